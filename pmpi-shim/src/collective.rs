//! One intercepted collective, whatever binding it came through: the one
//! entry ([`intercept`]), then describe the call, route it (eligibility,
//! then the path measured faster), run the fast path. How a call is
//! completed through MPI is the binding's closure, because the C and
//! Fortran bindings complete it differently (PMPI_Allreduce vs. the MPI's
//! own Fortran wrapper).

use crate::comm::{self, CommState, PmpiComm, RingState};
use crate::ffi::{MPI_Comm, MPI_Datatype, MPI_Op, RawHandle, MPI_SUCCESS};
use crate::packing::{type_layout, Layout, Packing};
use crate::rt::{pmpi, runtime, Guard, Runtime};
use liberar::config::{Config, Precision, Routing};
use liberar::datapath::ring::Ring;
use liberar::datapath::{reproducible, Comm as _, DatapathError};
use liberar::select::{self, CallShape, Collective, ElemType, Reason, ReduceOp, Route};
use liberar::stats;
use liberar::tuning::{Class, Path, Plan, Tuner};
use parking_lot::Mutex;
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// What the binding does next.
pub enum Outcome {
    /// The fast path completed the call.
    Done,
    /// Complete the call through PMPI with the caller's original arguments
    /// (already counted under this reason).
    Pmpi(Reason),
    /// The same, timed: a trial of MPI against the fast path. Call
    /// [`Trial::done`] with PMPI's return code.
    Trial(Trial),
    /// Return this MPI error code (the communicator's error handler has run).
    Error(c_int),
}

pub struct AllreduceArgs {
    /// C `MPI_IN_PLACE` already substituted for Fortran's.
    pub send: *const c_void,
    pub recv: *mut c_void,
    pub count: c_int,
    pub datatype: MPI_Datatype,
    pub op: MPI_Op,
    pub comm: MPI_Comm,
}

pub struct BcastArgs {
    pub buf: *mut c_void,
    pub count: c_int,
    pub datatype: MPI_Datatype,
    pub root: c_int,
    pub comm: MPI_Comm,
}

/// The one way in for every intercepted collective, C and Fortran alike.
/// A re-entrant call (MPI calling itself) and a call outside
/// MPI_Init..MPI_Finalize go to MPI untouched. Otherwise `route` describes
/// and routes the call (`None`: arguments the binding could not even read,
/// which MPI reports), and `mpi` completes what the fast path does not —
/// timed, when it is a trial. Returns the call's MPI return code.
///
/// # Safety
/// `mpi` and `route` must be safe to call with the caller's arguments, as
/// the intercepted MPI function requires of its caller.
#[inline]
pub unsafe fn intercept(
    coll: Collective,
    mpi: impl Fn() -> c_int,
    route: impl FnOnce(&'static Runtime) -> Option<Outcome>,
) -> c_int {
    let Some(_guard) = Guard::enter() else {
        record_early(coll, Reason::Reentrant);
        return mpi();
    };
    let Some(rt) = runtime() else {
        record_early(coll, Reason::InvalidArgs);
        return mpi();
    };
    match route(rt) {
        None => {
            record_early(coll, Reason::InvalidArgs);
            mpi()
        }
        Some(Outcome::Done) => MPI_SUCCESS,
        Some(Outcome::Pmpi(_)) => mpi(),
        Some(Outcome::Trial(trial)) => {
            let rc = mpi();
            trial.done(rt, rc);
            rc
        }
        Some(Outcome::Error(code)) => code,
    }
}

/// Counts a call that goes to PMPI before any routing (re-entrant, or MPI
/// not initialized).
#[inline]
fn record_early(coll: Collective, reason: Reason) {
    stats::record(coll, Route::Pmpi(reason), 0);
}

fn to_pmpi(coll: Collective, reason: Reason, bytes: usize) -> Outcome {
    stats::record(coll, Route::Pmpi(reason), bytes);
    log::debug!("liberar: {coll:?} {bytes} B -> pmpi ({})", reason.name());
    Outcome::Pmpi(reason)
}

/// Size and kind of the communicator, or `None` if MPI rejects it (the PMPI
/// call will then report the error on the right error handler).
unsafe fn comm_info(comm: MPI_Comm) -> Option<(usize, bool)> {
    let p = pmpi();
    let (mut size, mut inter) = (0, 0);
    if p.PMPI_Comm_test_inter(comm, &mut inter) != MPI_SUCCESS
        || p.PMPI_Comm_size(comm, &mut size) != MPI_SUCCESS
    {
        return None;
    }
    Some((size.max(0) as usize, inter != 0))
}

fn ranges_overlap(a: usize, b: usize, len: usize) -> bool {
    a < b.saturating_add(len) && b < a.saturating_add(len)
}

/// What every collective checks first: routing disabled, arguments MPI must
/// reject (`in_place_misused`: MPI_IN_PLACE where the call does not allow
/// it), then the communicator's size and kind.
unsafe fn prologue(
    rt: &Runtime,
    coll: Collective,
    count: c_int,
    comm: MPI_Comm,
    datatype: MPI_Datatype,
    in_place_misused: bool,
) -> Result<(&'static Config, usize, bool), Outcome> {
    let cfg = Config::get();
    if cfg.disabled {
        return Err(to_pmpi(coll, Reason::Disabled, 0));
    }
    if count < 0 || rt.is_null_comm(comm) || rt.is_null_type(datatype) || in_place_misused {
        return Err(to_pmpi(coll, Reason::InvalidArgs, 0));
    }
    let Some((comm_size, inter_comm)) = comm_info(comm) else {
        return Err(to_pmpi(coll, Reason::InvalidArgs, 0));
    };
    Ok((cfg, comm_size, inter_comm))
}

/// Routes one `MPI_Allreduce` ([`route_allreduce`]); under the
/// `reproducible` contract a float or double SUM that MPI would carry as it
/// is gets the ring's bits instead ([`reproducible_by_mpi`]).
pub unsafe fn allreduce(rt: &Runtime, a: &AllreduceArgs) -> Outcome {
    let outcome = route_allreduce(rt, a);
    if Config::get().precision != Precision::Reproducible || rt.op_of(a.op) != Some(ReduceOp::Sum) {
        return outcome;
    }
    let elem = match rt.elem_of(a.datatype) {
        Some(e @ (ElemType::F32 | ElemType::F64)) => e,
        _ => return outcome,
    };
    match outcome {
        Outcome::Pmpi(reason) if reason.is_a_routing_choice() => reproducible_by_mpi(rt, a, elem),
        // MPI_DOUBLE SUM is not in-kernel: the contract holds through MPI.
        // (The reason is only given to calls whose buffers passed the
        // checks: null or aliased ones get another.)
        Outcome::Pmpi(Reason::UnsupportedOp) if elem == ElemType::F64 => {
            reproducible_by_mpi(rt, a, elem)
        }
        Outcome::Trial(trial) => {
            let outcome = reproducible_by_mpi(rt, a, elem);
            let rc = match outcome {
                Outcome::Error(code) => code,
                _ => MPI_SUCCESS,
            };
            trial.done(rt, rc);
            outcome
        }
        outcome => outcome,
    }
}

/// A reproducible float or double SUM that MPI carries (below the
/// threshold, a trial, measured slower, no datapath; every MPI_DOUBLE SUM):
/// with the bits the ring gives
/// (`liberar::datapath::reproducible`). Reached only after the arguments
/// passed the checks that send erroneous calls to MPI as they are.
unsafe fn reproducible_by_mpi(rt: &Runtime, a: &AllreduceArgs, elem: ElemType) -> Outcome {
    let in_place = a.send == rt.h.in_place.cast_const();
    let bytes = a.count as usize * elem.size();
    let adapter =
        comm_info(a.comm).and_then(|(size, _)| PmpiComm::new(rt, a.comm, size, None, None).ok());
    let Some(adapter) = adapter else {
        return Outcome::Pmpi(Reason::InvalidArgs);
    };
    // SAFETY: as for the fast path: non-null, `bytes` long, not overlapping
    // (checked before any routing reason that comes here).
    let recv = std::slice::from_raw_parts_mut(a.recv.cast::<u8>(), bytes);
    let send = (!in_place).then(|| std::slice::from_raw_parts(a.send.cast::<u8>(), bytes));
    let sum = match elem {
        ElemType::F64 => reproducible::allreduce_f64,
        _ => reproducible::allreduce,
    };
    match catch_unwind(AssertUnwindSafe(|| sum(&adapter, send, recv))) {
        Ok(Ok(())) => Outcome::Done,
        Ok(Err(e)) => error(rt, a.comm, &e.to_string()),
        Err(_) => error(rt, a.comm, "the reproducible sum panicked"),
    }
}

unsafe fn route_allreduce(rt: &Runtime, a: &AllreduceArgs) -> Outcome {
    const COLL: Collective = Collective::Allreduce;
    // MPI_IN_PLACE as the receive buffer is erroneous: MPI reports it.
    let recv_in_place = a.recv.cast_const() == rt.h.in_place.cast_const();
    let (cfg, comm_size, inter_comm) =
        match prologue(rt, COLL, a.count, a.comm, a.datatype, recv_in_place) {
            Ok(v) => v,
            Err(outcome) => return outcome,
        };
    let in_place = a.send == rt.h.in_place.cast_const();
    let mut elem = rt.elem_of(a.datatype);
    let op = rt.op_of(a.op);
    // A predefined type's size is in the table (from MPI_Type_size at init);
    // any other type is never accelerated, so its size does not matter.
    let bytes = elem.map_or(0, |e| (a.count as usize).saturating_mul(e.size()));
    if bytes > 0 {
        // MPI_BOTTOM (null) addresses through the datatype, which a
        // predefined type cannot do meaningfully: leave it to MPI.
        if a.recv.is_null() || (!in_place && a.send.is_null()) {
            elem = None;
        } else if !in_place && ranges_overlap(a.send as usize, a.recv as usize, bytes) {
            return to_pmpi(COLL, Reason::InvalidArgs, bytes);
        }
    }
    let shape = CallShape {
        collective: COLL,
        elem,
        op,
        contiguous: elem.is_some(),
        count: a.count as i64,
        bytes,
        in_place,
        comm_size,
        inter_comm,
        thread_multiple: rt.thread_multiple,
    };
    match select::decide(&shape, cfg, comm::state_keyval(rt) != rt.h.keyval_invalid) {
        Route::Pmpi(reason) => to_pmpi(COLL, reason, bytes),
        Route::Fast => {
            let (Some(e), Some(o)) = (elem, op) else {
                return to_pmpi(COLL, Reason::UnsupportedType, bytes);
            };
            let Ok(adapter) = PmpiComm::new(
                rt,
                a.comm,
                comm_size,
                Some((e, a.datatype)),
                Some((o, a.op)),
            ) else {
                return to_pmpi(COLL, Reason::InvalidArgs, bytes);
            };
            eligible(rt, &adapter, &shape, |ring, c| {
                // SAFETY: non-null, `bytes` long, not overlapping (checked
                // above); the caller owns both buffers for the call.
                let recv = std::slice::from_raw_parts_mut(a.recv.cast::<u8>(), bytes);
                let send =
                    (!in_place).then(|| std::slice::from_raw_parts(a.send.cast::<u8>(), bytes));
                ring.allreduce(c, send, recv, e, o)
            })
        }
    }
}

pub unsafe fn bcast(rt: &Runtime, a: &BcastArgs) -> Outcome {
    const COLL: Collective = Collective::Bcast;
    // Broadcast has no MPI_IN_PLACE: MPI reports it.
    let buf_in_place = a.buf.cast_const() == rt.h.in_place.cast_const();
    let (cfg, comm_size, inter_comm) =
        match prologue(rt, COLL, a.count, a.comm, a.datatype, buf_in_place) {
            Ok(v) => v,
            Err(outcome) => return outcome,
        };
    // Routing depends on the message's size in bytes only, never on how a
    // rank lays it out: a correct program may broadcast from a contiguous
    // root into strided receivers (equal type signatures, different
    // datatypes), and every rank must still take the same route, or the
    // ring's collectives on one rank would meet MPI's broadcast on another.
    let elem = rt.elem_of(a.datatype);
    let (bytes, layout) = match elem {
        Some(e) => (
            (a.count as usize).saturating_mul(e.size()),
            Some(Layout::Dense),
        ),
        None if a.count == 0 || inter_comm => (0, None),
        None => match type_layout(a.datatype, a.count) {
            Some(v) => v,
            None => return to_pmpi(COLL, Reason::InvalidArgs, 0),
        },
    };
    if bytes > isize::MAX as usize
        || (bytes > 0 && a.buf.is_null() && matches!(layout, Some(Layout::Dense)))
    {
        // More bytes than any buffer holds; or MPI_BOTTOM with a datatype
        // whose data would start at address 0 (erroneous; MPI_BOTTOM with
        // absolute addresses is a packed layout): MPI reports or does it.
        return to_pmpi(COLL, Reason::InvalidArgs, bytes);
    }
    let shape = CallShape {
        collective: COLL,
        elem,
        op: None,
        contiguous: layout.is_some(),
        count: a.count as i64,
        bytes,
        in_place: false,
        comm_size,
        inter_comm,
        thread_multiple: rt.thread_multiple,
    };
    match select::decide(&shape, cfg, comm::state_keyval(rt) != rt.h.keyval_invalid) {
        Route::Pmpi(reason) => to_pmpi(COLL, reason, bytes),
        Route::Fast => {
            let Some(layout) = layout else {
                return to_pmpi(COLL, Reason::UnsupportedType, bytes);
            };
            let Ok(root) = usize::try_from(a.root) else {
                return to_pmpi(COLL, Reason::InvalidArgs, bytes);
            };
            if root >= comm_size {
                return to_pmpi(COLL, Reason::InvalidArgs, bytes);
            }
            // The datapath moves bytes whatever the handle says; MPI
            // rejects a derived datatype that is not committed.
            if elem.is_none() && !rt.datatype_usable(a.datatype) {
                return to_pmpi(COLL, Reason::InvalidArgs, bytes);
            }
            let Ok(adapter) = PmpiComm::new(rt, a.comm, comm_size, None, None) else {
                return to_pmpi(COLL, Reason::InvalidArgs, bytes);
            };
            match layout {
                Layout::Dense => eligible(rt, &adapter, &shape, |ring, c| {
                    // SAFETY: non-null and `bytes` long (a dense layout
                    // starting at the buffer, checked above).
                    let buf = std::slice::from_raw_parts_mut(a.buf.cast::<u8>(), bytes);
                    ring.bcast(c, buf, root)
                }),
                Layout::Packed { size, extent } => eligible(rt, &adapter, &shape, |ring, c| {
                    let packing = Packing {
                        rt,
                        buf: a.buf,
                        count: a.count as usize,
                        datatype: a.datatype,
                        comm: a.comm,
                        size,
                        extent,
                    };
                    // Every rank moves the same `bytes` through the ring:
                    // the root packs first, the others unpack after. Only
                    // the unpack writes the caller's buffer, after the data
                    // is complete (a fallback inside the ring completes
                    // the bounce buffer through MPI as bytes).
                    let mut tmp = vec![0u8; bytes];
                    let is_root = c.rank() == root;
                    if is_root {
                        packing.pack(&mut tmp)?;
                    }
                    ring.bcast(c, &mut tmp, root)?;
                    if !is_root {
                        packing.unpack(&tmp)?;
                    }
                    Ok(())
                }),
            }
        }
    }
}

/// An eligible call: the path its class takes on this communicator (by
/// trials, see `liberar::tuning`, unless the collective's routing is a fixed
/// threshold), then that path.
unsafe fn eligible<F>(rt: &Runtime, adapter: &PmpiComm<'_>, shape: &CallShape, op: F) -> Outcome
where
    F: FnOnce(&mut Ring, &PmpiComm<'_>) -> Result<(), DatapathError>,
{
    let (coll, bytes) = (shape.collective, shape.bytes);
    let comm = adapter.comm();
    let state = match comm::state(rt, comm) {
        Ok(s) => s,
        Err(rc) => {
            return fail(
                rt,
                comm,
                coll,
                bytes,
                &format!("MPI_Comm_get_attr/set_attr returned {rc}"),
            )
        }
    };
    let mut st = state.lock();
    if matches!(st.ring, RingState::Unavailable) {
        return to_pmpi(coll, Reason::DatapathUnavailable, bytes);
    }
    let measured = select::routing(Config::get(), coll).0 == Routing::Measured;
    let Some(class) = Class::of(shape).filter(|_| measured) else {
        return fast(rt, adapter, state, &mut st, coll, bytes, op);
    };
    match st.tuner.plan(class) {
        Plan::Use(Path::Fast) => {
            // For the ERAR_STATS summary: this call against MPI's time for
            // its class, as the trials measured it.
            let mpi_us = st.tuner.mpi_estimate_us(class, adapter.size());
            let t0 = Instant::now();
            let outcome = fast(rt, adapter, state, &mut st, coll, bytes, op);
            if let (Some(mpi_us), Outcome::Done) = (mpi_us, &outcome) {
                stats::record_saved(mpi_us, t0.elapsed());
            }
            outcome
        }
        Plan::Use(Path::Mpi) => to_pmpi(coll, Reason::MeasuredSlower, bytes),
        Plan::Trial(Path::Fast) => {
            let t0 = Instant::now();
            let outcome = fast(rt, adapter, state, &mut st, coll, bytes, op);
            if !matches!(outcome, Outcome::Error(_)) {
                sample(adapter, &mut st.tuner, class, Path::Fast, t0);
            }
            outcome
        }
        Plan::Trial(Path::Mpi) => {
            stats::record(coll, Route::Pmpi(Reason::Trial), bytes);
            Outcome::Trial(Trial {
                state,
                class,
                comm,
                comm_size: adapter.size(),
                t0: Instant::now(),
            })
        }
    }
}

/// An MPI trial under way: the binding runs PMPI, then [`Trial::done`].
pub struct Trial {
    state: &'static Mutex<CommState>,
    class: Class,
    comm: MPI_Comm,
    comm_size: usize,
    t0: Instant,
}

impl Trial {
    /// Records the trial once PMPI has completed the call with `rc`. A failed
    /// call is not a measurement (and its communicator may be unusable).
    ///
    /// # Safety
    /// Right after PMPI completed the call on `self.comm`, inside the same
    /// intercepted call.
    pub unsafe fn done(self, rt: &Runtime, rc: c_int) {
        if rc != MPI_SUCCESS {
            return;
        }
        let Ok(adapter) = PmpiComm::new(rt, self.comm, self.comm_size, None, None) else {
            return;
        };
        sample(
            &adapter,
            &mut self.state.lock().tuner,
            self.class,
            Path::Mpi,
            self.t0,
        );
    }
}

/// Records one trial; after a class's last, adds up every rank's best time
/// of each path and settles the class on the sums. Every rank comes here on
/// the same call, so the exchange is matched.
fn sample(adapter: &PmpiComm<'_>, tuner: &mut Tuner, class: Class, path: Path, t0: Instant) {
    let mut took = t0.elapsed();
    let cfg = Config::get();
    if path == Path::Fast
        && cfg.test_slow_fast != 1.0
        && cfg
            .test_slow_fast_rank
            .is_none_or(|r| r as usize == adapter.rank())
    {
        took = took.mul_f64(cfg.test_slow_fast);
    }
    let Some(mine) = tuner.sample(class, path, took) else {
        return;
    };
    let times = match sum_over_ranks(adapter, mine) {
        Ok(sums) => sums,
        Err(e) => {
            // MPI itself failed on this communicator: MPI it is (never wrong).
            log::warn!("liberar: adding up trial times failed: {e}");
            [0, i64::MAX]
        }
    };
    let chosen = tuner.settle(class, times);
    let n = adapter.size().max(1) as i64;
    let mean_us = times.map(|t| t / n);
    stats::record_choice(class, chosen, mean_us);
    log::debug!(
        "liberar: {} from {} B on this communicator -> {} (mean over ranks of each rank's best: \
         mpi {} us, fast {} us)",
        class.kind_name(),
        class.min_bytes(),
        chosen.name(),
        mean_us[Path::Mpi as usize],
        mean_us[Path::Fast as usize]
    );
}

/// `MPI_Allreduce(SUM)` of two i64 over the communicator.
fn sum_over_ranks(adapter: &PmpiComm<'_>, mine: [i64; 2]) -> Result<[i64; 2], DatapathError> {
    let mut bytes = [0u8; 16];
    let (a, b) = bytes.split_at_mut(8);
    a.copy_from_slice(&mine[0].to_ne_bytes());
    b.copy_from_slice(&mine[1].to_ne_bytes());
    adapter.pmpi_allreduce(None, &mut bytes, ElemType::I64, ReduceOp::Sum)?;
    let (a, b) = bytes.split_at(8);
    let word = |s: &[u8]| i64::from_ne_bytes(s.try_into().unwrap_or_default());
    Ok([word(a), word(b)])
}

/// The fast route: set up the communicator's ring if it has none, run `op`
/// on it.
unsafe fn fast<F>(
    rt: &Runtime,
    adapter: &PmpiComm<'_>,
    state: &Mutex<CommState>,
    st: &mut CommState,
    coll: Collective,
    bytes: usize,
    op: F,
) -> Outcome
where
    F: FnOnce(&mut Ring, &PmpiComm<'_>) -> Result<(), DatapathError>,
{
    if matches!(st.ring, RingState::NotYet) {
        match establish(rt, adapter) {
            Ok(ring) => {
                st.ring = RingState::Ready(Box::new(ring));
                comm::register_ring(adapter.comm(), state);
            }
            Err(None) => {
                // Declined: this call tried the fast path and handed it back.
                st.ring = RingState::Unavailable;
                return to_pmpi(coll, Reason::FastPathDeclined, bytes);
            }
            Err(Some(outcome)) => {
                stats::record(coll, Route::Fast, bytes);
                return outcome;
            }
        }
    }
    let RingState::Ready(ring) = &mut st.ring else {
        return to_pmpi(coll, Reason::DatapathUnavailable, bytes);
    };
    // A panic in the datapath becomes an MPI error on this communicator
    // rather than an abort of the whole process from inside an extern "C"
    // function.
    match catch_unwind(AssertUnwindSafe(|| op(ring, adapter))) {
        Ok(Ok(())) => {
            stats::record(coll, Route::Fast, bytes);
            log::debug!("liberar: {coll:?} {bytes} B -> fast");
            Outcome::Done
        }
        Ok(Err(DatapathError::Declined(why))) => {
            log::debug!("liberar: {coll:?} {bytes} B: fast path declined: {why}");
            to_pmpi(coll, Reason::FastPathDeclined, bytes)
        }
        Ok(Err(DatapathError::Failed(why))) => fail(rt, adapter.comm(), coll, bytes, &why),
        Err(_) => fail(rt, adapter.comm(), coll, bytes, "the datapath panicked"),
    }
}

/// First call on a communicator that takes the fast path: set up its ring
/// (collective, the same verdict on every rank). `Err(None)` when declined,
/// `Err(Some(error))` when it failed.
unsafe fn establish(rt: &Runtime, adapter: &PmpiComm<'_>) -> Result<Ring, Option<Outcome>> {
    let comm = adapter.comm();
    match catch_unwind(AssertUnwindSafe(|| Ring::establish(adapter))) {
        Ok(Ok(ring)) => Ok(ring),
        Ok(Err(DatapathError::Declined(why))) => {
            log::debug!("liberar: no ring on this communicator: {why}");
            Err(None)
        }
        Ok(Err(DatapathError::Failed(why))) => {
            Err(Some(error(rt, comm, &format!("ring setup failed: {why}"))))
        }
        Err(_) => Err(Some(error(rt, comm, "ring setup panicked"))),
    }
}

unsafe fn fail(rt: &Runtime, comm: MPI_Comm, coll: Collective, bytes: usize, why: &str) -> Outcome {
    // Counted as fast: the call was routed there; the error is the outcome.
    stats::record(coll, Route::Fast, bytes);
    error(rt, comm, why)
}

/// Reports a fast-path failure the way MPI reports errors: through the
/// communicator's error handler (fatal by default), then as the return code.
unsafe fn error(rt: &Runtime, comm: MPI_Comm, why: &str) -> Outcome {
    log::error!("liberar: fast path failed: {why}");
    let code = rt.h.err_other;
    if !comm.is_zero() {
        pmpi().PMPI_Comm_call_errhandler(comm, code);
    }
    Outcome::Error(code)
}
