//! Running an armed operation past its barrier: inject, wait, the verdict
//! every rank shares (carrying a bounded float SUM's repairs), and the loss
//! recovery rounds, until all hosts are complete or all let MPI complete
//! the call.

use super::agree::Barrier;
use super::call::Repairs;
use super::{retry_quiet, Ring};
use crate::config::Config;
use crate::datapath::kernel::Patience;
use crate::datapath::{wire, Comm, DatapathError};
use crate::stats::{self, Phase};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Who does what in one armed operation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// Injects its starting chunks and receives every chunk (allreduce).
    Member,
    /// Injects every chunk, receives none (broadcast root).
    Source,
    /// Receives every chunk (broadcast non-root).
    Sink,
}

/// How an armed operation ended, the same on every rank.
pub(super) enum Outcome {
    /// Every host holds every chunk's final value.
    Complete,
    /// The kernel result is not used: MPI completes the call (why).
    Fallback(&'static str),
}

impl Ring {
    /// Runs the armed operation past its barrier `b` (`chunks` chunks)
    /// until every host holds every chunk, or every rank agrees to let MPI
    /// complete it. `veto`: this rank already knows the kernel's result
    /// cannot be used (a NaN in its data). `repairs`: a bounded float SUM's
    /// verdicts carry its repair inputs (one exchange for both).
    ///
    /// Rounds: each host waits until it holds every chunk or its progress
    /// stops for ERAR_RETRY_MS. While it waits, each pause of ERAR_NACK_US
    /// sends its predecessor NACKs for what it misses, which that host's XDP
    /// answers by itself: most losses are repaired there, without user
    /// space on the other side or any MPI exchange. Then the ranks agree
    /// whether all are complete; if
    /// not, every host publishes its chunks' stages and its predecessor
    /// re-sends what it waits for (each re-sent frame carries on around
    /// the ring by itself). Duplicates and late originals are dropped in the
    /// kernel by the chunk's stage, so a re-send never adds twice. After
    /// ERAR_STALL_MS the ranks give up together and MPI completes the call.
    pub(super) fn run_armed(
        &mut self,
        comm: &dyn Comm,
        b: Barrier,
        chunks: u32,
        role: Role,
        veto: bool,
        repairs: Option<&Repairs<'_>>,
    ) -> Result<Outcome, DatapathError> {
        let cfg = Config::get();
        let limit = Duration::from_millis(cfg.stall_ms);
        let patience = Patience {
            nack_after: (cfg.nack_us > 0).then(|| Duration::from_micros(cfg.nack_us)),
            quiet: retry_quiet(),
        };
        let Barrier {
            seq,
            mut broken,
            started,
            ..
        } = b;
        let mut phase_start = Instant::now();
        // Everyone is inside the call now: from here a silent peer is a
        // dead one (or one whose link is down), not a late one.
        let _deadline = (cfg.timeout_ms > 0)
            .then(|| Deadline::set(comm, Duration::from_millis(cfg.timeout_ms)));
        if !broken && role != Role::Sink {
            broken = self.host.inject(self.slot).is_err();
        }
        phase_start = stats::phase_done(Phase::Inject, phase_start);
        loop {
            let complete = broken
                || role == Role::Source
                || match self.host.wait(self.slot, seq, patience) {
                    Ok(waited) => {
                        stats::record_nacks(waited.nacks, waited.nack_chunks);
                        waited.complete
                    }
                    Err(_) => false,
                };
            phase_start = stats::phase_done(Phase::Wait, phase_start);
            let timed_out = started.elapsed() >= limit;
            let mut verdict = [
                broken as i32,
                veto as i32,
                (!complete) as i32,
                timed_out as i32,
            ];
            match repairs {
                Some(r) if r.capacity > 0 => {
                    let host = Arc::clone(&self.host);
                    // SAFETY: our slot, armed; once this host is complete
                    // the kernel writes no more of its words (late copies
                    // are dropped by their chunk's stage), and only then
                    // are they read.
                    let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
                    let usable = complete && !broken && !veto;
                    self.float_sum.verdict_with_repairs(
                        comm,
                        &mut verdict,
                        usable,
                        r.capacity,
                        r.layout,
                        self.chunk_bytes,
                        slot_buf,
                        r.input,
                    )?;
                }
                _ => comm.allreduce_max_i32(&mut verdict)?,
            }
            phase_start = stats::phase_done(Phase::Verdict, phase_start);
            match verdict {
                [0, 0, 0, _] => return Ok(Outcome::Complete),
                [1, ..] => return Ok(Outcome::Fallback("a host's datapath failed")),
                [_, 1, ..] => return Ok(Outcome::Fallback("NaN in the data")),
                [.., 1] => return Ok(Outcome::Fallback("ERAR_STALL_MS passed")),
                _ => {}
            }
            broken = !self.recovery_round(comm, seq, chunks, role)?;
            phase_start = stats::phase_done(Phase::Recovery, phase_start);
        }
    }

    /// Every host publishes its chunks' stages; each re-sends what its
    /// successor waits for. Ok(false): this host's datapath failed (the next
    /// verdict makes everyone fall back); Err: the exchange itself failed.
    fn recovery_round(
        &mut self,
        comm: &dyn Comm,
        seq: u32,
        chunks: u32,
        role: Role,
    ) -> Result<bool, DatapathError> {
        let bytes = (chunks as usize).div_ceil(4);
        let n = comm.size();
        self.stages.clear();
        self.stages.resize(bytes, 0);
        let local_ok = role == Role::Source
            || self
                .host
                .stages(self.slot, seq, chunks, &mut self.stages)
                .is_ok();
        self.all_stages.clear();
        self.all_stages.resize(bytes * n, 0);
        comm.allgather(&self.stages, &mut self.all_stages)?;
        if !local_ok {
            return Ok(false);
        }
        let next = (comm.rank() + 1) % n;
        let theirs = &self.all_stages[next * bytes..(next + 1) * bytes];
        let stage = |packed: &[u8], c: u32| (packed[c as usize / 4] >> (2 * (c % 4))) & 3;
        let bcast = role != Role::Member;
        self.resend.clear();
        for c in 0..chunks {
            let wanted = successor_awaits(bcast, n as u32, next as u32, c, stage(theirs, c));
            // Re-send only what the successor waits for from us: the frame
            // we last sent must be of the kind it awaits (an RS partial, or
            // an AG final value); otherwise the loss was further up the
            // ring, and our predecessor re-sends to us first.
            let mine_is_ag = bcast || stage(&self.stages, c) == wire::ERAR_STAGE_FINAL as u8;
            if wanted == Some(mine_is_ag) {
                self.resend.push(c);
            }
        }
        stats::record_recovery_round(self.resend.len());
        Ok(self.resend.is_empty() || self.host.resend(self.slot, &self.resend).is_ok())
    }
}

/// What the host at ring position `pos` waits for next for chunk `c`, given
/// its stage: `Some(false)` an RS frame, `Some(true)` an AG frame, `None`
/// nothing (it holds the final value, or is applying a frame right now).
fn successor_awaits(bcast: bool, n: u32, pos: u32, c: u32, stage: u8) -> Option<bool> {
    match stage as u32 {
        wire::ERAR_STAGE_FINAL | wire::ERAR_STAGE_BUSY => None,
        _ if bcast => Some(true),
        // Allreduce: the chunk's origin (c mod n) and hosts that already
        // reduced it wait for the all-gather; the others for the RS partial.
        wire::ERAR_STAGE_NONE => Some(pos == c % n),
        _ => Some(true),
    }
}

/// Bounds the communicator's exchanges while alive (see
/// [`Comm::set_deadline`]).
struct Deadline<'a>(&'a dyn Comm);

impl<'a> Deadline<'a> {
    fn set(comm: &'a dyn Comm, within: Duration) -> Deadline<'a> {
        comm.set_deadline(Some(Instant::now() + within));
        Deadline(comm)
    }
}

impl Drop for Deadline<'_> {
    fn drop(&mut self) {
        self.0.set_deadline(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn successor_waits_for_the_right_kind() {
        let (none, reduced, fin) = (
            wire::ERAR_STAGE_NONE as u8,
            wire::ERAR_STAGE_REDUCED as u8,
            wire::ERAR_STAGE_FINAL as u8,
        );
        // Ring of 4, chunk 5 starts at position 1.
        assert_eq!(successor_awaits(false, 4, 2, 5, none), Some(false)); // RS partial
        assert_eq!(successor_awaits(false, 4, 1, 5, none), Some(true)); // origin: AG
        assert_eq!(successor_awaits(false, 4, 3, 5, reduced), Some(true));
        assert_eq!(successor_awaits(false, 4, 3, 5, fin), None);
        assert_eq!(successor_awaits(true, 4, 3, 5, none), Some(true));
        assert_eq!(
            successor_awaits(true, 4, 3, 5, wire::ERAR_STAGE_BUSY as u8),
            None
        );
    }
}
