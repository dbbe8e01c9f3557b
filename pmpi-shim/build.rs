//! Generates the PMPI bindings from the installed mpi.h and compiles the C
//! handle table. One build per MPI ABI: Open MPI by default, MPICH with the
//! `mpich` feature.
//!
//! The PMPI_ functions are resolved with dlsym at the first intercepted call
//! (bindgen's dynamic loading), never linked: a cdylib's references to
//! undefined functions become load-time relocations, and liberar.so must load
//! into programs that have no MPI at all (the launcher, bash, python).

use std::env;
use std::path::PathBuf;
use std::process::Command;

/// Every PMPI_ function the shim calls. Kept short on purpose: each one must
/// exist in every supported MPI, or loading the table fails.
const PMPI_COMMON: &[&str] = &[
    "PMPI_Init",
    "PMPI_Init_thread",
    "PMPI_Initialized",
    "PMPI_Finalized",
    "PMPI_Finalize",
    "PMPI_Query_thread",
    "PMPI_Allreduce",
    "PMPI_Bcast",
    "PMPI_Allgather",
    "PMPI_Iallreduce",
    "PMPI_Iallgather",
    "PMPI_Test",
    // MPI progress while a rank waits in the kernel (Comm::progress).
    "PMPI_Iprobe",
    "PMPI_Comm_size",
    "PMPI_Comm_rank",
    "PMPI_Comm_test_inter",
    "PMPI_Comm_create_keyval",
    "PMPI_Comm_set_attr",
    "PMPI_Comm_get_attr",
    "PMPI_Comm_delete_attr",
    "PMPI_Comm_call_errhandler",
    // The private MPI_ERRORS_RETURN communicator on which datatypes are
    // validated (rt::Runtime::probe_comm), and packing of non-dense
    // broadcasts.
    "PMPI_Comm_dup",
    "PMPI_Comm_set_errhandler",
    "PMPI_Comm_free",
    // The sub-communicators of several ranks per host (node.rs).
    "PMPI_Comm_split",
    "PMPI_Pack",
    "PMPI_Unpack",
    "PMPI_Type_size_x",
    "PMPI_Type_get_extent_x",
    "PMPI_Type_get_true_extent_x",
];

/// Handle conversion for the Fortran bindings (Open MPI only: MPICH's f2c are
/// macros, and its Fortran layer calls the C MPI_ symbols we intercept).
const PMPI_FORTRAN: &[&str] = &["PMPI_Comm_f2c", "PMPI_Type_f2c", "PMPI_Op_f2c"];

fn main() {
    let mpich = env::var_os("CARGO_FEATURE_MPICH").is_some();
    println!("cargo:rerun-if-changed=csrc/shim.h");
    println!("cargo:rerun-if-changed=csrc/handles.c");
    println!("cargo:rerun-if-env-changed=ERAR_MPI_INCLUDE");

    let incdirs = mpi_include_dirs(mpich);

    let mut cc = cc::Build::new();
    cc.file("csrc/handles.c")
        .include("csrc")
        // Nothing from the C half is part of liberar.so's interface.
        .flag("-fvisibility=hidden")
        .warnings(true);
    for d in &incdirs {
        cc.include(d);
    }
    cc.compile("erar_handles");

    let mut functions: Vec<&str> = PMPI_COMMON.to_vec();
    if !mpich {
        functions.extend_from_slice(PMPI_FORTRAN);
    }
    let mut b = bindgen::Builder::default()
        .header("csrc/shim.h")
        .allowlist_type("erar_handles")
        .allowlist_type("erar_kind")
        .allowlist_type("erar_fint")
        .allowlist_var("ERAR_MAX_TYPES")
        .dynamic_library_name("Pmpi")
        .dynamic_link_require_all(true)
        .layout_tests(false)
        .generate_comments(false)
        .derive_debug(false)
        .derive_copy(true)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for f in &functions {
        b = b.allowlist_function(format!("^{f}$"));
    }
    for d in &incdirs {
        b = b.clang_arg(format!("-I{}", d.display()));
    }
    let bindings = b.generate().unwrap_or_else(|e| {
        panic!(
            "bindgen on mpi.h failed ({e}); include dirs tried: {incdirs:?}. \
             Install {} or set ERAR_MPI_INCLUDE to the directory holding mpi.h",
            if mpich {
                "libmpich-dev"
            } else {
                "libopenmpi-dev"
            }
        )
    });
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("pmpi.rs"))
        .expect("write pmpi.rs");
}

/// Where mpi.h lives: `ERAR_MPI_INCLUDE` (colon-separated), else what the
/// MPI's own compiler wrapper reports, else Debian's locations.
fn mpi_include_dirs(mpich: bool) -> Vec<PathBuf> {
    if let Ok(v) = env::var("ERAR_MPI_INCLUDE") {
        let dirs: Vec<PathBuf> = env::split_paths(&v).collect();
        if !dirs.is_empty() {
            return dirs;
        }
    }
    let (wrapper, arg) = if mpich {
        ("mpicc.mpich", "-show")
    } else {
        ("mpicc.openmpi", "-showme:incdirs")
    };
    if let Ok(out) = Command::new(wrapper).arg(arg).output() {
        if out.status.success() {
            let text = String::from_utf8_lossy(&out.stdout);
            let dirs: Vec<PathBuf> = text
                .split_whitespace()
                .filter_map(|t| {
                    if mpich {
                        t.strip_prefix("-I").map(PathBuf::from)
                    } else {
                        Some(PathBuf::from(t))
                    }
                })
                .filter(|d| d.join("mpi.h").exists() || !mpich)
                .collect();
            if !dirs.is_empty() {
                return dirs;
            }
        }
    }
    let fallback = if mpich {
        "/usr/include/x86_64-linux-gnu/mpich"
    } else {
        "/usr/lib/x86_64-linux-gnu/openmpi/include"
    };
    vec![PathBuf::from(fallback)]
}
