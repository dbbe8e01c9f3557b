//! The kernel's maps, found from the program: each slot's inner maps
//! (`slot_buf`, `chunk_state`, `slot_ctl`, `slot_events`) reached through
//! the arrays of maps, mapped read-only (the slot_ctl read-write: user
//! space's `sleeping`), and our consumer of its events.

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void, CStr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use anyhow::{anyhow, bail, ensure, Context, Result};
use liberar::datapath::wire;

use crate::layout::{le32, SLOTS};

pub struct Mmap {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mmap {
    pub fn new(fd: &OwnedFd, len: usize, what: &str) -> Result<Mmap> {
        Mmap::with_prot(fd, len, what, libc::PROT_READ)
    }
    /// A read-write mapping: for the words user space writes.
    pub fn writable(fd: &OwnedFd, len: usize, what: &str) -> Result<Mmap> {
        Mmap::with_prot(fd, len, what, libc::PROT_READ | libc::PROT_WRITE)
    }
    fn with_prot(fd: &OwnedFd, len: usize, what: &str, prot: c_int) -> Result<Mmap> {
        let page = 4096usize;
        let len = len.div_ceil(page).max(1) * page;
        // SAFETY: a fresh shared mapping of an mmapable map.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("mmap {what}"));
        }
        Ok(Mmap {
            ptr: NonNull::new(p.cast()).ok_or_else(|| anyhow!("mmap {what}: NULL"))?,
            len,
        })
    }
    /// Writes the u32 at byte `off` as user space does (a mapping made by
    /// [`Mmap::writable`]).
    pub fn write_u32(&self, off: usize, v: u32) {
        assert!(off.is_multiple_of(4) && off + 4 <= self.len);
        // SAFETY: an aligned u32 within the mapping.
        unsafe { self.ptr.as_ptr().add(off).cast::<u32>().write_volatile(v) };
    }
    /// Writes `bytes` from byte `off` on, as user space does (a mapping
    /// made by [`Mmap::writable`]).
    pub fn write_at(&self, off: usize, bytes: &[u8]) {
        assert!(off + bytes.len() <= self.len);
        // SAFETY: within the mapping, which no Rust reference borrows
        // meanwhile (bytes() is read between our BPF_PROG_RUN calls only).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.as_ptr().add(off), bytes.len())
        };
    }
    pub fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.len);
        // SAFETY: within the mapping; the kernel writes it only during our
        // own (synchronous) BPF_PROG_RUN calls.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len) }
    }
}

impl Drop for Mmap {
    fn drop(&mut self) {
        // SAFETY: unmapping what new() mapped.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// fds of the maps `prog_fd` uses, by name.
pub fn prog_maps(prog_fd: c_int) -> Result<BTreeMap<String, OwnedFd>> {
    let mut ids = [0u32; 32];
    // SAFETY: zeroed info is valid input; map_ids points to `ids`.
    let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    info.nr_map_ids = ids.len() as u32;
    info.map_ids = ids.as_mut_ptr() as u64;
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: info and ids outlive the call.
    let r = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(prog_fd, &mut info, &mut len) };
    ensure!(r == 0, "bpf_prog_get_info_by_fd: {r}");
    let mut out = BTreeMap::new();
    for &id in &ids[..(info.nr_map_ids as usize).min(ids.len())] {
        // SAFETY: plain syscall wrapper.
        let fd = unsafe { libbpf_sys::bpf_map_get_fd_by_id(id) };
        ensure!(fd >= 0, "bpf_map_get_fd_by_id({id}): {fd}");
        // SAFETY: a new fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mi = map_info(&fd)?;
        // SAFETY: the kernel NUL-terminates the 16-byte name.
        let name = unsafe { CStr::from_ptr(mi.name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        out.insert(name, fd);
    }
    Ok(out)
}

/// The inner map of `slot` in the array of maps `outer` (named `what`): its
/// id and an fd of it, after checking that it is what the program's
/// template says (type, value size, entries, flags).
fn inner_map(
    outer: &OwnedFd,
    slot: u32,
    what: &str,
    want: (libbpf_sys::bpf_map_type, u32, u32, u32),
) -> Result<(u32, OwnedFd)> {
    let id = inner_id(outer, slot).with_context(|| format!("slot {slot}'s {what}"))?;
    ensure!(id != 0, "slot {slot}: no {what} installed");
    // SAFETY: plain syscall wrapper.
    let fd = unsafe { libbpf_sys::bpf_map_get_fd_by_id(id) };
    ensure!(fd >= 0, "bpf_map_get_fd_by_id({id}) ({what}): {fd}");
    // SAFETY: a new fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mi = map_info(&fd)?;
    let got = (mi.type_, mi.value_size, mi.max_entries, mi.map_flags);
    ensure!(
        got == want,
        "slot {slot}'s {what} (id {id}) is (type, value size, entries, flags) {got:?}, expected {want:?}"
    );
    Ok((id, fd))
}

/// The id of the inner map of `slot` in the array of maps `outer` (0: none).
pub fn inner_id(outer: &OwnedFd, slot: u32) -> Result<u32> {
    let mut id = 0u32;
    // SAFETY: key and value are valid for the call.
    let r = unsafe {
        libbpf_sys::bpf_map_lookup_elem(
            outer.as_raw_fd(),
            (&raw const slot).cast(),
            (&raw mut id).cast(),
        )
    };
    match r {
        0 => Ok(id),
        r if r == -libc::ENOENT => Ok(0),
        r => bail!("bpf_map_lookup_elem({slot}): {r}"),
    }
}

pub fn map_info(fd: &OwnedFd) -> Result<libbpf_sys::bpf_map_info> {
    // SAFETY: zeroed info is valid input.
    let mut mi: libbpf_sys::bpf_map_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_map_info>() as u32;
    // SAFETY: mi outlives the call.
    let r = unsafe { libbpf_sys::bpf_map_get_info_by_fd(fd.as_raw_fd(), &mut mi, &mut len) };
    ensure!(r == 0, "bpf_map_get_info_by_fd: {r}");
    Ok(mi)
}

/// The arrays of maps holding the inner maps this fuzzer reads, in the
/// order of [`SlotState::ids`].
pub const OUTERS: [&str; 4] = ["slot_bufs", "chunk_states", "slot_ctls", "slot_events"];

/// One slot's state in the kernel: its inner maps, reached through the
/// program's arrays of maps, mapped read-only into this process.
pub struct SlotState {
    /// `slot_buf`: chunks_per_slot elements of chunk_bytes (element c is
    /// chunk c), contiguous.
    pub buf: Mmap,
    /// `chunk_state`: chunks_per_slot u64 words.
    pub state: Mmap,
    /// `slot_ctl`: one struct erar_slot_ctl (read-write: the fuzzer
    /// writes `sleeping` as a waiting rank does).
    pub ctl: Mmap,
    /// Our consumer of `slot_events`, the slot's completion events.
    pub events: Events,
    /// The inner maps' ids, in [`OUTERS`] order.
    pub ids: [u32; 4],
    /// Their fds, closed after the mappings and the consumer.
    _fds: Vec<OwnedFd>,
}

impl SlotState {
    /// Finds slot `slot`'s inner maps through the arrays of maps in `maps`.
    pub fn open(
        maps: &BTreeMap<String, OwnedFd>,
        slot: u32,
        cb: u32,
        cps: u32,
    ) -> Result<SlotState> {
        let array = libbpf_sys::BPF_MAP_TYPE_ARRAY;
        let mmapable = libbpf_sys::BPF_F_MMAPABLE;
        let wants = [
            (array, cb, cps, mmapable),
            (array, 8, cps, mmapable),
            (array, CTL_SIZE as u32, 1, mmapable),
            (
                libbpf_sys::BPF_MAP_TYPE_RINGBUF,
                0,
                wire::ERAR_EVENTS_BYTES,
                0,
            ),
        ];
        let mut ids = [0u32; 4];
        let mut fds = Vec::new();
        for (i, (name, want)) in OUTERS.iter().zip(wants).enumerate() {
            let outer = outer_map(maps, name)?;
            let (id, fd) = inner_map(outer, slot, name, want)?;
            ids[i] = id;
            fds.push(fd);
        }
        Ok(SlotState {
            buf: Mmap::new(&fds[0], (cb * cps) as usize, "slot_buf")?,
            state: Mmap::new(&fds[1], cps as usize * 8, "chunk_state")?,
            ctl: Mmap::writable(&fds[2], CTL_SIZE, "slot_ctl")?,
            events: Events::new(&fds[3])?,
            ids,
            _fds: fds,
        })
    }

    /// Sets the slot_ctl's `start_next`, as a rank's START runs take
    /// starting frames from it.
    pub fn set_start_next(&self, taken: u32) {
        self.ctl.write_u32(START_NEXT_OFF, taken);
    }

    /// Sets the slot_ctl's `sleeping`, as a rank does before it sleeps on
    /// the slot's events.
    pub fn set_sleeping(&self, sleeping: u32) {
        self.ctl.write_u32(
            std::mem::offset_of!(wire::erar_slot_ctl, sleeping),
            sleeping,
        );
    }
}

/// The program's array of maps `name`, checked to be one of the slots.
pub fn outer_map<'a>(maps: &'a BTreeMap<String, OwnedFd>, name: &str) -> Result<&'a OwnedFd> {
    let fd = maps
        .get(name)
        .ok_or_else(|| anyhow!("erar_xdp has no map {name} ({:?})", maps.keys()))?;
    let mi = map_info(fd)?;
    ensure!(
        mi.type_ == libbpf_sys::BPF_MAP_TYPE_ARRAY_OF_MAPS && mi.max_entries == SLOTS as u32,
        "map {name} is type {} with {} entries, expected an array of {SLOTS} maps",
        mi.type_,
        mi.max_entries
    );
    Ok(fd)
}

/// Our own consumer of one slot's `slot_events` ring buffer.
pub struct Events {
    rb: *mut libbpf_sys::ring_buffer,
    /// Boxed: the callback writes through a pointer to the Vec itself.
    #[allow(clippy::box_collection)]
    got: Box<Vec<(u32, u32)>>,
}

unsafe extern "C" fn on_event(
    ctx: *mut c_void,
    data: *mut c_void,
    size: libbpf_sys::size_t,
) -> c_int {
    // SAFETY: ctx is Events::got, data points to `size` bytes.
    let got = unsafe { &mut *(ctx as *mut Vec<(u32, u32)>) };
    let b = unsafe { std::slice::from_raw_parts(data as *const u8, size as usize) };
    if b.len() >= 8 {
        got.push((le32(b, 0), le32(b, 4)));
    } else {
        got.push((u32::MAX, u32::MAX));
    }
    0
}

impl Events {
    pub fn new(fd: &OwnedFd) -> Result<Events> {
        let mut got = Box::new(Vec::new());
        // SAFETY: got lives as long as rb (freed in drop first).
        let rb = unsafe {
            libbpf_sys::ring_buffer__new(
                fd.as_raw_fd(),
                Some(on_event),
                (&mut *got as *mut Vec<(u32, u32)>).cast(),
                std::ptr::null(),
            )
        };
        ensure!(!rb.is_null(), "ring_buffer__new failed");
        Ok(Events { rb, got })
    }
    pub fn take(&mut self) -> Vec<(u32, u32)> {
        // SAFETY: rb is valid; the callback writes self.got.
        unsafe { libbpf_sys::ring_buffer__consume(self.rb) };
        std::mem::take(&mut *self.got)
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        // SAFETY: created by ring_buffer__new.
        unsafe { libbpf_sys::ring_buffer__free(self.rb) };
    }
}

pub const CTL_SIZE: usize = std::mem::size_of::<wire::erar_slot_ctl>();
pub const DONE_OFF: usize = std::mem::offset_of!(wire::erar_slot_ctl, done);
pub const START_NEXT_OFF: usize = std::mem::offset_of!(wire::erar_slot_ctl, start_next);
pub const READY_OFF: usize = std::mem::offset_of!(wire::erar_slot_ctl, ready);
pub const READY_KEY_OFF: usize = std::mem::offset_of!(wire::erar_slot_ctl, ready_key);
