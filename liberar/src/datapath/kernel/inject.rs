//! Putting frames on the wire with BPF_PROG_RUN (live frames) of
//! `erar_xdp`: an operation's starting chunks, paced ([`InjectPacing`],
//! [`HostDatapath::inject`], which NACKs what goes missing while its window
//! is shut), or only the first window when its frames circulate (the rest
//! start in XDP; [`HostDatapath::restart`] starts what lost frames leave
//! unstarted), listed ones: re-sends ([`HostDatapath::resend`]) and NACKs
//! ([`HostDatapath::nack`]), and the barrier's READY frames.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, ensure, Context, Result};

use super::drive::{armed_op, armed_trip, chunks_starting_at, is_final};
use super::host::{HostDatapath, InjectPacing, Injector};
use super::raw::RawSender;
use super::slot::SlotMaps;
use super::{wire, PAYLOAD_OFF};
use crate::datapath::lanes::Lanes;

/// The pages a live BPF_PROG_RUN's page pool allocates, and fills with a
/// copy of the input, when it starts (the kernel's PP_ALLOC_CACHE_REFILL).
const POOL_PAGES: u32 = 64;

/// Offsets of erar_hdr.slot and erar_hdr.token in a frame.
const HDR_SLOT_OFF: usize =
    wire::ERAR_L2L4_LEN as usize + std::mem::offset_of!(wire::erar_hdr, slot);
const HDR_TOKEN_OFF: usize =
    wire::ERAR_L2L4_LEN as usize + std::mem::offset_of!(wire::erar_hdr, token);

impl HostDatapath {
    /// Sets how [`Self::inject`] paces frames.
    pub fn set_inject_pacing(&self, pacing: InjectPacing) {
        let mut inject = self.inject.lock();
        inject.pacing = pacing;
        self.circulate.store(pacing.circulate, Ordering::Relaxed);
    }

    pub fn inject_pacing(&self) -> InjectPacing {
        self.inject.lock().pacing
    }

    /// Puts this host's starting chunks (its run, see `trip_of`) of the armed
    /// operation on the wire, paced by [`InjectPacing`]. Every host of the
    /// ring must have armed the slot before any host injects. For
    /// `ERAR_OP_BCAST` only the root calls this, and it sends every chunk.
    pub fn inject(&self, slot: u32) -> Result<()> {
        let m = self.slot_maps(slot)?;
        let (seq, pos, n, chunks, wire_op) =
            armed_op(&m, slot).with_context(|| format!("inject on slot {slot}"))?;
        let bcast = wire_op == wire::ERAR_OP_BCAST;
        ensure!(n >= 1, "slot {slot} has no route");
        if n == 1 {
            // A ring of one: the contribution is the result.
            m.done().store(chunks, Ordering::SeqCst);
            return Ok(());
        }
        let mine = chunks_starting_at(&m, pos, chunks);
        let mut inj = self.inject.lock();
        let pacing = inj.pacing;
        let batch = pacing.batch.clamp(1, 256);
        name_slot(&mut inj.frame, &m, slot);
        if bcast {
            // SAFETY: under the inject mutex.
            unsafe { set_inject(&m, wire::ERAR_INJECT_START, mine, 0) };
            return self.inject_from_lanes(&inj.frame, &m, slot, mine, batch);
        }
        if m.circulates() {
            // The first window only: erar_xdp starts the rest as frames
            // end their trips here (end_trip), and wait() starts what
            // lost frames leave unstarted (restart()).
            let first = pacing.window.div_ceil(n).max(1);
            return self
                .start(&inj.frame, &m, slot, (first, mine), batch)
                .map(|_| ());
        }
        let burst = pacing.burst.max(1);
        let done = m.done();
        let mut sent = 0u32;
        // Frames given up on while waiting for the window: lost ones never
        // complete, and would otherwise close the window for good.
        let mut written_off = 0u64;
        while sent < mine {
            if pacing.window != u32::MAX {
                let Injector { frame, payload, .. } = &mut *inj;
                // A pause while the window is shut: chunks lost on their way
                // hold it shut; NACK the ones missing below the frontier
                // (as wait() does), so that the ring repairs them now
                // rather than after the quiet period writes them off.
                let mut repair = || {
                    let missing = self.missing_below_frontier(&m, seq, chunks);
                    // A failed NACK run only leaves the repair to wait().
                    let bufs = (&mut **frame, &mut **payload);
                    let _ =
                        self.run_list_on(bufs, batch, &m, slot, wire::ERAR_INJECT_NACK, missing);
                    name_slot(frame, &m, slot);
                };
                written_off = wait_for_window(
                    done,
                    (n as u64 * sent as u64, pacing.window as u64),
                    written_off,
                    (pacing.nack_after, &mut repair),
                    pacing.quiet,
                );
            }
            let k = self.start(&inj.frame, &m, slot, (burst, mine), batch)?;
            if k == 0 {
                break;
            }
            sent += k;
        }
        Ok(())
    }

    /// Starts what lost frames left unstarted on a ring whose frames
    /// circulate: each frame that ends its trip here starts one chunk, so
    /// a frame lost for good (repaired by a re-send from further up, or
    /// never) leaves one chunk fewer started. Up to one burst of this
    /// host's starting frames not taken yet; returns how many it sent.
    pub fn restart(&self, slot: u32) -> Result<u32> {
        let m = self.slot_maps(slot)?;
        let (_, pos, n, chunks, _) =
            armed_op(&m, slot).with_context(|| format!("restart on slot {slot}"))?;
        if n < 2 || !m.circulates() {
            return Ok(0);
        }
        let mine = chunks_starting_at(&m, pos, chunks);
        if m.start_next().load(Ordering::Acquire) >= mine {
            return Ok(0);
        }
        let mut inj = self.inject.lock();
        let (burst, batch) = (inj.pacing.burst.max(1), inj.pacing.batch.clamp(1, 256));
        name_slot(&mut inj.frame, &m, slot);
        self.start(&inj.frame, &m, slot, (burst, mine), batch)
    }

    /// Takes up to `want` of this host's `mine` starting frames from the
    /// slot's start_next (circulating frames take them too) and sends
    /// them; returns how many it took. Under the inject mutex (`frame` is
    /// its input frame, naming the slot).
    fn start(
        &self,
        frame: &[u8],
        m: &SlotMaps,
        slot: u32,
        (want, mine): (u32, u32),
        batch: u32,
    ) -> Result<u32> {
        let next = m.start_next();
        let mut first = next.load(Ordering::Acquire);
        let k = loop {
            let k = want.min(mine.saturating_sub(first));
            if k == 0 {
                return Ok(0);
            }
            match next.compare_exchange_weak(first, first + k, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break k,
                Err(now) => first = now,
            }
        };
        match self.jumbo()? {
            Some(raw) => self.raw_starts(raw, m, slot, first..first + k),
            None => {
                // SAFETY: under the inject mutex.
                unsafe { set_inject(m, wire::ERAR_INJECT_START, k, first) };
                self.prog_run_live(frame, k, batch)
            }
        }
        .with_context(|| {
            format!(
                "injecting starting frames {first}..{} of slot {slot}",
                first + k
            )
        })?;
        Ok(k)
    }

    /// A broadcast root's injection: every chunk, from every lane at once
    /// (see [`crate::datapath::lanes`]); erar_inject hands out the chunks
    /// from one atomic counter, so the lanes need not agree on which.
    ///
    /// A root sees none of its frames come back, so it has no progress to
    /// pace by and sends its share in one BPF_PROG_RUN per lane: the
    /// batches inside it are flushed and forwarded in softirq one after the
    /// other, without a syscall and page-pool setup per burst (16 MiB:
    /// 15-25% faster than bursts of 32, measured).
    fn inject_from_lanes(
        &self,
        frame: &[u8],
        m: &SlotMaps,
        slot: u32,
        chunks: u32,
        batch: u32,
    ) -> Result<()> {
        let lanes = Lanes::get();
        let share = chunks.div_ceil(lanes.count() as u32);
        let raw = self.jumbo()?;
        lanes.run(|lane| {
            let first = share * lane as u32;
            let count = share.min(chunks.saturating_sub(first));
            if count == 0 {
                return Ok(());
            }
            match raw {
                Some(raw) => self.raw_starts(raw, m, slot, first..first + count),
                None => self.prog_run_live(frame, count, batch),
            }
            .with_context(|| {
                format!("injecting {count} of the {chunks} frames of slot {slot} (lane {lane})")
            })
        })
    }

    /// Re-sends, for each of `chunks`, the frame this host last sent for it
    /// in the armed operation (see `last_sent` in erar_ring.bpf.c): the
    /// successor reported them missing. Chunks this host has nothing stable
    /// for are skipped (counted as `resend_skip`).
    pub fn resend(&self, slot: u32, chunks: &[u32]) -> Result<()> {
        let m = self.slot_maps(slot)?;
        armed_op(&m, slot).with_context(|| format!("resend on slot {slot}"))?;
        self.run_list(&m, slot, wire::ERAR_INJECT_RESEND, chunks.iter().copied())
            .map(|_| ())
    }

    /// Injects in `mode` (RESEND or NACK) one frame per chunk of `chunks`,
    /// through the slot's resend list (ERAR_RESEND_MAX per BPF_PROG_RUN);
    /// returns how many chunks it named.
    fn run_list(
        &self,
        m: &SlotMaps,
        slot: u32,
        mode: u32,
        chunks: impl Iterator<Item = u32>,
    ) -> Result<u32> {
        let mut inj = self.inject.lock();
        let batch = inj.pacing.batch.clamp(1, 256);
        let Injector { frame, payload, .. } = &mut *inj;
        self.run_list_on((frame, payload), batch, m, slot, mode, chunks)
    }

    /// [`Self::run_list`] with the inject mutex held (`frame` and
    /// `payload` are its buffers).
    fn run_list_on(
        &self,
        (frame, payload): (&mut [u8], &mut [u8]),
        batch: u32,
        m: &SlotMaps,
        slot: u32,
        mode: u32,
        chunks: impl Iterator<Item = u32>,
    ) -> Result<u32> {
        if let Some(raw) = self.jumbo()? {
            return self.raw_list(raw, m, slot, mode, chunks, payload);
        }
        name_slot(frame, m, slot);
        // SAFETY: the slot's resend list, written only under the inject
        // mutex and read by XDP only within our BPF_PROG_RUN.
        let list = unsafe { &mut *m.resend_list() };
        let flush = |len: usize| -> Result<()> {
            // SAFETY: under the inject mutex.
            unsafe { set_inject(m, mode, len as u32, 0) };
            self.prog_run_live(frame, len as u32, batch)
                .with_context(|| {
                    format!("injecting {len} listed frames (mode {mode}) on slot {slot}")
                })
        };
        let (mut named, mut len) = (0u32, 0usize);
        for c in chunks {
            list.chunk[len] = c;
            len += 1;
            named += 1;
            if len == list.chunk.len() {
                flush(len)?;
                len = 0;
            }
        }
        if len > 0 {
            flush(len)?;
        }
        Ok(named)
    }

    /// The socket frames go out through when chunks are larger than a live
    /// frame (see `kernel/jumbo.rs`); None: BPF_PROG_RUN sends them.
    fn jumbo(&self) -> Result<Option<&RawSender>> {
        if self.chunk_bytes <= wire::ERAR_MAX_LINEAR_CHUNK_BYTES {
            return Ok(None);
        }
        self.raw.as_ref().map(Some).ok_or_else(|| {
            anyhow!(
                "{}-byte chunks need jumbo frames, sent from an AF_PACKET socket this \
                 process could not open (CAP_NET_RAW)",
                self.chunk_bytes
            )
        })
    }

    /// One BPF_PROG_RUN of erar_xdp (attached, so no dispatcher update) in
    /// live-frames mode: it injects `repeat` frames. A run of fewer frames
    /// than the kernel's page pool allocates up front hands in the headers
    /// alone, which erar_inject grows to a whole frame (see grow_to_frame
    /// in erar_ring.bpf.c: the kernel copies the input into each of those
    /// pages, where a grown frame costs a zeroing of its own); a longer run
    /// recycles its pages, and hands in the whole frame.
    fn prog_run_live(&self, frame: &[u8], repeat: u32, batch: u32) -> Result<()> {
        let input = if repeat < POOL_PAGES {
            &frame[..PAYLOAD_OFF.min(frame.len())]
        } else {
            frame
        };
        // SAFETY: zeroed opts is the documented default; sz tells libbpf
        // which fields we know.
        let mut opts: libbpf_sys::bpf_test_run_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_test_run_opts>() as _;
        opts.data_in = input.as_ptr().cast();
        opts.data_size_in = input.len() as u32;
        opts.repeat = repeat as _;
        opts.flags = libbpf_sys::BPF_F_TEST_XDP_LIVE_FRAMES;
        opts.batch_size = batch;
        let fd = self.prog_fd().as_raw_fd();
        // SAFETY: opts and the frame outlive the call.
        let ret = unsafe { libbpf_sys::bpf_prog_test_run_opts(fd, &mut opts) };
        if ret != 0 {
            return Err(std::io::Error::from_raw_os_error(-ret))
                .context("BPF_PROG_RUN (live frames) of erar_xdp");
        }
        Ok(())
    }

    /// Asks the predecessor, with one NACK each (ERAR_INJECT_NACK), for the
    /// frame this host waits for next for chunks of armed operation `seq`
    /// that are not final here: every such chunk, or (`below`) only those
    /// whose place in their run (`Trip::place_in_run`, see
    /// [`HostDatapath::frontier`]) is below it. Returns how many chunks were
    /// asked about (the kernel skips those a frame is being applied to).
    pub fn nack(&self, slot: u32, seq: u32, below: Option<u32>) -> Result<u32> {
        let m = self.slot_maps(slot)?;
        let (armed_seq, _, n, chunks, _) =
            armed_op(&m, slot).with_context(|| format!("NACK on slot {slot}"))?;
        ensure!(
            armed_seq == seq,
            "NACK on slot {slot} for seq {seq}, armed {armed_seq}"
        );
        if n < 2 {
            return Ok(0);
        }
        let missing = self.missing(&m, seq, chunks, below.unwrap_or(u32::MAX));
        self.run_list(&m, slot, wire::ERAR_INJECT_NACK, missing)
    }

    /// The first `chunks` chunks of operation `seq` not final on this host
    /// whose place in their run is below `end`.
    fn missing<'a>(
        &self,
        m: &'a SlotMaps,
        seq: u32,
        chunks: u32,
        end: u32,
    ) -> impl Iterator<Item = u32> + 'a {
        let trip = armed_trip(m);
        let states = m.states(self.chunks_per_slot);
        states[..(chunks as usize).min(states.len())]
            .iter()
            .enumerate()
            .filter(move |&(c, w)| !is_final(w, seq) && trip.place_in_run(c as u32) < end)
            .map(|(c, _)| c as u32)
    }

    /// The chunks of operation `seq` missing below this host's frontier.
    fn missing_below_frontier<'a>(
        &self,
        m: &'a SlotMaps,
        seq: u32,
        chunks: u32,
    ) -> impl Iterator<Item = u32> + 'a {
        self.missing(m, seq, chunks, self.frontier(m, seq, chunks))
    }

    /// Sends one READY of the operation this host joined on `slot`, telling
    /// `count` (see "Barrier" in erar_wire.h): to the predecessor
    /// (`mode` ERAR_INJECT_READY), or as a query to the successor
    /// (ERAR_INJECT_QUERY).
    ///
    /// Through the socket where there is one (`kernel/raw.rs`), for any
    /// chunk size: a BPF_PROG_RUN in live-frames mode sets up and tears
    /// down a page pool for its one frame. Paired calls (crate::paired,
    /// session 42), 4 hosts, socket against BPF_PROG_RUN: `osu_bcast -i
    /// 800` 1.10-1.19x at 1 MiB, 1.03-1.12x at 2 MiB, 1.02-1.06x at 4 MiB
    /// (two barriers a call; B also ended at the successor, see
    /// `Ring::in_place_done`, worth about 2% alone); `osu_allreduce -T
    /// mpi_int -i 500` 0.98-1.06x at 1-8 MiB (one barrier, longer calls).
    /// Sessions 34 and 38 had read this as noise in rotating rounds
    /// (geometric means 1.03-1.04x).
    pub(super) fn send_ready(&self, m: &SlotMaps, slot: u32, mode: u32, count: u32) -> Result<()> {
        let mut inj = self.inject.lock();
        // SAFETY: under the inject mutex.
        unsafe { set_inject(m, mode, count, 0) };
        if let Some(raw) = &self.raw {
            return self.raw_ready(raw, m, slot, mode, count, &mut inj.payload);
        }
        name_slot(&mut inj.frame, m, slot);
        self.prog_run_live(&inj.frame, 1, 1)
            .with_context(|| format!("sending READY {count} (mode {mode}) on slot {slot}"))
    }
}

/// Makes the inject path's input frame name `slot`, with the slot's token:
/// erar_inject drives a slot only for a frame that carries it, so a process
/// can inject for the slots it holds only.
fn name_slot(frame: &mut [u8], m: &SlotMaps, slot: u32) {
    // SAFETY: written by configure_slot() only, never concurrently.
    let token = unsafe { std::ptr::addr_of!((*m.ctl()).token).read_volatile() };
    frame[HDR_SLOT_OFF..HDR_SLOT_OFF + 2].copy_from_slice(&(slot as u16).to_le_bytes());
    frame[HDR_TOKEN_OFF..HDR_TOKEN_OFF + 4].copy_from_slice(&token.to_le_bytes());
}

/// Sets the slot's inject mode, the runs to make (`count`; READY: the
/// count to tell) and the first starting frame (START), and restarts its
/// run counter.
///
/// # Safety
/// Under the inject mutex (one runner of the slot's inject fields).
unsafe fn set_inject(m: &SlotMaps, mode: u32, count: u32, first: u32) {
    let ctl = m.ctl();
    std::ptr::addr_of_mut!((*ctl).inject_mode).write_volatile(mode);
    std::ptr::addr_of_mut!((*ctl).inject_count).write_volatile(count);
    std::ptr::addr_of_mut!((*ctl).inject_first).write_volatile(first);
    std::ptr::addr_of_mut!((*ctl).inject_next).write_volatile(0);
}

/// Waits until `issued - done - written_off <= window`, i.e. a burst may
/// start, and returns the new `written_off`. Each `pause` (the NACK period)
/// without progress calls `repair` (NACKs for what went missing). If `done`
/// stops moving for `quiet`, every frame still outstanding is presumed lost
/// (recovery re-sends lost frames after injection) and written off, which
/// opens the window: lost frames never complete and would otherwise keep it
/// shut.
fn wait_for_window(
    done: &AtomicU32,
    (issued, window): (u64, u64),
    written_off: u64,
    (pause, repair): (Option<Duration>, &mut dyn FnMut()),
    quiet: Duration,
) -> u64 {
    let mut last = done.load(Ordering::Acquire);
    let mut last_progress = Instant::now();
    let mut last_repair = last_progress;
    let mut spins = 0u32;
    loop {
        let d = done.load(Ordering::Acquire);
        let outstanding = issued.saturating_sub(d as u64);
        if outstanding.saturating_sub(written_off) <= window {
            return written_off;
        }
        let now = Instant::now();
        if d != last {
            last = d;
            last_progress = now;
            last_repair = now;
        } else if now.duration_since(last_progress) >= quiet {
            return outstanding;
        } else if pause.is_some_and(|p| now.duration_since(last_repair) >= p) {
            repair();
            last_repair = Instant::now();
        }
        // Other hosts' frames are processed in softirq on these same CPUs:
        // give them the CPU rather than spin.
        spins += 1;
        if spins < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}
