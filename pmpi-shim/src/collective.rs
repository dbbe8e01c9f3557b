//! One intercepted collective, whatever binding it came through: the C
//! entries (`MPI_Allreduce`, `MPI_Bcast`), the one entry every binding goes
//! through ([`intercept`]), then the call described ([`CallShape`]), routed
//! by `liberar::select::decide` alone, and run on the communicator's ring.
//! How a call is completed through MPI is the binding's closure, because the
//! C and Fortran bindings complete it differently (PMPI_Allreduce vs. the
//! MPI's own Fortran wrapper).

use crate::comm::{self, CommState, RingState};
use crate::ffi::{MPI_Comm, MPI_Datatype, MPI_Op, RawHandle, MPI_SUCCESS};
use crate::node::NodeRing;
use crate::packing::{type_layout, Layout, Packing};
use crate::pmpi_comm::PmpiComm;
use crate::rt::{pmpi, runtime, Guard, Runtime};
use crate::trials::{self, Trial};
use liberar::config::Config;
use liberar::datapath::node::Node;
use liberar::datapath::ring::{Hosts, Ring};
use liberar::datapath::{reproducible, Comm as _, DatapathError, Done, Reduction};
use liberar::select::{
    self, CallShape, Collective, ElemType, FastCall, FastOp, Measure, Path, Reason, ReduceOp, Route,
};
use liberar::stats;
use liberar::trace::{self, Mark};
use parking_lot::{Mutex, MutexGuard};
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// # Safety
/// As `MPI_Allreduce`.
#[no_mangle]
pub unsafe extern "C" fn MPI_Allreduce(
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: c_int,
    datatype: MPI_Datatype,
    op: MPI_Op,
    comm: MPI_Comm,
) -> c_int {
    let mpi = || pmpi().PMPI_Allreduce(sendbuf, recvbuf, count, datatype, op, comm);
    intercept(Collective::Allreduce, mpi, |rt| {
        let args = AllreduceArgs {
            send: sendbuf,
            recv: recvbuf,
            count,
            datatype,
            op,
            comm,
        };
        Some(allreduce(rt, &args))
    })
}

/// # Safety
/// As `MPI_Bcast`.
#[no_mangle]
pub unsafe extern "C" fn MPI_Bcast(
    buffer: *mut c_void,
    count: c_int,
    datatype: MPI_Datatype,
    root: c_int,
    comm: MPI_Comm,
) -> c_int {
    let mpi = || pmpi().PMPI_Bcast(buffer, count, datatype, root, comm);
    intercept(Collective::Bcast, mpi, |rt| {
        let args = BcastArgs {
            buf: buffer,
            count,
            datatype,
            root,
            comm,
        };
        Some(bcast(rt, &args))
    })
}

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

/// A call past [`prologue`]: what its description needs besides its data.
struct Called {
    cfg: &'static Config,
    coll: Collective,
    count: c_int,
    comm_size: usize,
    inter_comm: bool,
}

impl Called {
    fn shape(
        &self,
        elem: Option<ElemType>,
        op: Option<ReduceOp>,
        contiguous: bool,
        bytes: usize,
    ) -> CallShape {
        CallShape {
            collective: self.coll,
            elem,
            op,
            contiguous,
            count: self.count as i64,
            bytes,
            comm_size: self.comm_size,
            inter_comm: self.inter_comm,
        }
    }
}

/// What every collective checks first: routing disabled, arguments MPI must
/// reject (`not_in_place`, a buffer where the call does not allow
/// MPI_IN_PLACE, holds it), then the communicator's size and kind.
unsafe fn prologue(
    rt: &Runtime,
    coll: Collective,
    count: c_int,
    comm: MPI_Comm,
    datatype: MPI_Datatype,
    not_in_place: *const c_void,
) -> Result<Called, Outcome> {
    let cfg = Config::get();
    if cfg.disabled {
        return Err(to_pmpi(coll, Reason::Disabled, 0));
    }
    let in_place_misused = not_in_place == rt.h.in_place.cast_const();
    if count < 0 || rt.is_null_comm(comm) || rt.is_null_type(datatype) || in_place_misused {
        return Err(to_pmpi(coll, Reason::InvalidArgs, 0));
    }
    let Some((comm_size, inter_comm)) = comm_info(comm) else {
        return Err(to_pmpi(coll, Reason::InvalidArgs, 0));
    };
    Ok(Called {
        cfg,
        coll,
        count,
        comm_size,
        inter_comm,
    })
}

/// Routes and runs one `MPI_Allreduce`. Under the `reproducible` contract a
/// float or double SUM that MPI would carry as it is gets the ring's bits
/// instead ([`reproducible_by_mpi`]; `select::mpi_gives_ring_bits` says
/// which).
pub unsafe fn allreduce(rt: &Runtime, a: &AllreduceArgs) -> Outcome {
    const COLL: Collective = Collective::Allreduce;
    // MPI_IN_PLACE as the receive buffer is erroneous: MPI reports it.
    let called = match prologue(rt, COLL, a.count, a.comm, a.datatype, a.recv.cast_const()) {
        Ok(called) => called,
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
    let (shape, cfg) = (called.shape(elem, op, elem.is_some(), bytes), called.cfg);
    let typed = (elem.map(|e| (e, a.datatype)), op.map(|o| (o, a.op)));
    let outcome = route(
        rt,
        &shape,
        cfg,
        a.comm,
        typed,
        || None,
        |ring, c, call| {
            let FastOp::Allreduce { elem, op } = call.op else {
                return Err(DatapathError::Declined(
                    "decide answered another collective".into(),
                ));
            };
            // SAFETY: non-null, `bytes` long, not overlapping (checked above);
            // the caller owns both buffers for the call.
            let recv = std::slice::from_raw_parts_mut(a.recv.cast::<u8>(), call.bytes);
            let send =
                (!in_place).then(|| std::slice::from_raw_parts(a.send.cast::<u8>(), call.bytes));
            ring.allreduce(c, send, recv, (elem, op))
        },
    );
    match outcome {
        Outcome::Pmpi(reason) if select::mpi_gives_ring_bits(&shape, reason, cfg) => {
            reproducible_by_mpi(rt, a, &shape)
        }
        Outcome::Trial(trial) if select::mpi_gives_ring_bits(&shape, Reason::Trial, cfg) => {
            let outcome = reproducible_by_mpi(rt, a, &shape);
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
unsafe fn reproducible_by_mpi(rt: &Runtime, a: &AllreduceArgs, shape: &CallShape) -> Outcome {
    let in_place = a.send == rt.h.in_place.cast_const();
    let bytes = shape.bytes;
    let adapter = PmpiComm::new(rt, a.comm, shape.comm_size, None, None).ok();
    let Some(adapter) = adapter else {
        return Outcome::Pmpi(Reason::InvalidArgs);
    };
    // SAFETY: as for the fast path: non-null, `bytes` long, not overlapping
    // (checked before any routing reason that comes here).
    let recv = std::slice::from_raw_parts_mut(a.recv.cast::<u8>(), bytes);
    let send = (!in_place).then(|| std::slice::from_raw_parts(a.send.cast::<u8>(), bytes));
    let sum = match shape.elem {
        Some(ElemType::F64) => reproducible::allreduce_f64,
        _ => reproducible::allreduce,
    };
    match catch_unwind(AssertUnwindSafe(|| sum(&adapter, send, recv))) {
        Ok(Ok(())) => Outcome::Done,
        Ok(Err(e)) => error(rt, a.comm, &e.to_string()),
        Err(_) => error(rt, a.comm, "the reproducible sum panicked"),
    }
}

pub unsafe fn bcast(rt: &Runtime, a: &BcastArgs) -> Outcome {
    const COLL: Collective = Collective::Bcast;
    // Broadcast has no MPI_IN_PLACE: MPI reports it.
    let called = match prologue(rt, COLL, a.count, a.comm, a.datatype, a.buf.cast_const()) {
        Ok(called) => called,
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
        None if a.count == 0 || called.inter_comm => (0, None),
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
    let shape = called.shape(elem, None, layout.is_some(), bytes);
    // Checked once the call is eligible, before its communicator is looked
    // up: the datapath moves bytes whatever the handle says, where MPI
    // rejects a root out of range or a derived datatype not committed.
    let root = usize::try_from(a.root)
        .ok()
        .filter(|r| *r < called.comm_size);
    let invalid = || {
        (root.is_none() || (elem.is_none() && !rt.datatype_usable(a.datatype)))
            .then_some(Reason::InvalidArgs)
    };
    let cfg = called.cfg;
    route(
        rt,
        &shape,
        cfg,
        a.comm,
        (None, None),
        invalid,
        |ring, c, call| {
            let (Some(layout), Some(root)) = (layout, root) else {
                return Err(DatapathError::Declined("no layout or root".into()));
            };
            let bytes = call.bytes;
            match layout {
                Layout::Dense => {
                    // SAFETY: non-null and `bytes` long (a dense layout starting
                    // at the buffer, checked above).
                    let buf = std::slice::from_raw_parts_mut(a.buf.cast::<u8>(), bytes);
                    ring.bcast(c, buf, root)
                }
                Layout::Packed { size, extent } => {
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
                }
            }
        },
    )
}

/// The communicator of a call `decide` found eligible, once looked up: the
/// adapter the ring talks through, and the communicator's state, locked
/// for the rest of the call.
struct Held<'a> {
    adapter: PmpiComm<'a>,
    state: &'static Mutex<CommState>,
    st: MutexGuard<'static, CommState>,
}

/// The call's own datatype and op, for what MPI completes of it.
type Typed = (Option<(ElemType, MPI_Datatype)>, Option<(ReduceOp, MPI_Op)>);

/// Routes one described call with `select::decide` and follows its answer:
/// PMPI (counted), an MPI trial (timed by the binding), or the fast path
/// through `run`. The communicator is looked up only for an eligible call,
/// after `invalid` (arguments MPI must reject) found nothing.
unsafe fn route<R>(
    rt: &Runtime,
    shape: &CallShape,
    cfg: &Config,
    comm: MPI_Comm,
    typed: Typed,
    invalid: impl FnOnce() -> Option<Reason>,
    run: R,
) -> Outcome
where
    R: FnOnce(Carrier<'_>, &PmpiComm<'_>, FastCall) -> Result<(), DatapathError>,
{
    let (coll, bytes) = (shape.collective, shape.bytes);
    let ready = comm::state_keyval(rt) != rt.h.keyval_invalid;
    let mut held = None;
    let slot = &mut held;
    let lookup = move || {
        let slot: &mut Option<Held<'_>> = slot;
        if let Some(reason) = invalid() {
            return Err(to_pmpi(coll, reason, bytes));
        }
        let (call_type, call_op) = typed;
        let adapter = PmpiComm::new(rt, comm, shape.comm_size, call_type, call_op)
            .map_err(|_| to_pmpi(coll, Reason::InvalidArgs, bytes))?;
        let state = comm::state(rt, comm).map_err(|rc| {
            let why = format!("MPI_Comm_get_attr/set_attr returned {rc}");
            stats::record_fast(coll, bytes);
            error(rt, comm, &why)
        })?;
        let held = slot.insert(Held {
            adapter,
            state,
            st: state.lock(),
        });
        if let RingState::Ready(ring) = &mut held.st.ring {
            ring.release_region_if_taken_over();
        }
        let available = match &held.st.ring {
            RingState::Unavailable => false,
            // Ranks share hosts: only what the node path carries (no
            // trials for the rest).
            RingState::Node(_) | RingState::SharedHosts(_) => {
                Node::carries(shape.collective, shape.elem, shape.op, shape.bytes)
            }
            RingState::NotYet | RingState::Ready(_) => true,
        };
        Ok(available.then_some(&held.st.tuner))
    };
    let route = match select::decide(shape, cfg, ready, lookup) {
        Ok(route) => route,
        Err(outcome) => return outcome,
    };
    if let Route::Pmpi(reason) = route {
        return to_pmpi(coll, reason, bytes);
    }
    // decide answers with a trial or the fast path only after the lookup.
    let Some(h) = held.as_mut() else {
        return to_pmpi(coll, Reason::DatapathUnavailable, bytes);
    };
    let (adapter, state, st) = (&h.adapter, h.state, &mut *h.st);
    match route {
        Route::Pmpi(reason) => to_pmpi(coll, reason, bytes),
        Route::MpiTrial(class) => {
            stats::record(coll, route, bytes);
            Outcome::Trial(Trial {
                state,
                class,
                comm,
                comm_size: adapter.size(),
                t0: Instant::now(),
            })
        }
        Route::Fast(call) => match call.measure {
            Measure::Fixed => fast(rt, adapter, state, st, call, run),
            Measure::Settled(class) => {
                // For the ERAR_STATS summary: this call against MPI's time
                // for its class, as the trials measured it.
                let mpi_us = st.tuner.mpi_estimate_us(class, adapter.size());
                let t0 = Instant::now();
                let outcome = fast(rt, adapter, state, st, call, run);
                if let (Some(mpi_us), Outcome::Done) = (mpi_us, &outcome) {
                    stats::record_saved(mpi_us, t0.elapsed());
                }
                outcome
            }
            Measure::Trial(class) => {
                let t0 = Instant::now();
                let outcome = fast(rt, adapter, state, st, call, run);
                if !matches!(outcome, Outcome::Error(_)) {
                    trials::sample(adapter, &mut st.tuner, class, Path::Fast, t0);
                }
                outcome
            }
        },
    }
}

/// The fast route: set up the communicator's ring if it has none, run `op`
/// on it.
unsafe fn fast<F>(
    rt: &Runtime,
    adapter: &PmpiComm<'_>,
    state: &Mutex<CommState>,
    st: &mut CommState,
    call: FastCall,
    op: F,
) -> Outcome
where
    F: FnOnce(Carrier<'_>, &PmpiComm<'_>, FastCall) -> Result<(), DatapathError>,
{
    let (coll, bytes) = (call.collective(), call.bytes);
    if matches!(st.ring, RingState::NotYet | RingState::SharedHosts(_)) {
        let known = match std::mem::replace(&mut st.ring, RingState::NotYet) {
            RingState::SharedHosts(host_of) => Some(host_of),
            _ => None,
        };
        match establish(rt, adapter, known, node_carries(call)) {
            Ok(ready) => {
                if matches!(ready, RingState::Ready(_) | RingState::Node(_)) {
                    comm::register_ring(adapter.comm(), state);
                }
                st.ring = ready;
            }
            Err(None) => {
                // Declined: this call tried the fast path and handed it back.
                st.ring = RingState::Unavailable;
                return to_pmpi(coll, Reason::FastPathDeclined, bytes);
            }
            Err(Some(outcome)) => {
                stats::record(coll, Route::Fast(call), bytes);
                return outcome;
            }
        }
    }
    let carrier = match &mut st.ring {
        RingState::Ready(ring) => Carrier::Ring(ring),
        RingState::Node(node) => Carrier::Node(node),
        RingState::NotYet | RingState::Unavailable | RingState::SharedHosts(_) => {
            return to_pmpi(coll, Reason::DatapathUnavailable, bytes)
        }
    };
    // A panic in the datapath becomes an MPI error on this communicator
    // rather than an abort of the whole process from inside an extern "C"
    // function.
    trace::mark(Mark::Call);
    let ran = catch_unwind(AssertUnwindSafe(|| op(carrier, adapter, call)));
    trace::mark(Mark::End);
    match ran {
        Ok(Ok(())) => {
            stats::record(coll, Route::Fast(call), bytes);
            log::debug!("liberar: {coll:?} {bytes} B -> fast");
            Outcome::Done
        }
        Ok(Err(DatapathError::Declined(why))) => {
            log::debug!("liberar: {coll:?} {bytes} B: fast path declined: {why}");
            to_pmpi(coll, Reason::FastPathDeclined, bytes)
        }
        Ok(Err(DatapathError::Failed(why))) => {
            // Counted as fast: the call was routed there; the error is the
            // outcome.
            stats::record(coll, Route::Fast(call), bytes);
            error(rt, adapter.comm(), &why)
        }
        Err(_) => {
            stats::record(coll, Route::Fast(call), bytes);
            error(rt, adapter.comm(), "the datapath panicked")
        }
    }
}

/// What carries a communicator's fast calls: its ring (one rank per host),
/// or its hosts' shared memory and slice rings (ranks share hosts).
pub enum Carrier<'r> {
    Ring(&'r mut Ring),
    Node(&'r mut NodeRing),
}

impl Carrier<'_> {
    fn allreduce(
        self,
        c: &PmpiComm<'_>,
        send: Option<&[u8]>,
        recv: &mut [u8],
        how: Reduction,
    ) -> Done {
        match self {
            Carrier::Ring(ring) => ring.allreduce(c, send, recv, how),
            Carrier::Node(node) => node.allreduce(c, send, recv, how),
        }
    }

    fn bcast(self, c: &PmpiComm<'_>, buf: &mut [u8], root: usize) -> Done {
        match self {
            Carrier::Ring(ring) => ring.bcast(c, buf, root),
            Carrier::Node(node) => node.bcast(c, buf, root),
        }
    }
}

/// Whether the node path would carry `call` (see `Node::carries`).
fn node_carries(call: FastCall) -> bool {
    match call.op {
        FastOp::Allreduce { elem, op } => {
            Node::carries(Collective::Allreduce, Some(elem), Some(op), call.bytes)
        }
        FastOp::Bcast => Node::carries(Collective::Bcast, None, None, call.bytes),
    }
}

/// First call on a communicator that takes the fast path: find where its
/// ranks are (unless `known`: the host of each rank, found by an earlier
/// call), and set up its ring (one rank per host) or, if `for_node` (the
/// call is one the node path carries), its node path (ranks share hosts;
/// at least two hosts), collectively, with the same verdict on every
/// rank. Ranks that share hosts with a call the node path does not carry
/// give `SharedHosts`: nothing attached yet. `Err(None)` when declined,
/// `Err(Some(error))` when it failed.
unsafe fn establish(
    rt: &Runtime,
    adapter: &PmpiComm<'_>,
    known: Option<Vec<usize>>,
    for_node: bool,
) -> Result<RingState, Option<Outcome>> {
    let comm = adapter.comm();
    let setup = || -> Result<RingState, DatapathError> {
        let host_of = match known {
            Some(host_of) => host_of,
            None => {
                let hosts = Hosts::discover(adapter)?;
                if hosts.count() == adapter.size() {
                    let ring = Ring::establish_on(adapter, hosts)?;
                    return Ok(RingState::Ready(Box::new(ring)));
                }
                hosts.host_of
            }
        };
        if host_of.iter().all(|h| *h == 0) {
            Err(DatapathError::Declined("every rank is on one host".into()))
        } else if for_node {
            let node = NodeRing::establish(adapter, host_of)?;
            Ok(RingState::Node(Box::new(node)))
        } else {
            Ok(RingState::SharedHosts(host_of))
        }
    };
    match catch_unwind(AssertUnwindSafe(setup)) {
        Ok(Ok(ready)) => Ok(ready),
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
