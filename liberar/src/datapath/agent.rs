//! The node agent: `erarctl agent start` (run by root or systemd) loads this
//! host's datapath once, attaches it to the MPI interface with a bpf_link
//! and pins the link, the program and the maps with group permissions, so
//! that jobs of users in that group use the datapath unprivileged: they
//! open the pinned objects (BPF_OBJ_GET), mmap the maps and inject with
//! BPF_PROG_RUN, none of which needs a capability once the file permissions
//! allow it (see "Privilege" in docs/datapath.md for what was measured).
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
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, ensure, Context, Result};

use super::kernel::{slot::OUTER_MAPS, HostDatapath};
use super::wire;

pub mod lease;

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
fn bpffs_name(s: &str) -> String {
    s.replace('%', "%25").replace('.', "%2e")
}

fn from_bpffs_name(s: &str) -> String {
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
    const SOURCES: [&[u8]; 4] = [
        include_bytes!("../../../bpf/erar_ring.bpf.c"),
        include_bytes!("../../../bpf/include/erar_wire.h"),
        include_bytes!("../../../bpf/include/erar_parse.h"),
        include_bytes!("../../../bpf/include/erar_reduce.h"),
    ];
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
    fn render(&self) -> String {
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

/// Mounts a bpffs at `path` unless one is there. `may_mount`: this process
/// is in the mount namespace jobs see. Under `ip netns exec` (a named
/// network namespace the agent did not enter itself) it is not: that is a
/// private mount namespace, and a bpffs mounted there would vanish with the
/// agent, taking the pins along (measured).
fn ensure_bpffs(path: &Path, may_mount: bool) -> Result<()> {
    if is_bpffs(path) {
        return Ok(());
    }
    ensure!(
        may_mount,
        "{} is not a bpffs, and this process probably runs in the private mount namespace \
         of `ip netns exec`, where a mount would vanish with it, taking the pins along: use \
         `erarctl agent start --netns NAME ...` instead, or mount it first in the host's \
         namespace: mount -t bpf bpf {}",
        path.display(),
        path.display()
    );
    std::fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))?;
    let src = CString::new("bpf")?;
    let dst = CString::new(path.as_os_str().as_encoded_bytes())?;
    let opts = CString::new("mode=0755")?;
    // SAFETY: valid C strings; a plain mount(2).
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            src.as_ptr(),
            0,
            opts.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("mount -t bpf bpf {}", path.display()));
    }
    Ok(())
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

fn set_owner_mode(path: &Path, gid: u32, mode: u32) -> Result<()> {
    std::os::unix::fs::chown(path, Some(0), Some(gid))
        .with_context(|| format!("chown root:{gid} {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", path.display()))
}

fn mkdir_public(path: &Path) -> Result<()> {
    std::fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod 755 {}", path.display()))
}

/// What `erarctl agent start` is asked to do.
#[derive(Debug, Clone)]
pub struct StartOptions {
    pub ifname: String,
    /// Group whose members may use the datapath (`None`: root only).
    pub group: Option<String>,
    /// `None`: derived from the interface's MTU with the rings' own rule.
    pub chunk_bytes: Option<u32>,
    pub chunks_per_slot: u32,
    /// This process entered the network namespace itself ([`enter_netns`]),
    /// so its mount namespace is the caller's, where jobs look.
    pub entered_netns: bool,
}

/// What [`start`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartOutcome {
    Started(AgentInfo),
    /// The same datapath was already pinned and attached.
    AlreadyRunning(AgentInfo),
}

/// One agent's state, as `erarctl agent status` shows it.
#[derive(Debug, Clone)]
pub struct AgentStatus {
    pub paths: AgentPaths,
    pub info: Option<AgentInfo>,
    /// Pins present in the pin directory.
    pub pins: Vec<String>,
    /// The pinned link's interface index (0: the link is defunct, e.g. its
    /// interface is gone) and program id, if the link could be read.
    pub link: Option<(u32, u32)>,
    /// The pinned program's id.
    pub prog_id: Option<u32>,
    /// Per slot: pids holding its lock.
    pub slots: Vec<Vec<u32>>,
    /// The lease server's pid, if it runs.
    pub lease_server: Option<u32>,
}

impl AgentStatus {
    /// Complete, attached, and the program is the pinned one.
    pub fn healthy(&self) -> bool {
        ALL_PINS.iter().all(|p| self.pins.iter().any(|q| q == p))
            && self.info.is_some()
            && self.lease_server.is_some()
            && matches!((self.link, self.prog_id), (Some((ifx, lp)), Some(p)) if ifx != 0 && lp == p)
    }

    pub fn render(&self) -> String {
        let mut s = format!("agent {}: ", self.paths.where_());
        if self.healthy() {
            s += "running";
        } else if self.pins.is_empty() {
            s += "not running";
        } else {
            s += "BROKEN (stale or incomplete: `erarctl agent start` replaces it, `stop` removes it)";
        }
        s += &format!("\n  pins:  {}", self.paths.pin_dir.display());
        if !self.pins.is_empty() {
            s += &format!(" ({})", self.pins.join(" "));
        }
        s += &format!("\n  locks: {}", self.paths.run_dir.display());
        if let Some(i) = &self.info {
            s += &format!(
                "\n  group {} (gid {}), chunk_bytes {}, chunks_per_slot {}, ifindex {}, prog id {}, build {}{}",
                i.group,
                i.gid,
                i.chunk_bytes,
                i.chunks_per_slot,
                i.ifindex,
                i.prog_id,
                i.fingerprint,
                if i.fingerprint == fingerprint() { "" } else { " (NOT this build's)" }
            );
        }
        if let Some((ifx, pid)) = self.link {
            s += &format!("\n  link: ifindex {ifx}, prog id {pid}");
        }
        s += &match self.lease_server {
            Some(pid) => format!("\n  lease server: pid {pid}"),
            None => "\n  lease server: not running".to_owned(),
        };
        if !self.slots.is_empty() {
            let slots: Vec<String> = self
                .slots
                .iter()
                .enumerate()
                .map(|(n, h)| {
                    if h.is_empty() {
                        format!("{n}:free")
                    } else {
                        format!(
                            "{n}:pid {}",
                            h.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
                        )
                    }
                })
                .collect();
            s += &format!("\n  slots: {}", slots.join(" "));
        }
        s
    }
}

fn obj_get(path: &Path, flags: u32) -> std::io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(ErrorKind::InvalidInput))?;
    let opts = libbpf_sys::bpf_obj_get_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_obj_get_opts>() as _,
        file_flags: flags,
        ..Default::default()
    };
    // SAFETY: c is a valid path; opts is initialized.
    let fd = unsafe { libbpf_sys::bpf_obj_get_opts(c.as_ptr(), &opts) };
    if fd < 0 {
        return Err(std::io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: a new fd from BPF_OBJ_GET.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens a pinned object (BPF_OBJ_GET) read-write, or read-only.
pub fn open_pin(path: &Path, read_only: bool) -> std::io::Result<OwnedFd> {
    obj_get(
        path,
        if read_only {
            libbpf_sys::BPF_F_RDONLY
        } else {
            0
        },
    )
}

/// Id of the BPF program `fd`.
pub fn prog_id(fd: &OwnedFd) -> std::io::Result<u32> {
    let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: info is len bytes.
    let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(-rc));
    }
    Ok(info.id)
}

/// (ifindex, prog id) of XDP link `fd`; ifindex 0 once the link is defunct.
pub fn xdp_link_info(fd: &OwnedFd) -> std::io::Result<(u32, u32)> {
    let mut info: libbpf_sys::bpf_link_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_link_info>() as u32;
    // SAFETY: info is len bytes.
    let rc = unsafe { libbpf_sys::bpf_link_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(-rc));
    }
    // SAFETY: an XDP link fills the xdp member.
    Ok((unsafe { info.__bindgen_anon_1.xdp.ifindex }, info.prog_id))
}

/// Id of the XDP program attached to `ifindex` in this namespace (0: none).
/// Netlink; no privilege needed.
pub fn attached_xdp_prog(ifindex: u32) -> std::io::Result<u32> {
    let mut id = 0u32;
    // SAFETY: writes id.
    let rc = unsafe { libbpf_sys::bpf_xdp_query_id(ifindex as i32, 0, &mut id) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(-rc));
    }
    Ok(id)
}

/// The state of the agent at `paths` (as root: reads the link pin too).
pub fn status(paths: &AgentPaths) -> AgentStatus {
    let mut pins: Vec<String> = std::fs::read_dir(&paths.pin_dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    pins.sort();
    // Links take no BPF_F_RDONLY (EINVAL).
    let link = open_pin(&paths.pin(PIN_LINK), false)
        .ok()
        .and_then(|fd| xdp_link_info(&fd).ok());
    let prog_id = open_pin(&paths.pin(PIN_PROG), true)
        .ok()
        .and_then(|fd| prog_id(&fd).ok());
    let info = AgentInfo::read(paths).ok();
    let slots = if paths.run_dir.is_dir() {
        (0..wire::ERAR_MAX_SLOTS)
            .map(|s| lock_holders(&paths.slot_lock(s)))
            .collect()
    } else {
        Vec::new()
    };
    AgentStatus {
        paths: paths.clone(),
        info,
        pins,
        link,
        prog_id,
        slots,
        lease_server: lease_server_pid(paths),
    }
}

/// Every agent directory on this machine (both layouts).
pub fn all_agents() -> Vec<AgentPaths> {
    let mut out = Vec::new();
    let list = |dir: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.path().is_dir())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .filter(|n| !n.contains("%tmp"))
                    .map(|n| from_bpffs_name(&n))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    for ifname in list(Path::new("/sys/fs/bpf/liberar")) {
        if let Ok(p) = AgentPaths::for_netns(None, &ifname) {
            out.push(p);
        }
    }
    for ns in list(Path::new("/run/liberar/bpffs")) {
        for ifname in list(&Path::new("/run/liberar/bpffs").join(bpffs_name(&ns))) {
            if let Ok(p) = AgentPaths::for_netns(Some(&ns), &ifname) {
                out.push(p);
            }
        }
    }
    out
}

/// Removes a pin directory (unpinning everything in it; the kernel frees
/// each object once no process holds it any more).
fn remove_pin_dir(dir: &Path) -> Result<bool> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    for e in entries.flatten() {
        std::fs::remove_file(e.path())
            .with_context(|| format!("unpinning {}", e.path().display()))?;
    }
    std::fs::remove_dir(dir).with_context(|| format!("removing {}", dir.display()))?;
    Ok(true)
}

/// Name of a temporary pin directory (`<if>%tmp<pid>`: `%t` never occurs
/// in an escaped name).
fn tmp_dir_name(paths: &AgentPaths, pid: u32) -> String {
    format!("{}%tmp{pid}", bpffs_name(&paths.ifname))
}

/// Temporary pin directories of starts that never finished.
fn stale_tmp_dirs(paths: &AgentPaths) -> Vec<PathBuf> {
    let Some(parent) = paths.pin_dir.parent() else {
        return Vec::new();
    };
    let prefix = format!("{}%tmp", bpffs_name(&paths.ifname));
    std::fs::read_dir(parent)
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.starts_with(&prefix))
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Unpins everything of the agent at `paths` and removes its lock files.
/// Jobs still running keep the objects they hold until they exit; the XDP
/// program is detached at once (the link pin was its last reference).
/// Returns whether there was anything to remove.
pub fn stop(paths: &AgentPaths) -> Result<bool> {
    let mut removed = stop_lease_server(paths);
    removed |= remove_pin_dir(&paths.pin_dir)?;
    for tmp in stale_tmp_dirs(paths) {
        removed |= remove_pin_dir(&tmp)?;
    }
    match std::fs::remove_dir_all(&paths.run_dir) {
        Ok(()) => removed = true,
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", paths.run_dir.display())),
    }
    // A named namespace's own directories, once empty (remove_dir refuses
    // otherwise).
    if paths.netns.is_some() {
        for dir in [paths.pin_dir.parent(), paths.run_dir.parent()]
            .into_iter()
            .flatten()
        {
            let _ = std::fs::remove_dir(dir);
        }
    }
    Ok(removed)
}

/// Loads, attaches and pins the datapath of `opts.ifname` in this network
/// namespace (see the module docs). Idempotent: an agent already running
/// with the same parameters and this build is left alone; a stale or
/// different one (dead link, other build, other group or chunk size) is
/// replaced — jobs using the old one fall back to MPI.
pub fn start(opts: &StartOptions) -> Result<StartOutcome> {
    // SAFETY: geteuid has no preconditions.
    ensure!(
        unsafe { libc::geteuid() } == 0,
        "the agent needs root (loading and attaching XDP, pinning)"
    );
    let paths = AgentPaths::current(&opts.ifname)?;
    let ifindex = super::kernel::if_index(&opts.ifname)?;
    let mtu = if_mtu(&opts.ifname)?;
    let chunk_bytes = match opts.chunk_bytes {
        Some(c) => c,
        None => super::ring::agent_chunk_bytes(mtu),
    };
    ensure!(
        (wire::ERAR_MIN_CHUNK_BYTES..=wire::ERAR_MAX_CHUNK_BYTES).contains(&chunk_bytes)
            && chunk_bytes % wire::ERAR_CHUNK_ALIGN == 0,
        "chunk size {chunk_bytes} (MTU {mtu}) is not usable: it must be a multiple of {} in \
         {}..={}",
        wire::ERAR_CHUNK_ALIGN,
        wire::ERAR_MIN_CHUNK_BYTES,
        wire::ERAR_MAX_CHUNK_BYTES
    );
    let (gid, group) = match &opts.group {
        Some(g) => (group_id(g)?, g.clone()),
        None => (0, "root".to_owned()),
    };
    let want = AgentInfo {
        iface: opts.ifname.clone(),
        netns: paths.netns.clone().unwrap_or_else(|| "-".into()),
        ifindex,
        group: group.clone(),
        gid,
        chunk_bytes,
        chunks_per_slot: opts.chunks_per_slot,
        prog_id: 0,
        fingerprint: fingerprint(),
        started: 0,
    };

    let current = status(&paths);
    if current.healthy() {
        if let Some(info) = &current.info {
            let same = AgentInfo {
                prog_id: info.prog_id,
                started: info.started,
                ..want.clone()
            };
            if *info == same && current.link.map(|l| l.0) == Some(ifindex) {
                return Ok(StartOutcome::AlreadyRunning(info.clone()));
            }
        }
    }
    if !current.pins.is_empty() || paths.run_dir.exists() || !stale_tmp_dirs(&paths).is_empty() {
        log::info!("replacing the agent at {}", paths.pin_dir.display());
        stop(&paths)?;
    }

    ensure_bpffs(&paths.bpffs, opts.entered_netns || paths.netns.is_none())?;
    let parent = paths
        .pin_dir
        .parent()
        .ok_or_else(|| anyhow!("{} has no parent", paths.pin_dir.display()))?;
    mkdir_public(parent)?;
    // Pins go to a temporary directory, renamed into place once complete:
    // a job never sees half an agent.
    let tmp = parent.join(tmp_dir_name(&paths, std::process::id()));
    let _ = remove_pin_dir(&tmp);
    std::fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let result = (|| -> Result<AgentInfo> {
        let dir_mode = if opts.group.is_some() { 0o750 } else { 0o700 };
        set_owner_mode(&tmp, gid, dir_mode)?;
        let pinned =
            HostDatapath::load_and_pin(&opts.ifname, chunk_bytes, opts.chunks_per_slot, &tmp)?;
        let (rw, ro) = if opts.group.is_some() {
            (0o660, 0o640)
        } else {
            (0o600, 0o600)
        };
        set_owner_mode(&tmp.join(PIN_PROG), gid, rw)?;
        // Every slot's state: root's (the lease server's) alone.
        for m in OUTER_MAPS {
            set_owner_mode(&tmp.join(m), 0, 0o600)?;
        }
        set_owner_mode(&tmp.join(PIN_STATS), gid, ro)?;
        set_owner_mode(&tmp.join(PIN_RODATA), gid, ro)?;
        // Any holder of a link fd can detach it: root only.
        set_owner_mode(&tmp.join(PIN_LINK), 0, 0o600)?;

        // Lock files and info first, then the pins appear.
        let run_parent = paths
            .run_dir
            .parent()
            .ok_or_else(|| anyhow!("{} has no parent", paths.run_dir.display()))?;
        mkdir_public(run_parent)?;
        std::fs::create_dir(&paths.run_dir)
            .with_context(|| format!("creating {}", paths.run_dir.display()))?;
        // Not group-writable: members cannot remove or replace a lock file
        // (which would let two processes "hold" one slot).
        set_owner_mode(&paths.run_dir, gid, dir_mode)?;
        for s in 0..wire::ERAR_MAX_SLOTS {
            let p = paths.slot_lock(s);
            File::create(&p).with_context(|| format!("creating {}", p.display()))?;
            set_owner_mode(&p, gid, ro)?;
        }
        let info = AgentInfo {
            prog_id: pinned.prog_id,
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            ..want.clone()
        };
        let info_tmp = paths.run_dir.join(".agent.info.tmp");
        let mut f =
            File::create(&info_tmp).with_context(|| format!("creating {}", info_tmp.display()))?;
        f.write_all(info.render().as_bytes())?;
        drop(f);
        set_owner_mode(&info_tmp, gid, ro)?;
        std::fs::rename(&info_tmp, paths.info_file())
            .with_context(|| format!("creating {}", paths.info_file().display()))?;
        std::fs::rename(&tmp, &paths.pin_dir).with_context(|| {
            format!("renaming {} to {}", tmp.display(), paths.pin_dir.display())
        })?;
        spawn_lease_server(&paths)?;
        Ok(info)
    })();
    match result {
        Ok(info) => Ok(StartOutcome::Started(info)),
        Err(e) => {
            let _ = remove_pin_dir(&tmp);
            let _ = std::fs::remove_dir_all(&paths.run_dir);
            Err(e)
        }
    }
}

/// Starts the lease server (`erarctl agent serve`, this executable) for the
/// agent at `paths`, detached in its own session, and waits until it
/// listens. It runs in this process's network namespace.
fn spawn_lease_server(paths: &AgentPaths) -> Result<()> {
    use std::os::unix::process::CommandExt as _;
    let exe = std::env::current_exe().context("locating erarctl")?;
    let log = File::create(paths.run_dir.join("lease.log")).context("creating lease.log")?;
    let mut cmd = std::process::Command::new(&exe);
    cmd.args(["agent", "serve", "--iface", &paths.ifname])
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: setsid is async-signal-safe; nothing else runs in the child.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {} agent serve", exe.display()))?;
    let socket = paths.lease_socket();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if lease::pid_file(paths).exists() && socket.exists() {
            // Reaped by init once we exit (it is in its own session).
            std::mem::forget(child);
            return Ok(());
        }
        if let Ok(Some(st)) = child.try_wait() {
            let log = std::fs::read_to_string(paths.run_dir.join("lease.log")).unwrap_or_default();
            bail!("the lease server exited at once ({st}): {}", log.trim());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    bail!("the lease server did not start listening within 5 s")
}

/// The running lease server's pid, if any.
pub fn lease_server_pid(paths: &AgentPaths) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(lease::pid_file(paths))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let serving = cmdline.split(|b| *b == 0).any(|arg| arg == b"serve");
    serving.then_some(pid)
}

/// Stops the lease server; whether one ran. Leases end with it (the jobs'
/// fds stay valid, but the datapath goes away with the pins anyway).
fn stop_lease_server(paths: &AgentPaths) -> bool {
    let Some(pid) = lease_server_pid(paths) else {
        return false;
    };
    // SAFETY: plain kill(2).
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while Path::new(&format!("/proc/{pid}")).exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    true
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
    if super::kernel::if_index(ifname).is_err() {
        bail!(
            "no interface {ifname} in this network namespace{}",
            current_netns_name()
                .map(|n| format!(" ({n})"))
                .unwrap_or_default()
        );
    }
    Ok(())
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
