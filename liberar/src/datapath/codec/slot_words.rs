//! The slot seen as words, and the conversions between the caller's floats
//! and them: float SUM per block on its agreed scale (into the slot, and out
//! of it for the blocks that travelled), and float MAX/MIN as
//! order-preserving keys.

use super::{BlockScale, Layout};
use crate::config::Precision;
use crate::numerics::{
    bounded, exact, for_each_block, for_each_block_mut, ordered, prefetch_next, quantized, simd,
    BlockSummary, BLOCK_ELEMS,
};

/// The slot buffer as words of `T`. The buffer is an mmap of a BPF array:
/// page-aligned, so there is no unaligned head.
pub(super) fn slot_words<T: Copy>(slot_buf: &mut [u8]) -> &mut [T] {
    // SAFETY: i32/i64 have no invalid bit patterns.
    let (head, words, _) = unsafe { slot_buf.align_to_mut::<T>() };
    debug_assert!(head.is_empty(), "slot buffers are page-aligned");
    words
}

/// A segment's slot seen as the words of its float SUM contract.
pub(super) enum SlotWords<'a> {
    Exact(&'a mut [i64]),
    Quantized(&'a mut [i32]),
    Bounded {
        q: &'a mut [i32],
        big: &'a mut [u64],
        inexact: &'a mut [u64],
    },
}

impl<'a> SlotWords<'a> {
    pub(super) fn new(
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
    pub(super) fn encode_block(&mut self, i: usize, vals: &[f32], scale: Option<BlockScale>) {
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

    /// [`SlotWords::encode_block_parts`], returning the parts'
    /// [`summary_words`]: from the same loads where the contract has a
    /// loop that does both (bounded, `bounded::encode_summarized`),
    /// else summarized first.
    pub(super) fn encode_block_parts_summarized(
        &mut self,
        i: usize,
        parts: &[&[f32]],
        scale: Option<BlockScale>,
    ) -> [i32; 2] {
        if let (SlotWords::Bounded { q, big, inexact }, Some(BlockScale::Bounded(g))) =
            (&mut *self, scale)
        {
            let at = i * BLOCK_ELEMS;
            let mut words = [i32::MIN; 2];
            for (k, vals) in parts.iter().enumerate() {
                let n = vals.len();
                let w = at / bounded::FLAG_BITS..(at + n).div_ceil(bounded::FLAG_BITS);
                let (q, big, inexact) = (&mut q[at..][..n], &mut big[w.clone()], &mut inexact[w]);
                let fused = if k == 0 {
                    bounded::encode_summarized::<false>(vals, g, q, big, inexact)
                } else {
                    bounded::encode_summarized::<true>(vals, g, q, big, inexact)
                };
                // (The CPU and the step decide: every part or none.)
                let Some(summary) = fused else { break };
                let x = summary.to_words();
                words = [words[0].max(x[0]), words[1].max(x[1])];
                if k + 1 == parts.len() {
                    return words;
                }
            }
        }
        let words = summary_words(parts);
        self.encode_block_parts(i, parts, scale);
        words
    }

    /// Encodes block `i` of several contributions (a host's local ranks'
    /// inputs, `parts`) as the ring would add them: each on `scale`, the
    /// words summed and the bounded flags ORed, as the XDP op does.
    pub(super) fn encode_block_parts(
        &mut self,
        i: usize,
        parts: &[&[f32]],
        scale: Option<BlockScale>,
    ) {
        let Some((first, rest)) = parts.split_first() else {
            return;
        };
        self.encode_block(i, first, scale);
        if scale.is_none() {
            return; // zeros, ignored
        }
        let at = i * BLOCK_ELEMS;
        for vals in rest {
            let n = vals.len();
            match self {
                SlotWords::Exact(out) => {
                    let mut tmp = [0i64; BLOCK_ELEMS];
                    encode_block::<exact::Grid>(vals, scale, &mut tmp[..n]);
                    add_words(&mut out[at..][..n], &tmp[..n], i64::wrapping_add);
                }
                SlotWords::Quantized(out) => {
                    let mut tmp = [0i32; BLOCK_ELEMS];
                    encode_block::<quantized::Step>(vals, scale, &mut tmp[..n]);
                    add_words(&mut out[at..][..n], &tmp[..n], i32::wrapping_add);
                }
                SlotWords::Bounded { q, big, inexact } => {
                    let Some(BlockScale::Bounded(g)) = scale else {
                        return;
                    };
                    let w = at / bounded::FLAG_BITS..(at + n).div_ceil(bounded::FLAG_BITS);
                    let (q, big, inexact) =
                        (&mut q[at..][..n], &mut big[w.clone()], &mut inexact[w]);
                    bounded::encode_add(vals, g, q, big, inexact);
                }
            }
        }
    }
}

/// The summary words of one block of several contributions: the MAX of
/// each one's, as the exchange would reduce them.
pub(super) fn summary_words(parts: &[&[f32]]) -> [i32; 2] {
    parts.iter().fold([i32::MIN; 2], |acc, vals| {
        let w = BlockSummary::of(vals).to_words();
        [acc[0].max(w[0]), acc[1].max(w[1])]
    })
}

/// `dst[k] = op(dst[k], src[k])`: the kernel's combine of one word kind.
fn add_words<T: Copy>(dst: &mut [T], src: &[T], op: impl Fn(T, T) -> T) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = op(*d, *s);
    }
}

/// One float SUM encoding of a block: its wire word and both conversions.
pub(super) trait BlockCodec: Copy {
    type Word: Copy + Default;
    /// This codec's part of an agreed block scale (`None` for another codec).
    fn of(scale: BlockScale) -> Option<Self>;
    fn encode(self, vals: &[f32], dst: &mut [Self::Word]);
    fn decode(self, src: &[Self::Word], vals: &mut [f32]);
}

/// `impl BlockCodec` for a numerics codec: its scale type, the
/// [`BlockScale`] variant that carries it, and its wire word; the
/// conversions are the module's `encode` and `decode`.
macro_rules! block_codec {
    ($($codec:ident::$scale:ident in BlockScale::$variant:ident as $word:ty;)*) => {$(
        impl BlockCodec for $codec::$scale {
            type Word = $word;
            fn of(scale: BlockScale) -> Option<Self> {
                match scale {
                    BlockScale::$variant(s) => Some(s),
                    _ => None,
                }
            }
            fn encode(self, vals: &[f32], dst: &mut [$word]) {
                $codec::encode(vals, self, dst)
            }
            fn decode(self, src: &[$word], vals: &mut [f32]) {
                $codec::decode(src, self, vals)
            }
        }
    )*};
}

block_codec! {
    exact::Grid in BlockScale::Exact as i64;
    quantized::Step in BlockScale::Quantized as i32;
}

/// Encodes one block on its scale, or zeros when it has none of codec `C`'s.
fn encode_block<C: BlockCodec>(vals: &[f32], scale: Option<BlockScale>, dst: &mut [C::Word]) {
    match scale.and_then(C::of) {
        Some(codec) => codec.encode(vals, dst),
        None => dst.fill(C::Word::default()),
    }
}

/// Decodes every block that travelled on a scale into the caller's buffer;
/// refused blocks are left for
/// [`reduce_refused_blocks`](super::float_sum::reduce_refused_blocks).
pub(super) fn decode_blocks<C: BlockCodec>(
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

/// A kept result's step word for a block that did not travel (MPI
/// completes it).
const NO_STEP: i32 = i32::MIN;

/// Writes what each rank needs to decode a float SUM result kept in its
/// slot ([`decode_kept`]) at the start of `out`, where the values would
/// go (native-endian u32 words): each block's step exponent, in block
/// order (`NO_STEP` for a refused block, or a scale with no step: exact
/// grids are never kept), then how many elements the bounded certificate
/// repaired, then each one's index and value bits, in element order.
/// False, with nothing to keep, if they do not fit: a block's step needs
/// 4 of its 4096 bytes, a repair 8 of the element's 4.
pub(super) fn write_kept(
    scales: &[Option<BlockScale>],
    repairs: impl ExactSizeIterator<Item = (usize, f32)>,
    out: &mut [u8],
) -> bool {
    let repairs_at = 4 * scales.len();
    if repairs_at + 4 + 8 * repairs.len() > out.len() {
        return false;
    }
    let (steps, rest) = out.split_at_mut(repairs_at);
    for (scale, word) in scales.iter().zip(steps.chunks_exact_mut(4)) {
        let exp = match scale {
            Some(BlockScale::Quantized(step)) => step.exp(),
            Some(BlockScale::Bounded(g)) => g.step.exp(),
            _ => NO_STEP,
        };
        word.copy_from_slice(&exp.to_ne_bytes());
    }
    rest[..4].copy_from_slice(&(repairs.len() as u32).to_ne_bytes());
    for ((i, value), pair) in repairs.zip(rest[4..].chunks_exact_mut(8)) {
        pair[..4].copy_from_slice(&(i as u32).to_ne_bytes());
        pair[4..].copy_from_slice(&value.to_ne_bytes());
    }
    true
}

/// Decodes a float SUM result kept in its slot: `words`, the slot's first
/// `recv.len()` bytes, on the block steps [`write_kept`] left in `kept`,
/// into `recv`, then writes the repaired elements it lists: as the
/// leader's own decode would (the same functions, so the same bits), with
/// streaming stores if `streamed`, each block's words
/// prefetched while the one before decodes (8 ranks, `allreduce_bench -T
/// float`, two runs of 3 alternating rounds against none: 1.15x and 1.09x
/// at 2 MiB, 1.27x and 1.02x at 4 MiB, 1.05x and 1.13x at 8 MiB, 1.02x and
/// 0.97x at 16 MiB). A block without a step is left as it is: MPI
/// completes it. False if `words` is not 4-aligned (a slot mapping always
/// is) or shorter than `recv`, or `kept` is not whole.
pub(in crate::datapath) fn decode_kept(
    words: &[u8],
    kept: &[u8],
    recv: &mut [u8],
    streamed: bool,
) -> bool {
    // SAFETY: every bit pattern is an i32.
    let (head, q, _) = unsafe { words.align_to::<i32>() };
    if !head.is_empty() || 4 * q.len() < recv.len() {
        return false;
    }
    let word = |at: usize| {
        let w = kept.get(at..at + 4)?;
        Some(u32::from_ne_bytes([w[0], w[1], w[2], w[3]]))
    };
    let step_of = |i: usize| {
        let exp = word(4 * i)? as i32;
        (exp != NO_STEP).then(|| quantized::Step::of_exp(exp))
    };
    // The repairs, each in a block that has a step (the certificate runs
    // on no other): all checked before anything is written.
    let len = recv.len();
    let repairs_at = 4 * len.div_ceil(4 * BLOCK_ELEMS);
    let repair = |r: usize| {
        let at = repairs_at + 4 + 8 * r;
        let (i, bits) = (word(at)? as usize, word(at + 4)?);
        (4 * i + 4 <= len && step_of(i / BLOCK_ELEMS).is_some()).then_some((i, bits))
    };
    let Some(repairs) = word(repairs_at) else {
        return false;
    };
    if !(0..repairs as usize).all(|r| repair(r).is_some()) {
        return false;
    }
    for_each_block_mut(recv, |i, vals| {
        let Some(step) = step_of(i) else {
            return false;
        };
        let words = &q[i * BLOCK_ELEMS..][..vals.len()];
        prefetch_next(q.get((i + 1) * BLOCK_ELEMS..).unwrap_or_default());
        if streamed {
            quantized::decode_streamed(words, step, vals);
        } else {
            quantized::decode(words, step, vals);
        }
        true
    });
    if streamed {
        simd::store_fence();
    }
    for (i, bits) in (0..repairs as usize).filter_map(repair) {
        recv[4 * i..4 * i + 4].copy_from_slice(&bits.to_ne_bytes());
    }
    true
}

/// Writes order-preserving keys; true if this rank's data holds a NaN.
pub(in crate::datapath) fn encode_order(input: &[u8], slot_buf: &mut [u8]) -> bool {
    let out = slot_words::<i32>(slot_buf);
    let mut nan = false;
    for_each_block(input, |i, vals| {
        nan |= ordered::encode(vals, &mut out[i * BLOCK_ELEMS..][..vals.len()]);
    });
    nan
}

pub(in crate::datapath) fn decode_order(slot_buf: &mut [u8], recv: &mut [u8]) {
    let keys = slot_words::<i32>(slot_buf);
    for_each_block_mut(recv, |i, vals| {
        ordered::decode(&keys[i * BLOCK_ELEMS..][..vals.len()], vals);
        true
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the leader keeps decodes, on every rank, to each block's words
    /// times its step, the repairs written over them, and a refused block
    /// left as it was; streamed or not. A list that does not fit is not
    /// kept, and one that names an element of a refused block is refused
    /// before anything is written.
    #[test]
    fn kept_results_decode_with_their_steps_and_repairs() {
        let n = 2 * BLOCK_ELEMS + 300;
        let q: Vec<i32> = (0..n as i32)
            .map(|i| i.wrapping_mul(40503) - 7_000_000)
            .collect();
        let words: Vec<u8> = q.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let (a, b) = (quantized::Step::of_exp(-20), quantized::Step::of_exp(3));
        let scales = [
            Some(BlockScale::Quantized(a)),
            None,
            Some(BlockScale::Bounded(bounded::Grid::new(b, 4))),
        ];
        let repairs = [(5usize, 1.5f32), (2 * BLOCK_ELEMS + 299, -3.0)];
        let mut kept = vec![0u8; 4 * n];
        assert!(write_kept(&scales, repairs.iter().copied(), &mut kept));
        let want: Vec<u32> = (0..n)
            .map(
                |i| match (i / BLOCK_ELEMS, repairs.iter().find(|r| r.0 == i)) {
                    (_, Some((_, v))) => v.to_bits(),
                    (0, _) => ((q[i] as f64 * 2f64.powi(-20)) as f32).to_bits(),
                    (1, _) => 0xdead_beef,
                    _ => ((q[i] as f64 * 8.0) as f32).to_bits(),
                },
            )
            .collect();
        for streamed in [true, false] {
            let mut recv = vec![0xdead_beefu32; n];
            let bytes = as_bytes(&mut recv);
            assert!(decode_kept(&words, &kept, bytes, streamed));
            assert_eq!(recv, want, "streamed: {streamed}");
        }

        let too_many = (0..n / 2).map(|i| (i, 0.0f32));
        assert!(!write_kept(&scales, too_many, &mut kept));
        let in_refused = [(BLOCK_ELEMS + 1, 2.0f32)];
        assert!(write_kept(&scales, in_refused.iter().copied(), &mut kept));
        let mut recv = vec![7u32; n];
        assert!(!decode_kept(&words, &kept, as_bytes(&mut recv), true));
        assert!(recv.iter().all(|w| *w == 7), "written before the refusal");
    }

    fn as_bytes(w: &mut [u32]) -> &mut [u8] {
        // SAFETY: u32 to bytes, the same memory.
        unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast(), 4 * w.len()) }
    }
}
