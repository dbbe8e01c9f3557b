//! Builds the emulated switch's XDP program (`bpf/testbed_switch.bpf.c`)
//! into a libbpf-rs skeleton: `OUT_DIR/testbed_switch.skel.rs`. The
//! datapath's own program and the wire format are `liberar`'s build.

use std::env;
use std::path::PathBuf;

use anyhow::Context;
use libbpf_cargo::SkeletonBuilder;

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
    let include = bpf_dir.join("include");
    let src = bpf_dir.join("testbed_switch.bpf.c");
    println!("cargo:rerun-if-changed={}", src.display());
    for entry in std::fs::read_dir(&include).context("reading bpf/include")? {
        println!("cargo:rerun-if-changed={}", entry?.path().display());
    }
    let arch = env::var("CARGO_CFG_TARGET_ARCH").context("CARGO_CFG_TARGET_ARCH")?;
    let skel =
        PathBuf::from(env::var("OUT_DIR").context("OUT_DIR")?).join("testbed_switch.skel.rs");
    SkeletonBuilder::new()
        .source(&src)
        .clang_args([
            format!("-I{}", include.display()),
            format!("-I/usr/include/{}", multiarch(&arch)),
            "-mcpu=v3".to_string(),
            "-Wall".to_string(),
            "-Werror".to_string(),
        ])
        .build_and_generate(&skel)
        .with_context(|| format!("building BPF skeleton from {}", src.display()))
}

/// Debian's multiarch include directory (where `<asm/types.h>` is) for a
/// Rust target architecture: `x86_64-linux-gnu`, `aarch64-linux-gnu`, ...
fn multiarch(arch: &str) -> String {
    format!("{}-linux-gnu", if arch == "x86" { "i386" } else { arch })
}
