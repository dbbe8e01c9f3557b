/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * erar_parse.h - recognise a liberar datapath frame (BPF side only).
 *
 * A datapath frame is Ethernet / IPv4 without options, not fragmented /
 * UDP with destination port ERAR_UDP_PORT. Senders always build exactly
 * this layout, so the check works on fixed offsets: one bounds check for
 * all three headers, no variable-length parsing.
 */
#ifndef ERAR_PARSE_H
#define ERAR_PARSE_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "erar_wire.h"

/* IPv4 frag_off bits that mean "this is (part of) a fragment". DF is fine. */
#define ERAR_IP_MF 0x2000
#define ERAR_IP_OFFMASK 0x1fff

/*
 * Returns 1 if [data, data_end) starts with the Ethernet/IPv4/UDP headers of
 * a datapath frame, 0 otherwise (the caller passes such frames on). On 1 the
 * verifier knows that ERAR_L2L4_LEN bytes at data are readable.
 */
static __always_inline int erar_is_datapath(void *data, void *data_end)
{
	struct ethhdr *eth = data;
	struct iphdr *ip = data + sizeof(*eth);
	struct udphdr *udp = data + sizeof(*eth) + sizeof(*ip);

	if (data + ERAR_L2L4_LEN > data_end)
		return 0;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return 0;
	/* ihl == 5 keeps the UDP header at its fixed offset. */
	if (ip->ihl != 5 || ip->version != 4 || ip->protocol != IPPROTO_UDP)
		return 0;
	if (ip->frag_off & bpf_htons(ERAR_IP_MF | ERAR_IP_OFFMASK))
		return 0;
	return udp->dest == bpf_htons(ERAR_UDP_PORT);
}

#endif /* ERAR_PARSE_H */
