/* A long loop of large collectives for the fault-injection tests
 * (rust-tests/tests/faults.rs, issue #4 items 2, 3, 6): while it runs, the
 * harness kills a rank, takes a link down and up, or runs a second job on
 * the same hosts.
 *
 *   fault_loop [--iters N] [--count ELEMS] [--bcast] [--seed S]
 *              [--errors-return] [--pause-ms MS] [--quick]
 *
 * Each iteration k (0-based) makes, on MPI_COMM_WORLD:
 * - an MPI_Allreduce of ELEMS int32 (SUM, separate buffers),
 * - an MPI_Allreduce of ELEMS float (SUM, in place) whose inputs are
 *   dyadic (i * 2^-8, |i| < 2^11), so every summation order gives the same
 *   bits,
 * - with --bcast, an MPI_Bcast of ELEMS 32-bit words from root k mod size;
 * and checks every element of every result on every rank against a
 * reference it computes itself: each rank's input is a pure function of
 * (seed, iteration, world rank, index), as in common.c. Defaults: 10
 * iterations of 1M elements (4 MiB per call: above liberar's thresholds),
 * short enough for the c-test suites, which run every program here with
 * and without liberar (--quick: 4 iterations of 256K elements); the fault
 * tests pass --iters. The DIGEST covers every result (all are exact), so it
 * is the same with and without liberar for the same arguments.
 *
 * Output (stdout, flushed at once so the harness can follow it live):
 *   iter K ok rank=R ms=T at=S        after every checked iteration, every
 *                                     rank (T: the iteration's duration,
 *                                     S: ms since the loop started)
 *   DIGEST <16 hex>, PASS fault_loop  rank 0, at the end (common.h contract)
 * A wrong result prints `FAIL fault_loop rank R: ...` on stderr and calls
 * MPI_Abort. With --errors-return, MPI_COMM_WORLD gets MPI_ERRORS_RETURN and
 * a failed call prints
 *   ERROR fault_loop rank=R iter=K call=MPI_Allreduce class=C (NAME): STRING
 * on stderr, then the rank exits with status 3 without MPI_Finalize (its
 * peers may be gone); without it, MPI's default handler aborts the job.
 * --pause-ms sleeps between iterations (stretches the loop without traffic). */
#include "common.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int world_rank, world_size;
static bool errors_return;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "FAIL fault_loop rank %d: %s\n", world_rank, buf);
    fflush(stderr);
    fflush(stdout);
    MPI_Abort(MPI_COMM_WORLD, 1);
    abort();
}

/* Only reached with MPI_ERRORS_RETURN: report the error and leave. */
static void check_rc(int rc, const char *call, int iter)
{
    if (rc == MPI_SUCCESS)
        return;
    int cls = -1, len = 0;
    char str[MPI_MAX_ERROR_STRING + 1] = "";
    MPI_Error_class(rc, &cls);
    MPI_Error_string(rc, str, &len);
    fprintf(stderr, "ERROR fault_loop rank=%d iter=%d call=%s class=%d (%s): %s\n", world_rank, iter,
            call, cls, mpi_error_class_name(cls), str);
    fflush(stderr);
    fflush(stdout);
    _exit(3); /* no MPI_Finalize: the peers may be gone */
}

/* Input element i of `rank` for (seed, iteration, collective). */
static inline uint64_t key_of(uint64_t seed, int iter, int which, int rank)
{
    return mix64(seed * 0x9e3779b97f4a7c15ULL ^ (uint64_t)iter * 0xc2b2ae3d27d4eb4fULL ^
                 (uint64_t)which * 0x165667b19e3779f9ULL ^ (uint64_t)(rank + 1) * 0xd6e8feb86659fd93ULL);
}

static inline uint64_t elem(uint64_t key, size_t i)
{
    return mix64(key ^ ((uint64_t)i * 0xd1b54a32d192ed03ULL));
}

/* int32 in [-2^23, 2^23): sums of up to 256 ranks never overflow. */
static inline int32_t in_int(uint64_t key, size_t i)
{
    return (int32_t)(elem(key, i) >> 40) - (1 << 23);
}

/* i * 2^-8 with |i| < 2^11: sums of up to 4096 ranks are exact floats. */
static inline float in_float(uint64_t key, size_t i)
{
    return (float)((int32_t)(elem(key, i) >> 52) - 2048) * (1.0f / 256.0f);
}

static inline uint32_t in_word(uint64_t key, size_t i)
{
    return (uint32_t)(elem(key, i) >> 17);
}

static void usage(const char *prog)
{
    if (world_rank == 0)
        fprintf(stderr,
                "usage: %s [--iters N] [--count ELEMS] [--bcast] [--seed S] [--errors-return] "
                "[--pause-ms MS] [--quick]\n",
                prog);
    MPI_Abort(MPI_COMM_WORLD, 2);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);

    long iters = 10, pause_ms = 0;
    size_t count = (size_t)1 << 20;
    uint64_t seed = 1;
    bool bcast = false;
    /* --quick first: explicit --iters/--count win whatever the order. */
    for (int a = 1; a < argc; a++)
        if (!strcmp(argv[a], "--quick") || !strcmp(argv[a], "-q")) {
            iters = 4;
            count = (size_t)1 << 18;
        }
    for (int a = 1; a < argc; a++) {
        const char *opt = argv[a];
        bool has_val = a + 1 < argc;
        char *end = NULL;
        if (!strcmp(opt, "--quick") || !strcmp(opt, "-q")) {
            /* handled above */
        } else if (!strcmp(opt, "--bcast")) {
            bcast = true;
        } else if (!strcmp(opt, "--errors-return")) {
            errors_return = true;
        } else if (!strcmp(opt, "--iters") && has_val) {
            iters = strtol(argv[++a], &end, 0);
        } else if (!strcmp(opt, "--count") && has_val) {
            count = (size_t)strtoull(argv[++a], &end, 0);
        } else if (!strcmp(opt, "--seed") && has_val) {
            seed = strtoull(argv[++a], &end, 0);
        } else if (!strcmp(opt, "--pause-ms") && has_val) {
            pause_ms = strtol(argv[++a], &end, 0);
        } else {
            usage(argv[0]);
        }
        if (end && *end)
            usage(argv[0]);
    }
    if (iters < 0 || pause_ms < 0 || count == 0 || count > (size_t)1 << 28)
        usage(argv[0]);
    if (errors_return)
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    if (world_rank == 0) {
        printf("fault_loop: %d ranks, %ld iterations of %zu elements%s, seed %llu%s\n", world_size,
               iters, count, bcast ? " (+bcast)" : "", (unsigned long long)seed,
               errors_return ? ", MPI_ERRORS_RETURN" : "");
        fflush(stdout);
    }

    int32_t *isend = gbuf_alloc(count * 4, 0);
    int32_t *irecv = gbuf_alloc(count * 4, 0);
    float *fbuf = gbuf_alloc(count * 4, 0);
    uint32_t *wbuf = gbuf_alloc(count * 4, 0);
    uint64_t *keys = malloc(sizeof(uint64_t) * (size_t)world_size);
    uint64_t digest = FNV_OFFSET;
    double t0 = now_ms();

    for (int k = 0; k < iters; k++) {
        double ts = now_ms();

        /* int32 SUM, separate buffers. */
        for (int r = 0; r < world_size; r++)
            keys[r] = key_of(seed, k, 0, r);
        for (size_t i = 0; i < count; i++)
            isend[i] = in_int(keys[world_rank], i);
        memset(irecv, 0xcd, count * 4);
        check_rc(MPI_Allreduce(isend, irecv, (int)count, MPI_INT, MPI_SUM, MPI_COMM_WORLD),
                 "MPI_Allreduce", k);
        for (size_t i = 0; i < count; i++) {
            int32_t want = 0;
            for (int r = 0; r < world_size; r++)
                want += in_int(keys[r], i);
            if (irecv[i] != want)
                fail("iter %d: int32 SUM of %zu: element %zu: got %d expected %d", k, count, i,
                     irecv[i], want);
            if (isend[i] != in_int(keys[world_rank], i))
                fail("iter %d: int32 SUM of %zu: the send buffer changed at %zu", k, count, i);
        }
        if (!gbuf_intact(isend, count * 4) || !gbuf_intact(irecv, count * 4))
            fail("iter %d: int32 SUM of %zu: bytes around the buffers were overwritten", k, count);
        digest = fnv1a(digest, irecv, count * 4);

        /* float SUM of dyadic values, in place. */
        for (int r = 0; r < world_size; r++)
            keys[r] = key_of(seed, k, 1, r);
        for (size_t i = 0; i < count; i++)
            fbuf[i] = in_float(keys[world_rank], i);
        check_rc(MPI_Allreduce(MPI_IN_PLACE, fbuf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
                 "MPI_Allreduce", k);
        for (size_t i = 0; i < count; i++) {
            float want = 0.0f;
            for (int r = 0; r < world_size; r++)
                want += in_float(keys[r], i); /* exact: see in_float */
            if (memcmp(&fbuf[i], &want, 4) != 0)
                fail("iter %d: float SUM of %zu (in place): element %zu: got %a expected %a", k,
                     count, i, (double)fbuf[i], (double)want);
        }
        if (!gbuf_intact(fbuf, count * 4))
            fail("iter %d: float SUM of %zu: bytes around the buffer were overwritten", k, count);
        digest = fnv1a(digest, fbuf, count * 4);

        if (bcast) {
            int root = k % world_size;
            uint64_t key = key_of(seed, k, 2, root);
            for (size_t i = 0; i < count; i++)
                wbuf[i] = world_rank == root ? in_word(key, i) : 0xcdcdcdcdu;
            check_rc(MPI_Bcast(wbuf, (int)count, MPI_UINT32_T, root, MPI_COMM_WORLD), "MPI_Bcast",
                     k);
            for (size_t i = 0; i < count; i++)
                if (wbuf[i] != in_word(key, i))
                    fail("iter %d: bcast of %zu words from root %d: word %zu: got 0x%08x expected "
                         "0x%08x",
                         k, count, root, i, wbuf[i], in_word(key, i));
            if (!gbuf_intact(wbuf, count * 4))
                fail("iter %d: bcast: bytes around the buffer were overwritten", k);
            digest = fnv1a(digest, wbuf, count * 4);
        }

        double te = now_ms();
        printf("iter %d ok rank=%d ms=%.1f at=%.0f\n", k, world_rank, te - ts, te - t0);
        fflush(stdout);
        if (pause_ms > 0) {
            struct timespec d = {pause_ms / 1000, (pause_ms % 1000) * 1000000L};
            while (nanosleep(&d, &d) == -1 && errno == EINTR) {
            }
        }
    }

    check_rc(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier", (int)iters);
    if (world_rank == 0) {
        printf("DIGEST %016llx\n", (unsigned long long)digest);
        printf("PASS fault_loop\n");
        fflush(stdout);
    }
    gbuf_free(isend, 0);
    gbuf_free(irecv, 0);
    gbuf_free(fbuf, 0);
    gbuf_free(wbuf, 0);
    free(keys);
    MPI_Finalize();
    return 0;
}
