/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * erar_wire.h - the ONE definition of liberar's datapath wire format and of
 * every constant and struct shared between the BPF programs and Rust.
 *
 * Rust gets this file through bindgen (liberar/build.rs -> OUT_DIR/wire.rs,
 * re-exported by liberar::datapath::wire). Never re-declare any of this in
 * Rust: change it here and both sides follow.
 *
 * Only plain C with the kernel's UAPI headers is allowed in here (no BPF
 * helpers), so that both clang -target bpf and bindgen (host target) can
 * parse it. Offsets and lengths are computed from the structs (sizeof,
 * offsetof) as enum constants: clang evaluates them, bindgen hands Rust the
 * values, so neither side writes a header offset as a number.
 *
 * Byte order: the Ethernet/IPv4/UDP headers are network order as usual; every
 * field of struct erar_hdr is little-endian (all hosts here are LE, and the
 * datapath never converts them).
 */
#ifndef ERAR_WIRE_H
#define ERAR_WIRE_H

#include <linux/types.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/udp.h>

/* ---- Frame layout ------------------------------------------------------ */

/* UDP destination port that marks a datapath frame. Everything else on the
 * interface (MPI's own TCP, ARP, ...) is passed to the stack untouched. */
#define ERAR_UDP_PORT 47470

#define ERAR_MAGIC 0x52415245u /* "ERAR" read as a little-endian u32 */
#define ERAR_VERSION 3

/* Limits. chunk_bytes must be a multiple of ERAR_CHUNK_ALIGN (the reduce
 * loops work on whole u64 words, and BPF array maps round each element to 8
 * bytes, so only then is a slot one contiguous buffer in the mmap). */
#define ERAR_CHUNK_ALIGN 8
#define ERAR_MIN_CHUNK_BYTES 64
/* The largest frame that BPF_PROG_RUN accepts in live-frames mode is
 * PAGE_SIZE - XDP_PACKET_HEADROOM - sizeof(struct xdp_page_head) (112 on
 * 6.18) - sizeof(struct skb_shared_info) (320) = 3408 bytes, so the payload
 * of a frame the program injects is at most 3408 - ERAR_PAYLOAD_OFF = 3336
 * (a multiple of 8). Such a frame needs an MTU of at least 3394. */
#define ERAR_MAX_LINEAR_CHUNK_BYTES 3336
/* Larger chunks (jumbo frames) are sent from user space (an AF_PACKET
 * socket, liberar's kernel/raw.rs and kernel/jumbo.rs) and reach the XDP program in
 * fragments: veth's page pool puts the first ERAR_JUMBO_HEAD_BYTES of the
 * payload in the linear part (one page less XDP_PACKET_HEADROOM, 256, and
 * skb_shared_info, 320, is 3520 bytes of frame) and the rest in whole pages
 * of ERAR_JUMBO_FRAG_BYTES. A 9000-byte MTU carries 8936 (9000 - IPv4,
 * UDP and erar headers, a multiple of 8). */
#define ERAR_MAX_CHUNK_BYTES 8936
#define ERAR_JUMBO_HEAD_BYTES 3448
#define ERAR_JUMBO_FRAG_BYTES 4096
/* Slots one host has on the datapath: each ring (communicator) holds two,
 * used by its operations in turn (see "Generations" in docs/datapath.md),
 * so four rings per host. */
#define ERAR_MAX_SLOTS 8
/* Registered buffers (regions): a caller's buffer whose pages are the
 * pages of a BPF map, so that XDP reads and writes it with no copy through
 * the slot buffer (liberar's kernel/region.rs): a broadcast's (the root's
 * frames filled from it, the other hosts storing what they receive into
 * theirs), or an allreduce's send buffer (read) and receive buffer (the
 * partials and the result written). One inner map each, of one element:
 * its first ERAR_REGION_HEAD bytes hold the token of the ring that may use
 * it, then the buffer at its offset within a page, then the last chunk's
 * padding. Three per ring (liberar's ring/registered.rs numbers them).
 *
 * Region maps come in ERAR_REGION_CLASSES sizes, each with an array of
 * maps of its own (`regions_<size>` in erar_maps.h): a buffer takes the
 * smallest class that holds it, so that a 256 KiB allreduce holds 2 MiB of
 * kernel memory a rank, not the 128 MiB that one 64 MiB class made it
 * hold (the kernel allocates and zeroes a map's every page when it
 * creates it). An element is its class's buffer bytes and
 * ERAR_REGION_PAD (the head, the buffer's offset in its first page, the
 * last chunk's padding). Region r of an operation (erar_slot_ctl's
 * in_region, out_region: r + 1) is entry r % ERAR_MAX_REGIONS of class
 * r / ERAR_MAX_REGIONS. */
#define ERAR_MAX_REGIONS (2 * ERAR_MAX_SLOTS)
#define ERAR_REGION_HEAD 4096
#define ERAR_REGION_PAD (8 * 4096)
#define ERAR_REGION_CLASSES 4
#define ERAR_REGION_BYTES_1M (1 * 1024 * 1024 + ERAR_REGION_PAD)
#define ERAR_REGION_BYTES_4M (4 * 1024 * 1024 + ERAR_REGION_PAD)
#define ERAR_REGION_BYTES_16M (16 * 1024 * 1024 + ERAR_REGION_PAD)
#define ERAR_REGION_BYTES_64M (64 * 1024 * 1024 + ERAR_REGION_PAD)
/* Ring size limit: step fits the u8 field with room to spare. */
#define ERAR_MAX_RING 128

/* erar_hdr.kind */
enum erar_kind {
	ERAR_KIND_RS = 1, /* reduce-scatter: payload is a partial reduction */
	ERAR_KIND_AG = 2, /* all-gather: payload is the final value */
	/* Liveness probe of a slot's ring, sent by a rank's ordinary UDP
	 * socket (any source port) while it waits for the other ranks: the
	 * receiving host's XDP answers it by itself, armed or not, whatever
	 * its rank is doing, with the same frame turned back (addresses and
	 * ports swapped, kind ERAR_KIND_PONG, UDP checksum 0), which the
	 * prober's stack delivers to its socket. So a rank that is only late
	 * still answers, and silence means its host or link is gone. Full
	 * datapath length, so it passes the same validation as data. */
	ERAR_KIND_PING = 3,
	ERAR_KIND_PONG = 4,
	/* The in-kernel barrier of an operation (see "Barrier" below), sent to
	 * the predecessor: "`chunk` consecutive hosts, from me on down the
	 * ring, have joined operation `seq` with the call key in the first
	 * ERAR_KEY_WORDS words of the payload" (or ERAR_READY_ABORT). Full
	 * datapath length, so it passes the same validation as data. */
	ERAR_KIND_READY = 5,
	/* Flag: a negative acknowledgement, sent to the predecessor. Frame
	 * ERAR_KIND_NACK | k, step s of a chunk means "I miss your (k, s) frame
	 * of this chunk": the predecessor's XDP turns it into that frame, if
	 * that is the frame it last sent for the chunk (see "Reliability"). It
	 * is full-sized so that it can be rewritten in place. */
	ERAR_KIND_NACK = 0x80,
};

/* erar_hdr.wire_op: how payload words combine with this host's contribution.
 * AND/OR/XOR work on u64 words (any element type whose bitwise op is meant). */
enum erar_wire_op {
	ERAR_OP_ADD_I32 = 1,
	ERAR_OP_ADD_I64 = 2,
	ERAR_OP_MAX_I32 = 3,
	ERAR_OP_MIN_I32 = 4,
	ERAR_OP_MAX_U32 = 5,
	ERAR_OP_MIN_U32 = 6,
	ERAR_OP_MAX_I64 = 7,
	ERAR_OP_MIN_I64 = 8,
	ERAR_OP_MAX_U64 = 9,
	ERAR_OP_MIN_U64 = 10,
	ERAR_OP_AND = 11,
	ERAR_OP_OR = 12,
	ERAR_OP_XOR = 13,
	/* Broadcast: no reduction. The root injects every chunk as an AG frame
	 * (step 0); each other host stores it and forwards it, the root's
	 * predecessor is the last. RS frames are invalid with this op. */
	ERAR_OP_BCAST = 14,
	/* Float SUM under the `bounded` contract: chunks below the armed
	 * erar_slot_ctl.flags_from hold i32 values (ADD_I32), the chunks from
	 * there on hold per-element flag bits (OR). See numerics/bounded.rs. */
	ERAR_OP_ADD_I32_FLAGS = 15,
	ERAR_OP_NR, /* one past the last valid op */
};

/* The datapath header, right after the UDP header. */
struct erar_hdr {
	__u32 magic;   /* ERAR_MAGIC */
	__u8 version;  /* ERAR_VERSION */
	__u8 kind;     /* enum erar_kind */
	__u8 step;     /* hops already taken in this phase (see docs/datapath.md) */
	__u8 wire_op;  /* enum erar_wire_op; must equal the armed op */
	__u32 comm_id; /* communicator id, must match the slot */
	__u32 token;   /* per-ring random token, must match the slot */
	__u32 seq;     /* operation number, must equal the slot's armed seq */
	__u32 chunk;   /* chunk index within the operation */
	__u16 slot;    /* receiver's slot index (same on every host of a ring) */
	__u16 reserved[2]; /* zero; pads the payload to an 8-byte offset */
} __attribute__((packed));

/*
 * Where everything sits in a datapath frame: Ethernet, IPv4 without
 * options, UDP, struct erar_hdr, payload. The forwarding path overwrites
 * exactly the first ERAR_L2L4_LEN bytes from the slot's precomputed
 * template; struct erar_hdr is 30 bytes so that the payload starts 8-byte
 * aligned relative to the frame start, for the u64 reduce loops.
 */
enum erar_frame_layout {
	ERAR_IP_OFF = sizeof(struct ethhdr),
	ERAR_UDP_OFF = ERAR_IP_OFF + sizeof(struct iphdr),
	ERAR_L2L4_LEN = ERAR_UDP_OFF + sizeof(struct udphdr),
	ERAR_HDR_LEN = sizeof(struct erar_hdr),
	ERAR_PAYLOAD_OFF = ERAR_L2L4_LEN + ERAR_HDR_LEN,
	/* The header fields a sender writes and a receiver checks. */
	ERAR_ETH_DEST_OFF = __builtin_offsetof(struct ethhdr, h_dest),
	ERAR_ETH_SOURCE_OFF = __builtin_offsetof(struct ethhdr, h_source),
	ERAR_ETH_PROTO_OFF = __builtin_offsetof(struct ethhdr, h_proto),
	ERAR_IP_TOT_LEN_OFF = ERAR_IP_OFF + __builtin_offsetof(struct iphdr, tot_len),
	ERAR_IP_FRAGS_OFF = ERAR_IP_OFF + __builtin_offsetof(struct iphdr, frag_off),
	ERAR_IP_TTL_OFF = ERAR_IP_OFF + __builtin_offsetof(struct iphdr, ttl),
	ERAR_IP_PROTO_OFF = ERAR_IP_OFF + __builtin_offsetof(struct iphdr, protocol),
	ERAR_IP_CHECK_OFF = ERAR_IP_OFF + __builtin_offsetof(struct iphdr, check),
	ERAR_IP_SADDR_OFF = ERAR_IP_OFF + __builtin_offsetof(struct iphdr, saddr),
	ERAR_IP_DADDR_OFF = ERAR_IP_OFF + __builtin_offsetof(struct iphdr, daddr),
	ERAR_UDP_SOURCE_OFF = ERAR_UDP_OFF + __builtin_offsetof(struct udphdr, source),
	ERAR_UDP_DEST_OFF = ERAR_UDP_OFF + __builtin_offsetof(struct udphdr, dest),
	ERAR_UDP_LEN_OFF = ERAR_UDP_OFF + __builtin_offsetof(struct udphdr, len),
	ERAR_UDP_CHECK_OFF = ERAR_UDP_OFF + __builtin_offsetof(struct udphdr, check),
};

/* What the standards fix (RFC 894, 791, 768) and docs/datapath.md states;
 * liberar's wire.rs tests check the same numbers on the Rust side. */
_Static_assert(ERAR_L2L4_LEN == 14 + 20 + 8, "Ethernet + IPv4 + UDP");
_Static_assert(ERAR_HDR_LEN == 30 && ERAR_PAYLOAD_OFF == 72, "erar_hdr size");
_Static_assert(ERAR_PAYLOAD_OFF % 8 == 0, "payload 8-byte aligned");
_Static_assert(ERAR_MAX_LINEAR_CHUNK_BYTES == 3408 - ERAR_PAYLOAD_OFF &&
		       ERAR_MAX_LINEAR_CHUNK_BYTES % ERAR_CHUNK_ALIGN == 0 &&
		       ERAR_MAX_CHUNK_BYTES == (9000 - (ERAR_PAYLOAD_OFF - ERAR_IP_OFF)) / 8 * 8 &&
		       ERAR_JUMBO_HEAD_BYTES == 3520 - ERAR_PAYLOAD_OFF &&
		       ERAR_MAX_CHUNK_BYTES <= ERAR_JUMBO_HEAD_BYTES + 2 * ERAR_JUMBO_FRAG_BYTES,
	       "largest live frame, jumbo chunk and its layout");

/* ---- Per-host kernel state shared with user space ------------------------ */

/* Ethernet+IPv4+UDP header this host writes on every frame it sends for a
 * slot (to the next host of the ring), IPv4 checksum included. Stored as u64
 * words so BPF copies it with five 8-byte and one 2-byte store. */
#define ERAR_TEMPLATE_WORDS 6
_Static_assert(ERAR_TEMPLATE_WORDS * 8 == ERAR_L2L4_LEN + 6,
	       "five whole words and one 2-byte tail");

/* armed: ERAR_ARMED_BIT | seq while armed, 0 when not. One 64-bit word so the
 * XDP program sees "armed" and "seq" consistently with a single load. */
#define ERAR_ARMED_BIT (1ull << 32)

/* erar_slot_ctl.inject_mode: what one BPF_PROG_RUN of the inject path sends. */
enum erar_inject_mode {
	/* This host's starting frames, one per run: allreduce, the RS step-0
	 * frame of chunk ring_pos + ring_size * i; broadcast (root), the AG
	 * step-0 frame of chunk i. */
	ERAR_INJECT_START = 1,
	/* Run i re-sends chunk resend.chunk[i]: the frame this host last sent
	 * for it, rebuilt from the chunk's stage (its payload is the slot
	 * buffer's chunk, which always holds what was last sent). */
	ERAR_INJECT_RESEND = 2,
	/* Run i asks the predecessor for the frame this host waits for next
	 * for chunk resend.chunk[i] (an ERAR_KIND_NACK frame); chunks this host
	 * waits for nothing of are skipped. */
	ERAR_INJECT_NACK = 3,
	/* One ERAR_KIND_READY frame to the predecessor for the joined
	 * operation, its count inject_count (see "Barrier"). */
	ERAR_INJECT_READY = 4,
	/* One ERAR_KIND_READY query (step ERAR_READY_QUERY) to the successor
	 * for the joined operation: "tell me your count again". */
	ERAR_INJECT_QUERY = 5,
};

/* ---- Barrier -----------------------------------------------------------------
 *
 * Before a host injects an operation, every host must have armed (joined)
 * it with the same call key, so that no frame arrives early and an
 * erroneous call (counts, types, ops or roots that differ across ranks)
 * fails everywhere before anything is sent. The hosts agree on it in the
 * kernel, with no MPI exchange: a host joins operation seq (join_seq, key)
 * and sends its predecessor READY(seq, 1 + c), where c is the count its
 * successor last told it (0 if none). A host's XDP keeps the newest count
 * it is told in `ready` ((seq << 32) | count; a newer seq replaces an older
 * one, a larger count a smaller one) and the key beside it; if it has
 * joined that seq itself it checks the key and tells its predecessor
 * 1 + count in turn (ERAR_READY_ABORT if the keys differ), each time the
 * count grows. A host passes the barrier when its successor's count is at
 * least n - 1 (every other host joined, every neighbour's key checked: the
 * keys are all equal), or when its successor has moved on to a newer seq
 * (which it can only do once everyone joined this one). An abort travels
 * the whole ring and fails the operation on every host. A joined host
 * sends its READY again from time to time until it passes (lost frames),
 * and its XDP posts an event when it passes or aborts. A data frame or NACK
 * of the operation tells a host that passed too (its sender passed, so
 * everyone joined): a READY lost after its sender stopped sending costs
 * nothing more than the next frame. */
#define ERAR_KEY_WORDS 4
#define ERAR_READY_ABORT 0xffffffffu
/* erar_hdr.step of a READY sent to the successor instead: a query. A host
 * that waits in a barrier sends one from time to time, since its
 * successor, once passed, tells it nothing more on its own: the
 * successor's XDP answers (if it joined that operation) with the count its
 * rank tells, its own key in the payload, as a READY to its predecessor.
 * That is ERAR_READY_ABORT for a count kept before the host joined with
 * another key, which only the rank could check: its abort holds however
 * many of its READYs are lost. */
#define ERAR_READY_QUERY 1

/* No chunk: start_chunk() past a run (above any operation's count). */
#define ERAR_NO_CHUNK 0xffffffffu

/*
 * The trip of an operation's frames around the ring, set by arm() from the
 * op (the one place that tells broadcast from allreduce), so that XDP's hop
 * arithmetic is the same for both (see erar_trip.h):
 *                 allreduce         broadcast
 *   origin_run    ceil(C / n)       0xffffffff
 *   origin_mod    n                 1
 *   origin_base   0                 root
 *   rs_hops       n - 1             0
 *   ag_shift      1                 0
 *   start_kind    ERAR_KIND_RS      ERAR_KIND_AG
 *   start_stages  1 << STAGE_NONE   every stage
 * Chunk c's frames start at ring position (c / origin_run) % origin_mod +
 * origin_base (its origin): an allreduce's origins each start a run of
 * consecutive chunks, a block of the buffer, in order (start_chunk() in
 * erar_trip.h). So each host combines and stores a few runs of adjacent
 * chunks, which the CPU's prefetchers follow; with chunks interleaved (c
 * mod n), every chunk was a new stream: `benchmarks/floor`'s combine of a
 * chunk out of the cache took 1136-1140 ns taking every 4th chunk, against
 * 506-618 ns taking the next one (session 46). A chunk takes rs_hops
 * reduce-scatter hops; the host at distance d from the origin is hop (d +
 * ag_shift) mod n of the chunk's all-gather; the origin's first frame is of
 * kind start_kind, and it re-sends it while the chunk's stage is one of
 * start_stages (bits).
 */
struct erar_trip {
	__u32 origin_run;
	__u32 origin_mod;
	__u32 origin_base;
	__u32 rs_hops;
	__u32 ag_shift;
	__u32 start_kind;
	__u32 start_stages;
};

/* One element of the slot_ctl map (BPF_F_MMAPABLE: user space writes it
 * through an mmap, XDP reads it per frame). */
struct erar_slot_ctl {
	__u64 tmpl[ERAR_TEMPLATE_WORDS]; /* first ERAR_L2L4_LEN bytes used */
	/* The same to the previous host of the ring (NACKs go upstream). */
	__u64 nack_tmpl[ERAR_TEMPLATE_WORDS];
	/* Route, written by configure_slot() while the slot is disarmed. */
	__u32 comm_id;
	__u32 token;
	__u32 ring_pos;  /* this host's position 0..ring_size-1 */
	__u32 ring_size; /* n */
	__u32 ifindex;   /* interface the inject path sends out of */
	/* Operation, written by arm() before `armed`. */
	__u32 root;    /* broadcast: ring position of the root */
	__u32 chunks;  /* chunk count C of the armed operation */
	__u32 wire_op; /* enum erar_wire_op */
	__u32 flags_from; /* ERAR_OP_ADD_I32_FLAGS: first chunk of flag bits */
	/* The armed op's trip around the ring (set by arm() from the op). */
	struct erar_trip trip;
	__u64 armed;   /* see ERAR_ARMED_BIT; written last by arm() */
	/* Progress: chunks whose final value is in this host's slot buffer.
	 * Incremented atomically by XDP when a chunk's stage becomes FINAL
	 * (exactly once per chunk); reset by arm() before arming. */
	__u32 done;
	/* Frames that circulate (an allreduce's, set by arm()): an all-gather
	 * frame that ends its trip on this host becomes its next starting
	 * frame (see "Circulating frames" in docs/datapath.md), so the rank
	 * injects only the first window. start_next counts the starting
	 * frames taken (run i starts chunk start_chunk(i)), by circulation
	 * and by the rank before its START runs, atomically: both take them
	 * at once. Reset by arm(). */
	__u32 circulate;
	__u32 start_next;
	/* Inject path: set by user space before each BPF_PROG_RUN (or before
	 * a broadcast root's lanes start theirs); inject_next counts the runs,
	 * drawn atomically (the lanes' runs interleave), up to inject_count. */
	__u32 inject_mode;  /* enum erar_inject_mode */
	__u32 inject_next;  /* index of the next run */
	__u32 inject_count; /* START and lists: runs to make (START: from
			     * starting frame inject_first on; lists:
			     * entries of the slot's resend list);
			     * READY: the count to send */
	__u32 inject_first;
	/* Barrier (see "Barrier"): the operation this host joined and its
	 * call key, written by user space (key first, join_seq last); the
	 * newest count its successor told it and that READY's key, written
	 * by XDP (key first, then `ready` by compare-and-swap). */
	__u32 key[ERAR_KEY_WORDS];
	__u32 join_seq;
	__u32 ready_key[ERAR_KEY_WORDS];
	__u64 ready;
	/* Whether the rank sleeps on the slot's event ring buffer (user space
	 * sets it before its last look and clears it on waking): XDP posts an
	 * event (a wake-up) only then. A rank that polls sees `done` and
	 * `ready` move by itself. */
	__u32 sleeping;
	/* Registered buffers (set by arm(), see "Registered buffers"): where
	 * a broadcast's root reads the chunks it sends (in) and where the
	 * other hosts store the chunks they receive and re-send them from
	 * (out); an allreduce's send (in) and receive (out) buffers. 0: the
	 * slot buffer; r + 1: region r (class r / ERAR_MAX_REGIONS) from byte
	 * *_off on, chunk c at *_off + c * chunk_bytes. */
	__u32 in_region;
	__u32 in_off;
	__u32 out_region;
	__u32 out_off;
	__u32 pad;
};

/* ---- Reliability ------------------------------------------------------------
 *
 * Every host keeps one state word per (slot, chunk) in the chunk_state map:
 *     (seq << 32) | stage
 * A word whose seq is not the armed one reads as ERAR_STAGE_NONE, so no reset
 * is needed between operations (configure_slot() zeroes the slot's words when
 * a new ring takes it, because a new ring restarts seq). A frame is processed
 * only by the compare-and-swap that moves its chunk's stage forward: a
 * duplicate, or a re-sent frame that crosses the original, finds the stage
 * already moved and is dropped (ERAR_STAT_DUP), so nothing adds twice.
 *
 * The slot buffer's chunk always holds the payload of the last frame this
 * host sent for the chunk (the reduce-scatter writes its partial back), so a
 * lost frame is re-sent by its sender from the chunk's stage alone.
 *
 * Recovery is first local and in the kernel: a host whose progress stops
 * for a moment sends its predecessor one NACK per chunk it still waits for,
 * naming the frame it waits for; the predecessor's XDP answers with that
 * frame if it is the one it last sent for the chunk (else the loss was
 * further up the ring, whose own NACKs repair it first). Only when that
 * does not help do the ranks compare stages over MPI (ERAR_INJECT_RESEND). */
enum erar_chunk_stage {
	ERAR_STAGE_NONE = 0,    /* nothing received (own contribution, if any) */
	ERAR_STAGE_BUSY = 1,    /* a frame is being applied right now */
	ERAR_STAGE_REDUCED = 2, /* partial reduction stored and forwarded (RS) */
	ERAR_STAGE_FINAL = 3,   /* final value stored (and forwarded) */
};

/* Chunks one BPF_PROG_RUN in ERAR_INJECT_RESEND mode can re-send. */
#define ERAR_RESEND_MAX 256

/* One element per slot of the resend map (BPF_F_MMAPABLE). */
struct erar_resend_list {
	__u32 chunk[ERAR_RESEND_MAX];
};

/* Size of each slot's completion-event ring buffer (a power of 2 pages). */
#define ERAR_EVENTS_BYTES (64 * 1024)

/* Ring-buffer record: slot `slot` completed operation `seq` on this host. */
struct erar_event {
	__u32 slot;
	__u32 seq;
};

/* Per-CPU counters (one struct erar_stats per CPU, key 0). */
enum erar_stat {
	ERAR_STAT_RX_RS,        /* RS frames accepted and reduced */
	ERAR_STAT_RX_AG,        /* AG frames accepted and stored */
	ERAR_STAT_FINISHED,     /* RS frames finished here (turned into AG) */
	ERAR_STAT_TX,           /* frames forwarded with XDP_TX */
	ERAR_STAT_AG_LAST,      /* AG frames that ended their trip here (and were dropped) */
	ERAR_STAT_COMPLETE,     /* operations completed on this host */
	ERAR_STAT_INJECTED,     /* frames built by erar_inject */
	ERAR_STAT_DROP_SHORT,   /* truncated datapath frame */
	ERAR_STAT_DROP_MAGIC,   /* bad magic */
	ERAR_STAT_DROP_VERSION, /* unknown version */
	ERAR_STAT_DROP_SLOT,    /* slot index out of range */
	ERAR_STAT_DROP_COMM,    /* comm_id does not match the slot */
	ERAR_STAT_DROP_TOKEN,   /* token does not match the slot */
	ERAR_STAT_DROP_SEQ,     /* slot not armed, or seq != armed seq */
	ERAR_STAT_DROP_OP,      /* wire_op differs from the armed op */
	ERAR_STAT_DROP_CHUNK,   /* chunk index >= armed chunk count */
	ERAR_STAT_DROP_STEP,    /* kind/step not the one this host receives */
	ERAR_STAT_DROP_RINGBUF, /* a sleeping rank's event could not be posted */
	ERAR_STAT_INJECT_ERR,   /* erar_inject could not build a frame */
	ERAR_STAT_DUP,          /* duplicate: the chunk's stage had moved on */
	ERAR_STAT_DROP_STATE,   /* frame impossible in the chunk's stage */
	ERAR_STAT_RESENT,       /* frames re-sent by the inject path */
	ERAR_STAT_RESEND_SKIP,  /* re-send asked for, nothing (stable) to send */
	ERAR_STAT_DROP_MALFORMED, /* frame, IPv4 or UDP length, or reserved bytes wrong */
	ERAR_STAT_NACK_SENT,    /* NACKs built by the inject path */
	ERAR_STAT_NACK_SERVED,  /* NACKs answered with the frame they name */
	ERAR_STAT_NACK_SKIP,    /* NACKs naming a frame this host did not last send */
	ERAR_STAT_PING,         /* liveness probes answered */
	ERAR_STAT_READY,        /* barrier counts taken from the successor */
	ERAR_STAT_READY_FWD,    /* barrier counts passed on to the predecessor */
	ERAR_STAT_READY_STALE,  /* barrier frames older than what was known */
	ERAR_STAT_READY_ABORT,  /* call keys found to differ (operation aborted) */
	ERAR_STAT_READY_SENT,   /* barrier frames built by the inject path */
	ERAR_STAT_READY_LEARNED, /* barriers passed on a data frame or NACK */
	ERAR_STAT_READY_QUERY,  /* barrier queries answered */
	ERAR_STAT_PAYLOAD_COPIED, /* RS payloads combined through a copy (layout not the one read in place) */
	ERAR_STAT_CIRCULATED,   /* AG frames that ended their trip here and went on as this host's next starting frame */
	ERAR_STAT_REGION_ERR,   /* frames dropped: the armed region is missing or not the ring's */
	ERAR_STAT_NR,
};

struct erar_stats {
	__u64 c[ERAR_STAT_NR];
};

/* ---- Emulated switch (test bed only) -------------------------------------- */

/* Ports of one emulated switch (devmap size). */
#define ERAR_SWITCH_MAX_PORTS 64

/* Per-CPU counters of the switch (switch_stats, one u64 per index). */
enum erar_switch_stat {
	ERAR_SW_REDIRECTED,   /* datapath frames forwarded once (fast path) */
	ERAR_SW_PASSED,       /* other frames, given to the Linux bridge */
	ERAR_SW_UNKNOWN_MAC,  /* datapath frames to an unknown MAC (bridge) */
	ERAR_SW_LOST,         /* impairment: random loss (dropped) */
	ERAR_SW_DUPLICATED,   /* impairment: forwarded twice */
	ERAR_SW_REORDERED,    /* impairment: sent the slow way, via the bridge */
	ERAR_SW_RULE_DROPPED, /* impairment: first pass of a chosen frame dropped */
	ERAR_SW_RULE_PASSED,  /* chosen frame seen again (re-send): forwarded */
	ERAR_SW_RULE_FULL,    /* chosen frame not tracked (table error): forwarded */
	ERAR_SW_STAT_NR,
};

/* ---- Impairments of the emulated switch (test bed only) -------------------
 *
 * Applied to datapath frames only (MPI's TCP is never touched), at the
 * switch port where a frame enters, i.e. once per hop. Configured through
 * the switch_impair array (one struct erar_impair_cfg, key 0); all zero is
 * a perfect switch. Rates are in parts per million of frames. */
#define ERAR_PPM 1000000u
/* Chosen-frame drop rules active at once. */
#define ERAR_IMPAIR_MAX_RULES 4

/* erar_impair_rule.select: which chunks of an operation a rule picks. */
enum erar_impair_select {
	ERAR_SELECT_CHUNK = 1, /* chunk index == arg (0: the first chunk) */
	ERAR_SELECT_EVERY = 2, /* chunk % every == arg */
};

/* erar_impair_rule.op: which operations a rule applies to. */
enum erar_impair_op {
	ERAR_IMPAIR_OP_ANY = 0,
	ERAR_IMPAIR_OP_ALLREDUCE = 1, /* every wire_op but ERAR_OP_BCAST */
	ERAR_IMPAIR_OP_BCAST = 2,     /* wire_op == ERAR_OP_BCAST */
};

/* "Drop the first copy of every frame of this kind/step whose chunk is
 * selected"; later copies of the same frame (the re-sends: same comm_id,
 * seq, chunk, slot, kind, step) pass, so each such frame is lost once. */
struct erar_impair_rule {
	__u8 kind;     /* enum erar_kind; 0: the rule is off */
	__u8 step;     /* step to match, unless any_step */
	__u8 any_step; /* 1: every step */
	__u8 op;       /* enum erar_impair_op */
	__u32 select;  /* enum erar_impair_select */
	__u32 every;   /* ERAR_SELECT_EVERY: period (>= 1) */
	__u32 arg;     /* chunk index, or remainder for ERAR_SELECT_EVERY */
};

struct erar_impair_cfg {
	__u32 loss_ppm;    /* random loss: XDP_DROP */
	__u32 dup_ppm;     /* random duplication: delivered twice */
	__u32 reorder_ppm; /* random delay: via the Linux bridge (slow path), so
			    * that later frames overtake it */
	__u32 burst;       /* frames each random loss drops in a row, on the
			    * CPU that lost the first (a full queue's tail
			    * drops); 0 or 1: one */
	struct erar_impair_rule rules[ERAR_IMPAIR_MAX_RULES];
};

/* Key of the switch's table of frames already dropped once by a rule. */
struct erar_impair_key {
	__u32 comm_id;
	__u32 token;
	__u32 seq;
	__u32 chunk;
	__u16 slot;
	__u8 kind;
	__u8 step;
};

/* Frames the table remembers (LRU: the oldest are forgotten first). */
#define ERAR_IMPAIR_TRACKED 65536

#endif /* ERAR_WIRE_H */
