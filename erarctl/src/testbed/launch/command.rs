//! Preparing a job's launcher command: the per-rank wrapper script that
//! enters the rank's host (and drops to the job's user), and the
//! launcher's arguments and environment for Open MPI or MPICH.

use super::{LaunchSpec, Mpi};
use crate::testbed::cluster::{require_root, status};
use crate::testbed::{BRIDGE, HOST_IFNAME};
use anyhow::{ensure, Context, Result};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

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
# Written by erarctl::testbed::launch: runs this MPI rank inside its emulated
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_for_sh() {
        assert_eq!(shell_quote("/usr/sbin/ip"), "'/usr/sbin/ip'");
        assert_eq!(shell_quote("a'b"), r"'a'\''b'");
    }
}
