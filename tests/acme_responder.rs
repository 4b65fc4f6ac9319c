//! The HTTP-01 responder (docs/reference.md#challenge-endpoint) over real sockets: what it
//! answers, what it refuses without asking the store, and a token published
//! by another replica (another `ChallengeBook` on the same store) answered
//! within about a second of a prior miss. The shared store is a
//! `MemoryStore` behind a counting wrapper, and also a real Redis when
//! `SBMESH_TEST_REDIS_URL` is set (scripts/test sets it).

mod object_servers;
mod store_hook;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use sbmesh::internal::challenge::{ChallengeBook, Lookup, challenge_router};
use sbmesh::{MemoryStore, Metrics, ResultLabels, Store, StoreError};
use store_hook::{Hook, Hooked, Op};
use tokio::net::TcpStream;

const TTL: Duration = Duration::from_secs(300);
const HOST: &str = "api.example.com";

/// Counts reads (and can be told to fail them, fail the first few, or
/// hang).
#[derive(Default)]
struct Reads {
    gets: AtomicUsize,
    /// Reads started and not yet answered (or dropped), and the most at
    /// once.
    in_flight: Arc<AtomicUsize>,
    max_in_flight: AtomicUsize,
    /// Every read and write fails.
    fail: bool,
    /// Reads to fail before answering (a store coming back).
    fail_first: AtomicUsize,
    /// Reads never answer (a frozen backend).
    hang: bool,
}

/// Counts a read out of `in_flight` when it ends, answered or dropped.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl Hook for Reads {
    async fn before(&self, op: Op, _key: &str) -> Result<(), StoreError> {
        if op != Op::Get {
            return match (op, self.fail) {
                (Op::Put, true) => Err(store_hook::unreachable("test", "connection refused")),
                _ => Ok(()),
            };
        }
        self.gets.fetch_add(1, Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        let _in_flight = InFlight(self.in_flight.clone());
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        if self.hang {
            std::future::pending::<()>().await;
        }
        let failing_first = self
            .fail_first
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if self.fail || failing_first {
            return Err(store_hook::unreachable("test", "connection refused"));
        }
        Ok(())
    }
}

/// A store that counts reads: a shared store as the responder reads it.
type Counting = Hooked<Reads>;

impl Hooked<Reads> {
    fn counting(inner: Arc<dyn Store>) -> Arc<Self> {
        Hooked::shared(inner, Reads::default())
    }
    /// The first `n` reads fail, the next ones answer from `inner`.
    fn back_after(inner: Arc<dyn Store>, n: usize) -> Arc<Self> {
        let reads = Reads {
            fail_first: AtomicUsize::new(n),
            ..Reads::default()
        };
        Hooked::shared(inner, reads)
    }
    fn failing() -> Arc<Self> {
        let reads = Reads {
            fail: true,
            ..Reads::default()
        };
        Hooked::shared(Arc::new(MemoryStore::new()), reads)
    }
    fn hanging() -> Arc<Self> {
        let reads = Reads {
            hang: true,
            ..Reads::default()
        };
        Hooked::shared(Arc::new(MemoryStore::new()), reads)
    }
    fn gets(&self) -> usize {
        self.hook.gets.load(Ordering::SeqCst)
    }
    fn max_in_flight(&self) -> usize {
        self.hook.max_in_flight.load(Ordering::SeqCst)
    }
}

/// Serves the book's router on 127.0.0.1:0.
async fn serve(book: Arc<ChallengeBook>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, challenge_router(book)).await.unwrap();
    });
    addr
}

struct Answer {
    status: u16,
    content_type: Option<String>,
    body: String,
}

/// One request on a fresh connection, the Host header exactly as given
/// (none when `None`) and the path sent verbatim.
async fn request(addr: SocketAddr, method: &str, path: &str, host: Option<&str>) -> Answer {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = Request::builder().method(method).uri(path);
    if let Some(host) = host {
        req = req.header("host", host);
    }
    let resp = sender
        .send_request(req.body(Empty::<Bytes>::new()).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        content_type,
        body: String::from_utf8(body.to_vec()).unwrap(),
    }
}

async fn get(addr: SocketAddr, token: &str, host: Option<&str>) -> Answer {
    request(
        addr,
        "GET",
        &format!("/.well-known/acme-challenge/{token}"),
        host,
    )
    .await
}

fn count(metrics: &Metrics, result: &'static str) -> u64 {
    metrics
        .acme
        .challenge_requests
        .get_or_create(&ResultLabels { result })
        .get()
}

fn key_auth(token: &str) -> String {
    format!("{token}.9jg46WB3rR_AHD-EBXdN7cBkH1WOu0tA3M9fm21mqTI")
}

#[tokio::test]
async fn published_token_is_answered_for_its_host_only() {
    let store = Counting::counting(Arc::new(MemoryStore::new()));
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(store.clone(), metrics.clone());
    let token = "evaGxfADs6pSRb2LAv9IZf17Dt3juxGJ-PCt92wr-oA";
    book.publish(token, HOST, &key_auth(token), TTL)
        .await
        .unwrap();
    let addr = serve(book.clone()).await;

    for host in [
        HOST,
        "api.example.com:80",
        "API.Example.COM",
        "api.example.com.",
        "api.example.com.:5002",
    ] {
        let a = get(addr, token, Some(host)).await;
        assert_eq!(a.status, 200, "Host {host}");
        assert_eq!(a.body, key_auth(token), "Host {host}");
        assert_eq!(a.content_type.as_deref(), Some("text/plain"), "Host {host}");
    }
    for host in [
        Some("other.example.com"),
        Some("example.com"),
        Some("api.example.com.evil.test"),
        Some(""),
        None,
    ] {
        let a = get(addr, token, host).await;
        assert_eq!(a.status, 404, "Host {host:?}");
        assert!(a.body.is_empty());
    }
    // Answered from memory: the store was never read.
    assert_eq!(store.gets(), 0);
    assert_eq!(count(&metrics, "hit"), 5);
    assert_eq!(count(&metrics, "rejected"), 5);
    assert_eq!(count(&metrics, "miss"), 0);

    // Other methods and paths.
    let path = format!("/.well-known/acme-challenge/{token}");
    for (method, path) in [
        ("POST", path.as_str()),
        ("PUT", path.as_str()),
        ("DELETE", path.as_str()),
        ("GET", "/"),
        ("GET", "/.well-known/acme-challenge"),
        ("GET", "/.well-known/other/x"),
        ("GET", "/healthz"),
    ] {
        let a = request(addr, method, path, Some(HOST)).await;
        assert_eq!(a.status, 404, "{method} {path}");
    }

    // The library call agrees with the socket.
    assert_eq!(
        book.lookup(token, Some("api.example.com:443")).await,
        Lookup::Hit(key_auth(token))
    );
    assert_eq!(
        book.lookup(token, Some("x.example.com")).await,
        Lookup::Rejected
    );

    book.withdraw(token).await;
    assert_eq!(get(addr, token, Some(HOST)).await.status, 404);
    assert!(
        store
            .inner
            .get(&format!("acme/challenges/{token}"))
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn malformed_tokens_are_refused_without_a_store_lookup() {
    let store = Counting::counting(Arc::new(MemoryStore::new()));
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(store.clone(), metrics.clone());
    let addr = serve(book.clone()).await;
    let long = "a".repeat(300);
    let bad = [
        "../x",
        "..",
        "a.b",
        "%2e",
        "%2e%2e%2fx",
        "abc%41",
        "a/b",
        "",
        "a;b",
        "a+b",
        long.as_str(),
        "acme/challenges/x",
    ];
    for token in bad {
        let a = get(addr, token, Some(HOST)).await;
        assert_eq!(a.status, 404, "token {token:?}");
    }
    assert_eq!(store.gets(), 0, "a malformed token reached the store");
    assert_eq!(count(&metrics, "rejected"), bad.len() as u64);
    assert_eq!(count(&metrics, "miss"), 0);
    assert_eq!(count(&metrics, "hit"), 0);
    assert_eq!(book.lookup("../x", Some(HOST)).await, Lookup::Rejected);
    assert_eq!(store.gets(), 0);

    // Publishing one is refused before anything is written.
    assert!(book.publish("a.b", HOST, "a.b.x", TTL).await.is_err());
    assert!(
        book.publish("tok", HOST, "not-tok.x", TTL).await.is_err(),
        "a key authorization for another token"
    );
    assert!(store.inner.list("acme/").await.unwrap().is_empty());
}

#[tokio::test]
async fn unknown_tokens_are_misses_cached_briefly() {
    let store = Counting::counting(Arc::new(MemoryStore::new()));
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(store.clone(), metrics.clone());
    let addr = serve(book).await;
    for _ in 0..5 {
        assert_eq!(get(addr, "unknown-token", Some(HOST)).await.status, 404);
    }
    // One store read; the four repeats (well within 1 s) came from memory.
    assert_eq!(store.gets(), 1);
    assert_eq!(count(&metrics, "miss"), 5);
    assert_eq!(get(addr, "another", Some(HOST)).await.status, 404);
    assert_eq!(store.gets(), 2);
}

/// Replica B publishes to the shared store after replica A has already
/// missed the token: A answers within about a second.
async fn another_replicas_token_is_answered(shared: Arc<dyn Store>) {
    let store_a = Counting::counting(shared.clone());
    let metrics_a = Arc::new(Metrics::new());
    let a = ChallengeBook::new(store_a.clone(), metrics_a.clone());
    let b = ChallengeBook::new(shared, Arc::new(Metrics::new()));
    let addr_a = serve(a.clone()).await;
    let token = format!("tok-{:016x}", rand::random::<u64>());

    assert_eq!(get(addr_a, &token, Some(HOST)).await.status, 404);
    b.publish(&token, HOST, &key_auth(&token), TTL)
        .await
        .unwrap();
    let published = Instant::now();
    let answer = loop {
        let answer = get(addr_a, &token, Some(HOST)).await;
        if answer.status == 200 {
            break answer;
        }
        assert!(
            published.elapsed() < Duration::from_secs(3),
            "A did not see B's token"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let took = published.elapsed();
    assert_eq!(answer.body, key_auth(&token));
    assert!(
        took <= Duration::from_millis(1500),
        "B's token reached A after {took:?}"
    );
    // Wrong Host is refused for a store-read record too.
    assert_eq!(get(addr_a, &token, Some("evil.test")).await.status, 404);
    // Cached now: further hits do not read the store.
    let reads = store_a.gets();
    for _ in 0..3 {
        assert_eq!(get(addr_a, &token, Some(HOST)).await.status, 200);
    }
    assert_eq!(store_a.gets(), reads);
    assert!(count(&metrics_a, "miss") >= 1);
    assert_eq!(count(&metrics_a, "hit"), 4);
    assert_eq!(count(&metrics_a, "rejected"), 1);

    // B withdraws: gone from the store (A's memory copy lives at most 30 s).
    b.withdraw(&token).await;
    assert_eq!(b.lookup(&token, Some(HOST)).await, Lookup::Miss);
}

#[tokio::test]
async fn another_replicas_token_memory_store() {
    another_replicas_token_is_answered(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn another_replicas_token_redis() {
    let Some(url) = object_servers::server_env("SBMESH_TEST_REDIS_URL") else {
        return;
    };
    let ns = format!("responder-{:016x}", rand::random::<u64>());
    let store = sbmesh::RedisStore::connect(&url, Duration::from_secs(2))
        .await
        .expect("connect to SBMESH_TEST_REDIS_URL")
        .with_namespace(&ns)
        .unwrap();
    another_replicas_token_is_answered(Arc::new(store)).await;
}

#[tokio::test]
async fn records_expire_with_their_ttl() {
    let store = Arc::new(MemoryStore::new());
    let book = ChallengeBook::new(store.clone(), Arc::new(Metrics::new()));
    let addr = serve(book.clone()).await;
    book.publish(
        "short",
        HOST,
        &key_auth("short"),
        Duration::from_millis(300),
    )
    .await
    .unwrap();
    assert_eq!(get(addr, "short", Some(HOST)).await.status, 200);
    let start = Instant::now();
    while get(addr, "short", Some(HOST)).await.status == 200 {
        assert!(start.elapsed() < Duration::from_secs(5), "never expired");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(store.get("acme/challenges/short").await.unwrap().is_none());
}

/// A store that fails every read: the CA's request gets `404` once the
/// responder's 3 s of asking again are spent (never a panic), and a
/// publish is an error.
#[tokio::test]
async fn store_failures_are_404_never_a_panic() {
    let store = Counting::failing();
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(store.clone(), metrics.clone());
    let addr = serve(book.clone()).await;
    let a = get(addr, "t0", Some(HOST)).await;
    assert_eq!(a.status, 404);
    assert!(store.gets() > 1, "the store was asked again");
    assert_eq!(count(&metrics, "miss"), 1);
    // A publish whose store write fails is an error, and nothing is served.
    assert!(
        book.publish("t0", HOST, &key_auth("t0"), TTL)
            .await
            .is_err()
    );
    assert_eq!(book.lookup("t0", Some(HOST)).await, Lookup::Miss);
}

/// Every lookup against a failing store asks it again within its 3 s
/// (paused clock: no real waiting) and ends a miss.
#[tokio::test(start_paused = true)]
async fn a_failing_store_is_asked_again_within_the_lookup_time() {
    let store = Counting::failing();
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(store.clone(), metrics.clone());
    for i in 0..20 {
        let start = tokio::time::Instant::now();
        let before = store.gets();
        assert_eq!(
            book.lookup(&format!("t{i}"), Some(HOST)).await,
            Lookup::Miss
        );
        assert!(store.gets() - before > 1, "t{i}: the store was asked again");
        assert!(
            start.elapsed() >= Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
    }
    assert_eq!(count(&metrics, "miss"), 20);
}

/// The store fails for a moment (a Redis restarting) as the CA's request
/// arrives: the responder asks again and the CA gets its answer.
#[tokio::test(start_paused = true)]
async fn a_store_back_within_the_lookup_time_answers_the_ca() {
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let publisher = ChallengeBook::new(inner.clone(), Arc::new(Metrics::new()));
    publisher
        .publish("back", HOST, &key_auth("back"), TTL)
        .await
        .unwrap();
    let store = Counting::back_after(inner, 5);
    let book = ChallengeBook::new(store.clone(), Arc::new(Metrics::new()));
    assert_eq!(
        book.lookup("back", Some(HOST)).await,
        Lookup::Hit(key_auth("back"))
    );
    assert_eq!(store.gets(), 6, "five failed reads, then the answer");
}

#[tokio::test]
async fn corrupt_store_records_are_misses() {
    let store = Arc::new(MemoryStore::new());
    let book = ChallengeBook::new(store.clone(), Arc::new(Metrics::new()));
    for (token, value) in [
        ("c1", b"not json".as_slice()),
        (
            "c2",
            br#"{"host":"api.example.com","key_authorization":"other.abc"}"#,
        ),
        ("c3", br#"{"host":"","key_authorization":"c3.abc"}"#),
        ("c4", &[0xff; 10_000]),
    ] {
        store
            .put(&format!("acme/challenges/{token}"), value, Some(TTL))
            .await
            .unwrap();
        assert_eq!(
            book.lookup(token, Some(HOST)).await,
            Lookup::Miss,
            "{token}"
        );
    }
}

/// A frozen store: each lookup gives up after the responder's 3 s budget
/// (paused clock: no real waiting), and at most 32 reads are in flight.
#[tokio::test(start_paused = true)]
async fn a_hung_store_is_a_miss_after_the_timeout() {
    let store = Counting::hanging();
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(store.clone(), metrics.clone());
    let start = tokio::time::Instant::now();
    let lookups: Vec<_> = (0..100)
        .map(|i| {
            let book = book.clone();
            tokio::spawn(async move { book.lookup(&format!("hung{i}"), Some(HOST)).await })
        })
        .collect();
    // Polled (each sleep lets the paused clock run the lookups) until the
    // first reads reach the store; none answers, so the rest wait.
    let mut polls = 0;
    while store.gets() < 32 {
        polls += 1;
        assert!(
            polls < 1_000,
            "only {} reads reached the store",
            store.gets()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for l in lookups {
        assert_eq!(l.await.unwrap(), Lookup::Miss);
    }
    // Never more than 32 reads at once, whenever the others got a slot.
    assert_eq!(store.max_in_flight(), 32);
    let took = start.elapsed();
    assert!(
        (Duration::from_secs(3)..Duration::from_secs(4)).contains(&took),
        "{took:?}"
    );
    assert_eq!(count(&metrics, "miss"), 100);
}
