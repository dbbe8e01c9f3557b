//! The Ethernet/IPv4/UDP header of the frames this host sends for a slot,
//! computed here (IPv4 checksum included) so XDP only copies it, and the
//! erar_hdr of the frames user space builds whole (liveness probes, jumbo
//! frames).

use std::net::Ipv4Addr;

use super::wire;

/// A template as the u64 words erar_slot_ctl stores it in.
pub(super) fn template_words(tmpl: &[u8]) -> [u64; wire::ERAR_TEMPLATE_WORDS as usize] {
    let mut words = [0u64; wire::ERAR_TEMPLATE_WORDS as usize];
    for (w, b) in words.iter_mut().zip(tmpl.chunks(8)) {
        let mut le = [0u8; 8];
        le[..b.len()].copy_from_slice(b);
        *w = u64::from_le_bytes(le);
    }
    words
}

/// Ethernet + IPv4 + UDP header (ERAR_L2L4_LEN bytes) of the frames this host
/// sends for a slot from `from` to `to` (MAC, IPv4): UDP checksum 0, DF,
/// TTL 64, IPv4 checksum set. Every offset is erar_wire.h's (from the
/// kernel's structs, through bindgen).
pub(super) fn frame_template(
    from: ([u8; 6], Ipv4Addr),
    to: ([u8; 6], Ipv4Addr),
    chunk_bytes: u32,
) -> [u8; wire::ERAR_L2L4_LEN as usize] {
    use wire::*;
    let mut f = [0u8; ERAR_L2L4_LEN as usize];
    let mut put = |at: u32, bytes: &[u8]| {
        let at = at as usize;
        f[at..at + bytes.len()].copy_from_slice(bytes);
    };
    put(ERAR_ETH_DEST_OFF, &to.0);
    put(ERAR_ETH_SOURCE_OFF, &from.0);
    put(ERAR_ETH_PROTO_OFF, &ETH_P_IPV4.to_be_bytes());
    let udp_len = ERAR_PAYLOAD_OFF - ERAR_UDP_OFF + chunk_bytes;
    let ip_len = ERAR_PAYLOAD_OFF - ERAR_IP_OFF + chunk_bytes;
    // Version 4, header length 5 words (no options): the first byte.
    put(ERAR_IP_OFF, &[0x45]);
    put(ERAR_IP_TOT_LEN_OFF, &(ip_len as u16).to_be_bytes());
    put(ERAR_IP_FRAGS_OFF, &IP_DF.to_be_bytes());
    put(ERAR_IP_TTL_OFF, &[64]);
    put(ERAR_IP_PROTO_OFF, &[IPPROTO_UDP]);
    put(ERAR_IP_SADDR_OFF, &from.1.octets());
    put(ERAR_IP_DADDR_OFF, &to.1.octets());
    put(ERAR_UDP_SOURCE_OFF, &(ERAR_UDP_PORT as u16).to_be_bytes());
    put(ERAR_UDP_DEST_OFF, &(ERAR_UDP_PORT as u16).to_be_bytes());
    put(ERAR_UDP_LEN_OFF, &(udp_len as u16).to_be_bytes());
    let csum = ipv4_checksum(&f[ERAR_IP_OFF as usize..ERAR_UDP_OFF as usize]);
    f[ERAR_IP_CHECK_OFF as usize..ERAR_IP_CHECK_OFF as usize + 2]
        .copy_from_slice(&csum.to_be_bytes());
    f
}

/// An erar_hdr as this host sends it (magic, version, reserved bytes 0):
/// `kind`, `step`, `wire_op`, the ring's (comm_id, token) and the frame's
/// (seq, chunk, slot).
pub fn erar_hdr(
    (kind, step, wire_op): (u32, u32, u32),
    (comm_id, token): (u32, u32),
    (seq, chunk, slot): (u32, u32, u32),
) -> wire::erar_hdr {
    wire::erar_hdr {
        magic: wire::ERAR_MAGIC,
        version: wire::ERAR_VERSION as u8,
        kind: kind as u8,
        step: step as u8,
        wire_op: wire_op as u8,
        comm_id,
        token,
        seq,
        chunk,
        slot: slot as u16,
        reserved: [0; 2],
    }
}

/// An erar_hdr's wire bytes.
pub fn hdr_bytes(hdr: &wire::erar_hdr) -> [u8; wire::ERAR_HDR_LEN as usize] {
    const LEN: usize = wire::ERAR_HDR_LEN as usize;
    let mut b = [0u8; LEN];
    // SAFETY: erar_hdr is a packed plain-old-data struct of exactly
    // ERAR_HDR_LEN bytes (its sizeof, erar_wire.h; wire.rs tests it).
    b.copy_from_slice(unsafe {
        std::slice::from_raw_parts(std::ptr::addr_of!(*hdr).cast::<u8>(), LEN)
    });
    b
}

/// EtherType of IPv4, IPv4's "don't fragment" flag and protocol number of
/// UDP (values of RFC 894 and 791, not layout).
const ETH_P_IPV4: u16 = 0x0800;
const IP_DF: u16 = 0x4000;
const IPPROTO_UDP: u8 = 17;

/// RFC 791 header checksum (the checksum field must be zero on input).
fn ipv4_checksum(hdr: &[u8]) -> u16 {
    let mut sum: u32 = hdr
        .chunks(2)
        .map(|w| u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]) as u32)
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_checksum_known_vector() {
        // Wikipedia's example header: checksum 0xb861.
        let mut h = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(ipv4_checksum(&h), 0xb861);
        h[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
        assert_eq!(ipv4_checksum(&h), 0);
    }

    #[test]
    fn template_layout() {
        let from = ([2, 0, 0, 0, 0, 1], Ipv4Addr::new(10, 0, 0, 1));
        let to = ([2, 0, 0, 0, 0, 2], Ipv4Addr::new(10, 0, 0, 2));
        let t = frame_template(from, to, 1024);
        // The literal offsets of RFC 894/791/768 here, erar_wire.h's
        // (computed from the kernel's structs) in frame_template.
        assert_eq!(&t[0..6], &to.0);
        assert_eq!(&t[6..12], &from.0);
        assert_eq!(&t[30..34], &to.1.octets());
        assert_eq!(ipv4_checksum(&t[14..34]), 0);
        assert_eq!(t[23], 17);
        assert_eq!(u16::from_be_bytes([t[38], t[39]]), 8 + 30 + 1024);
        assert_eq!(
            u16::from_be_bytes([t[36], t[37]]),
            wire::ERAR_UDP_PORT as u16
        );
        assert_eq!(
            u16::from_be_bytes([t[16], t[17]]) as u32,
            20 + 8 + wire::ERAR_HDR_LEN + 1024
        );
    }
}
