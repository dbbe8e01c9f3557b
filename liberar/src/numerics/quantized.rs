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
simd::dispatch! {
    pub fn decode(src: &[i32], step: Step, dst: &mut [f32]) = decode_loop;
}

#[inline(always)]
fn decode_loop(src: &[i32], step: Step, dst: &mut [f32]) {
    let s = pow2(step.exp);
    for (k, out) in src.iter().zip(dst.iter_mut()) {
        *out = (*k as f64 * s) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
