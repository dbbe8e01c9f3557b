//! How a (type, op, precision) travels through the kernel ring: the wire op
//! and layout of one segment ([`Plan`]), and, for float SUM, the per-block
//! scales every rank agrees on, the encoding into the slot and the decoding
//! out of it, with the parts MPI completes (blocks no integer grid carries,
//! elements the bounded certificate cannot vouch for).

use super::reproducible::Refused;
use super::{wire, Comm, DatapathError};
use crate::config::Precision;
use crate::numerics::{
    bounded, exact, for_each_block, for_each_block_mut, ordered, quantized, BlockSummary,
    BLOCK_ELEMS,
};
use crate::select::{ElemType, ReduceOp};
use crate::stats;

/// How a (type, op, precision) travels through the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Plan {
    /// The caller's bytes as they are, combined by this wire op.
    Raw { op: u32, size: usize },
    /// f32 SUM, encoded per block.
    FloatSum(Precision),
    /// f32 MAX/MIN on order-preserving i32 keys; the wire op.
    FloatOrder(u32),
}

/// Where one segment's words sit in the slot: `chunks` chunks, of which
/// those from `flags_from` on hold the bounded contract's flag bits (for
/// other plans `flags_from == chunks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Layout {
    pub chunks: u32,
    pub flags_from: u32,
    /// u64 words of each of the two flag bitmaps.
    flag_words: usize,
}

impl Layout {
    fn flags_offset(self, chunk_bytes: usize) -> usize {
        self.flags_from as usize * chunk_bytes
    }
}

impl Plan {
    pub(super) fn of(elem: ElemType, op: ReduceOp, precision: Precision) -> Option<Plan> {
        use ElemType::*;
        use ReduceOp::*;
        let raw = |op: u32| {
            Some(Plan::Raw {
                op,
                size: elem.size(),
            })
        };
        match (elem, op) {
            (F32, Sum) => Some(Plan::FloatSum(precision)),
            (F32, Max) => Some(Plan::FloatOrder(wire::ERAR_OP_MAX_I32)),
            (F32, Min) => Some(Plan::FloatOrder(wire::ERAR_OP_MIN_I32)),
            (I32 | U32, Sum) => raw(wire::ERAR_OP_ADD_I32),
            (I64 | U64, Sum) => raw(wire::ERAR_OP_ADD_I64),
            (I32, Max) => raw(wire::ERAR_OP_MAX_I32),
            (I32, Min) => raw(wire::ERAR_OP_MIN_I32),
            (U32, Max) => raw(wire::ERAR_OP_MAX_U32),
            (U32, Min) => raw(wire::ERAR_OP_MIN_U32),
            (I64, Max) => raw(wire::ERAR_OP_MAX_I64),
            (I64, Min) => raw(wire::ERAR_OP_MIN_I64),
            (U64, Max) => raw(wire::ERAR_OP_MAX_U64),
            (U64, Min) => raw(wire::ERAR_OP_MIN_U64),
            (I32 | U32 | I64 | U64, Band) => raw(wire::ERAR_OP_AND),
            (I32 | U32 | I64 | U64, Bor) => raw(wire::ERAR_OP_OR),
            (I32 | U32 | I64 | U64, Bxor) => raw(wire::ERAR_OP_XOR),
            _ => None,
        }
    }

    pub(super) fn wire_op(self) -> u32 {
        match self {
            Plan::Raw { op, .. } | Plan::FloatOrder(op) => op,
            Plan::FloatSum(Precision::Bounded) => wire::ERAR_OP_ADD_I32_FLAGS,
            Plan::FloatSum(Precision::Reproducible) => wire::ERAR_OP_ADD_I64,
            Plan::FloatSum(Precision::Quantized) => wire::ERAR_OP_ADD_I32,
        }
    }

    /// Bytes per element in the value chunks.
    fn wire_size(self) -> usize {
        match self {
            Plan::FloatSum(Precision::Reproducible) => 8,
            Plan::FloatSum(_) | Plan::FloatOrder(_) => 4,
            Plan::Raw { size, .. } => size,
        }
    }

    /// The slot layout of `count` elements in chunks of `chunk_bytes`.
    pub(super) fn layout(self, count: usize, chunk_bytes: usize) -> Layout {
        let values = (count * self.wire_size()).div_ceil(chunk_bytes) as u32;
        if self != Plan::FloatSum(Precision::Bounded) {
            return Layout {
                chunks: values,
                flags_from: values,
                flag_words: 0,
            };
        }
        let flag_words = count.div_ceil(bounded::FLAG_BITS);
        let flags = (2 * flag_words * 8).div_ceil(chunk_bytes) as u32;
        Layout {
            chunks: values + flags,
            flags_from: values,
            flag_words,
        }
    }

    /// Elements of the caller's type one segment of `slot_bytes` holds; a
    /// whole number of numerics blocks so that blocks never straddle
    /// segments.
    pub(super) fn segment_elems(self, slot_bytes: usize, chunk_bytes: usize) -> usize {
        let wire_elems = if self == Plan::FloatSum(Precision::Bounded) {
            // 4 bytes and 2 bits per element, each part padded to a chunk.
            (slot_bytes - 2 * chunk_bytes) * 4 / 17
        } else {
            slot_bytes / self.wire_size()
        };
        (wire_elems / BLOCK_ELEMS).max(1) * BLOCK_ELEMS
    }
}

/// How one block of f32 SUM travels, agreed by every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
enum BlockScale {
    Exact(exact::Grid),
    Quantized(quantized::Step),
    Bounded(bounded::Grid),
}

/// One communicator's float SUM state: the current segment's block scales,
/// the scales last agreed for each segment, and the bounded contract's
/// repairs (kept to reuse their allocations across calls).
#[derive(Default)]
pub(super) struct FloatSum {
    scales: Vec<Option<BlockScale>>,
    /// This rank's per-block summary words of the current segment, and
    /// everyone's reduced.
    local: Vec<i32>,
    exchanged: Vec<i32>,
    /// Per segment index: the last agreement made for it.
    agreed: Vec<Option<Agreed>>,
    /// Bounded: the elements the certificate failed, this rank's inputs for
    /// them, and every rank's.
    repair_at: Vec<usize>,
    repair_mine: Vec<u8>,
    repair_all: Vec<u8>,
    /// This rank's part of a verdict that carries repairs.
    verdict_mine: Vec<u8>,
    /// The certificate ran on this call's final words (in the verdict).
    certified: bool,
    /// The verdict carried every rank's repair inputs: where they are in
    /// `repair_all` (each rank's part `stride` bytes, values from byte
    /// [`VERDICT_HEAD`] on).
    gathered: Option<usize>,
}

/// The words a verdict that carries repairs starts with: the verdict's 4,
/// and how many elements this rank's certificate failed (−1: its host is
/// not complete).
const VERDICT_WORDS: usize = 5;
const VERDICT_HEAD: usize = 4 * VERDICT_WORDS;

/// One agreement on a segment's scales, and what it was made from.
struct Agreed {
    precision: Precision,
    /// The call's key (the same on every rank).
    key: [i32; 4],
    /// This rank's summary words then: 2 per block, as many on every rank.
    local: Vec<i32>,
    scales: Vec<Option<BlockScale>>,
    /// The segment's latest call needed new scales (the same on every
    /// rank): its next one probably will too.
    rescaled: bool,
    /// Bounded: elements the certificate failed on the segment's latest
    /// complete call (the same on every rank: it reads only final words).
    repaired: usize,
}

/// Where the words of [`FloatSum::opening_words`] are, after the key and
/// its negation.
const OPENING_CHANGED: usize = 8;
const OPENING_SUMMARIES: usize = 9;

impl FloatSum {
    /// Summarizes this rank's blocks of segment `segment`. True if they are
    /// the summaries this rank gave to the segment's last agreement: if every
    /// rank's are, the MAX over ranks is what it was then, and so are the
    /// scales ([`FloatSum::reuse`]) — the same bits a new agreement would
    /// give, without its exchange.
    ///
    /// In the same pass, while the summaries match, each block is encoded
    /// into `slot_buf` on that agreement's scale, so a call that reuses its
    /// scales reads the caller's data once (the block is still in L1 when
    /// it is encoded; a separate summary pass over 16 MiB is 0.5 ms of one
    /// core at the 32 GB/s of `cargo bench --bench codecs`). When it
    /// returns true the slot
    /// holds the whole contribution; otherwise [`FloatSum::encode`] must
    /// run once the scales are agreed.
    pub(super) fn summarize(
        &mut self,
        input: &[u8],
        precision: Precision,
        segment: usize,
        layout: Layout,
        chunk_bytes: usize,
        slot_buf: &mut [u8],
    ) -> bool {
        // A new call: nothing certified or gathered yet (a call that fell
        // back never reached its finish).
        self.certified = false;
        self.gathered = None;
        let words = &mut self.local;
        words.clear();
        // (Scales that carry no block are not worth a ring: agree anew,
        // which sends the segment to MPI.)
        let last = match self.agreed.get(segment) {
            Some(Some(a)) if a.precision == precision && a.scales.iter().any(Option::is_some) => {
                Some(a)
            }
            _ => None,
        };
        let Some(a) = last else {
            for_each_block(input, |_, vals| {
                words.extend_from_slice(&BlockSummary::of(vals).to_words())
            });
            return false;
        };
        let mut slot = SlotWords::new(precision, layout, chunk_bytes, slot_buf);
        let mut same = true;
        for_each_block(input, |i, vals| {
            let w = BlockSummary::of(vals).to_words();
            words.extend_from_slice(&w);
            if same {
                same = a.local.get(2 * i..2 * i + 2) == Some(&w[..]);
                if same {
                    slot.encode_block(i, vals, a.scales[i]);
                }
            }
        });
        same && a.local.len() == words.len()
    }

    /// Takes segment `segment`'s last agreed scales (every rank's summaries
    /// are unchanged since: see [`FloatSum::summarize`]).
    pub(super) fn reuse(&mut self, segment: usize) {
        if let Some(Some(a)) = self.agreed.get_mut(segment) {
            self.scales.clone_from(&a.scales);
            a.rescaled = false;
        }
    }

    /// When segment `segment`'s latest call needed new scales: the words of
    /// a call-opening exchange that also agrees on them (one exchange where
    /// the barrier would say "rescale" and the summaries would follow).
    /// They are the call key and its negation, whether this rank's
    /// summaries changed, and the summaries, sized as at the segment's last
    /// agreement: the same size on every rank whatever this call's count
    /// (a call of another size finds the key changed, see
    /// [`FloatSum::take_opening`]). To be reduced with MAX.
    pub(super) fn opening_words(
        &mut self,
        segment: usize,
        key: [i32; 4],
        changed: bool,
    ) -> Option<&mut Vec<i32>> {
        let a = self.agreed.get(segment)?.as_ref().filter(|a| a.rescaled)?;
        let words = &mut self.exchanged;
        words.clear();
        words.extend(key);
        words.extend(key.map(|k| -k));
        words.push(changed as i32);
        words.extend(
            self.local
                .iter()
                .copied()
                .chain(std::iter::repeat(0))
                .take(a.local.len()),
        );
        Some(words)
    }

    /// After the opening exchange, with every rank's key the same: the
    /// scales from its summaries (`Some(fits)`, as [`FloatSum::agree`]), or
    /// `None` if the call's size is not the last agreement's (then agree
    /// anew: the key has been checked, so that exchange's size agrees).
    pub(super) fn take_opening(
        &mut self,
        segment: usize,
        precision: Precision,
        key: [i32; 4],
        ranks: usize,
    ) -> Option<bool> {
        let a = self.agreed.get_mut(segment)?.as_mut()?;
        if a.key != key || a.precision != precision {
            return None;
        }
        let summaries = &self.exchanged[OPENING_SUMMARIES..];
        self.scales.clear();
        self.scales.extend(
            summaries
                .chunks_exact(2)
                .map(|w| scale(precision, w, ranks)),
        );
        a.local.clone_from(&self.local);
        a.scales.clone_from(&self.scales);
        a.rescaled = self.exchanged[OPENING_CHANGED] != 0;
        Some(self.scales.iter().any(Option::is_some))
    }

    /// Reduces the summaries of [`FloatSum::summarize`] with MAX over the
    /// communicator and derives each block's scale. False: no block fits a
    /// grid (every rank knows it), so MPI reduces the whole segment.
    pub(super) fn agree(
        &mut self,
        comm: &dyn Comm,
        precision: Precision,
        segment: usize,
        key: [i32; 4],
    ) -> Result<bool, DatapathError> {
        let words = &mut self.exchanged;
        words.clone_from(&self.local);
        comm.allreduce_max_i32(words)?;
        let n = comm.size();
        self.scales.clear();
        self.scales
            .extend(words.chunks_exact(2).map(|w| scale(precision, w, n)));
        if self.agreed.len() <= segment {
            self.agreed.resize_with(segment + 1, || None);
        }
        let a = self.agreed[segment].get_or_insert_with(|| Agreed {
            precision,
            key,
            local: Vec::new(),
            scales: Vec::new(),
            rescaled: true,
            repaired: 0,
        });
        a.precision = precision;
        a.key = key;
        a.local.clone_from(&self.local);
        a.scales.clone_from(&self.scales);
        a.rescaled = true;
        Ok(self.scales.iter().any(Option::is_some))
    }

    /// Writes this rank's contribution into the slot: every block on its
    /// agreed scale; refused blocks travel as zeros (MPI reduces them).
    pub(super) fn encode(
        &self,
        input: &[u8],
        precision: Precision,
        layout: Layout,
        chunk_bytes: usize,
        slot_buf: &mut [u8],
    ) {
        let mut slot = SlotWords::new(precision, layout, chunk_bytes, slot_buf);
        for_each_block(input, |i, vals| slot.encode_block(i, vals, self.scales[i]));
    }

    /// Writes the result into `recv` from the slot's final words, then has
    /// MPI complete what the integers could not carry: refused blocks, and
    /// (bounded) the elements the certificate failed.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish(
        &mut self,
        comm: &dyn Comm,
        segment: usize,
        precision: Precision,
        layout: Layout,
        chunk_bytes: usize,
        slot_buf: &mut [u8],
        send: Option<&[u8]>,
        recv: &mut [u8],
        elem: ElemType,
        op: ReduceOp,
    ) -> Result<(), DatapathError> {
        match precision {
            Precision::Reproducible => {
                // Refused blocks too are summed exactly: read their inputs
                // before `recv` (in place, the inputs) is written.
                let scales = &self.scales;
                let refused =
                    Refused::<f32>::collect(send.unwrap_or(recv), |b| scales[b].is_none());
                stats::record_fallback_bytes(refused.bytes());
                // The exchange before any write: a failed one leaves `recv`
                // as it was.
                let refused = refused.gather(comm)?;
                decode_blocks::<exact::Grid>(slot_buf, scales, recv);
                refused.write(recv);
                return Ok(());
            }
            Precision::Quantized => decode_blocks::<quantized::Step>(slot_buf, &self.scales, recv),
            Precision::Bounded => {
                let (values, flags) = slot_buf.split_at_mut(layout.flags_offset(chunk_bytes));
                let q = slot_words::<i32>(values);
                let (big, inexact) = slot_words::<u64>(flags).split_at(layout.flag_words);
                // Before decoding: in place, `recv` still holds the inputs
                // the repairs need (unless the verdict took them already).
                if !std::mem::take(&mut self.certified) {
                    self.certify(q, big, inexact, send.unwrap_or(recv));
                }
                let repairs = self.gather_repairs(comm)?;
                for_each_block_mut(recv, |i, vals| {
                    let Some(BlockScale::Bounded(g)) = self.scales[i] else {
                        return false;
                    };
                    bounded::decode(&q[i * BLOCK_ELEMS..][..vals.len()], g, vals);
                    true
                });
                self.write_repairs(repairs, recv);
                if let Some(Some(a)) = self.agreed.get_mut(segment) {
                    a.repaired = self.repair_at.len();
                }
            }
        }
        reduce_refused_blocks(comm, &self.scales, send, recv, elem, op)
    }

    /// How many repair inputs the verdict of segment `segment`'s bounded
    /// call carries: from its latest complete call's count, with room to
    /// grow (gradients change little from step to step); 0 (a plain
    /// verdict, and the repair its own exchange) before any repair. The
    /// same on every rank: it follows from state every rank updates alike.
    pub(super) fn verdict_capacity(&self, segment: usize, count: usize) -> usize {
        match self.agreed.get(segment) {
            Some(Some(a)) if a.repaired > 0 => (a.repaired + a.repaired / 4 + 64).min(count),
            _ => 0,
        }
    }

    /// The verdict of a bounded call whose verdict carries repairs: this
    /// rank's `verdict` words and, once its host is `complete`, the
    /// certificate's count and the inputs of the elements it fails (up to
    /// `capacity`), gathered from every rank in one exchange. `verdict`
    /// becomes the MAX over ranks, as a plain verdict's would. When every
    /// host is complete, every rank's count is the same (they all read the
    /// same final words) and, if it fits, [`FloatSum::finish`] repairs from
    /// what was gathered without another exchange.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn verdict_with_repairs(
        &mut self,
        comm: &dyn Comm,
        verdict: &mut [i32; 4],
        complete: bool,
        capacity: usize,
        layout: Layout,
        chunk_bytes: usize,
        slot_buf: &mut [u8],
        input: &[u8],
    ) -> Result<(), DatapathError> {
        if complete && !self.certified {
            let (values, flags) = slot_buf.split_at_mut(layout.flags_offset(chunk_bytes));
            let q = slot_words::<i32>(values);
            let (big, inexact) = slot_words::<u64>(flags).split_at(layout.flag_words);
            self.certify(q, big, inexact, input);
            self.certified = true;
        }
        let k = if self.certified {
            self.repair_at.len() as i32
        } else {
            -1
        };
        let stride = VERDICT_HEAD + 4 * capacity;
        let mine = &mut self.verdict_mine;
        mine.clear();
        for w in verdict.iter().chain([&k]) {
            mine.extend_from_slice(&w.to_ne_bytes());
        }
        if k >= 0 && k as usize <= capacity {
            mine.extend_from_slice(&self.repair_mine);
        }
        mine.resize(stride, 0);
        self.repair_all.clear();
        self.repair_all.resize(stride * comm.size(), 0);
        comm.allgather(mine, &mut self.repair_all)?;
        let all = &self.repair_all;
        let word = |r: usize, i: usize| i32::from_ne_bytes(word4(&all[r * stride + 4 * i..]));
        let n = comm.size();
        for (i, v) in verdict.iter_mut().enumerate() {
            *v = (0..n).map(|r| word(r, i)).max().unwrap_or(*v);
        }
        let all_fit = (0..n).all(|r| (0..=capacity as i32).contains(&word(r, 4)));
        self.gathered = all_fit.then_some(stride);
        Ok(())
    }

    /// Collects the elements whose sums the certificate fails (the same on
    /// every rank: it reads only the final words) with this rank's inputs.
    fn certify(&mut self, q: &[i32], big: &[u64], inexact: &[u64], input: &[u8]) {
        self.repair_at.clear();
        self.repair_mine.clear();
        let mut fail = [0u64; BLOCK_ELEMS / bounded::FLAG_BITS];
        let count = input.len() / 4;
        for (b, scale) in self.scales.iter().enumerate() {
            let Some(BlockScale::Bounded(g)) = *scale else {
                continue;
            };
            let at = b * BLOCK_ELEMS;
            let len = BLOCK_ELEMS.min(count - at);
            let w = at / bounded::FLAG_BITS..(at + len).div_ceil(bounded::FLAG_BITS);
            let fail = &mut fail[..w.len()];
            bounded::certify(&q[at..][..len], &big[w.clone()], &inexact[w], g, fail);
            for (k, word) in fail.iter().enumerate() {
                let mut bits = *word;
                while bits != 0 {
                    let i = at + k * bounded::FLAG_BITS + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    self.repair_at.push(i);
                    self.repair_mine.extend_from_slice(&input[4 * i..4 * i + 4]);
                }
            }
        }
    }

    /// Every rank's inputs for the elements the certificate failed:
    /// carried by the verdict, or gathered now, before the caller's buffer
    /// is written (a failed exchange leaves it as it was). Returns where
    /// they are in `repair_all`: each rank's part `stride` bytes apart,
    /// the values from byte `at` on.
    fn gather_repairs(&mut self, comm: &dyn Comm) -> Result<(usize, usize), DatapathError> {
        let k = self.repair_at.len();
        let carried = self.gathered.take();
        if k == 0 {
            return Ok((0, 0));
        }
        stats::record_repaired(k);
        if let Some(stride) = carried {
            stats::record_repairs_carried();
            return Ok((stride, VERDICT_HEAD));
        }
        self.repair_all.clear();
        self.repair_all.resize(4 * k * comm.size(), 0);
        comm.allgather(&self.repair_mine, &mut self.repair_all)?;
        Ok((4 * k, 0))
    }

    /// Sums the failed elements from every rank's inputs, in f64 and in
    /// rank order, so that every rank writes the same bits. Within the
    /// bound for n ≥ 3 (the only case bounded runs): the f64 sum adds at
    /// most (n−1)·2⁻⁵³·Σ|x| to the final rounding's u·Σ|x|.
    fn write_repairs(&self, (stride, at): (usize, usize), recv: &mut [u8]) {
        for (j, &i) in self.repair_at.iter().enumerate() {
            let sum: f64 = self
                .repair_all
                .chunks_exact(stride)
                .map(|rank| f32::from_ne_bytes(word4(&rank[at + 4 * j..])) as f64)
                .sum();
            recv[4 * i..4 * i + 4].copy_from_slice(&(sum as f32).to_ne_bytes());
        }
    }
}

/// A block's scale under `precision` from its two summary words reduced
/// over `ranks` ranks (`None`: MPI reduces the block).
fn scale(precision: Precision, words: &[i32], ranks: usize) -> Option<BlockScale> {
    let summary = BlockSummary::from_words([words[0], words[1]]);
    match precision {
        Precision::Reproducible => exact::Grid::for_block(summary, ranks).map(BlockScale::Exact),
        Precision::Quantized => {
            quantized::Step::for_block(summary, ranks).map(BlockScale::Quantized)
        }
        Precision::Bounded => quantized::Step::for_block(summary, ranks)
            .map(|step| BlockScale::Bounded(bounded::Grid::new(step, ranks))),
    }
}

fn word4(b: &[u8]) -> [u8; 4] {
    [b[0], b[1], b[2], b[3]]
}

/// The slot buffer as words of `T`. The buffer is an mmap of a BPF array:
/// page-aligned, so there is no unaligned head.
fn slot_words<T: Copy>(slot_buf: &mut [u8]) -> &mut [T] {
    // SAFETY: i32/i64 have no invalid bit patterns.
    let (head, words, _) = unsafe { slot_buf.align_to_mut::<T>() };
    debug_assert!(head.is_empty(), "slot buffers are page-aligned");
    words
}

/// A segment's slot seen as the words of its float SUM contract.
enum SlotWords<'a> {
    Exact(&'a mut [i64]),
    Quantized(&'a mut [i32]),
    Bounded {
        q: &'a mut [i32],
        big: &'a mut [u64],
        inexact: &'a mut [u64],
    },
}

impl<'a> SlotWords<'a> {
    fn new(
        precision: Precision,
        layout: Layout,
        chunk_bytes: usize,
        slot_buf: &'a mut [u8],
    ) -> Self {
        match precision {
            Precision::Reproducible => SlotWords::Exact(slot_words(slot_buf)),
            Precision::Quantized => SlotWords::Quantized(slot_words(slot_buf)),
            Precision::Bounded => {
                let (values, flags) = slot_buf.split_at_mut(layout.flags_offset(chunk_bytes));
                let (big, inexact) = slot_words::<u64>(flags).split_at_mut(layout.flag_words);
                SlotWords::Bounded {
                    q: slot_words(values),
                    big,
                    inexact,
                }
            }
        }
    }

    /// Encodes block `i` (`vals`) on `scale`; a refused block (`None`, or
    /// another contract's scale) travels as zeros, its sums ignored.
    fn encode_block(&mut self, i: usize, vals: &[f32], scale: Option<BlockScale>) {
        let at = i * BLOCK_ELEMS;
        match self {
            SlotWords::Exact(out) => {
                encode_block::<exact::Grid>(vals, scale, &mut out[at..][..vals.len()])
            }
            SlotWords::Quantized(out) => {
                encode_block::<quantized::Step>(vals, scale, &mut out[at..][..vals.len()])
            }
            SlotWords::Bounded { q, big, inexact } => {
                let w = at / bounded::FLAG_BITS..(at + vals.len()).div_ceil(bounded::FLAG_BITS);
                let (q, big, inexact) = (
                    &mut q[at..][..vals.len()],
                    &mut big[w.clone()],
                    &mut inexact[w],
                );
                match scale {
                    Some(BlockScale::Bounded(g)) => bounded::encode(vals, g, q, big, inexact),
                    _ => {
                        q.fill(0);
                        big.fill(0);
                        inexact.fill(0);
                    }
                }
            }
        }
    }
}

/// One float SUM encoding of a block: its wire word and both conversions.
trait BlockCodec: Copy {
    type Word: Copy + Default;
    /// This codec's part of an agreed block scale (`None` for another codec).
    fn of(scale: BlockScale) -> Option<Self>;
    fn encode(self, vals: &[f32], dst: &mut [Self::Word]);
    fn decode(self, src: &[Self::Word], vals: &mut [f32]);
}

impl BlockCodec for exact::Grid {
    type Word = i64;
    fn of(scale: BlockScale) -> Option<Self> {
        match scale {
            BlockScale::Exact(g) => Some(g),
            _ => None,
        }
    }
    fn encode(self, vals: &[f32], dst: &mut [i64]) {
        exact::encode(vals, self, dst)
    }
    fn decode(self, src: &[i64], vals: &mut [f32]) {
        exact::decode(src, self, vals)
    }
}

impl BlockCodec for quantized::Step {
    type Word = i32;
    fn of(scale: BlockScale) -> Option<Self> {
        match scale {
            BlockScale::Quantized(q) => Some(q),
            _ => None,
        }
    }
    fn encode(self, vals: &[f32], dst: &mut [i32]) {
        quantized::encode(vals, self, dst)
    }
    fn decode(self, src: &[i32], vals: &mut [f32]) {
        quantized::decode(src, self, vals)
    }
}

/// Encodes one block on its scale, or zeros when it has none of codec `C`'s.
fn encode_block<C: BlockCodec>(vals: &[f32], scale: Option<BlockScale>, dst: &mut [C::Word]) {
    match scale.and_then(C::of) {
        Some(codec) => codec.encode(vals, dst),
        None => dst.fill(C::Word::default()),
    }
}

/// Decodes every block that travelled on a scale into the caller's buffer;
/// refused blocks are left for [`reduce_refused_blocks`].
fn decode_blocks<C: BlockCodec>(
    slot_buf: &mut [u8],
    scales: &[Option<BlockScale>],
    recv: &mut [u8],
) {
    let words = slot_words::<C::Word>(slot_buf);
    for_each_block_mut(recv, |i, vals| {
        let Some(codec) = scales[i].and_then(C::of) else {
            return false;
        };
        codec.decode(&words[i * BLOCK_ELEMS..][..vals.len()], vals);
        true
    });
}

/// Completes the blocks no integer grid could carry through MPI itself, one
/// PMPI call per run of consecutive such blocks (every rank has the same
/// scales, so every rank makes the same calls).
fn reduce_refused_blocks(
    comm: &dyn Comm,
    scales: &[Option<BlockScale>],
    send: Option<&[u8]>,
    recv: &mut [u8],
    elem: ElemType,
    op: ReduceOp,
) -> Result<(), DatapathError> {
    let block_bytes = BLOCK_ELEMS * elem.size();
    let mut b = 0;
    while b < scales.len() {
        if scales[b].is_some() {
            b += 1;
            continue;
        }
        let first = b;
        while b < scales.len() && scales[b].is_none() {
            b += 1;
        }
        let range = first * block_bytes..(b * block_bytes).min(recv.len());
        stats::record_fallback_bytes(range.len());
        comm.pmpi_allreduce(send.map(|s| &s[range.clone()]), &mut recv[range], elem, op)?;
    }
    Ok(())
}

/// Writes order-preserving keys; true if this rank's data holds a NaN.
pub(super) fn encode_order(input: &[u8], slot_buf: &mut [u8]) -> bool {
    let out = slot_words::<i32>(slot_buf);
    let mut nan = false;
    for_each_block(input, |i, vals| {
        nan |= ordered::encode(vals, &mut out[i * BLOCK_ELEMS..][..vals.len()]);
    });
    nan
}

pub(super) fn decode_order(slot_buf: &mut [u8], recv: &mut [u8]) {
    let keys = slot_words::<i32>(slot_buf);
    for_each_block_mut(recv, |i, vals| {
        ordered::decode(&keys[i * BLOCK_ELEMS..][..vals.len()], vals);
        true
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The block walkers give the same values, and write the same bytes,
    /// whether the buffer is 4-aligned (no copy) or not (through a copy).
    /// A communicator of one rank: the exchanges are the identity.
    struct One;

    impl Comm for One {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            1
        }
        fn allgather(&self, mine: &[u8], all: &mut [u8]) -> Result<(), DatapathError> {
            all.copy_from_slice(mine);
            Ok(())
        }
        fn allreduce_max_i32(&self, _: &mut [i32]) -> Result<(), DatapathError> {
            Ok(())
        }
        fn allreduce_max_i32_watched(
            &self,
            _: &mut [i32],
            _: &mut dyn FnMut() -> Result<(), DatapathError>,
        ) -> Result<(), DatapathError> {
            Ok(())
        }
        fn pmpi_allreduce(
            &self,
            _: Option<&[u8]>,
            _: &mut [u8],
            _: ElemType,
            _: ReduceOp,
        ) -> Result<(), DatapathError> {
            unreachable!("no block is refused here")
        }
        fn pmpi_bcast(&self, _: &mut [u8], _: usize) -> Result<(), DatapathError> {
            unreachable!()
        }
        fn set_deadline(&self, _: Option<std::time::Instant>) {}
    }

    /// The summary pass that encodes on the last scales writes exactly the
    /// slot a separate encode would, and says "changed" as soon as one
    /// block's summary differs.
    #[test]
    fn summarizing_encodes_what_encode_writes() {
        let cb = 3336;
        let n = 3 * BLOCK_ELEMS + 17;
        let mut vals: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1013) as f32 * 1e-3 - 0.5)
            .collect();
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        for precision in [
            Precision::Reproducible,
            Precision::Quantized,
            Precision::Bounded,
        ] {
            let plan = Plan::FloatSum(precision);
            let layout = plan.layout(n, cb);
            let slot_len = layout.chunks as usize * cb;
            let mut want = vec![0u64; slot_len / 8];
            let mut got = vec![0u64; slot_len / 8];
            let as_bytes = |w: &mut Vec<u64>| {
                // SAFETY: u64 storage viewed as bytes, in bounds.
                unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<u8>(), w.len() * 8) }
            };
            let mut fs = FloatSum::default();
            let input = bytes(&vals);
            assert!(!fs.summarize(&input, precision, 0, layout, cb, as_bytes(&mut got)));
            assert!(fs
                .agree(&One, precision, 0, [1, 2, 3, 4])
                .expect("one rank"));
            fs.encode(&input, precision, layout, cb, as_bytes(&mut want));
            assert!(fs.summarize(&input, precision, 0, layout, cb, as_bytes(&mut got)));
            assert!(
                got == want,
                "{precision:?}: the fused pass wrote other words"
            );
            // A block whose exponent range moved: changed.
            let kept = vals[BLOCK_ELEMS + 5];
            vals[BLOCK_ELEMS + 5] = 1e3;
            assert!(!fs.summarize(&bytes(&vals), precision, 0, layout, cb, as_bytes(&mut got)));
            vals[BLOCK_ELEMS + 5] = kept;
        }
    }

    #[test]
    fn every_supported_pair_has_a_plan() {
        use crate::select::datapath_reduces;
        let elems = ElemType::ALL;
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Band,
            ReduceOp::Bor,
            ReduceOp::Bxor,
        ];
        for e in elems {
            for o in ops {
                assert_eq!(
                    datapath_reduces(e, o),
                    Plan::of(e, o, Precision::Bounded).is_some(),
                    "{e:?} {o:?}"
                );
            }
        }
    }
}
