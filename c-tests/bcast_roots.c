/* MPI_Bcast from the first, last and middle root (--all-roots: from every
 * rank of world, which changes the case list and so the DIGEST), 0 bytes to 4 MiB, of
 * MPI_BYTE, MPI_INT and MPI_DOUBLE, on world, a dup and split communicators,
 * plus a contiguous derived type and a strided vector type (whose holes a
 * receiver must leave untouched: the shim may only take the byte-copy fast
 * path for contiguous data).
 *
 * Payload bytes are pseudo-random, so DOUBLE payloads include NaN bit
 * patterns that must arrive bit for bit. */
#define _GNU_SOURCE /* MREMAP_FIXED */
#include "common.h"

#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static size_t env_bytes(const char *name, size_t dflt)
{
    const char *v = getenv(name);
    long long b = v ? atoll(v) : 0;
    return b > 0 ? (size_t)b : dflt;
}

/* Root's payload: a function of (case seed, root's world rank, byte index). */
static void payload(uint64_t seed, int root_world, unsigned char *buf, size_t n)
{
    uint64_t rs = mix64(seed * 0x9e3779b97f4a7c15ULL + (uint64_t)root_world);
    for (size_t i = 0; i < n; i += 8) {
        uint64_t w = mix64(rs ^ (i * 0xd1b54a32d192ed03ULL));
        memcpy(buf + i, &w, n - i < 8 ? n - i : 8);
    }
}

struct bcase {
    const char *tname;
    MPI_Datatype dt;
    size_t tsize;
    size_t count;
    int root;
    const char *comm_name;
};

static uint64_t case_no;

static void run_bcast(struct suite *s, const struct bcase *b, MPI_Comm comm)
{
    char label[160];
    snprintf(label, sizeof label, "bcast type=%s count=%zu root=%d comm=%s", b->tname, b->count,
             b->root, b->comm_name);
    int me;
    MPI_Comm_rank(comm, &me);
    MPI_Group grp, world;
    int root_world;
    MPI_Comm_group(comm, &grp);
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    MPI_Group_translate_ranks(grp, 1, &b->root, world, &root_world);
    MPI_Group_free(&grp);
    MPI_Group_free(&world);

    case_no++;
    /* From the case itself, not a counter: ranks of different sub-communicators
     * run different numbers of cases. */
    uint64_t seed = fnv1a(FNV_OFFSET, label, strlen(label));
    size_t bytes = b->count * b->tsize;
    /* Every third buffer starts off any natural alignment boundary. */
    size_t mis = (case_no % 3 == 1) ? b->tsize : 0;
    unsigned char *buf = gbuf_alloc(bytes, mis);
    unsigned char *want = malloc(bytes ? bytes : 1);
    payload(seed, root_world, want, bytes);
    if (me == b->root)
        memcpy(buf, want, bytes);
    else
        memset(buf, 0xcd, bytes);

    int rc = MPI_Bcast(buf, (int)b->count, b->dt, b->root, comm);
    if (rc != MPI_SUCCESS)
        suite_fail(s, "%s: MPI_Bcast returned %d", label, rc);
    if (!gbuf_intact(buf, bytes))
        suite_fail(s, "%s: bytes around the buffer were overwritten", label);
    if (memcmp(buf, want, bytes) != 0) {
        size_t i = 0;
        while (buf[i] == want[i])
            i++;
        suite_fail(s, "%s: byte %zu is 0x%02x, root sent 0x%02x%s", label, i, buf[i], want[i],
                   me == b->root ? " (root's own buffer changed)" : "");
    }
    suite_record(s, label, buf, bytes, true, NULL);
    free(want);
    gbuf_free(buf, mis);
}

/* Derived types: a contiguous one (eligible: plain bytes) and a strided
 * vector (2 ints every 3): receivers' holes must keep their own values. */
static void run_derived(struct suite *s, MPI_Comm comm, size_t approx_bytes, int root, bool vector)
{
    char label[160];
    int me;
    MPI_Comm_rank(comm, &me);
    size_t nblocks = approx_bytes / 8 + 1; /* blocks of 2 ints */
    size_t nints = vector ? (nblocks - 1) * 3 + 2 : nblocks * 3;
    MPI_Datatype dt;
    int count;
    if (vector) {
        MPI_Type_vector((int)nblocks, 2, 3, MPI_INT, &dt);
        count = 1;
    } else {
        MPI_Type_contiguous(3, MPI_INT, &dt);
        count = (int)nblocks;
    }
    MPI_Type_commit(&dt);
    snprintf(label, sizeof label, "bcast derived=%s ints=%zu root=%d", vector ? "vector(2 of 3)" : "contiguous(3)",
             nints, root);

    size_t bytes = nints * 4;
    int *buf = gbuf_alloc(bytes, 0);
    int *want = malloc(bytes);
    payload(fnv1a(FNV_OFFSET, label, strlen(label)), root, (unsigned char *)want, bytes);
    for (size_t i = 0; i < nints; i++) {
        bool hole = vector && i % 3 == 2;
        /* Holes: each rank's own marker, on root and receivers alike. */
        if (hole)
            want[i] = (int)(0x5a000000u + (unsigned)me);
        buf[i] = (me == root || hole) ? want[i] : (int)0xcdcdcdcd;
    }
    int rc = MPI_Bcast(buf, count, dt, root, comm);
    if (rc != MPI_SUCCESS)
        suite_fail(s, "%s: MPI_Bcast returned %d", label, rc);
    if (!gbuf_intact(buf, bytes))
        suite_fail(s, "%s: bytes around the buffer were overwritten", label);
    for (size_t i = 0; i < nints; i++)
        if (buf[i] != want[i])
            suite_fail(s, "%s: int %zu is 0x%08x, expected 0x%08x%s", label, i, (unsigned)buf[i],
                       (unsigned)want[i], vector && i % 3 == 2 ? " (a hole of the vector type was written)" : "");
    /* Holes differ per rank by design: digest only the transferred ints. */
    for (size_t i = 0; i < nints; i++)
        if (vector && i % 3 == 2)
            buf[i] = 0;
    suite_record(s, label, buf, bytes, true, NULL);
    free(want);
    gbuf_free(buf, 0);
    MPI_Type_free(&dt);
}

/* The program's own SIGBUS action (installed after MPI_Init, before any
 * broadcast): a fault it expects (`bus_expected`) jumps back to `bus_jump`;
 * any other ends the rank with a message, as a program's handler would. */
static sigjmp_buf bus_jump;
static volatile sig_atomic_t bus_expected;
static void *volatile bus_addr;

static void on_bus(int sig, siginfo_t *info, void *ctx)
{
    (void)sig;
    (void)ctx;
    bus_addr = info->si_addr;
    if (bus_expected)
        siglongjmp(bus_jump, 1);
    static const char msg[] = "bcast_roots: unexpected SIGBUS in the program's handler\n";
    ssize_t unused = write(2, msg, sizeof msg - 1);
    (void)unused;
    _exit(97);
}

static void install_bus_handler(void)
{
    struct sigaction act;
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_bus;
    act.sa_flags = SA_SIGINFO;
    sigemptyset(&act.sa_mask);
    sigaction(SIGBUS, &act, NULL);
}

/* A SIGBUS of the program's own (a read past the end of a file it mapped,
 * at `at` if not NULL, then truncated) must reach its handler, also when
 * liberar's (which mends its registered pages) was installed after it, and
 * where a freed buffer's region still keeps its guard. */
static void expect_own_sigbus(struct suite *s, const char *label, void *at)
{
    FILE *f = tmpfile();
    if (!f || ftruncate(fileno(f), 4096) != 0)
        suite_fail(s, "%s: no file to map", label);
    volatile unsigned char *p =
        mmap(at, 4096, PROT_READ, MAP_SHARED | (at ? MAP_FIXED_NOREPLACE : 0), fileno(f), 0);
    if (p == MAP_FAILED || (at && (void *)p != at) || ftruncate(fileno(f), 0) != 0)
        suite_fail(s, "%s: could not map and truncate a file", label);
    bus_addr = NULL;
    if (sigsetjmp(bus_jump, 1) == 0) {
        bus_expected = 1;
        (void)p[0];
        bus_expected = 0;
        suite_fail(s, "%s: reading past a truncated file raised no SIGBUS", label);
    }
    bus_expected = 0;
    if (bus_addr != (void *)p)
        suite_fail(s, "%s: the program's SIGBUS handler saw address %p, not %p", label, bus_addr,
                   (void *)p);
    munmap((void *)p, 4096);
    fclose(f);
}

/* One buffer broadcast again and again from every root, as OSU and training
 * loops do (liberar then registers it: XDP reads and writes it in place, its
 * whole pages a BPF map's), and what a caller may do to its memory between
 * calls: fork a child that reads and writes it, drop its pages
 * (MADV_DONTNEED, as allocators do with freed memory: it must read zeros),
 * raise a SIGBUS of its own, unmap it and map new memory at the same
 * address. The buffer starts 13 bytes into a page and ends inside one. */
static void run_reused(struct suite *s)
{
    int me, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    const size_t bytes = (3u << 20) + 5, span = bytes + 13 + 4096;
    unsigned char *base = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED)
        suite_fail(s, "reused: mmap failed");
    unsigned char *buf = base + 13, *want = malloc(bytes);
    for (int call = 0; call < 12; call++) {
        char label[96];
        int root = call % n;
        snprintf(label, sizeof label, "bcast reused call=%d root=%d", call, root);
        payload(fnv1a(FNV_OFFSET, label, strlen(label)), root, want, bytes);
        if (me == root)
            memcpy(buf, want, bytes);
        else
            memset(buf, 0xcd, bytes);
        if (MPI_Bcast(buf, (int)bytes, MPI_BYTE, root, MPI_COMM_WORLD) != MPI_SUCCESS)
            suite_fail(s, "%s: MPI_Bcast failed", label);
        if (memcmp(buf, want, bytes) != 0)
            suite_fail(s, "%s: wrong bytes%s", label, me == root ? " (root's own buffer changed)" : "");
        suite_record(s, label, buf, bytes, true, NULL);
        if (call == 3) {
            /* A child reads the result, overwrites it and exits: the
             * parent's buffer keeps its bytes. */
            pid_t child = fork();
            if (child == 0) {
                int same = memcmp(buf, want, bytes) == 0;
                memset(buf, 0x11, bytes);
                _exit(same ? 0 : 3);
            }
            int status = 0;
            if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) ||
                WEXITSTATUS(status) != 0)
                suite_fail(s, "%s: the forked child did not read the broadcast (status %d)", label,
                           status);
            if (memcmp(buf, want, bytes) != 0)
                suite_fail(s, "%s: the forked child's writes reached the parent's buffer", label);
        } else if (call == 5) {
            expect_own_sigbus(s, label, NULL);
        } else if (call == 6) {
            if (madvise(base, span, MADV_DONTNEED) != 0)
                suite_fail(s, "%s: madvise failed", label);
            for (size_t i = 0; i < bytes; i++)
                if (buf[i] != 0)
                    suite_fail(s, "%s: byte %zu reads 0x%02x after MADV_DONTNEED, not 0", label, i, buf[i]);
        } else if (call == 9) {
            if (munmap(base, span) != 0 ||
                mmap(base, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != base)
                suite_fail(s, "%s: could not map new memory at the same address", label);
        }
    }
    free(want);
    munmap(base, span);
}

/* `buf` broadcast from rank 0 with the payload `label` names (in `want`
 * too), and checked: every rank must end with the root's bytes. */
static void bcast_checked(struct suite *s, const char *label, unsigned char *buf,
                          unsigned char *want, size_t bytes)
{
    int me;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    payload(fnv1a(FNV_OFFSET, label, strlen(label)), 0, want, bytes);
    if (me == 0)
        memcpy(buf, want, bytes);
    else
        memset(buf, 0xcd, bytes);
    if (MPI_Bcast(buf, (int)bytes, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
        suite_fail(s, "%s: MPI_Bcast failed", label);
    if (memcmp(buf, want, bytes) != 0)
        suite_fail(s, "%s: wrong bytes", label);
}

/* A new buffer of `bytes` (its own pages), broadcast into twice with the
 * payload `label` names, checked each time and recorded: liberar registers
 * a buffer at its second call in a row, and gives the buffer registered
 * before its pages back. Returns it, and in *want its bytes. */
static unsigned char *broadcast_new_twice(struct suite *s, const char *label, size_t bytes,
                                          unsigned char **want)
{
    unsigned char *w = malloc(bytes);
    unsigned char *buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (!w || buf == MAP_FAILED)
        suite_fail(s, "%s: no memory", label);
    for (int call = 0; call < 2; call++)
        bcast_checked(s, label, buf, w, bytes);
    suite_record(s, label, buf, bytes, true, NULL);
    *want = w;
    return buf;
}

/* Registered buffers the caller frees while they are registered, as a
 * program frees a buffer it broadcast twice: the whole of one, then a fork
 * (the child must not read its unmapped pages) and a file of its own mapped
 * there (its SIGBUS is the program's); the middle of the next and the
 * pages of its last MiB dropped, then a third buffer registered, which
 * drops the second's region (the pages still there keep their bytes, the
 * dropped ones read zeros afterwards with no fault, the hole is left
 * alone). */
static void run_freed(struct suite *s)
{
    const size_t bytes = 3u << 20, mib = 1u << 20;
    unsigned char *want[3], *buf[3];
    for (int round = 0; round < 3; round++) {
        char label[96];
        snprintf(label, sizeof label, "bcast freed round=%d", round);
        buf[round] = broadcast_new_twice(s, label, bytes, &want[round]);
        if (round == 0) {
            /* Freed, and a page of something else in the middle (so that
             * the range is not one hole a new mapping would fill). */
            munmap(buf[0], bytes);
            void *other = mmap(buf[0] + mib, 4096, PROT_NONE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
            if (other != buf[0] + mib)
                suite_fail(s, "%s: could not map a page where the buffer was", label);
            pid_t child = fork();
            if (child == 0)
                _exit(0);
            int status = 0;
            if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) ||
                WEXITSTATUS(status) != 0)
                suite_fail(s, "%s: a child forked after the buffer was freed failed (status %d)",
                           label, status);
            expect_own_sigbus(s, label, buf[0]);
            munmap(other, 4096);
        } else if (round == 1) {
            /* The middle freed, the last MiB's pages dropped (an allocator's
             * purge) and not touched before the region is dropped. */
            munmap(buf[1] + mib, mib);
            if (madvise(buf[1] + 2 * mib, mib, MADV_DONTNEED) != 0)
                suite_fail(s, "%s: madvise failed", label);
        } else {
            if (memcmp(buf[1], want[1], mib) != 0)
                suite_fail(s, "%s: the partly freed buffer before lost its bytes", label);
            for (size_t i = 2 * mib; i < bytes; i++)
                if (buf[1][i] != 0)
                    suite_fail(s, "%s: a dropped page of the buffer before reads 0x%02x at %zu, not 0",
                               label, buf[1][i], i);
            munmap(buf[1], mib);
            munmap(buf[1] + 2 * mib, mib);
            munmap(buf[2], bytes);
        }
    }
    for (int round = 0; round < 3; round++)
        free(want[round]);
}

/* A registered buffer the caller moves elsewhere (mremap, as realloc does
 * with a large block), then another buffer registered: the moved pages keep
 * their bytes while the new buffer is broadcast into (its region must not
 * be the moved pages' map, which liberar would otherwise reuse). */
static void run_moved(struct suite *s)
{
    const size_t bytes = 3u << 20;
    unsigned char *want[2], *buf[2];
    for (int round = 0; round < 2; round++) {
        char label[96];
        snprintf(label, sizeof label, "bcast moved round=%d", round);
        buf[round] = broadcast_new_twice(s, label, bytes, &want[round]);
        if (round == 0) {
            /* The system call, as glibc's realloc makes it: UCX (under
             * MPICH) interposes mremap and drops its fifth argument. */
            void *to = mmap(NULL, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            void *moved = to == MAP_FAILED ? MAP_FAILED
                                           : (void *)syscall(SYS_mremap, buf[0], bytes, bytes,
                                                             MREMAP_MAYMOVE | MREMAP_FIXED, to);
            if (moved != to)
                suite_fail(s, "%s: could not move the buffer", label);
            buf[0] = moved;
        }
    }
    if (memcmp(buf[0], want[0], bytes) != 0)
        suite_fail(s, "bcast moved: the moved buffer changed while the next one was broadcast");
    for (int round = 0; round < 2; round++) {
        munmap(buf[round], bytes);
        free(want[round]);
    }
}

/* The pages of `buf` dropped must read zeros, with no fault. */
static void expect_zeros_when_dropped(struct suite *s, const char *label, unsigned char *buf,
                                      size_t bytes)
{
    if (madvise(buf, bytes, MADV_DONTNEED) != 0)
        suite_fail(s, "%s: madvise failed", label);
    for (size_t i = 0; i < bytes; i++)
        if (buf[i] != 0)
            suite_fail(s, "%s: byte %zu reads 0x%02x after MADV_DONTNEED, not 0", label, i, buf[i]);
}

/* A 1 MiB int SUM on world (over the allreduce floor of every routing),
 * checked against the sum computed here and recorded. */
static void allreduce_checked(struct suite *s, const char *label)
{
    int me, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    const size_t count = 1u << 18;
    int *in = malloc(count * sizeof(int)), *out = malloc(count * sizeof(int));
    if (!in || !out)
        suite_fail(s, "%s: no memory", label);
    for (size_t i = 0; i < count; i++)
        in[i] = (int)((i * 7 + (size_t)me * 13) % 1000);
    if (MPI_Allreduce(in, out, (int)count, MPI_INT, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS)
        suite_fail(s, "%s: MPI_Allreduce failed", label);
    for (size_t i = 0; i < count; i++) {
        int want = 0;
        for (int r = 0; r < n; r++)
            want += (int)((i * 7 + (size_t)r * 13) % 1000);
        if (out[i] != want)
            suite_fail(s, "%s: element %zu is %d, not %d", label, i, out[i], want);
    }
    suite_record(s, label, out, count * sizeof(int), true, NULL);
    free(in);
    free(out);
}

/* Last (liberar registers no buffer after it): the program installs its
 * SIGBUS action anew, over liberar's, after two broadcasts of a buffer
 * liberar registered, then makes an allreduce on the same communicator:
 * the pages it drops after that must read zeros, with no fault (liberar
 * gave them back before that call, whichever path the call took); and so
 * after the next broadcast of the buffer, which copies. */
static void run_taken_over(struct suite *s)
{
    const size_t bytes = 3u << 20;
    unsigned char *want = malloc(bytes);
    unsigned char *buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (!want || buf == MAP_FAILED)
        suite_fail(s, "bcast taken over: no memory");
    for (int call = 0; call < 3; call++) {
        char label[96];
        snprintf(label, sizeof label, "bcast taken over call=%d", call);
        bcast_checked(s, label, buf, want, bytes);
        suite_record(s, label, buf, bytes, true, NULL);
        if (call == 1) {
            install_bus_handler();
            allreduce_checked(s, "bcast taken over: then an allreduce");
            expect_zeros_when_dropped(s, "bcast taken over: after the allreduce", buf, bytes);
        }
    }
    expect_zeros_when_dropped(s, "bcast taken over: after the broadcast", buf, bytes);
    munmap(buf, bytes);
    free(want);
}

/* --all-roots: world's cases run from every root, not only three. */
static bool all_roots;

static void roots_of(int n, int roots[3], int *nroots)
{
    int cand[3] = {0, n - 1, n / 2};
    *nroots = 0;
    for (int k = 0; k < 3; k++) {
        bool dup = false;
        for (int j = 0; j < *nroots; j++)
            dup |= roots[j] == cand[k];
        if (!dup)
            roots[(*nroots)++] = cand[k];
    }
}

static void run_sizes(struct suite *s, MPI_Comm comm, const char *name, const size_t *sizes, size_t nsizes,
                      bool all_types)
{
    struct {
        const char *name;
        MPI_Datatype dt;
        size_t size;
    } types[3] = {{"BYTE", MPI_BYTE, 1}, {"DOUBLE", MPI_DOUBLE, 8}, {"INT", MPI_INT, 4}};
    int n, three[3], nroots;
    MPI_Comm_size(comm, &n);
    roots_of(n, three, &nroots);
    int *roots = three;
    if (all_roots && comm == MPI_COMM_WORLD) {
        roots = malloc(sizeof(int) * (size_t)n);
        for (int r = 0; r < n; r++)
            roots[r] = r;
        nroots = n;
    }
    for (int ti = 0; ti < (all_types ? 3 : 2); ti++)
        for (size_t si = 0; si < nsizes; si++)
            for (int r = 0; r < nroots; r++) {
                size_t count = sizes[si] / types[ti].size;
                if (count == 0 && sizes[si] > 0)
                    count = 1;
                struct bcase b = {types[ti].name, types[ti].dt, types[ti].size, count, roots[r], name};
                run_bcast(s, &b, comm);
            }
    if (roots != three)
        free(roots);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    install_bus_handler();
    /* Our own option, taken out before the common ones are parsed. */
    int kept = 1;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--all-roots"))
            all_roots = true;
        else
            argv[kept++] = argv[a];
    }
    argc = kept;
    struct suite s;
    suite_init(&s, "bcast_roots", argc, argv);
    int rank = s.world_rank, size = s.world_size;
    /* Sizes sit around the default threshold; a different
     * ERAR_BCAST_MIN_BYTES adds its own edges, outside the digest. */
    size_t thr = 512 * 1024, env_thr = env_bytes("ERAR_BCAST_MIN_BYTES", thr);

    size_t full[] = {0, 1, 7, 4096, thr - 1, thr, thr + 1, (1u << 20) + 3, 4u << 20};
    size_t quick[] = {0, 1, 4096, thr + 1, (1u << 20) + 3};
    size_t sub[] = {1, 4096, thr + 1, (1u << 20) + 3};
    if (s.quick)
        run_sizes(&s, MPI_COMM_WORLD, "world", quick, sizeof quick / sizeof quick[0], true);
    else
        run_sizes(&s, MPI_COMM_WORLD, "world", full, sizeof full / sizeof full[0], true);
    if (env_thr != thr) {
        size_t edges[] = {env_thr - 1, env_thr, env_thr + 1};
        s.no_digest = true;
        run_sizes(&s, MPI_COMM_WORLD, "world_env_threshold", edges, 3, true);
        s.no_digest = false;
    }
    suite_verify_same(&s, MPI_COMM_WORLD);
    run_reused(&s);
    run_freed(&s);
    run_moved(&s);
    run_taken_over(&s);
    suite_verify_same(&s, MPI_COMM_WORLD);

    MPI_Comm dup, parity, reversed;
    MPI_Comm_dup(MPI_COMM_WORLD, &dup);
    MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &parity);
    MPI_Comm_split(MPI_COMM_WORLD, 0, size - rank, &reversed);
    size_t one[] = {thr + 1};
    run_sizes(&s, dup, "dup", one, 1, false);
    suite_verify_same(&s, dup);
    run_sizes(&s, reversed, "split_reversed", sub, sizeof sub / sizeof sub[0], false);
    suite_verify_same(&s, reversed);
    run_sizes(&s, parity, "split_parity", sub, sizeof sub / sizeof sub[0], false);
    suite_verify_same(&s, parity);

    int roots[3], nroots;
    roots_of(size, roots, &nroots);
    for (int r = 0; r < nroots; r += nroots - 1 > 0 ? nroots - 1 : 1) {
        run_derived(&s, MPI_COMM_WORLD, thr + 100, roots[r], false);
        run_derived(&s, MPI_COMM_WORLD, thr + 100, roots[r], true);
        run_derived(&s, MPI_COMM_WORLD, 300, roots[r], true);
    }
    suite_verify_same(&s, MPI_COMM_WORLD);

    MPI_Comm_free(&reversed);
    MPI_Comm_free(&parity);
    MPI_Comm_free(&dup);
    return suite_finish(&s);
}
