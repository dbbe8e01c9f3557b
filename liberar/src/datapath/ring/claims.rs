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
    let cfg = Config::get();
    h.set_inject_pacing(InjectPacing {
        quiet: retry_quiet(),
        nack_after: (cfg.nack_us > 0).then(|| Duration::from_micros(4 * cfg.nack_us)),
        circulate: cfg.circulate,
        ..h.inject_pacing()
    });
    *host = Some(h.clone());
    Ok(h)
}

/// Forgets this process's datapath if `host` is it and nothing else holds
/// it (no other ring), so that it detaches once `host` drops: a ring that
/// declined at setup leaves the interface as it found it (an XDP program
/// on a veth turns TSO off on its peer, which slows MPI's TCP).
pub(super) fn release_host(host: Arc<HostDatapath>) {
    let mut cached = HOST.lock();
    if cached.as_ref().is_some_and(|h| Arc::ptr_eq(h, &host)) && Arc::strong_count(&host) == 2 {
        *cached = None;
    }
}

/// The agent's datapath, else our own; Err: why neither, for the warning.
fn open_or_attach(ifname: &str, chunk_bytes: u32) -> Result<HostDatapath, String> {
    // A datapath this ring can use: its chunks, and enough of them a slot.
    let fits =
        |h: &HostDatapath| h.chunk_bytes() == chunk_bytes && h.chunks_per_slot() >= CHUNKS_PER_SLOT;
    let agent_why = match HostDatapath::open_pinned(ifname) {
        Ok(h) if fits(&h) => return Ok(h),
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
    // Another process attached this build's erar_xdp already (a rank of
    // this host that leads another slice, another job): share it, rather
    // than load a program whose attach then fails (EBUSY, which libbpf
    // prints on stderr).
    if let Some(h) = HostDatapath::adopt(ifname).ok().filter(fits) {
        return Ok(h);
    }
    let attach_why = match HostDatapath::attach(ifname, chunk_bytes, CHUNKS_PER_SLOT) {
        Ok(h) => return Ok(h),
        Err(e) => format!("{e:#}"),
    };
    // Taken meanwhile by another process's erar_xdp (no agent): share it.
    match HostDatapath::adopt(ifname) {
        Ok(h) if fits(&h) => Ok(h),
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

/// `line` on stderr unless `warned` says it was printed already: one line
/// per process, in one write(2), so that ranks sharing the launcher's
/// stderr do not interleave.
pub(super) fn warn_once(warned: &AtomicBool, line: &str) {
    if warned.swap(true, Ordering::Relaxed) {
        return;
    }
    use std::io::Write as _;
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// The one line a process prints when it has no datapath.
fn warn_no_datapath(ifname: &str, why: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if WARNED.load(Ordering::Relaxed) {
        return;
    }
    let place = AgentPaths::current(ifname)
        .map(|p| p.where_())
        .unwrap_or_else(|_| ifname.to_owned());
    let why = why.replace('\n', " ");
    let line = format!("liberar: no datapath on {place}: {why}; MPI_Allreduce/MPI_Bcast use MPI\n");
    warn_once(&WARNED, &line);
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

/// How many pairs a ring's ranks try before declining. Two jobs that set
/// up at once used to try the same pairs in lockstep: each won a pair on
/// some hosts, both gave it back, both struck it off, and so on through
/// every slot, so both declined (4 of 20 runs of
/// `two_concurrent_jobs_are_both_accelerated`). Now each job starts at its
/// own random place and, after a lost pair, asks the hosts what is free
/// rather than striking it off: 0 of 30 runs declined. A try collides
/// again only if the two jobs' places are within one slot of each other
/// (3 in 8 with every slot free), so 16 tries fail together about once in
/// 6 million.
const CLAIM_TRIES: u32 = 16;

/// Every rank takes two slots free on every host (a ring's two
/// generations): the first two of `common` from a place that `seed` (the
/// same on every rank, different for every job) and the try choose. If
/// another process took one of them on some host meanwhile, all give back
/// what they took, ask the hosts again which slots are free, and try again.
/// Every rank sees the same `common`, place and verdicts, so all end on
/// the same slots, or all decline.
pub(super) fn claim_common_slots(
    comm: &dyn Comm,
    host: &HostDatapath,
    mut common: u32,
    seed: u32,
) -> Result<[u32; 2], DatapathError> {
    for try_ in 0..CLAIM_TRIES {
        let Some(pair) = pair_from(common, start_of(seed, try_)) else {
            break;
        };
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
        common = free_everywhere(comm, host)?;
    }
    Err(DatapathError::Declined(
        "no two datapath slots free on every host".into(),
    ))
}

/// The first two slots of `common` from `start` on (wrapping).
fn pair_from(common: u32, start: u32) -> Option<[u32; 2]> {
    let mut free = (0..wire::ERAR_MAX_SLOTS)
        .map(|i| (start + i) % wire::ERAR_MAX_SLOTS)
        .filter(|slot| common & (1 << slot) != 0);
    Some([free.next()?, free.next()?])
}

/// Where try `try_` of the job with `seed` starts looking for a pair.
fn start_of(seed: u32, try_: u32) -> u32 {
    // Fibonacci hashing: tries of one job and jobs of one try spread out.
    let h = (seed ^ try_.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x9e37_79b9);
    (h >> 16) % wire::ERAR_MAX_SLOTS
}

/// The slots free on every rank's host now.
fn free_everywhere(comm: &dyn Comm, host: &HostDatapath) -> Result<u32, DatapathError> {
    let free = free_slots(host);
    let mut taken = [0i32; wire::ERAR_MAX_SLOTS as usize];
    for (slot, t) in taken.iter_mut().enumerate() {
        *t = i32::from(free & (1 << slot) == 0);
    }
    comm.allreduce_max_i32(&mut taken)?;
    Ok(taken
        .iter()
        .enumerate()
        .filter(|(_, t)| **t == 0)
        .fold(0, |acc, (slot, _)| acc | 1 << slot))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_is_the_first_two_free_from_the_start_wrapping() {
        assert_eq!(pair_from(0xff, 0), Some([0, 1]));
        assert_eq!(pair_from(0xff, 7), Some([7, 0]));
        assert_eq!(pair_from(0b1010_0100, 6), Some([7, 2]));
        assert_eq!(pair_from(0b0001_0000, 3), None);
        assert_eq!(pair_from(0, 0), None);
    }

    #[test]
    fn jobs_and_tries_start_all_over_the_slots() {
        let mut seen = [0u32; wire::ERAR_MAX_SLOTS as usize];
        for seed in 0..4096u32 {
            seen[start_of(seed.wrapping_mul(0x2545_f491), 0) as usize] += 1;
        }
        // Each of 8 places within 25% of its share of 4096 seeds.
        assert!(seen.iter().all(|n| (384..=640).contains(n)), "{seen:?}");
        // One job's tries do not repeat one place.
        let starts: std::collections::BTreeSet<u32> =
            (0..CLAIM_TRIES).map(|t| start_of(7, t)).collect();
        assert!(starts.len() >= 4, "{starts:?}");
    }
}
