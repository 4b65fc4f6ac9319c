//! The HTTP client the ACME account talks through: hyper + rustls on
//! aws-lc-rs (the stack instant-acme uses by default), plus what the
//! default client lacks: a trust anchor from `ca_root`, a per-request
//! timeout, a bound on response bodies, and the CA's `Retry-After`.
//!
//! # Trust
//!
//! With `ca_root` set, the certificates in that PEM file are the **only**
//! trust anchors: `ca_root` names a private CA whose directory is served
//! under that CA, and letting every public root vouch for it as well would
//! only widen who can impersonate it. Without `ca_root`, the platform's
//! verifier (the OS trust store, as instant-acme's own client) is used.
//!
//! # `Retry-After`, per order
//!
//! instant-acme honours `Retry-After` while it polls, but drops the header
//! when a request fails (a `429 rateLimited`, a `503`), and many orders
//! share one [`instant_acme::Account`] and so one client. The client
//! therefore records the header in a slot scoped to the *task* that made
//! the request: wrap an order in [`RetryAfterCapture::scope`] (a tokio
//! `task_local!`), and every response received while that future runs
//! overwrites the slot with its own `Retry-After` (or with nothing when it
//! has none, or when no response came at all). After an error,
//! [`RetryAfterCapture::remaining`] is what the CA said about the request
//! that failed, never what it said to another order. Requests made outside
//! any scope are not recorded. instant-acme awaits its requests in the
//! caller's task (it spawns nothing), which is what makes the scope hold.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::header::RETRY_AFTER;
use hyper::{HeaderMap, Request};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use instant_acme::{BodyWrapper, BytesResponse, HttpClient};
use rustls::RootCertStore;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// How long one request may take, response body included.
pub(crate) const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest response body accepted (a certificate chain is a few KiB).
pub(crate) const MAX_RESPONSE_BYTES: usize = 1 << 20;

tokio::task_local! {
    static CAPTURE: Arc<Mutex<Option<SystemTime>>>;
}

/// The `Retry-After` of the most recent ACME response seen by the futures
/// run in [`RetryAfterCapture::scope`] (see the module docs).
#[derive(Clone, Debug, Default)]
pub(crate) struct RetryAfterCapture {
    slot: Arc<Mutex<Option<SystemTime>>>,
}

impl RetryAfterCapture {
    /// An empty capture.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Runs `fut`, recording into this capture the `Retry-After` of every
    /// response it receives through an [`AcmeHttpClient`].
    pub(crate) async fn scope<F: Future>(&self, fut: F) -> F::Output {
        CAPTURE.scope(Arc::clone(&self.slot), fut).await
    }

    /// When the last response said to come back, if it said so.
    pub(crate) fn retry_at(&self) -> Option<SystemTime> {
        *self.slot.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How long from now until [`RetryAfterCapture::retry_at`] (zero when
    /// that is already past).
    pub(crate) fn remaining(&self) -> Option<Duration> {
        self.retry_at().map(until)
    }
}

/// The time left until `at`, zero when it has passed.
fn until(at: SystemTime) -> Duration {
    at.duration_since(SystemTime::now())
        .unwrap_or(Duration::ZERO)
}

fn record(slot: Option<&Arc<Mutex<Option<SystemTime>>>>, value: Option<SystemTime>) {
    if let Some(slot) = slot {
        *slot.lock().unwrap_or_else(PoisonError::into_inner) = value;
    }
}

/// Parses a `Retry-After` header (RFC 9110 section 10.2.3): delay-seconds
/// or an HTTP-date, as the instant it designates, with `now` the time the
/// response arrived. Unparseable values are ignored.
pub(crate) fn parse_retry_after(headers: &HeaderMap, now: SystemTime) -> Option<SystemTime> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if value.is_empty() {
        return None;
    }
    match u64::from_str(value) {
        // Capped at a day: a larger value is a CA bug or an attack, and an
        // instant far in the future must not overflow.
        Ok(secs) => now.checked_add(Duration::from_secs(secs.min(86_400))),
        Err(_) => httpdate::parse_http_date(value).ok(),
    }
}

/// Why a request through [`AcmeHttpClient`] failed before the CA answered
/// in full. Carried inside [`instant_acme::Error::Other`].
#[derive(Debug)]
pub(crate) struct RequestError {
    /// `METHOD uri` of the request.
    pub request: String,
    /// What went wrong.
    pub kind: RequestErrorKind,
}

/// The ways a request fails.
#[derive(Debug)]
pub(crate) enum RequestErrorKind {
    /// No complete response within the timeout.
    Timeout(Duration),
    /// Connecting, TLS or the HTTP exchange failed (the message includes
    /// the causes).
    Transport(String),
    /// The response body is over [`MAX_RESPONSE_BYTES`] or broke off.
    Body(String),
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            RequestErrorKind::Timeout(after) => {
                write!(f, "{}: no complete response within {after:?}", self.request)
            }
            RequestErrorKind::Transport(msg) => write!(f, "{}: {msg}", self.request),
            RequestErrorKind::Body(msg) => {
                write!(f, "{}: reading the response: {msg}", self.request)
            }
        }
    }
}

impl StdError for RequestError {}

/// Renders an error with its chain of causes ("a: b: c").
pub(crate) fn error_chain(err: &(dyn StdError + 'static)) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

/// Why the client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientBuildError {
    /// `ca_root` cannot be read or holds no usable certificate.
    #[error("proxy.extensions.sbmesh.acme.ca_root {path}: {message}")]
    CaRoot {
        /// The file.
        path: String,
        /// What is wrong with it.
        message: String,
    },
    /// rustls refused the configuration.
    #[error("TLS setup failed: {0}")]
    Tls(String),
}

/// An [`instant_acme::HttpClient`] over hyper + rustls (aws-lc-rs) with
/// the trust, timeout and `Retry-After` capture of the module docs. Cheap
/// to clone (connections are pooled and shared).
#[derive(Clone)]
pub struct AcmeHttpClient {
    client: Client<HttpsConnector<HttpConnector>, BodyWrapper<Bytes>>,
    timeout: Duration,
}

impl fmt::Debug for AcmeHttpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcmeHttpClient")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl AcmeHttpClient {
    /// A client trusting only the certificates in `ca_root` when given,
    /// else the platform's trust store. `http://` URLs are accepted too
    /// (a local test CA); a production directory is `https://`.
    pub fn new(ca_root: Option<&Path>) -> Result<Self, ClientBuildError> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = hyper_rustls::HttpsConnectorBuilder::new();
        let builder = match ca_root {
            Some(path) => {
                let roots = load_roots(path)?;
                let config = rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| ClientBuildError::Tls(e.to_string()))?
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                builder.with_tls_config(config)
            }
            None => builder
                .with_provider_and_platform_verifier(provider)
                .map_err(|e| ClientBuildError::Tls(e.to_string()))?,
        };
        let connector = builder
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .build();
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            timeout: DEFAULT_REQUEST_TIMEOUT,
        })
    }

    /// Sends `req` and returns the whole response body (bounded, within
    /// the timeout), recording `Retry-After` into the current
    /// `RetryAfterCapture` scope.
    pub async fn send(
        &self,
        req: Request<BodyWrapper<Bytes>>,
    ) -> Result<(hyper::http::response::Parts, Bytes), instant_acme::Error> {
        let BytesResponse { parts, mut body } = self.request(req).await?;
        let bytes = body
            .into_bytes()
            .await
            .map_err(instant_acme::Error::Other)?;
        Ok((parts, bytes))
    }
}

fn load_roots(path: &Path) -> Result<RootCertStore, ClientBuildError> {
    let err = |message: String| ClientBuildError::CaRoot {
        path: path.display().to_string(),
        message,
    };
    let pem = std::fs::read(path).map_err(|e| err(format!("cannot read it: {e}")))?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| err(format!("not valid PEM: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| err(format!("a certificate in it is not usable as a root: {e}")))?;
    }
    if roots.is_empty() {
        return Err(err(
            "no CERTIFICATE block found; give the PEM of the CA that signed the directory's TLS certificate".to_owned(),
        ));
    }
    Ok(roots)
}

impl HttpClient for AcmeHttpClient {
    fn request(
        &self,
        req: Request<BodyWrapper<Bytes>>,
    ) -> Pin<Box<dyn Future<Output = Result<BytesResponse, instant_acme::Error>> + Send>> {
        // Taken now, inside the caller's task, where the task-local is set.
        let slot = CAPTURE.try_with(Arc::clone).ok();
        let request = format!("{} {}", req.method(), req.uri());
        let timeout = self.timeout;
        let fut = self.client.request(req);
        Box::pin(async move {
            let exchange = async {
                let rsp = fut
                    .await
                    .map_err(|e| RequestErrorKind::Transport(error_chain(&e)))?;
                let (parts, body) = rsp.into_parts();
                let bytes = Limited::new(body, MAX_RESPONSE_BYTES)
                    .collect()
                    .await
                    .map_err(|e| RequestErrorKind::Body(error_chain(&*e)))?
                    .to_bytes();
                Ok::<_, RequestErrorKind>((parts, bytes))
            };
            let result = match tokio::time::timeout(timeout, exchange).await {
                Ok(result) => result,
                Err(_) => Err(RequestErrorKind::Timeout(timeout)),
            };
            match result {
                Ok((parts, bytes)) => {
                    record(
                        slot.as_ref(),
                        parse_retry_after(&parts.headers, SystemTime::now()),
                    );
                    Ok(BytesResponse {
                        parts,
                        body: Box::new(bytes),
                    })
                }
                Err(kind) => {
                    record(slot.as_ref(), None);
                    Err(instant_acme::Error::Other(Box::new(RequestError {
                        request,
                        kind,
                    })))
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(
            parse_retry_after(&headers("120"), now),
            Some(now + Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after(&headers("Sun, 06 Nov 1994 08:49:37 GMT"), now),
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777))
        );
        assert_eq!(
            parse_retry_after(&headers("99999999999"), now),
            Some(now + Duration::from_secs(86_400))
        );
        assert_eq!(parse_retry_after(&headers("soon"), now), None);
        assert_eq!(parse_retry_after(&headers(""), now), None);
        assert_eq!(parse_retry_after(&HeaderMap::new(), now), None);
    }
}
