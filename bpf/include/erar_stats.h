/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * erar_stats.h - erar_xdp's counters (BPF side only): the per-CPU `stats`
 * map (one struct erar_stats, indexed by enum erar_stat of erar_wire.h,
 * which names them for Rust too) and how a path counts and drops.
 */
#ifndef ERAR_STATS_H
#define ERAR_STATS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "erar_wire.h"

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct erar_stats);
	__uint(max_entries, 1);
} stats SEC(".maps");

static __always_inline void stat_inc(struct erar_stats *st, __u32 idx)
{
	if (idx < ERAR_STAT_NR)
		st->c[idx]++;
}

/* Counts `reason` and drops the frame: every drop has exactly one counter. */
#define DROP(st, reason)                                                       \
	do {                                                                   \
		stat_inc(st, reason);                                          \
		return XDP_DROP;                                               \
	} while (0)

#endif /* ERAR_STATS_H */
