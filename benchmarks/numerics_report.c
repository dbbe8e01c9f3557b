/* Numerics report: per input family, the largest error of MPI_Allreduce
 * (float SUM) against the exact sum, for whatever MPI_Allreduce is (liberar
 * when preloaded) and for the MPI underneath (PMPI_Allreduce) on the same
 * inputs, in the same run.
 *
 * Checks, and fails the job if violated, for the contract named by
 * ERAR_PRECISION (liberar's default, bounded, when unset):
 *   - bounded: per element, |liberar - exact| <= (n-1) * 2^-24 * sum|x_r|,
 *     the worst case of the ordered sum MPI computes ("beyond" column);
 *   - exact: per element, |liberar - exact| <= |MPI - exact| (never worse);
 *   - every contract: results bitwise identical on every rank, and the
 *     same bits on a second call with the same inputs (deterministic);
 *   - IEEE specials (+-0, +-Inf, NaN, subnormals) give what MPI gives.
 * The "worse" column (elements where liberar is further from the exact sum
 * than MPI) is informative under bounded and quantized.
 *
 * The exact sum is computed here independently: every rank recomputes all
 * ranks' inputs, puts them on one binary grid as 128-bit integers and adds.
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum family {
    FAM_GRADIENT,
    FAM_MIXED,
    FAM_LOGUNIFORM,
    FAM_CANCEL,
    FAM_SPECIAL,
    FAM_HEAVY,
    FAM_SPARSE,
    FAM_COUNT
};
static const char *family_name[FAM_COUNT] = {
    "gradient N(0,1e-3)",   "+-1e6 mixed with 1e-2", "log-uniform 1e-4..1e4",
    "exact cancellation",   "+-0, +-Inf, NaN, subnormal", "heavy-tailed (Cauchy)",
    "sparse (90% zeros)"};

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static double unit(uint64_t h) { return (double)(h >> 11) / 9007199254740992.0; }

/* Input of `rank` (of n) at index i: a pure function, so every rank can
 * compute every other rank's contribution. */
static float input(enum family f, int rank, int n, size_t i)
{
    uint64_t h = mix(((uint64_t)f << 56) ^ ((uint64_t)rank << 40) ^ i);
    uint64_t h2 = mix(h);
    switch (f) {
    case FAM_GRADIENT: {
        double u1 = unit(h) + 1e-300, u2 = unit(h2);
        return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2) * 1e-3);
    }
    case FAM_MIXED: {
        double s = (h2 & 1) ? 1e6 : 1e-2;
        return (float)((2.0 * unit(h) - 1.0) * s);
    }
    case FAM_LOGUNIFORM: {
        double m = pow(10.0, unit(h) * 8.0 - 4.0);
        return (float)((h2 & 1) ? m : -m);
    }
    case FAM_CANCEL: {
        /* Ranks r and n-1-r contribute opposite values; a middle rank 0. */
        int partner = n - 1 - rank;
        if (partner == rank)
            return 0.0f;
        int lo = rank < partner ? rank : partner;
        uint64_t hp = mix(((uint64_t)f << 56) ^ ((uint64_t)lo << 40) ^ i);
        float v = (float)((2.0 * unit(hp) - 1.0) * pow(10.0, (double)(hp % 9) - 4.0));
        return rank < partner ? v : -v;
    }
    case FAM_HEAVY: {
        /* Cauchy: tan of a uniform angle, scaled like a gradient. */
        double t = tan(3.141592653589793 * (unit(h) - 0.5));
        return (float)(t * 1e-3);
    }
    case FAM_SPARSE: {
        if (h2 % 10 != 0)
            return 0.0f;
        double u1 = unit(h) + 1e-300, u2 = unit(mix(h2));
        return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2) * 1e-3);
    }
    case FAM_SPECIAL: {
        switch (h % 16) {
        case 0: return 0.0f;
        case 1: return -0.0f;
        case 2: return (h2 & 1) ? INFINITY : -INFINITY;
        case 3: return NAN;
        case 4: case 5: case 6: /* subnormals */
            return ldexpf((float)(h2 % 1000) - 500.0f, -140);
        default: /* dyadic values that stay on one grid */
            return ldexpf((float)((int)(h2 % 2001) - 1000), -(int)(h % 20));
        }
    }
    default:
        return 0.0f;
    }
}

/* The exact sum of `v` as value = acc * 2^(base-150). */
struct exact { __int128 acc; int base; };

static void decompose(float x, __int128 *m, int *e)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    int ex = (int)((b >> 23) & 0xff);
    __int128 mant = (b & 0x7fffff) | (ex ? 0x800000 : 0);
    *m = (b >> 31) ? -mant : mant;
    *e = ex ? ex : 1;
}

static struct exact exact_sum(const float *v, int n)
{
    struct exact r = {0, 255};
    __int128 m[256];
    int e[256];
    for (int k = 0; k < n; k++) {
        decompose(v[k], &m[k], &e[k]);
        if (m[k] != 0 && e[k] < r.base)
            r.base = e[k];
    }
    if (r.base == 255)
        r.base = 1;
    for (int k = 0; k < n; k++)
        if (m[k] != 0)
            r.acc += m[k] << (e[k] - r.base);
    return r;
}

/* |x - exact| as a 128-bit integer on a grid fine enough for both; the grid
 * is 2^(g-150) with g = min(base, x's exponent). Returns the distance and
 * the grid exponent through *g. */
static unsigned __int128 dist_on(float x, struct exact ex, int g)
{
    __int128 m;
    int e;
    decompose(x, &m, &e);
    __int128 xv = m << (e - g);
    __int128 ev = ex.acc << (ex.base - g);
    __int128 d = xv - ev;
    return d < 0 ? (unsigned __int128)(-d) : (unsigned __int128)d;
}

static int min_exp_of(float x, int base)
{
    __int128 m;
    int e;
    decompose(x, &m, &e);
    return (m != 0 && e < base) ? e : base;
}

static double as_double(struct exact ex) { return ldexp((double)ex.acc, ex.base - 150); }

/* Error in units of the last place of the exact sum (as an f32): the
 * correctly rounded result is within 0.5. */
static double ulp_err(float x, struct exact ex)
{
    double e = as_double(ex);
    double d = fabs((double)x - e);
    float ae = fabsf((float)e);
    float u = nextafterf(ae, INFINITY) - ae;
    return u > 0 ? d / u : 0.0;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t count = (argc > 1) ? strtoul(argv[1], NULL, 10) : (1u << 20);
    float *in = malloc(count * 4), *lib = malloc(count * 4), *mpi = malloc(count * 4);
    float *again = malloc(count * 4);
    float col[256];
    int failures = 0;
    const char *contract = getenv("ERAR_PRECISION");
    if (!contract || !*contract)
        contract = "bounded";
    int never_worse = strcmp(contract, "exact") == 0;
    int bounded = strcmp(contract, "bounded") == 0;
    if (rank == 0)
        printf("contract: %s, %d ranks\n%-28s %10s %14s %14s %10s %10s %8s %8s\n", contract, n,
               "family (float SUM)", "elements", "liberar max|e|", "MPI max|e|", "lib ulp",
               "MPI ulp", "worse", "beyond");
    for (int f = 0; f < FAM_COUNT; f++) {
        for (size_t i = 0; i < count; i++)
            in[i] = input((enum family)f, rank, n, i);
        MPI_Allreduce(in, lib, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        PMPI_Allreduce(in, mpi, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Allreduce(in, again, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double lib_max = 0, mpi_max = 0, lib_ulp = 0, mpi_ulp = 0;
        long worse = 0, special_mismatch = 0, beyond = 0;
        long changed = memcmp(lib, again, count * 4) != 0;
        for (size_t i = 0; i < count; i++) {
            for (int r = 0; r < n; r++)
                col[r] = input((enum family)f, r, n, i);
            if (!isfinite(mpi[i]) || !isfinite(lib[i]) || f == FAM_SPECIAL) {
                /* IEEE specials: same class and, unless NaN, same bits. */
                int same = isnan(mpi[i]) ? isnan(lib[i]) : memcmp(&mpi[i], &lib[i], 4) == 0;
                special_mismatch += !same;
                if (f == FAM_SPECIAL || !isfinite(mpi[i]))
                    continue;
            }
            struct exact ex = exact_sum(col, n);
            int g = min_exp_of(lib[i], min_exp_of(mpi[i], ex.base));
            double el0 = fabs((double)lib[i] - as_double(ex));
            double em0 = fabs((double)mpi[i] - as_double(ex));
            int emax = 1;
            for (int r = 0; r < n; r++) {
                __int128 m;
                int e;
                decompose(col[r], &m, &e);
                emax = e > emax ? e : emax;
            }
            emax += 2; /* results may carry into the next binade */
            if (emax - g + 24 + 9 < 126) { /* all values fit the 128-bit grid */
                unsigned __int128 dl = dist_on(lib[i], ex, g), dm = dist_on(mpi[i], ex, g);
                worse += dl > dm;
            } else {
                worse += el0 > em0;
            }
            double el = fabs((double)lib[i] - as_double(ex)), em = fabs((double)mpi[i] - as_double(ex));
            /* The ordered sum's worst case. Both sides are computed in
             * double from the 128-bit exact sum (relative error 2^-53),
             * hence the 2^-40 slack. */
            double abs_sum = 0;
            for (int r = 0; r < n; r++)
                abs_sum += fabs((double)col[r]);
            beyond += el > (n - 1) * ldexp(abs_sum, -24) * (1 + ldexp(1, -40));
            lib_max = el > lib_max ? el : lib_max;
            mpi_max = em > mpi_max ? em : mpi_max;
            double ul = ulp_err(lib[i], ex), um = ulp_err(mpi[i], ex);
            lib_ulp = ul > lib_ulp ? ul : lib_ulp;
            mpi_ulp = um > mpi_ulp ? um : mpi_ulp;
        }
        /* Bitwise identical on all ranks: min and max of a hash agree. */
        uint64_t hash = 1469598103934665603ull;
        for (size_t i = 0; i < count * 4; i++)
            hash = (hash ^ ((unsigned char *)lib)[i]) * 1099511628211ull;
        uint64_t hmin, hmax;
        PMPI_Allreduce(&hash, &hmin, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
        PMPI_Allreduce(&hash, &hmax, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
        long bad[4] = {worse, special_mismatch, beyond, changed}, allbad[4];
        PMPI_Allreduce(bad, allbad, 4, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        if (rank == 0) {
            printf("%-28s %10zu %14.3e %14.3e %10.2f %10.2f %8ld %8ld%s%s%s\n", family_name[f],
                   count, lib_max, mpi_max, lib_ulp, mpi_ulp, allbad[0], allbad[2],
                   hmin == hmax ? "" : "  NOT IDENTICAL ACROSS RANKS",
                   allbad[1] ? "  SPECIAL VALUES DIFFER FROM MPI" : "",
                   allbad[3] ? "  NOT DETERMINISTIC" : "");
            fflush(stdout);
        }
        failures += (never_worse && allbad[0] != 0) || (bounded && allbad[2] != 0) ||
                    allbad[1] != 0 || allbad[3] != 0 || hmin != hmax;
    }
    if (rank == 0)
        printf(failures ? "FAIL numerics_report\n" : "PASS numerics_report\n");
    free(in);
    free(lib);
    free(mpi);
    free(again);
    MPI_Finalize();
    return failures ? 1 : 0;
}
