//! Names and addresses of the emulated hosts: namespace and bridge-port
//! names, IPv4 and MAC addresses, and reading a host's index back from
//! a name.

use std::net::Ipv4Addr;

pub(super) const HOST_NS_PREFIX: &str = "erar-h";
pub(super) const PORT_PREFIX: &str = "erar-p";

/// Network namespace of host `i`.
pub fn host_ns(i: usize) -> String {
    format!("{HOST_NS_PREFIX}{i}")
}

/// Bridge port (root namespace) that connects host `i`.
pub fn port_ifname(i: usize) -> String {
    format!("{PORT_PREFIX}{i}")
}

/// Address of host `i`'s `eth0`.
pub fn host_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 200, 0, (i + 1) as u8)
}

/// MAC of host `i`'s `eth0`.
pub fn host_mac(i: usize) -> [u8; 6] {
    [0x02, 0xe7, 0xa1, 0x00, 0x00, (i + 1) as u8]
}

/// MAC of bridge port `erar-p{i}`.
pub fn port_mac(i: usize) -> [u8; 6] {
    [0x02, 0xe7, 0xa1, 0x01, 0x00, (i + 1) as u8]
}

/// Index of a name like `erar-h12` (prefix + decimal, no leading zeros).
pub(super) fn parse_index(name: &str, prefix: &str) -> Option<usize> {
    let rest = name.strip_prefix(prefix)?;
    if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if rest.len() > 1 && rest.starts_with('0') {
        return None;
    }
    rest.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testbed::fmt_mac;

    #[test]
    fn names_and_addresses() {
        assert_eq!(host_ns(3), "erar-h3");
        assert_eq!(port_ifname(0), "erar-p0");
        assert_eq!(host_ip(0), Ipv4Addr::new(10, 200, 0, 1));
        assert_eq!(fmt_mac(&host_mac(9)), "02:e7:a1:00:00:0a");
        assert_eq!(fmt_mac(&port_mac(0)), "02:e7:a1:01:00:01");
        assert_eq!(parse_index("erar-h12", "erar-h"), Some(12));
        assert_eq!(parse_index("erar-h012", "erar-h"), None);
        assert_eq!(parse_index("erar-hx", "erar-h"), None);
        assert_eq!(parse_index("erar-h", "erar-h"), None);
    }
}
