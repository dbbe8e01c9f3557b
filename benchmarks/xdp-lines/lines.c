// SPDX-License-Identifier: (Apache-2.0 OR MIT)
/*
 * lines.c - the line table of a loaded BPF program, for benchmarks/xdp-lines:
 * one line per BTF line-info record, "OFFSET FILE:LINE SOURCE", OFFSET the
 * record's first byte in the JIT image, from the program's start (what perf
 * prints as sym+OFFSET). Where this machine's bpftool and perf cannot
 * disassemble BPF, this maps perf's samples to source lines.
 *
 *   lines PROG_ID
 */
#include <bpf/bpf.h>
#include <bpf/btf.h>
#include <bpf/libbpf.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *what)
{
	fprintf(stderr, "lines: %s: %s\n", what, strerror(errno));
	exit(1);
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: lines PROG_ID\n");
		return 2;
	}
	int fd = bpf_prog_get_fd_by_id((__u32)strtoul(argv[1], NULL, 0));
	if (fd < 0)
		die("the program");

	/* First the counts, then the records. */
	struct bpf_prog_info info = {};
	__u32 len = sizeof(info);
	if (bpf_obj_get_info_by_fd(fd, &info, &len))
		die("its info");
	__u32 n = info.nr_jited_line_info < info.nr_line_info ? info.nr_jited_line_info
							      : info.nr_line_info;
	if (!n || !info.nr_jited_ksyms) {
		fprintf(stderr, "lines: the program has no line info or no JIT image\n");
		return 1;
	}
	__u32 rec = info.line_info_rec_size;
	void *li = calloc(info.nr_line_info, rec);
	__u64 *jli = calloc(info.nr_jited_line_info, sizeof(__u64));
	__u64 *ksyms = calloc(info.nr_jited_ksyms, sizeof(__u64));
	if (!li || !jli || !ksyms)
		die("memory");
	struct bpf_prog_info more = {
		.nr_line_info = info.nr_line_info,
		.line_info_rec_size = rec,
		.line_info = (__u64)(unsigned long)li,
		.nr_jited_line_info = info.nr_jited_line_info,
		.jited_line_info_rec_size = sizeof(__u64),
		.jited_line_info = (__u64)(unsigned long)jli,
		.nr_jited_ksyms = info.nr_jited_ksyms,
		.jited_ksyms = (__u64)(unsigned long)ksyms,
	};
	len = sizeof(more);
	if (bpf_obj_get_info_by_fd(fd, &more, &len))
		die("its line info");
	struct btf *btf = btf__load_from_kernel_by_id(info.btf_id);
	if (!btf)
		die("its BTF");

	/* Offsets from the main function's start (a program of one function:
	 * erar_xdp's helpers are all inlined). */
	__u64 base = ksyms[0];
	for (__u32 i = 0; i < n; i++) {
		const struct bpf_line_info *l = (const void *)((const char *)li + (size_t)i * rec);
		const char *file = btf__name_by_offset(btf, l->file_name_off);
		const char *src = btf__name_by_offset(btf, l->line_off);
		const char *slash = file ? strrchr(file, '/') : NULL;

		if (jli[i] < base)
			continue; /* another function's */
		printf("%llu %s:%u %s\n", (unsigned long long)(jli[i] - base),
		       slash ? slash + 1 : (file ? file : "?"), BPF_LINE_INFO_LINE_NUM(l->line_col),
		       src ? src : "");
	}
	btf__free(btf);
	return 0;
}
