//! Run-time settings, read once from `ERAR_*` environment variables.
//!
//! Every variable is documented in the README; defaults here are the ones
//! chosen from measurements.

use once_cell::sync::OnceCell;

/// How float SUM is carried in the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// The default: i32 on a per-block grid with flags and a certificate;
    /// every element within the ordered sum's worst case (n−1)·u·Σ|x|,
    /// bitwise identical on every rank, deterministic
    /// ([`crate::numerics::bounded`]).
    Bounded,
    /// The correctly rounded exact sum, the same bits whatever the number of
    /// hosts, the rank order, the message size or fusion, and whichever path
    /// (the ring, or MPI below the threshold or after a stall) reduced it
    /// ([`crate::datapath::reproducible`]). `ERAR_PRECISION=reproducible`
    /// (`exact`, its former name, is accepted).
    Reproducible,
    /// int32 with a shared exponent per block: half the bytes, bounded error.
    Quantized,
}

/// How an exact allreduce is cut into segments (`ERAR_SEGMENT_BYTES`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segments {
    /// Learned per size class from the calls (ring/tune.rs).
    Tuned,
    /// A slot's worth each.
    Whole,
    /// Equal segments of at most this many bytes (never 0).
    Fixed(usize),
}

/// How a collective's eligible calls at or above its threshold are routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routing {
    /// Trials on each communicator choose, per class of call, the path that
    /// was faster there (see [`crate::select`]). The default.
    Measured,
    /// Every eligible call at or above the threshold takes the fast path:
    /// `ERAR_SELECT=threshold`, or a threshold set in the environment.
    Threshold,
}

impl Routing {
    pub const fn name(self) -> &'static str {
        match self {
            Routing::Measured => "measured",
            Routing::Threshold => "threshold",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    /// `ERAR_DISABLE=1`: every call goes to PMPI.
    pub disabled: bool,
    /// `ERAR_STATS=1`: one summary line per rank on stderr at finalize.
    pub stats: bool,
    /// `ERAR_TRACE=PREFIX`: each rank writes a timeline of its fast-path
    /// calls to `PREFIX.<rank>` at finalize (see [`crate::trace`]).
    pub trace: Option<String>,
    /// `ERAR_MIN_BYTES`: allreduces smaller than this go to PMPI untried.
    pub allreduce_min_bytes: usize,
    /// Float SUM allreduces smaller than this go to PMPI untried (their fast
    /// path moves an i64 per f32 and costs one MPI exchange more, so it
    /// breaks even later). `ERAR_MIN_BYTES` sets it too.
    pub float_sum_min_bytes: usize,
    /// `ERAR_BCAST_MIN_BYTES`: broadcasts smaller than this go to PMPI untried.
    pub bcast_min_bytes: usize,
    /// How eligible allreduces at or above `allreduce_min_bytes` are routed:
    /// `ERAR_SELECT=measure|threshold`; without it, `Threshold` where
    /// `ERAR_MIN_BYTES` is set (a user who names a threshold gets it),
    /// `Measured` otherwise.
    pub allreduce_routing: Routing,
    /// The same for broadcasts and `ERAR_BCAST_MIN_BYTES`.
    pub bcast_routing: Routing,
    /// `ERAR_TEST_SLOW_FAST=F[@RANK]`, for tests of the measured routing
    /// only: this rank (or every rank) reports its fast-path trials F times
    /// slower than they were. 1.0 otherwise.
    pub test_slow_fast: f64,
    pub test_slow_fast_rank: Option<i32>,
    /// `ERAR_PRECISION=bounded|reproducible|quantized`.
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
    /// `ERAR_POLL_US`: a rank that waits (for the other ranks of its host,
    /// for its ring's barrier, for its last chunks) looks again and again
    /// for this long, giving up the CPU between looks (`sched_yield`),
    /// before it sleeps. On a host with more ranks than CPUs a sleeping
    /// rank, once woken, queued behind the ranks that poll (Open MPI's,
    /// between calls) for up to 10 ms (`perf sched`, 8 ranks on 2 CPUs);
    /// one that yields takes its turn among them. 8 ranks on 4 hosts, OSU
    /// `osu_allreduce -i 100`, 8 alternating rounds against sleeping at
    /// once (`ERAR_POLL_US=0`), best and median: `-T mpi_int` 1.10x and
    /// 1.21x at 1 MiB, 1.18x and 1.14x at 2 MiB; `-T mpi_float` 1.14x and
    /// 1.10x, 1.06x and 1.03x; 4-64 MiB `-i 20`, 3 rounds, best: int
    /// 0.93-1.21x, float 0.98-1.05x; one rank per host, 1-16 MiB, 5 rounds:
    /// best 0.99-1.41x, median 0.93-1.27x. 0: sleep at once.
    pub poll_us: u64,
    /// `ERAR_TIMEOUT_MS`: once every rank is inside a fast-path call, the
    /// longest any of the call's own MPI exchanges may take; past it the call
    /// fails with an MPI error (a peer died or its link is down). 0: none.
    pub timeout_ms: u64,
    /// `ERAR_PROBE_MS`: how long a ring's setup waits for every other host
    /// to answer its probe (`Ring::reach_every_host`) before every rank
    /// declines the ring and MPI carries its calls. A healthy ring answers
    /// within a millisecond or two; this bounds what a network that drops
    /// the datapath's frames costs, once per communicator. 0: no check
    /// (such a network then fails the first fast call after
    /// `ERAR_TIMEOUT_MS`).
    pub probe_ms: u64,
    /// `ERAR_LANES`: threads a broadcast root copies and injects from (see
    /// `datapath::lanes`). 0: one per CPU this process may run on.
    pub lanes: usize,
    /// `ERAR_NODE_SLICES`: on a communicator with several ranks on a host,
    /// how many of a host's ranks lead a slice of each call across hosts
    /// (each slice its own ring; at most the fewest ranks any host has).
    pub node_slices: usize,
    /// `ERAR_NODE_FLOAT_MIN`: the least bytes of a float SUM the node path
    /// carries (smaller ones on such communicators go to MPI). Measured,
    /// 8 ranks on 4 hosts, MTU 9000, OSU `-T mpi_float` against Open MPI
    /// on the bridge: session 14, when every float call made 2-3 MPI
    /// exchanges, 0.80x (4 MiB) and 0.95x (8 MiB), hence a 16 MiB floor;
    /// session 17, with the slice rings agreeing on scales in the kernel
    /// (session 16), every size from 1 to 64 MiB won in two runs: 1.47-1.75x
    /// (1 MiB), 1.35-1.38x (2 MiB), 1.03-1.08x (4 MiB), 1.09-1.12x (8 MiB),
    /// 1.11-1.27x (16 MiB); two later runs with this 1 MiB floor were
    /// closer at 4-8 MiB (0.84-0.98x and 0.96-1.13x), where the routing
    /// trials still chose the fast path (they measure MPI on the same
    /// network, which the old floor left those calls to). Session 23, with
    /// the decode in f32 (`numerics/quantized.rs`), 512 KiB calls on this
    /// path against MPI on the same (XDP) network, 4 alternating rounds,
    /// best: 1312 against 2969 µs and 1160 against 2982 µs (2.26x, 2.57x),
    /// hence a 512 KiB floor; session 29, 64 KiB, with every float SUM
    /// (`float_sum_min_bytes` has the figures).
    pub node_float_min: usize,
    /// `ERAR_JUMBO` (0, or 1): on an interface whose MTU allows chunks
    /// larger than one BPF_PROG_RUN live frame (above 3394), use them:
    /// jumbo frames (8936-byte chunks at MTU 9000), which this host sends
    /// from an AF_PACKET socket (needs CAP_NET_RAW; not with the node
    /// agent's datapath). Off by default: measured on 4 hosts at MTU 9000
    /// (session 15, best of 4-6 alternating rounds, `allreduce_bench`),
    /// int32 allreduces 1.15-1.35x at 2-8 MiB in one run (6 rounds) but
    /// 0.82-0.94x in another (4 rounds), 1.0-1.23x at 16-64 MiB, float SUMs
    /// unchanged (0.92-1.12x), broadcasts 0.6-0.87x: their
    /// root injects every chunk, and a socket's frame costs two copies and
    /// an skb where BPF_PROG_RUN's live frame costs one copy.
    pub jumbo: bool,
    /// `ERAR_SEGMENT_BYTES` (`auto`, `0`, or a size): how an exact
    /// allreduce (integer or bitwise) on a ring of one rank per host is cut
    /// into segments, each a kernel barrier and a pass of the ring. A size:
    /// equal segments of at most that many bytes; `0`: a slot's worth
    /// (about 27 MiB). `auto`, the default: from 2 MiB, each size class's
    /// SUM, MAX and MIN calls try both a slot's worth and 1 MiB segments
    /// and keep the faster, the same on every rank (ring/tune.rs); bitwise
    /// ones run a slot's worth. Which wins depends on
    /// whether the rank's CPU and the CPU running the ring's softirqs share
    /// a last-level cache (`erarctl testbed cpus`). Session 31, 4 hosts on
    /// 2 vCPUs, `osu_allreduce -T mpi_int -i 50`, 16 MiB, jobs alternating:
    /// 1 MiB segments 13.9-15.5 ms a call against 17.0-19.2 ms for a
    /// slot's worth while the vCPUs shared one (a cache line's round trip
    /// 50-100 ns), 22.9-24.5 against 17.4-18.6 ms while they did not
    /// (310-360 ns). Float SUMs, which agree on scales per segment, lost
    /// in segments (0.70-0.91x median), so they are never segmented by
    /// this.
    pub segments: Segments,
    /// `ERAR_CIRCULATE` (1, or 0): an allreduce's frames circulate (see
    /// `InjectPacing::circulate`): each host injects its first window and
    /// the ring clocks the rest in the kernel.
    pub circulate: bool,
    /// `ERAR_ZERO_COPY` (1, or 0): a broadcast of `BCAST_IN_PLACE_MIN`
    /// (2 MiB) to 64 MiB reads and writes the callers' buffers in place
    /// (their pages become a BPF map's, see datapath/kernel/region.rs) once
    /// a rank broadcasts the same buffer twice in a row, and ends with a
    /// barrier in the kernel. OSU `osu_bcast`, 4 hosts, 4 rotating rounds
    /// against copies through the slots (docs/benchmarks.md, "Session
    /// 36"): 1.39-1.66x best, 1.34-1.57x median at 2-64 MiB. Must be the
    /// same on every rank.
    pub zero_copy: bool,
}

/// The allreduce floors of threshold routing when no floor is named: every
/// call from them on takes the ring untried, so they stay where the ring
/// won on every MTU before the trials could choose (see
/// `allreduce_min_bytes`): integers 256 KiB, float SUM 512 KiB.
const THRESHOLD_FLOOR: usize = 256 * 1024;
const THRESHOLD_FLOAT_FLOOR: usize = 512 * 1024;

impl Default for Config {
    fn default() -> Self {
        Config {
            disabled: false,
            stats: false,
            trace: None,
            // The floors are where trials start, and the first trial sets up
            // the ring, which attaches XDP to the host's interface. On the
            // test bed's veths that alone costs MPI's own TCP 4-25% at
            // 64 KiB-1 MiB (session 24; 10-40% in session 6), so a floor
            // must sit where the fast path wins on every MTU, or MPI, after
            // winning the trials, runs slower than without liberar. Session
            // 6 (OSU, 4 hosts, MTU 1500/3400/9000, against MPI on the same
            // network) put the integer floor at 256 KiB (a 64 KiB floor lost
            // 0.78-0.92x at 64 KiB on every MTU then) and float SUM's and
            // broadcast's at 512 KiB (at 256 KiB they lost at MTU 9000,
            // 0.61x and 0.80x, MPI winning their trials; from 512 KiB they
            // won, 1.03x and 1.78x and up). Session 24, integer allreduces, OSU, 3
            // alternating rounds, best, a 64 KiB floor against the 256 KiB
            // one (where 64 and 128 KiB calls went to MPI before any XDP was
            // attached), 4 hosts: MTU 1500 2.81x and 3.76x at 64 and 128 KiB
            // with one rank per host, 2.89x and 3.36x with two; MTU 3400
            // 1.39x and 2.15x, 1.75x and 2.53x; MTU 9000 1.04x and 1.70x,
            // 1.43x and 2.54x; every class's trials chose the ring. (At 32
            // KiB one rank per host lost, 0.77x, its trials a tie.) A user
            // who routes by threshold without naming one (`ERAR_SELECT=
            // threshold`) keeps 256 KiB: [`THRESHOLD_FLOOR`].
            //
            // Float SUM from 64 KiB too since session 29 (512 KiB before),
            // once a waiting rank no longer took an event's wake-up per
            // call: OSU `osu_allreduce -T mpi_float -i 200`, every call on
            // the ring from 64 KiB (`ERAR_MIN_BYTES=65536`), against MPI on
            // the bridge (no XDP attached), 3 alternating rounds, best, at
            // 64, 128 and 256 KiB: one rank per host MTU 1500 1.00x, 1.28x,
            // 1.41x; MTU 3400 1.05x, 1.21x, 1.31x; MTU 9000 1.23x, 1.23x,
            // 1.35x; two ranks per host (the node path, `node_float_min`)
            // MTU 1500 2.38x, 2.78x, 2.69x; MTU 9000 2.11x, 2.61x, 2.85x.
            // With the 512 KiB floor, a job that also made larger calls
            // (so XDP was attached) ran these sizes on MPI at 0.29-0.63x of
            // MPI on the bridge. Broadcasts stay at 512 KiB: at 64-256 KiB
            // the ring beat MPI on the same network (1.2-1.8x) but not on
            // the bridge (0.64-0.80x, one rank per host, MTU 9000).
            allreduce_min_bytes: 64 * 1024,
            float_sum_min_bytes: 64 * 1024,
            bcast_min_bytes: 512 * 1024,
            allreduce_routing: Routing::Measured,
            bcast_routing: Routing::Measured,
            test_slow_fast: 1.0,
            test_slow_fast_rank: None,
            precision: Precision::Bounded,
            iface: None,
            stall_ms: 2000,
            retry_ms: 10,
            nack_us: 200,
            poll_us: 2000,
            timeout_ms: 8000,
            // Long enough for a rank descheduled on an oversubscribed host
            // (8 ranks on the test machine's 2 CPUs). 1 s was not: once in
            // CI (2 CPUs, 4 ranks, session 30) a healthy ring's probes went
            // unanswered for 1 s and the ring was declined. A network that
            // drops the frames pays this once per communicator.
            probe_ms: 3000,
            lanes: 0,
            // Two: one per CPU of the test machine; more rings only share
            // the same CPUs' softirq time.
            node_slices: 2,
            node_float_min: 64 * 1024,
            jumbo: false,
            segments: Segments::Tuned,
            circulate: true,
            zero_copy: true,
        }
    }
}

impl Config {
    /// Reads the environment. Unparseable values keep their default (and are
    /// logged at warn level once), so a typo never breaks a job.
    pub fn from_env() -> Config {
        Config::from_vars(&|name| std::env::var(name).ok())
    }

    /// [`Config::from_env`] with the variables from `lookup`.
    fn from_vars(lookup: &dyn Fn(&str) -> Option<String>) -> Config {
        let mut cfg = Config::default();
        let var = |name: &str| lookup(name).filter(|v| !v.is_empty());
        cfg.disabled = var("ERAR_DISABLE").is_some_and(|v| truthy(&v));
        cfg.stats = var("ERAR_STATS").is_some_and(|v| truthy(&v));
        cfg.trace = var("ERAR_TRACE");
        let min_named = parse_into(&mut cfg.allreduce_min_bytes, "ERAR_MIN_BYTES", lookup);
        if min_named {
            cfg.float_sum_min_bytes = cfg.allreduce_min_bytes;
            cfg.allreduce_routing = Routing::Threshold;
        }
        if parse_into(&mut cfg.bcast_min_bytes, "ERAR_BCAST_MIN_BYTES", lookup) {
            cfg.bcast_routing = Routing::Threshold;
        }
        match var("ERAR_SELECT").as_deref() {
            None => {}
            Some("measure") => {
                cfg.allreduce_routing = Routing::Measured;
                cfg.bcast_routing = Routing::Measured;
            }
            Some("threshold") => {
                cfg.allreduce_routing = Routing::Threshold;
                cfg.bcast_routing = Routing::Threshold;
                if !min_named {
                    cfg.allreduce_min_bytes = THRESHOLD_FLOOR;
                    cfg.float_sum_min_bytes = THRESHOLD_FLOAT_FLOOR;
                }
            }
            Some(other) => log::warn!("ERAR_SELECT={other:?} is not measure|threshold; ignored"),
        }
        if let Some(v) = var("ERAR_TEST_SLOW_FAST") {
            let (factor, rank) = match v.split_once('@') {
                Some((f, r)) => (f, r.trim().parse().ok()),
                None => (v.as_str(), None),
            };
            match factor.trim().parse::<f64>() {
                Ok(f) if f > 0.0 => {
                    cfg.test_slow_fast = f;
                    cfg.test_slow_fast_rank = rank;
                }
                _ => log::warn!("ERAR_TEST_SLOW_FAST={v:?} is not FACTOR[@RANK]; ignored"),
            }
        }
        parse_into(&mut cfg.stall_ms, "ERAR_STALL_MS", lookup);
        parse_into(&mut cfg.retry_ms, "ERAR_RETRY_MS", lookup);
        cfg.retry_ms = cfg.retry_ms.max(1);
        parse_into(&mut cfg.nack_us, "ERAR_NACK_US", lookup);
        parse_into(&mut cfg.poll_us, "ERAR_POLL_US", lookup);
        parse_into(&mut cfg.timeout_ms, "ERAR_TIMEOUT_MS", lookup);
        parse_into(&mut cfg.probe_ms, "ERAR_PROBE_MS", lookup);
        parse_into(&mut cfg.lanes, "ERAR_LANES", lookup);
        parse_into(&mut cfg.node_slices, "ERAR_NODE_SLICES", lookup);
        parse_into(&mut cfg.node_float_min, "ERAR_NODE_FLOAT_MIN", lookup);
        let mut jumbo = u32::from(cfg.jumbo);
        parse_into(&mut jumbo, "ERAR_JUMBO", lookup);
        cfg.jumbo = jumbo != 0;
        if let Some(v) = var("ERAR_SEGMENT_BYTES") {
            match v.trim() {
                "auto" => cfg.segments = Segments::Tuned,
                n => match n.parse() {
                    Ok(0) => cfg.segments = Segments::Whole,
                    Ok(bytes) => cfg.segments = Segments::Fixed(bytes),
                    Err(_) => log::warn!("ERAR_SEGMENT_BYTES={v:?} is not auto or a size; ignored"),
                },
            }
        }
        let mut circulate = u32::from(cfg.circulate);
        parse_into(&mut circulate, "ERAR_CIRCULATE", lookup);
        cfg.circulate = circulate != 0;
        let mut zero_copy = u32::from(cfg.zero_copy);
        parse_into(&mut zero_copy, "ERAR_ZERO_COPY", lookup);
        cfg.zero_copy = zero_copy != 0;
        cfg.node_slices = cfg.node_slices.max(1);
        cfg.iface = var("ERAR_IFACE");
        if let Some(p) = var("ERAR_PRECISION") {
            match p.as_str() {
                "bounded" => cfg.precision = Precision::Bounded,
                "reproducible" | "exact" => cfg.precision = Precision::Reproducible,
                "quantized" => cfg.precision = Precision::Quantized,
                other => log::warn!(
                    "ERAR_PRECISION={other:?} is not bounded|reproducible|quantized; using bounded"
                ),
            }
        }
        cfg
    }

    /// How each collective is routed and where that came from, for the log.
    pub fn routing_summary(&self) -> String {
        fn from(var: &'static str) -> &'static str {
            if std::env::var_os(var).is_some() {
                var
            } else {
                "default"
            }
        }
        let how = |var: &'static str| {
            if std::env::var_os("ERAR_SELECT").is_some() {
                "ERAR_SELECT"
            } else {
                from(var)
            }
        };
        format!(
            "allreduce {} (from {}) at >= {} B, float SUM at >= {} B (from {}); \
             bcast {} (from {}) at >= {} B (from {})",
            self.allreduce_routing.name(),
            how("ERAR_MIN_BYTES"),
            self.allreduce_min_bytes,
            self.float_sum_min_bytes,
            from("ERAR_MIN_BYTES"),
            self.bcast_routing.name(),
            how("ERAR_BCAST_MIN_BYTES"),
            self.bcast_min_bytes,
            from("ERAR_BCAST_MIN_BYTES"),
        )
    }

    /// The process-wide configuration, read on first use.
    pub fn get() -> &'static Config {
        static CONFIG: OnceCell<Config> = OnceCell::new();
        CONFIG.get_or_init(Config::from_env)
    }

    /// How long a waiting rank polls before it sleeps (`ERAR_POLL_US`).
    pub fn poll(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.poll_us)
    }
}

fn truthy(v: &str) -> bool {
    !matches!(v, "0" | "false" | "no" | "off")
}

/// Parses `name` into `slot`; true if it was set and valid.
fn parse_into<T: std::str::FromStr>(
    slot: &mut T,
    name: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> bool {
    let Some(v) = lookup(name) else {
        return false;
    };
    match v.trim().parse() {
        Ok(x) => {
            *slot = x;
            true
        }
        Err(_) => {
            log::warn!("{name}={v:?} is not a number; keeping the default");
            false
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

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Config {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_vars(&|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn segments_are_auto_a_slot_or_a_size() {
        let seg = |v: &str| with(&[("ERAR_SEGMENT_BYTES", v)]).segments;
        assert_eq!(with(&[]).segments, Segments::Tuned);
        assert_eq!(seg("auto"), Segments::Tuned);
        assert_eq!(seg("0"), Segments::Whole);
        assert_eq!(seg("00"), Segments::Whole);
        assert_eq!(seg("1048576"), Segments::Fixed(1 << 20));
        assert_eq!(
            seg("1 MiB"),
            Segments::Tuned,
            "not a size: the default stays"
        );
    }

    #[test]
    fn floors_by_routing() {
        let measured = with(&[]);
        assert_eq!(measured.allreduce_routing, Routing::Measured);
        assert_eq!(
            (measured.allreduce_min_bytes, measured.float_sum_min_bytes),
            (64 * 1024, 64 * 1024)
        );
        let threshold = with(&[("ERAR_SELECT", "threshold")]);
        assert_eq!(threshold.allreduce_routing, Routing::Threshold);
        assert_eq!(
            (threshold.allreduce_min_bytes, threshold.float_sum_min_bytes),
            (THRESHOLD_FLOOR, THRESHOLD_FLOAT_FLOOR)
        );
        let named = with(&[("ERAR_SELECT", "threshold"), ("ERAR_MIN_BYTES", "131072")]);
        assert_eq!(
            (named.allreduce_min_bytes, named.float_sum_min_bytes),
            (131072, 131072)
        );
        assert_eq!(
            with(&[("ERAR_MIN_BYTES", "x")]).allreduce_min_bytes,
            64 * 1024
        );
    }
}
