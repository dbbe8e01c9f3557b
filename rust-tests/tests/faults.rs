//! Faults while the fast path runs (issue #4, items 2, 3 and 6), on 4 hosts
//! under Open MPI with `liberar.so`, driven by `c-tests/fault_loop` (a loop
//! of large MPI_Allreduce / MPI_Bcast calls, every result checked on every
//! rank against a reference it computes itself, one `iter K ok` line per
//! rank and iteration, MPI_ERRORS_RETURN so MPI errors are printed with
//! their class):
//!
//! * `kill9_one_rank_ends_the_job_and_frees_the_datapath` — `kill -9` of the
//!   rank inside host 2 mid-loop: the whole job ends within 15 s, nothing of
//!   it is left in any host namespace, and the kernel holds no liberar
//!   object any more (no `erar_xdp` program, none of its maps, no XDP on any
//!   host's eth0; the test bed's own `testbed_switch` on the bridge ports
//!   stays). The same objects are first seen while the job runs, so the
//!   check cannot pass by looking in the wrong place.
//! * `kill9_non_leader_with_two_ranks_per_host` and
//!   `kill9_slice_leader_with_two_ranks_per_host` — issue 14's node path:
//!   2 ranks on each of the 4 hosts, so MPI_COMM_WORLD's integer
//!   allreduces and broadcasts meet in each host's shared memory
//!   (`/dev/shm/liberar.*`, unlinked once mapped) and cross the hosts on
//!   slice rings led by the first local ranks. `kill -9` of local rank 1 of
//!   host 2 with one slice (`ERAR_NODE_SLICES=1`: it leads none, holds no
//!   BPF object), and of local rank 0 of host 2 with the default two slices
//!   (it leads slice 0 and made the host's shared memory): the job ends
//!   within 15 s, nothing of it is left in the host namespaces or in the
//!   kernel (as above), and `/dev/shm` holds no `liberar.*` entry that was
//!   not there before the job — while the job ran, every rank had the
//!   shared memory mapped, so the check looks where the job's objects were.
//! * `link_flap_completes_every_call_correctly` — host 1's switch port down
//!   for 1.5 s mid-loop, then up: every rank completes every iteration with
//!   right results; the counters say whether the ring recovered the lost
//!   frames (`recovery_rounds`) or MPI completed the calls
//!   (`fallback_bytes`).
//! * `link_down_for_good_ends_every_rank` and
//!   `link_down_for_good_between_calls_ends_every_rank` — host 1's port
//!   down for good mid-loop, at an arbitrary moment and while every rank is
//!   between calls: every rank must end within 30 s
//!   (`ERAR_TEST_LINK_LOSS_SECS` changes the bound). Inside a call the
//!   ranks' deadline (ERAR_TIMEOUT_MS) ends it; before a call's first
//!   exchange, which has no deadline (a rank may be late), the liveness
//!   probes of `liberar::datapath::liveness` do: every survivor finds host 1
//!   silent, host 1 finds everyone silent.
//! * `a_network_that_drops_the_frames_leaves_every_call_to_mpi` — the
//!   plain bridge as the switch from the start (its ports drop what the
//!   hosts' XDP programs send): with 1 and 2 ranks per host, every ring's
//!   setup finds its probes unanswered and declines, the job passes on MPI
//!   with no call on the fast path, and nothing of liberar stays in the
//!   kernel while it runs.
//! * `two_concurrent_jobs_are_both_correct` — two jobs with different
//!   inputs on the same 4 hosts at once (no agent): both correct.
//!   `two_concurrent_jobs_are_both_accelerated`: and both on the fast path
//!   — an interface takes one XDP program, so on each host the job that
//!   attaches second shares the first one's (`kernel::adopt`), each job on
//!   its own slot.
//!
//! "Frames of a stale operation or of another job never change a result"
//! is the datapath fuzzer's job; the concurrent-jobs test covers it too:
//! both jobs' frames cross the same XDP programs at once.
//!
//! Jobs run in the background (`erarctl::testbed::launch::prepare`) so the
//! test can act while they run; every test holds the shared test-bed lock.

use anyhow::{anyhow, bail, ensure, Context, Result};
use erarctl::testbed::{self, launch::Prepared, LaunchSpec};
use rust_tests::{ctests, parse_stats, repo_root, shim_path, testbed, Mpi, StatsLine};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const HOSTS: usize = 4;
/// How long a job may run at most, whatever happens (then it is killed).
const JOB_LIMIT: Duration = Duration::from_secs(150);
/// Bound for a job to end after one of its ranks was killed.
const KILL_BOUND: Duration = Duration::from_secs(15);
/// Bound for every rank to end after its host lost its link for good.
const LINK_LOSS_BOUND: Duration = Duration::from_secs(30);
/// Names of liberar's kernel objects (`bpf/erar_ring.bpf.c`).
const PROG_NAME: &str = "erar_xdp";
/// The datapath's maps: the arrays of maps and each slot's own maps (the
/// slot's ring buffer is named like its array, `slot_events`).
const MAP_NAMES: [&str; 9] = [
    "slot_bufs",
    "slot_ctls",
    "chunk_states",
    "resends",
    "slot_events",
    "slot_buf",
    "slot_ctl",
    "chunk_state",
    "resend",
];

fn fault_loop() -> PathBuf {
    ctests(Mpi::Openmpi); // builds c-tests/bin/openmpi/fault_loop
    let p = repo_root().join("c-tests/bin/openmpi/fault_loop");
    assert!(p.is_file(), "{} was not built", p.display());
    p
}

fn spec(args: &[&str], env: &[(&str, &str)]) -> LaunchSpec {
    let mut argv = vec![fault_loop().into_os_string()];
    argv.extend(args.iter().map(Into::into));
    let mut s = LaunchSpec::new(Mpi::Openmpi, HOSTS, argv)
        .env("ERAR_STATS", "1")
        // Faults of the fast path: every eligible call takes it, no trials.
        .env("ERAR_SELECT", "threshold")
        .preload(shim_path(Mpi::Openmpi));
    for (k, v) in env {
        s = s.env(*k, *v);
    }
    s
}

// ------------------------------------------------------------ background jobs

#[derive(Clone, Debug)]
struct Line {
    at: Instant,
    stderr: bool,
    text: String,
}

/// One MPI job running in the background; its output is collected line by
/// line as it comes. Dropped while running, it is killed (launcher's process
/// group, then whatever is left in the job's host namespaces).
struct Job {
    name: String,
    child: Child,
    pgid: i32,
    started: Instant,
    lines: Arc<Mutex<Vec<Line>>>,
    readers: Vec<JoinHandle<()>>,
    exited: Option<(ExitStatus, Instant)>,
    _prepared: Prepared, // its wrapper directory lives as long as the job
}

fn collect<R: Read + Send + 'static>(
    mut pipe: R,
    stderr: bool,
    lines: Arc<Mutex<Vec<Line>>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut pending = Vec::new();
        let mut buf = [0u8; 8192];
        let push = |bytes: &[u8]| {
            lines.lock().unwrap().push(Line {
                at: Instant::now(),
                stderr,
                text: String::from_utf8_lossy(bytes).trim_end().to_owned(),
            })
        };
        loop {
            match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    pending.extend_from_slice(&buf[..n]);
                    while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
                        push(&pending[..nl]);
                        pending.drain(..=nl);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        if !pending.is_empty() {
            push(&pending);
        }
    })
}

impl Job {
    fn start(name: &str, spec: &LaunchSpec) -> Result<Job> {
        Job::spawn(name, testbed::launch::prepare(spec)?)
    }

    /// Starts several jobs as close together as possible: every launcher
    /// command is prepared (which inspects the test bed, ~0.1 s) before the
    /// first one is spawned.
    fn start_together(jobs: &[(&str, &LaunchSpec)]) -> Result<Vec<Job>> {
        let prepared = jobs
            .iter()
            .map(|(_, spec)| testbed::launch::prepare(spec))
            .collect::<Result<Vec<_>>>()?;
        jobs.iter()
            .zip(prepared)
            .map(|((name, _), p)| Job::spawn(name, p))
            .collect()
    }

    fn spawn(name: &str, mut prepared: Prepared) -> Result<Job> {
        prepared
            .command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        std::os::unix::process::CommandExt::process_group(&mut prepared.command, 0);
        let mut child = prepared
            .command
            .spawn()
            .with_context(|| format!("starting job {name}"))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let readers = vec![
            collect(child.stdout.take().unwrap(), false, lines.clone()),
            collect(child.stderr.take().unwrap(), true, lines.clone()),
        ];
        Ok(Job {
            name: name.to_owned(),
            pgid: child.id() as i32,
            child,
            started: Instant::now(),
            lines,
            readers,
            exited: None,
            _prepared: prepared,
        })
    }

    fn lines(&self) -> Vec<Line> {
        self.lines.lock().unwrap().clone()
    }

    fn poll(&mut self) -> Option<(ExitStatus, Instant)> {
        if self.exited.is_none() {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.exited = Some((st, Instant::now()));
            }
        }
        self.exited
    }

    /// Waits until a line satisfies `pred` (Ok(when)), the job exits, or
    /// `limit` passes (Err with the output).
    fn wait_line(&mut self, limit: Duration, pred: impl Fn(&str) -> bool) -> Result<Instant> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(l) = self.lines().iter().find(|l| pred(&l.text)) {
                return Ok(l.at);
            }
            if self.poll().is_some() || Instant::now() > deadline {
                // One last look: the line may have come with the exit.
                std::thread::sleep(Duration::from_millis(100));
                if let Some(l) = self.lines().iter().find(|l| pred(&l.text)) {
                    return Ok(l.at);
                }
                bail!(
                    "job {}: the awaited line never came ({})\n{}",
                    self.name,
                    if self.exited.is_some() {
                        "the job exited"
                    } else {
                        "timed out"
                    },
                    self.tail(60)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the launcher to exit, at most until `deadline`.
    fn wait_exit(&mut self, deadline: Instant) -> Option<(ExitStatus, Instant)> {
        loop {
            if let Some(e) = self.poll() {
                return Some(e);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM to the launcher's group, SIGKILL after 3 s, then SIGKILL to
    /// anything left in the job's host namespaces.
    fn kill(&mut self) {
        if self.poll().is_none() {
            // SAFETY: kill(2) on the process group this job created.
            unsafe { libc::kill(-self.pgid, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(3);
            if self.wait_exit(deadline).is_none() {
                // SAFETY: as above.
                unsafe { libc::kill(-self.pgid, libc::SIGKILL) };
                let _ = self.child.wait();
                self.exited = self.exited.or(Some((
                    std::os::unix::process::ExitStatusExt::from_raw(9),
                    Instant::now(),
                )));
            }
        }
        kill_in_hosts();
    }

    /// Waits for the output pipes to close (after the exit).
    fn join_readers(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }

    fn text(&self, stderr: bool) -> String {
        self.lines()
            .iter()
            .filter(|l| l.stderr == stderr)
            .map(|l| l.text.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn stats(&self) -> Vec<StatsLine> {
        let mut v = parse_stats(&self.text(true));
        v.extend(parse_stats(&self.text(false)));
        v.sort_by_key(|s| s.rank);
        v
    }

    fn tail(&self, n: usize) -> String {
        let lines = self.lines();
        let from = lines.len().saturating_sub(n);
        let mut out = format!(
            "--- job {} ({:.1}s, {}) ---\n",
            self.name,
            self.started.elapsed().as_secs_f64(),
            match self.exited {
                Some((st, _)) => st.to_string(),
                None => "running".into(),
            }
        );
        if from > 0 {
            out.push_str(&format!("[… {from} lines omitted …]\n"));
        }
        for l in &lines[from..] {
            out.push_str(if l.stderr { "E| " } else { "O| " });
            out.push_str(&l.text);
            out.push('\n');
        }
        out
    }

    /// `iter K ok rank=R ms=T at=S` lines: (rank, iteration, ms, when).
    fn iterations(&self) -> Vec<(usize, usize, f64, Instant)> {
        self.lines()
            .iter()
            .filter_map(|l| {
                let rest = l.text.trim().strip_prefix("iter ")?;
                let mut words = rest.split_whitespace();
                let k = words.next()?.parse().ok()?;
                (words.next()? == "ok").then_some(())?;
                let mut rank = None;
                let mut ms = None;
                for w in words {
                    if let Some(v) = w.strip_prefix("rank=") {
                        rank = v.parse().ok();
                    } else if let Some(v) = w.strip_prefix("ms=") {
                        ms = v.parse().ok();
                    }
                }
                Some((rank?, k, ms?, l.at))
            })
            .collect()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.kill();
        self.join_readers();
    }
}

/// Pids inside host namespace `erar-h<i>`.
fn host_pids(i: usize) -> Vec<i32> {
    let out = Command::new("ip")
        .args(["netns", "pids", &testbed::host_ns(i)])
        .output();
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect(),
        Err(_) => Vec::new(),
    }
}

fn describe_pid(pid: i32) -> String {
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .replace('\0', " ")
                .trim()
                .to_owned()
        })
        .unwrap_or_default();
    format!("{pid} ({cmd})")
}

/// Every process in the job's host namespaces, described.
fn processes_in_hosts() -> Vec<String> {
    (0..HOSTS)
        .flat_map(|i| {
            host_pids(i)
                .into_iter()
                .map(move |p| format!("{}: {}", testbed::host_ns(i), describe_pid(p)))
        })
        .collect()
}

/// SIGKILLs whatever is left in the job's host namespaces (only processes
/// the tests started live there).
fn kill_in_hosts() {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pids: Vec<i32> = (0..HOSTS).flat_map(host_pids).collect();
        if pids.is_empty() || Instant::now() > deadline {
            return;
        }
        for p in pids {
            // SAFETY: kill(2) of a specific pid.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

// ------------------------------------------------------------ links

fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .with_context(|| format!("running ip {}", args.join(" ")))?;
    ensure!(
        out.status.success(),
        "ip {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The test bed's switch changed for a test; the suite's again when
/// dropped (also when the test fails).
struct SwitchSet;

impl SwitchSet {
    fn new(kind: testbed::SwitchKind) -> Result<SwitchSet> {
        testbed::set_switch(kind)?;
        Ok(SwitchSet)
    }
}

impl Drop for SwitchSet {
    fn drop(&mut self) {
        if let Err(e) = testbed::set_switch(rust_tests::test_switch()) {
            eprintln!("  WARNING: could not set the test bed's switch back: {e:#}");
        }
    }
}

/// A switch port taken down; brought up again when dropped (also when the
/// test fails), so the shared test bed is never left broken.
struct PortDown {
    port: String,
}

impl PortDown {
    fn new(host: usize) -> Result<PortDown> {
        let port = testbed::port_ifname(host);
        ip(&["link", "set", &port, "down"])?;
        Ok(PortDown { port })
    }
}

impl Drop for PortDown {
    fn drop(&mut self) {
        if let Err(e) = ip(&["link", "set", &self.port, "up"]) {
            eprintln!("  WARNING: could not bring {} up again: {e:#}", self.port);
        }
    }
}

// ------------------------------------------------------------ kernel objects

/// A minimal JSON value, enough for `bpftool -j` and `ip -j`.
#[derive(Debug, Clone)]
#[allow(dead_code)] // every variant is parsed; not every payload is read
enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    fn parse(text: &str) -> Result<Json> {
        let b = text.as_bytes();
        let mut i = 0;
        let v = Self::value(b, &mut i)?;
        Self::ws(b, &mut i);
        ensure!(i == b.len(), "trailing characters in JSON at {i}");
        Ok(v)
    }

    fn ws(b: &[u8], i: &mut usize) {
        while *i < b.len() && b[*i].is_ascii_whitespace() {
            *i += 1;
        }
    }

    fn value(b: &[u8], i: &mut usize) -> Result<Json> {
        Self::ws(b, i);
        let c = *b.get(*i).ok_or_else(|| anyhow!("JSON ends early"))?;
        match c {
            b'{' => {
                *i += 1;
                let mut fields = Vec::new();
                loop {
                    Self::ws(b, i);
                    if b.get(*i) == Some(&b'}') {
                        *i += 1;
                        return Ok(Json::Obj(fields));
                    }
                    let Json::Str(k) = Self::value(b, i)? else {
                        bail!("JSON object key is not a string at {i}");
                    };
                    Self::ws(b, i);
                    ensure!(b.get(*i) == Some(&b':'), "JSON: ':' expected at {i}");
                    *i += 1;
                    fields.push((k, Self::value(b, i)?));
                    Self::ws(b, i);
                    if b.get(*i) == Some(&b',') {
                        *i += 1;
                    }
                }
            }
            b'[' => {
                *i += 1;
                let mut items = Vec::new();
                loop {
                    Self::ws(b, i);
                    if b.get(*i) == Some(&b']') {
                        *i += 1;
                        return Ok(Json::Arr(items));
                    }
                    items.push(Self::value(b, i)?);
                    Self::ws(b, i);
                    if b.get(*i) == Some(&b',') {
                        *i += 1;
                    }
                }
            }
            b'"' => {
                *i += 1;
                let mut s = Vec::new();
                while *i < b.len() && b[*i] != b'"' {
                    if b[*i] == b'\\' && *i + 1 < b.len() {
                        *i += 1;
                        match b[*i] {
                            b'n' => s.push(b'\n'),
                            b't' => s.push(b'\t'),
                            b'u' => {
                                // Not needed for these tools' names: keep as is.
                                s.extend_from_slice(b"\\u");
                            }
                            other => s.push(other),
                        }
                    } else {
                        s.push(b[*i]);
                    }
                    *i += 1;
                }
                ensure!(*i < b.len(), "unterminated JSON string");
                *i += 1;
                Ok(Json::Str(String::from_utf8_lossy(&s).into_owned()))
            }
            b't' | b'f' | b'n' => {
                for (word, v) in [
                    ("true", Json::Bool(true)),
                    ("false", Json::Bool(false)),
                    ("null", Json::Null),
                ] {
                    if b[*i..].starts_with(word.as_bytes()) {
                        *i += word.len();
                        return Ok(v);
                    }
                }
                bail!("bad JSON literal at {i}")
            }
            _ => {
                let start = *i;
                while *i < b.len()
                    && matches!(b[*i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    *i += 1;
                }
                let s = std::str::from_utf8(&b[start..*i])?;
                Ok(Json::Num(s.parse().with_context(|| {
                    format!("bad JSON number {s:?} at {start}")
                })?))
            }
        }
    }

    fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(f) => f.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    fn str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    fn u64(&self) -> Option<u64> {
        match self {
            Json::Num(n) if *n >= 0.0 => Some(*n as u64),
            _ => None,
        }
    }

    fn items(&self) -> &[Json] {
        match self {
            Json::Arr(a) => a,
            _ => &[],
        }
    }
}

fn run_json(cmd: &str, args: &[&str]) -> Result<Json> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .with_context(|| format!("running {cmd} (bpftool: apt-get install bpftool)"))?;
    ensure!(
        out.status.success(),
        "{cmd} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    if text.trim().is_empty() {
        return Ok(Json::Arr(Vec::new()));
    }
    Json::parse(&text).with_context(|| format!("parsing the JSON of {cmd} {}", args.join(" ")))
}

/// Processes holding BPF objects open (from `/proc/*/fd` and `fdinfo`):
/// program ids and map ids -> holder pids. A bpf_link fd counts as holding
/// its program.
#[derive(Debug, Default)]
struct Holders {
    progs: BTreeMap<u64, BTreeSet<i32>>,
    maps: BTreeMap<u64, BTreeSet<i32>>,
}

impl Holders {
    fn read() -> Holders {
        let mut h = Holders::default();
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return h;
        };
        for p in procs.flatten() {
            let Some(pid) = p.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
                continue;
            };
            for fd in fds.flatten() {
                let Ok(target) = std::fs::read_link(fd.path()) else {
                    continue;
                };
                let target = target.to_string_lossy();
                if !target.starts_with("anon_inode:bpf") {
                    continue;
                }
                let info = p.path().join("fdinfo").join(fd.file_name());
                let Ok(info) = std::fs::read_to_string(info) else {
                    continue;
                };
                for line in info.lines() {
                    let (key, val) = line.split_once(':').unwrap_or((line, ""));
                    let Ok(id) = val.trim().parse::<u64>() else {
                        continue;
                    };
                    match key {
                        "prog_id" => h.progs.entry(id).or_default().insert(pid),
                        "map_id" => h.maps.entry(id).or_default().insert(pid),
                        _ => false,
                    };
                }
            }
        }
        h
    }
}

/// The network namespace (inode) of a process, or of `/run/netns/<name>`.
fn netns_inode(path: &str) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// Whether every holder is a live process outside the job's host
/// namespaces: then the object belongs to someone else (e.g. a datapath
/// fuzzer in its own namespace) and says nothing about the job.
fn foreign(holders: Option<&BTreeSet<i32>>, host_ns: &BTreeSet<u64>) -> bool {
    let Some(pids) = holders.filter(|p| !p.is_empty()) else {
        return false;
    };
    pids.iter().all(|pid| {
        netns_inode(&format!("/proc/{pid}/ns/net")).is_some_and(|ino| !host_ns.contains(&ino))
    })
}

/// The highest BPF program and map ids before a job started: ids only grow,
/// so an object with a higher id was created during the job. liberar
/// objects that existed before it (other users of this machine: datapath
/// fuzzers, node-agent experiments in their own namespaces, possibly with
/// pinned links and no process holding them) are not the job's.
#[derive(Clone, Copy, Debug, Default)]
struct Baseline {
    prog: u64,
    map: u64,
}

impl Baseline {
    fn now() -> Result<Baseline> {
        let max_id = |what: &str| -> Result<u64> {
            Ok(run_json("bpftool", &["-j", what, "show"])?
                .items()
                .iter()
                .filter_map(|o| o.get("id").and_then(Json::u64))
                .max()
                .unwrap_or(0))
        };
        Ok(Baseline {
            prog: max_id("prog")?,
            map: max_id("map")?,
        })
    }
}

/// What of liberar is in the kernel right now. Only objects created since
/// `base` and not held solely by processes outside the job's hosts count;
/// the others are listed apart, in `foreign`.
#[derive(Debug, Default)]
struct KernelObjects {
    /// `erar_xdp` programs: id -> the ids of their maps.
    progs: BTreeMap<u64, Vec<u64>>,
    /// Maps with liberar's names: id -> name.
    maps: BTreeMap<u64, String>,
    /// Every map id that exists (to follow a program's maps by id).
    all_maps: BTreeMap<u64, String>,
    /// XDP programs attached to eth0 in the job's hosts: (host, prog id, name).
    host_xdp: Vec<(usize, u64, String)>,
    /// liberar-named objects older than the baseline or held only by
    /// processes outside the job's hosts (not counted), described.
    foreign: Vec<String>,
}

impl KernelObjects {
    /// While a job runs: `erar_xdp` is attached to eth0 of every one of the
    /// `HOSTS` hosts, and no other program is (asserted, with `tail()`,
    /// the job's output, in the message); returns the maps those programs
    /// hold: the job's.
    fn job_maps(&self, tail: impl Fn() -> String) -> BTreeSet<u64> {
        let attached: BTreeSet<usize> = self
            .host_xdp
            .iter()
            .filter(|(_, _, n)| n == PROG_NAME)
            .map(|(h, ..)| *h)
            .collect();
        let ids: BTreeSet<u64> = self.host_xdp.iter().map(|(_, id, _)| *id).collect();
        assert!(
            attached.len() == HOSTS && ids.iter().all(|id| self.progs.contains_key(id)),
            "while the job runs, erar_xdp should be attached to eth0 of all {HOSTS} hosts: {}\n{}",
            self.describe(),
            tail()
        );
        ids.iter()
            .flat_map(|id| self.progs[id].iter().copied())
            .collect()
    }

    fn read(base: Baseline) -> Result<KernelObjects> {
        let mut k = KernelObjects::default();
        let holders = Holders::read();
        let host_ns: BTreeSet<u64> = (0..HOSTS)
            .filter_map(|h| netns_inode(&format!("/run/netns/{}", testbed::host_ns(h))))
            .collect();
        let who = |pids: Option<&BTreeSet<i32>>| {
            pids.into_iter()
                .flatten()
                .map(|&p| describe_pid(p))
                .collect::<Vec<_>>()
                .join(", ")
        };
        // Why an object with liberar's name is not the job's (None: it is).
        let not_the_jobs = |what: &str, id: u64, before: u64, pids: Option<&BTreeSet<i32>>| {
            if id <= before {
                Some(format!("{what} (existed before the job)"))
            } else if foreign(pids, &host_ns) {
                Some(format!("{what} held by {}", who(pids)))
            } else {
                None
            }
        };
        for p in run_json("bpftool", &["-j", "prog", "show"])?.items() {
            if p.get("name").and_then(Json::str) == Some(PROG_NAME) {
                let id = p.get("id").and_then(Json::u64).unwrap_or(0);
                let maps = p
                    .get("map_ids")
                    .map(|m| m.items().iter().filter_map(Json::u64).collect())
                    .unwrap_or_default();
                let what = format!("prog {id} {PROG_NAME}");
                match not_the_jobs(&what, id, base.prog, holders.progs.get(&id)) {
                    Some(why) => k.foreign.push(why),
                    None => {
                        k.progs.insert(id, maps);
                    }
                }
            }
        }
        for m in run_json("bpftool", &["-j", "map", "show"])?.items() {
            let id = m.get("id").and_then(Json::u64).unwrap_or(0);
            let name = m.get("name").and_then(Json::str).unwrap_or("").to_owned();
            if MAP_NAMES.contains(&name.as_str()) {
                let what = format!("map {id} {name}");
                match not_the_jobs(&what, id, base.map, holders.maps.get(&id)) {
                    Some(why) => k.foreign.push(why),
                    None => {
                        k.maps.insert(id, name.clone());
                    }
                }
            }
            k.all_maps.insert(id, name);
        }
        for h in 0..HOSTS {
            let ns = testbed::host_ns(h);
            let links = run_json(
                "ip",
                &["-n", &ns, "-j", "-d", "link", "show", "dev", "eth0"],
            )?;
            for l in links.items() {
                if let Some(x) = l.get("xdp") {
                    let prog = x.get("prog");
                    let id = prog.and_then(|p| p.get("id")).and_then(Json::u64);
                    let name = prog
                        .and_then(|p| p.get("name"))
                        .and_then(Json::str)
                        .unwrap_or("?");
                    k.host_xdp.push((h, id.unwrap_or(0), name.to_owned()));
                }
            }
            // The text form too, in case the JSON form changes shape.
            let text = ip(&["-n", &ns, "-d", "link", "show", "dev", "eth0"])?;
            if text.contains("prog/xdp") && !k.host_xdp.iter().any(|(hh, ..)| *hh == h) {
                k.host_xdp
                    .push((h, 0, "(seen in `ip -d link show`)".into()));
            }
        }
        Ok(k)
    }

    fn is_clean(&self) -> bool {
        self.progs.is_empty() && self.maps.is_empty() && self.host_xdp.is_empty()
    }

    /// Which of `ids` (maps) still exist.
    fn maps_alive(&self, ids: &BTreeSet<u64>) -> Vec<String> {
        ids.iter()
            .filter_map(|id| self.all_maps.get(id).map(|n| format!("map {id} {n}")))
            .collect()
    }

    fn describe(&self) -> String {
        let mut v = Vec::new();
        for (id, maps) in &self.progs {
            v.push(format!("prog {id} {PROG_NAME} (maps {maps:?})"));
        }
        for (id, name) in &self.maps {
            v.push(format!("map {id} {name}"));
        }
        for (h, id, name) in &self.host_xdp {
            v.push(format!(
                "XDP prog {id} {name} on eth0 of {}",
                testbed::host_ns(*h)
            ));
        }
        let mut out = if v.is_empty() {
            "nothing".into()
        } else {
            v.join("; ")
        };
        if !self.foreign.is_empty() {
            out.push_str(&format!(
                " (not counted, held by processes outside the job's hosts: {})",
                self.foreign.join("; ")
            ));
        }
        out
    }
}

/// Waits (up to 5 s: the kernel frees maps and programs asynchronously)
/// until no liberar object created since `base` is left and no XDP program
/// is on a host's eth0; Err lists what is. `job_maps`: every map id the
/// job's programs used (those must be gone too, whatever their name).
fn wait_kernel_clean(base: Baseline, job_maps: &BTreeSet<u64>, note: bool) -> Result<Duration> {
    let t0 = Instant::now();
    loop {
        let k = KernelObjects::read(base)?;
        let alive = k.maps_alive(job_maps);
        if k.is_clean() && alive.is_empty() {
            if note && !k.foreign.is_empty() {
                eprintln!(
                    "  note: other liberar objects on this machine, not the job's (not \
                     counted): {}",
                    k.foreign.join("; ")
                );
            }
            return Ok(t0.elapsed());
        }
        if t0.elapsed() > Duration::from_secs(5) {
            bail!(
                "liberar's kernel objects are still there {:.1}s later: {}; maps of the job's \
                 programs still alive: {alive:?}",
                t0.elapsed().as_secs_f64(),
                k.describe()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Before a test: no XDP program on the hosts' eth0 (the hosts are free);
/// returns the id baseline for the checks after the job.
fn kernel_baseline() -> Baseline {
    let base = Baseline::now().unwrap_or_else(|e| panic!("{e:#}"));
    if let Err(e) = wait_kernel_clean(base, &BTreeSet::new(), false) {
        panic!("before the test: {e:#}");
    }
    base
}

// ------------------------------------------------------------ checks

fn no_failures(job: &Job) -> Result<()> {
    let bad: Vec<String> = job
        .lines()
        .iter()
        .map(|l| l.text.trim())
        .filter(|t| t.starts_with("FAIL") || t.starts_with("ERROR fault_loop"))
        .map(str::to_owned)
        .collect();
    ensure!(
        bad.is_empty(),
        "job {} reported failures:\n{}\n{}",
        job.name,
        bad.join("\n"),
        job.tail(60)
    );
    Ok(())
}

/// The job exited 0 and printed PASS, every rank completed all `iters`
/// iterations (each checked by the program against its reference), one
/// stats line per rank.
fn check_passed(job: &Job, iters: usize) -> Result<Vec<StatsLine>> {
    check_passed_ranks(job, iters, HOSTS)
}

/// [`check_passed`] for a job of `ranks` ranks.
fn check_passed_ranks(job: &Job, iters: usize, ranks: usize) -> Result<Vec<StatsLine>> {
    let (status, _) = job
        .exited
        .ok_or_else(|| anyhow!("job {} still running", job.name))?;
    no_failures(job)?;
    ensure!(
        status.success(),
        "job {} exited with {status}\n{}",
        job.name,
        job.tail(60)
    );
    ensure!(
        job.lines()
            .iter()
            .any(|l| l.text.trim() == "PASS fault_loop"),
        "job {} did not print PASS fault_loop\n{}",
        job.name,
        job.tail(60)
    );
    let its = job.iterations();
    for r in 0..ranks {
        let done: BTreeSet<usize> = its.iter().filter(|i| i.0 == r).map(|i| i.1).collect();
        ensure!(
            done.len() == iters && done.iter().all(|&k| k < iters),
            "job {}: rank {r} reported {} of {iters} iterations ok\n{}",
            job.name,
            done.len(),
            job.tail(60)
        );
    }
    let stats = job.stats();
    rust_tests::check_stats_per_rank(&stats, ranks)
        .map_err(|e| anyhow!("job {}: {e:#}\n{}", job.name, job.tail(60)))?;
    Ok(stats)
}

fn counters_summary(stats: &[StatsLine]) -> String {
    stats
        .iter()
        .map(|s| {
            format!(
                "rank {}: allreduce fast={} pmpi={} bcast fast={} pmpi={} fast_bytes={} \
                 fallback_bytes={} recovery_rounds={} resend_chunks={} reasons={:?}",
                s.rank,
                s.get("allreduce.fast"),
                s.get("allreduce.pmpi"),
                s.get("bcast.fast"),
                s.get("bcast.pmpi"),
                s.get("allreduce.fast_bytes") + s.get("bcast.fast_bytes"),
                s.get("fallback_bytes"),
                s.get("recovery_rounds"),
                s.get("resend_chunks"),
                s.reasons
            )
        })
        .collect::<Vec<_>>()
        .join("\n    ")
}

/// Every rank ran its large calls on the fast path (not merely handed all
/// the bytes back to MPI).
fn accelerated(stats: &[StatsLine]) -> bool {
    stats.len() == HOSTS
        && stats.iter().all(|s| {
            s.get("allreduce.fast") > 0
                && s.get("fallback_bytes")
                    < s.get("allreduce.fast_bytes") + s.get("bcast.fast_bytes")
        })
}

/// The slowest iteration: (rank, iteration, ms).
fn slowest(job: &Job) -> Option<(usize, usize, f64)> {
    job.iterations()
        .into_iter()
        .map(|(r, k, ms, _)| (r, k, ms))
        .max_by(|a, b| a.2.total_cmp(&b.2))
}

/// Waits for the first `iter 3 ok` (the loop runs, the ring is set up).
fn wait_mid_loop(job: &mut Job) -> Instant {
    job.wait_line(Duration::from_secs(90), |t| t.starts_with("iter 3 ok"))
        .unwrap_or_else(|e| panic!("{e:#}"))
}

// ------------------------------------------------------------ tests

/// kill -9 of the rank in host 2 mid-loop: the job ends within 15 s, no
/// process of it remains in any host namespace, and no liberar kernel
/// object remains.
#[test]
fn kill9_one_rank_ends_the_job_and_frees_the_datapath() {
    let _tb = testbed();
    let base = kernel_baseline();
    let victim = 2;
    let mut job = Job::start(
        "kill9",
        &spec(&["--iters", "100000", "--bcast", "--errors-return"], &[]),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    wait_mid_loop(&mut job);

    // While it runs: the detector sees the job's datapath on every host.
    let during = KernelObjects::read(base).unwrap_or_else(|e| panic!("{e:#}"));
    let job_maps = during.job_maps(|| job.tail(40));
    for name in MAP_NAMES {
        assert!(
            during.maps.values().filter(|n| *n == name).count() >= HOSTS,
            "while the job runs, {HOSTS} maps named {name} should exist: {}",
            during.describe()
        );
    }

    let pids = host_pids(victim);
    assert!(
        !pids.is_empty(),
        "no process in {} while the job runs",
        testbed::host_ns(victim)
    );
    let described: Vec<String> = pids.iter().map(|&p| describe_pid(p)).collect();
    let killed_at = Instant::now();
    for &p in &pids {
        // SAFETY: kill(2) of the rank's pid in its host namespace.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    eprintln!(
        "  killed {} with SIGKILL: {described:?}",
        testbed::host_ns(victim)
    );

    // The whole job ends: the launcher exits and the namespaces empty.
    let (exit_report, emptied) = job_ends_after_kill(
        &mut job,
        killed_at,
        &format!("the rank in {}", testbed::host_ns(victim)),
    );
    job.join_readers();
    let emptied = (emptied - killed_at).as_secs_f64();

    let freed = wait_kernel_clean(base, &job_maps, true)
        .unwrap_or_else(|e| panic!("after the kill: {e:#}"));
    // The test bed's own switch is still on the bridge ports.
    let st = testbed::status().unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        st.is_healthy(),
        "the test bed is not healthy after the test:\n{st}"
    );

    let errors: Vec<String> = job
        .lines()
        .iter()
        .map(|l| l.text.trim().to_owned())
        .filter(|t| t.starts_with("ERROR fault_loop"))
        .collect();
    let last_iter = job.iterations().iter().map(|i| i.1).max();
    eprintln!(
        "  kill -9 result: {exit_report}; host namespaces empty after {emptied:.2}s; kernel \
         objects gone {:.2}s after that; last iteration completed: {last_iter:?}; surviving \
         ranks' MPI errors (MPI_ERRORS_RETURN): {errors:?}",
        freed.as_secs_f64()
    );
    let mpirun_says: Vec<String> = job
        .lines()
        .iter()
        .filter(|l| l.stderr && !l.text.trim().is_empty() && !l.text.starts_with("ERROR"))
        .map(|l| l.text.clone())
        .take(12)
        .collect();
    eprintln!(
        "  launcher/rank stderr:\n    {}",
        mpirun_says.join("\n    ")
    );
}

/// After `kill -9` of `what` at `killed_at`: the launcher exits and the host
/// namespaces empty within [`KILL_BOUND`] (else the job is killed and the
/// test fails). Returns how the launcher ended and when the namespaces were
/// empty.
fn job_ends_after_kill(job: &mut Job, killed_at: Instant, what: &str) -> (String, Instant) {
    let deadline = killed_at + KILL_BOUND;
    let exit = job.wait_exit(deadline);
    while Instant::now() < deadline && !processes_in_hosts().is_empty() {
        std::thread::sleep(Duration::from_millis(20));
    }
    let emptied = Instant::now();
    let left = processes_in_hosts();
    let exit_report = match exit {
        Some((st, at)) => format!(
            "launcher exited ({st}) {:.2}s after the kill",
            (at - killed_at).as_secs_f64()
        ),
        None => format!("launcher still running {KILL_BOUND:?} after the kill"),
    };
    if exit.is_none() || !left.is_empty() {
        let tail = job.tail(40);
        job.kill();
        panic!(
            "after kill -9 of {what}: {exit_report}; processes left in the host namespaces: \
             {left:?}\n{tail}"
        );
    }
    (exit_report, emptied)
}

// ------------------------------------------------------------ several ranks per host

/// Ranks per host of the node-path fault tests.
const RANKS_PER_HOST: usize = 2;

/// The `liberar.*` entries of /dev/shm (the node path's POSIX shared
/// memory: `liberar.<uid>.<pid of local rank 0>.<nonce>[.d<gen>]`).
fn shm_entries() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .filter(|n| n.starts_with("liberar."))
                .collect()
        })
        .unwrap_or_default()
}

/// The job's ranks: world rank -> (host, pid), from the environment of the
/// processes in the host namespaces (`OMPI_COMM_WORLD_RANK`).
fn rank_pids() -> BTreeMap<usize, (usize, i32)> {
    let mut m = BTreeMap::new();
    for h in 0..HOSTS {
        for pid in host_pids(h) {
            let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else {
                continue;
            };
            let rank = env
                .split(|&b| b == 0)
                .filter_map(|kv| std::str::from_utf8(kv).ok())
                .find_map(|kv| kv.strip_prefix("OMPI_COMM_WORLD_RANK="))
                .and_then(|v| v.parse().ok());
            if let Some(r) = rank {
                m.insert(r, (h, pid));
            }
        }
    }
    m
}

/// The node path's shared memory a process has mapped: the names (without
/// `/dev/shm/`) of its `liberar.*` mappings (unlinked: `(deleted)`).
fn shm_mapped(pid: i32) -> BTreeSet<String> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once("/dev/shm/").map(|(_, n)| n))
        .filter(|n| n.starts_with("liberar."))
        .map(|n| n.trim_end_matches(" (deleted)").trim().to_owned())
        .collect()
}

/// kill -9 of local rank `victim_local` of host 2 while 2 ranks per host run
/// `fault_loop` (int32 SUM and broadcasts of 4 MiB on the node path, the
/// float SUM on MPI) with `env`; `leads`: whether the victim leads a slice.
fn kill9_node_path(name: &str, victim_local: usize, leads: bool, env: &[(&str, &str)]) {
    let _tb = testbed();
    let base = kernel_baseline();
    let shm_before = shm_entries();
    let ranks = HOSTS * RANKS_PER_HOST;
    let mut job = Job::start(
        name,
        &spec(&["--iters", "100000", "--bcast", "--errors-return"], env)
            .ranks_per_host(vec![RANKS_PER_HOST; HOSTS]),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    wait_mid_loop(&mut job);

    // While it runs: the datapath on every host, every rank with the node
    // path's shared memory mapped, and no name of it left in /dev/shm.
    let during = KernelObjects::read(base).unwrap_or_else(|e| panic!("{e:#}"));
    let job_maps = during.job_maps(|| job.tail(40));
    let pids = rank_pids();
    assert_eq!(
        pids.len(),
        ranks,
        "expected {ranks} ranks in the host namespaces: {pids:?}\n{}",
        job.tail(40)
    );
    let mut job_shm = BTreeSet::new();
    for (r, (h, pid)) in &pids {
        assert_eq!(*h, r / RANKS_PER_HOST, "rank {r} runs in host {h}");
        let mapped = shm_mapped(*pid);
        assert!(
            !mapped.is_empty(),
            "rank {r} (pid {pid}) has no /dev/shm/liberar.* mapped: not on the node path?\n{}",
            job.tail(40)
        );
        job_shm.extend(mapped);
    }
    let named_during: Vec<String> = shm_entries().difference(&shm_before).cloned().collect();
    assert!(
        named_during.is_empty(),
        "the node path's shared memory should be unlinked once mapped, yet /dev/shm has \
         {named_during:?} while the job runs"
    );
    let victim_rank = 2 * RANKS_PER_HOST + victim_local;
    let (vhost, victim) = pids[&victim_rank];
    let holders = Holders::read();
    let holds_bpf = holders
        .progs
        .values()
        .chain(holders.maps.values())
        .any(|p| p.contains(&victim));
    assert_eq!(
        holds_bpf,
        leads,
        "rank {victim_rank} (local rank {victim_local}) should {}hold the datapath's BPF objects \
         (lead {} slice)",
        if leads { "" } else { "not " },
        if leads { "a" } else { "no" }
    );

    let described = describe_pid(victim);
    let killed_at = Instant::now();
    // SAFETY: kill(2) of one rank's pid in its host namespace.
    unsafe { libc::kill(victim, libc::SIGKILL) };
    eprintln!(
        "  killed rank {victim_rank} (local rank {victim_local} of {}, {}) with SIGKILL: \
         {described}",
        testbed::host_ns(vhost),
        if leads {
            "a slice leader"
        } else {
            "leads no slice"
        },
    );

    let (exit_report, _) = job_ends_after_kill(&mut job, killed_at, &format!("rank {victim_rank}"));
    let ended = killed_at.elapsed();
    job.join_readers();

    let freed = wait_kernel_clean(base, &job_maps, true)
        .unwrap_or_else(|e| panic!("after the kill: {e:#}"));
    let shm_left: Vec<String> = shm_entries()
        .into_iter()
        .filter(|n| !shm_before.contains(n) || job_shm.contains(n))
        .collect();
    assert!(
        shm_left.is_empty(),
        "after kill -9 of rank {victim_rank}: /dev/shm still has {shm_left:?} (the job's shared \
         memory was {job_shm:?})"
    );
    let st = testbed::status().unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        st.is_healthy(),
        "the test bed is not healthy after the test:\n{st}"
    );
    let last_iter = job.iterations().iter().map(|i| i.1).max();
    eprintln!(
        "  kill -9 ({name}): {exit_report}; host namespaces empty {:.2}s after the kill; kernel \
         objects gone {:.2}s after that; /dev/shm: no liberar.* entry left (the job had \
         {job_shm:?} mapped); last iteration completed: {last_iter:?}",
        ended.as_secs_f64(),
        freed.as_secs_f64()
    );
}

/// 2 ranks per host, one slice (`ERAR_NODE_SLICES=1`): kill -9 of local
/// rank 1 of host 2, which leads no slice.
#[test]
fn kill9_non_leader_with_two_ranks_per_host() {
    kill9_node_path("kill9-non-leader", 1, false, &[("ERAR_NODE_SLICES", "1")]);
}

/// 2 ranks per host, two slices (the default): kill -9 of local rank 0 of
/// host 2, which leads slice 0 and made the host's shared memory.
#[test]
fn kill9_slice_leader_with_two_ranks_per_host() {
    kill9_node_path("kill9-leader", 0, true, &[]);
}

/// Host 1's switch port down for 1.5 s mid-loop, then up: every rank
/// completes every call with right results; the counters say how.
#[test]
fn link_flap_completes_every_call_correctly() {
    let _tb = testbed();
    let base = kernel_baseline();
    let host = 1;
    let iters = 40;
    let mut job = Job::start(
        "flap",
        &spec(
            &["--iters", &iters.to_string(), "--bcast", "--errors-return"],
            &[],
        ),
    )
    .unwrap_or_else(|e| panic!("{e:#}"));
    wait_mid_loop(&mut job);

    let down = PortDown::new(host).unwrap_or_else(|e| panic!("{e:#}"));
    let down_at = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    drop(down);
    let up_at = Instant::now();
    eprintln!(
        "  {} was down for {:.2}s",
        testbed::port_ifname(host),
        (up_at - down_at).as_secs_f64()
    );

    let exit = job.wait_exit(job.started + JOB_LIMIT);
    if exit.is_none() {
        let tail = job.tail(60);
        job.kill();
        panic!("the job did not end within {JOB_LIMIT:?} of its start after the flap\n{tail}");
    }
    job.join_readers();
    let stats = check_passed(&job, iters).unwrap_or_else(|e| panic!("{e:#}"));

    // The flap really hit the loop: iterations before it, and the loop was
    // still running when the link came back.
    let its = job.iterations();
    let before = its.iter().filter(|i| i.3 < down_at).count();
    let after = its.iter().filter(|i| i.3 > up_at).count();
    assert!(
        before > 0 && after > 0,
        "the flap was not mid-loop: {before} iteration lines before it, {after} after\n{}",
        job.tail(40)
    );
    let (sr, sk, sms) = slowest(&job).unwrap();
    let end = exit.unwrap().1;
    let fallback: u64 = stats.iter().map(|s| s.get("fallback_bytes")).sum();
    let rounds: u64 = stats.iter().map(|s| s.get("recovery_rounds")).sum();
    let nacks: u64 = stats.iter().map(|s| s.get("nacks")).sum();
    eprintln!(
        "  link flap result: PASS, all {iters} iterations correct on every rank; job ended \
         {:.2}s after the link came back; slowest iteration: rank {sr} iter {sk} {sms:.0} ms; \
         {} (fallback_bytes total {fallback}, recovery_rounds total {rounds}, NACK bursts \
         total {nacks})\n    {}",
        (end - up_at).as_secs_f64(),
        match (fallback > 0, rounds + nacks > 0) {
            (true, true) => "recovery rounds ran, then MPI completed some calls",
            (true, false) => "MPI completed the stalled calls (fallback)",
            (false, true) => "the ring's loss recovery (NACKs, rounds) completed every call",
            (false, false) => "no call needed recovery or fallback",
        },
        counters_summary(&stats)
    );
    wait_kernel_clean(base, &BTreeSet::new(), true)
        .unwrap_or_else(|e| panic!("after the job: {e:#}"));
}

/// How long every rank may take to end after its host lost its link for
/// good (`ERAR_TEST_LINK_LOSS_SECS` overrides, to measure a hang).
fn link_loss_bound() -> Duration {
    std::env::var("ERAR_TEST_LINK_LOSS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_secs)
        .unwrap_or(LINK_LOSS_BOUND)
}

/// Host 1's switch port down for good once `trigger` is printed: every rank
/// must end (with an MPI error) within [`link_loss_bound`], nothing may be
/// left in the host namespaces or in the kernel.
fn link_down_for_good(name: &str, args: &[&str], trigger: &dyn Fn(&str) -> bool) {
    let _tb = testbed();
    let base = kernel_baseline();
    let host = 1;
    let bound = link_loss_bound();
    let mut all_args = vec!["--iters", "100000", "--bcast", "--errors-return"];
    all_args.extend_from_slice(args);
    let mut job = Job::start(name, &spec(&all_args, &[])).unwrap_or_else(|e| panic!("{e:#}"));
    job.wait_line(Duration::from_secs(90), trigger)
        .unwrap_or_else(|e| panic!("{e:#}"));

    let down = PortDown::new(host).unwrap_or_else(|e| panic!("{e:#}"));
    let down_at = Instant::now();
    let exit = job.wait_exit(down_at + bound);
    let mut emptied = None;
    if exit.is_some() {
        while down_at.elapsed() < bound {
            if processes_in_hosts().is_empty() {
                emptied = Some(Instant::now());
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let left = processes_in_hosts();
    let last_iter =
        job.iterations()
            .iter()
            .map(|i| (i.0, i.1))
            .fold(BTreeMap::new(), |mut m, (r, k)| {
                let e = m.entry(r).or_insert(k);
                *e = (*e).max(k);
                m
            });
    let tail = job.tail(40);
    // Bring the link back before anything else, then clean up.
    drop(down);
    job.kill();
    job.join_readers();
    let errors: Vec<String> = job
        .lines()
        .iter()
        .map(|l| l.text.trim().to_owned())
        .filter(|t| t.starts_with("ERROR fault_loop"))
        .collect();
    assert!(
        exit.is_some() && left.is_empty(),
        "{} down for good: {}; processes left: {left:?}; last iteration per rank: \
         {last_iter:?}; errors: {errors:?}\n{tail}",
        testbed::port_ifname(host),
        match exit {
            Some((st, at)) => format!(
                "launcher exited ({st}) {:.1}s after the link went down",
                (at - down_at).as_secs_f64()
            ),
            None => format!("the job was still running {bound:?} after the link went down"),
        }
    );
    eprintln!(
        "  link down for good ({name}): job ended {:.1}s after the link went down (namespaces \
         empty at {:.1}s); last iteration per rank: {last_iter:?}; errors: {errors:?}",
        (exit.unwrap().1 - down_at).as_secs_f64(),
        emptied
            .map(|t| (t - down_at).as_secs_f64())
            .unwrap_or(f64::NAN)
    );
    wait_kernel_clean(base, &BTreeSet::new(), true)
        .unwrap_or_else(|e| panic!("after the job: {e:#}"));
}

/// Host 1's switch port down for good mid-loop, at whatever moment the
/// first `iter 3 ok` line is seen: every rank must end within 30 s.
#[test]
fn link_down_for_good_ends_every_rank() {
    link_down_for_good("link-down", &[], &|t| t.starts_with("iter 3 ok"));
}

/// Host 1's switch port down for good while every rank is between calls
/// (rank 1 has just finished iteration 3 and sleeps 2 s before the next):
/// every rank must end within 30 s.
#[test]
fn link_down_for_good_between_calls_ends_every_rank() {
    link_down_for_good("link-down-between-calls", &["--pause-ms", "2000"], &|t| {
        t.starts_with("iter 3 ok rank=1 ")
    });
}

/// Runs two jobs with different inputs (seeds 11 and 22) on the same 4
/// hosts at the same time; both must pass (every result checked by the
/// program against its reference, every rank, every iteration) and give
/// different digests. Returns their stats lines, printed with a summary.
fn two_concurrent_jobs() -> (Vec<StatsLine>, Vec<StatsLine>) {
    let _tb = testbed();
    let base = kernel_baseline();
    let iters = 15;
    let it = iters.to_string();
    let spec_a = spec(&["--iters", &it, "--seed", "11", "--bcast"], &[]);
    let spec_b = spec(&["--iters", &it, "--seed", "22", "--bcast"], &[]);
    let mut jobs = Job::start_together(&[("A(seed 11)", &spec_a), ("B(seed 22)", &spec_b)])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut b = jobs.pop().unwrap();
    let mut a = jobs.pop().unwrap();
    let limit = Instant::now() + JOB_LIMIT;
    let (ea, eb) = (a.wait_exit(limit), b.wait_exit(limit));
    if ea.is_none() || eb.is_none() {
        let tails = format!("{}\n{}", a.tail(40), b.tail(40));
        a.kill();
        b.kill();
        panic!("the concurrent jobs did not both end within {JOB_LIMIT:?}\n{tails}");
    }
    a.join_readers();
    b.join_readers();
    let sa = check_passed(&a, iters).unwrap_or_else(|e| panic!("{e:#}"));
    let sb = check_passed(&b, iters).unwrap_or_else(|e| panic!("{e:#}"));
    let digest = |j: &Job| {
        j.lines()
            .iter()
            .find(|l| l.text.starts_with("DIGEST "))
            .map(|l| l.text.clone())
    };
    assert_ne!(
        digest(&a),
        digest(&b),
        "different seeds should give different results"
    );
    let partly = |s: &[StatsLine]| s.iter().filter(|l| l.get("allreduce.fast") > 0).count();
    eprintln!(
        "  concurrent jobs: A {:.1}s accelerated={} (fast on {} ranks), B {:.1}s \
         accelerated={} (fast on {} ranks)\n  A:\n    {}\n  B:\n    {}",
        (ea.unwrap().1 - a.started).as_secs_f64(),
        accelerated(&sa),
        partly(&sa),
        (eb.unwrap().1 - b.started).as_secs_f64(),
        accelerated(&sb),
        partly(&sb),
        counters_summary(&sa),
        counters_summary(&sb)
    );
    wait_kernel_clean(base, &BTreeSet::new(), true)
        .unwrap_or_else(|e| panic!("after the jobs: {e:#}"));
    (sa, sb)
}

/// Two concurrent jobs on the same hosts: both correct (whichever path
/// each one took); the counters say which ran on the fast path.
#[test]
fn two_concurrent_jobs_are_both_correct() {
    two_concurrent_jobs();
}

/// Two concurrent jobs on the same hosts, no agent: both on the fast path
/// (whichever attaches first on a host, the other shares its program).
#[test]
fn two_concurrent_jobs_are_both_accelerated() {
    let (sa, sb) = two_concurrent_jobs();
    assert!(
        accelerated(&sa) && accelerated(&sb),
        "not both concurrent jobs ran on the fast path:\n  A:\n    {}\n  B:\n    {}",
        counters_summary(&sa),
        counters_summary(&sb)
    );
}

/// A network that does not carry the datapath's frames, from the start: the
/// plain bridge, whose ports carry no XDP, so the frames the hosts' XDP
/// programs send are dropped at the switch (as a switch that filters them,
/// or whose MTU is smaller than the hosts', would). Every ring's setup
/// finds its probes unanswered, every rank declines, and MPI carries every
/// call: the job passes with every result right, no call on the fast path,
/// one line on stderr saying why, and, while the job still runs, nothing of
/// liberar left in the kernel (the declined rings let go of their XDP
/// programs, which on a veth would slow MPI's TCP). One rank per host (the
/// ring) and two (the node path's slice rings).
#[test]
fn a_network_that_drops_the_frames_leaves_every_call_to_mpi() {
    let _tb = testbed();
    let base = kernel_baseline();
    let _bridge = SwitchSet::new(testbed::SwitchKind::Bridge).unwrap_or_else(|e| panic!("{e:#}"));
    let iters = 12;
    for per_host in [1, 2] {
        let ranks = HOSTS * per_host;
        let name = format!("no-frames-{per_host}-per-host");
        let args = [
            "--iters",
            &iters.to_string(),
            "--bcast",
            "--errors-return",
            "--pause-ms",
            "300",
        ];
        let mut job = Job::start(
            &name,
            &spec(&args, &[]).ranks_per_host(vec![per_host; HOSTS]),
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
        wait_mid_loop(&mut job);
        let during = KernelObjects::read(base).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(
            during.is_clean(),
            "{name}: liberar's kernel objects remain after the rings declined: {}\n{}",
            during.describe(),
            job.tail(40)
        );
        if job.wait_exit(job.started + JOB_LIMIT).is_none() {
            let tail = job.tail(60);
            job.kill();
            panic!("{name}: the job did not end within {JOB_LIMIT:?}\n{tail}");
        }
        job.join_readers();
        let stats = check_passed_ranks(&job, iters, ranks).unwrap_or_else(|e| panic!("{e:#}"));
        for st in &stats {
            assert!(
                st.get("allreduce.fast") + st.get("bcast.fast") == 0
                    && st.get("allreduce.pmpi") >= iters as u64,
                "{name}: rank {} should have left every call to MPI:\n    {}",
                st.rank,
                counters_summary(&stats)
            );
        }
        assert!(
            job.lines()
                .iter()
                .any(|l| l.text.contains("did not answer the ring's probes")),
            "{name}: no rank said why its calls went to MPI\n{}",
            job.tail(40)
        );
        eprintln!(
            "  {name}: PASS, {iters} iterations right on all {ranks} ranks, all on MPI\n    {}",
            counters_summary(&stats)
        );
    }
}
