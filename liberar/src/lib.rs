//! liberar core: everything the preload library needs that is not MPI's ABI.
//!
//! One `MPI_Allreduce` call flows: `pmpi-shim` (C/Fortran entry, handle
//! translation) → [`select::decide`] (eligible, or PMPI with a reason) →
//! [`tuning`] (the path measured faster for this class of call) →
//! [`datapath`] (ring setup, numerics encode, in-kernel ring, decode) → back
//! to the shim, which returns to the caller.

pub mod config;
pub mod datapath;
pub mod numerics;
pub mod select;
pub mod stats;
pub mod tuning;
