//! The HTTP-01 responder shared by every replica (docs/reference.md#challenge-endpoint).
//!
//! The replica that orders a certificate [`ChallengeBook::publish`]es the
//! key authorization to the shared store (with an expiry) before it tells
//! the CA the challenge is ready; whichever replica the CA's validation
//! request lands on answers it through [`challenge_router`]:
//!
//! 1. the token must match `[A-Za-z0-9_-]{1,256}` ([`valid_token`]), taken
//!    from the raw request path (no percent-decoding: a real token never
//!    needs it), else `404` without touching the store;
//! 2. memory first (what this replica published or already read);
//! 3. else the shared store, unless the token missed there less than 1 s
//!    ago (so a flood of unknown tokens costs one store read per token per
//!    second, and a token another replica publishes is seen within 1 s);
//! 4. the request's Host (port, IPv6 brackets and a trailing dot ignored,
//!    case-insensitive) must be the identifier the token was issued for.
//!
//! Store failures answer `404` (the CA retries) with a rate-limited warning;
//! nothing a client sends can panic the responder.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::acme::layout;
use crate::metrics::{Metrics, ResultLabels};
use crate::store::{Store, StoreError, now_unix_ms};

/// Path prefix of HTTP-01 validation requests (RFC 8555 section 8.3).
pub(crate) const CHALLENGE_PATH_PREFIX: &str = "/.well-known/acme-challenge/";

/// Longest accepted token.
pub(crate) const MAX_TOKEN_LEN: usize = 256;

/// How long an unknown token is answered `404` from memory before the
/// store is asked again.
pub(crate) const MISS_CACHE_TTL: Duration = Duration::from_secs(1);

/// Longest a record read from the store is kept in memory (its own expiry
/// applies when sooner). Long enough for a CA's multi-perspective
/// validation burst; short, so a record withdrawn by another replica stops
/// being answered here soon after.
const STORE_HIT_CACHE_TTL: Duration = Duration::from_secs(30);

/// Most unknown tokens remembered at once; beyond that a miss is simply not
/// cached (a flood of distinct tokens gains nothing from caching anyway).
const MAX_CACHED_MISSES: usize = 4096;

/// Memory entries beyond which expired ones are swept on insert.
const SWEEP_ABOVE: usize = 1024;

/// A store record larger than this is not a challenge record.
const MAX_RECORD_BYTES: usize = 4096;

/// Time a store read may take (waiting for a turn included) before the
/// request is answered `404`.
const STORE_LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);

/// The pause between two reads of a store that failed, within
/// [`STORE_LOOKUP_TIMEOUT`].
const STORE_RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Most store reads in flight at once: a flood of distinct unknown tokens
/// (which the miss cache cannot absorb) costs the store at most this much
/// concurrency; the excess waits its turn, within the timeout above.
const MAX_STORE_LOOKUPS: usize = 32;

/// Minimum interval between two warnings of one [`WarnGate`].
const WARN_EVERY_MS: u64 = 10_000;

/// Lets a warning through at most every 10 s and counts the ones held back:
/// a listener's failures can come once per request, and the log must not.
#[derive(Debug, Default)]
pub(crate) struct WarnGate {
    last_ms: AtomicU64,
    held_back: AtomicU64,
}

impl WarnGate {
    /// `Some(warnings held back since the last one)` when one may be logged now.
    pub(crate) fn open(&self) -> Option<u64> {
        let now = now_unix_ms();
        let last = self.last_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= WARN_EVERY_MS
            && self
                .last_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            Some(self.held_back.swap(0, Ordering::Relaxed))
        } else {
            self.held_back.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// The record at [`layout::challenge`]`(token)`: JSON, not sealed (the key
/// authorization is served to anyone who asks for the token anyway).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChallengeRecord {
    /// The identifier (hostname) the token was issued for, lowercase.
    pub host: String,
    /// `<token>.<account key thumbprint>`, the body of the answer.
    pub key_authorization: String,
}

/// Whether `token` has the form of an ACME token: `[A-Za-z0-9_-]{1,256}`.
pub(crate) fn valid_token(token: &str) -> bool {
    !token.is_empty()
        && token.len() <= MAX_TOKEN_LEN
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The outcome of [`ChallengeBook::lookup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Known token for this Host: the key authorization to answer.
    Hit(String),
    /// Unknown token (or the store could not be read).
    Miss,
    /// Malformed token (never looked up), or a known token asked for under
    /// another Host.
    Rejected,
}

/// Internal outcome: the hit carries the shared body bytes (no copy).
enum Found {
    Hit(Bytes),
    Miss,
    Rejected,
}

#[derive(Debug)]
struct Published {
    /// Normalized identifier (see [`normalize_host`]).
    host: String,
    body: Bytes,
    expires_at: Instant,
}

/// Key authorizations this replica can answer: its own, and those other
/// replicas published to the shared store.
pub struct ChallengeBook {
    store: Arc<dyn Store>,
    entries: RwLock<HashMap<String, Published>>,
    misses: Mutex<HashMap<String, Instant>>,
    store_lookups: tokio::sync::Semaphore,
    hits: Counter,
    missed: Counter,
    rejected: Counter,
    warnings: WarnGate,
}

impl std::fmt::Debug for ChallengeBook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChallengeBook")
            .field("store", &self.store.backend())
            .field("entries", &read(&self.entries).len())
            .finish_non_exhaustive()
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    // Every mutation is a single map operation: a panic elsewhere cannot
    // leave the map half-updated, so poisoning is safe to ignore.
    lock.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|e| e.into_inner())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `now + ttl`, saturating far in the future instead of overflowing.
fn deadline(now: Instant, ttl: Duration) -> Instant {
    now.checked_add(ttl)
        .unwrap_or_else(|| now + Duration::from_secs(365 * 24 * 3600))
}

/// The host part of a Host header or identifier: the port, IPv6 brackets
/// and one trailing dot removed (case is left alone; compare with
/// [`str::eq_ignore_ascii_case`]).
fn host_part(host: &str) -> &str {
    let host = host.trim();
    let bare = if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port or [v6]
        rest.split_once(']').map_or(rest, |(inner, _)| inner)
    } else {
        match host.rsplit_once(':') {
            // One colon followed by digits: a port. Several colons without
            // brackets: an IPv6 literal, left whole.
            Some((name, port))
                if !name.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) =>
            {
                name
            }
            _ => host,
        }
    };
    bare.strip_suffix('.').unwrap_or(bare)
}

/// The identifier as kept in memory: host part, lowercase.
fn normalize_host(host: &str) -> String {
    host_part(host).to_ascii_lowercase()
}

/// Whether a request's Host header names `identifier` (normalized).
fn host_matches(identifier: &str, host_header: Option<&str>) -> bool {
    host_header.is_some_and(|h| {
        let h = host_part(h);
        !h.is_empty() && h.eq_ignore_ascii_case(identifier)
    })
}

fn key_authorization_fits(token: &str, key_authorization: &str) -> bool {
    key_authorization
        .strip_prefix(token)
        .and_then(|rest| rest.strip_prefix('.'))
        .is_some_and(|thumb| {
            !thumb.is_empty()
                && thumb.len() <= 512
                && thumb
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        })
}

impl ChallengeBook {
    /// A book answering from memory and from `store` (the store shared by
    /// the replicas), counting into `acme_challenge_requests_total`.
    pub fn new(store: Arc<dyn Store>, metrics: Arc<Metrics>) -> Arc<Self> {
        let counter = |result| {
            metrics
                .acme
                .challenge_requests
                .get_or_create(&ResultLabels { result })
                .clone()
        };
        Arc::new(Self {
            hits: counter("hit"),
            missed: counter("miss"),
            rejected: counter("rejected"),
            store,
            entries: RwLock::new(HashMap::new()),
            misses: Mutex::new(HashMap::new()),
            store_lookups: tokio::sync::Semaphore::new(MAX_STORE_LOOKUPS),
            warnings: WarnGate::default(),
        })
    }

    /// Publishes the key authorization of `token`, issued for `host`: to the
    /// store FIRST (key `layout::challenge``(token)`, expiring after `ttl`),
    /// then to memory. On an error nothing is published and the caller must
    /// not tell the CA the challenge is ready.
    ///
    /// A malformed token, or a key authorization that is not
    /// `<token>.<thumbprint>`, is refused before anything is written.
    pub async fn publish(
        &self,
        token: &str,
        host: &str,
        key_authorization: &str,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let key = layout::challenge(token);
        if !valid_token(token) {
            return Err(StoreError::InvalidKey {
                key: key.chars().take(80).collect(),
                reason: "an ACME token is 1 to 256 characters of [A-Za-z0-9_-]",
            });
        }
        let host = normalize_host(host);
        if host.is_empty() || !key_authorization_fits(token, key_authorization) {
            return Err(StoreError::Corrupt {
                key,
                message: "a challenge record needs a host and a key authorization of the form \
                          '<token>.<base64url account key thumbprint>'"
                    .to_owned(),
            });
        }
        let record = ChallengeRecord {
            host: host.clone(),
            key_authorization: key_authorization.to_owned(),
        };
        let json = serde_json::to_vec(&record).map_err(|e| StoreError::Corrupt {
            key: key.clone(),
            message: format!("cannot encode challenge record: {e}"),
        })?;
        self.store.put(&key, &json, Some(ttl)).await?;
        let now = Instant::now();
        self.remember(
            token,
            Published {
                host,
                body: Bytes::from(key_authorization.to_owned()),
                expires_at: deadline(now, ttl),
            },
            now,
        );
        lock(&self.misses).remove(token);
        Ok(())
    }

    /// Forgets `token`: from memory, and (best effort) from the store. Call
    /// once the order no longer needs it (valid or failed).
    pub async fn withdraw(&self, token: &str) {
        write(&self.entries).remove(token);
        if !valid_token(token) {
            return;
        }
        if let Err(e) = self.store.delete(&layout::challenge(token)).await {
            // The record expires on its own; nothing else to do.
            tracing::debug!(token, error = %e, "challenge record not deleted; it will expire");
        }
    }

    /// The key authorization to answer for `token` requested under
    /// `host_header`, counted in `acme_challenge_requests_total`.
    pub async fn lookup(&self, token: &str, host_header: Option<&str>) -> Lookup {
        match self.find(token, host_header).await {
            Found::Hit(body) => match std::str::from_utf8(&body) {
                Ok(s) => Lookup::Hit(s.to_owned()),
                // Bodies are built from &str: unreachable, but never panic.
                Err(_) => Lookup::Miss,
            },
            Found::Miss => Lookup::Miss,
            Found::Rejected => Lookup::Rejected,
        }
    }

    async fn find(&self, token: &str, host_header: Option<&str>) -> Found {
        if !valid_token(token) {
            self.rejected.inc();
            return Found::Rejected;
        }
        let now = Instant::now();
        if let Some(found) = self.in_memory(token, host_header, now) {
            return found;
        }
        if self.recently_missed(token, now) {
            self.missed.inc();
            return Found::Miss;
        }
        match self.in_store(token).await {
            Some(published) => {
                let found = if host_matches(&published.host, host_header) {
                    self.hits.inc();
                    Found::Hit(published.body.clone())
                } else {
                    self.rejected.inc();
                    Found::Rejected
                };
                self.remember(token, published, now);
                found
            }
            None => {
                self.remember_miss(token, now);
                self.missed.inc();
                Found::Miss
            }
        }
    }

    /// `None` when memory does not know the token (or its entry expired).
    fn in_memory(&self, token: &str, host_header: Option<&str>, now: Instant) -> Option<Found> {
        let entries = read(&self.entries);
        let entry = entries.get(token).filter(|e| e.expires_at > now)?;
        Some(if host_matches(&entry.host, host_header) {
            self.hits.inc();
            Found::Hit(entry.body.clone())
        } else {
            self.rejected.inc();
            Found::Rejected
        })
    }

    fn recently_missed(&self, token: &str, now: Instant) -> bool {
        lock(&self.misses)
            .get(token)
            .is_some_and(|at| now.saturating_duration_since(*at) < MISS_CACHE_TTL)
    }

    fn remember_miss(&self, token: &str, now: Instant) {
        let mut misses = lock(&self.misses);
        if misses.len() >= MAX_CACHED_MISSES {
            misses.retain(|_, at| now.saturating_duration_since(*at) < MISS_CACHE_TTL);
        }
        if misses.len() < MAX_CACHED_MISSES {
            misses.insert(token.to_owned(), now);
        }
    }

    fn remember(&self, token: &str, published: Published, now: Instant) {
        let mut entries = write(&self.entries);
        if entries.len() >= SWEEP_ABOVE {
            entries.retain(|_, e| e.expires_at > now);
        }
        entries.insert(token.to_owned(), published);
    }

    /// The token's record from the store; `None` when absent, expired,
    /// malformed or unreadable within [`STORE_LOOKUP_TIMEOUT`] (the last
    /// two logged).
    async fn in_store(&self, token: &str) -> Option<Published> {
        let key = layout::challenge(token);
        let mut last_error = None;
        let read = async {
            // The semaphore is never closed; a closed one would only mean no
            // limit.
            let _turn = self.store_lookups.acquire().await.ok();
            // A store that fails (restarting, a connection being re-made)
            // is asked again within the lookup's time: the CA's request
            // may have come in the second the store was away.
            loop {
                match self.store.get(&key).await {
                    Ok(found) => break found,
                    Err(e) => last_error = Some(e.to_string()),
                }
                tokio::time::sleep(STORE_RETRY_PAUSE).await;
            }
        };
        let outcome = tokio::time::timeout(STORE_LOOKUP_TIMEOUT, read).await;
        let Ok(found) = outcome else {
            self.warn_limited(&match &last_error {
                Some(e) => format!("store read failed for {STORE_LOOKUP_TIMEOUT:?}: {e}"),
                None => format!(
                    "store read took longer than {STORE_LOOKUP_TIMEOUT:?} (or \
                     {MAX_STORE_LOOKUPS} reads were already in flight)"
                ),
            });
            return None;
        };
        let entry = found?;
        if entry.value.len() > MAX_RECORD_BYTES {
            self.warn_limited(&format!(
                "record {key} is {} bytes, not a challenge record",
                entry.value.len()
            ));
            return None;
        }
        let record: ChallengeRecord = match serde_json::from_slice(&entry.value) {
            Ok(r) => r,
            Err(e) => {
                self.warn_limited(&format!("record {key} is not a challenge record: {e}"));
                return None;
            }
        };
        let host = normalize_host(&record.host);
        if host.is_empty() || !key_authorization_fits(token, &record.key_authorization) {
            self.warn_limited(&format!(
                "record {key} does not hold a key authorization for this token"
            ));
            return None;
        }
        let now = Instant::now();
        let mut ttl = STORE_HIT_CACHE_TTL;
        if let Some(at) = entry.expires_at_unix_ms {
            ttl = ttl.min(Duration::from_millis(at.saturating_sub(now_unix_ms())));
        }
        Some(Published {
            host,
            body: Bytes::from(record.key_authorization),
            expires_at: deadline(now, ttl),
        })
    }

    /// A warning at most every 10 s, with the count of those held back.
    fn warn_limited(&self, message: &str) {
        if let Some(suppressed) = self.warnings.open() {
            tracing::warn!(
                backend = self.store.backend(),
                suppressed,
                "challenge responder: {message}; answering 404 (the CA retries)"
            );
        }
    }
}

/// The HTTP-01 responder: `GET /.well-known/acme-challenge/{token}` answers
/// `200 text/plain` with the key authorization, or `404`; any other path or
/// method is `404`. Serve it on `--challenge-listen` (port 80 behind the
/// proxy), e.g. `axum::serve(listener, challenge_router(book))`.
pub fn challenge_router(book: Arc<ChallengeBook>) -> Router {
    Router::new().fallback(respond).with_state(book)
}

fn not_found() -> Response {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::NOT_FOUND;
    response
}

async fn respond(State(book): State<Arc<ChallengeBook>>, req: Request) -> Response {
    // The raw path, not percent-decoded: `%2e` and friends stay invalid.
    let Some(token) = req.uri().path().strip_prefix(CHALLENGE_PATH_PREFIX) else {
        return not_found();
    };
    if req.method() != Method::GET {
        return not_found();
    }
    // HTTP/1.1 sends Host; an absolute-form request target carries it in
    // the URI instead.
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()));
    match book.find(token, host).await {
        Found::Hit(body) => {
            let mut response = Response::new(Body::from(body));
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            response
        }
        Found::Miss | Found::Rejected => not_found(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens() {
        for ok in ["a", "abc_DEF-123", &"x".repeat(256)] {
            assert!(valid_token(ok), "{ok:?}");
        }
        for bad in [
            "",
            "../x",
            "a.b",
            "%2e",
            "a/b",
            "a b",
            "é",
            &"x".repeat(257),
        ] {
            assert!(!valid_token(bad), "{bad:?}");
        }
    }

    #[test]
    fn host_forms() {
        for (header, id) in [
            ("example.com", "example.com"),
            ("Example.COM:80", "example.com"),
            ("example.com.", "example.com"),
            ("example.com.:8080", "example.com"),
            ("[::1]:80", "::1"),
            ("[::1]", "::1"),
            ("::1", "::1"),
            ("10.0.0.1:80", "10.0.0.1"),
        ] {
            assert!(host_matches(id, Some(header)), "{header} vs {id}");
        }
        assert!(!host_matches("example.com", None));
        assert!(!host_matches("example.com", Some("evil.com")));
        assert!(!host_matches("example.com", Some("example.com.evil")));
        assert!(!host_matches("", Some(":80")));
        assert_eq!(normalize_host("API.example.com."), "api.example.com");
    }

    #[test]
    fn key_authorization_form() {
        assert!(key_authorization_fits("tok", "tok.abc-_9"));
        assert!(!key_authorization_fits("tok", "tok."));
        assert!(!key_authorization_fits("tok", "other.abc"));
        assert!(!key_authorization_fits("tok", "tokabc"));
        assert!(!key_authorization_fits("tok", "tok.a<script>"));
    }
}
