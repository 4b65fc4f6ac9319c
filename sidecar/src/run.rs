//! `sbmesh-sidecar run`: builds the library's parts from the settings and
//! runs them until SIGTERM/SIGINT, then drains.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use sbmesh::acme::challenge::{ChallengeBook, challenge_router};
use sbmesh::acme::manager::{
    AcmeInputs, AcmeManager, AcmeManagerConfig, AcmeStatus, CertificatesChanged,
};
use sbmesh::config::{CertApply, SbConfig, StorageBackend};
use sbmesh::http::{AdminAuth, AdminState, ReadinessCheck, admin_router, mesh_running};
use sbmesh::mesh::{AcmeInfo, Mesh, MeshConfig, NodeMeta, SeedSource, SwimTuning};
use sbmesh::metrics::Metrics;
use sbmesh::proxy::{
    ProxyStatus, RestartConfig, RestartCoordinator, TlsWatcher, WatchTlsConfig, restart_readiness,
    watch_tls_readiness,
};
use sbmesh::reload::{ReloadStatus, Reloader, ReloaderConfig};
use sbmesh::store::Store;
use sbmesh::store::open::{open_cluster_store, probe};
use sbmesh::store::sealed::AtRestRing;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt;
use tracing::{info, warn};

use crate::settings::Settings;

/// Certificates listed in this node's mesh metadata at most (see
/// `publish_meta`).
const MAX_CERTS_IN_META: usize = 400;

/// Exit code after a clean drain.
pub const EXIT_OK: i32 = 0;
/// Exit code when the drain budget ran out.
pub const EXIT_DRAIN_TIMEOUT: i32 = 1;

/// Runs the sidecar; returns the process exit code.
pub async fn run(settings: Settings) -> anyhow::Result<i32> {
    // First of all, so that a proxy reading its certificate files at
    // start-up finds some: self-signed placeholders until the CA's arrive.
    match sbmesh::acme::manager::write_startup_placeholders(&settings.config, &settings.cert_dir) {
        Ok(0) => {}
        Ok(n) => info!(
            certificates = n,
            dir = %settings.cert_dir.display(),
            "placeholder certificates written until the CA's arrive"
        ),
        Err(e) => {
            warn!(dir = %settings.cert_dir.display(), "cannot write placeholder certificates: {e}")
        }
    }
    let metrics = Arc::new(Metrics::new());
    let keys = match settings.cluster_key.clone() {
        Some(keys) => keys,
        None => {
            // Validation refuses peers without a key, so this node is alone:
            // a throwaway key keeps the code path (and the sockets) the same.
            warn!("no cluster key configured: running alone with an ephemeral key");
            let mut k = [0u8; 32];
            aws_lc_rs::rand::fill(&mut k).map_err(|_| anyhow::anyhow!("no system randomness"))?;
            vec![k]
        }
    };
    let mesh_cfg = MeshConfig {
        node_id: settings.node_id.clone(),
        cluster_id: settings.cluster_id.clone(),
        bind: settings.bind,
        gossip_port: settings.gossip_port,
        transport_port: settings.transport_port,
        advertise: settings.advertise,
        seeds: SeedSource {
            seeds: settings.seeds.clone(),
            mesh_service: settings.mesh_service.clone(),
            gossip_port: settings.gossip_port,
        },
        keys,
        key_file: settings.cluster_key_file.clone(),
        tuning: SwimTuning::default(),
    };
    let meta = NodeMeta {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        config_hash: Some(format!("sha256:{}", settings.config_sha256)),
        ready: false,
        ..NodeMeta::default()
    };
    let mesh = Mesh::start(mesh_cfg, metrics.clone(), meta.clone())
        .await
        .context("starting the mesh")?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let store_health = Arc::new(std::sync::Mutex::new(Some(
        "store: not probed yet".to_owned(),
    )));
    let (store_tx, store_rx) = watch::channel(None);
    tokio::spawn(keep_store_probed(
        settings.clone(),
        metrics.clone(),
        store_health.clone(),
        store_tx,
        stop_rx.clone(),
    ));
    let store_check: ReadinessCheck = Arc::new(move || {
        store_health
            .lock()
            .map(|h| h.clone())
            .unwrap_or_else(|_| Some("store: health unknown".to_owned()))
    });
    // How new certificates reach the proxy (--proxy-cert-apply): one
    // callback for the ACME manager and every --watch-tls directory, set
    // once its target exists (a restart needs the store).
    let apply = Arc::new(ApplySlot::default());
    let (proxy_tx, proxy_rx) = watch::channel(ProxyStatus::default());
    let tls_watchers: Vec<TlsWatcher> = settings
        .watch_tls
        .iter()
        .map(|dir| {
            info!(dir = %dir.display(), apply = settings.proxy_cert_apply.as_str(), "watching a certificate directory");
            TlsWatcher::spawn(WatchTlsConfig::new(dir), apply.caller(), metrics.clone())
        })
        .collect();
    let mut readiness = vec![mesh_running(mesh.clone()), store_check];
    if settings.proxy_cert_apply == CertApply::Restart {
        readiness.push(restart_readiness(proxy_rx.clone()));
    }
    if !tls_watchers.is_empty() {
        readiness.push(watch_tls_readiness(
            tls_watchers.iter().map(TlsWatcher::problem).collect(),
        ));
    }
    let state = AdminState {
        mesh: mesh.clone(),
        metrics: metrics.clone(),
        auth: AdminAuth::new(
            settings.admin_user.as_deref(),
            settings.admin_password.as_deref(),
        ),
        readiness,
    };

    let admin = TcpListener::bind(settings.admin_listen)
        .await
        .with_context(|| format!("binding --admin-listen {}", settings.admin_listen))?;
    let admin_task = tokio::spawn(serve(
        admin,
        "admin",
        admin_router(state.clone()),
        metrics.clone(),
        stop_rx.clone(),
    ));

    // The HTTP-01 responder needs the store; until the store is open the
    // port answers 404 for every path, as it does for unknown tokens.
    let challenge = TcpListener::bind(settings.challenge_listen)
        .await
        .with_context(|| format!("binding --challenge-listen {}", settings.challenge_listen))?;
    let responder: Arc<OnceLock<Router>> = Arc::new(OnceLock::new());
    let challenge_task = tokio::spawn(serve(
        challenge,
        "challenge",
        deferred_router(responder.clone()),
        metrics.clone(),
        stop_rx.clone(),
    ));

    // Hot reload: every distinct valid content of --config is POSTed to the
    // proxy once. The proxy read the file as it is now when it started.
    let reload_cfg = ReloaderConfig {
        authorization: settings.proxy_authorization.clone(),
        debounce: settings.reload_debounce,
        rescan: settings.reload_rescan,
        assume_delivered: Some(settings.config_sha256.clone()),
        initial_config: Arc::new(settings.config.clone()),
        sidecar_ports: Some(sbmesh::config::SidecarPorts {
            gossip: settings.gossip_port,
            transport: settings.transport_port,
        }),
        ..ReloaderConfig::new(
            settings.config_path.clone(),
            settings.proxy_reload_url.clone(),
        )
    };
    let reloader = Reloader::spawn(reload_cfg, metrics.clone())
        .map_err(|e| anyhow::anyhow!("--proxy-reload-url / --proxy-authorization: {e}"))?;
    match settings.proxy_cert_apply {
        CertApply::Reload => {
            let reload = reloader.trigger();
            apply.set(Arc::new(move || reload.certificates_changed()));
        }
        CertApply::None => apply.set(Arc::new(|| {})),
        // Set once the store is open (run_acme).
        CertApply::Restart => {}
    }

    // ACME: hostnames follow the config file as the reloader reads it; the
    // manager starts once the store is open.
    let (acme_tx, acme_rx) = watch::channel(AcmeStatus::default());
    let acme_task = tokio::spawn(run_acme(
        settings.clone(),
        AcmeParts {
            mesh: mesh.clone(),
            metrics: metrics.clone(),
            config: reloader.config(),
            apply: apply.clone(),
            proxy_status: proxy_tx,
            store: store_rx,
            responder,
            status: acme_tx,
        },
        stop_rx.clone(),
    ));
    tokio::spawn(publish_meta(
        state,
        meta,
        reloader.status(),
        acme_rx,
        proxy_rx,
        stop_rx.clone(),
    ));
    info!(
        admin = %settings.admin_listen,
        challenge = %settings.challenge_listen,
        "sidecar running"
    );
    // Start-up code runs once; its pages need not stay resident.
    tokio::spawn(async {
        tokio::time::sleep(crate::memory::STARTUP_SETTLE).await;
        let _ = tokio::task::spawn_blocking(crate::memory::release_startup_pages).await;
    });

    let signal = shutdown_signal().await;
    info!(
        signal,
        grace_ms = settings.shutdown_grace.as_millis() as u64,
        "draining"
    );
    let drain = async {
        drop(tls_watchers);
        acme_task.abort();
        drop(reloader);
        mesh.leave().await;
        let _ = stop_tx.send(true);
        let _ = admin_task.await;
        let _ = challenge_task.await;
    };
    match tokio::time::timeout(settings.shutdown_grace, drain).await {
        Ok(()) => {
            info!("drained");
            Ok(EXIT_OK)
        }
        Err(_) => {
            warn!("drain budget ran out");
            Ok(EXIT_DRAIN_TIMEOUT)
        }
    }
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

/// What the ACME task needs from the rest of the sidecar.
struct AcmeParts {
    mesh: Mesh,
    metrics: Arc<Metrics>,
    config: watch::Receiver<Arc<SbConfig>>,
    apply: Arc<ApplySlot>,
    proxy_status: watch::Sender<ProxyStatus>,
    store: watch::Receiver<Option<Arc<dyn Store>>>,
    responder: Arc<OnceLock<Router>>,
    status: watch::Sender<AcmeStatus>,
}

/// Waits for the store, then serves challenges from it and runs the ACME
/// manager, whose status goes into the node metadata.
async fn run_acme(settings: Settings, mut parts: AcmeParts, mut stop: watch::Receiver<bool>) {
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
    let _coordinator = if settings.proxy_cert_apply == CertApply::Restart {
        let cfg = RestartConfig {
            min_interval: settings.proxy_restart_interval,
            ..RestartConfig::new(
                &settings.node_id,
                &settings.proxy_process_name,
                &settings.proxy_health_url,
            )
        };
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
    // The at-rest ring follows the mesh's, which the key file rotates.
    let key_ring = match settings.cluster_key {
        Some(_) => AtRestRing::following(parts.mesh.key_rings()),
        None => AtRestRing::plain(),
    };
    let cfg = AcmeManagerConfig {
        key_ring,
        max_concurrent_orders: settings.acme_concurrent_orders,
        max_orders_per_interval: settings.acme_max_orders,
        order_interval: settings.acme_orders_interval,
        order_lock_ttl: settings.acme_order_lock_ttl,
        ..AcmeManagerConfig::new(settings.node_id.clone(), settings.cert_dir.clone())
    };
    let _manager = AcmeManager::spawn_into(
        cfg,
        AcmeInputs {
            store,
            mesh: parts.mesh,
            metrics: parts.metrics,
            config: parts.config,
            certificates_changed: parts.apply.caller(),
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
    use sbmesh::http::listener as limited;
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
            next.acme = (!a.not_eligible.is_empty() || a.refusal.is_some()).then(|| AcmeInfo {
                not_eligible: a.not_eligible.clone(),
                refusal: a.refusal.clone(),
            });
        }
        if next != meta {
            meta = next;
            state.mesh.set_meta(meta.clone()).await;
        }
    }
}

/// Opens the certificate store (`proxy.acme.storage_backend`, else a redb
/// file in `--state-dir`) and probes it every 5 s; `/readyz` reads the last
/// outcome. A store that cannot be opened yet is retried, never fatal.
async fn keep_store_probed(
    settings: Settings,
    metrics: Arc<Metrics>,
    health: Arc<std::sync::Mutex<Option<String>>>,
    opened: watch::Sender<Option<Arc<dyn Store>>>,
    mut stop: watch::Receiver<bool>,
) {
    let acme = settings.config.sbmesh().acme.as_ref();
    let backend = acme
        .and_then(|a| a.storage_backend)
        .unwrap_or(StorageBackend::Redb);
    let path = acme
        .and_then(|a| a.storage_path.clone())
        .unwrap_or_default();
    let set = |v: Option<String>| {
        if let Ok(mut h) = health.lock() {
            *h = v;
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
                &path,
                &settings.state_dir,
                &settings.cluster_id,
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
                    set(Some(format!("store: {e}")));
                }
            }
        }
        if let Some(s) = &store {
            match probe(s.as_ref()).await {
                Ok(()) => set(None),
                Err(e) => set(Some(format!("store: {e}"))),
            }
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

async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return "SIGINT";
        }
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = tokio::signal::ctrl_c() => "SIGINT",
    }
}
