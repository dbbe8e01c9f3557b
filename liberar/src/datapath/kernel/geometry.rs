//! Slot geometry: the chunk size an MTU allows and which ones are usable
//! (the one chunk-size rule), which `chunk_bytes` × `chunks_per_slot` a
//! slot may have, and mapping sizes rounded to whole pages.

use anyhow::{ensure, Result};

use super::wire;

/// The one chunk-size rule, part one: the largest chunk a frame carries on
/// an interface of this MTU (the MTU counts from the IPv4 header: IPv4,
/// UDP and erar headers, then the payload), a multiple of ERAR_CHUNK_ALIGN,
/// at most ERAR_MAX_CHUNK_BYTES. Below ERAR_MIN_CHUNK_BYTES on a small
/// MTU: [`check_chunk_bytes`] says whether it is usable.
pub fn chunk_bytes_for_mtu(mtu: u32) -> u32 {
    let room = mtu.saturating_sub(wire::ERAR_PAYLOAD_OFF - wire::ERAR_IP_OFF);
    (room.min(wire::ERAR_MAX_CHUNK_BYTES) / wire::ERAR_CHUNK_ALIGN) * wire::ERAR_CHUNK_ALIGN
}

/// The largest MTU whose chunks one BPF_PROG_RUN live frame carries
/// (ERAR_MAX_LINEAR_CHUNK_BYTES): above it, chunks are jumbo (sent from
/// user space, see `kernel/raw.rs`).
pub const LINEAR_MTU: u32 =
    wire::ERAR_MAX_LINEAR_CHUNK_BYTES + (wire::ERAR_PAYLOAD_OFF - wire::ERAR_IP_OFF);

/// The one chunk-size rule, part two: a chunk size the program can be
/// built with (erar_wire.h's limits; the reduce loops work on whole u64
/// words, and only then is a slot one contiguous buffer in the mmap).
pub fn check_chunk_bytes(chunk_bytes: u32) -> Result<()> {
    ensure!(
        (wire::ERAR_MIN_CHUNK_BYTES..=wire::ERAR_MAX_CHUNK_BYTES).contains(&chunk_bytes)
            && chunk_bytes.is_multiple_of(wire::ERAR_CHUNK_ALIGN),
        "chunk_bytes {chunk_bytes} must be a multiple of {} in {}..={}",
        wire::ERAR_CHUNK_ALIGN,
        wire::ERAR_MIN_CHUNK_BYTES,
        wire::ERAR_MAX_CHUNK_BYTES
    );
    Ok(())
}

/// Checks a slot geometry.
pub(super) fn check_geometry(chunk_bytes: u32, chunks_per_slot: u32) -> Result<()> {
    check_chunk_bytes(chunk_bytes)?;
    ensure!(chunks_per_slot > 0, "chunks_per_slot must be positive");
    Ok(())
}

pub(super) fn page_round(len: usize) -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    len.div_ceil(page).max(1) * page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_fits_the_mtu() {
        assert_eq!(chunk_bytes_for_mtu(1500) % 8, 0);
        assert!(chunk_bytes_for_mtu(1500) + wire::ERAR_PAYLOAD_OFF <= 1514);
        assert_eq!(
            chunk_bytes_for_mtu(9000),
            wire::ERAR_MAX_CHUNK_BYTES / 8 * 8
        );
        assert_eq!(chunk_bytes_for_mtu(9000), 8936);
        assert_eq!(
            chunk_bytes_for_mtu(LINEAR_MTU),
            wire::ERAR_MAX_LINEAR_CHUNK_BYTES
        );
        assert!(chunk_bytes_for_mtu(LINEAR_MTU + 8) > wire::ERAR_MAX_LINEAR_CHUNK_BYTES);
        assert!(check_chunk_bytes(chunk_bytes_for_mtu(1500)).is_ok());
        assert!(check_chunk_bytes(chunk_bytes_for_mtu(100)).is_err());
        assert!(check_chunk_bytes(wire::ERAR_MIN_CHUNK_BYTES + 4).is_err());
    }
}
