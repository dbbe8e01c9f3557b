//! What every rank agrees on before anyone injects: that all make the same
//! call (its key), the seq of the operation, and whether float scales must
//! be agreed anew; the exchange that carries it is the barrier.

use super::Ring;
use crate::config::{Config, Precision};
use crate::datapath::liveness::Prober;
use crate::datapath::{Comm, DatapathError};
use crate::select::{ElemType, ReduceOp};
use crate::stats::{self, Phase};
use std::time::{Duration, Instant};

impl Ring {
    /// The next operation's seq, in 1..2^31 (agree_call compares seqs as
    /// non-negative i32).
    pub(super) fn next_seq(&mut self) -> u32 {
        self.seq = (self.seq + 1) & 0x7fff_ffff;
        self.seq = self.seq.max(1);
        self.seq
    }

    /// The barrier before injection: nobody injects before every host has
    /// armed, so no frame arrives early. It is the call-key agreement
    /// ([`agree_call`]), which also reconciles seqs and tells whether any
    /// rank asked to `rescale` (agree on new float scales). `armed`: this
    /// host armed the slot for `seq`.
    pub(super) fn barrier(
        &mut self,
        comm: &dyn Comm,
        key: CallKey,
        seq: u32,
        armed: bool,
        rescale: bool,
    ) -> Result<Barrier, DatapathError> {
        let started = Instant::now();
        let agreed = agree_call(comm, key, seq, rescale, self.prober.as_deref_mut())?;
        stats::phase_done(Phase::Agree, started);
        let mut broken = !armed;
        let seq = if agreed.seq != seq {
            // A call that failed on some ranks before it took a seq and on
            // others after (an erroneous call) leaves the counters apart:
            // everyone adopts the largest. Frames that reach this host
            // before it re-armed are dropped and re-sent by recovery.
            self.seq = agreed.seq;
            broken |= armed && self.host.rearm_seq(self.slot, agreed.seq).is_err();
            agreed.seq
        } else {
            seq
        };
        Ok(Barrier {
            seq,
            broken,
            rescale: agreed.rescale,
            started,
        })
    }
}

/// What every rank must pass identically to one call on the ring, as
/// non-negative words (so that their negations exist).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CallKey(pub(super) [i32; 4]);

impl CallKey {
    pub(super) fn allreduce(
        bytes: usize,
        elem: ElemType,
        op: ReduceOp,
        precision: Precision,
    ) -> CallKey {
        let what = 1 | (elem as i32) << 4 | (op as i32) << 8 | (precision as i32) << 12;
        CallKey::new(what, bytes, 0)
    }

    pub(super) fn bcast(bytes: usize, root: usize) -> CallKey {
        CallKey::new(2, bytes, root)
    }

    fn new(what: i32, bytes: usize, extra: usize) -> CallKey {
        const LOW31: u64 = 0x7fff_ffff;
        let b = bytes as u64;
        CallKey([
            what,
            (b & LOW31) as i32,
            ((b >> 31) & LOW31) as i32,
            extra.min(LOW31 as usize) as i32,
        ])
    }
}

/// Checks that every rank makes the same call (size, type, op, precision;
/// size and root for a broadcast) before anything whose size depends on it;
/// being an allreduce, it is also a barrier. An erroneous program (counts,
/// datatypes, ops or roots that differ across ranks) would otherwise have
/// the ranks run different sequences of collectives (a hang), complete
/// silently with truncated or foreign data, or reach MPI's fallback call
/// with mismatched counts. One MAX allreduce of the key and its negation
/// gives every rank each word's largest and smallest value: the same
/// verdict everywhere, an error on every rank, no buffer touched.
///
/// Also returns the largest seq of any rank (see [`Ring::barrier`]) and
/// whether any rank asked to rescale.
///
/// A rank may reach this exchange arbitrarily late, so it has no deadline;
/// while it waits, `prober` watches the other hosts: one that stops
/// answering for ERAR_TIMEOUT_MS (its link or the host is gone) fails the
/// call here instead of hanging it.
fn agree_call(
    comm: &dyn Comm,
    key: CallKey,
    seq: u32,
    rescale: bool,
    prober: Option<&mut Prober>,
) -> Result<Agreed, DatapathError> {
    let mut words = [0i32; 11];
    for (i, k) in key.0.iter().enumerate() {
        words[i] = *k;
        words[4 + i] = -*k;
    }
    let seq_word = (seq & 0x7fff_ffff) as i32;
    words[8] = seq_word;
    words[9] = -seq_word;
    words[10] = rescale as i32;
    opening_max(comm, &mut words, prober)?;
    check_keys(&words)?;
    Ok(Agreed {
        seq: words[8] as u32,
        rescale: words[10] != 0,
    })
}

/// The MAX over ranks of `words` in the exchange that opens a call: a rank
/// may reach it arbitrarily late, so it has no deadline; while it waits,
/// `prober` watches the other hosts (see [`agree_call`]).
pub(super) fn opening_max(
    comm: &dyn Comm,
    words: &mut [i32],
    prober: Option<&mut Prober>,
) -> Result<(), DatapathError> {
    let timeout = Config::get().timeout_ms;
    match prober {
        Some(p) if timeout > 0 => {
            let within = Duration::from_millis(timeout);
            p.start();
            let agreed = comm.allreduce_max_i32_watched(words, &mut || p.check(within));
            p.stop();
            agreed
        }
        _ => comm.allreduce_max_i32(words),
    }
}

/// After a MAX over `[key, -key, ..]`: every rank gave the same key, or the
/// call is erroneous (an error on every rank).
pub(super) fn check_keys(words: &[i32]) -> Result<(), DatapathError> {
    if (0..4).any(|i| words[i] != -words[4 + i]) {
        return Err(DatapathError::Failed(
            "the ranks' arguments differ (count, datatype, op or root): erroneous call".into(),
        ));
    }
    Ok(())
}

/// What [`agree_call`] found every rank to say.
struct Agreed {
    /// The largest seq.
    seq: u32,
    /// Some rank must agree on new float scales before injecting.
    rescale: bool,
}

/// Past the barrier: the agreed seq, whether this host's datapath is
/// unusable for it, whether some rank asked to rescale, and when the
/// barrier began (ERAR_STALL_MS counts from there).
pub(super) struct Barrier {
    pub(super) seq: u32,
    pub(super) broken: bool,
    pub(super) rescale: bool,
    pub(super) started: Instant,
}
