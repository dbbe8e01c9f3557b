//! The MPI ABI as seen from Rust: bindgen's output for the installed mpi.h
//! (the PMPI_ table, handle types, the C handle table's layout).

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    unsafe_op_in_unsafe_fn,
    clippy::all
)]
mod generated {
    include!(concat!(env!("OUT_DIR"), "/pmpi.rs"));
}

pub use generated::*;

use std::os::raw::{c_int, c_void};

/// The standard fixes `MPI_SUCCESS` at 0; needed before the handle table can
/// be filled (at `MPI_Init`).
pub const MPI_SUCCESS: c_int = 0;

extern "C" {
    /// csrc/handles.c: expands mpi.h's handle macros (through dlsym on `lib`
    /// for Open MPI).
    pub fn erar_fill_handles(h: *mut erar_handles, lib: *mut c_void);
}

/// A predefined-handle check that works for both ABIs: Open MPI's handles are
/// pointers (null when dlsym found nothing), MPICH's are integers.
pub trait RawHandle: Copy + PartialEq {
    fn is_zero(self) -> bool;
}

impl<T> RawHandle for *mut T {
    #[inline]
    fn is_zero(self) -> bool {
        self.is_null()
    }
}

impl RawHandle for c_int {
    #[inline]
    fn is_zero(self) -> bool {
        self == 0
    }
}

/// `MPI_Comm` made storable in statics. MPI handles are plain values that any
/// thread may use; only the raw-pointer representation of Open MPI's makes
/// them `!Send` in Rust.
#[derive(Clone, Copy, PartialEq)]
pub struct SendComm(pub MPI_Comm);
// SAFETY: see the type's doc; the handle is only passed back to MPI.
unsafe impl Send for SendComm {}
