//! `--challenge-passthrough` as a user meets it (docs/reference.md#passthrough):
//! real `sbmesh-sidecar run` processes on 127.0.111.*, their challenge port
//! standing in for a Service's port 80, and a real HTTP server on
//! 127.0.0.1 standing in for the proxy's HTTP listener in the same pod.
//! The flag and its variable reach the listener; a redirect, a POST and the
//! forwarding headers go through; a challenge path never does; a proxy that
//! is down gets `502`; `/metrics` counts each; a value that is not
//! `http://host:port` stops `run` with exit 2, naming the flag.

mod common;

use std::net::{SocketAddr, SocketAddrV4};
use std::process::{Command, Stdio};

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use common::{
    CHALLENGE_PORT, Cluster, HttpResponse, deadline, http_raw, metric_sum, poll_until, sidecar_bin,
};

const HOST: &str = "shop.example.com";

/// The stand-in for the proxy: `/old` is a 301 to HTTPS; anything else is
/// 200 and says what it received, forwarding headers included.
fn proxy() -> SocketAddr {
    async fn answer(req: Request) -> Response {
        let (parts, body) = req.into_parts();
        let Ok(body) = axum::body::to_bytes(body, 1 << 20).await else {
            return StatusCode::BAD_REQUEST.into_response();
        };
        let target = parts
            .uri
            .path_and_query()
            .map(|pq| pq.as_str().to_owned())
            .unwrap_or_default();
        if parts.uri.path() == "/old" {
            return (
                StatusCode::MOVED_PERMANENTLY,
                [("location", format!("https://{HOST}/new"))],
            )
                .into_response();
        }
        let header = |name: &str| {
            parts
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_owned()
        };
        format!(
            "{} {target} host={} xff={} proto={} xhost={} body={}",
            parts.method,
            header("host"),
            header("x-forwarded-for"),
            header("x-forwarded-proto"),
            header("x-forwarded-host"),
            String::from_utf8_lossy(&body),
        )
        .into_response()
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let router = Router::new().fallback(answer);
            axum::serve(listener, router).await.unwrap();
        });
    });
    addr
}

fn request(addr: SocketAddr, method: &str, target: &str, extra: &str, body: &str) -> HttpResponse {
    let raw = format!(
        "{method} {target} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n{extra}\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    http_raw(addr, raw.as_bytes()).unwrap_or_else(|e| panic!("{method} {target}: {e}"))
}

fn passed(text: &str, result: &str) -> f64 {
    metric_sum(
        text,
        "sbmesh_challenge_passthrough_total",
        &[("result", result)],
    )
    .unwrap_or_else(|| panic!("no sbmesh_challenge_passthrough_total{{result={result:?}}}"))
}

#[test]
fn the_challenge_port_passes_other_requests_to_the_proxy() {
    let upstream = proxy();
    let mut cluster = Cluster::new("127.0.111");
    // Node 1: the flag, to the running proxy. Node 2: the variable, to a
    // proxy that is down (a port nothing listens on). Node 3: neither.
    let mut opts = cluster.default_opts(1, 1);
    opts.seeds.clear();
    opts.extra_args = vec![
        "--challenge-passthrough".into(),
        format!("http://{upstream}"),
    ];
    let one = cluster.spawn(opts);
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut opts = cluster.default_opts(2, 1);
    opts.seeds.clear();
    let mut node = common::Node::prepare(&cluster.bin, &cluster.config, &cluster.dir, opts);
    node.env.push((
        "SBMESH_CHALLENGE_PASSTHROUGH".into(),
        format!("http://{down}"),
    ));
    node.start();
    cluster.nodes.push(node);
    let two = cluster.nodes.len() - 1;
    let mut opts = cluster.default_opts(3, 1);
    opts.seeds.clear();
    let three = cluster.spawn(opts);

    let port80 =
        |i: usize| SocketAddr::V4(SocketAddrV4::new(cluster.nodes[i].opts.ip, CHALLENGE_PORT));
    let (a, b, c) = (port80(one), port80(two), port80(three));
    // Polled on a challenge path: never passed, so never counted.
    cluster.wait_until("the challenge listeners answer", || {
        [a, b, c].iter().all(|addr| {
            http_raw(
                *addr,
                b"GET /.well-known/acme-challenge/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            )
            .is_ok()
        })
    });

    // A plain GET: the proxy's answer, with what it was told.
    let r = request(a, "GET", "/cart?item=7", "", "");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.text(),
        format!("GET /cart?item=7 host={HOST} xff=127.0.0.1 proto=http xhost={HOST} body=")
    );
    // A redirect to HTTPS stays one.
    let r = request(a, "GET", "/old", "", "");
    assert_eq!(r.status, 301);
    assert_eq!(r.header("location"), Some("https://shop.example.com/new"));
    // A POST with its body; a client's X-Forwarded-For kept, ours appended.
    let r = request(
        a,
        "POST",
        "/checkout",
        "X-Forwarded-For: 198.51.100.23\r\nContent-Type: application/x-www-form-urlencoded\r\n",
        "card=none&total=12",
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.text(),
        format!(
            "POST /checkout host={HOST} xff=198.51.100.23, 127.0.0.1 proto=http xhost={HOST} \
             body=card=none&total=12"
        )
    );
    // The challenge path is the responder's (no such token: 404), never
    // the proxy's: its answer would be 200.
    let r = request(
        a,
        "GET",
        "/.well-known/acme-challenge/no-such-token",
        "",
        "",
    );
    assert_eq!(r.status, 404, "{}", r.text());

    // The proxy is down: 502, the challenge still answered.
    let r = request(b, "GET", "/", "", "");
    assert_eq!(r.status, 502);
    let r = request(
        b,
        "GET",
        "/.well-known/acme-challenge/no-such-token",
        "",
        "",
    );
    assert_eq!(r.status, 404);

    // No passthrough: every other path stays 404.
    let r = request(c, "GET", "/cart", "", "");
    assert_eq!(r.status, 404);

    let metrics = |i: usize| {
        let mut text = String::new();
        assert!(
            poll_until(deadline(), || {
                text = cluster.nodes[i].metrics().unwrap_or_default();
                !text.is_empty()
            }),
            "no /metrics from node {i}"
        );
        text
    };
    let m = metrics(one);
    assert_eq!(passed(&m, "ok"), 3.0, "{m}");
    assert_eq!(passed(&m, "error"), 0.0);
    let m = metrics(two);
    assert_eq!(passed(&m, "error"), 1.0, "{m}");
    assert_eq!(passed(&m, "ok"), 0.0);
    let m = metrics(three);
    assert_eq!(passed(&m, "ok") + passed(&m, "error"), 0.0, "{m}");
}

#[test]
fn a_passthrough_that_is_not_http_host_port_stops_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sb.yml");
    std::fs::write(&config, "origins: {}\n").unwrap();
    let config = config.to_str().unwrap();
    for (how, value) in [
        ("flag", "https://127.0.0.1:8443"),
        ("env", "127.0.0.1:8080"),
    ] {
        let mut cmd = Command::new(sidecar_bin());
        cmd.args(["run", "--config", config])
            .env_remove("SBMESH_CLUSTER_KEY")
            .env_remove("SBMESH_CHALLENGE_PASSTHROUGH")
            .stdin(Stdio::null());
        match how {
            "flag" => cmd.args(["--challenge-passthrough", value]),
            _ => cmd.env("SBMESH_CHALLENGE_PASSTHROUGH", value),
        };
        let out = cmd.output().expect("sidecar runs");
        assert_eq!(out.status.code(), Some(2), "{how}: {out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find(|l| l.starts_with("--challenge-passthrough: "))
            .unwrap_or_else(|| panic!("{how}: no problem named by the flag in {stdout}"));
        assert!(
            line.contains(&format!("{value:?} is not an http://host:port URL"))
                && line.contains("e.g. http://127.0.0.1:8080")
                && line.contains("SBMESH_CHALLENGE_PASSTHROUGH"),
            "{line}"
        );
    }
}
