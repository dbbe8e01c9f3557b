//! How a (type, op, precision) travels through the kernel ring: the wire op
//! and layout of one segment ([`Plan`]), and, for float SUM, the per-block
//! scales every rank agrees on, the encoding into the slot and the decoding
//! out of it, with the parts MPI completes (blocks no integer grid carries,
//! elements the bounded certificate cannot vouch for).
//!
//! This file holds the `Plan` and `Layout` of a segment and the scale
//! one block of float SUM travels on; the rest is one job a file:
//! * `codec/float_sum.rs`: the per-block scales every rank agrees on
//!   (`FloatSum`), the call's encode and finish, and the blocks no integer
//!   grid carries, which MPI completes;
//! * `codec/float_sum/repairs.rs`: the bounded contract's certificate and
//!   repairs (the elements it cannot vouch for), with the verdict that
//!   carries them;
//! * `codec/slot_words.rs`: the slot seen as words, and the encoding of the
//!   caller's floats into them and the decoding out of them (by each of a
//!   host's ranks, for a node path result kept in its slot).

use super::wire_ops::{kernel_reduces, Carried};
use super::{wire, Comm, Done, Reduction};
use crate::config::Precision;
use crate::numerics::{bounded, exact, quantized, BLOCK_ELEMS};
use crate::select::{ElemType, ReduceOp};

mod float_sum;
mod slot_words;

pub(super) use float_sum::FloatSum;
pub(super) use slot_words::{decode_kept, decode_order, encode_order};

/// How a (type, op, precision) travels through the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Plan {
    /// The caller's bytes as they are, combined by this wire op.
    Raw { op: u32, size: usize },
    /// f32 SUM, encoded per block.
    FloatSum(Precision),
    /// f32 MAX/MIN on order-preserving i32 keys; the wire op.
    FloatOrder(u32),
}

/// Where one segment's words sit in the slot: `chunks` chunks, of which
/// those from `flags_from` on hold the bounded contract's flag bits (for
/// other plans `flags_from == chunks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Layout {
    pub chunks: u32,
    pub flags_from: u32,
    /// u64 words of each of the two flag bitmaps.
    flag_words: usize,
}

impl Layout {
    fn flags_offset(self, chunk_bytes: usize) -> usize {
        self.flags_from as usize * chunk_bytes
    }
}

impl Plan {
    /// The plan of a (type, op) the kernel reduces (the kernel's table,
    /// `wire_ops::kernel_reduces!`), `None` for any other.
    pub(super) fn of(elem: ElemType, op: ReduceOp, precision: Precision) -> Option<Plan> {
        Some(match kernel_reduces!(elem, op)? {
            Carried::Raw(op) => Plan::Raw {
                op,
                size: elem.size(),
            },
            Carried::FloatOrder(op) => Plan::FloatOrder(op),
            Carried::FloatSum => Plan::FloatSum(precision),
        })
    }

    pub(super) fn wire_op(self) -> u32 {
        match self {
            Plan::Raw { op, .. } | Plan::FloatOrder(op) => op,
            Plan::FloatSum(Precision::Bounded) => wire::ERAR_OP_ADD_I32_FLAGS,
            Plan::FloatSum(Precision::Reproducible) => wire::ERAR_OP_ADD_I64,
            Plan::FloatSum(Precision::Quantized) => wire::ERAR_OP_ADD_I32,
        }
    }

    /// Bytes per element in the value chunks.
    fn wire_size(self) -> usize {
        match self {
            Plan::FloatSum(Precision::Reproducible) => 8,
            Plan::FloatSum(_) | Plan::FloatOrder(_) => 4,
            Plan::Raw { size, .. } => size,
        }
    }

    /// The slot layout of `count` elements in chunks of `chunk_bytes`.
    pub(super) fn layout(self, count: usize, chunk_bytes: usize) -> Layout {
        let values = (count * self.wire_size()).div_ceil(chunk_bytes) as u32;
        if self != Plan::FloatSum(Precision::Bounded) {
            return Layout {
                chunks: values,
                flags_from: values,
                flag_words: 0,
            };
        }
        let flag_words = count.div_ceil(bounded::FLAG_BITS);
        let flags = (2 * flag_words * 8).div_ceil(chunk_bytes) as u32;
        Layout {
            chunks: values + flags,
            flags_from: values,
            flag_words,
        }
    }

    /// Elements of the caller's type one segment of `slot_bytes` holds; a
    /// whole number of numerics blocks so that blocks never straddle
    /// segments.
    pub(super) fn segment_elems(self, slot_bytes: usize, chunk_bytes: usize) -> usize {
        let wire_elems = if self == Plan::FloatSum(Precision::Bounded) {
            // 4 bytes and 2 bits per element, each part padded to a chunk.
            (slot_bytes - 2 * chunk_bytes) * 4 / 17
        } else {
            slot_bytes / self.wire_size()
        };
        (wire_elems / BLOCK_ELEMS).max(1) * BLOCK_ELEMS
    }
}

/// What one ring member contributes to a float SUM segment.
#[derive(Clone, Copy)]
pub(in crate::datapath) enum Input<'a> {
    /// The caller's `send`, or its `recv` when in place (`None`).
    Caller(Option<&'a [u8]>),
    /// The inputs of a host's ranks, in local rank order (a slice leader
    /// of the node path, `datapath/node.rs`): each is encoded on the
    /// agreed scales and their words added, as the ring adds those of its
    /// members. What MPI must complete is not reduced here: `left` is
    /// told the byte range, which MPI completes over the whole
    /// communicator, from every rank's own input, once the call is back.
    /// With `keep`, the result stays in the slot as words, and the
    /// caller's buffer gets the block steps and repairs to decode it with
    /// (`slot_words::decode_kept`, by each of the host's ranks).
    Local {
        parts: &'a [&'a [u8]],
        left: &'a dyn Fn(std::ops::Range<usize>),
        keep: bool,
    },
}

impl Input<'_> {
    /// Runs `f` on the contributions as parts: the caller's data (`recv`
    /// when in place) is one.
    pub(in crate::datapath) fn with_parts<R>(
        self,
        recv: &[u8],
        f: impl FnOnce(&[&[u8]]) -> R,
    ) -> R {
        match self {
            Input::Caller(send) => f(&[send.unwrap_or(recv)]),
            Input::Local { parts, .. } => f(parts),
        }
    }

    /// Has MPI reduce bytes `r` of this input into `recv[r]` over `comm`
    /// (MPI's own datatype and op); a host's local inputs leave the range
    /// to the whole communicator instead.
    pub(in crate::datapath) fn pmpi_allreduce(
        self,
        comm: &dyn Comm,
        r: std::ops::Range<usize>,
        recv: &mut [u8],
        how: Reduction,
    ) -> Done {
        match self {
            Input::Caller(send) => {
                comm.pmpi_allreduce(send.map(|s| &s[r.clone()]), &mut recv[r], how)
            }
            Input::Local { left, .. } => {
                left(r);
                Ok(())
            }
        }
    }
}

/// How one block of f32 SUM travels, agreed by every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
enum BlockScale {
    Exact(exact::Grid),
    Quantized(quantized::Step),
    Bounded(bounded::Grid),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_pair_has_a_plan() {
        use crate::select::datapath_reduces;
        let elems = ElemType::ALL;
        let ops = crate::datapath::wire_ops::ALL_OPS;
        for e in elems {
            for o in ops {
                assert_eq!(
                    datapath_reduces(e, o),
                    Plan::of(e, o, Precision::Bounded).is_some(),
                    "{e:?} {o:?}"
                );
            }
        }
    }
}
