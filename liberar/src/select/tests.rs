//! Unit tests of [`super`]: every [`Reason`] [`decide`] gives, the route of an
//! eligible call (threshold and measured), and the tuner's trials and
//! decisions.

use super::*;

/// [`decide`] on a communicator whose tuner has seen no call yet.
fn route(call: &CallShape, cfg: &Config, ready: bool) -> Route {
    let tuner = Tuner::new();
    let never: Result<Route, ()> = decide(call, cfg, ready, || Ok(Some(&tuner)));
    never.expect("the communicator lookup does not fail here")
}

/// The route of an eligible call on a fresh communicator routed by
/// measurement: its class's first trial, on MPI.
fn first_trial(c: &CallShape) -> Route {
    Route::MpiTrial(Class::of(c).expect("an eligible call has a class"))
}

fn big_f32_sum() -> CallShape {
    CallShape {
        collective: Collective::Allreduce,
        elem: Some(ElemType::F32),
        op: Some(ReduceOp::Sum),
        contiguous: true,
        count: 1 << 20,
        bytes: 4 << 20,
        comm_size: 4,
        inter_comm: false,
    }
}

#[test]
fn large_float_sum_is_fast_when_ready() {
    let cfg = Config::default();
    let c = big_f32_sum();
    assert_eq!(route(&c, &cfg, true), first_trial(&c));
}

#[test]
fn reasons_are_specific() {
    let cfg = Config::default();
    type Change = fn(&mut CallShape);
    let cases: [(Change, Reason); 7] = [
        (|c| c.count = -1, Reason::InvalidArgs),
        (|c| c.op = None, Reason::UnsupportedOp),
        (|c| c.op = Some(ReduceOp::Prod), Reason::UnsupportedOp),
        (|c| c.elem = None, Reason::UnsupportedType),
        (|c| (c.bytes, c.count) = (16, 4), Reason::BelowThreshold),
        (|c| c.comm_size = 1, Reason::Trivial),
        (|c| c.inter_comm = true, Reason::InterComm),
    ];
    for (change, reason) in cases {
        let mut c = big_f32_sum();
        change(&mut c);
        assert_eq!(route(&c, &cfg, true), Route::Pmpi(reason), "{c:?}");
    }
    let disabled = Config {
        disabled: true,
        ..Config::default()
    };
    let settings = [
        (&disabled, true, Reason::Disabled),
        (&cfg, false, Reason::DatapathUnavailable),
    ];
    for (cfg, ready, reason) in settings {
        assert_eq!(route(&big_f32_sum(), cfg, ready), Route::Pmpi(reason));
    }
}

#[test]
fn allreduces_start_trials_at_64_kib() {
    let cfg = Config::default();
    let mut c = big_f32_sum();
    for (elem, op) in [
        (ElemType::F32, ReduceOp::Sum),
        (ElemType::I32, ReduceOp::Sum),
    ] {
        (c.elem, c.op) = (Some(elem), Some(op));
        c.bytes = 64 * 1024;
        c.count = (c.bytes / 4) as i64;
        assert_eq!(route(&c, &cfg, true), first_trial(&c));
        c.bytes -= 4;
        c.count -= 1;
        assert_eq!(route(&c, &cfg, true), Route::Pmpi(Reason::BelowThreshold));
    }
}

#[test]
fn float_sum_has_its_own_floor() {
    // As threshold routing sets it when no floor is named.
    let cfg = Config {
        float_sum_min_bytes: 512 * 1024,
        ..Config::default()
    };
    assert!(cfg.float_sum_min_bytes > cfg.allreduce_min_bytes);
    let mut c = big_f32_sum();
    c.bytes = cfg.allreduce_min_bytes;
    c.count = (c.bytes / 4) as i64;
    assert_eq!(route(&c, &cfg, true), Route::Pmpi(Reason::BelowThreshold));
    c.op = Some(ReduceOp::Max);
    assert_eq!(route(&c, &cfg, true), first_trial(&c));
    c.op = Some(ReduceOp::Sum);
    c.elem = Some(ElemType::I32);
    assert_eq!(route(&c, &cfg, true), first_trial(&c));
    c.elem = Some(ElemType::F32);
    c.bytes = cfg.float_sum_min_bytes;
    assert_eq!(route(&c, &cfg, true), first_trial(&c));
}

#[test]
fn bcast_ignores_op() {
    let cfg = Config::default();
    let mut c = big_f32_sum();
    c.collective = Collective::Bcast;
    c.op = None;
    assert_eq!(route(&c, &cfg, true), first_trial(&c));
}

#[test]
fn threshold_routing_carries_the_call() {
    let cfg = Config {
        allreduce_routing: Routing::Threshold,
        bcast_routing: Routing::Threshold,
        ..Config::default()
    };
    let mut c = big_f32_sum();
    let fast = |op| {
        Route::Fast(FastCall {
            op,
            bytes: 4 << 20,
            measure: Measure::Fixed,
        })
    };
    let sum = FastOp::Allreduce {
        elem: ElemType::F32,
        op: ReduceOp::Sum,
    };
    assert_eq!(route(&c, &cfg, true), fast(sum));
    c.collective = Collective::Bcast;
    c.op = None;
    assert_eq!(route(&c, &cfg, true), fast(FastOp::Bcast));
    assert_eq!(FastOp::Bcast.collective(), Collective::Bcast);
    assert_eq!(sum.collective(), Collective::Allreduce);
}

#[test]
fn measured_routing_follows_the_tuner() {
    let cfg = Config::default();
    let c = big_f32_sum();
    let class = Class::of(&c).expect("eligible");
    let on = |t: &Tuner| decide(&c, &cfg, true, || Ok::<_, ()>(Some(t))).expect("no lookup error");
    let mut t = Tuner::new();
    for _ in 0..TRIALS / 2 {
        assert_eq!(on(&t), Route::MpiTrial(class));
        t.sample(class, Path::Mpi, Duration::from_micros(5));
    }
    let trial = Route::Fast(FastCall {
        op: FastOp::Allreduce {
            elem: ElemType::F32,
            op: ReduceOp::Sum,
        },
        bytes: c.bytes,
        measure: Measure::Trial(class),
    });
    assert_eq!(on(&t), trial);
    let mut slower = Tuner::new();
    slower.settle(class, [1, 2]);
    assert_eq!(on(&slower), Route::Pmpi(Reason::MeasuredSlower));
    let mut faster = Tuner::new();
    faster.settle(class, [2, 1]);
    let Route::Fast(settled) = on(&faster) else {
        panic!("settled on the fast path")
    };
    assert_eq!(settled.measure, Measure::Settled(class));
}

#[test]
fn the_communicator_is_asked_only_for_an_eligible_call() {
    let cfg = Config::default();
    let mut c = big_f32_sum();
    // Its ring was declined: every later call goes to MPI.
    let declined = decide(&c, &cfg, true, || Ok::<_, ()>(None));
    assert_eq!(declined, Ok(Route::Pmpi(Reason::DatapathUnavailable)));
    // Its lookup failed: the error, as it is.
    assert_eq!(
        decide(&c, &cfg, true, || Err::<Option<&Tuner>, _>(7)),
        Err(7)
    );
    c.bytes = 16;
    c.count = 4;
    let below = decide(&c, &cfg, true, || -> Result<Option<&Tuner>, ()> {
        panic!("asked for a call below the threshold")
    });
    assert_eq!(below, Ok(Route::Pmpi(Reason::BelowThreshold)));
}

#[test]
fn mpi_gives_ring_bits_only_to_reproducible_float_sums_routed_by_choice() {
    let cfg = Config {
        precision: Precision::Reproducible,
        ..Config::default()
    };
    let mut c = big_f32_sum();
    for r in Reason::ALL {
        assert_eq!(
            mpi_gives_ring_bits(&c, r, &cfg),
            r.is_a_routing_choice(),
            "{r:?}"
        );
    }
    assert!(!mpi_gives_ring_bits(&c, Reason::Trial, &Config::default()));
    c.elem = Some(ElemType::F64);
    assert!(mpi_gives_ring_bits(&c, Reason::UnsupportedOp, &cfg));
    c.op = Some(ReduceOp::Max);
    assert!(!mpi_gives_ring_bits(&c, Reason::Trial, &cfg));
    c.op = Some(ReduceOp::Sum);
    c.elem = Some(ElemType::I32);
    assert!(!mpi_gives_ring_bits(&c, Reason::Trial, &cfg));
}

/// The class of an eligible [`call`].
fn class_of(collective: Collective, elem: ElemType, op: ReduceOp, bytes: usize) -> Class {
    Class::of(&call(collective, elem, op, bytes)).expect("an eligible call has a class")
}

fn call(collective: Collective, elem: ElemType, op: ReduceOp, bytes: usize) -> CallShape {
    CallShape {
        collective,
        elem: Some(elem),
        op: Some(op),
        contiguous: true,
        count: (bytes / elem.size()) as i64,
        bytes,
        comm_size: 4,
        inter_comm: false,
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
    let c = class_of(Collective::Allreduce, ElemType::I32, ReduceOp::Sum, 4 << 20);
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
    let c = class_of(Collective::Bcast, ElemType::I32, ReduceOp::Sum, 1 << 20);
    let local = trials(&mut t, c, [900, 900, 900, 300, 300, 300]);
    assert!(winner(local) == Path::Fast);
    assert_eq!(t.settle(c, [3600, 5000]), Path::Mpi);
    assert_eq!(t.plan(c), Plan::Use(Path::Mpi));
    // And the other way round.
    let c2 = class_of(Collective::Bcast, ElemType::I32, ReduceOp::Sum, 2 << 20);
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
    let a = class_of(Collective::Allreduce, ElemType::I32, ReduceOp::Sum, 1 << 20);
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
    let at = |bytes| class_of(Collective::Allreduce, ElemType::F32, ReduceOp::Sum, bytes);
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
