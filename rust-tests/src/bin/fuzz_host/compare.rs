//! Checking one frame's runs: the kernel's verdicts, output frames, counter
//! deltas, events and slot state against the model's predictions, the
//! model-free accounting and the docs' rules; mismatches reported.

use anyhow::{bail, Result};
use liberar::datapath::wire;

use crate::counters::{fmt_ctr, stat_array, NR, TERMINAL};
use crate::layout::{
    be16, hex, key_of, le16, le32, ARMED_BIT, HDR, LINEAR_MAX, MAGIC, MAX_RING, NACK, OP_BCAST,
    O_CHUNK, O_COMM, O_KIND, O_MAGIC, O_OP, O_RESERVED, O_SEQ, O_SLOT, O_STEP, O_TOKEN, O_VERSION,
    PING, PL, READY, READY_ABORT, SLOTS, STAGE_NONE, VERSION,
};
use crate::maps::{CTL_SIZE, DONE_OFF, READY_KEY_OFF, READY_OFF, START_NEXT_OFF};
use crate::model::{
    docs_expect, docs_last_sent, is_datapath, ready_newer, Ctl, Prediction, Verdict,
};
use crate::runner::{Fuzzer, Outcome, XDP_DROP, XDP_PASS, XDP_TX};

/// A completion event as read: (the slot whose ring buffer held it, the
/// record's slot, its seq).
type Event = (u32, u32, u32);
/// Counter deltas and completion events.
type Observed = ([u64; NR], Vec<Event>);

impl Fuzzer {
    pub fn mismatch(&mut self, class: &str, f: &[u8], what: &str, detail: String) {
        self.mismatches += 1;
        if self.reported < 20 {
            self.reported += 1;
            let slot = if f.len() >= O_SLOT + 2 {
                le16(f, O_SLOT) as usize
            } else {
                SLOTS
            };
            let ctx = if slot < SLOTS {
                let c = self.before_ctl[slot];
                let st = match self.before_word {
                    Some(w) => format!("{w:#x}"),
                    None => "-".into(),
                };
                format!("slot {slot} ctl {{comm {:#x} token {:#x} pos {} n {} root {} chunks {} op {} armed {:#x} done {} \
                    join_seq {:#x} key {:x?} ready {:#x} ready_key {:x?}}} chunk_state(before) {st}",
                    c.comm_id, c.token, c.ring_pos, c.ring_size, c.root, c.chunks, c.wire_op, c.armed, c.done,
                    c.join_seq, c.key, c.ready, c.ready_key)
            } else {
                String::new()
            };
            println!(
                "MISMATCH #{} [{class}] {what}: {detail}\n  {ctx}\n  frame len {}: {}",
                self.mismatches,
                f.len(),
                hex(f),
            );
        }
    }

    /// Notes the model's state before a frame (reports, and the revert of
    /// a model-accepted frame the kernel rejected). Returns the frame's
    /// chunk element (its state word and, in `before_chunk`, the bytes it
    /// may write: `Model::written_at`), the only one it may change.
    pub fn before(&mut self, f: &[u8]) -> Option<usize> {
        self.before_ctl = self.model.ctl;
        self.before_word = None;
        if f.len() >= O_SLOT + 2 {
            let (s, c) = (le16(f, O_SLOT) as usize, le32(f, O_CHUNK) as usize);
            if s < SLOTS && c < self.model.cps {
                let idx = self.model.idx(s, c);
                self.before_word = Some(self.model.state[idx]);
                let at = self.model.written_at(s, c);
                self.before_chunk.clear();
                self.before_chunk.extend_from_slice(&self.model.buf[at]);
                return Some(idx);
            }
        }
        None
    }

    /// The docs' rule, independent of the program's order of checks: a
    /// frame is applied (once) iff it is a well-formed datapath frame of the
    /// armed operation (magic, version, slot, seq, comm_id, token, wire_op,
    /// chunk < chunks) whose (kind, step) is the one [`docs_expect`] gives
    /// for the chunk's stage before it. A NACK is never applied; it is
    /// answered (`served`, when given) iff it is such a frame whose kind is
    /// NACK | k and (k, step) is what [`docs_last_sent`] gives. Either only
    /// if the registered buffers it needs hold the chunk
    /// ([`Model::docs_region_ok`]).
    fn check_semantics(
        &mut self,
        class: &str,
        f: &[u8],
        target: Option<usize>,
        accepted: bool,
        served: Option<bool>,
    ) {
        let cb = self.model.cb;
        let (should, should_serve) = match (target, self.before_word) {
            (Some(idx), Some(w)) if f.len() >= PL + cb => {
                let (slot, chunk) = (idx / self.model.cps, (idx % self.model.cps) as u32);
                let c = self.before_ctl[slot];
                let seq = le32(f, O_SEQ);
                let stage = if (w >> 32) as u32 == seq {
                    w as u32
                } else {
                    STAGE_NONE
                };
                if c.wire_op == OP_BCAST && c.root >= c.ring_size {
                    // arm() accepted a root outside the ring: unspecified.
                    if accepted {
                        self.root_oob_accepts += 1;
                    }
                    return;
                }
                let of_op = is_datapath(&f[..f.len().min(LINEAR_MAX)])
                    && f.len() == PL + cb
                    && be16(f, 16) as usize == 20 + 8 + HDR + cb
                    && be16(f, 38) as usize == 8 + HDR + cb
                    && le32(f, O_RESERVED) == 0
                    && le32(f, O_MAGIC) == MAGIC
                    && f[O_VERSION] == VERSION
                    && c.armed == ARMED_BIT | seq as u64
                    && le32(f, O_COMM) == c.comm_id
                    && le32(f, O_TOKEN) == c.token
                    && f[O_OP] as u32 == c.wire_op
                    && chunk < c.chunks;
                let (kind, step) = (f[O_KIND], f[O_STEP]);
                let held = self.model.docs_region_ok(slot, chunk as usize, kind, stage);
                (
                    of_op && held && docs_expect(&c, chunk, stage) == Some((kind, step)),
                    of_op
                        && held
                        && docs_last_sent(&c, chunk, stage).map(|(k, s)| (NACK | k, s))
                            == Some((kind, step)),
                )
            }
            _ => (false, false),
        };
        if accepted != should {
            self.mismatch(
                class,
                f,
                "SEMANTICS",
                format!("kernel accepted: {accepted}, docs' rule says: {should}"),
            );
        }
        if let Some(served) = served {
            if served != should_serve {
                self.mismatch(
                    class,
                    f,
                    "SEMANTICS",
                    format!("kernel answered the NACK: {served}, docs' rule says: {should_serve}"),
                );
            }
        }
    }

    /// Whether `f` is a well-formed datapath frame (length, IPv4 and UDP
    /// lengths, reserved bytes, magic, version) of kind exactly `kind`,
    /// naming a slot that exists.
    fn well_formed_of_kind(&self, f: &[u8], kind: u8) -> bool {
        let cb = self.model.cb;
        is_datapath(&f[..f.len().min(LINEAR_MAX)])
            && f.len() == PL + cb
            && be16(f, 16) as usize == 20 + 8 + HDR + cb
            && be16(f, 38) as usize == 8 + HDR + cb
            && le32(f, O_RESERVED) == 0
            && le32(f, O_MAGIC) == MAGIC
            && f[O_VERSION] == VERSION
            && f[O_KIND] == kind
            && (le16(f, O_SLOT) as usize) < SLOTS
    }

    /// The rule of erar_wire.h (ERAR_KIND_PING) and docs/datapath.md
    /// (Faults), independent of the program's order of checks: a frame is
    /// answered as a PING iff it is a well-formed datapath frame (length,
    /// IPv4 and UDP lengths, reserved bytes, magic, version) of kind exactly
    /// ERAR_KIND_PING whose slot exists and whose comm_id and token are the
    /// slot's, armed or not, whatever its seq, wire_op, chunk and step.
    fn check_ping_semantics(&mut self, class: &str, f: &[u8], pinged: bool) {
        let should = self.well_formed_of_kind(f, PING) && {
            let c = self.before_ctl[le16(f, O_SLOT) as usize];
            le32(f, O_COMM) == c.comm_id && le32(f, O_TOKEN) == c.token
        };
        if pinged != should {
            self.mismatch(
                class,
                f,
                "SEMANTICS",
                format!("kernel answered a PING: {pinged}, erar_wire.h's rule says: {should}"),
            );
        }
    }

    /// The rule of erar_wire.h ("Barrier"), independent of the program's
    /// order of checks: a frame is taken as a READY (`ready`) iff it is a
    /// well-formed datapath frame of kind exactly ERAR_KIND_READY whose
    /// slot exists, whose comm_id and token are the slot's, on a ring of
    /// 2..=128 hosts, with a count in 1..=n or READY_ABORT, that tells more
    /// than the slot's `ready` word (a newer seq, or a larger count of the
    /// same seq; a count of the joined seq with another key tells
    /// READY_ABORT); it is passed on (`ready_fwd`) iff it is taken and its
    /// seq is the one the slot joined, armed or not. A query (step
    /// ERAR_READY_QUERY) is never taken, and is answered (counted as passed
    /// on here) iff it would be valid and its seq is the one joined; a READY
    /// of another step is malformed.
    fn check_ready_semantics(&mut self, class: &str, f: &[u8], taken: bool, passed: bool) {
        let well_formed = self.well_formed_of_kind(f, READY);
        let (should_take, should_pass) = if well_formed {
            let c: Ctl = self.before_ctl[le16(f, O_SLOT) as usize];
            let (seq, count, n) = (le32(f, O_SEQ), le32(f, O_CHUNK), c.ring_size);
            // join_seq 0 is "joined nothing" (seq 0 is reserved).
            let joined = c.join_seq == seq && seq != 0;
            let told = if joined && key_of(f) != c.key {
                READY_ABORT
            } else {
                count
            };
            let valid = le32(f, O_COMM) == c.comm_id
                && le32(f, O_TOKEN) == c.token
                && (2..=MAX_RING).contains(&n)
                && (count == READY_ABORT || (1..=n).contains(&count));
            match f[O_STEP] as u32 {
                0 => {
                    let take = valid && ready_newer(c.ready, ((seq as u64) << 32) | told as u64);
                    (take, take && joined)
                }
                wire::ERAR_READY_QUERY => (false, valid && joined),
                _ => (false, false),
            }
        } else {
            (false, false)
        };
        if (taken, passed) != (should_take, should_pass) {
            self.mismatch(
                class,
                f,
                "SEMANTICS",
                format!(
                    "kernel took / passed on a READY: {taken} / {passed}, erar_wire.h's rule says: \
                     {should_take} / {should_pass}"
                ),
            );
        }
    }

    /// Counter deltas and completion events since the last call.
    pub fn observe(&mut self) -> Result<Observed> {
        let now = stat_array(&self.dp.stats()?);
        let mut delta = [0u64; NR];
        for i in 0..NR {
            delta[i] = now[i].wrapping_sub(self.stats[i]);
        }
        self.stats = now;
        let mut events = Vec::new();
        for (s, st) in self.slots.iter_mut().enumerate() {
            events.extend(
                st.events
                    .take()
                    .into_iter()
                    .map(|(slot, seq)| (s as u32, slot, seq)),
            );
        }
        Ok((delta, events))
    }

    /// Runs one frame and checks everything. Returns the outcome labels.
    pub fn one(&mut self, class: &str, f: &[u8]) -> Result<(Verdict, [u64; NR])> {
        let target = self.before(f);
        let pred = self.model.run(f);
        let res = self.prog_run(f);
        let out = match res {
            Ok((_, len)) => self.out[..len.min(self.out.len())].to_vec(),
            Err(_) => Vec::new(),
        };
        let (delta, events) = self.observe()?;
        let v = self.check(
            class,
            f,
            target,
            &[pred],
            vec![(res, out)],
            delta,
            events,
            false,
        )?;
        Ok((v[0], delta))
    }

    /// Checks the runs of copies of frame `f` (results in any order) against
    /// the model's predictions for applying it that many times in a row.
    /// `mixed`: the second run was not of `f` but of a NACK for its chunk
    /// (results in the order of `preds`; no NACK semantics for `f`).
    #[allow(clippy::too_many_arguments)]
    pub fn check(
        &mut self,
        class: &str,
        f: &[u8],
        target: Option<usize>,
        preds: &[Prediction],
        mut results: Vec<Outcome>,
        delta: [u64; NR],
        events: Vec<Event>,
        mixed: bool,
    ) -> Result<Vec<Verdict>> {
        let mut verdicts = Vec::new();
        for (res, _) in &results {
            verdicts.push(match *res {
                Err(e) if e == libc::EINVAL => Verdict::Einval,
                Err(e) => bail!("BPF_PROG_RUN failed: errno {e} on a {}-byte frame", f.len()),
                Ok((XDP_DROP, _)) => Verdict::Drop,
                Ok((XDP_PASS, _)) => Verdict::Pass,
                Ok((XDP_TX, _)) => Verdict::Tx,
                Ok((other, _)) => {
                    self.mismatch(class, f, "retval", format!("unexpected retval {other}"));
                    Verdict::Drop
                }
            });
        }
        // Concurrent copies: match kernel results to the model's order.
        if results.len() == 2 && !mixed {
            let fits = |i: usize, p: &Prediction, v: &[Verdict], r: &[Outcome]| {
                v[i] == p.verdict && (v[i] == Verdict::Einval || r[i].1 == p.out)
            };
            if !(fits(0, &preds[0], &verdicts, &results) && fits(1, &preds[1], &verdicts, &results))
                && fits(1, &preds[0], &verdicts, &results)
                && fits(0, &preds[1], &verdicts, &results)
            {
                results.swap(0, 1);
                verdicts.swap(0, 1);
            }
        }
        let mut want = [0u64; NR];
        let mut want_events = Vec::new();
        for (i, p) in preds.iter().enumerate() {
            for (w, c) in want.iter_mut().zip(&p.ctr) {
                *w += c;
            }
            // Slot s's events come from slot s's ring buffer.
            want_events.extend(p.events.iter().map(|&(slot, seq)| (slot, slot, seq)));
            if verdicts[i] != p.verdict {
                self.mismatch(
                    class,
                    f,
                    "verdict",
                    format!("kernel {:?}, model {:?}", verdicts[i], p.verdict),
                );
            }
            if verdicts[i] != Verdict::Einval && results[i].1 != p.out {
                let out = &results[i].1;
                let first = out.iter().zip(&p.out).position(|(a, b)| a != b);
                self.mismatch(
                    class,
                    f,
                    "output frame",
                    format!(
                        "len {} vs {}, first difference at {first:?}",
                        out.len(),
                        p.out.len()
                    ),
                );
            }
        }
        // Model-free accounting: each datapath frame raises exactly one
        // terminal counter (drop) or tx / circulated / nack_served / ping /
        // ready_fwd (sent back out), or `ready` alone (a READY kept, not
        // joined: dropped, its job done); a tx, a circulated frame or an
        // AG_LAST drop follows exactly one acceptance, a served NACK, an answered PING or a READY
        // passed on none, and a READY passed on was taken (`ready`); an
        // abort is counted only for a READY taken or stale; others count
        // nothing. A REGION_ERR drop follows an acceptance when the frame
        // ended its trip and the next starting chunk's input was refused;
        // otherwise the frame's own chunk was (and no copy of it can then
        // be accepted: they all meet the same refusal, or a stage moved
        // by none of them; see `trip_ends_ok`).
        let terminal: u64 = TERMINAL.iter().map(|&i| delta[i as usize]).sum();
        let rx = delta[wire::ERAR_STAT_RX_RS as usize] + delta[wire::ERAR_STAT_RX_AG as usize];
        let tx = delta[wire::ERAR_STAT_TX as usize];
        let circulated = delta[wire::ERAR_STAT_CIRCULATED as usize];
        let served = delta[wire::ERAR_STAT_NACK_SERVED as usize];
        let pinged = delta[wire::ERAR_STAT_PING as usize];
        let taken = delta[wire::ERAR_STAT_READY as usize];
        let passed = delta[wire::ERAR_STAT_READY_FWD as usize];
        let queried = delta[wire::ERAR_STAT_READY_QUERY as usize];
        let aborts = delta[wire::ERAR_STAT_READY_ABORT as usize];
        let stale = delta[wire::ERAR_STAT_READY_STALE as usize];
        let n_drop = verdicts.iter().filter(|&&v| v == Verdict::Drop).count() as u64;
        let n_tx = verdicts.iter().filter(|&&v| v == Verdict::Tx).count() as u64;
        // The trips that ended: each acceptance is forwarded (tx,
        // circulated) or ends its frame's trip (AG_LAST, or REGION_ERR
        // when the next starting chunk's input was refused). A mixed
        // round's NACK accepts nothing and may add one REGION_ERR of its own.
        let ended = tx + circulated + delta[wire::ERAR_STAT_AG_LAST as usize];
        let region_err = delta[wire::ERAR_STAT_REGION_ERR as usize];
        let trip_ends_ok = match (rx, mixed) {
            (0, _) => ended == 0,
            (_, false) => rx == ended + region_err,
            (_, true) => rx >= ended && (region_err == rx - ended || region_err == rx - ended + 1),
        };
        let lin = &f[..f.len().min(LINEAR_MAX)];
        let quiet_ok = verdicts.iter().all(|&v| v != Verdict::Pass) || !is_datapath(lin);
        let acct_ok = passed <= taken
            && terminal + (taken - passed.min(taken)) == n_drop
            && tx + circulated + served + pinged + passed + queried == n_tx
            && aborts <= taken + stale
            && trip_ends_ok
            && (n_drop + n_tx > 0 || delta.iter().all(|&d| d == 0))
            && quiet_ok;
        if !acct_ok {
            self.mismatch(
                class,
                f,
                "ACCOUNTING",
                format!("{verdicts:?} with counter deltas {}", fmt_ctr(&delta)),
            );
        }
        if delta != want {
            self.mismatch(
                class,
                f,
                "counters",
                format!("kernel {} / model {}", fmt_ctr(&delta), fmt_ctr(&want)),
            );
        }
        // Ring buffers are read one after the other: only the order within
        // one is kept.
        let mut events = events;
        events.sort_by_key(|e| e.0);
        want_events.sort_by_key(|e: &Event| e.0);
        if events != want_events {
            self.mismatch(
                class,
                f,
                "events",
                format!("kernel {events:?}, model {want_events:?} (ring buffer's slot, slot, seq)"),
            );
        }

        // Corruption: the kernel's state must be exactly the model's. If the
        // kernel rejected a frame the model accepted (reported above), the
        // kernel's state must be the state before the frame.
        let accepted = rx > 0;
        self.check_semantics(class, f, target, accepted, (!mixed).then_some(served > 0));
        self.check_ping_semantics(class, f, pinged > 0);
        // A query answered counts as passed on there.
        self.check_ready_semantics(class, f, taken > 0, passed + queried > 0);
        let model_accepted =
            want[wire::ERAR_STAT_RX_RS as usize] + want[wire::ERAR_STAT_RX_AG as usize] > 0;
        if !accepted && model_accepted {
            if let (Some(idx), Some(w)) = (target, self.before_word) {
                let cps = self.model.cps;
                let at = self.model.written_at(idx / cps, idx % cps);
                self.model.buf[at].copy_from_slice(&self.before_chunk);
                self.model.state[idx] = w;
                for s in 0..SLOTS {
                    self.model.ctl[s].done = self.before_ctl[s].done;
                }
            }
        }
        self.check_state(class, f, accepted || taken > 0);
        Ok(verdicts)
    }

    /// The kernel's slot buffers, regions, chunk-state words and slot_ctls
    /// must be the model's (`changed`: the frame was meant to change them); where
    /// they are not (reported), the model takes the kernel's.
    pub fn check_state(&mut self, class: &str, f: &[u8], changed: bool) {
        let what = if changed {
            "effect of an accepted frame"
        } else {
            "CORRUPTION by a rejected frame"
        };
        if let Some(first) = self.buf_diff() {
            let (slot, chunk) = (
                first / self.dp.slot_bytes(),
                first % self.dp.slot_bytes() / self.model.cb,
            );
            self.mismatch(
                class,
                f,
                what,
                format!("slot buffer differs from slot {slot} chunk {chunk} (byte {first})"),
            );
            self.sync_buf();
        }
        if let Some((k, at)) = self.region_diff() {
            self.mismatch(
                class,
                f,
                what,
                format!("region {k} differs at byte {at} of its windows"),
            );
            self.sync_regions();
        }
        let rs = self.real_state();
        if rs != self.model.state {
            let diffs: Vec<String> = rs
                .iter()
                .zip(&self.model.state)
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .map(|(i, (a, b))| format!("[{i}] kernel {a:#x} model {b:#x}"))
                .collect();
            self.mismatch(class, f, what, format!("chunk_state: {}", diffs.join(", ")));
            self.model.state = rs;
        }
        // What XDP writes in a slot_ctl (`done`, `start_next`, the
        // barrier's `ready` and its key) is the model's; everything else is
        // what setup and the joins left.
        let mut want_ctl = self.ctl_snapshot.clone();
        for s in 0..SLOTS {
            let (at, c) = (s * CTL_SIZE, &self.model.ctl[s]);
            let o = at + DONE_OFF;
            want_ctl[o..o + 4].copy_from_slice(&c.done.to_ne_bytes());
            let o = at + START_NEXT_OFF;
            want_ctl[o..o + 4].copy_from_slice(&c.start_next.to_ne_bytes());
            let o = at + READY_OFF;
            want_ctl[o..o + 8].copy_from_slice(&c.ready.to_ne_bytes());
            for (i, w) in c.ready_key.iter().enumerate() {
                let o = at + READY_KEY_OFF + 4 * i;
                want_ctl[o..o + 4].copy_from_slice(&w.to_ne_bytes());
            }
        }
        let real_ctl = self.real_ctl_bytes();
        if real_ctl != want_ctl {
            let real: Vec<(u32, u64)> = (0..SLOTS)
                .map(|s| {
                    let c = self.real_ctl(s);
                    (c.done, c.ready)
                })
                .collect();
            self.mismatch(
                class,
                f,
                what,
                format!("slot_ctl differs ((done, ready): kernel {real:x?})"),
            );
            for s in 0..SLOTS {
                let real = self.real_ctl(s);
                let c = &mut self.model.ctl[s];
                (c.done, c.ready, c.ready_key) = (real.done, real.ready, real.ready_key);
                c.start_next = real.start_next;
            }
            self.ctl_snapshot = real_ctl;
        }
    }
}
