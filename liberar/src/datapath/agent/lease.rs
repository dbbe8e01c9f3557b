//! The agent's lease server: the only way a job gets a slot's kernel memory.
//!
//! The pinned datapath gives group members the program (to inject) and
//! read-only counters; the arrays of maps that hold each slot's state are
//! root's. A job that holds a slot's lock file (flock, as before) connects
//! to `lease.sock` in the agent's run directory and asks for the slot; the
//! server checks that the asking process holds that lock, creates the
//! slot's inner maps afresh (zeroed: nothing of an earlier job survives),
//! installs them where the program finds them, and hands their fds to the
//! job over the socket (SCM_RIGHTS). Nobody else ever gets those fds (but
//! the job's own ranks on the host: datapath/node/slots.rs). When
//! the connection closes — the ring is done, or the job died, kill -9
//! included — the server takes the maps out again, so the kernel frees them
//! once the job's own fds are gone.
//!
//! Protocol, one line per connection: `lease <slot>` → `ok` with the five
//! fds (in `slot::OUTER_MAPS` order), then silence until the client
//! closes; or `refused <why>`.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use parking_lot::Mutex;
use sendfd::SendWithFd;

use super::{lock_holders, open_pin, AgentInfo, AgentPaths};
use crate::datapath::kernel::slot::{self, SlotMaps};
use crate::datapath::wire;

const PID_FILE: &str = "lease.pid";

/// The server's pid file.
pub fn pid_file(paths: &AgentPaths) -> std::path::PathBuf {
    paths.run_dir.join(PID_FILE)
}

/// Runs the lease server of the agent at `paths` until killed (root).
pub fn serve(paths: &AgentPaths) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    ensure!(
        unsafe { libc::geteuid() } == 0,
        "the lease server needs root"
    );
    let info = AgentInfo::read(paths).context("reading agent.info")?;
    let mut outers = Vec::new();
    for name in slot::OUTER_MAPS {
        outers.push(
            open_pin(&paths.pin(name), false)
                .with_context(|| format!("opening {}", paths.pin(name).display()))?,
        );
    }
    let outers: Arc<[OwnedFd]> = outers.into();
    let socket = paths.lease_socket();
    let _ = std::fs::remove_file(&socket);
    let listener =
        UnixListener::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
    super::set_owner_mode(&socket, info.gid, if info.gid == 0 { 0o600 } else { 0o660 })?;
    std::fs::write(pid_file(paths), format!("{}\n", std::process::id()))
        .context("writing the pid file")?;
    let leased = Arc::new(Leases::default());
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let (outers, leased, paths) = (outers.clone(), leased.clone(), paths.clone());
        let geometry = (info.chunk_bytes, info.chunks_per_slot);
        std::thread::spawn(move || {
            if let Err(e) = serve_one(conn, &outers, &leased, &paths, geometry) {
                log::info!("lease: {e:#}");
            }
        });
    }
    Ok(())
}

/// One lease, start to end.
fn serve_one(
    conn: UnixStream,
    outers: &[OwnedFd],
    leased: &Leases,
    paths: &AgentPaths,
    (chunk_bytes, chunks_per_slot): (u32, u32),
) -> Result<()> {
    let mut line = String::new();
    BufReader::new((&conn).take(64))
        .read_line(&mut line)
        .context("reading the request")?;
    let refuse = |why: String| -> Result<()> {
        let _ = (&conn).write_all(format!("refused {why}\n").as_bytes());
        bail!("refused: {why}")
    };
    let Some(slot) = line
        .trim()
        .strip_prefix("lease ")
        .and_then(|s| s.parse::<u32>().ok())
        .filter(|s| *s < wire::ERAR_MAX_SLOTS)
    else {
        return refuse(format!("bad request {:?}", line.trim()));
    };
    let pid = peer_pid(&conn)?;
    if !lock_holders(&paths.slot_lock(slot)).contains(&pid) {
        return refuse(format!("pid {pid} does not hold slot {slot}'s lock"));
    }
    let outer_fds: [BorrowedFd<'_>; 5] = std::array::from_fn(|i| outers[i].as_fd());
    let fds = {
        let mut busy = leased.busy.lock();
        // The previous holder let go of the lock just before its lease
        // (or died): its connection's end is being handled right now.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while busy[slot as usize] {
            if leased.released.wait_until(&mut busy, deadline).timed_out() {
                return refuse(format!(
                    "slot {slot} is still leased to its previous holder"
                ));
            }
        }
        let fds = SlotMaps::create(chunk_bytes, chunks_per_slot)?;
        slot::install(outer_fds, slot, fds.each_ref().map(|f| f.as_fd()))?;
        busy[slot as usize] = true;
        fds
    };
    let raw = fds.each_ref().map(|f| f.as_raw_fd());
    let sent = conn.send_with_fd(b"ok\n", &raw);
    drop(fds); // the job's copies (and the program's) keep them alive
    if sent.is_ok() {
        // Until the job closes its end (or dies).
        let mut sink = [0u8; 16];
        while matches!((&conn).read(&mut sink), Ok(n) if n > 0) {}
    }
    slot::uninstall(outer_fds, slot);
    leased.busy.lock()[slot as usize] = false;
    leased.released.notify_all();
    sent.map(|_| ()).context("sending the lease")
}

/// Which slots are leased; `released` is signalled when one is given back.
#[derive(Default)]
struct Leases {
    busy: Mutex<[bool; wire::ERAR_MAX_SLOTS as usize]>,
    released: parking_lot::Condvar,
}

fn peer_pid(conn: &UnixStream) -> Result<u32> {
    let pid = crate::datapath::peer::peer_pid(conn).context("SO_PEERCRED")?;
    Ok(pid as u32)
}

/// A job's side, kept with the contract it follows.
pub use crate::datapath::contract::request_lease as request;
