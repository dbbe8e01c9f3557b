//! Quantized float SUM (`ERAR_PRECISION=quantized`): i32 with one shared
//! exponent per block, as in SwitchML. Half the bytes of [`super::exact`].
//!
//! Error bound, per element, for `n` ranks whose block maximum magnitude is
//! below 2^(t+1): each value is rounded to the step q = 2^(t + 1 + h − 30)
//! (h = ceil(log2 n)), so the sum is off by at most n·q/2 before the final
//! rounding to f32 (≤ ½ ulp of the result). Relative to the block maximum
//! that is ≤ n · 2^(h − 29): 1.5e-8 for 4 ranks, 4.8e-7 for 64.

use super::exact::pow2;
use super::{headroom_bits, simd, BlockSummary, Scale};

/// Exponent of the quantization step of one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    exp: i32,
}

impl Scale for Step {
    /// Never `None`: any range fits, on a coarser step.
    fn for_ordinary_block(summary: BlockSummary, ranks: usize) -> Option<Step> {
        let top = summary.max_exp.max(1) as i32 - 127;
        Some(Step {
            exp: top + 1 + headroom_bits(ranks) as i32 - 30,
        })
    }
}

impl Step {
    /// The step 2^`exp`, as [`Step::exp`] gave it: a step agreed already,
    /// handed between the ranks of one host.
    pub fn of_exp(exp: i32) -> Step {
        Step { exp }
    }

    /// log2 of the step.
    pub fn exp(self) -> i32 {
        self.exp
    }

    /// The step itself.
    pub fn size(self) -> f64 {
        pow2(self.exp)
    }

    /// The largest error the sum of `ranks` values can carry on this block
    /// (excluding the final rounding to f32).
    pub fn error_bound(self, ranks: usize) -> f64 {
        ranks as f64 * pow2(self.exp - 1)
    }
}

simd::dispatch! {
    /// Rounds each value to the nearest multiple of the step (halves to
    /// even).
    pub fn encode(src: &[f32], step: Step, dst: &mut [i32]) = encode_loop;
}

/// 1.5·2⁵²: adding it to an f64 of magnitude below 2⁵¹ rounds that value
/// to an integer (to nearest, halves to even), which then stands, in two's
/// complement, in the low bits of the sum's representation.
pub(crate) const ROUNDER: f64 = 6_755_399_441_055_744.0;

/// `x / step` (exact in f64: a power-of-two scaling of a 24-bit mantissa,
/// far from f64's range limits) rounded to the nearest integer, and that
/// integer as an f64. By construction |x| < 2^(step.exp + 30), so it fits
/// an i32.
///
/// Float arithmetic that vectorizes on every level (add, multiply; no
/// rounding instruction, which the baseline x86-64 target lacks): the
/// integer-shift formulation it replaced ran the bounded encode at 7.3
/// GB/s with AVX-512 on the EPYC of session 8, a third of memcpy.
#[inline(always)]
pub(crate) fn round_to_grid(x: f32, inv_step: f64) -> (i32, f64, f64) {
    let y = x as f64 * inv_step;
    let t = y + ROUNDER;
    (t.to_bits() as u32 as i32, t - ROUNDER, y)
}

#[inline(always)]
fn encode_loop(src: &[f32], step: Step, dst: &mut [i32]) {
    let inv = pow2(-step.exp);
    for (x, out) in src.iter().zip(dst.iter_mut()) {
        *out = round_to_grid(*x, inv).0;
    }
}
/// Each word times the step, rounded to f32 (by [`decode_loop`]'s
/// arithmetic, whatever the level: the same bits).
pub fn decode(src: &[i32], step: Step, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd::level() == simd::Level::Avx512 {
        // SAFETY: `level()` never answers above what the CPU has.
        return unsafe { decode_avx512::<false>(src, step, dst) };
    }
    decode_compiled(src, step, dst)
}

simd::dispatch! {
    fn decode_compiled(src: &[i32], step: Step, dst: &mut [f32]) = decode_loop;
}

#[inline(always)]
fn decode_loop(src: &[i32], step: Step, dst: &mut [f32]) {
    let s = pow2(step.exp);
    for (k, out) in src.iter().zip(dst.iter_mut()) {
        *out = (*k as f64 * s) as f32;
    }
}

/// [`decode`] with non-temporal stores (AVX2 or AVX-512; else [`decode`]):
/// for a result written once into memory that no core reads again soon,
/// where an ordinary store reads every destination line first (the node
/// path's decode of each slice into a rank's buffer, `datapath/copy.rs`).
/// The same bits as [`decode`] (on AVX2 by the same conversions, lane by
/// lane; on AVX-512 by `decode_avx512`, which says why). A run of these
/// must end with [`simd::store_fence`] before anything else reads the
/// values or learns they are written: one fence per block cost more than
/// the decode (a 4 KiB block a call here).
pub fn decode_streamed(src: &[i32], step: Step, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let n = src.len().min(dst.len());
        let (src, dst) = (&src[..n], &mut dst[..n]);
        match simd::level() {
            // SAFETY: `level()` never answers above what the CPU has.
            simd::Level::Avx512 => return unsafe { decode_avx512::<true>(src, step, dst) },
            // SAFETY: as above.
            simd::Level::Avx2 => return unsafe { decode_streamed_avx2(src, step, dst) },
            simd::Level::Portable => {}
        }
    }
    decode(src, step, dst)
}

/// [`decode`] (`STREAM`: [`decode_streamed`]) on AVX-512, 16 values a
/// step (streamed: from the first 64-byte aligned value on; the head and
/// the tail by [`decode_loop`]). In f32 where that gives the f64 loop's
/// bits, which is every value whose result is a normal f32: k·2^e in f64
/// is exact, and its rounding to f32 is k rounded to 24 bits (the
/// conversion of k to f32) times 2^e, exact as two power-of-two scalings
/// 2^a·2^b, each a normal f32, while nothing is subnormal. A group with a
/// value whose result would be subnormal (|k| < 2^(−126−e), not 0) goes
/// through f64, where the one rounding is to the subnormal grid. The f64
/// loop's conversions (two to f64, two back, a shuffle) bound it more
/// than memory did: with it and the fused encode (bounded.rs,
/// `encode_summarized`), 8 ranks on 4 hosts, OSU `-T mpi_float`, the
/// session 22 build against this one, alternating, best: 1.27x (1 MiB),
/// 1.18x, 1.13x, 1.03x (8 MiB) in one run, 1.15x, 1.01x, 1.00x, 1.03x in
/// another; steady-state CPU per 1 MiB call (all CPUs, 3 rounds) 7.3-7.5
/// ms against 5.9-6.9.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn decode_avx512<const STREAM: bool>(src: &[i32], step: Step, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    let head = if STREAM {
        dst.as_ptr().align_offset(64).min(n)
    } else {
        0
    };
    decode_loop(&src[..head], step, &mut dst[..head]);
    let e = step.exp;
    let a = e.clamp(-126, 127);
    let b = e - a;
    // Below 2^-29, 2^b is no normal f32 (no grid has such a step): every
    // nonzero value goes through f64.
    let tiny = match -126 - e {
        _ if !(-29..=0).contains(&b) => u32::MAX,
        bits @ 1.. => 1u32 << bits,
        _ => 0,
    };
    let (fa, fb) = (
        _mm512_set1_ps(pow2(a) as f32),
        _mm512_set1_ps(pow2(b) as f32),
    );
    let (s, tiny) = (_mm512_set1_pd(pow2(e)), _mm512_set1_epi32(tiny as i32));
    let groups = (n - head) / 16;
    let (from, to) = (src[head..].as_ptr(), dst[head..].as_mut_ptr());
    for g in 0..groups {
        // SAFETY: group g lies within both slices (g < groups, counted
        // from `head`); streamed, `to + head` is 64-byte aligned, as the
        // streaming store needs, and so is every 16-value step from it.
        unsafe {
            let k = _mm512_loadu_si512(from.add(16 * g).cast());
            let nonzero = _mm512_test_epi32_mask(k, k);
            let v = if _mm512_mask_cmplt_epu32_mask(nonzero, _mm512_abs_epi32(k), tiny) == 0 {
                _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(k), fa), fb)
            } else {
                let lo = _mm512_cvtepi32_pd(_mm512_castsi512_si256(k));
                let hi = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64::<1>(k));
                let lo = _mm512_cvtpd_ps(_mm512_mul_pd(lo, s));
                let hi = _mm512_cvtpd_ps(_mm512_mul_pd(hi, s));
                _mm512_insertf32x8::<1>(_mm512_castps256_ps512(lo), hi)
            };
            if STREAM {
                _mm512_stream_ps(to.add(16 * g), v);
            } else {
                _mm512_storeu_ps(to.add(16 * g), v);
            }
        }
    }
    let done = head + 16 * groups;
    decode_loop(&src[done..], step, &mut dst[done..]);
}

/// [`decode_streamed`], AVX2: as the AVX-512 one, 8 values a store from a
/// 32-byte aligned destination.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn decode_streamed_avx2(src: &[i32], step: Step, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let head = dst.as_ptr().align_offset(32).min(dst.len());
    decode_loop(&src[..head], step, &mut dst[..head]);
    let s = _mm256_set1_pd(pow2(step.exp));
    let groups = (dst.len() - head) / 8;
    let (from, to) = (src[head..].as_ptr(), dst[head..].as_mut_ptr());
    for g in 0..groups {
        // SAFETY: as in the AVX-512 one, for groups of 8 and 32 bytes.
        unsafe {
            let k = _mm256_loadu_si256(from.add(8 * g).cast());
            let lo = _mm256_cvtepi32_pd(_mm256_castsi256_si128(k));
            let hi = _mm256_cvtepi32_pd(_mm256_extracti128_si256::<1>(k));
            let lo = _mm256_cvtpd_ps(_mm256_mul_pd(lo, s));
            let hi = _mm256_cvtpd_ps(_mm256_mul_pd(hi, s));
            let v = _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi);
            _mm256_stream_ps(to.add(8 * g), v);
        }
    }
    let done = head + 8 * groups;
    decode_loop(&src[done..], step, &mut dst[done..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streamed decode writes the bits of the plain one at every SIMD
    /// level, length and destination misalignment, and nothing outside.
    #[test]
    fn streamed_decode_gives_the_same_bits() {
        use simd::{with_level, Level};
        let src: Vec<i32> = (0..1100u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ (i << 7)) as i32)
            .collect();
        for level in [Level::Portable, Level::Avx2, Level::Avx512] {
            for (len, off, exp) in [
                (0, 0, 0),
                (7, 1, -30),
                (16, 0, 3),
                (1024, 3, -149),
                (1100, 5, 100),
            ] {
                let step = Step::of_exp(exp);
                let mut want = vec![0f32; len];
                decode_loop(&src[..len], step, &mut want);
                let mut got = vec![-1f32; len + off + 8];
                with_level(level, || {
                    decode_streamed(&src[..len], step, &mut got[off..off + len])
                });
                let what = format!("{level:?}, {len} values at +{off}, step 2^{exp}");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got[off..off + len]), bits(&want), "{what}");
                assert!(
                    got[..off]
                        .iter()
                        .chain(&got[off + len..])
                        .all(|x| *x == -1.0),
                    "{what}"
                );
            }
        }
    }

    /// At every level, the plain decode writes the f64 loop's bits: steps
    /// across the whole range a grid gives and beyond, with words whose
    /// results are normal, at the subnormal edge, subnormal, zero, and the
    /// extremes of i32.
    #[test]
    fn decode_gives_the_f64_loops_bits() {
        use simd::{with_level, Level};
        let mut x = 0x9e37_79b9u32;
        let mut src: Vec<i32> = (0..2000)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                // Magnitudes of every bit length, both signs.
                let v = (x >> (i % 32)) as i32;
                if i % 3 == 0 {
                    v.wrapping_neg()
                } else {
                    v
                }
            })
            .collect();
        src[..6].copy_from_slice(&[0, 1, -1, i32::MIN, i32::MAX, 1 << 24 | 1]);
        // Groups of 16 where every word is large: the f32 lanes.
        for (g, w) in src[1000..1320].iter_mut().enumerate() {
            *w = (1 << 29) + g as i32 * 977;
        }
        for level in Level::ALL {
            for exp in [
                -200, -160, -155, -154, -151, -140, -127, -126, -125, -60, 0, 70, 97, 101, 120,
            ] {
                let step = Step::of_exp(exp);
                // Groups of 16 just either side of the subnormal edge,
                // |k| = 2^(-126-exp), with every low bit pattern.
                let edge = (-126 - exp).clamp(1, 30);
                let mut src = src.clone();
                for (j, w) in src[1400..1720].iter_mut().enumerate() {
                    let low = (j as i32).wrapping_mul(0x2f1b_3a5d) & ((1 << (edge - 1)) - 1);
                    *w = if j < 160 { 1 << (edge - 1) } else { 1 << edge } | low;
                }
                let mut want = vec![0f32; src.len()];
                decode_loop(&src, step, &mut want);
                let mut got = vec![-1f32; src.len()];
                with_level(level, || decode(&src, step, &mut got));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{level:?}, step 2^{exp}");
            }
        }
    }

    #[test]
    fn error_within_documented_bound() {
        let n = 4;
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| {
                (0..1024)
                    .map(|i| ((i * 7 + r * 13) as f32).sin() * 10f32.powi((i % 9) as i32 - 4))
                    .collect()
            })
            .collect();
        let step = Step::for_block(BlockSummary::agreed(&inputs), n).expect("finite");
        let mut total = vec![0i32; 1024];
        let mut enc = vec![0i32; 1024];
        for inp in &inputs {
            encode(inp, step, &mut enc);
            for (t, e) in total.iter_mut().zip(&enc) {
                *t = t.checked_add(*e).expect("no overflow by construction");
            }
        }
        let mut out = vec![0f32; 1024];
        decode(&total, step, &mut out);
        let bound = step.error_bound(n);
        for i in 0..1024 {
            let exact: f64 = inputs.iter().map(|v| v[i] as f64).sum();
            let ulp = (out[i].abs() as f64) * f32::EPSILON as f64;
            assert!((out[i] as f64 - exact).abs() <= bound + ulp, "i={i}");
        }
    }
}
