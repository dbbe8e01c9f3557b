//! Per-process counters: which path each call took and why.
//!
//! Relaxed atomics only: they are bumped on the per-call path. The summary
//! line printed at finalize (`ERAR_STATS=1`) is what tests parse to prove
//! which path ran, so its format is stable:
//!
//! `liberar: rank=R size=N allreduce fast=F fast_bytes=B pmpi=P bcast fast=F fast_bytes=B pmpi=P fallback_bytes=B fortran=K recovery_rounds=R resend_chunks=C nacks=K nack_chunks=A reasons=coll.reason:count,...`

use crate::select::{Collective, Reason, Route};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

const NCOLL: usize = 2;
const NREASON: usize = Reason::ALL.len();

struct Counters {
    fast: [AtomicU64; NCOLL],
    fast_bytes: [AtomicU64; NCOLL],
    pmpi: [[AtomicU64; NREASON]; NCOLL],
    fortran: AtomicU64,
    /// Bytes of fast-path calls that MPI reduced after all (blocks outside
    /// the exact float range, NaN, lost frames).
    fallback_bytes: AtomicU64,
    /// Loss-recovery rounds this rank took part in (lost, late or dropped
    /// frames), and chunks it re-sent for its successor in them.
    recovery_rounds: AtomicU64,
    resend_chunks: AtomicU64,
    /// NACK bursts this rank's host sent its predecessor (in-kernel repair
    /// of lost frames, no MPI exchange), and the chunks they asked about.
    nacks: AtomicU64,
    nack_chunks: AtomicU64,
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
    recovery_rounds: ZERO,
    resend_chunks: ZERO,
    nacks: ZERO,
    nack_chunks: ZERO,
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
        Route::Fast => {
            COUNTERS.fast[idx(coll)].fetch_add(1, Relaxed);
            COUNTERS.fast_bytes[idx(coll)].fetch_add(bytes as u64, Relaxed);
        }
        Route::Pmpi(r) => {
            COUNTERS.pmpi[idx(coll)][r as usize].fetch_add(1, Relaxed);
        }
    }
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

/// Counts one loss-recovery round in which this rank re-sent `chunks` chunks.
pub fn record_recovery_round(chunks: usize) {
    COUNTERS.recovery_rounds.fetch_add(1, Relaxed);
    COUNTERS.resend_chunks.fetch_add(chunks as u64, Relaxed);
}

/// Counts `bursts` NACK bursts asking about `chunks` chunks in all.
pub fn record_nacks(bursts: u32, chunks: u64) {
    if bursts > 0 {
        COUNTERS.nacks.fetch_add(bursts as u64, Relaxed);
        COUNTERS.nack_chunks.fetch_add(chunks, Relaxed);
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
    let _ = write!(
        s,
        " fallback_bytes={} fortran={} recovery_rounds={} resend_chunks={} nacks={} nack_chunks={}",
        COUNTERS.fallback_bytes.load(Relaxed),
        COUNTERS.fortran.load(Relaxed),
        COUNTERS.recovery_rounds.load(Relaxed),
        COUNTERS.resend_chunks.load(Relaxed),
        COUNTERS.nacks.load(Relaxed),
        COUNTERS.nack_chunks.load(Relaxed)
    );
    let mut sep = " reasons=";
    for (coll, cname) in [
        (Collective::Allreduce, "allreduce"),
        (Collective::Bcast, "bcast"),
    ] {
        for r in Reason::ALL {
            let n = pmpi_calls(coll, r);
            if n > 0 {
                let _ = write!(s, "{sep}{cname}.{}:{n}", r.name());
                sep = ",";
            }
        }
    }
    s
}
