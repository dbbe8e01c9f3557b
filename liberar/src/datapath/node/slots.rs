//! Each slice's result where its ring left it: every rank of a host maps
//! the slice leaders' slot buffers read-only, and copies a slice's result
//! to its own buffer straight from there. The result then crosses memory
//! once on its way to each rank instead of twice (slot → shared output
//! region → buffer), and the leader's copy leaves the critical path of
//! the call (`Ring::allreduce_kept`). A float SUM's result is decoded
//! from the words there the same way (`Ring::allreduce_local_kept`).
//!
//! At setup each leader hands the fds of its ring's two slot buffers to
//! the other local ranks over an abstract unix socket (SCM_RIGHTS), named
//! after the group's control page. Both ends check who is at the other end
//! (SO_PEERCRED: a rank of the group, the slice's leader), so no other
//! process gets the fds or passes off memory of its own as a result.
//! Every step ends in an agreement over the local ranks: they all map
//! every slice, or none does and results go through the output region.

use super::super::{Comm, DatapathError};
use crate::datapath::mapping::SharedMapping;
use sendfd::{RecvWithFd, SendWithFd};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

/// How long a rank waits for a leader's fds once every rank has connected
/// (the leader sends them right after it accepts).
const HANDOVER: Duration = Duration::from_secs(10);

/// Every slice's two slot buffers, mapped read-only in this process.
pub struct SlotViews {
    views: Vec<[SharedMapping; 2]>,
}

impl SlotViews {
    /// Collective over `local`, the ranks of one host (`pids` in local rank
    /// order): the leader of each of the first `slices` local ranks hands
    /// `own`, its ring's slot buffer fds and their size
    /// (`Ring::slot_buffer_fds`), to every other local rank. `name` is the
    /// group's control page name. Every local rank gets the same verdict.
    pub fn share(
        local: &dyn Comm,
        name: &str,
        slices: usize,
        own: Option<([OwnedFd; 2], usize)>,
        pids: &[i32],
    ) -> Result<SlotViews, DatapathError> {
        let me = local.rank();
        let addr = |s: usize| {
            SocketAddr::from_abstract_name(format!("{}.slots{s}", name.trim_start_matches('/')))
                .map_err(|e| declined("socket name", e))
        };
        let leads = me < slices;
        let listener = match (leads, &own) {
            (true, Some(_)) => Some(addr(me).and_then(|a| {
                let l = UnixListener::bind_addr(&a).map_err(|e| declined("bind", e))?;
                l.set_nonblocking(true).map_err(|e| declined("bind", e))?;
                Ok(l)
            })),
            (true, None) => Some(Err(DatapathError::Declined(
                "a leader without its slot buffers' fds".into(),
            ))),
            (false, _) => None,
        };
        agree(local, !matches!(listener, Some(Err(_))))?;

        // Every rank connects to every other leader before any leader
        // accepts: the connections wait in the listeners' backlogs, so no
        // rank waits for another here.
        let conns: Result<Vec<(usize, UnixStream)>, DatapathError> = (0..slices)
            .filter(|s| *s != me)
            .map(|s| {
                let c = UnixStream::connect_addr(&addr(s)?).map_err(|e| declined("connect", e))?;
                Ok((s, c))
            })
            .collect();
        agree(local, conns.is_ok())?;
        let conns = conns?;

        let served = match (listener, &own) {
            (Some(Ok(l)), Some((fds, bytes))) => serve(&l, local.size() - 1, fds, *bytes, pids),
            _ => Ok(()),
        };
        let views = served.and_then(|()| {
            let mut views = Vec::with_capacity(slices);
            for (s, &pid) in pids.iter().enumerate().take(slices) {
                let (fds, len) = match (&own, conns.iter().find(|c| c.0 == s)) {
                    (Some((fds, len)), _) if s == me => (dup(fds)?, *len),
                    (_, Some((_, c))) => receive(c, pid)?,
                    _ => return Err(DatapathError::Declined(format!("no leader for slice {s}"))),
                };
                let map = |fd: &OwnedFd| {
                    SharedMapping::read_only(fd.as_fd(), len).map_err(|e| declined("mmap", e))
                };
                views.push([map(&fds[0])?, map(&fds[1])?]);
            }
            Ok(SlotViews { views })
        });
        agree(local, views.is_ok())?;
        views
    }

    /// Bytes `0..len` of slice `s`'s slot buffer of generation `gen`.
    ///
    /// # Safety
    /// Only while the slice's leader keeps a result there: after the
    /// barrier that follows its `Ring::allreduce_kept` (or
    /// `allreduce_local_kept`, `bcast_kept`), and before the barrier that
    /// opens its ring's next operation but one.
    pub unsafe fn result(&self, s: usize, gen: usize, len: usize) -> &[u8] {
        let m = &self.views[s][gen & 1];
        std::slice::from_raw_parts(m.as_ptr(), len.min(m.len()))
    }
}

/// A leader's side: accepts `peers` connections (all already waiting),
/// each from a rank of the group, and sends each the slot fds.
fn serve(
    l: &UnixListener,
    peers: usize,
    fds: &[OwnedFd; 2],
    bytes: usize,
    pids: &[i32],
) -> Result<(), DatapathError> {
    let raw = [fds[0].as_raw_fd(), fds[1].as_raw_fd()];
    for _ in 0..peers {
        let (c, _) = l.accept().map_err(|e| declined("accept", e))?;
        let pid = peer_pid(&c)?;
        if !pids.contains(&pid) {
            return Err(DatapathError::Declined(format!(
                "process {pid}, not of this group, asked for the slots"
            )));
        }
        c.set_nonblocking(false).map_err(|e| declined("send", e))?;
        c.send_with_fd(&(bytes as u64).to_ne_bytes(), &raw)
            .map_err(|e| declined("send", e))?;
    }
    Ok(())
}

/// A rank's side of one slice: the leader's fds and their size, from the
/// leader (`leader`, its pid) alone.
fn receive(c: &UnixStream, leader: i32) -> Result<([OwnedFd; 2], usize), DatapathError> {
    let pid = peer_pid(c)?;
    if pid != leader {
        return Err(DatapathError::Declined(format!(
            "process {pid}, not the slice's leader {leader}, offered slots"
        )));
    }
    c.set_read_timeout(Some(HANDOVER))
        .map_err(|e| declined("receive", e))?;
    let mut buf = [0u8; 8];
    let mut raw: [RawFd; 2] = [-1; 2];
    let (n, nfds) = c
        .recv_with_fd(&mut buf, &mut raw)
        .map_err(|e| declined("receive", e))?;
    // SAFETY: the first nfds entries are fds the kernel just gave us.
    let got: Vec<OwnedFd> = raw[..nfds]
        .iter()
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    let fds: [OwnedFd; 2] = got
        .try_into()
        .map_err(|_| DatapathError::Declined(format!("the leader sent {nfds} fds, not 2")))?;
    if n != buf.len() {
        return Err(DatapathError::Declined("a short slot handover".into()));
    }
    Ok((fds, u64::from_ne_bytes(buf) as usize))
}

/// The pid of the process at the other end of `c`.
fn peer_pid(c: &UnixStream) -> Result<i32, DatapathError> {
    crate::datapath::peer::peer_pid(c).map_err(|e| declined("SO_PEERCRED", e))
}

fn dup(fds: &[OwnedFd; 2]) -> Result<[OwnedFd; 2], DatapathError> {
    let one = |f: &OwnedFd| f.try_clone().map_err(|e| declined("dup", e));
    Ok([one(&fds[0])?, one(&fds[1])?])
}

/// Whether every local rank's step went well (a MAX over them).
fn agree(local: &dyn Comm, ok: bool) -> Result<(), DatapathError> {
    let mut bad = [i32::from(!ok)];
    local.allreduce_max_i32(&mut bad)?;
    if bad[0] != 0 {
        return Err(DatapathError::Declined(
            "a local rank could not map the slots".into(),
        ));
    }
    Ok(())
}

fn declined(what: &str, e: std::io::Error) -> DatapathError {
    DatapathError::Declined(format!("slot handover: {what}: {e}"))
}
