//! The in-kernel barrier of one operation (see "Barrier" in erar_wire.h):
//! this host joins the operation with its call key and tells its
//! predecessor ([`HostDatapath::join`]); its XDP learns from the
//! successor's READY frames how many hosts down the ring have joined, and
//! whether a key differs ([`HostDatapath::barrier`] reads it, and tells the
//! predecessor again while it waits).

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Result;

use super::drive::sleep_on_events;
use super::host::HostDatapath;
use super::slot::SlotMaps;
use super::wire;

/// A call key, as the barrier compares it (the ring's `CallKey` words).
pub type CallKeyWords = [u32; wire::ERAR_KEY_WORDS as usize];

/// Where this host stands in an operation's barrier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BarrierState {
    /// Not every host has joined yet, as far as this host knows: its
    /// successor told it of `0` consecutive joined hosts from itself on.
    Waiting(u32),
    /// Every host joined with this host's key: it may inject.
    Passed,
    /// Some host joined with another key: the call is erroneous, and it
    /// fails on every host.
    Aborted,
}

impl HostDatapath {
    /// Joins operation `seq` of `slot` (armed already, or to be armed only
    /// once every host has joined) with call `key`, and tells the
    /// predecessor. Returns where the barrier stands.
    pub fn join(&self, slot: u32, seq: u32, key: CallKeyWords) -> Result<BarrierState> {
        let m = self.slot_maps(slot)?;
        let ctl = m.ctl();
        // SAFETY: only this rank writes the key, and XDP reads it only
        // after seeing join_seq (published below with SeqCst).
        unsafe { std::ptr::addr_of_mut!((*ctl).key).write_volatile(key) };
        m.join_seq().store(seq, Ordering::SeqCst);
        // SeqCst on both sides: either XDP saw the join and tells the
        // predecessor itself, or this read sees what it kept.
        let state = barrier_state(&m, seq, key);
        self.tell(&m, slot, state)?;
        Ok(state)
    }

    /// Waits up to `tick` for operation `seq`'s barrier to move (XDP posts an
    /// event when this host passes or the call aborts), then, if
    /// `tell_again` (a READY may have been lost), tells the predecessor
    /// again and asks the successor for its count (which, once passed, it
    /// tells nobody on its own), and returns where it stands.
    pub fn barrier(
        &self,
        slot: u32,
        seq: u32,
        key: CallKeyWords,
        tick: Duration,
        tell_again: bool,
    ) -> Result<BarrierState> {
        let m = self.slot_maps(slot)?;
        let state = barrier_state(&m, seq, key);
        if state != BarrierState::Passed && state != BarrierState::Aborted {
            sleep_on_events(&m, tick)?;
        }
        let state = barrier_state(&m, seq, key);
        if tell_again && state != BarrierState::Passed {
            self.tell(&m, slot, state)?;
            self.send_ready(&m, slot, wire::ERAR_INJECT_QUERY, count_of(&m, state))?;
        }
        Ok(state)
    }

    /// Tells the predecessor the count `state` gives this host.
    fn tell(&self, m: &SlotMaps, slot: u32, state: BarrierState) -> Result<()> {
        self.send_ready(m, slot, wire::ERAR_INJECT_READY, count_of(m, state))
    }
}

/// The count this host tells in `state`: 1 + its successor's, at most the
/// ring's size, or ERAR_READY_ABORT.
fn count_of(m: &SlotMaps, state: BarrierState) -> u32 {
    // SAFETY: written by configure_slot() only, never concurrently.
    let n = unsafe { std::ptr::addr_of!((*m.ctl()).ring_size).read_volatile() };
    match state {
        BarrierState::Waiting(c) => (c + 1).min(n),
        BarrierState::Passed => n,
        BarrierState::Aborted => wire::ERAR_READY_ABORT,
    }
}

/// Where operation `seq`'s barrier stands on this host, from the newest
/// count its successor told it.
fn barrier_state(m: &SlotMaps, seq: u32, key: CallKeyWords) -> BarrierState {
    // The key beside the word, read between two equal reads of the word
    // (XDP writes it before the compare-and-swap that publishes a word).
    let (word, told_key) = loop {
        let word = m.ready().load(Ordering::SeqCst);
        // SAFETY: a plain read of the mapping; torn reads are retried.
        let told_key = unsafe { std::ptr::addr_of!((*m.ctl()).ready_key).read_volatile() };
        if m.ready().load(Ordering::SeqCst) == word {
            break (word, told_key);
        }
    };
    let (told_seq, count) = ((word >> 32) as u32, word as u32);
    if told_seq != seq {
        // A successor on a newer operation has passed this one's barrier,
        // so every host joined it; an older one has not joined yet.
        // Seqs count 1..2^31-1 and wrap to 1: they compare in 31 bits (as
        // erar_ring.bpf.c's seq_after()).
        let ahead = told_seq.wrapping_sub(seq) & 0x7fff_ffff;
        return if ahead != 0 && ahead < 0x4000_0000 {
            BarrierState::Passed
        } else {
            BarrierState::Waiting(0)
        };
    }
    if count == wire::ERAR_READY_ABORT {
        return BarrierState::Aborted;
    }
    if told_key != key {
        // Told before this host joined (its XDP could not check).
        return BarrierState::Aborted;
    }
    // SAFETY: as in tell().
    let n = unsafe { std::ptr::addr_of!((*m.ctl()).ring_size).read_volatile() };
    if count + 1 >= n {
        BarrierState::Passed
    } else {
        BarrierState::Waiting(count)
    }
}
