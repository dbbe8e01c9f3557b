//! Inspecting the emulated cluster, never changing it: what
//! `erarctl testbed status` reports ([`TestbedStatus`]), read from
//! `ip link`/`ip addr` and sysfs, and the consistency checks behind it.

use super::naming::{
    host_ip, host_mac, host_ns, parse_index, port_ifname, HOST_NS_PREFIX, PORT_PREFIX,
};
use super::SwitchKind;
use crate::testbed::ipcmd::{ip, ip_ok, netns_list};
use crate::testbed::{fmt_mac, BRIDGE, BRIDGE_IP, HOST_IFNAME, PREFIX_LEN};
use anyhow::{Context, Result};
use std::fmt;

/// One network link as `ip -o link show` describes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkInfo {
    pub name: String,
    pub flags: Vec<String>,
    pub mtu: Option<u32>,
    pub mac: Option<String>,
    /// The bridge it is a port of.
    pub master: Option<String>,
    /// `prog/xdp id N`: an XDP program is attached.
    pub xdp_prog_id: Option<u32>,
}

impl LinkInfo {
    pub fn admin_up(&self) -> bool {
        self.flags.iter().any(|f| f == "UP")
    }
}

/// Parses the output of `ip -o link show` (one link per line).
fn parse_links(text: &str) -> Vec<LinkInfo> {
    let mut links = Vec::new();
    for line in text.lines() {
        let mut toks = line.split_whitespace().peekable();
        // "5:" "erar-p0@if2:" "<FLAGS>" …
        if toks.next().is_none() {
            continue;
        }
        let Some(name) = toks.next() else { continue };
        let name = name.trim_end_matches(':');
        let name = name.split('@').next().unwrap_or(name).to_owned();
        let mut li = LinkInfo {
            name,
            ..LinkInfo::default()
        };
        while let Some(t) = toks.next() {
            if t.starts_with('<') {
                li.flags = t
                    .trim_matches(|c| c == '<' || c == '>')
                    .split(',')
                    .map(str::to_owned)
                    .collect();
                continue;
            }
            match t {
                "mtu" => li.mtu = toks.next().and_then(|v| v.parse().ok()),
                "master" => li.master = toks.next().map(str::to_owned),
                "link/ether" => li.mac = toks.next().map(str::to_owned),
                "prog/xdp" | "prog/xdpdrv" | "prog/xdpgeneric" | "prog/xdpoffload"
                    if toks.peek() == Some(&"id") =>
                {
                    toks.next();
                    li.xdp_prog_id = toks.next().and_then(|v| v.parse().ok());
                }
                _ => {}
            }
        }
        links.push(li);
    }
    links
}

/// The root-namespace side of the test bed.
#[derive(Clone, Debug)]
pub struct BridgeStatus {
    pub mtu: Option<u32>,
    pub mac: Option<String>,
    pub up: bool,
    pub has_address: bool,
}

/// One emulated host as found on the system.
#[derive(Clone, Debug)]
pub struct HostStatus {
    /// Its number: its namespace is `erar-h<index>` ([`Self::netns`]), its
    /// bridge port `erar-p<index>` ([`Self::port`]).
    pub index: usize,
    /// `eth0` inside the namespace (`None`: missing); an XDP program on it
    /// is the datapath.
    pub eth0: Option<LinkInfo>,
    /// IPv4 address with prefix, e.g. `10.200.0.1/24`.
    pub eth0_addr: Option<String>,
    /// The bridge port in the root namespace (`None`: missing).
    pub port_link: Option<LinkInfo>,
    pub port_counters: PortCounters,
}

/// A bridge port's counters, from sysfs (0 where unreadable): the frames
/// its host sent are the port's rx.
#[derive(Clone, Copy, Debug, Default)]
pub struct PortCounters {
    pub rx_packets: u64,
    pub tx_packets: u64,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

impl PortCounters {
    fn read(port: &str) -> PortCounters {
        let sys = |stat: &str| read_sys_u64(&format!("/sys/class/net/{port}/statistics/{stat}"));
        PortCounters {
            rx_packets: sys("rx_packets"),
            tx_packets: sys("tx_packets"),
            rx_bytes: sys("rx_bytes"),
            tx_bytes: sys("tx_bytes"),
        }
    }
}

impl HostStatus {
    /// The name of its network namespace.
    pub fn netns(&self) -> String {
        host_ns(self.index)
    }

    /// The name of its bridge port.
    pub fn port(&self) -> String {
        port_ifname(self.index)
    }

    /// The XDP program on the bridge port (the emulated switch), if any.
    pub fn port_xdp_prog(&self) -> Option<u32> {
        self.port_link.as_ref().and_then(|l| l.xdp_prog_id)
    }
}

/// Everything `erarctl testbed status` reports.
#[derive(Clone, Debug)]
pub struct TestbedStatus {
    /// `None`: no bridge.
    pub bridge: Option<BridgeStatus>,
    /// Namespaces `erar-h<i>`, sorted by index.
    pub hosts: Vec<HostStatus>,
    /// `erar-p*` links in the root namespace with no matching host.
    pub stray_ports: Vec<String>,
    /// Human-readable inconsistencies (empty when healthy).
    pub problems: Vec<String>,
    /// `Some` when every port agrees (no XDP anywhere, or XDP on all).
    pub switch: Option<SwitchKind>,
    /// `net.bridge.bridge-nf-call-iptables` is on: bridged IPv4 frames go
    /// through iptables (a firewall on this machine could drop MPI traffic).
    pub bridge_nf_call_iptables: bool,
}

impl TestbedStatus {
    /// Nothing of the test bed exists.
    pub fn is_absent(&self) -> bool {
        self.bridge.is_none() && self.hosts.is_empty() && self.stray_ports.is_empty()
    }

    /// Up, consistent, hosts numbered 0..n-1.
    pub fn is_healthy(&self) -> bool {
        self.bridge.is_some() && !self.hosts.is_empty() && self.problems.is_empty()
    }

    /// The bridge MTU (the test bed's MTU).
    pub fn mtu(&self) -> Option<u32> {
        self.bridge.as_ref().and_then(|b| b.mtu)
    }

    /// Healthy with exactly these hosts and this MTU (switch not compared).
    pub fn matches(&self, hosts: usize, mtu: u32) -> bool {
        self.is_healthy() && self.hosts.len() == hosts && self.mtu() == Some(mtu)
    }
}

impl fmt::Display for TestbedStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_absent() {
            return writeln!(f, "testbed: down (nothing of it exists)");
        }
        let state = if self.is_healthy() { "up" } else { "BROKEN" };
        let sw = self
            .switch
            .map(|s| s.to_string())
            .unwrap_or_else(|| "mixed".into());
        let mtu = self
            .mtu()
            .map(|m| m.to_string())
            .unwrap_or_else(|| "?".into());
        writeln!(
            f,
            "testbed: {state}, {} hosts, MTU {mtu}, switch {sw}",
            self.hosts.len()
        )?;
        match &self.bridge {
            Some(b) => writeln!(
                f,
                "bridge {BRIDGE}: {} {BRIDGE_IP}/{PREFIX_LEN} mac {} mtu {}",
                if b.up { "UP" } else { "DOWN" },
                b.mac.as_deref().unwrap_or("?"),
                b.mtu.map(|m| m.to_string()).unwrap_or_else(|| "?".into())
            )?,
            None => writeln!(f, "bridge {BRIDGE}: missing")?,
        }
        writeln!(
            f,
            "{:<4} {:<8} {:<15} {:<17} {:>5} {:<8} {:<8} {:<7} {:<8} {:>10} {:>10}",
            "host",
            "netns",
            "eth0 address",
            "eth0 mac",
            "mtu",
            "eth0 xdp",
            "port",
            "state",
            "port xdp",
            "frames in",
            "frames out"
        )?;
        for h in &self.hosts {
            let prog =
                |p: Option<u32>| p.map(|id| format!("id {id}")).unwrap_or_else(|| "-".into());
            let state = match &h.port_link {
                None => "missing",
                Some(l) if l.admin_up() => "up",
                Some(_) => "down",
            };
            let eth0 = h.eth0.as_ref();
            // A host's outgoing frames are its port's rx.
            writeln!(
                f,
                "{:<4} {:<8} {:<15} {:<17} {:>5} {:<8} {:<8} {:<7} {:<8} {:>10} {:>10}",
                h.index,
                h.netns(),
                h.eth0_addr.as_deref().unwrap_or("-"),
                eth0.and_then(|l| l.mac.as_deref()).unwrap_or("-"),
                eth0.and_then(|l| l.mtu)
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| "-".into()),
                prog(eth0.and_then(|l| l.xdp_prog_id)),
                h.port(),
                state,
                prog(h.port_xdp_prog()),
                h.port_counters.tx_packets,
                h.port_counters.rx_packets
            )?;
        }
        if self.bridge_nf_call_iptables {
            writeln!(
                f,
                "note: net.bridge.bridge-nf-call-iptables=1: bridged traffic passes iptables \
                 (a FORWARD DROP policy would block MPI between hosts)"
            )?;
        }
        if self.problems.is_empty() {
            writeln!(f, "problems: none")?;
        } else {
            writeln!(f, "problems:")?;
            for p in &self.problems {
                writeln!(f, "  - {p}")?;
            }
        }
        Ok(())
    }
}

fn read_sys_u64(path: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Inspects the system. Never changes anything.
pub fn status() -> Result<TestbedStatus> {
    let root_links = parse_links(&ip(&["-o", "link", "show"]).context("listing links")?);
    let find = |n: &str| root_links.iter().find(|l| l.name == n);

    let bridge = find(BRIDGE).map(|b| {
        let addrs = ip_ok(&["-o", "-4", "addr", "show", "dev", BRIDGE]).unwrap_or_default();
        BridgeStatus {
            mtu: b.mtu,
            mac: b.mac.clone(),
            up: b.admin_up(),
            has_address: addrs.contains(&format!("{BRIDGE_IP}/{PREFIX_LEN}")),
        }
    });

    let mut indices: Vec<usize> = netns_list()
        .context("listing network namespaces")?
        .iter()
        .filter_map(|n| parse_index(n, HOST_NS_PREFIX))
        .collect();
    indices.sort_unstable();

    let mut problems = Vec::new();
    let mut hosts = Vec::new();
    for &i in &indices {
        let ns = host_ns(i);
        let port = port_ifname(i);
        let eth0 = ip_ok(&["-n", &ns, "-o", "link", "show", "dev", HOST_IFNAME])
            .map(|t| parse_links(&t))
            .and_then(|v| v.into_iter().next());
        let eth0_addr = ip_ok(&["-n", &ns, "-o", "-4", "addr", "show", "dev", HOST_IFNAME])
            .and_then(|t| {
                t.split_whitespace()
                    .skip_while(|w| *w != "inet")
                    .nth(1)
                    .map(str::to_owned)
            });
        let h = HostStatus {
            index: i,
            eth0,
            eth0_addr,
            port_link: find(&port).cloned(),
            port_counters: PortCounters::read(&port),
        };
        check_host(&h, bridge.as_ref().and_then(|b| b.mtu), &mut problems);
        hosts.push(h);
    }

    for (pos, &i) in indices.iter().enumerate() {
        if pos != i {
            problems.push(format!(
                "hosts are not numbered 0..{}: found {}",
                indices.len(),
                host_ns(i)
            ));
            break;
        }
    }
    let stray_ports: Vec<String> = root_links
        .iter()
        .filter_map(|l| parse_index(&l.name, PORT_PREFIX).map(|i| (i, &l.name)))
        .filter(|(i, _)| !indices.contains(i))
        .map(|(_, n)| n.clone())
        .collect();
    for s in &stray_ports {
        problems.push(format!("bridge port {s} has no host namespace"));
    }
    match &bridge {
        None if !indices.is_empty() => problems.push(format!("bridge {BRIDGE} is missing")),
        Some(b) => {
            if !b.up {
                problems.push(format!("bridge {BRIDGE} is down"));
            }
            if !b.has_address {
                problems.push(format!("bridge {BRIDGE} lacks {BRIDGE_IP}/{PREFIX_LEN}"));
            }
            if indices.is_empty() {
                problems.push(format!("bridge {BRIDGE} exists but there are no hosts"));
            }
        }
        None => {}
    }

    let with_xdp = hosts.iter().filter(|h| h.port_xdp_prog().is_some()).count();
    let switch = if with_xdp == 0 {
        Some(SwitchKind::Bridge)
    } else if with_xdp == hosts.len() {
        Some(SwitchKind::Xdp)
    } else {
        problems.push(format!(
            "switch is mixed: {with_xdp} of {} bridge ports carry an XDP program",
            hosts.len()
        ));
        None
    };

    Ok(TestbedStatus {
        bridge,
        hosts,
        stray_ports,
        problems,
        switch,
        bridge_nf_call_iptables: read_sys_u64("/proc/sys/net/bridge/bridge-nf-call-iptables") == 1,
    })
}

fn check_host(h: &HostStatus, bridge_mtu: Option<u32>, problems: &mut Vec<String>) {
    let i = h.index;
    let (ns, port_name) = (h.netns(), h.port());
    let Some(eth0) = &h.eth0 else {
        problems.push(format!("{ns}: no {HOST_IFNAME}"));
        return;
    };
    if !eth0.admin_up() {
        problems.push(format!("{ns}: {HOST_IFNAME} is down"));
    }
    let want_mac = fmt_mac(&host_mac(i));
    if eth0.mac.as_deref() != Some(want_mac.as_str()) {
        problems.push(format!(
            "{ns}: {HOST_IFNAME} mac is {:?}, want {want_mac}",
            eth0.mac
        ));
    }
    let want_addr = format!("{}/{PREFIX_LEN}", host_ip(i));
    if h.eth0_addr.as_deref() != Some(want_addr.as_str()) {
        problems.push(format!(
            "{ns}: {HOST_IFNAME} address is {:?}, want {want_addr}",
            h.eth0_addr
        ));
    }
    let Some(port) = &h.port_link else {
        problems.push(format!("{ns}: bridge port {port_name} is missing"));
        return;
    };
    if !port.admin_up() {
        problems.push(format!("bridge port {port_name} is down"));
    }
    if port.master.as_deref() != Some(BRIDGE) {
        problems.push(format!("{port_name} is not a port of {BRIDGE}"));
    }
    if let Some(m) = bridge_mtu {
        if eth0.mtu != Some(m) || port.mtu != Some(m) {
            problems.push(format!(
                "{ns}: MTU mismatch (eth0 {:?}, {port_name} {:?}, bridge {m})",
                eth0.mtu, port.mtu
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ip_link_lines() {
        let text = "5: erar-p0@if2: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 3400 xdp qdisc noqueue master erar-br0 state UP mode DEFAULT group default qlen 1000\\    link/ether 02:e7:a1:01:00:01 brd ff:ff:ff:ff:ff:ff link-netns erar-h0\\    prog/xdp id 42 name erar_switch tag 0123 jited \n\
                    2: eth0@if5: <BROADCAST,MULTICAST> mtu 1500 qdisc noop state DOWN mode DEFAULT group default qlen 1000\\    link/ether 02:e7:a1:00:00:02 brd ff:ff:ff:ff:ff:ff link-netnsid 0\n";
        let l = parse_links(text);
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].name, "erar-p0");
        assert!(l[0].admin_up());
        assert_eq!(l[0].mtu, Some(3400));
        assert_eq!(l[0].master.as_deref(), Some("erar-br0"));
        assert_eq!(l[0].mac.as_deref(), Some("02:e7:a1:01:00:01"));
        assert_eq!(l[0].xdp_prog_id, Some(42));
        assert_eq!(l[1].name, "eth0");
        assert!(!l[1].admin_up());
        assert_eq!(l[1].xdp_prog_id, None);
    }
}
