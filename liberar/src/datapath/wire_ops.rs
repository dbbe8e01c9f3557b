//! The one table of what the kernel reduces: which (element type, MPI op)
//! travels on which wire op (`enum erar_wire_op` in erar_wire.h), and how.
//! `select::datapath_reduces` (may a call take the fast path) and the
//! codec's `Plan::of` (how it travels) both expand [`kernel_reduces!`], so
//! they cannot disagree; the tests below check every row against the
//! combines the kernel has (erar_reduce.h's `ERAR_COMBINES`, read at build
//! time into `wire::ERAR_KERNEL_COMBINES`).
//!
//! Why a macro and not a function: the table is written in `select`'s
//! types (`ElemType`, `ReduceOp`, named as the caller has them in scope),
//! and `select` uses it. A function here taking those types would make this
//! module and `select` import each other; expanded where it is used, the
//! table imports nothing above the wire format.

/// How a (type, op) the kernel reduces travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carried {
    /// The caller's elements as they are, combined by this wire op.
    Raw(u32),
    /// f32 MAX/MIN as order-preserving i32 keys, combined by this wire op.
    FloatOrder(u32),
    /// f32 SUM in fixed point; its wire op follows the precision contract
    /// (the codec's `Plan::wire_op`).
    FloatSum,
}

/// `kernel_reduces!(elem, op)`: `Some(`[`Carried`]`)` when the kernel
/// reduces (`elem`, `op`), else `None`, for `ElemType` and `ReduceOp` (of
/// `crate::select`) in scope. Integers: exact for SUM (two's complement
/// wrap-around, as every MPI does), MAX/MIN and the bitwise ops; f32: SUM
/// in fixed point, MAX/MIN on order keys; f64 and PROD never.
macro_rules! kernel_reduces {
    ($elem:expr, $op:expr) => {{
        use $crate::datapath::wire as w;
        use $crate::datapath::wire_ops::Carried::{FloatOrder, FloatSum, Raw};
        match ($elem, $op) {
            (ElemType::F32, ReduceOp::Sum) => Some(FloatSum),
            (ElemType::F32, ReduceOp::Max) => Some(FloatOrder(w::ERAR_OP_MAX_I32)),
            (ElemType::F32, ReduceOp::Min) => Some(FloatOrder(w::ERAR_OP_MIN_I32)),
            (ElemType::I32 | ElemType::U32, ReduceOp::Sum) => Some(Raw(w::ERAR_OP_ADD_I32)),
            (ElemType::I64 | ElemType::U64, ReduceOp::Sum) => Some(Raw(w::ERAR_OP_ADD_I64)),
            (ElemType::I32, ReduceOp::Max) => Some(Raw(w::ERAR_OP_MAX_I32)),
            (ElemType::I32, ReduceOp::Min) => Some(Raw(w::ERAR_OP_MIN_I32)),
            (ElemType::U32, ReduceOp::Max) => Some(Raw(w::ERAR_OP_MAX_U32)),
            (ElemType::U32, ReduceOp::Min) => Some(Raw(w::ERAR_OP_MIN_U32)),
            (ElemType::I64, ReduceOp::Max) => Some(Raw(w::ERAR_OP_MAX_I64)),
            (ElemType::I64, ReduceOp::Min) => Some(Raw(w::ERAR_OP_MIN_I64)),
            (ElemType::U64, ReduceOp::Max) => Some(Raw(w::ERAR_OP_MAX_U64)),
            (ElemType::U64, ReduceOp::Min) => Some(Raw(w::ERAR_OP_MIN_U64)),
            (ElemType::I32 | ElemType::U32 | ElemType::I64 | ElemType::U64, ReduceOp::Band) => {
                Some(Raw(w::ERAR_OP_AND))
            }
            (ElemType::I32 | ElemType::U32 | ElemType::I64 | ElemType::U64, ReduceOp::Bor) => {
                Some(Raw(w::ERAR_OP_OR))
            }
            (ElemType::I32 | ElemType::U32 | ElemType::I64 | ElemType::U64, ReduceOp::Bxor) => {
                Some(Raw(w::ERAR_OP_XOR))
            }
            _ => None,
        }
    }};
}
pub(crate) use kernel_reduces;

/// Every `ReduceOp`, for tests that walk the table.
#[cfg(test)]
pub(crate) const ALL_OPS: [crate::select::ReduceOp; 7] = {
    use crate::select::ReduceOp;
    [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Band,
        ReduceOp::Bor,
        ReduceOp::Bxor,
    ]
};

#[cfg(test)]
mod tests {
    use super::{Carried, ALL_OPS as OPS};
    use crate::datapath::wire;
    use crate::select::{ElemType, ReduceOp};

    /// `x`'s low `bits` bits as an integer, signed or not.
    fn int(x: u64, bits: u32, signed: bool) -> i128 {
        match (bits, signed) {
            (32, true) => x as u32 as i32 as i128,
            (32, false) => x as u32 as i128,
            (_, true) => x as i64 as i128,
            _ => x as i128,
        }
    }

    /// The kernel's row of a wire op: (C word type, C expression).
    fn c_row(op: u32) -> Option<(&'static str, &'static str)> {
        wire::ERAR_KERNEL_COMBINES
            .iter()
            .find(|r| r.0 == op)
            .map(|r| (r.1, r.2))
    }

    /// What the kernel's row computes on two words of its type, read from
    /// the row itself (C type and expression), on values given as u64
    /// (zero- or sign-extended from the word's width).
    fn c_combine(op: u32, a: u64, b: u64) -> u64 {
        let (ty, expr) = c_row(op).unwrap_or_else(|| panic!("no kernel combine for op {op}"));
        let (bits, signed) = match ty {
            "__u32" => (32, false),
            "__s32" => (32, true),
            "__u64" => (64, false),
            "__s64" => (64, true),
            t => panic!("word type {t}"),
        };
        let ord = |x: u64| int(x, bits, signed);
        let r = match expr {
            // Two 32-bit lanes, each wrapping on its own.
            "ERAR_SWAR_ADD32(a, b)" => {
                let lo = (a as u32).wrapping_add(b as u32) as u64;
                let hi = ((a >> 32) as u32).wrapping_add((b >> 32) as u32) as u64;
                lo | hi << 32
            }
            "a + b" => a.wrapping_add(b),
            "ERAR_MAXV(a, b)" => {
                if ord(a) > ord(b) {
                    a
                } else {
                    b
                }
            }
            "ERAR_MINV(a, b)" => {
                if ord(a) < ord(b) {
                    a
                } else {
                    b
                }
            }
            "a & b" => a & b,
            "a | b" => a | b,
            "a ^ b" => a ^ b,
            e => panic!("expression {e}"),
        };
        if bits == 32 {
            r & 0xffff_ffff
        } else {
            r
        }
    }

    /// MPI's own meaning of (elem, op) on two elements given as their bytes
    /// in a u64 (little-endian, zero-extended).
    fn mpi_reduce(elem: ElemType, op: ReduceOp, a: u64, b: u64) -> u64 {
        let (w, signed) = match elem {
            ElemType::I32 => (32, true),
            ElemType::U32 => (32, false),
            ElemType::I64 => (64, true),
            ElemType::U64 => (64, false),
            e => panic!("{e:?} is not an integer"),
        };
        let v = |x: u64| int(x, w, signed);
        let r = match op {
            ReduceOp::Sum => a.wrapping_add(b),
            ReduceOp::Max => {
                if v(a) >= v(b) {
                    a
                } else {
                    b
                }
            }
            ReduceOp::Min => {
                if v(a) <= v(b) {
                    a
                } else {
                    b
                }
            }
            ReduceOp::Band => a & b,
            ReduceOp::Bor => a | b,
            ReduceOp::Bxor => a ^ b,
            ReduceOp::Prod => a.wrapping_mul(b),
        };
        if w == 32 {
            r & 0xffff_ffff
        } else {
            r
        }
    }

    /// Every row that carries integers as they are: the kernel's combine
    /// of its wire op, on the element's bytes laid into the kernel's words,
    /// is MPI's reduction of those elements.
    #[test]
    fn raw_rows_mean_what_mpi_means() {
        let samples: [u64; 9] = [
            0,
            1,
            2,
            0x7fff_ffff,
            0x8000_0000,
            0xffff_ffff,
            0x7fff_ffff_ffff_ffff,
            0x8000_0000_0000_0001,
            0xdead_beef_0123_4567,
        ];
        for elem in [ElemType::I32, ElemType::U32, ElemType::I64, ElemType::U64] {
            let width = elem.size() * 8;
            let mask = if width == 32 { 0xffff_ffff } else { u64::MAX };
            for op in OPS {
                let Some(Carried::Raw(w)) = kernel_reduces!(elem, op) else {
                    assert!(kernel_reduces!(elem, op).is_none(), "{elem:?} {op:?}");
                    continue;
                };
                let (ty, _) = c_row(w).unwrap_or_else(|| panic!("{elem:?} {op:?}: op {w}"));
                let word = if ty.ends_with("64") { 64 } else { 32 };
                for &a in &samples {
                    for &b in &samples {
                        let (a, b) = (a & mask, b & mask);
                        let want = mpi_reduce(elem, op, a, b);
                        // A 32-bit element in a 64-bit kernel word: the
                        // word holds two elements; check the low one with
                        // the other element of each word different.
                        let got = if word > width {
                            c_combine(w, a | 0x1234_5678 << 32, b | 0x0fed_cba9 << 32) & mask
                        } else {
                            c_combine(w, a, b)
                        };
                        assert_eq!(got, want, "{elem:?} {op:?} on {a:#x}, {b:#x}");
                    }
                }
            }
        }
    }

    /// Every wire op the table (or the float SUM contracts, through the
    /// codec) sends is one the kernel combines, and every combine the kernel
    /// has is used.
    #[test]
    fn the_kernel_has_every_op_the_table_sends() {
        let mut sent = vec![
            // Float SUM: quantized (i32), reproducible (i64), bounded (i32
            // values, then flag bits OR-ed: erar_reduce.h's combine_op).
            wire::ERAR_OP_ADD_I32,
            wire::ERAR_OP_ADD_I64,
            wire::ERAR_OP_OR,
        ];
        for elem in ElemType::ALL {
            for op in OPS {
                match kernel_reduces!(elem, op) {
                    Some(Carried::Raw(w) | Carried::FloatOrder(w)) => sent.push(w),
                    Some(Carried::FloatSum) => {
                        assert_eq!((elem, op), (ElemType::F32, ReduceOp::Sum))
                    }
                    None => {}
                }
            }
        }
        for w in &sent {
            assert!(c_row(*w).is_some(), "wire op {w} has no kernel combine");
        }
        for (w, ty, expr) in wire::ERAR_KERNEL_COMBINES {
            assert!(
                sent.contains(&w),
                "kernel combine {w} ({ty}, {expr}) is never sent"
            );
        }
        // f32 order keys are i32s (numerics::ordered).
        assert_eq!(c_row(wire::ERAR_OP_MAX_I32).map(|r| r.0), Some("__s32"));
        assert_eq!(c_row(wire::ERAR_OP_MIN_I32).map(|r| r.0), Some("__s32"));
    }
}
