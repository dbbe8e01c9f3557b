//! Exact float SUM: f32 values as i64 multiples of a per-block grid.
//!
//! A block is exact when every value of every rank is an integer multiple of
//! the grid 2^g (g = the lowest exponent present, minus 23 mantissa bits) and
//! the largest possible sum of `n` such multiples fits in 63 bits. Then the
//! in-kernel i64 sum *is* the exact real sum, and [`decode`] rounds it once,
//! to nearest-even: the best float answer there is.

use super::{headroom_bits, simd, BlockSummary};

/// The grid of one block: values travel as `k × 2^(min_exp − 150)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    /// Biased exponent field whose unit in the last place is the grid step.
    min_exp: u32,
}

impl Grid {
    /// The grid for a block summarized over all `ranks`, or `None` when the
    /// block cannot be summed exactly in i64 (the caller sends it to MPI).
    pub fn for_block(summary: BlockSummary, ranks: usize) -> Option<Grid> {
        if summary.special {
            return None;
        }
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

/// The correctly rounded sum of any f32 values, whatever their range and
/// however many (up to 2^40): what a block no i64 grid carries gets, so
/// that every path of the `reproducible` contract gives the same bits.
///
/// Finite values are added exactly in a 320-bit fixed-point accumulator
/// whose unit is 2^-149 (the smallest subnormal; the largest f32 is below
/// 2^128, so 277 bits plus 40 of headroom and a sign), then rounded once to
/// nearest-even; a sum beyond f32's range is ±∞, as IEEE addition gives.
/// Specials depend only on which values are present, never on their order:
/// a NaN gives the quieted input NaN with the lowest bits; +∞ with −∞ gives
/// the CPU's default NaN (as their IEEE sum does); one infinity gives
/// itself; an exact zero is −0 only when every value is −0.
pub fn correctly_rounded_sum(values: impl IntoIterator<Item = f32>) -> f32 {
    let mut acc = Wide::default();
    let (mut nan, mut pos_inf, mut neg_inf, mut all_neg_zero) = (None::<u32>, false, false, true);
    for x in values {
        let bits = x.to_bits();
        all_neg_zero &= bits == 0x8000_0000;
        let e = (bits >> 23) & 0xff;
        if e == 255 {
            if bits & 0x7f_ffff != 0 {
                let quiet = bits | 0x40_0000;
                nan = Some(nan.map_or(quiet, |n| n.min(quiet)));
            } else if bits >> 31 == 0 {
                pos_inf = true;
            } else {
                neg_inf = true;
            }
            continue;
        }
        let mantissa = (bits & 0x7f_ffff) | (((e != 0) as u32) << 23);
        acc.add(mantissa, e.max(1) - 1, bits >> 31 == 1);
    }
    match (nan, pos_inf, neg_inf) {
        (Some(n), ..) => f32::from_bits(n),
        (None, true, true) => std::hint::black_box(f32::INFINITY) + f32::NEG_INFINITY,
        (None, true, false) => f32::INFINITY,
        (None, false, true) => f32::NEG_INFINITY,
        (None, false, false) if acc.is_zero() => {
            if all_neg_zero {
                -0.0
            } else {
                0.0
            }
        }
        (None, false, false) => acc.round(),
    }
}

/// Whether any of the bits below position `p` of `m` is set.
fn any_below(m: &[u64; LIMBS], p: u32) -> bool {
    let (limb, bit) = ((p / 64) as usize, p % 64);
    m[..limb].iter().any(|&w| w != 0) || m[limb] & ((1u64 << bit) - 1) != 0
}

/// Limbs of the exact accumulator of [`correctly_rounded_sum`].
const LIMBS: usize = 5;

/// A sum of f32 values exactly, in units of 2^-149: the positive and the
/// negative parts apart, so that both only ever grow.
#[derive(Default)]
struct Wide {
    pos: [u64; LIMBS],
    neg: [u64; LIMBS],
}

impl Wide {
    /// Adds ±`mantissa` × 2^`shift` units.
    fn add(&mut self, mantissa: u32, shift: u32, negative: bool) {
        let limbs = if negative {
            &mut self.neg
        } else {
            &mut self.pos
        };
        let (i, bit) = ((shift / 64) as usize, shift % 64);
        let wide = (mantissa as u128) << bit;
        let mut carry = 0u128;
        for (k, part) in [wide as u64, (wide >> 64) as u64].into_iter().enumerate() {
            let t = limbs[i + k] as u128 + part as u128 + carry;
            limbs[i + k] = t as u64;
            carry = t >> 64;
        }
        let mut k = i + 2;
        while carry != 0 && k < LIMBS {
            let t = limbs[k] as u128 + carry;
            limbs[k] = t as u64;
            carry = t >> 64;
            k += 1;
        }
    }

    fn is_zero(&self) -> bool {
        self.pos == self.neg
    }

    /// The sum rounded to the nearest f32 (ties to even); not zero.
    fn round(&self) -> f32 {
        let negative = self.neg.iter().rev().cmp(self.pos.iter().rev()).is_gt();
        let (big, small) = if negative {
            (&self.neg, &self.pos)
        } else {
            (&self.pos, &self.neg)
        };
        let mut m = [0u64; LIMBS];
        let mut borrow = false;
        for k in 0..LIMBS {
            let (d, b1) = big[k].overflowing_sub(small[k]);
            let (d, b2) = d.overflowing_sub(borrow as u64);
            m[k] = d;
            borrow = b1 || b2;
        }
        let top_limb = (0..LIMBS).rev().find(|&k| m[k] != 0).unwrap_or(0);
        let top = top_limb as u32 * 64 + 63 - m[top_limb].leading_zeros();
        let bits = if top < 24 {
            // Below 2^-125: a multiple of 2^-149 under 2^24 units is an f32
            // whose bits are that multiple (subnormal, or exponent field 1).
            m[0] as u32
        } else {
            let shift = top - 23;
            let (limb, bit) = ((shift / 64) as usize, shift % 64);
            let high = m.get(limb + 1).map_or(0, |&w| (w as u128) << 64);
            let mut q = (((m[limb] as u128 | high) >> bit) & 0xff_ffff) as u32;
            let round = (m[((shift - 1) / 64) as usize] >> ((shift - 1) % 64)) & 1 == 1;
            let sticky = any_below(&m, shift - 1);
            if round && (sticky || q & 1 == 1) {
                q += 1;
            }
            // q in [2^23, 2^24]; bits = (shift << 23) + q spills a carry of
            // q == 2^24 into the exponent, and a field of 255 is infinity.
            let bits = (shift << 23) as u64 + q as u64;
            bits.min(0x7f80_0000) as u32
        };
        f32::from_bits(bits | ((negative as u32) << 31))
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
        let mut words = BlockSummary::EMPTY.to_words();
        for inp in inputs {
            let w = BlockSummary::of(inp).to_words();
            words = [words[0].max(w[0]), words[1].max(w[1])];
        }
        let grid = Grid::for_block(BlockSummary::from_words(words), n)?;
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

    #[test]
    fn the_wide_sum_is_exact_across_the_whole_range() {
        let p = |e: i32| 2f32.powi(e);
        let sub = f32::from_bits(1);
        let cases: [(&[f32], f32); 12] = [
            (&[1.0e30, 1.0, -1.0e30], 1.0),
            (&[f32::MAX, f32::MAX, -f32::MAX], f32::MAX),
            (&[f32::MAX, f32::MAX], f32::INFINITY),
            (&[-f32::MAX, -f32::MAX], f32::NEG_INFINITY),
            (&[sub, 1.0e38, -1.0e38], sub),
            (&[sub, sub, sub], f32::from_bits(3)),
            (&[f32::MIN_POSITIVE, -sub], f32::from_bits(0x7f_ffff)),
            // Ties to even, and a sticky bit 76 binades further down.
            (&[1.0, p(-24)], 1.0),
            (&[1.0 + p(-23), p(-24)], 1.0 + p(-22)),
            (&[1.0, p(-24), p(-100)], 1.0 + p(-23)),
            (&[1.0, -p(-25), -p(-120)], 1.0 - p(-24)),
            // Rounding up across a binade.
            (&[2.0 - p(-23), p(-24)], 2.0),
        ];
        for (vals, want) in cases {
            let mut v = vals.to_vec();
            for _ in 0..v.len() {
                v.rotate_left(1);
                let got = correctly_rounded_sum(v.iter().copied());
                assert_eq!(got.to_bits(), want.to_bits(), "{v:?}: {got:?}");
            }
        }
    }

    #[test]
    fn the_wide_sum_gives_specials_whatever_the_order() {
        let nan_a = f32::from_bits(0x7f80_0001); // signalling: comes out quiet
        let nan_b = f32::from_bits(0xffc0_0002);
        let cases: [(&[f32], u32); 7] = [
            (&[1.0, nan_a, nan_b, f32::INFINITY], 0x7fc0_0001),
            (&[f32::INFINITY, 1.0e38, 1.0e38], 0x7f80_0000),
            (&[f32::NEG_INFINITY, -1.0], 0xff80_0000),
            (
                &[f32::INFINITY, f32::NEG_INFINITY, 2.0],
                (f32::INFINITY - f32::INFINITY).to_bits(),
            ),
            (&[-0.0, -0.0, -0.0], 0x8000_0000),
            (&[-0.0, 0.0, -0.0], 0),
            (&[-3.0, 3.0, -0.0], 0),
        ];
        for (vals, want) in cases {
            let mut v = vals.to_vec();
            for _ in 0..v.len() {
                v.rotate_left(1);
                let got = correctly_rounded_sum(v.iter().copied()).to_bits();
                if want == (f32::INFINITY - f32::INFINITY).to_bits() {
                    assert!(f32::from_bits(got).is_nan(), "{v:?}: {got:#x}");
                } else {
                    assert_eq!(got, want, "{v:?}: {got:#x}");
                }
            }
        }
    }
}
