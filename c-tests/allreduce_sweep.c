/* Sizes from one element to --max-mib MiB (default 16), including sizes that
 * are not multiples of the datapath's chunk, in place and not, then
 * --repeat back-to-back calls (default 1000). Every input is an integer or a
 * small dyadic float, so every correct result is exact and bit-for-bit
 * predictable: each rank checks every element against the sum it computes
 * itself from all ranks' inputs.
 *
 * Run with ERAR_MIN_BYTES=1 to push every size through liberar's fast path.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int rank, nranks;
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

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    size_t max_mib = 16, repeat = 1000;
    for (int a = 1; a + 1 < argc; a++) {
        if (!strcmp(argv[a], "--max-mib"))
            max_mib = strtoul(argv[++a], NULL, 10);
        else if (!strcmp(argv[a], "--repeat"))
            repeat = strtoul(argv[++a], NULL, 10);
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
    for (size_t mib = 1; mib <= max_mib; mib *= 2) {
        size_t count = mib * 262144 + 13; /* never a multiple of the chunk */
        run_int(count, mib & 1, ++salt);
        run_float(count, !(mib & 1), ++salt);
    }
    for (size_t r = 0; r < repeat; r++)
        run_int(16384 + r % 7, r & 1, ++salt);
    if (rank == 0) {
        printf("DIGEST %016llx\n", (unsigned long long)digest);
        printf("PASS allreduce_sweep\n");
    }
    MPI_Finalize();
    return 0;
}
