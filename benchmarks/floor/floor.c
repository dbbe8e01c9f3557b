// SPDX-License-Identifier: (Apache-2.0 OR MIT)
/*
 * floor.c - the least CPU an in-kernel ring's allreduce or broadcast can
 * take on this machine: the work no design of it can skip, each piece
 * timed alone at its best, added up. See benchmarks/floor/README.md.
 *
 * The pieces (S bytes a call, N hosts with one rank each):
 *   - every rank copies its input into kernel memory and its result out
 *     of it (BPF cannot read or write a process's buffer from softirq): 2S
 *     a rank, timed here as copies from a buffer into a mmapped BPF array
 *     and back, with memcpy and with streaming stores, every CPU copying at
 *     once (the best of the two);
 *   - the kernel puts each host's share into frames (S in all), combines
 *     (N-1)S bytes in reduce-scatter hops and stores (N-1)S in all-gather
 *     hops: floor.bpf.c, erar_reduce.h's own loop, run by BPF_PROG_RUN on a
 *     frame in the cache;
 *   - with --hop-ns H: every host receives 2(N-1)S/N bytes at the least,
 *     in frames of --frame-bytes payload (default the largest, 8936 at MTU
 *     9000), each costing H ns of CPU to move one hop (veth, the switch,
 *     the redirect; measure it on the real ring, see the README).
 * Left out, so the floor stays a floor: injecting frames, waking the
 * ranks, barriers, the caller's own skew. A broadcast copies S in at the
 * root and S out at every other host, puts S into frames, stores (N-1)S,
 * and moves (N-1)S bytes.
 *
 *   floor OBJ [--size BYTES] [--hosts N] [--mpi-us T] [--hop-ns H]
 *             [--frame-bytes B] [--sets K] [--rounds R]
 *
 * --sets: ranks whose buffers each CPU copies in turn (default: the hosts
 * shared out over the CPUs), so the copies see a call's working set.
 *
 * With --mpi-us (MPI's time for the same call, measured in the same run),
 * it prints the largest speed-up over MPI that the floor leaves.
 *
 * It then prints the same sum with the combines and stores timed on chunks
 * that come from memory (floor.bpf.c's rs_mem and ag_mem): not a floor,
 * but what a call pays whose chunks the cache no longer holds when their
 * frames arrive, as a call larger than the cache does unless its design
 * brings them back in first.
 */
#define _GNU_SOURCE
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <errno.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "erar_wire.h"

#define NB ERAR_MAX_LINEAR_CHUNK_BYTES
#define MAX_THREADS 64

static double now(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

static void die(const char *what)
{
	fprintf(stderr, "floor: %s: %s\n", what, strerror(errno));
	exit(1);
}

/* ---- the kernel's per-byte work ---------------------------------------- */

/* The average ns of one run of `prog` over `repeat` runs, best of `rounds`. */
static double prog_ns(int prog, const void *frame, unsigned repeat, int rounds)
{
	double best = 1e18;

	for (int r = 0; r < rounds; r++) {
		LIBBPF_OPTS(bpf_test_run_opts, opts, .data_in = frame, .data_size_in = NB,
			    .repeat = repeat);
		if (bpf_prog_test_run_opts(prog, &opts))
			die("BPF_PROG_RUN");
		if (opts.retval != XDP_DROP) {
			fprintf(stderr, "floor: a program returned %u, not XDP_DROP\n", opts.retval);
			exit(1);
		}
		if (opts.duration < best)
			best = opts.duration;
	}
	return best;
}

static int prog_fd(struct bpf_object *obj, const char *name)
{
	struct bpf_program *p = bpf_object__find_program_by_name(obj, name);

	if (!p) {
		fprintf(stderr, "floor: no program %s in the object\n", name);
		exit(1);
	}
	return bpf_program__fd(p);
}

/* Runs store program `prog` (`name`) once on `frame` and checks that
 * element `key` of map `fd` then holds the frame's payload. */
static void expect_stored(int prog, const char *name, const uint32_t *frame, int fd,
			  uint32_t key)
{
	uint32_t back[NB / 4];

	LIBBPF_OPTS(bpf_test_run_opts, r, .data_in = frame, .data_size_in = NB, .repeat = 1);
	if (bpf_prog_test_run_opts(prog, &r)) {
		fprintf(stderr, "floor: BPF_PROG_RUN %s: %s\n", name, strerror(errno));
		exit(1);
	}
	if (bpf_map_lookup_elem(fd, &key, back))
		die("reading back a stored chunk");
	if (memcmp(back, frame, NB)) {
		fprintf(stderr, "floor: %s did not store the frame's payload\n", name);
		exit(1);
	}
}

/* Checks that `rs` and `ag` do their work: one run each on known data, the
 * frame and the chunk read back, against sums computed here. */
static void check_programs(int rs, int ag, int own_fd)
{
	uint32_t frame[NB / 4], mine[NB / 4], out[NB / 4];
	uint32_t zero = 0;

	for (unsigned i = 0; i < NB / 4; i++) {
		frame[i] = 0x9e3779b9u * (i + 1);
		mine[i] = 0x7f4a7c15u * (i + 3) ^ 0x80000000u;
	}
	if (bpf_map_update_elem(own_fd, &zero, mine, BPF_ANY))
		die("writing the chunk");
	LIBBPF_OPTS(bpf_test_run_opts, r1, .data_in = frame, .data_size_in = NB,
		    .data_out = out, .data_size_out = NB, .repeat = 1);
	if (bpf_prog_test_run_opts(rs, &r1))
		die("BPF_PROG_RUN rs");
	for (unsigned i = 0; i < NB / 4; i++)
		if (out[i] != frame[i] + mine[i]) {
			fprintf(stderr, "floor: rs word %u: %u, not %u\n", i, out[i],
				frame[i] + mine[i]);
			exit(1);
		}
	expect_stored(ag, "ag", frame, own_fd, zero);
}

/* Checks `rs_mem` and `ag_mem` on known data: on a fresh object, pinned
 * to one CPU (their chunk counter is per CPU), rs_mem's first run combines
 * into the first cold chunk (all zero: the frame comes out unchanged, and
 * the chunk keeps it) and ag_mem's first run stores into the second. */
static void check_cold_programs(int rs_mem, int ag_mem, int cold_fd)
{
	uint32_t frame[NB / 4], other[NB / 4], out[NB / 4], back[NB / 4];
	uint32_t zero = 0;
	cpu_set_t was, here;

	if (sched_getaffinity(0, sizeof(was), &was))
		die("reading the affinity mask");
	CPU_ZERO(&here);
	CPU_SET(sched_getcpu(), &here);
	if (sched_setaffinity(0, sizeof(here), &here))
		die("binding to one CPU");
	for (unsigned i = 0; i < NB / 4; i++) {
		frame[i] = 0x85ebca6bu * (i + 5);
		other[i] = 0xc2b2ae35u * (i + 11);
	}
	LIBBPF_OPTS(bpf_test_run_opts, r1, .data_in = frame, .data_size_in = NB,
		    .data_out = out, .data_size_out = NB, .repeat = 1);
	if (bpf_prog_test_run_opts(rs_mem, &r1))
		die("BPF_PROG_RUN rs_mem");
	if (bpf_map_lookup_elem(cold_fd, &zero, back))
		die("reading the first cold chunk");
	if (memcmp(out, frame, NB) || memcmp(back, frame, NB)) {
		fprintf(stderr, "floor: rs_mem did not combine with the zero chunk\n");
		exit(1);
	}
	expect_stored(ag_mem, "ag_mem", other, cold_fd, 1);
	if (sched_setaffinity(0, sizeof(was), &was))
		die("restoring the affinity mask");
}

/* ---- the copies ---------------------------------------------------------- */

__attribute__((target("avx2"))) static void copy_stream(void *dst, const void *src, size_t n)
{
	char *d = dst;
	const char *s = src;
	size_t i = 0;

	for (; i + 128 <= n; i += 128) {
		__m256i a = _mm256_loadu_si256((const void *)(s + i));
		__m256i b = _mm256_loadu_si256((const void *)(s + i + 32));
		__m256i c = _mm256_loadu_si256((const void *)(s + i + 64));
		__m256i e = _mm256_loadu_si256((const void *)(s + i + 96));

		_mm256_stream_si256((void *)(d + i), a);
		_mm256_stream_si256((void *)(d + i + 32), b);
		_mm256_stream_si256((void *)(d + i + 64), c);
		_mm256_stream_si256((void *)(d + i + 96), e);
	}
	memcpy(d + i, s + i, n - i);
	_mm_sfence();
}

struct copier {
	size_t bytes;
	int sets, rounds, stream;
	pthread_barrier_t *start;
	double gbps; /* out: in and out copies, bytes a second */
};

/* `sets` ranks' buffers: an input and a result buffer of the process and a
 * mmapped BPF array between them (the slot as liberar lays it out: chunks
 * of NB bytes back to back); copies each rank's input in and its result
 * out in turn, as that many ranks' calls on this CPU would; best round. */
static void *copier_run(void *arg)
{
	struct copier *c = arg;
	size_t chunks = c->bytes / NB + 1, len = chunks * NB;
	size_t pages = (len + 4095) & ~(size_t)4095; /* aligned_alloc's size */
	char *in[16], *out[16], *slot[16];
	double best = 0;

	for (int k = 0; k < c->sets; k++) {
		LIBBPF_OPTS(bpf_map_create_opts, mo, .map_flags = BPF_F_MMAPABLE);
		int fd = bpf_map_create(BPF_MAP_TYPE_ARRAY, "floor_slot", 4, NB, chunks, &mo);

		if (fd < 0)
			die("creating a slot map");
		slot[k] = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (slot[k] == MAP_FAILED)
			die("mapping a slot map");
		in[k] = aligned_alloc(4096, pages);
		out[k] = aligned_alloc(4096, pages);
		if (!in[k] || !out[k])
			die("allocating a buffer");
		memset(in[k], k + 1, len);
		memset(out[k], 0, len);
		memset(slot[k], 0, len);
	}
	pthread_barrier_wait(c->start);
	for (int r = 0; r < c->rounds; r++) {
		double t0 = now();

		for (int k = 0; k < c->sets; k++) {
			if (c->stream) {
				copy_stream(slot[k], in[k], c->bytes);
				copy_stream(out[k], slot[k], c->bytes);
			} else {
				memcpy(slot[k], in[k], c->bytes);
				memcpy(out[k], slot[k], c->bytes);
			}
		}
		double rate = 2.0 * c->sets * c->bytes / (now() - t0);

		if (rate > best)
			best = rate;
	}
	c->gbps = best / 1e9;
	return NULL;
}

/* GB/s a CPU copies while `threads` CPUs copy at once (their mean). */
static double copy_rate(size_t bytes, int threads, int sets, int rounds, int stream)
{
	pthread_t t[MAX_THREADS];
	struct copier c[MAX_THREADS];
	pthread_barrier_t start;
	double sum = 0;

	pthread_barrier_init(&start, NULL, threads);
	for (int i = 0; i < threads; i++) {
		c[i] = (struct copier){ bytes, sets, rounds, stream, &start, 0 };
		if (pthread_create(&t[i], NULL, copier_run, &c[i]))
			die("starting a copier");
	}
	for (int i = 0; i < threads; i++) {
		pthread_join(t[i], NULL);
		sum += c[i].gbps;
	}
	pthread_barrier_destroy(&start);
	return sum / threads;
}

/* ---- the floor ----------------------------------------------------------- */

int main(int argc, char **argv)
{
	size_t size = 16 << 20;
	int hosts = 4, sets = 0, rounds = 5;
	double mpi_us = 0, hop_ns = 0, frame_bytes = ERAR_MAX_CHUNK_BYTES;
	const char *obj_path = NULL;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--size") && i + 1 < argc)
			size = strtoull(argv[++i], NULL, 0);
		else if (!strcmp(argv[i], "--hosts") && i + 1 < argc)
			hosts = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--mpi-us") && i + 1 < argc)
			mpi_us = atof(argv[++i]);
		else if (!strcmp(argv[i], "--hop-ns") && i + 1 < argc)
			hop_ns = atof(argv[++i]);
		else if (!strcmp(argv[i], "--frame-bytes") && i + 1 < argc)
			frame_bytes = atof(argv[++i]);
		else if (!strcmp(argv[i], "--sets") && i + 1 < argc)
			sets = atoi(argv[++i]);
		else if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
			rounds = atoi(argv[++i]);
		else if (argv[i][0] != '-' && !obj_path)
			obj_path = argv[i];
		else {
			fprintf(stderr, "usage: floor OBJ [--size BYTES] [--hosts N] [--mpi-us T] "
					"[--hop-ns H] [--frame-bytes B] [--sets K] [--rounds R]\n");
			return 2;
		}
	}
	int cpus = (int)sysconf(_SC_NPROCESSORS_ONLN);
	if (cpus > MAX_THREADS)
		cpus = MAX_THREADS;
	if (!sets) /* each CPU copies for its share of the ranks */
		sets = (hosts + cpus - 1) / cpus;
	if (!obj_path || hosts < 2 || sets < 1 || sets > 16 || rounds < 1 || size < NB ||
	    hop_ns < 0 || frame_bytes < 64) {
		fprintf(stderr, "floor: an object, --hosts >= 2, --sets 1..16, --size >= %d, "
				"--hop-ns >= 0, --frame-bytes >= 64\n", NB);
		return 2;
	}
	struct bpf_object *obj = bpf_object__open_file(obj_path, NULL);
	if (!obj || bpf_object__load(obj))
		die("loading the object");
	int rs = prog_fd(obj, "rs"), ag = prog_fd(obj, "ag"), empty = prog_fd(obj, "empty");
	int own_fd = bpf_object__find_map_fd_by_name(obj, "own_chunk");
	if (own_fd < 0)
		die("the object's own_chunk map");
	check_programs(rs, ag, own_fd);
	int rs_mem = prog_fd(obj, "rs_mem"), ag_mem = prog_fd(obj, "ag_mem");
	int cold_fd = bpf_object__find_map_fd_by_name(obj, "cold_slot");
	if (cold_fd < 0)
		die("the object's cold_slot map");
	check_cold_programs(rs_mem, ag_mem, cold_fd);

	static uint8_t frame[NB];
	for (unsigned i = 0; i < NB; i++)
		frame[i] = (uint8_t)(i * 131 + 7);
	const unsigned repeat = 100000;
	double t_empty = prog_ns(empty, frame, repeat, rounds);
	double t_rs = prog_ns(rs, frame, repeat, rounds) - t_empty;
	double t_ag = prog_ns(ag, frame, repeat, rounds) - t_empty;
	double rs_b = t_rs / NB, ag_b = t_ag / NB; /* ns a byte */

	double t_mem = prog_ns(rs_mem, frame, repeat, rounds) - t_empty;
	double t_ag_mem = prog_ns(ag_mem, frame, repeat, rounds) - t_empty;

	printf("kernel, a %d-byte frame in the cache (BPF_PROG_RUN x%u, best of %d):\n", NB,
	       repeat, rounds);
	printf("  run's fixed cost %.0f ns; combine (ADD_I32) %.0f ns = %.3f ns/B; "
	       "store (fill, all-gather) %.0f ns = %.3f ns/B\n",
	       t_empty, t_rs, rs_b, t_ag, ag_b);
	printf("  (not in the floor: on a chunk from 64 MiB of them, the combine as erar_xdp\n"
	       "   makes it, keeping the partial sum, %.0f ns = %.3f ns/B; the store %.0f ns = "
	       "%.3f ns/B)\n",
	       t_mem, t_mem / NB, t_ag_mem, t_ag_mem / NB);

	double best = 0;
	const char *how = "";
	for (int stream = 0; stream < 2; stream++) {
		for (int threads = 1; threads <= cpus; threads += cpus > 1 ? cpus - 1 : 1) {
			double r = copy_rate(size, threads, sets, rounds, stream);

			printf("copies, %zu B in and out of a mmapped BPF array, %d sets, %d CPU(s) at "
			       "once, %s: %.1f GB/s a CPU\n",
			       size, sets, threads, stream ? "streaming stores" : "memcpy", r);
			if (threads == cpus && r > best) {
				best = r;
				how = stream ? "streaming stores" : "memcpy";
			}
		}
	}

	double s = (double)size, n = hosts;
	double copy_ns = 1.0 / best; /* ns a byte, GB/s = B/ns */
	/* CPU ns of each piece */
	double ar_copies = n * 2 * s * copy_ns, bc_copies = n * s * copy_ns;
	double ar_kernel = s * ag_b + (n - 1) * s * (rs_b + ag_b);
	double bc_kernel = s * ag_b + (n - 1) * s * ag_b;
	double ar_hops = 2 * (n - 1) * s / frame_bytes * hop_ns;
	double bc_hops = (n - 1) * s / frame_bytes * hop_ns;
	double ar = ar_copies + ar_kernel + ar_hops, bc = bc_copies + bc_kernel + bc_hops;
	/* The same with every chunk out of the cache when its frame comes:
	 * what a call larger than the cache pays unless something brings its
	 * chunks back in first. Not a floor: a design may avoid it. */
	double rs_mem_b = t_mem / NB, ag_mem_b = t_ag_mem / NB;
	double ar_cold = ar_copies + s * ag_mem_b + (n - 1) * s * (rs_mem_b + ag_mem_b) + ar_hops;
	double bc_cold = bc_copies + n * s * ag_mem_b + bc_hops;

	printf("\nfloor of one call, %zu B, %d hosts with one rank each, %d CPUs "
	       "(copies at %.1f GB/s a CPU, %s; %.0f ns a frame-hop, %.0f-byte frames):\n",
	       size, hosts, cpus, best, how, hop_ns, frame_bytes);
	printf("  allreduce: copies %.0f + kernel payload work %.0f + frame-hops %.0f us of CPU"
	       " = %.0f us; %.0f us on %d CPUs\n",
	       ar_copies / 1e3, ar_kernel / 1e3, ar_hops / 1e3, ar / 1e3, ar / 1e3 / cpus, cpus);
	printf("  broadcast: copies %.0f + kernel payload work %.0f + frame-hops %.0f us of CPU"
	       " = %.0f us; %.0f us on %d CPUs\n",
	       bc_copies / 1e3, bc_kernel / 1e3, bc_hops / 1e3, bc / 1e3, bc / 1e3 / cpus, cpus);
	if (mpi_us > 0)
		printf("  against MPI's %.0f us: at most %.2fx (allreduce), %.2fx (broadcast)\n",
		       mpi_us, mpi_us / (ar / 1e3 / cpus), mpi_us / (bc / 1e3 / cpus));
	printf("with the kernel's chunks out of the cache (not a floor: what a call pays whose\n"
	       "chunks the cache no longer holds when their frames come):\n"
	       "  allreduce %.0f us, broadcast %.0f us on %d CPUs\n",
	       ar_cold / 1e3 / cpus, bc_cold / 1e3 / cpus, cpus);
	if (mpi_us > 0)
		printf("  against MPI's %.0f us: %.2fx (allreduce), %.2fx (broadcast)\n", mpi_us,
		       mpi_us / (ar_cold / 1e3 / cpus), mpi_us / (bc_cold / 1e3 / cpus));
	bpf_object__close(obj);
	return 0;
}
