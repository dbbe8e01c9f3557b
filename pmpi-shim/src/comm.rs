//! Per-communicator datapath state, kept in an MPI attribute so that it lives
//! and dies with the communicator, and the `liberar::datapath::Comm` adapter
//! the datapath uses to talk to the other ranks.

use crate::ffi::{MPI_Comm, MPI_Datatype, MPI_Op, Pmpi, SendComm, MPI_SUCCESS};
use crate::rt::{self, Runtime};
use liberar::datapath::ring::Ring;
use liberar::datapath::{Comm, DatapathError};
use liberar::select::{ElemType, ReduceOp};
use parking_lot::Mutex;
use std::os::raw::{c_int, c_void};
use std::ptr;

/// What a communicator's attribute holds. Only `Ring::establish` (collective,
/// same verdict on every rank) creates one, so every rank holds the same
/// variant and later routing stays identical across ranks.
pub enum CommState {
    /// `Ring::establish` declined: later calls on this communicator go to
    /// PMPI without asking again.
    Unavailable,
    /// `None` once the finalize hook tore the ring down.
    Ring(Mutex<Option<Ring>>),
}

/// Communicators holding a ring, so the finalize hook can tear down those
/// the program never freed (MPI_COMM_WORLD, leaks). Entries leave when the
/// attribute is deleted, so no freed handle is ever used. Touched only at
/// ring setup, communicator free and finalize: never per call.
static RINGS: Mutex<Vec<(SendComm, usize)>> = Mutex::new(Vec::new());

pub fn create_state_keyval(p: &Pmpi, invalid: c_int) -> c_int {
    let mut keyval = invalid;
    // SAFETY: MPI is initialized; the callbacks match mpi.h's typedefs.
    let rc = unsafe {
        p.PMPI_Comm_create_keyval(
            // A duplicate gets its own ring (its own context) on first use.
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

unsafe extern "C" fn delete_state(
    _comm: MPI_Comm,
    _keyval: c_int,
    val: *mut c_void,
    _extra: *mut c_void,
) -> c_int {
    if !val.is_null() {
        let addr = val as usize;
        RINGS.lock().retain(|(_, a)| *a != addr);
        // SAFETY: every value under this keyval came from Box::into_raw in
        // `set_state`, and MPI calls the delete callback once per value.
        drop(Box::from_raw(val.cast::<CommState>()));
    }
    MPI_SUCCESS
}

/// The communicator's state, `Ok(None)` if it has none yet. The reference is
/// valid for the current call: a communicator cannot be freed while a
/// collective runs on it.
pub unsafe fn get_state<'a>(rt: &Runtime, comm: MPI_Comm) -> Result<Option<&'a CommState>, c_int> {
    let mut val: *mut c_void = ptr::null_mut();
    let mut flag: c_int = 0;
    let rc = rt::pmpi().PMPI_Comm_get_attr(
        comm,
        rt.state_keyval,
        (&mut val as *mut *mut c_void).cast(),
        &mut flag,
    );
    if rc != MPI_SUCCESS {
        return Err(rc);
    }
    if flag == 0 || val.is_null() {
        return Ok(None);
    }
    Ok(Some(&*val.cast::<CommState>()))
}

pub unsafe fn set_state<'a>(
    rt: &Runtime,
    comm: MPI_Comm,
    state: CommState,
) -> Result<&'a CommState, c_int> {
    let has_ring = matches!(state, CommState::Ring(_));
    let raw = Box::into_raw(Box::new(state));
    let rc = rt::pmpi().PMPI_Comm_set_attr(comm, rt.state_keyval, raw.cast());
    if rc != MPI_SUCCESS {
        drop(Box::from_raw(raw));
        return Err(rc);
    }
    if has_ring {
        RINGS.lock().push((SendComm(comm), raw as usize));
    }
    Ok(&*raw)
}

/// Drops every ring still alive, from the finalize hook (MPI fully usable).
pub fn drop_all_rings(rt: &Runtime) {
    // Taken out first: deleting the attribute re-enters `delete_state`,
    // which locks RINGS.
    let rings = std::mem::take(&mut *RINGS.lock());
    for (comm, _) in rings {
        // SAFETY: the communicator is alive (freed ones left RINGS).
        let rc = unsafe { rt::pmpi().PMPI_Comm_delete_attr(comm.0, rt.state_keyval) };
        if rc != MPI_SUCCESS {
            log::debug!("liberar: MPI_Comm_delete_attr at finalize returned {rc}");
        }
    }
}

/// The caller's communicator, spoken to through PMPI only (MPI_ would re-enter
/// the shim).
pub struct PmpiComm<'a> {
    rt: &'a Runtime,
    comm: MPI_Comm,
    rank: usize,
    size: usize,
    /// The call's own datatype and op, so that a range the datapath hands
    /// back is reduced exactly as MPI would have reduced the whole call.
    call_type: Option<(ElemType, MPI_Datatype)>,
    call_op: Option<(ReduceOp, MPI_Op)>,
}

impl<'a> PmpiComm<'a> {
    pub unsafe fn new(
        rt: &'a Runtime,
        comm: MPI_Comm,
        size: usize,
        call_type: Option<(ElemType, MPI_Datatype)>,
        call_op: Option<(ReduceOp, MPI_Op)>,
    ) -> Result<Self, c_int> {
        let mut rank: c_int = 0;
        let rc = rt::pmpi().PMPI_Comm_rank(comm, &mut rank);
        if rc != MPI_SUCCESS {
            return Err(rc);
        }
        Ok(PmpiComm {
            rt,
            comm,
            rank: rank.max(0) as usize,
            size,
            call_type,
            call_op,
        })
    }

    pub fn comm(&self) -> MPI_Comm {
        self.comm
    }
}

fn check(what: &str, rc: c_int) -> Result<(), DatapathError> {
    if rc == MPI_SUCCESS {
        Ok(())
    } else {
        Err(DatapathError::Failed(format!(
            "{what} returned MPI error {rc}"
        )))
    }
}

fn count_of(len: usize, what: &str) -> Result<c_int, DatapathError> {
    c_int::try_from(len)
        .map_err(|_| DatapathError::Failed(format!("{what}: {len} elements exceed an MPI count")))
}

impl Comm for PmpiComm<'_> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn allgather(&self, mine: &[u8], all: &mut [u8]) -> Result<(), DatapathError> {
        if Some(all.len()) != mine.len().checked_mul(self.size) {
            return Err(DatapathError::Failed(format!(
                "allgather: {} bytes for {} ranks of {}",
                all.len(),
                self.size,
                mine.len()
            )));
        }
        let n = count_of(mine.len(), "allgather")?;
        // SAFETY: buffers sized as checked above; MPI_BYTE moves them as is.
        let rc = unsafe {
            rt::pmpi().PMPI_Allgather(
                mine.as_ptr().cast(),
                n,
                self.rt.h.dt_byte,
                all.as_mut_ptr().cast(),
                n,
                self.rt.h.dt_byte,
                self.comm,
            )
        };
        check("MPI_Allgather", rc)
    }

    fn allreduce_max_i32(&self, buf: &mut [i32]) -> Result<(), DatapathError> {
        let n = count_of(buf.len(), "allreduce_max_i32")?;
        // SAFETY: `buf` holds n i32, which is C int on every target MPI runs on.
        let rc = unsafe {
            rt::pmpi().PMPI_Allreduce(
                self.rt.h.in_place,
                buf.as_mut_ptr().cast(),
                n,
                self.rt.elem_handle(ElemType::I32),
                self.rt.h.op_max,
                self.comm,
            )
        };
        check("MPI_Allreduce(MAX)", rc)
    }

    fn barrier(&self) -> Result<(), DatapathError> {
        // SAFETY: a live communicator.
        check("MPI_Barrier", unsafe { rt::pmpi().PMPI_Barrier(self.comm) })
    }

    fn pmpi_allreduce(
        &self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        elem: ElemType,
        op: ReduceOp,
    ) -> Result<(), DatapathError> {
        let whole_elems = recv.len() / elem.size() * elem.size() == recv.len();
        if !whole_elems || send.is_some_and(|s| s.len() != recv.len()) {
            return Err(DatapathError::Failed(format!(
                "pmpi_allreduce: {} bytes of {elem:?} (send {:?})",
                recv.len(),
                send.map(<[u8]>::len)
            )));
        }
        let n = count_of(recv.len() / elem.size(), "pmpi_allreduce")?;
        let dt = match self.call_type {
            Some((e, h)) if e == elem => h,
            _ => self.rt.elem_handle(elem),
        };
        let mpi_op = match self.call_op {
            Some((o, h)) if o == op => h,
            _ => self.rt.op_handle(op),
        };
        let sendbuf = match send {
            Some(s) => s.as_ptr().cast(),
            None => self.rt.h.in_place.cast_const(),
        };
        // SAFETY: lengths checked above; the handles are predefined.
        let rc = unsafe {
            rt::pmpi().PMPI_Allreduce(sendbuf, recv.as_mut_ptr().cast(), n, dt, mpi_op, self.comm)
        };
        check("MPI_Allreduce", rc)
    }

    fn pmpi_bcast(&self, buf: &mut [u8], root: usize) -> Result<(), DatapathError> {
        let n = count_of(buf.len(), "pmpi_bcast")?;
        let root = c_int::try_from(root)
            .map_err(|_| DatapathError::Failed(format!("pmpi_bcast: root {root}")))?;
        // SAFETY: `buf` is `n` bytes; MPI_BYTE moves them as they are, which
        // is what the fast path promised for this dense call.
        let rc = unsafe {
            rt::pmpi().PMPI_Bcast(
                buf.as_mut_ptr().cast(),
                n,
                self.rt.h.dt_byte,
                root,
                self.comm,
            )
        };
        check("MPI_Bcast", rc)
    }
}
