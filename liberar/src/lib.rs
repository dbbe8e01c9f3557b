//! liberar core: everything the preload library needs that is not MPI's ABI.
//!
//! One `MPI_Allreduce` call flows: `pmpi-shim` (C/Fortran entry, handle
//! translation) → [`select::decide`] (eligible, and the path measured
//! faster for this class of call; or PMPI with a reason) → [`datapath`]
//! (ring setup, numerics encode, in-kernel ring, decode) → back to the
//! shim, which returns to the caller. `docs/architecture.md` names the file
//! of each step.

pub mod config;
pub mod datapath;
pub mod numerics;
#[cfg(feature = "paired")]
pub mod paired;
pub mod select;
pub mod shape;
pub mod stats;
pub mod trace;
