//! Several ranks per host (issue 14: `erarctl run --ranks-per-host K` /
//! `--per-host K,K,...`), where the fast path runs through the node path:
//! the ranks of a host meet in shared memory and the first k local ranks
//! (k = min(fewest ranks on any host, ERAR_NODE_SLICES = 2)) each carry one
//! slice of every call across hosts on their own in-kernel ring.
//!
//! The c-tests that cover allreduce and broadcast run with 2 ranks on each
//! of 4 hosts and with 3+1+2 ranks on 3 hosts, with and without liberar.so
//! (`ERAR_SELECT=threshold`), under Open MPI (`allreduce_big`,
//! `allreduce_types`, `allreduce_comms`, `bcast_roots`) and MPICH
//! (`allreduce_big`, `bcast_roots`, `--quick`: its small messages are slow).
//! For each: both exit 0 with the same `DIGEST`; every rank prints its
//! statistics line; and, on every rank, from the counters:
//!
//! * `node_calls` is at least the number of integer/bitwise allreduces,
//!   float SUMs and broadcasts at or above the thresholds (256 KiB; 512 KiB
//!   for float SUM and broadcast) that the
//!   program makes on MPI_COMM_WORLD and on its dup (the first two
//!   communicators to set up a node path: a host has 8 datapath slots, a
//!   ring takes 2 and a node path one ring per slice, so with 2 slices a
//!   third shared-host communicator may find no slots and go to MPI),
//!   counted from the program's source ([`Program::node_calls`]);
//! * the world's such calls were fast (`allreduce.fast`, `bcast.fast` at
//!   least their number) and no byte fell back to MPI;
//! * on every host at least one rank carried slices across hosts
//!   (`node_led > 0`).
//!
//! For the programs that use MPI_COMM_WORLD only (`allreduce_big`,
//! `allreduce_types`) also: every fast call went through the node path
//! (`node_calls` = fast calls), local rank 0 of every host carried a slice
//! of each (`node_led` >= `node_calls`; a small call runs on fewer slices
//! than the host has leaders), ranks beyond the first k carried none, and
//! no call was declined (a float MAX/MIN that comes first only finds where
//! the ranks are and goes to MPI, [`Calls::declined`]); for
//! `allreduce_big`'s 16 MiB calls every one of the k leaders of a host
//! carried slices, every rank copied int SUM slices straight out of the
//! leaders' slot buffers (`node_kept > 0`), and decoded float SUM slices
//! from the words there (`node_decoded > 0`). (The float SUMs' results are
//! checked by the programs themselves, against a bound, and the exact
//! dyadic sum's in the digest; the numerics report's runs on shared hosts
//! are in `fastpath.rs`.)

use erarctl::testbed::LaunchSpec;
use rust_tests::{
    ctest_args, ctests, end_grace, job_timeout, run_job, shim_path, strict_exit, testbed,
    JobResult, Mpi, StatsLine,
};

/// liberar's default slice count on a shared-host communicator
/// (`ERAR_NODE_SLICES`).
const DEFAULT_SLICES: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Program {
    AllreduceBig,
    AllreduceTypes,
    AllreduceComms,
    BcastRoots,
}

/// What a program makes at or above the thresholds, as counted from its
/// source (c-tests/*.c), per rank.
struct Calls {
    /// Integer/bitwise allreduces and float SUMs on MPI_COMM_WORLD.
    world_allreduce: u64,
    /// Contiguous broadcasts on MPI_COMM_WORLD.
    world_bcast: u64,
    /// Node-path calls (allreduce + broadcast) on MPI_COMM_WORLD and its
    /// dup: a lower bound for `node_calls`.
    node_calls: u64,
    /// Only MPI_COMM_WORLD (no other communicator takes the fast path).
    world_only: bool,
    /// Allreduces counted `fast_path_declined`: none. A communicator's
    /// first eligible call finds where its ranks are; a float MAX/MIN
    /// (which the node path does not carry) then goes to MPI as
    /// `datapath_unavailable` and attaches nothing; the first call the
    /// node path carries sets it up.
    declined: u64,
}

impl Program {
    fn name(self) -> &'static str {
        match self {
            Program::AllreduceBig => "allreduce_big",
            Program::AllreduceTypes => "allreduce_types",
            Program::AllreduceComms => "allreduce_comms",
            Program::BcastRoots => "bcast_roots",
        }
    }

    /// The calls the node path must carry; `quick`: the program runs with
    /// `--quick`; `ranks`: the world size (3 broadcast roots from 3 ranks on).
    fn node_calls(self, quick: bool, ranks: usize) -> Calls {
        assert!(ranks >= 3, "the counts assume 3 roots");
        match self {
            // 4M+3 (quick 1M+3) int SUM, separate buffers and in place (2);
            // float SUM of 4M (quick 1M) twice, 2M+5, 4M+5 and 3 of 512K+7
            // (7); its float MAX goes to MPI.
            Program::AllreduceBig => Calls {
                world_allreduce: 2 + 7,
                world_bcast: 0,
                node_calls: 2 + 7,
                world_only: true,
                declined: 0,
            },
            // INT UNSIGNED LONG INT64_T UINT64_T (5 types) x SUM MAX MIN
            // BAND BOR BXOR (PROD and the user op are not the kernel's);
            // counts at or above 256 KiB: `at` (exactly the threshold, SUM
            // MAX BXOR, not with --quick) and at+4567 (every op); each
            // separate and in place.
            Program::AllreduceTypes => {
                let counts_per_type = if quick { 6 } else { 3 * 2 + 3 };
                let n = 5 * counts_per_type * 2;
                Calls {
                    world_allreduce: n,
                    world_bcast: 0,
                    node_calls: n,
                    world_only: true,
                    // FLOAT MAX at 256 KiB comes first (FLOAT SUM's
                    // counts are all below 512 KiB): it only finds the
                    // hosts.
                    declined: 0,
                }
            }
            // 70001 elements (280 KB of INT, UNSIGNED; 560 KB of INT64):
            // run_set's INT SUM, UNSIGNED BXOR, INT64 MAX, each separate and
            // in place, on world (6) and its dup (6); the alternating
            // loop's 2 world INT SUMs. (The splits that follow may find no
            // datapath slots left: not counted.)
            Program::AllreduceComms => Calls {
                world_allreduce: 6 + 2,
                world_bcast: 0,
                node_calls: 6 + 2 + 6,
                world_only: false,
                // Every communicator's first eligible call is INT SUM
                // 70001 (the float SUMs before it are below 512 KiB).
                declined: 0,
            },
            // World: BYTE, DOUBLE, INT of the sizes >= 512 KiB (full: thr,
            // thr+1, 1M+3, 4M; --quick: thr+1, 1M+3) from 3 roots, plus the
            // contiguous and the vector (packed by the shim) derived types
            // of thr+100 bytes from 2 roots; dup: thr+1 of BYTE and DOUBLE
            // from 3 roots (6). (The splits may find no slots left.)
            Program::BcastRoots => {
                let world = if quick { 2 } else { 4 } * 3 * 3 + 2 * 2;
                Calls {
                    world_allreduce: 0,
                    world_bcast: world,
                    node_calls: world + 6,
                    world_only: false,
                    declined: 0,
                }
            }
        }
    }
}

fn run(mpi: Mpi, program: Program, counts: &[usize], preload: bool) -> JobResult {
    ctests(mpi);
    let path = rust_tests::repo_root()
        .join("c-tests/bin")
        .join(mpi.name())
        .join(program.name());
    let mut argv = vec![path.into_os_string()];
    argv.extend(ctest_args(mpi).into_iter().map(Into::into));
    let mut spec = LaunchSpec::new(mpi, counts.len(), argv)
        .ranks_per_host(counts.to_vec())
        .env("ERAR_STATS", "1")
        .env("ERAR_SELECT", "threshold")
        // Float SUMs from the fast path's threshold on (the node path's
        // float floor is about speed, not results).
        .env("ERAR_NODE_FLOAT_MIN", "0")
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace());
    if preload {
        spec = spec.preload(shim_path(mpi));
    }
    let r = run_job(&spec).unwrap_or_else(|e| panic!("{e:#}"));
    let name = program.name();
    let exited_ok = if r.finalize_hung {
        // MPICH 4.0.2's finalize deadlock (see rust_tests::mpich_attempts):
        // the output is complete and still checked.
        assert!(
            !strict_exit(),
            "{name} hung in MPI_Finalize (ERAR_TEST_STRICT_EXIT=1)\n{}",
            r.tail()
        );
        eprintln!(
            "  WARNING: {} hung in MPI_Finalize after printing its results (MPICH 4.0.2 UCX \
             finalize bug); its exit status is unknown, its output is still checked",
            r.what
        );
        true
    } else {
        r.output.status.success()
    };
    assert!(
        exited_ok && r.passes().iter().any(|p| *p == format!("PASS {name}")),
        "{name} on {counts:?} ranks per host ({mpi}, preload {preload}) failed\n{}",
        r.tail()
    );
    r
}

/// The host of each rank (ranks fill the hosts in rank order) and its
/// index among its host's ranks.
fn placement(counts: &[usize]) -> Vec<(usize, usize)> {
    counts
        .iter()
        .enumerate()
        .flat_map(|(h, &k)| (0..k).map(move |j| (h, j)))
        .collect()
}

fn summary(stats: &[StatsLine]) -> String {
    stats
        .iter()
        .map(|s| s.raw.as_str())
        .collect::<Vec<_>>()
        .join("\n")
}

fn check(mpi: Mpi, program: Program, counts: &[usize]) {
    let name = program.name();
    let plain = run(mpi, program, counts, false);
    let lib = run(mpi, program, counts, true);
    let ctx = || format!("{}\n{}", plain.tail(), lib.tail());
    let (dp, dl) = (plain.digests(), lib.digests());
    assert!(
        dp.len() == 1 && dl == dp,
        "{name} on {counts:?} ({mpi}): DIGEST {dl:?} with liberar, {dp:?} without\n{}",
        ctx()
    );
    assert!(
        plain.stats().is_empty(),
        "a run without the preload printed liberar statistics\n{}",
        ctx()
    );

    let ranks: usize = counts.iter().sum();
    let place = placement(counts);
    let mut stats = lib.stats();
    stats.sort_by_key(|s| s.rank);
    rust_tests::check_stats_per_rank(&stats, ranks)
        .unwrap_or_else(|e| panic!("{name} on {counts:?} ({mpi}): {e:#}\n{}", ctx()));
    let quick = !ctest_args(mpi).is_empty();
    let want = program.node_calls(quick, ranks);
    let slices = DEFAULT_SLICES.min(counts.iter().copied().min().unwrap_or(0));
    let all = || summary(&stats);

    for s in &stats {
        let r = s.rank as usize;
        let reason = |k: &str| s.reasons.get(k).copied().unwrap_or(0);
        let declined = (
            reason("allreduce.fast_path_declined"),
            reason("bcast.fast_path_declined"),
        );
        let bcast_to_mpi = s
            .reasons
            .get("bcast.datapath_unavailable")
            .copied()
            .unwrap_or(0);
        assert!(
            s.get("node_calls") >= want.node_calls
                && s.get("allreduce.fast") >= want.world_allreduce
                && s.get("bcast.fast") >= want.world_bcast
                && s.get("fallback_bytes") == 0,
            "{name} on {counts:?} ({mpi}), rank {r} (host {}, local rank {}): expected \
             node_calls >= {}, allreduce.fast >= {}, bcast.fast >= {}, fallback_bytes=0; \
             got: {}\nall ranks:\n{}",
            place[r].0,
            place[r].1,
            want.node_calls,
            want.world_allreduce,
            want.world_bcast,
            s.raw,
            all()
        );
        if want.world_only {
            // Only MPI_COMM_WORLD takes the fast path: every fast call is a
            // node-path call. Local rank 0 leads slice 0 of every piece;
            // ranks beyond the first `slices` lead nothing; for 16 MiB
            // calls every leader carries a slice.
            let fast = s.get("allreduce.fast") + s.get("bcast.fast");
            let j = place[r].1;
            let led = s.get("node_led");
            let every_leader = program == Program::AllreduceBig && !quick;
            // allreduce_big's int and float SUMs fit one slot: every rank
            // copies the int slices straight from the leaders' slots, and
            // decodes the float ones from the words there.
            let (kept, decoded) = (s.get("node_kept"), s.get("node_decoded"));
            assert!(
                program != Program::AllreduceBig || (decoded > 0 && kept > decoded),
                "{name} on {counts:?} ({mpi}), rank {r}: expected node_decoded > 0 (float \
                 SUM slices decoded from the leaders' slot buffers) and node_kept above it \
                 (int SUM slices copied from there too); got: {}\nall ranks:\n{}",
                s.raw,
                all()
            );
            let (led_ok, led_want) = match j {
                0 => (led >= fast, format!(">= {fast}")),
                j if j >= slices => (led == 0, "= 0".to_owned()),
                _ if every_leader => (led > 0, "> 0".to_owned()),
                _ => (led <= fast, format!("<= {fast}")),
            };
            assert!(
                s.get("node_calls") == fast
                    && led_ok
                    && declined == (want.declined, 0)
                    && bcast_to_mpi == 0,
                "{name} on {counts:?} ({mpi}), rank {r} (host {}, local rank {j}, {slices} \
                 slices): expected node_calls = fast calls ({fast}), node_led {led_want}, \
                 allreduce.fast_path_declined = {}, none for bcast, no \
                 bcast.datapath_unavailable; got: {}\nall ranks:\n{}",
                place[r].0,
                want.declined,
                s.raw,
                all()
            );
        }
    }
    for h in 0..counts.len() {
        assert!(
            stats
                .iter()
                .any(|s| place[s.rank as usize].0 == h && s.get("node_led") > 0),
            "{name} on {counts:?} ({mpi}): no rank of host {h} carried a slice across hosts \
             (node_led=0 on all of them)\n{}",
            all()
        );
    }
    let r0 = &stats[0];
    eprintln!(
        "  ok {name} on {counts:?} ({mpi}): {} | rank 0: node_calls={} node_led={} \
         allreduce.fast={} bcast.fast={} (want node_calls >= {}) | node_led per rank: {:?}",
        dl[0],
        r0.get("node_calls"),
        r0.get("node_led"),
        r0.get("allreduce.fast"),
        r0.get("bcast.fast"),
        want.node_calls,
        stats.iter().map(|s| s.get("node_led")).collect::<Vec<_>>()
    );
}

const OPENMPI_PROGRAMS: [Program; 4] = [
    Program::AllreduceBig,
    Program::AllreduceTypes,
    Program::AllreduceComms,
    Program::BcastRoots,
];
/// MPICH's small messages are slow over UCX tcp here: two programs.
const MPICH_PROGRAMS: [Program; 2] = [Program::AllreduceBig, Program::BcastRoots];

fn check_all(mpi: Mpi, programs: &[Program], counts: &[usize]) {
    let _tb = testbed();
    shim_path(mpi);
    for &p in programs {
        check(mpi, p, counts);
    }
}

#[test]
fn openmpi_two_ranks_per_host_take_the_node_path() {
    check_all(Mpi::Openmpi, &OPENMPI_PROGRAMS, &[2, 2, 2, 2]);
}

#[test]
fn openmpi_unequal_ranks_per_host_take_the_node_path() {
    check_all(Mpi::Openmpi, &OPENMPI_PROGRAMS, &[3, 1, 2]);
}

#[test]
fn mpich_two_ranks_per_host_take_the_node_path() {
    check_all(Mpi::Mpich, &MPICH_PROGRAMS, &[2, 2, 2, 2]);
}

#[test]
fn mpich_unequal_ranks_per_host_take_the_node_path() {
    check_all(Mpi::Mpich, &MPICH_PROGRAMS, &[3, 1, 2]);
}
