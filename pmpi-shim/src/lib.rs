//! liberar.so: preloaded into MPI programs, it defines `MPI_Allreduce` and
//! `MPI_Bcast` (in `collective.rs`; for Open MPI, their Fortran bindings in
//! `fortran.rs`) and `MPI_Init`/`MPI_Finalize` (here), routes large
//! calls to the eBPF datapath and everything else to the real MPI through
//! PMPI, with the same semantics.
//!
//! Loading the library does nothing: no constructors, no references to MPI
//! symbols resolved at load time (PMPI_ functions and Open MPI's predefined
//! handles are found with dlsym at the first intercepted call). So it can be
//! preloaded into the launcher, a shell or python without an MPI in sight.

mod collective;
mod comm;
mod ffi;
#[cfg(not(feature = "mpich"))]
mod fortran;
mod node;
mod packing;
mod pmpi_comm;
mod rt;
mod trials;

use ffi::MPI_SUCCESS;
use rt::pmpi;
use std::os::raw::{c_char, c_int};

/// # Safety
/// As `MPI_Init`.
#[no_mangle]
pub unsafe extern "C" fn MPI_Init(argc: *mut c_int, argv: *mut *mut *mut c_char) -> c_int {
    let rc = pmpi().PMPI_Init(argc, argv);
    if rc == MPI_SUCCESS {
        rt::after_init();
    }
    rc
}

/// # Safety
/// As `MPI_Init_thread`.
#[no_mangle]
pub unsafe extern "C" fn MPI_Init_thread(
    argc: *mut c_int,
    argv: *mut *mut *mut c_char,
    required: c_int,
    provided: *mut c_int,
) -> c_int {
    let rc = pmpi().PMPI_Init_thread(argc, argv, required, provided);
    if rc == MPI_SUCCESS {
        rt::after_init();
    }
    rc
}

/// The finalize work (stats line, ring teardown) runs from MPI_COMM_SELF's
/// attribute callback inside PMPI_Finalize; see `rt::install_finalize_hook`.
///
/// # Safety
/// As `MPI_Finalize`.
#[no_mangle]
pub unsafe extern "C" fn MPI_Finalize() -> c_int {
    pmpi().PMPI_Finalize()
}
