/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * erar_ring.bpf.c - liberar's in-kernel ring allreduce (see docs/datapath.md).
 *
 *   erar_xdp     attached (bpf_link) to the host's MPI interface: receives a
 *                datapath frame, reduces or stores its payload against the
 *                slot buffer, forwards it to the next host with XDP_TX.
 *                Run through BPF_PROG_RUN with BPF_F_TEST_XDP_LIVE_FRAMES,
 *                the same program injects: it builds this host's starting
 *                frames and redirects them out of the MPI interface.
 *
 * Why one program and not a separate injector: every BPF_PROG_RUN of an XDP
 * program that is not attached anywhere adds it to and removes it from the
 * kernel's XDP dispatcher (text poking and two synchronize_rcu()), measured
 * at 20-100 ms per call on the 2-CPU test machine. A program that is already
 * attached is in the dispatcher, and BPF_PROG_RUN then costs microseconds.
 *
 * Everything shared with user space (wire format, slot_ctl, events, stats)
 * is defined in erar_wire.h.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "erar_wire.h"
#include "erar_parse.h"
#include "erar_reduce.h"

char LICENSE[] SEC("license") = "Dual MIT/GPL";

/* A plain load the compiler may neither cache nor tear: user space writes
 * these fields concurrently through the mmap. */
#define READ_ONCE(x) (*(const volatile __typeof__(x) *)&(x))
#define WRITE_ONCE(x, v) (*(volatile __typeof__(x) *)&(x) = (v))

/* ---- Load-time constants (set by user space before load) ------------------
 * Frozen .rodata: the verifier reads them as constants, so the reduce loops
 * have a known trip count and one packet bounds check covers them. */
const volatile __u32 erar_chunk_bytes = ERAR_MIN_CHUNK_BYTES;
const volatile __u32 erar_chunks_per_slot = 1;

/* The loopback device has this ifindex in every network namespace. */
#define ERAR_LOOPBACK_IFINDEX 1

/* ---- Maps ----------------------------------------------------------------- */

/*
 * Per-slot state lives in maps of the slot's own ("inner" maps), found
 * through one array of maps per kind, indexed by slot. Whoever runs a slot's
 * ring holds the only user-space references to its inner maps: the process
 * itself for its own program, or, on the node agent's datapath, the job that
 * leased the slot (the agent creates them per lease and hands over their fds;
 * see "Privilege" in docs/datapath.md). So no job can map another job's data.
 * A slot without inner maps drops every frame for it. The inner templates
 * below are sized by user space before load (chunk_bytes, chunks_per_slot).
 */

/* This host's data for a slot: element c is chunk c. Mmapped as one buffer. */
struct slot_buf_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	/* Sizes only, no BTF types (libbpf cannot size BTF value types of
	 * inner maps; here the value size changes before load anyway). */
	__uint(key_size, sizeof(__u32));
	__uint(value_size, ERAR_MIN_CHUNK_BYTES);
	__uint(max_entries, 1);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, ERAR_MAX_SLOTS);
	__type(key, __u32);
	__array(values, struct slot_buf_inner);
} slot_bufs SEC(".maps");

/* The slot's route and operation state (one element), mmapped. */
struct slot_ctl_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(struct erar_slot_ctl));
	__uint(max_entries, 1);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, ERAR_MAX_SLOTS);
	__type(key, __u32);
	__array(values, struct slot_ctl_inner);
} slot_ctls SEC(".maps");

/* One state word per chunk of the slot (see "Reliability" in erar_wire.h),
 * mmapped: user space reads the stages to find the chunks it still misses. */
struct chunk_state_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(__u64));
	__uint(max_entries, 1);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, ERAR_MAX_SLOTS);
	__type(key, __u32);
	__array(values, struct chunk_state_inner);
} chunk_states SEC(".maps");

/* The chunks the slot's next ERAR_INJECT_RESEND / _NACK run names. */
struct resend_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, sizeof(struct erar_resend_list));
	__uint(max_entries, 1);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, ERAR_MAX_SLOTS);
	__type(key, __u32);
	__array(values, struct resend_inner);
} resends SEC(".maps");

/* The slot's completion events (struct erar_event), one per operation. */
struct events_inner {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, ERAR_EVENTS_BYTES);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, ERAR_MAX_SLOTS);
	__type(key, __u32);
	__array(values, struct events_inner);
} slot_events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct erar_stats);
	__uint(max_entries, 1);
} stats SEC(".maps");

/* Element `slot` of an array of maps (one kind of a slot's inner maps), or
 * NULL when no ring holds the slot. */
static __always_inline void *slot_map(void *outer, __u32 slot)
{
	return bpf_map_lookup_elem(outer, &slot);
}

/* Element `key` of the slot's inner map of that kind, or NULL. */
static __always_inline void *slot_elem(void *outer, __u32 slot, __u32 key)
{
	void *inner = slot_map(outer, slot);

	return inner ? bpf_map_lookup_elem(inner, &key) : 0;
}

/* ---- Helpers -------------------------------------------------------------- */

/*
 * erar_hdr is packed (30 bytes) on the wire, but every field sits at its
 * natural offset inside it. Reading through this unpacked twin makes clang
 * emit one load per field instead of byte loads; x86 does not care that the
 * frame offset (42) is only 2-byte aligned, and neither does the verifier
 * there (efficient unaligned access).
 */
struct erar_hdr_view {
	__u32 magic;
	__u8 version;
	__u8 kind;
	__u8 step;
	__u8 wire_op;
	__u32 comm_id;
	__u32 token;
	__u32 seq;
	__u32 chunk;
	__u16 slot;
	__u16 reserved[2];
};
_Static_assert(__builtin_offsetof(struct erar_hdr_view, slot) ==
		       __builtin_offsetof(struct erar_hdr, slot),
	       "erar_hdr_view must mirror erar_hdr");
_Static_assert(__builtin_offsetof(struct erar_hdr_view, chunk) ==
		       __builtin_offsetof(struct erar_hdr, chunk),
	       "erar_hdr_view must mirror erar_hdr");
/* docs/datapath.md's offsets; liberar's wire.rs tests check the same. */
_Static_assert(__builtin_offsetof(struct erar_hdr, kind) == 5 &&
		       __builtin_offsetof(struct erar_hdr, token) == 12 &&
		       __builtin_offsetof(struct erar_hdr, seq) == 16 &&
		       __builtin_offsetof(struct erar_hdr, chunk) == 20 &&
		       __builtin_offsetof(struct erar_hdr, slot) == 24,
	       "erar_hdr layout");

static __always_inline void stat_inc(struct erar_stats *st, __u32 idx)
{
	if (idx < ERAR_STAT_NR)
		st->c[idx]++;
}

/* IPv4 total length and UDP length fields (network order) of a datapath
 * frame; erar_is_datapath() has checked that the headers are there. */
static __always_inline __u16 ip_tot_len(void *data)
{
	return *(__u16 *)(data + ERAR_IP_TOT_LEN_OFF);
}

static __always_inline __u16 udp_len(void *data)
{
	return *(__u16 *)(data + ERAR_UDP_LEN_OFF);
}

/* Copies an Ethernet+IPv4+UDP header template (erar_slot_ctl.tmpl or
 * .nack_tmpl) into a frame: five 8-byte stores and one 2-byte store. */
static __always_inline void copy_l2l4(void *data, const __u64 *tmpl)
{
	__u64 *w = data;

	_Static_assert(ERAR_L2L4_LEN == 5 * sizeof(__u64) + sizeof(__u16),
		       "template copy");
	w[0] = tmpl[0];
	w[1] = tmpl[1];
	w[2] = tmpl[2];
	w[3] = tmpl[3];
	w[4] = tmpl[4];
	*(__u16 *)(data + 5 * sizeof(__u64)) = (__u16)tmpl[5];
}

/* Ethernet+IPv4+UDP of every frame this host sends for the slot. */
static __always_inline void write_l2l4(void *data, const struct erar_slot_ctl *ctl)
{
	copy_l2l4(data, ctl->tmpl);
}

/* One more chunk of the slot holds its final value on this host; the last
 * one wakes the waiting rank. */
static __always_inline void chunk_done(struct erar_slot_ctl *ctl,
				       struct erar_stats *st, __u32 slot,
				       __u32 seq)
{
	__u32 old = __sync_fetch_and_add(&ctl->done, 1);

	if (old + 1 == ctl->chunks) {
		struct erar_event ev = { .slot = slot, .seq = seq };
		void *events = slot_map(&slot_events, slot);

		if (!events || bpf_ringbuf_output(events, &ev, sizeof(ev),
						  BPF_RB_FORCE_WAKEUP))
			stat_inc(st, ERAR_STAT_DROP_RINGBUF);
		else
			stat_inc(st, ERAR_STAT_COMPLETE);
	}
}

#define DROP(st, reason)                                                       \
	do {                                                                   \
		stat_inc(st, reason);                                          \
		return XDP_DROP;                                               \
	} while (0)

/* ---- Chunk stages (see "Reliability" in erar_wire.h) ------------------------ */

static __always_inline __u32 stage_of(__u64 word, __u32 seq)
{
	return (__u32)(word >> 32) == seq ? (__u32)word : ERAR_STAGE_NONE;
}

static __always_inline __u64 stage_word(__u32 seq, __u32 stage)
{
	return ((__u64)seq << 32) | stage;
}

/* Hops from `from` to `pos` along the ring of n. */
static __always_inline __u32 ring_dist(__u32 pos, __u32 from, __u32 n)
{
	return pos >= from ? pos - from : pos + n - from;
}

/* The combine a chunk's RS frame gets: its wire op, except that a flagged
 * float SUM keeps i32 values below flags_from and flag bits from there on. */
static __always_inline __u32 combine_op(const struct erar_slot_ctl *ctl,
					__u32 wire_op, __u32 chunk)
{
	if (wire_op != ERAR_OP_ADD_I32_FLAGS)
		return wire_op;
	return chunk < ctl->flags_from ? ERAR_OP_ADD_I32 : ERAR_OP_OR;
}

/* Where a chunk's frames start: its reduce-scatter origin (allreduce; chunk c
 * starts at position c mod n) or the broadcast root. */
static __always_inline __u32 chunk_origin(const struct erar_slot_ctl *ctl,
					  __u32 chunk, __u32 n)
{
	return ctl->wire_op == ERAR_OP_BCAST ? ctl->root : chunk % n;
}

/*
 * The frame this host last sent for a chunk, from the chunk's stage and the
 * host's distance d from the chunk's origin: its kind and step, or 0 when the
 * host has sent nothing (yet) for it, or the frame ended its trip here.
 *
 *   allreduce  d = 0, NONE           RS step 0 (own contribution)
 *              1 <= d <= n-2, REDUCED RS step d (partial)
 *              d = n-1, FINAL        AG step 0 (reduction finished here)
 *              d <= n-3, FINAL       AG step d+1
 *   broadcast  d = 0 (root)          AG step 0
 *              1 <= d <= n-2, FINAL  AG step d
 */
static __always_inline int last_sent(const struct erar_slot_ctl *ctl,
				     __u32 stage, __u32 d, __u32 n,
				     __u8 *kind, __u8 *step)
{
	if (ctl->wire_op == ERAR_OP_BCAST) {
		if (d == 0 || (stage == ERAR_STAGE_FINAL && d + 2 <= n)) {
			*kind = ERAR_KIND_AG;
			*step = d;
			return 1;
		}
		return 0;
	}
	if (d == 0 && stage == ERAR_STAGE_NONE) {
		*kind = ERAR_KIND_RS;
		*step = 0;
		return 1;
	}
	if (stage == ERAR_STAGE_REDUCED && d >= 1 && d + 2 <= n) {
		*kind = ERAR_KIND_RS;
		*step = d;
		return 1;
	}
	if (stage == ERAR_STAGE_FINAL && d + 1 == n) {
		*kind = ERAR_KIND_AG;
		*step = 0;
		return 1;
	}
	if (stage == ERAR_STAGE_FINAL && d + 3 <= n) {
		*kind = ERAR_KIND_AG;
		*step = d + 1;
		return 1;
	}
	return 0;
}

/*
 * The frame this host waits for next for a chunk (the one its predecessor
 * sends it), from the chunk's stage and the host's distance d from the
 * chunk's origin: its kind and step, or 0 when it waits for nothing (final
 * value held, a frame being applied right now, or the broadcast root).
 *
 *   allreduce  d = 0, NONE           AG step 0 (the finished reduction)
 *              d >= 1, NONE          RS step d-1
 *              REDUCED               AG step d
 *   broadcast  d >= 1, NONE          AG step d-1
 */
static __always_inline int awaits(const struct erar_slot_ctl *ctl,
				  __u32 stage, __u32 d, __u8 *kind, __u8 *step)
{
	if (stage == ERAR_STAGE_BUSY || stage == ERAR_STAGE_FINAL)
		return 0;
	if (ctl->wire_op == ERAR_OP_BCAST) {
		if (d == 0)
			return 0;
		*kind = ERAR_KIND_AG;
		*step = d - 1;
		return 1;
	}
	if (stage == ERAR_STAGE_REDUCED) {
		*kind = ERAR_KIND_AG;
		*step = d;
	} else if (d == 0) {
		*kind = ERAR_KIND_AG;
		*step = 0;
	} else {
		*kind = ERAR_KIND_RS;
		*step = d - 1;
	}
	return 1;
}

/* Ethernet+IPv4+UDP of a NACK: to the previous host of the ring. */
static __always_inline void write_nack_l2l4(void *data, const struct erar_slot_ctl *ctl)
{
	copy_l2l4(data, ctl->nack_tmpl);
}

/* ---- Injection ------------------------------------------------------------------
 * One BPF_PROG_RUN (live frames, repeat = frames to send) per burst. Each run
 * builds one frame in the page the kernel hands it (sized 72 + chunk_bytes by
 * user space) and redirects it out of the slot's interface. The slot is named
 * by the input frame's erar_hdr.slot (the program writes the same value back,
 * so a recycled page still names it); the mode and the run counter are in the
 * slot's erar_slot_ctl. Runs are serialized on one CPU within a BPF_PROG_RUN
 * call, but a broadcast root injects from several threads at once (one
 * BPF_PROG_RUN per lane, on different CPUs), so inject_next is drawn
 * atomically: each run gets its own index, whichever lane it is on. */
static __always_inline int erar_inject(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	const __u32 cb = erar_chunk_bytes;
	__u32 zero = 0, slot, i, chunk, n, d, stage = ERAR_STAGE_NONE;
	struct erar_hdr_view *h;
	struct erar_slot_ctl *ctl;
	struct erar_stats *st;
	__u32 mode;
	__u64 armed, *state = 0;
	__u8 kind, step;
	void *own;

	st = bpf_map_lookup_elem(&stats, &zero);
	if (!st)
		return XDP_DROP;
	if (data + ERAR_PAYLOAD_OFF > data_end)
		DROP(st, ERAR_STAT_INJECT_ERR);
	h = data + ERAR_L2L4_LEN;
	slot = h->slot;
	if (slot >= ERAR_MAX_SLOTS)
		DROP(st, ERAR_STAT_INJECT_ERR);
	ctl = slot_elem(&slot_ctls, slot, 0);
	if (!ctl)
		DROP(st, ERAR_STAT_INJECT_ERR);
	/* Only the ring's own rank drives its slot: it knows the token. */
	if (h->token != ctl->token)
		DROP(st, ERAR_STAT_INJECT_ERR);
	armed = READ_ONCE(ctl->armed);
	if (!(armed & ERAR_ARMED_BIT))
		DROP(st, ERAR_STAT_INJECT_ERR);
	n = ctl->ring_size;
	if (n < 2 || n > ERAR_MAX_RING)
		DROP(st, ERAR_STAT_INJECT_ERR);

	mode = ctl->inject_mode;
	i = __sync_fetch_and_add(&ctl->inject_next, 1);
	if (mode == ERAR_INJECT_RESEND || mode == ERAR_INJECT_NACK) {
		struct erar_resend_list *list = slot_elem(&resends, slot, 0);

		if (!list || i >= ctl->inject_count || i >= ERAR_RESEND_MAX)
			DROP(st, ERAR_STAT_INJECT_ERR);
		chunk = list->chunk[i];
	} else if (ctl->wire_op == ERAR_OP_BCAST) {
		chunk = i;
	} else {
		chunk = ctl->ring_pos + n * i;
	}
	if (chunk >= ctl->chunks || chunk >= erar_chunks_per_slot)
		DROP(st, ERAR_STAT_INJECT_ERR);
	own = slot_elem(&slot_bufs, slot, chunk);
	if (!own)
		DROP(st, ERAR_STAT_INJECT_ERR);

	d = ring_dist(ctl->ring_pos, chunk_origin(ctl, chunk, n), n);
	if (mode != ERAR_INJECT_START) {
		state = slot_elem(&chunk_states, slot, chunk);
		if (!state)
			DROP(st, ERAR_STAT_INJECT_ERR);
		stage = stage_of(READ_ONCE(*state), (__u32)armed);
	}
	if (mode == ERAR_INJECT_NACK) {
		if (!awaits(ctl, stage, d, &kind, &step))
			DROP(st, ERAR_STAT_RESEND_SKIP);
		/* The payload is left as it is: the predecessor overwrites it. */
		write_nack_l2l4(data, ctl);
		kind |= ERAR_KIND_NACK;
	} else if (last_sent(ctl, stage, d, n, &kind, &step)) {
		write_l2l4(data, ctl);
	} else {
		DROP(st, mode == ERAR_INJECT_RESEND ? ERAR_STAT_RESEND_SKIP
						   : ERAR_STAT_INJECT_ERR);
	}

	h->magic = ERAR_MAGIC;
	h->version = ERAR_VERSION;
	h->kind = kind;
	h->step = step;
	h->wire_op = ctl->wire_op;
	h->comm_id = ctl->comm_id;
	h->token = ctl->token;
	h->seq = (__u32)armed;
	h->chunk = chunk;
	h->slot = slot;
	h->reserved[0] = 0;
	h->reserved[1] = 0;
	if (mode == ERAR_INJECT_NACK) {
		stat_inc(st, ERAR_STAT_NACK_SENT);
		return bpf_redirect(ctl->ifindex, 0);
	}
	if (bpf_xdp_store_bytes(ctx, ERAR_PAYLOAD_OFF, own, cb))
		DROP(st, ERAR_STAT_INJECT_ERR);

	if (state) {
		/* A frame applied while we copied may have rewritten the chunk:
		 * send only a payload that matches the stage it is labelled with. */
		if (stage_of(READ_ONCE(*state), (__u32)armed) != stage)
			DROP(st, ERAR_STAT_RESEND_SKIP);
		stat_inc(st, ERAR_STAT_RESENT);
	} else {
		stat_inc(st, ERAR_STAT_INJECTED);
	}
	return bpf_redirect(ctl->ifindex, 0);
}

/*
 * Answers a NACK (validated like any frame of the armed operation) from the
 * successor: it names the frame the successor waits for. If that is the
 * frame this host last sent for the chunk, the NACK becomes that frame again
 * (the slot buffer holds its payload) and goes back out; otherwise the
 * successor's wait starts further up the ring, or it already has the frame.
 */
static __always_inline int serve_nack(struct xdp_md *ctx, void *data,
				      const struct erar_slot_ctl *ctl,
				      struct erar_stats *st,
				      struct erar_hdr_view *h, void *own,
				      __u64 *state, __u32 stage, __u32 d,
				      __u32 n)
{
	const __u32 cb = erar_chunk_bytes;
	__u8 kind, step;

	__u32 seq = h->seq;

	if (!last_sent(ctl, stage, d, n, &kind, &step) ||
	    h->kind != (ERAR_KIND_NACK | kind) || h->step != step)
		DROP(st, ERAR_STAT_NACK_SKIP);
	/* Headers first: no packet pointer is used after the helper. */
	h->kind = kind;
	write_l2l4(data, ctl);
	if (bpf_xdp_store_bytes(ctx, ERAR_PAYLOAD_OFF, own, cb))
		DROP(st, ERAR_STAT_DROP_SHORT);
	/* A frame applied while we copied may have rewritten the chunk: send
	 * only a payload that matches the stage it is labelled with. */
	if (stage_of(READ_ONCE(*state), seq) != stage)
		DROP(st, ERAR_STAT_NACK_SKIP);
	stat_inc(st, ERAR_STAT_NACK_SERVED);
	return XDP_TX;
}

/* Swaps the n bytes at a and b (n a multiple of 2). */
static __always_inline void swap_bytes(__u8 *a, __u8 *b, int n)
{
	for (int i = 0; i < n; i += 2) {
		__u16 t = *(__u16 *)(a + i);

		*(__u16 *)(a + i) = *(__u16 *)(b + i);
		*(__u16 *)(b + i) = t;
	}
}

/*
 * Answers a liveness probe of a ring this host is on (see ERAR_KIND_PING):
 * sends the frame back where it came from. The IPv4 checksum is unchanged
 * by swapping the addresses; the UDP checksum is dropped (0: none).
 */
static __always_inline int answer_ping(void *data, const struct erar_slot_ctl *ctl,
				       struct erar_stats *st,
				       struct erar_hdr_view *h)
{
	if (h->comm_id != ctl->comm_id)
		DROP(st, ERAR_STAT_DROP_COMM);
	if (h->token != ctl->token)
		DROP(st, ERAR_STAT_DROP_TOKEN);
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ERAR_IP_OFF;
	struct udphdr *udp = data + ERAR_UDP_OFF;

	swap_bytes(eth->h_dest, eth->h_source, ETH_ALEN);
	swap_bytes((__u8 *)&ip->saddr, (__u8 *)&ip->daddr, sizeof(ip->saddr));
	swap_bytes((__u8 *)&udp->source, (__u8 *)&udp->dest, sizeof(udp->source));
	udp->check = 0; /* none */
	h->kind = ERAR_KIND_PONG;
	stat_inc(st, ERAR_STAT_PING);
	return XDP_TX;
}

SEC("xdp.frags")
int erar_xdp(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	const __u32 cb = erar_chunk_bytes;
	struct erar_hdr_view *h;
	struct erar_slot_ctl *ctl;
	struct erar_stats *st;
	__u32 zero = 0, slot, seq, chunk, n, step, d, stage, len;
	__u64 *state, word;
	void *pl, *own;

	/* BPF_PROG_RUN without a ctx runs "on" the namespace's loopback device;
	 * the program is only ever attached to the MPI interface. */
	if (ctx->ingress_ifindex == ERAR_LOOPBACK_IFINDEX)
		return erar_inject(ctx);

	if (!erar_is_datapath(data, data_end))
		return XDP_PASS; /* MPI's TCP, ARP, ...: not ours */

	st = bpf_map_lookup_elem(&stats, &zero);
	if (!st)
		return XDP_DROP;

	h = data + ERAR_L2L4_LEN;
	pl = data + ERAR_PAYLOAD_OFF;
	/* On a jumbo-frame link (xdp.frags) a frame may reach us in fragments:
	 * the headers must be in the linear part, the payload is read by
	 * helpers, except where the reduce loop reads it in place (below). */
	len = bpf_xdp_get_buff_len(ctx);
	if (pl > data_end || len < ERAR_PAYLOAD_OFF + cb)
		DROP(st, ERAR_STAT_DROP_SHORT);
	if (h->magic != ERAR_MAGIC)
		DROP(st, ERAR_STAT_DROP_MAGIC);
	if (h->version != ERAR_VERSION)
		DROP(st, ERAR_STAT_DROP_VERSION);
	/* Exactly what a sender builds: forwarding rewrites the headers from the
	 * template, so a frame of another length (trailing bytes, fragments)
	 * would leave with headers that lie about it. */
	if (len != ERAR_PAYLOAD_OFF + cb ||
	    ip_tot_len(data) != bpf_htons(ERAR_PAYLOAD_OFF - ERAR_IP_OFF + cb) ||
	    udp_len(data) != bpf_htons(ERAR_PAYLOAD_OFF - ERAR_UDP_OFF + cb) ||
	    (h->reserved[0] | h->reserved[1]))
		DROP(st, ERAR_STAT_DROP_MALFORMED);

	slot = h->slot;
	if (slot >= ERAR_MAX_SLOTS)
		DROP(st, ERAR_STAT_DROP_SLOT);
	ctl = slot_elem(&slot_ctls, slot, 0);
	if (!ctl)
		DROP(st, ERAR_STAT_DROP_SLOT);
	/* Before the armed check: a rank between calls must answer too. */
	if (h->kind == ERAR_KIND_PING)
		return answer_ping(data, ctl, st, h);

	seq = h->seq;
	/* One load: armed and seq are consistent with each other. */
	if (READ_ONCE(ctl->armed) != (ERAR_ARMED_BIT | seq))
		DROP(st, ERAR_STAT_DROP_SEQ);
	if (h->comm_id != ctl->comm_id)
		DROP(st, ERAR_STAT_DROP_COMM);
	if (h->token != ctl->token)
		DROP(st, ERAR_STAT_DROP_TOKEN);
	if (h->wire_op != ctl->wire_op)
		DROP(st, ERAR_STAT_DROP_OP);
	chunk = h->chunk;
	if (chunk >= ctl->chunks || chunk >= erar_chunks_per_slot)
		DROP(st, ERAR_STAT_DROP_CHUNK);
	n = ctl->ring_size;
	if (n < 2 || n > ERAR_MAX_RING)
		DROP(st, ERAR_STAT_DROP_STEP);
	step = h->step;
	d = ring_dist(ctl->ring_pos, chunk_origin(ctl, chunk, n), n);

	own = slot_elem(&slot_bufs, slot, chunk);
	state = slot_elem(&chunk_states, slot, chunk);
	if (!own || !state)
		DROP(st, ERAR_STAT_DROP_CHUNK);
	word = READ_ONCE(*state);
	stage = stage_of(word, seq);

	if (h->kind & ERAR_KIND_NACK)
		return serve_nack(ctx, data, ctl, st, h, own, state, stage, d, n);

	/* Each host receives each chunk's frames from its predecessor only, at
	 * one (kind, step) per stage: anything else is forged or misrouted. */
	if (h->kind == ERAR_KIND_RS && h->wire_op != ERAR_OP_BCAST) {
		/* RS step s is received at distance s+1 from the origin. */
		if (d == 0 || step + 1 != d)
			DROP(st, ERAR_STAT_DROP_STEP);
		/* Our senders build every frame linear (one page): the reduce
		 * loop reads and writes the payload in place. */
		if (pl + cb > data_end)
			DROP(st, ERAR_STAT_DROP_SHORT);
		if (stage != ERAR_STAGE_NONE)
			DROP(st, ERAR_STAT_DUP);
		if (__sync_val_compare_and_swap(state, word, stage_word(seq, ERAR_STAGE_BUSY)) != word)
			DROP(st, ERAR_STAT_DUP);
		stat_inc(st, ERAR_STAT_RX_RS);
		/* The partial goes back into the slot too: it is what a re-send
		 * of this hop must carry. */
		erar_combine(pl, own, cb, combine_op(ctl, h->wire_op, chunk), 1);
		if (d + 1 == n) {
			/* Last contribution: the result is final. Keep it and
			 * start its all-gather from here. */
			WRITE_ONCE(*state, stage_word(seq, ERAR_STAGE_FINAL));
			chunk_done(ctl, st, slot, seq);
			stat_inc(st, ERAR_STAT_FINISHED);
			h->kind = ERAR_KIND_AG;
			h->step = 0;
		} else {
			WRITE_ONCE(*state, stage_word(seq, ERAR_STAGE_REDUCED));
			h->step = d;
		}
	} else if (h->kind == ERAR_KIND_AG) {
		/* Allreduce: AG step s is received at distance s (the origin
		 * gets step 0 from the last host); broadcast: at s+1. */
		__u32 at = h->wire_op == ERAR_OP_BCAST ? step + 1 : step;
		__u32 before = h->wire_op == ERAR_OP_BCAST || d == 0 ? ERAR_STAGE_NONE
								       : ERAR_STAGE_REDUCED;

		if (d != at || d + 1 >= n + (h->wire_op == ERAR_OP_BCAST))
			DROP(st, ERAR_STAT_DROP_STEP);
		if (stage == ERAR_STAGE_FINAL || stage == ERAR_STAGE_BUSY)
			DROP(st, ERAR_STAT_DUP);
		if (stage != before)
			DROP(st, ERAR_STAT_DROP_STATE);
		if (__sync_val_compare_and_swap(state, word, stage_word(seq, ERAR_STAGE_BUSY)) != word)
			DROP(st, ERAR_STAT_DUP);
		stat_inc(st, ERAR_STAT_RX_AG);
		/* A memcpy in the kernel; the helper accepts a map value of
		 * exactly cb bytes as destination. */
		if (bpf_xdp_load_bytes(ctx, ERAR_PAYLOAD_OFF, own, cb)) {
			WRITE_ONCE(*state, word);
			DROP(st, ERAR_STAT_DROP_SHORT);
		}
		WRITE_ONCE(*state, stage_word(seq, ERAR_STAGE_FINAL));
		chunk_done(ctl, st, slot, seq);
		/* Allreduce ends its all-gather at distance n-2, broadcast at n-1. */
		if (d + 2 == n + (h->wire_op == ERAR_OP_BCAST))
			DROP(st, ERAR_STAT_AG_LAST); /* everyone has it now */
		h->step = step + 1;
	} else {
		DROP(st, ERAR_STAT_DROP_STEP);
	}

	write_l2l4(data, ctl);
	stat_inc(st, ERAR_STAT_TX);
	return XDP_TX;
}

