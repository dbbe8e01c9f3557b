//! The command line: `IFNAME CHUNK_BYTES CHUNKS_PER_SLOT FRAMES SEED
//! [RACE_ROUNDS]`.

use anyhow::{bail, Context, Result};

pub struct Args {
    pub ifname: String,
    pub cb: u32,
    pub cps: u32,
    pub frames: u64,
    pub seed: u64,
    /// 0 without the argument: no race phase.
    pub race_rounds: u64,
}

impl Args {
    /// The process's arguments.
    pub fn parse() -> Result<Args> {
        let a: Vec<String> = std::env::args().skip(1).collect();
        if a.len() != 5 && a.len() != 6 {
            bail!("usage: fuzz_host IFNAME CHUNK_BYTES CHUNKS_PER_SLOT FRAMES SEED [RACE_ROUNDS]");
        }
        let race_rounds: u64 = match a.get(5) {
            Some(v) => v.parse().context("RACE_ROUNDS")?,
            None => 0,
        };
        let ifname = a[0].clone();
        let cb: u32 = a[1].parse().context("CHUNK_BYTES")?;
        let cps: u32 = a[2].parse().context("CHUNKS_PER_SLOT")?;
        let frames: u64 = a[3].parse().context("FRAMES")?;
        let seed: u64 = a[4].parse().context("SEED")?;
        Ok(Args {
            ifname,
            cb,
            cps,
            frames,
            seed,
            race_rounds,
        })
    }
}
