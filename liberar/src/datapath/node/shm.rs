//! The shared memory of one host's ranks: a control page (a futex barrier,
//! each slice's outcome, the data segment's generation) and a data segment
//! (one input region per local rank and two output regions), both POSIX
//! shared memory unlinked as soon as every local rank has mapped them, so
//! that a `kill -9` leaves nothing behind.
//!
//! The barrier never times out by itself (a rank may reach a collective
//! late, as MPI allows): while it waits it watches the other local ranks'
//! pidfds, and a rank that died, or a peer that marked the group broken,
//! ends the wait with an error.

use crate::datapath::mapping::SharedMapping;
use crate::datapath::DatapathError;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Most slices a host's ranks lead at once (each one a ring, two slots).
pub const MAX_SLICES: usize = 8;

/// How long one futex wait lasts before the waiter looks at its peers
/// again and lets MPI progress (see `Comm::progress`): how fast a dead
/// local rank is noticed, and how long a peer may wait for this rank's
/// queued MPI sends.
const WATCH_PERIOD: Duration = Duration::from_millis(2);

/// Spins before a barrier waiter sleeps: a few microseconds, the time a
/// peer on another CPU takes to arrive when the call is balanced (4-8
/// ranks share 2 CPUs here, so a longer spin only steals their time).
const SPINS: u32 = 200;

/// The control page, shared by the host's ranks of one communicator.
#[repr(C)]
struct Ctl {
    /// Ranks arrived at the current barrier.
    arrived: AtomicU32,
    /// Barriers passed (the futex word).
    generation: AtomicU32,
    /// Set by a rank that left the group mid-call (an error or a panic):
    /// every later barrier fails.
    broken: AtomicU32,
    /// The data segment's generation and region size, as its creator (the
    /// first local rank) made it.
    data_gen: AtomicU32,
    region: AtomicU64,
    /// Each slice's outcome in the current step ([`SliceOutcome::word`]).
    status: [AtomicU32; MAX_SLICES],
    /// Each slice's byte ranges in the current step that MPI completes over
    /// the whole communicator (start, end pairs), and how many.
    left: [[AtomicU64; 2 * MAX_LEFT]; MAX_SLICES],
    left_count: [AtomicU32; MAX_SLICES],
}

/// Where a slice's result is once its leader is done with a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SliceOutcome {
    /// In the step's output region.
    Output,
    /// In the leader's slot buffer of this generation (node/slots.rs).
    Kept(usize),
    /// A float SUM's, as words in the leader's slot buffer of this
    /// generation, with its block steps and repairs in the step's output
    /// region (`codec::decode_kept`).
    Encoded(usize),
    Failed,
}

impl SliceOutcome {
    fn word(self) -> u32 {
        match self {
            SliceOutcome::Output => 0,
            SliceOutcome::Failed => 1,
            SliceOutcome::Kept(gen) => 2 + (gen & 1) as u32,
            SliceOutcome::Encoded(gen) => 4 + (gen & 1) as u32,
        }
    }

    fn of_word(w: u32) -> SliceOutcome {
        match w {
            0 => SliceOutcome::Output,
            2 | 3 => SliceOutcome::Kept(w as usize - 2),
            4 | 5 => SliceOutcome::Encoded(w as usize - 4),
            _ => SliceOutcome::Failed,
        }
    }
}

/// The most ranges of one slice [`Shm::set_left`] lists one by one; more
/// become one range from the first one's start to the last one's end.
const MAX_LEFT: usize = 16;

fn os_err(what: &str) -> DatapathError {
    DatapathError::Failed(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// Opens (or creates, exclusively) the shared-memory object `name`,
/// sized `len` when created, and maps it.
fn map_shm(name: &str, len: usize, create: bool) -> Result<SharedMapping, DatapathError> {
    let cname = CString::new(name).map_err(|_| DatapathError::Failed("shm name".into()))?;
    let flags = if create {
        libc::O_RDWR | libc::O_CREAT | libc::O_EXCL
    } else {
        libc::O_RDWR
    };
    // SAFETY: a valid C string; the fd is owned below.
    let fd = unsafe { libc::shm_open(cname.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(os_err(&format!("shm_open {name}")));
    }
    // SAFETY: fd is a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    if create {
        // SAFETY: plain syscall on our fd.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
            let e = os_err(&format!("ftruncate {name}"));
            unlink(name);
            return Err(e);
        }
    }
    SharedMapping::new(fd.as_fd(), len).map_err(|e| {
        if create {
            unlink(name);
        }
        DatapathError::Failed(format!("mmap {name}: {e}"))
    })
}

/// Removes this user's segments whose creator has died between making one
/// and every local rank mapping it (the only window in which a name
/// exists): `liberar.<uid>.<pid>.…` in /dev/shm, where `pid` is gone.
fn remove_stale() {
    // SAFETY: getuid cannot fail.
    let prefix = format!("liberar.{}.", unsafe { libc::getuid() });
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|rest| rest.split('.').next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: signal 0 only checks the pid.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            if let Some(n) = name.to_str() {
                unlink(&format!("/{n}"));
            }
        }
    }
}

fn unlink(name: &str) {
    if let Ok(c) = CString::new(name) {
        // SAFETY: a valid C string.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// A process to watch: its pidfd (readable once it has exited, zombie or
/// not, and never another process that reused the pid).
struct Peer {
    pid: i32,
    fd: Option<OwnedFd>,
}

impl Peer {
    fn open(pid: i32) -> Peer {
        // SAFETY: pidfd_open(pid, 0); the result is owned below.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        Peer {
            pid,
            // SAFETY: a fresh descriptor we own.
            fd: (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) }),
        }
    }

    fn alive(&self) -> bool {
        match &self.fd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, no wait.
                unsafe { libc::poll(&mut p, 1, 0) == 0 }
            }
            // SAFETY: signal 0 only checks the pid.
            None => unsafe { libc::kill(self.pid, 0) == 0 },
        }
    }
}

/// One host's ranks' shared memory, as one of them sees it.
pub struct Shm {
    ctl: SharedMapping,
    data: Option<SharedMapping>,
    /// The generation of `data` (0: none yet).
    data_gen: u32,
    region: usize,
    /// The objects' name prefix (the same on every local rank).
    name: String,
    local_rank: usize,
    local_size: usize,
    peers: Vec<Peer>,
    /// How long a barrier polls, yielding the CPU, before it sleeps
    /// (`ERAR_POLL_US`).
    poll: Duration,
}

impl Shm {
    /// The control page, made by local rank 0 (`create`) before the
    /// others open it; `name` is unique to the group and job. `poll`: how
    /// long a barrier looks again and again, yielding the CPU, before it
    /// sleeps.
    pub fn control(
        name: String,
        create: bool,
        (local_rank, pids): (usize, &[i32]),
        poll: Duration,
    ) -> Result<Shm, DatapathError> {
        if create {
            remove_stale();
        }
        let ctl = map_shm(&name, std::mem::size_of::<Ctl>(), create)?;
        let peers = pids
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != local_rank)
            .map(|(_, p)| Peer::open(*p))
            .collect();
        Ok(Shm {
            ctl,
            data: None,
            data_gen: 0,
            region: 0,
            name,
            local_rank,
            local_size: pids.len(),
            peers,
            poll,
        })
    }

    /// The group's name (its control page's).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Removes the control page's name (every local rank has mapped it).
    pub fn unlink_control(&self) {
        unlink(&self.name);
    }

    fn ctl(&self) -> &Ctl {
        // SAFETY: the mapping is at least size_of::<Ctl>() bytes, page
        // aligned, and lives as long as self; Ctl is made of atomics,
        // valid for any bits (the page starts zeroed).
        unsafe { &*self.ctl.as_ptr().cast::<Ctl>() }
    }

    /// Marks the group broken (a rank leaves a call early) and wakes every
    /// waiter: their barriers fail from now on.
    pub fn set_broken(&self) {
        let c = self.ctl();
        c.broken.store(1, Ordering::SeqCst);
        c.generation.fetch_add(1, Ordering::SeqCst);
        futex_wake(&c.generation);
    }

    /// Waits until every local rank has arrived, calling `progress` while
    /// it waits. Fails if the group is broken or a local rank has died.
    pub fn barrier(&self, progress: &dyn Fn()) -> Result<(), DatapathError> {
        let c = self.ctl();
        if c.broken.load(Ordering::Acquire) != 0 {
            return Err(broken());
        }
        let gen = c.generation.load(Ordering::Acquire);
        if c.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.local_size as u32 {
            // Reset before the release: a rank that passes and arrives at
            // the next barrier counts from zero.
            c.arrived.store(0, Ordering::Relaxed);
            c.generation.fetch_add(1, Ordering::Release);
            futex_wake(&c.generation);
            return Ok(());
        }
        let mut spins = 0;
        let started = Instant::now();
        while c.generation.load(Ordering::Acquire) == gen {
            if spins < SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            // A peer that is descheduled arrives after a scheduler turn:
            // take turns with the ranks that poll rather than sleep
            // behind them (see ERAR_POLL_US).
            if started.elapsed() < self.poll {
                std::thread::yield_now();
                continue;
            }
            progress();
            futex_wait(&c.generation, gen, WATCH_PERIOD);
            if c.generation.load(Ordering::Acquire) != gen {
                break;
            }
            if let Some(dead) = self.peers.iter().find(|p| !p.alive()) {
                self.set_broken();
                return Err(DatapathError::Failed(format!(
                    "local rank process {} died",
                    dead.pid
                )));
            }
        }
        if c.broken.load(Ordering::Acquire) != 0 {
            return Err(broken());
        }
        Ok(())
    }

    /// Records slice `s`'s outcome in this step.
    pub fn set_outcome(&self, s: usize, outcome: SliceOutcome) {
        self.ctl().status[s].store(outcome.word(), Ordering::Release);
    }

    /// Slice `s`'s outcome in this step, read after the barrier that
    /// follows [`Shm::set_outcome`].
    pub fn outcome(&self, s: usize) -> SliceOutcome {
        SliceOutcome::of_word(self.ctl().status[s].load(Ordering::Acquire))
    }

    /// Slice `s`'s leader: the byte ranges (ascending, within the slice)
    /// that MPI completes over the whole communicator in this step.
    pub fn set_left(&self, s: usize, ranges: &[std::ops::Range<usize>]) {
        let c = self.ctl();
        let (first, last) = match (ranges.first(), ranges.last()) {
            (Some(f), Some(l)) => (f.start, l.end),
            _ => (0, 0),
        };
        let merged = first..last;
        let ranges = if ranges.len() > MAX_LEFT {
            std::slice::from_ref(&merged)
        } else {
            ranges
        };
        for (i, r) in ranges.iter().enumerate() {
            c.left[s][2 * i].store(r.start as u64, Ordering::Relaxed);
            c.left[s][2 * i + 1].store(r.end as u64, Ordering::Relaxed);
        }
        c.left_count[s].store(ranges.len() as u32, Ordering::Release);
    }

    /// Slice `s`'s ranges of [`Shm::set_left`], read after the barrier
    /// that follows it.
    pub fn left(&self, s: usize) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let c = self.ctl();
        let n = c.left_count[s].load(Ordering::Acquire) as usize;
        (0..n.min(MAX_LEFT)).map(move |i| {
            let at = |k: usize| c.left[s][2 * i + k].load(Ordering::Relaxed) as usize;
            at(0)..at(1)
        })
    }

    /// The first slice below `slices` that failed in this step.
    pub fn failed_slice(&self, slices: usize) -> Option<usize> {
        (0..slices).find(|s| self.outcome(*s) == SliceOutcome::Failed)
    }

    /// Makes sure the data segment's regions hold `bytes` (collective over
    /// the local ranks, which all ask for the same size: they see the same
    /// call). A larger segment replaces the old one: local rank 0 makes it,
    /// the others map it after a barrier, and its name goes after a second.
    pub fn reserve(&mut self, bytes: usize, progress: &dyn Fn()) -> Result<(), DatapathError> {
        if bytes <= self.region {
            return Ok(());
        }
        // Page-rounded, with room to grow by half before the next remap.
        let region = (bytes + bytes / 2).next_multiple_of(4096);
        let gen = self.data_gen + 1;
        let name = format!("{}.d{gen}", self.name);
        let len = region * (self.local_size + 2);
        if self.local_rank == 0 {
            match map_shm(&name, len, true) {
                Ok(m) => {
                    self.data = Some(m);
                    self.ctl().region.store(region as u64, Ordering::Release);
                    self.ctl().data_gen.store(gen, Ordering::Release);
                }
                Err(e) => {
                    self.set_broken();
                    return Err(e);
                }
            }
        }
        self.barrier(progress)?;
        if self.local_rank != 0 {
            let c = self.ctl();
            if c.data_gen.load(Ordering::Acquire) != gen
                || c.region.load(Ordering::Acquire) != region as u64
            {
                self.set_broken();
                return Err(DatapathError::Failed(
                    "local ranks disagree on the shared segment".into(),
                ));
            }
            match map_shm(&name, len, false) {
                Ok(m) => self.data = Some(m),
                Err(e) => {
                    self.set_broken();
                    return Err(e);
                }
            }
        }
        self.barrier(progress)?;
        if self.local_rank == 0 {
            unlink(&name);
        }
        self.data_gen = gen;
        self.region = region;
        Ok(())
    }

    /// Local rank `r`'s input region (`local_size` and `local_size + 1`:
    /// the two output regions).
    ///
    /// # Safety
    /// The caller follows the protocol that makes this access race-free: a
    /// region is written by one rank between two barriers, and read by
    /// others only after the next one.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn region(&self, r: usize, len: usize) -> &mut [u8] {
        let Some(m) = &self.data else {
            return &mut [];
        };
        debug_assert!(r <= self.local_size + 1 && len <= self.region);
        std::slice::from_raw_parts_mut(m.as_ptr().add(r * self.region), len.min(self.region))
    }

    /// Output region `which` (0 or 1): pieces use them in turn, so that a
    /// broadcast root may fill the next one before its peers have read
    /// the last one.
    ///
    /// # Safety
    /// As [`Shm::region`].
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn output(&self, which: usize, len: usize) -> &mut [u8] {
        self.region(self.local_size + (which & 1), len)
    }
}

fn broken() -> DatapathError {
    DatapathError::Failed("a rank on this host left the call (see its error)".into())
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a shared (not private: several processes) futex wait on an
    // aligned u32 of a live mapping, with a relative timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: wakes every waiter on an aligned u32 of a live mapping.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}
