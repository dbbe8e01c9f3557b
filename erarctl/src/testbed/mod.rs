//! The emulated Ethernet cluster: network namespaces on a bridge, and a
//! launcher that runs MPI rank i inside host i.
//!
//! Layout (all names fixed so runs are reproducible):
//!
//! * host i = network namespace `erar-h{i}` with one veth `eth0`,
//!   address `10.200.0.{i+1}/24`, MAC `02:e7:a1:00:00:{i+1:02x}`;
//! * its peer `erar-p{i}` (MAC `02:e7:a1:01:00:{i+1:02x}`) is a port of the
//!   Linux bridge `erar-br0` (`10.200.0.254/24`, MAC `02:e7:a1:00:00:fe`)
//!   in the root namespace — the "switch";
//! * every host has permanent neighbour entries for all other hosts and the
//!   bridge, so no ARP is ever needed and `ip neigh` tells the datapath the
//!   next hop's MAC;
//! * IPv6 is off inside the hosts and no link-local addresses are generated
//!   on the ports, so the only traffic on the wire is what a test sends.
//!
//! [`cluster`] builds, inspects and removes it; [`launch`] runs MPI jobs on
//! it. The command-line front end is `erarctl testbed …` / `erarctl run …`.

pub mod cluster;
pub mod cpus;
pub mod impair;
pub mod ipcmd;
pub mod launch;
pub mod switch;

pub use cluster::{
    down, host_ip, host_mac, host_ns, port_ifname, port_mac, set_switch, status, up, HostStatus,
    LinkInfo, PortCounters, SwitchKind, TestbedConfig, TestbedStatus, UpOutcome,
};
pub use launch::{launch, launch_inherit, Hung, LaunchSpec, Mpi};

/// The bridge in the root namespace that connects all hosts.
pub const BRIDGE: &str = "erar-br0";
/// The bridge's address (MPI launchers listen on it).
pub const BRIDGE_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 200, 0, 254);
/// Prefix length of the test-bed subnet 10.200.0.0/24.
pub const PREFIX_LEN: u8 = 24;
/// The bridge's MAC address.
pub const BRIDGE_MAC: [u8; 6] = [0x02, 0xe7, 0xa1, 0x00, 0x00, 0xfe];
/// Name of each host's interface (inside its namespace).
pub const HOST_IFNAME: &str = "eth0";
/// Host i gets 10.200.0.{i+1}; .254 is the bridge.
pub const MAX_HOSTS: usize = 253;
/// Default link MTU.
pub const DEFAULT_MTU: u32 = 1500;
/// Largest MTU the test bed offers with the XDP switch: the usual jumbo
/// frame. Both XDP programs are multi-buffer aware (xdp.frags), which veth
/// (like NIC drivers) requires above one page per frame (3506 here).
pub const MAX_XDP_VETH_MTU: u32 = 9000;

/// Formats a MAC address as `aa:bb:cc:dd:ee:ff`.
pub fn fmt_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

// XDP switch hook — the single place that calls [`switch`] (the emulated
// hardware switch, bpf/testbed_switch.bpf.c).

/// Whether `--switch xdp` can be used in this build.
pub const XDP_SWITCH_AVAILABLE: bool = true;

/// Attaches the emulated-switch XDP program to the bridge ports.
/// `ports`: (bridge port ifname, MAC of the host behind it).
pub(crate) fn xdp_switch_attach(ports: &[(String, [u8; 6])]) -> anyhow::Result<()> {
    let ports: Vec<switch::SwitchPort> = ports
        .iter()
        .map(|(n, m)| switch::SwitchPort {
            port_ifname: n.clone(),
            host_mac: *m,
        })
        .collect();
    switch::attach(&ports)
}

/// Removes the emulated-switch XDP program from the given bridge ports.
pub(crate) fn xdp_switch_detach(port_ifnames: &[String]) -> anyhow::Result<()> {
    switch::detach(port_ifnames)
}
