//! The sidecar's command line as a user meets it: `keygen`, `validate` and
//! the exit codes of `run` (docs/reference.md#exit-codes), and `/readyz` naming an
//! unreachable store.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{http_get, sidecar_bin};

fn sidecar(args: &[&str]) -> std::process::Output {
    Command::new(sidecar_bin())
        .args(args)
        .env_remove("SBMESH_CLUSTER_KEY")
        .stdin(Stdio::null())
        .output()
        .expect("sidecar runs")
}

#[test]
fn keygen_prints_a_fresh_64_hex_key() {
    let a = sidecar(&["keygen"]);
    let b = sidecar(&["keygen"]);
    assert!(a.status.success());
    let ka = String::from_utf8(a.stdout).unwrap();
    let kb = String::from_utf8(b.stdout).unwrap();
    assert_eq!(ka.trim().len(), 64, "{ka:?}");
    assert!(ka.trim().bytes().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(ka, kb, "two keys are equal");
}

#[test]
fn validate_exit_codes_and_problem_lines() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yml");
    std::fs::write(&good, "proxy:\n  admin: {enabled: true, port: 9090}\n").unwrap();
    let out = sidecar(&["validate", "--config", good.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");

    let bad = dir.path().join("bad.yml");
    std::fs::write(
        &bad,
        "proxy:\n  extensions:\n    sbmesh: {gossip_port: 99999, acme: {enabled: true, storage_backend: sqlite}}\n",
    )
    .unwrap();
    let out = sidecar(&["validate", "--config", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines().any(
            |l| l.starts_with("proxy.extensions.sbmesh.acme.storage_backend: ")
                && l.contains("redis")
        ),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with("proxy.extensions.sbmesh.gossip_port: ")),
        "{text}"
    );
}

/// One limit, read the same way by `validate` and `run`: a 20 MiB file
/// is refused by both, naming the limit; YAML and `${VAR}` that would
/// multiply a small file in memory are refused with what is wrong.
#[test]
fn validate_and_run_refuse_what_the_reloader_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.yml");
    let mut text = String::from("origins:\n");
    let mut i = 0;
    while text.len() < 20 << 20 {
        text.push_str(&format!("  \"h{i}.example.com\": {{}}\n"));
        i += 1;
    }
    std::fs::write(&big, &text).unwrap();
    let out = sidecar(&["validate", "--config", big.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(report.contains("larger than 16 MiB"), "{report}");
    let out = sidecar(&["run", "--config", big.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("larger than 16 MiB"),
        "{out:?}"
    );

    // Billion laughs: nine levels of nine aliases each.
    let bomb = dir.path().join("bomb.yml");
    let mut text = String::from("l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for n in 1..10 {
        let p = n - 1;
        text.push_str(&format!(
            "l{n}: &l{n} [*l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}]\n"
        ));
    }
    text.push_str("origins: {}\n");
    std::fs::write(&bomb, &text).unwrap();
    let out = sidecar(&["validate", "--config", bomb.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.starts_with("(yaml): repetition limit exceeded") && report.contains("alias"),
        "{report}"
    );

    // A ConfigMap-sized file of references to one large variable.
    let multiplied = dir.path().join("multiplied.yml");
    std::fs::write(
        &multiplied,
        format!("origins: {{}}\n{}", "# ${SBMESH_TEST_BIG}\n".repeat(40)),
    )
    .unwrap();
    let out = Command::new(sidecar_bin())
        .args(["validate", "--config", multiplied.to_str().unwrap()])
        .env("SBMESH_TEST_BIG", "x".repeat(100_000))
        .env_remove("SBMESH_CLUSTER_KEY")
        .stdin(Stdio::null())
        .output()
        .expect("sidecar runs");
    // 40 x 100 kB stays under the limit.
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    std::fs::write(
        &multiplied,
        format!("origins: {{}}\n{}", "# ${SBMESH_TEST_BIG}\n".repeat(400)),
    )
    .unwrap();
    let out = Command::new(sidecar_bin())
        .args(["validate", "--config", multiplied.to_str().unwrap()])
        .env("SBMESH_TEST_BIG", "x".repeat(100_000))
        .env_remove("SBMESH_CLUSTER_KEY")
        .stdin(Stdio::null())
        .output()
        .expect("sidecar runs");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("larger than 16 MiB once ${VAR} references are substituted"),
        "{out:?}"
    );
}

#[test]
fn run_with_a_bad_config_exits_2_printing_the_problems() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("sb.yml");
    std::fs::write(
        &bad,
        "proxy:\n  extensions: {sbmesh: {acme: {enabled: true, storage_backend: sqlite}}}\n",
    )
    .unwrap();
    let out = sidecar(&["run", "--config", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("proxy.extensions.sbmesh.acme.storage_backend: "),
        "{text}"
    );

    // Peers without a key: refused with the way to make one.
    let ok = dir.path().join("ok.yml");
    std::fs::write(&ok, "proxy:\n  admin: {enabled: true}\n").unwrap();
    let out = sidecar(&[
        "run",
        "--config",
        ok.to_str().unwrap(),
        "--seeds",
        "127.0.0.1:7946",
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("keygen"));
}

#[test]
fn readyz_names_an_unreachable_store_and_the_process_drains_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("sb.yml");
    // Port 1 on loopback: nothing listens there.
    std::fs::write(
        &cfg,
        "proxy:\n  extensions: {sbmesh: {acme: {enabled: false, storage_backend: redis, storage_path: \"redis://127.0.0.1:1/0\"}}}\n",
    )
    .unwrap();
    let admin = "127.0.19.1:9091";
    let mut child = Command::new(sidecar_bin())
        .args([
            "run",
            "--config",
            cfg.to_str().unwrap(),
            "--node-id",
            "lonely",
            "--bind",
            "127.0.19.1",
            "--admin-listen",
            admin,
            "--challenge-listen",
            "127.0.19.1:8089",
            "--state-dir",
            dir.path().join("state").to_str().unwrap(),
            "--cert-dir",
            dir.path().join("certs").to_str().unwrap(),
            "--log-format",
            "text",
        ])
        .env_remove("SBMESH_CLUSTER_KEY")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("sidecar starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    let body = loop {
        if let Ok(r) = http_get(admin.parse().unwrap(), "/readyz", None) {
            let body = String::from_utf8_lossy(&r.body).into_owned();
            if r.status == 503 && body.contains("store:") && !body.contains("mesh:") {
                break body;
            }
        }
        assert!(Instant::now() < deadline, "/readyz never named the store");
        std::thread::sleep(Duration::from_millis(200));
    };
    let v: serde_json::Value = serde_json::from_str(&body).expect("readyz JSON");
    assert_eq!(v["ready"], false);
    assert!(v["reasons"][0].as_str().unwrap().contains("redis"), "{v}");
    assert_eq!(
        http_get(admin.parse().unwrap(), "/healthz", None)
            .unwrap()
            .status,
        200
    );

    // SIGTERM: a clean drain exits 0.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0));
}

/// `status` in a pod needs no flags: the listener from
/// `SBMESH_ADMIN_LISTEN` and the credentials from `proxy.admin` of the
/// config, as `run` reads them (address 127.0.77.1).
#[test]
fn status_finds_the_listener_and_the_credentials_as_run_does() {
    let c = common::Cluster::start("127.0.77", 1);
    c.wait_converged(&c.all());
    let node = &c.nodes[0];
    let config = c.dir.join("status-sb.yml");
    let status = |password_ref: &str, pw: &str| {
        std::fs::write(
            &config,
            format!(
                "proxy:\n  admin: {{ enabled: true, username: {}, password: \"{password_ref}\" }}\n",
                common::ADMIN_USER
            ),
        )
        .unwrap();
        Command::new(sidecar_bin())
            .args(["status", "--config"])
            .arg(&config)
            .env("SBMESH_ADMIN_LISTEN", node.admin_addr().to_string())
            .env("STATUS_TEST_PW", pw)
            .env_remove("SBMESH_ADMIN_USER")
            .env_remove("SBMESH_ADMIN_PASSWORD")
            .stdin(Stdio::null())
            .output()
            .expect("sidecar runs")
    };
    let out = status("env:STATUS_TEST_PW", common::ADMIN_PASSWORD);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(stdout.contains(node.id()), "{stdout}");
    // The wrong password in the file: refused by the sidecar, and said so.
    let out = status("env:STATUS_TEST_PW", "wrong");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("401"), "{stderr}");
}
