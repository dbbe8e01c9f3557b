//! Counters read back for people and tests: the switch's
//! ([`SwitchCounters`]: forwarded, lost, duplicated, …) and those of each
//! test-bed host's datapath ([`DatapathCounters`] of its `erar_xdp`).

use std::fmt;
use std::os::fd::AsRawFd;

use anyhow::{Context, Result};
use libbpf_rs::{MapCore, MapFlags};

use liberar::datapath::bpfobj::attached_xdp_prog;
use liberar::datapath::iface::if_index;
use liberar::datapath::wire;

use super::progs::{prog_info, prog_maps, u64_of};

/// The switch's per-CPU counters, summed (index: `wire::ERAR_SW_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwitchCounters(pub [u64; wire::ERAR_SW_STAT_NR as usize]);

/// One accessor per named counter: `$name()` reads `wire::$index`.
macro_rules! counter_accessors {
    ($($(#[$doc:meta])* $name:ident = $index:ident;)*) => {
        $($(#[$doc])* pub fn $name(&self) -> u64 {
            self.0[wire::$index as usize]
        })*
    };
}

impl SwitchCounters {
    counter_accessors! {
        /// Forwarded on the XDP path.
        redirected = ERAR_SW_REDIRECTED;
        /// Randomly lost.
        lost = ERAR_SW_LOST;
        /// Delivered twice.
        duplicated = ERAR_SW_DUPLICATED;
        /// Sent the slow way (bridge), to be overtaken.
        reordered = ERAR_SW_REORDERED;
        /// First passes of chosen frames, dropped.
        rule_dropped = ERAR_SW_RULE_DROPPED;
        /// Later passes (re-sends) of chosen frames, forwarded.
        rule_passed = ERAR_SW_RULE_PASSED;
        /// Chosen frames the switch could not track (forwarded).
        rule_full = ERAR_SW_RULE_FULL;
    }

    /// What happened since `before`.
    pub fn since(&self, before: &SwitchCounters) -> SwitchCounters {
        let mut d = *self;
        for (x, b) in d.0.iter_mut().zip(&before.0) {
            *x = x.saturating_sub(*b);
        }
        d
    }
}

impl fmt::Display for SwitchCounters {
    /// `name=value` for every counter, named as in `erar_wire.h`
    /// (`wire::ERAR_SW_STAT_NAMES`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (name, v)) in wire::ERAR_SW_STAT_NAMES.iter().zip(&self.0).enumerate() {
            let sep = if i == 0 { "" } else { " " };
            write!(f, "{sep}{name}={v}")?;
        }
        Ok(())
    }
}

/// Counters (`wire::ERAR_STAT_*` indices, summed over CPUs) of one live
/// `erar_xdp` program, i.e. of one process's datapath on one host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatapathCounters {
    pub prog_id: u32,
    pub c: [u64; wire::ERAR_STAT_NR as usize],
}

impl DatapathCounters {
    pub fn get(&self, stat: u32) -> u64 {
        self.c.get(stat as usize).copied().unwrap_or(0)
    }
}

/// The counters of `erar_xdp` program `prog_id`, if that is what it is:
/// what one host's datapath did with the frames it got — e.g.
/// `ERAR_STAT_DUP` counts duplicates it dropped. A program lives as long as
/// its process, so sample while a job runs.
pub fn datapath_counters(prog_id: u32) -> Result<Option<DatapathCounters>> {
    let (name, _) = prog_info(prog_id)?;
    if name != "erar_xdp" {
        return Ok(None);
    }
    let Some(stats) = prog_maps(prog_id, &["stats"])?.pop().flatten() else {
        return Ok(None);
    };
    let Some(per_cpu) = stats
        .lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)
        .context("reading erar_xdp's stats")?
    else {
        return Ok(None);
    };
    let mut c = [0u64; wire::ERAR_STAT_NR as usize];
    for cpu in &per_cpu {
        for (s, w) in c.iter_mut().zip(cpu.chunks_exact(8)) {
            *s += u64_of(w);
        }
    }
    Ok(Some(DatapathCounters { prog_id, c }))
}

/// Id of the XDP program on `ifname` inside network namespace `netns` (0:
/// none). Asks from a short-lived thread that enters the namespace, so no
/// process is spawned (cheap enough to sample while a job runs).
pub fn xdp_prog_in_netns(netns: &str, ifname: &str) -> Result<u32> {
    let path = format!("/run/netns/{netns}");
    let ns = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
    let ifname = ifname.to_owned();
    std::thread::spawn(move || -> Result<u32> {
        // SAFETY: setns on this thread only (network namespaces are per
        // thread); the thread ends right after.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error()).context("setns");
        }
        attached_xdp_prog(if_index(&ifname)?)
            .with_context(|| format!("querying the XDP program of {ifname}"))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the netns query thread panicked"))?
    .with_context(|| format!("in network namespace {netns}"))
}

/// The datapath counters of test-bed hosts `0..hosts` whose `eth0` runs
/// erar_xdp right now (i.e. a liberar job is on them): (host, counters).
pub fn testbed_datapath_counters(hosts: usize) -> Result<Vec<(usize, DatapathCounters)>> {
    let mut out = Vec::new();
    for h in 0..hosts {
        let id = xdp_prog_in_netns(&crate::testbed::host_ns(h), crate::testbed::HOST_IFNAME)?;
        if id == 0 {
            continue;
        }
        // Gone between the two questions: the job just ended there.
        if let Ok(Some(c)) = datapath_counters(id) {
            out.push((h, c));
        }
    }
    Ok(out)
}
