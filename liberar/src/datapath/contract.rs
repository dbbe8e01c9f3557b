//! The contract between a node's agent and its jobs, which both sides
//! follow: where the agent of an interface pins its objects and keeps its
//! slot locks ([`AgentPaths`]), the names of the pins, what `agent.info`
//! says ([`AgentInfo`]), why a job cannot use an agent ([`AgentError`]),
//! and a job's side of a lease ([`request_lease`]). The daemon that keeps
//! it is [`super::agent`]; BPF object queries are [`super::bpfobj`].
//!
//! Layout, per interface (the same rule in the agent and in every job):
//!
//! | network namespace | pins (bpffs) | slot locks and info |
//! |---|---|---|
//! | unnamed (a normal host) | `/sys/fs/bpf/liberar/<if>/` | `/run/liberar/<if>/` |
//! | named `N` (`/run/netns/N`, e.g. the test bed) | `/run/liberar/bpffs/N/<if>/` | `/run/liberar/netns/N/<if>/` |
//!
//! A named namespace gets a bpffs under `/run` because `ip netns exec`
//! mounts a fresh sysfs on `/sys` (so `/sys/fs/bpf` is empty there), and
//! because the hosts of the test bed share one file system, so the
//! namespace's name must be part of the path.
//!
//! In the pin directory: `erar_xdp` (program, group read-write: jobs
//! inject with BPF_PROG_RUN), `stats` and `rodata` (group read-only), and
//! root only: `link` (any process that holds an fd of a bpf_link can
//! BPF_LINK_DETACH it, no capability needed) and the arrays of maps that
//! hold every slot's state (`slot_bufs`, `slot_ctls`, `chunk_states`,
//! `resends`, `slot_events`). In the run directory: `slot-<N>.lock` for N
//! in 0..ERAR_MAX_SLOTS (a job holds the flock of the slot its ring uses
//! while the ring lives; the kernel drops it when the process dies, even on
//! kill -9), `agent.info`, and the lease server's `lease.sock` and
//! `lease.pid` ([`lease`]): a job gets its slot's maps from the server, as
//! fresh maps nobody else can reach.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::{ErrorKind, Write as _};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};

use std::os::unix::net::UnixStream;

use sendfd::RecvWithFd;

/// The program's arrays of maps that hold every slot's inner maps, in the
/// order of a slot's maps (see the per-slot maps in erar_ring.bpf.c and
/// `kernel::slot::SlotMaps`): pinned by the agent, root only.
pub const OUTER_MAPS: [&str; 5] = [
    "slot_bufs",
    "slot_ctls",
    "chunk_states",
    "resends",
    "slot_events",
];

/// Pin names inside an agent's pin directory.
pub const PIN_PROG: &str = "erar_xdp";
pub const PIN_LINK: &str = "link";
pub const PIN_STATS: &str = "stats";
pub const PIN_RODATA: &str = "rodata";
/// Every pin of a complete agent directory.
pub const ALL_PINS: [&str; 9] = [
    PIN_PROG,
    PIN_LINK,
    OUTER_MAPS[0],
    OUTER_MAPS[1],
    OUTER_MAPS[2],
    OUTER_MAPS[3],
    OUTER_MAPS[4],
    PIN_STATS,
    PIN_RODATA,
];

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const INFO_FILE: &str = "agent.info";
const LEASE_SOCKET: &str = "lease.sock";

/// Where the agent of one interface keeps its objects (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentPaths {
    pub ifname: String,
    /// The named network namespace this applies to (`None`: unnamed).
    pub netns: Option<String>,
    /// The bpffs mount that holds `pin_dir`.
    pub bpffs: PathBuf,
    /// The pinned program, link and maps.
    pub pin_dir: PathBuf,
    /// Slot lock files and `agent.info`.
    pub run_dir: PathBuf,
}

impl AgentPaths {
    /// The paths for `ifname` in the network namespace named `netns`.
    pub fn for_netns(netns: Option<&str>, ifname: &str) -> Result<AgentPaths> {
        ensure!(
            valid_name(ifname),
            "bad interface name {ifname:?} for an agent directory"
        );
        Ok(match netns {
            None => AgentPaths {
                ifname: ifname.to_owned(),
                netns: None,
                bpffs: PathBuf::from("/sys/fs/bpf"),
                pin_dir: Path::new("/sys/fs/bpf/liberar").join(bpffs_name(ifname)),
                run_dir: Path::new("/run/liberar").join(ifname),
            },
            Some(ns) => {
                ensure!(valid_name(ns), "bad network namespace name {ns:?}");
                AgentPaths {
                    ifname: ifname.to_owned(),
                    netns: Some(ns.to_owned()),
                    bpffs: PathBuf::from("/run/liberar/bpffs"),
                    pin_dir: Path::new("/run/liberar/bpffs")
                        .join(bpffs_name(ns))
                        .join(bpffs_name(ifname)),
                    run_dir: Path::new("/run/liberar/netns").join(ns).join(ifname),
                }
            }
        })
    }

    /// The paths for `ifname` in this process's network namespace.
    pub fn current(ifname: &str) -> Result<AgentPaths> {
        Self::for_netns(current_netns_name().as_deref(), ifname)
    }

    pub fn pin(&self, name: &str) -> PathBuf {
        self.pin_dir.join(name)
    }

    pub fn slot_lock(&self, slot: u32) -> PathBuf {
        self.run_dir.join(format!("slot-{slot}.lock"))
    }

    /// The agent's lease server (see [`lease`]).
    pub fn lease_socket(&self) -> PathBuf {
        self.run_dir.join(LEASE_SOCKET)
    }

    pub fn info_file(&self) -> PathBuf {
        self.run_dir.join(INFO_FILE)
    }

    /// `<host>/<if>` or `<host>/<netns>:<if>`, for messages.
    pub fn where_(&self) -> String {
        let host = hostname();
        match &self.netns {
            None => format!("{host}/{}", self.ifname),
            Some(ns) => format!("{host}/{ns}:{}", self.ifname),
        }
    }
}

/// bpffs refuses names with a dot (EPERM): `.` → `%2e`, `%` → `%25`.
pub(crate) fn bpffs_name(s: &str) -> String {
    s.replace('%', "%25").replace('.', "%2e")
}

pub(crate) fn from_bpffs_name(s: &str) -> String {
    s.replace("%2e", ".").replace("%25", "%")
}

fn valid_name(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains('/') && !s.contains('\0')
}

/// The name under `/run/netns` of this process's network namespace (what
/// `ip netns identify` prints), if it has one; the first in name order if
/// it has several.
pub fn current_netns_name() -> Option<String> {
    let me = std::fs::metadata("/proc/self/ns/net").ok()?;
    let mut names: Vec<String> = std::fs::read_dir("/run/netns")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    names.into_iter().find(|n| {
        std::fs::metadata(Path::new("/run/netns").join(n))
            .is_ok_and(|m| m.dev() == me.dev() && m.ino() == me.ino())
    })
}

/// Enters network namespace `/run/netns/<name>` (this thread only; call it
/// before any other thread starts). The mount namespace stays, unlike with
/// `ip netns exec`, so the agent can mount its bpffs where jobs see it.
pub fn enter_netns(name: &str) -> Result<()> {
    ensure!(valid_name(name), "bad network namespace name {name:?}");
    let path = Path::new("/run/netns").join(name);
    let f = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: setns on an fd we own.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("entering network namespace {name}"));
    }
    Ok(())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return "?".into();
    }
    CStr::from_bytes_until_nul(&buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "?".into())
}

/// Name of group `gid` (or the number).
pub fn group_name(gid: u32) -> String {
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 4096];
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: getgrgid_r fills grp/buf, out points to grp or is null.
    let rc = unsafe { libc::getgrgid_r(gid, &mut grp, buf.as_mut_ptr(), buf.len(), &mut out) };
    if rc == 0 && !out.is_null() {
        // SAFETY: gr_name points into buf, NUL-terminated.
        return unsafe { CStr::from_ptr(grp.gr_name) }
            .to_string_lossy()
            .into_owned();
    }
    gid.to_string()
}

/// Group id of `name` (a number is taken as it is).
pub fn group_id(name: &str) -> Result<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(n);
    }
    let c = CString::new(name).context("group name")?;
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16384];
    let mut out: *mut libc::group = std::ptr::null_mut();
    // SAFETY: as in group_name.
    let rc =
        unsafe { libc::getgrnam_r(c.as_ptr(), &mut grp, buf.as_mut_ptr(), buf.len(), &mut out) };
    ensure!(rc == 0 && !out.is_null(), "no group {name:?}");
    Ok(grp.gr_gid)
}

/// Whether this process may load and attach its own datapath: CAP_NET_ADMIN
/// and CAP_BPF (or CAP_SYS_ADMIN) in its effective set.
pub fn can_attach() -> bool {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    let Some(eff) = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
    else {
        return false;
    };
    let has = |cap: u32| eff & (1u64 << cap) != 0;
    const CAP_NET_ADMIN: u32 = 12;
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_BPF: u32 = 39;
    has(CAP_NET_ADMIN) && (has(CAP_BPF) || has(CAP_SYS_ADMIN))
}

/// Fingerprint of the BPF sources this build was made from: a job uses an
/// agent's datapath only if the agent runs the same erar_ring program.
pub fn fingerprint() -> String {
    // erar_ring.bpf.c and every header of bpf/include, listed by build.rs
    // (so a new header cannot be left out).
    const SOURCES: &[&[u8]] = include!(concat!(env!("OUT_DIR"), "/bpf_sources.rs"));
    // FNV-1a, 64 bit.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for src in SOURCES {
        for &b in src.iter().chain(&(src.len() as u64).to_le_bytes()) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// Why a job cannot use the agent's datapath.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("no liberar agent ({} missing)", .0.display())]
    Absent(PathBuf),
    #[error("not in group {group} of the liberar agent ({})", .dir.display())]
    NoAccess { dir: PathBuf, group: String },
    #[error("the liberar agent's datapath ({}) is unusable: {why}", .dir.display())]
    Unusable { dir: PathBuf, why: String },
}

impl AgentError {
    /// Classifies a failure to open `path` inside the agent's directory.
    pub fn opening(paths: &AgentPaths, path: &Path, e: &std::io::Error) -> AgentError {
        match e.kind() {
            ErrorKind::PermissionDenied => AgentError::NoAccess {
                dir: paths.pin_dir.clone(),
                group: std::fs::metadata(&paths.pin_dir)
                    .map(|m| group_name(m.gid()))
                    .unwrap_or_else(|_| "?".into()),
            },
            ErrorKind::NotFound if path == paths.pin_dir => {
                AgentError::Absent(paths.pin_dir.clone())
            }
            _ => AgentError::Unusable {
                dir: paths.pin_dir.clone(),
                why: format!("{}: {e}", path.display()),
            },
        }
    }
}

/// The agent's description of its datapath (`agent.info`, `key=value` lines).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentInfo {
    pub iface: String,
    pub netns: String,
    pub ifindex: u32,
    pub group: String,
    pub gid: u32,
    pub chunk_bytes: u32,
    pub chunks_per_slot: u32,
    pub prog_id: u32,
    pub fingerprint: String,
    pub started: u64,
}

impl AgentInfo {
    pub(crate) fn render(&self) -> String {
        format!(
            "# liberar node agent (erarctl agent start); read by liberar.so\n\
             iface={}\nnetns={}\nifindex={}\ngroup={}\ngid={}\nchunk_bytes={}\n\
             chunks_per_slot={}\nprog_id={}\nfingerprint={}\nstarted={}\n",
            self.iface,
            self.netns,
            self.ifindex,
            self.group,
            self.gid,
            self.chunk_bytes,
            self.chunks_per_slot,
            self.prog_id,
            self.fingerprint,
            self.started
        )
    }

    pub fn parse(text: &str) -> AgentInfo {
        let mut i = AgentInfo::default();
        for line in text.lines() {
            let Some((k, v)) = line.split_once('=') else {
                continue;
            };
            let num = |v: &str| v.trim().parse().unwrap_or(0);
            match k.trim() {
                "iface" => i.iface = v.to_owned(),
                "netns" => i.netns = v.to_owned(),
                "ifindex" => i.ifindex = num(v),
                "group" => i.group = v.to_owned(),
                "gid" => i.gid = num(v),
                "chunk_bytes" => i.chunk_bytes = num(v),
                "chunks_per_slot" => i.chunks_per_slot = num(v),
                "prog_id" => i.prog_id = num(v),
                "fingerprint" => i.fingerprint = v.to_owned(),
                "started" => i.started = v.trim().parse().unwrap_or(0),
                _ => {}
            }
        }
        i
    }

    pub fn read(paths: &AgentPaths) -> std::io::Result<AgentInfo> {
        std::fs::read_to_string(paths.info_file()).map(|t| AgentInfo::parse(&t))
    }
}

/// Takes slot `slot`'s lock file without waiting: `Ok(None)` if another
/// open file (another process, or another ring of this one) holds it. The
/// lock lasts while the returned file is open.
pub fn try_lock_slot(paths: &AgentPaths, slot: u32) -> std::io::Result<Option<File>> {
    try_lock_file(&paths.slot_lock(slot))
}

/// Takes the flock of the existing file `path` without waiting; `None`
/// while another process holds it.
pub fn try_lock_file(path: &Path) -> std::io::Result<Option<File>> {
    let f = File::open(path)?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(Some(f));
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(None)
    } else {
        Err(e)
    }
}

/// Pids holding an flock on `path` (from /proc/locks).
pub fn lock_holders(path: &Path) -> Vec<u32> {
    let Ok(meta) = std::fs::metadata(path) else {
        return Vec::new();
    };
    let want = format!(
        "{:02x}:{:02x}:{}",
        libc::major(meta.dev()),
        libc::minor(meta.dev()),
        meta.ino()
    );
    let Ok(locks) = std::fs::read_to_string("/proc/locks") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = locks
        .lines()
        .filter(|l| !l.contains("->")) // waiters
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // "1: FLOCK  ADVISORY  WRITE 22850 fe:00:9838593 0 EOF"
            (f.len() >= 6 && f[1] == "FLOCK" && f[5] == want)
                .then(|| f[4].parse().ok())
                .flatten()
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// `statfs(path).f_type == BPF_FS_MAGIC`.
pub fn is_bpffs(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid path, st is written by statfs.
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type as i64 == BPF_FS_MAGIC }
}

/// MTU of `ifname` in this network namespace (ioctl, so it also works
/// after [`enter_netns`], where /sys still shows the old namespace).
pub fn if_mtu(ifname: &str) -> Result<u32> {
    let name = ifname.as_bytes();
    ensure!(
        name.len() < libc::IFNAMSIZ,
        "interface name {ifname:?} too long"
    );
    // SAFETY: a datagram socket for the ioctl, owned by `sock`.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("socket for SIOCGIFMTU");
    }
    // SAFETY: fd is a fresh socket.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFMTU reads ifr_name and writes ifru_mtu.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFMTU, &mut req) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("reading the MTU of {ifname}"));
    }
    // SAFETY: the union member SIOCGIFMTU wrote.
    Ok(unsafe { req.ifr_ifru.ifru_mtu } as u32)
}

/// Checks the agent's `agent.info` against this build and returns it.
pub fn check_info(paths: &AgentPaths) -> Result<AgentInfo, AgentError> {
    let info =
        AgentInfo::read(paths).map_err(|e| AgentError::opening(paths, &paths.info_file(), &e))?;
    if info.fingerprint != fingerprint() {
        return Err(AgentError::Unusable {
            dir: paths.pin_dir.clone(),
            why: format!(
                "the agent runs another build of erar_ring ({}, this library is {}): restart \
                 it with this build's erarctl",
                info.fingerprint,
                fingerprint()
            ),
        });
    }
    Ok(info)
}

/// Refuses to go on unless `ifname` names an interface here.
pub fn require_iface(ifname: &str) -> Result<()> {
    if super::iface::if_index(ifname).is_err() {
        bail!(
            "no interface {ifname} in this network namespace{}",
            current_netns_name()
                .map(|n| format!(" ({n})"))
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// A job's side of a lease: asks the agent at `paths` for `slot` (whose
/// lock the caller holds). Returns the connection, which is the lease
/// (close it to give the slot back), and the slot's inner map fds. The
/// server is `agent::lease`.
pub fn request_lease(paths: &AgentPaths, slot: u32) -> Result<(UnixStream, [OwnedFd; 5])> {
    let socket = paths.lease_socket();
    let conn = UnixStream::connect(&socket)
        .with_context(|| format!("connecting to {}", socket.display()))?;
    (&conn)
        .write_all(format!("lease {slot}\n").as_bytes())
        .context("sending the request")?;
    let mut buf = [0u8; 256];
    let mut raw = [-1; 5];
    let (n, nfds) = conn
        .recv_with_fd(&mut buf, &mut raw)
        .context("receiving the lease")?;
    // SAFETY: the first nfds entries are fds the kernel just gave us.
    let got: Vec<OwnedFd> = raw[..nfds]
        .iter()
        .map(|&fd| unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
        .collect();
    let reply = String::from_utf8_lossy(&buf[..n]).trim().to_owned();
    ensure!(
        reply == "ok",
        "the agent refused slot {slot}: {}",
        reply.strip_prefix("refused ").unwrap_or(&reply)
    );
    let fds: [OwnedFd; 5] = got
        .try_into()
        .map_err(|v: Vec<OwnedFd>| anyhow::anyhow!("the agent sent {} fds, not 5", v.len()))?;
    Ok((conn, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_follow_the_namespace_rule() {
        let host = AgentPaths::for_netns(None, "eth0").unwrap();
        assert_eq!(host.pin_dir, Path::new("/sys/fs/bpf/liberar/eth0"));
        assert_eq!(host.run_dir, Path::new("/run/liberar/eth0"));
        assert_eq!(
            host.slot_lock(2),
            Path::new("/run/liberar/eth0/slot-2.lock")
        );
        let ns = AgentPaths::for_netns(Some("erar-h3"), "eth0").unwrap();
        assert_eq!(ns.pin_dir, Path::new("/run/liberar/bpffs/erar-h3/eth0"));
        assert_eq!(ns.run_dir, Path::new("/run/liberar/netns/erar-h3/eth0"));
        assert!(AgentPaths::for_netns(None, "../x").is_err());
        assert!(AgentPaths::for_netns(Some(".."), "eth0").is_err());
        assert!(AgentPaths::for_netns(None, "").is_err());
        // bpffs refuses dots.
        let vlan = AgentPaths::for_netns(Some("a.b"), "eth0.100").unwrap();
        assert_eq!(
            vlan.pin_dir,
            Path::new("/run/liberar/bpffs/a%2eb/eth0%2e100")
        );
        assert_eq!(vlan.run_dir, Path::new("/run/liberar/netns/a.b/eth0.100"));
        assert_eq!(from_bpffs_name(&bpffs_name("x%2e.y")), "x%2e.y");
        assert!(!bpffs_name("a.b%c").contains('.'));
    }

    #[test]
    fn info_round_trips() {
        let i = AgentInfo {
            iface: "eth0".into(),
            netns: "erar-h1".into(),
            ifindex: 7,
            group: "liberar".into(),
            gid: 1234,
            chunk_bytes: 3336,
            chunks_per_slot: 8192,
            prog_id: 99,
            fingerprint: fingerprint(),
            started: 1,
        };
        assert_eq!(AgentInfo::parse(&i.render()), i);
    }

    #[test]
    fn fingerprint_is_stable_hex() {
        assert_eq!(fingerprint(), fingerprint());
        assert_eq!(fingerprint().len(), 16);
    }
}
