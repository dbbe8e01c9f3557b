//! Copies of whole buffers between the caller's memory and the datapath's
//! (a rank's input into its host's shared region, a result out of a slot
//! or region into the caller's buffer): large ones with non-temporal
//! stores.
//!
//! Such a copy writes memory that nothing reads again soon from this core's
//! cache (the leader reads a region while it reduces, the application its
//! result later), and the machine is bound by memory traffic: the rings'
//! frames, the kernel's combines and the copies of several ranks share it.
//! Streaming stores skip the read of every destination line that an
//! ordinary store makes first. glibc's memcpy picks them only above a
//! threshold taken from the last-level cache, which virtual machines
//! report as hundreds of MiB, so it never does here.
//!
//! Measured on the 2-CPU test machine: one 16 MiB copy 12.2 GB/s with
//! memcpy, 15.4 with these stores (64 MiB: 5.7 against 8.0 GB/s). A rank's
//! input into its ring's slot is an ordinary copy below
//! [`INPUT_STREAM_MIN`]: the kernel reads it within the call, from the
//! cache if it is still there (one rank per host, streaming every copy
//! from 4 MiB: 0.78x at 4 MiB, 0.87x at 8 MiB).

/// The node path (several ranks per host) streams every copy from this
/// size on but a reduction's into its leader's slot (the kernel reads it
/// within the call). 8 ranks on 4 hosts, MTU 9000, `allreduce_bench -T int`, 3
/// alternating rounds, best, against ordinary copies: 1.17x (4 MiB),
/// 1.33x (8 MiB), 1.19x, 1.04x, 1.29x (64 MiB).
///
/// A piece (a call) this large also streams every slice it copies or
/// decodes out to a rank's buffer, however small the slice: the same
/// benchmark, against streaming only slices this large, 3-4 alternating
/// rounds, best: `-T float` 1.22x and 1.11x at 4 MiB (2 MiB slices),
/// `-T int` 1.09x and 1.10x.
///
/// From 1 MiB since session 23, once the float decode ran at memory speed
/// (codec/slot_words.rs): 8 ranks, OSU `osu_allreduce`, 4-6 alternating
/// rounds, best, against streaming from 4 MiB: 2 MiB `-T mpi_float`
/// 1.25x, 1.08x, 1.09x and `-T mpi_int` 1.08x, 1.11x, 1.11x in five runs;
/// 1 MiB int 1.14x and 0.94x, float 0.95x and 1.10x, and, steady state
/// (`-i 1200` less `-i 200`, 3 alternating rounds), int 4.9-5.2 ms of
/// CPU a call against 5.5-6.6 (2.07-2.27 ms against 2.23-2.57 a call),
/// float 5.8-7.1 against 6.0-7.3. (Session 18's `allreduce_bench` had a
/// 2 MiB call lose to it, 0.94-0.99x, with the f64 decode.)
pub const NODE_STREAM_MIN: usize = 1 << 20;

/// A result copied out of a ring's slot (one rank per host), a whole call
/// or one of its segments, is streamed from this size on: the caller's
/// buffer is written whole and the slot is reused two operations later.
/// Measured with paired calls (crate::paired, session 42: half of one
/// job's calls took the other threshold; A/A jobs read 0.98-1.01), OSU
/// `osu_allreduce -T mpi_int -i 500-600`, 4 hosts, MTU 9000, streamed
/// from 1 MiB against from 16 MiB, six jobs: 1.01-1.08x at 2 MiB,
/// 1.03-1.08x at 4 MiB, 1.03-1.08x at 8 MiB, 0.98-1.03x at 1 MiB;
/// from 256 KiB, 0.97-1.02x at 256-512 KiB, hence not below. (Rotating
/// rounds of whole jobs had read 0.87-1.12x at 4-8 MiB, sessions 23 and
/// 30: within their noise.) From 16 MiB: 1.18x (16 MiB), 1.15x, 1.07x
/// (64 MiB) in session 23.
pub const RESULT_STREAM_MIN: usize = 1 << 20;

/// A rank's input copied into its ring's slot (one rank per host, an
/// exact allreduce) is streamed from this size on. Four hosts' slots are
/// then larger than the last-level cache (32 MiB here), so the kernel
/// reads the input from memory either way, and an ordinary copy only adds
/// the read of every slot line before it is written. OSU `osu_allreduce
/// -T mpi_int -i 20-30`, 4 hosts, MTU 9000, 6 rotating rounds, best /
/// median against ordinary copies (session 32): 1.07/1.07x (16 MiB),
/// 1.04/1.09x (32 MiB), 1.07/1.10x (64 MiB) in one run, 1.04/1.10x and
/// 1.06/1.08x at 16 MiB in another; from 4 MiB, 0.92/0.94x at 4 MiB and
/// 1.01/1.03x at 8 MiB, hence not below. At 32 MiB it gains whether or
/// not the two vCPUs share their cache (jobs in turn, tagged with the
/// round trip of a cache line between them: 34.7-37.5 against
/// 37.1-37.9 ms shared, 38.3-38.9 against 39.4-41.5 ms not).
pub const INPUT_STREAM_MIN: usize = 16 << 20;

/// A broadcast's data copied out of a ring's slot (one rank per host, on
/// the ranks other than the root) is streamed from this size on: the
/// caller's buffer is written whole and not read back soon, and a
/// broadcast's working set (every host's buffer and slot) leaves the cache
/// from a few MiB. 4 hosts, OSU `osu_bcast -i 30-50`, streaming against
/// ordinary copies, rotating rounds, best/median (session 30, a 2-CPU
/// machine with a 32 MiB L3): 8 MiB 1.11/1.24x, 1.10/1.26x, 1.18/1.08x in
/// three runs; 4 MiB 1.01/1.09x, 1.10/1.14x, 1.08/1.03x; from 1 MiB,
/// 1 MiB lost (0.67/0.85x).
pub const BCAST_STREAM_MIN: usize = 4 << 20;

/// `dst.copy_from_slice(src)`, with streaming stores if it is
/// `stream_min` bytes or more and the CPU has AVX2 (see the module docs).
/// Panics if the lengths differ, as `copy_from_slice` does.
pub fn copy(dst: &mut [u8], src: &[u8], stream_min: usize) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between buffers of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    {
        use crate::numerics::simd::{level, Level};
        if dst.len() >= stream_min && level() >= Level::Avx2 {
            // SAFETY: `level()` answers AVX2 only on a CPU that has it.
            unsafe { stream_avx2(dst, src) };
            return;
        }
    }
    dst.copy_from_slice(src);
}

/// The streaming copy: up to the first 32-byte aligned destination byte
/// and the last partial block by `copy_from_slice`, the rest in blocks of
/// 256 bytes (eight unaligned loads, then eight streaming stores), and a
/// store fence, so that the data is visible before anything this thread
/// writes next (the barrier's words, the kernel's syscalls).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    const BLOCK: usize = 256;
    const LANES: usize = BLOCK / 32;
    let len = dst.len();
    let head = dst.as_ptr().align_offset(32).min(len);
    dst[..head].copy_from_slice(&src[..head]);
    let blocks = (len - head) / BLOCK;
    let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
    for b in 0..blocks {
        // SAFETY: block b lies within both slices (b < blocks, counted
        // from `head`); `d + head` is 32-byte aligned, as the streaming
        // store needs, and so is every 32-byte step from it; the loads are
        // unaligned ones.
        unsafe {
            let (d, s) = (
                d.add(b * BLOCK).cast::<__m256i>(),
                s.add(b * BLOCK).cast::<__m256i>(),
            );
            let mut v = [std::mem::zeroed::<__m256i>(); LANES];
            for (k, v) in v.iter_mut().enumerate() {
                *v = _mm256_loadu_si256(s.add(k));
            }
            for (k, v) in v.iter().enumerate() {
                _mm256_stream_si256(d.add(k), *v);
            }
        }
    }
    _mm_sfence();
    let done = head + blocks * BLOCK;
    dst[done..].copy_from_slice(&src[done..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length and misalignment around the block and the threshold
    /// copies exactly, streamed or not, and touches nothing outside the
    /// destination.
    #[test]
    fn copies_exactly_at_every_edge() {
        const MIN: usize = NODE_STREAM_MIN;
        let n = MIN + 1024;
        let src: Vec<u8> = (0..n + 64).map(|i| (i * 7 + i / 251) as u8).collect();
        let lens = [0, 1, 31, 255, 256, 257, 4097, MIN - 1, MIN, MIN + 291];
        for (stream_min, len) in [0, MIN].into_iter().flat_map(|m| lens.map(|l| (m, l))) {
            for (so, dof) in [(0, 0), (1, 0), (0, 5), (13, 31), (32, 1)] {
                let mut dst = vec![0xa5u8; n + 64];
                copy(&mut dst[dof..dof + len], &src[so..so + len], stream_min);
                let what = format!("len {len}, offsets {so}/{dof}, streamed from {stream_min}");
                assert_eq!(&dst[dof..dof + len], &src[so..so + len], "{what}");
                assert!(dst[..dof].iter().all(|&b| b == 0xa5), "before: {what}");
                assert!(dst[dof + len..].iter().all(|&b| b == 0xa5), "after: {what}");
            }
        }
    }
}
