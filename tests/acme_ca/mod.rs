//! Pebble, as the ACME tests reach it (each test starts its own Pebble and
//! pebble-challtestsrv with [`Pebble::start`], see `pebble_server`):
//! routing a hostname to a 127.0.0.x address through challtestsrv, Pebble's
//! root and intermediates from its management port, a challenge responder
//! on a test's own address, unique hostnames, and the checks a user makes
//! on an issued certificate (the chain verifies against Pebble's root for
//! every name, the key matches the leaf).

#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use aws_lc_rs::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair};
use bytes::Bytes;
use hyper::{Method, Request};
use instant_acme::BodyWrapper;
use rustls::RootCertStore;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use sbmesh::internal::account::AccountSettings;
use sbmesh::internal::challenge::{ChallengeBook, challenge_router};
use sbmesh::internal::http_client::AcmeHttpClient;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

#[path = "../pebble_server/mod.rs"]
mod pebble_server;

use pebble_server::{Endpoints, PebbleServer};

/// This test's Pebble ([`Endpoints`] by `Deref`); its servers stop when
/// the last clone is dropped.
#[derive(Clone, Debug)]
pub struct Pebble {
    server: Arc<PebbleServer>,
    http: AcmeHttpClient,
}

impl std::ops::Deref for Pebble {
    type Target = Endpoints;
    fn deref(&self) -> &Endpoints {
        &self.server.endpoints
    }
}

/// How long Pebble's management API and pebble-challtestsrv have to answer
/// one request of a test's.
const SERVER_ANSWER: Duration = Duration::from_secs(10);

impl Pebble {
    /// Which server `url` is, and its log.
    fn server_of(&self, url: &str) -> (&'static str, &std::path::Path) {
        if url.starts_with(&self.challtestsrv_url()) {
            ("pebble-challtestsrv", &self.challtestsrv_log)
        } else {
            ("pebble", &self.log)
        }
    }

    fn challtestsrv_url(&self) -> String {
        format!("http://{}", self.challtestsrv)
    }

    /// Starts this test's Pebble (named after the test's thread); `None`
    /// (a SKIP line) when `scripts/test` did not prepare Pebble, a panic
    /// when `SBMESH_TEST_REQUIRE_SERVERS=1`.
    pub fn start() -> Option<Self> {
        let server = PebbleServer::start(&pebble_server::test_name())?;
        let http =
            AcmeHttpClient::new(Some(&server.ca_root)).expect("a client trusting Pebble's CA");
        Some(Self {
            server: Arc::new(server),
            http,
        })
    }

    /// Account settings for this Pebble.
    pub fn settings(&self) -> AccountSettings {
        AccountSettings {
            directory_url: self.directory.clone(),
            ca_root: Some(self.ca_root.clone()),
            email: Some("ops@sbmesh.test".to_owned()),
            eab: None,
        }
    }

    /// Makes Pebble resolve `host` to `ip` (and only `ip`).
    pub async fn add_a(&self, host: &str, ip: Ipv4Addr) {
        let body = serde_json::json!({ "host": format!("{host}."), "addresses": [ip.to_string()] });
        self.post_challtestsrv("/add-a", body).await;
    }

    /// Forgets the address of `host`.
    pub async fn clear_a(&self, host: &str) {
        let body = serde_json::json!({ "host": format!("{host}.") });
        self.post_challtestsrv("/clear-a", body).await;
    }

    async fn post_challtestsrv(&self, path: &str, body: serde_json::Value) {
        let url = format!("{}{path}", self.challtestsrv_url());
        let (status, text) = self
            .request(Method::POST, &url, serde_json::to_vec(&body).unwrap())
            .await;
        assert!(status < 300, "POST {url} {body}: {status} {text}");
    }

    /// Pebble's root certificate (PEM), which signs every chain it issues.
    pub async fn root_pem(&self) -> String {
        self.get_pem("/roots/0").await
    }

    /// Pebble's intermediate certificate (PEM).
    pub async fn intermediate_pem(&self) -> String {
        self.get_pem("/intermediates/0").await
    }

    async fn get_pem(&self, path: &str) -> String {
        let url = format!("{}{path}", self.management);
        let (status, text) = self.request(Method::GET, &url, Vec::new()).await;
        assert_eq!(status, 200, "GET {url}: {text}");
        text
    }

    async fn request(&self, method: Method, url: &str, body: Vec<u8>) -> (u16, String) {
        let req = Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json")
            .body(BodyWrapper::<Bytes>::from(body))
            .expect("request");
        // A stalled server fails here, named, not in a client's time-out.
        let (parts, bytes) = tokio::time::timeout(SERVER_ANSWER, self.http.send(req))
            .await
            .unwrap_or_else(|_| {
                let (server, log) = self.server_of(url);
                panic!(
                    "{server} at {url} did not answer within {SERVER_ANSWER:?} (its log: {})",
                    log.display()
                )
            })
            .unwrap_or_else(|e| panic!("{} at {url}: {e}", self.server_of(url).0));
        (
            parts.status.as_u16(),
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    }
}

/// A hostname no other test (or earlier run) uses: `<tag>-<random>.issuer.test`.
pub fn unique_host(tag: &str) -> String {
    format!("{tag}-{:012x}.issuer.test", rand::random::<u64>() >> 16)
}

/// A challenge responder serving `book` on `ip:port`; stopped on drop.
pub struct Responder {
    /// Where it listens.
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves [`challenge_router`] for `book` on `ip:port`.
pub async fn serve_responder(book: Arc<ChallengeBook>, ip: Ipv4Addr, port: u16) -> Responder {
    let listener = TcpListener::bind((ip, port))
        .await
        .unwrap_or_else(|e| panic!("bind the challenge responder on {ip}:{port}: {e}"));
    let addr = listener.local_addr().expect("local addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, challenge_router(book)).await;
    });
    Responder { addr, task }
}

/// A listener on `ip:port` that accepts connections and never answers
/// (a validation sent there hangs); stopped on drop.
pub async fn serve_black_hole(ip: Ipv4Addr, port: u16) -> Responder {
    let listener = TcpListener::bind((ip, port))
        .await
        .unwrap_or_else(|e| panic!("bind {ip}:{port}: {e}"));
    let addr = listener.local_addr().expect("local addr");
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    Responder { addr, task }
}

/// Checks what a user checks on an issued certificate: `chain_pem` (leaf
/// first) verifies against `root_pem` for each of `hosts`, now; `key_pem`
/// is a PKCS#8 PEM ECDSA P-256 key whose public key is the leaf's.
pub fn verify_issued(chain_pem: &str, key_pem: &str, root_pem: &str, hosts: &[String]) {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .collect::<Result<_, _>>()
        .expect("the chain is PEM");
    assert!(
        chain.len() >= 2,
        "the chain holds the leaf and its intermediate: {chain_pem}"
    );
    let mut roots = RootCertStore::empty();
    for root in CertificateDer::pem_slice_iter(root_pem.as_bytes()) {
        roots.add(root.expect("root PEM")).expect("usable root");
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .expect("verifier");
    for host in hosts {
        let name = ServerName::try_from(host.clone()).expect("a DNS name");
        verifier
            .verify_server_cert(&chain[0], &chain[1..], &name, &[], UnixTime::now())
            .unwrap_or_else(|e| {
                panic!("the chain does not verify for {host} against Pebble's root: {e}")
            });
    }

    assert!(
        key_pem
            .trim_start()
            .starts_with("-----BEGIN PRIVATE KEY-----"),
        "the key is PKCS#8 PEM"
    );
    let PrivateKeyDer::Pkcs8(pkcs8) =
        PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("key PEM")
    else {
        panic!("the key is not PKCS#8");
    };
    let pair = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.secret_pkcs8_der())
        .expect("an ECDSA P-256 key");
    let (_, leaf) = x509_parser::parse_x509_certificate(chain[0].as_ref()).expect("leaf parses");
    assert_eq!(
        pair.public_key().as_ref(),
        leaf.public_key().subject_public_key.data.as_ref(),
        "the key does not match the leaf's public key"
    );
}

/// Polls `check` every 20 ms until it holds or `limit` passes.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
