//! The injection webhook's shell: its TLS (a CA and serving certificate the
//! operator makes, keeps in a Secret and renews), the HTTPS listener on
//! `--webhook-listen`, and the `caBundle` of the configuration `install`
//! applies. Every replica serves it, leader or not; the decision is
//! [`crate::admit`]'s.
//!
//! TLS: the Secret [`TLS_SECRET`] (in the operator's namespace) holds a CA
//! (10 years) and a serving certificate it signed for the Service's names
//! (`--webhook-cert-lifetime-secs`, a year by default). Each replica reads
//! the Secret every [`REFRESH`]: the first to find it missing creates it,
//! and the first to find the serving certificate in the last third of its
//! life writes a new one signed by the same CA (a write conditioned on the
//! Secret's `resourceVersion`, so two replicas never both renew). The CA
//! does not change, so the API server, which trusts the CA in `caBundle`,
//! accepts the old and the new serving certificate alike: no admission
//! fails during a renewal, whichever replica it reaches.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::admit::{self, Defaults, Injection};
use crate::telemetry::Metrics;

/// The Service in front of every replica's webhook listener.
pub const SERVICE: &str = "sbmesh-operator-webhook";
/// The Secret with the webhook's CA and serving certificate.
pub const TLS_SECRET: &str = "sbmesh-operator-webhook-tls";
/// The MutatingWebhookConfiguration `install` applies (SPEC section 13):
/// one per cluster, as the object is cluster-wide.
pub const CONFIGURATION: &str = "sbmesh-sidecar-injector";
/// The path the API server posts AdmissionReviews to.
pub const PATH: &str = "/inject";
/// `--webhook-listen`'s port: one the control planes of private clusters
/// reach nodes on (GKE's allow 443 and 10250 only), and unprivileged.
pub const DEFAULT_PORT: u16 = 10250;
/// The Service's port (what the configuration names).
pub const SERVICE_PORT: i32 = 443;
/// How long the API server waits for an answer (`timeoutSeconds`): an
/// answer takes milliseconds, and a pod creation should not hang long on
/// a replica that does not answer (the API server then admits the pod
/// without the sidecar, `failurePolicy: Ignore`).
pub const TIMEOUT_SECONDS: i32 = 5;
/// How often each replica reads the Secret (and the configuration's
/// `caBundle`).
pub const REFRESH: Duration = Duration::from_secs(10);
/// The serving certificate's life by default (`--webhook-cert-lifetime-secs`).
pub const DEFAULT_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
/// The longest serving certificate: it must end before its CA.
pub const MAX_LIFETIME: Duration = Duration::from_secs(5 * 365 * 24 * 3600);
/// How long a stopping replica keeps answering admissions.
pub const DRAIN: Duration = Duration::from_secs(5);
/// The CA's life.
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// The largest AdmissionReview read (a pod is well under 1.5 MiB, etcd's
/// object limit).
const MAX_BODY: usize = 3 * 1024 * 1024;

/// The Secret's keys.
const CA_CRT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
const TLS_CRT: &str = "tls.crt";
const TLS_KEY: &str = "tls.key";

/// The webhook's CA and serving certificate, PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bundle {
    pub ca_crt: String,
    pub ca_key: String,
    pub tls_crt: String,
    pub tls_key: String,
}

/// Why a bundle cannot be made or read.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("making a certificate: {0}")]
    Make(#[from] rcgen::Error),
    #[error("Secret {TLS_SECRET}: key {0} is missing or not PEM")]
    Missing(&'static str),
    #[error("Secret {TLS_SECRET}: {0}")]
    Invalid(String),
}

/// The names the API server dials the Service by.
pub fn service_names(namespace: &str) -> Vec<String> {
    vec![
        format!("{SERVICE}.{namespace}.svc"),
        format!(
            "{SERVICE}.{namespace}.svc.{}",
            sbmesh::DEFAULT_CLUSTER_DOMAIN
        ),
    ]
}

fn at(t: SystemTime) -> time::OffsetDateTime {
    time::OffsetDateTime::from(t)
}

/// A new CA and a serving certificate for `names`, valid from `now`.
pub fn new_bundle(
    names: &[String],
    now: SystemTime,
    lifetime: Duration,
) -> Result<Bundle, TlsError> {
    let ca_key = rcgen::KeyPair::generate()?;
    let mut ca = rcgen::CertificateParams::default();
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "sbmesh-operator webhook CA");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    ca.not_before = at(now - Duration::from_secs(60));
    ca.not_after = at(now + CA_LIFETIME);
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let (tls_crt, tls_key) = serving(&issuer, names, now, lifetime)?;
    Ok(Bundle {
        ca_crt: ca_cert.pem(),
        ca_key: issuer.key().serialize_pem(),
        tls_crt,
        tls_key,
    })
}

/// A serving certificate signed by `issuer`.
fn serving(
    issuer: &rcgen::Issuer<'_, rcgen::KeyPair>,
    names: &[String],
    now: SystemTime,
    lifetime: Duration,
) -> Result<(String, String), TlsError> {
    let key = rcgen::KeyPair::generate()?;
    let mut params = rcgen::CertificateParams::new(names.to_vec())?;
    params.distinguished_name.push(
        rcgen::DnType::CommonName,
        names.first().cloned().unwrap_or_default(),
    );
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    params.not_before = at(now - Duration::from_secs(60));
    params.not_after = at(now + lifetime);
    let cert = params.signed_by(&key, issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// The same bundle with a new serving certificate from its CA.
pub fn renewed(
    bundle: &Bundle,
    names: &[String],
    now: SystemTime,
    lifetime: Duration,
) -> Result<Bundle, TlsError> {
    let ca_key = rcgen::KeyPair::from_pem(&bundle.ca_key)?;
    let issuer = rcgen::Issuer::from_ca_cert_pem(&bundle.ca_crt, ca_key)?;
    let (tls_crt, tls_key) = serving(&issuer, names, now, lifetime)?;
    Ok(Bundle {
        tls_crt,
        tls_key,
        ..bundle.clone()
    })
}

/// What [`plan`] reads of a serving certificate: its validity and DNS names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub names: Vec<String>,
}

/// Parses a certificate's PEM once for [`Served`].
pub fn served(pem: &str) -> Result<Served, TlsError> {
    let der = first_certificate(pem).ok_or(TlsError::Missing(TLS_CRT))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der)
        .map_err(|e| TlsError::Invalid(format!("{TLS_CRT} does not parse: {e}")))?;
    let v = cert.validity();
    let t = |s: i64| SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(s).unwrap_or(0));
    let names = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    x509_parser::extensions::GeneralName::DNSName(d) => Some(d.to_string()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Served {
        not_before: t(v.not_before.timestamp()),
        not_after: t(v.not_after.timestamp()),
        names,
    })
}

fn first_certificate(pem: &str) -> Option<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()
        .and_then(Result::ok)
        .map(|c| c.to_vec())
}

/// What to do with the Secret found at `now`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Serve it as it is.
    Keep,
    /// None yet (or unreadable): make one.
    Create,
    /// The serving certificate is in the last third of its life, or does
    /// not name the Service: a new one from the same CA.
    Renew,
}

/// Decides from the bundle's serving certificate and the time.
pub fn plan(bundle: Option<&Bundle>, names: &[String], now: SystemTime) -> Plan {
    let Some(bundle) = bundle else {
        return Plan::Create;
    };
    let Ok(cert) = served(&bundle.tls_crt) else {
        return Plan::Renew;
    };
    let (from, until) = (cert.not_before, cert.not_after);
    let life = until.duration_since(from).unwrap_or_default();
    let left = until.duration_since(now).unwrap_or_default();
    let names_match = names.iter().all(|n| cert.names.contains(n));
    if left < life / 3 || !names_match {
        Plan::Renew
    } else {
        Plan::Keep
    }
}

impl Bundle {
    /// The Secret's data.
    fn data(&self) -> BTreeMap<String, ByteString> {
        [
            (CA_CRT, &self.ca_crt),
            (CA_KEY, &self.ca_key),
            (TLS_CRT, &self.tls_crt),
            (TLS_KEY, &self.tls_key),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
        .collect()
    }

    /// From a Secret's data.
    fn from_secret(secret: &Secret) -> Result<Bundle, TlsError> {
        let data = secret.data.as_ref();
        let get = |key: &'static str| {
            data.and_then(|d| d.get(key))
                .map(|v| String::from_utf8_lossy(&v.0).into_owned())
                .filter(|v| v.contains("-----BEGIN"))
                .ok_or(TlsError::Missing(key))
        };
        Ok(Bundle {
            ca_crt: get(CA_CRT)?,
            ca_key: get(CA_KEY)?,
            tls_crt: get(TLS_CRT)?,
            tls_key: get(TLS_KEY)?,
        })
    }

    /// The serving certificate and key as rustls serves them.
    fn certified_key(&self) -> Result<CertifiedKey, TlsError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(self.tls_crt.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|e| TlsError::Invalid(format!("{TLS_CRT}: {e}")))?;
        let key = PrivateKeyDer::from_pem_slice(self.tls_key.as_bytes())
            .map_err(|e| TlsError::Invalid(format!("{TLS_KEY}: {e}")))?;
        let provider = rustls::crypto::aws_lc_rs::default_provider();
        CertifiedKey::from_der(chain, key, &provider)
            .map_err(|e| TlsError::Invalid(format!("{TLS_KEY} does not match {TLS_CRT}: {e}")))
    }
}

/// The serving certificate the listener presents; swapped on renewal.
#[derive(Debug, Default)]
pub struct Current(RwLock<Option<Arc<CertifiedKey>>>);

impl Current {
    fn set(&self, key: CertifiedKey) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(key));
    }

    /// Whether a certificate is loaded (the replica's readiness).
    pub fn loaded(&self) -> bool {
        self.0.read().unwrap_or_else(|e| e.into_inner()).is_some()
    }
}

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// What the webhook runs with.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: SocketAddr,
    /// The operator's namespace (the Service's and the Secret's).
    pub namespace: String,
    /// The serving certificate's life.
    pub lifetime: Duration,
    pub defaults: Defaults,
}

/// Runs the webhook on `listener` (bound to `settings.listen`) until
/// `stop` and its [`DRAIN`]: the Secret keeper and the listener.
pub async fn run(
    client: Client,
    listener: TcpListener,
    settings: Settings,
    metrics: Arc<Metrics>,
    current: Arc<Current>,
    stop: watch::Receiver<bool>,
) {
    info!(addr = %settings.listen, path = PATH, "serving the injection webhook (HTTPS)");
    let keeper = tokio::spawn(keep_tls(
        client,
        (settings.namespace.clone(), CONFIGURATION.to_string()),
        settings.lifetime,
        current.clone(),
        stop.clone(),
    ));
    serve(
        listener,
        current,
        Arc::new(settings.defaults),
        metrics,
        stop,
    )
    .await;
    keeper.abort();
}

/// Reads the Secret every [`REFRESH`]: creates or renews it when due,
/// loads its serving certificate, and keeps the configuration's `caBundle`
/// equal to its CA.
async fn keep_tls(
    client: Client,
    (namespace, configuration): (String, String),
    lifetime: Duration,
    current: Arc<Current>,
    mut stop: watch::Receiver<bool>,
) {
    let secrets = Api::<Secret>::namespaced(client.clone(), &namespace);
    let configurations = Api::<MutatingWebhookConfiguration>::all(client);
    let names = service_names(&namespace);
    let mut served: Option<String> = None;
    // A failure is logged when it first happens or changes, not each round.
    let mut last_error = String::new();
    let mut report = |error: String, what: &str| {
        if error != last_error {
            warn!(secret = %format!("{namespace}/{TLS_SECRET}"), %configuration, %error, "{what}");
            last_error = error;
        }
    };
    loop {
        match settle(&secrets, &names, lifetime).await {
            Ok(bundle) => {
                if served.as_deref() != Some(bundle.tls_crt.as_str()) {
                    match bundle.certified_key() {
                        Ok(key) => {
                            current.set(key);
                            info!(secret = %format!("{namespace}/{TLS_SECRET}"), "webhook serving certificate loaded");
                            served = Some(bundle.tls_crt.clone());
                        }
                        Err(e) => report(e.to_string(), "webhook serving certificate not loaded"),
                    }
                }
                // Read each round (one GET; a PATCH only when it differs):
                // a configuration deleted and applied again gets it back.
                if let Err(e) =
                    write_ca_bundle(&configurations, &configuration, &bundle.ca_crt).await
                {
                    report(
                        e.to_string(),
                        "cannot write the webhook's caBundle; the API server cannot call the \
                         webhook until it is (is the operator installed by `sbmesh-operator install`?)",
                    );
                }
            }
            Err(e) => report(format!("{e:#}"), "webhook TLS not settled; trying again"),
        }
        tokio::select! {
            _ = tokio::time::sleep(REFRESH) => {}
            _ = stop.changed() => return,
        }
    }
}

/// One round of the Secret: read, then create or renew when due.
async fn settle(
    secrets: &Api<Secret>,
    names: &[String],
    lifetime: Duration,
) -> anyhow::Result<Bundle> {
    let now = SystemTime::now();
    let found = secrets.get_opt(TLS_SECRET).await?;
    let bundle = found.as_ref().map(Bundle::from_secret).transpose();
    let bundle = match bundle {
        Ok(b) => b,
        Err(e) => {
            warn!(error = %e, "the webhook's Secret is unreadable: replacing it");
            None
        }
    };
    match (plan(bundle.as_ref(), names, now), found, bundle) {
        (Plan::Keep, _, Some(bundle)) => Ok(bundle),
        (Plan::Create, None, _) => {
            let bundle = new_bundle(names, now, lifetime)?;
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(TLS_SECRET.to_string()),
                    labels: Some(BTreeMap::from([(
                        "app.kubernetes.io/managed-by".to_string(),
                        crate::install::OPERATOR_NAME.to_string(),
                    )])),
                    ..ObjectMeta::default()
                },
                type_: Some("kubernetes.io/tls".to_string()),
                data: Some(bundle.data()),
                ..Secret::default()
            };
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {
                    info!(
                        secret = TLS_SECRET,
                        "webhook CA and serving certificate created"
                    );
                    Ok(bundle)
                }
                // Another replica made it first: serve theirs next round.
                Err(e) => Err(anyhow::anyhow!("creating Secret {TLS_SECRET}: {e}")),
            }
        }
        (plan, Some(secret), bundle) => {
            let next = match (&plan, &bundle) {
                (Plan::Renew, Some(b)) => renewed(b, names, now, lifetime)?,
                _ => new_bundle(names, now, lifetime)?,
            };
            // Conditioned on the resourceVersion read (a merge patch that
            // carries it fails with 409 if the Secret changed): a replica
            // that renewed meanwhile wins, this one serves its certificate.
            let patch = json!({
                "metadata": { "resourceVersion": secret.metadata.resource_version },
                "data": next.data(),
            });
            secrets
                .patch(TLS_SECRET, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| anyhow::anyhow!("renewing Secret {TLS_SECRET}: {e}"))?;
            info!(
                secret = TLS_SECRET,
                "webhook serving certificate renewed (same CA)"
            );
            Ok(next)
        }
        (_, None, _) => Err(anyhow::anyhow!("Secret {TLS_SECRET} vanished")),
    }
}

/// Writes `ca` as the `caBundle` of each webhook of the configuration.
async fn write_ca_bundle(
    configurations: &Api<MutatingWebhookConfiguration>,
    name: &str,
    ca: &str,
) -> anyhow::Result<()> {
    let found = configurations
        .get_opt(name)
        .await?
        .ok_or_else(|| anyhow::anyhow!("MutatingWebhookConfiguration {name} not found"))?;
    let bundle = ByteString(ca.as_bytes().to_vec());
    let webhooks = found.webhooks.unwrap_or_default();
    if webhooks
        .iter()
        .all(|w| w.client_config.ca_bundle.as_ref() == Some(&bundle))
    {
        return Ok(());
    }
    let patched: Vec<_> = webhooks
        .iter()
        .map(|w| json!({ "name": w.name, "clientConfig": { "caBundle": bundle } }))
        .collect();
    // A strategic merge patch merges `webhooks` by name: only caBundle changes.
    configurations
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Strategic(json!({ "webhooks": patched })),
        )
        .await?;
    info!(configuration = name, "webhook caBundle written");
    Ok(())
}

/// Accepts TLS connections and answers each request.
async fn serve(
    listener: TcpListener,
    current: Arc<Current>,
    defaults: Arc<Defaults>,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map(|b| b.with_no_client_auth().with_cert_resolver(current))
    .expect("the default protocol versions are supported");
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    // After the stop, it answers for [`DRAIN`] more: a terminating pod
    // leaves the Service's endpoints a moment after its SIGTERM, and an
    // admission sent to it meanwhile must still be answered.
    let mut until: Option<tokio::time::Instant> = None;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.changed(), if until.is_none() => {
                until = Some(tokio::time::Instant::now() + DRAIN);
                continue;
            }
            _ = tokio::time::sleep_until(until.unwrap_or_else(tokio::time::Instant::now)), if until.is_some() => return,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                warn!(error = %e, "webhook accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let defaults = defaults.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let tls =
                match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        debug!(%peer, error = %e, "webhook TLS handshake failed");
                        return;
                    }
                    Err(_) => return,
                };
            let service = hyper::service::service_fn(move |req| {
                let defaults = defaults.clone();
                let metrics = metrics.clone();
                async move { Ok::<_, std::convert::Infallible>(answer(req, &defaults, &metrics).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                .await;
        });
    }
}

/// One HTTP request: a POST of an AdmissionReview to [`PATH`].
async fn answer(
    req: Request<Incoming>,
    defaults: &Defaults,
    metrics: &Metrics,
) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static(if status.is_success() {
                "application/json"
            } else {
                "text/plain; charset=utf-8"
            }),
        );
        r
    };
    if req.uri().path() != PATH {
        return reply(
            StatusCode::NOT_FOUND,
            format!("not found: the webhook answers POST {PATH}\n"),
        );
    }
    if req.method() != Method::POST {
        return reply(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{PATH} takes POST\n"),
        );
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            metrics.injection(Injection::malformed);
            warn!(error = %e, "webhook: request body unreadable or over {MAX_BODY} bytes");
            return reply(
                StatusCode::BAD_REQUEST,
                format!("request body unreadable or too large ({e})\n"),
            );
        }
    };
    match admit::admit(&body, defaults) {
        Ok(decision) => {
            metrics.injection(decision.result);
            match decision.result {
                Injection::injected | Injection::skipped => {
                    info!(pod = %decision.pod, result = decision.result.as_str(), reason = %decision.reason, "admission")
                }
                _ => {
                    warn!(pod = %decision.pod, result = decision.result.as_str(), reason = %decision.reason, "admission")
                }
            }
            reply(StatusCode::OK, decision.review.to_string())
        }
        Err(e) => {
            metrics.injection(Injection::malformed);
            warn!(error = %e, "webhook: not an AdmissionReview");
            reply(StatusCode::BAD_REQUEST, format!("{e}\n"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn names() -> Vec<String> {
        service_names("sbmesh-system")
    }

    #[test]
    fn a_bundle_is_made_kept_then_renewed_from_the_same_ca_in_its_last_third() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(plan(None, &names(), t0), Plan::Create);
        let first = new_bundle(&names(), t0, 30 * DAY).unwrap();
        first.certified_key().expect("rustls serves it");
        let cert = served(&first.tls_crt).unwrap();
        assert_eq!(
            cert.not_after.duration_since(cert.not_before).unwrap(),
            30 * DAY + Duration::from_secs(60)
        );
        assert_eq!(plan(Some(&first), &names(), t0 + 19 * DAY), Plan::Keep);
        assert_eq!(plan(Some(&first), &names(), t0 + 21 * DAY), Plan::Renew);
        let second = renewed(&first, &names(), t0 + 21 * DAY, 30 * DAY).unwrap();
        assert_eq!(second.ca_crt, first.ca_crt, "the CA in caBundle stays");
        assert_eq!(second.ca_key, first.ca_key);
        assert_ne!(second.tls_crt, first.tls_crt);
        assert_ne!(second.tls_key, first.tls_key);
        assert_eq!(plan(Some(&second), &names(), t0 + 21 * DAY), Plan::Keep);
        second
            .certified_key()
            .expect("rustls serves the renewed one");
        assert_eq!(served(&second.tls_crt).unwrap().names, names());
    }

    #[test]
    fn a_certificate_for_another_namespace_or_not_pem_is_renewed() {
        let t0 = SystemTime::now();
        let other = new_bundle(&service_names("elsewhere"), t0, 30 * DAY).unwrap();
        assert_eq!(plan(Some(&other), &names(), t0), Plan::Renew);
        let broken = Bundle {
            tls_crt: "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n".into(),
            ..other
        };
        assert_eq!(plan(Some(&broken), &names(), t0), Plan::Renew);
    }
}
