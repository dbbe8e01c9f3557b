//! Telling a dead peer from a late one while a call waits for every rank.
//!
//! A call's first exchange ([`super::ring`]'s `agree_call`) waits for every
//! rank to arrive, and a rank may legitimately arrive minutes late (it is
//! computing). A rank whose host died or whose link went down never
//! arrives, and MPI over TCP would wait for it for as long as TCP
//! retransmits (many minutes). What tells the two apart is the peer's
//! *kernel*: its XDP program answers a liveness probe of the ring
//! (`ERAR_KIND_PING` in erar_wire.h) by itself, whatever its rank is doing.
//!
//! So a rank that has waited [`PROBE_AFTER`] starts probing every other
//! host of the ring from an ordinary UDP socket, every [`PROBE_EVERY`]; a
//! host that has not answered for the call's timeout (`ERAR_TIMEOUT_MS`)
//! since probing started is gone, and the call fails with an MPI error on
//! this rank. Every survivor probes every host, so every survivor sees the
//! same silence within the same bound; the host that lost its link hears
//! nobody and fails too. Nothing of this runs in a call that does not wait
//! (the fast path pays one clock read per test of the exchange).

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::kernel::{erar_hdr, hdr_bytes};
use super::wire;
use super::DatapathError;

/// How long a call waits for the other ranks before it starts probing.
pub const PROBE_AFTER: Duration = Duration::from_millis(500);
/// How often it probes each host then.
pub const PROBE_EVERY: Duration = Duration::from_millis(200);

/// How often setup probes the hosts that have not answered yet
/// ([`Prober::reach_all`]; how long it waits: `ERAR_PROBE_MS`).
const REACH_EVERY: Duration = Duration::from_millis(10);

/// Offsets in erar_hdr of `kind` and `seq` (the struct's, through bindgen).
const KIND_OFF: usize = std::mem::offset_of!(wire::erar_hdr, kind);
const SEQ_OFF: usize = std::mem::offset_of!(wire::erar_hdr, seq);

/// One ring's prober: a UDP socket on the ring's interface and what a probe
/// of each member looks like.
pub struct Prober {
    sock: UdpSocket,
    /// Each other rank and its host's address (datapath port).
    peers: Vec<(usize, SocketAddrV4)>,
    /// The probe: erar_hdr (kind PING) and a zero payload, full datapath
    /// length. `seq` carries a round number.
    probe: Vec<u8>,
    /// The wait being watched: when it started, when probing started, the
    /// last probe.
    wait: Option<Wait>,
    /// When each peer (same order as `peers`) last answered in this wait.
    /// Allocated once: `start` runs on every call.
    heard: Vec<Option<Instant>>,
    /// Receive buffer for answers.
    answer: Vec<u8>,
}

struct Wait {
    since: Instant,
    probing: Option<Instant>,
    last_probe: Instant,
    round: u32,
}

/// The ring a [`Prober`] probes.
pub struct RingAddr<'a> {
    /// Every rank's host address on the ring's interface, by rank.
    pub hosts: &'a [Ipv4Addr],
    pub rank: usize,
    pub slot: u32,
    pub comm_id: u32,
    pub token: u32,
    pub chunk_bytes: u32,
}

impl Prober {
    pub fn new(ring: &RingAddr) -> std::io::Result<Prober> {
        let me = ring.hosts[ring.rank];
        let sock = UdpSocket::bind(SocketAddrV4::new(me, 0))?;
        sock.set_nonblocking(true)?;
        let peers: Vec<(usize, SocketAddrV4)> = ring
            .hosts
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != ring.rank)
            .map(|(r, ip)| (r, SocketAddrV4::new(*ip, wire::ERAR_UDP_PORT as u16)))
            .collect();
        let mut probe = vec![0u8; (wire::ERAR_HDR_LEN + ring.chunk_bytes) as usize];
        let hdr = erar_hdr(
            (wire::ERAR_KIND_PING, 0, 0),
            (ring.comm_id, ring.token),
            (0, ring.rank as u32, ring.slot),
        );
        probe[..wire::ERAR_HDR_LEN as usize].copy_from_slice(&hdr_bytes(&hdr));
        let answer = vec![0u8; probe.len() + 64];
        Ok(Prober {
            heard: vec![None; peers.len()],
            sock,
            peers,
            probe,
            wait: None,
            answer,
        })
    }

    /// Starts watching a wait for every rank.
    pub fn start(&mut self) {
        let now = Instant::now();
        self.wait = Some(Wait {
            since: now,
            probing: None,
            last_probe: now,
            round: 0,
        });
        self.heard.fill(None);
    }

    /// One look at the watched wait (cheap until [`PROBE_AFTER`]): probes
    /// when due, reads answers, and fails once some host has been silent
    /// for `within` since probing started.
    pub fn check(&mut self, within: Duration) -> Result<(), DatapathError> {
        let now = Instant::now();
        let Some(w) = self.wait.as_mut() else {
            return Ok(());
        };
        if now.duration_since(w.since) < PROBE_AFTER {
            return Ok(());
        }
        let probing = *w.probing.get_or_insert(now);
        let probe_due = w.round == 0 || now.duration_since(w.last_probe) >= PROBE_EVERY;
        if probe_due {
            w.round += 1;
            w.last_probe = now;
        }
        let round = w.round;
        self.read_answers();
        let silent = |i: usize| now.duration_since(self.heard[i].unwrap_or(probing));
        if let Some(i) = (0..self.peers.len()).find(|&i| silent(i) >= within) {
            let (rank, addr) = self.peers[i];
            return Err(DatapathError::Failed(format!(
                "the host of rank {rank} ({}) has not answered liveness probes for {:.1} s: \
                 it is gone or its link is down",
                addr.ip(),
                silent(i).as_secs_f64()
            )));
        }
        if probe_due {
            self.send_probes(round);
        }
        Ok(())
    }

    /// At setup, once this host's slot is configured: probes every other
    /// host until each has answered once (its XDP program turned a
    /// full-length probe back, so datapath frames cross the network both
    /// ways at the ring's frame size), or until `within` passed. A peer
    /// whose slot is not configured yet does not answer: it is probed
    /// again. `progress` lets MPI complete this rank's queued sends of the
    /// setup's last exchange meanwhile (see `Comm::progress`), which a
    /// peer may still be waiting for. `Err` names a host that stayed
    /// silent.
    pub fn reach_all(&mut self, within: Duration, progress: &dyn Fn()) -> Result<(), String> {
        self.start();
        let started = Instant::now();
        let mut round = 0;
        let mut last_probe: Option<Instant> = None;
        let result = loop {
            self.read_answers();
            let Some(i) = self.heard.iter().position(Option::is_none) else {
                break Ok(());
            };
            let now = Instant::now();
            if now.duration_since(started) >= within {
                let (rank, addr) = self.peers[i];
                let me = self.sock.local_addr().map(|a| a.ip().to_string());
                let heard = self.heard.iter().filter(|h| h.is_some()).count();
                break Err(format!(
                    "the host of rank {rank} ({}) did not answer the ring's probes from {} within \
                     {:.1} s ({round} probes; {heard} of {} other hosts answered): the network \
                     does not carry the datapath's {}-byte frames between these hosts",
                    addr.ip(),
                    me.unwrap_or_else(|_| "this host".into()),
                    within.as_secs_f64(),
                    self.peers.len(),
                    self.probe.len() + wire::ERAR_L2L4_LEN as usize
                ));
            }
            if last_probe.is_none_or(|t| now.duration_since(t) >= REACH_EVERY) {
                round += 1;
                self.send_probes(round);
                last_probe = Some(now);
            }
            progress();
            self.wait_readable(Duration::from_millis(1));
        };
        self.stop();
        result
    }

    /// Sleeps until an answer may be waiting, at most `timeout`.
    fn wait_readable(&self, timeout: Duration) {
        let mut fds = [libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: one valid pollfd; an error or EINTR is a short sleep.
        unsafe { libc::poll(fds.as_mut_ptr(), 1, timeout.as_millis() as libc::c_int) };
    }

    /// Stops watching.
    pub fn stop(&mut self) {
        self.wait = None;
    }

    fn send_probes(&mut self, round: u32) {
        self.probe[SEQ_OFF..SEQ_OFF + 4].copy_from_slice(&round.to_le_bytes());
        for (_, addr) in &self.peers {
            // A full socket buffer or an unreachable route is silence too.
            let _ = self.sock.send_to(&self.probe, addr);
        }
    }

    /// Answers that came back: the probe with kind PONG, from a peer's host.
    fn read_answers(&mut self) {
        let hdr = wire::ERAR_HDR_LEN as usize;
        let buf = &mut self.answer;
        while let Ok((len, from)) = self.sock.recv_from(buf) {
            // The probe of any round, turned back: only kind and seq differ.
            let answer = len == self.probe.len()
                && buf[KIND_OFF] == wire::ERAR_KIND_PONG as u8
                && buf[..KIND_OFF] == self.probe[..KIND_OFF]
                && buf[KIND_OFF + 1..SEQ_OFF] == self.probe[KIND_OFF + 1..SEQ_OFF]
                && buf[SEQ_OFF + 4..hdr] == self.probe[SEQ_OFF + 4..hdr];
            if !answer {
                continue;
            }
            if let Some(i) = self.peers.iter().position(|(_, a)| from == (*a).into()) {
                self.heard[i] = Some(Instant::now());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_match_the_wire_header() {
        // docs/datapath.md's layout (the same numbers as erar_frame.h's
        // static assertions on erar_hdr).
        assert_eq!(KIND_OFF, 5);
        assert_eq!(SEQ_OFF, 16);
        assert_eq!(
            std::mem::size_of::<wire::erar_hdr>(),
            wire::ERAR_HDR_LEN as usize
        );
    }
}
