//! The one routing decision: does this call take the eBPF fast path, or go
//! to the real MPI through PMPI — and why. [`decide`] answers in one place:
//! eligibility (the call's shape, the thresholds, what the kernel reduces),
//! then, on a communicator that routes by measurement, the path its trials
//! found faster for the call's class ([`Tuner`]). Its answer carries what
//! the fast path needs ([`FastCall`]), so nothing after it decides again.
//!
//! Pure and allocation-free: it runs on every intercepted call.

use crate::config::{Config, Precision, Routing};
pub use crate::shape::{CallShape, Collective, ElemType, ReduceOp};
use std::time::Duration;

/// What the fast path is asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastOp {
    /// A (type, op) pair the kernel reduces ([`datapath_reduces`]).
    Allreduce { elem: ElemType, op: ReduceOp },
    /// The message as bytes (see [`CallShape::contiguous`]).
    Bcast,
}

impl FastOp {
    pub const fn collective(self) -> Collective {
        match self {
            FastOp::Allreduce { .. } => Collective::Allreduce,
            FastOp::Bcast => Collective::Bcast,
        }
    }
}

/// Which measurement a fast call belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Measure {
    /// The collective routes by threshold ([`Routing::Threshold`]).
    Fixed,
    /// One of its class's fast-path trials: time it, report it with
    /// [`Tuner::sample`].
    Trial(Class),
    /// Its class settled on the fast path.
    Settled(Class),
}

/// A call [`decide`] sent to the fast path: all the fast path needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastCall {
    pub op: FastOp,
    /// The message in bytes (a whole number of elements for an allreduce).
    pub bytes: usize,
    pub measure: Measure,
}

impl FastCall {
    pub const fn collective(&self) -> Collective {
        self.op.collective()
    }
}

/// The answer of [`decide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Fast(FastCall),
    Pmpi(Reason),
    /// Eligible, and one of its class's MPI trials: PMPI, timed (counted as
    /// [`Reason::Trial`]; report it with [`Tuner::sample`]).
    MpiTrial(Class),
}

/// Why a call went to PMPI. Each has a counter in [`crate::stats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Reason {
    /// `ERAR_DISABLE=1`.
    Disabled,
    /// MPI called itself (e.g. inside `MPI_File_open`): never intercepted.
    Reentrant,
    /// Negative count or other erroneous input: MPI reports the error.
    InvalidArgs,
    /// A count of zero or a communicator of one rank: nothing to move.
    Trivial,
    InterComm,
    UnsupportedType,
    UnsupportedOp,
    /// Below `ERAR_MIN_BYTES` (`ERAR_BCAST_MIN_BYTES`): too small for the
    /// fast path to be worth even a trial.
    BelowThreshold,
    /// A trial: MPI timed against the fast path (see [`crate::select`]).
    Trial,
    /// The trials on this communicator found MPI faster for this class.
    MeasuredSlower,
    /// The eBPF datapath is not attached on this host (or not yet built).
    DatapathUnavailable,
    /// The fast path was tried and gave the call back untouched
    /// (e.g. float data outside the exact range, a ring setup failure).
    FastPathDeclined,
}

impl Reason {
    /// The call could have taken the fast path, and MPI carries it by
    /// choice (size, a trial, a measurement, the datapath's state): under
    /// the `reproducible` contract such a float SUM must still give the
    /// ring's bits. The other reasons send the call to MPI as it is
    /// (disabled, erroneous, trivial, or nothing the fast path carries).
    pub const fn is_a_routing_choice(self) -> bool {
        matches!(
            self,
            Reason::BelowThreshold
                | Reason::Trial
                | Reason::MeasuredSlower
                | Reason::DatapathUnavailable
                | Reason::FastPathDeclined
        )
    }

    pub const ALL: [Reason; 12] = [
        Reason::Disabled,
        Reason::Reentrant,
        Reason::InvalidArgs,
        Reason::Trivial,
        Reason::InterComm,
        Reason::UnsupportedType,
        Reason::UnsupportedOp,
        Reason::BelowThreshold,
        Reason::Trial,
        Reason::MeasuredSlower,
        Reason::DatapathUnavailable,
        Reason::FastPathDeclined,
    ];

    /// Stable name used in logs and in the `ERAR_STATS` line.
    pub const fn name(self) -> &'static str {
        match self {
            Reason::Disabled => "disabled",
            Reason::Reentrant => "reentrant",
            Reason::InvalidArgs => "invalid_args",
            Reason::Trivial => "trivial",
            Reason::InterComm => "inter_comm",
            Reason::UnsupportedType => "unsupported_type",
            Reason::UnsupportedOp => "unsupported_op",
            Reason::BelowThreshold => "below_threshold",
            Reason::Trial => "trial",
            Reason::MeasuredSlower => "measured_slower",
            Reason::DatapathUnavailable => "datapath_unavailable",
            Reason::FastPathDeclined => "fast_path_declined",
        }
    }
}

/// Which (type, op) pairs the datapath reduces in the kernel.
///
/// Integers: exact for every bitwise and ordering op and for SUM (two's
/// complement wrap-around, as every MPI does). Floats: SUM through exact
/// fixed point (see [`crate::numerics`]), MAX/MIN through an order-preserving
/// integer mapping. PROD is never in-kernel.
pub const fn datapath_reduces(elem: ElemType, op: ReduceOp) -> bool {
    // The kernel's one table (datapath/wire_ops.rs), which the codec's
    // plans expand too.
    crate::datapath::wire_ops::kernel_reduces!(elem, op).is_some()
}

/// The routing of `coll`'s eligible calls and its floor (for float SUM
/// allreduces the floor is `cfg.float_sum_min_bytes`).
pub fn routing(cfg: &Config, coll: Collective) -> (Routing, usize) {
    match coll {
        Collective::Allreduce => (cfg.allreduce_routing, cfg.allreduce_min_bytes),
        Collective::Bcast => (cfg.bcast_routing, cfg.bcast_min_bytes),
    }
}

/// Route one call. `datapath_ready` says whether this process can use the
/// datapath at all. `comm` is asked only for an eligible call (so a
/// declined call costs no lookup): the communicator's [`Tuner`], or `None`
/// when its ring was declined (every later call goes to MPI); its error is
/// returned as it is. On a collective routed by measurement, the call's
/// class takes the path its trials found faster, after the trials.
pub fn decide<'t, E>(
    call: &CallShape,
    cfg: &Config,
    datapath_ready: bool,
    comm: impl FnOnce() -> Result<Option<&'t Tuner>, E>,
) -> Result<Route, E> {
    let op = match eligible(call, cfg) {
        Ok(op) => op,
        Err(reason) => return Ok(Route::Pmpi(reason)),
    };
    if !datapath_ready {
        return Ok(Route::Pmpi(Reason::DatapathUnavailable));
    }
    let Some(tuner) = comm()? else {
        return Ok(Route::Pmpi(Reason::DatapathUnavailable));
    };
    let bytes = call.bytes;
    let fast = |measure| Route::Fast(FastCall { op, bytes, measure });
    if routing(cfg, call.collective).0 != Routing::Measured {
        return Ok(fast(Measure::Fixed));
    }
    let class = Class::of_fast(op, bytes);
    Ok(match tuner.plan(class) {
        Plan::Use(Path::Fast) => fast(Measure::Settled(class)),
        Plan::Use(Path::Mpi) => Route::Pmpi(Reason::MeasuredSlower),
        Plan::Trial(Path::Fast) => fast(Measure::Trial(class)),
        Plan::Trial(Path::Mpi) => Route::MpiTrial(class),
    })
}

/// What the fast path would do with this call, or why it cannot: the shape,
/// the type and op, the size against the collective's floor.
fn eligible(call: &CallShape, cfg: &Config) -> Result<FastOp, Reason> {
    if cfg.disabled {
        return Err(Reason::Disabled);
    }
    if call.count < 0 {
        return Err(Reason::InvalidArgs);
    }
    if call.inter_comm {
        return Err(Reason::InterComm);
    }
    if call.count == 0 || call.comm_size < 2 {
        return Err(Reason::Trivial);
    }
    let (op, threshold) = match call.collective {
        Collective::Allreduce => {
            let elem = call.elem.ok_or(Reason::UnsupportedType)?;
            let op = match call.op {
                Some(op) if datapath_reduces(elem, op) => op,
                _ => return Err(Reason::UnsupportedOp),
            };
            let float_sum = matches!(elem, ElemType::F32 | ElemType::F64) && op == ReduceOp::Sum;
            let threshold = if float_sum {
                cfg.float_sum_min_bytes
            } else {
                cfg.allreduce_min_bytes
            };
            (FastOp::Allreduce { elem, op }, threshold)
        }
        Collective::Bcast if !call.contiguous => return Err(Reason::UnsupportedType),
        Collective::Bcast => (FastOp::Bcast, cfg.bcast_min_bytes),
    };
    if call.bytes < threshold {
        return Err(Reason::BelowThreshold);
    }
    Ok(op)
}

/// Under the `reproducible` contract, whether a float or double SUM that MPI
/// completes for `reason` must still give the ring's bits (through
/// `datapath::reproducible`): every routing choice (a size, a trial, a
/// measurement, the datapath's state), and every MPI_DOUBLE SUM, which is
/// not in-kernel. Erroneous and trivial calls go to MPI as they are (a
/// call whose buffers failed the shim's checks has no element type here).
pub fn mpi_gives_ring_bits(call: &CallShape, reason: Reason, cfg: &Config) -> bool {
    if cfg.precision != Precision::Reproducible || call.op != Some(ReduceOp::Sum) {
        return false;
    }
    match call.elem {
        Some(ElemType::F32) => reason.is_a_routing_choice(),
        Some(ElemType::F64) => reason.is_a_routing_choice() || reason == Reason::UnsupportedOp,
        _ => false,
    }
}

// Measured routing: the path an eligible call takes is chosen by
// measurement, per communicator and per class of call (collective, element
// type, float SUM or not, power-of-two size), never by a guess.
//
// The first [`TRIALS`] calls of a class are trials: three on MPI, then
// three on the fast path, back to back as the program makes them, each
// timed on every rank. The first of each run is not counted (it pays the
// switch from the other path, and the fast path's first call may set up
// the ring); each rank keeps its best of the other two. After the last
// trial the ranks add up their best times per path (an MPI SUM the shim
// runs, once per class: the mean over ranks, which is what OSU reports),
// and from then on the class takes the path that was faster. No exchange
// is added to a decided call. Every rank makes the same trials on the same
// calls (collectives are called in the same order with the same sizes) and
// decides from the same agreed numbers, so a rank whose own clock says
// otherwise cannot route a call differently from the others.
//
// Back to back, not from a barrier: a call's time on a rank then includes
// what the path makes it wait for the others, as in the program and in
// OSU (MPI pipelines successive broadcasts; isolated by a barrier, MPI's
// trials measured 2-3x slower than OSU's figure and lost where MPI wins).
//
// [`Tuner`] is pure: no MPI, no clock, no allocation after [`Tuner::new`].
// The shim owns one per communicator, hands it to [`decide`] and reports the
// trials [`decide`] asks for.

/// The two ways to complete an eligible call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The real MPI, through PMPI.
    Mpi,
    /// The in-kernel ring.
    Fast,
}

impl Path {
    pub const fn name(self) -> &'static str {
        match self {
            Path::Mpi => "mpi",
            Path::Fast => "fast",
        }
    }
}

/// Trial calls per class: three on MPI, then three on the fast path, the
/// first of each not counted. No more, because a trial of the losing path
/// costs what losing costs (up to 4x a call where the fast path is slow);
/// six calls fit in OSU's default warm-up of 10 for large messages.
pub const TRIALS: u8 = 6;
const PER_PATH: u8 = TRIALS / 2;

/// What to do with the next call of a class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Time this call on this path and report it with [`Tuner::sample`].
    Trial(Path),
    /// The class is decided.
    Use(Path),
}

const SIZE_BUCKETS: usize = 48;
/// Broadcast; then per float type SUM (encoded on the host) apart from its
/// other ops (mapped to integers); then one per integer type.
const KINDS: usize = 9;
const KIND_NAMES: [&str; KINDS] = [
    "bcast",
    "allreduce.f32",
    "allreduce.f32.sum",
    "allreduce.f64",
    "allreduce.f64.sum",
    "allreduce.i32",
    "allreduce.u32",
    "allreduce.i64",
    "allreduce.u64",
];

/// A class of calls that share a decision. Only [`Class::of`] makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Class(u16);

impl Class {
    /// The class of an eligible call (`None` for an allreduce without a known
    /// type and op, which is never eligible). Depends only on what every rank
    /// passes alike: the collective, the type, the op and the size in bytes.
    pub fn of(call: &CallShape) -> Option<Class> {
        let op = match call.collective {
            Collective::Bcast => FastOp::Bcast,
            Collective::Allreduce => FastOp::Allreduce {
                elem: call.elem?,
                op: call.op?,
            },
        };
        Some(Class::of_fast(op, call.bytes))
    }

    fn of_fast(op: FastOp, bytes: usize) -> Class {
        let kind = match op {
            FastOp::Bcast => 0,
            FastOp::Allreduce { elem, op } => {
                let sum = op == ReduceOp::Sum;
                match elem {
                    ElemType::F32 => 1 + usize::from(sum),
                    ElemType::F64 => 3 + usize::from(sum),
                    ElemType::I32 => 5,
                    ElemType::U32 => 6,
                    ElemType::I64 => 7,
                    ElemType::U64 => 8,
                }
            }
        };
        let bucket = (bytes.max(1).ilog2() as usize).min(SIZE_BUCKETS - 1);
        Class((kind * SIZE_BUCKETS + bucket) as u16)
    }

    /// Smallest size in bytes of this class (a power of two).
    pub fn min_bytes(self) -> usize {
        1 << (self.0 as usize % SIZE_BUCKETS)
    }

    /// `allreduce.f32.sum`, `allreduce.i32`, `bcast`: for logs and stats.
    pub fn kind_name(self) -> &'static str {
        KIND_NAMES[self.0 as usize / SIZE_BUCKETS]
    }
}

#[derive(Clone, Copy, Debug)]
struct State {
    trials: u8,
    /// Best counted trial time of each path on this rank, µs (index:
    /// `Path as usize`).
    best_us: [i64; 2],
    chosen: Option<Path>,
    /// The agreed times the decision was made from (sums over ranks).
    agreed_us: [i64; 2],
}

const UNSEEN: State = State {
    trials: 0,
    best_us: [i64::MAX; 2],
    chosen: None,
    agreed_us: [0; 2],
};

/// One communicator's decisions.
pub struct Tuner {
    classes: Box<[State]>,
}

impl Default for Tuner {
    fn default() -> Self {
        Self::new()
    }
}

impl Tuner {
    pub fn new() -> Tuner {
        Tuner {
            classes: vec![UNSEEN; KINDS * SIZE_BUCKETS].into_boxed_slice(),
        }
    }

    pub fn plan(&self, class: Class) -> Plan {
        let s = &self.classes[class.0 as usize];
        match s.chosen {
            Some(path) => Plan::Use(path),
            None if s.trials < PER_PATH => Plan::Trial(Path::Mpi),
            None => Plan::Trial(Path::Fast),
        }
    }

    /// Records how long this rank's trial on `path` (the one [`Tuner::plan`]
    /// said) took. After the class's last trial, returns this rank's best
    /// time of each path in µs, indexed by `Path as usize`: the caller adds
    /// it up over all ranks and hands the sums to [`Tuner::settle`].
    pub fn sample(&mut self, class: Class, path: Path, took: Duration) -> Option<[i64; 2]> {
        let s = &mut self.classes[class.0 as usize];
        debug_assert_eq!(path == Path::Fast, s.trials >= PER_PATH);
        if !s.trials.is_multiple_of(PER_PATH) {
            let us = i64::try_from(took.as_micros()).unwrap_or(i64::MAX);
            s.best_us[path as usize] = s.best_us[path as usize].min(us);
        }
        s.trials += 1;
        // Bounded, so that a sum over any number of ranks cannot wrap.
        (s.trials >= TRIALS).then_some(s.best_us.map(|t| t.min(i64::from(u32::MAX))))
    }

    /// Decides the class from the agreed times (each path's best times
    /// summed over ranks) and returns the winner: the fast path only if it
    /// was faster.
    pub fn settle(&mut self, class: Class, agreed_us: [i64; 2]) -> Path {
        let path = winner(agreed_us);
        let s = &mut self.classes[class.0 as usize];
        s.chosen = Some(path);
        s.agreed_us = agreed_us;
        path
    }

    /// For a class settled on the fast path: MPI's time for one of its
    /// calls as the trials measured it (the mean over `ranks` ranks of
    /// each rank's best), in µs; what a fast call of the class is compared
    /// with in the `ERAR_STATS` summary.
    pub fn mpi_estimate_us(&self, class: Class, ranks: usize) -> Option<i64> {
        let s = &self.classes[class.0 as usize];
        (s.chosen == Some(Path::Fast))
            .then(|| s.agreed_us[Path::Mpi as usize] / ranks.max(1) as i64)
    }
}

/// The faster path by the agreed times; MPI on a tie.
pub fn winner(agreed_us: [i64; 2]) -> Path {
    if agreed_us[Path::Fast as usize] < agreed_us[Path::Mpi as usize] {
        Path::Fast
    } else {
        Path::Mpi
    }
}

#[cfg(test)]
mod tests;
