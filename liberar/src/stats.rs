//! Per-process counters: which path each call took and why.
//!
//! Relaxed atomics only: they are bumped on the per-call path. The summary
//! line printed at finalize (`ERAR_STATS=1`) is what tests parse to prove
//! which path ran, so its format is stable:
//!
//! `liberar: rank=R size=N allreduce fast=F fast_bytes=B pmpi=P bcast fast=F fast_bytes=B pmpi=P fallback_bytes=B repaired=E repairs_carried=V exact_mpi=M exact_gathered=G exchanges=X kernel_barriers=K kernel_aborts=A segmented=S bcast_in_place=Z allreduce_in_place=Z regions_reused=U region_peak_kib=K fortran=K recovery_rounds=R resend_chunks=C nacks=K nack_chunks=A restarted=S node_calls=H node_led=L node_kept=K node_decoded=D t_prepare_us=T t_agree_us=T t_inject_us=T t_wait_us=T t_verdict_us=T t_recovery_us=T t_finish_us=T t_node_in_us=T t_node_wait_us=T t_node_out_us=T reasons=coll.reason:count,...`
//!
//! The `t_*_us` fields say where the fast path's time went on this rank,
//! summed over its calls (see [`Phase`]). `select=` says how each collective
//! was routed and from what floor
//! (`allreduce:measured>=262144,allreduce.f32.sum:measured>=524288,…`);
//! `chosen=` lists the classes the trials decided, in order, as
//! `kind@bytes:path:MPI_us/FAST_us` (each path's mean over ranks of each
//! rank's best counted trial; at most [`MAX_CHOICES`] of them, then `+N`).

use crate::config::Config;
use crate::select::{Class, Collective, Path, Reason, Route};
pub use crate::trace::Phase;
use crate::trace::{self, Mark};
use parking_lot::Mutex;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

const NCOLL: usize = 2;
const NREASON: usize = Reason::ALL.len();
const NPHASE: usize = Phase::ALL.len();

struct Counters {
    fast: [AtomicU64; NCOLL],
    fast_bytes: [AtomicU64; NCOLL],
    pmpi: [[AtomicU64; NREASON]; NCOLL],
    fortran: AtomicU64,
    /// Bytes of fast-path calls that MPI reduced after all (blocks outside
    /// the exact float range, NaN, lost frames).
    fallback_bytes: AtomicU64,
    /// Float SUM elements the bounded certificate sent to the exact repair.
    repaired: AtomicU64,
    /// Bounded calls whose repair inputs the verdict carried (no exchange
    /// of their own).
    repairs_carried: AtomicU64,
    /// Fast calls of classes settled by measurement, and the time they
    /// saved against MPI's measured time for their class (µs; negative:
    /// lost).
    estimated_calls: AtomicU64,
    saved_us: AtomicI64,
    /// Reproducible float SUM: calls (or segments) MPI carried with the
    /// ring's bits (summed as exact integers), and elements summed from every
    /// rank's gathered inputs (blocks no i64 grid carries).
    exact_mpi: AtomicU64,
    exact_gathered: AtomicU64,
    /// Agreement exchanges the fast path made over MPI (barriers, scale
    /// agreements, verdicts, recovery and repair rounds, ring setup).
    exchanges: AtomicU64,
    /// Barriers the fast path passed in the kernel (no MPI exchange).
    kernel_barriers: AtomicU64,
    /// Barriers in the kernel that aborted because the hosts joined with
    /// different keys (float SUM hosts not all ready to reuse their
    /// scales, a NaN in some hosts' data of a float MAX/MIN, an erroneous
    /// call, a host that could not arm): the ranks then met over MPI.
    kernel_aborts: AtomicU64,
    /// Exact allreduce calls the tuner ran in cache-sized segments
    /// (ring/tune.rs; the others of their size ran as one operation).
    segmented: AtomicU64,
    /// Broadcast segments whose data XDP read (root) or wrote (the other
    /// ranks) in the caller's buffer (datapath/kernel/region.rs).
    bcast_in_place: AtomicU64,
    /// Exact allreduce segments whose input XDP read from the caller's
    /// send buffer and whose result it wrote into the receive buffer
    /// (datapath/ring/registered.rs).
    allreduce_in_place: AtomicU64,
    /// Buffers registered in the map the buffer before had
    /// (datapath/kernel/region.rs: `RegionMap`), not in a new one.
    regions_reused: AtomicU64,
    /// The most KiB of kernel memory this rank's region maps held at once
    /// (their size classes follow the buffers': "Registered buffers" in
    /// erar_wire.h).
    region_peak_kib: AtomicU64,
    /// Loss-recovery rounds this rank took part in (lost, late or dropped
    /// frames), and chunks it re-sent for its successor in them.
    recovery_rounds: AtomicU64,
    resend_chunks: AtomicU64,
    /// NACK bursts this rank's host sent its predecessor (in-kernel repair
    /// of lost frames, no MPI exchange), and the chunks they asked about.
    nacks: AtomicU64,
    nack_chunks: AtomicU64,
    /// Starting frames this rank's host sent while waiting, on a ring
    /// whose frames circulate (chunks that lost frames left unstarted).
    restarted: AtomicU64,
    /// Calls this rank completed through its host's shared memory (a
    /// communicator with several ranks on a host), and slices of them it
    /// led across hosts on a slice's ring.
    node_calls: AtomicU64,
    node_led: AtomicU64,
    /// Slices of those calls this rank copied out straight from their
    /// leader's slot buffer (datapath/node/slots.rs), and of them, float
    /// SUM slices it decoded from the words there.
    node_kept: AtomicU64,
    node_decoded: AtomicU64,
    /// Nanoseconds spent in each [`Phase`].
    phase_ns: [AtomicU64; NPHASE],
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicU64 = AtomicU64::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const ZEROS: [AtomicU64; NREASON] = [ZERO; NREASON];

static COUNTERS: Counters = Counters {
    fast: [ZERO; NCOLL],
    fast_bytes: [ZERO; NCOLL],
    pmpi: [ZEROS; NCOLL],
    fortran: ZERO,
    fallback_bytes: ZERO,
    repaired: ZERO,
    repairs_carried: ZERO,
    estimated_calls: ZERO,
    saved_us: AtomicI64::new(0),
    exact_mpi: ZERO,
    exact_gathered: ZERO,
    exchanges: ZERO,
    kernel_barriers: ZERO,
    kernel_aborts: ZERO,
    segmented: ZERO,
    bcast_in_place: ZERO,
    allreduce_in_place: ZERO,
    regions_reused: ZERO,
    region_peak_kib: ZERO,
    recovery_rounds: ZERO,
    resend_chunks: ZERO,
    nacks: ZERO,
    nack_chunks: ZERO,
    restarted: ZERO,
    node_calls: ZERO,
    node_led: ZERO,
    node_kept: ZERO,
    node_decoded: ZERO,
    phase_ns: [ZERO; NPHASE],
};

fn idx(c: Collective) -> usize {
    match c {
        Collective::Allreduce => 0,
        Collective::Bcast => 1,
    }
}

/// Counts one routed call.
#[inline]
pub fn record(coll: Collective, route: Route, bytes: usize) {
    match route {
        Route::Fast(_) => record_fast(coll, bytes),
        Route::Pmpi(r) => {
            COUNTERS.pmpi[idx(coll)][r as usize].fetch_add(1, Relaxed);
        }
        Route::MpiTrial(_) => {
            COUNTERS.pmpi[idx(coll)][Reason::Trial as usize].fetch_add(1, Relaxed);
        }
    }
}

/// Counts one call routed to the fast path (also one that failed before
/// [`crate::select::decide`] could answer with its [`Route::Fast`]: its
/// communicator's state could not be looked up).
#[inline]
pub fn record_fast(coll: Collective, bytes: usize) {
    COUNTERS.fast[idx(coll)].fetch_add(1, Relaxed);
    COUNTERS.fast_bytes[idx(coll)].fetch_add(bytes as u64, Relaxed);
}

/// A fast-path attempt handed the call back to PMPI: move it from `fast` to
/// the given reason so the counters tell the truth.
pub fn record_declined(coll: Collective, bytes: usize) {
    COUNTERS.fast[idx(coll)].fetch_sub(1, Relaxed);
    COUNTERS.fast_bytes[idx(coll)].fetch_sub(bytes as u64, Relaxed);
    COUNTERS.pmpi[idx(coll)][Reason::FastPathDeclined as usize].fetch_add(1, Relaxed);
}

/// Counts bytes of an accelerated call that MPI completed instead.
#[inline]
pub fn record_fallback_bytes(bytes: usize) {
    COUNTERS.fallback_bytes.fetch_add(bytes as u64, Relaxed);
}

/// Counts one agreement exchange of the fast path.
#[inline]
pub fn record_exchange() {
    COUNTERS.exchanges.fetch_add(1, Relaxed);
}

/// Counts one barrier passed in the kernel.
#[inline]
pub fn record_kernel_barrier() {
    COUNTERS.kernel_barriers.fetch_add(1, Relaxed);
}

/// Counts one exact call the tuner ran in segments.
pub fn record_segmented() {
    COUNTERS.segmented.fetch_add(1, Relaxed);
}

/// Counts one broadcast segment run in the caller's buffer.
pub fn record_bcast_in_place() {
    COUNTERS.bcast_in_place.fetch_add(1, Relaxed);
}

/// Counts one exact allreduce segment run in the caller's buffers.
pub fn record_allreduce_in_place() {
    COUNTERS.allreduce_in_place.fetch_add(1, Relaxed);
}

/// Counts one buffer registered in its ring's map before.
pub fn record_region_reused() {
    COUNTERS.regions_reused.fetch_add(1, Relaxed);
}

/// Notes the bytes this rank's region maps hold now (after a buffer was
/// registered): the most is reported.
pub fn record_region_kib(held_bytes: usize) {
    let kib = held_bytes.div_ceil(1024) as u64;
    COUNTERS.region_peak_kib.fetch_max(kib, Relaxed);
}

/// Counts one barrier in the kernel that aborted.
#[inline]
pub fn record_kernel_abort() {
    COUNTERS.kernel_aborts.fetch_add(1, Relaxed);
}

/// Counts `elems` float SUM elements repaired under the bounded contract.
pub fn record_repaired(elems: usize) {
    COUNTERS.repaired.fetch_add(elems as u64, Relaxed);
}

/// Records one fast call of a class settled by measurement: `mpi_us` is
/// MPI's measured time for the class, `took` this call's.
pub fn record_saved(mpi_us: i64, took: std::time::Duration) {
    let took_us = i64::try_from(took.as_micros()).unwrap_or(i64::MAX);
    COUNTERS.estimated_calls.fetch_add(1, Relaxed);
    COUNTERS
        .saved_us
        .fetch_add(mpi_us.saturating_sub(took_us), Relaxed);
}

/// Counts one bounded call whose verdict carried its repairs.
pub fn record_repairs_carried() {
    COUNTERS.repairs_carried.fetch_add(1, Relaxed);
}

/// Counts one reproducible float SUM (or segment) that MPI carried exactly.
pub fn record_exact_mpi() {
    COUNTERS.exact_mpi.fetch_add(1, Relaxed);
}

/// Counts `elems` reproducible float SUM elements summed from every rank's
/// gathered inputs.
pub fn record_exact_gathered(elems: usize) {
    COUNTERS.exact_gathered.fetch_add(elems as u64, Relaxed);
}

/// Counts one loss-recovery round in which this rank re-sent `chunks` chunks.
pub fn record_recovery_round(chunks: usize) {
    COUNTERS.recovery_rounds.fetch_add(1, Relaxed);
    COUNTERS.resend_chunks.fetch_add(chunks as u64, Relaxed);
}

/// Counts `bursts` NACK bursts asking about `chunks` chunks in all, and
/// `restarted` starting frames sent while waiting.
pub fn record_repairs(bursts: u32, chunks: u64, restarted: u64) {
    if bursts > 0 {
        COUNTERS.nacks.fetch_add(bursts as u64, Relaxed);
        COUNTERS.nack_chunks.fetch_add(chunks, Relaxed);
    }
    if restarted > 0 {
        COUNTERS.restarted.fetch_add(restarted, Relaxed);
    }
}

/// Counts one call completed through the host's shared memory.
pub fn record_node_call() {
    COUNTERS.node_calls.fetch_add(1, Relaxed);
}

/// Counts one slice this rank carried across hosts on its slice's ring.
pub fn record_node_led() {
    COUNTERS.node_led.fetch_add(1, Relaxed);
}

/// Counts one slice this rank copied out of its leader's slot buffer.
pub fn record_node_kept() {
    COUNTERS.node_kept.fetch_add(1, Relaxed);
}

/// Counts one float SUM slice this rank decoded out of its leader's slot
/// buffer (it counts as kept too).
pub fn record_node_decoded() {
    COUNTERS.node_kept.fetch_add(1, Relaxed);
    COUNTERS.node_decoded.fetch_add(1, Relaxed);
}

/// Charges the time since `since` to `phase`; returns now, where the next
/// phase starts.
#[inline]
pub fn phase_done(phase: Phase, since: Instant) -> Instant {
    let now = Instant::now();
    let ns = now.duration_since(since).as_nanos() as u64;
    COUNTERS.phase_ns[phase as usize].fetch_add(ns, Relaxed);
    trace::mark(Mark::Done(phase));
    now
}

/// Decisions listed on the stats line; more are only counted.
pub const MAX_CHOICES: usize = 32;

struct Choices {
    list: Vec<(Class, Path, [i64; 2])>,
    more: usize,
}

/// Touched once per class and communicator, when its trials end.
static CHOICES: Mutex<Choices> = Mutex::new(Choices {
    list: Vec::new(),
    more: 0,
});

/// Records a class's decision and the times it was made from.
pub fn record_choice(class: Class, path: Path, mean_us: [i64; 2]) {
    let mut c = CHOICES.lock();
    if c.list.len() < MAX_CHOICES {
        c.list.push((class, path, mean_us));
    } else {
        c.more += 1;
    }
}

/// Counts one call that entered through a Fortran binding.
#[inline]
pub fn record_fortran() {
    COUNTERS.fortran.fetch_add(1, Relaxed);
}

pub fn fast_calls(coll: Collective) -> u64 {
    COUNTERS.fast[idx(coll)].load(Relaxed)
}

pub fn pmpi_calls(coll: Collective, reason: Reason) -> u64 {
    COUNTERS.pmpi[idx(coll)][reason as usize].load(Relaxed)
}

/// The calls handed to MPI, where there were any, by collective (its
/// short name) and reason, in that order: (name, reason, calls).
fn pmpi_reasons() -> impl Iterator<Item = (&'static str, Reason, u64)> {
    [
        (Collective::Allreduce, "allreduce"),
        (Collective::Bcast, "bcast"),
    ]
    .into_iter()
    .flat_map(|(coll, cname)| Reason::ALL.map(|r| (cname, r, pmpi_calls(coll, r))))
    .filter(|&(_, _, n)| n > 0)
}

/// The one-line summary (without trailing newline).
pub fn summary(rank: i32, size: i32) -> String {
    let mut s = format!("liberar: rank={rank} size={size}");
    for (coll, name) in [
        (Collective::Allreduce, "allreduce"),
        (Collective::Bcast, "bcast"),
    ] {
        let pmpi: u64 = Reason::ALL.iter().map(|r| pmpi_calls(coll, *r)).sum();
        let _ = write!(
            s,
            " {name} fast={} fast_bytes={} pmpi={pmpi}",
            fast_calls(coll),
            COUNTERS.fast_bytes[idx(coll)].load(Relaxed)
        );
    }
    let c = &COUNTERS;
    let totals: [(&str, &AtomicU64); 23] = [
        ("fallback_bytes", &c.fallback_bytes),
        ("repaired", &c.repaired),
        ("repairs_carried", &c.repairs_carried),
        ("exact_mpi", &c.exact_mpi),
        ("exact_gathered", &c.exact_gathered),
        ("exchanges", &c.exchanges),
        ("kernel_barriers", &c.kernel_barriers),
        ("kernel_aborts", &c.kernel_aborts),
        ("segmented", &c.segmented),
        ("bcast_in_place", &c.bcast_in_place),
        ("allreduce_in_place", &c.allreduce_in_place),
        ("regions_reused", &c.regions_reused),
        ("region_peak_kib", &c.region_peak_kib),
        ("fortran", &c.fortran),
        ("recovery_rounds", &c.recovery_rounds),
        ("resend_chunks", &c.resend_chunks),
        ("nacks", &c.nacks),
        ("nack_chunks", &c.nack_chunks),
        ("restarted", &c.restarted),
        ("node_calls", &c.node_calls),
        ("node_led", &c.node_led),
        ("node_kept", &c.node_kept),
        ("node_decoded", &c.node_decoded),
    ];
    for (name, v) in totals {
        let _ = write!(s, " {name}={}", v.load(Relaxed));
    }
    for phase in Phase::ALL {
        let us = COUNTERS.phase_ns[phase as usize].load(Relaxed) / 1000;
        let _ = write!(s, " t_{}_us={us}", phase.name());
    }
    let cfg = Config::get();
    let mut sep = " select=";
    for (coll, cname) in [
        (Collective::Allreduce, "allreduce"),
        (Collective::Bcast, "bcast"),
    ] {
        let (routing, min) = crate::select::routing(cfg, coll);
        let _ = write!(s, "{sep}{cname}:{}>={min}", routing.name());
        if coll == Collective::Allreduce {
            let _ = write!(
                s,
                ",allreduce.f32.sum:{}>={}",
                routing.name(),
                cfg.float_sum_min_bytes
            );
        }
        sep = ",";
    }
    let choices = CHOICES.lock();
    let mut sep = " chosen=";
    for (class, path, [mpi_us, fast_us]) in &choices.list {
        let _ = write!(
            s,
            "{sep}{}@{}:{}:{mpi_us}/{fast_us}",
            class.kind_name(),
            class.min_bytes(),
            path.name()
        );
        sep = ",";
    }
    if choices.more > 0 {
        let _ = write!(s, "{sep}+{}", choices.more);
    }
    drop(choices);
    let mut sep = " reasons=";
    for (cname, r, n) in pmpi_reasons() {
        let _ = write!(s, "{sep}{cname}.{}:{n}", r.name());
        sep = ",";
    }
    s
}

/// The job's summary for people, printed once by rank 0 with `ERAR_STATS`:
/// calls and bytes per path, the time the fast path saved against MPI's
/// own measured time for the same classes of call, and the commonest
/// reasons calls went to MPI. Every rank routes every call the same way,
/// so rank 0's counts are the job's.
pub fn human_summary(size: i32) -> String {
    let mut s = String::new();
    let gb = |b: u64| b as f64 / 1e9;
    let mut parts = Vec::new();
    for (coll, name) in [
        (Collective::Allreduce, "MPI_Allreduce"),
        (Collective::Bcast, "MPI_Bcast"),
    ] {
        let fast = fast_calls(coll);
        let pmpi: u64 = Reason::ALL.iter().map(|r| pmpi_calls(coll, *r)).sum();
        if fast + pmpi > 0 {
            parts.push(format!(
                "{name} {} calls, {fast} on the fast path ({:.3} GB)",
                fast + pmpi,
                gb(COUNTERS.fast_bytes[idx(coll)].load(Relaxed))
            ));
        }
    }
    let calls = if parts.is_empty() {
        "no MPI_Allreduce or MPI_Bcast".to_string()
    } else {
        parts.join("; ")
    };
    let _ = writeln!(
        s,
        "liberar: job summary ({size} ranks, as rank 0 saw it): {calls}"
    );
    let n = COUNTERS.estimated_calls.load(Relaxed);
    let saved_ms = COUNTERS.saved_us.load(Relaxed) as f64 / 1000.0;
    if n > 0 {
        let _ = writeln!(
            s,
            "liberar: time saved against MPI's measured time for the same calls: {saved_ms:.1} ms \
             over {n} fast calls of measured classes{}",
            if saved_ms < 0.0 { " (a loss)" } else { "" }
        );
    } else {
        let _ = writeln!(
            s,
            "liberar: time saved: not estimated (no fast call of a class whose MPI time was \
             measured; with a fixed threshold nothing is measured)"
        );
    }
    let mut reasons: Vec<(u64, String)> = pmpi_reasons()
        .map(|(cname, r, k)| (k, format!("{cname} {}", r.name().replace('_', " "))))
        .collect();
    reasons.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    if !reasons.is_empty() {
        let top: Vec<String> = reasons
            .iter()
            .take(3)
            .map(|(k, what)| format!("{what} ({k})"))
            .collect();
        let _ = writeln!(
            s,
            "liberar: calls MPI made, commonest reasons: {}",
            top.join(", ")
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn phases_are_charged_and_summarised() {
        let since = Instant::now() - Duration::from_millis(3);
        let next = phase_done(Phase::Verdict, since);
        assert!(next >= since + Duration::from_millis(3));
        let line = summary(0, 1);
        let field = |name: &str| -> u64 {
            let tok = line
                .split_whitespace()
                .find_map(|t| t.strip_prefix(&format!("t_{name}_us=")))
                .unwrap_or_else(|| panic!("no t_{name}_us in {line}"));
            tok.parse().unwrap()
        };
        assert!(field("verdict") >= 3000, "{line}");
        for phase in Phase::ALL {
            field(phase.name());
        }
        assert!(
            line.find(" t_prepare_us=").unwrap() < line.find(" reasons=").unwrap_or(line.len()),
            "the reasons come last: {line}"
        );
    }
}
