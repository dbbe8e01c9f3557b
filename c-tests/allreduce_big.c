/* Large MPI_Allreduce: 4M floats and 4M+3 ints (16 MiB), in place and not,
 * and back-to-back repeats on the same buffers. liberar splits messages this
 * large into several ring segments, so this is where segment boundaries,
 * the last partial chunk and per-operation sequence numbers are exercised.
 * --quick: 1M elements. */
#include "common.h"

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    struct suite s;
    suite_init(&s, "allreduce_big", argc, argv);

    size_t n = s.quick ? (size_t)1 << 20 : (size_t)4 << 20;
    const struct {
        enum elem_kind kind;
        enum op_kind op;
        enum pattern pat;
        size_t extra; /* odd tails: the last chunk is partial */
        bool in_place;
    } cases[] = {
        {EK_FLOAT, OPK_SUM, PAT_REAL, 0, false},
        {EK_FLOAT, OPK_SUM, PAT_REAL, 0, true},
        {EK_INT, OPK_SUM, PAT_INT, 3, false},
        {EK_INT, OPK_SUM, PAT_INT, 3, true},
        {EK_FLOAT, OPK_MAX, PAT_REAL, 1, true},
        {EK_FLOAT, OPK_SUM, PAT_DYADIC, 5, false},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        struct rcase c = {elem_type(cases[k].kind), cases[k].op, cases[k].pat, n + cases[k].extra,
                          0x5000 + k, cases[k].in_place, "world"};
        run_allreduce(&s, &c, MPI_COMM_WORLD);
    }
    /* Back to back with no other MPI call in between, new data each time. */
    for (uint64_t it = 0; it < 3; it++) {
        struct rcase c = {elem_type(EK_FLOAT), OPK_SUM, PAT_REAL, n / 4 + 7, 0x5100 + it, false, "world"};
        run_allreduce(&s, &c, MPI_COMM_WORLD);
    }
    suite_verify_same(&s, MPI_COMM_WORLD);
    return suite_finish(&s);
}
