/* MPI_Allreduce over every datatype x op the shim distinguishes, at counts
 * around liberar's size threshold, in place and not, on MPI_COMM_WORLD.
 *
 * Types: FLOAT DOUBLE INT UNSIGNED LONG INT64_T UINT64_T, and SHORT (a type
 * the datapath does not know: must fall back and still be right).
 * Ops: SUM MAX MIN PROD BAND BOR BXOR and a commutative user op.
 * Float SUM runs four input patterns: realistic mixed-scale data (checked
 * against the ordered-summation error bound), dyadic and subnormal data
 * (exact in any order: checked bitwise) and data with Inf/NaN/-0.0. */
#include "common.h"

#include <stdio.h>
#include <stdlib.h>

/* liberar's routing threshold: counts are placed just below, at and above
 * it so both routes are exercised. The default (256 KiB) always; a different
 * ERAR_MIN_BYTES adds its own edge cases, outside the digest. */
#define DEFAULT_THRESHOLD (256 * 1024)

static size_t env_threshold(void)
{
    const char *v = getenv("ERAR_MIN_BYTES");
    long long b = v ? atoll(v) : 0;
    return b > 0 ? (size_t)b : DEFAULT_THRESHOLD;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    struct suite s;
    suite_init(&s, "allreduce_types", argc, argv);

    static const enum elem_kind kinds[] = {EK_FLOAT, EK_DOUBLE, EK_INT, EK_UNSIGNED,
                                           EK_LONG, EK_INT64, EK_UINT64, EK_SHORT};
    size_t thr = DEFAULT_THRESHOLD, env_thr = env_threshold();
    uint64_t case_no = 0, env_case_no = 0;

    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        const struct elem_type *t = elem_type(kinds[k]);
        size_t at = thr / t->size; /* elements that make exactly the threshold */
        for (int op = 0; op < OPK_COUNT; op++) {
            if (!op_applies((enum op_kind)op, t))
                continue;
            if (mpi_op_broken(t, (enum op_kind)op)) {
                if (s.world_rank == 0)
                    fprintf(stderr, "NOTE allreduce_types: this MPI computes %s %s wrongly by itself "
                                    "(MPICH 4.0.x, pmodels/mpich#6083): cases skipped\n",
                            t->name, op_name((enum op_kind)op));
                continue;
            }
            /* Every (type, op) runs empty, single, odd and above-threshold
             * counts; the threshold edges run for the ops most likely to be
             * routed differently on either side of it. */
            size_t counts[8];
            int ncounts = 0, ndigest;
            counts[ncounts++] = 0;
            counts[ncounts++] = 1;
            counts[ncounts++] = s.quick ? 1235 : 12345;
            bool edges = !s.quick && (op == OPK_SUM || op == OPK_MAX || op == OPK_BXOR);
            if (edges) {
                counts[ncounts++] = at > 1 ? at - 1 : 1;
                counts[ncounts++] = at;
            }
            counts[ncounts++] = at + 4567;
            ndigest = ncounts;
            if (edges && env_thr != thr) {
                size_t eat = env_thr / t->size;
                counts[ncounts++] = eat > 1 ? eat - 1 : 1;
                counts[ncounts++] = eat ? eat : 1;
            }

            enum pattern pats[4];
            int npats = 0;
            if (t->is_float && op == OPK_SUM) {
                pats[npats++] = PAT_REAL;
                pats[npats++] = PAT_DYADIC;
                pats[npats++] = PAT_SUBNORMAL;
                pats[npats++] = PAT_SPECIAL;
            } else {
                pats[npats++] = default_pattern((enum op_kind)op, t);
            }
            for (int p = 0; p < npats; p++) {
                for (int ci = 0; ci < ncounts; ci++) {
                    /* Environment-only cases draw seeds from their own range so
                     * the digested cases keep theirs. */
                    s.no_digest = ci >= ndigest;
                    uint64_t seed = s.no_digest ? 0x900000 + env_case_no++ : 0x1000 + ++case_no;
                    /* Same inputs separate and in place: one reference serves both. */
                    for (int inplace = 0; inplace < 2; inplace++) {
                        struct rcase c = {t, (enum op_kind)op, pats[p], counts[ci], seed, inplace,
                                          "world"};
                        run_allreduce(&s, &c, MPI_COMM_WORLD);
                    }
                }
            }
        }
    }
    suite_verify_same(&s, MPI_COMM_WORLD);
    return suite_finish(&s);
}
