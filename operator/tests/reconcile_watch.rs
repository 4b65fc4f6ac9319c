//! The controller wired end to end in the real binary, against a fake API
//! server: SBProxies converge, an SBProxyConfig edit reaches every SBProxy
//! that references it through the watch (not the 5-minute requeue), and
//! Secrets are never listed or watched.

mod fake_apiserver;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fake_apiserver::FakeApiServer;
use serde_json::{Value, json};

const SBP: &str = "/apis/sbproxy.dev/v1alpha1/namespaces/test";
const CM: &str = "/api/v1/namespaces/test/configmaps";

const V1: &str =
    "proxy:\n  admin: { enabled: true, port: 9090 }\norigins:\n  \"v1.example.com\": {}\n";
const V2: &str =
    "proxy:\n  admin: { enabled: true, port: 9090 }\norigins:\n  \"v2.example.com\": {}\n";

/// The operator process; killed by PID and reaped when dropped.
struct Guard(Child);

impl Guard {
    fn sigterm(&self) {
        let pid = self.0.id().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {pid}");
    }

    fn exit_code(&mut self) -> Option<Option<i32>> {
        self.0.try_wait().ok().flatten().map(|s| s.code())
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(kubeconfig: &Path, log: &Path, extra: &[&str]) -> Guard {
    let metrics = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port");
    let stderr = std::fs::File::create(log).expect("log file");
    let child = Command::new(env!("CARGO_BIN_EXE_sbmesh-operator"))
        .args([
            "run",
            "--namespace",
            "test",
            "--no-leader-election",
            "--metrics-listen",
            &metrics.to_string(),
            // Each process its own port (the default, 10250, is one per machine).
            "--webhook-listen",
            "127.0.0.1:0",
            "--log-format",
            "text",
        ])
        .args(extra)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("POD_NAME")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("start sbmesh-operator");
    Guard(child)
}

fn config(name: &str, text: &str) -> Value {
    json!({
        "apiVersion": "sbproxy.dev/v1alpha1", "kind": "SBProxyConfig",
        "metadata": { "name": name, "namespace": "test" },
        "spec": { "config": text },
    })
}

fn proxy(name: &str, config: &str) -> Value {
    json!({
        "apiVersion": "sbproxy.dev/v1alpha1", "kind": "SBProxy",
        "metadata": { "name": name, "namespace": "test", "generation": 1 },
        "spec": {
            "image": "ghcr.io/sbproxy/sbproxy:0.9.0",
            "configRef": config,
            "replicas": 1, "port": 8080, "adminPort": 9090,
            "clustering": { "enabled": true, "gossipPort": 7946, "transportPort": 8946, "clusterDomain": "cluster.local" },
            "sidecar": { "adminPort": 9091, "challengePort": 8089 },
        },
    })
}

fn sb_yml(fake: &FakeApiServer, proxy: &str) -> Option<String> {
    fake.get(&format!("{CM}/{proxy}-config"))
        .and_then(|cm| cm["data"]["sb.yml"].as_str().map(str::to_owned))
}

fn config_hash(fake: &FakeApiServer, proxy: &str) -> Option<String> {
    fake.get(&format!("{SBP}/sbproxies/{proxy}"))
        .and_then(|p| p["status"]["configHash"].as_str().map(str::to_owned))
}

async fn eventually(deadline: Duration, what: &str, log: &Path, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        if start.elapsed() > deadline {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            panic!("timed out after {deadline:?} waiting for {what}\n--- operator ---\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_edit_reconciles_every_proxy_that_references_it() {
    let fake = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = fake.write_kubeconfig(dir.path(), "test");
    let log = dir.path().join("operator.log");
    fake.put(
        &format!("{SBP}/sbproxyconfigs/shared"),
        config("shared", V1),
    );
    fake.put(&format!("{SBP}/sbproxyconfigs/other"), config("other", V1));
    for (name, cfg) in [("alpha", "shared"), ("beta", "shared"), ("gamma", "other")] {
        fake.put(&format!("{SBP}/sbproxies/{name}"), proxy(name, cfg));
    }
    let _operator = start(&kubeconfig, &log, &[]);

    eventually(
        Duration::from_secs(60),
        "all three SBProxies applied",
        &log,
        || {
            ["alpha", "beta", "gamma"]
                .iter()
                .all(|p| sb_yml(&fake, p).as_deref() == Some(V1) && config_hash(&fake, p).is_some())
        },
    )
    .await;
    let before = config_hash(&fake, "alpha");
    assert_eq!(before, config_hash(&fake, "gamma"), "same text, same hash");
    for p in ["alpha", "beta", "gamma"] {
        assert!(
            fake.get(&format!("/api/v1/namespaces/test/secrets/{p}-cluster-key"))
                .is_some(),
            "cluster key of {p} created"
        );
    }

    // The edit: only a watch event can bring it in before the 5-minute
    // periodic requeue.
    fake.put(
        &format!("{SBP}/sbproxyconfigs/shared"),
        config("shared", V2),
    );
    eventually(
        Duration::from_secs(30),
        "alpha and beta to carry the edit",
        &log,
        || {
            sb_yml(&fake, "alpha").as_deref() == Some(V2)
                && sb_yml(&fake, "beta").as_deref() == Some(V2)
                && config_hash(&fake, "alpha") != before
                && config_hash(&fake, "beta") != before
        },
    )
    .await;
    assert_eq!(
        sb_yml(&fake, "gamma").as_deref(),
        Some(V1),
        "gamma reads another config"
    );
    assert_eq!(config_hash(&fake, "gamma"), before);

    // Secrets: GET and POST by name only (RBAC: get, create).
    for r in fake
        .requests()
        .iter()
        .filter(|r| r.path.contains("/secrets"))
    {
        let by_name = r.path.trim_end_matches('/').rsplit('/').next() != Some("secrets");
        assert!(
            (r.method == "GET" && by_name) || (r.method == "POST" && !by_name),
            "secrets: only get by name and create, saw {} {}?{}",
            r.method,
            r.path,
            r.query
        );
    }
}

/// Starts the operator on one SBProxy whose config GET the API server
/// answers only after `delay`, sends SIGTERM while that reconcile is in
/// flight, and returns the exit code and the fake.
async fn sigterm_during_a_slow_reconcile(
    delay: Duration,
    grace_ms: &str,
) -> (Option<i32>, FakeApiServer) {
    let fake = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = fake.write_kubeconfig(dir.path(), "test");
    let log = dir.path().join("operator.log");
    fake.put(&format!("{SBP}/sbproxyconfigs/slow"), config("slow", V1));
    fake.put(&format!("{SBP}/sbproxies/alpha"), proxy("alpha", "slow"));
    fake.delay("/sbproxyconfigs/slow", delay);
    let mut operator = start(&kubeconfig, &log, &["--shutdown-grace-ms", grace_ms]);
    eventually(
        Duration::from_secs(30),
        "the reconcile to start",
        &log,
        || {
            fake.requests()
                .iter()
                .any(|r| r.method == "GET" && r.path.ends_with("/sbproxyconfigs/slow"))
        },
    )
    .await;
    operator.sigterm();
    let mut code = None;
    eventually(
        Duration::from_secs(40),
        "the operator to exit",
        &log,
        || {
            code = operator.exit_code();
            code.is_some()
        },
    )
    .await;
    (code.flatten(), fake)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_in_flight_reconcile_finish_then_exits_0() {
    let (code, fake) = sigterm_during_a_slow_reconcile(Duration::from_secs(2), "20000").await;
    assert_eq!(code, Some(0));
    assert_eq!(
        sb_yml(&fake, "alpha").as_deref(),
        Some(V1),
        "the reconcile in flight at SIGTERM ran to its end"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_1_when_the_drain_budget_runs_out() {
    let (code, fake) = sigterm_during_a_slow_reconcile(Duration::from_secs(3600), "1000").await;
    assert_eq!(code, Some(1));
    assert_eq!(sb_yml(&fake, "alpha"), None);
}
