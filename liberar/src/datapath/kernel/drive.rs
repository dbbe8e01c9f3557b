//! Driving a slot through one operation: its route ([`SlotRoute`], set by
//! [`HostDatapath::configure_slot`]), arming and disarming it, its barrier
//! in the kernel (see "Barrier" in erar_wire.h: this host joins the
//! operation with its call key and tells its predecessor,
//! [`HostDatapath::join`]; its XDP learns from the successor's READY frames
//! how many hosts down the ring have joined and whether a key differs,
//! which [`HostDatapath::barrier`] reads), reading its progress, and
//! waiting for it to complete, NACKing what goes missing
//! ([`HostDatapath::wait`]).

use std::net::Ipv4Addr;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};

use super::frame::{frame_template, template_words};
use super::host::HostDatapath;
use super::slot::SlotMaps;
use super::wire;

/// The trip of `wire_op`'s frames around a ring of `n` (`struct
/// erar_trip`, see erar_wire.h): the one place where broadcast and
/// allreduce differ, so that XDP's hop arithmetic (erar_trip.h) and
/// [`starts_here`] have no branch on the op. Broadcast: every chunk starts
/// at the root and only travels as all-gather frames. Allreduce of
/// `chunks`: position p starts the run of chunks p*r .. p*r + r - 1 (r =
/// ceil(chunks / n), a block of the buffer; the last run may be shorter or
/// empty), each takes n-1 reduce-scatter hops, and its all-gather starts
/// where the reduction finished (one before its origin).
pub(super) fn trip_of(wire_op: u32, n: u32, root: u32, chunks: u32) -> wire::erar_trip {
    if wire_op == wire::ERAR_OP_BCAST {
        wire::erar_trip {
            origin_run: wire::ERAR_NO_CHUNK,
            origin_mod: 1,
            origin_base: root,
            rs_hops: 0,
            ag_shift: 0,
            start_kind: wire::ERAR_KIND_AG,
            start_stages: !0,
        }
    } else {
        wire::erar_trip {
            origin_run: chunks.div_ceil(n.max(1)).max(1),
            origin_mod: n,
            origin_base: 0,
            rs_hops: n.saturating_sub(1),
            ag_shift: 1,
            start_kind: wire::ERAR_KIND_RS,
            start_stages: 1 << wire::ERAR_STAGE_NONE,
        }
    }
}

/// How many of `chunks` start at ring position `pos` on `trip` (what
/// ERAR_INJECT_START sends there, as erar_trip.h's start_chunk() counts).
pub(super) fn starts_here(trip: &wire::erar_trip, pos: u32, chunks: u32) -> u32 {
    let run = trip.origin_run.max(1);
    let first =
        u64::from(pos.wrapping_sub(trip.origin_base) % trip.origin_mod.max(1)) * u64::from(run);
    u64::from(chunks).saturating_sub(first).min(u64::from(run)) as u32
}

/// The trip of a slot's armed operation, as arm() wrote it: what the ring's
/// recovery asks of a chunk, answered from the same data erar_trip.h reads
/// (so the host, like the XDP program, never asks which collective it is).
#[derive(Clone, Copy, Debug)]
pub struct Trip(wire::erar_trip);

impl Trip {
    /// The trip a slot's control block holds (written by arm()).
    pub(super) fn from_ctl(ctl: &wire::erar_slot_ctl) -> Trip {
        Trip(ctl.trip)
    }

    /// What the host at ring position `pos` of a ring of `n` waits for next
    /// for `chunk`, given its stage: `Some(false)` a reduce-scatter frame,
    /// `Some(true)` an all-gather frame, `None` nothing (final value held, a
    /// frame being applied, or the all-gather starts there): erar_trip.h's
    /// awaits() from its chunk_dist() and ag_hop().
    pub fn awaits(&self, n: u32, pos: u32, chunk: u32, stage: u32) -> Option<bool> {
        self.awaited(n, pos, chunk, stage)
            .map(|(kind, _)| kind == wire::ERAR_KIND_AG)
    }

    /// The frame (kind, step) the host at `pos` waits for next for `chunk`
    /// in `stage`: erar_trip.h's awaits().
    pub(super) fn awaited(&self, n: u32, pos: u32, chunk: u32, stage: u32) -> Option<(u32, u32)> {
        let t = &self.0;
        if stage == wire::ERAR_STAGE_BUSY || stage == wire::ERAR_STAGE_FINAL {
            return None;
        }
        let (d, h) = self.place(n, pos, chunk);
        if stage == wire::ERAR_STAGE_NONE && d.wrapping_sub(1) < t.rs_hops {
            return Some((wire::ERAR_KIND_RS, d - 1));
        }
        (h != 0).then(|| (wire::ERAR_KIND_AG, h - 1))
    }

    /// The frame (kind, step) the host at `pos` last sent for `chunk` in
    /// `stage`, or None if it sent none (yet) or the trip ended there:
    /// erar_trip.h's last_sent().
    pub(super) fn last_sent(&self, n: u32, pos: u32, chunk: u32, stage: u32) -> Option<(u32, u32)> {
        let t = &self.0;
        let (d, h) = self.place(n, pos, chunk);
        if d == 0 && stage < 32 && (t.start_stages >> stage) & 1 != 0 {
            return Some((t.start_kind, 0));
        }
        if stage == wire::ERAR_STAGE_REDUCED && d >= 1 && d < t.rs_hops {
            return Some((wire::ERAR_KIND_RS, d));
        }
        (stage == wire::ERAR_STAGE_FINAL && h + 2 <= n).then_some((wire::ERAR_KIND_AG, h))
    }

    /// The host's distance from the chunk's origin and its all-gather hop:
    /// erar_trip.h's chunk_dist() and ag_hop().
    fn place(&self, n: u32, pos: u32, chunk: u32) -> (u32, u32) {
        let t = &self.0;
        let origin = chunk / t.origin_run.max(1) % t.origin_mod.max(1) + t.origin_base;
        let d = if pos >= origin {
            pos - origin
        } else {
            pos + n - origin
        };
        let h = d + t.ag_shift;
        (d, if h >= n { h - n } else { h })
    }

    /// The chunk run `i` of a START injection sends (erar_trip.h's
    /// start_chunk()): `ERAR_NO_CHUNK` past the run.
    pub(super) fn start_chunk(&self, pos: u32, i: u32) -> u32 {
        let t = &self.0;
        if i >= t.origin_run {
            return wire::ERAR_NO_CHUNK;
        }
        pos.wrapping_sub(t.origin_base) % t.origin_mod.max(1) * t.origin_run + i
    }

    /// Where `chunk` comes in its origin's run: the chunks of every run go
    /// out in that order, all runs at once, so a chunk's place is about
    /// when it goes out (what the NACK frontier compares, see
    /// [`HostDatapath::wait`]). A broadcast's one run: the chunk itself.
    pub(super) fn place_in_run(&self, chunk: u32) -> u32 {
        chunk % self.0.origin_run.max(1)
    }

    /// Whether the frame a host whose chunk is in `stage` last sent for it
    /// was an all-gather frame (a final value, or a broadcast's data, which
    /// only travels as all-gather frames).
    pub fn sent_ag(&self, stage: u32) -> bool {
        self.0.start_kind == wire::ERAR_KIND_AG || stage == wire::ERAR_STAGE_FINAL
    }
}

/// Where this host sits in one ring, and where it sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotRoute {
    pub self_mac: [u8; 6],
    pub self_ip: Ipv4Addr,
    /// The next host of the ring (position `(ring_pos + 1) % ring_size`).
    pub next_mac: [u8; 6],
    pub next_ip: Ipv4Addr,
    /// The previous host of the ring, where this host's NACKs go.
    pub prev_mac: [u8; 6],
    pub prev_ip: Ipv4Addr,
    pub ring_pos: u32,
    pub ring_size: u32,
    pub comm_id: u32,
    /// Random per ring: frames of another ring (or a stale one) with the same
    /// slot and comm_id are dropped.
    pub token: u32,
}

/// How [`HostDatapath::wait`] repairs losses and when it gives up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Patience {
    /// The NACK period (see [`HostDatapath::wait`]); `None`: no NACKs.
    pub nack_after: Option<Duration>,
    /// After a pause this long, stop waiting.
    pub quiet: Duration,
    /// How long the wait looks again and again, yielding the CPU between
    /// looks, before it sleeps (see `ERAR_POLL_US`).
    pub poll: Duration,
    /// Whether that budget counts from the last progress rather than from
    /// the wait's start: the only rank of its communicator on its host
    /// polls while frames come and sleeps once they stall; one whose
    /// host's other ranks need the CPUs (the node path) polls for `poll`
    /// in all.
    pub poll_renewed: bool,
}

/// A pause of progress this many NACK periods long NACKs every missing
/// chunk, also those above the frontier (see [`HostDatapath::wait`]).
const TAIL_NACK_PERIODS: u32 = 2;

/// What [`HostDatapath::wait`] saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Waited {
    /// Every chunk holds its final value on this host.
    pub complete: bool,
    /// NACK bursts sent, and chunks they asked about.
    pub nacks: u32,
    pub nack_chunks: u64,
    /// Starting frames sent while waiting (see [`HostDatapath::restart`]).
    pub restarted: u64,
}

impl HostDatapath {
    /// The trip of the operation armed on `slot` (see [`Trip`]).
    pub fn trip(&self, slot: u32) -> Result<Trip> {
        Ok(armed_trip(&*self.slot_maps(slot)?))
    }

    /// Chunks of the armed operation whose final value is in this host's slot.
    pub fn done(&self, slot: u32) -> Result<u32> {
        Ok(self.slot_maps(slot)?.done().load(Ordering::Acquire))
    }

    /// Sets the slot's ring route (disarms it first). The Ethernet/IPv4/UDP
    /// header of every frame this host sends for the slot is computed here,
    /// checksum included, so XDP only copies it.
    pub fn configure_slot(&self, slot: u32, route: &SlotRoute) -> Result<()> {
        ensure!(
            route.ring_size >= 1 && route.ring_size <= wire::ERAR_MAX_RING,
            "ring size {} out of range 1..={}",
            route.ring_size,
            wire::ERAR_MAX_RING
        );
        ensure!(
            route.ring_pos < route.ring_size,
            "ring position {} >= ring size {}",
            route.ring_pos,
            route.ring_size
        );
        let m = self.slot_maps(slot)?;
        m.armed().store(0, Ordering::SeqCst);
        // A new ring restarts seq at 1: its barrier starts from nothing.
        m.join_seq().store(0, Ordering::SeqCst);
        m.ready().store(0, Ordering::SeqCst);
        // Nobody sleeps on it yet (a rank of its last ring may have died
        // asleep: XDP would post events nobody needs).
        m.sleeping().store(0, Ordering::SeqCst);
        let ctl = m.ctl();
        let to_next = template_words(&frame_template(
            (route.self_mac, route.self_ip),
            (route.next_mac, route.next_ip),
            self.chunk_bytes,
        ));
        let to_prev = template_words(&frame_template(
            (route.self_mac, route.self_ip),
            (route.prev_mac, route.prev_ip),
            self.chunk_bytes,
        ));
        // A new ring restarts seq at 1: stages left by the slot's previous
        // ring must not read as this ring's.
        for word in m.states(self.chunks_per_slot) {
            word.store(0, Ordering::Relaxed);
        }
        // SAFETY: the slot is disarmed; XDP drops every data frame for it
        // before reading these fields, and `armed` is published with SeqCst
        // later. Only a liveness probe reads comm_id and token of a disarmed
        // slot: one arriving mid-write may be answered or dropped wrongly,
        // which changes nothing but that probe's answer.
        unsafe {
            std::ptr::addr_of_mut!((*ctl).tmpl).write_volatile(to_next);
            std::ptr::addr_of_mut!((*ctl).nack_tmpl).write_volatile(to_prev);
            std::ptr::addr_of_mut!((*ctl).comm_id).write_volatile(route.comm_id);
            std::ptr::addr_of_mut!((*ctl).token).write_volatile(route.token);
            std::ptr::addr_of_mut!((*ctl).ring_pos).write_volatile(route.ring_pos);
            std::ptr::addr_of_mut!((*ctl).ring_size).write_volatile(route.ring_size);
            std::ptr::addr_of_mut!((*ctl).ifindex).write_volatile(self.ifindex);
        }
        Ok(())
    }

    /// Arms `slot` for operation `seq` (non-zero, a new value for every
    /// operation on the slot) of `chunks` chunks combined with `wire_op`
    /// (`root`: the broadcast root's ring position; `flags_from`: the
    /// first chunk of flag bits of an `ERAR_OP_ADD_I32_FLAGS` operation;
    /// each ignored by the other ops).
    /// An allreduce's frames circulate if
    /// [`InjectPacing::circulate`](super::host::InjectPacing::circulate) says
    /// so (see [`HostDatapath::inject`]).
    /// `done` is reset before `armed` is published, so no frame of this
    /// operation can be counted against the previous one's progress.
    pub fn arm(
        &self,
        slot: u32,
        seq: u32,
        chunks: u32,
        wire_op: u8,
        root: u32,
        flags_from: u32,
    ) -> Result<()> {
        self.arm_reading(slot, seq, chunks, wire_op, root, flags_from, (None, None))
    }

    /// [`HostDatapath::arm`] of an operation on registered buffers (see
    /// kernel/region.rs): this host reads what it sends before it has
    /// received anything (a broadcast root's chunks, an allreduce's
    /// contribution) from `input`, and keeps what it receives (and
    /// combines) in `output`; None: the slot buffer. XDP drops the frames
    /// of a chunk a region does not hold (`REGION_ERR`).
    #[allow(clippy::too_many_arguments)]
    pub fn arm_reading(
        &self,
        slot: u32,
        seq: u32,
        chunks: u32,
        wire_op: u8,
        root: u32,
        flags_from: u32,
        (input, output): (Option<RegionAt>, Option<RegionAt>),
    ) -> Result<()> {
        ensure!(seq != 0, "seq 0 is reserved");
        ensure!(
            chunks >= 1 && chunks <= self.chunks_per_slot,
            "chunk count {chunks} out of range 1..={}",
            self.chunks_per_slot
        );
        ensure!(
            wire_op as u32 >= wire::ERAR_OP_ADD_I32 && (wire_op as u32) < wire::ERAR_OP_NR,
            "unknown wire op {wire_op}"
        );
        let m = self.slot_maps(slot)?;
        let ctl = m.ctl();
        // SAFETY: written by configure_slot() only, never concurrently.
        let ring_size = unsafe { std::ptr::addr_of!((*ctl).ring_size).read_volatile() };
        ensure!(
            wire_op as u32 != wire::ERAR_OP_BCAST || root < ring_size,
            "broadcast root {root} outside the ring of {ring_size}"
        );
        let trip = trip_of(wire_op as u32, ring_size, root, chunks);
        let circulate =
            wire_op as u32 != wire::ERAR_OP_BCAST && self.circulate.load(Ordering::Relaxed);
        let armed = m.armed();
        armed.store(0, Ordering::SeqCst);
        // SAFETY: disarmed: XDP reads these only after seeing `armed`.
        unsafe {
            std::ptr::addr_of_mut!((*ctl).chunks).write_volatile(chunks);
            std::ptr::addr_of_mut!((*ctl).wire_op).write_volatile(wire_op as u32);
            std::ptr::addr_of_mut!((*ctl).root).write_volatile(root);
            std::ptr::addr_of_mut!((*ctl).flags_from).write_volatile(flags_from);
            std::ptr::addr_of_mut!((*ctl).trip).write_volatile(trip);
            std::ptr::addr_of_mut!((*ctl).circulate).write_volatile(u32::from(circulate));
            let (region, off) = input.map_or((0, 0), |(r, off)| (r + 1, off));
            std::ptr::addr_of_mut!((*ctl).in_region).write_volatile(region);
            std::ptr::addr_of_mut!((*ctl).in_off).write_volatile(off);
            let (region, off) = output.map_or((0, 0), |(r, off)| (r + 1, off));
            std::ptr::addr_of_mut!((*ctl).out_region).write_volatile(region);
            std::ptr::addr_of_mut!((*ctl).out_off).write_volatile(off);
        }
        m.done().store(0, Ordering::SeqCst);
        m.start_next().store(0, Ordering::SeqCst);
        armed.store(wire::ERAR_ARMED_BIT | seq as u64, Ordering::SeqCst);
        Ok(())
    }

    /// Stops the slot: every frame for it is dropped (and counted) from now on.
    pub fn disarm(&self, slot: u32) {
        if let Some(m) = self.held(slot) {
            m.armed().store(0, Ordering::SeqCst);
        }
    }

    /// Writes the stage (`enum erar_chunk_stage`, 2 bits: chunk c at bits
    /// 2*(c%4) of byte c/4, `chunks.div_ceil(4)` bytes) of each chunk of
    /// armed operation `seq` on this host; returns how many are not FINAL.
    pub fn stages(&self, slot: u32, seq: u32, chunks: u32, packed: &mut [u8]) -> Result<u32> {
        let m = self.slot_maps(slot)?;
        let states = m.states(self.chunks_per_slot);
        ensure!(
            chunks as usize <= states.len() && packed.len() >= (chunks as usize).div_ceil(4),
            "stages(): {chunks} chunks, {} states, {} bytes",
            states.len(),
            packed.len()
        );
        packed.fill(0);
        let mut not_final = 0;
        for (c, word) in states[..chunks as usize].iter().enumerate() {
            let stage = stage_of(word, seq) as u8 & 3;
            packed[c / 4] |= stage << (2 * (c % 4));
            not_final += u32::from(stage != wire::ERAR_STAGE_FINAL as u8);
        }
        Ok(not_final)
    }

    /// One past the highest place in its run ([`Trip::place_in_run`]) of
    /// a chunk of armed operation `seq` that is final on this host (0: none
    /// is). Every run's chunks go out in order, all runs at once, so a
    /// chunk missing below it for a while was most likely lost, while the
    /// ones above it are most likely still on their way.
    pub(super) fn frontier(&self, m: &SlotMaps, seq: u32, chunks: u32) -> u32 {
        let trip = armed_trip(m);
        let states = m.states(self.chunks_per_slot);
        states[..(chunks as usize).min(states.len())]
            .iter()
            .enumerate()
            .filter(|(_, w)| is_final(w, seq))
            .map(|(c, _)| trip.place_in_run(c as u32) + 1)
            .max()
            .unwrap_or(0)
    }

    /// Waits until operation `seq` of `slot` is complete on this host
    /// (`done == chunks`). Once per NACK period (`patience.nack_after`) it
    /// NACKs, depending on how long progress has paused: none, the chunks
    /// still missing below the frontier of one period earlier (later
    /// chunks overtook them that long ago); one period, those below the
    /// frontier now; `TAIL_NACK_PERIODS`, every missing chunk. Gives up
    /// (`complete: false`) once `done` has made no progress for
    /// `patience.quiet`: frames were lost (or are late) beyond what NACKs
    /// repaired, and the caller starts a recovery round.
    pub fn wait(&self, slot: u32, seq: u32, patience: Patience) -> Result<Waited> {
        let m = self.slot_maps(slot)?;
        let (ctl, armed, done) = (m.ctl(), m.armed(), m.done());
        let want = wire::ERAR_ARMED_BIT | seq as u64;
        ensure!(
            armed.load(Ordering::Acquire) == want,
            "wait on slot {slot} for seq {seq}, which is not armed"
        );
        // SAFETY: written before arming.
        let chunks = unsafe { std::ptr::addr_of!((*ctl).chunks).read_volatile() };
        let quiet = patience.quiet;
        // NACKs go out within 1.5x their period, silence is noticed within
        // 1.25x its own; waking more often costs the other ranks CPU.
        let tick = patience
            .nack_after
            .map_or(quiet / 4, |n| (n / 2).min(quiet / 4))
            .max(Duration::from_micros(50));
        let mut waited = Waited::default();
        let mut last = done.load(Ordering::Acquire);
        let started = Instant::now();
        let mut last_progress = started;
        let mut last_nack = last_progress;
        // The frontier one NACK period ago: chunks below it still missing
        // now were overtaken by later ones for that long.
        let mut old_frontier = 0u32;
        // Starting frames lost for good leave chunks unstarted on a ring
        // whose frames circulate: each pause this long starts a burst.
        let restart_after = patience.nack_after.unwrap_or(quiet / 4);
        let mut last_restart = last_progress;
        let nack = |below: Option<u32>, waited: &mut Waited| -> Result<()> {
            let asked = self.nack(slot, seq, below)?;
            if asked > 0 {
                waited.nack_chunks += u64::from(asked);
                waited.nacks += 1;
            }
            Ok(())
        };
        loop {
            let d = done.load(Ordering::Acquire);
            if d >= chunks {
                ensure!(
                    armed.load(Ordering::Acquire) == want,
                    "slot {slot} was re-armed while waiting for seq {seq}"
                );
                waited.complete = true;
                return Ok(waited);
            }
            let now = Instant::now();
            if d != last {
                last = d;
                last_progress = now;
            } else if now.duration_since(last_progress) >= quiet {
                return Ok(waited);
            }
            if let Some(after) = patience
                .nack_after
                .filter(|&after| now.duration_since(last_nack) >= after)
            {
                let frontier = self.frontier(&m, seq, chunks);
                if now.duration_since(last_progress) >= after * TAIL_NACK_PERIODS {
                    // A long pause: the operation's last frames were lost
                    // (nothing overtakes them), or a host is slow.
                    nack(None, &mut waited)?;
                } else if now.duration_since(last_progress) >= after {
                    // A pause: whatever is missing below the frontier.
                    nack(Some(frontier), &mut waited)?;
                } else if old_frontier > 0 {
                    // Progress goes on, around the holes it left behind.
                    nack(Some(old_frontier), &mut waited)?;
                }
                old_frontier = frontier;
                last_nack = Instant::now();
            }
            if now.duration_since(last_progress) >= restart_after
                && now.duration_since(last_restart) >= restart_after
            {
                waited.restarted += u64::from(self.restart(slot)?);
                last_restart = Instant::now();
            }
            // The poll's budget is the whole wait's, not each look's, or,
            // renewed by progress, that of the pause under way.
            let since = if patience.poll_renewed {
                last_progress
            } else {
                started
            };
            let poll = patience.poll.saturating_sub(since.elapsed());
            // XDP posts an event when the last chunk is final.
            sleep_on_events(&m, tick, poll, || done.load(Ordering::Acquire) >= chunks)?;
        }
    }
}

/// A call key, as the barrier compares it (the ring's `CallKey` words).
pub type CallKeyWords = [u32; wire::ERAR_KEY_WORDS as usize];

/// Where a broadcast's registered buffer is (see
/// [`HostDatapath::arm_reading`]): the region's index and the byte offset
/// of the operation's first chunk in it.
pub type RegionAt = (u32, u32);

/// Where this host stands in an operation's barrier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarrierState {
    /// Not every host has joined yet, as far as this host knows: its
    /// successor told it of `0` consecutive joined hosts from itself on.
    Waiting(u32),
    /// Every host joined with this host's key: it may inject.
    Passed,
    /// Some host joined with another key (an erroneous call, a host that
    /// could not arm, hosts whose float data disagree: see ring/armed.rs):
    /// the operation aborts on every host before anything is sent.
    Aborted,
}

/// What a host waits for in an operation's barrier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarrierWait {
    /// Every host joined (or some host aborted): the barrier before an
    /// operation sends anything.
    Everyone,
    /// Its successor joined (or every host did, or some host aborted).
    /// Enough to end a broadcast in place: a host's buffer serves NACKs
    /// from its successor only, and a host joins that barrier once it
    /// holds every chunk (see [`Self::met`]).
    Successor,
}

impl BarrierWait {
    /// Whether `state` ends the wait. A successor's count is how many
    /// consecutive hosts from it on joined: 1 or more, it joined (with
    /// the same key: a host told another key sees `Aborted`).
    pub fn met(self, state: BarrierState) -> bool {
        match (self, state) {
            (_, BarrierState::Passed | BarrierState::Aborted) => true,
            (BarrierWait::Successor, BarrierState::Waiting(count)) => count >= 1,
            (BarrierWait::Everyone, BarrierState::Waiting(_)) => false,
        }
    }
}

impl HostDatapath {
    /// Joins operation `seq` of `slot` (armed already, or to be armed only
    /// once every host has joined) with call `key`, and tells the
    /// predecessor. Returns where the barrier stands.
    pub fn join(&self, slot: u32, seq: u32, key: CallKeyWords) -> Result<BarrierState> {
        let m = self.slot_maps(slot)?;
        let ctl = m.ctl();
        // SAFETY: only this rank writes the key, and XDP reads it only
        // after seeing join_seq (published below with SeqCst).
        unsafe { std::ptr::addr_of_mut!((*ctl).key).write_volatile(key) };
        m.join_seq().store(seq, Ordering::SeqCst);
        // SeqCst on both sides: either XDP saw the join and tells the
        // predecessor itself, or this read sees what it kept.
        let state = barrier_state(&m, seq, key);
        self.tell(&m, slot, state)?;
        Ok(state)
    }

    /// Waits (the caller knows it has not passed) up to `tick` for operation
    /// `seq`'s barrier to move (XDP posts an event when this host passes or
    /// the call aborts), then, if
    /// `tell_again` (a READY may have been lost), tells the predecessor
    /// again and asks the successor for its count (which, once passed, it
    /// tells nobody on its own), and returns where it stands.
    pub fn barrier(
        &self,
        slot: u32,
        seq: u32,
        key: CallKeyWords,
        (tick, poll): (Duration, Duration),
        (tell_again, wait): (bool, BarrierWait),
    ) -> Result<BarrierState> {
        let m = self.slot_maps(slot)?;
        // XDP posts an event when this host passes or the call aborts (not
        // when only its successor joins: a rank asleep for that sees it
        // at the next tick).
        sleep_on_events(&m, tick, poll, || wait.met(barrier_state(&m, seq, key)))?;
        let state = barrier_state(&m, seq, key);
        if tell_again && state != BarrierState::Passed {
            self.tell(&m, slot, state)?;
            self.send_ready(&m, slot, wire::ERAR_INJECT_QUERY, count_of(&m, state))?;
        }
        Ok(state)
    }

    /// Tells the predecessor the count `state` gives this host.
    fn tell(&self, m: &SlotMaps, slot: u32, state: BarrierState) -> Result<()> {
        self.send_ready(m, slot, wire::ERAR_INJECT_READY, count_of(m, state))
    }
}

/// The count this host tells in `state`: 1 + its successor's, at most the
/// ring's size, or ERAR_READY_ABORT.
fn count_of(m: &SlotMaps, state: BarrierState) -> u32 {
    // SAFETY: written by configure_slot() only, never concurrently.
    let n = unsafe { std::ptr::addr_of!((*m.ctl()).ring_size).read_volatile() };
    match state {
        BarrierState::Waiting(c) => (c + 1).min(n),
        BarrierState::Passed => n,
        BarrierState::Aborted => wire::ERAR_READY_ABORT,
    }
}

/// Where operation `seq`'s barrier stands on this host, from the newest
/// count its successor told it.
fn barrier_state(m: &SlotMaps, seq: u32, key: CallKeyWords) -> BarrierState {
    // The key beside the word, read between two equal reads of the word
    // (XDP writes it before the compare-and-swap that publishes a word).
    let (word, told_key) = loop {
        let word = m.ready().load(Ordering::SeqCst);
        // SAFETY: a plain read of the mapping; torn reads are retried.
        let told_key = unsafe { std::ptr::addr_of!((*m.ctl()).ready_key).read_volatile() };
        if m.ready().load(Ordering::SeqCst) == word {
            break (word, told_key);
        }
    };
    let (told_seq, count) = ((word >> 32) as u32, word as u32);
    if told_seq != seq {
        // A successor on a newer operation has passed this one's barrier,
        // so every host joined it; an older one has not joined yet.
        // Seqs count 1..2^31-1 and wrap to 1: they compare in 31 bits (as
        // erar_ring.bpf.c's seq_after()).
        let ahead = told_seq.wrapping_sub(seq) & 0x7fff_ffff;
        return if ahead != 0 && ahead < 0x4000_0000 {
            BarrierState::Passed
        } else {
            BarrierState::Waiting(0)
        };
    }
    if count == wire::ERAR_READY_ABORT {
        return BarrierState::Aborted;
    }
    if told_key != key {
        // Told before this host joined (its XDP could not check).
        return BarrierState::Aborted;
    }
    // SAFETY: as in tell().
    let n = unsafe { std::ptr::addr_of!((*m.ctl()).ring_size).read_volatile() };
    if count + 1 >= n {
        BarrierState::Passed
    } else {
        BarrierState::Waiting(count)
    }
}

/// Waits until `moved()` (a look at the slot's shared words) says what the
/// caller waits for has happened, or `timeout` passes. For up to `poll` it
/// looks without sleeping, yielding the CPU between looks (see
/// `ERAR_POLL_US`); then it sets the slot's `sleeping`, looks once more and
/// sleeps until XDP's event (which it posts only to a sleeping rank) or
/// the timeout. Both sides write before they read the other's word
/// (`sleeping` here, `done` or `ready` in XDP, each a full barrier), so
/// either this last look sees XDP's update or XDP sees `sleeping`.
/// Not RingBuffer::poll: that hands epoll_wait whole milliseconds, so any
/// timeout under 1 ms became 0 and the waiting rank spun without yielding,
/// starving the other hosts' softirqs and ranks on the test bed's 2 CPUs
/// (a 256 KiB allreduce took 4-8 ms instead of 1). ppoll on the ring
/// buffer's epoll fd sleeps to the microsecond.
fn sleep_on_events(
    m: &SlotMaps,
    timeout: Duration,
    poll: Duration,
    moved: impl Fn() -> bool,
) -> Result<()> {
    let started = Instant::now();
    let polling = poll.min(timeout);
    while !polling.is_zero() {
        if moved() {
            return Ok(());
        }
        if started.elapsed() >= polling {
            break;
        }
        std::thread::yield_now();
    }
    let left = timeout.saturating_sub(started.elapsed());
    if left.is_zero() {
        return Ok(());
    }
    let sleeping = m.sleeping();
    sleeping.store(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    let slept = if moved() {
        Ok(())
    } else {
        sleep_for_event(m, left)
    };
    sleeping.store(0, Ordering::Release);
    slept
}

/// Sleeps until an event is on the slot's ring buffer or `timeout` passes,
/// and consumes the events (an event left by a wake-up that came late only
/// ends the next sleep early).
fn sleep_for_event(m: &SlotMaps, timeout: Duration) -> Result<()> {
    let rb = m.events();
    let mut fds = [libc::pollfd {
        fd: rb.epoll_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    if ppoll(&mut fds, timeout)? > 0 {
        rb.consume().context("consuming the events ring buffer")?;
    }
    Ok(())
}

/// One ppoll of `fds` for up to `timeout`: how many are ready (0 also
/// when a signal interrupted it).
fn ppoll(fds: &mut [libc::pollfd; 1], timeout: Duration) -> Result<i32> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: one valid pollfd, a valid timespec, no signal mask.
    let ret = unsafe { libc::ppoll(fds.as_mut_ptr(), 1, &ts, std::ptr::null()) };
    if ret < 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err).context("waiting on the events ring buffer");
        }
        return Ok(0);
    }
    Ok(ret)
}

/// The armed operation's (seq, ring_pos, ring_size, chunks, wire_op).
pub(super) fn armed_op(m: &SlotMaps, slot: u32) -> Result<(u32, u32, u32, u32, u32)> {
    let ctl = m.ctl();
    let armed = m.armed().load(Ordering::Acquire);
    ensure!(
        armed & wire::ERAR_ARMED_BIT != 0,
        "slot {slot} is not armed"
    );
    // SAFETY: plain reads of fields written before arming.
    Ok(unsafe {
        (
            armed as u32,
            std::ptr::addr_of!((*ctl).ring_pos).read_volatile(),
            std::ptr::addr_of!((*ctl).ring_size).read_volatile(),
            std::ptr::addr_of!((*ctl).chunks).read_volatile(),
            std::ptr::addr_of!((*ctl).wire_op).read_volatile(),
        )
    })
}

/// The trip of the armed operation of `m`, as arm() wrote it.
pub(super) fn armed_trip(m: &SlotMaps) -> Trip {
    // SAFETY: a plain read of a field written before arming.
    Trip(unsafe { std::ptr::addr_of!((*m.ctl()).trip).read_volatile() })
}

/// How many chunks of the armed operation of `m` start at ring position
/// `pos` (the runs its ERAR_INJECT_START sends), from the trip arm() wrote.
pub(super) fn chunks_starting_at(m: &SlotMaps, pos: u32, chunks: u32) -> u32 {
    starts_here(&armed_trip(m).0, pos, chunks)
}

/// A chunk's stage in operation `seq`, from its state word (NONE if the
/// word is of another operation): erar_trip.h's stage_of().
pub(super) fn stage_of(word: &AtomicU64, seq: u32) -> u32 {
    // Acquire: the chunk's payload was stored before its stage.
    let w = word.load(Ordering::Acquire);
    if (w >> 32) as u32 == seq {
        w as u32
    } else {
        wire::ERAR_STAGE_NONE
    }
}

/// Whether a chunk's state word says final in operation `seq`.
pub(super) fn is_final(word: &AtomicU64, seq: u32) -> bool {
    stage_of(word, seq) == wire::ERAR_STAGE_FINAL
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunks a host starts are the ones erar_inject's START runs send:
    /// allreduce, a run of ceil(C / n) adjacent chunks a position (the last
    /// shorter or empty); broadcast, every chunk (the root's).
    #[test]
    fn starting_chunks_follow_the_trip() {
        let ar = trip_of(wire::ERAR_OP_ADD_I32, 4, 3, 10);
        let t = (ar.origin_run, ar.origin_mod, ar.origin_base, ar.rs_hops);
        assert_eq!(t, (3, 4, 0, 3));
        assert_eq!(starts_here(&ar, 0, 10), 3); // 0, 1, 2
        assert_eq!(starts_here(&ar, 1, 10), 3); // 3, 4, 5
        assert_eq!(starts_here(&ar, 3, 10), 1); // 9
        let five = trip_of(wire::ERAR_OP_ADD_I32, 4, 0, 5);
        let runs: Vec<u32> = (0..4).map(|p| starts_here(&five, p, 5)).collect();
        assert_eq!(runs, [2, 2, 1, 0]);
        let one = trip_of(wire::ERAR_OP_ADD_I32, 4, 0, 1);
        let runs: Vec<u32> = (0..4).map(|p| starts_here(&one, p, 1)).collect();
        assert_eq!(runs, [1, 0, 0, 0]);
        let bc = trip_of(wire::ERAR_OP_BCAST, 4, 2, 10);
        assert_eq!((bc.origin_mod, bc.origin_base, bc.rs_hops), (1, 2, 0));
        assert_eq!(starts_here(&bc, 2, 10), 10);
        assert_eq!(bc.start_kind, wire::ERAR_KIND_AG);
    }

    /// Each run's chunks in order, and a chunk's place in its run (what
    /// the NACK frontier compares): every chunk of the operation is started
    /// exactly once, by the position whose run holds it.
    #[test]
    fn runs_cover_every_chunk_once_in_order() {
        for (n, chunks) in [(4, 10), (4, 629), (3, 7), (8, 5), (2, 1)] {
            let trip = Trip(trip_of(wire::ERAR_OP_ADD_I32, n, 0, chunks));
            let mut started = Vec::new();
            for pos in 0..n {
                for i in 0..starts_here(&trip.0, pos, chunks) {
                    let c = trip.start_chunk(pos, i);
                    assert_eq!(trip.place(n, pos, c).0, 0, "chunk {c} starts at {pos}");
                    assert_eq!(trip.place_in_run(c), i);
                    started.push(c);
                }
                let past = starts_here(&trip.0, pos, chunks);
                let c = trip.start_chunk(pos, past);
                assert!(
                    c >= chunks,
                    "{n} hosts, {chunks} chunks: {pos} starts {c} past its run"
                );
            }
            assert_eq!(
                started,
                (0..chunks).collect::<Vec<_>>(),
                "{n} hosts, {chunks} chunks"
            );
        }
        let bc = Trip(trip_of(wire::ERAR_OP_BCAST, 4, 2, 10));
        assert_eq!(bc.place_in_run(7), 7);
    }

    /// What a host waits for, as the ring's recovery asks it (erar_trip.h's
    /// awaits() on the same trip).
    #[test]
    fn successor_waits_for_the_right_kind() {
        let (none, reduced, fin, busy) = (
            wire::ERAR_STAGE_NONE,
            wire::ERAR_STAGE_REDUCED,
            wire::ERAR_STAGE_FINAL,
            wire::ERAR_STAGE_BUSY,
        );
        // Ring of 4, 10 chunks: chunk 5 starts at position 1 (runs of 3).
        let ar = Trip(trip_of(wire::ERAR_OP_ADD_I32, 4, 0, 10));
        assert_eq!(ar.awaits(4, 2, 5, none), Some(false)); // RS partial
        assert_eq!(ar.awaits(4, 1, 5, none), Some(true)); // origin: AG
        assert_eq!(ar.awaits(4, 3, 5, reduced), Some(true));
        assert_eq!(ar.awaits(4, 3, 5, fin), None);
        assert!(!ar.sent_ag(reduced) && ar.sent_ag(fin));
        let bc = Trip(trip_of(wire::ERAR_OP_BCAST, 4, 0, 10));
        assert_eq!(bc.awaits(4, 3, 5, none), Some(true));
        assert_eq!(bc.awaits(4, 3, 5, busy), None);
        // The root waits for nothing; every host's last frame was AG.
        assert_eq!(bc.awaits(4, 0, 5, none), None);
        assert!(bc.sent_ag(none));
    }

    /// The frames a host sends and waits for, with their steps, as
    /// erar_trip.h's last_sent() and awaits() give them (ring of 4).
    #[test]
    fn frames_sent_and_awaited_carry_their_steps() {
        let (none, reduced, fin) = (
            wire::ERAR_STAGE_NONE,
            wire::ERAR_STAGE_REDUCED,
            wire::ERAR_STAGE_FINAL,
        );
        let (rs, ag) = (wire::ERAR_KIND_RS, wire::ERAR_KIND_AG);
        let ar = Trip(trip_of(wire::ERAR_OP_ADD_I32, 4, 0, 10));
        // Chunk 5 of 10 starts at 1: position 1 sent its contribution (RS 0),
        // 2 and 3 their partials (RS 1, RS 2); 0 finished it and sends AG 0.
        assert_eq!(ar.last_sent(4, 1, 5, none), Some((rs, 0)));
        assert_eq!(ar.last_sent(4, 2, 5, reduced), Some((rs, 1)));
        assert_eq!(ar.last_sent(4, 3, 5, reduced), Some((rs, 2)));
        assert_eq!(ar.last_sent(4, 0, 5, fin), Some((ag, 0)));
        assert_eq!(ar.last_sent(4, 1, 5, fin), Some((ag, 1)));
        assert_eq!(ar.last_sent(4, 2, 5, fin), Some((ag, 2)));
        assert_eq!(ar.last_sent(4, 3, 5, fin), None); // the trip ends there
        assert_eq!(ar.awaited(4, 3, 5, none), Some((rs, 1)));
        assert_eq!(ar.awaited(4, 0, 5, none), Some((rs, 2)));
        assert_eq!(ar.awaited(4, 2, 5, reduced), Some((ag, 1)));
        assert_eq!(ar.start_chunk(1, 1), 4);
        assert_eq!(ar.start_chunk(1, 3), wire::ERAR_NO_CHUNK);
        let bc = Trip(trip_of(wire::ERAR_OP_BCAST, 4, 2, 10));
        assert_eq!(bc.last_sent(4, 2, 7, none), Some((ag, 0)));
        assert_eq!(bc.last_sent(4, 3, 7, fin), Some((ag, 1)));
        assert_eq!(bc.awaited(4, 0, 7, none), Some((ag, 1)));
        assert_eq!(bc.start_chunk(2, 7), 7);
    }
}
