//! The driver: the fuzzer's state (datapath, model, generator, the slots'
//! maps), setting the slots up (and having their ranks join, see
//! `barrier`), and running one frame through BPF_PROG_RUN (the main loop
//! that generates and checks frames is `main`'s).

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};

use anyhow::{ensure, Context, Result};
use liberar::datapath::kernel::{HostDatapath, InjectPacing, RegionAt, SlotRoute};
use liberar::datapath::wire;

use crate::counters::BarrierTally;
use crate::counters::{stat_array, NR};
use crate::frames::call_key;
use crate::frames::Gen;
use crate::layout::{
    be16, ipv4_csum, put32, ARMED_BIT, HDR, KEY_WORDS, L2L4, OP_BCAST, OP_FLAGS, OP_NR, SLOTS,
    UDP_PORT,
};
use crate::maps::{inner_id, outer_map, prog_maps, Mmap, SlotState, CTL_SIZE, OUTERS};
use crate::model::{Ctl, Model};
use crate::regions::{self, Windows, ARMABLE, INSTALLED};
use crate::rng::Rng;

/// One BPF_PROG_RUN: Ok((retval, output length)) or Err(errno).
pub type RunRes = std::result::Result<(u32, usize), i32>;
/// A run and its output frame.
pub type Outcome = (RunRes, Vec<u8>);

pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;

pub struct Fuzzer {
    pub dp: HostDatapath,
    pub model: Model,
    pub gen: Gen,
    /// Every slot's inner maps, as the program finds them.
    pub slots: Vec<SlotState>,
    /// The program's maps by name (the arrays of maps among them).
    pub maps: BTreeMap<String, OwnedFd>,
    /// The regions installed in the program's arrays of region maps
    /// (region `regions::INSTALLED[k]`: map and read-write mapping).
    pub regions: Vec<(OwnedFd, Mmap)>,
    /// Last seq armed per slot (a new ring restarts at 1).
    pub seqs: [u32; SLOTS],
    /// The call key of each slot's current operation, as its ring's hosts
    /// join it (unless a call is erroneous).
    pub op_keys: [[u32; KEY_WORDS]; SLOTS],
    /// The joins and the inject path's READY runs.
    pub barrier: BarrierTally,
    pub ctl_snapshot: Vec<u8>,
    /// The model's slot_ctl and the frame's chunk-state word before the
    /// current frame (for mismatch reports).
    pub before_ctl: [Ctl; SLOTS],
    pub before_word: Option<u64>,
    pub before_chunk: Vec<u8>,
    pub stats: [u64; NR],
    pub mismatches: u64,
    pub reported: u32,
    /// Frames accepted for a broadcast armed with a root outside the ring.
    pub root_oob_accepts: u64,
    pub out: Vec<u8>,
}

impl Fuzzer {
    /// Slot `slot`'s buffer: its `slot_buf` inner map.
    fn real_buf(&self, slot: usize) -> &[u8] {
        self.slots[slot].buf.bytes(self.dp.slot_bytes())
    }

    /// The first byte at which the slot buffers differ from the model's
    /// (offset in the model's layout: slot after slot).
    pub fn buf_diff(&self) -> Option<usize> {
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
    pub fn sync_buf(&mut self) {
        let sb = self.dp.slot_bytes();
        for s in 0..SLOTS {
            let real = self.slots[s].buf.bytes(sb);
            self.model.buf[s * sb..(s + 1) * sb].copy_from_slice(real);
        }
    }

    /// The first region whose windows differ from the model's, and the
    /// first byte (in the windows' layout) where.
    pub fn region_diff(&self) -> Option<(usize, usize)> {
        self.regions.iter().enumerate().find_map(|(k, (_, view))| {
            let (w, base) = (self.model.windows[k], self.model.region_base(k));
            w.diff(view, &self.model.buf[base..base + w.len()])
                .map(|at| (k, at))
        })
    }

    /// The model's regions := the kernel's.
    pub fn sync_regions(&mut self) {
        for (k, (_, view)) in self.regions.iter().enumerate() {
            let (w, base) = (self.model.windows[k], self.model.region_base(k));
            self.model.buf[base..base + w.len()].copy_from_slice(&w.read(view));
        }
    }

    /// Region k's bytes (in the windows' layout) := `fill`'s, in the
    /// kernel and the model alike.
    fn write_region(&mut self, k: usize, fill: impl FnOnce(&mut [u8], &mut Rng)) {
        let (w, base) = (self.model.windows[k], self.model.region_base(k));
        let bytes = &mut self.model.buf[base..base + w.len()];
        fill(bytes, &mut self.gen.rng);
        w.write(&self.regions[k].1, bytes);
    }

    /// Registered buffers for the operation about to be armed on `slot`
    /// (on a third of them): an input, an output, both (one entry at one
    /// offset now and then, as one buffer given for both would be) or
    /// neither, each at an entry of `regions::ARMABLE` and an offset of
    /// `regions::pick_offset`. The head of an installed region it names
    /// becomes the slot's token mostly (another now and then: its frames
    /// are dropped), and its bytes new random ones now and then.
    fn pick_regions(&mut self, slot: usize) -> (Option<RegionAt>, Option<RegionAt>) {
        let (cb, cps) = (self.model.cb, self.model.cps);
        let r = &mut self.gen.rng;
        if !r.chance(1, 3) {
            return (None, None);
        }
        let one = |r: &mut Rng| {
            let region = r.pick(&ARMABLE);
            // (A region past the last class has no bytes: any offset.)
            let end = regions::region_bytes(region).unwrap_or(wire::ERAR_REGION_BYTES_1M as usize);
            (region, regions::pick_offset(r, cb, cps, end))
        };
        let (input, output) = match r.below(6) {
            0 => (Some(one(r)), None),
            1 => (None, Some(one(r))),
            2 => {
                let both = one(r);
                (Some(both), Some(both))
            }
            // Apart, or (one entry) at one offset: a streaming combine
            // over overlapping input and output is not modelled (liberar
            // never registers overlapping pages: `claim_guard`).
            _ => {
                let (input, mut output) = (one(r), one(r));
                if input.0 == output.0 {
                    output.1 = input.1;
                }
                (Some(input), Some(output))
            }
        };
        let token = self.model.ctl[slot].token;
        for (entry, _) in [input, output].into_iter().flatten() {
            let Some(k) = INSTALLED.iter().position(|&e| e == entry) else {
                continue;
            };
            if self.gen.rng.chance(1, 4) {
                self.write_region(k, |b, r| r.fill(b));
            }
            let head = if self.gen.rng.chance(7, 8) {
                token
            } else {
                self.gen.rng.u32()
            };
            self.write_region(k, |b, _| put32(b, 0, head));
        }
        (input, output)
    }

    /// Every slot's chunk-state words (its `chunk_state` inner map), slot
    /// after slot as in the model.
    pub fn real_state(&self) -> Vec<u64> {
        let cps = self.model.cps;
        self.slots
            .iter()
            .flat_map(|s| s.state.bytes(cps * 8).chunks_exact(8))
            .map(|w| u64::from_ne_bytes(w.try_into().unwrap()))
            .collect()
    }

    pub fn real_ctl(&self, slot: usize) -> wire::erar_slot_ctl {
        let b = self.slots[slot].ctl.bytes(CTL_SIZE);
        // SAFETY: CTL_SIZE bytes; erar_slot_ctl is plain old data.
        unsafe { std::ptr::read_unaligned(b.as_ptr().cast()) }
    }

    /// Every slot's `slot_ctl` inner map, slot after slot.
    pub fn real_ctl_bytes(&self) -> Vec<u8> {
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
    pub fn maintain(&mut self, epoch_left: &mut u64, first: &mut bool) -> Result<()> {
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
        self.maybe_join()
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
            self.region_diff().is_none(),
            "regions differ after setup (region, byte): {:?}",
            self.region_diff()
        );
        ensure!(
            self.real_state() == self.model.state,
            "chunk_state differs after setup"
        );
        self.ctl_snapshot = self.real_ctl_bytes();
        Ok(())
    }

    /// Next operation on one slot (after `reconfigure`, of a new ring), and
    /// maybe its rank's join of it.
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
                // A new ring's barrier starts from nothing (its key words
                // stay as they were: nothing reads them before a join).
                c.join_seq = 0;
                c.ready = 0;
                c.sleeping = 0;
                for w in &mut self.model.state[slot * cps..(slot + 1) * cps] {
                    *w = 0;
                }
                self.seqs[slot] = 0;
                let real = self.real_ctl(slot);
                // Half the slots had a sleeping rank (set below, per
                // operation): a new ring starts with none.
                ensure!(
                    real.sleeping == 0,
                    "slot {slot}: configure_slot left sleeping {}",
                    real.sleeping
                );
                let bytes = |w: &[u64]| -> [u8; L2L4] {
                    w.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>()[..L2L4]
                        .try_into()
                        .unwrap()
                };
                self.model.ctl[slot].tmpl = bytes(&real.tmpl);
                self.model.ctl[slot].nack_tmpl = bytes(&real.nack_tmpl);
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
            // The next operation's call key (the same as the last one's now
            // and then: a program calls the same collective again).
            if r.chance(2, 3) {
                self.op_keys[slot] = call_key(r);
            }
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
                // Frames circulate on most allreduces (the default), not
                // on some (and never on a broadcast).
                let circulate = r.chance(3, 4);
                self.dp.set_inject_pacing(InjectPacing {
                    circulate,
                    ..self.dp.inject_pacing()
                });
                let (input, output) = self.pick_regions(slot);
                self.dp.arm_reading(
                    slot as u32,
                    seq,
                    chunks,
                    op as u8,
                    root,
                    flags_from,
                    (input, output),
                )?;
                let c = &mut self.model.ctl[slot];
                (c.in_region, c.in_off) = input.map_or((0, 0), |(e, off)| (e + 1, off));
                (c.out_region, c.out_off) = output.map_or((0, 0), |(e, off)| (e + 1, off));
                c.chunks = chunks;
                c.wire_op = op;
                c.flags_from = flags_from;
                c.root = root;
                c.done = 0;
                c.circulate = u32::from(circulate && op != OP_BCAST);
                c.start_next = 0;
                c.armed = ARMED_BIT | seq as u64;
                // The rank's START runs take starting frames too: circulating
                // frames then draw from further on, up to past this host's
                // run (where the next host's run begins).
                let run = c.run();
                let rng = &mut self.gen.rng;
                if rng.chance(1, 3) {
                    let taken = rng.below(u64::from(run) + 3) as u32;
                    self.model.ctl[slot].start_next = taken;
                    self.slots[slot].set_start_next(taken);
                }
            }
            // Whether the rank sleeps on the slot's events: XDP posts
            // them only then (changes between operations, as a rank's
            // waits poll or sleep).
            let sleeping = u32::from(self.gen.rng.chance(1, 2));
            self.slots[slot].set_sleeping(sleeping);
            self.model.ctl[slot].sleeping = sleeping;
            // The kernel-visible slot_ctl must be what the model thinks.
            let real = self.real_ctl(slot);
            let c = self.model.ctl[slot];
            ensure!(
                real.comm_id == c.comm_id
                    && real.token == c.token
                    && real.join_seq == c.join_seq
                    && real.key == c.key
                    && real.ready == c.ready
                    && real.ready_key == c.ready_key
                    && real.ring_pos == c.ring_pos
                    && real.ring_size == c.ring_size
                    && real.armed == c.armed
                    && real.sleeping == c.sleeping
                    && (c.armed == 0
                        || (real.in_region, real.in_off, real.out_region, real.out_off)
                            == (c.in_region, c.in_off, c.out_region, c.out_off))
                    && (c.armed == 0
                        || (real.chunks == c.chunks
                            && real.wire_op == c.wire_op
                            && real.flags_from == c.flags_from
                            && real.root == c.root
                            && real.done == c.done
                            && real.circulate == c.circulate
                            && real.start_next == c.start_next)),
                "slot {slot}: slot_ctl {real:?} differs from the model {c:?}"
            );
            self.model.ctl[slot].done = real.done;
            self.model.ctl[slot].start_next = real.start_next;
            self.model.ctl[slot].circulate = real.circulate;
            self.model.ctl[slot].chunks = real.chunks;
            self.model.ctl[slot].wire_op = real.wire_op;
            self.model.ctl[slot].flags_from = real.flags_from;
            self.model.ctl[slot].root = real.root;
        }
        // Before the join, whose inject runs check every slot_ctl.
        self.ctl_settled(slot);
        self.join_op(slot)
    }

    /// Slot `slot`'s slot_ctl as it is now is the expected one (after
    /// user space wrote it and it was checked against the model).
    pub fn ctl_settled(&mut self, slot: usize) {
        let at = slot * CTL_SIZE;
        self.ctl_snapshot[at..at + CTL_SIZE].copy_from_slice(self.slots[slot].ctl.bytes(CTL_SIZE));
    }

    /// One BPF_PROG_RUN of `f` on the receive path: Ok((retval, out_len))
    /// or Err(errno).
    pub fn prog_run(&mut self, f: &[u8]) -> RunRes {
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
pub fn prog_run_raw(prog_fd: c_int, ifindex: u32, f: &[u8], out: &mut [u8]) -> RunRes {
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

impl Fuzzer {
    /// Attaches the datapath to `ifname` and finds every slot's state as the
    /// program finds it; the model and the generator (seeded by `seed`)
    /// start empty.
    pub fn attach(ifname: &str, cb: u32, cps: u32, seed: u64) -> Result<Fuzzer> {
        let dp = HostDatapath::attach(ifname, cb, cps).context("attaching the datapath")?;
        ensure!(
            wire::ERAR_MAX_SLOTS as usize == SLOTS,
            "ERAR_MAX_SLOTS is {}, this fuzzer models {SLOTS} slots",
            wire::ERAR_MAX_SLOTS
        );
        // Each slot's state, found as the program finds it: through its arrays
        // of maps, once every slot's first use has installed its inner maps.
        for s in 0..SLOTS as u32 {
            dp.use_slot(s)
                .with_context(|| format!("first use of slot {s}"))?;
        }
        let maps = prog_maps(dp.prog_fd().as_raw_fd())?;
        let regions = regions::install(&maps)?;
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
        let windows = INSTALLED.map(|region| {
            let end = regions::region_bytes(region).expect("an installed region has a class");
            Windows::new(cb as usize, cps as usize, end)
        });
        // A payload has fragments past the linear part's head bytes.
        let copies_fragments =
            cb > wire::ERAR_JUMBO_HEAD_BYTES && !dp.combines_fragments_in_place()?;
        Ok(Fuzzer {
            dp,
            model: Model {
                cb: cb as usize,
                cps: cps as usize,
                copies_fragments,
                ctl: [Ctl::default(); SLOTS],
                state: vec![0; SLOTS * cps as usize],
                buf: vec![0; SLOTS * slot_bytes + windows.iter().map(Windows::len).sum::<usize>()],
                windows,
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
            regions,
            seqs: [0; SLOTS],
            op_keys: [[0; KEY_WORDS]; SLOTS],
            barrier: BarrierTally::default(),
            ctl_snapshot: Vec::new(),
            before_ctl: [Ctl::default(); SLOTS],
            before_word: None,
            before_chunk: Vec::new(),
            stats,
            mismatches: 0,
            reported: 0,
            root_oob_accepts: 0,
            out: vec![0u8; 3 * 4096 + 8192],
        })
    }

    /// The model starts from the kernel's state (attach disarmed everything;
    /// no slot is configured yet).
    pub fn start_from_kernel(&mut self) -> Result<()> {
        self.sync_buf();
        self.sync_regions();
        self.model.state = self.real_state();
        for s in 0..SLOTS {
            let real = self.real_ctl(s);
            let c = &mut self.model.ctl[s];
            (c.comm_id, c.token, c.armed) = (real.comm_id, real.token, real.armed);
            (c.ring_pos, c.ring_size) = (real.ring_pos, real.ring_size);
            (c.key, c.join_seq) = (real.key, real.join_seq);
            (c.ready, c.ready_key) = (real.ready, real.ready_key);
            (c.inject_mode, c.inject_count) = (real.inject_mode, real.inject_count);
            let bytes = |w: &[u64]| -> Vec<u8> { w.iter().flat_map(|w| w.to_le_bytes()).collect() };
            c.tmpl.copy_from_slice(&bytes(&real.tmpl)[..L2L4]);
            c.nack_tmpl.copy_from_slice(&bytes(&real.nack_tmpl)[..L2L4]);
            ensure!(
                real.armed == 0,
                "slot {s} armed right after attach: {real:?}"
            );
        }
        self.settle()
    }
}
