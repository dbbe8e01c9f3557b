// How this workspace compiles its BPF C: shared by `liberar/build.rs` and
// `erarctl/build.rs`, which `include!` this file (a build script cannot
// depend on a library crate of its own workspace without a cycle of build
// order, and these few functions are all they share).

/// Debian's multiarch include directory (where `<asm/types.h>` is) of the
/// architecture Cargo builds for (`CARGO_CFG_TARGET_ARCH`, not the build
/// host's): `-I/usr/include/x86_64-linux-gnu`, `aarch64-linux-gnu`, ...
fn multiarch_include() -> anyhow::Result<String> {
    use anyhow::Context;
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").context("CARGO_CFG_TARGET_ARCH")?;
    let dir = if arch == "x86" { "i386" } else { arch.as_str() };
    Ok(format!("-I/usr/include/{dir}-linux-gnu"))
}

/// Asks Cargo to re-run the build script when a file of `dir` changes (a
/// directory alone is only watched for its own mtime).
fn rerun_if_dir_changed(dir: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    println!("cargo:rerun-if-changed={}", dir.display());
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        println!("cargo:rerun-if-changed={}", entry?.path().display());
    }
    Ok(())
}

/// Builds `bpf/<prog>.bpf.c` into the libbpf-rs skeleton
/// `<out>/<prog>.skel.rs`. `-mcpu=v3` for atomic fetch-and-add with a used
/// result; warnings are errors.
fn build_bpf_skeleton(
    bpf_dir: &std::path::Path,
    prog: &str,
    out: &std::path::Path,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let src = bpf_dir.join(format!("{prog}.bpf.c"));
    println!("cargo:rerun-if-changed={}", src.display());
    libbpf_cargo::SkeletonBuilder::new()
        .source(&src)
        .clang_args([
            format!("-I{}", bpf_dir.join("include").display()),
            multiarch_include()?,
            "-mcpu=v3".to_string(),
            "-Wall".to_string(),
            "-Werror".to_string(),
        ])
        .build_and_generate(out.join(format!("{prog}.skel.rs")))
        .with_context(|| format!("building BPF skeleton from {}", src.display()))
}
