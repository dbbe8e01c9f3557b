//! Open MPI's Fortran bindings (mpif.h and `use mpi`, in every spelling a
//! Fortran compiler may produce, and `use mpi_f08`).
//!
//! Open MPI's own Fortran wrappers call PMPI_ directly, so without these the
//! shim would never see a Fortran caller. A call that goes to PMPI is handed
//! to the MPI's own Fortran symbol (the next definition after ours), which
//! keeps Open MPI's handling of MPI_IN_PLACE, MPI_BOTTOM, handle conversion
//! and ierror exactly. Only the fast path converts arguments itself.
//!
//! `use mpi_f08` calls Open MPI's internals (`ompi_allreduce_f`), not
//! these symbols, so its entry points are intercepted by their own names
//! (`mpi_allreduce_f08_`, ...). Open MPI 4.x builds them with "ignore TKR"
//! buffers (addresses, as above), its TYPE(MPI_Comm) and friends hold one
//! INTEGER (passed by reference: the same as the Fortran handle), and
//! `ierror` is OPTIONAL (null when left out): the same arguments as the
//! `use mpi` symbols. (Open MPI 5's `_f08ts_` variants pass descriptors and
//! are not intercepted.)

use crate::collective::{self, AllreduceArgs, BcastArgs, Outcome};
use crate::ffi::{erar_fint as Fint, MPI_Comm, MPI_Datatype, MPI_SUCCESS};
use crate::rt::{self, pmpi, Runtime};
use liberar::select::Collective;
use liberar::stats;
use once_cell::sync::OnceCell;
use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

/// The MPI's definition of one of our Fortran symbols, found on first use.
pub struct NextSym {
    name: &'static CStr,
    addr: AtomicPtr<c_void>,
}

impl NextSym {
    pub const fn new(name: &'static CStr) -> Self {
        NextSym {
            name,
            addr: AtomicPtr::new(ptr::null_mut()),
        }
    }

    fn get(&self) -> *mut c_void {
        let p = self.addr.load(Ordering::Acquire);
        if !p.is_null() {
            return p;
        }
        // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT looks past this
        // library, where the MPI's Fortran library defines the same name.
        let p = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr()) };
        if p.is_null() {
            rt::fatal(&format!(
                "{} was called but the MPI library does not define it",
                self.name.to_string_lossy()
            ));
        }
        self.addr.store(p, Ordering::Release);
        p
    }
}

/// Addresses Open MPI gives Fortran's MPI_IN_PLACE and MPI_BOTTOM (common
/// blocks, one per name-mangling convention). Zero where absent.
struct FortranConstants {
    in_place: [usize; 4],
    bottom: [usize; 4],
}

fn constants() -> &'static FortranConstants {
    static C: OnceCell<FortranConstants> = OnceCell::new();
    C.get_or_init(|| {
        let lib = rt::loaded().lib;
        let look = |names: [&CStr; 4]| {
            // SAFETY: dlsym on the live handle the PMPI table came from.
            names.map(|n| unsafe { libc::dlsym(lib, n.as_ptr()) } as usize)
        };
        FortranConstants {
            in_place: look([
                c"mpi_fortran_in_place_",
                c"mpi_fortran_in_place",
                c"mpi_fortran_in_place__",
                c"MPI_FORTRAN_IN_PLACE",
            ]),
            bottom: look([
                c"mpi_fortran_bottom_",
                c"mpi_fortran_bottom",
                c"mpi_fortran_bottom__",
                c"MPI_FORTRAN_BOTTOM",
            ]),
        }
    })
}

fn is_one_of(p: *const c_void, addrs: &[usize; 4]) -> bool {
    let p = p as usize;
    p != 0 && addrs.contains(&p)
}

/// A Fortran buffer argument as the C API spells it, for routing: the
/// common blocks' addresses become C's MPI_IN_PLACE (`c_in_place`) and
/// MPI_BOTTOM. MPI_IN_PLACE where the call does not allow it (a receive
/// buffer, a broadcast buffer) becomes C's MPI_IN_PLACE too, so the shim's
/// prologue sends the call to MPI (which gets the caller's own arguments and
/// does what its wrapper does) instead of the fast path moving a whole
/// message into the one-integer common block.
fn c_buffer(p: *const c_void, c_in_place: *mut c_void) -> *const c_void {
    let k = constants();
    if is_one_of(p, &k.in_place) {
        c_in_place.cast_const()
    } else if is_one_of(p, &k.bottom) {
        ptr::null() // C MPI_BOTTOM in both ABIs
    } else {
        p
    }
}

unsafe fn set_ierr(ierr: *mut Fint, code: Fint) {
    if !ierr.is_null() {
        *ierr = code;
    }
}

/// What the MPI's own Fortran wrapper left in `ierr` (success if the
/// caller passed none).
unsafe fn read_ierr(ierr: *const Fint) -> Fint {
    if ierr.is_null() {
        MPI_SUCCESS
    } else {
        *ierr
    }
}

/// What every Fortran collective does around [`collective::intercept`]:
/// counts the call, completes it through the MPI's own Fortran symbol
/// (`mpi`, which leaves its code in `ierr`) when it is not taken, and sets
/// `ierr` to the call's return code.
unsafe fn intercept_fortran(
    coll: Collective,
    ierr: *mut Fint,
    mpi: impl Fn(),
    route: impl FnOnce(&'static Runtime) -> Option<Outcome>,
) {
    stats::record_fortran();
    let rc = collective::intercept(
        coll,
        || {
            mpi();
            read_ierr(ierr)
        },
        route,
    );
    set_ierr(ierr, rc);
}

/// The count, datatype and communicator every Fortran collective passes by
/// reference, in C's terms (`None`: an argument the caller left out, which
/// MPI reports).
unsafe fn c_handles(
    count: *const Fint,
    datatype: *const Fint,
    comm: *const Fint,
) -> Option<(c_int, MPI_Datatype, MPI_Comm)> {
    let (count, datatype, comm) = (count.as_ref()?, datatype.as_ref()?, comm.as_ref()?);
    let p = pmpi();
    Some((*count, p.PMPI_Type_f2c(*datatype), p.PMPI_Comm_f2c(*comm)))
}

/// One exported symbol per spelling, each handing the implementation the
/// MPI's own definition of the same spelling (`mpi`: a call of it with the
/// caller's arguments) and those arguments. Each binding's signature is
/// written once, with its implementation.
macro_rules! bindings {
    ($(#[$doc:meta])* fn $imp:ident $params:tt $body:block => $($name:ident)*) => {
        implementation!($(#[$doc])* $imp $params $body);
        $(binding!($name $imp $params);)*
    };
}

macro_rules! implementation {
    ($(#[$doc:meta])* $imp:ident ($mpi:ident $(, $arg:ident : $ty:ty)*) $body:block) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        unsafe fn $imp($mpi: impl Fn(), $($arg: $ty),*) $body
    };
}

macro_rules! binding {
    ($name:ident $imp:ident ($mpi:ident $(, $arg:ident : $ty:ty)*)) => {
        /// # Safety
        /// As the MPI Fortran binding of the same name.
        #[no_mangle]
        #[allow(non_snake_case)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) {
            static NEXT: NextSym = NextSym::new(
                match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                    Ok(s) => s,
                    Err(_) => panic!("symbol name with a NUL"),
                },
            );
            let mpi = || {
                // SAFETY: NEXT is the next definition of this very symbol,
                // which has this same signature.
                let f: unsafe extern "C" fn($($ty),*) = std::mem::transmute(NEXT.get());
                f($($arg),*)
            };
            $imp(mpi, $($arg),*)
        }
    };
}

bindings! {
    fn allreduce(
        mpi,
        sendbuf: *const c_void,
        recvbuf: *mut c_void,
        count: *const Fint,
        datatype: *const Fint,
        op: *const Fint,
        comm: *const Fint,
        ierr: *mut Fint
    ) {
        intercept_fortran(Collective::Allreduce, ierr, mpi, |rt| {
            let op = op.as_ref()?;
            let (count, datatype, comm) = c_handles(count, datatype, comm)?;
            let args = AllreduceArgs {
                send: c_buffer(sendbuf, rt.h.in_place),
                recv: c_buffer(recvbuf, rt.h.in_place).cast_mut(),
                count,
                datatype,
                op: pmpi().PMPI_Op_f2c(*op),
                comm,
            };
            Some(collective::allreduce(rt, &args))
        })
    } => mpi_allreduce_ mpi_allreduce__ mpi_allreduce MPI_ALLREDUCE mpi_allreduce_f08_
}

bindings! {
    fn bcast(
        mpi,
        buffer: *mut c_void,
        count: *const Fint,
        datatype: *const Fint,
        root: *const Fint,
        comm: *const Fint,
        ierr: *mut Fint
    ) {
        intercept_fortran(Collective::Bcast, ierr, mpi, |rt| {
            let root = *root.as_ref()?;
            let (count, datatype, comm) = c_handles(count, datatype, comm)?;
            let args = BcastArgs {
                buf: c_buffer(buffer, rt.h.in_place).cast_mut(),
                count,
                datatype,
                root,
                comm,
            };
            Some(collective::bcast(rt, &args))
        })
    } => mpi_bcast_ mpi_bcast__ mpi_bcast MPI_BCAST mpi_bcast_f08_
}

bindings! {
    /// The MPI's own MPI_INIT, then the runtime if it succeeded (with no
    /// `ierr` to read, nothing says so).
    fn init(mpi, ierr: *mut Fint) {
        mpi();
        if !ierr.is_null() && *ierr == MPI_SUCCESS {
            rt::after_init();
        }
    } => mpi_init_ mpi_init__ mpi_init MPI_INIT mpi_init_f08_
}

bindings! {
    /// As `init`.
    fn init_thread(mpi, _required: *const Fint, _provided: *mut Fint, ierr: *mut Fint) {
        init(mpi, ierr)
    } => mpi_init_thread_ mpi_init_thread__ mpi_init_thread MPI_INIT_THREAD mpi_init_thread_f08_
}

bindings! {
    fn finalize(mpi, _ierr: *mut Fint) {
        mpi()
    } => mpi_finalize_ mpi_finalize__ mpi_finalize MPI_FINALIZE mpi_finalize_f08_
}
