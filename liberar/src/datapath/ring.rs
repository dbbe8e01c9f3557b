//! Ring membership and the per-call flow of one fast-path collective.
//! (Being written: the signatures below are the contract with the shim.)

use super::{Comm, DatapathError};
use crate::select::{ElemType, ReduceOp};

/// One communicator's ring on the eBPF datapath. Created collectively on the
/// communicator's first accelerated call; the shim keeps it in a communicator
/// attribute and drops it when the communicator is freed.
pub struct Ring {
    _private: (),
}

impl Ring {
    /// Collective over `comm`: learns every member's interface, MAC and IPv4
    /// address, and checks that every host has the datapath. Every rank gets
    /// the same verdict: all `Ok`, or all `Err(Declined)`.
    pub fn establish(comm: &dyn Comm) -> Result<Ring, DatapathError> {
        let _ = comm;
        Err(DatapathError::Declined("the eBPF datapath is not built yet".into()))
    }

    /// `recv = op over ranks of (send, or recv when in place)`, bitwise
    /// identical on every rank. `send.len() == recv.len()` when present.
    pub fn allreduce(
        &mut self,
        comm: &dyn Comm,
        send: Option<&[u8]>,
        recv: &mut [u8],
        elem: ElemType,
        op: ReduceOp,
    ) -> Result<(), DatapathError> {
        let _ = (comm, send, recv, elem, op);
        Err(DatapathError::Declined("the eBPF datapath is not built yet".into()))
    }

    /// Broadcast of `buf` (bytes) from `root`.
    pub fn bcast(&mut self, comm: &dyn Comm, buf: &mut [u8], root: usize) -> Result<(), DatapathError> {
        let _ = (comm, buf, root);
        Err(DatapathError::Declined("in-kernel broadcast is not built yet".into()))
    }
}
