//! One communicator's float SUM state: the per-block scales every rank
//! agrees on for a segment (reused while every rank's summaries stay the
//! same), the encoding of this rank's contribution on them, and the finish
//! that decodes the result and has MPI complete what the integers could not
//! carry (refused blocks here, the bounded contract's repairs in
//! `float_sum/repairs.rs`).

use super::slot_words::{decode_blocks, slot_words, summary_words, write_kept, SlotWords};
use super::{BlockScale, Input, Layout};
use crate::config::Precision;
use crate::datapath::reproducible::Refused;
use crate::datapath::{Comm, DatapathError, Done, Reduction};
use crate::numerics::{
    bounded, exact, for_each_block_mut, for_each_block_of_parts, quantized, BlockSummary, Scale,
    BLOCK_ELEMS,
};
use crate::stats;

mod repairs;

/// An allgather over the communicator (each rank's bytes, every rank's in
/// rank order): MPI's, or the ring's own (ring/sum_alone.rs).
pub(in crate::datapath) type Gather<'a> =
    &'a mut dyn FnMut(&[u8], &mut [u8]) -> Result<(), DatapathError>;

/// One communicator's float SUM state: the current segment's block scales,
/// the scales last agreed for each segment, and the bounded contract's
/// repairs (kept to reuse their allocations across calls).
#[derive(Default)]
pub(in crate::datapath) struct FloatSum {
    scales: Vec<Option<BlockScale>>,
    /// This rank's per-block summary words of the current segment, and
    /// everyone's reduced.
    local: Vec<i32>,
    exchanged: Vec<i32>,
    /// Per segment index: the last agreement made for it.
    agreed: Vec<Option<Agreed>>,
    /// Bounded: the elements the certificate failed, this rank's inputs for
    /// them, and every rank's.
    repair_at: Vec<usize>,
    repair_mine: Vec<u8>,
    repair_all: Vec<u8>,
    /// This rank's part of a verdict that carries repairs.
    verdict_mine: Vec<u8>,
    /// The certificate ran on this call's final words (in the verdict).
    certified: bool,
    /// The verdict carried every rank's repair inputs: where they are in
    /// `repair_all` (each rank's part `stride` bytes, values from byte
    /// [`VERDICT_HEAD`](repairs::VERDICT_HEAD) on).
    gathered: Option<usize>,
    /// This call's finish kept its result in the slot (see
    /// [`Input::Local`]'s `keep`).
    kept: bool,
}

/// One agreement on a segment's scales, and what it was made from.
struct Agreed {
    /// The operation (seq) whose exchange or ring made it: the same on
    /// every rank that took part in it.
    at: u32,
    precision: Precision,
    /// The call's key (the same on every rank).
    key: [i32; 4],
    /// This rank's summary words then: 2 per block, as many on every rank.
    local: Vec<i32>,
    scales: Vec<Option<BlockScale>>,
    /// The segment's latest call needed new scales (the same on every
    /// rank): its next one probably will too.
    rescaled: bool,
    /// Bounded: elements the certificate failed on the segment's latest
    /// complete call (the same on every rank: it reads only final words).
    repaired: usize,
}

/// Where the words of [`FloatSum::opening_words`] are, after the key and
/// its negation.
const OPENING_CHANGED: usize = 8;
const OPENING_SUMMARIES: usize = 9;

impl FloatSum {
    /// Summarizes this rank's blocks of segment `segment` (the MAX of its
    /// `parts`' summaries: one part, or a host's local inputs on the node
    /// path). True if they are
    /// the summaries this rank gave to the segment's last agreement: if every
    /// rank's are, the MAX over ranks is what it was then, and so are the
    /// scales ([`FloatSum::reuse`]) — the same bits a new agreement would
    /// give, without its exchange.
    ///
    /// In the same pass, while the summaries match, each block is encoded
    /// into `slot_buf` on that agreement's scale, so a call that reuses its
    /// scales reads the caller's data once (the block is still in L1 when
    /// it is encoded; a separate summary pass over 16 MiB is 0.5 ms of one
    /// core at the 32 GB/s of `cargo bench --bench codecs`). When it
    /// returns true the slot
    /// holds the whole contribution; otherwise [`FloatSum::encode`] must
    /// run once the scales are agreed.
    pub(in crate::datapath) fn summarize(
        &mut self,
        parts: &[&[u8]],
        precision: Precision,
        segment: usize,
        layout: Layout,
        chunk_bytes: usize,
        slot_buf: &mut [u8],
    ) -> bool {
        // A new call: nothing certified or gathered yet (a call that fell
        // back never reached its finish).
        self.certified = false;
        self.gathered = None;
        self.kept = false;
        let words = &mut self.local;
        words.clear();
        // (Scales that carry no block are not worth a ring: agree anew,
        // which sends the segment to MPI.)
        let last = match self.agreed.get(segment) {
            Some(Some(a)) if a.precision == precision && a.scales.iter().any(Option::is_some) => {
                Some(a)
            }
            _ => None,
        };
        let Some(a) = last else {
            for_each_block_of_parts(parts, |_, vals| {
                words.extend_from_slice(&summary_words(vals))
            });
            return false;
        };
        let mut slot = SlotWords::new(precision, layout, chunk_bytes, slot_buf);
        let mut same = true;
        for_each_block_of_parts(parts, |i, vals| {
            // A block past the agreement's last has changed (the call's
            // size has). The block whose summaries first differ is encoded
            // too, on scales this call will not use: a call whose
            // summaries changed agrees anew and encodes again
            // ([`FloatSum::encode`]).
            let w = match a.scales.get(i) {
                Some(scale) if same => slot.encode_block_parts_summarized(i, vals, *scale),
                _ => summary_words(vals),
            };
            words.extend_from_slice(&w);
            same = same && a.local.get(2 * i..2 * i + 2) == Some(&w[..]);
        });
        same && a.local.len() == words.len()
    }

    /// The operation that made the agreement [`FloatSum::summarize`]
    /// compared this rank's summaries with (when it returned true).
    pub(in crate::datapath) fn agreed_at(&self, segment: usize) -> Option<u32> {
        Some(self.agreed.get(segment)?.as_ref()?.at)
    }

    /// This rank's summary words of the current segment (2 per block), from
    /// [`FloatSum::summarize`].
    pub(in crate::datapath) fn summaries(&self) -> &[i32] {
        &self.local
    }

    /// Takes segment `segment`'s last agreed scales (every rank's summaries
    /// are unchanged since: see [`FloatSum::summarize`]).
    pub(in crate::datapath) fn reuse(&mut self, segment: usize) {
        if let Some(Some(a)) = self.agreed.get_mut(segment) {
            self.scales.clone_from(&a.scales);
            a.rescaled = false;
        }
    }

    /// When segment `segment`'s latest call needed new scales: the words of
    /// a call-opening exchange that also agrees on them (one exchange where
    /// the barrier would say "rescale" and the summaries would follow).
    /// They are the call key and its negation, whether this rank's
    /// summaries changed, and the summaries, sized as at the segment's last
    /// agreement: the same size on every rank whatever this call's count
    /// (a call of another size finds the key changed, see
    /// [`FloatSum::take_opening`]). To be reduced with MAX.
    pub(in crate::datapath) fn opening_words(
        &mut self,
        segment: usize,
        key: [i32; 4],
        changed: bool,
    ) -> Option<&mut Vec<i32>> {
        let a = self.agreed.get(segment)?.as_ref().filter(|a| a.rescaled)?;
        let words = &mut self.exchanged;
        words.clear();
        words.extend(key);
        words.extend(key.map(|k| -k));
        words.push(changed as i32);
        words.extend(
            self.local
                .iter()
                .copied()
                .chain(std::iter::repeat(0))
                .take(a.local.len()),
        );
        Some(words)
    }

    /// After the opening exchange, with every rank's key the same: the
    /// scales from its summaries (`Some(fits)`, as [`FloatSum::agree`]), or
    /// `None` if the call's size is not the last agreement's (then agree
    /// anew: the key has been checked, so that exchange's size agrees).
    pub(in crate::datapath) fn take_opening(
        &mut self,
        segment: usize,
        precision: Precision,
        key: [i32; 4],
        ranks: usize,
        at: u32,
    ) -> Option<bool> {
        let a = self.agreed.get_mut(segment)?.as_mut()?;
        if a.key != key || a.precision != precision {
            return None;
        }
        a.at = at;
        let summaries = &self.exchanged[OPENING_SUMMARIES..];
        self.scales.clear();
        self.scales.extend(
            summaries
                .chunks_exact(2)
                .map(|w| scale(precision, w, ranks)),
        );
        a.local.clone_from(&self.local);
        a.scales.clone_from(&self.scales);
        a.rescaled = self.exchanged[OPENING_CHANGED] != 0;
        Some(self.scales.iter().any(Option::is_some))
    }

    /// Reduces the summaries of [`FloatSum::summarize`] with MAX over the
    /// communicator in operation `at`, and adopts the result
    /// ([`FloatSum::adopt`]).
    pub(in crate::datapath) fn agree(
        &mut self,
        comm: &dyn Comm,
        precision: Precision,
        segment: usize,
        key: [i32; 4],
        contributors: usize,
        at: u32,
    ) -> Result<bool, DatapathError> {
        let words = &mut self.exchanged;
        words.clone_from(&self.local);
        comm.allreduce_max_i32(words)?;
        Ok(self.adopt(None, precision, segment, key, contributors, at))
    }

    /// Adopts the MAX over every rank of the summaries of
    /// [`FloatSum::summarize`] (`reduced`: as the ring left them, native
    /// i32 words; `None`: already in place, from [`FloatSum::agree`]) as
    /// segment `segment`'s agreement, made in operation `at`, deriving each
    /// block's scale for `contributors` inputs in all (the communicator's
    /// ranks, or on the node path every local rank of every host). False:
    /// no block fits a grid (every rank knows it), so MPI reduces the
    /// whole segment.
    pub(in crate::datapath) fn adopt(
        &mut self,
        reduced: Option<&[u8]>,
        precision: Precision,
        segment: usize,
        key: [i32; 4],
        contributors: usize,
        at: u32,
    ) -> bool {
        let words = &mut self.exchanged;
        if let Some(bytes) = reduced {
            words.clear();
            words.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
            );
        }
        let n = contributors;
        self.scales.clear();
        self.scales
            .extend(words.chunks_exact(2).map(|w| scale(precision, w, n)));
        if self.agreed.len() <= segment {
            self.agreed.resize_with(segment + 1, || None);
        }
        let a = self.agreed[segment].get_or_insert_with(|| Agreed {
            at,
            precision,
            key,
            local: Vec::new(),
            scales: Vec::new(),
            rescaled: true,
            repaired: 0,
        });
        a.at = at;
        a.precision = precision;
        a.key = key;
        a.local.clone_from(&self.local);
        a.scales.clone_from(&self.scales);
        a.rescaled = true;
        self.scales.iter().any(Option::is_some)
    }

    /// Writes this rank's contribution into the slot: every block of its
    /// `parts` on its agreed scale, their words added; refused blocks
    /// travel as zeros (MPI reduces them).
    pub(in crate::datapath) fn encode(
        &self,
        parts: &[&[u8]],
        precision: Precision,
        layout: Layout,
        chunk_bytes: usize,
        slot_buf: &mut [u8],
    ) {
        let mut slot = SlotWords::new(precision, layout, chunk_bytes, slot_buf);
        for_each_block_of_parts(parts, |i, vals| {
            slot.encode_block_parts(i, vals, self.scales[i])
        });
    }

    /// Whether this call's finish kept its result in the slot, as words,
    /// and wrote its block steps and repairs into the caller's buffer
    /// instead of the values (an [`Input::Local`] that asked to).
    pub(in crate::datapath) fn kept(&self) -> bool {
        self.kept
    }

    /// Writes the result into `recv` from the slot's final words, then has
    /// MPI complete what the integers could not carry: refused blocks, and
    /// (bounded) the elements the certificate failed, from every rank's
    /// inputs for them, which `gather` collects. A host's local inputs
    /// that ask to keep the result ([`Input::Local`]) get the block steps
    /// and the repaired elements in `recv` instead (unless they do not fit
    /// there: more repairs than nearly half its elements).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::datapath) fn finish(
        &mut self,
        comm: &dyn Comm,
        segment: usize,
        precision: Precision,
        layout: Layout,
        chunk_bytes: usize,
        slot_buf: &mut [u8],
        input: Input<'_>,
        recv: &mut [u8],
        how: Reduction,
        gather: Gather<'_>,
    ) -> Done {
        let keep = matches!(input, Input::Local { keep: true, .. });
        match precision {
            Precision::Reproducible => {
                let Input::Caller(send) = input else {
                    return Err(DatapathError::Failed(
                        "reproducible float SUM takes no host's local inputs".into(),
                    ));
                };
                // Refused blocks too are summed exactly: read their inputs
                // before `recv` (in place, the inputs) is written.
                let scales = &self.scales;
                let refused =
                    Refused::<f32>::collect(send.unwrap_or(recv), |b| scales[b].is_none());
                stats::record_fallback_bytes(refused.bytes());
                // The exchange before any write: a failed one leaves `recv`
                // as it was.
                let refused = refused.gather(comm)?;
                decode_blocks::<exact::Grid>(slot_buf, scales, recv);
                refused.write(recv);
                return Ok(());
            }
            Precision::Quantized if keep => {
                self.kept = write_kept(&self.scales, std::iter::empty(), recv);
                debug_assert!(self.kept, "no repairs always fit");
            }
            Precision::Quantized => decode_blocks::<quantized::Step>(slot_buf, &self.scales, recv),
            Precision::Bounded => {
                let (values, flags) = slot_buf.split_at_mut(layout.flags_offset(chunk_bytes));
                let q = slot_words::<i32>(values);
                let (big, inexact) = slot_words::<u64>(flags).split_at(layout.flag_words);
                // Before decoding: in place, `recv` still holds the inputs
                // the repairs need (unless the verdict took them already).
                if !std::mem::take(&mut self.certified) {
                    input.with_parts(recv, |parts| self.certify(q, big, inexact, parts));
                }
                let repairs = self.gather_repairs(comm.size(), gather)?;
                self.kept = keep && write_kept(&self.scales, self.repaired(repairs), recv);
                if !self.kept {
                    for_each_block_mut(recv, |i, vals| {
                        let Some(BlockScale::Bounded(g)) = self.scales[i] else {
                            return false;
                        };
                        bounded::decode(&q[i * BLOCK_ELEMS..][..vals.len()], g, vals);
                        true
                    });
                    self.write_repairs(repairs, recv);
                }
                if let Some(Some(a)) = self.agreed.get_mut(segment) {
                    a.repaired = self.repair_at.len();
                }
            }
        }
        reduce_refused_blocks(comm, &self.scales, input, recv, how)
    }
}

/// A block's scale under `precision` from its two summary words reduced
/// over `ranks` ranks (`None`: MPI reduces the block).
fn scale(precision: Precision, words: &[i32], ranks: usize) -> Option<BlockScale> {
    let summary = BlockSummary::from_words([words[0], words[1]]);
    match precision {
        Precision::Reproducible => exact::Grid::for_block(summary, ranks).map(BlockScale::Exact),
        Precision::Quantized => {
            quantized::Step::for_block(summary, ranks).map(BlockScale::Quantized)
        }
        Precision::Bounded => quantized::Step::for_block(summary, ranks)
            .map(|step| BlockScale::Bounded(bounded::Grid::new(step, ranks))),
    }
}

/// Completes the blocks no integer grid could carry through MPI itself, one
/// PMPI call per run of consecutive such blocks (every rank has the same
/// scales, so every rank makes the same calls).
pub(super) fn reduce_refused_blocks(
    comm: &dyn Comm,
    scales: &[Option<BlockScale>],
    input: Input<'_>,
    recv: &mut [u8],
    (elem, op): Reduction,
) -> Done {
    let block_bytes = BLOCK_ELEMS * elem.size();
    let mut b = 0;
    while b < scales.len() {
        if scales[b].is_some() {
            b += 1;
            continue;
        }
        let first = b;
        while b < scales.len() && scales[b].is_none() {
            b += 1;
        }
        let range = first * block_bytes..(b * block_bytes).min(recv.len());
        stats::record_fallback_bytes(range.len());
        input.pmpi_allreduce(comm, range, recv, (elem, op))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::codec::Plan;
    use crate::datapath::{Done, Reduction};

    /// The block walkers give the same values, and write the same bytes,
    /// whether the buffer is 4-aligned (no copy) or not (through a copy).
    /// A communicator of one rank: the exchanges are the identity.
    struct One;

    impl Comm for One {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            1
        }
        fn allgather(&self, mine: &[u8], all: &mut [u8]) -> Result<(), DatapathError> {
            all.copy_from_slice(mine);
            Ok(())
        }
        fn allreduce_max_i32(&self, _: &mut [i32]) -> Result<(), DatapathError> {
            Ok(())
        }
        fn allreduce_max_i32_watched(
            &self,
            _: &mut [i32],
            _: &mut dyn FnMut() -> Result<(), DatapathError>,
        ) -> Result<(), DatapathError> {
            Ok(())
        }
        fn pmpi_allreduce(&self, _: Option<&[u8]>, _: &mut [u8], _: Reduction) -> Done {
            unreachable!("no block is refused here")
        }
        fn pmpi_bcast(&self, _: &mut [u8], _: usize) -> Result<(), DatapathError> {
            unreachable!()
        }
        fn set_deadline(&self, _: Option<std::time::Instant>) {}
    }

    const CONTRACTS: [Precision; 3] = [
        Precision::Reproducible,
        Precision::Quantized,
        Precision::Bounded,
    ];

    /// Slot words (u64 storage, as a slot is aligned) seen as bytes.
    fn as_bytes(w: &mut [u64]) -> &mut [u8] {
        // SAFETY: u64 storage viewed as bytes, in bounds.
        unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<u8>(), w.len() * 8) }
    }

    /// The summary pass that encodes on the last scales writes exactly the
    /// slot a separate encode would, and says "changed" as soon as one
    /// block's summary differs.
    #[test]
    fn summarizing_encodes_what_encode_writes() {
        let cb = 3336;
        let n = 3 * BLOCK_ELEMS + 17;
        let mut vals: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1013) as f32 * 1e-3 - 0.5)
            .collect();
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        for precision in CONTRACTS {
            let plan = Plan::FloatSum(precision);
            let layout = plan.layout(n, cb);
            let slot_len = layout.chunks as usize * cb;
            let mut want = vec![0u64; slot_len / 8];
            let mut got = vec![0u64; slot_len / 8];
            let mut fs = FloatSum::default();
            let input = bytes(&vals);
            assert!(!fs.summarize(&[&input], precision, 0, layout, cb, as_bytes(&mut got)));
            assert!(fs
                .agree(&One, precision, 0, [1, 2, 3, 4], 1, 1)
                .expect("one rank"));
            fs.encode(&[&input], precision, layout, cb, as_bytes(&mut want));
            assert!(fs.summarize(&[&input], precision, 0, layout, cb, as_bytes(&mut got)));
            assert!(
                got == want,
                "{precision:?}: the fused pass wrote other words"
            );
            // A block whose exponent range moved: changed.
            let kept = vals[BLOCK_ELEMS + 5];
            vals[BLOCK_ELEMS + 5] = 1e3;
            assert!(!fs.summarize(
                &[&bytes(&vals)],
                precision,
                0,
                layout,
                cb,
                as_bytes(&mut got)
            ));
            vals[BLOCK_ELEMS + 5] = kept;
        }
    }

    /// A host's local inputs (the node path) encode to what the ring's sum
    /// of their separate encodings is: values added as words of their
    /// wire op, the bounded flags ORed; the fused summary pass writes the
    /// same; one part that is not 4-aligned reads the same values.
    #[test]
    fn several_parts_encode_as_the_ring_adds() {
        let cb = 3336;
        let n = 2 * BLOCK_ELEMS + 300;
        let part = |k: usize| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    (((i * 7919 + k * 104729) % 2003) as f32 - 1001.0) * 10f32.powi(k as i32 - 4)
                })
                .collect()
        };
        let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<u8>>();
        let inputs: Vec<Vec<u8>> = (0..3).map(|k| bytes(&part(k))).collect();
        // The last part one byte past an aligned start.
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&inputs[2]);
        let parts: [&[u8]; 3] = [&inputs[0], &inputs[1], &shifted[1..]];
        assert!(crate::numerics::simd::as_f32(parts[2]).is_none());
        for precision in CONTRACTS {
            let plan = Plan::FloatSum(precision);
            let layout = plan.layout(n, cb);
            let words = layout.chunks as usize * cb / 8;
            let flags_at = layout.flags_from as usize * cb / 8;
            let mut fs = FloatSum::default();
            let mut got = vec![0u64; words];
            assert!(!fs.summarize(&parts, precision, 0, layout, cb, as_bytes(&mut got)));
            assert!(fs
                .agree(&One, precision, 0, [1, 2, 3, 4], 3, 1)
                .expect("one rank"));
            fs.encode(&parts, precision, layout, cb, as_bytes(&mut got));
            let mut want = vec![0u64; words];
            for p in &inputs {
                let mut one = vec![0u64; words];
                fs.encode(&[p], precision, layout, cb, as_bytes(&mut one));
                for (k, (w, o)) in want.iter_mut().zip(&one).enumerate() {
                    *w = match precision {
                        _ if k >= flags_at => *w | *o,
                        Precision::Reproducible => w.wrapping_add(*o),
                        _ => {
                            let lo = (*w as u32).wrapping_add(*o as u32);
                            let hi = ((*w >> 32) as u32).wrapping_add((*o >> 32) as u32);
                            (hi as u64) << 32 | lo as u64
                        }
                    };
                }
            }
            assert!(
                got == want,
                "{precision:?}: the parts' words are not their sum"
            );
            let mut fused = vec![0u64; words];
            assert!(fs.summarize(&parts, precision, 0, layout, cb, as_bytes(&mut fused)));
            assert!(
                fused == want,
                "{precision:?}: the fused pass wrote other words"
            );
        }
    }
}
