//! `scripts/install --prefix DIR` (issue 16): the site layout
//! (`lib/openmpi/liberar.so`, `lib/mpich/liberar.so`, `bin/erarctl`, the
//! docs, the agent's systemd unit), every binary stripped with its debug
//! info in a `.debug` file beside it that `.gnu_debuglink` names, the
//! installed Open MPI library accelerating a job on every rank, the unit
//! passing `systemd-analyze verify` with its paths under DIR; and, with
//! Debian's Lmod, `module use DIR/modulefiles; module load liberar` making
//! an unmodified Open MPI job and an MPICH job accelerated (no --preload:
//! the module's LD_PRELOAD reaches every rank), and `module unload
//! liberar` taking back every variable it set.

use erarctl::testbed::LaunchSpec;
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

/// A fresh install under a prefix of this test's own (`tag`: tests run in
/// parallel).
fn installed(tag: &str) -> PathBuf {
    shim_path(Mpi::Openmpi); // scripts/build has run
    let prefix = std::env::temp_dir().join(format!("liberar-install-{tag}-{}", std::process::id()));
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
    let prefix = installed("layout");
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
        let spec = allreduce_big(Mpi::Openmpi).preload(prefix.join("lib/openmpi/liberar.so"));
        check_accelerated(&spec, "the installed library");
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

/// Runs `script` in a login bash (where Lmod's `module` is defined) with
/// the installed tree's modulefiles in use; its stdout and stderr.
fn with_lmod(prefix: &Path, script: &str) -> (bool, String, String) {
    let out = Command::new("bash")
        .arg("-lc")
        .arg(format!(
            "module use {}/modulefiles || exit 90\n{script}",
            prefix.display()
        ))
        .output()
        .expect("running bash -lc (Lmod)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `allreduce_big --quick` of `mpi` on 4 hosts, counted, on the fast path
/// wherever it may go.
fn allreduce_big(mpi: Mpi) -> LaunchSpec {
    let prog = repo_root().join(format!("c-tests/bin/{}/allreduce_big", mpi.name()));
    LaunchSpec::new(mpi, 4, [prog.into_os_string(), "--quick".into()])
        .env("ERAR_STATS", "1")
        .env("ERAR_SELECT", "threshold")
        .timeout(job_timeout())
        .end_marker("PASS ", end_grace())
}

/// Runs `spec`: it passes, and every rank ran allreduces on the fast path.
fn check_accelerated(spec: &LaunchSpec, what: &str) {
    let r = run_job(spec).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        r.passes().iter().any(|p| p == "PASS allreduce_big"),
        "{what}: {}",
        r.tail()
    );
    let stats = r.stats();
    rust_tests::check_stats_per_rank(&stats, 4).unwrap_or_else(|e| panic!("{e:#}"));
    for s in &stats {
        assert!(
            s.get("allreduce.fast") > 0,
            "{what}: rank {}: {}",
            s.rank,
            s.raw
        );
    }
}

/// `env -0` output as a sorted map.
fn env_dump(text: &str) -> std::collections::BTreeMap<String, String> {
    text.split('\0')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim_start_matches('\n').to_owned(), v.to_owned()))
        .collect()
}

/// The environment `module load liberar` gives (`select`: what to set
/// before loading), as the variables it added or changed.
fn module_env(prefix: &Path, select: &str) -> Vec<(String, String)> {
    let (ok, stdout, stderr) = with_lmod(
        prefix,
        &format!("{select}env -0; echo; echo ==LOADED==; module load liberar || exit 91; env -0"),
    );
    assert!(ok, "module load liberar failed:\n{stdout}{stderr}");
    let (before, after) = stdout.split_once("\n==LOADED==\n").expect("both dumps");
    let (before, after) = (env_dump(before), env_dump(after));
    after
        .into_iter()
        .filter(|(k, v)| before.get(k) != Some(v))
        .collect()
}

fn is_lmod_internal(k: &str) -> bool {
    k.starts_with("_ModuleTable")
        || k.starts_with("__LMOD")
        || k.starts_with("LMOD_")
        || matches!(
            k,
            "_" | "LOADEDMODULES" | "_LMFILES_" | "MODULEPATH" | "MODULEPATH_ROOT"
        )
}

#[test]
fn module_load_accelerates_unmodified_jobs() {
    let prefix = installed("module");
    ctests(Mpi::Openmpi);
    ctests(Mpi::Mpich);
    let _tb = testbed();
    for (mpi, select) in [
        (Mpi::Openmpi, ""),
        (Mpi::Mpich, "export LIBERAR_MPI=mpich\n"),
    ] {
        let env = module_env(&prefix, select);
        let lib = prefix.join(format!("lib/{}/liberar.so", mpi.name()));
        assert!(
            env.iter()
                .any(|(k, v)| k == "LD_PRELOAD" && v.contains(&*lib.to_string_lossy())),
            "module load liberar set no {mpi} LD_PRELOAD: {env:?}"
        );
        // The job's launcher gets the module's environment as from the
        // user's shell; nothing is passed with -x, and no --preload.
        let mut spec = allreduce_big(mpi);
        for (k, v) in env.iter().filter(|(k, _)| !is_lmod_internal(k)) {
            spec = spec.shell_env(k.clone(), v.clone());
        }
        check_accelerated(&spec, &format!("{mpi} under the module"));
    }
    // The Environment Modules (Tcl) file gives the same (Lmod reads Tcl).
    let (ok, stdout, stderr) = with_lmod(
        &prefix,
        &format!(
            "module use {}/modulefiles-tcl\nmodule load liberar || exit 91\n\
             echo \"LD_PRELOAD=$LD_PRELOAD\"\nmodule unload liberar\necho \"AFTER=$LD_PRELOAD\"",
            prefix.display()
        ),
    );
    assert!(
        ok && stdout.contains(&format!(
            "LD_PRELOAD={}/lib/openmpi/liberar.so\n",
            prefix.display()
        )) && stdout.contains("AFTER=\n"),
        "the Tcl modulefile:\n{stdout}{stderr}"
    );
    // Unload takes back every variable it set (Lmod's own bookkeeping
    // aside; it also drops duplicate PATH entries it finds).
    let (ok, stdout, stderr) = with_lmod(
        &prefix,
        "env -0; echo; echo ==AFTER==; module load liberar || exit 91\n\
         module unload liberar || exit 92\nenv -0",
    );
    assert!(ok, "{stdout}{stderr}");
    let (before, after) = stdout.split_once("\n==AFTER==\n").expect("both dumps");
    // Lmod's own bookkeeping aside, and PATH without the duplicates Lmod
    // drops.
    let vars = |text: &str| -> Vec<(String, String)> {
        env_dump(text)
            .into_iter()
            .filter(|(k, _)| !is_lmod_internal(k))
            .map(|(k, v)| {
                if k != "PATH" {
                    return (k, v);
                }
                let mut seen: Vec<&str> = Vec::new();
                for p in v.split(':') {
                    if !seen.contains(&p) {
                        seen.push(p);
                    }
                }
                let path = seen.join(":");
                (k, path)
            })
            .collect()
    };
    let (before, after) = (vars(before), vars(after));
    let changed: Vec<&(String, String)> = after
        .iter()
        .filter(|kv| kv.0 != "SHLVL" && !before.contains(kv))
        .chain(
            before
                .iter()
                .filter(|kv| kv.0 != "SHLVL" && !after.contains(kv)),
        )
        .collect();
    assert!(
        changed.is_empty(),
        "module unload liberar left the environment changed: {changed:?}"
    );
    let _ = std::fs::remove_dir_all(&prefix);
}
