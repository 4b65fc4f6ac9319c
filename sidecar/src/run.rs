//! `sbmesh-sidecar run`: builds the library's parts from the settings and
//! runs them until SIGTERM/SIGINT, then drains.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::http::StatusCode;
use sbmesh::config::StorageBackend;
use sbmesh::http::{AdminAuth, AdminState, ReadinessCheck, admin_router, mesh_running};
use sbmesh::mesh::{Mesh, MeshConfig, NodeMeta, SeedSource, SwimTuning};
use sbmesh::metrics::Metrics;
use sbmesh::reload::{ReloadStatus, Reloader, ReloaderConfig};
use sbmesh::store::open::{open_store, probe};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::settings::Settings;

/// Exit code after a clean drain.
pub const EXIT_OK: i32 = 0;
/// Exit code when the drain budget ran out.
pub const EXIT_DRAIN_TIMEOUT: i32 = 1;

/// Runs the sidecar; returns the process exit code.
pub async fn run(settings: Settings) -> anyhow::Result<i32> {
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
    tokio::spawn(keep_store_probed(
        settings.clone(),
        metrics.clone(),
        store_health.clone(),
        stop_rx.clone(),
    ));
    let store_check: ReadinessCheck = Arc::new(move || {
        store_health
            .lock()
            .map(|h| h.clone())
            .unwrap_or_else(|_| Some("store: health unknown".to_owned()))
    });
    let state = AdminState {
        mesh: mesh.clone(),
        metrics: metrics.clone(),
        auth: AdminAuth::new(
            settings.admin_user.as_deref(),
            settings.admin_password.as_deref(),
        ),
        readiness: vec![mesh_running(mesh.clone()), store_check],
    };

    let admin = TcpListener::bind(settings.admin_listen)
        .await
        .with_context(|| format!("binding --admin-listen {}", settings.admin_listen))?;
    let admin_task = tokio::spawn(serve(admin, admin_router(state.clone()), stop_rx.clone()));

    // The HTTP-01 responder arrives with the ACME issuer; until then the
    // port answers 404 for every path, as it will for unknown tokens.
    let challenge = TcpListener::bind(settings.challenge_listen)
        .await
        .with_context(|| format!("binding --challenge-listen {}", settings.challenge_listen))?;
    let challenge_router = Router::new().fallback(|| async { StatusCode::NOT_FOUND });
    let challenge_task = tokio::spawn(serve(challenge, challenge_router, stop_rx.clone()));

    // Hot reload: every distinct valid content of --config is POSTed to the
    // proxy once. The proxy read the file as it is now when it started.
    let reload_cfg = ReloaderConfig {
        authorization: settings.proxy_authorization.clone(),
        debounce: settings.reload_debounce,
        rescan: settings.reload_rescan,
        assume_delivered: Some(settings.config_sha256.clone()),
        ..ReloaderConfig::new(
            settings.config_path.clone(),
            settings.proxy_reload_url.clone(),
        )
    };
    let reloader = Reloader::spawn(reload_cfg, metrics.clone())
        .map_err(|e| anyhow::anyhow!("--proxy-reload-url / --proxy-authorization: {e}"))?;
    tokio::spawn(publish_meta(
        state,
        meta,
        reloader.status(),
        stop_rx.clone(),
    ));
    info!(
        admin = %settings.admin_listen,
        challenge = %settings.challenge_listen,
        "sidecar running"
    );

    let signal = shutdown_signal().await;
    info!(
        signal,
        grace_ms = settings.shutdown_grace.as_millis() as u64,
        "draining"
    );
    let drain = async {
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

async fn serve(listener: TcpListener, router: Router, mut stop: watch::Receiver<bool>) {
    let service = router.into_make_service_with_connect_info::<SocketAddr>();
    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    if let Err(e) = axum::serve(listener, service)
        .with_graceful_shutdown(shutdown)
        .await
    {
        warn!(error = %e, "http listener failed");
    }
}

/// The one owner of this node's mesh metadata: readiness (every 500 ms)
/// and the reloader's delivered config hash and last result, so every
/// node's status shows which pod runs which config.
async fn publish_meta(
    state: AdminState,
    mut meta: NodeMeta,
    mut reload: watch::Receiver<ReloadStatus>,
    stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            r = reload.changed() => {
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
        {
            let r = reload.borrow();
            if let Some(hash) = &r.delivered_hash {
                next.config_hash = Some(hash.clone());
            }
            if r.last_result.is_some() {
                next.last_reload = r.last_result.clone();
            }
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
    mut stop: watch::Receiver<bool>,
) {
    let acme = settings.config.proxy.acme.as_ref();
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
            match open_store(backend, &path, &settings.state_dir, metrics.clone()).await {
                Ok(s) => {
                    info!(backend = %backend, "certificate store opened");
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
