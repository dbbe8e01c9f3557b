/* One pair of buffers given to MPI_Allreduce again and again, as OSU and
 * training loops do: liberar then registers them (XDP reads the send
 * buffer and writes the receive buffer in place, their whole pages a BPF
 * map's). Between calls the program does to its memory what a program
 * may: new input every call, a forked child that reads and writes both
 * buffers, pages dropped (MADV_DONTNEED: they must read zeros), the two
 * buffers swapped, the receive buffer broadcast (a broadcast registers
 * its buffer too), the memory unmapped and mapped anew at the same
 * address. Then pairs of other sizes, whose regions are of other size
 * classes (a smaller and a larger map than the first pair's). Every result
 * is checked against the sums computed here, on every rank, and recorded
 * in the digest. The buffers start 12 and 28 bytes into a page and end
 * inside one. */
#include "common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

/* Rank r's input of call `call`: a function of (call, r, index). */
static int input(int call, int r, size_t i)
{
    return (int)((i * 2654435761u + (size_t)call * 40503u + (size_t)r * 97u) % 100003u) - 50000;
}

static const size_t COUNT = (3u << 18) + 5; /* 3 MiB + 20 bytes of int */

struct pair {
    unsigned char *base[2];
    size_t span;
    int *send, *recv;
};

static void map_pair(struct suite *s, struct pair *p, size_t count)
{
    p->span = count * sizeof(int) + 2 * 4096;
    for (int b = 0; b < 2; b++) {
        p->base[b] = mmap(NULL, p->span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p->base[b] == MAP_FAILED)
            suite_fail(s, "allreduce reused: mmap failed");
    }
    p->send = (int *)(p->base[0] + 12);
    p->recv = (int *)(p->base[1] + 28);
}

/* One checked int SUM of call `call`'s `count` inputs from `send` into
 * `recv`. */
static void allreduce_call(struct suite *s, int call, int *send, int *recv, size_t count)
{
    int me, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    char label[64];
    snprintf(label, sizeof label, "allreduce reused call=%d", call);
    for (size_t i = 0; i < count; i++)
        send[i] = input(call, me, i);
    memset(recv, 0xcd, count * sizeof(int));
    if (MPI_Allreduce(send, recv, (int)count, MPI_INT, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS)
        suite_fail(s, "%s: MPI_Allreduce failed", label);
    for (size_t i = 0; i < count; i++) {
        int want = 0;
        for (int r = 0; r < n; r++)
            want += input(call, r, i);
        if (recv[i] != want)
            suite_fail(s, "%s: element %zu is %d, not %d", label, i, recv[i], want);
        if (send[i] != input(call, me, i))
            suite_fail(s, "%s: the send buffer changed at element %zu", label, i);
    }
    suite_record(s, label, recv, count * sizeof(int), true, NULL);
}

static void expect_zeros(struct suite *s, int call, const char *what, const int *buf)
{
    for (size_t i = 0; i < COUNT; i++)
        if (buf[i] != 0)
            suite_fail(s, "allreduce reused call=%d: the %s buffer reads %d at %zu after "
                       "MADV_DONTNEED, not 0", call, what, buf[i], i);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    struct suite s;
    suite_init(&s, "allreduce_reused", argc, argv);
    struct pair p;
    map_pair(&s, &p, COUNT);
    int *send = p.send, *recv = p.recv;
    for (int call = 0; call < 14; call++) {
        allreduce_call(&s, call, send, recv, COUNT);
        if (call == 3) {
            /* A child reads the result, overwrites both buffers and exits:
             * the parent's keep their bytes. */
            int *copy = malloc(COUNT * sizeof(int));
            memcpy(copy, recv, COUNT * sizeof(int));
            pid_t child = fork();
            if (child == 0) {
                int same = memcmp(recv, copy, COUNT * sizeof(int)) == 0;
                memset(recv, 0x11, COUNT * sizeof(int));
                memset(send, 0x22, COUNT * sizeof(int));
                _exit(same ? 0 : 3);
            }
            int status = 0;
            if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) ||
                WEXITSTATUS(status) != 0)
                suite_fail(&s, "call 3: the forked child did not read the result (status %d)",
                           status);
            if (memcmp(recv, copy, COUNT * sizeof(int)) != 0)
                suite_fail(&s, "call 3: the forked child's writes reached the parent's buffer");
            free(copy);
        } else if (call == 5) {
            if (madvise(p.base[1], p.span, MADV_DONTNEED) != 0)
                suite_fail(&s, "call 5: madvise failed");
            expect_zeros(&s, call, "receive", recv);
        } else if (call == 6) {
            if (madvise(p.base[0], p.span, MADV_DONTNEED) != 0)
                suite_fail(&s, "call 6: madvise failed");
            expect_zeros(&s, call, "send", send);
        } else if (call == 8) {
            /* The buffers swapped (each registered one now the other's). */
            int *t = send;
            send = recv;
            recv = t;
        } else if (call == 10) {
            /* The receive buffer broadcast twice (registered for that),
             * then given to the allreduce again. */
            int me;
            MPI_Comm_rank(MPI_COMM_WORLD, &me);
            for (int b = 0; b < 2; b++) {
                for (size_t i = 0; i < COUNT; i++)
                    recv[i] = me == 0 ? input(100 + b, 0, i) : 0;
                if (MPI_Bcast(recv, (int)COUNT, MPI_INT, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
                    suite_fail(&s, "call 10: MPI_Bcast failed");
                for (size_t i = 0; i < COUNT; i++)
                    if (recv[i] != input(100 + b, 0, i))
                        suite_fail(&s, "call 10: broadcast %d: element %zu is %d", b, i, recv[i]);
            }
        } else if (call == 12) {
            /* New memory at the same addresses. */
            for (int b = 0; b < 2; b++)
                if (munmap(p.base[b], p.span) != 0 ||
                    mmap(p.base[b], p.span, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != p.base[b])
                    suite_fail(&s, "call 12: could not map new memory at the same address");
        }
    }
    for (int b = 0; b < 2; b++)
        munmap(p.base[b], p.span);
    /* 300 KiB and 12 MiB pairs, three calls each (registered at the
     * second): regions of the smallest class and of the one above the
     * first pair's, the ring's maps of another class given up. */
    const size_t counts[] = {(300u << 8) + 3, (3u << 20) + 1};
    for (int k = 0; k < 2; k++) {
        struct pair q;
        map_pair(&s, &q, counts[k]);
        for (int call = 0; call < 3; call++)
            allreduce_call(&s, 20 + 3 * k + call, q.send, q.recv, counts[k]);
        for (int b = 0; b < 2; b++)
            munmap(q.base[b], q.span);
    }
    suite_verify_same(&s, MPI_COMM_WORLD);
    return suite_finish(&s);
}
