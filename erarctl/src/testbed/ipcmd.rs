//! Running iproute2's `ip` with useful error messages.

use anyhow::{bail, Context, Result};
use std::io::Write;
use std::process::{Command, Stdio};

/// Runs `ip ARGS…`; returns its stdout. Fails with the command line, the
/// exit status and ip's own stderr.
pub fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| {
            format!(
                "cannot run `ip {}` (is iproute2 installed?)",
                args.join(" ")
            )
        })?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Like [`ip`], for probes ("does this device exist"): `None` on any
/// failure, stderr discarded.
pub(crate) fn ip_ok(args: &[&str]) -> Option<String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs many `ip` commands in one process (`ip [-n NS] -batch -`). Stops at
/// the first failing command; the error names it.
pub(crate) fn ip_batch(netns: Option<&str>, what: &str, cmds: &[String]) -> Result<()> {
    if cmds.is_empty() {
        return Ok(());
    }
    let mut args: Vec<&str> = Vec::new();
    if let Some(ns) = netns {
        args.extend(["-n", ns]);
    }
    args.extend(["-batch", "-"]);
    let mut child = Command::new("ip")
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("{what}: cannot run `ip` (is iproute2 installed?)"))?;
    let script = cmds.join("\n") + "\n";
    {
        let mut stdin = child.stdin.take().context("ip -batch: no stdin pipe")?;
        stdin
            .write_all(script.as_bytes())
            .with_context(|| format!("{what}: writing commands to `ip -batch`"))?;
    }
    let out = child
        .wait_with_output()
        .with_context(|| format!("{what}: waiting for `ip -batch`"))?;
    if !out.status.success() {
        let ns = netns.map(|n| format!(" in netns {n}")).unwrap_or_default();
        bail!(
            "{what}: `ip -batch`{ns} failed ({}): {}\ncommands were:\n  {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            cmds.join("\n  ")
        );
    }
    Ok(())
}

/// Runs `ip netns exec NS sh -c SCRIPT` (small fixed scripts only).
pub(crate) fn netns_sh(netns: &str, script: &str) -> Result<()> {
    let out = Command::new("ip")
        .args(["netns", "exec", netns, "sh", "-c", script])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run `ip netns exec {netns} sh -c …`"))?;
    if !out.status.success() {
        bail!(
            "`ip netns exec {netns} sh -c '{script}'` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Names of all network namespaces (`ip netns list`).
pub(crate) fn netns_list() -> Result<Vec<String>> {
    let out = ip(&["netns", "list"])?;
    // Lines look like "erar-h0 (id: 3)" or just "erar-h0".
    Ok(out
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect())
}

/// Process ids inside a network namespace (`ip netns pids NS`).
pub(crate) fn netns_pids(netns: &str) -> Vec<i32> {
    ip_ok(&["netns", "pids", netns])
        .map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}
