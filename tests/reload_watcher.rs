//! The config reloader against a stand-in proxy admin server: every distinct
//! content reaches the proxy once, an invalid one never, one POST at a time.
//!
//! The stand-in records each POST with its `Authorization` header and the
//! sha256 of the config file at that moment, and answers as each test
//! scripts it. Waits poll with generous deadlines; the only fixed waits are
//! the windows in which something must *not* happen.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod kubelet;

use kubelet::Kubelet;

use sbmesh::{
    Metrics, ReloadStatus, ReloadTiming, Reloader, ReloaderConfig, ReloaderHandle, parse_config,
    sha256_hex,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const AUTH: &str = "Basic cmVsb2FkZXI6c2VjcmV0";
const DEADLINE: Duration = Duration::from_secs(20);

/// One POST as the stand-in saw it.
#[derive(Clone, Debug)]
struct Seen {
    authorization: Option<String>,
    /// sha256 of the config file when the POST arrived.
    file_sha: String,
    status: u16,
    at: Instant,
}

struct ProxyState {
    config: PathBuf,
    posts: Mutex<Vec<Seen>>,
    script: Mutex<VecDeque<u16>>,
    delay: Duration,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

/// The stand-in proxy admin server.
struct Proxy {
    addr: SocketAddr,
    state: Arc<ProxyState>,
}

impl Proxy {
    async fn start(config: &Path, script: &[u16], delay: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(listener, config, script, delay)
    }

    fn serve(listener: TcpListener, config: &Path, script: &[u16], delay: Duration) -> Self {
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ProxyState {
            config: config.to_path_buf(),
            posts: Mutex::new(Vec::new()),
            script: Mutex::new(script.iter().copied().collect()),
            delay,
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        });
        let shared = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(answer(stream, shared.clone()));
            }
        });
        Self { addr, state }
    }

    fn url(&self) -> String {
        format!("http://{}/admin/reload", self.addr)
    }

    fn posts(&self) -> Vec<Seen> {
        self.state.posts.lock().unwrap().clone()
    }

    fn shas(&self) -> Vec<String> {
        self.posts().into_iter().map(|p| p.file_sha).collect()
    }
}

/// Answers one HTTP/1.1 request (the reloader sends bodiless POSTs), then
/// closes the connection.
async fn answer(mut stream: TcpStream, state: Arc<ProxyState>) {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    assert!(head.starts_with("POST /admin/reload HTTP/1.1"), "{head}");
    let authorization = head.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("authorization")
            .then(|| value.trim().to_string())
    });
    let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    state.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let file_sha = std::fs::read(&state.config)
        .map(|raw| sha256_hex(&raw))
        .unwrap_or_else(|e| format!("unreadable: {e}"));
    tokio::time::sleep(state.delay).await;
    let status = state.script.lock().unwrap().pop_front().unwrap_or(200);
    state.posts.lock().unwrap().push(Seen {
        authorization,
        file_sha,
        status,
        at: Instant::now(),
    });
    state.in_flight.fetch_sub(1, Ordering::SeqCst);
    let response =
        format!("HTTP/1.1 {status} Scripted\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// A valid `sb.yml`, distinct per `version`.
fn valid(version: usize) -> String {
    let text = format!(
        "proxy:\n  admin: {{ port: 9090 }}\norigins:\n  \"v{version}.example.com\": {{}}\n"
    );
    assert!(parse_config(&text).is_ok(), "test config must be valid");
    text
}

fn sha(text: &str) -> String {
    sha256_hex(text.as_bytes())
}

/// Editor-style write: a temporary file renamed over the original.
fn write_rename_over(path: &Path, text: &str) {
    let tmp = path.with_extension("yml.tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn reloader(path: &Path, url: &str) -> ReloaderConfig {
    let mut c = ReloaderConfig::new(path, url);
    c.authorization = Some(AUTH.into());
    c.debounce = Duration::from_millis(100);
    c.rescan = Duration::from_secs(3600);
    c.post_timeout = Duration::from_secs(5);
    c
}

fn spawn(config: ReloaderConfig, metrics: &Arc<Metrics>) -> ReloaderHandle {
    Reloader::spawn(config, metrics.clone()).unwrap()
}

/// Polls `cond` until it holds, or panics with `what` after [`DEADLINE`].
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn delivered(handle: &ReloaderHandle) -> ReloadStatus {
    handle.status().borrow().clone()
}

async fn wait_delivered(proxy: &Proxy, handle: &ReloaderHandle, text: &str) {
    let want = sha(text);
    wait_for(&format!("delivery of {want}"), || {
        proxy
            .posts()
            .last()
            .is_some_and(|p| p.file_sha == want && p.status == 200)
            && delivered(handle).delivered_hash == Some(format!("sha256:{want}"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubelet_swaps_are_each_delivered_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut kubelet = Kubelet::new(dir.path(), &valid(1));
    let proxy = Proxy::start(&kubelet.path(), &[], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let handle = spawn(reloader(&kubelet.path(), &proxy.url()), &metrics);
    wait_delivered(&proxy, &handle, &valid(1)).await;

    kubelet.publish(&valid(2));
    wait_delivered(&proxy, &handle, &valid(2)).await;
    // A swap to identical content is no change.
    kubelet.publish(&valid(2));
    kubelet.publish(&valid(3));
    wait_delivered(&proxy, &handle, &valid(3)).await;

    assert_eq!(
        proxy.shas(),
        vec![sha(&valid(1)), sha(&valid(2)), sha(&valid(3))]
    );
    assert!(
        proxy
            .posts()
            .iter()
            .all(|p| p.authorization.as_deref() == Some(AUTH))
    );
    assert_eq!(metrics.reloader.reloads.get(), 3);
    assert_eq!(metrics.reloader.reloads_failed.get(), 0);
    assert_eq!(metrics.reloader.last_reload_successful.get(), 1);
    let status = delivered(&handle);
    assert_eq!(status.last_result.map(|r| r.result).as_deref(), Some("ok"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_and_rename_over_writes_are_each_delivered_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(1)).unwrap();
    let proxy = Proxy::start(&path, &[], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let handle = spawn(reloader(&path, &proxy.url()), &metrics);
    wait_delivered(&proxy, &handle, &valid(1)).await;

    std::fs::write(&path, valid(2)).unwrap();
    wait_delivered(&proxy, &handle, &valid(2)).await;
    // Rewriting the same bytes, in place and by rename, is no change.
    std::fs::write(&path, valid(2)).unwrap();
    write_rename_over(&path, &valid(2));
    write_rename_over(&path, &valid(3));
    wait_delivered(&proxy, &handle, &valid(3)).await;

    assert_eq!(
        proxy.shas(),
        vec![sha(&valid(1)), sha(&valid(2)), sha(&valid(3))]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_changes_in_bursts_deliver_the_final_content_one_post_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(0)).unwrap();
    // A slow proxy widens the window in which a second POST could overlap.
    let proxy = Proxy::start(&path, &[], Duration::from_millis(40)).await;
    let metrics = Arc::new(Metrics::new());
    let handle = spawn(reloader(&path, &proxy.url()), &metrics);
    wait_delivered(&proxy, &handle, &valid(0)).await;

    // 10 bursts of 20 changes; between bursts a pause longer than the
    // debounce, so POSTs start while the next burst is being written.
    for version in 1..=200 {
        write_rename_over(&path, &valid(version));
        let pause = if version % 20 == 0 {
            250
        } else {
            2 + (version as u64 % 4) * 4
        };
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    wait_delivered(&proxy, &handle, &valid(200)).await;

    assert_eq!(proxy.state.max_in_flight.load(Ordering::SeqCst), 1);
    // Each burst is read at most a few times (debounce windows), never
    // once per change.
    let posts = proxy.posts().len();
    assert!(
        posts <= 1 + 10 * 4,
        "{posts} POSTs for 200 changes in 10 bursts"
    );
    assert_eq!(proxy.shas().last(), Some(&sha(&valid(200))));
}

/// Changes spaced wider than the debounce are each read, but while one
/// slow POST is in flight they collapse into a single follow-up POST of the
/// newest content: far fewer POSTs than changes, the last one delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_during_a_slow_post_collapse_into_one_post_of_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(0)).unwrap();
    let proxy = Proxy::start(&path, &[], Duration::from_millis(1000)).await;
    let metrics = Arc::new(Metrics::new());
    let mut config = reloader(&path, &proxy.url());
    config.debounce = Duration::from_millis(10);
    let handle = spawn(config, &metrics);
    wait_delivered(&proxy, &handle, &valid(0)).await;

    let changes = 100;
    for version in 1..=changes {
        write_rename_over(&path, &valid(version));
        // Wider than the debounce: the watcher reads every change.
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    wait_delivered(&proxy, &handle, &valid(changes)).await;

    let posts = proxy.posts();
    assert_eq!(proxy.state.max_in_flight.load(Ordering::SeqCst), 1);
    // 100 changes over >= 3 s with 1 s POSTs: about 4 follow-ups after the
    // first POST; 20 would already mean changes queue up one by one.
    assert!(
        posts.len() <= 1 + changes / 5,
        "{} POSTs for {changes} changes",
        posts.len()
    );
    assert_eq!(proxy.shas().last(), Some(&sha(&valid(changes))));
    // Each follow-up carried the content newest at its start, never an
    // older one again.
    let versions: Vec<usize> = proxy
        .shas()
        .iter()
        .map(|s| {
            (0..=changes)
                .find(|v| sha(&valid(*v)) == *s)
                .unwrap_or_else(|| panic!("POST of unknown content {s}"))
        })
        .collect();
    assert!(
        versions.windows(2).all(|w| w[0] < w[1]),
        "POSTed versions {versions:?}"
    );
}

/// The default debounce (docs/reference.md#hot-reload: 200 ms): a burst written at once is one
/// POST of its last content, and a single change is not POSTed before
/// the debounce has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_200_ms_debounce_collapses_a_burst_and_delays_a_single_change() {
    let debounce = ReloadTiming::default().debounce;
    assert_eq!(debounce, Duration::from_millis(200));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(0)).unwrap();
    let proxy = Proxy::start(&path, &[], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let mut config = ReloaderConfig::new(&path, proxy.url());
    config.authorization = Some(AUTH.into());
    config.rescan = Duration::from_secs(3600);
    assert_eq!(config.debounce, debounce);
    let handle = spawn(config, &metrics);
    wait_delivered(&proxy, &handle, &valid(0)).await;

    // A burst, written back to back: one POST, of the last version.
    for version in 1..=10 {
        write_rename_over(&path, &valid(version));
    }
    wait_delivered(&proxy, &handle, &valid(10)).await;
    assert_eq!(proxy.shas(), vec![sha(&valid(0)), sha(&valid(10))]);

    // A single change: POSTed, but not before the debounce has passed
    // (a lower bound, which no fixed sleep in a test could fake).
    let written = Instant::now();
    write_rename_over(&path, &valid(11));
    wait_delivered(&proxy, &handle, &valid(11)).await;
    let posts = proxy.posts();
    assert_eq!(posts.len(), 3);
    let after = posts[2].at.duration_since(written);
    assert!(after >= debounce, "POSTed {after:?} after the write");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_yaml_is_never_posted_and_keeps_the_delivered_hash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(1)).unwrap();
    let proxy = Proxy::start(&path, &[], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let handle = spawn(reloader(&path, &proxy.url()), &metrics);
    wait_delivered(&proxy, &handle, &valid(1)).await;

    let broken = "proxy:\n  admin: [unclosed\n";
    write_rename_over(&path, broken);
    wait_for("the invalid count", || {
        metrics.reloader.config_invalid.get() == 1
    })
    .await;
    let status = delivered(&handle);
    assert_eq!(
        status.delivered_hash,
        Some(format!("sha256:{}", sha(&valid(1))))
    );
    assert_eq!(
        status.last_result.map(|r| r.result).as_deref(),
        Some("invalid")
    );

    write_rename_over(&path, &valid(2));
    wait_delivered(&proxy, &handle, &valid(2)).await;
    assert_eq!(proxy.shas(), vec![sha(&valid(1)), sha(&valid(2))]);
    assert_eq!(metrics.reloader.config_invalid.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflict_is_retried_after_about_500_ms() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(1)).unwrap();
    let proxy = Proxy::start(&path, &[409], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let handle = spawn(reloader(&path, &proxy.url()), &metrics);
    wait_delivered(&proxy, &handle, &valid(1)).await;

    let posts = proxy.posts();
    assert_eq!(
        posts.iter().map(|p| p.status).collect::<Vec<_>>(),
        [409, 200]
    );
    let gap = posts[1].at - posts[0].at;
    assert!(gap >= Duration::from_millis(450), "retried after {gap:?}");
    assert_eq!(metrics.reloader.reloads.get(), 2);
    assert_eq!(metrics.reloader.reloads_failed.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_are_retried_with_backoff() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(1)).unwrap();
    let proxy = Proxy::start(&path, &[500, 503], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let handle = spawn(reloader(&path, &proxy.url()), &metrics);
    wait_delivered(&proxy, &handle, &valid(1)).await;

    let posts = proxy.posts();
    assert_eq!(
        posts.iter().map(|p| p.status).collect::<Vec<_>>(),
        [500, 503, 200]
    );
    // 500 ms, then 1 s.
    assert!(posts[2].at - posts[1].at >= Duration::from_millis(900));
    assert_eq!(metrics.reloader.reloads_failed.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_content_is_not_retried_until_it_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(1)).unwrap();
    let proxy = Proxy::start(&path, &[400], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let mut config = reloader(&path, &proxy.url());
    // Frequent re-reads give a wrong retry every chance to happen.
    config.rescan = Duration::from_millis(200);
    let handle = spawn(config, &metrics);
    wait_for("the refusal", || {
        delivered(&handle).last_result.map(|r| r.result).as_deref() == Some("refused")
    })
    .await;
    // The window in which a retry must not happen (several 500 ms retries'
    // worth, several rescans).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(proxy.shas(), vec![sha(&valid(1))]);
    assert_eq!(delivered(&handle).delivered_hash, None);
    assert_eq!(metrics.reloader.last_reload_successful.get(), 0);

    write_rename_over(&path, &valid(2));
    wait_delivered(&proxy, &handle, &valid(2)).await;
    assert_eq!(proxy.shas(), vec![sha(&valid(1)), sha(&valid(2))]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_down_is_retried_and_delivered_once_it_is_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(1)).unwrap();
    // Reserve a port, then close it: connections are refused.
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let url = format!("http://{addr}/admin/reload");
    let metrics = Arc::new(Metrics::new());
    let handle = spawn(reloader(&path, &url), &metrics);
    wait_for("two failed attempts", || {
        metrics.reloader.reloads_failed.get() >= 2
    })
    .await;
    assert_eq!(
        delivered(&handle).last_result.map(|r| r.result).as_deref(),
        Some("failed")
    );

    let listener = TcpListener::bind(addr).await.unwrap();
    let proxy = Proxy::serve(listener, &path, &[], Duration::ZERO);
    wait_delivered(&proxy, &handle, &valid(1)).await;
    assert_eq!(proxy.shas(), vec![sha(&valid(1))]);
    assert_eq!(metrics.reloader.last_reload_successful.get(), 1);
    assert!(metrics.reloader.last_reload_success_timestamp_seconds.get() > 1.0e9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescan_delivers_with_the_watcher_disabled() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(1)).unwrap();
    let proxy = Proxy::start(&path, &[], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let mut config = reloader(&path, &proxy.url());
    config.watch = false;
    config.rescan = Duration::from_secs(1);
    let handle = spawn(config, &metrics);
    wait_delivered(&proxy, &handle, &valid(1)).await;

    write_rename_over(&path, &valid(2));
    wait_delivered(&proxy, &handle, &valid(2)).await;
    assert_eq!(proxy.shas(), vec![sha(&valid(1)), sha(&valid(2))]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_change_reloads_the_current_content_once_more() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(1)).unwrap();
    let proxy = Proxy::start(&path, &[], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let handle = spawn(reloader(&path, &proxy.url()), &metrics);
    wait_delivered(&proxy, &handle, &valid(1)).await;

    handle.certificates_changed();
    wait_for("the second POST", || proxy.posts().len() == 2).await;
    assert_eq!(proxy.shas(), vec![sha(&valid(1)), sha(&valid(1))]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assumed_delivered_content_is_not_posted_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(1)).unwrap();
    let proxy = Proxy::start(&path, &[], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let mut config = reloader(&path, &proxy.url());
    config.assume_delivered = Some(sha(&valid(1)));
    let handle = spawn(config, &metrics);
    write_rename_over(&path, &valid(2));
    wait_delivered(&proxy, &handle, &valid(2)).await;
    assert_eq!(proxy.shas(), vec![sha(&valid(2))]);
}

/// The ACME issuer follows the origins through `config()`: each new valid
/// content is published parsed, an invalid one is not (the last valid one
/// stays).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parsed_config_follows_valid_content_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sb.yml");
    std::fs::write(&path, valid(1)).unwrap();
    let proxy = Proxy::start(&path, &[], Duration::ZERO).await;
    let metrics = Arc::new(Metrics::new());
    let handle = spawn(reloader(&path, &proxy.url()), &metrics);
    let config = handle.config();
    let origins = || config.borrow().origins.clone();
    write_rename_over(&path, &valid(2));
    wait_for("the new origin", || {
        origins() == vec!["v2.example.com".to_owned()]
    })
    .await;

    write_rename_over(&path, "proxy:\n  admin: [unclosed\n");
    wait_for("the invalid count", || {
        metrics.reloader.config_invalid.get() == 1
    })
    .await;
    assert_eq!(origins(), vec!["v2.example.com".to_owned()]);
}
