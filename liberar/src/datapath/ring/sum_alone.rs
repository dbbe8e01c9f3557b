//! A float SUM segment on a ring that runs alone (every rank has NACKs on),
//! with no MPI exchange: the scales are agreed through the ring itself.
//!
//! Each host summarizes its blocks ([`FloatSum::summarize`]) and joins the
//! operation's barrier in the kernel with what its slot holds:
//! * its data, encoded already on the scales agreed in operation `at`,
//!   because its summaries are those it gave that agreement: it joins with
//!   the call key marked `at` ([`CallKey::on_scales_of`]). If every host
//!   does, every host's summaries are unchanged, so the MAX over them, and
//!   the scales, are what they were: the data operation runs alone.
//! * otherwise its summaries, armed as a MAX_I32 operation: it joins with
//!   the plain call key. If every host does, that operation runs alone and
//!   leaves the MAX of every host's summaries in each slot: the agreement,
//!   made in the ring. Each host encodes on it, arms the other slot, and
//!   the data operation meets in the kernel again (everyone has encoded
//!   before anyone injects) and runs alone.
//!
//! Hosts that join differently (some summaries changed, others not; an
//! erroneous call; a host that could not arm) abort the barrier on every
//! host before anything is sent, and the segment goes on over MPI as on a
//! ring that does not run alone: [`SumAlone::Disagreed`].
//!
//! The barriers have no deadline, as an exact operation's: a rank may be
//! arbitrarily late, and a host that left a barrier on a timer while
//! another passed it would split the ranks between the ring and MPI. A
//! host or link that is gone is caught by the prober while they wait;
//! past them, a segment that makes no progress for ERAR_STALL_MS (every
//! frame can be re-sent, so a live ring always progresses) ends in an
//! error, with the caller's buffer untouched. (The fallback to MPI after a
//! stall is for rings that do not run alone, where the verdict lets every
//! rank agree on it.)
//!
//! Like an exact operation run alone, the result is final the moment the
//! host holds every chunk (the kernel adds integers on agreed scales, so
//! it is the same on every host); the contract's finish (blocks no grid
//! carries, the bounded certificate's repairs) reads only final words and
//! agreed scales, so every rank takes the same steps for it, and none when
//! there is nothing to complete. The repairs' inputs are gathered through
//! the ring too ([`Ring::gather`]); blocks no grid carries (NaN, ±∞,
//! ranges too wide) go to MPI.

use super::armed::{Barrier, CallKey, Outcome, Role};
use super::call::Seg;
use super::{Ring, CHUNKS_PER_SLOT};
use crate::config::Precision;
use crate::datapath::codec::{Layout, Plan};
use crate::datapath::{wire, Comm, DatapathError};
use crate::stats::{self, Phase};
use std::sync::Arc;
use std::time::Instant;

/// How a float SUM segment run alone ended.
pub(super) enum SumAlone {
    /// The data operation ran, on the ring's current slot, or an operation
    /// on that slot failed (Err: the caller disarms it).
    Ran(Result<Outcome, DatapathError>),
    /// The agreed scales carry no block (every host knows): MPI completes
    /// the segment.
    ByMpi,
    /// The hosts did not all join the same way: every rank agrees over MPI,
    /// on the operation (and slot) the ring is at.
    Disagreed,
}

/// The wire op of the agreement: the MAX over hosts of summary words.
const AGREE: Plan = Plan::Raw {
    op: wire::ERAR_OP_MAX_I32,
    size: 4,
};

/// The wire op of the repairs' gather: disjoint regions ORed.
const GATHER: Plan = Plan::Raw {
    op: wire::ERAR_OP_OR,
    size: 8,
};

impl Ring {
    /// Runs float SUM segment `seg` of `parts` (this member's inputs,
    /// `layout` in the slot) from operation `seq`, which this call has
    /// taken; `started`: when its preparation began.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sum_alone(
        &mut self,
        comm: &dyn Comm,
        precision: Precision,
        seg: Seg,
        seq: u32,
        parts: &[&[u8]],
        layout: Layout,
        started: Instant,
    ) -> SumAlone {
        let cb = self.chunk_bytes;
        let data_op = Plan::FloatSum(precision).wire_op() as u8;
        let host = Arc::clone(&self.host);
        // SAFETY: the slot is ours, disarmed or armed for an operation every
        // host completed (see "Generations" in ring.rs): XDP writes none of
        // it until arm().
        let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
        let fs = &mut self.float_sum;
        let unchanged = fs.summarize(parts, precision, seg.index, layout, cb, slot_buf);
        if let Some(at) = fs.agreed_at(seg.index).filter(|_| unchanged) {
            // Encoded already, on the scales agreed at `at`.
            let data = (layout.chunks, data_op, layout.flags_from);
            let b = match self.arm_and_meet(comm, seq, data, seg.key.on_scales_of(at), started) {
                Ok(b) => b,
                Err(end) => return end,
            };
            self.float_sum.reuse(seg.index);
            return SumAlone::Ran(self.run_alone(comm, b, layout.chunks, Role::Member));
        }

        // The agreement, in the ring: the MAX of every host's summaries.
        let words = self.float_sum.summaries();
        let bytes = 4 * words.len();
        for (to, w) in slot_buf[..bytes].chunks_exact_mut(4).zip(words) {
            to.copy_from_slice(&w.to_ne_bytes());
        }
        let chunks = AGREE.layout(words.len(), cb).chunks;
        let summaries = (chunks, AGREE.wire_op() as u8, chunks);
        let b = match self.arm_and_meet(comm, seq, summaries, seg.key, started) {
            Ok(b) => b,
            Err(end) => return end,
        };
        let agreed_at = b.seq;
        let agreed = self.run_alone(comm, b, chunks, Role::Member);
        if agreed.is_err() {
            return SumAlone::Ran(agreed);
        }
        // Complete on this host: its slot stays armed for the NACKs of hosts
        // still missing a frame of it, and the kernel writes no more of its
        // words (late copies are dropped by their chunk's stage).
        let encoding = Instant::now();
        let (key, n) = (seg.key.0, seg.contributors);
        let reduced = Some(&slot_buf[..bytes]);
        if !self
            .float_sum
            .adopt(reduced, precision, seg.index, key, n, agreed_at)
        {
            return SumAlone::ByMpi;
        }

        // The data, on the other generation: every host has passed the
        // barrier above, so every host completed the operation it last held.
        let seq = self.next_seq();
        // SAFETY: as above, for the ring's other slot.
        let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
        self.float_sum
            .encode(parts, precision, layout, cb, slot_buf);
        let data = (layout.chunks, data_op, layout.flags_from);
        let key = seg.key.on_scales_of(agreed_at);
        let b = match self.arm_and_meet(comm, seq, data, key, encoding) {
            Ok(b) => b,
            Err(end) => return end,
        };
        SumAlone::Ran(self.run_alone(comm, b, layout.chunks, Role::Member))
    }

    /// The bounded contract's repairs, gathered: every rank's `mine` into
    /// `all`, in rank order. On a ring that does not run alone, by MPI's
    /// allgather; otherwise through the ring. Each host writes its bytes
    /// at its rank's place in a zeroed region of the ring's next slot, and
    /// an OR of the regions runs alone (they are disjoint, so each arrives
    /// as written). Every rank certified the same final words, so every
    /// rank gathers the same size, and takes the same branch: MPI's
    /// allgather if the region does not fit a slot, or if the barrier
    /// aborts (a host could not arm).
    pub(super) fn gather(
        &mut self,
        comm: &dyn Comm,
        mine: &[u8],
        all: &mut [u8],
    ) -> Result<(), DatapathError> {
        let (len, bytes) = (mine.len(), all.len());
        let capacity = self.chunk_bytes * CHUNKS_PER_SLOT as usize;
        if !self.alone || len % 8 != 0 || bytes != len * comm.size() || bytes > capacity {
            return comm.allgather(mine, all);
        }
        let seq = self.next_seq();
        let host = Arc::clone(&self.host);
        // SAFETY: the ring's next slot, armed for an operation every host
        // completed (it passed this call's barrier after completing it).
        let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
        let region = &mut slot_buf[..bytes];
        region.fill(0);
        region[comm.rank() * len..][..len].copy_from_slice(mine);
        let chunks = GATHER.layout(bytes / 8, self.chunk_bytes).chunks;
        let armed = host
            .arm(self.slot, seq, chunks, GATHER.wire_op() as u8, 0, chunks)
            .is_ok();
        let key = CallKey::repairs(bytes);
        let outcome = match self.kernel_barrier(comm, key, (seq, armed)) {
            Ok(Some(b)) => self.run_alone(comm, b, chunks, Role::Member),
            Ok(None) => {
                self.host.disarm(self.slot);
                return comm.allgather(mine, all);
            }
            Err(e) => Err(e),
        };
        self.finish_armed(&outcome);
        outcome?;
        all.copy_from_slice(&slot_buf[..bytes]);
        Ok(())
    }

    /// Arms the ring's current slot for operation `seq` (`chunks`, wire
    /// op, `flags_from`; the preparation that began at `started` ends
    /// here) and meets the other hosts in the kernel with `key`. Err: how
    /// the segment goes on instead (the barrier aborted, or failed).
    fn arm_and_meet(
        &mut self,
        comm: &dyn Comm,
        seq: u32,
        (chunks, wire_op, flags_from): (u32, u8, u32),
        key: CallKey,
        started: Instant,
    ) -> Result<Barrier, SumAlone> {
        let armed = self
            .host
            .arm(self.slot, seq, chunks, wire_op, 0, flags_from)
            .is_ok();
        stats::phase_done(Phase::Prepare, started);
        match self.kernel_barrier(comm, key, (seq, armed)) {
            Ok(Some(b)) => Ok(b),
            Ok(None) => Err(SumAlone::Disagreed),
            Err(e) => Err(SumAlone::Ran(Err(e))),
        }
    }
}
