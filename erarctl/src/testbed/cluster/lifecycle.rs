//! Changing the emulated cluster: bringing it up, tearing it down,
//! swapping its switch, and killing what runs inside its hosts (all of
//! which needs root).

use super::naming::{host_ip, host_mac, host_ns, port_ifname, port_mac};
use super::{status, SwitchKind, TestbedConfig};
use crate::testbed::ipcmd::{ip_batch, netns_pids, netns_sh};
use crate::testbed::{
    fmt_mac, xdp_switch_attach, xdp_switch_detach, BRIDGE, BRIDGE_IP, BRIDGE_MAC, HOST_IFNAME,
    MAX_XDP_VETH_MTU, PREFIX_LEN, XDP_SWITCH_AVAILABLE,
};
use anyhow::{bail, ensure, Context, Result};
use std::time::{Duration, Instant};

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
    let namespaces: Vec<String> = st.hosts.iter().map(|h| h.netns()).collect();
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
        .filter(|h| h.port_link.is_some())
        .map(|h| h.port())
        .chain(st.stray_ports.iter().cloned())
        .collect();
    if XDP_SWITCH_AVAILABLE && st.hosts.iter().any(|h| h.port_xdp_prog().is_some()) {
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
    let ports: Vec<String> = st.hosts.iter().map(|h| h.port()).collect();
    match kind {
        SwitchKind::Bridge => xdp_switch_detach(&ports).context("detaching the XDP switch")?,
        SwitchKind::Xdp => {
            ensure!(
                XDP_SWITCH_AVAILABLE,
                "--switch xdp is not available yet: the emulated-switch loader \
                 (erarctl::testbed::switch) is not part of this build"
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
                .map(|h| (h.port(), host_mac(h.index)))
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
