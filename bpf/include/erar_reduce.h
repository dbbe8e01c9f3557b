/* SPDX-License-Identifier: (Apache-2.0 OR MIT) */
/*
 * erar_reduce.h - element-wise combine of a frame's payload with this host's
 * contribution (BPF side only).
 *
 * One tight loop per wire op (no per-element dispatch), made from one row
 * per op of ERAR_COMBINES, over blocks of constant size (a global function
 * the verifier checks once, erar_combine_block) and a rest that the
 * verifier sees as a constant (it comes from frozen .rodata). The caller does the single packet bounds check for the whole payload before
 * calling; inside the loops there are no helper calls and no bounds checks.
 *
 *   pkt[i] = op(pkt[i], own[i])           and
 *   out[i] = pkt[i]                       in the same pass (fin == 1),
 *
 * out being own but on registered buffers (the caller's send and receive
 * buffers, see region_chunk() in erar_ring.bpf.c).
 *
 * ADD_I32 uses a two-lane SWAR add on u64 words: half the loads and stores
 * of a 32-bit loop, and exact wrap-around per 32-bit lane. The loops run
 * four words a step (then the rest one by one): the loop is bound by its
 * instructions, and a step's counter, bound and branch are paid once per
 * four words.
 */
#ifndef ERAR_REDUCE_H
#define ERAR_REDUCE_H

#include <linux/types.h>
#include "erar_wire.h"
#include "erar_stats.h" /* the copy path is counted */
#include "erar_maps.h"  /* its per-CPU copy */

/* a + b per 32-bit lane: the high lanes added as u64 words (their carry
 * falls off the top), the low lanes by a 32-bit add (which zero-extends).
 * clang makes it 6 ALU instructions a word, against 9 and a 64-bit
 * constant reloaded every word for the masked form (a31 ^ b31 fixed up
 * after adding the low 31 bits): with the 4-word steps, erar_xdp went from
 * 925-962 to 779-817 ns a run on 16 MiB int calls (bpf_stats, session 17). */
#define ERAR_SWAR_ADD32(a, b)                                                  \
	(((((a) >> 32) + ((b) >> 32)) << 32) |                                 \
	 (__u64)(__u32)((__u32)(a) + (__u32)(b)))

#define ERAR_MAXV(a, b) ((a) > (b) ? (a) : (b))
#define ERAR_MINV(a, b) ((a) < (b) ? (a) : (b))

/*
 * pkt/own/out: payload in the frame, this host's contribution and where
 * the combine is kept (fin), the same as own but for an allreduce on
 * registered buffers; T: word type; EXPR combines `a` (frame) and `b`
 * (own). `nbytes` must be a verifier-known constant, `fin` a compile-time
 * constant.
 */
#define ERAR_COMBINE_ONE(T, EXPR, p_, s_, o_, j_, fin)                        \
	do {                                                                   \
		T a = (p_)[j_];                                                \
		T b = (s_)[j_];                                                \
		T v_ = (EXPR);                                                 \
		(p_)[j_] = v_;                                                 \
		if (fin)                                                       \
			(o_)[j_] = v_;                                         \
	} while (0)

#define ERAR_COMBINE_LOOP(T, EXPR, pkt, own, out, nbytes, fin)                 \
	do {                                                                   \
		T *p_ = (T *)(pkt);                                            \
		T *s_ = (T *)(own);                                            \
		T *o_ = (T *)(out);                                            \
		__u32 n_ = (nbytes) / sizeof(T);                               \
		__u32 i_ = 0;                                                  \
		for (; i_ + 4 <= n_; i_ += 4) {                                \
			ERAR_COMBINE_ONE(T, EXPR, p_, s_, o_, i_, fin);        \
			ERAR_COMBINE_ONE(T, EXPR, p_, s_, o_, i_ + 1, fin);    \
			ERAR_COMBINE_ONE(T, EXPR, p_, s_, o_, i_ + 2, fin);    \
			ERAR_COMBINE_ONE(T, EXPR, p_, s_, o_, i_ + 3, fin);    \
		}                                                              \
		for (; i_ < n_; i_++)                                          \
			ERAR_COMBINE_ONE(T, EXPR, p_, s_, o_, i_, fin);        \
	} while (0)

/*
 * The combines the kernel knows, one row per wire op: X(op, word type,
 * combine of `a` (frame) and `b` (own)). erar_combine() is a switch made of
 * these rows, and liberar's build reads the list (liberar/build.rs), so a
 * wire op Rust sends that no row combines fails its tests. ADD_I32_FLAGS
 * has no row of its own: it is ADD_I32 or OR, by chunk (combine_op()).
 */
#define ERAR_COMBINES(X)                                                       \
	X(ERAR_OP_ADD_I32, __u64, ERAR_SWAR_ADD32(a, b))                        \
	X(ERAR_OP_ADD_I64, __u64, a + b)                                        \
	X(ERAR_OP_MAX_I32, __s32, ERAR_MAXV(a, b))                              \
	X(ERAR_OP_MIN_I32, __s32, ERAR_MINV(a, b))                              \
	X(ERAR_OP_MAX_U32, __u32, ERAR_MAXV(a, b))                              \
	X(ERAR_OP_MIN_U32, __u32, ERAR_MINV(a, b))                              \
	X(ERAR_OP_MAX_I64, __s64, ERAR_MAXV(a, b))                              \
	X(ERAR_OP_MIN_I64, __s64, ERAR_MINV(a, b))                              \
	X(ERAR_OP_MAX_U64, __u64, ERAR_MAXV(a, b))                              \
	X(ERAR_OP_MIN_U64, __u64, ERAR_MINV(a, b))                              \
	X(ERAR_OP_AND, __u64, a & b)                                            \
	X(ERAR_OP_OR, __u64, a | b)                                             \
	X(ERAR_OP_XOR, __u64, a ^ b)

/*
 * Combines one payload. Returns 0, or -1 for an unknown op (the caller has
 * already checked the op against the armed one, so this does not happen).
 */
static __always_inline int erar_combine(void *pkt, void *own, void *out,
					__u32 nbytes, __u32 op, const int fin)
{
	switch (op) {
#define ERAR_COMBINE_CASE(OP, T, EXPR)                                         \
	case OP:                                                               \
		ERAR_COMBINE_LOOP(T, EXPR, pkt, own, out, nbytes, fin);        \
		return 0;
		ERAR_COMBINES(ERAR_COMBINE_CASE)
#undef ERAR_COMBINE_CASE
	}
	return -1;
}

/*
 * The combine of erar_xdp: blocks of ERAR_COMBINE_BLOCK bytes through one
 * global function, which the verifier checks once for any pointers it is
 * given (packet, slot or registered buffer: memory of a block at least),
 * then the rest of the payload inline. Inlined, the loops were explored
 * once for each kind of pointer a call site may pass, which an allreduce
 * on registered buffers doubled (286 021 to 663 893 instructions, 0.43 to
 * 1.1 s a load, 1.5 s more to start a 4-rank job: session 43).
 */
#define ERAR_COMBINE_BLOCK 256

struct erar_block {
	__u64 w[ERAR_COMBINE_BLOCK / 8];
};

__noinline int erar_combine_block(struct erar_block *pkt, struct erar_block *own,
				  struct erar_block *out, __u32 op)
{
	if (!pkt || !own || !out)
		return -1;
	return erar_combine(pkt, own, out, ERAR_COMBINE_BLOCK, op, 1);
}

static __always_inline int erar_combine_blocks(void *pkt, void *own, void *out, __u32 nbytes,
					       __u32 op)
{
	__u32 k = 0;

	for (; k + ERAR_COMBINE_BLOCK <= nbytes; k += ERAR_COMBINE_BLOCK)
		if (erar_combine_block(pkt + k, own + k, out + k, op))
			return -1;
	if (k < nbytes)
		return erar_combine(pkt + k, own + k, out + k, nbytes - k, op, 1);
	return 0;
}

/* The kfuncs that reach a jumbo frame's fragments in place. */
extern int bpf_dynptr_from_xdp(struct xdp_md *xdp, __u64 flags,
			       struct bpf_dynptr *ptr__uninit) __ksym;
extern void *bpf_dynptr_slice_rdwr(const struct bpf_dynptr *ptr, __u32 offset,
				   void *buffer__opt, __u32 buffer__szk) __ksym;

/*
 * Combines a frame's whole payload (cb bytes from ERAR_PAYLOAD_OFF) with
 * `own`, writing the frame and `out`, in place: the linear part's
 * ERAR_JUMBO_HEAD_BYTES at most, then up to two whole pages of fragments (a jumbo frame as veth's
 * page pool lays it out, see ERAR_JUMBO_HEAD_BYTES), each piece a loop of
 * constant length. A payload laid out otherwise, or any payload with
 * fragments when `slices` is 0 (a load-time constant: the kernel refuses
 * the slice kfunc), goes through the per-CPU payload_scratch (a copy in and
 * out: correct, slower). Returns 0; -1 if the frame is
 * shorter than cb (nothing written); 1 if the copy could not be written
 * back (`out` holds the combine, the frame does not). Packet pointers the
 * caller holds are stale afterwards.
 */
static __always_inline int erar_combine_frame(struct xdp_md *ctx, void *own, void *out,
					      __u32 cb, __u32 op, const __u32 slices,
					      struct erar_stats *st)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	const __u32 n0 = cb < ERAR_JUMBO_HEAD_BYTES ? cb : ERAR_JUMBO_HEAD_BYTES;
	const __u32 n1 = cb - n0 < ERAR_JUMBO_FRAG_BYTES ? cb - n0 : ERAR_JUMBO_FRAG_BYTES;
	const __u32 n2 = cb - n0 - n1;
	void *p0 = data + ERAR_PAYLOAD_OFF, *p1 = 0, *p2 = 0, *scratch;
	struct bpf_dynptr frame;
	int copied = 0;

	if (slices && n1 && !bpf_dynptr_from_xdp(ctx, 0, &frame)) {
		p1 = bpf_dynptr_slice_rdwr(&frame, ERAR_PAYLOAD_OFF + n0, 0, n1);
		if (n2)
			p2 = bpf_dynptr_slice_rdwr(&frame, ERAR_PAYLOAD_OFF + n0 + n1, 0, n2);
	}
	if (p0 + n0 > data_end || (n1 && !p1) || (n2 && !p2)) {
		__u32 zero = 0;

		scratch = bpf_map_lookup_elem(&payload_scratch, &zero);
		if (!scratch || bpf_xdp_load_bytes(ctx, ERAR_PAYLOAD_OFF, scratch, cb))
			return -1;
		copied = 1;
		stat_inc(st, ERAR_STAT_PAYLOAD_COPIED);
		p0 = scratch;
		p1 = scratch + n0;
		p2 = scratch + n0 + n1;
	}
	erar_combine_blocks(p0, own, out, n0, op);
	if (n1)
		erar_combine_blocks(p1, own + n0, out + n0, n1, op);
	if (n2)
		erar_combine_blocks(p2, own + n0 + n1, out + n0 + n1, n2, op);
	if (copied && bpf_xdp_store_bytes(ctx, ERAR_PAYLOAD_OFF, scratch, cb))
		return 1;
	return 0;
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

#endif /* ERAR_REDUCE_H */
