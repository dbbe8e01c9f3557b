/* Expands mpi.h's predefined handles without leaving relocations behind.
 *
 * Open MPI's handles are addresses of globals in libmpi: used as they are,
 * they would become data relocations resolved when liberar.so is loaded, and
 * preloading into a program without MPI (bash, the launcher) would fail. So
 * every handle is looked up with dlsym, once, at the first intercepted call.
 * MPICH's handles are integer constants and need nothing. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

#include "shim.h"

#ifdef OMPI_PREDEFINED_GLOBAL
static void *erar_lib;
#undef OMPI_PREDEFINED_GLOBAL
#define OMPI_PREDEFINED_GLOBAL(type, global) ((type)dlsym(erar_lib, #global))
#endif

/* MPI_<type> of a sized Fortran type, or a null handle (which add_type
 * skips) where this MPI lacks it: Open MPI defines one only when its Fortran
 * compiler had the type (OMPI_HAVE_FORTRAN_<type> is 1), MPICH all of them. */
#ifdef OPEN_MPI
#define ERAR_FORTRAN_HAS(type) OMPI_HAVE_FORTRAN_##type
#else
#define ERAR_FORTRAN_HAS(type) 1
#endif
#define ERAR_FORTRAN_SIZED(type) \
    ERAR_IF_ELSE(ERAR_FORTRAN_HAS(type), MPI_##type, MPI_DATATYPE_NULL)
/* `yes` if `cond` expands to 1, `no` if to 0 (the other is never compiled). */
#define ERAR_IF_ELSE(cond, yes, no) ERAR_IF_ELSE_(cond, yes, no)
#define ERAR_IF_ELSE_(cond, yes, no) ERAR_IF_ELSE_##cond(yes, no)
#define ERAR_IF_ELSE_1(yes, no) yes
#define ERAR_IF_ELSE_0(yes, no) no

static void add_type(struct erar_handles *h, MPI_Datatype t, int kind)
{
    /* A null handle is a type this MPI build lacks (dlsym found nothing, or
     * ERAR_FORTRAN_SIZED). */
    if (t == (MPI_Datatype)0 || t == MPI_DATATYPE_NULL || h->ntypes >= ERAR_MAX_TYPES)
        return;
    for (int i = 0; i < h->ntypes; i++)
        if (h->types[i] == t)
            return; /* aliases such as MPI_LONG_LONG_INT */
    h->types[h->ntypes] = t;
    h->kinds[h->ntypes] = kind;
    h->ntypes++;
}

void erar_fill_handles(struct erar_handles *h, void *lib)
{
#ifdef OMPI_PREDEFINED_GLOBAL
    erar_lib = lib;
#else
    (void)lib;
#endif
    h->ntypes = 0;
    h->dt_null = MPI_DATATYPE_NULL;
    h->dt_byte = MPI_BYTE;
    h->dt_int = MPI_INT;
    h->dt_float = MPI_FLOAT;
    h->dt_double = MPI_DOUBLE;
    h->dt_int32 = MPI_INT32_T;
    h->dt_uint32 = MPI_UINT32_T;
    h->dt_int64 = MPI_INT64_T;
    h->dt_uint64 = MPI_UINT64_T;

    add_type(h, MPI_FLOAT, ERAR_KIND_FLOAT);
    add_type(h, MPI_DOUBLE, ERAR_KIND_FLOAT);
    add_type(h, MPI_INT, ERAR_KIND_SIGNED);
    add_type(h, MPI_UNSIGNED, ERAR_KIND_UNSIGNED);
    add_type(h, MPI_LONG, ERAR_KIND_SIGNED);
    add_type(h, MPI_UNSIGNED_LONG, ERAR_KIND_UNSIGNED);
    add_type(h, MPI_LONG_LONG, ERAR_KIND_SIGNED);
    add_type(h, MPI_LONG_LONG_INT, ERAR_KIND_SIGNED);
    add_type(h, MPI_UNSIGNED_LONG_LONG, ERAR_KIND_UNSIGNED);
    add_type(h, MPI_INT32_T, ERAR_KIND_SIGNED);
    add_type(h, MPI_UINT32_T, ERAR_KIND_UNSIGNED);
    add_type(h, MPI_INT64_T, ERAR_KIND_SIGNED);
    add_type(h, MPI_UINT64_T, ERAR_KIND_UNSIGNED);
    add_type(h, MPI_AINT, ERAR_KIND_SIGNED);
    add_type(h, MPI_OFFSET, ERAR_KIND_SIGNED);
    add_type(h, MPI_COUNT, ERAR_KIND_SIGNED);
    /* Fortran types (the sized ones only where this MPI has them). */
    add_type(h, MPI_REAL, ERAR_KIND_FLOAT);
    add_type(h, MPI_DOUBLE_PRECISION, ERAR_KIND_FLOAT);
    add_type(h, MPI_INTEGER, ERAR_KIND_SIGNED);
    add_type(h, ERAR_FORTRAN_SIZED(REAL4), ERAR_KIND_FLOAT);
    add_type(h, ERAR_FORTRAN_SIZED(REAL8), ERAR_KIND_FLOAT);
    add_type(h, ERAR_FORTRAN_SIZED(INTEGER4), ERAR_KIND_SIGNED);
    add_type(h, ERAR_FORTRAN_SIZED(INTEGER8), ERAR_KIND_SIGNED);

    h->op_null = MPI_OP_NULL;
    h->op_sum = MPI_SUM;
    h->op_prod = MPI_PROD;
    h->op_max = MPI_MAX;
    h->op_min = MPI_MIN;
    h->op_band = MPI_BAND;
    h->op_bor = MPI_BOR;
    h->op_bxor = MPI_BXOR;

    h->comm_world = MPI_COMM_WORLD;
    h->comm_self = MPI_COMM_SELF;
    h->comm_null = MPI_COMM_NULL;

    h->in_place = MPI_IN_PLACE;

    h->errors_return = MPI_ERRORS_RETURN;
    h->status_ignore = MPI_STATUS_IGNORE;

    h->err_other = MPI_ERR_OTHER;
    h->keyval_invalid = MPI_KEYVAL_INVALID;
    h->thread_multiple = MPI_THREAD_MULTIPLE;
    h->undefined = MPI_UNDEFINED;
    h->any_source = MPI_ANY_SOURCE;
    h->any_tag = MPI_ANY_TAG;
}
