//! Impairments of the emulated switch: loss, duplication, reordering and
//! chosen-frame drops of datapath frames, to prove the datapath's loss
//! recovery on the test bed.
//!
//! This machine's kernel has no tc netem, and redirected XDP frames bypass
//! qdiscs anyway, so the switch program (bpf/testbed_switch.bpf.c) impairs
//! frames itself, at the port where a frame enters the switch (once per
//! hop). Only datapath frames are touched, never MPI's TCP. The
//! configuration is one `struct erar_impair_cfg` (bpf/include/erar_wire.h)
//! in the switch's `switch_impair` map; [`Switch::open`] finds the maps of
//! the program attached to a port, so any process can change them while
//! jobs run. They reset when the switch is re-attached.
//!
//! * random loss: the frame is dropped, and with `--burst N` the next
//!   N - 1 frames the switch sees on that CPU too (a full queue's drops);
//! * random duplication: the frame is delivered twice (a per-port devmap
//!   lists the port twice and the frame is broadcast to it);
//! * random reordering: the frame is handed to the Linux bridge, whose
//!   software path delivers it after frames sent later on the XDP path;
//! * chosen-frame drops ([`DropRule`]): the first pass of each frame of a
//!   kind, step and chunk selection is dropped, its re-sends pass.
//!
//! Command line: `erarctl testbed impair --loss 1% [--burst N] --dup 0.5%
//! --reorder 0.5% --drop kind=rs,step=1,every=7`, `--clear`, `--show`.
//!
//! Split by job and re-exported here: `rules` (rule syntax, rates,
//! [`Impairments`]), `maps` (the live [`Switch`]), `counters` (what the
//! switch and the hosts' datapaths counted) and `progs` (finding a BPF
//! program's maps by id).

mod counters;
mod maps;
mod progs;
mod rules;

pub use counters::{
    datapath_counters, testbed_datapath_counters, xdp_prog_in_netns, DatapathCounters,
    SwitchCounters,
};
pub use maps::Switch;
pub use rules::{fmt_rate, parse_rate, ChunkSelect, DropRule, FrameKind, Impairments, OpFilter};
