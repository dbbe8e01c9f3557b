/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * erar_trip.h - a chunk's trip around the ring (BPF side only): its stage
 * words, a host's distance from the chunk's origin and its hop along the
 * chunk's all-gather, and from those the frame a host last sent for the
 * chunk and the one it waits for next (see docs/datapath.md).
 *
 * Allreduce and broadcast differ only in the data arm() puts in
 * erar_slot_ctl.trip (struct erar_trip, see erar_wire.h): nothing here
 * looks at the wire op.
 */
#ifndef ERAR_TRIP_H
#define ERAR_TRIP_H

#include <linux/types.h>

#include "erar_wire.h"

/* ---- Chunk stages (see "Reliability" in erar_wire.h) --------------------- */

static __always_inline __u32 stage_of(__u64 word, __u32 seq)
{
	return (__u32)(word >> 32) == seq ? (__u32)word : ERAR_STAGE_NONE;
}

static __always_inline __u64 stage_word(__u32 seq, __u32 stage)
{
	return ((__u64)seq << 32) | stage;
}

/* Moves the chunk's stage from `word` (as read) to BUSY: 1 if this frame
 * won, 0 if the stage had moved (a duplicate, or a copy racing this one). */
static __always_inline int claim_chunk(__u64 *state, __u64 word, __u32 seq)
{
	return __sync_val_compare_and_swap(state, word,
					   stage_word(seq, ERAR_STAGE_BUSY)) == word;
}

/* ---- Where a host is on a chunk's trip ------------------------------------ */

/* Hops from `from` to `pos` along the ring of n. */
static __always_inline __u32 ring_dist(__u32 pos, __u32 from, __u32 n)
{
	return pos >= from ? pos - from : pos + n - from;
}

/* The ring position where the chunk's frames start (allreduce: the
 * position whose run of chunks holds it; broadcast: the root). */
static __always_inline __u32 chunk_origin(const struct erar_slot_ctl *ctl, __u32 chunk)
{
	return chunk / ctl->trip.origin_run % ctl->trip.origin_mod + ctl->trip.origin_base;
}

/* This host's distance from the chunk's origin. */
static __always_inline __u32 chunk_dist(const struct erar_slot_ctl *ctl,
					__u32 chunk, __u32 n)
{
	return ring_dist(ctl->ring_pos, chunk_origin(ctl, chunk), n);
}

/* This host's hop along the chunk's all-gather, from its distance d: 0 where
 * the all-gather starts (allreduce: the host that finished the reduction,
 * d = n-1; broadcast: the root), then 1, 2, ... AG step s is received at
 * hop s+1, and the trip ends at hop n-1. */
static __always_inline __u32 ag_hop(const struct erar_slot_ctl *ctl, __u32 d,
				    __u32 n)
{
	__u32 h = d + ctl->trip.ag_shift;

	return h >= n ? h - n : h;
}

/* The i-th chunk whose frames start at this host (what run i of
 * ERAR_INJECT_START sends, or a circulating frame takes): its run's i-th;
 * ERAR_NO_CHUNK past the run. A chunk at or past the operation's count
 * (the last run may be shorter) is the caller's to refuse. */
static __always_inline __u32 start_chunk(const struct erar_slot_ctl *ctl, __u32 i)
{
	if (i >= ctl->trip.origin_run)
		return ERAR_NO_CHUNK;
	return (ctl->ring_pos - ctl->trip.origin_base) % ctl->trip.origin_mod *
	       ctl->trip.origin_run + i;
}

/*
 * The frame this host last sent for a chunk, from the chunk's stage, the
 * host's distance d from the chunk's origin and its all-gather hop h: its
 * kind and step, or 0 when the host has sent nothing (yet) for it, or the
 * frame ended its trip here.
 *
 *   d = 0, stage in start_stages   start_kind step 0 (RS: own contribution;
 *                                  AG: the broadcast root's data)
 *   1 <= d < rs_hops, REDUCED      RS step d (partial)
 *   h <= n-2, FINAL                AG step h
 */
static __always_inline int last_sent(const struct erar_slot_ctl *ctl,
				     __u32 stage, __u32 d, __u32 h, __u32 n,
				     __u8 *kind, __u8 *step)
{
	if (d == 0 && (ctl->trip.start_stages >> stage & 1)) {
		*kind = ctl->trip.start_kind;
		*step = 0;
		return 1;
	}
	if (stage == ERAR_STAGE_REDUCED && d >= 1 && d + 1 <= ctl->trip.rs_hops) {
		*kind = ERAR_KIND_RS;
		*step = d;
		return 1;
	}
	if (stage == ERAR_STAGE_FINAL && h + 2 <= n) {
		*kind = ERAR_KIND_AG;
		*step = h;
		return 1;
	}
	return 0;
}

/*
 * The frame this host waits for next for a chunk (the one its predecessor
 * sends it), from the chunk's stage, the host's distance d from the chunk's
 * origin and its all-gather hop h: its kind and step, or 0 when it waits
 * for nothing (final value held, a frame being applied right now, or the
 * all-gather starts here).
 *
 *   NONE, 1 <= d <= rs_hops        RS step d-1
 *   otherwise, h >= 1              AG step h-1
 */
static __always_inline int awaits(const struct erar_slot_ctl *ctl,
				  __u32 stage, __u32 d, __u32 h, __u8 *kind,
				  __u8 *step)
{
	if (stage == ERAR_STAGE_BUSY || stage == ERAR_STAGE_FINAL)
		return 0;
	if (stage == ERAR_STAGE_NONE && d - 1 < ctl->trip.rs_hops) {
		*kind = ERAR_KIND_RS;
		*step = d - 1;
		return 1;
	}
	if (h == 0)
		return 0;
	*kind = ERAR_KIND_AG;
	*step = h - 1;
	return 1;
}

#endif /* ERAR_TRIP_H */
