//! The barrier from the rank's side: joining a slot's operation as user
//! space does ([`HostDatapath::join`]: key and join_seq written, the
//! `ready` word read, the predecessor told with one ERAR_INJECT_READY run
//! of the inject path), and the READY frames that inject path builds (run
//! through BPF_PROG_RUN "on" the loopback device, so that its output frame
//! can be read), each checked against the model.
//!
//! [`HostDatapath::join`]: liberar::datapath::kernel::HostDatapath::join

use std::os::fd::AsRawFd;

use anyhow::{Context, Result};
use liberar::datapath::kernel::BarrierState;
use liberar::datapath::wire;

use crate::counters::{fmt_ctr, NR};
use crate::frames::call_key;
use crate::layout::{put16, put32, KEY_WORDS, O_SLOT, O_TOKEN, PL, SLOTS};
use crate::model::Verdict;
use crate::runner::{prog_run_raw, Fuzzer, XDP_DROP, XDP_REDIRECT};

/// BPF_PROG_RUN with this ingress_ifindex (the loopback device's in every
/// namespace) takes erar_xdp's inject path.
const LOOPBACK_IFINDEX: u32 = 1;

fn state_name(s: BarrierState) -> &'static str {
    match s {
        BarrierState::Waiting(_) => "waiting",
        BarrierState::Passed => "passed",
        BarrierState::Aborted => "aborted",
    }
}

impl Fuzzer {
    /// After a slot's setup: its rank joins the new operation (the armed
    /// one mostly, or the next one on the slot before arming it) with the
    /// operation's call key, or another (an erroneous call), or does not
    /// join yet.
    pub fn join_op(&mut self, slot: usize) -> Result<()> {
        let c = self.model.ctl[slot];
        let r = &mut self.gen.rng;
        if c.ring_size == 0 || r.chance(1, 4) {
            return Ok(());
        }
        let seq = match (c.seq(), r.below(10)) {
            (Some(seq), 0..=7) => seq,
            (_, 8) => self.seqs[slot].wrapping_add(2),
            _ => r.near(self.seqs[slot]),
        };
        let key = if r.chance(9, 10) {
            self.op_keys[slot]
        } else {
            call_key(r)
        };
        self.join(slot, seq, key)
    }

    /// Between frames, now and then: a rank joins (again) on a configured
    /// slot: the operation it joined (telling its predecessor again), the
    /// one its successor told of (it joins late), the next one, or the
    /// armed one; with the operation's key mostly.
    pub fn maybe_join(&mut self) -> Result<()> {
        let r = &mut self.gen.rng;
        if !r.chance(1, 150) {
            return Ok(());
        }
        let slot = r.below(SLOTS as u64) as usize;
        let c = self.model.ctl[slot];
        if c.ring_size == 0 {
            return Ok(());
        }
        let seq = match r.below(8) {
            0..=2 => c.join_seq,
            3 | 4 => (c.ready >> 32) as u32,
            5 => c.join_seq.wrapping_add(2),
            _ => c.armed as u32,
        };
        let key = match r.below(12) {
            0 | 1 => c.ready_key,
            2 => call_key(r),
            _ => self.op_keys[slot],
        };
        self.join(slot, seq, key)
    }

    /// One join (HostDatapath::join), checked: the barrier state it
    /// returns, the count it told (the inject path's mode and count left in
    /// the slot_ctl), one `ready_sent` and nothing else, no event, key and
    /// join_seq in the slot_ctl and nothing else changed. Then a few runs
    /// of the inject path in that mode.
    pub fn join(&mut self, slot: usize, seq: u32, key: [u32; KEY_WORDS]) -> Result<()> {
        self.before_ctl = self.model.ctl;
        self.before_word = None;
        let (want_state, told) = self.model.join(slot, seq, key);
        let got = self
            .dp
            .join(slot as u32, seq, key)
            .with_context(|| format!("join of slot {slot}, seq {seq}"))?;
        let (delta, events) = self.observe()?;
        let b = self.before_ctl[slot];
        let what = format!(
            "slot {slot} (n {}) join seq {seq:#x} key {key:x?}, ready {:#x} key {:x?}",
            b.ring_size, b.ready, b.ready_key
        );
        if got != want_state {
            self.mismatch(
                "join",
                &[],
                "barrier state",
                format!("{what}: kernel {got:?}, model {want_state:?}"),
            );
        }
        let mut want = [0u64; NR];
        want[wire::ERAR_STAT_READY_SENT as usize] = 1;
        if delta != want || !events.is_empty() {
            self.mismatch(
                "join",
                &[],
                "counters/events",
                format!(
                    "{what}: kernel {} events {events:?} / model {}",
                    fmt_ctr(&delta),
                    fmt_ctr(&want)
                ),
            );
        }
        let real = self.real_ctl(slot);
        let m = self.model.ctl[slot];
        if real.key != key
            || real.join_seq != seq
            || real.inject_mode != m.inject_mode
            || real.inject_count != told
            || real.inject_next != 0
            || real.ready != m.ready
            || real.ready_key != m.ready_key
        {
            self.mismatch(
                "join",
                &[],
                "slot_ctl",
                format!(
                    "{what}: kernel key {:x?} join_seq {:#x} inject mode {} count {} next {} ready {:#x} key {:x?}; \
                     model count {told}",
                    real.key, real.join_seq, real.inject_mode, real.inject_count, real.inject_next,
                    real.ready, real.ready_key
                ),
            );
            let c = &mut self.model.ctl[slot];
            (c.key, c.join_seq, c.ready, c.ready_key) =
                (real.key, real.join_seq, real.ready, real.ready_key);
            (c.inject_mode, c.inject_count) = (real.inject_mode, real.inject_count);
        }
        // The rank's own writes are the new expected slot_ctl.
        self.ctl_settled(slot);
        self.barrier.joins += 1;
        *self.barrier.by_state.entry(state_name(got)).or_default() += 1;
        for _ in 0..self.gen.rng.range(1, 3) {
            self.inject_run(slot)?;
        }
        Ok(())
    }

    /// One run of the inject path for `slot` (in ERAR_INJECT_READY mode
    /// since its join), with an input page as a rank builds it (full
    /// datapath length or the headers alone, naming the slot and its
    /// token; the rest whatever it held), one of any length in between
    /// (linear chunks: grown to a frame), or a bad one (another token, a
    /// slot out of range, too short for the headers; jumbo, for the key):
    /// the output frame, verdict, counters, no event and no state change
    /// checked against the model.
    fn inject_run(&mut self, slot: usize) -> Result<()> {
        let cb = self.model.cb;
        let token = self.model.ctl[slot].token;
        let r = &mut self.gen.rng;
        let len = match r.below(10) {
            0 => r.range(14, PL as u64 - 1) as usize,
            1 => r.range(PL as u64, PL as u64 + 4 * KEY_WORDS as u64 - 1) as usize,
            2 => PL,
            3 => r.range(PL as u64 + 4 * KEY_WORDS as u64, (PL + cb) as u64) as usize,
            _ => PL + cb,
        };
        let mut f = vec![0u8; len];
        r.fill(&mut f);
        if len >= PL {
            put16(&mut f, O_SLOT, slot as u16);
            put32(&mut f, O_TOKEN, token);
            match r.below(12) {
                0 => put32(&mut f, O_TOKEN, r.near(token)),
                1 => put16(&mut f, O_SLOT, r.range(SLOTS as u64, 0xffff) as u16),
                _ => {}
            }
        }
        // Another mode (none set it here, but a wrong token on another
        // slot may name one): not modelled, not run.
        let Some(pred) = self.model.inject(&f) else {
            return Ok(());
        };
        self.before_ctl = self.model.ctl;
        self.before_word = None;
        let prog_fd = self.dp.prog_fd().as_raw_fd();
        let res = prog_run_raw(prog_fd, LOOPBACK_IFINDEX, &f, &mut self.out);
        let (verdict, out) = match res {
            Ok((XDP_REDIRECT, n)) => (Some(Verdict::Redirect), self.out[..n].to_vec()),
            Ok((XDP_DROP, n)) => (Some(Verdict::Drop), self.out[..n].to_vec()),
            _ => (None, Vec::new()),
        };
        let (delta, events) = self.observe()?;
        self.barrier.inject_runs += 1;
        let outcome = if delta[wire::ERAR_STAT_READY_SENT as usize] > 0 {
            "ready_sent"
        } else {
            "inject_err"
        };
        *self.barrier.inject_outcomes.entry(outcome).or_default() += 1;
        if verdict != Some(pred.verdict) {
            self.mismatch(
                "inject-ready",
                &f,
                "verdict",
                format!("kernel {res:?}, model {:?}", pred.verdict),
            );
        }
        if out != pred.out {
            let first = out.iter().zip(&pred.out).position(|(a, b)| a != b);
            self.mismatch(
                "inject-ready",
                &f,
                "output frame",
                format!(
                    "len {} vs {}, first difference at {first:?}",
                    out.len(),
                    pred.out.len()
                ),
            );
        }
        if delta != pred.ctr || !events.is_empty() {
            self.mismatch(
                "inject-ready",
                &f,
                "counters/events",
                format!(
                    "kernel {} events {events:?} / model {}",
                    fmt_ctr(&delta),
                    fmt_ctr(&pred.ctr)
                ),
            );
        }
        self.check_state("inject-ready", &f, false);
        Ok(())
    }
}
