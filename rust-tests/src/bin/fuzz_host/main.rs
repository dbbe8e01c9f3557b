//! The XDP frame-parser fuzzer of `tests/fuzz_xdp.rs` (issue #4, item 6).
//! Run inside a private network namespace (`ip netns exec fuzz-… fuzz_host
//! …`): it attaches the kernel datapath to IFNAME, configures and arms the
//! slots with known contents, and pushes FRAMES generated frames through
//! `erar_xdp` with BPF_PROG_RUN in normal (non-live) mode, one frame per
//! call, with an `xdp_md` context whose `ingress_ifindex` is IFNAME's, so
//! the program takes its RECEIVE path (without a context it would run "on"
//! the loopback device and take its inject path).
//!
//! Every frame is checked against a model of the receive path, in plain
//! Rust (its own element-wise reductions, no SWAR), which predicts the exact
//! drop reason (so it follows the program's order of checks) and holds its
//! own copy of every slot buffer, chunk-state word, `done` counter and armed
//! operation:
//!
//! * verdict (XDP_PASS / XDP_DROP / XDP_TX, or EINVAL for frames shorter
//!   than an Ethernet header, which the kernel refuses) and output frame;
//! * the delta of EVERY counter of [`HostDatapath::stats`];
//! * accounting, model-free: a PASS counts nothing and is not a datapath
//!   frame; a DROP raises exactly one terminal counter (a `drop_*` reason,
//!   `dup`, `ag_last`, `nack_skip` or `ready_stale`) by one, or `ready`
//!   alone (a READY kept, not joined); a TX raises either `tx` and `rx_rs`
//!   or `rx_ag` (a data frame forwarded), or `nack_served` alone (a NACK
//!   answered), or `ping` alone (a PING answered: not `tx`), or `ready`
//!   and `ready_fwd` (a READY passed on), and no terminal counter; so
//!   tx + nack_served + ping + ready_fwd = TX verdicts (`ready_abort` may
//!   come with a READY taken or stale);
//! * corruption: after every frame, for every slot, the whole slot buffer,
//!   every chunk-state word and the slot_ctl must equal the model (a frame
//!   that was not accepted must leave them untouched; an accepted one must
//!   have exactly the RS reduce-with-writeback / AG store effect). They are
//!   read from the slot's own inner maps (`slot_buf`, `chunk_state`,
//!   `slot_ctl`), found through the program's arrays of maps (`slot_bufs`,
//!   `chunk_states`, `slot_ctls`: a lookup of the slot gives the inner map's
//!   id) and mmapped read-only by this process; the ids must stay the ones
//!   installed at attach, and no two slots may share a map;
//! * completion events (each slot's own ring buffer, the inner map of
//!   `slot_events`; every slot's is consumed after every frame): exactly the
//!   predicted (slot, seq), in the ring buffer of that slot;
//! * semantics, from docs/datapath.md alone ([`docs_expect`]): a frame is
//!   applied iff it is a well-formed frame of the armed operation whose
//!   (kind, step) is the one this host's ring position receives in the
//!   chunk's current stage; a NACK (kind `0x80 | k`) is never applied, and
//!   it is answered iff it is well-formed, of the armed operation, and
//!   names (k, step) of the frame this host last sent for the chunk
//!   ([`docs_last_sent`]); a PING is answered iff it is well-formed, its
//!   slot exists and its comm_id and token are the slot's (erar_wire.h);
//!   a READY is taken iff it is well-formed, of the slot's ring (comm_id,
//!   token, 2..=128 hosts), its count valid, and it tells more than the
//!   slot's `ready` word, and passed on iff taken and of the joined seq
//!   ("Barrier" in erar_wire.h).
//!
//! NACK frames (kind `ERAR_KIND_NACK | k`, full-sized, sent by the successor
//! for the (k, step) frame of a chunk it misses) pass the same validations
//! as data frames, in the same order; then the model answers one whose
//! (k, step) is the frame this host last sent for the chunk (from the
//! chunk's stage) with exactly that frame: kind k, Ethernet/IPv4/UDP from
//! the slot's template (to the next host), payload the slot buffer's chunk,
//! XDP_TX and `nack_served`. Any other NACK (also one whose low kind bits
//! are neither RS nor AG) is dropped with `nack_skip`. A NACK never changes
//! a chunk's stage, the slot buffer, `done` or the events. The classes
//! `nack` (NACKs that name the frame last sent, so they are served) and
//! `nack-miss` (NACKs of another kind/step, of a chunk not sent yet, with
//! bad kind bits, ...) make them; the mutating classes start from a NACK
//! now and then; `replay` repeats them.
//!
//! PING frames (kind exactly `ERAR_KIND_PING`, a liveness probe sent by a
//! rank's UDP socket) pass the same validations as data frames up to the
//! slot index; then, BEFORE the armed/seq check (so armed or not, any seq,
//! wire_op, chunk, step, payload), a comm_id other than the slot's is
//! dropped with `drop_comm`, then a token other than the slot's with
//! `drop_token`; any other PING is turned back: Ethernet destination and
//! source, IPv4 source and destination and UDP source and destination port
//! swapped, UDP checksum 0, kind `ERAR_KIND_PONG`, every other byte as it
//! came; XDP_TX and `ping` (not `tx`). It never changes a chunk's stage,
//! the slot buffer, `done` or the events. A PONG-kind frame is not special
//! on receipt: it takes the data path (and is dropped as an unknown kind).
//! The classes `ping` (PINGs of a slot's ring, as liveness.rs builds them
//! or with any seq/op/chunk/step, to armed and unarmed slots, the unarmed
//! ones more often) and `ping-bad` (wrong comm_id / token, another slot's
//! identity, slot out of range, PONG kind, PING with more kind bits) make
//! them; the mutating classes start from a PING now and then; `replay`
//! repeats them. The first frames of a run (class `ping-unconf`: PINGs,
//! bad PINGs, READYs and data frames) go to slots never configured
//! (comm_id and token 0).
//!
//! READY frames (kind exactly `ERAR_KIND_READY`, a barrier count from the
//! successor, see "Barrier" in erar_wire.h) pass the same validations as
//! data frames up to the slot index; then, BEFORE the armed check, a
//! comm_id other than the slot's is dropped with `drop_comm`, a token with
//! `drop_token`, a ring of fewer than 2 or more than 128 hosts or a count
//! (`chunk`) other than 1..=n or `ERAR_READY_ABORT` with `drop_malformed`;
//! if its seq is the slot's `join_seq` and its key (payload words 0..4) is
//! not the slot's `key`, its count becomes the abort (`ready_abort`); a
//! word (seq << 32 | count) that does not tell more than the slot's
//! `ready` (a newer seq in 32-bit serial arithmetic, or a larger count of
//! the same seq) is dropped with `ready_stale`; else it and the key are
//! kept in `ready` / `ready_key` (`ready`), and if the seq is not joined
//! the frame is dropped (counted by `ready` alone); if it is, it goes back
//! out to the predecessor: Ethernet/IPv4/UDP from the slot's NACK
//! template, kind READY, step and wire_op 0, seq `join_seq`, chunk
//! min(count + 1, n) or the abort, the payload as it came; XDP_TX and
//! `ready_fwd`, and an event (slot, seq) when count + 1 >= n or it
//! aborts. It never changes a chunk's stage, the slot buffer or `done`.
//! The classes `ready` (of a slot's ring, of the joined seq mostly, with a
//! count that tells more, the joined key mostly) and `ready-bad` (bad
//! counts, identity or slot, differing keys, stale words, more kind bits)
//! make them; the mutating classes start from a READY now and then;
//! `replay` repeats them. The ranks join (`HostDatapath::join`, as user
//! space does: key and `join_seq` written, `ready` read, the predecessor
//! told with one `ERAR_INJECT_READY` run of the inject path) after most
//! setups and now and then between frames, with the operation's key or
//! another one: the state join returns, the count it told, `ready_sent`
//! and the slot_ctl are checked; and after each join a few runs of the
//! inject path in that mode (BPF_PROG_RUN "on" the loopback device, its
//! output frame read back) must give exactly the READY the model builds
//! (the NACK template, `join_seq`, `inject_count`, the key in the first
//! payload words, the rest of the page as it came, a page of linear chunks
//! shorter than a frame grown to one with zeros; `ready_sent`), or
//! `inject_err` for a page too short for the headers (or, jumbo, the key),
//! another token or a slot out of range.
//!
//! Registered buffers (regions, `regions`): two region maps made as
//! liberar's kernel/region.rs makes them, one of the smallest size class
//! and one of the largest, are installed in their classes' arrays
//! (`regions_1m` entry 0, `regions_64m` entry 3), and a third of the
//! operations are armed with an input region, an output region or both
//! (`arm_reading`), naming those, an empty entry, a class with none or one
//! past the last class, at an offset
//! within the head's next page mostly, now and then one that puts the
//! first or the last chunks outside the region; the head's token is the
//! slot's mostly, another now and then. The model reads an RS frame's
//! contribution from the input region and keeps the combine in the output
//! region (both or neither, of one class), stores AG payloads in the output region,
//! answers NACKs and starts circulating frames from the input (nothing
//! received yet) or the output, and drops with `region_err` a frame whose
//! region is refused ([`Model::docs_region_ok`] is the docs' rule); both
//! regions' reachable bytes are compared after every frame, like the slot
//! buffers.
//!
//! The slots are re-armed (new seq, new random contents) every few hundred
//! frames and soon after an operation completes, and re-configured as a new
//! ring (ring sizes 1..128, any position, colliding comm_ids, token 0, ...)
//! now and then, so stale and future seqs, other rings' frames and frames
//! for disarmed slots keep coming.
//!
//! Then RACE_ROUNDS rounds of a race phase: the same frame (mostly one the
//! host accepts) runs on both CPUs at once, main thread and a pinned worker
//! released by one store; the model applies it twice in a row, and whichever
//! copy wins, counters, outputs and state must match that. In a quarter of
//! the rounds a valid data frame races instead with a NACK for the same
//! chunk, naming the frame last sent before or after the data frame's
//! stage change: the data frame must have exactly its effect, and the NACK
//! must be answered with the frame last sent before (payload: the chunk as
//! it was) or after (the chunk as the data frame left it) — a payload that
//! matches the (kind, step) it is labelled with — or dropped with
//! `nack_skip` (it met the chunk mid-change: `busy`, or its copy was
//! overtaken, every payload byte then old or new).
//!
//! After a mismatch the model re-syncs from the kernel and fuzzing goes on;
//! the first mismatches are printed with the exact frame. Output ends with a
//! per-class counter table, coverage lines and a line
//! `RESULT frames=… datapath=… pass=… einval=… accepted=… nack_served=…
//! nack_skip=… ping=… ping_drop_comm=… ping_drop_token=… ready_frames=…
//! ready=… ready_fwd=… ready_kept=… ready_stale=… ready_abort=… joins=…
//! inject_runs=… inject_ready_sent=… rate=… … mismatches=…` (ping_drop_*:
//! kind-PING frames dropped for that reason; ready_frames: datapath frames
//! of kind READY); the exit status is 0 only without mismatches.
//!
//! Arguments: IFNAME CHUNK_BYTES CHUNKS_PER_SLOT FRAMES SEED [RACE_ROUNDS].
//!
//! Modules: `args` (the command line), `runner` (the fuzzer's state,
//! the slots' setup, BPF_PROG_RUN; the main loop, `fuzz_frames`, is here,
//! above both it and `report`), `frames` (the frame
//! classes and their generator, with `rng`), `model` (the receive-path
//! model and the docs' rules), `compare` (checking each frame against
//! them), `maps` (the slots' inner maps, read from the kernel),
//! `barrier` (the ranks' joins and the inject path's READY frames),
//! `counters`, `layout` (the frame layout), `regions` (the registered
//! buffers the operations may be armed with), `race` (the race phase)
//! and `report` (the counter table and the `RESULT` line).
//!
//! [`HostDatapath::stats`]: liberar::datapath::kernel::HostDatapath::stats
//! [`docs_expect`]: model::docs_expect
//! [`docs_last_sent`]: model::docs_last_sent
//! [`Model::docs_region_ok`]: model::Model::docs_region_ok

mod args;
mod barrier;
mod compare;
mod counters;
mod frames;
mod layout;
mod maps;
mod model;
mod race;
mod regions;
mod report;
mod rng;
mod runner;

use std::time::{Duration, Instant};

use anyhow::Result;

use crate::args::Args;
use crate::frames::{CLASSES, C_PING_UNCONF, UNCONF_FRAMES};
use crate::race::race_phase;
use crate::report::{report, Tally};
use crate::runner::Fuzzer;

fn main() {
    match run() {
        Ok(0) => {}
        Ok(_) => std::process::exit(2),
        Err(e) => {
            eprintln!("fuzz_host: {e:#}");
            println!("error {e:#}");
            std::process::exit(1);
        }
    }
}

/// The whole run: returns the number of mismatches.
fn run() -> Result<u64> {
    let a = Args::parse()?;
    let (ifname, cb, cps, frames, seed) = (&a.ifname, a.cb, a.cps, a.frames, a.seed);
    let mut fz = Fuzzer::attach(ifname, cb, cps, seed)?;
    fz.start_from_kernel()?;
    println!(
        "fuzz_host: {ifname} (ifindex {}), chunk_bytes {cb}, chunks_per_slot {cps}, {frames} frames, seed {seed}",
        fz.dp.ifindex()
    );

    let mut tally = Tally::new();
    let mut epoch_left = 0u64;
    let mut first = true;
    let (wall, run_time) = fuzz_frames(&mut fz, frames, &mut tally, &mut epoch_left, &mut first)?;
    let race = if a.race_rounds > 0 {
        race_phase(&mut fz, a.race_rounds, &mut epoch_left, &mut first)?
    } else {
        String::from("race=0")
    };
    report(&mut fz, &tally, frames, wall, run_time, &race)?;
    Ok(fz.mismatches)
}

/// The main phase: `frames` generated frames (the first ones to slots never
/// configured), each run and checked, tallied into `tally`. Returns the
/// wall time in seconds and the time spent running and checking frames.
pub fn fuzz_frames(
    fz: &mut Fuzzer,
    frames: u64,
    tally: &mut Tally,
    epoch_left: &mut u64,
    first: &mut bool,
) -> Result<(f64, Duration)> {
    // The first frames go to slots that were never configured.
    let unconf = UNCONF_FRAMES.min(frames / 4);
    let mut run_time = Duration::ZERO;
    let t0 = Instant::now();
    for i in 0..frames {
        let class = if i < unconf {
            C_PING_UNCONF
        } else {
            fz.maintain(epoch_left, first)?;
            fz.gen.class()
        };
        let f = fz.gen.frame(&fz.model, class);
        let t = Instant::now();
        let (verdict, delta) = fz.one(CLASSES[class], &f)?;
        run_time += t.elapsed();
        tally.record(fz, class, &f, verdict, &delta);
        if (i + 1) % 200_000 == 0 {
            eprintln!(
                "fuzz_host: {} frames, {:.0} frames/s, {} mismatches",
                i + 1,
                (i + 1) as f64 / t0.elapsed().as_secs_f64(),
                fz.mismatches
            );
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    Ok((wall, run_time))
}
