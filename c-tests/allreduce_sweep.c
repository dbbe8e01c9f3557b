/* Sizes from one element to --max-mib MiB (default 16), including sizes that
 * are not multiples of the datapath's chunk, in place and not, then
 * --repeat back-to-back calls (default 1000). Every input is an integer or a
 * small dyadic float, so every correct result is exact and bit-for-bit
 * predictable: each rank checks every element against the sum it computes
 * itself from all ranks' inputs.
 *
 * --mixed N (default 0) then adds N back-to-back calls whose sizes cycle
 * through 1 KiB, 2 KiB, ... --max-mib MiB (each a few elements off the power
 * of two), alternating int32 and float, in place and not. To keep 4-8 ranks
 * on 2 cores fast there, each rank checks a 1/n slice of every result
 * against the reference and hashes all of it; at the end the ranks compare
 * their digests (MPI_Allgather, which liberar does not intercept), so every
 * element of every rank's result is still checked.
 *
 * --small-floats N (default 0) adds, after the odd sizes, N float calls
 * cycling through 416-418 and 833-835 elements, in place and not. Their
 * inputs change with every call, so each rank's block summaries change on
 * some calls and not on others, and where the ranks differ liberar's hosts
 * join the call's kernel barrier with different keys: it must abort on
 * every host (ring/sum_alone.rs). Under loss, that is the barrier's
 * hardest case.
 *
 * --int-only makes every call int32 (the float calls of the sweep and of
 * --mixed become int32 calls of the same size and placement): integer
 * reductions only, e.g. to exercise liberar's exact operations alone.
 *
 * Run with ERAR_MIN_BYTES=1 to push every size through liberar's fast path.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, nranks;
static int int_only;
static uint64_t digest = 1469598103934665603ull;

static void fail(const char *what, size_t count, size_t i, double got, double want)
{
    fprintf(stderr, "FAIL allreduce_sweep rank %d: %s count=%zu i=%zu got=%.9g want=%.9g\n", rank,
            what, count, i, got, want);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);
}

static void fold(const void *p, size_t bytes)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < bytes; i++)
        digest = (digest ^ b[i]) * 1099511628211ull;
}

/* Inputs: int32 in [-1000, 1000]; float k/64 with |k| < 2^16: all sums exact. */
static int32_t in_int(int r, size_t i, int salt) { return (int32_t)((i * 2654435761u + r * 40503u + salt) % 2001) - 1000; }
static float in_float(int r, size_t i, int salt) { return (float)in_int(r, i, salt) / 64.0f; }

static void run_int(size_t count, int in_place, int salt)
{
    int32_t *send = calloc(count + 1, 4), *recv = calloc(count + 1, 4);
    for (size_t i = 0; i < count; i++)
        send[i] = in_int(rank, i, salt);
    if (in_place)
        memcpy(recv, send, count * 4);
    MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, (int)count, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    for (size_t i = 0; i < count; i++) {
        int32_t want = 0;
        for (int r = 0; r < nranks; r++)
            want += in_int(r, i, salt);
        if (recv[i] != want)
            fail("int sum", count, i, recv[i], want);
        if (!in_place && send[i] != in_int(rank, i, salt))
            fail("send buffer changed", count, i, send[i], in_int(rank, i, salt));
    }
    fold(recv, count * 4);
    free(send);
    free(recv);
}

static void run_float(size_t count, int in_place, int salt)
{
    if (int_only) {
        run_int(count, in_place, salt);
        return;
    }
    float *send = calloc(count + 1, 4), *recv = calloc(count + 1, 4);
    for (size_t i = 0; i < count; i++)
        send[i] = in_float(rank, i, salt);
    if (in_place)
        memcpy(recv, send, count * 4);
    MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    for (size_t i = 0; i < count; i++) {
        float want = 0;
        for (int r = 0; r < nranks; r++)
            want += in_float(r, i, salt); /* exact: dyadic with few bits */
        if (memcmp(&recv[i], &want, 4) != 0)
            fail("float sum", count, i, recv[i], want);
    }
    fold(recv, count * 4);
    free(send);
    free(recv);
}

/* The digest over 64-bit words (the --mixed phase: ~8x faster than fold). */
static void fold_words(const void *p, size_t bytes)
{
    const unsigned char *b = p;
    size_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        digest = (digest ^ w) * 1099511628211ull;
    }
    for (; i < bytes; i++)
        digest = (digest ^ b[i]) * 1099511628211ull;
}

/* One --mixed call on buffers of at least `count` elements. */
static void run_mixed(size_t count, int is_float, int in_place, int salt, void *sendbuf, void *recvbuf)
{
    size_t lo = count * rank / nranks, hi = count * (rank + 1) / nranks;
    if (is_float && !int_only) {
        float *send = sendbuf, *recv = recvbuf, *in = in_place ? recv : send;
        for (size_t i = 0; i < count; i++)
            in[i] = in_float(rank, i, salt);
        MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (size_t i = lo; i < hi; i++) {
            float want = 0;
            for (int r = 0; r < nranks; r++)
                want += in_float(r, i, salt);
            if (memcmp(&recv[i], &want, 4) != 0)
                fail("mixed float sum", count, i, recv[i], want);
            if (!in_place && send[i] != in_float(rank, i, salt))
                fail("mixed send buffer changed", count, i, send[i], in_float(rank, i, salt));
        }
    } else {
        int32_t *send = sendbuf, *recv = recvbuf, *in = in_place ? recv : send;
        for (size_t i = 0; i < count; i++)
            in[i] = in_int(rank, i, salt);
        MPI_Allreduce(in_place ? MPI_IN_PLACE : send, recv, (int)count, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        for (size_t i = lo; i < hi; i++) {
            int32_t want = 0;
            for (int r = 0; r < nranks; r++)
                want += in_int(r, i, salt);
            if (recv[i] != want)
                fail("mixed int sum", count, i, recv[i], want);
            if (!in_place && send[i] != in_int(rank, i, salt))
                fail("mixed send buffer changed", count, i, send[i], in_int(rank, i, salt));
        }
    }
    fold_words(recvbuf, count * 4);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    size_t max_mib = 16, repeat = 1000, mixed = 0, small_floats = 0;
    for (int a = 1; a < argc; a++)
        if (!strcmp(argv[a], "--int-only"))
            int_only = 1;
    for (int a = 1; a + 1 < argc; a++) {
        if (!strcmp(argv[a], "--int-only"))
            continue;
        if (!strcmp(argv[a], "--max-mib"))
            max_mib = strtoul(argv[++a], NULL, 10);
        else if (!strcmp(argv[a], "--repeat"))
            repeat = strtoul(argv[++a], NULL, 10);
        else if (!strcmp(argv[a], "--mixed"))
            mixed = strtoul(argv[++a], NULL, 10);
        else if (!strcmp(argv[a], "--small-floats"))
            small_floats = strtoul(argv[++a], NULL, 10);
    }
    if (argc > 1 && !strcmp(argv[1], "--quick")) {
        max_mib = 4;
        repeat = 100;
    }
    /* 834 = elements of one full 3336-byte chunk; 417 = i64 words of it. */
    const size_t odd[] = {1, 2, 3, 7, 416, 417, 418, 833, 834, 835, 1023, 1025, 12345, 65537, 262143};
    int salt = 0;
    for (size_t k = 0; k < sizeof odd / sizeof odd[0]; k++)
        for (int ip = 0; ip < 2; ip++) {
            run_int(odd[k], ip, ++salt);
            run_float(odd[k], ip, ++salt);
        }
    const size_t small[] = {416, 417, 418, 833, 834, 835};
    for (size_t k = 0; k < small_floats; k++)
        run_float(small[k % 6], (k / 6) & 1, ++salt);
    for (size_t mib = 1; mib <= max_mib; mib *= 2) {
        size_t count = mib * 262144 + 13; /* never a multiple of the chunk */
        run_int(count, mib & 1, ++salt);
        run_float(count, !(mib & 1), ++salt);
    }
    for (size_t r = 0; r < repeat; r++)
        run_int(16384 + r % 7, r & 1, ++salt);
    /* 1 KiB << 0 .. max_mib MiB: 11 + log2(max_mib) sizes per cycle. */
    size_t cycle = 11;
    while (cycle < 64 && ((size_t)1024 << cycle) <= max_mib * 1048576)
        cycle++;
    if (mixed) {
        size_t max_count = ((size_t)256 << (cycle - 1)) + 5;
        void *send = calloc(max_count, 4), *recv = calloc(max_count, 4);
        for (size_t k = 0; k < mixed; k++)
            run_mixed(((size_t)256 << (k % cycle)) + k % 5, k & 1, (k >> 1) & 1, ++salt, send, recv);
        free(send);
        free(recv);
        uint64_t *all = calloc((size_t)nranks, 8);
        MPI_Allgather(&digest, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, MPI_COMM_WORLD);
        for (int r = 0; r < nranks; r++)
            if (all[r] != digest) {
                fprintf(stderr, "FAIL allreduce_sweep rank %d: results differ from rank %d's (digest %016llx vs %016llx)\n",
                        rank, r, (unsigned long long)digest, (unsigned long long)all[r]);
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
        free(all);
    }
    if (rank == 0) {
        printf("DIGEST %016llx\n", (unsigned long long)digest);
        printf("PASS allreduce_sweep\n");
    }
    MPI_Finalize();
    return 0;
}
