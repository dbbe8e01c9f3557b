//! `erarctl`: the emulated cluster (test bed) and an MPI launcher for it.
//!
//! ```text
//! erarctl testbed up --hosts N [--mtu M] [--switch bridge|xdp]
//! erarctl testbed down [--force]
//! erarctl testbed status
//! erarctl testbed switch bridge|xdp
//! erarctl testbed cpus [--rounds N]
//! erarctl testbed impair [--loss R [--burst N]] [--dup R] [--reorder R] [--drop RULE ...] | --clear | --show
//! erarctl run --mpi openmpi|mpich --hosts N [--ranks-per-host K | --per-host K,K,...] [--preload PATH] [--env K=V ...] [--user U] -- PROG ARGS...
//! erarctl agent start --iface IF [--group G] [--chunk-bytes auto|N] [--netns NAME]
//! erarctl agent stop (--iface IF [--netns NAME] | --all)
//! erarctl agent status [--iface IF [--netns NAME]]
//! erarctl doctor [--iface IF] [--json]
//! erarctl agent check --iface IF       (as any user: can my jobs use it?)
//! ```

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use erarctl::testbed::{
    self, impair, launch, LaunchSpec, Mpi, SwitchKind, TestbedConfig, UpOutcome,
};
use liberar::datapath::agent::{self, ChunkBytes};
use liberar::datapath::kernel::HostDatapath;
use liberar::datapath::{ring, wire};
use std::ffi::OsString;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "erarctl",
    version,
    about = "liberar's emulated Ethernet cluster and MPI launcher"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create, inspect or remove the emulated cluster (needs root).
    #[command(subcommand)]
    Testbed(TestbedCmd),
    /// Run an MPI job with rank i inside emulated host i (or K ranks per host).
    Run(RunArgs),
    /// The privileged node agent: attaches the datapath once per interface
    /// and pins it for a group's unprivileged jobs (needs root).
    #[command(subcommand)]
    Agent(AgentCmd),
    /// Whether this node can run the fast path for you: one line per check
    /// (kernel, bpffs, interface and MTU, driver, agent, your access, CPU),
    /// with what to do about each failure; exit code 1 if any failed.
    Doctor {
        /// The interface to check (default: the one a job would use,
        /// ERAR_IFACE or the first up IPv4 Ethernet interface).
        #[arg(long)]
        iface: Option<String>,
        /// One JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum TestbedCmd {
    /// Bring the cluster up (idempotent; other parameters rebuild it).
    Up {
        /// Number of hosts (network namespaces erar-h0..erar-h{N-1}).
        #[arg(long, default_value_t = 4)]
        hosts: usize,
        /// MTU of every veth end and of the bridge.
        #[arg(long, default_value_t = testbed::DEFAULT_MTU)]
        mtu: u32,
        /// What forwards frames: the plain Linux bridge, or the emulated
        /// XDP switch on the bridge ports.
        #[arg(long, value_enum, default_value_t = SwitchKind::Bridge)]
        switch: SwitchKind,
    },
    /// Remove everything the test bed created.
    Down {
        /// Kill processes still running inside the host namespaces.
        #[arg(long)]
        force: bool,
    },
    /// Show hosts, addresses, MTU, switch and per-port frame counters.
    Status,
    /// Change the switch of a running test bed.
    Switch {
        #[arg(value_enum)]
        kind: SwitchKind,
    },
    /// How the machine's CPUs share their caches now: the round trip of a
    /// cache line between the first allowed CPU and each other one (the
    /// vCPUs of a VM may or may not share a last-level cache, and that
    /// moves benchmarks; see testbed/cpus.rs).
    Cpus {
        /// Round trips averaged per pair.
        #[arg(long, default_value_t = testbed::cpus::ROUNDS)]
        rounds: u32,
    },
    /// Impair liberar's datapath frames in the XDP switch (loss,
    /// duplication, reordering, chosen-frame drops; MPI's TCP is never
    /// touched). Setting replaces all impairments; no option shows them.
    Impair(ImpairArgs),
}

#[derive(Args)]
struct ImpairArgs {
    /// Random loss per hop: 1%, 0.5%, 250ppm (a bare number is percent).
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    loss: Option<u32>,
    /// Frames each random loss drops in a row on its CPU, as a full queue
    /// drops them (needs --loss).
    #[arg(long, value_name = "FRAMES", requires = "loss")]
    burst: Option<u32>,
    /// Random duplication per hop (the frame is delivered twice).
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    dup: Option<u32>,
    /// Random reordering per hop (the frame takes the bridge's slow path
    /// and is overtaken by later frames).
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    reorder: Option<u32>,
    /// Drop the first pass of chosen frames, re-sends pass (repeatable, at
    /// most 4): kind=rs|ag, step=N|any, first|chunk=K|last=K|every=N[,rem=R],
    /// op=any|allreduce|bcast. E.g. 'kind=rs,step=1,every=7'.
    #[arg(long, value_name = "RULE", value_parser = parse_rule)]
    drop: Vec<impair::DropRule>,
    /// Remove every impairment.
    #[arg(long, conflicts_with_all = ["loss", "dup", "reorder", "drop"])]
    clear: bool,
    /// Print the impairments and the switch's counters (the default when
    /// nothing is set).
    #[arg(long)]
    show: bool,
    /// Zero the switch's counters.
    #[arg(long)]
    reset_counters: bool,
}

fn parse_rate(s: &str) -> Result<u32, String> {
    impair::parse_rate(s).map_err(|e| format!("{e:#}"))
}

fn parse_rule(s: &str) -> Result<impair::DropRule, String> {
    s.parse().map_err(|e: anyhow::Error| format!("{e:#}"))
}

fn impair_cmd(a: ImpairArgs) -> Result<()> {
    let sw = impair::Switch::testbed()?;
    let setting = a.loss.is_some() || a.dup.is_some() || a.reorder.is_some() || !a.drop.is_empty();
    if a.clear {
        sw.clear()?;
        println!("impairments: none");
    } else if setting {
        let imp = impair::Impairments {
            loss_ppm: a.loss.unwrap_or(0),
            burst: a.burst.unwrap_or(0),
            dup_ppm: a.dup.unwrap_or(0),
            reorder_ppm: a.reorder.unwrap_or(0),
            rules: a.drop,
        };
        sw.set(&imp)?;
        println!("impairments: {imp}");
    }
    if a.reset_counters {
        sw.reset_counters()?;
    }
    if a.show || !(a.clear || setting || a.reset_counters) {
        println!("switch: program id {}", sw.prog_id());
        println!("impairments: {}", sw.get()?);
        println!("switch counters: {}", sw.counters()?);
        let hosts = testbed::status()?.hosts.len();
        let live = impair::testbed_datapath_counters(hosts)?;
        if !live.is_empty() {
            let sum = |i: u32| live.iter().map(|(_, d)| d.get(i)).sum::<u64>();
            println!(
                "datapath of the job now running ({} hosts): dup={} resent={} resend_skip={} \
                 drop_seq={} drop_state={}",
                live.len(),
                sum(wire::ERAR_STAT_DUP),
                sum(wire::ERAR_STAT_RESENT),
                sum(wire::ERAR_STAT_RESEND_SKIP),
                sum(wire::ERAR_STAT_DROP_SEQ),
                sum(wire::ERAR_STAT_DROP_STATE)
            );
        }
    }
    Ok(())
}

#[derive(Args)]
struct RunArgs {
    /// Which MPI launches the job.
    #[arg(long, value_enum)]
    mpi: Mpi,
    /// Number of hosts used (rank i runs in host i, unless the ranks per
    /// host say otherwise).
    #[arg(long)]
    hosts: usize,
    /// Ranks in every host: K per host, in rank order (host 0 gets ranks
    /// 0..K, host 1 the next K, ...), as a scheduler places several ranks
    /// per node.
    #[arg(long, value_name = "K", conflicts_with = "per_host")]
    ranks_per_host: Option<usize>,
    /// Ranks in each host, e.g. `3,1,2` (as many counts as --hosts).
    #[arg(long, value_name = "K,K,...", value_delimiter = ',')]
    per_host: Vec<usize>,
    /// Library to LD_PRELOAD into the launcher and every rank.
    #[arg(long)]
    preload: Option<PathBuf>,
    /// Extra environment for the launcher and every rank (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_kv)]
    env: Vec<(String, String)>,
    /// Extra argument for the launcher, before the program (repeatable).
    #[arg(long = "launcher-arg", value_name = "ARG", allow_hyphen_values = true)]
    launcher_args: Vec<String>,
    /// Run every rank as this user (with its groups) instead of root; the
    /// launcher and the test bed stay root's.
    #[arg(long, value_name = "USER")]
    user: Option<String>,
    /// The program and its arguments.
    #[arg(last = true, required = true, value_name = "PROG ARGS")]
    program: Vec<OsString>,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("expected K=V, got {s:?}")),
    }
}

fn main() -> ExitCode {
    liberar::config::init_logging();
    let cli = Cli::parse();
    match real_main(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("erarctl: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main(cli: Cli) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Testbed(TestbedCmd::Up { hosts, mtu, switch }) => {
            let cfg = TestbedConfig { hosts, mtu, switch };
            let outcome = testbed::up(&cfg)?;
            let what = match outcome {
                UpOutcome::Created => "created",
                UpOutcome::Unchanged => "already up, nothing to do",
                UpOutcome::SwitchChanged => "switch changed",
                UpOutcome::Rebuilt => "rebuilt",
            };
            println!("testbed: {what} ({hosts} hosts, MTU {mtu}, switch {switch})");
        }
        Cmd::Testbed(TestbedCmd::Down { force }) => {
            testbed::down(force)?;
            println!("testbed: down");
        }
        Cmd::Testbed(TestbedCmd::Status) => {
            let st = testbed::status()?;
            // Ignore a closed stdout (`erarctl testbed status | head`).
            let _ = write!(std::io::stdout(), "{st}");
            if !st.is_absent() && !st.is_healthy() {
                return Ok(ExitCode::from(2));
            }
        }
        Cmd::Testbed(TestbedCmd::Switch { kind }) => {
            testbed::set_switch(kind)?;
            println!("testbed: switch {kind}");
        }
        Cmd::Testbed(TestbedCmd::Cpus { rounds }) => {
            let cpus = liberar::datapath::affinity::allowed_cpus();
            anyhow::ensure!(cpus.len() >= 2, "fewer than 2 CPUs to compare: {cpus:?}");
            for &b in &cpus[1..] {
                match testbed::cpus::round_trip(cpus[0], b, rounds) {
                    Some(t) => println!("cpus {},{b}: round trip {} ns", cpus[0], t.as_nanos()),
                    None => println!("cpus {},{b}: cannot run on both", cpus[0]),
                }
            }
        }
        Cmd::Testbed(TestbedCmd::Impair(a)) => impair_cmd(a)?,
        Cmd::Agent(c) => agent_cmd(c)?,
        Cmd::Doctor { iface, json } => {
            let checks = erarctl::doctor::run(iface.as_deref());
            if json {
                println!("{}", erarctl::doctor::to_json(&checks));
            } else {
                print!("{}", erarctl::doctor::render(&checks));
            }
            if !erarctl::doctor::passed(&checks) {
                return Ok(ExitCode::from(1));
            }
        }
        Cmd::Run(a) => {
            let per_host = match a.ranks_per_host {
                Some(k) => vec![k; a.hosts],
                None => a.per_host,
            };
            let spec = LaunchSpec {
                mpi: a.mpi,
                hosts: a.hosts,
                per_host,
                preload: a.preload,
                env: a.env,
                shell_env: Vec::new(),
                launcher_args: a.launcher_args,
                program: a.program,
                timeout: None,
                end_marker: None,
                user: a.user,
            };
            let status = testbed::launch_inherit(&spec).context("erarctl run")?;
            let code = launch::exit_code(status);
            return Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)));
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Subcommand)]
enum AgentCmd {
    /// Load erar_ring sized for IF's MTU, attach it to IF with a bpf_link and
    /// pin link, program and maps for GROUP's members (idempotent; replaces
    /// a stale or different agent).
    Start {
        /// The interface that carries MPI traffic.
        #[arg(long)]
        iface: String,
        /// Group whose members' jobs may use the datapath (default: root only).
        #[arg(long)]
        group: Option<String>,
        /// Payload bytes per frame: `auto` (the rings' rule for IF's MTU) or
        /// a number; every host of a ring must use the same.
        #[arg(long, default_value = "auto", value_parser = parse_chunk_bytes)]
        chunk_bytes: ChunkBytes,
        /// Run in network namespace /run/netns/NAME (the test bed's hosts):
        /// unlike `ip netns exec`, keeps the host's mount namespace, so the
        /// agent can mount its bpffs where jobs see it.
        #[arg(long, value_name = "NAME")]
        netns: Option<String>,
    },
    /// Unpin everything of the agent on IF (the XDP program is detached at
    /// once; running jobs keep what they hold until they exit).
    Stop {
        #[arg(long, required_unless_present = "all")]
        iface: Option<String>,
        #[arg(long, value_name = "NAME")]
        netns: Option<String>,
        /// Every agent on this machine (all interfaces and namespaces).
        #[arg(long, conflicts_with_all = ["iface", "netns"])]
        all: bool,
    },
    /// What a job of the calling user gets on IF: the agent's datapath (and
    /// its free slots), or why not. Needs no privilege; exits 1 if unusable.
    Check {
        #[arg(long)]
        iface: String,
    },
    /// Run the lease server of the agent on IF (started by `start`; runs
    /// in the calling process's network namespace until killed).
    #[command(hide = true)]
    Serve {
        #[arg(long)]
        iface: String,
    },
    /// Show the agent on IF, or every agent on this machine.
    Status {
        #[arg(long)]
        iface: Option<String>,
        #[arg(long, value_name = "NAME", requires = "iface")]
        netns: Option<String>,
    },
}

fn parse_chunk_bytes(s: &str) -> Result<ChunkBytes, String> {
    match s {
        "auto" => Ok(ChunkBytes::Auto),
        n => n
            .parse()
            .map(ChunkBytes::Fixed)
            .map_err(|_| format!("expected auto or a number of bytes, got {s:?}")),
    }
}

/// The agent's paths for IF in NAME (`None`: this process's namespace).
fn agent_paths(iface: &str, netns: Option<&str>) -> Result<agent::AgentPaths> {
    match netns {
        Some(ns) => agent::AgentPaths::for_netns(Some(ns), iface),
        None => agent::AgentPaths::current(iface),
    }
}

fn agent_cmd(c: AgentCmd) -> Result<()> {
    match c {
        AgentCmd::Start {
            iface,
            group,
            chunk_bytes,
            netns,
        } => {
            if let Some(ns) = &netns {
                agent::enter_netns(ns)?;
            }
            agent::require_iface(&iface)?;
            let opts = agent::StartOptions {
                ifname: iface.clone(),
                group,
                chunk_bytes,
                chunks_per_slot: ring::RING_CHUNKS_PER_SLOT,
                entered_netns: netns.is_some(),
            };
            let paths = agent::AgentPaths::current(&iface)?;
            let (what, info) = match agent::start(&opts)? {
                agent::StartOutcome::Started(i) => ("started", i),
                agent::StartOutcome::AlreadyRunning(i) => ("already running", i),
            };
            println!(
                "agent {}: {what} (group {}, {}-byte chunks x {} per slot, erar_xdp id {}); \
                 pins {}, slot locks {}",
                paths.where_(),
                info.group,
                info.chunk_bytes,
                info.chunks_per_slot,
                info.prog_id,
                paths.pin_dir.display(),
                paths.run_dir.display()
            );
        }
        AgentCmd::Stop { iface, netns, all } => {
            let targets = if all {
                agent::all_agents()
            } else {
                let iface = iface.context("--iface is required")?;
                vec![agent_paths(&iface, netns.as_deref())?]
            };
            for p in targets {
                let removed = agent::stop(&p)?;
                println!(
                    "agent {}: {}",
                    p.where_(),
                    if removed {
                        "stopped"
                    } else {
                        "was not running"
                    }
                );
            }
        }
        AgentCmd::Check { iface } => {
            let paths = agent::AgentPaths::current(&iface)?;
            match HostDatapath::open_pinned(&iface) {
                Ok(h) => {
                    let free: Vec<String> = (0..wire::ERAR_MAX_SLOTS)
                        .filter(|&s| matches!(agent::try_lock_slot(&paths, s), Ok(Some(_))))
                        .map(|s| s.to_string())
                        .collect();
                    println!(
                        "agent {}: usable by this process ({}-byte chunks x {} per slot; free \
                         slots: {})",
                        paths.where_(),
                        h.chunk_bytes(),
                        h.chunks_per_slot(),
                        if free.is_empty() {
                            "none".to_owned()
                        } else {
                            free.join(" ")
                        }
                    );
                }
                Err(e) => anyhow::bail!(
                    "agent {}: not usable by this process: {e}; {}",
                    paths.where_(),
                    if agent::can_attach() {
                        "privileged, so a job attaches its own datapath"
                    } else {
                        "not privileged, so jobs fall back to MPI"
                    }
                ),
            }
        }
        AgentCmd::Serve { iface } => {
            agent::lease::serve(&agent::AgentPaths::current(&iface)?)?;
        }
        AgentCmd::Status { iface, netns } => {
            let targets = match iface {
                Some(i) => vec![agent_paths(&i, netns.as_deref())?],
                None => agent::all_agents(),
            };
            if targets.is_empty() {
                println!("no liberar agent on this machine");
            }
            for p in targets {
                println!("{}", agent::status(&p).render());
            }
        }
    }
    Ok(())
}
