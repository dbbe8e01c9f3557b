//! A ring's registered buffer (region): a caller's buffer whose pages are
//! a BPF map's, so that XDP reads and writes it with no copy through the
//! slot buffer: a broadcast's (the root's frames filled from it, what the
//! other hosts receive stored into theirs), an exact allreduce's send and
//! receive buffers (see "Broadcasts in place", "Allreduces in place" in
//! docs/datapath.md, "Registered buffers" in erar_wire.h).
//!
//! A region is one mmappable array map of one element, of the smallest
//! size class that holds the buffer ([`class_for`]), installed in the
//! program's array of that class (`regions_1m` ... `regions_64m`): its
//! first page holds the token of the ring that may use it, then the buffer
//! at its offset within a page (byte x of the buffer at ERAR_REGION_HEAD +
//! pad + x). Registering
//! a buffer copies its whole pages into the map and moves the map's pages
//! over them (one `mremap`, atomic for other threads); the bytes on its
//! partial first and last pages stay the caller's and are copied at each
//! call. Unregistering gives the buffer private pages again, with the same
//! bytes, and leaves the map (still installed) to the ring's next buffer,
//! unless a page of it is still mapped elsewhere ([`RegionMap`]: a new
//! map costs 16 ms, and installing one waits for RCU).
//!
//! The caller's pages are then shared memory the caller does not know of,
//! so these are watched for:
//! * the caller frees or remaps the buffer: each call first checks, in
//!   `/proc/self/pagemap`, that its first and last page are still shared
//!   pages ([`Region::holds`]), and a region dropped, or a fork, gives
//!   private pages only to what `/proc/self/maps` still shows as the
//!   map's (the caller may have unmapped some since);
//! * an allocator gives a freed buffer's pages back with
//!   `madvise(MADV_DONTNEED)`: a shared mapping without a fault handler
//!   then raises SIGBUS at the next touch, where anonymous memory reads
//!   zeros. The SIGBUS handler below maps a zero page there and marks the
//!   region, which is then registered anew;
//! * `fork`: the child gets private copies of registered pages (a
//!   `pthread_atfork` handler), as it would have without us;
//! * the program installs its own SIGBUS action over ours: the rings give
//!   their regions up before their communicator's next call that could
//!   take the fast path ([`sigbus_taken_over`]);
//! * an MPI's memory hooks: UCX's interpose `mremap` (and lost its fifth
//!   argument here), so the pages are moved by the system call itself,
//!   and UCX's registration cache is told the old ones are gone.
//!
//! Pages are 4 KiB (the region's layout in erar_wire.h counts in them).

use std::ffi::c_void;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;

use anyhow::{bail, ensure, Context, Result};

use super::slot::create_map;
use super::wire;
use crate::datapath::mapping::SharedMapping;

const PAGE: usize = 4096;
/// A `/proc/self/pagemap` entry's bits of a page that is present (63) and
/// a file page or shared anonymous (61), as a region's pages are.
const SHARED: u64 = 1 << 63 | 1 << 61;
const HEAD: usize = wire::ERAR_REGION_HEAD as usize;

/// Size classes of region maps (see "Registered buffers" in erar_wire.h).
pub const CLASSES: usize = wire::ERAR_REGION_CLASSES as usize;

/// A region map's element bytes, by class.
const CLASS_BYTES: [usize; CLASSES] = [
    wire::ERAR_REGION_BYTES_1M as usize,
    wire::ERAR_REGION_BYTES_4M as usize,
    wire::ERAR_REGION_BYTES_16M as usize,
    wire::ERAR_REGION_BYTES_64M as usize,
];

/// The largest buffer an element of `bytes` holds (the rest of it is its
/// head, the buffer's offset in its first page and the last chunk's
/// padding).
const fn max_buffer(bytes: usize) -> usize {
    bytes - HEAD - PAGE - wire::ERAR_MAX_CHUNK_BYTES as usize
}

/// The largest buffer a region holds (one of the largest class).
pub const REGION_MAX_BUFFER: usize = max_buffer(CLASS_BYTES[CLASSES - 1]);

/// The bytes of this process's region maps (their elements), summed.
static HELD_BYTES: AtomicUsize = AtomicUsize::new(0);

/// The kernel memory this process holds in region maps (every page of an
/// element is allocated when the map is created).
pub fn maps_held_bytes() -> usize {
    HELD_BYTES.load(Ordering::Relaxed)
}

/// The smallest class whose regions hold a buffer of `len` bytes.
pub fn class_for(len: usize) -> Option<usize> {
    CLASS_BYTES.iter().position(|&b| len <= max_buffer(b))
}

/// The map a region lives in, and this process's view of its element.
/// A ring keeps the one its last buffer used for its next of the same
/// class ([`Region::unregister`]): creating a 64 MiB one took 16 ms here
/// and mapping its view 2 ms (the kernel allocates and zeroes every page;
/// docs/benchmarks.md, "Session 39"), so a program that broadcast a few
/// buffers in turn, each twice, paid more than its broadcasts' own time at
/// every change.
pub struct RegionMap {
    view: SharedMapping,
    map: OwnedFd,
    /// Its size class (the element's bytes: `CLASS_BYTES[class]`).
    class: usize,
    pagemap: File,
    /// Where it is installed, the program's array of its class and the
    /// index: it stays there while the ring keeps it for its next buffer,
    /// because installing a map there and taking one out each wait for an
    /// RCU grace period (the kernel's `maybe_wait_bpf_programs`), which
    /// took most of a change of buffer here (docs/benchmarks.md, "Session
    /// 39").
    installed: Option<(OwnedFd, u32)>,
    /// The process that created it: a forked child's copy leaves the
    /// parent's arrays alone.
    pid: u32,
}

impl RegionMap {
    fn new(class: usize) -> Result<RegionMap> {
        let bytes = CLASS_BYTES[class];
        let map = create_map(
            libbpf_sys::BPF_MAP_TYPE_ARRAY,
            "region",
            4,
            bytes as u32,
            1,
            libbpf_sys::BPF_F_MMAPABLE,
        )?;
        let view = SharedMapping::new(map.as_fd(), bytes.div_ceil(PAGE) * PAGE)
            .context("mapping a region")?;
        let pagemap = File::open("/proc/self/pagemap").context("opening /proc/self/pagemap")?;
        HELD_BYTES.fetch_add(bytes, Ordering::Relaxed);
        Ok(RegionMap {
            view,
            map,
            class,
            pagemap,
            installed: None,
            pid: std::process::id(),
        })
    }

    /// Whether a buffer of `len` bytes takes a map of its class (and so
    /// [`Region::register`] keeps it as the spare it is given).
    pub fn holds_len(&self, len: usize) -> bool {
        class_for(len) == Some(self.class)
    }

    /// The bytes of its element.
    fn bytes(&self) -> usize {
        CLASS_BYTES[self.class]
    }

    /// Installs the map as entry `id` of `outer` (the program's array of
    /// its class), unless it is there already: a map handed back by
    /// [`Region::unregister`] goes back to the ring it came from, whose
    /// array and entry do not change.
    fn install(&mut self, outer: BorrowedFd<'_>, id: u32) -> Result<()> {
        if self.installed.as_ref().is_some_and(|&(_, i)| i == id) {
            return Ok(());
        }
        let raw = self.map.as_raw_fd();
        // SAFETY: key and value valid for the call.
        let rc = unsafe {
            libbpf_sys::bpf_map_update_elem(
                outer.as_raw_fd(),
                (&raw const id).cast::<c_void>(),
                (&raw const raw).cast::<c_void>(),
                libbpf_sys::BPF_ANY as u64,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(-rc))
                .with_context(|| format!("installing region {id}"));
        }
        self.installed = Some((outer.try_clone_to_owned()?, id));
        Ok(())
    }

    /// Whether the view alone maps the pages of its bytes [at, at + n)
    /// (`at` and `n` page-aligned): every one present in it and mapped
    /// exclusively (`/proc/self/pagemap` bit 56: one mapping in the whole
    /// system). Not so when the caller moved pages of its buffer elsewhere
    /// (`mremap`, a `realloc`) or a forked child still maps the view.
    fn mapped_by_view_alone(&self, at: usize, n: usize) -> bool {
        const ALONE: u64 = 1 << 63 | 1 << 56;
        let mut entries = [0u8; 8 * 512];
        let first = (self.view.as_ptr() as usize + at) / PAGE;
        let mut page = 0;
        while page < n / PAGE {
            let count = (n / PAGE - page).min(512);
            let bytes = &mut entries[..8 * count];
            if self
                .pagemap
                .read_exact_at(bytes, ((first + page) * 8) as u64)
                .is_err()
            {
                return false;
            }
            let alone = bytes.chunks_exact(8).all(|e| {
                e.try_into()
                    .is_ok_and(|e| u64::from_ne_bytes(e) & ALONE == ALONE)
            });
            if !alone {
                return false;
            }
            page += count;
        }
        true
    }
}

impl Drop for RegionMap {
    /// Takes the map out of its class's array: XDP drops the frames of an
    /// operation that still names it.
    fn drop(&mut self) {
        HELD_BYTES.fetch_sub(self.bytes(), Ordering::Relaxed);
        if std::process::id() != self.pid {
            return;
        }
        if let Some((outer, id)) = &self.installed {
            // SAFETY: key valid for the call.
            unsafe {
                libbpf_sys::bpf_map_delete_elem(
                    outer.as_raw_fd(),
                    (&raw const *id).cast::<c_void>(),
                )
            };
        }
    }
}

/// One registered buffer: its map and view, and its pages held.
pub struct Region {
    // First: dropped first, so the buffer gets its own pages back (read
    // through its mapping of the map) before the view goes.
    held: Held,
    store: RegionMap,
}

/// A buffer [base, base + len) whose whole pages [first, last) are a
/// region map's, watched through guard `guard`; dropping it gives them back.
struct Held {
    id: u32,
    /// The process that registered it: a forked child that drops its copy
    /// of the ring leaves the parent's region alone.
    pid: u32,
    base: usize,
    len: usize,
    first: usize,
    last: usize,
    guard: usize,
}

impl Held {
    /// The region's byte offset of the buffer's byte at `addr`.
    fn offset_at(&self, addr: usize) -> usize {
        HEAD + self.base % PAGE + (addr - self.base)
    }
}

impl Region {
    /// Registers `buf` for the ring of `token`: in `spare` (the map the
    /// ring's buffer before had, see [`Region::unregister`]) if it is of
    /// the class `buf` needs, else a new map, installed as entry `id` of
    /// the program's array of that class (`outers`, by class), whose pages
    /// become `buf`'s whole pages. `buf` must have one at least.
    pub fn register(
        outers: [BorrowedFd<'_>; CLASSES],
        id: u32,
        token: u32,
        buf: &[u8],
        spare: Option<RegionMap>,
    ) -> Result<Region> {
        ensure!(id < wire::ERAR_MAX_REGIONS, "region {id} out of range");
        let (base, len) = (buf.as_ptr() as usize, buf.len());
        let class = class_for(len).with_context(|| format!("{len} bytes do not fit a region"))?;
        let first = base.div_ceil(PAGE) * PAGE;
        let last = (base + len) / PAGE * PAGE;
        ensure!(last > first, "no whole page in {len} bytes");
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        ensure!(
            page == PAGE as libc::c_long,
            "pages of {page} bytes, not {PAGE}"
        );
        install_handlers()?;
        ensure!(
            !sigbus_taken_over(),
            "the program replaced liberar's SIGBUS action with its own"
        );
        // A spare of another class leaves its array (dropped) first.
        let store = match spare.filter(|s| s.holds_len(len)) {
            Some(spare) => spare,
            None => RegionMap::new(class)?,
        };
        let guard = claim_guard(first, last)?;
        let mut region = Region {
            held: Held {
                id,
                pid: std::process::id(),
                base,
                len,
                first,
                last,
                guard,
            },
            store,
        };
        // (Dropped on an error below: the guard is released, the buffer
        // keeps or gets back its own pages.)
        let view = region.store.view.as_ptr();
        let (n, at, end) = (
            last - first,
            region.held.offset_at(first),
            region.held.offset_at(base + len),
        );
        // SAFETY: the view is bytes() long and no other mapping shares its
        // pages (a new map, or one unregister found so). [first, last)
        // lies within `buf`, [at, at + n) within the view, and so does
        // the last chunk's padding after the buffer's end (len <=
        // max_buffer(bytes()): class_for), which the root's last frame
        // carries: zeros, as in a new map, not a buffer's before.
        unsafe {
            view.cast::<u32>().write(token);
            std::ptr::write_bytes(view.add(end), 0, wire::ERAR_MAX_CHUNK_BYTES as usize);
            std::ptr::copy_nonoverlapping(first as *const u8, view.add(at), n)
        };
        // SAFETY: a new shared mapping of the region's pages from `at` (a
        // multiple of the page: the buffer keeps its offset in its page),
        // moved over the buffer's whole pages, which hold the same bytes.
        unsafe {
            let tmp = libc::mmap(
                std::ptr::null_mut(),
                n,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                region.store.map.as_raw_fd(),
                at as libc::off_t,
            );
            if tmp == libc::MAP_FAILED {
                bail!("mapping a region: {}", std::io::Error::last_os_error());
            }
            if let Err(e) = move_pages(tmp, n, first, true) {
                libc::munmap(tmp, n);
                bail!("moving a region over the caller's buffer: {e}");
            }
        }
        region.store.install(outers[class], id)?;
        Ok(region)
    }

    /// Gives the buffer its own pages back, as dropping the region does,
    /// and hands back its map for the ring's next buffer if the view alone
    /// maps the pages the buffer had: a page still mapped elsewhere (moved
    /// by the caller, or a forked child's) would show that buffer's bytes
    /// there. XDP no longer reads or writes them: the broadcast that last
    /// used the buffer ended with a barrier every host passed once it held
    /// every chunk, and the frames of an operation before the armed one are
    /// dropped before they reach a region.
    pub fn unregister(self) -> Option<RegionMap> {
        let Region { held, store } = self;
        let (at, n) = (held.offset_at(held.first), held.last - held.first);
        let ours = held.pid == std::process::id();
        drop(held);
        (ours && store.mapped_by_view_alone(at, n)).then_some(store)
    }

    /// The region as XDP names it (erar_slot_ctl's in_region and
    /// out_region, less one): its entry in its class's array, after the
    /// classes before.
    pub fn id(&self) -> u32 {
        self.store.class as u32 * wire::ERAR_MAX_REGIONS + self.held.id
    }

    /// Whether `buf` is the registered buffer and its pages are still the
    /// region's (see [`Region::intact`]).
    pub fn holds(&self, buf: &[u8]) -> bool {
        (buf.as_ptr() as usize, buf.len()) == (self.held.base, self.held.len) && self.intact()
    }

    /// Whether some whole page of `buf` is one of the region's.
    pub fn overlaps(&self, buf: &[u8]) -> bool {
        let (start, end) = (buf.as_ptr() as usize, buf.as_ptr() as usize + buf.len());
        start.div_ceil(PAGE) * PAGE < self.held.last && self.held.first < end / PAGE * PAGE
    }

    /// Whether the buffer's pages are still the region's: none faulted in
    /// anew by the SIGBUS handler, and its first and last page shared
    /// pages (not pages the caller mapped after freeing it). Two reads of
    /// `/proc/self/pagemap`.
    fn intact(&self) -> bool {
        !GUARDS[self.held.guard].faulted.load(Ordering::Acquire)
            && [self.held.first, self.held.last - PAGE]
                .iter()
                .all(|&page| {
                    let mut entry = [0u8; 8];
                    let at = (page / PAGE * 8) as u64;
                    self.store.pagemap.read_exact_at(&mut entry, at).is_ok()
                        && u64::from_ne_bytes(entry) & SHARED == SHARED
                })
    }

    /// The region's byte offset of `part`'s first byte (`part` within the
    /// registered buffer).
    pub fn offset_of(&self, part: &[u8]) -> u32 {
        self.held.offset_at(part.as_ptr() as usize) as u32
    }

    /// Copies the bytes of `part` outside the region's pages (the buffer's
    /// partial first and last pages) into the region.
    pub fn copy_edges_in(&self, part: &[u8]) {
        for (a, b) in self.edges(part) {
            // SAFETY: [a, b) lies within `part`, the region's bytes from
            // offset_at(a) within the view (register checked the buffer).
            unsafe {
                let to = self.store.view.as_ptr().add(self.held.offset_at(a));
                std::ptr::copy_nonoverlapping(a as *const u8, to, b - a)
            };
        }
    }

    /// Copies the region's bytes of `part` outside its pages to `part`.
    pub fn copy_edges_out(&self, part: &mut [u8]) {
        for (a, b) in self.edges(part) {
            // SAFETY: as in copy_edges_in, the other way.
            unsafe {
                let from = self.store.view.as_ptr().add(self.held.offset_at(a));
                std::ptr::copy_nonoverlapping(from, a as *mut u8, b - a)
            };
        }
    }

    /// Writes `bytes` into the region `at` bytes from the start of `part`,
    /// the buffer's last part, past its end (`at >= part.len()`): bytes of
    /// the region that are no page of the caller's (its last chunk's
    /// padding, which XDP reads with the chunk). False, nothing written,
    /// for a place that is not so.
    pub fn write_past_end(&self, part: &[u8], at: usize, bytes: &[u8]) -> bool {
        let Some(to) = self.past_end(part, at, bytes.len()) else {
            return false;
        };
        // SAFETY: past_end checked that [to, to + len) lies within the
        // view and past the buffer's bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), to, bytes.len()) };
        true
    }

    /// Reads what [`Region::write_past_end`] writes (once XDP wrote the
    /// chunk there). False, nothing read, for a place that is not so.
    pub fn read_past_end(&self, part: &[u8], at: usize, bytes: &mut [u8]) -> bool {
        let Some(from) = self.past_end(part, at, bytes.len()) else {
            return false;
        };
        // SAFETY: as in write_past_end.
        unsafe { std::ptr::copy_nonoverlapping(from, bytes.as_mut_ptr(), bytes.len()) };
        true
    }

    /// The view's address of the byte `at` past `part`'s start, if `part`
    /// ends where the buffer does, `at >= part.len()` and `len` bytes from
    /// there lie within the view.
    fn past_end(&self, part: &[u8], at: usize, len: usize) -> Option<*mut u8> {
        let start = part.as_ptr() as usize;
        let ends_here = start + part.len() == self.held.base + self.held.len;
        if !ends_here || start < self.held.base || at < part.len() {
            return None;
        }
        let off = self.held.offset_at(start).checked_add(at)?;
        (off.checked_add(len)? <= self.store.bytes())
            // SAFETY: off + len <= bytes(), the view's length.
            .then(|| unsafe { self.store.view.as_ptr().add(off) })
    }

    /// The byte ranges of `part` before and after the region's pages.
    fn edges(&self, part: &[u8]) -> [(usize, usize); 2] {
        let (start, end) = (part.as_ptr() as usize, part.as_ptr() as usize + part.len());
        let clip = |(a, b): (usize, usize)| if a < b { (a, b) } else { (a, a) };
        [
            clip((start, end.min(self.held.first))),
            clip((start.max(self.held.last), end)),
        ]
    }
}

impl Drop for Held {
    /// Gives the buffer's pages that are still the region's private pages
    /// again, with their bytes (pages the caller unmapped or mapped anew
    /// are left alone). (The map leaves its class's array when it is dropped.)
    fn drop(&mut self) {
        // A forked child's copy: its pages are private already (in_child).
        if std::process::id() != self.pid {
            return;
        }
        // SAFETY: [first, last) is page-aligned, its guard still held
        // (released just after).
        unsafe { give_private_runs(self.first, self.last - self.first, true) };
        release_guard(self.guard);
    }
}

/// Gives the pages of [first, first + n) that are still a BPF map's (see
/// [`bpf_map_ranges`]) private pages with the same bytes, mapping by
/// mapping. Pages the caller unmapped, or mapped anew, are left alone:
/// reading them could fault. A page of the map an allocator dropped faults
/// in the copy, and the SIGBUS handler gives it a zero page, as it does for
/// the caller: so the caller of this function must still hold the range's
/// guard. `notify`: tell an MPI's registration cache (not in a forked
/// child). System calls and buffers on the stack only: the fork handler
/// uses it.
///
/// # Safety
/// `first` and `n` page-aligned; the range's guard held.
unsafe fn give_private_runs(first: usize, n: usize, notify: bool) {
    bpf_map_ranges(first, first + n, |a, b| {
        // SAFETY: [a, b) is a mapping of a BPF map (readable: a dropped
        // page is mended by the handler), page-aligned.
        unsafe { give_private_pages(a, b - a, notify) }
    });
}

/// Replaces `n` bytes of pages at `first` by private anonymous pages with
/// the same bytes (one `mremap` over them). System calls, not their libc
/// wrappers, which an MPI's memory hooks may interpose.
///
/// # Safety
/// [first, first + n) must be mapped and readable, page-aligned.
unsafe fn give_private_pages(first: usize, n: usize, notify: bool) {
    // Populated: one system call faults every page in, where the copy
    // below took a page fault a page.
    let anon = libc::syscall(
        libc::SYS_mmap,
        0usize,
        n,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
        -1,
        0,
    );
    if anon < 0 {
        return;
    }
    let anon = anon as *mut c_void;
    std::ptr::copy_nonoverlapping(first as *const u8, anon.cast::<u8>(), n);
    if move_pages(anon, n, first, notify).is_err() {
        libc::syscall(libc::SYS_munmap, anon, n);
    }
}

/// Moves the `n` bytes of mappings at `from` to `to`, replacing what was
/// mapped there (one `mremap`, atomic for other threads). The system call
/// itself: an MPI's memory hooks may interpose `mremap` without its fifth
/// argument (UCX's, under MPICH, did: the pages went elsewhere).
///
/// # Safety
/// `from` must be a mapping of `n` bytes this module made; `to` page-aligned.
unsafe fn move_pages(from: *mut c_void, n: usize, to: usize, notify: bool) -> std::io::Result<()> {
    let flags = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
    let at = libc::syscall(libc::SYS_mremap, from, n, n, flags, to);
    if at == -1 {
        return Err(std::io::Error::last_os_error());
    }
    if at as usize != to {
        return Err(std::io::Error::other(format!(
            "mremap moved to {at:#x}, not {to:#x}"
        )));
    }
    if notify {
        forget_old_pages(to, n);
    }
    Ok(())
}

/// Tells UCX's memory hooks (if the MPI loaded them) that the pages at
/// [addr, addr + n) were replaced, as the `mremap` they did not see would
/// have: its registration cache must not reuse the old ones.
fn forget_old_pages(addr: usize, n: usize) {
    type Unmapped = unsafe extern "C" fn(*mut c_void, usize);
    static HOOK: std::sync::OnceLock<Option<Unmapped>> = std::sync::OnceLock::new();
    let hook = HOOK.get_or_init(|| {
        // SAFETY: a lookup by a constant name; the symbol, if present, is
        // UCX's `void ucm_vm_munmap(void *addr, size_t length)`.
        let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"ucm_vm_munmap".as_ptr()) };
        (!f.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, Unmapped>(f) })
    });
    if let Some(f) = hook {
        // SAFETY: UCX's notification, with a range this module just moved.
        unsafe { f(addr as *mut c_void, n) };
    }
}

/// The registered ranges, for the SIGBUS and fork handlers (which may not
/// lock): `start` 0 is a free guard.
struct Guard {
    start: AtomicUsize,
    end: AtomicUsize,
    faulted: AtomicBool,
}

const GUARD_COUNT: usize = wire::ERAR_MAX_REGIONS as usize;
#[allow(clippy::declare_interior_mutable_const)]
const FREE: Guard = Guard {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};
static GUARDS: [Guard; GUARD_COUNT] = [FREE; GUARD_COUNT];

/// A guard for the pages [start, end), which no other region may hold:
/// the pages would be the later one's, and the earlier one would take
/// them for its own (see [`Region::holds`]).
fn claim_guard(start: usize, end: usize) -> Result<usize> {
    if let Some(g) = GUARDS.iter().find(|g| {
        let s = g.start.load(Ordering::Acquire);
        s != 0 && s < end && start < g.end.load(Ordering::Acquire)
    }) {
        bail!(
            "pages {start:#x}..{end:#x} overlap a registered buffer's ({:#x}..)",
            g.start.load(Ordering::Relaxed)
        );
    }
    for (i, g) in GUARDS.iter().enumerate() {
        if g.start
            .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            g.faulted.store(false, Ordering::Release);
            g.end.store(end, Ordering::Release);
            g.start.store(start, Ordering::Release);
            return Ok(i);
        }
    }
    bail!("every region guard is taken")
}

fn release_guard(i: usize) {
    GUARDS[i].start.store(0, Ordering::Release);
}

/// The SIGBUS action before ours, called for faults outside regions.
static mut PREVIOUS: Option<libc::sigaction> = None;

/// Whether install_handlers() installed ours.
static INSTALLED: AtomicBool = AtomicBool::new(false);

fn install_handlers() -> Result<()> {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: the previous action is read and stored before ours is
        // installed (a zeroed sigaction with our handler and SA_SIGINFO),
        // once (call_once).
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut old) != 0 {
                return;
            }
            PREVIOUS = Some(old);
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigbus as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut act.sa_mask);
            if libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut()) != 0 {
                return;
            }
            if libc::pthread_atfork(None, None, Some(in_child)) != 0 {
                return;
            }
        }
        INSTALLED.store(true, Ordering::Release);
    });
    ensure!(
        INSTALLED.load(Ordering::Acquire),
        "could not install the SIGBUS and fork handlers"
    );
    Ok(())
}

/// Whether the process's SIGBUS action, once liberar's (a region was
/// registered), is now another: a program or runtime that installs its own
/// after ours (Python's `faulthandler` enabled late, a JVM) would get the
/// faults of registered pages, which it cannot repair. The rings then give
/// their regions up and register none any more. One system call.
pub fn sigbus_taken_over() -> bool {
    if !INSTALLED.load(Ordering::Acquire) {
        return false;
    }
    // SAFETY: a query (no new action) into a zeroed struct.
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut cur) == 0
            && cur.sa_sigaction != on_sigbus as *const () as usize
    }
}

/// Calls `f(a, b)` for each part [a, b) of [lo, hi) that `/proc/self/maps`
/// shows as a mapping of a BPF map (`anon_inode:bpf-map`): a region's pages,
/// not what the caller mapped where it freed a registered buffer whose
/// region lives on (a file there must fault into its own handler, and its
/// pages stay the caller's). Returns false if the file cannot be read.
/// System calls and buffers on the stack only: the SIGBUS and fork
/// handlers call it.
fn bpf_map_ranges(lo: usize, hi: usize, mut f: impl FnMut(usize, usize)) -> bool {
    const NAME: &[u8] = b"anon_inode:bpf-map";
    // SAFETY: open, read and close with a constant path and a buffer on
    // the stack, all async-signal-safe.
    let fd = unsafe {
        libc::open(
            c"/proc/self/maps".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return false;
    }
    // Per line: its range (the hex digits before '-' and before the first
    // space) and its last NAME.len() bytes (a ring).
    let (mut start, mut end, mut field) = (0usize, 0usize, 0u8);
    let (mut tail, mut len) = ([0u8; NAME.len()], 0usize);
    let mut buf = [0u8; 4096];
    let read = loop {
        // SAFETY: `buf` is writable for its length.
        let got = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        match usize::try_from(got) {
            Ok(0) => break true,
            Ok(got) => {
                for &b in &buf[..got] {
                    if b == b'\n' {
                        let k = len % NAME.len();
                        let named =
                            len >= NAME.len() && tail[k..].iter().chain(&tail[..k]).eq(NAME.iter());
                        if named && start.max(lo) < end.min(hi) {
                            f(start.max(lo), end.min(hi));
                        }
                        (start, end, field, len) = (0, 0, 0, 0);
                        continue;
                    }
                    tail[len % NAME.len()] = b;
                    len += 1;
                    let digit = (b as char).to_digit(16).map(|d| d as usize);
                    match (field, b, digit) {
                        (0, b'-', _) => field = 1,
                        (0, _, Some(d)) => start = start << 4 | d,
                        (1, b' ', _) => field = 2,
                        (1, _, Some(d)) => end = end << 4 | d,
                        _ => {}
                    }
                }
            }
            Err(_) => break false,
        }
    };
    // SAFETY: the descriptor opened above.
    unsafe { libc::close(fd) };
    read
}

/// Whether `addr` lies in a mapping of a BPF map (see [`bpf_map_ranges`]);
/// true if `/proc/self/maps` cannot be read (a guard's range is then taken
/// as the region's).
fn in_bpf_map(addr: usize) -> bool {
    let mut found = false;
    let read = bpf_map_ranges(addr, addr + 1, |_, _| found = true);
    found || !read
}

/// A fault in a registered range, on a mapping of a BPF map, is a page
/// whose mapping an allocator dropped (`MADV_DONTNEED` on a freed buffer):
/// it gets the zero page that anonymous memory would have read, and the
/// region is registered anew at its next use. Any other SIGBUS goes to the
/// action before ours, also one in a range whose buffer the caller freed
/// and mapped something else over while its region lives on.
extern "C" fn on_sigbus(sig: i32, info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for g in &GUARDS {
        let (start, end) = (
            g.start.load(Ordering::Acquire),
            g.end.load(Ordering::Acquire),
        );
        if start != 0 && start != usize::MAX && (start..end).contains(&addr) && in_bpf_map(addr) {
            g.faulted.store(true, Ordering::Release);
            let page = addr / PAGE * PAGE;
            // SAFETY: a private zero page over one page of the region's
            // mapping in the caller's range: the system call itself
            // (async-signal-safe, unlike an MPI's hooks on `mmap`).
            unsafe {
                libc::syscall(
                    libc::SYS_mmap,
                    page,
                    PAGE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            return;
        }
    }
    // SAFETY: PREVIOUS was written once, before this handler was installed.
    let previous = unsafe { (*std::ptr::addr_of!(PREVIOUS)).as_ref() };
    match previous {
        Some(old) if old.sa_sigaction == libc::SIG_IGN => {}
        Some(old) if old.sa_sigaction != libc::SIG_DFL => {
            if old.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous handler, with the arguments it expects.
                let f: extern "C" fn(i32, *mut libc::siginfo_t, *mut c_void) =
                    unsafe { std::mem::transmute(old.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: as above, a handler of one argument.
                let f: extern "C" fn(i32) = unsafe { std::mem::transmute(old.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // The default action: restore it; the access faults again and
            // the process ends as it would have without us.
            // SAFETY: resetting a signal's action is async-signal-safe.
            unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        }
    }
}

/// In a child after `fork`: registered pages become private copies, so
/// that parent and child no longer share them. Only pages still the
/// region's: the caller may have freed the buffer since it was registered.
extern "C" fn in_child() {
    for g in &GUARDS {
        let (start, end) = (
            g.start.load(Ordering::Acquire),
            g.end.load(Ordering::Acquire),
        );
        if start != 0 && start != usize::MAX {
            // SAFETY: a registered range (page-aligned), its guard held
            // until just after.
            unsafe { give_private_runs(start, end - start, false) };
            g.start.store(0, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer takes the smallest class that holds it with the head, its
    /// offset in a page and the last chunk's padding: 1, 4, 16 and 64 MiB
    /// of buffer each, and 15 640 bytes more (32 KiB of padding, less a
    /// page of head, a page of offset and an 8936-byte chunk).
    #[test]
    fn buffers_take_the_smallest_class_that_holds_them() {
        const MIB: usize = 1 << 20;
        const SLACK: usize = 32768 - 2 * 4096 - 8936;
        for (len, class) in [
            (256 << 10, Some(0)),
            (MIB + SLACK, Some(0)),
            (MIB + SLACK + 1, Some(1)),
            (4 * MIB, Some(1)),
            (12 * MIB, Some(2)),
            (16 * MIB + SLACK + 1, Some(3)),
            (64 * MIB + SLACK, Some(3)),
            (64 * MIB + SLACK + 1, None),
        ] {
            assert_eq!(class_for(len), class, "{len} bytes");
        }
        assert_eq!(REGION_MAX_BUFFER, 64 * MIB + SLACK);
    }
}
