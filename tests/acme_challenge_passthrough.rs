//! Port 80's two jobs on one listener (docs/reference.md#passthrough): the
//! challenge listener, served as the node serves it, answers
//! `/.well-known/acme-challenge/*` itself and passes every other request to
//! a real HTTP server on 127.0.0.1 standing in for the proxy, which records
//! what it received. What a client gets back, what the proxy saw, and
//! `sbmesh_challenge_passthrough_total`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use sbmesh::internal::challenge::{ChallengeBook, challenge_router};
use sbmesh::internal::listener;
use sbmesh::internal::listener::Listener;
use sbmesh::{MemoryStore, Metrics, Passthrough, Upstream, with_passthrough};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const HOST: &str = "www.example.com";
const TOKEN: &str = "tok_ABC-123";
const KEY_AUTHORIZATION: &str = "tok_ABC-123.thumbprint_0-9";

/// One request as the stand-in proxy received it.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    target: String,
    headers: HeaderMap,
    body: Bytes,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

type Log = Arc<Mutex<Vec<Seen>>>;

/// The stand-in proxy: records each request, then answers by path:
/// `/redirect` is a 301 to HTTPS, `/echo` echoes the body, `/teapot` is a
/// 418 with a header of its own, anything else 200 naming what it got.
async fn proxy() -> (SocketAddr, Log) {
    async fn answer(State(log): State<Log>, req: Request) -> Response {
        let (parts, body) = req.into_parts();
        let Ok(body) = axum::body::to_bytes(body, 64 << 20).await else {
            return StatusCode::BAD_REQUEST.into_response();
        };
        let target = parts
            .uri
            .path_and_query()
            .map(|pq| pq.as_str().to_owned())
            .unwrap_or_default();
        log.lock().unwrap().push(Seen {
            method: parts.method.to_string(),
            target: target.clone(),
            headers: parts.headers.clone(),
            body: body.clone(),
        });
        match parts.uri.path() {
            "/redirect" => (
                StatusCode::MOVED_PERMANENTLY,
                [("location", format!("https://{HOST}{target}"))],
                "moved\n",
            )
                .into_response(),
            "/echo" => (
                StatusCode::CREATED,
                [("x-echo-length", body.len().to_string())],
                body,
            )
                .into_response(),
            "/teapot" => (
                StatusCode::IM_A_TEAPOT,
                [("x-proxy", "stand-in")],
                "short and stout\n",
            )
                .into_response(),
            _ => format!("proxy: {} {target}\n", parts.method).into_response(),
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Log::default();
    let router = Router::new().fallback(answer).with_state(log.clone());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    (addr, log)
}

/// The challenge listener as the node runs it (`http::listener::serve`,
/// which gives each request its peer address), passing to `passthrough`.
struct ChallengeListener {
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    _stop: watch::Sender<bool>,
}

async fn challenge_listener(
    upstream: &str,
    edit: impl FnOnce(Passthrough) -> Passthrough,
) -> ChallengeListener {
    challenge_listener_of(upstream, edit, 64).await
}

async fn challenge_listener_of(
    upstream: &str,
    edit: impl FnOnce(Passthrough) -> Passthrough,
    max_connections: usize,
) -> ChallengeListener {
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(Arc::new(MemoryStore::new()), metrics.clone());
    book.publish(TOKEN, HOST, KEY_AUTHORIZATION, Duration::from_secs(300))
        .await
        .unwrap();
    let upstream: Upstream = upstream.parse().unwrap();
    let passthrough = edit(Passthrough::new(upstream, &metrics));
    let router = with_passthrough(challenge_router(book), Arc::new(passthrough));
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let (stop, stop_rx) = watch::channel(false);
    let limits = Listener {
        name: "challenge",
        max_connections,
        header_read_timeout: listener::HEADER_READ_TIMEOUT,
    };
    tokio::spawn(listener::serve(
        tcp,
        router,
        limits,
        metrics.clone(),
        stop_rx,
    ));
    ChallengeListener {
        addr,
        metrics,
        _stop: stop,
    }
}

impl ChallengeListener {
    /// `sbmesh_challenge_passthrough_total{result}` now.
    fn passed(&self, result: &str) -> u64 {
        let text = self.metrics.encode();
        let prefix = format!("sbmesh_challenge_passthrough_total{{result=\"{result}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
    }
}

struct Answer {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// One request on a fresh connection, headers exactly as given (no Host
/// unless given), the target sent verbatim.
async fn send(
    addr: SocketAddr,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Answer {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = hyper::Request::builder().method(method).uri(target);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(Full::new(Bytes::copy_from_slice(body))).unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body,
    }
}

async fn get(addr: SocketAddr, target: &str) -> Answer {
    send(addr, "GET", target, &[("host", HOST)], b"").await
}

#[tokio::test]
async fn a_plain_get_is_the_proxys_answer_with_the_forwarded_headers() {
    let (proxy_addr, log) = proxy().await;
    let l = challenge_listener(&format!("http://{proxy_addr}"), |p| p).await;

    let answer = send(
        l.addr,
        "GET",
        "/shop/items?page=2&sort=asc",
        &[
            ("host", "www.example.com:80"),
            ("x-custom", "kept as sent"),
            ("cookie", "session=abc"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "dropped"),
        ],
        b"",
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.text(), "proxy: GET /shop/items?page=2&sort=asc\n");

    let seen = log.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let seen = &seen[0];
    assert_eq!(seen.method, "GET");
    assert_eq!(seen.target, "/shop/items?page=2&sort=asc");
    // The proxy routes by Host: the client's, not the upstream address.
    assert_eq!(seen.header("host"), Some("www.example.com:80"));
    assert_eq!(seen.header("x-custom"), Some("kept as sent"));
    assert_eq!(seen.header("cookie"), Some("session=abc"));
    assert_eq!(seen.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));
    assert_eq!(seen.header("x-forwarded-host"), Some("www.example.com:80"));
    assert_eq!(
        seen.header("x-hop"),
        None,
        "named by Connection: hop-by-hop"
    );
    assert_eq!(l.passed("ok"), 1);

    // An X-Forwarded-For the client sent is kept, this hop appended; the
    // proto and host are this hop's.
    let answer = send(
        l.addr,
        "GET",
        "/",
        &[
            ("host", HOST),
            ("x-forwarded-for", "203.0.113.9, 198.51.100.4"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "spoofed.example"),
        ],
        b"",
    )
    .await;
    assert_eq!(answer.status, 200);
    let seen = log.lock().unwrap()[1].clone();
    assert_eq!(
        seen.header("x-forwarded-for"),
        Some("203.0.113.9, 198.51.100.4, 127.0.0.1")
    );
    assert_eq!(seen.header("x-forwarded-proto"), Some("http"));
    assert_eq!(seen.header("x-forwarded-host"), Some(HOST));
    assert_eq!(l.passed("ok"), 2);
    assert_eq!(l.passed("error"), 0);
}

#[tokio::test]
async fn a_post_body_a_redirect_and_any_status_come_back_intact() {
    let (proxy_addr, log) = proxy().await;
    let l = challenge_listener(&format!("http://{proxy_addr}/"), |p| p).await;

    // 300 KB of every byte value: streamed through, both ways.
    let body: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    let answer = send(
        l.addr,
        "POST",
        "/echo?via=port80",
        &[("host", HOST), ("content-type", "application/octet-stream")],
        &body,
    )
    .await;
    assert_eq!(answer.status, 201);
    assert_eq!(answer.body.as_ref(), &body[..]);
    assert_eq!(
        answer.headers.get("x-echo-length").unwrap(),
        &body.len().to_string()
    );
    {
        let seen = log.lock().unwrap();
        assert_eq!(seen[0].method, "POST");
        assert_eq!(seen[0].target, "/echo?via=port80");
        assert_eq!(seen[0].body.as_ref(), &body[..]);
        assert_eq!(
            seen[0].header("content-type"),
            Some("application/octet-stream")
        );
    }

    // Other methods too, with their bodies.
    for method in ["PUT", "PATCH", "DELETE"] {
        let answer = send(l.addr, method, "/echo", &[("host", HOST)], b"{\"a\":1}").await;
        assert_eq!(answer.status, 201, "{method}");
        assert_eq!(answer.text(), "{\"a\":1}", "{method}");
    }

    // The proxy's redirect to HTTPS is the client's: 301 and its Location.
    let answer = get(l.addr, "/redirect?from=80").await;
    assert_eq!(answer.status, 301);
    assert_eq!(
        answer.headers.get("location").unwrap(),
        "https://www.example.com/redirect?from=80"
    );
    assert_eq!(answer.text(), "moved\n");

    let answer = get(l.addr, "/teapot").await;
    assert_eq!(answer.status, 418);
    assert_eq!(answer.headers.get("x-proxy").unwrap(), "stand-in");
    assert_eq!(answer.text(), "short and stout\n");

    // A HEAD gets the proxy's head, no body.
    let answer = send(l.addr, "HEAD", "/anything", &[("host", HOST)], b"").await;
    assert_eq!(answer.status, 200);
    assert!(answer.body.is_empty());

    assert_eq!(l.passed("ok"), 7);
    assert_eq!(log.lock().unwrap().len(), 7);
}

#[tokio::test]
async fn challenge_paths_are_answered_here_and_never_passed() {
    let (proxy_addr, log) = proxy().await;
    let l = challenge_listener(&format!("http://{proxy_addr}"), |p| p).await;

    let known = format!("/.well-known/acme-challenge/{TOKEN}");
    let answer = get(l.addr, &known).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.text(), KEY_AUTHORIZATION);

    // Whatever the responder's answer, the proxy never sees the request.
    for (method, target, host) in [
        ("GET", "/.well-known/acme-challenge/unknown-token", HOST),
        ("GET", "/.well-known/acme-challenge/not.a.token", HOST),
        ("GET", "/.well-known/acme-challenge/", HOST),
        ("GET", known.as_str(), "other.example.com"),
        ("POST", known.as_str(), HOST),
        ("HEAD", known.as_str(), HOST),
        ("GET", "/.well-known/acme-challenge/../../admin", HOST),
    ] {
        let answer = send(l.addr, method, target, &[("host", host)], b"").await;
        assert_eq!(answer.status, 404, "{method} {target} (Host {host})");
    }
    assert!(log.lock().unwrap().is_empty(), "{:?}", log.lock().unwrap());
    assert_eq!(l.passed("ok"), 0);

    // Next to the prefix is not under it: passed.
    let answer = get(l.addr, "/.well-known/acme-challenge").await;
    assert_eq!(answer.status, 200);
    let answer = get(l.addr, "/.well-known/security.txt").await;
    assert_eq!(answer.text(), "proxy: GET /.well-known/security.txt\n");
    assert_eq!(l.passed("ok"), 2);
}

#[tokio::test]
async fn a_proxy_that_does_not_answer_gets_the_client_a_502() {
    // Connection refused: a port nothing listens on any more.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let down = closed.local_addr().unwrap();
    drop(closed);
    let l = challenge_listener(&format!("http://{down}"), |p| p).await;
    for _ in 0..3 {
        let answer = get(l.addr, "/").await;
        assert_eq!(answer.status, 502);
    }
    assert_eq!(l.passed("error"), 3);
    assert_eq!(l.passed("ok"), 0);
    // The challenge is still answered meanwhile.
    let answer = get(l.addr, &format!("/.well-known/acme-challenge/{TOKEN}")).await;
    assert_eq!(answer.status, 200);

    // Accepts, reads, never answers: 502 once the response head is late.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut stream, _)) = silent.accept().await {
            let mut buf = [0u8; 1024];
            let _ = stream.read(&mut buf).await;
            held.push(stream);
        }
    });
    let l = challenge_listener(&format!("http://{silent_addr}"), |p| {
        p.with_response_timeout(Duration::from_millis(300))
    })
    .await;
    let started = std::time::Instant::now();
    let answer = get(l.addr, "/slow").await;
    assert_eq!(answer.status, 502);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(l.passed("error"), 1);
}

#[tokio::test]
async fn a_body_over_the_limit_gets_413() {
    let (proxy_addr, log) = proxy().await;
    let l = challenge_listener(&format!("http://{proxy_addr}"), |p| {
        p.with_max_request_body(1024)
    })
    .await;

    // Declared too large: refused before the proxy is asked.
    let answer = send(l.addr, "POST", "/echo", &[("host", HOST)], &[b'x'; 2048]).await;
    assert_eq!(answer.status, 413);
    assert!(log.lock().unwrap().is_empty());
    // At the limit: passed.
    let answer = send(l.addr, "POST", "/echo", &[("host", HOST)], &[b'x'; 1024]).await;
    assert_eq!(answer.status, 201);
    assert_eq!(answer.body.len(), 1024);

    // Chunked, growing past the limit: cut, 413.
    let mut stream = TcpStream::connect(l.addr).await.unwrap();
    let mut request =
        format!("POST /echo HTTP/1.1\r\nhost: {HOST}\r\ntransfer-encoding: chunked\r\n\r\n")
            .into_bytes();
    for _ in 0..4 {
        request.extend_from_slice(format!("{:x}\r\n", 512).as_bytes());
        request.extend_from_slice(&[b'y'; 512]);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    stream.write_all(&request).await.unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0, "closed without an answer");
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 413 "), "{head}");

    assert_eq!(l.passed("too_large"), 2);
    assert_eq!(l.passed("ok"), 1);
    assert_eq!(
        log.lock().unwrap().len(),
        1,
        "only the request at the limit"
    );
}

/// Nothing a client sends makes the listener fall over: odd targets and
/// methods get an answer, and the listener keeps answering.
#[tokio::test]
async fn odd_requests_get_answers() {
    let (proxy_addr, log) = proxy().await;
    let l = challenge_listener(&format!("http://{proxy_addr}"), |p| p).await;

    let answer = send(l.addr, "CONNECT", "www.example.com:443", &[], b"").await;
    assert_eq!(answer.status, 405);
    // No Host header at all (HTTP/1.0 style): passed, with the proxy's
    // own address as Host (HTTP/1.1 needs one) and no X-Forwarded-Host.
    let answer = send(l.addr, "GET", "/no-host", &[], b"").await;
    assert_eq!(answer.status, 200);
    // Absolute form: its authority stands for the Host; the path goes to
    // the proxy, never the named server.
    let answer = send(
        l.addr,
        "GET",
        "http://elsewhere.example/abs?x=1",
        &[("host", "elsewhere.example")],
        b"",
    )
    .await;
    assert_eq!(answer.text(), "proxy: GET /abs?x=1\n");
    let answer = send(l.addr, "OPTIONS", "*", &[("host", HOST)], b"").await;
    assert_eq!(answer.status, 400);
    let answer = send(l.addr, "BREW", "/pot", &[("host", HOST)], b"").await;
    assert_eq!(answer.text(), "proxy: BREW /pot\n");

    let seen = log.lock().unwrap().clone();
    assert_eq!(
        seen[0].header("host"),
        Some(proxy_addr.to_string().as_str())
    );
    assert_eq!(seen[0].header("x-forwarded-host"), None);
    assert_eq!(seen[1].header("host"), Some("elsewhere.example"));
    assert_eq!(
        seen[1].header("x-forwarded-host"),
        Some("elsewhere.example")
    );
    assert_eq!(
        get(l.addr, "/still-up").await.text(),
        "proxy: GET /still-up\n"
    );
}

/// Without a passthrough (the default), every other path stays `404` and
/// nothing is counted.
#[tokio::test]
async fn without_a_passthrough_other_paths_stay_404() {
    let metrics = Arc::new(Metrics::new());
    let book = ChallengeBook::new(Arc::new(MemoryStore::new()), metrics.clone());
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let router = challenge_router(book);
    tokio::spawn(async move { axum::serve(tcp, router).await.unwrap() });
    let answer = send(addr, "GET", "/", &[("host", HOST)], b"").await;
    assert_eq!(answer.status, 404);
    assert!(
        metrics
            .encode()
            .contains("sbmesh_challenge_passthrough_total{result=\"ok\"} 0")
    );
}

/// A body fed from a channel: a response the stand-in proxy sends in parts.
struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(hyper::body::Frame::data(c))))
    }
}

/// A response still streaming from the proxy keeps its connection busy: at
/// the listener's connection limit an idle connection is closed, never the
/// one still receiving its answer.
#[tokio::test]
async fn a_streaming_answer_is_not_an_idle_connection() {
    type Rest = Arc<Mutex<Option<tokio::sync::mpsc::Sender<Bytes>>>>;
    let rest: Rest = Rest::default();
    let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    let router = Router::new()
        .fallback(|State(rest): State<Rest>| async move {
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tx.send(Bytes::from_static(b"first part;")).await.unwrap();
            *rest.lock().unwrap() = Some(tx);
            Response::new(axum::body::Body::new(ChannelBody(rx)))
        })
        .with_state(rest.clone());
    tokio::spawn(async move { axum::serve(upstream, router).await.unwrap() });
    let l = challenge_listener_of(&format!("http://{upstream_addr}"), |p| p, 2).await;

    // A download: the head and its first part arrive, the rest waits.
    let stream = TcpStream::connect(l.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .uri("/download")
        .header("host", HOST)
        .body(Full::new(Bytes::new()))
        .unwrap();
    let mut download = sender.send_request(req).await.unwrap().into_body();
    let first = download
        .frame()
        .await
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap();
    assert_eq!(first.as_ref(), b"first part;");

    // Two more connections, idle: the second reaches the limit of 2.
    let mut idle = TcpStream::connect(l.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _newest = TcpStream::connect(l.addr).await.unwrap();
    // The idle one is closed for it...
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(5), idle.read(&mut buf))
        .await
        .expect("the idle connection is closed");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");

    // ... and the download completes.
    let tx = rest.lock().unwrap().take().unwrap();
    tx.send(Bytes::from_static(b"second part")).await.unwrap();
    drop(tx);
    let mut tail = Vec::new();
    while let Some(frame) = download.frame().await {
        let frame = frame.expect("the download is not cut");
        if let Ok(data) = frame.into_data() {
            tail.extend_from_slice(&data);
        }
    }
    assert_eq!(tail, b"second part");
    assert!(l.metrics.encode().contains(
        "sbmesh_http_connections_closed_total{listener=\"challenge\",reason=\"limit\"} 1"
    ));
}
