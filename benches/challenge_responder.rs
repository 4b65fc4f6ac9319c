//! HTTP-01 responder throughput: the challenge router served on 127.0.0.1
//! (axum, as the sidecar serves `--challenge-listen`) and driven by N
//! keep-alive HTTP/1.1 connections from hyper clients in the same process,
//! one request in flight per connection, every answer checked.
//!
//! ```text
//! cargo bench -p sbmesh --bench challenge_responder
//! SBMESH_BENCH_CONNS=64 SBMESH_BENCH_SECS=10 cargo bench -p sbmesh --bench challenge_responder
//! ```
//!
//! Paths measured: `hit` (a token published in memory, the CA's case),
//! `rejected` (a malformed token) and `miss` (an unknown token: served from
//! the 1 s miss cache after the first store read). The load generator
//! shares the machine's cores with the server, so the figures are a lower
//! bound of what the responder alone sustains.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use sbmesh::internal::challenge::{ChallengeBook, challenge_router};
use sbmesh::{MemoryStore, Metrics};

const HOST: &str = "api.example.com";
const TOKEN: &str = "evaGxfADs6pSRb2LAv9IZf17Dt3juxGJ-PCt92wr-oA";

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Drives `conns` keep-alive connections at `path` for `secs` (after a 1 s
/// warm-up); returns requests per second. Panics on an unexpected status.
async fn drive(addr: SocketAddr, path: &'static str, expect: u16, conns: u64, secs: u64) -> f64 {
    let counting = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (counting, stop, done) = (counting.clone(), stop.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            stream.set_nodelay(true).expect("nodelay");
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .expect("handshake");
            tokio::spawn(conn);
            while !stop.load(Ordering::Relaxed) {
                let req = Request::get(path)
                    .header("host", HOST)
                    .body(Empty::<Bytes>::new())
                    .expect("request");
                let resp = sender.send_request(req).await.expect("response");
                assert_eq!(resp.status().as_u16(), expect, "{path}");
                resp.into_body().collect().await.expect("body");
                if counting.load(Ordering::Relaxed) {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    counting.store(true, Ordering::Relaxed);
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let n = done.load(Ordering::Relaxed);
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("client task");
    }
    n as f64 / elapsed.as_secs_f64()
}

fn main() {
    let conns = env("SBMESH_BENCH_CONNS", 32);
    let secs = env("SBMESH_BENCH_SECS", 5);
    let threads = env("SBMESH_BENCH_THREADS", 2) as usize;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let metrics = Arc::new(Metrics::new());
        let book = ChallengeBook::new(Arc::new(MemoryStore::new()), metrics.clone());
        let key_auth = format!("{TOKEN}.9jg46WB3rR_AHD-EBXdN7cBkH1WOu0tA3M9fm21mqTI");
        book.publish(TOKEN, HOST, &key_auth, Duration::from_secs(3600))
            .await
            .expect("publish");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            axum::serve(listener, challenge_router(book))
                .await
                .expect("serve")
        });

        println!(
            "challenge responder: {conns} keep-alive connections, {secs} s per path, \
             {threads} tokio workers shared by server and clients"
        );
        println!("| path | requests/s |");
        println!("|---|---|");
        for (name, path, status) in [
            (
                "hit",
                "/.well-known/acme-challenge/evaGxfADs6pSRb2LAv9IZf17Dt3juxGJ-PCt92wr-oA",
                200,
            ),
            ("rejected", "/.well-known/acme-challenge/a.b", 404),
            ("miss", "/.well-known/acme-challenge/unknown-token", 404),
        ] {
            let rate = drive(addr, path, status, conns, secs).await;
            println!("| {name} | {rate:.0} |");
        }
        let text = metrics.encode();
        for line in text
            .lines()
            .filter(|l| l.starts_with("acme_challenge_requests_total"))
        {
            println!("{line}");
        }
    });
}
