"""Unit tests of the OSU side of run-allreduce (what benchmarks/osu/run-osu
uses): finding osu_bcast / osu_allreduce in build and installation trees,
the -T detection, OSU call counts against liberar's counters, the second
baseline, thresholds and the markdown report. No MPI, no OSU needed.

    python3 benchmarks/osu/test_run_osu.py
"""
import importlib.machinery
import importlib.util
import os
import stat
import subprocess
import tempfile
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
_loader = importlib.machinery.SourceFileLoader("run_allreduce", os.path.join(HERE, "..", "run-allreduce"))
_spec = importlib.util.spec_from_loader("run_allreduce", _loader)
ra = importlib.util.module_from_spec(_spec)
_loader.exec_module(ra)

OSU74_BCAST = """
# OSU MPI Broadcast Latency Test v7.4
# Datatype: MPI_CHAR.
# Size       Avg Latency(us)
1                      40.10
2                      41.00
1048576              2500.00
"""


def stats_line(rank, fast, pmpi):
    return (f"liberar: rank={rank} size=4 allreduce fast=0 fast_bytes=0 pmpi=0 bcast fast={fast} "
            f"fast_bytes=123 pmpi={pmpi} fallback_bytes=0 fortran=0 reasons=bcast.below_threshold:{pmpi}\n")


def touch_prog(path, content=b"\x7fELF fake"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


class FindOsu(unittest.TestCase):
    def test_layouts(self):
        for sub in ("c/mpi/collective/blocking",                      # 7.x build tree
                    "mpi/collective",                                 # 5.x/6.x build tree
                    "libexec/osu-micro-benchmarks/mpi/collective",    # make install prefix
                    "bin"):
            with self.subTest(sub=sub), tempfile.TemporaryDirectory() as d:
                want = os.path.join(d, sub, "osu_bcast")
                touch_prog(want)
                self.assertEqual(ra.find_osu(d, "osu_bcast"), want)
                self.assertEqual(ra.find_osu(os.path.join(d, sub), "osu_bcast"), want)

    def test_blocking_preferred_over_other_families(self):
        # A 7.x tree also has persistent/ and non-blocking variants; names
        # differ there, but a stray copy in another directory must not win.
        with tempfile.TemporaryDirectory() as d:
            touch_prog(os.path.join(d, "c/mpi/collective/aaa/osu_bcast"))
            want = os.path.join(d, "c/mpi/collective/blocking/osu_bcast")
            touch_prog(want)
            self.assertEqual(ra.find_osu(d, "osu_bcast"), want)

    def test_sibling_of_a_binary_and_not_executable(self):
        with tempfile.TemporaryDirectory() as d:
            touch_prog(os.path.join(d, "x", "osu_allreduce"))
            touch_prog(os.path.join(d, "x", "osu_bcast"))
            self.assertEqual(ra.find_osu(os.path.join(d, "x", "osu_allreduce"), "osu_bcast"),
                             os.path.join(d, "x", "osu_bcast"))
            src = os.path.join(d, "src", "osu_reduce")
            os.makedirs(os.path.dirname(src))
            open(src, "w").close()  # not executable
            with self.assertRaises(SystemExit):
                ra.find_osu(os.path.join(d, "src"), "osu_reduce")
            with self.assertRaises(SystemExit):
                ra.find_osu(os.path.join(d, "missing"), "osu_bcast")

    def test_type_option_detection(self):
        with tempfile.TemporaryDirectory() as d:
            new, old = os.path.join(d, "new", "osu_allreduce"), os.path.join(d, "old", "osu_allreduce")
            touch_prog(new, b"\x7fELF ... [all,mpi_char,mpi_int,mpi_float] - Set MPI_TYPE")
            touch_prog(old, b"\x7fELF ... osu_allreduce 5.3")
            self.assertTrue(ra.osu_has_type_option(new))
            self.assertFalse(ra.osu_has_type_option(old))
            args = types.SimpleNamespace(osu=os.path.join(d, "old"), sizes="4:64", iters=3, warmup=1,
                                         type="float")
            argv = ra.bench_argv(args, "allreduce")
            self.assertNotIn("-T", argv)
            args.type = "int"
            with self.assertRaises(SystemExit):
                ra.bench_argv(args, "allreduce")
            args.osu = os.path.join(d, "new")
            self.assertEqual(ra.bench_argv(args, "allreduce")[-2:], ["-T", "mpi_int"])


class Counting(unittest.TestCase):
    def test_expected_calls_and_verdict(self):
        rows = ra.parse_rows(OSU74_BCAST)
        est = ra.osu_expected_calls(rows, 10, 2)
        self.assertEqual({v["calls"] for v in est.values()}, {12})
        self.assertIsNone(rows[1]["calls"])  # the input is not modified
        st = ra.parse_stats("".join(stats_line(r, 12, 24) for r in range(4)))
        self.assertEqual(ra.stats_total_calls("bcast", st), {36})
        status, _ = ra.fast_path_verdict("bcast", st, est, 512 * 1024)
        self.assertEqual(status, "fast")
        st = ra.parse_stats("".join(stats_line(r, 5, 31) for r in range(4)))
        status, _ = ra.fast_path_verdict("bcast", st, est, 512 * 1024)
        self.assertEqual(status, "partial")
        # The same split, where liberar's trials found MPI faster: as routed.
        measured = "".join(stats_line(r, 5, 31).replace("reasons=", "reasons=bcast.measured_slower:7,")
                           for r in range(4))
        status, msg = ra.fast_path_verdict("bcast", ra.parse_stats(measured), est, 512 * 1024)
        self.assertEqual(status, "measured")
        self.assertIn("measured_slower", msg)

    def test_expected_calls_with_osus_default_warmup(self):
        rows = {s: {"avg_us": 1.0, "calls": None} for s in (4, 8192, 16384)}
        est = ra.osu_expected_calls(rows, 200, None)
        self.assertEqual([est[s]["calls"] for s in (4, 8192, 16384)], [300, 300, 210])

    def test_nothing_eligible_is_not_a_fallback(self):
        rows = ra.osu_expected_calls({1: {"avg_us": 3.0, "calls": None}}, 10, 2)
        st = ra.parse_stats("".join(stats_line(r, 0, 12) for r in range(4)))
        status, msg = ra.fast_path_verdict("bcast", st, rows, 512 * 1024)
        self.assertEqual(status, "pmpi")
        self.assertIn("as routed", msg)
        (row,) = ra.build_table("bcast", {1: 3.0}, {1: 3.0}, 4, 512 * 1024, status)
        self.assertEqual(row["liberar_path"], "pmpi")

    def test_thresholds_follow_liberar_defaults(self):
        self.assertEqual(ra.threshold_for("allreduce", {}), 256 * 1024)
        self.assertEqual(ra.threshold_for("bcast", {}), 512 * 1024)
        self.assertEqual(ra.threshold_for("bcast", {"ERAR_BCAST_MIN_BYTES": "4096"}), 4096)

    def test_osu_version(self):
        self.assertEqual(ra.osu_version(OSU74_BCAST), "OSU MPI Broadcast Latency Test v7.4")
        self.assertIsNone(ra.osu_version("nothing"))


OSU74_Z50 = """
# OSU MPI Broadcast Latency Test v7.4
# Datatype: MPI_CHAR.
# Size       Avg Latency(us)  P50 Tail Lat(us)
1                      40.10             30.00
2                      41.00             31.50
"""

OSU74_FZ50 = """
# Size       Avg Latency(us)   Min Latency(us)   Max Latency(us)  Iterations  P50 Tail Lat(us)
1                       1.08              0.46              2.23          50              0.48
"""


class P50(unittest.TestCase):
    def test_parse_and_select(self):
        rows = ra.parse_rows(OSU74_Z50)
        self.assertEqual(rows[1]["p50_us"], 30.0)
        self.assertIsNone(rows[1]["calls"])
        self.assertEqual(ra.select_stat(rows, "p50")[2]["avg_us"], 31.5)
        self.assertEqual(ra.select_stat(rows, "avg")[2]["avg_us"], 41.0)
        rows = ra.parse_rows(OSU74_FZ50)
        self.assertEqual(rows[1]["p50_us"], 0.48)
        self.assertIsNone(rows[1]["calls"])  # the P50 column is not a call count
        with self.assertRaises(SystemExit):
            ra.select_stat(ra.parse_rows(OSU74_BCAST), "p50")

    def test_argv(self):
        with tempfile.TemporaryDirectory() as d:
            touch_prog(os.path.join(d, "new", "osu_bcast"), b"\x7fELF mpi_float --tail-lat")
            touch_prog(os.path.join(d, "old", "osu_bcast"), b"\x7fELF 5.3")
            args = types.SimpleNamespace(osu=os.path.join(d, "new"), sizes="1:64", iters=3, warmup=1,
                                         type="float", stat="p50")
            self.assertEqual(ra.bench_argv(args, "bcast")[-1], "-z50")
            args.osu = os.path.join(d, "old")
            with self.assertRaises(SystemExit):
                ra.bench_argv(args, "bcast")


class SecondBaseline(unittest.TestCase):
    def test_table_md_csv_plot(self):
        base = {1: 40.0, 1 << 20: 2000.0}
        base2 = {1: 50.0, 1 << 20: 2600.0}
        lib = {1: 45.0, 1 << 20: 1000.0}
        rows = ra.build_table("bcast", base, lib, 4, 512 * 1024, "fast", base2=base2)
        self.assertAlmostEqual(rows[0]["speedup2"], 50.0 / 45.0)
        self.assertEqual([r["liberar_path"] for r in rows], ["pmpi", "fast"])
        runs = [{1: {"avg_us": v, "calls": None}, 1 << 20: {"avg_us": 2000.0, "calls": None}} for v in (30.0, 40.0, 50.0)]
        ra.add_spread(rows, "mpi", runs)
        self.assertAlmostEqual(rows[0]["mpi_spread_pct"], 50.0)
        ra.add_spread(rows, "liberar", [{1: {"avg_us": 45.0}, 1 << 20: {"avg_us": 1000.0}}] * 2)
        ra.add_spread(rows, "mpi2", [{1: {"avg_us": 50.0}, 1 << 20: {"avg_us": 2600.0}}] * 2)
        md = ra.md_table(rows, ["MPI (bridge)", "liberar (xdp)", "MPI (xdp)"])
        lines = md.splitlines()
        self.assertIn("MPI (xdp) µs", lines[0])
        self.assertEqual(len(lines), 4)
        self.assertIn("| 1 MiB | 2000.00 | 1000.00 | 2.00x | 2600.00 | 2.60x | 0% / 0% / 0% | fast |", md)
        with tempfile.TemporaryDirectory() as d:
            ra.write_csv(os.path.join(d, "b.csv"), rows)
            with open(os.path.join(d, "b.csv")) as f:
                header = f.readline()
            self.assertIn("mpi2_avg_us", header)
            ra.write_md(os.path.join(d, "b.md"), "t", rows, ["a", "b", "c"], [("command", "`x`")], ["n"],
                        "OK fine", "b.png")
            with open(os.path.join(d, "b.md")) as f:
                text = f.read()
            self.assertIn("- command: `x`", text)
            self.assertIn("![t](b.png)", text)
            # The plot script itself, where matplotlib exists.
            out = ra.plot(os.path.join(d, "b.csv"), os.path.join(d, "b.png"), rows, "t", 512 * 1024,
                          ("a", "b", "c"), "latency")
            self.assertTrue(os.path.isfile(out))

    def test_without_second_baseline_csv_unchanged(self):
        rows = ra.build_table("allreduce", {4: 10.0}, {4: 11.0}, 4, 262144, "fast")
        self.assertEqual(list(rows[0]), ["size_bytes", "mpi_avg_us", "liberar_avg_us", "mpi_busbw_GBps",
                                          "liberar_busbw_GBps", "speedup", "liberar_path"])


class Wrapper(unittest.TestCase):
    def test_usage(self):
        p = subprocess.run([os.path.join(HERE, "run-osu")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("usage", p.stderr)
        p = subprocess.run([os.path.join(HERE, "run-osu"), "/nonexistent/osu"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("does not exist", p.stderr)


if __name__ == "__main__":
    unittest.main()
