//! Loading erar_ring in this process: the skeleton, sized to the slot
//! geometry and verified, with `erar_xdp` attached to the interface through
//! a bpf_link; kept by this process ([`HostDatapath::attach`]) or pinned for
//! the node agent ([`HostDatapath::load_and_pin`]); and the geometry a
//! loaded program was built with ([`geometry_of`]).
//!
//! [`HostDatapath::attach`]: super::HostDatapath::attach
//! [`HostDatapath::load_and_pin`]: super::HostDatapath::load_and_pin

use crate::datapath::iface::if_index;
use std::mem::{ManuallyDrop, MaybeUninit};
use std::os::fd::AsFd;
use std::path::Path;
use std::ptr::NonNull;

use anyhow::{anyhow, ensure, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{Link, MapCore, MapFlags, OpenObject};

use super::geometry::check_geometry;
use super::slot::{self, SlotMaps};
use super::wire;
use crate::datapath::{bpfobj, contract};

#[allow(clippy::all, clippy::pedantic, unsafe_op_in_unsafe_fn, dead_code)]
#[allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
pub(super) mod skel {
    include!(concat!(env!("OUT_DIR"), "/erar_ring.skel.rs"));
}
use skel::{ErarRingSkel, ErarRingSkelBuilder};

/// For [`HostDatapath::attach`](super::HostDatapath::attach) and
/// [`load_and_pin`]: checks the geometry, then loads erar_ring sized to it
/// and attaches `erar_xdp` to `ifname` ([`OwnDatapath::load`]); returns it
/// and the interface's index.
pub(super) fn load_own(
    ifname: &str,
    chunk_bytes: u32,
    chunks_per_slot: u32,
) -> Result<(OwnDatapath, u32)> {
    check_geometry(chunk_bytes, chunks_per_slot)?;
    let ifindex = if_index(ifname)?;
    let own = OwnDatapath::load(chunk_bytes, chunks_per_slot, ifname, ifindex)?;
    Ok((own, ifindex))
}

/// [`HostDatapath::load_and_pin`](super::HostDatapath::load_and_pin):
/// loads and attaches exactly as `attach` does, pins the program, the link
/// and every map into `dir`, and lets go of them.
pub(super) fn load_and_pin(
    ifname: &str,
    chunk_bytes: u32,
    chunks_per_slot: u32,
    dir: &Path,
) -> Result<PinnedIds> {
    let (mut own, _) = load_own(ifname, chunk_bytes, chunks_per_slot)?;
    let pin = |what: &str, r: libbpf_rs::Result<()>| {
        r.with_context(|| format!("pinning {what} in {}", dir.display()))
    };
    let skel = &mut *own.skel;
    pin(
        "erar_xdp",
        skel.progs.erar_xdp.pin(dir.join(contract::PIN_PROG)),
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
    pin("stats", skel.maps.stats.pin(dir.join(contract::PIN_STATS)))?;
    pin(
        "rodata",
        skel.maps.rodata.pin(dir.join(contract::PIN_RODATA)),
    )?;
    let prog_fd = skel.progs.erar_xdp.as_fd().try_clone_to_owned()?;
    let link = own
        .link
        .as_mut()
        .ok_or_else(|| anyhow!("no link after attaching"))?;
    pin("link", link.pin(dir.join(contract::PIN_LINK)))?;
    let ids = PinnedIds {
        prog_id: bpfobj::prog_id(&prog_fd).context("reading erar_xdp's id")?,
    };
    // Closing our fds now leaves the pins as the only references (the
    // link is not detached: libbpf only closes its fd).
    drop(own);
    Ok(ids)
}

/// (chunk_bytes, chunks_per_slot) of a loaded erar_ring, from its frozen
/// .rodata map.
pub(super) fn geometry_of(rodata: &impl MapCore) -> Result<(u32, u32)> {
    let consts = consts_of(rodata)?;
    let (chunk_bytes, chunks_per_slot) = (consts.erar_chunk_bytes, consts.erar_chunks_per_slot);
    check_geometry(chunk_bytes, chunks_per_slot)?;
    Ok((chunk_bytes, chunks_per_slot))
}

/// The load-time constants of a loaded erar_ring, from its frozen .rodata map.
pub(super) fn consts_of(rodata: &impl MapCore) -> Result<skel::types::rodata> {
    let ro = rodata
        .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
        .context("reading rodata")?
        .ok_or_else(|| anyhow!("rodata has no value"))?;
    let consts_len = std::mem::size_of::<skel::types::rodata>();
    ensure!(ro.len() >= consts_len, "rodata is {} bytes", ro.len());
    // SAFETY: at least size_of bytes of u32s, any bit pattern valid.
    Ok(unsafe { std::ptr::read_unaligned(ro.as_ptr().cast()) })
}

/// This process's own skeleton and link.
pub(super) struct OwnDatapath {
    pub(super) link: Option<Link>,
    pub(super) skel: ManuallyDrop<ErarRingSkel<'static>>,
    /// Storage of the libbpf object that `skel` borrows ('static is a lie
    /// told to the borrow checker; Drop ends `skel` before this box).
    obj: NonNull<MaybeUninit<OpenObject>>,
    pub(super) prog_id: u32,
    /// Its slot locks exist: other processes may share it.
    pub(super) published: bool,
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
        let load_into = |frag_slices| {
            let consts = (chunk_bytes, chunks_per_slot, frag_slices);
            Self::load_into(obj, consts, ifname, ifindex)
        };
        // Jumbo chunks reach XDP in fragments, combined in place through a
        // kfunc that some kernels refuse to XDP; those get the program that
        // combines fragments through a copy. The first try is quiet: its
        // verifier log would only say that.
        let loaded = if chunk_bytes > wire::ERAR_MAX_LINEAR_CHUNK_BYTES {
            let print = libbpf_rs::set_print(None);
            let first = load_into(true);
            libbpf_rs::set_print(print);
            first.or_else(|e| {
                log::debug!(
                    "liberar: erar_xdp with fragments combined in place did not load ({e:#}); \
                     loading it with fragments combined through a copy"
                );
                load_into(false)
            })
        } else {
            load_into(true)
        };
        match loaded {
            Ok((skel, link)) => {
                let prog_id = skel
                    .progs
                    .erar_xdp
                    .as_fd()
                    .try_clone_to_owned()
                    .and_then(|fd| bpfobj::prog_id(&fd));
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

    /// One try of [`Self::load`], with the load-time constants
    /// (chunk_bytes, chunks_per_slot, frag_slices).
    fn load_into(
        obj: NonNull<MaybeUninit<OpenObject>>,
        (chunk_bytes, chunks_per_slot, frag_slices): (u32, u32, bool),
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
            ro.erar_frag_slices = u32::from(frag_slices);
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

/// What [`HostDatapath::load_and_pin`](super::HostDatapath::load_and_pin)
/// pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedIds {
    pub prog_id: u32,
}
