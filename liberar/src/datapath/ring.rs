//! One communicator's ring on the eBPF datapath: how it is set up over the
//! communicator, and the per-call flow of an allreduce on it.
//!
//! Every decision that could differ between ranks (an interface missing, a
//! frame lost, a NaN in one rank's data) is agreed through the communicator
//! before anyone acts on it, so all ranks always take the same path.
//!
//! This file holds the [`Ring`] and its sizes; the rest is one job a file:
//! * `ring/claims.rs`: this process's datapath and the slots its rings hold
//!   (host identity, slot locks and leases);
//! * `ring/setup.rs`: establishing a ring over a communicator
//!   ([`Ring::establish`]);
//! * `ring/call.rs`: one allreduce or broadcast call, segment by segment:
//!   prepare (encode, arm), run, finish (decode), or complete it by MPI;
//! * `ring/armed.rs`: the exchanges around one armed operation and its run:
//!   the barrier (call key, seq, rescale), inject, wait, and then either the
//!   verdict (with a bounded float SUM's repairs) and loss recovery, or, for
//!   an operation run alone, nothing more: NACKs alone repair its losses;
//! * `ring/sum_alone.rs`: a float SUM segment run alone, its scales agreed
//!   and its repairs gathered through the ring itself (no MPI exchange);
//! * `ring/tune.rs`: whether a large exact call runs as one operation or
//!   in cache-sized segments, learned from the calls alike on every rank.
//!
//! Generations: a ring holds two slots and its operations take them in
//! turn (seq parity). An operation run alone returns as soon as its host holds every chunk, with no verdict, and
//! leaves its slot armed: a host still
//! missing a frame of it is answered by this host's XDP while this host
//! runs the next operation on the other slot. The slot is armed again two
//! operations later, after the barrier of the operation in between, which
//! every host reached only once it had completed this one.

use super::codec::FloatSum;
use super::kernel::region::Region;
use super::kernel::HostDatapath;
use super::liveness::Prober;
use super::{Comm, DatapathError};
use crate::config::Config;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;
use tune::Tuner;

mod armed;
mod call;
mod claims;
mod registered;
mod setup;
mod sum_alone;
mod tune;

pub use setup::Hosts;

/// Chunks per slot: with 3336-byte chunks, 26 MiB of wire data per slot
/// and operation, 52 MiB of kernel memory per ring and host.
/// Larger messages run as consecutive segments; each segment boundary costs
/// a barrier and an agreement round plus the ring's fill and drain, so
/// fewer, larger segments are faster (9 MiB segments measured slower).
const CHUNKS_PER_SLOT: u32 = 8192;

/// A ring's chunks are the largest all its ranks' MTUs allow (the kernel
/// driver's chunk-size rule, re-exported where ring setup uses it).
pub use super::kernel::chunk_bytes_for_mtu;

/// Chunks per slot of this build's rings (a node agent's datapath needs at
/// least as many).
pub const RING_CHUNKS_PER_SLOT: u32 = CHUNKS_PER_SLOT;

/// One communicator's ring on the eBPF datapath. Created collectively on the
/// communicator's first accelerated call; the shim keeps it in a communicator
/// attribute and drops it when the communicator is freed.
pub struct Ring {
    host: Arc<HostDatapath>,
    /// The ring's two slots (generations), taken in turn by seq parity.
    slots: [u32; 2],
    /// The slot of the current operation (`slots[seq & 1]`).
    slot: u32,
    /// Every rank has NACKs on (agreed at setup): operations run alone past
    /// a barrier in the kernel, with no MPI exchange
    /// ([`Ring::kernel_barrier`], [`Ring::run_alone`]).
    alone: bool,
    /// This rank is its communicator's only one on its host (a ring of one
    /// rank per host; ranks of other communicators may still share the
    /// host): its waits poll while frames come (`Patience::poll_renewed`).
    /// Not on a node path's ring, whose host's other ranks need the CPUs
    /// ([`Ring::serving_node`]).
    host_to_itself: bool,
    ranks: usize,
    seq: u32,
    chunk_bytes: usize,
    /// Float SUM's agreed scales and repairs (kept to reuse allocations).
    float_sum: FloatSum,
    /// The generation whose slot holds the last float SUM segment's
    /// result words: the ring's current one when its finish began (the
    /// repairs' gather runs on the other).
    result_gen: usize,
    /// Loss recovery: this host's chunk stages, everyone's, and the chunks
    /// to re-send (kept to reuse their allocations).
    stages: Vec<u8>,
    all_stages: Vec<u8>,
    resend: Vec<u32>,
    /// Tells a dead peer from a late one in the exchange that opens each
    /// call (None: no socket could be made; that exchange then waits as
    /// long as MPI does).
    prober: Option<Box<Prober>>,
    /// How large exact calls are cut into segments, learned alike on
    /// every rank (ring/tune.rs).
    tuner: Tuner,
    /// The word the last segment carried for the tuner, as the ring
    /// reduced it (set by the segment, taken by its call).
    carried: Option<u64>,
    /// The broadcast buffer registered in this ring's region, if any: XDP
    /// reads and writes it in place (kernel/region.rs).
    region: Option<Region>,
    /// Registering failed once (no region on this datapath), or the
    /// program took SIGBUS over: the ring copies through its slots from
    /// then on.
    region_failed: bool,
    /// The last broadcast buffer (address, length): one broadcast twice
    /// in a row is registered.
    last_bcast: (usize, usize),
    /// The send and receive buffers of an exact allreduce registered in
    /// this ring's regions, if any: XDP reads the one and writes the other
    /// in place (ring/registered.rs).
    allreduce_regions: Option<(Region, Region)>,
    /// The last such allreduce's buffers (send and receive addresses,
    /// length).
    last_allreduce: (usize, usize, usize),
}

impl Ring {
    /// Ends the ring collectively: once every rank is here, no host still
    /// waits for a frame of an operation this host completed, and its slots
    /// may stop answering. Called by every rank of the communicator (at
    /// its free, or at finalize); the slots are given back when the ring
    /// is dropped, whatever the barrier's outcome.
    pub fn close(self, comm: &dyn Comm) -> Result<(), DatapathError> {
        let mut nothing = [0i32; 1];
        comm.allreduce_max_i32(&mut nothing)
    }

    /// This ring as a node path's: its rank shares its host with the
    /// host's other ranks, which need the CPUs while it waits, so a wait of
    /// its polls for `ERAR_POLL_US` in all (see that setting), not for that
    /// long after each progress. One rank per host, OSU `osu_bcast` and
    /// `-T mpi_int`, 1-64 MiB, 6 alternating rounds each, renewed against
    /// not: 1.00-1.24x best and 1.02-1.33x median (bcast), 1.03-1.36x and
    /// 0.96-1.32x (int); `-T mpi_float` 1-16 MiB 0.83-1.05x and 0.97-1.10x.
    /// 8 ranks on 4 hosts, int 1-16 MiB: 0.91-1.04x and 0.92-1.06x, within
    /// the noise of the same build against itself (docs/benchmarks.md,
    /// "Sessions 40-41").
    pub fn serving_node(mut self) -> Ring {
        self.host_to_itself = false;
        self
    }

    /// New fds of the ring's two slot buffers (in generation order, see
    /// [`Ring::allreduce_kept`]) and the bytes each holds: for the other
    /// ranks of this rank's host, which read results there
    /// (datapath/node/slots.rs).
    pub fn slot_buffer_fds(&self) -> Result<([OwnedFd; 2], usize), DatapathError> {
        let fd = |slot: u32| {
            self.host
                .slot_buffer_fd(slot)
                .map_err(|e| DatapathError::Failed(format!("{e:#}")))
        };
        Ok((
            [fd(self.slots[0])?, fd(self.slots[1])?],
            self.host.slot_bytes(),
        ))
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        for slot in self.slots {
            self.host.disarm(slot);
            claims::release_slot(&self.host, slot);
        }
    }
}

fn retry_quiet() -> Duration {
    Duration::from_millis(Config::get().retry_ms)
}
