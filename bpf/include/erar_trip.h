/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * erar_trip.h - a chunk's trip around the ring (BPF side only): its stage
 * words, a host's distance from the chunk's origin, and from those the
 * frame a host last sent for the chunk and the one it waits for next (see
 * docs/datapath.md).
 */
#ifndef ERAR_TRIP_H
#define ERAR_TRIP_H

#include <linux/types.h>

#include "erar_wire.h"

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

#endif /* ERAR_TRIP_H */
