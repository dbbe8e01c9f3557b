//! `erar_xdp`'s counters on this host: [`KernelStats`], the per-CPU
//! `stats` map summed over CPUs ([`HostDatapath::stats`]). Which counters
//! there are, their names and what each counts are `enum erar_stat` in
//! `erar_wire.h` (read at build time: `wire::ERAR_STAT_NAMES`, `_DOCS`).

use std::fmt;

use anyhow::{anyhow, Context, Result};
use libbpf_rs::MapFlags;

use super::host::HostDatapath;
use super::wire;

/// Counters of `enum erar_stat`.
const NR: usize = wire::ERAR_STAT_NR as usize;

/// Summed per-CPU counters of `erar_xdp` (receive and inject paths) on this
/// host, indexed by `wire::ERAR_STAT_*`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KernelStats([u64; NR]);

impl Default for KernelStats {
    fn default() -> KernelStats {
        KernelStats([0; NR])
    }
}

impl KernelStats {
    /// The counters in `enum erar_stat` order (missing ones 0).
    pub fn from_counters(c: &[u64]) -> KernelStats {
        let mut all = [0u64; NR];
        for (a, v) in all.iter_mut().zip(c) {
            *a = *v;
        }
        KernelStats(all)
    }

    /// Counter `stat` (`wire::ERAR_STAT_*`; 0 for an index out of range).
    pub fn get(&self, stat: wire::erar_stat) -> u64 {
        self.0.get(stat as usize).copied().unwrap_or(0)
    }

    /// Every counter, in `enum erar_stat` order.
    pub fn counters(&self) -> &[u64; NR] {
        &self.0
    }

    /// Each counter's name (`wire::ERAR_STAT_NAMES`) and value.
    pub fn named(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        wire::ERAR_STAT_NAMES
            .iter()
            .copied()
            .zip(self.0.iter().copied())
    }

    /// Frames dropped for any validation reason (not counting AG frames that
    /// simply finished their trip, nor duplicates): every `drop_*` counter
    /// but `drop_ringbuf`, which counts completion events, not frames.
    pub fn drops(&self) -> u64 {
        self.named()
            .enumerate()
            .filter(|&(i, (name, _))| {
                name.starts_with("drop_") && i != wire::ERAR_STAT_DROP_RINGBUF as usize
            })
            .map(|(_, (_, v))| v)
            .sum()
    }
}

/// `KernelStats { rx_rs: 1, .. }` with every counter by its header name.
impl fmt::Debug for KernelStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("KernelStats");
        for (name, v) in self.named() {
            d.field(name, &v);
        }
        d.finish()
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
        // Frames a jumbo datapath sends from user space count as
        // erar_inject's would (see kernel/raw.rs).
        let mut sum: [u64; NR] = std::array::from_fn(|i| self.raw_counts.get(i));
        for cpu in &per_cpu {
            for (s, w) in sum.iter_mut().zip(cpu.chunks_exact(8)) {
                let mut b = [0u8; 8];
                b.copy_from_slice(w);
                *s += u64::from_ne_bytes(b);
            }
        }
        Ok(KernelStats(sum))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// drops() sums the twelve validation drops of enum erar_stat: not
    /// drop_ringbuf (an event), nor dup or ag_last (a frame's normal end).
    #[test]
    fn drops_are_the_validation_drops() {
        assert_eq!(KernelStats::from_counters(&[1; NR]).drops(), 12);
        let only = |stat: wire::erar_stat| {
            let mut c = [0u64; NR];
            c[stat as usize] = 1;
            KernelStats::from_counters(&c).drops()
        };
        assert_eq!(only(wire::ERAR_STAT_DROP_MALFORMED), 1);
        assert_eq!(only(wire::ERAR_STAT_DROP_RINGBUF), 0);
        assert_eq!(only(wire::ERAR_STAT_DUP), 0);
        assert_eq!(only(wire::ERAR_STAT_AG_LAST), 0);
    }
}
