//! The bounded contract's repairs: the elements whose sums the certificate
//! fails, every rank's inputs for them (carried by the call's verdict, or
//! gathered in their own exchange) and their sums, written in the same bits
//! on every rank. A rank's input for an element is an f64: its value, or
//! on the node path the sum of its host's local ranks' values.

use super::{FloatSum, Gather};
use crate::datapath::codec::slot_words::slot_words;
use crate::datapath::codec::{BlockScale, Layout};
use crate::datapath::{Comm, DatapathError};
use crate::numerics::{bounded, BLOCK_ELEMS};
use crate::stats;

/// The words a verdict that carries repairs starts with: the verdict's 4,
/// and how many elements this rank's certificate failed (−1: its host is
/// not complete).
const VERDICT_WORDS: usize = 5;
pub(super) const VERDICT_HEAD: usize = 4 * VERDICT_WORDS;

impl FloatSum {
    /// How many repair inputs the verdict of segment `segment`'s bounded
    /// call carries: from its latest complete call's count, with room to
    /// grow (gradients change little from step to step); 0 (a plain
    /// verdict, and the repair its own exchange) before any repair. The
    /// same on every rank: it follows from state every rank updates alike.
    pub(in crate::datapath) fn verdict_capacity(&self, segment: usize, count: usize) -> usize {
        match self.agreed.get(segment) {
            Some(Some(a)) if a.repaired > 0 => (a.repaired + a.repaired / 4 + 64).min(count),
            _ => 0,
        }
    }

    /// The verdict of a bounded call whose verdict carries repairs: this
    /// rank's `verdict` words and, once its host is `complete`, the
    /// certificate's count and the inputs (from `parts`) of the elements it
    /// fails (up to `capacity`), gathered from every rank in one exchange. `verdict`
    /// becomes the MAX over ranks, as a plain verdict's would. When every
    /// host is complete, every rank's count is the same (they all read the
    /// same final words) and, if it fits, [`FloatSum::finish`] repairs from
    /// what was gathered without another exchange.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::datapath) fn verdict_with_repairs(
        &mut self,
        comm: &dyn Comm,
        verdict: &mut [i32; 4],
        complete: bool,
        capacity: usize,
        layout: Layout,
        chunk_bytes: usize,
        slot_buf: &mut [u8],
        parts: &[&[u8]],
    ) -> Result<(), DatapathError> {
        if complete && !self.certified {
            let (values, flags) = slot_buf.split_at_mut(layout.flags_offset(chunk_bytes));
            let q = slot_words::<i32>(values);
            let (big, inexact) = slot_words::<u64>(flags).split_at(layout.flag_words);
            self.certify(q, big, inexact, parts);
            self.certified = true;
        }
        let k = if self.certified {
            self.repair_at.len() as i32
        } else {
            -1
        };
        let stride = VERDICT_HEAD + INPUT_BYTES * capacity;
        let mine = &mut self.verdict_mine;
        mine.clear();
        for w in verdict.iter().chain([&k]) {
            mine.extend_from_slice(&w.to_ne_bytes());
        }
        if k >= 0 && k as usize <= capacity {
            mine.extend_from_slice(&self.repair_mine);
        }
        mine.resize(stride, 0);
        self.repair_all.clear();
        self.repair_all.resize(stride * comm.size(), 0);
        comm.allgather(mine, &mut self.repair_all)?;
        let all = &self.repair_all;
        let word = |r: usize, i: usize| i32::from_ne_bytes(word4(&all[r * stride + 4 * i..]));
        let n = comm.size();
        for (i, v) in verdict.iter_mut().enumerate() {
            *v = (0..n).map(|r| word(r, i)).max().unwrap_or(*v);
        }
        let all_fit = (0..n).all(|r| (0..=capacity as i32).contains(&word(r, 4)));
        self.gathered = all_fit.then_some(stride);
        Ok(())
    }

    /// Collects the elements whose sums the certificate fails (the same on
    /// every rank: it reads only the final words) with this rank's inputs:
    /// each the f64 sum of its `parts`' values (one part but on the node
    /// path).
    pub(super) fn certify(&mut self, q: &[i32], big: &[u64], inexact: &[u64], parts: &[&[u8]]) {
        self.repair_at.clear();
        self.repair_mine.clear();
        let mut fail = [0u64; BLOCK_ELEMS / bounded::FLAG_BITS];
        let count = parts.first().map_or(0, |p| p.len() / 4);
        for (b, scale) in self.scales.iter().enumerate() {
            let Some(BlockScale::Bounded(g)) = *scale else {
                continue;
            };
            let at = b * BLOCK_ELEMS;
            let len = BLOCK_ELEMS.min(count - at);
            let w = at / bounded::FLAG_BITS..(at + len).div_ceil(bounded::FLAG_BITS);
            let fail = &mut fail[..w.len()];
            bounded::certify(&q[at..][..len], &big[w.clone()], &inexact[w], g, fail);
            for (k, word) in fail.iter().enumerate() {
                let mut bits = *word;
                while bits != 0 {
                    let i = at + k * bounded::FLAG_BITS + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    self.repair_at.push(i);
                    let x: f64 = parts
                        .iter()
                        .map(|p| f32::from_ne_bytes(word4(&p[4 * i..])) as f64)
                        .sum();
                    self.repair_mine.extend_from_slice(&x.to_ne_bytes());
                }
            }
        }
    }

    /// Every rank's inputs for the elements the certificate failed:
    /// carried by the verdict, or gathered now by `gather` (an allgather
    /// over the communicator's `ranks`), before the caller's buffer is
    /// written (a failed gather leaves it as it was). Returns where they
    /// are in `repair_all`: each rank's part `stride` bytes apart, the
    /// values from byte `at` on.
    pub(super) fn gather_repairs(
        &mut self,
        ranks: usize,
        gather: Gather<'_>,
    ) -> Result<(usize, usize), DatapathError> {
        let k = self.repair_at.len();
        let carried = self.gathered.take();
        if k == 0 {
            return Ok((0, 0));
        }
        stats::record_repaired(k);
        if let Some(stride) = carried {
            stats::record_repairs_carried();
            return Ok((stride, VERDICT_HEAD));
        }
        self.repair_all.clear();
        self.repair_all.resize(INPUT_BYTES * k * ranks, 0);
        gather(&self.repair_mine, &mut self.repair_all)?;
        Ok((INPUT_BYTES * k, 0))
    }

    /// Sums the failed elements from every rank's inputs, in f64 and in
    /// rank order, so that every rank writes the same bits. Within the
    /// bound for n ≥ 3 contributors (the only case bounded runs): the f64
    /// sums (the node path's local ones included: n−1 additions in all)
    /// add at most (n−1)·2⁻⁵³·Σ|x| to the final rounding's u·Σ|x|.
    pub(super) fn write_repairs(&self, at: (usize, usize), recv: &mut [u8]) {
        for (i, value) in self.repaired(at) {
            recv[4 * i..4 * i + 4].copy_from_slice(&value.to_ne_bytes());
        }
    }

    /// The failed elements and their sums (see [`FloatSum::write_repairs`]),
    /// in element order.
    pub(super) fn repaired(
        &self,
        (stride, at): (usize, usize),
    ) -> impl ExactSizeIterator<Item = (usize, f32)> + '_ {
        self.repair_at.iter().enumerate().map(move |(j, &i)| {
            let sum: f64 = self
                .repair_all
                .chunks_exact(stride)
                .map(|rank| f64::from_ne_bytes(word8(&rank[at + INPUT_BYTES * j..])))
                .sum();
            (i, sum as f32)
        })
    }
}

/// Bytes of one rank's input for one repaired element (an f64).
const INPUT_BYTES: usize = 8;

fn word4(b: &[u8]) -> [u8; 4] {
    [b[0], b[1], b[2], b[3]]
}

fn word8(b: &[u8]) -> [u8; 8] {
    [b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]
}
