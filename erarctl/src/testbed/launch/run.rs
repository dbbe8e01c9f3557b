//! Running a prepared job: on the caller's terminal, or captured with a
//! timeout and an end marker, killing it (and what it left in the hosts)
//! when it hangs.

use super::{prepare, LaunchSpec};
use crate::testbed::cluster::{host_ns, kill_in_namespaces};
use anyhow::{Context, Result};
use std::fmt;
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
