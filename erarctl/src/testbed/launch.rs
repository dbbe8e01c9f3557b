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

use super::cluster::{host_ns, kill_in_namespaces, require_root, status};
use super::{BRIDGE, HOST_IFNAME};
use anyhow::{bail, ensure, Context, Result};
use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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

/// A prepared launcher command plus the wrapper it needs (removed on drop).
pub struct Prepared {
    pub command: Command,
    wrapper_dir: PathBuf,
}

impl Drop for Prepared {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.wrapper_dir);
    }
}

/// Finds an executable in PATH (or the usual sbin directories for `ip`).
fn which(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(prog))
        .find(|p| {
            p.metadata()
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Removes wrapper directories left by launchers that were killed before
/// they could clean up (their pid, in the name, no longer exists).
fn remove_stale_wrappers() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("erar-launch-"))
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// A user the ranks run as: uid, primary gid (from the password database).
#[derive(Clone, Copy, Debug)]
struct RankUser {
    uid: u32,
    gid: u32,
}

fn lookup_user(name: &str) -> Result<RankUser> {
    let c = std::ffi::CString::new(name).context("user name")?;
    let mut pw: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16384];
    let mut out: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: getpwnam_r/getpwuid_r fill pw and buf; out is pw or null.
    let rc = unsafe {
        match name.parse::<u32>() {
            Ok(uid) => libc::getpwuid_r(uid, &mut pw, buf.as_mut_ptr(), buf.len(), &mut out),
            Err(_) => libc::getpwnam_r(c.as_ptr(), &mut pw, buf.as_mut_ptr(), buf.len(), &mut out),
        }
    };
    ensure!(rc == 0 && !out.is_null(), "no user {name:?}");
    Ok(RankUser {
        uid: pw.pw_uid,
        gid: pw.pw_gid,
    })
}

/// Writes the per-rank wrapper into a fresh private directory.
fn write_wrapper(ip_path: &Path, user: Option<RankUser>, placement: &[usize]) -> Result<PathBuf> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    remove_stale_wrappers();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!(
        "erar-launch-{}-{}-{nanos}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    // create_dir (not _all): fails if anything is already there.
    std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod {}", dir.display()))?;
    let ip = ip_path.to_str().context("the path of `ip` is not UTF-8")?;
    // As another user: drop root right after entering the namespace (with
    // the user's supplementary groups), and give Open MPI's rank a session
    // directory of the user's in this directory (removed with it) instead
    // of the root daemon's, where it may not write.
    let drop_to = match user {
        None => String::new(),
        Some(u) => {
            let setpriv = which("setpriv").context("`setpriv` (util-linux) not found")?;
            let env = which("env").context("`env` not found")?;
            let sessions = dir.join("sessions");
            std::fs::create_dir(&sessions)
                .with_context(|| format!("creating {}", sessions.display()))?;
            std::os::unix::fs::chown(&sessions, Some(u.uid), Some(u.gid))
                .with_context(|| format!("chown {}", sessions.display()))?;
            std::fs::set_permissions(&sessions, std::fs::Permissions::from_mode(0o700))
                .with_context(|| format!("chmod {}", sessions.display()))?;
            format!(
                "{} --reuid={} --regid={} --init-groups -- {} \
                 -u OMPI_MCA_orte_jobfam_session_dir OMPI_MCA_orte_top_session_dir={} ",
                shell_quote(setpriv.to_str().context("setpriv path")?),
                u.uid,
                u.gid,
                shell_quote(env.to_str().context("env path")?),
                shell_quote(sessions.to_str().context("session dir path")?)
            )
        }
    };
    let script = format!(
        r#"#!/bin/sh
# Written by liberar::testbed::launch: runs this MPI rank inside its emulated
# host (network namespace erar-h<host>; the hosts of ranks 0, 1, ... are
# listed below). Arguments pass verbatim; exec keeps the program's exit code.
rank="${{OMPI_COMM_WORLD_RANK:-${{PMI_RANK:-}}}}"
case "$rank" in
  ''|*[!0-9]*)
    echo "erar-exec-in-host: cannot tell this process's MPI rank (OMPI_COMM_WORLD_RANK/PMI_RANK unset)" >&2
    exit 127;;
esac
host=; i=0
for h in {placement}; do
  [ "$i" = "$rank" ] && host=$h
  i=$((i + 1))
done
if [ -z "$host" ]; then
  echo "erar-exec-in-host: rank $rank is not in this job's placement" >&2
  exit 127
fi
exec {ip} netns exec "erar-h$host" {drop_to}"$@"
"#,
        ip = shell_quote(ip),
        placement = placement
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let path = dir.join("exec-in-host");
    std::fs::write(&path, script).with_context(|| format!("writing {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod {}", path.display()))?;
    Ok(dir)
}

/// Builds the launcher command for `spec` (checks the test bed first).
pub fn prepare(spec: &LaunchSpec) -> Result<Prepared> {
    require_root()?;
    ensure!(spec.hosts >= 1, "--hosts must be at least 1");
    ensure!(
        spec.per_host.is_empty()
            || (spec.per_host.len() == spec.hosts && spec.per_host.iter().all(|&k| k >= 1)),
        "ranks per host {:?}: one count of at least 1 for each of the {} hosts",
        spec.per_host,
        spec.hosts
    );
    let placement = spec.placement();
    ensure!(!spec.program.is_empty(), "no program given to run");
    let st = status()?;
    ensure!(
        st.is_healthy(),
        "the test bed is not up (or broken); run `erarctl testbed up --hosts {}` first:\n{st}",
        spec.hosts
    );
    ensure!(
        st.hosts.len() >= spec.hosts,
        "the test bed has {} hosts but the job wants {}; run `erarctl testbed up --hosts {}`",
        st.hosts.len(),
        spec.hosts,
        spec.hosts
    );
    let launcher = which(spec.mpi.launcher()).with_context(|| {
        format!(
            "{} not found: install {} (scripts/install-deps)",
            spec.mpi.launcher(),
            match spec.mpi {
                Mpi::Openmpi => "openmpi-bin",
                Mpi::Mpich => "mpich",
            }
        )
    })?;
    let ip_path = which("ip").context("`ip` (iproute2) not found")?;
    let preload = match &spec.preload {
        Some(p) => Some(
            std::fs::canonicalize(p)
                .with_context(|| format!("preload library {} not found", p.display()))?,
        ),
        None => None,
    };
    for (k, _) in &spec.env {
        ensure!(
            !k.is_empty() && !k.contains('=') && !k.contains('\0'),
            "bad environment variable name {k:?}"
        );
    }

    let user = spec.user.as_deref().map(lookup_user).transpose()?;
    let wrapper_dir = write_wrapper(&ip_path, user, &placement)?;
    let wrapper = wrapper_dir.join("exec-in-host");
    let mut cmd = Command::new(&launcher);
    let n = placement.len().to_string();
    // Settings every rank needs, then the user's (which may override them).
    let mut env: Vec<(String, String)> = Vec::new();
    match spec.mpi {
        Mpi::Openmpi => {
            env.extend(
                [
                    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
                    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
                    // The PMIx client in a host namespace reaches the
                    // launcher's PMIx server over the bridge.
                    ("PMIX_MCA_ptl_tcp_remote_connections", "1"),
                    ("PMIX_MCA_ptl_tcp_if_include", BRIDGE),
                ]
                .map(|(k, v)| (k.to_owned(), v.to_owned())),
            );
            if user.is_some() {
                // Ranks of another uid than the (root) daemon's PMIx
                // server: its `native` security plugin rejects their uid,
                // and the shared-memory datastore's lock file sits in the
                // root daemon's session directory.
                env.extend(
                    [("PMIX_MCA_psec", "none"), ("PMIX_MCA_gds", "hash")]
                        .map(|(k, v)| (k.to_owned(), v.to_owned())),
                );
            }
            cmd.args(["-np", &n, "--oversubscribe", "--bind-to", "none"]);
            // ob1 + tcp only: pml ucx would bypass the BTL choice and use
            // shared memory; vader (shared memory) is excluded by the list.
            cmd.args(["--mca", "pml", "ob1", "--mca", "btl", "tcp,self"]);
            cmd.args(["--mca", "btl_tcp_if_include", HOST_IFNAME]);
            cmd.args(["--mca", "oob_tcp_if_include", BRIDGE]);
        }
        Mpi::Mpich => {
            env.extend(
                [
                    // Without these UCX silently uses shared memory even
                    // across namespaces.
                    ("UCX_TLS", "tcp,self"),
                    ("UCX_NET_DEVICES", HOST_IFNAME),
                    // Every rank is "remote": no ch4 shared-memory shortcut.
                    ("MPIR_CVAR_NOLOCAL", "1"),
                ]
                .map(|(k, v)| (k.to_owned(), v.to_owned())),
            );
            cmd.args(["-n", &n, "-launcher", "fork", "-genvall"]);
        }
    }
    env.extend(spec.env.iter().cloned());
    if let Some(p) = &preload {
        env.push(("LD_PRELOAD".into(), p.to_string_lossy().into_owned()));
    }
    for (k, v) in &spec.shell_env {
        cmd.env(k, v);
    }
    let mut exported: Vec<&str> = Vec::new();
    for (k, v) in &env {
        cmd.env(k, v);
        if !exported.contains(&k.as_str()) {
            exported.push(k);
        }
    }
    if spec.mpi == Mpi::Openmpi {
        for k in &exported {
            cmd.args(["-x", k]);
        }
    }
    cmd.args(&spec.launcher_args);
    cmd.arg(&wrapper);
    cmd.args(&spec.program);
    Ok(Prepared {
        command: cmd,
        wrapper_dir,
    })
}

/// Renders a command line for messages.
pub fn describe(cmd: &Command) -> String {
    let mut s: Vec<String> = cmd
        .get_envs()
        .filter_map(|(k, v)| v.map(|v| format!("{}={}", k.to_string_lossy(), v.to_string_lossy())))
        .collect();
    s.push(cmd.get_program().to_string_lossy().into_owned());
    s.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    s.join(" ")
}

/// Runs the job with the caller's stdin/stdout/stderr; returns the
/// launcher's exit status (the CLI's `erarctl run`).
pub fn launch_inherit(spec: &LaunchSpec) -> Result<ExitStatus> {
    let mut p = prepare(spec)?;
    log::info!("running: {}", describe(&p.command));
    let status = p
        .command
        .status()
        .with_context(|| format!("starting {}", spec.mpi.launcher()))?;
    Ok(status)
}

/// Runs the job with stdout/stderr captured. On timeout the job is killed
/// (launcher first, then anything left in the host namespaces) and an error
/// carrying the output so far is returned. A non-zero exit is *not* an
/// error: inspect `Output::status`.
pub fn launch(spec: &LaunchSpec) -> Result<Output> {
    let mut p = prepare(spec)?;
    let what = describe(&p.command);
    p.command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Own process group, so a timeout can signal all of it.
        .process_group(0);
    let mut child = p
        .command
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let marker_seen: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
    let marker = spec.end_marker.as_ref().map(|(m, _)| m.clone());
    let out_reader = reader(child.stdout.take(), marker.clone(), marker_seen.clone());
    let err_reader = reader(child.stderr.take(), marker, marker_seen.clone());
    let grace = spec.end_marker.as_ref().map(|(_, g)| *g);
    let waited = wait_with_timeout(&mut child, spec.timeout, grace, &marker_seen);
    let hung = match waited {
        Ok(Waited::Exited) => None,
        Ok(Waited::TimedOut) => Some(format!(
            "timed out after {:?}",
            spec.timeout.unwrap_or_default()
        )),
        Ok(Waited::HungAfterMarker) => Some(format!(
            "timed out: still running {:?} after printing {:?} (hung in shutdown?)",
            grace.unwrap_or_default(),
            spec.end_marker
                .as_ref()
                .map(|(m, _)| m.as_str())
                .unwrap_or("")
        )),
        Err(e) => {
            terminate(&mut child);
            return Err(e.context(format!("waiting for {what}")));
        }
    };
    if hung.is_some() {
        terminate(&mut child);
        // Anything the job left in the host namespaces (e.g. ranks orphaned
        // by a killed launcher) would hold the namespace; it was started by us.
        let ns: Vec<String> = (0..spec.hosts).map(host_ns).collect();
        kill_in_namespaces(&ns);
    }
    let status = child.wait().context("reaping the launcher")?;
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    let output = Output {
        status,
        stdout,
        stderr,
    };
    if let Some(why) = hung {
        return Err(Hung {
            message: format!("{why}: {what}"),
            after_marker: why.contains("after printing"),
            output,
        }
        .into());
    }
    Ok(output)
}

/// The error [`launch`] returns when it had to kill a job (downcast the
/// `anyhow::Error` to get the output the job printed before).
#[derive(Debug)]
pub struct Hung {
    pub message: String,
    /// Killed because it kept running after printing the end marker (hung
    /// in shutdown), not because the overall timeout expired.
    pub after_marker: bool,
    /// What it printed; `status` is the killed launcher's.
    pub output: Output,
}

impl fmt::Display for Hung {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.message,
            String::from_utf8_lossy(&self.output.stdout),
            String::from_utf8_lossy(&self.output.stderr)
        )
    }
}

impl std::error::Error for Hung {}

/// Collects a pipe; notes the first time a line starts with `marker`.
fn reader<R: Read + Send + 'static>(
    pipe: Option<R>,
    marker: Option<String>,
    seen: Arc<Mutex<Option<Instant>>>,
) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let Some(mut p) = pipe else { return buf };
        let mut chunk = [0u8; 8192];
        let mut line_start = 0;
        loop {
            let n = match p.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            buf.extend_from_slice(&chunk[..n]);
            if let Some(m) = &marker {
                while let Some(nl) = buf[line_start..].iter().position(|&b| b == b'\n') {
                    let line = &buf[line_start..line_start + nl];
                    if line.trim_ascii_start().starts_with(m.as_bytes()) {
                        let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
                        s.get_or_insert_with(Instant::now);
                    }
                    line_start += nl + 1;
                }
            }
        }
        buf
    })
}

enum Waited {
    Exited,
    TimedOut,
    HungAfterMarker,
}

fn wait_with_timeout(
    child: &mut Child,
    timeout: Option<Duration>,
    grace: Option<Duration>,
    marker_seen: &Mutex<Option<Instant>>,
) -> Result<Waited> {
    if timeout.is_none() && grace.is_none() {
        child.wait()?;
        return Ok(Waited::Exited);
    }
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        if child.try_wait()?.is_some() {
            return Ok(Waited::Exited);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(Waited::TimedOut);
        }
        if let Some(g) = grace {
            let seen = *marker_seen.lock().unwrap_or_else(|e| e.into_inner());
            if seen.is_some_and(|t| t.elapsed() >= g) {
                return Ok(Waited::HungAfterMarker);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGTERM the launcher's process group (launchers then stop their ranks),
/// SIGKILL it after a grace period.
fn terminate(child: &mut Child) {
    let Ok(pgid) = i32::try_from(child.id()) else {
        return;
    };
    // SAFETY: kill(2) on the process group we created for this child.
    unsafe {
        libc::kill(-pgid, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above; harmless if the group is already gone.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}

/// The exit code of a finished process, or 128+signal like a shell.
pub fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_for_sh() {
        assert_eq!(shell_quote("/usr/sbin/ip"), "'/usr/sbin/ip'");
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
    }

    #[test]
    fn parses_mpi_names() {
        assert_eq!("openmpi".parse::<Mpi>().ok(), Some(Mpi::Openmpi));
        assert_eq!("mpich".parse::<Mpi>().ok(), Some(Mpi::Mpich));
        assert!("intel".parse::<Mpi>().is_err());
    }
}
