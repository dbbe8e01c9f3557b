//! What an intercepted call is, in the words routing ([`crate::select`])
//! and the datapath share: the collective, its element type and op, and the
//! shape routing reads ([`CallShape`]). Definitions only: no decision is
//! made here.

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
    pub comm_size: usize,
    pub inter_comm: bool,
}
