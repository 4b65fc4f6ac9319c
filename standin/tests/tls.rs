//! The TLS port serves the certificate read at start-up, for every SNI
//! name, even after the files are replaced and a reload is POSTed or a
//! SIGHUP sent; it answers the running config's origins as the data port
//! does.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Ca {
    issuer: Issuer<'static, KeyPair>,
    der: CertificateDer<'static>,
    pem: String,
}

fn ca() -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).unwrap();
    Ca {
        der: cert.der().clone(),
        pem: cert.pem(),
        issuer: Issuer::new(params, key),
    }
}

/// Writes `cert` (leaf + CA, leaf first) and `key` for `names`; the leaf's DER.
fn write_leaf(ca: &Ca, names: &[&str], dir: &Path) -> CertificateDer<'static> {
    let key = KeyPair::generate().unwrap();
    let params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    let leaf = params.signed_by(&key, &ca.issuer).unwrap();
    write_atomic(&dir.join("tls.crt"), &format!("{}{}", leaf.pem(), ca.pem));
    write_atomic(&dir.join("tls.key"), &key.serialize_pem());
    leaf.der().clone()
}

/// Connects with SNI `name`, trusting `ca`; the leaf served, and the
/// status of `GET /`.
async fn fetch(port: u16, name: &str, ca: &Ca) -> (CertificateDer<'static>, u16) {
    let (leaf, status, _) = fetch_from(port, name, ca, name, "/").await;
    (leaf, status)
}

/// Connects with SNI `name`, trusting `ca`, and asks `GET path` with
/// `Host: host`; the leaf served, the status and the body.
async fn fetch_from(
    port: u16,
    name: &str,
    ca: &Ca,
    host: &str,
    path: &str,
) -> (CertificateDer<'static>, u16, String) {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let server_name = ServerName::try_from(name.to_owned()).unwrap();
    let mut tls = connector.connect(server_name, tcp).await.unwrap();
    let leaf = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
    tls.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut raw = Vec::new();
    // A server may close without close_notify; what was read is enough.
    let _ = tls.read_to_end(&mut raw).await;
    let (status, _, body) = parse_response(&raw);
    (leaf, status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_the_start_up_certificate_for_every_name_until_restart() {
    let ca = ca();
    let cfg = ConfigDir::new("");
    let dir = cfg.dir.path().to_path_buf();
    let first = write_leaf(&ca, &["localhost", "a.example.com", "b.example.com"], &dir);
    let (admin, http, https) = (free_port(), free_port(), free_port());
    let text = config(
        admin,
        http,
        "",
        &format!(
            "  https_bind_port: {https}\n  tls_cert_file: {}\n  tls_key_file: {}\n",
            dir.join("tls.crt").display(),
            dir.join("tls.key").display()
        ),
    );
    cfg.write(&text);
    let path = cfg.path();
    let p = tokio::task::spawn_blocking(move || Proxy::start(&path, admin, &[]))
        .await
        .unwrap();

    for name in ["localhost", "a.example.com", "b.example.com"] {
        let (leaf, status) = fetch(https, name, &ca).await;
        assert_eq!(leaf, first, "{name}");
        assert_eq!(status, 200);
    }

    // New files, a reload, a SIGHUP: still the first certificate.
    let second = write_leaf(&ca, &["localhost", "a.example.com"], &dir);
    assert_ne!(first, second);
    let p = tokio::task::spawn_blocking(move || {
        let (status, body) = p.reload(("admin", "changeme"));
        assert_eq!(status, 200, "{body}");
        p.signal("HUP");
        let until = Instant::now() + DEADLINE;
        while !p.stderr().contains("SIGHUP ignored") {
            assert!(Instant::now() < until, "{}", p.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
        p
    })
    .await
    .unwrap();
    for name in ["localhost", "a.example.com"] {
        let (leaf, status) = fetch(https, name, &ca).await;
        assert_eq!(leaf, first, "{name}: the certificate was re-read");
        assert_eq!(status, 200);
    }
    drop(p);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_port_answers_the_running_origins() {
    let ca = ca();
    let cfg = ConfigDir::new("");
    let dir = cfg.dir.path().to_path_buf();
    write_leaf(&ca, &["localhost", "demo.example.com"], &dir);
    let (admin, http, https) = (free_port(), free_port(), free_port());
    let text = |body: &str| {
        format!(
            "{}origins:\n  \"demo.example.com\":\n    action: {{ type: mock, status: 200, body: \"{body}\" }}\n  \"api.example.com\":\n    action: {{ type: proxy, url: \"http://127.0.0.1:1\" }}\n",
            config(
                admin,
                http,
                "",
                &format!(
                    "  https_bind_port: {https}\n  tls_cert_file: {}\n  tls_key_file: {}\n",
                    dir.join("tls.crt").display(),
                    dir.join("tls.key").display()
                ),
            )
        )
    };
    cfg.write(&text("tls one"));
    let path = cfg.path();
    let p = tokio::task::spawn_blocking(move || Proxy::start(&path, admin, &[]))
        .await
        .unwrap();

    for host in ["demo.example.com", "Demo.Example.com:8443"] {
        let (_, status, body) = fetch_from(https, "demo.example.com", &ca, host, "/any").await;
        assert_eq!((status, body.as_str()), (200, "tls one"), "{host}");
    }
    let (_, status, _) = fetch_from(https, "localhost", &ca, "api.example.com", "/").await;
    assert_eq!(status, 502);
    // No origin for the Host: `/` and `/health` 200, anything else 404.
    for (path, want) in [("/", 200), ("/health", 200), ("/nothing", 404)] {
        let (_, status, _) = fetch_from(https, "localhost", &ca, "localhost", path).await;
        assert_eq!(status, want, "{path}");
    }

    // A reload changes the TLS port's answer too.
    cfg.write(&text("tls two"));
    let p = tokio::task::spawn_blocking(move || {
        let (status, body) = p.reload(("admin", "changeme"));
        assert_eq!(status, 200, "{body}");
        p
    })
    .await
    .unwrap();
    let (_, status, body) =
        fetch_from(https, "demo.example.com", &ca, "demo.example.com", "/").await;
    assert_eq!((status, body.as_str()), (200, "tls two"));
    drop(p);
}

#[test]
fn refuses_to_start_on_bad_tls_files() {
    let cfg = ConfigDir::new("");
    let dir = cfg.dir.path();
    let (admin, http, https) = (free_port(), free_port(), free_port());
    let tls = |cert: &str, key: &str| {
        config(
            admin,
            http,
            "",
            &format!(
                "  https_bind_port: {https}\n  tls_cert_file: {}\n  tls_key_file: {}\n",
                dir.join(cert).display(),
                dir.join(key).display()
            ),
        )
    };
    let refused = |text: &str, needle: &str| {
        cfg.write(text);
        let mut p = Proxy::spawn(&cfg.path(), admin, &[]);
        let (status, stderr) = p.wait_exit();
        assert_eq!(status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(needle), "{needle}:\n{stderr}");
    };
    // Missing files.
    refused(&tls("none.crt", "none.key"), "proxy.tls_cert_file");
    // Not PEM.
    std::fs::write(dir.join("junk.crt"), "junk").unwrap();
    refused(&tls("junk.crt", "none.key"), "proxy.tls_cert_file");
    // Only one of the two.
    refused(
        &config(
            admin,
            http,
            "",
            &format!("  tls_cert_file: {}\n", dir.join("junk.crt").display()),
        ),
        "proxy.tls_key_file",
    );
    // A key that is not the certificate's.
    let ca = ca();
    write_leaf(&ca, &["localhost"], dir);
    std::fs::write(
        dir.join("other.key"),
        KeyPair::generate().unwrap().serialize_pem(),
    )
    .unwrap();
    refused(&tls("tls.crt", "other.key"), "proxy.tls_key_file");
}
