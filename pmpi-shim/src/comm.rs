//! Per-communicator state (which path each class of call takes, and the
//! ring or node path), kept in an MPI attribute so that it lives and dies
//! with the communicator.

use crate::ffi::{MPI_Comm, Pmpi, SendComm, MPI_SUCCESS};
use crate::node::NodeRing;
use crate::pmpi_comm::PmpiComm;
use crate::rt::{self, Runtime};
use liberar::datapath::ring::Ring;
use liberar::datapath::DatapathError;
use liberar::select::Tuner;
use once_cell::sync::OnceCell;
use parking_lot::Mutex;
use std::os::raw::{c_int, c_void};
use std::ptr;

/// What a communicator's attribute holds. Its first eligible call creates it
/// (the same call on every rank), and only collective steps change it, so
/// every rank holds the same state and routes later calls the same way.
pub struct CommState {
    /// Which path each class of call takes here, by measurement.
    pub tuner: Tuner,
    pub ring: RingState,
}

pub enum RingState {
    /// No call has taken the fast path on this communicator yet: nothing
    /// was attached on its behalf.
    NotYet,
    /// `Ring::establish` declined (the same verdict on every rank): every
    /// later call goes to PMPI without asking again.
    Unavailable,
    Ready(Box<Ring>),
    /// Ranks share hosts (the host of each rank), and no call the node path
    /// carries has come yet: nothing is attached (a job whose calls all go
    /// to MPI here, float reductions, keeps MPI's network as it was).
    SharedHosts(Vec<usize>),
    /// Ranks share hosts: shared memory on each host and a ring per slice.
    Node(Box<NodeRing>),
}

/// Communicators holding a ring, so the finalize hook can tear down those
/// the program never freed (MPI_COMM_WORLD, leaks). Entries leave when the
/// attribute is deleted, so no freed handle is ever used. Touched only at
/// ring setup, communicator free and finalize: never per call.
static RINGS: Mutex<Vec<(SendComm, usize)>> = Mutex::new(Vec::new());

/// Keyval of the per-communicator state, made at the first call that needs
/// it (`keyval_invalid` if MPI refused one: the fast path is then off).
/// Making it registers the rings' teardown with the runtime's finalize
/// hook ([`drop_all_rings`]).
static STATE_KEYVAL: OnceCell<c_int> = OnceCell::new();

/// See [`STATE_KEYVAL`].
pub fn state_keyval(rt: &Runtime) -> c_int {
    *STATE_KEYVAL.get_or_init(|| {
        rt::at_finalize(drop_all_rings);
        create_state_keyval(rt::pmpi(), rt.h.keyval_invalid)
    })
}

fn create_state_keyval(p: &Pmpi, invalid: c_int) -> c_int {
    let mut keyval = invalid;
    // SAFETY: MPI is initialized; the callbacks match mpi.h's typedefs.
    let rc = unsafe {
        p.PMPI_Comm_create_keyval(
            // A duplicate gets its own state (its own trials, its own ring).
            Some(rt::no_copy),
            Some(delete_state),
            &mut keyval,
            ptr::null_mut(),
        )
    };
    if rc != MPI_SUCCESS {
        log::warn!("liberar: MPI_Comm_create_keyval returned {rc}; fast path off");
        return invalid;
    }
    keyval
}

/// Called by MPI when the communicator is freed (collectively, by every
/// rank) or, for those still alive at finalize, by [`drop_all_rings`]: the
/// ring closes with a barrier over the communicator, which is still usable
/// here (MPI deletes attributes before it frees anything), so that no host
/// stops answering NACKs another still needs (see [`Ring::close`]).
unsafe extern "C" fn delete_state(
    comm: MPI_Comm,
    _keyval: c_int,
    val: *mut c_void,
    _extra: *mut c_void,
) -> c_int {
    if !val.is_null() {
        let addr = val as usize;
        RINGS.lock().retain(|(_, a)| *a != addr);
        // SAFETY: every value under this keyval came from Box::into_raw in
        // `state`, and MPI calls the delete callback once per value.
        let state = Box::from_raw(val.cast::<Mutex<CommState>>()).into_inner();
        match state.ring {
            RingState::Ready(ring) => close_ring(*ring, comm),
            RingState::Node(node) => close_node(*node, comm),
            RingState::NotYet | RingState::Unavailable | RingState::SharedHosts(_) => {}
        }
    }
    MPI_SUCCESS
}

/// [`Ring::close`] on `comm`; a failure is only logged: the slots are
/// given back either way, and a peer that still needed them ends its call
/// with an error.
unsafe fn close_ring(ring: Ring, comm: MPI_Comm) {
    close_on(comm, "a ring", |_, adapter| ring.close(adapter));
}

/// [`NodeRing::close`] on `comm`, as [`close_ring`].
unsafe fn close_node(node: NodeRing, comm: MPI_Comm) {
    close_on(comm, "a node path", |rt, adapter| node.close(rt, adapter));
}

/// Runs `close` with `comm`'s adapter (MPI still fully usable: attribute
/// deletion or the finalize hook); its failure is only logged.
unsafe fn close_on(
    comm: MPI_Comm,
    what: &str,
    close: impl FnOnce(&Runtime, &PmpiComm<'_>) -> Result<(), DatapathError>,
) {
    let closed = match rt::created() {
        Some(rt) => {
            let mut size: c_int = 0;
            let rc = rt::pmpi().PMPI_Comm_size(comm, &mut size);
            match PmpiComm::new(rt, comm, size.max(0) as usize, None, None) {
                Ok(adapter) if rc == MPI_SUCCESS => close(rt, &adapter),
                _ => Err(DatapathError::Failed("no rank or size".into())),
            }
        }
        None => Err(DatapathError::Failed("no runtime".into())),
    };
    if let Err(e) = closed {
        log::debug!("liberar: closing {what}: {e}");
    }
}

/// The communicator's state, created on first use. The reference is valid
/// for the current call: a communicator cannot be freed while a collective
/// runs on it.
pub unsafe fn state<'a>(rt: &Runtime, comm: MPI_Comm) -> Result<&'a Mutex<CommState>, c_int> {
    let p = rt::pmpi();
    let mut val: *mut c_void = ptr::null_mut();
    let mut flag: c_int = 0;
    let rc = p.PMPI_Comm_get_attr(
        comm,
        state_keyval(rt),
        (&mut val as *mut *mut c_void).cast(),
        &mut flag,
    );
    if rc != MPI_SUCCESS {
        return Err(rc);
    }
    if flag != 0 && !val.is_null() {
        return Ok(&*val.cast::<Mutex<CommState>>());
    }
    let raw = Box::into_raw(Box::new(Mutex::new(CommState {
        tuner: Tuner::new(),
        ring: RingState::NotYet,
    })));
    let rc = p.PMPI_Comm_set_attr(comm, state_keyval(rt), raw.cast());
    if rc != MPI_SUCCESS {
        drop(Box::from_raw(raw));
        return Err(rc);
    }
    Ok(&*raw)
}

/// Remembers that `state` (the attribute of `comm`) now holds a ring.
pub fn register_ring(comm: MPI_Comm, state: &Mutex<CommState>) {
    RINGS
        .lock()
        .push((SendComm(comm), state as *const Mutex<CommState> as usize));
}

/// Drops every ring still alive, from the finalize hook (MPI fully usable).
pub fn drop_all_rings(rt: &Runtime) {
    // Taken out first: deleting the attribute re-enters `delete_state`,
    // which locks RINGS.
    let rings = std::mem::take(&mut *RINGS.lock());
    for (comm, _) in rings {
        // SAFETY: the communicator is alive (freed ones left RINGS).
        let rc = unsafe { rt::pmpi().PMPI_Comm_delete_attr(comm.0, state_keyval(rt)) };
        if rc != MPI_SUCCESS {
            log::debug!("liberar: MPI_Comm_delete_attr at finalize returned {rc}");
        }
    }
}
