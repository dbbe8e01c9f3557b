//! One slot's kernel state: its inner maps (see the per-slot maps in
//! erar_ring.bpf.c) and this process's mappings of them.
//!
//! Whoever creates a slot's inner maps decides who can reach them: on a
//! program a job attached itself, the first process of the host to use the
//! slot creates them (root processes that adopt the program open them by
//! id); the node agent creates them per lease and hands their fds to the
//! one job that leased the slot. Nobody else ever holds an fd of them but
//! the job's other ranks on the host, to which a node path's slice leader
//! hands its slot buffers' fds to map read-only (datapath/node/slots.rs).

use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};

use anyhow::{anyhow, Context, Result};
use parking_lot::Mutex;

use super::geometry::page_round;
use super::wire;
use crate::datapath::mapping::SharedMapping;

/// The kinds of inner map a slot has, in the order of [`SlotMaps::fds`]:
/// named after the program's arrays of maps that hold them, which the
/// agent pins under these names (the contract's list).
pub use crate::datapath::contract::OUTER_MAPS;

/// A slot's inner maps and their mappings.
pub struct SlotMaps {
    /// Mappings and the ring buffer first (drop order): they go before the
    /// fds they came from.
    events: Mutex<EventRing>,
    buf: SharedMapping,
    ctl: SharedMapping,
    state: SharedMapping,
    resend: SharedMapping,
    /// Keeps the maps alive as long as their mappings.
    _fds: [OwnedFd; 5],
}

// SAFETY: the mappings are shared memory whose concurrent use goes through
// atomics or is coordinated by the slot's owner (see HostDatapath); the
// ring buffer is behind a mutex.
unsafe impl Send for SlotMaps {}
unsafe impl Sync for SlotMaps {}

/// Creates one map; its fd.
pub(super) fn create_map(
    kind: libbpf_sys::bpf_map_type,
    name: &str,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    flags: u32,
) -> Result<OwnedFd> {
    // SAFETY: zeroed opts with sz set is the documented default.
    let mut opts: libbpf_sys::bpf_map_create_opts = unsafe { std::mem::zeroed() };
    opts.sz = std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as _;
    opts.map_flags = flags;
    let cname = std::ffi::CString::new(name).context("map name")?;
    // SAFETY: valid name and opts for the duration of the call.
    let fd = unsafe {
        libbpf_sys::bpf_map_create(
            kind,
            cname.as_ptr(),
            key_size,
            value_size,
            max_entries,
            &opts,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::from_raw_os_error(-fd))
            .with_context(|| format!("creating map {name}"));
    }
    // SAFETY: a new fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl SlotMaps {
    /// Creates a slot's inner maps (needs CAP_BPF), in [`OUTER_MAPS`] order.
    pub fn create(chunk_bytes: u32, chunks_per_slot: u32) -> Result<[OwnedFd; 5]> {
        let array = libbpf_sys::BPF_MAP_TYPE_ARRAY;
        let mmapable = libbpf_sys::BPF_F_MMAPABLE;
        let size = |n: usize| n as u32;
        Ok([
            create_map(array, "slot_buf", 4, chunk_bytes, chunks_per_slot, mmapable)?,
            create_map(
                array,
                "slot_ctl",
                4,
                size(std::mem::size_of::<wire::erar_slot_ctl>()),
                1,
                mmapable,
            )?,
            create_map(array, "chunk_state", 4, 8, chunks_per_slot, mmapable)?,
            create_map(
                array,
                "resend",
                4,
                size(std::mem::size_of::<wire::erar_resend_list>()),
                1,
                mmapable,
            )?,
            create_map(
                libbpf_sys::BPF_MAP_TYPE_RINGBUF,
                "slot_events",
                0,
                0,
                wire::ERAR_EVENTS_BYTES,
                0,
            )?,
        ])
    }

    /// Maps a slot's inner maps (fds in [`OUTER_MAPS`] order) into this
    /// process. Each map's size is checked against what this build expects
    /// (the kernel refuses an mmap longer than the map).
    pub fn map(fds: [OwnedFd; 5], chunk_bytes: u32, chunks_per_slot: u32) -> Result<SlotMaps> {
        let [buf, ctl, state, resend, events] = &fds;
        let size = |n: usize| n as u32;
        let array = libbpf_sys::BPF_MAP_TYPE_ARRAY;
        check_map(buf.as_fd(), "slot_buf", array, chunk_bytes, chunks_per_slot)?;
        check_map(
            ctl.as_fd(),
            "slot_ctl",
            array,
            size(std::mem::size_of::<wire::erar_slot_ctl>()),
            1,
        )?;
        check_map(state.as_fd(), "chunk_state", array, 8, chunks_per_slot)?;
        check_map(
            resend.as_fd(),
            "resend",
            array,
            size(std::mem::size_of::<wire::erar_resend_list>()),
            1,
        )?;
        check_map(
            events.as_fd(),
            "slot_events",
            libbpf_sys::BPF_MAP_TYPE_RINGBUF,
            0,
            wire::ERAR_EVENTS_BYTES,
        )?;
        let mmap = |fd: &OwnedFd, bytes: usize, what: &str| {
            let len = page_round(bytes);
            SharedMapping::new(fd.as_fd(), len)
                .with_context(|| format!("mmap of map {what} ({len} bytes)"))
        };
        let buf = mmap(
            buf,
            chunks_per_slot as usize * chunk_bytes as usize,
            "slot_buf",
        )?;
        let ctl = mmap(ctl, std::mem::size_of::<wire::erar_slot_ctl>(), "slot_ctl")?;
        let state = mmap(state, chunks_per_slot as usize * 8, "chunk_state")?;
        let resend = mmap(
            resend,
            std::mem::size_of::<wire::erar_resend_list>(),
            "resend",
        )?;
        let events = EventRing::new(events.as_fd())?;
        Ok(SlotMaps {
            events: Mutex::new(events),
            buf,
            ctl,
            state,
            resend,
            _fds: fds,
        })
    }

    pub fn buf(&self) -> *mut u8 {
        self.buf.as_ptr()
    }

    /// The slot buffer map's fd (first in [`OUTER_MAPS`] order).
    pub fn buf_fd(&self) -> BorrowedFd<'_> {
        self._fds[0].as_fd()
    }

    pub fn ctl(&self) -> *mut wire::erar_slot_ctl {
        self.ctl.as_ptr().cast()
    }

    /// The control word's `armed` (armed bit and seq: one word, so XDP sees
    /// both consistently).
    pub fn armed(&self) -> &AtomicU64 {
        // SAFETY: an 8-byte aligned u64 in the shared mapping, accessed by
        // both sides with single loads/stores; lives as long as `self`.
        unsafe { AtomicU64::from_ptr(std::ptr::addr_of_mut!((*self.ctl()).armed)) }
    }

    /// The control word's `done` counter (XDP increments it atomically).
    pub fn done(&self) -> &AtomicU32 {
        // SAFETY: as armed().
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*self.ctl()).done)) }
    }

    /// The control word's `start_next`: this host's starting frames taken
    /// so far (by circulating frames in XDP, and by the rank before its
    /// START runs), atomically.
    pub fn start_next(&self) -> &AtomicU32 {
        // SAFETY: as armed().
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*self.ctl()).start_next)) }
    }

    /// Whether the armed operation's frames circulate (set by arm()).
    pub fn circulates(&self) -> bool {
        // SAFETY: a plain read of a field written before arming.
        unsafe { std::ptr::addr_of!((*self.ctl()).circulate).read_volatile() != 0 }
    }

    /// The control word's `join_seq`: the operation this host joined the
    /// barrier of (see "Barrier" in erar_wire.h).
    pub fn join_seq(&self) -> &AtomicU32 {
        // SAFETY: as armed().
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*self.ctl()).join_seq)) }
    }

    /// The control word's `ready`: the newest barrier count the successor
    /// told this host, `(seq << 32) | count` (XDP's compare-and-swap).
    pub fn ready(&self) -> &AtomicU64 {
        // SAFETY: as armed().
        unsafe { AtomicU64::from_ptr(std::ptr::addr_of_mut!((*self.ctl()).ready)) }
    }

    /// The control word's `sleeping`: set while the rank sleeps on the
    /// slot's events, the only time XDP posts one (see `post_event` in
    /// erar_ring.bpf.c).
    pub fn sleeping(&self) -> &AtomicU32 {
        // SAFETY: as armed().
        unsafe { AtomicU32::from_ptr(std::ptr::addr_of_mut!((*self.ctl()).sleeping)) }
    }

    pub fn resend_list(&self) -> *mut wire::erar_resend_list {
        self.resend.as_ptr().cast()
    }

    /// The chunk state words (`chunks_per_slot` of them).
    pub fn states(&self, chunks_per_slot: u32) -> &[AtomicU64] {
        // SAFETY: the mapping holds chunks_per_slot u64 words, page-aligned;
        // XDP updates them with atomic ops.
        unsafe {
            std::slice::from_raw_parts(
                self.state.as_ptr().cast::<AtomicU64>(),
                chunks_per_slot as usize,
            )
        }
    }

    pub fn events(&self) -> parking_lot::MutexGuard<'_, EventRing> {
        self.events.lock()
    }
}

/// Checks that map `fd` is what this build expects of `what` (the mappings
/// and the accessors rely on it; the maps may come from another process).
pub fn check_map(
    fd: BorrowedFd<'_>,
    what: &str,
    kind: libbpf_sys::bpf_map_type,
    value_size: u32,
    max_entries: u32,
) -> Result<()> {
    // SAFETY: zeroed info is valid input.
    let mut info: libbpf_sys::bpf_map_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_map_info>() as u32;
    // SAFETY: info is len bytes.
    let rc = unsafe { libbpf_sys::bpf_map_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(-rc))
            .with_context(|| format!("reading map {what}'s info"));
    }
    if (info.type_, info.value_size, info.max_entries) != (kind, value_size, max_entries) {
        return Err(anyhow!(
            "map {what} is type {} {}x{}, this build expects type {kind} {value_size}x{max_entries}",
            info.type_,
            info.value_size,
            info.max_entries
        ));
    }
    Ok(())
}

/// Puts a slot's inner maps into the program's arrays of maps (`outers` in
/// [`OUTER_MAPS`] order): from now on XDP handles frames for the slot.
pub fn install(outers: [BorrowedFd<'_>; 5], slot: u32, inner: [BorrowedFd<'_>; 5]) -> Result<()> {
    for (i, (outer, inner)) in outers.iter().zip(inner).enumerate() {
        let fd = inner.as_raw_fd();
        // SAFETY: key and value are valid for the call.
        let rc = unsafe {
            libbpf_sys::bpf_map_update_elem(
                outer.as_raw_fd(),
                (&raw const slot).cast::<c_void>(),
                (&raw const fd).cast::<c_void>(),
                libbpf_sys::BPF_ANY as u64,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(-rc))
                .with_context(|| format!("installing slot {slot}'s {}", OUTER_MAPS[i]));
        }
    }
    Ok(())
}

/// Takes a slot's inner maps out of the program's arrays of maps: XDP drops
/// frames for the slot from now on, and the maps are freed once their last
/// fd closes.
pub fn uninstall(outers: [BorrowedFd<'_>; 5], slot: u32) {
    // The control map first: every frame checks it before anything else.
    for outer in [1, 0, 2, 3, 4].map(|i| outers[i]) {
        // SAFETY: key valid for the call; ENOENT (never installed) is fine.
        unsafe {
            libbpf_sys::bpf_map_delete_elem(outer.as_raw_fd(), (&raw const slot).cast::<c_void>())
        };
    }
}

/// The inner map ids of slot `slot` in the program's arrays of maps (0:
/// none installed); the outer maps return ids to user space.
pub fn installed_ids(outers: [BorrowedFd<'_>; 5], slot: u32) -> [u32; 5] {
    outers.map(|outer| {
        let mut id = 0u32;
        // SAFETY: key and value valid for the call.
        let rc = unsafe {
            libbpf_sys::bpf_map_lookup_elem(
                outer.as_raw_fd(),
                (&raw const slot).cast::<c_void>(),
                (&raw mut id).cast::<c_void>(),
            )
        };
        if rc == 0 {
            id
        } else {
            0
        }
    })
}

/// Opens the inner maps installed for `slot` by id: a slot some process of
/// this host first used, on a program this process attached or adopted
/// (opening by id needs CAP_SYS_ADMIN, as adopting does). `None` if there
/// are none, or only some: a process that died between installing the
/// first and the last leaves the slot to be made anew (by the caller, who
/// holds the slot's lock).
pub fn open_installed(outers: [BorrowedFd<'_>; 5], slot: u32) -> Result<Option<[OwnedFd; 5]>> {
    let ids = installed_ids(outers, slot);
    if ids.contains(&0) {
        return Ok(None);
    }
    let mut fds = Vec::with_capacity(ids.len());
    for id in ids {
        // SAFETY: plain syscall wrapper.
        let fd = unsafe { libbpf_sys::bpf_map_get_fd_by_id(id) };
        if fd < 0 {
            return Err(std::io::Error::from_raw_os_error(-fd))
                .with_context(|| format!("opening slot {slot}'s map {id} by id"));
        }
        // SAFETY: a new fd the call gave us.
        fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    let fds: [OwnedFd; 5] = fds
        .try_into()
        .map_err(|_| anyhow!("slot {slot}: not five maps"))?;
    Ok(Some(fds))
}

/// A consumer of a slot's completion-event ring buffer: only its epoll fd
/// is used to sleep on (the events only wake the waiter; completion is read
/// from the slot's `done` counter).
pub struct EventRing {
    rb: NonNull<libbpf_sys::ring_buffer>,
}

unsafe extern "C" fn ignore_event(_: *mut c_void, _: *mut c_void, _: u64) -> i32 {
    0
}

impl EventRing {
    fn new(fd: BorrowedFd<'_>) -> Result<EventRing> {
        // SAFETY: a valid ring-buffer map fd; no context, default options.
        let rb = unsafe {
            libbpf_sys::ring_buffer__new(
                fd.as_raw_fd(),
                Some(ignore_event),
                std::ptr::null_mut(),
                std::ptr::null(),
            )
        };
        NonNull::new(rb).map(|rb| EventRing { rb }).ok_or_else(|| {
            anyhow!(
                "creating a ring-buffer consumer: {}",
                std::io::Error::last_os_error()
            )
        })
    }

    pub fn epoll_fd(&self) -> i32 {
        // SAFETY: a live ring_buffer.
        unsafe { libbpf_sys::ring_buffer__epoll_fd(self.rb.as_ptr()) }
    }

    pub fn consume(&self) -> Result<()> {
        // SAFETY: a live ring_buffer.
        let rc = unsafe { libbpf_sys::ring_buffer__consume(self.rb.as_ptr()) };
        if rc < 0 {
            return Err(std::io::Error::from_raw_os_error(-rc)).context("consuming events");
        }
        Ok(())
    }
}

impl Drop for EventRing {
    fn drop(&mut self) {
        // SAFETY: created by ring_buffer__new, freed once.
        unsafe { libbpf_sys::ring_buffer__free(self.rb.as_ptr()) }
    }
}
