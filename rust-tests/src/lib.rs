//! Integration-test helpers shared by the files under tests/.
//!
//! The tests run MPI programs on the emulated cluster (`erarctl::testbed`),
//! with and without `build/<mpi>/liberar.so` preloaded, and compare.
//! Everything that needs root or a prerequisite fails loudly with a message
//! that says what to do — a test never passes by skipping its work.
//!
//! Knobs (environment):
//! * `ERAR_TEST_MTU` — MTU of the test bed (default 3400);
//! * `ERAR_TEST_TIMEOUT_SECS` — per-job timeout (default 240);
//! * `ERAR_TEST_END_GRACE_SECS` — how long a job may run after printing
//!   `PASS` (default 20);
//! * `ERAR_TEST_MPICH_ATTEMPTS`, `ERAR_TEST_STRICT_EXIT=1` — MPICH finalize
//!   hangs, see [`mpich_attempts`];
//! * `ERAR_TEST_QUICK=1` — pass `--quick` to the c-tests under Open MPI too
//!   (always passed under MPICH);
//! * `ERAR_TEST_ONLY` — comma-separated program names to run (default all).

use anyhow::{anyhow, bail, ensure, Context, Result};
use erarctl::testbed::{self, LaunchSpec, SwitchKind, TestbedConfig};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

pub use erarctl::testbed::Mpi;

/// Hosts of the shared test bed (every test uses hosts 0..n-1 of it).
pub const TESTBED_HOSTS: usize = 8;

/// The repository root (this crate lives in `<root>/rust-tests`).
pub fn repo_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_path_buf()
}

/// Panics with a clear message unless running as root.
pub fn require_root(what: &str) {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert!(
        euid == 0,
        "{what} needs root (network namespaces, veth, bridge, XDP): run the tests as root, \
         e.g. `sudo scripts/test-all` — this test refuses to pass without doing its work"
    );
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// How long a job may keep running after printing its `PASS` line (then
/// it is hung in MPI_Finalize and counts as timed out).
pub fn end_grace() -> Duration {
    Duration::from_secs(env_u64("ERAR_TEST_END_GRACE_SECS", 20))
}

/// Per-job timeout.
pub fn job_timeout() -> Duration {
    Duration::from_secs(env_u64("ERAR_TEST_TIMEOUT_SECS", 240))
}

/// The switch liberar's runs use: the XDP switch once the build has it.
pub fn test_switch() -> SwitchKind {
    if testbed::XDP_SWITCH_AVAILABLE {
        SwitchKind::Xdp
    } else {
        SwitchKind::Bridge
    }
}

/// The test-bed configuration the suite uses.
pub fn testbed_config() -> TestbedConfig {
    TestbedConfig {
        hosts: TESTBED_HOSTS,
        mtu: env_u64("ERAR_TEST_MTU", 3400) as u32,
        switch: test_switch(),
    }
}

static TESTBED_LOCK: Mutex<()> = Mutex::new(());

/// The lock file every process that uses the shared test bed holds (test
/// binaries run one after another, but a developer's or a benchmark's run
/// may overlap them): `flock /run/lock/erar-testbed.lock <cmd>` from a shell.
pub const TESTBED_LOCK_FILE: &str = "/run/lock/erar-testbed.lock";

/// Exclusive use of the test bed: within this process (the mutex) and
/// across processes (an flock on [`TESTBED_LOCK_FILE`], released when the
/// file closes, also if the process dies).
pub struct TestbedLock {
    _file: std::fs::File,
    _guard: MutexGuard<'static, ()>,
}

fn lock_testbed() -> TestbedLock {
    let guard = TESTBED_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(TESTBED_LOCK_FILE)
        .unwrap_or_else(|e| panic!("opening {TESTBED_LOCK_FILE}: {e}"));
    // SAFETY: flock on a file descriptor we own.
    let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) };
    assert_eq!(
        rc,
        0,
        "flock {TESTBED_LOCK_FILE}: {}",
        std::io::Error::last_os_error()
    );
    TestbedLock {
        _file: file,
        _guard: guard,
    }
}

/// Exclusive use of the shared test bed, brought up (idempotently) with
/// [`testbed_config`]. Tests that use the network hold this for their whole
/// duration, so they never overlap.
pub struct Testbed {
    _lock: TestbedLock,
}

/// Takes the test-bed lock (even if a previous holder panicked) and makes
/// sure the test bed is up.
pub fn testbed() -> Testbed {
    require_root("the emulated-cluster test bed");
    let lock = lock_testbed();
    let cfg = testbed_config();
    if let Err(e) = testbed::up(&cfg) {
        panic!("cannot bring the test bed up ({cfg:?}): {e:#}");
    }
    Testbed { _lock: lock }
}

/// Takes the test-bed lock without touching the test bed (for tests that
/// bring it down and up themselves).
pub fn testbed_lock() -> TestbedLock {
    require_root("the emulated-cluster test bed");
    lock_testbed()
}

/// `build/<mpi>/liberar.so`, which `scripts/build` produces. Panics if absent.
pub fn shim_path(mpi: Mpi) -> PathBuf {
    let p = repo_root()
        .join("build")
        .join(mpi.name())
        .join("liberar.so");
    assert!(
        p.is_file(),
        "{} is missing: run `scripts/build` first (it builds the preload library for both MPIs)",
        p.display()
    );
    p
}

/// One self-checking MPI program from `c-tests/bin/<mpi>/`.
#[derive(Clone, Debug)]
pub struct CTest {
    pub name: String,
    pub path: PathBuf,
    /// Built from Fortran source (`c-tests/<name>.f90` / `.f`).
    pub fortran: bool,
}

fn build_ctests_uncached(mpi: Mpi) -> Result<Vec<CTest>> {
    let dir = repo_root().join("c-tests");
    ensure!(
        dir.join("Makefile").is_file(),
        "{}/Makefile is missing: the c-tests are not in this checkout",
        dir.display()
    );
    let out = Command::new("make")
        .arg("-C")
        .arg(&dir)
        .arg(format!("MPI={}", mpi.name()))
        .output()
        .context("cannot run make (is it installed? scripts/install-deps)")?;
    if !out.status.success() {
        bail!(
            "`make -C c-tests MPI={}` failed ({}):\n{}\n{}",
            mpi.name(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let bin = dir.join("bin").join(mpi.name());
    let mut tests = Vec::new();
    for entry in std::fs::read_dir(&bin).with_context(|| format!("listing {}", bin.display()))? {
        let entry = entry?;
        let path = entry.path();
        use std::os::unix::fs::PermissionsExt;
        let meta = entry.metadata()?;
        if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
            continue;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        // Programs have no extension; skip objects and helper libraries
        // (e.g. the self-test's faulty_mpi.so) that share the directory.
        if name.contains('.') || CONTRACT_PROGRAMS.contains(&name.as_str()) {
            continue;
        }
        let fortran = ["f90", "F90", "f", "F", "f08"]
            .iter()
            .any(|ext| dir.join(format!("{name}.{ext}")).is_file());
        tests.push(CTest {
            name,
            path,
            fortran,
        });
    }
    tests.sort_by(|a, b| a.name.cmp(&b.name));
    ensure!(
        !tests.is_empty(),
        "make built no programs into {}",
        bin.display()
    );
    if let Ok(only) = std::env::var("ERAR_TEST_ONLY") {
        let only: Vec<&str> = only.split(',').map(str::trim).collect();
        tests.retain(|t| only.contains(&t.name.as_str()));
        ensure!(
            !tests.is_empty(),
            "ERAR_TEST_ONLY={only:?} matches no program"
        );
    }
    Ok(tests)
}

/// Programs that check one of liberar's float SUM contracts rather than
/// MPI's semantics: they fail under plain MPI by design (its summation
/// orders do not round correctly), so the with/without comparison of
/// [`check_ctest`] does not apply; their own tests run them
/// (`tests/reproducible.rs`).
const CONTRACT_PROGRAMS: [&str; 1] = ["reproducible"];

/// Builds the c-tests for `mpi` (once per test process) and lists them.
/// Panics with make's output if the build fails.
pub fn ctests(mpi: Mpi) -> Vec<CTest> {
    static CACHE: [OnceLock<std::result::Result<Vec<CTest>, String>>; 2] =
        [OnceLock::new(), OnceLock::new()];
    let slot = &CACHE[match mpi {
        Mpi::Openmpi => 0,
        Mpi::Mpich => 1,
    }];
    match slot.get_or_init(|| build_ctests_uncached(mpi).map_err(|e| format!("{e:#}"))) {
        Ok(v) => v.clone(),
        Err(e) => panic!("building the c-tests for {mpi}: {e}"),
    }
}

/// One `liberar: rank=… ` line printed at finalize with `ERAR_STATS=1`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatsLine {
    pub rank: u64,
    pub size: u64,
    /// Per-collective counters as `allreduce.fast`, `bcast.pmpi`, …; global
    /// ones (`fortran`, `reentrant`, …) under their own names.
    pub counters: BTreeMap<String, u64>,
    /// `reasons=allreduce.below_threshold:3,…` as a map.
    pub reasons: BTreeMap<String, u64>,
    pub raw: String,
}

impl StatsLine {
    pub fn get(&self, key: &str) -> u64 {
        self.counters.get(key).copied().unwrap_or(0)
    }

    /// Every allreduce call the shim saw (fast + PMPI).
    pub fn allreduce_calls(&self) -> u64 {
        self.get("allreduce.fast") + self.get("allreduce.pmpi")
    }

    pub fn bcast_calls(&self) -> u64 {
        self.get("bcast.fast") + self.get("bcast.pmpi")
    }
}

/// Parses one stats line (the text from `liberar: rank=` on).
pub fn parse_stats_line(line: &str) -> Option<StatsLine> {
    let start = line.find("liberar: rank=")?;
    let text = line[start + "liberar:".len()..].trim();
    let mut s = StatsLine {
        raw: line[start..].trim_end().to_owned(),
        ..StatsLine::default()
    };
    let mut section: Option<&str> = None;
    let (mut have_rank, mut have_size) = (false, false);
    for tok in text.split_whitespace() {
        match tok.split_once('=') {
            None => section = Some(tok),
            Some(("rank", v)) => {
                s.rank = v.parse().ok()?;
                have_rank = true;
            }
            Some(("size", v)) => {
                s.size = v.parse().ok()?;
                have_size = true;
            }
            Some(("reasons", v)) => {
                for item in v.split(',').filter(|i| !i.is_empty()) {
                    let (k, n) = item.rsplit_once(':')?;
                    s.reasons.insert(k.to_owned(), n.parse().ok()?);
                }
            }
            Some((k, v)) => {
                let Ok(n) = v.parse::<u64>() else { continue };
                let per_collective = matches!(k, "fast" | "fast_bytes" | "pmpi");
                let key = match (section, per_collective) {
                    (Some(sec), true) => format!("{sec}.{k}"),
                    _ => k.to_owned(),
                };
                s.counters.insert(key, n);
            }
        }
    }
    (have_rank && have_size).then_some(s)
}

/// All stats lines in a job's output.
pub fn parse_stats(text: &str) -> Vec<StatsLine> {
    text.lines().filter_map(parse_stats_line).collect()
}

/// One finished job.
#[derive(Debug)]
pub struct JobResult {
    pub what: String,
    pub output: Output,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    /// MPICH only: the job printed its results, then hung in MPI_Finalize
    /// and was killed (see [`mpich_attempts`]); `output.status` is moot.
    pub finalize_hung: bool,
}

impl JobResult {
    fn lines_with<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.stdout
            .lines()
            .chain(self.stderr.lines())
            .map(str::trim)
            .filter(move |l| l.starts_with(prefix))
    }

    /// `DIGEST <hex>` lines (whole lines, trimmed).
    pub fn digests(&self) -> Vec<String> {
        self.lines_with("DIGEST ").map(str::to_owned).collect()
    }

    pub fn passes(&self) -> Vec<String> {
        self.lines_with("PASS ").map(str::to_owned).collect()
    }

    pub fn stats(&self) -> Vec<StatsLine> {
        let mut v = parse_stats(&self.stderr);
        v.extend(parse_stats(&self.stdout));
        v
    }

    /// The end of the output, for failure messages.
    pub fn tail(&self) -> String {
        fn last(s: &str, n: usize) -> String {
            let lines: Vec<&str> = s.lines().collect();
            let from = lines.len().saturating_sub(n);
            let mut t = lines[from..].join("\n");
            if from > 0 {
                t = format!("[… {from} lines omitted …]\n{t}");
            }
            t
        }
        format!(
            "--- {} ({}, {:.1}s) ---\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.what,
            self.output.status,
            self.elapsed.as_secs_f64(),
            last(&self.stdout, 40),
            last(&self.stderr, 40)
        )
    }
}

/// Attempts per MPICH job. MPICH 4.0.2's ch4:ucx finalize can deadlock
/// over UCX tcp: a rank whose endpoint still needs its peer's progress
/// spins in `ucp_worker_progress` inside `MPI_Finalize` while the peer
/// already sits in the blocking PMI barrier (pmodels/mpich#6596, fixed
/// upstream, not in Debian 12). It strikes at random after the program has
/// finished its work and printed everything, more often under CPU load, and
/// has nothing to do with liberar. So an MPICH job that hangs *after its
/// end marker* (`PASS …`) is killed after [`end_grace`] and retried; if
/// every attempt hangs that way, the last output is used with
/// [`JobResult::finalize_hung`] set, and the checks on the output still
/// apply (only the exit status is unknowable). `ERAR_TEST_STRICT_EXIT=1`
/// makes that a failure instead. A job that exits is never retried, and a
/// job that hangs before its end marker always fails.
pub fn mpich_attempts() -> u32 {
    env_u64("ERAR_TEST_MPICH_ATTEMPTS", 2).max(1) as u32
}

/// Whether a finalize hang (see [`mpich_attempts`]) fails the test.
pub fn strict_exit() -> bool {
    std::env::var("ERAR_TEST_STRICT_EXIT").is_ok_and(|v| v == "1")
}

/// Runs a job on the test bed (caller holds [`Testbed`]). MPICH jobs that
/// hang in shutdown are retried, see [`mpich_attempts`].
pub fn run_job(spec: &LaunchSpec) -> Result<JobResult> {
    let what = format!(
        "{} {} ranks{}: {}",
        spec.mpi,
        spec.placement().len(),
        if spec.preload.is_some() {
            " +liberar.so"
        } else {
            ""
        },
        spec.program
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let attempts = match spec.mpi {
        Mpi::Mpich if spec.end_marker.is_some() => mpich_attempts(),
        _ => 1,
    };
    for attempt in 1..=attempts {
        let t0 = Instant::now();
        let result = testbed::launch(spec);
        let elapsed = t0.elapsed();
        let (output, finalize_hung) = match result {
            Ok(output) => (output, false),
            Err(e) => {
                let tolerated = spec.mpi == Mpi::Mpich
                    && e.downcast_ref::<testbed::Hung>()
                        .is_some_and(|h| h.after_marker);
                if !tolerated {
                    return Err(e.context(format!("running {what}")));
                }
                if attempt < attempts {
                    eprintln!(
                        "  {what}: attempt {attempt} of {attempts} hung in MPI_Finalize \
                         (known MPICH 4.0.2/UCX bug); retrying"
                    );
                    continue;
                }
                match e.downcast::<testbed::Hung>() {
                    Ok(h) => (h.output, true),
                    Err(e) => return Err(e.context(format!("running {what}"))),
                }
            }
        };
        eprintln!(
            "  {what}: {} in {:.1}s",
            if finalize_hung {
                "HUNG IN MPI_Finalize after printing its results (killed)".to_owned()
            } else {
                output.status.to_string()
            },
            elapsed.as_secs_f64()
        );
        return Ok(JobResult {
            what,
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
            output,
            elapsed,
            finalize_hung,
        });
    }
    Err(anyhow!("running {what}: no attempt made"))
}

/// Arguments for every c-test run: `--quick` under MPICH (its small messages
/// are slow over UCX tcp), or for both with `ERAR_TEST_QUICK=1`.
pub fn ctest_args(mpi: Mpi) -> Vec<String> {
    let quick = mpi == Mpi::Mpich || std::env::var("ERAR_TEST_QUICK").is_ok_and(|v| v == "1");
    if quick {
        vec!["--quick".to_owned()]
    } else {
        Vec::new()
    }
}

/// How the run with liberar.so routes calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// `ERAR_SELECT=threshold`: every eligible call at or above the default
    /// thresholds takes the fast path (the c-tests check its semantics).
    Threshold,
    /// liberar's defaults, as a user runs it: calls routed by measurement,
    /// trials through MPI included.
    Default,
}

/// Runs `t` without and with liberar.so: both must exit 0 (or hang only in
/// MPICH's finalize), print `PASS <name>` and exactly one DIGEST, the same.
fn run_with_and_without(
    mpi: Mpi,
    t: &CTest,
    hosts: usize,
    routing: Routing,
) -> Result<(JobResult, JobResult)> {
    let spec = |preload: bool| {
        let mut program = vec![t.path.clone().into_os_string()];
        program.extend(ctest_args(mpi).into_iter().map(Into::into));
        let mut s = LaunchSpec::new(mpi, hosts, program)
            .env("ERAR_STATS", "1")
            .timeout(job_timeout())
            .end_marker("PASS ", end_grace());
        if routing == Routing::Threshold {
            s = s.env("ERAR_SELECT", "threshold");
        }
        if preload {
            s = s.preload(shim_path(mpi));
        }
        s
    };
    let base = run_job(&spec(false))?;
    let with = run_job(&spec(true))?;
    let ctx = || format!("{}\n{}", base.tail(), with.tail());

    for r in [&base, &with] {
        if r.finalize_hung {
            ensure!(
                !strict_exit(),
                "{} hung in MPI_Finalize (ERAR_TEST_STRICT_EXIT=1)\n{}",
                r.what,
                ctx()
            );
            eprintln!(
                "  WARNING: {} hung in MPI_Finalize after printing its results (MPICH 4.0.2 \
                 UCX finalize bug); its exit status is unknown, its output is still checked",
                r.what
            );
        } else if !r.output.status.success() {
            bail!("{} exited with {}\n{}", r.what, r.output.status, ctx());
        }
        let want_pass = format!("PASS {}", t.name);
        if !r.passes().contains(&want_pass) {
            bail!("{} did not print `{want_pass}`\n{}", r.what, ctx());
        }
    }
    let (db, dw) = (base.digests(), with.digests());
    if db.len() != 1 || dw.len() != 1 {
        bail!(
            "expected exactly one DIGEST line per run (rank 0), got {} without and {} with liberar\n{}",
            db.len(),
            dw.len(),
            ctx()
        );
    }
    if db != dw {
        bail!(
            "results differ: without liberar `{}`, with liberar `{}`\n{}",
            db[0],
            dw[0],
            ctx()
        );
    }
    Ok((base, with))
}

/// Runs one c-test with liberar's default routing (see [`Routing::Default`]):
/// the same results as without it, exit 0 and one stats line per rank.
/// Which path each call took is the routing's affair (tests/selection.rs).
pub fn check_ctest_default_routing(mpi: Mpi, t: &CTest, hosts: usize) -> Result<()> {
    let (base, with) = run_with_and_without(mpi, t, hosts, Routing::Default)?;
    check_stats_per_rank(&with.stats(), hosts)
        .map_err(|e| anyhow!("{e:#}\n{}\n{}", base.tail(), with.tail()))?;
    eprintln!(
        "  ok {} on {mpi} x{hosts}, default routing: {}",
        t.name,
        with.digests()[0]
    );
    Ok(())
}

/// Runs one c-test with and without liberar.so and checks the contract:
/// both exit 0, identical DIGEST, PASS printed, one stats line per rank
/// with the preload (none without), and the Fortran counters.
pub fn check_ctest(mpi: Mpi, t: &CTest, hosts: usize) -> Result<()> {
    let (base, with) = run_with_and_without(mpi, t, hosts, Routing::Threshold)?;
    let ctx = || format!("{}\n{}", base.tail(), with.tail());
    let stray = base.stats();
    if !stray.is_empty() {
        bail!(
            "a run WITHOUT the preload printed liberar stats lines:\n{}\n{}",
            stray[0].raw,
            ctx()
        );
    }
    let stats = with.stats();
    check_stats_per_rank(&stats, hosts).map_err(|e| anyhow!("{e:#}\n{}", ctx()))?;
    // Every program but the broadcast one makes large float/int allreduces
    // on MPI_COMM_WORLD: the fast path must have run on every rank, and not
    // merely handed everything back to MPI.
    if t.name == "bcast_roots" {
        for s in &stats {
            ensure!(
                s.get("bcast.fast") > 0,
                "bcast_roots: rank {} did not use the in-kernel broadcast: {}\n{}",
                s.rank,
                s.raw,
                ctx()
            );
            // Its buffer broadcast again and again is registered: XDP
            // read (root) or wrote it in place.
            ensure!(
                s.get("bcast_in_place") > 0,
                "bcast_roots: rank {} ran no broadcast in place (ERAR_ZERO_COPY): {}\n{}",
                s.rank,
                s.raw,
                ctx()
            );
        }
    } else {
        for s in &stats {
            ensure!(
                s.get("allreduce.fast") > 0
                    && s.get("fallback_bytes") < s.get("allreduce.fast_bytes"),
                "{}: rank {} did not use the eBPF fast path: {}\n{}",
                t.name,
                s.rank,
                s.raw,
                ctx()
            );
        }
    }
    if t.fortran {
        for s in &stats {
            match mpi {
                // Open MPI's Fortran bindings call PMPI_ directly: only the
                // shim's own Fortran entry points can have seen the calls.
                Mpi::Openmpi => ensure!(
                    s.get("fortran") > 0,
                    "Fortran program under Open MPI: rank {} counted fortran=0 (the shim's Fortran \
                     entry points were not used): {}\n{}",
                    s.rank,
                    s.raw,
                    ctx()
                ),
                // MPICH's Fortran layer calls the C MPI_ symbols.
                Mpi::Mpich => ensure!(
                    s.allreduce_calls() > 0,
                    "Fortran program under MPICH: rank {} saw no allreduce calls: {}\n{}",
                    s.rank,
                    s.raw,
                    ctx()
                ),
            }
        }
    }
    eprintln!(
        "  ok {} on {mpi} x{hosts}: {} | rank0: {}",
        t.name,
        with.digests()[0],
        stats
            .iter()
            .find(|s| s.rank == 0)
            .map(|s| s.raw.as_str())
            .unwrap_or("")
    );
    Ok(())
}

/// Exactly one stats line for each rank 0..n-1, all with `size=n`.
pub fn check_stats_per_rank(stats: &[StatsLine], n: usize) -> Result<()> {
    let mut seen = vec![0usize; n];
    for s in stats {
        ensure!(
            s.size == n as u64,
            "stats line with size={} in a job of {n} ranks: {}",
            s.size,
            s.raw
        );
        let r = usize::try_from(s.rank).unwrap_or(usize::MAX);
        ensure!(r < n, "stats line for rank {} of {n}: {}", s.rank, s.raw);
        seen[r] += 1;
    }
    let missing: Vec<usize> = (0..n).filter(|&r| seen[r] == 0).collect();
    let dup: Vec<usize> = (0..n).filter(|&r| seen[r] > 1).collect();
    ensure!(
        missing.is_empty() && dup.is_empty(),
        "with ERAR_STATS=1 every rank must print one `liberar: rank=…` line; \
         missing for ranks {missing:?}, repeated for ranks {dup:?}"
    );
    Ok(())
}

/// Runs every c-test for `mpi` on `hosts` ranks, routed as `routing` says;
/// panics with every failure.
pub fn check_all_ctests(mpi: Mpi, hosts: usize, routing: Routing) {
    let _tb = testbed();
    shim_path(mpi);
    let tests = ctests(mpi);
    let mut failures = Vec::new();
    for t in &tests {
        let checked = match routing {
            Routing::Threshold => check_ctest(mpi, t, hosts),
            Routing::Default => check_ctest_default_routing(mpi, t, hosts),
        };
        if let Err(e) = checked {
            failures.push(format!(
                "=== {} ({mpi}, {hosts} hosts) FAILED: {e:#}",
                t.name
            ));
        }
    }
    if !failures.is_empty() {
        panic!(
            "{} of {} c-tests failed on {mpi} with {hosts} hosts:\n{}",
            failures.len(),
            tests.len(),
            failures.join("\n\n")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_stats_line() {
        let l = "liberar: rank=3 size=4 allreduce fast=2 fast_bytes=4096 pmpi=5 bcast fast=0 \
                 fast_bytes=0 pmpi=1 fortran=7 reasons=allreduce.below_threshold:4,bcast.trivial:1";
        let s = parse_stats_line(&format!("[1,3]<stderr>:{l}")).expect("parses");
        assert_eq!((s.rank, s.size), (3, 4));
        assert_eq!(s.get("allreduce.fast"), 2);
        assert_eq!(s.get("allreduce.pmpi"), 5);
        assert_eq!(s.get("bcast.pmpi"), 1);
        assert_eq!(s.get("fortran"), 7);
        assert_eq!(s.allreduce_calls(), 7);
        assert_eq!(s.reasons.get("allreduce.below_threshold"), Some(&4));
        assert_eq!(s.raw, l);
        assert!(parse_stats_line("liberar: something else").is_none());
        assert!(parse_stats_line("no stats here").is_none());
    }

    #[test]
    fn checks_one_line_per_rank() {
        let mk = |rank, size| StatsLine {
            rank,
            size,
            ..StatsLine::default()
        };
        assert!(check_stats_per_rank(&[mk(0, 2), mk(1, 2)], 2).is_ok());
        assert!(check_stats_per_rank(&[mk(0, 2)], 2).is_err());
        assert!(check_stats_per_rank(&[mk(0, 2), mk(0, 2), mk(1, 2)], 2).is_err());
        assert!(check_stats_per_rank(&[mk(0, 3), mk(1, 3)], 2).is_err());
    }

    #[test]
    fn repo_root_is_the_workspace() {
        assert!(repo_root().join("Cargo.toml").is_file());
        assert!(repo_root().join("rust-tests").is_dir());
    }
}
