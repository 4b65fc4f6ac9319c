//! `examples/embed.rs`, the compiled example run as a user runs it,
//! against a real Pebble (`scripts/test` starts it; without its variables
//! the test prints SKIP, or fails when SBMESH_TEST_REQUIRE_SERVERS=1).
//!
//! A rustls client connects to the example's HTTPS port with the origin's
//! name as SNI. It first gets the self-signed placeholder, then, from the
//! same running process, the certificate Pebble issued: a client that
//! trusts only Pebble's root completes the handshake for that name.
//!
//! The example binary is `target/<profile>/examples/embed`, built here
//! with cargo when `SBMESH_TEST_EMBED_BIN` does not name it (a no-op after
//! `scripts/test`'s build). The example binds 127.0.105.1 only.

mod acme_ca;
mod object_servers;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, DigitallySignedStruct, RootCertStore, StreamOwned};

use acme_ca::{Pebble, unique_host};

const IP: Ipv4Addr = Ipv4Addr::new(127, 0, 105, 1);
const HTTPS_PORT: u16 = 8443;
const DEADLINE: Duration = Duration::from_secs(90);

/// The example, killed when the test ends.
struct Example {
    child: Child,
    log: PathBuf,
}

impl Example {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The compiled example: `SBMESH_TEST_EMBED_BIN`, else built next to this
/// test binary (`target/<profile>/deps/..` -> `target/<profile>/examples/embed`).
fn example_bin() -> PathBuf {
    if let Ok(bin) = std::env::var("SBMESH_TEST_EMBED_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .expect("a profile directory");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut build = Command::new(cargo);
    build.args(["build", "-p", "sbmesh", "--example", "embed"]);
    match profile {
        "debug" => {}
        "release" => {
            build.arg("--release");
        }
        other => {
            build.args(["--profile", other]);
        }
    }
    let status = build
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run cargo to build the example");
    assert!(status.success(), "cargo build --example embed failed");
    profile_dir.join("examples").join("embed")
}

/// What a handshake presented: the chain, leaf first.
#[derive(Debug)]
struct Capture {
    provider: Arc<CryptoProvider>,
    chain: Mutex<Vec<CertificateDer<'static>>>,
}

impl ServerCertVerifier for Capture {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let mut chain = vec![end_entity.clone().into_owned()];
        chain.extend(intermediates.iter().map(|c| c.clone().into_owned()));
        *self.chain.lock().unwrap() = chain;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// One HTTPS request to the example with SNI `host`; the body of its
/// answer, or why there is none.
fn get(config: Arc<ClientConfig>, host: &str) -> Result<String, String> {
    let addr = SocketAddr::from((IP, HTTPS_PORT));
    let tcp = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| format!("connect: {e}"))?;
    tcp.set_read_timeout(Some(Duration::from_secs(5))).ok();
    let name = ServerName::try_from(host.to_owned()).map_err(|e| e.to_string())?;
    let conn = ClientConnection::new(config, name).map_err(|e| e.to_string())?;
    let mut tls = StreamOwned::new(conn, tcp);
    let request = format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    tls.write_all(request.as_bytes())
        .map_err(|e| format!("handshake/write: {e}"))?;
    let mut answer = String::new();
    match tls.read_to_string(&mut answer) {
        Ok(_) => {}
        // A server that closes without close_notify still answered.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !answer.is_empty() => {}
        Err(e) => return Err(format!("read: {e}")),
    }
    Ok(answer)
}

/// The leaf a handshake with SNI `host` presents (any certificate is
/// accepted), with the answer.
fn presented_leaf(host: &str) -> Result<CertificateDer<'static>, String> {
    let capture = Arc::new(Capture {
        provider: provider(),
        chain: Mutex::default(),
    });
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(capture.clone())
        .with_no_client_auth();
    let answer = get(Arc::new(config), host)?;
    if !answer.starts_with("HTTP/1.1 200") || !answer.ends_with("ok\n") {
        return Err(format!("unexpected answer {answer:?}"));
    }
    capture
        .chain
        .lock()
        .unwrap()
        .first()
        .cloned()
        .ok_or_else(|| "no certificate presented".to_owned())
}

/// (subject, issuer) of a leaf.
fn subject_issuer(leaf: &CertificateDer<'_>) -> (String, String) {
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).expect("leaf parses");
    (cert.subject().to_string(), cert.issuer().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_serves_the_placeholder_then_pebbles_certificate_without_a_restart() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let host = unique_host("embed");
    pebble.add_a(&host, IP).await;
    let root_pem = pebble.root_pem().await;

    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("sb.yml");
    let store = dir.path().join("store.redb");
    std::fs::write(
        &config,
        format!(
            "proxy:\n  extensions:\n    sbmesh:\n      acme:\n        enabled: true\n        \
             email: ops@example.com\n        directory_url: \"{}\"\n        ca_root: \"{}\"\n        \
             storage_backend: redb\n        storage_path: \"{}\"\norigins:\n  \"{host}\": {{}}\n",
            pebble.directory,
            pebble.ca_root.display(),
            store.display(),
        ),
    )
    .expect("write sb.yml");

    let bin = example_bin();
    let log = dir.path().join("embed.log");
    let out = std::fs::File::create(&log).expect("log file");
    let child = Command::new(&bin)
        .env("EMBED_CONFIG", &config)
        .env("EMBED_STATE_DIR", dir.path().join("state"))
        .env("EMBED_IP", IP.to_string())
        .env("EMBED_CHALLENGE_PORT", pebble.http_port.to_string())
        .env("EMBED_HTTPS_PORT", HTTPS_PORT.to_string())
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("log file"))
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
    let mut example = Example { child, log };
    let pid = example.child.id();

    let result = tokio::task::spawn_blocking(move || {
        // First the placeholder: self-signed, for the origin's name.
        let deadline = Instant::now() + DEADLINE;
        let placeholder = loop {
            match presented_leaf(&host) {
                Ok(leaf) => break leaf,
                Err(e) => {
                    assert!(Instant::now() < deadline, "no certificate served: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        let (subject, issuer) = subject_issuer(&placeholder);
        assert_eq!(subject, issuer, "the first certificate is self-signed");
        let (_, leaf) = x509_parser::parse_x509_certificate(placeholder.as_ref()).unwrap();
        let names: Vec<String> = leaf
            .subject_alternative_name()
            .unwrap()
            .map(|san| {
                san.value
                    .general_names
                    .iter()
                    .map(|n| n.to_string())
                    .collect()
            })
            .unwrap_or_default();
        assert!(
            names.iter().any(|n| n.contains(&host)),
            "the placeholder names {host}: {names:?}"
        );

        // Then Pebble's: another issuer, and a client trusting only
        // Pebble's root accepts it for the name.
        let issued = loop {
            match presented_leaf(&host) {
                Ok(leaf) if leaf != placeholder => break leaf,
                Ok(_) => {}
                Err(e) => panic!("the example stopped serving {host}: {e}"),
            }
            assert!(
                Instant::now() < deadline,
                "Pebble's certificate was never served"
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        let (_, issued_by) = subject_issuer(&issued);
        assert_ne!(issued_by, issuer, "the new certificate has another issuer");
        let mut roots = RootCertStore::empty();
        for root in CertificateDer::pem_slice_iter(root_pem.as_bytes()) {
            roots.add(root.expect("root PEM")).expect("a usable root");
        }
        let trusting = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        let answer = get(Arc::new(trusting), &host)
            .unwrap_or_else(|e| panic!("a client trusting Pebble's root: {e}"));
        assert!(answer.ends_with("ok\n"), "{answer:?}");
    })
    .await;
    // The same process served both.
    let still_running = example.child.try_wait().expect("child status").is_none();
    if let Err(panic) = result {
        eprintln!("--- example log ---\n{}", example.log());
        std::panic::resume_unwind(panic.into_panic());
    }
    assert!(
        still_running,
        "the example (pid {pid}) exited:\n{}",
        example.log()
    );
}
