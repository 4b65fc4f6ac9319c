//! `sbmesh-sidecar run`: maps the settings onto a [`NodeConfig`], starts
//! the library's [`Node`] (everything the sidecar does lives there, so a
//! proxy embedding the library gets the same), and runs it until
//! SIGTERM/SIGINT, then drains.

use anyhow::anyhow;
use sbmesh::node::{Drain, Node, NodeConfig, NodeError, ProxyReload, ProxyRestart};
use tracing::{info, warn};

use crate::settings::Settings;

/// Exit code after a clean drain.
pub const EXIT_OK: i32 = 0;
/// Exit code when the drain budget ran out.
pub const EXIT_DRAIN_TIMEOUT: i32 = 1;

/// The node the settings describe.
fn node_config(settings: &Settings) -> NodeConfig {
    let mut cfg = NodeConfig::new(
        settings.node_id.clone(),
        settings.cluster_id.clone(),
        settings.config.clone(),
    );
    cfg.version = env!("CARGO_PKG_VERSION").to_owned();
    cfg.config_path = Some(settings.config_path.clone());
    cfg.config_sha256 = Some(settings.config_sha256.clone());
    cfg.bind = settings.bind;
    cfg.gossip_port = settings.gossip_port;
    cfg.transport_port = settings.transport_port;
    cfg.advertise = settings.advertise;
    cfg.seeds = settings.seeds.clone();
    cfg.mesh_service = settings.mesh_service.clone();
    cfg.cluster_key = settings.cluster_key.clone();
    cfg.cluster_key_file = settings.cluster_key_file.clone();
    cfg.admin_listen = Some(settings.admin_listen);
    cfg.admin_user = settings.admin_user.clone();
    cfg.admin_password = settings.admin_password.clone();
    cfg.challenge_listen = Some(settings.challenge_listen);
    cfg.proxy_reload = Some(ProxyReload {
        url: settings.proxy_reload_url.clone(),
        authorization: settings.proxy_authorization.clone(),
    });
    cfg.reload_debounce = settings.reload_debounce;
    cfg.reload_rescan = settings.reload_rescan;
    cfg.cert_dir = settings.cert_dir.clone();
    cfg.state_dir = settings.state_dir.clone();
    cfg.cert_apply = settings.proxy_cert_apply;
    cfg.proxy_restart = ProxyRestart {
        process_name: settings.proxy_process_name.clone(),
        health_url: settings.proxy_health_url.clone(),
        min_interval: settings.proxy_restart_interval,
    };
    cfg.watch_tls = settings.watch_tls.clone();
    cfg.acme_concurrent_orders = settings.acme_concurrent_orders;
    cfg.acme_max_orders = settings.acme_max_orders;
    cfg.acme_orders_interval = settings.acme_orders_interval;
    cfg.acme_order_lock_ttl = settings.acme_order_lock_ttl;
    cfg
}

/// A start-up error in the words of the command line.
fn in_flag_terms(e: NodeError) -> anyhow::Error {
    match e {
        NodeError::Bind { what, addr, source } => {
            anyhow!(source).context(format!("binding --{what}-listen {addr}"))
        }
        NodeError::Reload(e) => anyhow!("--proxy-reload-url / --proxy-authorization: {e}"),
        other => anyhow!(other),
    }
}

/// Runs the sidecar; returns the process exit code.
pub async fn run(settings: Settings) -> anyhow::Result<i32> {
    let node = Node::start(node_config(&settings))
        .await
        .map_err(in_flag_terms)?;
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
    match node.shutdown(settings.shutdown_grace).await {
        Drain::Clean => {
            info!("drained");
            Ok(EXIT_OK)
        }
        Drain::TimedOut => {
            warn!("drain budget ran out");
            Ok(EXIT_DRAIN_TIMEOUT)
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
