//! `ERAR_TRACE=PREFIX`: a timeline of this rank's fast-path calls, for lining
//! up the ranks of a job call by call (`benchmarks/timeline`).
//!
//! The `t_*_us` phases of the stats line are sums over one rank, and on an
//! oversubscribed machine they mislead: a rank whose barrier "took" 500 µs
//! may have been descheduled while the other CPUs ran the whole ring in
//! softirq (docs/benchmarks.md, "Session 26"). A timeline shows what waited
//! on what. Each mark is one CLOCK_MONOTONIC reading, the clock every
//! network namespace of the test bed shares; on real hosts, timelines line
//! up across hosts only as well as their clocks are synchronized.
//!
//! Off (the default), a mark is one load and a branch. On, it is a clock
//! read and a store into a buffer allocated at the first mark, of
//! [`CAPACITY`] marks (the later ones are counted, not kept). The buffer is
//! written to `PREFIX.<world rank>` at `MPI_Finalize`: one `name ns` line
//! per mark.

use once_cell::sync::OnceCell;
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

use crate::config::Config;

/// The steps of one fast-path operation (one slot's worth of data), in
/// order. Which one a rank's time goes to tells the datapath's own work
/// from the MPI exchanges around it: a broadcast root's `inject` lasts
/// about as long as the whole chain, whose hops run in softirq on the
/// CPUs that sent the frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The caller's data into the slot: copy, encoding, float scales.
    Prepare,
    /// The call-key agreement (the barrier before anyone injects).
    Agree,
    /// This host's BPF_PROG_RUN calls.
    Inject,
    /// Waiting for the last chunk (NACKs included).
    Wait,
    /// The exchanges that decide whether every host is complete.
    Verdict,
    /// Loss-recovery rounds.
    Recovery,
    /// The slot into the caller's buffer: copy or decoding.
    Finish,
    /// Several ranks on a host: this rank's input into shared memory, and
    /// a slice leader's reduction of its host's inputs.
    NodeIn,
    /// Waiting at the host's shared-memory barriers (for the other local
    /// ranks, or for the slice leaders' rings).
    NodeWait,
    /// The result out of shared memory into the caller's buffer.
    NodeOut,
}

impl Phase {
    pub const ALL: [Phase; 10] = [
        Phase::Prepare,
        Phase::Agree,
        Phase::Inject,
        Phase::Wait,
        Phase::Verdict,
        Phase::Recovery,
        Phase::Finish,
        Phase::NodeIn,
        Phase::NodeWait,
        Phase::NodeOut,
    ];

    /// Its name on the stats line (`t_<name>_us`) and in a trace.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prepare => "prepare",
            Phase::Agree => "agree",
            Phase::Inject => "inject",
            Phase::Wait => "wait",
            Phase::Verdict => "verdict",
            Phase::Recovery => "recovery",
            Phase::Finish => "finish",
            Phase::NodeIn => "node_in",
            Phase::NodeWait => "node_wait",
            Phase::NodeOut => "node_out",
        }
    }
}

/// Marks kept per process: 16 MiB, about 100k calls of up to ten marks.
pub const CAPACITY: usize = 1 << 21;

/// What happened at a mark: a fast-path call began or ended, this host
/// joined a kernel barrier, or one of the stats phases ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mark {
    /// A call handed to the fast path (after its communicator's setup).
    Call,
    /// That call returned.
    End,
    /// This host told its predecessor it joined an operation's barrier.
    Joined,
    /// A phase of [`Phase`] ended.
    Done(Phase),
}

impl Mark {
    /// A mark's code: the phase's index, or one of the three above it.
    fn code(self) -> u64 {
        match self {
            Mark::Done(p) => p as u64,
            Mark::Call => Phase::ALL.len() as u64,
            Mark::End => Phase::ALL.len() as u64 + 1,
            Mark::Joined => Phase::ALL.len() as u64 + 2,
        }
    }

    fn name(code: u64) -> &'static str {
        match code as usize {
            c if c < Phase::ALL.len() => Phase::ALL[c].name(),
            c if c == Phase::ALL.len() => "call",
            c if c == Phase::ALL.len() + 1 => "end",
            _ => "joined",
        }
    }
}

/// The kept marks: each word the code in its top 8 bits and the time in
/// nanoseconds below (2^56 ns: 2.3 years of uptime).
struct Trace {
    prefix: String,
    next: AtomicUsize,
    words: Box<[AtomicU64]>,
}

static TRACE: OnceCell<Option<Trace>> = OnceCell::new();

fn trace() -> Option<&'static Trace> {
    TRACE
        .get_or_init(|| {
            Config::get().trace.clone().map(|prefix| Trace {
                prefix,
                next: AtomicUsize::new(0),
                words: (0..CAPACITY).map(|_| AtomicU64::new(0)).collect(),
            })
        })
        .as_ref()
}

/// Records `mark` now, if tracing is on.
#[inline]
pub fn mark(mark: Mark) {
    let Some(t) = trace() else {
        return;
    };
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec; CLOCK_MONOTONIC cannot fail.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let ns = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    let i = t.next.fetch_add(1, Relaxed);
    if let Some(w) = t.words.get(i) {
        w.store(mark.code() << 56 | (ns & ((1 << 56) - 1)), Relaxed);
    }
}

/// Writes the kept marks to `PREFIX.<rank>` (at finalize; a rank that made
/// no fast call writes an empty file); warns if it could not, or if marks
/// were left out.
pub fn dump(rank: i32) {
    let Some(t) = TRACE.get().and_then(Option::as_ref) else {
        if let Some(prefix) = &Config::get().trace {
            if let Err(e) = std::fs::File::create(format!("{prefix}.{rank}")) {
                log::warn!("liberar: ERAR_TRACE: writing {prefix}.{rank}: {e}");
            }
        }
        return;
    };
    let taken = t.next.load(Relaxed);
    let path = format!("{}.{rank}", t.prefix);
    let write = || -> std::io::Result<()> {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path)?);
        for w in &t.words[..taken.min(CAPACITY)] {
            let w = w.load(Relaxed);
            writeln!(out, "{} {}", Mark::name(w >> 56), w & ((1 << 56) - 1))?;
        }
        out.flush()
    };
    match write() {
        Ok(()) if taken > CAPACITY => log::warn!(
            "liberar: {path}: the first {CAPACITY} of {taken} marks (ERAR_TRACE keeps no more)"
        ),
        Ok(()) => {}
        Err(e) => log::warn!("liberar: ERAR_TRACE: writing {path}: {e}"),
    }
}
