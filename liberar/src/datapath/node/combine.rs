//! The host side of the kernel's combines: `acc = op(acc, x)` element-wise
//! over raw bytes, for the wire ops that carry a caller's elements as they
//! are (`Carried::Raw`), so that the ranks of one host reduce exactly what
//! the ring then reduces across hosts. Every one of these ops is exact,
//! associative and commutative (integer SUM wraps around, as in MPI and in
//! the kernel), so any order gives the same bits.

use crate::datapath::wire as w;

/// Expands `$body` once per wire op, with `$n` the element size and `$f`
/// the combine of one element (`$f(d, s)`: `d = op(d, s)`), so that each
/// op's loop is compiled with its combine inlined. `false` for a wire op
/// with no host combine (never raw), `true` once `$body` ran.
macro_rules! per_op {
    ($wire_op:expr, |$n:ident, $f:ident| $body:expr) => {{
        macro_rules! with {
            ($t:ty, |$a:ident, $b:ident| $e:expr) => {{
                const $n: usize = std::mem::size_of::<$t>();
                let $f = |d: &mut [u8], s: &[u8]| {
                    let $a = <$t>::from_ne_bytes(d[..$n].try_into().unwrap_or([0; $n]));
                    let $b = <$t>::from_ne_bytes(s[..$n].try_into().unwrap_or([0; $n]));
                    d[..$n].copy_from_slice(&($e).to_ne_bytes());
                };
                $body;
                true
            }};
        }
        match $wire_op {
            w::ERAR_OP_ADD_I32 => with!(u32, |a, b| a.wrapping_add(b)),
            w::ERAR_OP_ADD_I64 => with!(u64, |a, b| a.wrapping_add(b)),
            w::ERAR_OP_MAX_I32 => with!(i32, |a, b| a.max(b)),
            w::ERAR_OP_MIN_I32 => with!(i32, |a, b| a.min(b)),
            w::ERAR_OP_MAX_U32 => with!(u32, |a, b| a.max(b)),
            w::ERAR_OP_MIN_U32 => with!(u32, |a, b| a.min(b)),
            w::ERAR_OP_MAX_I64 => with!(i64, |a, b| a.max(b)),
            w::ERAR_OP_MIN_I64 => with!(i64, |a, b| a.min(b)),
            w::ERAR_OP_MAX_U64 => with!(u64, |a, b| a.max(b)),
            w::ERAR_OP_MIN_U64 => with!(u64, |a, b| a.min(b)),
            // Bitwise: any word width gives the same bytes; u32 keeps the
            // 4-byte types whole.
            w::ERAR_OP_AND => with!(u32, |a, b| a & b),
            w::ERAR_OP_OR => with!(u32, |a, b| a | b),
            w::ERAR_OP_XOR => with!(u32, |a, b| a ^ b),
            _ => false,
        }
    }};
}

/// Element-wise `acc = op(acc, x)` (`acc.len() == x.len()`, a whole number
/// of elements). `false` for a wire op with no host combine (never raw).
pub fn combine(wire_op: u32, acc: &mut [u8], x: &[u8]) -> bool {
    per_op!(wire_op, |N, f| {
        for (d, s) in acc.chunks_exact_mut(N).zip(x.chunks_exact(N)) {
            f(d, s);
        }
    })
}

/// Element-wise `dst = op(a, b)` in one pass (all three the same length).
pub fn combine_into(wire_op: u32, dst: &mut [u8], a: &[u8], b: &[u8]) -> bool {
    per_op!(wire_op, |N, f| {
        let pairs = a.chunks_exact(N).zip(b.chunks_exact(N));
        for (d, (x, y)) in dst.chunks_exact_mut(N).zip(pairs) {
            d.copy_from_slice(x);
            f(d, y);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{combine, combine_into};
    use crate::datapath::wire as w;

    fn bytes32(v: &[i32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    fn ints32(b: &[u8]) -> Vec<i32> {
        b.chunks_exact(4)
            .map(|c| i32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    #[test]
    fn sums_wrap_and_orders_keep_sign() {
        let mut acc = bytes32(&[i32::MAX, -5, 7, 0]);
        let x = bytes32(&[1, 3, -9, -1]);
        let mut sum = acc.clone();
        assert!(combine(w::ERAR_OP_ADD_I32, &mut sum, &x));
        assert_eq!(ints32(&sum), vec![i32::MIN, -2, -2, -1]);
        assert!(combine(w::ERAR_OP_MAX_I32, &mut acc, &x));
        assert_eq!(ints32(&acc), vec![i32::MAX, 3, 7, 0]);
        let mut u = bytes32(&[-1, 2, 0, 0]);
        assert!(combine(w::ERAR_OP_MIN_U32, &mut u, &bytes32(&[5, 1, 0, 0])));
        assert_eq!(ints32(&u), vec![5, 1, 0, 0]);
    }

    #[test]
    fn sixty_four_bit_and_bitwise() {
        let a: Vec<u8> = [u64::MAX, 4].iter().flat_map(|x| x.to_ne_bytes()).collect();
        let b: Vec<u8> = [2u64, 1].iter().flat_map(|x| x.to_ne_bytes()).collect();
        let mut s = a.clone();
        assert!(combine(w::ERAR_OP_ADD_I64, &mut s, &b));
        let want: Vec<u8> = [1u64, 5].iter().flat_map(|x| x.to_ne_bytes()).collect();
        assert_eq!(s, want);
        let mut m = a.clone();
        assert!(combine(w::ERAR_OP_MIN_I64, &mut m, &b));
        let want: Vec<u8> = [-1i64 as u64, 1]
            .iter()
            .flat_map(|x| x.to_ne_bytes())
            .collect();
        assert_eq!(m, want);
        let mut x = a;
        assert!(combine(w::ERAR_OP_XOR, &mut x, &b));
        let want: Vec<u8> = [u64::MAX ^ 2, 5]
            .iter()
            .flat_map(|x| x.to_ne_bytes())
            .collect();
        assert_eq!(x, want);
        assert!(!combine(w::ERAR_OP_BCAST, &mut [0u8; 4], &[0u8; 4]));
    }

    #[test]
    fn into_a_third_buffer_is_the_same_combine() {
        let a = bytes32(&[i32::MIN, 4, -7, 9]);
        let b = bytes32(&[-1, 4, 7, -10]);
        for op in [
            w::ERAR_OP_ADD_I32,
            w::ERAR_OP_MIN_I32,
            w::ERAR_OP_XOR,
            w::ERAR_OP_MAX_U32,
        ] {
            let mut two = a.clone();
            assert!(combine(op, &mut two, &b));
            let mut three = vec![0u8; a.len()];
            assert!(combine_into(op, &mut three, &a, &b));
            assert_eq!(three, two, "op {op}");
        }
    }
}
