//! Loss recovery of the datapath, proven on an impaired network: the
//! emulated XDP switch (`erarctl::testbed::impair`) loses, duplicates,
//! reorders and drops chosen datapath frames, and every collective must
//! still complete on the fast path, exactly.
//!
//! * `allreduce_under_loss_dup_reorder`: 4 hosts, 1% loss + 0.5%
//!   duplication + 0.5% reordering per hop; `allreduce_sweep` with 2000+
//!   back-to-back int32/float allreduces from 1 KiB to 16 MiB: the same
//!   DIGEST as MPI alone, every call on the fast path with no fallback,
//!   lost frames repaired by in-kernel NACKs (the ranks' `nacks`, the
//!   receivers' `nack_served`), and the switch's and the receivers' counters
//!   show the impairments happened (duplicates dropped by the receivers'
//!   `dup`).
//! * `jumbo_allreduce_under_loss_dup_reorder`: the same at MTU 9000 with
//!   `ERAR_JUMBO=1`: jumbo chunks (sent from user space, fragments in XDP);
//!   the rings say they use 8936-byte chunks.
//! * `node_path_allreduce_under_loss_dup_reorder`: the same impairments
//!   with 2 ranks on each of 4 hosts (issue 14's node path: the ranks of a
//!   host meet in shared memory, two slice rings cross the hosts);
//!   `allreduce_sweep` with 2000 back-to-back int32 and float allreduces
//!   from 1 KiB to 16 MiB (float SUMs of every size on the node path,
//!   `ERAR_NODE_FLOAT_MIN=0`): the same DIGEST as MPI alone with 8 ranks on a lossless
//!   network, every call on the fast path through the node path
//!   (`node_calls`) with no fallback, both slice leaders of every host
//!   carrying slices (`node_led`: local rank 0 one of every call, local
//!   rank 1 of the calls large enough to split), and the loss repaired by
//!   NACKs (the ranks sent them, the receivers served them; the switch
//!   lost frames).
//! * `allreduce_in_place_under_loss`: the same impairments on allreduces
//!   in place (`allreduce_reused`: XDP reads the caller's send buffer and
//!   writes partials and results into the receive buffer, and answers
//!   NACKs from them): MPI's lossless DIGEST, calls in place on every
//!   rank, NACKs sent and answered.
//! * `allreduce_chosen_frame_drops` / `bcast_chosen_frame_drops`: the first
//!   chunk, the last chunk and every 7th chunk of one kind and step dropped
//!   once each (re-sends pass): exact results, every operation repaired by
//!   NACKs; and again with NACKs off (`ERAR_NACK_US=0`), where every
//!   operation needs an MPI recovery round (the backstop path).
//! * `float_barriers_that_abort_under_loss`: 600 small float SUMs whose
//!   hosts often join their kernel barriers with different keys, at 10%
//!   loss: every such barrier aborts on every host, results exact.
//! * `bcast_under_loss`: 1% loss, 2, 3, 4 and 8 hosts, every root, 0 B to
//!   4 MiB.
//! * `loss_in_bursts`: each loss (0.01% per hop) takes the next 1000
//!   frames of its CPU with it, as a full switch queue drops them; mixed
//!   allreduces and broadcasts from every root, exact, on the fast path.
//!
//! Every test clears the impairments when it ends, also when it fails.

use anyhow::{ensure, Result};
use erarctl::testbed::impair::{self, DatapathCounters, Impairments, Switch, SwitchCounters};
use erarctl::testbed::{self, LaunchSpec, SwitchKind};
use liberar::datapath::wire;
use rust_tests::{
    ctests, end_grace, job_timeout, run_job, shim_path, testbed, testbed_config, JobResult, Mpi,
    StatsLine,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The shape: at least this many consecutive allreduces.
const MIXED_CALLS: usize = 2000;

/// The loss per hop, in parts per million.
const ONE_PERCENT: u32 = 10_000;

fn ctest(name: &str) -> PathBuf {
    ctests(Mpi::Openmpi); // builds c-tests/bin/openmpi/*
    rust_tests::repo_root()
        .join("c-tests/bin/openmpi")
        .join(name)
}

/// The test bed's switch with impairments in force; clears them on drop
/// (also when the test fails). Create it after [`testbed`] so that it is
/// dropped before the test-bed lock is released.
struct Impaired {
    sw: Switch,
}

impl Impaired {
    fn new(imp: &Impairments) -> Impaired {
        let sw = switch();
        sw.set(imp)
            .unwrap_or_else(|e| panic!("setting impairments {imp}: {e:#}"));
        eprintln!("  impairments: {imp}");
        Impaired { sw }
    }

    fn counters(&self) -> SwitchCounters {
        self.sw
            .counters()
            .unwrap_or_else(|e| panic!("reading the switch counters: {e:#}"))
    }
}

impl Drop for Impaired {
    fn drop(&mut self) {
        if let Err(e) = self.sw.clear() {
            eprintln!("  WARNING: could not clear the switch impairments: {e:#}");
        }
    }
}

/// The switch of the test bed; re-attached once if it predates
/// impairments (a switch attached by an older build has no impair maps).
fn switch() -> Switch {
    match Switch::testbed() {
        Ok(sw) => sw,
        Err(e) => {
            eprintln!("  re-attaching the XDP switch ({e:#})");
            testbed::set_switch(SwitchKind::Bridge).expect("detaching the XDP switch");
            testbed::set_switch(SwitchKind::Xdp).expect("attaching the XDP switch");
            Switch::testbed().unwrap_or_else(|e| panic!("{e:#}"))
        }
    }
}

/// Puts the test bed's switch back to the XDP switch on drop.
struct RestoreXdpSwitch;

impl Drop for RestoreXdpSwitch {
    fn drop(&mut self) {
        if let Err(e) = testbed::set_switch(testbed_config().switch) {
            eprintln!("  WARNING: could not restore the XDP switch: {e:#}");
        }
    }
}

/// Samples the datapath counters of the hosts' erar_xdp programs while a
/// job runs (they vanish with the job's processes).
struct Sampler {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<BTreeMap<u32, DatapathCounters>>,
}

impl Sampler {
    fn start(hosts: usize) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut latest = BTreeMap::new();
            while !flag.load(Ordering::Relaxed) {
                if let Ok(v) = impair::testbed_datapath_counters(hosts) {
                    for (_, c) in v {
                        latest.insert(c.prog_id, c);
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            latest
        });
        Sampler { stop, handle }
    }

    /// Each program's last sample, summed: (programs seen, counters).
    fn finish(self) -> (usize, [u64; wire::ERAR_STAT_NR as usize]) {
        self.stop.store(true, Ordering::Relaxed);
        let latest = self.handle.join().unwrap_or_default();
        let mut sum = [0u64; wire::ERAR_STAT_NR as usize];
        for c in latest.values() {
            for (s, v) in sum.iter_mut().zip(c.c) {
                *s += v;
            }
        }
        (latest.len(), sum)
    }
}

fn spec(hosts: usize, program: &str, args: &[&str], preload: bool) -> LaunchSpec {
    let mut argv = vec![ctest(program).into_os_string()];
    argv.extend(args.iter().map(Into::into));
    let mut s = LaunchSpec::new(Mpi::Openmpi, hosts, argv)
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace());
    if preload {
        s = s
            .preload(shim_path(Mpi::Openmpi))
            .env("ERAR_STATS", "1")
            .env("ERAR_MIN_BYTES", "1")
            .env("ERAR_BCAST_MIN_BYTES", "1");
    }
    s
}

/// Runs a job; it must exit 0 and print `PASS <program>`.
fn run_ok(spec: &LaunchSpec, program: &str) -> Result<JobResult> {
    let r = run_job(spec)?;
    ensure!(
        r.output.status.success() && r.passes().iter().any(|p| *p == format!("PASS {program}")),
        "{program} failed ({})\n{}",
        r.output.status,
        r.tail()
    );
    Ok(r)
}

fn digest(r: &JobResult) -> Result<String> {
    let d = r.digests();
    ensure!(d.len() == 1, "{} DIGEST lines\n{}", d.len(), r.tail());
    Ok(d[0].clone())
}

/// Calls of a collective that MPI makes whatever the network does: empty
/// ones and non-contiguous datatypes (bcast_roots has both).
const NOT_FOR_THE_DATAPATH: [&str; 2] = ["trivial", "unsupported_type"];

/// One stats line per rank; every call of `coll` that the shim could
/// accelerate went on the fast path, and none of its bytes fell back to MPI.
fn all_fast(r: &JobResult, hosts: usize, coll: &str) -> Result<Vec<StatsLine>> {
    let stats = r.stats();
    rust_tests::check_stats_per_rank(&stats, hosts)?;
    for s in &stats {
        let other_pmpi: u64 = s
            .reasons
            .iter()
            .filter(|(k, _)| {
                k.strip_prefix(coll)
                    .and_then(|k| k.strip_prefix('.'))
                    .is_some_and(|why| !NOT_FOR_THE_DATAPATH.contains(&why))
            })
            .map(|(_, n)| n)
            .sum();
        ensure!(
            s.get(&format!("{coll}.fast")) > 0 && other_pmpi == 0 && s.get("fallback_bytes") == 0,
            "rank {}: not every {coll} completed on the fast path: {}\n{}",
            s.rank,
            s.raw,
            r.tail()
        );
    }
    Ok(stats)
}

/// An impaired run of a c-test, with what the receivers and the
/// switch counted during it.
struct Swept {
    r: JobResult,
    progs: usize,
    dp: [u64; wire::ERAR_STAT_NR as usize],
    sw: SwitchCounters,
}

/// The impairments: `ONE_PERCENT` loss, 0.5% duplication and 0.5%
/// reordering per hop.
fn loss_dup_reorder() -> Impairments {
    Impairments {
        loss_ppm: ONE_PERCENT,
        dup_ppm: 5_000,
        reorder_ppm: 5_000,
        ..Impairments::default()
    }
}

/// [`impaired_run`] of `allreduce_sweep`.
fn sweep_impaired(
    hosts: usize,
    impairments: &Impairments,
    job: impl Fn(bool) -> LaunchSpec,
) -> Swept {
    impaired_run("allreduce_sweep", hosts, impairments, job)
}

/// `job(false)` (c-test `program`) without liberar on the plain bridge
/// (MPI's best case; the impairments only ever touch datapath frames
/// anyway) for the lossless reference, then `job(true)` under
/// `impairments`: asserts the same DIGEST and prints what the switch and
/// the receivers counted.
fn impaired_run(
    program: &str,
    hosts: usize,
    impairments: &Impairments,
    job: impl Fn(bool) -> LaunchSpec,
) -> Swept {
    let base = {
        let _restore = RestoreXdpSwitch;
        testbed::set_switch(SwitchKind::Bridge).expect("switching to the bridge");
        run_ok(&job(false), program).unwrap_or_else(|e| panic!("{e:#}"))
    };
    let want = digest(&base).unwrap_or_else(|e| panic!("{e:#}"));

    let imp = Impaired::new(impairments);
    let before = imp.counters();
    let sampler = Sampler::start(hosts);
    let r = run_ok(&job(true), program);
    let (progs, dp) = sampler.finish();
    let sw = imp.counters().since(&before);
    let r = r.unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("  switch: {sw}");
    eprintln!(
        "  receivers ({progs} erar_xdp programs sampled): dup={} nack_sent={} nack_served={} \
         nack_skip={} resent={} resend_skip={} payload_copied={}; base {:.1}s, impaired run \
         {:.1}s",
        dp[wire::ERAR_STAT_DUP as usize],
        dp[wire::ERAR_STAT_NACK_SENT as usize],
        dp[wire::ERAR_STAT_NACK_SERVED as usize],
        dp[wire::ERAR_STAT_NACK_SKIP as usize],
        dp[wire::ERAR_STAT_RESENT as usize],
        dp[wire::ERAR_STAT_RESEND_SKIP as usize],
        dp[wire::ERAR_STAT_PAYLOAD_COPIED as usize],
        base.elapsed.as_secs_f64(),
        r.elapsed.as_secs_f64()
    );
    let got = digest(&r).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        got,
        want,
        "results under loss differ from MPI's on a lossless network\n{}\n{}",
        base.tail(),
        r.tail()
    );
    Swept { r, progs, dp, sw }
}

/// 1% loss, 0.5% duplication, 0.5% reordering on every hop; the issue's
/// shape of 2000+ consecutive allreduces from 1 KiB to 16 MiB, int32 and
/// float, plus the sweep's odd sizes.
#[test]
fn allreduce_under_loss_dup_reorder() {
    let _tb = testbed();
    mixed_allreduces_under_loss(|s| s);
}

/// [`allreduce_under_loss_dup_reorder`]'s impairments on allreduces in
/// place (datapath/ring/registered.rs), whose NACKs are answered from the
/// caller's buffers: `allreduce_reused` (one pair of buffers, 3 MiB calls
/// whose pages are dropped, swapped and mapped anew between calls).
#[test]
fn allreduce_in_place_under_loss() {
    let _tb = testbed();
    let (hosts, program) = (4, "allreduce_reused");
    let job = |preload| spec(hosts, program, &[], preload);
    let Swept { r, dp, sw, .. } = impaired_run(program, hosts, &loss_dup_reorder(), job);
    let stats = all_fast(&r, hosts, "allreduce").unwrap_or_else(|e| panic!("{e:#}"));
    for s in &stats {
        assert!(
            s.get("allreduce_in_place") > 0,
            "rank {}: no allreduce in place: {}",
            s.rank,
            s.raw
        );
    }
    assert!(
        stats.iter().any(|s| s.get("nacks") > 0),
        "no rank sent a NACK at 1% loss:\n{}",
        r.tail()
    );
    assert!(sw.lost() > 0, "the switch lost nothing: {sw}");
    assert!(
        dp[wire::ERAR_STAT_NACK_SERVED as usize] > 0,
        "no receiver answered a NACK from the caller's buffers"
    );
}

/// [`allreduce_under_loss_dup_reorder`] with jumbo frames: the test bed at
/// MTU 9000 and `ERAR_JUMBO=1`, so the rings' chunks are 8936 bytes, sent
/// from user space (kernel/raw.rs: starting frames, NACKs, READY frames)
/// and reaching XDP in fragments, which the switch loses, duplicates and
/// reorders too.
#[test]
fn jumbo_allreduce_under_loss_dup_reorder() {
    let _tb = JumboBed::up();
    let chunks = format!("{}-byte chunks", wire::ERAR_MAX_CHUNK_BYTES);
    let r = mixed_allreduces_under_loss(|s| {
        s.env("ERAR_JUMBO", "1")
            .env("ERAR_LOG", "liberar::datapath::ring::setup=debug")
    });
    assert!(
        r.stderr.contains(&chunks) || r.stdout.contains(&chunks),
        "the rings did not say they use {chunks}:\n{}",
        r.tail()
    );
}

/// The test bed at MTU 9000 while alive (under the test-bed lock), then
/// back to the suite's configuration.
struct JumboBed {
    _lock: rust_tests::TestbedLock,
}

impl JumboBed {
    fn up() -> JumboBed {
        let lock = rust_tests::testbed_lock();
        let jumbo = testbed::TestbedConfig {
            mtu: 9000,
            ..testbed_config()
        };
        testbed::up(&jumbo).unwrap_or_else(|e| panic!("test bed at MTU 9000: {e:#}"));
        JumboBed { _lock: lock }
    }
}

impl Drop for JumboBed {
    fn drop(&mut self) {
        if let Err(e) = testbed::up(&testbed_config()) {
            eprintln!("restoring the test bed: {e:#}");
        }
    }
}

/// The body of the loss tests on one rank per host: `tune` adds to the
/// impaired job's launch. Returns the impaired run.
fn mixed_allreduces_under_loss(tune: impl Fn(LaunchSpec) -> LaunchSpec) -> JobResult {
    let hosts = 4;
    let mixed = MIXED_CALLS.to_string();
    let args = ["--max-mib", "16", "--repeat", "0", "--mixed", &mixed];

    let job = |preload: bool| {
        let s = spec(hosts, "allreduce_sweep", &args, preload);
        if preload {
            tune(s)
        } else {
            s
        }
    };
    let Swept { r, progs, dp, sw } = sweep_impaired(hosts, &loss_dup_reorder(), job);
    let stats = all_fast(&r, hosts, "allreduce").unwrap_or_else(|e| panic!("{e:#}"));
    for s in &stats {
        assert!(
            s.get("allreduce.fast") >= MIXED_CALLS as u64,
            "rank {}: only {} fast allreduces: {}",
            s.rank,
            s.get("allreduce.fast"),
            s.raw
        );
    }
    assert!(
        stats.iter().any(|s| s.get("nacks") > 0),
        "no rank sent a NACK at 1% loss:\n{}",
        r.tail()
    );
    assert!(
        dp[wire::ERAR_STAT_NACK_SERVED as usize] > 0,
        "no receiver answered a NACK ({progs} programs sampled)"
    );
    assert!(
        sw.lost() > 0 && sw.duplicated() > 0 && sw.reordered() > 0,
        "the switch did not impair: {sw}"
    );
    assert!(
        dp[wire::ERAR_STAT_DUP as usize] > 0,
        "the receivers dropped no duplicates ({progs} programs sampled)"
    );
    r
}

/// [`allreduce_under_loss_dup_reorder`] with 2 ranks on each of 4 hosts:
/// the node path (shared memory on each host, one slice ring per local
/// leader) under 1% loss, 0.5% duplication and 0.5% reordering per hop,
/// 2000 back-to-back allreduces of 1 KiB to 16 MiB, int32 and float, plus
/// the sweep's odd sizes; float SUMs of every size on the node path
/// (`ERAR_NODE_FLOAT_MIN=0`: its floor is about speed), so every call of
/// either type crosses the hosts on a slice ring.
#[test]
fn node_path_allreduce_under_loss_dup_reorder() {
    let _tb = testbed();
    let per_host = vec![2usize; 4];
    let (hosts, ranks) = (per_host.len(), per_host.iter().sum::<usize>());
    let mixed = MIXED_CALLS.to_string();
    let args = ["--max-mib", "16", "--repeat", "0", "--mixed", &mixed];
    let job = |preload: bool| {
        spec(hosts, "allreduce_sweep", &args, preload)
            .ranks_per_host(per_host.clone())
            .env("ERAR_NODE_FLOAT_MIN", "0")
    };

    let Swept { r, dp, sw, .. } = sweep_impaired(hosts, &loss_dup_reorder(), job);
    let stats = all_fast(&r, ranks, "allreduce").unwrap_or_else(|e| panic!("{e:#}"));
    let all = stats
        .iter()
        .map(|s| s.raw.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    for s in &stats {
        // Ranks fill the hosts in rank order: local rank = rank % 2. Both
        // lead a slice (k = min(2, ERAR_NODE_SLICES)): local rank 0 slice 0
        // of every call, local rank 1 slice 1 of the calls large enough to
        // be split (the 16 MiB ones at least).
        let local = s.rank % 2;
        let (node, led) = (s.get("node_calls"), s.get("node_led"));
        assert!(
            node >= MIXED_CALLS as u64
                && node == s.get("allreduce.fast")
                && if local == 0 {
                    led >= node
                } else {
                    led > 0 && led <= node
                },
            "rank {} (local rank {local}): expected every one of >= {MIXED_CALLS} fast \
             allreduces through the node path, and node_led {}: {}\nall ranks:\n{all}",
            s.rank,
            if local == 0 {
                ">= node_calls"
            } else {
                "in 1..=node_calls"
            },
            s.raw
        );
    }
    let nacks: u64 = stats.iter().map(|s| s.get("nacks")).sum();
    let rounds: u64 = stats.iter().map(|s| s.get("recovery_rounds")).sum();
    eprintln!(
        "  ranks: NACK bursts {nacks}, recovery rounds {rounds}; rank 0: {}",
        stats
            .iter()
            .find(|s| s.rank == 0)
            .map_or("", |s| s.raw.as_str())
    );
    assert!(sw.lost() > 0, "the switch lost nothing: {sw}");
    assert!(
        nacks > 0 && dp[wire::ERAR_STAT_NACK_SERVED as usize] > 0,
        "at 1% loss no rank sent a NACK or no receiver answered one (nacks {nacks}, \
         recovery rounds {rounds}, nack_served {}):\n{all}",
        dp[wire::ERAR_STAT_NACK_SERVED as usize]
    );
}

/// Float SUMs whose hosts join their kernel barriers with different keys
/// (some hosts' block summaries changed since the last agreement, others'
/// did not: `allreduce_sweep --small-floats`), under 10% loss: each such
/// barrier must abort on every host, however many READY frames are lost,
/// or the hosts that pass run the operation with a host whose slot holds
/// its summaries instead of its data (a wrong sum, or a stalled ring:
/// session 24's CI run, here 17 of 20 jobs before the fix). Asserts the
/// same DIGEST as MPI alone, every call on the fast path, and that the
/// barriers aborted (`kernel_aborts`) and NACKs repaired the loss.
#[test]
fn float_barriers_that_abort_under_loss() {
    let _tb = testbed();
    let hosts = 4;
    let calls = 600;
    let n = calls.to_string();
    let args = ["--max-mib", "1", "--repeat", "0", "--small-floats", &n];
    let job = |preload: bool| spec(hosts, "allreduce_sweep", &args, preload);
    let ten_percent = Impairments {
        loss_ppm: 10 * ONE_PERCENT,
        ..loss_dup_reorder()
    };
    let Swept { r, sw, .. } = sweep_impaired(hosts, &ten_percent, job);
    let stats = all_fast(&r, hosts, "allreduce").unwrap_or_else(|e| panic!("{e:#}"));
    for s in &stats {
        // About three in four of these calls abort their first barrier
        // (469 of 630 float calls in a lossless run).
        assert!(
            s.get("kernel_aborts") >= calls as u64 / 4,
            "rank {}: only {} kernel barriers aborted in {calls} float calls whose hosts \
             disagree: {}",
            s.rank,
            s.get("kernel_aborts"),
            s.raw
        );
    }
    assert!(sw.lost() > 0, "the switch lost nothing: {sw}");
    assert!(
        stats.iter().any(|s| s.get("nacks") > 0),
        "no rank sent a NACK at 10% loss:\n{}",
        r.tail()
    );
}

/// Duplication alone: every duplicated frame reaches its receiver twice
/// and the second copy is dropped there (`dup`), nothing is lost, results
/// exact.
#[test]
fn duplication_reaches_the_receiver() {
    let _tb = testbed();
    let hosts = 3;
    let imp = Impaired::new(&Impairments {
        dup_ppm: 50_000,
        ..Impairments::default()
    });
    let before = imp.counters();
    let sampler = Sampler::start(hosts);
    let r = run_ok(
        &spec(
            hosts,
            "allreduce_sweep",
            &["--max-mib", "16", "--repeat", "0"],
            true,
        ),
        "allreduce_sweep",
    );
    let (progs, dp) = sampler.finish();
    let sw = imp.counters().since(&before);
    let r = r.unwrap_or_else(|e| panic!("{e:#}"));
    all_fast(&r, hosts, "allreduce").unwrap_or_else(|e| panic!("{e:#}"));
    let dup = dp[wire::ERAR_STAT_DUP as usize];
    eprintln!("  switch: {sw}; receivers ({progs} programs): dup={dup}");
    assert!(sw.duplicated() > 100, "too few duplicates to judge: {sw}");
    // Sampled while the job ran: the last few hundred ms may be missing.
    assert!(
        dup >= sw.duplicated() / 2,
        "the switch duplicated {} frames but the receivers dropped only {dup} duplicates",
        sw.duplicated()
    );
}

/// The chunk size the ring uses on this test bed (the datapath's one rule).
fn chunk_bytes() -> usize {
    liberar::datapath::kernel::chunk_bytes_for_mtu(testbed_config().mtu) as usize
}

/// How lost frames must have been repaired.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Repair {
    /// In the kernel, by NACKs (the default).
    Nacks,
    /// By MPI recovery rounds, NACKs off (`ERAR_NACK_US=0`).
    Rounds,
}

/// Runs `program` under `rules` (chosen-frame drops only) and checks:
/// PASS, every call of `coll` fast, every operation repaired the way
/// `repair` says (each drops its first chunk once), and every dropped frame
/// passed when re-sent.
fn chosen_drops(
    hosts: usize,
    program: &str,
    args: &[&str],
    coll: &str,
    rules: &[&str],
    repair: Repair,
) {
    let imp = Impaired::new(&Impairments {
        rules: rules
            .iter()
            .map(|r| r.parse().unwrap_or_else(|e| panic!("{e:#}")))
            .collect(),
        ..Impairments::default()
    });
    let before = imp.counters();
    let mut job = spec(hosts, program, args, true);
    if repair == Repair::Rounds {
        job = job.env("ERAR_NACK_US", "0");
    }
    let r = run_ok(&job, program);
    let sw = imp.counters().since(&before);
    let r = r.unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("  switch: {sw}");
    let stats = all_fast(&r, hosts, coll).unwrap_or_else(|e| panic!("{e:#}"));
    let fast = stats
        .iter()
        .map(|s| s.get(&format!("{coll}.fast")))
        .max()
        .unwrap_or(0);
    assert!(
        sw.rule_dropped() >= fast,
        "{fast} fast {coll}s, each with a first chunk to drop, but the switch dropped {}: {sw}",
        sw.rule_dropped()
    );
    assert!(
        sw.rule_passed() >= sw.rule_dropped(),
        "dropped frames were not re-sent through the switch: {sw}"
    );
    assert_eq!(sw.rule_full(), 0, "{sw}");
    match repair {
        Repair::Rounds => {
            for s in &stats {
                assert!(
                    s.get("recovery_rounds") >= s.get(&format!("{coll}.fast"))
                        && s.get("resend_chunks") > 0
                        && s.get("nacks") == 0,
                    "rank {}: NACKs off and every operation lost its first chunk, yet: {}",
                    s.rank,
                    s.raw
                );
            }
        }
        Repair::Nacks => {
            // The hosts downstream of a drop all stall; whichever NACKs
            // first gets the frame back. Each operation needs at least one
            // NACK burst somewhere, and no MPI round.
            let nacks: u64 = stats.iter().map(|s| s.get("nacks")).sum();
            let rounds: u64 = stats.iter().map(|s| s.get("recovery_rounds")).sum();
            assert!(
                nacks >= fast && rounds == 0,
                "{fast} fast {coll}s, each losing its first chunk, repaired by {nacks} NACK \
                 bursts and {rounds} MPI rounds:\n{}",
                stats
                    .iter()
                    .map(|s| s.raw.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
}

/// Allreduce: first, last and every 7th chunk of reduce-scatter step 0,
/// then of all-gather step 1, each frame dropped once.
#[test]
fn allreduce_chosen_frame_drops() {
    let _tb = testbed();
    // The sweep's --repeat calls are 16384..16390 ints: the last chunk's
    // index is the same for all of them.
    let cb = chunk_bytes();
    let last = (16384 * 4usize).div_ceil(cb) - 1;
    assert_eq!(last, (16390 * 4usize).div_ceil(cb) - 1);
    let args = ["--max-mib", "4", "--repeat", "40"];
    for (kind, step, repair) in [
        ("rs", 0, Repair::Nacks),
        ("ag", 1, Repair::Nacks),
        ("rs", 0, Repair::Rounds),
    ] {
        eprintln!("  {kind} step {step}: first, last ({last}), every 7th chunk; {repair:?}");
        chosen_drops(
            4,
            "allreduce_sweep",
            &args,
            "allreduce",
            &[
                &format!("kind={kind},step={step},first,op=allreduce"),
                &format!("kind={kind},step={step},last={last},op=allreduce"),
                &format!("kind={kind},step={step},every=7,rem=3,op=allreduce"),
            ],
            repair,
        );
    }
}

/// Broadcast: the root's first and last chunk and every 7th chunk of the
/// second hop (bcast_roots: the last chunk of its 4 MiB cases), once each.
#[test]
fn bcast_chosen_frame_drops() {
    let _tb = testbed();
    let last = (4usize << 20).div_ceil(chunk_bytes()) - 1;
    for repair in [Repair::Nacks, Repair::Rounds] {
        eprintln!("  {repair:?}");
        chosen_drops(
            4,
            "bcast_roots",
            &[],
            "bcast",
            &[
                "kind=ag,step=0,first,op=bcast",
                &format!("kind=ag,step=0,last={last},op=bcast"),
                "kind=ag,step=1,every=7,op=bcast",
            ],
            repair,
        );
    }
}

/// Loss in bursts, as a switch's full queue drops frames: each loss of
/// 0.01% per hop takes the next 1000 frames of its CPU with it (about 9%
/// of the frames, in runs far longer than a NACK burst asks for). Mixed
/// allreduces (int32 and float, 1 KiB to 16 MiB) and broadcasts from every
/// root on 4 hosts: the same DIGEST as MPI alone on a clean network,
/// every call on the fast path with nothing left to MPI, repaired by
/// NACKs; the switch's counters show that the losses came in bursts (a
/// share of lost frames that 0.01% of single losses cannot reach).
#[test]
fn loss_in_bursts() {
    let _tb = testbed();
    let hosts = 4;
    let bursts = Impairments {
        loss_ppm: 100,
        burst: 1000,
        ..Impairments::default()
    };
    let mixed = (MIXED_CALLS / 4).to_string();
    let args = ["--max-mib", "16", "--repeat", "0", "--mixed", &mixed];
    let job = |preload: bool| spec(hosts, "allreduce_sweep", &args, preload);
    let Swept { r, dp, sw, .. } = sweep_impaired(hosts, &bursts, job);
    let stats = all_fast(&r, hosts, "allreduce").unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        stats.iter().any(|s| s.get("nacks") > 0) && dp[wire::ERAR_STAT_NACK_SERVED as usize] > 0,
        "no NACK sent and served under bursts of loss:\n{}",
        r.tail()
    );
    // 0.01% of single losses would be 1 frame in 10,000; bursts of 1000
    // make it about 1 in 11.
    let seen = sw.lost() + sw.redirected();
    assert!(
        sw.lost() >= bursts.burst as u64 && sw.lost() * 50 >= seen,
        "the switch's losses were not in bursts: {sw}"
    );

    let imp = Impaired::new(&bursts);
    let before = imp.counters();
    let r = run_ok(
        &spec(hosts, "bcast_roots", &["--all-roots"], true),
        "bcast_roots",
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    let stats = all_fast(&r, hosts, "bcast").unwrap_or_else(|e| panic!("{e:#}"));
    let sw = imp.counters().since(&before);
    eprintln!("  broadcasts: switch: {sw}");
    assert!(sw.lost() >= bursts.burst as u64, "no burst was lost: {sw}");
    assert!(
        stats
            .iter()
            .any(|s| s.get("nacks") + s.get("recovery_rounds") > 0),
        "no broadcast was repaired under bursts of loss:\n{}",
        r.tail()
    );
}

/// 1% loss; 2, 3, 4 and 8 hosts; every root; 0 B to 4 MiB.
#[test]
fn bcast_under_loss() {
    let _tb = testbed();
    let imp = Impaired::new(&Impairments {
        loss_ppm: ONE_PERCENT,
        ..Impairments::default()
    });
    let before = imp.counters();
    let mut repairs = 0;
    for hosts in [2, 3, 4, 8] {
        let r = run_ok(
            &spec(hosts, "bcast_roots", &["--all-roots"], true),
            "bcast_roots",
        )
        .unwrap_or_else(|e| panic!("{hosts} hosts: {e:#}"));
        let stats = all_fast(&r, hosts, "bcast").unwrap_or_else(|e| panic!("{e:#}"));
        repairs += stats
            .iter()
            .map(|s| s.get("nacks") + s.get("recovery_rounds"))
            .max()
            .unwrap_or(0);
        eprintln!(
            "  {hosts} hosts: rank 0: {}",
            stats
                .iter()
                .find(|s| s.rank == 0)
                .map(|s| s.raw.as_str())
                .unwrap_or("")
        );
    }
    let sw = imp.counters().since(&before);
    eprintln!("  switch: {sw}");
    assert!(sw.lost() > 0, "nothing was lost: {sw}");
    assert!(repairs > 0, "no NACK and no recovery round at 1% loss");
}

/// The `reproducible` contract when the ring gives up: every datapath frame
/// is lost, so every call on the ring stalls (`ERAR_STALL_MS`) and MPI
/// completes it, exactly. `c-tests/reproducible` checks each result against
/// the correctly rounded sum; the digest must be the clean network's, every
/// call must have fallen back (`fallback_bytes`) and been completed by the
/// exact MPI path (`exact_mpi`). The stalled job runs without NACKs
/// (`ERAR_NACK_US=0`): on a ring that runs alone a float SUM, like an exact
/// operation, never falls back once past its barrier in the kernel (which
/// no frame crosses here: it would wait for the prober's error), so the
/// fallback after a stall is the verdict's, on rings that have one. Nor
/// does the ring's setup check that the hosts answer its probes
/// (`ERAR_PROBE_MS=0`): on a network that drops every datapath frame from
/// the start the rings would decline and MPI carry every call
/// (`faults::a_network_that_drops_the_frames_leaves_every_call_to_mpi`),
/// while this test is about a ring that gives up once it runs.
#[test]
fn reproducible_after_a_stall() {
    let _tb = testbed();
    let program = "reproducible";
    let job = |stall: bool| {
        let s = spec(4, program, &[], true).env("ERAR_PRECISION", "reproducible");
        if stall {
            s.env("ERAR_STALL_MS", "100")
                .env("ERAR_NACK_US", "0")
                .env("ERAR_PROBE_MS", "0")
        } else {
            s
        }
    };
    let clean = run_ok(&job(false), program).unwrap_or_else(|e| panic!("{e:#}"));
    let imp = Impaired::new(&Impairments {
        loss_ppm: wire::ERAR_PPM,
        ..Impairments::default()
    });
    let lost = run_ok(&job(true), program);
    drop(imp);
    let lost = lost.unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        digest(&lost).unwrap_or_else(|e| panic!("{e:#}")),
        digest(&clean).unwrap_or_else(|e| panic!("{e:#}")),
        "other bits after the ring fell back"
    );
    let stats = lost.stats();
    rust_tests::check_stats_per_rank(&stats, 4).unwrap_or_else(|e| panic!("{e:#}"));
    for s in &stats {
        assert!(
            s.get("allreduce.fast") > 0
                && s.get("fallback_bytes") >= s.get("allreduce.fast_bytes")
                && s.get("exact_mpi") >= s.get("allreduce.fast"),
            "rank {}: not every call fell back to the exact MPI path: {}",
            s.rank,
            s.raw
        );
    }
}
