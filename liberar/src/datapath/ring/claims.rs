//! This process's claims on its host's datapath: the one datapath it uses
//! (the node agent's, else its own or another job's, shared by all its
//! rings) and the slots its rings hold on it, with their lock files and
//! leases, taken by every rank together or not at all.

use super::{retry_quiet, CHUNKS_PER_SLOT};
use crate::config::Config;
use crate::datapath::contract::{self, AgentPaths};
use crate::datapath::kernel::{HostDatapath, InjectPacing};
use crate::datapath::{wire, Comm, DatapathError};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// This process's attachment to its interface, shared by all its rings.
static HOST: Mutex<Option<Arc<HostDatapath>>> = Mutex::new(None);
/// Bitmap of this host's slots in use by some ring of this process.
static SLOTS_IN_USE: Mutex<u32> = Mutex::new(0);
/// What this process holds for each slot in SLOTS_IN_USE, on a datapath it
/// shares with other processes: the lock file (flock held: other processes
/// see the slot as taken until the ring ends or this process dies) and, on
/// the node agent's, the lease of the slot's maps.
static SLOT_CLAIMS: Mutex<[Option<SlotClaim>; wire::ERAR_MAX_SLOTS as usize]> =
    Mutex::new([const { None }; wire::ERAR_MAX_SLOTS as usize]);

struct SlotClaim {
    _lock: std::fs::File,
    _lease: Option<std::os::unix::net::UnixStream>,
}

/// This process's datapath on `ifname`, set up once and shared by all its
/// rings: the node agent's pinned datapath if there is one this process may
/// use, else its own (loaded and attached here: needs CAP_BPF and
/// CAP_NET_ADMIN). When neither works, one line on stderr says why (once
/// per process) and the caller declines; every rank sees the decline.
pub(super) fn host_for(ifname: &str, chunk_bytes: u32) -> Result<Arc<HostDatapath>, String> {
    let mut host = HOST.lock();
    if let Some(h) = host.as_ref() {
        if h.ifname() == ifname && h.chunk_bytes() == chunk_bytes {
            return Ok(h.clone());
        }
        return Err(format!(
            "this process's datapath is on {} with {}-byte chunks, not {ifname} with {chunk_bytes}",
            h.ifname(),
            h.chunk_bytes()
        ));
    }
    let h = match open_or_attach(ifname, chunk_bytes) {
        Ok(h) => Arc::new(h),
        Err(why) => {
            warn_no_datapath(ifname, &why);
            return Err(why);
        }
    };
    // The injection's own NACKs (while its window is shut) every four NACK
    // periods: see InjectPacing::nack_after.
    let nack_us = Config::get().nack_us;
    h.set_inject_pacing(InjectPacing {
        quiet: retry_quiet(),
        nack_after: (nack_us > 0).then(|| Duration::from_micros(4 * nack_us)),
        ..h.inject_pacing()
    });
    *host = Some(h.clone());
    Ok(h)
}

/// The agent's datapath, else our own; Err: why neither, for the warning.
fn open_or_attach(ifname: &str, chunk_bytes: u32) -> Result<HostDatapath, String> {
    let agent_why = match HostDatapath::open_pinned(ifname) {
        Ok(h) if h.chunk_bytes() == chunk_bytes && h.chunks_per_slot() >= CHUNKS_PER_SLOT => {
            return Ok(h)
        }
        Ok(h) => format!(
            "the liberar agent's datapath ({}) has {}-byte chunks and {} per slot, this ring \
             needs {chunk_bytes} and {CHUNKS_PER_SLOT} (start every host's agent with \
             --chunk-bytes {chunk_bytes})",
            h.agent_paths()
                .map(|p| p.pin_dir.display().to_string())
                .unwrap_or_default(),
            h.chunk_bytes(),
            h.chunks_per_slot()
        ),
        Err(e) => e.to_string(),
    };
    if !contract::can_attach() {
        return Err(format!("{agent_why} and not privileged"));
    }
    let attach_why = match HostDatapath::attach(ifname, chunk_bytes, CHUNKS_PER_SLOT) {
        Ok(h) => return Ok(h),
        Err(e) => format!("{e:#}"),
    };
    // Taken by another job's erar_xdp (no agent): share it.
    match HostDatapath::adopt(ifname) {
        Ok(h) if h.chunk_bytes() == chunk_bytes && h.chunks_per_slot() >= CHUNKS_PER_SLOT => Ok(h),
        Ok(h) => Err(format!(
            "{agent_why}; attaching one failed ({attach_why}); the erar_xdp another process \
             attached has {}-byte chunks and {} per slot, this ring needs {chunk_bytes} and \
             {CHUNKS_PER_SLOT}",
            h.chunk_bytes(),
            h.chunks_per_slot()
        )),
        Err(e) => Err(format!(
            "{agent_why}; attaching one failed ({attach_why}); sharing the one on {ifname} \
             failed: {e:#}"
        )),
    }
}

/// The one line a process prints when it has no datapath.
fn warn_no_datapath(ifname: &str, why: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    let place = AgentPaths::current(ifname)
        .map(|p| p.where_())
        .unwrap_or_else(|_| ifname.to_owned());
    let why = why.replace('\n', " ");
    let line = format!("liberar: no datapath on {place}: {why}; MPI_Allreduce/MPI_Bcast use MPI\n");
    // One write(2): ranks sharing the launcher's stderr do not interleave.
    use std::io::Write as _;
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Slots this process could give a new ring: not used by another of its
/// rings and not locked by another process sharing the datapath (the
/// agent's, or ours adopted by another job; a probe: the lock is taken for
/// real by [`claim_slot`]).
pub(super) fn free_slots(host: &HostDatapath) -> u32 {
    let in_use = *SLOTS_IN_USE.lock();
    let mut free = 0;
    for slot in 0..wire::ERAR_MAX_SLOTS {
        let unlocked = host
            .slot_lock_path(slot)
            .is_none_or(|p| matches!(contract::try_lock_file(&p), Ok(Some(_))));
        if in_use & (1 << slot) == 0 && unlocked {
            free |= 1 << slot;
        }
    }
    free
}

/// Takes `slot` for a ring of this process, with its lock file; false if
/// it is taken.
fn claim_slot(host: &HostDatapath, slot: u32) -> bool {
    let mut in_use = SLOTS_IN_USE.lock();
    if *in_use & (1 << slot) != 0 {
        return false;
    }
    if let Some(path) = host.slot_lock_path(slot) {
        let lock = match contract::try_lock_file(&path) {
            Ok(Some(f)) => f,
            Ok(None) => return false,
            Err(e) => {
                log::debug!("liberar: slot {slot} lock {}: {e}", path.display());
                return false;
            }
        };
        let lease = match host.lease(slot) {
            Ok(lease) => lease,
            Err(e) => {
                log::debug!("liberar: slot {slot}: {e:#}");
                return false;
            }
        };
        SLOT_CLAIMS.lock()[slot as usize] = Some(SlotClaim {
            _lock: lock,
            _lease: lease,
        });
    } else if let Err(e) = host.use_slot(slot) {
        // A program of this process's own that no other process can share:
        // no lock to take, but the slot's maps are made here all the same.
        log::debug!("liberar: slot {slot}: {e:#}");
        return false;
    }
    *in_use |= 1 << slot;
    true
}

/// Gives `slot` back: its leased maps, then the lease and the lock.
pub(super) fn release_slot(host: &HostDatapath, slot: u32) {
    let mut in_use = SLOTS_IN_USE.lock();
    host.release(slot);
    SLOT_CLAIMS.lock()[slot as usize] = None;
    *in_use &= !(1 << slot);
}

/// Every rank takes the two lowest slots free on every host (a ring's two
/// generations); if another process took one of them on some host in the
/// meantime, all give back what they took and try the next. Every rank sees
/// the same `common` and verdicts, so all end on the same slots, or all
/// decline.
pub(super) fn claim_common_slots(
    comm: &dyn Comm,
    host: &HostDatapath,
    mut common: u32,
) -> Result<[u32; 2], DatapathError> {
    while common.count_ones() >= 2 {
        let first = common.trailing_zeros();
        let pair = [first, (common & !(1 << first)).trailing_zeros()];
        let mine = pair.map(|slot| claim_slot(host, slot));
        let mut verdict = mine.map(|took| i32::from(!took));
        let agreed = comm.allreduce_max_i32(&mut verdict);
        if agreed.is_ok() && verdict == [0, 0] {
            return Ok(pair);
        }
        for (slot, took) in pair.into_iter().zip(mine) {
            if took {
                release_slot(host, slot);
            }
        }
        agreed?;
        for (slot, lost) in pair.into_iter().zip(verdict) {
            if lost != 0 {
                common &= !(1 << slot);
            }
        }
    }
    Err(DatapathError::Declined(
        "no two datapath slots free on every host".into(),
    ))
}
