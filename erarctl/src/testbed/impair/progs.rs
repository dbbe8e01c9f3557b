//! Looking up a loaded BPF program by id (its name and maps), and reading
//! the native-endian `u64` counters its per-CPU maps hold.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{bail, Context, Result};
use libbpf_rs::{MapCore, MapHandle};

/// Name and map ids of a loaded BPF program.
pub(super) fn prog_info(id: u32) -> Result<(String, Vec<u32>)> {
    // SAFETY: plain syscall wrapper.
    let fd = unsafe { libbpf_sys::bpf_prog_get_fd_by_id(id) };
    if fd < 0 {
        return Err(std::io::Error::from_raw_os_error(-fd))
            .with_context(|| format!("opening BPF program id {id}"));
    }
    // SAFETY: a fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut ids: Vec<u32> = Vec::new();
    // Twice: the first call tells how many maps, the second fills them in.
    for _ in 0..2 {
        // SAFETY: zero is a valid bpf_prog_info.
        let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
        info.nr_map_ids = ids.len() as u32;
        info.map_ids = ids.as_mut_ptr() as u64;
        let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
        // SAFETY: info and ids (nr_map_ids entries) outlive the call.
        let ret =
            unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
        if ret != 0 {
            return Err(std::io::Error::from_raw_os_error(-ret))
                .with_context(|| format!("reading the info of BPF program id {id}"));
        }
        let n = info.nr_map_ids as usize;
        if n <= ids.len() {
            ids.truncate(n);
            // SAFETY: the kernel NUL-terminates the name (16 bytes).
            let name = unsafe { CStr::from_ptr(info.name.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            return Ok((name, ids));
        }
        ids.resize(n, 0);
    }
    bail!("BPF program id {id} keeps gaining maps")
}

/// The maps of `prog_id`, by name.
pub(super) fn prog_maps(prog_id: u32, names: &[&str]) -> Result<Vec<Option<MapHandle>>> {
    let (_, ids) = prog_info(prog_id)?;
    let mut found: Vec<Option<MapHandle>> = names.iter().map(|_| None).collect();
    for id in ids {
        let Ok(m) = MapHandle::from_map_id(id) else {
            continue;
        };
        let name = m.name().to_string_lossy().into_owned();
        if let Some(i) = names.iter().position(|n| *n == name) {
            found[i] = Some(m);
        }
    }
    Ok(found)
}

pub(super) fn u64_of(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    let n = b.len().min(8);
    w[..n].copy_from_slice(&b[..n]);
    u64::from_ne_bytes(w)
}
