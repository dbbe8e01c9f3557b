//! The fuzzer's PRNG: xoshiro256**, seeded by splitmix64.

pub struct Rng {
    s: [u64; 4],
    /// Random bytes that fill() copies windows of (cheap even unoptimized).
    pool: Vec<u8>,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut s = [0u64; 4];
        for w in &mut s {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            *w = x ^ (x >> 31);
        }
        let mut r = Rng {
            s,
            pool: Vec::new(),
        };
        let mut pool = vec![0u8; 1 << 17];
        for c in pool.chunks_exact_mut(8) {
            c.copy_from_slice(&r.next().to_le_bytes());
        }
        r.pool = pool;
        r
    }
    pub fn next(&mut self) -> u64 {
        let s = &mut self.s;
        let r = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        r
    }
    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }
    pub fn range(&mut self, lo: u64, hi_incl: u64) -> u64 {
        lo + self.below(hi_incl - lo + 1)
    }
    /// True with probability num/den.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
    pub fn u32(&mut self) -> u32 {
        self.next() as u32
    }
    pub fn fill(&mut self, b: &mut [u8]) {
        if b.len() > 64 && b.len() <= self.pool.len() / 2 {
            // A random window of the pool, its first 16 bytes fresh.
            let at = self.below((self.pool.len() - b.len()) as u64) as usize;
            b.copy_from_slice(&self.pool[at..at + b.len()]);
            b[..8].copy_from_slice(&self.next().to_le_bytes());
            b[8..16].copy_from_slice(&self.next().to_le_bytes());
            return;
        }
        for c in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
    /// A "interesting" 32-bit value around `base`.
    pub fn near(&mut self, base: u32) -> u32 {
        match self.below(8) {
            0 => 0,
            1 => u32::MAX,
            2 => base.wrapping_add(1),
            3 => base.wrapping_sub(1),
            4 => base ^ (1 << self.below(32)),
            5 => base.wrapping_add(1 << 16),
            6 => base.swap_bytes(),
            _ => self.u32(),
        }
    }
}
