//! The chaos soak (issue 11): five pods (sidecar + stand-in sbproxy, one
//! PID namespace each), a Redis and a Pebble of its own, 20 origins, and for
//! a fixed time one fault after another from a seeded schedule: kill -9 of
//! a sidecar, a 2/3 partition, a Redis crash, SIGSTOP for 2 s, a config
//! swap, a key rotation one pod at a time, a +60 s clock skew. Then
//! everything heals and the invariants are checked from the outside: what
//! the CA issued, the files on disk, the processes, the proxies' reload
//! logs, the store operation rates scraped from `/metrics`, and the logs.
//!
//! Everything runs inside one private network namespace (the caller
//! re-executes itself under `unshare -rn`), so iptables rules on `lo` cut
//! pairs of pods and vanish with the namespace; Redis, Pebble and
//! pebble-challtestsrv are started here, inside it, on fixed ports.
//!
//! The schedule is a pure function of (seed, duration, pods): the seed is
//! printed, and `SBMESH_CHAOS_SEED` replays it. Faults run one after
//! another, so each has a clear window that the invariants can excuse.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::acme::Pebble;
use crate::common::acme::pebble_server::{PebbleServer, Ports};
use crate::common::pods::{HTTP_PORT, PROXY_ADMIN_PORT, SIDECAR_ADMIN_PORT, http_get, standin_bin};
use crate::common::{
    iptables, metric_sum, now_unix_ms, poll_until, sidecar_bin, tool, write_atomic,
};

pub const PODS: usize = 5;
pub const BASE_HOSTS: usize = 20;
/// Origins a config swap may add beyond the first 20.
pub const EXTRA_HOSTS: usize = 4;
/// The per-replica store rate allowed outside issuance bursts.
pub const MAX_STORE_OPS_PER_SEC: f64 = 20.0;
/// How long after a fault's end its effects (error lines) are excused.
const GRACE: Duration = Duration::from_secs(15);
/// An issuance burst (an order counter moving) excuses the store traffic
/// of the 5 s windows that overlap this long either side of it: an order
/// against Pebble takes about a second, so a replica that spins for longer
/// (waiting on a lock, failing to open a record) is still seen.
const BURST_MARGIN_MS: u64 = 3_000;

// Fixed ports: the namespace is ours alone.
const REDIS_PORT: u16 = 6379;
const PEBBLE_PORT: u16 = 14000;
const PEBBLE_MGMT_PORT: u16 = 15000;
const PEBBLE_HTTP_PORT: u16 = 5002;
const PEBBLE_TLS_PORT: u16 = 5001;
const CHALL_DNS_PORT: u16 = 8053;
const CHALL_MGMT_PORT: u16 = 8055;

const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
pub const SKEW: &str = "+60s";

/// The seed: `SBMESH_CHAOS_SEED`, else from the clock; printed either way.
pub fn seed_from_env() -> u64 {
    let seed = match std::env::var("SBMESH_CHAOS_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("SBMESH_CHAOS_SEED={s:?} is not an unsigned integer")),
        Err(_) => now_unix_ms() ^ (u64::from(std::process::id()) << 40),
    };
    eprintln!("chaos seed {seed} (SBMESH_CHAOS_SEED={seed} replays this schedule)");
    seed
}

/// `SBMESH_CHAOS_SECS`, else `default`.
pub fn secs_from_env(default: u64) -> u64 {
    match std::env::var("SBMESH_CHAOS_SECS") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("SBMESH_CHAOS_SECS={s:?} is not a number of seconds")),
        Err(_) => default,
    }
}

// ---------------------------------------------------------------------------
// The schedule: a pure function of (seed, duration, pods)
// ---------------------------------------------------------------------------

/// splitmix64: small, seedable, good enough for a schedule.
#[derive(Clone, Debug)]
pub struct SeededRng(u64);

impl SeededRng {
    pub fn new(seed: u64) -> Self {
        SeededRng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// kill -9 the pod's sidecar; the pod's loop (the kubelet) restarts it.
    Kill { pod: usize },
    /// Cut `pair` from the other three for `secs`; halfway through,
    /// toggle origin `swap` (a config change meeting a split mesh).
    Partition {
        pair: [usize; 2],
        secs: u64,
        swap: Option<usize>,
    },
    /// kill -9 Redis, start it again (same data, AOF) after `down_secs`.
    RedisRestart { down_secs: u64 },
    /// SIGSTOP the pod's sidecar for 2 s.
    Stop { pod: usize },
    /// Toggle origin `host` of the pool (add it, or remove it); with
    /// `kill_owner`, kill -9 the new host's owner 300 ms after adding it
    /// (its order in flight, its lock held).
    ConfigSwap { host: usize, kill_owner: bool },
    /// Write the next key ring to each pod's key file, one pod every 2 s.
    RotateKey,
    /// Skew the pod's wall clock by +60 s for `secs`; halfway through,
    /// toggle origin `swap` (an order while one node's clock is off).
    Skew {
        pod: usize,
        secs: u64,
        swap: Option<usize>,
    },
}

impl FaultKind {
    pub fn label(&self) -> String {
        match self {
            FaultKind::Kill { pod } => format!("kill -9 pod-{pod}"),
            FaultKind::Partition { pair, secs, swap } => format!(
                "partition pod-{} pod-{} for {secs}s{}",
                pair[0],
                pair[1],
                midway(swap)
            ),
            FaultKind::RedisRestart { down_secs } => format!("redis down {down_secs}s"),
            FaultKind::Stop { pod } => format!("SIGSTOP pod-{pod} 2s"),
            FaultKind::ConfigSwap { host, kill_owner } => format!(
                "config swap origin #{host}{}",
                if *kill_owner {
                    ", then kill -9 its owner"
                } else {
                    ""
                }
            ),
            FaultKind::RotateKey => "key rotation".to_owned(),
            FaultKind::Skew { pod, secs, swap } => {
                format!("clock skew {SKEW} pod-{pod} for {secs}s{}", midway(swap))
            }
        }
    }

    /// The pods whose logs may show errors because of this fault.
    pub fn affects(&self, pods: usize) -> Vec<usize> {
        match self {
            FaultKind::Kill { pod } | FaultKind::Stop { pod } | FaultKind::Skew { pod, .. } => {
                vec![*pod]
            }
            // Killing a new host's owner mid-order may fail its order anywhere.
            FaultKind::ConfigSwap { kill_owner, .. } => {
                if *kill_owner {
                    (0..pods).collect()
                } else {
                    Vec::new()
                }
            }
            FaultKind::Partition { .. } | FaultKind::RedisRestart { .. } | FaultKind::RotateKey => {
                (0..pods).collect()
            }
        }
    }
}

fn midway(swap: &Option<usize>) -> String {
    swap.map(|h| format!(", config swap origin #{h} halfway"))
        .unwrap_or_default()
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// From the start of the chaos phase.
    pub at: Duration,
    pub kind: FaultKind,
}

/// How long a fault's injector runs (faults never overlap).
fn fault_len(kind: &FaultKind, pods: usize) -> Duration {
    Duration::from_secs(match kind {
        FaultKind::Kill { .. } => 3,
        FaultKind::Partition { secs, .. } => *secs,
        FaultKind::RedisRestart { down_secs } => *down_secs,
        FaultKind::Stop { .. } => 2,
        FaultKind::ConfigSwap { .. } => 3,
        FaultKind::RotateKey => 2 * pods as u64,
        FaultKind::Skew { secs, .. } => *secs,
    })
}

/// The faults of a run: one after another with 2-8 s between them, until
/// `secs` have passed, drawn from a shuffled bag (two kills, a partition,
/// a Redis restart, a SIGSTOP, two config swaps, a key rotation, a skew)
/// so that every kind comes up in each round of about two minutes. Same
/// arguments, same schedule.
pub fn schedule(seed: u64, secs: u64, pods: usize) -> Vec<Fault> {
    const BAG: [u8; 9] = [0, 0, 1, 2, 3, 4, 4, 5, 6];
    let mut rng = SeededRng::new(seed);
    let end = Duration::from_secs(secs);
    let mut t = Duration::ZERO;
    let mut out = Vec::new();
    let pod = |rng: &mut SeededRng| rng.range(0, pods as u64 - 1) as usize;
    loop {
        let mut bag = BAG;
        for i in (1..bag.len()).rev() {
            bag.swap(i, rng.range(0, i as u64) as usize);
        }
        for draw in bag {
            t += Duration::from_secs(rng.range(2, 8));
            let kind = match draw {
                0 => FaultKind::Kill { pod: pod(&mut rng) },
                1 => {
                    let a = pod(&mut rng);
                    let b = (a + 1 + rng.range(0, pods as u64 - 2) as usize) % pods;
                    FaultKind::Partition {
                        pair: [a.min(b), a.max(b)],
                        secs: rng.range(10, 25),
                        swap: maybe_swap(&mut rng),
                    }
                }
                2 => FaultKind::RedisRestart {
                    down_secs: rng.range(2, 6),
                },
                3 => FaultKind::Stop { pod: pod(&mut rng) },
                4 => FaultKind::ConfigSwap {
                    host: pick_host(&mut rng),
                    kill_owner: rng.range(0, 2) == 0,
                },
                5 => FaultKind::RotateKey,
                _ => FaultKind::Skew {
                    pod: pod(&mut rng),
                    secs: rng.range(15, 30),
                    swap: maybe_swap(&mut rng),
                },
            };
            let len = fault_len(&kind, pods);
            if t + len > end {
                return out;
            }
            out.push(Fault { at: t, kind });
            t += len;
        }
    }
}

/// An origin of the pool; half the time one of the extras, so that swaps
/// add origins (and orders happen) as often as they remove them.
fn pick_host(rng: &mut SeededRng) -> usize {
    if rng.range(0, 1) == 0 {
        BASE_HOSTS + rng.range(0, EXTRA_HOSTS as u64 - 1) as usize
    } else {
        rng.range(0, BASE_HOSTS as u64 - 1) as usize
    }
}

fn maybe_swap(rng: &mut SeededRng) -> Option<usize> {
    (rng.range(0, 1) == 0).then(|| pick_host(rng))
}

/// Key `generation` of a run: 64 hex chars derived from the seed.
pub fn key_hex(seed: u64, generation: u64) -> String {
    let mut rng = SeededRng::new(seed ^ generation.wrapping_mul(0xA076_1D64_78BD_642F) ^ 0x5eed);
    (0..4).fold(String::new(), |mut s, _| {
        let _ = write!(s, "{:016x}", rng.next_u64());
        s
    })
}

// ---------------------------------------------------------------------------
// Processes the harness starts (all killed by PID on drop)
// ---------------------------------------------------------------------------

/// A child that dies with the harness: SIGKILLed by PID on drop, and by
/// the kernel (`PR_SET_PDEATHSIG`) if the harness dies first.
pub struct Proc {
    pub name: String,
    child: Child,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command) -> Proc {
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Proc {
            name: name.to_owned(),
            child,
        }
    }
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn log_file(path: &Path) -> Stdio {
    Stdio::from(
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display())),
    )
}

fn wait_port(addr: SocketAddr, what: &str, proc_: &mut Proc, log: &Path) {
    let ok = poll_until(Duration::from_secs(30), || {
        TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() || !proc_.running()
    });
    if !ok || !proc_.running() {
        panic!(
            "{what} did not listen on {addr}; its log {}:\n{}",
            log.display(),
            fs::read_to_string(log).unwrap_or_default()
        );
    }
}

/// Redis with an append-only file fsynced on every write, so a kill -9
/// and restart loses nothing acknowledged (as a persistent Redis would).
pub struct Redis {
    dir: PathBuf,
    proc_: Option<Proc>,
}

impl Redis {
    pub fn start(base: &Path) -> Redis {
        let dir = base.join("redis");
        fs::create_dir_all(&dir).expect("redis dir");
        let mut r = Redis { dir, proc_: None };
        r.spawn();
        r
    }
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{REDIS_PORT}/0")
    }
    fn spawn(&mut self) {
        let log = self.dir.join("redis.log");
        let mut cmd = Command::new(tool("redis-server"));
        cmd.args(["--bind", "127.0.0.1", "--port", &REDIS_PORT.to_string()])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .args(["--daemonize", "no", "--loglevel", "warning"])
            .stdout(log_file(&log))
            .stderr(log_file(&log));
        let mut p = Proc::spawn("redis-server", &mut cmd);
        wait_port(
            SocketAddr::from(([127, 0, 0, 1], REDIS_PORT)),
            "redis-server",
            &mut p,
            &log,
        );
        self.proc_ = Some(p);
    }
    pub fn kill9(&mut self) {
        if let Some(mut p) = self.proc_.take() {
            p.kill();
        }
    }
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }
    pub fn running(&mut self) -> bool {
        self.proc_.as_mut().is_some_and(Proc::running)
    }
}

/// Pebble and pebble-challtestsrv inside the namespace, on its fixed
/// ports, their logs in `<base>/pebble` with the rest of the run's.
pub struct Ca {
    pub pebble: Pebble,
}

impl Ca {
    pub fn start(base: &Path) -> Ca {
        let ports = Ports {
            acme: PEBBLE_PORT,
            mgmt: PEBBLE_MGMT_PORT,
            http: PEBBLE_HTTP_PORT,
            tls: PEBBLE_TLS_PORT,
            dns: CHALL_DNS_PORT,
            chall: CHALL_MGMT_PORT,
        };
        let server = PebbleServer::start_in("chaos", &base.join("pebble"), ports)
            .unwrap_or_else(|e| panic!("the chaos soak's CA did not start: {e}"));
        Ca {
            pebble: Pebble::from(server),
        }
    }
}

/// Why Pebble's log says it stopped serving: its request handlers wedged
/// (seen twice in CI: new orders and new accounts logged as "calling
/// handler()" and never answered, while `GET /dir` still was), a deadlock
/// inside Pebble 2.4 (the lock cycle `tests/pebble_server` describes) and
/// not something a sidecar can cause or recover from.
/// The signature: at least 5 POSTs that create something (`/order-plz`,
/// `/sign-me-up`) logged after the last object Pebble added ("There are now
/// …"), over at least 60 s.
pub fn pebble_wedged(log: &str) -> Option<String> {
    let lines: Vec<&str> = log.lines().collect();
    let last_added = lines.iter().rposition(|l| l.contains("There are now "))?;
    let stalled: Vec<&&str> = lines[last_added + 1..]
        .iter()
        .filter(|l| l.contains("POST /order-plz ") || l.contains("POST /sign-me-up "))
        .collect();
    // "Pebble 2026/12/02 06:48:07 ...": the clock as seconds of the day.
    let secs = |line: &str| -> Option<u32> {
        let hms = line.split_whitespace().nth(2)?;
        let mut parts = hms.split(':').map(|p| p.parse::<u32>().ok());
        Some(parts.next()?? * 3600 + parts.next()?? * 60 + parts.next()??)
    };
    let since = secs(lines[last_added])?;
    let until = stalled.last().and_then(|l| secs(l))?;
    let span = until.checked_sub(since)?;
    (stalled.len() >= 5 && span >= 60).then(|| {
        format!(
            "Pebble stopped answering: {} new-order/new-account requests logged over {span} s \
             after the last object it added, none answered ({})",
            stalled.len(),
            lines[last_added]
        )
    })
}

/// Every certificate Pebble says it issued: serial (as `parse_chain`
/// writes it) -> names. Pebble's log lists the serials; its management
/// API gives each certificate.
pub fn issued_by_ca(pebble: &Pebble, known: &mut BTreeMap<String, (String, BTreeSet<String>)>) {
    let log = fs::read_to_string(&pebble.log).unwrap_or_default();
    for line in log.lines() {
        let Some(rest) = line.split("Issued certificate serial ").nth(1) else {
            continue;
        };
        let raw = rest.split_whitespace().next().unwrap_or("").to_owned();
        if raw.is_empty() || known.contains_key(&raw) {
            continue;
        }
        let Ok((200, body)) = pebble.management_get(&format!("/cert-status-by-serial/{raw}"))
        else {
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let Ok(facts) =
            sbmesh::internal::certs::parse_chain(v["Certificate"].as_str().unwrap_or(""))
        else {
            continue;
        };
        known.insert(raw, (facts.serial, facts.dns_names.into_iter().collect()));
    }
}

// ---------------------------------------------------------------------------
// Pods
// ---------------------------------------------------------------------------

/// One pod: `unshare --pid --fork --kill-child --mount-proc bash pod.sh`,
/// where pod.sh runs the sidecar in a restart loop (the kubelet) under
/// libfaketime (offset read from a file, so a skew needs no restart) and
/// the stand-in proxy in another loop. Each loop appends its starts and
/// exits to a file, so the harness can tell injected kills from crashes.
///
/// The stand-in, not the real sbproxy, because the soak's reload invariant
/// needs what the real proxy does not tell: which config content each
/// reload POST applied. The stand-in logs every POST with the sha256 of
/// the file it loaded; sbproxy 1.13 answers and logs a `config_revision`
/// that stays the same across different files, and its own file watcher
/// reloads the same edits. (The real proxy's hot reload is checked in
/// `reload_processes` and on the cluster.)
pub struct ChaosPod {
    pub index: usize,
    pub name: String,
    pub ip: Ipv4Addr,
    pub dir: PathBuf,
    pub key_file: PathBuf,
    pub skew_file: PathBuf,
    child: Child,
}

impl ChaosPod {
    fn spawn(index: usize, ip: Ipv4Addr, base: &Path, config: &Path, args: &[String]) -> ChaosPod {
        let name = format!("pod-{index}");
        let dir = base.join(&name);
        fs::create_dir_all(dir.join("certs")).expect("pod dir");
        let skew_file = dir.join("faketime");
        fs::write(&skew_file, "+0s\n").expect("faketime file");
        let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
        let script = format!(
            "#!/bin/bash\n\
             export POD_IP={ip} CERT_DIR='{certs}' SBPROXY_STANDIN_BIND={ip} SBPROXY_SHUTDOWN_GRACE_MS=2000\n\
             (\n\
               while true; do\n\
                 echo \"start $(date +%s%3N)\" >> '{dir}/sidecar.runs'\n\
                 env LD_PRELOAD='{faketime}' FAKETIME_TIMESTAMP_FILE='{skew}' FAKETIME_CACHE_DURATION=1 \
                   FAKETIME_DONT_FAKE_MONOTONIC=1 '{sidecar}' run --config '{config}' {args} >> '{dir}/sidecar.log' 2>&1\n\
                 echo \"exit $? $(date +%s%3N)\" >> '{dir}/sidecar.runs'\n\
                 sleep 1\n\
               done\n\
             ) &\n\
             while true; do\n\
               '{proxy}' -f '{config}' >> '{dir}/proxy.log' 2>&1\n\
               echo \"proxy exited: $?\" >> '{dir}/proxy.log'\n\
               sleep 0.2\n\
             done\n",
            certs = dir.join("certs").display(),
            sidecar = sidecar_bin().display(),
            proxy = standin_bin().display(),
            config = config.display(),
            args = quoted.join(" "),
            dir = dir.display(),
            faketime = FAKETIME_LIB,
            skew = skew_file.display(),
        );
        let script_path = dir.join("pod.sh");
        fs::write(&script_path, script).expect("pod.sh");
        let mut cmd = Command::new(tool("unshare"));
        cmd.args(["--pid", "--fork", "--kill-child", "--mount-proc", "bash"])
            .arg(&script_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("unshare runs (needs root)");
        ChaosPod {
            index,
            key_file: dir.join("cluster.key"),
            name,
            ip,
            dir,
            skew_file,
            child,
        }
    }

    /// The sidecar's PID as seen from here: the `sbmesh-sidecar`
    /// descendant of this pod's `unshare`.
    pub fn sidecar_pid(&self) -> Option<u32> {
        descendants(self.child.id())
            .into_iter()
            .find(|(_, comm)| comm == "sbmesh-sidecar")
            .map(|(pid, _)| pid)
    }

    pub fn proxy_pid(&self) -> Option<u32> {
        descendants(self.child.id())
            .into_iter()
            .find(|(_, comm)| comm == "sbproxy")
            .map(|(pid, _)| pid)
    }

    fn signal_sidecar(&self, sig: libc::c_int) -> Option<u32> {
        let pid = self.sidecar_pid()?;
        // SAFETY: kill(2) by PID on a process of our own pod.
        unsafe { libc::kill(pid as libc::pid_t, sig) };
        Some(pid)
    }

    pub fn metrics(&self) -> Option<String> {
        let (st, body) = http_get(
            SocketAddr::from((self.ip, SIDECAR_ADMIN_PORT)),
            "/metrics",
            None,
        )?;
        (st == 200).then_some(body)
    }

    pub fn status(&self) -> Option<serde_json::Value> {
        let (st, body) = http_get(
            SocketAddr::from((self.ip, SIDECAR_ADMIN_PORT)),
            "/admin/cluster/status",
            Some("YWRtaW46Y2hhbmdlbWU="), // admin:changeme, the proxy's defaults
        )?;
        (st == 200).then(|| serde_json::from_str(&body).ok())?
    }

    /// host -> serial of every certificate file under this pod's cert dir.
    pub fn serials_on_disk(&self) -> BTreeMap<String, String> {
        ChaosPod::serials_in(&self.dir)
    }

    pub fn read(&self, file: &str) -> String {
        fs::read(self.dir.join(file))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }
}

impl Drop for ChaosPod {
    fn drop(&mut self) {
        // --kill-child: the whole PID namespace goes with it. A stopped
        // sidecar dies of SIGKILL as well.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `(pid, comm)` of every descendant of `root`, from /proc.
fn descendants(root: u32) -> Vec<(u32, String)> {
    let mut procs = Vec::new();
    if let Ok(entries) = fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // "pid (comm) state ppid ...": comm may hold spaces, so split at ')'.
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            let comm = stat[open + 1..close].to_owned();
            let mut rest = stat[close + 1..].split_whitespace();
            let state = rest.next().unwrap_or("");
            let ppid: u32 = rest.next().and_then(|p| p.parse().ok()).unwrap_or(0);
            if state != "Z" {
                procs.push((pid, ppid, comm));
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (pid, ppid, comm) in &procs {
            if *ppid == p {
                out.push((*pid, comm.clone()));
                frontier.push(*pid);
            }
        }
    }
    out
}

fn pod_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 70, i as u8 + 1)
}

/// The sb.yml of the fleet: per-host certificates, applied by reload.
pub fn chaos_config(pebble: &Pebble, redis: &str, hosts: &[String]) -> String {
    let mut s = format!(
        "proxy:\n  http_bind_port: {HTTP_PORT}\n  \
         admin: {{ enabled: true, bind: \"${{POD_IP}}\", port: {PROXY_ADMIN_PORT} }}\n  \
         extensions:\n    sbmesh:\n      acme:\n        enabled: true\n        \
         email: ops@example.com\n        directory_url: \"{}\"\n        ca_root: \"{}\"\n        \
         storage_backend: redis\n        storage_path: \"{redis}\"\n        \
         certificates: per_host\n        apply: reload\norigins:\n",
        pebble.directory,
        pebble.ca_root.display()
    );
    for h in hosts {
        s.push_str(&format!("  \"{h}\": {{}}\n"));
    }
    s
}

fn pod_args(i: usize, cluster_id: &str, key_file: &Path, base: &Path) -> Vec<String> {
    let ip = pod_ip(i);
    let seeds: Vec<String> = (0..PODS).map(|j| format!("{}:7946", pod_ip(j))).collect();
    [
        "--node-id",
        &format!("pod-{i}"),
        "--cluster-id",
        cluster_id,
        "--cluster-key-file",
        &key_file.display().to_string(),
        "--bind",
        &ip.to_string(),
        "--seeds",
        &seeds.join(","),
        "--admin-listen",
        &format!("{ip}:{SIDECAR_ADMIN_PORT}"),
        "--challenge-listen",
        &format!("{ip}:{PEBBLE_HTTP_PORT}"),
        "--proxy-reload-url",
        &format!("http://{ip}:{PROXY_ADMIN_PORT}/admin/reload"),
        "--cert-dir",
        &base.join(format!("pod-{i}/certs")).display().to_string(),
        "--state-dir",
        &base.join(format!("pod-{i}/state")).display().to_string(),
        "--acme-order-lock-ttl-secs",
        "10",
        "--log-format",
        "text",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

// ---------------------------------------------------------------------------
// The monitor: scrapes every pod once a second
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
pub struct Sample {
    pub at_ms: u64,
    pub pod: usize,
    /// Sum of `store_operations_total` (every backend, op and result).
    pub store_ops: f64,
    /// Sum of `acme_orders_total{result="issued"|"failed"}`.
    pub orders: f64,
    /// host -> serial on disk.
    pub serials: BTreeMap<String, String>,
}

struct Monitor {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Monitor {
    fn start(targets: Vec<(usize, Ipv4Addr, PathBuf)>) -> Monitor {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (s, out) = (stop.clone(), samples.clone());
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let tick = Instant::now();
                for (pod, ip, dir) in &targets {
                    let at_ms = now_unix_ms();
                    let serials = ChaosPod::serials_in(dir);
                    // A stopped or restarting sidecar has no sample.
                    let Some((200, m)) = http_get(
                        SocketAddr::from((*ip, SIDECAR_ADMIN_PORT)),
                        "/metrics",
                        None,
                    ) else {
                        continue;
                    };
                    let orders = metric_sum(&m, "acme_orders_total", &[("result", "issued")])
                        .unwrap_or(0.0)
                        + metric_sum(&m, "acme_orders_total", &[("result", "failed")])
                            .unwrap_or(0.0);
                    out.lock().unwrap().push(Sample {
                        at_ms,
                        pod: *pod,
                        store_ops: metric_sum(&m, "store_operations_total", &[]).unwrap_or(0.0),
                        orders,
                        serials,
                    });
                }
                let spent = tick.elapsed();
                if spent < Duration::from_secs(1) {
                    std::thread::sleep(Duration::from_secs(1) - spent);
                }
            }
        });
        Monitor {
            stop,
            samples,
            handle: Some(handle),
        }
    }

    fn finish(mut self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        std::mem::take(&mut *self.samples.lock().unwrap())
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl ChaosPod {
    fn serials_in(dir: &Path) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        let Ok(entries) = fs::read_dir(dir.join("certs")) else {
            return out;
        };
        for e in entries.flatten() {
            if let Ok(pem) = fs::read_to_string(e.path().join("tls.crt"))
                && let Ok(facts) = sbmesh::internal::certs::parse_chain(&pem)
            {
                out.insert(e.file_name().to_string_lossy().into_owned(), facts.serial);
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------

/// One injected fault as it happened (wall clock, ms).
#[derive(Clone, Debug)]
pub struct Injected {
    pub kind: FaultKind,
    pub start_ms: u64,
    pub end_ms: u64,
}

/// A config content written to sb.yml: when, and its sha256.
#[derive(Clone, Debug)]
pub struct ConfigEpoch {
    pub at_ms: u64,
    pub sha256: String,
    pub hosts: Vec<String>,
}

pub struct Fleet {
    pub seed: u64,
    pub base: tempfile::TempDir,
    pub pool: Vec<String>,
    pub active: BTreeSet<usize>,
    pub config_path: PathBuf,
    pub epochs: Vec<ConfigEpoch>,
    pub injected: Vec<Injected>,
    pub key_generation: u64,
    /// Every kill -9 sent, by pod index.
    pub killed: Vec<(usize, u64)>,
    pub redis: Redis,
    pub ca: Ca,
    pub pods: Vec<ChaosPod>,
    partition_rules: Vec<Vec<String>>,
}

impl Fleet {
    pub fn start(seed: u64) -> Fleet {
        let base = tempfile::Builder::new()
            .prefix("sbmesh-chaos-")
            .tempdir()
            .expect("temp dir");
        let redis = Redis::start(base.path());
        let ca = Ca::start(base.path());
        let tag = format!("s{seed:x}");
        let pool: Vec<String> = (0..BASE_HOSTS + EXTRA_HOSTS)
            .map(|i| format!("h{i}.{tag}.chaos.test"))
            .collect();
        // Each host validates at some pod, most often not its owner.
        for (i, h) in pool.iter().enumerate() {
            ca.pebble.route(h, pod_ip(i % PODS));
        }
        let config_path = base.path().join("sb.yml");
        let mut fleet = Fleet {
            seed,
            pool,
            active: (0..BASE_HOSTS).collect(),
            config_path,
            epochs: Vec::new(),
            injected: Vec::new(),
            key_generation: 0,
            killed: Vec::new(),
            redis,
            ca,
            pods: Vec::new(),
            partition_rules: Vec::new(),
            base,
        };
        fleet.write_config();
        let cluster_id = format!("chaos-{seed:x}");
        for i in 0..PODS {
            let dir = fleet.base.path().join(format!("pod-{i}"));
            fs::create_dir_all(&dir).expect("pod dir");
            let key_file = dir.join("cluster.key");
            write_atomic(&key_file, &format!("{}\n", key_hex(seed, 0)));
            let args = pod_args(i, &cluster_id, &key_file, fleet.base.path());
            let pod = ChaosPod::spawn(i, pod_ip(i), fleet.base.path(), &fleet.config_path, &args);
            fleet.pods.push(pod);
        }
        fleet
    }

    pub fn hosts(&self) -> Vec<String> {
        self.active.iter().map(|&i| self.pool[i].clone()).collect()
    }

    fn write_config(&mut self) {
        let hosts = self.hosts();
        let text = chaos_config(&self.ca.pebble, &self.redis.url(), &hosts);
        write_atomic(&self.config_path, &text);
        self.epochs.push(ConfigEpoch {
            at_ms: now_unix_ms(),
            sha256: sha256_hex(text.as_bytes()),
            hosts,
        });
    }

    /// Every pod's sidecar lists all five members alive.
    pub fn converged(&self) -> bool {
        self.pods.iter().all(|p| {
            p.status().is_some_and(|s| {
                let nodes = s["nodes"].as_array().cloned().unwrap_or_default();
                nodes.len() == PODS && nodes.iter().all(|n| n["membership_state"] == "alive")
            })
        })
    }

    // --- the fault injectors: one small function each ---

    fn kill(&mut self, pod: usize) {
        let p = &self.pods[pod];
        if p.signal_sidecar(libc::SIGKILL).is_none() {
            eprintln!("chaos: {} had no sidecar to kill (restarting)", p.name);
        } else {
            self.killed.push((pod, now_unix_ms()));
        }
        // The pod's loop starts it again after 1 s.
        std::thread::sleep(Duration::from_secs(3));
    }

    fn partition(&mut self, pair: [usize; 2], secs: u64, swap: Option<usize>) {
        for &a in &pair {
            for b in (0..PODS).filter(|b| !pair.contains(b)) {
                let (ia, ib) = (pod_ip(a).to_string(), pod_ip(b).to_string());
                for (src, dst) in [(&ia, &ib), (&ib, &ia)] {
                    let rule: Vec<String> =
                        ["INPUT", "-i", "lo", "-s", src, "-d", dst, "-j", "DROP"]
                            .iter()
                            .map(|s| s.to_string())
                            .collect();
                    let mut args = vec!["-A"];
                    args.extend(rule.iter().map(String::as_str));
                    iptables(&args);
                    self.partition_rules.push(rule);
                }
            }
        }
        self.sleep_with_swap(secs, swap);
        self.heal_partition();
    }

    /// Sleeps `secs`, toggling origin `swap` halfway.
    fn sleep_with_swap(&mut self, secs: u64, swap: Option<usize>) {
        let half = Duration::from_secs(secs) / 2;
        std::thread::sleep(half);
        if let Some(h) = swap {
            self.toggle(h);
        }
        std::thread::sleep(Duration::from_secs(secs) - half);
    }

    /// Adds origin `host`, or removes it (keeping at least 16, else it
    /// stays); true when added.
    fn toggle(&mut self, host: usize) -> bool {
        let what = if !self.active.contains(&host) {
            self.active.insert(host);
            "added"
        } else if self.active.len() > BASE_HOSTS - 4 {
            self.active.remove(&host);
            "removed"
        } else {
            "kept (at the minimum of origins)"
        };
        eprintln!("chaos:   {what} {}", self.pool[host]);
        if what != "kept (at the minimum of origins)" {
            self.write_config();
        }
        what == "added"
    }

    fn heal_partition(&mut self) {
        for rule in std::mem::take(&mut self.partition_rules) {
            let mut args = vec!["-D"];
            args.extend(rule.iter().map(String::as_str));
            iptables(&args);
        }
    }

    fn redis_restart(&mut self, down_secs: u64) {
        self.redis.kill9();
        std::thread::sleep(Duration::from_secs(down_secs));
        self.redis.restart();
    }

    fn stop(&mut self, pod: usize) {
        let p = &self.pods[pod];
        let Some(pid) = p.signal_sidecar(libc::SIGSTOP) else {
            eprintln!("chaos: {} had no sidecar to stop", p.name);
            return;
        };
        std::thread::sleep(Duration::from_secs(2));
        // SAFETY: kill(2) by the PID we stopped.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
    }

    fn config_swap(&mut self, host: usize, kill_owner: bool) {
        let added = self.toggle(host);
        if added && kill_owner {
            // The sidecars see the file within the debounce; the owner then
            // takes the order lock and calls the CA.
            std::thread::sleep(Duration::from_millis(300));
            let ids: Vec<String> = (0..PODS).map(|i| format!("pod-{i}")).collect();
            let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
            if let Some(owner) = sbmesh::internal::ownership::owner(&self.pool[host], &refs)
                && let Some(i) = ids.iter().position(|id| id == owner)
            {
                eprintln!("chaos:   kill -9 pod-{i}, the owner");
                self.pods[i].signal_sidecar(libc::SIGKILL);
                self.killed.push((i, now_unix_ms()));
            }
        }
        std::thread::sleep(Duration::from_secs(3));
    }

    /// The next key becomes primary; every earlier key still opens. One pod
    /// at a time, as a Secret update reaches pods at different moments.
    fn rotate_key(&mut self) {
        self.key_generation += 1;
        let ring: Vec<String> = (0..=self.key_generation)
            .rev()
            .map(|g| key_hex(self.seed, g))
            .collect();
        let text = ring.join("\n") + "\n";
        for p in &self.pods {
            write_atomic(&p.key_file, &text);
            std::thread::sleep(Duration::from_secs(2));
        }
    }

    fn skew(&mut self, pod: usize, secs: u64, swap: Option<usize>) {
        fs::write(&self.pods[pod].skew_file, format!("{SKEW}\n")).expect("faketime file");
        self.sleep_with_swap(secs, swap);
        fs::write(&self.pods[pod].skew_file, "+0s\n").expect("faketime file");
    }

    pub fn inject(&mut self, kind: &FaultKind) {
        let start_ms = now_unix_ms();
        eprintln!("chaos: {} (at {start_ms})", kind.label());
        match kind {
            FaultKind::Kill { pod } => self.kill(*pod),
            FaultKind::Partition { pair, secs, swap } => self.partition(*pair, *secs, *swap),
            FaultKind::RedisRestart { down_secs } => self.redis_restart(*down_secs),
            FaultKind::Stop { pod } => self.stop(*pod),
            FaultKind::ConfigSwap { host, kill_owner } => self.config_swap(*host, *kill_owner),
            FaultKind::RotateKey => self.rotate_key(),
            FaultKind::Skew { pod, secs, swap } => self.skew(*pod, *secs, *swap),
        }
        self.injected.push(Injected {
            kind: kind.clone(),
            start_ms,
            end_ms: now_unix_ms(),
        });
    }

    /// Ends every fault still in force (a panic midway leaves none behind).
    pub fn heal(&mut self) {
        self.heal_partition();
        for p in &self.pods {
            let _ = fs::write(&p.skew_file, "+0s\n");
            p.signal_sidecar(libc::SIGCONT);
        }
        if !self.redis.running() {
            self.redis.restart();
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // Rules live in this namespace only; take them out all the same.
        for rule in std::mem::take(&mut self.partition_rules) {
            let mut args = vec!["-D".to_owned()];
            args.extend(rule);
            let _ = Command::new(tool("iptables")).args(&args).output();
        }
        // Pods first (their processes use Redis and Pebble), by their unshare PIDs.
        self.pods.clear();
        if std::thread::panicking() || std::env::var_os("SBMESH_KEEP_TMP").is_some() {
            keep_logs(self);
        }
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .fold(String::new(), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

// ---------------------------------------------------------------------------
// Log lines
// ---------------------------------------------------------------------------

/// Unix ms of an RFC 3339 UTC timestamp such as `2026-12-01T11:40:50.123456Z`.
pub fn parse_rfc3339_ms(ts: &str) -> Option<u64> {
    let ts = ts.strip_suffix('Z')?;
    let (date, time) = ts.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|p| p.parse::<i64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    let ms: i64 = format!("{frac:0<3}")[..3].parse().ok()?;
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(((days * 86_400 + hh * 3600 + mm * 60 + ss) * 1000) + ms).ok()
}

/// `(unix ms, line)` of every line at ERROR level in `text` (the sidecar's
/// tracing text format and the stand-in's both start `<time> <LEVEL>`).
pub fn error_lines(text: &str) -> Vec<(u64, String)> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            let ts = parse_rfc3339_ms(w.next()?)?;
            (w.next()? == "ERROR").then(|| (ts, l.to_owned()))
        })
        .collect()
}

// ---------------------------------------------------------------------------
// Invariants
// ---------------------------------------------------------------------------

pub struct Outcome {
    pub seed: u64,
    pub secs: u64,
    pub faults: usize,
    pub failures: Vec<String>,
    pub notes: Vec<String>,
    /// The CA itself stopped answering before the chaos began
    /// ([`pebble_wedged`]): nothing about the sidecars was tested.
    pub ca_wedged: Option<String>,
}

/// Runs the soak: start, chaos for `secs`, heal, check. Never panics on a
/// broken invariant: each is one entry of `failures`.
pub fn run(seed: u64, secs: u64) -> Outcome {
    let plan = schedule(seed, secs, PODS);
    eprintln!(
        "chaos: {} faults in {secs}s: {}",
        plan.len(),
        plan.iter()
            .map(|f| format!("{}s {}", f.at.as_secs(), f.kind.label()))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let mut fleet = Fleet::start(seed);
    let mut notes = Vec::new();
    let mut failures = Vec::new();

    let t0 = Instant::now();
    if !poll_until(Duration::from_secs(120), || fleet.converged()) {
        failures.push(format!(
            "the fleet did not converge before the chaos (120 s): {}",
            describe_members(&fleet)
        ));
    }
    notes.push(format!(
        "converged after {:.1}s",
        t0.elapsed().as_secs_f64()
    ));
    let first = fleet.hosts();
    let initial = poll_until(Duration::from_secs(120), || {
        all_same_serials(&fleet, &first).is_ok()
    });
    notes.push(format!(
        "initial issuance of {} hosts: {} after {:.1}s",
        first.len(),
        if initial { "done" } else { "NOT done" },
        t0.elapsed().as_secs_f64()
    ));
    if !initial {
        let log = fs::read_to_string(&fleet.ca.pebble.log).unwrap_or_default();
        if let Some(why) = pebble_wedged(&log) {
            keep_logs(&mut fleet);
            return Outcome {
                seed,
                secs,
                faults: plan.len(),
                failures: vec![why.clone()],
                notes,
                ca_wedged: Some(why),
            };
        }
    }

    let monitor = Monitor::start(
        fleet
            .pods
            .iter()
            .map(|p| (p.index, p.ip, p.dir.clone()))
            .collect(),
    );
    let chaos_start = Instant::now();
    for f in &plan {
        if let Some(wait) = f.at.checked_sub(chaos_start.elapsed()) {
            std::thread::sleep(wait);
        }
        fleet.inject(&f.kind);
    }
    fleet.heal();
    let healed_ms = now_unix_ms();
    eprintln!("chaos: healed at {healed_ms}; checking the invariants");

    // The mesh heals.
    if !poll_until(Duration::from_secs(60), || fleet.converged()) {
        failures.push(format!(
            "the mesh did not heal within 60 s: {}",
            describe_members(&fleet)
        ));
    }
    // Every live replica has the same serial per host on disk within 30 s.
    let final_hosts = fleet.hosts();
    let mut disk = Err(String::new());
    poll_until(Duration::from_secs(30), || {
        disk = all_same_serials(&fleet, &final_hosts);
        disk.is_ok()
    });
    // Let the last reloads land before reading the proxies' logs.
    std::thread::sleep(Duration::from_secs(2));
    let samples = monitor.finish();

    let mut issued = BTreeMap::new();
    issued_by_ca(&fleet.ca.pebble, &mut issued);
    if let Err(e) = &disk {
        // Name which serials are the CA's (the others are placeholders).
        let from_ca: Vec<String> = issued
            .values()
            .filter(|(_, names)| names.iter().any(|n| e.contains(n.as_str())))
            .map(|(serial, names)| format!("{serial} for {names:?}"))
            .collect();
        failures.push(format!(
            "30 s after healing, the replicas' certificate files disagree: {e} \
             (the CA issued: {from_ca:?}; any other serial is a placeholder)"
        ));
    }
    check_issuance(&fleet, &issued, &final_hosts, &mut failures);
    if let Ok(serials) = &disk {
        let at_ca: BTreeSet<&String> = issued.values().map(|(s, _)| s).collect();
        for (h, s) in serials {
            if !at_ca.contains(s) {
                failures.push(format!(
                    "{h}: the replicas hold serial {s}, which the CA never issued (a placeholder?)"
                ));
            }
        }
    }
    check_processes(&fleet, &mut failures);
    check_reloads(&fleet, &samples, healed_ms, &mut failures);
    check_store_rate(&samples, &mut failures, &mut notes);
    write_samples(&fleet.base.path().join("samples.tsv"), &samples);
    check_logs(&fleet, &mut failures);

    let outcome = Outcome {
        seed,
        secs,
        faults: plan.len(),
        failures,
        notes,
        ca_wedged: None,
    };
    if !outcome.failures.is_empty() {
        // Keep the logs for the failure report.
        keep_logs(&mut fleet);
    }
    outcome
}

/// Leaves the run's directory (every log, pod.sh, samples.tsv) on disk.
fn keep_logs(fleet: &mut Fleet) {
    let path = fleet.base.path().to_path_buf();
    eprintln!("chaos: logs kept in {}", path.display());
    std::mem::forget(std::mem::replace(
        &mut fleet.base,
        tempfile::tempdir().expect("temp dir"),
    ));
}

fn describe_members(fleet: &Fleet) -> String {
    fleet
        .pods
        .iter()
        .map(|p| {
            let view = p.status().map(|s| {
                s["nodes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|n| {
                        format!(
                            "{}={}",
                            n["node_id"].as_str().unwrap_or("?"),
                            n["membership_state"].as_str().unwrap_or("?")
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(",")
            });
            format!(
                "{} sees [{}]",
                p.name,
                view.unwrap_or_else(|| "no status".into())
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// `Ok(host -> serial)` when every pod holds the same serial for every
/// host; `Err` names each host whose files disagree or are missing.
fn all_same_serials(fleet: &Fleet, hosts: &[String]) -> Result<BTreeMap<String, String>, String> {
    let on_disk: Vec<BTreeMap<String, String>> =
        fleet.pods.iter().map(ChaosPod::serials_on_disk).collect();
    let mut agreed = BTreeMap::new();
    let mut bad = Vec::new();
    for h in hosts {
        let per_pod: Vec<Option<&String>> = on_disk.iter().map(|m| m.get(h)).collect();
        let first = per_pod[0];
        if first.is_some() && per_pod.iter().all(|s| *s == first) {
            agreed.insert(h.clone(), first.cloned().unwrap_or_default());
        } else {
            bad.push(format!(
                "{h}: {}",
                per_pod
                    .iter()
                    .enumerate()
                    .map(|(i, s)| format!("pod-{i}={}", s.map_or("missing", |s| s.as_str())))
                    .collect::<Vec<_>>()
                    .join(" ")
            ));
        }
    }
    if bad.is_empty() {
        Ok(agreed)
    } else {
        Err(bad.join("; "))
    }
}

/// One certificate per hostname (and name set), never two; every host of
/// the final config has one.
fn check_issuance(
    fleet: &Fleet,
    issued: &BTreeMap<String, (String, BTreeSet<String>)>,
    final_hosts: &[String],
    failures: &mut Vec<String>,
) {
    let mut by_names: BTreeMap<BTreeSet<String>, Vec<&String>> = BTreeMap::new();
    for (serial, names) in issued.values() {
        if names.iter().any(|n| fleet.pool.contains(n)) {
            by_names.entry(names.clone()).or_default().push(serial);
        }
    }
    for (names, serials) in &by_names {
        if serials.len() > 1 {
            failures.push(format!(
                "the CA issued {} certificates for {:?} (serials {:?}); one was intended",
                serials.len(),
                names,
                serials
            ));
        }
    }
    for h in final_hosts {
        let single: BTreeSet<String> = [h.clone()].into();
        if !by_names.contains_key(&single) {
            failures.push(format!("the CA never issued a certificate for {h}"));
        }
    }
}

/// Every sidecar exit was an injected kill, every proxy still runs, and
/// each pod runs a sidecar now.
fn check_processes(fleet: &Fleet, failures: &mut Vec<String>) {
    for p in &fleet.pods {
        let kills = fleet.killed.iter().filter(|(k, _)| *k == p.index).count();
        let runs = p.read("sidecar.runs");
        let exits: Vec<&str> = runs.lines().filter(|l| l.starts_with("exit ")).collect();
        let not_killed: Vec<&&str> = exits
            .iter()
            .filter(|l| !l.starts_with("exit 137"))
            .collect();
        if !not_killed.is_empty() {
            failures.push(format!(
                "{}: the sidecar exited by itself ({not_killed:?}); last log lines:\n{}",
                p.name,
                tail(&p.read("sidecar.log"), 20)
            ));
        }
        if exits.len() > kills {
            failures.push(format!(
                "{}: the sidecar exited {} times but was killed {kills} times",
                p.name,
                exits.len()
            ));
        }
        if p.sidecar_pid().is_none() {
            failures.push(format!("{}: no sidecar running at the end", p.name));
        }
        let proxy_log = p.read("proxy.log");
        let proxy_exits: Vec<&str> = proxy_log
            .lines()
            .filter(|l| l.starts_with("proxy exited"))
            .collect();
        if !proxy_exits.is_empty() || p.proxy_pid().is_none() {
            failures.push(format!(
                "{}: the proxy, never killed, exited: {proxy_exits:?} (running now: {})",
                p.name,
                p.proxy_pid().is_some()
            ));
        }
    }
}

/// `(unix ms, revision)` of every reload POST the stand-in applied.
pub fn applied_posts(proxy_log: &str) -> Vec<(u64, String)> {
    proxy_log
        .lines()
        .filter_map(|l| {
            let rest = l
                .split("reload (POST /admin/reload): applied revision ")
                .nth(1)?;
            let ts = parse_rfc3339_ms(l.split_whitespace().next()?)?;
            Some((ts, rest.split_whitespace().next()?.to_owned()))
        })
        .collect()
}

/// Sidecar downtime of a pod: kill windows (until its restart) and stops.
fn sidecar_down(fleet: &Fleet, pod: usize) -> Vec<(u64, u64)> {
    let stops = fleet
        .injected
        .iter()
        .filter(|i| matches!(i.kind, FaultKind::Stop { pod: p } if p == pod))
        .map(|i| (i.start_ms, i.end_ms + 1000));
    // A killed sidecar is back (restarted by the pod's loop) within ~3 s.
    let kills = fleet
        .killed
        .iter()
        .filter(|(p, _)| *p == pod)
        .map(|(_, at)| (*at, at + 5000));
    stops.chain(kills).collect()
}

/// No config content missed, none POSTed twice without a certificate
/// change in between.
fn check_reloads(fleet: &Fleet, samples: &[Sample], healed_ms: u64, failures: &mut Vec<String>) {
    let Some(last) = fleet.epochs.last() else {
        return;
    };
    for p in &fleet.pods {
        let posts = applied_posts(&p.read("proxy.log"));
        // Missed: the final content, and every content that stayed 10 s
        // while this pod's sidecar ran all of those 10 s.
        if posts.last().map(|(_, r)| r) != Some(&last.sha256) {
            failures.push(format!(
                "{}: the final config (sha256 {}) was never POSTed last; last POST {:?}",
                p.name,
                &last.sha256[..12],
                posts.last()
            ));
        }
        let down = sidecar_down(fleet, p.index);
        for (k, e) in fleet.epochs.iter().enumerate().skip(1) {
            let until = fleet
                .epochs
                .get(k + 1)
                .map_or(healed_ms.max(e.at_ms + 10_000), |n| n.at_ms);
            let window = (e.at_ms, e.at_ms + 10_000);
            let disturbed = down.iter().any(|(a, b)| *a < window.1 && *b > window.0);
            if until < window.1 || disturbed {
                continue;
            }
            if !posts
                .iter()
                .any(|(t, r)| r == &e.sha256 && *t + 1000 >= e.at_ms && *t <= until + 5000)
            {
                failures.push(format!(
                    "{}: config #{k} (sha256 {}, written at {}, current {} ms) was never POSTed",
                    p.name,
                    &e.sha256[..12],
                    e.at_ms,
                    until - e.at_ms
                ));
            }
        }
        // Twice: the same revision POSTed again with no config change and no
        // certificate change on this pod's disk (±1 s of sampling) between.
        let mine: Vec<&Sample> = samples.iter().filter(|s| s.pod == p.index).collect();
        for w in posts.windows(2) {
            let ((t1, r1), (t2, r2)) = (&w[0], &w[1]);
            if r1 != r2 {
                continue;
            }
            let before = mine.iter().rev().find(|s| s.at_ms + 1000 <= *t1);
            let after = mine.iter().find(|s| s.at_ms >= *t2 + 1000);
            let cert_change = match (before, after) {
                (Some(b), Some(a)) => b.serials != a.serials,
                // Not sampled around it: do not accuse.
                _ => true,
            };
            let config_change = fleet.epochs.iter().any(|e| e.at_ms > *t1 && e.at_ms <= *t2);
            if !cert_change && !config_change {
                failures.push(format!(
                    "{}: revision {} was POSTed twice (at {t1} and {t2}) with no config or \
                     certificate change between",
                    p.name,
                    &r1[..12.min(r1.len())]
                ));
            }
        }
    }
}

/// The store operation rate of each replica, over 5 s windows, outside
/// issuance bursts (any replica's order counter moving, ±3 s).
fn check_store_rate(samples: &[Sample], failures: &mut Vec<String>, notes: &mut Vec<String>) {
    let mut bursts: Vec<u64> = Vec::new();
    let mut by_pod: BTreeMap<usize, Vec<&Sample>> = BTreeMap::new();
    for s in samples {
        by_pod.entry(s.pod).or_default().push(s);
    }
    for list in by_pod.values() {
        for w in list.windows(2) {
            if w[1].orders != w[0].orders {
                bursts.push(w[1].at_ms);
            }
        }
    }
    let in_burst = |a: u64, b: u64| {
        bursts
            .iter()
            .any(|t| *t + BURST_MARGIN_MS >= a && *t <= b + BURST_MARGIN_MS)
    };
    let mut worst_outside = (0.0_f64, String::new());
    let mut worst_inside = 0.0_f64;
    for (pod, list) in &by_pod {
        // Windows over the limit: (rate, from, to).
        let mut over: Vec<(f64, u64, u64)> = Vec::new();
        for (i, s) in list.iter().enumerate() {
            let Some(e) = list[i..].iter().find(|e| e.at_ms >= s.at_ms + 5000) else {
                break;
            };
            // A restart resets the counters: no rate across it.
            if e.store_ops < s.store_ops || e.at_ms > s.at_ms + 15_000 {
                continue;
            }
            let rate = (e.store_ops - s.store_ops) * 1000.0 / (e.at_ms - s.at_ms) as f64;
            if in_burst(s.at_ms, e.at_ms) {
                worst_inside = worst_inside.max(rate);
                continue;
            }
            if rate > worst_outside.0 {
                worst_outside = (rate, format!("pod-{pod} at {}", s.at_ms));
            }
            if rate > MAX_STORE_OPS_PER_SEC {
                over.push((rate, s.at_ms, e.at_ms));
            }
        }
        if let (Some(first), Some(worst)) =
            (over.first(), over.iter().max_by(|a, b| a.0.total_cmp(&b.0)))
        {
            failures.push(format!(
                "pod-{pod}: {} windows of 5 s over {MAX_STORE_OPS_PER_SEC} store ops/s outside any \
                 issuance burst; first {:.1} ops/s from {} to {} ms, worst {:.1} ops/s from {} to {} ms",
                over.len(),
                first.0,
                first.1,
                first.2,
                worst.0,
                worst.1,
                worst.2
            ));
        }
    }
    notes.push(format!(
        "highest store rate per replica outside bursts: {:.1} ops/s ({}), inside: {:.1} ops/s; \
         {} samples, {} burst marks",
        worst_outside.0,
        worst_outside.1,
        worst_inside,
        samples.len(),
        bursts.len()
    ));
}

/// Nothing at ERROR level except inside the window of a fault that
/// touched that pod (its start to its end + 15 s; a skewed pod's lines
/// are stamped 60 s ahead).
fn check_logs(fleet: &Fleet, failures: &mut Vec<String>) {
    for p in &fleet.pods {
        let windows: Vec<(u64, u64, bool)> = fleet
            .injected
            .iter()
            .filter(|i| i.kind.affects(PODS).contains(&p.index))
            .map(|i| {
                let skew = matches!(i.kind, FaultKind::Skew { .. });
                (i.start_ms, i.end_ms + GRACE.as_millis() as u64, skew)
            })
            .collect();
        let explained = |t: u64| {
            windows.iter().any(|(a, b, skew)| {
                (t + 1000 >= *a && t <= *b) || (*skew && t >= *a && t <= *b + 61_000)
            })
        };
        for file in ["sidecar.log", "proxy.log"] {
            let unexplained: Vec<String> = error_lines(&p.read(file))
                .into_iter()
                .filter(|(t, _)| !explained(*t))
                .map(|(_, l)| l)
                .collect();
            if !unexplained.is_empty() {
                failures.push(format!(
                    "{} {file}: {} ERROR lines outside any injected fault, e.g.:\n  {}",
                    p.name,
                    unexplained.len(),
                    unexplained
                        .iter()
                        .take(5)
                        .cloned()
                        .collect::<Vec<_>>()
                        .join("\n  ")
                ));
            }
        }
    }
}

/// The monitor's samples, for reading a failure afterwards.
fn write_samples(path: &Path, samples: &[Sample]) {
    let mut out = String::from("unix_ms\tpod\tstore_ops\torders\tcertificates\n");
    for s in samples {
        let _ = writeln!(
            out,
            "{}\tpod-{}\t{}\t{}\t{}",
            s.at_ms,
            s.pod,
            s.store_ops,
            s.orders,
            s.serials.len()
        );
    }
    let _ = fs::write(path, out);
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The report of a finished run; `Err` with every broken invariant.
pub fn report(o: &Outcome) -> Result<(), String> {
    let mut s = format!(
        "chaos soak: seed {} ({}s, {} faults; SBMESH_CHAOS_SEED={} replays it)\n",
        o.seed, o.secs, o.faults, o.seed
    );
    for n in &o.notes {
        let _ = writeln!(s, "  note: {n}");
    }
    if o.failures.is_empty() {
        eprintln!("{s}  every invariant held");
        return Ok(());
    }
    let _ = writeln!(s, "{} invariant failures:", o.failures.len());
    for f in &o.failures {
        let _ = writeln!(s, "- {f}");
    }
    Err(s)
}

/// Re-executes this binary as `unshare -rn <exe> <args>` unless it is
/// already inside (for the benchmark; the test uses `enter_netns_test`).
/// Returns `true` inside.
pub fn enter_netns_bench() -> bool {
    if std::env::var_os(crate::common::IN_NETNS_ENV).is_some() {
        crate::common::netns_setup();
        return true;
    }
    if let Err(why) = crate::common::netns_available() {
        panic!("the chaos soak needs a private network namespace: {why}");
    }
    let exe = std::env::current_exe().expect("current_exe");
    let status = Command::new(tool("unshare"))
        .arg("-rn")
        .arg("--")
        .arg(&exe)
        .args(std::env::args_os().skip(1))
        .env(crate::common::IN_NETNS_ENV, "1")
        .status()
        .expect("run unshare");
    assert!(status.success(), "the soak failed inside its namespace");
    false
}
