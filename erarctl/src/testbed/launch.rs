//! Running an MPI job on the emulated cluster: rank i inside host i, MPI's
//! own traffic over the emulated Ethernet (TCP, never shared memory).
//!
//! The launcher (`mpirun.openmpi` / `mpiexec.mpich`) runs in the root
//! namespace; every rank is started through a tiny wrapper script that
//! reads the rank the launcher gave it (`OMPI_COMM_WORLD_RANK` or
//! `PMI_RANK`) and `exec`s `ip netns exec erar-h<rank> PROG ARGS…`, so the
//! arguments pass verbatim and the exit code is the program's.
//!
//! The preload is set the way a user sets it: `LD_PRELOAD` in the
//! launcher's own environment (so the launcher, the wrapper's `sh` and `ip`
//! load it too — it must be harmless there), plus `-x LD_PRELOAD` for
//! Open MPI.
//!
//! This file says what a job is ([`Mpi`], [`LaunchSpec`] and its
//! placement); `command` prepares the launcher command ([`prepare`]) and
//! `run` runs it ([`launch`], [`launch_inherit`]), re-exported here.

mod command;
mod run;

pub use command::{prepare, Prepared};
pub use run::{describe, exit_code, launch, launch_inherit, Hung};

use anyhow::{bail, Result};
use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// Which MPI implementation launches the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Mpi {
    /// Open MPI (`mpirun.openmpi`), BTL tcp over eth0.
    Openmpi,
    /// MPICH (`mpiexec.mpich`, hydra), UCX tcp over eth0.
    Mpich,
}

impl Mpi {
    pub const ALL: [Mpi; 2] = [Mpi::Openmpi, Mpi::Mpich];

    /// Short name, also the directory name under `build/` and `c-tests/bin/`.
    pub fn name(self) -> &'static str {
        match self {
            Mpi::Openmpi => "openmpi",
            Mpi::Mpich => "mpich",
        }
    }

    /// The launcher binary.
    pub fn launcher(self) -> &'static str {
        match self {
            Mpi::Openmpi => "mpirun.openmpi",
            Mpi::Mpich => "mpiexec.mpich",
        }
    }
}

impl fmt::Display for Mpi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Mpi {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Mpi> {
        match s {
            "openmpi" | "ompi" => Ok(Mpi::Openmpi),
            "mpich" => Ok(Mpi::Mpich),
            _ => bail!("unknown MPI {s:?} (want openmpi or mpich)"),
        }
    }
}

/// One MPI job on the test bed.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    pub mpi: Mpi,
    /// Number of hosts the job uses (erar-h0 …): one rank each, rank i in
    /// host i, unless `per_host` says otherwise.
    pub hosts: usize,
    /// Ranks in each host, in rank order (host 0 gets ranks 0..per_host[0],
    /// host 1 the next per_host[1], …), as a site's scheduler places several
    /// ranks per node; its length is `hosts`. Empty: one rank per host.
    pub per_host: Vec<usize>,
    /// Shared library to preload (e.g. `build/openmpi/liberar.so`).
    pub preload: Option<PathBuf>,
    /// Extra environment for the launcher and every rank.
    pub env: Vec<(String, String)>,
    /// Environment the launcher inherits, as from the user's shell (a
    /// loaded module), and passes on only as the MPI itself does: no `-x`.
    pub shell_env: Vec<(String, String)>,
    /// Extra arguments for the launcher, before the program.
    pub launcher_args: Vec<String>,
    /// Program and its arguments (passed verbatim).
    pub program: Vec<OsString>,
    /// Run every rank as this user (name or uid) with its groups instead of
    /// root: the launcher stays root (only root enters the hosts'
    /// namespaces), each rank drops to the user with `setpriv` right after
    /// `ip netns exec`. See [`prepare`] for what Open MPI needs then.
    pub user: Option<String>,
    /// [`launch`] only: kill the job after this long (`None`: wait forever).
    pub timeout: Option<Duration>,
    /// [`launch`] only: once a line of the job's output starts with this
    /// marker (e.g. `PASS `), the job must end within the given time, else
    /// it is killed and reported as hung in shutdown (a timeout). Catches
    /// MPI_Finalize deadlocks long before `timeout`.
    pub end_marker: Option<(String, Duration)>,
}

impl LaunchSpec {
    pub fn new<I, S>(mpi: Mpi, hosts: usize, program: I) -> LaunchSpec
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        LaunchSpec {
            mpi,
            hosts,
            per_host: Vec::new(),
            preload: None,
            env: Vec::new(),
            shell_env: Vec::new(),
            launcher_args: Vec::new(),
            program: program.into_iter().map(Into::into).collect(),
            timeout: None,
            end_marker: None,
            user: None,
        }
    }

    /// Places `counts[i]` ranks in host i (see [`LaunchSpec::per_host`]).
    pub fn ranks_per_host(mut self, counts: Vec<usize>) -> Self {
        self.hosts = counts.len();
        self.per_host = counts;
        self
    }

    /// The host of each rank, in rank order.
    pub fn placement(&self) -> Vec<usize> {
        if self.per_host.is_empty() {
            return (0..self.hosts).collect();
        }
        let hosts = self.per_host.iter().enumerate();
        hosts
            .flat_map(|(h, &k)| std::iter::repeat_n(h, k))
            .collect()
    }

    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self
    }

    pub fn preload(mut self, lib: impl Into<PathBuf>) -> Self {
        self.preload = Some(lib.into());
        self
    }

    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Sets `key` in the launcher's own environment (see
    /// [`LaunchSpec::shell_env`]).
    pub fn shell_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.shell_env.push((key.into(), value.into()));
        self
    }

    pub fn timeout(mut self, t: Duration) -> Self {
        self.timeout = Some(t);
        self
    }

    pub fn end_marker(mut self, marker: impl Into<String>, grace: Duration) -> Self {
        self.end_marker = Some((marker.into(), grace));
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mpi_names() {
        assert_eq!("openmpi".parse::<Mpi>().ok(), Some(Mpi::Openmpi));
        assert_eq!("mpich".parse::<Mpi>().ok(), Some(Mpi::Mpich));
        assert!("intel".parse::<Mpi>().is_err());
    }
}
