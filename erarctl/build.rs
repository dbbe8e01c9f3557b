//! Builds the emulated switch's XDP program (`bpf/testbed_switch.bpf.c`)
//! into a libbpf-rs skeleton: `OUT_DIR/testbed_switch.skel.rs`. The
//! datapath's own program and the wire format are `liberar`'s build.

use std::env;
use std::path::PathBuf;

use anyhow::Context;

include!("../build-support/bpf_build.rs");

fn main() {
    if let Err(e) = run() {
        // A build script reports through its exit status and stderr.
        eprintln!("erarctl build.rs: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?);
    let bpf_dir = manifest.join("..").join("bpf");
    rerun_if_dir_changed(&bpf_dir.join("include"))?;
    let out = PathBuf::from(env::var("OUT_DIR").context("OUT_DIR")?);
    build_bpf_skeleton(&bpf_dir, "testbed_switch", &out)
}
