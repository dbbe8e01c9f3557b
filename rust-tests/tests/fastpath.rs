//! The eBPF fast path itself, proven by the counters: with the size
//! threshold at 1 byte, every allreduce of `allreduce_sweep` (1 element to
//! 16 MiB — 256 MiB on 4 hosts — sizes that are not multiples of the chunk,
//! in place and not, 1000 back-to-back calls) must complete on the datapath
//! with exact results, on 2, 3, 4 and 8 hosts; and the numerics report must
//! find liberar's float SUM within its contract, element by element, on the
//! same inputs (bounded: the ordered sum's worst case; reproducible: the
//! correctly rounded sum).

use anyhow::{ensure, Result};
use erarctl::testbed::LaunchSpec;
use rust_tests::{
    ctests, end_grace, job_timeout, run_job, shim_path, testbed, JobResult, Mpi, StatsLine,
};
use std::path::PathBuf;

fn program(mpi: Mpi, dir: &str, name: &str) -> PathBuf {
    rust_tests::repo_root()
        .join(dir)
        .join("bin")
        .join(mpi.name())
        .join(name)
}

/// `benchmarks/`, with its programs built for Open MPI.
fn benchmarks_built() -> PathBuf {
    let dir = rust_tests::repo_root().join("benchmarks");
    let built = std::process::Command::new("make")
        .arg("-C")
        .arg(&dir)
        .arg("MPI=openmpi")
        .status()
        .expect("running make -C benchmarks");
    assert!(built.success(), "make -C benchmarks MPI=openmpi failed");
    dir
}

fn sweep(mpi: Mpi, hosts: usize, args: &[&str]) -> Result<JobResult> {
    ctests(mpi); // builds c-tests/bin/<mpi>/allreduce_sweep
    let mut argv = vec![program(mpi, "c-tests", "allreduce_sweep").into_os_string()];
    argv.extend(args.iter().map(Into::into));
    let spec = LaunchSpec::new(mpi, hosts, argv)
        .env("ERAR_STATS", "1")
        .env("ERAR_MIN_BYTES", "1")
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace())
        .preload(shim_path(mpi));
    let r = run_job(&spec)?;
    ensure!(
        r.passes().iter().any(|p| p == "PASS allreduce_sweep"),
        "allreduce_sweep did not pass\n{}",
        r.tail()
    );
    ensure!(
        r.finalize_hung || r.output.status.success(),
        "exit status {}\n{}",
        r.output.status,
        r.tail()
    );
    Ok(r)
}

/// Every rank: every allreduce took the fast path (none went to PMPI).
fn all_fast(r: &JobResult, hosts: usize) -> Result<()> {
    let stats = r.stats();
    ensure!(
        stats.len() == hosts,
        "{} stats lines for {hosts} ranks\n{}",
        stats.len(),
        r.tail()
    );
    for s in &stats {
        ensure!(
            s.get("allreduce.fast") > 0 && s.get("allreduce.pmpi") == 0,
            "rank {}: not every allreduce took the fast path: {}",
            s.rank,
            s.raw
        );
    }
    Ok(())
}

fn openmpi_sweep(hosts: usize, args: &[&str]) {
    let _tb = testbed();
    let r = sweep(Mpi::Openmpi, hosts, args).unwrap_or_else(|e| panic!("{e:#}"));
    all_fast(&r, hosts).unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn sweep_2_hosts() {
    openmpi_sweep(2, &[]);
}

#[test]
fn sweep_3_hosts() {
    openmpi_sweep(3, &[]);
}

#[test]
fn sweep_4_hosts_up_to_256_mib() {
    openmpi_sweep(4, &["--max-mib", "256", "--repeat", "1000"]);
}

#[test]
fn sweep_8_hosts() {
    openmpi_sweep(8, &["--max-mib", "4"]);
}

#[test]
fn sweep_mpich_3_hosts() {
    let _tb = testbed();
    let r = sweep(Mpi::Mpich, 3, &["--quick"]).unwrap_or_else(|e| panic!("{e:#}"));
    all_fast(&r, 3).unwrap_or_else(|e| panic!("{e:#}"));
}

/// Runs the numerics report (float SUM, element by element against the
/// exact sum, 7 input families, 2^20 elements each) through liberar on
/// `hosts` hosts (one rank each) under `precision` (None: the default
/// contract); see [`numerics_report_placed`].
fn numerics_report(hosts: usize, precision: Option<&str>) -> JobResult {
    numerics_report_placed(&vec![1; hosts], precision, &[])
}

/// The numerics report with `counts[h]` ranks on host h. The
/// program fails the job unless every element meets the contract, results
/// are bitwise identical on every rank and the same on a repeated call,
/// and IEEE specials come out as MPI gives them. `env`: more settings.
fn numerics_report_placed(
    counts: &[usize],
    precision: Option<&str>,
    env: &[(&str, &str)],
) -> JobResult {
    let _tb = testbed();
    benchmarks_built();
    let argv = vec![program(Mpi::Openmpi, "benchmarks", "numerics_report").into_os_string()];
    let mut spec = LaunchSpec::new(Mpi::Openmpi, counts.len(), argv)
        .ranks_per_host(counts.to_vec())
        .env("ERAR_STATS", "1")
        // Compares the fast path's sums with MPI's: every call takes it,
        // on shared hosts too (the report's 4 MiB calls are below the node
        // path's float floor, which is about speed, not results).
        .env("ERAR_SELECT", "threshold")
        .env("ERAR_NODE_FLOAT_MIN", "0")
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace())
        .preload(shim_path(Mpi::Openmpi));
    if let Some(p) = precision {
        spec = spec.env("ERAR_PRECISION", p);
    }
    for &(k, v) in env {
        spec = spec.env(k, v);
    }
    let r = run_job(&spec).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("{}", r.stdout);
    assert!(
        r.output.status.success() && r.passes().iter().any(|p| p == "PASS numerics_report"),
        "numerics report failed ({counts:?} ranks per host, {precision:?})\n{}",
        r.tail()
    );
    for s in r.stats() {
        assert!(
            s.get("allreduce.fast") > 0,
            "the report did not run through liberar: {}",
            s.raw
        );
    }
    r
}

/// The default contract, bounded: every element within the ordered sum's
/// worst case (n-1)·2^-24·Σ|x|. On 3 hosts the certificate fails some
/// elements of these families (values far below their block's maximum on
/// every rank), so the exact repair must have run, and the report's second
/// call of each family must give the first call's bits (the report checks
/// that). Twice: on the default ring, which runs float SUM alone (no
/// verdict: the repair is the call's one exchange), and on a ring without
/// NACKs, whose second call of each family finds the repair count of the
/// first, so its verdict carries the repairs (`repairs_carried`).
#[test]
fn numerics_bounded_on_3_hosts_with_repairs() {
    for nack_us in ["200", "0"] {
        let env = [("ERAR_NACK_US", nack_us)];
        let r = numerics_report_placed(&[1; 3], None, &env);
        for s in r.stats() {
            let carried = s.get("repairs_carried");
            assert!(
                s.get("repaired") > 0 && (carried > 0) == (nack_us == "0"),
                "ERAR_NACK_US={nack_us}: no element was repaired, or verdicts carried \
                 repairs where there are none, or none where there are: {}",
                s.raw
            );
        }
    }
}

#[test]
fn numerics_bounded_on_4_hosts() {
    numerics_report(4, None);
}

/// Several ranks per host: float SUM on the node path, whose slice
/// leaders hand their rings every local input, encoded on scales agreed
/// for the whole communicator's size. The same report, so the same checks
/// (every element within the bound for n = all ranks, bitwise identical on
/// every rank, deterministic, specials as MPI gives them), and from the
/// counters: on every rank, every fast call went through the node path;
/// on every rank that led slices, the repairs ran and the blocks no
/// integer grid carries (the specials family) were left to MPI over the
/// whole communicator (`fallback_bytes`, counted where the ring found
/// them); and on every host a rank led slices.
fn numerics_on_the_node_path(counts: &[usize]) {
    let r = numerics_report_placed(counts, None, &[]);
    let stats = r.stats();
    let mut rank = 0;
    for (h, &k) in counts.iter().enumerate() {
        let host = &stats_of(&stats, rank..rank + k);
        for s in host {
            let led = s.get("node_led") > 0;
            assert!(
                s.get("node_calls") == s.get("allreduce.fast")
                    && (!led || (s.get("repaired") > 0 && s.get("fallback_bytes") > 0)),
                "expected every fast call on the node path (node_calls = allreduce.fast) \
                 and, on a slice leader, repairs and blocks left to MPI (repaired, \
                 fallback_bytes > 0): {}",
                s.raw
            );
        }
        assert!(
            host.iter().any(|s| s.get("node_led") > 0),
            "no rank of host {h} led a slice: {:?}",
            host.iter().map(|s| &s.raw).collect::<Vec<_>>()
        );
        rank += k;
    }
}

fn stats_of(stats: &[StatsLine], ranks: std::ops::Range<usize>) -> Vec<StatsLine> {
    let of = |s: &&StatsLine| ranks.contains(&(s.rank as usize));
    let v: Vec<StatsLine> = stats.iter().filter(of).cloned().collect();
    assert_eq!(
        v.len(),
        ranks.len(),
        "a statistics line per rank of {ranks:?}"
    );
    v
}

#[test]
fn numerics_bounded_with_two_ranks_per_host() {
    numerics_on_the_node_path(&[2, 2, 2, 2]);
}

#[test]
fn numerics_bounded_with_unequal_ranks_per_host() {
    numerics_on_the_node_path(&[3, 1, 2]);
}

/// `reproducible`: every element the correctly rounded exact sum (checked
/// against GMP), so never further from it than MPI; on 3 hosts, where blocks
/// too wide for one i64 grid are summed from every rank's gathered inputs.
#[test]
fn numerics_reproducible_correctly_rounded() {
    let r = numerics_report(3, Some("reproducible"));
    for s in r.stats() {
        assert!(
            s.get("exact_gathered") > 0,
            "no wide block was summed from gathered inputs: {}",
            s.raw
        );
    }
}

/// Steady state, counted by the `exchanges` field: no call on a ring whose
/// ranks all have NACKs on makes an MPI exchange. An integer call meets the
/// other hosts in the kernel and runs alone past that barrier (no
/// verdict); so does a float SUM call, whose block summaries are what they
/// were on the previous call on every rank (it reuses the scales: one
/// kernel barrier a call), or, with `--vary` (every call's data scaled by 2
/// or 1/2 in turn, as gradients change between steps), new on every rank:
/// the ranks then agree on scales through the ring itself, a MAX of their
/// summaries run alone, before the data (two kernel barriers a call). With
/// `--vary-rank 0` only rank 0's summaries change: the ranks join the
/// kernel barrier differently, it aborts (`kernel_aborts`), and every call
/// after the first agrees over MPI, with `--check`'s result exact. A float
/// MAX runs alone too, unless a rank's data holds a NaN (`--nan-rank 0`),
/// which it says in its key: the barrier aborts and the ranks let MPI
/// complete the call (`fallback_bytes`). The benchmark repeats one buffer
/// 30 times.
#[test]
fn steady_calls_make_no_exchanges() {
    let _tb = testbed();
    benchmarks_built();
    // (type, extra arguments, kernel barriers a call, whether they abort)
    let cases: [(&str, &[&str], u64, bool); 6] = [
        ("float", &[], 1, false),
        ("float", &["--vary"], 2, false),
        ("int", &[], 1, false),
        ("float", &["--op", "max"], 1, false),
        ("float", &["--vary-rank", "0", "--check"], 0, true),
        ("float", &["--op", "max", "--nan-rank", "0"], 0, true),
    ];
    for (ty, extra, barriers_per_call, aborts) in cases {
        let mut argv = vec![
            program(Mpi::Openmpi, "benchmarks", "allreduce_bench").into_os_string(),
            "-m".into(),
            "1048576:1048576".into(),
            "-I".into(),
            "30".into(),
            "-x".into(),
            "0".into(),
            "-T".into(),
            ty.into(),
        ];
        argv.extend(extra.iter().map(Into::into));
        let spec = LaunchSpec::new(Mpi::Openmpi, 4, argv)
            .env("ERAR_STATS", "1")
            .env("ERAR_SELECT", "threshold")
            .timeout(job_timeout())
            .preload(shim_path(Mpi::Openmpi));
        let r = run_job(&spec).unwrap_or_else(|e| panic!("{e:#}"));
        let ty = format!("{ty} {}", extra.join(" "));
        assert!(r.output.status.success(), "{ty}: job failed\n{}", r.tail());
        for s in r.stats() {
            let (fast, ex) = (s.get("allreduce.fast"), s.get("exchanges"));
            let (passed, aborted) = (s.get("kernel_barriers"), s.get("kernel_aborts"));
            assert!(fast >= 30, "{ty}: only {fast} fast calls: {}", s.raw);
            if aborts {
                // Every call but, for SUM, the first (no agreement yet:
                // every rank joins with its summaries) and --check's; each
                // then met over MPI (2 exchanges at least: barrier and
                // verdict, or the fallback's own MPI call).
                assert!(
                    aborted + 2 >= fast && ex >= 2 * aborted,
                    "{ty}: {aborted} aborted kernel barriers, {ex} exchanges for {fast} \
                     calls: {}",
                    s.raw
                );
                if extra.contains(&"--nan-rank") {
                    assert!(
                        s.get("fallback_bytes") >= 30 << 20,
                        "{ty}: MPI did not complete the calls with a NaN: {}",
                        s.raw
                    );
                }
            } else {
                assert!(
                    passed >= barriers_per_call * fast && aborted == 0,
                    "{ty}: {passed} kernel barriers ({aborted} aborted) for {fast} calls: {}",
                    s.raw
                );
                // None per call; ring setup makes 3.
                assert!(ex <= 4, "{ty}: {ex} exchanges for {fast} calls: {}", s.raw);
            }
        }
        if extra.contains(&"--check") {
            assert!(
                r.stdout.contains("# check: all results correct"),
                "{ty}: the checked result was wrong\n{}",
                r.tail()
            );
        }
    }
}

/// `allreduce_big` on 4 hosts under fixed routing and `ERAR_SEGMENT_BYTES
/// = segment_bytes`: it passes (the program checks every result) with
/// every call on the fast path. Returns its stats lines.
fn allreduce_big_stats(segment_bytes: &str) -> Vec<StatsLine> {
    ctests(Mpi::Openmpi);
    let argv = vec![program(Mpi::Openmpi, "c-tests", "allreduce_big").into_os_string()];
    let spec = LaunchSpec::new(Mpi::Openmpi, 4, argv)
        .env("ERAR_STATS", "1")
        .env("ERAR_SELECT", "threshold")
        .env("ERAR_SEGMENT_BYTES", segment_bytes)
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace())
        .preload(shim_path(Mpi::Openmpi));
    let r = run_job(&spec).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        r.passes().iter().any(|p| p == "PASS allreduce_big"),
        "ERAR_SEGMENT_BYTES={segment_bytes}: allreduce_big did not pass\n{}",
        r.tail()
    );
    all_fast(&r, 4).unwrap_or_else(|e| panic!("{e:#}"));
    r.stats()
}

/// `ERAR_SEGMENT_BYTES`: an exact allreduce larger than it runs as equal
/// segments, one kernel barrier each. `allreduce_big`'s two 16 MiB int SUMs
/// of 4M+3 elements (in place and not; a partial last chunk) run as 17
/// segments of 1 MiB instead of one slot, and every result is right (the
/// program checks each against its own reference); its float calls are
/// not segmented. Fails if the setting is ignored (16 barriers fewer a
/// call), if segments overlap or leave a gap (wrong results), or if a
/// segmented call leaves the fast path.
#[test]
fn exact_calls_in_cache_sized_segments() {
    let _tb = testbed();
    let whole = allreduce_big_stats("0");
    let segmented = allreduce_big_stats("1048576");
    for s in &segmented {
        let w = whole
            .iter()
            .find(|w| w.rank == s.rank)
            .unwrap_or_else(|| panic!("rank {}: no stats line without segments", s.rank));
        let calls = |st: &StatsLine| st.get("allreduce.fast");
        let joins = |st: &StatsLine| st.get("kernel_barriers") + st.get("kernel_aborts");
        assert_eq!(calls(w), calls(s), "rank {}: fast calls differ", s.rank);
        assert!(
            joins(s) >= joins(w) + 2 * 16,
            "rank {}: {} kernel barriers in 1 MiB segments, {} whole: not 16 more for each \
             of the two 16 MiB int calls\n  {}\n  {}",
            s.rank,
            joins(s),
            joins(w),
            s.raw,
            w.raw
        );
    }
}

/// `ERAR_SEGMENT_BYTES=auto` (the default; set here so that the test
/// holds whatever the environment says): the tuner (ring/tune.rs) runs
/// `allreduce_big`'s twelve back-to-back exact calls of 4 MiB and 8 MiB
/// (int and int64 SUM, MAX, MIN, some in place) some whole and some in
/// 1 MiB segments, the same ones on every rank, and every result is right
/// (the program checks each). Fails if no call of a class is ever tried
/// in segments (the class's third and fourth calls are), if the ranks'
/// choices differ (their `segmented` counts, or a kernel barrier aborting
/// on the segment length in the key), if a result is wrong, or if the
/// tuning makes an MPI exchange (more than with every call whole).
#[test]
fn the_tuner_cuts_exact_calls_alike_on_every_rank() {
    let _tb = testbed();
    let stats = allreduce_big_stats("auto");
    let segmented: Vec<u64> = stats.iter().map(|s| s.get("segmented")).collect();
    // The 4 MiB class (nine calls) tries segments in its third and fourth,
    // the 8 MiB one (three) in its third; the first two of each run whole,
    // as do the two 16 MiB calls before them (a class of their own).
    assert!(
        segmented.iter().all(|&n| (3..=8).contains(&n)),
        "segmented calls per rank: {segmented:?}"
    );
    assert!(
        segmented.iter().all(|&n| n == segmented[0]),
        "the ranks cut the calls differently: {segmented:?}"
    );
    // No exchange added: as many as when every call runs whole.
    let whole = allreduce_big_stats("0");
    for s in &stats {
        assert_eq!(s.get("kernel_aborts"), 0, "rank {}: {}", s.rank, s.raw);
        let w = whole
            .iter()
            .find(|w| w.rank == s.rank)
            .unwrap_or_else(|| panic!("rank {}: no stats line with whole calls", s.rank));
        assert_eq!(
            s.get("exchanges"),
            w.get("exchanges"),
            "rank {}: tuned\n  {}\nwhole\n  {}",
            s.rank,
            s.raw,
            w.raw
        );
    }
}

/// `ERAR_TRACE`: every rank writes its timeline, one `call` and one `end`
/// mark per fast call, one `joined` per kernel barrier, in time order; and
/// `benchmarks/timeline` lines the four ranks up. Fails if a mark is
/// dropped or doubled, a rank writes nothing, or the script cannot read
/// what the ranks wrote.
#[test]
fn a_trace_has_every_fast_call_of_every_rank() {
    let _tb = testbed();
    let dir = benchmarks_built();
    let out = std::env::temp_dir().join(format!("liberar-trace-{}", std::process::id()));
    std::fs::create_dir_all(&out).expect("creating the trace directory");
    let prefix = out.join("tl");
    let argv = vec![
        program(Mpi::Openmpi, "benchmarks", "allreduce_bench").into_os_string(),
        "-m".into(),
        "1048576:1048576".into(),
        "-I".into(),
        "20".into(),
        "-T".into(),
        "int".into(),
    ];
    let spec = LaunchSpec::new(Mpi::Openmpi, 4, argv)
        .env("ERAR_STATS", "1")
        .env("ERAR_SELECT", "threshold")
        .env("ERAR_TRACE", prefix.to_str().expect("a UTF-8 temp path"))
        .timeout(job_timeout())
        .preload(shim_path(Mpi::Openmpi));
    let r = run_job(&spec).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(r.output.status.success(), "job failed\n{}", r.tail());
    let stats = r.stats();
    assert_eq!(stats.len(), 4, "stats lines\n{}", r.tail());
    for s in &stats {
        let path = format!("{}.{}", prefix.display(), s.rank);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("rank {}: {path}: {e}", s.rank));
        let marks: Vec<(&str, u64)> = text
            .lines()
            .map(|l| {
                let (name, ns) = l.split_once(' ').expect("`name ns` lines");
                (name, ns.parse().expect("a time in ns"))
            })
            .collect();
        let count = |name: &str| marks.iter().filter(|(n, _)| *n == name).count() as u64;
        let fast = s.get("allreduce.fast");
        assert!(fast >= 20, "rank {}: {fast} fast calls: {}", s.rank, s.raw);
        assert_eq!(count("call"), fast, "rank {}: call marks", s.rank);
        assert_eq!(count("end"), fast, "rank {}: end marks", s.rank);
        let joins = s.get("kernel_barriers") + s.get("kernel_aborts");
        assert_eq!(count("joined"), joins, "rank {}: joined marks", s.rank);
        assert!(count("agree") >= fast, "rank {}: barriers passed", s.rank);
        assert!(
            marks.windows(2).all(|w| w[0].1 <= w[1].1),
            "rank {}: marks out of time order",
            s.rank
        );
    }
    let lined = std::process::Command::new(dir.join("timeline"))
        .arg(&prefix)
        .args(["--skip", "2"])
        .output()
        .expect("running benchmarks/timeline");
    let shown = String::from_utf8_lossy(&lined.stdout);
    assert!(
        lined.status.success() && shown.contains("calls lined up on 4 ranks"),
        "benchmarks/timeline: {}\n{shown}{}",
        lined.status,
        String::from_utf8_lossy(&lined.stderr)
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Broadcasts in place (ERAR_ZERO_COPY, datapath/kernel/region.rs) are the
/// default and only that: `bcast_roots` (whose one buffer broadcast again
/// and again is forked, dropped with MADV_DONTNEED and mapped anew between
/// calls) gives the same digest with the setting off, every rank's
/// broadcasts then all copy through the slots, and with it on (the
/// default) some ran in place on every rank, in regions reused too.
#[test]
fn broadcasts_in_place_by_default_only() {
    in_place_by_default_only("bcast_roots", "bcast.fast", "bcast_in_place", None);
}

/// Allreduces in place likewise (datapath/ring/registered.rs):
/// `allreduce_reused`, whose pair of buffers is forked, dropped, swapped,
/// broadcast and mapped anew between calls, then pairs of other sizes.
/// Its region maps are sized by class: at their most they are the largest
/// pair's (12 MiB buffers), two maps of 16 MiB and 32 KiB, the maps of the
/// pairs before dropped first (a single 64 MiB class held 128 MiB for any
/// pair; a 12 MiB pair that never ran in place would leave less).
#[test]
fn allreduces_in_place_by_default_only() {
    const LARGEST_PAIR_KIB: u64 = 2 * (16 * 1024 + 32);
    in_place_by_default_only(
        "allreduce_reused",
        "allreduce.fast",
        "allreduce_in_place",
        Some(LARGEST_PAIR_KIB),
    );
}

/// The c-test `program` under Open MPI on 4 hosts, with ERAR_ZERO_COPY
/// on (the default) and off: the same digest; on, every rank ran some of
/// its calls in place (`counter`) in regions reused too, its region maps
/// holding `peak_kib` at most (if given); off, none, and some on the fast
/// path (`fast`).
fn in_place_by_default_only(program: &str, fast: &str, counter: &str, peak_kib: Option<u64>) {
    let _tb = testbed();
    let test = ctests(Mpi::Openmpi)
        .into_iter()
        .find(|t| t.name == program)
        .unwrap_or_else(|| panic!("c-tests/{program}"));
    let run = |zero_copy: Option<&str>| {
        let mut spec = LaunchSpec::new(Mpi::Openmpi, 4, vec![test.path.clone().into_os_string()])
            .env("ERAR_STATS", "1")
            .env("ERAR_SELECT", "threshold")
            .timeout(job_timeout())
            .end_marker("PASS ", end_grace())
            .preload(shim_path(Mpi::Openmpi));
        if let Some(v) = zero_copy {
            spec = spec.env("ERAR_ZERO_COPY", v);
        }
        let r = run_job(&spec).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(
            r.passes().contains(&format!("PASS {program}")),
            "ERAR_ZERO_COPY={zero_copy:?}: no PASS\n{}",
            r.tail()
        );
        r
    };
    let (on, off) = (run(None), run(Some("0")));
    assert_eq!(
        on.digests(),
        off.digests(),
        "digests differ\n{}\n{}",
        on.tail(),
        off.tail()
    );
    assert_eq!(on.stats().len(), 4, "stats lines\n{}", on.tail());
    for s in on.stats() {
        assert!(
            s.get(counter) > 0,
            "default: rank {} none in place: {}",
            s.rank,
            s.raw
        );
        // Its buffers after the first go into the map the ones before
        // had (not all: bcast_roots' `run_moved` moves a buffer's pages).
        assert!(
            s.get("regions_reused") > 0,
            "default: rank {} reused no region: {}",
            s.rank,
            s.raw
        );
        if let Some(peak) = peak_kib {
            assert_eq!(
                s.get("region_peak_kib"),
                peak,
                "default: rank {}'s region maps at their most: {}",
                s.rank,
                s.raw
            );
        }
    }
    assert_eq!(off.stats().len(), 4, "stats lines\n{}", off.tail());
    for s in off.stats() {
        assert!(
            s.get(fast) > 0,
            "off: rank {} no fast call: {}",
            s.rank,
            s.raw
        );
        assert_eq!(
            s.get(counter),
            0,
            "off: rank {} ran in place: {}",
            s.rank,
            s.raw
        );
    }
}
