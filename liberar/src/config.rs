//! Run-time settings, read once from `ERAR_*` environment variables.
//!
//! Every variable is documented in the README; defaults here are the ones
//! chosen from measurements.

use once_cell::sync::OnceCell;

/// How float SUM is carried in the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Exact fixed point: the result is the correctly rounded exact sum,
    /// never less accurate than MPI's own float summation.
    Exact,
    /// int32 with a shared exponent per block: half the bytes, bounded error.
    Quantized,
}

#[derive(Clone, Debug)]
pub struct Config {
    /// `ERAR_DISABLE=1`: every call goes to PMPI.
    pub disabled: bool,
    /// `ERAR_STATS=1`: one summary line per rank on stderr at finalize.
    pub stats: bool,
    /// `ERAR_MIN_BYTES`: allreduces smaller than this go to PMPI.
    pub allreduce_min_bytes: usize,
    /// `ERAR_BCAST_MIN_BYTES`: broadcasts smaller than this go to PMPI.
    pub bcast_min_bytes: usize,
    /// `ERAR_PRECISION=exact|quantized`.
    pub precision: Precision,
    /// `ERAR_IFACE`: the interface carrying MPI traffic (default: found from
    /// the route to the ring peers).
    pub iface: Option<String>,
    /// `ERAR_STALL_MS`: a segment not complete on the ring after this long,
    /// loss recovery included, is completed through MPI instead.
    pub stall_ms: u64,
    /// `ERAR_RETRY_MS`: a host whose progress stops for this long reports
    /// what it misses, and the ring re-sends it (one recovery round).
    pub retry_ms: u64,
    /// `ERAR_NACK_US`: a host whose progress stops for this long asks its
    /// predecessor, in the kernel, for every frame it still waits for; again
    /// after each such pause. 0: no NACKs (recovery rounds only).
    pub nack_us: u64,
    /// `ERAR_TIMEOUT_MS`: once every rank is inside a fast-path call, the
    /// longest any of the call's own MPI exchanges may take; past it the call
    /// fails with an MPI error (a peer died or its link is down). 0: none.
    pub timeout_ms: u64,
    /// `ERAR_LANES`: threads a broadcast root copies and injects from (see
    /// `datapath::lanes`). 0: one per CPU this process may run on.
    pub lanes: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            disabled: false,
            stats: false,
            allreduce_min_bytes: 256 * 1024,
            bcast_min_bytes: 512 * 1024,
            precision: Precision::Exact,
            iface: None,
            stall_ms: 2000,
            retry_ms: 10,
            nack_us: 200,
            timeout_ms: 8000,
            lanes: 0,
        }
    }
}

impl Config {
    /// Reads the environment. Unparseable values keep their default (and are
    /// logged at warn level once), so a typo never breaks a job.
    pub fn from_env() -> Config {
        let mut cfg = Config::default();
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        cfg.disabled = var("ERAR_DISABLE").is_some_and(|v| truthy(&v));
        cfg.stats = var("ERAR_STATS").is_some_and(|v| truthy(&v));
        parse_into(&mut cfg.allreduce_min_bytes, "ERAR_MIN_BYTES");
        parse_into(&mut cfg.bcast_min_bytes, "ERAR_BCAST_MIN_BYTES");
        parse_into(&mut cfg.stall_ms, "ERAR_STALL_MS");
        parse_into(&mut cfg.retry_ms, "ERAR_RETRY_MS");
        cfg.retry_ms = cfg.retry_ms.max(1);
        parse_into(&mut cfg.nack_us, "ERAR_NACK_US");
        parse_into(&mut cfg.timeout_ms, "ERAR_TIMEOUT_MS");
        parse_into(&mut cfg.lanes, "ERAR_LANES");
        cfg.iface = var("ERAR_IFACE");
        if let Some(p) = var("ERAR_PRECISION") {
            match p.as_str() {
                "exact" => cfg.precision = Precision::Exact,
                "quantized" => cfg.precision = Precision::Quantized,
                other => log::warn!("ERAR_PRECISION={other:?} is not exact|quantized; using exact"),
            }
        }
        cfg
    }

    /// The process-wide configuration, read on first use.
    pub fn get() -> &'static Config {
        static CONFIG: OnceCell<Config> = OnceCell::new();
        CONFIG.get_or_init(Config::from_env)
    }
}

fn truthy(v: &str) -> bool {
    !matches!(v, "0" | "false" | "no" | "off")
}

fn parse_into<T: std::str::FromStr>(slot: &mut T, name: &str) {
    if let Ok(v) = std::env::var(name) {
        match v.trim().parse() {
            Ok(x) => *slot = x,
            Err(_) => log::warn!("{name}={v:?} is not a number; keeping the default"),
        }
    }
}

/// Starts logging to stderr, filtered by `ERAR_LOG` (env_logger syntax, e.g.
/// `ERAR_LOG=debug`). Silent when unset. Safe to call more than once.
pub fn init_logging() {
    let env = env_logger::Env::new()
        .filter("ERAR_LOG")
        .write_style("ERAR_LOG_STYLE");
    let _ = env_logger::Builder::from_env(env)
        .format_timestamp_micros()
        .try_init();
}
