/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * erar_maps.h - the per-slot maps of erar_xdp (BPF side only): each slot's
 * own inner maps, reached through one array of maps per kind, and how the
 * program finds a slot's element in them.
 *
 * Whoever runs a slot's ring holds the only user-space references to its
 * inner maps: the process itself for its own program, or, on the node
 * agent's datapath, the job that leased the slot (the agent creates them
 * per lease and hands over their fds; see "Privilege" in docs/datapath.md).
 * So no job can map another job's data. A slot without inner maps drops
 * every frame for it. The inner templates below are sized by user space
 * before load (chunk_bytes, chunks_per_slot).
 */
#ifndef ERAR_MAPS_H
#define ERAR_MAPS_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "erar_wire.h"

/* A plain load or store the compiler may neither cache nor tear: user space
 * writes and reads these map values concurrently through the mmap. */
#define READ_ONCE(x) (*(const volatile __typeof__(x) *)&(x))
#define WRITE_ONCE(x, v) (*(volatile __typeof__(x) *)&(x) = (v))

/* The template of an inner map: an mmappable array of `value_bytes`-byte
 * elements, by sizes only, no BTF types (libbpf cannot size BTF value types
 * of inner maps; the slot buffer's size changes before load anyway). */
#define ERAR_MMAP_INNER(tag, value_bytes)                                      \
	struct tag {                                                           \
		__uint(type, BPF_MAP_TYPE_ARRAY);                              \
		__uint(map_flags, BPF_F_MMAPABLE);                             \
		__uint(key_size, sizeof(__u32));                               \
		__uint(value_size, value_bytes);                               \
		__uint(max_entries, 1);                                        \
	}

/* One array of maps, indexed by slot, of inner maps `inner`. */
#define ERAR_PER_SLOT(name, inner)                                             \
	struct {                                                               \
		__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);                      \
		__uint(max_entries, ERAR_MAX_SLOTS);                           \
		__type(key, __u32);                                            \
		__array(values, struct inner);                                 \
	} name SEC(".maps")

/* This host's data for a slot: element c is chunk c. Mmapped as one buffer. */
ERAR_MMAP_INNER(slot_buf_inner, ERAR_MIN_CHUNK_BYTES);
ERAR_PER_SLOT(slot_bufs, slot_buf_inner);

/* The slot's route and operation state (one element), mmapped. */
ERAR_MMAP_INNER(slot_ctl_inner, sizeof(struct erar_slot_ctl));
ERAR_PER_SLOT(slot_ctls, slot_ctl_inner);

/* One state word per chunk of the slot (see "Reliability" in erar_wire.h),
 * mmapped: user space reads the stages to find the chunks it still misses. */
ERAR_MMAP_INNER(chunk_state_inner, sizeof(__u64));
ERAR_PER_SLOT(chunk_states, chunk_state_inner);

/* The chunks the slot's next ERAR_INJECT_RESEND / _NACK run names. */
ERAR_MMAP_INNER(resend_inner, sizeof(struct erar_resend_list));
ERAR_PER_SLOT(resends, resend_inner);

/* The slot's events (struct erar_event): wake-ups of a rank that sleeps
 * (erar_slot_ctl.sleeping) when its operation completes or its barrier moves. */
struct events_inner {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, ERAR_EVENTS_BYTES);
};
ERAR_PER_SLOT(slot_events, events_inner);

/* Registered buffers (see "Registered buffers" in erar_wire.h): one array
 * of region maps per size class, indexed by entry. One row per class:
 * X(class, array, element bytes). */
#define ERAR_REGION_CLASS_ROWS(X)                                              \
	X(0, regions_1m, ERAR_REGION_BYTES_1M)                                 \
	X(1, regions_4m, ERAR_REGION_BYTES_4M)                                 \
	X(2, regions_16m, ERAR_REGION_BYTES_16M)                               \
	X(3, regions_64m, ERAR_REGION_BYTES_64M)

#define ERAR_REGIONS(class, name, value_bytes)                                 \
	ERAR_MMAP_INNER(name##_inner, value_bytes);                            \
	struct {                                                               \
		__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);                      \
		__uint(max_entries, ERAR_MAX_REGIONS);                         \
		__type(key, __u32);                                            \
		__array(values, struct name##_inner);                          \
	} name SEC(".maps");
ERAR_REGION_CLASS_ROWS(ERAR_REGIONS)
#undef ERAR_REGIONS

#define ERAR_REGION_ROW_COUNT(class, name, value_bytes) +1
_Static_assert(0 ERAR_REGION_CLASS_ROWS(ERAR_REGION_ROW_COUNT) == ERAR_REGION_CLASSES,
	       "one row of ERAR_REGION_CLASS_ROWS per class");
#undef ERAR_REGION_ROW_COUNT

/* A frame's payload when it is not laid out as erar_combine_frame() reads
 * it in place (erar_reduce.h): per CPU, one chunk of the largest size. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__uint(key_size, sizeof(__u32));
	__uint(value_size, ERAR_MAX_CHUNK_BYTES);
} payload_scratch SEC(".maps");

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

/* The slot_ctl of slot index `slot` as a frame names it, or NULL when the
 * index is out of range or no ring holds the slot. */
static __always_inline struct erar_slot_ctl *slot_ctl_of(__u32 slot)
{
	if (slot >= ERAR_MAX_SLOTS)
		return 0;
	return slot_elem(&slot_ctls, slot, 0);
}

#endif /* ERAR_MAPS_H */
