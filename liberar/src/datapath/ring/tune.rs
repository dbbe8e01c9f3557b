//! Whether a large exact allreduce runs as one operation or in cache-sized
//! segments: learned from the calls themselves, the same on every rank,
//! with no exchange.
//!
//! Segments keep a call's slots in the last-level cache (four hosts' 1 MiB
//! segments are 4 MiB where a 16 MiB call's slots are 64 MiB), which pays
//! where the rank's CPU and the CPU that runs the ring's softirqs share
//! that cache, and costs where they do not: the chains then read each
//! segment from the other CPU's cache (docs/benchmarks.md, "Session 31").
//! Which of the two holds is a property of the machine (IRQ affinity on a
//! cluster; on the test VM it changes every few seconds), so neither mode
//! can be the default; the calls themselves tell which is faster.
//!
//! The choice must be the same on every rank: ranks that segment a call
//! differently would arm different operations (their barrier keys say
//! the segment length, so that fails the call; it never mixes data). So
//! the learner is replicated, fed only figures every rank reads alike:
//! each call carries, in the padding of its last chunk, this rank's time
//! a MiB of the previous call of its size class, and the ring reduces that
//! word with the call's own op (SUM, MAX or MIN of non-negative numbers),
//! so every rank reads the same sum (divided by the ranks), maximum or
//! minimum. Only those agreed figures and the modes they chose decide
//! (a rank's own figure goes only into the word it carries), so every
//! rank's [`Tuner`] makes the same choices.

use crate::select::ReduceOp;

/// Calls from this many bytes on are tuned. From 2 MiB rather than 4:
/// `osu_allreduce -T mpi_int -i 100` at 2 MiB, 10 rotating rounds, best /
/// median 1.05/1.09x and 1.07/1.10x in two runs (session 33). From 1 MiB,
/// in 512 KiB segments, 1 MiB calls lost (0.91x median, 6 jobs each).
pub(super) const TUNED_MIN: usize = 2 << 20;

/// The segment of the segmented mode. Session 31 (`ERAR_SEGMENT_BYTES`,
/// `osu_allreduce -T mpi_int`, 4-64 MiB, 4 hosts): 1 MiB gave 1.21-1.41x
/// best while the vCPUs shared their cache, 512 KiB 1.02-1.28x, 2 MiB
/// 0.80-0.90x median.
pub(super) const TUNED_SEGMENT: usize = 1 << 20;

/// Every so many calls of a size class, one try runs the mode that was
/// not the faster, so that a change of the machine's placement that makes
/// it the faster is noticed (one that makes the running mode slower shows
/// in its own figures). The period starts at `EXPLORE_FIRST` and doubles,
/// up to `EXPLORE_MOST`, each time a try confirms the choice. A try of
/// segments where they lose costs about 1.3x a call (16 MiB: 22.9-24.5
/// against 17.4-18.6 ms, session 31), so tries of [`TRY_CALLS`] calls
/// every 34 cost about 2%. Chosen, not tuned: one-call tries from the
/// same periods, each mode's figure its last alone, measured within the
/// noise of these (session 33).
const EXPLORE_FIRST: u32 = 8;
const EXPLORE_MOST: u32 = 32;

/// Size classes: powers of two from `TUNED_MIN` on (the last holds the rest).
const CLASSES: usize = 12;

/// How one call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Segments of a slot (the most the ring's operation holds).
    Whole,
    /// Segments of about [`TUNED_SEGMENT`].
    Segmented,
}

impl Mode {
    fn other(self) -> Mode {
        match self {
            Mode::Whole => Mode::Segmented,
            Mode::Segmented => Mode::Whole,
        }
    }
}

/// A try runs the slower mode this many calls in a row, and a mode's
/// figure is the lower of its last two in a row: a call's time varies by
/// up to 20-30% (a rank descheduled, the other CPU's softirqs), mostly
/// upwards, where the two modes differ by 10-30%.
const TRY_CALLS: u32 = 2;

/// One size class's state: identical on every rank, but for the figure
/// in `pending`, which only goes into the word the next call carries.
#[derive(Clone, Copy, Debug)]
struct Class {
    /// Each mode's last agreed µs a MiB, newest first, of its last run
    /// of calls in a row.
    figures: [[Option<u32>; 2]; 2],
    /// The mode of the last agreed figure.
    last_figure: Option<Mode>,
    /// The next call's mode, and whether it tries the slower one.
    next: (Mode, bool),
    /// Calls until the next try, the period it was set from, and the
    /// calls left of the try under way.
    countdown: u32,
    period: u32,
    trying: u32,
    /// The last call: its mode, whether it was a try, and this rank's µs
    /// a MiB in it (carried by the next call of the class).
    pending: Option<(Mode, bool, u32)>,
}

impl Default for Class {
    fn default() -> Self {
        Class {
            figures: [[None; 2]; 2],
            last_figure: None,
            next: (Mode::Whole, false),
            // The second call tries segments.
            countdown: 1,
            period: EXPLORE_FIRST,
            trying: 0,
            pending: None,
        }
    }
}

impl Class {
    /// A mode's figure: the lower of its last two in a row.
    fn figure(&self, mode: Mode) -> Option<u32> {
        self.figures[mode as usize].into_iter().flatten().min()
    }

    /// The mode with the lower figure; of one measured mode, that one
    /// (the other is tried first); of none, `Whole`.
    fn faster(&self) -> Mode {
        match (self.figure(Mode::Whole), self.figure(Mode::Segmented)) {
            (Some(whole), Some(segmented)) if segmented < whole => Mode::Segmented,
            (None, Some(_)) => Mode::Segmented,
            _ => Mode::Whole,
        }
    }

    /// Takes the agreed figure of a call in `mode` (`tried`: a try).
    fn agreed(&mut self, mode: Mode, tried: bool, figure: u32) {
        let f = &mut self.figures[mode as usize];
        *f = if self.last_figure == Some(mode) {
            [Some(figure), f[0]]
        } else {
            [Some(figure), None]
        };
        self.last_figure = Some(mode);
        if tried && f[1].is_some() {
            // A whole try: it won, so look again soon, or it confirmed
            // the choice, so look less often.
            self.period = if self.faster() == mode {
                EXPLORE_FIRST
            } else {
                (self.period * 2).min(EXPLORE_MOST)
            };
        }
    }

    /// The mode of the call after the one that just ran.
    fn choose(&mut self) -> (Mode, bool) {
        if self.trying > 0 {
            self.trying -= 1;
            (self.next.0, true)
        } else if self.countdown == 0 {
            self.countdown = self.period;
            self.trying = TRY_CALLS - 1;
            (self.faster().other(), true)
        } else {
            self.countdown -= 1;
            (self.faster(), false)
        }
    }
}

/// The replicated learner of one ring (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Tuner {
    classes: [Class; CLASSES],
}

/// A tuned call: its class, the mode it runs (and whether that is a try
/// of the slower one), and the figure it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Tuned {
    class: usize,
    pub(super) mode: Mode,
    tried: bool,
    pub(super) carry: Option<u32>,
}

impl Tuner {
    /// How a `bytes`-byte call with `op` runs: `None` if it is not tuned
    /// (too small, or an op that does not reduce times to a time).
    pub(super) fn call(&self, bytes: usize, op: ReduceOp) -> Option<Tuned> {
        if bytes < TUNED_MIN || !matches!(op, ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min) {
            return None;
        }
        let class = ((bytes / TUNED_MIN).ilog2() as usize).min(CLASSES - 1);
        let c = &self.classes[class];
        Some(Tuned {
            class,
            mode: c.next.0,
            tried: c.next.1,
            carry: c.pending.map(|(_, _, us)| us),
        })
    }

    /// After call `t` of `bytes` bytes took `elapsed` on this rank:
    /// `reduced` is its carried word as the ring reduced it with `op` over
    /// `ranks` ranks (`None` if it carried none, the same on every rank).
    pub(super) fn ran(
        &mut self,
        t: Tuned,
        (bytes, elapsed): (usize, std::time::Duration),
        (reduced, op, ranks): (Option<u64>, ReduceOp, usize),
    ) {
        let c = &mut self.classes[t.class];
        if let (Some((mode, tried, _)), Some(word)) = (c.pending, reduced) {
            let agreed = match op {
                ReduceOp::Sum => word / ranks.max(1) as u64,
                _ => word,
            };
            c.agreed(mode, tried, agreed.min(u64::from(u32::MAX)) as u32);
        }
        // At most what keeps a sum of every rank's below 2^32 (and one
        // below 2^31, for a signed MAX or MIN).
        let most = u64::from(u32::MAX) / ranks.max(2) as u64;
        let us_per_mib = (elapsed.as_micros() as u64 * (1 << 20) / bytes.max(1) as u64).min(most);
        c.pending = Some((t.mode, t.tried, us_per_mib as u32));
        c.next = c.choose();
    }
}

/// Where the carried word goes in a slot whose call data is `len` bytes
/// and whose chunks hold `room`: the first 8-byte boundary after the data,
/// if the last chunk has room there (the ring reduces every byte of a
/// chunk; the caller's buffer gets `len` of them). `None`: no room, the
/// same on every rank.
pub(super) fn carry_at(len: usize, room: usize) -> Option<usize> {
    let at = len.next_multiple_of(8);
    (at + 8 <= room).then_some(at)
}

/// Writes `word` at `at` as one element of `size` bytes (4 or 8; a 4-byte
/// element's neighbour zero), the call's own type, for its op to reduce.
pub(super) fn put_carried(slot: &mut [u8], at: usize, size: usize, word: u32) {
    if size == 4 {
        slot[at..at + 4].copy_from_slice(&word.to_ne_bytes());
        slot[at + 4..at + 8].fill(0);
    } else {
        slot[at..at + 8].copy_from_slice(&u64::from(word).to_ne_bytes());
    }
}

/// The word at `at` once the ring reduced it (see [`put_carried`]).
pub(super) fn carried(slot: &[u8], at: usize, size: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&slot[at..at + 8]);
    if size == 4 {
        u64::from(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    } else {
        u64::from_ne_bytes(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const MIB: usize = 1 << 20;

    /// One call of `bytes` on every rank of `tuners`, rank r taking
    /// `times(mode)[r]` µs; returns the mode they all ran.
    fn call_all(
        tuners: &mut [Tuner],
        bytes: usize,
        op: ReduceOp,
        times: &dyn Fn(Mode) -> Vec<u64>,
    ) -> Mode {
        let calls: Vec<Tuned> = tuners.iter().map(|t| t.call(bytes, op).unwrap()).collect();
        let mode = calls[0].mode;
        assert!(calls
            .iter()
            .all(|c| c.mode == mode && c.class == calls[0].class));
        // The ring's reduction of the carried words, with the call's op.
        let carried: Vec<u64> = calls
            .iter()
            .filter_map(|c| c.carry.map(u64::from))
            .collect();
        assert!(
            carried.is_empty() || carried.len() == calls.len(),
            "some ranks carried none"
        );
        let reduced = (!carried.is_empty()).then(|| match op {
            ReduceOp::Sum => carried.iter().sum(),
            ReduceOp::Max => *carried.iter().max().unwrap(),
            _ => *carried.iter().min().unwrap(),
        });
        let n = tuners.len();
        let us = times(mode);
        for ((t, c), us) in tuners.iter_mut().zip(calls).zip(us) {
            t.ran(c, (bytes, Duration::from_micros(us)), (reduced, op, n));
        }
        mode
    }

    #[test]
    fn small_calls_and_bitwise_ops_are_not_tuned() {
        let t = Tuner::default();
        assert_eq!(t.call(TUNED_MIN - 1, ReduceOp::Sum), None);
        assert_eq!(t.call(64 * MIB, ReduceOp::Band), None);
        assert_eq!(t.call(64 * MIB, ReduceOp::Bxor), None);
        let first = t.call(TUNED_MIN, ReduceOp::Max).unwrap();
        assert_eq!((first.mode, first.carry), (Mode::Whole, None));
    }

    #[test]
    fn ranks_settle_on_the_faster_mode_and_keep_trying_the_other() {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            for segmented_faster in [true, false] {
                let mut tuners: Vec<Tuner> = (0..4).map(|_| Tuner::default()).collect();
                // Ranks disagree on times (one is 30% off), as real ones do.
                let times = |m: Mode| {
                    let base = if (m == Mode::Segmented) == segmented_faster {
                        12_000
                    } else {
                        16_000
                    };
                    vec![base, base + 300, base * 13 / 10, base - 200]
                };
                let modes: Vec<Mode> = (0..200)
                    .map(|_| call_all(&mut tuners, 16 * MIB, op, &times))
                    .collect();
                assert!(
                    modes[..4].contains(&Mode::Segmented),
                    "{op:?}: never tried segments"
                );
                let faster = if segmented_faster {
                    Mode::Segmented
                } else {
                    Mode::Whole
                };
                let late = &modes[100..];
                let tried = late.iter().filter(|&&m| m != faster).count();
                // Tries back off to one every EXPLORE_MOST calls, and go on.
                let (try_calls, period) = (TRY_CALLS as usize, EXPLORE_MOST as usize);
                assert!(
                    tried >= try_calls * (late.len() / (period + try_calls + 1))
                        && tried <= try_calls * (late.len() / period + 1),
                    "{op:?}: {tried} calls tried in {modes:?}"
                );
            }
        }
    }

    #[test]
    fn a_change_of_placement_is_followed_both_ways() {
        let mut tuners: Vec<Tuner> = (0..4).map(|_| Tuner::default()).collect();
        let seg_fast = |m: Mode| vec![if m == Mode::Segmented { 10_000 } else { 15_000 }; 4];
        let seg_slow = |m: Mode| vec![if m == Mode::Segmented { 25_000 } else { 15_000 }; 4];
        let mut run = |times: &dyn Fn(Mode) -> Vec<u64>| -> Vec<Mode> {
            (0..100)
                .map(|_| call_all(&mut tuners, 8 * MIB, ReduceOp::Sum, times))
                .collect()
        };
        let count = |modes: &[Mode], m: Mode| modes.iter().filter(|&&x| x == m).count();
        // Segments slow down while they run: seen in their own figures,
        // a call and the carried figure's lag later.
        let try_calls = TRY_CALLS as usize;
        let fast = run(&seg_fast);
        assert!(count(&fast[50..], Mode::Whole) <= 2 * try_calls, "{fast:?}");
        // Two figures in a row, the last a call late.
        let slow = run(&seg_slow);
        assert!(
            count(&slow[4..], Mode::Segmented) <= 3 * try_calls,
            "{slow:?}"
        );
        // Segments speed up while they do not run: seen at the next try,
        // at most EXPLORE_MOST calls and the lag later.
        let again = run(&seg_fast);
        let late = EXPLORE_MOST as usize + try_calls + 3;
        assert!(
            count(&again[late..], Mode::Whole) <= 3 * try_calls,
            "{again:?}"
        );
    }

    #[test]
    fn size_classes_learn_apart_and_carried_figures_fit_a_sum() {
        let mut t = Tuner::default();
        let a = t.call(4 * MIB, ReduceOp::Sum).unwrap();
        let b = t.call(64 * MIB, ReduceOp::Sum).unwrap();
        assert_ne!(a.class, b.class);
        t.ran(
            a,
            (4 * MIB, Duration::from_secs(3600)),
            (None, ReduceOp::Sum, 256),
        );
        let again = t.call(4 * MIB, ReduceOp::Sum).unwrap();
        let carried = u64::from(again.carry.unwrap());
        assert!(carried * 256 <= u64::from(u32::MAX), "{carried}");
        assert_eq!(t.call(64 * MIB, ReduceOp::Sum).unwrap().carry, None);
    }
}
