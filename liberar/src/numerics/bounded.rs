//! Bounded float SUM (`ERAR_PRECISION=bounded`, the default): about 4 bytes
//! per element on the wire, and every element's error within the bound of
//! the ordered sum MPI computes, (n−1)·u·Σᵣ|xᵣ| with u = 2⁻²⁴.
//!
//! Each value travels as an i32 on its block's agreed grid (the step of
//! [`quantized`]), and with two flag bits that the kernel ORs over ranks:
//!
//! * `inexact`: this rank's value is not a multiple of the step (it was
//!   rounded by at most step/2);
//! * `big`: |x| ≥ T, where T is the smallest magnitude whose presence alone
//!   guarantees Σᵣ|xᵣ| is large enough to absorb every rank's rounding.
//!
//! After the ring, every rank evaluates the same certificate on the same
//! words ([`certify`]): from the exact integer sum Q, the rounding of Q·step
//! to f32 (computed exactly) and the flags, it bounds the error from above
//! and Σᵣ|xᵣ| from below, and the element passes if the first is within
//! (n−1)·u times the second. The few elements that fail (all ranks' values
//! far below their block's maximum and some of them rounded) are repaired
//! exactly by the caller: every rank's inputs for them are gathered and
//! summed in f64 in rank order, so they, too, are identical on every rank.
//! The result is deterministic: the same inputs give the same bits.
//!
//! With 2 ranks the bound is u·(|x₀|+|x₁|), which only a correctly rounded
//! sum meets; the ring then uses [`super::exact`] instead.

use super::exact::pow2;
use super::quantized::{self, round_to_grid, Step};
use super::{simd, BlockSummary};

/// Elements per flag word.
pub const FLAG_BITS: usize = 64;

/// The unit roundoff of f32.
const U: f64 = 1.0 / (1u64 << 24) as f64;

/// One block's grid and certificate constants, the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Grid {
    pub step: Step,
    /// Ranks in the sum (on 2, no T helps: see the module doc).
    ranks: u32,
    /// The bits of T as a positive f32 (`f32::INFINITY` if no T helps).
    big_bits: u32,
}

impl Grid {
    /// The grid of a block of `ranks` ranks whose values fit `step`.
    pub fn new(step: Step, ranks: usize) -> Grid {
        let ranks = ranks as u32;
        // With some |xᵣ| ≥ T: error ≤ d + E and Σ|x| ≥ T, where E = n·s/2
        // bounds the rounding and d ≤ u·(Σ|x| + E) the final f32 rounding.
        // d + E ≤ (n−1)·u·Σ|x| holds once Σ|x| ≥ E·(1+u)/((n−2)·u).
        let big = if ranks >= 3 {
            let e = ranks as f64 * step.size() / 2.0;
            let t = e * (1.0 + 4.0 * U) / ((ranks - 2) as f64 * U);
            let t32 = t as f32;
            // Round up: a T below the bound would certify too much.
            let t32 = if (t32 as f64) < t { t32.next_up() } else { t32 };
            t32.to_bits()
        } else {
            f32::INFINITY.to_bits()
        };
        Grid {
            step,
            ranks,
            big_bits: big,
        }
    }
}

/// Writes each value's i32 on the grid and its `big` and `inexact` bits
/// (bit k of word g for element 64·g + k of `src`).
///
/// With AVX2 or AVX-512 through intrinsics, 8 or 16 values a step: the
/// flags come straight from compares, where the compiler's vectorization
/// of [`encode_loop`] builds them as bytes and packs them. `cargo bench
/// --bench codecs`, session 16, the compiled loop's binary and this one in
/// turn: AVX-512 3.3-3.8 → 4.0-4.5 GB/s, AVX2 2.7-2.9 → 3.0-3.5, while
/// memcpy made 5.7-9; AVX-512 3.8 → 10.3 in a run while memory was faster.
/// (4 ranks encoding on 2 CPUs made a 16 MiB float call's prepare phase 11
/// ms against an integer call's 4.6.)
/// The same arithmetic as [`round_to_grid`], lane by lane, so the same bits
/// (`numerics::tests::every_simd_level_gives_the_same_bits`); the last
/// partial group of 64 goes through [`encode_loop`].
pub fn encode(src: &[f32], grid: Grid, dst: &mut [i32], big: &mut [u64], inexact: &mut [u64]) {
    encode_into::<false>(src, grid, dst, big, inexact)
}

/// [`encode`] added to what `dst`, `big` and `inexact` hold: the words
/// summed (wrapping) and the flags ORed, as the kernel combines two ranks'
/// (a host's local inputs on the node path). In the same pass, so that a
/// second input needs no block of its own and no pass to add it: with a
/// scratch block zeroed, encoded and added, the memset and the add were
/// 5% of the CPU of 8 ranks' 4 MiB float calls (`perf`, session 20).
pub fn encode_add(src: &[f32], grid: Grid, dst: &mut [i32], big: &mut [u64], inexact: &mut [u64]) {
    encode_into::<true>(src, grid, dst, big, inexact)
}

fn encode_into<const ADD: bool>(
    src: &[f32],
    grid: Grid,
    dst: &mut [i32],
    big: &mut [u64],
    inexact: &mut [u64],
) {
    #[cfg(target_arch = "x86_64")]
    {
        let groups = whole_groups(src, dst, big, inexact);
        match simd::level() {
            // SAFETY: `level()` never answers above what the CPU has.
            simd::Level::Avx512 if F32_EXPS.contains(&grid.step.exp()) => unsafe {
                encode_avx512_f32::<ADD, false>(src, grid, dst, big, inexact, groups);
            },
            // SAFETY: as above.
            simd::Level::Avx512 => unsafe {
                encode_avx512::<ADD>(src, grid, dst, big, inexact, groups)
            },
            // SAFETY: as above.
            simd::Level::Avx2 => unsafe {
                encode_avx2::<ADD>(src, grid, dst, big, inexact, groups)
            },
            simd::Level::Portable => return encode_loop::<ADD>(src, grid, dst, big, inexact),
        }
        encode_tail::<ADD>(src, grid, dst, big, inexact, groups)
    }
    #[cfg(not(target_arch = "x86_64"))]
    encode_loop::<ADD>(src, grid, dst, big, inexact)
}

/// The whole groups of 64 values the vector loops encode: as many as
/// every one of the four slices holds.
#[cfg(target_arch = "x86_64")]
fn whole_groups(src: &[f32], dst: &[i32], big: &[u64], inexact: &[u64]) -> usize {
    (src.len() / FLAG_BITS)
        .min(dst.len() / FLAG_BITS)
        .min(big.len())
        .min(inexact.len())
}

/// The values after the first `groups` groups, by [`encode_loop`].
#[cfg(target_arch = "x86_64")]
fn encode_tail<const ADD: bool>(
    src: &[f32],
    grid: Grid,
    dst: &mut [i32],
    big: &mut [u64],
    inexact: &mut [u64],
    groups: usize,
) {
    let done = groups * FLAG_BITS;
    encode_loop::<ADD>(
        &src[done..],
        grid,
        &mut dst[done..],
        &mut big[groups..],
        &mut inexact[groups..],
    )
}

/// [`encode`] (`ADD`: [`encode_add`]) of one block, with the block's
/// [`BlockSummary`] gathered from the same loads: where the summary pass
/// and the encode were two loops, the first waiting on memory and the
/// second on the vector unit, the encode now runs under the loads' wait.
/// `None`, having written nothing, where no such loop exists (below
/// AVX-512, or a step outside [`F32_EXPS`]): the caller summarizes and
/// encodes apart. The same bits and summary as the two apart
/// (`encode_summarized_is_both_at_once`). 8 ranks' 1 MiB float calls,
/// `perf -a`: the summaries and the encode from 21.7% of the machine's
/// CPU to 18.3% (session 23).
pub fn encode_summarized<const ADD: bool>(
    src: &[f32],
    grid: Grid,
    dst: &mut [i32],
    big: &mut [u64],
    inexact: &mut [u64],
) -> Option<BlockSummary> {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::level() != simd::Level::Avx512 || !F32_EXPS.contains(&grid.step.exp()) {
            return None;
        }
        let groups = whole_groups(src, dst, big, inexact);
        // SAFETY: `level()` never answers above what the CPU has.
        let scan = unsafe { encode_avx512_f32::<ADD, true>(src, grid, dst, big, inexact, groups) };
        encode_tail::<ADD>(src, grid, dst, big, inexact, groups);
        let tail = &src[groups * FLAG_BITS..];
        Some(tail.iter().fold(scan, |s, x| s.with(*x)).summary())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (src, grid, dst, big, inexact);
        None
    }
}

/// What [`encode_summarized`] gathers of a block's values for its summary,
/// in words a vector unit reduces with MAX and MIN: the largest magnitude,
/// the smallest non-zero magnitude less one (all ones while every value is
/// zero: 0 − 1 wraps around), and the smallest bits as an i32 (i32::MIN
/// exactly when a −0 is among them). The exponent field grows with the
/// magnitude, so the extreme exponents are those of the extreme magnitudes.
#[derive(Clone, Copy)]
struct Scan {
    max_mag: u32,
    min_nz: u32,
    min_bits: i32,
}

impl Scan {
    const EMPTY: Scan = Scan {
        max_mag: 0,
        min_nz: u32::MAX,
        min_bits: i32::MAX,
    };

    fn with(self, x: f32) -> Scan {
        let mag = x.to_bits() & 0x7fff_ffff;
        Scan {
            max_mag: self.max_mag.max(mag),
            min_nz: self.min_nz.min(mag.wrapping_sub(1)),
            min_bits: self.min_bits.min(x.to_bits() as i32),
        }
    }

    /// As [`BlockSummary::of`] sees the same values.
    fn summary(self) -> BlockSummary {
        BlockSummary {
            max_exp: self.max_mag >> 23,
            min_exp: if self.min_nz == u32::MAX {
                255
            } else {
                ((self.min_nz + 1) >> 23).max(1)
            },
            special: self.max_mag >> 23 == 255 || self.min_bits == i32::MIN,
        }
    }
}

/// [`encode`]'s first `groups` groups of 64 values, AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn encode_avx512<const ADD: bool>(
    src: &[f32],
    grid: Grid,
    dst: &mut [i32],
    big: &mut [u64],
    inexact: &mut [u64],
    groups: usize,
) {
    use std::arch::x86_64::*;
    let inv = _mm512_set1_pd(pow2(-grid.step.exp()));
    let rounder = _mm512_set1_pd(quantized::ROUNDER);
    let t = _mm512_set1_epi32(grid.big_bits as i32);
    let magnitude = _mm512_set1_epi32(0x7fff_ffff);
    for g in 0..groups {
        let xs = &src[g * FLAG_BITS..][..FLAG_BITS];
        let qs = &mut dst[g * FLAG_BITS..][..FLAG_BITS];
        let (mut b, mut ix) = (0u64, 0u64);
        for j in 0..FLAG_BITS / 16 {
            // SAFETY: 16 values from 16·j on, within the group's 64.
            let x = unsafe { _mm512_loadu_ps(xs.as_ptr().add(16 * j)) };
            let bits = _mm512_castps_si512(x);
            let is_big = _mm512_cmpge_epu32_mask(_mm512_and_si512(bits, magnitude), t);
            b |= u64::from(is_big) << (16 * j);
            let halves = [
                _mm512_cvtps_pd(_mm512_castps512_ps256(x)),
                _mm512_cvtps_pd(_mm512_extractf32x8_ps::<1>(x)),
            ];
            for (h, wide) in halves.into_iter().enumerate() {
                let scaled = _mm512_mul_pd(wide, inv);
                let shifted = _mm512_add_pd(scaled, rounder);
                let rounded = _mm512_sub_pd(shifted, rounder);
                let rounded_off = _mm512_cmp_pd_mask::<_CMP_NEQ_UQ>(rounded, scaled);
                ix |= u64::from(rounded_off) << (16 * j + 8 * h);
                // The integer is the low 32 bits of `shifted`.
                let mut q = _mm512_cvtepi64_epi32(_mm512_castpd_si512(shifted));
                // SAFETY: 8 words from 16·j + 8·h on, within the group's 64.
                let at = unsafe { qs.as_mut_ptr().add(16 * j + 8 * h).cast::<__m256i>() };
                if ADD {
                    // SAFETY: as above.
                    q = _mm256_add_epi32(q, unsafe { _mm256_loadu_si256(at) });
                }
                // SAFETY: as above.
                unsafe { _mm256_storeu_si256(at, q) };
            }
        }
        merge_flags::<ADD>(&mut big[g], &mut inexact[g], b, ix);
    }
}

/// The step exponents on which [`encode_avx512_f32`] gives [`encode`]'s
/// bits: a step no larger than 1, so that x/step never underflows (not
/// even the smallest subnormal, which then stays nonzero and `inexact`),
/// and 1/step the product of two normal f32 powers of two (2^127 at
/// most each). Steps below 2^-126 are those of blocks of tiny values,
/// such as the OSU benchmarks' data (every byte 1: 2.4e-38), which went
/// through the f64 loop until session 21: with them, 8 ranks on 4 hosts,
/// OSU `osu_allreduce -T mpi_float`, 4 alternating rounds, best, 1.15x
/// (1 MiB), 1.11x, 1.27x, 1.15x (8 MiB) faster.
const F32_EXPS: std::ops::RangeInclusive<i32> = -254..=0;

/// 1/step for [`encode_avx512_f32`], as two factors: a step of 2^e
/// scales by 2^-e, more than an f32 holds below e = -127.
fn f32_inverse(step: Step) -> (f32, f32) {
    let up = -step.exp();
    let first = up.min(127);
    (pow2(first) as f32, pow2(up - first) as f32)
}

/// [`encode_avx512`] in f32, 16 values an instruction instead of 8: on a
/// step of [`F32_EXPS`], y = x/step is exact in f32 (one or two
/// power-of-two scalings up, neither above y, which is below 2^30 by the
/// grid's construction), its rounding to
/// the nearest integer (halves to even, as the rounder) is the conversion
/// to i32, and y is inexact exactly when that integer, converted back
/// (exactly: either it is below 2^24, or y was an integer already),
/// differs from it. The same bits as [`encode_loop`]
/// (`encode_in_f32_gives_the_same_bits`). The node path's encode of 8
/// ranks' 8 MiB float calls, `perf`, its CPU per call against the XDP
/// program's in the same run: 0.69 in f64, 0.52 in f32 (the rest of it
/// is the stores into the slot, which the memory bounds).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn encode_avx512_f32<const ADD: bool, const SCAN: bool>(
    src: &[f32],
    grid: Grid,
    dst: &mut [i32],
    big: &mut [u64],
    inexact: &mut [u64],
    groups: usize,
) -> Scan {
    use std::arch::x86_64::*;
    let (first, then) = f32_inverse(grid.step);
    let (first, then) = (_mm512_set1_ps(first), _mm512_set1_ps(then));
    let t = _mm512_set1_epi32(grid.big_bits as i32);
    let magnitude = _mm512_set1_epi32(0x7fff_ffff);
    let one = _mm512_set1_epi32(1);
    let (mut max_mag, mut min_nz, mut min_bits) = (
        _mm512_setzero_si512(),
        _mm512_set1_epi32(-1),
        _mm512_set1_epi32(i32::MAX),
    );
    for g in 0..groups {
        let xs = &src[g * FLAG_BITS..][..FLAG_BITS];
        let qs = &mut dst[g * FLAG_BITS..][..FLAG_BITS];
        let (mut b, mut ix) = (0u64, 0u64);
        for j in 0..FLAG_BITS / 16 {
            // SAFETY: 16 values from 16·j on, within the group's 64.
            let x = unsafe { _mm512_loadu_ps(xs.as_ptr().add(16 * j)) };
            let bits = _mm512_castps_si512(x);
            let mag = _mm512_and_si512(bits, magnitude);
            let is_big = _mm512_cmpge_epu32_mask(mag, t);
            b |= u64::from(is_big) << (16 * j);
            if SCAN {
                max_mag = _mm512_max_epu32(max_mag, mag);
                min_nz = _mm512_min_epu32(min_nz, _mm512_sub_epi32(mag, one));
                min_bits = _mm512_min_epi32(min_bits, bits);
            }
            let y = _mm512_mul_ps(_mm512_mul_ps(x, first), then);
            let mut q = _mm512_cvtps_epi32(y);
            let rounded_off = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(_mm512_cvtepi32_ps(q), y);
            ix |= u64::from(rounded_off) << (16 * j);
            // SAFETY: 16 words from 16·j on, within the group's 64.
            let at = unsafe { qs.as_mut_ptr().add(16 * j).cast::<__m512i>() };
            if ADD {
                // SAFETY: as above.
                q = _mm512_add_epi32(q, unsafe { _mm512_loadu_si512(at) });
            }
            // SAFETY: as above.
            unsafe { _mm512_storeu_si512(at, q) };
        }
        merge_flags::<ADD>(&mut big[g], &mut inexact[g], b, ix);
    }
    if !SCAN {
        return Scan::EMPTY;
    }
    Scan {
        max_mag: _mm512_reduce_max_epu32(max_mag),
        min_nz: _mm512_reduce_min_epu32(min_nz),
        min_bits: _mm512_reduce_min_epi32(min_bits),
    }
}

/// [`encode`]'s first `groups` groups of 64 values, AVX2: no unsigned
/// compare (`big` is max(|x|, T) == |x|) and no mask registers (the flags
/// are sign bits, gathered by movemask).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn encode_avx2<const ADD: bool>(
    src: &[f32],
    grid: Grid,
    dst: &mut [i32],
    big: &mut [u64],
    inexact: &mut [u64],
    groups: usize,
) {
    use std::arch::x86_64::*;
    let inv = _mm256_set1_pd(pow2(-grid.step.exp()));
    let rounder = _mm256_set1_pd(quantized::ROUNDER);
    let t = _mm256_set1_epi32(grid.big_bits as i32);
    let magnitude = _mm256_set1_epi32(0x7fff_ffff);
    // The low 32 bits of each 64-bit lane, in the low half.
    let low_words = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for g in 0..groups {
        let xs = &src[g * FLAG_BITS..][..FLAG_BITS];
        let qs = &mut dst[g * FLAG_BITS..][..FLAG_BITS];
        let (mut b, mut ix) = (0u64, 0u64);
        for j in 0..FLAG_BITS / 8 {
            // SAFETY: 8 values from 8·j on, within the group's 64.
            let x = unsafe { _mm256_loadu_ps(xs.as_ptr().add(8 * j)) };
            let abs = _mm256_and_si256(_mm256_castps_si256(x), magnitude);
            let is_big = _mm256_cmpeq_epi32(_mm256_max_epu32(abs, t), abs);
            let is_big = _mm256_movemask_ps(_mm256_castsi256_ps(is_big)) as u32;
            b |= u64::from(is_big) << (8 * j);
            let halves = [
                _mm256_cvtps_pd(_mm256_castps256_ps128(x)),
                _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)),
            ];
            for (h, wide) in halves.into_iter().enumerate() {
                let scaled = _mm256_mul_pd(wide, inv);
                let shifted = _mm256_add_pd(scaled, rounder);
                let rounded = _mm256_sub_pd(shifted, rounder);
                let rounded_off = _mm256_cmp_pd::<_CMP_NEQ_UQ>(rounded, scaled);
                let rounded_off = _mm256_movemask_pd(rounded_off) as u32;
                ix |= u64::from(rounded_off) << (8 * j + 4 * h);
                // The integer is the low 32 bits of `shifted`.
                let q = _mm256_permutevar8x32_epi32(_mm256_castpd_si256(shifted), low_words);
                let mut q = _mm256_castsi256_si128(q);
                // SAFETY: 4 words from 8·j + 4·h on, within the group's 64.
                let at = unsafe { qs.as_mut_ptr().add(8 * j + 4 * h).cast::<__m128i>() };
                if ADD {
                    // SAFETY: as above.
                    q = _mm_add_epi32(q, unsafe { _mm_loadu_si128(at) });
                }
                // SAFETY: as above.
                unsafe { _mm_storeu_si128(at, q) };
            }
        }
        merge_flags::<ADD>(&mut big[g], &mut inexact[g], b, ix);
    }
}

#[inline(always)]
fn encode_loop<const ADD: bool>(
    src: &[f32],
    grid: Grid,
    dst: &mut [i32],
    big: &mut [u64],
    inexact: &mut [u64],
) {
    let inv = pow2(-grid.step.exp());
    let groups = src.chunks(FLAG_BITS).zip(dst.chunks_mut(FLAG_BITS));
    for ((xs, qs), (b, ix)) in groups.zip(big.iter_mut().zip(inexact.iter_mut())) {
        // The flags as bytes first (a loop that vectorizes), then packed.
        let mut big_bytes = [0u8; FLAG_BITS];
        let mut inexact_bytes = [0u8; FLAG_BITS];
        let flags = big_bytes.iter_mut().zip(inexact_bytes.iter_mut());
        for ((x, out), (bb, ib)) in xs.iter().zip(qs.iter_mut()).zip(flags) {
            let (q, rounded, scaled) = round_to_grid(*x, inv);
            *out = if ADD { out.wrapping_add(q) } else { q };
            *bb = ((x.to_bits() & 0x7fff_ffff) >= grid.big_bits) as u8;
            *ib = (rounded != scaled) as u8;
        }
        merge_flags::<ADD>(b, ix, pack(&big_bytes), pack(&inexact_bytes));
    }
}

/// A group's flag words: written, or (`ADD`) ORed into what they hold.
#[inline(always)]
fn merge_flags<const ADD: bool>(big: &mut u64, inexact: &mut u64, b: u64, ix: u64) {
    (*big, *inexact) = if ADD {
        (*big | b, *inexact | ix)
    } else {
        (b, ix)
    };
}

/// 64 bytes of 0 or 1 as the bits of one word (byte k → bit k).
#[inline(always)]
fn pack(bytes: &[u8; FLAG_BITS]) -> u64 {
    let mut word = 0u64;
    for (i, eight) in bytes.chunks_exact(8).enumerate() {
        let x = u64::from_le_bytes([
            eight[0], eight[1], eight[2], eight[3], eight[4], eight[5], eight[6], eight[7],
        ]);
        // Moves byte j's low bit to bit 56 + j; no product lands there
        // otherwise, and none carries into it.
        word |= (x.wrapping_mul(0x0102_0408_1020_4080) >> 56) << (8 * i);
    }
    word
}

/// Sets bit k of `fail[g]` for each element 64·g + k whose sum `q` (flags
/// ORed over ranks) the certificate cannot vouch for; clears the others.
/// The same bits at every level: [`certify_avx512`] (where suspects are
/// [`dense`]) makes [`certify_loop`]'s IEEE operations, eight elements at
/// a time.
pub fn certify(q: &[i32], big: &[u64], inexact: &[u64], grid: Grid, fail: &mut [u64]) {
    #[cfg(target_arch = "x86_64")]
    if simd::level() == simd::Level::Avx512 {
        let k = Certificate::of(grid);
        if dense(q, big, inexact, k) {
            // SAFETY: `level()` never answers above what the CPU has.
            return unsafe { certify_avx512(q, big, inexact, k, fail) };
        }
    }
    certify_compiled(q, big, inexact, grid, fail)
}

simd::dispatch! {
    // AVX-512 ran this scalar loop at half the AVX2 speed (9.1 against
    // 17.0 GB/s, `cargo bench --bench codecs`, EPYC, session 8).
    avx2_at_most:
    fn certify_compiled(q: &[i32], big: &[u64], inexact: &[u64], grid: Grid, fail: &mut [u64])
        = certify_loop;
}

/// Whether a quarter of the first groups' elements or more are suspects,
/// where [`certify_avx512`] pays: 8 elements a step, against the compiled
/// loop's one suspect at a time (a loop AVX-512 code generation slows,
/// hence its AVX2 build at that level too). `cargo bench --bench codecs --
/// 1`, 1 MiB in cache: on the bench's gradient data (one rank's rounding,
/// few suspects) the compiled loop makes 11.5-12.4 GB/s and the vector
/// one alone 8.0-10.2 (with this test, 11.4-11.5 in two runs of three);
/// with every element a suspect 1.55 against 6.35 (4.1x). A sample (the
/// first 4 groups, 256 elements) so that the test costs nothing.
fn dense(q: &[i32], big: &[u64], inexact: &[u64], k: Certificate) -> bool {
    const SAMPLE: usize = 4;
    let suspects: u32 = q
        .chunks(FLAG_BITS)
        .zip(big.iter().zip(inexact))
        .take(SAMPLE)
        .map(|(qs, (b, i))| k.suspects(qs, *b, *i).count_ones())
        .sum();
    suspects as usize * 4 >= q.len().min(SAMPLE * FLAG_BITS)
}

/// [`certify_loop`] on eight elements a step, for each byte of a group's
/// suspects that has one: the words converted to f64 and scaled, their
/// rounding to f32 and back, the flags' E and T by masked moves, and one
/// compare, each the scalar loop's operation in the same order (so the
/// same bits, whatever MXCSR says: both honour it). The more ranks round
/// an element, the more elements are suspects, and the scalar loop's
/// branchy f64 arithmetic per suspect bounds it (see [`dense`] for the
/// figures). The training example's certificate (4 ranks) waits on its
/// loads of the words either way (`perf annotate`).
///
/// # Safety
/// The CPU has the AVX-512 level's features (`simd::dispatch!`'s).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi2")]
unsafe fn certify_avx512(
    q: &[i32],
    big: &[u64],
    inexact: &[u64],
    k: Certificate,
    fail: &mut [u64],
) {
    use std::arch::x86_64::*;
    let (vs, ve, vt) = (
        _mm512_set1_pd(k.s),
        _mm512_set1_pd(k.e_max),
        _mm512_set1_pd(k.t),
    );
    let vc = _mm512_set1_pd(k.c);
    let slack = _mm512_set1_pd(1.0 + 1.0 / (1u64 << 50) as f64);
    for (g, qs) in q.chunks(FLAG_BITS).enumerate() {
        let suspects = k.suspects(qs, big[g], inexact[g]);
        let mut word = 0u64;
        let mut todo = suspects;
        while todo != 0 {
            let at = 8 * (todo.trailing_zeros() as usize / 8);
            todo &= !(0xff << at);
            let lanes = (suspects >> at) as u8;
            // SAFETY: the masked-off lanes (past the end of `qs` among them)
            // are not read.
            let words = unsafe { _mm256_maskz_loadu_epi32(lanes, qs.as_ptr().add(at)) };
            let exact = _mm512_mul_pd(_mm512_cvtepi32_pd(words), vs);
            let d = _mm512_abs_pd(_mm512_sub_pd(
                _mm512_cvtps_pd(_mm512_cvtpd_ps(exact)),
                exact,
            ));
            let e = _mm512_maskz_mov_pd((inexact[g] >> at) as u8, ve);
            let floor = _mm512_maskz_mov_pd((big[g] >> at) as u8, vt);
            let lower = _mm512_max_pd(floor, _mm512_sub_pd(_mm512_abs_pd(exact), e));
            let ok = _mm512_cmp_pd_mask::<_CMP_LE_OQ>(
                _mm512_mul_pd(_mm512_add_pd(d, e), slack),
                _mm512_mul_pd(vc, lower),
            );
            word |= u64::from(!ok & lanes) << at;
        }
        fail[g] = word;
    }
}

#[inline(always)]
fn certify_loop(q: &[i32], big: &[u64], inexact: &[u64], grid: Grid, fail: &mut [u64]) {
    let k = Certificate::of(grid);
    for (g, qs) in q.chunks(FLAG_BITS).enumerate() {
        fail[g] = k.group(qs, big[g], inexact[g], k.suspects(qs, big[g], inexact[g]));
    }
}

/// A grid's certificate constants (see [`certify`]).
#[derive(Clone, Copy)]
struct Certificate {
    s: f64,
    t: f64,
    e_max: f64,
    c: f64,
    /// An element that no rank rounded passes: its sum is exact, a sum of
    /// f32 values, so its rounding is within u·|sum| (or exact below the
    /// normal range). On a grid no finer than f32's smallest subnormal, so
    /// does one with a big value (T is chosen so). Only the others need
    /// the arithmetic.
    coarse: bool,
}

impl Certificate {
    #[inline(always)]
    fn of(grid: Grid) -> Certificate {
        let s = grid.step.size();
        Certificate {
            s,
            t: f32::from_bits(grid.big_bits) as f64,
            e_max: grid.ranks as f64 * s / 2.0,
            c: (grid.ranks - 1) as f64 * U,
            coarse: grid.step.exp() >= -149,
        }
    }

    /// The elements of a group (`qs`, at most 64) that need the arithmetic.
    #[inline(always)]
    fn suspects(self, qs: &[i32], big: u64, inexact: u64) -> u64 {
        let suspects = if self.coarse { inexact & !big } else { inexact };
        if qs.len() < FLAG_BITS {
            suspects & ((1u64 << qs.len()) - 1)
        } else {
            suspects
        }
    }

    /// The group's failures among `suspects`, one element at a time.
    #[inline(always)]
    fn group(self, qs: &[i32], big: u64, inexact: u64, mut suspects: u64) -> u64 {
        let mut word = 0u64;
        while suspects != 0 {
            let k = suspects.trailing_zeros() as usize;
            suspects &= suspects - 1;
            // Q·s is exact in f64; so is its distance to the f32 nearest.
            let exact = qs[k] as f64 * self.s;
            let d = ((exact as f32) as f64 - exact).abs();
            let e = if inexact >> k & 1 != 0 {
                self.e_max
            } else {
                0.0
            };
            let floor = if big >> k & 1 != 0 { self.t } else { 0.0 };
            let lower = floor.max(exact.abs() - e);
            // (1 + 2⁻⁵⁰): the sum of the two errors may round down in f64.
            let ok = (d + e) * (1.0 + 1.0 / (1u64 << 50) as f64) <= self.c * lower;
            word |= (!ok as u64) << k;
        }
        word
    }
}

/// Decodes the sums (the same as [`quantized::decode`]).
pub fn decode(src: &[i32], grid: Grid, dst: &mut [f32]) {
    quantized::decode(src, grid.step, dst)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::{BlockSummary, Scale};

    /// A xorshift64 generator from `seed`.
    fn xorshift(mut s: u64) -> impl FnMut() -> u64 {
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// Words and flags for `n` values that already hold something, which a
    /// plain encode must overwrite and an adding one add to.
    fn held(n: usize) -> (Vec<i32>, Vec<u64>, Vec<u64>) {
        let words = n.div_ceil(FLAG_BITS);
        (
            (0..n as i32).map(|i| i * 7919).collect(),
            vec![0x00ff_00ff_0000_0001u64; words],
            vec![0x0101_0000_ff00_0000u64; words],
        )
    }

    /// On the steps [`F32_EXPS`] and either side of them, the f32 encode
    /// (the AVX-512 level's) writes the words and flags of the f64 loop,
    /// plain and adding: values up to the grid's top, ties at every
    /// magnitude, subnormals, values far below the step, zeros of both
    /// signs.
    #[test]
    fn encode_in_f32_gives_the_same_bits() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        let n = 4 * FLAG_BITS + 9;
        // (Below 2^-177 the grid's top, 2^(exp + 28), is below every
        // nonzero f32.)
        for exp in [
            -177, -160, -150, -149, -140, -128, -127, -126, -125, -100, -60, -24, -1, 0, 1,
        ] {
            // 4 ranks: 2 bits of headroom, so |x| < 2^(exp + 28).
            let grid = Grid::new(Step::of_exp(exp), 4);
            let vals: Vec<f32> = (0..n)
                .map(|i| {
                    let r = next();
                    let sign = if r & 1 == 0 { 1.0 } else { -1.0 };
                    let x = match i % 6 {
                        // Any magnitude from 40 binades below the step up.
                        0 | 1 => {
                            let e = exp - 40 + (r >> 8) as i32 % 68;
                            ((r >> 32) as u32 | 1) as f64 / 2f64.powi(32) * 2f64.powi(e)
                        }
                        // A tie: an odd number of half steps.
                        2 => (((r >> 40) % (1 << 20)) as f64 + 0.5) * 2f64.powi(exp),
                        // Subnormal.
                        3 => ((r >> 41) as f64) * 2f64.powi(-149),
                        4 => 0.0,
                        _ => ((r >> 40) as f64) * 2f64.powi(exp + 4),
                    };
                    (sign * x) as f32
                })
                .collect();
            let top = 2f32.powi(exp + 28);
            let mut vals: Vec<f32> = vals
                .iter()
                .map(|v| {
                    if v.abs() >= top {
                        top.next_down().copysign(*v)
                    } else {
                        *v
                    }
                })
                .collect();
            // The edges: the smallest subnormal, half a step (a tie that
            // rounds to 0), a step and a half, the largest value.
            let step = 2f32.powi(exp);
            let edges = [
                f32::from_bits(1),
                -f32::from_bits(1),
                step / 2.0,
                1.5 * step,
            ];
            vals[..4].copy_from_slice(&edges);
            vals[4] = -top.next_down();
            for add in [false, true] {
                let start = held(n);
                let (mut q, mut b, mut ix) = start.clone();
                let (mut rq, mut rb, mut ri) = start.clone();
                simd::with_level(simd::Level::Avx512, || {
                    if add {
                        encode_add(&vals, grid, &mut q, &mut b, &mut ix)
                    } else {
                        encode(&vals, grid, &mut q, &mut b, &mut ix)
                    }
                });
                if add {
                    encode_loop::<true>(&vals, grid, &mut rq, &mut rb, &mut ri);
                } else {
                    encode_loop::<false>(&vals, grid, &mut rq, &mut rb, &mut ri);
                }
                assert_eq!((q, b, ix), (rq, rb, ri), "step 2^{exp}, adding: {add}");
            }
        }
    }

    /// The fused encode writes what [`encode`] and [`encode_add`] write and
    /// summarizes as [`BlockSummary::of`] does: whole blocks and tails,
    /// zeros only, subnormals only, a −0, a NaN, an infinity, values at
    /// the grid's top; on a step it has no loop for, it declines having
    /// written nothing.
    #[test]
    fn encode_summarized_is_both_at_once() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        for exp in [-150, -126, -40, -3, 0, 1] {
            let grid = Grid::new(Step::of_exp(exp), 8);
            let top = 2f32.powi(exp + 27);
            for (case, n) in [1024, 4 * FLAG_BITS + 9, 63, 5, 1024, 1024, 1024, 1024]
                .into_iter()
                .enumerate()
            {
                let mut vals: Vec<f32> = (0..n)
                    .map(|_| {
                        let r = next();
                        let x = ((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * top;
                        match r % 7 {
                            0 => 0.0,
                            1 => f32::from_bits((r >> 44) as u32) * x.signum(),
                            _ => x,
                        }
                    })
                    .collect();
                match case {
                    4 => vals.fill(0.0),
                    5 => vals
                        .iter_mut()
                        .for_each(|v| *v = f32::from_bits(v.to_bits() >> 9)),
                    6 => vals[700] = -0.0,
                    7 => vals[3] = [f32::NAN, f32::NEG_INFINITY][(exp & 1) as usize],
                    _ => vals[n - 1] = -top.next_down(),
                }
                for add in [false, true] {
                    let start = held(n);
                    let (mut q, mut b, mut ix) = start.clone();
                    let (mut rq, mut rb, mut ri) = start.clone();
                    let (summary, fuses) = simd::with_level(simd::Level::Avx512, || {
                        let fuses = simd::level() == simd::Level::Avx512;
                        let summary = if add {
                            encode_add(&vals, grid, &mut rq, &mut rb, &mut ri);
                            encode_summarized::<true>(&vals, grid, &mut q, &mut b, &mut ix)
                        } else {
                            encode(&vals, grid, &mut rq, &mut rb, &mut ri);
                            encode_summarized::<false>(&vals, grid, &mut q, &mut b, &mut ix)
                        };
                        (summary, fuses && F32_EXPS.contains(&exp))
                    });
                    let at = format!("step 2^{exp}, case {case}, adding: {add}");
                    match summary {
                        Some(summary) => {
                            assert!(fuses, "{at}: fused where no loop fuses");
                            assert_eq!(summary, BlockSummary::of(&vals), "{at}");
                            assert_eq!((q, b, ix), (rq, rb, ri), "{at}");
                        }
                        None => {
                            assert!(!fuses, "{at}: declined where the loop fuses");
                            assert_eq!((q, b, ix), start, "{at}: wrote while declining");
                        }
                    }
                }
            }
        }
    }

    /// Seeded normal-ish values: the sum of four uniforms, scaled.
    fn data(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut s = seed;
        let mut next = move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        (0..n)
            .map(|_| (next() + next() + next() + next()) * scale)
            .collect()
    }

    /// Runs the whole contract over `inputs` (one Vec per rank): returns
    /// the results and how many elements needed the repair.
    fn reduce(inputs: &[Vec<f32>]) -> (Vec<f32>, usize) {
        let n = inputs.len();
        let len = inputs[0].len();
        let step = Step::for_block(BlockSummary::agreed(inputs), n).expect("finite");
        let grid = Grid::new(step, n);
        let flag_words = len.div_ceil(FLAG_BITS);
        let (mut q, mut big, mut inexact) = (
            vec![0i32; len],
            vec![0u64; flag_words],
            vec![0u64; flag_words],
        );
        for inp in inputs {
            let (mut qr, mut br, mut ir) = (
                vec![0i32; len],
                vec![0u64; flag_words],
                vec![0u64; flag_words],
            );
            encode(inp, grid, &mut qr, &mut br, &mut ir);
            for i in 0..len {
                q[i] = q[i]
                    .checked_add(qr[i])
                    .expect("no overflow by construction");
            }
            for g in 0..flag_words {
                big[g] |= br[g];
                inexact[g] |= ir[g];
            }
        }
        let mut fail = vec![0u64; flag_words];
        certify(&q, &big, &inexact, grid, &mut fail);
        let mut out = vec![0f32; len];
        decode(&q, grid, &mut out);
        let mut repaired = 0;
        for i in 0..len {
            if fail[i / FLAG_BITS] >> (i % FLAG_BITS) & 1 != 0 {
                repaired += 1;
                out[i] = inputs.iter().map(|v| v[i] as f64).sum::<f64>() as f32;
            }
        }
        (out, repaired)
    }

    fn assert_within_bound(inputs: &[Vec<f32>], out: &[f32]) {
        let n = inputs.len();
        for (i, got) in out.iter().enumerate() {
            let exact: f64 = inputs.iter().map(|v| v[i] as f64).sum();
            let abs: f64 = inputs.iter().map(|v| (v[i] as f64).abs()).sum();
            let bound = (n - 1) as f64 * U * abs;
            assert!(
                (*got as f64 - exact).abs() <= bound,
                "element {i}: {got} vs exact {exact}, bound {bound}"
            );
        }
    }

    #[test]
    fn gradient_like_data_stays_within_the_bound_with_few_repairs() {
        for n in [3usize, 4, 8] {
            let inputs: Vec<Vec<f32>> = (0..n).map(|r| data(r as u64 + 1, 4096, 1e-3)).collect();
            let (out, repaired) = reduce(&inputs);
            assert_within_bound(&inputs, &out);
            // Gradient-like data: 0.7% on 3 ranks, 0.02% on 4, none on 8
            // (measured on this data); 2% at most.
            assert!(repaired * 50 < out.len(), "n={n}: {repaired} repaired");
        }
    }

    #[test]
    fn wide_ranges_and_cancellation_stay_within_the_bound() {
        let n = 4;
        let mut inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| {
                data(r as u64 + 11, 2048, 1.0)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * 10f32.powi((i % 13) as i32 - 6))
                    .collect()
            })
            .collect();
        // Exact cancellation on some elements, zeros on others.
        for i in (0..2048).step_by(7) {
            inputs[1][i] = -inputs[0][i];
            inputs[2][i] = 0.0;
            inputs[3][i] = 0.0;
        }
        let (out, repaired) = reduce(&inputs);
        assert_within_bound(&inputs, &out);
        assert!(repaired > 0, "this data needs repairs");
    }

    #[test]
    fn pack_moves_byte_k_to_bit_k() {
        let mut seed = 3u64;
        for _ in 0..1000 {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            let mut bytes = [0u8; FLAG_BITS];
            for (k, b) in bytes.iter_mut().enumerate() {
                *b = (seed >> (k % 64) & 1) as u8 ^ (k % 3 == 0) as u8;
            }
            let want = bytes
                .iter()
                .enumerate()
                .fold(0u64, |w, (k, b)| w | (*b as u64) << k);
            assert_eq!(pack(&bytes), want);
        }
    }

    /// The shortcut (only rounded, non-big elements evaluated) fails exactly
    /// the elements the full arithmetic fails.
    #[test]
    fn the_certificate_shortcut_agrees_with_the_full_check() {
        // Wide ranges, and tiny values whose grid is finer than f32's
        // smallest subnormal.
        for (n, scale) in [(3usize, 1.0), (4, 1.0), (8, 1.0), (4, 1e-44), (3, 1e-44)] {
            let inputs: Vec<Vec<f32>> = (0..n)
                .map(|r| {
                    data(r as u64 + 40, 4096, scale)
                        .iter()
                        .enumerate()
                        .map(|(i, v)| v * 2f32.powi((i % 40) as i32 - 20))
                        // Tiny negatives flush to −0, which MPI reduces.
                        .map(|x| if x == 0.0 { 0.0 } else { x })
                        .collect()
                })
                .collect();
            let step = Step::for_block(BlockSummary::agreed(&inputs), n).expect("finite");
            let grid = Grid::new(step, n);
            assert_eq!(step.exp() < -149, scale < 1.0, "the grids this test means");
            let words = 4096 / FLAG_BITS;
            let (mut q, mut big, mut inexact) =
                (vec![0i32; 4096], vec![0u64; words], vec![0u64; words]);
            for inp in &inputs {
                let (mut qr, mut br, mut ir) =
                    (vec![0i32; 4096], vec![0u64; words], vec![0u64; words]);
                encode(inp, grid, &mut qr, &mut br, &mut ir);
                q.iter_mut().zip(&qr).for_each(|(a, b)| *a += b);
                big.iter_mut().zip(&br).for_each(|(a, b)| *a |= b);
                inexact.iter_mut().zip(&ir).for_each(|(a, b)| *a |= b);
            }
            let mut short = vec![0u64; words];
            certify(&q, &big, &inexact, grid, &mut short);
            let mut full = vec![0u64; words];
            certify_all(&q, &big, &inexact, grid, &mut full);
            assert_eq!(short, full, "n={n}, scale {scale}");
            // On a grid finer than every f32, no value is ever rounded.
            assert_eq!(
                full.iter().any(|w| *w != 0),
                scale == 1.0,
                "n={n}, scale {scale}"
            );
        }
    }

    /// Every level's certificate fails the elements of the scalar loop:
    /// words from the whole i32 range, near zero and near the f32 rounding
    /// boundaries of each step, every flag pattern, steps finer than f32's
    /// subnormals to coarse ones, 2 ranks (no T) to 8, lengths that end
    /// inside a group and inside one of its 8-element lanes, and few or
    /// most elements suspects (both of the AVX-512 level's paths).
    #[test]
    fn certify_gives_the_scalar_loops_bits_at_every_level() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1d);
        let (mut failed, mut suspects) = (0, 0);
        for exp in [
            -220, -180, -160, -150, -149, -140, -100, -40, -20, 0, 20, 60,
        ] {
            for ranks in [2usize, 3, 4, 8] {
                let grid = Grid::new(Step::of_exp(exp), ranks);
                for len in [3usize, 64, 200, 201, 4096, 4096 + 37] {
                    let q: Vec<i32> = (0..len)
                        .map(|i| match i % 4 {
                            0 => next() as i32,
                            1 => (next() % 4096) as i32 - 2048,
                            // Just above 2^24 (f32's last exact integers)
                            // and near 2^30: odd words round.
                            2 => {
                                ((1 << 24) + (next() % 64) as i32) * if i % 8 == 2 { 1 } else { -1 }
                            }
                            _ => [0, 1, -1, i32::MAX, i32::MIN, 1 << 30][i % 6],
                        })
                        .collect();
                    let words = len.div_ceil(FLAG_BITS);
                    let big: Vec<u64> = (0..words).map(|_| next() & next()).collect();
                    // Most elements suspects (the vector path at AVX-512)
                    // or few (the compiled loop at every level).
                    let dense = len % 2 == 0;
                    let inexact: Vec<u64> = (0..words)
                        .map(|_| {
                            if dense {
                                next() | next()
                            } else {
                                next() & next() & next()
                            }
                        })
                        .collect();
                    let mut want = vec![0u64; words];
                    certify_loop(&q, &big, &inexact, grid, &mut want);
                    failed += want.iter().map(|w| w.count_ones()).sum::<u32>();
                    suspects += inexact.iter().map(|w| w.count_ones()).sum::<u32>();
                    for level in simd::Level::ALL {
                        let mut got = vec![!0u64; words];
                        simd::with_level(level, || certify(&q, &big, &inexact, grid, &mut got));
                        assert_eq!(got, want, "{level:?}, exp {exp}, {ranks} ranks, {len}");
                    }
                }
            }
        }
        // Both outcomes, often.
        assert!(
            failed > suspects / 10 && failed < suspects * 9 / 10,
            "{failed} of {suspects}"
        );
    }

    /// The certificate's arithmetic on every element (the reference).
    fn certify_all(q: &[i32], big: &[u64], inexact: &[u64], grid: Grid, fail: &mut [u64]) {
        let s = grid.step.size();
        let t = f32::from_bits(grid.big_bits) as f64;
        let e_max = grid.ranks as f64 * s / 2.0;
        let c = (grid.ranks - 1) as f64 * U;
        for (i, &sum) in q.iter().enumerate() {
            let (g, k) = (i / FLAG_BITS, i % FLAG_BITS);
            let exact = sum as f64 * s;
            let d = ((exact as f32) as f64 - exact).abs();
            let e = if inexact[g] >> k & 1 != 0 { e_max } else { 0.0 };
            let floor = if big[g] >> k & 1 != 0 { t } else { 0.0 };
            let ok = (d + e) * (1.0 + 1.0 / (1u64 << 50) as f64) <= c * floor.max(exact.abs() - e);
            if !ok {
                fail[g] |= 1 << k;
            }
        }
    }

    #[test]
    fn the_big_threshold_is_not_below_the_bound() {
        let step = Step::for_block(BlockSummary::of(&[1.0]), 4).expect("finite");
        let grid = Grid::new(step, 4);
        let e = 4.0 * step.size() / 2.0;
        let t = f32::from_bits(grid.big_bits) as f64;
        assert!(t * 2.0 * U >= e * (1.0 + U), "T = {t}, E = {e}");
        assert_eq!(Grid::new(step, 2).big_bits, f32::INFINITY.to_bits());
    }
}
