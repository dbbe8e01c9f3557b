//! The datapath's counters as an array in enum erar_stat order: their
//! names, the terminal ones, and how a set of deltas is printed.

use liberar::datapath::kernel::KernelStats;
use liberar::datapath::wire;

pub const NR: usize = wire::ERAR_STAT_NR as usize;

/// KernelStats as an array in enum erar_stat order.
pub fn stat_array(s: &KernelStats) -> [u64; NR] {
    let mut a = [0u64; NR];
    let mut set = |i: u32, v: u64| a[i as usize] = v;
    set(wire::ERAR_STAT_RX_RS, s.rx_rs);
    set(wire::ERAR_STAT_RX_AG, s.rx_ag);
    set(wire::ERAR_STAT_FINISHED, s.finished);
    set(wire::ERAR_STAT_TX, s.tx);
    set(wire::ERAR_STAT_AG_LAST, s.ag_last);
    set(wire::ERAR_STAT_COMPLETE, s.complete);
    set(wire::ERAR_STAT_INJECTED, s.injected);
    set(wire::ERAR_STAT_DROP_SHORT, s.drop_short);
    set(wire::ERAR_STAT_DROP_MAGIC, s.drop_magic);
    set(wire::ERAR_STAT_DROP_VERSION, s.drop_version);
    set(wire::ERAR_STAT_DROP_SLOT, s.drop_slot);
    set(wire::ERAR_STAT_DROP_COMM, s.drop_comm);
    set(wire::ERAR_STAT_DROP_TOKEN, s.drop_token);
    set(wire::ERAR_STAT_DROP_SEQ, s.drop_seq);
    set(wire::ERAR_STAT_DROP_OP, s.drop_op);
    set(wire::ERAR_STAT_DROP_CHUNK, s.drop_chunk);
    set(wire::ERAR_STAT_DROP_STEP, s.drop_step);
    set(wire::ERAR_STAT_DROP_RINGBUF, s.drop_ringbuf);
    set(wire::ERAR_STAT_INJECT_ERR, s.inject_err);
    set(wire::ERAR_STAT_DUP, s.dup);
    set(wire::ERAR_STAT_DROP_STATE, s.drop_state);
    set(wire::ERAR_STAT_RESENT, s.resent);
    set(wire::ERAR_STAT_RESEND_SKIP, s.resend_skip);
    set(wire::ERAR_STAT_DROP_MALFORMED, s.drop_malformed);
    set(wire::ERAR_STAT_NACK_SENT, s.nack_sent);
    set(wire::ERAR_STAT_NACK_SERVED, s.nack_served);
    set(wire::ERAR_STAT_NACK_SKIP, s.nack_skip);
    set(wire::ERAR_STAT_PING, s.ping);
    a
}

pub fn stat_name(i: usize) -> &'static str {
    match i as u32 {
        wire::ERAR_STAT_RX_RS => "rx_rs",
        wire::ERAR_STAT_RX_AG => "rx_ag",
        wire::ERAR_STAT_FINISHED => "finished",
        wire::ERAR_STAT_TX => "tx",
        wire::ERAR_STAT_AG_LAST => "ag_last",
        wire::ERAR_STAT_COMPLETE => "complete",
        wire::ERAR_STAT_INJECTED => "injected",
        wire::ERAR_STAT_DROP_SHORT => "drop_short",
        wire::ERAR_STAT_DROP_MAGIC => "drop_magic",
        wire::ERAR_STAT_DROP_VERSION => "drop_version",
        wire::ERAR_STAT_DROP_SLOT => "drop_slot",
        wire::ERAR_STAT_DROP_COMM => "drop_comm",
        wire::ERAR_STAT_DROP_TOKEN => "drop_token",
        wire::ERAR_STAT_DROP_SEQ => "drop_seq",
        wire::ERAR_STAT_DROP_OP => "drop_op",
        wire::ERAR_STAT_DROP_CHUNK => "drop_chunk",
        wire::ERAR_STAT_DROP_STEP => "drop_step",
        wire::ERAR_STAT_DROP_RINGBUF => "drop_ringbuf",
        wire::ERAR_STAT_INJECT_ERR => "inject_err",
        wire::ERAR_STAT_DUP => "dup",
        wire::ERAR_STAT_DROP_STATE => "drop_state",
        wire::ERAR_STAT_RESENT => "resent",
        wire::ERAR_STAT_RESEND_SKIP => "resend_skip",
        wire::ERAR_STAT_DROP_MALFORMED => "drop_malformed",
        wire::ERAR_STAT_NACK_SENT => "nack_sent",
        wire::ERAR_STAT_NACK_SERVED => "nack_served",
        wire::ERAR_STAT_NACK_SKIP => "nack_skip",
        wire::ERAR_STAT_PING => "ping",
        _ => "?",
    }
}

/// Counters that end a datapath frame's life here: exactly one per dropped
/// datapath frame (AG_LAST: the frame completed its trip; DUP: already
/// applied; NACK_SKIP: a NACK not answered), none for a forwarded one.
pub const TERMINAL: [u32; 15] = [
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
