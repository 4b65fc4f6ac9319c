//! Leader election with two real `sbmesh-operator run` processes against a
//! fake API server: one leads, a taken Lease ends the leader with exit 0,
//! the follower takes over, and SIGTERM releases the Lease and exits 0.

mod fake_apiserver;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fake_apiserver::FakeApiServer;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/test/leases/sbproxy-operator-leader";

/// A running operator; killed (by its PID) and reaped when dropped.
struct Operator {
    identity: String,
    child: Mutex<Child>,
    metrics: SocketAddr,
    log: PathBuf,
}

impl Drop for Operator {
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(|e| e.into_inner());
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Operator {
    fn start(identity: &str, kubeconfig: &Path, dir: &Path) -> Self {
        let metrics = free_addr();
        let log = dir.join(format!("{identity}.log"));
        let stderr = std::fs::File::create(&log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_sbmesh-operator"))
            .args([
                "run",
                "--namespace",
                "test",
                "--lease-namespace",
                "test",
                "--identity",
                identity,
                "--metrics-listen",
                &metrics.to_string(),
                // Each process its own port (the default, 10250, is one per machine).
                "--webhook-listen",
                "127.0.0.1:0",
                "--log-format",
                "text",
                "--shutdown-grace-ms",
                "10000",
            ])
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info")
            .env_remove("POD_NAME")
            .env_remove("SBMESH_OPERATOR_NAMESPACE")
            .env_remove("SBMESH_LEASE_NAMESPACE")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start sbmesh-operator");
        Self {
            identity: identity.to_owned(),
            child: Mutex::new(child),
            metrics,
            log,
        }
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Child> {
        self.child.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn exited(&self) -> Option<ExitStatus> {
        self.child().try_wait().ok().flatten()
    }

    fn sigterm(&self) {
        let pid = self.child().id().to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {pid}");
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `sbmesh_operator_leader`, when /metrics answers.
    async fn leader_gauge(&self) -> Option<i64> {
        let page = http_get(self.metrics, "/metrics").await?;
        page.lines()
            .find_map(|l| l.strip_prefix("sbmesh_operator_leader "))
            .and_then(|v| v.trim().parse().ok())
    }
}

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr")
}

async fn http_get(addr: SocketAddr, path: &str) -> Option<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    let ok = out
        .lines()
        .next()
        .is_some_and(|l| l.split(' ').nth(1) == Some("200"));
    ok.then_some(out)
}

/// Polls `f` every 100 ms until it yields, or panics after `deadline`
/// with `what` and the processes' logs.
async fn eventually<T, F, Fut>(deadline: Duration, what: &str, ops: &[&Operator], mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        if start.elapsed() > deadline {
            let logs: Vec<String> = ops
                .iter()
                .map(|o| format!("--- {} ---\n{}", o.identity, o.logs()))
                .collect();
            panic!(
                "timed out after {deadline:?} waiting for {what}\n{}",
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn holder(fake: &FakeApiServer) -> Option<String> {
    fake.get(LEASE)
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_owned))
        .filter(|h| !h.is_empty())
}

/// Now, as the API writes a `MicroTime`.
fn now_micro() -> Value {
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
        k8s_openapi::jiff::Timestamp::now(),
    );
    serde_json::to_value(now).expect("MicroTime serialises")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leads_a_taken_lease_ends_it_with_0_and_the_other_takes_over() {
    let fake = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = fake.write_kubeconfig(dir.path(), "test");
    let a = Operator::start("op-a", &kubeconfig, dir.path());
    let b = Operator::start("op-b", &kubeconfig, dir.path());

    // Exactly one holds the Lease, and the gauges agree.
    let first = eventually(
        Duration::from_secs(30),
        "a Lease holder",
        &[&a, &b],
        || async { holder(&fake) },
    )
    .await;
    assert!(first == "op-a" || first == "op-b", "holder {first}");
    let (leader, follower) = if first == "op-a" { (&a, &b) } else { (&b, &a) };
    eventually(
        Duration::from_secs(20),
        "leader gauge 1 on the holder and 0 on the other",
        &[leader, follower],
        || async {
            let l = leader.leader_gauge().await;
            let f = follower.leader_gauge().await;
            (l == Some(1) && f == Some(0)).then_some(())
        },
    )
    .await;
    assert_eq!(
        holder(&fake).as_deref(),
        Some(first.as_str()),
        "still one holder"
    );
    let lease = fake.get(LEASE).unwrap_or(Value::Null);
    assert_eq!(lease["spec"]["leaseDurationSeconds"], 15, "{lease}");
    assert!(
        http_get(follower.metrics, "/healthz").await.is_some(),
        "a follower is healthy"
    );

    // Someone else takes the Lease (fresh renewTime, new resourceVersion).
    let mut stolen = fake.get(LEASE).unwrap_or(Value::Null);
    stolen["spec"]["holderIdentity"] = json!("thief");
    stolen["spec"]["renewTime"] = now_micro();
    stolen["spec"]["acquireTime"] = now_micro();
    stolen["spec"]["leaseDurationSeconds"] = json!(15);
    fake.put(LEASE, stolen);

    let status = eventually(
        Duration::from_secs(40),
        "the former leader to exit",
        &[leader, follower],
        || {
            let s = leader.exited();
            async move { s }
        },
    )
    .await;
    assert_eq!(
        status.code(),
        Some(0),
        "a lost Lease ends the process with 0"
    );
    assert_eq!(
        holder(&fake).as_deref(),
        Some("thief"),
        "the loser did not write over the new holder"
    );

    // The thief never renews: once its Lease expires the follower leads.
    let second = follower.identity.clone();
    eventually(
        Duration::from_secs(60),
        "the follower to take the expired Lease",
        &[leader, follower],
        || async { (holder(&fake).as_deref() == Some(second.as_str())).then_some(()) },
    )
    .await;
    eventually(
        Duration::from_secs(20),
        "the new leader's gauge",
        &[leader, follower],
        || async { (follower.leader_gauge().await == Some(1)).then_some(()) },
    )
    .await;

    // SIGTERM: drain, release the Lease, exit 0.
    follower.sigterm();
    let status = eventually(
        Duration::from_secs(40),
        "the new leader to exit after SIGTERM",
        &[leader, follower],
        || {
            let s = follower.exited();
            async move { s }
        },
    )
    .await;
    assert_eq!(
        status.code(),
        Some(0),
        "SIGTERM exits 0\n{}",
        follower.logs()
    );
    assert_eq!(holder(&fake), None, "the Lease was released on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_exits_0_on_sigterm_and_leaves_the_lease_alone() {
    let fake = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = fake.write_kubeconfig(dir.path(), "test");
    // Someone else holds a fresh Lease: op-c waits a whole lease duration
    // (15 s) before it may take it, far longer than this test needs.
    fake.put(
        LEASE,
        json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": { "name": "sbproxy-operator-leader", "namespace": "test" },
            "spec": { "holderIdentity": "elsewhere", "leaseDurationSeconds": 15,
                      "renewTime": now_micro(), "acquireTime": now_micro() },
        }),
    );
    let c = Operator::start("op-c", &kubeconfig, dir.path());
    eventually(
        Duration::from_secs(20),
        "op-c to serve a leader gauge of 0",
        &[&c],
        || async { (c.leader_gauge().await == Some(0)).then_some(()) },
    )
    .await;
    eventually(
        Duration::from_secs(20),
        "op-c to read the Lease",
        &[&c],
        || async {
            fake.requests()
                .iter()
                .any(|r| r.method == "GET" && r.path == LEASE)
                .then_some(())
        },
    )
    .await;
    c.sigterm();
    let status = eventually(Duration::from_secs(20), "op-c to exit", &[&c], || {
        let s = c.exited();
        async move { s }
    })
    .await;
    assert_eq!(status.code(), Some(0), "{}", c.logs());
    assert_eq!(holder(&fake).as_deref(), Some("elsewhere"));
    assert!(
        !fake
            .requests()
            .iter()
            .any(|r| r.path.contains("/sbproxies")),
        "a follower runs no controller"
    );
}

/// A stop that comes before the controller's caches were first filled
/// (here: the SBProxy list hangs) has nothing to drain: the leader exits 0
/// at once instead of waiting out its drain budget (kube's runner waits for
/// the caches and would never end by itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stopped_before_its_caches_filled_exits_0_without_waiting_the_budget() {
    let fake = FakeApiServer::start().await;
    fake.delay("sbproxies", Duration::from_secs(120));
    let dir = tempfile::tempdir().expect("tempdir");
    let kubeconfig = fake.write_kubeconfig(dir.path(), "test");
    let d = Operator::start("op-d", &kubeconfig, dir.path());
    eventually(Duration::from_secs(30), "op-d to lead", &[&d], || async {
        (d.leader_gauge().await == Some(1)).then_some(())
    })
    .await;
    d.sigterm();
    let status = eventually(Duration::from_secs(30), "op-d to exit", &[&d], || {
        let s = d.exited();
        async move { s }
    })
    .await;
    // Exit 1 would mean it waited out the drain budget with nothing in flight.
    assert_eq!(status.code(), Some(0), "SIGTERM exits 0\n{}", d.logs());
}
