//! The calling thread's CPUs: which it may run on, and binding it to one
//! (a broadcast root's lanes, `erarctl testbed cpus`, the fuzzer's race
//! threads).

/// The CPUs of the calling thread's affinity mask, in order (empty if the
/// kernel does not say).
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the kernel writes at
    // most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a cpu_set_t of `size` bytes; pid 0 is this thread.
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` is below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Binds the calling thread to `cpu`: false if no CPU has that number or
/// the kernel refused (the thread then runs where it did).
pub fn bind(cpu: usize) -> bool {
    if cpu >= libc::CPU_SETSIZE as usize {
        return false;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (checked above).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a cpu_set_t of the size passed; pid 0 is this thread.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_bound_to_one_allowed_cpu_runs_only_there() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty(), "no CPU in this thread's affinity mask");
        let last = *cpus.last().expect("a CPU");
        let seen = std::thread::spawn(move || (bind(last), allowed_cpus()))
            .join()
            .expect("the bound thread");
        assert_eq!(seen, (true, vec![last]));
        assert!(!bind(libc::CPU_SETSIZE as usize));
        assert!(!bind(usize::MAX));
    }
}
