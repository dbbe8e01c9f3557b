//! The datapath's counters as an array in enum erar_stat order: their
//! names (erar_wire.h's, generated into `wire::ERAR_STAT_NAMES`), the
//! terminal ones, and how a set of deltas is printed; and the tally of the
//! barrier's joins and inject runs.

use std::collections::BTreeMap;

use liberar::datapath::kernel::KernelStats;
use liberar::datapath::wire;

pub const NR: usize = wire::ERAR_STAT_NR as usize;

/// KernelStats as an array in enum erar_stat order.
pub fn stat_array(s: &KernelStats) -> [u64; NR] {
    *s.counters()
}

/// Counter `i`'s name (the header's, `wire::ERAR_STAT_NAMES`).
pub fn stat_name(i: usize) -> &'static str {
    wire::ERAR_STAT_NAMES.get(i).copied().unwrap_or("?")
}

/// Counters that end a datapath frame's life here: exactly one per dropped
/// datapath frame (AG_LAST: the frame completed its trip; DUP: already
/// applied; NACK_SKIP: a NACK not answered; READY_STALE: a READY that told
/// nothing new; REGION_ERR: its operation's registered buffer refused it),
/// none for a forwarded one; except a READY kept but not passed on (its seq
/// not joined), which counts only READY.
pub const TERMINAL: [u32; 17] = [
    wire::ERAR_STAT_DROP_SHORT,
    wire::ERAR_STAT_DROP_MALFORMED,
    wire::ERAR_STAT_DROP_MAGIC,
    wire::ERAR_STAT_DROP_VERSION,
    wire::ERAR_STAT_DROP_SLOT,
    wire::ERAR_STAT_DROP_COMM,
    wire::ERAR_STAT_DROP_TOKEN,
    wire::ERAR_STAT_DROP_SEQ,
    wire::ERAR_STAT_DROP_OP,
    wire::ERAR_STAT_DROP_CHUNK,
    wire::ERAR_STAT_DROP_STEP,
    wire::ERAR_STAT_DUP,
    wire::ERAR_STAT_DROP_STATE,
    wire::ERAR_STAT_AG_LAST,
    wire::ERAR_STAT_NACK_SKIP,
    wire::ERAR_STAT_READY_STALE,
    wire::ERAR_STAT_REGION_ERR,
];

pub fn fmt_ctr(c: &[u64; NR]) -> String {
    let v: Vec<String> = (0..NR)
        .filter(|&i| c[i] != 0)
        .map(|i| format!("{}+{}", stat_name(i), c[i]))
        .collect();
    if v.is_empty() {
        "(none)".into()
    } else {
        v.join(" ")
    }
}

/// What the joins and the inject path's runs did.
#[derive(Default)]
pub struct BarrierTally {
    pub joins: u64,
    /// Joins by where the barrier stood (the model's and kernel's word).
    pub by_state: BTreeMap<&'static str, u64>,
    pub inject_runs: u64,
    /// Inject runs by outcome (`ready_sent` / `inject_err`).
    pub inject_outcomes: BTreeMap<&'static str, u64>,
}
