//! Establishing a [`Ring`] on a communicator: every rank advertises its
//! interfaces, all pick the ones on a common subnet, attach to their
//! host's datapath, agree on two slots free on every host (the ring's
//! generations) and check that the datapath's frames reach every host,
//! or all decline.

use super::claims::{claim_common_slots, free_slots, host_for, release_host, warn_once};
use super::tune::Tuner;
use super::{chunk_bytes_for_mtu, Ring};
use crate::config::Config;
use crate::datapath::codec::FloatSum;
use crate::datapath::contract::AgentPaths;
use crate::datapath::iface::{self, Candidate};
use crate::datapath::kernel::{jumbo_permitted, SlotRoute, LINEAR_MTU};
use crate::datapath::liveness::{Prober, RingAddr};
use crate::datapath::{wire, Comm, DatapathError};
use std::net::Ipv4Addr;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

/// How many interfaces one rank advertises.
const MAX_CANDIDATES: usize = 4;

/// What one rank tells the others when a ring is set up.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Advert {
    candidates: [AdvertIface; MAX_CANDIDATES],
    count: u32,
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct AdvertIface {
    ipv4: [u8; 4],
    netmask: [u8; 4],
    mac: [u8; 6],
    _pad: [u8; 2],
    mtu: u32,
}

/// Second round: did this rank attach, which slots are free, its token,
/// whether it can run exact operations alone (its NACKs are on).
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Ready {
    ok: u32,
    free_slots: u32,
    token: u32,
    comm_id: u32,
    alone: u32,
}

/// Records exchanged between ranks as raw bytes: repr(C), made of integers
/// and byte arrays with no implicit padding, valid for any bit pattern.
trait Record: Copy + Default {}
impl Record for Advert {}
impl Record for Ready {}

fn as_bytes<T: Record>(v: &T) -> &[u8] {
    // SAFETY: a Record has no padding, so every byte is initialized.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

fn gather<T: Record>(comm: &dyn Comm, mine: &T) -> Result<Vec<T>, DatapathError> {
    let size = std::mem::size_of::<T>();
    let mut all = vec![0u8; size * comm.size()];
    comm.allgather(as_bytes(mine), &mut all)?;
    Ok(all
        .chunks_exact(size)
        // SAFETY: a Record is valid for any bytes of its size.
        .map(|c| unsafe { std::ptr::read_unaligned(c.as_ptr().cast::<T>()) })
        .collect())
}

/// For every rank, the index of the candidate it uses: the first of its
/// interfaces whose subnet holds an interface of every other rank. All ranks
/// compute this from the same table, so they agree.
fn choose_interfaces(adverts: &[Advert]) -> Option<Vec<usize>> {
    let cands = |a: &Advert| a.candidates[..(a.count as usize).min(MAX_CANDIDATES)].to_vec();
    let mut chosen = Vec::with_capacity(adverts.len());
    for (r, a) in adverts.iter().enumerate() {
        let pick = cands(a).iter().position(|c| {
            let mine = Candidate {
                name: String::new(),
                ipv4: Ipv4Addr::from(c.ipv4),
                netmask: Ipv4Addr::from(c.netmask),
                mac: c.mac,
                mtu: c.mtu,
            };
            adverts.iter().enumerate().all(|(q, other)| {
                q == r
                    || cands(other)
                        .iter()
                        .any(|o| mine.same_subnet(Ipv4Addr::from(o.ipv4)))
            })
        })?;
        chosen.push(pick);
    }
    Some(chosen)
}

fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != 4 {
        // Never observed; a fixed fallback only weakens stale-frame isolation.
        return std::process::id() ^ 0x9e37_79b9;
    }
    u32::from_ne_bytes(b)
}

/// The MTU this rank's frames may use on `c`: the interface's, or what one
/// live frame needs if it cannot send jumbo frames (ERAR_JUMBO=0, no
/// CAP_NET_RAW, or the node agent's datapath, shared with unprivileged
/// jobs, see `kernel/raw.rs`). The ring's chunk follows the smallest.
fn frame_mtu(c: &Candidate) -> u32 {
    let agent = || AgentPaths::current(&c.name).is_ok_and(|p| p.pin_dir.exists());
    if Config::get().jumbo && jumbo_permitted() && !agent() {
        c.mtu
    } else {
        c.mtu.min(LINEAR_MTU)
    }
}

/// Round 1 of every setup: each rank's interfaces, and for each rank the
/// one it uses (on a subnet every other rank reaches).
fn interfaces(comm: &dyn Comm) -> Result<(Vec<Advert>, Vec<usize>), DatapathError> {
    let mut advert = Advert::default();
    match iface::candidates(Config::get().iface.as_deref()) {
        Ok(list) => {
            for (slot, c) in advert.candidates.iter_mut().zip(&list) {
                *slot = AdvertIface {
                    ipv4: c.ipv4.octets(),
                    netmask: c.netmask.octets(),
                    mac: c.mac,
                    _pad: [0; 2],
                    mtu: frame_mtu(c),
                };
            }
            advert.count = list.len().min(MAX_CANDIDATES) as u32;
        }
        Err(e) => log::debug!("liberar: listing interfaces failed: {e}"),
    }
    let adverts = gather(comm, &advert)?;
    let chosen = choose_interfaces(&adverts).ok_or_else(|| {
        DatapathError::Declined("the ranks share no IPv4 subnet (set ERAR_IFACE)".into())
    })?;
    Ok((adverts, chosen))
}

/// Where the ranks of a communicator are: each one's interfaces, the one
/// it uses, and its host.
pub struct Hosts {
    adverts: Vec<Advert>,
    chosen: Vec<usize>,
    /// The host of each rank, numbered in the order of their first rank:
    /// ranks whose datapath interface has the same MAC address share a
    /// host (its identity on the network the ring uses, whatever the OS
    /// or the launcher says).
    pub host_of: Vec<usize>,
}

impl Hosts {
    /// Collective over `comm` (round 1 of every ring setup).
    pub fn discover(comm: &dyn Comm) -> Result<Hosts, DatapathError> {
        let (adverts, chosen) = interfaces(comm)?;
        let macs: Vec<[u8; 6]> = (0..comm.size())
            .map(|r| adverts[r].candidates[chosen[r]].mac)
            .collect();
        Ok(Hosts {
            host_of: host_indices(&macs),
            adverts,
            chosen,
        })
    }

    /// How many hosts the ranks are on.
    pub fn count(&self) -> usize {
        self.host_of.iter().max().map_or(0, |h| h + 1)
    }
}

/// Host indices for ranks by identity: equal identities share an index,
/// numbered in order of first appearance.
fn host_indices<T: PartialEq>(ids: &[T]) -> Vec<usize> {
    let mut firsts: Vec<&T> = Vec::new();
    ids.iter()
        .map(|id| {
            firsts.iter().position(|f| *f == id).unwrap_or_else(|| {
                firsts.push(id);
                firsts.len() - 1
            })
        })
        .collect()
}

impl Ring {
    /// Collective over `comm`: learns every member's interface, MAC and IPv4
    /// address, and checks that every host has the datapath. Every rank gets
    /// the same verdict: all `Ok`, or all `Err(Declined)`.
    pub fn establish(comm: &dyn Comm) -> Result<Ring, DatapathError> {
        let hosts = Hosts::discover(comm)?;
        Ring::establish_on(comm, hosts)
    }

    /// [`Ring::establish`] once round 1 ([`Hosts::discover`]) is done.
    pub fn establish_on(comm: &dyn Comm, hosts: Hosts) -> Result<Ring, DatapathError> {
        let cfg = Config::get();
        let (rank, n) = (comm.rank(), comm.size());
        if n > wire::ERAR_MAX_RING as usize {
            return Err(DatapathError::Declined(format!(
                "{n} ranks exceed the ring limit"
            )));
        }

        let Hosts {
            adverts, chosen, ..
        } = &hosts;
        let pick = |r: usize| adverts[r].candidates[chosen[r]];
        if hosts.count() != n {
            return Err(DatapathError::Declined(
                "two ranks share a host (a ring has one rank per host)".into(),
            ));
        }
        let chunk_bytes = (0..n)
            .map(|r| chunk_bytes_for_mtu(pick(r).mtu))
            .min()
            .unwrap_or(0);
        if chunk_bytes < wire::ERAR_MIN_CHUNK_BYTES {
            return Err(DatapathError::Declined(
                "the interface MTU is too small".into(),
            ));
        }

        // Round 2: attach locally, then agree on two slots free on every host.
        let me = pick(rank);
        let my_ifname = iface::candidates(cfg.iface.as_deref())
            .ok()
            .and_then(|l| l.into_iter().find(|c| c.mac == me.mac).map(|c| c.name));
        let host = my_ifname
            .ok_or_else(|| "the chosen interface vanished".to_string())
            .and_then(|name| host_for(&name, chunk_bytes));
        let mut ready = Ready {
            token: random_u32(),
            comm_id: random_u32(),
            // Only NACKs repair an operation run alone.
            alone: u32::from(cfg.nack_us > 0),
            ..Ready::default()
        };
        match &host {
            Ok(h) => {
                ready.ok = 1;
                ready.free_slots = free_slots(h);
            }
            Err(e) => log::debug!("liberar: datapath unavailable on this host: {e}"),
        }
        let readies = gather(comm, &ready)?;
        if let Some(bad) = readies.iter().position(|r| r.ok == 0) {
            return Err(DatapathError::Declined(format!(
                "no datapath on the host of rank {bad}"
            )));
        }
        let common = readies.iter().fold(u32::MAX, |acc, r| acc & r.free_slots);
        let host = host.map_err(DatapathError::Declined)?;
        let slots = claim_common_slots(comm, &host, common, readies[0].comm_id)?;

        let next = pick((rank + 1) % n);
        let prev = pick((rank + n - 1) % n);
        let route = SlotRoute {
            self_mac: me.mac,
            self_ip: Ipv4Addr::from(me.ipv4),
            next_mac: next.mac,
            next_ip: Ipv4Addr::from(next.ipv4),
            prev_mac: prev.mac,
            prev_ip: Ipv4Addr::from(prev.ipv4),
            ring_pos: rank as u32,
            ring_size: n as u32,
            comm_id: readies[0].comm_id,
            token: readies[0].token,
        };
        let mut ring = Ring {
            host,
            slots,
            slot: slots[0],
            alone: readies.iter().all(|r| r.alone != 0),
            host_to_itself: true,
            ranks: n,
            seq: 0,
            chunk_bytes: chunk_bytes as usize,
            float_sum: FloatSum::default(),
            result_gen: 0,
            stages: Vec::new(),
            all_stages: Vec::new(),
            resend: Vec::new(),
            prober: None,
            tuner: Tuner::default(),
            carried: None,
            region: None,
            region_failed: false,
            last_bcast: (0, 0),
            allreduce_regions: None,
            last_allreduce: (0, 0, 0),
        };
        for slot in slots {
            ring.host
                .configure_slot(slot, &route)
                .map_err(|e| DatapathError::Failed(format!("configuring slot {slot}: {e:#}")))?;
        }
        let hosts: Vec<Ipv4Addr> = (0..n).map(|r| Ipv4Addr::from(pick(r).ipv4)).collect();
        ring.prober = Prober::new(&RingAddr {
            hosts: &hosts,
            rank,
            slot: slots[0],
            comm_id: route.comm_id,
            token: route.token,
            chunk_bytes,
        })
        .map(Box::new)
        .map_err(|e| log::debug!("liberar: no liveness prober ({e}); a lost peer hangs"))
        .ok();
        let ring = ring.reach_every_host(comm)?;
        log::debug!(
            "liberar: ring of {n} ready on slots {slots:?}, {chunk_bytes}-byte chunks, next hop {}",
            route.next_ip
        );
        Ok(ring)
    }

    /// Collective: every rank's host answered this rank's probes at the
    /// ring's frame size ([`Prober::reach_all`]), or every rank declines,
    /// the ring goes and, if no other ring of this process holds it, so
    /// does its attachment to the interface. A network that drops the
    /// datapath's frames (a switch that filters them or has a smaller MTU;
    /// on the test bed, the plain bridge, whose ports carry no XDP) then
    /// leaves the communicator's calls to MPI, as fast as without liberar,
    /// rather than failing each call once its peers stay silent for
    /// `ERAR_TIMEOUT_MS`. A rank without a prober, or with `ERAR_PROBE_MS`
    /// 0, checks nothing.
    fn reach_every_host(mut self, comm: &dyn Comm) -> Result<Ring, DatapathError> {
        let within = Duration::from_millis(Config::get().probe_ms);
        let silent = match self.prober.as_deref_mut() {
            Some(p) if !within.is_zero() => p.reach_all(within, &|| comm.progress()).err(),
            _ => None,
        };
        let mut bad = [i32::from(silent.is_some())];
        comm.allreduce_max_i32(&mut bad)?;
        if bad[0] == 0 {
            return Ok(self);
        }
        if let Some(why) = &silent {
            log::debug!("liberar: rank {}: {why}", comm.rank());
        }
        let why = silent.unwrap_or_else(|| "another rank's probes went unanswered".into());
        // One line for the ring, not one per rank: its rank 0's view.
        if comm.rank() == 0 {
            warn_unreachable(&why);
        }
        let host = Arc::clone(&self.host);
        drop(self);
        release_host(host);
        Err(DatapathError::Declined(why))
    }
}

/// One line on stderr, once per process (a ring's rank 0): why a ring was
/// declined although every host has the datapath (else only
/// `ERAR_LOG=debug` would tell).
fn warn_unreachable(why: &str) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    warn_once(
        &WARNED,
        &format!("liberar: {why}; MPI_Allreduce/MPI_Bcast use MPI\n"),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn advert(ifaces: &[([u8; 4], [u8; 6])]) -> Advert {
        let mut a = Advert::default();
        for (slot, (ip, mac)) in a.candidates.iter_mut().zip(ifaces) {
            *slot = AdvertIface {
                ipv4: *ip,
                netmask: [255, 255, 255, 0],
                mac: *mac,
                _pad: [0; 2],
                mtu: 1500,
            };
        }
        a.count = ifaces.len() as u32;
        a
    }

    #[test]
    fn hosts_are_numbered_by_first_rank() {
        let macs = [
            [2, 0, 0, 0, 0, 9],
            [2, 0, 0, 0, 0, 3],
            [2, 0, 0, 0, 0, 9],
            [2, 0, 0, 0, 0, 3],
            [2, 0, 0, 0, 0, 1],
        ];
        assert_eq!(host_indices(&macs), vec![0, 1, 0, 1, 2]);
        assert_eq!(host_indices::<u8>(&[]), Vec::<usize>::new());
    }

    #[test]
    fn interfaces_are_chosen_on_the_common_subnet() {
        // Rank 0 lists a management interface first; only the second one
        // reaches rank 1.
        let a = advert(&[
            ([192, 0, 2, 1], [2, 0, 0, 0, 0, 1]),
            ([10, 9, 0, 1], [2, 0, 0, 0, 0, 2]),
        ]);
        let b = advert(&[([10, 9, 0, 2], [2, 0, 0, 0, 0, 3])]);
        assert_eq!(choose_interfaces(&[a, b]), Some(vec![1, 0]));
        let c = advert(&[([198, 51, 100, 7], [2, 0, 0, 0, 0, 4])]);
        assert_eq!(choose_interfaces(&[a, b, c]), None);
    }
}
