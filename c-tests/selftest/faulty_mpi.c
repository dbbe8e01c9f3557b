/* A deliberately broken MPI_Allreduce / MPI_Bcast (LD_PRELOAD, PMPI), used
 * only to prove that the test programs catch the kinds of bugs a preload
 * library can have. FAULT selects one:
 *   none          pass through (the programs must PASS)
 *   flip_one      flip one bit of one result element, on comm rank 1 only
 *   flip_all      flip the same bit on every rank (identical, but wrong)
 *   overrun       write one byte past the end of the receive buffer
 *   sendbuf       modify the caller's send buffer
 *   ulp_one       float SUM: move one element by 1 ulp on comm rank 1 only
 *   ulp_all       float SUM: move one element by 1 ulp on every rank
 *   ulp_one_pow2  ulp_one, only for counts that are multiples of 1024: in
 *                 allreduce_big that hits only realistic data, where 1 ulp is
 *                 within the error bound; only the cross-rank bitwise
 *                 comparison can catch it
 *   scale_all     float SUM: multiply one element by (1 + 2^-12) everywhere
 *   inplace_noop  MPI_IN_PLACE calls lose their result (buffer zeroed, as a
 *                 shim that never copies its result back would leave it)
 *   bcast_flip    flip one bit of a received broadcast on non-roots
 *   bcast_overrun write one byte past a broadcast buffer (contiguous types)
 * Faults apply to messages of at least 1000 elements (bcast: bytes), so
 * small bookkeeping calls stay intact. */
#include <mpi.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *fault(void)
{
    const char *f = getenv("FAULT");
    return f ? f : "none";
}

static int is(const char *name)
{
    return strcmp(fault(), name) == 0;
}

int MPI_Allreduce(const void *sendbuf, void *recvbuf, int count, MPI_Datatype dt, MPI_Op op, MPI_Comm comm)
{
    int rc = PMPI_Allreduce(sendbuf, recvbuf, count, dt, op, comm);
    if (rc != MPI_SUCCESS || count < 1000)
        return rc;
    int rank, size;
    PMPI_Comm_rank(comm, &rank);
    PMPI_Type_size(dt, &size);
    unsigned char *r = recvbuf;
    size_t mid = (size_t)count / 2 * (size_t)size;
    int fsum = dt == MPI_FLOAT && op == MPI_SUM;
    if ((is("flip_one") && rank == 1) || is("flip_all"))
        r[mid] ^= 1;
    else if (is("overrun"))
        r[(size_t)count * (size_t)size] ^= 0xff;
    else if (is("sendbuf") && sendbuf != MPI_IN_PLACE)
        ((unsigned char *)sendbuf)[mid] ^= 1;
    else if (fsum && ((is("ulp_one") && rank == 1) || is("ulp_all") ||
                      (is("ulp_one_pow2") && rank == 1 && count % 1024 == 0))) {
        float *f = (float *)recvbuf + count / 2;
        *f = nextafterf(*f, INFINITY);
    } else if (fsum && is("scale_all")) {
        float *f = (float *)recvbuf + count / 2;
        *f *= 1.0f + 0x1p-12f;
    } else if (is("inplace_noop") && sendbuf == MPI_IN_PLACE) {
        memset(recvbuf, 0, (size_t)count * (size_t)size);
    }
    return rc;
}

int MPI_Bcast(void *buf, int count, MPI_Datatype dt, int root, MPI_Comm comm)
{
    int rc = PMPI_Bcast(buf, count, dt, root, comm);
    int rank, size;
    PMPI_Comm_rank(comm, &rank);
    PMPI_Type_size(dt, &size);
    size_t bytes = (size_t)count * (size_t)size;
    if (rc != MPI_SUCCESS || bytes < 1000)
        return rc;
    MPI_Aint lb, extent;
    PMPI_Type_get_extent(dt, &lb, &extent);
    if (is("bcast_flip") && rank != root)
        ((unsigned char *)buf)[bytes / 2] ^= 1;
    else if (is("bcast_overrun") && (size_t)extent == (size_t)size)
        ((unsigned char *)buf)[bytes] ^= 0xff;
    return rc;
}
