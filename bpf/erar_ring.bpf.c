/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * erar_ring.bpf.c - liberar's in-kernel ring allreduce (see docs/datapath.md).
 *
 *   erar_xdp     attached (bpf_link) to the host's MPI interface: receives a
 *                datapath frame, reduces or stores its payload against the
 *                slot buffer, forwards it to the next host with XDP_TX.
 *                Run through BPF_PROG_RUN with BPF_F_TEST_XDP_LIVE_FRAMES,
 *                the same program injects: it builds this host's starting
 *                frames and redirects them out of the MPI interface (chunks
 *                of one page; jumbo chunks are sent from user space, built
 *                as here, and reach the receive path in fragments).
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
#include <stdbool.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "erar_wire.h"  /* everything shared with user space */
#include "erar_parse.h" /* is this a datapath frame */
#include "erar_frame.h" /* its headers, read and rewritten in place */
#include "erar_maps.h"  /* the slots' maps */
#include "erar_stats.h" /* the counters */
#include "erar_trip.h"  /* a chunk's trip around the ring */
#include "erar_reduce.h" /* combining payloads */

char LICENSE[] SEC("license") = "Dual MIT/GPL";

/* ---- Load-time constants (set by user space before load) ------------------
 * Frozen .rodata: the verifier reads them as constants, so the reduce loops
 * have a known trip count and one packet bounds check covers them. */
const volatile __u32 erar_chunk_bytes = ERAR_MIN_CHUNK_BYTES;
const volatile __u32 erar_chunks_per_slot = 1;
/* 1: a jumbo frame's fragments are combined where they lie, through
 * bpf_dynptr_slice_rdwr(); 0: through a copy (erar_combine_frame). Some
 * kernels refuse that kfunc to XDP (6.18.44-fc: "bpf_dynptr_slice_rdwr() is
 * not allowed", EPERM); the loader then loads again with 0 (kernel/load.rs). */
const volatile __u32 erar_frag_slices = 1;

/* The loopback device has this ifindex in every network namespace. */
#define ERAR_LOOPBACK_IFINDEX 1

/*
 * Wakes the rank waiting on `slot` if it sleeps (erar_slot_ctl.sleeping):
 * an event on its ring buffer. Only then: an event's wake-up is a self-IPI
 * (irq_work), a VM exit on a virtual machine, 5% of the CPU of a 1 MiB
 * broadcast when every event woke (perf, 4 hosts on 2 vCPUs), while a rank
 * that polls sees `done` and `ready` move by itself. The caller's atomic
 * update of those comes first: the rank sets `sleeping`, then looks at
 * them once more before it sleeps, so one side sees the other's write.
 */
static __always_inline void post_event(const struct erar_slot_ctl *ctl,
				       struct erar_stats *st, __u32 slot, __u32 seq)
{
	struct erar_event ev = { .slot = slot, .seq = seq };
	void *events;

	if (!READ_ONCE(ctl->sleeping))
		return;
	events = slot_map(&slot_events, slot);
	if (!events || bpf_ringbuf_output(events, &ev, sizeof(ev), BPF_RB_FORCE_WAKEUP))
		stat_inc(st, ERAR_STAT_DROP_RINGBUF);
}

/* One more chunk of the slot holds its final value on this host; the last
 * one completes the operation and wakes the waiting rank. */
static __always_inline void chunk_done(struct erar_slot_ctl *ctl,
				       struct erar_stats *st, __u32 slot,
				       __u32 seq)
{
	__u32 old = __sync_fetch_and_add(&ctl->done, 1);

	if (old + 1 == ctl->chunks) {
		stat_inc(st, ERAR_STAT_COMPLETE);
		post_event(ctl, st, slot, seq);
	}
}

/* This frame takes the chunk (its stage moves from `word` to BUSY, see
 * claim_chunk) and counts as received (`rx`); 0 if a copy took it first. */
static __always_inline int take_chunk(struct erar_stats *st, __u64 *state,
				      __u64 word, __u32 seq, __u32 rx)
{
	if (!claim_chunk(state, word, seq))
		return 0;
	stat_inc(st, rx);
	return 1;
}

/* Byte `off` of the region map at `entry` of `outer` (a class's array,
 * elements of `bytes`), if its head holds the ring's token and a chunk
 * from there lies past the head and within the element; else NULL. */
static __always_inline void *region_at(void *outer, __u32 entry, __u32 bytes,
				       const struct erar_slot_ctl *ctl, __u32 off)
{
	__u32 zero = 0;
	void *inner;
	__u8 *v;

	inner = bpf_map_lookup_elem(outer, &entry);
	if (!inner)
		return 0;
	v = bpf_map_lookup_elem(inner, &zero);
	if (!v || *(__u32 *)v != ctl->token)
		return 0;
	if (off < ERAR_REGION_HEAD || off > bytes - ERAR_MAX_CHUNK_BYTES)
		return 0;
	return v + off;
}

/*
 * A registered buffer (see "Registered buffers" in erar_wire.h): chunk
 * `chunk` of region r - 1 from byte `off` on, if the region is the ring's
 * (its head holds the ring's token); `own`, the slot buffer's element, for
 * r == 0. NULL (the frame is dropped, the operation fails by its stall
 * rule, never with a wrong result): a region this ring may not use, or a
 * chunk outside it. Each class's pointer is a kind of its own to the
 * verifier, which follows what the caller does with it once per class.
 */
static __always_inline void *region_chunk(const struct erar_slot_ctl *ctl, __u32 r,
					  __u32 off, void *own, __u32 chunk, __u32 cb)
{
	__u32 entry;

	if (!r)
		return own;
	r -= 1;
	entry = r % ERAR_MAX_REGIONS;
	off += chunk * cb;
	switch (r / ERAR_MAX_REGIONS) {
#define ERAR_REGION_CASE(class, outer, bytes)                                  \
	case class:                                                            \
		return region_at(&outer, entry, bytes, ctl, off);
		ERAR_REGION_CLASS_ROWS(ERAR_REGION_CASE)
#undef ERAR_REGION_CASE
	}
	return 0;
}

/* Where this host reads its contribution to `chunk` (a broadcast's root:
 * the data it sends). */
static __always_inline void *own_input(const struct erar_slot_ctl *ctl, void *own,
				       __u32 chunk, __u32 cb)
{
	return region_chunk(ctl, READ_ONCE(ctl->in_region), ctl->in_off, own, chunk, cb);
}

/* Where a host that receives `chunk` (a partial or final result) stores
 * it, and re-sends it from. */
static __always_inline void *own_output(const struct erar_slot_ctl *ctl, void *own,
					__u32 chunk, __u32 cb)
{
	return region_chunk(ctl, READ_ONCE(ctl->out_region), ctl->out_off, own, chunk, cb);
}

/* An allreduce on registered buffers: where this host reads its
 * contribution to `chunk` and keeps the combine. Both regions or neither,
 * and both of one class (a send and a receive buffer of one length), so
 * that the combine is given one kind of pointer a side, which the verifier
 * then follows through its inline tail once for each class, not for each
 * mix. 0 if either is refused. */
static __always_inline int regions_of(const struct erar_slot_ctl *ctl, __u32 chunk, __u32 cb,
				      void **in, void **out)
{
	__u32 r_in = READ_ONCE(ctl->in_region), r_out = READ_ONCE(ctl->out_region);
	__u32 off_in = ctl->in_off + chunk * cb, off_out = ctl->out_off + chunk * cb;
	__u32 e_in, e_out;

	if (!r_in || !r_out)
		return 0;
	r_in -= 1;
	r_out -= 1;
	e_in = r_in % ERAR_MAX_REGIONS;
	e_out = r_out % ERAR_MAX_REGIONS;
	if (r_in / ERAR_MAX_REGIONS != r_out / ERAR_MAX_REGIONS)
		return 0;
	switch (r_in / ERAR_MAX_REGIONS) {
#define ERAR_REGION_PAIR(class, outer, bytes)                                  \
	case class:                                                            \
		*in = region_at(&outer, e_in, bytes, ctl, off_in);             \
		*out = region_at(&outer, e_out, bytes, ctl, off_out);          \
		break;
		ERAR_REGION_CLASS_ROWS(ERAR_REGION_PAIR)
#undef ERAR_REGION_PAIR
	default:
		return 0;
	}
	return *in && *out;
}

/* ---- Barrier (see "Barrier" in erar_wire.h) ------------------------------- */

/* The frame's header for the ring of `ctl`, kind READY, operation `seq`,
 * count `count`: to the predecessor, or (`query`) a query to the successor. */
static __always_inline void ready_header(void *data, const struct erar_slot_ctl *ctl,
					 struct erar_hdr_view *h, __u32 slot,
					 __u32 seq, __u32 count, bool query)
{
	copy_l2l4(data, query ? ctl->tmpl : ctl->nack_tmpl);
	h->magic = ERAR_MAGIC;
	h->version = ERAR_VERSION;
	h->kind = ERAR_KIND_READY;
	h->step = query ? ERAR_READY_QUERY : 0;
	h->wire_op = 0;
	h->comm_id = ctl->comm_id;
	h->token = ctl->token;
	h->seq = seq;
	h->chunk = count;
	h->slot = slot;
	h->reserved[0] = 0;
	h->reserved[1] = 0;
}

/* ERAR_INJECT_READY: this host's READY (count inject_count, its key) to
 * the predecessor; ERAR_INJECT_QUERY: a query to the successor. */
static __always_inline int inject_ready(void *data, void *data_end,
					const struct erar_slot_ctl *ctl,
					struct erar_stats *st,
					struct erar_hdr_view *h, __u32 slot)
{
	__u32 *key = data + ERAR_PAYLOAD_OFF;

	if ((void *)(key + ERAR_KEY_WORDS) > data_end)
		DROP(st, ERAR_STAT_INJECT_ERR);
	ready_header(data, ctl, h, slot, READ_ONCE(ctl->join_seq), ctl->inject_count,
		     ctl->inject_mode == ERAR_INJECT_QUERY);
	for (int i = 0; i < ERAR_KEY_WORDS; i++)
		key[i] = ctl->key[i];
	stat_inc(st, ERAR_STAT_READY_SENT);
	return bpf_redirect(ctl->ifindex, 0);
}

/* Whether seq `a` comes after seq `b`. Seqs count 1..2^31-1 and wrap to 1
 * (user space's next_seq), so they compare in 31 bits: `a` is newer if it
 * is less than 2^30 operations ahead. */
static __always_inline bool seq_after(__u32 a, __u32 b)
{
	__u32 d = (a - b) & 0x7fffffff;

	return d != 0 && d < 0x40000000;
}

/* Whether barrier word `next` ((seq << 32) | count) tells more than `old`:
 * a newer seq, or a larger count of the same seq. */
static __always_inline bool ready_newer(__u64 old, __u64 next)
{
	__u32 old_seq = old >> 32, next_seq = next >> 32;

	if (next_seq != old_seq)
		return seq_after(next_seq, old_seq);
	return (__u32)next > (__u32)old;
}

/* Whether READY payload `key` is the call key this host joined with. */
static __always_inline bool same_key(const __u32 *key, const struct erar_slot_ctl *ctl)
{
	for (int i = 0; i < ERAR_KEY_WORDS; i++)
		if (key[i] != ctl->key[i])
			return false;
	return true;
}

/* Keeps barrier word `next` and its `key` if it tells more than `ready`
 * does (compare-and-swap, a few tries against concurrent frames). */
static __always_inline bool take_ready(struct erar_slot_ctl *ctl, const __u32 *key,
				       __u64 next)
{
	for (int i = 0; i < 4; i++) {
		__u64 old = READ_ONCE(ctl->ready);

		if (!ready_newer(old, next))
			return false;
		for (int k = 0; k < ERAR_KEY_WORDS; k++)
			ctl->ready_key[k] = key[k];
		if (__sync_bool_compare_and_swap(&ctl->ready, old, next))
			return true;
	}
	return false;
}

/*
 * A data frame or NACK of the armed operation `seq` arrived: its sender
 * passed the operation's barrier, so every host joined it, this one too.
 * If this host's rank may not know it yet (its successor's last READY was
 * lost), it does now: `ready` says its successor counted n - 1, and an
 * event wakes the rank. One load per frame when it knows already.
 */
static __always_inline void learn_passed(struct erar_slot_ctl *ctl, struct erar_stats *st,
					 __u32 slot, __u32 seq, __u32 n)
{
	__u64 r = READ_ONCE(ctl->ready);

	if ((__u32)(r >> 32) == seq && (__u32)r + 1 >= n)
		return;
	if (take_ready(ctl, ctl->key, (__u64)seq << 32 | (n - 1))) {
		stat_inc(st, ERAR_STAT_READY_LEARNED);
		post_event(ctl, st, slot, seq);
	}
}

/*
 * Answers the predecessor's query (see ERAR_READY_QUERY): its count again,
 * from what the successor last told this host, if it joined the operation:
 * the count the rank tells (HostDatapath::join). So a count the successor
 * told before this host joined, with another key (XDP could not check it;
 * the rank aborted on reading it), is answered ERAR_READY_ABORT: answered
 * as a count, it let the hosts up the ring pass a barrier this one had
 * aborted, and run the operation without it (lossy.rs, jumbo frames: a
 * float SUM whose summaries had changed on one host only).
 */
static __always_inline int answer_query(const struct erar_slot_ctl *ctl, struct erar_stats *st,
					void *data, struct erar_hdr_view *h, __u32 *key,
					__u32 slot, bool joined, __u32 n)
{
	__u32 seq = h->seq, told_seq, count, own;
	__u64 r;

	if (!joined)
		DROP(st, ERAR_STAT_READY_STALE);
	r = READ_ONCE(ctl->ready);
	told_seq = r >> 32;
	count = r;
	if (told_seq == seq && (count == ERAR_READY_ABORT || !same_key(ctl->ready_key, ctl)))
		own = ERAR_READY_ABORT;
	else if (told_seq == seq)
		own = count + 1 < n ? count + 1 : n;
	else
		own = seq_after(told_seq, seq) ? n : 1;
	ready_header(data, ctl, h, slot, seq, own, false);
	for (int i = 0; i < ERAR_KEY_WORDS; i++)
		key[i] = ctl->key[i];
	stat_inc(st, ERAR_STAT_READY_QUERY);
	return XDP_TX;
}

/*
 * Takes a READY from the successor (validated like a probe: ring and
 * token): keeps its count if it tells more than what was known, and if this
 * host has joined that operation, checks the key and tells its own
 * predecessor 1 + count (or ERAR_READY_ABORT) by turning the frame around;
 * wakes the rank when it passes or the operation aborts.
 */
static __always_inline int serve_ready(void *data, void *data_end,
				       struct erar_slot_ctl *ctl,
				       struct erar_stats *st,
				       struct erar_hdr_view *h, __u32 slot)
{
	__u32 *key = data + ERAR_PAYLOAD_OFF;
	__u32 seq = h->seq, count = h->chunk, n = ctl->ring_size, own, join_seq;
	bool joined;

	if (h->comm_id != ctl->comm_id)
		DROP(st, ERAR_STAT_DROP_COMM);
	if (h->token != ctl->token)
		DROP(st, ERAR_STAT_DROP_TOKEN);
	if ((void *)(key + ERAR_KEY_WORDS) > data_end)
		DROP(st, ERAR_STAT_DROP_SHORT);
	if (n < 2 || n > ERAR_MAX_RING ||
	    (count != ERAR_READY_ABORT && (count == 0 || count > n)) ||
	    h->step > ERAR_READY_QUERY)
		DROP(st, ERAR_STAT_DROP_MALFORMED);
	/* join_seq 0: joined nothing (seq 0 is reserved). */
	join_seq = READ_ONCE(ctl->join_seq);
	joined = join_seq == seq && seq != 0;
	if (h->step == ERAR_READY_QUERY)
		return answer_query(ctl, st, data, h, key, slot, joined, n);
	if (joined && count != ERAR_READY_ABORT && !same_key(key, ctl)) {
		count = ERAR_READY_ABORT;
		stat_inc(st, ERAR_STAT_READY_ABORT);
	}
	if (!take_ready(ctl, key, (__u64)seq << 32 | count))
		DROP(st, ERAR_STAT_READY_STALE);
	stat_inc(st, ERAR_STAT_READY);
	if (!joined) {
		/* Not joined: the rank reads `ready` when it joins and tells
		 * its predecessor itself. A successor on a newer operation
		 * than the one the rank waits in passes it (see "Barrier"):
		 * wake it. */
		if (READ_ONCE(ctl->join_seq) != seq || seq == 0) {
			if (join_seq != 0 && seq_after(seq, join_seq))
				post_event(ctl, st, slot, seq);
			return XDP_DROP;
		}
		/* It joined meanwhile (and may have read `ready` before we
		 * wrote it): check the key now. */
		if (count != ERAR_READY_ABORT && !same_key(key, ctl)) {
			count = ERAR_READY_ABORT;
			stat_inc(st, ERAR_STAT_READY_ABORT);
			take_ready(ctl, key, (__u64)seq << 32 | count);
		}
	}
	own = count == ERAR_READY_ABORT ? count : count + 1 < n ? count + 1 : n;
	if (count == ERAR_READY_ABORT || count + 1 >= n)
		post_event(ctl, st, slot, seq);
	/* The payload (the key) stays: it equals this host's, or the
	 * operation aborts anyway. */
	ready_header(data, ctl, h, slot, seq, own, false);
	stat_inc(st, ERAR_STAT_READY_FWD);
	return XDP_TX;
}

/* ---- Injection ------------------------------------------------------------------
 * One BPF_PROG_RUN (live frames, repeat = frames to send) per burst. Each run
 * builds one frame in the page the kernel hands it (72 + chunk_bytes: user
 * space hands in a whole frame, or its headers for grow_to_frame) and
 * redirects it out of the slot's interface. The slot is named
 * by the input frame's erar_hdr.slot (the program writes the same value back,
 * so a recycled page still names it); the mode and the run counter are in the
 * slot's erar_slot_ctl. Runs are serialized on one CPU within a BPF_PROG_RUN
 * call, but a broadcast root injects from several threads at once (one
 * BPF_PROG_RUN per lane, on different CPUs), so inject_next is drawn
 * atomically: each run gets its own index, whichever lane it is on. */

/* Grows an injected frame of linear chunks to a whole one (ERAR_PAYLOAD_OFF +
 * cb bytes; the kernel zeroes what it adds). The kernel copies BPF_PROG_RUN's
 * input into each of the 64 pages its page pool allocates at the start of
 * every live run, whatever the count of frames: a whole frame as input cost
 * 64 copies of 3.4 KB a run, 2% of the CPU of an 8-rank 1 MiB allreduce
 * (perf), whose hosts make two runs of one or a few frames a call (READY,
 * the first window). So user space hands in the headers alone for a run of
 * fewer frames than that (kernel/inject.rs). 0, or an error: a frame too
 * short to name its slot. Jumbo frames come in whole (from a socket). */
static __always_inline int grow_to_frame(struct xdp_md *ctx, __u32 cb)
{
	__u32 len = ctx->data_end - ctx->data;

	if (len < ERAR_PAYLOAD_OFF)
		return -1;
	if (cb > ERAR_MAX_LINEAR_CHUNK_BYTES || len >= ERAR_PAYLOAD_OFF + cb)
		return 0;
	return bpf_xdp_adjust_tail(ctx, (int)(ERAR_PAYLOAD_OFF + cb - len));
}

static __always_inline int erar_inject(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	const __u32 cb = erar_chunk_bytes;
	__u32 zero = 0, slot, i, chunk, n, d, h_ag, stage = ERAR_STAGE_NONE;
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
	if (grow_to_frame(ctx, cb))
		DROP(st, ERAR_STAT_INJECT_ERR);
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	if (data + ERAR_PAYLOAD_OFF > data_end)
		DROP(st, ERAR_STAT_INJECT_ERR);
	h = data + ERAR_L2L4_LEN;
	slot = h->slot;
	ctl = slot_ctl_of(slot);
	if (!ctl)
		DROP(st, ERAR_STAT_INJECT_ERR);
	/* Only the ring's own rank drives its slot: it knows the token. */
	if (h->token != ctl->token)
		DROP(st, ERAR_STAT_INJECT_ERR);
	if (ctl->inject_mode == ERAR_INJECT_READY || ctl->inject_mode == ERAR_INJECT_QUERY)
		return inject_ready(data, data_end, ctl, st, h, slot);
	armed = READ_ONCE(ctl->armed);
	if (!(armed & ERAR_ARMED_BIT))
		DROP(st, ERAR_STAT_INJECT_ERR);
	n = ctl->ring_size;
	if (n < 2 || n > ERAR_MAX_RING)
		DROP(st, ERAR_STAT_INJECT_ERR);

	mode = ctl->inject_mode;
	i = __sync_fetch_and_add(&ctl->inject_next, 1);
	if (i >= ctl->inject_count)
		DROP(st, ERAR_STAT_INJECT_ERR);
	if (mode == ERAR_INJECT_RESEND || mode == ERAR_INJECT_NACK) {
		struct erar_resend_list *list = slot_elem(&resends, slot, 0);

		if (!list || i >= ERAR_RESEND_MAX)
			DROP(st, ERAR_STAT_INJECT_ERR);
		chunk = list->chunk[i];
	} else {
		chunk = start_chunk(ctl, ctl->inject_first + i);
	}
	if (chunk >= ctl->chunks || chunk >= erar_chunks_per_slot)
		DROP(st, ERAR_STAT_INJECT_ERR);
	own = slot_elem(&slot_bufs, slot, chunk);
	if (!own)
		DROP(st, ERAR_STAT_INJECT_ERR);

	d = chunk_dist(ctl, chunk, n);
	h_ag = ag_hop(ctl, d, n);
	if (mode != ERAR_INJECT_START) {
		state = slot_elem(&chunk_states, slot, chunk);
		if (!state)
			DROP(st, ERAR_STAT_INJECT_ERR);
		stage = stage_of(READ_ONCE(*state), (__u32)armed);
	}
	if (mode == ERAR_INJECT_NACK) {
		if (!awaits(ctl, stage, d, h_ag, &kind, &step))
			DROP(st, ERAR_STAT_RESEND_SKIP);
		/* The payload is left as it is: the predecessor overwrites it. */
		write_nack_l2l4(data, ctl);
		kind |= ERAR_KIND_NACK;
	} else if (last_sent(ctl, stage, d, h_ag, n, &kind, &step)) {
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
	/* Nothing received yet: the frame carries this host's own data. */
	own = stage == ERAR_STAGE_NONE ? own_input(ctl, own, chunk, cb)
				       : own_output(ctl, own, chunk, cb);
	if (!own)
		DROP(st, ERAR_STAT_REGION_ERR);
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

	if (!last_sent(ctl, stage, d, ag_hop(ctl, d, n), n, &kind, &step) ||
	    h->kind != (ERAR_KIND_NACK | kind) || h->step != step)
		DROP(st, ERAR_STAT_NACK_SKIP);
	own = stage == ERAR_STAGE_NONE ? own_input(ctl, own, h->chunk, cb)
				       : own_output(ctl, own, h->chunk, cb);
	if (!own)
		DROP(st, ERAR_STAT_REGION_ERR);
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

/*
 * The frame's header again after a helper that may have moved the packet
 * (bpf_xdp_store_bytes, the combine's bpf_xdp_load_bytes/store_bytes):
 * every packet pointer taken before it is stale. NULL if the linear part no
 * longer holds the headers; `*data` gets the frame's start.
 */
static __always_inline struct erar_hdr_view *hdr_again(struct xdp_md *ctx, void **data)
{
	void *start = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;

	if (start + ERAR_PAYLOAD_OFF > end)
		return NULL;
	*data = start;
	return start + ERAR_L2L4_LEN;
}

/*
 * An all-gather frame ended its trip here, its payload stored (hop n-1). On
 * a ring whose frames circulate (an allreduce's: see "Circulating frames"
 * in docs/datapath.md) it goes on as this host's next starting frame: the
 * chunk drawn from start_next, its reduce-scatter step 0, its payload this
 * host's contribution (own_input()). So the rank injects only the first
 * window and the ring clocks itself, with no page, syscall or wake-up per
 * frame. Dropped when circulation is off, every starting chunk is drawn,
 * or the drawn one has moved on already (a NACK started it: its successor
 * has it, and would drop this copy as a duplicate).
 */
static __always_inline int end_trip(struct xdp_md *ctx, struct erar_slot_ctl *ctl,
				    struct erar_stats *st, __u32 slot, __u32 seq)
{
	const __u32 cb = erar_chunk_bytes;
	void *data, *own;
	struct erar_hdr_view *h;
	__u32 chunk;
	__u64 *state;

	/* Not after the rank re-armed the slot (it may have, once this
	 * frame's chunk completed the operation): the draw is the new one's. */
	if (!READ_ONCE(ctl->circulate) || ctl->trip.start_kind != ERAR_KIND_RS ||
	    READ_ONCE(ctl->armed) != (ERAR_ARMED_BIT | seq))
		DROP(st, ERAR_STAT_AG_LAST);
	chunk = start_chunk(ctl, __sync_fetch_and_add(&ctl->start_next, 1));
	if (chunk >= ctl->chunks || chunk >= erar_chunks_per_slot)
		DROP(st, ERAR_STAT_AG_LAST);
	own = slot_elem(&slot_bufs, slot, chunk);
	state = slot_elem(&chunk_states, slot, chunk);
	if (!own || !state || stage_of(READ_ONCE(*state), seq) != ERAR_STAGE_NONE)
		DROP(st, ERAR_STAT_AG_LAST);
	own = own_input(ctl, own, chunk, cb);
	if (!own)
		DROP(st, ERAR_STAT_REGION_ERR);
	if (bpf_xdp_store_bytes(ctx, ERAR_PAYLOAD_OFF, own, cb))
		DROP(st, ERAR_STAT_AG_LAST);
	h = hdr_again(ctx, &data);
	if (!h)
		DROP(st, ERAR_STAT_AG_LAST);
	h->kind = ERAR_KIND_RS;
	h->step = 0;
	h->chunk = chunk;
	write_l2l4(data, ctl);
	stat_inc(st, ERAR_STAT_CIRCULATED);
	return XDP_TX;
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
	turn_back(data);
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
	void *pl, *own, *in, *out;

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
	ctl = slot_ctl_of(slot);
	if (!ctl)
		DROP(st, ERAR_STAT_DROP_SLOT);
	/* Before the armed check: a rank between calls must answer too. */
	if (h->kind == ERAR_KIND_PING)
		return answer_ping(data, ctl, st, h);
	/* Before the armed check too: a host joins before it arms. */
	if (h->kind == ERAR_KIND_READY)
		return serve_ready(data, data_end, ctl, st, h, slot);

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
	learn_passed(ctl, st, slot, seq, n);
	step = h->step;
	d = chunk_dist(ctl, chunk, n);

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
	if (h->kind == ERAR_KIND_RS) {
		/* RS step s is received at distance s+1 from the origin, by the
		 * rs_hops hosts after it (none in a broadcast). */
		if (d - 1 >= ctl->trip.rs_hops || step + 1 != d)
			DROP(st, ERAR_STAT_DROP_STEP);
		if (stage != ERAR_STAGE_NONE)
			DROP(st, ERAR_STAT_DUP);
		/* Before the claim: a refused region leaves the chunk as it was. */
		in = own;
		out = own;
		if (READ_ONCE(ctl->out_region) && !regions_of(ctl, chunk, cb, &in, &out))
			DROP(st, ERAR_STAT_REGION_ERR);
		if (!take_chunk(st, state, word, seq, ERAR_STAT_RX_RS))
			DROP(st, ERAR_STAT_DUP);
		/* The partial is kept too (in the slot, or the caller's receive
		 * buffer): it is what a re-send of this hop must carry. In
		 * place, in the linear part and (a jumbo frame) its pages. */
		switch (erar_combine_frame(ctx, in, out, cb, combine_op(ctl, ctl->wire_op, chunk),
					   erar_frag_slices, st)) {
		case 0:
			break;
		case -1: /* nothing written: a whole frame may still come */
			WRITE_ONCE(*state, word);
			DROP(st, ERAR_STAT_DROP_SHORT);
		default: /* the slot holds the partial, no frame does: the
			  * chunk stays BUSY, the operation stalls (an error) */
			DROP(st, ERAR_STAT_DROP_SHORT);
		}
		h = hdr_again(ctx, &data);
		if (!h)
			DROP(st, ERAR_STAT_DROP_SHORT);
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
		/* AG step s is received at all-gather hop s+1 (see erar_trip.h),
		 * by a host that holds nothing of the chunk yet, or the partial
		 * it forwarded in the reduce-scatter. */
		__u32 hop = ag_hop(ctl, d, n);
		__u32 before = d >= 1 && d + 1 <= ctl->trip.rs_hops ? ERAR_STAGE_REDUCED
							       : ERAR_STAGE_NONE;

		if (hop != step + 1)
			DROP(st, ERAR_STAT_DROP_STEP);
		if (stage == ERAR_STAGE_FINAL || stage == ERAR_STAGE_BUSY)
			DROP(st, ERAR_STAT_DUP);
		if (stage != before)
			DROP(st, ERAR_STAT_DROP_STATE);
		/* Before the claim: a refused region leaves the chunk as it was. */
		out = own_output(ctl, own, chunk, cb);
		if (!out)
			DROP(st, ERAR_STAT_REGION_ERR);
		if (!take_chunk(st, state, word, seq, ERAR_STAT_RX_AG))
			DROP(st, ERAR_STAT_DUP);
		/* A memcpy in the kernel; the helper accepts a map value of
		 * exactly cb bytes (the slot's element) or a region's chunk as
		 * destination. */
		if (bpf_xdp_load_bytes(ctx, ERAR_PAYLOAD_OFF, out, cb)) {
			WRITE_ONCE(*state, word);
			DROP(st, ERAR_STAT_DROP_SHORT);
		}
		WRITE_ONCE(*state, stage_word(seq, ERAR_STAGE_FINAL));
		chunk_done(ctl, st, slot, seq);
		/* The all-gather ends at hop n-1 (allreduce: distance n-2;
		 * broadcast: n-1, the root's predecessor). */
		if (hop + 1 == n) /* everyone has it now */
			return end_trip(ctx, ctl, st, slot, seq);
		h->step = step + 1;
	} else {
		DROP(st, ERAR_STAT_DROP_STEP);
	}

	write_l2l4(data, ctl);
	stat_inc(st, ERAR_STAT_TX);
	return XDP_TX;
}

