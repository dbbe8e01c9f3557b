/* Numerics report: per input family, the largest error of MPI_Allreduce
 * (float SUM) against the exact sum, for whatever MPI_Allreduce is (liberar
 * when preloaded) and for the MPI underneath (PMPI_Allreduce) on the same
 * inputs, in the same run.
 *
 * Checks, and fails the job if violated, for the contract named by
 * ERAR_PRECISION (liberar's default, bounded, when unset):
 *   - bounded: per element, |liberar - exact| <= (n-1) * 2^-24 * sum|x_r|,
 *     the worst case of the ordered sum MPI computes ("beyond" column);
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
 * ranks' inputs and adds them as GMP integers in units of 2^-149.
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

/* Exact arithmetic in GMP integers, in units of 2^-149 (the smallest
 * subnormal): every finite float is an integer multiple of it. */
static void to_units(mpz_t out, float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    int ex = (int)((b >> 23) & 0xff);
    mpz_set_ui(out, (b & 0x7fffff) | (ex ? 0x800000 : 0));
    mpz_mul_2exp(out, out, ex ? ex - 1 : 0);
    if (b >> 31)
        mpz_neg(out, out);
}

/* An mpz in units of 2^-149 as a double (truncated; for error reports). */
static double units_to_double(const mpz_t u)
{
    long exp;
    double d = mpz_get_d_2exp(&exp, u);
    return ldexp(d, (int)exp - 149);
}

/* The exact sum `s` (units) rounded to the nearest float, ties to even. */
static float round_units(const mpz_t s)
{
    if (mpz_sgn(s) == 0)
        return 0.0f;
    mpz_t a, q, r;
    mpz_inits(a, q, r, NULL);
    mpz_abs(a, s);
    long top = (long)mpz_sizeinbase(a, 2) - 1; /* value in [2^top, 2^(top+1)) units */
    long shift = top - 23 > 0 ? top - 23 : 0;  /* keep 24 significant bits */
    mpz_tdiv_q_2exp(q, a, shift);
    mpz_tdiv_r_2exp(r, a, shift);
    if (shift > 0) {
        int cmp = mpz_cmp_ui(r, 0) == 0 ? -1 : 0;
        if (cmp == 0) {
            /* r against half = 2^(shift-1) */
            mpz_t half;
            mpz_init(half);
            mpz_ui_pow_ui(half, 2, (unsigned long)(shift - 1));
            cmp = mpz_cmp(r, half);
            mpz_clear(half);
        }
        if (cmp > 0 || (cmp == 0 && mpz_odd_p(q)))
            mpz_add_ui(q, q, 1);
    }
    /* q <= 2^24: exact in double; the product is a float or overflows. */
    float v = (float)ldexp((double)mpz_get_ui(q), (int)shift - 149);
    int neg = mpz_sgn(s) < 0;
    mpz_clears(a, q, r, NULL);
    return neg ? -v : v;
}

/* Error in units of the last place of the exact sum (as an f32): the
 * correctly rounded result is within 0.5. */
static double ulp_err(float x, double exact)
{
    double d = fabs((double)x - exact);
    float ae = fabsf((float)exact);
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
    int rounded = strcmp(contract, "reproducible") == 0 || strcmp(contract, "exact") == 0;
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
        mpz_t sum, term, dist_lib, dist_mpi;
        mpz_inits(sum, term, dist_lib, dist_mpi, NULL);
        long worse = 0, special_mismatch = 0, beyond = 0, unrounded = 0;
        long changed = memcmp(lib, again, count * 4) != 0;
        for (size_t i = 0; i < count; i++) {
            for (int r = 0; r < n; r++)
                col[r] = input((enum family)f, r, n, i);
            int col_finite = 1;
            for (int r = 0; r < n; r++)
                col_finite &= isfinite(col[r]);
            /* Finite inputs under a correctly rounded contract: the rounding
             * check below decides, whatever MPI's order made of them. */
            int mpi_decides = !(rounded && col_finite);
            if (mpi_decides && (!isfinite(mpi[i]) || !isfinite(lib[i]) || f == FAM_SPECIAL)) {
                /* IEEE specials: same class and, unless NaN, same bits. */
                int same = isnan(mpi[i]) ? isnan(lib[i]) : memcmp(&mpi[i], &lib[i], 4) == 0;
                special_mismatch += !same;
                if (f == FAM_SPECIAL || !isfinite(mpi[i]))
                    continue;
            }
            mpz_set_ui(sum, 0);
            for (int r = 0; r < n; r++) {
                to_units(term, col[r]);
                mpz_add(sum, sum, term);
            }
            double exact = units_to_double(sum);
            float want = round_units(sum);
            int all_neg_zero = 1;
            for (int r = 0; r < n; r++)
                all_neg_zero &= signbit(col[r]) && col[r] == 0.0f;
            if (all_neg_zero)
                want = -0.0f;
            unrounded += memcmp(&want, &lib[i], 4) != 0;
            if (!isfinite(lib[i]) || !isfinite(mpi[i]))
                continue; /* an overflowing sum: only its rounding is checked */
            /* Distances to the exact sum, exactly: worse than MPI? */
            to_units(term, lib[i]);
            mpz_sub(dist_lib, term, sum);
            mpz_abs(dist_lib, dist_lib);
            to_units(term, mpi[i]);
            mpz_sub(dist_mpi, term, sum);
            mpz_abs(dist_mpi, dist_mpi);
            worse += mpz_cmp(dist_lib, dist_mpi) > 0;
            double el = units_to_double(dist_lib), em = units_to_double(dist_mpi);
            /* The ordered sum's worst case. Both sides are computed in
             * double (relative error 2^-53), hence the 2^-40 slack. */
            double abs_sum = 0;
            for (int r = 0; r < n; r++)
                abs_sum += fabs((double)col[r]);
            beyond += el > (n - 1) * ldexp(abs_sum, -24) * (1 + ldexp(1, -40));
            lib_max = el > lib_max ? el : lib_max;
            mpi_max = em > mpi_max ? em : mpi_max;
            double ul = ulp_err(lib[i], exact), um = ulp_err(mpi[i], exact);
            lib_ulp = ul > lib_ulp ? ul : lib_ulp;
            mpi_ulp = um > mpi_ulp ? um : mpi_ulp;
        }
        mpz_clears(sum, term, dist_lib, dist_mpi, NULL);
        /* Bitwise identical on all ranks: min and max of a hash agree. */
        uint64_t hash = 1469598103934665603ull;
        for (size_t i = 0; i < count * 4; i++)
            hash = (hash ^ ((unsigned char *)lib)[i]) * 1099511628211ull;
        uint64_t hmin, hmax;
        PMPI_Allreduce(&hash, &hmin, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
        PMPI_Allreduce(&hash, &hmax, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
        long bad[5] = {worse, special_mismatch, beyond, changed, unrounded}, allbad[5];
        PMPI_Allreduce(bad, allbad, 5, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        if (rank == 0) {
            printf("%-28s %10zu %14.3e %14.3e %10.2f %10.2f %8ld %8ld %8ld%s%s%s\n",
                   family_name[f], count, lib_max, mpi_max, lib_ulp, mpi_ulp, allbad[0],
                   allbad[2], allbad[4],
                   hmin == hmax ? "" : "  NOT IDENTICAL ACROSS RANKS",
                   allbad[1] ? "  SPECIAL VALUES DIFFER FROM MPI" : "",
                   allbad[3] ? "  NOT DETERMINISTIC" : "");
            fflush(stdout);
        }
        failures += (rounded && (allbad[0] != 0 || allbad[4] != 0)) || (bounded && allbad[2] != 0) ||
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
