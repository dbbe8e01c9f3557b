//! The operator's side of liberar, apart from what a job links: the
//! emulated Ethernet cluster the tests and benchmarks run on ([`testbed`])
//! and the node checks of `erarctl doctor` ([`doctor`]). The `erarctl`
//! binary (`main.rs`) is their command line, and the node agent's.
//!
//! Imports point one way: this crate uses `liberar` (the datapath, its
//! agent contract, the wire format); `liberar`, and so `liberar.so`, knows
//! nothing of it.

pub mod doctor;
pub mod testbed;
