//! Builds the BPF objects into libbpf-rs skeletons and generates the Rust
//! view of `bpf/include/erar_wire.h`, the single definition of the wire
//! format and of every struct and constant shared between BPF C and Rust.
//!
//! Outputs in `OUT_DIR`: `erar_ring.skel.rs`, `erar_wire.rs`. (The test
//! bed's switch program is built by the `erarctl` crate.)

use std::env;
use std::path::{Path, PathBuf};

include!("../build-support/bpf_build.rs");

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
    rerun_if_dir_changed(&include)?;
    for prog in BPF_PROGS {
        build_bpf_skeleton(&bpf_dir, prog, &out)?;
    }

    generate_wire(&include.join("erar_wire.h"), &out.join("erar_wire.rs"))
}

fn generate_wire(header: &Path, dst: &Path) -> anyhow::Result<()> {
    use anyhow::Context;

    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_arg(multiarch_include()?)
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
