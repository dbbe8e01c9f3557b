/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * erar_frame.h - reading and rewriting a datapath frame's headers in place
 * (BPF side only): the erar_hdr view, the IPv4/UDP length fields, the
 * Ethernet+IPv4+UDP template copy, and turning a frame back to its sender.
 * Every offset comes from the structs (enum erar_frame_layout).
 */
#ifndef ERAR_FRAME_H
#define ERAR_FRAME_H

#include <linux/types.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/udp.h>

#include "erar_wire.h"

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

/* Ethernet+IPv4+UDP of a NACK: to the previous host of the ring. */
static __always_inline void write_nack_l2l4(void *data, const struct erar_slot_ctl *ctl)
{
	copy_l2l4(data, ctl->nack_tmpl);
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

/* Addresses the frame back to where it came from: Ethernet, IPv4 and UDP
 * source and destination swapped, UDP checksum 0 (none). The IPv4 checksum
 * is unchanged by swapping the addresses. */
static __always_inline void turn_back(void *data)
{
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ERAR_IP_OFF;
	struct udphdr *udp = data + ERAR_UDP_OFF;

	swap_bytes(eth->h_dest, eth->h_source, ETH_ALEN);
	swap_bytes((__u8 *)&ip->saddr, (__u8 *)&ip->daddr, sizeof(ip->saddr));
	swap_bytes((__u8 *)&udp->source, (__u8 *)&udp->dest, sizeof(udp->source));
	udp->check = 0;
}

#endif /* ERAR_FRAME_H */
