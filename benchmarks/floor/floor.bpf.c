// SPDX-License-Identifier: (Apache-2.0 OR MIT)
/*
 * floor.bpf.c - the per-byte work of erar_xdp that no in-kernel ring can
 * skip, alone, for benchmarks/floor: each program is one frame's worth of
 * it on a payload of ERAR_MAX_LINEAR_CHUNK_BYTES, run by BPF_PROG_RUN
 * (repeat) on a frame that stays in the cache, so its time is a lower
 * bound of what the same work costs in a real call.
 *
 *   rs     a reduce-scatter hop: the frame's payload += this host's chunk
 *          (ADD_I32, erar_reduce.h's own loop, without the finishing
 *          host's write-back)
 *   ag     an all-gather hop: the payload into this host's chunk
 *          (bpf_xdp_load_bytes, as erar_xdp does)
 *   empty  the same lookups and bounds check, no payload work: the run's
 *          fixed cost, subtracted from the others
 *
 * Not part of the floor, to show what memory adds in a real call:
 *   rs_mem a reduce-scatter hop as erar_xdp makes it (the host keeps the
 *          partial sum: ERAR_STAGE_REDUCED), on the next of COLD_CHUNKS
 *          chunks each run, 64 MiB in all (more than the last-level
 *          cache), as a large call's slot is
 *   ag_mem an all-gather hop's store into the next of those chunks each
 *          run (floor.c charges a fill, which reads such a chunk, the same)
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "erar_reduce.h"

#define NB ERAR_MAX_LINEAR_CHUNK_BYTES

char LICENSE[] SEC("license") = "Dual MIT/GPL";

/* This host's chunk. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, NB);
} own_chunk SEC(".maps");

/* 64 MiB of chunks, one after the other in turn (rs_mem). */
#define COLD_CHUNKS ((64u << 20) / NB)

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, COLD_CHUNKS);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, NB);
} cold_slot SEC(".maps");

/* The chunk rs_mem takes next, per CPU. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(__u32));
} cold_next SEC(".maps");

static __always_inline void *own(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&own_chunk, &zero);
}

/* The frame's first NB bytes, or NULL if it is shorter: checked here, so
 * that the verifier lets the loops read all of them. */
static __always_inline void *payload(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;

	if (data + NB > (void *)(long)ctx->data_end)
		return 0;
	return data;
}

/* A reduce-scatter hop's combine of the frame with chunk `o` (keeping the
 * partial sum there too if `fin`, as erar_xdp does). */
static __always_inline int combine_into(struct xdp_md *ctx, void *o, const int fin)
{
	void *p = payload(ctx);

	if (!p || !o)
		return XDP_ABORTED;
	erar_combine(p, o, o, NB, ERAR_OP_ADD_I32, fin);
	return XDP_DROP;
}

/* An all-gather hop's store of the frame's payload into chunk `o`. */
static __always_inline int store_into(struct xdp_md *ctx, void *o)
{
	if (!payload(ctx) || !o || bpf_xdp_load_bytes(ctx, 0, o, NB))
		return XDP_ABORTED;
	return XDP_DROP;
}

/* The next of the COLD_CHUNKS chunks, per CPU, in turn. */
static __always_inline void *next_cold(void)
{
	__u32 zero = 0, *next = bpf_map_lookup_elem(&cold_next, &zero), chunk;

	if (!next)
		return 0;
	chunk = *next;
	*next = chunk + 1 < COLD_CHUNKS ? chunk + 1 : 0;
	return bpf_map_lookup_elem(&cold_slot, &chunk);
}

SEC("xdp")
int rs(struct xdp_md *ctx)
{
	return combine_into(ctx, own(), 0);
}

SEC("xdp")
int ag(struct xdp_md *ctx)
{
	return store_into(ctx, own());
}

SEC("xdp")
int rs_mem(struct xdp_md *ctx)
{
	return combine_into(ctx, next_cold(), 1);
}

SEC("xdp")
int ag_mem(struct xdp_md *ctx)
{
	return store_into(ctx, next_cold());
}

SEC("xdp")
int empty(struct xdp_md *ctx)
{
	void *p = payload(ctx), *o = own();

	if (!p || !o)
		return XDP_ABORTED;
	return XDP_DROP;
}
