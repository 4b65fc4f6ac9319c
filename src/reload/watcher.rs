//! Watches the config file and turns what it finds into
//! [`Input::ContentSeen`] for the state machine.
//!
//! inotify (through `notify`) watches the file's *directory*, not the file:
//! the kubelet updates a ConfigMap mount by renaming a `..data` symlink over
//! the old one, editors rename a temporary file over the original, and
//! either replaces the inode a file watch would be attached to. Any event in
//! the directory opens a debounce window; at its end the file is read,
//! hashed and validated. A full re-read every `rescan` catches whatever
//! inotify missed (overflowed queues, unsupported file systems).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::event::{AccessKind, AccessMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::{mpsc, watch};

use super::machine::Input;
use crate::config::{self, Problem, ReadError, SbConfig, SidecarPorts};

/// What one read of the config file found.
#[derive(Debug)]
pub enum Observation {
    /// The file was read; `problems` holds the errors when it is invalid.
    Content {
        /// Lowercase hex sha256 of the raw bytes.
        sha256: String,
        /// Validation errors and warnings; valid when none is an error.
        problems: Vec<Problem>,
        /// The parsed configuration, when valid.
        config: Option<Box<SbConfig>>,
    },
    /// The file could not be read (missing mid-swap, permissions): nothing
    /// to decide on; the next event or rescan reads it again.
    Unreadable(String),
}

/// Reads, hashes and validates the config file the way `validate` does
/// (interpolating `${VAR}` from the process environment); with `ports`, a
/// conflict with the sidecar's mesh or ACME makes the content invalid too.
pub async fn observe(path: &Path, ports: Option<SidecarPorts>) -> Observation {
    // Reading and parsing (up to MAX_CONFIG_BYTES of YAML: seconds of CPU)
    // stay off the runtime's thread, which also drives the mesh.
    let owned = path.to_path_buf();
    tokio::task::spawn_blocking(move || observe_blocking(&owned, ports))
        .await
        .unwrap_or_else(|e| Observation::Unreadable(format!("{}: {e}", path.display())))
}

fn observe_blocking(path: &Path, ports: Option<SidecarPorts>) -> Observation {
    // The same bounded read as `validate` and start-up.
    let raw = match config::read_bounded(path) {
        Ok(raw) => raw,
        Err(ReadError::TooLarge {
            message,
            sha256_of_prefix,
        }) => {
            return Observation::Content {
                sha256: sha256_of_prefix,
                problems: vec![Problem::error(path.display().to_string(), message)],
                config: None,
            };
        }
        Err(e) => return Observation::Unreadable(format!("{}: {e}", path.display())),
    };
    let sha256 = config::sha256_hex(&raw);
    match config::parse_bytes(&raw, &|name| std::env::var(name).ok()) {
        Ok(cfg) => {
            let conflicts = ports
                .map(|p| config::conflicts(&cfg, p))
                .unwrap_or_default();
            if conflicts.is_empty() {
                Observation::Content {
                    sha256,
                    problems: cfg.warnings(),
                    config: Some(Box::new(cfg)),
                }
            } else {
                Observation::Content {
                    sha256,
                    problems: conflicts,
                    config: None,
                }
            }
        }
        Err(problems) => Observation::Content {
            sha256,
            problems,
            config: None,
        },
    }
}

/// Starts an inotify watch of the directory `dir` (not recursive); every
/// relevant event lands, coalesced, in the returned receiver. `None` when
/// the watch cannot be set up (logged with `what`, the watcher's name):
/// the caller's rescan alone then notices changes. Kubelet mounts swap a
/// `..data` symlink inside the directory, so the directory is what is
/// watched, for the config file and for `--watch-tls` alike.
pub(crate) fn watch_directory(
    dir: &Path,
    what: &str,
) -> Option<(RecommendedWatcher, mpsc::Receiver<()>)> {
    let (tx, rx) = mpsc::channel(1);
    let handler = move |event: notify::Result<Event>| {
        let relevant = match &event {
            // Opens and reads (our own, among others) change nothing.
            Ok(event) => match event.kind {
                EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
                EventKind::Access(_) => false,
                _ => true,
            },
            // An error (e.g. a queue overflow) may hide a change: look.
            Err(_) => true,
        };
        if relevant {
            // A full channel already holds a wake-up: coalesce.
            let _ = tx.try_send(());
        }
    };
    let mut watcher = match notify::recommended_watcher(handler) {
        Ok(watcher) => watcher,
        Err(e) => {
            tracing::warn!(error = %e, "{what}: cannot start inotify; relying on the rescan");
            return None;
        }
    };
    if let Err(e) = watcher.watch(dir, RecursiveMode::NonRecursive) {
        tracing::warn!(dir = %dir.display(), error = %e, "{what}: cannot watch the directory; relying on the rescan");
        return None;
    }
    Some((watcher, rx))
}

/// The directory holding `path`.
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Watches `path` forever, sending what it reads to `tx`: once at start,
/// after every debounced burst of directory events (when `watch`), and every
/// `rescan`. Each new valid content, parsed, also goes to `parsed` (the
/// one reading of the file other components follow). Returns when `tx` is
/// closed.
pub async fn run(
    path: PathBuf,
    debounce: Duration,
    rescan: Duration,
    watch: bool,
    ports: Option<SidecarPorts>,
    tx: mpsc::Sender<Input>,
    parsed: watch::Sender<Arc<SbConfig>>,
) {
    // Without a watch, a channel that never yields (its sender is kept
    // alive here): only the rescan remains.
    let (_idle_tx, idle_rx) = mpsc::channel(1);
    let (_watcher, mut events) = match watch
        .then(|| watch_directory(&parent_dir(&path), "reload"))
        .flatten()
    {
        Some((watcher, rx)) => (Some(watcher), rx),
        None => (None, idle_rx),
    };
    let mut rescan = tokio::time::interval(rescan.max(Duration::from_millis(10)));
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_logged: Option<String> = None;
    loop {
        tokio::select! {
            _ = rescan.tick() => {}
            Some(()) = events.recv() => {
                // Let the rest of the burst (a kubelet swap is several
                // events) land before reading.
                tokio::time::sleep(debounce).await;
                while events.try_recv().is_ok() {}
            }
        }
        let input = match observe(&path, ports).await {
            Observation::Unreadable(reason) => {
                tracing::debug!(%reason, "reload: config file unreadable for now");
                continue;
            }
            Observation::Content {
                sha256,
                problems,
                config,
            } => {
                if let Some(config) = config {
                    parsed.send_if_modified(|current| {
                        let changed = **current != *config;
                        if changed {
                            *current = Arc::new(*config);
                        }
                        changed
                    });
                }
                let valid = !problems.iter().any(Problem::is_error);
                if !valid && last_logged.as_deref() != Some(sha256.as_str()) {
                    for problem in problems.iter().filter(|p| p.is_error()) {
                        tracing::warn!(config = %path.display(), %problem, "reload: invalid config, not reloading");
                    }
                    last_logged = Some(sha256.clone());
                }
                Input::ContentSeen { sha256, valid }
            }
        };
        if tx.send(input).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content(obs: Observation) -> (Vec<String>, bool) {
        match obs {
            Observation::Content {
                problems, config, ..
            } => (
                problems.iter().map(ToString::to_string).collect(),
                config.is_some(),
            ),
            Observation::Unreadable(reason) => panic!("unreadable: {reason}"),
        }
    }

    #[tokio::test]
    async fn a_conflict_with_the_sidecar_makes_the_content_invalid() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sb.yml");
        std::fs::write(
            &path,
            "proxy:\n  cluster: { cluster_id: own }\n  extensions: { sbmesh: {} }\n",
        )
        .unwrap();
        let ours = SidecarPorts {
            gossip: config::DEFAULT_GOSSIP_PORT,
            transport: config::DEFAULT_TRANSPORT_PORT,
        };
        let (problems, valid) = content(observe(&path, Some(ours)).await);
        assert!(!valid);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].starts_with("proxy.cluster.gossip_port: sbproxy's own mesh"));
        // Elsewhere: valid.
        let elsewhere = SidecarPorts {
            gossip: 7947,
            transport: 8947,
        };
        assert_eq!(
            content(observe(&path, Some(elsewhere)).await),
            (vec![], true)
        );
        // Too large: invalid, named by the file.
        std::fs::write(&path, vec![b'#'; config::MAX_CONFIG_BYTES as usize + 1]).unwrap();
        let (problems, valid) = content(observe(&path, None).await);
        assert!(
            !valid && problems[0].contains("larger than"),
            "{problems:?}"
        );
    }
}
