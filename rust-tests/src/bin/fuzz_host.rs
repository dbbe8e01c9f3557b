//! The XDP frame-parser fuzzer of `tests/fuzz_xdp.rs` (issue #4, item 6).
//! Run inside a private network namespace (`ip netns exec fuzz-… fuzz_host
//! …`): it attaches the kernel datapath to IFNAME, configures and arms the
//! slots with known contents, and pushes FRAMES generated frames through
//! `erar_xdp` with BPF_PROG_RUN in normal (non-live) mode, one frame per
//! call, with an `xdp_md` context whose `ingress_ifindex` is IFNAME's, so
//! the program takes its RECEIVE path (without a context it would run "on"
//! the loopback device and take its inject path).
//!
//! Every frame is checked against a model of the receive path, in plain
//! Rust (its own element-wise reductions, no SWAR), which predicts the exact
//! drop reason (so it follows the program's order of checks) and holds its
//! own copy of every slot buffer, chunk-state word, `done` counter and armed
//! operation:
//!
//! * verdict (XDP_PASS / XDP_DROP / XDP_TX, or EINVAL for frames shorter
//!   than an Ethernet header, which the kernel refuses) and output frame;
//! * the delta of EVERY counter of [`HostDatapath::stats`];
//! * accounting, model-free: a PASS counts nothing and is not a datapath
//!   frame; a DROP raises exactly one terminal counter (a `drop_*` reason,
//!   `dup`, `ag_last` or `nack_skip`) by one; a TX raises either `tx` and
//!   `rx_rs` or `rx_ag` (a data frame forwarded), or `nack_served` alone (a
//!   NACK answered), or `ping` alone (a PING answered: not `tx`), and no
//!   terminal counter; so tx + nack_served + ping = TX verdicts;
//! * corruption: after every frame, for every slot, the whole slot buffer,
//!   every chunk-state word and the slot_ctl must equal the model (a frame
//!   that was not accepted must leave them untouched; an accepted one must
//!   have exactly the RS reduce-with-writeback / AG store effect). They are
//!   read from the slot's own inner maps (`slot_buf`, `chunk_state`,
//!   `slot_ctl`), found through the program's arrays of maps (`slot_bufs`,
//!   `chunk_states`, `slot_ctls`: a lookup of the slot gives the inner map's
//!   id) and mmapped read-only by this process; the ids must stay the ones
//!   installed at attach, and no two slots may share a map;
//! * completion events (each slot's own ring buffer, the inner map of
//!   `slot_events`; all four are consumed after every frame): exactly the
//!   predicted (slot, seq), in the ring buffer of that slot;
//! * semantics, from docs/datapath.md alone ([`docs_expect`]): a frame is
//!   applied iff it is a well-formed frame of the armed operation whose
//!   (kind, step) is the one this host's ring position receives in the
//!   chunk's current stage; a NACK (kind `0x80 | k`) is never applied, and
//!   it is answered iff it is well-formed, of the armed operation, and
//!   names (k, step) of the frame this host last sent for the chunk
//!   ([`docs_last_sent`]); a PING is answered iff it is well-formed, its
//!   slot exists and its comm_id and token are the slot's (erar_wire.h).
//!
//! NACK frames (kind `ERAR_KIND_NACK | k`, full-sized, sent by the successor
//! for the (k, step) frame of a chunk it misses) pass the same validations
//! as data frames, in the same order; then the model answers one whose
//! (k, step) is the frame this host last sent for the chunk (from the
//! chunk's stage) with exactly that frame: kind k, Ethernet/IPv4/UDP from
//! the slot's template (to the next host), payload the slot buffer's chunk,
//! XDP_TX and `nack_served`. Any other NACK (also one whose low kind bits
//! are neither RS nor AG) is dropped with `nack_skip`. A NACK never changes
//! a chunk's stage, the slot buffer, `done` or the events. The classes
//! `nack` (NACKs that name the frame last sent, so they are served) and
//! `nack-miss` (NACKs of another kind/step, of a chunk not sent yet, with
//! bad kind bits, ...) make them; the mutating classes start from a NACK
//! now and then; `replay` repeats them.
//!
//! PING frames (kind exactly `ERAR_KIND_PING`, a liveness probe sent by a
//! rank's UDP socket) pass the same validations as data frames up to the
//! slot index; then, BEFORE the armed/seq check (so armed or not, any seq,
//! wire_op, chunk, step, payload), a comm_id other than the slot's is
//! dropped with `drop_comm`, then a token other than the slot's with
//! `drop_token`; any other PING is turned back: Ethernet destination and
//! source, IPv4 source and destination and UDP source and destination port
//! swapped, UDP checksum 0, kind `ERAR_KIND_PONG`, every other byte as it
//! came; XDP_TX and `ping` (not `tx`). It never changes a chunk's stage,
//! the slot buffer, `done` or the events. A PONG-kind frame is not special
//! on receipt: it takes the data path (and is dropped as an unknown kind).
//! The classes `ping` (PINGs of a slot's ring, as liveness.rs builds them
//! or with any seq/op/chunk/step, to armed and unarmed slots, the unarmed
//! ones more often) and `ping-bad` (wrong comm_id / token, another slot's
//! identity, slot out of range, PONG kind, PING with more kind bits) make
//! them; the mutating classes start from a PING now and then; `replay`
//! repeats them. The first frames of a run (class `ping-unconf`: PINGs,
//! bad PINGs and data frames) go to slots never configured (comm_id and
//! token 0).
//!
//! The slots are re-armed (new seq, new random contents) every few hundred
//! frames and soon after an operation completes, and re-configured as a new
//! ring (ring sizes 1..128, any position, colliding comm_ids, token 0, ...)
//! now and then, so stale and future seqs, other rings' frames and frames
//! for disarmed slots keep coming.
//!
//! Then RACE_ROUNDS rounds of a race phase: the same frame (mostly one the
//! host accepts) runs on both CPUs at once, main thread and a pinned worker
//! released by one store; the model applies it twice in a row, and whichever
//! copy wins, counters, outputs and state must match that. In a quarter of
//! the rounds a valid data frame races instead with a NACK for the same
//! chunk, naming the frame last sent before or after the data frame's
//! stage change: the data frame must have exactly its effect, and the NACK
//! must be answered with the frame last sent before (payload: the chunk as
//! it was) or after (the chunk as the data frame left it) — a payload that
//! matches the (kind, step) it is labelled with — or dropped with
//! `nack_skip` (it met the chunk mid-change: `busy`, or its copy was
//! overtaken, every payload byte then old or new).
//!
//! After a mismatch the model re-syncs from the kernel and fuzzing goes on;
//! the first mismatches are printed with the exact frame. Output ends with a
//! per-class counter table, coverage lines and a line
//! `RESULT frames=… datapath=… pass=… einval=… accepted=… nack_served=…
//! nack_skip=… ping=… ping_drop_comm=… ping_drop_token=… rate=… …
//! mismatches=…` (ping_drop_*: kind-PING frames dropped for that reason);
//! the exit status is 0 only without mismatches.
//!
//! Arguments: IFNAME CHUNK_BYTES CHUNKS_PER_SLOT FRAMES SEED [RACE_ROUNDS].

use std::collections::BTreeMap;
use std::ffi::{c_int, c_void, CStr};
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{anyhow, bail, ensure, Context, Result};
use liberar::datapath::kernel::{HostDatapath, KernelStats, SlotRoute};
use liberar::datapath::wire;

// ---- Frame layout (docs/datapath.md), written out independently ----------

const L2L4: usize = 42;
const HDR: usize = 30;
const PL: usize = L2L4 + HDR; // payload offset, 72
const O_MAGIC: usize = 42;
const O_VERSION: usize = 46;
const O_KIND: usize = 47;
const O_STEP: usize = 48;
const O_OP: usize = 49;
const O_COMM: usize = 50;
const O_TOKEN: usize = 54;
const O_SEQ: usize = 58;
const O_CHUNK: usize = 62;
const O_SLOT: usize = 66;
const O_RESERVED: usize = 68;

const MAGIC: u32 = 0x5241_5245;
const VERSION: u8 = 3;
const UDP_PORT: u16 = 47470;
const RS: u8 = 1;
const AG: u8 = 2;
/// Kind flag of a NACK ("I miss your (kind & 0x7f, step) frame").
const NACK: u8 = 0x80;
/// A liveness probe, and the kind of its answer.
const PING: u8 = 3;
const PONG: u8 = 4;
const OP_BCAST: u32 = 14;
/// Flagged float SUM: ADD_I32 below the armed `flags_from` chunk, OR above.
const OP_FLAGS: u32 = 15;
const OP_NR: u32 = 16;
const SLOTS: usize = 4;
const MAX_RING: u32 = 128;
const ARMED_BIT: u64 = 1 << 32;
const STAGE_NONE: u32 = 0;
const STAGE_BUSY: u32 = 1;
const STAGE_REDUCED: u32 = 2;
const STAGE_FINAL: u32 = 3;

/// Largest linear part of a BPF_PROG_RUN XDP frame: PAGE_SIZE minus
/// XDP_PACKET_HEADROOM (256) minus the aligned skb_shared_info (320); longer
/// input goes to fragments, which the program does not see through
/// `data_end`.
const LINEAR_MAX: usize = 4096 - 256 - 320;

/// One BPF_PROG_RUN: Ok((retval, output length)) or Err(errno).
type RunRes = std::result::Result<(u32, usize), i32>;
/// A run and its output frame.
type Outcome = (RunRes, Vec<u8>);
/// A completion event as read: (the slot whose ring buffer held it, the
/// record's slot, its seq).
type Event = (u32, u32, u32);
/// Counter deltas and completion events.
type Observed = ([u64; NR], Vec<Event>);

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_TX: u32 = 3;

const NR: usize = wire::ERAR_STAT_NR as usize;

fn main() {
    match run() {
        Ok(0) => {}
        Ok(_) => std::process::exit(2),
        Err(e) => {
            eprintln!("fuzz_host: {e:#}");
            println!("error {e:#}");
            std::process::exit(1);
        }
    }
}

// ---- PRNG (xoshiro256**, seeded by splitmix64) -----------------------------

struct Rng {
    s: [u64; 4],
    /// Random bytes that fill() copies windows of (cheap even unoptimized).
    pool: Vec<u8>,
}

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut s = [0u64; 4];
        for w in &mut s {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            *w = x ^ (x >> 31);
        }
        let mut r = Rng {
            s,
            pool: Vec::new(),
        };
        let mut pool = vec![0u8; 1 << 17];
        for c in pool.chunks_exact_mut(8) {
            c.copy_from_slice(&r.next().to_le_bytes());
        }
        r.pool = pool;
        r
    }
    fn next(&mut self) -> u64 {
        let s = &mut self.s;
        let r = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        r
    }
    /// Uniform in 0..n (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }
    fn range(&mut self, lo: u64, hi_incl: u64) -> u64 {
        lo + self.below(hi_incl - lo + 1)
    }
    /// True with probability num/den.
    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
    fn u32(&mut self) -> u32 {
        self.next() as u32
    }
    fn fill(&mut self, b: &mut [u8]) {
        if b.len() > 64 && b.len() <= self.pool.len() / 2 {
            // A random window of the pool, its first 16 bytes fresh.
            let at = self.below((self.pool.len() - b.len()) as u64) as usize;
            b.copy_from_slice(&self.pool[at..at + b.len()]);
            b[..8].copy_from_slice(&self.next().to_le_bytes());
            b[8..16].copy_from_slice(&self.next().to_le_bytes());
            return;
        }
        for c in b.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
    /// A "interesting" 32-bit value around `base`.
    fn near(&mut self, base: u32) -> u32 {
        match self.below(8) {
            0 => 0,
            1 => u32::MAX,
            2 => base.wrapping_add(1),
            3 => base.wrapping_sub(1),
            4 => base ^ (1 << self.below(32)),
            5 => base.wrapping_add(1 << 16),
            6 => base.swap_bytes(),
            _ => self.u32(),
        }
    }
}

fn le32(f: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(f[o..o + 4].try_into().unwrap())
}
fn le16(f: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(f[o..o + 2].try_into().unwrap())
}
fn be16(f: &[u8], o: usize) -> u16 {
    u16::from_be_bytes(f[o..o + 2].try_into().unwrap())
}
fn put32(f: &mut [u8], o: usize, v: u32) {
    f[o..o + 4].copy_from_slice(&v.to_le_bytes());
}
fn put16(f: &mut [u8], o: usize, v: u16) {
    f[o..o + 2].copy_from_slice(&v.to_le_bytes());
}
fn putbe16(f: &mut [u8], o: usize, v: u16) {
    f[o..o + 2].copy_from_slice(&v.to_be_bytes());
}

fn ipv4_csum(h: &[u8]) -> u16 {
    let mut s: u32 = h
        .chunks(2)
        .map(|w| u16::from_be_bytes([w[0], w[1]]) as u32)
        .sum();
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

// ---- Counters ------------------------------------------------------------------

/// KernelStats as an array in enum erar_stat order.
fn stat_array(s: &KernelStats) -> [u64; NR] {
    let mut a = [0u64; NR];
    let mut set = |i: u32, v: u64| a[i as usize] = v;
    set(wire::ERAR_STAT_RX_RS, s.rx_rs);
    set(wire::ERAR_STAT_RX_AG, s.rx_ag);
    set(wire::ERAR_STAT_FINISHED, s.finished);
    set(wire::ERAR_STAT_TX, s.tx);
    set(wire::ERAR_STAT_AG_LAST, s.ag_last);
    set(wire::ERAR_STAT_COMPLETE, s.complete);
    set(wire::ERAR_STAT_INJECTED, s.injected);
    set(wire::ERAR_STAT_DROP_SHORT, s.drop_short);
    set(wire::ERAR_STAT_DROP_MAGIC, s.drop_magic);
    set(wire::ERAR_STAT_DROP_VERSION, s.drop_version);
    set(wire::ERAR_STAT_DROP_SLOT, s.drop_slot);
    set(wire::ERAR_STAT_DROP_COMM, s.drop_comm);
    set(wire::ERAR_STAT_DROP_TOKEN, s.drop_token);
    set(wire::ERAR_STAT_DROP_SEQ, s.drop_seq);
    set(wire::ERAR_STAT_DROP_OP, s.drop_op);
    set(wire::ERAR_STAT_DROP_CHUNK, s.drop_chunk);
    set(wire::ERAR_STAT_DROP_STEP, s.drop_step);
    set(wire::ERAR_STAT_DROP_RINGBUF, s.drop_ringbuf);
    set(wire::ERAR_STAT_INJECT_ERR, s.inject_err);
    set(wire::ERAR_STAT_DUP, s.dup);
    set(wire::ERAR_STAT_DROP_STATE, s.drop_state);
    set(wire::ERAR_STAT_RESENT, s.resent);
    set(wire::ERAR_STAT_RESEND_SKIP, s.resend_skip);
    set(wire::ERAR_STAT_DROP_MALFORMED, s.drop_malformed);
    set(wire::ERAR_STAT_NACK_SENT, s.nack_sent);
    set(wire::ERAR_STAT_NACK_SERVED, s.nack_served);
    set(wire::ERAR_STAT_NACK_SKIP, s.nack_skip);
    set(wire::ERAR_STAT_PING, s.ping);
    a
}

fn stat_name(i: usize) -> &'static str {
    match i as u32 {
        wire::ERAR_STAT_RX_RS => "rx_rs",
        wire::ERAR_STAT_RX_AG => "rx_ag",
        wire::ERAR_STAT_FINISHED => "finished",
        wire::ERAR_STAT_TX => "tx",
        wire::ERAR_STAT_AG_LAST => "ag_last",
        wire::ERAR_STAT_COMPLETE => "complete",
        wire::ERAR_STAT_INJECTED => "injected",
        wire::ERAR_STAT_DROP_SHORT => "drop_short",
        wire::ERAR_STAT_DROP_MAGIC => "drop_magic",
        wire::ERAR_STAT_DROP_VERSION => "drop_version",
        wire::ERAR_STAT_DROP_SLOT => "drop_slot",
        wire::ERAR_STAT_DROP_COMM => "drop_comm",
        wire::ERAR_STAT_DROP_TOKEN => "drop_token",
        wire::ERAR_STAT_DROP_SEQ => "drop_seq",
        wire::ERAR_STAT_DROP_OP => "drop_op",
        wire::ERAR_STAT_DROP_CHUNK => "drop_chunk",
        wire::ERAR_STAT_DROP_STEP => "drop_step",
        wire::ERAR_STAT_DROP_RINGBUF => "drop_ringbuf",
        wire::ERAR_STAT_INJECT_ERR => "inject_err",
        wire::ERAR_STAT_DUP => "dup",
        wire::ERAR_STAT_DROP_STATE => "drop_state",
        wire::ERAR_STAT_RESENT => "resent",
        wire::ERAR_STAT_RESEND_SKIP => "resend_skip",
        wire::ERAR_STAT_DROP_MALFORMED => "drop_malformed",
        wire::ERAR_STAT_NACK_SENT => "nack_sent",
        wire::ERAR_STAT_NACK_SERVED => "nack_served",
        wire::ERAR_STAT_NACK_SKIP => "nack_skip",
        wire::ERAR_STAT_PING => "ping",
        _ => "?",
    }
}

/// Counters that end a datapath frame's life here: exactly one per dropped
/// datapath frame (AG_LAST: the frame completed its trip; DUP: already
/// applied; NACK_SKIP: a NACK not answered), none for a forwarded one.
const TERMINAL: [u32; 15] = [
    wire::ERAR_STAT_DROP_SHORT,
    wire::ERAR_STAT_DROP_MALFORMED,
    wire::ERAR_STAT_DROP_MAGIC,
    wire::ERAR_STAT_DROP_VERSION,
    wire::ERAR_STAT_DROP_SLOT,
    wire::ERAR_STAT_DROP_COMM,
    wire::ERAR_STAT_DROP_TOKEN,
    wire::ERAR_STAT_DROP_SEQ,
    wire::ERAR_STAT_DROP_OP,
    wire::ERAR_STAT_DROP_CHUNK,
    wire::ERAR_STAT_DROP_STEP,
    wire::ERAR_STAT_DUP,
    wire::ERAR_STAT_DROP_STATE,
    wire::ERAR_STAT_AG_LAST,
    wire::ERAR_STAT_NACK_SKIP,
];

// ---- The kernel's maps, found from the program ---------------------------------

struct Mmap {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mmap {
    fn new(fd: &OwnedFd, len: usize, what: &str) -> Result<Mmap> {
        let page = 4096usize;
        let len = len.div_ceil(page).max(1) * page;
        // SAFETY: a fresh read-only shared mapping of an mmapable map.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).with_context(|| format!("mmap {what}"));
        }
        Ok(Mmap {
            ptr: NonNull::new(p.cast()).ok_or_else(|| anyhow!("mmap {what}: NULL"))?,
            len,
        })
    }
    fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.len);
        // SAFETY: within the mapping; the kernel writes it only during our
        // own (synchronous) BPF_PROG_RUN calls.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len) }
    }
}

impl Drop for Mmap {
    fn drop(&mut self) {
        // SAFETY: unmapping what new() mapped.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// fds of the maps `prog_fd` uses, by name.
fn prog_maps(prog_fd: c_int) -> Result<BTreeMap<String, OwnedFd>> {
    let mut ids = [0u32; 32];
    // SAFETY: zeroed info is valid input; map_ids points to `ids`.
    let mut info: libbpf_sys::bpf_prog_info = unsafe { std::mem::zeroed() };
    info.nr_map_ids = ids.len() as u32;
    info.map_ids = ids.as_mut_ptr() as u64;
    let mut len = std::mem::size_of::<libbpf_sys::bpf_prog_info>() as u32;
    // SAFETY: info and ids outlive the call.
    let r = unsafe { libbpf_sys::bpf_prog_get_info_by_fd(prog_fd, &mut info, &mut len) };
    ensure!(r == 0, "bpf_prog_get_info_by_fd: {r}");
    let mut out = BTreeMap::new();
    for &id in &ids[..(info.nr_map_ids as usize).min(ids.len())] {
        // SAFETY: plain syscall wrapper.
        let fd = unsafe { libbpf_sys::bpf_map_get_fd_by_id(id) };
        ensure!(fd >= 0, "bpf_map_get_fd_by_id({id}): {fd}");
        // SAFETY: a new fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mi = map_info(&fd)?;
        // SAFETY: the kernel NUL-terminates the 16-byte name.
        let name = unsafe { CStr::from_ptr(mi.name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        out.insert(name, fd);
    }
    Ok(out)
}

/// The inner map of `slot` in the array of maps `outer` (named `what`): its
/// id and an fd of it, after checking that it is what the program's
/// template says (type, value size, entries, flags).
fn inner_map(
    outer: &OwnedFd,
    slot: u32,
    what: &str,
    want: (libbpf_sys::bpf_map_type, u32, u32, u32),
) -> Result<(u32, OwnedFd)> {
    let id = inner_id(outer, slot).with_context(|| format!("slot {slot}'s {what}"))?;
    ensure!(id != 0, "slot {slot}: no {what} installed");
    // SAFETY: plain syscall wrapper.
    let fd = unsafe { libbpf_sys::bpf_map_get_fd_by_id(id) };
    ensure!(fd >= 0, "bpf_map_get_fd_by_id({id}) ({what}): {fd}");
    // SAFETY: a new fd we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mi = map_info(&fd)?;
    let got = (mi.type_, mi.value_size, mi.max_entries, mi.map_flags);
    ensure!(
        got == want,
        "slot {slot}'s {what} (id {id}) is (type, value size, entries, flags) {got:?}, expected {want:?}"
    );
    Ok((id, fd))
}

/// The id of the inner map of `slot` in the array of maps `outer` (0: none).
fn inner_id(outer: &OwnedFd, slot: u32) -> Result<u32> {
    let mut id = 0u32;
    // SAFETY: key and value are valid for the call.
    let r = unsafe {
        libbpf_sys::bpf_map_lookup_elem(
            outer.as_raw_fd(),
            (&raw const slot).cast(),
            (&raw mut id).cast(),
        )
    };
    match r {
        0 => Ok(id),
        r if r == -libc::ENOENT => Ok(0),
        r => bail!("bpf_map_lookup_elem({slot}): {r}"),
    }
}

fn map_info(fd: &OwnedFd) -> Result<libbpf_sys::bpf_map_info> {
    // SAFETY: zeroed info is valid input.
    let mut mi: libbpf_sys::bpf_map_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libbpf_sys::bpf_map_info>() as u32;
    // SAFETY: mi outlives the call.
    let r = unsafe { libbpf_sys::bpf_map_get_info_by_fd(fd.as_raw_fd(), &mut mi, &mut len) };
    ensure!(r == 0, "bpf_map_get_info_by_fd: {r}");
    Ok(mi)
}

/// The arrays of maps holding the inner maps this fuzzer reads, in the
/// order of [`SlotState::ids`].
const OUTERS: [&str; 4] = ["slot_bufs", "chunk_states", "slot_ctls", "slot_events"];

/// One slot's state in the kernel: its inner maps, reached through the
/// program's arrays of maps, mapped read-only into this process.
struct SlotState {
    /// `slot_buf`: chunks_per_slot elements of chunk_bytes (element c is
    /// chunk c), contiguous.
    buf: Mmap,
    /// `chunk_state`: chunks_per_slot u64 words.
    state: Mmap,
    /// `slot_ctl`: one struct erar_slot_ctl.
    ctl: Mmap,
    /// Our consumer of `slot_events`, the slot's completion events.
    events: Events,
    /// The inner maps' ids, in [`OUTERS`] order.
    ids: [u32; 4],
    /// Their fds, closed after the mappings and the consumer.
    _fds: Vec<OwnedFd>,
}

impl SlotState {
    /// Finds slot `slot`'s inner maps through the arrays of maps in `maps`.
    fn open(maps: &BTreeMap<String, OwnedFd>, slot: u32, cb: u32, cps: u32) -> Result<SlotState> {
        let array = libbpf_sys::BPF_MAP_TYPE_ARRAY;
        let mmapable = libbpf_sys::BPF_F_MMAPABLE;
        let wants = [
            (array, cb, cps, mmapable),
            (array, 8, cps, mmapable),
            (array, CTL_SIZE as u32, 1, mmapable),
            (
                libbpf_sys::BPF_MAP_TYPE_RINGBUF,
                0,
                wire::ERAR_EVENTS_BYTES,
                0,
            ),
        ];
        let mut ids = [0u32; 4];
        let mut fds = Vec::new();
        for (i, (name, want)) in OUTERS.iter().zip(wants).enumerate() {
            let outer = outer_map(maps, name)?;
            let (id, fd) = inner_map(outer, slot, name, want)?;
            ids[i] = id;
            fds.push(fd);
        }
        Ok(SlotState {
            buf: Mmap::new(&fds[0], (cb * cps) as usize, "slot_buf")?,
            state: Mmap::new(&fds[1], cps as usize * 8, "chunk_state")?,
            ctl: Mmap::new(&fds[2], CTL_SIZE, "slot_ctl")?,
            events: Events::new(&fds[3])?,
            ids,
            _fds: fds,
        })
    }
}

/// The program's array of maps `name`, checked to be one of the slots.
fn outer_map<'a>(maps: &'a BTreeMap<String, OwnedFd>, name: &str) -> Result<&'a OwnedFd> {
    let fd = maps
        .get(name)
        .ok_or_else(|| anyhow!("erar_xdp has no map {name} ({:?})", maps.keys()))?;
    let mi = map_info(fd)?;
    ensure!(
        mi.type_ == libbpf_sys::BPF_MAP_TYPE_ARRAY_OF_MAPS && mi.max_entries == SLOTS as u32,
        "map {name} is type {} with {} entries, expected an array of {SLOTS} maps",
        mi.type_,
        mi.max_entries
    );
    Ok(fd)
}

/// Our own consumer of one slot's `slot_events` ring buffer.
struct Events {
    rb: *mut libbpf_sys::ring_buffer,
    /// Boxed: the callback writes through a pointer to the Vec itself.
    #[allow(clippy::box_collection)]
    got: Box<Vec<(u32, u32)>>,
}

unsafe extern "C" fn on_event(
    ctx: *mut c_void,
    data: *mut c_void,
    size: libbpf_sys::size_t,
) -> c_int {
    // SAFETY: ctx is Events::got, data points to `size` bytes.
    let got = unsafe { &mut *(ctx as *mut Vec<(u32, u32)>) };
    let b = unsafe { std::slice::from_raw_parts(data as *const u8, size as usize) };
    if b.len() >= 8 {
        got.push((le32(b, 0), le32(b, 4)));
    } else {
        got.push((u32::MAX, u32::MAX));
    }
    0
}

impl Events {
    fn new(fd: &OwnedFd) -> Result<Events> {
        let mut got = Box::new(Vec::new());
        // SAFETY: got lives as long as rb (freed in drop first).
        let rb = unsafe {
            libbpf_sys::ring_buffer__new(
                fd.as_raw_fd(),
                Some(on_event),
                (&mut *got as *mut Vec<(u32, u32)>).cast(),
                std::ptr::null(),
            )
        };
        ensure!(!rb.is_null(), "ring_buffer__new failed");
        Ok(Events { rb, got })
    }
    fn take(&mut self) -> Vec<(u32, u32)> {
        // SAFETY: rb is valid; the callback writes self.got.
        unsafe { libbpf_sys::ring_buffer__consume(self.rb) };
        std::mem::take(&mut *self.got)
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        // SAFETY: created by ring_buffer__new.
        unsafe { libbpf_sys::ring_buffer__free(self.rb) };
    }
}

// ---- The model of erar_xdp's receive path ----------------------------------------

#[derive(Clone, Copy, Debug)]
struct Ctl {
    comm_id: u32,
    token: u32,
    ring_pos: u32,
    ring_size: u32,
    root: u32,
    chunks: u32,
    wire_op: u32,
    flags_from: u32,
    armed: u64,
    done: u32,
    tmpl: [u8; L2L4],
}

impl Default for Ctl {
    fn default() -> Ctl {
        Ctl {
            comm_id: 0,
            token: 0,
            ring_pos: 0,
            ring_size: 0,
            root: 0,
            chunks: 0,
            wire_op: 0,
            flags_from: 0,
            armed: 0,
            done: 0,
            tmpl: [0; L2L4],
        }
    }
}

impl Ctl {
    fn seq(&self) -> Option<u32> {
        (self.armed & ARMED_BIT != 0).then_some(self.armed as u32)
    }
    /// Distance of this host from chunk's origin.
    fn dist(&self, chunk: u32) -> u32 {
        let n = self.ring_size;
        let from = if self.wire_op == OP_BCAST {
            self.root
        } else {
            chunk % n
        };
        let pos = self.ring_pos;
        if pos >= from {
            pos - from
        } else {
            pos.wrapping_add(n).wrapping_sub(from)
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Verdict {
    Einval,
    Pass,
    Drop,
    Tx,
}

struct Prediction {
    verdict: Verdict,
    ctr: [u64; NR],
    out: Vec<u8>,
    events: Vec<(u32, u32)>,
}

struct Model {
    cb: usize,
    cps: usize,
    ctl: [Ctl; SLOTS],
    state: Vec<u64>,
    buf: Vec<u8>,
}

/// Element-wise combine, written per element type (not SWAR).
fn combine(op: u32, pkt: &mut [u8], own: &mut [u8]) {
    fn lanes<const W: usize>(pkt: &mut [u8], own: &mut [u8], f: impl Fn(u64, u64) -> u64) {
        for (p, o) in pkt.chunks_exact_mut(W).zip(own.chunks_exact_mut(W)) {
            let mut a = [0u8; 8];
            let mut b = [0u8; 8];
            a[..W].copy_from_slice(p);
            b[..W].copy_from_slice(o);
            let v = f(u64::from_le_bytes(a), u64::from_le_bytes(b)).to_le_bytes();
            p.copy_from_slice(&v[..W]);
            o.copy_from_slice(&v[..W]);
        }
    }
    let i32_ = |x: u64| x as u32 as i32;
    match op {
        1 => lanes::<4>(pkt, own, |a, b| (a as u32).wrapping_add(b as u32) as u64),
        2 => lanes::<8>(pkt, own, |a, b| a.wrapping_add(b)),
        3 => lanes::<4>(pkt, own, |a, b| i32_(a).max(i32_(b)) as u32 as u64),
        4 => lanes::<4>(pkt, own, |a, b| i32_(a).min(i32_(b)) as u32 as u64),
        5 => lanes::<4>(pkt, own, |a, b| (a as u32).max(b as u32) as u64),
        6 => lanes::<4>(pkt, own, |a, b| (a as u32).min(b as u32) as u64),
        7 => lanes::<8>(pkt, own, |a, b| (a as i64).max(b as i64) as u64),
        8 => lanes::<8>(pkt, own, |a, b| (a as i64).min(b as i64) as u64),
        9 => lanes::<8>(pkt, own, |a, b| a.max(b)),
        10 => lanes::<8>(pkt, own, |a, b| a.min(b)),
        11 => lanes::<8>(pkt, own, |a, b| a & b),
        12 => lanes::<8>(pkt, own, |a, b| a | b),
        13 => lanes::<8>(pkt, own, |a, b| a ^ b),
        _ => panic!("model: combine with op {op}"),
    }
}

/// Is this a datapath frame (Ethernet / IPv4 without options, not a
/// fragment / UDP to ERAR_UDP_PORT), judged on the linear part?
fn is_datapath(lin: &[u8]) -> bool {
    lin.len() >= L2L4
        && be16(lin, 12) == 0x0800
        && lin[14] == 0x45
        && lin[23] == 17
        && be16(lin, 20) & 0x3fff == 0
        && be16(lin, 36) == UDP_PORT
}

/// For an IPv4/UDP frame to ERAR_UDP_PORT that is not a datapath frame by
/// docs/datapath.md's definition: why not.
fn udp_to_port_not_datapath(f: &[u8]) -> Option<&'static str> {
    if f.len() < 34 || be16(f, 12) != 0x0800 || f[14] >> 4 != 4 || f[23] != 17 {
        return None;
    }
    let udp = 14 + 4 * (f[14] & 0xf) as usize;
    if f.len() < udp + 4 || be16(f, udp + 2) != UDP_PORT {
        return None;
    }
    Some(if f[14] & 0xf != 5 {
        "with IPv4 options"
    } else if be16(f, 20) & 0x3fff != 0 {
        "an IPv4 fragment"
    } else if f.len() < L2L4 {
        "cut inside the UDP header"
    } else {
        "??? (should have been a datapath frame)"
    })
}

impl Model {
    fn idx(&self, slot: usize, chunk: usize) -> usize {
        slot * self.cps + chunk
    }

    fn stage(&self, slot: usize, chunk: usize, seq: u32) -> u32 {
        let w = self.state[self.idx(slot, chunk)];
        if (w >> 32) as u32 == seq {
            w as u32
        } else {
            STAGE_NONE
        }
    }

    /// What erar_xdp must do with `f`; applies its effect to the model.
    fn run(&mut self, f: &[u8]) -> Prediction {
        let mut p = Prediction {
            verdict: Verdict::Drop,
            ctr: [0; NR],
            out: f.to_vec(),
            events: Vec::new(),
        };
        if f.len() < 14 {
            p.verdict = Verdict::Einval;
            return p;
        }
        let lin = &f[..f.len().min(LINEAR_MAX)];
        if !is_datapath(lin) {
            p.verdict = Verdict::Pass;
            return p;
        }
        let cb = self.cb;
        let drop = |mut p: Prediction, s: u32| {
            p.ctr[s as usize] += 1;
            p.verdict = Verdict::Drop;
            p
        };
        if lin.len() < PL + cb {
            return drop(p, wire::ERAR_STAT_DROP_SHORT);
        }
        if le32(f, O_MAGIC) != MAGIC {
            return drop(p, wire::ERAR_STAT_DROP_MAGIC);
        }
        if f[O_VERSION] != VERSION {
            return drop(p, wire::ERAR_STAT_DROP_VERSION);
        }
        if f.len() != PL + cb
            || be16(f, 16) as usize != PL - 14 + cb
            || be16(f, 38) as usize != PL - 34 + cb
            || le32(f, O_RESERVED) != 0
        {
            return drop(p, wire::ERAR_STAT_DROP_MALFORMED);
        }
        let slot = le16(f, O_SLOT) as usize;
        if slot >= SLOTS {
            return drop(p, wire::ERAR_STAT_DROP_SLOT);
        }
        let ctl = self.ctl[slot];
        if f[O_KIND] == PING {
            // Armed or not, whatever seq, op, chunk and step: turned back
            // to where it came from; never changes anything here.
            if le32(f, O_COMM) != ctl.comm_id {
                return drop(p, wire::ERAR_STAT_DROP_COMM);
            }
            if le32(f, O_TOKEN) != ctl.token {
                return drop(p, wire::ERAR_STAT_DROP_TOKEN);
            }
            let o = &mut p.out;
            o[0..6].copy_from_slice(&f[6..12]);
            o[6..12].copy_from_slice(&f[0..6]);
            o[26..30].copy_from_slice(&f[30..34]);
            o[30..34].copy_from_slice(&f[26..30]);
            o[34..36].copy_from_slice(&f[36..38]);
            o[36..38].copy_from_slice(&f[34..36]);
            putbe16(o, 40, 0);
            o[O_KIND] = PONG;
            p.ctr[wire::ERAR_STAT_PING as usize] += 1;
            p.verdict = Verdict::Tx;
            return p;
        }
        let seq = le32(f, O_SEQ);
        if ctl.armed != ARMED_BIT | seq as u64 {
            return drop(p, wire::ERAR_STAT_DROP_SEQ);
        }
        if le32(f, O_COMM) != ctl.comm_id {
            return drop(p, wire::ERAR_STAT_DROP_COMM);
        }
        if le32(f, O_TOKEN) != ctl.token {
            return drop(p, wire::ERAR_STAT_DROP_TOKEN);
        }
        let op = f[O_OP] as u32;
        if op != ctl.wire_op {
            return drop(p, wire::ERAR_STAT_DROP_OP);
        }
        let chunk = le32(f, O_CHUNK);
        if chunk >= ctl.chunks || chunk as usize >= self.cps {
            return drop(p, wire::ERAR_STAT_DROP_CHUNK);
        }
        let n = ctl.ring_size;
        if !(2..=MAX_RING).contains(&n) {
            return drop(p, wire::ERAR_STAT_DROP_STEP);
        }
        let chunk = chunk as usize;
        let step = f[O_STEP] as u32;
        let kind = f[O_KIND];
        let d = ctl.dist(chunk as u32);
        let stage = self.stage(slot, chunk, seq);
        let bcast = op == OP_BCAST;
        let idx = self.idx(slot, chunk);
        let own = idx * cb..(idx + 1) * cb;
        let word = |stage: u32| ((seq as u64) << 32) | stage as u64;

        if kind & NACK != 0 {
            // Answered only if it names exactly the frame this host last
            // sent for the chunk; never changes anything here.
            match last_sent(&ctl, stage, d) {
                Some((k, s)) if kind == NACK | k && step == s as u32 => {
                    p.out[O_KIND] = k;
                    p.out[..L2L4].copy_from_slice(&ctl.tmpl);
                    p.out[PL..PL + cb].copy_from_slice(&self.buf[own]);
                    p.ctr[wire::ERAR_STAT_NACK_SERVED as usize] += 1;
                    p.verdict = Verdict::Tx;
                    return p;
                }
                _ => return drop(p, wire::ERAR_STAT_NACK_SKIP),
            }
        }
        if kind == RS && !bcast {
            if d == 0 || step + 1 != d {
                return drop(p, wire::ERAR_STAT_DROP_STEP);
            }
            if stage != STAGE_NONE {
                return drop(p, wire::ERAR_STAT_DUP);
            }
            p.ctr[wire::ERAR_STAT_RX_RS as usize] += 1;
            let op = match op {
                OP_FLAGS if (chunk as u32) < ctl.flags_from => 1,
                OP_FLAGS => 12,
                _ => op,
            };
            combine(op, &mut p.out[PL..PL + cb], &mut self.buf[own]);
            if d + 1 == n {
                self.state[idx] = word(STAGE_FINAL);
                self.chunk_done(slot, seq, &mut p);
                p.ctr[wire::ERAR_STAT_FINISHED as usize] += 1;
                p.out[O_KIND] = AG;
                p.out[O_STEP] = 0;
            } else {
                self.state[idx] = word(STAGE_REDUCED);
                p.out[O_STEP] = d as u8;
            }
        } else if kind == AG {
            let b = bcast as u32;
            let at = step + b;
            let before = if bcast || d == 0 {
                STAGE_NONE
            } else {
                STAGE_REDUCED
            };
            if d != at || d.wrapping_add(1) >= n + b {
                return drop(p, wire::ERAR_STAT_DROP_STEP);
            }
            if stage == STAGE_FINAL || stage == STAGE_BUSY {
                return drop(p, wire::ERAR_STAT_DUP);
            }
            if stage != before {
                return drop(p, wire::ERAR_STAT_DROP_STATE);
            }
            p.ctr[wire::ERAR_STAT_RX_AG as usize] += 1;
            self.buf[own].copy_from_slice(&f[PL..PL + cb]);
            self.state[idx] = word(STAGE_FINAL);
            self.chunk_done(slot, seq, &mut p);
            if d + 2 == n + b {
                return drop(p, wire::ERAR_STAT_AG_LAST);
            }
            p.out[O_STEP] = (step + 1) as u8;
        } else {
            return drop(p, wire::ERAR_STAT_DROP_STEP);
        }
        p.out[..L2L4].copy_from_slice(&ctl.tmpl);
        p.ctr[wire::ERAR_STAT_TX as usize] += 1;
        p.verdict = Verdict::Tx;
        p
    }

    fn chunk_done(&mut self, slot: usize, seq: u32, p: &mut Prediction) {
        let c = &mut self.ctl[slot];
        let old = c.done;
        c.done = old.wrapping_add(1);
        if old.wrapping_add(1) == c.chunks {
            // We drain the ring buffer after every frame: it never fills.
            p.events.push((slot as u32, seq));
            p.ctr[wire::ERAR_STAT_COMPLETE as usize] += 1;
        }
    }

    /// The (kind, step) of the frame this host last sent for a chunk of
    /// the armed operation on `slot` (what a NACK must name to be served).
    fn last_sent_now(&self, slot: usize, chunk: u32) -> Option<(u8, u8)> {
        let c = &self.ctl[slot];
        let seq = c.seq()?;
        if !(2..=MAX_RING).contains(&c.ring_size) || chunk >= c.chunks {
            return None;
        }
        let stage = self.stage(slot, chunk as usize, seq);
        last_sent(c, stage, c.dist(chunk))
    }

    /// The (kind, step) this host receives next for a chunk, if any.
    fn legit(&self, slot: usize, chunk: u32) -> Option<(u8, u8)> {
        let c = &self.ctl[slot];
        let n = c.ring_size;
        if !(2..=MAX_RING).contains(&n) || chunk >= c.chunks {
            return None;
        }
        let d = c.dist(chunk);
        if d >= n {
            return None;
        }
        if c.wire_op == OP_BCAST {
            return (d >= 1).then(|| (AG, (d - 1) as u8));
        }
        let stage = c
            .seq()
            .map(|s| self.stage(slot, chunk as usize, s))
            .unwrap_or(STAGE_NONE);
        Some(match (stage, d) {
            (STAGE_NONE, 0) => (AG, 0),
            (STAGE_NONE, _) => (RS, (d - 1) as u8),
            (STAGE_REDUCED, _) => (AG, d as u8),
            // FINAL: what it last received (a duplicate now).
            (_, 0) => (AG, 0),
            (_, _) if d + 1 == n => (RS, (d - 1) as u8),
            (_, _) => (AG, d as u8),
        })
    }
}

/// The frame a host at distance `d` from a chunk's origin last sent for it,
/// from the chunk's stage (u32 arithmetic as in the program): allreduce, the
/// origin's own RS step 0 (NONE), RS step d (REDUCED, 1 <= d <= n-2), AG
/// step 0 (FINAL at the finisher d = n-1) or AG step d+1 (FINAL, d <= n-3);
/// broadcast, AG step 0 at the root (whatever its stage) or AG step d
/// (FINAL, d <= n-2).
fn last_sent(c: &Ctl, stage: u32, d: u32) -> Option<(u8, u8)> {
    let n = c.ring_size;
    if c.wire_op == OP_BCAST {
        return (d == 0 || (stage == STAGE_FINAL && d.wrapping_add(2) <= n))
            .then_some((AG, d as u8));
    }
    match stage {
        STAGE_NONE if d == 0 => Some((RS, 0)),
        STAGE_REDUCED if d >= 1 && d.wrapping_add(2) <= n => Some((RS, d as u8)),
        STAGE_FINAL if d.wrapping_add(1) == n => Some((AG, 0)),
        STAGE_FINAL if d.wrapping_add(3) <= n => Some((AG, d.wrapping_add(1) as u8)),
        _ => None,
    }
}

/// What docs/datapath.md says a host last sent for a chunk, from the trip
/// of its frames around the ring (what a NACK is answered with). Allreduce,
/// at distance d from the chunk's origin (c mod n): the origin sends its
/// contribution as RS step 0 and holds nothing else until the final value
/// comes back; a host 1 <= d <= n-2 forwards its partial as RS step d once
/// it has added its contribution; the host d = n-1 finishes the reduction
/// and sends it as AG step 0; AG step s is received at distance s and
/// forwarded as AG step s+1 until distance n-2 holds it. Broadcast: the root
/// sends AG step 0; a host at distance d >= 1 receives AG step d-1 and
/// forwards AG step d unless it is the root's predecessor (d = n-1).
fn docs_last_sent(c: &Ctl, chunk: u32, stage: u32) -> Option<(u8, u8)> {
    let n = c.ring_size;
    if !(2..=MAX_RING).contains(&n) {
        return None;
    }
    let origin = if c.wire_op == OP_BCAST {
        c.root
    } else {
        chunk % n
    };
    let d = (c.ring_pos + n - origin) % n;
    if c.wire_op == OP_BCAST {
        return match d {
            0 => Some((AG, 0)),
            _ if stage == STAGE_FINAL && d < n - 1 => Some((AG, d as u8)),
            _ => None,
        };
    }
    let forwards_ag = d < n - 2; // the AG trip goes on after distance d
    match stage {
        STAGE_NONE if d == 0 => Some((RS, 0)),
        STAGE_REDUCED if d >= 1 && d < n - 1 => Some((RS, d as u8)),
        STAGE_FINAL if d == n - 1 => Some((AG, 0)),
        STAGE_FINAL if forwards_ag => Some((AG, (d + 1) as u8)),
        _ => None,
    }
}

/// What docs/datapath.md says a host receives for a chunk in a stage:
/// allreduce, at distance d from the chunk's origin (c mod n): RS step d-1
/// (d >= 1) while nothing was received; then AG step d (1 <= d <= n-2); the
/// origin (d = 0) receives only AG step 0. Broadcast, at distance d >= 1
/// from the root: AG step d-1, once. The finisher (d = n-1) receives no AG.
fn docs_expect(c: &Ctl, chunk: u32, stage: u32) -> Option<(u8, u8)> {
    let n = c.ring_size;
    if !(2..=MAX_RING).contains(&n) {
        return None;
    }
    let origin = if c.wire_op == OP_BCAST {
        c.root
    } else {
        chunk % n
    };
    let d = (c.ring_pos + n - origin) % n;
    if c.wire_op == OP_BCAST {
        return (d >= 1 && stage == STAGE_NONE).then(|| (AG, (d - 1) as u8));
    }
    match stage {
        STAGE_NONE if d == 0 => Some((AG, 0)),
        STAGE_NONE => Some((RS, (d - 1) as u8)),
        STAGE_REDUCED if d >= 1 && d + 2 <= n => Some((AG, d as u8)),
        _ => None,
    }
}

// ---- Frame generation ----------------------------------------------------------------

const CLASSES: [&str; 19] = [
    "random",      // uniformly random bytes, random length
    "random-hdr",  // valid Eth/IPv4/UDP header, random rest
    "truncated",   // valid frame cut at a header boundary / random point
    "extended",    // valid frame with trailing bytes (also into frags)
    "valid",       // the frame this host legitimately receives next
    "bitflip",     // valid frame, 1-4 bit flips
    "field",       // valid frame, one erar_hdr field substituted
    "l2l4",        // valid frame, one Ethernet/IPv4/UDP field substituted
    "other-slot",  // slot index of another (or no) slot
    "stale-seq",   // seq of another operation
    "wrong-id",    // token / comm_id of another ring
    "kind-step",   // arbitrary kind/step with a valid identity
    "replay",      // an earlier frame sent again
    "chunk",       // chunk index out of the operation / slot
    "nack",        // a NACK naming the frame this host last sent (served)
    "nack-miss",   // a NACK naming another frame (or bad kind bits)
    "ping",        // a PING of a slot's ring (armed or not): answered
    "ping-bad",    // a PING of another ring / slot, or a PONG-kind frame
    "ping-unconf", // first frames only: PINGs and data for unconfigured slots
];
const WEIGHTS: [u64; 19] = [8, 5, 8, 5, 20, 10, 10, 6, 4, 4, 4, 10, 6, 4, 10, 6, 8, 6, 0];
/// Classes 2..=13 other than "valid" and "replay" mutate a valid frame; one
/// in NACK_BASE_IN of them starts from a NACK instead of a data frame, one
/// in PING_BASE_IN of the others from a PING.
const NACK_BASE_IN: u64 = 5;
const PING_BASE_IN: u64 = 8;
const C_VALID: usize = 4;
const C_NACK: usize = 14;
const C_NACK_MISS: usize = 15;
const C_PING: usize = 16;
const C_PING_BAD: usize = 17;
/// Not drawn by weight: the first UNCONF_FRAMES frames of a run, sent
/// before any slot is configured.
const C_PING_UNCONF: usize = 18;
const UNCONF_FRAMES: u64 = 256;

struct Gen {
    rng: Rng,
    /// 32-bit lanes of sign/overflow edge values, for min/max/add payloads.
    edges: Vec<u8>,
    /// Recently generated datapath-looking frames (for "replay").
    history: Vec<Vec<u8>>,
    hist_next: usize,
}

impl Gen {
    /// A frame class, by WEIGHTS.
    fn class(&mut self) -> usize {
        let mut x = self.rng.below(WEIGHTS.iter().sum());
        let mut class = 0;
        while x >= WEIGHTS[class] {
            x -= WEIGHTS[class];
            class += 1;
        }
        class
    }

    fn pick_slot(&mut self, m: &Model) -> usize {
        let armed: Vec<usize> = (0..SLOTS).filter(|&s| m.ctl[s].seq().is_some()).collect();
        if !armed.is_empty() && self.rng.chance(9, 10) {
            self.rng.pick(&armed)
        } else {
            self.rng.below(SLOTS as u64) as usize
        }
    }

    fn l2l4(&mut self, f: &mut [u8], cb: usize) {
        let r = &mut self.rng;
        r.fill(&mut f[0..12]);
        f[0] &= 0xfe; // unicast
        putbe16(f, 12, 0x0800);
        f[14] = 0x45;
        f[15] = 0;
        putbe16(f, 16, (20 + 8 + HDR + cb) as u16);
        putbe16(f, 18, r.u32() as u16);
        putbe16(f, 20, if r.chance(3, 4) { 0x4000 } else { 0 });
        f[22] = 64;
        f[23] = 17;
        f[24] = 0;
        f[25] = 0;
        r.fill(&mut f[26..34]);
        let c = ipv4_csum(&f[14..34]);
        putbe16(f, 24, c);
        putbe16(
            f,
            34,
            if r.chance(1, 2) {
                UDP_PORT
            } else {
                r.u32() as u16
            },
        );
        putbe16(f, 36, UDP_PORT);
        putbe16(f, 38, (8 + HDR + cb) as u16);
        putbe16(f, 40, 0);
    }

    /// A well-formed frame for `slot` (mostly the one this host receives
    /// next for a random chunk of the armed operation).
    fn base(&mut self, m: &Model, slot: usize) -> Vec<u8> {
        let cb = m.cb;
        let mut f = vec![0u8; PL + cb];
        self.l2l4(&mut f, cb);
        let c = m.ctl[slot];
        let r = &mut self.rng;
        put32(&mut f, O_MAGIC, MAGIC);
        f[O_VERSION] = VERSION;
        let seq = c.seq().unwrap_or(c.armed as u32);
        let op = if c.wire_op != 0 {
            c.wire_op as u8
        } else {
            r.range(1, OP_NR as u64 - 1) as u8
        };
        f[O_OP] = op;
        put32(&mut f, O_COMM, c.comm_id);
        put32(&mut f, O_TOKEN, c.token);
        put32(&mut f, O_SEQ, seq);
        // Mostly a chunk that still expects frames (the deeper paths).
        let open: Vec<u32> = match c.seq() {
            Some(seq) if r.chance(2, 3) => (0..c.chunks)
                .filter(|&k| m.stage(slot, k as usize, seq) != STAGE_FINAL)
                .collect(),
            _ => Vec::new(),
        };
        let chunk = if open.is_empty() {
            r.below(c.chunks.max(1) as u64) as u32
        } else {
            r.pick(&open)
        };
        put32(&mut f, O_CHUNK, chunk);
        put16(&mut f, O_SLOT, slot as u16);
        let (kind, step) = match m.legit(slot, chunk) {
            Some(ks) if r.chance(6, 7) => ks,
            _ => (
                r.pick(&[RS, AG]),
                r.below(c.ring_size.clamp(2, 8) as u64) as u8,
            ),
        };
        f[O_KIND] = kind;
        f[O_STEP] = step;
        // Payload: random, or edge values for the min/max/sign cases.
        match r.below(6) {
            0 => f[PL..].fill(0xff),
            1 => f[PL..].fill(0),
            2 => {
                let at = r.below((self.edges.len() - cb) as u64 / 4) as usize * 4;
                f[PL..].copy_from_slice(&self.edges[at..at + cb]);
            }
            _ => r.fill(&mut f[PL..]),
        }
        f
    }

    /// Turns `f` (from base()) into a NACK: mostly one naming the frame
    /// this host last sent for one of the chunks it sent something for, so
    /// that it is served; otherwise (no such chunk) one of any (kind, step).
    fn nack_served(&mut self, m: &Model, f: &mut [u8]) {
        let slot = le16(f, O_SLOT) as usize;
        let c = m.ctl[slot];
        let r = &mut self.rng;
        let sent: Vec<(u32, (u8, u8))> = (0..c.chunks.min(m.cps as u32))
            .filter_map(|k| m.last_sent_now(slot, k).map(|ks| (k, ks)))
            .collect();
        if sent.is_empty() {
            f[O_KIND] = NACK | r.pick(&[RS, AG]);
            f[O_STEP] = r.below(c.ring_size.clamp(2, 8) as u64) as u8;
            return;
        }
        let (chunk, (k, st)) = r.pick(&sent);
        put32(f, O_CHUNK, chunk);
        f[O_KIND] = NACK | k;
        f[O_STEP] = st;
    }

    /// Turns `f` (from base()) into a NACK that (mostly) names a frame this
    /// host did not last send for its chunk.
    fn nack_miss(&mut self, m: &Model, f: &mut [u8]) {
        let slot = le16(f, O_SLOT) as usize;
        let chunk = le32(f, O_CHUNK);
        let c = m.ctl[slot];
        let last = m.last_sent_now(slot, chunk);
        let r = &mut self.rng;
        let rnd = r.u32();
        let (kind, step) = match (r.below(7), last) {
            // What this host waits for itself (its own NACK's content).
            (0, _) => match m.legit(slot, chunk) {
                Some((k, s)) => (NACK | k, s),
                None => (NACK | RS, 0),
            },
            // The last frame sent, but the other kind or a step off.
            (1, Some((k, s))) => (NACK | (k ^ (RS | AG)), s),
            (2, Some((k, s))) => (NACK | k, s.wrapping_add(r.pick(&[1, 255, 2]))),
            // The frame the next stage sends: not sent yet.
            (3, _) => {
                let d = c.dist(chunk);
                r.pick(&[
                    (NACK | RS, d as u8),
                    (NACK | AG, d.wrapping_add(1) as u8),
                    (NACK | AG, d as u8),
                    (NACK | AG, 0),
                ])
            }
            // Kind bits other than one NACK flag plus RS or AG.
            (4, Some((_, s))) | (5, Some((_, s))) => (
                r.pick(&[NACK, NACK | 3, 0xff, NACK | 0x40 | RS, NACK | (rnd as u8)]),
                s,
            ),
            _ => (
                NACK | r.pick(&[RS, AG]),
                r.below(c.ring_size.clamp(2, 8) as u64 + 1) as u8,
            ),
        };
        f[O_KIND] = kind;
        f[O_STEP] = step;
    }

    /// A slot for a PING: any slot, an unarmed one more often than its share.
    fn ping_slot(&mut self, m: &Model) -> usize {
        let unarmed: Vec<usize> = (0..SLOTS).filter(|&s| m.ctl[s].seq().is_none()).collect();
        if !unarmed.is_empty() && self.rng.chance(1, 3) {
            self.rng.pick(&unarmed)
        } else {
            self.rng.below(SLOTS as u64) as usize
        }
    }

    /// A PING of `slot`'s ring (its comm_id and token), as a prober's UDP
    /// socket sends it (liveness.rs: any source port, step 0, op 0, seq a
    /// round number, chunk its rank, zero payload), or with any other
    /// seq / op / chunk / step / payload / UDP checksum.
    fn ping(&mut self, m: &Model, slot: usize) -> Vec<u8> {
        let mut f = self.base(m, slot);
        f[O_KIND] = PING;
        let r = &mut self.rng;
        match r.below(3) {
            0 => {
                f[O_STEP] = 0;
                f[O_OP] = 0;
                put32(&mut f, O_SEQ, r.below(1000) as u32);
                put32(&mut f, O_CHUNK, r.below(MAX_RING as u64) as u32);
                f[PL..].fill(0);
            }
            1 => {
                f[O_STEP] = r.u32() as u8;
                f[O_OP] = r.u32() as u8;
                put32(&mut f, O_SEQ, r.u32());
                put32(&mut f, O_CHUNK, r.u32());
            }
            _ => {}
        }
        if r.chance(2, 3) {
            putbe16(&mut f, 34, r.range(1024, 0xffff) as u16);
        }
        if r.chance(1, 2) {
            putbe16(&mut f, 40, r.u32() as u16);
        }
        f
    }

    /// A PING that (mostly) must not be answered: of another ring (comm_id
    /// or token), of a slot out of range; or a PONG-kind frame (not special
    /// on receipt: it takes the data path), or a PING kind with more bits.
    fn ping_bad(&mut self, m: &Model, slot: usize) -> Vec<u8> {
        let mut f = self.ping(m, slot);
        let c = m.ctl[slot];
        let r = &mut self.rng;
        let o = m.ctl[r.below(SLOTS as u64) as usize];
        match r.below(8) {
            0 => put32(&mut f, O_COMM, r.near(c.comm_id)),
            1 => put32(&mut f, O_TOKEN, r.near(c.token)),
            2 => put32(&mut f, O_TOKEN, o.token),
            3 => put32(&mut f, O_COMM, o.comm_id),
            4 => put16(&mut f, O_SLOT, r.range(SLOTS as u64, 0xffff) as u16),
            5 => {
                // The identity of another slot, to this slot.
                put32(&mut f, O_COMM, o.comm_id);
                put32(&mut f, O_TOKEN, o.token);
            }
            6 => {
                // PONG: as answered, or as a data frame of the armed op.
                if r.chance(1, 2) {
                    let p = f.clone();
                    f = self.base(m, slot);
                    if self.rng.chance(1, 2) {
                        f[PL..].copy_from_slice(&p[PL..]);
                    }
                }
                f[O_KIND] = PONG;
            }
            _ => f[O_KIND] = r.pick(&[NACK | PING, 0x40 | PING, PING | 0x10, 7, PONG | NACK]),
        }
        f
    }

    fn frame(&mut self, m: &Model, class: usize) -> Vec<u8> {
        let cb = m.cb;
        let full = PL + cb;
        let slot = self.pick_slot(m);
        let mut f = match class {
            0 => {
                let len = if self.rng.chance(1, 20) {
                    self.rng.below(64) as usize
                } else {
                    self.rng.below(4001) as usize
                };
                let mut f = vec![0u8; len];
                self.rng.fill(&mut f);
                return f;
            }
            1 => {
                let len = if self.rng.chance(1, 2) {
                    self.rng.range(L2L4 as u64, 4000) as usize
                } else {
                    self.rng.range(full as u64 - 8, full as u64 + 8) as usize
                };
                let mut f = vec![0u8; len.max(L2L4)];
                self.l2l4(&mut f, cb);
                self.rng.fill(&mut f[L2L4..]);
                if self.rng.chance(1, 2) && f.len() > O_VERSION {
                    put32(&mut f, O_MAGIC, MAGIC);
                    if self.rng.chance(1, 2) {
                        f[O_VERSION] = VERSION;
                    }
                }
                return f;
            }
            C_NACK => {
                let mut f = self.base(m, slot);
                self.nack_served(m, &mut f);
                return f;
            }
            C_NACK_MISS => {
                let mut f = self.base(m, slot);
                self.nack_miss(m, &mut f);
                return f;
            }
            C_PING => {
                let slot = self.ping_slot(m);
                return self.ping(m, slot);
            }
            C_PING_BAD => return self.ping_bad(m, slot),
            C_PING_UNCONF => {
                let slot = self.rng.below(SLOTS as u64) as usize;
                return match self.rng.below(3) {
                    0 => self.ping(m, slot),
                    1 => self.ping_bad(m, slot),
                    _ => self.base(m, slot),
                };
            }
            C_VALID | 12 => self.base(m, slot),
            _ => {
                let mut f = self.base(m, slot);
                if self.rng.chance(1, NACK_BASE_IN) {
                    if self.rng.chance(3, 4) {
                        self.nack_served(m, &mut f);
                    } else {
                        self.nack_miss(m, &mut f);
                    }
                } else if self.rng.chance(1, PING_BASE_IN) {
                    f = self.ping(m, slot);
                }
                f
            }
        };
        let c = m.ctl[slot];
        let r = &mut self.rng;
        let rnd = r.u32();
        let cur_chunk = le32(&f, O_CHUNK);
        match class {
            2 => {
                // Every header boundary (and one byte either side), or anywhere.
                const B: [usize; 22] = [
                    0, 1, 6, 12, 13, 14, 15, 20, 24, 33, 34, 35, 36, 38, 40, 41, 42, 43, 46, 47,
                    48, 49,
                ];
                const B2: [usize; 12] = [50, 53, 54, 57, 58, 61, 62, 65, 66, 67, 68, 71];
                let len = match r.below(5) {
                    0 => r.pick(&B),
                    1 => r.pick(&B2),
                    2 => r.pick(&[PL, PL + 1, PL + 7, PL + 8, full - 8, full - 1]),
                    _ => r.below(full as u64) as usize,
                };
                f.truncate(len.min(full - 1));
            }
            3 => {
                let extra = if r.chance(1, 4) {
                    r.range(1, 2 * LINEAR_MAX as u64 - full as u64) as usize
                } else {
                    r.range(1, (4000 - full.min(3999)) as u64) as usize
                };
                let at = f.len();
                f.resize(at + extra, 0);
                r.fill(&mut f[at..]);
            }
            4 => {}
            5 => {
                for _ in 0..r.range(1, 4) {
                    let at = if r.chance(4, 5) {
                        r.below(PL as u64) as usize
                    } else {
                        r.below(f.len() as u64) as usize
                    };
                    f[at] ^= 1 << r.below(8);
                }
            }
            6 => match r.below(11) {
                0 => put32(&mut f, O_MAGIC, r.near(MAGIC)),
                1 => f[O_VERSION] = r.pick(&[0, 1, 3, 0xff, rnd as u8]),
                2 => f[O_KIND] = r.pick(&[0, RS, AG, PING, PONG, 0xff, rnd as u8]),
                3 => f[O_STEP] = r.pick(&[0, 1, 2, 3, 0x7f, 0x80, 0xff, rnd as u8]),
                4 => f[O_OP] = r.pick(&[0, (rnd >> 8) as u8 % (OP_NR as u8 + 2), 0xff, rnd as u8]),
                5 => put32(&mut f, O_COMM, r.near(c.comm_id)),
                6 => put32(&mut f, O_TOKEN, r.near(c.token)),
                7 => put32(&mut f, O_SEQ, r.near(c.armed as u32)),
                8 => put32(&mut f, O_CHUNK, r.near(cur_chunk)),
                9 => put16(&mut f, O_SLOT, r.near(slot as u32) as u16),
                _ => {
                    let v = r.u32();
                    put32(
                        &mut f,
                        O_RESERVED,
                        if r.chance(1, 2) { v } else { v & 0xff },
                    );
                }
            },
            7 => match r.below(11) {
                0 => putbe16(
                    &mut f,
                    12,
                    r.pick(&[0x86dd, 0x0806, 0x8100, 0x0008, rnd as u16]),
                ),
                1 => f[14] = r.pick(&[0x46, 0x44, 0x65, 0x05, 0x4f, 0x55, rnd as u8]),
                2 => f[23] = r.pick(&[6, 1, 0, 0x11 ^ 0x80, rnd as u8]),
                3 => putbe16(
                    &mut f,
                    20,
                    r.pick(&[0x2000, 0x0001, 0x1fff, 0x6000, 0x8000, 0xc000, rnd as u16]),
                ),
                4 => putbe16(
                    &mut f,
                    36,
                    r.pick(&[
                        UDP_PORT + 1,
                        UDP_PORT - 1,
                        UDP_PORT.swap_bytes(),
                        0,
                        rnd as u16,
                    ]),
                ),
                5 => putbe16(&mut f, 34, r.u32() as u16),
                6 => putbe16(&mut f, 16, r.u32() as u16),
                7 => putbe16(&mut f, 38, r.u32() as u16),
                8 => putbe16(&mut f, 24, r.u32() as u16),
                9 => r.fill(&mut f[26..34]),
                _ => {
                    // IPv4 options (NOPs + EOL): everything after moves on.
                    let words = r.range(1, 10) as usize;
                    let mut opts = vec![1u8; 4 * words];
                    opts[4 * words - 1] = 0;
                    f.splice(34..34, opts);
                    f[14] = 0x40 | (5 + words) as u8;
                    let len = be16(&f, 16) as usize + 4 * words;
                    putbe16(&mut f, 16, len as u16);
                }
            },
            8 => {
                let other = if r.chance(3, 4) {
                    (slot + r.range(1, SLOTS as u64 - 1) as usize) % SLOTS
                } else {
                    r.range(SLOTS as u64, 0xffff) as usize
                };
                put16(&mut f, O_SLOT, other as u16);
            }
            9 => {
                let s = c.armed as u32;
                let v = match r.below(5) {
                    0 => s.wrapping_sub(1),
                    1 => s.wrapping_add(1),
                    2 => s.wrapping_sub(r.range(2, 5) as u32),
                    3 => s ^ 0x8000_0000,
                    _ => r.u32(),
                };
                put32(&mut f, O_SEQ, v);
            }
            10 => {
                let o = m.ctl[r.below(SLOTS as u64) as usize];
                match r.below(4) {
                    0 => put32(&mut f, O_TOKEN, o.token),
                    1 => put32(&mut f, O_COMM, o.comm_id),
                    2 => put32(&mut f, O_TOKEN, r.near(c.token)),
                    _ => {
                        put32(&mut f, O_TOKEN, o.token);
                        put32(&mut f, O_COMM, o.comm_id);
                    }
                }
            }
            11 if r.chance(1, 2) && c.ring_size >= 2 && c.ring_size <= MAX_RING => {
                // A frame this host does receive for the chunk, but maybe
                // not in its current stage (AG before RS, RS after AG, ...).
                let d = c.dist(cur_chunk);
                let mut options = Vec::new();
                if c.wire_op == OP_BCAST {
                    options.push((AG, d.wrapping_sub(1) as u8));
                } else {
                    if d >= 1 {
                        options.push((RS, (d - 1) as u8));
                    }
                    if d + 2 <= c.ring_size {
                        options.push((AG, d as u8));
                    }
                    options.push((AG, d.wrapping_add(1) as u8));
                    options.push((RS, d as u8));
                }
                let (k, st) = r.pick(&options);
                f[O_KIND] = k;
                f[O_STEP] = st;
            }
            11 => {
                f[O_KIND] = r.pick(&[RS, RS, AG, AG, 0, PING, PONG, rnd as u8]);
                f[O_STEP] = if r.chance(7, 8) {
                    r.below(c.ring_size.clamp(1, 200) as u64 + 2) as u8
                } else {
                    r.u32() as u8
                };
            }
            12 => {
                if !self.history.is_empty() {
                    let i = r.below(self.history.len() as u64) as usize;
                    return self.history[i].clone();
                }
            }
            13 => {
                let v = match r.below(5) {
                    0 => c.chunks,
                    1 => m.cps as u32,
                    2 => r.range(c.chunks as u64, m.cps as u64 + 2) as u32,
                    3 => u32::MAX,
                    _ => r.u32(),
                };
                put32(&mut f, O_CHUNK, v);
            }
            _ => unreachable!(),
        }
        f
    }

    fn remember(&mut self, f: &[u8]) {
        const H: usize = 256;
        if self.history.len() < H {
            self.history.push(f.to_vec());
        } else {
            self.history[self.hist_next] = f.to_vec();
            self.hist_next = (self.hist_next + 1) % H;
        }
    }
}

// ---- Driver ---------------------------------------------------------------------------------

struct Fuzzer {
    dp: HostDatapath,
    model: Model,
    gen: Gen,
    /// Every slot's inner maps, as the program finds them.
    slots: Vec<SlotState>,
    /// The program's maps by name (the arrays of maps among them).
    maps: BTreeMap<String, OwnedFd>,
    /// Last seq armed per slot (a new ring restarts at 1).
    seqs: [u32; SLOTS],
    ctl_snapshot: Vec<u8>,
    /// The model's slot_ctl and the frame's chunk-state word before the
    /// current frame (for mismatch reports).
    before_ctl: [Ctl; SLOTS],
    before_word: Option<u64>,
    before_chunk: Vec<u8>,
    stats: [u64; NR],
    mismatches: u64,
    reported: u32,
    /// Frames accepted for a broadcast armed with a root outside the ring.
    root_oob_accepts: u64,
    out: Vec<u8>,
}

const CTL_SIZE: usize = std::mem::size_of::<wire::erar_slot_ctl>();
const DONE_OFF: usize = std::mem::offset_of!(wire::erar_slot_ctl, done);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Fuzzer {
    /// Slot `slot`'s buffer: its `slot_buf` inner map.
    fn real_buf(&self, slot: usize) -> &[u8] {
        self.slots[slot].buf.bytes(self.dp.slot_bytes())
    }

    /// The first byte at which the slot buffers differ from the model's
    /// (offset in the model's layout: slot after slot).
    fn buf_diff(&self) -> Option<usize> {
        let sb = self.dp.slot_bytes();
        (0..SLOTS).find_map(|s| {
            let (real, model) = (self.real_buf(s), &self.model.buf[s * sb..(s + 1) * sb]);
            (real != model).then(|| {
                s * sb
                    + real
                        .iter()
                        .zip(model)
                        .position(|(a, b)| a != b)
                        .unwrap_or(0)
            })
        })
    }

    /// The model's slot buffers := the kernel's.
    fn sync_buf(&mut self) {
        let sb = self.dp.slot_bytes();
        for s in 0..SLOTS {
            let real = self.slots[s].buf.bytes(sb);
            self.model.buf[s * sb..(s + 1) * sb].copy_from_slice(real);
        }
    }

    /// Every slot's chunk-state words (its `chunk_state` inner map), slot
    /// after slot as in the model.
    fn real_state(&self) -> Vec<u64> {
        let cps = self.model.cps;
        self.slots
            .iter()
            .flat_map(|s| s.state.bytes(cps * 8).chunks_exact(8))
            .map(|w| u64::from_ne_bytes(w.try_into().unwrap()))
            .collect()
    }

    fn real_ctl(&self, slot: usize) -> wire::erar_slot_ctl {
        let b = self.slots[slot].ctl.bytes(CTL_SIZE);
        // SAFETY: CTL_SIZE bytes; erar_slot_ctl is plain old data.
        unsafe { std::ptr::read_unaligned(b.as_ptr().cast()) }
    }

    /// Every slot's `slot_ctl` inner map, slot after slot.
    fn real_ctl_bytes(&self) -> Vec<u8> {
        self.slots
            .iter()
            .flat_map(|s| s.ctl.bytes(CTL_SIZE).iter().copied())
            .collect()
    }

    /// The inner maps must still be the ones this fuzzer mapped.
    fn check_installed(&self) -> Result<()> {
        for (s, st) in self.slots.iter().enumerate() {
            for (i, name) in OUTERS.iter().enumerate() {
                let id = inner_id(outer_map(&self.maps, name)?, s as u32)?;
                ensure!(
                    id == st.ids[i],
                    "slot {s}'s {name} is now map id {id}, was {}",
                    st.ids[i]
                );
            }
        }
        Ok(())
    }

    /// Between frames: a new epoch when due; completed operations are
    /// followed by the next one on their slot after a while (duplicates of
    /// the old one still arrive meanwhile).
    fn maintain(&mut self, epoch_left: &mut u64, first: &mut bool) -> Result<()> {
        if *epoch_left == 0 {
            self.epoch(*first)?;
            *first = false;
            *epoch_left = self.gen.rng.range(16, 400);
        }
        *epoch_left -= 1;
        for slot in 0..SLOTS {
            let c = self.model.ctl[slot];
            if c.seq().is_some() && c.done >= c.chunks && self.gen.rng.chance(1, 24) {
                let reconfigure = self.gen.rng.chance(1, 8);
                self.setup_slot(slot, reconfigure)?;
                self.settle()?;
            }
        }
        Ok(())
    }

    /// A new operation on every slot (and, sometimes or at first, a new
    /// ring): buffers refilled with random data, armed or left disarmed.
    fn epoch(&mut self, first: bool) -> Result<()> {
        for slot in 0..SLOTS {
            let reconfigure = first || self.gen.rng.chance(1, 4);
            self.setup_slot(slot, reconfigure)?;
        }
        self.settle()
    }

    /// The kernel's state must be the model's after a setup.
    fn settle(&mut self) -> Result<()> {
        self.check_installed()?;
        ensure!(
            self.buf_diff().is_none(),
            "slot buffers differ after setup (at byte {:?})",
            self.buf_diff()
        );
        ensure!(
            self.real_state() == self.model.state,
            "chunk_state differs after setup"
        );
        self.ctl_snapshot = self.real_ctl_bytes();
        Ok(())
    }

    /// Next operation on one slot (after `reconfigure`, of a new ring).
    fn setup_slot(&mut self, slot: usize, reconfigure: bool) -> Result<()> {
        let cb = self.model.cb;
        let cps = self.model.cps;
        {
            let r = &mut self.gen.rng;
            if reconfigure {
                let n = r.pick(&[1u32, 2, 2, 3, 3, 4, 4, 4, 5, 7, 8, 128]);
                let mac = |r: &mut Rng| {
                    let mut m = [0u8; 6];
                    r.fill(&mut m);
                    m[0] = (m[0] & 0xfe) | 0x02;
                    m
                };
                let route = SlotRoute {
                    self_mac: mac(r),
                    self_ip: Ipv4Addr::from(r.u32()),
                    next_mac: mac(r),
                    next_ip: Ipv4Addr::from(r.u32()),
                    ring_pos: r.below(n as u64) as u32,
                    ring_size: n,
                    // Small ids collide across slots now and then.
                    comm_id: if r.chance(1, 3) {
                        r.below(4) as u32
                    } else {
                        r.u32()
                    },
                    token: if r.chance(1, 8) { 0 } else { r.u32() },
                    prev_mac: mac(r),
                    prev_ip: Ipv4Addr::from(r.u32()),
                };
                self.dp.configure_slot(slot as u32, &route)?;
                let c = &mut self.model.ctl[slot];
                c.comm_id = route.comm_id;
                c.token = route.token;
                c.ring_pos = route.ring_pos;
                c.ring_size = n;
                c.armed = 0;
                for w in &mut self.model.state[slot * cps..(slot + 1) * cps] {
                    *w = 0;
                }
                self.seqs[slot] = 0;
                let real = self.real_ctl(slot);
                let bytes = |w: &[u64]| -> [u8; L2L4] {
                    w.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>()[..L2L4]
                        .try_into()
                        .unwrap()
                };
                self.model.ctl[slot].tmpl = bytes(&real.tmpl);
                let me = (route.self_mac, route.self_ip);
                check_template(&bytes(&real.tmpl), me, (route.next_mac, route.next_ip), cb)
                    .with_context(|| format!("slot {slot}: tmpl (to the next host)"))?;
                check_template(
                    &bytes(&real.nack_tmpl),
                    me,
                    (route.prev_mac, route.prev_ip),
                    cb,
                )
                .with_context(|| format!("slot {slot}: nack_tmpl (to the previous host)"))?;
            }
            self.dp.disarm(slot as u32);
            self.model.ctl[slot].armed = 0;
            let r = &mut self.gen.rng;
            if r.chance(17, 20) {
                let seq = match r.below(10) {
                    0 => self.seqs[slot].wrapping_add(r.range(2, 1000) as u32),
                    1 => u32::MAX - r.below(3) as u32,
                    _ => self.seqs[slot].wrapping_add(1),
                };
                let seq = if seq == 0 { 1 } else { seq };
                self.seqs[slot] = seq;
                let chunks = if r.chance(1, 4) {
                    cps as u32
                } else {
                    r.range(1, cps as u64) as u32
                };
                let op = match r.range(1, OP_NR as u64 - 2) as u32 {
                    _ if r.chance(1, 5) => OP_BCAST,
                    // The range's last value stands for the op after it.
                    OP_BCAST => OP_FLAGS,
                    op => op,
                };
                let flags_from = r.range(0, chunks as u64 + 1) as u32;
                let n = self.model.ctl[slot].ring_size;
                // arm() must refuse a root outside the ring (and change
                // nothing): hosts would disagree on who the root is.
                if op == OP_BCAST && r.chance(1, 16) {
                    let bad = r.pick(&[n, n + 1, u32::MAX]);
                    ensure!(
                        self.dp
                            .arm(slot as u32, seq, chunks, op as u8, bad, flags_from)
                            .is_err(),
                        "arm() accepted broadcast root {bad} outside the ring of {n}"
                    );
                }
                let root = r.below(n as u64) as u32;
                // SAFETY: disarmed; no other reference to the buffer.
                let buf = unsafe { self.dp.slot_slice_mut(slot as u32) };
                r.fill(buf);
                let sb = self.dp.slot_bytes();
                self.model.buf[slot * sb..(slot + 1) * sb].copy_from_slice(buf);
                self.dp
                    .arm(slot as u32, seq, chunks, op as u8, root, flags_from)?;
                let c = &mut self.model.ctl[slot];
                c.chunks = chunks;
                c.wire_op = op;
                c.flags_from = flags_from;
                c.root = root;
                c.done = 0;
                c.armed = ARMED_BIT | seq as u64;
            }
            // The kernel-visible slot_ctl must be what the model thinks.
            let real = self.real_ctl(slot);
            let c = self.model.ctl[slot];
            ensure!(
                real.comm_id == c.comm_id
                    && real.token == c.token
                    && real.ring_pos == c.ring_pos
                    && real.ring_size == c.ring_size
                    && real.armed == c.armed
                    && (c.armed == 0
                        || (real.chunks == c.chunks
                            && real.wire_op == c.wire_op
                            && real.flags_from == c.flags_from
                            && real.root == c.root
                            && real.done == c.done)),
                "slot {slot}: slot_ctl {real:?} differs from the model {c:?}"
            );
            self.model.ctl[slot].done = real.done;
            self.model.ctl[slot].chunks = real.chunks;
            self.model.ctl[slot].wire_op = real.wire_op;
            self.model.ctl[slot].flags_from = real.flags_from;
            self.model.ctl[slot].root = real.root;
        }
        Ok(())
    }

    /// One BPF_PROG_RUN of `f` on the receive path: Ok((retval, out_len))
    /// or Err(errno).
    fn prog_run(&mut self, f: &[u8]) -> RunRes {
        prog_run_raw(
            self.dp.prog_fd().as_raw_fd(),
            self.dp.ifindex(),
            f,
            &mut self.out,
        )
    }
}

/// One BPF_PROG_RUN of `f` through the program's receive path: Ok((retval,
/// output length in `out`)) or Err(errno).
fn prog_run_raw(prog_fd: c_int, ifindex: u32, f: &[u8], out: &mut [u8]) -> RunRes {
    {
        let ctx = libbpf_sys::xdp_md {
            data: 0,
            data_end: f.len() as u32,
            data_meta: 0,
            ingress_ifindex: ifindex,
            rx_queue_index: 0,
            egress_ifindex: 0,
        };
        let dummy = [0u8; 1];
        // SAFETY: zeroed opts is the documented default.
        let mut o: libbpf_sys::bpf_test_run_opts = unsafe { std::mem::zeroed() };
        o.sz = std::mem::size_of::<libbpf_sys::bpf_test_run_opts>() as _;
        o.data_in = if f.is_empty() {
            dummy.as_ptr()
        } else {
            f.as_ptr()
        }
        .cast();
        o.data_size_in = f.len() as u32;
        o.data_out = out.as_mut_ptr().cast();
        o.data_size_out = out.len() as u32;
        o.ctx_in = (&ctx as *const libbpf_sys::xdp_md).cast();
        o.ctx_size_in = std::mem::size_of::<libbpf_sys::xdp_md>() as u32;
        o.repeat = 1;
        // SAFETY: every buffer outlives the call.
        let r = unsafe { libbpf_sys::bpf_prog_test_run_opts(prog_fd, &mut o) };
        if r != 0 {
            return Err(-r);
        }
        Ok((o.retval, o.data_size_out as usize))
    }
}

impl Fuzzer {
    fn mismatch(&mut self, class: &str, f: &[u8], what: &str, detail: String) {
        self.mismatches += 1;
        if self.reported < 20 {
            self.reported += 1;
            let slot = if f.len() >= O_SLOT + 2 {
                le16(f, O_SLOT) as usize
            } else {
                SLOTS
            };
            let ctx = if slot < SLOTS {
                let c = self.before_ctl[slot];
                let st = match self.before_word {
                    Some(w) => format!("{w:#x}"),
                    None => "-".into(),
                };
                format!("slot {slot} ctl {{comm {:#x} token {:#x} pos {} n {} root {} chunks {} op {} armed {:#x} done {}}} chunk_state(before) {st}",
                    c.comm_id, c.token, c.ring_pos, c.ring_size, c.root, c.chunks, c.wire_op, c.armed, c.done)
            } else {
                String::new()
            };
            println!(
                "MISMATCH #{} [{class}] {what}: {detail}\n  {ctx}\n  frame len {}: {}",
                self.mismatches,
                f.len(),
                hex(f),
            );
        }
    }

    /// Notes the model's state before a frame (reports, and the revert of
    /// a model-accepted frame the kernel rejected). Returns the frame's
    /// chunk element, the only one it may change.
    fn before(&mut self, f: &[u8]) -> Option<usize> {
        self.before_ctl = self.model.ctl;
        self.before_word = None;
        if f.len() >= O_SLOT + 2 {
            let (s, c) = (le16(f, O_SLOT) as usize, le32(f, O_CHUNK) as usize);
            if s < SLOTS && c < self.model.cps {
                let idx = s * self.model.cps + c;
                self.before_word = Some(self.model.state[idx]);
                let cb = self.model.cb;
                self.before_chunk.clear();
                self.before_chunk
                    .extend_from_slice(&self.model.buf[idx * cb..(idx + 1) * cb]);
                return Some(idx);
            }
        }
        None
    }

    /// The docs' rule, independent of the program's order of checks: a
    /// frame is applied (once) iff it is a well-formed datapath frame of the
    /// armed operation (magic, version, slot, seq, comm_id, token, wire_op,
    /// chunk < chunks) whose (kind, step) is the one [`docs_expect`] gives
    /// for the chunk's stage before it. A NACK is never applied; it is
    /// answered (`served`, when given) iff it is such a frame whose kind is
    /// NACK | k and (k, step) is what [`docs_last_sent`] gives.
    fn check_semantics(
        &mut self,
        class: &str,
        f: &[u8],
        target: Option<usize>,
        accepted: bool,
        served: Option<bool>,
    ) {
        let cb = self.model.cb;
        let (should, should_serve) = match (target, self.before_word) {
            (Some(idx), Some(w)) if f.len() >= PL + cb => {
                let (slot, chunk) = (idx / self.model.cps, (idx % self.model.cps) as u32);
                let c = self.before_ctl[slot];
                let seq = le32(f, O_SEQ);
                let stage = if (w >> 32) as u32 == seq {
                    w as u32
                } else {
                    STAGE_NONE
                };
                if c.wire_op == OP_BCAST && c.root >= c.ring_size {
                    // arm() accepted a root outside the ring: unspecified.
                    if accepted {
                        self.root_oob_accepts += 1;
                    }
                    return;
                }
                let of_op = is_datapath(&f[..f.len().min(LINEAR_MAX)])
                    && f.len() == PL + cb
                    && be16(f, 16) as usize == 20 + 8 + HDR + cb
                    && be16(f, 38) as usize == 8 + HDR + cb
                    && le32(f, O_RESERVED) == 0
                    && le32(f, O_MAGIC) == MAGIC
                    && f[O_VERSION] == VERSION
                    && c.armed == ARMED_BIT | seq as u64
                    && le32(f, O_COMM) == c.comm_id
                    && le32(f, O_TOKEN) == c.token
                    && f[O_OP] as u32 == c.wire_op
                    && chunk < c.chunks;
                let (kind, step) = (f[O_KIND], f[O_STEP]);
                (
                    of_op && docs_expect(&c, chunk, stage) == Some((kind, step)),
                    of_op
                        && docs_last_sent(&c, chunk, stage).map(|(k, s)| (NACK | k, s))
                            == Some((kind, step)),
                )
            }
            _ => (false, false),
        };
        if accepted != should {
            self.mismatch(
                class,
                f,
                "SEMANTICS",
                format!("kernel accepted: {accepted}, docs' rule says: {should}"),
            );
        }
        if let Some(served) = served {
            if served != should_serve {
                self.mismatch(
                    class,
                    f,
                    "SEMANTICS",
                    format!("kernel answered the NACK: {served}, docs' rule says: {should_serve}"),
                );
            }
        }
    }

    /// The rule of erar_wire.h (ERAR_KIND_PING) and docs/datapath.md
    /// (Faults), independent of the program's order of checks: a frame is
    /// answered as a PING iff it is a well-formed datapath frame (length,
    /// IPv4 and UDP lengths, reserved bytes, magic, version) of kind exactly
    /// ERAR_KIND_PING whose slot exists and whose comm_id and token are the
    /// slot's, armed or not, whatever its seq, wire_op, chunk and step.
    fn check_ping_semantics(&mut self, class: &str, f: &[u8], pinged: bool) {
        let cb = self.model.cb;
        let should = is_datapath(&f[..f.len().min(LINEAR_MAX)])
            && f.len() == PL + cb
            && be16(f, 16) as usize == 20 + 8 + HDR + cb
            && be16(f, 38) as usize == 8 + HDR + cb
            && le32(f, O_RESERVED) == 0
            && le32(f, O_MAGIC) == MAGIC
            && f[O_VERSION] == VERSION
            && f[O_KIND] == PING
            && (le16(f, O_SLOT) as usize) < SLOTS
            && {
                let c = self.before_ctl[le16(f, O_SLOT) as usize];
                le32(f, O_COMM) == c.comm_id && le32(f, O_TOKEN) == c.token
            };
        if pinged != should {
            self.mismatch(
                class,
                f,
                "SEMANTICS",
                format!("kernel answered a PING: {pinged}, erar_wire.h's rule says: {should}"),
            );
        }
    }

    /// Counter deltas and completion events since the last call.
    fn observe(&mut self) -> Result<Observed> {
        let now = stat_array(&self.dp.stats()?);
        let mut delta = [0u64; NR];
        for i in 0..NR {
            delta[i] = now[i].wrapping_sub(self.stats[i]);
        }
        self.stats = now;
        let mut events = Vec::new();
        for (s, st) in self.slots.iter_mut().enumerate() {
            events.extend(
                st.events
                    .take()
                    .into_iter()
                    .map(|(slot, seq)| (s as u32, slot, seq)),
            );
        }
        Ok((delta, events))
    }

    /// Runs one frame and checks everything. Returns the outcome labels.
    fn one(&mut self, class: &str, f: &[u8]) -> Result<(Verdict, [u64; NR])> {
        let target = self.before(f);
        let pred = self.model.run(f);
        let res = self.prog_run(f);
        let out = match res {
            Ok((_, len)) => self.out[..len.min(self.out.len())].to_vec(),
            Err(_) => Vec::new(),
        };
        let (delta, events) = self.observe()?;
        let v = self.check(
            class,
            f,
            target,
            &[pred],
            vec![(res, out)],
            delta,
            events,
            false,
        )?;
        Ok((v[0], delta))
    }

    /// Checks the runs of copies of frame `f` (results in any order) against
    /// the model's predictions for applying it that many times in a row.
    /// `mixed`: the second run was not of `f` but of a NACK for its chunk
    /// (results in the order of `preds`; no NACK semantics for `f`).
    #[allow(clippy::too_many_arguments)]
    fn check(
        &mut self,
        class: &str,
        f: &[u8],
        target: Option<usize>,
        preds: &[Prediction],
        mut results: Vec<Outcome>,
        delta: [u64; NR],
        events: Vec<Event>,
        mixed: bool,
    ) -> Result<Vec<Verdict>> {
        let mut verdicts = Vec::new();
        for (res, _) in &results {
            verdicts.push(match *res {
                Err(e) if e == libc::EINVAL => Verdict::Einval,
                Err(e) => bail!("BPF_PROG_RUN failed: errno {e} on a {}-byte frame", f.len()),
                Ok((XDP_DROP, _)) => Verdict::Drop,
                Ok((XDP_PASS, _)) => Verdict::Pass,
                Ok((XDP_TX, _)) => Verdict::Tx,
                Ok((other, _)) => {
                    self.mismatch(class, f, "retval", format!("unexpected retval {other}"));
                    Verdict::Drop
                }
            });
        }
        // Concurrent copies: match kernel results to the model's order.
        if results.len() == 2 && !mixed {
            let fits = |i: usize, p: &Prediction, v: &[Verdict], r: &[Outcome]| {
                v[i] == p.verdict && (v[i] == Verdict::Einval || r[i].1 == p.out)
            };
            if !(fits(0, &preds[0], &verdicts, &results) && fits(1, &preds[1], &verdicts, &results))
                && fits(1, &preds[0], &verdicts, &results)
                && fits(0, &preds[1], &verdicts, &results)
            {
                results.swap(0, 1);
                verdicts.swap(0, 1);
            }
        }
        let mut want = [0u64; NR];
        let mut want_events = Vec::new();
        for (i, p) in preds.iter().enumerate() {
            for (w, c) in want.iter_mut().zip(&p.ctr) {
                *w += c;
            }
            // Slot s's events come from slot s's ring buffer.
            want_events.extend(p.events.iter().map(|&(slot, seq)| (slot, slot, seq)));
            if verdicts[i] != p.verdict {
                self.mismatch(
                    class,
                    f,
                    "verdict",
                    format!("kernel {:?}, model {:?}", verdicts[i], p.verdict),
                );
            }
            if verdicts[i] != Verdict::Einval && results[i].1 != p.out {
                let out = &results[i].1;
                let first = out.iter().zip(&p.out).position(|(a, b)| a != b);
                self.mismatch(
                    class,
                    f,
                    "output frame",
                    format!(
                        "len {} vs {}, first difference at {first:?}",
                        out.len(),
                        p.out.len()
                    ),
                );
            }
        }
        // Model-free accounting: each datapath frame raises exactly one
        // terminal counter (drop) or tx / nack_served / ping (sent back
        // out); a tx or an AG_LAST drop follows exactly one acceptance, a
        // served NACK or an answered PING none; others count nothing.
        let terminal: u64 = TERMINAL.iter().map(|&i| delta[i as usize]).sum();
        let rx = delta[wire::ERAR_STAT_RX_RS as usize] + delta[wire::ERAR_STAT_RX_AG as usize];
        let tx = delta[wire::ERAR_STAT_TX as usize];
        let served = delta[wire::ERAR_STAT_NACK_SERVED as usize];
        let pinged = delta[wire::ERAR_STAT_PING as usize];
        let n_drop = verdicts.iter().filter(|&&v| v == Verdict::Drop).count() as u64;
        let n_tx = verdicts.iter().filter(|&&v| v == Verdict::Tx).count() as u64;
        let lin = &f[..f.len().min(LINEAR_MAX)];
        let quiet_ok = verdicts.iter().all(|&v| v != Verdict::Pass) || !is_datapath(lin);
        let acct_ok = terminal == n_drop
            && tx + served + pinged == n_tx
            && rx == tx + delta[wire::ERAR_STAT_AG_LAST as usize]
            && (n_drop + n_tx > 0 || delta.iter().all(|&d| d == 0))
            && quiet_ok;
        if !acct_ok {
            self.mismatch(
                class,
                f,
                "ACCOUNTING",
                format!("{verdicts:?} with counter deltas {}", fmt_ctr(&delta)),
            );
        }
        if delta != want {
            self.mismatch(
                class,
                f,
                "counters",
                format!("kernel {} / model {}", fmt_ctr(&delta), fmt_ctr(&want)),
            );
        }
        // Ring buffers are read one after the other: only the order within
        // one is kept.
        let mut events = events;
        events.sort_by_key(|e| e.0);
        want_events.sort_by_key(|e: &Event| e.0);
        if events != want_events {
            self.mismatch(
                class,
                f,
                "events",
                format!("kernel {events:?}, model {want_events:?} (ring buffer's slot, slot, seq)"),
            );
        }

        // Corruption: the kernel's state must be exactly the model's. If the
        // kernel rejected a frame the model accepted (reported above), the
        // kernel's state must be the state before the frame.
        let accepted = rx > 0;
        self.check_semantics(class, f, target, accepted, (!mixed).then_some(served > 0));
        self.check_ping_semantics(class, f, pinged > 0);
        let model_accepted =
            want[wire::ERAR_STAT_RX_RS as usize] + want[wire::ERAR_STAT_RX_AG as usize] > 0;
        if !accepted && model_accepted {
            if let (Some(idx), Some(w)) = (target, self.before_word) {
                let cb = self.model.cb;
                self.model.buf[idx * cb..(idx + 1) * cb].copy_from_slice(&self.before_chunk);
                self.model.state[idx] = w;
                for s in 0..SLOTS {
                    self.model.ctl[s].done = self.before_ctl[s].done;
                }
            }
        }
        let what = if accepted {
            "effect of an accepted frame"
        } else {
            "CORRUPTION by a rejected frame"
        };
        if let Some(first) = self.buf_diff() {
            let (slot, chunk) = (
                first / self.dp.slot_bytes(),
                first % self.dp.slot_bytes() / self.model.cb,
            );
            self.mismatch(
                class,
                f,
                what,
                format!("slot buffer differs from slot {slot} chunk {chunk} (byte {first})"),
            );
            self.sync_buf();
        }
        let rs = self.real_state();
        if rs != self.model.state {
            let diffs: Vec<String> = rs
                .iter()
                .zip(&self.model.state)
                .enumerate()
                .filter(|(_, (a, b))| a != b)
                .map(|(i, (a, b))| format!("[{i}] kernel {a:#x} model {b:#x}"))
                .collect();
            self.mismatch(class, f, what, format!("chunk_state: {}", diffs.join(", ")));
            self.model.state = rs;
        }
        let mut want_ctl = self.ctl_snapshot.clone();
        for s in 0..SLOTS {
            let o = s * CTL_SIZE + DONE_OFF;
            want_ctl[o..o + 4].copy_from_slice(&self.model.ctl[s].done.to_ne_bytes());
        }
        let real_ctl = self.real_ctl_bytes();
        if real_ctl != want_ctl {
            let real: Vec<u32> = (0..SLOTS).map(|s| self.real_ctl(s).done).collect();
            self.mismatch(
                class,
                f,
                what,
                format!("slot_ctl differs (done: kernel {real:?})"),
            );
            for s in 0..SLOTS {
                self.model.ctl[s].done = self.real_ctl(s).done;
            }
            self.ctl_snapshot = real_ctl;
        }
        Ok(verdicts)
    }
}

fn fmt_ctr(c: &[u64; NR]) -> String {
    let v: Vec<String> = (0..NR)
        .filter(|&i| c[i] != 0)
        .map(|i| format!("{}+{}", stat_name(i), c[i]))
        .collect();
    if v.is_empty() {
        "(none)".into()
    } else {
        v.join(" ")
    }
}

/// A precomputed header of a slot (`from` this host `to` the next or the
/// previous host), checked field by field.
fn check_template(
    t: &[u8; L2L4],
    from: ([u8; 6], Ipv4Addr),
    to: ([u8; 6], Ipv4Addr),
    cb: usize,
) -> Result<()> {
    ensure!(t[0..6] == to.0 && t[6..12] == from.0, "template MACs");
    ensure!(
        be16(t, 12) == 0x0800 && t[14] == 0x45 && t[23] == 17,
        "template protocols"
    );
    ensure!(
        be16(t, 16) as usize == 20 + 8 + HDR + cb,
        "template IPv4 length"
    );
    ensure!(be16(t, 20) == 0x4000 && t[22] == 64, "template DF/TTL");
    ensure!(ipv4_csum(&t[14..34]) == 0, "template IPv4 checksum");
    ensure!(
        t[26..30] == from.1.octets() && t[30..34] == to.1.octets(),
        "template IPs"
    );
    ensure!(
        be16(t, 34) == UDP_PORT && be16(t, 36) == UDP_PORT,
        "template ports"
    );
    ensure!(
        be16(t, 38) as usize == 8 + HDR + cb && be16(t, 40) == 0,
        "template UDP length/checksum"
    );
    Ok(())
}

fn run() -> Result<u64> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() != 5 && a.len() != 6 {
        bail!("usage: fuzz_host IFNAME CHUNK_BYTES CHUNKS_PER_SLOT FRAMES SEED [RACE_ROUNDS]");
    }
    let race_rounds: u64 = match a.get(5) {
        Some(v) => v.parse().context("RACE_ROUNDS")?,
        None => 0,
    };
    let ifname = &a[0];
    let cb: u32 = a[1].parse().context("CHUNK_BYTES")?;
    let cps: u32 = a[2].parse().context("CHUNKS_PER_SLOT")?;
    let frames: u64 = a[3].parse().context("FRAMES")?;
    let seed: u64 = a[4].parse().context("SEED")?;

    let dp = HostDatapath::attach(ifname, cb, cps).context("attaching the datapath")?;
    ensure!(
        wire::ERAR_MAX_SLOTS as usize == SLOTS,
        "ERAR_MAX_SLOTS is {}, this fuzzer models {SLOTS} slots",
        wire::ERAR_MAX_SLOTS
    );
    // Each slot's state, found as the program finds it: through its arrays
    // of maps (attach installed every slot's inner maps).
    let maps = prog_maps(dp.prog_fd().as_raw_fd())?;
    let slots = (0..SLOTS as u32)
        .map(|s| SlotState::open(&maps, s, cb, cps))
        .collect::<Result<Vec<_>>>()?;
    let mut ids: Vec<u32> = slots.iter().flat_map(|s| s.ids).collect();
    ids.sort_unstable();
    ids.dedup();
    ensure!(
        ids.len() == SLOTS * OUTERS.len(),
        "slots share inner maps: {:?}",
        slots.iter().map(|s| s.ids).collect::<Vec<_>>()
    );
    let stats = stat_array(&dp.stats()?);
    let slot_bytes = dp.slot_bytes();
    let mut fz = Fuzzer {
        dp,
        model: Model {
            cb: cb as usize,
            cps: cps as usize,
            ctl: [Ctl::default(); SLOTS],
            state: vec![0; SLOTS * cps as usize],
            buf: vec![0; SLOTS * slot_bytes],
        },
        gen: Gen {
            edges: {
                let mut r = Rng::new(!seed);
                (0..2 * 4096)
                    .flat_map(|_| {
                        r.pick(&[0x8000_0000u32, 0x7fff_ffff, 1, u32::MAX, 0, 0x8000_0001])
                            .to_le_bytes()
                    })
                    .collect()
            },
            rng: Rng::new(seed),
            history: Vec::new(),
            hist_next: 0,
        },
        slots,
        maps,
        seqs: [0; SLOTS],
        ctl_snapshot: Vec::new(),
        before_ctl: [Ctl::default(); SLOTS],
        before_word: None,
        before_chunk: Vec::new(),
        stats,
        mismatches: 0,
        reported: 0,
        root_oob_accepts: 0,
        out: vec![0u8; 3 * 4096 + 8192],
    };
    // The model starts from the kernel's state (attach disarmed everything;
    // no slot is configured yet).
    fz.sync_buf();
    fz.model.state = fz.real_state();
    for s in 0..SLOTS {
        let real = fz.real_ctl(s);
        let c = &mut fz.model.ctl[s];
        (c.comm_id, c.token, c.armed) = (real.comm_id, real.token, real.armed);
        (c.ring_pos, c.ring_size) = (real.ring_pos, real.ring_size);
        ensure!(
            real.armed == 0,
            "slot {s} armed right after attach: {real:?}"
        );
    }
    fz.settle()?;
    println!(
        "fuzz_host: {ifname} (ifindex {}), chunk_bytes {cb}, chunks_per_slot {cps}, {frames} frames, seed {seed}",
        fz.dp.ifindex()
    );

    // class -> outcome label -> frames
    let mut table: Vec<BTreeMap<&'static str, u64>> = vec![BTreeMap::new(); CLASSES.len()];
    let mut per_class = [0u64; CLASSES.len()];
    let (mut pass, mut einval, mut datapath, mut accepted) = (0u64, 0u64, 0u64, 0u64);
    // Coverage: lengths 0..=4000 seen; frames spilling into fragments (by
    // verdict); accepted frames by (kind, op).
    let mut lengths = vec![false; 4001];
    let mut frags = BTreeMap::<String, u64>::new();
    let mut by_op = BTreeMap::<String, u64>::new();
    // Served NACKs by the frame they were answered with.
    let mut nack_by_op = BTreeMap::<String, u64>::new();
    // Datapath frames of kind PING / PONG by outcome ("answered" or the
    // counter that dropped them); answered PINGs a prober would not send.
    let mut ping_outcomes = BTreeMap::<&str, u64>::new();
    let mut pong_outcomes = BTreeMap::<&str, u64>::new();
    let mut ping_oddities = BTreeMap::<&str, u64>::new();
    let mut ping_by_slot = BTreeMap::<&str, u64>::new();
    // The first frames go to slots that were never configured.
    let unconf = UNCONF_FRAMES.min(frames / 4);
    let mut oddities = BTreeMap::<&str, u64>::new();
    // PASSed frames that are UDP to ERAR_UDP_PORT all the same: (count,
    // first frame), by why they are not datapath frames.
    let mut passed_to_port = BTreeMap::<&str, (u64, String)>::new();
    let mut epoch_left = 0u64;
    let mut first = true;
    let mut run_time = std::time::Duration::ZERO;
    let t0 = Instant::now();
    for i in 0..frames {
        let class = if i < unconf {
            C_PING_UNCONF
        } else {
            fz.maintain(&mut epoch_left, &mut first)?;
            fz.gen.class()
        };
        let f = fz.gen.frame(&fz.model, class);
        let t = Instant::now();
        let (verdict, delta) = fz.one(CLASSES[class], &f)?;
        run_time += t.elapsed();
        per_class[class] += 1;
        if let Some(l) = lengths.get_mut(f.len()) {
            *l = true;
        }
        if f.len() > LINEAR_MAX {
            let k = if delta[wire::ERAR_STAT_RX_RS as usize] + delta[wire::ERAR_STAT_RX_AG as usize]
                > 0
            {
                "accepted".to_string()
            } else {
                format!("{verdict:?}")
            };
            *frags.entry(k).or_default() += 1;
        }
        if delta[wire::ERAR_STAT_NACK_SERVED as usize] > 0 {
            let kind = if f[O_KIND] == NACK | RS { "RS" } else { "AG" };
            let op = if f[O_OP] as u32 == OP_BCAST {
                "bcast".to_string()
            } else {
                "allreduce".to_string()
            };
            *nack_by_op
                .entry(format!("{kind}/{op}/step{}", f[O_STEP].min(3)))
                .or_default() += 1;
        }
        if delta[wire::ERAR_STAT_RX_RS as usize] + delta[wire::ERAR_STAT_RX_AG as usize] > 0 {
            let kind = if f[O_KIND] == RS { "RS" } else { "AG" };
            let op = if f[O_OP] as u32 == OP_BCAST {
                "bcast".to_string()
            } else {
                format!("op{}", f[O_OP])
            };
            *by_op.entry(format!("{kind}/{op}")).or_default() += 1;
            // Accepted although not as a sender builds it (see the report).
            let cbu = cb as usize;
            for (what, odd) in [
                ("reserved!=0", le32(&f, O_RESERVED) != 0),
                ("trailing bytes", f.len() > PL + cbu),
                (
                    "IPv4 total length wrong",
                    be16(&f, 16) as usize != 20 + 8 + HDR + cbu,
                ),
                ("UDP length wrong", be16(&f, 38) as usize != 8 + HDR + cbu),
                ("IPv4 checksum wrong", ipv4_csum(&f[14..34]) != 0),
                ("group dst MAC", f[0] & 1 != 0),
            ] {
                if odd {
                    *oddities.entry(what).or_default() += 1;
                }
            }
        }
        let row = &mut table[class];
        match verdict {
            Verdict::Einval => {
                einval += 1;
                *row.entry("einval").or_default() += 1;
            }
            Verdict::Pass => {
                pass += 1;
                *row.entry("pass").or_default() += 1;
                if let Some(why) = udp_to_port_not_datapath(&f) {
                    let e = passed_to_port
                        .entry(why)
                        .or_insert((0, hex(&f[..f.len().min(PL + 16)])));
                    e.0 += 1;
                }
            }
            _ => {
                datapath += 1;
                if f.len() >= PL && le32(&f, O_MAGIC) == MAGIC {
                    fz.gen.remember(&f);
                }
                if f.len() > O_KIND && (f[O_KIND] == PING || f[O_KIND] == PONG) {
                    let outcome = if delta[wire::ERAR_STAT_PING as usize] > 0 {
                        "answered"
                    } else {
                        (0..NR)
                            .find(|&k| delta[k] != 0 && TERMINAL.contains(&(k as u32)))
                            .map_or("?", stat_name)
                    };
                    let m = if f[O_KIND] == PING {
                        &mut ping_outcomes
                    } else {
                        &mut pong_outcomes
                    };
                    *m.entry(outcome).or_default() += 1;
                }
                if delta[wire::ERAR_STAT_PING as usize] > 0 {
                    let c = fz.before_ctl[le16(&f, O_SLOT) as usize];
                    let state = match (c.ring_size, c.seq()) {
                        (0, _) => "unconfigured",
                        (_, None) => "unarmed",
                        (_, Some(_)) => "armed",
                    };
                    *ping_by_slot.entry(state).or_default() += 1;
                    for (what, odd) in [
                        ("group dst MAC (the answer's source)", f[0] & 1 != 0),
                        ("IPv4 checksum wrong", ipv4_csum(&f[14..34]) != 0),
                        (
                            "UDP source port the datapath's (answer dropped there)",
                            be16(&f, 34) == UDP_PORT,
                        ),
                        ("slot unconfigured (comm_id 0, token 0)", c.ring_size == 0),
                    ] {
                        if odd {
                            *ping_oddities.entry(what).or_default() += 1;
                        }
                    }
                }
                for (k, &d) in delta.iter().enumerate() {
                    if d != 0 {
                        *row.entry(stat_name(k)).or_default() += d;
                    }
                }
                if delta[wire::ERAR_STAT_RX_RS as usize] + delta[wire::ERAR_STAT_RX_AG as usize] > 0
                {
                    accepted += 1;
                }
            }
        }
        if (i + 1) % 200_000 == 0 {
            eprintln!(
                "fuzz_host: {} frames, {:.0} frames/s, {} mismatches",
                i + 1,
                (i + 1) as f64 / t0.elapsed().as_secs_f64(),
                fz.mismatches
            );
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let race = if race_rounds > 0 {
        race_phase(&mut fz, race_rounds, &mut epoch_left, &mut first)?
    } else {
        String::from("race=0")
    };

    // Table: one row per class, one column per outcome.
    let cols: [&str; 24] = [
        "einval",
        "pass",
        "drop_short",
        "drop_magic",
        "drop_version",
        "drop_malformed",
        "drop_slot",
        "drop_seq",
        "drop_comm",
        "drop_token",
        "drop_op",
        "drop_chunk",
        "drop_step",
        "dup",
        "drop_state",
        "ag_last",
        "nack_skip",
        "tx",
        "nack_served",
        "ping",
        "rx_rs",
        "rx_ag",
        "finished",
        "complete",
    ];
    let short = |c: &str| {
        c.trim_start_matches("drop_")
            .chars()
            .take(7)
            .collect::<String>()
    };
    let mut hdr = format!("{:<11}{:>8}", "class", "frames");
    for c in cols {
        hdr += &format!("{:>8}", short(c));
    }
    println!("counter table (columns after `frames`: frames that raised each counter; drop_* shown without the prefix):");
    println!("{hdr}");
    let mut totals = BTreeMap::<&str, u64>::new();
    for (k, row) in table.iter().enumerate() {
        let mut line = format!("{:<11}{:>8}", CLASSES[k], per_class[k]);
        for c in cols {
            let v = row.get(c).copied().unwrap_or(0);
            *totals.entry(c).or_default() += v;
            line += &format!("{v:>8}");
        }
        println!("{line}");
    }
    let mut line = format!("{:<11}{:>8}", "TOTAL", frames);
    for c in cols {
        line += &format!("{:>8}", totals.get(c).copied().unwrap_or(0));
    }
    println!("{line}");
    for (k, row) in table.iter().enumerate() {
        for c in row.keys() {
            ensure!(
                cols.contains(c),
                "class {} hit unexpected counter {c}",
                CLASSES[k]
            );
        }
    }
    // Every frame accounted for exactly once, over the whole run.
    let terminal: u64 = TERMINAL
        .iter()
        .map(|&i| totals.get(stat_name(i as usize)).copied().unwrap_or(0))
        .sum();
    let tx = totals.get("tx").copied().unwrap_or(0);
    let nack_served = totals.get("nack_served").copied().unwrap_or(0);
    let nack_skip = totals.get("nack_skip").copied().unwrap_or(0);
    let ping = totals.get("ping").copied().unwrap_or(0);
    if terminal + tx + nack_served + ping != datapath || pass + einval + datapath != frames {
        println!(
            "ACCOUNTING TOTALS: datapath {datapath}, terminal {terminal} + tx {tx} + nack_served {nack_served} + ping {ping}; pass {pass} einval {einval} frames {frames}"
        );
        fz.mismatches += 1;
    }
    println!(
        "coverage: {} of the lengths 0..=4000; {} frames longer than the linear part ({LINEAR_MAX} B, rest in fragments): {frags:?}",
        lengths.iter().filter(|&&b| b).count(),
        frags.values().sum::<u64>()
    );
    println!("accepted frames by kind/wire_op: {by_op:?}");
    let nack_class = |c: usize, k: &str| table[c].get(k).copied().unwrap_or(0);
    println!(
        "NACKs: {nack_served} served, {nack_skip} skipped (class nack: {} served / {} skipped of {}; \
         nack-miss: {} served / {} skipped of {}); served by kind/op/step: {nack_by_op:?}",
        nack_class(C_NACK, "nack_served"),
        nack_class(C_NACK, "nack_skip"),
        per_class[C_NACK],
        nack_class(C_NACK_MISS, "nack_served"),
        nack_class(C_NACK_MISS, "nack_skip"),
        per_class[C_NACK_MISS],
    );
    let ping_out = |k: &str| ping_outcomes.get(k).copied().unwrap_or(0);
    let (ping_drop_comm, ping_drop_token) = (ping_out("drop_comm"), ping_out("drop_token"));
    println!(
        "PINGs: {ping} answered (class ping: {} answered / {} dropped of {}; ping-bad: {} / {} of {}; \
         ping-unconf: {} / {} of {}); answered by slot: {ping_by_slot:?}; datapath frames of kind PING by outcome: {ping_outcomes:?}; \
         of kind PONG: {pong_outcomes:?}",
        nack_class(C_PING, "ping"),
        per_class[C_PING] - nack_class(C_PING, "ping"),
        per_class[C_PING],
        nack_class(C_PING_BAD, "ping"),
        per_class[C_PING_BAD] - nack_class(C_PING_BAD, "ping"),
        per_class[C_PING_BAD],
        nack_class(C_PING_UNCONF, "ping"),
        per_class[C_PING_UNCONF] - nack_class(C_PING_UNCONF, "ping"),
        per_class[C_PING_UNCONF],
    );
    println!(
        "answered PINGs a prober would not send (not validated by erar_xdp): {ping_oddities:?}"
    );
    println!(
        "accepted frames of broadcasts armed with root >= ring size (unspecified): {}",
        fz.root_oob_accepts
    );
    println!("accepted frames a sender would not build (not validated by erar_xdp): {oddities:?}");
    for (why, (n, ex)) in &passed_to_port {
        println!("passed uncounted, UDP to port {UDP_PORT} but {why}: {n} frames, e.g. {ex}");
    }
    println!(
        "RESULT frames={frames} datapath={datapath} pass={pass} einval={einval} accepted={accepted} \
         nack_served={nack_served} nack_skip={nack_skip} ping={ping} \
         ping_drop_comm={ping_drop_comm} ping_drop_token={ping_drop_token} \
         rate={:.0} run_rate={:.0} {race} mismatches={}",
        frames as f64 / wall,
        frames as f64 / run_time.as_secs_f64(),
        fz.mismatches
    );
    Ok(fz.mismatches)
}

// ---- Race phase ----------------------------------------------------------------------

/// Handed from the main thread to the racing worker.
struct RaceShared {
    /// Round published by the main thread (u64::MAX: stop).
    go: AtomicU64,
    /// Round the worker has finished.
    done: AtomicU64,
    frame: Mutex<Vec<u8>>,
    result: Mutex<(RunRes, Vec<u8>, Instant, Instant)>,
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET and sched_setaffinity
    // only touch it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// Spins (then yields) until `cond`.
fn spin_until(cond: impl Fn() -> bool) {
    let mut n = 0u32;
    while !cond() {
        n += 1;
        if n < 20_000 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// One round on two CPUs: `mine` on this thread, `theirs` on the worker,
/// released by one store. Returns both outcomes and whether the runs
/// overlapped in time.
fn race_pair(
    fz: &mut Fuzzer,
    sh: &RaceShared,
    round: u64,
    mine: &[u8],
    theirs: &[u8],
) -> (Outcome, Outcome, bool) {
    *sh.frame.lock().unwrap() = theirs.to_vec();
    sh.go.store(round, Ordering::Release);
    let a = Instant::now();
    let r = fz.prog_run(mine);
    let b = Instant::now();
    let o = match r {
        Ok((_, len)) => fz.out[..len.min(fz.out.len())].to_vec(),
        Err(_) => Vec::new(),
    };
    spin_until(|| sh.done.load(Ordering::Acquire) == round);
    let (wr, wo, wa, wb) =
        std::mem::replace(&mut *sh.result.lock().unwrap(), (Err(0), Vec::new(), a, a));
    ((r, o), (wr, wo), a < wb && wa < b)
}

fn verdict_of(r: &RunRes) -> Option<Verdict> {
    match *r {
        Err(e) if e == libc::EINVAL => Some(Verdict::Einval),
        Ok((XDP_DROP, _)) => Some(Verdict::Drop),
        Ok((XDP_PASS, _)) => Some(Verdict::Pass),
        Ok((XDP_TX, _)) => Some(Verdict::Tx),
        _ => None,
    }
}

/// Outcomes of the NACK-vs-data race rounds.
#[derive(Default)]
struct NackRace {
    rounds: u64,
    overlapped: u64,
    /// Rounds whose data frame changed the chunk's stage.
    moved: u64,
    outcomes: BTreeMap<&'static str, u64>,
}

/// One round of a valid data frame racing with a NACK for the same chunk
/// that names the frame this host last sent before the data frame's stage
/// change or the one it sends with it. The data frame must have exactly its
/// effect (a NACK changes nothing). The NACK must be answered as before the
/// change (payload: the chunk before) or as after it (payload: the chunk
/// after), i.e. always with a payload that matches the (kind, step) it is
/// labelled with; or dropped with nack_skip, untouched (it read the stage
/// word while `busy`), or rewritten with every payload byte the chunk's old
/// or new one (the change overtook its copy).
fn race_nack_round(fz: &mut Fuzzer, sh: &RaceShared, round: u64, st: &mut NackRace) -> Result<()> {
    let f = fz.gen.frame(&fz.model, C_VALID);
    let target = fz.before(&f);
    let cb = fz.model.cb;
    let (slot, chunk) = (le16(&f, O_SLOT) as usize, le32(&f, O_CHUNK));
    let ls_before = target.and_then(|_| fz.model.last_sent_now(slot, chunk));
    let pd = fz.model.run(&f);
    let ls_after = target.and_then(|_| fz.model.last_sent_now(slot, chunk));
    let moved = pd.ctr[wire::ERAR_STAT_RX_RS as usize] + pd.ctr[wire::ERAR_STAT_RX_AG as usize] > 0;
    let r = &mut fz.gen.rng;
    let named: Vec<(u8, u8)> = [ls_before, ls_after].into_iter().flatten().collect();
    let (k, s) = if named.is_empty() {
        (r.pick(&[RS, AG]), r.below(4) as u8)
    } else {
        r.pick(&named)
    };
    let mut g = f.clone();
    g[O_KIND] = NACK | k;
    g[O_STEP] = s;
    r.fill(&mut g[PL..]);
    let nack_on_worker = r.chance(1, 2);
    // The NACK's outcome against the chunk as the data frame leaves it, and
    // as it was before (the NACK path reads only the stage word and chunk).
    let p_after = fz.model.run(&g);
    let after_chunk = target.map(|idx| {
        let after = (
            fz.model.state[idx],
            fz.model.buf[idx * cb..(idx + 1) * cb].to_vec(),
        );
        fz.model.state[idx] = fz.before_word.unwrap();
        fz.model.buf[idx * cb..(idx + 1) * cb].copy_from_slice(&fz.before_chunk);
        after
    });
    let p_before = fz.model.run(&g);
    if let (Some(idx), Some((w, b))) = (target, &after_chunk) {
        fz.model.state[idx] = *w;
        fz.model.buf[idx * cb..(idx + 1) * cb].copy_from_slice(b);
    }

    let (data, nack, overlap) = if nack_on_worker {
        race_pair(fz, sh, round, &f, &g)
    } else {
        let (n, d, o) = race_pair(fz, sh, round, &g, &f);
        (d, n, o)
    };
    st.rounds += 1;
    st.overlapped += overlap as u64;
    st.moved += moved as u64;
    let nv = verdict_of(&nack.0);
    let fits = |p: &Prediction| nv == Some(p.verdict) && nack.1 == p.out;
    let skip = |out: Vec<u8>| {
        let mut ctr = [0u64; NR];
        ctr[wire::ERAR_STAT_NACK_SKIP as usize] = 1;
        Prediction {
            verdict: Verdict::Drop,
            ctr,
            out,
            events: Vec::new(),
        }
    };
    let (label, chosen) = if fits(&p_before) {
        let l = if p_before.verdict == Verdict::Tx {
            "served-before"
        } else {
            "skipped"
        };
        (l, p_before)
    } else if fits(&p_after) {
        let l = if p_after.verdict == Verdict::Tx {
            "served-after"
        } else {
            "skipped"
        };
        (l, p_after)
    } else if moved && nv == Some(Verdict::Drop) && nack.1 == g {
        ("skipped-busy", skip(g.clone()))
    } else if moved
        && p_before.verdict == Verdict::Tx
        && nv == Some(Verdict::Drop)
        && nack.1.len() == p_before.out.len()
        && nack.1[..PL] == p_before.out[..PL]
        && after_chunk.as_ref().is_some_and(|(_, new)| {
            nack.1[PL..]
                .iter()
                .zip(fz.before_chunk.iter().zip(new))
                .all(|(x, (o, n))| x == o || x == n)
        })
    {
        ("skipped-overtaken", skip(nack.1.clone()))
    } else {
        let out = &nack.1;
        let first = out.iter().zip(&p_before.out).position(|(a, b)| a != b);
        fz.mismatch(
            "race-nack",
            &g,
            "NACK outcome",
            format!(
                "{:?} len {} (first difference to the answer before the data frame at {first:?}); \
                 neither the answer before ({:?}) nor after ({:?}) nor a nack_skip; racing data frame {}",
                nack.0,
                out.len(),
                p_before.verdict,
                p_after.verdict,
                hex(&f)
            ),
        );
        ("MISMATCH", p_before)
    };
    *st.outcomes.entry(label).or_default() += 1;
    let (delta, events) = fz.observe()?;
    fz.check(
        "race-nack",
        &f,
        target,
        &[pd, chosen],
        vec![data, nack],
        delta,
        events,
        true,
    )?;
    Ok(())
}

/// Every round, the same frame runs on two CPUs at once (the main thread and
/// a worker, released by one store): duplicates racing for a chunk's stage.
/// The model predicts the frame applied twice in a row; whichever copy wins,
/// the kernel must end in exactly that state, with exactly those counters.
/// A quarter of the rounds race a data frame with a NACK instead
/// ([`race_nack_round`]).
fn race_phase(
    fz: &mut Fuzzer,
    rounds: u64,
    epoch_left: &mut u64,
    first: &mut bool,
) -> Result<String> {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let prog_fd = fz.dp.prog_fd().as_raw_fd();
    let ifindex = fz.dp.ifindex();
    let sh = RaceShared {
        go: AtomicU64::new(0),
        done: AtomicU64::new(0),
        frame: Mutex::new(Vec::new()),
        result: Mutex::new((Err(0), Vec::new(), Instant::now(), Instant::now())),
    };
    let (mut overlapped, mut accepted, mut accepted_overlapped) = (0u64, 0u64, 0u64);
    let mut nr = NackRace::default();
    let t0 = Instant::now();
    let before = fz.mismatches;
    std::thread::scope(|s| -> Result<()> {
        let sh = &sh;
        s.spawn(move || {
            if cpus > 1 {
                pin_to_cpu(1);
            }
            let mut out = vec![0u8; 3 * 4096 + 8192];
            let mut last = 0u64;
            loop {
                spin_until(|| sh.go.load(Ordering::Acquire) != last);
                last = sh.go.load(Ordering::Acquire);
                if last == u64::MAX {
                    return;
                }
                let f = sh.frame.lock().unwrap().clone();
                let a = Instant::now();
                let r = prog_run_raw(prog_fd, ifindex, &f, &mut out);
                let b = Instant::now();
                let o = match r {
                    Ok((_, len)) => out[..len.min(out.len())].to_vec(),
                    Err(_) => Vec::new(),
                };
                *sh.result.lock().unwrap() = (r, o, a, b);
                sh.done.store(last, Ordering::Release);
            }
        });
        if cpus > 1 {
            pin_to_cpu(0);
        }
        let res = (|| -> Result<()> {
            for round in 1..=rounds {
                fz.maintain(epoch_left, first)?;
                if fz.gen.rng.chance(1, 4) {
                    race_nack_round(fz, sh, round, &mut nr)?;
                    continue;
                }
                let class = if fz.gen.rng.chance(7, 10) {
                    C_VALID
                } else {
                    fz.gen.class()
                };
                let f = fz.gen.frame(&fz.model, class);
                let target = fz.before(&f);
                let p1 = fz.model.run(&f);
                let p2 = fz.model.run(&f);
                let (mine, theirs, overlap) = race_pair(fz, sh, round, &f, &f);
                overlapped += overlap as u64;
                let model_acc = p1.ctr[wire::ERAR_STAT_RX_RS as usize]
                    + p1.ctr[wire::ERAR_STAT_RX_AG as usize]
                    > 0;
                if model_acc {
                    accepted += 1;
                    accepted_overlapped += overlap as u64;
                }
                let (delta, events) = fz.observe()?;
                let name = if class == C_VALID {
                    "race-valid"
                } else {
                    "race-mixed"
                };
                fz.check(
                    name,
                    &f,
                    target,
                    &[p1, p2],
                    vec![mine, theirs],
                    delta,
                    events,
                    false,
                )?;
            }
            Ok(())
        })();
        sh.go.store(u64::MAX, Ordering::Release);
        res
    })?;
    let secs = t0.elapsed().as_secs_f64();
    let same = rounds - nr.rounds;
    println!(
        "race: {same} rounds of one frame twice (2 copies each, {cpus} CPUs), {overlapped} with overlapping BPF_PROG_RUN calls; \
         {accepted} rounds of an acceptable frame ({accepted_overlapped} overlapping); {:.0} rounds/s; {} mismatches",
        rounds as f64 / secs,
        fz.mismatches - before
    );
    println!(
        "race: {} rounds of a data frame against a NACK for its chunk ({} overlapping, {} changing the chunk's stage); NACK outcomes {:?}",
        nr.rounds, nr.overlapped, nr.moved, nr.outcomes
    );
    let served = |k: &str| nr.outcomes.get(k).copied().unwrap_or(0);
    Ok(format!(
        "race={rounds} race_overlapped={overlapped} race_accepted={accepted} race_nack={} \
         race_nack_served={}",
        nr.rounds,
        served("served-before") + served("served-after")
    ))
}
