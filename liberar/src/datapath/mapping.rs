//! A shared mapping of a file descriptor (a `BPF_F_MMAPABLE`
//! map's data, a POSIX shared-memory object), unmapped on drop: the one
//! `mmap` of the datapath.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

/// `len` bytes of a descriptor, mapped shared from offset 0.
pub(crate) struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain shared memory; every access through it is either atomic or
// ordered by its owner's protocol (the slot's arm/complete, the node
// barrier), as each user states where it reads or writes.
unsafe impl Send for SharedMapping {}
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps `len` bytes of `fd`; the kernel checks `len` against the map's
    /// or object's size.
    pub(crate) fn new(fd: BorrowedFd<'_>, len: usize) -> std::io::Result<SharedMapping> {
        Self::with_prot(fd, len, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// The same, read-only: a mapping this process only reads (another
    /// process's slot buffer, see datapath/node/slots.rs).
    pub(crate) fn read_only(fd: BorrowedFd<'_>, len: usize) -> std::io::Result<SharedMapping> {
        Self::with_prot(fd, len, libc::PROT_READ)
    }

    fn with_prot(fd: BorrowedFd<'_>, len: usize, prot: i32) -> std::io::Result<SharedMapping> {
        // SAFETY: a fresh shared mapping of a descriptor the caller keeps
        // open for the call; the result is checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(std::io::ErrorKind::InvalidData)?;
        Ok(SharedMapping { ptr, len })
    }

    /// The bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what new() mapped; its owner holds no
        // reference into it any more.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
