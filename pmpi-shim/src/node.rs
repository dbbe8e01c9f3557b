//! A communicator whose ranks share hosts, as the shim holds it: its
//! sub-communicators (the ranks of this rank's host; the slice this rank
//! leads, one rank per host), the slice's ring, and liberar's
//! [`Node`], which runs each call through shared memory and the rings.

use crate::ffi::{MPI_Comm, MPI_SUCCESS};
use crate::pmpi_comm::PmpiComm;
use crate::rt::{self, Runtime};
use liberar::config::Config;
use liberar::datapath::node::{Node, Slice};
use liberar::datapath::ring::Ring;
use liberar::datapath::{Comm, DatapathError, Done, Reduction};
use std::os::raw::c_int;

/// Most slices a host leads (each one a ring of two slots on the host).
const MAX_SLICES: usize = 4;

pub struct NodeRing {
    node: Node,
    local: MPI_Comm,
    slice: Option<SliceRing>,
    /// The host of every rank of the communicator, and its rank there.
    host_of: Vec<usize>,
    local_of: Vec<usize>,
    rank: usize,
}

/// The slice this rank leads: its communicator (one rank per host, ranked
/// by host) and the ring on it.
struct SliceRing {
    comm: MPI_Comm,
    ring: Ring,
    rank: usize,
    size: usize,
}

/// Each rank's index among the ranks of its host, in rank order.
fn local_ranks(host_of: &[usize]) -> Vec<usize> {
    let mut seen = vec![0usize; host_of.iter().max().map_or(0, |h| h + 1)];
    host_of
        .iter()
        .map(|h| {
            seen[*h] += 1;
            seen[*h] - 1
        })
        .collect()
}

/// How many slices each call is cut into: at most the fewest ranks a host
/// has (every host leads every slice), `ERAR_NODE_SLICES` and MAX_SLICES.
fn slices_for(host_of: &[usize]) -> usize {
    let hosts = host_of.iter().max().map_or(0, |h| h + 1);
    let fewest = (0..hosts)
        .map(|h| host_of.iter().filter(|x| **x == h).count())
        .min()
        .unwrap_or(0);
    fewest.min(Config::get().node_slices).min(MAX_SLICES)
}

unsafe fn split(
    rt: &Runtime,
    comm: MPI_Comm,
    color: Option<usize>,
    key: usize,
) -> Result<MPI_Comm, DatapathError> {
    let mut out = rt.h.comm_null;
    let color = color.map_or(rt.h.undefined, |c| c as c_int);
    let rc = rt::pmpi().PMPI_Comm_split(comm, color, key as c_int, &mut out);
    if rc != MPI_SUCCESS {
        return Err(DatapathError::Failed(format!(
            "MPI_Comm_split returned {rc}"
        )));
    }
    Ok(out)
}

unsafe fn free(rt: &Runtime, comm: &mut MPI_Comm) {
    if !rt.is_null_comm(*comm) {
        let rc = rt::pmpi().PMPI_Comm_free(comm);
        if rc != MPI_SUCCESS {
            log::debug!("liberar: MPI_Comm_free of a node sub-communicator returned {rc}");
        }
    }
}

impl NodeRing {
    /// Collective over the communicator of `c`, whose ranks are on the
    /// hosts `host_of` says (at least two hosts, some shared): splits it,
    /// maps each host's shared memory and sets up every slice's ring; all
    /// ranks get the same verdict.
    pub unsafe fn establish(
        c: &PmpiComm<'_>,
        host_of: Vec<usize>,
    ) -> Result<NodeRing, DatapathError> {
        let rt = c.runtime();
        let (rank, local_of) = (c.rank(), local_ranks(&host_of));
        let hosts = host_of.iter().max().map_or(0, |h| h + 1);
        let (host, j) = (host_of[rank], local_of[rank]);
        let local_size = host_of.iter().filter(|h| **h == host).count();
        let k = slices_for(&host_of);

        let mut local = split(rt, c.comm(), Some(host), rank)?;
        let mut slice_comm = match split(rt, c.comm(), (j < k).then_some(j), host) {
            Ok(s) => s,
            Err(e) => {
                free(rt, &mut local);
                return Err(e);
            }
        };
        let node = Node::establish(&c.on(local, j, local_size), k, c.size());
        // One slice at a time: the leaders of two slices on one host would
        // otherwise claim the same free slots at once, each take some, and
        // both find too few left (seen in 3 of 12 jobs on 4 hosts).
        // A slice declined (its hosts do not reach each other, say) ends
        // the loop: the next would decline too, after as long a wait.
        // (`bad` is the same on every rank only after an exchange.)
        let mut ring = None;
        let mut agreed = Ok(());
        let mut bad = [i32::from(node.is_err())];
        let mut declined = false;
        for s in 0..k {
            if s == j && !declined {
                ring =
                    Some(Ring::establish(&c.on(slice_comm, host, hosts)).map(Ring::serving_node));
            }
            bad[0] = bad[0].max(i32::from(matches!(ring, Some(Err(_)))));
            if agreed.is_ok() {
                agreed = c.allreduce_max_i32(&mut bad);
                declined = bad[0] != 0;
            }
        }
        let agreed = if k == 0 {
            c.allreduce_max_i32(&mut bad)
        } else {
            agreed
        };
        if agreed.is_err() || bad[0] != 0 {
            let why = match (&node, &ring) {
                (Err(e), _) | (_, Some(Err(e))) => e.to_string(),
                _ => "another host's ranks could not".into(),
            };
            if let Some(Ok(r)) = ring {
                let _ = r.close(&c.on(slice_comm, host, hosts));
            }
            free(rt, &mut slice_comm);
            free(rt, &mut local);
            agreed?;
            return Err(DatapathError::Declined(format!("no node path: {why}")));
        }
        let mut node = node?;
        let mut slice = match ring {
            Some(r) => Some(SliceRing {
                comm: slice_comm,
                ring: r?,
                rank: host,
                size: hosts,
            }),
            None => None,
        };
        let local_comm = c.on(local, j, local_size);
        if let Err(e) = node.share_slots(&local_comm, slice.as_ref().map(|s| &s.ring)) {
            // Only an MPI error among this host's ranks gets here: no
            // collective close of the ring with the other hosts.
            drop(slice.take());
            free(rt, &mut slice_comm);
            free(rt, &mut local);
            return Err(e);
        }
        log::debug!(
            "liberar: node path: {local_size} ranks on this host, {hosts} hosts, {k} slices, \
             leading {:?}",
            node.leads()
        );
        Ok(NodeRing {
            node,
            local,
            slice,
            host_of,
            local_of,
            rank,
        })
    }

    /// Runs `f` on the Node with this rank's slice (its ring, spoken to
    /// through the call's adapter on the slice communicator), if it leads.
    fn with_slice<R>(
        &mut self,
        c: &PmpiComm<'_>,
        f: impl FnOnce(&mut Node, Option<Slice<'_>>) -> R,
    ) -> R {
        let sc = self.slice.as_ref().map(|s| c.on(s.comm, s.rank, s.size));
        let slice = match (self.slice.as_mut(), sc.as_ref()) {
            (Some(s), Some(comm)) => Some(Slice {
                ring: &mut s.ring,
                comm,
            }),
            _ => None,
        };
        f(&mut self.node, slice)
    }

    /// `recv = how over ranks of (send, or recv when in place)`.
    pub fn allreduce(
        &mut self,
        c: &PmpiComm<'_>,
        send: Option<&[u8]>,
        recv: &mut [u8],
        (elem, op): Reduction,
    ) -> Done {
        self.with_slice(c, |node, slice| {
            node.allreduce(slice, c, send, recv, elem, op)
        })
    }

    pub fn bcast(&mut self, c: &PmpiComm<'_>, buf: &mut [u8], root: usize) -> Done {
        let root_host = self.host_of[root];
        let root_local = (root_host == self.host_of[self.rank]).then(|| self.local_of[root]);
        let progress = || c.progress();
        self.with_slice(c, |node, slice| {
            node.bcast(slice, &progress, buf, root_local, root_host)
        })
    }

    /// Tears down collectively (comm free, finalize): the slice's ring
    /// closes on its communicator, then both sub-communicators are freed.
    pub unsafe fn close(mut self, rt: &Runtime, c: &PmpiComm<'_>) -> Done {
        let closed = match self.slice.take() {
            Some(SliceRing {
                mut comm,
                ring,
                rank,
                size,
            }) => {
                let r = ring.close(&c.on(comm, rank, size));
                free(rt, &mut comm);
                r
            }
            None => Ok(()),
        };
        free(rt, &mut self.local);
        closed
    }
}

#[cfg(test)]
mod tests {
    use super::local_ranks;

    #[test]
    fn local_ranks_count_within_each_host() {
        assert_eq!(local_ranks(&[0, 0, 0, 1, 2, 2]), vec![0, 1, 2, 0, 0, 1]);
        assert_eq!(local_ranks(&[0, 1, 0, 1]), vec![0, 0, 1, 1]);
    }
}
