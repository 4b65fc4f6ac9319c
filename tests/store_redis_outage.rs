//! The redis store through an outage, against a `redis-server` of its own:
//! killed mid-test, operations fail with an error within the operation
//! timeout (never a panic or a hang); restarted on the same port, they work
//! again without a new store. Also: Redis down at startup, and Redis frozen
//! (SIGSTOP: the connection stays open but nothing answers).

mod redis_server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis_server::RedisServer;
use sbmesh::{RedisStore, Store, StoreError};

const OP_TIMEOUT: Duration = Duration::from_secs(1);
/// What the brief allows on top of the operation timeout.
const SLACK: Duration = Duration::from_secs(1);

async fn store(url: &str) -> Arc<RedisStore> {
    let ns = format!("outage-{:016x}", rand::random::<u64>());
    Arc::new(
        RedisStore::connect(url, OP_TIMEOUT)
            .await
            .expect("connect")
            .with_namespace(&ns)
            .expect("namespace"),
    )
}

/// Every kind of operation once; each must end within the bound. Returns
/// the errors (or `Ok` results as `None`).
async fn every_op(store: &RedisStore) -> Vec<(&'static str, Result<(), StoreError>)> {
    let mut out = Vec::new();
    macro_rules! op {
        ($name:literal, $e:expr) => {{
            let start = Instant::now();
            let r = $e.await.map(|_| ());
            let took = start.elapsed();
            assert!(
                took < OP_TIMEOUT + SLACK,
                "{} took {took:?} (bound {:?}): {r:?}",
                $name,
                OP_TIMEOUT + SLACK
            );
            out.push(($name, r));
        }};
    }
    let v = sbmesh::Version("0".repeat(32));
    op!("get", store.get("certs/a/chain"));
    op!("put", store.put("certs/a/chain", b"chain", None));
    op!(
        "put_if_absent",
        store.put_if_absent("locks/a", b"me", Some(Duration::from_secs(30)))
    );
    op!(
        "compare_and_swap",
        store.compare_and_swap("certs/a/chain", &v, b"x", None)
    );
    op!("delete", store.delete("certs/a/chain"));
    op!("list", store.list("certs/"));
    op!("ping", store.ping());
    out
}

async fn works(store: &RedisStore) {
    let v1 = store.put("certs/a/chain", b"one", None).await.unwrap();
    let e = store.get("certs/a/chain").await.unwrap().unwrap();
    assert_eq!((e.value.as_slice(), &e.version), (&b"one"[..], &v1));
    let v2 = store
        .compare_and_swap("certs/a/chain", &v1, b"two", None)
        .await
        .unwrap()
        .expect("swap with the current version");
    assert!(
        store
            .compare_and_swap("certs/a/chain", &v1, b"three", None)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        store.get("certs/a/chain").await.unwrap().unwrap().version,
        v2
    );
    assert_eq!(store.list("certs/").await.unwrap(), vec!["certs/a/chain"]);
    assert!(store.delete("certs/a/chain").await.unwrap());
    assert!(store.get("certs/a/chain").await.unwrap().is_none());
    store.ping().await.unwrap();
}

/// Polls until `works` passes (the first operations after a restart may
/// still see the old connection's failure).
async fn recovers(store: &RedisStore, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        match store.ping().await {
            Ok(()) => break,
            Err(e) => {
                assert!(Instant::now() < deadline, "not back within {within:?}: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    works(store).await;
}

fn assert_all_failed(results: &[(&str, Result<(), StoreError>)]) {
    for (name, r) in results {
        match r {
            Err(StoreError::Timeout { .. } | StoreError::Backend { .. }) => {}
            other => panic!("{name} during the outage: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_then_restarted() {
    let Some(bin) = redis_server::binary("killed_then_restarted") else {
        return;
    };
    let mut server = RedisServer::start(&bin);
    let store = store(&server.url()).await;
    works(&store).await;
    store.put("certs/b/chain", b"kept?", None).await.unwrap();

    server.kill();
    // Several rounds: the first sees the dropped connection, later ones the
    // reconnect attempts.
    for _ in 0..3 {
        assert_all_failed(&every_op(&store).await);
    }
    // Concurrent callers all get their error in time too.
    let start = Instant::now();
    let calls: Vec<_> = (0..16)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move { store.get(&format!("certs/{i}/chain")).await })
        })
        .collect();
    for call in calls {
        assert!(call.await.expect("no panic").is_err());
    }
    assert!(
        start.elapsed() < OP_TIMEOUT + SLACK,
        "{:?}",
        start.elapsed()
    );
    let err = store.get("certs/a/chain").await.unwrap_err().to_string();
    assert!(
        err.contains(&format!("127.0.0.1:{}", server.port)) || err.contains("timed out"),
        "the error names the server or the timeout: {err}"
    );

    server.restart();
    recovers(&store, Duration::from_secs(15)).await;
    // No persistence: the restarted server is empty, and says so.
    assert!(store.get("certs/b/chain").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn down_at_startup() {
    let Some(bin) = redis_server::binary("down_at_startup") else {
        return;
    };
    let port = redis_server::free_port();
    let url = format!("127.0.0.1:{port}");
    // Connecting does not need the server.
    let store = store(&url).await;
    assert_all_failed(&every_op(&store).await);

    let _server = RedisServer::start_with(&bin, port, Vec::new());
    recovers(&store, Duration::from_secs(15)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_server_times_out() {
    let Some(bin) = redis_server::binary("frozen_server_times_out") else {
        return;
    };
    let server = RedisServer::start(&bin);
    let store = store(&server.url()).await;
    works(&store).await;

    server.signal("STOP");
    let results = every_op(&store).await;
    server.signal("CONT");
    assert_all_failed(&results);
    assert!(
        results
            .iter()
            .any(|(_, r)| matches!(r, Err(StoreError::Timeout { .. }))),
        "a server that accepts but never answers ends in timeouts: {results:?}"
    );
    recovers(&store, Duration::from_secs(15)).await;
}
