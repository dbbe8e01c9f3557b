//! Correctly rounded sums of any IEEE values, whatever their range: what
//! the `reproducible` contract gives the elements no i64 grid carries, and
//! how the MPI path of MPI_DOUBLE SUM rounds its exact integer sums.
//!
//! Finite values are added exactly in a fixed-point accumulator whose unit
//! is the format's smallest subnormal (2⁻¹⁴⁹, 2⁻¹⁰⁷⁴) and whose width holds
//! the largest finite value times 2⁴⁰, then rounded once to nearest-even; a
//! sum beyond the format's range is ±∞, as IEEE addition gives. Specials
//! depend only on which values are present, never on their order: a NaN
//! gives the quieted input NaN with the lowest bits; +∞ with −∞ gives the
//! CPU's default NaN (as their IEEE sum does); one infinity gives itself; an
//! exact zero is −0 only when every value is −0.

/// An IEEE binary format, as far as exact summation needs it.
pub trait Float: Copy {
    const BITS: u32;
    /// Significand bits, the implicit one included (24, 53).
    const MANT: u32;
    /// Exponent field of ∞ and NaN (255, 2047).
    const EXP_MAX: u64;
    /// Limbs of the accumulator, on the stack: (EXP_MAX − 1) + MANT + 40
    /// bits, and a spare.
    type Limbs: AsRef<[u64]> + AsMut<[u64]> + Copy;
    const ZERO: Self::Limbs;
    fn to_bits64(self) -> u64;
    fn from_bits64(bits: u64) -> Self;
    /// The CPU's result of +∞ + −∞.
    fn default_nan() -> Self;
}

/// `impl Float` for the primitive `$f`, whose bits are a `$bits`, with an
/// accumulator of `$limbs` limbs; its widths are the standard library's.
macro_rules! impl_float {
    ($($f:ident: $bits:ident, $limbs:literal limbs;)*) => {$(
        impl Float for $f {
            const BITS: u32 = $bits::BITS;
            const MANT: u32 = $f::MANTISSA_DIGITS;
            const EXP_MAX: u64 = (1 << ($bits::BITS - $f::MANTISSA_DIGITS)) - 1;
            type Limbs = [u64; $limbs];
            const ZERO: Self::Limbs = [0; $limbs];
            fn to_bits64(self) -> u64 {
                self.to_bits().into()
            }
            fn from_bits64(bits: u64) -> Self {
                $f::from_bits(bits as $bits)
            }
            fn default_nan() -> Self {
                std::hint::black_box($f::INFINITY) + $f::NEG_INFINITY
            }
        }
    )*};
}

impl_float! {
    f32: u32, 5 limbs;
    f64: u64, 34 limbs;
}

/// The correctly rounded sum of `values` (at most 2^40 of them).
pub fn correctly_rounded_sum<F: Float>(values: impl IntoIterator<Item = F>) -> F {
    let frac_bits = F::MANT - 1;
    let sign = 1u64 << (F::BITS - 1);
    let frac_mask = (1u64 << frac_bits) - 1;
    let mut acc = Wide {
        pos: F::ZERO,
        neg: F::ZERO,
    };
    let (mut nan, mut pos_inf, mut neg_inf, mut all_neg_zero) = (None::<u64>, false, false, true);
    for x in values {
        let bits = x.to_bits64();
        all_neg_zero &= bits == sign;
        let e = (bits & !sign) >> frac_bits;
        let negative = bits & sign != 0;
        if e == F::EXP_MAX {
            if bits & frac_mask != 0 {
                let quiet = bits | (1 << (frac_bits - 1));
                nan = Some(nan.map_or(quiet, |n| n.min(quiet)));
            } else if negative {
                neg_inf = true;
            } else {
                pos_inf = true;
            }
            continue;
        }
        let mantissa = (bits & frac_mask) | (((e != 0) as u64) << frac_bits);
        acc.add(mantissa, e.max(1) as u32 - 1, negative);
    }
    match (nan, pos_inf, neg_inf) {
        (Some(n), ..) => F::from_bits64(n),
        (None, true, true) => F::default_nan(),
        (None, true, false) => F::from_bits64(F::EXP_MAX << frac_bits),
        (None, false, true) => F::from_bits64(sign | F::EXP_MAX << frac_bits),
        (None, false, false) if acc.is_zero() => {
            F::from_bits64(if all_neg_zero { sign } else { 0 })
        }
        (None, false, false) => {
            let (negative, magnitude) = acc.round(F::MANT);
            let magnitude = magnitude.min(F::EXP_MAX << frac_bits);
            F::from_bits64(magnitude | if negative { sign } else { 0 })
        }
    }
}

/// `s × 2^lsb_exp` rounded to the nearest f64 (ties to even), `lsb_exp`
/// ≥ −1074: the decoding of MPI_DOUBLE's exact integer sums.
pub fn round_i128_to_f64(s: i128, lsb_exp: i32) -> f64 {
    let a = s.unsigned_abs();
    if a == 0 {
        return 0.0;
    }
    let top = 127 - a.leading_zeros() as i32 + lsb_exp;
    // The lowest bit kept, and the value as q units of it.
    let target = (top - 52).max(-1074);
    let shift = target - lsb_exp;
    let q = if shift <= 0 {
        (a << (-shift) as u32) as u64
    } else {
        let shift = shift as u32;
        let q = a >> shift;
        let rem = a & ((1u128 << shift) - 1);
        let half = 1u128 << (shift - 1);
        (q + (rem > half || (rem == half && q & 1 == 1)) as u128) as u64
    };
    // q < 2^53 (or 2^53 after rounding up): its bits, placed at `target`,
    // are the f64's; a carry into the exponent is right, and a field of
    // 2047 is infinity.
    let bits = ((((target + 1074) as u64) << 52) + q).min(0x7ff0_0000_0000_0000);
    f64::from_bits(bits | ((s < 0) as u64) << 63)
}

/// A sum of finite values exactly, in units of the smallest subnormal: the
/// positive and the negative parts apart, so that both only ever grow.
struct Wide<L> {
    pos: L,
    neg: L,
}

impl<L: AsRef<[u64]> + AsMut<[u64]> + Copy> Wide<L> {
    /// Adds ±`mantissa` × 2^`shift` units (`mantissa` < 2^53).
    fn add(&mut self, mantissa: u64, shift: u32, negative: bool) {
        let limbs = if negative {
            &mut self.neg
        } else {
            &mut self.pos
        }
        .as_mut();
        let (i, bit) = ((shift / 64) as usize, shift % 64);
        let wide = (mantissa as u128) << bit;
        let mut carry = 0u128;
        for (k, part) in [wide as u64, (wide >> 64) as u64].into_iter().enumerate() {
            let t = limbs[i + k] as u128 + part as u128 + carry;
            limbs[i + k] = t as u64;
            carry = t >> 64;
        }
        let mut k = i + 2;
        while carry != 0 && k < limbs.len() {
            let t = limbs[k] as u128 + carry;
            limbs[k] = t as u64;
            carry = t >> 64;
            k += 1;
        }
    }

    fn is_zero(&self) -> bool {
        self.pos.as_ref() == self.neg.as_ref()
    }

    /// The non-zero sum rounded to `mant` significant bits (ties to even):
    /// its sign, and its magnitude's bits in the format (exponent field and
    /// fraction; a field at or past the maximum means it overflowed).
    fn round(&self, mant: u32) -> (bool, u64) {
        let (pos, neg) = (self.pos.as_ref(), self.neg.as_ref());
        let negative = neg.iter().rev().cmp(pos.iter().rev()).is_gt();
        let (big, small) = if negative { (neg, pos) } else { (pos, neg) };
        let mut diff = self.pos; // every limb is overwritten
        let m = diff.as_mut();
        let mut borrow = false;
        for k in 0..m.len() {
            let (d, b1) = big[k].overflowing_sub(small[k]);
            let (d, b2) = d.overflowing_sub(borrow as u64);
            m[k] = d;
            borrow = b1 || b2;
        }
        let top_limb = (0..m.len()).rev().find(|&k| m[k] != 0).unwrap_or(0);
        let top = top_limb as u32 * 64 + 63 - m[top_limb].leading_zeros();
        if top < mant {
            // Below the lowest normal binade's end: a multiple of the unit
            // under 2^mant is the format's value whose bits are that
            // multiple (subnormal, or exponent field 1).
            return (negative, m[0]);
        }
        let shift = top - (mant - 1);
        let (limb, bit) = ((shift / 64) as usize, shift % 64);
        let high = m.get(limb + 1).map_or(0, |&w| (w as u128) << 64);
        let mut q = (((m[limb] as u128 | high) >> bit) as u64) & ((1u64 << mant) - 1);
        let round = (m[((shift - 1) / 64) as usize] >> ((shift - 1) % 64)) & 1 == 1;
        if round && (any_below(m, shift - 1) || q & 1 == 1) {
            q += 1;
        }
        // q in [2^(mant−1), 2^mant]: (shift << (mant−1)) + q carries a
        // q of 2^mant into the exponent field, as it should.
        (negative, ((shift as u64) << (mant - 1)) + q)
    }
}

/// Whether any of the bits below position `p` of `m` is set.
fn any_below(m: &[u64], p: u32) -> bool {
    let (limb, bit) = ((p / 64) as usize, p % 64);
    m[..limb].iter().any(|&w| w != 0) || m[limb] & ((1u64 << bit) - 1) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each case's values, in every rotation, sum to its bits.
    fn every_rotation_sums_to<F: Float + std::fmt::Debug>(cases: &[(&[F], F)]) {
        for (vals, want) in cases {
            let mut v = vals.to_vec();
            for _ in 0..v.len() {
                v.rotate_left(1);
                let got = correctly_rounded_sum(v.iter().copied());
                assert_eq!(got.to_bits64(), want.to_bits64(), "{v:?}: {got:?}");
            }
        }
    }

    /// Checks the cases every format must sum exactly, for `$f`: `$big`
    /// and `$huge` cancel exactly (the latter near the top of the range),
    /// and `$far` and `$farther` are sticky bits far below the rounding bit.
    macro_rules! sums_are_exact_across_the_whole_range {
        ($f:ty, $big:expr, $huge:expr, $far:expr, $farther:expr) => {{
            let p = |e: i32| (2.0 as $f).powi(e);
            // One ulp of 1, and the rounding bit below it.
            let m = <$f as Float>::MANT as i32;
            let (ulp, half) = (p(1 - m), p(-m));
            let sub = <$f>::from_bits(1);
            let cases: [(&[$f], $f); 12] = [
                (&[$big, 1.0, -$big], 1.0),
                (&[<$f>::MAX, <$f>::MAX, -<$f>::MAX], <$f>::MAX),
                (&[<$f>::MAX, <$f>::MAX], <$f>::INFINITY),
                (&[-<$f>::MAX, -<$f>::MAX], <$f>::NEG_INFINITY),
                (&[sub, $huge, -$huge], sub),
                (&[sub, sub, sub], <$f>::from_bits(3)),
                (
                    &[<$f>::MIN_POSITIVE, -sub],
                    <$f>::from_bits((1 << (m - 1)) - 1),
                ),
                // Ties to even, and a sticky bit far below the rounding bit.
                (&[1.0, half], 1.0),
                (&[1.0 + ulp, half], 1.0 + 2.0 * ulp),
                (&[1.0, half, $far], 1.0 + ulp),
                (&[1.0, -half / 2.0, -$farther], 1.0 - half),
                // Rounding up across a binade.
                (&[2.0 - ulp, half], 2.0),
            ];
            every_rotation_sums_to(&cases);
        }};
    }

    #[test]
    fn f32_sums_are_exact_across_the_whole_range() {
        let (far, farther) = (2f32.powi(-100), 2f32.powi(-120));
        sums_are_exact_across_the_whole_range!(f32, 1.0e30, 1.0e38, far, farther);
    }

    #[test]
    fn f64_sums_are_exact_across_the_whole_range() {
        // 2^-1070 as bits: powi would round it away.
        let (far, farther) = (2f64.powi(-1000), f64::from_bits(16));
        sums_are_exact_across_the_whole_range!(f64, 1.0e300, 1.0e308, far, farther);
    }

    /// Against the f64 sum of f32 values where it is exact (two values
    /// within 29 binades): a single rounding to f32 is then correct.
    #[test]
    fn f32_pairs_match_the_exact_f64_sum() {
        let mut seed = 3u64;
        for _ in 0..100_000 {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let a = f32::from_bits((seed >> 32) as u32 & 0x8fff_ffff | 0x3000_0000);
            let b = f32::from_bits(seed as u32 & 0x8fff_ffff | 0x3000_0000);
            let want = (a as f64 + b as f64) as f32;
            assert_eq!(
                correctly_rounded_sum([a, b]).to_bits(),
                want.to_bits(),
                "{a:?} {b:?}"
            );
        }
    }

    #[test]
    fn specials_whatever_the_order() {
        let nan_a = f32::from_bits(0x7f80_0001); // signalling: comes out quiet
        let nan_b = f32::from_bits(0xffc0_0002);
        let inf_minus_inf = f32::default_nan().to_bits();
        let cases: [(&[f32], u32); 7] = [
            (&[1.0, nan_a, nan_b, f32::INFINITY], 0x7fc0_0001),
            (&[f32::INFINITY, 1.0e38, 1.0e38], 0x7f80_0000),
            (&[f32::NEG_INFINITY, -1.0], 0xff80_0000),
            (&[f32::INFINITY, f32::NEG_INFINITY, 2.0], inf_minus_inf),
            (&[-0.0, -0.0, -0.0], 0x8000_0000),
            (&[-0.0, 0.0, -0.0], 0),
            (&[-3.0, 3.0, -0.0], 0),
        ];
        for (vals, want) in cases {
            let mut v = vals.to_vec();
            for _ in 0..v.len() {
                v.rotate_left(1);
                let got = correctly_rounded_sum(v.iter().copied()).to_bits();
                assert_eq!(got, want, "{v:?}: {got:#x}");
            }
        }
        let d: [f64; 3] = [-0.0, -0.0, f64::NEG_INFINITY];
        assert_eq!(correctly_rounded_sum(d), f64::NEG_INFINITY);
        assert_eq!(correctly_rounded_sum([-0.0f64, -0.0]).to_bits(), 1 << 63);
        assert!(correctly_rounded_sum([f64::NAN, 1.0]).is_nan());
    }

    /// The integer decoding against the accumulator, on random integers and
    /// grids (both exact: two algorithms, one answer).
    #[test]
    fn i128_rounding_matches_the_accumulator() {
        let mut next = crate::numerics::test_rng(11);
        for _ in 0..100_000 {
            let bits = next() % 126;
            let s = ((next() as i128) << 64 | next() as i128) >> (127 - bits);
            let lsb = -1074 + (next() % 1900) as i32;
            let got = round_i128_to_f64(s, lsb);
            // Only where every part below is exact in f64 (normal, no
            // overflow).
            if lsb < -1022 || lsb + 126 >= 1023 {
                continue;
            }
            // The same value as a sum of three f64 parts of 42 bits each.
            let parts = (0..3).map(|k| {
                let chunk = (s.unsigned_abs() >> (42 * k)) & ((1u128 << 42) - 1);
                let v = chunk as f64 * crate::numerics::exact::pow2(lsb + 42 * k);
                if s < 0 {
                    -v
                } else {
                    v
                }
            });
            let want = correctly_rounded_sum(parts);
            assert_eq!(got.to_bits(), want.to_bits(), "{s} × 2^{lsb}");
        }
    }
}
