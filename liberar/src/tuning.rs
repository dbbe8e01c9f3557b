//! Which path a call takes once [`crate::select::decide`] found it eligible:
//! chosen by measurement, per communicator and per class of call (collective,
//! element type, float SUM or not, power-of-two size), never by a guess.
//!
//! The first [`TRIALS`] calls of a class are trials: three on MPI, then
//! three on the fast path, back to back as the program makes them, each
//! timed on every rank. The first of each run is not counted (it pays the
//! switch from the other path, and the fast path's first call may set up
//! the ring); each rank keeps its best of the other two. After the last
//! trial the ranks add up their best times per path (an MPI SUM the shim
//! runs, once per class: the mean over ranks, which is what OSU reports),
//! and from then on the class takes the path that was faster. No exchange
//! is added to a decided call. Every rank makes the same trials on the same
//! calls (collectives are called in the same order with the same sizes) and
//! decides from the same agreed numbers, so a rank whose own clock says
//! otherwise cannot route a call differently from the others.
//!
//! Back to back, not from a barrier: a call's time on a rank then includes
//! what the path makes it wait for the others, as in the program and in
//! OSU (MPI pipelines successive broadcasts; isolated by a barrier, MPI's
//! trials measured 2-3x slower than OSU's figure and lost where MPI wins).
//!
//! Pure: no MPI, no clock, no allocation after [`Tuner::new`]. The shim owns
//! one per communicator and drives it.

use crate::select::{CallShape, Collective, ElemType, ReduceOp};
use std::time::Duration;

/// The two ways to complete an eligible call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// The real MPI, through PMPI.
    Mpi,
    /// The in-kernel ring.
    Fast,
}

impl Path {
    pub const fn name(self) -> &'static str {
        match self {
            Path::Mpi => "mpi",
            Path::Fast => "fast",
        }
    }
}

/// Trial calls per class: three on MPI, then three on the fast path, the
/// first of each not counted. No more, because a trial of the losing path
/// costs what losing costs (up to 4x a call where the fast path is slow);
/// six calls fit in OSU's default warm-up of 10 for large messages.
pub const TRIALS: u8 = 6;
const PER_PATH: u8 = TRIALS / 2;

/// What to do with the next call of a class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Time this call on this path and report it with [`Tuner::sample`].
    Trial(Path),
    /// The class is decided.
    Use(Path),
}

const SIZE_BUCKETS: usize = 48;
/// Broadcast; then per float type SUM (encoded on the host) apart from its
/// other ops (mapped to integers); then one per integer type.
const KINDS: usize = 9;
const KIND_NAMES: [&str; KINDS] = [
    "bcast",
    "allreduce.f32",
    "allreduce.f32.sum",
    "allreduce.f64",
    "allreduce.f64.sum",
    "allreduce.i32",
    "allreduce.u32",
    "allreduce.i64",
    "allreduce.u64",
];

/// A class of calls that share a decision. Only [`Class::of`] makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Class(u16);

impl Class {
    /// The class of an eligible call (`None` for an allreduce without a known
    /// type and op, which is never eligible). Depends only on what every rank
    /// passes alike: the collective, the type, the op and the size in bytes.
    pub fn of(call: &CallShape) -> Option<Class> {
        let kind = match call.collective {
            Collective::Bcast => 0,
            Collective::Allreduce => {
                let sum = call.op? == ReduceOp::Sum;
                match call.elem? {
                    ElemType::F32 => 1 + usize::from(sum),
                    ElemType::F64 => 3 + usize::from(sum),
                    ElemType::I32 => 5,
                    ElemType::U32 => 6,
                    ElemType::I64 => 7,
                    ElemType::U64 => 8,
                }
            }
        };
        let bucket = (call.bytes.max(1).ilog2() as usize).min(SIZE_BUCKETS - 1);
        Some(Class((kind * SIZE_BUCKETS + bucket) as u16))
    }

    /// Smallest size in bytes of this class (a power of two).
    pub fn min_bytes(self) -> usize {
        1 << (self.0 as usize % SIZE_BUCKETS)
    }

    /// `allreduce.f32.sum`, `allreduce.i32`, `bcast`: for logs and stats.
    pub fn kind_name(self) -> &'static str {
        KIND_NAMES[self.0 as usize / SIZE_BUCKETS]
    }
}

#[derive(Clone, Copy, Debug)]
struct State {
    trials: u8,
    /// Best counted trial time of each path on this rank, µs (index:
    /// `Path as usize`).
    best_us: [i64; 2],
    chosen: Option<Path>,
    /// The agreed times the decision was made from (sums over ranks).
    agreed_us: [i64; 2],
}

const UNSEEN: State = State {
    trials: 0,
    best_us: [i64::MAX; 2],
    chosen: None,
    agreed_us: [0; 2],
};

/// One communicator's decisions.
pub struct Tuner {
    classes: Box<[State]>,
}

impl Default for Tuner {
    fn default() -> Self {
        Self::new()
    }
}

impl Tuner {
    pub fn new() -> Tuner {
        Tuner {
            classes: vec![UNSEEN; KINDS * SIZE_BUCKETS].into_boxed_slice(),
        }
    }

    pub fn plan(&self, class: Class) -> Plan {
        let s = &self.classes[class.0 as usize];
        match s.chosen {
            Some(path) => Plan::Use(path),
            None if s.trials < PER_PATH => Plan::Trial(Path::Mpi),
            None => Plan::Trial(Path::Fast),
        }
    }

    /// Records how long this rank's trial on `path` (the one [`Tuner::plan`]
    /// said) took. After the class's last trial, returns this rank's best
    /// time of each path in µs, indexed by `Path as usize`: the caller adds
    /// it up over all ranks and hands the sums to [`Tuner::settle`].
    pub fn sample(&mut self, class: Class, path: Path, took: Duration) -> Option<[i64; 2]> {
        let s = &mut self.classes[class.0 as usize];
        debug_assert_eq!(path == Path::Fast, s.trials >= PER_PATH);
        if !s.trials.is_multiple_of(PER_PATH) {
            let us = i64::try_from(took.as_micros()).unwrap_or(i64::MAX);
            s.best_us[path as usize] = s.best_us[path as usize].min(us);
        }
        s.trials += 1;
        // Bounded, so that a sum over any number of ranks cannot wrap.
        (s.trials >= TRIALS).then_some(s.best_us.map(|t| t.min(i64::from(u32::MAX))))
    }

    /// Decides the class from the agreed times (each path's best times
    /// summed over ranks) and returns the winner: the fast path only if it
    /// was faster.
    pub fn settle(&mut self, class: Class, agreed_us: [i64; 2]) -> Path {
        let path = winner(agreed_us);
        let s = &mut self.classes[class.0 as usize];
        s.chosen = Some(path);
        s.agreed_us = agreed_us;
        path
    }

    /// For a class settled on the fast path: MPI's time for one of its
    /// calls as the trials measured it (the mean over `ranks` ranks of
    /// each rank's best), in µs; what a fast call of the class is compared
    /// with in the `ERAR_STATS` summary.
    pub fn mpi_estimate_us(&self, class: Class, ranks: usize) -> Option<i64> {
        let s = &self.classes[class.0 as usize];
        (s.chosen == Some(Path::Fast))
            .then(|| s.agreed_us[Path::Mpi as usize] / ranks.max(1) as i64)
    }
}

/// The faster path by the agreed times; MPI on a tie.
pub fn winner(agreed_us: [i64; 2]) -> Path {
    if agreed_us[Path::Fast as usize] < agreed_us[Path::Mpi as usize] {
        Path::Fast
    } else {
        Path::Mpi
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(collective: Collective, elem: ElemType, op: ReduceOp, bytes: usize) -> CallShape {
        CallShape {
            collective,
            elem: Some(elem),
            op: Some(op),
            contiguous: true,
            count: (bytes / elem.size()) as i64,
            bytes,
            in_place: false,
            comm_size: 4,
            inter_comm: false,
            thread_multiple: false,
        }
    }

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    /// Runs a class through its trials with these local times (µs) per
    /// trial call and returns this rank's bests.
    fn trials(t: &mut Tuner, c: Class, local: [u64; TRIALS as usize]) -> [i64; 2] {
        let mut out = None;
        for took in local {
            let Plan::Trial(path) = t.plan(c) else {
                panic!("a trial was expected")
            };
            assert!(out.is_none(), "bests reported before the last trial");
            out = t.sample(c, path, us(took));
        }
        out.expect("the last trial reports the bests")
    }

    #[test]
    fn three_on_mpi_then_three_fast_then_the_faster_path() {
        let mut t = Tuner::new();
        let c = Class::of(&call(
            Collective::Allreduce,
            ElemType::I32,
            ReduceOp::Sum,
            4 << 20,
        ))
        .unwrap();
        let mut seen = Vec::new();
        // The first of each run does not count: MPI's 1 µs, the fast
        // path's 50 ms ring setup.
        for took in [1, 9000, 8000, 50_000, 3000, 3500] {
            let Plan::Trial(path) = t.plan(c) else {
                panic!("trials first")
            };
            seen.push(path);
            let bests = t.sample(c, path, us(took));
            if seen.len() < TRIALS as usize {
                assert_eq!(bests, None);
            } else {
                assert_eq!(bests, Some([8000, 3000]));
            }
        }
        use Path::{Fast, Mpi};
        assert_eq!(seen, [Mpi, Mpi, Mpi, Fast, Fast, Fast]);
        assert_eq!(t.settle(c, [4 * 8000, 4 * 3000]), Path::Fast);
        assert_eq!(t.plan(c), Plan::Use(Path::Fast));
    }

    #[test]
    fn the_decision_follows_the_agreed_times_not_the_local_ones() {
        // This rank measured the fast path faster; the sum over ranks did not.
        let mut t = Tuner::new();
        let c = Class::of(&call(
            Collective::Bcast,
            ElemType::I32,
            ReduceOp::Sum,
            1 << 20,
        ))
        .unwrap();
        let local = trials(&mut t, c, [900, 900, 900, 300, 300, 300]);
        assert!(winner(local) == Path::Fast);
        assert_eq!(t.settle(c, [3600, 5000]), Path::Mpi);
        assert_eq!(t.plan(c), Plan::Use(Path::Mpi));
        // And the other way round.
        let c2 = Class::of(&call(
            Collective::Bcast,
            ElemType::I32,
            ReduceOp::Sum,
            2 << 20,
        ))
        .unwrap();
        let local = trials(&mut t, c2, [300, 300, 300, 900, 900, 900]);
        assert!(winner(local) == Path::Mpi);
        assert_eq!(t.settle(c2, [6000, 4000]), Path::Fast);
        assert_eq!(t.plan(c2), Plan::Use(Path::Fast));
    }

    #[test]
    fn a_tie_keeps_mpi() {
        assert_eq!(winner([500, 500]), Path::Mpi);
        assert_eq!(winner([500, 499]), Path::Fast);
        assert_eq!(winner([i64::MAX, i64::MAX]), Path::Mpi);
    }

    #[test]
    fn classes_are_decided_independently() {
        let mut t = Tuner::new();
        let a = Class::of(&call(
            Collective::Allreduce,
            ElemType::I32,
            ReduceOp::Sum,
            1 << 20,
        ))
        .unwrap();
        trials(&mut t, a, [1, 1, 1, 2, 2, 2]);
        t.settle(a, [1, 2]);
        for other in [
            // Same size, other type; float SUM apart from float MAX; next size up.
            call(Collective::Allreduce, ElemType::U32, ReduceOp::Sum, 1 << 20),
            call(Collective::Allreduce, ElemType::F32, ReduceOp::Sum, 1 << 20),
            call(Collective::Allreduce, ElemType::F32, ReduceOp::Max, 1 << 20),
            call(Collective::Allreduce, ElemType::I32, ReduceOp::Sum, 2 << 20),
            call(Collective::Bcast, ElemType::I32, ReduceOp::Sum, 1 << 20),
        ] {
            let c = Class::of(&other).unwrap();
            assert_ne!(c, a);
            assert_eq!(t.plan(c), Plan::Trial(Path::Mpi), "{other:?}");
        }
    }

    #[test]
    fn sizes_share_a_class_within_a_power_of_two() {
        let at = |bytes| {
            Class::of(&call(
                Collective::Allreduce,
                ElemType::F32,
                ReduceOp::Sum,
                bytes,
            ))
            .unwrap()
        };
        assert_eq!(at(1 << 20), at((2 << 20) - 4));
        assert_ne!(at(1 << 20), at(2 << 20));
        assert_eq!(at(3 << 20).min_bytes(), 2 << 20);
        assert_eq!(at(1 << 20).kind_name(), "allreduce.f32.sum");
        // Larger than any bucket: the last one.
        assert_eq!(at(usize::MAX).min_bytes(), 1 << (SIZE_BUCKETS - 1));
        // Bcast ignores type and op: only the bytes matter.
        let b = |e, op| Class::of(&call(Collective::Bcast, e, op, 1 << 20)).unwrap();
        assert_eq!(
            b(ElemType::I32, ReduceOp::Sum),
            b(ElemType::F64, ReduceOp::Max)
        );
        assert_eq!(b(ElemType::I32, ReduceOp::Sum).kind_name(), "bcast");
    }

    #[test]
    fn every_kind_has_its_own_name() {
        let mut names = std::collections::HashSet::new();
        for e in ElemType::ALL {
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                names.insert(
                    Class::of(&call(Collective::Allreduce, e, op, 64))
                        .unwrap()
                        .kind_name(),
                );
            }
        }
        // Float SUM apart from float MAX; integer ops share one class.
        assert_eq!(names.len(), 8);
    }
}
