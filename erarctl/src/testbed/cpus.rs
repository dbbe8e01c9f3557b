//! How the machine's CPUs share their caches right now: the round trip of
//! one cache line between two CPUs (`erarctl testbed cpus`), which
//! benchmarks record beside each run.
//!
//! Why: on the test machine (a VM, 2 vCPUs, AMD EPYC) the host moves the
//! vCPUs between sharing a last-level cache (a round trip of 50-100 ns) and
//! not sharing one (310-360 ns), every few tens of seconds (session 31:
//! 20 probes 1.5 s apart gave 307-358 ns nine times, then 53-81 ns eleven
//! times). A design that hands cache-resident data from one CPU to the
//! other (an allreduce in 1 MiB segments) is 1.2x faster than streaming
//! from memory in the first placement and 0.75x in the second, while MPI
//! and liberar's default path barely notice it. A benchmark round
//! without this figure cannot be told apart from the other kind.

use liberar::datapath::affinity::bind;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Round trips a probe makes: about 1.5-7 ms of both CPUs.
pub const ROUNDS: u32 = 20_000;

/// The mean round trip of one cache line between CPUs `a` and `b` over
/// `rounds` exchanges (each thread waits for the other's write, then
/// writes): `None` if either CPU cannot be bound. Other work on either CPU
/// inflates it (a descheduled thread stalls the exchange).
pub fn round_trip(a: usize, b: usize, rounds: u32) -> Option<Duration> {
    // The line both threads write, and a flag either sets when it gives up
    // (a CPU it cannot run on), only read while waiting.
    let line = Arc::new(AtomicU32::new(0));
    let quit = Arc::new(AtomicBool::new(false));
    // Waits until `line` holds `want`; false if the other side quit.
    let wait = |line: &AtomicU32, quit: &AtomicBool, want: u32| loop {
        if line.load(Ordering::Acquire) == want {
            return true;
        }
        if quit.load(Ordering::Relaxed) {
            return false;
        }
        std::hint::spin_loop();
    };
    let other = {
        let (line, quit) = (Arc::clone(&line), Arc::clone(&quit));
        std::thread::spawn(move || {
            if !bind(b) {
                quit.store(true, Ordering::Relaxed);
                return false;
            }
            for i in 0..rounds {
                if !wait(&line, &quit, 2 * i + 1) {
                    return false;
                }
                line.store(2 * i + 2, Ordering::Release);
            }
            true
        })
    };
    let mut ok = bind(a);
    let start = Instant::now();
    if ok {
        for i in 0..rounds {
            line.store(2 * i + 1, Ordering::Release);
            if !wait(&line, &quit, 2 * i + 2) {
                ok = false;
                break;
            }
        }
    }
    let took = start.elapsed();
    if !ok {
        quit.store(true, Ordering::Relaxed);
    }
    let answered = other.join().unwrap_or(false);
    (ok && answered && rounds > 0).then(|| took / rounds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use liberar::datapath::affinity::allowed_cpus;

    #[test]
    fn a_round_trip_between_two_allowed_cpus() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty(), "no CPU in this process's affinity mask");
        if cpus.len() < 2 {
            return;
        }
        let t = round_trip(cpus[0], cpus[1], 1000);
        assert!(t.is_some_and(|t| t > Duration::ZERO), "{t:?}");
    }

    #[test]
    fn a_cpu_outside_the_mask_gives_none() {
        let cpus = allowed_cpus();
        let outside = (0..libc::CPU_SETSIZE as usize)
            .find(|c| !cpus.contains(c))
            .expect("a CPU number outside the mask");
        assert_eq!(round_trip(cpus[0], outside, 10), None);
        assert_eq!(round_trip(outside, cpus[0], 10), None);
    }
}
