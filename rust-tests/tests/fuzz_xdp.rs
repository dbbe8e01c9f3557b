//! Fuzzer for the XDP frame parser (issue #4, item 6): at least 1,000,000
//! frames through `erar_xdp`'s receive path, zero result corruption, every
//! bad frame counted.
//!
//! Builds a private network namespace `fuzz-<pid>` with a veth pair (removed
//! by a Drop guard, also when the test fails; ones left by killed runs are
//! removed at the next start) and runs the `fuzz_host` helper inside it. The
//! helper attaches the datapath to one end, configures and arms slots with
//! known contents, and sends each generated frame through BPF_PROG_RUN
//! (non-live, with an `xdp_md` whose ingress_ifindex is the attached
//! interface, so the receive path runs). Every frame is checked against a
//! model of the receive path: verdict, output frame, the delta of every
//! counter (a PASS counts nothing and is not a datapath frame, a DROP raises
//! exactly one terminal counter, a TX raises `tx` after an acceptance, or
//! `nack_served` or `ping` alone), every slot's whole buffer, chunk-state
//! words and slot_ctl (read from the slot's own inner maps, found through
//! the program's arrays of maps `slot_bufs`, `chunk_states`, `slot_ctls`),
//! the completion events (in each slot's own ring buffer, `slot_events`),
//! and whether it was applied at all against the rule of docs/datapath.md.
//! NACK frames (kind `ERAR_KIND_NACK | k`: the successor misses the (k,
//! step) frame of a chunk) are among them: valid ones naming
//! the frame this host last sent for the chunk must be answered with exactly
//! that frame (kind k, the slot's template, the slot buffer's chunk as
//! payload, `nack_served`), every other one dropped with `nack_skip`, and
//! none may change any state; each run must have both answered and skipped
//! some. PING frames (kind `ERAR_KIND_PING`, a liveness probe) pass the same
//! validations up to the slot; then, armed or not and whatever their seq,
//! op, chunk and step, one with the slot's comm_id and token must be turned
//! back (Ethernet, IPv4 and UDP source and destination swapped, UDP
//! checksum 0, kind `ERAR_KIND_PONG`, the rest as it came, `ping` alone),
//! others dropped with `drop_comm` / `drop_token`, none changing any state;
//! a PONG-kind frame is not special on receipt (it is dropped like any
//! unknown kind). Each run must have answered some PINGs and dropped some
//! for a wrong token; its first frames go to slots that were never
//! configured. READY frames (kind `ERAR_KIND_READY`, the in-kernel barrier's
//! counts, see "Barrier" in erar_wire.h) pass the same validations up to
//! the slot; then, armed or not, one of the slot's ring with a count in
//! 1..=n (or `ERAR_READY_ABORT`) that tells more than the slot's `ready`
//! word is kept there with its key, and if the slot joined its seq it is
//! checked against the call key and passed on to the predecessor (the
//! slot's NACK template, count min(count + 1, n) or the abort, an event
//! when this host passes or aborts); the rest are dropped (`drop_comm`,
//! `drop_token`, `drop_malformed`, `ready_stale`). The fuzzer's ranks join
//! their slots' operations as user space does (`HostDatapath::join`: one
//! `ERAR_INJECT_READY` run each), with agreeing or differing keys, and the
//! inject path's READY frame is checked byte by byte. Each run must have
//! passed READYs on, kept some, dropped some as stale, seen keys differ and
//! joined. A third of the operations are armed with registered buffers
//! (regions, as allreduces and broadcasts in place are: the fuzzer installs
//! a region map of the smallest size class and one of the largest, each in
//! its class's array, and names those, an empty entry, a class with none or
//! one past the last class, at offsets that put some chunks outside the
//! region; an allreduce's pair of two classes is refused): frames must
//! read the input and keep what they bring in the
//! output exactly as the model does, both regions' reachable bytes are
//! compared after every frame, and a frame whose region is missing, holds
//! another ring's token or does not hold its chunk must be dropped with
//! `region_err`, changing nothing; each run must have applied frames to
//! regions, answered NACKs from them and refused some. See
//! src/bin/fuzz_host/ for the frame classes. A race phase then
//! runs each of `FUZZ_RACE` (default 50000) frames on both CPUs at once:
//! duplicates racing for a chunk's stage must be applied once (READYs
//! racing for a slot's barrier word: taken once), and a NACK
//! racing with a data frame for its chunk must be answered with a payload
//! that matches the frame it is labelled as, or skipped.
//!
//! Three runs, because the chunk size is fixed at attach: a jumbo chunk
//! (8936 B: valid frames of 9008 B, the payload mostly in XDP fragments,
//! combined in place; the rank's READY frames sent from user space), the
//! largest chunk of one live frame (3336 B: valid frames of 3408 B, longer
//! ones spill into fragments) and the smallest (64 B: many more random
//! lengths reach the deeper checks). The veth pair has MTU 9000. `FUZZ_FRAMES` (per run, default 520000), `FUZZ_RACE` and
//! `FUZZ_SEED` change them.
//!
//! `cargo test -p rust-tests --test fuzz_xdp -- --nocapture`. Needs root.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::{anyhow, ensure, Context, Result};
use erarctl::testbed::ipcmd::ip;
use liberar::datapath::wire;

/// The namespace with the veth pair; deleted (with the pair) on drop.
struct Netns {
    name: String,
}

const IFACE: &str = "fz0";
const PEER: &str = "fz1";

impl Netns {
    fn up() -> Result<Netns> {
        // Namespaces left by runs that were killed (their pid is gone).
        if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let name = line.split_whitespace().next().unwrap_or("");
                if let Some(pid) = name
                    .strip_prefix("fuzz-")
                    .and_then(|p| p.parse::<u32>().ok())
                {
                    if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                        let _ = ip(&["netns", "del", name]);
                    }
                }
            }
        }
        let name = format!("fuzz-{}", std::process::id());
        let _ = ip(&["netns", "del", &name]);
        ip(&["netns", "add", &name])?;
        let ns = Netns { name };
        let n = ns.name.as_str();
        ip(&[
            "-n", n, "link", "add", IFACE, "mtu", "9000", "type", "veth", "peer", "name", PEER,
            "mtu", "9000",
        ])?;
        // No IPv6 autoconfiguration chatter on the pair (it would only be
        // XDP_PASSed, uncounted, but the namespace stays silent this way).
        for dev in [IFACE, PEER] {
            ip(&["-n", n, "link", "set", dev, "addrgenmode", "none"])?;
        }
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&["-n", n, "link", "set", PEER, "up"])?;
        ip(&["-n", n, "link", "set", IFACE, "up"])?;
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

struct RunResult {
    frames: u64,
    mismatches: u64,
    /// All-gather frames that ended their trip: dropped / gone on as the
    /// host's next starting frame (a circulating ring).
    ag_last: u64,
    circulated: u64,
    /// NACKs answered / dropped as not naming the frame last sent.
    nack_served: u64,
    nack_skip: u64,
    /// PINGs answered / dropped for a wrong token.
    ping: u64,
    ping_drop_token: u64,
    /// Datapath frames of kind READY; READYs passed on, kept (not joined),
    /// dropped as stale, found with another key; joins.
    ready_frames: u64,
    ready_fwd: u64,
    ready_kept: u64,
    ready_stale: u64,
    ready_abort: u64,
    joins: u64,
    region_applied: u64,
    region_served: u64,
    region_err: u64,
    fields: String,
}

fn run_fuzzer(
    ns: &Netns,
    chunk_bytes: u32,
    cps: u32,
    frames: u64,
    seed: u64,
    race: u64,
) -> Result<RunResult> {
    let mut child = Command::new("ip")
        .args(["netns", "exec", &ns.name, env!("CARGO_BIN_EXE_fuzz_host")])
        .args([
            IFACE.to_string(),
            chunk_bytes.to_string(),
            cps.to_string(),
            frames.to_string(),
            seed.to_string(),
            race.to_string(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .context("spawning fuzz_host")?;
    let out = BufReader::new(child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?);
    let mut result = None;
    for line in out.lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("RESULT ") {
            result = Some(rest.to_string());
        }
    }
    let status = child.wait()?;
    let rest = result.ok_or_else(|| anyhow!("fuzz_host printed no RESULT ({status})"))?;
    let field = |k: &str| -> Result<u64> {
        rest.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{k}=")))
            .ok_or_else(|| anyhow!("no {k} in RESULT {rest}"))?
            .parse()
            .with_context(|| format!("{k} in RESULT {rest}"))
    };
    let r = RunResult {
        frames: field("frames")?,
        mismatches: field("mismatches")?,
        ag_last: field("ag_last")?,
        circulated: field("circulated")?,
        nack_served: field("nack_served")?,
        nack_skip: field("nack_skip")?,
        ping: field("ping")?,
        ping_drop_token: field("ping_drop_token")?,
        ready_frames: field("ready_frames")?,
        ready_fwd: field("ready_fwd")?,
        ready_kept: field("ready_kept")?,
        ready_stale: field("ready_stale")?,
        ready_abort: field("ready_abort")?,
        joins: field("joins")?,
        region_applied: field("region_applied")?,
        region_served: field("region_served")?,
        region_err: field("region_err")?,
        fields: rest.clone(),
    };
    ensure!(
        status.success() || r.mismatches > 0,
        "fuzz_host failed ({status}) without reporting mismatches: {rest}"
    );
    Ok(r)
}

fn xdp_attached(ns: &Netns) -> Result<bool> {
    let out = Command::new("ip")
        .args(["-n", &ns.name, "link", "show", IFACE])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).contains("prog/xdp"))
}

/// Kernel log lines that would mean the fuzzer hurt the kernel.
fn kernel_complaints(since_lines: usize) -> Vec<String> {
    let Ok(out) = Command::new("dmesg").output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(since_lines)
        .filter(|l| {
            let bad = ["BUG:", "Oops", "WARNING:", "general protection", "KASAN"]
                .iter()
                .any(|k| l.contains(k));
            let ours = ["bpf", "xdp", "veth", "erar"]
                .iter()
                .any(|k| l.to_lowercase().contains(k));
            bad && ours
        })
        .map(str::to_string)
        .collect()
}

fn dmesg_lines() -> usize {
    Command::new("dmesg")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
        .unwrap_or(0)
}

#[test]
fn xdp_parser_fuzz() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "fuzz_xdp needs root (network namespace, XDP, BPF_PROG_RUN): run the tests as root"
    );
    let per_run: u64 = std::env::var("FUZZ_FRAMES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(520_000);
    let seed: u64 = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_f022);
    let race: u64 = std::env::var("FUZZ_RACE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    let dmesg0 = dmesg_lines();
    let ns = Netns::up()?;
    let (mut total, mut ready_total) = (0u64, 0u64);
    let mut bad = Vec::new();
    for (k, (cb, cps)) in [
        (wire::ERAR_MAX_CHUNK_BYTES, 6u32),
        (wire::ERAR_MAX_LINEAR_CHUNK_BYTES, 6),
        (wire::ERAR_MIN_CHUNK_BYTES, 16),
    ]
    .into_iter()
    .enumerate()
    {
        println!("=== chunk_bytes {cb}, chunks_per_slot {cps} ===");
        let r = run_fuzzer(&ns, cb, cps, per_run, seed.wrapping_add(k as u64), race)?;
        total += r.frames;
        ready_total += r.ready_frames;
        if r.mismatches > 0 {
            bad.push(format!("chunk_bytes {cb}: {}", r.fields));
        }
        // Both ends of the NACK path must have been exercised.
        if r.nack_served == 0 || r.nack_skip == 0 {
            bad.push(format!(
                "chunk_bytes {cb}: NACKs served {} / skipped {}, both must be non-zero: {}",
                r.nack_served, r.nack_skip, r.fields
            ));
        }
        // Registered buffers: frames applied to them, NACKs answered from
        // them, and frames refused by them.
        if r.region_applied == 0 || r.region_served == 0 || r.region_err == 0 {
            bad.push(format!(
                "chunk_bytes {cb}: on registered buffers {} applied / {} served / {} refused, all must be non-zero: {}",
                r.region_applied, r.region_served, r.region_err, r.fields
            ));
        }
        // Both ends of an all-gather trip too.
        if r.ag_last == 0 || r.circulated == 0 {
            bad.push(format!(
                "chunk_bytes {cb}: AG trips ended dropped {} / circulated {}, both must be non-zero: {}",
                r.ag_last, r.circulated, r.fields
            ));
        }
        // Both ends of the PING path too.
        if r.ping == 0 || r.ping_drop_token == 0 {
            bad.push(format!(
                "chunk_bytes {cb}: PINGs answered {} / dropped for a wrong token {}, both must be non-zero: {}",
                r.ping, r.ping_drop_token, r.fields
            ));
        }
        // Every end of the barrier's path too.
        let ready = [
            ("passed on", r.ready_fwd),
            ("kept", r.ready_kept),
            ("stale", r.ready_stale),
            ("aborted", r.ready_abort),
            ("joins", r.joins),
        ];
        if ready.iter().any(|&(_, n)| n == 0) {
            bad.push(format!(
                "chunk_bytes {cb}: READYs {ready:?}, each must be non-zero: {}",
                r.fields
            ));
        }
        // The helper's datapath went away with it (bpf_link).
        ensure!(
            !xdp_attached(&ns)?,
            "XDP still attached after fuzz_host exited"
        );
    }
    let complaints = kernel_complaints(dmesg0);
    drop(ns);
    println!("fuzz_xdp: {total} frames in total, {ready_total} of kind READY");
    assert!(
        complaints.is_empty(),
        "kernel complained during the fuzz run:\n{}",
        complaints.join("\n")
    );
    assert!(
        bad.is_empty(),
        "mismatches (see MISMATCH lines above) or NACK / PING / READY paths not exercised: {bad:?}"
    );
    if std::env::var_os("FUZZ_FRAMES").is_none() {
        assert!(total >= 1_000_000, "only {total} frames fuzzed");
    }
    Ok(())
}
