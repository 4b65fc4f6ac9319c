//! The certificate feed: the files the ACME manager wrote, read back after
//! each change, for [`super::Node::certificates`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::sync::{Notify, watch};

use crate::acme::certs::{key_matches, parse_chain};
use crate::acme::deliver::read_pair;
use crate::acme::placeholder::is_placeholder;
use crate::acme::unit::{AcmeStatus, wanted_units};
use crate::config::SbConfig;

use super::{NodeCertificate, NodeCertificates};

/// The node's certificates as read back from the files, a wake-up for
/// the task that reads them, and what that task needs, kept until the
/// first [`Node::certificates`](super::Node::certificates) starts it.
pub(super) struct CertificateFeed {
    pub(super) tx: watch::Sender<NodeCertificates>,
    pub(super) wake: Notify,
    reader: std::sync::Mutex<Option<FeedReader>>,
}

/// The inputs of [`keep_certificates_loaded`].
struct FeedReader {
    cert_dir: PathBuf,
    config: watch::Receiver<Arc<SbConfig>>,
    acme: watch::Receiver<AcmeStatus>,
    stop: watch::Receiver<bool>,
}

impl CertificateFeed {
    pub(super) fn new(
        cert_dir: PathBuf,
        config: watch::Receiver<Arc<SbConfig>>,
        acme: watch::Receiver<AcmeStatus>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        Self {
            tx: watch::channel(Arc::default()).0,
            wake: Notify::new(),
            reader: std::sync::Mutex::new(Some(FeedReader {
                cert_dir,
                config,
                acme,
                stop,
            })),
        }
    }

    /// Starts the reading task, once; it ends when the node stops.
    pub(super) fn start(self: &Arc<Self>) {
        let reader = self
            .reader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(reader) = reader {
            tokio::spawn(keep_certificates_loaded(self.clone(), reader));
        }
    }
}

/// Reads the certificate files back after every change (a certificate
/// written, a placeholder written, the origins changed), while anyone
/// holds a receiver of [`Node::certificates`](super::Node::certificates).
async fn keep_certificates_loaded(feed: Arc<CertificateFeed>, reader: FeedReader) {
    let FeedReader {
        cert_dir,
        mut config,
        mut acme,
        mut stop,
    } = reader;
    let (mut config_open, mut acme_open) = (true, true);
    loop {
        tokio::select! {
            () = feed.wake.notified() => {}
            r = config.changed(), if config_open => config_open = r.is_ok(),
            r = acme.changed(), if acme_open => acme_open = r.is_ok(),
            _ = stop.wait_for(|s| *s) => return,
        }
        if feed.tx.receiver_count() == 0 {
            continue;
        }
        let current = config.borrow_and_update().clone();
        acme.mark_unchanged();
        let previous = feed.tx.borrow().clone();
        let dir = cert_dir.clone();
        let Ok(next) =
            tokio::task::spawn_blocking(move || read_certificates(&current, &dir, &previous)).await
        else {
            return;
        };
        feed.tx.send_if_modified(|served| {
            let changed = **served != next;
            if changed {
                *served = Arc::new(next);
            }
            changed
        });
    }
}

/// The certificate files of every unit `config` asks for, as they are in
/// `cert_dir`. A pair whose key does not match its chain (read between
/// the key's rename and the chain's) keeps what `previous` had.
fn read_certificates(
    config: &SbConfig,
    cert_dir: &Path,
    previous: &[NodeCertificate],
) -> Vec<NodeCertificate> {
    wanted_units(config)
        .0
        .into_iter()
        .filter_map(|unit| {
            let (chain_pem, key_pem) = read_pair(&unit.dir(cert_dir).ok()?)?;
            let facts = parse_chain(&chain_pem).ok()?;
            if !matches!(key_matches(&chain_pem, &key_pem), Ok(true)) {
                return previous.iter().find(|c| c.unit == unit.id).cloned();
            }
            Some(NodeCertificate {
                names: if facts.dns_names.is_empty() {
                    unit.names.clone()
                } else {
                    facts.dns_names
                },
                unit: unit.id,
                placeholder: is_placeholder(&chain_pem),
                chain_pem,
                key_pem,
                serial: facts.serial,
                not_after_unix: facts.not_after_unix,
            })
        })
        .collect()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    const ORIGINS: &str = "proxy:\n  extensions:\n    sbmesh:\n      acme:\n        enabled: true\n        \
        email: ops@example.com\n        directory_url: \"https://127.0.0.1:9/dir\"\n        \
        storage_backend: memory\norigins:\n  \"a.test\": {}\n  \"b.test\": {}\n";

    /// Two origins under the sidecar's ACME, on the memory store.
    pub(in crate::node) fn config() -> SbConfig {
        crate::config::parse_config(ORIGINS).expect("a valid sb.yml")
    }

    #[test]
    fn certificates_are_read_back_from_the_files() {
        let dir = tempfile::tempdir().unwrap();
        let config = config();
        assert_eq!(
            crate::acme::unit_files::write_startup_placeholders(&config, dir.path()),
            Ok(2)
        );
        let read = read_certificates(&config, dir.path(), &[]);
        let names: Vec<_> = read
            .iter()
            .map(|c| (c.unit.as_str(), c.names.clone()))
            .collect();
        assert_eq!(
            names,
            [
                ("a.test", vec!["a.test".to_owned()]),
                ("b.test", vec!["b.test".to_owned()])
            ]
        );
        assert!(read.iter().all(|c| c.placeholder));

        // Between the key's rename and the chain's the pair does not
        // match: what was served stays.
        let (_, other_key) = crate::acme::placeholder::generate(&["x.test".into()], 0).unwrap();
        std::fs::write(dir.path().join("a.test").join("tls.key"), other_key).unwrap();
        let again = read_certificates(&config, dir.path(), &read);
        assert_eq!(again, read);
        assert_eq!(read_certificates(&config, dir.path(), &[]).len(), 1);
    }
}
