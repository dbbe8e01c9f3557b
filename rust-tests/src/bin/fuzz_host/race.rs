//! The race phase: frames run on both CPUs at once (duplicates racing for
//! a chunk's stage or a slot's barrier word, a data frame racing with a
//! NACK for its chunk), checked against the model.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::Result;
use liberar::datapath::affinity::bind;
use liberar::datapath::wire;

use crate::counters::NR;
use crate::frames::{C_READY, C_VALID};
use crate::layout::{hex, le16, le32, AG, NACK, O_CHUNK, O_KIND, O_SLOT, O_STEP, PL, RS};
use crate::model::{Prediction, Verdict};
use crate::runner::{prog_run_raw, Fuzzer, Outcome, RunRes, XDP_DROP, XDP_PASS, XDP_TX};

/// Handed from the main thread to the racing worker.
struct RaceShared {
    /// Round published by the main thread (u64::MAX: stop).
    go: AtomicU64,
    /// Round the worker has finished.
    done: AtomicU64,
    frame: Mutex<Vec<u8>>,
    result: Mutex<(RunRes, Vec<u8>, Instant, Instant)>,
}

/// Spins (then yields) until `cond`.
fn spin_until(cond: impl Fn() -> bool) {
    let mut n = 0u32;
    while !cond() {
        n += 1;
        if n < 20_000 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// One round on two CPUs: `mine` on this thread, `theirs` on the worker,
/// released by one store. Returns both outcomes and whether the runs
/// overlapped in time.
fn race_pair(
    fz: &mut Fuzzer,
    sh: &RaceShared,
    round: u64,
    mine: &[u8],
    theirs: &[u8],
) -> (Outcome, Outcome, bool) {
    *sh.frame.lock().unwrap() = theirs.to_vec();
    sh.go.store(round, Ordering::Release);
    let a = Instant::now();
    let r = fz.prog_run(mine);
    let b = Instant::now();
    let o = match r {
        Ok((_, len)) => fz.out[..len.min(fz.out.len())].to_vec(),
        Err(_) => Vec::new(),
    };
    spin_until(|| sh.done.load(Ordering::Acquire) == round);
    let (wr, wo, wa, wb) =
        std::mem::replace(&mut *sh.result.lock().unwrap(), (Err(0), Vec::new(), a, a));
    ((r, o), (wr, wo), a < wb && wa < b)
}

fn verdict_of(r: &RunRes) -> Option<Verdict> {
    match *r {
        Err(e) if e == libc::EINVAL => Some(Verdict::Einval),
        Ok((XDP_DROP, _)) => Some(Verdict::Drop),
        Ok((XDP_PASS, _)) => Some(Verdict::Pass),
        Ok((XDP_TX, _)) => Some(Verdict::Tx),
        _ => None,
    }
}

/// Outcomes of the NACK-vs-data race rounds.
#[derive(Default)]
struct NackRace {
    rounds: u64,
    overlapped: u64,
    /// Rounds whose data frame changed the chunk's stage.
    moved: u64,
    outcomes: BTreeMap<&'static str, u64>,
}

/// One round of a valid data frame racing with a NACK for the same chunk
/// that names the frame this host last sent before the data frame's stage
/// change or the one it sends with it. The data frame must have exactly its
/// effect (a NACK changes nothing). The NACK must be answered as before the
/// change (payload: the chunk before) or as after it (payload: the chunk
/// after), i.e. always with a payload that matches the (kind, step) it is
/// labelled with; or dropped with nack_skip, untouched (it read the stage
/// word while `busy`), or rewritten with every payload byte the chunk's old
/// or new one (the change overtook its copy).
fn race_nack_round(fz: &mut Fuzzer, sh: &RaceShared, round: u64, st: &mut NackRace) -> Result<()> {
    let f = fz.gen.frame(&fz.model, C_VALID);
    let target = fz.before(&f);
    let (slot, chunk) = (le16(&f, O_SLOT) as usize, le32(&f, O_CHUNK));
    let ls_before = target.and_then(|_| fz.model.last_sent_now(slot, chunk));
    let pd = fz.model.run(&f);
    let ls_after = target.and_then(|_| fz.model.last_sent_now(slot, chunk));
    let moved = pd.ctr[wire::ERAR_STAT_RX_RS as usize] + pd.ctr[wire::ERAR_STAT_RX_AG as usize] > 0;
    let r = &mut fz.gen.rng;
    let named: Vec<(u8, u8)> = [ls_before, ls_after].into_iter().flatten().collect();
    let (k, s) = if named.is_empty() {
        (r.pick(&[RS, AG]), r.below(4) as u8)
    } else {
        r.pick(&named)
    };
    let mut g = f.clone();
    g[O_KIND] = NACK | k;
    g[O_STEP] = s;
    r.fill(&mut g[PL..]);
    let nack_on_worker = r.chance(1, 2);
    // The NACK's outcome against the chunk as the data frame leaves it, and
    // as it was before (the NACK path reads only the stage word and the
    // chunk, or on registered buffers this host's input, which no frame
    // writes).
    let p_after = fz.model.run(&g);
    let after_chunk = target.map(|idx| {
        let at = fz.model.written_at(slot, chunk as usize);
        let after = (fz.model.state[idx], fz.model.buf[at.clone()].to_vec());
        fz.model.state[idx] = fz.before_word.unwrap();
        fz.model.buf[at].copy_from_slice(&fz.before_chunk);
        after
    });
    let p_before = fz.model.run(&g);
    if let (Some(idx), Some((w, b))) = (target, &after_chunk) {
        let at = fz.model.written_at(slot, chunk as usize);
        fz.model.state[idx] = *w;
        fz.model.buf[at].copy_from_slice(b);
    }

    let (data, nack, overlap) = if nack_on_worker {
        race_pair(fz, sh, round, &f, &g)
    } else {
        let (n, d, o) = race_pair(fz, sh, round, &g, &f);
        (d, n, o)
    };
    st.rounds += 1;
    st.overlapped += overlap as u64;
    st.moved += moved as u64;
    let nv = verdict_of(&nack.0);
    // The NACK's counters: the round's less the data frame's (which the
    // NACK cannot change; check() verifies them). They tell a NACK
    // dropped for its own reason (a refused region) from one that met the
    // chunk mid-change (`nack_skip`), whose verdicts and frames are alike.
    let (delta, events) = fz.observe()?;
    let nack_ctr: [u64; NR] = std::array::from_fn(|i| delta[i].wrapping_sub(pd.ctr[i]));
    let fits = |p: &Prediction| nv == Some(p.verdict) && nack.1 == p.out && p.ctr == nack_ctr;
    let skip = |out: Vec<u8>| {
        let mut ctr = [0u64; NR];
        ctr[wire::ERAR_STAT_NACK_SKIP as usize] = 1;
        Prediction {
            verdict: Verdict::Drop,
            ctr,
            out,
            events: Vec::new(),
        }
    };
    let dropped = |p: &Prediction| {
        if p.ctr[wire::ERAR_STAT_REGION_ERR as usize] > 0 {
            "refused"
        } else {
            "skipped"
        }
    };
    let (label, chosen) = if fits(&p_before) {
        let l = if p_before.verdict == Verdict::Tx {
            "served-before"
        } else {
            dropped(&p_before)
        };
        (l, p_before)
    } else if fits(&p_after) {
        let l = if p_after.verdict == Verdict::Tx {
            "served-after"
        } else {
            dropped(&p_after)
        };
        (l, p_after)
    } else if moved && nv == Some(Verdict::Drop) && nack.1 == g {
        ("skipped-busy", skip(g.clone()))
    } else if moved
        && p_before.verdict == Verdict::Tx
        && nv == Some(Verdict::Drop)
        && nack.1.len() == p_before.out.len()
        && nack.1[..PL] == p_before.out[..PL]
        && after_chunk.as_ref().is_some_and(|(_, new)| {
            // Every byte the answer's before (what it read: the chunk as
            // it was, or this host's input on registered buffers) or the
            // chunk as the data frame left it.
            nack.1[PL..]
                .iter()
                .zip(p_before.out[PL..].iter().zip(new))
                .all(|(x, (o, n))| x == o || x == n)
        })
    {
        ("skipped-overtaken", skip(nack.1.clone()))
    } else {
        let out = &nack.1;
        let first = out.iter().zip(&p_before.out).position(|(a, b)| a != b);
        fz.mismatch(
            "race-nack",
            &g,
            "NACK outcome",
            format!(
                "{:?} len {} (first difference to the answer before the data frame at {first:?}); \
                 neither the answer before ({:?}) nor after ({:?}) nor a nack_skip; racing data frame {}",
                nack.0,
                out.len(),
                p_before.verdict,
                p_after.verdict,
                hex(&f)
            ),
        );
        ("MISMATCH", p_before)
    };
    *st.outcomes.entry(label).or_default() += 1;
    fz.check(
        "race-nack",
        &f,
        target,
        &[pd, chosen],
        vec![data, nack],
        delta,
        events,
        true,
    )?;
    Ok(())
}

/// Every round, the same frame runs on two CPUs at once (the main thread and
/// a worker, released by one store): duplicates racing for a chunk's stage,
/// or READYs racing for the slot's `ready` word (its compare-and-swap: one
/// copy is taken, the other is stale). The model predicts the frame applied
/// twice in a row; whichever copy wins, the kernel must end in exactly that
/// state, with exactly those counters. A quarter of the rounds race a data
/// frame with a NACK instead ([`race_nack_round`]).
pub fn race_phase(
    fz: &mut Fuzzer,
    rounds: u64,
    epoch_left: &mut u64,
    first: &mut bool,
) -> Result<String> {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let prog_fd = fz.dp.prog_fd().as_raw_fd();
    let ifindex = fz.dp.ifindex();
    let sh = RaceShared {
        go: AtomicU64::new(0),
        done: AtomicU64::new(0),
        frame: Mutex::new(Vec::new()),
        result: Mutex::new((Err(0), Vec::new(), Instant::now(), Instant::now())),
    };
    let (mut overlapped, mut accepted, mut accepted_overlapped) = (0u64, 0u64, 0u64);
    // READY rounds, and those whose first copy the model takes.
    let (mut ready_rounds, mut ready_taken) = (0u64, 0u64);
    let mut nr = NackRace::default();
    let t0 = Instant::now();
    let before = fz.mismatches;
    std::thread::scope(|s| -> Result<()> {
        let sh = &sh;
        s.spawn(move || {
            // Unpinned, the two threads race less often, no less rightly.
            if cpus > 1 {
                let _ = bind(1);
            }
            let mut out = vec![0u8; 3 * 4096 + 8192];
            let mut last = 0u64;
            loop {
                spin_until(|| sh.go.load(Ordering::Acquire) != last);
                last = sh.go.load(Ordering::Acquire);
                if last == u64::MAX {
                    return;
                }
                let f = sh.frame.lock().unwrap().clone();
                let a = Instant::now();
                let r = prog_run_raw(prog_fd, ifindex, &f, &mut out);
                let b = Instant::now();
                let o = match r {
                    Ok((_, len)) => out[..len.min(out.len())].to_vec(),
                    Err(_) => Vec::new(),
                };
                *sh.result.lock().unwrap() = (r, o, a, b);
                sh.done.store(last, Ordering::Release);
            }
        });
        if cpus > 1 {
            let _ = bind(0);
        }
        let res = (|| -> Result<()> {
            for round in 1..=rounds {
                fz.maintain(epoch_left, first)?;
                if fz.gen.rng.chance(1, 4) {
                    race_nack_round(fz, sh, round, &mut nr)?;
                    continue;
                }
                let class = match fz.gen.rng.below(10) {
                    0..=5 => C_VALID,
                    6 => C_READY,
                    _ => fz.gen.class(),
                };
                let f = fz.gen.frame(&fz.model, class);
                let target = fz.before(&f);
                let p1 = fz.model.run(&f);
                let p2 = fz.model.run(&f);
                let (mine, theirs, overlap) = race_pair(fz, sh, round, &f, &f);
                overlapped += overlap as u64;
                let model_acc = p1.ctr[wire::ERAR_STAT_RX_RS as usize]
                    + p1.ctr[wire::ERAR_STAT_RX_AG as usize]
                    > 0;
                if model_acc {
                    accepted += 1;
                    accepted_overlapped += overlap as u64;
                }
                if class == C_READY {
                    ready_rounds += 1;
                    ready_taken += (p1.ctr[wire::ERAR_STAT_READY as usize] > 0) as u64;
                }
                let (delta, events) = fz.observe()?;
                let name = match class {
                    C_VALID => "race-valid",
                    C_READY => "race-ready",
                    _ => "race-mixed",
                };
                fz.check(
                    name,
                    &f,
                    target,
                    &[p1, p2],
                    vec![mine, theirs],
                    delta,
                    events,
                    false,
                )?;
            }
            Ok(())
        })();
        sh.go.store(u64::MAX, Ordering::Release);
        res
    })?;
    let secs = t0.elapsed().as_secs_f64();
    let same = rounds - nr.rounds;
    println!(
        "race: {same} rounds of one frame twice (2 copies each, {cpus} CPUs), {overlapped} with overlapping BPF_PROG_RUN calls; \
         {accepted} rounds of an acceptable frame ({accepted_overlapped} overlapping); {:.0} rounds/s; {} mismatches",
        rounds as f64 / secs,
        fz.mismatches - before
    );
    println!(
        "race: of those, {ready_rounds} rounds of a READY ({ready_taken} that one copy must take, the other then stale)"
    );
    println!(
        "race: {} rounds of a data frame against a NACK for its chunk ({} overlapping, {} changing the chunk's stage); NACK outcomes {:?}",
        nr.rounds, nr.overlapped, nr.moved, nr.outcomes
    );
    let served = |k: &str| nr.outcomes.get(k).copied().unwrap_or(0);
    Ok(format!(
        "race={rounds} race_overlapped={overlapped} race_accepted={accepted} race_nack={} \
         race_nack_served={} race_ready={ready_rounds} race_ready_taken={ready_taken}",
        nr.rounds,
        served("served-before") + served("served-after")
    ))
}
