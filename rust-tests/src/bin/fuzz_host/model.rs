//! The model of erar_xdp's receive path, in plain Rust: what the program
//! must do with a frame (verdict, output, counters, events) and its effect
//! on the model's own slot buffers, chunk-state words and slot_ctl; what a
//! rank's join of a barrier and the inject path's READY frame do; and the
//! docs' rule of which frame a host receives and last sent for a chunk.

use liberar::datapath::kernel::BarrierState;
use liberar::datapath::wire;

use crate::counters::NR;
use crate::layout::{
    be16, key_of, le16, le32, put16, put32, put_key, putbe16, AG, ARMED_BIT, INJECT_READY,
    KEY_WORDS, L2L4, LINEAR_MAX, MAGIC, MAX_RING, NACK, OP_BCAST, OP_FLAGS, O_CHUNK, O_COMM,
    O_KIND, O_MAGIC, O_OP, O_RESERVED, O_SEQ, O_SLOT, O_STEP, O_TOKEN, O_VERSION, PING, PL, PONG,
    READY, READY_ABORT, RS, SLOTS, STAGE_BUSY, STAGE_FINAL, STAGE_NONE, STAGE_REDUCED, UDP_PORT,
    VERSION,
};
use crate::regions::{same_class, Windows, HEAD, INSTALLED};

#[derive(Clone, Copy, Debug)]
pub struct Ctl {
    pub comm_id: u32,
    pub token: u32,
    pub ring_pos: u32,
    pub ring_size: u32,
    pub root: u32,
    pub chunks: u32,
    pub wire_op: u32,
    pub flags_from: u32,
    pub armed: u64,
    pub done: u32,
    /// Frames circulate (set by arm(): an allreduce, when the pacing
    /// says so), and the starting frames taken so far (reset by arm()).
    pub circulate: u32,
    pub start_next: u32,
    pub tmpl: [u8; L2L4],
    /// To the previous host of the ring (NACKs and READYs go upstream).
    pub nack_tmpl: [u8; L2L4],
    /// Barrier, written by a rank's join: its call key and the operation
    /// it joined (0 after configure_slot: none).
    pub key: [u32; KEY_WORDS],
    pub join_seq: u32,
    /// Barrier, written by XDP: the newest word `(seq << 32) | count` the
    /// successor told and that READY's key (`ready` 0 after configure_slot;
    /// the key is left as it was).
    pub ready_key: [u32; KEY_WORDS],
    pub ready: u64,
    /// Inject path, as a join leaves it (ERAR_INJECT_READY and the count
    /// it told).
    pub inject_mode: u32,
    pub inject_count: u32,
    /// The rank sleeps on the slot's events (set by user space): XDP posts
    /// an event only then.
    pub sleeping: u32,
    /// Registered buffers (set by arm()): region entry + 1 (0: the slot
    /// buffer) and the offset of chunk 0, where this host reads its
    /// contribution (in) and keeps what it receives (out).
    pub in_region: u32,
    pub in_off: u32,
    pub out_region: u32,
    pub out_off: u32,
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
            circulate: 0,
            start_next: 0,
            tmpl: [0; L2L4],
            nack_tmpl: [0; L2L4],
            key: [0; KEY_WORDS],
            join_seq: 0,
            ready_key: [0; KEY_WORDS],
            ready: 0,
            inject_mode: 0,
            inject_count: 0,
            sleeping: 0,
            in_region: 0,
            in_off: 0,
            out_region: 0,
            out_off: 0,
        }
    }
}

impl Ctl {
    /// The event XDP posts for (`slot`, `seq`): only to a rank that sleeps
    /// (we drain the ring buffer after every frame: it never fills).
    fn wake(&self, p: &mut Prediction, slot: usize, seq: u32) {
        if self.sleeping != 0 {
            p.events.push((slot as u32, seq));
        }
    }
    pub fn seq(&self) -> Option<u32> {
        (self.armed & ARMED_BIT != 0).then_some(self.armed as u32)
    }
    /// How many consecutive chunks each position of an allreduce's ring
    /// starts (docs/datapath.md): ceil(chunks / n), at least 1.
    pub fn run(&self) -> u32 {
        self.chunks.div_ceil(self.ring_size.max(1)).max(1)
    }

    /// The ring position where a chunk's frames start: a broadcast's root;
    /// an allreduce's, the position whose run of chunks holds it (position
    /// p starts chunks p*run .. p*run + run - 1).
    pub fn origin(&self, chunk: u32) -> u32 {
        if self.wire_op == OP_BCAST {
            self.root
        } else {
            chunk / self.run()
        }
    }

    /// Distance of this host from chunk's origin.
    pub fn dist(&self, chunk: u32) -> u32 {
        let n = self.ring_size;
        let from = self.origin(chunk);
        let pos = self.ring_pos;
        if pos >= from {
            pos - from
        } else {
            pos.wrapping_add(n).wrapping_sub(from)
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Verdict {
    Einval,
    Pass,
    Drop,
    Tx,
    /// The inject path's frame, out of the slot's interface.
    Redirect,
}

pub struct Prediction {
    pub verdict: Verdict,
    pub ctr: [u64; NR],
    pub out: Vec<u8>,
    pub events: Vec<(u32, u32)>,
}

pub struct Model {
    pub cb: usize,
    pub cps: usize,
    /// The kernel combines an RS payload that has fragments through a copy
    /// (counted as `payload_copied`): the loader's choice on a kernel that
    /// refuses XDP the kfunc reaching fragments in place
    /// (`HostDatapath::combines_fragments_in_place`).
    pub copies_fragments: bool,
    pub ctl: [Ctl; SLOTS],
    pub state: Vec<u64>,
    /// The slot buffers (slot after slot), then the regions' windows
    /// (region after region, see regions.rs).
    pub buf: Vec<u8>,
    /// Each installed region's windows (`regions::INSTALLED` order).
    pub windows: [Windows; INSTALLED.len()],
}

/// `p`, dropped for reason `s` (a counter).
fn dropped(mut p: Prediction, s: u32) -> Prediction {
    p.ctr[s as usize] += 1;
    p.verdict = Verdict::Drop;
    p
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
pub fn is_datapath(lin: &[u8]) -> bool {
    lin.len() >= L2L4
        && be16(lin, 12) == 0x0800
        && lin[14] == 0x45
        && lin[23] == 17
        && be16(lin, 20) & 0x3fff == 0
        && be16(lin, 36) == UDP_PORT
}

/// For an IPv4/UDP frame to ERAR_UDP_PORT that is not a datapath frame by
/// docs/datapath.md's definition: why not.
pub fn udp_to_port_not_datapath(f: &[u8]) -> Option<&'static str> {
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
    pub fn idx(&self, slot: usize, chunk: usize) -> usize {
        slot * self.cps + chunk
    }

    /// Where region k's windows start in `buf`.
    pub fn region_base(&self, k: usize) -> usize {
        SLOTS * self.cps * self.cb + self.windows[..k].iter().map(Windows::len).sum::<usize>()
    }

    /// Where in `buf` chunk `chunk` of slot `slot` is for `region` and
    /// `off` (a slot_ctl's in or out pair), as erar_xdp's region_chunk()
    /// finds it: the slot buffer's for region 0; None (`region_err`) for
    /// an entry without a map, a region whose head is not the slot's
    /// token, or a chunk outside [head, end - ERAR_MAX_CHUNK_BYTES] (the
    /// end of its class's maps).
    fn region_chunk(&self, slot: usize, region: u32, off: u32, chunk: usize) -> Option<usize> {
        if region == 0 {
            return Some(self.idx(slot, chunk) * self.cb);
        }
        let k = INSTALLED.iter().position(|&e| e == region - 1)?;
        let (base, w) = (self.region_base(k), &self.windows[k]);
        if le32(&self.buf, base) != self.ctl[slot].token {
            return None;
        }
        let o = off.wrapping_add(chunk as u32 * self.cb as u32) as usize;
        if !(HEAD..=w.end() - wire::ERAR_MAX_CHUNK_BYTES as usize).contains(&o) {
            return None;
        }
        Some(base + w.at(o, self.cb))
    }

    /// Whether the slot's regions are an allreduce's pair: an input and
    /// an output region, of one class.
    fn region_pair(&self, slot: usize) -> bool {
        let c = &self.ctl[slot];
        c.in_region != 0 && c.out_region != 0 && same_class(c.in_region - 1, c.out_region - 1)
    }

    /// Where this host reads its contribution to a chunk (own_input()).
    pub fn input_at(&self, slot: usize, chunk: usize) -> Option<usize> {
        let c = &self.ctl[slot];
        self.region_chunk(slot, c.in_region, c.in_off, chunk)
    }

    /// Where this host keeps what it receives of a chunk and re-sends it
    /// from (own_output()): the only bytes an applied frame writes.
    pub fn output_at(&self, slot: usize, chunk: usize) -> Option<usize> {
        let c = &self.ctl[slot];
        self.region_chunk(slot, c.out_region, c.out_off, chunk)
    }

    /// The docs' rule for registered buffers ("Allreduces in place" and
    /// "Broadcasts in place" in docs/datapath.md): a frame of kind `kind`
    /// (a NACK: the frame it asks for) for `chunk` in `stage` reads or
    /// writes this host's input (what it sends before it has received
    /// anything) or its output (what it receives and re-sends), each a
    /// registered buffer or the slot buffer; it is dropped (`region_err`)
    /// when one it needs is refused. An allreduce's reduce-scatter frame
    /// armed with an output region needs an input region too, of the
    /// same size class.
    pub fn docs_region_ok(&self, slot: usize, chunk: usize, kind: u8, stage: u32) -> bool {
        let c = &self.ctl[slot];
        let input = || self.input_at(slot, chunk).is_some();
        let output = || self.output_at(slot, chunk).is_some();
        if kind & NACK != 0 {
            return if stage == STAGE_NONE {
                input()
            } else {
                output()
            };
        }
        match kind {
            RS if c.out_region != 0 => self.region_pair(slot) && input() && output(),
            RS => true,
            _ => output(),
        }
    }

    /// The bytes a frame for `chunk` of `slot` may write (the slot
    /// buffer's chunk when the output is refused: then nothing is).
    pub fn written_at(&self, slot: usize, chunk: usize) -> std::ops::Range<usize> {
        let at = self
            .output_at(slot, chunk)
            .unwrap_or(self.idx(slot, chunk) * self.cb);
        at..at + self.cb
    }

    pub fn stage(&self, slot: usize, chunk: usize, seq: u32) -> u32 {
        let w = self.state[self.idx(slot, chunk)];
        if (w >> 32) as u32 == seq {
            w as u32
        } else {
            STAGE_NONE
        }
    }

    /// What erar_xdp must do with `f`; applies its effect to the model.
    pub fn run(&mut self, f: &[u8]) -> Prediction {
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
        let drop = dropped;
        // The headers in the linear part, the payload anywhere (a jumbo
        // chunk's is mostly in fragments).
        if lin.len() < PL || f.len() < PL + cb {
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
        if f[O_KIND] == READY {
            // Armed or not, before the armed check: a host joins before
            // it arms.
            return self.serve_ready(f, lin.len(), slot, p);
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
        // A frame of the armed operation: its sender passed the barrier,
        // so this host has (learn_passed): its successor counts n - 1.
        let (r, passed) = (ctl.ready, ((seq as u64) << 32) | (n - 1) as u64);
        if !((r >> 32) as u32 == seq && (r as u32).wrapping_add(1) >= n) && ready_newer(r, passed) {
            self.ctl[slot].ready = passed;
            self.ctl[slot].ready_key = ctl.key;
            p.ctr[wire::ERAR_STAT_READY_LEARNED as usize] += 1;
            ctl.wake(&mut p, slot, seq);
        }
        let chunk = chunk as usize;
        let step = f[O_STEP] as u32;
        let kind = f[O_KIND];
        let d = ctl.dist(chunk as u32);
        let stage = self.stage(slot, chunk, seq);
        let bcast = op == OP_BCAST;
        let idx = self.idx(slot, chunk);
        let own = idx * cb;
        let word = |stage: u32| ((seq as u64) << 32) | stage as u64;

        if kind & NACK != 0 {
            // Answered only if it names exactly the frame this host last
            // sent for the chunk; never changes anything here.
            match last_sent(&ctl, stage, d) {
                Some((k, s)) if kind == NACK | k && step == s as u32 => {
                    // Nothing received yet: the frame carries this host's
                    // own data.
                    let src = if stage == STAGE_NONE {
                        self.input_at(slot, chunk)
                    } else {
                        self.output_at(slot, chunk)
                    };
                    let Some(src) = src else {
                        return drop(p, wire::ERAR_STAT_REGION_ERR);
                    };
                    p.out[O_KIND] = k;
                    p.out[..L2L4].copy_from_slice(&ctl.tmpl);
                    p.out[PL..PL + cb].copy_from_slice(&self.buf[src..src + cb]);
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
            // An allreduce on registered buffers reads the one and keeps
            // the combine in the other: both or neither, of one class
            // (regions_of()).
            let (input, output) = if ctl.out_region == 0 {
                (own, own)
            } else {
                match (
                    self.region_pair(slot),
                    self.input_at(slot, chunk),
                    self.output_at(slot, chunk),
                ) {
                    (true, Some(i), Some(o)) => (i, o),
                    _ => return drop(p, wire::ERAR_STAT_REGION_ERR),
                }
            };
            p.ctr[wire::ERAR_STAT_RX_RS as usize] += 1;
            let op = match op {
                OP_FLAGS if (chunk as u32) < ctl.flags_from => 1,
                OP_FLAGS => 12,
                _ => op,
            };
            let mut kept = self.buf[input..input + cb].to_vec();
            combine(op, &mut p.out[PL..PL + cb], &mut kept);
            self.buf[output..output + cb].copy_from_slice(&kept);
            if self.copies_fragments {
                p.ctr[wire::ERAR_STAT_PAYLOAD_COPIED as usize] += 1;
            }
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
            let Some(output) = self.output_at(slot, chunk) else {
                return drop(p, wire::ERAR_STAT_REGION_ERR);
            };
            p.ctr[wire::ERAR_STAT_RX_AG as usize] += 1;
            self.buf[output..output + cb].copy_from_slice(&f[PL..PL + cb]);
            self.state[idx] = word(STAGE_FINAL);
            self.chunk_done(slot, seq, &mut p);
            if d + 2 == n + b {
                return self.end_trip(slot, seq, p);
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

    /// An all-gather frame ended its trip here: dropped, or on a ring whose
    /// frames circulate (never a broadcast's), this host's next starting
    /// frame: chunk `ring_pos * run + start_next` (start_next counts every
    /// draw), reduce-scatter step 0, this host's contribution as payload,
    /// to the next host; dropped as well if the draw is past this host's
    /// run or that chunk past the operation's or the slot's, or it is no
    /// longer untouched here.
    fn end_trip(&mut self, slot: usize, seq: u32, mut p: Prediction) -> Prediction {
        let drop = dropped;
        let c = self.ctl[slot];
        if c.circulate == 0 || c.wire_op == OP_BCAST {
            return drop(p, wire::ERAR_STAT_AG_LAST);
        }
        self.ctl[slot].start_next = c.start_next.wrapping_add(1);
        let (n, run) = (c.ring_size, c.run());
        let chunk = (c.ring_pos % n)
            .wrapping_mul(run)
            .wrapping_add(c.start_next);
        if c.start_next >= run || chunk >= c.chunks || chunk as usize >= self.cps {
            return drop(p, wire::ERAR_STAT_AG_LAST);
        }
        if self.stage(slot, chunk as usize, seq) != STAGE_NONE {
            return drop(p, wire::ERAR_STAT_AG_LAST);
        }
        let Some(src) = self.input_at(slot, chunk as usize) else {
            return drop(p, wire::ERAR_STAT_REGION_ERR);
        };
        let cb = self.cb;
        p.out[PL..PL + cb].copy_from_slice(&self.buf[src..src + cb]);
        p.out[O_KIND] = RS;
        p.out[O_STEP] = 0;
        put32(&mut p.out, O_CHUNK, chunk);
        p.out[..L2L4].copy_from_slice(&c.tmpl);
        p.ctr[wire::ERAR_STAT_CIRCULATED as usize] += 1;
        p.verdict = Verdict::Tx;
        p
    }

    /// A READY from the successor (see "Barrier" in erar_wire.h), validated
    /// like a PING (ring and token), then its count: kept if it tells more
    /// than the slot's `ready` word; if this host joined its seq, checked
    /// against the call key (a differing key turns the count into
    /// READY_ABORT before it is kept) and passed on to the predecessor as
    /// min(count + 1, n) or READY_ABORT, with an event when this host
    /// passes (count + 1 >= n) or aborts. A READY not joined (seq 0 is
    /// never joined) is kept and dropped: the rank reads `ready` when it
    /// joins (a drop that counts `ready`, no drop reason: the frame did its
    /// job); if it is of a newer operation than the one joined, the rank
    /// is woken (its successor has passed that one).
    fn serve_ready(
        &mut self,
        f: &[u8],
        lin_len: usize,
        slot: usize,
        mut p: Prediction,
    ) -> Prediction {
        let c = self.ctl[slot];
        let drop = dropped;
        if le32(f, O_COMM) != c.comm_id {
            return drop(p, wire::ERAR_STAT_DROP_COMM);
        }
        if le32(f, O_TOKEN) != c.token {
            return drop(p, wire::ERAR_STAT_DROP_TOKEN);
        }
        // The key must be in the linear part (it always is: the frame
        // already has its full length).
        if lin_len < PL + 4 * KEY_WORDS {
            return drop(p, wire::ERAR_STAT_DROP_SHORT);
        }
        let (seq, mut count, n) = (le32(f, O_SEQ), le32(f, O_CHUNK), c.ring_size);
        let step = f[O_STEP] as u32;
        if !(2..=MAX_RING).contains(&n)
            || (count != READY_ABORT && !(1..=n).contains(&count))
            || step > wire::ERAR_READY_QUERY
        {
            return drop(p, wire::ERAR_STAT_DROP_MALFORMED);
        }
        let key = key_of(f);
        let joined = c.join_seq == seq && seq != 0;
        if step == wire::ERAR_READY_QUERY {
            // A query from the predecessor: this host's count again, the
            // one its rank tells (so READY_ABORT for a count told before
            // it joined, with another key), its own key, to the
            // predecessor; nothing kept.
            if !joined {
                return drop(p, wire::ERAR_STAT_READY_STALE);
            }
            let own = count_told(rank_state(&c, seq, c.key), n);
            ready_header(&mut p.out, &c, slot, seq, own);
            for (i, k) in c.key.iter().enumerate() {
                put32(&mut p.out, PL + 4 * i, *k);
            }
            p.ctr[wire::ERAR_STAT_READY_QUERY as usize] += 1;
            p.verdict = Verdict::Tx;
            return p;
        }
        if joined && count != READY_ABORT && key != c.key {
            count = READY_ABORT;
            p.ctr[wire::ERAR_STAT_READY_ABORT as usize] += 1;
        }
        let word = ((seq as u64) << 32) | count as u64;
        if !ready_newer(c.ready, word) {
            return drop(p, wire::ERAR_STAT_READY_STALE);
        }
        self.ctl[slot].ready = word;
        self.ctl[slot].ready_key = key;
        p.ctr[wire::ERAR_STAT_READY as usize] += 1;
        if !joined {
            if c.join_seq != 0 && seq_after(seq, c.join_seq) {
                c.wake(&mut p, slot, seq);
            }
            p.verdict = Verdict::Drop;
            return p;
        }
        if count == READY_ABORT || count + 1 >= n {
            c.wake(&mut p, slot, seq);
        }
        let own = if count == READY_ABORT {
            READY_ABORT
        } else {
            (count + 1).min(n)
        };
        ready_header(&mut p.out, &c, slot, seq, own);
        p.ctr[wire::ERAR_STAT_READY_FWD as usize] += 1;
        p.verdict = Verdict::Tx;
        p
    }

    /// A rank joins operation `seq` of `slot` with call `key` (what
    /// HostDatapath::join does): key and join_seq written, then where the
    /// barrier stands read from the `ready` word, and the predecessor told
    /// its count with one READY run of the inject path (mode and count
    /// left in the slot_ctl). Returns that state and the count told.
    pub fn join(&mut self, slot: usize, seq: u32, key: [u32; KEY_WORDS]) -> (BarrierState, u32) {
        let c = &mut self.ctl[slot];
        c.key = key;
        c.join_seq = seq;
        let state = rank_state(c, seq, key);
        let told = count_told(state, c.ring_size);
        c.inject_mode = INJECT_READY;
        c.inject_count = told;
        (state, told)
    }

    /// What one run of the inject path (BPF_PROG_RUN "on" the loopback
    /// device) does with input `f`, for the cases that do not depend on an
    /// armed operation: a frame too short for the headers (inject_err, as
    /// it came); else, with linear chunks, a frame shorter than whole is
    /// first grown to whole with zeros (grow_to_frame); then a slot out of
    /// range or a token not the slot's (inject_err); else, in mode
    /// ERAR_INJECT_READY, the slot's READY: to the predecessor (nack_tmpl),
    /// seq join_seq, count inject_count, the call key in the payload's
    /// first words, the rest of the page as it came (ready_sent), or
    /// inject_err if the page cannot hold the key. None: another mode.
    pub fn inject(&self, f: &[u8]) -> Option<Prediction> {
        let mut p = Prediction {
            verdict: Verdict::Drop,
            ctr: [0; NR],
            out: f.to_vec(),
            events: Vec::new(),
        };
        let err = |mut p: Prediction| {
            p.ctr[wire::ERAR_STAT_INJECT_ERR as usize] += 1;
            Some(p)
        };
        if f.len() < PL {
            return err(p);
        }
        if self.cb <= wire::ERAR_MAX_LINEAR_CHUNK_BYTES as usize && f.len() < PL + self.cb {
            p.out.resize(PL + self.cb, 0);
        }
        let slot = le16(&p.out, O_SLOT) as usize;
        if slot >= SLOTS {
            return err(p);
        }
        let c = &self.ctl[slot];
        if le32(&p.out, O_TOKEN) != c.token {
            return err(p);
        }
        if c.inject_mode != INJECT_READY {
            return None;
        }
        if p.out.len() < PL + 4 * KEY_WORDS {
            return err(p);
        }
        ready_header(&mut p.out, c, slot, c.join_seq, c.inject_count);
        put_key(&mut p.out, c.key);
        p.ctr[wire::ERAR_STAT_READY_SENT as usize] += 1;
        p.verdict = Verdict::Redirect;
        Some(p)
    }

    fn chunk_done(&mut self, slot: usize, seq: u32, p: &mut Prediction) {
        let c = &mut self.ctl[slot];
        let old = c.done;
        c.done = old.wrapping_add(1);
        if old.wrapping_add(1) == c.chunks {
            p.ctr[wire::ERAR_STAT_COMPLETE as usize] += 1;
            c.wake(p, slot, seq);
        }
    }

    /// The (kind, step) of the frame this host last sent for a chunk of
    /// the armed operation on `slot` (what a NACK must name to be served).
    pub fn last_sent_now(&self, slot: usize, chunk: u32) -> Option<(u8, u8)> {
        let c = &self.ctl[slot];
        let seq = c.seq()?;
        if !(2..=MAX_RING).contains(&c.ring_size) || chunk >= c.chunks {
            return None;
        }
        let stage = self.stage(slot, chunk as usize, seq);
        last_sent(c, stage, c.dist(chunk))
    }

    /// The (kind, step) this host receives next for a chunk, if any.
    pub fn legit(&self, slot: usize, chunk: u32) -> Option<(u8, u8)> {
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

/// Whether seq `a` comes after seq `b`: seqs count 1..2^31-1 and wrap to
/// 1, so they compare in 31 bits (`a` less than 2^30 operations ahead).
pub fn seq_after(a: u32, b: u32) -> bool {
    let d = a.wrapping_sub(b) & 0x7fff_ffff;
    d != 0 && d < 0x4000_0000
}

/// Whether barrier word `next` ((seq << 32) | count) tells more than `old`:
/// a newer seq ([`seq_after`]), or a larger count of the same seq
/// (READY_ABORT is the largest).
pub fn ready_newer(old: u64, next: u64) -> bool {
    let (old_seq, next_seq) = ((old >> 32) as u32, (next >> 32) as u32);
    if old_seq != next_seq {
        seq_after(next_seq, old_seq)
    } else {
        next as u32 > old as u32
    }
}

/// A READY's headers as the program writes them (forwarded or injected):
/// Ethernet/IPv4/UDP to the predecessor, kind READY, step and wire_op 0,
/// the slot's ring and token, seq `seq`, chunk `count`.
fn ready_header(o: &mut [u8], c: &Ctl, slot: usize, seq: u32, count: u32) {
    o[..L2L4].copy_from_slice(&c.nack_tmpl);
    put32(o, O_MAGIC, MAGIC);
    o[O_VERSION] = VERSION;
    o[O_KIND] = READY;
    o[O_STEP] = 0;
    o[O_OP] = 0;
    put32(o, O_COMM, c.comm_id);
    put32(o, O_TOKEN, c.token);
    put32(o, O_SEQ, seq);
    put32(o, O_CHUNK, count);
    put16(o, O_SLOT, slot as u16);
    put32(o, O_RESERVED, 0);
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
/// at distance d from the chunk's origin (`Ctl::origin`): the origin sends its
/// contribution as RS step 0 and holds nothing else until the final value
/// comes back; a host 1 <= d <= n-2 forwards its partial as RS step d once
/// it has added its contribution; the host d = n-1 finishes the reduction
/// and sends it as AG step 0; AG step s is received at distance s and
/// forwarded as AG step s+1 until distance n-2 holds it. Broadcast: the root
/// sends AG step 0; a host at distance d >= 1 receives AG step d-1 and
/// forwards AG step d unless it is the root's predecessor (d = n-1).
pub fn docs_last_sent(c: &Ctl, chunk: u32, stage: u32) -> Option<(u8, u8)> {
    let n = c.ring_size;
    if !(2..=MAX_RING).contains(&n) {
        return None;
    }
    let d = (c.ring_pos + n - c.origin(chunk)) % n;
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
/// allreduce, at distance d from the chunk's origin (`Ctl::origin`): RS step d-1
/// (d >= 1) while nothing was received; then AG step d (1 <= d <= n-2); the
/// origin (d = 0) receives only AG step 0. Broadcast, at distance d >= 1
/// from the root: AG step d-1, once. The finisher (d = n-1) receives no AG.
pub fn docs_expect(c: &Ctl, chunk: u32, stage: u32) -> Option<(u8, u8)> {
    let n = c.ring_size;
    if !(2..=MAX_RING).contains(&n) {
        return None;
    }
    let d = (c.ring_pos + n - c.origin(chunk)) % n;
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

/// Where operation `seq`'s barrier stands for a rank that joined it with
/// `key`, from the `ready` word and its key (the kernel crate's
/// barrier_state): the successor on a newer operation has passed this one
/// (so has everyone); on an older one it has not joined this one yet. A
/// key told before this host joined could not be checked by XDP.
fn rank_state(c: &Ctl, seq: u32, key: [u32; KEY_WORDS]) -> BarrierState {
    let (told_seq, count) = ((c.ready >> 32) as u32, c.ready as u32);
    if told_seq != seq {
        if seq_after(told_seq, seq) {
            BarrierState::Passed
        } else {
            BarrierState::Waiting(0)
        }
    } else if count == READY_ABORT || c.ready_key != key {
        BarrierState::Aborted
    } else if count.wrapping_add(1) >= c.ring_size {
        BarrierState::Passed
    } else {
        BarrierState::Waiting(count)
    }
}

/// The count a host in `state` tells its predecessor (ring of `n`).
fn count_told(state: BarrierState, n: u32) -> u32 {
    match state {
        BarrierState::Waiting(k) => k.wrapping_add(1).min(n),
        BarrierState::Passed => n,
        BarrierState::Aborted => READY_ABORT,
    }
}
