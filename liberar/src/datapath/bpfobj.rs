//! Queries of BPF objects, for the agent and its jobs alike: a pinned
//! object by path (BPF_OBJ_GET), a program's id, an XDP link's program and
//! interface, and which XDP program an interface has attached. No
//! privilege is needed beyond the pins' file permissions.

use std::ffi::CString;
use std::io::ErrorKind;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

fn obj_get(path: &Path, flags: u32) -> std::io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| std::io::Error::from(ErrorKind::InvalidInput))?;
    let opts = libbpf_sys::bpf_obj_get_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_obj_get_opts>() as _,
        file_flags: flags,
        ..Default::default()
    };
    // SAFETY: c is a valid path; opts is initialized.
    let fd = unsafe { libbpf_sys::bpf_obj_get_opts(c.as_ptr(), &opts) };
    if fd < 0 {
        return Err(std::io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: a new fd from BPF_OBJ_GET.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Opens a pinned object (BPF_OBJ_GET) read-write, or read-only.
pub fn open_pin(path: &Path, read_only: bool) -> std::io::Result<OwnedFd> {
    obj_get(
        path,
        if read_only {
            libbpf_sys::BPF_F_RDONLY
        } else {
            0
        },
    )
}

/// Id of the BPF program `fd`.
pub fn prog_id(fd: &OwnedFd) -> std::io::Result<u32> {
    let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: info is len bytes.
    let rc = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(-rc));
    }
    Ok(info.id)
}

/// (ifindex, prog id) of XDP link `fd`; ifindex 0 once the link is defunct.
pub fn xdp_link_info(fd: &OwnedFd) -> std::io::Result<(u32, u32)> {
    let mut info: libbpf_sys::bpf_link_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_link_info>() as u32;
    // SAFETY: info is len bytes.
    let rc = unsafe { libbpf_sys::bpf_link_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(-rc));
    }
    // SAFETY: an XDP link fills the xdp member.
    Ok((unsafe { info.__bindgen_anon_1.xdp.ifindex }, info.prog_id))
}

/// Id of the XDP program attached to `ifindex` in this namespace (0: none).
/// Netlink; no privilege needed.
pub fn attached_xdp_prog(ifindex: u32) -> std::io::Result<u32> {
    let mut id = 0u32;
    // SAFETY: writes id.
    let rc = unsafe { libbpf_sys::bpf_xdp_query_id(ifindex as i32, 0, &mut id) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(-rc));
    }
    Ok(id)
}
