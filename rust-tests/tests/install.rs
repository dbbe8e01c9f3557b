//! `scripts/install --prefix DIR` (issue 16): the site layout
//! (`lib/openmpi/liberar.so`, `lib/mpich/liberar.so`, `bin/erarctl`, the
//! docs, the agent's systemd unit), every binary stripped with its debug
//! info in a `.debug` file beside it that `.gnu_debuglink` names, the
//! installed Open MPI library accelerating a job on every rank, and the
//! unit passing `systemd-analyze verify` with its paths under DIR.

use liberar::testbed::LaunchSpec;
use rust_tests::{ctests, end_grace, job_timeout, repo_root, run_job, shim_path, testbed, Mpi};
use std::path::{Path, PathBuf};
use std::process::Command;

fn sections(file: &Path) -> String {
    let out = Command::new("readelf")
        .arg("-SW")
        .arg(file)
        .output()
        .expect("running readelf");
    assert!(out.status.success(), "readelf -S {}", file.display());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn installed() -> PathBuf {
    shim_path(Mpi::Openmpi); // scripts/build has run
    let prefix = std::env::temp_dir().join(format!("liberar-install-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&prefix);
    let out = Command::new(repo_root().join("scripts/install"))
        .arg("--prefix")
        .arg(&prefix)
        .arg("--no-build")
        .output()
        .expect("running scripts/install");
    assert!(
        out.status.success(),
        "scripts/install failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    prefix
}

#[test]
fn install_layout_stripped_and_working() {
    let prefix = installed();
    for rel in [
        "lib/openmpi/liberar.so",
        "lib/mpich/liberar.so",
        "bin/erarctl",
    ] {
        let bin = prefix.join(rel);
        let s = sections(&bin);
        assert!(!s.contains(".debug_info"), "{rel} still has debug info");
        assert!(s.contains(".gnu_debuglink"), "{rel} names no debug file");
        let dbg = sections(&prefix.join(format!("{rel}.debug")));
        assert!(
            dbg.contains(".debug_info"),
            "{rel}.debug holds no debug info"
        );
        let built = repo_root().join(match rel {
            "bin/erarctl" => "build/erarctl".to_string(),
            r => format!("build/{}", r.trim_start_matches("lib/")),
        });
        let (small, big) = (
            std::fs::metadata(&bin).expect("installed").len(),
            std::fs::metadata(&built).expect("built").len(),
        );
        assert!(
            small * 4 < big,
            "{rel}: {small} bytes installed, {big} built"
        );
    }
    assert!(prefix.join("share/doc/liberar/README.md").is_file());

    // The installed library, stripped, accelerates a job.
    {
        let _tb = testbed();
        ctests(Mpi::Openmpi);
        let prog = repo_root().join("c-tests/bin/openmpi/allreduce_big");
        let spec = LaunchSpec::new(Mpi::Openmpi, 4, [prog.into_os_string(), "--quick".into()])
            .env("ERAR_STATS", "1")
            .env("ERAR_SELECT", "threshold")
            .timeout(job_timeout())
            .end_marker("PASS ", end_grace())
            .preload(prefix.join("lib/openmpi/liberar.so"));
        let r = run_job(&spec).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(
            r.passes().iter().any(|p| p == "PASS allreduce_big"),
            "{}",
            r.tail()
        );
        let stats = r.stats();
        rust_tests::check_stats_per_rank(&stats, 4).unwrap_or_else(|e| panic!("{e:#}"));
        for s in &stats {
            assert!(s.get("allreduce.fast") > 0, "rank {}: {}", s.rank, s.raw);
        }
    }

    // The agent's unit, as an instance, with its paths under the prefix.
    let unit = prefix.join("lib/systemd/system/liberar-agent@.service");
    let text = std::fs::read_to_string(&unit).expect("the unit");
    let erarctl = prefix.join("bin/erarctl");
    assert!(
        text.contains(&format!("ExecStart={} agent start", erarctl.display())),
        "{text}"
    );
    let dir = prefix.join("verify");
    std::fs::create_dir_all(&dir).expect("dir");
    let instance = dir.join("liberar-agent@eth0.service");
    std::fs::copy(&unit, dir.join("liberar-agent@.service")).expect("copy unit");
    std::os::unix::fs::symlink("liberar-agent@.service", &instance).expect("instance link");
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&instance)
        .output()
        .expect("running systemd-analyze (package systemd, scripts/install-deps)");
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&prefix);
}
