//! Runtime dispatch of the float codecs to the widest vector unit this CPU
//! has. Each codec is written once, as a plain branch-free loop that the
//! compiler vectorizes; [`dispatch!`] compiles that loop again for AVX-512
//! and for AVX2 and picks one per call (a relaxed atomic load), with the
//! portable build (baseline x86-64: SSE2) as the fallback. The library is
//! built for baseline x86-64 so that it loads on any node of a cluster.
//!
//! `ERAR_SIMD=portable|avx2|avx512` caps the level (never above what the CPU
//! has), so the fallback can be tested and measured on a machine that has
//! more.

use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// Instruction sets the codecs are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Portable = 1,
    Avx2 = 2,
    Avx512 = 3,
}

impl Level {
    pub const ALL: [Level; 3] = [Level::Portable, Level::Avx2, Level::Avx512];

    pub const fn name(self) -> &'static str {
        match self {
            Level::Portable => "portable",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    /// The best level this CPU runs.
    pub fn detected() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512dq")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                return Level::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Level::Avx2;
            }
        }
        Level::Portable
    }
}

/// 0: not decided yet; else a `Level as u8`.
static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The level the codecs run at: the CPU's best, capped by `ERAR_SIMD`.
#[inline]
pub fn level() -> Level {
    match LEVEL.load(Relaxed) {
        1 => Level::Portable,
        2 => Level::Avx2,
        3 => Level::Avx512,
        _ => {
            let cap = std::env::var("ERAR_SIMD")
                .ok()
                .and_then(|v| Level::ALL.into_iter().find(|l| l.name() == v.trim()));
            let level = cap.map_or(Level::detected(), |c| c.min(Level::detected()));
            LEVEL.store(level as u8, Relaxed);
            level
        }
    }
}

/// Orders the non-temporal stores this thread made before every store it
/// makes after (`sfence`): they bypass the cache, and would otherwise
/// reach memory after the barrier word that says they are there.
#[inline]
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE, which every x86-64 CPU has.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Runs `f` with the codecs capped at `level` (tests and benchmarks compare
/// the levels on one machine). The cap is global: callers take turns (the
/// tests run in parallel, and one that checks a level's own path, such as
/// the fused encode at AVX-512, failed now and then while another capped
/// the level), and calls outside it may run at `level` meanwhile.
pub fn with_level<T>(level: Level, f: impl FnOnce() -> T) -> T {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    /// Puts the level back, also when `f` panics.
    struct Restore(u8);
    impl Drop for Restore {
        fn drop(&mut self) {
            LEVEL.store(self.0, Relaxed);
        }
    }
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let level = level.min(Level::detected());
    let _restore = Restore(LEVEL.swap(level as u8, Relaxed));
    f()
}

/// `dispatch!(pub fn name(a: A, b: B) -> R = body);` defines `name`, which
/// runs `body` (an `#[inline(always)]` function with the same signature)
/// compiled for the best [`level`]. `dispatch!(avx2_at_most: …)` stops at
/// AVX2, for a scalar loop that the AVX-512 build only slows down.
macro_rules! dispatch {
    (avx2_at_most: $($item:tt)*) => {
        $crate::numerics::simd::dispatch!(@up_to Avx2: $($item)*);
    };
    (@up_to $max:ident: $(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi2")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,bmi2")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                use $crate::numerics::simd::{level, Level};
                match level().min(Level::$max) {
                    // SAFETY: `level()` never answers above what the CPU has.
                    Level::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    Level::Avx2 => return unsafe { avx2($($arg),*) },
                    Level::Portable => {}
                }
            }
            $body($($arg),*)
        }
    };
    ($($item:tt)*) => {
        $crate::numerics::simd::dispatch!(@up_to Avx512: $($item)*);
    };
}
pub(crate) use dispatch;

/// The f32 values in `bytes` (native endian) without a copy when the bytes
/// are 4-aligned, as every f32 array is; `None` otherwise.
#[inline]
pub fn as_f32(bytes: &[u8]) -> Option<&[f32]> {
    // SAFETY: every bit pattern is an f32.
    let (head, vals, tail) = unsafe { bytes.align_to::<f32>() };
    (head.is_empty() && tail.is_empty()).then_some(vals)
}

/// The same for writing.
#[inline]
pub fn as_f32_mut(bytes: &mut [u8]) -> Option<&mut [f32]> {
    // SAFETY: every bit pattern is an f32, and an f32 is plain bytes.
    let (head, vals, tail) = unsafe { bytes.align_to_mut::<f32>() };
    (head.is_empty() && tail.is_empty()).then_some(vals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_never_exceed_the_cpu() {
        let best = Level::detected();
        for l in Level::ALL {
            with_level(l, || assert!(level() <= best && level() <= l));
        }
    }

    #[test]
    fn aligned_views_only() {
        let v = [1.5f32, -2.0, 3.25];
        // SAFETY: reading the array's own bytes.
        let bytes = unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), 12) };
        assert_eq!(as_f32(bytes), Some(&v[..]));
        assert_eq!(as_f32(&bytes[1..9]), None);
        assert_eq!(as_f32(&bytes[..6]), None);
    }
}
