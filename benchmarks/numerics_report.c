/* Numerics report: per input family and type (MPI_FLOAT, MPI_DOUBLE), the
 * largest error of MPI_Allreduce (SUM) against the exact sum, for whatever
 * MPI_Allreduce is (liberar when preloaded) and for the MPI underneath
 * (PMPI_Allreduce) on the same inputs, in the same run.
 *
 * Checks, and fails the job if violated, for the contract named by
 * ERAR_PRECISION (liberar's default, bounded, when unset):
 *   - bounded: per element, |liberar - exact| <= (n-1) * u * sum|x_r|
 *     (u = 2^-24, 2^-53), the worst case of the ordered sum MPI computes
 *     ("beyond" column);
 *   - reproducible (or its former name, exact): per element, the correctly
 *     rounded exact sum (nearest, ties to even; "!rounded" column), hence
 *     never worse than MPI either;
 *   - every contract: results bitwise identical on every rank, and the
 *     same bits on a second call with the same inputs (deterministic);
 *   - IEEE specials (+-0, +-Inf, NaN, subnormals) give what MPI gives
 *     (under reproducible, elements whose inputs are all finite must be
 *     the correctly rounded sum instead, even where MPI's order rounds
 *     differently or overflows).
 * The "worse" column (elements where liberar is further from the exact sum
 * than MPI) is informative under bounded and quantized.
 *
 * The exact sum is computed here independently: every rank recomputes all
 * ranks' inputs and adds them as GMP integers in units of 2^-1074 (the
 * smallest double subnormal; every finite float and double is a multiple).
 */
#include <gmp.h>
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

/* Input of `rank` (of n) at index i, as a float (dbl = 0, the double's
 * nearest float) or a double: a pure function, so every rank can compute
 * every other rank's contribution. */
static double input(enum family f, int rank, int n, size_t i, int dbl)
{
#define T(x) (dbl ? (double)(x) : (double)(float)(x))
    uint64_t h = mix(((uint64_t)f << 56) ^ ((uint64_t)rank << 40) ^ i);
    uint64_t h2 = mix(h);
    switch (f) {
    case FAM_GRADIENT: {
        double u1 = unit(h) + 1e-300, u2 = unit(h2);
        return T(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2) * 1e-3);
    }
    case FAM_MIXED: {
        double s = (h2 & 1) ? 1e6 : 1e-2;
        return T((2.0 * unit(h) - 1.0) * s);
    }
    case FAM_LOGUNIFORM: {
        double m = pow(10.0, unit(h) * 8.0 - 4.0);
        return T((h2 & 1) ? m : -m);
    }
    case FAM_CANCEL: {
        /* Ranks r and n-1-r contribute opposite values; a middle rank 0. */
        int partner = n - 1 - rank;
        if (partner == rank)
            return 0.0;
        int lo = rank < partner ? rank : partner;
        uint64_t hp = mix(((uint64_t)f << 56) ^ ((uint64_t)lo << 40) ^ i);
        double v = T((2.0 * unit(hp) - 1.0) * pow(10.0, (double)(hp % 9) - 4.0));
        return rank < partner ? v : -v;
    }
    case FAM_HEAVY: {
        /* Cauchy: tan of a uniform angle, scaled like a gradient. */
        double t = tan(3.141592653589793 * (unit(h) - 0.5));
        return T(t * 1e-3);
    }
    case FAM_SPARSE: {
        if (h2 % 10 != 0)
            return 0.0;
        double u1 = unit(h) + 1e-300, u2 = unit(mix(h2));
        return T(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2) * 1e-3);
    }
    case FAM_SPECIAL: {
        switch (h % 16) {
        case 0: return 0.0;
        case 1: return -0.0;
        case 2: return (h2 & 1) ? INFINITY : -INFINITY;
        case 3: return NAN;
        case 4: case 5: case 6: /* subnormals */
            return ldexp((double)(h2 % 1000) - 500.0, dbl ? -1065 : -140);
        default: /* dyadic values (many binades apart) */
            return ldexp((double)((int)(h2 % 2001) - 1000), -(int)(h % 20));
        }
    }
    default:
        return 0.0;
    }
#undef T
}

/* Exact arithmetic in GMP integers, in units of 2^-1074 (the smallest
 * double subnormal): every finite float and double is a multiple of it. */
static void to_units(mpz_t out, double x)
{
    uint64_t b;
    memcpy(&b, &x, 8);
    int ex = (int)((b >> 52) & 0x7ff);
    mpz_set_ui(out, (unsigned long)((b & 0xfffffffffffffull) | (ex ? 1ull << 52 : 0)));
    mpz_mul_2exp(out, out, ex ? ex - 1 : 0);
    if (b >> 63)
        mpz_neg(out, out);
}

/* An mpz in units as a double (truncated; for error reports). */
static double units_to_double(const mpz_t u)
{
    long exp;
    double d = mpz_get_d_2exp(&exp, u);
    return ldexp(d, (int)exp - 1074);
}

/* The exact sum `s` (units) rounded to the nearest float (dbl = 0) or
 * double, ties to even, returned as a double (exact for a float). */
static double round_units(const mpz_t s, int dbl)
{
    if (mpz_sgn(s) == 0)
        return 0.0;
    long mant = dbl ? 53 : 24;
    long lowest = dbl ? 0 : 925; /* the subnormal lsb: 2^-1074, 2^-149 */
    mpz_t a, q, r, half;
    mpz_inits(a, q, r, half, NULL);
    mpz_abs(a, s);
    long top = (long)mpz_sizeinbase(a, 2) - 1; /* value in [2^top, 2^(top+1)) units */
    long shift = top - (mant - 1) > lowest ? top - (mant - 1) : lowest;
    mpz_tdiv_q_2exp(q, a, shift);
    mpz_tdiv_r_2exp(r, a, shift);
    if (shift > 0) {
        mpz_setbit(half, shift - 1);
        int cmp = mpz_cmp(r, half);
        if (cmp > 0 || (cmp == 0 && mpz_odd_p(q)))
            mpz_add_ui(q, q, 1);
    }
    /* q <= 2^mant: exact in double; the product is the value, or beyond
     * the type's range (infinity once converted). */
    double v = ldexp((double)mpz_get_ui(q), (int)(shift - 1074));
    if (!dbl)
        v = (double)(float)v;
    int neg = mpz_sgn(s) < 0;
    mpz_clears(a, q, r, half, NULL);
    return neg ? -v : v;
}

/* An error `e` in units of the last place of `want`, the correctly rounded
 * sum (in the type): a correctly rounded result is within 0.5. */
static double ulp_err(double e, double want, int dbl)
{
    double u;
    if (dbl) {
        double a = fabs(want);
        u = nextafter(a, INFINITY) - a;
    } else {
        float a = fabsf((float)want);
        u = (double)(nextafterf(a, INFINITY) - a);
    }
    return u > 0 && isfinite(u) ? e / u : 0.0;
}

static double get(const void *buf, size_t i, int dbl)
{
    return dbl ? ((const double *)buf)[i] : (double)((const float *)buf)[i];
}

static int same_bits(const void *a, const void *b, size_t i, int dbl)
{
    size_t w = dbl ? 8 : 4;
    return memcmp((const char *)a + i * w, (const char *)b + i * w, w) == 0;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t count = (argc > 1) ? strtoul(argv[1], NULL, 10) : (1u << 20);
    void *in = malloc(count * 8), *lib = malloc(count * 8), *mpi = malloc(count * 8);
    void *again = malloc(count * 8);
    double col[256];
    int failures = 0;
    const char *contract = getenv("ERAR_PRECISION");
    if (!contract || !*contract)
        contract = "bounded";
    int rounded = strcmp(contract, "reproducible") == 0 || strcmp(contract, "exact") == 0;
    int bounded = strcmp(contract, "bounded") == 0;
    mpz_t sum, term, dist_lib, dist_mpi;
    mpz_inits(sum, term, dist_lib, dist_mpi, NULL);
    for (int dbl = 0; dbl < 2; dbl++) {
        MPI_Datatype dt = dbl ? MPI_DOUBLE : MPI_FLOAT;
        size_t w = dbl ? 8 : 4;
        int u_exp = dbl ? -53 : -24;
        if (rank == 0)
            printf("%scontract: %s, %d ranks, %s SUM\n%-28s %10s %14s %14s %10s %10s %8s %8s "
                   "%8s\n",
                   dbl ? "\n" : "", contract, n, dbl ? "MPI_DOUBLE" : "MPI_FLOAT", "family",
                   "elements", "liberar max|e|", "MPI max|e|", "lib ulp", "MPI ulp", "worse",
                   "beyond", "!rounded");
        for (int f = 0; f < FAM_COUNT; f++) {
            for (size_t i = 0; i < count; i++) {
                double v = input((enum family)f, rank, n, i, dbl);
                if (dbl)
                    ((double *)in)[i] = v;
                else
                    ((float *)in)[i] = (float)v;
            }
            MPI_Allreduce(in, lib, (int)count, dt, MPI_SUM, MPI_COMM_WORLD);
            PMPI_Allreduce(in, mpi, (int)count, dt, MPI_SUM, MPI_COMM_WORLD);
            MPI_Allreduce(in, again, (int)count, dt, MPI_SUM, MPI_COMM_WORLD);
            double lib_max = 0, mpi_max = 0, lib_ulp = 0, mpi_ulp = 0;
            long worse = 0, special_mismatch = 0, beyond = 0, unrounded = 0;
            long changed = memcmp(lib, again, count * w) != 0;
            for (size_t i = 0; i < count; i++) {
                int col_finite = 1;
                for (int r = 0; r < n; r++) {
                    col[r] = input((enum family)f, r, n, i, dbl);
                    col_finite &= isfinite(col[r]);
                }
                double l = get(lib, i, dbl), m = get(mpi, i, dbl);
                /* Finite inputs under a correctly rounded contract: the
                 * rounding check below decides, whatever MPI's order made
                 * of them. */
                int mpi_decides = !(rounded && col_finite);
                if (mpi_decides && (!isfinite(m) || !isfinite(l) || f == FAM_SPECIAL)) {
                    /* IEEE specials: same class and, unless NaN, same bits. */
                    int same = isnan(m) ? isnan(l) : same_bits(mpi, lib, i, dbl);
                    special_mismatch += !same;
                    if (f == FAM_SPECIAL || !isfinite(m))
                        continue;
                }
                mpz_set_ui(sum, 0);
                for (int r = 0; r < n; r++) {
                    to_units(term, col[r]);
                    mpz_add(sum, sum, term);
                }
                double want = round_units(sum, dbl);
                int all_neg_zero = 1;
                for (int r = 0; r < n; r++)
                    all_neg_zero &= signbit(col[r]) && col[r] == 0.0;
                if (all_neg_zero)
                    want = -0.0;
                unrounded += memcmp(&want, &l, 8) != 0;
                if (!isfinite(l) || !isfinite(m))
                    continue; /* an overflowing sum: only its rounding is checked */
                /* Distances to the exact sum, exactly: worse than MPI? */
                to_units(term, l);
                mpz_sub(dist_lib, term, sum);
                mpz_abs(dist_lib, dist_lib);
                to_units(term, m);
                mpz_sub(dist_mpi, term, sum);
                mpz_abs(dist_mpi, dist_mpi);
                worse += mpz_cmp(dist_lib, dist_mpi) > 0;
                double el = units_to_double(dist_lib), em = units_to_double(dist_mpi);
                /* The ordered sum's worst case. Both sides are computed in
                 * double (relative error 2^-53), hence the 2^-40 slack. */
                double abs_sum = 0;
                for (int r = 0; r < n; r++)
                    abs_sum += fabs(col[r]);
                beyond += el > (n - 1) * ldexp(abs_sum, u_exp) * (1 + ldexp(1, -40));
                lib_max = el > lib_max ? el : lib_max;
                mpi_max = em > mpi_max ? em : mpi_max;
                double ul = ulp_err(el, want, dbl), um = ulp_err(em, want, dbl);
                lib_ulp = ul > lib_ulp ? ul : lib_ulp;
                mpi_ulp = um > mpi_ulp ? um : mpi_ulp;
            }
            /* Bitwise identical on all ranks: min and max of a hash agree. */
            uint64_t hash = 1469598103934665603ull;
            for (size_t i = 0; i < count * w; i++)
                hash = (hash ^ ((unsigned char *)lib)[i]) * 1099511628211ull;
            uint64_t hmin, hmax;
            PMPI_Allreduce(&hash, &hmin, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
            PMPI_Allreduce(&hash, &hmax, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
            long bad[5] = {worse, special_mismatch, beyond, changed, unrounded}, allbad[5];
            PMPI_Allreduce(bad, allbad, 5, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
            if (rank == 0) {
                printf("%-28s %10zu %14.3e %14.3e %10.2f %10.2f %8ld %8ld %8ld%s%s%s\n",
                       family_name[f], count, lib_max, mpi_max, lib_ulp, mpi_ulp, allbad[0],
                       allbad[2], allbad[4], hmin == hmax ? "" : "  NOT IDENTICAL ACROSS RANKS",
                       allbad[1] ? "  SPECIAL VALUES DIFFER FROM MPI" : "",
                       allbad[3] ? "  NOT DETERMINISTIC" : "");
                fflush(stdout);
            }
            failures += (rounded && (allbad[0] != 0 || allbad[4] != 0)) ||
                        (bounded && allbad[2] != 0) || allbad[1] != 0 || allbad[3] != 0 ||
                        hmin != hmax;
        }
    }
    mpz_clears(sum, term, dist_lib, dist_mpi, NULL);
    if (rank == 0)
        printf(failures ? "FAIL numerics_report\n" : "PASS numerics_report\n");
    free(in);
    free(lib);
    free(mpi);
    free(again);
    MPI_Finalize();
    return failures ? 1 : 0;
}
