//! Handing certificates to the running proxy: the restart coordinator
//! against real processes (a copy of `sleep` under a chosen name, so its
//! `/proc/<pid>/comm` is that name), a real health endpoint and the lease
//! in a shared store; and the `--watch-tls` watcher against a kubelet-style
//! Secret mount.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use sbmesh::internal::proxy::{
    ProxyStatus, RESTART_LEASE, RestartConfig, RestartCoordinator, TlsWatcher, WatchTlsConfig,
    restart_lease,
};
use sbmesh::{MemoryStore, Metrics, Store};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;

const DEADLINE: Duration = Duration::from_secs(30);

/// A process name unique to this test run (at most 15 bytes).
fn unique(tag: &str) -> String {
    format!("sbpx{}{tag}", std::process::id() % 1_000_000)
}

/// A child process, waited for by a plain thread (not the runtime's child
/// reaper), SIGTERMed when dropped unexited.
struct Proc {
    pid: u32,
    done: Arc<OnceLock<(ExitStatus, Instant)>>,
}

impl Proc {
    fn start(exe: &Path) -> std::io::Result<Self> {
        let mut child = std::process::Command::new(exe).arg("3600").spawn()?;
        let pid = child.id();
        let done = Arc::new(OnceLock::new());
        let set = done.clone();
        std::thread::spawn(move || {
            if let Ok(status) = child.wait() {
                let _ = set.set((status, Instant::now()));
            }
        });
        Ok(Self { pid, done })
    }

    fn is_finished(&self) -> bool {
        self.done.get().is_some()
    }

    /// Its exit status and time, once it exited within `within`.
    async fn exit_within(&self, within: Duration) -> Option<(ExitStatus, Instant)> {
        let start = Instant::now();
        loop {
            if let Some(done) = self.done.get() {
                return Some(*done);
            }
            if start.elapsed() > within {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn exited(&self) -> (ExitStatus, Instant) {
        match self.exit_within(DEADLINE).await {
            Some(done) => done,
            None => panic!("process {} did not exit", self.pid),
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if !self.is_finished() {
            let _ = sbmesh::internal::proxy::terminate(self.pid);
        }
    }
}

/// Waits until the kernel shows the process under its new name: a parent
/// may resume from its vfork before the exec has set the child's comm.
async fn named(proc: &Proc, name: &str) {
    let comm = PathBuf::from(format!("/proc/{}/comm", proc.pid));
    let start = Instant::now();
    while !std::fs::read_to_string(&comm).is_ok_and(|c| c.trim_end() == name) {
        assert!(
            start.elapsed() < DEADLINE,
            "process {} never showed as {name}",
            proc.pid
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs `sleep 3600` under the executable name `name`.
async fn fake_proxy(dir: &Path, name: &str) -> Proc {
    let exe = dir.join(name);
    std::fs::copy("/bin/sleep", &exe).expect("copy /bin/sleep");
    // A file just written may still be open for writing in a child forked
    // meanwhile by another test thread (ETXTBSY): try again.
    for _ in 0..50 {
        match Proc::start(&exe) {
            Ok(proc) => {
                named(&proc, name).await;
                return proc;
            }
            Err(e) if e.raw_os_error() == Some(26) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("spawn {}: {e}", exe.display()),
        }
    }
    panic!("spawn {}: text file busy", exe.display());
}

/// A health endpoint answering every request with the status in `code`.
async fn health_server(code: Arc<AtomicU16>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let code = code.load(Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                let _ = conn.read(&mut buf).await;
                let answer =
                    format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = conn.write_all(answer.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    format!("http://{addr}/health")
}

fn config(node: &str, name: &str, health_url: &str) -> RestartConfig {
    RestartConfig {
        probe_interval: Duration::from_millis(50),
        probe_timeout: Duration::from_millis(500),
        lease_ttl: Duration::from_secs(5),
        ..RestartConfig::new(node, name, health_url)
    }
}

async fn wait_status(
    rx: &mut watch::Receiver<ProxyStatus>,
    what: &str,
    f: impl FnMut(&ProxyStatus) -> bool,
) -> ProxyStatus {
    let found = match tokio::time::timeout(DEADLINE, rx.wait_for(f)).await {
        Ok(Ok(status)) => Some(status.clone()),
        _ => None,
    };
    found.unwrap_or_else(|| panic!("timed out waiting for {what}; status {:?}", *rx.borrow()))
}

/// Waits until another holder can take the restart lease.
async fn lease_free(store: &Arc<dyn Store>) {
    let lock = restart_lease(store.clone());
    let start = Instant::now();
    loop {
        if let Some(lease) = lock
            .try_acquire("someone-else", Duration::from_secs(5))
            .await
            .expect("store")
        {
            lock.release(&lease).await.expect("release");
            return;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "the restart lease was not released: {:?}",
            lock.current().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_terminates_the_proxy_waits_for_health_and_releases_the_lease() {
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("a");
    let exit = fake_proxy(tmp.path(), &name).await;
    let health = health_server(Arc::new(AtomicU16::new(200))).await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let metrics = Arc::new(Metrics::new());
    let coordinator = RestartCoordinator::spawn(
        config("node-a", &name, &health),
        store.clone(),
        metrics.clone(),
    )
    .unwrap();
    let mut status = coordinator.status();
    assert_eq!(*status.borrow(), ProxyStatus::default());

    let before = sbmesh::now_unix_ms();
    (coordinator.requester())();
    let (exit, _) = exit.exited().await;
    assert_eq!(exit.signal(), Some(15), "the proxy got SIGTERM: {exit:?}");

    let shown = wait_status(&mut status, "one restart", |s| s.restarts == 1).await;
    assert!(shown.last_restart_unix_ms.unwrap() >= before);
    assert_eq!(shown.problem, None);
    assert_eq!(shown.info().restarts, 1);
    lease_free(&store).await;
    let record = restart_lease(store.clone())
        .current()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(RESTART_LEASE, "proxy-restart");
    assert!(record.released);
    assert!(
        metrics
            .encode()
            .contains("sbmesh_proxy_restarts_total{reason=\"certificate\"} 1"),
        "{}",
        metrics.encode()
    );
    assert!(
        metrics
            .encode()
            .contains("store_lock_acquired_total{backend=\"memory\"} 1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_proxy_is_reported_and_the_lease_released() {
    let name = unique("gone");
    let health = health_server(Arc::new(AtomicU16::new(200))).await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let metrics = Arc::new(Metrics::new());
    let coordinator = RestartCoordinator::spawn(
        RestartConfig {
            starting_grace: Duration::ZERO,
            ..config("node-b", &name, &health)
        },
        store.clone(),
        metrics.clone(),
    )
    .unwrap();
    let mut status = coordinator.status();
    coordinator.request();
    let shown = wait_status(&mut status, "a problem", |s| s.problem.is_some()).await;
    let problem = shown.problem.unwrap();
    assert!(
        problem.contains(&format!("proxy process {name} not found in /proc"))
            && problem.contains("shareProcessNamespace: true"),
        "{problem}"
    );
    assert_eq!(shown.restarts, 0);
    lease_free(&store).await;
    assert!(
        metrics
            .encode()
            .contains("sbmesh_proxy_restarts_total{reason=\"certificate\"} 0")
    );
    // The readiness check carries the problem.
    let check = sbmesh::internal::proxy::restart_readiness(coordinator.status());
    assert!(check().unwrap().contains("not found"));
}

/// While the pod starts, the proxy may not run yet when the certificate
/// is written (the startup probe holds it back): it reads the files when
/// it starts, so nothing is restarted and nothing is reported; a proxy
/// started before the next files is restarted for them. (A proxy replaced
/// after the files: the next test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_proxy_yet_needs_no_restart_and_one_started_before_new_files_does() {
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("late");
    let health = health_server(Arc::new(AtomicU16::new(200))).await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let metrics = Arc::new(Metrics::new());
    let coordinator = RestartCoordinator::spawn(
        config("node-c", &name, &health),
        store.clone(),
        metrics.clone(),
    )
    .unwrap();
    let status = coordinator.status();
    // No proxy runs yet: the request needs no restart, and is found out
    // before the fleet lease (the other pods' turns are not held up).
    coordinator.request();
    lease_free(&store).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        *status.borrow(),
        ProxyStatus::default(),
        "no restart, no problem"
    );
    // Leases this coordinator took (no sample before the first).
    let leases = || {
        metrics
            .encode()
            .lines()
            .find_map(|l| l.strip_prefix("store_lock_acquired_total{backend=\"memory\"} "))
            .map_or(0, |n| n.parse::<u64>().expect("a count"))
    };
    assert_eq!(leases(), 0, "the lease was taken");
    // A proxy started now, then new files: it ran before them, so it is
    // restarted (the window of one restart per interval is its own).
    let exit = fake_proxy(tmp.path(), &name).await;
    let mut status = coordinator.status();
    coordinator.request();
    let shown = wait_status(&mut status, "one restart", |s| s.restarts == 1).await;
    assert_eq!(shown.problem, None);
    assert_eq!(leases(), 1, "one lease, for the restart");
    drop(exit);
}

/// A proxy that ran when new files were written, and was replaced by one
/// that started after them (the kubelet restarted it) while this pod waited
/// for its turn: the new process read the files at its start, so it is not
/// signalled and no restart is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_replaced_after_the_files_while_waiting_is_not_restarted() {
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("repl");
    let health = health_server(Arc::new(AtomicU16::new(200))).await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let metrics = Arc::new(Metrics::new());
    let old = fake_proxy(tmp.path(), &name).await;
    // Another pod's turn: this one waits for the restart lease.
    let other = restart_lease(store.clone());
    let held = other
        .try_acquire("someone-else", Duration::from_secs(30))
        .await
        .expect("store")
        .expect("the restart lease is free");
    let coordinator = RestartCoordinator::spawn(
        config("node-r", &name, &health),
        store.clone(),
        metrics.clone(),
    )
    .unwrap();
    let status = coordinator.status();
    coordinator.request();
    // The request is noted at once (the proxy running now read the old
    // files); then the proxy is replaced while the turn is someone else's.
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(old);
    // Its own copy of the executable: the old one may still be running
    // from the first (ETXTBSY on writing over it).
    let dir = tmp.path().join("new");
    std::fs::create_dir(&dir).expect("mkdir");
    let new = fake_proxy(&dir, &name).await;
    other.release(&held).await.expect("release");
    // This pod's turn: it takes the lease, finds only the new process, and
    // lets the lease go.
    let start = Instant::now();
    loop {
        let record = other.current().await.expect("store");
        if record
            .as_ref()
            .is_some_and(|r| r.holder == "node-r" && r.released)
        {
            break;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "node-r never took and released the restart lease: {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        new.exit_within(Duration::from_millis(500)).await.is_none(),
        "the proxy started after the files was signalled"
    );
    assert_eq!(
        *status.borrow(),
        ProxyStatus::default(),
        "no restart, no problem"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_never_restart_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let metrics = Arc::new(Metrics::new());
    let mut pods = Vec::new();
    for (node, tag) in [("pod-0", "c0"), ("pod-1", "c1")] {
        let name = unique(tag);
        let exit = fake_proxy(tmp.path(), &name).await;
        // Down until the test says the restarted proxy is up.
        let code = Arc::new(AtomicU16::new(503));
        let health = health_server(code.clone()).await;
        let coordinator =
            RestartCoordinator::spawn(config(node, &name, &health), store.clone(), metrics.clone())
                .unwrap();
        pods.push((node, exit, code, coordinator));
    }
    for (_, _, _, c) in &pods {
        c.request();
    }
    // Whichever took the lease signals first.
    let first = tokio::time::timeout(DEADLINE, async {
        loop {
            if let Some(i) = pods.iter().position(|p| p.1.is_finished()) {
                return i;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("one proxy is restarted");
    let second = 1 - first;
    let lock = restart_lease(store.clone());
    let record = lock.current().await.unwrap().unwrap();
    assert_eq!(record.holder, pods[first].0);
    assert!(!record.released);
    // While the first proxy is not back, the second is left alone.
    let watch_until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < watch_until {
        assert!(
            !pods[second].1.is_finished(),
            "the second proxy was restarted while the first was down"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let up_at = Instant::now();
    pods[first].2.store(200, Ordering::SeqCst);
    pods[second].2.store(200, Ordering::SeqCst);

    let (_, exit_second, _, c_second) = pods.remove(second);
    let Some(exited) = exit_second.exit_within(DEADLINE).await else {
        panic!(
            "the second proxy was not restarted; lease {:?}, first {:?}, second {:?}",
            lock.current().await,
            *pods[0].3.status().borrow(),
            *c_second.status().borrow()
        );
    };
    let (status, at) = exited;
    assert_eq!(status.signal(), Some(15));
    assert!(at >= up_at);
    let mut s = c_second.status();
    wait_status(&mut s, "second restart", |s| s.restarts == 1).await;
    let (_, exit_first, _, c_first) = pods.remove(0);
    assert_eq!(exit_first.exited().await.0.signal(), Some(15));
    assert_eq!(c_first.status().borrow().restarts, 1);
    lease_free(&store).await;
    let record = lock.current().await.unwrap().unwrap();
    assert!(record.fence >= 2, "{record:?}");
    assert!(
        metrics
            .encode()
            .contains("sbmesh_proxy_restarts_total{reason=\"certificate\"} 2")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_process_of_the_name_is_signalled() {
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("m");
    let first = fake_proxy(tmp.path(), &name).await;
    let exe = tmp.path().join(&name);
    let second = Proc::start(&exe).unwrap();
    named(&second, &name).await;
    let health = health_server(Arc::new(AtomicU16::new(200))).await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let coordinator = RestartCoordinator::spawn(
        config("node-m", &name, &health),
        store.clone(),
        Arc::new(Metrics::new()),
    )
    .unwrap();
    coordinator.request();
    for exit in [&first, &second] {
        let (status, _) = exit.exited().await;
        assert_eq!(status.signal(), Some(15));
    }
    let mut status = coordinator.status();
    let shown = wait_status(&mut status, "one restart", |s| s.restarts == 1).await;
    assert_eq!(shown.problem, None);
    lease_free(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_does_not_come_back_is_reported_and_frees_the_lease() {
    let tmp = tempfile::tempdir().unwrap();
    let name = unique("d");
    let exit = fake_proxy(tmp.path(), &name).await;
    let code = Arc::new(AtomicU16::new(503));
    let health = health_server(code.clone()).await;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let metrics = Arc::new(Metrics::new());
    let failing = |value: u8| {
        metrics
            .encode()
            .contains(&format!("\nsbmesh_proxy_restart_failing {value}\n"))
    };
    let coordinator = RestartCoordinator::spawn(
        RestartConfig {
            give_up_after: Duration::from_secs(1),
            ..config("node-d", &name, &health)
        },
        store.clone(),
        metrics.clone(),
    )
    .unwrap();
    assert!(failing(0), "{}", metrics.encode());
    coordinator.request();
    let (status, _) = exit.exited().await;
    assert_eq!(status.signal(), Some(15));
    let mut status = coordinator.status();
    let shown = wait_status(&mut status, "the give-up", |s| s.problem.is_some()).await;
    assert_eq!(shown.restarts, 1);
    assert!(
        shown
            .problem
            .as_deref()
            .unwrap()
            .contains("did not answer 200"),
        "{shown:?}"
    );
    // The metric an alert watches says so while the problem stands.
    assert!(failing(1), "{}", metrics.encode());
    lease_free(&store).await;
    // The proxy answering again clears the problem.
    code.store(200, Ordering::SeqCst);
    wait_status(&mut status, "recovery", |s| s.problem.is_none()).await;
    assert!(failing(0), "{}", metrics.encode());
}

/// A `kubernetes.io/tls` Secret mount as the kubelet keeps it.
struct SecretMount {
    dir: PathBuf,
    generation: usize,
}

impl SecretMount {
    fn new(dir: &Path, cert: &str, key: &str) -> Self {
        let mut m = Self {
            dir: dir.to_path_buf(),
            generation: 0,
        };
        m.publish(cert, key);
        for file in ["tls.crt", "tls.key"] {
            std::os::unix::fs::symlink(format!("..data/{file}"), dir.join(file)).unwrap();
        }
        m
    }

    /// Writes a new timestamped directory and renames `..data` over.
    fn publish(&mut self, cert: &str, key: &str) {
        self.generation += 1;
        let name = format!("..2026_12_01_09_00_{:02}.{:06}", self.generation, 42);
        let data = self.dir.join(&name);
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("tls.crt"), cert).unwrap();
        std::fs::write(data.join("tls.key"), key).unwrap();
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&name, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
    }
}

fn pair(host: &str) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec![host.to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    (cert.pem(), key.serialize_pem())
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_tls_applies_valid_renewals_only() {
    let tmp = tempfile::tempdir().unwrap();
    let (cert1, key1) = pair("a.test");
    let mut mount = SecretMount::new(tmp.path(), &cert1, &key1);
    let applied = Arc::new(AtomicUsize::new(0));
    let metrics = Arc::new(Metrics::new());
    let watcher = TlsWatcher::spawn(
        WatchTlsConfig {
            // Long: inotify must carry these changes.
            rescan: Duration::from_secs(3600),
            debounce: Duration::from_millis(50),
            ..WatchTlsConfig::new(tmp.path())
        },
        {
            let applied = applied.clone();
            Arc::new(move || {
                applied.fetch_add(1, Ordering::SeqCst);
            })
        },
        metrics.clone(),
    );
    let mut problem = watcher.problem();
    assert_eq!(*problem.borrow(), None);
    assert_eq!(
        applied.load(Ordering::SeqCst),
        0,
        "the start pair is not applied"
    );

    // A renewal: applied once.
    let (cert2, key2) = pair("a.test");
    mount.publish(&cert2, &key2);
    until("the renewal is applied", || {
        applied.load(Ordering::SeqCst) == 1
    })
    .await;

    // A pair whose key belongs to another certificate: never applied.
    let (cert3, _) = pair("a.test");
    let (_, other_key) = pair("b.test");
    mount.publish(&cert3, &other_key);
    let shown = tokio::time::timeout(DEADLINE, problem.wait_for(Option::is_some))
        .await
        .expect("the mismatch is reported")
        .unwrap()
        .clone()
        .unwrap();
    assert!(
        shown.contains(&tmp.path().display().to_string()) && shown.contains("mismatch"),
        "{shown}"
    );
    assert!(
        metrics
            .encode()
            .contains("sbmesh_watch_tls_rejected_total{reason=\"mismatch\"} 1")
    );
    assert_eq!(applied.load(Ordering::SeqCst), 1);
    let check = sbmesh::internal::proxy::watch_tls_readiness(vec![watcher.problem()]);
    assert!(check().unwrap().contains("mismatch"));

    // A valid pair clears the problem and is applied.
    let (cert4, key4) = pair("a.test");
    mount.publish(&cert4, &key4);
    tokio::time::timeout(DEADLINE, problem.wait_for(Option::is_none))
        .await
        .expect("the problem clears")
        .unwrap();
    until("the next renewal is applied", || {
        applied.load(Ordering::SeqCst) == 2
    })
    .await;
    assert_eq!(check(), None);
}
