//! Watches the config file and turns what it finds into
//! [`Input::ContentSeen`] for the state machine.
//!
//! inotify ([`DirWatch`]) watches the file's *directory*, not the file:
//! the kubelet updates a ConfigMap mount by renaming a `..data` symlink over
//! the old one, editors rename a temporary file over the original, and
//! either replaces the inode a file watch would be attached to. Any event in
//! the directory opens a debounce window; at its end the file is read,
//! hashed and validated. A full re-read every `rescan` catches whatever
//! inotify missed (overflowed queues, unsupported file systems).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use super::machine::Input;
use crate::config::{self, Problem, ReadError, SbConfig, SidecarPorts};

/// What one read of the config file found.
#[derive(Debug)]
pub(crate) enum Observation {
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
pub(crate) async fn observe(path: &Path, ports: Option<SidecarPorts>) -> Observation {
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
                .map(|p| config::config_conflicts(&cfg, p))
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

/// A watch of one directory (not recursive) for what can change a file's
/// content: a write closed, a rename in or out, a creation, a deletion, an
/// attribute change, the directory itself removed or moved. Kubelet mounts
/// swap a `..data` symlink inside the directory, so the directory is what
/// is watched, for the config file and for `--watch-tls` alike.
///
/// Opens and reads are not watched: the proxy reading its config, and our
/// own reads after each event, would otherwise wake the watcher for
/// nothing (and every watcher of a directory that several processes share
/// for every read by any of them). The inotify descriptor is polled by the
/// runtime itself, so a watch costs no thread. Elsewhere than Linux there
/// is no watch and the callers' rescan alone notices changes.
pub(crate) struct DirWatch {
    #[cfg(target_os = "linux")]
    fd: tokio::io::unix::AsyncFd<inotify::Inotify>,
    /// A read failed for another reason than "nothing queued": the watch
    /// is given up and the rescan alone remains.
    #[cfg(target_os = "linux")]
    broken: bool,
}

#[cfg(target_os = "linux")]
const CONTENT_CHANGES: inotify::WatchMask = inotify::WatchMask::CLOSE_WRITE
    .union(inotify::WatchMask::MODIFY)
    .union(inotify::WatchMask::MOVED_FROM)
    .union(inotify::WatchMask::MOVED_TO)
    .union(inotify::WatchMask::CREATE)
    .union(inotify::WatchMask::DELETE)
    .union(inotify::WatchMask::ATTRIB)
    .union(inotify::WatchMask::DELETE_SELF)
    .union(inotify::WatchMask::MOVE_SELF);

impl DirWatch {
    /// Starts watching `dir`; `None` when the watch cannot be set up
    /// (logged with `what`, the watcher's name).
    #[cfg(target_os = "linux")]
    pub(crate) fn new(dir: &Path, what: &str) -> Option<Self> {
        let started = inotify::Inotify::init().and_then(|inotify| {
            inotify.watches().add(dir, CONTENT_CHANGES)?;
            // SAFETY: `Inotify` owns its descriptor, closes it only when
            // dropped and always returns that same one from `as_raw_fd`.
            let fd = unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(
                    inotify,
                    tokio::io::Interest::READABLE,
                )
            };
            Ok(fd?)
        });
        match started {
            Ok(fd) => Some(Self { fd, broken: false }),
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "{what}: cannot watch the directory with inotify; relying on the rescan");
                None
            }
        }
    }

    #[cfg(not(target_os = "linux"))]
    pub(crate) fn new(dir: &Path, what: &str) -> Option<Self> {
        tracing::info!(dir = %dir.display(), "{what}: no inotify on this platform; relying on the rescan");
        None
    }

    /// Waits for the next change and takes every event queued with it.
    /// Cancel-safe: nothing is read across an await.
    pub(crate) async fn changed(&mut self) {
        #[cfg(target_os = "linux")]
        while !self.broken {
            let Ok(mut ready) = self.fd.readable_mut().await else {
                break;
            };
            match ready.try_io(|fd| read_queued(fd.get_mut())) {
                Ok(Ok(_)) => return,
                // Nothing queued after all: readiness cleared, wait again.
                Err(_) => continue,
                Ok(Err(e)) => {
                    // Seen as a change once (it may hide one), then given up.
                    tracing::warn!(error = %e, "inotify read failed; relying on the rescan");
                    self.broken = true;
                    return;
                }
            }
        }
        std::future::pending::<()>().await
    }

    /// Discards the events queued now (the rest of a burst that a read is
    /// about to cover).
    pub(crate) fn drain(&mut self) {
        #[cfg(target_os = "linux")]
        let _ = read_queued(self.fd.get_mut());
    }
}

/// Reads every event queued on `inotify` (each one is relevant: only
/// [`CONTENT_CHANGES`] are watched; a queue overflow may hide one too);
/// how many, or `WouldBlock` when there was none.
#[cfg(target_os = "linux")]
fn read_queued(inotify: &mut inotify::Inotify) -> std::io::Result<usize> {
    let mut buf = [0u8; 1024];
    let mut seen = 0;
    loop {
        match inotify.read_events(&mut buf) {
            Ok(events) => seen += events.count(),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && seen > 0 => return Ok(seen),
            Err(e) => return Err(e),
        }
    }
}

/// Waits for `watch`'s next change; never, without a watch.
pub(crate) async fn next_change(watch: &mut Option<DirWatch>) {
    match watch {
        Some(w) => w.changed().await,
        None => std::future::pending().await,
    }
}

/// The directory holding `path`.
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// What the config watcher follows and how: the one description both its
/// starters (the reloader and a node without a proxy to tell) fill in.
#[derive(Clone, Debug)]
pub(crate) struct WatchSpec {
    /// The config file.
    pub path: PathBuf,
    /// How long a burst of directory events may last before the file is read.
    pub debounce: Duration,
    /// The full re-read's period, whatever inotify says.
    pub rescan: Duration,
    /// Whether to watch the directory at all (else only `rescan`).
    pub events: bool,
    /// The sidecar's ports: content that conflicts with them is invalid.
    pub ports: Option<SidecarPorts>,
}

/// A running watcher ([`spawn`]).
pub(crate) struct Watching {
    pub task: tokio::task::JoinHandle<()>,
    /// Every read of the file, for whoever decides on it.
    pub contents: mpsc::Receiver<Input>,
    /// The newest valid content, parsed (starting from `initial`): the one
    /// reading of the file other components follow.
    pub config: watch::Receiver<Arc<SbConfig>>,
}

/// Starts watching `spec.path` ([`run`]).
pub(crate) fn spawn(spec: WatchSpec, initial: Arc<SbConfig>) -> Watching {
    let (content_tx, contents) = mpsc::channel(16);
    let (parsed_tx, config) = watch::channel(initial);
    Watching {
        task: tokio::spawn(run(spec, content_tx, parsed_tx)),
        contents,
        config,
    }
}

/// Watches the file forever, sending what it reads to `tx`: once at start,
/// after every debounced burst of directory events (when `events`), and
/// every `rescan`. Each new valid content, parsed, also goes to `parsed`.
/// Returns when `tx` is closed.
async fn run(spec: WatchSpec, tx: mpsc::Sender<Input>, parsed: watch::Sender<Arc<SbConfig>>) {
    let WatchSpec {
        path,
        debounce,
        rescan,
        events: watch,
        ports,
    } = spec;
    // Without a watch, only the rescan remains.
    let mut events = watch
        .then(|| DirWatch::new(&parent_dir(&path), "reload"))
        .flatten();
    let mut rescan = tokio::time::interval(rescan.max(Duration::from_millis(10)));
    rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_logged: Option<String> = None;
    loop {
        tokio::select! {
            _ = rescan.tick() => {}
            () = next_change(&mut events) => {
                // Let the rest of the burst (a kubelet swap is several
                // events) land before reading.
                tokio::time::sleep(debounce).await;
                if let Some(w) = &mut events {
                    w.drain();
                }
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

    /// Whether `watch` reports a change within `wait`.
    async fn changes_within(watch: &mut DirWatch, wait: Duration) -> bool {
        tokio::time::timeout(wait, watch.changed()).await.is_ok()
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_directory_watch_sees_writes_and_renames_but_not_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sb.yml");
        std::fs::write(&path, "a: 1\n").unwrap();
        let mut watch = DirWatch::new(dir.path(), "test").expect("inotify");
        let wait = Duration::from_millis(300);

        for _ in 0..50 {
            std::fs::read(&path).unwrap();
        }
        assert!(
            !changes_within(&mut watch, wait).await,
            "reads woke the watch"
        );

        std::fs::write(&path, "a: 2\n").unwrap();
        assert!(changes_within(&mut watch, wait).await, "an in-place write");
        // The events of that one write were all taken with it.
        assert!(!changes_within(&mut watch, wait).await);

        let tmp = dir.path().join(".sb.yml.tmp");
        std::fs::write(&tmp, "a: 3\n").unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        watch.drain();
        assert!(!changes_within(&mut watch, wait).await, "drained");

        let link = dir.path().join("..data");
        std::os::unix::fs::symlink("somewhere", &link).unwrap();
        assert!(changes_within(&mut watch, wait).await, "a symlink created");
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
