//! The ACME manager in `certificates: san` mode against a real Pebble
//! (`scripts/test` starts it; without its variables the test prints SKIP,
//! or fails when SBMESH_TEST_REQUIRE_SERVERS=1), one replica on a memory
//! store with a mesh of its own:
//!
//! - before any certificate exists, `<cert-dir>/tls.crt` is a self-signed
//!   placeholder naming the three origins, shown as `placeholder: true` in
//!   status, and writing it hands nothing to the proxy;
//! - then the CA's certificate for the three names replaces it (one order
//!   for all names, each authorization answered through the challenge
//!   book), verifies against Pebble's root for every name, and is handed to
//!   the proxy once; status lists all names;
//! - adding a fourth origin orders exactly one new certificate for the four
//!   names (one issuance in the store's history of that set, none more for
//!   the old set), and the old certificate is served until the new one is
//!   written (the file is never a placeholder again, never half a set).
//!
//! And in `per_host` mode: each host gets its placeholder in
//! `<cert-dir>/<host>/`, then its own certificate from the CA there.
//!
//! The responders bind 127.0.42.2 and .4, the meshes .1 and .3, so this runs in
//! parallel with the issuer tests (127.0.41.x) against one Pebble.

mod acme_ca;
mod object_servers;

use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sbmesh::internal::certs::parse_chain;
use sbmesh::internal::challenge::ChallengeBook;
use sbmesh::internal::layout;
use sbmesh::internal::manager::{AcmeInputs, AcmeManager, AcmeManagerConfig};
use sbmesh::internal::placeholder::is_placeholder;
use sbmesh::internal::schedule::IssuanceHistory;
use sbmesh::{MemoryStore, Mesh, MeshConfig, Metrics, NodeMeta, SbConfig, Store};
use tokio::sync::watch;

use acme_ca::{Pebble, eventually, serve_responder, unique_host, verify_issued};

const MESH_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 42, 1);
const RESPONDER_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 42, 2);
const PER_HOST_MESH_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 42, 3);
const PER_HOST_RESPONDER_IP: Ipv4Addr = Ipv4Addr::new(127, 0, 42, 4);

fn config(pebble: &Pebble, origins: &[String]) -> Arc<SbConfig> {
    config_in(pebble, origins, "san")
}

fn config_in(pebble: &Pebble, origins: &[String], mode: &str) -> Arc<SbConfig> {
    let mut text = format!(
        "proxy:\n  extensions:\n    sbmesh:\n      acme:\n        enabled: true\n        \
         email: ops@sbmesh.test\n        directory_url: {}\n        ca_root: {}\n        \
         storage_backend: memory\n        certificates: {mode}\norigins:\n",
        pebble.directory,
        pebble.ca_root.display()
    );
    for origin in origins {
        text.push_str(&format!("  \"{origin}\": {{}}\n"));
    }
    Arc::new(sbmesh::parse_config(&text).expect("a valid config"))
}

async fn alone(node: &str, ip: Ipv4Addr, metrics: &Arc<Metrics>) -> Mesh {
    let mut cfg = MeshConfig::new(node, "san-test", vec![[0x24; 32]]);
    cfg.bind = ip.into();
    (cfg.gossip_port, cfg.transport_port, cfg.seeds.gossip_port) = (0, 0, 0);
    Mesh::start(cfg, metrics.clone(), NodeMeta::default())
        .await
        .expect("mesh starts")
}

/// The names of the certificate in `<dir>/tls.crt`, sorted, and whether it
/// is a placeholder; `None` while there is none.
fn on_disk(dir: &Path) -> Option<(Vec<String>, bool, String)> {
    let chain = std::fs::read_to_string(dir.join("tls.crt")).ok()?;
    let facts = parse_chain(&chain).ok()?;
    let mut names = facts.dns_names;
    names.sort();
    Some((names, is_placeholder(&chain), facts.serial))
}

async fn issuances(store: &Arc<dyn Store>, directory: &str, names: &[String]) -> usize {
    let key = layout::issued(
        &layout::directory_id(directory),
        &layout::hostname_set_id(names),
    );
    match store.get(&key).await.expect("store answers") {
        Some(entry) => serde_json::from_slice::<IssuanceHistory>(&entry.value)
            .expect("issuance history")
            .issued_unix
            .len(),
        None => 0,
    }
}

#[tokio::test]
async fn san_mode_orders_one_certificate_for_all_origins_and_again_when_they_change() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let mut three: Vec<String> = (0..3).map(|i| unique_host(&format!("san{i}"))).collect();
    three.sort();
    for host in &three {
        pebble.add_a(host, RESPONDER_IP).await;
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(store.clone(), metrics.clone());
    let _responder = serve_responder(book.clone(), RESPONDER_IP, pebble.http_port).await;
    let mesh = alone("san-0", MESH_IP, &metrics).await;
    let certs = tempfile::tempdir().unwrap();
    let (config_tx, config_rx) = watch::channel(config(&pebble, &three));
    let changed = Arc::new(AtomicUsize::new(0));
    let mut cfg = AcmeManagerConfig::new("san-0", certs.path());
    cfg.settle = Duration::from_millis(500);
    let manager = AcmeManager::spawn(
        cfg,
        AcmeInputs {
            store: store.clone(),
            mesh: mesh.clone(),
            metrics: metrics.clone(),
            config: config_rx,
            certificates_changed: {
                let changed = changed.clone();
                Arc::new(move || {
                    changed.fetch_add(1, Ordering::SeqCst);
                })
            },
            book,
        },
    );
    let status = manager.status();

    // 1. A placeholder for the three names, at once (an order takes at
    //    least the 1 s the mesh view must hold still).
    eventually(Duration::from_secs(5), "a placeholder in tls.crt", || {
        let got = on_disk(certs.path());
        async move { got.is_some() }
    })
    .await;
    let (names, placeholder, _) = on_disk(certs.path()).unwrap();
    assert!(placeholder, "the first file is the placeholder");
    assert_eq!(names, three);
    assert!(certs.path().join("tls.key").exists());
    {
        let s = status.borrow();
        assert_eq!(s.certificates.len(), 1, "{s:?}");
        assert!(s.certificates[0].placeholder);
        assert_eq!(s.certificates[0].names, three);
        assert_eq!(s.certificates[0].host, three[0]);
    }
    assert_eq!(
        changed.load(Ordering::SeqCst),
        0,
        "a placeholder is not handed to the proxy as a new certificate"
    );

    // 2. The CA's certificate for the three names replaces it.
    eventually(
        Duration::from_secs(90),
        "the CA's certificate for 3 names",
        || {
            let got = on_disk(certs.path());
            async move { got.is_some_and(|(_, placeholder, _)| !placeholder) }
        },
    )
    .await;
    let chain = std::fs::read_to_string(certs.path().join("tls.crt")).unwrap();
    let key = std::fs::read_to_string(certs.path().join("tls.key")).unwrap();
    let root = pebble.root_pem().await;
    verify_issued(&chain, &key, &root, &three);
    let (_, _, first_serial) = on_disk(certs.path()).unwrap();
    eventually(Duration::from_secs(5), "the proxy told once", || {
        let n = changed.load(Ordering::SeqCst);
        async move { n == 1 }
    })
    .await;
    {
        let s = status.borrow();
        let info = &s.certificates[0];
        assert!(!info.placeholder, "{s:?}");
        assert_eq!(info.names, three);
        assert_eq!(info.host, three[0]);
        assert_eq!(info.serial, first_serial);
    }
    assert_eq!(issuances(&store, &pebble.directory, &three).await, 1);
    assert_eq!(store.list(layout::SAN_PREFIX).await.unwrap().len(), 1);

    // 3. A fourth origin: one new certificate for the four names; the old
    //    one is served meanwhile.
    let fourth = unique_host("san3");
    pebble.add_a(&fourth, RESPONDER_IP).await;
    let mut four = three.clone();
    four.push(fourth.clone());
    four.sort();
    config_tx.send(config(&pebble, &four)).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let (names, placeholder, _) = on_disk(certs.path()).expect("tls.crt stays");
        assert!(!placeholder, "no placeholder over a real certificate");
        if names == four {
            break;
        }
        assert_eq!(names, three, "the old certificate until the new one");
        assert!(
            tokio::time::Instant::now() < deadline,
            "no certificate for 4 names within 90 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let chain = std::fs::read_to_string(certs.path().join("tls.crt")).unwrap();
    let key = std::fs::read_to_string(certs.path().join("tls.key")).unwrap();
    verify_issued(&chain, &key, &root, &four);
    // Let the manager run a dozen more passes: nothing more is ordered.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(issuances(&store, &pebble.directory, &four).await, 1);
    assert_eq!(issuances(&store, &pebble.directory, &three).await, 1);
    assert_eq!(store.list(layout::SAN_PREFIX).await.unwrap().len(), 2);
    assert_eq!(changed.load(Ordering::SeqCst), 2);
    {
        let s = status.borrow();
        assert_eq!(s.certificates.len(), 1, "{s:?}");
        assert_eq!(s.certificates[0].names, four);
        assert!(!s.certificates[0].placeholder);
    }
    for host in &four {
        pebble.clear_a(host).await;
    }
    drop(manager);
    mesh.leave().await;
}

#[tokio::test]
async fn per_host_mode_writes_a_placeholder_per_host_then_its_certificate() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let mut hosts: Vec<String> = (0..2).map(|i| unique_host(&format!("ph{i}"))).collect();
    hosts.sort();
    for host in &hosts {
        pebble.add_a(host, PER_HOST_RESPONDER_IP).await;
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(store.clone(), metrics.clone());
    let _responder = serve_responder(book.clone(), PER_HOST_RESPONDER_IP, pebble.http_port).await;
    let mesh = alone("ph-0", PER_HOST_MESH_IP, &metrics).await;
    let certs = tempfile::tempdir().unwrap();
    let (_config_tx, config_rx) = watch::channel(config_in(&pebble, &hosts, "per_host"));
    let mut cfg = AcmeManagerConfig::new("ph-0", certs.path());
    cfg.settle = Duration::from_millis(500);
    let manager = AcmeManager::spawn(
        cfg,
        AcmeInputs {
            store: store.clone(),
            mesh: mesh.clone(),
            metrics: metrics.clone(),
            config: config_rx,
            certificates_changed: Arc::new(|| {}),
            book,
        },
    );
    let status = manager.status();
    eventually(Duration::from_secs(5), "a placeholder per host", || {
        let got: Vec<_> = hosts
            .iter()
            .map(|h| on_disk(&certs.path().join(h)))
            .collect();
        async move { got.iter().all(Option::is_some) }
    })
    .await;
    for host in &hosts {
        let (names, placeholder, _) = on_disk(&certs.path().join(host)).unwrap();
        assert!(placeholder, "{host}: the first file is the placeholder");
        assert_eq!(names, vec![host.clone()]);
    }
    assert!(
        !certs.path().join("tls.crt").exists(),
        "per_host writes no SAN pair"
    );
    eventually(
        Duration::from_secs(90),
        "the CA's certificate per host",
        || {
            let got: Vec<_> = hosts
                .iter()
                .map(|h| on_disk(&certs.path().join(h)))
                .collect();
            async move { got.iter().all(|g| g.as_ref().is_some_and(|(_, p, _)| !p)) }
        },
    )
    .await;
    let root = pebble.root_pem().await;
    for host in &hosts {
        let dir = certs.path().join(host);
        let chain = std::fs::read_to_string(dir.join("tls.crt")).unwrap();
        let key = std::fs::read_to_string(dir.join("tls.key")).unwrap();
        verify_issued(&chain, &key, &root, std::slice::from_ref(host));
    }
    eventually(
        Duration::from_secs(5),
        "status without placeholders",
        || {
            let s = status.borrow().clone();
            async move {
                s.certificates.len() == 2
                    && s.certificates
                        .iter()
                        .all(|c| !c.placeholder && c.names.is_empty())
            }
        },
    )
    .await;
    for host in &hosts {
        pebble.clear_a(host).await;
    }
    drop(manager);
    mesh.leave().await;
}
