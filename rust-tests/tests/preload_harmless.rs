//! liberar.so preloaded into processes that are not MPI ranks (launchers,
//! shells, Python) must change nothing: same output, same exit code.

use rust_tests::{shim_path, Mpi};
use std::process::Command;

fn run(
    cmd: &[&str],
    preload: Option<&std::path::Path>,
    stats: bool,
) -> (Option<i32>, String, String) {
    let mut c = Command::new(cmd[0]);
    c.args(&cmd[1..])
        .env_remove("LD_PRELOAD")
        .env_remove("ERAR_STATS");
    if let Some(p) = preload {
        c.env("LD_PRELOAD", p);
    }
    if stats {
        c.env("ERAR_STATS", "1");
    }
    let out = c
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (scripts/install-deps)"));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn check(mpi: Mpi, cmds: &[&[&str]]) {
    let lib = shim_path(mpi);
    for cmd in cmds {
        let plain = run(cmd, None, false);
        assert_eq!(
            plain.0,
            Some(0),
            "{cmd:?} fails even without the preload: {plain:?}"
        );
        for stats in [false, true] {
            let pre = run(cmd, Some(&lib), stats);
            assert_eq!(
                pre,
                plain,
                "LD_PRELOAD={} (ERAR_STATS={}) changed what {cmd:?} does",
                lib.display(),
                u8::from(stats)
            );
        }
    }
}

#[test]
fn openmpi_shim_is_harmless_outside_mpi() {
    check(
        Mpi::Openmpi,
        &[
            &["mpirun.openmpi", "--version"],
            &["bash", "-c", "true"],
            &["python3", "-c", "pass"],
            &["sh", "-c", "echo hello; echo err >&2"],
        ],
    );
}

#[test]
fn mpich_shim_is_harmless_outside_mpi() {
    check(
        Mpi::Mpich,
        &[
            &["mpiexec.mpich", "--version"],
            &["bash", "-c", "true"],
            &["python3", "-c", "pass"],
        ],
    );
}
