//! Float ↔ integer conversion at the edges of the in-kernel ring.
//!
//! eBPF has no floating point and this kernel cannot load modules, so the
//! datapath only adds, compares and masks integers. Floats are converted on
//! the host while they are copied into (and out of) kernel memory:
//!
//! * [`bounded`] (default float SUM): i32 on the block's grid plus two flag
//!   bits per element; a certificate every rank evaluates identically
//!   proves each element within the ordered sum's bound (n−1)·u·Σ|x|, and
//!   the few it cannot are summed exactly from every rank's inputs.
//! * [`exact`] (`ERAR_PRECISION=exact`; bounded's choice on 2 ranks): every value of a block of
//!   [`BLOCK_ELEMS`] elements is written as an exact multiple of a grid 2^g
//!   agreed by all ranks, as i64. Integer addition is exact and associative,
//!   so the in-kernel sum is the exact sum on every rank, and one correctly
//!   rounded conversion back gives the float nearest to it: never less
//!   accurate than any ordered float summation (what MPI does), and bitwise
//!   identical everywhere. Blocks whose values cannot be placed on one i64
//!   grid (range too wide, NaN/Inf, -0) are reduced by MPI itself.
//! * [`quantized`] (`ERAR_PRECISION=quantized`): i32 with a shared exponent
//!   per block as in SwitchML: half the bytes, with a documented error bound.
//! * [`ordered`]: float MAX/MIN as integer MAX/MIN on an order-preserving
//!   mapping of the bits (exact).
//!
//! Every rank derives the same per-block scale from a block summary reduced
//! with MAX over the communicator ([`BlockSummary`]), so all ranks encode
//! on the same grid.

pub mod bounded;
pub mod exact;
pub mod ordered;
pub mod quantized;
pub mod simd;
pub mod wide;

/// Elements per exponent block. Small enough that a block's dynamic range is
/// usually narrow, large enough that the pre-pass exchange is ~0.2% of the
/// payload (2 × i32 per 4 KiB of f32 data).
pub const BLOCK_ELEMS: usize = 1024;

/// `ceil(log2(n))`: the bits of headroom a sum of `n` values needs.
pub const fn headroom_bits(n: usize) -> u32 {
    if n <= 1 {
        0
    } else {
        usize::BITS - (n - 1).leading_zeros()
    }
}

/// Per-block facts about f32 data, combined over ranks by element-wise MAX of
/// the two i32 words produced by [`BlockSummary::to_words`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSummary {
    /// Largest biased exponent field among the block's values (0 if only
    /// zeros and subnormals).
    pub max_exp: u32,
    /// Smallest biased exponent field among non-zero values, subnormals
    /// counted as 1; 255 if the block holds only zeros.
    pub min_exp: u32,
    /// A NaN, an infinity or a negative zero: IEEE semantics the integer
    /// path cannot reproduce, so MPI reduces this block.
    pub special: bool,
}

impl BlockSummary {
    /// The summary of an empty (or all +0) block: the identity of [`merge`].
    pub const EMPTY: BlockSummary = BlockSummary {
        max_exp: 0,
        min_exp: 255,
        special: false,
    };

    /// Scans one block: it runs over every element of every float SUM.
    pub fn of(block: &[f32]) -> BlockSummary {
        summarize(block)
    }
}

simd::dispatch! {
    fn summarize(block: &[f32]) -> BlockSummary = summarize_loop;
}

/// Branch-free so that it vectorizes.
#[inline(always)]
fn summarize_loop(block: &[f32]) -> BlockSummary {
    let mut max_exp = 0u32;
    let mut min_exp = 255u32;
    let mut special = 0u32;
    for x in block {
        let bits = x.to_bits();
        let e = (bits >> 23) & 0xff;
        let magnitude = bits & 0x7fff_ffff;
        max_exp = max_exp.max(e);
        // Zeros do not constrain the grid; subnormals sit on exponent 1's grid.
        let grid_e = if magnitude == 0 { 255 } else { e.max(1) };
        min_exp = min_exp.min(grid_e);
        special |= (e == 255) as u32 | (bits == 0x8000_0000) as u32;
    }
    BlockSummary {
        max_exp,
        min_exp,
        special: special != 0,
    }
}

/// A block's scale (its grid or its step), which every rank derives from
/// the same agreed [`BlockSummary`]: on it the block's values travel as
/// integers.
pub trait Scale: Sized {
    /// The scale of a block with no NaN, ±∞ or −0, summarized over all
    /// `ranks`, or `None` when its values do not fit the integers.
    fn for_ordinary_block(summary: BlockSummary, ranks: usize) -> Option<Self>;

    /// The scale of a block summarized over all `ranks`, or `None` when the
    /// block cannot travel as integers (the caller sends it to MPI): never
    /// one holding a NaN, ±∞ or −0, whose IEEE semantics no integer sum
    /// reproduces.
    fn for_block(summary: BlockSummary, ranks: usize) -> Option<Self> {
        if summary.special {
            return None;
        }
        Self::for_ordinary_block(summary, ranks)
    }
}

/// Runs `f` on each block of the f32 values in `input` (with its index):
/// straight from the caller's buffer when it is 4-aligned, as every f32
/// array is; through a copy otherwise.
pub fn for_each_block(input: &[u8], mut f: impl FnMut(usize, &[f32])) {
    if let Some(vals) = simd::as_f32(input) {
        vals.chunks(BLOCK_ELEMS)
            .enumerate()
            .for_each(|(i, b)| f(i, b));
        return;
    }
    let mut tmp = [0f32; BLOCK_ELEMS];
    for (i, block) in input.as_chunks::<4>().0.chunks(BLOCK_ELEMS).enumerate() {
        for (t, b) in tmp.iter_mut().zip(block) {
            *t = f32::from_ne_bytes(*b);
        }
        f(i, &tmp[..block.len()]);
    }
}

/// Runs `f` on block i of several equal-length f32 buffers at once, for
/// each i (the parts in their order): a host's slice leader encodes its
/// local ranks' inputs as the ring would add them (`datapath/node.rs`).
/// Straight from the buffers when every one is 4-aligned; through copies
/// of each block otherwise, as [`for_each_block`] does.
pub fn for_each_block_of_parts(parts: &[&[u8]], mut f: impl FnMut(usize, &[&[f32]])) {
    if let [one] = parts {
        // The ring's own members: no allocation on the per-call path.
        return for_each_block(one, |i, vals| f(i, &[vals]));
    }
    let len = parts.first().map_or(0, |p| p.len() / 4);
    let blocks = (0..len)
        .step_by(BLOCK_ELEMS)
        .map(|at| at..(at + BLOCK_ELEMS).min(len));
    if let Some(vals) = parts
        .iter()
        .map(|p| simd::as_f32(p))
        .collect::<Option<Vec<_>>>()
    {
        let mut block = Vec::with_capacity(vals.len());
        for (i, r) in blocks.enumerate() {
            for v in &vals {
                prefetch_next(&v[r.end..]);
            }
            block.clear();
            block.extend(vals.iter().map(|v| &v[r.clone()]));
            f(i, &block);
        }
        return;
    }
    let mut tmp = vec![[0f32; BLOCK_ELEMS]; parts.len()];
    for (i, r) in blocks.enumerate() {
        for (t, p) in tmp.iter_mut().zip(parts) {
            let words = p[4 * r.start..4 * r.end].as_chunks::<4>().0;
            for (x, w) in t.iter_mut().zip(words) {
                *x = f32::from_ne_bytes(*w);
            }
        }
        let block: Vec<&[f32]> = tmp.iter().map(|t| &t[..r.len()]).collect();
        f(i, &block);
    }
}

/// Asks for the first block of `next` in the L2 cache (a block's
/// elements of it, `BLOCK_ELEMS`): the parts' blocks take turns, each on
/// a page of its own, where the hardware's prefetcher starts over. 8
/// ranks on 4 hosts, `allreduce_bench -T float`, two runs of 3
/// alternating rounds, best, against no prefetch: 1.27x and 1.20x at 4
/// MiB, 1.13x and 1.12x at 8 MiB, 0.99x at 16 MiB.
#[inline(always)]
pub(crate) fn prefetch_next<T>(next: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for line in next[..next.len().min(BLOCK_ELEMS)].chunks(64 / size_of::<T>().max(1)) {
        // SAFETY: a prefetch of memory the slice holds; it never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                line.as_ptr().cast(),
            )
        };
    }
}

/// The same for writing the blocks of `out`: `f` fills each block's values
/// (or leaves them as they are, and then they are not copied back).
pub fn for_each_block_mut(out: &mut [u8], mut f: impl FnMut(usize, &mut [f32]) -> bool) {
    if let Some(vals) = simd::as_f32_mut(out) {
        vals.chunks_mut(BLOCK_ELEMS).enumerate().for_each(|(i, b)| {
            f(i, b);
        });
        return;
    }
    let mut tmp = [0f32; BLOCK_ELEMS];
    for (i, block) in out.chunks_mut(BLOCK_ELEMS * 4).enumerate() {
        let vals = &mut tmp[..block.len() / 4];
        if f(i, vals) {
            for (o, v) in block.as_chunks_mut::<4>().0.iter_mut().zip(vals.iter()) {
                *o = v.to_ne_bytes();
            }
        }
    }
}

impl BlockSummary {
    /// Two words whose element-wise MAX over ranks is the summary of the
    /// union of the ranks' blocks.
    pub fn to_words(self) -> [i32; 2] {
        let hi = if self.special {
            256
        } else {
            self.max_exp as i32
        };
        [hi, 255 - self.min_exp as i32]
    }

    pub fn from_words(w: [i32; 2]) -> BlockSummary {
        BlockSummary {
            max_exp: w[0].clamp(0, 255) as u32,
            min_exp: (255 - w[1]).clamp(0, 255) as u32,
            special: w[0] > 255,
        }
    }

    /// The summary every rank agrees on when rank r holds `blocks[r]`: the
    /// element-wise MAX of their words, as the exchange computes it.
    #[cfg(test)]
    pub(crate) fn agreed(blocks: &[Vec<f32>]) -> BlockSummary {
        let words = blocks.iter().fold(BlockSummary::EMPTY.to_words(), |w, b| {
            let x = BlockSummary::of(b).to_words();
            [w[0].max(x[0]), w[1].max(x[1])]
        });
        BlockSummary::from_words(words)
    }
}

/// The unit tests' random numbers: a 64-bit LCG (Knuth's MMIX constants)
/// from `seed`, each call the next state (so a seed always gives the same
/// data).
#[cfg(test)]
pub(crate) fn test_rng(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        seed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every codec gives the same bits at every SIMD level this CPU has (the
    /// portable build is what a node without AVX2 runs), on data with
    /// specials, subnormals, wide ranges and exact sums beyond 53 bits.
    #[test]
    fn every_simd_level_gives_the_same_bits() {
        let mut rng = test_rng(7);
        let mut next = move || (rng() >> 32) as u32;
        let n = 3 * BLOCK_ELEMS + 17;
        let mut vals: Vec<f32> = (0..n)
            .map(|i| match i % 5 {
                0 => f32::from_bits(next()),
                1 => f32::from_bits(next() & 0x807f_ffff), // subnormal or zero
                _ => (next() as f32 / u32::MAX as f32 - 0.5) * 1e-3,
            })
            .collect();
        vals[5] = f32::NAN;
        vals[6] = -0.0;
        let wide: Vec<i64> = (0..n as i64)
            .map(|i| ((i - 100).wrapping_mul((1 << 55) + 12345)).wrapping_add(next() as i64))
            .collect();
        let narrow: Vec<i64> = (0..n).map(|_| next() as i32 as i64).collect();
        let keys: Vec<i32> = (0..n).map(|_| next() as i32).collect();
        let run = || {
            let mut out = Vec::new();
            for block in vals.chunks(BLOCK_ELEMS) {
                let s = BlockSummary::of(block);
                out.push(format!("{s:?}"));
                let mut k = vec![0i32; block.len()];
                out.push(format!("{:?}", ordered::encode(block, &mut k)));
                out.extend(k.iter().map(|x| x.to_string()));
                if let Some(step) = quantized::Step::for_block(s, 4) {
                    quantized::encode(block, step, &mut k);
                    out.extend(k.iter().map(|x| x.to_string()));
                }
            }
            // Bounded encode and certificate on blocks without specials
            // (subnormals and wide ranges kept).
            let finite: Vec<f32> = vals
                .iter()
                .map(|v| {
                    if v.is_finite() && v.to_bits() != 0x8000_0000 {
                        *v
                    } else {
                        0.5
                    }
                })
                .collect();
            for block in finite.chunks(BLOCK_ELEMS) {
                let step = quantized::Step::for_block(BlockSummary::of(block), 4).expect("finite");
                let words = block.len().div_ceil(bounded::FLAG_BITS);
                let (mut q, mut big, mut inexact) = (
                    vec![0i32; block.len()],
                    vec![0u64; words],
                    vec![0u64; words],
                );
                let grid = bounded::Grid::new(step, 4);
                bounded::encode(block, grid, &mut q, &mut big, &mut inexact);
                out.extend(q.iter().map(|x| x.to_string()));
                out.push(format!("{big:?} {inexact:?}"));
                // A second input added in place: the reversed block.
                let second: Vec<f32> = block.iter().rev().copied().collect();
                let (mut q2, mut big2, mut inexact2) = (q.clone(), big.clone(), inexact.clone());
                bounded::encode_add(&second, grid, &mut q2, &mut big2, &mut inexact2);
                out.extend(q2.iter().map(|x| x.to_string()));
                out.push(format!("{big2:?} {inexact2:?}"));
                let mut fail = vec![0u64; words];
                bounded::certify(&q, &big, &inexact, grid, &mut fail);
                out.push(format!("{fail:?}"));
            }
            // Exact encode on a block that fits one grid.
            let fine: Vec<f32> = vals
                .iter()
                .map(|v| {
                    if v.is_finite() && *v != 0.0 {
                        v.abs().clamp(1e-30, 1e-20)
                    } else {
                        1e-25
                    }
                })
                .collect();
            for block in fine.chunks(BLOCK_ELEMS) {
                let grid = exact::Grid::for_block(BlockSummary::of(block), 4).expect("one grid");
                let mut w = vec![0i64; block.len()];
                exact::encode(block, grid, &mut w);
                out.extend(w.iter().map(|x| x.to_string()));
                let mut f = vec![0f32; block.len()];
                for src in [&wide, &narrow] {
                    exact::decode(&src[..block.len()], grid, &mut f);
                    out.extend(f.iter().map(|x| x.to_bits().to_string()));
                }
            }
            let mut f = vec![0f32; n];
            ordered::decode(&keys, &mut f);
            out.extend(f.iter().map(|x| x.to_bits().to_string()));
            let step = quantized::Step::for_block(BlockSummary::of(&[1.0]), 4).expect("finite");
            quantized::decode(&keys, step, &mut f);
            out.extend(f.iter().map(|x| x.to_bits().to_string()));
            out
        };
        let portable = simd::with_level(simd::Level::Portable, run);
        for level in simd::Level::ALL {
            let got = simd::with_level(level, run);
            assert!(got == portable, "{} differs from portable", level.name());
        }
    }

    #[test]
    fn block_walkers_do_not_depend_on_alignment() {
        let n = 2 * BLOCK_ELEMS + 3;
        let vals: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_ne_bytes()).collect();
        let mut store = vec![0u64; bytes.len() / 8 + 2];
        // SAFETY: u64 storage viewed as bytes, in bounds.
        let raw = unsafe {
            std::slice::from_raw_parts_mut(store.as_mut_ptr().cast::<u8>(), store.len() * 8)
        };
        for offset in [0, 1] {
            let buf = &mut raw[offset..offset + bytes.len()];
            buf.copy_from_slice(&bytes);
            assert_eq!(simd::as_f32(buf).is_some(), offset == 0);
            let mut seen = Vec::new();
            for_each_block(buf, |i, b| {
                assert_eq!(seen.len(), i * BLOCK_ELEMS);
                seen.extend_from_slice(b)
            });
            assert_eq!(seen, vals);
            // Negate every block but the second, which is left alone.
            for_each_block_mut(buf, |i, b| {
                if i == 1 {
                    return false;
                }
                b.iter_mut()
                    .enumerate()
                    .for_each(|(k, v)| *v = -vals[i * BLOCK_ELEMS + k]);
                true
            });
            let mut got = Vec::new();
            for_each_block(buf, |_, b| got.extend_from_slice(b));
            for (k, (g, v)) in got.iter().zip(&vals).enumerate() {
                let want = if k / BLOCK_ELEMS == 1 { *v } else { -*v };
                assert_eq!(g.to_bits(), want.to_bits(), "offset {offset}, element {k}");
            }
        }
    }

    #[test]
    fn headroom() {
        assert_eq!(headroom_bits(1), 0);
        assert_eq!(headroom_bits(2), 1);
        assert_eq!(headroom_bits(3), 2);
        assert_eq!(headroom_bits(4), 2);
        assert_eq!(headroom_bits(5), 3);
        assert_eq!(headroom_bits(1024), 10);
    }

    #[test]
    fn summary_words_merge_by_max() {
        let a = BlockSummary::of(&[1.0, 0.0, 3.0e-3]);
        let b = BlockSummary::of(&[-1.0e6, 2.0]);
        let wa = a.to_words();
        let wb = b.to_words();
        let merged = BlockSummary::from_words([wa[0].max(wb[0]), wa[1].max(wb[1])]);
        let both = BlockSummary::of(&[1.0, 0.0, 3.0e-3, -1.0e6, 2.0]);
        assert_eq!(merged, both);
        assert_eq!(
            BlockSummary::from_words(BlockSummary::EMPTY.to_words()),
            BlockSummary::EMPTY
        );
    }

    #[test]
    fn specials_are_flagged() {
        for x in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0] {
            let s = BlockSummary::of(&[1.0, x]);
            assert!(s.special, "{x:?}");
            assert!(BlockSummary::from_words(s.to_words()).special);
        }
        assert!(!BlockSummary::of(&[0.0, 1.0e-40, 1.0]).special);
    }
}
