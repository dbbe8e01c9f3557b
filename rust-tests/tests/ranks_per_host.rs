//! Several ranks per host (issue 14's placement, `erarctl run
//! --ranks-per-host K` / `--per-host K,K,...`): the c-tests that cover
//! allreduce and broadcast on every communicator shape run with 2 ranks on
//! each of 4 hosts and with 3+1+2 ranks on 3 hosts, with and without
//! liberar.so, under Open MPI: both exit 0 with the same `DIGEST`, and
//! every rank prints its statistics line.
//!
//! The fast path does not yet span ranks that share a host (the ring
//! needs one member per host): such communicators must decline it cleanly,
//! every rank alike, and MPI completes their calls. Sub-communicators with
//! one rank per host (`bcast_roots`' splits) still take it.

use erarctl::testbed::LaunchSpec;
use rust_tests::{ctests, end_grace, job_timeout, run_job, shim_path, testbed, JobResult, Mpi};

fn run(program: &str, counts: &[usize], preload: bool) -> JobResult {
    ctests(Mpi::Openmpi);
    let path = rust_tests::repo_root()
        .join("c-tests/bin/openmpi")
        .join(program);
    let mut spec = LaunchSpec::new(Mpi::Openmpi, counts.len(), [path.into_os_string()])
        .ranks_per_host(counts.to_vec())
        .env("ERAR_STATS", "1")
        .env("ERAR_SELECT", "threshold")
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace());
    if preload {
        spec = spec.preload(shim_path(Mpi::Openmpi));
    }
    let r = run_job(&spec).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        r.output.status.success() && r.passes().iter().any(|p| *p == format!("PASS {program}")),
        "{program} on {counts:?} ranks per host (preload {preload}) failed\n{}",
        r.tail()
    );
    r
}

fn same_as_mpi(program: &str, counts: &[usize]) -> JobResult {
    let plain = run(program, counts, false);
    let lib = run(program, counts, true);
    assert_eq!(
        lib.digests(),
        plain.digests(),
        "{program} on {counts:?}: other results with liberar\n{}",
        lib.tail()
    );
    let ranks = counts.iter().sum();
    rust_tests::check_stats_per_rank(&lib.stats(), ranks).unwrap_or_else(|e| panic!("{e:#}"));
    lib
}

#[test]
fn two_ranks_per_host_same_results_as_mpi() {
    let _tb = testbed();
    for program in ["allreduce_big", "allreduce_comms", "bcast_roots"] {
        same_as_mpi(program, &[2, 2, 2, 2]);
    }
}

#[test]
fn unequal_ranks_per_host_same_results_as_mpi() {
    let _tb = testbed();
    for program in ["allreduce_big", "bcast_roots"] {
        let r = same_as_mpi(program, &[3, 1, 2]);
        if program == "bcast_roots" {
            // Its splits with one rank per host still use the ring.
            assert!(
                r.stats().iter().any(|s| s.get("bcast.fast") > 0),
                "no broadcast took the fast path\n{}",
                r.tail()
            );
        }
    }
}
