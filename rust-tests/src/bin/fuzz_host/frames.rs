//! Frame generation: the frame classes, their weights, and the generator
//! that builds each class's frames from the model's view of the slots.

use crate::layout::{
    be16, ipv4_csum, le16, le32, put16, put32, put_key, putbe16, AG, HDR, KEY_WORDS, L2L4,
    LINEAR_MAX, MAGIC, MAX_RING, NACK, OP_BCAST, OP_NR, O_CHUNK, O_COMM, O_KIND, O_MAGIC, O_OP,
    O_RESERVED, O_SEQ, O_SLOT, O_STEP, O_TOKEN, O_VERSION, PING, PL, PONG, READY, READY_ABORT, RS,
    SLOTS, STAGE_FINAL, UDP_PORT, VERSION,
};
use crate::model::{ready_newer, Model};
use crate::rng::Rng;

pub const CLASSES: [&str; 21] = [
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
    "ping-unconf", // first frames only: PINGs, READYs, data for unconfigured slots
    "ready",       // a barrier count of a slot's ring (taken often)
    "ready-bad",   // a READY with a bad count, identity or key, or stale
];
const WEIGHTS: [u64; 21] = [
    8, 5, 8, 5, 20, 10, 10, 6, 4, 4, 4, 10, 6, 4, 10, 6, 8, 6, 0, 10, 6,
];
/// Classes 2..=13 other than "valid" and "replay" mutate a valid frame; one
/// in NACK_BASE_IN of them starts from a NACK instead of a data frame, one
/// in PING_BASE_IN of the others from a PING, one in READY_BASE_IN of the
/// rest from a READY.
const NACK_BASE_IN: u64 = 5;
const PING_BASE_IN: u64 = 8;
const READY_BASE_IN: u64 = 8;
pub const C_VALID: usize = 4;
pub const C_NACK: usize = 14;
pub const C_NACK_MISS: usize = 15;
pub const C_PING: usize = 16;
pub const C_PING_BAD: usize = 17;
/// Not drawn by weight: the first UNCONF_FRAMES frames of a run, sent
/// before any slot is configured.
pub const C_PING_UNCONF: usize = 18;
pub const C_READY: usize = 19;
pub const C_READY_BAD: usize = 20;
pub const UNCONF_FRAMES: u64 = 256;

pub struct Gen {
    pub rng: Rng,
    /// 32-bit lanes of sign/overflow edge values, for min/max/add payloads.
    pub edges: Vec<u8>,
    /// Recently generated datapath-looking frames (for "replay").
    pub history: Vec<Vec<u8>>,
    pub hist_next: usize,
}

impl Gen {
    /// A frame class, by WEIGHTS.
    pub fn class(&mut self) -> usize {
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
    pub fn base(&mut self, m: &Model, slot: usize) -> Vec<u8> {
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
    pub fn nack_served(&mut self, m: &Model, f: &mut [u8]) {
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
    pub fn ping(&mut self, m: &Model, slot: usize) -> Vec<u8> {
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

    /// A slot for a READY: mostly one on a ring of 2 or more (its READYs
    /// get past the ring-size check), a joined one more often.
    fn ready_slot(&mut self, m: &Model) -> usize {
        let rings: Vec<usize> = (0..SLOTS)
            .filter(|&s| (2..=MAX_RING).contains(&m.ctl[s].ring_size))
            .collect();
        let joined: Vec<usize> = rings
            .iter()
            .copied()
            .filter(|&s| m.ctl[s].join_seq != 0)
            .collect();
        let r = &mut self.rng;
        if !joined.is_empty() && r.chance(2, 3) {
            r.pick(&joined)
        } else if !rings.is_empty() && r.chance(9, 10) {
            r.pick(&rings)
        } else {
            r.below(SLOTS as u64) as usize
        }
    }

    /// A READY of `slot`'s ring (its comm_id and token), as a successor's
    /// inject path or XDP sends it (step and wire_op 0; the rest of the
    /// payload what the page held), or with any step / wire_op: of the
    /// operation the slot joined mostly, or of the one its `ready` word
    /// names, the next or previous one on the slot, the armed one, or one
    /// near; a count that tells more than `ready` mostly (1..=n, n,
    /// READY_ABORT now and then); the call key the slot joined with
    /// mostly, the one beside `ready`, or one word off.
    pub fn ready(&mut self, m: &Model, slot: usize) -> Vec<u8> {
        let mut f = self.base(m, slot);
        let c = m.ctl[slot];
        let r = &mut self.rng;
        f[O_KIND] = READY;
        if r.chance(3, 4) {
            f[O_STEP] = 0;
            f[O_OP] = 0;
        }
        let told = (c.ready >> 32) as u32;
        let n = c.ring_size.clamp(2, MAX_RING);
        // Mostly one that tells more than `ready` (a few tries): a barrier
        // that has passed takes nothing of its seq any more.
        let pick = |r: &mut Rng| {
            let seq = match r.below(20) {
                0..=10 => c.join_seq,
                11..=13 => told,
                14 | 15 => c.join_seq.wrapping_add(2),
                16 => c.join_seq.wrapping_sub(2),
                17 | 18 => c.armed as u32,
                _ => r.near(c.join_seq),
            };
            // Counts that grow (the next frames of the same barrier).
            let from = if seq == told && (c.ready as u32) < n {
                c.ready as u32 + 1
            } else {
                1
            };
            let count = match r.below(12) {
                0 => READY_ABORT,
                1 => n,
                2 => n - 1,
                _ => r.range(from as u64, n as u64) as u32,
            };
            (seq, count)
        };
        let mut seq_count = pick(r);
        for _ in 0..4 {
            let (seq, count) = seq_count;
            if ready_newer(c.ready, ((seq as u64) << 32) | count as u64) || r.chance(1, 8) {
                break;
            }
            seq_count = pick(r);
        }
        let (seq, count) = seq_count;
        put32(&mut f, O_SEQ, seq);
        put32(&mut f, O_CHUNK, count);
        let mut key = match r.below(10) {
            0 => c.ready_key,
            _ => c.key,
        };
        if r.chance(1, 12) {
            let w = r.below(KEY_WORDS as u64) as usize;
            key[w] = r.near(key[w]);
        }
        put_key(&mut f, key);
        if r.chance(1, 3) {
            f[PL + 4 * KEY_WORDS..].fill(0);
        }
        f
    }

    /// A READY that (mostly) must not be taken, or that aborts: a count
    /// out of 1..=n (0, n + 1, ...), another ring's comm_id / token, a slot
    /// out of range or on a ring of fewer than 2, a key that differs from
    /// the one joined with (the abort), a count that does not tell more
    /// than `ready` (stale: the same word again, a smaller count, an older
    /// seq, or one 2^31 away), or READY kind bits with more set.
    fn ready_bad(&mut self, m: &Model, slot: usize) -> Vec<u8> {
        let small: Vec<usize> = (0..SLOTS).filter(|&s| m.ctl[s].ring_size < 2).collect();
        let which = self.rng.below(10);
        let slot = if which == 3 && !small.is_empty() {
            self.rng.pick(&small)
        } else {
            slot
        };
        let mut f = self.ready(m, slot);
        let c = m.ctl[slot];
        let o = m.ctl[self.rng.below(SLOTS as u64) as usize];
        let r = &mut self.rng;
        let n = c.ring_size;
        match which {
            0 => {
                let v = match r.below(6) {
                    0 => 0,
                    1 => n.wrapping_add(1),
                    2 => READY_ABORT - 1,
                    3 => 0x8000_0000,
                    4 => r.range(n as u64 + 1, MAX_RING as u64 + 2) as u32,
                    _ => r.u32(),
                };
                put32(&mut f, O_CHUNK, v);
            }
            1 => match r.below(4) {
                0 => put32(&mut f, O_COMM, r.near(c.comm_id)),
                1 => put32(&mut f, O_TOKEN, r.near(c.token)),
                2 => put32(&mut f, O_TOKEN, o.token),
                _ => {
                    put32(&mut f, O_COMM, o.comm_id);
                    put32(&mut f, O_TOKEN, o.token);
                }
            },
            2 => put16(&mut f, O_SLOT, r.range(SLOTS as u64, 0xffff) as u16),
            // 3: the slot (maybe) on a ring of fewer than 2, chosen above.
            3 => {}
            4 | 5 => {
                // The joined operation, another key: the abort.
                put32(&mut f, O_SEQ, c.join_seq);
                let mut key = c.key;
                match r.below(3) {
                    0 => key = [u32::MAX; KEY_WORDS],
                    1 => key = std::array::from_fn(|_| r.u32()),
                    _ => {
                        let w = r.below(KEY_WORDS as u64) as usize;
                        key[w] ^= 1 << r.below(32);
                    }
                }
                put_key(&mut f, key);
            }
            6 | 7 => {
                // Stale: tells no more than the `ready` word.
                let (told, count) = ((c.ready >> 32) as u32, c.ready as u32);
                let (seq, count) = match r.below(4) {
                    0 => (told, count),
                    1 => (told, r.range(1, count.clamp(1, MAX_RING) as u64) as u32),
                    2 => (
                        told.wrapping_sub(r.range(1, 4) as u32),
                        r.range(1, 8) as u32,
                    ),
                    _ => (told ^ 0x8000_0000, r.range(1, 8) as u32),
                };
                put32(&mut f, O_SEQ, seq);
                put32(&mut f, O_CHUNK, count);
                if r.chance(1, 2) {
                    put_key(&mut f, c.ready_key);
                }
            }
            8 => f[O_KIND] = r.pick(&[NACK | READY, 0x40 | READY, READY | 0x10, 6, 0xff]),
            _ => {
                // Not the slot's join: kept, not passed on (the rank reads
                // it when it joins), unless stale.
                let seq = loop {
                    let s = r.near(c.join_seq);
                    if s != c.join_seq {
                        break s;
                    }
                };
                put32(&mut f, O_SEQ, seq);
            }
        }
        f
    }

    pub fn frame(&mut self, m: &Model, class: usize) -> Vec<u8> {
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
                return match self.rng.below(4) {
                    0 => self.ping(m, slot),
                    1 => self.ping_bad(m, slot),
                    2 => self.ready(m, slot),
                    _ => self.base(m, slot),
                };
            }
            C_READY => {
                let slot = self.ready_slot(m);
                return self.ready(m, slot);
            }
            C_READY_BAD => {
                let slot = self.ready_slot(m);
                return self.ready_bad(m, slot);
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
                } else if self.rng.chance(1, READY_BASE_IN) {
                    f = self.ready(m, slot);
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
                    // Into the fragments (a jumbo frame is there already:
                    // up to one more page).
                    let upto = (2 * LINEAR_MAX).saturating_sub(full).max(4096);
                    r.range(1, upto as u64) as usize
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
                2 => f[O_KIND] = r.pick(&[0, RS, AG, PING, PONG, READY, 0xff, rnd as u8]),
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
                f[O_KIND] = r.pick(&[RS, RS, AG, AG, 0, PING, PONG, READY, rnd as u8]);
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

    pub fn remember(&mut self, f: &[u8]) {
        const H: usize = 256;
        if self.history.len() < H {
            self.history.push(f.to_vec());
        } else {
            self.history[self.hist_next] = f.to_vec();
            self.hist_next = (self.hist_next + 1) % H;
        }
    }
}

/// A call key as ranks make them (CallKey: what, size in two 31-bit words,
/// root), from a small set so that hosts agree often, or the key of a host
/// whose slot could not be armed (every word u32::MAX).
pub fn call_key(r: &mut Rng) -> [u32; KEY_WORDS] {
    match r.below(8) {
        0 => [u32::MAX; KEY_WORDS],
        1 => std::array::from_fn(|_| r.u32()),
        _ => [
            r.pick(&[0x0101, 0x2212, 0x1331, 0x0002]),
            r.pick(&[64, 4096, 1 << 20, 0x7fff_ffff]),
            r.pick(&[0, 0, 1]),
            r.below(4) as u32,
        ],
    }
}
