//! One communicator's ring on the eBPF datapath: how it is set up over the
//! communicator, and the per-call flow of an allreduce on it.
//!
//! Every decision that could differ between ranks (an interface missing, a
//! frame lost, a NaN in one rank's data) is agreed through the communicator
//! before anyone acts on it, so all ranks always take the same path.

use super::agent::{self, AgentPaths};
use super::codec::{self, FloatSum, Plan};
use super::iface::{self, Candidate};
use super::kernel::{HostDatapath, InjectPacing, Patience, SlotRoute};
use super::lanes::Lanes;
use super::liveness::{Prober, RingAddr};
use super::{reproducible, wire, Comm, DatapathError};
use crate::config::{Config, Precision};
use crate::select::{ElemType, ReduceOp};
use crate::stats::{self, Phase};
use parking_lot::Mutex;
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Chunks per slot: with 3336-byte chunks, 26 MiB of wire data per slot
/// and operation, 104 MiB of kernel memory per host for all four slots.
/// Larger messages run as consecutive segments; each segment boundary costs
/// a barrier and an agreement round plus the ring's fill and drain, so
/// fewer, larger segments are faster (9 MiB segments measured slower).
const CHUNKS_PER_SLOT: u32 = 8192;
/// How many interfaces one rank advertises.
const MAX_CANDIDATES: usize = 4;

/// This process's attachment to its interface, shared by all its rings.
static HOST: Mutex<Option<Arc<HostDatapath>>> = Mutex::new(None);
/// Bitmap of this host's slots in use by some ring of this process.
static SLOTS_IN_USE: Mutex<u32> = Mutex::new(0);
/// What this process holds for each slot in SLOTS_IN_USE, on a datapath it
/// shares with other processes: the lock file (flock held: other processes
/// see the slot as taken until the ring ends or this process dies) and, on
/// the node agent's, the lease of the slot's maps.
static SLOT_CLAIMS: Mutex<[Option<SlotClaim>; wire::ERAR_MAX_SLOTS as usize]> =
    Mutex::new([const { None }; wire::ERAR_MAX_SLOTS as usize]);

struct SlotClaim {
    _lock: std::fs::File,
    _lease: Option<std::os::unix::net::UnixStream>,
}

/// One communicator's ring on the eBPF datapath. Created collectively on the
/// communicator's first accelerated call; the shim keeps it in a communicator
/// attribute and drops it when the communicator is freed.
pub struct Ring {
    host: Arc<HostDatapath>,
    slot: u32,
    ranks: usize,
    seq: u32,
    chunk_bytes: usize,
    /// Float SUM's agreed scales and repairs (kept to reuse allocations).
    float_sum: FloatSum,
    /// Loss recovery: this host's chunk stages, everyone's, and the chunks
    /// to re-send (kept to reuse their allocations).
    stages: Vec<u8>,
    all_stages: Vec<u8>,
    resend: Vec<u32>,
    /// Tells a dead peer from a late one in the exchange that opens each
    /// call (None: no socket could be made; that exchange then waits as
    /// long as MPI does).
    prober: Option<Box<Prober>>,
}

/// Who does what in one armed operation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Injects its starting chunks and receives every chunk (allreduce).
    Member,
    /// Injects every chunk, receives none (broadcast root).
    Source,
    /// Receives every chunk (broadcast non-root).
    Sink,
}

/// How an armed operation ended, the same on every rank.
enum Outcome {
    /// Every host holds every chunk's final value.
    Complete,
    /// The kernel result is not used: MPI completes the call (why).
    Fallback(&'static str),
}

/// What one rank tells the others when a ring is set up.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Advert {
    candidates: [AdvertIface; MAX_CANDIDATES],
    count: u32,
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct AdvertIface {
    ipv4: [u8; 4],
    netmask: [u8; 4],
    mac: [u8; 6],
    _pad: [u8; 2],
    mtu: u32,
}

/// Second round: did this rank attach, which slots are free, its token.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Ready {
    ok: u32,
    free_slots: u32,
    token: u32,
    comm_id: u32,
}

/// Records exchanged between ranks as raw bytes: repr(C), made of integers
/// and byte arrays with no implicit padding, valid for any bit pattern.
trait Record: Copy + Default {}
impl Record for Advert {}
impl Record for Ready {}

fn as_bytes<T: Record>(v: &T) -> &[u8] {
    // SAFETY: a Record has no padding, so every byte is initialized.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

fn gather<T: Record>(comm: &dyn Comm, mine: &T) -> Result<Vec<T>, DatapathError> {
    let size = std::mem::size_of::<T>();
    let mut all = vec![0u8; size * comm.size()];
    comm.allgather(as_bytes(mine), &mut all)?;
    Ok(all
        .chunks_exact(size)
        // SAFETY: a Record is valid for any bytes of its size.
        .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr().cast::<T>()) })
        .collect())
}

/// The largest chunk a frame carries on an interface of this MTU.
pub fn chunk_bytes_for_mtu(mtu: u32) -> u32 {
    let room = mtu.saturating_sub(wire::ERAR_PAYLOAD_OFF - 14);
    (room.min(wire::ERAR_MAX_CHUNK_BYTES) / wire::ERAR_CHUNK_ALIGN) * wire::ERAR_CHUNK_ALIGN
}

/// For every rank, the index of the candidate it uses: the first of its
/// interfaces whose subnet holds an interface of every other rank. All ranks
/// compute this from the same table, so they agree.
fn choose_interfaces(adverts: &[Advert]) -> Option<Vec<usize>> {
    let cands = |a: &Advert| a.candidates[..(a.count as usize).min(MAX_CANDIDATES)].to_vec();
    let mut chosen = Vec::with_capacity(adverts.len());
    for (r, a) in adverts.iter().enumerate() {
        let pick = cands(a).iter().position(|c| {
            let mine = Candidate {
                name: String::new(),
                ipv4: Ipv4Addr::from(c.ipv4),
                netmask: Ipv4Addr::from(c.netmask),
                mac: c.mac,
                mtu: c.mtu,
            };
            adverts.iter().enumerate().all(|(q, other)| {
                q == r
                    || cands(other)
                        .iter()
                        .any(|o| mine.same_subnet(Ipv4Addr::from(o.ipv4)))
            })
        })?;
        chosen.push(pick);
    }
    Some(chosen)
}

fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 4 {
        // Never observed; a fixed fallback only weakens stale-frame isolation.
        return std::process::id() ^ 0x9e37_79b9;
    }
    u32::from_ne_bytes(b)
}

/// The chunk size a ring uses when every rank's interface has this MTU:
/// `erarctl agent start` sizes a host's shared datapath with it.
pub fn agent_chunk_bytes(mtu: u32) -> u32 {
    chunk_bytes_for_mtu(mtu)
}

/// Chunks per slot of this build's rings (a node agent's datapath needs at
/// least as many).
pub const RING_CHUNKS_PER_SLOT: u32 = CHUNKS_PER_SLOT;

/// This process's datapath on `ifname`, set up once and shared by all its
/// rings: the node agent's pinned datapath if there is one this process may
/// use, else its own (loaded and attached here: needs CAP_BPF and
/// CAP_NET_ADMIN). When neither works, one line on stderr says why (once
/// per process) and the caller declines; every rank sees the decline.
fn host_for(ifname: &str, chunk_bytes: u32) -> Result<Arc<HostDatapath>, String> {
    let mut host = HOST.lock();
    if let Some(h) = host.as_ref() {
        if h.ifname() == ifname && h.chunk_bytes() == chunk_bytes {
            return Ok(h.clone());
        }
        return Err(format!(
            "this process's datapath is on {} with {}-byte chunks, not {ifname} with {chunk_bytes}",
            h.ifname(),
            h.chunk_bytes()
        ));
    }
    let h = match open_or_attach(ifname, chunk_bytes) {
        Ok(h) => Arc::new(h),
        Err(why) => {
            warn_no_datapath(ifname, &why);
            return Err(why);
        }
    };
    h.set_inject_pacing(InjectPacing {
        quiet: retry_quiet(),
        ..h.inject_pacing()
    });
    *host = Some(h.clone());
    Ok(h)
}

/// The agent's datapath, else our own; Err: why neither, for the warning.
fn open_or_attach(ifname: &str, chunk_bytes: u32) -> Result<HostDatapath, String> {
    let agent_why = match HostDatapath::open_pinned(ifname) {
        Ok(h) if h.chunk_bytes() == chunk_bytes && h.chunks_per_slot() >= CHUNKS_PER_SLOT => {
            return Ok(h)
        }
        Ok(h) => format!(
            "the liberar agent's datapath ({}) has {}-byte chunks and {} per slot, this ring \
             needs {chunk_bytes} and {CHUNKS_PER_SLOT} (start every host's agent with \
             --chunk-bytes {chunk_bytes})",
            h.agent_paths()
                .map(|p| p.pin_dir.display().to_string())
                .unwrap_or_default(),
            h.chunk_bytes(),
            h.chunks_per_slot()
        ),
        Err(e) => e.to_string(),
    };
    if !agent::can_attach() {
        return Err(format!("{agent_why} and not privileged"));
    }
    let attach_why = match HostDatapath::attach(ifname, chunk_bytes, CHUNKS_PER_SLOT) {
        Ok(h) => return Ok(h),
        Err(e) => format!("{e:#}"),
    };
    // Taken by another job's erar_xdp (no agent): share it.
    match HostDatapath::adopt(ifname) {
        Ok(h) if h.chunk_bytes() == chunk_bytes && h.chunks_per_slot() >= CHUNKS_PER_SLOT => Ok(h),
        Ok(h) => Err(format!(
            "{agent_why}; attaching one failed ({attach_why}); the erar_xdp another process \
             attached has {}-byte chunks and {} per slot, this ring needs {chunk_bytes} and \
             {CHUNKS_PER_SLOT}",
            h.chunk_bytes(),
            h.chunks_per_slot()
        )),
        Err(e) => Err(format!(
            "{agent_why}; attaching one failed ({attach_why}); sharing the one on {ifname} \
             failed: {e:#}"
        )),
    }
}

/// The one line a process prints when it has no datapath.
fn warn_no_datapath(ifname: &str, why: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    let place = AgentPaths::current(ifname)
        .map(|p| p.where_())
        .unwrap_or_else(|_| ifname.to_owned());
    let why = why.replace('\n', " ");
    let line = format!("liberar: no datapath on {place}: {why}; MPI_Allreduce/MPI_Bcast use MPI\n");
    // One write(2): ranks sharing the launcher's stderr do not interleave.
    use std::io::Write as _;
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Slots this process could give a new ring: not used by another of its
/// rings and not locked by another process sharing the datapath (the
/// agent's, or ours adopted by another job; a probe: the lock is taken for
/// real by [`claim_slot`]).
fn free_slots(host: &HostDatapath) -> u32 {
    let in_use = *SLOTS_IN_USE.lock();
    let mut free = 0;
    for slot in 0..wire::ERAR_MAX_SLOTS {
        let unlocked = host
            .slot_lock_path(slot)
            .is_none_or(|p| matches!(agent::try_lock_file(&p), Ok(Some(_))));
        if in_use & (1 << slot) == 0 && unlocked {
            free |= 1 << slot;
        }
    }
    free
}

/// Takes `slot` for a ring of this process, with its lock file; false if
/// it is taken.
fn claim_slot(host: &HostDatapath, slot: u32) -> bool {
    let mut in_use = SLOTS_IN_USE.lock();
    if *in_use & (1 << slot) != 0 {
        return false;
    }
    if let Some(path) = host.slot_lock_path(slot) {
        let lock = match agent::try_lock_file(&path) {
            Ok(Some(f)) => f,
            Ok(None) => return false,
            Err(e) => {
                log::debug!("liberar: slot {slot} lock {}: {e}", path.display());
                return false;
            }
        };
        let lease = match host.lease(slot) {
            Ok(lease) => lease,
            Err(e) => {
                log::debug!("liberar: slot {slot}: {e:#}");
                return false;
            }
        };
        SLOT_CLAIMS.lock()[slot as usize] = Some(SlotClaim {
            _lock: lock,
            _lease: lease,
        });
    }
    *in_use |= 1 << slot;
    true
}

/// Gives `slot` back: its leased maps, then the lease and the lock.
fn release_slot(host: &HostDatapath, slot: u32) {
    let mut in_use = SLOTS_IN_USE.lock();
    host.release(slot);
    SLOT_CLAIMS.lock()[slot as usize] = None;
    *in_use &= !(1 << slot);
}

/// Every rank takes the lowest slot free on every host; if another process
/// took it on some host in the meantime, all give it back and try the next.
/// Every rank sees the same `common` and verdicts, so all end on the same
/// slot, or all decline.
fn claim_common_slot(
    comm: &dyn Comm,
    host: &HostDatapath,
    mut common: u32,
) -> Result<u32, DatapathError> {
    while common != 0 {
        let slot = common.trailing_zeros();
        let mine = claim_slot(host, slot);
        let mut verdict = [i32::from(!mine)];
        let agreed = comm.allreduce_max_i32(&mut verdict);
        if agreed.is_ok() && verdict[0] == 0 {
            return Ok(slot);
        }
        if mine {
            release_slot(host, slot);
        }
        agreed?;
        common &= !(1 << slot);
    }
    Err(DatapathError::Declined(
        "no datapath slot free on every host".into(),
    ))
}

impl Ring {
    /// Collective over `comm`: learns every member's interface, MAC and IPv4
    /// address, and checks that every host has the datapath. Every rank gets
    /// the same verdict: all `Ok`, or all `Err(Declined)`.
    pub fn establish(comm: &dyn Comm) -> Result<Ring, DatapathError> {
        let cfg = Config::get();
        let (rank, n) = (comm.rank(), comm.size());
        if n > wire::ERAR_MAX_RING as usize {
            return Err(DatapathError::Declined(format!(
                "{n} ranks exceed the ring limit"
            )));
        }

        // Round 1: interfaces.
        let mut advert = Advert::default();
        match iface::candidates(cfg.iface.as_deref()) {
            Ok(list) => {
                for (slot, c) in advert.candidates.iter_mut().zip(&list) {
                    *slot = AdvertIface {
                        ipv4: c.ipv4.octets(),
                        netmask: c.netmask.octets(),
                        mac: c.mac,
                        _pad: [0; 2],
                        mtu: c.mtu,
                    };
                }
                advert.count = list.len().min(MAX_CANDIDATES) as u32;
            }
            Err(e) => log::debug!("liberar: listing interfaces failed: {e}"),
        }
        let adverts = gather(comm, &advert)?;
        let chosen = choose_interfaces(&adverts).ok_or_else(|| {
            DatapathError::Declined("the ranks share no IPv4 subnet (set ERAR_IFACE)".into())
        })?;
        let pick = |r: usize| adverts[r].candidates[chosen[r]];
        let mut macs: Vec<[u8; 6]> = (0..n).map(|r| pick(r).mac).collect();
        macs.sort_unstable();
        if macs.windows(2).any(|w| w[0] == w[1]) {
            return Err(DatapathError::Declined(
                "two ranks share a host (one rank per host for now)".into(),
            ));
        }
        let chunk_bytes = (0..n)
            .map(|r| chunk_bytes_for_mtu(pick(r).mtu))
            .min()
            .unwrap_or(0);
        if chunk_bytes < wire::ERAR_MIN_CHUNK_BYTES {
            return Err(DatapathError::Declined(
                "the interface MTU is too small".into(),
            ));
        }

        // Round 2: attach locally, then agree on a slot free on every host.
        let me = pick(rank);
        let my_ifname = iface::candidates(cfg.iface.as_deref())
            .ok()
            .and_then(|l| l.into_iter().find(|c| c.mac == me.mac).map(|c| c.name));
        let host = my_ifname
            .ok_or_else(|| "the chosen interface vanished".to_string())
            .and_then(|name| host_for(&name, chunk_bytes));
        let mut ready = Ready {
            token: random_u32(),
            comm_id: random_u32(),
            ..Ready::default()
        };
        match &host {
            Ok(h) => {
                ready.ok = 1;
                ready.free_slots = free_slots(h);
            }
            Err(e) => log::debug!("liberar: datapath unavailable on this host: {e}"),
        }
        let readies = gather(comm, &ready)?;
        if let Some(bad) = readies.iter().position(|r| r.ok == 0) {
            return Err(DatapathError::Declined(format!(
                "no datapath on the host of rank {bad}"
            )));
        }
        let common = readies.iter().fold(u32::MAX, |acc, r| acc & r.free_slots);
        let host = host.map_err(DatapathError::Declined)?;
        let slot = claim_common_slot(comm, &host, common)?;

        let next = pick((rank + 1) % n);
        let prev = pick((rank + n - 1) % n);
        let route = SlotRoute {
            self_mac: me.mac,
            self_ip: Ipv4Addr::from(me.ipv4),
            next_mac: next.mac,
            next_ip: Ipv4Addr::from(next.ipv4),
            prev_mac: prev.mac,
            prev_ip: Ipv4Addr::from(prev.ipv4),
            ring_pos: rank as u32,
            ring_size: n as u32,
            comm_id: readies[0].comm_id,
            token: readies[0].token,
        };
        let mut ring = Ring {
            host,
            slot,
            ranks: n,
            seq: 0,
            chunk_bytes: chunk_bytes as usize,
            float_sum: FloatSum::default(),
            stages: Vec::new(),
            all_stages: Vec::new(),
            resend: Vec::new(),
            prober: None,
        };
        ring.host
            .configure_slot(slot, &route)
            .map_err(|e| DatapathError::Failed(format!("configuring slot {slot}: {e:#}")))?;
        let hosts: Vec<Ipv4Addr> = (0..n).map(|r| Ipv4Addr::from(pick(r).ipv4)).collect();
        ring.prober = Prober::new(&RingAddr {
            hosts: &hosts,
            rank,
            slot,
            comm_id: route.comm_id,
            token: route.token,
            chunk_bytes,
        })
        .map(Box::new)
        .map_err(|e| log::debug!("liberar: no liveness prober ({e}); a lost peer hangs"))
        .ok();
        log::debug!(
            "liberar: ring of {n} ready on slot {slot}, {chunk_bytes}-byte chunks, next hop {}",
            route.next_ip
        );
        Ok(ring)
    }

    /// `recv = op over ranks of (send, or recv when in place)`, bitwise
    /// identical on every rank. `send.len() == recv.len()` when present.
    pub fn allreduce(
        &mut self,
        comm: &dyn Comm,
        send: Option<&[u8]>,
        recv: &mut [u8],
        elem: ElemType,
        op: ReduceOp,
    ) -> Result<(), DatapathError> {
        let precision = match Config::get().precision {
            // Only a correctly rounded sum meets the bound on 2 ranks.
            Precision::Bounded if self.ranks < 3 => Precision::Reproducible,
            p => p,
        };
        let plan = Plan::of(elem, op, precision)
            .ok_or_else(|| DatapathError::Declined(format!("{elem:?} {op:?} is not in-kernel")))?;
        let key = CallKey::allreduce(recv.len(), elem, op, precision);
        let count = recv.len() / elem.size();
        let capacity = self.segment_elems(plan);
        let mut start = 0;
        while start < count {
            let len = capacity.min(count - start);
            let bytes = start * elem.size()..(start + len) * elem.size();
            let send_seg = send.map(|s| &s[bytes.clone()]);
            let seg = Seg {
                index: start / capacity,
                key,
            };
            self.segment(comm, plan, seg, send_seg, &mut recv[bytes], elem, op)?;
            start += len;
        }
        Ok(())
    }

    /// Broadcast of `buf` (bytes) from `root`: the root's data enters the
    /// network once and travels the ring as all-gather frames, each host
    /// keeping a copy and forwarding it (a pipelined chain).
    pub fn bcast(
        &mut self,
        comm: &dyn Comm,
        buf: &mut [u8],
        root: usize,
    ) -> Result<(), DatapathError> {
        let key = CallKey::bcast(buf.len(), root);
        let segment = self.chunk_bytes * CHUNKS_PER_SLOT as usize;
        for seg in buf.chunks_mut(segment) {
            self.bcast_segment(comm, key, seg, root)?;
        }
        Ok(())
    }

    fn bcast_segment(
        &mut self,
        comm: &dyn Comm,
        key: CallKey,
        buf: &mut [u8],
        root: usize,
    ) -> Result<(), DatapathError> {
        let started = Instant::now();
        let is_root = comm.rank() == root;
        let chunks = buf.len().div_ceil(self.chunk_bytes) as u32;
        let (host, slot) = (Arc::clone(&self.host), self.slot);
        // SAFETY: our slot, disarmed until arm().
        let slot_buf = unsafe { host.slot_slice_mut(slot) };
        if is_root {
            // On every lane: one thread takes about as long as a quarter
            // of the chain's own work.
            Lanes::get().copy(&mut slot_buf[..buf.len()], buf);
        }
        let seq = self.next_seq();
        let armed = host
            .arm(
                slot,
                seq,
                chunks,
                wire::ERAR_OP_BCAST as u8,
                root as u32,
                chunks,
            )
            .is_ok();
        let role = if is_root { Role::Source } else { Role::Sink };
        stats::phase_done(Phase::Prepare, started);
        let outcome = self
            .barrier(comm, key, seq, armed, false)
            .and_then(|b| self.run_armed(comm, b, chunks, role, false, None));
        let ran = Instant::now();
        host.disarm(slot);
        if let Outcome::Fallback(why) = outcome? {
            log::debug!("liberar: broadcast segment seq {seq} completed by MPI ({why})");
            stats::record_fallback_bytes(buf.len());
            // The root's data is untouched and nobody else wrote theirs.
            return comm.pmpi_bcast(buf, root);
        }
        if !is_root {
            // After the call, not chunk by chunk while it runs: the copy
            // then competes with the chain for the same CPUs and their
            // caches (16 MiB on 4 hosts: 1.6x the CPU time, measured).
            buf.copy_from_slice(&slot_buf[..buf.len()]);
        }
        stats::phase_done(Phase::Finish, ran);
        Ok(())
    }

    /// Elements of the caller's type one segment holds.
    fn segment_elems(&self, plan: Plan) -> usize {
        plan.segment_elems(
            self.chunk_bytes * CHUNKS_PER_SLOT as usize,
            self.chunk_bytes,
        )
    }

    /// One operation on the kernel ring over at most one slot of data.
    ///
    /// A float SUM whose block summaries are, on every rank, what they were
    /// at this segment's last scale agreement reuses that agreement's
    /// scales (the same ones a new exchange would give), so it makes the
    /// same two exchanges as an integer call: the barrier and the verdict.
    /// Otherwise the barrier says so, and the ranks agree on new scales and
    /// meet once more before anyone injects.
    #[allow(clippy::too_many_arguments)]
    fn segment(
        &mut self,
        comm: &dyn Comm,
        plan: Plan,
        seg: Seg,
        send: Option<&[u8]>,
        recv: &mut [u8],
        elem: ElemType,
        op: ReduceOp,
    ) -> Result<(), DatapathError> {
        let started = Instant::now();
        let count = recv.len() / elem.size();
        let layout = plan.layout(count, self.chunk_bytes);
        // SAFETY: the slot is ours (allocated in establish) and disarmed:
        // the XDP program does not touch it until arm().
        let host = Arc::clone(&self.host);
        let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
        let input: &[u8] = send.unwrap_or(recv);

        // Encode this rank's contribution (float SUM: on the last agreed
        // scales, if this rank's summaries have not changed since).
        let cb = self.chunk_bytes;
        let mut local_special = false;
        let mut rescale = false;
        match plan {
            Plan::Raw { .. } => slot_buf[..input.len()].copy_from_slice(input),
            Plan::FloatSum(precision) => {
                let fs = &mut self.float_sum;
                let unchanged = fs.summarize(input, precision, seg.index, layout, cb, slot_buf);
                if let Some(words) = fs.opening_words(seg.index, seg.key.0, !unchanged) {
                    // The last call rescaled: agree on the scales in the
                    // exchange that opens this one.
                    opening_max(comm, words, self.prober.as_deref_mut())?;
                    check_keys(words)?;
                    let n = self.ranks;
                    let fits = match fs.take_opening(seg.index, precision, seg.key.0, n) {
                        Some(fits) => fits,
                        None => fs.agree(comm, precision, seg.index, seg.key.0)?,
                    };
                    if !fits {
                        // Every rank knows no block fits: skip the ring.
                        stats::record_fallback_bytes(recv.len());
                        return complete_by_mpi(comm, plan, send, recv, elem, op);
                    }
                    fs.encode(input, precision, layout, cb, slot_buf);
                } else if unchanged {
                    // Encoded already, on these scales.
                    fs.reuse(seg.index);
                } else {
                    rescale = true;
                }
            }
            Plan::FloatOrder(_) => local_special = codec::encode_order(input, slot_buf),
        }

        // A bounded call's verdict carries its repairs (from its segment's
        // second call on: the capacity follows the last count).
        let repairs = (plan == Plan::FloatSum(Precision::Bounded)).then(|| Repairs {
            capacity: self.float_sum.verdict_capacity(seg.index, count),
            layout,
            input,
        });
        let seq = self.next_seq();
        let (chunks, wire_op) = (layout.chunks, plan.wire_op() as u8);
        let armed = self
            .host
            .arm(self.slot, seq, chunks, wire_op, 0, layout.flags_from)
            .is_ok();
        stats::phase_done(Phase::Prepare, started);
        let outcome = match self.barrier(comm, seg.key, seq, armed, rescale) {
            Ok(b) if b.rescale => {
                // The key agreed, so the summary exchange's size does too.
                let rescaled = Instant::now();
                let Plan::FloatSum(precision) = plan else {
                    unreachable!("only float SUM asks for new scales")
                };
                let fits = match self.float_sum.agree(comm, precision, seg.index, seg.key.0) {
                    Ok(fits) => fits,
                    Err(e) => {
                        self.host.disarm(self.slot);
                        return Err(e);
                    }
                };
                if !fits {
                    // Every rank knows no block fits: nobody injected.
                    self.host.disarm(self.slot);
                    stats::record_fallback_bytes(recv.len());
                    return complete_by_mpi(comm, plan, send, recv, elem, op);
                }
                self.float_sum
                    .encode(input, precision, layout, cb, slot_buf);
                stats::phase_done(Phase::Prepare, rescaled);
                // Everyone has encoded before anyone injects.
                let seq = b.seq;
                self.barrier(comm, seg.key, seq, !b.broken, false)
                    .and_then(|b| {
                        let repairs = repairs.as_ref();
                        self.run_armed(comm, b, chunks, Role::Member, local_special, repairs)
                    })
            }
            Ok(b) => {
                let repairs = repairs.as_ref();
                self.run_armed(comm, b, chunks, Role::Member, local_special, repairs)
            }
            Err(e) => Err(e),
        };
        let ran = Instant::now();
        self.host.disarm(self.slot);
        if let Outcome::Fallback(why) = outcome? {
            log::debug!("liberar: segment seq {seq} completed by MPI ({why})");
            stats::record_fallback_bytes(recv.len());
            // Nothing was written to `recv` yet: in place, it still holds
            // the caller's input.
            return complete_by_mpi(comm, plan, send, recv, elem, op);
        }

        // Decode into the caller's buffer; blocks MPI must reduce go last.
        match plan {
            Plan::Raw { .. } => recv.copy_from_slice(&slot_buf[..recv.len()]),
            Plan::FloatSum(precision) => {
                let cb = self.chunk_bytes;
                let sum = &mut self.float_sum;
                sum.finish(
                    comm, seg.index, precision, layout, cb, slot_buf, send, recv, elem, op,
                )?;
            }
            Plan::FloatOrder(_) => codec::decode_order(slot_buf, recv),
        }
        stats::phase_done(Phase::Finish, ran);
        Ok(())
    }
}

/// What a bounded float SUM's verdict carries: up to `capacity` repair
/// inputs from `input`, certified on the slot's final words of `layout`
/// ([`FloatSum::verdict_with_repairs`]).
struct Repairs<'a> {
    capacity: usize,
    layout: codec::Layout,
    input: &'a [u8],
}

/// Completes a segment through MPI: under the `reproducible` contract with
/// the bits the ring would have given, otherwise with the caller's own
/// datatype and op.
fn complete_by_mpi(
    comm: &dyn Comm,
    plan: Plan,
    send: Option<&[u8]>,
    recv: &mut [u8],
    elem: ElemType,
    op: ReduceOp,
) -> Result<(), DatapathError> {
    match plan {
        Plan::FloatSum(Precision::Reproducible) => reproducible::allreduce(comm, send, recv),
        _ => comm.pmpi_allreduce(send, recv, elem, op),
    }
}

impl Ring {
    /// The next operation's seq, in 1..2^31 (agree_call compares seqs as
    /// non-negative i32).
    fn next_seq(&mut self) -> u32 {
        self.seq = (self.seq + 1) & 0x7fff_ffff;
        self.seq = self.seq.max(1);
        self.seq
    }

    /// The barrier before injection: nobody injects before every host has
    /// armed, so no frame arrives early. It is the call-key agreement
    /// ([`agree_call`]), which also reconciles seqs and tells whether any
    /// rank asked to `rescale` (agree on new float scales). `armed`: this
    /// host armed the slot for `seq`.
    fn barrier(
        &mut self,
        comm: &dyn Comm,
        key: CallKey,
        seq: u32,
        armed: bool,
        rescale: bool,
    ) -> Result<Barrier, DatapathError> {
        let started = Instant::now();
        let agreed = agree_call(comm, key, seq, rescale, self.prober.as_deref_mut())?;
        stats::phase_done(Phase::Agree, started);
        let mut broken = !armed;
        let seq = if agreed.seq != seq {
            // A call that failed on some ranks before it took a seq and on
            // others after (an erroneous call) leaves the counters apart:
            // everyone adopts the largest. Frames that reach this host
            // before it re-armed are dropped and re-sent by recovery.
            self.seq = agreed.seq;
            broken |= armed && self.host.rearm_seq(self.slot, agreed.seq).is_err();
            agreed.seq
        } else {
            seq
        };
        Ok(Barrier {
            seq,
            broken,
            rescale: agreed.rescale,
            started,
        })
    }

    /// Runs the armed operation past its barrier `b` (`chunks` chunks)
    /// until every host holds every chunk, or every rank agrees to let MPI
    /// complete it. `veto`: this rank already knows the kernel's result
    /// cannot be used (a NaN in its data). `repairs`: a bounded float SUM's
    /// verdicts carry its repair inputs (one exchange for both).
    ///
    /// Rounds: each host waits until it holds every chunk or its progress
    /// stops for ERAR_RETRY_MS. While it waits, each pause of ERAR_NACK_US
    /// sends its predecessor NACKs for what it misses, which that host's XDP
    /// answers by itself: most losses are repaired there, without user
    /// space on the other side or any MPI exchange. Then the ranks agree
    /// whether all are complete; if
    /// not, every host publishes its chunks' stages and its predecessor
    /// re-sends what it waits for (each re-sent frame carries on around
    /// the ring by itself). Duplicates and late originals are dropped in the
    /// kernel by the chunk's stage, so a re-send never adds twice. After
    /// ERAR_STALL_MS the ranks give up together and MPI completes the call.
    fn run_armed(
        &mut self,
        comm: &dyn Comm,
        b: Barrier,
        chunks: u32,
        role: Role,
        veto: bool,
        repairs: Option<&Repairs<'_>>,
    ) -> Result<Outcome, DatapathError> {
        let cfg = Config::get();
        let limit = Duration::from_millis(cfg.stall_ms);
        let patience = Patience {
            nack_after: (cfg.nack_us > 0).then(|| Duration::from_micros(cfg.nack_us)),
            quiet: retry_quiet(),
        };
        let Barrier {
            seq,
            mut broken,
            started,
            ..
        } = b;
        let mut phase_start = Instant::now();
        // Everyone is inside the call now: from here a silent peer is a
        // dead one (or one whose link is down), not a late one.
        let _deadline = (cfg.timeout_ms > 0)
            .then(|| Deadline::set(comm, Duration::from_millis(cfg.timeout_ms)));
        if !broken && role != Role::Sink {
            broken = self.host.inject(self.slot).is_err();
        }
        phase_start = stats::phase_done(Phase::Inject, phase_start);
        loop {
            let complete = broken
                || role == Role::Source
                || match self.host.wait(self.slot, seq, patience) {
                    Ok(waited) => {
                        stats::record_nacks(waited.nacks, waited.nack_chunks);
                        waited.complete
                    }
                    Err(_) => false,
                };
            phase_start = stats::phase_done(Phase::Wait, phase_start);
            let timed_out = started.elapsed() >= limit;
            let mut verdict = [
                broken as i32,
                veto as i32,
                (!complete) as i32,
                timed_out as i32,
            ];
            match repairs {
                Some(r) if r.capacity > 0 => {
                    let host = Arc::clone(&self.host);
                    // SAFETY: our slot, armed; once this host is complete
                    // the kernel writes no more of its words (late copies
                    // are dropped by their chunk's stage), and only then
                    // are they read.
                    let slot_buf = unsafe { host.slot_slice_mut(self.slot) };
                    let usable = complete && !broken && !veto;
                    self.float_sum.verdict_with_repairs(
                        comm,
                        &mut verdict,
                        usable,
                        r.capacity,
                        r.layout,
                        self.chunk_bytes,
                        slot_buf,
                        r.input,
                    )?;
                }
                _ => comm.allreduce_max_i32(&mut verdict)?,
            }
            phase_start = stats::phase_done(Phase::Verdict, phase_start);
            match verdict {
                [0, 0, 0, _] => return Ok(Outcome::Complete),
                [1, ..] => return Ok(Outcome::Fallback("a host's datapath failed")),
                [_, 1, ..] => return Ok(Outcome::Fallback("NaN in the data")),
                [.., 1] => return Ok(Outcome::Fallback("ERAR_STALL_MS passed")),
                _ => {}
            }
            broken = !self.recovery_round(comm, seq, chunks, role)?;
            phase_start = stats::phase_done(Phase::Recovery, phase_start);
        }
    }

    /// Every host publishes its chunks' stages; each re-sends what its
    /// successor waits for. Ok(false): this host's datapath failed (the next
    /// verdict makes everyone fall back); Err: the exchange itself failed.
    fn recovery_round(
        &mut self,
        comm: &dyn Comm,
        seq: u32,
        chunks: u32,
        role: Role,
    ) -> Result<bool, DatapathError> {
        let bytes = (chunks as usize).div_ceil(4);
        let n = comm.size();
        self.stages.clear();
        self.stages.resize(bytes, 0);
        let local_ok = role == Role::Source
            || self
                .host
                .stages(self.slot, seq, chunks, &mut self.stages)
                .is_ok();
        self.all_stages.clear();
        self.all_stages.resize(bytes * n, 0);
        comm.allgather(&self.stages, &mut self.all_stages)?;
        if !local_ok {
            return Ok(false);
        }
        let next = (comm.rank() + 1) % n;
        let theirs = &self.all_stages[next * bytes..(next + 1) * bytes];
        let stage = |packed: &[u8], c: u32| (packed[c as usize / 4] >> (2 * (c % 4))) & 3;
        let bcast = role != Role::Member;
        self.resend.clear();
        for c in 0..chunks {
            let wanted = successor_awaits(bcast, n as u32, next as u32, c, stage(theirs, c));
            // Re-send only what the successor waits for from us: the frame
            // we last sent must be of the kind it awaits (an RS partial, or
            // an AG final value); otherwise the loss was further up the
            // ring, and our predecessor re-sends to us first.
            let mine_is_ag = bcast || stage(&self.stages, c) == wire::ERAR_STAGE_FINAL as u8;
            if wanted == Some(mine_is_ag) {
                self.resend.push(c);
            }
        }
        stats::record_recovery_round(self.resend.len());
        Ok(self.resend.is_empty() || self.host.resend(self.slot, &self.resend).is_ok())
    }
}

/// What the host at ring position `pos` waits for next for chunk `c`, given
/// its stage: `Some(false)` an RS frame, `Some(true)` an AG frame, `None`
/// nothing (it holds the final value, or is applying a frame right now).
fn successor_awaits(bcast: bool, n: u32, pos: u32, c: u32, stage: u8) -> Option<bool> {
    match stage as u32 {
        wire::ERAR_STAGE_FINAL | wire::ERAR_STAGE_BUSY => None,
        _ if bcast => Some(true),
        // Allreduce: the chunk's origin (c mod n) and hosts that already
        // reduced it wait for the all-gather; the others for the RS partial.
        wire::ERAR_STAGE_NONE => Some(pos == c % n),
        _ => Some(true),
    }
}

/// Bounds the communicator's exchanges while alive (see
/// [`Comm::set_deadline`]).
struct Deadline<'a>(&'a dyn Comm);

impl<'a> Deadline<'a> {
    fn set(comm: &'a dyn Comm, within: Duration) -> Deadline<'a> {
        comm.set_deadline(Some(Instant::now() + within));
        Deadline(comm)
    }
}

impl Drop for Deadline<'_> {
    fn drop(&mut self) {
        self.0.set_deadline(None);
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.host.disarm(self.slot);
        release_slot(&self.host, self.slot);
    }
}

/// What every rank must pass identically to one call on the ring, as
/// non-negative words (so that their negations exist).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CallKey([i32; 4]);

impl CallKey {
    fn allreduce(bytes: usize, elem: ElemType, op: ReduceOp, precision: Precision) -> CallKey {
        let what = 1 | (elem as i32) << 4 | (op as i32) << 8 | (precision as i32) << 12;
        CallKey::new(what, bytes, 0)
    }

    fn bcast(bytes: usize, root: usize) -> CallKey {
        CallKey::new(2, bytes, root)
    }

    fn new(what: i32, bytes: usize, extra: usize) -> CallKey {
        const LOW31: u64 = 0x7fff_ffff;
        let b = bytes as u64;
        CallKey([
            what,
            (b & LOW31) as i32,
            ((b >> 31) & LOW31) as i32,
            extra.min(LOW31 as usize) as i32,
        ])
    }
}

/// Checks that every rank makes the same call (size, type, op, precision;
/// size and root for a broadcast) before anything whose size depends on it;
/// being an allreduce, it is also a barrier. An erroneous program (counts,
/// datatypes, ops or roots that differ across ranks) would otherwise have
/// the ranks run different sequences of collectives (a hang), complete
/// silently with truncated or foreign data, or reach MPI's fallback call
/// with mismatched counts. One MAX allreduce of the key and its negation
/// gives every rank each word's largest and smallest value: the same
/// verdict everywhere, an error on every rank, no buffer touched.
///
/// Also returns the largest seq of any rank (see [`Ring::barrier`]) and
/// whether any rank asked to rescale.
///
/// A rank may reach this exchange arbitrarily late, so it has no deadline;
/// while it waits, `prober` watches the other hosts: one that stops
/// answering for ERAR_TIMEOUT_MS (its link or the host is gone) fails the
/// call here instead of hanging it.
fn agree_call(
    comm: &dyn Comm,
    key: CallKey,
    seq: u32,
    rescale: bool,
    prober: Option<&mut Prober>,
) -> Result<Agreed, DatapathError> {
    let mut words = [0i32; 11];
    for (i, k) in key.0.iter().enumerate() {
        words[i] = *k;
        words[4 + i] = -*k;
    }
    let seq_word = (seq & 0x7fff_ffff) as i32;
    words[8] = seq_word;
    words[9] = -seq_word;
    words[10] = rescale as i32;
    opening_max(comm, &mut words, prober)?;
    check_keys(&words)?;
    Ok(Agreed {
        seq: words[8] as u32,
        rescale: words[10] != 0,
    })
}

/// The MAX over ranks of `words` in the exchange that opens a call: a rank
/// may reach it arbitrarily late, so it has no deadline; while it waits,
/// `prober` watches the other hosts (see [`agree_call`]).
fn opening_max(
    comm: &dyn Comm,
    words: &mut [i32],
    prober: Option<&mut Prober>,
) -> Result<(), DatapathError> {
    let timeout = Config::get().timeout_ms;
    match prober {
        Some(p) if timeout > 0 => {
            let within = Duration::from_millis(timeout);
            p.start();
            let agreed = comm.allreduce_max_i32_watched(words, &mut || p.check(within));
            p.stop();
            agreed
        }
        _ => comm.allreduce_max_i32(words),
    }
}

/// After a MAX over `[key, -key, ..]`: every rank gave the same key, or the
/// call is erroneous (an error on every rank).
fn check_keys(words: &[i32]) -> Result<(), DatapathError> {
    if (0..4).any(|i| words[i] != -words[4 + i]) {
        return Err(DatapathError::Failed(
            "the ranks' arguments differ (count, datatype, op or root): erroneous call".into(),
        ));
    }
    Ok(())
}

/// What [`agree_call`] found every rank to say.
struct Agreed {
    /// The largest seq.
    seq: u32,
    /// Some rank must agree on new float scales before injecting.
    rescale: bool,
}

/// A segment of one call: its index within the call and the call's key.
#[derive(Clone, Copy)]
struct Seg {
    index: usize,
    key: CallKey,
}

/// Past the barrier: the agreed seq, whether this host's datapath is
/// unusable for it, whether some rank asked to rescale, and when the
/// barrier began (ERAR_STALL_MS counts from there).
struct Barrier {
    seq: u32,
    broken: bool,
    rescale: bool,
    started: Instant,
}

fn retry_quiet() -> Duration {
    Duration::from_millis(Config::get().retry_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn advert(ifaces: &[([u8; 4], [u8; 6])]) -> Advert {
        let mut a = Advert::default();
        for (slot, (ip, mac)) in a.candidates.iter_mut().zip(ifaces) {
            *slot = AdvertIface {
                ipv4: *ip,
                netmask: [255, 255, 255, 0],
                mac: *mac,
                _pad: [0; 2],
                mtu: 1500,
            };
        }
        a.count = ifaces.len() as u32;
        a
    }

    #[test]
    fn interfaces_are_chosen_on_the_common_subnet() {
        // Rank 0 lists a management interface first; only the second one
        // reaches rank 1.
        let a = advert(&[
            ([192, 0, 2, 1], [2, 0, 0, 0, 0, 1]),
            ([10, 9, 0, 1], [2, 0, 0, 0, 0, 2]),
        ]);
        let b = advert(&[([10, 9, 0, 2], [2, 0, 0, 0, 0, 3])]);
        assert_eq!(choose_interfaces(&[a, b]), Some(vec![1, 0]));
        let c = advert(&[([198, 51, 100, 7], [2, 0, 0, 0, 0, 4])]);
        assert_eq!(choose_interfaces(&[a, b, c]), None);
    }

    #[test]
    fn successor_waits_for_the_right_kind() {
        let (none, reduced, fin) = (
            wire::ERAR_STAGE_NONE as u8,
            wire::ERAR_STAGE_REDUCED as u8,
            wire::ERAR_STAGE_FINAL as u8,
        );
        // Ring of 4, chunk 5 starts at position 1.
        assert_eq!(successor_awaits(false, 4, 2, 5, none), Some(false)); // RS partial
        assert_eq!(successor_awaits(false, 4, 1, 5, none), Some(true)); // origin: AG
        assert_eq!(successor_awaits(false, 4, 3, 5, reduced), Some(true));
        assert_eq!(successor_awaits(false, 4, 3, 5, fin), None);
        assert_eq!(successor_awaits(true, 4, 3, 5, none), Some(true));
        assert_eq!(
            successor_awaits(true, 4, 3, 5, wire::ERAR_STAGE_BUSY as u8),
            None
        );
    }

    #[test]
    fn chunk_fits_the_mtu() {
        assert_eq!(chunk_bytes_for_mtu(1500) % 8, 0);
        assert!(chunk_bytes_for_mtu(1500) + wire::ERAR_PAYLOAD_OFF <= 1514);
        assert_eq!(
            chunk_bytes_for_mtu(9000),
            wire::ERAR_MAX_CHUNK_BYTES / 8 * 8
        );
    }
}
