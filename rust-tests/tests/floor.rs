//! `benchmarks/floor`, the least CPU an in-kernel ring's call can take on
//! this machine: it builds against the repository's `bpf/include` (its
//! combine is erar_reduce.h's own loop), its BPF programs compute what it
//! times (it checks them on known data against sums computed in C, and
//! exits non-zero otherwise), and its floor adds up; it also prints the
//! same sums with chunks out of the cache.
//!
//! Needs root (it loads BPF programs and creates BPF maps).

use rust_tests::{repo_root, require_root};
use std::process::Command;

/// The numbers of the floor's line for `what` ("allreduce" or
/// "broadcast"): copies, kernel payload work, frame-hops and their sum, µs
/// of CPU, then the wall time on the CPUs.
fn floor_line(out: &str, what: &str) -> Vec<f64> {
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{what}:")))
        .unwrap_or_else(|| panic!("no {what} line in:\n{out}"));
    line.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse::<f64>().ok())
        .collect()
}

#[test]
fn the_floor_checks_its_programs_and_adds_up() {
    require_root("benchmarks/floor");
    let (size, hosts, hop_ns) = (1u64 << 20, 4u64, 100.0);
    let out = Command::new(repo_root().join("benchmarks/floor/run"))
        .args(["--size", &size.to_string(), "--hosts", &hosts.to_string()])
        .args(["--hop-ns", "100", "--mpi-us", "2000", "--rounds", "1"])
        .output()
        .expect("running benchmarks/floor/run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "benchmarks/floor/run failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every host receives 2(N-1)/N of the buffer, in 8936-byte frames.
    let hops_us = 2.0 * (hosts - 1) as f64 * size as f64 / 8936.0 * hop_ns / 1e3;
    let bcast_hops_us = hops_us / 2.0;
    for (what, want_hops) in [("allreduce", hops_us), ("broadcast", bcast_hops_us)] {
        // [copies, payload, hops, sum, wall, CPUs]
        let v = floor_line(&stdout, what);
        assert_eq!(v.len(), 6, "{what}: {v:?} in\n{stdout}");
        assert!(
            v[0] > 0.0 && v[1] > 0.0,
            "{what}: a piece of no cost: {v:?}"
        );
        assert!(
            (v[2] - want_hops).abs() <= 1.0,
            "{what}: frame-hops {} us, want {want_hops:.0}",
            v[2]
        );
        assert!(
            (v[0] + v[1] + v[2] - v[3]).abs() <= 2.0,
            "{what}: the pieces do not add up: {v:?}"
        );
        assert!(
            (v[3] / v[5] - v[4]).abs() <= 1.0,
            "{what}: the wall time is not the CPU time over the CPUs: {v:?}"
        );
    }
    // The same sums with the combine and the store on chunks from memory
    // (not a floor): both printed, each of some cost.
    let cold = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("allreduce ") && l.contains("broadcast"))
        .unwrap_or_else(|| panic!("no line for chunks out of the cache in:\n{stdout}"));
    let v: Vec<f64> = cold
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.parse::<f64>().ok())
        .collect();
    assert!(
        v.len() == 3 && v[0] > 0.0 && v[1] > 0.0,
        "chunks out of the cache: {v:?} in {cold}"
    );
}
