//! The eBPF fast path itself, proven by the counters: with the size
//! threshold at 1 byte, every allreduce of `allreduce_sweep` (1 element to
//! 16 MiB — 256 MiB on 4 hosts — sizes that are not multiples of the chunk,
//! in place and not, 1000 back-to-back calls) must complete on the datapath
//! with exact results, on 2, 3, 4 and 8 hosts; and the numerics report must
//! find liberar's float SUM never less accurate than MPI's, element by
//! element, on the same inputs.

use anyhow::{ensure, Result};
use liberar::testbed::LaunchSpec;
use rust_tests::{ctests, end_grace, job_timeout, run_job, shim_path, testbed, JobResult, Mpi};
use std::path::PathBuf;

fn program(mpi: Mpi, dir: &str, name: &str) -> PathBuf {
    rust_tests::repo_root()
        .join(dir)
        .join("bin")
        .join(mpi.name())
        .join(name)
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

/// Float SUM accuracy, element by element against the exact sum: liberar
/// (MPI_Allreduce, intercepted) never worse than the MPI underneath
/// (PMPI_Allreduce) on the same inputs, bitwise identical on every rank,
/// IEEE specials as MPI gives them. The program fails the job otherwise.
#[test]
fn numerics_never_worse_than_mpi() {
    let _tb = testbed();
    let dir = rust_tests::repo_root().join("benchmarks");
    let built = std::process::Command::new("make")
        .arg("-C")
        .arg(&dir)
        .arg("MPI=openmpi")
        .status()
        .expect("running make -C benchmarks");
    assert!(built.success(), "make -C benchmarks MPI=openmpi failed");
    let argv = vec![program(Mpi::Openmpi, "benchmarks", "numerics_report").into_os_string()];
    let spec = LaunchSpec::new(Mpi::Openmpi, 4, argv)
        .env("ERAR_STATS", "1")
        // Compares the fast path's sums with MPI's: every call takes it.
        .env("ERAR_SELECT", "threshold")
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace())
        .preload(shim_path(Mpi::Openmpi));
    let r = run_job(&spec).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("{}", r.stdout);
    assert!(
        r.output.status.success() && r.passes().iter().any(|p| p == "PASS numerics_report"),
        "numerics report failed\n{}",
        r.tail()
    );
    for s in r.stats() {
        assert!(
            s.get("allreduce.fast") > 0,
            "the report did not run through liberar: {}",
            s.raw
        );
    }
}
