//! The node agent: `erarctl agent start` (run by root or systemd) loads this
//! host's datapath once, attaches it to the MPI interface with a bpf_link
//! and pins the link, the program and the maps with group permissions, so
//! that jobs of users in that group use the datapath unprivileged: they
//! open the pinned objects (BPF_OBJ_GET), mmap the maps and inject with
//! BPF_PROG_RUN, none of which needs a capability once the file permissions
//! allow it (see "Privilege" in docs/datapath.md for what was measured).
//!
//! What it promises jobs (where it pins what, its locks and `agent.info`)
//! is [`super::contract`]; this file is the daemon's side: start, stop,
//! status, and the lease server ([`lease`]).

use std::ffi::CString;
use std::fs::File;
use std::io::{ErrorKind, Write as _};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, ensure, Context, Result};

use super::kernel::{check_chunk_bytes, chunk_bytes_for_mtu, HostDatapath, LINEAR_MTU};
use super::wire;

pub mod lease;

// The contract's and the queries' items under the agent's name too, as the
// agent's users have always named them.
pub use super::bpfobj::*;
pub use super::contract::*;

/// Mounts a bpffs at `path` unless one is there. `may_mount`: this process
/// is in the mount namespace jobs see. Under `ip netns exec` (a named
/// network namespace the agent did not enter itself) it is not: that is a
/// private mount namespace, and a bpffs mounted there would vanish with the
/// agent, taking the pins along (measured).
fn ensure_bpffs(path: &Path, may_mount: bool) -> Result<()> {
    if is_bpffs(path) {
        return Ok(());
    }
    ensure!(
        may_mount,
        "{} is not a bpffs, and this process probably runs in the private mount namespace \
         of `ip netns exec`, where a mount would vanish with it, taking the pins along: use \
         `erarctl agent start --netns NAME ...` instead, or mount it first in the host's \
         namespace: mount -t bpf bpf {}",
        path.display(),
        path.display()
    );
    std::fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))?;
    let src = CString::new("bpf")?;
    let dst = CString::new(path.as_os_str().as_encoded_bytes())?;
    let opts = CString::new("mode=0755")?;
    // SAFETY: valid C strings; a plain mount(2).
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            src.as_ptr(),
            0,
            opts.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("mount -t bpf bpf {}", path.display()));
    }
    Ok(())
}

fn set_owner_mode(path: &Path, gid: u32, mode: u32) -> Result<()> {
    std::os::unix::fs::chown(path, Some(0), Some(gid))
        .with_context(|| format!("chown root:{gid} {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", path.display()))
}

fn mkdir_public(path: &Path) -> Result<()> {
    std::fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod 755 {}", path.display()))
}

/// What `erarctl agent start` is asked to do.
#[derive(Debug, Clone)]
pub struct StartOptions {
    pub ifname: String,
    /// Group whose members may use the datapath (`None`: root only).
    pub group: Option<String>,
    pub chunk_bytes: ChunkBytes,
    pub chunks_per_slot: u32,
    /// This process entered the network namespace itself ([`enter_netns`]),
    /// so its mount namespace is the caller's, where jobs look.
    pub entered_netns: bool,
}

/// The payload bytes per frame of an agent's datapath.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkBytes {
    /// Derived from the interface's MTU with the rings' own rule.
    Auto,
    /// As given (every host of a ring must use the same).
    Fixed(u32),
}

/// What [`start`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartOutcome {
    Started(AgentInfo),
    /// The same datapath was already pinned and attached.
    AlreadyRunning(AgentInfo),
}

/// One agent's state, as `erarctl agent status` shows it.
#[derive(Debug, Clone)]
pub struct AgentStatus {
    pub paths: AgentPaths,
    pub info: Option<AgentInfo>,
    /// Pins present in the pin directory.
    pub pins: Vec<String>,
    /// The pinned link's interface index (0: the link is defunct, e.g. its
    /// interface is gone) and program id, if the link could be read.
    pub link: Option<(u32, u32)>,
    /// The pinned program's id.
    pub prog_id: Option<u32>,
    /// Per slot: pids holding its lock.
    pub slots: Vec<Vec<u32>>,
    /// The lease server's pid, if it runs.
    pub lease_server: Option<u32>,
}

impl AgentStatus {
    /// Complete, attached, and the program is the pinned one.
    pub fn healthy(&self) -> bool {
        ALL_PINS.iter().all(|p| self.pins.iter().any(|q| q == p))
            && self.info.is_some()
            && self.lease_server.is_some()
            && matches!((self.link, self.prog_id), (Some((ifx, lp)), Some(p)) if ifx != 0 && lp == p)
    }

    pub fn render(&self) -> String {
        let mut s = format!("agent {}: ", self.paths.where_());
        if self.healthy() {
            s += "running";
        } else if self.pins.is_empty() {
            s += "not running";
        } else {
            s += "BROKEN (stale or incomplete: `erarctl agent start` replaces it, `stop` removes it)";
        }
        s += &format!("\n  pins:  {}", self.paths.pin_dir.display());
        if !self.pins.is_empty() {
            s += &format!(" ({})", self.pins.join(" "));
        }
        s += &format!("\n  locks: {}", self.paths.run_dir.display());
        if let Some(i) = &self.info {
            s += &format!(
                "\n  group {} (gid {}), chunk_bytes {}, chunks_per_slot {}, ifindex {}, prog id {}, build {}{}",
                i.group,
                i.gid,
                i.chunk_bytes,
                i.chunks_per_slot,
                i.ifindex,
                i.prog_id,
                i.fingerprint,
                if i.fingerprint == fingerprint() { "" } else { " (NOT this build's)" }
            );
        }
        if let Some((ifx, pid)) = self.link {
            s += &format!("\n  link: ifindex {ifx}, prog id {pid}");
        }
        s += &match self.lease_server {
            Some(pid) => format!("\n  lease server: pid {pid}"),
            None => "\n  lease server: not running".to_owned(),
        };
        if !self.slots.is_empty() {
            let slots: Vec<String> = self
                .slots
                .iter()
                .enumerate()
                .map(|(n, h)| {
                    if h.is_empty() {
                        format!("{n}:free")
                    } else {
                        format!(
                            "{n}:pid {}",
                            h.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
                        )
                    }
                })
                .collect();
            s += &format!("\n  slots: {}", slots.join(" "));
        }
        s
    }
}

/// The state of the agent at `paths` (as root: reads the link pin too).
pub fn status(paths: &AgentPaths) -> AgentStatus {
    let mut pins: Vec<String> = std::fs::read_dir(&paths.pin_dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    pins.sort();
    // Links take no BPF_F_RDONLY (EINVAL).
    let link = open_pin(&paths.pin(PIN_LINK), false)
        .ok()
        .and_then(|fd| xdp_link_info(&fd).ok());
    let prog_id = open_pin(&paths.pin(PIN_PROG), true)
        .ok()
        .and_then(|fd| prog_id(&fd).ok());
    let info = AgentInfo::read(paths).ok();
    let slots = if paths.run_dir.is_dir() {
        (0..wire::ERAR_MAX_SLOTS)
            .map(|s| lock_holders(&paths.slot_lock(s)))
            .collect()
    } else {
        Vec::new()
    };
    AgentStatus {
        paths: paths.clone(),
        info,
        pins,
        link,
        prog_id,
        slots,
        lease_server: lease_server_pid(paths),
    }
}

/// Every agent directory on this machine (both layouts).
pub fn all_agents() -> Vec<AgentPaths> {
    let mut out = Vec::new();
    let list = |dir: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.path().is_dir())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| !n.contains("%tmp"))
                    .map(|n| from_bpffs_name(&n))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    for ifname in list(Path::new("/sys/fs/bpf/liberar")) {
        if let Ok(p) = AgentPaths::for_netns(None, &ifname) {
            out.push(p);
        }
    }
    for ns in list(Path::new("/run/liberar/bpffs")) {
        for ifname in list(&Path::new("/run/liberar/bpffs").join(bpffs_name(&ns))) {
            if let Ok(p) = AgentPaths::for_netns(Some(&ns), &ifname) {
                out.push(p);
            }
        }
    }
    out
}

/// Removes a pin directory (unpinning everything in it; the kernel frees
/// each object once no process holds it any more).
fn remove_pin_dir(dir: &Path) -> Result<bool> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    for e in entries.flatten() {
        std::fs::remove_file(e.path())
            .with_context(|| format!("unpinning {}", e.path().display()))?;
    }
    std::fs::remove_dir(dir).with_context(|| format!("removing {}", dir.display()))?;
    Ok(true)
}

/// Name of a temporary pin directory (`<if>%tmp<pid>`: `%t` never occurs
/// in an escaped name).
fn tmp_dir_name(paths: &AgentPaths, pid: u32) -> String {
    format!("{}%tmp{pid}", bpffs_name(&paths.ifname))
}

/// Temporary pin directories of starts that never finished.
fn stale_tmp_dirs(paths: &AgentPaths) -> Vec<PathBuf> {
    let Some(parent) = paths.pin_dir.parent() else {
        return Vec::new();
    };
    let prefix = format!("{}%tmp", bpffs_name(&paths.ifname));
    std::fs::read_dir(parent)
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.starts_with(&prefix))
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Unpins everything of the agent at `paths` and removes its lock files.
/// Jobs still running keep the objects they hold until they exit; the XDP
/// program is detached at once (the link pin was its last reference).
/// Returns whether there was anything to remove.
pub fn stop(paths: &AgentPaths) -> Result<bool> {
    let mut removed = stop_lease_server(paths);
    removed |= remove_pin_dir(&paths.pin_dir)?;
    for tmp in stale_tmp_dirs(paths) {
        removed |= remove_pin_dir(&tmp)?;
    }
    match std::fs::remove_dir_all(&paths.run_dir) {
        Ok(()) => removed = true,
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", paths.run_dir.display())),
    }
    // A named namespace's own directories, once empty (remove_dir refuses
    // otherwise).
    if paths.netns.is_some() {
        for dir in [paths.pin_dir.parent(), paths.run_dir.parent()]
            .into_iter()
            .flatten()
        {
            let _ = std::fs::remove_dir(dir);
        }
    }
    Ok(removed)
}

/// Loads, attaches and pins the datapath of `opts.ifname` in this network
/// namespace (see the module docs). Idempotent: an agent already running
/// with the same parameters and this build is left alone; a stale or
/// different one (dead link, other build, other group or chunk size) is
/// replaced — jobs using the old one fall back to MPI.
pub fn start(opts: &StartOptions) -> Result<StartOutcome> {
    // SAFETY: geteuid has no preconditions.
    ensure!(
        unsafe { libc::geteuid() } == 0,
        "the agent needs root (loading and attaching XDP, pinning)"
    );
    let paths = AgentPaths::current(&opts.ifname)?;
    let ifindex = super::iface::if_index(&opts.ifname)?;
    let mtu = if_mtu(&opts.ifname)?;
    // The chunk size a ring uses when every rank's interface has this MTU.
    let chunk_bytes = match opts.chunk_bytes {
        ChunkBytes::Fixed(c) => c,
        // The jobs the agent serves are unprivileged: no AF_PACKET socket,
        // so no jumbo frames (kernel/raw.rs): chunks of one live frame.
        ChunkBytes::Auto => chunk_bytes_for_mtu(mtu.min(LINEAR_MTU)),
    };
    check_chunk_bytes(chunk_bytes)
        .with_context(|| format!("chunk size {chunk_bytes} (MTU {mtu}) is not usable"))?;
    let (gid, group) = match &opts.group {
        Some(g) => (group_id(g)?, g.clone()),
        None => (0, "root".to_owned()),
    };
    let want = AgentInfo {
        iface: opts.ifname.clone(),
        netns: paths.netns.clone().unwrap_or_else(|| "-".into()),
        ifindex,
        group: group.clone(),
        gid,
        chunk_bytes,
        chunks_per_slot: opts.chunks_per_slot,
        prog_id: 0,
        fingerprint: fingerprint(),
        started: 0,
    };

    let current = status(&paths);
    if current.healthy() {
        if let Some(info) = &current.info {
            let same = AgentInfo {
                prog_id: info.prog_id,
                started: info.started,
                ..want.clone()
            };
            if *info == same && current.link.map(|l| l.0) == Some(ifindex) {
                return Ok(StartOutcome::AlreadyRunning(info.clone()));
            }
        }
    }
    if !current.pins.is_empty() || paths.run_dir.exists() || !stale_tmp_dirs(&paths).is_empty() {
        log::info!("replacing the agent at {}", paths.pin_dir.display());
        stop(&paths)?;
    }

    ensure_bpffs(&paths.bpffs, opts.entered_netns || paths.netns.is_none())?;
    let parent = paths
        .pin_dir
        .parent()
        .ok_or_else(|| anyhow!("{} has no parent", paths.pin_dir.display()))?;
    mkdir_public(parent)?;
    // Pins go to a temporary directory, renamed into place once complete:
    // a job never sees half an agent.
    let tmp = parent.join(tmp_dir_name(&paths, std::process::id()));
    let _ = remove_pin_dir(&tmp);
    std::fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let result = (|| -> Result<AgentInfo> {
        let dir_mode = if opts.group.is_some() { 0o750 } else { 0o700 };
        set_owner_mode(&tmp, gid, dir_mode)?;
        let pinned =
            HostDatapath::load_and_pin(&opts.ifname, chunk_bytes, opts.chunks_per_slot, &tmp)?;
        let (rw, ro) = if opts.group.is_some() {
            (0o660, 0o640)
        } else {
            (0o600, 0o600)
        };
        set_owner_mode(&tmp.join(PIN_PROG), gid, rw)?;
        // Every slot's state: root's (the lease server's) alone.
        for m in OUTER_MAPS {
            set_owner_mode(&tmp.join(m), 0, 0o600)?;
        }
        set_owner_mode(&tmp.join(PIN_STATS), gid, ro)?;
        set_owner_mode(&tmp.join(PIN_RODATA), gid, ro)?;
        // Any holder of a link fd can detach it: root only.
        set_owner_mode(&tmp.join(PIN_LINK), 0, 0o600)?;

        // Lock files and info first, then the pins appear.
        let run_parent = paths
            .run_dir
            .parent()
            .ok_or_else(|| anyhow!("{} has no parent", paths.run_dir.display()))?;
        mkdir_public(run_parent)?;
        std::fs::create_dir(&paths.run_dir)
            .with_context(|| format!("creating {}", paths.run_dir.display()))?;
        // Not group-writable: members cannot remove or replace a lock file
        // (which would let two processes "hold" one slot).
        set_owner_mode(&paths.run_dir, gid, dir_mode)?;
        for s in 0..wire::ERAR_MAX_SLOTS {
            let p = paths.slot_lock(s);
            File::create(&p).with_context(|| format!("creating {}", p.display()))?;
            set_owner_mode(&p, gid, ro)?;
        }
        let info = AgentInfo {
            prog_id: pinned.prog_id,
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            ..want.clone()
        };
        let info_tmp = paths.run_dir.join(".agent.info.tmp");
        let mut f =
            File::create(&info_tmp).with_context(|| format!("creating {}", info_tmp.display()))?;
        f.write_all(info.render().as_bytes())?;
        drop(f);
        set_owner_mode(&info_tmp, gid, ro)?;
        std::fs::rename(&info_tmp, paths.info_file())
            .with_context(|| format!("creating {}", paths.info_file().display()))?;
        std::fs::rename(&tmp, &paths.pin_dir).with_context(|| {
            format!("renaming {} to {}", tmp.display(), paths.pin_dir.display())
        })?;
        spawn_lease_server(&paths)?;
        Ok(info)
    })();
    match result {
        Ok(info) => Ok(StartOutcome::Started(info)),
        Err(e) => {
            let _ = remove_pin_dir(&tmp);
            let _ = std::fs::remove_dir_all(&paths.run_dir);
            Err(e)
        }
    }
}

/// Starts the lease server (`erarctl agent serve`, this executable) for the
/// agent at `paths`, detached in its own session, and waits until it
/// listens. It runs in this process's network namespace.
fn spawn_lease_server(paths: &AgentPaths) -> Result<()> {
    use std::os::unix::process::CommandExt as _;
    let exe = std::env::current_exe().context("locating erarctl")?;
    let log = File::create(paths.run_dir.join("lease.log")).context("creating lease.log")?;
    let mut cmd = std::process::Command::new(&exe);
    cmd.args(["agent", "serve", "--iface", &paths.ifname])
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: setsid is async-signal-safe; nothing else runs in the child.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {} agent serve", exe.display()))?;
    let socket = paths.lease_socket();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if lease::pid_file(paths).exists() && socket.exists() {
            // Reaped by init once we exit (it is in its own session).
            std::mem::forget(child);
            return Ok(());
        }
        if let Ok(Some(st)) = child.try_wait() {
            let log = std::fs::read_to_string(paths.run_dir.join("lease.log")).unwrap_or_default();
            bail!("the lease server exited at once ({st}): {}", log.trim());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    bail!("the lease server did not start listening within 5 s")
}

/// The running lease server's pid, if any.
pub fn lease_server_pid(paths: &AgentPaths) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(lease::pid_file(paths))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let serving = cmdline.split(|b| *b == 0).any(|arg| arg == b"serve");
    serving.then_some(pid)
}

/// Stops the lease server; whether one ran. Leases end with it (the jobs'
/// fds stay valid, but the datapath goes away with the pins anyway).
fn stop_lease_server(paths: &AgentPaths) -> bool {
    let Some(pid) = lease_server_pid(paths) else {
        return false;
    };
    // SAFETY: plain kill(2).
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while Path::new(&format!("/proc/{pid}")).exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    true
}
