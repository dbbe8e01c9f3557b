/* Erroneous MPI_Allreduce and MPI_Bcast calls (issue #4, item 5 "Bad input").
 *
 * With MPI_ERRORS_RETURN on MPI_COMM_WORLD (and MPI_COMM_SELF), every rank
 * makes the same erroneous call: negative count, NULL buffers with count > 0,
 * MPI_COMM_NULL, MPI_OP_NULL, MPI_DATATYPE_NULL, an op the type does not
 * support, MPI_IN_PLACE where it is not allowed, aliased buffers, an
 * uncommitted datatype, a root out of range. Each call is made with a small
 * and a large (1 MiB, above liberar's thresholds) count. Then:
 * - the returned error class goes into the DIGEST, so the harness compares
 *   the classes of a plain run with those of a preloaded run (MPIs differ in
 *   what they check: what matters is that liberar changes nothing);
 * - every rank must have got the same class (cross-rank hash check);
 * - a failed call must leave the caller's buffers, and the guard bytes
 *   around them, untouched;
 * - a large valid call on the same communicator follows, and its result is
 *   checked: the communicator still works.
 * The list runs on a duplicate of MPI_COMM_WORLD first (erroneous calls
 * before the communicator's first accelerated call), then on
 * MPI_COMM_WORLD (--quick: MPI_COMM_WORLD only).
 *
 * A correct program may broadcast from a contiguous root into strided
 * receivers (same type signature, different datatypes); that case (not an
 * error, so checked and digested like any result) follows the list, in both
 * directions.
 *
 * Run it with ERAR_MIN_BYTES=1 ERAR_BCAST_MIN_BYTES=1 as well: then even the
 * small erroneous calls reach liberar's fast-path decision code. The DIGEST
 * does not depend on those variables.
 *
 * Cases an MPI cannot survive (it dereferences the NULL buffer) are skipped
 * under that MPI with a NOTE, identically with and without liberar.
 *
 * --mismatch (not part of the default run, not digested): arguments that
 * differ across ranks while each rank's call is locally valid (counts,
 * datatypes, ops, roots), all above the thresholds. MPI itself may hang,
 * crash or write out of bounds on such calls, so this mode only makes sense
 * with liberar.so preloaded: it requires every rank to get an error (any
 * class), its buffers untouched, and the communicator to work afterwards. */
#include "common.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BIG_INTS ((size_t)1 << 18) /* 1 MiB of int: above every threshold */
#define SMALL_INTS ((size_t)16)

static int world_rank, world_size;
/* Investigation flags: --only SUBSTRING runs the matching erroneous cases
 * only; --try-all runs the cases this MPI cannot survive too. */
static const char *only;
static bool try_all;

static int error_class(int rc)
{
    int cls = rc;
    if (rc != MPI_SUCCESS && MPI_Error_class(rc, &cls) != MPI_SUCCESS)
        cls = -1;
    return cls;
}

/* Pseudo-random bytes: the caller's data, which a failed call must keep. */
static void fill(unsigned char *p, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i += 8) {
        uint64_t w = mix64(seed ^ (i * 0xd1b54a32d192ed03ULL));
        memcpy(p + i, &w, n - i < 8 ? n - i : 8);
    }
}

enum coll { ALLREDUCE, BCAST };

enum kind {
    /* MPI_Allreduce */
    AR_COUNT_NEG,
    AR_SEND_NULL,
    AR_RECV_NULL,
    AR_BOTH_NULL,
    AR_COMM_NULL,
    AR_OP_NULL,
    AR_TYPE_NULL,
    AR_RECV_IN_PLACE,
    AR_BOTH_IN_PLACE,
    AR_ALIASED,
    AR_BAND_FLOAT,
    AR_MAXLOC_INT,
    AR_UNCOMMITTED,
    /* MPI_Bcast */
    BC_COUNT_NEG,
    BC_BUF_NULL,
    BC_COMM_NULL,
    BC_TYPE_NULL,
    BC_ROOT_SIZE,
    BC_ROOT_NEG,
    BC_ROOT_MPI_ROOT,
    BC_ROOT_PROC_NULL,
    BC_IN_PLACE,
    BC_UNCOMMITTED,
    BC_UNCOMMITTED_VECTOR,
    KIND_COUNT
};

static const struct {
    const char *name;
    enum coll coll;
} kinds[KIND_COUNT] = {
    [AR_COUNT_NEG] = {"count=-1", ALLREDUCE},
    [AR_SEND_NULL] = {"sendbuf=NULL", ALLREDUCE},
    [AR_RECV_NULL] = {"recvbuf=NULL", ALLREDUCE},
    [AR_BOTH_NULL] = {"sendbuf=recvbuf=NULL", ALLREDUCE},
    [AR_COMM_NULL] = {"comm=MPI_COMM_NULL", ALLREDUCE},
    [AR_OP_NULL] = {"op=MPI_OP_NULL", ALLREDUCE},
    [AR_TYPE_NULL] = {"datatype=MPI_DATATYPE_NULL", ALLREDUCE},
    [AR_RECV_IN_PLACE] = {"recvbuf=MPI_IN_PLACE", ALLREDUCE},
    [AR_BOTH_IN_PLACE] = {"sendbuf=recvbuf=MPI_IN_PLACE", ALLREDUCE},
    [AR_ALIASED] = {"sendbuf=recvbuf (not MPI_IN_PLACE)", ALLREDUCE},
    [AR_BAND_FLOAT] = {"MPI_BAND on MPI_FLOAT", ALLREDUCE},
    [AR_MAXLOC_INT] = {"MPI_MAXLOC on MPI_INT", ALLREDUCE},
    [AR_UNCOMMITTED] = {"uncommitted contiguous datatype", ALLREDUCE},
    [BC_COUNT_NEG] = {"count=-1", BCAST},
    [BC_BUF_NULL] = {"buffer=NULL", BCAST},
    [BC_COMM_NULL] = {"comm=MPI_COMM_NULL", BCAST},
    [BC_TYPE_NULL] = {"datatype=MPI_DATATYPE_NULL", BCAST},
    [BC_ROOT_SIZE] = {"root=size", BCAST},
    [BC_ROOT_NEG] = {"root=-1", BCAST},
    [BC_ROOT_MPI_ROOT] = {"root=MPI_ROOT (intracommunicator)", BCAST},
    [BC_ROOT_PROC_NULL] = {"root=MPI_PROC_NULL (intracommunicator)", BCAST},
    [BC_IN_PLACE] = {"buffer=MPI_IN_PLACE", BCAST},
    [BC_UNCOMMITTED] = {"uncommitted contiguous datatype", BCAST},
    [BC_UNCOMMITTED_VECTOR] = {"uncommitted vector datatype", BCAST},
};

/* Cases this MPI cannot survive: it does not check the argument and
 * dereferences it (measured; the same with and without liberar, which hands
 * such calls to MPI untouched). */
static const char *mpi_crashes(enum kind k)
{
#if defined(OPEN_MPI)
    /* Open MPI 4.1 checks no buffer pointer: with MPI_BOTTOM (NULL) and a
     * predefined datatype it copies from or to address 0 (SIGSEGV). */
    switch (k) {
    case AR_SEND_NULL:
    case AR_RECV_NULL:
    case AR_BOTH_NULL:
    case BC_BUF_NULL:
        return "Open MPI does not check buffer pointers and dereferences NULL";
    default:
        return NULL;
    }
#elif defined(MPICH)
    /* MPICH 4.0.2 does not check MPI_Allreduce's count: -1 reaches its
     * datatype engine (a failed assertion, then SIGSEGV). */
    switch (k) {
    case AR_COUNT_NEG:
        return "MPICH does not check a negative MPI_Allreduce count and crashes";
    case BC_IN_PLACE:
        /* Not checked either: MPI_IN_PLACE is (void *)-1, sent from. */
        return "MPICH does not check MPI_IN_PLACE in MPI_Bcast and dereferences it";
    default:
        return NULL;
    }
#else
    (void)k;
    return NULL;
#endif
}

/* One erroneous call. Buffers: `a` and `b`, each `bytes` long. */
static int bad_call(enum kind k, size_t n, MPI_Comm comm, void *a, void *b)
{
    int size, rc;
    MPI_Comm_size(comm, &size);
    int count = (int)n;
    MPI_Datatype t;
    switch (k) {
    case AR_COUNT_NEG:
        return MPI_Allreduce(a, b, -1, MPI_INT, MPI_SUM, comm);
    case AR_SEND_NULL:
        return MPI_Allreduce(NULL, b, count, MPI_INT, MPI_SUM, comm);
    case AR_RECV_NULL:
        return MPI_Allreduce(a, NULL, count, MPI_INT, MPI_SUM, comm);
    case AR_BOTH_NULL:
        return MPI_Allreduce(NULL, NULL, count, MPI_INT, MPI_SUM, comm);
    case AR_COMM_NULL:
        return MPI_Allreduce(a, b, count, MPI_INT, MPI_SUM, MPI_COMM_NULL);
    case AR_OP_NULL:
        return MPI_Allreduce(a, b, count, MPI_INT, MPI_OP_NULL, comm);
    case AR_TYPE_NULL:
        return MPI_Allreduce(a, b, count, MPI_DATATYPE_NULL, MPI_SUM, comm);
    case AR_RECV_IN_PLACE:
        return MPI_Allreduce(a, MPI_IN_PLACE, count, MPI_INT, MPI_SUM, comm);
    case AR_BOTH_IN_PLACE:
        return MPI_Allreduce(MPI_IN_PLACE, MPI_IN_PLACE, count, MPI_INT, MPI_SUM, comm);
    case AR_ALIASED:
        return MPI_Allreduce(b, b, count, MPI_INT, MPI_SUM, comm);
    case AR_BAND_FLOAT:
        return MPI_Allreduce(a, b, count, MPI_FLOAT, MPI_BAND, comm);
    case AR_MAXLOC_INT:
        return MPI_Allreduce(a, b, count, MPI_INT, MPI_MAXLOC, comm);
    case AR_UNCOMMITTED:
        MPI_Type_contiguous(4, MPI_INT, &t);
        rc = MPI_Allreduce(a, b, count / 4, t, MPI_SUM, comm);
        MPI_Type_free(&t);
        return rc;
    case BC_COUNT_NEG:
        return MPI_Bcast(b, -1, MPI_INT, 0, comm);
    case BC_BUF_NULL:
        return MPI_Bcast(NULL, count, MPI_INT, 0, comm);
    case BC_COMM_NULL:
        return MPI_Bcast(b, count, MPI_INT, 0, MPI_COMM_NULL);
    case BC_TYPE_NULL:
        return MPI_Bcast(b, count, MPI_DATATYPE_NULL, 0, comm);
    case BC_ROOT_SIZE:
        return MPI_Bcast(b, count, MPI_INT, size, comm);
    case BC_ROOT_NEG:
        return MPI_Bcast(b, count, MPI_INT, -1, comm);
    case BC_ROOT_MPI_ROOT:
        return MPI_Bcast(b, count, MPI_INT, MPI_ROOT, comm);
    case BC_ROOT_PROC_NULL:
        return MPI_Bcast(b, count, MPI_INT, MPI_PROC_NULL, comm);
    case BC_IN_PLACE:
        return MPI_Bcast(MPI_IN_PLACE, count, MPI_INT, 0, comm);
    case BC_UNCOMMITTED:
        MPI_Type_contiguous(4, MPI_INT, &t);
        rc = MPI_Bcast(b, count / 4, t, 0, comm);
        MPI_Type_free(&t);
        return rc;
    case BC_UNCOMMITTED_VECTOR:
        /* count/4 blocks of 2 ints, stride 4: stays inside the buffer. */
        MPI_Type_vector(count / 4, 2, 4, MPI_INT, &t);
        rc = MPI_Bcast(b, 1, t, 0, comm);
        MPI_Type_free(&t);
        return rc;
    case KIND_COUNT:
        break;
    }
    return MPI_ERR_INTERN;
}

/* A valid large allreduce on comm, checked and digested (common.c). */
static void valid_allreduce(struct suite *s, MPI_Comm comm, const char *comm_name, uint64_t seed,
                            bool in_place)
{
    struct rcase c = {
        .t = elem_type(EK_INT),
        .op = OPK_SUM,
        .pat = PAT_INT,
        .count = BIG_INTS,
        .seed = seed,
        .in_place = in_place,
        .comm_name = comm_name,
    };
    run_allreduce(s, &c, comm);
}

/* A valid large broadcast from `root` on comm, checked and digested. */
static void valid_bcast(struct suite *s, MPI_Comm comm, const char *comm_name, uint64_t seed, int root)
{
    char label[160];
    snprintf(label, sizeof label, "valid bcast count=%zu root=%d seed=%llu comm=%s", BIG_INTS, root,
             (unsigned long long)seed, comm_name);
    int me;
    MPI_Comm_rank(comm, &me);
    size_t bytes = BIG_INTS * sizeof(int);
    unsigned char *buf = gbuf_alloc(bytes, 0), *want = malloc(bytes);
    fill(want, bytes, mix64(seed));
    if (me == root)
        memcpy(buf, want, bytes);
    else
        memset(buf, 0xcd, bytes);
    int rc = MPI_Bcast(buf, (int)BIG_INTS, MPI_INT, root, comm);
    if (rc != MPI_SUCCESS)
        suite_fail(s, "%s: MPI_Bcast returned %d", label, rc);
    if (!gbuf_intact(buf, bytes))
        suite_fail(s, "%s: bytes around the buffer were overwritten", label);
    if (memcmp(buf, want, bytes) != 0)
        suite_fail(s, "%s: wrong data", label);
    suite_record(s, label, buf, bytes, true, NULL);
    gbuf_free(buf, 0);
    free(want);
}

static uint64_t case_no;

/* One erroneous call on every rank, then a valid call of the same
 * collective on the same communicator. */
static void run_bad(struct suite *s, enum kind k, size_t n, MPI_Comm comm, const char *comm_name)
{
    char label[200];
    snprintf(label, sizeof label, "bad %s %s count=%zu comm=%s",
             kinds[k].coll == ALLREDUCE ? "MPI_Allreduce" : "MPI_Bcast", kinds[k].name, n, comm_name);
    case_no++;
    if (only && !strstr(label, only))
        return;
    const char *skip = try_all ? NULL : mpi_crashes(k);
    if (skip) {
        if (world_rank == 0)
            fprintf(stderr, "NOTE bad_input: skipped %s: %s\n", label, skip);
        return;
    }
    size_t bytes = n * sizeof(int);
    /* Alternate aligned and merely int-aligned buffers. */
    size_t mis = (case_no & 1) ? sizeof(int) : 0;
    unsigned char *a = gbuf_alloc(bytes, mis), *b = gbuf_alloc(bytes, mis);
    unsigned char *a0 = malloc(bytes), *b0 = malloc(bytes);
    uint64_t seed = fnv1a(FNV_OFFSET, label, strlen(label)) ^ (uint64_t)world_rank;
    fill(a, bytes, seed);
    fill(b, bytes, ~seed);
    memcpy(a0, a, bytes);
    memcpy(b0, b, bytes);

    int rc = bad_call(k, n, comm, a, b);
    int cls = error_class(rc);

    if (!gbuf_intact(a, bytes) || !gbuf_intact(b, bytes))
        suite_fail(s, "%s: bytes around a buffer were overwritten (returned %s)", label, mpi_error_class_name(cls));
    if (rc != MPI_SUCCESS && (memcmp(a, a0, bytes) != 0 || memcmp(b, b0, bytes) != 0))
        suite_fail(s, "%s: the call failed (%s) but changed the caller's buffer", label, mpi_error_class_name(cls));
    if (world_rank == 0)
        fprintf(stderr, "bad_input: %s -> %s (%d)\n", label, mpi_error_class_name(cls), cls);
    /* Same class on every rank (cross-rank check), and into the digest. */
    suite_record(s, label, &cls, sizeof cls, true, NULL);
    suite_verify_same(s, MPI_COMM_WORLD);

    if (kinds[k].coll == ALLREDUCE)
        valid_allreduce(s, comm, comm_name, case_no, case_no & 2);
    else
        valid_bcast(s, comm, comm_name, case_no, (int)(case_no % (uint64_t)world_size));
    suite_verify_same(s, MPI_COMM_WORLD);

    free(a0);
    free(b0);
    gbuf_free(a, mis);
    gbuf_free(b, mis);
}

/* Valid: the root broadcasts BIG_INTS contiguous ints, the others receive
 * them into a strided vector (blocks of 256 ints, stride 512), or the
 * reverse. Type signatures match, so this is a correct program; liberar
 * must route it the same way on every rank. */
static void layouts_differ(struct suite *s, MPI_Comm comm, const char *comm_name, bool root_strided)
{
    char label[160];
    snprintf(label, sizeof label, "bcast contiguous %s strided root=0 comm=%s",
             root_strided ? "<-" : "->", comm_name);
    int me;
    MPI_Comm_rank(comm, &me);
    const size_t block = 256, stride = 512, nblocks = BIG_INTS / block;
    MPI_Datatype vec;
    MPI_Type_vector((int)nblocks, (int)block, (int)stride, MPI_INT, &vec);
    MPI_Type_commit(&vec);
    bool strided = (me == 0) == root_strided;
    size_t span = strided ? nblocks * stride * sizeof(int) : BIG_INTS * sizeof(int);
    int *buf = gbuf_alloc(span, 0);
    int *want = malloc(BIG_INTS * sizeof(int));
    fill((unsigned char *)want, BIG_INTS * sizeof(int), 0x5eedULL);
    /* Holes of a strided buffer hold a pattern that must survive. */
    for (size_t i = 0; i < span / sizeof(int); i++)
        buf[i] = (int)(0x40000000u ^ (unsigned)i);
    if (me == 0) {
        for (size_t i = 0; i < BIG_INTS; i++)
            buf[strided ? (i / block) * stride + i % block : i] = want[i];
    }
    int rc = strided ? MPI_Bcast(buf, 1, vec, 0, comm) : MPI_Bcast(buf, (int)BIG_INTS, MPI_INT, 0, comm);
    if (rc != MPI_SUCCESS)
        suite_fail(s, "%s: MPI_Bcast returned %d", label, rc);
    if (!gbuf_intact(buf, span))
        suite_fail(s, "%s: bytes around the buffer were overwritten", label);
    for (size_t i = 0; i < span / sizeof(int); i++) {
        bool data = !strided || i % stride < block;
        size_t j = strided ? (i / stride) * block + i % stride : i;
        int expect = data ? want[j] : (int)(0x40000000u ^ (unsigned)i);
        if (buf[i] != expect)
            suite_fail(s, "%s: int %zu is 0x%x, expected 0x%x (%s)", label, i, (unsigned)buf[i],
                       (unsigned)expect, data ? "data" : "a hole");
    }
    /* Digest the data as received (the same bytes on every rank). */
    suite_record(s, label, want, BIG_INTS * sizeof(int), true, NULL);
    suite_verify_same(s, MPI_COMM_WORLD);
    MPI_Type_free(&vec);
    gbuf_free(buf, 0);
    free(want);
}

static void run_list(struct suite *s, MPI_Comm comm, const char *comm_name)
{
    const size_t sizes[] = {SMALL_INTS, BIG_INTS};
    for (int k = 0; k < KIND_COUNT; k++)
        for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; z++)
            run_bad(s, (enum kind)k, sizes[z], comm, comm_name);
    layouts_differ(s, comm, comm_name, false);
    layouts_differ(s, comm, comm_name, true);
    /* The other collective still works too. */
    valid_allreduce(s, comm, comm_name, 1000 + case_no, false);
    valid_bcast(s, comm, comm_name, 1000 + case_no, world_size - 1);
    suite_verify_same(s, MPI_COMM_WORLD);
}

/* ------------------------------------------------------------ --mismatch */

enum mkind { MM_AR_COUNT, MM_AR_TYPE, MM_AR_OP, MM_BC_COUNT, MM_BC_ROOT, MM_COUNT };
static const char *mm_names[MM_COUNT] = {
    "allreduce count differs (rank 0: N, others N/2)",
    "allreduce datatype differs (rank 0: MPI_INT, others MPI_FLOAT)",
    "allreduce op differs (rank 0: MPI_SUM, others MPI_MAX)",
    "bcast count differs (rank 0: N, others N/2)",
    "bcast root differs (rank 0: 0, others 1)",
};

static void run_mismatch(struct suite *s, enum mkind k, MPI_Comm comm)
{
    size_t bytes = BIG_INTS * sizeof(int);
    unsigned char *a = gbuf_alloc(bytes, 0), *b = gbuf_alloc(bytes, 0);
    unsigned char *a0 = malloc(bytes), *b0 = malloc(bytes);
    fill(a, bytes, 77 + (uint64_t)world_rank);
    /* Broadcast payloads: the same on every rank, so that a rank that
     * wrongly takes another root's data is not "changed". */
    fill(b, bytes, k == MM_BC_ROOT ? 99 : 88 + (uint64_t)world_rank);
    memcpy(a0, a, bytes);
    memcpy(b0, b, bytes);
    int n = (int)BIG_INTS, half = (int)BIG_INTS / 2, r0 = world_rank == 0, rc = MPI_ERR_INTERN;
    switch (k) {
    case MM_AR_COUNT:
        rc = MPI_Allreduce(a, b, r0 ? n : half, MPI_INT, MPI_SUM, comm);
        break;
    case MM_AR_TYPE:
        rc = MPI_Allreduce(a, b, n, r0 ? MPI_INT : MPI_FLOAT, MPI_SUM, comm);
        break;
    case MM_AR_OP:
        rc = MPI_Allreduce(a, b, n, MPI_INT, r0 ? MPI_SUM : MPI_MAX, comm);
        break;
    case MM_BC_COUNT:
        rc = MPI_Bcast(b, r0 ? n : half, MPI_INT, 0, comm);
        break;
    case MM_BC_ROOT:
        rc = MPI_Bcast(b, n, MPI_INT, r0 ? 0 : 1, comm);
        break;
    case MM_COUNT:
        break;
    }
    int cls = error_class(rc);
    fprintf(stderr, "bad_input --mismatch rank %d: %s -> %s (%d)\n", world_rank, mm_names[k],
            mpi_error_class_name(cls), cls);
    if (!gbuf_intact(a, bytes) || !gbuf_intact(b, bytes))
        suite_fail(s, "%s: bytes around a buffer were overwritten", mm_names[k]);
    if (rc == MPI_SUCCESS)
        suite_fail(s, "%s: the call succeeded", mm_names[k]);
    if (memcmp(a, a0, bytes) != 0 || memcmp(b, b0, bytes) != 0)
        suite_fail(s, "%s: the call failed but changed the caller's buffer", mm_names[k]);
    valid_allreduce(s, comm, "world", 5000 + (uint64_t)k, false);
    valid_bcast(s, comm, "world", 5000 + (uint64_t)k, 0);
    suite_verify_same(s, MPI_COMM_WORLD);
    free(a0);
    free(b0);
    gbuf_free(a, 0);
    gbuf_free(b, 0);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    /* Our own flags first; common's parser knows only --quick. */
    bool mismatch = false;
    int nargs = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mismatch"))
            mismatch = true;
        else if (!strcmp(argv[i], "--try-all"))
            try_all = true;
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else
            argv[nargs++] = argv[i];
    }
    struct suite s;
    suite_init(&s, "bad_input", nargs, argv);
    world_rank = s.world_rank;
    world_size = s.world_size;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    /* Where an MPI reports errors without a communicator. */
    MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);

    if (mismatch) {
        if (world_size < 2)
            suite_fail(&s, "--mismatch needs at least 2 ranks");
        s.no_digest = true;
        /* A first valid call sets the ring up. */
        valid_allreduce(&s, MPI_COMM_WORLD, "world", 4999, false);
        for (int k = 0; k < MM_COUNT; k++)
            run_mismatch(&s, (enum mkind)k, MPI_COMM_WORLD);
        return suite_finish(&s);
    }

    if (!s.quick) {
        MPI_Comm dup;
        MPI_Comm_dup(MPI_COMM_WORLD, &dup); /* inherits MPI_ERRORS_RETURN */
        run_list(&s, dup, "dup");
        MPI_Comm_free(&dup);
    }
    run_list(&s, MPI_COMM_WORLD, "world");
    return suite_finish(&s);
}
