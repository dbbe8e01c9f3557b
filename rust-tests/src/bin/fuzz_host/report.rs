//! The report of the main phase: what every frame did, tallied by class and
//! outcome, then printed as the counter table, coverage lines and the
//! `RESULT` line.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{ensure, Result};
use liberar::datapath::wire;

use crate::counters::{stat_name, NR, TERMINAL};
use crate::frames::{
    CLASSES, C_NACK, C_NACK_MISS, C_PING, C_PING_BAD, C_PING_UNCONF, C_READY, C_READY_BAD,
};
use crate::layout::{
    be16, hex, ipv4_csum, le16, le32, HDR, LINEAR_MAX, MAGIC, NACK, OP_BCAST, O_CHUNK, O_KIND,
    O_MAGIC, O_OP, O_RESERVED, O_SEQ, O_SLOT, O_STEP, PING, PL, PONG, READY, READY_ABORT, RS,
    UDP_PORT,
};
use crate::model::{udp_to_port_not_datapath, Verdict};
use crate::runner::Fuzzer;

/// The counter table's columns (after `frames`), in print order.
const COLS: [&str; 33] = [
    "einval",
    "pass",
    "drop_short",
    "drop_magic",
    "drop_version",
    "drop_malformed",
    "drop_slot",
    "drop_seq",
    "drop_comm",
    "drop_token",
    "drop_op",
    "drop_chunk",
    "drop_step",
    "dup",
    "drop_state",
    "ag_last",
    "nack_skip",
    "ready_stale",
    "region_err",
    "tx",
    "circulated",
    "nack_served",
    "ping",
    "ready_fwd",
    "ready",
    "ready_abort",
    "ready_learned",
    "ready_query",
    "rx_rs",
    "payload_copied",
    "rx_ag",
    "finished",
    "complete",
];

/// What the main phase's frames did.
pub struct Tally {
    /// class -> outcome label -> frames
    table: Vec<BTreeMap<&'static str, u64>>,
    per_class: [u64; CLASSES.len()],
    pass: u64,
    einval: u64,
    datapath: u64,
    accepted: u64,
    /// Frames applied on a slot armed with an output region, NACKs
    /// answered on one armed with any (see regions.rs).
    region_applied: u64,
    region_served: u64,
    /// Coverage: lengths 0..=4000 seen; frames spilling into fragments (by
    /// verdict); accepted frames by (kind, op).
    lengths: Vec<bool>,
    frags: BTreeMap<String, u64>,
    by_op: BTreeMap<String, u64>,
    /// Served NACKs by the frame they were answered with.
    nack_by_op: BTreeMap<String, u64>,
    /// Datapath frames of kind PING / PONG by outcome ("answered" or the
    /// counter that dropped them); answered PINGs a prober would not send.
    ping_outcomes: BTreeMap<&'static str, u64>,
    pong_outcomes: BTreeMap<&'static str, u64>,
    ping_oddities: BTreeMap<&'static str, u64>,
    ping_by_slot: BTreeMap<&'static str, u64>,
    /// Datapath frames of kind READY: how many, by outcome ("passed on",
    /// "kept" or the counter that dropped them), and taken ones by the
    /// slot's state; passed on although no sender builds them: (count,
    /// first frame's headers and key, the slot before it).
    ready_frames: u64,
    ready_outcomes: BTreeMap<&'static str, u64>,
    ready_by_slot: BTreeMap<&'static str, u64>,
    ready_oddities: BTreeMap<&'static str, (u64, String)>,
    oddities: BTreeMap<&'static str, u64>,
    /// PASSed frames that are UDP to ERAR_UDP_PORT all the same: (count,
    /// first frame), by why they are not datapath frames.
    passed_to_port: BTreeMap<&'static str, (u64, String)>,
}

impl Tally {
    pub fn new() -> Tally {
        Tally {
            table: vec![BTreeMap::new(); CLASSES.len()],
            per_class: [0u64; CLASSES.len()],
            pass: 0,
            einval: 0,
            datapath: 0,
            accepted: 0,
            region_applied: 0,
            region_served: 0,
            lengths: vec![false; 4001],
            frags: BTreeMap::new(),
            by_op: BTreeMap::new(),
            nack_by_op: BTreeMap::new(),
            ping_outcomes: BTreeMap::new(),
            pong_outcomes: BTreeMap::new(),
            ping_oddities: BTreeMap::new(),
            ping_by_slot: BTreeMap::new(),
            ready_frames: 0,
            ready_outcomes: BTreeMap::new(),
            ready_by_slot: BTreeMap::new(),
            ready_oddities: BTreeMap::new(),
            oddities: BTreeMap::new(),
            passed_to_port: BTreeMap::new(),
        }
    }

    /// Tallies frame `f` of `class`, which got `verdict` and counter deltas
    /// `delta`; a datapath frame with the magic also goes to the
    /// generator's history (for "replay").
    pub fn record(
        &mut self,
        fz: &mut Fuzzer,
        class: usize,
        f: &[u8],
        verdict: Verdict,
        delta: &[u64; NR],
    ) {
        self.per_class[class] += 1;
        if let Some(l) = self.lengths.get_mut(f.len()) {
            *l = true;
        }
        if f.len() > LINEAR_MAX {
            let k = if delta[wire::ERAR_STAT_RX_RS as usize] + delta[wire::ERAR_STAT_RX_AG as usize]
                > 0
            {
                "accepted".to_string()
            } else {
                format!("{verdict:?}")
            };
            *self.frags.entry(k).or_default() += 1;
        }
        if delta[wire::ERAR_STAT_NACK_SERVED as usize] > 0 {
            let kind = if f[O_KIND] == NACK | RS { "RS" } else { "AG" };
            let op = if f[O_OP] as u32 == OP_BCAST {
                "bcast".to_string()
            } else {
                "allreduce".to_string()
            };
            *self
                .nack_by_op
                .entry(format!("{kind}/{op}/step{}", f[O_STEP].min(3)))
                .or_default() += 1;
        }
        if delta[wire::ERAR_STAT_RX_RS as usize] + delta[wire::ERAR_STAT_RX_AG as usize] > 0 {
            let kind = if f[O_KIND] == RS { "RS" } else { "AG" };
            let op = if f[O_OP] as u32 == OP_BCAST {
                "bcast".to_string()
            } else {
                format!("op{}", f[O_OP])
            };
            *self.by_op.entry(format!("{kind}/{op}")).or_default() += 1;
            // Accepted although not as a sender builds it (see the report).
            let cbu = fz.model.cb;
            for (what, odd) in [
                ("reserved!=0", le32(f, O_RESERVED) != 0),
                ("trailing bytes", f.len() > PL + cbu),
                (
                    "IPv4 total length wrong",
                    be16(f, 16) as usize != 20 + 8 + HDR + cbu,
                ),
                ("UDP length wrong", be16(f, 38) as usize != 8 + HDR + cbu),
                ("IPv4 checksum wrong", ipv4_csum(&f[14..34]) != 0),
                ("group dst MAC", f[0] & 1 != 0),
            ] {
                if odd {
                    *self.oddities.entry(what).or_default() += 1;
                }
            }
        }
        let row = &mut self.table[class];
        match verdict {
            Verdict::Einval => {
                self.einval += 1;
                *row.entry("einval").or_default() += 1;
            }
            Verdict::Pass => {
                self.pass += 1;
                *row.entry("pass").or_default() += 1;
                if let Some(why) = udp_to_port_not_datapath(f) {
                    let e = self
                        .passed_to_port
                        .entry(why)
                        .or_insert((0, hex(&f[..f.len().min(PL + 16)])));
                    e.0 += 1;
                }
            }
            _ => {
                self.datapath += 1;
                if f.len() >= PL && le32(f, O_MAGIC) == MAGIC {
                    fz.gen.remember(f);
                }
                if f.len() > O_KIND && (f[O_KIND] == PING || f[O_KIND] == PONG) {
                    let outcome = if delta[wire::ERAR_STAT_PING as usize] > 0 {
                        "answered"
                    } else {
                        (0..NR)
                            .find(|&k| delta[k] != 0 && TERMINAL.contains(&(k as u32)))
                            .map_or("?", stat_name)
                    };
                    let m = if f[O_KIND] == PING {
                        &mut self.ping_outcomes
                    } else {
                        &mut self.pong_outcomes
                    };
                    *m.entry(outcome).or_default() += 1;
                }
                if delta[wire::ERAR_STAT_PING as usize] > 0 {
                    let c = fz.before_ctl[le16(f, O_SLOT) as usize];
                    let state = match (c.ring_size, c.seq()) {
                        (0, _) => "unconfigured",
                        (_, None) => "unarmed",
                        (_, Some(_)) => "armed",
                    };
                    *self.ping_by_slot.entry(state).or_default() += 1;
                    for (what, odd) in [
                        ("group dst MAC (the answer's source)", f[0] & 1 != 0),
                        ("IPv4 checksum wrong", ipv4_csum(&f[14..34]) != 0),
                        (
                            "UDP source port the datapath's (answer dropped there)",
                            be16(f, 34) == UDP_PORT,
                        ),
                        ("slot unconfigured (comm_id 0, token 0)", c.ring_size == 0),
                    ] {
                        if odd {
                            *self.ping_oddities.entry(what).or_default() += 1;
                        }
                    }
                }
                for (k, &d) in delta.iter().enumerate() {
                    if d != 0 {
                        *row.entry(stat_name(k)).or_default() += d;
                    }
                }
                if f.len() > O_KIND && f[O_KIND] == READY {
                    self.record_ready(fz, f, delta);
                }
                let applied = delta[wire::ERAR_STAT_RX_RS as usize]
                    + delta[wire::ERAR_STAT_RX_AG as usize]
                    > 0;
                let served = delta[wire::ERAR_STAT_NACK_SERVED as usize] > 0;
                if applied {
                    self.accepted += 1;
                }
                if applied || served {
                    let c = fz.before_ctl[le16(f, O_SLOT) as usize];
                    self.region_applied += u64::from(applied && c.out_region != 0);
                    self.region_served +=
                        u64::from(served && (c.in_region != 0 || c.out_region != 0));
                }
            }
        }
    }

    /// Tallies a datapath frame of kind READY by outcome: passed on (with
    /// a count below n, the count that passes this host, or an abort),
    /// kept (not joined), or dropped for a reason; taken ones by whether
    /// the slot was armed / joined.
    fn record_ready(&mut self, fz: &Fuzzer, f: &[u8], delta: &[u64; NR]) {
        self.ready_frames += 1;
        let (taken, passed) = (
            delta[wire::ERAR_STAT_READY as usize] > 0,
            delta[wire::ERAR_STAT_READY_FWD as usize] > 0,
        );
        let aborted = delta[wire::ERAR_STAT_READY_ABORT as usize] > 0;
        let outcome = if passed {
            let c = fz.before_ctl[le16(f, O_SLOT) as usize];
            let count = le32(f, O_CHUNK);
            if aborted || count == READY_ABORT {
                "passed on: abort"
            } else if count + 1 >= c.ring_size {
                "passed on: n (this host passes)"
            } else {
                "passed on: count+1 < n"
            }
        } else if taken {
            "kept (not joined)"
        } else {
            (0..NR)
                .find(|&k| delta[k] != 0 && TERMINAL.contains(&(k as u32)))
                .map_or("?", stat_name)
        };
        *self.ready_outcomes.entry(outcome).or_default() += 1;
        if aborted {
            *self.ready_outcomes.entry("(keys differ)").or_default() += 1;
        }
        if taken {
            let c = fz.before_ctl[le16(f, O_SLOT) as usize];
            let state = match (c.seq(), c.join_seq != 0) {
                (Some(_), true) => "armed, joined before",
                (Some(_), false) => "armed, never joined",
                (None, true) => "unarmed, joined before",
                (None, false) => "unarmed, never joined",
            };
            *self.ready_by_slot.entry(state).or_default() += 1;
            if passed && le32(f, O_SEQ) == 0 {
                // join_seq 0 is "none" (configure_slot), and seq 0 is
                // reserved (arm refuses it), yet it reads as joined.
                let e = self
                    .ready_oddities
                    .entry("seq 0 to a slot whose join_seq is 0 (never joined)")
                    .or_insert_with(|| {
                        let head = hex(&f[..f.len().min(PL + 16)]);
                        (
                            0,
                            format!(
                                "{head} (slot n {} key {:x?} ready {:#x})",
                                c.ring_size, c.key, c.ready
                            ),
                        )
                    });
                e.0 += 1;
            }
        }
    }

    /// Prints the table, one row per class, one column per outcome, and
    /// checks that no class hit a counter outside it. Returns the column
    /// totals.
    fn print_table(&self, frames: u64) -> Result<BTreeMap<&'static str, u64>> {
        let short = |c: &str| {
            c.trim_start_matches("drop_")
                .chars()
                .take(7)
                .collect::<String>()
        };
        let mut hdr = format!("{:<11}{:>8}", "class", "frames");
        for c in COLS {
            hdr += &format!("{:>8}", short(c));
        }
        println!("counter table (columns after `frames`: frames that raised each counter; drop_* shown without the prefix):");
        println!("{hdr}");
        let mut totals = BTreeMap::<&str, u64>::new();
        for (k, row) in self.table.iter().enumerate() {
            let mut line = format!("{:<11}{:>8}", CLASSES[k], self.per_class[k]);
            for c in COLS {
                let v = row.get(c).copied().unwrap_or(0);
                *totals.entry(c).or_default() += v;
                line += &format!("{v:>8}");
            }
            println!("{line}");
        }
        let mut line = format!("{:<11}{:>8}", "TOTAL", frames);
        for c in COLS {
            line += &format!("{:>8}", totals.get(c).copied().unwrap_or(0));
        }
        println!("{line}");
        for (k, row) in self.table.iter().enumerate() {
            for c in row.keys() {
                ensure!(
                    COLS.contains(c),
                    "class {} hit unexpected counter {c}",
                    CLASSES[k]
                );
            }
        }
        Ok(totals)
    }

    /// Prints the coverage lines: lengths and fragments, accepted frames by
    /// kind/op, NACKs and PINGs by class and outcome, and the frames
    /// accepted, answered or passed although no sender builds them. Returns
    /// the PINGs dropped for a wrong comm_id and for a wrong token.
    fn print_coverage(
        &self,
        nack_served: u64,
        nack_skip: u64,
        ping: u64,
        root_oob_accepts: u64,
    ) -> (u64, u64) {
        let (frags, by_op, nack_by_op) = (&self.frags, &self.by_op, &self.nack_by_op);
        let (ping_outcomes, pong_outcomes) = (&self.ping_outcomes, &self.pong_outcomes);
        let (ping_oddities, ping_by_slot) = (&self.ping_oddities, &self.ping_by_slot);
        let (oddities, per_class) = (&self.oddities, &self.per_class);
        println!(
            "coverage: {} of the lengths 0..=4000; {} frames longer than the linear part ({LINEAR_MAX} B, rest in fragments): {frags:?}",
            self.lengths.iter().filter(|&&b| b).count(),
            frags.values().sum::<u64>()
        );
        println!("accepted frames by kind/wire_op: {by_op:?}");
        let nack_class = |c: usize, k: &str| self.table[c].get(k).copied().unwrap_or(0);
        println!(
            "NACKs: {nack_served} served, {nack_skip} skipped (class nack: {} served / {} skipped of {}; \
             nack-miss: {} served / {} skipped of {}); served by kind/op/step: {nack_by_op:?}",
            nack_class(C_NACK, "nack_served"),
            nack_class(C_NACK, "nack_skip"),
            per_class[C_NACK],
            nack_class(C_NACK_MISS, "nack_served"),
            nack_class(C_NACK_MISS, "nack_skip"),
            per_class[C_NACK_MISS],
        );
        let ping_out = |k: &str| ping_outcomes.get(k).copied().unwrap_or(0);
        let (ping_drop_comm, ping_drop_token) = (ping_out("drop_comm"), ping_out("drop_token"));
        println!(
            "PINGs: {ping} answered (class ping: {} answered / {} dropped of {}; ping-bad: {} / {} of {}; \
             ping-unconf: {} / {} of {}); answered by slot: {ping_by_slot:?}; datapath frames of kind PING by outcome: {ping_outcomes:?}; \
             of kind PONG: {pong_outcomes:?}",
            nack_class(C_PING, "ping"),
            per_class[C_PING] - nack_class(C_PING, "ping"),
            per_class[C_PING],
            nack_class(C_PING_BAD, "ping"),
            per_class[C_PING_BAD] - nack_class(C_PING_BAD, "ping"),
            per_class[C_PING_BAD],
            nack_class(C_PING_UNCONF, "ping"),
            per_class[C_PING_UNCONF] - nack_class(C_PING_UNCONF, "ping"),
            per_class[C_PING_UNCONF],
        );
        println!(
            "answered PINGs a prober would not send (not validated by erar_xdp): {ping_oddities:?}"
        );
        println!(
            "accepted frames of broadcasts armed with root >= ring size (unspecified): {}",
            root_oob_accepts
        );
        println!(
            "accepted frames a sender would not build (not validated by erar_xdp): {oddities:?}"
        );
        for (why, (n, ex)) in &self.passed_to_port {
            println!("passed uncounted, UDP to port {UDP_PORT} but {why}: {n} frames, e.g. {ex}");
        }
        (ping_drop_comm, ping_drop_token)
    }

    /// Prints the READY coverage lines: frames by class and outcome, taken
    /// ones by the slot's state, the joins and the inject path's runs.
    fn print_ready(&self, fz: &Fuzzer) {
        let of = |c: usize, k: &str| self.table[c].get(k).copied().unwrap_or(0);
        println!(
            "READYs: {} datapath frames of kind READY (class ready: {} taken / {} passed on of {}; \
             ready-bad: {} / {} of {}); by outcome: {:?}; taken by slot: {:?}",
            self.ready_frames,
            of(C_READY, "ready"),
            of(C_READY, "ready_fwd"),
            self.per_class[C_READY],
            of(C_READY_BAD, "ready"),
            of(C_READY_BAD, "ready_fwd"),
            self.per_class[C_READY_BAD],
            self.ready_outcomes,
            self.ready_by_slot,
        );
        for (what, (n, ex)) in &self.ready_oddities {
            println!(
                "READYs passed on that no sender builds (not refused by erar_xdp), {what}: {n} frames, e.g. {ex}"
            );
        }
        let b = &fz.barrier;
        println!(
            "joins (HostDatapath::join, each one ERAR_INJECT_READY run): {} by state {:?}; \
             inject path runs in mode READY: {} by outcome {:?}",
            b.joins, b.by_state, b.inject_runs, b.inject_outcomes
        );
    }
}

/// The end of the run's output: the counter table, the accounting of every
/// frame over the whole run (a mismatch if it does not add up), the
/// coverage lines and the `RESULT` line (`race`: the race phase's fields).
pub fn report(
    fz: &mut Fuzzer,
    t: &Tally,
    frames: u64,
    wall: f64,
    run_time: Duration,
    race: &str,
) -> Result<()> {
    let (pass, einval, datapath, accepted) = (t.pass, t.einval, t.datapath, t.accepted);
    let totals = t.print_table(frames)?;
    // Every frame accounted for exactly once, over the whole run.
    let terminal: u64 = TERMINAL
        .iter()
        .map(|&i| totals.get(stat_name(i as usize)).copied().unwrap_or(0))
        .sum();
    let tx =
        totals.get("tx").copied().unwrap_or(0) + totals.get("circulated").copied().unwrap_or(0);
    let nack_served = totals.get("nack_served").copied().unwrap_or(0);
    let nack_skip = totals.get("nack_skip").copied().unwrap_or(0);
    let ping = totals.get("ping").copied().unwrap_or(0);
    // A READY taken is either passed on (TX) or kept (DROP, no reason); a
    // query answered is TX.
    let ready = totals.get("ready").copied().unwrap_or(0);
    let query = totals.get("ready_query").copied().unwrap_or(0);
    if terminal + tx + nack_served + ping + ready + query != datapath
        || pass + einval + datapath != frames
    {
        println!(
            "ACCOUNTING TOTALS: datapath {datapath}, terminal {terminal} + tx {tx} + nack_served {nack_served} + ping {ping} \
             + ready {ready} + query {query}; pass {pass} einval {einval} frames {frames}"
        );
        fz.mismatches += 1;
    }
    let (ping_drop_comm, ping_drop_token) =
        t.print_coverage(nack_served, nack_skip, ping, fz.root_oob_accepts);
    t.print_ready(fz);
    let col = |k: &str| totals.get(k).copied().unwrap_or(0);
    let ready_fwd = col("ready_fwd");
    let b = &fz.barrier;
    let inject_sent = b.inject_outcomes.get("ready_sent").copied().unwrap_or(0);
    println!(
        "RESULT frames={frames} datapath={datapath} pass={pass} einval={einval} accepted={accepted} \
         ag_last={} circulated={} nack_served={nack_served} nack_skip={nack_skip} \
         region_applied={} region_served={} region_err={} ping={ping} \
         ping_drop_comm={ping_drop_comm} ping_drop_token={ping_drop_token} \
         ready_frames={} ready={ready} ready_fwd={ready_fwd} ready_kept={} ready_stale={} \
         ready_abort={} joins={} inject_runs={} inject_ready_sent={inject_sent} \
         rate={:.0} run_rate={:.0} {race} mismatches={}",
        col("ag_last"),
        col("circulated"),
        t.region_applied,
        t.region_served,
        col("region_err"),
        t.ready_frames,
        ready - ready_fwd.min(ready),
        col("ready_stale"),
        col("ready_abort"),
        b.joins,
        b.inject_runs,
        frames as f64 / wall,
        frames as f64 / run_time.as_secs_f64(),
        fz.mismatches
    );
    Ok(())
}
