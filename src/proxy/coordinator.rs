//! The shell around [`RestartCore`]: the fleet lease in the shared store,
//! `/proc`, SIGTERM and the health probe.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Empty;
use hyper::{Request, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use super::procs;
use super::restart::{Probe, RestartCore, SignalOutcome, Step};
use crate::http::ReadinessCheck;
use crate::mesh::meta::ProxyInfo;
use crate::metrics::Metrics;
use crate::store::lock::{LeaseKeeper, LeaseLock};
use crate::store::{Store, now_unix_ms};

/// Name of the fleet-wide restart lease (`locks/proxy-restart`).
pub const RESTART_LEASE: &str = "proxy-restart";

/// The fleet-wide restart lease in `store`.
pub fn restart_lease(store: Arc<dyn Store>) -> LeaseLock {
    LeaseLock::new(store, RESTART_LEASE)
}

/// How long one lease acquisition waits before the loop looks again (the
/// wait itself is unbounded: the pod restarts when its turn comes).
const LEASE_WAIT: Duration = Duration::from_secs(30);

/// Settings of the restart coordinator.
#[derive(Clone, Debug)]
pub struct RestartConfig {
    /// This node's id: the lease holder.
    pub node_id: String,
    /// The proxy's `/proc/<pid>/comm` (`--proxy-process-name`).
    pub process_name: String,
    /// What must answer 200 before a restarted proxy counts as back
    /// (`--proxy-health-url`, plain `http://`).
    pub health_url: String,
    /// At most one restart per this (10 minutes).
    pub min_interval: Duration,
    /// A proxy not back after this is reported unhealthy (5 minutes).
    pub give_up_after: Duration,
    /// TTL of the lease, renewed while waiting (60 s).
    pub lease_ttl: Duration,
    /// Pause between health probes (500 ms).
    pub probe_interval: Duration,
    /// Budget of one health probe (2 s).
    pub probe_timeout: Duration,
    /// Where processes are listed (`/proc`).
    pub proc_root: PathBuf,
    /// While the pod starts (60 s), finding no proxy process needs no
    /// restart: it reads the files when it starts (the sidecar's startup
    /// probe holds it back until they are written). Later it is reported.
    pub starting_grace: Duration,
}

impl RestartConfig {
    /// The defaults (docs/reference.md#sidecar-flags) for a node, a process name and a health URL.
    pub fn new(node_id: &str, process_name: &str, health_url: &str) -> Self {
        Self {
            node_id: node_id.to_owned(),
            process_name: process_name.to_owned(),
            health_url: health_url.to_owned(),
            min_interval: crate::flags::DEFAULT_PROXY_RESTART_INTERVAL,
            give_up_after: Duration::from_secs(300),
            lease_ttl: Duration::from_secs(60),
            probe_interval: Duration::from_millis(500),
            probe_timeout: Duration::from_secs(2),
            proc_root: PathBuf::from("/proc"),
            starting_grace: Duration::from_secs(60),
        }
    }
}

/// What the coordinator shows: status (`nodes[].proxy`) and `/readyz`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyStatus {
    /// Restarts signalled since start.
    pub restarts: u64,
    /// When the last one was signalled, unix ms.
    pub last_restart_unix_ms: Option<u64>,
    /// Why the proxy is not known to be fine: not found, not back in time.
    pub problem: Option<String>,
}

impl ProxyStatus {
    /// The part that goes into node metadata.
    pub fn info(&self) -> ProxyInfo {
        ProxyInfo {
            restarts: self.restarts,
            last_restart_unix_ms: self.last_restart_unix_ms,
        }
    }
}

/// A readiness check failing while `status` carries a problem.
pub fn restart_readiness(status: watch::Receiver<ProxyStatus>) -> ReadinessCheck {
    Arc::new(move || {
        status
            .borrow()
            .problem
            .as_ref()
            .map(|p| format!("proxy restart: {p}"))
    })
}

/// Why the coordinator cannot start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RestartError {
    /// The health URL is not a plain `http://host[:port]/path`.
    #[error("invalid proxy health URL {url:?}: {reason}")]
    InvalidHealthUrl {
        /// The URL.
        url: String,
        /// What is wrong.
        reason: String,
    },
}

struct Requests {
    pending: AtomicBool,
    notify: Notify,
}

/// The running coordinator; stops when dropped (a lease still held then
/// expires after its TTL).
#[derive(Debug)]
pub struct RestartCoordinator {
    requests: Arc<Requests>,
    /// For tests; the node reads the channel it made itself.
    status: watch::Receiver<ProxyStatus>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for Requests {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Requests")
            .field("pending", &self.pending.load(Ordering::Relaxed))
            .finish()
    }
}

impl RestartCoordinator {
    /// Starts the coordinator: restarts the proxy after each
    /// [`RestartCoordinator::request`], as docs/reference.md#certificate-files says.
    pub fn spawn(
        cfg: RestartConfig,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, RestartError> {
        Self::spawn_into(
            cfg,
            store,
            metrics,
            watch::channel(ProxyStatus::default()).0,
        )
    }

    /// As [`RestartCoordinator::spawn`], publishing the status into `tx`
    /// (a channel its caller already hands out, e.g. to node metadata and
    /// `/readyz`).
    pub(crate) fn spawn_into(
        cfg: RestartConfig,
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
        tx: watch::Sender<ProxyStatus>,
    ) -> Result<Self, RestartError> {
        let health = HealthProbe::new(&cfg.health_url, cfg.probe_timeout)?;
        let requests = Arc::new(Requests {
            pending: AtomicBool::new(false),
            notify: Notify::new(),
        });
        let status = tx.subscribe();
        let lock = restart_lease(store).with_metrics(Arc::clone(&metrics));
        let shell = Shell {
            core: RestartCore::new(cfg.min_interval, cfg.give_up_after, &cfg.health_url),
            cfg,
            lock,
            metrics,
            health,
            requests: Arc::clone(&requests),
            status: tx,
            keeper: None,
            signalled: Vec::new(),
            stale: BTreeSet::new(),
            started: Instant::now(),
        };
        let task = tokio::spawn(shell.run());
        Ok(Self {
            requests,
            status,
            task,
        })
    }

    /// New certificate files were written: restart the proxy (when the
    /// rate limit and the fleet lease allow).
    pub fn request(&self) {
        self.requests.request();
    }

    /// [`RestartCoordinator::request`] as the callback the ACME manager and
    /// the `--watch-tls` watcher take.
    pub fn requester(&self) -> Arc<dyn Fn() + Send + Sync> {
        let requests = Arc::clone(&self.requests);
        Arc::new(move || requests.request())
    }

    /// The coordinator's status.
    pub fn status(&self) -> watch::Receiver<ProxyStatus> {
        self.status.clone()
    }
}

impl Requests {
    fn request(&self) {
        self.pending.store(true, Ordering::SeqCst);
        self.notify.notify_one();
    }
}

impl Drop for RestartCoordinator {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a restart would signal, by [`Shell::targets`].
enum Targets {
    /// These pids ran when new files were written.
    Signal(Vec<u32>),
    /// Nothing: the running proxy read the new files, or will.
    NotNeeded(String),
    /// Nothing can be signalled, and that is a problem (for status).
    Missing(String),
}

struct Shell {
    core: RestartCore,
    cfg: RestartConfig,
    lock: LeaseLock,
    metrics: Arc<Metrics>,
    health: HealthProbe,
    requests: Arc<Requests>,
    status: watch::Sender<ProxyStatus>,
    keeper: Option<LeaseKeeper>,
    /// The pids the last restart signalled.
    signalled: Vec<u32>,
    /// The proxy processes (pid, start) that ran when new files were
    /// written since the last restart: only these need one.
    stale: BTreeSet<(u32, u64)>,
    /// When the shell started.
    started: Instant,
}

impl Shell {
    async fn run(mut self) {
        loop {
            if self.requests.pending.swap(false, Ordering::SeqCst) {
                self.note_running();
                self.core.request();
            }
            self.publish();
            let now = now_unix_ms();
            match self.core.next(now) {
                Step::Idle => self.requests.notify.notified().await,
                Step::WaitUntil(at) => {
                    let pause = Duration::from_millis(at.saturating_sub(now));
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = self.requests.notify.notified() => {}
                    }
                }
                // Decided before the fleet lease: a restart nobody needs
                // must not wait for (or hold up) the other pods' turns.
                Step::AcquireLease => match self.targets() {
                    Targets::NotNeeded(why) => {
                        self.not_needed(&why);
                        self.core.not_needed();
                    }
                    _ => self.acquire().await,
                },
                Step::Signal => {
                    let outcome = self.signal();
                    if outcome == SignalOutcome::Signalled {
                        self.metrics.proxy.restarted_for_certificate();
                    }
                    self.core.signalled(now_unix_ms(), outcome);
                }
                Step::Probe => {
                    tokio::time::sleep(self.cfg.probe_interval).await;
                    let healthy = self.health.healthy().await;
                    let signalled_gone = !procs::any_running(
                        &self.cfg.proc_root,
                        &self.signalled,
                        &self.cfg.process_name,
                    );
                    self.core.probed(Probe {
                        healthy,
                        signalled_gone,
                    });
                }
                Step::ReleaseLease => {
                    self.release().await;
                    self.core.released();
                }
            }
        }
    }

    fn publish(&self) {
        let next = ProxyStatus {
            restarts: self.core.restarts(),
            last_restart_unix_ms: self.core.last_restart_unix_ms(),
            problem: self.core.problem().map(str::to_owned),
        };
        self.metrics
            .proxy
            .restart_failing
            .set(i64::from(next.problem.is_some()));
        self.status.send_if_modified(|current| {
            let changed = *current != next;
            if changed {
                *current = next;
            }
            changed
        });
    }

    async fn acquire(&mut self) {
        let holder = &self.cfg.node_id;
        match self
            .lock
            .acquire(holder, self.cfg.lease_ttl, LEASE_WAIT)
            .await
        {
            Ok(Some(lease)) => {
                tracing::debug!(
                    lock = RESTART_LEASE,
                    fence = lease.fence,
                    "restart lease taken"
                );
                self.keeper = Some(LeaseKeeper::spawn(self.lock.clone(), lease));
                self.core.lease_acquired();
            }
            Ok(None) => {
                tracing::info!(
                    lock = RESTART_LEASE,
                    "another pod is restarting its proxy; waiting for the restart lease"
                );
            }
            Err(e) => {
                tracing::warn!(lock = RESTART_LEASE, error = %e, "cannot take the restart lease; retrying");
                self.core.lease_failed(now_unix_ms());
            }
        }
    }

    /// The proxy processes running now, as (pid, start).
    fn running(&self) -> std::io::Result<Vec<(u32, u64)>> {
        let root = &self.cfg.proc_root;
        let pids = procs::find_by_name(root, &self.cfg.process_name)?;
        Ok(pids
            .into_iter()
            .filter_map(|pid| Some((pid, procs::start_ticks(root, pid)?)))
            .collect())
    }

    /// New files were written: the proxy processes running now read the
    /// old ones and need a restart; one started later will not.
    fn note_running(&mut self) {
        if let Ok(running) = self.running() {
            self.stale.extend(running);
        }
    }

    /// Which proxy processes a restart must signal: those that ran when
    /// new files were written. None when every one running started since
    /// (it read them), or none runs yet while the pod starts.
    fn targets(&self) -> Targets {
        let name = &self.cfg.process_name;
        let root = &self.cfg.proc_root;
        let running = match self.running() {
            Ok(running) => running,
            Err(e) => {
                return Targets::Missing(format!(
                    "cannot list processes in {}: {e}",
                    root.display()
                ));
            }
        };
        // While the pod starts the proxy may not run yet; later, finding
        // none means the process name or shareProcessNamespace is wrong.
        let starting = self.started.elapsed() < self.cfg.starting_grace;
        if running.is_empty() && (!self.stale.is_empty() || starting) {
            return Targets::NotNeeded(format!(
                "no proxy process {name} runs now; it reads the new files when it starts"
            ));
        }
        if running.is_empty() {
            return Targets::Missing(format!(
                "proxy process {name} not found in {} (is shareProcessNamespace: true set?)",
                root.display()
            ));
        }
        let pids: Vec<u32> = running
            .iter()
            .filter(|p| self.stale.contains(p))
            .map(|(pid, _)| *pid)
            .collect();
        if pids.is_empty() {
            return Targets::NotNeeded(format!(
                "every proxy process {name} started after the new files were written"
            ));
        }
        Targets::Signal(pids)
    }

    /// Files written, no restart needed: what was noted is served.
    fn not_needed(&mut self, why: &str) {
        self.stale.clear();
        tracing::info!("new certificate: no proxy restart needed: {why}");
    }

    /// SIGTERM to the [`Shell::targets`].
    fn signal(&mut self) -> SignalOutcome {
        let name = &self.cfg.process_name;
        self.signalled.clear();
        let pids = match self.targets() {
            Targets::Signal(pids) => pids,
            Targets::NotNeeded(why) => {
                self.not_needed(&why);
                return SignalOutcome::NotNeeded(why);
            }
            Targets::Missing(why) => {
                tracing::warn!("{why}; the new certificate is not served until the proxy restarts");
                return SignalOutcome::NotSignalled(why);
            }
        };
        if pids.len() > 1 {
            tracing::warn!(process = %name, ?pids, "more than one proxy process found; signalling all of them");
        }
        let mut failures = Vec::new();
        for pid in pids {
            match procs::terminate(pid) {
                Ok(()) => self.signalled.push(pid),
                // Exited between the scan and the signal.
                Err(e) if e.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error()) => {}
                Err(e) => failures.push(format!("pid {pid}: {e}")),
            }
        }
        if self.signalled.is_empty() {
            let why = if failures.is_empty() {
                format!("proxy process {name} exited before it could be signalled")
            } else {
                format!(
                    "cannot signal proxy process {name}: {}",
                    failures.join(", ")
                )
            };
            tracing::warn!("{why}");
            return SignalOutcome::NotSignalled(why);
        }
        // Signalled: what was noted is served by this restart.
        self.stale.clear();
        if !failures.is_empty() {
            tracing::warn!(process = %name, failures = %failures.join(", "), "some proxy processes could not be signalled");
        }
        tracing::info!(process = %name, pids = ?self.signalled, "new certificate: SIGTERM sent to the proxy; waiting for its health check");
        SignalOutcome::Signalled
    }

    async fn release(&mut self) {
        let Some(keeper) = self.keeper.take() else {
            return;
        };
        match keeper.release().await {
            Ok(true) => tracing::debug!(lock = RESTART_LEASE, "restart lease released"),
            Ok(false) => {
                tracing::warn!(
                    lock = RESTART_LEASE,
                    "the restart lease was lost before its release"
                )
            }
            Err(e) => {
                tracing::warn!(lock = RESTART_LEASE, error = %e, "cannot release the restart lease; it expires by itself")
            }
        }
    }
}

/// GETs the health URL: healthy only on `200`.
struct HealthProbe {
    client: Client<HttpConnector, Empty<Bytes>>,
    url: Uri,
    timeout: Duration,
}

impl HealthProbe {
    fn new(url: &str, timeout: Duration) -> Result<Self, RestartError> {
        let invalid = |reason: String| RestartError::InvalidHealthUrl {
            url: url.to_owned(),
            reason,
        };
        let parsed: Uri = url.parse().map_err(|e| invalid(format!("{e}")))?;
        if parsed.scheme_str() != Some("http") || parsed.host().is_none() {
            return Err(invalid("expected http://host:port/path".into()));
        }
        // No pooled connections: one kept alive to the draining process
        // would answer for the old proxy.
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build_http();
        Ok(Self {
            client,
            url: parsed,
            timeout,
        })
    }

    async fn healthy(&self) -> bool {
        let Ok(request) = Request::get(self.url.clone()).body(Empty::new()) else {
            return false;
        };
        match tokio::time::timeout(self.timeout, self.client.request(request)).await {
            Ok(Ok(response)) => response.status() == StatusCode::OK,
            _ => false,
        }
    }
}
