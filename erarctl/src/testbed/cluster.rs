//! Building, inspecting and removing the emulated cluster.
//!
//! This file holds the test bed's parameters ([`TestbedConfig`],
//! [`SwitchKind`]); the rest is split by job and re-exported here:
//! `naming` (host names and addresses), `inspect` ([`status`]) and
//! `lifecycle` ([`up`], [`down`], [`set_switch`]).

mod inspect;
mod lifecycle;
mod naming;

pub use inspect::{status, BridgeStatus, HostStatus, LinkInfo, PortCounters, TestbedStatus};
pub(crate) use lifecycle::kill_in_namespaces;
pub use lifecycle::{down, require_root, set_switch, up, UpOutcome};
pub use naming::{host_ip, host_mac, host_ns, port_ifname, port_mac};

use super::{MAX_HOSTS, MAX_XDP_VETH_MTU};
use anyhow::{ensure, Result};
use std::fmt;

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

#[cfg(test)]
mod tests {
    use super::*;

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
