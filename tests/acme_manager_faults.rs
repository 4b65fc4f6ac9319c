//! The ACME manager's fault paths against a real Pebble (`scripts/test`
//! starts it; without its variables the tests print SKIP, or fail when
//! SBMESH_TEST_REQUIRE_SERVERS=1), each replica alone in a mesh of its own
//! on a memory store whose operations are counted:
//!
//! - an order lock held by another replica is waited out at a few store
//!   operations a second (not retried as fast as the store answers), and
//!   the certificate is ordered soon after the lease expires;
//! - a restarted pod (same node id, another process) takes over the lease
//!   its previous process left behind at once, instead of waiting it out;
//! - a failing hostname's backoff is kept in the store: when its owner
//!   goes away, the next replica does not order it again before the
//!   backoff elapses;
//! - the duplicate guard fails closed: an issuance history that cannot be
//!   read places no order;
//! - attempts that never reach the CA (its directory unreachable) do not
//!   spend the cluster's order budget.
//! - a certificate the CA issued that the store does not take at first is
//!   kept and written once the store answers, not ordered again.
//!
//! Meshes bind 127.0.43.1-9, responders 127.0.43.1x; 127.0.43.99 is where
//! a hostname goes to fail its validation (nothing listens there).

mod acme_ca;
mod object_servers;
mod store_hook;

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sbmesh::internal::certs::parse_chain;
use sbmesh::internal::challenge::ChallengeBook;
use sbmesh::internal::instrumented::Instrumented;
use sbmesh::internal::layout;
use sbmesh::internal::manager::{AcmeInputs, AcmeManager, AcmeManagerConfig};
use sbmesh::internal::placeholder::is_placeholder;
use sbmesh::internal::schedule::{OrderBudget, UnitOrderState};
use sbmesh::internal::unit::CertUnit;
use sbmesh::{
    LeaseLock, MemoryStore, Mesh, MeshConfig, Metrics, NodeMeta, SbConfig, Store, StoreError,
    put_fenced,
};
use tokio::sync::watch;

use acme_ca::{Pebble, eventually, serve_responder, unique_host};
use store_hook::{Hook, Hooked, Op};

const NOWHERE: Ipv4Addr = Ipv4Addr::new(127, 0, 43, 99);

fn config(directory: &str, ca_root: &Path, origins: &[String]) -> Arc<SbConfig> {
    let mut text = format!(
        "proxy:\n  extensions:\n    sbmesh:\n      acme:\n        enabled: true\n        \
         email: ops@sbmesh.test\n        directory_url: {directory}\n        ca_root: {}\n        \
         storage_backend: memory\norigins:\n",
        ca_root.display()
    );
    for origin in origins {
        text.push_str(&format!("  \"{origin}\": {{}}\n"));
    }
    Arc::new(sbmesh::parse_config(&text).expect("a valid config"))
}

async fn alone(node: &str, ip: Ipv4Addr, metrics: &Arc<Metrics>) -> Mesh {
    let mut cfg = MeshConfig::new(node, format!("faults-{node}"), vec![[0x43; 32]]);
    cfg.bind = ip.into();
    (cfg.gossip_port, cfg.transport_port, cfg.seeds.gossip_port) = (0, 0, 0);
    Mesh::start(cfg, metrics.clone(), NodeMeta::default())
        .await
        .expect("mesh starts")
}

/// One replica: its manager, mesh and metrics.
struct Replica {
    manager: AcmeManager,
    mesh: Mesh,
    metrics: Arc<Metrics>,
    certs: tempfile::TempDir,
}

impl Replica {
    async fn start(
        node: &str,
        ip: Ipv4Addr,
        store: &Arc<dyn Store>,
        config: Arc<SbConfig>,
    ) -> Replica {
        let metrics = Arc::new(Metrics::new());
        // This replica's own count of the shared store's operations.
        let counted: Arc<dyn Store> = Arc::new(Instrumented::new(store.clone(), metrics.clone()));
        let book = ChallengeBook::new(counted.clone(), metrics.clone());
        let mesh = alone(node, ip, &metrics).await;
        let certs = tempfile::tempdir().unwrap();
        let (_tx, config_rx) = watch::channel(config);
        let mut cfg = AcmeManagerConfig::new(node, certs.path());
        cfg.settle = Duration::from_millis(300);
        cfg.limits.order_lock_ttl = Duration::from_secs(20);
        let manager = AcmeManager::spawn(
            cfg,
            AcmeInputs {
                store: counted,
                mesh: mesh.clone(),
                metrics: metrics.clone(),
                config: config_rx,
                certificates_changed: Arc::new(|| {}),
                book,
            },
        );
        // The config sender may go: the manager keeps the last config.
        std::mem::forget(_tx);
        Replica {
            manager,
            mesh,
            metrics,
            certs,
        }
    }

    /// Every store operation this replica made so far.
    fn store_ops(&self) -> f64 {
        metric_sum(&self.metrics.encode(), "store_operations_total")
    }

    fn orders(&self, result: &str) -> f64 {
        let text = self.metrics.encode();
        text.lines()
            .filter(|l| {
                l.starts_with("acme_orders_total{") && l.contains(&format!("result=\"{result}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Whether the CA's certificate for `host` is on disk.
    fn has_real_cert(&self, host: &str) -> bool {
        std::fs::read_to_string(self.certs.path().join(host).join("tls.crt"))
            .ok()
            .is_some_and(|chain| !is_placeholder(&chain) && parse_chain(&chain).is_ok())
    }

    async fn stop(self) {
        drop(self.manager);
        self.mesh.leave().await;
    }
}

fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn shared_state(
    store: &Arc<dyn Store>,
    directory: &str,
    host: &str,
) -> Option<UnitOrderState> {
    let key = layout::order_state(
        &layout::directory_id(directory),
        &layout::hostname_set_id(&[host.to_owned()]),
    );
    let entry = store.get(&key).await.expect("store answers")?;
    Some(serde_json::from_slice(&entry.value).expect("the shared order state is JSON"))
}

#[tokio::test]
async fn a_busy_order_lock_is_waited_out_quietly_then_ordered() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let ip = Ipv4Addr::new(127, 0, 43, 1);
    let responder_ip = Ipv4Addr::new(127, 0, 43, 11);
    let host = unique_host("busy");
    pebble.add_a(&host, responder_ip).await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    // Another replica holds the host's order lock (and is hung: it never
    // renews nor releases it).
    let ttl = Duration::from_secs(8);
    let lock = LeaseLock::new(store.clone(), &CertUnit::per_host(&host).lock_name());
    let lease = lock
        .try_acquire("faults-other/0123abcd", ttl)
        .await
        .unwrap()
        .expect("a fresh lock");
    let expires = Instant::now() + ttl;
    let book_metrics = Arc::new(Metrics::new());
    let _responder = serve_responder(
        ChallengeBook::new(store.clone(), book_metrics),
        responder_ip,
        pebble.http_port,
    )
    .await;
    let replica = Replica::start(
        "faults-busy",
        ip,
        &store,
        config(
            &pebble.directory,
            &pebble.ca_root,
            std::slice::from_ref(&host),
        ),
    )
    .await;
    let started = Instant::now();

    // Over the lease: a few operations a second (a look at the lock every
    // few seconds, the certificate record every 2 s), not thousands.
    tokio::time::sleep_until((expires - Duration::from_millis(500)).into()).await;
    let waited = started.elapsed().as_secs_f64();
    let ops = replica.store_ops();
    let rate = ops / waited;
    eprintln!("store operations while the lock was busy: {ops} in {waited:.1} s ({rate:.2}/s)");
    assert!(
        rate < 20.0,
        "{ops} store operations in {waited:.1} s ({rate:.0}/s) while another replica held the lock"
    );
    assert!(
        !replica.has_real_cert(&host),
        "ordered while another replica held the lock"
    );
    assert_eq!(
        lock.current().await.unwrap().map(|r| r.fence),
        Some(lease.fence),
        "the live lease was not taken over"
    );

    // Soon after it expires, the certificate is ordered.
    eventually(
        Duration::from_secs(60),
        "the certificate ordered after the lease expired",
        || {
            let done = replica.has_real_cert(&host);
            async move { done }
        },
    )
    .await;
    let after = expires.elapsed();
    assert!(
        after < Duration::from_secs(30),
        "ordered {after:?} after the lease expired"
    );
    assert_eq!(replica.orders("issued"), 1.0);
    replica.stop().await;
}

#[tokio::test]
async fn a_restarted_pod_takes_over_its_own_previous_lease() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let ip = Ipv4Addr::new(127, 0, 43, 2);
    let responder_ip = Ipv4Addr::new(127, 0, 43, 12);
    let host = unique_host("restart");
    pebble.add_a(&host, responder_ip).await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let _responder = serve_responder(
        ChallengeBook::new(store.clone(), Arc::new(Metrics::new())),
        responder_ip,
        pebble.http_port,
    )
    .await;
    // This pod's previous process died holding the lease (kill -9 during
    // an order): a long one, that would block the host for 10 minutes.
    let lock = LeaseLock::new(store.clone(), &CertUnit::per_host(&host).lock_name());
    let old = lock
        .try_acquire("faults-restart/0123abcd", Duration::from_secs(600))
        .await
        .unwrap()
        .expect("a fresh lock");
    let replica = Replica::start(
        "faults-restart",
        ip,
        &store,
        config(
            &pebble.directory,
            &pebble.ca_root,
            std::slice::from_ref(&host),
        ),
    )
    .await;
    eventually(
        Duration::from_secs(45),
        "the restarted pod orders at once, over its own previous lease",
        || {
            let done = replica.has_real_cert(&host);
            async move { done }
        },
    )
    .await;
    let record = lock.current().await.unwrap().expect("the lock record");
    assert!(
        record.fence > old.fence,
        "the takeover bumps the fence: {record:?}"
    );
    assert!(
        record.holder.starts_with("faults-restart/") && record.holder != old.holder,
        "held by the new process: {record:?}"
    );
    replica.stop().await;
}

#[tokio::test]
async fn the_next_owner_honours_the_shared_backoff() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let host = unique_host("backoff");
    // Its validation goes where nothing listens: every order fails.
    pebble.add_a(&host, NOWHERE).await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let cfg = config(
        &pebble.directory,
        &pebble.ca_root,
        std::slice::from_ref(&host),
    );

    // Node A orders it, and fails.
    let a = Replica::start(
        "faults-a",
        Ipv4Addr::new(127, 0, 43, 3),
        &store,
        cfg.clone(),
    )
    .await;
    eventually(Duration::from_secs(90), "A's order failed", || {
        let n = a.orders("failed");
        async move { n >= 1.0 }
    })
    .await;
    let first = shared_state(&store, &pebble.directory, &host)
        .await
        .expect("the failure is recorded in the store, for every replica");
    assert_eq!(first.failures.count, 1, "{first:?}");
    let not_before = first.failures.next_attempt_unix();
    // A goes away; B becomes the owner, with nothing in memory.
    a.stop().await;
    let b = Replica::start("faults-b", Ipv4Addr::new(127, 0, 43, 4), &store, cfg).await;

    // B tries again only once the backoff has elapsed.
    eventually(
        Duration::from_secs(150),
        "B ordered once the backoff elapsed",
        || {
            let n = b.orders("failed");
            async move { n >= 1.0 }
        },
    )
    .await;
    let second = shared_state(&store, &pebble.directory, &host)
        .await
        .expect("the shared record");
    assert_eq!(
        second.failures.count, 2,
        "B's failure adds to A's: {second:?}"
    );
    assert!(
        second.failures.last_failure_unix >= not_before,
        "B ordered at {} before the shared backoff ended at {not_before}",
        second.failures.last_failure_unix
    );
    assert!(
        second.failures.next_attempt_unix() >= second.failures.last_failure_unix + 120,
        "the backoff doubled: {second:?}"
    );
    b.stop().await;
}

#[tokio::test]
async fn an_unreadable_issuance_history_places_no_order() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let responder_ip = Ipv4Addr::new(127, 0, 43, 15);
    let host = unique_host("guard");
    pebble.add_a(&host, responder_ip).await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let _responder = serve_responder(
        ChallengeBook::new(store.clone(), Arc::new(Metrics::new())),
        responder_ip,
        pebble.http_port,
    )
    .await;
    let dir = layout::directory_id(&pebble.directory);
    let history = layout::issued(&dir, &layout::hostname_set_id(std::slice::from_ref(&host)));
    store
        .put(&history, b"{ not an issuance history", None)
        .await
        .unwrap();
    let replica = Replica::start(
        "faults-guard",
        Ipv4Addr::new(127, 0, 43, 5),
        &store,
        config(
            &pebble.directory,
            &pebble.ca_root,
            std::slice::from_ref(&host),
        ),
    )
    .await;
    eventually(
        Duration::from_secs(90),
        "an attempt that ended (refused by the guard, or issued)",
        || {
            let n = replica.orders("failed") + replica.orders("issued");
            async move { n >= 1.0 }
        },
    )
    .await;
    assert_eq!(replica.orders("issued"), 0.0, "an order went out unguarded");
    assert!(!replica.has_real_cert(&host));
    assert!(
        store
            .get(&layout::certificate(&host))
            .await
            .unwrap()
            .is_none(),
        "no certificate was stored"
    );
    let budget = store.get(&layout::order_budget(&dir)).await.unwrap();
    assert!(budget.is_none(), "no order was counted: {budget:?}");
    replica.stop().await;
}

#[tokio::test]
async fn attempts_that_never_reach_the_ca_spend_no_budget() {
    // A directory where nothing listens: every attempt fails before the CA.
    let closed = std::net::TcpListener::bind("127.0.43.6:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let directory = format!("https://127.0.43.6:{port}/dir");
    let ca_root = tempfile::NamedTempFile::new().unwrap();
    // Any PEM certificate will do as the (never used) trust anchor.
    let (chain, _) =
        sbmesh::internal::placeholder::generate(&["ca.test".to_owned()], 1_800_000_000)
            .expect("a certificate");
    std::fs::write(ca_root.path(), chain).unwrap();
    let hosts: Vec<String> = (0..40).map(|i| format!("h{i}.budget.test")).collect();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let replica = Replica::start(
        "faults-budget",
        Ipv4Addr::new(127, 0, 43, 6),
        &store,
        config(&directory, ca_root.path(), &hosts),
    )
    .await;
    eventually(
        Duration::from_secs(60),
        "every host's first attempt failed",
        || {
            let done = replica.orders("failed") >= hosts.len() as f64;
            async move { done }
        },
    )
    .await;
    let key = layout::order_budget(&layout::directory_id(&directory));
    let used = match store.get(&key).await.unwrap() {
        None => 0,
        Some(entry) => {
            serde_json::from_slice::<OrderBudget>(&entry.value)
                .expect("a budget record")
                .used
        }
    };
    assert_eq!(
        used,
        0,
        "{} attempts that never reached the CA spent the order budget",
        hosts.len()
    );
    replica.stop().await;
}

/// A CA whose directory, nonces and accounts answer, but whose newOrder URL
/// is a port where nothing listens: every order fails before it reaches
/// the CA, after the budget was taken. Returns the directory URL.
async fn ca_without_new_order(ip: Ipv4Addr) -> (String, tokio::task::JoinHandle<()>) {
    use axum::http::{StatusCode, header};
    use axum::routing::{get, post};
    let closed = std::net::TcpListener::bind((ip, 0)).unwrap();
    let closed_port = closed.local_addr().unwrap().port();
    drop(closed);
    let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let nonce = || [(header::HeaderName::from_static("replay-nonce"), "bm9uY2U")];
    let directory = serde_json::json!({
        "newNonce": format!("{base}/nonce"),
        "newAccount": format!("{base}/account"),
        "newOrder": format!("http://{ip}:{closed_port}/order"),
    });
    let account = format!("{base}/acct/1");
    let app = axum::Router::new()
        .route(
            "/dir",
            get(move || {
                let d = directory.clone();
                async move { axum::Json(d) }
            }),
        )
        .route(
            "/nonce",
            get(move || async move { (StatusCode::OK, nonce()) })
                .head(move || async move { (StatusCode::OK, nonce()) }),
        )
        .route(
            "/account",
            post(move || {
                let location = account.clone();
                async move {
                    (
                        StatusCode::CREATED,
                        [
                            (
                                header::HeaderName::from_static("replay-nonce"),
                                "bm9uY2U".to_owned(),
                            ),
                            (header::LOCATION, location),
                        ],
                        axum::Json(serde_json::json!({"status": "valid"})),
                    )
                }
            }),
        );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("{base}/dir"), task)
}

#[tokio::test]
async fn a_new_order_that_never_reached_the_ca_gives_its_budget_back() {
    let ip = Ipv4Addr::new(127, 0, 43, 7);
    let (directory, _ca) = ca_without_new_order(ip).await;
    let hosts: Vec<String> = (0..10).map(|i| format!("h{i}.neworder.test")).collect();
    let mut text = format!(
        "proxy:\n  extensions:\n    sbmesh:\n      acme:\n        enabled: true\n        \
         directory_url: {directory}\n        storage_backend: memory\norigins:\n"
    );
    for h in &hosts {
        text.push_str(&format!("  \"{h}\": {{}}\n"));
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let replica = Replica::start(
        "faults-neworder",
        Ipv4Addr::new(127, 0, 43, 8),
        &store,
        Arc::new(sbmesh::parse_config(&text).expect("a valid config")),
    )
    .await;
    eventually(
        Duration::from_secs(60),
        "every host's first attempt failed",
        || {
            let done = replica.orders("failed") >= hosts.len() as f64;
            async move { done }
        },
    )
    .await;
    let key = layout::order_budget(&layout::directory_id(&directory));
    let budget: OrderBudget = serde_json::from_slice(
        &store
            .get(&key)
            .await
            .unwrap()
            .expect("the budget was taken (the account was ready)")
            .value,
    )
    .expect("a budget record");
    assert_eq!(
        budget.used,
        0,
        "{} newOrder requests that never reached the CA spent the budget: {budget:?}",
        hosts.len()
    );
    replica.stop().await;
}

/// What the ARI-speaking fake CA saw.
#[derive(Default)]
struct AriCaLog {
    /// newOrder requests: (identifiers, `replaces` field).
    orders: Vec<(Vec<String>, Option<String>)>,
    /// renewalInfo requests: the certificate ids asked about.
    ari_asked: Vec<String>,
}

/// A CA that offers ARI: it serves its directory, nonces and accounts,
/// answers renewalInfo with a window in the past ("renew now") and a
/// `Retry-After` of an hour, and refuses every newOrder (503) after
/// noting what it asked for.
async fn ca_with_ari(
    ip: Ipv4Addr,
) -> (
    String,
    Arc<std::sync::Mutex<AriCaLog>>,
    tokio::task::JoinHandle<()>,
) {
    use axum::extract::Path as UrlPath;
    use axum::http::{StatusCode, header};
    use axum::routing::{get, post};
    use base64::Engine as _;
    let listener = tokio::net::TcpListener::bind((ip, 0)).await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let log = Arc::new(std::sync::Mutex::new(AriCaLog::default()));
    let nonce = header::HeaderName::from_static("replay-nonce");
    let directory = serde_json::json!({
        "newNonce": format!("{base}/nonce"),
        "newAccount": format!("{base}/account"),
        "newOrder": format!("{base}/order"),
        "renewalInfo": format!("{base}/ari"),
    });
    let account = format!("{base}/acct/1");
    let (n1, n2, n3, n4) = (nonce.clone(), nonce.clone(), nonce.clone(), nonce.clone());
    let (orders_log, ari_log) = (log.clone(), log.clone());
    let app = axum::Router::new()
        .route(
            "/dir",
            get(move || {
                let d = directory.clone();
                async move { axum::Json(d) }
            }),
        )
        .route(
            "/nonce",
            get(move || async move { (StatusCode::OK, [(n1, "bm9uY2U")]) })
                .head(move || async move { (StatusCode::OK, [(n2, "bm9uY2U")]) }),
        )
        .route(
            "/account",
            post(move || {
                let location = account.clone();
                async move {
                    (
                        StatusCode::CREATED,
                        [(n3, "bm9uY2U".to_owned()), (header::LOCATION, location)],
                        axum::Json(serde_json::json!({"status": "valid"})),
                    )
                }
            }),
        )
        .route(
            "/order",
            post(move |body: axum::body::Bytes| async move {
                let jws: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                let payload = jws["payload"].as_str().unwrap_or_default();
                let payload: serde_json::Value = base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(payload)
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
                    .unwrap_or_default();
                let ids = payload["identifiers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|i| i["value"].as_str().map(str::to_owned))
                    .collect();
                let replaces = payload["replaces"].as_str().map(str::to_owned);
                orders_log.lock().unwrap().orders.push((ids, replaces));
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [(n4, "bm9uY2U"), (header::CONTENT_TYPE, "application/problem+json")],
                    r#"{"type":"urn:ietf:params:acme:error:serverInternal","detail":"not today","status":503}"#,
                )
            }),
        )
        .route(
            "/ari/{id}",
            get(move |UrlPath(id): UrlPath<String>| async move {
                ari_log.lock().unwrap().ari_asked.push(id);
                (
                    StatusCode::OK,
                    [(header::RETRY_AFTER, "3600")],
                    axum::Json(serde_json::json!({
                        "suggestedWindow": {
                            "start": "2020-01-01T00:00:00Z",
                            "end": "2020-01-02T00:00:00Z"
                        }
                    })),
                )
            }),
        );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("{base}/dir"), log, task)
}

/// A certificate for `host` from a throwaway CA, with the authority key
/// identifier ARI names it by: (chain PEM, key PEM).
fn ari_certificate(host: &str) -> (String, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.clone().self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec![host.to_owned()]).unwrap();
    params.use_authority_key_identifier_extension = true;
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(89);
    let leaf = params.signed_by(&key, &issuer).unwrap();
    (
        format!("{}{}", leaf.pem(), ca_cert.pem()),
        key.serialize_pem(),
    )
}

#[tokio::test]
async fn a_renewal_asked_for_by_ari_names_the_certificate_it_replaces() {
    use sbmesh::internal::certs::CertRecord;
    use sbmesh::internal::issuer::certificate_identifier;
    let (directory, ca, _task) = ca_with_ari(Ipv4Addr::new(127, 0, 43, 9)).await;
    let renewed = "renew.ari.test".to_owned();
    // A second origin without a certificate: its order builds the issuer.
    let fresh = "fresh.ari.test".to_owned();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    // The stored certificate of `renewed`, valid for 89 more days.
    let (chain, key_pem) = ari_certificate(&renewed);
    let facts = parse_chain(&chain).unwrap();
    let record = CertRecord {
        host: renewed.clone(),
        hosts: facts.dns_names.clone(),
        chain_pem: chain.clone(),
        key_pem,
        not_before_unix: facts.not_before_unix,
        not_after_unix: facts.not_after_unix,
        serial: facts.serial.clone(),
        issued_at_unix: facts.not_before_unix,
        issued_by: "earlier".into(),
    };
    let unit = CertUnit::per_host(&renewed);
    let lock = LeaseLock::new(store.clone(), &unit.lock_name());
    let lease = lock
        .try_acquire("earlier/0", Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();
    let value = record.encode(None, &unit.store_key()).unwrap();
    put_fenced(store.as_ref(), &unit.store_key(), &value, &lease)
        .await
        .unwrap();
    lock.release(&lease).await.unwrap();
    let ari_id = certificate_identifier(&chain).unwrap().to_string();

    let text = format!(
        "proxy:\n  extensions:\n    sbmesh:\n      acme:\n        enabled: true\n        \
         directory_url: {directory}\n        storage_backend: memory\norigins:\n  \
         \"{renewed}\": {{}}\n  \"{fresh}\": {{}}\n"
    );
    let replica = Replica::start(
        "faults-ari",
        Ipv4Addr::new(127, 0, 43, 10),
        &store,
        Arc::new(sbmesh::parse_config(&text).expect("a valid config")),
    )
    .await;
    eventually(
        Duration::from_secs(60),
        "the renewal the CA asked for was ordered",
        || {
            let done = ca
                .lock()
                .unwrap()
                .orders
                .iter()
                .any(|(ids, _)| ids.contains(&renewed));
            async move { done }
        },
    )
    .await;
    let (asked, replaces) = {
        let log = ca.lock().unwrap();
        let replaces: Vec<Option<String>> = log
            .orders
            .iter()
            .filter(|(ids, _)| ids.contains(&renewed))
            .map(|(_, r)| r.clone())
            .collect();
        (log.ari_asked.clone(), replaces)
    };
    assert_eq!(
        asked,
        vec![ari_id.clone()],
        "asked about the stored certificate once"
    );
    assert_eq!(
        replaces[0].as_deref(),
        Some(ari_id.as_str()),
        "the renewal names the certificate it replaces"
    );
    // The CA's answer and its Retry-After are shared with every replica.
    let state = shared_state(&store, &directory, &renewed)
        .await
        .expect("the shared state of the renewed certificate");
    let ari = state.ari.expect("the CA's answer is shared");
    assert_eq!(ari.serial, facts.serial);
    let now = sbmesh::now_unix_ms() / 1000;
    assert!(
        ari.next_check_unix > now + 3500 && ari.next_check_unix <= now + 3600,
        "not asked again before the CA's Retry-After of an hour: {ari:?}"
    );
    replica.stop().await;
}

/// Fenced writes of one key fail a number of times first (the store
/// restarting just as the CA's certificate arrives).
struct CertWriteFails {
    key: String,
    fails_left: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl Hook for CertWriteFails {
    async fn before(&self, op: Op, key: &str) -> Result<(), StoreError> {
        let failing = op == Op::PutFenced
            && key == self.key
            && self
                .fails_left
                .fetch_update(
                    std::sync::atomic::Ordering::SeqCst,
                    std::sync::atomic::Ordering::SeqCst,
                    |n| n.checked_sub(1),
                )
                .is_ok();
        if failing {
            return Err(store_hook::unreachable(
                "memory",
                "connection reset (the store restarting)",
            ));
        }
        Ok(())
    }
}

/// The store does not take the CA's certificate at first (it restarts as
/// the certificate arrives): the certificate is kept and written once the
/// store answers, not lost and ordered again: one order, issued, none failed.
#[tokio::test]
async fn a_certificate_the_store_refuses_at_first_is_kept_not_ordered_again() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let responder_ip = Ipv4Addr::new(127, 0, 43, 16);
    let host = unique_host("kept");
    pebble.add_a(&host, responder_ip).await;
    let store: Arc<dyn Store> = Hooked::shared(
        Arc::new(MemoryStore::new()),
        CertWriteFails {
            key: layout::certificate(&host),
            fails_left: std::sync::atomic::AtomicUsize::new(3),
        },
    );
    let _responder = serve_responder(
        ChallengeBook::new(store.clone(), Arc::new(Metrics::new())),
        responder_ip,
        pebble.http_port,
    )
    .await;
    let replica = Replica::start(
        "faults-kept",
        Ipv4Addr::new(127, 0, 43, 6),
        &store,
        config(
            &pebble.directory,
            &pebble.ca_root,
            std::slice::from_ref(&host),
        ),
    )
    .await;
    eventually(
        Duration::from_secs(60),
        "the CA's certificate on disk",
        || {
            let done = replica.has_real_cert(&host);
            async move { done }
        },
    )
    .await;
    assert_eq!(replica.orders("issued"), 1.0, "orders issued");
    assert_eq!(replica.orders("failed"), 0.0, "orders failed");
    assert!(
        store
            .get(&layout::certificate(&host))
            .await
            .unwrap()
            .is_some(),
        "the certificate is in the store"
    );
    replica.stop().await;
}
