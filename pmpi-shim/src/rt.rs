//! Process-wide state, all created lazily: the PMPI table, the handle table,
//! the attribute keyvals and the finalize hook. Nothing here runs when the
//! library is loaded, so preloading into a program without MPI is harmless.

use crate::ffi::{
    self, erar_handles, MPI_Comm, MPI_Datatype, MPI_Op, Pmpi, RawHandle, MPI_SUCCESS,
};
use liberar::config::{self, Config};
use liberar::select::{ElemType, ReduceOp};
use liberar::{stats, trace};
use once_cell::sync::OnceCell;
use std::cell::Cell;
use std::ffi::CStr;
use std::io::Write as _;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};

/// The PMPI_ table and the dlopen handle it was found through (kept for the
/// handle table's and the Fortran constants' dlsym lookups).
pub struct Loaded {
    pub pmpi: Pmpi,
    pub lib: *mut c_void,
}
// SAFETY: function pointers and a dlopen handle, immutable once loaded.
unsafe impl Send for Loaded {}
unsafe impl Sync for Loaded {}

static LOADED: OnceCell<Loaded> = OnceCell::new();

/// Where the MPI library may be found. The global scope comes first (the
/// program links libmpi, or dlopened it RTLD_GLOBAL); the sonames cover an
/// MPI dlopened RTLD_LOCAL (RTLD_NOLOAD: never loads a library itself).
#[cfg(not(feature = "mpich"))]
const SONAMES: &[&CStr] = &[c"libmpi.so.40", c"libmpi.so"];
#[cfg(feature = "mpich")]
const SONAMES: &[&CStr] = &[
    c"libmpich.so.12",
    c"libmpi.so.12",
    c"libmpich.so",
    c"libmpi.so",
];

fn load() -> Result<Loaded, String> {
    let mut last = String::from("no MPI library is loaded in this process");
    let candidates = std::iter::once(None).chain(SONAMES.iter().map(|s| Some(*s)));
    for name in candidates {
        // SAFETY: dlopen of the main program or of an already loaded library
        // (RTLD_NOLOAD) runs no initialisers.
        let handle = unsafe {
            match name {
                None => libc::dlopen(ptr::null(), libc::RTLD_LAZY),
                Some(n) => libc::dlopen(n.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD),
            }
        };
        if handle.is_null() {
            continue;
        }
        // SAFETY: `handle` is a live dlopen handle; Library takes ownership.
        let lib = unsafe { libloading::os::unix::Library::from_raw(handle) };
        // SAFETY: the symbol types come from the same mpi.h as the library.
        match unsafe { Pmpi::from_library(lib) } {
            Ok(pmpi) => return Ok(Loaded { pmpi, lib: handle }),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

/// The PMPI_ table. An intercepted MPI_ function was called, so an MPI must
/// be loaded; if its PMPI_ functions cannot be found there is no way to
/// complete the call, and aborting with the reason beats a crash.
pub fn loaded() -> &'static Loaded {
    match LOADED.get_or_try_init(load) {
        Ok(l) => l,
        Err(e) => fatal(&format!(
            "cannot find the MPI library's PMPI_ functions: {e}"
        )),
    }
}

#[inline]
pub fn pmpi() -> &'static Pmpi {
    &loaded().pmpi
}

pub fn fatal(msg: &str) -> ! {
    let _ = writeln!(std::io::stderr(), "liberar: fatal: {msg}");
    std::process::abort()
}

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside an intercepted call: anything MPI calls back
/// into the shim from there (MPI_File_open's internal collectives, an MPI
/// built on its own MPI_ symbols) goes straight to PMPI.
pub struct Guard(());

impl Guard {
    /// `None` when this thread is already inside (or its TLS is being torn
    /// down, where treating the call as re-entrant is the safe choice).
    #[inline]
    pub fn enter() -> Option<Guard> {
        INSIDE
            .try_with(|c| {
                if c.get() {
                    None
                } else {
                    c.set(true);
                    Some(Guard(()))
                }
            })
            .ok()
            .flatten()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = INSIDE.try_with(|c| c.set(false));
    }
}

const MAX_ELEMS: usize = ffi::ERAR_MAX_TYPES as usize;

/// Everything that needs MPI to be initialized.
pub struct Runtime {
    pub h: erar_handles,
    elem_types: [MPI_Datatype; MAX_ELEMS],
    elems: [ElemType; MAX_ELEMS],
    nelems: usize,
    pub thread_multiple: bool,
    /// A private duplicate of MPI_COMM_SELF with MPI_ERRORS_RETURN (null if
    /// it could not be made): local calls that validate the caller's
    /// arguments (e.g. a datatype's commit) run on it, so that a failed check
    /// invokes no error handler of the caller's; the caller's call then goes
    /// to PMPI, which reports the error itself.
    probe_comm: MPI_Comm,
}
// SAFETY: predefined MPI handles and integers, immutable after init.
unsafe impl Send for Runtime {}
unsafe impl Sync for Runtime {}

static RUNTIME: OnceCell<Runtime> = OnceCell::new();
/// What the layer above the runtime tears down at MPI_Finalize, after the
/// stats line, while MPI is still usable: the rings of the communicators
/// the program never freed (`comm.rs` registers it with [`at_finalize`]).
/// The runtime calls up only through this, never by name.
static AT_FINALIZE: OnceCell<fn(&Runtime)> = OnceCell::new();

/// Registers the finalize-time teardown (once; later calls are ignored).
pub fn at_finalize(teardown: fn(&Runtime)) {
    let _ = AT_FINALIZE.set(teardown);
}

/// Set by the finalize hook: from then on every call goes to PMPI untouched.
static FINALIZED: AtomicBool = AtomicBool::new(false);

/// The runtime, created at the first call after MPI is initialized. `None`
/// before MPI_Init or after MPI_Finalize: such calls are erroneous and go to
/// PMPI, which reports them (as the call the program made, not as some
/// call of the shim's).
#[inline]
pub fn runtime() -> Option<&'static Runtime> {
    if FINALIZED.load(Ordering::Relaxed) {
        return None;
    }
    match RUNTIME.get() {
        Some(r) => Some(r),
        None => RUNTIME.get_or_try_init(init).ok(),
    }
}

/// The runtime if it was created, also while the finalize hook tears down
/// (when [`runtime`] already answers `None`): for teardown only.
pub fn created() -> Option<&'static Runtime> {
    RUNTIME.get()
}

/// Called after a successful MPI_Init(_thread), C or Fortran: installs the
/// finalize hook while MPI is certainly usable.
pub fn after_init() {
    let _ = runtime();
}

fn init() -> Result<Runtime, ()> {
    config::init_logging();
    let p = pmpi();
    let (mut inited, mut finalized) = (0, 0);
    // SAFETY: both may be called at any time, even before MPI_Init.
    unsafe {
        p.PMPI_Initialized(&mut inited);
        p.PMPI_Finalized(&mut finalized);
    }
    if inited == 0 || finalized != 0 {
        return Err(());
    }

    let mut h = std::mem::MaybeUninit::<erar_handles>::zeroed();
    // SAFETY: the C filler writes every field; all-zero is a valid start.
    let h = unsafe {
        ffi::erar_fill_handles(h.as_mut_ptr(), loaded().lib);
        h.assume_init()
    };

    let mut rt = Runtime {
        h,
        elem_types: [h.dt_null; MAX_ELEMS],
        elems: [ElemType::U32; MAX_ELEMS],
        nelems: 0,
        thread_multiple: false,
        probe_comm: h.comm_null,
    };
    let n = (h.ntypes.max(0) as usize).min(MAX_ELEMS);
    for i in 0..n {
        let dt = h.types[i];
        let mut size: ffi::MPI_Count = 0;
        // SAFETY: a predefined datatype of this MPI.
        if unsafe { p.PMPI_Type_size_x(dt, &mut size) } != MPI_SUCCESS {
            continue;
        }
        let elem = match (h.kinds[i] as u32, size) {
            (ffi::erar_kind_ERAR_KIND_FLOAT, 4) => ElemType::F32,
            (ffi::erar_kind_ERAR_KIND_FLOAT, 8) => ElemType::F64,
            (ffi::erar_kind_ERAR_KIND_SIGNED, 4) => ElemType::I32,
            (ffi::erar_kind_ERAR_KIND_SIGNED, 8) => ElemType::I64,
            (ffi::erar_kind_ERAR_KIND_UNSIGNED, 4) => ElemType::U32,
            (ffi::erar_kind_ERAR_KIND_UNSIGNED, 8) => ElemType::U64,
            _ => continue,
        };
        rt.elem_types[rt.nelems] = dt;
        rt.elems[rt.nelems] = elem;
        rt.nelems += 1;
    }

    let mut provided = 0;
    // SAFETY: MPI is initialized.
    if unsafe { p.PMPI_Query_thread(&mut provided) } == MPI_SUCCESS {
        rt.thread_multiple = provided == h.thread_multiple;
    }

    rt.probe_comm = create_probe_comm(p, &h);
    install_finalize_hook(p, &h);
    log::debug!(
        "liberar: runtime ready ({} known datatypes, thread_multiple={}); routing: {}",
        rt.nelems,
        rt.thread_multiple,
        Config::get().routing_summary()
    );
    Ok(rt)
}

impl Runtime {
    /// The datapath element type of a predefined datatype; `None` for
    /// anything else (derived, user-defined, 1- or 2-byte types).
    #[inline]
    pub fn elem_of(&self, dt: MPI_Datatype) -> Option<ElemType> {
        self.elem_types[..self.nelems]
            .iter()
            .position(|t| *t == dt)
            .map(|i| self.elems[i])
    }

    /// The predefined op `op` is (the inverse of [`Self::op_handle`]);
    /// `None` for MPI_OP_NULL and user-defined ops.
    #[inline]
    pub fn op_of(&self, op: MPI_Op) -> Option<ReduceOp> {
        use ReduceOp::*;
        if op.is_zero() || op == self.h.op_null {
            return None;
        }
        [Sum, Prod, Max, Min, Band, Bor, Bxor]
            .into_iter()
            .find(|&r| self.op_handle(r) == op)
    }

    pub fn elem_handle(&self, e: ElemType) -> MPI_Datatype {
        let h = &self.h;
        match e {
            ElemType::F32 => h.dt_float,
            ElemType::F64 => h.dt_double,
            ElemType::I32 => h.dt_int32,
            ElemType::U32 => h.dt_uint32,
            ElemType::I64 => h.dt_int64,
            ElemType::U64 => h.dt_uint64,
        }
    }

    #[inline]
    pub fn op_handle(&self, op: ReduceOp) -> MPI_Op {
        let h = &self.h;
        match op {
            ReduceOp::Sum => h.op_sum,
            ReduceOp::Prod => h.op_prod,
            ReduceOp::Max => h.op_max,
            ReduceOp::Min => h.op_min,
            ReduceOp::Band => h.op_band,
            ReduceOp::Bor => h.op_bor,
            ReduceOp::Bxor => h.op_bxor,
        }
    }

    #[inline]
    pub fn is_null_comm(&self, c: MPI_Comm) -> bool {
        c.is_zero() || c == self.h.comm_null
    }

    #[inline]
    pub fn is_null_type(&self, t: MPI_Datatype) -> bool {
        t.is_zero() || t == self.h.dt_null
    }

    /// The communicator for argument checks that must not reach the
    /// caller's error handler (see the field); `None` if there is none.
    pub fn probe_comm(&self) -> Option<MPI_Comm> {
        (!self.is_null_comm(self.probe_comm)).then_some(self.probe_comm)
    }

    /// Whether MPI accepts `dt` for a send or receive: a valid, committed
    /// datatype. Checked by packing zero elements on the probe
    /// communicator (both MPIs check the datatype first, touch no buffer
    /// for zero elements and report on that communicator's
    /// MPI_ERRORS_RETURN handler). Without a probe communicator (never
    /// seen) nothing is checked: the answer must not depend on this
    /// process's luck, or ranks would route one call differently.
    pub fn datatype_usable(&self, dt: MPI_Datatype) -> bool {
        let Some(probe) = self.probe_comm() else {
            return true;
        };
        let (inbuf, mut outbuf, mut position) = (0u8, 0u8, 0 as c_int);
        // SAFETY: zero elements: MPI reads and writes no buffer bytes; both
        // pointers are valid anyway.
        let rc = unsafe {
            pmpi().PMPI_Pack(
                (&inbuf as *const u8).cast(),
                0,
                dt,
                (&mut outbuf as *mut u8).cast(),
                0,
                &mut position,
                probe,
            )
        };
        rc == MPI_SUCCESS
    }
}

/// See [`Runtime::probe_comm`]. Made at initialisation, from the thread that
/// initialised MPI, so it never races a collective of the program's on
/// MPI_COMM_SELF; freed by the finalize hook.
fn create_probe_comm(p: &Pmpi, h: &erar_handles) -> MPI_Comm {
    let mut probe = h.comm_null;
    // SAFETY: MPI is initialized; MPI_Comm_dup of MPI_COMM_SELF involves
    // this process only.
    unsafe {
        if p.PMPI_Comm_dup(h.comm_self, &mut probe) != MPI_SUCCESS {
            log::warn!(
                "liberar: MPI_Comm_dup(MPI_COMM_SELF) failed; derived broadcasts stay on MPI"
            );
            return h.comm_null;
        }
        if p.PMPI_Comm_set_errhandler(probe, h.errors_return) != MPI_SUCCESS {
            log::warn!("liberar: MPI_Comm_set_errhandler failed; datatypes go unchecked");
            p.PMPI_Comm_free(&mut probe);
            return h.comm_null;
        }
    }
    probe
}

/// MPI_COMM_NULL_COPY_FN, written here because Open MPI's is a function in
/// libmpi (a load-time relocation if referenced).
pub unsafe extern "C" fn no_copy(
    _comm: MPI_Comm,
    _keyval: c_int,
    _extra: *mut c_void,
    _val_in: *mut c_void,
    _val_out: *mut c_void,
    flag: *mut c_int,
) -> c_int {
    if !flag.is_null() {
        *flag = 0;
    }
    MPI_SUCCESS
}

/// MPI_Finalize deletes MPI_COMM_SELF's attributes first, while all of MPI is
/// still usable: the standard's finalize hook, with no need to intercept
/// MPI_Finalize (which may be reached through paths we do not see).
fn install_finalize_hook(p: &Pmpi, h: &erar_handles) {
    let mut keyval = h.keyval_invalid;
    // SAFETY: MPI is initialized; callbacks match mpi.h's typedefs.
    unsafe {
        let rc = p.PMPI_Comm_create_keyval(
            Some(no_copy),
            Some(on_finalize),
            &mut keyval,
            ptr::null_mut(),
        );
        if rc != MPI_SUCCESS {
            log::warn!("liberar: no finalize hook (MPI_Comm_create_keyval returned {rc})");
            return;
        }
        let rc = p.PMPI_Comm_set_attr(h.comm_self, keyval, ptr::null_mut());
        if rc != MPI_SUCCESS {
            log::warn!("liberar: no finalize hook (MPI_Comm_set_attr returned {rc})");
        }
    }
}

unsafe extern "C" fn on_finalize(
    _comm: MPI_Comm,
    _keyval: c_int,
    _val: *mut c_void,
    _extra: *mut c_void,
) -> c_int {
    FINALIZED.store(true, Ordering::Relaxed);
    let Some(rt) = RUNTIME.get() else {
        return MPI_SUCCESS;
    };
    let cfg = Config::get();
    let (mut rank, mut size) = (-1, -1);
    if cfg.stats || cfg.trace.is_some() || cfg!(feature = "paired") {
        let p = pmpi();
        p.PMPI_Comm_rank(rt.h.comm_world, &mut rank);
        p.PMPI_Comm_size(rt.h.comm_world, &mut size);
    }
    if cfg.stats {
        // One write per line, so lines of ranks sharing a terminal or file
        // do not interleave.
        let mut line = stats::summary(rank, size);
        line.push('\n');
        if rank == 0 {
            line.push_str(&stats::human_summary(size));
        }
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
    #[cfg(feature = "paired")]
    if let Some(mut line) = liberar::paired::report(rank) {
        line.push('\n');
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
    if cfg.trace.is_some() {
        trace::dump(rank);
    }
    if let Some(teardown) = AT_FINALIZE.get() {
        teardown(rt);
    }
    if let Some(mut probe) = rt.probe_comm() {
        // Nothing uses it any more: MPI_Finalize is under way and
        // `runtime()` answers no call from now on.
        let rc = pmpi().PMPI_Comm_free(&mut probe);
        if rc != MPI_SUCCESS {
            log::debug!("liberar: freeing the probe communicator returned {rc}");
        }
    }
    MPI_SUCCESS
}
