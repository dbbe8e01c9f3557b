//! The trials `liberar::select::decide` asks for, as the shim runs them:
//! an MPI trial under way ([`Trial`]), and each trial's time reported to the
//! communicator's tuner ([`sample`]), with the one exchange that adds up
//! every rank's best times once a class's trials are over.

use crate::comm::CommState;
use crate::ffi::{MPI_Comm, MPI_SUCCESS};
use crate::pmpi_comm::PmpiComm;
use crate::rt::Runtime;
use liberar::config::Config;
use liberar::datapath::{Comm as _, DatapathError};
use liberar::select::{Class, ElemType, Path, ReduceOp, Tuner};
use liberar::stats;
use parking_lot::Mutex;
use std::os::raw::c_int;
use std::time::Instant;

/// An MPI trial under way: the binding runs PMPI, then [`Trial::done`].
pub struct Trial {
    pub(crate) state: &'static Mutex<CommState>,
    pub(crate) class: Class,
    pub(crate) comm: MPI_Comm,
    pub(crate) comm_size: usize,
    pub(crate) t0: Instant,
}

impl Trial {
    /// Records the trial once PMPI has completed the call with `rc`. A failed
    /// call is not a measurement (and its communicator may be unusable).
    ///
    /// # Safety
    /// Right after PMPI completed the call on `self.comm`, inside the same
    /// intercepted call.
    pub unsafe fn done(self, rt: &Runtime, rc: c_int) {
        if rc != MPI_SUCCESS {
            return;
        }
        let Ok(adapter) = PmpiComm::new(rt, self.comm, self.comm_size, None, None) else {
            return;
        };
        sample(
            &adapter,
            &mut self.state.lock().tuner,
            self.class,
            Path::Mpi,
            self.t0,
        );
    }
}

/// Records one trial; after a class's last, adds up every rank's best time
/// of each path and settles the class on the sums. Every rank comes here on
/// the same call, so the exchange is matched.
pub fn sample(adapter: &PmpiComm<'_>, tuner: &mut Tuner, class: Class, path: Path, t0: Instant) {
    let mut took = t0.elapsed();
    let cfg = Config::get();
    if path == Path::Fast
        && cfg.test_slow_fast != 1.0
        && cfg
            .test_slow_fast_rank
            .is_none_or(|r| r as usize == adapter.rank())
    {
        took = took.mul_f64(cfg.test_slow_fast);
    }
    let Some(mine) = tuner.sample(class, path, took) else {
        return;
    };
    let times = match sum_over_ranks(adapter, mine) {
        Ok(sums) => sums,
        Err(e) => {
            // MPI itself failed on this communicator: MPI it is (never wrong).
            log::warn!("liberar: adding up trial times failed: {e}");
            [0, i64::MAX]
        }
    };
    let chosen = tuner.settle(class, times);
    let n = adapter.size().max(1) as i64;
    let mean_us = times.map(|t| t / n);
    stats::record_choice(class, chosen, mean_us);
    log::debug!(
        "liberar: {} from {} B on this communicator -> {} (mean over ranks of each rank's best: \
         mpi {} us, fast {} us)",
        class.kind_name(),
        class.min_bytes(),
        chosen.name(),
        mean_us[Path::Mpi as usize],
        mean_us[Path::Fast as usize]
    );
}

/// `MPI_Allreduce(SUM)` of two i64 over the communicator.
fn sum_over_ranks(adapter: &PmpiComm<'_>, mine: [i64; 2]) -> Result<[i64; 2], DatapathError> {
    let mut bytes = [0u8; 16];
    let (a, b) = bytes.split_at_mut(8);
    a.copy_from_slice(&mine[0].to_ne_bytes());
    b.copy_from_slice(&mine[1].to_ne_bytes());
    adapter.pmpi_allreduce(None, &mut bytes, (ElemType::I64, ReduceOp::Sum))?;
    let (a, b) = bytes.split_at(8);
    let word = |s: &[u8]| i64::from_ne_bytes(s.try_into().unwrap_or_default());
    Ok([word(a), word(b)])
}
