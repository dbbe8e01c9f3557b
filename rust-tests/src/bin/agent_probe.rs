//! What a group member's process can reach of the node agent's datapath
//! (rust-tests/tests/agent.rs runs it as an unprivileged member inside a
//! host of the test bed). One line per probe:
//!
//! * `pin NAME rw|ro ok|denied|error E` — opening each pin;
//! * `lease-unlocked SLOT ok|refused ...` — a lease without the slot's lock;
//! * `lease-locked SLOT ok zero=true|false|refused ...|busy` — a lease of
//!   a slot whose lock this process took, and whether the slot's buffer
//!   arrived zeroed.
//!
//! Usage: agent_probe IFNAME UNLOCKED_SLOT LOCKED_SLOT

use std::os::fd::AsRawFd;

use anyhow::{Context, Result};
use liberar::datapath::agent::{self, lease, AgentPaths, ALL_PINS};

fn main() {
    if let Err(e) = run() {
        eprintln!("agent_probe: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    anyhow::ensure!(
        a.len() == 3,
        "usage: agent_probe IFNAME UNLOCKED_SLOT LOCKED_SLOT"
    );
    let paths = AgentPaths::current(&a[0])?;
    let unlocked: u32 = a[1].parse().context("UNLOCKED_SLOT")?;
    let locked: u32 = a[2].parse().context("LOCKED_SLOT")?;

    for name in ALL_PINS {
        for read_only in [false, true] {
            let what = match agent::open_pin(&paths.pin(name), read_only) {
                Ok(_) => "ok".to_owned(),
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => "denied".into(),
                Err(e) => format!("error {e}"),
            };
            println!("pin {name} {} {what}", if read_only { "ro" } else { "rw" });
        }
    }

    match lease::request(&paths, unlocked) {
        Ok(_) => println!("lease-unlocked {unlocked} ok"),
        Err(e) => println!("lease-unlocked {unlocked} refused {e:#}"),
    }

    let Some(_lock) = agent::try_lock_slot(&paths, locked)? else {
        println!("lease-locked {locked} busy");
        return Ok(());
    };
    match lease::request(&paths, locked) {
        Ok((_conn, fds)) => {
            let len = std::fs::read_to_string(paths.info_file())
                .map(|t| agent::AgentInfo::parse(&t))
                .map(|i| i.chunk_bytes as usize * i.chunks_per_slot as usize)
                .context("reading agent.info")?;
            // SAFETY: a read-only shared mapping of the leased slot buffer.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    fds[0].as_raw_fd(),
                    0,
                )
            };
            anyhow::ensure!(
                p != libc::MAP_FAILED,
                "mmap: {}",
                std::io::Error::last_os_error()
            );
            // SAFETY: len bytes mapped above.
            let zero = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) }
                .iter()
                .all(|b| *b == 0);
            // SAFETY: unmapping what was mapped.
            unsafe { libc::munmap(p, len) };
            println!("lease-locked {locked} ok zero={zero}");
        }
        Err(e) => println!("lease-locked {locked} refused {e:#}"),
    }
    Ok(())
}
