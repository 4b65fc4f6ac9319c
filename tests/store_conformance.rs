//! One conformance suite for every [`Store`] backend: the same checks (in
//! [`checks`]) run against each, instantiated by [`backend_suite!`].
//!
//! Local backends (memory, redb, file) always run. Server backends read
//! their endpoint from the environment (`scripts/test` starts the servers
//! and sets the variables); without it a test prints `SKIP` and passes,
//! unless `SBMESH_TEST_REQUIRE_SERVERS=1`, when it fails instead.
//!
//! Every check works under a fresh random key namespace, so checks can run
//! in parallel against one shared server.

use std::sync::Arc;
use std::time::Duration;

mod object_servers;

use object_servers::{require_servers, server_env};

use sbmesh::{
    FileStore, Lease, LeaseLock, MAX_KEY_LEN, MAX_VALUE_BYTES, MemoryStore, RedbStore, Store,
    StoreError, Version, get_fenced, now_unix_ms, put_fenced,
};

/// A store under test and whatever must outlive it (a temp directory).
struct Fixture {
    store: Arc<dyn Store>,
    _dir: Option<tempfile::TempDir>,
}

impl From<Arc<dyn Store>> for Fixture {
    fn from(store: Arc<dyn Store>) -> Self {
        Self { store, _dir: None }
    }
}

// ---------------------------------------------------------------------------
// Constructors, one per backend.
// ---------------------------------------------------------------------------

async fn memory_store() -> Option<Fixture> {
    Some(Fixture::from(Arc::new(MemoryStore::new()) as Arc<dyn Store>))
}

async fn redb_store() -> Option<Fixture> {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = RedbStore::open(dir.path()).await.expect("open redb store");
    Some(Fixture {
        store: Arc::new(store),
        _dir: Some(dir),
    })
}

async fn file_store() -> Option<Fixture> {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = FileStore::open(dir.path().join("store"))
        .await
        .expect("open file store");
    Some(Fixture {
        store: Arc::new(store),
        _dir: Some(dir),
    })
}

/// Redis at `SBMESH_TEST_REDIS_URL` (`redis://127.0.0.1:P/0`), under a
/// random key namespace per check, so one database serves them all.
async fn redis_store() -> Option<Arc<dyn Store>> {
    let url = server_env("SBMESH_TEST_REDIS_URL")?;
    let namespace = format!("conformance-{:016x}", rand::random::<u64>());
    let store = sbmesh::RedisStore::connect(&url, Duration::from_secs(5))
        .await
        .expect("redis store")
        .with_namespace(&namespace)
        .expect("namespace");
    Some(Arc::new(store))
}

/// S3 (moto) at `SBMESH_TEST_S3_ENDPOINT`, in a new bucket per check.
async fn s3_store() -> Option<Arc<dyn Store>> {
    let endpoint = server_env("SBMESH_TEST_S3_ENDPOINT")?;
    Some(object_servers::s3_store(&endpoint).await)
}

/// Azure Blob (Azurite) at `SBMESH_TEST_AZURE_BLOB_ENDPOINT`, in a new
/// container per check.
async fn azure_store() -> Option<Arc<dyn Store>> {
    let endpoint = server_env("SBMESH_TEST_AZURE_BLOB_ENDPOINT")?;
    Some(object_servers::azure_store(&endpoint).await)
}

/// What a test does when its constructor gave no store.
fn skipped(backend: &str, check: &str) {
    assert!(
        !require_servers(),
        "{backend}: no store for {check} although SBMESH_TEST_REQUIRE_SERVERS=1 \
         (scripts/test starts the servers; is the constructor in tests/store_conformance.rs written?)"
    );
    eprintln!("SKIP {backend}::{check}: backend not available");
}

/// One test per check for one backend.
macro_rules! backend_suite {
    ($backend:ident, $ctor:path) => {
        mod $backend {
            use super::*;
            backend_suite!(@checks $backend, $ctor;
                round_trip,
                put_returns_new_versions,
                put_if_absent_is_create_only,
                compare_and_swap_needs_the_current_version,
                versions_are_never_reused,
                delete_removes,
                list_is_sorted_by_prefix_without_expired,
                ttl_expires,
                invalid_keys_are_rejected,
                oversized_values_are_rejected,
                cas_counter_eight_workers,
                create_race_has_one_winner,
                fenced_write_checks_both_fences,
                fenced_writers_race_to_the_highest_fence,
                clock_offset_is_the_servers,
            );
        }
    };
    (@checks $backend:ident, $ctor:path; $($check:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                let fixture: Option<Fixture> = $ctor().await.map(Into::into);
                let Some(fixture) = fixture else {
                    skipped(stringify!($backend), stringify!($check));
                    return;
                };
                checks::$check(Arc::clone(&fixture.store)).await;
            }
        )*
    };
}

backend_suite!(memory, memory_store);
backend_suite!(redb, redb_store);
backend_suite!(file, file_store);
// Server backends: their constructors above are filled in by the redis and
// object store engineers.
backend_suite!(redis, redis_store);
backend_suite!(s3, s3_store);
backend_suite!(azure, azure_store);

/// The checks, each taking any store.
mod checks {
    use std::collections::HashSet;
    use std::time::Instant;

    use super::*;

    /// A fresh namespace, so parallel checks on one server never meet.
    fn ns() -> String {
        format!("conformance/t{:016x}", rand::random::<u64>())
    }

    /// Polls until `key` reads as absent (its TTL ran out).
    async fn wait_absent(store: &dyn Store, key: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while store.get(key).await.expect("get").is_some() {
            assert!(
                Instant::now() < deadline,
                "{key} still present 20 s after its TTL"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the wall clock is past `unix_ms` (expiries are wall
    /// clock times).
    async fn wait_past(unix_ms: u64) {
        while now_unix_ms() <= unix_ms + 50 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    const SHORT_TTL: Duration = Duration::from_millis(300);

    pub async fn round_trip(store: Arc<dyn Store>) {
        let ns = ns();
        let key = format!("{ns}/certs/api.example.com/chain");
        assert_eq!(store.get(&key).await.unwrap(), None);

        let v = store.put(&key, b"hello", None).await.unwrap();
        let entry = store.get(&key).await.unwrap().expect("value just put");
        assert_eq!(entry.value, b"hello");
        assert_eq!(entry.version, v);
        assert_eq!(entry.expires_at_unix_ms, None);

        // Any bytes, the empty value and the largest value.
        let binary: Vec<u8> = (0..=255u8).chain(*b"\r\n\0*$1\r\n").collect();
        let largest: Vec<u8> = (0..MAX_VALUE_BYTES).map(|i| (i % 251) as u8).collect();
        for value in [binary, Vec::new(), largest] {
            let v = store.put(&key, &value, None).await.unwrap();
            let entry = store.get(&key).await.unwrap().expect("value just put");
            assert_eq!(entry.value.len(), value.len());
            assert!(
                entry.value == value,
                "value of {} bytes changed",
                value.len()
            );
            assert_eq!(entry.version, v);
        }

        // Valid keys that look like a backend's own names, and a key that
        // is both a record and a prefix of others: none may collide.
        let long_key = {
            let mut k = format!("{ns}/");
            while k.len() + 101 < MAX_KEY_LEN {
                k.push_str(&"s".repeat(100));
                k.push('/');
            }
            k.push_str(&"e".repeat(MAX_KEY_LEN - k.len()));
            k
        };
        assert_eq!(long_key.len(), MAX_KEY_LEN);
        let keys: Vec<String> = [
            "dir",
            "dir/leaf",
            "dir/leaf/deeper",
            ".lock",
            "x.tmp",
            "x.rec",
            "...",
            "-",
            "_",
            "A.b-C_d",
            "dir.lock",
        ]
        .iter()
        .map(|k| format!("{ns}/{k}"))
        .chain([long_key])
        .collect();
        for k in &keys {
            store.put(k, k.as_bytes(), None).await.unwrap();
        }
        for k in &keys {
            let entry = store
                .get(k)
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{k} lost"));
            assert_eq!(entry.value, k.as_bytes(), "{k} holds another key's value");
        }
    }

    pub async fn put_returns_new_versions(store: Arc<dyn Store>) {
        let key = format!("{}/k", ns());
        let v1 = store.put(&key, b"one", None).await.unwrap();
        let v2 = store.put(&key, b"two", None).await.unwrap();
        assert_ne!(v1, v2);
        let entry = store.get(&key).await.unwrap().unwrap();
        assert_eq!((entry.value.as_slice(), &entry.version), (&b"two"[..], &v2));

        // Same bytes again: still a new version.
        let v3 = store.put(&key, b"two", None).await.unwrap();
        assert_ne!(v3, v2);

        // A put without a TTL clears an earlier expiry.
        store
            .put(&key, b"ttl", Some(Duration::from_secs(600)))
            .await
            .unwrap();
        assert!(
            store
                .get(&key)
                .await
                .unwrap()
                .unwrap()
                .expires_at_unix_ms
                .is_some()
        );
        store.put(&key, b"forever", None).await.unwrap();
        assert_eq!(
            store.get(&key).await.unwrap().unwrap().expires_at_unix_ms,
            None
        );
    }

    pub async fn put_if_absent_is_create_only(store: Arc<dyn Store>) {
        let ns = ns();
        let key = format!("{ns}/lock");
        let v = store
            .put_if_absent(&key, b"first", None)
            .await
            .unwrap()
            .expect("created");
        assert_eq!(
            store.put_if_absent(&key, b"second", None).await.unwrap(),
            None
        );
        let entry = store.get(&key).await.unwrap().unwrap();
        assert_eq!(
            (entry.value.as_slice(), &entry.version),
            (&b"first"[..], &v)
        );

        // Absent again after a delete.
        assert!(store.delete(&key).await.unwrap());
        let v2 = store
            .put_if_absent(&key, b"third", None)
            .await
            .unwrap()
            .expect("created after delete");
        assert_ne!(v2, v);

        // An expired record counts as absent.
        let key = format!("{ns}/expiring");
        store.put(&key, b"old", Some(SHORT_TTL)).await.unwrap();
        wait_absent(store.as_ref(), &key).await;
        let v3 = store
            .put_if_absent(&key, b"new", None)
            .await
            .unwrap()
            .expect("created over an expired record");
        let entry = store.get(&key).await.unwrap().unwrap();
        assert_eq!((entry.value.as_slice(), &entry.version), (&b"new"[..], &v3));
        assert_eq!(entry.expires_at_unix_ms, None);
    }

    pub async fn compare_and_swap_needs_the_current_version(store: Arc<dyn Store>) {
        let ns = ns();
        let key = format!("{ns}/cas");
        let v1 = store.put(&key, b"1", None).await.unwrap();
        let v2 = store
            .compare_and_swap(&key, &v1, b"2", None)
            .await
            .unwrap()
            .expect("swap with the current version");
        assert_ne!(v1, v2);
        let entry = store.get(&key).await.unwrap().unwrap();
        assert_eq!((entry.value.as_slice(), &entry.version), (&b"2"[..], &v2));

        // A stale version loses and changes nothing.
        assert_eq!(
            store.compare_and_swap(&key, &v1, b"x", None).await.unwrap(),
            None
        );
        // Versions the store never issued lose.
        for bogus in ["", "0", "nonsense", "\"etag\"", "*"] {
            assert_eq!(
                store
                    .compare_and_swap(&key, &Version(bogus.into()), b"x", None)
                    .await
                    .unwrap(),
                None,
                "version {bogus:?} matched"
            );
        }
        assert_eq!(store.get(&key).await.unwrap().unwrap().value, b"2");

        // Another write in between.
        let v3 = store.put(&key, b"3", None).await.unwrap();
        assert_eq!(
            store.compare_and_swap(&key, &v2, b"x", None).await.unwrap(),
            None
        );

        // A delete in between: the swap fails and does not create the key.
        assert!(store.delete(&key).await.unwrap());
        assert_eq!(
            store.compare_and_swap(&key, &v3, b"x", None).await.unwrap(),
            None
        );
        assert_eq!(store.get(&key).await.unwrap(), None);

        // A key that never existed.
        let missing = format!("{ns}/missing");
        assert_eq!(
            store
                .compare_and_swap(&missing, &v3, b"x", None)
                .await
                .unwrap(),
            None
        );
        assert_eq!(store.get(&missing).await.unwrap(), None);

        // Expiry in between.
        let v4 = store.put(&key, b"4", Some(SHORT_TTL)).await.unwrap();
        wait_absent(store.as_ref(), &key).await;
        assert_eq!(
            store.compare_and_swap(&key, &v4, b"x", None).await.unwrap(),
            None
        );
        assert_eq!(store.get(&key).await.unwrap(), None);

        // A swap can set and clear the expiry.
        let v5 = store.put(&key, b"5", None).await.unwrap();
        let v6 = store
            .compare_and_swap(&key, &v5, b"6", Some(Duration::from_secs(600)))
            .await
            .unwrap()
            .expect("swap");
        let entry = store.get(&key).await.unwrap().unwrap();
        assert_eq!(entry.version, v6);
        assert!(entry.expires_at_unix_ms.is_some());
        store
            .compare_and_swap(&key, &v6, b"7", None)
            .await
            .unwrap()
            .expect("swap");
        assert_eq!(
            store.get(&key).await.unwrap().unwrap().expires_at_unix_ms,
            None
        );
    }

    pub async fn versions_are_never_reused(store: Arc<dyn Store>) {
        let key = format!("{}/aba", ns());
        let mut seen = HashSet::new();
        for round in 0..10 {
            let v = store.put(&key, b"same", None).await.unwrap();
            assert!(seen.insert(v.clone()), "version {v} issued twice");
            assert!(store.delete(&key).await.unwrap());
            let v = store
                .put_if_absent(&key, b"same", None)
                .await
                .unwrap()
                .expect("created");
            assert!(seen.insert(v.clone()), "version {v} issued twice");
            assert!(store.delete(&key).await.unwrap(), "round {round}");
        }
        // An old version never matches the re-created key (no ABA).
        store.put(&key, b"same", None).await.unwrap();
        for old in &seen {
            assert_eq!(
                store.compare_and_swap(&key, old, b"x", None).await.unwrap(),
                None,
                "old version {old} matched a re-created key"
            );
        }
    }

    pub async fn delete_removes(store: Arc<dyn Store>) {
        let ns = ns();
        let key = format!("{ns}/d");
        let child = format!("{ns}/d/child");
        assert!(!store.delete(&key).await.unwrap(), "deleted a missing key");
        store.put(&key, b"1", None).await.unwrap();
        store.put(&child, b"2", None).await.unwrap();
        assert!(store.delete(&key).await.unwrap());
        assert_eq!(store.get(&key).await.unwrap(), None);
        assert!(!store.delete(&key).await.unwrap(), "deleted twice");
        // Deleting a key leaves the keys it is a prefix of.
        assert_eq!(store.get(&child).await.unwrap().unwrap().value, b"2");
        assert_eq!(
            store.list(&format!("{ns}/")).await.unwrap(),
            vec![child.clone()]
        );
        assert!(store.delete(&child).await.unwrap());
        assert_eq!(
            store.list(&format!("{ns}/")).await.unwrap(),
            Vec::<String>::new()
        );

        // An expired record is already absent.
        store.put(&key, b"3", Some(SHORT_TTL)).await.unwrap();
        wait_absent(store.as_ref(), &key).await;
        assert!(!store.delete(&key).await.unwrap(), "deleted an expired key");
        assert_eq!(store.get(&key).await.unwrap(), None);
    }

    pub async fn list_is_sorted_by_prefix_without_expired(store: Arc<dyn Store>) {
        let ns = ns();
        let k = |s: &str| format!("{ns}/{s}");
        // Written out of order.
        for key in [
            "b",
            "a/2",
            "a/10",
            "ab",
            "a",
            "a/1",
            "c/deep/er/key",
            "gone",
            "expired",
        ] {
            store.put(&k(key), key.as_bytes(), None).await.unwrap();
        }
        store
            .put(&k("expired"), b"x", Some(SHORT_TTL))
            .await
            .unwrap();
        assert!(store.delete(&k("gone")).await.unwrap());
        wait_absent(store.as_ref(), &k("expired")).await;

        let all = ["a", "a/1", "a/10", "a/2", "ab", "b", "c/deep/er/key"].map(k);
        assert_eq!(store.list(&format!("{ns}/")).await.unwrap(), all);
        // A plain string prefix, not a directory.
        assert_eq!(
            store.list(&k("a")).await.unwrap(),
            ["a", "a/1", "a/10", "a/2", "ab"].map(k)
        );
        assert_eq!(
            store.list(&k("a/")).await.unwrap(),
            ["a/1", "a/10", "a/2"].map(k)
        );
        assert_eq!(store.list(&k("a/1")).await.unwrap(), ["a/1", "a/10"].map(k));
        assert_eq!(store.list(&k("c/")).await.unwrap(), [k("c/deep/er/key")]);
        assert_eq!(store.list(&k("c/de")).await.unwrap(), [k("c/deep/er/key")]);
        assert_eq!(store.list(&k("zzz")).await.unwrap(), Vec::<String>::new());
        assert_eq!(
            store.list(&k("expired")).await.unwrap(),
            Vec::<String>::new()
        );

        // The whole store: ours are there, in order, and it is sorted.
        let everything = store.list("").await.unwrap();
        assert!(everything.is_sorted(), "list(\"\") is not sorted");
        let ours: Vec<&String> = everything
            .iter()
            .filter(|key| key.starts_with(&format!("{ns}/")))
            .collect();
        assert_eq!(ours, all.iter().collect::<Vec<_>>());
    }

    pub async fn ttl_expires(store: Arc<dyn Store>) {
        let ns = ns();
        let key = format!("{ns}/challenge");
        let ttl = Duration::from_secs(3);
        let before = now_unix_ms();
        store.put(&key, b"token", Some(ttl)).await.unwrap();
        let after = now_unix_ms();
        let entry = store
            .get(&key)
            .await
            .unwrap()
            .expect("present before its TTL");
        let expires = entry.expires_at_unix_ms.expect("an expiry");
        let ttl_ms = ttl.as_millis() as u64;
        assert!(
            expires + 1000 >= before + ttl_ms && expires <= after + ttl_ms + 1000,
            "expiry {expires} not about {ttl_ms} ms after {before}..{after}"
        );
        assert_eq!(
            store.list(&format!("{ns}/")).await.unwrap(),
            vec![key.clone()]
        );

        let kept = format!("{ns}/kept");
        store.put(&kept, b"k", None).await.unwrap();
        wait_absent(store.as_ref(), &key).await;
        assert_eq!(
            store.list(&format!("{ns}/")).await.unwrap(),
            vec![kept.clone()]
        );

        // The sweeper removes only what expired.
        store.sweep_expired().await.unwrap();
        assert_eq!(store.get(&key).await.unwrap(), None);
        assert_eq!(store.get(&kept).await.unwrap().unwrap().value, b"k");

        // A TTL from put_if_absent and from compare_and_swap.
        let created = format!("{ns}/created");
        store
            .put_if_absent(&created, b"c", Some(SHORT_TTL))
            .await
            .unwrap()
            .expect("created");
        let swapped = format!("{ns}/swapped");
        let v = store.put(&swapped, b"s", None).await.unwrap();
        store
            .compare_and_swap(&swapped, &v, b"s2", Some(SHORT_TTL))
            .await
            .unwrap()
            .expect("swap");
        wait_absent(store.as_ref(), &created).await;
        wait_absent(store.as_ref(), &swapped).await;

        // Rewriting without a TTL keeps the key past its first expiry.
        let renewed = format!("{ns}/renewed");
        store.put(&renewed, b"r", Some(SHORT_TTL)).await.unwrap();
        let first_expiry = now_unix_ms() + SHORT_TTL.as_millis() as u64;
        store.put(&renewed, b"r2", None).await.unwrap();
        wait_past(first_expiry).await;
        assert_eq!(store.get(&renewed).await.unwrap().unwrap().value, b"r2");
    }

    pub async fn invalid_keys_are_rejected(store: Arc<dyn Store>) {
        let ns = ns();
        let long = "x".repeat(MAX_KEY_LEN + 1);
        let bad_keys = [
            "",
            "/etc/passwd",
            "../etc/passwd",
            "a/../../etc/passwd",
            &format!("{ns}/../escape"),
            "..",
            ".",
            "a/./b",
            "a/",
            "a//b",
            "a\\..\\b",
            "a\r\nSET injected 1",
            "a\nDEL b",
            "a\0b",
            "a b",
            "*",
            "a*",
            "{tag}a",
            "a:b",
            "ü",
            "~",
            "a~rec",
            &long,
        ];
        let v = Version("1".into());
        for key in bad_keys {
            let invalid = |r: Result<(), StoreError>, op: &str| {
                assert!(
                    matches!(r, Err(StoreError::InvalidKey { .. })),
                    "{op}({key:?}) was not refused as an invalid key: {r:?}"
                );
            };
            invalid(store.get(key).await.map(drop), "get");
            invalid(store.put(key, b"x", None).await.map(drop), "put");
            invalid(
                store.put_if_absent(key, b"x", None).await.map(drop),
                "put_if_absent",
            );
            invalid(
                store.compare_and_swap(key, &v, b"x", None).await.map(drop),
                "compare_and_swap",
            );
            invalid(store.delete(key).await.map(drop), "delete");
        }
        for prefix in ["../", "/", "a//", "a\r\n", "*", "a/../"] {
            assert!(
                matches!(store.list(prefix).await, Err(StoreError::InvalidKey { .. })),
                "list({prefix:?}) was not refused"
            );
        }
        // The error tells the accepted form.
        let Err(e) = store.get("../x").await else {
            panic!("accepted");
        };
        assert!(e.to_string().contains("[A-Za-z0-9._-]"), "{e}");
    }

    pub async fn oversized_values_are_rejected(store: Arc<dyn Store>) {
        let key = format!("{}/big", ns());
        let v = store.put(&key, b"small", None).await.unwrap();
        let big = vec![7u8; MAX_VALUE_BYTES + 1];
        let too_large = |r: Result<(), StoreError>, op: &str| {
            assert!(
                matches!(r, Err(StoreError::TooLarge { len, .. }) if len == MAX_VALUE_BYTES + 1),
                "{op} accepted {} bytes: {r:?}",
                MAX_VALUE_BYTES + 1
            );
        };
        too_large(store.put(&key, &big, None).await.map(drop), "put");
        too_large(
            store.compare_and_swap(&key, &v, &big, None).await.map(drop),
            "compare_and_swap",
        );
        let fresh = format!("{key}/fresh");
        too_large(
            store.put_if_absent(&fresh, &big, None).await.map(drop),
            "put_if_absent",
        );
        let entry = store.get(&key).await.unwrap().unwrap();
        assert_eq!(
            (entry.value.as_slice(), &entry.version),
            (&b"small"[..], &v)
        );
        assert_eq!(store.get(&fresh).await.unwrap(), None);
    }

    /// 8 workers each add 125 to one counter by compare-and-swap, retrying
    /// on conflict: a lost update would leave it below 1000.
    pub async fn cas_counter_eight_workers(store: Arc<dyn Store>) {
        const WORKERS: usize = 8;
        const TOTAL: usize = 1000;
        let key = format!("{}/counter", ns());
        store.put_if_absent(&key, b"0", None).await.unwrap();
        let workers: Vec<_> = (0..WORKERS)
            .map(|_| {
                let store = Arc::clone(&store);
                let key = key.clone();
                tokio::spawn(async move {
                    let mut conflicts = 0u64;
                    for _ in 0..TOTAL / WORKERS {
                        loop {
                            let entry = store.get(&key).await.unwrap().expect("counter");
                            let n: u64 =
                                std::str::from_utf8(&entry.value).unwrap().parse().unwrap();
                            let next = (n + 1).to_string();
                            match store
                                .compare_and_swap(&key, &entry.version, next.as_bytes(), None)
                                .await
                                .unwrap()
                            {
                                Some(_) => break,
                                None => conflicts += 1,
                            }
                        }
                    }
                    conflicts
                })
            })
            .collect();
        let mut conflicts = 0;
        for w in workers {
            conflicts += w.await.unwrap();
        }
        let value = store.get(&key).await.unwrap().unwrap().value;
        assert_eq!(
            std::str::from_utf8(&value).unwrap(),
            TOTAL.to_string(),
            "lost updates ({conflicts} conflicts retried)"
        );
    }

    /// `put_fenced` (through the lock module): written under the current
    /// lease, refused under an older one (the lock record's fence) and
    /// under an older value's fence; a lock record that is not one is a
    /// `Corrupt` error naming it.
    pub async fn fenced_write_checks_both_fences(store: Arc<dyn Store>) {
        let ns = ns();
        let key = format!("{ns}/value");
        let lock = LeaseLock::new(Arc::clone(&store), &format!("{ns}/lock"));
        let ttl = Duration::from_secs(30);
        let first = lock.try_acquire("a", ttl).await.unwrap().unwrap();
        put_fenced(store.as_ref(), &key, b"one", &first)
            .await
            .unwrap();
        assert!(lock.release(&first).await.unwrap());
        let second = lock.try_acquire("b", ttl).await.unwrap().unwrap();
        match put_fenced(store.as_ref(), &key, b"stale", &first).await {
            Err(StoreError::Fenced { fence, newest, .. }) => {
                assert_eq!((fence, newest), (first.fence, second.fence));
            }
            other => panic!("stale fenced write: {other:?}"),
        }
        put_fenced(store.as_ref(), &key, b"two", &second)
            .await
            .unwrap();
        let read = get_fenced(store.as_ref(), &key).await.unwrap().unwrap();
        assert_eq!(
            (read.value.as_slice(), read.fence),
            (&b"two"[..], second.fence)
        );

        // A lease of another lock with an old fence: the value's fence refuses.
        let unrelated = Lease {
            name: format!("{ns}/other"),
            fence: first.fence,
            ..first.clone()
        };
        assert!(matches!(
            put_fenced(store.as_ref(), &key, b"x", &unrelated).await,
            Err(StoreError::Fenced { .. })
        ));
        store
            .put(&format!("locks/{ns}/garbage"), b"not a lock record", None)
            .await
            .unwrap();
        let garbage = Lease {
            name: format!("{ns}/garbage"),
            ..second.clone()
        };
        match put_fenced(store.as_ref(), &format!("{ns}/g"), b"x", &garbage).await {
            Err(StoreError::Corrupt { key, .. }) => assert_eq!(key, format!("locks/{ns}/garbage")),
            other => panic!("write under a garbage lock record: {other:?}"),
        }
    }

    /// 8 writers with fences 1..=8 write one key at once: the value ends
    /// under fence 8, and every refusal names a newer fence.
    pub async fn fenced_writers_race_to_the_highest_fence(store: Arc<dyn Store>) {
        let ns = ns();
        let key = format!("{ns}/value");
        let barrier = Arc::new(tokio::sync::Barrier::new(8));
        let writers: Vec<_> = (1..=8u64)
            .map(|fence| {
                let (store, key, barrier) = (Arc::clone(&store), key.clone(), Arc::clone(&barrier));
                let lease = Lease {
                    name: format!("{ns}/lock"),
                    holder: format!("w{fence}"),
                    fence,
                    expires_at_unix_ms: u64::MAX,
                    version: Version(String::new()),
                    ttl: Duration::from_secs(30),
                };
                tokio::spawn(async move {
                    barrier.wait().await;
                    (
                        fence,
                        put_fenced(store.as_ref(), &key, &fence.to_be_bytes(), &lease).await,
                    )
                })
            })
            .collect();
        for w in writers {
            match w.await.unwrap() {
                (_, Ok(_)) => {}
                (fence, Err(StoreError::Fenced { newest, .. })) => assert!(newest > fence),
                (fence, Err(e)) => panic!("writer {fence}: {e}"),
            }
        }
        let read = get_fenced(store.as_ref(), &key).await.unwrap().unwrap();
        assert_eq!(
            (read.fence, read.value.as_slice()),
            (8, &8u64.to_be_bytes()[..])
        );
    }

    /// The test servers run on this machine, so the store's clock is this
    /// one's: the offset is within the backend's resolution (a second for
    /// object stores' `Last-Modified`).
    pub async fn clock_offset_is_the_servers(store: Arc<dyn Store>) {
        let offset = store.clock_offset_ms().await.unwrap();
        assert!(
            offset.abs() <= 1_500,
            "offset {offset} ms from a local server"
        );
        // Cached: asking again at once gives the same answer.
        assert_eq!(store.clock_offset_ms().await.unwrap(), offset);
    }

    /// 16 concurrent creates of one key: exactly one wins, and its value is
    /// the one stored.
    pub async fn create_race_has_one_winner(store: Arc<dyn Store>) {
        let key = format!("{}/race", ns());
        let barrier = Arc::new(tokio::sync::Barrier::new(16));
        let racers: Vec<_> = (0..16u32)
            .map(|i| {
                let (store, key, barrier) = (Arc::clone(&store), key.clone(), Arc::clone(&barrier));
                tokio::spawn(async move {
                    barrier.wait().await;
                    let won = store
                        .put_if_absent(&key, &i.to_be_bytes(), None)
                        .await
                        .unwrap();
                    won.map(|v| (i, v))
                })
            })
            .collect();
        let mut winners = Vec::new();
        for r in racers {
            winners.extend(r.await.unwrap());
        }
        assert_eq!(winners.len(), 1, "winners: {winners:?}");
        let (i, v) = &winners[0];
        let entry = store.get(&key).await.unwrap().unwrap();
        assert_eq!(
            (entry.value.as_slice(), &entry.version),
            (&i.to_be_bytes()[..], v)
        );
    }
}
