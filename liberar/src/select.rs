//! The one routing decision: does this call take the eBPF fast path, or go
//! to the real MPI through PMPI — and why.
//!
//! Pure and allocation-free: it runs on every intercepted call.

use crate::config::{Config, Routing};

/// Which collective is being routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    Allreduce,
    Bcast,
}

/// Predefined contiguous element types the datapath understands.
/// The shim maps MPI handles to these; anything else is `None` in [`CallShape`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    F32,
    F64,
    I32,
    U32,
    I64,
    U64,
}

impl ElemType {
    pub const ALL: [ElemType; 6] = [
        ElemType::F32,
        ElemType::F64,
        ElemType::I32,
        ElemType::U32,
        ElemType::I64,
        ElemType::U64,
    ];

    pub const fn size(self) -> usize {
        match self {
            ElemType::F32 | ElemType::I32 | ElemType::U32 => 4,
            ElemType::F64 | ElemType::I64 | ElemType::U64 => 8,
        }
    }
}

/// Predefined reduction operators. User-defined ops are `None` in [`CallShape`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Prod,
    Max,
    Min,
    Band,
    Bor,
    Bxor,
}

/// Everything about one call that routing depends on.
#[derive(Clone, Copy, Debug)]
pub struct CallShape {
    pub collective: Collective,
    /// `None`: a datatype the fast path does not know (derived, user, …).
    pub elem: Option<ElemType>,
    /// `None`: a user-defined or unknown op; always `None` for `Bcast`.
    pub op: Option<ReduceOp>,
    /// The shim can hand the datapath the message as one string of bytes
    /// (a predefined or dense datatype as it is, any other through
    /// MPI_Pack): what `Bcast` needs. For `Bcast` it must not depend on
    /// the rank's datatype beyond its type signature, or ranks of a correct
    /// program could route one call differently.
    pub contiguous: bool,
    /// As the caller passed it (may be negative: erroneous input).
    pub count: i64,
    /// Message size in bytes (count × datatype size), 0 if unknown.
    pub bytes: usize,
    pub in_place: bool,
    pub comm_size: usize,
    pub inter_comm: bool,
    /// The job runs at `MPI_THREAD_MULTIPLE`.
    pub thread_multiple: bool,
}

/// The answer of [`decide`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    Fast,
    Pmpi(Reason),
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
    /// A trial: MPI timed against the fast path (see [`crate::tuning`]).
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

/// Route one call. `datapath_ready` says whether this host has the datapath
/// attached and usable by this process. `Fast` means eligible: which of the
/// two paths an eligible call takes is [`crate::tuning`]'s to say, unless
/// the collective's routing is [`crate::config::Routing::Threshold`].
pub fn decide(call: &CallShape, cfg: &Config, datapath_ready: bool) -> Route {
    if cfg.disabled {
        return Route::Pmpi(Reason::Disabled);
    }
    if call.count < 0 {
        return Route::Pmpi(Reason::InvalidArgs);
    }
    if call.inter_comm {
        return Route::Pmpi(Reason::InterComm);
    }
    if call.count == 0 || call.comm_size < 2 {
        return Route::Pmpi(Reason::Trivial);
    }
    match call.collective {
        Collective::Allreduce => {
            let Some(elem) = call.elem else {
                return Route::Pmpi(Reason::UnsupportedType);
            };
            match call.op {
                Some(op) if datapath_reduces(elem, op) => {}
                _ => return Route::Pmpi(Reason::UnsupportedOp),
            }
        }
        Collective::Bcast if !call.contiguous => return Route::Pmpi(Reason::UnsupportedType),
        Collective::Bcast => {}
    }
    let float_sum =
        matches!(call.elem, Some(ElemType::F32 | ElemType::F64)) && call.op == Some(ReduceOp::Sum);
    let threshold = match call.collective {
        Collective::Allreduce if float_sum => cfg.float_sum_min_bytes,
        Collective::Allreduce => cfg.allreduce_min_bytes,
        Collective::Bcast => cfg.bcast_min_bytes,
    };
    if call.bytes < threshold {
        return Route::Pmpi(Reason::BelowThreshold);
    }
    if !datapath_ready {
        return Route::Pmpi(Reason::DatapathUnavailable);
    }
    Route::Fast
}

#[cfg(test)]
mod tests {
    use super::*;

    fn big_f32_sum() -> CallShape {
        CallShape {
            collective: Collective::Allreduce,
            elem: Some(ElemType::F32),
            op: Some(ReduceOp::Sum),
            contiguous: true,
            count: 1 << 20,
            bytes: 4 << 20,
            in_place: false,
            comm_size: 4,
            inter_comm: false,
            thread_multiple: false,
        }
    }

    #[test]
    fn large_float_sum_is_fast_when_ready() {
        let cfg = Config::default();
        assert_eq!(decide(&big_f32_sum(), &cfg, true), Route::Fast);
        assert_eq!(
            decide(&big_f32_sum(), &cfg, false),
            Route::Pmpi(Reason::DatapathUnavailable)
        );
    }

    #[test]
    fn reasons_are_specific() {
        let cfg = Config::default();
        let mut c = big_f32_sum();
        c.count = -1;
        assert_eq!(decide(&c, &cfg, true), Route::Pmpi(Reason::InvalidArgs));
        let mut c = big_f32_sum();
        c.op = None;
        assert_eq!(decide(&c, &cfg, true), Route::Pmpi(Reason::UnsupportedOp));
        let mut c = big_f32_sum();
        c.op = Some(ReduceOp::Prod);
        assert_eq!(decide(&c, &cfg, true), Route::Pmpi(Reason::UnsupportedOp));
        let mut c = big_f32_sum();
        c.elem = None;
        assert_eq!(decide(&c, &cfg, true), Route::Pmpi(Reason::UnsupportedType));
        let mut c = big_f32_sum();
        c.bytes = 16;
        c.count = 4;
        assert_eq!(decide(&c, &cfg, true), Route::Pmpi(Reason::BelowThreshold));
        let mut c = big_f32_sum();
        c.comm_size = 1;
        assert_eq!(decide(&c, &cfg, true), Route::Pmpi(Reason::Trivial));
        let mut c = big_f32_sum();
        c.inter_comm = true;
        assert_eq!(decide(&c, &cfg, true), Route::Pmpi(Reason::InterComm));
        let cfg = Config {
            disabled: true,
            ..Config::default()
        };
        assert_eq!(
            decide(&big_f32_sum(), &cfg, true),
            Route::Pmpi(Reason::Disabled)
        );
    }

    #[test]
    fn float_sum_has_its_own_floor() {
        let cfg = Config::default();
        assert!(cfg.float_sum_min_bytes > cfg.allreduce_min_bytes);
        let mut c = big_f32_sum();
        c.bytes = cfg.allreduce_min_bytes;
        c.count = (c.bytes / 4) as i64;
        assert_eq!(decide(&c, &cfg, true), Route::Pmpi(Reason::BelowThreshold));
        c.op = Some(ReduceOp::Max);
        assert_eq!(decide(&c, &cfg, true), Route::Fast);
        c.op = Some(ReduceOp::Sum);
        c.elem = Some(ElemType::I32);
        assert_eq!(decide(&c, &cfg, true), Route::Fast);
        c.elem = Some(ElemType::F32);
        c.bytes = cfg.float_sum_min_bytes;
        assert_eq!(decide(&c, &cfg, true), Route::Fast);
    }

    #[test]
    fn bcast_ignores_op() {
        let cfg = Config::default();
        let mut c = big_f32_sum();
        c.collective = Collective::Bcast;
        c.op = None;
        assert_eq!(decide(&c, &cfg, true), Route::Fast);
    }
}
