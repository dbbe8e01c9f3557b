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
//! * random loss: the frame is dropped;
//! * random duplication: the frame is delivered twice (a per-port devmap
//!   lists the port twice and the frame is broadcast to it);
//! * random reordering: the frame is handed to the Linux bridge, whose
//!   software path delivers it after frames sent later on the XDP path;
//! * chosen-frame drops ([`DropRule`]): the first pass of each frame of a
//!   kind, step and chunk selection is dropped, its re-sends pass.
//!
//! Command line: `erarctl testbed impair --loss 1% --dup 0.5% --reorder 0.5%
//! --drop kind=rs,step=1,every=7`, `--clear`, `--show`.

use std::ffi::CStr;
use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::str::FromStr;

use anyhow::{bail, ensure, Context, Result};
use libbpf_rs::{MapCore, MapFlags, MapHandle};

use liberar::datapath::kernel::if_index;
use liberar::datapath::wire;

/// Frames of the ring, as the rules name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// Reduce-scatter (partial sums).
    Rs,
    /// All-gather (final values; every broadcast frame).
    Ag,
}

impl FrameKind {
    fn wire(self) -> u8 {
        match self {
            FrameKind::Rs => wire::ERAR_KIND_RS as u8,
            FrameKind::Ag => wire::ERAR_KIND_AG as u8,
        }
    }
}

/// Which operations a rule applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OpFilter {
    #[default]
    Any,
    /// Every reduction (wire op other than broadcast).
    Allreduce,
    /// Broadcasts only.
    Bcast,
}

/// Which chunks of an operation a rule selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkSelect {
    /// The chunk with this index (`0`: the first; the last chunk of a known
    /// size is its index, `chunks - 1`).
    Chunk(u32),
    /// Every chunk `c` with `c % every == rem`.
    Every { every: u32, rem: u32 },
}

/// "Drop the first pass of every frame of `kind` at `step` (any step when
/// `None`) whose chunk `select` picks, in operations `op`." A frame is
/// identified by its ring (comm_id, token), operation (seq), chunk, slot,
/// kind and step, so its re-sends (same identity) pass: each such frame is
/// lost exactly once.
///
/// Text form (`FromStr`/`Display`), comma-separated:
/// `kind=rs|ag`, `step=N|any` (default any), exactly one of `first`,
/// `chunk=K` (alias `last=K`), `every=N` with optional `rem=R`, and
/// optionally `op=any|allreduce|bcast`. Example: `kind=rs,step=1,every=7`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropRule {
    pub kind: FrameKind,
    pub step: Option<u8>,
    pub select: ChunkSelect,
    pub op: OpFilter,
}

impl DropRule {
    fn to_wire(self) -> wire::erar_impair_rule {
        let (select, every, arg) = match self.select {
            ChunkSelect::Chunk(c) => (wire::ERAR_SELECT_CHUNK, 0, c),
            ChunkSelect::Every { every, rem } => (wire::ERAR_SELECT_EVERY, every, rem),
        };
        wire::erar_impair_rule {
            kind: self.kind.wire(),
            step: self.step.unwrap_or(0),
            any_step: self.step.is_none() as u8,
            op: match self.op {
                OpFilter::Any => wire::ERAR_IMPAIR_OP_ANY,
                OpFilter::Allreduce => wire::ERAR_IMPAIR_OP_ALLREDUCE,
                OpFilter::Bcast => wire::ERAR_IMPAIR_OP_BCAST,
            } as u8,
            select,
            every,
            arg,
        }
    }

    fn from_wire(r: &wire::erar_impair_rule) -> Option<DropRule> {
        let kind = match r.kind as u32 {
            wire::ERAR_KIND_RS => FrameKind::Rs,
            wire::ERAR_KIND_AG => FrameKind::Ag,
            _ => return None,
        };
        let select = match r.select {
            wire::ERAR_SELECT_CHUNK => ChunkSelect::Chunk(r.arg),
            wire::ERAR_SELECT_EVERY => ChunkSelect::Every {
                every: r.every,
                rem: r.arg,
            },
            _ => return None,
        };
        let op = match r.op as u32 {
            wire::ERAR_IMPAIR_OP_ALLREDUCE => OpFilter::Allreduce,
            wire::ERAR_IMPAIR_OP_BCAST => OpFilter::Bcast,
            _ => OpFilter::Any,
        };
        Some(DropRule {
            kind,
            step: (r.any_step == 0).then_some(r.step),
            select,
            op,
        })
    }
}

impl FromStr for DropRule {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<DropRule> {
        let mut kind = None;
        let mut step = None;
        let mut select = None;
        let mut rem = None;
        let mut op = OpFilter::Any;
        let num = |k: &str, v: &str| -> Result<u32> {
            v.trim()
                .parse::<u32>()
                .with_context(|| format!("drop rule {s:?}: {k}={v:?} is not a number"))
        };
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (k, v) = item.split_once('=').unwrap_or((item, ""));
            let mut set_select = |sel: ChunkSelect| -> Result<()> {
                ensure!(
                    select.replace(sel).is_none(),
                    "drop rule {s:?}: choose one of first, chunk=K, last=K, every=N"
                );
                Ok(())
            };
            match (k.trim(), v.trim()) {
                ("kind", "rs" | "RS") => kind = Some(FrameKind::Rs),
                ("kind", "ag" | "AG") => kind = Some(FrameKind::Ag),
                ("step", "any" | "*") => step = None,
                ("step", v) => {
                    let n = num("step", v)?;
                    ensure!(
                        n < wire::ERAR_MAX_RING,
                        "drop rule {s:?}: step {n} is beyond any ring"
                    );
                    step = Some(n as u8);
                }
                ("first", "") => set_select(ChunkSelect::Chunk(0))?,
                ("chunk" | "last", v) => set_select(ChunkSelect::Chunk(num(k, v)?))?,
                ("every", v) => {
                    let every = num("every", v)?;
                    ensure!(every >= 1, "drop rule {s:?}: every must be at least 1");
                    set_select(ChunkSelect::Every { every, rem: 0 })?;
                }
                ("rem", v) => rem = Some(num("rem", v)?),
                ("op", "any") => op = OpFilter::Any,
                ("op", "allreduce") => op = OpFilter::Allreduce,
                ("op", "bcast") => op = OpFilter::Bcast,
                _ => bail!(
                    "drop rule {s:?}: unknown item {item:?} (want kind=rs|ag, step=N|any, \
                     first|chunk=K|last=K|every=N[,rem=R], op=any|allreduce|bcast)"
                ),
            }
        }
        let kind = kind.with_context(|| format!("drop rule {s:?}: kind=rs or kind=ag missing"))?;
        let mut select = select.with_context(|| {
            format!("drop rule {s:?}: which chunks? (first, chunk=K, last=K or every=N)")
        })?;
        if let Some(r) = rem {
            match &mut select {
                ChunkSelect::Every { every, rem } => {
                    ensure!(
                        r < *every,
                        "drop rule {s:?}: rem={r} must be below every={every}"
                    );
                    *rem = r;
                }
                ChunkSelect::Chunk(_) => bail!("drop rule {s:?}: rem= goes with every="),
            }
        }
        Ok(DropRule {
            kind,
            step,
            select,
            op,
        })
    }
}

impl fmt::Display for DropRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            FrameKind::Rs => "rs",
            FrameKind::Ag => "ag",
        };
        write!(f, "kind={kind},")?;
        match self.step {
            Some(s) => write!(f, "step={s},")?,
            None => write!(f, "step=any,")?,
        }
        match self.select {
            ChunkSelect::Chunk(0) => write!(f, "first")?,
            ChunkSelect::Chunk(c) => write!(f, "chunk={c}")?,
            ChunkSelect::Every { every, rem: 0 } => write!(f, "every={every}")?,
            ChunkSelect::Every { every, rem } => write!(f, "every={every},rem={rem}")?,
        }
        match self.op {
            OpFilter::Any => Ok(()),
            OpFilter::Allreduce => write!(f, ",op=allreduce"),
            OpFilter::Bcast => write!(f, ",op=bcast"),
        }
    }
}

/// A rate as the switch takes it: parts per million of frames. Accepts
/// `1%`, `0.5%`, `250ppm`, or a bare number meaning percent (`0.5`).
pub fn parse_rate(s: &str) -> Result<u32> {
    let t = s.trim();
    let (num, scale) = if let Some(p) = t.strip_suffix("ppm") {
        (p, 1.0)
    } else if let Some(p) = t.strip_suffix('%') {
        (p, 10_000.0)
    } else {
        (t, 10_000.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .with_context(|| format!("rate {s:?}: want e.g. 1%, 0.5% or 250ppm"))?;
    let ppm = (v * scale).round();
    ensure!(
        (0.0..=wire::ERAR_PPM as f64).contains(&ppm),
        "rate {s:?} is not between 0% and 100%"
    );
    Ok(ppm as u32)
}

/// A rate in parts per million as a percentage for people (`0.5%`).
pub fn fmt_rate(ppm: u32) -> String {
    format!("{}%", ppm as f64 / 10_000.0)
}

/// Everything the switch does to datapath frames. `Default`: nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Impairments {
    /// Random loss, parts per million of frames.
    pub loss_ppm: u32,
    /// Random duplication, ppm.
    pub dup_ppm: u32,
    /// Random reordering (the slow way through the bridge), ppm.
    pub reorder_ppm: u32,
    /// At most `ERAR_IMPAIR_MAX_RULES` chosen-frame drop rules.
    pub rules: Vec<DropRule>,
}

impl Impairments {
    pub fn is_none(&self) -> bool {
        *self == Impairments::default()
    }

    fn to_wire(&self) -> Result<wire::erar_impair_cfg> {
        ensure!(
            self.rules.len() <= wire::ERAR_IMPAIR_MAX_RULES as usize,
            "{} drop rules, the switch takes at most {}",
            self.rules.len(),
            wire::ERAR_IMPAIR_MAX_RULES
        );
        for (what, ppm) in [
            ("loss", self.loss_ppm),
            ("dup", self.dup_ppm),
            ("reorder", self.reorder_ppm),
        ] {
            ensure!(ppm <= wire::ERAR_PPM, "{what} rate {ppm} ppm exceeds 100%");
        }
        let mut cfg = wire::erar_impair_cfg {
            loss_ppm: self.loss_ppm,
            dup_ppm: self.dup_ppm,
            reorder_ppm: self.reorder_ppm,
            ..Default::default()
        };
        for (slot, r) in cfg.rules.iter_mut().zip(&self.rules) {
            *slot = r.to_wire();
        }
        Ok(cfg)
    }

    fn from_wire(cfg: &wire::erar_impair_cfg) -> Impairments {
        Impairments {
            loss_ppm: cfg.loss_ppm,
            dup_ppm: cfg.dup_ppm,
            reorder_ppm: cfg.reorder_ppm,
            rules: cfg.rules.iter().filter_map(DropRule::from_wire).collect(),
        }
    }
}

impl fmt::Display for Impairments {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_none() {
            return f.write_str("none");
        }
        write!(
            f,
            "loss {} dup {} reorder {}",
            fmt_rate(self.loss_ppm),
            fmt_rate(self.dup_ppm),
            fmt_rate(self.reorder_ppm)
        )?;
        for r in &self.rules {
            write!(f, " drop[{r}]")?;
        }
        Ok(())
    }
}

/// The switch's per-CPU counters, summed (index: `wire::ERAR_SW_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwitchCounters(pub [u64; wire::ERAR_SW_STAT_NR as usize]);

impl SwitchCounters {
    fn get(&self, i: u32) -> u64 {
        self.0[i as usize]
    }
    /// Datapath frames forwarded once on the XDP path.
    pub fn redirected(&self) -> u64 {
        self.get(wire::ERAR_SW_REDIRECTED)
    }
    /// Other frames, handed to the bridge.
    pub fn passed(&self) -> u64 {
        self.get(wire::ERAR_SW_PASSED)
    }
    pub fn unknown_mac(&self) -> u64 {
        self.get(wire::ERAR_SW_UNKNOWN_MAC)
    }
    /// Randomly lost.
    pub fn lost(&self) -> u64 {
        self.get(wire::ERAR_SW_LOST)
    }
    /// Delivered twice.
    pub fn duplicated(&self) -> u64 {
        self.get(wire::ERAR_SW_DUPLICATED)
    }
    /// Sent the slow way (bridge), to be overtaken.
    pub fn reordered(&self) -> u64 {
        self.get(wire::ERAR_SW_REORDERED)
    }
    /// First passes of chosen frames, dropped.
    pub fn rule_dropped(&self) -> u64 {
        self.get(wire::ERAR_SW_RULE_DROPPED)
    }
    /// Later passes (re-sends) of chosen frames, forwarded.
    pub fn rule_passed(&self) -> u64 {
        self.get(wire::ERAR_SW_RULE_PASSED)
    }
    /// Chosen frames the switch could not track (forwarded).
    pub fn rule_untracked(&self) -> u64 {
        self.get(wire::ERAR_SW_RULE_FULL)
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
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "redirected={} passed={} unknown_mac={} lost={} duplicated={} reordered={} \
             rule_dropped={} rule_passed={} rule_untracked={}",
            self.redirected(),
            self.passed(),
            self.unknown_mac(),
            self.lost(),
            self.duplicated(),
            self.reordered(),
            self.rule_dropped(),
            self.rule_passed(),
            self.rule_untracked()
        )
    }
}

/// Name and map ids of a loaded BPF program.
fn prog_info(id: u32) -> Result<(String, Vec<u32>)> {
    // SAFETY: plain syscall wrapper.
    let fd = unsafe { libbpf_sys::bpf_prog_get_fd_by_id(id) };
    if fd < 0 {
        return Err(std::io::Error::from_raw_os_error(-fd))
            .with_context(|| format!("opening BPF program id {id}"));
    }
    // SAFETY: a fresh fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut ids: Vec<u32> = Vec::new();
    // Twice: the first call tells how many maps, the second fills them in.
    for _ in 0..2 {
        // SAFETY: zero is a valid bpf_prog_info.
        let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
        info.nr_map_ids = ids.len() as u32;
        info.map_ids = ids.as_mut_ptr() as u64;
        let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
        // SAFETY: info and ids (nr_map_ids entries) outlive the call.
        let ret =
            unsafe { libbpf_sys::bpf_prog_get_info_by_fd(fd.as_raw_fd(), &mut info, &mut len) };
        if ret != 0 {
            return Err(std::io::Error::from_raw_os_error(-ret))
                .with_context(|| format!("reading the info of BPF program id {id}"));
        }
        let n = info.nr_map_ids as usize;
        if n <= ids.len() {
            ids.truncate(n);
            // SAFETY: the kernel NUL-terminates the name (16 bytes).
            let name = unsafe { CStr::from_ptr(info.name.as_ptr()) }
                .to_string_lossy()
                .into_owned();
            return Ok((name, ids));
        }
        ids.resize(n, 0);
    }
    bail!("BPF program id {id} keeps gaining maps")
}

/// The maps of `prog_id`, by name.
fn prog_maps(prog_id: u32, names: &[&str]) -> Result<Vec<Option<MapHandle>>> {
    let (_, ids) = prog_info(prog_id)?;
    let mut found: Vec<Option<MapHandle>> = names.iter().map(|_| None).collect();
    for id in ids {
        let Ok(m) = MapHandle::from_map_id(id) else {
            continue;
        };
        let name = m.name().to_string_lossy().into_owned();
        if let Some(i) = names.iter().position(|n| *n == name) {
            found[i] = Some(m);
        }
    }
    Ok(found)
}

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
        let ifindex = if_index(port_ifname)?;
        let mut prog_id = 0u32;
        // SAFETY: netlink query; prog_id outlives the call.
        let ret = unsafe {
            libbpf_sys::bpf_xdp_query_id(
                ifindex as i32,
                libbpf_sys::XDP_FLAGS_DRV_MODE as i32,
                &mut prog_id,
            )
        };
        if ret != 0 {
            return Err(std::io::Error::from_raw_os_error(-ret))
                .with_context(|| format!("querying the XDP program of {port_ifname}"));
        }
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
        super::cluster::require_root()?;
        Switch::open(&super::port_ifname(0))
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

fn u64_of(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    let n = b.len().min(8);
    w[..n].copy_from_slice(&b[..n]);
    u64::from_ne_bytes(w)
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
        let ifindex = if_index(&ifname)?;
        let mut id = 0u32;
        // SAFETY: netlink query; id outlives the call.
        let ret = unsafe {
            libbpf_sys::bpf_xdp_query_id(
                ifindex as i32,
                libbpf_sys::XDP_FLAGS_DRV_MODE as i32,
                &mut id,
            )
        };
        if ret != 0 {
            return Err(std::io::Error::from_raw_os_error(-ret))
                .with_context(|| format!("querying the XDP program of {ifname}"));
        }
        Ok(id)
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
        let id = xdp_prog_in_netns(&super::host_ns(h), super::HOST_IFNAME)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rates() {
        assert_eq!(parse_rate("1%").unwrap(), 10_000);
        assert_eq!(parse_rate("0.5%").unwrap(), 5_000);
        assert_eq!(parse_rate("0.5").unwrap(), 5_000);
        assert_eq!(parse_rate("250ppm").unwrap(), 250);
        assert_eq!(parse_rate("100%").unwrap(), 1_000_000);
        assert!(parse_rate("101%").is_err());
        assert!(parse_rate("-1%").is_err());
        assert!(parse_rate("lots").is_err());
        assert_eq!(fmt_rate(5_000), "0.5%");
    }

    #[test]
    fn parses_drop_rules() {
        let r: DropRule = "kind=rs,step=1,every=7".parse().unwrap();
        assert_eq!(
            r,
            DropRule {
                kind: FrameKind::Rs,
                step: Some(1),
                select: ChunkSelect::Every { every: 7, rem: 0 },
                op: OpFilter::Any
            }
        );
        let r: DropRule = "kind=ag,first,op=bcast".parse().unwrap();
        assert_eq!(r.step, None);
        assert_eq!(r.select, ChunkSelect::Chunk(0));
        assert_eq!(r.op, OpFilter::Bcast);
        let r: DropRule = "kind=ag,step=2,last=19".parse().unwrap();
        assert_eq!(r.select, ChunkSelect::Chunk(19));
        let r: DropRule = "kind=rs,step=0,every=7,rem=3".parse().unwrap();
        assert_eq!(r.select, ChunkSelect::Every { every: 7, rem: 3 });
        for bad in [
            "step=1,every=7",
            "kind=rs",
            "kind=rs,first,every=2",
            "kind=rs,every=0",
            "kind=rs,every=4,rem=4",
            "kind=rs,first,rem=1",
            "kind=xx,first",
            "kind=rs,first,bogus=1",
            "kind=rs,step=200,first",
        ] {
            assert!(bad.parse::<DropRule>().is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn rules_round_trip() {
        for text in [
            "kind=rs,step=1,every=7",
            "kind=rs,step=0,first",
            "kind=ag,step=any,chunk=19,op=allreduce",
            "kind=ag,step=0,every=5,rem=2,op=bcast",
        ] {
            let r: DropRule = text.parse().unwrap();
            assert_eq!(r.to_string(), text);
            assert_eq!(DropRule::from_wire(&r.to_wire()), Some(r));
            assert_eq!(r.to_string().parse::<DropRule>().unwrap(), r);
        }
    }

    #[test]
    fn impairments_round_trip_through_the_wire_struct() {
        let imp = Impairments {
            loss_ppm: 10_000,
            dup_ppm: 5_000,
            reorder_ppm: 1,
            rules: vec!["kind=rs,step=0,first".parse().unwrap()],
        };
        let w = imp.to_wire().unwrap();
        assert_eq!(Impairments::from_wire(&w), imp);
        assert_eq!(
            std::mem::size_of::<wire::erar_impair_cfg>(),
            16 + 16 * wire::ERAR_IMPAIR_MAX_RULES as usize
        );
        let too_many = Impairments {
            rules: vec![imp.rules[0]; wire::ERAR_IMPAIR_MAX_RULES as usize + 1],
            ..Impairments::default()
        };
        assert!(too_many.to_wire().is_err());
        assert_eq!(Impairments::default().to_string(), "none");
    }
}
