//! The [`HostDatapath`] value: its constructors (each opens its backing
//! through that backing's module: `load`, `adopt`, `pinned`), what it
//! holds (where its program comes from, the slots it holds, the inject
//! path's state and its [`InjectPacing`]), and the accessors every other
//! part of the driver goes through.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context, Result};
use libbpf_rs::MapCore;
use parking_lot::{Mutex, RwLock};

use super::adopt::{self, AdoptedDatapath};
use super::load::{self, OwnDatapath, PinnedIds};
use super::pinned::{self, PinnedDatapath};
use super::raw::{RawCounts, RawSender};
use super::region;
use super::slot::{self, SlotMaps};
use super::{wire, MAX_SLOTS, PAYLOAD_OFF};
use crate::datapath::contract::{self, AgentError, AgentPaths};

/// The datapath of this host on one interface. See the [`kernel`](super)
/// module docs.
pub struct HostDatapath {
    // Field order is drop order: the slots' mappings go before the program
    // and maps they came from.
    /// The slots this process holds (their inner maps, mapped): on a
    /// program of its own or adopted, those it has used (made or opened at
    /// their first use); on the agent's, those it leased.
    /// A slot is used only by the ring that holds it, and released by it.
    slots: [RwLock<Option<Arc<SlotMaps>>>; MAX_SLOTS as usize],
    pub(super) backing: Backing,
    /// Serializes this process's BPF_PROG_RUN calls (they drive the slots'
    /// inject fields) and holds their pacing and input frame.
    pub(super) inject: Mutex<Injector>,
    /// `inject`'s pacing says an allreduce's frames circulate: read by
    /// every arm(), which takes no lock for it.
    pub(super) circulate: AtomicBool,
    /// The socket this host's READY frames go out through, and, for jumbo
    /// chunks (larger than one BPF_PROG_RUN live frame carries), every
    /// frame it originates (see `kernel/raw.rs`); what it sent, for the
    /// counters. `None` if it could not be opened (no CAP_NET_RAW): READY
    /// frames then go through BPF_PROG_RUN, and jumbo chunks cannot be
    /// injected (injecting fails, saying why).
    pub(super) raw: Option<RawSender>,
    pub(super) raw_counts: RawCounts,
    ifname: String,
    pub(super) ifindex: u32,
    pub(super) chunk_bytes: u32,
    pub(super) chunks_per_slot: u32,
}

// SAFETY: the raw pointers are to mappings and to the libbpf object owned by
// this value; shared mutation goes through atomics (slot_ctl), the `inject`
// mutex (inject fields of slot_ctl, resend lists) or the ring-buffer mutex. The slot buffers are handed out as
// raw pointers: callers coordinate their use with arm/wait.
unsafe impl Send for HostDatapath {}
unsafe impl Sync for HostDatapath {}

impl HostDatapath {
    /// The value on a backing just opened: `opened` is what its module
    /// returned (its part of the backing, the interface's index, and the
    /// program's chunk_bytes and chunks_per_slot), `kind` which backing.
    fn assemble<B>(ifname: &str, opened: (B, u32, u32, u32), kind: fn(B) -> Backing) -> Self {
        let (part, ifindex, chunk_bytes, chunks_per_slot) = opened;
        let raw = RawSender::open(ifindex)
            .map_err(|e| {
                log::debug!("liberar: READY frames through BPF_PROG_RUN, no jumbo frames: {e:#}")
            })
            .ok();
        let live_frame = chunk_bytes.min(wire::ERAR_MAX_LINEAR_CHUNK_BYTES);
        let payload_len = if raw.is_some() {
            chunk_bytes as usize
        } else {
            0
        };
        HostDatapath {
            slots: Default::default(),
            backing: kind(part),
            inject: Mutex::new(Injector {
                pacing: InjectPacing::default(),
                frame: vec![0u8; PAYLOAD_OFF + live_frame as usize].into_boxed_slice(),
                payload: vec![0u8; payload_len].into_boxed_slice(),
            }),
            circulate: AtomicBool::new(InjectPacing::default().circulate),
            raw,
            raw_counts: RawCounts::default(),
            ifname: ifname.to_string(),
            ifindex,
            chunk_bytes,
            chunks_per_slot,
        }
    }

    /// Loads the datapath, sizes its slot buffers to `chunks_per_slot` chunks
    /// of `chunk_bytes` bytes per slot, and attaches `erar_xdp` to `ifname`
    /// (native XDP, through a bpf_link). Needs CAP_BPF and CAP_NET_ADMIN.
    pub fn attach(ifname: &str, chunk_bytes: u32, chunks_per_slot: u32) -> Result<Self> {
        let (mut own, ifindex) = load::load_own(ifname, chunk_bytes, chunks_per_slot)?;
        // A slot's maps are made at its first use (HostDatapath::slot_maps),
        // by this process or by one that adopts the program. Other
        // processes may share it from now on.
        match adopt::publish(own.prog_id) {
            Ok(()) => own.published = true,
            Err(e) => {
                log::debug!("liberar: erar_xdp on {ifname} cannot be shared with other jobs: {e:#}")
            }
        }
        let opened = (own, ifindex, chunk_bytes, chunks_per_slot);
        let dp = Self::assemble(ifname, opened, Backing::Own);
        log::debug!("erar_xdp attached to {ifname} (ifindex {ifindex}): chunk_bytes {chunk_bytes}, chunks_per_slot {chunks_per_slot}");
        Ok(dp)
    }

    /// For the node agent: loads and attaches exactly as [`Self::attach`]
    /// does, pins the program, the link and every map into `dir` (an
    /// existing directory in a bpffs; names in [`agent`]) and lets
    /// go of them: the pins keep the datapath attached after this process
    /// exits, until they are removed.
    pub fn load_and_pin(
        ifname: &str,
        chunk_bytes: u32,
        chunks_per_slot: u32,
        dir: &Path,
    ) -> Result<PinnedIds> {
        load::load_and_pin(ifname, chunk_bytes, chunks_per_slot, dir)
    }

    /// Uses the erar_xdp of this build that another process attached to
    /// `ifname` (see `kernel/adopt.rs`). Needs CAP_SYS_ADMIN.
    pub fn adopt(ifname: &str) -> Result<Self> {
        adopt::open(ifname).map(|opened| Self::assemble(ifname, opened, Backing::Adopted))
    }

    /// Opens the node agent's datapath on `ifname` (pinned by `erarctl agent
    /// start`, see [`agent`]): BPF_OBJ_GET of its program and of its
    /// read-only maps — nothing is loaded or attached, and no capability is
    /// needed, only the file permissions of the pins; no slot is held until
    /// a ring leases one ([`Self::lease`]). The
    /// geometry (chunk_bytes, chunks_per_slot) is the agent's, read from
    /// the program's own constants. Slots are shared with every other
    /// process using the agent: take a slot's lock
    /// ([`Self::slot_lock_path`]), then lease it, before configuring it.
    pub fn open_pinned(ifname: &str) -> Result<Self, AgentError> {
        pinned::open(ifname).map(|opened| Self::assemble(ifname, opened, Backing::Pinned))
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

    pub(super) fn stats_map(&self) -> &dyn MapCore {
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

    /// Whether `erar_xdp` combines a jumbo frame's fragments where they lie
    /// (`erar_frag_slices`): false where the kernel refused the kfunc that
    /// reaches them (see [`load`]), and the combine goes through a copy
    /// (counted as `ERAR_STAT_PAYLOAD_COPIED`).
    pub fn combines_fragments_in_place(&self) -> Result<bool> {
        let consts = match &self.backing {
            Backing::Own(own) => load::consts_of(&own.skel.maps.rodata),
            Backing::Pinned(p) => load::consts_of(&p.rodata),
            Backing::Adopted(a) => load::consts_of(&a.rodata),
        }?;
        Ok(consts.erar_frag_slices != 0)
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
    /// If this process does not hold `slot` and cannot take it (the agent's
    /// slots come by lease; on another program, making or opening the
    /// slot's maps at its first use failed).
    pub fn slot_buffer(&self, slot: u32) -> *mut u8 {
        match self.slot_maps(slot) {
            Ok(m) => m.buf(),
            Err(e) => panic!("{e:#}"),
        }
    }

    /// A new fd of slot `slot`'s buffer map, for a process that reads the
    /// slot's results through a mapping of its own (the other ranks of a
    /// node group: datapath/node/slots.rs).
    pub fn slot_buffer_fd(&self, slot: u32) -> Result<OwnedFd> {
        let maps = self.slot_maps(slot)?;
        let fd = maps.buf_fd().try_clone_to_owned();
        fd.with_context(|| format!("duplicating slot {slot}'s buffer fd"))
    }

    /// The maps of a slot this process holds, once per operation: every
    /// method below keeps the Arc while it uses the mappings, so they stay
    /// valid even if the slot were released meanwhile (only the ring that
    /// holds a slot releases it, after its last use).
    pub(super) fn slot_maps(&self, slot: u32) -> Result<Arc<SlotMaps>> {
        ensure!(
            slot < MAX_SLOTS,
            "slot {slot} out of range (max {MAX_SLOTS})"
        );
        match self.held(slot) {
            Some(maps) => Ok(maps),
            None => self.first_use(slot),
        }
    }

    /// Makes sure this process holds `slot`'s maps: on a program it
    /// attached or adopted, the slot's first use here, which opens them (or
    /// creates them, the slot's first use on this host). Every operation on
    /// a slot does this by itself; a caller that reads the slot's maps some
    /// other way (the fuzzer, through the program's arrays of maps) calls it
    /// first.
    pub fn use_slot(&self, slot: u32) -> Result<()> {
        self.slot_maps(slot).map(|_| ())
    }

    /// The maps of `slot` if this process has them mapped already.
    pub(super) fn held(&self, slot: u32) -> Option<Arc<SlotMaps>> {
        self.slots.get(slot as usize)?.read().clone()
    }

    /// A slot of a program this process attached or adopted, at its first
    /// use here: opened by id if some process of this host created its
    /// maps already, else created and installed now. Creating every slot's
    /// maps at attach (4 x 27 MB of zeroed kernel memory at MTU 3400) took
    /// 0.42 s of a job's first fast call, measured; most jobs use one slot.
    /// Two processes never first-use one slot at once: a ring holds the
    /// slot's lock file before it touches the slot. Opening another
    /// process's maps by id needs CAP_SYS_ADMIN, as adopting does; a
    /// process that attached with CAP_BPF alone cannot take a slot an
    /// adopter made (the claim fails, and the ring tries the next slot or
    /// declines). The agent's slots come by [`Self::lease`] only.
    #[cold]
    fn first_use(&self, slot: u32) -> Result<Arc<SlotMaps>> {
        let mut held = self.slots[slot as usize].write();
        if let Some(maps) = &*held {
            return Ok(maps.clone());
        }
        let Ok(outers) = self.outer_fds() else {
            bail!("slot {slot} is not held by this process");
        };
        let fds = match slot::open_installed(outers, slot)? {
            Some(fds) => fds,
            None => {
                let fds = SlotMaps::create(self.chunk_bytes, self.chunks_per_slot)?;
                slot::install(outers, slot, fds.each_ref().map(|f| f.as_fd()))?;
                fds
            }
        };
        let maps = Arc::new(SlotMaps::map(fds, self.chunk_bytes, self.chunks_per_slot)?);
        *held = Some(maps.clone());
        Ok(maps)
    }

    /// On the node agent's datapath: takes `slot`'s maps from the agent's
    /// lease server (the caller holds the slot's lock file). The connection
    /// returned is the lease: close it after [`Self::release`] to give the
    /// slot back. Elsewhere this is the slot's first use here
    /// ([`Self::use_slot`]), so that a failure to make its maps is a slot
    /// not claimed, which every rank agrees on, and not an error in the
    /// middle of a ring's setup: `None`.
    pub fn lease(&self, slot: u32) -> Result<Option<std::os::unix::net::UnixStream>> {
        let Backing::Pinned(p) = &self.backing else {
            self.use_slot(slot)?;
            return Ok(None);
        };
        let (conn, fds) = contract::request_lease(&p.paths, slot)?;
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
    pub(super) fn hold(&self, slot: u32, maps: SlotMaps) {
        *self.slots[slot as usize].write() = Some(Arc::new(maps));
    }

    /// The program's arrays of maps (see erar_ring.bpf.c), in
    /// [`super::slot::OUTER_MAPS`] order: only a process that owns or
    /// adopted the program (root) has them.
    pub(super) fn outer_fds(&self) -> Result<[BorrowedFd<'_>; 5]> {
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

    /// The program's arrays of registered buffers (kernel/region.rs), one
    /// per size class: on a program this process loaded only.
    pub fn regions_fds(&self) -> Result<[BorrowedFd<'_>; region::CLASSES]> {
        match &self.backing {
            Backing::Own(o) => {
                let m = &o.skel.maps;
                Ok([
                    m.regions_1m.as_fd(),
                    m.regions_4m.as_fd(),
                    m.regions_16m.as_fd(),
                    m.regions_64m.as_fd(),
                ])
            }
            _ => Err(anyhow!("registered buffers need a program of this process")),
        }
    }

    /// The token of the ring configured on `slot`.
    pub fn slot_token(&self, slot: u32) -> Result<u32> {
        let m = self.slot_maps(slot)?;
        // SAFETY: written by configure_slot() only, never concurrently.
        Ok(unsafe { std::ptr::addr_of!((*m.ctl()).token).read_volatile() })
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
    /// While inject() waits for the window, each pause of progress this
    /// long NACKs the chunks missing below the frontier (`None`: no NACKs).
    /// Measured (`benchmarks/run-loss`, 16 MiB, 1% loss per hop): without
    /// them every lost chunk held the window shut until `quiet`: 40-64 ms
    /// per call instead of 21 (lossy/lossless 0.33; 0.65 with these NACKs
    /// every NACK period, 0.82 every four). Rings use four
    /// NACK periods: lossless 16 MiB calls were as fast as without
    /// (`benchmarks/phases`, best of 4 alternating runs: 19.9 ms, 20.3 ms
    /// without, 19.6 ms before the barrier moved into the kernel).
    pub nack_after: Option<Duration>,
    /// Whether an allreduce's frames circulate: this host injects the
    /// first window (`window / n` frames) and every all-gather frame that
    /// ends its trip here goes on as its next starting frame (erar_xdp's
    /// end_trip; "Circulating frames" in docs/datapath.md). A broadcast's
    /// frames never do (its trips end at the root's predecessor).
    pub circulate: bool,
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
            nack_after: None,
            circulate: true,
        }
    }
}

/// State of the inject path, under [`HostDatapath::inject`]'s mutex.
pub(super) struct Injector {
    pub(super) pacing: InjectPacing,
    /// BPF_PROG_RUN's input frame. erar_inject writes every header byte and
    /// the payload; it only reads erar_hdr.slot, which names the slot.
    pub(super) frame: Box<[u8]>,
    /// The payload of the frames sent from the socket (`kernel/jumbo.rs`):
    /// READY frames, and the re-sends and NACKs of jumbo chunks; empty
    /// without the socket.
    pub(super) payload: Box<[u8]>,
}

/// Where a [`HostDatapath`]'s program and maps come from.
pub(super) enum Backing {
    /// Loaded and attached by this process.
    Own(OwnDatapath),
    /// The node agent's pinned objects: this process only holds fds.
    Pinned(PinnedDatapath),
    /// Another process's program, shared (see [`adopt`]).
    Adopted(AdoptedDatapath),
}
