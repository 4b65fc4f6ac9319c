//! Mesh at scale: N real `sbmesh-sidecar run` processes, one per 127.0.31.y
//! address, all on port 7946, each seeded with the full list (as a
//! StatefulSet's pods are). Prints one markdown table row for BENCHMARKS.md.
//!
//! ```text
//! SBMESH_BENCH_N=32  cargo bench -p sbmesh-sidecar --bench mesh_scale
//! SBMESH_BENCH_N=128 cargo bench -p sbmesh-sidecar --bench mesh_scale
//! # false `down` events under 10 % random loss on lo, 10 minutes, in `unshare -rn`:
//! SBMESH_BENCH_N=32 SBMESH_BENCH_LOSS=0.10 SBMESH_BENCH_SECS=600 \
//!     cargo bench -p sbmesh-sidecar --bench mesh_scale
//! ```
//!
//! `cargo bench` builds the sidecar with the bench profile (= release) and
//! this bench runs that binary (`target/release/sbmesh-sidecar`);
//! `SBMESH_SIDECAR_BIN=path` runs another one.
//!
//! Measured (status = `GET /admin/cluster/status`, polled every 100 ms —
//! `SBMESH_BENCH_POLL_MS` — per node from 16 threads,
//! `SBMESH_BENCH_POLL_THREADS`):
//! - converge: from the moment the last process was spawned until every
//!   node's status shows `total_nodes = N`. A polled figure is when an
//!   answer showed it; each line also gives when the last answer that did
//!   not was asked for (it came to hold between the two) and the longest
//!   time between two asks of one node (at N = 512 a round of status
//!   requests takes seconds while the start loads the machine). From the
//!   nodes' logs: when the last node logged `member up` for every other,
//!   and, over every pair of a node and a member spawned a second or more
//!   after it, how long from the member's spawn to that node's first
//!   `member up` for it (percentiles);
//! - kill -9: from the SIGKILL of one node until every survivor shows it
//!   `down` (`SBMESH_BENCH_KILLS=k`: k nodes, one after another, 3 s apart;
//!   median and max);
//! - SIGTERM: from the SIGTERM of another node until every survivor shows it
//!   `down` (and its exit code);
//! - bytes/node/s: `mesh_bytes_sent_total` (udp + tcp) deltas per node over
//!   `SBMESH_BENCH_STEADY_SECS` (20) at steady state, after
//!   `SBMESH_BENCH_SETTLE_SECS` (30) of settling (the join tail);
//! - RSS: VmRSS of every process at steady state, median and max;
//! - CPU: the sidecars' CPU time from the first spawn to convergence, and
//!   per second at steady state (over the bytes' window).
//!
//! With `SBMESH_BENCH_LOSS=p` the bench re-executes itself inside
//! `unshare -rn`, converges without loss, then adds
//! `iptables -A INPUT -i lo -m statistic --mode random --probability p -j DROP`
//! for `SBMESH_BENCH_SECS` (600) seconds, polls every status every 2 s for
//! `down`/`suspect` entries, and at the end counts false `down` transitions as
//! the increase of `mesh_member_state_changes_total{state="down"}` summed over
//! all nodes (nobody is killed in that mode, so every one is false), beside
//! the suspicions (`{state="suspect"}`: failed probes, far more frequent, so
//! they show a difference between two builds with some statistical weight),
//! the identity renewals the nodes logged, and the sidecars' CPU and major
//! page faults during the loss.
//!
//! Start patterns (`SBMESH_BENCH_START`):
//! - `burst` (default): the bench spawns all N back to back;
//! - `spread`: a separate spawner process (this bench re-executed with
//!   `SBMESH_BENCH_SPAWNER` set) starts one every `SBMESH_BENCH_SPREAD_MS`
//!   (10) ms, as a StatefulSet with `Parallel` pod management does, so the
//!   bench's polling threads do not pace the spawns; it reports every PID,
//!   keeps the processes unreaped (their PIDs stay theirs) and kills them all
//!   when the bench closes its stdin or dies;
//! - `ordered` (OrderedReady): each node is started once the previous one
//!   answers `/readyz` 200; converge counts from the last one's 200.
//!
//! `SBMESH_BENCH_FULL=1` runs every node as in production: the ACME manager
//! on (a shared `file` store, no origin, so nothing is due and the CA is
//! never contacted), the store open and the reload watcher on. Without it
//! the store (redb) and the reloader run too, but ACME is off.
//!
//! `SBMESH_BENCH_STARVE=1`: after the steady-state figures, one node is
//! SIGSTOPped for 1.5 s every 10 s for `SBMESH_BENCH_SECS` (120); counts
//! `down` transitions on the others (counter increase, per node) and which
//! members were seen `down` (polled every second), and shows the starved
//! node's incarnation everywhere before and after (it refutes by raising
//! it).
//!
//! `SBMESH_BENCH_DEBUG_NODES=1,64,128` runs those nodes with
//! `RUST_LOG=sbmesh=debug` and `SBMESH_KEEP_TMP=1` keeps their logs.
//!
//! Every wait is bounded (`SBMESH_BENCH_TIMEOUT_SECS`, 180 s) and every
//! process started is killed at the end, by PID.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use serde::Deserialize;
use serde_json::Value;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("{name}={s:?} does not parse")),
        Err(_) => default,
    }
}

fn fetch_status(addr: SocketAddr) -> Option<Value> {
    let r = http_get(
        addr,
        "/admin/cluster/status",
        Some((ADMIN_USER, ADMIN_PASSWORD)),
    )
    .ok()?;
    if r.status != 200 {
        return None;
    }
    serde_json::from_slice(&r.body).ok()
}

fn fetch_metric(addr: SocketAddr, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    for _ in 0..5 {
        if let Ok(r) = http_get(addr, "/metrics", None)
            && r.status == 200
        {
            return Some(metric_sum(&r.text(), name, labels).unwrap_or(0.0));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    None
}

/// The part of `/admin/cluster/status` the bench reads; serde skips the
/// rest without building it (a status of 128 members is ~40 KB).
#[derive(Deserialize)]
struct Brief {
    summary: BriefSummary,
    nodes: Vec<BriefNode>,
}

#[derive(Deserialize)]
struct BriefSummary {
    total_nodes: u64,
}

#[derive(Deserialize)]
struct BriefNode {
    node_id: String,
    membership_state: String,
}

impl Brief {
    fn state_of(&self, id: &str) -> Option<&str> {
        let mut it = self.nodes.iter().filter(|n| n.node_id == id);
        match (it.next(), it.next()) {
            (Some(n), None) => Some(n.membership_state.as_str()),
            _ => None,
        }
    }
}

fn fetch_brief(addr: SocketAddr) -> Option<Brief> {
    let r = http_get(
        addr,
        "/admin/cluster/status",
        Some((ADMIN_USER, ADMIN_PASSWORD)),
    )
    .ok()?;
    if r.status != 200 {
        return None;
    }
    serde_json::from_slice(&r.body).ok()
}

/// Per node, each `(seconds since t0, total_nodes)` at which the count it
/// showed changed.
type History = Mutex<Vec<Vec<(f64, u64)>>>;

/// What `poll_all` saw, per address (times since its `t0`).
struct Polled {
    /// When the predicate was first seen to hold (the answer's arrival), or
    /// `None` if it never did before the timeout.
    seen: Vec<Option<Duration>>,
    /// When the last answer that did not satisfy it was asked for: the
    /// state still failed the predicate at some moment after this one, so
    /// the predicate came to hold somewhere in `(before, seen]`.
    before: Vec<Option<Duration>>,
    /// The longest time between asking one address twice (a polling
    /// round under load takes longer than `interval`).
    widest_round: Duration,
}

/// Polls every address's status every `interval` (from
/// `SBMESH_BENCH_POLL_THREADS` threads, 16) until `pred` holds on it. A
/// node is no longer polled once it passed.
fn poll_all(
    addrs: &[SocketAddr],
    t0: Instant,
    interval: Duration,
    timeout: Duration,
    history: Option<&History>,
    pred: impl Fn(&Brief) -> bool + Sync,
) -> Polled {
    let polled = Mutex::new(Polled {
        seen: vec![None; addrs.len()],
        before: vec![None; addrs.len()],
        widest_round: Duration::ZERO,
    });
    let threads = addrs
        .len()
        .clamp(1, env_or("SBMESH_BENCH_POLL_THREADS", 16usize).max(1));
    let end = Instant::now() + timeout;
    std::thread::scope(|s| {
        for t in 0..threads {
            let (polled, pred) = (&polled, &pred);
            s.spawn(move || {
                let mut pending: Vec<usize> = (t..addrs.len()).step_by(threads).collect();
                let mut last_round: Option<Instant> = None;
                while !pending.is_empty() && Instant::now() < end {
                    let round = Instant::now();
                    if let Some(prev) = last_round {
                        let mut p = polled.lock().unwrap();
                        p.widest_round = p.widest_round.max(round - prev);
                    }
                    last_round = Some(round);
                    pending.retain(|&i| {
                        let asked = t0.elapsed();
                        let brief = fetch_brief(addrs[i]);
                        if let (Some(h), Some(b)) = (history, &brief) {
                            let mut h = h.lock().unwrap();
                            let total = b.summary.total_nodes;
                            if h[i].last().is_none_or(|&(_, t)| t != total) {
                                h[i].push((t0.elapsed().as_secs_f64(), total));
                            }
                        }
                        let mut p = polled.lock().unwrap();
                        match brief.map(|b| pred(&b)) {
                            Some(true) => {
                                p.seen[i] = Some(t0.elapsed());
                                false
                            }
                            Some(false) => {
                                p.before[i] = Some(asked);
                                true
                            }
                            None => true,
                        }
                    });
                    if let Some(rest) = interval.checked_sub(round.elapsed()) {
                        std::thread::sleep(rest);
                    }
                }
            });
        }
    });
    polled.into_inner().unwrap()
}

fn secs(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64())
}

/// "max (p50 …)" of a phase, or "> timeout" naming the laggards.
fn summarize(what: &str, polled: &Polled, ids: &[String], timeout: Duration) -> String {
    let r = &polled.seen;
    let mut done: Vec<Duration> = r.iter().flatten().copied().collect();
    done.sort();
    if done.len() == r.len() && !done.is_empty() {
        let max = *done.last().unwrap();
        let p50 = done[done.len() / 2];
        let before = polled.before.iter().flatten().max().copied();
        let bracket = match before {
            Some(b) => format!(
                "; the last answer without it was asked for at {} s, so it came to hold everywhere between {} and {} s",
                secs(b),
                secs(b),
                secs(max)
            ),
            None => "; every first answer already showed it".to_string(),
        };
        eprintln!(
            "{what}: all {} in {} s (p50 {} s){bracket}; one address was asked again at most {} s later",
            r.len(),
            secs(max),
            secs(p50),
            secs(polled.widest_round)
        );
        secs(max)
    } else {
        let missing: Vec<&String> = r
            .iter()
            .zip(ids)
            .filter(|(d, _)| d.is_none())
            .map(|(_, id)| id)
            .collect();
        eprintln!(
            "{what}: TIMEOUT after {timeout:?}: {} of {} never did: {:?}",
            missing.len(),
            r.len(),
            missing
        );
        format!(
            "> {} (timeout, {} missing)",
            timeout.as_secs(),
            missing.len()
        )
    }
}

/// The five nodes that converged last, with how their count grew.
fn print_laggards(r: &[Option<Duration>], ids: &[String], history: &[Vec<(f64, u64)>]) {
    let mut order: Vec<usize> = (0..r.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(r[i].unwrap_or(Duration::MAX)));
    for &i in order.iter().take(5) {
        let steps: Vec<String> = history[i]
            .iter()
            .map(|(t, k)| format!("{t:.2}s:{k}"))
            .collect();
        eprintln!(
            "  slow: {} total_nodes over time: {}",
            ids[i],
            steps.join(" ")
        );
    }
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

/// Set (to the plan file) in the environment of the spawner child.
const SPAWNER_ENV: &str = "SBMESH_BENCH_SPAWNER";

/// One process for the spawner to start, as the bench prepared it.
#[derive(serde::Serialize, Deserialize)]
struct Planned {
    bin: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    env: Vec<(String, String)>,
}

/// The spawner child: starts the planned processes one every `spread` on
/// an absolute schedule, prints `pid <index> <pid>` for each and
/// `last <unix ms>` after the last, then waits for its stdin to close and
/// kills them all. It reaps nothing before that, so a PID the bench holds
/// never belongs to another process.
fn spawner(plan: &str) {
    let plan: Vec<Planned> =
        serde_json::from_slice(&std::fs::read(plan).expect("read the spawn plan"))
            .expect("parse the spawn plan");
    let spread = Duration::from_millis(env_or("SBMESH_BENCH_SPREAD_MS", 10));
    let mut out = std::io::stdout().lock();
    let mut children = Vec::new();
    let t0 = Instant::now();
    for (i, p) in plan.iter().enumerate() {
        if let Some(wait) = (t0 + spread * i as u32).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let child = node_command(&p.bin, &p.args, &p.log, &p.env, 1)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", p.bin.display()));
        writeln!(out, "pid {i} {}", child.id()).expect("stdout");
        out.flush().expect("stdout");
        children.push(child);
    }
    writeln!(out, "last {}", now_unix_ms()).expect("stdout");
    out.flush().expect("stdout");
    drop(out);
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    for c in &mut children {
        let _ = c.kill();
    }
    for c in &mut children {
        let _ = c.wait();
    }
}

/// The spawner process; dropping it closes its stdin, so it kills and
/// reaps what it started.
struct Spawner {
    child: std::process::Child,
}

impl Drop for Spawner {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the prepared nodes of `c` from a spawner child; returns it and
/// the instant of the last spawn.
fn spawn_spread(c: &mut Cluster) -> (Spawner, Instant) {
    let plan: Vec<Planned> = c
        .nodes
        .iter()
        .map(|n| Planned {
            bin: c.bin.clone(),
            args: n.args(),
            log: n.log_path.clone(),
            env: n.env.clone(),
        })
        .collect();
    let plan_path = c.dir.join("spawn-plan.json");
    std::fs::write(&plan_path, serde_json::to_vec(&plan).expect("plan")).expect("write plan");
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.env(SPAWNER_ENV, &plan_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("start the spawner");
    let stdout = child.stdout.take().expect("piped stdout");
    let spawner = Spawner { child };
    let mut last = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read the spawner");
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["pid", i, pid] => {
                let (i, pid): (usize, u32) = (i.parse().expect("index"), pid.parse().expect("pid"));
                c.nodes[i].adopt(pid);
            }
            ["last", ms] => {
                let ms: u64 = ms.parse().expect("unix ms");
                let ago = Duration::from_millis(now_unix_ms().saturating_sub(ms));
                last = Some(Instant::now() - ago);
                break;
            }
            _ => panic!("spawner said {line:?}"),
        }
    }
    let last = last.expect("the spawner ended before its last spawn");
    (spawner, last)
}

/// `/readyz` answers 200.
fn ready(addr: SocketAddr) -> bool {
    http_get(addr, "/readyz", None).is_ok_and(|r| r.status == 200)
}

/// The production-like `sb.yml` of `SBMESH_BENCH_FULL`: ACME on with a
/// store every node shares and nothing to order.
fn full_config(dir: &Path) -> String {
    format!(
        "proxy:\n  admin:\n    enabled: true\n    port: 9090\n  extensions:\n    sbmesh:\n      \
         acme:\n        enabled: true\n        email: ops@example.com\n        \
         directory_url: \"http://127.0.0.1:9/directory\"\n        storage_backend: file\n        \
         storage_path: \"{}\"\norigins: {{}}\n",
        dir.join("store").display()
    )
}

/// CPU seconds the hypervisor gave to others (`steal` of /proc/stat's
/// `cpu` line, all CPUs together).
fn stolen_secs() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let steal: f64 = line.split_whitespace().nth(8)?.parse().ok()?;
    // USER_HZ: 100 on every Linux this runs on.
    Some(steal / 100.0)
}

/// UDP receive-buffer errors of the whole namespace (`/proc/net/snmp`).
fn udp_rcvbuf_errors() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/net/snmp").ok()?;
    let mut it = s.lines().filter(|l| l.starts_with("Udp:"));
    let (head, vals) = (it.next()?, it.next()?);
    let k = head.split_whitespace().position(|h| h == "RcvbufErrors")?;
    vals.split_whitespace().nth(k)?.parse().ok()
}

/// Drops per gossip socket (`/proc/net/udp`: local address, last column),
/// largest first.
fn gossip_socket_drops() -> Vec<(Ipv4Addr, u64)> {
    let s = std::fs::read_to_string("/proc/net/udp").unwrap_or_default();
    let mut drops: Vec<(Ipv4Addr, u64)> = s
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (ip, port) = f.get(1)?.split_once(':')?;
            if u16::from_str_radix(port, 16).ok()? != GOSSIP_PORT {
                return None;
            }
            // The kernel prints the address in host byte order.
            let ip = Ipv4Addr::from(u32::from_str_radix(ip, 16).ok()?.swap_bytes());
            Some((ip, f.last()?.parse().ok()?))
        })
        .collect();
    drops.sort_by_key(|&(_, d)| std::cmp::Reverse(d));
    drops
}

fn main() {
    if let Ok(plan) = std::env::var(SPAWNER_ENV) {
        spawner(&plan);
        return;
    }
    let n: u16 = env_or("SBMESH_BENCH_N", 32);
    assert!(
        (2..=1000).contains(&n),
        "SBMESH_BENCH_N must be 2..=1000 (250 per /24: <prefix>.1-250, then the next /24)"
    );
    let start: String = env_or("SBMESH_BENCH_START", "burst".to_string());
    assert!(
        ["burst", "spread", "ordered"].contains(&start.as_str()),
        "SBMESH_BENCH_START is burst, spread or ordered"
    );
    let full = std::env::var_os("SBMESH_BENCH_FULL").is_some_and(|v| v == "1");
    let starve = std::env::var_os("SBMESH_BENCH_STARVE").is_some_and(|v| v == "1");
    let debug_nodes: BTreeSet<u16> = std::env::var("SBMESH_BENCH_DEBUG_NODES")
        .unwrap_or_default()
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let loss: Option<f64> = std::env::var("SBMESH_BENCH_LOSS").ok().map(|s| {
        s.parse()
            .expect("SBMESH_BENCH_LOSS is a probability like 0.10")
    });
    let run_secs: u64 = env_or("SBMESH_BENCH_SECS", if starve { 120 } else { 600 });
    let steady_secs: u64 = env_or("SBMESH_BENCH_STEADY_SECS", 20);
    // Joining disseminates every member's metadata once; steady state is
    // what follows.
    let settle_secs: u64 = env_or("SBMESH_BENCH_SETTLE_SECS", 30);
    let timeout = Duration::from_secs(env_or("SBMESH_BENCH_TIMEOUT_SECS", 180));
    let interval = Duration::from_millis(env_or("SBMESH_BENCH_POLL_MS", 100));
    let prefix: String = env_or("SBMESH_BENCH_PREFIX", "127.0.31".to_string());

    if loss.is_some() {
        if std::env::var_os(IN_NETNS_ENV).is_none() {
            if let Err(why) = netns_available() {
                eprintln!("the loss mode needs a private network namespace: {why}");
                std::process::exit(1);
            }
            eprintln!("re-running inside `unshare -rn`");
            let st = Command::new(tool("unshare"))
                .arg("-rn")
                .arg("--")
                .arg(std::env::current_exe().expect("current_exe"))
                .args(std::env::args_os().skip(1))
                .env(IN_NETNS_ENV, "1")
                .status()
                .expect("run unshare");
            std::process::exit(st.code().unwrap_or(1));
        }
        netns_setup();
        require_iptables();
    }

    let bin = std::env::var_os("SBMESH_SIDECAR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(sidecar_bin);
    eprintln!("sidecar binary: {}", bin.display());
    eprintln!(
        "N = {n}, start {start}, {} config",
        if full { "full (ACME on)" } else { "default" }
    );

    // Declared before the cluster so that it is dropped after it: the
    // cluster kills the adopted PIDs while the spawner still holds them.
    let mut _spawner: Option<Spawner> = None;
    let mut c = Cluster::new(&prefix);
    c.bin = bin;
    if full {
        let config = c.config.with_file_name("sb-full.yml");
        std::fs::write(&config, full_config(&c.dir)).expect("write the full sb.yml");
        c.config = config;
    }
    // Node i on <prefix>.i up to 250, then on the next /24 (N = 512 needs
    // three: 127.0.31-33.x).
    let ip_of = |i: u16| {
        let [a, b, third, _] = c.ip(1).octets();
        let i = i - 1;
        Ipv4Addr::new(a, b, third + (i / 250) as u8, (i % 250 + 1) as u8)
    };
    let seeds: Vec<SocketAddr> = (1..=n)
        .map(|i| SocketAddr::new(ip_of(i).into(), GOSSIP_PORT))
        .collect();
    let nodes: Vec<Node> = (1..=n)
        .map(|i| {
            let opts = NodeOpts {
                node_id: format!("node-{i}"),
                ip: ip_of(i),
                seeds: seeds.clone(),
                ..c.default_opts(1, 2)
            };
            let mut node = Node::prepare(&c.bin, &c.config, &c.dir, opts);
            if debug_nodes.contains(&i) {
                node.env
                    .push(("RUST_LOG".into(), "info,sbmesh=debug".into()));
            }
            node
        })
        .collect();
    let rcvbuf_before = udp_rcvbuf_errors();
    let bench_cpu0 = cpu_secs(std::process::id()).unwrap_or(0.0);
    let steal0 = stolen_secs();
    let t_first_start = Instant::now();
    let t_last_start = match start.as_str() {
        "spread" => {
            c.nodes = nodes;
            let (sp, last) = spawn_spread(&mut c);
            _spawner = Some(sp);
            last
        }
        "ordered" => {
            for mut node in nodes {
                node.start();
                let addr = node.admin_addr();
                c.nodes.push(node);
                let end = Instant::now() + timeout;
                while !ready(addr) {
                    assert!(
                        Instant::now() < end,
                        "{} not ready after {timeout:?}",
                        c.nodes.last().map(Node::id).unwrap_or("?")
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            Instant::now()
        }
        _ => {
            for mut node in nodes {
                node.start();
                c.nodes.push(node);
            }
            Instant::now()
        }
    };
    let start_span = t_last_start.saturating_duration_since(t_first_start);
    let last_start_unix_ms =
        now_unix_ms().saturating_sub(t_last_start.elapsed().as_millis() as u64);
    eprintln!("first to last start ({start}): {} s", secs(start_span));
    let ids: Vec<String> = c.nodes.iter().map(|x| x.id().to_string()).collect();
    let addrs: Vec<SocketAddr> = c.nodes.iter().map(Node::admin_addr).collect();
    let nn = u64::from(n);

    // ---- convergence -------------------------------------------------------------
    let history = Mutex::new(vec![Vec::new(); addrs.len()]);
    let conv = poll_all(
        &addrs,
        t_last_start,
        interval,
        timeout,
        Some(&history),
        |b| b.summary.total_nodes == nn,
    );
    let converge = summarize("converge", &conv, &ids, timeout);
    let wall = t_first_start.elapsed().as_secs_f64();
    let sidecar_cpu: f64 = c.nodes.iter().filter_map(|x| cpu_secs(x.pid()?)).sum();
    let bench_cpu = cpu_secs(std::process::id()).unwrap_or(0.0) - bench_cpu0;
    eprintln!(
        "CPU from the first start to convergence ({wall:.2} s wall, {:.2} s on 2 cores): sidecars {sidecar_cpu:.2} s, the bench's pollers {bench_cpu:.2} s",
        2.0 * wall
    );
    // Pages read back from the binary's file: a start-up page one sidecar
    // evicted is read from disk by the next one to touch it.
    let majflt_converged = proc_stat_sum(&c, MAJFLT);
    eprintln!("major page faults of all sidecars, start to convergence: {majflt_converged}");
    // On a virtual machine the host may run others on "our" cores: the
    // same start then takes longer and starves more sidecars.
    if let (Some(a), Some(b)) = (steal0, stolen_secs()) {
        eprintln!(
            "CPU time the host took from this machine (steal), start to convergence: {:.1} s of {:.1} s",
            b - a,
            2.0 * wall
        );
    }
    // Every node's log as it is now, read once for both figures (0.6 s and
    // 0.35 CPU-s of the bench at N = 512).
    let logs: Vec<String> = c
        .nodes
        .iter()
        .map(|n| std::fs::read_to_string(&n.log_path).unwrap_or_default())
        .collect();
    let from_logs = full_view_from_logs(&logs, addrs.len());
    let log_conv = if from_logs.iter().all(Option::is_some) {
        let last = from_logs.iter().flatten().max().copied().unwrap_or(0);
        let s = last.saturating_sub(last_start_unix_ms) as f64 / 1000.0;
        eprintln!(
            "converge from the nodes' logs (every node logged `member up` for all others): {s:.2} s after the last start"
        );
        format!("{s:.2}")
    } else {
        "n/a".to_string()
    };
    let stalls: std::collections::HashMap<&str, (u64, u64)> = c
        .nodes
        .iter()
        .zip(&logs)
        .map(|(node, text)| (node.id(), stalls_ms(text)))
        .collect();
    let stalled = |id: &str| stall_text(stalls.get(id).copied().unwrap_or((0, 0)));
    let mut longest: Vec<(u64, &str)> = stalls.iter().map(|(id, s)| (s.0, *id)).collect();
    longest.sort_by(|a, b| b.cmp(a));
    eprintln!(
        "stalls the sidecars logged (timers >= 1 s late) during the start: {} processes; longest: {}",
        longest.iter().filter(|s| s.0 > 0).count(),
        longest
            .iter()
            .take(5)
            .filter(|s| s.0 > 0)
            .map(|(_, id)| format!("{id} {}", stalled(id)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let delays = newcomer_delays_from_logs(&c, &logs);
    if let Some(&(max, _, _)) = delays.last() {
        let q = |p: f64| delays[((delays.len() - 1) as f64 * p) as usize].0;
        let slowest: Vec<String> = delays
            .iter()
            .rev()
            .take(5)
            .map(|(d, node, newcomer)| {
                format!(
                    "{node} learnt {newcomer} after {d:.2} s (stalls: {}; {})",
                    stalled(node),
                    stalled(newcomer)
                )
            })
            .collect();
        eprintln!(
            "a newcomer unknown to a node up before it (spawn to first `member up`, {} pairs): p50 {:.2} s, p99 {:.2} s, p99.9 {:.2} s, max {max:.2} s; over 2 s: {}; slowest: {}",
            delays.len(),
            q(0.5),
            q(0.99),
            q(0.999),
            delays.iter().filter(|d| d.0 > 2.0).count(),
            slowest.join(", ")
        );
    }
    drop(delays);
    drop(stalls);
    drop(logs);
    print_laggards(&conv.seen, &ids, &history.into_inner().unwrap());
    if let Some(k) = conv.seen.iter().position(Option::is_none) {
        let v = fetch_status(addrs[k]);
        eprintln!(
            "{} total_nodes: {:?}; log tail:\n{}",
            ids[k],
            v.as_ref().and_then(total_nodes),
            c.nodes[k].log_tail(20)
        );
    }
    let rcvbuf = match (rcvbuf_before, udp_rcvbuf_errors()) {
        (Some(a), Some(b)) => format!("{}", b.saturating_sub(a)),
        _ => "n/a".to_string(),
    };
    let drops = gossip_socket_drops();
    let top: Vec<String> = drops
        .iter()
        .take(8)
        .map(|(ip, d)| format!("{ip} {d}"))
        .collect();
    eprintln!(
        "UDP receive-buffer errors during the start: {rcvbuf}; gossip socket drops: {} on {} of {} sockets (most: {})",
        drops.iter().map(|d| d.1).sum::<u64>(),
        drops.iter().filter(|d| d.1 > 0).count(),
        drops.len(),
        top.join(", ")
    );

    // ---- steady state: bytes and RSS -------------------------------------------------
    std::thread::sleep(Duration::from_secs(settle_secs));
    let sample = || -> Vec<Option<(Instant, f64)>> {
        addrs
            .iter()
            .map(|&a| fetch_metric(a, "mesh_bytes_sent_total", &[]).map(|b| (Instant::now(), b)))
            .collect()
    };
    let sidecars_cpu = || -> f64 { c.nodes.iter().filter_map(|x| cpu_secs(x.pid()?)).sum() };
    let s0 = sample();
    let (cpu0, wall0) = (sidecars_cpu(), Instant::now());
    std::thread::sleep(Duration::from_secs(steady_secs));
    let (cpu1, wall1) = (sidecars_cpu(), wall0.elapsed().as_secs_f64());
    let s1 = sample();
    eprintln!(
        "sidecar CPU at steady state: {:.3} CPU-s/s for all {} ({:.2} ms/s each)",
        (cpu1 - cpu0) / wall1,
        c.nodes.len(),
        1000.0 * (cpu1 - cpu0) / wall1 / c.nodes.len().max(1) as f64
    );
    let mut by_node: Vec<(f64, &str)> = s0
        .iter()
        .zip(&s1)
        .zip(&ids)
        .filter_map(|((a, b), id)| match (a, b) {
            (Some((t0, b0)), Some((t1, b1))) => Some((
                (b1 - b0) / t1.duration_since(*t0).as_secs_f64(),
                id.as_str(),
            )),
            _ => None,
        })
        .collect();
    by_node.sort_by(|a, b| a.0.total_cmp(&b.0));
    let busiest: Vec<String> = by_node
        .iter()
        .rev()
        .take(3)
        .map(|(r, id)| format!("{id} {r:.0}"))
        .collect();
    eprintln!("busiest senders (bytes/s): {}", busiest.join(", "));
    let rates: Vec<f64> = by_node.iter().map(|(r, _)| *r).collect();
    let bytes = if rates.is_empty() {
        "n/a".to_string()
    } else {
        let mean = rates.iter().sum::<f64>() / rates.len() as f64;
        format!("{mean:.0} / {:.0}", rates.last().unwrap())
    };
    eprintln!(
        "bytes sent per node per second (mean / max over {} nodes): {bytes}",
        rates.len()
    );
    let mut rss: Vec<u64> = c.nodes.iter().filter_map(Node::rss_kib).collect();
    rss.sort();
    let rss_s = if rss.is_empty() {
        "n/a".to_string()
    } else {
        format!(
            "{} / {}",
            mib(rss[rss.len() / 2]),
            mib(*rss.last().unwrap())
        )
    };
    eprintln!("RSS MiB (median / max): {rss_s}");
    eprintln!(
        "major page faults of all sidecars, convergence to the end of the steady window: {}",
        proc_stat_sum(&c, MAJFLT).saturating_sub(majflt_converged)
    );
    // Nobody has been killed yet: every `member down` so far is false.
    let logs: Vec<String> = c
        .nodes
        .iter()
        .map(|n| std::fs::read_to_string(&n.log_path).unwrap_or_default())
        .collect();
    // Per victim: how many logged it down, and when the first did.
    let mut downed: BTreeMap<&str, (usize, Option<u64>)> = BTreeMap::new();
    let mut renewals = 0;
    for line in logs.iter().flat_map(|t| t.lines()) {
        if line.contains("member down")
            && let Some(id) = logged_node_id(line)
        {
            let (by, first) = downed.entry(id).or_default();
            *by += 1;
            *first = (*first).into_iter().chain(log_time_ms(line)).min();
        }
        renewals += usize::from(line.contains(RENEWAL_LINE));
    }
    if !downed.is_empty() {
        let log_of: std::collections::HashMap<&str, &str> = c
            .nodes
            .iter()
            .zip(&logs)
            .map(|(n, text)| (n.id(), text.as_str()))
            .collect();
        let who: Vec<String> = downed
            .iter()
            .map(|(id, (by, first))| {
                let own = log_of.get(id).copied().unwrap_or_default();
                // How old the victim was at its first false down (young
                // members get a longer suspicion: mesh/machine.rs, YOUNG_FOR).
                let age = first.zip(spawn_ms(own)).map_or("?".into(), |(t, spawn)| {
                    format!("{:.1}", t.saturating_sub(spawn) as f64 / 1000.0)
                });
                format!(
                    "{id} by {by} (its stalls: {}; first down {age} s after its spawn)",
                    stall_text(stalls_ms(own))
                )
            })
            .collect();
        eprintln!(
            "before any kill: {} `member down` lines (false), {renewals} identity renewals: {}",
            downed.values().map(|(by, _)| by).sum::<usize>(),
            who.join(", ")
        );
    }
    print_stalls_by_age(&logs);
    drop(logs);

    if let Some(p) = loss {
        // ---- false downs under random loss ---------------------------------------------
        let changes = |state: &str| -> f64 {
            addrs
                .iter()
                .filter_map(|&a| {
                    fetch_metric(a, "mesh_member_state_changes_total", &[("state", state)])
                })
                .sum()
        };
        let base = (changes("down"), changes("suspect"));
        let renewals0 = log_lines(&c, RENEWAL_LINE);
        let majflt0 = proc_stat_sum(&c, MAJFLT);
        let cpu0: f64 = c.nodes.iter().filter_map(|x| cpu_secs(x.pid()?)).sum();
        let prob = format!("{p}");
        let rule = [
            "INPUT",
            "-i",
            "lo",
            "-m",
            "statistic",
            "--mode",
            "random",
            "--probability",
            &prob,
            "-j",
            "DROP",
        ];
        let mut add = vec!["-A"];
        add.extend(rule);
        iptables(&add);
        eprintln!("{p} random loss on lo for {run_secs} s");
        let end = Instant::now() + Duration::from_secs(run_secs);
        let seen_down = Mutex::new(BTreeSet::<(String, String)>::new());
        let suspect_obs = Mutex::new(0u64);
        while Instant::now() < end {
            let round = Instant::now();
            std::thread::scope(|s| {
                for chunk in addrs
                    .chunks(addrs.len().div_ceil(8))
                    .zip(ids.chunks(ids.len().div_ceil(8)))
                {
                    let (seen_down, suspect_obs) = (&seen_down, &suspect_obs);
                    s.spawn(move || {
                        for (a, observer) in chunk.0.iter().zip(chunk.1) {
                            let Some(v) = fetch_status(*a) else { continue };
                            for e in v
                                .get("nodes")
                                .and_then(Value::as_array)
                                .into_iter()
                                .flatten()
                            {
                                let id = e.get("node_id").and_then(Value::as_str).unwrap_or("?");
                                match e.get("membership_state").and_then(Value::as_str) {
                                    Some("down") => {
                                        seen_down
                                            .lock()
                                            .unwrap()
                                            .insert((observer.clone(), id.to_string()));
                                    }
                                    Some("suspect") => *suspect_obs.lock().unwrap() += 1,
                                    _ => {}
                                }
                            }
                        }
                    });
                }
            });
            if let Some(rest) = Duration::from_secs(2).checked_sub(round.elapsed()) {
                std::thread::sleep(rest);
            }
        }
        let mut del = vec!["-D"];
        del.extend(rule);
        iptables(&del);
        let false_downs = changes("down") - base.0;
        let suspicions = changes("suspect") - base.1;
        let renewals = log_lines(&c, RENEWAL_LINE) - renewals0;
        let majflt = proc_stat_sum(&c, MAJFLT) - majflt0;
        let cpu = c
            .nodes
            .iter()
            .filter_map(|x| cpu_secs(x.pid()?))
            .sum::<f64>()
            - cpu0;
        let seen = seen_down.into_inner().unwrap();
        eprintln!(
            "false down transitions: {false_downs}; suspicions (failed probes, counter): {suspicions}; identity renewals (logged): {renewals}; (observer, member) pairs seen down: {}; suspect observations (polled): {}",
            seen.len(),
            suspect_obs.into_inner().unwrap()
        );
        eprintln!(
            "during the loss: sidecar CPU {cpu:.1} s ({:.1} % of one core per node), major page faults {majflt} (all nodes)",
            100.0 * cpu / run_secs as f64 / f64::from(n)
        );
        for (o, m) in seen.iter().take(20) {
            eprintln!("  {o} saw {m} down");
        }
        println!();
        println!(
            "| N | loss | duration | converge (s) | bytes/node/s (mean / max) | RSS MiB (median / max) | false downs (counter) | pairs seen down (polled) | suspicions (counter) | identity renewals | major faults |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        println!(
            "| {n} | {:.0} % | {run_secs} s | {converge} | {bytes} | {rss_s} | {false_downs} | {} | {suspicions} | {renewals} | {majflt} |",
            p * 100.0,
            seen.len()
        );
        return;
    }

    if starve {
        let victim = usize::from(n) / 3;
        let row = starve_run(&c, &ids, &addrs, victim, run_secs, interval, timeout);
        println!();
        println!(
            "| N | start | starved node | duration | SIGSTOPs | false downs by the others (counter) | members seen down by the others (polled) | starved node seen down | starved node seen suspect (observations) | its incarnation before / after (min–max over the others) | downs counted by the starved node | alive everywhere again after the run (s) |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
        println!("| {n} | {start} | {row} |");
        return;
    }

    // ---- kill -9 ----------------------------------------------------------------------
    // One kill by default; SBMESH_BENCH_KILLS=k kills k nodes one after
    // another (each timed on its own), for a distribution.
    let kills: usize = env_or::<usize>("SBMESH_BENCH_KILLS", 1).clamp(1, usize::from(n) / 2);
    let mut killed: Vec<usize> = Vec::new();
    let mut kill_times: Vec<Option<Duration>> = Vec::new();
    let mut kill_detect = String::new();
    for k in 0..kills {
        let victim = (usize::from(n) / 2 + 2 * k) % usize::from(n);
        let victim_id = ids[victim].clone();
        let survivors: Vec<usize> = (0..addrs.len())
            .filter(|i| *i != victim && !killed.contains(i))
            .collect();
        let t0 = Instant::now();
        let killed_unix_ms = now_unix_ms();
        c.nodes[victim].kill9();
        let sub: Vec<SocketAddr> = survivors.iter().map(|&i| addrs[i]).collect();
        let sub_ids: Vec<String> = survivors.iter().map(|&i| ids[i].clone()).collect();
        let det = poll_all(&sub, t0, interval, timeout, None, |b| {
            b.state_of(&victim_id) == Some("down")
        });
        kill_detect = summarize("kill -9 detected", &det, &sub_ids, timeout);
        // The survivors' own `member down` lines, independent of polling.
        let logged: Vec<Option<u64>> = survivors
            .iter()
            .map(|&i| logged_down_ms(&c.nodes[i].log_path, &victim_id))
            .collect();
        if logged.iter().all(Option::is_some) {
            let last = logged.iter().flatten().max().copied().unwrap_or(0);
            eprintln!(
                "kill -9 from the survivors' logs (each logged `member down` for it): {:.2} s",
                last.saturating_sub(killed_unix_ms) as f64 / 1000.0
            );
        }
        let all = det.seen.iter().all(Option::is_some);
        kill_times.push(
            all.then(|| det.seen.iter().flatten().max().copied())
                .flatten(),
        );
        killed.push(victim);
        if k + 1 < kills {
            std::thread::sleep(Duration::from_secs(3));
        }
    }
    if kills > 1 {
        let mut done: Vec<Duration> = kill_times.iter().flatten().copied().collect();
        done.sort();
        let missed = kills - done.len();
        kill_detect = match (done.first(), done.last()) {
            (Some(_), Some(max)) => format!(
                "median {} / max {} of {kills} kills{}",
                secs(done[done.len() / 2]),
                secs(*max),
                if missed > 0 {
                    format!(", {missed} timed out")
                } else {
                    String::new()
                }
            ),
            _ => format!("all {kills} kills timed out"),
        };
        eprintln!("kill -9, every survivor sees down: {kill_detect}");
    }
    let survivors: Vec<usize> = (0..addrs.len()).filter(|i| !killed.contains(i)).collect();
    let victim = killed[0];

    // ---- SIGTERM ------------------------------------------------------------------------
    let leaver = (victim + 1) % usize::from(n);
    let leaver_id = ids[leaver].clone();
    let rest: Vec<usize> = survivors.iter().copied().filter(|&i| i != leaver).collect();
    let sub: Vec<SocketAddr> = rest.iter().map(|&i| addrs[i]).collect();
    let sub_ids: Vec<String> = rest.iter().map(|&i| ids[i].clone()).collect();
    let t0 = Instant::now();
    c.nodes[leaver].sigterm();
    let det = poll_all(&sub, t0, interval, timeout, None, |b| {
        b.state_of(&leaver_id) == Some("down")
    });
    let term_detect = summarize("SIGTERM seen", &det, &sub_ids, timeout);
    let exit = match c.nodes[leaver].wait_exit(Duration::from_secs(40)) {
        Some(st) => describe_exit(st),
        None if poll_until(Duration::from_secs(40), || !c.nodes[leaver].is_running()) => {
            "exited (its status is the spawner's)".to_string()
        }
        None => "still running after 40 s".to_string(),
    };
    eprintln!("SIGTERM'd node: {exit}");

    println!();
    println!(
        "| N | start (first to last) | converge after last start (s), polled / from logs | kill -9: all survivors see down (s) | SIGTERM: all see down (s) | bytes/node/s (mean / max) | RSS MiB (median / max) | config | UDP rcvbuf errors at start |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {n} | {start} ({} s) | {converge} / {log_conv} | {kill_detect} | {term_detect} | {bytes} | {rss_s} | {} | {rcvbuf} |",
        secs(start_span),
        if full { "full" } else { "default" }
    );
    drop(c); // kills every process by PID
}

/// The counter of `state` transitions on every node (`None` where
/// `/metrics` did not answer).
fn state_changes(addrs: &[SocketAddr], state: &str) -> Vec<Option<f64>> {
    addrs
        .iter()
        .map(|&a| fetch_metric(a, "mesh_member_state_changes_total", &[("state", state)]))
        .collect()
}

/// `min–max` of what `nodes` show as `victim`'s incarnation.
fn incarnations(addrs: &[SocketAddr], nodes: &[usize], victim: &str) -> String {
    let seen: Vec<u64> = nodes
        .iter()
        .filter_map(|&i| incarnation_of(&fetch_status(addrs[i])?, victim))
        .collect();
    match (seen.iter().min(), seen.iter().max()) {
        (Some(a), Some(b)) => format!("{a}–{b} ({} nodes)", seen.len()),
        _ => "n/a".to_string(),
    }
}

/// Sends SIGCONT to the starved node however the run ends.
struct Resume(u32);

impl Drop for Resume {
    fn drop(&mut self) {
        // SAFETY: kill(2) by the PID of a node of ours, which is not reaped.
        unsafe {
            libc::kill(self.0 as libc::pid_t, libc::SIGCONT);
        }
    }
}

/// The CPU-starvation run: `victim` is stopped 1.5 s of every 10 s for
/// `secs_total`, the others are polled every second. Returns the table
/// cells after N and start.
fn starve_run(
    c: &Cluster,
    ids: &[String],
    addrs: &[SocketAddr],
    victim: usize,
    secs_total: u64,
    interval: Duration,
    timeout: Duration,
) -> String {
    const EVERY: Duration = Duration::from_secs(10);
    const STOPPED: Duration = Duration::from_millis(1500);
    let victim_id = ids[victim].clone();
    let others: Vec<usize> = (0..addrs.len()).filter(|&i| i != victim).collect();
    let pid = c.nodes[victim].pid().expect("the starved node runs");
    let downs0 = state_changes(addrs, "down");
    let inc0 = incarnations(addrs, &others, &victim_id);
    eprintln!(
        "starving {victim_id} (pid {pid}) {} s of every {} s for {secs_total} s; its incarnation: {inc0}",
        STOPPED.as_secs_f64(),
        EVERY.as_secs()
    );
    let seen_down = Mutex::new(BTreeSet::<(String, String)>::new());
    let victim_suspect = Mutex::new(0u64);
    let done = AtomicBool::new(false);
    let mut stops = 0;
    std::thread::scope(|s| {
        for t in 0..8 {
            let (seen_down, victim_suspect, done, others, victim_id) =
                (&seen_down, &victim_suspect, &done, &others, &victim_id);
            s.spawn(move || {
                let mine: Vec<usize> = others.iter().copied().skip(t).step_by(8).collect();
                while !done.load(Ordering::Relaxed) {
                    let round = Instant::now();
                    for &i in &mine {
                        let Some(b) = fetch_brief(addrs[i]) else {
                            continue;
                        };
                        for m in &b.nodes {
                            match m.membership_state.as_str() {
                                "down" => {
                                    seen_down
                                        .lock()
                                        .unwrap()
                                        .insert((ids[i].clone(), m.node_id.clone()));
                                }
                                "suspect" if &m.node_id == victim_id => {
                                    *victim_suspect.lock().unwrap() += 1
                                }
                                _ => {}
                            }
                        }
                    }
                    if let Some(rest) = Duration::from_secs(1).checked_sub(round.elapsed()) {
                        std::thread::sleep(rest);
                    }
                }
            });
        }
        let end = Instant::now() + Duration::from_secs(secs_total);
        while Instant::now() < end {
            let cycle = Instant::now();
            let resume = Resume(pid);
            c.nodes[victim].signal(libc::SIGSTOP);
            stops += 1;
            std::thread::sleep(STOPPED);
            drop(resume);
            if let Some(rest) = EVERY.checked_sub(cycle.elapsed()) {
                std::thread::sleep(rest);
            }
        }
        done.store(true, Ordering::Relaxed);
    });
    let sub: Vec<SocketAddr> = others.iter().map(|&i| addrs[i]).collect();
    let sub_ids: Vec<String> = others.iter().map(|&i| ids[i].clone()).collect();
    let back = poll_all(&sub, Instant::now(), interval, timeout, None, |b| {
        b.state_of(&victim_id) == Some("alive")
    });
    let back = summarize("starved node alive everywhere", &back, &sub_ids, timeout);
    let downs1 = state_changes(addrs, "down");
    let delta = |i: usize| match (downs0[i], downs1[i]) {
        (Some(a), Some(b)) => b - a,
        _ => 0.0,
    };
    let false_downs: f64 = others.iter().map(|&i| delta(i)).sum();
    for &i in &others {
        if delta(i) > 0.0 {
            eprintln!("  {} counted {} down transitions", ids[i], delta(i));
        }
    }
    let inc1 = incarnations(addrs, &others, &victim_id);
    let seen = seen_down.into_inner().unwrap();
    for (o, m) in seen.iter().take(20) {
        eprintln!("  {o} saw {m} down");
    }
    let members: BTreeSet<&String> = seen.iter().map(|(_, m)| m).collect();
    let members_s = if members.is_empty() {
        "none".to_string()
    } else {
        let names: Vec<&str> = members.iter().map(|m| m.as_str()).collect();
        format!("{} ({} pairs)", names.join(", "), seen.len())
    };
    let victim_seen_down = seen.iter().filter(|(_, m)| *m == victim_id).count();
    eprintln!(
        "false downs by the others: {false_downs}; starved node seen down by {victim_seen_down} observers; incarnation {inc0} -> {inc1}"
    );
    let seen_down_s = if victim_seen_down > 0 {
        format!("yes, by {victim_seen_down}")
    } else {
        "no".to_string()
    };
    format!(
        "{victim_id} | {secs_total} s | {stops} | {false_downs} | {members_s} | {seen_down_s} | {} | {inc0} / {inc1} | {} | {back}",
        victim_suspect.into_inner().unwrap(),
        delta(victim),
    )
}

/// Unix ms of a log line's RFC 3339 UTC timestamp (`2026-12-01T15:17:49.398280Z`).
fn log_time_ms(line: &str) -> Option<u64> {
    let ts = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = ts.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|x| x.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.splitn(3, ':');
    let (h, min) = (
        t.next()?.parse::<u64>().ok()?,
        t.next()?.parse::<u64>().ok()?,
    );
    let sec: f64 = t.next()?.parse().ok()?;
    // Days from 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    Some((days * 86_400 + h * 3600 + min * 60) * 1000 + (sec * 1000.0) as u64)
}

/// From the nodes' own logs, independent of polling: per node, the unix ms
/// at which it had logged `member up` for `n - 1` distinct others.
fn full_view_from_logs(logs: &[String], n: usize) -> Vec<Option<u64>> {
    logs.iter()
        .map(|text| {
            let mut seen = BTreeSet::new();
            for line in text.lines().filter(|l| l.contains("member up")) {
                let id = logged_node_id(line)?;
                if seen.insert(id.to_string()) && seen.len() + 1 == n {
                    return log_time_ms(line);
                }
            }
            None
        })
        .collect()
}

/// For every pair of a node and a member spawned at least a second after
/// it: seconds from the member's spawn to the node's first `member up` for
/// it (how long a newcomer goes unknown to a node already up), with the
/// node and the member, sorted by the delay.
fn newcomer_delays_from_logs<'a>(
    c: &'a Cluster,
    logs: &'a [String],
) -> Vec<(f64, &'a str, &'a str)> {
    let spawn: std::collections::HashMap<&str, u64> = c
        .nodes
        .iter()
        .zip(logs)
        .filter_map(|(n, text)| Some((n.id(), spawn_ms(text)?)))
        .collect();
    let mut delays = Vec::new();
    for (node, text) in c.nodes.iter().zip(logs) {
        let Some(&mine) = spawn.get(node.id()) else {
            continue;
        };
        let mut seen = BTreeSet::new();
        for line in text.lines().filter(|l| l.contains("member up")) {
            let Some(id) = logged_node_id(line) else {
                continue;
            };
            if !seen.insert(id) {
                continue;
            }
            if let (Some(&theirs), Some(at)) = (spawn.get(id), log_time_ms(line))
                && theirs >= mine + 1000
            {
                delays.push((at.saturating_sub(theirs) as f64 / 1000.0, node.id(), id));
            }
        }
    }
    delays.sort_by(|a, b| a.0.total_cmp(&b.0));
    delays
}

/// Unix ms of a node's first spawn, from the line the harness writes to its
/// log.
fn spawn_ms(log: &str) -> Option<u64> {
    log.split("=== spawn #1 at ")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The stalls a sidecar logged (its timers ran that late: the process was
/// not running), as Unix ms spans sorted by start (a stall logged at `t`
/// with `late_ms` covers the `late_ms` before `t`: the sidecar logs a stall
/// before anything else it does after it).
fn stall_spans(log: &str) -> Vec<(u64, u64)> {
    let mut spans: Vec<(u64, u64)> = log
        .lines()
        .filter(|l| l.contains("this process was not running"))
        .filter_map(|l| {
            let late: u64 = l
                .split("late_ms=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            let at = log_time_ms(l)?;
            Some((at.saturating_sub(late), at))
        })
        .collect();
    spans.sort();
    spans
}

/// When in their lives the sidecars stalled: the time stalled and the
/// processes that stalled (a stall of 1 s or more), by the process's age
/// at the stall's end in 5 s steps. A sidecar hands back its start-up pages
/// at `memory::STARTUP_SETTLE` (10 s); young members get a longer
/// suspicion (`YOUNG_FOR`, 10 s).
fn print_stalls_by_age(logs: &[String]) {
    const STEP_MS: u64 = 5_000;
    const STEPS: usize = 7;
    let mut ms = [0u64; STEPS];
    let mut procs = [0usize; STEPS];
    for text in logs {
        let Some(spawn) = spawn_ms(text) else {
            continue;
        };
        let mut hit = [false; STEPS];
        for (from, to) in stall_spans(text) {
            let step = ((to.saturating_sub(spawn) / STEP_MS) as usize).min(STEPS - 1);
            ms[step] += to - from;
            hit[step] = true;
        }
        for (p, h) in procs.iter_mut().zip(hit) {
            *p += usize::from(h);
        }
    }
    if ms.iter().all(|&m| m == 0) {
        return;
    }
    let steps: Vec<String> = (0..STEPS)
        .map(|k| {
            let from = k as u64 * STEP_MS / 1000;
            let label = if k + 1 == STEPS {
                format!("{from}+ s")
            } else {
                format!("{from}-{} s", from + STEP_MS / 1000)
            };
            format!("{label}: {:.1} s in {}", ms[k] as f64 / 1000.0, procs[k])
        })
        .collect();
    eprintln!(
        "stalls by the process's age at their end (time stalled in processes): {}",
        steps.join(", ")
    );
}

/// The longest stall a sidecar logged and the time its stalls covered
/// together, in ms.
fn stalls_ms(log: &str) -> (u64, u64) {
    let spans = stall_spans(log);
    let longest = spans.iter().map(|(a, b)| b - a).max().unwrap_or(0);
    let (mut covered, mut reach) = (0, 0);
    for (from, to) in spans {
        let from = from.max(reach);
        if to > from {
            covered += to - from;
            reach = to;
        }
    }
    (longest, covered)
}

/// `stalls_ms`'s figures as printed: longest / all together.
fn stall_text((longest, all): (u64, u64)) -> String {
    format!(
        "longest {:.2} s, all {:.2} s",
        longest as f64 / 1000.0,
        all as f64 / 1000.0
    )
}

/// The `node_id=` field of a sidecar log line.
fn logged_node_id(line: &str) -> Option<&str> {
    line.split("node_id=").nth(1)?.split_whitespace().next()
}

/// Unix ms of the first `member down` line for `victim` in a node's log.
fn logged_down_ms(log: &std::path::Path, victim: &str) -> Option<u64> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .filter(|l| l.contains("member down"))
        .find(|l| logged_node_id(l) == Some(victim))
        .and_then(log_time_ms)
}

/// The line a node logs when it renews its identity after being declared
/// down (`Event::Rejoined` in the mesh shell).
const RENEWAL_LINE: &str = "rejoined the mesh under a renewed identity";

/// `majflt` of stat(5) (field 12).
const MAJFLT: usize = 12;

/// Lines containing `needle` in every node's log.
fn log_lines(c: &Cluster, needle: &str) -> u64 {
    c.nodes
        .iter()
        .filter_map(|node| std::fs::read_to_string(&node.log_path).ok())
        .map(|text| text.lines().filter(|l| l.contains(needle)).count() as u64)
        .sum()
}

/// Field `field` (numbered as in stat(5)) of `/proc/<pid>/stat`.
fn proc_stat(pid: u32, field: usize) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the comm start at 3 (state).
    s.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(field.checked_sub(3)?)?
        .parse()
        .ok()
}

/// [`proc_stat`] summed over every running node.
fn proc_stat_sum(c: &Cluster, field: usize) -> u64 {
    c.nodes
        .iter()
        .filter_map(|x| proc_stat(x.pid()?, field))
        .sum()
}

/// CPU seconds (user + system) a process used so far.
fn cpu_secs(pid: u32) -> Option<f64> {
    // utime and stime are fields 14 and 15 of stat(5).
    let ticks = proc_stat(pid, 14)? + proc_stat(pid, 15)?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    Some(ticks as f64 / hz as f64)
}
