//! One emulated host of `tests/datapath_kernel.rs`: run inside a host's
//! network namespace (`ip netns exec dpt-hN dpt_host …`), it attaches the
//! kernel datapath to `eth0` and executes line commands from the test on
//! stdin, answering one line each on stdout:
//!
//! * `op SLOT SEQ WIRE_OP ELEMS` — fill the slot with this rank's pattern
//!   for (SEQ, element), arm it → `armed CHUNKS`;
//! * `go SLOT SEQ` — inject, wait, verify every element against the result
//!   computed here from all ranks' patterns → `ok WAIT_US INJECT_US`,
//!   `stall DONE CHUNKS (…)` or `bad INDEX GOT WANT`;
//! * `pacing BATCH BURST WINDOW CIRCULATE` (numbers or `inf`; CIRCULATE
//!   0 or 1) → `ok`;
//! * `stats` → `stats RX_RS RX_AG FINISHED TX AG_LAST COMPLETE INJECTED DROPS
//!   PAYLOAD_COPIED CIRCULATED IN_PLACE` (IN_PLACE: 1 if erar_xdp combines
//!   a jumbo frame's fragments where they lie, 0 if through a copy);
//! * `quit`.
//!
//! Arguments: RANK N CHUNK_BYTES CHUNKS_PER_SLOT SELF_MAC SELF_IP NEXT_MAC
//! NEXT_IP COMM_ID TOKEN.

use std::io::{BufRead, Write};
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use liberar::datapath::kernel::{HostDatapath, InjectPacing, Patience, SlotRoute};
use liberar::datapath::wire;

fn main() {
    if let Err(e) = run() {
        eprintln!("dpt_host: {e:#}");
        println!("error {e:#}");
        std::process::exit(1);
    }
}

fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let v: Vec<u8> = s
        .split(':')
        .map(|p| u8::from_str_radix(p, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("MAC {s}"))?;
    v.try_into().map_err(|_| anyhow!("MAC {s} is not 6 bytes"))
}

/// Deterministic, rank/seq/element dependent 64-bit value (splitmix64).
pub fn pattern(rank: u32, seq: u32, i: u64) -> u64 {
    let mut z =
        (i ^ ((rank as u64) << 40) ^ ((seq as u64) << 52)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Element width of a wire op, in bytes.
fn elem_size(op: u32) -> Result<usize> {
    Ok(match op {
        wire::ERAR_OP_ADD_I32
        | wire::ERAR_OP_ADD_I32_FLAGS
        | wire::ERAR_OP_MAX_I32
        | wire::ERAR_OP_MIN_I32
        | wire::ERAR_OP_MAX_U32
        | wire::ERAR_OP_MIN_U32 => 4,
        wire::ERAR_OP_ADD_I64
        | wire::ERAR_OP_MAX_I64
        | wire::ERAR_OP_MIN_I64
        | wire::ERAR_OP_MAX_U64
        | wire::ERAR_OP_MIN_U64
        | wire::ERAR_OP_AND
        | wire::ERAR_OP_OR
        | wire::ERAR_OP_XOR => 8,
        _ => bail!("unknown wire op {op}"),
    })
}

/// The first chunk of flag bits this harness arms ERAR_OP_ADD_I32_FLAGS
/// with: the second half of the operation's chunks.
fn flags_from(chunks: u32) -> u32 {
    chunks / 2
}

/// The op element `i` of an operation of `chunks` chunks of `chunk_bytes`
/// combines with (a flagged sum's values add, its flag words OR).
fn elem_op(op: u32, i: u64, chunks: u32, chunk_bytes: u32) -> u32 {
    if op != wire::ERAR_OP_ADD_I32_FLAGS {
        op
    } else if i * 4 < flags_from(chunks) as u64 * chunk_bytes as u64 {
        wire::ERAR_OP_ADD_I32
    } else {
        wire::ERAR_OP_OR
    }
}

/// The reference result: op folded over ranks, computed independently of
/// the datapath (plain Rust integer semantics).
fn combine(op: u32, a: u64, b: u64) -> u64 {
    match op {
        wire::ERAR_OP_ADD_I32 => (a as u32 as i32).wrapping_add(b as u32 as i32) as u32 as u64,
        wire::ERAR_OP_MAX_I32 => (a as u32 as i32).max(b as u32 as i32) as u32 as u64,
        wire::ERAR_OP_MIN_I32 => (a as u32 as i32).min(b as u32 as i32) as u32 as u64,
        wire::ERAR_OP_MAX_U32 => (a as u32).max(b as u32) as u64,
        wire::ERAR_OP_MIN_U32 => (a as u32).min(b as u32) as u64,
        wire::ERAR_OP_ADD_I64 => (a as i64).wrapping_add(b as i64) as u64,
        wire::ERAR_OP_MAX_I64 => (a as i64).max(b as i64) as u64,
        wire::ERAR_OP_MIN_I64 => (a as i64).min(b as i64) as u64,
        wire::ERAR_OP_MAX_U64 => a.max(b),
        wire::ERAR_OP_MIN_U64 => a.min(b),
        wire::ERAR_OP_AND => a & b,
        wire::ERAR_OP_OR => a | b,
        wire::ERAR_OP_XOR => a ^ b,
        _ => 0,
    }
}

fn elem_value(op: u32, rank: u32, seq: u32, i: u64) -> u64 {
    let v = pattern(rank, seq, i);
    if elem_size(op).unwrap_or(8) == 4 {
        v & 0xffff_ffff
    } else {
        v
    }
}

/// How long inject() waits for the window before presuming the frames in
/// flight lost; shorter than the 3 s after which `go` reports a stall.
const WINDOW_QUIET: Duration = Duration::from_secs(2);

struct Armed {
    slot: u32,
    seq: u32,
    op: u32,
    elems: u64,
    chunks: u32,
    chunk_bytes: u32,
}

fn run() -> Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() != 12 {
        bail!("usage: dpt_host RANK N CHUNK_BYTES CHUNKS_PER_SLOT SELF_MAC SELF_IP NEXT_MAC NEXT_IP COMM_ID TOKEN PREV_MAC PREV_IP");
    }
    let rank: u32 = a[0].parse().context("RANK")?;
    let n: u32 = a[1].parse().context("N")?;
    let chunk_bytes: u32 = a[2].parse().context("CHUNK_BYTES")?;
    let cps: u32 = a[3].parse().context("CHUNKS_PER_SLOT")?;
    let route = SlotRoute {
        self_mac: parse_mac(&a[4])?,
        self_ip: a[5].parse::<Ipv4Addr>().context("SELF_IP")?,
        next_mac: parse_mac(&a[6])?,
        next_ip: a[7].parse::<Ipv4Addr>().context("NEXT_IP")?,
        ring_pos: rank,
        ring_size: n,
        comm_id: a[8].parse().context("COMM_ID")?,
        token: a[9].parse().context("TOKEN")?,
        prev_mac: parse_mac(&a[10])?,
        prev_ip: a[11].parse::<Ipv4Addr>().context("PREV_IP")?,
    };

    let t0 = Instant::now();
    let dp = HostDatapath::attach("eth0", chunk_bytes, cps).context("attaching the datapath")?;
    let load_ms = t0.elapsed().as_millis();
    for slot in 0..wire::ERAR_MAX_SLOTS {
        dp.configure_slot(slot, &route)?;
    }
    // This harness sends no NACKs, so the injection window must never be
    // written off: a host that stalls for the default few ms (a busy CI
    // machine) would then overfill a veth ring, and the frames it drops
    // would stall the test, not show a datapath bug.
    dp.set_inject_pacing(InjectPacing {
        quiet: WINDOW_QUIET,
        ..dp.inject_pacing()
    });
    let out = std::io::stdout();
    let mut out = out.lock();
    writeln!(out, "ready {load_ms}")?;
    out.flush()?;

    let mut armed: Option<Armed> = None;
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading a command")?;
        let w: Vec<&str> = line.split_whitespace().collect();
        let reply = match w.as_slice() {
            ["op", slot, seq, op, elems] => {
                let (slot, seq, op, elems): (u32, u32, u32, u64) =
                    (slot.parse()?, seq.parse()?, op.parse()?, elems.parse()?);
                let es = elem_size(op)?;
                let bytes = elems as usize * es;
                let chunks = bytes.div_ceil(chunk_bytes as usize) as u32;
                // SAFETY: the slot is not armed (arm() below comes after)
                // and no other reference to its buffer exists.
                let buf = unsafe { dp.slot_slice_mut(slot) };
                for (i, e) in buf[..bytes].chunks_exact_mut(es).enumerate() {
                    let v = elem_value(op, rank, seq, i as u64);
                    e.copy_from_slice(&v.to_le_bytes()[..es]);
                }
                buf[bytes..chunks as usize * chunk_bytes as usize].fill(0);
                dp.arm(slot, seq, chunks, op as u8, 0, flags_from(chunks))?;
                armed = Some(Armed {
                    slot,
                    seq,
                    op,
                    elems,
                    chunks,
                    chunk_bytes,
                });
                format!("armed {chunks}")
            }
            ["go", slot, seq] => {
                let (slot, seq): (u32, u32) = (slot.parse()?, seq.parse()?);
                let arm = armed.take().ok_or_else(|| anyhow!("go without op"))?;
                if arm.slot != slot || arm.seq != seq {
                    bail!("go {slot} {seq} does not match the armed op");
                }
                let t = Instant::now();
                dp.inject(slot)?;
                let inject_us = t.elapsed().as_micros();
                let patience = Patience {
                    nack_after: None,
                    quiet: Duration::from_secs(3),
                    poll: Duration::ZERO,
                    poll_renewed: false,
                };
                let ok = dp.wait(slot, seq, patience)?.complete;
                let wait_us = t.elapsed().as_micros();
                if !ok {
                    let s = dp.stats()?;
                    format!(
                        "stall {} {} (kernel stats: {} frames dropped in XDP, {} sent)",
                        dp.done(slot)?,
                        arm.chunks,
                        s.drops(),
                        s.get(wire::ERAR_STAT_TX)
                    )
                } else {
                    verify(&dp, &arm, n).unwrap_or_else(|| format!("ok {wait_us} {inject_us}"))
                }
            }
            ["pacing", batch, burst, window, circulate] => {
                let num =
                    |s: &str| -> Result<u32> { Ok(if s == "inf" { u32::MAX } else { s.parse()? }) };
                dp.set_inject_pacing(InjectPacing {
                    batch: num(batch)?,
                    burst: num(burst)?,
                    window: num(window)?,
                    quiet: WINDOW_QUIET,
                    nack_after: None,
                    circulate: *circulate == "1",
                });
                "ok".to_string()
            }
            ["stats"] => {
                let s = dp.stats()?;
                format!(
                    "stats {} {} {} {} {} {} {} {} {} {} {}",
                    s.get(wire::ERAR_STAT_RX_RS),
                    s.get(wire::ERAR_STAT_RX_AG),
                    s.get(wire::ERAR_STAT_FINISHED),
                    s.get(wire::ERAR_STAT_TX),
                    s.get(wire::ERAR_STAT_AG_LAST),
                    s.get(wire::ERAR_STAT_COMPLETE),
                    s.get(wire::ERAR_STAT_INJECTED),
                    s.drops(),
                    s.get(wire::ERAR_STAT_PAYLOAD_COPIED),
                    s.get(wire::ERAR_STAT_CIRCULATED),
                    u64::from(dp.combines_fragments_in_place()?)
                )
            }
            ["quit"] => break,
            _ => bail!("unknown command {line:?}"),
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    Ok(())
}

/// First mismatch between the slot and the reference result, if any.
fn verify(dp: &HostDatapath, arm: &Armed, n: u32) -> Option<String> {
    let es = elem_size(arm.op).ok()?;
    // SAFETY: the operation is complete: XDP no longer writes this slot
    // until it is armed again.
    let buf = unsafe { std::slice::from_raw_parts(dp.slot_buffer(arm.slot), dp.slot_bytes()) };
    for (i, e) in buf[..arm.elems as usize * es].chunks_exact(es).enumerate() {
        let mut b = [0u8; 8];
        b[..es].copy_from_slice(e);
        let got = u64::from_le_bytes(b);
        let op = elem_op(arm.op, i as u64, arm.chunks, arm.chunk_bytes);
        let mut want = elem_value(arm.op, 0, arm.seq, i as u64);
        for r in 1..n {
            want = combine(op, want, elem_value(arm.op, r, arm.seq, i as u64));
        }
        if got != want {
            return Some(format!("bad {i} {got:#x} {want:#x}"));
        }
    }
    None
}
