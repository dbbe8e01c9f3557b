//! `erar_xdp`'s counters on this host: [`KernelStats`], the per-CPU
//! `stats` map summed over CPUs ([`HostDatapath::stats`]).

use anyhow::{anyhow, Context, Result};
use libbpf_rs::MapFlags;

use super::host::HostDatapath;
use super::wire;

/// Summed per-CPU counters of `erar_xdp` (receive and inject paths) on this host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelStats {
    /// RS frames received and reduced here.
    pub rx_rs: u64,
    /// AG frames received and stored here.
    pub rx_ag: u64,
    /// RS frames that got their last contribution here (became AG).
    pub finished: u64,
    /// Frames forwarded with XDP_TX.
    pub tx: u64,
    /// AG frames that ended their trip here.
    pub ag_last: u64,
    /// Operations completed (ring-buffer events posted).
    pub complete: u64,
    /// Frames built by the inject path (BPF_PROG_RUN).
    pub injected: u64,
    pub drop_short: u64,
    pub drop_magic: u64,
    pub drop_version: u64,
    pub drop_slot: u64,
    pub drop_comm: u64,
    pub drop_token: u64,
    /// Slot not armed, or the frame's seq is not the armed one.
    pub drop_seq: u64,
    pub drop_op: u64,
    pub drop_chunk: u64,
    pub drop_step: u64,
    pub drop_ringbuf: u64,
    pub inject_err: u64,
    /// Duplicates dropped: the chunk's stage had already moved on.
    pub dup: u64,
    /// Frames impossible in their chunk's stage (forged or misrouted).
    pub drop_state: u64,
    /// Frames re-sent after a loss.
    pub resent: u64,
    /// Re-sends asked for with nothing stable to send yet.
    pub resend_skip: u64,
    /// Frames whose length, IPv4/UDP length fields or reserved bytes are
    /// not what a sender builds.
    pub drop_malformed: u64,
    /// NACKs sent to the predecessor (frames this host waited for).
    pub nack_sent: u64,
    /// NACKs from the successor answered with the frame they named.
    pub nack_served: u64,
    /// NACKs naming a frame this host did not last send (the loss was
    /// further up the ring, or the frame was only late).
    pub nack_skip: u64,
    /// Liveness probes of this host's rings answered.
    pub ping: u64,
}

impl KernelStats {
    fn from_counters(c: &[u64]) -> KernelStats {
        let g = |i: wire::erar_stat| c.get(i as usize).copied().unwrap_or(0);
        KernelStats {
            rx_rs: g(wire::ERAR_STAT_RX_RS),
            rx_ag: g(wire::ERAR_STAT_RX_AG),
            finished: g(wire::ERAR_STAT_FINISHED),
            tx: g(wire::ERAR_STAT_TX),
            ag_last: g(wire::ERAR_STAT_AG_LAST),
            complete: g(wire::ERAR_STAT_COMPLETE),
            injected: g(wire::ERAR_STAT_INJECTED),
            drop_short: g(wire::ERAR_STAT_DROP_SHORT),
            drop_magic: g(wire::ERAR_STAT_DROP_MAGIC),
            drop_version: g(wire::ERAR_STAT_DROP_VERSION),
            drop_slot: g(wire::ERAR_STAT_DROP_SLOT),
            drop_comm: g(wire::ERAR_STAT_DROP_COMM),
            drop_token: g(wire::ERAR_STAT_DROP_TOKEN),
            drop_seq: g(wire::ERAR_STAT_DROP_SEQ),
            drop_op: g(wire::ERAR_STAT_DROP_OP),
            drop_chunk: g(wire::ERAR_STAT_DROP_CHUNK),
            drop_step: g(wire::ERAR_STAT_DROP_STEP),
            drop_ringbuf: g(wire::ERAR_STAT_DROP_RINGBUF),
            inject_err: g(wire::ERAR_STAT_INJECT_ERR),
            dup: g(wire::ERAR_STAT_DUP),
            drop_state: g(wire::ERAR_STAT_DROP_STATE),
            resent: g(wire::ERAR_STAT_RESENT),
            resend_skip: g(wire::ERAR_STAT_RESEND_SKIP),
            drop_malformed: g(wire::ERAR_STAT_DROP_MALFORMED),
            nack_sent: g(wire::ERAR_STAT_NACK_SENT),
            nack_served: g(wire::ERAR_STAT_NACK_SERVED),
            nack_skip: g(wire::ERAR_STAT_NACK_SKIP),
            ping: g(wire::ERAR_STAT_PING),
        }
    }

    /// Frames dropped for any validation reason (not counting AG frames that
    /// simply finished their trip, nor duplicates).
    pub fn drops(&self) -> u64 {
        self.drop_short
            + self.drop_magic
            + self.drop_version
            + self.drop_slot
            + self.drop_comm
            + self.drop_token
            + self.drop_seq
            + self.drop_op
            + self.drop_chunk
            + self.drop_step
            + self.drop_state
            + self.drop_malformed
    }
}

impl HostDatapath {
    /// Summed per-CPU counters.
    pub fn stats(&self) -> Result<KernelStats> {
        let key = 0u32.to_ne_bytes();
        let per_cpu = self
            .stats_map()
            .lookup_percpu(&key, MapFlags::ANY)
            .context("reading the stats map")?
            .ok_or_else(|| anyhow!("stats map has no entry 0"))?;
        let mut sum = [0u64; wire::ERAR_STAT_NR as usize];
        for cpu in &per_cpu {
            for (s, w) in sum.iter_mut().zip(cpu.chunks_exact(8)) {
                let mut b = [0u8; 8];
                b.copy_from_slice(w);
                *s += u64::from_ne_bytes(b);
            }
        }
        Ok(KernelStats::from_counters(&sum))
    }
}
