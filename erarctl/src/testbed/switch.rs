//! The emulated hardware switch of the test bed (bpf/testbed_switch.bpf.c).
//!
//! On every bridge port (the root-namespace end of a host's veth), datapath
//! frames are redirected by destination MAC straight to the port of that
//! host through a devmap; everything else goes on to the Linux bridge.
//!
//! One program instance (and so one MAC table) serves all the ports given to
//! one [`attach`] call. It is attached with plain netlink, not a bpf_link, so
//! it stays after the process that attached it (`erarctl testbed up`) exits;
//! [`detach`] (or deleting the port) removes it.
//!
//! The same program can impair datapath frames (loss, duplication,
//! reordering, chosen-frame drops) for loss-recovery tests: see
//! [`super::impair`].

use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd};

use anyhow::{ensure, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags, MapHandle, MapType, Xdp, XdpFlags};

use liberar::datapath::iface::if_index;
use liberar::datapath::wire;

#[allow(clippy::all, clippy::pedantic, unsafe_op_in_unsafe_fn, dead_code)]
#[allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/testbed_switch.skel.rs"));
}

/// One port of the emulated switch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchPort {
    /// The bridge port (root namespace) that leads to the host.
    pub port_ifname: String,
    /// MAC of the host's interface behind that port.
    pub host_mac: [u8; 6],
}

/// The switch's MAC-table key: the 6 MAC bytes zero-extended, read as a
/// little-endian u64 (the BPF side memcpy()s them into a zeroed u64).
fn mac_key(mac: &[u8; 6]) -> [u8; 8] {
    let mut k = [0u8; 8];
    k[..6].copy_from_slice(mac);
    k
}

/// Loads the switch program, fills its MAC table with `ports`, and attaches
/// it (native XDP, netlink) to every port, replacing any XDP program they
/// had. The hosts' own interfaces must run an XDP program (erar_xdp) to
/// receive redirected frames; until then those frames are dropped, which is
/// harmless: only datapath frames are redirected.
pub fn attach(ports: &[SwitchPort]) -> Result<()> {
    ensure!(!ports.is_empty(), "no switch ports given");
    ensure!(
        ports.len() <= wire::ERAR_SWITCH_MAX_PORTS as usize,
        "{} ports, the switch has {}",
        ports.len(),
        wire::ERAR_SWITCH_MAX_PORTS
    );
    let ifindexes = ports
        .iter()
        .map(|p| if_index(&p.port_ifname))
        .collect::<Result<Vec<_>>>()?;

    let mut storage = MaybeUninit::uninit();
    let open = skel::TestbedSwitchSkelBuilder::default()
        .open(&mut storage)
        .context("opening the testbed_switch BPF object")?;
    let skel = open.load().context("loading testbed_switch")?;
    for (i, (p, ifindex)) in ports.iter().zip(&ifindexes).enumerate() {
        let idx = (i as u32).to_ne_bytes();
        skel.maps
            .switch_ports
            .update(&idx, &ifindex.to_ne_bytes(), MapFlags::ANY)
            .with_context(|| format!("adding port {} to the switch devmap", p.port_ifname))?;
        skel.maps
            .switch_fdb
            .update(&mac_key(&p.host_mac), &idx, MapFlags::ANY)
            .with_context(|| format!("adding {}'s host MAC to the switch table", p.port_ifname))?;
    }
    // Duplication (see impair.rs): per port a devmap listing it twice.
    let opts = libbpf_sys::bpf_map_create_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as libbpf_sys::size_t,
        ..Default::default()
    };
    for (i, (p, ifindex)) in ports.iter().zip(&ifindexes).enumerate() {
        let dup = MapHandle::create(
            MapType::DevmapHash,
            Some(format!("sw_dup{i}")),
            4,
            4,
            2,
            &opts,
        )
        .with_context(|| format!("creating the duplication devmap of {}", p.port_ifname))?;
        for key in [0u32, 1] {
            dup.update(&key.to_ne_bytes(), &ifindex.to_ne_bytes(), MapFlags::ANY)
                .with_context(|| format!("filling the duplication devmap of {}", p.port_ifname))?;
        }
        let fd = dup.as_fd().as_raw_fd();
        skel.maps
            .switch_dup
            .update(&(i as u32).to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY)
            .with_context(|| format!("adding {}'s duplication devmap", p.port_ifname))?;
        // The outer map holds its own reference: `dup` may close.
    }
    let xdp = Xdp::new(skel.progs.testbed_switch.as_fd());
    for (p, ifindex) in ports.iter().zip(&ifindexes) {
        xdp.attach(*ifindex as i32, XdpFlags::DRV_MODE)
            .with_context(|| {
                format!("attaching testbed_switch to {} (native XDP)", p.port_ifname)
            })?;
    }
    log::info!("emulated XDP switch attached to {} ports", ports.len());
    // Dropping the skeleton closes our fds; the attached program keeps
    // itself and its maps alive.
    Ok(())
}

/// Removes whatever XDP program (the switch's) the given ports carry.
/// Ports that no longer exist are skipped.
pub fn detach(port_ifnames: &[String]) -> Result<()> {
    for name in port_ifnames {
        let Ok(ifindex) = if_index(name) else {
            log::debug!("switch detach: no port {name}, skipping");
            continue;
        };
        // SAFETY: plain netlink request, no pointers (opts NULL).
        let ret = unsafe {
            libbpf_sys::bpf_xdp_detach(ifindex as i32, XdpFlags::DRV_MODE.bits(), std::ptr::null())
        };
        if ret != 0 {
            return Err(std::io::Error::from_raw_os_error(-ret))
                .with_context(|| format!("detaching the XDP switch from {name}"));
        }
    }
    Ok(())
}
