//! Float SUM under the `reproducible` contract where MPI carries it: the
//! correctly rounded exact sum, so the same bits the ring gives, whichever
//! path a call or a part of it takes (below the threshold, an MPI trial,
//! after a stall, the blocks no i64 grid carries).
//!
//! Three exact parts, each a deterministic function of the multiset of inputs:
//! * [`allreduce`]: the ring's own encoding with MPI as the transport. The
//!   block summaries are reduced with MAX, every block that fits an i64 grid
//!   is encoded on it and summed by `MPI_Allreduce` on `MPI_INT64_T` (integer
//!   addition is exact in any order and any tree), and decoded with one
//!   rounding: 2 exchanges and twice the bytes of the float call.
//! * [`Refused`]: the blocks no grid carries (NaN, ±∞, −0, a range beyond 63
//!   bits) gathered from every rank and summed exactly in a fixed-point
//!   accumulator ([`wide::correctly_rounded_sum`]).
//! * [`allreduce_f64`]: MPI_DOUBLE SUM (not in-kernel) the same way, each
//!   value cut into 32-bit limbs of its block's grid.
//!
//! Every exchange completes before the caller's buffer is written, so a
//! failed one leaves it as it was.

use super::{Comm, DatapathError, Done};
use crate::numerics::exact::{self, Grid};
use crate::numerics::wide::{self, Float};
use crate::numerics::{
    for_each_block, for_each_block_mut, headroom_bits, BlockSummary, Scale, BLOCK_ELEMS,
};
use crate::select::{ElemType, ReduceOp};
use crate::stats;
use std::cell::RefCell;

/// Per-thread buffers of [`allreduce`] and [`allreduce_f64`], kept across
/// calls: a declined call allocates nothing once its size has been seen.
#[derive(Default)]
struct Scratch {
    /// The blocks' summary words, reduced with MAX.
    words: Vec<i32>,
    /// The exact integers of the blocks that travel, summed by MPI.
    sums: Vec<i64>,
    /// f32: each block's grid (`None`: gathered).
    grids: Vec<Option<Grid>>,
    /// f64: each block's limbs and where they start in `sums` (`None`:
    /// gathered).
    plan: Vec<Option<(Limbs, usize)>>,
    /// f64: one block's values.
    block: Vec<f64>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `recv = Σ over ranks of (send, or recv in place)` of f32 values, correctly
/// rounded, through MPI alone. Collective: every rank calls it on the same
/// call with the same length.
pub fn allreduce(comm: &dyn Comm, send: Option<&[u8]>, recv: &mut [u8]) -> Done {
    exact_call(|s| allreduce_with(s, comm, send, recv))
}

/// Counts one exact sum through MPI and runs it on this thread's scratch
/// buffers. A re-entrant call (never: the shim does not intercept PMPI)
/// would find them taken; it gets its own.
fn exact_call(call: impl FnOnce(&mut Scratch) -> Done) -> Done {
    stats::record_exact_mpi();
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut scratch) => call(&mut scratch),
        Err(_) => call(&mut Scratch::default()),
    })
}

/// Sums `sums` element-wise over ranks, in place: `MPI_Allreduce` on
/// `MPI_INT64_T` (exact in any order and any tree).
fn sum_i64(comm: &dyn Comm, sums: &mut [i64]) -> Done {
    // SAFETY: an i64 slice seen as its bytes (any bit pattern is valid
    // either way; u8 has no alignment).
    let bytes =
        unsafe { std::slice::from_raw_parts_mut(sums.as_mut_ptr().cast::<u8>(), 8 * sums.len()) };
    comm.pmpi_allreduce(None, bytes, (ElemType::I64, ReduceOp::Sum))
}

fn allreduce_with(s: &mut Scratch, comm: &dyn Comm, send: Option<&[u8]>, recv: &mut [u8]) -> Done {
    let count = recv.len() / 4;
    let n = comm.size();
    let blocks = count.div_ceil(BLOCK_ELEMS);
    s.words.clear();
    s.words.resize(2 * blocks, 0);
    s.sums.clear();
    s.sums.resize(count, 0);
    let refused = {
        let input = send.unwrap_or(recv);
        for_each_block(input, |i, vals| {
            s.words[2 * i..2 * i + 2].copy_from_slice(&BlockSummary::of(vals).to_words());
        });
        comm.allreduce_max_i32(&mut s.words)?;
        s.grids.clear();
        s.grids.extend(
            s.words
                .chunks_exact(2)
                .map(|w| Grid::for_block(BlockSummary::from_words([w[0], w[1]]), n)),
        );
        for_each_block(input, |i, vals| {
            if let Some(g) = s.grids[i] {
                exact::encode(vals, g, &mut s.sums[i * BLOCK_ELEMS..][..vals.len()]);
            }
        });
        // Before `recv` is written: in place, it holds the inputs.
        let grids = &s.grids;
        Refused::<f32>::collect(input, |b| grids[b].is_none())
    };
    if s.grids.iter().any(Option::is_some) {
        sum_i64(comm, &mut s.sums)?;
    }
    let refused = refused.gather(comm)?;
    // Every exchange done: only now is `recv` written.
    let (grids, sums) = (&s.grids, &s.sums);
    for_each_block_mut(recv, |i, vals| {
        let Some(g) = grids[i] else {
            return false;
        };
        exact::decode(&sums[i * BLOCK_ELEMS..][..vals.len()], g, vals);
        true
    });
    refused.write(recv);
    Ok(())
}

/// This rank's inputs of the blocks no grid carries (the same blocks on
/// every rank: they follow from agreed summaries), to be summed exactly.
pub struct Refused<F> {
    /// Byte ranges of the caller's buffer, in order.
    ranges: Vec<std::ops::Range<usize>>,
    mine: Vec<u8>,
    format: std::marker::PhantomData<F>,
}

impl<F: Float> Refused<F> {
    const BYTES: usize = F::BITS as usize / 8;

    /// Copies this rank's values of every block of [`BLOCK_ELEMS`] elements
    /// that `refused(b)` says, from `input` (before an in-place result
    /// overwrites it).
    pub fn collect(input: &[u8], refused: impl Fn(usize) -> bool) -> Refused<F> {
        let block_bytes = Self::BYTES * BLOCK_ELEMS;
        let blocks = input.len().div_ceil(block_bytes);
        let mut ranges: Vec<std::ops::Range<usize>> = Vec::new();
        for b in (0..blocks).filter(|&b| refused(b)) {
            let r = b * block_bytes..((b + 1) * block_bytes).min(input.len());
            match ranges.last_mut() {
                Some(last) if last.end == r.start => last.end = r.end,
                _ => ranges.push(r),
            }
        }
        let mine = ranges
            .iter()
            .flat_map(|r| &input[r.clone()])
            .copied()
            .collect();
        Refused {
            ranges,
            mine,
            format: std::marker::PhantomData,
        }
    }

    /// Bytes of this rank's values to gather.
    pub fn bytes(&self) -> usize {
        self.mine.len()
    }

    /// Gathers every rank's values (one allgather, none if there are
    /// none). Before anything is written to the caller's buffer: a failed
    /// exchange leaves it as it was.
    pub fn gather(self, comm: &dyn Comm) -> Result<Gathered<F>, DatapathError> {
        let mut all = Vec::new();
        if !self.mine.is_empty() {
            stats::record_exact_gathered(self.mine.len() / Self::BYTES);
            all.resize(self.mine.len() * comm.size(), 0);
            comm.allgather(&self.mine, &mut all)?;
        }
        Ok(Gathered {
            refused: self,
            all,
            ranks: comm.size(),
        })
    }
}

/// Every rank's values of the refused blocks, to be summed.
pub struct Gathered<F> {
    refused: Refused<F>,
    all: Vec<u8>,
    ranks: usize,
}

impl<F: Float> Gathered<F> {
    /// Writes each element's correctly rounded sum into `recv`.
    pub fn write(self, recv: &mut [u8]) {
        let (w, len) = (Refused::<F>::BYTES, self.refused.mine.len());
        let mut at = 0;
        for range in self.refused.ranges {
            for out in recv[range].chunks_exact_mut(w) {
                let ranks = (0..self.ranks).map(|r| read::<F>(&self.all[r * len + at..][..w]));
                write(wide::correctly_rounded_sum(ranks), out);
                at += w;
            }
        }
    }
}

/// One value of format `F` from its native-endian bytes.
fn read<F: Float>(b: &[u8]) -> F {
    let bits = match b.len() {
        4 => u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as u64,
        _ => u64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
    };
    F::from_bits64(bits)
}

fn write<F: Float>(v: F, out: &mut [u8]) {
    let bits = v.to_bits64();
    match out.len() {
        4 => out.copy_from_slice(&(bits as u32).to_ne_bytes()),
        _ => out.copy_from_slice(&bits.to_ne_bytes()),
    }
}

/// How one block of MPI_DOUBLE travels through MPI: each value as its
/// integer multiple of 2^(min_e − 1075), cut into `limbs` signed 32-bit
/// pieces, each summed as an i64 (n ranks add at most n·2^32: no
/// overflow), and put back together exactly in an i128.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Limbs {
    /// Lowest biased exponent of the block's non-zero values (subnormals
    /// count as 1).
    min_e: u32,
    limbs: u32,
}

impl Limbs {
    /// From the block's summary words reduced with MAX over `ranks`
    /// (`None`: NaN, ±∞, −0, or more than 126 bits: gathered instead).
    fn of(w: [i32; 2], ranks: usize) -> Option<Limbs> {
        if w[0] > 2047 {
            return None;
        }
        let min_e = (2047 - w[1]) as u32;
        if min_e == 2047 {
            return Some(Limbs { min_e: 1, limbs: 1 });
        }
        let bits = (w[0] as u32).max(1) - min_e + 53;
        (bits + headroom_bits(ranks) <= 126).then_some(Limbs {
            min_e,
            limbs: bits.div_ceil(32),
        })
    }

    /// Summary words of a block: [max exponent (2048 with a special), 2047 −
    /// min non-zero exponent]: their element-wise MAX is the union's.
    fn words(block: &[f64]) -> [i32; 2] {
        let (mut max_e, mut min_e, mut special) = (0u64, 2047u64, false);
        for x in block {
            let bits = x.to_bits();
            let e = (bits >> 52) & 0x7ff;
            max_e = max_e.max(e);
            if bits << 1 != 0 {
                min_e = min_e.min(e.max(1));
            }
            special |= e == 0x7ff || bits == 1 << 63;
        }
        [
            if special { 2048 } else { max_e as i32 },
            2047 - min_e as i32,
        ]
    }

    fn encode(self, vals: &[f64], out: &mut [i64]) {
        let k = self.limbs as usize;
        for (x, pieces) in vals.iter().zip(out.chunks_exact_mut(k)) {
            let bits = x.to_bits();
            let e = ((bits >> 52) & 0x7ff) as u32;
            let mantissa = (bits & ((1 << 52) - 1)) | (((e != 0) as u64) << 52);
            // Zeros (e = 0) may sit below the grid: shift 0, magnitude 0.
            let magnitude = (mantissa as u128) << e.max(1).saturating_sub(self.min_e);
            for (j, piece) in pieces.iter_mut().enumerate() {
                let p = ((magnitude >> (32 * j)) & 0xffff_ffff) as i64;
                *piece = if bits >> 63 == 1 { -p } else { p };
            }
        }
    }

    fn decode(self, sums: &[i64], vals: &mut [f64]) {
        let k = self.limbs as usize;
        for (pieces, out) in sums.chunks_exact(k).zip(vals.iter_mut()) {
            let s: i128 = pieces
                .iter()
                .enumerate()
                .map(|(j, &p)| (p as i128) << (32 * j))
                .sum();
            *out = wide::round_i128_to_f64(s, self.min_e as i32 - 1075);
        }
    }
}

/// `recv = Σ over ranks` of f64 values, correctly rounded, through MPI
/// alone: MPI_DOUBLE SUM under the `reproducible` contract (not
/// in-kernel). Each block of [`BLOCK_ELEMS`] travels as 32-bit limbs of its
/// exact integer multiple of the block's grid, summed by `MPI_Allreduce` on
/// `MPI_INT64_T`: 2 exchanges and 2-4 times the bytes of the call on
/// gradient-like data; blocks wider than 126 bits are gathered.
pub fn allreduce_f64(comm: &dyn Comm, send: Option<&[u8]>, recv: &mut [u8]) -> Done {
    exact_call(|s| allreduce_f64_with(s, comm, send, recv))
}

fn allreduce_f64_with(
    s: &mut Scratch,
    comm: &dyn Comm,
    send: Option<&[u8]>,
    recv: &mut [u8],
) -> Done {
    let n = comm.size();
    let block_bytes = 8 * BLOCK_ELEMS;
    let refused = {
        let input = send.unwrap_or(recv);
        s.words.clear();
        for b in input.chunks(block_bytes) {
            read_f64s(b, &mut s.block);
            s.words.extend_from_slice(&Limbs::words(&s.block));
        }
        comm.allreduce_max_i32(&mut s.words)?;
        s.plan.clear();
        let mut at = 0;
        for (w, b) in s.words.chunks_exact(2).zip(input.chunks(block_bytes)) {
            let limbs = Limbs::of([w[0], w[1]], n);
            s.plan.push(limbs.map(|l| (l, at)));
            at += limbs.map_or(0, |l| l.limbs as usize * b.len() / 8);
        }
        s.sums.clear();
        s.sums.resize(at, 0);
        for (b, plan) in input.chunks(block_bytes).zip(&s.plan) {
            if let Some((l, at)) = *plan {
                read_f64s(b, &mut s.block);
                l.encode(
                    &s.block,
                    &mut s.sums[at..][..l.limbs as usize * s.block.len()],
                );
            }
        }
        let plan = &s.plan;
        Refused::<f64>::collect(input, |b| plan[b].is_none())
    };
    if !s.sums.is_empty() {
        sum_i64(comm, &mut s.sums)?;
    }
    let refused = refused.gather(comm)?;
    // Every exchange done: only now is `recv` written.
    for (out, plan) in recv.chunks_mut(block_bytes).zip(&s.plan) {
        if let Some((l, at)) = *plan {
            let len = out.len() / 8;
            s.block.clear();
            s.block.resize(len, 0.0);
            l.decode(&s.sums[at..][..l.limbs as usize * len], &mut s.block);
            for (o, v) in out.chunks_exact_mut(8).zip(&s.block) {
                o.copy_from_slice(&v.to_ne_bytes());
            }
        }
    }
    refused.write(recv);
    Ok(())
}

/// The f64 values of `bytes` (native-endian, any alignment) into `out`.
fn read_f64s(bytes: &[u8], out: &mut Vec<f64>) {
    out.clear();
    out.extend(bytes.chunks_exact(8).map(read::<f64>));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The MPI_DOUBLE limb encoding, summed over simulated ranks as MPI
    /// would (i64 addition), gives the correctly rounded sum of the
    /// accumulator (another algorithm) on every element; blocks it cannot
    /// carry are the ones the summaries refuse.
    #[test]
    fn double_limbs_sum_exactly() {
        let mut next = crate::numerics::test_rng(5);
        for (ranks, spread) in [(2, 10), (3, 30), (4, 60), (8, 65), (5, 0)] {
            let inputs: Vec<Vec<f64>> = (0..ranks)
                .map(|_| {
                    (0..BLOCK_ELEMS)
                        .map(|i| {
                            if i % 97 == 0 {
                                return 0.0;
                            }
                            let m = (next() >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
                            let e = if spread == 0 {
                                0
                            } else {
                                (next() % spread) as i32
                            };
                            m * 2f64.powi(e - 20)
                        })
                        .collect()
                })
                .collect();
            let mut words = [0, 0];
            for inp in &inputs {
                let w = Limbs::words(inp);
                words = [words[0].max(w[0]), words[1].max(w[1])];
            }
            let Some(l) = Limbs::of(words, ranks) else {
                assert!(spread > 60, "{ranks} ranks, {spread} binades refused");
                continue;
            };
            let k = l.limbs as usize;
            let mut total = vec![0i64; k * BLOCK_ELEMS];
            let mut one = vec![0i64; k * BLOCK_ELEMS];
            for inp in &inputs {
                l.encode(inp, &mut one);
                total.iter_mut().zip(&one).for_each(|(t, o)| *t += o);
            }
            let mut out = vec![0f64; BLOCK_ELEMS];
            l.decode(&total, &mut out);
            for (i, got) in out.iter().enumerate() {
                let want = wide::correctly_rounded_sum(inputs.iter().map(|v| v[i]));
                assert_eq!(got.to_bits(), want.to_bits(), "{ranks} ranks, element {i}");
            }
        }
        // NaN, infinities and −0 are never encoded.
        for special in [f64::NAN, f64::INFINITY, -0.0] {
            assert_eq!(Limbs::of(Limbs::words(&[1.0, special]), 4), None);
        }
    }
}
