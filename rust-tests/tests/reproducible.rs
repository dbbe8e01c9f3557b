//! The `reproducible` float SUM contract (`ERAR_PRECISION=reproducible`):
//! `c-tests/reproducible` reduces the same data as one call, in place and
//! fused into pieces around the threshold (some through the ring, some
//! through MPI), checks every result against the correctly rounded sum it
//! computes itself, and prints a digest of the bits. Here:
//!
//! * `same_bits_at_every_host_count_and_fusion`: 2, 3, 4, 5 and 8 hosts give
//!   the same digest (the data's exact sum does not depend on the host
//!   count, its float sums in MPI's orders do), and the counters prove both
//!   paths ran: calls on the ring, calls below the threshold that MPI
//!   carried exactly (`exact_mpi`), and blocks no i64 grid carries summed
//!   from every rank's inputs (`exact_gathered`).
//! * `same_bits_when_mpi_routing_trials_run`: the default measured routing,
//!   whose trials send some calls of each size class to MPI: same digest.
//! * The ring falling back after a stall: `lossy::reproducible_after_a_stall`.
//!
//! The program fails under plain MPI on 4 hosts (its tree and ring orders
//! round `(a + x) + (-x + b)` away from `a + b`), so the checks can fail.

use erarctl::testbed::LaunchSpec;
use rust_tests::{ctests, end_grace, job_timeout, run_job, shim_path, testbed, JobResult, Mpi};

fn run(hosts: usize, env: &[(&str, &str)]) -> JobResult {
    ctests(Mpi::Openmpi); // builds c-tests/bin/openmpi/reproducible
    let prog = rust_tests::repo_root().join("c-tests/bin/openmpi/reproducible");
    let mut spec = LaunchSpec::new(Mpi::Openmpi, hosts, vec![prog.into_os_string()])
        .env("ERAR_PRECISION", "reproducible")
        .env("ERAR_STATS", "1")
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace())
        .preload(shim_path(Mpi::Openmpi));
    for &(k, v) in env {
        spec = spec.env(k, v);
    }
    let r = run_job(&spec).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        r.output.status.success() && r.passes().iter().any(|p| p == "PASS reproducible"),
        "reproducible failed on {hosts} hosts ({env:?})\n{}",
        r.tail()
    );
    rust_tests::check_stats_per_rank(&r.stats(), hosts).unwrap_or_else(|e| panic!("{e:#}"));
    r
}

fn digest(r: &JobResult) -> String {
    let d = r.digests();
    assert_eq!(d.len(), 1, "{} DIGEST lines\n{}", d.len(), r.tail());
    d[0].clone()
}

#[test]
fn same_bits_at_every_host_count_and_fusion() {
    let _tb = testbed();
    let mut seen: Vec<(usize, String)> = Vec::new();
    for hosts in [2, 3, 4, 5, 8] {
        // A fixed threshold (the float SUM default): pieces below it go to
        // MPI, the others to the ring, on every call.
        let r = run(hosts, &[("ERAR_MIN_BYTES", "524288")]);
        for s in r.stats() {
            assert!(
                s.get("allreduce.fast") > 0
                    && s.reasons
                        .get("allreduce.below_threshold")
                        .copied()
                        .unwrap_or(0)
                        > 0
                    && s.get("exact_mpi") > 0
                    && s.get("exact_gathered") > 0,
                "rank {}: not every path ran: {}",
                s.rank,
                s.raw
            );
        }
        seen.push((hosts, digest(&r)));
    }
    eprintln!("  digests: {seen:?}");
    assert!(
        seen.iter().all(|(_, d)| *d == seen[0].1),
        "the bits depend on the host count: {seen:?}"
    );
}

#[test]
fn same_bits_when_mpi_routing_trials_run() {
    let _tb = testbed();
    let fixed = digest(&run(4, &[("ERAR_MIN_BYTES", "524288")]));
    let r = run(4, &[]);
    for s in r.stats() {
        assert!(
            s.reasons.get("allreduce.trial").copied().unwrap_or(0) > 0 && s.get("exact_mpi") > 0,
            "rank {}: no MPI trial ran: {}",
            s.rank,
            s.raw
        );
    }
    assert_eq!(digest(&r), fixed, "measured routing changed the bits");
}
