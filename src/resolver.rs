//! Serving the node's certificates from a rustls server in the same
//! process (docs/architecture.md#proxy-hand-off): [`CertResolver`] is a
//! [`ResolvesServerCert`] fed by [`crate::node::Node::certificates`], so a
//! certificate issued or renewed anywhere in the fleet is served on the
//! next handshake, with no reload and no restart. Placeholders are served
//! until the CA's certificate arrives, as the files are.
//!
//! A handshake reads the current table through an [`ArcSwap`]: no lock,
//! no allocation for a lowercase SNI name. Loading a new set builds a new
//! table beside the old one and swaps it in.
//!
//! Matching: the SNI name exactly, ASCII case-insensitively (a trailing
//! dot ignored), against every DNS name of every certificate (a per-host
//! certificate's host, each name of a SAN certificate); else a wildcard
//! certificate one label up (`*.example.com` serves `a.example.com`, not
//! `example.com` nor `a.b.example.com`; DNS-01 issues them). When SNI is
//! absent or names no certificate, the [`DefaultCertificate`] answers, or
//! the handshake is refused.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::node::{NodeCertificate, NodeCertificates};

/// What a handshake without SNI, or with a name no certificate has, gets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DefaultCertificate {
    /// The first certificate of the set (the node lists them in name
    /// order).
    #[default]
    First,
    /// The certificate serving this host (when there is one; else the
    /// handshake is refused).
    Named(String),
    /// None: the handshake is refused.
    None,
}

/// Why a chain and key cannot be served.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// The chain is not PEM certificates.
    #[error(
        "the certificate chain is not readable PEM ({0}); expected '-----BEGIN CERTIFICATE-----' blocks, leaf first"
    )]
    ChainPem(String),
    /// The chain holds no certificate.
    #[error(
        "the certificate chain holds no certificate; expected '-----BEGIN CERTIFICATE-----' blocks, leaf first"
    )]
    NoCertificate,
    /// The key is not a readable PEM private key.
    #[error(
        "the private key is not readable PEM ({0}); expected PKCS#8 '-----BEGIN PRIVATE KEY-----'"
    )]
    KeyPem(String),
    /// The key cannot sign with aws-lc-rs, or is not the leaf's.
    #[error("the private key cannot be used with this certificate: {0}")]
    Unusable(rustls::Error),
}

/// A certificate of a set that was not loaded, and why.
#[derive(Debug, thiserror::Error)]
#[error("certificate {unit} ({names}): {source}")]
pub(crate) struct LoadError {
    /// Its unit ([`NodeCertificate::unit`]).
    pub unit: String,
    /// Its names, comma-separated.
    pub names: String,
    /// What is wrong.
    pub source: TlsError,
}

/// A chain (PEM, leaf first) and its private key (PEM; PKCS#8, SEC1 or
/// PKCS#1) as rustls serves them, signing with aws-lc-rs.
pub(crate) fn certified_key(chain_pem: &str, key_pem: &str) -> Result<CertifiedKey, TlsError> {
    let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::ChainPem(e.to_string()))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate);
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| TlsError::KeyPem(e.to_string()))?;
    CertifiedKey::from_der(chain, key, &provider()).map_err(TlsError::Unusable)
}

/// The one crypto provider of the tree.
fn provider() -> CryptoProvider {
    rustls::crypto::aws_lc_rs::default_provider()
}

/// What a handshake reads: name -> certificate, and the default.
#[derive(Default)]
struct Table {
    by_name: HashMap<String, Arc<CertifiedKey>>,
    default: Option<Arc<CertifiedKey>>,
}

/// A [`ResolvesServerCert`] serving a set of certificates by SNI name,
/// swapped as a whole by `CertResolver::load` (or kept current by
/// `CertResolver::follow`).
pub struct CertResolver {
    table: ArcSwap<Table>,
    default: DefaultCertificate,
}

impl std::fmt::Debug for CertResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertResolver")
            .field("names", &self.names())
            .field("default", &self.default)
            .finish()
    }
}

impl CertResolver {
    /// An empty resolver (every handshake refused until a set is loaded).
    pub(crate) fn new(default: DefaultCertificate) -> Self {
        Self {
            table: ArcSwap::from_pointee(Table::default()),
            default,
        }
    }

    /// A resolver kept current with `certificates` (e.g.
    /// [`crate::node::Node::certificates`]) by a task on the current
    /// Tokio runtime; the task ends when the sender or the resolver is
    /// gone. Certificates that cannot be served are logged and skipped.
    pub fn following(
        certificates: watch::Receiver<NodeCertificates>,
        default: DefaultCertificate,
    ) -> Arc<Self> {
        let resolver = Arc::new(Self::new(default));
        resolver.follow(certificates);
        resolver
    }

    /// Loads the current value of `certificates` now, then each new one,
    /// in a task on the current Tokio runtime (see [`CertResolver::following`]).
    pub(crate) fn follow(
        self: &Arc<Self>,
        mut certificates: watch::Receiver<NodeCertificates>,
    ) -> JoinHandle<()> {
        let weak: Weak<Self> = Arc::downgrade(self);
        let load = move |set: &NodeCertificates| match weak.upgrade() {
            Some(resolver) => {
                for error in resolver.load(set) {
                    tracing::warn!("tls: not serving {error}");
                }
                true
            }
            None => false,
        };
        let current = certificates.borrow_and_update().clone();
        load(&current);
        tokio::spawn(async move {
            while certificates.changed().await.is_ok() {
                let set = certificates.borrow_and_update().clone();
                if !load(&set) {
                    return;
                }
            }
        })
    }

    /// Serves `certificates` from the next handshake on, replacing the
    /// whole set. A name several certificates carry is served by the
    /// first real one, else the first placeholder. Returns the
    /// certificates that could not be loaded (the others are served).
    pub(crate) fn load(&self, certificates: &[NodeCertificate]) -> Vec<LoadError> {
        let mut errors = Vec::new();
        let mut loaded: Vec<(&NodeCertificate, Arc<CertifiedKey>)> = Vec::new();
        for cert in certificates {
            match certified_key(&cert.chain_pem, &cert.key_pem) {
                Ok(key) => loaded.push((cert, Arc::new(key))),
                Err(source) => errors.push(LoadError {
                    unit: cert.unit.clone(),
                    names: cert.names.join(","),
                    source,
                }),
            }
        }
        let mut table = Table::default();
        // Real certificates claim their names before placeholders do.
        for placeholders in [false, true] {
            for (cert, key) in loaded.iter().filter(|(c, _)| c.placeholder == placeholders) {
                for name in &cert.names {
                    table
                        .by_name
                        .entry(normalize(name))
                        .or_insert_with(|| key.clone());
                }
            }
        }
        table.default = match &self.default {
            DefaultCertificate::First => loaded.first().map(|(_, key)| key.clone()),
            DefaultCertificate::Named(host) => table.by_name.get(&normalize(host)).cloned(),
            DefaultCertificate::None => None,
        };
        self.table.store(Arc::new(table));
        errors
    }

    /// The certificate a handshake with this SNI name gets (`None`: the
    /// handshake is refused).
    pub(crate) fn resolve_name(&self, server_name: Option<&str>) -> Option<Arc<CertifiedKey>> {
        let table = self.table.load();
        if let Some(name) = server_name {
            let name = name.strip_suffix('.').unwrap_or(name);
            let lower;
            let name = if name.bytes().any(|b| b.is_ascii_uppercase()) {
                lower = name.to_ascii_lowercase();
                lower.as_str()
            } else {
                name
            };
            if let Some(key) = table.by_name.get(name) {
                return Some(key.clone());
            }
            // A wildcard one label up, for a name of at least three labels'
            // worth (`*.com` is never issued).
            if let Some((label, parent)) = name.split_once('.')
                && !label.is_empty()
                && label != "*"
                && let Some(key) = table.by_name.get(&format!("*.{parent}"))
            {
                return Some(key.clone());
            }
        }
        table.default.clone()
    }

    /// The names served, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.table.load().by_name.keys().cloned().collect();
        names.sort();
        names
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.resolve_name(client_hello.server_name())
    }
}

fn normalize(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

/// A rustls server configuration (aws-lc-rs, TLS 1.2 and 1.3, no client
/// certificates) answering with `resolver`'s certificates; set its
/// `alpn_protocols` as the server needs.
pub fn server_config(resolver: Arc<CertResolver>) -> Result<ServerConfig, rustls::Error> {
    Ok(ServerConfig::builder_with_provider(Arc::new(provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(resolver))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acme::placeholder::generate;

    fn cert(unit: &str, names: &[&str], placeholder: bool) -> NodeCertificate {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let (chain_pem, key_pem) = generate(&names, 1_800_000_000).expect("a test certificate");
        NodeCertificate {
            unit: unit.to_owned(),
            names,
            chain_pem,
            key_pem,
            placeholder,
            serial: String::new(),
            not_after_unix: 0,
        }
    }

    /// The leaf DER a resolution serves.
    fn leaf(key: Option<Arc<CertifiedKey>>) -> Option<Vec<u8>> {
        key.map(|k| k.cert[0].as_ref().to_vec())
    }

    fn leaf_of(c: &NodeCertificate) -> Option<Vec<u8>> {
        Some(
            CertificateDer::pem_slice_iter(c.chain_pem.as_bytes())
                .next()
                .unwrap()
                .unwrap()
                .as_ref()
                .to_vec(),
        )
    }

    #[test]
    fn exact_names_and_case() {
        let (a, b) = (
            cert("a.test", &["a.test"], false),
            cert("b.test", &["b.test"], false),
        );
        let r = CertResolver::new(DefaultCertificate::None);
        assert!(r.load(&[a.clone(), b.clone()]).is_empty());
        assert_eq!(leaf(r.resolve_name(Some("a.test"))), leaf_of(&a));
        assert_eq!(leaf(r.resolve_name(Some("b.test"))), leaf_of(&b));
        assert_eq!(leaf(r.resolve_name(Some("B.Test"))), leaf_of(&b));
        assert_eq!(leaf(r.resolve_name(Some("a.test."))), leaf_of(&a));
        // Exact only: no suffix or parent match.
        assert!(r.resolve_name(Some("x.a.test")).is_none());
        assert!(r.resolve_name(Some("test")).is_none());
        assert_eq!(r.names(), ["a.test", "b.test"]);
    }

    #[test]
    fn a_wildcard_serves_one_label_below_it() {
        let apex = cert("san-1", &["*.w.test", "w.test"], false);
        let other = cert("x.w.test", &["x.w.test"], false);
        let r = CertResolver::new(DefaultCertificate::None);
        assert!(r.load(&[apex.clone(), other.clone()]).is_empty());
        for name in ["a.w.test", "B.W.test", "w.test"] {
            assert_eq!(leaf(r.resolve_name(Some(name))), leaf_of(&apex), "{name}");
        }
        // An exact certificate wins over the wildcard.
        assert_eq!(leaf(r.resolve_name(Some("x.w.test"))), leaf_of(&other));
        assert!(r.resolve_name(Some("a.b.w.test")).is_none());
    }

    #[test]
    fn every_name_of_a_san_certificate() {
        let san = cert("san-1", &["x.test", "y.test", "z.test"], false);
        let r = CertResolver::new(DefaultCertificate::None);
        assert!(r.load(std::slice::from_ref(&san)).is_empty());
        for name in ["x.test", "Y.TEST", "z.test"] {
            assert_eq!(leaf(r.resolve_name(Some(name))), leaf_of(&san), "{name}");
        }
    }

    #[test]
    fn real_certificates_win_over_placeholders() {
        let placeholder = cert("a.test", &["a.test"], true);
        let real = cert("san-1", &["a.test", "b.test"], false);
        let r = CertResolver::new(DefaultCertificate::None);
        assert!(r.load(&[placeholder, real.clone()]).is_empty());
        assert_eq!(leaf(r.resolve_name(Some("a.test"))), leaf_of(&real));
    }

    #[test]
    fn default_certificate() {
        let (a, b) = (
            cert("a.test", &["a.test"], false),
            cert("b.test", &["b.test"], false),
        );
        let set = [a.clone(), b.clone()];
        let first = CertResolver::new(DefaultCertificate::First);
        first.load(&set);
        assert_eq!(leaf(first.resolve_name(None)), leaf_of(&a));
        assert_eq!(leaf(first.resolve_name(Some("other.test"))), leaf_of(&a));
        assert_eq!(leaf(first.resolve_name(Some("b.test"))), leaf_of(&b));

        let named = CertResolver::new(DefaultCertificate::Named("B.test".into()));
        named.load(&set);
        assert_eq!(leaf(named.resolve_name(None)), leaf_of(&b));
        assert_eq!(leaf(named.resolve_name(Some("other.test"))), leaf_of(&b));
        let missing = CertResolver::new(DefaultCertificate::Named("c.test".into()));
        missing.load(&set);
        assert!(missing.resolve_name(None).is_none());

        let none = CertResolver::new(DefaultCertificate::None);
        none.load(&set);
        assert!(none.resolve_name(None).is_none());
        assert!(none.resolve_name(Some("other.test")).is_none());
        // Nothing loaded: refused, whatever the default.
        assert!(
            CertResolver::new(DefaultCertificate::First)
                .resolve_name(None)
                .is_none()
        );
    }

    #[test]
    fn a_new_set_is_served_on_the_next_resolve() {
        let old = cert("a.test", &["a.test"], true);
        let new = cert("a.test", &["a.test"], false);
        let r = CertResolver::new(DefaultCertificate::None);
        r.load(std::slice::from_ref(&old));
        let held = r.resolve_name(Some("a.test"));
        assert_eq!(leaf(held.clone()), leaf_of(&old));
        r.load(std::slice::from_ref(&new));
        assert_eq!(leaf(r.resolve_name(Some("a.test"))), leaf_of(&new));
        // A handshake in flight keeps what it resolved.
        assert_eq!(leaf(held), leaf_of(&old));
        // A removed origin is no longer served.
        r.load(&[]);
        assert!(r.resolve_name(Some("a.test")).is_none());
    }

    #[tokio::test]
    async fn follows_a_watch() {
        let a = cert("a.test", &["a.test"], true);
        let b = cert("a.test", &["a.test"], false);
        let (tx, rx) = watch::channel(Arc::new(vec![a.clone()]));
        let r = CertResolver::following(rx, DefaultCertificate::None);
        assert_eq!(leaf(r.resolve_name(Some("a.test"))), leaf_of(&a));
        tx.send(Arc::new(vec![b.clone()])).unwrap();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while leaf(r.resolve_name(Some("a.test"))) != leaf_of(&b) {
            assert!(tokio::time::Instant::now() < deadline, "never swapped");
            tokio::task::yield_now().await;
        }
    }

    #[test]
    fn bad_pem_is_refused_with_the_reason() {
        let good = cert("a.test", &["a.test"], false);
        let other = cert("b.test", &["b.test"], false);
        let err =
            |chain: &str, key: &str| certified_key(chain, key).expect_err("refused").to_string();

        assert!(err("not pem at all", &good.key_pem).contains("holds no certificate"));
        let truncated = good.chain_pem.replace("-----END CERTIFICATE-----", "");
        assert!(
            err(&truncated, &good.key_pem).contains("not readable PEM"),
            "{}",
            err(&truncated, &good.key_pem)
        );
        assert!(err(&good.chain_pem, "").contains("private key is not readable PEM"));
        assert!(err(&good.chain_pem, &good.chain_pem).contains("private key is not readable PEM"));
        let garbage_key = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n";
        assert!(err(&good.chain_pem, garbage_key).contains("cannot be used"));
        let mismatch = err(&good.chain_pem, &other.key_pem);
        assert!(mismatch.contains("cannot be used"), "{mismatch}");

        // In a set: the bad one is named and skipped, the rest is served.
        let mut bad = cert("b.test", &["b.test"], false);
        bad.key_pem = other.chain_pem.clone();
        let r = CertResolver::new(DefaultCertificate::First);
        let errors = r.load(&[bad, good.clone()]);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0]
                .to_string()
                .starts_with("certificate b.test (b.test): "),
            "{}",
            errors[0]
        );
        assert!(
            r.resolve_name(Some("b.test"))
                .is_some_and(|k| Some(k.cert[0].as_ref().to_vec()) == leaf_of(&good))
        );
        assert_eq!(leaf(r.resolve_name(Some("a.test"))), leaf_of(&good));
    }
}
