//! This host's XDP datapath: loading, attaching, and driving it (see
//! docs/datapath.md for the contract and bpf/erar_ring.bpf.c for the kernel
//! side).
//!
//! One [`HostDatapath`] per process and interface. It owns:
//! * the program: either the loaded `erar_ring` skeleton, with `erar_xdp`
//!   attached to the MPI interface through a bpf_link (the kernel detaches
//!   it when the last holder dies, even on `kill -9`) —
//!   [`HostDatapath::attach`], needs CAP_BPF and CAP_NET_ADMIN; or another
//!   process's, adopted ([`HostDatapath::adopt`], root, see `kernel/adopt.rs`); or
//!   the node agent's pinned one ([`HostDatapath::open_pinned`], no
//!   capability needed, see [`super::agent`]);
//! * the slots it holds (`kernel/slot.rs`): each slot's own maps, mmapped (its
//!   buffer of `chunks_per_slot * chunk_bytes` bytes, its `slot_ctl`, chunk
//!   state words and resend list) and its completion ring buffer. All four
//!   on its own or an adopted program; on the agent's, the ones its rings
//!   leased ([`HostDatapath::lease`]).
//!
//! Per operation: [`HostDatapath::arm`] → (barrier across hosts, done by the
//! caller) → [`HostDatapath::inject`] → [`HostDatapath::wait`] (which NACKs
//! what it misses when progress pauses), and if that is not enough:
//! [`HostDatapath::stages`] (every host) → [`HostDatapath::resend`] (on each
//! predecessor) → wait again.

use std::ffi::CString;
use std::mem::{ManuallyDrop, MaybeUninit};
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, MapHandle, OpenObject};
use parking_lot::{Mutex, RwLock};
use std::sync::Arc;

use super::agent::{self, AgentError, AgentPaths};
use super::lanes::Lanes;
use super::wire;

#[allow(clippy::all, clippy::pedantic, unsafe_op_in_unsafe_fn, dead_code)]
#[allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/erar_ring.skel.rs"));
}
use skel::{ErarRingSkel, ErarRingSkelBuilder};

mod adopt;
pub mod slot;
use adopt::AdoptedDatapath;
use slot::SlotMaps;

const MAX_SLOTS: u32 = wire::ERAR_MAX_SLOTS;
const PAYLOAD_OFF: usize = wire::ERAR_PAYLOAD_OFF as usize;

/// Where this host sits in one ring, and where it sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotRoute {
    pub self_mac: [u8; 6],
    pub self_ip: Ipv4Addr,
    /// The next host of the ring (position `(ring_pos + 1) % ring_size`).
    pub next_mac: [u8; 6],
    pub next_ip: Ipv4Addr,
    /// The previous host of the ring, where this host's NACKs go.
    pub prev_mac: [u8; 6],
    pub prev_ip: Ipv4Addr,
    pub ring_pos: u32,
    pub ring_size: u32,
    pub comm_id: u32,
    /// Random per ring: frames of another ring (or a stale one) with the same
    /// slot and comm_id are dropped.
    pub token: u32,
}

/// How [`HostDatapath::inject`] paces its frames.
///
/// Every hop of a frame goes through a veth ptr_ring of 256 entries (or a
/// NIC ring). Within one BPF_PROG_RUN call the kernel injects `batch` frames,
/// flushes them, and runs the pending softirqs (the receiving hosts' XDP)
/// before the next batch, which keeps the rings short. Each call has a large
/// fixed cost, though (tens of ms: page-pool setup and teardown), so frames
/// should go out in as few calls as possible: `burst` frames per call. With a
/// finite `window`, a call only starts while the estimate of frames in
/// flight (`n * injected - done`, all hosts assumed to inject at the same
/// pace) is at most `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectPacing {
    /// Frames per batch inside one call (BPF_PROG_RUN's batch_size, 1..=256).
    pub batch: u32,
    /// Frames per BPF_PROG_RUN call; `u32::MAX`: all of them in one call.
    pub burst: u32,
    /// Frames in flight over the whole ring before a call may start;
    /// `u32::MAX` disables the check.
    pub window: u32,
    /// If `done` does not move for this long while inject() waits for the
    /// window, the frames in flight are presumed lost and the window opens.
    pub quiet: Duration,
}

impl Default for InjectPacing {
    fn default() -> Self {
        // Measured on the 4-host veth test bed (16 MiB, 3336-B chunks): no
        // loss in 20 runs at 32/32/128, while unpaced injection or bursts of
        // 64 into a window of 256 lost frames at the veth rings in 5-10% of
        // the runs, at no better speed.
        InjectPacing {
            batch: 32,
            burst: 32,
            window: 128,
            quiet: Duration::from_millis(3),
        }
    }
}

/// How [`HostDatapath::wait`] repairs losses and when it gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Patience {
    /// The NACK period (see [`HostDatapath::wait`]); `None`: no NACKs.
    pub nack_after: Option<Duration>,
    /// After a pause this long, stop waiting.
    pub quiet: Duration,
}

/// A pause of progress this many NACK periods long NACKs every missing
/// chunk, also those above the frontier (see [`HostDatapath::wait`]).
const TAIL_NACK_PERIODS: u32 = 2;

/// What [`HostDatapath::wait`] saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Waited {
    /// Every chunk holds its final value on this host.
    pub complete: bool,
    /// NACK bursts sent, and chunks they asked about.
    pub nacks: u32,
    pub nack_chunks: u64,
}

/// Summed per-CPU counters of `erar_xdp` (receive and inject paths) on this host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelStats {
    /// RS frames received and reduced here.
    pub rx_rs: u64,
    /// AG frames received and stored here.
    pub rx_ag: u64,
    /// RS frames that got their last contribution here (became AG).
    pub finished: u64,
    /// Frames forwarded with XDP_TX.
    pub tx: u64,
    /// AG frames that ended their trip here.
    pub ag_last: u64,
    /// Operations completed (ring-buffer events posted).
    pub complete: u64,
    /// Frames built by the inject path (BPF_PROG_RUN).
    pub injected: u64,
    pub drop_short: u64,
    pub drop_magic: u64,
    pub drop_version: u64,
    pub drop_slot: u64,
    pub drop_comm: u64,
    pub drop_token: u64,
    /// Slot not armed, or the frame's seq is not the armed one.
    pub drop_seq: u64,
    pub drop_op: u64,
    pub drop_chunk: u64,
    pub drop_step: u64,
    pub drop_ringbuf: u64,
    pub inject_err: u64,
    /// Duplicates dropped: the chunk's stage had already moved on.
    pub dup: u64,
    /// Frames impossible in their chunk's stage (forged or misrouted).
    pub drop_state: u64,
    /// Frames re-sent after a loss.
    pub resent: u64,
    /// Re-sends asked for with nothing stable to send yet.
    pub resend_skip: u64,
    /// Frames whose length, IPv4/UDP length fields or reserved bytes are
    /// not what a sender builds.
    pub drop_malformed: u64,
    /// NACKs sent to the predecessor (frames this host waited for).
    pub nack_sent: u64,
    /// NACKs from the successor answered with the frame they named.
    pub nack_served: u64,
    /// NACKs naming a frame this host did not last send (the loss was
    /// further up the ring, or the frame was only late).
    pub nack_skip: u64,
    /// Liveness probes of this host's rings answered.
    pub ping: u64,
}

impl KernelStats {
    fn from_counters(c: &[u64]) -> KernelStats {
        let g = |i: wire::erar_stat| c.get(i as usize).copied().unwrap_or(0);
        KernelStats {
            rx_rs: g(wire::ERAR_STAT_RX_RS),
            rx_ag: g(wire::ERAR_STAT_RX_AG),
            finished: g(wire::ERAR_STAT_FINISHED),
            tx: g(wire::ERAR_STAT_TX),
            ag_last: g(wire::ERAR_STAT_AG_LAST),
            complete: g(wire::ERAR_STAT_COMPLETE),
            injected: g(wire::ERAR_STAT_INJECTED),
            drop_short: g(wire::ERAR_STAT_DROP_SHORT),
            drop_magic: g(wire::ERAR_STAT_DROP_MAGIC),
            drop_version: g(wire::ERAR_STAT_DROP_VERSION),
            drop_slot: g(wire::ERAR_STAT_DROP_SLOT),
            drop_comm: g(wire::ERAR_STAT_DROP_COMM),
            drop_token: g(wire::ERAR_STAT_DROP_TOKEN),
            drop_seq: g(wire::ERAR_STAT_DROP_SEQ),
            drop_op: g(wire::ERAR_STAT_DROP_OP),
            drop_chunk: g(wire::ERAR_STAT_DROP_CHUNK),
            drop_step: g(wire::ERAR_STAT_DROP_STEP),
            drop_ringbuf: g(wire::ERAR_STAT_DROP_RINGBUF),
            inject_err: g(wire::ERAR_STAT_INJECT_ERR),
            dup: g(wire::ERAR_STAT_DUP),
            drop_state: g(wire::ERAR_STAT_DROP_STATE),
            resent: g(wire::ERAR_STAT_RESENT),
            resend_skip: g(wire::ERAR_STAT_RESEND_SKIP),
            drop_malformed: g(wire::ERAR_STAT_DROP_MALFORMED),
            nack_sent: g(wire::ERAR_STAT_NACK_SENT),
            nack_served: g(wire::ERAR_STAT_NACK_SERVED),
            nack_skip: g(wire::ERAR_STAT_NACK_SKIP),
            ping: g(wire::ERAR_STAT_PING),
        }
    }

    /// Frames dropped for any validation reason (not counting AG frames that
    /// simply finished their trip, nor duplicates).
    pub fn drops(&self) -> u64 {
        self.drop_short
            + self.drop_magic
            + self.drop_version
            + self.drop_slot
            + self.drop_comm
            + self.drop_token
            + self.drop_seq
            + self.drop_op
            + self.drop_chunk
            + self.drop_step
            + self.drop_state
            + self.drop_malformed
    }
}

/// A shared read-write mapping of a BPF_F_MMAPABLE map.
struct MapMmap {
    ptr: NonNull<u8>,
    len: usize,
}

impl MapMmap {
    fn new(fd: i32, len: usize, what: &str) -> Result<MapMmap> {
        // SAFETY: a fresh shared mapping of an mmapable map fd; the kernel
        // checks len against the map size.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("mmap of map {what} ({len} bytes)"));
        }
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| anyhow!("mmap of {what} returned NULL"))?;
        Ok(MapMmap { ptr, len })
    }
}

impl Drop for MapMmap {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what new() mapped.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The datapath of this host on one interface. See the module docs.
pub struct HostDatapath {
    // Field order is drop order: the slots' mappings go before the program
    // and maps they came from.
    /// The slots this process holds (their inner maps, mapped): all four
    /// on a program of its own or adopted; on the agent's, those it leased.
    /// A slot is used only by the ring that holds it, and released by it.
    slots: [RwLock<Option<Arc<SlotMaps>>>; MAX_SLOTS as usize],
    backing: Backing,
    /// Serializes this process's BPF_PROG_RUN calls (they drive the slots'
    /// inject fields) and holds their pacing and input frame.
    inject: Mutex<Injector>,
    ifname: String,
    ifindex: u32,
    chunk_bytes: u32,
    chunks_per_slot: u32,
}

/// State of the inject path, under [`HostDatapath::inject`]'s mutex.
struct Injector {
    pacing: InjectPacing,
    /// BPF_PROG_RUN's input frame. erar_inject writes every header byte and
    /// the payload; it only reads erar_hdr.slot, which names the slot.
    frame: Box<[u8]>,
}

/// Offsets of erar_hdr.slot and erar_hdr.token in a frame.
const HDR_SLOT_OFF: usize = wire::ERAR_L2L4_LEN as usize + 24;
const HDR_TOKEN_OFF: usize = wire::ERAR_L2L4_LEN as usize + 12;

// SAFETY: the raw pointers are to mappings and to the libbpf object owned by
// this value; shared mutation goes through atomics (slot_ctl), the `inject`
// mutex (inject fields of slot_ctl, resend lists) or the ring-buffer mutex. The slot buffers are handed out as
// raw pointers: callers coordinate their use with arm/wait.
unsafe impl Send for HostDatapath {}
unsafe impl Sync for HostDatapath {}

impl HostDatapath {
    /// Loads the datapath, sizes its slot buffers to `chunks_per_slot` chunks
    /// of `chunk_bytes` bytes per slot, and attaches `erar_xdp` to `ifname`
    /// (native XDP, through a bpf_link). Needs CAP_BPF and CAP_NET_ADMIN.
    pub fn attach(ifname: &str, chunk_bytes: u32, chunks_per_slot: u32) -> Result<Self> {
        check_geometry(chunk_bytes, chunks_per_slot)?;
        let ifindex = if_index(ifname)?;
        let own = OwnDatapath::load(chunk_bytes, chunks_per_slot, ifname, ifindex)?;
        let mut dp = Self::assemble(
            Backing::Own(own),
            ifname,
            ifindex,
            chunk_bytes,
            chunks_per_slot,
        );
        // Every slot is ours: create and install its maps.
        // `dp` drops (detaching) if this fails.
        for slot in 0..MAX_SLOTS {
            let fds = SlotMaps::create(chunk_bytes, chunks_per_slot)?;
            slot::install(dp.outer_fds()?, slot, fds.each_ref().map(|f| f.as_fd()))?;
            dp.hold(slot, SlotMaps::map(fds, chunk_bytes, chunks_per_slot)?);
        }
        // Complete: other processes may share it from now on.
        if let Backing::Own(own) = &mut dp.backing {
            match adopt::publish(own.prog_id) {
                Ok(()) => own.published = true,
                Err(e) => log::debug!(
                    "liberar: erar_xdp on {ifname} cannot be shared with other jobs: {e:#}"
                ),
            }
        }
        log::debug!("erar_xdp attached to {ifname} (ifindex {ifindex}): chunk_bytes {chunk_bytes}, chunks_per_slot {chunks_per_slot}");
        Ok(dp)
    }

    /// Opens the node agent's datapath on `ifname` (pinned by `erarctl agent
    /// start`, see [`super::agent`]): BPF_OBJ_GET of its program and of its
    /// read-only maps — nothing is loaded or attached, and no capability is
    /// needed, only the file permissions of the pins; no slot is held until
    /// a ring leases one ([`Self::lease`]). The
    /// geometry (chunk_bytes, chunks_per_slot) is the agent's, read from
    /// the program's own constants. Slots are shared with every other
    /// process using the agent: take a slot's lock
    /// ([`Self::slot_lock_path`]), then lease it, before configuring it.
    pub fn open_pinned(ifname: &str) -> Result<Self, AgentError> {
        let paths = AgentPaths::current(ifname).map_err(|e| AgentError::Unusable {
            dir: "?".into(),
            why: format!("{e:#}"),
        })?;
        let unusable = |why: String| AgentError::Unusable {
            dir: paths.pin_dir.clone(),
            why,
        };
        if let Err(e) = std::fs::metadata(&paths.pin_dir) {
            return Err(AgentError::opening(&paths, &paths.pin_dir, &e));
        }
        let open = |name: &str, read_only: bool| {
            let path = paths.pin(name);
            agent::open_pin(&path, read_only).map_err(|e| AgentError::opening(&paths, &path, &e))
        };
        let map = |name: &str, read_only: bool| -> Result<MapHandle, AgentError> {
            let path = paths.pin(name);
            let flags = if read_only {
                libbpf_sys::BPF_F_RDONLY
            } else {
                0
            };
            MapHandle::from_pinned_path_with_file_flags(&path, flags).map_err(|e| {
                let kind = match e.kind() {
                    libbpf_rs::ErrorKind::PermissionDenied => std::io::ErrorKind::PermissionDenied,
                    libbpf_rs::ErrorKind::NotFound => std::io::ErrorKind::NotFound,
                    _ => std::io::ErrorKind::Other,
                };
                AgentError::opening(&paths, &path, &std::io::Error::new(kind, e.to_string()))
            })
        };
        let prog = open(agent::PIN_PROG, false)?;
        let info = agent::check_info(&paths)?;
        let ifindex = if_index(ifname).map_err(|e| unusable(format!("{e:#}")))?;

        // The program must be the one attached to this interface: the
        // agent's link is not readable here (any holder of a link fd could
        // detach it), so ask the kernel what runs on the interface.
        let id = agent::prog_id(&prog).map_err(|e| unusable(format!("program info: {e}")))?;
        let attached = agent::attached_xdp_prog(ifindex)
            .map_err(|e| unusable(format!("XDP query on {ifname}: {e}")))?;
        if attached != id {
            return Err(unusable(format!(
                "its erar_xdp (id {id}) is not what runs on {ifname} (XDP program id \
                 {attached}): the agent is stale, restart it"
            )));
        }

        let rodata = map(agent::PIN_RODATA, true)?;
        let (chunk_bytes, chunks_per_slot) =
            geometry_of(&rodata).map_err(|e| unusable(format!("{e:#}")))?;
        if (info.chunk_bytes, info.chunks_per_slot) != (chunk_bytes, chunks_per_slot) {
            return Err(unusable(format!(
                "agent.info says {}x{} but the program has {chunk_bytes}x{chunks_per_slot}",
                info.chunk_bytes, info.chunks_per_slot
            )));
        }

        let stats = map(agent::PIN_STATS, true)?;
        slot::check_map(
            stats.as_fd(),
            "stats",
            libbpf_sys::BPF_MAP_TYPE_PERCPU_ARRAY,
            std::mem::size_of::<wire::erar_stats>() as u32,
            1,
        )
        .map_err(|e| unusable(format!("{e:#}")))?;
        // Slots come from the agent, one lease each (see Self::claim).
        let socket = paths.lease_socket();
        if let Err(e) = std::fs::metadata(&socket) {
            return Err(AgentError::opening(&paths, &socket, &e));
        }
        log::debug!(
            "liberar: using the agent's datapath on {ifname} ({}): chunk_bytes {chunk_bytes}, \
             chunks_per_slot {chunks_per_slot}",
            paths.pin_dir.display()
        );
        Ok(Self::assemble(
            Backing::Pinned(PinnedDatapath {
                prog,
                stats,
                _rodata: rodata,
                paths,
            }),
            ifname,
            ifindex,
            chunk_bytes,
            chunks_per_slot,
        ))
    }

    /// For the node agent: loads and attaches exactly as [`Self::attach`]
    /// does, pins the program, the link and every map into `dir` (an
    /// existing directory in a bpffs; names in [`super::agent`]) and lets
    /// go of them: the pins keep the datapath attached after this process
    /// exits, until they are removed.
    pub fn load_and_pin(
        ifname: &str,
        chunk_bytes: u32,
        chunks_per_slot: u32,
        dir: &Path,
    ) -> Result<PinnedIds> {
        check_geometry(chunk_bytes, chunks_per_slot)?;
        let ifindex = if_index(ifname)?;
        let mut own = OwnDatapath::load(chunk_bytes, chunks_per_slot, ifname, ifindex)?;
        let pin = |what: &str, r: libbpf_rs::Result<()>| {
            r.with_context(|| format!("pinning {what} in {}", dir.display()))
        };
        let skel = &mut *own.skel;
        pin(
            "erar_xdp",
            skel.progs.erar_xdp.pin(dir.join(agent::PIN_PROG)),
        )?;
        // The arrays of maps: the agent's lease server installs each
        // lease's inner maps through them (root only).
        let m = &mut skel.maps;
        for (name, map) in slot::OUTER_MAPS.iter().zip([
            &mut m.slot_bufs,
            &mut m.slot_ctls,
            &mut m.chunk_states,
            &mut m.resends,
            &mut m.slot_events,
        ]) {
            pin(name, map.pin(dir.join(name)))?;
        }
        pin("stats", skel.maps.stats.pin(dir.join(agent::PIN_STATS)))?;
        pin("rodata", skel.maps.rodata.pin(dir.join(agent::PIN_RODATA)))?;
        let prog_fd = skel.progs.erar_xdp.as_fd().try_clone_to_owned()?;
        let link = own
            .link
            .as_mut()
            .ok_or_else(|| anyhow!("no link after attaching"))?;
        pin("link", link.pin(dir.join(agent::PIN_LINK)))?;
        let ids = PinnedIds {
            prog_id: agent::prog_id(&prog_fd).context("reading erar_xdp's id")?,
        };
        // Closing our fds now leaves the pins as the only references (the
        // link is not detached: libbpf only closes its fd).
        drop(own);
        Ok(ids)
    }

    fn assemble(
        backing: Backing,
        ifname: &str,
        ifindex: u32,
        chunk_bytes: u32,
        chunks_per_slot: u32,
    ) -> Self {
        HostDatapath {
            slots: Default::default(),
            backing,
            inject: Mutex::new(Injector {
                pacing: InjectPacing::default(),
                frame: vec![0u8; PAYLOAD_OFF + chunk_bytes as usize].into_boxed_slice(),
            }),
            ifname: ifname.to_string(),
            ifindex,
            chunk_bytes,
            chunks_per_slot,
        }
    }

    /// The lock file a process holds (flock) while one of its rings uses
    /// `slot`: the agent's, or those of the process-owned program, which
    /// other jobs may share ([`Self::adopt`]). `None`: our own program,
    /// which could not be published for sharing, so its slots are ours.
    pub fn slot_lock_path(&self, slot: u32) -> Option<std::path::PathBuf> {
        let lock = |id| adopt::own_dir(id).join(format!("slot-{slot}.lock"));
        match &self.backing {
            Backing::Pinned(p) => Some(p.paths.slot_lock(slot)),
            Backing::Own(o) => o.published.then(|| lock(o.prog_id)),
            Backing::Adopted(a) => Some(lock(a.prog_id)),
        }
    }

    /// The node agent's paths, for a pinned datapath: slots are claimed
    /// through their lock files there.
    pub fn agent_paths(&self) -> Option<&AgentPaths> {
        match &self.backing {
            Backing::Pinned(p) => Some(&p.paths),
            Backing::Own(_) | Backing::Adopted(_) => None,
        }
    }

    /// `erar_xdp`'s program fd, for tools that run frames through it with
    /// BPF_PROG_RUN themselves (the frame-parser fuzzer).
    pub fn prog_fd(&self) -> BorrowedFd<'_> {
        match &self.backing {
            Backing::Own(o) => o.skel.progs.erar_xdp.as_fd(),
            Backing::Pinned(p) => p.prog.as_fd(),
            Backing::Adopted(a) => a.prog.as_fd(),
        }
    }

    fn stats_map(&self) -> &dyn MapCore {
        match &self.backing {
            Backing::Own(o) => &o.skel.maps.stats,
            Backing::Pinned(p) => &p.stats,
            Backing::Adopted(a) => &a.stats,
        }
    }

    pub fn ifname(&self) -> &str {
        &self.ifname
    }

    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    pub fn chunk_bytes(&self) -> u32 {
        self.chunk_bytes
    }

    pub fn chunks_per_slot(&self) -> u32 {
        self.chunks_per_slot
    }

    /// Bytes of one slot buffer: `chunks_per_slot * chunk_bytes`.
    pub fn slot_bytes(&self) -> usize {
        self.chunks_per_slot as usize * self.chunk_bytes as usize
    }

    /// Start of slot `slot`'s buffer ([`Self::slot_bytes`] contiguous bytes,
    /// chunk c at `c * chunk_bytes`). The XDP program reads it while an
    /// operation is armed and writes results into it: write the
    /// contribution before [`Self::arm`], read results after
    /// [`Self::wait`] returned true. Valid while this process holds the
    /// slot.
    ///
    /// # Panics
    /// If this process does not hold `slot`.
    pub fn slot_buffer(&self, slot: u32) -> *mut u8 {
        match self.slot_maps(slot) {
            Ok(m) => m.buf(),
            Err(e) => panic!("{e:#}"),
        }
    }

    /// The maps of a slot this process holds, once per operation: every
    /// method below keeps the Arc while it uses the mappings, so they stay
    /// valid even if the slot were released meanwhile (only the ring that
    /// holds a slot releases it, after its last use).
    fn slot_maps(&self, slot: u32) -> Result<Arc<SlotMaps>> {
        ensure!(
            slot < MAX_SLOTS,
            "slot {slot} out of range (max {MAX_SLOTS})"
        );
        self.slots[slot as usize]
            .read()
            .clone()
            .ok_or_else(|| anyhow!("slot {slot} is not held by this process"))
    }

    /// On the node agent's datapath: takes `slot`'s maps from the agent's
    /// lease server (the caller holds the slot's lock file). The connection
    /// returned is the lease: close it after [`Self::release`] to give the
    /// slot back. Elsewhere every slot's maps are held already: `None`.
    pub fn lease(&self, slot: u32) -> Result<Option<std::os::unix::net::UnixStream>> {
        let Backing::Pinned(p) = &self.backing else {
            return Ok(None);
        };
        let (conn, fds) = agent::lease::request(&p.paths, slot)?;
        self.hold(
            slot,
            SlotMaps::map(fds, self.chunk_bytes, self.chunks_per_slot)?,
        );
        Ok(Some(conn))
    }

    /// Lets go of a leased slot's maps (the agent's datapath; the caller
    /// has stopped using the slot). Slots of a program of this process's
    /// own, or adopted, stay held.
    pub fn release(&self, slot: u32) {
        if matches!(self.backing, Backing::Pinned(_)) && slot < MAX_SLOTS {
            self.disarm(slot);
            *self.slots[slot as usize].write() = None;
        }
    }

    /// Starts holding `slot` with its maps.
    fn hold(&self, slot: u32, maps: SlotMaps) {
        *self.slots[slot as usize].write() = Some(Arc::new(maps));
    }

    /// The program's arrays of maps (see erar_ring.bpf.c), in
    /// [`slot::OUTER_MAPS`] order: only a process that owns or adopted the
    /// program (root) has them.
    fn outer_fds(&self) -> Result<[BorrowedFd<'_>; 5]> {
        match &self.backing {
            Backing::Own(o) => {
                let m = &o.skel.maps;
                Ok([
                    m.slot_bufs.as_fd(),
                    m.slot_ctls.as_fd(),
                    m.chunk_states.as_fd(),
                    m.resends.as_fd(),
                    m.slot_events.as_fd(),
                ])
            }
            Backing::Adopted(a) => Ok(a.outers.each_ref().map(|m| m.as_fd())),
            Backing::Pinned(_) => Err(anyhow!("the agent's slot maps are reached by lease only")),
        }
    }

    /// Slot `slot`'s buffer as a slice.
    ///
    /// # Safety
    /// No other reference to this slot's buffer may be alive, and the slot
    /// must not be armed while the slice is written.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot_slice_mut(&self, slot: u32) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.slot_buffer(slot), self.slot_bytes())
    }

    /// Chunks of the armed operation whose final value is in this host's slot.
    pub fn done(&self, slot: u32) -> Result<u32> {
        Ok(self.slot_maps(slot)?.done().load(Ordering::Acquire))
    }

    /// Sets the slot's ring route (disarms it first). The Ethernet/IPv4/UDP
    /// header of every frame this host sends for the slot is computed here,
    /// checksum included, so XDP only copies it.
    pub fn configure_slot(&self, slot: u32, route: &SlotRoute) -> Result<()> {
        ensure!(
            route.ring_size >= 1 && route.ring_size <= wire::ERAR_MAX_RING,
            "ring size {} out of range 1..={}",
            route.ring_size,
            wire::ERAR_MAX_RING
        );
        ensure!(
            route.ring_pos < route.ring_size,
            "ring position {} >= ring size {}",
            route.ring_pos,
            route.ring_size
        );
        let m = self.slot_maps(slot)?;
        m.armed().store(0, Ordering::SeqCst);
        let ctl = m.ctl();
        let to_next = template_words(&frame_template(
            (route.self_mac, route.self_ip),
            (route.next_mac, route.next_ip),
            self.chunk_bytes,
        ));
        let to_prev = template_words(&frame_template(
            (route.self_mac, route.self_ip),
            (route.prev_mac, route.prev_ip),
            self.chunk_bytes,
        ));
        // A new ring restarts seq at 1: stages left by the slot's previous
        // ring must not read as this ring's.
        for word in m.states(self.chunks_per_slot) {
            word.store(0, Ordering::Relaxed);
        }
        // SAFETY: the slot is disarmed; XDP drops every data frame for it
        // before reading these fields, and `armed` is published with SeqCst
        // later. Only a liveness probe reads comm_id and token of a disarmed
        // slot: one arriving mid-write may be answered or dropped wrongly,
        // which changes nothing but that probe's answer.
        unsafe {
            std::ptr::addr_of_mut!((*ctl).tmpl).write_volatile(to_next);
            std::ptr::addr_of_mut!((*ctl).nack_tmpl).write_volatile(to_prev);
            std::ptr::addr_of_mut!((*ctl).comm_id).write_volatile(route.comm_id);
            std::ptr::addr_of_mut!((*ctl).token).write_volatile(route.token);
            std::ptr::addr_of_mut!((*ctl).ring_pos).write_volatile(route.ring_pos);
            std::ptr::addr_of_mut!((*ctl).ring_size).write_volatile(route.ring_size);
            std::ptr::addr_of_mut!((*ctl).ifindex).write_volatile(self.ifindex);
        }
        Ok(())
    }

    /// Arms `slot` for operation `seq` (non-zero, a new value for every
    /// operation on the slot) of `chunks` chunks combined with `wire_op`
    /// (`root`: the broadcast root's ring position; `flags_from`: the
    /// first chunk of flag bits of an `ERAR_OP_ADD_I32_FLAGS` operation;
    /// each ignored by the other ops).
    /// `done` is reset before `armed` is published, so no frame of this
    /// operation can be counted against the previous one's progress.
    pub fn arm(
        &self,
        slot: u32,
        seq: u32,
        chunks: u32,
        wire_op: u8,
        root: u32,
        flags_from: u32,
    ) -> Result<()> {
        ensure!(seq != 0, "seq 0 is reserved");
        ensure!(
            chunks >= 1 && chunks <= self.chunks_per_slot,
            "chunk count {chunks} out of range 1..={}",
            self.chunks_per_slot
        );
        ensure!(
            wire_op as u32 >= wire::ERAR_OP_ADD_I32 && (wire_op as u32) < wire::ERAR_OP_NR,
            "unknown wire op {wire_op}"
        );
        let m = self.slot_maps(slot)?;
        let ctl = m.ctl();
        // SAFETY: written by configure_slot() only, never concurrently.
        let ring_size = unsafe { std::ptr::addr_of!((*ctl).ring_size).read_volatile() };
        ensure!(
            wire_op as u32 != wire::ERAR_OP_BCAST || root < ring_size,
            "broadcast root {root} outside the ring of {ring_size}"
        );
        let armed = m.armed();
        armed.store(0, Ordering::SeqCst);
        // SAFETY: disarmed: XDP reads these only after seeing `armed`.
        unsafe {
            std::ptr::addr_of_mut!((*ctl).chunks).write_volatile(chunks);
            std::ptr::addr_of_mut!((*ctl).wire_op).write_volatile(wire_op as u32);
            std::ptr::addr_of_mut!((*ctl).root).write_volatile(root);
            std::ptr::addr_of_mut!((*ctl).flags_from).write_volatile(flags_from);
        }
        m.done().store(0, Ordering::SeqCst);
        armed.store(wire::ERAR_ARMED_BIT | seq as u64, Ordering::SeqCst);
        Ok(())
    }

    /// Re-arms the armed operation of `slot` under another `seq` (the ranks
    /// found their seq counters apart, see ring.rs): same chunks, op and
    /// root; progress restarts. Nothing may have been injected yet.
    pub fn rearm_seq(&self, slot: u32, seq: u32) -> Result<()> {
        ensure!(seq != 0, "seq 0 is reserved");
        let m = self.slot_maps(slot)?;
        armed_op(&m, slot).with_context(|| format!("re-arming slot {slot}"))?;
        let armed = m.armed();
        armed.store(0, Ordering::SeqCst);
        m.done().store(0, Ordering::SeqCst);
        armed.store(wire::ERAR_ARMED_BIT | seq as u64, Ordering::SeqCst);
        Ok(())
    }

    /// Stops the slot: every frame for it is dropped (and counted) from now on.
    pub fn disarm(&self, slot: u32) {
        if let Ok(m) = self.slot_maps(slot) {
            m.armed().store(0, Ordering::SeqCst);
        }
    }

    /// Sets how [`Self::inject`] paces frames.
    pub fn set_inject_pacing(&self, pacing: InjectPacing) {
        self.inject.lock().pacing = pacing;
    }

    pub fn inject_pacing(&self) -> InjectPacing {
        self.inject.lock().pacing
    }

    /// Puts this host's starting chunks (c ≡ ring_pos mod n) of the armed
    /// operation on the wire, paced by [`InjectPacing`]. Every host of the
    /// ring must have armed the slot before any host injects. For
    /// `ERAR_OP_BCAST` only the root calls this, and it sends every chunk.
    pub fn inject(&self, slot: u32) -> Result<()> {
        let m = self.slot_maps(slot)?;
        let (_, pos, n, chunks, wire_op) =
            armed_op(&m, slot).with_context(|| format!("inject on slot {slot}"))?;
        let bcast = wire_op == wire::ERAR_OP_BCAST;
        ensure!(n >= 1, "slot {slot} has no route");
        if n == 1 {
            // A ring of one: the contribution is the result.
            m.done().store(chunks, Ordering::SeqCst);
            return Ok(());
        }
        let mine = if bcast {
            chunks
        } else if pos < chunks {
            (chunks - pos).div_ceil(n)
        } else {
            0
        };
        let mut inj = self.inject.lock();
        let pacing = inj.pacing;
        let batch = pacing.batch.clamp(1, 256);
        name_slot(&mut inj.frame, &m, slot);
        // SAFETY: under the inject mutex.
        unsafe { set_inject(&m, wire::ERAR_INJECT_START, 0) };
        if bcast {
            return self.inject_from_lanes(&inj.frame, slot, mine, batch);
        }
        let burst = pacing.burst.max(1);
        let done = m.done();
        let mut sent = 0u32;
        // Frames given up on while waiting for the window: lost ones never
        // complete, and would otherwise close the window for good.
        let mut written_off = 0u64;
        while sent < mine {
            if pacing.window != u32::MAX {
                written_off = wait_for_window(
                    done,
                    n as u64 * sent as u64,
                    pacing.window as u64,
                    written_off,
                    pacing.quiet,
                );
            }
            let k = burst.min(mine - sent);
            self.prog_run_live(&inj.frame, k, batch)
                .with_context(|| format!("injecting frames {sent}..{} of slot {slot}", sent + k))?;
            sent += k;
        }
        Ok(())
    }

    /// A broadcast root's injection: every chunk, from every lane at once
    /// (see [`crate::datapath::lanes`]); erar_inject hands out the chunks
    /// from one atomic counter, so the lanes need not agree on which.
    ///
    /// A root sees none of its frames come back, so it has no progress to
    /// pace by and sends its share in one BPF_PROG_RUN per lane: the
    /// batches inside it are flushed and forwarded in softirq one after the
    /// other, without a syscall and page-pool setup per burst (16 MiB:
    /// 15-25% faster than bursts of 32, measured).
    fn inject_from_lanes(&self, frame: &[u8], slot: u32, chunks: u32, batch: u32) -> Result<()> {
        let lanes = Lanes::get();
        let share = chunks.div_ceil(lanes.count() as u32);
        lanes.run(|lane| {
            let first = share * lane as u32;
            let count = share.min(chunks.saturating_sub(first));
            if count == 0 {
                return Ok(());
            }
            self.prog_run_live(frame, count, batch).with_context(|| {
                format!("injecting {count} of the {chunks} frames of slot {slot} (lane {lane})")
            })
        })
    }

    /// Re-sends, for each of `chunks`, the frame this host last sent for it
    /// in the armed operation (see `last_sent` in erar_ring.bpf.c): the
    /// successor reported them missing. Chunks this host has nothing stable
    /// for are skipped (counted as `resend_skip`).
    pub fn resend(&self, slot: u32, chunks: &[u32]) -> Result<()> {
        let m = self.slot_maps(slot)?;
        armed_op(&m, slot).with_context(|| format!("resend on slot {slot}"))?;
        self.run_list(&m, slot, wire::ERAR_INJECT_RESEND, chunks.iter().copied())
            .map(|_| ())
    }

    /// Injects in `mode` (RESEND or NACK) one frame per chunk of `chunks`,
    /// through the slot's resend list (ERAR_RESEND_MAX per BPF_PROG_RUN);
    /// returns how many chunks it named.
    fn run_list(
        &self,
        m: &SlotMaps,
        slot: u32,
        mode: u32,
        chunks: impl Iterator<Item = u32>,
    ) -> Result<u32> {
        let mut inj = self.inject.lock();
        let batch = inj.pacing.batch.clamp(1, 256);
        name_slot(&mut inj.frame, m, slot);
        // SAFETY: the slot's resend list, written only under the inject
        // mutex and read by XDP only within our BPF_PROG_RUN.
        let list = unsafe { &mut *m.resend_list() };
        let flush = |len: usize| -> Result<()> {
            // SAFETY: under the inject mutex.
            unsafe { set_inject(m, mode, len as u32) };
            self.prog_run_live(&inj.frame, len as u32, batch)
                .with_context(|| {
                    format!("injecting {len} listed frames (mode {mode}) on slot {slot}")
                })
        };
        let (mut named, mut len) = (0u32, 0usize);
        for c in chunks {
            list.chunk[len] = c;
            len += 1;
            named += 1;
            if len == list.chunk.len() {
                flush(len)?;
                len = 0;
            }
        }
        if len > 0 {
            flush(len)?;
        }
        Ok(named)
    }

    /// Writes the stage (`enum erar_chunk_stage`, 2 bits: chunk c at bits
    /// 2*(c%4) of byte c/4, `chunks.div_ceil(4)` bytes) of each chunk of
    /// armed operation `seq` on this host; returns how many are not FINAL.
    pub fn stages(&self, slot: u32, seq: u32, chunks: u32, packed: &mut [u8]) -> Result<u32> {
        let m = self.slot_maps(slot)?;
        let states = m.states(self.chunks_per_slot);
        ensure!(
            chunks as usize <= states.len() && packed.len() >= (chunks as usize).div_ceil(4),
            "stages(): {chunks} chunks, {} states, {} bytes",
            states.len(),
            packed.len()
        );
        packed.fill(0);
        let mut not_final = 0;
        for (c, word) in states[..chunks as usize].iter().enumerate() {
            let w = word.load(Ordering::Acquire);
            let stage = if (w >> 32) as u32 == seq {
                w as u8 & 3
            } else {
                0
            };
            packed[c / 4] |= stage << (2 * (c % 4));
            not_final += u32::from(stage != wire::ERAR_STAGE_FINAL as u8);
        }
        Ok(not_final)
    }

    /// One BPF_PROG_RUN of erar_xdp (attached, so no dispatcher update) in
    /// live-frames mode: it injects `repeat` frames.
    fn prog_run_live(&self, frame: &[u8], repeat: u32, batch: u32) -> Result<()> {
        // SAFETY: zeroed opts is the documented default; sz tells libbpf
        // which fields we know.
        let mut opts: libbpf_sys::bpf_test_run_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_test_run_opts>() as _;
        opts.data_in = frame.as_ptr().cast();
        opts.data_size_in = frame.len() as u32;
        opts.repeat = repeat as _;
        opts.flags = libbpf_sys::BPF_F_TEST_XDP_LIVE_FRAMES;
        opts.batch_size = batch;
        let fd = self.prog_fd().as_raw_fd();
        // SAFETY: opts and the frame outlive the call.
        let ret = unsafe { libbpf_sys::bpf_prog_test_run_opts(fd, &mut opts) };
        if ret != 0 {
            return Err(std::io::Error::from_raw_os_error(-ret))
                .context("BPF_PROG_RUN (live frames) of erar_xdp");
        }
        Ok(())
    }

    /// Asks the predecessor, with one NACK each (ERAR_INJECT_NACK), for the
    /// frame this host waits for next for chunks of armed operation `seq`
    /// that are not final here: every such chunk, or (`below`) only those
    /// below that chunk index. Returns how many chunks were asked about
    /// (the kernel skips those a frame is being applied to).
    pub fn nack(&self, slot: u32, seq: u32, below: Option<u32>) -> Result<u32> {
        let m = self.slot_maps(slot)?;
        let (armed_seq, _, n, chunks, _) =
            armed_op(&m, slot).with_context(|| format!("NACK on slot {slot}"))?;
        ensure!(
            armed_seq == seq,
            "NACK on slot {slot} for seq {seq}, armed {armed_seq}"
        );
        if n < 2 {
            return Ok(0);
        }
        let end = below.map_or(chunks, |b| b.min(chunks));
        let missing = m.states(self.chunks_per_slot)[..end as usize]
            .iter()
            .enumerate()
            .filter(|(_, w)| !is_final(w, seq))
            .map(|(c, _)| c as u32);
        self.run_list(&m, slot, wire::ERAR_INJECT_NACK, missing)
    }

    /// One past the highest chunk of armed operation `seq` that is final on
    /// this host (0: none is). Chunks go out roughly in index order, so a
    /// chunk missing below it for a while was most likely lost, while the
    /// ones above it are most likely still on their way.
    fn frontier(&self, m: &SlotMaps, seq: u32, chunks: u32) -> u32 {
        let states = m.states(self.chunks_per_slot);
        states[..(chunks as usize).min(states.len())]
            .iter()
            .rposition(|w| is_final(w, seq))
            .map_or(0, |c| c as u32 + 1)
    }

    /// Waits until operation `seq` of `slot` is complete on this host
    /// (`done == chunks`). Once per NACK period (`patience.nack_after`) it
    /// NACKs, depending on how long progress has paused: none, the chunks
    /// still missing below the frontier of one period earlier (later
    /// chunks overtook them that long ago); one period, those below the
    /// frontier now; `TAIL_NACK_PERIODS`, every missing chunk. Gives up
    /// (`complete: false`) once `done` has made no progress for
    /// `patience.quiet`: frames were lost (or are late) beyond what NACKs
    /// repaired, and the caller starts a recovery round.
    pub fn wait(&self, slot: u32, seq: u32, patience: Patience) -> Result<Waited> {
        let m = self.slot_maps(slot)?;
        let (ctl, armed, done) = (m.ctl(), m.armed(), m.done());
        let want = wire::ERAR_ARMED_BIT | seq as u64;
        ensure!(
            armed.load(Ordering::Acquire) == want,
            "wait on slot {slot} for seq {seq}, which is not armed"
        );
        // SAFETY: written before arming.
        let chunks = unsafe { std::ptr::addr_of!((*ctl).chunks).read_volatile() };
        let quiet = patience.quiet;
        // NACKs go out within 1.5x their period, silence is noticed within
        // 1.25x its own; waking more often costs the other ranks CPU.
        let tick = patience
            .nack_after
            .map_or(quiet / 4, |n| (n / 2).min(quiet / 4))
            .max(Duration::from_micros(50));
        let mut waited = Waited::default();
        let mut last = done.load(Ordering::Acquire);
        let mut last_progress = Instant::now();
        let mut last_nack = last_progress;
        // The frontier one NACK period ago: chunks below it still missing
        // now were overtaken by later ones for that long.
        let mut old_frontier = 0u32;
        let nack = |below: Option<u32>, waited: &mut Waited| -> Result<()> {
            let asked = self.nack(slot, seq, below)?;
            if asked > 0 {
                waited.nack_chunks += u64::from(asked);
                waited.nacks += 1;
            }
            Ok(())
        };
        loop {
            let d = done.load(Ordering::Acquire);
            if d >= chunks {
                ensure!(
                    armed.load(Ordering::Acquire) == want,
                    "slot {slot} was re-armed while waiting for seq {seq}"
                );
                waited.complete = true;
                return Ok(waited);
            }
            let now = Instant::now();
            if d != last {
                last = d;
                last_progress = now;
            } else if now.duration_since(last_progress) >= quiet {
                return Ok(waited);
            }
            if let Some(after) = patience
                .nack_after
                .filter(|&after| now.duration_since(last_nack) >= after)
            {
                let frontier = self.frontier(&m, seq, chunks);
                if now.duration_since(last_progress) >= after * TAIL_NACK_PERIODS {
                    // A long pause: the operation's last frames were lost
                    // (nothing overtakes them), or a host is slow.
                    nack(None, &mut waited)?;
                } else if now.duration_since(last_progress) >= after {
                    // A pause: whatever is missing below the frontier.
                    nack(Some(frontier), &mut waited)?;
                } else if old_frontier > 0 {
                    // Progress goes on, around the holes it left behind.
                    nack(Some(old_frontier), &mut waited)?;
                }
                old_frontier = frontier;
                last_nack = Instant::now();
            }
            sleep_on_events(&m, tick)?;
        }
    }

    /// Summed per-CPU counters.
    pub fn stats(&self) -> Result<KernelStats> {
        let key = 0u32.to_ne_bytes();
        let per_cpu = self
            .stats_map()
            .lookup_percpu(&key, MapFlags::ANY)
            .context("reading the stats map")?
            .ok_or_else(|| anyhow!("stats map has no entry 0"))?;
        let mut sum = [0u64; wire::ERAR_STAT_NR as usize];
        for cpu in &per_cpu {
            for (s, w) in sum.iter_mut().zip(cpu.chunks_exact(8)) {
                let mut b = [0u8; 8];
                b.copy_from_slice(w);
                *s += u64::from_ne_bytes(b);
            }
        }
        Ok(KernelStats::from_counters(&sum))
    }
}

impl Drop for HostDatapath {
    fn drop(&mut self) {
        // Every slot belongs to whichever process holds its lock, also on
        // our own program (other jobs may share it): each Ring disarms its
        // own slot, nothing is disarmed here.
        if let Backing::Own(own) = &mut self.backing {
            // Our reference to the attachment goes first; the program stays
            // attached while a process that adopted it holds another.
            drop(own.link.take());
        }
        // Then the mappings and the ring buffer (fields, in order), then
        // the backing's skeleton or fds.
    }
}

/// Where a [`HostDatapath`]'s program and maps come from.
enum Backing {
    /// Loaded and attached by this process.
    Own(OwnDatapath),
    /// The node agent's pinned objects: this process only holds fds.
    Pinned(PinnedDatapath),
    /// Another process's program, shared (see [`adopt`]).
    Adopted(AdoptedDatapath),
}

/// This process's own skeleton and link.
struct OwnDatapath {
    link: Option<Link>,
    skel: ManuallyDrop<ErarRingSkel<'static>>,
    /// Storage of the libbpf object that `skel` borrows ('static is a lie
    /// told to the borrow checker; Drop ends `skel` before this box).
    obj: NonNull<MaybeUninit<OpenObject>>,
    prog_id: u32,
    /// Its slot locks exist: other processes may share it.
    published: bool,
}

impl OwnDatapath {
    /// Opens the skeleton, sizes it, loads it and attaches erar_xdp to
    /// `ifindex` with a bpf_link.
    fn load(
        chunk_bytes: u32,
        chunks_per_slot: u32,
        ifname: &str,
        ifindex: u32,
    ) -> Result<OwnDatapath> {
        let obj = NonNull::from(Box::leak(Box::new(MaybeUninit::<OpenObject>::uninit())));
        // From here on `obj` must be freed on every path.
        match Self::load_into(obj, chunk_bytes, chunks_per_slot, ifname, ifindex) {
            Ok((skel, link)) => {
                let prog_id = skel
                    .progs
                    .erar_xdp
                    .as_fd()
                    .try_clone_to_owned()
                    .and_then(|fd| agent::prog_id(&fd));
                let mut own = OwnDatapath {
                    link: Some(link),
                    skel: ManuallyDrop::new(skel),
                    obj,
                    prog_id: 0,
                    published: false,
                };
                // On error `own` drops, detaching and freeing `obj`.
                own.prog_id = prog_id.context("reading erar_xdp's id")?;
                Ok(own)
            }
            Err(e) => {
                // SAFETY: load_into() failed, every skeleton borrowing obj is
                // gone (the skeleton drops the object it initialized).
                drop(unsafe { Box::from_raw(obj.as_ptr()) });
                Err(e)
            }
        }
    }

    fn load_into(
        obj: NonNull<MaybeUninit<OpenObject>>,
        chunk_bytes: u32,
        chunks_per_slot: u32,
        ifname: &str,
        ifindex: u32,
    ) -> Result<(ErarRingSkel<'static>, Link)> {
        // SAFETY: obj is a leaked box, valid until OwnDatapath::drop (or
        // load()'s error path), which end every borrow first.
        let storage: &'static mut MaybeUninit<OpenObject> = unsafe { &mut *obj.as_ptr() };
        let mut open = ErarRingSkelBuilder::default()
            .open(storage)
            .context("opening the erar_ring BPF object")?;
        {
            let ro = open
                .maps
                .rodata_data
                .as_deref_mut()
                .ok_or_else(|| anyhow!("erar_ring has no .rodata"))?;
            ro.erar_chunk_bytes = chunk_bytes;
            ro.erar_chunks_per_slot = chunks_per_slot;
        }
        // The inner-map templates fix what every slot's maps look like (the
        // verifier checks accesses against them): one slot's worth, made
        // here with this geometry, used only while loading. (libbpf cannot
        // resize the templates it makes from BTF.)
        let templates = SlotMaps::create(chunk_bytes, chunks_per_slot)
            .context("creating the slot-map templates")?;
        let m = &mut open.maps;
        for (outer, template) in [
            &mut m.slot_bufs,
            &mut m.slot_ctls,
            &mut m.chunk_states,
            &mut m.resends,
            &mut m.slot_events,
        ]
        .into_iter()
        .zip(&templates)
        {
            outer
                .set_inner_map_fd(template.as_fd())
                .context("setting an inner-map template")?;
        }
        let skel = open.load().context("loading erar_ring (verifier)")?;
        let link = skel
            .progs
            .erar_xdp
            .attach_xdp(ifindex as i32)
            .with_context(|| {
                format!("attaching erar_xdp to {ifname} (ifindex {ifindex}) with a bpf_link")
            })?;
        Ok((skel, link))
    }
}

impl Drop for OwnDatapath {
    fn drop(&mut self) {
        drop(self.link.take());
        // SAFETY: nothing borrows the skeleton any more (ring buffers and
        // mappings hold their own kernel references); the skeleton is
        // dropped before the storage it borrows, exactly once.
        unsafe {
            ManuallyDrop::drop(&mut self.skel);
            drop(Box::from_raw(self.obj.as_ptr()));
        }
    }
}

/// The node agent's objects, opened by BPF_OBJ_GET.
struct PinnedDatapath {
    prog: OwnedFd,
    stats: MapHandle,
    _rodata: MapHandle,
    paths: AgentPaths,
}

/// What [`HostDatapath::load_and_pin`] pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedIds {
    pub prog_id: u32,
}

/// Sleeps until a completion event arrives or `timeout` passes, and
/// consumes the events. Not RingBuffer::poll: that hands epoll_wait
/// whole milliseconds, so any timeout under 1 ms became 0 and the
/// waiting rank spun, starving the other hosts' softirqs and ranks on
/// the test bed's 2 CPUs (a 256 KiB allreduce took 4-8 ms instead of
/// 1). ppoll on the ring buffer's epoll fd sleeps to the microsecond.
fn sleep_on_events(m: &SlotMaps, timeout: Duration) -> Result<()> {
    let rb = m.events();
    let mut fds = [libc::pollfd {
        fd: rb.epoll_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: one valid pollfd, a valid timespec, no signal mask.
    let ret = unsafe { libc::ppoll(fds.as_mut_ptr(), 1, &ts, std::ptr::null()) };
    if ret < 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err).context("waiting on the events ring buffer");
        }
    }
    if ret > 0 {
        rb.consume().context("consuming the events ring buffer")?;
    }
    Ok(())
}

/// Makes the inject path's input frame name `slot`, with the slot's token:
/// erar_inject drives a slot only for a frame that carries it, so a process
/// can inject for the slots it holds only.
fn name_slot(frame: &mut [u8], m: &SlotMaps, slot: u32) {
    // SAFETY: written by configure_slot() only, never concurrently.
    let token = unsafe { std::ptr::addr_of!((*m.ctl()).token).read_volatile() };
    frame[HDR_SLOT_OFF..HDR_SLOT_OFF + 2].copy_from_slice(&(slot as u16).to_le_bytes());
    frame[HDR_TOKEN_OFF..HDR_TOKEN_OFF + 4].copy_from_slice(&token.to_le_bytes());
}

/// The armed operation's (seq, ring_pos, ring_size, chunks, wire_op).
fn armed_op(m: &SlotMaps, slot: u32) -> Result<(u32, u32, u32, u32, u32)> {
    let ctl = m.ctl();
    let armed = m.armed().load(Ordering::Acquire);
    ensure!(
        armed & wire::ERAR_ARMED_BIT != 0,
        "slot {slot} is not armed"
    );
    // SAFETY: plain reads of fields written before arming.
    Ok(unsafe {
        (
            armed as u32,
            std::ptr::addr_of!((*ctl).ring_pos).read_volatile(),
            std::ptr::addr_of!((*ctl).ring_size).read_volatile(),
            std::ptr::addr_of!((*ctl).chunks).read_volatile(),
            std::ptr::addr_of!((*ctl).wire_op).read_volatile(),
        )
    })
}

/// Sets the slot's inject mode and restarts its run counter.
///
/// # Safety
/// Under the inject mutex (one runner of the slot's inject fields).
unsafe fn set_inject(m: &SlotMaps, mode: u32, count: u32) {
    let ctl = m.ctl();
    std::ptr::addr_of_mut!((*ctl).inject_mode).write_volatile(mode);
    std::ptr::addr_of_mut!((*ctl).inject_count).write_volatile(count);
    std::ptr::addr_of_mut!((*ctl).inject_next).write_volatile(0);
}

/// (chunk_bytes, chunks_per_slot) of a loaded erar_ring, from its frozen
/// .rodata map.
fn geometry_of(rodata: &MapHandle) -> Result<(u32, u32)> {
    let ro = rodata
        .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
        .context("reading rodata")?
        .ok_or_else(|| anyhow!("rodata has no value"))?;
    let consts_len = std::mem::size_of::<skel::types::rodata>();
    ensure!(ro.len() >= consts_len, "rodata is {} bytes", ro.len());
    // SAFETY: at least size_of bytes of two u32, any bit pattern valid.
    let consts: skel::types::rodata = unsafe { std::ptr::read_unaligned(ro.as_ptr().cast()) };
    let (chunk_bytes, chunks_per_slot) = (consts.erar_chunk_bytes, consts.erar_chunks_per_slot);
    check_geometry(chunk_bytes, chunks_per_slot)?;
    Ok((chunk_bytes, chunks_per_slot))
}

/// Checks a slot geometry.
fn check_geometry(chunk_bytes: u32, chunks_per_slot: u32) -> Result<()> {
    ensure!(
        (wire::ERAR_MIN_CHUNK_BYTES..=wire::ERAR_MAX_CHUNK_BYTES).contains(&chunk_bytes)
            && chunk_bytes & (wire::ERAR_CHUNK_ALIGN - 1) == 0,
        "chunk_bytes {chunk_bytes} must be a multiple of {} in {}..={}",
        wire::ERAR_CHUNK_ALIGN,
        wire::ERAR_MIN_CHUNK_BYTES,
        wire::ERAR_MAX_CHUNK_BYTES
    );
    ensure!(chunks_per_slot > 0, "chunks_per_slot must be positive");
    Ok(())
}

/// Whether a chunk's state word says final in operation `seq`.
fn is_final(word: &AtomicU64, seq: u32) -> bool {
    // Acquire: the chunk's payload was stored before its stage.
    let w = word.load(Ordering::Acquire);
    (w >> 32) as u32 == seq && w as u32 == wire::ERAR_STAGE_FINAL
}

/// Waits until `issued - done - written_off <= window`, i.e. a burst may
/// start, and returns the new `written_off`. If `done` stops moving for
/// `quiet`, every frame still outstanding is presumed lost (recovery re-sends
/// lost frames after injection) and written off, which opens the window:
/// lost frames never complete and would otherwise keep it shut.
fn wait_for_window(
    done: &AtomicU32,
    issued: u64,
    window: u64,
    written_off: u64,
    quiet: Duration,
) -> u64 {
    let mut last = done.load(Ordering::Acquire);
    let mut last_progress = Instant::now();
    let mut spins = 0u32;
    loop {
        let d = done.load(Ordering::Acquire);
        let outstanding = issued.saturating_sub(d as u64);
        if outstanding.saturating_sub(written_off) <= window {
            return written_off;
        }
        if d != last {
            last = d;
            last_progress = Instant::now();
        } else if last_progress.elapsed() >= quiet {
            return outstanding;
        }
        // Other hosts' frames are processed in softirq on these same CPUs:
        // give them the CPU rather than spin.
        spins += 1;
        if spins < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

fn page_round(len: usize) -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    len.div_ceil(page).max(1) * page
}

/// Index of interface `ifname` in this network namespace.
pub fn if_index(ifname: &str) -> Result<u32> {
    let c = CString::new(ifname).with_context(|| format!("interface name {ifname:?}"))?;
    // SAFETY: c is a valid C string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("no interface {ifname}"));
    }
    Ok(idx)
}

/// A template as the u64 words erar_slot_ctl stores it in.
fn template_words(tmpl: &[u8]) -> [u64; wire::ERAR_TEMPLATE_WORDS as usize] {
    let mut words = [0u64; wire::ERAR_TEMPLATE_WORDS as usize];
    for (w, b) in words.iter_mut().zip(tmpl.chunks(8)) {
        let mut le = [0u8; 8];
        le[..b.len()].copy_from_slice(b);
        *w = u64::from_le_bytes(le);
    }
    words
}

/// Ethernet + IPv4 + UDP header (ERAR_L2L4_LEN bytes) of the frames this host
/// sends for a slot from `from` to `to` (MAC, IPv4): UDP checksum 0, DF,
/// TTL 64, IPv4 checksum set.
fn frame_template(
    from: ([u8; 6], Ipv4Addr),
    to: ([u8; 6], Ipv4Addr),
    chunk_bytes: u32,
) -> [u8; wire::ERAR_L2L4_LEN as usize] {
    let mut f = [0u8; wire::ERAR_L2L4_LEN as usize];
    f[0..6].copy_from_slice(&to.0);
    f[6..12].copy_from_slice(&from.0);
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let udp_len = 8 + wire::ERAR_HDR_LEN + chunk_bytes;
    let ip_len = 20 + udp_len;
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&(ip_len as u16).to_be_bytes());
    ip[6..8].copy_from_slice(&0x4000u16.to_be_bytes()); // DF
    ip[8] = 64;
    ip[9] = 17; // UDP
    ip[12..16].copy_from_slice(&from.1.octets());
    ip[16..20].copy_from_slice(&to.1.octets());
    let csum = ipv4_checksum(ip);
    ip[10..12].copy_from_slice(&csum.to_be_bytes());
    let udp = &mut f[34..42];
    udp[0..2].copy_from_slice(&(wire::ERAR_UDP_PORT as u16).to_be_bytes());
    udp[2..4].copy_from_slice(&(wire::ERAR_UDP_PORT as u16).to_be_bytes());
    udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    f
}

/// RFC 791 header checksum (the checksum field must be zero on input).
fn ipv4_checksum(hdr: &[u8]) -> u16 {
    let mut sum: u32 = hdr
        .chunks(2)
        .map(|w| u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]) as u32)
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_checksum_known_vector() {
        // Wikipedia's example header: checksum 0xb861.
        let mut h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(ipv4_checksum(&h), 0xb861);
        h[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
        assert_eq!(ipv4_checksum(&h), 0);
    }

    #[test]
    fn template_layout() {
        let from = ([2, 0, 0, 0, 0, 1], Ipv4Addr::new(10, 0, 0, 1));
        let to = ([2, 0, 0, 0, 0, 2], Ipv4Addr::new(10, 0, 0, 2));
        let t = frame_template(from, to, 1024);
        assert_eq!(&t[0..6], &to.0);
        assert_eq!(&t[6..12], &from.0);
        assert_eq!(&t[30..34], &to.1.octets());
        assert_eq!(ipv4_checksum(&t[14..34]), 0);
        assert_eq!(
            u16::from_be_bytes([t[36], t[37]]),
            wire::ERAR_UDP_PORT as u16
        );
        assert_eq!(
            u16::from_be_bytes([t[16], t[17]]) as u32,
            20 + 8 + wire::ERAR_HDR_LEN + 1024
        );
    }
}
