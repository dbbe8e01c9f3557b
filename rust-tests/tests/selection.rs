//! Routing by measurement (`liberar::select`), proven by the counters of
//! real jobs on the test bed at liberar's defaults: each size class of a
//! communicator makes its trials (three calls on MPI, three on the fast path),
//! then every rank takes the path the agreed times say was faster, and all
//! ranks route every call the same way even when one rank's clock says
//! otherwise. Timings are never asserted: `ERAR_TEST_SLOW_FAST` scales what
//! the ranks report of their fast-path trials by a factor far beyond any
//! noise, so the decision that must follow is known in advance.

use anyhow::{ensure, Result};
use erarctl::testbed::LaunchSpec;
use liberar::select::TRIALS;
use rust_tests::{end_grace, job_timeout, run_job, shim_path, testbed, JobResult, Mpi, StatsLine};

/// 512 KiB .. 8 MiB: five classes at or above the default floors (64 KiB
/// for allreduces, 512 KiB for broadcasts).
const SIZES: &str = "524288:8388608";
const CLASSES: u64 = 5;
/// Calls per size: 2 warm-up + 8 timed + 1 for --check.
const CALLS: u64 = 11;

fn bench(mode: &str, slow_fast: Option<&str>) -> Result<JobResult> {
    let dir = rust_tests::repo_root().join("benchmarks");
    let built = std::process::Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(&dir)
        .arg("MPI=openmpi")
        .status()?;
    ensure!(built.success(), "make -C benchmarks MPI=openmpi failed");
    let prog = dir.join("bin").join("openmpi").join("allreduce_bench");
    let argv = [
        &*prog.to_string_lossy(),
        "--mode",
        mode,
        "-m",
        SIZES,
        "-i",
        "8",
        "-I",
        "8",
        "-x",
        "2",
        "-T",
        "int",
        "--check",
    ]
    .map(std::ffi::OsString::from)
    .to_vec();
    let mut spec = LaunchSpec::new(Mpi::Openmpi, 4, argv)
        .env("ERAR_STATS", "1")
        .timeout(job_timeout())
        .end_marker("# check:", end_grace())
        .preload(shim_path(Mpi::Openmpi));
    if let Some(f) = slow_fast {
        spec = spec.env("ERAR_TEST_SLOW_FAST", f);
    }
    let r = run_job(&spec)?;
    ensure!(
        r.finalize_hung || r.output.status.success(),
        "exit status {}\n{}",
        r.output.status,
        r.tail()
    );
    ensure!(
        r.stdout.contains("# check: all results correct"),
        "allreduce_bench --check did not find every result correct\n{}",
        r.tail()
    );
    Ok(r)
}

/// The `chosen=` list of a stats line: (kind, class bytes, path).
fn chosen(s: &StatsLine) -> Vec<(String, u64, String)> {
    let Some(list) = s
        .raw
        .split_whitespace()
        .find_map(|t| t.strip_prefix("chosen="))
    else {
        return Vec::new();
    };
    list.split(',')
        .filter_map(|item| {
            let (head, rest) = item.split_once(':')?;
            let (kind, bytes) = head.split_once('@')?;
            let path = rest.split(':').next()?;
            Some((kind.to_owned(), bytes.parse().ok()?, path.to_owned()))
        })
        .collect()
}

/// Every rank routed every call alike: same counters, same decisions, and
/// one decision per class, in the order the sizes were called.
fn same_on_every_rank(r: &JobResult, coll: &str, kind: &str) -> Result<Vec<StatsLine>> {
    let stats = r.stats();
    ensure!(
        stats.len() == 4,
        "{} stats lines for 4 ranks\n{}",
        stats.len(),
        r.tail()
    );
    let first = &stats[0];
    for s in &stats {
        for key in ["fast", "pmpi"] {
            let k = format!("{coll}.{key}");
            ensure!(
                s.get(&k) == first.get(&k),
                "rank {} counted {k}={}, rank {} {}: ranks routed calls differently\n{}\n{}",
                s.rank,
                s.get(&k),
                first.rank,
                first.get(&k),
                s.raw,
                first.raw
            );
        }
        ensure!(
            s.reasons == first.reasons,
            "ranks {} and {} differ in reasons\n{}\n{}",
            s.rank,
            first.rank,
            s.raw,
            first.raw
        );
        ensure!(
            chosen(s) == chosen(first),
            "ranks {} and {} decided differently\n{}\n{}",
            s.rank,
            first.rank,
            s.raw,
            first.raw
        );
    }
    let decided = chosen(first);
    let want: Vec<u64> = (0..CLASSES).map(|i| 524288 << i).collect();
    ensure!(
        decided.iter().map(|(_, b, _)| *b).collect::<Vec<_>>() == want
            && decided.iter().all(|(k, _, _)| k == kind),
        "expected one {kind} decision per class {want:?}: {}",
        first.raw
    );
    ensure!(
        first.raw.contains(&format!(
            " select={}",
            "allreduce:measured>=65536,allreduce.f32.sum:measured>=65536,bcast:measured>=524288"
        )),
        "not at the default routing: {}",
        first.raw
    );
    Ok(stats)
}

/// What the counters must say when every class went to `path` after its
/// trials: 3 MPI trials and 3 fast trials per class, the rest on `path`.
fn check_counts(s: &StatsLine, coll: &str, path: &str) -> Result<()> {
    let per_path = u64::from(TRIALS / 2);
    let decided = CLASSES * (CALLS - u64::from(TRIALS));
    let trial = s
        .reasons
        .get(&format!("{coll}.trial"))
        .copied()
        .unwrap_or(0);
    let slower = s
        .reasons
        .get(&format!("{coll}.measured_slower"))
        .copied()
        .unwrap_or(0);
    let fast = s.get(&format!("{coll}.fast"));
    let (want_fast, want_slower) = if path == "fast" {
        (CLASSES * per_path + decided, 0)
    } else {
        (CLASSES * per_path, decided)
    };
    ensure!(
        trial == CLASSES * per_path && fast == want_fast && slower == want_slower,
        "rank {}: expected {} MPI trials, {want_fast} fast calls and {want_slower} measured_slower \
         with every class on {path}; got {trial}, {fast}, {slower}: {}",
        s.rank,
        CLASSES * per_path,
        s.raw
    );
    for (kind, bytes, p) in chosen(s) {
        ensure!(p == path, "{kind}@{bytes} chose {p}, not {path}: {}", s.raw);
    }
    Ok(())
}

fn expect_all(mode: &str, kind: &str, slow_fast: &str, path: &str) {
    let _tb = testbed();
    let r = bench(mode, Some(slow_fast)).unwrap_or_else(|e| panic!("{e:#}"));
    let stats = same_on_every_rank(&r, mode, kind).unwrap_or_else(|e| panic!("{e:#}"));
    for s in &stats {
        check_counts(s, mode, path).unwrap_or_else(|e| panic!("{e:#}"));
    }
    // Rank 0's summary for people, once per job: an estimate of the time
    // saved exactly when calls ran on the fast path after their class was
    // measured.
    let text = format!("{}\n{}", r.stdout, r.stderr);
    assert_eq!(
        text.matches("liberar: job summary (4 ranks").count(),
        1,
        "one job summary wanted:\n{}",
        r.tail()
    );
    let estimated = text.contains("liberar: time saved against MPI's measured time");
    assert_eq!(
        estimated,
        path == "fast",
        "the time-saved line does not match the routing ({path}):\n{}",
        r.tail()
    );
}

/// Fast-path trials reported 1000x slower: every class stays on MPI after
/// its trials, and nothing else runs on the fast path.
#[test]
fn a_slower_fast_path_is_not_used() {
    expect_all("allreduce", "allreduce.i32", "1000", "mpi");
}

/// Fast-path trials reported 1000x faster: every class takes the fast path.
#[test]
fn a_faster_fast_path_is_used() {
    expect_all("allreduce", "allreduce.i32", "0.001", "fast");
    expect_all("bcast", "bcast", "0.001", "fast");
}

/// Only rank 1 sees the fast path as 1000x slower. The ranks agree on the
/// slowest rank's times, so all of them keep every class on MPI: no rank
/// routes a call differently from the others.
#[test]
fn one_rank_cannot_route_differently() {
    expect_all("allreduce", "allreduce.i32", "1000@1", "mpi");
}

/// At the real timings, whatever they are: trials on every class, then
/// one decision per class that every rank shares, and right results.
#[test]
fn unbiased_decisions_are_shared() {
    let _tb = testbed();
    let r = bench("allreduce", None).unwrap_or_else(|e| panic!("{e:#}"));
    let stats =
        same_on_every_rank(&r, "allreduce", "allreduce.i32").unwrap_or_else(|e| panic!("{e:#}"));
    for s in &stats {
        let per_path = u64::from(TRIALS / 2);
        let trial = s.reasons.get("allreduce.trial").copied().unwrap_or(0);
        assert_eq!(trial, CLASSES * per_path, "MPI trials per class: {}", s.raw);
        assert!(
            s.get("allreduce.fast") >= CLASSES * per_path,
            "fast trials per class: {}",
            s.raw
        );
    }
}
