//! Which interface carries this host's MPI traffic, and its addresses.

use std::ffi::{CStr, CString};
use std::net::Ipv4Addr;

use anyhow::{Context, Result};

/// An IPv4 interface that could carry the ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub name: String,
    pub ipv4: Ipv4Addr,
    pub netmask: Ipv4Addr,
    pub mac: [u8; 6],
    pub mtu: u32,
}

impl Candidate {
    pub fn same_subnet(&self, other: Ipv4Addr) -> bool {
        let m = u32::from(self.netmask);
        u32::from(self.ipv4) & m == u32::from(other) & m
    }
}

/// Up, non-loopback Ethernet interfaces with an IPv4 address, in the
/// kernel's order; only `only` if given (`ERAR_IFACE`).
pub fn candidates(only: Option<&str>) -> std::io::Result<Vec<Candidate>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` walks the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_netmask.is_null() {
            continue;
        }
        let flags = ifa.ifa_flags as libc::c_int;
        if flags & libc::IFF_UP == 0 || flags & libc::IFF_LOOPBACK != 0 {
            continue;
        }
        // SAFETY: ifa_addr is non-null and sa_family tells its real type.
        if unsafe { (*ifa.ifa_addr).sa_family } as libc::c_int != libc::AF_INET {
            continue;
        }
        // SAFETY: AF_INET addresses are sockaddr_in.
        let (addr, mask) = unsafe {
            let a = &*(ifa.ifa_addr as *const libc::sockaddr_in);
            let m = &*(ifa.ifa_netmask as *const libc::sockaddr_in);
            (
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                Ipv4Addr::from(u32::from_be(m.sin_addr.s_addr)),
            )
        };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let (Some(mac), Some(mtu)) = (read_mac(&name), read_sys(&name, "mtu")) else {
            continue; // not Ethernet (e.g. a tunnel): no MAC to address frames to
        };
        out.push(Candidate {
            name,
            ipv4: addr,
            netmask: mask,
            mac,
            mtu,
        });
    }
    // SAFETY: frees the list getifaddrs allocated; no reference outlives it.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

fn read_sys(ifname: &str, attr: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/sys/class/net/{ifname}/{attr}"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn read_mac(ifname: &str) -> Option<[u8; 6]> {
    let s = std::fs::read_to_string(format!("/sys/class/net/{ifname}/address")).ok()?;
    let mut mac = [0u8; 6];
    let mut parts = s.trim().split(':');
    for b in mac.iter_mut() {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    (parts.next().is_none() && mac != [0; 6]).then_some(mac)
}

/// Index of interface `ifname` in this network namespace.
pub fn if_index(ifname: &str) -> Result<u32> {
    let c = CString::new(ifname).with_context(|| format!("interface name {ifname:?}"))?;
    // SAFETY: c is a valid C string.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("no interface {ifname}"));
    }
    Ok(idx)
}
