//! A CI run cannot be talked out of testing (issue 54): `scripts/test`
//! with `CI` set refuses every variable and argument that would narrow the
//! run, and a run that is not root; a test whose server is missing fails
//! under CI; `scripts/find-sbproxy` takes only sbproxy 1.13; every nextest
//! run of the script forbids retries.
//!
//! The refusals come before the script installs or starts anything, so
//! these runs take milliseconds and leave nothing behind. Should a refusal
//! be missing, the script must still not run the suite from inside the
//! suite: its PATH has only the two commands it needs up to the refusals
//! (`dirname`, `id`), so it stops at its first `mkdir`, and its scratch
//! space is a folder of the test's own.

#[allow(clippy::duplicate_mod)]
mod required;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A folder holding `dirname` and `id` only: the PATH of the script under
/// test, and its scratch space beside it.
struct Jail {
    dir: tempfile::TempDir,
}

impl Jail {
    fn new() -> Jail {
        let dir = tempfile::tempdir().expect("temp dir");
        // Readable by nobody too (the not-root test).
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        std::fs::create_dir(dir.path().join("bin")).expect("mkdir");
        for tool in ["dirname", "id"] {
            let found = ["/usr/bin", "/bin"]
                .iter()
                .map(|d| Path::new(d).join(tool))
                .find(|p| p.is_file())
                .unwrap_or_else(|| panic!("{tool} not in /usr/bin or /bin"));
            std::os::unix::fs::symlink(found, dir.path().join("bin").join(tool)).expect("link");
        }
        Jail { dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("bin")
    }

    fn scratch(&self) -> PathBuf {
        self.dir.path().join("tmp")
    }
}

/// `bash scripts/test ARGS` with CI=true, `extra`, the jail's PATH and
/// scratch space, and nothing else in its environment (not the variables
/// of the run this test is part of).
fn ci_run(args: &[&str], extra: &[(&str, &str)]) -> Output {
    let jail = Jail::new();
    let mut cmd = Command::new("/bin/bash");
    cmd.arg(repo().join("scripts/test"))
        .args(args)
        .env_clear()
        .env("PATH", jail.path())
        .env("SBMESH_TEST_TMP", jail.scratch())
        .env("CI", "true")
        .envs(extra.iter().copied())
        .current_dir(repo());
    cmd.output().expect("run scripts/test")
}

fn refused(out: &Output, naming: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "scripts/test under CI was not refused: {stderr}"
    );
    assert!(
        stderr.contains("scripts/test: error: CI is set") && stderr.contains(naming),
        "the refusal names {naming}: {stderr}"
    );
    assert!(
        !stderr.contains("==> install"),
        "the refusal came after the run started: {stderr}"
    );
}

#[test]
fn under_ci_no_variable_narrows_the_run() {
    for (var, value) in [
        // Any value, even empty, used to drop SBMESH_TEST_REQUIRE_SERVERS
        // and the cluster's phase.
        ("SBMESH_TEST_SERVERS", ""),
        ("SBMESH_TEST_SERVERS", "redis"),
        ("SBMESH_TEST_RUN", "true"),
        ("SBMESH_TEST_SKIP_LINT", "1"),
        ("SBMESH_TEST_CLUSTER", "1"),
        ("SBMESH_TEST_REQUIRE_SERVERS", "0"),
        ("SBMESH_SOAK_SECS", "0"),
        ("SBMESH_GOSSIP_PORT", "1"),
        ("NEXTEST_RETRIES", "3"),
        ("NEXTEST_PROFILE", "default"),
        ("UPDATE_GOLDEN", "1"),
    ] {
        refused(&ci_run(&[], &[(var, value)]), var);
    }
}

#[test]
fn under_ci_no_filter_narrows_the_run() {
    refused(&ci_run(&["mesh_"], &[]), "with no filter (given: mesh_)");
}

#[test]
fn under_ci_a_run_that_is_not_root_is_refused() {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0");
    let out = if root {
        // As nobody: the checkout must be readable by it (it is, in CI's
        // clone).
        let jail = Jail::new();
        // By its path: the child's PATH is the jail's.
        let mut cmd = Command::new("/usr/bin/setpriv");
        cmd.args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/bin/bash",
        ])
        .arg(repo().join("scripts/test"))
        .env_clear()
        .env("PATH", jail.path())
        .env("SBMESH_TEST_TMP", jail.scratch())
        .env("CI", "true")
        .current_dir("/");
        cmd.output().expect("run scripts/test as nobody")
    } else {
        ci_run(&[], &[])
    };
    refused(&out, "not root");
}

/// Every nextest command line of the script goes through its `nextest`
/// function, which forbids retries whatever NEXTEST_RETRIES says.
#[test]
fn every_nextest_run_of_the_script_forbids_retries() {
    let script = std::fs::read_to_string(repo().join("scripts/test")).expect("scripts/test");
    let runs: Vec<&str> = script
        .lines()
        .filter(|l| l.contains("cargo nextest run") && !l.trim_start().starts_with('#'))
        .collect();
    assert_eq!(runs.len(), 1, "one place runs nextest: {runs:?}");
    let function = script
        .split("\nnextest() {")
        .nth(1)
        .and_then(|body| body.split("\n}").next())
        .expect("the script's nextest function");
    assert!(
        function.contains("--retries 0") && function.contains("cargo nextest run"),
        "the nextest function passes --retries 0: {function}"
    );
}

#[test]
fn a_missing_server_fails_under_ci_and_skips_otherwise() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    };
    for (pairs, servers, cluster) in [
        (&[("CI", "true")][..], true, true),
        (&[("CI", "1")][..], true, true),
        (&[("CI", "false")][..], false, false),
        (&[("CI", "")][..], false, false),
        (&[][..], false, false),
        (&[("SBMESH_TEST_REQUIRE_SERVERS", "1")][..], true, false),
        (&[("SBMESH_TEST_CLUSTER_REQUIRED", "1")][..], false, true),
        // CI wins over a variable that says otherwise.
        (
            &[("CI", "true"), ("SBMESH_TEST_REQUIRE_SERVERS", "0")][..],
            true,
            true,
        ),
    ] {
        let env = env(pairs);
        assert_eq!(
            required::servers_required_of(&env),
            servers,
            "servers required with {pairs:?}"
        );
        assert_eq!(
            required::cluster_required_of(&env),
            cluster,
            "cluster required with {pairs:?}"
        );
    }
}

fn find_sbproxy(sbproxy: &Path) -> Output {
    Command::new("bash")
        .arg(repo().join("scripts/find-sbproxy"))
        .env("SBMESH_TEST_SBPROXY", sbproxy)
        .output()
        .expect("run scripts/find-sbproxy")
}

#[test]
fn find_sbproxy_takes_only_sbproxy_1_13() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (version, taken) in [
        ("sbproxy 1.12.4 (rev 0, built 2026-01-01)", false),
        ("sbproxy 1.130.0", false),
        ("nginx version: nginx/1.22.1", false),
        ("sbproxy 1.13.0 (rev 708ff4a8, built 2026-12-04)", true),
    ] {
        let fake = dir.path().join("sbproxy");
        std::fs::write(&fake, format!("#!/bin/sh\necho '{version}'\n")).expect("write");
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let out = find_sbproxy(&fake);
        assert_eq!(
            out.status.success(),
            taken,
            "{version}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if !taken {
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("is not sbproxy 1.13"),
                "{version}: the refusal says why: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
