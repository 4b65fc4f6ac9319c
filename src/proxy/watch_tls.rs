//! `--watch-tls DIR` (docs/reference.md#sidecar-flags): a mounted `kubernetes.io/tls`
//! Secret (`tls.crt`, `tls.key`) whose renewal is applied to the running
//! proxy.
//!
//! The kubelet updates such a mount by renaming a `..data` symlink over the
//! old one (`tls.crt -> ..data/tls.crt`), so inotify watches the directory,
//! not the files, and a rescan every 30 s catches whatever it missed. Each
//! look reads both files (bounded) twice; a pair that changed between the
//! reads is read again shortly. A complete pair whose key matches its
//! certificate and whose chain parses, with content different from the
//! pair last applied, is applied (the callback: a reload or a restart,
//! `--proxy-cert-apply`). Anything else is never applied: it is logged,
//! counted in `sbmesh_watch_tls_rejected_total{reason}` and shown as a
//! problem until a valid pair replaces it. The pair present at start is
//! what the proxy read when it started: recorded, not applied.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::acme::certs;
use crate::config::sha256_hex;
use crate::http::ReadinessCheck;
use crate::metrics::Metrics;
use crate::reload::watcher::{DirWatch, next_change};

/// A `kubernetes.io/tls` Secret's keys are the names the sidecar writes its
/// own pairs under.
use crate::acme::deliver::{CHAIN_FILE as CERT_FILE, KEY_FILE};

/// Largest file read (the bound of every PEM the sidecar reads); a larger
/// one is rejected.
const MAX_TLS_FILE_BYTES: u64 = certs::MAX_PEM_BYTES as u64;

/// One read of a directory's pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PairRead {
    /// Both files read, unchanged between two reads.
    Read {
        /// `tls.crt`.
        cert: Vec<u8>,
        /// `tls.key`.
        key: Vec<u8>,
    },
    /// A file is missing, unreadable or empty.
    Incomplete(String),
    /// A file is over the PEM bound ([`certs::MAX_PEM_BYTES`]).
    TooLarge(String),
    /// The files changed while being read (a swap in progress).
    Changing,
}

/// What a read pair is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A complete, matching, parsable pair.
    Valid {
        /// sha256 of the pair.
        sha256: String,
    },
    /// Not to be applied.
    Invalid {
        /// Label of `sbmesh_watch_tls_rejected_total`: `incomplete`,
        /// `too_large`, `unparsable` or `mismatch`.
        reason: &'static str,
        /// What is wrong, for the log and the problem string.
        detail: String,
    },
    /// Look again shortly.
    Changing,
}

/// sha256 of a pair (length-prefixed, so no two pairs share a hash input).
pub(crate) fn pair_sha256(cert: &[u8], key: &[u8]) -> String {
    let mut input = Vec::with_capacity(8 + cert.len() + key.len());
    input.extend_from_slice(&(cert.len() as u64).to_be_bytes());
    input.extend_from_slice(cert);
    input.extend_from_slice(key);
    sha256_hex(&input)
}

/// Judges a read pair: complete, parsable, key matching the certificate.
pub(crate) fn check_pair(read: &PairRead) -> Verdict {
    let invalid = |reason, detail: String| Verdict::Invalid { reason, detail };
    let (cert, key) = match read {
        PairRead::Read { cert, key } => (cert, key),
        PairRead::Incomplete(why) => return invalid("incomplete", why.clone()),
        PairRead::TooLarge(why) => return invalid("too_large", why.clone()),
        PairRead::Changing => return Verdict::Changing,
    };
    let Ok(cert_pem) = std::str::from_utf8(cert) else {
        return invalid("unparsable", format!("{CERT_FILE} is not PEM text"));
    };
    let Ok(key_pem) = std::str::from_utf8(key) else {
        return invalid("unparsable", format!("{KEY_FILE} is not PEM text"));
    };
    if let Err(e) = certs::parse_chain(cert_pem) {
        return invalid("unparsable", format!("{CERT_FILE}: {e}"));
    }
    match certs::key_matches(cert_pem, key_pem) {
        Ok(true) => Verdict::Valid {
            sha256: pair_sha256(cert, key),
        },
        Ok(false) => invalid(
            "mismatch",
            format!("{KEY_FILE} is not the key of the certificate in {CERT_FILE}"),
        ),
        Err(e) => invalid("unparsable", format!("{KEY_FILE}: {e}")),
    }
}

/// What to do about a verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The first valid pair: the one the proxy started with; not applied.
    Baseline,
    /// A new valid pair: apply it.
    Apply,
    /// A new invalid pair: log and count it (never applied).
    Reject {
        /// The metric label.
        reason: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// Nothing new (same pair, same rejection, or a swap in progress).
    Nothing,
}

/// The decisions for one directory.
#[derive(Clone, Debug, Default)]
pub(crate) struct TlsDirState {
    started: bool,
    applied: Option<String>,
    rejected: Option<(&'static str, String)>,
    problem: Option<String>,
}

impl TlsDirState {
    /// A directory not looked at yet.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// sha256 of the pair last applied (or recorded at start).
    #[cfg(test)]
    pub(crate) fn applied(&self) -> Option<&str> {
        self.applied.as_deref()
    }

    /// Why the directory's current pair is not applied, if it is not.
    pub(crate) fn problem(&self) -> Option<&str> {
        self.problem.as_deref()
    }

    /// Decides on a verdict about `dir` (the directory only names itself
    /// in the problem string).
    pub(crate) fn decide(&mut self, dir: &Path, verdict: Verdict) -> Decision {
        match verdict {
            Verdict::Changing => Decision::Nothing,
            Verdict::Valid { sha256 } => {
                self.rejected = None;
                self.problem = None;
                let first = !self.started;
                self.started = true;
                if self.applied.as_deref() == Some(sha256.as_str()) {
                    return Decision::Nothing;
                }
                self.applied = Some(sha256);
                if first {
                    Decision::Baseline
                } else {
                    Decision::Apply
                }
            }
            Verdict::Invalid { reason, detail } => {
                self.started = true;
                let key = (reason, detail);
                if self.rejected.as_ref() == Some(&key) {
                    return Decision::Nothing;
                }
                let (reason, detail) = key.clone();
                self.rejected = Some(key);
                self.problem = Some(format!(
                    "watch-tls {}: {detail} ({reason}); not applied",
                    dir.display()
                ));
                Decision::Reject { reason, detail }
            }
        }
    }
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, PairRead> {
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let file = std::fs::File::open(path)
        .map_err(|e| PairRead::Incomplete(format!("{name} cannot be read: {e}")))?;
    let mut raw = Vec::new();
    file.take(MAX_TLS_FILE_BYTES + 1)
        .read_to_end(&mut raw)
        .map_err(|e| PairRead::Incomplete(format!("{name} cannot be read: {e}")))?;
    if raw.len() as u64 > MAX_TLS_FILE_BYTES {
        return Err(PairRead::TooLarge(format!(
            "{name} is larger than {MAX_TLS_FILE_BYTES} bytes"
        )));
    }
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Err(PairRead::Incomplete(format!("{name} is empty")));
    }
    Ok(raw)
}

fn read_once(dir: &Path) -> Result<(Vec<u8>, Vec<u8>), PairRead> {
    let cert = read_bounded(&dir.join(CERT_FILE))?;
    let key = read_bounded(&dir.join(KEY_FILE))?;
    Ok((cert, key))
}

/// Reads `dir`'s pair twice; [`PairRead::Changing`] when the reads differ.
pub(crate) fn read_pair(dir: &Path) -> PairRead {
    let first = read_once(dir);
    let second = read_once(dir);
    match (first, second) {
        (Ok(a), Ok(b)) if a == b => PairRead::Read {
            cert: a.0,
            key: a.1,
        },
        (Err(a), Err(b)) if a == b => a,
        _ => PairRead::Changing,
    }
}

/// Settings of one `--watch-tls` directory.
#[derive(Clone, Debug)]
pub struct WatchTlsConfig {
    /// The mounted Secret directory.
    pub dir: PathBuf,
    /// Full re-read interval (30 s).
    pub rescan: Duration,
    /// Quiet time after a directory event before reading (200 ms); also
    /// the pause before reading a changing pair again.
    pub debounce: Duration,
}

impl WatchTlsConfig {
    /// The defaults for `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            rescan: Duration::from_secs(30),
            debounce: Duration::from_millis(200),
        }
    }
}

/// A running watch of one directory; stops when dropped.
#[derive(Debug)]
pub struct TlsWatcher {
    problem: watch::Receiver<Option<String>>,
    task: JoinHandle<()>,
}

impl TlsWatcher {
    /// Starts watching. The pair present now is recorded as applied
    /// (read before this returns); each later valid change calls `apply`.
    pub fn spawn(
        cfg: WatchTlsConfig,
        apply: Arc<dyn Fn() + Send + Sync>,
        metrics: Arc<Metrics>,
    ) -> Self {
        // Watch first, then read: a change in between is not missed.
        let mut events = DirWatch::new(&cfg.dir, "watch-tls");
        let mut state = TlsDirState::new();
        let (tx, problem) = watch::channel(None);
        let mut again = look(&cfg.dir, &mut state, &apply, &metrics, &tx);
        let task = tokio::spawn(async move {
            let mut rescan = tokio::time::interval(cfg.rescan.max(Duration::from_millis(10)));
            rescan.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            rescan.tick().await;
            loop {
                if again {
                    tokio::time::sleep(cfg.debounce).await;
                } else {
                    tokio::select! {
                        _ = rescan.tick() => {}
                        () = next_change(&mut events) => {
                            // Let the rest of the swap land.
                            tokio::time::sleep(cfg.debounce).await;
                        }
                    }
                }
                if let Some(w) = &mut events {
                    w.drain();
                }
                let dir = cfg.dir.clone();
                let Ok(verdict) =
                    tokio::task::spawn_blocking(move || check_pair(&read_pair(&dir))).await
                else {
                    return;
                };
                again = decide(&cfg.dir, &mut state, verdict, &apply, &metrics, &tx);
            }
        });
        Self { problem, task }
    }

    /// Why the directory's current pair is not applied (`None`: fine).
    pub fn problem(&self) -> watch::Receiver<Option<String>> {
        self.problem.clone()
    }
}

impl Drop for TlsWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A readiness check failing while any of the watchers reports a problem.
pub fn watch_tls_readiness(problems: Vec<watch::Receiver<Option<String>>>) -> ReadinessCheck {
    Arc::new(move || {
        let all: Vec<String> = problems.iter().filter_map(|p| p.borrow().clone()).collect();
        (!all.is_empty()).then(|| all.join("; "))
    })
}

/// One synchronous look; `true` when the pair was changing.
fn look(
    dir: &Path,
    state: &mut TlsDirState,
    apply: &Arc<dyn Fn() + Send + Sync>,
    metrics: &Metrics,
    tx: &watch::Sender<Option<String>>,
) -> bool {
    let verdict = check_pair(&read_pair(dir));
    decide(dir, state, verdict, apply, metrics, tx)
}

fn decide(
    dir: &Path,
    state: &mut TlsDirState,
    verdict: Verdict,
    apply: &Arc<dyn Fn() + Send + Sync>,
    metrics: &Metrics,
    tx: &watch::Sender<Option<String>>,
) -> bool {
    let changing = verdict == Verdict::Changing;
    match state.decide(dir, verdict) {
        Decision::Baseline => {
            tracing::info!(dir = %dir.display(), "watch-tls: watching; the current pair is the one the proxy started with");
        }
        Decision::Apply => {
            tracing::info!(dir = %dir.display(), "watch-tls: new certificate; applying it to the proxy");
            apply();
        }
        Decision::Reject { reason, detail } => {
            tracing::warn!(dir = %dir.display(), reason, %detail, "watch-tls: certificate pair not applied");
            metrics.proxy.watch_tls_rejected(reason);
        }
        Decision::Nothing => {}
    }
    let problem = state.problem().map(str::to_owned);
    tx.send_if_modified(|current| {
        let changed = *current != problem;
        if changed {
            *current = problem;
        }
        changed
    });
    changing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(s: &str) -> Verdict {
        Verdict::Valid { sha256: s.into() }
    }

    fn mismatch() -> Verdict {
        Verdict::Invalid {
            reason: "mismatch",
            detail: "tls.key is not the key".into(),
        }
    }

    #[test]
    fn the_first_pair_is_the_baseline_and_a_new_one_is_applied_once() {
        let dir = Path::new("/tls");
        let mut s = TlsDirState::new();
        assert_eq!(s.decide(dir, valid("a")), Decision::Baseline);
        assert_eq!(s.applied(), Some("a"));
        assert_eq!(s.decide(dir, valid("a")), Decision::Nothing);
        assert_eq!(s.decide(dir, Verdict::Changing), Decision::Nothing);
        assert_eq!(s.decide(dir, valid("b")), Decision::Apply);
        assert_eq!(s.decide(dir, valid("b")), Decision::Nothing);
        assert_eq!(s.applied(), Some("b"));
        assert_eq!(s.problem(), None);
    }

    #[test]
    fn an_invalid_pair_is_rejected_once_and_cleared_by_a_valid_one() {
        let dir = Path::new("/tls");
        let mut s = TlsDirState::new();
        s.decide(dir, valid("a"));
        assert_eq!(
            s.decide(dir, mismatch()),
            Decision::Reject {
                reason: "mismatch",
                detail: "tls.key is not the key".into()
            }
        );
        let problem = s.problem().unwrap();
        assert!(
            problem.contains("/tls") && problem.contains("mismatch"),
            "{problem}"
        );
        // The rescan sees it again: not counted twice.
        assert_eq!(s.decide(dir, mismatch()), Decision::Nothing);
        assert!(s.problem().is_some());
        assert_eq!(s.applied(), Some("a"));
        // Another problem is reported anew.
        assert!(matches!(
            s.decide(
                dir,
                Verdict::Invalid {
                    reason: "incomplete",
                    detail: "tls.key cannot be read".into()
                }
            ),
            Decision::Reject {
                reason: "incomplete",
                ..
            }
        ));
        assert_eq!(s.decide(dir, valid("c")), Decision::Apply);
        assert_eq!(s.problem(), None);
        // The same problem after a valid pair is news again.
        assert!(matches!(s.decide(dir, mismatch()), Decision::Reject { .. }));
    }

    #[test]
    fn going_back_to_the_applied_pair_clears_the_problem_without_applying() {
        let dir = Path::new("/tls");
        let mut s = TlsDirState::new();
        s.decide(dir, valid("a"));
        s.decide(dir, mismatch());
        assert_eq!(s.decide(dir, valid("a")), Decision::Nothing);
        assert_eq!(s.problem(), None);
    }

    #[test]
    fn an_invalid_start_applies_the_first_valid_pair() {
        let dir = Path::new("/tls");
        let mut s = TlsDirState::new();
        assert!(matches!(s.decide(dir, mismatch()), Decision::Reject { .. }));
        assert_eq!(s.applied(), None);
        assert_eq!(s.decide(dir, valid("a")), Decision::Apply);
    }

    #[test]
    fn a_swap_in_progress_before_the_first_pair_changes_nothing() {
        let dir = Path::new("/tls");
        let mut s = TlsDirState::new();
        assert_eq!(s.decide(dir, Verdict::Changing), Decision::Nothing);
        assert_eq!(s.decide(dir, valid("a")), Decision::Baseline);
    }

    fn pair(names: &[&str]) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let cert = rcgen::CertificateParams::new(names)
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn read(cert: &str, key: &str) -> PairRead {
        PairRead::Read {
            cert: cert.as_bytes().to_vec(),
            key: key.as_bytes().to_vec(),
        }
    }

    #[test]
    fn pairs_are_checked() {
        let (cert, key) = pair(&["a.test"]);
        let (_, other_key) = pair(&["b.test"]);
        assert_eq!(
            check_pair(&read(&cert, &key)),
            Verdict::Valid {
                sha256: pair_sha256(cert.as_bytes(), key.as_bytes())
            }
        );
        let reason = |v: Verdict| match v {
            Verdict::Invalid { reason, .. } => reason,
            other => panic!("{other:?}"),
        };
        assert_eq!(reason(check_pair(&read(&cert, &other_key))), "mismatch");
        assert_eq!(reason(check_pair(&read("garbage", &key))), "unparsable");
        assert_eq!(reason(check_pair(&read(&cert, "garbage"))), "unparsable");
        let half = &cert[..cert.len() / 2];
        assert_eq!(reason(check_pair(&read(half, &key))), "unparsable");
        assert_eq!(
            reason(check_pair(&PairRead::Read {
                cert: vec![0xff, 0xfe],
                key: key.clone().into_bytes()
            })),
            "unparsable"
        );
        assert_eq!(
            reason(check_pair(&PairRead::Incomplete("x".into()))),
            "incomplete"
        );
        assert_eq!(
            reason(check_pair(&PairRead::TooLarge("x".into()))),
            "too_large"
        );
        assert_eq!(check_pair(&PairRead::Changing), Verdict::Changing);
        // Hash inputs are length-prefixed.
        assert_ne!(pair_sha256(b"ab", b"c"), pair_sha256(b"a", b"bc"));
    }

    #[test]
    fn reading_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(read_pair(dir.path()), PairRead::Incomplete(_)));
        std::fs::write(dir.path().join(CERT_FILE), "c").unwrap();
        match read_pair(dir.path()) {
            PairRead::Incomplete(why) => assert!(why.contains("tls.key"), "{why}"),
            other => panic!("{other:?}"),
        }
        std::fs::write(dir.path().join(KEY_FILE), "\n").unwrap();
        match read_pair(dir.path()) {
            PairRead::Incomplete(why) => assert!(why.contains("empty"), "{why}"),
            other => panic!("{other:?}"),
        }
        std::fs::write(dir.path().join(KEY_FILE), "k").unwrap();
        assert_eq!(
            read_pair(dir.path()),
            PairRead::Read {
                cert: b"c".to_vec(),
                key: b"k".to_vec()
            }
        );
        std::fs::write(
            dir.path().join(KEY_FILE),
            vec![b'k'; MAX_TLS_FILE_BYTES as usize + 1],
        )
        .unwrap();
        assert!(matches!(read_pair(dir.path()), PairRead::TooLarge(_)));
    }
}
