//! Building, inspecting and removing the emulated cluster.

use super::ipcmd::{ip, ip_batch, ip_ok, netns_list, netns_pids, netns_sh};
use super::{
    fmt_mac, xdp_switch_attach, xdp_switch_detach, BRIDGE, BRIDGE_IP, BRIDGE_MAC, HOST_IFNAME,
    MAX_HOSTS, MAX_XDP_VETH_MTU, PREFIX_LEN, XDP_SWITCH_AVAILABLE,
};
use anyhow::{bail, ensure, Context, Result};
use std::fmt;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

const HOST_NS_PREFIX: &str = "erar-h";
const PORT_PREFIX: &str = "erar-p";

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

/// What forwards frames between the hosts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SwitchKind {
    /// The plain Linux bridge, no XDP anywhere (the MPI baseline's best case).
    Bridge,
    /// The emulated-switch XDP program on every bridge port (liberar's runs).
    Xdp,
}

impl fmt::Display for SwitchKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SwitchKind::Bridge => "bridge",
            SwitchKind::Xdp => "xdp",
        })
    }
}

/// Parameters of `erarctl testbed up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TestbedConfig {
    pub hosts: usize,
    pub mtu: u32,
    pub switch: SwitchKind,
}

impl Default for TestbedConfig {
    fn default() -> Self {
        TestbedConfig {
            hosts: 4,
            mtu: super::DEFAULT_MTU,
            switch: SwitchKind::Bridge,
        }
    }
}

impl TestbedConfig {
    pub fn validate(&self) -> Result<()> {
        ensure!(
            (1..=MAX_HOSTS).contains(&self.hosts),
            "--hosts must be between 1 and {MAX_HOSTS} (got {})",
            self.hosts
        );
        ensure!(
            (576..=65535).contains(&self.mtu),
            "--mtu must be between 576 and 65535 (got {})",
            self.mtu
        );
        if self.switch == SwitchKind::Xdp {
            ensure!(
                self.mtu <= MAX_XDP_VETH_MTU,
                "--switch xdp needs --mtu <= {MAX_XDP_VETH_MTU} (jumbo frames; got {})",
                self.mtu
            );
        }
        Ok(())
    }
}

/// What `up` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpOutcome {
    /// Nothing was there; built from scratch.
    Created,
    /// Already up with these parameters: nothing done.
    Unchanged,
    /// Already up with these hosts and MTU; only the switch was changed.
    SwitchChanged,
    /// Something else (or something broken) was there: torn down and rebuilt.
    Rebuilt,
}

/// One network link as `ip -o link show` describes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct LinkInfo {
    name: String,
    flags: Vec<String>,
    mtu: Option<u32>,
    mac: Option<String>,
    master: Option<String>,
    /// `prog/xdp id N`: an XDP program is attached.
    xdp_prog_id: Option<u32>,
}

impl LinkInfo {
    fn admin_up(&self) -> bool {
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
    pub index: usize,
    pub netns: String,
    /// `eth0` exists inside the namespace.
    pub eth0_present: bool,
    pub eth0_up: bool,
    pub eth0_mac: Option<String>,
    pub eth0_mtu: Option<u32>,
    /// IPv4 address with prefix, e.g. `10.200.0.1/24`.
    pub eth0_addr: Option<String>,
    /// XDP program on the host's `eth0` (the datapath), if any.
    pub eth0_xdp_prog: Option<u32>,
    pub port: String,
    pub port_present: bool,
    pub port_up: bool,
    pub port_mtu: Option<u32>,
    pub port_master: Option<String>,
    /// XDP program on the bridge port (the emulated switch), if any.
    pub port_xdp_prog: Option<u32>,
    /// Counters of the bridge port (frames the host sent are the port's rx).
    pub port_rx_packets: u64,
    pub port_tx_packets: u64,
    pub port_rx_bytes: u64,
    pub port_tx_bytes: u64,
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
            let state = match (h.port_present, h.port_up) {
                (false, _) => "missing",
                (true, true) => "up",
                (true, false) => "down",
            };
            // A host's outgoing frames are its port's rx.
            writeln!(
                f,
                "{:<4} {:<8} {:<15} {:<17} {:>5} {:<8} {:<8} {:<7} {:<8} {:>10} {:>10}",
                h.index,
                h.netns,
                h.eth0_addr.as_deref().unwrap_or("-"),
                h.eth0_mac.as_deref().unwrap_or("-"),
                h.eth0_mtu
                    .map(|m| m.to_string())
                    .unwrap_or_else(|| "-".into()),
                prog(h.eth0_xdp_prog),
                h.port,
                state,
                prog(h.port_xdp_prog),
                h.port_tx_packets,
                h.port_rx_packets
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

/// Index of a name like `erar-h12` (prefix + decimal, no leading zeros).
fn parse_index(name: &str, prefix: &str) -> Option<usize> {
    let rest = name.strip_prefix(prefix)?;
    if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if rest.len() > 1 && rest.starts_with('0') {
        return None;
    }
    rest.parse().ok()
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
        let p = find(&port);
        let sys = |stat: &str| read_sys_u64(&format!("/sys/class/net/{port}/statistics/{stat}"));
        let h = HostStatus {
            index: i,
            netns: ns.clone(),
            eth0_present: eth0.is_some(),
            eth0_up: eth0.as_ref().is_some_and(|l| l.admin_up()),
            eth0_mac: eth0.as_ref().and_then(|l| l.mac.clone()),
            eth0_mtu: eth0.as_ref().and_then(|l| l.mtu),
            eth0_addr,
            eth0_xdp_prog: eth0.as_ref().and_then(|l| l.xdp_prog_id),
            port: port.clone(),
            port_present: p.is_some(),
            port_up: p.is_some_and(|l| l.admin_up()),
            port_mtu: p.and_then(|l| l.mtu),
            port_master: p.and_then(|l| l.master.clone()),
            port_xdp_prog: p.and_then(|l| l.xdp_prog_id),
            port_rx_packets: sys("rx_packets"),
            port_tx_packets: sys("tx_packets"),
            port_rx_bytes: sys("rx_bytes"),
            port_tx_bytes: sys("tx_bytes"),
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

    let with_xdp = hosts.iter().filter(|h| h.port_xdp_prog.is_some()).count();
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
    let ns = &h.netns;
    if !h.eth0_present {
        problems.push(format!("{ns}: no {HOST_IFNAME}"));
        return;
    }
    if !h.eth0_up {
        problems.push(format!("{ns}: {HOST_IFNAME} is down"));
    }
    let want_mac = fmt_mac(&host_mac(i));
    if h.eth0_mac.as_deref() != Some(want_mac.as_str()) {
        problems.push(format!(
            "{ns}: {HOST_IFNAME} mac is {:?}, want {want_mac}",
            h.eth0_mac
        ));
    }
    let want_addr = format!("{}/{PREFIX_LEN}", host_ip(i));
    if h.eth0_addr.as_deref() != Some(want_addr.as_str()) {
        problems.push(format!(
            "{ns}: {HOST_IFNAME} address is {:?}, want {want_addr}",
            h.eth0_addr
        ));
    }
    if !h.port_present {
        problems.push(format!("{ns}: bridge port {} is missing", h.port));
        return;
    }
    if !h.port_up {
        problems.push(format!("bridge port {} is down", h.port));
    }
    if h.port_master.as_deref() != Some(BRIDGE) {
        problems.push(format!("{} is not a port of {BRIDGE}", h.port));
    }
    if let Some(m) = bridge_mtu {
        if h.eth0_mtu != Some(m) || h.port_mtu != Some(m) {
            problems.push(format!(
                "{ns}: MTU mismatch (eth0 {:?}, {} {:?}, bridge {m})",
                h.eth0_mtu, h.port, h.port_mtu
            ));
        }
    }
}

/// Brings the test bed up. Idempotent: the same parameters again are a
/// no-op; other host counts or MTU (or a broken test bed) rebuild it; a
/// different switch only swaps the switch.
pub fn up(cfg: &TestbedConfig) -> Result<UpOutcome> {
    cfg.validate()?;
    require_root()?;
    let st = status()?;
    if st.matches(cfg.hosts, cfg.mtu) {
        if st.switch == Some(cfg.switch) {
            return Ok(UpOutcome::Unchanged);
        }
        set_switch(cfg.switch)?;
        return Ok(UpOutcome::SwitchChanged);
    }
    let outcome = if st.is_absent() {
        UpOutcome::Created
    } else {
        down(false).context("tearing down the existing test bed before rebuilding it")?;
        UpOutcome::Rebuilt
    };
    if let Err(e) = create(cfg) {
        // Leave nothing half-built behind; the original error matters more.
        if let Err(e2) = down(true) {
            log::warn!("cleanup after failed `testbed up` also failed: {e2:#}");
        }
        return Err(e.context(format!(
            "bringing up the test bed ({} hosts, MTU {})",
            cfg.hosts, cfg.mtu
        )));
    }
    if cfg.switch == SwitchKind::Xdp {
        set_switch(SwitchKind::Xdp).context(
            "the test bed is up with a plain bridge, but attaching the XDP switch failed",
        )?;
    }
    Ok(outcome)
}

fn create(cfg: &TestbedConfig) -> Result<()> {
    let n = cfg.hosts;
    let mtu = cfg.mtu.to_string();
    let br_mac = fmt_mac(&BRIDGE_MAC);

    // 1. The bridge (no STP, no multicast snooping: ports forward at once).
    let mut root = vec![
        format!(
            "link add {BRIDGE} address {br_mac} mtu {mtu} type bridge \
             stp_state 0 forward_delay 0 mcast_snooping 0"
        ),
        format!("link set dev {BRIDGE} addrgenmode none"),
        format!("addr add {BRIDGE_IP}/{PREFIX_LEN} dev {BRIDGE}"),
    ];
    for i in 0..n {
        root.push(format!("netns add {}", host_ns(i)));
    }
    ip_batch(None, "creating the bridge and host namespaces", &root)?;

    // 2. No IPv6 inside the hosts: no autoconf/MLD noise on the wire.
    for i in 0..n {
        netns_sh(
            &host_ns(i),
            "for f in /proc/sys/net/ipv6/conf/default/disable_ipv6 \
                      /proc/sys/net/ipv6/conf/all/disable_ipv6; do \
               [ -w \"$f\" ] && echo 1 > \"$f\"; done; true",
        )
        .with_context(|| format!("disabling IPv6 in {}", host_ns(i)))?;
    }

    // 3. One veth per host: eth0 created directly inside the namespace (the
    //    root namespace may have its own eth0), the peer on the bridge. One
    //    queue per CPU on both ends, as a multi-queue NIC has: XDP frames
    //    sent into a veth queue are received by its NAPI on the sending
    //    CPU, so senders on different CPUs do not funnel through one queue.
    let mut root = Vec::new();
    let q = std::thread::available_parallelism().map_or(1, |c| c.get());
    for i in 0..n {
        let (p, ns) = (port_ifname(i), host_ns(i));
        root.push(format!(
            "link add {p} address {} mtu {mtu} numtxqueues {q} numrxqueues {q} \
             type veth peer name {HOST_IFNAME} address {} mtu {mtu} \
             numtxqueues {q} numrxqueues {q} netns {ns}",
            fmt_mac(&port_mac(i)),
            fmt_mac(&host_mac(i))
        ));
        root.push(format!("link set dev {p} addrgenmode none"));
        root.push(format!("link set dev {p} master {BRIDGE}"));
        root.push(format!("link set dev {p} up"));
    }
    root.push(format!("link set dev {BRIDGE} mtu {mtu}"));
    root.push(format!("link set dev {BRIDGE} up"));
    for j in 0..n {
        root.push(format!(
            "neigh replace {} lladdr {} dev {BRIDGE} nud permanent",
            host_ip(j),
            fmt_mac(&host_mac(j))
        ));
    }
    ip_batch(None, "creating the veth pairs", &root)?;

    // 4. Inside each host: lo, eth0 address, static neighbours.
    for i in 0..n {
        let mut cmds = vec![
            "link set dev lo up".to_owned(),
            format!("link set dev {HOST_IFNAME} addrgenmode none"),
            format!("addr add {}/{PREFIX_LEN} dev {HOST_IFNAME}", host_ip(i)),
            format!("link set dev {HOST_IFNAME} up"),
            format!("neigh replace {BRIDGE_IP} lladdr {br_mac} dev {HOST_IFNAME} nud permanent"),
        ];
        for j in (0..n).filter(|&j| j != i) {
            cmds.push(format!(
                "neigh replace {} lladdr {} dev {HOST_IFNAME} nud permanent",
                host_ip(j),
                fmt_mac(&host_mac(j))
            ));
        }
        ip_batch(
            Some(&host_ns(i)),
            &format!("configuring {}", host_ns(i)),
            &cmds,
        )?;
    }

    let st = status()?;
    if !st.matches(n, cfg.mtu) {
        bail!(
            "the test bed is not consistent right after creation:\n{}",
            st.problems.join("\n")
        );
    }
    Ok(())
}

/// Removes everything of the test bed. With `force`, processes still running
/// inside the host namespaces are killed first; without it, their presence
/// is an error (a namespace with processes outlives `ip netns del`).
pub fn down(force: bool) -> Result<()> {
    require_root()?;
    let st = status()?;
    if st.is_absent() {
        return Ok(());
    }
    let namespaces: Vec<String> = st.hosts.iter().map(|h| h.netns.clone()).collect();
    let busy: Vec<(String, Vec<i32>)> = namespaces
        .iter()
        .map(|ns| (ns.clone(), netns_pids(ns)))
        .filter(|(_, p)| !p.is_empty())
        .collect();
    if !busy.is_empty() {
        let desc = busy
            .iter()
            .map(|(ns, p)| format!("{ns}: {p:?}"))
            .collect::<Vec<_>>()
            .join("; ");
        if !force {
            bail!("processes are still running inside the test bed ({desc}); stop them or use `erarctl testbed down --force`");
        }
        log::warn!("killing processes left in the test bed: {desc}");
        kill_in_namespaces(&namespaces);
    }

    let ports: Vec<String> = st
        .hosts
        .iter()
        .filter(|h| h.port_present)
        .map(|h| h.port.clone())
        .chain(st.stray_ports.iter().cloned())
        .collect();
    if XDP_SWITCH_AVAILABLE && st.hosts.iter().any(|h| h.port_xdp_prog.is_some()) {
        if let Err(e) = xdp_switch_detach(&ports) {
            log::warn!("detaching the XDP switch: {e:#} (removing the ports anyway)");
        }
    }
    // Delete the root-side veth ends first: that removes both ends at once,
    // synchronously (namespace teardown is asynchronous in the kernel).
    let mut cmds: Vec<String> = ports.iter().map(|p| format!("link del dev {p}")).collect();
    cmds.extend(namespaces.iter().map(|ns| format!("netns del {ns}")));
    if st.bridge.is_some() {
        cmds.push(format!("link del dev {BRIDGE}"));
    }
    ip_batch(None, "removing the test bed", &cmds)?;

    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = status()?;
        if st.is_absent() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the test bed is still partly present after removal:\n{st}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGKILLs every process inside the given namespaces (ours: only
/// processes started in the test bed live there), then waits for them.
pub(crate) fn kill_in_namespaces(namespaces: &[String]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pids: Vec<i32> = namespaces.iter().flat_map(|ns| netns_pids(ns)).collect();
        if pids.is_empty() || Instant::now() > deadline {
            return;
        }
        for pid in pids {
            // SAFETY: kill(2) with a specific positive pid has no memory effects.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Switches a running test bed between the plain bridge and the XDP switch.
pub fn set_switch(kind: SwitchKind) -> Result<()> {
    require_root()?;
    let st = status()?;
    ensure!(
        st.is_healthy(),
        "the test bed is not up (or broken); run `erarctl testbed up` first:\n{st}"
    );
    if st.switch == Some(kind) {
        return Ok(());
    }
    let ports: Vec<String> = st.hosts.iter().map(|h| h.port.clone()).collect();
    match kind {
        SwitchKind::Bridge => xdp_switch_detach(&ports).context("detaching the XDP switch")?,
        SwitchKind::Xdp => {
            ensure!(
                XDP_SWITCH_AVAILABLE,
                "--switch xdp is not available yet: the emulated-switch loader \
                 (liberar::testbed::switch) is not part of this build"
            );
            if let Some(mtu) = st.mtu() {
                ensure!(
                    mtu <= MAX_XDP_VETH_MTU,
                    "the XDP switch needs MTU <= {MAX_XDP_VETH_MTU}; the test bed has {mtu}"
                );
            }
            if st.switch.is_none() {
                // Mixed: start from a clean slate.
                xdp_switch_detach(&ports).context("detaching a partial XDP switch")?;
            }
            let spec: Vec<(String, [u8; 6])> = st
                .hosts
                .iter()
                .map(|h| (h.port.clone(), host_mac(h.index)))
                .collect();
            xdp_switch_attach(&spec).context("attaching the XDP switch")?;
        }
    }
    let after = status()?;
    ensure!(
        after.switch == Some(kind),
        "switch is {:?} after changing it to {kind}:\n{after}",
        after.switch
    );
    Ok(())
}

/// Test-bed changes need root (CAP_NET_ADMIN, CAP_SYS_ADMIN for netns).
pub fn require_root() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    ensure!(
        euid == 0,
        "the test bed needs root (network namespaces, veth, bridge): run with sudo"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn validates_config() {
        let ok = TestbedConfig::default();
        assert!(ok.validate().is_ok());
        assert!(TestbedConfig { hosts: 0, ..ok }.validate().is_err());
        assert!(TestbedConfig { hosts: 254, ..ok }.validate().is_err());
        assert!(TestbedConfig { mtu: 100, ..ok }.validate().is_err());
        let xdp = |mtu| TestbedConfig {
            mtu,
            switch: SwitchKind::Xdp,
            ..ok
        };
        assert!(xdp(MAX_XDP_VETH_MTU).validate().is_ok());
        assert!(xdp(MAX_XDP_VETH_MTU + 1).validate().is_err());
    }
}
