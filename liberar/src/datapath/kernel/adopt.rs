//! Sharing a process-owned datapath with the other jobs of a host (no
//! agent).
//!
//! Without the node agent, each process loads and attaches its own
//! erar_xdp, and an interface takes one XDP program: a second job on the
//! host found it taken and fell back to MPI, and two jobs that started
//! together split the hosts between them and both fell back for good. Now
//! the process that finds another erar_xdp of this build on the interface
//! *adopts* it: it opens the program and its maps by id and takes a
//! reference to its bpf_link, so the program stays attached while the
//! adopter uses it, also after its owner has exited. Like attaching, this
//! needs root (ids become fds only with CAP_SYS_ADMIN).
//!
//! Owner and adopters share the slots through lock files, exactly as jobs
//! share the agent's: `/run/liberar/own/<program id>/slot-<N>.lock`, with
//! `build` holding the owner's build fingerprint (an adopter of another
//! build would misread the maps).

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;

use anyhow::{anyhow, bail, ensure, Context, Result};
use libbpf_rs::{MapCore, MapHandle};

use super::load::geometry_of;
use super::slot;
use super::{wire, MAX_SLOTS};
use crate::datapath::iface::if_index;
use crate::datapath::{bpfobj, contract};

/// Where the slot locks of the process-owned program `prog_id` live.
pub(super) fn own_dir(prog_id: u32) -> PathBuf {
    PathBuf::from(format!("/run/liberar/own/{prog_id}"))
}

const BUILD_FILE: &str = "build";

/// For the owner of a freshly attached program: its lock files and build
/// fingerprint, so other processes can adopt it. Directories of programs
/// that no longer exist are removed on the way.
pub(super) fn publish(prog_id: u32) -> Result<()> {
    let dir = own_dir(prog_id);
    if let Some(parent) = dir.parent() {
        remove_stale(parent);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for slot in 0..MAX_SLOTS {
        let p = dir.join(format!("slot-{slot}.lock"));
        std::fs::File::create(&p).with_context(|| format!("creating {}", p.display()))?;
    }
    let tmp = dir.join(".build.tmp");
    std::fs::write(&tmp, contract::fingerprint())
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(BUILD_FILE))
        .with_context(|| format!("creating {}", dir.join(BUILD_FILE).display()))
}

/// Removes the lock directories of programs that are gone.
fn remove_stale(parent: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let Some(id) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        // SAFETY: plain syscall wrapper.
        let fd = unsafe { libbpf_sys::bpf_prog_get_fd_by_id(id) };
        if fd >= 0 {
            // SAFETY: a new fd we own.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        } else if fd == -libc::ENOENT {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Takes an fd returned by a libbpf_sys "get fd by id" call.
fn owned(fd: i32, what: &str) -> Result<OwnedFd> {
    if fd < 0 {
        return Err(std::io::Error::from_raw_os_error(-fd)).with_context(|| what.to_owned());
    }
    // SAFETY: a new fd the call gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Name and map ids of a program.
fn prog_info(prog: &OwnedFd) -> Result<(String, Vec<u32>)> {
    use std::os::fd::AsRawFd;
    let mut ids = [0u32; 32];
    // SAFETY: zeroed info is valid input; map_ids points to `ids`.
    let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    info.nr_map_ids = ids.len() as u32;
    info.map_ids = ids.as_mut_ptr() as u64;
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: info and ids outlive the call.
    let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(prog.as_raw_fd(), &mut info, &mut len) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(-rc)).context("program info");
    }
    // SAFETY: the kernel NUL-terminates the 16-byte name.
    let name = unsafe { std::ffi::CStr::from_ptr(info.name.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let n = (info.nr_map_ids as usize).min(ids.len());
    Ok((name, ids[..n].to_vec()))
}

/// The bpf_link that attaches program `prog_id` to `ifindex` (XDP).
fn xdp_link(ifindex: u32, prog_id: u32) -> Result<OwnedFd> {
    let mut id = 0u32;
    loop {
        // SAFETY: writes the next id.
        if unsafe { libbpf_sys::bpf_link_get_next_id(id, &mut id) } != 0 {
            bail!("no bpf_link attaches program {prog_id} to ifindex {ifindex}");
        }
        // SAFETY: plain syscall wrapper.
        let Ok(fd) = owned(unsafe { libbpf_sys::bpf_link_get_fd_by_id(id) }, "link") else {
            continue; // gone meanwhile
        };
        if matches!(bpfobj::xdp_link_info(&fd), Ok((i, p)) if i == ifindex && p == prog_id) {
            return Ok(fd);
        }
    }
}

/// Another process's datapath, adopted: fds only.
pub(super) struct AdoptedDatapath {
    pub(super) prog: OwnedFd,
    pub(super) stats: MapHandle,
    pub(super) prog_id: u32,
    /// The program's arrays of maps, in [`slot::OUTER_MAPS`] order.
    pub(super) outers: [MapHandle; 5],
    /// Its load-time constants (frozen).
    pub(super) rodata: MapHandle,
    /// Keeps the program attached while we use it.
    _link: OwnedFd,
}

/// [`HostDatapath::adopt`](super::HostDatapath::adopt): opens the erar_xdp
/// of this build that another process attached to `ifname` (see the module
/// docs); returns it with the interface's index and the program's
/// (chunk_bytes, chunks_per_slot).
pub(super) fn open(ifname: &str) -> Result<(AdoptedDatapath, u32, u32, u32)> {
    let ifindex = if_index(ifname)?;
    let prog_id =
        bpfobj::attached_xdp_prog(ifindex).with_context(|| format!("XDP query on {ifname}"))?;
    ensure!(prog_id != 0, "no XDP program on {ifname}");
    // SAFETY: plain syscall wrapper.
    let prog = owned(
        unsafe { libbpf_sys::bpf_prog_get_fd_by_id(prog_id) },
        "opening the attached program by id",
    )?;
    let (name, map_ids) = prog_info(&prog)?;
    ensure!(
        name == "erar_xdp",
        "{ifname} runs XDP program {prog_id} ({name:?}), not liberar's"
    );
    // The owner publishes once its program is attached (slots' maps are
    // made at their first use, by whichever process); two jobs that
    // start together meet here while it is still at it.
    let build_file = own_dir(prog_id).join(BUILD_FILE);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while !build_file.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let build = std::fs::read_to_string(&build_file)
        .with_context(|| format!("program {prog_id} on {ifname} was not published for sharing"))?;
    ensure!(
        build.trim() == contract::fingerprint(),
        "program {prog_id} on {ifname} is another build of erar_ring ({}, this library is {})",
        build.trim(),
        contract::fingerprint()
    );
    let link = xdp_link(ifindex, prog_id)?;
    let mut maps = std::collections::BTreeMap::new();
    for id in map_ids {
        let m = MapHandle::from_map_id(id).with_context(|| format!("opening map {id}"))?;
        maps.insert(m.name().to_string_lossy().into_owned(), m);
    }
    // libbpf names the object's .rodata "<object prefix>.rodata".
    if let Some(k) = maps.keys().find(|k| k.ends_with(".rodata")).cloned() {
        if let Some(m) = maps.remove(&k) {
            maps.insert(".rodata".into(), m);
        }
    }
    let mut take = |name: &str| {
        maps.remove(name)
            .ok_or_else(|| anyhow!("program {prog_id} has no map {name}"))
    };
    let stats = take("stats")?;
    slot::check_map(
        stats.as_fd(),
        "stats",
        libbpf_sys::BPF_MAP_TYPE_PERCPU_ARRAY,
        std::mem::size_of::<wire::erar_stats>() as u32,
        1,
    )?;
    let outers = [
        take(slot::OUTER_MAPS[0])?,
        take(slot::OUTER_MAPS[1])?,
        take(slot::OUTER_MAPS[2])?,
        take(slot::OUTER_MAPS[3])?,
        take(slot::OUTER_MAPS[4])?,
    ];
    let rodata = take(".rodata")?;
    let (chunk_bytes, chunks_per_slot) = geometry_of(&rodata)?;
    log::debug!(
        "liberar: sharing erar_xdp {prog_id} on {ifname} (attached by another process): \
         chunk_bytes {chunk_bytes}, chunks_per_slot {chunks_per_slot}"
    );
    let adopted = AdoptedDatapath {
        prog,
        stats,
        prog_id,
        outers,
        rodata,
        _link: link,
    };
    Ok((adopted, ifindex, chunk_bytes, chunks_per_slot))
}

use std::os::fd::AsFd as _;
