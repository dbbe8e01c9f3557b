//! Slot geometry: which `chunk_bytes` × `chunks_per_slot` a slot may have,
//! which one a loaded program was built with, and mapping sizes rounded to
//! whole pages.

use anyhow::{anyhow, ensure, Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle};

use super::load::skel;
use super::wire;

/// (chunk_bytes, chunks_per_slot) of a loaded erar_ring, from its frozen
/// .rodata map.
pub(super) fn geometry_of(rodata: &MapHandle) -> Result<(u32, u32)> {
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
pub(super) fn check_geometry(chunk_bytes: u32, chunks_per_slot: u32) -> Result<()> {
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

pub(super) fn page_round(len: usize) -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    len.div_ceil(page).max(1) * page
}
