//! The float codecs' speed on one core, beside a plain memcpy of the same
//! f32 buffer: every codec at every SIMD level this CPU has, block by block
//! as the ring calls them. Prints a table (GB/s of f32 data; the memcpy
//! ratio is codec time / memcpy time). No timing is asserted.
//!
//!     cargo bench -p liberar --bench codecs [-- MIB]

use liberar::numerics::simd::{self, Level};
use liberar::numerics::{bounded, exact, ordered, quantized, BlockSummary, Scale, BLOCK_ELEMS};
use std::hint::black_box;
use std::time::{Duration, Instant};

const RANKS: usize = 4;

/// Gradient-like data, N(0, 1e-3) (Box-Muller on an LCG).
fn gradient(n: usize) -> Vec<f32> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut unit = move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (unit().max(1e-300), unit());
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * 1e-3) as f32
        })
        .collect()
}

/// Best of `reps` runs of `f`.
fn best(reps: usize, mut f: impl FnMut()) -> Duration {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// `f(block, its scale, its words)` over every block of `src`.
fn per_block<S, D, G: Copy>(src: &[S], dst: &mut [D], scales: &[G], f: impl Fn(&[S], G, &mut [D])) {
    for ((b, d), g) in src
        .chunks(BLOCK_ELEMS)
        .zip(dst.chunks_mut(BLOCK_ELEMS))
        .zip(scales)
    {
        f(b, *g, d);
    }
}

fn main() {
    let mib: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(16);
    let n = mib * (1 << 20) / 4;
    let reps = 7;
    let src = gradient(n);
    let mut out = vec![0f32; n];
    let mut words64 = vec![0i64; n];
    let mut words32 = vec![0i32; n];
    let blocks = n.div_ceil(BLOCK_ELEMS);
    let grids: Vec<exact::Grid> = src
        .chunks(BLOCK_ELEMS)
        .map(|b| exact::Grid::for_block(BlockSummary::of(b), RANKS).expect("gradient data fits"))
        .collect();
    let steps: Vec<quantized::Step> = src
        .chunks(BLOCK_ELEMS)
        .map(|b| quantized::Step::for_block(BlockSummary::of(b), RANKS).expect("finite"))
        .collect();
    let bgrids: Vec<bounded::Grid> = steps
        .iter()
        .map(|s| bounded::Grid::new(*s, RANKS))
        .collect();
    let flag_words = n.div_ceil(bounded::FLAG_BITS);
    let (mut big, mut inexact, mut fail) = (
        vec![0u64; flag_words],
        vec![0u64; flag_words],
        vec![0u64; flag_words],
    );
    let wpb = BLOCK_ELEMS / bounded::FLAG_BITS;
    let gb = (n * 4) as f64 / 1e9;

    let memcpy = best(reps, || {
        out.copy_from_slice(black_box(&src));
        black_box(&out);
    });
    println!(
        "# {mib} MiB of f32 (gradient-like), {blocks} blocks of {BLOCK_ELEMS}, one core, best of {reps}; \
         CPU level {}",
        Level::detected().name()
    );
    println!(
        "{:<18} {:>9} {:>9} {:>12}",
        "codec", "level", "GB/s", "x memcpy"
    );
    println!(
        "{:<18} {:>9} {:>9.2} {:>12.2}",
        "memcpy",
        "-",
        gb / memcpy.as_secs_f64(),
        1.0
    );
    for level in Level::ALL.into_iter().filter(|l| *l <= Level::detected()) {
        simd::with_level(level, || {
            let row = |name: &str, f: &mut dyn FnMut()| {
                let t = best(reps, f);
                println!(
                    "{name:<18} {:>9} {:>9.2} {:>12.2}",
                    level.name(),
                    gb / t.as_secs_f64(),
                    t.as_secs_f64() / memcpy.as_secs_f64()
                );
            };
            row("summary", &mut || {
                for b in src.chunks(BLOCK_ELEMS) {
                    black_box(BlockSummary::of(b));
                }
            });
            row("exact encode", &mut || {
                per_block(&src, &mut words64, &grids, exact::encode)
            });
            row("exact decode", &mut || {
                per_block(&words64, &mut out, &grids, exact::decode)
            });
            row("quantized encode", &mut || {
                per_block(&src, &mut words32, &steps, quantized::encode)
            });
            row("quantized decode", &mut || {
                per_block(&words32, &mut out, &steps, quantized::decode)
            });
            row("bounded encode", &mut || {
                for ((((b, d), g), bw), iw) in src
                    .chunks(BLOCK_ELEMS)
                    .zip(words32.chunks_mut(BLOCK_ELEMS))
                    .zip(&bgrids)
                    .zip(big.chunks_mut(wpb))
                    .zip(inexact.chunks_mut(wpb))
                {
                    bounded::encode(b, *g, d, bw, iw);
                }
            });
            row("bounded certify", &mut || {
                for ((((w, g), bw), iw), f) in words32
                    .chunks(BLOCK_ELEMS)
                    .zip(&bgrids)
                    .zip(big.chunks(wpb))
                    .zip(inexact.chunks(wpb))
                    .zip(fail.chunks_mut(wpb))
                {
                    bounded::certify(w, bw, iw, *g, f);
                }
            });
            row("ordered encode", &mut || {
                for (b, d) in src.chunks(BLOCK_ELEMS).zip(words32.chunks_mut(BLOCK_ELEMS)) {
                    black_box(ordered::encode(b, d));
                }
            });
            row("ordered decode", &mut || {
                for (w, d) in words32.chunks(BLOCK_ELEMS).zip(out.chunks_mut(BLOCK_ELEMS)) {
                    ordered::decode(w, d);
                }
            });
        });
    }
}
