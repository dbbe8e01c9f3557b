//! Erroneous calls (issue #4, item 5): `c-tests/bad_input` makes them on
//! every rank with MPI_ERRORS_RETURN — negative count, NULL buffers,
//! MPI_COMM_NULL, MPI_OP_NULL, MPI_DATATYPE_NULL, ops a type lacks,
//! misplaced MPI_IN_PLACE, aliased buffers, uncommitted datatypes, roots out
//! of range — each followed by a large valid call on the same communicator,
//! and folds the returned error classes into its DIGEST. So, for each MPI:
//! the run without liberar, the run with it, and the run with it and both
//! thresholds at 1 byte (every erroneous call then reaches the fast-path
//! decision code) must all pass (no crash, no hang, buffers of failed calls
//! untouched, nothing written outside them) with the same DIGEST: the same
//! error classes as MPI itself, and right results afterwards. The counters
//! must show the erroneous calls handed to MPI and the valid ones on the
//! fast path.

use anyhow::{bail, ensure, Result};
use erarctl::testbed::LaunchSpec;
use rust_tests::{
    check_stats_per_rank, ctest_args, ctests, end_grace, job_timeout, repo_root, run_job,
    shim_path, strict_exit, testbed, JobResult, Mpi,
};
use std::path::PathBuf;

fn program(mpi: Mpi) -> PathBuf {
    ctests(mpi); // builds c-tests/bin/<mpi>/bad_input
    repo_root()
        .join("c-tests")
        .join("bin")
        .join(mpi.name())
        .join("bad_input")
}

/// How one run is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// Without liberar.so: MPI's own answers.
    Plain,
    /// With liberar.so, default thresholds.
    Preload,
    /// With liberar.so and ERAR_MIN_BYTES = ERAR_BCAST_MIN_BYTES = 1.
    PreloadSmallThresholds,
    /// With liberar.so, default thresholds, and every eligible call on the
    /// fast path (`ERAR_SELECT=threshold`, no trials).
    PreloadFixedRouting,
}

fn run(mpi: Mpi, hosts: usize, variant: Variant, extra: &[&str]) -> Result<JobResult> {
    let mut argv = vec![program(mpi).into_os_string()];
    argv.extend(ctest_args(mpi).into_iter().map(Into::into));
    argv.extend(extra.iter().map(Into::into));
    let mut spec = LaunchSpec::new(mpi, hosts, argv)
        .env("ERAR_STATS", "1")
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace());
    if variant != Variant::Plain {
        spec = spec.preload(shim_path(mpi));
    }
    if variant == Variant::PreloadSmallThresholds {
        spec = spec
            .env("ERAR_MIN_BYTES", "1")
            .env("ERAR_BCAST_MIN_BYTES", "1");
    }
    if variant == Variant::PreloadFixedRouting {
        spec = spec.env("ERAR_SELECT", "threshold");
    }
    let r = run_job(&spec)?;
    if r.finalize_hung {
        ensure!(
            !strict_exit(),
            "{} hung in MPI_Finalize (ERAR_TEST_STRICT_EXIT=1)\n{}",
            r.what,
            r.tail()
        );
        eprintln!(
            "  WARNING: {} hung in MPI_Finalize after printing its results (MPICH 4.0.2 UCX \
             finalize bug); its exit status is unknown, its output is still checked",
            r.what
        );
    } else if !r.output.status.success() {
        bail!("{} exited with {}\n{}", r.what, r.output.status, r.tail());
    }
    ensure!(
        r.passes().iter().any(|p| p == "PASS bad_input"),
        "{} did not print `PASS bad_input`\n{}",
        r.what,
        r.tail()
    );
    Ok(r)
}

/// The program's per-case lines (`bad_input: bad <call> -> <class>`, rank 0).
fn classes(r: &JobResult) -> Vec<String> {
    r.stderr
        .lines()
        .filter_map(|l| l.find("bad_input: bad ").map(|i| l[i..].trim().to_owned()))
        .collect()
}

/// The one DIGEST line of a run.
fn digest(r: &JobResult) -> Result<String> {
    let d = r.digests();
    ensure!(
        d.len() == 1,
        "{}: {} DIGEST lines, expected 1\n{}",
        r.what,
        d.len(),
        r.tail()
    );
    Ok(d[0].clone())
}

/// Where two runs' error classes differ, line by line.
fn class_diff(a: &JobResult, b: &JobResult) -> String {
    let (ca, cb) = (classes(a), classes(b));
    let mut out = String::new();
    for i in 0..ca.len().max(cb.len()) {
        let (x, y) = (ca.get(i), cb.get(i));
        if x != y {
            out.push_str(&format!(
                "  without: {}\n  with:    {}\n",
                x.map_or("(none)", String::as_str),
                y.map_or("(none)", String::as_str)
            ));
        }
    }
    out
}

fn check_preloaded(r: &JobResult, hosts: usize) -> Result<()> {
    let stats = r.stats();
    check_stats_per_rank(&stats, hosts)
        .map_err(|e| anyhow::anyhow!("{}: {e:#}\n{}", r.what, r.tail()))?;
    for s in &stats {
        // The valid calls between the erroneous ones ran on the datapath…
        ensure!(
            s.get("allreduce.fast") > 0 && s.get("bcast.fast") > 0,
            "{}: rank {} did not use the fast path for the valid calls: {}",
            r.what,
            s.rank,
            s.raw
        );
        // …and the erroneous ones went to MPI, counted as such.
        for key in ["allreduce.invalid_args", "bcast.invalid_args"] {
            ensure!(
                s.reasons.get(key).copied().unwrap_or(0) > 0,
                "{}: rank {} counted no {key}: {}",
                r.what,
                s.rank,
                s.raw
            );
        }
    }
    Ok(())
}

/// Plain vs. preloaded vs. preloaded with 1-byte thresholds: all pass with
/// the same DIGEST (the same error classes and results).
fn check_bad_input(mpi: Mpi, hosts: usize) {
    let _tb = testbed();
    shim_path(mpi);
    let result = (|| -> Result<()> {
        let plain = run(mpi, hosts, Variant::Plain, &[])?;
        ensure!(
            plain.stats().is_empty(),
            "a run WITHOUT the preload printed liberar stats lines\n{}",
            plain.tail()
        );
        let want = digest(&plain)?;
        for variant in [Variant::Preload, Variant::PreloadSmallThresholds] {
            let with = run(mpi, hosts, variant, &[])?;
            let got = digest(&with)?;
            if got != want {
                bail!(
                    "{variant:?}: without liberar `{want}`, with liberar `{got}`; \
                     error classes that differ:\n{}\n{}\n{}",
                    class_diff(&plain, &with),
                    plain.tail(),
                    with.tail()
                );
            }
            check_preloaded(&with, hosts)?;
            eprintln!(
                "  ok bad_input on {mpi} x{hosts} ({variant:?}): {got}, {} erroneous calls",
                classes(&with).len()
            );
        }
        Ok(())
    })();
    if let Err(e) = result {
        panic!("bad_input on {mpi} with {hosts} hosts: {e:#}");
    }
}

#[test]
fn openmpi_2_hosts() {
    check_bad_input(Mpi::Openmpi, 2);
}

#[test]
fn openmpi_4_hosts() {
    check_bad_input(Mpi::Openmpi, 4);
}

#[test]
fn mpich_2_hosts() {
    check_bad_input(Mpi::Mpich, 2);
}

/// Arguments that differ across ranks (counts, datatype, op, root), each
/// rank's call locally valid and above the thresholds. MPI itself hangs,
/// crashes or writes out of bounds on these (measured with Open MPI 4.1.4),
/// so only the preloaded run is made: liberar must turn each into an error
/// on every rank, leave the buffers alone and keep the communicator usable.
/// Needs a per-call agreement on the call's arguments in
/// `liberar/src/datapath/ring.rs`; without it liberar hands such calls to
/// MPI with the same arguments, which does what it does. That agreement is
/// the fast path's: under the measured routing, a call whose class MPI won
/// (or one of MPI's trials) is MPI's, mismatches included, and mismatched
/// counts or types put the ranks' calls in different classes. So this runs
/// with every eligible call on the fast path.
#[test]
fn openmpi_2_hosts_mismatched_arguments() {
    let _tb = testbed();
    let r = run(
        Mpi::Openmpi,
        2,
        Variant::PreloadFixedRouting,
        &["--mismatch"],
    )
    .unwrap_or_else(|e| panic!("bad_input --mismatch: {e:#}"));
    eprintln!("{}", r.tail());
    // The valid calls around the erroneous ones ran on the ring, none was
    // handed to MPI after a stall (a failed call must not leave the ranks'
    // operation numbers apart).
    let stats = r.stats();
    assert_eq!(stats.len(), 2, "one stats line per rank:\n{}", r.tail());
    for s in &stats {
        assert!(
            s.get("allreduce.fast") > 0,
            "rank {}: no fast allreduce",
            s.rank
        );
        assert_eq!(
            s.get("fallback_bytes"),
            0,
            "rank {}: MPI completed fast-path bytes after the erroneous calls:\n{}",
            s.rank,
            r.tail()
        );
    }
}
