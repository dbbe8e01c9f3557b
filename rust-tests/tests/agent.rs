//! The privileged node agent (issue #4, "Privilege"): `erarctl agent start`
//! attaches each host's datapath once and pins it for a group; jobs of
//! users in that group use it without any privilege, a user outside the
//! group gets one warning line per process and a clean MPI fallback, and
//! after the jobs only the agents' objects remain in the kernel — none
//! once the agents are stopped. And a member's process reaches no job's
//! slot state but through a lease of a slot whose lock it holds, which
//! comes as fresh maps (`isolation`).
//!
//! `erarctl doctor` reports the same verdicts, with what to do: a member
//! passes, a user outside the group is told which group to join, and with
//! the agents stopped the advice is to start one.
//!
//! The test bed stays root's: the launcher runs as root and every rank
//! drops to the test user right after entering its host
//! (`LaunchSpec::user`, `erarctl run --user`).

use anyhow::{bail, ensure, Context, Result};
use erarctl::testbed::{self, LaunchSpec};
use liberar::datapath::agent::{self, AgentInfo, AgentPaths};
use liberar::datapath::kernel::slot::SlotMaps;
use rust_tests::{
    check_stats_per_rank, ctests, end_grace, job_timeout, repo_root, run_job, shim_path, testbed,
    JobResult, Mpi,
};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const GROUP: &str = "liberar-test";
const USER_IN: &str = "erar-agent-in";
const USER_OUT: &str = "erar-agent-out";
const HOSTS: usize = 4;

fn erarctl() -> PathBuf {
    let p = repo_root().join("build").join("erarctl");
    assert!(
        p.is_file(),
        "{} is missing: run `scripts/build` first",
        p.display()
    );
    p
}

fn run(cmd: &mut Command) -> Result<Output> {
    let what = format!("{cmd:?}");
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    ensure!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out)
}

fn agent_paths(host: usize) -> AgentPaths {
    AgentPaths::for_netns(Some(&testbed::host_ns(host)), testbed::HOST_IFNAME)
        .expect("test-bed agent paths")
}

/// Users, group and agents of this test; removed on drop, also when the
/// test fails half-way.
struct Fixture;

impl Fixture {
    fn new() -> Result<Fixture> {
        let f = Fixture;
        f.remove(); // leftovers of a killed run
        run(Command::new("groupadd").arg(GROUP))?;
        run(Command::new("useradd").args([
            "-M",
            "-N",
            "-g",
            "nogroup",
            "-G",
            GROUP,
            "-s",
            "/usr/sbin/nologin",
            USER_IN,
        ]))?;
        run(Command::new("useradd").args([
            "-M",
            "-N",
            "-g",
            "nogroup",
            "-s",
            "/usr/sbin/nologin",
            USER_OUT,
        ]))?;
        Ok(f)
    }

    fn stop_agents(&self) {
        for h in 0..HOSTS {
            let _ = Command::new(erarctl())
                .args(["agent", "stop", "--iface", testbed::HOST_IFNAME, "--netns"])
                .arg(testbed::host_ns(h))
                .output();
        }
    }

    fn remove(&self) {
        self.stop_agents();
        for u in [USER_IN, USER_OUT] {
            let _ = Command::new("userdel").arg("-f").arg(u).output();
        }
        let _ = Command::new("groupdel").arg(GROUP).output();
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Ids of every loaded BPF program named erar_xdp.
fn erar_progs() -> Result<BTreeSet<u32>> {
    let out = run(Command::new("bpftool").args(["prog", "show"]))?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(" name erar_xdp "))
        .filter_map(|l| l.split(':').next()?.trim().parse().ok())
        .collect())
}

/// The XDP program attached to host h's eth0 (0: none).
fn attached(host: usize) -> Result<u32> {
    let out = run(Command::new("ip").args([
        "-n",
        &testbed::host_ns(host),
        "link",
        "show",
        testbed::HOST_IFNAME,
    ]))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    Ok(text
        .split("prog/xdp id ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|id| id.parse().ok())
        .unwrap_or(0))
}

fn job(user: &str, env: &[(&str, &str)]) -> Result<JobResult> {
    ctests(Mpi::Openmpi); // builds c-tests/bin/openmpi
    let prog = repo_root()
        .join("c-tests/bin/openmpi/allreduce_big")
        .into_os_string();
    let mut spec = LaunchSpec::new(Mpi::Openmpi, HOSTS, vec![prog, "--quick".into()])
        .env("ERAR_STATS", "1")
        .env("ERAR_SELECT", "threshold")
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace())
        .preload(shim_path(Mpi::Openmpi))
        .user(user);
    for (k, v) in env {
        spec = spec.env(*k, *v);
    }
    let r = run_job(&spec)?;
    ensure!(
        r.output.status.success() && r.passes().iter().any(|p| p == "PASS allreduce_big"),
        "the job as {user} failed\n{}",
        r.tail()
    );
    ensure!(
        r.digests().len() == 1,
        "no single DIGEST line\n{}",
        r.tail()
    );
    check_stats_per_rank(&r.stats(), HOSTS).with_context(|| r.tail())?;
    Ok(r)
}

fn warnings(r: &JobResult) -> Vec<String> {
    r.stderr
        .lines()
        .chain(r.stdout.lines())
        .filter(|l| l.contains("liberar: no datapath on"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn unprivileged_jobs_use_the_agent_or_fall_back_cleanly() {
    let _tb = testbed();
    if let Err(e) = scenario() {
        panic!("{e:#}");
    }
}

/// "No job can read or change another job's data in kernel memory": what
/// a group member's process reaches on host 0, checked by `agent_probe`
/// running as that member. The test itself plays the other job: it holds
/// slot 0 (its lock), and it used slot 3 before (wrote a pattern into the
/// leased buffer, then gave the slot back).
fn isolation() -> Result<()> {
    let paths = agent_paths(0);
    {
        let _lock = agent::try_lock_slot(&paths, 3)?.context("slot 3 of host 0 is locked")?;
        let (_lease, fds) = agent::lease::request(&paths, 3).context("root's lease of slot 3")?;
        let info = AgentInfo::read(&paths)?;
        let maps = SlotMaps::map(fds, info.chunk_bytes, info.chunks_per_slot)
            .context("mapping root's lease of slot 3")?;
        let len = info.chunk_bytes as usize * info.chunks_per_slot as usize;
        // SAFETY: the slot buffer mapping holds len bytes; the slot is not
        // armed, so nothing else writes it.
        unsafe { std::ptr::write_bytes(maps.buf(), 0xab, len) };
    }
    let _held = agent::try_lock_slot(&paths, 0)?.context("slot 0 of host 0 is locked")?;
    let out = run(Command::new("ip")
        .args(["netns", "exec", &testbed::host_ns(0)])
        .args(["runuser", "-u", USER_IN, "--"])
        .arg(env!("CARGO_BIN_EXE_agent_probe"))
        .args([testbed::HOST_IFNAME, "0", "3"]))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "  a member's process on host 0:\n    {}",
        text.trim().replace('\n', "\n    ")
    );
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .map(|l| l[prefix.len()..].trim().to_owned())
            .unwrap_or_default()
    };
    // The program (to inject) and the read-only pins: usable. Every slot's
    // state and the link: root's.
    for (pin, rw, ro) in [
        (agent::PIN_PROG, "ok", "ok"),
        (agent::PIN_STATS, "denied", "ok"),
        (agent::PIN_RODATA, "denied", "ok"),
        (agent::PIN_LINK, "denied", "denied"),
        ("slot_bufs", "denied", "denied"),
        ("slot_ctls", "denied", "denied"),
        ("chunk_states", "denied", "denied"),
        ("resends", "denied", "denied"),
        ("slot_events", "denied", "denied"),
    ] {
        ensure!(
            line(&format!("pin {pin} rw")) == rw && line(&format!("pin {pin} ro")) == ro,
            "pin {pin}: want rw {rw} / ro {ro}, the member got rw {:?} / ro {:?}",
            line(&format!("pin {pin} rw")),
            line(&format!("pin {pin} ro"))
        );
    }
    let unlocked = line("lease-unlocked 0");
    ensure!(
        unlocked.starts_with("refused") && unlocked.contains("does not hold slot 0's lock"),
        "a lease of slot 0, which another process holds, must be refused: {unlocked:?}"
    );
    let locked = line("lease-locked 3");
    ensure!(
        locked == "ok zero=true",
        "a lease of free slot 3 must give fresh, zeroed maps (the previous user wrote 0xab): \
         {locked:?}"
    );
    Ok(())
}

fn scenario() -> Result<()> {
    let fixture = Fixture::new()?;
    let before = erar_progs()?;

    // One agent per host: host 0 with --netns (it mounts the bpffs under
    // /run if needed), the others the way the README shows for a named
    // namespace, `ip netns exec`, which works once that bpffs exists.
    for h in 0..HOSTS {
        let ns = testbed::host_ns(h);
        let mut cmd = if h == 0 {
            let mut c = Command::new(erarctl());
            c.args(["agent", "start", "--netns", &ns]);
            c
        } else {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &ns])
                .arg(erarctl())
                .args(["agent", "start"]);
            c
        };
        let out = run(cmd.args(["--iface", testbed::HOST_IFNAME, "--group", GROUP]))?;
        eprintln!("  {}", String::from_utf8_lossy(&out.stdout).trim());
    }
    // Idempotent: a second start changes nothing.
    let again = run(Command::new(erarctl()).args([
        "agent",
        "start",
        "--netns",
        &testbed::host_ns(0),
        "--iface",
        testbed::HOST_IFNAME,
        "--group",
        GROUP,
    ]))?;
    ensure!(
        String::from_utf8_lossy(&again.stdout).contains("already running"),
        "a second `agent start` did not say `already running`: {}",
        String::from_utf8_lossy(&again.stdout)
    );
    let mut agent_progs = BTreeSet::new();
    for h in 0..HOSTS {
        let info = AgentInfo::read(&agent_paths(h)).context("reading agent.info")?;
        ensure!(
            attached(h)? == info.prog_id,
            "host {h}: the agent's erar_xdp (id {}) is not what runs on eth0 (id {})",
            info.prog_id,
            attached(h)?
        );
        agent_progs.insert(info.prog_id);
    }
    let status = run(Command::new(erarctl()).args(["agent", "status"]))?;
    eprintln!("{}", String::from_utf8_lossy(&status.stdout));

    // In the group: accelerated. The test holds slot 0's lock on host 0
    // (as another process on that host would), so the ring must agree on
    // slot 1: proves that jobs see each other's slots through the locks.
    let held =
        agent::try_lock_slot(&agent_paths(0), 0)?.context("slot 0 of host 0 is already locked")?;
    let inside = job(USER_IN, &[("ERAR_LOG", "liberar=debug")])?;
    drop(held);
    for s in inside.stats() {
        ensure!(
            s.get("allreduce.fast") > 0 && s.get("fallback_bytes") < s.get("allreduce.fast_bytes"),
            "a member of {GROUP}: rank {} did not run on the agent's datapath: {}\n{}",
            s.rank,
            s.raw,
            inside.tail()
        );
    }
    ensure!(
        warnings(&inside).is_empty(),
        "warnings in the group member's job: {:?}",
        warnings(&inside)
    );
    let agent_lines = inside
        .stderr
        .lines()
        .filter(|l| l.contains("using the agent's datapath"))
        .count();
    ensure!(
        agent_lines == HOSTS,
        "{agent_lines} ranks said they use the agent's datapath, want {HOSTS}\n{}",
        inside.tail()
    );
    let slots: Vec<&str> = inside
        .stderr
        .lines()
        .filter(|l| l.contains("ready on slots"))
        .collect();
    // "ready on slots [a, b]," -> (a, b)
    let pair = |l: &str| -> Option<(u32, u32)> {
        let list = l.split("ready on slots [").nth(1)?.split(']').next()?;
        let (a, b) = list.split_once(", ")?;
        Some((a.parse().ok()?, b.parse().ok()?))
    };
    let pairs: BTreeSet<Option<(u32, u32)>> = slots.iter().map(|l| pair(l)).collect();
    ensure!(
        slots.len() == HOSTS
            && pairs.len() == 1
            && pairs
                .iter()
                .all(|p| matches!(p, Some((a, b)) if a != b && *a != 0 && *b != 0)),
        "with slot 0 of host 0 locked the ring must take the same two other slots on every \
         host: {slots:?}"
    );

    // Outside the group: one line per process, MPI does everything.
    let outside = job(USER_OUT, &[])?;
    let warned = warnings(&outside);
    ensure!(
        warned.len() == HOSTS
            && warned.iter().all(|w| {
                w.contains(&format!("not in group {GROUP} of the liberar agent"))
                    && w.contains("not privileged")
                    && w.ends_with("MPI_Allreduce/MPI_Bcast use MPI")
            }),
        "want one warning per rank (not in group {GROUP}, not privileged), got {warned:#?}\n{}",
        outside.tail()
    );
    ensure!(
        !outside.stderr.contains("libbpf:"),
        "the fallback printed more than its one line:\n{}",
        outside.tail()
    );
    for s in outside.stats() {
        ensure!(
            s.get("allreduce.fast") == 0 && s.get("allreduce.pmpi") > 0,
            "outside the group rank {} used the fast path: {}",
            s.rank,
            s.raw
        );
    }
    ensure!(
        inside.digests() == outside.digests(),
        "results differ: in the group {:?}, outside {:?}",
        inside.digests(),
        outside.digests()
    );
    eprintln!(
        "  in {GROUP}: {} | outside: {}\n  warning: {}",
        inside.stats()[0].raw,
        outside.stats()[0].raw,
        warned[0]
    );

    isolation()?;

    // `erarctl doctor` on host 0 says what a job of each user gets.
    let (ok, text) = doctor(USER_IN)?;
    ensure!(
        ok && text.contains("access: ") && text.contains("use the agent's datapath"),
        "doctor as a member of {GROUP} with the agents running did not pass:\n{text}"
    );
    let (ok, text) = doctor(USER_OUT)?;
    ensure!(
        !ok && text.contains(&format!("FAIL  access: {USER_OUT} is not in group {GROUP}"))
            && text.contains(&format!("usermod -aG {GROUP} {USER_OUT}")),
        "doctor outside {GROUP} did not fail with the group advice:\n{text}"
    );

    // After the jobs: only the agents' objects; every slot free again.
    let now = erar_progs()?;
    let extra: Vec<u32> = now
        .difference(&before)
        .filter(|id| !agent_progs.contains(id))
        .copied()
        .collect();
    ensure!(
        extra.is_empty(),
        "erar_xdp programs left by the jobs: {extra:?}"
    );
    for h in 0..HOSTS {
        let st = agent::status(&agent_paths(h));
        ensure!(
            st.healthy(),
            "host {h}'s agent is not healthy:\n{}",
            st.render()
        );
        ensure!(
            st.slots.iter().all(Vec::is_empty),
            "slot locks still held after the jobs:\n{}",
            st.render()
        );
    }

    // Stopped: nothing of the agents is left.
    fixture.stop_agents();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<u32> = erar_progs()?.intersection(&agent_progs).copied().collect();
        let still: Vec<usize> = (0..HOSTS)
            .filter(|&h| attached(h).unwrap_or(1) != 0)
            .collect();
        if left.is_empty() && still.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            bail!(
                "after `agent stop`: programs {left:?} still loaded, XDP still on hosts {still:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    for h in 0..HOSTS {
        let p = agent_paths(h);
        ensure!(
            !p.pin_dir.exists() && !p.run_dir.exists(),
            "{} or {} still exists after `agent stop`",
            p.pin_dir.display(),
            p.run_dir.display()
        );
    }
    let (ok, text) = doctor(USER_IN)?;
    ensure!(
        !ok && text.contains("FAIL  access: no agent on eth0")
            && text.contains("erarctl agent start --iface eth0"),
        "doctor with the agents stopped did not fail with the start advice:\n{text}"
    );
    Ok(())
}

/// `erarctl doctor` in host 0 as `user` (with its groups): whether it
/// passed (exit 0), and its report.
fn doctor(user: &str) -> Result<(bool, String)> {
    let out = Command::new("ip")
        .args(["netns", "exec", &testbed::host_ns(0), "setpriv"])
        .arg(format!("--reuid={user}"))
        .args(["--regid=nogroup", "--init-groups", "env"])
        .arg(format!("USER={user}"))
        .arg(erarctl())
        .arg("doctor")
        .output()
        .context("running erarctl doctor")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("  doctor as {user} (exit {:?}):\n{text}", out.status.code());
    match out.status.code() {
        Some(0) => Ok((true, text)),
        Some(1) => Ok((false, text)),
        _ => bail!(
            "erarctl doctor as {user}: {}\n{text}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}
