//! Hot reload (docs/reference.md#hot-reload): notice every change of the proxy's config
//! file, validate it, and POST the proxy's reload URL once per distinct
//! content, never for an invalid file, never two at a time.
//!
//! Three parts, one way: `watcher` (inotify on the directory + rescan,
//! debounce, read, hash, validate) → `machine` (the pure, clock-injected
//! single-flight state machine) → `post` (the HTTP POST). [`Reloader`]
//! wires them in a task, records the `reloader_*` metrics and publishes a
//! [`ReloadStatus`] for the node metadata.
//!
//! ```no_run
//! use std::sync::Arc;
//! use sbmesh::{Metrics, Reloader, ReloaderConfig};
//!
//! # async fn demo() -> Result<(), sbmesh::ReloadError> {
//! let handle = Reloader::spawn(
//!     ReloaderConfig::new("/etc/sbproxy/sb.yml", "http://127.0.0.1:9090/admin/reload"),
//!     Arc::new(Metrics::new()),
//! )?;
//! let mut status = handle.status();
//! status.changed().await.ok();
//! println!("proxy runs {:?}", status.borrow().delivered_hash);
//! handle.certificates_changed(); // after new certificate files were written
//! # Ok(())
//! # }
//! ```

pub(crate) mod machine;
pub(crate) mod post;
pub(crate) mod watcher;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::SbConfig;
use crate::flags::{DEFAULT_DEBOUNCE, DEFAULT_RESCAN};
use crate::mesh::LastReload;
use crate::metrics::Metrics;
use machine::{Action, Input, Machine, Report};
use post::Poster;

/// Default time allowed for one reload POST.
pub(crate) const DEFAULT_POST_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a reloader could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReloadError {
    /// The reload URL is not an `http://` URL.
    #[error("--proxy-reload-url {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The Authorization value cannot be sent as a header.
    #[error(
        "--proxy-authorization: not a valid header value (visible ASCII only, e.g. \"Basic dXNlcjpwYXNz\")"
    )]
    InvalidAuthorization,
}

/// When the config file is read again: the `--reload-*` flags, whose
/// defaults are the flag table's ([`Flag`](crate::Flag)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReloadTiming {
    /// Wait after a file event before reading (`--reload-debounce-ms`).
    pub debounce: Duration,
    /// Full re-read interval (`--reload-rescan-secs`).
    pub rescan: Duration,
}

impl Default for ReloadTiming {
    fn default() -> Self {
        Self {
            debounce: DEFAULT_DEBOUNCE,
            rescan: DEFAULT_RESCAN,
        }
    }
}

/// What the reloader needs.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ReloaderConfig {
    /// The proxy's config file (`--config`).
    pub config_path: PathBuf,
    /// Where reloads are POSTed (`--proxy-reload-url`).
    pub reload_url: String,
    /// Full `Authorization` header value (`--proxy-authorization`).
    pub authorization: Option<String>,
    /// Wait after a file event before reading (`--reload-debounce-ms`).
    pub debounce: Duration,
    /// Full re-read interval (`--reload-rescan-secs`).
    pub rescan: Duration,
    /// Watch the directory with inotify; `false` leaves only the rescan.
    pub watch: bool,
    /// Lowercase hex sha256 of the content the proxy is known to run (the
    /// file as read at start-up: the proxy read the same file itself), so
    /// that content is not POSTed again. `None` POSTs the first valid
    /// content seen.
    pub assume_delivered: Option<String>,
    /// Time allowed for one POST before it counts as failed.
    pub post_timeout: Duration,
    /// The configuration [`ReloaderHandle::config`] holds until the file is
    /// first read (at once, at start): e.g. the one the process started
    /// with. Default: empty.
    pub initial_config: Arc<SbConfig>,
    /// The ports of the sidecar's own mesh: content that conflicts with
    /// them (or with the sidecar's ACME) is invalid, as `validate` says.
    /// `None` checks no conflicts.
    pub sidecar_ports: Option<crate::config::SidecarPorts>,
}

impl ReloaderConfig {
    /// A configuration with the documented defaults: no Authorization, 200 ms
    /// debounce, 30 s rescan, inotify on, nothing assumed delivered.
    pub fn new(config_path: impl Into<PathBuf>, reload_url: impl Into<String>) -> Self {
        Self {
            config_path: config_path.into(),
            reload_url: reload_url.into(),
            authorization: None,
            debounce: DEFAULT_DEBOUNCE,
            rescan: DEFAULT_RESCAN,
            watch: true,
            assume_delivered: None,
            post_timeout: DEFAULT_POST_TIMEOUT,
            initial_config: Arc::default(),
            sidecar_ports: None,
        }
    }
}

/// What the reloader last did, for the node metadata.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReloadStatus {
    /// `sha256:<hex>` of the content the proxy runs, when known.
    pub delivered_hash: Option<String>,
    /// The last result: `ok`, `failed`, `refused` or `invalid`, and when.
    pub last_result: Option<LastReload>,
}

/// Asks for one more reload of the current content (cloneable, for the
/// certificate writer).
#[derive(Clone, Debug)]
pub(crate) struct ReloadTrigger(Arc<Notify>);

impl ReloadTrigger {
    /// Certificates changed: reload the current content once more, through
    /// the same single-flight path. Calls before that reload starts collapse
    /// into one.
    pub(crate) fn certificates_changed(&self) {
        self.0.notify_one();
    }
}

/// A running reloader; dropping it stops the watcher and the driver.
#[derive(Debug)]
pub struct ReloaderHandle {
    trigger: ReloadTrigger,
    status: watch::Receiver<ReloadStatus>,
    config: watch::Receiver<Arc<SbConfig>>,
    tasks: Vec<JoinHandle<()>>,
}

impl ReloaderHandle {
    /// Re-reads the config and POSTs a reload now: after new certificate
    /// files were written (the proxy reads them on reload).
    pub fn certificates_changed(&self) {
        self.trigger.certificates_changed();
    }

    /// A cloneable trigger for [`ReloadTrigger::certificates_changed`].
    pub(crate) fn trigger(&self) -> ReloadTrigger {
        self.trigger.clone()
    }

    /// The status, updated after every result.
    pub fn status(&self) -> watch::Receiver<ReloadStatus> {
        self.status.clone()
    }

    /// The newest valid content of the config file, parsed (whether or not
    /// the proxy took it): what the ACME issuer reads its origins from.
    pub fn config(&self) -> watch::Receiver<Arc<SbConfig>> {
        self.config.clone()
    }
}

impl Drop for ReloaderHandle {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The reloader's async shell.
pub struct Reloader;

impl Reloader {
    /// Starts watching and reloading; must be called inside a tokio
    /// runtime. Fails only on an unusable URL or Authorization value.
    pub fn spawn(
        config: ReloaderConfig,
        metrics: Arc<Metrics>,
    ) -> Result<ReloaderHandle, ReloadError> {
        let poster = Poster::new(
            &config.reload_url,
            config.authorization.as_deref(),
            config.post_timeout,
        )?;
        let notify = Arc::new(Notify::new());
        let (status_tx, status_rx) = watch::channel(ReloadStatus {
            delivered_hash: config
                .assume_delivered
                .as_ref()
                .map(|h| format!("sha256:{h}")),
            last_result: None,
        });
        let watching = watcher::spawn(
            watcher::WatchSpec {
                path: config.config_path.clone(),
                debounce: config.debounce,
                rescan: config.rescan,
                events: config.watch,
                ports: config.sidecar_ports,
            },
            config.initial_config.clone(),
        );
        let driver = tokio::spawn(drive(
            Machine::new(config.assume_delivered.clone()),
            poster,
            watching.contents,
            notify.clone(),
            status_tx,
            metrics,
        ));
        Ok(ReloaderHandle {
            trigger: ReloadTrigger(notify),
            status: status_rx,
            config: watching.config,
            tasks: vec![watching.task, driver],
        })
    }
}

/// Feeds the machine from the watcher, the certificate trigger, POST results
/// and its own timer, and carries out its actions.
async fn drive(
    mut machine: Machine,
    poster: Poster,
    mut content: mpsc::Receiver<Input>,
    certificates: Arc<Notify>,
    status: watch::Sender<ReloadStatus>,
    metrics: Arc<Metrics>,
) {
    let (result_tx, mut results) = mpsc::channel(1);
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let input = tokio::select! {
            seen = content.recv() => match seen {
                Some(input) => input,
                None => return,
            },
            () = certificates.notified() => Input::CertificatesChanged,
            Some(outcome) = results.recv() => Input::PostResult(outcome),
            () = sleep_until(deadline), if deadline.is_some() => Input::Tick,
        };
        deadline = None;
        for action in machine.step(input, Instant::now()) {
            match action {
                Action::Post { sha256 } => {
                    tracing::info!(sha256 = %sha256, "reload: POSTing the proxy's reload URL");
                    let poster = poster.clone();
                    let result_tx = result_tx.clone();
                    tokio::spawn(async move {
                        let _ = result_tx.send(poster.post().await).await;
                    });
                }
                Action::WaitUntil(at) => deadline = Some(tokio::time::Instant::from_std(at)),
                Action::Report(report) => record(&report, &status, &metrics),
            }
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    if let Some(at) = deadline {
        tokio::time::sleep_until(at).await;
    }
}

/// Applies a report to the metrics and the status.
fn record(report: &Report, status: &watch::Sender<ReloadStatus>, metrics: &Metrics) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let m = &metrics.reloader;
    let result = match report {
        Report::Delivered { sha256 } => {
            m.reloads.inc();
            m.last_reload_successful.set(1);
            m.last_reload_success_timestamp_seconds
                .set(now.as_secs_f64());
            tracing::info!(sha256 = %sha256, "reload: delivered");
            "ok"
        }
        Report::Failed => {
            m.reloads.inc();
            m.reloads_failed.inc();
            m.last_reload_successful.set(0);
            "failed"
        }
        Report::Refused => {
            m.reloads.inc();
            m.reloads_failed.inc();
            m.last_reload_successful.set(0);
            "refused"
        }
        Report::Invalid => {
            m.config_invalid.inc();
            "invalid"
        }
    };
    status.send_modify(|s| {
        if let Report::Delivered { sha256 } = report {
            s.delivered_hash = Some(format!("sha256:{sha256}"));
        }
        s.last_result = Some(LastReload {
            result: result.into(),
            at_unix_ms: u64::try_from(now.as_millis()).unwrap_or(u64::MAX),
        });
    });
}
