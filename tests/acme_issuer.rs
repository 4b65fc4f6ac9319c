//! The ACME issuer ([`sbmesh::internal::issuer`], [`sbmesh::internal::account`])
//! against a real Pebble (`scripts/test` starts it; without its variables
//! each Pebble test prints SKIP, or fails when SBMESH_TEST_REQUIRE_SERVERS=1):
//!
//! - one host, then two hosts in one order: the chain verifies against
//!   Pebble's root for every name, the key is PKCS#8 P-256 and matches the
//!   leaf, and the challenge tokens are gone from the store afterwards;
//! - the challenge published by replica A is answered by replica B's
//!   responder on another address, sharing only the store (Redis when
//!   `scripts/test` started it): the CA's validation reaches a replica
//!   that did not order;
//! - five replicas starting together create exactly one account;
//! - an order whose challenge nobody can answer fails with a validation
//!   error naming the host, and withdraws its token;
//! - an order stops when the caller's lease flips to lost;
//! - the directory's TLS is trusted through `ca_root` only, and a
//!   `ca_root` that cannot be used is a configuration error naming it;
//!
//! and, against a small fake CA (Pebble has no ARI and sends no
//! `Retry-After` on demand): a rate-limited order carries the CA's
//! `Retry-After` (delay-seconds and HTTP-date), and ARI's renewal window
//! is asked with the RFC 9773 certificate identifier.
//!
//! Each test binds its responders on its own 127.0.41.x and orders unique
//! hostnames, so tests run in parallel against one Pebble.

mod acme_ca;
mod object_servers;
mod store_hook;

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderName, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use base64::Engine;
use base64::prelude::BASE64_URL_SAFE_NO_PAD;
use sbmesh::internal::account::{AccountSettings, AcmeError, load_or_create};
use sbmesh::internal::challenge::ChallengeBook;
use sbmesh::internal::issuer::{Issuer, certificate_identifier};
use sbmesh::internal::layout;
use sbmesh::{KeyRing, MemoryStore, Metrics, Store, StoreError};
use tokio::net::TcpListener;
use tokio::sync::watch;

use acme_ca::{Pebble, eventually, serve_black_hole, serve_responder, unique_host, verify_issued};
use object_servers::server_env;
use store_hook::{Hook, Hooked, Op};

fn ip(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 41, last)
}

fn memory() -> Arc<dyn Store> {
    Arc::new(MemoryStore::new())
}

fn ring() -> KeyRing {
    KeyRing::new(vec![[0x5a; 32]]).expect("key ring")
}

async fn challenge_keys(store: &Arc<dyn Store>) -> Vec<String> {
    store
        .list("acme/challenges/")
        .await
        .expect("list challenges")
}

/// One replica: a book on `store` and an issuer ordering through it.
async fn replica(
    pebble: &Pebble,
    store: &Arc<dyn Store>,
    node: &str,
) -> (Issuer, Arc<ChallengeBook>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(Arc::clone(store), Arc::clone(&metrics));
    let account = load_or_create(store, None, &pebble.settings(), &format!("{node}/test"))
        .await
        .expect("account at Pebble");
    (Issuer::new(account, Arc::clone(&book), node), book, metrics)
}

#[tokio::test]
async fn one_host_is_issued_and_verifies() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let store = memory();
    let (issuer, book, _) = replica(&pebble, &store, "node-a").await;
    assert!(!issuer.offers_ari(), "Pebble 2.4 has no renewalInfo");
    let _responder = serve_responder(book, ip(1), pebble.http_port).await;
    let host = unique_host("one");
    pebble.add_a(&host, ip(1)).await;

    let started = Instant::now();
    let issued = issuer
        .order(std::slice::from_ref(&host), None)
        .await
        .expect("issued");
    eprintln!("one order against Pebble took {:?}", started.elapsed());

    assert_eq!(issued.hosts, vec![host.clone()]);
    verify_issued(
        &issued.chain_pem,
        &issued.key_pem,
        &pebble.root_pem().await,
        std::slice::from_ref(&host),
    );
    assert!(
        issued
            .chain_pem
            .contains(pebble.intermediate_pem().await.trim()),
        "the chain carries Pebble's intermediate"
    );
    assert!(
        challenge_keys(&store).await.is_empty(),
        "tokens withdrawn after the order"
    );
    assert_eq!(issuer.renewal_window(&issued.chain_pem).await, None);
    pebble.clear_a(&host).await;
}

#[tokio::test]
async fn two_hosts_in_one_order() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let store = memory();
    let (issuer, book, _) = replica(&pebble, &store, "node-a").await;
    let _responder = serve_responder(book, ip(2), pebble.http_port).await;
    let hosts = vec![unique_host("two-a"), unique_host("two-b")];
    for host in &hosts {
        pebble.add_a(host, ip(2)).await;
    }
    // Upper case and a duplicate: ordered once, lowercase.
    let asked = vec![hosts[0].to_uppercase(), hosts[1].clone(), hosts[0].clone()];
    let issued = issuer.order(&asked, None).await.expect("issued");
    assert_eq!(issued.hosts, hosts);
    verify_issued(
        &issued.chain_pem,
        &issued.key_pem,
        &pebble.root_pem().await,
        &hosts,
    );
    assert!(challenge_keys(&store).await.is_empty());
    for host in &hosts {
        pebble.clear_a(host).await;
    }
}

/// The store two replicas share: Redis when `scripts/test` started it.
async fn shared_store() -> Arc<dyn Store> {
    match server_env("SBMESH_TEST_REDIS_URL") {
        Some(url) => {
            let namespace = format!("issuer-{:016x}", rand::random::<u64>());
            let store = sbmesh::RedisStore::connect(&url, Duration::from_secs(5))
                .await
                .expect("redis store")
                .with_namespace(&namespace)
                .expect("namespace");
            Arc::new(store)
        }
        None => memory(),
    }
}

#[tokio::test]
async fn a_replica_that_did_not_order_answers_the_challenge() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let store = shared_store().await;
    // Replica A orders; its own responder listens but the CA never asks it.
    let (issuer_a, book_a, metrics_a) = replica(&pebble, &store, "node-a").await;
    let _responder_a = serve_responder(book_a, ip(3), pebble.http_port).await;
    // Replica B shares only the store: its own book, metrics and address.
    let metrics_b = Arc::new(Metrics::new());
    let book_b = ChallengeBook::new(Arc::clone(&store), Arc::clone(&metrics_b));
    let _responder_b = serve_responder(book_b, ip(4), pebble.http_port).await;

    let host = unique_host("cross");
    pebble.add_a(&host, ip(4)).await;
    let issued = issuer_a
        .order(std::slice::from_ref(&host), None)
        .await
        .expect("issued through B");
    verify_issued(
        &issued.chain_pem,
        &issued.key_pem,
        &pebble.root_pem().await,
        std::slice::from_ref(&host),
    );

    let hits = |metrics: &Metrics| {
        metrics
            .encode()
            .lines()
            .find(|l| l.starts_with("acme_challenge_requests_total{result=\"hit\"}"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(
        hits(&metrics_b) >= 1.0,
        "B answered the CA:\n{}",
        metrics_b.encode()
    );
    assert_eq!(hits(&metrics_a), 0.0, "A was never asked");
    assert!(challenge_keys(&store).await.is_empty());
    pebble.clear_a(&host).await;
}

/// Counts account record writes (each follows one account creation at the
/// CA).
#[derive(Default)]
struct AccountWrites(AtomicUsize);

#[async_trait]
impl Hook for AccountWrites {
    async fn before(&self, op: Op, key: &str) -> Result<(), StoreError> {
        if op.writes() && key.starts_with("acme/") && key.ends_with("/account") {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

#[tokio::test]
async fn five_replicas_starting_together_create_one_account() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let counting = Hooked::new(memory(), AccountWrites::default());
    let store: Arc<dyn Store> = counting.clone();
    let ring = ring();
    let settings = pebble.settings();
    let tasks: Vec<_> = (0..5)
        .map(|i| {
            let (store, ring, settings) = (Arc::clone(&store), ring.clone(), settings.clone());
            tokio::spawn(async move {
                load_or_create(&store, Some(&ring), &settings, &format!("node-{i}/p{i}"))
                    .await
                    .map(|account| account.id().to_owned())
            })
        })
        .collect();
    let mut ids = Vec::new();
    for task in tasks {
        ids.push(task.await.expect("task").expect("account"));
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one account id for all five: {ids:?}");
    assert_eq!(
        counting.hook.0.load(Ordering::SeqCst),
        1,
        "one account created"
    );

    // Sealed at rest under the ring (it holds the account's private key).
    let key = layout::account(&settings.directory_id());
    let stored = store.get(&key).await.unwrap().expect("stored credentials");
    assert_eq!(stored.value[0], 0xA5, "sealed record");
    assert!(!String::from_utf8_lossy(&stored.value).contains("key_pkcs8"));

    // A later start loads it (and Pebble confirms it exists).
    let again = load_or_create(&store, Some(&ring), &settings, "node-9/later")
        .await
        .unwrap();
    assert_eq!(again.id(), ids[0]);
    assert_eq!(counting.hook.0.load(Ordering::SeqCst), 1);
    // Without the key, the record cannot be opened: a configuration error.
    let err = load_or_create(&store, None, &settings, "node-9/nokey")
        .await
        .unwrap_err();
    assert!(matches!(err, AcmeError::Config(_)), "{err}");
}

#[tokio::test]
async fn an_account_the_ca_forgot_is_replaced_once() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let store = memory();
    let settings = pebble.settings();
    let key = layout::account(&settings.directory_id());
    // Credentials of an account Pebble never saw: a key it does not know.
    let first = load_or_create(&store, None, &settings, "node-a/1")
        .await
        .unwrap();
    let stored = store.get(&key).await.unwrap().unwrap();
    let mut record: serde_json::Value =
        serde_json::from_slice(&stored.value[1..]).expect("plain JSON record");
    let (_, pkcs8) = instant_acme::Key::generate_pkcs8().unwrap();
    record["credentials"]["key_pkcs8"] =
        serde_json::Value::String(BASE64_URL_SAFE_NO_PAD.encode(pkcs8.secret_pkcs8_der()));
    let mut bytes = vec![b'P'];
    bytes.extend_from_slice(&serde_json::to_vec(&record).unwrap());
    store.put(&key, &bytes, None).await.unwrap();

    let replaced = load_or_create(&store, None, &settings, "node-b/2")
        .await
        .unwrap();
    assert_ne!(
        replaced.id(),
        first.id(),
        "a new account replaced the unknown one"
    );
    let again = load_or_create(&store, None, &settings, "node-c/3")
        .await
        .unwrap();
    assert_eq!(again.id(), replaced.id(), "and it is kept");
}

#[tokio::test]
async fn an_unanswered_challenge_fails_clearly_and_is_withdrawn() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let store = memory();
    let (issuer, _book, _) = replica(&pebble, &store, "node-a").await;
    // The host points at a responder whose store never saw the token: 404.
    let stranger = ChallengeBook::new(memory(), Arc::new(Metrics::new()));
    let _responder = serve_responder(stranger, ip(6), pebble.http_port).await;
    let host = unique_host("unanswered");
    pebble.add_a(&host, ip(6)).await;

    let err = issuer
        .order(std::slice::from_ref(&host), None)
        .await
        .expect_err("nobody can answer the challenge");
    match &err {
        AcmeError::Validation { host: failed, .. } => assert_eq!(failed, &host),
        other => panic!("expected a validation error, got {other:?}"),
    }
    let message = err.to_string();
    eprintln!("the error a user sees: {message}");
    assert!(
        message.contains(&host) && message.contains("challenge listener"),
        "{message}"
    );
    assert!(err.is_retryable());
    assert!(
        challenge_keys(&store).await.is_empty(),
        "token withdrawn after the failure"
    );
    pebble.clear_a(&host).await;
}

#[tokio::test]
async fn an_order_stops_when_the_lease_is_lost() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let store = memory();
    let (issuer, _book, _) = replica(&pebble, &store, "node-a").await;
    // Validations sent here hang, so the order would wait.
    let _hole = serve_black_hole(ip(7), pebble.http_port).await;
    let host = unique_host("lease");
    pebble.add_a(&host, ip(7)).await;

    // Already lost: nothing is ordered.
    let (_tx, rx) = watch::channel(false);
    let err = issuer
        .order(std::slice::from_ref(&host), Some(rx))
        .await
        .unwrap_err();
    assert!(matches!(err, AcmeError::LeaseLost { .. }), "{err}");

    let (tx, rx) = watch::channel(true);
    let hosts = vec![host.clone()];
    let order = tokio::spawn({
        let issuer = Arc::new(issuer);
        async move { issuer.order(&hosts, Some(rx)).await }
    });
    eventually(
        Duration::from_secs(30),
        "the challenge is published",
        || {
            let store = Arc::clone(&store);
            async move { !challenge_keys(&store).await.is_empty() }
        },
    )
    .await;
    tx.send(false).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(30), order)
        .await
        .expect("the order stops once the lease is lost")
        .expect("task");
    match result {
        Err(AcmeError::LeaseLost { hosts }) => assert_eq!(hosts, vec![host.clone()]),
        other => panic!("expected LeaseLost, got {other:?}"),
    }
    assert!(challenge_keys(&store).await.is_empty(), "token withdrawn");
    pebble.clear_a(&host).await;
}

#[tokio::test]
async fn the_directory_is_trusted_only_through_ca_root() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let store = memory();
    let dir = tempfile::tempdir().unwrap();
    let other_ca = dir.path().join("other-ca.pem");
    std::fs::write(&other_ca, ARI_LEAF).unwrap();
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "not a certificate\n").unwrap();

    // Another CA in ca_root: Pebble's certificate is refused.
    let settings = AccountSettings {
        ca_root: Some(other_ca),
        ..pebble.settings()
    };
    let err = load_or_create(&store, None, &settings, "node-a/t")
        .await
        .unwrap_err();
    assert!(matches!(err, AcmeError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains("certificate"), "{err}");
    assert!(err.is_retryable());

    // No ca_root: the platform's roots do not know Pebble's test CA either.
    let settings = AccountSettings {
        ca_root: None,
        ..pebble.settings()
    };
    let err = load_or_create(&store, None, &settings, "node-a/t")
        .await
        .unwrap_err();
    assert!(matches!(err, AcmeError::Unreachable { .. }), "{err}");

    // A ca_root that cannot be used is a configuration error naming it.
    for (path, what) in [
        (empty, "no CERTIFICATE"),
        (dir.path().join("missing.pem"), "cannot read"),
    ] {
        let settings = AccountSettings {
            ca_root: Some(path.clone()),
            ..pebble.settings()
        };
        let err = load_or_create(&store, None, &settings, "node-a/t")
            .await
            .unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(err, AcmeError::Config(_)) && !err.is_retryable(),
            "{message}"
        );
        assert!(
            message.contains("proxy.extensions.sbmesh.acme.ca_root") && message.contains(what),
            "{message}"
        );
    }
    assert!(store.list("").await.unwrap().is_empty(), "nothing stored");
}

// ---------------------------------------------------------------------------
// A fake CA: what Pebble cannot show (ARI, Retry-After on errors).

/// The leaf of RFC 9773's example: authority key identifier
/// 69:88:5B:..:C8:D4 and serial 00:87:65:43:21.
const ARI_LEAF: &str = "-----BEGIN CERTIFICATE-----
MIIBfzCCASSgAwIBAgIFAIdlQyEwCgYIKoZIzj0EAwIwGTEXMBUGA1UEAwwOQVJJ
IGV4YW1wbGUgQ0EwIBcNMjYxMTI5MTcyMjQ2WhgPMjEyNjExMDUxNzIyNDZaMBYx
FDASBgNVBAMMC2FyaS5leGFtcGxlMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE
jRuSNua0vtMGnJd1jfhHhWTueHdDYWJT0nBuZVJg7Q+AaN4uLnAWwmfbi0Gmgv4z
QDp9F77nBUhAj0+5HHepHaNaMFgwHwYDVR0jBBgwFoAUaYhba4dGQEHhs3uEe6Cu
LN4ByNQwFgYDVR0RBA8wDYILYXJpLmV4YW1wbGUwHQYDVR0OBBYEFKpzGmjOgiUh
v3fEz0GgUAoDQxRQMAoGCCqGSM49BAMCA0kAMEYCIQDIMhcwMx6E+J9ahWJCEWOP
ypAfrqSDnyCpeaG/skNkXQIhAM3B6ONtHpc5angAGojj5ByEhueDuDRxlVmJQ0FT
nEro
-----END CERTIFICATE-----
";
/// The identifier RFC 9773 section 4.1 derives from those values.
const ARI_ID: &str = "aYhba4dGQEHhs3uEe6CuLN4ByNQ.AIdlQyE";

struct FakeCa {
    base: String,
    orders: AtomicUsize,
    ari_asked: Mutex<Vec<String>>,
}

fn nonce() -> (HeaderName, String) {
    (
        HeaderName::from_static("replay-nonce"),
        "fake-nonce".to_owned(),
    )
}

async fn fake_directory(State(ca): State<Arc<FakeCa>>) -> impl IntoResponse {
    let b = &ca.base;
    axum::Json(serde_json::json!({
        "newNonce": format!("{b}/nonce"),
        "newAccount": format!("{b}/account"),
        "newOrder": format!("{b}/order"),
        "renewalInfo": format!("{b}/ari"),
    }))
}

async fn fake_nonce() -> impl IntoResponse {
    (StatusCode::OK, [nonce()])
}

async fn fake_account(State(ca): State<Arc<FakeCa>>) -> impl IntoResponse {
    let location = format!("{}/acct/1", ca.base);
    (
        StatusCode::CREATED,
        [nonce(), (header::LOCATION, location)],
        axum::Json(serde_json::json!({"status": "valid"})),
    )
}

async fn fake_order(State(ca): State<Arc<FakeCa>>) -> impl IntoResponse {
    let n = ca.orders.fetch_add(1, Ordering::SeqCst);
    let (status, retry_after, kind) = if n == 0 {
        (
            StatusCode::TOO_MANY_REQUESTS,
            "120".to_owned(),
            "rateLimited",
        )
    } else {
        let at = SystemTime::now() + Duration::from_secs(300);
        (
            StatusCode::SERVICE_UNAVAILABLE,
            httpdate::fmt_http_date(at),
            "serverInternal",
        )
    };
    (
        status,
        [nonce(), (header::RETRY_AFTER, retry_after)],
        axum::Json(serde_json::json!({
            "type": format!("urn:ietf:params:acme:error:{kind}"),
            "detail": "come back later",
            "status": status.as_u16(),
        })),
    )
}

async fn fake_ari(State(ca): State<Arc<FakeCa>>, Path(id): Path<String>) -> impl IntoResponse {
    ca.ari_asked.lock().unwrap().push(id);
    (
        StatusCode::OK,
        [(header::RETRY_AFTER, "21600")],
        axum::Json(serde_json::json!({
            "suggestedWindow": {"start": "2030-01-02T03:04:05Z", "end": "2030-01-03T03:04:05Z"}
        })),
    )
}

#[tokio::test]
async fn retry_after_and_renewal_information_from_the_ca() {
    let listener = TcpListener::bind((ip(8), 0))
        .await
        .expect("bind the fake CA");
    let addr = listener.local_addr().unwrap();
    let ca = Arc::new(FakeCa {
        base: format!("http://{addr}"),
        orders: AtomicUsize::new(0),
        ari_asked: Mutex::new(Vec::new()),
    });
    let app = Router::new()
        .route("/dir", get(fake_directory))
        .route("/nonce", get(fake_nonce).head(fake_nonce))
        .route("/account", post(fake_account))
        .route("/order", post(fake_order))
        .route("/ari/{id}", get(fake_ari))
        .with_state(Arc::clone(&ca));
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });

    let store = memory();
    let settings = AccountSettings {
        directory_url: format!("{}/dir", ca.base),
        ca_root: None,
        email: None,
        eab: None,
    };
    let account = load_or_create(&store, None, &settings, "node-a/fake")
        .await
        .expect("account");
    assert_eq!(account.id(), format!("{}/acct/1", ca.base));
    let book = ChallengeBook::new(Arc::clone(&store), Arc::new(Metrics::new()));
    let issuer = Issuer::new(account, book, "node-a");
    assert!(issuer.offers_ari());

    let hosts = vec!["api.example.com".to_owned()];
    let err = issuer.order(&hosts, None).await.unwrap_err();
    assert!(err.is_rate_limited() && err.is_retryable(), "{err}");
    let wait = err.retry_after().expect("Retry-After seen");
    assert!(
        wait > Duration::from_secs(100) && wait <= Duration::from_secs(120),
        "{wait:?}"
    );

    let err = issuer.order(&hosts, None).await.unwrap_err();
    assert_eq!(err.problem_type(), Some("serverInternal"), "{err}");
    let wait = err.retry_after().expect("Retry-After (HTTP-date) seen");
    assert!(
        wait > Duration::from_secs(250) && wait <= Duration::from_secs(300),
        "{wait:?}"
    );

    assert_eq!(
        certificate_identifier(ARI_LEAF).unwrap().to_string(),
        ARI_ID
    );
    let window = issuer
        .renewal_info(ARI_LEAF)
        .await
        .unwrap()
        .expect("ARI offered");
    assert_eq!(window.start_unix, 1_893_553_445);
    assert_eq!(window.end_unix, 1_893_639_845);
    assert_eq!(window.check_again_after.as_secs().div_ceil(60), 360);
    assert_eq!(
        issuer.renewal_window(ARI_LEAF).await,
        Some((1_893_553_445, 1_893_639_845))
    );
    assert_eq!(
        ca.ari_asked.lock().unwrap().first().map(String::as_str),
        Some(ARI_ID)
    );
    server.abort();
}
