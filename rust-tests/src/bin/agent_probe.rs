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

use anyhow::{Context, Result};
use liberar::datapath::agent::{self, lease, AgentPaths, ALL_PINS};
use liberar::datapath::kernel::slot::SlotMaps;

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
            let info = std::fs::read_to_string(paths.info_file())
                .map(|t| agent::AgentInfo::parse(&t))
                .context("reading agent.info")?;
            let maps = SlotMaps::map(fds, info.chunk_bytes, info.chunks_per_slot)
                .context("mapping the leased slot")?;
            let len = info.chunk_bytes as usize * info.chunks_per_slot as usize;
            // SAFETY: the slot buffer mapping holds len bytes; nothing else
            // writes it (the slot is not armed).
            let zero = unsafe { std::slice::from_raw_parts(maps.buf(), len) }
                .iter()
                .all(|b| *b == 0);
            println!("lease-locked {locked} ok zero={zero}");
        }
        Err(e) => println!("lease-locked {locked} refused {e:#}"),
    }
    Ok(())
}
