//! Paired calls: an A/B measurement of a change to the ring inside one job
//! (cargo feature `paired`, built only for such experiments).
//!
//! On the test machine, whole jobs of the same build differ by 20-30% (the
//! two vCPUs share a last-level cache or not, and that flips within
//! seconds), so builds compared in rotating jobs cannot tell a 5% change
//! from noise (docs/benchmarks.md, "Session 42"). Here one build carries
//! both sides: every fast-path call of a ring is drawn into half A or half
//! B by a hash of the ring's operation sequence number at its start (the
//! same on every rank of the ring, whatever other communicators do), the
//! code under test asks [`in_b`] where it differs, and each half's call
//! times are summed per size. The two halves see the same machine state,
//! call after call, and at `MPI_Finalize` each rank prints its per-size
//! means and their ratio A/B (above 1: B is faster). A build with no site
//! asking [`in_b`] is an A/A run, which calibrates the method.
//!
//! Only for jobs that repeat calls (OSU, a training loop): each size's
//! first [`WARMUP_CALLS`] calls are left out (setup, the routing's trials,
//! the tuner's exploration). Call times are the ring's, from the shim's
//! call into it to its return, so the choice of MPI or the ring is not
//! measured.
//!
//! ```text
//! cargo build --release -p pmpi-shim --features paired
//! erarctl run --hosts 4 --preload target/release/libliberar_shim.so -- osu_allreduce ...
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Calls of each size left out before timing starts.
pub const WARMUP_CALLS: u64 = 24;

/// Size classes: calls of `2^(k-1) .. 2^k - 1` bytes share class k.
const CLASSES: usize = 40;

/// Whether the call under way is in half B (see [`in_b`]).
static IN_B: AtomicBool = AtomicBool::new(false);

/// Per class: calls seen, then per half the calls timed and their nanoseconds.
struct Class {
    seen: AtomicU64,
    calls: [AtomicU64; 2],
    ns: [AtomicU64; 2],
}

static CLASS: [Class; CLASSES] = [const {
    Class {
        seen: AtomicU64::new(0),
        calls: [const { AtomicU64::new(0) }; 2],
        ns: [const { AtomicU64::new(0) }; 2],
    }
}; CLASSES];

/// Whether the ring's call under way belongs to half B: the code under
/// test takes its variant where this is true. False outside calls.
#[inline]
pub fn in_b() -> bool {
    IN_B.load(Relaxed)
}

/// Half B for the operation sequence numbers whose hash (splitmix64's
/// finalizer) is odd: about half of them, in no pattern that the ring's
/// own alternations (two slots by seq parity, the tuner's periods) share.
pub fn draws_b(seq: u32) -> bool {
    let mut z = u64::from(seq).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)) & 1 == 1
}

/// One ring call being timed: made by [`Call::begin`] before the call's
/// first operation, recorded when dropped.
pub struct Call {
    started: Instant,
    class: usize,
    b: bool,
}

impl Call {
    /// Starts timing a `bytes`-byte call whose first operation is `seq`.
    pub fn begin(seq: u32, bytes: usize) -> Call {
        let b = draws_b(seq);
        IN_B.store(b, Relaxed);
        Call {
            started: Instant::now(),
            class: (usize::BITS - bytes.leading_zeros()) as usize,
            b,
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        let ns = self.started.elapsed().as_nanos() as u64;
        IN_B.store(false, Relaxed);
        let Some(c) = CLASS.get(self.class) else {
            return;
        };
        if c.seen.fetch_add(1, Relaxed) < WARMUP_CALLS {
            return;
        }
        let half = usize::from(self.b);
        c.calls[half].fetch_add(1, Relaxed);
        c.ns[half].fetch_add(ns, Relaxed);
    }
}

/// This rank's line: per size class with calls in both halves, the
/// class's lower bound in bytes, each half's mean µs and calls, and A/B.
/// `None` if no class has both.
pub fn report(rank: i32) -> Option<String> {
    let mut line = format!("liberar: paired rank={rank}");
    let mut any = false;
    for (k, c) in CLASS.iter().enumerate().skip(1) {
        let calls = [c.calls[0].load(Relaxed), c.calls[1].load(Relaxed)];
        if calls.contains(&0) {
            continue;
        }
        let mean = |h: usize| c.ns[h].load(Relaxed) as f64 / calls[h] as f64 / 1e3;
        let (a, b) = (mean(0), mean(1));
        line += &format!(
            " {}:A={a:.0}us/{}:B={b:.0}us/{}:A/B={:.3}",
            1u64 << (k - 1),
            calls[0],
            calls[1],
            a / b
        );
        any = true;
    }
    any.then_some(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn about_half_of_the_calls_draw_b_in_no_parity_pattern() {
        let b: Vec<bool> = (0..4000u32).map(draws_b).collect();
        let share = |it: &mut dyn Iterator<Item = &bool>| {
            let v: Vec<bool> = it.copied().collect();
            v.iter().filter(|&&x| x).count() as f64 / v.len() as f64
        };
        let all = share(&mut b.iter());
        let even = share(&mut b.iter().step_by(2));
        let odd = share(&mut b.iter().skip(1).step_by(2));
        for s in [all, even, odd] {
            assert!((0.45..0.55).contains(&s), "share of B {s}");
        }
    }

    #[test]
    fn calls_are_timed_per_half_after_the_warmup() {
        // A class no other test uses: 2^30 .. 2^31 - 1 bytes.
        let bytes = 1usize << 30;
        let k = (usize::BITS - bytes.leading_zeros()) as usize;
        let a_seq = (0..).find(|&s| !draws_b(s)).unwrap();
        let b_seq = (0..).find(|&s| draws_b(s)).unwrap();
        for _ in 0..WARMUP_CALLS {
            drop(Call::begin(a_seq, bytes));
        }
        let before = report(0).unwrap_or_default();
        assert!(!before.contains(" 1073741824:"), "{before}");
        for _ in 0..3 {
            let call = Call::begin(b_seq, bytes);
            assert!(in_b(), "inside a B call");
            drop(call);
            assert!(!in_b(), "outside calls");
            drop(Call::begin(a_seq, bytes));
        }
        let c = &CLASS[k];
        assert_eq!(c.calls[0].load(Relaxed), 3);
        assert_eq!(c.calls[1].load(Relaxed), 3);
        let line = report(5).unwrap();
        assert!(line.starts_with("liberar: paired rank=5"), "{line}");
        assert!(line.contains(" 1073741824:A="), "{line}");
        assert!(line.contains("us/3:A/B="), "{line}");
    }
}
