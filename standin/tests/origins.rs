//! The stand-in's data port answers for the running config's `origins`:
//! a `mock` action with its status, body and headers, any other action
//! `502` (nothing is dialled), and the answers follow the config the proxy
//! runs (a reload, its own watcher), never a file it refused.

mod common;

#[path = "../../tests/kubelet/mod.rs"]
mod kubelet;

use std::time::{Duration, Instant};

use common::*;

const AUTH: (&str, &str) = ("admin", "changeme");

/// The config with the admin API on `admin`, the data port on `http` and
/// `origins` (lines indented 2).
fn with_origins(admin: u16, http: u16, origins: &str) -> String {
    format!("{}origins:\n{origins}", config(admin, http, "", ""))
}

/// `demo.example.com` answering `body`.
fn demo(admin: u16, http: u16, body: &str) -> String {
    with_origins(
        admin,
        http,
        &format!(
            "  \"demo.example.com\":\n    action: {{ type: mock, status: 200, body: \"{body}\\n\" }}\n"
        ),
    )
}

/// `GET /` for `demo.example.com`: status and body.
fn get_demo(http: u16) -> (u16, String) {
    let (status, _, body) = request_to_host(http, "GET", "/", "demo.example.com");
    (status, body)
}

/// Waits until `demo.example.com` answers `want`.
fn wait_body(p: &Proxy, http: u16, want: &str) {
    let until = Instant::now() + DEADLINE;
    loop {
        let (status, body) = get_demo(http);
        if status == 200 && body == want {
            return;
        }
        assert!(
            Instant::now() < until,
            "still {status} {body:?}, not {want:?}:\n{}",
            p.stderr()
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

#[test]
fn a_mock_origin_answers_with_its_status_body_and_headers() {
    let (admin, http) = (free_port(), free_port());
    // Where a `proxy` action points: it must never be dialled.
    let upstream = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    upstream.set_nonblocking(true).unwrap();
    let upstream_port = upstream.local_addr().unwrap().port();
    let text = with_origins(
        admin,
        http,
        &format!(
            "  \"demo.example.com\":\n    action:\n      type: mock\n      status: 200\n      body: \"hello from sbproxy\\n\"\n      headers: {{ X-Config: one }}\n  \"teapot.example.com\":\n    action: {{ type: mock, status: 418, body: short and stout }}\n  \"empty.example.com\":\n    action: {{ type: mock }}\n  \"api.example.com\":\n    action: {{ type: proxy, url: \"http://127.0.0.1:{upstream_port}\" }}\n  \"bare.example.com\": {{}}\n"
        ),
    );
    let cfg = ConfigDir::new(&text);
    let p = Proxy::start(&cfg.path(), admin, &[]);

    let (status, head, body) = request_to_host(http, "GET", "/", "demo.example.com");
    assert_eq!((status, body.as_str()), (200, "hello from sbproxy\n"));
    assert!(
        head.to_ascii_lowercase().contains("\r\nx-config: one"),
        "{head}"
    );
    // Any method and path; the Host case-insensitive, its port stripped;
    // `/health` is the origin's too.
    for (method, path, host) in [
        ("GET", "/", "demo.example.com:8080"),
        ("GET", "/", "DEMO.Example.COM"),
        ("POST", "/cart?item=7", "Demo.example.com:80"),
        ("GET", "/health", "demo.example.com"),
    ] {
        let (status, _, body) = request_to_host(http, method, path, host);
        assert_eq!(
            (status, body.as_str()),
            (200, "hello from sbproxy\n"),
            "{method} {path} Host: {host}"
        );
    }
    let (status, _, body) = request_to_host(http, "GET", "/", "teapot.example.com");
    assert_eq!((status, body.as_str()), (418, "short and stout"));
    let (status, _, body) = request_to_host(http, "GET", "/x", "empty.example.com");
    assert_eq!((status, body.as_str()), (200, ""));

    // Other actions: 502, saying why; nothing dialled.
    for host in ["api.example.com", "bare.example.com:8080"] {
        let (status, _, body) = request_to_host(http, "GET", "/", host);
        assert_eq!(status, 502, "{host}: {body}");
        assert!(body.contains("no upstreams"), "{host}: {body}");
    }
    assert!(
        upstream
            .accept()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
        "the stand-in dialled the proxy action's url"
    );

    // No origin for the Host: /health 200, anything else 404.
    for host in ["unknown.example.com", "127.0.0.1", "sub.demo.example.com"] {
        let (status, _, body) = request_to_host(http, "GET", "/health", host);
        assert_eq!((status, body.as_str()), (200, "ok"), "{host}");
        let (status, _, _) = request_to_host(http, "GET", "/", host);
        assert_eq!(status, 404, "{host}");
    }
    assert_eq!(request(http, "GET", "/health", None).0, 200);
    drop(p);
}

#[test]
fn a_reload_changes_the_answer_and_a_refused_file_does_not() {
    let (admin, http) = (free_port(), free_port());
    let first = demo(admin, http, "one");
    let cfg = ConfigDir::new(&first);
    let p = Proxy::start(&cfg.path(), admin, &[]);
    assert_eq!(get_demo(http), (200, "one\n".to_owned()));

    // A new file, POSTed: the new body once the POST answers.
    let second = demo(admin, http, "two");
    cfg.write(&second);
    let (status, body) = p.reload(AUTH);
    assert_eq!(status, 200, "{body}");
    assert_eq!(get_demo(http), (200, "two\n".to_owned()));
    assert_eq!(p.revision(AUTH), sha256_hex(second.as_bytes()));

    // A status that is not an integer: refused, the old body stays.
    let bad = with_origins(
        admin,
        http,
        "  \"demo.example.com\":\n    action: { type: mock, status: \"two hundred\", body: \"three\\n\" }\n",
    );
    cfg.write(&bad);
    let (status, body) = p.reload(AUTH);
    assert_eq!(status, 400, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("origins.\"demo.example.com\".action.status"),
        "{error}"
    );
    assert_eq!(get_demo(http), (200, "two\n".to_owned()));
    // Unparsable YAML: the same.
    cfg.write(&format!("{second}origins: [\n"));
    assert_eq!(p.reload(AUTH).0, 400);
    assert_eq!(get_demo(http), (200, "two\n".to_owned()));
    assert_eq!(p.revision(AUTH), sha256_hex(second.as_bytes()));

    // The origin removed: its Host now gets the no-origin answers.
    let third = config(admin, http, "", "");
    cfg.write(&third);
    assert_eq!(p.reload(AUTH).0, 200);
    assert_eq!(get_demo(http).0, 404);
    assert_eq!(
        request_to_host(http, "GET", "/health", "demo.example.com").0,
        200
    );
}

#[test]
fn the_proxys_own_watcher_changes_the_answer_with_the_revision() {
    let (admin, http) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let first = demo(admin, http, "v1");
    let mut mount = kubelet::Kubelet::new(dir.path(), &first);
    let p = Proxy::start(&mount.path(), admin, &[]);
    assert_eq!(get_demo(http), (200, "v1\n".to_owned()));

    let second = demo(admin, http, "v2");
    mount.publish(&second);
    let want = sha256_hex(second.as_bytes());
    let until = Instant::now() + DEADLINE;
    loop {
        // The body is read after the revision: once the revision is the
        // new one, so is the body.
        let revision = p.revision(AUTH);
        let (status, body) = get_demo(http);
        if revision == want {
            assert_eq!((status, body.as_str()), (200, "v2\n"));
            break;
        }
        assert!(Instant::now() < until, "not applied:\n{}", p.stderr());
        std::thread::sleep(Duration::from_millis(25));
    }
    wait_body(&p, http, "v2\n");

    // A file the proxy refuses: the watcher does not apply it.
    mount.publish(&with_origins(
        admin,
        http,
        "  \"demo.example.com\":\n    action: { type: mock, status: 2.5, body: \"v3\\n\" }\n",
    ));
    p.wait_stderr("origins.\"demo.example.com\".action.status");
    assert_eq!(get_demo(http), (200, "v2\n".to_owned()));
    assert_eq!(p.revision(AUTH), want);

    // The next good file is applied.
    mount.publish(&demo(admin, http, "v4"));
    wait_body(&p, http, "v4\n");
}
