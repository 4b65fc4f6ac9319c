//! The lease lock between processes, as between pods: child processes (this
//! test binary, re-executed with [`ROLE_ENV`] set) contend for one lock in
//! a `file` store directory or on Redis (`SBMESH_TEST_REDIS_URL`).
//!
//! - 8 processes run 100 critical sections in all; in each, the holder
//!   reads a counter, writes counter + 1 with a fenced write, and appends
//!   `(round, fence, holder)` to its own log. The parent merges the logs:
//!   every round from 1 to 100 appears exactly once (one holder per round)
//!   and the fences strictly increase with the rounds. A marker file
//!   created with `O_EXCL` on entry and removed on exit detects overlap
//!   independently of the store.
//! - A holder killed with SIGKILL: another process takes the lease over
//!   once its TTL has passed (not before), with the next fence.
//! - Clock skew (file, redis, s3 on moto): a contender run under
//!   libfaketime 60 s ahead does not take over a lease that a holder with
//!   the right clock keeps, and takes over one whose holder stopped once
//!   its TTL has passed (on the store's clock), not earlier.

mod object_servers;
#[allow(clippy::duplicate_mod)]
mod required;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sbmesh::{
    FileStore, LeaseKeeper, LeaseLock, ObjectBackend, Store, get_fenced, now_unix_ms, put_fenced,
};

/// What a child does: `sections`, `hold` or `take`.
const ROLE_ENV: &str = "SBMESH_LOCK_CHILD_ROLE";
/// `file` or `redis`.
const BACKEND_ENV: &str = "SBMESH_LOCK_CHILD_BACKEND";
/// The store directory (file) or URL (redis).
const TARGET_ENV: &str = "SBMESH_LOCK_CHILD_TARGET";
/// The Redis key namespace.
const NAMESPACE_ENV: &str = "SBMESH_LOCK_CHILD_NAMESPACE";
/// Directory for start files, logs and the overlap marker (outside the store).
const SYNC_ENV: &str = "SBMESH_LOCK_CHILD_SYNC";
/// The child's number.
const ID_ENV: &str = "SBMESH_LOCK_CHILD_ID";

const PROCESSES: usize = 8;
const ROUNDS: u64 = 100;
const LOCK: &str = "processes";
const COUNTER: &str = "processes/counter";
const DEADLINE: Duration = Duration::from_secs(180);
const HOLD_TTL: Duration = Duration::from_millis(1_500);
/// The skewed contender's clock, ahead of the real one.
const SKEW: &str = "+60s";
/// Lease TTL of the skew test.
const SKEW_TTL: Duration = Duration::from_secs(3);

// ---------------------------------------------------------------------------
// Child side

/// The child processes' entry point; a no-op in a normal test run.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let env = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} unset"));
    let sync = PathBuf::from(env(SYNC_ENV));
    let id: u32 = env(ID_ENV).parse().expect("child id");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let store = open(&env(BACKEND_ENV), &env(TARGET_ENV), &env(NAMESPACE_ENV)).await;
        let holder = format!("proc-{id}-{}", std::process::id());
        let lock = LeaseLock::new(Arc::clone(&store), LOCK)
            .with_poll_interval(Duration::from_millis(1), Duration::from_millis(10));
        std::fs::write(sync.join(format!("ready-{id}")), b"").expect("ready file");
        wait_for_file(&sync.join("go")).await;
        match role.as_str() {
            "sections" => sections(&store, &lock, &holder, &sync, id).await,
            "hold" => {
                let lease = lock
                    .acquire(&holder, HOLD_TTL, Duration::from_secs(30))
                    .await
                    .expect("acquire")
                    .expect("acquired");
                let line = format!("{} {}\n", lease.fence, lease.expires_at_unix_ms);
                write_atomic(&sync.join("held"), line.as_bytes());
                // Stay here until the parent kills this process.
                std::future::pending::<()>().await;
            }
            "take" => {
                let lease = lock
                    .acquire(&holder, Duration::from_secs(30), Duration::from_secs(60))
                    .await
                    .expect("acquire")
                    .expect("taken over within 60 s");
                let acquired_at = lease.expires_at_unix_ms - 30_000;
                let line = format!("{} {acquired_at}\n", lease.fence);
                write_atomic(&sync.join("taken"), line.as_bytes());
                assert!(lock.release(&lease).await.expect("release"));
            }
            "skewed" => {
                // Phase 1: try for two TTLs while the parent keeps its lease.
                let got = lock
                    .acquire(&holder, SKEW_TTL, SKEW_TTL * 2)
                    .await
                    .expect("acquire");
                let line = match &got {
                    Some(lease) => format!("took {}\n", lease.fence),
                    None => "busy\n".to_owned(),
                };
                write_atomic(&sync.join("phase1"), line.as_bytes());
                if let Some(lease) = got {
                    let _ = lock.release(&lease).await;
                    return;
                }
                // Phase 2: the parent stopped renewing; wait it out.
                wait_for_file(&sync.join("stopped")).await;
                let lease = lock
                    .acquire(&holder, SKEW_TTL, Duration::from_secs(60))
                    .await
                    .expect("acquire")
                    .expect("taken over within 60 s");
                write_atomic(&sync.join("taken"), format!("{}\n", lease.fence).as_bytes());
                assert!(lock.release(&lease).await.expect("release"));
            }
            other => panic!("unknown role {other}"),
        }
    });
}

async fn sections(store: &Arc<dyn Store>, lock: &LeaseLock, holder: &str, sync: &Path, id: u32) {
    let mut log = std::fs::File::create(sync.join(format!("log-{id}"))).expect("log file");
    let marker = sync.join("inside");
    loop {
        let lease = lock
            .acquire(holder, Duration::from_secs(30), Duration::from_secs(120))
            .await
            .expect("acquire")
            .expect("acquired within 120 s");
        if let Err(e) = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&marker)
        {
            writeln!(log, "OVERLAP {e}").expect("log");
            panic!("two processes inside at once ({e})");
        }
        let count = match get_fenced(store.as_ref(), COUNTER).await.expect("read") {
            Some(entry) => u64::from_be_bytes(entry.value.try_into().expect("8 bytes")),
            None => 0,
        };
        let done = count >= ROUNDS;
        if !done {
            put_fenced(store.as_ref(), COUNTER, &(count + 1).to_be_bytes(), &lease)
                .await
                .expect("fenced write under a held lease");
            writeln!(log, "{} {} {holder}", count + 1, lease.fence).expect("log");
        }
        std::fs::remove_file(&marker).expect("remove marker");
        assert!(lock.release(&lease).await.expect("release"));
        if done {
            log.sync_all().expect("sync log");
            return;
        }
    }
}

async fn open(backend: &str, target: &str, namespace: &str) -> Arc<dyn Store> {
    match backend {
        "file" => Arc::new(FileStore::open(target).await.expect("open file store")),
        "redis" => Arc::new(
            sbmesh::RedisStore::connect(target, Duration::from_secs(5))
                .await
                .expect("redis store")
                .with_namespace(namespace)
                .expect("namespace"),
        ),
        "s3" => Arc::new(
            ObjectBackend::open_with_options(
                &format!("s3://{namespace}/sbmesh"),
                object_servers::s3_options(target),
            )
            .expect("open s3 store"),
        ),
        other => panic!("unknown backend {other}"),
    }
}

async fn wait_for_file(path: &Path) {
    let until = Instant::now() + DEADLINE;
    while !path.exists() {
        assert!(Instant::now() < until, "{} never appeared", path.display());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Writes through a temp file and a rename, so the parent never reads a
/// half-written file.
fn write_atomic(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

// ---------------------------------------------------------------------------
// Parent side

/// Where the children find the store.
struct Target {
    backend: &'static str,
    target: String,
    namespace: String,
    _dir: Option<tempfile::TempDir>,
}

fn file_target() -> Target {
    let dir = tempfile::tempdir().expect("temp dir");
    Target {
        backend: "file",
        target: dir.path().join("store").display().to_string(),
        namespace: String::new(),
        _dir: Some(dir),
    }
}

fn redis_target() -> Option<Target> {
    match std::env::var("SBMESH_TEST_REDIS_URL") {
        Ok(url) if !url.trim().is_empty() => Some(Target {
            backend: "redis",
            target: url,
            namespace: format!("lock-processes-{:016x}", rand::random::<u64>()),
            _dir: None,
        }),
        _ => required::missing(
            "redis",
            "SBMESH_TEST_REDIS_URL is not set",
            "scripts/test starts Redis",
        ),
    }
}

/// S3 on moto at `SBMESH_TEST_S3_ENDPOINT`, in a new bucket.
fn s3_target() -> Option<Target> {
    let endpoint = object_servers::server_env("SBMESH_TEST_S3_ENDPOINT")?;
    let bucket = object_servers::unique_name("skew");
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(object_servers::create_s3_bucket(&endpoint, &bucket));
    Some(Target {
        backend: "s3",
        target: endpoint,
        namespace: bucket,
        _dir: None,
    })
}

/// Child processes, killed (by PID) if still running when dropped.
struct Children(Vec<(u32, Child)>);

impl Children {
    fn spawn(target: &Target, sync: &Path, roles: &[&str]) -> Self {
        Self::spawn_with_clock(target, sync, roles, None)
    }

    /// Like [`Children::spawn`], the children's wall clock shifted by
    /// `skew` (libfaketime's `-f` syntax, e.g. `+60s`) when given.
    fn spawn_with_clock(target: &Target, sync: &Path, roles: &[&str], skew: Option<&str>) -> Self {
        let exe = std::env::current_exe().expect("test binary");
        let children = roles
            .iter()
            .enumerate()
            .map(|(id, role)| {
                let mut command = match skew {
                    None => Command::new(&exe),
                    Some(skew) => {
                        let mut c = Command::new("faketime");
                        c.args(["-f", skew]).arg(&exe);
                        // Only the wall clock is wrong on a skewed node:
                        // timers run true, and the filesystem stamps files
                        // with its own clock (libfaketime would shift what
                        // stat() reports too).
                        c.env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
                            .env("NO_FAKE_STAT", "1");
                        c
                    }
                };
                let child = command
                    .args([
                        "--exact",
                        "child_process_entry",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env(ROLE_ENV, role)
                    .env(BACKEND_ENV, target.backend)
                    .env(TARGET_ENV, &target.target)
                    .env(NAMESPACE_ENV, &target.namespace)
                    .env(SYNC_ENV, sync)
                    .env(ID_ENV, id.to_string())
                    .stdout(Stdio::null())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .expect("spawn child");
                (id as u32, child)
            })
            .collect();
        Self(children)
    }

    /// Waits for every child to exit successfully within the deadline.
    fn wait_all(&mut self) {
        let until = Instant::now() + DEADLINE;
        for (id, child) in &mut self.0 {
            loop {
                if let Some(status) = child.try_wait().expect("wait") {
                    assert!(status.success(), "child {id} failed: {status}");
                    break;
                }
                assert!(Instant::now() < until, "child {id} still running");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    fn kill(&mut self, id: u32) {
        for (i, child) in &mut self.0 {
            if *i == id {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn wait_ready(sync: &Path, ids: std::ops::Range<usize>) {
    let until = Instant::now() + DEADLINE;
    for id in ids {
        while !sync.join(format!("ready-{id}")).exists() {
            assert!(Instant::now() < until, "child {id} never got ready");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn wait_file(path: &Path) -> String {
    let until = Instant::now() + DEADLINE;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            return text;
        }
        assert!(Instant::now() < until, "{} never appeared", path.display());
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn one_holder_per_round(target: Target) {
    let sync = tempfile::tempdir().expect("sync dir");
    let mut children = Children::spawn(&target, sync.path(), &["sections"; PROCESSES]);
    wait_ready(sync.path(), 0..PROCESSES);
    std::fs::write(sync.path().join("go"), b"").expect("go file");
    children.wait_all();

    let mut rounds: Vec<(u64, u64, String)> = Vec::new();
    for id in 0..PROCESSES {
        let text = std::fs::read_to_string(sync.path().join(format!("log-{id}"))).expect("log");
        for line in text.lines() {
            assert!(!line.starts_with("OVERLAP"), "child {id}: {line}");
            let mut parts = line.split(' ');
            let round = parts.next().and_then(|p| p.parse().ok()).expect("round");
            let fence = parts.next().and_then(|p| p.parse().ok()).expect("fence");
            let holder = parts.next().expect("holder").to_owned();
            rounds.push((round, fence, holder));
        }
    }
    rounds.sort();
    let numbers: Vec<u64> = rounds.iter().map(|r| r.0).collect();
    assert_eq!(
        numbers,
        (1..=ROUNDS).collect::<Vec<_>>(),
        "every round exactly once"
    );
    for pair in rounds.windows(2) {
        assert!(
            pair[0].1 < pair[1].1,
            "fence of round {} ({}) not above round {} ({})",
            pair[1].0,
            pair[1].1,
            pair[0].0,
            pair[0].1
        );
    }
    let holders: std::collections::BTreeSet<&str> = rounds.iter().map(|r| r.2.as_str()).collect();
    eprintln!(
        "{}: {ROUNDS} rounds across {} of {PROCESSES} processes, fences {}..={}",
        target.backend,
        holders.len(),
        rounds[0].1,
        rounds[rounds.len() - 1].1
    );
}

fn killed_holder_is_taken_over(target: Target) {
    let sync = tempfile::tempdir().expect("sync dir");
    let mut children = Children::spawn(&target, sync.path(), &["hold"]);
    wait_ready(sync.path(), 0..1);
    std::fs::write(sync.path().join("go"), b"").expect("go file");
    let held = wait_file(&sync.path().join("held"));
    children.kill(0);
    let killed_at = now_unix_ms();

    let sync2 = tempfile::tempdir().expect("sync dir");
    let mut taker = Children::spawn(&target, sync2.path(), &["take"]);
    wait_ready(sync2.path(), 0..1);
    std::fs::write(sync2.path().join("go"), b"").expect("go file");
    taker.wait_all();
    let taken = wait_file(&sync2.path().join("taken"));

    let parse = |text: &str| -> (u64, u64) {
        let mut parts = text
            .split_whitespace()
            .map(|p| p.parse::<u64>().expect("number"));
        (parts.next().expect("fence"), parts.next().expect("time"))
    };
    let (old_fence, expires_at) = parse(&held);
    let (new_fence, acquired_at) = parse(&taken);
    assert_eq!(new_fence, old_fence + 1);
    assert!(
        acquired_at >= expires_at,
        "taken over at {acquired_at}, before the dead holder's expiry {expires_at}"
    );
    eprintln!(
        "{}: holder killed {} ms before its expiry; taken over {} ms after it",
        target.backend,
        expires_at.saturating_sub(killed_at),
        acquired_at - expires_at
    );
}

/// The parent holds the lease with a keeper (right clock); a child 60 s
/// ahead tries for two TTLs and must not get it. Then the parent stops
/// renewing (as a dead holder does): the child takes the lease over once
/// its TTL has passed on the store's clock, with the next fence.
fn skewed_contender(target: Target, tolerance: Duration) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let sync = tempfile::tempdir().expect("sync dir");
    let store = runtime.block_on(open(target.backend, &target.target, &target.namespace));
    let lock = LeaseLock::new(Arc::clone(&store), LOCK);
    let keeper = runtime.block_on(async {
        let lease = lock
            .acquire("right-clock", SKEW_TTL, Duration::from_secs(30))
            .await
            .expect("acquire")
            .expect("acquired");
        LeaseKeeper::spawn(lock.clone(), lease)
    });

    let mut child = Children::spawn_with_clock(&target, sync.path(), &["skewed"], Some(SKEW));
    wait_ready(sync.path(), 0..1);
    std::fs::write(sync.path().join("go"), b"").expect("go file");
    let phase1 = wait_file(&sync.path().join("phase1"));
    assert_eq!(
        phase1.trim(),
        "busy",
        "{}: a contender 60 s ahead took a kept lease",
        target.backend
    );
    assert!(keeper.is_held(), "the keeper lost its lease");

    // The holder stops renewing.
    let last = keeper.lease();
    drop(keeper);
    let expires_at = runtime
        .block_on(lock.current())
        .expect("read")
        .expect("record");
    assert_eq!(expires_at.fence, last.fence);
    std::fs::write(sync.path().join("stopped"), b"").expect("stopped file");
    let taken = wait_file(&sync.path().join("taken"));
    let seen_at = runtime.block_on(lock.store_now()).expect("store time");
    child.wait_all();
    let fence: u64 = taken.trim().parse().expect("fence");
    assert_eq!(fence, last.fence + 1);
    let tolerance = u64::try_from(tolerance.as_millis()).unwrap_or(u64::MAX);
    assert!(
        seen_at + tolerance >= expires_at.expires_at_unix_ms,
        "{}: taken over at {seen_at} (store clock), before the expiry {}",
        target.backend,
        expires_at.expires_at_unix_ms
    );
    eprintln!(
        "{}: a contender 60 s ahead took the lease {} ms after its expiry",
        target.backend,
        seen_at.saturating_sub(expires_at.expires_at_unix_ms)
    );
}

#[test]
fn file_skewed_contender_waits_for_the_expiry() {
    skewed_contender(file_target(), Duration::from_millis(100));
}

#[test]
fn redis_skewed_contender_waits_for_the_expiry() {
    if let Some(target) = redis_target() {
        skewed_contender(target, Duration::from_millis(100));
    }
}

/// On S3 each process knows the server's clock to about a second
/// (`Last-Modified` has whole seconds), hence the wider tolerance.
#[test]
fn s3_skewed_contender_waits_for_the_expiry() {
    if let Some(target) = s3_target() {
        skewed_contender(target, Duration::from_millis(1_500));
    }
}

#[test]
fn file_one_holder_per_round_across_processes() {
    one_holder_per_round(file_target());
}

#[test]
fn redis_one_holder_per_round_across_processes() {
    if let Some(target) = redis_target() {
        one_holder_per_round(target);
    }
}

#[test]
fn file_killed_holder_is_taken_over_after_its_ttl() {
    killed_holder_is_taken_over(file_target());
}

#[test]
fn redis_killed_holder_is_taken_over_after_its_ttl() {
    if let Some(target) = redis_target() {
        killed_holder_is_taken_over(target);
    }
}
