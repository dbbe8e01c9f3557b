//! Exact float SUM: f32 values as i64 multiples of a per-block grid.
//!
//! A block is exact when every value of every rank is an integer multiple of
//! the grid 2^g (g = the lowest exponent present, minus 23 mantissa bits) and
//! the largest possible sum of `n` such multiples fits in 63 bits. Then the
//! in-kernel i64 sum *is* the exact real sum, and [`decode`] rounds it once,
//! to nearest-even: the best float answer there is.

use super::{headroom_bits, simd, BlockSummary, Scale};

/// The grid of one block: values travel as `k × 2^(min_exp − 150)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    /// Biased exponent field whose unit in the last place is the grid step.
    min_exp: u32,
}

impl Scale for Grid {
    /// `None` when the block cannot be summed exactly in i64.
    fn for_ordinary_block(summary: BlockSummary, ranks: usize) -> Option<Grid> {
        if summary.min_exp == 255 {
            // Only zeros anywhere: any grid is exact.
            return Some(Grid { min_exp: 1 });
        }
        let max_exp = summary.max_exp.max(1);
        // |k| < 2^(max_exp − min_exp + 24); n of them need headroom bits more.
        let bits = max_exp - summary.min_exp + 24 + headroom_bits(ranks);
        (bits <= 63).then_some(Grid {
            min_exp: summary.min_exp,
        })
    }
}

impl Grid {
    /// Exponent of the grid step, 2^lsb_exp.
    fn lsb_exp(self) -> i32 {
        self.min_exp as i32 - 150
    }
}

simd::dispatch! {
    /// Writes each value of `src` as its exact multiple of the grid.
    pub fn encode(src: &[f32], grid: Grid, dst: &mut [i64]) = encode_loop;
}

/// Integer-only and branch-free, so it vectorizes (AVX2 variable shifts).
#[inline(always)]
fn encode_loop(src: &[f32], grid: Grid, dst: &mut [i64]) {
    debug_assert_eq!(src.len(), dst.len());
    for (x, out) in src.iter().zip(dst.iter_mut()) {
        let bits = x.to_bits();
        let e = (bits >> 23) & 0xff;
        let mantissa = (bits & 0x7f_ffff) | (((e != 0) as u32) << 23);
        // Zeros may sit below the grid (shift saturates to 0; 0 << 0 == 0).
        let shift = e.max(1).saturating_sub(grid.min_exp);
        let magnitude = (mantissa as i64) << shift;
        let negative = (bits >> 31) as i64;
        *out = (magnitude ^ -negative) + negative;
    }
}

simd::dispatch! {
    /// Rounds each exact sum to the nearest f32 (ties to even).
    pub fn decode(src: &[i64], grid: Grid, dst: &mut [f32]) = decode_loop;
}

/// One branch-free pass that is right for sums of up to 53 bits (exact in
/// f64, exponent in range: one rounding, to f32), then a second look only
/// if the block held a wider one.
#[inline(always)]
fn decode_loop(src: &[i64], grid: Grid, dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    let lsb_exp = grid.lsb_exp();
    let step = pow2(lsb_exp);
    let mut wide = false;
    for (s, out) in src.iter().zip(dst.iter_mut()) {
        wide |= s.unsigned_abs() >= 1 << 53;
        *out = ((*s as f64) * step) as f32;
    }
    if wide {
        for (s, out) in src.iter().zip(dst.iter_mut()) {
            if s.unsigned_abs() >= 1 << 53 {
                *out = round_wide(*s, lsb_exp);
            }
        }
    }
}

/// Correct rounding of `s × 2^lsb_exp` when `s` has more than 53 bits: round
/// the integer itself to 24 significant bits (or to the subnormal grid), so
/// that no intermediate rounding happens.
#[cold]
fn round_wide(s: i64, lsb_exp: i32) -> f32 {
    let a = s.unsigned_abs();
    let top = 63 - a.leading_zeros() as i32 + lsb_exp;
    let target_lsb = (top - 23).max(-149);
    let shift = (target_lsb - lsb_exp) as u32; // ≥ 30 here: a ≥ 2^53
    let mut q = a >> shift;
    let rem = a & ((1u64 << shift) - 1);
    let half = 1u64 << (shift - 1);
    if rem > half || (rem == half && q & 1 == 1) {
        q += 1;
    }
    // q ≤ 2^24: exact in f64, and the product is an f32 value or overflows
    // to infinity in the final conversion, as IEEE addition would.
    let v = (q as f64 * pow2(target_lsb)) as f32;
    if s < 0 {
        -v
    } else {
        v
    }
}

/// 2^e for e in f64's normal range.
pub(crate) fn pow2(e: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&e));
    f64::from_bits(((e + 1023) as u64) << 52)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::wide::correctly_rounded_sum;
    use crate::numerics::BLOCK_ELEMS;

    /// Independent reference: the exact sum in i128 on the column's own
    /// lowest grid, rounded to nearest-even by plain integer arithmetic.
    fn exact_sum_rounded(vals: &[f32]) -> f32 {
        let parts: Vec<(i128, i32)> = vals
            .iter()
            .map(|v| {
                let bits = v.to_bits();
                let e = ((bits >> 23) & 0xff) as i32;
                let m = ((bits & 0x7f_ffff) | if e != 0 { 1 << 23 } else { 0 }) as i128;
                (if bits >> 31 == 1 { -m } else { m }, e.max(1))
            })
            .collect();
        let base = parts.iter().map(|p| p.1).min().unwrap_or(1);
        let acc: i128 = parts.iter().map(|(m, e)| m << (e - base)).sum();
        if acc == 0 {
            return 0.0;
        }
        let lsb = base - 150;
        let a = acc.unsigned_abs();
        let top = 127 - a.leading_zeros() as i32 + lsb;
        let target_lsb = (top - 23).max(-149);
        let shift = target_lsb - lsb;
        let q = if shift <= 0 {
            a << (-shift)
        } else {
            let q = a >> shift;
            let rem = a & ((1u128 << shift) - 1);
            let half = 1u128 << (shift - 1);
            if rem > half || (rem == half && q & 1 == 1) {
                q + 1
            } else {
                q
            }
        };
        let v = (q as f64 * pow2(target_lsb)) as f32;
        if acc < 0 {
            -v
        } else {
            v
        }
    }

    /// Runs the whole exact pipeline for `ranks` inputs of one block.
    fn pipeline(inputs: &[Vec<f32>]) -> Option<Vec<f32>> {
        let n = inputs.len();
        let len = inputs[0].len();
        let grid = Grid::for_block(BlockSummary::agreed(inputs), n)?;
        let mut total = vec![0i64; len];
        let mut enc = vec![0i64; len];
        for inp in inputs {
            encode(inp, grid, &mut enc);
            for (t, e) in total.iter_mut().zip(&enc) {
                *t = t.wrapping_add(*e);
            }
        }
        let mut out = vec![0f32; len];
        decode(&total, grid, &mut out);
        Some(out)
    }

    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 >> 11
        }
        fn unit(&mut self) -> f64 {
            self.next() as f64 / (1u64 << 53) as f64
        }
    }

    /// Checks one block of a family bit-for-bit against the reference.
    /// Returns false if the block was refused (its range is too wide for one
    /// i64 grid: MPI reduces it).
    fn check_family(name: &str, n: usize, gen: impl Fn(&mut Lcg) -> f32) -> bool {
        let mut rng = Lcg(42 + n as u64);
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|_| (0..BLOCK_ELEMS).map(|_| gen(&mut rng)).collect())
            .collect();
        let Some(out) = pipeline(&inputs) else {
            // Refused: only the wide accumulator sums it (within i128 here).
            for i in 0..BLOCK_ELEMS {
                let col: Vec<f32> = inputs.iter().map(|v| v[i]).collect();
                let (want, wide) = (exact_sum_rounded(&col), correctly_rounded_sum(col.clone()));
                assert_eq!(wide.to_bits(), want.to_bits(), "wide {name} n={n} {col:?}");
            }
            return false;
        };
        for i in 0..BLOCK_ELEMS {
            let col: Vec<f32> = inputs.iter().map(|v| v[i]).collect();
            let want = exact_sum_rounded(&col);
            // What a refused block's elements get: the same bits.
            let wide = correctly_rounded_sum(col.iter().copied());
            assert_eq!(wide.to_bits(), want.to_bits(), "wide {name} n={n} {col:?}");
            assert_eq!(
                out[i].to_bits(),
                want.to_bits(),
                "{name} n={n} i={i} {col:?}"
            );
        }
        true
    }

    #[test]
    fn correctly_rounded_on_realistic_families() {
        for n in [2, 3, 4, 8, 64] {
            let gradient = check_family("gradient", n, |r| {
                // Box-Muller N(0, 1e-3)
                let (u1, u2) = (r.unit().max(1e-300), r.unit());
                ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * 1e-3) as f32
            });
            assert!(gradient, "gradient-like blocks fit one i64 grid");
            // Uniform values down to ~1e-9 next to 1e6 span > 40 binades:
            // refused (MPI reduces them) or, if they fit, exact.
            check_family("mixed", n, |r| {
                if r.next() % 2 == 0 {
                    (r.unit() * 2e6 - 1e6) as f32
                } else {
                    (r.unit() * 2e-2 - 1e-2) as f32
                }
            });
            let loguniform = check_family("loguniform", n, |r| {
                let mag = 10f64.powf(r.unit() * 8.0 - 4.0);
                (if r.next() % 2 == 0 { mag } else { -mag }) as f32
            });
            assert!(loguniform, "1e-4..1e4 spans 27 binades: fits");
        }
    }

    #[test]
    fn exact_cancellation_gives_positive_zero() {
        let a: Vec<f32> = (0..BLOCK_ELEMS).map(|i| (i as f32 + 0.5) * 1.1e3).collect();
        let b: Vec<f32> = a.iter().map(|x| -x).collect();
        let out = pipeline(&[a, b]).expect("exact");
        assert!(out.iter().all(|x| x.to_bits() == 0));
    }

    #[test]
    fn wide_and_special_blocks_are_refused() {
        assert!(pipeline(&[vec![1.0e30, 1.0e-30], vec![0.0, 0.0]]).is_none());
        assert!(pipeline(&[vec![1.0, f32::NAN], vec![0.0, 0.0]]).is_none());
        assert!(pipeline(&[vec![1.0, -0.0], vec![0.0, 0.0]]).is_none());
        // Subnormals alone are fine: they share exponent 1's grid.
        let sub = f32::from_bits(3);
        let out = pipeline(&[vec![sub, 0.0], vec![sub, 0.0]]).expect("exact");
        assert_eq!(out[0].to_bits(), 6);
    }

    #[test]
    fn wide_integers_round_once() {
        // Sums beyond 2^53 units take the integer rounding path.
        let big = 1.0e9f32;
        let tiny = big * f32::EPSILON / 4.0; // ~30 binades below: still one grid
        let out = pipeline(&[vec![big, tiny], vec![tiny, big], vec![tiny, tiny]]).expect("exact");
        assert_eq!(out[0], exact_sum_rounded(&[big, tiny, tiny]));
        assert_eq!(out[1], exact_sum_rounded(&[tiny, big, tiny]));
    }

    #[test]
    fn overflow_is_infinity() {
        let m = f32::MAX;
        let out = pipeline(&[vec![m], vec![m]]).expect("exact");
        assert_eq!(out[0], f32::INFINITY);
        let out = pipeline(&[vec![-m], vec![-m]]).expect("exact");
        assert_eq!(out[0], f32::NEG_INFINITY);
    }
}
