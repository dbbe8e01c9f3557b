//! Float SUM under the `reproducible` contract where MPI carries it: the
//! correctly rounded exact sum, so the same bits the ring gives, whichever
//! path a call or a part of it takes (below the threshold, an MPI trial,
//! after a stall, the blocks no i64 grid carries).
//!
//! Two exact ways, both deterministic functions of the multiset of inputs:
//! * [`allreduce`]: the ring's own encoding with MPI as the transport. The
//!   block summaries are reduced with MAX, every block that fits an i64 grid
//!   is encoded on it and summed by `MPI_Allreduce` on `MPI_INT64_T` (integer
//!   addition is exact in any order and any tree), and decoded with one
//!   rounding: 2 exchanges and twice the bytes of the float call.
//! * [`Refused`]: the blocks no grid carries (NaN, ±∞, −0, a range beyond 63
//!   bits) gathered from every rank and summed exactly in a 320-bit
//!   accumulator ([`exact::correctly_rounded_sum`]).

use super::{Comm, DatapathError};
use crate::numerics::exact::{self, Grid};
use crate::numerics::{for_each_block, for_each_block_mut, BlockSummary, BLOCK_ELEMS};
use crate::select::{ElemType, ReduceOp};
use crate::stats;
use std::cell::RefCell;

/// Per-thread buffers of [`allreduce`], kept across calls: a declined call
/// allocates nothing once its size has been seen.
#[derive(Default)]
struct Scratch {
    words: Vec<i32>,
    grids: Vec<Option<Grid>>,
    sums: Vec<i64>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `recv = Σ over ranks of (send, or recv in place)` of f32 values, correctly
/// rounded, through MPI alone. Collective: every rank calls it on the same
/// call with the same length.
pub fn allreduce(
    comm: &dyn Comm,
    send: Option<&[u8]>,
    recv: &mut [u8],
) -> Result<(), DatapathError> {
    stats::record_exact_mpi();
    SCRATCH.with(|s| {
        // A re-entrant call (never: the shim does not intercept PMPI) would
        // find the scratch taken; it gets its own.
        match s.try_borrow_mut() {
            Ok(mut scratch) => allreduce_with(&mut scratch, comm, send, recv),
            Err(_) => allreduce_with(&mut Scratch::default(), comm, send, recv),
        }
    })
}

fn allreduce_with(
    s: &mut Scratch,
    comm: &dyn Comm,
    send: Option<&[u8]>,
    recv: &mut [u8],
) -> Result<(), DatapathError> {
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
        Refused::collect(input, |b| grids[b].is_none())
    };
    if s.grids.iter().any(Option::is_some) {
        // SAFETY: an i64 slice seen as its bytes (any bit pattern is valid
        // either way; u8 has no alignment).
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(s.sums.as_mut_ptr().cast::<u8>(), 8 * s.sums.len())
        };
        comm.pmpi_allreduce(None, bytes, ElemType::I64, ReduceOp::Sum)?;
    }
    let (grids, sums) = (&s.grids, &s.sums);
    for_each_block_mut(recv, |i, vals| {
        let Some(g) = grids[i] else {
            return false;
        };
        exact::decode(&sums[i * BLOCK_ELEMS..][..vals.len()], g, vals);
        true
    });
    refused.finish(comm, recv)
}

/// This rank's inputs of the blocks no grid carries (the same blocks on
/// every rank: they follow from agreed summaries), to be summed exactly.
pub struct Refused {
    /// Byte ranges of the caller's buffer, in order.
    ranges: Vec<std::ops::Range<usize>>,
    mine: Vec<u8>,
}

impl Refused {
    /// Copies this rank's values of every block `refused(b)` says, from
    /// `input` (before an in-place result overwrites it).
    pub fn collect(input: &[u8], refused: impl Fn(usize) -> bool) -> Refused {
        let block_bytes = 4 * BLOCK_ELEMS;
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
        Refused { ranges, mine }
    }

    /// Bytes of this rank's values to gather.
    pub fn bytes(&self) -> usize {
        self.mine.len()
    }

    /// Gathers every rank's values (one allgather, none if there are none)
    /// and writes each element's correctly rounded sum into `recv`.
    pub fn finish(self, comm: &dyn Comm, recv: &mut [u8]) -> Result<(), DatapathError> {
        let len = self.mine.len();
        if len == 0 {
            return Ok(());
        }
        stats::record_exact_gathered(len / 4);
        let mut all = vec![0u8; len * comm.size()];
        comm.allgather(&self.mine, &mut all)?;
        let value = |r: usize, at: usize| {
            let w = &all[r * len + at..][..4];
            f32::from_ne_bytes([w[0], w[1], w[2], w[3]])
        };
        let mut at = 0;
        for range in self.ranges {
            for out in recv[range].chunks_exact_mut(4) {
                let sum = exact::correctly_rounded_sum((0..comm.size()).map(|r| value(r, at)));
                out.copy_from_slice(&sum.to_ne_bytes());
                at += 4;
            }
        }
        Ok(())
    }
}
