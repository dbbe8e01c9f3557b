//! Lanes: a rank's bulk work spread over the CPUs it may run on.
//!
//! A broadcast root does all of a call's sending: it copies the buffer into
//! its slot, and its BPF_PROG_RUN calls put every frame on the wire. Worse,
//! XDP_TX and redirects into a veth (or a NIC queue) schedule the receiving
//! queue's NAPI on the CPU that sent, so every hop of every frame the root
//! injects runs in softirq on the root's CPU: from one thread, the whole
//! chain runs on one CPU while the others idle. With one lane per CPU, each
//! lane injecting its share of the frames from its own thread (and one
//! queue per CPU on the interfaces, as multi-queue NICs have and the test
//! bed's veths are given), the chain runs on every CPU at once.
//!
//! The lanes are a persistent pool (rayon), built on the first call that
//! needs it, so a call pays a wake-up, not a thread creation. The pool has
//! as many threads as CPUs in this process's affinity mask (`ERAR_LANES`
//! overrides): a rank bound to one core gets one lane and no threads.
//! Lane i is bound to the i-th CPU of that mask: "one lane per CPU" is
//! then what happens, not what the scheduler may choose. Left free, both
//! lanes of a root sometimes ran on one CPU for a whole job, and its chain
//! on that CPU alone: a 1 MiB `osu_bcast` on 4 hosts (2 CPUs) took
//! 353-744 µs a call from one job to the next, 332-454 µs with the lanes
//! bound (8 jobs each); 8 rotating rounds of `-i 30`, bound against free,
//! best/median: 1.02/1.74x at 1 MiB, 1.04/1.45x at 2 MiB, 0.99-1.06x /
//! 0.95-1.11x at 4-32 MiB (session 30).

use anyhow::Result;
use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use super::affinity::{allowed_cpus, bind};
use crate::config::Config;

/// At most this many lanes, whatever the CPU count: beyond it the chain's
/// per-frame work is not what limits a broadcast.
pub const MAX_LANES: usize = 8;

/// Pieces smaller than this are not worth a lane's wake-up.
const MIN_COPY_PER_LANE: usize = 256 * 1024;

/// The process's lanes.
pub struct Lanes {
    /// `None`: one lane, the calling thread.
    pool: Option<rayon::ThreadPool>,
    count: usize,
}

impl Lanes {
    /// The process-wide lanes, created on first use.
    pub fn get() -> &'static Lanes {
        static LANES: OnceCell<Lanes> = OnceCell::new();
        LANES.get_or_init(|| Lanes::new(Config::get().lanes))
    }

    /// `requested` lanes, or (0) one per CPU of this process's affinity mask.
    fn new(requested: usize) -> Lanes {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let count = if requested == 0 { cpus } else { requested }.clamp(1, MAX_LANES);
        if count == 1 {
            return Lanes { pool: None, count };
        }
        let cpus = allowed_cpus();
        match rayon::ThreadPoolBuilder::new()
            .num_threads(count)
            .thread_name(|i| format!("liberar-lane-{i}"))
            .start_handler(move |i| {
                if !cpus.is_empty() {
                    let cpu = cpus[i % cpus.len()];
                    // Unbound, a lane runs where the scheduler puts it.
                    if !bind(cpu) {
                        log::debug!("liberar: lane {i} not bound to CPU {cpu}");
                    }
                }
            })
            .build()
        {
            Ok(pool) => Lanes {
                pool: Some(pool),
                count,
            },
            Err(e) => {
                log::warn!("liberar: no lane threads ({e}); one lane");
                Lanes {
                    pool: None,
                    count: 1,
                }
            }
        }
    }

    /// How many lanes [`Self::run`] runs.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Runs `work(lane)` for every lane 0..count at once and returns when
    /// all have returned: the first error, if any.
    pub fn run<F>(&self, work: F) -> Result<()>
    where
        F: Fn(usize) -> Result<()> + Sync,
    {
        let Some(pool) = &self.pool else {
            return work(0);
        };
        let first_error = Mutex::new(None);
        pool.broadcast(|ctx| {
            if let Err(e) = work(ctx.index()) {
                first_error.lock().get_or_insert(e);
            }
        });
        first_error.into_inner().map_or(Ok(()), Err)
    }

    /// `dst.copy_from_slice(src)`, each lane copying one contiguous piece.
    pub fn copy(&self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len(), "Lanes::copy of unequal lengths");
        let lanes = self.count.min(src.len() / MIN_COPY_PER_LANE).max(1);
        if lanes == 1 {
            dst.copy_from_slice(src);
            return;
        }
        let piece = src.len().div_ceil(lanes);
        let to = SharedMut(dst.as_mut_ptr());
        let _ = self.run(|lane| {
            let start = (lane * piece).min(src.len());
            let end = (start + piece).min(src.len());
            // SAFETY: the lanes' ranges are disjoint and inside `dst`, which
            // the caller lends us mutably until run() returns.
            let to = unsafe { std::slice::from_raw_parts_mut(to.get().add(start), end - start) };
            to.copy_from_slice(&src[start..end]);
            Ok(())
        });
    }
}

/// A mutable pointer the lanes share; each lane writes its own range only.
#[derive(Clone, Copy)]
struct SharedMut(*mut u8);

// SAFETY: see Lanes::copy: disjoint ranges, borrowed for the run only.
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    fn get(self) -> *mut u8 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::anyhow;

    #[test]
    fn every_lane_runs_once() {
        for count in [1, 3] {
            let lanes = Lanes::new(count);
            assert_eq!(lanes.count(), count);
            assert_eq!(lanes.pool.is_some(), count > 1, "one lane needs no threads");
            let seen = Mutex::new(Vec::new());
            lanes
                .run(|lane| {
                    seen.lock().push(lane);
                    Ok(())
                })
                .unwrap();
            let mut seen = seen.into_inner();
            seen.sort();
            assert_eq!(seen, (0..count).collect::<Vec<_>>());
        }
    }

    /// Lane i runs bound to the i-th CPU of the mask it was created under
    /// (round robin if there are more lanes than CPUs).
    #[test]
    fn each_lane_is_bound_to_its_cpu() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty(), "this thread's affinity mask is empty");
        let lanes = Lanes::new(3);
        let masks = Mutex::new(Vec::new());
        lanes
            .run(|lane| {
                masks.lock().push((lane, allowed_cpus()));
                Ok(())
            })
            .unwrap();
        let mut masks = masks.into_inner();
        masks.sort();
        for (lane, mask) in masks {
            assert_eq!(mask, vec![cpus[lane % cpus.len()]], "lane {lane}");
        }
    }

    #[test]
    fn an_error_of_one_lane_is_returned() {
        let lanes = Lanes::new(2);
        let r = lanes.run(|lane| {
            if lane == 1 {
                Err(anyhow!("lane 1 broke"))
            } else {
                Ok(())
            }
        });
        assert_eq!(r.unwrap_err().to_string(), "lane 1 broke");
    }

    #[test]
    fn copy_matches_copy_from_slice() {
        let lanes = Lanes::new(3);
        for len in [
            0,
            1,
            1000,
            MIN_COPY_PER_LANE * 2 + 12_345,
            3 * MIN_COPY_PER_LANE + 7,
        ] {
            let src: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
            let mut dst = vec![0u8; len];
            lanes.copy(&mut dst, &src);
            assert!(dst == src, "len {len}");
        }
    }
}
