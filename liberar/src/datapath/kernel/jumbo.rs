//! The inject path's runs for a datapath of jumbo chunks (larger than
//! ERAR_MAX_LINEAR_CHUNK_BYTES, which BPF_PROG_RUN's one-page live frames
//! cannot carry): the same frames erar_inject builds for ERAR_INJECT_START,
//! _RESEND, _NACK, _READY and _QUERY, built here from the slot's control
//! block and trip ([`Trip::last_sent`], [`Trip::awaited`]: erar_trip.h's
//! rules) and sent through the host's [`RawSender`]. `inject.rs` picks
//! these when the datapath has one, and [`HostDatapath::raw_ready`] for
//! every datapath with a socket, whatever its chunks; the counters they
//! add are the ones erar_inject would have counted.

use std::ops::Range;

use anyhow::{Context, Result};

use super::drive::{armed_op, stage_of, Trip};
use super::frame::erar_hdr;
use super::host::HostDatapath;
use super::raw::{erar_header, RawFrame, RawSender, BATCH};
use super::slot::SlotMaps;
use super::wire;

/// What every frame of a slot's armed operation shares.
struct Armed {
    seq: u32,
    pos: u32,
    n: u32,
    chunks: u32,
    ctl: wire::erar_slot_ctl,
    trip: Trip,
}

impl Armed {
    fn of(m: &SlotMaps, slot: u32) -> Result<Armed> {
        let (seq, pos, n, chunks, _) = armed_op(m, slot)?;
        // SAFETY: a plain copy of the control block; the fields read from
        // it were written before arming (route, operation, templates).
        let ctl = unsafe { m.ctl().read_volatile() };
        Ok(Armed {
            seq,
            pos,
            n,
            chunks,
            trip: Trip::from_ctl(&ctl),
            ctl,
        })
    }

    /// The header of this host's (kind, step) frame for `chunk`: to the
    /// next host, or (a NACK) to the previous one.
    fn header(&self, slot: u32, chunk: u32, (kind, step): (u32, u32)) -> [u8; super::PAYLOAD_OFF] {
        let upstream = kind & wire::ERAR_KIND_NACK != 0;
        let tmpl = if upstream {
            &self.ctl.nack_tmpl
        } else {
            &self.ctl.tmpl
        };
        let hdr = erar_hdr(
            (kind, step, self.ctl.wire_op),
            (self.ctl.comm_id, self.ctl.token),
            (self.seq, chunk, slot),
        );
        erar_header(tmpl, hdr)
    }
}

impl HostDatapath {
    /// ERAR_INJECT_START's runs `runs` of the armed operation: run i sends
    /// chunk `start_chunk(i)`'s first frame, its payload read by the kernel
    /// from the slot buffer (this host's contribution, or the broadcast
    /// root's data, which nothing writes until the chunk comes back).
    pub(super) fn raw_starts(
        &self,
        raw: &RawSender,
        m: &SlotMaps,
        slot: u32,
        runs: Range<u32>,
    ) -> Result<()> {
        let a = Armed::of(m, slot).context("injecting jumbo frames")?;
        let first = (a.ctl.trip.start_kind, 0);
        // On the stack: this runs once per burst of every call.
        let mut frames: [RawFrame<'_>; BATCH] = [([0; super::PAYLOAD_OFF], &[]); BATCH];
        let (mut k, mut sent) = (0, 0u64);
        for i in runs {
            let chunk = a.trip.start_chunk(a.pos, i);
            if chunk >= a.chunks.min(self.chunks_per_slot) {
                break;
            }
            // SAFETY: a chunk of our slot's mapping; see the fn docs for
            // why nothing writes it while the kernel reads it.
            let payload = unsafe { self.chunk_of(m, chunk) };
            frames[k] = (a.header(slot, chunk, first), payload);
            k += 1;
            if k == BATCH {
                raw.send(&frames)?;
                (k, sent) = (0, sent + BATCH as u64);
            }
        }
        raw.send(&frames[..k])?;
        self.raw_counts
            .add(wire::ERAR_STAT_INJECTED, sent + k as u64);
        Ok(())
    }

    /// ERAR_INJECT_RESEND (the frame this host last sent for each chunk,
    /// its payload copied and sent only if the chunk's stage did not move
    /// meanwhile) or ERAR_INJECT_NACK (a NACK for the frame it waits for,
    /// a full-size frame that the predecessor's XDP turns into that frame)
    /// for `chunks`; chunks with nothing to send are skipped and counted
    /// as erar_inject counts them. Returns how many chunks it was given.
    /// `payload`: the inject path's chunk-sized buffer.
    pub(super) fn raw_list(
        &self,
        raw: &RawSender,
        m: &SlotMaps,
        slot: u32,
        mode: u32,
        chunks: impl Iterator<Item = u32>,
        payload: &mut [u8],
    ) -> Result<u32> {
        let a = Armed::of(m, slot).context("re-sending or NACKing jumbo frames")?;
        let cb = self.chunk_bytes as usize;
        let states = m.states(self.chunks_per_slot);
        let stage = |c: u32| stage_of(&states[c as usize], a.seq);
        let payload = &mut payload[..cb];
        let (mut named, mut skipped, mut sent) = (0u32, 0u64, 0u64);
        for c in chunks {
            named += 1;
            if c >= a.chunks.min(self.chunks_per_slot) {
                skipped += 1;
                continue;
            }
            let s = stage(c);
            let frame = if mode == wire::ERAR_INJECT_NACK {
                a.trip
                    .awaited(a.n, a.pos, c, s)
                    .map(|(kind, step)| (kind | wire::ERAR_KIND_NACK, step))
            } else {
                a.trip.last_sent(a.n, a.pos, c, s).filter(|_| {
                    // SAFETY: a chunk of our slot's mapping, copied; a frame
                    // applied meanwhile moves its stage (checked below).
                    payload.copy_from_slice(unsafe { self.chunk_of(m, c) });
                    stage(c) == s
                })
            };
            let Some(kind_step) = frame else {
                skipped += 1;
                continue;
            };
            raw.send(&[(a.header(slot, c, kind_step), payload)])?;
            sent += 1;
        }
        let (done, skip) = if mode == wire::ERAR_INJECT_NACK {
            (wire::ERAR_STAT_NACK_SENT, wire::ERAR_STAT_RESEND_SKIP)
        } else {
            (wire::ERAR_STAT_RESENT, wire::ERAR_STAT_RESEND_SKIP)
        };
        self.raw_counts.add(done, sent);
        self.raw_counts.add(skip, skipped);
        Ok(named)
    }

    /// One READY of the joined operation, telling `count`, to the
    /// predecessor (ERAR_INJECT_READY) or as a query to the successor
    /// (ERAR_INJECT_QUERY): erar_inject's inject_ready(), full size.
    /// `payload`: the inject path's chunk-sized buffer (the key goes first;
    /// the rest is whatever it held).
    pub(super) fn raw_ready(
        &self,
        raw: &RawSender,
        m: &SlotMaps,
        slot: u32,
        mode: u32,
        count: u32,
        payload: &mut [u8],
    ) -> Result<()> {
        // SAFETY: a plain copy of the control block (route and key written
        // before joining; join_seq read as XDP reads it).
        let ctl = unsafe { m.ctl().read_volatile() };
        let query = mode == wire::ERAR_INJECT_QUERY;
        let step = if query { wire::ERAR_READY_QUERY } else { 0 };
        let join_seq = m.join_seq().load(std::sync::atomic::Ordering::Acquire);
        let hdr = erar_hdr(
            (wire::ERAR_KIND_READY, step, 0),
            (ctl.comm_id, ctl.token),
            (join_seq, count, slot),
        );
        let tmpl = if query { &ctl.tmpl } else { &ctl.nack_tmpl };
        let payload = &mut payload[..self.chunk_bytes as usize];
        for (dst, k) in payload.chunks_exact_mut(4).zip(ctl.key) {
            dst.copy_from_slice(&k.to_le_bytes());
        }
        raw.send(&[(erar_header(tmpl, hdr), payload)])
            .with_context(|| format!("sending READY {count} (mode {mode}) on slot {slot}"))?;
        self.raw_counts.add(wire::ERAR_STAT_READY_SENT, 1);
        Ok(())
    }

    /// Chunk `chunk` of the slot buffer of `m`.
    ///
    /// # Safety
    /// The caller knows what else may write the chunk while it is read.
    unsafe fn chunk_of<'m>(&self, m: &'m SlotMaps, chunk: u32) -> &'m [u8] {
        let cb = self.chunk_bytes as usize;
        std::slice::from_raw_parts(m.buf().add(chunk as usize * cb), cb)
    }
}
