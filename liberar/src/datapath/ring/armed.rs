//! What happens between arming a slot and disarming it: the barrier that
//! opens an operation, in the kernel ([`Ring::kernel_barrier`]: every host
//! joined with the same call key) or over MPI ([`Ring::barrier`]: the same,
//! plus the seq, whether every host armed, whether float scales must be
//! agreed anew; also where every rank goes when the kernel's aborts), then
//! inject and wait, and then either the verdict every rank shares (carrying
//! a bounded float SUM's repairs) and the loss recovery rounds, until all
//! hosts are complete or all let MPI complete the call, or, for an
//! operation run alone, nothing but NACKs until this host is complete.

use super::{retry_quiet, Ring};
use crate::config::{Config, Precision};
use crate::datapath::codec;
use crate::datapath::kernel::{BarrierState, BarrierWait, Patience};
use crate::datapath::liveness::Prober;
use crate::datapath::{wire, Comm, DatapathError};
use crate::select::{ElemType, ReduceOp};
use crate::stats::{self, Phase};
use crate::trace::{self, Mark};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a bounded float SUM's verdict carries: up to `capacity` repair
/// inputs from `parts` (this member's contributions), certified on the slot's final words of `layout`
/// ([`FloatSum::verdict_with_repairs`](codec::FloatSum::verdict_with_repairs)).
pub(super) struct Repairs<'a> {
    pub(super) capacity: usize,
    pub(super) layout: codec::Layout,
    pub(super) parts: &'a [&'a [u8]],
}

impl Ring {
    /// The next operation's seq, in 1..2^31 (agree_call compares seqs as
    /// non-negative i32), and its slot: the ring's generation of its parity.
    pub(super) fn next_seq(&mut self) -> u32 {
        self.seq = (self.seq + 1) & 0x7fff_ffff;
        self.seq = self.seq.max(1);
        self.slot = self.slots[self.generation()];
        self.seq
    }

    /// The generation of the current operation: its slot's index in
    /// `slots` (seq parity).
    pub(super) fn generation(&self) -> usize {
        (self.seq & 1) as usize
    }

    /// The barrier before injection over MPI: nobody injects before every
    /// host has armed, so no frame arrives early. It is the call-key
    /// agreement ([`agree_call`]), which also tells whether the ranks' seqs
    /// agree, whether every host armed and whether any rank asked to
    /// `rescale` (agree on new float scales). `armed`: this host armed the
    /// slot for `seq`.
    pub(super) fn barrier(
        &mut self,
        comm: &dyn Comm,
        key: CallKey,
        (seq, armed): (u32, bool),
        rescale: bool,
    ) -> Result<Barrier, DatapathError> {
        let started = Instant::now();
        let asked = Asked {
            seq,
            unarmed: !armed,
            rescale,
        };
        let agreed = agree_call(comm, key, asked, self.prober.as_deref_mut())?;
        stats::phase_done(Phase::Agree, started);
        // A call that failed on some ranks before it took a seq and on
        // others after (an erroneous call) leaves the counters apart:
        // everyone adopts the largest, and MPI completes this call (the
        // ranks armed different generations).
        self.seq = agreed.seq;
        Ok(Barrier {
            seq,
            broken: agreed.unarmed || agreed.seqs_apart,
            rescale: agreed.rescale,
            started,
        })
    }

    /// The barrier before injection in the kernel (see "Barrier" in
    /// erar_wire.h), with no MPI exchange: this host joins operation `seq`
    /// (its slot armed, `armed`, or to be armed after this barrier) with
    /// the call key, and waits until every host has joined with the same
    /// key. `Some`: every host did, and may inject. `None`: the barrier
    /// aborted on every host before anything was sent, because the hosts
    /// joined with different keys: an erroneous call, a host whose slot
    /// could not be armed (it joins with a key no call has), float SUM
    /// hosts that are not all ready to reuse the same scales (see
    /// ring/sum_alone.rs), or a NaN in some hosts' data of a float MAX/MIN
    /// ([`CallKey::vetoed`]). Every rank then meets over MPI, where
    /// [`agree_call`] tells these apart the same way on every rank
    /// ([`Ring::run_exact`]).
    ///
    /// A rank may reach it arbitrarily late, so it has no deadline (a host
    /// that left on a timer while another passed would split the ranks
    /// between the ring and MPI); while it waits, the prober watches the
    /// other hosts (as in [`opening_max`]).
    pub(super) fn kernel_barrier(
        &mut self,
        comm: &dyn Comm,
        key: CallKey,
        at: (u32, bool),
    ) -> Result<Option<Barrier>, DatapathError> {
        self.kernel_barrier_until(comm, key, at, BarrierWait::Everyone)
    }

    /// [`Ring::kernel_barrier`], left once `wait` is met: with
    /// [`BarrierWait::Successor`], once this host's successor joined (the
    /// barrier that ends a call in place, [`Ring::in_place_done`]).
    pub(super) fn kernel_barrier_until(
        &mut self,
        comm: &dyn Comm,
        key: CallKey,
        (seq, armed): (u32, bool),
        wait: BarrierWait,
    ) -> Result<Option<Barrier>, DatapathError> {
        let started = Instant::now();
        let cfg = Config::get();
        let words = if armed { key.words() } else { [u32::MAX; 4] };
        let failed =
            |e: anyhow::Error| DatapathError::Failed(format!("barrier of seq {seq}: {e:#}"));
        let (host, slot) = (Arc::clone(&self.host), self.slot);
        let mut state = host.join(slot, seq, words).map_err(failed)?;
        trace::mark(Mark::Joined);
        // READY frames are small and rare: tell the predecessor again
        // after a NACK period, then less and less often while a rank is late.
        let mut again = Duration::from_micros(cfg.nack_us.max(50));
        let mut told = Instant::now();
        let within = Duration::from_millis(cfg.timeout_ms);
        let mut prober = self.prober.as_deref_mut().filter(|_| cfg.timeout_ms > 0);
        if let Some(p) = prober.as_deref_mut() {
            p.start();
        }
        let outcome = loop {
            match state {
                BarrierState::Aborted => {
                    stats::record_kernel_abort();
                    break Ok(false);
                }
                state if wait.met(state) => break Ok(true),
                _ => {}
            }
            if let Some(p) = prober.as_deref_mut() {
                if let Err(e) = p.check(within) {
                    break Err(e);
                }
            }
            let tell_again = told.elapsed() >= again;
            if tell_again {
                told = Instant::now();
                again = (again * 2).min(Duration::from_millis(5));
            }
            let tick = again.min(Duration::from_millis(1));
            // MPI's queued sends of the last collective (see Comm::progress).
            comm.progress();
            // The rank polls for ERAR_POLL_US of the whole wait, then sleeps.
            let poll = cfg.poll().saturating_sub(started.elapsed());
            state = match host.barrier(slot, seq, words, (tick, poll), (tell_again, wait)) {
                Ok(state) => state,
                Err(e) => break Err(failed(e)),
            };
        };
        if let Some(p) = prober {
            p.stop();
        }
        stats::phase_done(Phase::Agree, started);
        match outcome? {
            // (Hosts that all failed to arm pass with the same key.)
            true if armed => {
                stats::record_kernel_barrier();
                Ok(Some(Barrier {
                    seq,
                    broken: false,
                    rescale: false,
                    started,
                }))
            }
            _ => Ok(None),
        }
    }

    /// An exact operation (or a broadcast) armed for `seq` (`armed`: this
    /// host's arm succeeded): the barrier in the kernel, then the run alone.
    /// If that barrier aborts, every rank meets over MPI instead
    /// ([`Ring::barrier`]): there an erroneous call fails on every rank, and
    /// a host that could not arm has MPI complete the call everywhere.
    pub(super) fn run_exact(
        &mut self,
        comm: &dyn Comm,
        key: CallKey,
        (seq, armed): (u32, bool),
        chunks: u32,
        role: Role,
    ) -> Result<Outcome, DatapathError> {
        match self.kernel_barrier(comm, key, (seq, armed))? {
            Some(b) => self.run_alone(comm, b, chunks, role),
            None => self
                .barrier(comm, key, (seq, armed), false)
                .and_then(|b| self.run_armed(comm, b, chunks, role, false, None)),
        }
    }
}

/// What every rank must pass identically to one call on the ring, as
/// non-negative words (so that their negations exist).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CallKey(pub(super) [i32; 4]);

impl CallKey {
    pub(super) fn allreduce(
        bytes: usize,
        elem: ElemType,
        op: ReduceOp,
        precision: Precision,
    ) -> CallKey {
        let what = 1 | (elem as i32) << 4 | (op as i32) << 8 | (precision as i32) << 12;
        CallKey::new(what, bytes, 0)
    }

    pub(super) fn bcast(bytes: usize, root: usize) -> CallKey {
        CallKey::new(2, bytes, root)
    }

    /// The barrier after a call (a broadcast, an allreduce) whose hosts
    /// read and write the callers' buffers: every host holds every chunk.
    pub(super) fn in_place_done() -> CallKey {
        CallKey::new(4, 0, 0)
    }

    /// A float SUM's repairs gathered through the ring, `bytes` in all.
    pub(super) fn repairs(bytes: usize) -> CallKey {
        CallKey::new(3, bytes, 0)
    }

    /// The key of a float SUM segment whose data is encoded on the scales
    /// agreed in operation `at` (at least 1, where an allreduce's key has
    /// 0): two hosts join the kernel barrier with the same one only if
    /// both reuse the same agreement (see ring/sum_alone.rs).
    pub(super) fn on_scales_of(self, at: u32) -> CallKey {
        let mut key = self;
        key.0[3] = (at & 0x7fff_ffff).max(1) as i32;
        key
    }

    /// The key of a float MAX/MIN on a host whose data holds a NaN (which
    /// vetoes the ring): the hosts pass the kernel barrier together only
    /// if all or none of them have one.
    pub(super) fn vetoed(self) -> CallKey {
        let mut key = self;
        key.0[3] = 1;
        key
    }

    /// The key of an exact call cut into segments of `elems` elements:
    /// hosts that cut it differently fail its barrier (ring/tune.rs).
    pub(super) fn in_segments_of(self, elems: usize) -> CallKey {
        let mut key = self;
        key.0[3] = elems.min(0x7fff_ffff) as i32;
        key
    }

    /// The key as the kernel barrier compares it.
    pub(super) fn words(&self) -> [u32; 4] {
        self.0.map(|w| w as u32)
    }

    fn new(what: i32, bytes: usize, extra: usize) -> CallKey {
        const LOW31: u64 = 0x7fff_ffff;
        let b = bytes as u64;
        CallKey([
            what,
            (b & LOW31) as i32,
            ((b >> 31) & LOW31) as i32,
            extra.min(LOW31 as usize) as i32,
        ])
    }
}

/// Checks that every rank makes the same call (size, type, op, precision;
/// size and root for a broadcast) before anything whose size depends on it;
/// being an allreduce, it is also a barrier. An erroneous program (counts,
/// datatypes, ops or roots that differ across ranks) would otherwise have
/// the ranks run different sequences of collectives (a hang), complete
/// silently with truncated or foreign data, or reach MPI's fallback call
/// with mismatched counts. One MAX allreduce of the key and its negation
/// gives every rank each word's largest and smallest value: the same
/// verdict everywhere, an error on every rank, no buffer touched.
///
/// Also returns the largest seq of any rank (see [`Ring::barrier`]) and
/// whether any rank asked to rescale.
///
/// A rank may reach this exchange arbitrarily late, so it has no deadline;
/// while it waits, `prober` watches the other hosts: one that stops
/// answering for ERAR_TIMEOUT_MS (its link or the host is gone) fails the
/// call here instead of hanging it.
fn agree_call(
    comm: &dyn Comm,
    key: CallKey,
    asked: Asked,
    prober: Option<&mut Prober>,
) -> Result<Agreed, DatapathError> {
    let mut words = [0i32; 12];
    for (i, k) in key.0.iter().enumerate() {
        words[i] = *k;
        words[4 + i] = -*k;
    }
    let seq_word = (asked.seq & 0x7fff_ffff) as i32;
    words[8] = seq_word;
    words[9] = -seq_word;
    words[10] = asked.rescale as i32;
    words[11] = asked.unarmed as i32;
    opening_max(comm, &mut words, prober)?;
    check_keys(&words)?;
    Ok(Agreed {
        seq: words[8] as u32,
        seqs_apart: words[8] != -words[9],
        rescale: words[10] != 0,
        unarmed: words[11] != 0,
    })
}

/// The MAX over ranks of `words` in the exchange that opens a call: a rank
/// may reach it arbitrarily late, so it has no deadline; while it waits,
/// `prober` watches the other hosts (see [`agree_call`]).
pub(super) fn opening_max(
    comm: &dyn Comm,
    words: &mut [i32],
    prober: Option<&mut Prober>,
) -> Result<(), DatapathError> {
    let timeout = Config::get().timeout_ms;
    match prober {
        Some(p) if timeout > 0 => {
            let within = Duration::from_millis(timeout);
            p.start();
            let agreed = comm.allreduce_max_i32_watched(words, &mut || p.check(within));
            p.stop();
            agreed
        }
        _ => comm.allreduce_max_i32(words),
    }
}

/// After a MAX over `[key, -key, ..]`: every rank gave the same key, or the
/// call is erroneous (an error on every rank).
pub(super) fn check_keys(words: &[i32]) -> Result<(), DatapathError> {
    if (0..4).any(|i| words[i] != -words[4 + i]) {
        return Err(DatapathError::Failed(
            "the ranks' arguments differ (count, datatype, op or root): erroneous call".into(),
        ));
    }
    Ok(())
}

/// What one rank tells [`agree_call`].
struct Asked {
    seq: u32,
    /// Arming its slot failed.
    unarmed: bool,
    /// It must agree on new float scales before injecting.
    rescale: bool,
}

/// What [`agree_call`] found every rank to say.
struct Agreed {
    /// The largest seq.
    seq: u32,
    /// Not every rank gave that seq.
    seqs_apart: bool,
    /// Some rank must agree on new float scales before injecting.
    rescale: bool,
    /// Some host did not arm its slot.
    unarmed: bool,
}

/// Past the barrier: the agreed seq, whether the datapath is unusable for
/// it (on some host, or the seqs were apart), whether some rank asked to
/// rescale, and when the barrier began (ERAR_STALL_MS counts from there).
pub(super) struct Barrier {
    pub(super) seq: u32,
    pub(super) broken: bool,
    pub(super) rescale: bool,
    pub(super) started: Instant,
}

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
    /// This host holds every chunk's final value, and the operation ran
    /// alone: its slot stays armed for the NACKs of hosts still missing a
    /// frame of it (see "Generations" in ring.rs).
    CompleteAlone,
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
            poll: cfg.poll(),
            poll_renewed: self.host_to_itself,
        };
        let Barrier {
            seq,
            broken,
            started,
            ..
        } = b;
        if broken {
            // Every rank knows it: nobody injects.
            return Ok(Outcome::Fallback(
                "a host could not arm its slot, or the ranks' seqs were apart",
            ));
        }
        let mut broken = false;
        let mut phase_start = Instant::now();
        // Everyone is inside the call now: from here a silent peer is a
        // dead one (or one whose link is down), not a late one.
        let _deadline = (cfg.timeout_ms > 0)
            .then(|| Deadline::set(comm, Duration::from_millis(cfg.timeout_ms)));
        if role != Role::Sink {
            broken = self.host.inject(self.slot).is_err();
        }
        phase_start = stats::phase_done(Phase::Inject, phase_start);
        loop {
            let complete = broken
                || role == Role::Source
                || match self.host.wait(self.slot, seq, patience) {
                    Ok(waited) => {
                        stats::record_repairs(waited.nacks, waited.nack_chunks, waited.restarted);
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
                        r.parts,
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

    /// Runs an operation alone: any operation (or a float SUM's scale
    /// agreement, or its repairs' gather) on a ring whose ranks all have
    /// NACKs on ([`Ring::alone`](super::Ring)). Past its barrier (in the
    /// kernel) it makes no exchange: this host injects, waits until it
    /// holds every chunk while its NACKs repair what is lost (answered by
    /// the other hosts' XDP, also by one
    /// that has returned already: the slot stays armed, see "Generations"
    /// in ring.rs), and returns. Its result is final the moment it is
    /// complete, so it needs no verdict; nothing falls back to MPI once a
    /// frame is out. An operation that makes no progress for
    /// ERAR_STALL_MS (a host or its link is gone: every frame of a live
    /// ring can be re-sent) ends in an error, and the caller's buffer is
    /// untouched.
    pub(super) fn run_alone(
        &mut self,
        comm: &dyn Comm,
        b: Barrier,
        chunks: u32,
        role: Role,
    ) -> Result<Outcome, DatapathError> {
        let cfg = Config::get();
        let stall = Duration::from_millis(cfg.stall_ms);
        let patience = Patience {
            nack_after: Some(Duration::from_micros(cfg.nack_us.max(1))),
            quiet: retry_quiet(),
            poll: cfg.poll(),
            poll_renewed: self.host_to_itself,
        };
        let mut phase_start = Instant::now();
        let failed = |what: &str, e: anyhow::Error| {
            DatapathError::Failed(format!("{what} (seq {}): {e:#}", b.seq))
        };
        if role != Role::Sink {
            self.host
                .inject(self.slot)
                .map_err(|e| failed("injecting", e))?;
        }
        phase_start = stats::phase_done(Phase::Inject, phase_start);
        if role == Role::Source {
            return Ok(Outcome::CompleteAlone);
        }
        let mut done = 0;
        let mut progress = Instant::now();
        loop {
            let waited = self
                .host
                .wait(self.slot, b.seq, patience)
                .map_err(|e| failed("waiting", e))?;
            stats::record_repairs(waited.nacks, waited.nack_chunks, waited.restarted);
            if waited.complete {
                stats::phase_done(Phase::Wait, phase_start);
                return Ok(Outcome::CompleteAlone);
            }
            comm.progress();
            let now_done = self
                .host
                .done(self.slot)
                .map_err(|e| failed("progress", e))?;
            if now_done != done {
                (done, progress) = (now_done, Instant::now());
            } else if progress.elapsed() >= stall {
                return Err(DatapathError::Failed(format!(
                    "seq {}: no progress for ERAR_STALL_MS ({} ms) with {done} chunks \
                     complete: a host or its link is gone ({})",
                    b.seq,
                    cfg.stall_ms,
                    self.stall_report(b.seq, chunks)
                )));
            }
        }
    }

    /// What a stalled operation's error says of this host: its first missing
    /// chunks and their stages, and the kernel's repair counters.
    fn stall_report(&mut self, seq: u32, chunks: u32) -> String {
        let bytes = (chunks as usize).div_ceil(4);
        self.stages.clear();
        self.stages.resize(bytes, 0);
        let _ = self.host.stages(self.slot, seq, chunks, &mut self.stages);
        let stage = |c: u32| (self.stages[c as usize / 4] >> (2 * (c % 4))) & 3;
        let missing: Vec<String> = (0..chunks)
            .filter(|&c| u32::from(stage(c)) != wire::ERAR_STAGE_FINAL)
            .take(6)
            .map(|c| format!("{c}:{}", stage(c)))
            .collect();
        let kernel = self
            .host
            .stats()
            .map(|k| {
                k.named()
                    .filter(|(name, v)| *v > 0 && (name.contains("nack") || name.contains("drop")))
                    .map(|(name, v)| format!("{name}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default();
        format!(
            "missing chunk:stage {} of {chunks}; kernel {kernel}",
            missing.join(" ")
        )
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
        let Ok(trip) = self.host.trip(self.slot) else {
            return Ok(false);
        };
        let next = (comm.rank() + 1) % n;
        let theirs = &self.all_stages[next * bytes..(next + 1) * bytes];
        let stage = |packed: &[u8], c: u32| u32::from(packed[c as usize / 4] >> (2 * (c % 4))) & 3;
        self.resend.clear();
        for c in 0..chunks {
            let wanted = trip.awaits(n as u32, next as u32, c, stage(theirs, c));
            // Re-send only what the successor waits for from us: the frame
            // we last sent must be of the kind it awaits (an RS partial, or
            // an AG final value); otherwise the loss was further up the
            // ring, and our predecessor re-sends to us first.
            if wanted == Some(trip.sent_ag(stage(&self.stages, c))) {
                self.resend.push(c);
            }
        }
        stats::record_recovery_round(self.resend.len());
        Ok(self.resend.is_empty() || self.host.resend(self.slot, &self.resend).is_ok())
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
