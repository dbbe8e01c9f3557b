"""Unit tests of run-allreduce's parsing and verdicts on canned output.

    python3 benchmarks/tests/test_run_allreduce.py
"""
import importlib.machinery
import importlib.util
import os
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
_loader = importlib.machinery.SourceFileLoader("run_allreduce", os.path.join(HERE, "..", "run-allreduce"))
_spec = importlib.util.spec_from_loader("run_allreduce", _loader)
ra = importlib.util.module_from_spec(_spec)
_loader.exec_module(ra)

OWN = """# liberar allreduce_bench: MPI_Allreduce SUM, type float, 4 ranks, separate buffers
# method: OSU-style; barrier before each iteration; avg over iterations, then over ranks
# size_bytes       avg_us       min_us       max_us   busbw_GBps    calls
4                   17.28        10.97        28.83       0.0003       31
262144             630.39       609.33       682.94       0.6238       31
1048576           2168.18      1754.15      2769.70       0.7254        9
"""

OSU = """
# OSU MPI Allreduce Latency Test v7.4
# Datatype: MPI_FLOAT.
# Size       Avg Latency(us)
4                      47.32
1024                   51.10
1048576              1612.77
16777216            33815.20
"""

STATS = """DIGEST 0
liberar: rank=0 size=4 allreduce fast=40 fast_bytes=123 pmpi=31 bcast fast=0 fast_bytes=0 pmpi=0 fallback_bytes=0 fortran=0 reasons=allreduce.below_threshold:31
liberar: rank=1 size=4 allreduce fast=40 fast_bytes=123 pmpi=31 bcast fast=0 fast_bytes=0 pmpi=0 fallback_bytes=0 fortran=0 reasons=allreduce.below_threshold:31
"""


class Parsing(unittest.TestCase):
    def test_own_rows(self):
        rows = ra.parse_rows(OWN)
        self.assertEqual(sorted(rows), [4, 262144, 1048576])
        self.assertAlmostEqual(rows[262144]["avg_us"], 630.39)
        self.assertEqual(rows[1048576]["calls"], 9)

    def test_osu_rows(self):
        rows = ra.parse_rows(OSU)
        self.assertEqual(sorted(rows), [4, 1024, 1048576, 16777216])
        self.assertIsNone(rows[4]["calls"])
        self.assertAlmostEqual(rows[16777216]["avg_us"], 33815.20)

    def test_stats(self):
        st = ra.parse_stats(STATS)
        self.assertEqual(len(st), 2)
        self.assertEqual(st[0]["allreduce"]["fast"], 40)
        self.assertEqual(st[1]["bcast"]["pmpi"], 0)
        self.assertEqual(st[0]["reasons"], {"allreduce.below_threshold": 31})
        self.assertEqual(st[0]["fallback_bytes"], 0)


class Verdicts(unittest.TestCase):
    def test_fast_when_all_eligible_calls_fast(self):
        rows = ra.parse_rows(OWN)  # eligible: 31 + 9 = 40 calls >= 256 KiB
        status, _ = ra.fast_path_verdict("allreduce", ra.parse_stats(STATS), rows, 262144)
        self.assertEqual(status, "fast")

    def test_partial(self):
        st = ra.parse_stats(STATS.replace("allreduce fast=40", "allreduce fast=7"))
        status, _ = ra.fast_path_verdict("allreduce", st, ra.parse_rows(OWN), 262144)
        self.assertEqual(status, "partial")

    def test_every_eligible_call_on_mpi_by_measurement_is_not_a_fallback(self):
        line = ("liberar: rank={} size=4 allreduce fast=0 fast_bytes=0 pmpi=26 bcast fast=0 fast_bytes=0 "
                "pmpi=0 reasons=allreduce.trial:3,allreduce.measured_slower:23\n")
        st = ra.parse_stats("".join(line.format(r) for r in range(4)))
        rows = {1 << 20: {"avg_us": 1.0, "calls": 26}}
        self.assertEqual(ra.fast_path_verdict("allreduce", st, rows, 262144)[0], "measured")
        unexplained = ra.parse_stats("".join(line.format(r).replace("measured_slower:23", "measured_slower:2")
                                             for r in range(4)))
        self.assertEqual(ra.fast_path_verdict("allreduce", unexplained, rows, 262144)[0], "fallback")

    def test_fallback_is_called_out(self):
        st = ra.parse_stats(STATS.replace("allreduce fast=40", "allreduce fast=0"))
        status, msg = ra.fast_path_verdict("allreduce", st, ra.parse_rows(OWN), 262144)
        self.assertEqual(status, "fallback")
        self.assertIn("NOT the in-kernel datapath", msg)

    def test_no_stats(self):
        status, _ = ra.fast_path_verdict("allreduce", [], ra.parse_rows(OWN), 262144)
        self.assertEqual(status, "unknown")

    def test_osu_cannot_count(self):
        status, _ = ra.fast_path_verdict("allreduce", ra.parse_stats(STATS), ra.parse_rows(OSU), 262144)
        self.assertEqual(status, "ran")


class Table(unittest.TestCase):
    def test_busbw_and_speedup(self):
        base = {1048576: 2000.0}
        lib = {1048576: 1000.0}
        (row,) = ra.build_table("allreduce", base, lib, 4, 262144, "fast")
        # 2(n-1)/n * bytes / time = 1.5 * 1 MiB / 2 ms
        self.assertAlmostEqual(row["mpi_busbw_GBps"], 1.5 * 1048576 / 2e-3 / 1e9)
        self.assertAlmostEqual(row["speedup"], 2.0)
        self.assertEqual(row["liberar_path"], "fast")
        (row,) = ra.build_table("bcast", base, lib, 4, 2 << 20, "fast")
        self.assertAlmostEqual(row["liberar_busbw_GBps"], 1048576 / 1e-3 / 1e9)
        self.assertEqual(row["liberar_path"], "pmpi")

    def test_median_over_rounds(self):
        runs = [{8: {"avg_us": v, "calls": 1}} for v in (3.0, 1.0, 2.0)]
        self.assertEqual(ra.merge(runs), {8: 2.0})

    def test_launcher_args_reach_both_sides(self):
        import argparse
        args = argparse.Namespace(launcher="erarctl", erarctl="erarctl", mpi="openmpi", hosts=4,
                                  launcher_arg=["--bind-to", "core:overload-allowed"])
        launcher = ra.Launcher(args)
        for preload in (None, "/x/liberar.so"):
            cmd = launcher.command(["osu_bcast"], preload, {})
            self.assertEqual(cmd[cmd.index("--") - 2:cmd.index("--")],
                             ["--launcher-arg=--bind-to", "--launcher-arg=core:overload-allowed"])
            self.assertEqual(cmd[-1], "osu_bcast")

    def test_best_over_rounds(self):
        runs = [{8: {"avg_us": v, "calls": 1}, 16: {"avg_us": 9.0, "calls": 1}} for v in (3.0, 1.0, 2.0)]
        self.assertEqual(ra.merge(runs, "best"), {8: 1.0, 16: 9.0})

    def test_path_per_size_from_the_trials_choices(self):
        text = ("liberar: rank=1 size=4 chosen=allreduce.i32@262144:mpi:1/2\n"
                "liberar: rank=0 size=4 allreduce fast=9 select=allreduce:measured>=262144 "
                "chosen=bcast@524288:fast:9/3,allreduce.i32@262144:mpi:400/500,"
                "allreduce.i32@524288:fast:900/300,allreduce.f32.sum@524288:mpi:1/2 reasons=\n")
        self.assertEqual(ra.parse_chosen(text, "allreduce.i32"), {262144: "mpi", 524288: "fast"})
        self.assertEqual(ra.parse_chosen(text, ra.class_kind("bcast", "float")), {524288: "fast"})
        self.assertEqual(ra.parse_chosen("", "bcast"), {})
        self.assertEqual(ra.parse_floor(text, "allreduce.i32", "allreduce"), 262144)
        floors = "liberar: rank=0 select=allreduce:measured>=262144,allreduce.f32.sum:measured>=524288,bcast:fixed>=1"
        self.assertEqual(ra.parse_floor(floors, "allreduce.f32.sum", "allreduce"), 524288)
        self.assertEqual(ra.parse_floor(floors, "bcast", "bcast"), 1)
        self.assertIsNone(ra.parse_floor("", "bcast", "bcast"))
        chosen = ra.parse_chosen(text, ra.class_kind("allreduce", "int"))
        sizes = [1024, 262144, 393216, 524288, 1 << 20]
        rows = ra.build_table("allreduce", {s: 1.0 for s in sizes}, {s: 1.0 for s in sizes}, 4, 262144,
                              "measured", chosen=chosen)
        self.assertEqual([r["liberar_path"] for r in rows],
                         ["pmpi", "pmpi (measured)", "pmpi (measured)", "fast", "mixed"])

    def test_csv_and_svg(self):
        rows = ra.build_table("allreduce", {4: 10.0, 1 << 20: 2000.0}, {4: 11.0, 1 << 20: 1000.0}, 4, 262144, "fast")
        with tempfile.TemporaryDirectory() as d:
            ra.write_csv(os.path.join(d, "a.csv"), rows)
            ra.svg_plot(rows, os.path.join(d, "a.svg"), "t")
            self.assertIn("size_bytes", open(os.path.join(d, "a.csv")).read())
            self.assertIn("<svg", open(os.path.join(d, "a.svg")).read())


class Placement(unittest.TestCase):
    """--ranks-per-host / --per-host: several ranks per emulated host, the
    same placement for every configuration, said in the tables."""

    @staticmethod
    def args(**kw):
        import argparse
        base = dict(launcher="erarctl", erarctl="erarctl", mpi="openmpi", hosts=None, ranks_per_host=None,
                    per_host=None, launcher_arg=None)
        base.update(kw)
        return ra.resolve_placement(argparse.Namespace(**base))

    def test_resolve(self):
        a = self.args()
        self.assertEqual((a.hosts, a.per_host, ra.rank_count(a)), (4, None, 4))
        self.assertEqual(ra.placement_args(a), [])
        self.assertEqual(ra.placement_text(a), "4 ranks on 4 hosts, 1 per host")
        a = self.args(hosts=4, ranks_per_host=2)
        self.assertEqual((a.hosts, a.per_host, ra.rank_count(a)), (4, [2, 2, 2, 2], 8))
        self.assertEqual(ra.placement_args(a), ["--ranks-per-host", "2"])
        self.assertEqual(ra.placement_text(a), "8 ranks on 4 hosts, 2 per host")
        a = self.args(ranks_per_host=3)  # --hosts defaults to 4
        self.assertEqual(ra.placement_text(a), "12 ranks on 4 hosts, 3 per host")
        a = self.args(per_host=[3, 1, 2])  # the entries are the host count
        self.assertEqual((a.hosts, ra.rank_count(a)), (3, 6))
        self.assertEqual(ra.placement_args(a), ["--per-host", "3,1,2"])
        self.assertEqual(ra.placement_text(a), "6 ranks on 3 hosts, 3,1,2 per host")
        self.assertEqual(self.args(hosts=3, per_host=[3, 1, 2]).hosts, 3)
        self.assertEqual(ra.placement_args(self.args(per_host=[2, 2])), ["--ranks-per-host", "2"])
        a = self.args(hosts=2, ranks_per_host=1)  # one per host is the plain placement
        self.assertEqual((a.per_host, ra.placement_args(a)), (None, []))
        with self.assertRaises(SystemExit):
            self.args(hosts=4, per_host=[3, 1, 2])
        with self.assertRaises(SystemExit):
            self.args(ranks_per_host=2, per_host=[1, 2])

    def test_parse_per_host(self):
        import argparse
        self.assertEqual(ra.parse_per_host("3,1,2"), [3, 1, 2])
        for bad in ("", "2,0", "a,1", "2,,1"):
            with self.subTest(bad=bad), self.assertRaises(argparse.ArgumentTypeError):
                ra.parse_per_host(bad)

    def test_same_placement_on_every_side(self):
        for kw, want in ((dict(hosts=4, ranks_per_host=2), ["--hosts", "4", "--ranks-per-host", "2"]),
                         (dict(per_host=[3, 1, 2]), ["--hosts", "3", "--per-host", "3,1,2"])):
            launcher = ra.Launcher(self.args(**kw))
            for preload in (None, "/x/liberar.so"):
                with self.subTest(kw=kw, preload=preload):
                    cmd = launcher.command(["osu_allreduce"], preload, {"ERAR_STATS": "1"} if preload else {})
                    i = cmd.index("--hosts")
                    self.assertEqual(cmd[i:i + 4], want)
                    self.assertEqual(cmd[-2:], ["--", "osu_allreduce"])
        # The local smoke-test launcher starts all ranks.
        for mpi, flag in (("openmpi", "-np"), ("mpich", "-n")):
            cmd = ra.Launcher(self.args(launcher="local", mpi=mpi, per_host=[3, 1, 2])).command(["b"], None, {})
            self.assertEqual(cmd[cmd.index(flag) + 1], "6")

    def test_busbw_over_ranks(self):
        (row,) = ra.build_table("allreduce", {1048576: 2000.0}, {1048576: 2000.0}, 8, 262144, "pmpi")
        self.assertAlmostEqual(row["mpi_busbw_GBps"], 2 * 7 / 8 * 1048576 / 2e-3 / 1e9)

    def run_script(self, *argv):
        import subprocess
        return subprocess.run([os.path.join(HERE, "..", "run-allreduce"), *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)

    def test_report_says_the_placement(self):
        with tempfile.TemporaryDirectory() as d:
            logs = []
            for name, scale in (("b", 1.0), ("l", 2.0)):
                path = os.path.join(d, name + ".log")
                with open(path, "w") as f:
                    f.write(OSU.replace("33815.20", f"{33815.20 * scale:.2f}"))
                logs.append(path)
            p = self.run_script("--parse", *logs, "--collective", "allreduce", "--hosts", "4",
                                "--ranks-per-host", "2", "--out", d, "--no-plot")
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("8 ranks on 4 hosts, 2 per host", p.stdout)
            self.assertIn("n ranks", p.stdout)
            with open(os.path.join(d, "allreduce.md")) as f:
                self.assertIn("# allreduce: allreduce_bench --mode allreduce, MPI_FLOAT SUM, 8 ranks on 4 hosts, "
                              "2 per host", f.readline())
            with open(os.path.join(d, "allreduce.csv")) as f:
                row = [r for r in f.read().splitlines() if r.startswith("16777216,")][0]
            busbw = float(row.split(",")[3])
            self.assertAlmostEqual(busbw, 2 * 7 / 8 * 16777216 / 33815.20e-6 / 1e9, places=3)
            p = self.run_script("--parse", *logs, "--collective", "allreduce", "--per-host", "3,1,2",
                                "--out", d, "--no-plot")
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("6 ranks on 3 hosts, 3,1,2 per host", p.stdout)

    def test_bad_options_are_usage_errors(self):
        for argv in (["--ranks-per-host", "2", "--per-host", "2,2"], ["--per-host", "2,0"],
                     ["--ranks-per-host", "0"], ["--hosts", "4", "--per-host", "1,2"]):
            with self.subTest(argv=argv):
                p = self.run_script("--parse", "/dev/null", "/dev/null", "--collective", "allreduce", *argv)
                self.assertEqual(p.returncode, 2 if "--hosts" not in argv else 1, p.stderr)


if __name__ == "__main__":
    unittest.main()
