/* The `reproducible` SUM contract (ERAR_PRECISION=reproducible), for
 * MPI_FLOAT and then MPI_DOUBLE (half as many elements): the same data
 * reduced as one call, in place, and fused differently (pieces of sizes
 * around the fast path's threshold, so some float calls go through the ring
 * and some through MPI; doubles always go through MPI) must give the same
 * bits every time, and those bits are the correctly rounded sum, which does
 * not depend on the number of ranks.
 *
 * Data, element i of `count` (a pure function of i and the rank):
 *   the first rank: a_i, the last: b_i (gradient-like, block scales
 *   varying); the ranks between, in pairs (1, 2), (3, 4), ...: x_i and
 *   -x_i, up to 2^10 times larger than a_i, so that a float sum in rank
 *   order or in a tree ((a + x) + (-x + b)) rounds away from a + b, and
 *   differently with the rank count; an unpaired rank between gives +0.
 * The exact sum is a_i + b_i, whatever the number of ranks, and its
 * correctly rounded float is (float)((double)a_i + (double)b_i) (the double
 * sum of two floats this close in scale is exact), its correctly rounded
 * double the IEEE double addition a_i + b_i. Some blocks hold a
 * range no 63-bit grid carries (1e30 next to 1e-30), and some elements are
 * NaN, +Inf or -0 on every rank that has them (the reference gives the same
 * IEEE results).
 *
 * Prints `DIGEST <16 hex>` (of both results) and `PASS reproducible` on rank
 * 0: the digest must be the same at every rank count. Exits non-zero, with
 * a FAIL line, on any difference.
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static double unit(uint64_t h) { return (double)(h >> 11) / 9007199254740992.0; }

enum { BLOCK = 1024, WIDE_EVERY = 7, SPECIAL_EVERY = 11 };

/* a_i (who = 0) or b_i (who = 1), as a float (dbl = 0) or a double. */
static double base_value(int who, size_t i, int dbl)
{
    size_t block = i / BLOCK;
    if (block % WIDE_EVERY == 3) {
        /* A range no integer grid carries: exactly cancelling giants next
         * to tiny values. */
        if (i % BLOCK == 5)
            return who ? -1.0e30 : 1.0e30;
        if (i % BLOCK == 6)
            return dbl ? 1.0e-30 : (double)1.0e-30f;
    }
    if (block % SPECIAL_EVERY == 4) {
        switch (i % BLOCK) {
        case 1: return who ? 1.0 : NAN;
        case 2: return who ? 2.5 : INFINITY;
        }
    }
    uint64_t h = mix(((uint64_t)who << 48) ^ i);
    double v = (2.0 * unit(h) - 1.0) * ldexp(1.0, -(int)(mix(block) % 24));
    return dbl ? v : (double)(float)v;
}

/* The element that is -0 on every rank (its pairs too: -x of -0 is +0). */
static int negative_zero_element(size_t i)
{
    return i / BLOCK % SPECIAL_EVERY == 4 && i % BLOCK == 3;
}

/* x_i of pair k (k >= 1). */
static double pair_value(int k, size_t i, int dbl)
{
    if (!isfinite(base_value(0, i, dbl)))
        return 0.0;
    uint64_t h = mix(((uint64_t)(k + 7) << 48) ^ i);
    double scale = ldexp(1.0, -(int)(mix(i / BLOCK) % 24) + (int)(h % 11));
    double v = (2.0 * unit(mix(h)) - 1.0) * scale;
    return dbl ? v : (double)(float)v;
}

static double input(int rank, int n, size_t i, int dbl)
{
    if (negative_zero_element(i))
        return -0.0;
    if (rank == 0 || rank == n - 1)
        return base_value(rank != 0, i, dbl);
    /* The ranks between: pairs (1, 2), (3, 4), ...; an unpaired last one
     * gives +0. */
    int m = rank - 1, middle = n - 2;
    if (middle % 2 == 1 && m == middle - 1)
        return 0.0;
    double x = pair_value(m / 2 + 1, i, dbl);
    return m % 2 == 0 ? x : -x;
}

/* The correctly rounded a_i + b_i: one IEEE double addition for doubles;
 * for floats, the double sum (exact: the two are this close in scale)
 * rounded once to float. */
static double expected(size_t i, int dbl)
{
    if (negative_zero_element(i))
        return -0.0;
    double s = base_value(0, i, dbl) + base_value(1, i, dbl);
    return dbl ? s : (double)(float)s;
}

static int rank_, failed;

static double get(const void *v, size_t i, int dbl)
{
    return dbl ? ((const double *)v)[i] : (double)((const float *)v)[i];
}

static void check(const char *what, const void *got, size_t count, int dbl)
{
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < count; i++) {
        double want = expected(i, dbl), g = get(got, i, dbl);
        /* Bits, as doubles: a float converts exactly, NaN payload too. */
        if (memcmp(&want, &g, 8) != 0) {
            if (!bad)
                first = i;
            bad++;
        }
    }
    if (bad) {
        fprintf(stderr,
                "FAIL reproducible rank %d: %s %s: %zu elements not the correctly rounded sum "
                "(first at %zu: %a, want %a)\n",
                rank_, dbl ? "MPI_DOUBLE" : "MPI_FLOAT", what, bad, first, get(got, first, dbl),
                expected(first, dbl));
        failed = 1;
    }
}

static uint64_t digest(uint64_t h, const void *v, size_t bytes)
{
    const unsigned char *b = (const unsigned char *)v;
    for (size_t i = 0; i < bytes; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* One type's calls: one, in place, and fused into pieces three ways.
 * Returns the digest of the result. */
static uint64_t run(size_t count, int n, int dbl, uint64_t h)
{
    size_t w = dbl ? 8 : 4;
    MPI_Datatype dt = dbl ? MPI_DOUBLE : MPI_FLOAT;
    char *in = calloc(count, w), *out = calloc(count, w);
    for (size_t i = 0; i < count; i++) {
        double v = input(rank_, n, i, dbl);
        if (dbl)
            ((double *)in)[i] = v;
        else
            ((float *)in)[i] = (float)v;
    }

    /* 1. One call. */
    MPI_Allreduce(in, out, (int)count, dt, MPI_SUM, MPI_COMM_WORLD);
    check("one call", out, count, dbl);
    uint64_t want = digest(1469598103934665603ull, out, count * w);

    /* 2. In place. */
    memcpy(out, in, count * w);
    MPI_Allreduce(MPI_IN_PLACE, out, (int)count, dt, MPI_SUM, MPI_COMM_WORLD);
    check("in place", out, count, dbl);

    /* 3. Fused differently: pieces around the 512 KiB threshold (131072
     * floats), some below (MPI), some at or above (the ring, for floats),
     * several times over so that routing trials and their verdicts come
     * and go. */
    static const size_t pieces[] = {1000, 200000, 50000, 300000, 7, 131072, 131071, 140000};
    for (int round = 0; round < 3; round++) {
        memset(out, 0xff, count * w);
        size_t at = 0, p = (size_t)round;
        while (at < count) {
            size_t len = pieces[p++ % (sizeof pieces / sizeof pieces[0])];
            len = len < count - at ? len : count - at;
            if (p % 2)
                MPI_Allreduce(in + at * w, out + at * w, (int)len, dt, MPI_SUM, MPI_COMM_WORLD);
            else {
                memcpy(out + at * w, in + at * w, len * w);
                MPI_Allreduce(MPI_IN_PLACE, out + at * w, (int)len, dt, MPI_SUM, MPI_COMM_WORLD);
            }
            at += len;
        }
        char what[32];
        snprintf(what, sizeof what, "pieces, round %d", round);
        check(what, out, count, dbl);
        if (digest(1469598103934665603ull, out, count * w) != want) {
            fprintf(stderr, "FAIL reproducible rank %d: %s %s: other bits than one call\n",
                    rank_, dbl ? "MPI_DOUBLE" : "MPI_FLOAT", what);
            failed = 1;
        }
    }
    h = digest(h, out, count * w);
    free(in);
    free(out);
    return h;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t count = (argc > 1) ? strtoul(argv[1], NULL, 10) : (1u << 20) + 4321;
    uint64_t h = run(count, n, 0, 1469598103934665603ull);
    h = run(count / 2, n, 1, h);
    int any_failed;
    PMPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any_failed)
        MPI_Abort(MPI_COMM_WORLD, 1);
    if (rank_ == 0) {
        printf("DIGEST %016llx\nPASS reproducible\n", (unsigned long long)h);
        fflush(stdout);
    }
    MPI_Finalize();
    return 0;
}
