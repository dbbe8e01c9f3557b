//! The frame layout of docs/datapath.md, written out independently of the
//! program's headers, and the byte helpers that read and write frames.

pub const L2L4: usize = 42;
pub const HDR: usize = 30;
pub const PL: usize = L2L4 + HDR; // payload offset, 72
pub const O_MAGIC: usize = 42;
pub const O_VERSION: usize = 46;
pub const O_KIND: usize = 47;
pub const O_STEP: usize = 48;
pub const O_OP: usize = 49;
pub const O_COMM: usize = 50;
pub const O_TOKEN: usize = 54;
pub const O_SEQ: usize = 58;
pub const O_CHUNK: usize = 62;
pub const O_SLOT: usize = 66;
pub const O_RESERVED: usize = 68;

pub const MAGIC: u32 = 0x5241_5245;
pub const VERSION: u8 = 3;
pub const UDP_PORT: u16 = 47470;
pub const RS: u8 = 1;
pub const AG: u8 = 2;
/// Kind flag of a NACK ("I miss your (kind & 0x7f, step) frame").
pub const NACK: u8 = 0x80;
/// A liveness probe, and the kind of its answer.
pub const PING: u8 = 3;
pub const PONG: u8 = 4;
/// A barrier count to the predecessor: "`chunk` hosts from me on down the
/// ring joined operation `seq` with the call key in the payload's first
/// KEY_WORDS words", or READY_ABORT (keys differ).
pub const READY: u8 = 5;
pub const READY_ABORT: u32 = u32::MAX;
pub const KEY_WORDS: usize = 4;
/// erar_slot_ctl.inject_mode of a READY run of the inject path.
pub const INJECT_READY: u32 = 4;
pub const OP_BCAST: u32 = 14;
/// Flagged float SUM: ADD_I32 below the armed `flags_from` chunk, OR above.
pub const OP_FLAGS: u32 = 15;
pub const OP_NR: u32 = 16;
pub const SLOTS: usize = 8;
pub const MAX_RING: u32 = 128;
pub const ARMED_BIT: u64 = 1 << 32;
pub const STAGE_NONE: u32 = 0;
pub const STAGE_BUSY: u32 = 1;
pub const STAGE_REDUCED: u32 = 2;
pub const STAGE_FINAL: u32 = 3;

/// Largest linear part of a BPF_PROG_RUN XDP frame: PAGE_SIZE minus
/// XDP_PACKET_HEADROOM (256) minus the aligned skb_shared_info (320); longer
/// input goes to fragments, which the program does not see through
/// `data_end`.
pub const LINEAR_MAX: usize = 4096 - 256 - 320;

pub fn le32(f: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(f[o..o + 4].try_into().unwrap())
}
pub fn le16(f: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(f[o..o + 2].try_into().unwrap())
}
pub fn be16(f: &[u8], o: usize) -> u16 {
    u16::from_be_bytes(f[o..o + 2].try_into().unwrap())
}
pub fn put32(f: &mut [u8], o: usize, v: u32) {
    f[o..o + 4].copy_from_slice(&v.to_le_bytes());
}
/// The call key in a READY frame's payload.
pub fn key_of(f: &[u8]) -> [u32; KEY_WORDS] {
    std::array::from_fn(|i| le32(f, PL + 4 * i))
}
pub fn put_key(f: &mut [u8], key: [u32; KEY_WORDS]) {
    for (i, w) in key.iter().enumerate() {
        put32(f, PL + 4 * i, *w);
    }
}
pub fn put16(f: &mut [u8], o: usize, v: u16) {
    f[o..o + 2].copy_from_slice(&v.to_le_bytes());
}
pub fn putbe16(f: &mut [u8], o: usize, v: u16) {
    f[o..o + 2].copy_from_slice(&v.to_be_bytes());
}

pub fn ipv4_csum(h: &[u8]) -> u16 {
    let mut s: u32 = h
        .chunks(2)
        .map(|w| u16::from_be_bytes([w[0], w[1]]) as u32)
        .sum();
    while s > 0xffff {
        s = (s & 0xffff) + (s >> 16);
    }
    !(s as u16)
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
