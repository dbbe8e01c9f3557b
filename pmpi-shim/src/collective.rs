//! One intercepted collective, whatever binding it came through: describe
//! the call, route it, run the fast path. Completing a call through PMPI is
//! left to the binding, because the C and Fortran bindings complete it
//! differently (PMPI_Allreduce vs. the MPI's own Fortran wrapper).

use crate::comm::{self, CommState, PmpiComm};
use crate::ffi::{MPI_Comm, MPI_Count, MPI_Datatype, MPI_Op, RawHandle, MPI_SUCCESS};
use crate::rt::{pmpi, Runtime};
use liberar::config::Config;
use liberar::datapath::ring::Ring;
use liberar::datapath::DatapathError;
use liberar::select::{self, CallShape, Collective, Reason, Route};
use liberar::stats;
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What the binding does next.
pub enum Outcome {
    /// The fast path completed the call.
    Done,
    /// Complete the call through PMPI with the caller's original arguments
    /// (already counted under its reason).
    Pmpi,
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

/// Counts a call that goes to PMPI before any routing (re-entrant, or MPI
/// not initialized).
#[inline]
pub fn record_early(coll: Collective, reason: Reason) {
    stats::record(coll, Route::Pmpi(reason), 0);
}

fn to_pmpi(coll: Collective, reason: Reason, bytes: usize) -> Outcome {
    stats::record(coll, Route::Pmpi(reason), bytes);
    log::debug!("liberar: {coll:?} {bytes} B -> pmpi ({})", reason.name());
    Outcome::Pmpi
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

pub unsafe fn allreduce(rt: &Runtime, a: &AllreduceArgs) -> Outcome {
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
    match select::decide(&shape, cfg, rt.state_keyval != rt.h.keyval_invalid) {
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
            fast(rt, &adapter, COLL, bytes, |ring, c| {
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
    let elem = rt.elem_of(a.datatype);
    let (bytes, mut contiguous) = match elem {
        Some(e) => ((a.count as usize).saturating_mul(e.size()), true),
        None if a.count == 0 || inter_comm => (0, false),
        None => match type_layout(a.datatype) {
            Some((size, dense)) => ((a.count as usize).saturating_mul(size), dense),
            None => return to_pmpi(COLL, Reason::InvalidArgs, 0),
        },
    };
    if bytes > 0 && a.buf.is_null() {
        contiguous = false; // MPI_BOTTOM: see allreduce
    }
    let shape = CallShape {
        collective: COLL,
        elem,
        op: None,
        contiguous,
        count: a.count as i64,
        bytes,
        in_place: false,
        comm_size,
        inter_comm,
        thread_multiple: rt.thread_multiple,
    };
    match select::decide(&shape, cfg, rt.state_keyval != rt.h.keyval_invalid) {
        Route::Pmpi(reason) => to_pmpi(COLL, reason, bytes),
        Route::Fast => {
            let Ok(root) = usize::try_from(a.root) else {
                return to_pmpi(COLL, Reason::InvalidArgs, bytes);
            };
            if root >= comm_size {
                return to_pmpi(COLL, Reason::InvalidArgs, bytes);
            }
            let Ok(adapter) = PmpiComm::new(rt, a.comm, comm_size, None, None) else {
                return to_pmpi(COLL, Reason::InvalidArgs, bytes);
            };
            fast(rt, &adapter, COLL, bytes, |ring, c| {
                // SAFETY: non-null and `bytes` long (a dense layout starting
                // at the buffer, checked above).
                let buf = std::slice::from_raw_parts_mut(a.buf.cast::<u8>(), bytes);
                ring.bcast(c, buf, root)
            })
        }
    }
}

/// (size, dense) of a datatype that is not in the table: dense when its
/// bytes start at the buffer and `count` copies tile without holes, so the
/// datapath can move `count * size` bytes as they are.
unsafe fn type_layout(dt: MPI_Datatype) -> Option<(usize, bool)> {
    let p = pmpi();
    let (mut size, mut lb, mut extent, mut tlb, mut textent): (
        MPI_Count,
        MPI_Count,
        MPI_Count,
        MPI_Count,
        MPI_Count,
    ) = (0, 0, 0, 0, 0);
    if p.PMPI_Type_size_x(dt, &mut size) != MPI_SUCCESS
        || p.PMPI_Type_get_extent_x(dt, &mut lb, &mut extent) != MPI_SUCCESS
        || p.PMPI_Type_get_true_extent_x(dt, &mut tlb, &mut textent) != MPI_SUCCESS
    {
        return None;
    }
    let Ok(usize_size) = usize::try_from(size) else {
        // MPI_UNDEFINED: a size beyond MPI_Count.
        return Some((0, false));
    };
    let dense = size > 0 && lb == 0 && tlb == 0 && extent == size && textent == size;
    Some((usize_size, dense))
}

/// The fast route: find or set up the communicator's ring, run `op` on it.
unsafe fn fast<F>(
    rt: &Runtime,
    adapter: &PmpiComm<'_>,
    coll: Collective,
    bytes: usize,
    op: F,
) -> Outcome
where
    F: FnOnce(&mut Ring, &PmpiComm<'_>) -> Result<(), DatapathError>,
{
    let comm = adapter.comm();
    let state = match comm::get_state(rt, comm) {
        Ok(Some(s)) => s,
        Ok(None) => match establish(rt, adapter) {
            Ok(s) => s,
            Err(outcome) => {
                // Declined: this call tried the fast path and handed it back.
                if matches!(outcome, Outcome::Pmpi) {
                    return to_pmpi(coll, Reason::FastPathDeclined, bytes);
                }
                stats::record(coll, Route::Fast, bytes);
                return outcome;
            }
        },
        Err(rc) => {
            return fail(
                rt,
                comm,
                coll,
                bytes,
                &format!("MPI_Comm_get_attr returned {rc}"),
            )
        }
    };
    let CommState::Ring(m) = state else {
        return to_pmpi(coll, Reason::DatapathUnavailable, bytes);
    };
    let mut guard = m.lock();
    let Some(ring) = guard.as_mut() else {
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
        Ok(Err(DatapathError::Failed(why))) => fail(rt, comm, coll, bytes, &why),
        Err(_) => fail(rt, comm, coll, bytes, "the datapath panicked"),
    }
}

/// First eligible call on a communicator: set up its ring (collective) and
/// remember the verdict. `Err(Outcome::Pmpi)` when declined.
unsafe fn establish<'a>(rt: &Runtime, adapter: &PmpiComm<'_>) -> Result<&'a CommState, Outcome> {
    let comm = adapter.comm();
    let state = match catch_unwind(AssertUnwindSafe(|| Ring::establish(adapter))) {
        Ok(Ok(ring)) => CommState::Ring(parking_lot::Mutex::new(Some(ring))),
        Ok(Err(DatapathError::Declined(why))) => {
            log::debug!("liberar: no ring on this communicator: {why}");
            CommState::Unavailable
        }
        Ok(Err(DatapathError::Failed(why))) => {
            return Err(error(rt, comm, &format!("ring setup failed: {why}")))
        }
        Err(_) => return Err(error(rt, comm, "ring setup panicked")),
    };
    let declined = matches!(state, CommState::Unavailable);
    match comm::set_state(rt, comm, state) {
        Ok(_) if declined => Err(Outcome::Pmpi),
        Ok(s) => Ok(s),
        Err(rc) => Err(error(rt, comm, &format!("MPI_Comm_set_attr returned {rc}"))),
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
