//! One allreduce or broadcast call on a [`Ring`], as consecutive segments of
//! at most one slot each: prepare (encode this rank's data, arm the slot),
//! agree and run the armed operation, finish (decode into the caller's
//! buffer), or let MPI complete a segment the ring could not.

use super::armed::{check_keys, opening_max, CallKey, Outcome, Repairs, Role};
use super::sum_alone::SumAlone;
use super::tune::{self, Mode, Tuned, TUNED_SEGMENT};
use super::{Ring, CHUNKS_PER_SLOT};
use crate::config::{Config, Precision, Segments};
use crate::datapath::codec::{self, Input, Layout, Plan};
use crate::datapath::copy::{copy, BCAST_STREAM_MIN, INPUT_STREAM_MIN, RESULT_STREAM_MIN};
use crate::datapath::kernel::region::{self, Region, REGION_MAX_BUFFER};
use crate::datapath::kernel::BarrierWait;
use crate::datapath::lanes::Lanes;
use crate::datapath::{reproducible, wire, Comm, DatapathError, Done, Reduction};
use crate::numerics::BLOCK_ELEMS;
use crate::select::{ElemType, ReduceOp};
use crate::stats::{self, Phase};
use std::sync::Arc;
use std::time::Instant;

/// The smallest broadcast that runs in place (ERAR_ZERO_COPY): in place
/// with its closing barrier against through the slots, OSU `osu_bcast
/// -i 300`, 4 hosts, 12 rotating rounds, best / median (docs/benchmarks.md,
/// "Session 39"): 512 KiB 1.20/1.28x, 1 MiB 1.06-1.07/1.13-1.14x; 8 hosts,
/// 6 rounds: 1.03/1.07x, 1.18/1.18x. From 128 KiB, 256 KiB read 0.95/1.00x.
/// (Session 36, on another machine: 1 MiB 0.83x best, 1.45x median.)
const BCAST_IN_PLACE_MIN: usize = 512 << 10;

/// The smallest exact allreduce that runs in place (ERAR_ZERO_COPY): in
/// place with its closing barrier against through the slots, paired calls
/// (crate::paired, session 43), OSU `osu_allreduce -T mpi_int -i 1000`,
/// 4 hosts, MTU 9000, two jobs, the four ranks' A/B: 256 KiB 0.99-1.12x,
/// 512 KiB 1.14-1.24x, 1 MiB 1.12-1.23x; `-i 400`: 2 MiB 1.13-1.27x, 4
/// MiB 1.01-1.14x, 8 MiB 1.03-1.10x, 16 MiB 1.09-1.22x.
const ALLREDUCE_IN_PLACE_MIN: usize = 256 << 10;

impl Ring {
    /// `recv = op over ranks of (send, or recv when in place)`, bitwise
    /// identical on every rank. `send.len() == recv.len()` when present.
    pub fn allreduce(
        &mut self,
        comm: &dyn Comm,
        send: Option<&[u8]>,
        recv: &mut [u8],
        (elem, op): Reduction,
    ) -> Done {
        let precision = contract(self.ranks);
        // `select::decide` routes here only pairs `datapath_reduces` admits,
        // and codec's `every_supported_pair_has_a_plan` proves each has a
        // plan: not a second decision, a guard against the two diverging.
        let plan = Plan::of(elem, op, precision)
            .ok_or_else(|| DatapathError::Declined(format!("{elem:?} {op:?} is not in-kernel")))?;
        let input = Input::Caller(send);
        #[cfg(feature = "paired")]
        let _paired = crate::paired::Call::begin(self.seq, recv.len());
        self.segments(comm, (plan, precision), input, recv, (elem, op), self.ranks)
    }

    /// A float SUM whose member contributes the inputs of its host's
    /// ranks (`parts`, in local rank order, each `recv.len()` bytes): a
    /// slice leader of the node path (datapath/node.rs). They are encoded
    /// and added as the ring adds its members', so the call is the
    /// `contributors`-rank call it stands for, under the same contract:
    /// `recv` gets the sum over every part of every host, bitwise
    /// identical on every host, except the byte ranges passed to `left`
    /// (ascending), which MPI must complete over the whole communicator
    /// (blocks no integer grid carries, segments MPI completes: the same
    /// ranges on every host). `Declined`, before anything is written, for
    /// any other op and under `reproducible`.
    pub fn allreduce_local(
        &mut self,
        comm: &dyn Comm,
        parts: &[&[u8]],
        recv: &mut [u8],
        how: Reduction,
        contributors: usize,
        left: &dyn Fn(std::ops::Range<usize>),
    ) -> Done {
        self.local(comm, parts, left, false, recv, how, contributors)
            .map(|_| ())
    }

    /// [`Ring::allreduce_local`] of a call that fits one slot, whose result
    /// may stay in the slot as words, for each of the host's ranks to
    /// decode (`codec::decode_kept`): then it returns the generation that
    /// holds them (its index in [`Ring::slot_buffer_fds`], bytes
    /// `0..recv.len()` of that buffer), and `recv` holds the block steps
    /// and repairs instead of values. They stay as they are until this
    /// ring's next operation but one. `Ok(None)`: the result is in `recv`
    /// (more repairs than fit there, or MPI completed the call). The byte
    /// ranges passed to `left` are the blocks without a step. `Declined`,
    /// before anything is written, for a call larger than a slot.
    pub fn allreduce_local_kept(
        &mut self,
        comm: &dyn Comm,
        parts: &[&[u8]],
        recv: &mut [u8],
        how: Reduction,
        contributors: usize,
        left: &dyn Fn(std::ops::Range<usize>),
    ) -> Result<Option<usize>, DatapathError> {
        self.local(comm, parts, left, true, recv, how, contributors)
    }

    /// Both of the above: the host's `parts`, `left` and whether to `keep`
    /// the result in the slot.
    #[allow(clippy::too_many_arguments)]
    fn local(
        &mut self,
        comm: &dyn Comm,
        parts: &[&[u8]],
        left: &dyn Fn(std::ops::Range<usize>),
        keep: bool,
        recv: &mut [u8],
        (elem, op): Reduction,
        contributors: usize,
    ) -> Result<Option<usize>, DatapathError> {
        let precision = contract(contributors);
        let plan = Plan::of(elem, op, precision)
            .filter(|p| matches!(p, Plan::FloatSum(Precision::Bounded | Precision::Quantized)))
            .filter(|_| parts.iter().all(|p| p.len() == recv.len()))
            .ok_or_else(|| {
                DatapathError::Declined(format!("{elem:?} {op:?} {precision:?} from local parts"))
            })?;
        if keep && recv.len() > self.segment_elems(plan) * elem.size() {
            return Err(DatapathError::Declined(format!(
                "{} bytes do not fit one slot",
                recv.len()
            )));
        }
        let input = Input::Local { parts, left, keep };
        let how = (elem, op);
        self.segments(comm, (plan, precision), input, recv, how, contributors)?;
        Ok((keep && self.float_sum.kept()).then_some(self.result_gen))
    }

    /// Runs a call as consecutive segments of at most one slot each.
    fn segments(
        &mut self,
        comm: &dyn Comm,
        (plan, precision): (Plan, Precision),
        input: Input<'_>,
        recv: &mut [u8],
        (elem, op): Reduction,
        contributors: usize,
    ) -> Done {
        let count = recv.len() / elem.size();
        let in_place = self.allreduce_in_place(plan, &input, recv.len());
        let registered = in_place
            && match input {
                Input::Caller(Some(send)) => self.allreduce_regions(send, recv),
                _ => false,
            };
        let tuned = self.tuned(plan, &input, recv.len(), op);
        let capacity = self.segment_len(plan, &input, count, tuned.map(|t| t.mode));
        let mut key = CallKey::allreduce(recv.len(), elem, op, precision);
        if let Plan::Raw { .. } = plan {
            key = key.in_segments_of(capacity);
        }
        let started = Instant::now();
        self.carried = None;
        let mut parts: Vec<&[u8]> = Vec::new();
        let mut start = 0;
        while start < count {
            let len = capacity.min(count - start);
            let bytes = start * elem.size()..(start + len) * elem.size();
            let at = bytes.start;
            let shifted;
            let seg_input = match input {
                Input::Caller(send) => Input::Caller(send.map(|s| &s[bytes.clone()])),
                Input::Local {
                    parts: all,
                    left,
                    keep,
                } => {
                    parts.clear();
                    parts.extend(all.iter().map(|p| &p[bytes.clone()]));
                    shifted = move |r: std::ops::Range<usize>| left(r.start + at..r.end + at);
                    Input::Local {
                        parts: &parts,
                        left: &shifted,
                        keep,
                    }
                }
            };
            let seg = Seg {
                index: start / capacity,
                key,
                contributors,
                carry: tuned.filter(|_| start + len == count).and_then(|t| t.carry),
                registered,
            };
            self.segment(comm, plan, seg, seg_input, &mut recv[bytes], (elem, op))?;
            start += len;
        }
        if in_place {
            self.in_place_done(comm)?;
        }
        if let Some(t) = tuned {
            if t.mode == Mode::Segmented {
                stats::record_segmented();
            }
            let carried = self.carried.take();
            let took = (recv.len(), started.elapsed());
            self.tuner.ran(t, took, (carried, op, self.ranks));
        }
        Ok(())
    }

    /// The tuner's call (ring/tune.rs) for an exact call of the caller's
    /// own data on a ring that runs alone, when `ERAR_SEGMENT_BYTES` is
    /// `auto`; `None` for any other.
    fn tuned(&self, plan: Plan, input: &Input<'_>, bytes: usize, op: ReduceOp) -> Option<Tuned> {
        match (plan, input, Config::get().segments) {
            (Plan::Raw { .. }, Input::Caller(_), Segments::Tuned) if self.alone => {
                self.tuner.call(bytes, op)
            }
            _ => None,
        }
    }

    /// Whether an allreduce runs on the caller's buffers where they are
    /// registered, and so ends with a barrier (as a broadcast in place,
    /// see [`Ring::in_place_done`]): an exact one of the caller's own data
    /// (not `MPI_IN_PLACE`: XDP writes partial results into the receive
    /// buffer, which must not be the input MPI would complete the call
    /// from) on a ring that runs alone. Decided alike on every rank, by
    /// the call and settings every rank shares; whether a rank's buffers
    /// are registered is its own affair.
    fn allreduce_in_place(&self, plan: Plan, input: &Input<'_>, bytes: usize) -> bool {
        matches!((plan, input), (Plan::Raw { .. }, Input::Caller(Some(_))))
            && self.alone
            && Config::get().zero_copy
            && (ALLREDUCE_IN_PLACE_MIN..=REGION_MAX_BUFFER).contains(&bytes)
    }

    /// The send and receive regions a segment runs on, if its call's
    /// buffers are registered (`Seg::registered`); None: the slot.
    fn registered_pair(&self, seg: &Seg) -> Option<&(Region, Region)> {
        self.allreduce_regions.as_ref().filter(|_| seg.registered)
    }

    /// An exact allreduce (an integer or bitwise op, carried raw) whose
    /// contribution `fill(offset, bytes)` writes straight into the slot,
    /// `offset` being where `bytes` start in the call: a host's ranks
    /// reduce their inputs there (datapath/node.rs), with no copy of the
    /// reduction in between. Only on a ring that runs exact operations
    /// alone, where nothing needs the contribution again once injected (no
    /// segment falls back to MPI); `Declined` otherwise, before anything
    /// is written. `recv` gets the result, bitwise identical on every rank.
    pub fn allreduce_filled(
        &mut self,
        comm: &dyn Comm,
        recv: &mut [u8],
        elem: ElemType,
        op: ReduceOp,
        fill: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Done {
        let plan = self.filled_plan(elem, op)?;
        let key = CallKey::allreduce(recv.len(), elem, op, Config::get().precision);
        let capacity = self.segment_elems(plan) * elem.size();
        for (index, seg) in recv.chunks_mut(capacity).enumerate() {
            let ran =
                self.filled_segment(comm, (plan, key, elem), index * capacity, seg.len(), fill)?;
            // SAFETY: our slot, which holds the final result: XDP writes
            // none of it any more (see "Generations" in ring.rs).
            let slot_buf = unsafe { self.host.slot_slice_mut(self.slot) };
            copy(seg, &slot_buf[..seg.len()], RESULT_STREAM_MIN);
            stats::phase_done(Phase::Finish, ran);
        }
        Ok(())
    }

    /// [`Ring::allreduce_filled`] of a `len`-byte call that fits one slot,
    /// whose result stays in the slot instead of being copied out: returns
    /// the generation that holds it (its index in
    /// [`Ring::slot_buffer_fds`]), bytes `0..len` of that buffer. They stay
    /// as they are until this ring's next operation but one fills the slot
    /// again. `Declined`, before anything is written, for a call larger
    /// than a slot.
    pub fn allreduce_kept(
        &mut self,
        comm: &dyn Comm,
        len: usize,
        elem: ElemType,
        op: ReduceOp,
        fill: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<usize, DatapathError> {
        let plan = self.filled_plan(elem, op)?;
        if len > self.segment_elems(plan) * elem.size() {
            return Err(DatapathError::Declined(format!(
                "{len} bytes do not fit one slot"
            )));
        }
        let key = CallKey::allreduce(len, elem, op, Config::get().precision);
        let ran = self.filled_segment(comm, (plan, key, elem), 0, len, fill)?;
        stats::phase_done(Phase::Finish, ran);
        Ok(self.generation())
    }

    /// The plan of a filled call: exact ops on a ring that runs alone.
    fn filled_plan(&self, elem: ElemType, op: ReduceOp) -> Result<Plan, DatapathError> {
        Plan::of(elem, op, Config::get().precision)
            .filter(|p| matches!(p, Plan::Raw { .. }) && self.alone)
            .ok_or_else(|| DatapathError::Declined(format!("{elem:?} {op:?} is not exact here")))
    }

    /// One segment of a filled call: bytes `at..at + len` of the call,
    /// `fill`ed into the next slot and run on the ring; on success the
    /// result is in `self.slot`. Returns when the ring finished.
    fn filled_segment(
        &mut self,
        comm: &dyn Comm,
        (plan, key, elem): (Plan, CallKey, ElemType),
        at: usize,
        len: usize,
        fill: &mut dyn FnMut(usize, &mut [u8]),
    ) -> Result<Instant, DatapathError> {
        let started = Instant::now();
        let seq = self.next_seq();
        let host = Arc::clone(&self.host);
        // SAFETY: as in `segment`: our slot, which XDP writes none of until
        // arm().
        let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
        fill(at, &mut slot_buf[..len]);
        let chunks = plan.layout(len / elem.size(), self.chunk_bytes).chunks;
        let armed = host
            .arm(self.slot, seq, chunks, plan.wire_op() as u8, 0, chunks)
            .is_ok();
        stats::phase_done(Phase::Prepare, started);
        let outcome = self.run_exact(comm, key, (seq, armed), chunks, Role::Member);
        let ran = Instant::now();
        self.finish_armed(&outcome);
        if let Outcome::Fallback(why) = outcome? {
            return Err(DatapathError::Failed(format!(
                "seq {seq}: an exact operation cannot fall back ({why})"
            )));
        }
        Ok(ran)
    }

    /// Broadcast of `buf` (bytes) from `root`: the root's data enters the
    /// network once and travels the ring as all-gather frames, each host
    /// keeping a copy and forwarding it (a pipelined chain).
    pub fn bcast(
        &mut self,
        comm: &dyn Comm,
        buf: &mut [u8],
        root: usize,
    ) -> Result<(), DatapathError> {
        let key = CallKey::bcast(buf.len(), root);
        #[cfg(feature = "paired")]
        let _paired = crate::paired::Call::begin(self.seq, buf.len());
        let segment = self.chunk_bytes * CHUNKS_PER_SLOT as usize;
        // Chosen alike on every rank (by the call's size and a setting
        // every rank shares): in place, the call ends with a barrier.
        let in_place = self.alone
            && Config::get().zero_copy
            && (BCAST_IN_PLACE_MIN..=REGION_MAX_BUFFER).contains(&buf.len());
        // Chosen by each rank for itself: its buffer registered.
        let registered = in_place && self.bcast_region(buf);
        for seg in buf.chunks_mut(segment) {
            self.bcast_segment(comm, key, seg, root, false, registered)?;
        }
        if in_place {
            self.in_place_done(comm)?;
        }
        Ok(())
    }

    /// Gives the registered buffer its private pages back, and registers
    /// none any more, once the program has taken SIGBUS over: a page of it
    /// that the program's allocator drops would fault into the program's
    /// own handler, which cannot repair it. Called before each call on this
    /// ring's communicator that could take the fast path, whichever path it
    /// then takes (MPI's too); one `sigaction` query, only while a buffer
    /// is registered.
    pub fn release_region_if_taken_over(&mut self) {
        if (self.region.is_some() || self.allreduce_regions.is_some())
            && region::sigbus_taken_over()
        {
            log::debug!("liberar: calls copy through the slots: SIGBUS taken over");
            self.region = None;
            self.allreduce_regions = None;
            self.region_failed = true;
        }
    }

    /// The barrier that ends a call in place (a broadcast's, an
    /// allreduce's): a host leaves it once it and its successor hold every
    /// chunk. A host's XDP re-sends chunks from the caller's buffers (the
    /// caller's again once the call returns) to its successor only, which
    /// asks for none once it holds them all; the hosts further on ask
    /// theirs, which wait in turn. The root
    /// leaves as soon as the first host is complete, the last host at
    /// once (the root holds everything). Against every host waiting for
    /// the last: paired calls (crate::paired, session 42), `osu_bcast -i
    /// 1000`, 4 hosts, 1.02-1.04x at 1 MiB, 1.00-1.04x at 2 MiB, 0.99-1.01x
    /// at 4 MiB (ranks 1 and 2 gain most).
    fn in_place_done(&mut self, comm: &dyn Comm) -> Result<(), DatapathError> {
        let seq = self.next_seq();
        let key = CallKey::in_place_done();
        match self.kernel_barrier_until(comm, key, (seq, true), BarrierWait::Successor)? {
            Some(_) => Ok(()),
            None => Err(DatapathError::Failed(format!(
                "the barrier ending a call in place (seq {seq}) aborted: ERAR_ZERO_COPY must \
                 be the same on every rank"
            ))),
        }
    }

    /// [`Ring::bcast`] of a `buf` that fits one slot, whose data stays in
    /// the slot on the ranks other than the root instead of being copied
    /// to `buf`: returns the generation that holds it, as
    /// [`Ring::allreduce_kept`] does; `None` where `buf` holds it (the
    /// root, and every rank when MPI completed the call). `Declined`,
    /// before anything is sent, for a `buf` larger than a slot.
    pub fn bcast_kept(
        &mut self,
        comm: &dyn Comm,
        buf: &mut [u8],
        root: usize,
    ) -> Result<Option<usize>, DatapathError> {
        if buf.len() > self.chunk_bytes * CHUNKS_PER_SLOT as usize {
            return Err(DatapathError::Declined(format!(
                "{} bytes do not fit one slot",
                buf.len()
            )));
        }
        self.bcast_segment(
            comm,
            CallKey::bcast(buf.len(), root),
            buf,
            root,
            true,
            false,
        )
    }

    /// One segment of a broadcast; `keep`: leave the data in the slot
    /// rather than copy it to `buf` (returns its generation); `registered`
    /// (never with `keep`): `buf` lies in the buffer registered in the
    /// ring's region, which XDP reads (root) or writes (the others) instead
    /// of the slot.
    fn bcast_segment(
        &mut self,
        comm: &dyn Comm,
        key: CallKey,
        buf: &mut [u8],
        root: usize,
        keep: bool,
        registered: bool,
    ) -> Result<Option<usize>, DatapathError> {
        let started = Instant::now();
        let is_root = comm.rank() == root;
        let chunks = buf.len().div_ceil(self.chunk_bytes) as u32;
        let seq = self.next_seq();
        let (host, slot) = (Arc::clone(&self.host), self.slot);
        // SAFETY: our slot, disarmed or armed for an operation every host
        // completed (see "Generations" in ring.rs): XDP writes none of it
        // until arm().
        let slot_buf = unsafe { host.slot_slice_mut(slot) };
        let region = self.region.as_ref().filter(|_| registered);
        let place = region.map(|r| (r.id(), r.offset_of(buf)));
        if let Some(r) = region.filter(|_| is_root) {
            r.copy_edges_in(buf);
            stats::record_bcast_in_place();
        } else if is_root {
            // On every lane: one thread takes about as long as a quarter
            // of the chain's own work.
            Lanes::get().copy(&mut slot_buf[..buf.len()], buf);
        }
        let (input, output) = if is_root {
            (place, None)
        } else {
            (None, place)
        };
        let armed = host
            .arm_reading(
                slot,
                seq,
                chunks,
                wire::ERAR_OP_BCAST as u8,
                root as u32,
                chunks,
                (input, output),
            )
            .is_ok();
        let role = if is_root { Role::Source } else { Role::Sink };
        stats::phase_done(Phase::Prepare, started);
        let outcome = if self.alone {
            self.run_exact(comm, key, (seq, armed), chunks, role)
        } else {
            self.barrier(comm, key, (seq, armed), false)
                .and_then(|b| self.run_armed(comm, b, chunks, role, false, None))
        };
        let ran = Instant::now();
        self.finish_armed(&outcome);
        if let Outcome::Fallback(why) = outcome? {
            log::debug!("liberar: broadcast segment seq {seq} completed by MPI ({why})");
            stats::record_fallback_bytes(buf.len());
            // The root's data is untouched; MPI writes the others' whole
            // (in place, XDP may have written part of them already).
            return comm.pmpi_bcast(buf, root).map(|()| None);
        }
        let kept = (keep && !is_root).then_some(self.generation());
        if !is_root && !keep {
            // After the call, not chunk by chunk while it runs: the copy
            // then competes with the chain for the same CPUs and their
            // caches (16 MiB on 4 hosts: 1.6x the CPU time, measured).
            match self.region.as_ref().filter(|_| registered) {
                Some(r) => {
                    r.copy_edges_out(buf);
                    stats::record_bcast_in_place();
                }
                None => copy(buf, &slot_buf[..buf.len()], BCAST_STREAM_MIN),
            }
        }
        stats::phase_done(Phase::Finish, ran);
        Ok(kept)
    }

    /// After an armed operation: its slot is disarmed, unless the operation
    /// ran alone and completed (see "Generations" in ring.rs): then it
    /// stays armed, so that its XDP answers the NACKs of hosts still
    /// missing a frame of it.
    pub(super) fn finish_armed(&self, outcome: &Result<Outcome, DatapathError>) {
        if !matches!(outcome, Ok(Outcome::CompleteAlone)) {
            self.host.disarm(self.slot);
        }
    }

    /// Elements of the caller's type one segment holds.
    fn segment_elems(&self, plan: Plan) -> usize {
        plan.segment_elems(
            self.chunk_bytes * CHUNKS_PER_SLOT as usize,
            self.chunk_bytes,
        )
    }

    /// Elements of each segment of a `count`-element call from `input`: as
    /// many as a slot holds, or, for an exact call (integer or bitwise,
    /// carried raw) of the caller's own data, equal segments
    /// ([`equal_segments`]) of at most `ERAR_SEGMENT_BYTES`, or of
    /// [`TUNED_SEGMENT`] when the tuner chose segments.
    fn segment_len(
        &self,
        plan: Plan,
        input: &Input<'_>,
        count: usize,
        tuned: Option<Mode>,
    ) -> usize {
        let slot = self.segment_elems(plan);
        let (most, size) = match (plan, input, Config::get().segments, tuned) {
            (Plan::Raw { size, .. }, Input::Caller(_), Segments::Fixed(most), _) => (most, size),
            (Plan::Raw { size, .. }, Input::Caller(_), _, Some(Mode::Segmented)) => {
                (TUNED_SEGMENT, size)
            }
            _ => return slot,
        };
        equal_segments(count, most / size, slot)
    }

    /// One operation on the kernel ring over at most one slot of data.
    ///
    /// On a ring that runs alone, every operation makes no MPI exchange: it
    /// meets the other hosts in the kernel, a float SUM agrees on its
    /// scales there too (ring/sum_alone.rs), and a float MAX/MIN says
    /// there whether its data holds a NaN. Otherwise, a float SUM
    /// whose block summaries are, on every rank, what they were at this
    /// segment's last scale agreement reuses that agreement's scales (the
    /// same ones a new exchange would give), so it makes two exchanges:
    /// the barrier and the verdict. If not, the barrier says so, and the
    /// ranks agree on new scales and meet once more before anyone injects.
    fn segment(
        &mut self,
        comm: &dyn Comm,
        plan: Plan,
        seg: Seg,
        input: Input<'_>,
        recv: &mut [u8],
        how: Reduction,
    ) -> Done {
        let started = Instant::now();
        let count = recv.len() / how.0.size();
        let layout = plan.layout(count, self.chunk_bytes);
        let mut seq = self.next_seq();
        let host = Arc::clone(&self.host);
        let one;
        let parts: &[&[u8]] = match input {
            Input::Caller(send) => {
                one = [send.unwrap_or(&*recv)];
                &one
            }
            Input::Local { parts, .. } => parts,
        };
        let (chunks, wire_op) = (layout.chunks, plan.wire_op() as u8);
        let cb = self.chunk_bytes;

        let mut local_special = false;
        let mut rescale = false;
        match plan {
            Plan::Raw { size, .. } if self.alone => {
                // SAFETY: the slot is ours (allocated in establish),
                // disarmed or armed for an operation every host completed
                // (see "Generations" in ring.rs): the XDP program writes
                // none of it until arm().
                let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
                // The tuner's word rides in the last chunk's padding, past
                // the caller's bytes: in the slot, or in the regions (whose
                // places past the buffer's end hold a last chunk whole,
                // REGION_MAX_BUFFER), so that every rank reads the word
                // the ring reduced, registered or not.
                let at = seg.carry.and_then(|word| {
                    Some((tune::carry_at(parts[0].len(), chunks as usize * cb)?, word))
                });
                let (armed, carried_at) = match self.registered_pair(&seg) {
                    Some((send, into)) => {
                        // XDP reads the input where the caller has it and
                        // writes the result where the caller wants it.
                        send.copy_edges_in(parts[0]);
                        let carried_at = at.and_then(|(at, word)| {
                            let mut w = [0u8; 8];
                            tune::put_carried(&mut w, 0, size, word);
                            send.write_past_end(parts[0], at, &w).then_some(at)
                        });
                        stats::record_allreduce_in_place();
                        let places = (
                            Some((send.id(), send.offset_of(parts[0]))),
                            Some((into.id(), into.offset_of(recv))),
                        );
                        let armed =
                            host.arm_reading(self.slot, seq, chunks, wire_op, 0, chunks, places);
                        (armed, carried_at)
                    }
                    None => {
                        copy(&mut slot_buf[..parts[0].len()], parts[0], INPUT_STREAM_MIN);
                        let carried_at = at.map(|(at, word)| {
                            tune::put_carried(slot_buf, at, size, word);
                            at
                        });
                        (
                            host.arm(self.slot, seq, chunks, wire_op, 0, chunks),
                            carried_at,
                        )
                    }
                };
                let armed = armed.is_ok();
                stats::phase_done(Phase::Prepare, started);
                let outcome = self.run_exact(comm, seg.key, (seq, armed), chunks, Role::Member);
                if let (Some(at), Ok(Outcome::CompleteAlone)) = (carried_at, &outcome) {
                    // Complete here: the kernel writes no more of the slot
                    // or the receive buffer.
                    let mut w = [0u8; 8];
                    self.carried = match self.registered_pair(&seg) {
                        Some((_, into)) => into
                            .read_past_end(recv, at, &mut w)
                            .then(|| tune::carried(&w, 0, size)),
                        None => Some(tune::carried(slot_buf, at, size)),
                    };
                }
                return self.finish_segment(comm, plan, seg, layout, outcome, input, recv, how);
            }
            Plan::FloatSum(precision) if self.alone => {
                match self.sum_alone(comm, precision, seg, seq, parts, layout, started) {
                    SumAlone::Ran(outcome) => {
                        return self
                            .finish_segment(comm, plan, seg, layout, outcome, input, recv, how)
                    }
                    SumAlone::ByMpi => {
                        stats::record_fallback_bytes(recv.len());
                        return complete_by_mpi(comm, plan, input, recv, how);
                    }
                    // The hosts did not all join alike: they agree over
                    // MPI, on the operation (and slot) the ring is at.
                    SumAlone::Disagreed => (seq, rescale) = (self.seq, true),
                }
            }
            Plan::FloatOrder(_) if self.alone => {
                // SAFETY: as above.
                let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
                local_special = codec::encode_order(parts[0], slot_buf);
                let armed = host.arm(self.slot, seq, chunks, wire_op, 0, chunks).is_ok();
                stats::phase_done(Phase::Prepare, started);
                // A NaN in this rank's data vetoes the ring (MPI completes
                // the call): said in the barrier's key, so that the ranks
                // agree on it with no exchange when none has one.
                let key = if local_special {
                    seg.key.vetoed()
                } else {
                    seg.key
                };
                let ran = match self.kernel_barrier(comm, key, (seq, armed)) {
                    Ok(Some(b)) if !local_special => {
                        Some(self.run_alone(comm, b, chunks, Role::Member))
                    }
                    // Every rank has a NaN: nobody injects.
                    Ok(Some(_)) => Some(Ok(Outcome::Fallback("NaN in the data"))),
                    // Some ranks have one: the MPI barrier and the verdict
                    // below agree on it (the keys compared there first).
                    Ok(None) => None,
                    Err(e) => Some(Err(e)),
                };
                if let Some(outcome) = ran {
                    return self.finish_segment(comm, plan, seg, layout, outcome, input, recv, how);
                }
            }
            _ => {
                // SAFETY: as above.
                let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
                // Encode this rank's contribution (float SUM: on the last
                // agreed scales, if this rank's summaries have not changed
                // since).
                match plan {
                    // (Several parts only ever come with a float SUM plan.)
                    Plan::Raw { .. } => {
                        copy(&mut slot_buf[..parts[0].len()], parts[0], INPUT_STREAM_MIN)
                    }
                    Plan::FloatSum(precision) => {
                        let fs = &mut self.float_sum;
                        let unchanged =
                            fs.summarize(parts, precision, seg.index, layout, cb, slot_buf);
                        if let Some(words) = fs.opening_words(seg.index, seg.key.0, !unchanged) {
                            // The last call rescaled: agree on the scales in
                            // the exchange that opens this one.
                            opening_max(comm, words, self.prober.as_deref_mut())?;
                            check_keys(words)?;
                            let n = seg.contributors;
                            let fits = match fs
                                .take_opening(seg.index, precision, seg.key.0, n, seq)
                            {
                                Some(fits) => fits,
                                None => fs.agree(comm, precision, seg.index, seg.key.0, n, seq)?,
                            };
                            if !fits {
                                // Every rank knows no block fits: skip the ring.
                                stats::record_fallback_bytes(recv.len());
                                return complete_by_mpi(comm, plan, input, recv, how);
                            }
                            fs.encode(parts, precision, layout, cb, slot_buf);
                        } else if unchanged {
                            // Encoded already, on these scales.
                            fs.reuse(seg.index);
                        } else {
                            rescale = true;
                        }
                    }
                    Plan::FloatOrder(_) => local_special = codec::encode_order(parts[0], slot_buf),
                }
            }
        }

        // A bounded call's verdict carries its repairs (from its segment's
        // second call on: the capacity follows the last count).
        let repairs = (plan == Plan::FloatSum(Precision::Bounded)).then(|| Repairs {
            capacity: self.float_sum.verdict_capacity(seg.index, count),
            layout,
            parts,
        });
        let armed = self
            .host
            .arm(self.slot, seq, chunks, wire_op, 0, layout.flags_from)
            .is_ok();
        stats::phase_done(Phase::Prepare, started);
        let outcome = match self.barrier(comm, seg.key, (seq, armed), rescale) {
            Ok(b) if b.rescale => {
                // The key agreed, so the summary exchange's size does too.
                let rescaled = Instant::now();
                let Plan::FloatSum(precision) = plan else {
                    unreachable!("only float SUM asks for new scales")
                };
                let n = seg.contributors;
                let fits = match self
                    .float_sum
                    .agree(comm, precision, seg.index, seg.key.0, n, seq)
                {
                    Ok(fits) => fits,
                    Err(e) => {
                        self.host.disarm(self.slot);
                        return Err(e);
                    }
                };
                if fits {
                    // SAFETY: as above; armed, but nobody injects before
                    // the barrier below.
                    let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
                    self.float_sum
                        .encode(parts, precision, layout, cb, slot_buf);
                    stats::phase_done(Phase::Prepare, rescaled);
                    // Everyone has encoded before anyone injects.
                    self.barrier(comm, seg.key, (b.seq, !b.broken), false)
                        .and_then(|b| {
                            let repairs = repairs.as_ref();
                            self.run_armed(comm, b, chunks, Role::Member, local_special, repairs)
                        })
                } else {
                    // Every rank knows no block fits: nobody injected.
                    Ok(Outcome::Fallback("no block fits an integer grid"))
                }
            }
            Ok(b) => {
                let repairs = repairs.as_ref();
                self.run_armed(comm, b, chunks, Role::Member, local_special, repairs)
            }
            Err(e) => Err(e),
        };
        self.finish_segment(comm, plan, seg, layout, outcome, input, recv, how)
    }

    /// After a segment's operation ran on the ring's current slot: its
    /// result decoded into the caller's buffer, or, if the ranks let MPI
    /// complete it, MPI's.
    #[allow(clippy::too_many_arguments)]
    fn finish_segment(
        &mut self,
        comm: &dyn Comm,
        plan: Plan,
        seg: Seg,
        layout: Layout,
        outcome: Result<Outcome, DatapathError>,
        input: Input<'_>,
        recv: &mut [u8],
        how: Reduction,
    ) -> Done {
        let ran = Instant::now();
        self.finish_armed(&outcome);
        if let Outcome::Fallback(why) = outcome? {
            log::debug!("liberar: segment seq {} completed by MPI ({why})", self.seq);
            stats::record_fallback_bytes(recv.len());
            // Nothing was written to `recv` yet: in place, it still holds
            // the caller's input.
            return complete_by_mpi(comm, plan, input, recv, how);
        }

        // Decode into the caller's buffer; blocks MPI must reduce go last.
        let host = Arc::clone(&self.host);
        // SAFETY: our slot, disarmed, or armed for the operation that just
        // completed on this host: the kernel writes no more of its words
        // (late copies are dropped by their chunk's stage). The repairs'
        // gather below runs on the ring's other slot.
        let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
        match plan {
            Plan::Raw { .. } => match self.registered_pair(&seg) {
                Some((_, into)) => into.copy_edges_out(recv),
                None => copy(recv, &slot_buf[..recv.len()], RESULT_STREAM_MIN),
            },
            Plan::FloatSum(precision) => {
                let cb = self.chunk_bytes;
                // Out of the ring while it finishes, so that the ring can
                // gather the repairs itself (on its next slot: the result
                // stays in this one's).
                self.result_gen = self.generation();
                let mut sum = std::mem::take(&mut self.float_sum);
                let gather = &mut |mine: &[u8], all: &mut [u8]| self.gather(comm, mine, all);
                let finished = sum.finish(
                    comm, seg.index, precision, layout, cb, slot_buf, input, recv, how, gather,
                );
                self.float_sum = sum;
                finished?;
            }
            Plan::FloatOrder(_) => codec::decode_order(slot_buf, recv),
        }
        stats::phase_done(Phase::Finish, ran);
        Ok(())
    }
}

/// Completes a segment through MPI: under the `reproducible` contract with
/// the bits the ring would have given, otherwise with the caller's own
/// datatype and op.
fn complete_by_mpi(
    comm: &dyn Comm,
    plan: Plan,
    input: Input<'_>,
    recv: &mut [u8],
    how: Reduction,
) -> Done {
    match (plan, input) {
        (Plan::FloatSum(Precision::Reproducible), Input::Caller(send)) => {
            reproducible::allreduce(comm, send, recv)
        }
        _ => input.pmpi_allreduce(comm, 0..recv.len(), recv, how),
    }
}

/// The float SUM contract of a call with `contributors` inputs: the
/// configured one, but only a correctly rounded sum meets `bounded`'s
/// bound on 2.
fn contract(contributors: usize) -> Precision {
    match Config::get().precision {
        Precision::Bounded if contributors < 3 => Precision::Reproducible,
        p => p,
    }
}

/// Elements of each segment when a `count`-element call runs in segments
/// of at most `most` elements, none above `slot` (a slot's worth, a
/// multiple of `BLOCK_ELEMS`): as few segments as that allows, all of one
/// length, a whole number of blocks, the last one shorter by what is left.
/// Equal, so that no call ends in a segment of a few elements that costs a
/// barrier of its own (16 MiB in 1 MiB segments rounded to blocks made 16
/// and a 17th of a few KB).
pub(super) fn equal_segments(count: usize, most: usize, slot: usize) -> usize {
    let most = most.max(BLOCK_ELEMS).min(slot);
    let segments = count.div_ceil(most).max(1);
    count
        .div_ceil(segments)
        .next_multiple_of(BLOCK_ELEMS)
        .min(slot)
}

/// A segment of one call: its index within the call, the call's key, how
/// many inputs its sum has in all, and what it carries for the tuner.
#[derive(Clone, Copy)]
pub(super) struct Seg {
    pub(super) index: usize,
    pub(super) key: CallKey,
    pub(super) contributors: usize,
    /// The tuner's word this segment carries (the last of a tuned call).
    pub(super) carry: Option<u32>,
    /// The call's buffers are registered (ring/registered.rs): XDP reads
    /// and writes them, not the slot.
    pub(super) registered: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_segments_cover_the_call_in_as_few_as_allowed() {
        let slot = 2_000 * BLOCK_ELEMS;
        let mib = (1 << 20) / 4; // 32-bit elements in 1 MiB
        for (count, most, segments) in [
            (16 * mib, mib, 16),
            (16 * mib + 1, mib, 17),
            (mib, mib, 1),
            (mib - 5, mib, 1),
            (3 * mib + 7, mib, 4),
            (10, mib, 1),
            (64 * mib, 64 * mib, 9), // capped at a slot
            (5 * BLOCK_ELEMS, 1, 5), // at least a block
        ] {
            let len = equal_segments(count, most, slot);
            assert_eq!(len % BLOCK_ELEMS, 0, "{count} {most}: {len}");
            assert!(len <= slot && len >= BLOCK_ELEMS, "{count} {most}: {len}");
            assert_eq!(count.div_ceil(len), segments, "{count} {most}: {len}");
            // Only the last segment is shorter, by less than a segment.
            assert!(
                count.div_ceil(len) * len - count < len,
                "{count} {most}: {len}"
            );
        }
    }
}
