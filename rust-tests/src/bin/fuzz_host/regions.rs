//! The registered buffers (regions, "Registered buffers" in erar_wire.h)
//! the fuzzer gives the program: maps made as liberar's kernel/region.rs
//! makes them, one of the smallest size class and one of the largest, each
//! installed in an entry of its class's array (the other entries, and the
//! other classes' arrays, stay empty), and the two windows of each that an
//! armed operation can reach, which the model keeps after its slot buffers
//! and compares with the kernel's.
//!
//! Region r (an operation's in_region or out_region, less one) is entry
//! r % ERAR_MAX_REGIONS of class r / ERAR_MAX_REGIONS. Its byte `o` is
//! where an operation armed with offset `off` finds chunk c at `o = off +
//! c * chunk_bytes`, if `o` lies in [ERAR_REGION_HEAD, its class's bytes -
//! ERAR_MAX_CHUNK_BYTES] and the region's first word (its head) is the
//! slot's token; otherwise the frame is dropped with `region_err`. The
//! offsets the generator arms with ([`pick_offset`]) keep every chunk that
//! can be reached inside one of the two windows: the low one from byte 0
//! (the head) to a page and a slot's chunks past the head, the high one the
//! last chunks' worth before the end.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{anyhow, ensure, Context, Result};
use liberar::datapath::wire;

use crate::maps::{map_info, Mmap};
use crate::rng::Rng;

pub const HEAD: usize = wire::ERAR_REGION_HEAD as usize;
const MAX_CHUNK: usize = wire::ERAR_MAX_CHUNK_BYTES as usize;
const PAGE: usize = 4096;
const ENTRIES: u32 = wire::ERAR_MAX_REGIONS;

/// The program's arrays of region maps, by class, and their maps' bytes
/// (erar_maps.h, erar_wire.h).
const CLASSES: [(&str, u32); wire::ERAR_REGION_CLASSES as usize] = [
    ("regions_1m", wire::ERAR_REGION_BYTES_1M),
    ("regions_4m", wire::ERAR_REGION_BYTES_4M),
    ("regions_16m", wire::ERAR_REGION_BYTES_16M),
    ("regions_64m", wire::ERAR_REGION_BYTES_64M),
];

/// The regions that hold a map, as operations name them; the fuzzer's
/// region k is `INSTALLED[k]`: entry 0 of the smallest class, entry 3 of
/// the largest. An operation may name any region (or one past the last),
/// and those without a map drop its frames.
pub const INSTALLED: [u32; 2] = [0, 3 * ENTRIES + 3];

/// The regions an operation is armed with: the installed ones mostly, an
/// empty entry of an installed class, an entry of a class with none, and
/// one past the last class.
pub const ARMABLE: [u32; 7] = [
    INSTALLED[0],
    INSTALLED[1],
    INSTALLED[0],
    INSTALLED[1],
    5,
    ENTRIES,
    ENTRIES * CLASSES.len() as u32,
];

/// The bytes of region `region`'s map (its class's), None past the last
/// class.
pub fn region_bytes(region: u32) -> Option<usize> {
    let class = (region / ENTRIES) as usize;
    CLASSES.get(class).map(|&(_, bytes)| bytes as usize)
}

/// Whether regions `a` and `b` are of one class (an allreduce's pair must
/// be: regions_of() in erar_ring.bpf.c).
pub fn same_class(a: u32, b: u32) -> bool {
    a / ENTRIES == b / ENTRIES
}

/// The two windows of a region of `end` bytes the model keeps, for
/// `cb`-byte chunks and `cps` chunks a slot: [0, lo) and [hi, end), stored
/// one after the other ([`Windows::len`] bytes).
#[derive(Clone, Copy, Debug)]
pub struct Windows {
    lo: usize,
    hi: usize,
    end: usize,
}

impl Windows {
    pub fn new(cb: usize, cps: usize, end: usize) -> Windows {
        let reach = (cps + 1) * cb;
        assert!(
            HEAD + PAGE + reach <= end - MAX_CHUNK - reach,
            "windows overlap"
        );
        Windows {
            lo: HEAD + PAGE + reach,
            hi: end - MAX_CHUNK - reach,
            end,
        }
    }

    /// The region's bytes.
    pub fn end(&self) -> usize {
        self.end
    }

    /// The model's bytes of the region.
    pub fn len(&self) -> usize {
        self.lo + (self.end - self.hi)
    }

    /// Where in a region's model bytes the `cb` bytes at region byte `o`
    /// are. Panics for bytes outside both windows: an offset the generator
    /// never arms with.
    pub fn at(&self, o: usize, cb: usize) -> usize {
        if o + cb <= self.lo {
            o
        } else {
            assert!(
                o >= self.hi && o + cb <= self.end,
                "region byte {o} outside the windows {self:?}"
            );
            self.lo + (o - self.hi)
        }
    }

    /// A region's bytes in the model's layout, read from its mapping.
    pub fn read(&self, view: &Mmap) -> Vec<u8> {
        let all = view.bytes(self.end);
        let mut v = Vec::with_capacity(self.len());
        v.extend_from_slice(&all[..self.lo]);
        v.extend_from_slice(&all[self.hi..]);
        v
    }

    /// The first byte (in the model's layout) where a region's mapping
    /// differs from `model`, its bytes in the model.
    pub fn diff(&self, view: &Mmap, model: &[u8]) -> Option<usize> {
        let all = view.bytes(self.end);
        let (lo, hi) = (
            (&all[..self.lo], &model[..self.lo]),
            (&all[self.hi..], &model[self.lo..]),
        );
        if lo.0 == lo.1 && hi.0 == hi.1 {
            return None;
        }
        let first = |(a, b): (&[u8], &[u8])| a.iter().zip(b).position(|(x, y)| x != y);
        first(lo).or_else(|| first(hi).map(|at| self.lo + at))
    }

    /// Writes a region's bytes in the model's layout through its mapping.
    pub fn write(&self, view: &Mmap, bytes: &[u8]) {
        view.write_at(0, &bytes[..self.lo]);
        view.write_at(self.hi, &bytes[self.lo..]);
    }
}

/// An offset to arm with, for `cb`-byte chunks and `cps` chunks a slot,
/// in a region of `end` bytes: mostly a buffer's, at its offset within its
/// first page after the head; now and then one from which the first
/// chunks fall into the head, or the last ones past the end (each such
/// chunk's frames: `region_err`).
pub fn pick_offset(r: &mut Rng, cb: usize, cps: usize, end: usize) -> u32 {
    let o = match r.below(8) {
        0 => HEAD.saturating_sub(r.range(1, 2 * cb as u64) as usize),
        1 => end - MAX_CHUNK - r.below(cps as u64 + 1) as usize * cb + r.below(cb as u64) as usize,
        _ => HEAD + r.below(PAGE as u64) as usize,
    };
    o as u32
}

/// The fuzzer's regions: a map for each of [`INSTALLED`], installed in
/// the program's array of its class (among `maps`, the program's maps by
/// name), and a read-write mapping of each.
pub fn install(maps: &BTreeMap<String, OwnedFd>) -> Result<Vec<(OwnedFd, Mmap)>> {
    for (name, _) in CLASSES {
        let outer = maps
            .get(name)
            .ok_or_else(|| anyhow!("erar_xdp has no map {name}"))?;
        let mi = map_info(outer)?;
        ensure!(
            mi.type_ == libbpf_sys::BPF_MAP_TYPE_ARRAY_OF_MAPS && mi.max_entries == ENTRIES,
            "map {name} is type {} with {} entries, expected an array of {ENTRIES} maps",
            mi.type_,
            mi.max_entries,
        );
    }
    INSTALLED
        .iter()
        .map(|&region| {
            let (name, bytes) = CLASSES[(region / ENTRIES) as usize];
            let (outer, entry) = (&maps[name], region % ENTRIES);
            // SAFETY: zeroed opts with sz set is the documented default.
            let mut opts: libbpf_sys::bpf_map_create_opts = unsafe { std::mem::zeroed() };
            opts.sz = std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as _;
            opts.map_flags = libbpf_sys::BPF_F_MMAPABLE;
            // SAFETY: a valid name and opts for the duration of the call.
            let fd = unsafe {
                libbpf_sys::bpf_map_create(
                    libbpf_sys::BPF_MAP_TYPE_ARRAY,
                    c"fuzz_region".as_ptr(),
                    4,
                    bytes,
                    1,
                    &opts,
                )
            };
            ensure!(fd >= 0, "creating region map for entry {entry}: {fd}");
            // SAFETY: a new fd we own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            let raw = fd.as_raw_fd();
            // SAFETY: key and value valid for the call.
            let rc = unsafe {
                libbpf_sys::bpf_map_update_elem(
                    outer.as_raw_fd(),
                    (&raw const entry).cast(),
                    (&raw const raw).cast(),
                    libbpf_sys::BPF_ANY as u64,
                )
            };
            ensure!(rc == 0, "installing region entry {entry}: {rc}");
            let view =
                Mmap::writable(&fd, bytes as usize, "a region").context("mapping a region")?;
            Ok((fd, view))
        })
        .collect()
}
