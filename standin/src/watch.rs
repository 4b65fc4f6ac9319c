//! The proxy's own config watcher: the config file's parent directory (a
//! ConfigMap mount swaps its `..data` symlink), 250 ms of quiet, then the
//! file is re-read and applied like a reload unless its sha256 is that of
//! the config last applied.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};

use crate::admin::{ReloadError, Shared, Trigger};
use crate::log::{error, info};
use crate::serve::stopped;

/// Quiet time after the last event before the file is read.
pub const QUIET: Duration = Duration::from_millis(250);

/// Starts watching; the watcher stops when the returned value is dropped.
pub fn spawn(
    shared: Arc<Shared>,
    shutdown: watch::Receiver<bool>,
) -> Result<RecommendedWatcher, String> {
    let dir = match shared.config_path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => Path::new(".").to_path_buf(),
    };
    let name = shared.config_path.file_name().map(|n| n.to_owned());
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<Event>| {
        let Ok(event) = res else { return };
        // Our own reads of the file are not changes.
        if matches!(event.kind, EventKind::Access(kind)
            if kind != AccessKind::Close(AccessMode::Write))
        {
            return;
        }
        // The file itself, or the kubelet's `..data` / `..<timestamp>`
        // entries; not other files of the directory.
        let relevant = event.need_rescan()
            || event.paths.is_empty()
            || event.paths.iter().any(|p| {
                p.file_name().is_some_and(|n| {
                    Some(n) == name.as_deref() || n.as_encoded_bytes().starts_with(b"..")
                })
            });
        if relevant {
            let _ = tx.send(());
        }
    })
    .map_err(|e| format!("config watcher: {e}"))?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .map_err(|e| format!("config watcher on {}: {e}", dir.display()))?;
    info!("watching {} for config changes", dir.display());
    tokio::spawn(async move {
        let stop = stopped(shutdown);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => return,
                event = rx.recv() => if event.is_none() { return },
            }
            // Wait for QUIET without events.
            loop {
                match tokio::time::timeout(QUIET, rx.recv()).await {
                    Ok(Some(())) => continue,
                    Ok(None) => return,
                    Err(_) => break,
                }
            }
            match shared.reload(Trigger::Watcher).await {
                Ok(None) => info!("watcher: config file unchanged (same sha256), skipped"),
                Ok(Some(o)) => info!(
                    "watcher: applied revision {} fully_applied={} degraded={:?}",
                    o.revision, o.fully_applied, o.degraded
                ),
                Err(ReloadError::Busy) => unreachable!("the watcher waits for a running reload"),
                Err(ReloadError::Read(m)) => {
                    error!("watcher: failed to read config file: {m}")
                }
                Err(ReloadError::Config(e)) => {
                    error!("watcher: {e}; the running config stays")
                }
            }
        }
    });
    Ok(watcher)
}
