/* Allreduce / broadcast latency benchmark, measured the way the OSU
 * micro-benchmarks do it (warm-up iterations, then timed iterations with a
 * barrier before each, average latency per size over iterations, then
 * averaged over ranks), so its numbers are comparable to osu_allreduce and
 * it works where OSU is not installed.
 *
 *   allreduce_bench [--mode allreduce|bcast] [-m MIN:MAX] [-i ITERS]
 *                   [-x WARMUP] [-I ITERS_LARGE] [-T float|int|double]
 *                   [--in-place] [--check] [--vary] [--vary-rank R] [--root R]
 *                   [--op sum|max] [--nan-rank R]
 *
 * --vary scales the data by 2 or by 1/2 in turn before each call (untimed),
 * as gradients change between training steps: every float call's block
 * exponents differ from its predecessor's, so a datapath that reuses scales
 * across calls cannot, and must agree on new ones each time. --vary-rank R
 * does so on rank R only: the ranks disagree on whether anything changed.
 * --op max times MPI_MAX instead of MPI_SUM (--check stays a SUM); with
 * --nan-rank R, rank R's first element is a NaN in every call.
 *
 * Output (rank 0): comment lines starting with '#', then one row per size:
 *   size_bytes avg_us min_us max_us busbw_GBps calls
 * busbw is 2(n-1)/n * bytes / avg for allreduce (what every rank sends and
 * receives in a bandwidth-optimal allreduce) and bytes / avg for bcast.
 * calls is how many collectives of that size each rank made (warm-up and
 * timed, plus one for --check): a preload's call counters can be matched
 * against it. */
#include <mpi.h>

#include <math.h>

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct opts {
    bool bcast;
    size_t min_bytes, max_bytes;
    int iters, warmup, iters_large;
    size_t large_bytes; /* sizes >= this use iters_large */
    const char *type;
    bool in_place, check, vary;
    int vary_rank; /* -1: every rank varies (with --vary) */
    bool max;
    int nan_rank; /* -1: none */
    int root;
};

static void usage(const char *prog)
{
    fprintf(stderr,
            "usage: %s [--mode allreduce|bcast] [-m MIN:MAX] [-i ITERS] [-x WARMUP]\n"
            "          [-I ITERS_LARGE] [-T float|int|double] [--in-place] [--check] [--vary]\n"
            "          [--vary-rank R] [--root R] [--op sum|max] [--nan-rank R]\n"
            "  -m MIN:MAX   message sizes in bytes, doubling (default 4:16777216)\n"
            "  -i ITERS     timed iterations below 1 MiB (default 100)\n"
            "  -I ITERS     timed iterations from 1 MiB (default 20)\n"
            "  -x WARMUP    warm-up iterations (default 10 below 1 MiB, 3 from 1 MiB)\n"
            "  --check      verify one result per size (not timed); off by default\n"
            "  --vary       scale the data by 2 or 1/2 in turn before each call (untimed)\n"
            "  --vary-rank R  the same, on rank R only\n",
            prog);
}

static size_t parse_size(const char *s)
{
    char *end;
    double v = strtod(s, &end);
    if (*end == 'k' || *end == 'K')
        v *= 1024;
    else if (*end == 'm' || *end == 'M')
        v *= 1024 * 1024;
    return (size_t)v;
}

static bool parse_opts(int argc, char **argv, struct opts *o)
{
    *o = (struct opts){false, 4, 16u << 20, 100, -1, 20, 1u << 20, "float", false, false, false, -1, false, -1, 0};
    for (int a = 1; a < argc; a++) {
        const char *arg = argv[a];
        const char *val = a + 1 < argc ? argv[a + 1] : NULL;
        if (!strcmp(arg, "--mode") && val) {
            o->bcast = !strcmp(val, "bcast");
            if (!o->bcast && strcmp(val, "allreduce"))
                return false;
            a++;
        } else if (!strcmp(arg, "-m") && val) {
            const char *colon = strchr(val, ':');
            if (colon) {
                o->min_bytes = colon == val ? 1 : parse_size(val);
                o->max_bytes = parse_size(colon + 1);
            } else {
                o->min_bytes = o->max_bytes = parse_size(val);
            }
            a++;
        } else if (!strcmp(arg, "-i") && val) {
            o->iters = atoi(val);
            a++;
        } else if (!strcmp(arg, "-I") && val) {
            o->iters_large = atoi(val);
            a++;
        } else if (!strcmp(arg, "-x") && val) {
            o->warmup = atoi(val);
            a++;
        } else if (!strcmp(arg, "-T") && val) {
            o->type = val;
            a++;
        } else if (!strcmp(arg, "--root") && val) {
            o->root = atoi(val);
            a++;
        } else if (!strcmp(arg, "--in-place") || !strcmp(arg, "-l")) {
            o->in_place = true;
        } else if (!strcmp(arg, "--check") || !strcmp(arg, "-c")) {
            o->check = true;
        } else if (!strcmp(arg, "--vary")) {
            o->vary = true;
        } else if (!strcmp(arg, "--op") && val) {
            o->max = !strcmp(val, "max");
            if (!o->max && strcmp(val, "sum"))
                return false;
            a++;
        } else if (!strcmp(arg, "--nan-rank") && val) {
            o->nan_rank = atoi(val);
            a++;
        } else if (!strcmp(arg, "--vary-rank") && val) {
            o->vary = true;
            o->vary_rank = atoi(val);
            a++;
        } else {
            return false;
        }
    }
    if (strcmp(o->type, "float") && strcmp(o->type, "int") && strcmp(o->type, "double"))
        return false;
    return o->iters > 0 && o->iters_large > 0 && o->min_bytes <= o->max_bytes && o->max_bytes > 0;
}

/* Realistic-looking data (mixed signs, a few magnitudes) so a datapath that
 * encodes floats sees what an application would send, not all-ones. */
static void fill(void *buf, size_t count, const char *type, int rank)
{
    uint64_t x = 0x9e3779b97f4a7c15ULL * (uint64_t)(rank + 1);
    for (size_t i = 0; i < count; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if (!strcmp(type, "float"))
            ((float *)buf)[i] = (float)((int64_t)(x >> 40) - (1 << 23)) * 0x1p-20f;
        else if (!strcmp(type, "double"))
            ((double *)buf)[i] = (double)((int64_t)(x >> 11) - (1LL << 52)) * 0x1p-49;
        else
            ((int *)buf)[i] = (int)((x >> 40) & 0xffff) - 0x8000;
    }
}

/* --vary: the data times 2 (`up`) or 1/2, exact in every type (the values
 * stay far from overflow and underflow: they alternate between two scales). */
static void rescale(void *buf, size_t count, const char *type, bool up)
{
    for (size_t i = 0; i < count; i++) {
        if (!strcmp(type, "float"))
            ((float *)buf)[i] *= up ? 2.0f : 0.5f;
        else if (!strcmp(type, "double"))
            ((double *)buf)[i] *= up ? 2.0 : 0.5;
        else
            ((int *)buf)[i] = up ? ((int *)buf)[i] * 2 : ((int *)buf)[i] / 2;
    }
}

/* --check: small integer-valued data whose sum is exact in every type, then
 * compare with the value every rank can compute. */
static bool check_size(const struct opts *o, MPI_Datatype dt, size_t esize, size_t count, int rank,
                       int nranks, MPI_Comm comm)
{
    void *buf = malloc(count * esize), *res = malloc(count * esize);
    for (size_t i = 0; i < count; i++) {
        int v = (int)((i * 7 + (size_t)rank * 13) % 64);
        if (esize == 4 && !strcmp(o->type, "float"))
            ((float *)buf)[i] = (float)v;
        else if (esize == 8)
            ((double *)buf)[i] = v;
        else
            ((int *)buf)[i] = v;
    }
    bool ok = true;
    if (o->bcast) {
        if (rank != o->root)
            memset(buf, 0, count * esize);
        MPI_Bcast(buf, (int)count, dt, o->root, comm);
        memcpy(res, buf, count * esize);
    } else {
        MPI_Allreduce(buf, res, (int)count, dt, MPI_SUM, comm);
    }
    for (size_t i = 0; i < count && ok; i++) {
        double want = 0;
        if (o->bcast)
            want = (double)((i * 7 + (size_t)o->root * 13) % 64);
        else
            for (int r = 0; r < nranks; r++)
                want += (double)((i * 7 + (size_t)r * 13) % 64);
        double got = esize == 8 ? ((double *)res)[i]
                     : !strcmp(o->type, "float") ? ((float *)res)[i] : ((int *)res)[i];
        if (got != want) {
            fprintf(stderr, "CHECK FAILED rank %d: %zu bytes, element %zu: got %g expected %g\n", rank,
                    count * esize, i, got, want);
            ok = false;
        }
    }
    free(buf);
    free(res);
    return ok;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, nranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    struct opts o;
    if (!parse_opts(argc, argv, &o)) {
        if (rank == 0)
            usage(argv[0]);
        MPI_Finalize();
        return 2;
    }
    if (o.root < 0 || o.root >= nranks)
        o.root = 0;
    MPI_Datatype dt = !strcmp(o.type, "double") ? MPI_DOUBLE : !strcmp(o.type, "int") ? MPI_INT : MPI_FLOAT;
    size_t esize = !strcmp(o.type, "double") ? 8 : 4;
    MPI_Op op = o.max ? MPI_MAX : MPI_SUM;

    size_t max_count = o.max_bytes / esize ? o.max_bytes / esize : 1;
    void *send = malloc(max_count * esize), *recv = malloc(max_count * esize);
    void *pristine = malloc(max_count * esize);
    fill(pristine, max_count, o.type, rank);
    memcpy(send, pristine, max_count * esize);
    memset(recv, 0, max_count * esize);

    if (rank == 0) {
        printf("# liberar allreduce_bench: %s, type %s, %d ranks, %s\n", o.bcast ? "MPI_Bcast" : o.max ? "MPI_Allreduce MAX" : "MPI_Allreduce SUM",
               o.type, nranks, o.in_place ? "in place" : "separate buffers");
        printf("# method: OSU-style; barrier before each iteration; avg over iterations, then over ranks\n");
        printf("# %-10s %12s %12s %12s %12s %8s\n", "size_bytes", "avg_us", "min_us", "max_us", "busbw_GBps",
               "calls");
        fflush(stdout);
    }

    bool all_ok = true;
    for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
        size_t count = bytes / esize;
        if (count == 0) {
            if (bytes * 2 <= bytes)
                break;
            continue; /* smaller than one element of this type */
        }
        bool large = bytes >= o.large_bytes;
        int iters = large ? o.iters_large : o.iters;
        int warmup = o.warmup >= 0 ? o.warmup : (large ? 3 : 10);
        double total = 0;
        for (int it = 0; it < warmup + iters; it++) {
            /* In place, the buffer would grow every iteration (x n per
             * allreduce) until it overflows; restore it, untimed. */
            if (o.vary && (o.vary_rank < 0 || o.vary_rank == rank))
                rescale(send, count, o.type, it % 2 == 0);
            if (o.nan_rank == rank && !strcmp(o.type, "float"))
                ((float *)send)[0] = NAN;
            if (o.in_place && !o.bcast)
                memcpy(recv, o.vary ? send : pristine, count * esize);
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            if (o.bcast)
                MPI_Bcast(send, (int)count, dt, o.root, MPI_COMM_WORLD);
            else if (o.in_place)
                MPI_Allreduce(MPI_IN_PLACE, recv, (int)count, dt, op, MPI_COMM_WORLD);
            else
                MPI_Allreduce(send, recv, (int)count, dt, op, MPI_COMM_WORLD);
            double t1 = MPI_Wtime();
            if (it >= warmup)
                total += t1 - t0;
        }
        if (o.bcast) /* non-roots received the root's data: restore ours */
            memcpy(send, pristine, count * esize);
        double mine = total / iters * 1e6, sum = 0, mn = 0, mx = 0;
        /* MPI_Reduce, not MPI_Allreduce: keep the benchmark's own
         * bookkeeping out of the code path being measured and counted. */
        MPI_Reduce(&mine, &sum, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
        MPI_Reduce(&mine, &mn, 1, MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
        MPI_Reduce(&mine, &mx, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        int calls = warmup + iters;
        if (o.check) {
            all_ok &= check_size(&o, dt, esize, count, rank, nranks, MPI_COMM_WORLD);
            calls++;
        }
        if (rank == 0) {
            double avg = sum / nranks;
            double factor = o.bcast ? 1.0 : 2.0 * (nranks - 1) / nranks;
            double busbw = avg > 0 ? factor * (double)(count * esize) / (avg * 1e-6) / 1e9 : 0;
            printf("%-12zu %12.2f %12.2f %12.2f %12.4f %8d\n", count * esize, avg, mn, mx, busbw, calls);
            fflush(stdout);
        }
        if (bytes * 2 <= bytes)
            break;
    }
    int ok = all_ok, all = 0;
    MPI_Reduce(&ok, &all, 1, MPI_INT, MPI_MIN, 0, MPI_COMM_WORLD);
    if (rank == 0 && o.check)
        printf("# check: %s\n", all ? "all results correct" : "FAILED");
    free(send);
    free(recv);
    free(pristine);
    MPI_Finalize();
    /* Rank 0 knows everyone's verdict, the others their own. */
    return o.check && !(rank == 0 ? all : ok) ? 1 : 0;
}
