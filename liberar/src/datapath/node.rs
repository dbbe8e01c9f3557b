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
//!                the ring of slice s: out[s] = ⊕ over hosts of acc
//!   ── barrier: every slice is final (or marked failed)
//!   copy out → recv
//! ```
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

use self::shm::{Shm, MAX_SLICES};
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

/// The least a slice carries: a piece runs on as many slices as it has
/// this many bytes (at most the group's). Measured on 4 hosts with 2 ranks
/// each, MTU 9000 (`allreduce_bench -T int`, ERAR_NODE_SLICES=1 against 2):
/// one slice wins at 1 MiB (1.73 against 2.26 ms) and 2 MiB (3.17 against
/// 4.09 ms), two from 4 MiB (8.9 against 9.3 ms) to 64 MiB (189 against
/// 213 ms): each ring's fixed costs (its barrier, its fill and drain) are
/// paid once per slice, the copies and reductions are split.
const MIN_SLICE: usize = 2 << 20;

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

        // Local rank 0 makes the page, then the others open it; every rank
        // tells whether it could (a MAX: all know when one could not).
        let made = if local_rank == 0 {
            Shm::control(name.clone(), true, local_rank, &pids)
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
            Err(_) => Shm::control(name, false, local_rank, &pids),
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
        })
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
        let guard = BreakOnError(&self.shm);
        let mut left = Vec::new();
        for start in (0..recv.len()).step_by(piece) {
            let end = (start + piece).min(recv.len());
            let len = end - start;
            let (k, led) = (self.active(len), self.led_range(len, elem.size()));
            let t = Instant::now();
            // SAFETY (every region below): the protocol of this module's
            // doc: a rank writes its own region before the first barrier,
            // the leaders read them and write the output between the two,
            // everyone reads the output after the second.
            let input = send.map_or(&recv[start..end], |s| &s[start..end]);
            let mine = unsafe { self.shm.region(self.local_rank, len) };
            let (lo, hi) = led.clone().map_or((len, len), |r| (r.start, r.end));
            mine[..lo].copy_from_slice(&input[..lo]);
            mine[hi..].copy_from_slice(&input[hi..]);
            let t = stats::phase_done(Phase::NodeIn, t);
            self.shm.barrier(progress)?;
            stats::phase_done(Phase::NodeWait, t);
            let mut own = None;
            if let (Some(s), Some(range)) = (self.leads_in(len), led) {
                let out = unsafe { &mut self.shm.output(self.pieces, len)[range.clone()] };
                let mine = &input[range.clone()];
                let ok = match (slice.as_mut(), wire_op) {
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
                own = self.led(s, ok);
            }
            let t = self.meet(own, k, progress)?;
            left.clear();
            if wire_op.is_none() {
                left.extend((0..k).flat_map(|s| self.shm.left(s)));
            }
            let out = unsafe { self.shm.output(self.pieces, len) };
            copy_but(&mut recv[start..end], out, &left);
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
    fn led(&self, s: usize, outcome: Done) -> Option<DatapathError> {
        self.shm.set_status(s, outcome.is_ok());
        stats::record_node_led();
        outcome.err()
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
    /// straight into the ring's slot (`reduce(offset, bytes)`), or, on a
    /// ring that declines that, into this rank's own region first.
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
    ) -> Done {
        match sl
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
        }
    }

    /// Runs a leader's float SUM slice `s`: every local input of the slice
    /// (its own `mine`, the others' regions) to its ring
    /// (`Ring::allreduce_local`), and the byte ranges the ring leaves to MPI
    /// into the control page, for every local rank to complete.
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
    ) -> Done {
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
        let done = sl
            .ring
            .allreduce_local(sl.comm, &parts, out, how, self.ranks, &to_mpi);
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
                out.copy_from_slice(&buf[start..end]);
            }
            let t = stats::phase_done(Phase::NodeIn, t);
            self.shm.barrier(progress)?;
            stats::phase_done(Phase::NodeWait, t);
            let mut own = None;
            if let (Some(s), Some(range)) = (self.leads_in(len), self.led_range(len, 1)) {
                let ok = match slice.as_mut() {
                    Some(sl) => sl.ring.bcast(sl.comm, &mut out[range], root_host),
                    None => Err(no_ring()),
                };
                own = self.led(s, ok);
            }
            let t = self.meet(own, self.active(len), progress)?;
            if !is_root {
                buf[start..end].copy_from_slice(out);
            }
            stats::phase_done(Phase::NodeOut, t);
            self.pieces += 1;
        }
        guard.defuse();
        stats::record_node_call();
        Ok(())
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

    /// How many slices a `len`-byte piece runs on (the same on every rank:
    /// they see the same call).
    fn active(&self, len: usize) -> usize {
        (len / MIN_SLICE).clamp(1, self.slices)
    }

    /// The slice this rank leads in a `len`-byte piece, if any.
    fn leads_in(&self, len: usize) -> Option<usize> {
        (self.local_rank < self.active(len)).then_some(self.local_rank)
    }

    /// The byte range of a `len`-byte piece this rank's slice covers:
    /// slice s of k holds elements [s·n/k, (s+1)·n/k).
    fn led_range(&self, len: usize, elem: usize) -> Option<std::ops::Range<usize>> {
        let s = self.leads_in(len)?;
        let (n, k) = (len / elem, self.active(len));
        Some(s * n / k * elem..(s + 1) * n / k * elem)
    }
}

/// `dst = src` but for the byte ranges `skip` (ascending, disjoint).
fn copy_but(dst: &mut [u8], src: &[u8], skip: &[Range<usize>]) {
    let mut from = 0;
    for r in skip.iter().chain([&(dst.len()..dst.len())]) {
        dst[from..r.start].copy_from_slice(&src[from..r.start]);
        from = r.end;
    }
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
