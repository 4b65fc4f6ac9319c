//! [`Node::start`]: everything the sidecar composes, in one call, for a
//! process that embeds the library.
//!
//! A node is the mesh member, the certificate store (opened and probed),
//! the ACME manager (orders, renewals, certificate files, placeholders),
//! the challenge responder, the config watcher (and the reload POST when
//! there is a proxy to tell), the `--watch-tls` directories, the node
//! metadata every peer reads, readiness, and the admin and challenge
//! routers. `sbmesh-sidecar run` is `Node::start`, a signal, and
//! [`Node::shutdown`]; a proxy linking the library does the same and
//! serves [`Node::certificates`] with [`crate::tls`].
//!
//! Data flow of the certificates, one way: the ACME manager writes the
//! files (placeholders first) -> this node reads them back after each
//! change -> [`Node::certificates`] -> e.g. [`crate::tls::CertResolver`].
//! The files stay the one source of truth, so what an embedding process
//! serves is exactly what a proxy reading the files would.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tower::ServiceExt;
use tracing::{info, warn};

use crate::acme::challenge::{ChallengeBook, challenge_router};
use crate::acme::manager::{
    AcmeInputs, AcmeLimits, AcmeManager, AcmeManagerConfig, CertificatesChanged,
};
use crate::acme::unit::AcmeStatus;
use crate::config::{CertApply, SbConfig, StorageBackend};
use crate::http::passthrough::{Passthrough, Upstream, with_passthrough};
use crate::http::{AdminAuth, AdminState, ReadinessCheck, admin_router, mesh_running, mesh_stalls};
use crate::mesh::{AcmeInfo, ClusterStatus, Mesh, MeshConfig, MeshError, NodeMeta, SeedSource};
use crate::metrics::Metrics;
use crate::proxy::{
    ProxyStatus, RestartConfig, RestartCoordinator, TlsWatcher, WatchTlsConfig, restart_readiness,
    watch_tls_readiness,
};
use crate::reload::{ReloadError, ReloadStatus, ReloadTrigger, ReloaderHandle};
use crate::store::Store;
use crate::store::open::{open_cluster_store, probe};
use crate::store::sealed::AtRestRing;

mod config;
mod feed;
mod follow;

use feed::CertificateFeed;
use follow::{FollowedConfig, follow_config};

pub use config::{NodeConfig, ProxyReload, ProxyRestart, ProxySettings};

/// Certificates listed in this node's mesh metadata at most (see
/// `publish_meta`).
const MAX_CERTS_IN_META: usize = 400;

/// Why a node did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The configuration file cannot be used.
    #[error("{}: {problems}", path.display())]
    Config {
        /// The file.
        path: PathBuf,
        /// Its problems, `<yaml.path>: <message>`, separated by `; `.
        problems: String,
    },
    /// A listener could not be bound.
    #[error("cannot bind the {what} listener on {addr}: {source}")]
    Bind {
        /// `admin` or `challenge`.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The mesh did not start.
    #[error("starting the mesh: {0}")]
    Mesh(#[from] MeshError),
    /// The reload URL or Authorization value is unusable.
    #[error(transparent)]
    Reload(#[from] ReloadError),
    /// No randomness for the ephemeral key of a node without a cluster key.
    #[error("no system randomness for an ephemeral cluster key")]
    Randomness,
}

/// A certificate this node serves, as its files hold it.
#[derive(Clone, PartialEq, Eq)]
pub struct NodeCertificate {
    /// The certificate unit: the host (`per_host`), or the id of the SAN
    /// name set (`san`).
    pub unit: String,
    /// The DNS names of the leaf, lowercase.
    pub names: Vec<String>,
    /// The chain, leaf first, PEM.
    pub chain_pem: String,
    /// The private key, PKCS#8 PEM.
    pub key_pem: String,
    /// A self-signed placeholder, served until the CA's certificate arrives.
    pub placeholder: bool,
    /// Serial of the leaf, lowercase hex.
    pub serial: String,
    /// notAfter of the leaf, unix seconds.
    pub not_after_unix: u64,
}

impl std::fmt::Debug for NodeCertificate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCertificate")
            .field("unit", &self.unit)
            .field("names", &self.names)
            .field("placeholder", &self.placeholder)
            .field("serial", &self.serial)
            .field("not_after_unix", &self.not_after_unix)
            .finish_non_exhaustive()
    }
}

/// The certificates a node serves, in unit order.
pub(crate) type NodeCertificates = Arc<Vec<NodeCertificate>>;

/// How [`Node::shutdown`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drain {
    /// Everything stopped within the budget.
    Clean,
    /// The budget ran out first.
    TimedOut,
}

/// A running node. Stop it with [`Node::shutdown`] (dropping it stops its
/// tasks too, without telling the peers).
pub struct Node {
    mesh: Mesh,
    metrics: Arc<Metrics>,
    admin: AdminState,
    challenge: Router,
    admin_addr: Option<SocketAddr>,
    challenge_addr: Option<SocketAddr>,
    config: watch::Receiver<Arc<SbConfig>>,
    acme: watch::Receiver<AcmeStatus>,
    reload: watch::Receiver<ReloadStatus>,
    certificates: Arc<CertificateFeed>,
    running: Option<Running>,
}

/// What [`Node::shutdown`] stops, in order.
struct Running {
    stop: watch::Sender<bool>,
    tls_watchers: Vec<TlsWatcher>,
    acme_task: JoinHandle<()>,
    reloader: Option<ReloaderHandle>,
    /// Keeps a fixed configuration's channel open.
    _fixed_config: Option<watch::Sender<Arc<SbConfig>>>,
    follow_tasks: Vec<JoinHandle<()>>,
    listeners: Vec<JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.acme_task.abort();
        for task in self.follow_tasks.iter().chain(&self.listeners) {
            task.abort();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Running's own drop stops what is left; the mesh driver stops
        // with its last handle.
        self.running.take();
    }
}

impl Node {
    /// Starts everything, in the order the sidecar always did: placeholder
    /// certificates first (so a proxy reading files at start-up finds
    /// some), the listeners, the config watcher, the mesh, then the store
    /// (retried in the background, never fatal), the ACME manager once the
    /// store is open, and the metadata publisher. Must be called within a
    /// Tokio runtime.
    pub async fn start(cfg: NodeConfig) -> Result<Node, NodeError> {
        write_placeholders(&cfg);
        let metrics = Arc::new(Metrics::new());
        let keys = cluster_keys(&cfg)?;
        // Bound before the mesh starts: a taken port fails the start
        // without a join and a leave.
        let admin_listener = bind_listener("admin", cfg.admin_listen).await?;
        let challenge_listener = bind_listener("challenge", cfg.challenge_listen).await?;
        let local = |l: &Option<TcpListener>| l.as_ref().and_then(|l| l.local_addr().ok());
        let (admin_addr, challenge_addr) = (local(&admin_listener), local(&challenge_listener));

        let (stop_tx, stop_rx) = watch::channel(false);
        let FollowedConfig {
            config: config_rx,
            reload: reload_rx,
            trigger: reload_trigger,
            reloader,
            fixed: fixed_config,
            tasks: mut follow_tasks,
        } = follow_config(&cfg, &metrics)?;

        let meta = NodeMeta {
            version: cfg.version.clone(),
            config_hash: cfg.config_hash(),
            ready: false,
            ..NodeMeta::default()
        };
        let mesh_cfg = mesh_config(&cfg, keys);
        let mesh = Mesh::start(mesh_cfg, metrics.clone(), meta.clone()).await?;

        let (store_rx, store_checks) = probe_store(&cfg, &metrics, &mut follow_tasks, &stop_rx);
        let hand_off = HandOff::start(&cfg.proxy, reload_trigger, &metrics);
        let (acme_tx, acme_rx) = watch::channel(AcmeStatus::default());
        let state = admin_state(&cfg, &mesh, &metrics, store_checks, &hand_off, &acme_rx);

        // The HTTP-01 responder needs the store; until the store is open
        // it answers 404 for every path, as it does for unknown tokens.
        let responder: Arc<OnceLock<Router>> = Arc::new(OnceLock::new());
        let challenge = challenge_router_of(&cfg, responder.clone(), &metrics);
        let listeners = [
            (admin_listener, "admin", admin_router(state.clone())),
            (challenge_listener, "challenge", challenge.clone()),
        ]
        .into_iter()
        .filter_map(|(listener, name, router)| {
            let (metrics, stop) = (metrics.clone(), stop_rx.clone());
            listener.map(|l| tokio::spawn(serve(l, name, router, metrics, stop)))
        })
        .collect();

        // ACME: hostnames follow the config file as it is read; the
        // manager starts once the store is open. Each certificate change
        // is handed to the proxy and read back for Node::certificates.
        let feed = Arc::new(CertificateFeed::new(
            cfg.cert_dir.clone(),
            config_rx.clone(),
            acme_rx.clone(),
            stop_rx.clone(),
        ));
        let changed: CertificatesChanged = {
            let (apply, feed) = (hand_off.apply.clone(), feed.clone());
            Arc::new(move || {
                apply.call();
                feed.wake.notify_one();
            })
        };
        let acme_task = tokio::spawn(run_acme(
            acme_manager_config(&cfg, &mesh, challenge_addr),
            restart_config(&cfg),
            AcmeParts {
                mesh: mesh.clone(),
                metrics: metrics.clone(),
                config: config_rx.clone(),
                apply: hand_off.apply,
                certificates_changed: changed,
                proxy_status: hand_off.proxy_status,
                store: store_rx,
                responder,
                status: acme_tx,
            },
            stop_rx.clone(),
        ));
        follow_tasks.push(tokio::spawn(publish_meta(
            state.clone(),
            meta,
            reload_rx.clone(),
            acme_rx.clone(),
            hand_off.proxy_rx,
            stop_rx,
        )));
        Ok(Node {
            mesh,
            metrics,
            admin: state,
            challenge,
            admin_addr,
            challenge_addr,
            config: config_rx,
            acme: acme_rx,
            reload: reload_rx,
            certificates: feed,
            running: Some(Running {
                stop: stop_tx,
                tls_watchers: hand_off.tls_watchers,
                acme_task,
                reloader,
                _fixed_config: fixed_config,
                follow_tasks,
                listeners,
            }),
        })
    }

    /// The mesh member.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The cluster as this node sees it (what `/admin/cluster/status`
    /// answers); `None` once the mesh stopped.
    pub async fn status(&self) -> Option<ClusterStatus> {
        self.mesh.status().await
    }

    /// The node's metrics (what `/metrics` exposes).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Why the node is not ready (what `/readyz` lists); empty when ready.
    pub fn not_ready_reasons(&self) -> Vec<String> {
        self.admin.not_ready_reasons()
    }

    /// Whether the node is ready: the mesh runs and the store answered
    /// (and, with their options, the proxy and the watched directories are
    /// fine).
    pub fn is_ready(&self) -> bool {
        self.not_ready_reasons().is_empty()
    }

    /// The certificates to serve, placeholders included until the CA's
    /// arrive, updated after every change (new origin, issuance, renewal).
    /// Feed them to `crate::tls::CertResolver::follow`. The files are read
    /// back only while someone holds a receiver.
    ///
    /// The first call starts the task that reads them (a node nobody asks,
    /// such as the sidecar's, never runs it), so it must be made within
    /// the Tokio runtime the node runs on.
    pub fn certificates(&self) -> watch::Receiver<NodeCertificates> {
        let rx = self.certificates.tx.subscribe();
        self.certificates.start();
        self.certificates.wake.notify_one();
        rx
    }

    /// This node's ACME state: its certificates, the origins not eligible,
    /// why it does not order (as its status shows them).
    pub fn acme_status(&self) -> watch::Receiver<AcmeStatus> {
        self.acme.clone()
    }

    /// The newest valid configuration read from the config file.
    pub fn config(&self) -> watch::Receiver<Arc<SbConfig>> {
        self.config.clone()
    }

    /// The config hash this node announces and the last reload result.
    pub fn reload_status(&self) -> watch::Receiver<ReloadStatus> {
        self.reload.clone()
    }

    /// `/healthz`, `/readyz`, `/metrics`, `/admin/*`. Serve it with the
    /// peer address, which `/admin/*` checks when no credentials are set:
    /// `axum::serve(listener, router.into_make_service_with_connect_info::<SocketAddr>())`.
    pub fn admin_router(&self) -> Router {
        admin_router(self.admin.clone())
    }

    /// The HTTP-01 responder (`/.well-known/acme-challenge/<token>`),
    /// answering 404 until the store is open; with
    /// [`NodeConfig::challenge_passthrough`], every other request goes to
    /// the proxy (serve it with connect info, as the admin router, for
    /// `X-Forwarded-For`). Serve it where the CA's validations arrive
    /// (port 80 of every name), or let the node do it with
    /// [`NodeConfig::challenge_listen`].
    pub fn challenge_router(&self) -> Router {
        self.challenge.clone()
    }

    /// Where the node serves the admin router, when it does.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// Where the node serves the challenge router, when it does.
    pub fn challenge_addr(&self) -> Option<SocketAddr> {
        self.challenge_addr
    }

    /// Drains within `grace`: stops the certificate watchers, the ACME
    /// manager and the config watcher, leaves the mesh (peers see this
    /// node `down` at once), then lets the listeners finish the requests
    /// in flight.
    pub async fn shutdown(mut self, grace: Duration) -> Drain {
        let Some(mut running) = self.running.take() else {
            return Drain::Clean;
        };
        let mesh = self.mesh.clone();
        let drain = async move {
            drop(std::mem::take(&mut running.tls_watchers));
            running.acme_task.abort();
            drop(running.reloader.take());
            mesh.leave().await;
            let _ = running.stop.send(true);
            for task in std::mem::take(&mut running.listeners) {
                let _ = task.await;
            }
        };
        match tokio::time::timeout(grace, drain).await {
            Ok(()) => Drain::Clean,
            Err(_) => Drain::TimedOut,
        }
    }
}

/// Placeholder certificates, so a proxy reading its files at start-up
/// finds some; a failure is logged, never fatal.
fn write_placeholders(cfg: &NodeConfig) {
    match crate::acme::unit_files::write_startup_placeholders(&cfg.config, &cfg.cert_dir) {
        Ok(0) => {}
        Ok(n) => info!(
            certificates = n,
            dir = %cfg.cert_dir.display(),
            "placeholder certificates written until the CA's arrive"
        ),
        Err(e) => {
            warn!(dir = %cfg.cert_dir.display(), "cannot write placeholder certificates: {e}")
        }
    }
}

/// The cluster key ring, or a throwaway key when none is configured.
fn cluster_keys(cfg: &NodeConfig) -> Result<Vec<[u8; 32]>, NodeError> {
    if let Some(keys) = cfg.cluster_key.clone() {
        return Ok(keys);
    }
    // Validation refuses peers without a key, so this node is alone: a
    // throwaway key keeps the code path (and the sockets) the same.
    warn!("no cluster key configured: running alone with an ephemeral key");
    let mut k = [0u8; 32];
    aws_lc_rs::rand::fill(&mut k).map_err(|_| NodeError::Randomness)?;
    Ok(vec![k])
}

/// The `what` listener (`admin`, `challenge`) when `addr` is set.
async fn bind_listener(
    what: &'static str,
    addr: Option<SocketAddr>,
) -> Result<Option<TcpListener>, NodeError> {
    match addr {
        Some(addr) => TcpListener::bind(addr)
            .await
            .map(Some)
            .map_err(|source| NodeError::Bind { what, addr, source }),
        None => Ok(None),
    }
}

/// What the mesh member starts with.
fn mesh_config(cfg: &NodeConfig, keys: Vec<[u8; 32]>) -> MeshConfig {
    MeshConfig {
        node_id: cfg.node_id.clone(),
        cluster_id: cfg.cluster_id.clone(),
        bind: cfg.bind,
        gossip_port: cfg.gossip_port,
        transport_port: cfg.transport_port,
        advertise: cfg.advertise,
        seeds: SeedSource {
            seeds: cfg.seeds.clone(),
            mesh_service: cfg.mesh_service.clone(),
            gossip_port: cfg.gossip_port,
        },
        keys,
        key_file: cfg.cluster_key_file.clone(),
        tuning: cfg.swim.clone(),
    }
}

/// What the admin listener serves: readiness (the mesh running, the store
/// and the certificate hand-off), degradation (the store, the mesh's
/// stalls) and start-up (the stored certificates written, when ACME is on).
fn admin_state(
    cfg: &NodeConfig,
    mesh: &Mesh,
    metrics: &Arc<Metrics>,
    store: StoreChecks,
    hand_off: &HandOff,
    acme: &watch::Receiver<AcmeStatus>,
) -> AdminState {
    let mut readiness = vec![mesh_running(mesh.clone()), store.readiness];
    readiness.extend(hand_off.readiness(cfg.proxy.cert_apply));
    let startup = vec![certificates_written(
        acme.clone(),
        cfg.config.acme().is_some(),
        Instant::now(),
    )];
    AdminState {
        mesh: mesh.clone(),
        metrics: metrics.clone(),
        auth: AdminAuth::new(cfg.admin_user.as_deref(), cfg.admin_password.as_deref()),
        readiness,
        degraded: vec![store.degraded, mesh_stalls(mesh.clone())],
        startup,
    }
}

/// Opens the store in the background, retried, never fatal: the store as
/// soon as it is open, and its checks for `/readyz` ([`StoreHealth`]).
fn probe_store(
    cfg: &NodeConfig,
    metrics: &Arc<Metrics>,
    tasks: &mut Vec<JoinHandle<()>>,
    stop: &watch::Receiver<bool>,
) -> (watch::Receiver<Option<Arc<dyn Store>>>, StoreChecks) {
    let health = Arc::new(std::sync::Mutex::new(StoreHealth::default()));
    let (store_tx, store_rx) = watch::channel(None);
    let acme = cfg.config.sbmesh().acme.as_ref();
    let place = StorePlace {
        backend: acme
            .and_then(|a| a.storage_backend)
            .unwrap_or(StorageBackend::Redb),
        path: acme
            .and_then(|a| a.storage_path.clone())
            .unwrap_or_default(),
        state_dir: cfg.state_dir.clone(),
        cluster_id: cfg.cluster_id.clone(),
    };
    tasks.push(tokio::spawn(keep_store_probed(
        place,
        metrics.clone(),
        health.clone(),
        store_tx,
        stop.clone(),
    )));
    let unknown = || Some("store: health unknown".to_owned());
    let ready = health.clone();
    let checks = StoreChecks {
        readiness: Arc::new(move || ready.lock().map_or_else(|_| unknown(), |h| h.not_ready())),
        degraded: Arc::new(move || health.lock().map_or_else(|_| unknown(), |h| h.degraded())),
    };
    (store_rx, checks)
}

/// The store as its probe last found it.
///
/// `/readyz` weighs it in two ways. Until the store first answered it is a
/// reason not to be ready (a pod that never reached its store has nothing
/// to serve from it). After that an outage is a degradation, said in
/// `/readyz` and status but not failing it: every replica shares the
/// store, and failing readiness would take the whole fleet out of its
/// Services at once, for a fault no replica can mend, while the
/// certificates already written keep being served.
#[derive(Debug, Default)]
struct StoreHealth {
    /// The store has answered a probe since the process started.
    answered: bool,
    /// What the last open or probe found wrong.
    problem: Option<String>,
}

impl StoreHealth {
    /// The reason `/readyz` fails, until the store first answered.
    fn not_ready(&self) -> Option<String> {
        (!self.answered).then(|| {
            self.problem
                .clone()
                .unwrap_or_else(|| "store: not probed yet".to_owned())
        })
    }

    /// The degradation `/readyz` and status report once it answered.
    fn degraded(&self) -> Option<String> {
        self.problem.as_ref().filter(|_| self.answered).map(|r| {
            format!(
                "{r} (certificates already written are still served; orders and renewals \
                 wait for the store)"
            )
        })
    }

    /// Records a probe's or an open's outcome; logs an outage and the
    /// store's return once each.
    fn record(&mut self, backend: StorageBackend, outcome: Result<(), String>) {
        match outcome {
            Ok(()) => {
                if self.answered && self.problem.is_some() {
                    info!(backend = %backend, "certificate store answers again");
                }
                self.answered = true;
                self.problem = None;
            }
            Err(e) => {
                if self.answered && self.problem.is_none() {
                    warn!(backend = %backend, error = %e, "certificate store does not answer; \
                        certificates already written are still served, orders and renewals wait");
                }
                self.problem = Some(format!("store: {e}"));
            }
        }
    }
}

/// The store's two checks (see [`StoreHealth`]).
struct StoreChecks {
    readiness: ReadinessCheck,
    degraded: ReadinessCheck,
}

/// A router that answers 404 until `slot` is filled, then delegates to it.
fn deferred_router(slot: Arc<OnceLock<Router>>) -> Router {
    Router::new().fallback(move |req: Request| {
        let slot = slot.clone();
        async move {
            match slot.get() {
                Some(router) => match router.clone().oneshot(req).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                },
                None => StatusCode::NOT_FOUND.into_response(),
            }
        }
    })
}

/// The callback that hands new certificate files to the proxy, set once
/// its target exists; a call before that is kept and made on `set`.
#[derive(Default)]
struct ApplySlot {
    target: OnceLock<CertificatesChanged>,
    pending: std::sync::atomic::AtomicBool,
}

impl ApplySlot {
    fn set(&self, target: CertificatesChanged) {
        if self.target.set(target).is_ok()
            && self
                .pending
                .swap(false, std::sync::atomic::Ordering::SeqCst)
            && let Some(target) = self.target.get()
        {
            target();
        }
    }

    fn call(&self) {
        match self.target.get() {
            Some(target) => target(),
            None => self
                .pending
                .store(true, std::sync::atomic::Ordering::SeqCst),
        }
    }

    fn caller(self: &Arc<Self>) -> CertificatesChanged {
        let slot = self.clone();
        Arc::new(move || slot.call())
    }
}

/// How new certificates reach the proxy (`cert_apply`): one callback for
/// the ACME manager and every `--watch-tls` directory, set once its target
/// exists (a restart needs the store: `run_acme` sets it).
struct HandOff {
    apply: Arc<ApplySlot>,
    tls_watchers: Vec<TlsWatcher>,
    proxy_status: watch::Sender<ProxyStatus>,
    proxy_rx: watch::Receiver<ProxyStatus>,
}

impl HandOff {
    fn start(proxy: &ProxySettings, reload: Option<ReloadTrigger>, metrics: &Arc<Metrics>) -> Self {
        let apply = Arc::new(ApplySlot::default());
        let (proxy_status, proxy_rx) = watch::channel(ProxyStatus::default());
        let tls_watchers = proxy
            .watch_tls
            .iter()
            .map(|dir| {
                info!(dir = %dir.display(), apply = proxy.cert_apply.as_str(), "watching a certificate directory");
                TlsWatcher::spawn(WatchTlsConfig::new(dir), apply.caller(), metrics.clone())
            })
            .collect();
        match (proxy.cert_apply, reload) {
            (CertApply::Reload, Some(reload)) => {
                apply.set(Arc::new(move || reload.certificates_changed()));
            }
            // Set once the store is open (run_acme).
            (CertApply::Restart, _) => {}
            // No proxy to POST to: the files (and Node::certificates) are it.
            (CertApply::Reload | CertApply::None, _) => apply.set(Arc::new(|| {})),
        }
        Self {
            apply,
            tls_watchers,
            proxy_status,
            proxy_rx,
        }
    }

    /// What `/readyz` checks of the hand-off: the restarts, the watched
    /// directories.
    fn readiness(&self, cert_apply: CertApply) -> Vec<ReadinessCheck> {
        let mut checks = Vec::new();
        if cert_apply == CertApply::Restart {
            checks.push(restart_readiness(self.proxy_rx.clone()));
        }
        if !self.tls_watchers.is_empty() {
            checks.push(watch_tls_readiness(
                self.tls_watchers.iter().map(TlsWatcher::problem).collect(),
            ));
        }
        checks
    }
}

/// The challenge listener's router: the HTTP-01 responder, and every other
/// path passed to the proxy from the start when `challenge_passthrough` is
/// set.
fn challenge_router_of(
    cfg: &NodeConfig,
    responder: Arc<OnceLock<Router>>,
    metrics: &Metrics,
) -> Router {
    match &cfg.challenge_passthrough {
        Some(upstream) => {
            info!(upstream = %upstream, "the challenge listener passes other requests to the proxy");
            with_passthrough(
                deferred_router(responder),
                Arc::new(Passthrough::new(upstream.clone(), metrics)),
            )
        }
        None => deferred_router(responder),
    }
}

/// How long `/startupz` waits for the stored certificates to be written
/// for the proxy (with peers, for the CA's certificate of every unit)
/// before it lets the proxy start anyway (a store that does not answer, or
/// a CA that does not issue, must not hold a pod back for long).
pub(crate) const STARTUP_CERTIFICATES_WAIT: Duration = Duration::from_secs(5);

/// The start-up condition of `/startupz`: with ACME on (`acme` at start),
/// the certificates the store holds are written for the proxy and, when
/// the node has peers (one of them is likely ordering), every unit has the
/// CA's certificate, so a proxy that reads its certificate once at start-up
/// serves the CA's and not a placeholder (which would cost it a restart
/// seconds later); holds after [`STARTUP_CERTIFICATES_WAIT`] whatever the
/// store and the CA do.
fn certificates_written(
    acme: watch::Receiver<AcmeStatus>,
    acme_on: bool,
    started: Instant,
) -> ReadinessCheck {
    Arc::new(move || {
        (acme_on && !acme.borrow().settled && started.elapsed() < STARTUP_CERTIFICATES_WAIT).then(
            || {
                format!(
                    "certificates: the stored certificates are not written for the proxy yet, \
                     or (with peers) a certificate is not the CA's yet (waiting up to {} s)",
                    STARTUP_CERTIFICATES_WAIT.as_secs()
                )
            },
        )
    })
}

/// The ACME manager's settings: the node's limits, and an at-rest ring that
/// follows the mesh's (which the key file rotates) when there is a cluster
/// key.
///
/// Orders are checked ([`crate::acme::reach`]) at `--acme-check-url`, else
/// at this node's own challenge listener (`challenge_addr`, an unspecified
/// address asked on loopback): that proves the listener and the store, not
/// the route from the CA.
fn acme_manager_config(
    cfg: &NodeConfig,
    mesh: &Mesh,
    challenge_addr: Option<SocketAddr>,
) -> AcmeManagerConfig {
    let own_listener =
        challenge_addr.and_then(|addr| Upstream::parse(&crate::config::local_url(addr)).ok());
    let key_ring = if cfg.cluster_key.is_some() {
        AtRestRing::following(mesh.key_rings())
    } else {
        AtRestRing::plain()
    };
    AcmeManagerConfig {
        key_ring,
        limits: AcmeLimits {
            check_url: cfg.acme.check_url.clone().or(own_listener),
            ..cfg.acme.clone()
        },
        ..AcmeManagerConfig::new(cfg.node_id.clone(), cfg.cert_dir.clone())
    }
}

/// The proxy restarts' settings when certificates are applied by
/// restarting the proxy.
fn restart_config(cfg: &NodeConfig) -> Option<RestartConfig> {
    let restart = &cfg.proxy.restart;
    (cfg.proxy.cert_apply == CertApply::Restart).then(|| RestartConfig {
        min_interval: restart.min_interval,
        ..RestartConfig::new(&cfg.node_id, &restart.process_name, &restart.health_url)
    })
}

/// What the ACME task needs from the rest of the node.
struct AcmeParts {
    mesh: Mesh,
    metrics: Arc<Metrics>,
    config: watch::Receiver<Arc<SbConfig>>,
    apply: Arc<ApplySlot>,
    certificates_changed: CertificatesChanged,
    proxy_status: watch::Sender<ProxyStatus>,
    store: watch::Receiver<Option<Arc<dyn Store>>>,
    responder: Arc<OnceLock<Router>>,
    status: watch::Sender<AcmeStatus>,
}

/// Waits for the store, then serves challenges from it and runs the ACME
/// manager, whose status goes into the node metadata.
async fn run_acme(
    manager: AcmeManagerConfig,
    restart: Option<RestartConfig>,
    mut parts: AcmeParts,
    mut stop: watch::Receiver<bool>,
) {
    let store = tokio::select! {
        s = parts.store.wait_for(Option::is_some) => match s {
            Ok(s) => match s.clone() {
                Some(store) => store,
                None => return,
            },
            Err(_) => return,
        },
        _ = stop.wait_for(|s| *s) => return,
    };
    let book = ChallengeBook::new(store.clone(), parts.metrics.clone());
    let _ = parts.responder.set(challenge_router(book.clone()));
    // apply: restart needs the store for its fleet-wide lease.
    let _coordinator = if let Some(cfg) = restart {
        match RestartCoordinator::spawn_into(
            cfg,
            store.clone(),
            parts.metrics.clone(),
            parts.proxy_status.clone(),
        ) {
            Ok(coordinator) => {
                parts.apply.set(coordinator.requester());
                Some(coordinator)
            }
            Err(e) => {
                warn!(error = %e, "--proxy-health-url: proxy restarts are off");
                None
            }
        }
    } else {
        None
    };
    let _manager = AcmeManager::spawn_into(
        manager,
        AcmeInputs {
            store,
            mesh: parts.mesh,
            metrics: parts.metrics,
            config: parts.config,
            certificates_changed: parts.certificates_changed,
            book,
        },
        parts.status,
    );
    // The manager stops when dropped.
    let _ = stop.wait_for(|s| *s).await;
}

async fn serve(
    listener: TcpListener,
    name: &'static str,
    router: Router,
    metrics: Arc<Metrics>,
    stop: watch::Receiver<bool>,
) {
    use crate::http::listener as limited;
    let limits = limited::Listener {
        name,
        max_connections: limited::max_connections(),
        header_read_timeout: limited::HEADER_READ_TIMEOUT,
    };
    limited::serve(listener, router, limits, metrics, stop).await;
}

/// The one owner of this node's mesh metadata: readiness (every 500 ms)
/// and the reloader's delivered config hash and last result, so every
/// node's status shows which pod runs which config.
async fn publish_meta(
    state: AdminState,
    mut meta: NodeMeta,
    mut reload: watch::Receiver<ReloadStatus>,
    mut acme: watch::Receiver<AcmeStatus>,
    mut proxy: watch::Receiver<ProxyStatus>,
    stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let mut warned_cap = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            r = reload.changed() => {
                if r.is_err() {
                    return;
                }
            }
            r = acme.changed() => {
                if r.is_err() {
                    return;
                }
            }
            r = proxy.changed() => {
                if r.is_err() {
                    return;
                }
            }
        }
        if *stop.borrow() {
            return;
        }
        let mut next = meta.clone();
        next.ready = state.not_ready_reasons().is_empty();
        next.proxy = Some(proxy.borrow_and_update().info());
        {
            let r = reload.borrow();
            if let Some(hash) = &r.delivered_hash {
                next.config_hash = Some(hash.clone());
            }
            if r.last_result.is_some() {
                next.last_reload = r.last_result.clone();
            }
        }
        {
            let a = acme.borrow_and_update();
            next.certificates = a.certificates.clone();
            // Metadata over 64 KiB is not gossiped at all: keep the list
            // (about 100 bytes an entry) well under it. Past the cap, peers
            // still learn of certificates from the store read every 60 s.
            if next.certificates.len() > MAX_CERTS_IN_META {
                if !warned_cap {
                    warn!(
                        certificates = next.certificates.len(),
                        listed = MAX_CERTS_IN_META,
                        "more certificates than node metadata can list; status shows the first ones"
                    );
                    warned_cap = true;
                }
                next.certificates.truncate(MAX_CERTS_IN_META);
            }
            let said = !a.not_eligible.is_empty()
                || a.refusal.is_some()
                || !a.waiting.is_empty()
                || !a.failing.is_empty();
            next.acme = said.then(|| AcmeInfo {
                not_eligible: a.not_eligible.clone(),
                refusal: a.refusal.clone(),
                waiting: a.waiting.clone(),
                failing: a.failing.clone(),
            });
        }
        if next != meta {
            meta = next;
            state.mesh.set_meta(meta.clone()).await;
        }
    }
}

/// Where the certificate store is: `proxy.acme.storage_backend` and
/// `storage_path` of the start-up configuration.
struct StorePlace {
    backend: StorageBackend,
    path: String,
    state_dir: PathBuf,
    cluster_id: String,
}

/// Opens the certificate store (`proxy.acme.storage_backend`, else a redb
/// file in `state_dir`) and probes it every 5 s; `/readyz` reads the last
/// outcome. A store that cannot be opened yet is retried, never fatal.
async fn keep_store_probed(
    place: StorePlace,
    metrics: Arc<Metrics>,
    health: Arc<std::sync::Mutex<StoreHealth>>,
    opened: watch::Sender<Option<Arc<dyn Store>>>,
    mut stop: watch::Receiver<bool>,
) {
    let backend = place.backend;
    let set = |outcome: Result<(), String>| {
        if let Ok(mut h) = health.lock() {
            h.record(backend, outcome);
        }
    };
    let mut store = None;
    let mut logged = false;
    // Backends without native expiry keep it in the record; sweep those
    // physically now and then (reads already treat them as absent).
    let mut next_sweep = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if store.is_none() {
            match open_cluster_store(
                backend,
                &place.path,
                &place.state_dir,
                &place.cluster_id,
                metrics.clone(),
            )
            .await
            {
                Ok(s) => {
                    info!(backend = %backend, "certificate store opened");
                    let _ = opened.send(Some(s.clone()));
                    store = Some(s);
                }
                Err(e) => {
                    if !logged {
                        warn!(backend = %backend, error = %e, "certificate store cannot be opened yet; retrying");
                        logged = true;
                    }
                    set(Err(e.to_string()));
                }
            }
        }
        if let Some(s) = &store {
            set(probe(s.as_ref()).await.map_err(|e| e.to_string()));
            if tokio::time::Instant::now() >= next_sweep {
                next_sweep = tokio::time::Instant::now() + Duration::from_secs(600);
                match s.sweep_expired().await {
                    Ok(0) => {}
                    Ok(n) => info!(removed = n, "expired store records swept"),
                    Err(e) => warn!(error = %e, "store sweep failed"),
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::feed::tests::config;
    use super::*;

    #[test]
    fn a_store_outage_after_its_first_answer_degrades_and_does_not_unready() {
        let mut health = StoreHealth::default();
        let backend = StorageBackend::Redis;
        // Never answered: not ready, nothing degraded.
        health.record(backend, Err("refused".to_owned()));
        assert_eq!(health.not_ready().as_deref(), Some("store: refused"));
        assert_eq!(health.degraded(), None);
        // Answered once.
        health.record(backend, Ok(()));
        assert_eq!(health.not_ready(), None);
        assert_eq!(health.degraded(), None);
        // Away again: ready still, and said.
        health.record(backend, Err("timed out".to_owned()));
        assert_eq!(health.not_ready(), None);
        let said = health.degraded().expect("a degradation");
        assert!(said.starts_with("store: timed out ("), "{said}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_node_starts_serves_its_placeholders_and_drains() {
        let dir = tempfile::tempdir().unwrap();
        let ip: IpAddr = "127.0.105.2".parse().unwrap();
        let mut cfg = NodeConfig::new("embed-test-0", "embed-test", config());
        cfg.bind = ip;
        cfg.cert_dir = dir.path().join("certs");
        cfg.state_dir = dir.path().join("state");
        cfg.admin_listen = Some(SocketAddr::new(ip, 0));
        let node = Node::start(cfg).await.expect("the node starts");
        assert!(node.admin_addr().is_some_and(|a| a.port() != 0));
        assert_eq!(node.challenge_addr(), None);

        let mut certificates = node.certificates();
        let served = tokio::time::timeout(
            Duration::from_secs(30),
            certificates.wait_for(|set| set.len() == 2),
        )
        .await
        .expect("the placeholders are read back")
        .expect("the node runs")
        .clone();
        assert!(served.iter().all(|c| c.placeholder), "{served:?}");
        let resolver =
            crate::tls::CertResolver::following(certificates, crate::tls::DefaultCertificate::None);
        assert_eq!(resolver.names(), ["a.test", "b.test"]);

        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !node.is_ready() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "never ready: {:?}",
                node.not_ready_reasons()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(node.shutdown(Duration::from_secs(10)).await, Drain::Clean);
    }
}
