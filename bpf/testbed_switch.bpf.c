/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * testbed_switch.bpf.c - the emulated hardware switch of the test bed.
 *
 * Attached (netlink, so it outlives erarctl) to every bridge port, i.e. the
 * root-namespace end of each host's veth. The Linux bridge forwards XDP
 * frames slowly (every frame becomes an skb), while a real switch forwards
 * at line rate; this program plays the switch for datapath frames only:
 * destination MAC -> port, through a devmap. Everything else (MPI's TCP,
 * ARP, unknown MACs) goes to the bridge unchanged with XDP_PASS.
 *
 * Never redirect non-datapath frames: a host whose eth0 has no XDP program
 * drops redirected frames, and redirect bypasses the port's qdisc.
 *
 * Impairments (test bed only; tc netem is unavailable here and would not
 * see redirected frames anyway): on datapath frames, configured in
 * switch_impair (struct erar_impair_cfg, erar_wire.h), in this order:
 * random loss (XDP_DROP), each loss followed by burst - 1 more on that
 * CPU; chosen-frame rules (drop a frame's first pass,
 * forward its re-sends); random reordering (XDP_PASS: the frame takes the
 * bridge's software path and arrives after frames sent later); random
 * duplication (broadcast to a per-port devmap that lists the port twice).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "erar_wire.h"
#include "erar_parse.h"

char LICENSE[] SEC("license") = "Dual MIT/GPL";

#define ERAR_EEXIST 17 /* errno EEXIST, as bpf_map_update_elem returns it */

/* Host MAC (6 bytes, zero-extended little-endian into a u64) -> index into
 * switch_ports. Written by user space before the first frame. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u64);
	__type(value, __u32);
	__uint(max_entries, ERAR_SWITCH_MAX_PORTS);
} switch_fdb SEC(".maps");

/* index -> ifindex of the bridge port that leads to that host. */
struct {
	__uint(type, BPF_MAP_TYPE_DEVMAP);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, ERAR_SWITCH_MAX_PORTS);
} switch_ports SEC(".maps");

/* Per-CPU counters, indexed by enum erar_switch_stat. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, ERAR_SW_STAT_NR);
} switch_stats SEC(".maps");

/* ---- Impairments (see erar_wire.h) ----------------------------------------- */

/* The configuration, key 0; written by user space at any time (each field
 * is read once per frame, so a frame sees a consistent rate per field). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct erar_impair_cfg);
	__uint(max_entries, 1);
} switch_impair SEC(".maps");

/* Frames already dropped once by a rule. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct erar_impair_key);
	__type(value, __u8);
	__uint(max_entries, ERAR_IMPAIR_TRACKED);
} switch_dropped SEC(".maps");

/* Duplication: per port, a DEVMAP_HASH holding that port's ifindex under
 * two keys (0 and 1). bpf_redirect_map(..., BPF_F_BROADCAST) on it sends
 * the frame to every entry: twice to the same port. User space creates
 * one inner map per port at attach time. */
struct switch_dup_inner {
	__uint(type, BPF_MAP_TYPE_DEVMAP_HASH);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 2);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__type(key, __u32);
	__uint(max_entries, ERAR_SWITCH_MAX_PORTS);
	__array(values, struct switch_dup_inner);
} switch_dup SEC(".maps");

static __always_inline void sw_count(__u32 idx)
{
	__u64 *c = bpf_map_lookup_elem(&switch_stats, &idx);

	if (c)
		(*c)++;
}

/* True with probability ppm / 10^6. */
static __always_inline int chance(__u32 ppm)
{
	if (!ppm)
		return 0;
	return (((__u64)bpf_get_prandom_u32() * ERAR_PPM) >> 32) < ppm;
}

/* Frames still to drop of the burst a random loss started, per CPU: one
 * CPU's frames in a row, as a queue that overflows drops them. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u32);
	__uint(max_entries, 1);
} switch_burst_left SEC(".maps");

/* Random loss: a frame is lost with probability loss_ppm, and so are the
 * burst - 1 frames this CPU sees after it. */
static __always_inline int lost(const struct erar_impair_cfg *cfg)
{
	__u32 zero = 0, *left;

	if (!cfg->loss_ppm) /* no loss (cleared: no burst goes on either) */
		return 0;
	left = bpf_map_lookup_elem(&switch_burst_left, &zero);
	if (left && *left && cfg->burst > 1) {
		*left -= 1;
		return 1;
	}
	if (!chance(cfg->loss_ppm))
		return 0;
	if (left && cfg->burst > 1)
		*left = cfg->burst - 1;
	return 1;
}

static __always_inline int rule_matches(const struct erar_impair_rule *r,
					const struct erar_hdr *h)
{
	if (!r->kind || r->kind != h->kind)
		return 0;
	if (!r->any_step && r->step != h->step)
		return 0;
	if (r->op == ERAR_IMPAIR_OP_ALLREDUCE && h->wire_op == ERAR_OP_BCAST)
		return 0;
	if (r->op == ERAR_IMPAIR_OP_BCAST && h->wire_op != ERAR_OP_BCAST)
		return 0;
	if (r->select == ERAR_SELECT_CHUNK)
		return h->chunk == r->arg;
	if (r->select == ERAR_SELECT_EVERY)
		return r->every && h->chunk % r->every == r->arg;
	return 0;
}

/* Chosen-frame rules: 1 if this frame is to be dropped now (its first
 * pass), 0 to forward it. */
static __always_inline int rule_drop(const struct erar_impair_cfg *cfg, void *data,
				     void *data_end)
{
	const struct erar_hdr *h = data + ERAR_L2L4_LEN;
	struct erar_impair_key key;
	__u8 one = 1;
	int i, hit = 0;

	if (data + ERAR_PAYLOAD_OFF > data_end)
		return 0;
#pragma unroll
	for (i = 0; i < ERAR_IMPAIR_MAX_RULES; i++)
		hit |= rule_matches(&cfg->rules[i], h);
	if (!hit)
		return 0;
	__builtin_memset(&key, 0, sizeof(key));
	key.comm_id = h->comm_id;
	key.token = h->token;
	key.seq = h->seq;
	key.chunk = h->chunk;
	key.slot = h->slot;
	key.kind = h->kind;
	key.step = h->step;
	/* Atomic: of two copies racing on two CPUs only one inserts. */
	switch (bpf_map_update_elem(&switch_dropped, &key, &one, BPF_NOEXIST)) {
	case 0:
		sw_count(ERAR_SW_RULE_DROPPED);
		return 1;
	case -ERAR_EEXIST: /* dropped before: this is a re-send */
		sw_count(ERAR_SW_RULE_PASSED);
		return 0;
	default:
		sw_count(ERAR_SW_RULE_FULL);
		return 0;
	}
}

SEC("xdp.frags")
int testbed_switch(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	const struct erar_impair_cfg *cfg;
	__u32 zero = 0, idx;
	__u64 mac = 0;
	__u32 *port;

	if (!erar_is_datapath(data, data_end)) {
		sw_count(ERAR_SW_PASSED);
		return XDP_PASS;
	}
	__builtin_memcpy(&mac, data, 6); /* h_dest */
	port = bpf_map_lookup_elem(&switch_fdb, &mac);
	if (!port) {
		sw_count(ERAR_SW_UNKNOWN_MAC);
		return XDP_PASS; /* let the bridge learn/flood it */
	}
	idx = *port;

	cfg = bpf_map_lookup_elem(&switch_impair, &zero);
	if (cfg) {
		if (lost(cfg)) {
			sw_count(ERAR_SW_LOST);
			return XDP_DROP;
		}
		if (rule_drop(cfg, data, data_end))
			return XDP_DROP;
		if (chance(cfg->reorder_ppm)) {
			/* The bridge forwards it as an skb (it knows the host
			 * MACs from their TCP traffic), far behind the frames
			 * that follow it on the XDP path. */
			sw_count(ERAR_SW_REORDERED);
			return XDP_PASS;
		}
		if (chance(cfg->dup_ppm)) {
			void *dup = bpf_map_lookup_elem(&switch_dup, &idx);

			if (dup) {
				sw_count(ERAR_SW_DUPLICATED);
				return bpf_redirect_map(dup, 0, BPF_F_BROADCAST);
			}
		}
	}
	sw_count(ERAR_SW_REDIRECTED);
	/* Low bits of flags: action if the devmap slot is empty. */
	return bpf_redirect_map(&switch_ports, idx, XDP_PASS);
}
