/* MPI_Allreduce on communicators other than MPI_COMM_WORLD.
 *
 * liberar keeps per-communicator ring state, so this checks that each
 * communicator reduces exactly its own members, in their order:
 *   world, a dup of world, an even/odd split, the same split with reversed
 *   keys, a split of everyone with key = size - rank (ring order reversed),
 *   MPI_COMM_SELF (one rank: trivial), an intercommunicator between the
 *   even and odd halves (result = reduction of the other half), back-to-back
 *   calls alternating two communicators, and communicators freed and
 *   re-created (handles may be reused: state must not be). */
#include "common.h"

#include <stdio.h>
#include <stdlib.h>

struct kase {
    enum elem_kind kind;
    enum op_kind op;
    enum pattern pat;
};

/* A spread of datapath-eligible pairs plus one fallback pair (DOUBLE SUM). */
static const struct kase kases[] = {
    {EK_FLOAT, OPK_SUM, PAT_REAL},  {EK_FLOAT, OPK_SUM, PAT_DYADIC},
    {EK_INT, OPK_SUM, PAT_INT},     {EK_UNSIGNED, OPK_BXOR, PAT_INT},
    {EK_INT64, OPK_MAX, PAT_INT},   {EK_FLOAT, OPK_MIN, PAT_REAL},
    {EK_DOUBLE, OPK_SUM, PAT_REAL},
};
#define NKASES (sizeof kases / sizeof kases[0])

static uint64_t seed_no;

static void run_set(struct suite *s, MPI_Comm comm, const char *name, bool allow_in_place)
{
    size_t counts[] = {1, s->quick ? 1235 : 12345, 70001};
    for (size_t k = 0; k < NKASES; k++) {
        for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++) {
            seed_no++;
            for (int inplace = 0; inplace < (allow_in_place ? 2 : 1); inplace++) {
                struct rcase c = {elem_type(kases[k].kind), kases[k].op, kases[k].pat, counts[ci],
                                  0x2000 + seed_no, inplace, name};
                run_allreduce(s, &c, comm);
            }
        }
    }
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    struct suite s;
    suite_init(&s, "allreduce_comms", argc, argv);
    int rank = s.world_rank, size = s.world_size;

    run_set(&s, MPI_COMM_WORLD, "world", true);
    suite_verify_same(&s, MPI_COMM_WORLD);

    MPI_Comm dup;
    MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    run_set(&s, dup, "dup", true);
    suite_verify_same(&s, dup);

    MPI_Comm parity, parity_rev, reversed;
    MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &parity);
    MPI_Comm_split(MPI_COMM_WORLD, rank % 2, size - rank, &parity_rev);
    MPI_Comm_split(MPI_COMM_WORLD, 0, size - rank, &reversed);
    run_set(&s, parity, "split_parity", true);
    suite_verify_same(&s, parity);
    run_set(&s, parity_rev, "split_parity_reversed", true);
    suite_verify_same(&s, parity_rev);
    run_set(&s, reversed, "split_reversed", true);
    suite_verify_same(&s, reversed);

    /* One rank: MPI returns the input. */
    struct rcase self_case = {elem_type(EK_FLOAT), OPK_SUM, PAT_REAL, 70001, 0x2f00, false, "self"};
    run_allreduce(&s, &self_case, MPI_COMM_SELF);
    self_case.in_place = true;
    run_allreduce(&s, &self_case, MPI_COMM_SELF);
    suite_verify_same(&s, MPI_COMM_SELF);

    /* Alternating communicators without anything in between: per-comm
     * sequence state must not mix. */
    for (int it = 0; it < 4; it++) {
        MPI_Comm comm = (it & 1) ? parity : MPI_COMM_WORLD;
        struct rcase c = {elem_type(EK_FLOAT), OPK_SUM, PAT_REAL, 70001, 0x3000 + (uint64_t)it, it >= 2,
                          (it & 1) ? "alternate_parity" : "alternate_world"};
        run_allreduce(&s, &c, comm);
        struct rcase d = {elem_type(EK_INT), OPK_SUM, PAT_INT, 70001, 0x3100 + (uint64_t)it, false,
                          (it & 1) ? "alternate_parity" : "alternate_world"};
        run_allreduce(&s, &d, comm);
    }
    /* World and parity results differ; compare within the parity comm only
     * (its members ran the same sequence). */
    suite_verify_same(&s, parity);

    /* Free and re-create: Open MPI may hand out the same handle again. */
    for (int it = 0; it < 3; it++) {
        MPI_Comm tmp;
        MPI_Comm_split(MPI_COMM_WORLD, 0, it == 1 ? size - rank : rank, &tmp);
        struct rcase c = {elem_type(EK_FLOAT), OPK_SUM, PAT_DYADIC, 70001, 0x3200 + (uint64_t)it, false,
                          "recreated"};
        run_allreduce(&s, &c, tmp);
        struct rcase d = {elem_type(EK_UNSIGNED), OPK_SUM, PAT_INT, 70001, 0x3300 + (uint64_t)it, true,
                          "recreated"};
        run_allreduce(&s, &d, tmp);
        suite_verify_same(&s, tmp);
        MPI_Comm_free(&tmp);
    }

    /* Intercommunicator even <-> odd: each side gets the other side's
     * reduction. No MPI_IN_PLACE on intercommunicators. */
    if (size >= 2) {
        MPI_Comm inter;
        MPI_Intercomm_create(parity, 0, MPI_COMM_WORLD, rank % 2 ? 0 : 1, 77, &inter);
        static const struct kase ik[] = {{EK_FLOAT, OPK_SUM, PAT_REAL}, {EK_INT, OPK_SUM, PAT_INT},
                                         {EK_FLOAT, OPK_MAX, PAT_REAL}};
        for (size_t k = 0; k < sizeof ik / sizeof ik[0]; k++) {
            struct rcase c = {elem_type(ik[k].kind), ik[k].op, ik[k].pat, 70001, 0x3400 + k, false,
                              "intercomm"};
            run_allreduce(&s, &c, inter);
        }
        suite_verify_same(&s, parity);
        MPI_Comm_free(&inter);
    }

    MPI_Comm_free(&reversed);
    MPI_Comm_free(&parity_rev);
    MPI_Comm_free(&parity);
    MPI_Comm_free(&dup);
    return suite_finish(&s);
}
