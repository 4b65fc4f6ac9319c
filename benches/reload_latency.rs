//! Hot reload, end to end: kubelet-style ConfigMap swaps (a new
//! `..<timestamp>` directory, a `..data_tmp` symlink renamed over `..data`)
//! against the real reloader (inotify, 200 ms debounce, validation, POST) and
//! a stand-in proxy admin that hashes the file at the moment each POST
//! arrives.
//!
//! ```text
//! cargo bench -p sbmesh --bench reload_latency
//! SBMESH_BENCH_SWAPS=200 cargo bench -p sbmesh --bench reload_latency
//! ```
//!
//! Reports swap → POST latency p50/p99/max over the swaps, missed changes
//! (a swap whose content never reached the proxy within 5 s) and duplicate
//! POSTs (the same content POSTed twice in a row), as a markdown row.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "../tests/kubelet/mod.rs"]
mod kubelet;

use kubelet::Kubelet;
use sbmesh::{Metrics, Reloader, ReloaderConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

#[derive(Default)]
struct Seen {
    /// (when, sha256 hex of the file at that moment)
    posts: Vec<(Instant, String)>,
    in_flight: usize,
    max_in_flight: usize,
}

fn sha(bytes: &[u8]) -> String {
    sbmesh::sha256_hex(bytes)
}

fn content(i: usize) -> String {
    format!("proxy:\n  admin: {{enabled: true, port: 9090}}\n# revision {i}\n")
}

async fn proxy(listener: TcpListener, file: PathBuf, seen: Arc<Mutex<Seen>>) {
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            continue;
        };
        let (file, seen) = (file.clone(), seen.clone());
        tokio::spawn(async move {
            if let Ok(mut s) = seen.lock() {
                s.in_flight += 1;
                s.max_in_flight = s.max_in_flight.max(s.in_flight);
            }
            let mut buf = vec![0u8; 8192];
            let _ = conn.read(&mut buf).await;
            let hash = std::fs::read(&file).map(|b| sha(&b)).unwrap_or_default();
            if let Ok(mut s) = seen.lock() {
                s.posts.push((Instant::now(), hash));
                s.in_flight -= 1;
            }
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .await;
        });
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let swaps: usize = std::env::var("SBMESH_BENCH_SWAPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut kubelet = Kubelet::new(dir.path(), &content(0));
    let file = dir.path().join("sb.yml");

    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let url = format!(
        "http://{}/admin/reload",
        listener.local_addr().expect("addr")
    );
    let seen = Arc::new(Mutex::new(Seen::default()));
    tokio::spawn(proxy(listener, file.clone(), seen.clone()));

    let mut cfg = ReloaderConfig::new(file.clone(), url);
    cfg.assume_delivered = Some(sha(content(0).as_bytes()));
    let _reloader = Reloader::spawn(cfg, Arc::new(Metrics::new())).expect("reloader");
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut latencies = Vec::with_capacity(swaps);
    let mut missed = 0usize;
    for i in 1..=swaps {
        let text = content(i);
        let want = sha(text.as_bytes());
        let already = seen.lock().map(|s| s.posts.len()).unwrap_or(0);
        let t0 = Instant::now();
        kubelet.publish(&text);
        let deadline = t0 + Duration::from_secs(5);
        let got = loop {
            let hit = seen.lock().ok().and_then(|s| {
                s.posts[already..]
                    .iter()
                    .find(|(_, h)| *h == want)
                    .map(|(at, _)| *at)
            });
            if let Some(at) = hit {
                break Some(at);
            }
            if Instant::now() > deadline {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        match got {
            Some(at) => latencies.push(at.duration_since(t0)),
            None => missed += 1,
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (posts, duplicates, max_in_flight) = {
        let s = seen.lock().expect("state");
        let dup = s.posts.windows(2).filter(|w| w[0].1 == w[1].1).count();
        (s.posts.len(), dup, s.max_in_flight)
    };
    latencies.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "swaps {swaps}, POSTs {posts}, missed {missed}, duplicate POSTs {duplicates}, max POSTs in flight {max_in_flight}"
    );
    println!();
    println!("| swaps | debounce | p50 | p99 | max | missed | duplicate POSTs |");
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {swaps} | 200 ms | {:.0} ms | {:.0} ms | {:.0} ms | {missed} | {duplicates} |",
        ms(percentile(&latencies, 0.50)),
        ms(percentile(&latencies, 0.99)),
        ms(latencies.last().copied().unwrap_or_default()),
    );
}
