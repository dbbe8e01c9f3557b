/* Shared helpers for the liberar MPI correctness programs.
 *
 * Every input element is a pure function of (case seed, world rank, position
 * in the contributing group, index), so each rank can recompute every other
 * rank's input and check the collective's result without trusting MPI.
 *
 * The DIGEST covers only results that every correct implementation must
 * produce bit for bit (integers, MAX/MIN, float sums that are exact in any
 * order, broadcasts). Float sums of realistic data legitimately depend on
 * summation order (MPI's algorithm vs. liberar's exact fixed point), so they
 * are checked against an error bound and left out of the digest; that keeps
 * the digest comparable between a plain run and a preloaded run.
 */
#ifndef ERAR_TEST_COMMON_H
#define ERAR_TEST_COMMON_H

#include <mpi.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum elem_kind {
    EK_FLOAT, EK_DOUBLE, EK_INT, EK_UNSIGNED, EK_LONG, EK_INT64, EK_UINT64,
    EK_SHORT, /* not a datapath type: must always fall back */
    EK_COUNT
};

struct elem_type {
    enum elem_kind kind;
    const char *name;
    MPI_Datatype dt;
    size_t size;
    bool is_float;
    bool is_signed;
};

const struct elem_type *elem_type(enum elem_kind k);

enum op_kind {
    OPK_SUM, OPK_MAX, OPK_MIN, OPK_PROD, OPK_BAND, OPK_BOR, OPK_BXOR,
    OPK_USER, /* commutative MPI_Op_create: mod-add for integers, max-|x| for floats */
    OPK_COUNT
};

const char *op_name(enum op_kind op);

/* Name of an MPI error class (MPI_Error_class's result), for messages. */
const char *mpi_error_class_name(int cls);
/* Bitwise ops exist only for integers. */
bool op_applies(enum op_kind op, const struct elem_type *t);

/* The MPI library itself gets this (type, op) wrong (a known bug of the
 * installed version): such cases are skipped, with a note on stderr. */
bool mpi_op_broken(const struct elem_type *t, enum op_kind op);

/* How float inputs are made (integers always use PAT_INT). */
enum pattern {
    PAT_INT,       /* integer data shaped for the op (no signed overflow, extremes) */
    PAT_REAL,      /* mixed scales per block, some wide-range blocks, cancelling pairs */
    PAT_DYADIC,    /* k * 2^e with e shared per block: sums exact in any order */
    PAT_SUBNORMAL, /* subnormal values: sums exact in any order */
    PAT_SPECIAL,   /* dyadic plus +-Inf, NaN and -0.0 at a few indices */
    PAT_POW2       /* +-2^k: products exact in any order */
};

const char *pattern_name(enum pattern p);
/* The pattern to use for (op, type) when the caller does not care. */
enum pattern default_pattern(enum op_kind op, const struct elem_type *t);

/* World ranks of the processes whose inputs are reduced, in their local rank
 * order (the communicator itself, or the remote group of an intercomm). */
struct group {
    int n;
    int *world;
};

struct rcase {
    const struct elem_type *t;
    enum op_kind op;
    enum pattern pat;
    size_t count;
    uint64_t seed;
    bool in_place;
    const char *comm_name;
};

/* Test-run state: digest, pending per-case hashes for the cross-rank check. */
struct suite {
    const char *name;
    int world_rank, world_size;
    bool quick;
    /* Results recorded while set are checked but not digested: cases that
     * exist only under some environment (ERAR_MIN_BYTES) must not change the
     * DIGEST, which is compared between plain and preloaded runs. */
    bool no_digest;
    uint64_t digest;
    int ncases;
    int npending;
    int cap;
    uint64_t *pending_hash;
    char (*pending_label)[160];
};

/* After MPI_Init: parses [--quick]. */
void suite_init(struct suite *s, const char *name, int argc, char **argv);
/* Prints a FAIL line for this rank and aborts the job. */
void suite_fail(const struct suite *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3), noreturn));
/* Every member of comm must have recorded the same sequence of result hashes
 * since the last call: results bitwise identical on all ranks. Collective. */
void suite_verify_same(struct suite *s, MPI_Comm comm);
/* Records one result: hash for the cross-rank check, digest if deterministic. */
void suite_record(struct suite *s, const char *label, const void *buf, size_t bytes,
                  bool deterministic, const struct elem_type *t);
/* Rank 0 prints DIGEST and PASS; finalizes MPI. Returns the exit code. */
int suite_finish(struct suite *s);

void group_of(MPI_Comm comm, struct group *g);
void group_free(struct group *g);

/* Builds the "type=.. op=.. ..." label of a case. */
void rcase_label(const struct rcase *c, char *buf, size_t len);
/* Runs one MPI_Allreduce on comm and checks everything about it. */
void run_allreduce(struct suite *s, const struct rcase *c, MPI_Comm comm);

/* Buffers with guard bytes on both sides, to catch writes outside the
 * message (e.g. chunk padding decoded past the end). misalign shifts the
 * start off a 64-byte boundary. */
void *gbuf_alloc(size_t bytes, size_t misalign);
bool gbuf_intact(const void *p, size_t bytes);
void gbuf_free(void *p, size_t misalign);

uint64_t mix64(uint64_t x);
uint64_t fnv1a(uint64_t h, const void *p, size_t n);
#define FNV_OFFSET 0xcbf29ce484222325ULL

/* Frees the user-defined ops; called by suite_finish. */
void ops_free(void);
MPI_Op op_handle(enum op_kind op);

#endif
