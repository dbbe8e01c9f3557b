//! Who is at the other end of a unix socket: the peer's pid as the kernel
//! recorded it at connect (SO_PEERCRED), for the servers that hand out
//! kernel memory by fd (the agent's leases, a node path's slot buffers).

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// The pid of the process at the other end of `conn`.
pub(crate) fn peer_pid(conn: &UnixStream) -> std::io::Result<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes into `cred`.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.pid)
}
