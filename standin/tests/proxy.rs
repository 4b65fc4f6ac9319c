//! The stand-in `sbproxy` as a real process: start-up refusals, the admin
//! API's reload answers, the proxy's own watcher, signals.

mod common;

#[path = "../../tests/kubelet/mod.rs"]
mod kubelet;

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use common::*;

const DEFAULT_AUTH: (&str, &str) = ("admin", "changeme");

/// Starts the binary on `text` and expects it to refuse: exit 1, `needle`
/// on stderr.
fn assert_refused(text: &str, needle: &str) {
    let cfg = ConfigDir::new(text);
    let mut p = Proxy::spawn(&cfg.path(), free_port(), &[]);
    let (status, stderr) = p.wait_exit();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(needle),
        "stderr does not name {needle}:\n{stderr}"
    );
}

#[test]
fn refuses_an_unknown_key_in_proxy_admin() {
    let admin = free_port();
    assert_refused(
        &config(admin, free_port(), "    passwrd: secret\n", ""),
        "proxy.admin.passwrd",
    );
}

#[test]
fn refuses_proxy_acme_eab() {
    assert_refused(
        "proxy:\n  acme:\n    enabled: false\n    eab: {kid: k, hmac_key: h}\n",
        "proxy.acme.eab",
    );
}

#[test]
fn refuses_unknown_keys_in_sub_blocks_and_wrong_types() {
    assert_refused(
        "proxy:\n  cluster:\n    security: {mode: shared_key, colour: red}\n",
        "proxy.cluster.security.colour",
    );
    assert_refused(
        "proxy:\n  admin:\n    operators:\n      - {username: a, role: admin, rol: x}\n",
        "proxy.admin.operators[0].rol",
    );
    assert_refused("proxy:\n  admin:\n    port: \"9090\"\n", "proxy.admin.port");
    assert_refused("proxy:\n  http_bind_port: 0\n", "proxy.http_bind_port");
    assert_refused(
        "proxy:\n  admin:\n    enabled: \"true\"\n",
        "proxy.admin.enabled",
    );
    assert_refused("proxy:\n  acme:\n    enabled: 1\n", "proxy.acme.enabled");
    assert_refused("proxy: [\n", "failed to parse config");
}

#[test]
fn top_level_unknown_keys_only_warn_and_extensions_is_free() {
    let admin = free_port();
    let text = format!(
        "whatever: {{a: 1}}\n{}",
        config(
            admin,
            free_port(),
            "",
            "  extensions:\n    sbmesh: {cluster_id: demo, anything: [1, 2]}\n    other: 3\n"
        )
    );
    let cfg = ConfigDir::new(&text);
    let p = Proxy::start(&cfg.path(), admin, &[]);
    p.wait_stderr("whatever");
}

/// Every key docs/reference.md#the-proxy lists for `proxy.admin`, `proxy.cluster` and
/// `proxy.acme`, with the proxy's mesh on free ports.
#[test]
fn accepts_every_key_of_section_10() {
    let (admin, http, gossip, transport) = (free_port(), free_port(), free_port(), free_port());
    let text = format!(
        r#"proxy:
  http_bind_port: {http}
  admin:
    enabled: true
    port: {admin}
    username: admin
    password: changeme
    max_log_entries: 1000
    rate_limit_per_minute: 240
    prompt_persistence_path: /var/lib/sbproxy/prompts
    prompt_persistence_encryption:
      enabled: false
      key: "00"
      previous_keys: []
    trace_url_template: "https://trace.example/{{trace_id}}"
    tls:
      cert: /etc/sbproxy/admin.crt
      key: /etc/sbproxy/admin.key
    bind: 127.0.0.1
    allow_ips: []
    cors_origins: ["https://console.example.com"]
    operators:
      - username: ops
        password_hash: "$$argon2id$$v=19$$x"
        role: admin
        tenant: default
  cluster:
    cluster_id: demo
    node_id: ${{POD_NAME:-demo-proxy-0}}
    roles: [gateway, worker, authority]
    labels: {{zone: a}}
    seeds: ["127.0.0.1:{gossip}"]
    gossip_port: {gossip}
    transport_port: {transport}
    advertise_addr: "127.0.0.1:{gossip}"
    transport_advertise_addr: "127.0.0.1:{transport}"
    model_bind: "127.0.0.1:0"
    model_endpoint: "http://127.0.0.1:1"
    state_dir: /var/lib/sbproxy/cluster
    security:
      mode: shared_key
      development: true
      shared_key: "env:CLUSTER_KEY"
      cert_file: /etc/sbproxy/mesh.crt
      key_file: /etc/sbproxy/mesh.key
      ca_file: /etc/sbproxy/ca.crt
      server_name: mesh.local
      key_derivation: hkdf
    snapshot_ttl_secs: 60
    publish_interval_secs: 5
    dead_peer_gc_secs: 300
    enrollment:
      authority_dir: /var/lib/sbproxy/authority
      allow_insecure_http: false
    deployment_authority:
      signing_key_file: /etc/sbproxy/sign.key
      verifying_key_file: /etc/sbproxy/verify.key
    replication:
      factor: 3
      write_consistency: quorum
      read_consistency: one
      anti_entropy_interval_secs: 30
      tombstone_gc_grace_secs: 600
      max_entries: 10000
      max_value_bytes: 65536
  acme:
    enabled: true
    email: ops@example.com
    directory_url: https://acme-v02.api.letsencrypt.org/directory
    challenge_types: [http-01]
    storage_backend: redb
    storage_path: /var/lib/sbproxy/certs
    renew_before_days: 30
    ca_root: /etc/sbproxy/acme-root.pem
origins:
  "api.example.com": {{}}
"#
    );
    let cfg = ConfigDir::new(&text);
    let p = Proxy::start(&cfg.path(), admin, &[]);
    // The proxy's own mesh holds both ports.
    assert!(
        UdpSocket::bind(("127.0.0.1", gossip)).is_err(),
        "gossip port not bound"
    );
    assert!(
        std::net::TcpListener::bind(("127.0.0.1", transport)).is_err(),
        "transport port not bound"
    );
    assert_eq!(request(http, "GET", "/health", None).0, 200);
    assert_eq!(request(http, "GET", "/nothing", None).0, 404);
    for path in ["/healthz", "/livez", "/readyz", "/health"] {
        assert_eq!(p.request("GET", path, None).0, 200, "{path}");
    }
    let (_, health) = p.request("GET", "/health", None);
    let health: serde_json::Value = serde_json::from_str(&health).unwrap();
    assert_eq!(health["status"], "ok");
    assert!(health["checks"].is_object());
    p.wait_stderr("ACME");
    // The same file reloads.
    let (status, body) = p.reload(DEFAULT_AUTH);
    assert_eq!(status, 200, "{body}");
}

#[test]
fn refuses_to_start_when_a_cluster_port_is_taken() {
    let (admin, gossip, transport) = (free_port(), free_port(), free_port());
    let _taken = UdpSocket::bind(("127.0.0.1", gossip)).unwrap();
    let text = config(
        admin,
        free_port(),
        "",
        &format!("  cluster:\n    gossip_port: {gossip}\n    transport_port: {transport}\n"),
    );
    let cfg = ConfigDir::new(&text);
    let mut p = Proxy::spawn(&cfg.path(), admin, &[]);
    let (status, stderr) = p.wait_exit();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&gossip.to_string()), "{stderr}");

    let _taken = std::net::TcpListener::bind(("127.0.0.1", transport)).unwrap();
    let gossip = free_port();
    let text = config(
        admin,
        free_port(),
        "",
        &format!("  cluster:\n    gossip_port: {gossip}\n    transport_port: {transport}\n"),
    );
    let cfg = ConfigDir::new(&text);
    let mut p = Proxy::spawn(&cfg.path(), admin, &[]);
    let (status, stderr) = p.wait_exit();
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&transport.to_string()), "{stderr}");
}

#[test]
fn reload_answers() {
    let (admin, http) = (free_port(), free_port());
    let first = config(admin, http, "", "");
    let cfg = ConfigDir::new(&first);
    let p = Proxy::start(&cfg.path(), admin, &[]);

    // No credentials, wrong ones.
    let (status, head, _) = request_full(admin, "POST", "/admin/reload", None, &[]);
    assert_eq!(status, 401);
    assert!(
        head.to_ascii_lowercase()
            .contains("www-authenticate: basic"),
        "{head}"
    );
    assert_eq!(
        p.request("POST", "/admin/reload", Some(("admin", "wrong")))
            .0,
        401
    );
    assert_eq!(
        p.request("POST", "/admin/reload", Some(("root", "changeme")))
            .0,
        401
    );
    let (status, _, _) = request_full(
        admin,
        "POST",
        "/admin/reload",
        None,
        &["Authorization: Bearer x"],
    );
    assert_eq!(status, 401);
    // Another method.
    assert_eq!(p.request("GET", "/admin/reload", Some(DEFAULT_AUTH)).0, 405);

    // The defaults admin/changeme, unchanged file: rebuilt all the same.
    let (status, body) = p.reload(DEFAULT_AUTH);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["config_revision"], sha256_hex(first.as_bytes()));
    assert_eq!(body["fully_applied"], true);
    assert_eq!(body["degraded"], serde_json::json!([]));
    let loaded_at = body["loaded_at"].as_str().unwrap();
    assert!(
        loaded_at.len() >= 20 && loaded_at.as_bytes()[10] == b'T' && loaded_at.ends_with('Z'),
        "{loaded_at}"
    );
    assert_eq!(body.as_object().unwrap().len(), 4, "{body}");

    // An unknown strict key: 400, the running config stays.
    cfg.write(&config(admin, http, "    passwrd: x\n", ""));
    let (status, body) = p.reload(DEFAULT_AUTH);
    assert_eq!(status, 400, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(error.starts_with("failed to parse config: "), "{error}");
    assert!(error.contains("proxy.admin.passwrd"), "{error}");
    assert_eq!(p.revision(DEFAULT_AUTH), sha256_hex(first.as_bytes()));
    // Unparsable YAML: 400 too.
    cfg.write("proxy: [\n");
    let (status, body) = p.reload(DEFAULT_AUTH);
    assert_eq!(status, 400, "{body}");
    assert_eq!(p.revision(DEFAULT_AUTH), sha256_hex(first.as_bytes()));

    // A later valid file reloads.
    let second = format!("{first}  https_bind_port: null\n");
    cfg.write(&second);
    let (status, body) = p.reload(DEFAULT_AUTH);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["config_revision"], sha256_hex(second.as_bytes()));
    assert_eq!(body["fully_applied"], true);

    // A change under proxy.admin needs a restart: applied, degraded, and
    // the admin API keeps its start-up credentials.
    let third = config(admin, http, "    password: other\n", "");
    cfg.write(&third);
    let (status, body) = p.reload(DEFAULT_AUTH);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["config_revision"], sha256_hex(third.as_bytes()));
    assert_eq!(body["fully_applied"], false);
    assert_eq!(body["degraded"], serde_json::json!(["proxy.admin"]));
    assert_eq!(
        p.request("POST", "/admin/reload", Some(("admin", "other")))
            .0,
        401
    );

    // An unreadable file: 500.
    std::fs::remove_file(cfg.path()).unwrap();
    let (status, body) = p.reload(DEFAULT_AUTH);
    assert_eq!(status, 500, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .starts_with("failed to read config file"),
        "{body}"
    );
}

#[test]
fn reload_uses_the_configured_credentials() {
    let (admin, http) = (free_port(), free_port());
    let cfg = ConfigDir::new(&config(
        admin,
        http,
        "    username: ops\n    password: ${ADMIN_PW}\n",
        "",
    ));
    let p = Proxy::start(&cfg.path(), admin, &[("ADMIN_PW", "s3cret")]);
    assert_eq!(
        p.request("POST", "/admin/reload", Some(DEFAULT_AUTH)).0,
        401
    );
    assert_eq!(p.reload(("ops", "s3cret")).0, 200);
}

#[test]
fn a_second_reload_while_one_runs_is_409() {
    let (admin, http) = (free_port(), free_port());
    let cfg = ConfigDir::new(&config(admin, http, "", ""));
    let p = Proxy::start(&cfg.path(), admin, &[("SBPROXY_STANDIN_RELOAD_MS", "1500")]);
    let port = p.admin_port;
    let posts: Vec<_> = (0..2)
        .map(|_| {
            std::thread::spawn(move || request(port, "POST", "/admin/reload", Some(DEFAULT_AUTH)))
        })
        .collect();
    let mut answers: Vec<(u16, String)> = posts.into_iter().map(|t| t.join().unwrap()).collect();
    answers.sort();
    assert_eq!(answers[0].0, 200, "{answers:?}");
    assert_eq!(answers[1].0, 409, "{answers:?}");
    let body: serde_json::Value = serde_json::from_str(&answers[1].1).unwrap();
    assert_eq!(body, serde_json::json!({"error": "reload in progress"}));
}

#[test]
fn allow_ips_and_rate_limit() {
    // 127.0.0.1 outside allow_ips: 403 (probes still answer).
    let (admin, http) = (free_port(), free_port());
    let cfg = ConfigDir::new(&config(
        admin,
        http,
        "    allow_ips: [\"10.9.9.9\", \"192.0.2.0/24\"]\n",
        "",
    ));
    let p = Proxy::start(&cfg.path(), admin, &[]);
    assert_eq!(
        p.request("POST", "/admin/reload", Some(DEFAULT_AUTH)).0,
        403
    );
    assert_eq!(p.request("GET", "/healthz", None).0, 200);
    drop(p);

    // Another loopback address is loopback too.
    let (admin, http) = (free_port(), free_port());
    let cfg = ConfigDir::new(&config(
        admin,
        http,
        "    bind: 0.0.0.0\n    rate_limit_per_minute: 3\n",
        "",
    ));
    let p = Proxy::start(&cfg.path(), admin, &[]);
    let statuses: Vec<u16> = (0..4)
        .map(|_| p.request("POST", "/admin/reload", Some(DEFAULT_AUTH)).0)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 429]);
    let (status, _) = try_request_from(admin, "127.0.0.2");
    assert_eq!(status, 200, "a fresh loopback peer has its own budget");
}

/// `POST /admin/reload` from `source` (a local address).
fn try_request_from(port: u16, source: &str) -> (u16, String) {
    use std::io::{Read, Write};
    // std cannot bind before connecting; tokio's TcpSocket can.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let stream = rt.block_on(async {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(format!("{source}:0").parse().unwrap()).unwrap();
        s.connect(([127, 0, 0, 1], port).into()).await.unwrap()
    });
    let mut stream = stream.into_std().unwrap();
    stream.set_nonblocking(false).unwrap();
    use base64::Engine;
    let token = base64::engine::general_purpose::STANDARD.encode("admin:changeme");
    write!(
        stream,
        "POST /admin/reload HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\nAuthorization: Basic {token}\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let (status, _, body) = parse_response(&raw);
    (status, body)
}

#[test]
fn the_proxys_own_watcher_applies_a_configmap_swap() {
    let (admin, http) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let first = config(admin, http, "", "");
    let mut mount = kubelet::Kubelet::new(dir.path(), &first);
    // SB_CONFIG_FILE instead of -f.
    let path = mount.path();
    let mut p = Proxy::spawn_args(&[], admin, &[("SB_CONFIG_FILE", path.to_str().unwrap())]);
    p.wait_ready();
    assert_eq!(p.revision(DEFAULT_AUTH), sha256_hex(first.as_bytes()));

    let second = format!("{first}origins:\n  \"a.example.com\": {{}}\n");
    mount.publish(&second);
    let want = sha256_hex(second.as_bytes());
    let until = Instant::now() + DEADLINE;
    while p.revision(DEFAULT_AUTH) != want {
        assert!(Instant::now() < until, "not applied:\n{}", p.stderr());
        std::thread::sleep(Duration::from_millis(25));
    }
    p.wait_stderr("watcher: applied");

    // A refused file is not applied by the watcher either.
    mount.publish(&config(admin, http, "    passwrd: x\n", ""));
    p.wait_stderr("watcher: failed to parse config");
    assert_eq!(p.revision(DEFAULT_AUTH), want);
}

#[test]
fn sigterm_drains_and_exits_0_and_sighup_is_ignored() {
    let (admin, http) = (free_port(), free_port());
    let cfg = ConfigDir::new(&config(admin, http, "", ""));
    let mut p = Proxy::start(&cfg.path(), admin, &[("SBPROXY_SHUTDOWN_GRACE_MS", "5000")]);
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", p.child.id())).unwrap();
    assert_eq!(comm.trim(), "sbproxy");

    p.signal("HUP");
    p.wait_stderr("SIGHUP ignored");
    assert_eq!(request(http, "GET", "/health", None).0, 200);

    p.signal("TERM");
    let (status, stderr) = p.wait_exit();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("shutdown complete"), "{stderr}");
}

#[test]
fn start_delay_postpones_binding() {
    let (admin, http) = (free_port(), free_port());
    let cfg = ConfigDir::new(&config(admin, http, "", ""));
    let started = Instant::now();
    let p = Proxy::start(
        &cfg.path(),
        admin,
        &[("SBPROXY_STANDIN_START_DELAY_MS", "300")],
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
    p.wait_stderr("start-up delay");
}

#[test]
fn sigterm_stops_accepting_and_lets_a_running_request_finish() {
    let (admin, http) = (free_port(), free_port());
    let cfg = ConfigDir::new(&config(admin, http, "", ""));
    let mut p = Proxy::start(
        &cfg.path(),
        admin,
        &[
            ("SBPROXY_STANDIN_RELOAD_MS", "2000"),
            ("SBPROXY_SHUTDOWN_GRACE_MS", "20000"),
        ],
    );
    let slow =
        std::thread::spawn(move || request(admin, "POST", "/admin/reload", Some(DEFAULT_AUTH)));
    p.wait_stderr("re-reading the config file");
    p.signal("TERM");
    // New connections are refused while the running request drains.
    let until = Instant::now() + DEADLINE;
    while std::net::TcpStream::connect(("127.0.0.1", http)).is_ok() {
        assert!(Instant::now() < until, "still accepting:\n{}", p.stderr());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!slow.is_finished() && p.child.try_wait().unwrap().is_none());
    let (status, body) = slow.join().unwrap();
    assert_eq!(status, 200, "{body}");
    let (status, stderr) = p.wait_exit();
    assert_eq!(status.code(), Some(0), "{stderr}");
}

#[test]
fn sigterm_exits_0_when_the_grace_period_is_over() {
    let (admin, http) = (free_port(), free_port());
    let cfg = ConfigDir::new(&config(admin, http, "", ""));
    let mut p = Proxy::start(
        &cfg.path(),
        admin,
        &[
            ("SBPROXY_STANDIN_RELOAD_MS", "60000"),
            ("SBPROXY_SHUTDOWN_GRACE_MS", "100"),
        ],
    );
    let slow =
        std::thread::spawn(move || try_request(admin, "POST", "/admin/reload", Some(DEFAULT_AUTH)));
    p.wait_stderr("re-reading the config file");
    p.signal("TERM");
    let (status, stderr) = p.wait_exit();
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("grace period over"), "{stderr}");
    assert_eq!(
        slow.join().unwrap(),
        None,
        "the request was cut at the end of the grace period"
    );
}
