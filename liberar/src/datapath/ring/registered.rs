//! The caller's buffers registered in the ring's regions (kernel/region.rs),
//! which XDP reads and writes in place instead of the slots: a broadcast's
//! buffer, and an exact allreduce's send and receive buffers. A buffer is
//! registered at its second call in a row; a ring holds one broadcast
//! buffer and one allreduce pair, each in a region of its own, and no page
//! in two (registering one gives the other's overlapping buffer its pages
//! back first).

use std::sync::Arc;

use super::Ring;
use crate::datapath::kernel::region::{self, Region, RegionMap};
use crate::datapath::wire;
use crate::stats;

/// Which of a ring's regions (their index in the program's array of
/// region maps of their size class).
#[derive(Clone, Copy)]
enum Buffer {
    /// A broadcast's buffer: the ring's first slot's index.
    Bcast,
    /// An allreduce's send buffer: the ring's second slot's.
    Send,
    /// An allreduce's receive buffer: past the slots, at the first's.
    Recv,
}

impl Ring {
    fn region_id(&self, which: Buffer) -> u32 {
        match which {
            Buffer::Bcast => self.slots[0],
            Buffer::Send => self.slots[1],
            Buffer::Recv => wire::ERAR_MAX_SLOTS + self.slots[0],
        }
    }

    /// Registers `buf` as the ring's `which` region, in `spare` (the map of
    /// the buffer it had before, see `Region::unregister`) or a new map. On
    /// failure (no region on this datapath) the ring registers nothing any
    /// more.
    fn register(&mut self, which: Buffer, buf: &[u8], spare: Option<RegionMap>) -> Option<Region> {
        let reused = spare.as_ref().is_some_and(|s| s.holds_len(buf.len()));
        let (host, id) = (Arc::clone(&self.host), self.region_id(which));
        let registered = host.regions_fds().and_then(|outers| {
            Region::register(outers, id, host.slot_token(self.slots[0])?, buf, spare)
        });
        match registered {
            Ok(r) => {
                if reused {
                    stats::record_region_reused();
                }
                stats::record_region_kib(region::maps_held_bytes());
                Some(r)
            }
            Err(e) => {
                log::debug!("liberar: calls copy through the slots: {e:#}");
                self.region_failed = true;
                None
            }
        }
    }

    /// Whether `buf` is (now) registered in the ring's broadcast region: it
    /// is when this rank broadcast it in the call before too, and on every
    /// call after while its pages stay the region's (after a SIGBUS
    /// takeover, [`Ring::release_region_if_taken_over`] has dropped the
    /// region and `Region::register` refuses).
    pub(super) fn bcast_region(&mut self, buf: &[u8]) -> bool {
        if self.region_failed {
            return false;
        }
        if self.region.as_ref().is_some_and(|r| r.holds(buf)) {
            return true;
        }
        let this = (buf.as_ptr() as usize, buf.len());
        if std::mem::replace(&mut self.last_bcast, this) != this {
            return false;
        }
        if self
            .allreduce_regions
            .as_ref()
            .is_some_and(|(s, r)| s.overlaps(buf) || r.overlaps(buf))
        {
            self.allreduce_regions = None;
        }
        // The buffer before gets its own pages back first; its map holds
        // this one, unless a page of it is still mapped elsewhere.
        let spare = self.region.take().and_then(Region::unregister);
        self.region = self.register(Buffer::Bcast, buf, spare);
        self.region.is_some()
    }

    /// Whether `send` and `recv` are (now) registered in the ring's
    /// allreduce regions: as [`Ring::bcast_region`], for the pair.
    pub(super) fn allreduce_regions(&mut self, send: &[u8], recv: &[u8]) -> bool {
        if self.region_failed {
            return false;
        }
        if self
            .allreduce_regions
            .as_ref()
            .is_some_and(|(s, r)| s.holds(send) && r.holds(recv))
        {
            return true;
        }
        let this = (send.as_ptr() as usize, recv.as_ptr() as usize, recv.len());
        if std::mem::replace(&mut self.last_allreduce, this) != this || overlap(send, recv) {
            return false;
        }
        if self
            .region
            .as_ref()
            .is_some_and(|r| r.overlaps(send) || r.overlaps(recv))
        {
            self.region = None;
        }
        // Both pairs' pages given back before either is registered: a
        // buffer may be the other of the pair before.
        let (spare_send, spare_recv) = match self.allreduce_regions.take() {
            Some((s, r)) => (s.unregister(), r.unregister()),
            None => (None, None),
        };
        let Some(s) = self.register(Buffer::Send, send, spare_send) else {
            return false;
        };
        let Some(r) = self.register(Buffer::Recv, recv, spare_recv) else {
            return false;
        };
        self.allreduce_regions = Some((s, r));
        true
    }
}

/// Whether `a` and `b` share a byte (an erroneous call: MPI forbids
/// aliased buffers), which would put a page in both regions of the pair.
fn overlap(a: &[u8], b: &[u8]) -> bool {
    let (a0, b0) = (a.as_ptr() as usize, b.as_ptr() as usize);
    a0 < b0 + b.len() && b0 < a0 + a.len()
}
