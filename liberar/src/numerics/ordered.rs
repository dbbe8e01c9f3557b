//! Float MAX/MIN as integer MAX/MIN: an order-preserving map of f32 bits to
//! i32 (negative values have their magnitude bits flipped). Exact; the map
//! is its own inverse. NaN has no place in the order: callers send blocks
//! with NaN to MPI (reported by [`encode`]).

use super::simd;

simd::dispatch! {
    /// Maps `src` into `dst`; returns true if any value is NaN.
    pub fn encode(src: &[f32], dst: &mut [i32]) -> bool = encode_loop;
}

simd::dispatch! {
    pub fn decode(src: &[i32], dst: &mut [f32]) = decode_loop;
}

#[inline(always)]
fn encode_loop(src: &[f32], dst: &mut [i32]) -> bool {
    let mut nan = false;
    for (x, out) in src.iter().zip(dst.iter_mut()) {
        let b = x.to_bits() as i32;
        nan |= (b & 0x7fff_ffff) > 0x7f80_0000;
        *out = b ^ ((b >> 31) & 0x7fff_ffff);
    }
    nan
}

#[inline(always)]
fn decode_loop(src: &[i32], dst: &mut [f32]) {
    for (k, out) in src.iter().zip(dst.iter_mut()) {
        *out = f32::from_bits((k ^ ((k >> 31) & 0x7fff_ffff)) as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_preserved_and_map_inverts() {
        let vals = [
            f32::NEG_INFINITY,
            -f32::MAX,
            -1.5,
            -f32::MIN_POSITIVE,
            -1e-45,
            -0.0,
            0.0,
            1e-45,
            f32::MIN_POSITIVE,
            2.5,
            f32::MAX,
            f32::INFINITY,
        ];
        let mut keys = [0i32; 12];
        assert!(!encode(&vals, &mut keys));
        assert!(keys.windows(2).all(|w| w[0] < w[1]));
        let mut back = [0f32; 12];
        decode(&keys, &mut back);
        assert!(vals
            .iter()
            .zip(&back)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(encode(&[f32::NAN], &mut [0]));
    }
}
