/* The C half of the shim: the handle table filled from mpi.h's macros.
 *
 * Shared by handles.c (which fills it) and bindgen (which gives Rust the same
 * layout and the PMPI_ signatures), so mpi.h stays the only source of the
 * ABI. */
#ifndef ERAR_SHIM_H
#define ERAR_SHIM_H

#include <mpi.h>

#define ERAR_MAX_TYPES 32

/* Gives bindgen a name for the Fortran INTEGER type (a macro in Open MPI). */
typedef MPI_Fint erar_fint;

/* How a predefined datatype's bits are read; the width comes from
 * MPI_Type_size at run time, so MPI_LONG and MPI_INTEGER (which may be
 * 8 bytes with -fdefault-integer-8) map to the right element type. */
enum erar_kind {
    ERAR_KIND_FLOAT = 1,
    ERAR_KIND_SIGNED = 2,
    ERAR_KIND_UNSIGNED = 3,
};

struct erar_handles {
    int ntypes;
    MPI_Datatype types[ERAR_MAX_TYPES];
    int kinds[ERAR_MAX_TYPES];

    MPI_Datatype dt_null, dt_byte, dt_int;
    MPI_Datatype dt_float, dt_double, dt_int32, dt_uint32, dt_int64, dt_uint64;

    MPI_Op op_null, op_sum, op_prod, op_max, op_min, op_band, op_bor, op_bxor;

    MPI_Comm comm_world, comm_self, comm_null;

    void *in_place;

    MPI_Errhandler errors_return;
    /* MPI_STATUS_IGNORE: null in Open MPI, (MPI_Status *)1 in MPICH, which
     * rejects a null status with MPI_ERR_ARG. */
    MPI_Status *status_ignore;

    int err_other;
    int keyval_invalid;
    int thread_multiple;
    int undefined; /* MPI_UNDEFINED: no color in MPI_Comm_split */
    int any_source, any_tag;
};

/* Fills *h. `lib` is a dlopen handle in whose scope the MPI library's
 * symbols are found (Open MPI's handles are addresses of its globals). */
void erar_fill_handles(struct erar_handles *h, void *lib);

#endif
