//! Frames put on the wire from user space. BPF_PROG_RUN's live frames
//! are one page each (ERAR_MAX_LINEAR_CHUNK_BYTES of payload), so a
//! datapath whose chunks are larger sends the frames it originates (an
//! operation's starting chunks, re-sends, NACKs, READY frames) through an
//! AF_PACKET socket bound to its interface; any datapath sends its READY
//! frames so, one at a time, where a BPF_PROG_RUN would set up a page pool
//! for each (see `send_ready`): [`RawSender`], one `sendmmsg`
//! per batch, each frame its 72-byte header ([`erar_header`], the slot's
//! template and an erar_hdr, as erar_inject writes them) and its payload
//! read by the kernel straight from the slot's buffer. The frames reach
//! the other hosts' `erar_xdp` in fragments (see ERAR_JUMBO_HEAD_BYTES);
//! what the XDP program forwards keeps that shape.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{Context, Result};

use super::frame::hdr_bytes;
use super::wire;
use super::PAYLOAD_OFF;

/// Frames per `sendmmsg` (as many as a BPF_PROG_RUN batch).
pub(super) const BATCH: usize = 32;

/// One frame: its header and its payload (chunk_bytes bytes).
pub(super) type RawFrame<'a> = ([u8; PAYLOAD_OFF], &'a [u8]);

/// An AF_PACKET socket that sends whole Ethernet frames out of one
/// interface and receives nothing (bound with protocol 0).
pub(super) struct RawSender {
    fd: OwnedFd,
    /// The interface's name, to ask whether it is up (SIOCGIFFLAGS).
    ifname: [libc::c_char; libc::IFNAMSIZ],
}

/// Whether this process may open [`RawSender`]s (CAP_NET_RAW), tried once.
pub fn jumbo_permitted() -> bool {
    static PERMITTED: once_cell::sync::OnceCell<bool> = once_cell::sync::OnceCell::new();
    *PERMITTED.get_or_init(|| {
        // SAFETY: socket() with constant arguments; closed at once.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return false;
        }
        // SAFETY: a fresh fd that nothing else owns (closed on drop).
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
        true
    })
}

impl RawSender {
    /// Needs CAP_NET_RAW. PACKET_QDISC_BYPASS: the frames go to the driver
    /// as XDP's do (the veth's peer takes them in its NAPI), not through a
    /// qdisc.
    pub(super) fn open(ifindex: u32) -> Result<RawSender> {
        // SAFETY: socket() with constant arguments; the fd is checked.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error())
                .context("opening an AF_PACKET socket (needs CAP_NET_RAW)");
        }
        // SAFETY: a fresh fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let one: libc::c_int = 1;
        // SAFETY: a c_int option of its size; the result is checked.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_QDISC_BYPASS,
                std::ptr::addr_of!(one).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error()).context("PACKET_QDISC_BYPASS");
        }
        // SAFETY: sockaddr_ll is plain data; zeroed is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = ifindex as i32;
        // SAFETY: addr is a sockaddr_ll of its size; the result is checked.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(addr).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error())
                .with_context(|| format!("binding the jumbo frames' socket to ifindex {ifindex}"));
        }
        let mut ifname = [0; libc::IFNAMSIZ];
        // SAFETY: if_indextoname writes at most IFNAMSIZ bytes to ifname.
        if unsafe { libc::if_indextoname(ifindex, ifname.as_mut_ptr()) }.is_null() {
            return Err(io::Error::last_os_error())
                .with_context(|| format!("naming ifindex {ifindex}"));
        }
        Ok(RawSender { fd, ifname })
    }

    /// Whether the interface may carry frames (IFF_RUNNING: up, with its
    /// carrier). Asked only once a frame was refused.
    fn running(&self) -> bool {
        // SAFETY: ifreq is plain data; zeroed is a valid value.
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        ifr.ifr_name = self.ifname;
        // SAFETY: SIOCGIFFLAGS reads ifr_name and writes ifr_flags of the
        // ifreq it is given; the result is checked.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr) };
        // SAFETY: ifr_flags is the union member SIOCGIFFLAGS wrote.
        rc == 0 && unsafe { ifr.ifr_ifru.ifru_flags } as libc::c_int & libc::IFF_RUNNING != 0
    }

    /// Sends `frames` (at most [`BATCH`]), in order. A frame the interface
    /// could not take (ENOBUFS) is sent again after the CPU was given to
    /// the softirq work that empties the veth's ring, unless the interface
    /// is down: then it and the rest are lost as a wire loses them, and
    /// the datapath's recovery re-sends them (a READY sent through
    /// BPF_PROG_RUN is lost so too). So is a frame refused 100 000 times.
    /// Counted as sent either way, as erar_inject counts what it builds.
    pub(super) fn send(&self, frames: &[RawFrame<'_>]) -> Result<()> {
        debug_assert!(frames.len() <= BATCH);
        let mut iov = [[IoSlice::new(&[]), IoSlice::new(&[])]; BATCH];
        for (v, (hdr, payload)) in iov.iter_mut().zip(frames) {
            *v = [IoSlice::new(hdr), IoSlice::new(payload)];
        }
        // SAFETY: mmsghdr is plain data; zeroed is a valid value.
        let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
        for (m, v) in msgs.iter_mut().zip(iov.iter_mut()) {
            // IoSlice is ABI-compatible with iovec (std's guarantee).
            m.msg_hdr.msg_iov = v.as_mut_ptr().cast();
            m.msg_hdr.msg_iovlen = 2;
        }
        let mut sent = 0;
        let mut refused = 0u32;
        while sent < frames.len() {
            let rest = &mut msgs[sent..frames.len()];
            // SAFETY: every message points at iovecs that borrow `frames`,
            // alive for the call; the count is the slice's.
            let n = unsafe {
                libc::sendmmsg(self.fd.as_raw_fd(), rest.as_mut_ptr(), rest.len() as u32, 0)
            };
            if n > 0 {
                sent += n as usize;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => {}
                Some(libc::ENOBUFS | libc::EAGAIN) => {
                    refused += 1;
                    if refused >= 100_000 || !self.running() {
                        return Ok(());
                    }
                    std::thread::yield_now();
                }
                _ => return Err(e).context("sendmmsg of datapath frames"),
            }
        }
        Ok(())
    }
}

/// What the frames sent here add to `erar_xdp`'s counters (the ones
/// erar_inject counts when it sends them): [`HostDatapath::stats`](super::HostDatapath::stats)
/// reports their sum.
pub(super) struct RawCounts([std::sync::atomic::AtomicU64; wire::ERAR_STAT_NR as usize]);

impl Default for RawCounts {
    fn default() -> RawCounts {
        RawCounts(std::array::from_fn(|_| Default::default()))
    }
}

impl RawCounts {
    pub(super) fn add(&self, stat: wire::erar_stat, n: u64) {
        if let Some(c) = self.0.get(stat as usize) {
            c.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    }

    pub(super) fn get(&self, i: usize) -> u64 {
        self.0[i].load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The header of a frame this host originates for a slot: the first
/// ERAR_L2L4_LEN bytes of `tmpl` (the slot's template to the next host, or
/// its NACK template to the previous one) and an erar_hdr, as erar_inject
/// writes them.
pub(super) fn erar_header(
    tmpl: &[u64; wire::ERAR_TEMPLATE_WORDS as usize],
    hdr: wire::erar_hdr,
) -> [u8; PAYLOAD_OFF] {
    let mut f = [0u8; PAYLOAD_OFF];
    let l2l4 = wire::ERAR_L2L4_LEN as usize;
    for (dst, w) in f[..l2l4].chunks_mut(8).zip(tmpl) {
        dst.copy_from_slice(&w.to_le_bytes()[..dst.len()]);
    }
    f[l2l4..].copy_from_slice(&hdr_bytes(&hdr));
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header is the template's bytes (as template_words stored them)
    /// followed by the erar_hdr at its wire offsets.
    #[test]
    fn header_is_template_then_erar_hdr() {
        let l2l4: Vec<u8> = (0..wire::ERAR_L2L4_LEN as u8).collect();
        let tmpl = super::super::frame::template_words(&l2l4);
        let hdr = super::super::frame::erar_hdr((wire::ERAR_KIND_AG, 2, 5), (7, 9), (11, 13, 3));
        let f = erar_header(&tmpl, hdr);
        assert_eq!(&f[..l2l4.len()], &l2l4[..]);
        let at = wire::ERAR_L2L4_LEN as usize;
        assert_eq!(&f[at..at + 4], &wire::ERAR_MAGIC.to_le_bytes());
        assert_eq!(f[at + 5], wire::ERAR_KIND_AG as u8);
        assert_eq!(&f[at + 16..at + 20], &11u32.to_le_bytes());
        assert_eq!(&f[at + 20..at + 24], &13u32.to_le_bytes());
        assert_eq!(&f[at + 24..at + 26], &3u16.to_le_bytes());
    }
}
