//! The eBPF fast path: ring setup over PMPI, the in-kernel ring, numerics at
//! the edges.
//!
//! * [`kernel`] loads and drives the XDP programs on this host (one per
//!   process): the per-slot mmapable buffer, arming, injection, completion.
//! * [`ring`] learns the ring's members over the communicator and runs one
//!   collective on it: encode → arm → barrier → inject → wait → agree → decode.
//! * [`codec`] says how each (type, op, precision) travels: wire op, slot
//!   layout, and float SUM's agreed scales, encoding and decoding; which
//!   (type, op) the kernel reduces at all is [`wire_ops`]' one table.
//! * [`reproducible`] completes float SUM through MPI with the bits the
//!   ring gives (`ERAR_PRECISION=reproducible`).
//! * [`node`] spans several ranks on a host: they reduce through shared
//!   memory and each of the first few leads a slice across hosts on its
//!   own ring.
//! * [`lanes`] spreads a broadcast root's copy and injection over its CPUs.
//! * [`agent`] is the node agent's side: `erarctl agent start` pins an
//!   attached datapath with group permissions, so that unprivileged jobs
//!   open it instead of loading their own.

pub mod affinity;
pub mod agent;
pub mod bpfobj;
pub mod codec;
pub mod contract;
mod copy;
pub mod iface;
pub mod kernel;
pub mod lanes;
pub mod liveness;
mod mapping;
pub mod node;
mod peer;
pub mod reproducible;
pub mod ring;
pub mod wire;
pub mod wire_ops;

use crate::select::{ElemType, ReduceOp};

/// Why the fast path did not complete a call.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// Nothing was written to the caller's buffers, and every rank of the
    /// communicator reached the same verdict: the caller completes the call
    /// through PMPI.
    #[error("fast path declined: {0}")]
    Declined(String),
    /// The call failed and must be reported as an MPI error (the buffers
    /// hold the caller's data unchanged).
    #[error("fast path failed: {0}")]
    Failed(String),
}

/// A reduction as MPI names it: the element type and the op.
pub type Reduction = (ElemType, ReduceOp);

/// What an exchange of the fast path returns.
pub type Done = Result<(), DatapathError>;

/// What the datapath needs from a communicator. The shim implements it over
/// raw PMPI calls on the caller's communicator (never over `MPI_*`, which
/// would re-enter the shim).
///
/// Every method is collective: all ranks call it in the same order.
pub trait Comm {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// `all.len() == mine.len() * size()`; rank r's bytes land at `r * mine.len()`.
    fn allgather(&self, mine: &[u8], all: &mut [u8]) -> Result<(), DatapathError>;
    /// Element-wise maximum over ranks, in place.
    fn allreduce_max_i32(&self, buf: &mut [i32]) -> Result<(), DatapathError>;
    /// The same, for an exchange whose wait has no bound by design (the
    /// first of a call: a rank may arrive late): while it waits, `watch` is
    /// called every few hundred microseconds at most; its error abandons
    /// the exchange and is returned (a peer is known to be gone).
    fn allreduce_max_i32_watched(
        &self,
        buf: &mut [i32],
        watch: &mut dyn FnMut() -> Result<(), DatapathError>,
    ) -> Result<(), DatapathError>;
    /// Completes `recv = reduce(send or recv)` over a sub-range of the call
    /// through the real MPI, with the call's own datatype and op. `send` is
    /// `None` for in-place.
    fn pmpi_allreduce(&self, send: Option<&[u8]>, recv: &mut [u8], how: Reduction) -> Done;
    /// Completes a broadcast of `buf` (bytes) from `root` through the real
    /// MPI.
    fn pmpi_bcast(&self, buf: &mut [u8], root: usize) -> Result<(), DatapathError>;
    /// From now on (`Some`), `allgather` and `allreduce_max_i32`
    /// fail with `Failed` instead of blocking past `deadline`: a peer that
    /// died or lost its link mid-call must not hang the survivors. Set only
    /// once every rank is inside the call (so a late rank is never taken for
    /// a dead one); `None` restores plain blocking calls.
    fn set_deadline(&self, deadline: Option<std::time::Instant>);
    /// Lets MPI move the messages it has in flight (not collective, no
    /// message is received). A rank that waits in the kernel (a barrier in
    /// XDP, a ring's completion, a host's shared-memory barrier) calls it
    /// while it waits: MPI may return from a collective with part of its
    /// sends still queued, and a peer blocked in that collective needs
    /// them before it can reach the kernel's barrier (a deadlock otherwise:
    /// 8 hosts, a float allreduce on MPI right after the first fast call,
    /// 4 of 8 jobs of `allreduce_sweep`).
    fn progress(&self) {}
}
