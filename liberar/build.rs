//! Builds the BPF objects into libbpf-rs skeletons and generates the Rust
//! view of `bpf/include/erar_wire.h`, the single definition of the wire
//! format and of every struct and constant shared between BPF C and Rust.
//!
//! Outputs in `OUT_DIR`: `erar_ring.skel.rs`, `erar_wire.rs`. (The test
//! bed's switch program is built by the `erarctl` crate.)

use std::env;
use std::path::{Path, PathBuf};

use libbpf_cargo::SkeletonBuilder;

/// BPF sources under `bpf/`, each built into `<name>.skel.rs`.
const BPF_PROGS: &[&str] = &["erar_ring"];

fn main() {
    if let Err(e) = run() {
        // A build script reports through its exit status and stderr.
        eprintln!("liberar build.rs: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    use anyhow::Context;

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?);
    let bpf_dir = manifest.join("..").join("bpf");
    let include = bpf_dir.join("include");
    let out = PathBuf::from(env::var("OUT_DIR").context("OUT_DIR")?);

    println!("cargo:rerun-if-changed={}", bpf_dir.display());
    for entry in std::fs::read_dir(&include).context("reading bpf/include")? {
        println!("cargo:rerun-if-changed={}", entry?.path().display());
    }

    // Debian's clang needs the multiarch dir for <asm/types.h> (of the
    // target, from Cargo); -mcpu=v3 for atomic fetch-and-add with a used
    // result (the done counter).
    let multiarch = format!(
        "-I/usr/include/{}",
        multiarch(&env::var("CARGO_CFG_TARGET_ARCH")?)
    );
    let clang_args = [
        format!("-I{}", include.display()),
        multiarch.clone(),
        "-mcpu=v3".to_string(),
        "-Wall".to_string(),
        "-Werror".to_string(),
    ];
    for prog in BPF_PROGS {
        let src = bpf_dir.join(format!("{prog}.bpf.c"));
        println!("cargo:rerun-if-changed={}", src.display());
        let skel = out.join(format!("{prog}.skel.rs"));
        SkeletonBuilder::new()
            .source(&src)
            .clang_args(&clang_args)
            .build_and_generate(&skel)
            .with_context(|| format!("building BPF skeleton from {}", src.display()))?;
    }

    generate_wire(
        &include.join("erar_wire.h"),
        &out.join("erar_wire.rs"),
        &multiarch,
    )
}

/// Debian's multiarch directory name for a Rust target architecture:
/// `x86_64-linux-gnu`, `aarch64-linux-gnu`, ...
fn multiarch(arch: &str) -> String {
    format!("{}-linux-gnu", if arch == "x86" { "i386" } else { arch })
}

fn generate_wire(header: &Path, dst: &Path, multiarch: &str) -> anyhow::Result<()> {
    use anyhow::Context;

    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_arg(multiarch)
        .allowlist_item("erar_.*")
        .allowlist_item("ERAR_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true)
        .generate()
        .context("bindgen on erar_wire.h")?;
    bindings
        .write_to_file(dst)
        .with_context(|| format!("writing {}", dst.display()))
}
