//! Harness shared by the process-level mesh tests and `benches/mesh_scale.rs`:
//! real `sbmesh-sidecar run` processes, one per 127.0.x.y address, all on the
//! default ports, talked to over plain HTTP/1.1 on their admin listener.
//!
//! Everything here goes through the external contract of `docs/reference.md`
//! (the flags, the status JSON, the metric names), never through library
//! internals.
//!
//! Conventions:
//! - every wait polls every 100 ms up to [`deadline()`] (60 s, or
//!   `SBMESH_TEST_DEADLINE_SECS`); on timeout the status JSON, the mesh metrics
//!   and the log tail of every node are printed before the panic;
//! - node processes die with the thread that spawned them (`PR_SET_PDEATHSIG`)
//!   and are SIGKILLed by PID when their [`Node`] is dropped;
//! - a cluster's temp dir is removed unless the test panicked or
//!   `SBMESH_KEEP_TMP` is set (then its path is printed so the full logs can
//!   be read);
//! - each test uses its own 127.0.X.* block (processes .11, status .12-.18,
//!   partition .21 inside its own namespace, bench .31) so they run in
//!   parallel.
#![allow(dead_code)]

pub mod acme;
pub mod pods;
#[allow(clippy::duplicate_mod)]
#[path = "../../../tests/required/mod.rs"]
pub mod required;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

pub const GOSSIP_PORT: u16 = 7946;
pub const TRANSPORT_PORT: u16 = 8946;
pub const ADMIN_PORT: u16 = 9091;
pub const CHALLENGE_PORT: u16 = 8089;
pub const ADMIN_USER: &str = "admin";
pub const ADMIN_PASSWORD: &str = "secret";
pub const CLUSTER_ID: &str = "sbmesh-test";
/// Nothing listens on port 9 (discard); reloads are not what these tests check.
pub const PROXY_RELOAD_URL: &str = "http://127.0.0.1:9/admin/reload";

/// The key most clusters use ("old" in the rotation tests).
pub const KEY_OLD: &str = "6f1d2c3b4a59687766554433221100ffeeddccbbaa99887766554433221100aa";
/// The key a rotation moves to.
pub const KEY_NEW: &str = "0123456789abcdeffedcba98765432100123456789abcdeffedcba9876543210";
/// A key no cluster uses.
pub const KEY_WRONG: &str = "deadbeefdeadbeefdeadbeefdeadbeefdeadbeefdeadbeefdeadbeefdeadbeef";

pub const SB_YML: &str = "proxy:\n  admin:\n    enabled: true\n    port: 9090\n";

/// Set in the environment of a test re-executed inside `unshare -rn`.
pub const IN_NETNS_ENV: &str = "SBMESH_IN_NETNS";
const NETNS_MARKER_ENV: &str = "SBMESH_NETNS_MARKER";

/// How long any single wait may take before the test fails.
pub fn deadline() -> Duration {
    let secs = std::env::var("SBMESH_TEST_DEADLINE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    Duration::from_secs(secs)
}

pub const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// The sidecar built by cargo for this test or bench target.
pub fn sidecar_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sbmesh-sidecar"))
}

/// An origin as the real sbproxy takes it (every origin has an `action`):
/// a fixed answer, so no upstream is needed.
pub const ORIGIN: &str = "{ action: { type: static, status_code: 200, body: ok } }";

/// The variable naming the real sbproxy binary (`scripts/test` sets it).
pub const SBPROXY_VAR: &str = "SBMESH_TEST_SBPROXY";

/// The real sbproxy 1.13 a test runs beside the sidecar; `None` (a SKIP
/// line) when `SBMESH_TEST_SBPROXY` is not set, a panic when it names no
/// file or is unset under `SBMESH_TEST_REQUIRE_SERVERS=1`.
pub fn sbproxy_bin(test: &str) -> Option<PathBuf> {
    match std::env::var_os(SBPROXY_VAR).filter(|v| !v.is_empty()) {
        Some(path) => {
            let path = PathBuf::from(path);
            assert!(
                path.is_file(),
                "{test}: {SBPROXY_VAR}={} is not a file",
                path.display()
            );
            Some(path)
        }
        None => required::missing(
            test,
            &format!("{SBPROXY_VAR} is not set"),
            "scripts/test sets it to the real sbproxy (scripts/find-sbproxy)",
        ),
    }
}

pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

/// Polls `cond` every 100 ms until it holds or `timeout` passes.
pub fn poll_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

// ---------------------------------------------------------------------------
// Nodes
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
pub enum KeySource {
    /// `--cluster-key <hex[,hex...]>`
    Hex(String),
    /// `--cluster-key-file <path>`
    File(PathBuf),
}

#[derive(Clone, Debug)]
pub struct NodeOpts {
    pub node_id: String,
    pub ip: Ipv4Addr,
    pub cluster_id: String,
    pub key: KeySource,
    pub seeds: Vec<SocketAddr>,
    pub extra_args: Vec<String>,
}

impl NodeOpts {
    pub fn gossip_addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.ip, GOSSIP_PORT))
    }
}

/// One `sbmesh-sidecar run` process (and its restarts).
pub struct Node {
    pub opts: NodeOpts,
    pub dir: PathBuf,
    pub log_path: PathBuf,
    bin: PathBuf,
    config: PathBuf,
    child: Option<Child>,
    /// A process started by another one (the bench's spawner), known by PID.
    foreign: Option<u32>,
    exit: Option<ExitStatus>,
    pub spawn_count: u32,
    /// Added to the process's environment (e.g. `RUST_LOG` for one node).
    pub env: Vec<(String, String)>,
}

impl Node {
    /// Spawns the node; its state, certs and log live in `<base>/<node_id>`.
    pub fn spawn(bin: &Path, config: &Path, base: &Path, opts: NodeOpts) -> Node {
        let mut node = Node::prepare(bin, config, base, opts);
        node.start();
        node
    }

    /// The node with its directory, not started yet: [`Node::start`] it, or
    /// start [`Node::command`] elsewhere and [`Node::adopt`] the PID.
    pub fn prepare(bin: &Path, config: &Path, base: &Path, opts: NodeOpts) -> Node {
        let dir = base.join(&opts.node_id);
        fs::create_dir_all(&dir).expect("create node dir");
        Node {
            log_path: dir.join("sidecar.log"),
            dir,
            bin: bin.to_path_buf(),
            config: config.to_path_buf(),
            opts,
            child: None,
            foreign: None,
            exit: None,
            spawn_count: 0,
            env: Vec::new(),
        }
    }

    /// Takes over a process another process spawned from [`Node::command`]:
    /// signals and `Drop` go to `pid`; its exit status stays with its parent.
    pub fn adopt(&mut self, pid: u32) {
        self.foreign = Some(pid);
        self.spawn_count += 1;
    }

    pub fn args(&self) -> Vec<String> {
        let o = &self.opts;
        let mut a: Vec<String> = vec![
            "run".into(),
            "--config".into(),
            self.config.display().to_string(),
            "--node-id".into(),
            o.node_id.clone(),
            "--cluster-id".into(),
            o.cluster_id.clone(),
            "--bind".into(),
            o.ip.to_string(),
            "--gossip-port".into(),
            GOSSIP_PORT.to_string(),
            "--transport-port".into(),
            TRANSPORT_PORT.to_string(),
            "--admin-listen".into(),
            self.admin_addr().to_string(),
            "--challenge-listen".into(),
            SocketAddr::V4(SocketAddrV4::new(o.ip, CHALLENGE_PORT)).to_string(),
            "--state-dir".into(),
            self.dir.display().to_string(),
            "--cert-dir".into(),
            self.dir.join("certs").display().to_string(),
            "--admin-user".into(),
            ADMIN_USER.into(),
            "--admin-password".into(),
            ADMIN_PASSWORD.into(),
            "--proxy-reload-url".into(),
            PROXY_RELOAD_URL.into(),
            "--log-format".into(),
            "text".into(),
        ];
        if !o.seeds.is_empty() {
            a.push("--seeds".into());
            a.push(
                o.seeds
                    .iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
                    .join(","),
            );
        }
        match &o.key {
            KeySource::Hex(k) => {
                a.push("--cluster-key".into());
                a.push(k.clone());
            }
            KeySource::File(p) => {
                a.push("--cluster-key-file".into());
                a.push(p.display().to_string());
            }
        }
        a.extend(o.extra_args.iter().cloned());
        a
    }

    pub fn start(&mut self) {
        assert!(
            self.child.is_none(),
            "{} is already running",
            self.opts.node_id
        );
        let child = self
            .command()
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.bin.display()));
        self.child = Some(child);
        self.exit = None;
        self.spawn_count += 1;
    }

    /// The command that starts this node (see [`node_command`]).
    pub fn command(&self) -> Command {
        node_command(
            &self.bin,
            &self.args(),
            &self.log_path,
            &self.env,
            self.spawn_count + 1,
        )
    }

    /// Starts the node again with the same options (same node id, addresses, dirs).
    pub fn restart(&mut self) {
        assert!(
            !self.is_running(),
            "restart of {} while it runs",
            self.opts.node_id
        );
        self.reap();
        self.start();
    }

    pub fn id(&self) -> &str {
        &self.opts.node_id
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id()).or(self.foreign)
    }

    pub fn gossip_addr(&self) -> SocketAddr {
        self.opts.gossip_addr()
    }

    pub fn transport_addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.opts.ip, TRANSPORT_PORT))
    }

    pub fn admin_addr(&self) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.opts.ip, ADMIN_PORT))
    }

    /// True while the process exists and is not a zombie (checked via /proc,
    /// so it needs no `&mut`).
    pub fn is_running(&self) -> bool {
        match self.pid() {
            Some(pid) if self.exit.is_none() => pid_alive(pid),
            _ => false,
        }
    }

    pub fn signal(&self, sig: libc::c_int) {
        let pid = self.pid().expect("node was spawned");
        // SAFETY: plain kill(2) on the PID of our own child, which is not reaped yet.
        let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
        assert_eq!(rc, 0, "kill({pid}, {sig}): {}", io::Error::last_os_error());
    }

    /// `kill -9` by PID, then reaps it.
    pub fn kill9(&mut self) {
        if self.exit.is_none() && self.child.is_none() && self.foreign.is_some() {
            self.signal(libc::SIGKILL);
            // Its parent reaps it; gone means a zombie here.
            poll_until(Duration::from_secs(10), || !self.is_running());
            return;
        }
        if self.exit.is_some() || self.child.is_none() {
            return;
        }
        self.signal(libc::SIGKILL);
        let st = self.child.as_mut().unwrap().wait().expect("wait for child");
        self.exit = Some(st);
    }

    /// `kill -TERM` by PID (does not wait).
    pub fn sigterm(&self) {
        self.signal(libc::SIGTERM);
    }

    /// Waits (polling) for the process to exit; returns its status.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if let Some(st) = self.exit {
            return Some(st);
        }
        let child = self.child.as_mut()?;
        let end = Instant::now() + timeout;
        loop {
            if let Some(st) = child.try_wait().expect("try_wait") {
                self.exit = Some(st);
                return Some(st);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    fn reap(&mut self) {
        if let Some(mut c) = self.child.take()
            && self.exit.is_none()
            && let Ok(Some(st)) = c.try_wait()
        {
            self.exit = Some(st);
        }
    }

    pub fn exit_status(&self) -> Option<ExitStatus> {
        self.exit
    }

    /// `GET /admin/cluster/status` with the admin credentials, parsed; `None`
    /// when the node does not answer 200 with JSON.
    pub fn status(&self) -> Option<Value> {
        let r = http_get(
            self.admin_addr(),
            "/admin/cluster/status",
            Some((ADMIN_USER, ADMIN_PASSWORD)),
        )
        .ok()?;
        if r.status != 200 {
            return None;
        }
        serde_json::from_slice(&r.body).ok()
    }

    /// `GET /metrics` body, when 200.
    pub fn metrics(&self) -> Option<String> {
        let r = http_get(self.admin_addr(), "/metrics", None).ok()?;
        (r.status == 200).then(|| r.text())
    }

    pub fn get(&self, path: &str, auth: Option<(&str, &str)>) -> io::Result<HttpResponse> {
        http_get(self.admin_addr(), path, auth)
    }

    pub fn log_tail(&self, lines: usize) -> String {
        let text = fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_else(|e| format!("<no log: {e}>"));
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// VmRSS of the process in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        let pid = self.pid()?;
        let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// Human-readable state for diagnostics.
    pub fn describe(&self) -> String {
        match (self.pid(), self.exit) {
            (None, _) => "never started".into(),
            (Some(pid), Some(st)) => format!("pid {pid} exited: {}", describe_exit(st)),
            (Some(pid), None) if pid_alive(pid) => format!("pid {pid} running"),
            (Some(pid), None) => format!("pid {pid} has exited (not reaped yet)"),
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut()
            && self.exit.is_none()
        {
            if let Ok(None) = c.try_wait() {
                // SAFETY: kill(2) by the PID of our own, unreaped child.
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGKILL);
                }
            }
            let _ = c.wait();
        } else if let Some(pid) = self.foreign
            && pid_alive(pid)
        {
            // SAFETY: kill(2) by PID; its parent (the spawner) reaps it only
            // at its own end, so the PID cannot have been reused.
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
}

pub fn describe_exit(st: ExitStatus) -> String {
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => format!("{st:?}"),
    }
}

/// The command that starts a node: output appended to `log_path`, the
/// caller's `SBMESH_*`/`SBPROXY_*` removed, `env` added, killed when the
/// spawning thread dies. Also used by the bench's spawner process.
pub fn node_command(
    bin: &Path,
    args: &[String],
    log_path: &Path,
    env: &[(String, String)],
    spawn_no: u32,
) -> Command {
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path)
        .expect("open node log");
    writeln!(
        log,
        "=== spawn #{spawn_no} at {} ms: {} {}",
        now_unix_ms(),
        bin.display(),
        args.join(" ")
    )
    .expect("write node log");
    let stderr = log.try_clone().expect("clone log fd");
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(stderr));
    // Flags win over the environment anyway, but an SBPROXY_POD_IP or
    // SBMESH_MESH_SERVICE of the caller would add to what we pass.
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("SBMESH_") || k.starts_with("SBPROXY_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd
}

/// The process exists and is not a zombie.
pub fn pid_alive(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // "pid (comm) S ..." — comm may contain spaces, so look after the last ')'.
        Ok(s) => match s.rfind(')') {
            Some(i) => !matches!(s[i + 1..].trim_start().chars().next(), Some('Z' | 'X')),
            None => false,
        },
        Err(_) => false,
    }
}

// ---------------------------------------------------------------------------
// Clusters
// ---------------------------------------------------------------------------

static DIR_SEQ: AtomicU64 = AtomicU64::new(0);

/// A set of nodes on `<prefix>.1`, `<prefix>.2`, … sharing one temp dir and
/// one `sb.yml`.
pub struct Cluster {
    pub dir: PathBuf,
    pub prefix: String,
    pub cluster_id: String,
    pub key: String,
    pub bin: PathBuf,
    pub config: PathBuf,
    pub nodes: Vec<Node>,
}

impl Cluster {
    /// An empty cluster (no node yet) for addresses `<prefix>.*`.
    pub fn new(prefix: &str) -> Cluster {
        let dir = std::env::temp_dir().join(format!(
            "sbmesh-{}-{}-{}-{}",
            prefix.replace('.', "_"),
            std::process::id(),
            now_unix_ms(),
            DIR_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        // The config in a directory of its own, as a pod's ConfigMap
        // mount is: every sidecar watches that directory, and the nodes'
        // directories created beside it woke all of them (N = 512: 7.8 %
        // of the start's CPU in the watcher threads).
        let etc = dir.join("etc");
        fs::create_dir_all(&etc).expect("create cluster temp dir");
        let config = etc.join("sb.yml");
        fs::write(&config, SB_YML).expect("write sb.yml");
        Cluster {
            dir,
            prefix: prefix.to_string(),
            cluster_id: CLUSTER_ID.to_string(),
            key: KEY_OLD.to_string(),
            bin: sidecar_bin(),
            config,
            nodes: Vec::new(),
        }
    }

    /// `n` nodes `node-1..node-n` on `<prefix>.1..n`, each seeded with all
    /// `n` gossip addresses (itself included, as a StatefulSet's pods are).
    pub fn start(prefix: &str, n: u8) -> Cluster {
        let mut c = Cluster::new(prefix);
        for i in 1..=n {
            let o = c.default_opts(i, n);
            c.spawn(o);
        }
        c
    }

    pub fn ip(&self, i: u8) -> Ipv4Addr {
        format!("{}.{i}", self.prefix)
            .parse()
            .expect("prefix is three octets")
    }

    pub fn gossip_addr(&self, i: u8) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.ip(i), GOSSIP_PORT))
    }

    /// Gossip addresses of `<prefix>.1..=n`.
    pub fn seed_list(&self, n: u8) -> Vec<SocketAddr> {
        (1..=n).map(|i| self.gossip_addr(i)).collect()
    }

    pub fn default_opts(&self, i: u8, n: u8) -> NodeOpts {
        NodeOpts {
            node_id: format!("node-{i}"),
            ip: self.ip(i),
            cluster_id: self.cluster_id.clone(),
            key: KeySource::Hex(self.key.clone()),
            seeds: self.seed_list(n),
            extra_args: Vec::new(),
        }
    }

    /// Spawns one more node; returns its index in `nodes`.
    pub fn spawn(&mut self, opts: NodeOpts) -> usize {
        let node = Node::spawn(&self.bin, &self.config, &self.dir, opts);
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    pub fn idx(&self, node_id: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n.id() == node_id)
            .unwrap_or_else(|| panic!("no node {node_id}"))
    }

    pub fn ids(&self, idx: &[usize]) -> Vec<String> {
        idx.iter()
            .map(|&i| self.nodes[i].id().to_string())
            .collect()
    }

    /// Waits until `cond` holds; on timeout dumps every node and panics.
    pub fn wait_until(&self, what: &str, cond: impl FnMut() -> bool) {
        self.wait_until_for(what, deadline(), cond)
    }

    pub fn wait_until_for(&self, what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
        let started = Instant::now();
        let end = started + timeout;
        loop {
            if cond() {
                eprintln!(
                    "[{}] ok after {:.1}s: {what}",
                    self.prefix,
                    started.elapsed().as_secs_f64()
                );
                return;
            }
            if Instant::now() >= end {
                break;
            }
            std::thread::sleep(POLL_INTERVAL);
        }
        self.dump();
        panic!("timed out after {timeout:?} waiting until {what}");
    }

    /// Every node in `members` shows `total_nodes == members.len()` and each
    /// member exactly once as `alive`.
    pub fn converged(&self, members: &[usize]) -> bool {
        let ids = self.ids(members);
        members.iter().all(|&i| match self.nodes[i].status() {
            Some(v) => {
                total_nodes(&v) == Some(members.len() as u64)
                    && ids
                        .iter()
                        .all(|id| state_of(&v, id).as_deref() == Some("alive"))
            }
            None => false,
        })
    }

    pub fn wait_converged(&self, members: &[usize]) {
        let what = format!(
            "{:?} all show total_nodes {} with every one alive",
            self.ids(members),
            members.len()
        );
        self.wait_until(&what, || self.converged(members));
    }

    /// Sum of a metric over the given nodes (absent series count as 0).
    pub fn metric_total(&self, members: &[usize], name: &str, labels: &[(&str, &str)]) -> f64 {
        members
            .iter()
            .filter_map(|&i| self.nodes[i].metrics())
            .map(|m| metric_sum(&m, name, labels).unwrap_or(0.0))
            .sum()
    }

    pub fn all(&self) -> Vec<usize> {
        (0..self.nodes.len()).collect()
    }

    /// Prints, for every node: process state, status JSON, mesh metrics, log tail.
    pub fn dump(&self) {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\n======== cluster {} ({} nodes), files in {} ========",
            self.prefix,
            self.nodes.len(),
            self.dir.display()
        );
        for n in &self.nodes {
            let _ = writeln!(
                out,
                "---- {} @ {} / admin {}: {}",
                n.id(),
                n.gossip_addr(),
                n.admin_addr(),
                n.describe()
            );
            match n.status() {
                Some(v) => {
                    let mut s = serde_json::to_string_pretty(&v).unwrap_or_default();
                    if s.len() > 6000 {
                        s.truncate(6000);
                        s.push_str("\n…(truncated)");
                    }
                    let _ = writeln!(out, "status: {s}");
                }
                None => {
                    let why =
                        match n.get("/admin/cluster/status", Some((ADMIN_USER, ADMIN_PASSWORD))) {
                            Ok(r) => format!("HTTP {} {}", r.status, truncate(&r.text(), 300)),
                            Err(e) => format!("error {e}"),
                        };
                    let _ = writeln!(out, "status: unavailable ({why})");
                }
            }
            if let Some(m) = n.metrics() {
                let mesh: Vec<&str> = m.lines().filter(|l| l.starts_with("mesh_")).collect();
                let _ = writeln!(out, "metrics:\n{}", mesh.join("\n"));
            }
            let _ = writeln!(
                out,
                "log tail ({}):\n{}",
                n.log_path.display(),
                n.log_tail(40)
            );
        }
        let _ = writeln!(out, "======== end of cluster {} ========", self.prefix);
        eprintln!("{out}");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.nodes.clear(); // kills every process first
        if std::thread::panicking() || std::env::var_os("SBMESH_KEEP_TMP").is_some() {
            eprintln!("kept node logs and state in {}", self.dir.display());
        } else {
            let mut res = fs::remove_dir_all(&self.dir);
            for _ in 0..3 {
                if res.is_ok() || !self.dir.exists() {
                    return;
                }
                std::thread::sleep(POLL_INTERVAL);
                res = fs::remove_dir_all(&self.dir);
            }
            if let Err(e) = res {
                eprintln!("could not remove {}: {e}", self.dir.display());
            }
        }
    }
}

pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Writes through a temp file and a rename, as a Secret volume update does.
pub fn write_atomic(path: &Path, contents: &str) {
    let tmp = path.with_extension("tmp-write");
    fs::write(&tmp, contents).expect("write temp file");
    fs::rename(&tmp, path).expect("rename into place");
}

// ---------------------------------------------------------------------------
// Status JSON helpers (docs/reference.md#cluster-status)
// ---------------------------------------------------------------------------

pub fn total_nodes(v: &Value) -> Option<u64> {
    v.pointer("/summary/total_nodes").and_then(Value::as_u64)
}

pub fn node_entries<'a>(v: &'a Value, node_id: &str) -> Vec<&'a Value> {
    v.get("nodes")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter(|n| n.get("node_id").and_then(Value::as_str) == Some(node_id))
                .collect()
        })
        .unwrap_or_default()
}

/// `membership_state` of `node_id`, when it is listed exactly once.
pub fn state_of(v: &Value, node_id: &str) -> Option<String> {
    match node_entries(v, node_id).as_slice() {
        [one] => one
            .get("membership_state")
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

pub fn incarnation_of(v: &Value, node_id: &str) -> Option<u64> {
    match node_entries(v, node_id).as_slice() {
        [one] => one.get("incarnation").and_then(Value::as_u64),
        _ => None,
    }
}

/// All node ids listed, with repetitions.
pub fn listed_ids(v: &Value) -> Vec<String> {
    v.get("nodes")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|n| n.get("node_id").and_then(Value::as_str).map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

pub fn listed_set(v: &Value) -> BTreeSet<String> {
    listed_ids(v).into_iter().collect()
}

// ---------------------------------------------------------------------------
// Prometheus text
// ---------------------------------------------------------------------------

/// A sample: metric name, labels, value.
pub type Sample<'a> = (&'a str, Vec<(String, String)>, f64);

/// Parses `name{labels} value [timestamp]`; `None` for comments and blanks.
pub fn parse_sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if rest.starts_with('{') {
        let mut chars = rest[1..].char_indices();
        let mut key = String::new();
        let mut consumed = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '}' => {
                    consumed = Some(i + 2);
                    break;
                }
                ',' | ' ' => {}
                '=' => {
                    // expect a quoted value
                    let mut val = String::new();
                    let (_, q) = chars.next()?;
                    if q != '"' {
                        return None;
                    }
                    loop {
                        let (_, c) = chars.next()?;
                        match c {
                            '\\' => match chars.next()?.1 {
                                'n' => val.push('\n'),
                                other => val.push(other),
                            },
                            '"' => break,
                            other => val.push(other),
                        }
                    }
                    labels.push((std::mem::take(&mut key), val));
                }
                other => key.push(other),
            }
        }
        rest = &rest[consumed?..];
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((name, labels, value))
}

/// Sum of every sample of `name` whose labels include all of `want`;
/// `None` when no sample matches.
pub fn metric_sum(text: &str, name: &str, want: &[(&str, &str)]) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        if let Some((n, labels, v)) = parse_sample(line)
            && n == name
            && want
                .iter()
                .all(|(k, wv)| labels.iter().any(|(lk, lv)| lk == k && lv == wv))
        {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum
}

/// The family is declared (`# TYPE`/`# HELP`, OpenMetrics names counters
/// without `_total` there) or has a sample.
pub fn metric_family_present(text: &str, name: &str) -> bool {
    let base = name.strip_suffix("_total").unwrap_or(name);
    text.lines().any(|l| {
        if let Some(rest) = l
            .strip_prefix("# TYPE ")
            .or_else(|| l.strip_prefix("# HELP "))
        {
            let fam = rest.split_whitespace().next().unwrap_or("");
            fam == name || fam == base
        } else {
            parse_sample(l).is_some_and(|(n, _, _)| n == name)
        }
    })
}

// ---------------------------------------------------------------------------
// A tiny blocking HTTP/1.1 client
// ---------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub fn http_get(
    addr: SocketAddr,
    path: &str,
    auth: Option<(&str, &str)>,
) -> io::Result<HttpResponse> {
    let mut req =
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: */*\r\n");
    if let Some((u, p)) = auth {
        let _ = write!(
            req,
            "Authorization: Basic {}\r\n",
            base64(format!("{u}:{p}").as_bytes())
        );
    }
    req.push_str("\r\n");
    http_raw(addr, req.as_bytes())
}

/// Sends `request` as is and reads one response.
pub fn http_raw(addr: SocketAddr, request: &[u8]) -> io::Result<HttpResponse> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(request)?;
    let mut buf = Vec::with_capacity(4096);
    let mut chunk = [0u8; 16384];
    loop {
        if let Some(resp) = parse_response(&buf)? {
            return Ok(resp);
        }
        let n = s.read(&mut chunk)?;
        if n == 0 {
            // EOF: whatever we have is the body (close-delimited).
            return parse_response_eof(&buf);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

type Head = (u16, Vec<(String, String)>, usize);

fn parse_head(buf: &[u8]) -> io::Result<Option<Head>> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| bad("non-UTF-8 head"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("bad status line {status_line:?}")))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Ok(Some((status, headers, end + 4)))
}

/// A complete response, or `None` while more bytes are needed.
fn parse_response(buf: &[u8]) -> io::Result<Option<HttpResponse>> {
    let Some((status, headers, body_start)) = parse_head(buf)? else {
        return Ok(None);
    };
    let resp = |body: Vec<u8>| HttpResponse {
        status,
        headers: headers.clone(),
        body,
    };
    let find = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let body = &buf[body_start..];
    if find("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
        return Ok(decode_chunked(body)?.map(resp));
    }
    if let Some(len) = find("content-length") {
        let len: usize = len.parse().map_err(|_| bad("bad content-length"))?;
        return Ok((body.len() >= len).then(|| resp(body[..len].to_vec())));
    }
    if status == 204 || status == 304 || (100..200).contains(&status) {
        return Ok(Some(resp(Vec::new())));
    }
    Ok(None) // close-delimited
}

fn parse_response_eof(buf: &[u8]) -> io::Result<HttpResponse> {
    if let Some(r) = parse_response(buf)? {
        return Ok(r);
    }
    let (status, headers, body_start) =
        parse_head(buf)?.ok_or_else(|| bad("connection closed before a full response head"))?;
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let has_len = headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-length"));
    if chunked || has_len {
        return Err(bad("connection closed inside the body"));
    }
    Ok(HttpResponse {
        status,
        headers,
        body: buf[body_start..].to_vec(),
    })
}

fn decode_chunked(mut b: &[u8]) -> io::Result<Option<Vec<u8>>> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return Ok(None);
        };
        let size_line = std::str::from_utf8(&b[..eol]).map_err(|_| bad("bad chunk size"))?;
        let size_hex = size_line.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_hex, 16).map_err(|_| bad("bad chunk size"))?;
        b = &b[eol + 2..];
        if size == 0 {
            // trailers end with an empty line
            return Ok(b.windows(2).any(|w| w == b"\r\n").then_some(out));
        }
        if b.len() < size + 2 {
            return Ok(None);
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

pub fn base64(input: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for c in input.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        out.push(T[(n >> 18) as usize & 63] as char);
        out.push(T[(n >> 12) as usize & 63] as char);
        out.push(if c.len() > 1 {
            T[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if c.len() > 2 {
            T[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

// ---------------------------------------------------------------------------
// Randomness (no dependency needed for garbage bytes)
// ---------------------------------------------------------------------------

pub struct Rng(u64);

impl Rng {
    pub fn seeded() -> Rng {
        let seed = std::env::var("SBMESH_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| now_unix_ms() ^ (u64::from(std::process::id()) << 32));
        eprintln!("random seed {seed} (set SBMESH_TEST_SEED to repeat)");
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        // xorshift64*
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + 8);
        while v.len() < len {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(len);
        v
    }
}

// ---------------------------------------------------------------------------
// Private network namespaces (`unshare -rn`)
// ---------------------------------------------------------------------------

/// `name` from PATH, else from /usr/sbin or /sbin (a developer's PATH often
/// lacks them); the bare name when found nowhere, so the error names it.
pub fn tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// Whether `unshare -rn` works here; `Err` says why not.
pub fn netns_available() -> Result<(), String> {
    match Command::new(tool("unshare"))
        .args(["-rn", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
    {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(format!(
            "`unshare -rn true` failed ({}): {}",
            describe_exit(o.status),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("cannot run `unshare` (util-linux): {e}")),
    }
}

/// Inside the namespace: brings `lo` up (a new namespace has it down).
pub fn netns_setup() {
    let out = Command::new(tool("ip"))
        .args(["link", "set", "lo", "up"])
        .output()
        .expect(
            "`ip` (iproute2) is needed inside the network namespace: apt-get install -y iproute2",
        );
    assert!(
        out.status.success(),
        "`ip link set lo up` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// For a `#[test]` that must run in its own network namespace. Outside, it
/// re-executes this test binary as `unshare -rn <self> <test_name> --exact`
/// and checks the inner run passed, then returns `false` (the caller
/// returns). Inside, it sets up `lo` and returns `true` (the caller runs the
/// body and then calls [`netns_test_passed`]). When namespaces are not
/// available it prints a SKIP reason and returns `false`, except in CI
/// or under `scripts/test` ([`required::servers_required`]), where that is a failure.
pub fn enter_netns_test(test_name: &str) -> bool {
    if std::env::var_os(IN_NETNS_ENV).is_some() {
        netns_setup();
        return true;
    }
    if let Err(why) = netns_available() {
        return required::missing(
            test_name,
            &format!("no private network namespace: {why}"),
            "unshare -rn, which scripts/test's machine allows",
        )
        .unwrap_or(false);
    }
    let marker = std::env::temp_dir().join(format!(
        "sbmesh-netns-{}-{}-{test_name}.passed",
        std::process::id(),
        now_unix_ms()
    ));
    let exe = std::env::current_exe().expect("current_exe");
    eprintln!("re-running {test_name} inside `unshare -rn`");
    let status = Command::new(tool("unshare"))
        .arg("-rn")
        .arg("--")
        .arg(&exe)
        .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env(IN_NETNS_ENV, "1")
        .env(NETNS_MARKER_ENV, &marker)
        .status()
        .expect("run unshare");
    let passed = marker.exists();
    let _ = fs::remove_file(&marker);
    assert!(
        status.success(),
        "{test_name} failed inside the network namespace ({}); its output is above",
        describe_exit(status)
    );
    assert!(
        passed,
        "the inner run of {test_name} did not reach its end (test name filter wrong?)"
    );
    false
}

/// Called at the end of the body run inside the namespace.
pub fn netns_test_passed() {
    if let Some(m) = std::env::var_os(NETNS_MARKER_ENV) {
        fs::write(m, "passed").expect("write netns marker");
    }
}

/// Runs `iptables ARGS`, panicking with the output on failure.
pub fn iptables(args: &[&str]) {
    let out = Command::new(tool("iptables"))
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run iptables ({e}); scripts/test installs it (apt-get install -y iptables)"
            )
        });
    assert!(
        out.status.success(),
        "iptables {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn require_iptables() {
    match Command::new(tool("iptables")).arg("-V").output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "iptables -V failed: {}; scripts/test installs it (apt-get install -y iptables)",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!(
            "iptables not found ({e}); scripts/test installs it (apt-get install -y iptables)"
        ),
    }
}
