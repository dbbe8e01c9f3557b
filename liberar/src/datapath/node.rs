//! Many ranks on one host: the ranks of a communicator that share a host
//! (its node group) meet in shared memory, and each of the first few leads
//! one slice of every call across hosts on its own ring (NetReduce's
//! "parallel all-reduce"): local rank s reduces slice s of every local
//! input and runs it on the ring of slice communicator s, which has one
//! rank per host; every local rank then copies the whole result out.
//!
//! One allreduce piece (at most one shared region of data), on every local
//! rank, with two barriers:
//!
//! ```text
//!   copy my input into my region (all but the slice I lead)
//!   ── barrier: every input is in place, the output is free
//!   leader of s: acc = my input ⊕ every other region, over slice s;
//!                the ring of slice s: ⊕ over hosts of acc, left in
//!                its slot (or copied to out[s])
//!   ── barrier: every slice is final (or marked failed)
//!   copy each slice from its leader's slot (or out[s]) → recv
//! ```
//!
//! Every local rank maps the leaders' slot buffers read-only at setup
//! (node/slots.rs), so an integer or bitwise slice's result, and a
//! broadcast's data on the hosts other than the root's, go from the
//! slot to each rank's buffer in one copy, and a float SUM slice's is
//! decoded by each rank from the words there (the leader leaves the block
//! steps and the certificate's repairs in the output region): 8 ranks,
//! `-T float`, 1.08-1.55x faster from 1 to 64 MiB than session 19's
//! build, where the leader decoded into the output region and each rank
//! copied that out (this build also encoded the second local input by
//! adding in place). 8 ranks on 4 hosts, MTU 9000,
//! `allreduce_bench -T int`: 8 MiB 18.2 against 20.5-31.1 ms and 4 MiB
//! 9.5 against 10.2-15.1 ms, with the leader's copy to the output region.
//! A slice larger than a slot goes through the output region.
//!
//! A broadcast is the same with the root's data in the output region and
//! each slice's ring broadcasting from the root's host. The root fills the
//! output before the first barrier, while a peer may still be copying the
//! last piece out: pieces take the two output regions in turn.
//!
//! Integer and bitwise reductions (the kernel's `Carried::Raw` ops, exact
//! in any order) are reduced on the host straight into the ring's slot. A
//! float SUM is not reduced on the host: the leader hands its ring every
//! local input of its slice (`Ring::allreduce_local`), which encodes each
//! on the scales agreed over every rank and adds their words as the ring
//! adds its members', so the call keeps the contract of the whole
//! communicator's size (`codec/`). Float MAX/MIN and the `reproducible`
//! contract stay on MPI.

pub mod combine;
mod shm;
mod slots;

use self::shm::{Shm, SliceOutcome, MAX_SLICES};
use self::slots::SlotViews;
use super::codec::decode_kept;
use super::copy::{copy, NODE_STREAM_MIN};
use super::ring::Ring;
use super::wire_ops::{kernel_reduces, Carried};
use super::{Comm, DatapathError, Done, Reduction};
use crate::config::{Config, Precision};
use crate::select::{Collective, ElemType, ReduceOp};
use crate::stats::{self, Phase};
use std::cell::RefCell;
use std::ops::Range;
use std::time::Instant;

/// The largest piece of a call the shared regions hold (per local rank,
/// plus two output regions): larger calls run as consecutive pieces.
const MAX_PIECE: usize = 64 << 20;

/// The least a slice of an integer, bitwise or broadcast piece carries: a
/// piece runs on as many slices as it has this many bytes (at most the
/// group's; float SUMs: [`MIN_FLOAT_SLICE`]). Measured on 4 hosts with 2 ranks
/// each, MTU 9000 (`allreduce_bench -T int`, ERAR_NODE_SLICES=1 against 2):
/// one slice wins at 1 MiB (1.73 against 2.26 ms) and 2 MiB (3.17 against
/// 4.09 ms), two from 4 MiB (8.9 against 9.3 ms) to 64 MiB (189 against
/// 213 ms): each ring's fixed costs (its barrier, its fill and drain) are
/// paid once per slice, the copies and reductions are split.
const MIN_SLICE: usize = 2 << 20;

/// [`MIN_SLICE`] for a float SUM, whose leader encodes every local input
/// of its slice and whose ranks each decode the result: two slices split
/// that work between two leaders from 1 MiB on. 8 ranks, OSU `-T
/// mpi_float`, 4-6 alternating rounds, best, against 2 MiB: 1.19x, 1.18x
/// and 1.02x (1 MiB), 1.16x and 1.01x (2 MiB) in three runs (an
/// earlier run with 1 MiB slices had 2 MiB at 0.99x, 4 rounds); steady
/// state (`-i 1200` less `-i 200`, 3 rounds) 2052 against 2113 µs a
/// 1 MiB call. The same unit for integers lost at 1 MiB (1.01x, 0.87x)
/// and drew at 2 MiB (1.03x): their per-slice costs (a ring's barrier,
/// fill and drain) outweigh a combine they split.
const MIN_FLOAT_SLICE: usize = 512 << 10;

/// This rank's view of its host's group: the shared memory and who leads
/// which slice.
pub struct Node {
    shm: Shm,
    local_rank: usize,
    local_size: usize,
    /// The communicator's size: the inputs of every call's sum.
    ranks: usize,
    slices: usize,
    /// Pieces run so far (the same count on every local rank): which
    /// output region the next one uses.
    pieces: usize,
    /// The local ranks' pids, in local rank order.
    pids: Vec<i32>,
    /// Every slice's slot buffers, where a leader may keep its slice's
    /// result for every local rank to copy out (`None`: results go
    /// through the output region).
    views: Option<SlotViews>,
}

/// The ring a slice leader carries its slice on, with its communicator
/// (one rank per host, ranked by host).
pub struct Slice<'a> {
    pub ring: &'a mut Ring,
    pub comm: &'a dyn Comm,
}

/// What each local rank tells the others at setup.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Member {
    pid: i32,
    nonce: u32,
}

impl Node {
    /// Collective over `local`, the ranks of one host: maps the group's
    /// control page (local rank 0 makes it; its name is gone once all have
    /// it). `slices` ≤ the fewest ranks any host of the communicator has;
    /// `ranks` is the communicator's size.
    pub fn establish(local: &dyn Comm, slices: usize, ranks: usize) -> Result<Node, DatapathError> {
        let (local_rank, local_size) = (local.rank(), local.size());
        if slices == 0 || slices > MAX_SLICES || slices > local_size {
            return Err(DatapathError::Declined(format!("{slices} slices")));
        }
        let me = Member {
            pid: std::process::id() as i32,
            nonce: nonce(),
        };
        let mut all = vec![0u8; 8 * local_size];
        local.allgather(&member_bytes(me), &mut all)?;
        let members: Vec<Member> = all
            .chunks_exact(8)
            .map(|c| Member {
                pid: i32::from_ne_bytes([c[0], c[1], c[2], c[3]]),
                nonce: u32::from_ne_bytes([c[4], c[5], c[6], c[7]]),
            })
            .collect();
        let pids: Vec<i32> = members.iter().map(|m| m.pid).collect();
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let name = format!("/liberar.{uid}.{}.{:08x}", members[0].pid, members[0].nonce);
        let poll = Config::get().poll();

        // Local rank 0 makes the page, then the others open it; every rank
        // tells whether it could (a MAX: all know when one could not).
        let made = if local_rank == 0 {
            Shm::control(name.clone(), true, (local_rank, &pids), poll)
        } else {
            Err(DatapathError::Declined("not yet".into()))
        };
        let mut bad = [i32::from(local_rank == 0 && made.is_err())];
        local.allreduce_max_i32(&mut bad)?;
        if bad[0] != 0 {
            return Err(DatapathError::Declined(
                "no shared memory on this host".into(),
            ));
        }
        let opened = match made {
            Ok(shm) => Ok(shm),
            Err(_) => Shm::control(name, false, (local_rank, &pids), poll),
        };
        let mut bad = [i32::from(opened.is_err())];
        local.allreduce_max_i32(&mut bad)?;
        if let Ok(shm) = &opened {
            if local_rank == 0 {
                shm.unlink_control();
            }
        }
        if bad[0] != 0 {
            return Err(DatapathError::Declined(
                "a local rank could not map the shared memory".into(),
            ));
        }
        Ok(Node {
            shm: opened?,
            local_rank,
            local_size,
            ranks,
            slices,
            pieces: 0,
            pids,
            views: None,
        })
    }

    /// Collective over `local` (as in [`Node::establish`]), once every
    /// slice's ring is set up (`ring`: this rank's, if it leads): maps
    /// every slice's slot buffers in every local rank (node/slots.rs), or,
    /// if any local rank cannot, none; then results go through the output
    /// region. Errs only if the local ranks could not agree.
    pub fn share_slots(&mut self, local: &dyn Comm, ring: Option<&Ring>) -> Done {
        let own = ring.and_then(|r| {
            r.slot_buffer_fds()
                .inspect_err(|e| log::debug!("liberar: no slot buffer fds to share: {e}"))
                .ok()
        });
        match SlotViews::share(local, self.shm.name(), self.slices, own, &self.pids) {
            Ok(views) => self.views = Some(views),
            Err(DatapathError::Declined(why)) => {
                log::debug!("liberar: node results go through shared memory: {why}");
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// Whether the node path carries a call of this collective, element
    /// type, op and size: every broadcast, the allreduces whose op the
    /// hosts compute exactly as the kernel does (integers and bitwise ops),
    /// and float SUMs of at least `ERAR_NODE_FLOAT_MIN` bytes under the
    /// `bounded` and `quantized` contracts (see the module's doc). The same
    /// answer on every rank: it reads only the call and the job's settings.
    pub fn carries(
        coll: Collective,
        elem: Option<ElemType>,
        op: Option<ReduceOp>,
        bytes: usize,
    ) -> bool {
        let cfg = Config::get();
        match (coll, elem, op) {
            (Collective::Bcast, _, _) => true,
            (Collective::Allreduce, Some(elem), Some(op)) => match kernel_reduces!(elem, op) {
                Some(Carried::Raw(_)) => true,
                Some(Carried::FloatSum) => {
                    cfg.precision != Precision::Reproducible && bytes >= cfg.node_float_min
                }
                _ => false,
            },
            _ => false,
        }
    }

    /// The slice this rank leads across hosts, if any.
    pub fn leads(&self) -> Option<usize> {
        (self.local_rank < self.slices).then_some(self.local_rank)
    }

    /// `recv = op over every rank of `comm` (send, or recv when in
    /// place)`, bitwise identical on every rank. `slice` is this rank's
    /// ring when it leads one ([`Node::leads`]).
    pub fn allreduce(
        &mut self,
        mut slice: Option<Slice<'_>>,
        comm: &dyn Comm,
        send: Option<&[u8]>,
        recv: &mut [u8],
        elem: ElemType,
        op: ReduceOp,
    ) -> Done {
        // The shim asked `Node::carries` before routing here; asked again,
        // the same answer on every rank and before any barrier, it guards
        // against the two diverging, as `Plan::of` does on the ring.
        let wire_op = match kernel_reduces!(elem, op) {
            Some(Carried::Raw(wire_op)) => Some(wire_op),
            Some(Carried::FloatSum)
                if Node::carries(Collective::Allreduce, Some(elem), Some(op), recv.len()) =>
            {
                None
            }
            _ => {
                return Err(DatapathError::Declined(format!(
                    "{elem:?} {op:?} has no node path"
                )))
            }
        };
        let progress = &|| comm.progress();
        let piece = self.reserve(recv.len(), elem.size(), progress)?;
        let unit = if wire_op.is_some() {
            MIN_SLICE
        } else {
            MIN_FLOAT_SLICE
        };
        let guard = BreakOnError(&self.shm);
        let mut left = Vec::new();
        for start in (0..recv.len()).step_by(piece) {
            let end = (start + piece).min(recv.len());
            let len = end - start;
            let (k, led) = (
                self.active(len, unit),
                self.led_range(len, elem.size(), unit),
            );
            let t = Instant::now();
            // SAFETY (every region below): the protocol of this module's
            // doc: a rank writes its own region before the first barrier,
            // the leaders read them and write the output between the two,
            // everyone reads the output after the second.
            let input = send.map_or(&recv[start..end], |s| &s[start..end]);
            let mine = unsafe { self.shm.region(self.local_rank, len) };
            let (lo, hi) = led.clone().map_or((len, len), |r| (r.start, r.end));
            copy(&mut mine[..lo], &input[..lo], NODE_STREAM_MIN);
            copy(&mut mine[hi..], &input[hi..], NODE_STREAM_MIN);
            let t = stats::phase_done(Phase::NodeIn, t);
            self.shm.barrier(progress)?;
            stats::phase_done(Phase::NodeWait, t);
            let mut own = None;
            if let (Some(s), Some(range)) = (self.leads_in(len, unit), led) {
                let out = unsafe { &mut self.shm.output(self.pieces, len)[range.clone()] };
                let mine = &input[range.clone()];
                let outcome = match (slice.as_mut(), wire_op) {
                    (Some(sl), Some(wire_op)) => {
                        let reduce = |off: usize, dst: &mut [u8]| {
                            let at = range.start + off..range.start + off + dst.len();
                            self.reduce_local(wire_op, dst, &mine[off..off + dst.len()], at, len);
                        };
                        self.carry(sl, reduce, out, elem, op, range.clone(), len)
                    }
                    (Some(sl), None) => {
                        self.carry_local(sl, s, mine, out, (elem, op), range.clone(), len)
                    }
                    (None, _) => Err(no_ring()),
                };
                own = self.led(s, outcome);
            }
            let t = self.meet(own, k, progress)?;
            left.clear();
            if wire_op.is_none() {
                left.extend((0..k).flat_map(|s| self.shm.left(s)));
            }
            self.copy_out(&mut recv[start..end], k, elem.size(), &left)?;
            stats::phase_done(Phase::NodeOut, t);
            self.pieces += 1;
            // What the slices left to MPI: every rank's own input, over the
            // whole communicator (in place, `recv` still holds it there).
            for r in &left {
                let at = start + r.start..start + r.end;
                comm.pmpi_allreduce(send.map(|s| &s[at.clone()]), &mut recv[at], (elem, op))?;
            }
        }
        guard.defuse();
        stats::record_node_call();
        Ok(())
    }

    /// A leader's outcome of slice `s`, for its peers to read after the
    /// second barrier (it meets them there whatever happened).
    fn led(&self, s: usize, outcome: Result<SliceOutcome, DatapathError>) -> Option<DatapathError> {
        self.shm
            .set_outcome(s, *outcome.as_ref().unwrap_or(&SliceOutcome::Failed));
        stats::record_node_led();
        outcome.err()
    }

    /// After the second barrier of a piece on `k` slices (of `elem`-byte
    /// elements): its result into `dst`, each slice from where its leader
    /// left it, but for the byte ranges `left` to MPI.
    fn copy_out(&self, dst: &mut [u8], k: usize, elem: usize, left: &[Range<usize>]) -> Done {
        let len = dst.len();
        // Out of a large piece, every slice is streamed (see copy.rs).
        let stream = len >= NODE_STREAM_MIN;
        // SAFETY: the output region, read after the second barrier (see
        // the module's doc).
        let out = unsafe { self.shm.output(self.pieces, len) };
        for s in 0..k {
            let r = slice_range(s, k, len, elem);
            match (self.shm.outcome(s), &self.views) {
                // SAFETY (both): the leader keeps the result there until its
                // ring's next operation but one, which starts after the
                // first barrier of the next piece, once every local rank is
                // done here (see node/slots.rs).
                (SliceOutcome::Kept(gen), Some(v)) => {
                    stats::record_node_kept();
                    let from = unsafe { v.result(s, gen, r.len()) };
                    copy_but(&mut dst[r.clone()], from, left, r.start, stream);
                }
                // The blocks MPI completes (`left`) are those without a
                // step, which the decode leaves as they are.
                (SliceOutcome::Encoded(gen), Some(v)) => {
                    stats::record_node_decoded();
                    let words = unsafe { v.result(s, gen, r.len()) };
                    if !decode_kept(words, &out[r.clone()], &mut dst[r.clone()], stream) {
                        return Err(DatapathError::Failed(
                            "a slice's kept words are not whole".into(),
                        ));
                    }
                }
                (SliceOutcome::Kept(_) | SliceOutcome::Encoded(_), None) => {
                    return Err(DatapathError::Failed(
                        "a slice kept in slots this rank has not mapped".into(),
                    ))
                }
                _ => copy_but(&mut dst[r.clone()], &out[r.clone()], left, r.start, stream),
            }
        }
        Ok(())
    }

    /// The second barrier of a piece: every slice of `k` is final, or this
    /// rank's own error (`own`) or a failed slice ends the call. Returns
    /// when it passed, where the copy out starts.
    fn meet(
        &self,
        own: Option<DatapathError>,
        k: usize,
        progress: &dyn Fn(),
    ) -> Result<Instant, DatapathError> {
        let t = Instant::now();
        self.shm.barrier(progress)?;
        let t = stats::phase_done(Phase::NodeWait, t);
        if let Some(e) = own {
            return Err(e);
        }
        match self.shm.failed_slice(k) {
            Some(s) => Err(DatapathError::Failed(format!(
                "slice {s} failed on its ring (see its leader's error)"
            ))),
            None => Ok(t),
        }
    }

    /// `dst = this rank's `mine` ⊕ every other local rank's input over
    /// byte range `at` of a `len`-byte piece`, in one pass over each input.
    fn reduce_local(
        &self,
        wire_op: u32,
        dst: &mut [u8],
        mine: &[u8],
        at: std::ops::Range<usize>,
        len: usize,
    ) {
        let mut others = (0..self.local_size).filter(|r| *r != self.local_rank);
        // SAFETY: the other ranks' regions, read between the barriers
        // (see the module's doc).
        let theirs = |r: usize| unsafe { &self.shm.region(r, len)[at.clone()] };
        match others.next() {
            None => dst.copy_from_slice(mine),
            Some(first) => {
                combine::combine_into(wire_op, dst, mine, theirs(first));
                for r in others {
                    combine::combine(wire_op, dst, theirs(r));
                }
            }
        }
    }

    /// Runs a leader's slice on its ring: the local reduction written
    /// straight into the ring's slot (`reduce(offset, bytes)`), the result
    /// kept there for every local rank to copy (when they all map the
    /// slots and the slice fits one) or copied into `out`; or, on a ring
    /// that declines filling, the reduction into this rank's own region
    /// first.
    #[allow(clippy::too_many_arguments)]
    fn carry(
        &self,
        sl: &mut Slice<'_>,
        mut reduce: impl FnMut(usize, &mut [u8]),
        out: &mut [u8],
        elem: ElemType,
        op: ReduceOp,
        range: std::ops::Range<usize>,
        len: usize,
    ) -> Result<SliceOutcome, DatapathError> {
        if self.views.is_some() {
            match sl
                .ring
                .allreduce_kept(sl.comm, out.len(), elem, op, &mut reduce)
            {
                Err(DatapathError::Declined(_)) => {}
                done => return done.map(SliceOutcome::Kept),
            }
        }
        let done = match sl
            .ring
            .allreduce_filled(sl.comm, out, elem, op, &mut reduce)
        {
            Err(DatapathError::Declined(_)) => {
                // SAFETY: this rank's own region, which it left free over
                // the slice it leads.
                let acc = unsafe { &mut self.shm.region(self.local_rank, len)[range] };
                reduce(0, acc);
                sl.ring.allreduce(sl.comm, Some(acc), out, (elem, op))
            }
            done => done,
        };
        done.map(|()| SliceOutcome::Output)
    }

    /// Runs a leader's float SUM slice `s`: every local input of the slice
    /// (its own `mine`, the others' regions) to its ring
    /// (`Ring::allreduce_local`), and the byte ranges the ring leaves to MPI
    /// into the control page, for every local rank to complete. When every
    /// local rank maps the slots and the slice fits one, the result stays
    /// there as words, with the block steps and repairs in `out`
    /// (`Ring::allreduce_local_kept`): each rank decodes its own copy
    /// straight from the slot, instead of the leader decoding into `out`
    /// and each rank copying that.
    #[allow(clippy::too_many_arguments)]
    fn carry_local(
        &self,
        sl: &mut Slice<'_>,
        s: usize,
        mine: &[u8],
        out: &mut [u8],
        how: Reduction,
        range: Range<usize>,
        len: usize,
    ) -> Result<SliceOutcome, DatapathError> {
        let parts: Vec<&[u8]> = (0..self.local_size)
            .map(|r| {
                if r == self.local_rank {
                    mine
                } else {
                    // SAFETY: the other ranks' regions, read between the
                    // barriers (see the module's doc).
                    unsafe { &self.shm.region(r, len)[range.clone()] }
                }
            })
            .collect();
        let left = RefCell::new(Vec::new());
        let to_mpi = |r: Range<usize>| {
            left.borrow_mut()
                .push(r.start + range.start..r.end + range.start)
        };
        let ring = &mut *sl.ring;
        let kept = self
            .views
            .is_some()
            .then(|| ring.allreduce_local_kept(sl.comm, &parts, out, how, self.ranks, &to_mpi));
        let done = match kept {
            None | Some(Err(DatapathError::Declined(_))) => ring
                .allreduce_local(sl.comm, &parts, out, how, self.ranks, &to_mpi)
                .map(|()| SliceOutcome::Output),
            Some(done) => done.map(|kept| kept.map_or(SliceOutcome::Output, SliceOutcome::Encoded)),
        };
        self.shm.set_left(s, &left.borrow());
        done
    }

    /// Broadcast of `buf` from the communicator's root: `root_local` is
    /// the root's local rank if it is on this host, `root_host` its host
    /// (its rank in every slice communicator).
    pub fn bcast(
        &mut self,
        mut slice: Option<Slice<'_>>,
        progress: &dyn Fn(),
        buf: &mut [u8],
        root_local: Option<usize>,
        root_host: usize,
    ) -> Done {
        let is_root = root_local == Some(self.local_rank);
        let piece = self.reserve(buf.len(), 1, progress)?;
        let guard = BreakOnError(&self.shm);
        for start in (0..buf.len()).step_by(piece) {
            let end = (start + piece).min(buf.len());
            let len = end - start;
            // SAFETY: as in allreduce: the root writes the output before
            // the first barrier, the leaders between the two, everyone
            // reads it after the second.
            let t = Instant::now();
            let out = unsafe { self.shm.output(self.pieces, len) };
            if is_root {
                copy(out, &buf[start..end], NODE_STREAM_MIN);
            }
            let t = stats::phase_done(Phase::NodeIn, t);
            self.shm.barrier(progress)?;
            stats::phase_done(Phase::NodeWait, t);
            let mut own = None;
            let unit = MIN_SLICE;
            if let (Some(s), Some(range)) = (self.leads_in(len, unit), self.led_range(len, 1, unit))
            {
                let outcome = match slice.as_mut() {
                    Some(sl) => self.carry_bcast(sl, &mut out[range], root_host),
                    None => Err(no_ring()),
                };
                own = self.led(s, outcome);
            }
            let k = self.active(len, unit);
            let t = self.meet(own, k, progress)?;
            if !is_root {
                self.copy_out(&mut buf[start..end], k, 1, &[])?;
            }
            stats::phase_done(Phase::NodeOut, t);
            self.pieces += 1;
        }
        guard.defuse();
        stats::record_node_call();
        Ok(())
    }

    /// Runs a leader's slice of a broadcast on its ring: its data kept in
    /// the ring's slot for every local rank to copy (when they all map the
    /// slots and the slice fits one), else in `out`.
    fn carry_bcast(
        &self,
        sl: &mut Slice<'_>,
        out: &mut [u8],
        root_host: usize,
    ) -> Result<SliceOutcome, DatapathError> {
        if self.views.is_some() {
            match sl.ring.bcast_kept(sl.comm, out, root_host) {
                Err(DatapathError::Declined(_)) => {}
                done => {
                    return done.map(|kept| kept.map_or(SliceOutcome::Output, SliceOutcome::Kept))
                }
            }
        }
        sl.ring
            .bcast(sl.comm, out, root_host)
            .map(|()| SliceOutcome::Output)
    }

    /// Sizes the shared regions for a call of `bytes` (the same on every
    /// local rank) and returns the piece length, a whole number of
    /// `elem`-byte elements.
    fn reserve(
        &mut self,
        bytes: usize,
        elem: usize,
        progress: &dyn Fn(),
    ) -> Result<usize, DatapathError> {
        let piece = bytes.min(MAX_PIECE / elem * elem).max(elem);
        self.shm
            .reserve(piece, progress)
            .inspect_err(|_| self.shm.set_broken())?;
        Ok(piece)
    }

    /// How many slices a `len`-byte piece runs on, at least `unit` bytes
    /// each (the same on every rank: they see the same call).
    fn active(&self, len: usize, unit: usize) -> usize {
        (len / unit).clamp(1, self.slices)
    }

    /// The slice this rank leads in a `len`-byte piece, if any.
    fn leads_in(&self, len: usize, unit: usize) -> Option<usize> {
        (self.local_rank < self.active(len, unit)).then_some(self.local_rank)
    }

    /// The byte range of a `len`-byte piece this rank's slice covers:
    /// slice s of k holds elements [s·n/k, (s+1)·n/k).
    fn led_range(&self, len: usize, elem: usize, unit: usize) -> Option<std::ops::Range<usize>> {
        let s = self.leads_in(len, unit)?;
        Some(slice_range(s, self.active(len, unit), len, elem))
    }
}

/// `dst = src` but for the byte ranges `skip` (ascending, disjoint),
/// counted from where `dst` and `src` start less `base`; with streaming
/// stores if `stream` (datapath/copy.rs).
fn copy_but(dst: &mut [u8], src: &[u8], skip: &[Range<usize>], base: usize, stream: bool) {
    let stream_min = if stream { 0 } else { usize::MAX };
    let end = base + dst.len();
    let clipped = skip.iter().filter_map(|r| {
        let (a, b) = (r.start.max(base), r.end.min(end));
        (a < b).then(|| a - base..b - base)
    });
    let mut from = 0;
    for r in clipped.chain(std::iter::once(dst.len()..dst.len())) {
        copy(&mut dst[from..r.start], &src[from..r.start], stream_min);
        from = r.end;
    }
}

/// Slice `s` of `k` of a `len`-byte piece of `elem`-byte elements: its
/// elements [s·n/k, (s+1)·n/k), in bytes.
fn slice_range(s: usize, k: usize, len: usize, elem: usize) -> Range<usize> {
    let n = len / elem;
    s * n / k * elem..(s + 1) * n / k * elem
}

/// Marks the group broken unless defused: a rank that leaves a call
/// between its barriers (an error, a panic) must not leave its peers
/// waiting for it.
struct BreakOnError<'a>(&'a Shm);

impl BreakOnError<'_> {
    fn defuse(self) {
        std::mem::forget(self);
    }
}

impl Drop for BreakOnError<'_> {
    fn drop(&mut self) {
        self.0.set_broken();
    }
}

fn no_ring() -> DatapathError {
    DatapathError::Failed("a slice leader without its ring".into())
}

fn member_bytes(m: Member) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&m.pid.to_ne_bytes());
    b[4..].copy_from_slice(&m.nonce.to_ne_bytes());
    b
}

fn nonce() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == 4 {
        u32::from_ne_bytes(b)
    } else {
        // The pid alone still names the group uniquely on the host.
        0
    }
}

#[cfg(test)]
mod tests {
    use super::{copy_but, slice_range};

    #[test]
    fn slices_tile_the_piece_on_element_boundaries() {
        for (len, elem, k) in [(4096 * 4 + 12, 4, 3), (10, 1, 2), (8 * 5, 8, 4), (12, 4, 1)] {
            let ranges: Vec<_> = (0..k).map(|s| slice_range(s, k, len, elem)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[k - 1].end, len / elem * elem);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            assert!(ranges
                .iter()
                .all(|r| r.start % elem == 0 && r.end % elem == 0));
        }
    }

    #[test]
    fn copy_but_skips_the_ranges_that_fall_in_its_part() {
        let src: Vec<u8> = (0..40).collect();
        // The part at bytes 10..30 of the piece; skips before, across both
        // ends of, inside and after it.
        let skip = [2..4, 8..12, 15..17, 28..33, 35..38];
        let mut dst = vec![0xff; 20];
        copy_but(&mut dst, &src[10..30], &skip, 10, false);
        let want: Vec<u8> = (10..30)
            .map(|i| {
                if skip.iter().any(|r| r.contains(&i)) {
                    0xff
                } else {
                    i as u8
                }
            })
            .collect();
        assert_eq!(dst, want);
    }
}
