//! `erarctl doctor`: whether this node can run liberar's fast path for the
//! user who asks, one check per line, each failure with what to do about it.
//!
//! It asks what a job asks at its first fast call (the interface its ring
//! would use, the agent's datapath opened with this user's rights, or the
//! privilege to attach one), so its verdict is the job's.

use liberar::datapath::agent::{self, AgentError, AgentPaths};
use liberar::datapath::kernel::{self, HostDatapath};
use liberar::datapath::{iface, wire};
use liberar::numerics::simd;
use std::fmt::Write as _;

/// Oldest kernel the datapath runs on: BPF_PROG_RUN's live-frame mode
/// (XDP frames injected from user space) came in 5.18.
const MIN_KERNEL: (u32, u32) = (5, 18);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    /// Works, with a caveat.
    Warn,
    /// The fast path cannot run for this user until it is fixed.
    Fail,
}

impl Status {
    pub const fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    pub detail: String,
    /// What to do (failures and warnings).
    pub advice: Option<String>,
}

fn check(name: &'static str, status: Status, detail: String, advice: Option<String>) -> Check {
    Check {
        name,
        status,
        detail,
        advice,
    }
}

/// Runs every check; `iface`: the interface to check (default: the one a
/// job would take, `ERAR_IFACE` or the first up IPv4 Ethernet interface).
pub fn run(iface: Option<&str>) -> Vec<Check> {
    let mut out = vec![kernel()];
    let chosen = iface
        .map(str::to_owned)
        .or_else(|| std::env::var("ERAR_IFACE").ok().filter(|v| !v.is_empty()));
    match interface(chosen.as_deref()) {
        Ok((line, name)) => {
            out.push(line);
            out.push(driver(&name));
            out.extend(agent_and_access(&name));
        }
        Err(line) => out.push(line),
    }
    out.push(check(
        "simd",
        Status::Ok,
        format!(
            "float codecs run at the {} level",
            simd::Level::detected().name()
        ),
        None,
    ));
    out
}

/// True when no check failed.
pub fn passed(checks: &[Check]) -> bool {
    checks.iter().all(|c| c.status != Status::Fail)
}

fn kernel() -> Check {
    // SAFETY: uname fills the struct it is given.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    let release = if unsafe { libc::uname(&mut u) } == 0 {
        // SAFETY: uname's fields are NUL-terminated.
        unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    } else {
        String::new()
    };
    let mut nums = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    let version = (nums.next().unwrap_or(0), nums.next().unwrap_or(0));
    let min = format!("{}.{}", MIN_KERNEL.0, MIN_KERNEL.1);
    if version >= MIN_KERNEL {
        check("kernel", Status::Ok, format!("{release} (>= {min})"), None)
    } else {
        check(
            "kernel",
            Status::Fail,
            format!("{release:?} is older than {min}"),
            Some(format!(
                "the datapath injects XDP frames with BPF_PROG_RUN's live mode: run Linux {min} \
                 or newer"
            )),
        )
    }
}

/// The BPF filesystem the agent pins into (this namespace's: see
/// [`AgentPaths`]); only the agent needs it, a privileged job does not.
fn bpffs(paths: &AgentPaths) -> Check {
    let dir = paths.bpffs.display().to_string();
    let ok = agent::is_bpffs(&paths.bpffs);
    if ok {
        return check("bpffs", Status::Ok, format!("{dir} is mounted"), None);
    }
    let advice = match paths.netns {
        // `agent start --netns` mounts its own.
        Some(_) => "the agent mounts it when it starts".to_string(),
        None => format!("mount -t bpf bpf {dir} (as root; scripts/install-deps does)"),
    };
    check(
        "bpffs",
        Status::Warn,
        format!("{dir} is not a BPF filesystem: no agent can pin its datapath here"),
        Some(advice),
    )
}

/// The interface, its address, MTU and the chunk that MTU gives.
fn interface(only: Option<&str>) -> Result<(Check, String), Check> {
    let fail = |detail: String| {
        check(
            "interface",
            Status::Fail,
            detail,
            Some(
                "the ring needs an up Ethernet interface with an IPv4 address on the subnet \
                 of the other hosts; name it with --iface (jobs: ERAR_IFACE)"
                    .into(),
            ),
        )
    };
    let list = iface::candidates(only).map_err(|e| fail(format!("listing interfaces: {e}")))?;
    let Some(c) = list.into_iter().next() else {
        return Err(fail(match only {
            Some(n) => format!("{n} is not an up IPv4 Ethernet interface here"),
            None => "no up IPv4 Ethernet interface here".into(),
        }));
    };
    // What a ring of this process would use (jumbo frames only if asked
    // for and permitted; see ERAR_JUMBO).
    let jumbo = liberar::config::Config::get().jumbo && kernel::jumbo_permitted();
    let chunk = kernel::chunk_bytes_for_mtu(if jumbo {
        c.mtu
    } else {
        c.mtu.min(kernel::LINEAR_MTU)
    });
    if kernel::check_chunk_bytes(chunk).is_err() {
        return Err(check(
            "interface",
            Status::Fail,
            format!("{} MTU {} gives {chunk}-byte chunks", c.name, c.mtu),
            Some(format!(
                "raise the MTU: a chunk needs at least {} bytes",
                wire::ERAR_MIN_CHUNK_BYTES
            )),
        ));
    }
    let detail = format!("{} {} MTU {}: {chunk}-byte chunks", c.name, c.ipv4, c.mtu);
    Ok((check("interface", Status::Ok, detail, None), c.name))
}

/// The NIC's driver (native XDP needs the driver's support; veth has it).
fn driver(ifname: &str) -> Check {
    let link = std::fs::read_link(format!("/sys/class/net/{ifname}/device/driver")).ok();
    let name = link
        .as_ref()
        .and_then(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned());
    let virt = std::path::Path::new(&format!("/sys/devices/virtual/net/{ifname}")).exists();
    let detail = match (&name, virt) {
        (Some(n), _) => format!("{ifname}: driver {n}"),
        (None, true) => format!("{ifname}: virtual device (veth or similar)"),
        (None, false) => format!("{ifname}: driver unknown"),
    };
    check("driver", Status::Ok, detail, None)
}

/// The node agent, and whether a job of this user gets a datapath: the
/// agent's (opened with this user's rights, as a job opens it), or its own
/// (privileged).
fn agent_and_access(ifname: &str) -> Vec<Check> {
    let user = std::env::var("USER").unwrap_or_else(|_| {
        // SAFETY: getuid cannot fail.
        format!("uid {}", unsafe { libc::getuid() })
    });
    let start = format!("erarctl agent start --iface {ifname} --group GROUP (as root)");
    let mut out = Vec::new();
    let paths = AgentPaths::current(ifname);
    if let Ok(p) = &paths {
        out.push(bpffs(p));
    }
    let status = paths.as_ref().ok().map(agent::status);
    // Root sees everything of the agent; a user, what its permissions
    // show (the access check below opens what a job opens).
    let privileged = agent::can_attach();
    let agent_line = match (&status, &paths) {
        (Some(s), _) if s.healthy() || (!privileged && s.info.is_some() && !s.pins.is_empty()) => {
            let (group, chunk) = s
                .info
                .as_ref()
                .map(|i| (i.group.clone(), i.chunk_bytes))
                .unwrap_or_default();
            check(
                "agent",
                Status::Ok,
                format!(
                    "running on {ifname} for group {group}, {chunk}-byte chunks ({})",
                    s.paths.pin_dir.display()
                ),
                None,
            )
        }
        (Some(s), Ok(p)) if s.pins.is_empty() && s.info.is_none() => {
            if p.pin_dir.exists() {
                check(
                    "agent",
                    Status::Warn,
                    format!("present on {ifname}, not readable by {user}"),
                    None,
                )
            } else {
                check(
                    "agent",
                    Status::Warn,
                    format!("none on {ifname}"),
                    Some(format!(
                        "without an agent only privileged jobs (CAP_BPF and CAP_NET_ADMIN) are \
                         accelerated: {start}"
                    )),
                )
            }
        }
        (Some(s), _) if privileged => check(
            "agent",
            Status::Fail,
            format!("broken on {ifname}: {}", s.render().replace('\n', "; ")),
            Some(format!("erarctl agent stop --iface {ifname}, then {start}")),
        ),
        (Some(_), _) => check(
            "agent",
            Status::Warn,
            format!("incomplete as {user} sees it on {ifname}"),
            Some("`erarctl agent status` as root tells more".into()),
        ),
        (None, _) => check(
            "agent",
            Status::Warn,
            format!(
                "cannot tell ({})",
                paths
                    .as_ref()
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default()
            ),
            None,
        ),
    };
    out.push(agent_line);
    let access = match HostDatapath::open_pinned(ifname) {
        Ok(h) => check(
            "access",
            Status::Ok,
            format!(
                "{user}'s jobs use the agent's datapath ({}-byte chunks)",
                h.chunk_bytes()
            ),
            None,
        ),
        Err(_) if privileged => check(
            "access",
            Status::Ok,
            format!("{user}'s jobs attach their own datapath (privileged)"),
            None,
        ),
        Err(AgentError::NoAccess { group, .. }) => check(
            "access",
            Status::Fail,
            format!("{user} is not in group {group} of the agent, and not privileged"),
            Some(format!(
                "ask an administrator to add {user} to group {group} (usermod -aG {group} \
                 {user}), then log in again"
            )),
        ),
        Err(AgentError::Absent(_)) => check(
            "access",
            Status::Fail,
            format!("no agent on {ifname}, and {user} is not privileged"),
            Some(format!("ask an administrator to start the agent: {start}")),
        ),
        Err(e) => check(
            "access",
            Status::Fail,
            format!("{e}, and {user} is not privileged"),
            Some(format!(
                "ask an administrator to restart the agent with this build: erarctl agent stop \
                 --iface {ifname}, then {start}"
            )),
        ),
    };
    out.push(access);
    out
}

/// One line per check: `ok    name: detail`, and `      -> advice`.
pub fn render(checks: &[Check]) -> String {
    let mut s = String::new();
    for c in checks {
        let _ = writeln!(s, "{:<5} {}: {}", c.status.name(), c.name, c.detail);
        if let Some(a) = &c.advice {
            let _ = writeln!(s, "      -> {a}");
        }
    }
    let verdict = if passed(checks) {
        "this node can run liberar's fast path for you"
    } else {
        "liberar's calls go to MPI on this node until the failures above are fixed"
    };
    let _ = writeln!(s, "{verdict}");
    s
}

/// The checks as a JSON object: `{"passed": bool, "checks": [{"name",
/// "status", "detail", "advice"}]}`.
pub fn to_json(checks: &[Check]) -> String {
    fn string(s: &str) -> String {
        let mut out = String::with_capacity(s.len() + 2);
        out.push('"');
        for ch in s.chars() {
            match ch {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c => out.push(c),
            }
        }
        out.push('"');
        out
    }
    let items: Vec<String> = checks
        .iter()
        .map(|c| {
            format!(
                "{{\"name\":{},\"status\":{},\"detail\":{},\"advice\":{}}}",
                string(c.name),
                string(&c.status.name().to_ascii_lowercase()),
                string(&c.detail),
                c.advice.as_deref().map_or("null".into(), string)
            )
        })
        .collect();
    format!(
        "{{\"passed\":{},\"checks\":[{}]}}",
        passed(checks),
        items.join(",")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_escapes_and_reports_the_verdict() {
        let checks = vec![
            check("a", Status::Ok, "x \"y\" \\ z".into(), None),
            check(
                "b",
                Status::Fail,
                "line\nbreak".into(),
                Some("do it".into()),
            ),
        ];
        assert_eq!(
            to_json(&checks),
            "{\"passed\":false,\"checks\":[{\"name\":\"a\",\"status\":\"ok\",\"detail\":\
             \"x \\\"y\\\" \\\\ z\",\"advice\":null},{\"name\":\"b\",\"status\":\"fail\",\
             \"detail\":\"line\\u000abreak\",\"advice\":\"do it\"}]}"
        );
        assert!(!passed(&checks));
        assert!(render(&checks).contains("FAIL  b: line\nbreak\n      -> do it\n"));
    }
}
