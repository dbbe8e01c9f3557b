/* Large MPI_Allreduce: 4M floats and 4M+3 ints (16 MiB), each in place and
 * not, plus float MAX (1M), exact float SUMs (dyadic 2M, powers of two
 * 4M+5), exact calls of 4 and 8 MiB with the op changing, and
 * back-to-back repeats. liberar splits messages this large into several ring segments, so
 * this is where segment boundaries, the last partial chunk and per-operation
 * sequence numbers are exercised. --quick: a quarter of the sizes. */
#include "common.h"

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    struct suite s;
    suite_init(&s, "allreduce_big", argc, argv);

    size_t n = s.quick ? (size_t)1 << 20 : (size_t)4 << 20;
    /* The brief's core: 4M floats and 4M+3 ints, each in place and not. */
    const struct {
        enum elem_kind kind;
        enum op_kind op;
        enum pattern pat;
        size_t count;
        bool in_place;
    } cases[] = {
        {EK_FLOAT, OPK_SUM, PAT_REAL, n, false},
        {EK_FLOAT, OPK_SUM, PAT_REAL, n, true},
        {EK_INT, OPK_SUM, PAT_INT, n + 3, false},   /* odd tail: partial last chunk */
        {EK_INT, OPK_SUM, PAT_INT, n + 3, true},
        {EK_FLOAT, OPK_MAX, PAT_REAL, n / 4 + 1, true},
        {EK_FLOAT, OPK_SUM, PAT_DYADIC, n / 2 + 5, false}, /* exact: in the digest */
        /* Exact too, and on every block's grid: nothing to repair, so on
         * the node path each rank decodes it from the leaders' slots. */
        {EK_FLOAT, OPK_SUM, PAT_POW2, n + 5, true},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        struct rcase c = {elem_type(cases[k].kind), cases[k].op, cases[k].pat, cases[k].count,
                          0x5000 + k, cases[k].in_place, "world"};
        run_allreduce(&s, &c, MPI_COMM_WORLD);
    }
    /* Exact calls of two size classes (4 MiB of int, 8 MiB of int64), back
     * to back, new data each time, the op changing: liberar's tuner
     * (ring/tune.rs) runs some whole and some in 1 MiB segments, each
     * carrying a word for it in its padding. */
    size_t tuned = (n / 4 > ((size_t)1 << 20) ? n / 4 : (size_t)1 << 20) + 3;
    const enum op_kind tuned_ops[] = {OPK_SUM, OPK_MAX, OPK_MIN};
    for (uint64_t it = 0; it < 12; it++) {
        enum elem_kind kind = it % 4 == 3 ? EK_INT64 : EK_INT;
        struct rcase c = {elem_type(kind), tuned_ops[it % 3], PAT_INT, tuned, 0x5200 + it, it % 5 == 4,
                          "world"};
        run_allreduce(&s, &c, MPI_COMM_WORLD);
    }
    /* Back to back with no other MPI call in between, new data each time. */
    for (uint64_t it = 0; it < 3; it++) {
        struct rcase c = {elem_type(EK_FLOAT), OPK_SUM, PAT_REAL, n / 8 + 7, 0x5100 + it, false, "world"};
        run_allreduce(&s, &c, MPI_COMM_WORLD);
    }
    suite_verify_same(&s, MPI_COMM_WORLD);
    return suite_finish(&s);
}
