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
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "erar_wire.h"
#include "erar_parse.h"

char LICENSE[] SEC("license") = "Dual MIT/GPL";

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

enum { SW_REDIRECTED, SW_PASSED, SW_UNKNOWN_MAC, SW_NR };

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, SW_NR);
} switch_stats SEC(".maps");

static __always_inline void sw_count(__u32 idx)
{
	__u64 *c = bpf_map_lookup_elem(&switch_stats, &idx);

	if (c)
		(*c)++;
}

SEC("xdp")
int testbed_switch(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u64 mac = 0;
	__u32 *port;

	if (!erar_is_datapath(data, data_end)) {
		sw_count(SW_PASSED);
		return XDP_PASS;
	}
	__builtin_memcpy(&mac, data, 6); /* h_dest */
	port = bpf_map_lookup_elem(&switch_fdb, &mac);
	if (!port) {
		sw_count(SW_UNKNOWN_MAC);
		return XDP_PASS; /* let the bridge learn/flood it */
	}
	sw_count(SW_REDIRECTED);
	/* Low bits of flags: action if the devmap slot is empty. */
	return bpf_redirect_map(&switch_ports, *port, XDP_PASS);
}
