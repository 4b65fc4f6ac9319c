//! Port 80 carries both the CA's HTTP-01 validations and ordinary HTTP
//! (docs/reference.md#challenge-endpoint): with a [`Passthrough`], the
//! challenge listener answers `/.well-known/acme-challenge/*` itself and
//! hands every other request to the proxy's plain HTTP listener in the same
//! pod, so a redirect to HTTPS and plain-HTTP origins keep working there.
//!
//! A request is passed with its method, path and query, headers and body,
//! plus `X-Forwarded-For` (the client's IP appended), `X-Forwarded-Proto:
//! http` and `X-Forwarded-Host` (the request's Host); the hop-by-hop headers
//! of RFC 9110 section 7.6.1 (`Connection` and those it names, `Keep-Alive`,
//! `Proxy-Connection`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`,
//! `Proxy-Authorization`, `Proxy-Authenticate`) are not, either way. The
//! proxy's answer (status, headers, body) comes back as it is. Bodies are
//! streamed both ways, never held whole; a request body larger than
//! `MAX_REQUEST_BODY_BYTES` gets `413`. A proxy that does not answer
//! (connection refused, no response head within `RESPONSE_TIMEOUT`) gets
//! the client a `502`. Each request handed over is counted in
//! `sbmesh_challenge_passthrough_total{result}`.
//!
//! ```no_run
//! use std::sync::Arc;
//! use sbmesh::{Passthrough, Upstream, with_passthrough};
//! # fn demo(challenge: axum::Router, metrics: Arc<sbmesh::Metrics>) -> Result<(), Box<dyn std::error::Error>> {
//! let upstream: Upstream = "http://127.0.0.1:8080".parse()?;
//! let router = with_passthrough(challenge, Arc::new(Passthrough::new(upstream, &metrics)));
//! # let _ = router; Ok(()) }
//! ```

use std::error::Error as StdError;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::http::uri::{Authority, PathAndQuery, Scheme};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, Version, header};
use axum::response::Response;
use http_body_util::{LengthLimitError, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use tracing::{debug, warn};

use crate::acme::challenge::CHALLENGE_PATH_PREFIX;
use crate::acme::challenge::WarnGate;
use crate::acme::http_client::error_chain;
use crate::flags::{FlagKind, FlagValue};
use crate::metrics::{Metrics, PASSTHROUGH_RESULTS, ResultLabels};

/// Largest request body passed to the proxy: a plain-HTTP form or upload on
/// port 80, not a bulk transfer (which belongs on HTTPS). A larger declared
/// `Content-Length` is answered `413` before the proxy is contacted; a
/// chunked body that grows past it is cut, and answered `413` unless the
/// proxy answered first.
pub(crate) const MAX_REQUEST_BODY_BYTES: usize = 32 << 20;

/// How long opening a connection to the proxy may take. The proxy is in the
/// same pod: a connection either opens at once or is refused.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the proxy may take to send its response head (it may itself
/// wait on an origin); the body then streams for as long as it takes.
pub(crate) const RESPONSE_TIMEOUT: Duration = Duration::from_secs(60);

/// Idle connections to the proxy kept for reuse, and for how long.
const MAX_IDLE_CONNECTIONS: usize = 32;
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// The proxy's plain HTTP listener: an `http://host:port` URL with nothing
/// after the port (a trailing `/` aside). The port defaults to 80.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upstream {
    authority: Authority,
}

/// Why a text is not an [`Upstream`]; the message says what is accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{text:?} is not an http://host:port URL: {reason}; expected a plain HTTP listener, \
     e.g. http://127.0.0.1:8080"
)]
pub struct InvalidUpstream {
    text: String,
    reason: &'static str,
}

impl Upstream {
    /// Parses `http://host:port` (or `http://host`, port 80).
    pub fn parse(text: &str) -> Result<Self, InvalidUpstream> {
        let bad = |reason| InvalidUpstream {
            text: text.chars().take(200).collect(),
            reason,
        };
        let uri: Uri = text.trim().parse().map_err(|_| bad("not a URL"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(bad(
                    "https is not accepted (port 80 is plain HTTP; the proxy's TLS listener \
                     would need a certificate for 127.0.0.1)",
                ));
            }
            Some(_) => return Err(bad("the scheme must be http")),
            None => return Err(bad("the scheme http:// is missing")),
        }
        let authority = uri.authority().ok_or_else(|| bad("no host"))?.clone();
        if authority.as_str().contains('@') {
            return Err(bad("user information is not accepted"));
        }
        if authority.host().is_empty() {
            return Err(bad("no host"));
        }
        if authority.port_u16() == Some(0) {
            return Err(bad("port 0 is no port"));
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(bad(
                "a path or query is not accepted (each request keeps its own)",
            ));
        }
        let authority = if authority.port().is_some() {
            authority
        } else {
            Authority::try_from(format!("{}:80", authority.as_str()))
                .map_err(|_| bad("no valid host"))?
        };
        Ok(Self { authority })
    }

    /// `host:port`.
    #[cfg(test)]
    pub(crate) fn authority(&self) -> &str {
        self.authority.as_str()
    }
}

impl FromStr for Upstream {
    type Err = InvalidUpstream;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

/// `--challenge-passthrough`.
impl FlagValue for Upstream {
    fn parse_flag(_: FlagKind, text: &str) -> Result<Self, String> {
        Upstream::parse(text).map_err(|e| e.to_string())
    }
}

impl fmt::Display for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority)
    }
}

/// Hands requests to the proxy and its answers back (see the module docs).
pub struct Passthrough {
    upstream: Upstream,
    client: Client<HttpConnector, Body>,
    response_timeout: Duration,
    max_request_body: usize,
    ok: Counter,
    error: Counter,
    too_large: Counter,
    /// Each failure is counted and logged at debug level; warned of at most every 10 s.
    warnings: WarnGate,
}

impl fmt::Debug for Passthrough {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Passthrough")
            .field("upstream", &self.upstream)
            .field("response_timeout", &self.response_timeout)
            .field("max_request_body", &self.max_request_body)
            .finish_non_exhaustive()
    }
}

impl Passthrough {
    /// Passes requests to `upstream`, counting them in `metrics`, with the
    /// limits of this module's constants.
    pub fn new(upstream: Upstream, metrics: &Metrics) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(IDLE_TIMEOUT)
            .pool_max_idle_per_host(MAX_IDLE_CONNECTIONS)
            .build(connector);
        let [ok, error, too_large] = PASSTHROUGH_RESULTS.map(|result| {
            metrics
                .http
                .challenge_passthrough
                .get_or_create(&ResultLabels { result })
                .clone()
        });
        Self {
            upstream,
            client,
            response_timeout: RESPONSE_TIMEOUT,
            max_request_body: MAX_REQUEST_BODY_BYTES,
            ok,
            error,
            too_large,
            warnings: WarnGate::default(),
        }
    }

    /// Another wait for the response head than `RESPONSE_TIMEOUT`: for
    /// tests, not part of the API.
    #[doc(hidden)]
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Another request body limit than `MAX_REQUEST_BODY_BYTES`: for
    /// tests, not part of the API.
    #[doc(hidden)]
    pub fn with_max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// Passes `req` to the proxy and returns its answer, or `502` when it
    /// gives none (`413` for a body over the limit; `405` for `CONNECT`, a
    /// tunnel this listener does not open, not counted).
    pub(crate) async fn forward(&self, req: Request) -> Response {
        if req.method() == Method::CONNECT {
            let mut response = status(StatusCode::METHOD_NOT_ALLOWED);
            response.headers_mut().insert(
                header::ALLOW,
                HeaderValue::from_static("GET, HEAD, POST, PUT, DELETE, OPTIONS, PATCH"),
            );
            return response;
        }
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.max_request_body as u64) {
            self.too_large.inc();
            return status(StatusCode::PAYLOAD_TOO_LARGE);
        }
        let Some(upstream_req) = self.upstream_request(req) else {
            return status(StatusCode::BAD_REQUEST);
        };
        match tokio::time::timeout(self.response_timeout, self.client.request(upstream_req)).await {
            Ok(Ok(response)) => {
                self.ok.inc();
                let (mut parts, body) = response.into_parts();
                remove_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, Body::new(body))
            }
            Ok(Err(e)) if is_too_large(&e) => {
                self.too_large.inc();
                status(StatusCode::PAYLOAD_TOO_LARGE)
            }
            Ok(Err(e)) => {
                self.failed(&error_chain(&e));
                status(StatusCode::BAD_GATEWAY)
            }
            Err(_) => {
                self.failed(&format!(
                    "no response head within {:?}",
                    self.response_timeout
                ));
                status(StatusCode::BAD_GATEWAY)
            }
        }
    }

    /// `req` addressed to the proxy, with the forwarding headers; `None`
    /// when its target cannot be (e.g. `OPTIONS *`).
    fn upstream_request(&self, req: Request) -> Option<hyper::Request<Body>> {
        let peer = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(addr)| addr.ip().to_canonical());
        let (mut parts, body) = req.into_parts();
        // HTTP/1.1 sends Host; an absolute-form target carries it instead.
        let host = parts.headers.get(header::HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        remove_hop_by_hop(&mut parts.headers);
        add_forwarded(&mut parts.headers, peer, host.as_ref());
        if let Some(host) = host {
            // The proxy routes by Host: keep the client's, not 127.0.0.1.
            parts.headers.insert(header::HOST, host);
        }
        let path = match parts.uri.path_and_query() {
            Some(pq) if pq.as_str().starts_with('/') => pq.clone(),
            Some(_) => return None,
            None => PathAndQuery::from_static("/"),
        };
        parts.uri = Uri::builder()
            .scheme(Scheme::HTTP)
            .authority(self.upstream.authority.clone())
            .path_and_query(path)
            .build()
            .ok()?;
        // Pooled HTTP/1.1 to the proxy, whatever the client spoke.
        parts.version = Version::HTTP_11;
        parts.extensions = Default::default();
        let body = Body::new(Limited::new(body, self.max_request_body));
        Some(hyper::Request::from_parts(parts, body))
    }

    /// Counts a request the proxy did not answer; a warning at most every 10 s.
    fn failed(&self, why: &str) {
        self.error.inc();
        debug!(upstream = %self.upstream, error = why, "passthrough: no answer from the proxy; 502");
        if let Some(suppressed) = self.warnings.open() {
            warn!(
                upstream = %self.upstream,
                error = why,
                suppressed,
                "challenge listener: the proxy did not answer a passed-through request; answering \
                 502 (counted in sbmesh_challenge_passthrough_total{{result=\"error\"}})"
            );
        }
    }
}

/// The challenge listener with a passthrough: requests whose path is under
/// `/.well-known/acme-challenge/` (any method) go to `challenge` and are
/// never passed on, whatever it answers; every other request goes to
/// `passthrough`.
pub fn with_passthrough(challenge: Router, passthrough: Arc<Passthrough>) -> Router {
    Router::new().fallback(move |req: Request| {
        let (challenge, passthrough) = (challenge.clone(), passthrough.clone());
        async move {
            // The raw path, as the responder reads it.
            if req.uri().path().starts_with(CHALLENGE_PATH_PREFIX) {
                match tower::ServiceExt::oneshot(challenge, req).await {
                    Ok(response) => response,
                    Err(never) => match never {},
                }
            } else {
                passthrough.forward(req).await
            }
        }
    })
}

fn status(code: StatusCode) -> Response {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = code;
    response
}

/// Headers that describe one connection, not the message (RFC 9110
/// section 7.6.1, and the older ones proxies still meet).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
];

fn remove_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(&HOP_BY_HOP) {
        headers.remove(name);
    }
    headers.remove(header::PROXY_AUTHENTICATE);
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// `X-Forwarded-For` with `peer` appended to what the client sent (several
/// lines joined), `X-Forwarded-Proto: http`, `X-Forwarded-Host: host`
/// (those two replaced: they describe this hop).
fn add_forwarded(headers: &mut HeaderMap, peer: Option<IpAddr>, host: Option<&HeaderValue>) {
    if let Some(ip) = peer {
        let mut list: Vec<u8> = Vec::new();
        for value in headers.get_all(&X_FORWARDED_FOR) {
            let value = value.as_bytes().trim_ascii();
            if !value.is_empty() {
                list.extend_from_slice(value);
                list.extend_from_slice(b", ");
            }
        }
        list.extend_from_slice(ip.to_string().as_bytes());
        // Valid header values joined with ", " and an IP stay valid.
        if let Ok(value) = HeaderValue::from_bytes(&list) {
            headers.insert(X_FORWARDED_FOR, value);
        }
    }
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    match host {
        Some(host) => {
            headers.insert(X_FORWARDED_HOST, host.clone());
        }
        None => {
            headers.remove(X_FORWARDED_HOST);
        }
    }
}

/// Whether the request failed because its body grew past the limit.
fn is_too_large(error: &(dyn StdError + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if e.is::<LengthLimitError>() {
            return true;
        }
        cause = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstreams() {
        for (text, authority) in [
            ("http://127.0.0.1:8080", "127.0.0.1:8080"),
            ("http://127.0.0.1:8080/", "127.0.0.1:8080"),
            (" http://localhost:80 ", "localhost:80"),
            ("http://proxy", "proxy:80"),
            ("http://[::1]:8080", "[::1]:8080"),
        ] {
            let upstream = Upstream::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(upstream.authority(), authority, "{text}");
            assert_eq!(upstream.to_string(), format!("http://{authority}"));
        }
        for (text, reason) in [
            ("https://127.0.0.1:8443", "https is not accepted"),
            ("ftp://127.0.0.1:21", "the scheme must be http"),
            ("127.0.0.1:8080", "the scheme http:// is missing"),
            ("http://127.0.0.1:8080/app", "a path or query"),
            ("http://127.0.0.1:8080/?a=b", "a path or query"),
            ("http://u:p@127.0.0.1:8080", "user information"),
            ("http://127.0.0.1:0", "port 0"),
            ("http://", "not a URL"),
            ("not a url", "not a URL"),
        ] {
            let e = Upstream::parse(text).expect_err(text);
            let message = e.to_string();
            assert!(message.contains(reason), "{text}: {message}");
            assert!(
                message.contains("expected a plain HTTP listener, e.g. http://127.0.0.1:8080"),
                "{message}"
            );
        }
    }

    #[test]
    fn hop_by_hop_headers_are_dropped_and_the_rest_kept() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, X-Secret-Hop"),
            ("x-secret-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "websocket"),
            ("te", "trailers"),
            ("proxy-authorization", "Basic eA=="),
            ("cookie", "a=b"),
            ("authorization", "Bearer t"),
            ("x-custom", "kept"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        remove_hop_by_hop(&mut headers);
        let mut left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "cookie", "x-custom"]);
    }

    #[test]
    fn forwarded_headers_append_and_replace() {
        let mut headers = HeaderMap::new();
        headers.append(&X_FORWARDED_FOR, HeaderValue::from_static("203.0.113.7"));
        headers.append(&X_FORWARDED_FOR, HeaderValue::from_static("198.51.100.2 "));
        headers.insert(&X_FORWARDED_PROTO, HeaderValue::from_static("https"));
        headers.insert(&X_FORWARDED_HOST, HeaderValue::from_static("spoofed"));
        let host = HeaderValue::from_static("www.example.com");
        add_forwarded(&mut headers, Some("10.1.2.3".parse().unwrap()), Some(&host));
        assert_eq!(
            headers.get_all(&X_FORWARDED_FOR).iter().collect::<Vec<_>>(),
            ["203.0.113.7, 198.51.100.2, 10.1.2.3"]
        );
        assert_eq!(headers[&X_FORWARDED_PROTO], "http");
        assert_eq!(headers[&X_FORWARDED_HOST], "www.example.com");

        let mut headers = HeaderMap::new();
        headers.insert(&X_FORWARDED_HOST, HeaderValue::from_static("spoofed"));
        add_forwarded(&mut headers, Some("::1".parse().unwrap()), None);
        assert_eq!(headers[&X_FORWARDED_FOR], "::1");
        assert!(!headers.contains_key(&X_FORWARDED_HOST));
    }
}
