//! `rediss://`: the redis store over TLS (rustls on aws-lc-rs) against a
//! `redis-server` of its own with a throwaway CA. The server's certificate
//! must be verified: refused while the CA is unknown, accepted once
//! `SSL_CERT_FILE` names it (checked in a child process, since the
//! environment is process-wide).

mod redis_server;
#[allow(clippy::duplicate_mod)]
mod required;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use redis_server::RedisServer;
use sbmesh::{RedisStore, Store};

const OP_TIMEOUT: Duration = Duration::from_secs(2);
const CHILD_URL_VAR: &str = "SBMESH_TEST_REDISS_URL";

/// Makes a CA and a `localhost`/127.0.0.1 server certificate in `dir` with
/// the openssl CLI; returns (ca, cert, key), or `None` without openssl.
fn make_certs(dir: &Path) -> Option<(PathBuf, PathBuf, PathBuf)> {
    const EC: &str = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
    let run = |args: String| {
        let out = Command::new("openssl")
            .args(args.split_whitespace())
            .current_dir(dir)
            .output()
            .ok()?;
        assert!(
            out.status.success(),
            "openssl {args}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(())
    };
    run(format!(
        "req -x509 {EC} -keyout ca.key -out ca.crt -days 2 -subj /CN=sbmesh-test-CA \
         -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign"
    ))?;
    run(format!(
        "req {EC} -keyout server.key -out server.csr -subj /CN=localhost"
    ))?;
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n\
         extendedKeyUsage=serverAuth\n\
         basicConstraints=CA:FALSE\n",
    )
    .expect("write ext.cnf");
    run(
        "x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial \
         -out server.crt -days 2 -extfile ext.cnf"
            .to_owned(),
    )?;
    let path = |name: &str| dir.join(name);
    Some((path("ca.crt"), path("server.crt"), path("server.key")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_verifies_the_server() {
    let Some(bin) = redis_server::binary("rediss_verifies_the_server") else {
        return;
    };
    let certs = tempfile::tempdir().expect("temp dir");
    let Some((ca, cert, key)) = make_certs(certs.path()) else {
        return required::missing(
            "rediss_verifies_the_server",
            "openssl is not installed",
            "apt-get install -y openssl",
        )
        .unwrap_or(());
    };
    let port = redis_server::free_port();
    let arg = |p: &Path| p.to_str().expect("utf-8 temp path").to_owned();
    let _server = RedisServer::start_with(
        &bin,
        port,
        vec![
            "--port".into(),
            "0".into(),
            "--tls-port".into(),
            port.to_string(),
            "--tls-cert-file".into(),
            arg(&cert),
            "--tls-key-file".into(),
            arg(&key),
            "--tls-ca-cert-file".into(),
            arg(&ca),
            "--tls-auth-clients".into(),
            "no".into(),
        ],
    );
    let url = format!("rediss://localhost:{port}/0");

    // The system roots do not know this CA: refused, quickly, no panic.
    let store = RedisStore::connect(&url, OP_TIMEOUT)
        .await
        .expect("connect");
    let start = Instant::now();
    let err = store
        .put("certs/a/chain", b"x", None)
        .await
        .expect_err("an unknown CA must be refused");
    assert!(start.elapsed() < OP_TIMEOUT + Duration::from_secs(1));
    eprintln!("unknown CA refused: {err}");

    // Plain TCP to the TLS port is no way around it either.
    let plain = RedisStore::connect(&format!("redis://127.0.0.1:{port}/0"), OP_TIMEOUT)
        .await
        .expect("connect");
    assert!(plain.ping().await.is_err());

    // Trusting the CA (the way a pod would: SSL_CERT_FILE), it works.
    let status = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "tls_child_round_trip",
            "--ignored",
            "--nocapture",
        ])
        .env("SSL_CERT_FILE", &ca)
        .env(CHILD_URL_VAR, &url)
        .status()
        .expect("run the child test");
    assert!(status.success(), "the child process failed: {status}");
}

/// The half of `rediss_verifies_the_server` that runs with `SSL_CERT_FILE`
/// set; does nothing when run on its own.
#[tokio::test]
#[ignore = "run by rediss_verifies_the_server in a child process"]
async fn tls_child_round_trip() {
    let Ok(url) = std::env::var(CHILD_URL_VAR) else {
        return;
    };
    let store = RedisStore::connect(&url, OP_TIMEOUT)
        .await
        .expect("connect")
        .with_namespace(&format!("tls-{:016x}", rand::random::<u64>()))
        .expect("namespace");
    // The first attempt may race the server's start; poll briefly.
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(e) = store.ping().await {
        assert!(Instant::now() < deadline, "rediss with the CA trusted: {e}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let v = store.put("certs/a/chain", b"over tls", None).await.unwrap();
    let entry = store.get("certs/a/chain").await.unwrap().unwrap();
    assert_eq!(
        (entry.value.as_slice(), &entry.version),
        (&b"over tls"[..], &v)
    );
    assert!(
        store
            .compare_and_swap("certs/a/chain", &v, b"swapped", None)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(store.list("certs/").await.unwrap(), vec!["certs/a/chain"]);
    assert!(store.delete("certs/a/chain").await.unwrap());
}
