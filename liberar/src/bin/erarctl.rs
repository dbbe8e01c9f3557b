//! `erarctl`: the emulated cluster (test bed) and an MPI launcher for it.
//!
//! ```text
//! erarctl testbed up --hosts N [--mtu M] [--switch bridge|xdp]
//! erarctl testbed down [--force]
//! erarctl testbed status
//! erarctl testbed switch bridge|xdp
//! erarctl run --mpi openmpi|mpich --hosts N [--preload PATH] [--env K=V ...] -- PROG ARGS...
//! ```

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use liberar::testbed::{self, launch, LaunchSpec, Mpi, SwitchKind, TestbedConfig, UpOutcome};
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
    /// Run an MPI job with rank i inside emulated host i.
    Run(RunArgs),
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
}

#[derive(Args)]
struct RunArgs {
    /// Which MPI launches the job.
    #[arg(long, value_enum)]
    mpi: Mpi,
    /// Number of ranks (= hosts used: rank i runs in host i).
    #[arg(long)]
    hosts: usize,
    /// Library to LD_PRELOAD into the launcher and every rank.
    #[arg(long)]
    preload: Option<PathBuf>,
    /// Extra environment for the launcher and every rank (repeatable).
    #[arg(long = "env", value_name = "K=V", value_parser = parse_kv)]
    env: Vec<(String, String)>,
    /// Extra argument for the launcher, before the program (repeatable).
    #[arg(long = "launcher-arg", value_name = "ARG", allow_hyphen_values = true)]
    launcher_args: Vec<String>,
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
        Cmd::Run(a) => {
            let spec = LaunchSpec {
                mpi: a.mpi,
                hosts: a.hosts,
                preload: a.preload,
                env: a.env,
                launcher_args: a.launcher_args,
                program: a.program,
                timeout: None,
                end_marker: None,
            };
            let status = testbed::launch_inherit(&spec).context("erarctl run")?;
            let code = launch::exit_code(status);
            return Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)));
        }
    }
    Ok(ExitCode::SUCCESS)
}
