//! The `liberar::datapath::Comm` adapter: the caller's communicator (or a
//! sub-communicator of it) as the datapath talks to the other ranks,
//! through PMPI only.

use crate::ffi::{MPI_Comm, MPI_Datatype, MPI_Op, MPI_Request, MPI_SUCCESS};
use crate::rt::{self, Runtime};
use liberar::datapath::{Comm, DatapathError, Done, Reduction};
use liberar::select::{ElemType, ReduceOp};
use liberar::stats;
use std::cell::Cell;
use std::os::raw::c_int;
use std::time::Instant;

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
    /// See [`Comm::set_deadline`].
    deadline: Cell<Option<Instant>>,
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
            deadline: Cell::new(None),
        })
    }

    pub fn comm(&self) -> MPI_Comm {
        self.comm
    }

    /// The same call's adapter on `comm`, where this rank is `rank` of
    /// `size` (a sub-communicator whose rank the caller knows).
    pub fn on(&self, comm: MPI_Comm, rank: usize, size: usize) -> PmpiComm<'a> {
        PmpiComm {
            rt: self.rt,
            comm,
            rank,
            size,
            call_type: self.call_type,
            call_op: self.call_op,
            deadline: Cell::new(None),
        }
    }

    pub fn runtime(&self) -> &'a Runtime {
        self.rt
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

impl PmpiComm<'_> {
    /// Runs a collective: blocking as `blocking` does without a deadline;
    /// with one, started as `start` (its nonblocking twin) and tested until
    /// it completes or the deadline passes. A request left behind at the
    /// deadline is never freed: the communicator is broken then, and the
    /// error goes to its handler (fatal by default).
    fn collective(
        &self,
        what: &str,
        blocking: impl FnOnce() -> c_int,
        start: impl FnOnce(*mut MPI_Request) -> c_int,
    ) -> Result<(), DatapathError> {
        match self.deadline.get() {
            None => check(what, blocking()),
            Some(deadline) => self.tested(what, start, &mut |now| {
                within_deadline(what, Some(deadline), now)
            }),
        }
    }

    /// `allreduce_max_i32`, watched by `watch` while it waits (see
    /// [`Comm::allreduce_max_i32_watched`]) or not.
    fn max_i32(
        &self,
        buf: &mut [i32],
        watch: Option<&mut dyn FnMut() -> Result<(), DatapathError>>,
    ) -> Result<(), DatapathError> {
        const WHAT: &str = "MPI_Allreduce(MAX)";
        stats::record_exchange();
        let n = count_of(buf.len(), "allreduce_max_i32")?;
        let (in_place, dt, max, comm) = (
            self.rt.h.in_place.cast_const(),
            self.rt.elem_handle(ElemType::I32),
            self.rt.h.op_max,
            self.comm,
        );
        let dst = buf.as_mut_ptr().cast();
        // SAFETY (all): `buf` holds n i32, which is C int on every target
        // MPI runs on.
        let start =
            |req| unsafe { rt::pmpi().PMPI_Iallreduce(in_place, dst, n, dt, max, comm, req) };
        match watch {
            None => self.collective(
                WHAT,
                || unsafe { rt::pmpi().PMPI_Allreduce(in_place, dst, n, dt, max, comm) },
                start,
            ),
            Some(watch) => {
                let deadline = self.deadline.get();
                self.tested(WHAT, start, &mut |now| {
                    within_deadline(WHAT, deadline, now)?;
                    watch()
                })
            }
        }
    }

    /// Starts a nonblocking collective and tests it until it completes,
    /// calling `watch` between tests; `watch`'s error abandons it. A request
    /// left behind is never freed: the communicator is broken then, and the
    /// error goes to its handler (fatal by default).
    fn tested(
        &self,
        what: &str,
        start: impl FnOnce(*mut MPI_Request) -> c_int,
        watch: &mut dyn FnMut(Instant) -> Result<(), DatapathError>,
    ) -> Result<(), DatapathError> {
        // SAFETY: a handle (pointer or int); the start call overwrites it.
        let mut req: MPI_Request = unsafe { std::mem::zeroed() };
        check(what, start(&mut req))?;
        let mut spins = 0u32;
        loop {
            let mut flag: c_int = 0;
            // SAFETY: req came from a nonblocking start; status ignored
            // (MPI_STATUS_IGNORE: MPICH rejects a null status).
            let status_ignore = self.rt.h.status_ignore;
            let rc = unsafe { rt::pmpi().PMPI_Test(&mut req, &mut flag, status_ignore) };
            check(what, rc)?;
            if flag != 0 {
                return Ok(());
            }
            watch(Instant::now())?;
            spins += 1;
            if spins > 1000 {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }
}

/// Err once `now` is past the call's deadline (if it has one).
fn within_deadline(
    what: &str,
    deadline: Option<Instant>,
    now: Instant,
) -> Result<(), DatapathError> {
    if deadline.is_some_and(|d| now >= d) {
        return Err(DatapathError::Failed(format!(
            "{what}: no answer from every rank within ERAR_TIMEOUT_MS (a peer died or its \
             link is down)"
        )));
    }
    Ok(())
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
        stats::record_exchange();
        if Some(all.len()) != mine.len().checked_mul(self.size) {
            return Err(DatapathError::Failed(format!(
                "allgather: {} bytes for {} ranks of {}",
                all.len(),
                self.size,
                mine.len()
            )));
        }
        let n = count_of(mine.len(), "allgather")?;
        let (byte, comm) = (self.rt.h.dt_byte, self.comm);
        let (src, dst) = (mine.as_ptr().cast(), all.as_mut_ptr().cast());
        // SAFETY (both): buffers sized as checked above, alive until the
        // request completes (or forever: see collective()); MPI_BYTE moves
        // them as they are.
        self.collective(
            "MPI_Allgather",
            || unsafe { rt::pmpi().PMPI_Allgather(src, n, byte, dst, n, byte, comm) },
            |req| unsafe { rt::pmpi().PMPI_Iallgather(src, n, byte, dst, n, byte, comm, req) },
        )
    }

    fn allreduce_max_i32(&self, buf: &mut [i32]) -> Result<(), DatapathError> {
        self.max_i32(buf, None)
    }

    fn progress(&self) {
        let mut flag: c_int = 0;
        // SAFETY: a probe of any message on this communicator: it drives
        // MPI's progress engine and receives nothing; the status is
        // ignored (MPI_STATUS_IGNORE, which MPICH needs non-null).
        unsafe {
            rt::pmpi().PMPI_Iprobe(
                self.rt.h.any_source,
                self.rt.h.any_tag,
                self.comm,
                &mut flag,
                self.rt.h.status_ignore,
            )
        };
    }

    fn allreduce_max_i32_watched(
        &self,
        buf: &mut [i32],
        watch: &mut dyn FnMut() -> Result<(), DatapathError>,
    ) -> Result<(), DatapathError> {
        self.max_i32(buf, Some(watch))
    }

    fn pmpi_allreduce(&self, send: Option<&[u8]>, recv: &mut [u8], how: Reduction) -> Done {
        let (elem, op) = how;
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

    fn set_deadline(&self, deadline: Option<Instant>) {
        self.deadline.set(deadline);
    }
}
