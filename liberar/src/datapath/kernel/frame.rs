//! The Ethernet/IPv4/UDP header of the frames this host sends for a slot,
//! computed here (IPv4 checksum included) so XDP only copies it.

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
/// TTL 64, IPv4 checksum set.
pub(super) fn frame_template(
    from: ([u8; 6], Ipv4Addr),
    to: ([u8; 6], Ipv4Addr),
    chunk_bytes: u32,
) -> [u8; wire::ERAR_L2L4_LEN as usize] {
    let mut f = [0u8; wire::ERAR_L2L4_LEN as usize];
    f[0..6].copy_from_slice(&to.0);
    f[6..12].copy_from_slice(&from.0);
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let udp_len = 8 + wire::ERAR_HDR_LEN + chunk_bytes;
    let ip_len = 20 + udp_len;
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&(ip_len as u16).to_be_bytes());
    ip[6..8].copy_from_slice(&0x4000u16.to_be_bytes()); // DF
    ip[8] = 64;
    ip[9] = 17; // UDP
    ip[12..16].copy_from_slice(&from.1.octets());
    ip[16..20].copy_from_slice(&to.1.octets());
    let csum = ipv4_checksum(ip);
    ip[10..12].copy_from_slice(&csum.to_be_bytes());
    let udp = &mut f[34..42];
    udp[0..2].copy_from_slice(&(wire::ERAR_UDP_PORT as u16).to_be_bytes());
    udp[2..4].copy_from_slice(&(wire::ERAR_UDP_PORT as u16).to_be_bytes());
    udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    f
}

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
        assert_eq!(&t[0..6], &to.0);
        assert_eq!(&t[6..12], &from.0);
        assert_eq!(&t[30..34], &to.1.octets());
        assert_eq!(ipv4_checksum(&t[14..34]), 0);
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
