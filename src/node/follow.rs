//! How a node follows its config file: the reloader when there is a proxy to
//! tell, else a watcher alone; without a file, a fixed configuration.

use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::SbConfig;
use crate::metrics::Metrics;
use crate::reload::{ReloadStatus, ReloadTrigger, Reloader, ReloaderConfig, ReloaderHandle};

use super::NodeError;
use super::config::NodeConfig;

/// Without a proxy to POST to, the hash this node announces is that of
/// the newest valid content of the file.
async fn follow_hash(
    mut content: mpsc::Receiver<crate::reload::machine::Input>,
    status: watch::Sender<ReloadStatus>,
) {
    while let Some(input) = content.recv().await {
        if let crate::reload::machine::Input::ContentSeen {
            sha256,
            valid: true,
        } = input
        {
            let hash = format!("sha256:{sha256}");
            status.send_if_modified(|s| {
                let changed = s.delivered_hash.as_deref() != Some(hash.as_str());
                s.delivered_hash = Some(hash);
                changed
            });
        }
    }
}

/// How the node follows its configuration ([`follow_config`]).
pub(super) struct FollowedConfig {
    pub(super) config: watch::Receiver<Arc<SbConfig>>,
    pub(super) reload: watch::Receiver<ReloadStatus>,
    /// Tells the reloader certificates changed (only when it POSTs).
    pub(super) trigger: Option<ReloadTrigger>,
    pub(super) reloader: Option<ReloaderHandle>,
    /// Keeps a fixed configuration's channel open.
    pub(super) fixed: Option<watch::Sender<Arc<SbConfig>>>,
    pub(super) tasks: Vec<JoinHandle<()>>,
}

/// The config file: every distinct valid content is POSTed to the proxy
/// once (the proxy read the file as it is now when it started), or only
/// followed when there is no proxy to tell; without a file the
/// configuration is fixed.
pub(super) fn follow_config(
    cfg: &NodeConfig,
    metrics: &Arc<Metrics>,
) -> Result<FollowedConfig, NodeError> {
    let sidecar_ports = Some(crate::config::SidecarPorts {
        gossip: cfg.gossip_port,
        transport: cfg.transport_port,
    });
    let mut tasks = Vec::new();
    let mut fixed = None;
    let mut reloader = None;
    let (config, reload, trigger) = match (&cfg.config_path, &cfg.proxy.reload) {
        (Some(path), Some(proxy)) => {
            let reload_cfg = ReloaderConfig {
                authorization: proxy.authorization.clone(),
                debounce: cfg.reload.debounce,
                rescan: cfg.reload.rescan,
                assume_delivered: cfg.config_sha256.clone(),
                initial_config: Arc::new(cfg.config.clone()),
                sidecar_ports,
                ..ReloaderConfig::new(path.clone(), proxy.url.clone())
            };
            let handle = Reloader::spawn(reload_cfg, metrics.clone())?;
            let out = (handle.config(), handle.status(), Some(handle.trigger()));
            reloader = Some(handle);
            out
        }
        (Some(path), None) => {
            let (status_tx, status_rx) = watch::channel(ReloadStatus {
                delivered_hash: cfg.config_hash(),
                last_result: None,
            });
            let watching = crate::reload::watcher::spawn(
                crate::reload::watcher::WatchSpec {
                    path: path.clone(),
                    debounce: cfg.reload.debounce,
                    rescan: cfg.reload.rescan,
                    events: true,
                    ports: sidecar_ports,
                },
                Arc::new(cfg.config.clone()),
            );
            tasks.push(watching.task);
            tasks.push(tokio::spawn(follow_hash(watching.contents, status_tx)));
            (watching.config, status_rx, None)
        }
        (None, _) => {
            let (config_tx, config_rx) = watch::channel(Arc::new(cfg.config.clone()));
            fixed = Some(config_tx);
            let status = ReloadStatus {
                delivered_hash: cfg.config_hash(),
                last_result: None,
            };
            // The sender lives as long as the receiver needs no change.
            let (status_tx, status_rx) = watch::channel(status);
            tasks.push(tokio::spawn(async move {
                status_tx.closed().await;
            }));
            (config_rx, status_rx, None)
        }
    };
    Ok(FollowedConfig {
        config,
        reload,
        trigger,
        reloader,
        fixed,
        tasks,
    })
}
