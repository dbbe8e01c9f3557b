//! The live switch ([`Switch`]): its maps, found from a bridge port, into
//! which any process writes the impairments in force and from which it
//! reads them and the switch's counters back.

use anyhow::{ensure, Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle};

use liberar::datapath::bpfobj::attached_xdp_prog;
use liberar::datapath::iface::if_index;
use liberar::datapath::wire;

use super::progs::{prog_info, prog_maps, u64_of};
use super::{Impairments, SwitchCounters};

/// The maps of the emulated switch attached to one port (every port of a
/// test bed shares one program, so one port gives the whole switch).
#[derive(Debug)]
pub struct Switch {
    prog_id: u32,
    cfg: MapHandle,
    stats: MapHandle,
    dropped: MapHandle,
}

impl Switch {
    /// The switch program on bridge port `port_ifname` (root namespace).
    pub fn open(port_ifname: &str) -> Result<Switch> {
        let prog_id = attached_xdp_prog(if_index(port_ifname)?)
            .with_context(|| format!("querying the XDP program of {port_ifname}"))?;
        ensure!(
            prog_id != 0,
            "{port_ifname} has no XDP program: impairments need the emulated XDP switch \
             (`erarctl testbed switch xdp`)"
        );
        let (name, _) = prog_info(prog_id)?;
        ensure!(
            name == "testbed_switch",
            "{port_ifname} runs XDP program {name:?} (id {prog_id}), not the emulated switch"
        );
        let mut maps = prog_maps(
            prog_id,
            &["switch_impair", "switch_stats", "switch_dropped"],
        )?
        .into_iter();
        let mut next = |what: &str| {
            maps.next().flatten().with_context(|| {
                format!(
                    "the switch on {port_ifname} (program id {prog_id}) has no {what} map: \
                     it predates impairments; re-attach it (`erarctl testbed switch bridge` \
                     then `xdp`)"
                )
            })
        };
        Ok(Switch {
            prog_id,
            cfg: next("switch_impair")?,
            stats: next("switch_stats")?,
            dropped: next("switch_dropped")?,
        })
    }

    /// The switch of the `erarctl` test bed (its port `erar-p0`).
    pub fn testbed() -> Result<Switch> {
        crate::testbed::cluster::require_root()?;
        Switch::open(&crate::testbed::port_ifname(0))
    }

    /// Id of the switch program.
    pub fn prog_id(&self) -> u32 {
        self.prog_id
    }

    /// Replaces the impairments (all of them: what `imp` leaves at zero is
    /// off) and forgets which chosen frames were dropped already.
    pub fn set(&self, imp: &Impairments) -> Result<()> {
        let cfg = imp.to_wire()?;
        // Off first, so no frame is judged by a half-written rule set.
        self.write_cfg(&wire::erar_impair_cfg::default())?;
        self.forget_dropped()?;
        self.write_cfg(&cfg)
    }

    /// No impairments (a perfect switch again).
    pub fn clear(&self) -> Result<()> {
        self.set(&Impairments::default())
    }

    /// The impairments in force.
    pub fn get(&self) -> Result<Impairments> {
        let v = self
            .cfg
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .context("reading switch_impair")?
            .context("switch_impair has no entry 0")?;
        ensure!(
            v.len() == std::mem::size_of::<wire::erar_impair_cfg>(),
            "switch_impair value is {} bytes, expected {}",
            v.len(),
            std::mem::size_of::<wire::erar_impair_cfg>()
        );
        // SAFETY: the size matches and erar_impair_cfg is plain integers.
        let cfg: wire::erar_impair_cfg = unsafe { std::ptr::read_unaligned(v.as_ptr().cast()) };
        Ok(Impairments::from_wire(&cfg))
    }

    /// Summed per-CPU counters.
    pub fn counters(&self) -> Result<SwitchCounters> {
        let mut c = SwitchCounters::default();
        for (i, slot) in c.0.iter_mut().enumerate() {
            let per_cpu = self
                .stats
                .lookup_percpu(&(i as u32).to_ne_bytes(), MapFlags::ANY)
                .context("reading switch_stats")?
                .unwrap_or_default();
            *slot = per_cpu.iter().map(|v| u64_of(v)).sum();
        }
        Ok(c)
    }

    /// Zeroes the counters.
    pub fn reset_counters(&self) -> Result<()> {
        let cpus = libbpf_rs::num_possible_cpus().context("counting possible CPUs")?;
        let zeros = vec![vec![0u8; 8]; cpus];
        for i in 0..wire::ERAR_SW_STAT_NR {
            self.stats
                .update_percpu(&i.to_ne_bytes(), &zeros, MapFlags::ANY)
                .context("zeroing switch_stats")?;
        }
        Ok(())
    }

    fn write_cfg(&self, cfg: &wire::erar_impair_cfg) -> Result<()> {
        // SAFETY: erar_impair_cfg is repr(C) plain integers without padding
        // (16 + 4 * 16 bytes), so every byte is initialized.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (cfg as *const wire::erar_impair_cfg).cast::<u8>(),
                std::mem::size_of::<wire::erar_impair_cfg>(),
            )
        };
        self.cfg
            .update(&0u32.to_ne_bytes(), bytes, MapFlags::ANY)
            .context("writing switch_impair")
    }

    fn forget_dropped(&self) -> Result<()> {
        // Collect first: deleting while walking restarts the walk.
        let keys: Vec<Vec<u8>> = self.dropped.keys().collect();
        for k in keys {
            // Gone already (LRU eviction) is fine.
            let _ = self.dropped.delete(&k);
        }
        Ok(())
    }
}
