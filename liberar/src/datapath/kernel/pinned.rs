//! Opening the node agent's pinned datapath ([`HostDatapath::open_pinned`]):
//! its program and read-only maps by BPF_OBJ_GET, checked against what runs
//! on the interface; nothing is loaded or attached.
//!
//! [`HostDatapath::open_pinned`]: super::HostDatapath::open_pinned

use std::os::fd::{AsFd, OwnedFd};

use libbpf_rs::MapHandle;

use super::load::geometry_of;
use super::{slot, wire};
use crate::datapath::bpfobj;
use crate::datapath::contract::{self, AgentError, AgentPaths};
use crate::datapath::iface::if_index;

/// [`HostDatapath::open_pinned`](super::HostDatapath::open_pinned): opens
/// the node agent's datapath on `ifname` by BPF_OBJ_GET and checks it;
/// returns it with the interface's index and the agent's (chunk_bytes,
/// chunks_per_slot), read from the program's own constants.
pub(super) fn open(ifname: &str) -> Result<(PinnedDatapath, u32, u32, u32), AgentError> {
    let paths = AgentPaths::current(ifname).map_err(|e| AgentError::Unusable {
        dir: "?".into(),
        why: format!("{e:#}"),
    })?;
    let unusable = |why: String| AgentError::Unusable {
        dir: paths.pin_dir.clone(),
        why,
    };
    if let Err(e) = std::fs::metadata(&paths.pin_dir) {
        return Err(AgentError::opening(&paths, &paths.pin_dir, &e));
    }
    let open = |name: &str, read_only: bool| {
        let path = paths.pin(name);
        bpfobj::open_pin(&path, read_only).map_err(|e| AgentError::opening(&paths, &path, &e))
    };
    let map = |name: &str, read_only: bool| -> Result<MapHandle, AgentError> {
        let path = paths.pin(name);
        let flags = if read_only {
            libbpf_sys::BPF_F_RDONLY
        } else {
            0
        };
        MapHandle::from_pinned_path_with_file_flags(&path, flags).map_err(|e| {
            let kind = match e.kind() {
                libbpf_rs::ErrorKind::PermissionDenied => std::io::ErrorKind::PermissionDenied,
                libbpf_rs::ErrorKind::NotFound => std::io::ErrorKind::NotFound,
                _ => std::io::ErrorKind::Other,
            };
            AgentError::opening(&paths, &path, &std::io::Error::new(kind, e.to_string()))
        })
    };
    let prog = open(contract::PIN_PROG, false)?;
    let info = contract::check_info(&paths)?;
    let ifindex = if_index(ifname).map_err(|e| unusable(format!("{e:#}")))?;

    // The program must be the one attached to this interface: the
    // agent's link is not readable here (any holder of a link fd could
    // detach it), so ask the kernel what runs on the interface.
    let id = bpfobj::prog_id(&prog).map_err(|e| unusable(format!("program info: {e}")))?;
    let attached = bpfobj::attached_xdp_prog(ifindex)
        .map_err(|e| unusable(format!("XDP query on {ifname}: {e}")))?;
    if attached != id {
        return Err(unusable(format!(
            "its erar_xdp (id {id}) is not what runs on {ifname} (XDP program id \
             {attached}): the agent is stale, restart it"
        )));
    }

    let rodata = map(contract::PIN_RODATA, true)?;
    let (chunk_bytes, chunks_per_slot) =
        geometry_of(&rodata).map_err(|e| unusable(format!("{e:#}")))?;
    if (info.chunk_bytes, info.chunks_per_slot) != (chunk_bytes, chunks_per_slot) {
        return Err(unusable(format!(
            "agent.info says {}x{} but the program has {chunk_bytes}x{chunks_per_slot}",
            info.chunk_bytes, info.chunks_per_slot
        )));
    }

    let stats = map(contract::PIN_STATS, true)?;
    slot::check_map(
        stats.as_fd(),
        "stats",
        libbpf_sys::BPF_MAP_TYPE_PERCPU_ARRAY,
        std::mem::size_of::<wire::erar_stats>() as u32,
        1,
    )
    .map_err(|e| unusable(format!("{e:#}")))?;
    // Slots come from the agent, one lease each (see Self::claim).
    let socket = paths.lease_socket();
    if let Err(e) = std::fs::metadata(&socket) {
        return Err(AgentError::opening(&paths, &socket, &e));
    }
    log::debug!(
        "liberar: using the agent's datapath on {ifname} ({}): chunk_bytes {chunk_bytes}, \
         chunks_per_slot {chunks_per_slot}",
        paths.pin_dir.display()
    );
    let pinned = PinnedDatapath {
        prog,
        stats,
        rodata,
        paths,
    };
    Ok((pinned, ifindex, chunk_bytes, chunks_per_slot))
}

/// The node agent's objects, opened by BPF_OBJ_GET.
pub(super) struct PinnedDatapath {
    pub(super) prog: OwnedFd,
    pub(super) stats: MapHandle,
    /// Its load-time constants (frozen).
    pub(super) rodata: MapHandle,
    pub(super) paths: AgentPaths,
}
