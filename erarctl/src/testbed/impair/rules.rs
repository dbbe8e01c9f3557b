//! What the switch is told to do: the `--drop` rule syntax ([`DropRule`]),
//! rates (`1%`, `250ppm`), the whole set ([`Impairments`]), and their
//! form in the switch's `struct erar_impair_cfg`.

use std::fmt;
use std::str::FromStr;

use anyhow::{bail, ensure, Context, Result};

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
    /// Frames each random loss drops in a row (0 or 1: one).
    pub burst: u32,
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

    pub(super) fn to_wire(&self) -> Result<wire::erar_impair_cfg> {
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
            burst: self.burst,
            dup_ppm: self.dup_ppm,
            reorder_ppm: self.reorder_ppm,
            ..Default::default()
        };
        for (slot, r) in cfg.rules.iter_mut().zip(&self.rules) {
            *slot = r.to_wire();
        }
        Ok(cfg)
    }

    pub(super) fn from_wire(cfg: &wire::erar_impair_cfg) -> Impairments {
        Impairments {
            loss_ppm: cfg.loss_ppm,
            burst: cfg.burst,
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
        write!(f, "loss {}", fmt_rate(self.loss_ppm))?;
        if self.burst > 1 {
            write!(f, " in bursts of {}", self.burst)?;
        }
        write!(
            f,
            " dup {} reorder {}",
            fmt_rate(self.dup_ppm),
            fmt_rate(self.reorder_ppm)
        )?;
        for r in &self.rules {
            write!(f, " drop[{r}]")?;
        }
        Ok(())
    }
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
            burst: 64,
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
