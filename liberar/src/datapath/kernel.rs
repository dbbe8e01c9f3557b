//! This host's XDP datapath: loading, attaching, and driving it (see
//! docs/datapath.md for the contract and bpf/erar_ring.bpf.c for the kernel
//! side).
//!
//! One [`HostDatapath`] per process and interface. It owns:
//! * the program: either the loaded `erar_ring` skeleton, with `erar_xdp`
//!   attached to the MPI interface through a bpf_link (the kernel detaches
//!   it when the last holder dies, even on `kill -9`) —
//!   [`HostDatapath::attach`], needs CAP_BPF and CAP_NET_ADMIN; or another
//!   process's, adopted ([`HostDatapath::adopt`], root, see `kernel/adopt.rs`); or
//!   the node agent's pinned one ([`HostDatapath::open_pinned`], no
//!   capability needed, see [`super::agent`]);
//! * the slots it holds (`kernel/slot.rs`): each slot's own maps, mmapped (its
//!   buffer of `chunks_per_slot * chunk_bytes` bytes, its `slot_ctl`, chunk
//!   state words and resend list) and its completion ring buffer. On its
//!   own or an adopted program, the ones it has used (each slot's maps are
//!   made at the slot's first use on the host); on the agent's, the ones
//!   its rings leased ([`HostDatapath::lease`]).
//!
//! Per operation: [`HostDatapath::arm`] → barrier across hosts (in the
//! kernel, [`HostDatapath::join`] and [`HostDatapath::barrier`], or over
//! MPI by the caller) → [`HostDatapath::inject`] → [`HostDatapath::wait`] (which NACKs
//! what it misses when progress pauses), and if that is not enough:
//! [`HostDatapath::stages`] (every host) → [`HostDatapath::resend`] (on each
//! predecessor) → wait again.
//!
//! One job per file:
//! * `kernel/host.rs`: the [`HostDatapath`] value, its constructors, its
//!   backing, the slots it holds and the inject path's state
//!   ([`InjectPacing`]);
//! * `kernel/load.rs`: the skeleton, this process's load and XDP attach
//!   (also for the agent to pin), and a loaded program's geometry;
//!   `kernel/pinned.rs`: the agent's pinned program; `kernel/adopt.rs`:
//!   another process's, shared (each opens its backing for `host.rs`);
//! * `kernel/slot.rs`: one slot's inner maps and their mappings;
//! * `kernel/drive.rs`: configuring, arming, waiting on and disarming a
//!   slot, and its barrier in the kernel ([`BarrierState`]);
//!   `kernel/inject.rs`: BPF_PROG_RUN injection and its pacing, re-sends,
//!   NACKs and READY frames;
//! * `kernel/raw.rs`: jumbo frames' AF_PACKET socket and headers;
//!   `kernel/jumbo.rs`: the inject path's runs for jumbo chunks, through
//!   it (BPF_PROG_RUN's live frames are one page);
//! * `kernel/stats.rs`: the counters ([`KernelStats`]), summed over CPUs;
//! * `kernel/frame.rs`: the frame headers (IPv4 checksum included);
//! * `kernel/geometry.rs`: the chunk-size rule ([`chunk_bytes_for_mtu`],
//!   [`check_chunk_bytes`]), the slot geometry and page rounding.
//!
//! Each file imports only the ones before it in this order (no import
//! cycles): `geometry`, `frame`, `raw` → `slot` → `load` → `adopt`,
//! `pinned` → `host` → `drive` → `jumbo` → `inject`, `stats`.

use super::wire;

mod adopt;
mod drive;
mod frame;
mod geometry;
mod host;
mod inject;
mod jumbo;
mod load;
mod pinned;
mod raw;
pub mod region;
pub mod slot;
mod stats;

pub use drive::{
    BarrierState, BarrierWait, CallKeyWords, Patience, RegionAt, SlotRoute, Trip, Waited,
};
pub use frame::{erar_hdr, hdr_bytes};
pub use geometry::{check_chunk_bytes, chunk_bytes_for_mtu, LINEAR_MTU};
pub use host::{HostDatapath, InjectPacing};
pub use load::PinnedIds;
pub use raw::jumbo_permitted;
pub use stats::KernelStats;

const MAX_SLOTS: u32 = wire::ERAR_MAX_SLOTS;
const PAYLOAD_OFF: usize = wire::ERAR_PAYLOAD_OFF as usize;
