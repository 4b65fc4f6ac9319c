//! The admin API of sbproxy 1.13 (`proxy.admin`): health endpoints and
//! `POST /admin/reload`; and the reload itself, shared with the file
//! watcher.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use serde_json::json;

use crate::config::{self, AdminSettings, ConfigError, Origins, Settings};
use crate::log::rfc3339;

/// The configuration the proxy runs with, as last applied.
#[derive(Debug, Clone)]
pub struct Applied {
    pub revision: String,
    pub loaded_at: String,
    pub settings: Settings,
}

/// The result of a reload that applied the file.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub revision: String,
    pub loaded_at: String,
    pub fully_applied: bool,
    pub degraded: Vec<String>,
}

/// Why a reload did not apply the file.
#[derive(Debug)]
pub enum ReloadError {
    /// Another reload is running (`409`).
    Busy,
    /// The file cannot be read (`500`).
    Read(String),
    /// The file is refused (`400`); the running config stays.
    Config(ConfigError),
}

/// Who asked for a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// `POST /admin/reload`: refused while another reload runs; always
    /// rebuilds, even when the file is unchanged.
    Post,
    /// The file watcher: waits for a running reload; skips a file whose
    /// sha256 is that of the config last applied.
    Watcher,
}

/// State shared by the admin API, the watcher and `main`.
pub struct Shared {
    pub config_path: PathBuf,
    /// `proxy.admin` as the process started with it: changes to it need a
    /// restart, so the admin API keeps serving these settings.
    pub running_admin: AdminSettings,
    pub running_admin_block: serde_norway::Value,
    pub current: Mutex<Applied>,
    /// How long a rebuild takes (`SBPROXY_STANDIN_RELOAD_MS`).
    pub reload_delay: Duration,
    reload_lock: tokio::sync::Mutex<()>,
    rate: Mutex<HashMap<IpAddr, (Instant, u64)>>,
}

impl Shared {
    pub fn new(config_path: PathBuf, applied: Applied, reload_delay: Duration) -> Self {
        Shared {
            config_path,
            running_admin: applied.settings.admin.clone(),
            running_admin_block: applied.settings.admin_block.clone(),
            current: Mutex::new(applied),
            reload_delay,
            reload_lock: tokio::sync::Mutex::new(()),
            rate: Mutex::new(HashMap::new()),
        }
    }

    /// The origins of the config running now: they change with the
    /// revision, under the same lock, so a request sees one config.
    pub fn origins(&self) -> Arc<Origins> {
        self.current.lock().unwrap().settings.origins.clone()
    }

    /// Re-reads the config file and rebuilds. `Ok(None)`: the watcher found
    /// the file unchanged.
    pub async fn reload(&self, trigger: Trigger) -> Result<Option<Outcome>, ReloadError> {
        let _guard = match trigger {
            Trigger::Post => self.reload_lock.try_lock().map_err(|_| ReloadError::Busy)?,
            Trigger::Watcher => self.reload_lock.lock().await,
        };
        if trigger == Trigger::Post {
            crate::log::info!("reload (POST /admin/reload): re-reading the config file");
        }
        let raw = tokio::fs::read(&self.config_path)
            .await
            .map_err(|e| ReloadError::Read(format!("{}: {e}", self.config_path.display())))?;
        let revision = config::revision(&raw);
        if trigger == Trigger::Watcher && self.current.lock().unwrap().revision == revision {
            return Ok(None);
        }
        let settings =
            config::parse(&raw, &|name| std::env::var(name).ok()).map_err(ReloadError::Config)?;
        for w in &settings.warnings {
            crate::log::warning!("{}: {w}", self.config_path.display());
        }
        // The rebuild.
        tokio::time::sleep(self.reload_delay).await;
        let mut degraded = Vec::new();
        if settings.admin_block != self.running_admin_block {
            degraded.push("proxy.admin".to_owned());
        }
        let loaded_at = rfc3339(SystemTime::now());
        *self.current.lock().unwrap() = Applied {
            revision: revision.clone(),
            loaded_at: loaded_at.clone(),
            settings,
        };
        Ok(Some(Outcome {
            revision,
            loaded_at,
            fully_applied: degraded.is_empty(),
            degraded,
        }))
    }

    /// Counts one request from `ip`; false past the per-minute limit.
    fn admit(&self, ip: IpAddr) -> Result<(), u64> {
        let limit = self.running_admin.rate_limit_per_minute;
        if limit == 0 {
            return Ok(());
        }
        let now = Instant::now();
        let mut rate = self.rate.lock().unwrap();
        let entry = rate.entry(ip).or_insert((now, 0));
        if now.duration_since(entry.0) >= Duration::from_secs(60) {
            *entry = (now, 0);
        }
        entry.1 += 1;
        if entry.1 > limit {
            let left = Duration::from_secs(60).saturating_sub(now.duration_since(entry.0));
            return Err(left.as_secs().max(1));
        }
        Ok(())
    }

    fn allowed(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        let allow = &self.running_admin.allow_ips;
        if allow.is_empty() {
            ip.is_loopback()
        } else {
            allow.iter().any(|net| net.contains(ip))
        }
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let Some(value) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return false;
        };
        let Some((scheme, encoded)) = value.trim().split_once(' ') else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case("basic") {
            return false;
        }
        let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded.trim()) else {
            return false;
        };
        let Some(colon) = decoded.iter().position(|&b| b == b':') else {
            return false;
        };
        let (user, pass) = (&decoded[..colon], &decoded[colon + 1..]);
        let admin = &self.running_admin;
        // Both compared, always, so the time does not tell which was wrong.
        let user_ok = same(user, admin.username.as_bytes());
        let pass_ok = same(pass, admin.password.as_bytes());
        user_ok & pass_ok
    }
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn json_response(status: StatusCode, body: serde_json::Value) -> Response {
    (status, axum::Json(body)).into_response()
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    json_response(status, json!({ "error": message.into() }))
}

fn method_not_allowed(allow: &'static str) -> Response {
    let mut r = error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed");
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

/// Every admin request.
pub async fn handle(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let path = uri.path();
    let read = method == Method::GET || method == Method::HEAD;
    match path {
        // Probes: always answered (the kubelet probes from the node's address).
        "/healthz" | "/livez" | "/readyz" => {
            if !read {
                return method_not_allowed("GET, HEAD");
            }
            return (StatusCode::OK, "ok").into_response();
        }
        "/health" => {
            if !read {
                return method_not_allowed("GET, HEAD");
            }
            return json_response(
                StatusCode::OK,
                json!({ "status": "ok", "checks": { "config": "ok", "listeners": "ok" } }),
            );
        }
        _ => {}
    }
    if !shared.allowed(peer.ip()) {
        return error(StatusCode::FORBIDDEN, "forbidden");
    }
    if let Err(retry_after) = shared.admit(peer.ip()) {
        let mut r = error(StatusCode::TOO_MANY_REQUESTS, "rate limit exceeded");
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
        return r;
    }
    match path {
        "/admin/reload" => {
            if method != Method::POST {
                return method_not_allowed("POST");
            }
            if !shared.authorized(&headers) {
                return unauthorized();
            }
            post_reload(&shared).await
        }
        // Stand-in only (sbproxy 1.13 has no such endpoint): what the
        // running config is, so tests can see what the watcher applied.
        "/admin/config/revision" => {
            if !read {
                return method_not_allowed("GET, HEAD");
            }
            if !shared.authorized(&headers) {
                return unauthorized();
            }
            let current = shared.current.lock().unwrap().clone();
            json_response(
                StatusCode::OK,
                json!({ "config_revision": current.revision, "loaded_at": current.loaded_at }),
            )
        }
        _ => error(StatusCode::NOT_FOUND, "not found"),
    }
}

fn unauthorized() -> Response {
    let mut r = error(StatusCode::UNAUTHORIZED, "unauthorized");
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"sbproxy admin\""),
    );
    r
}

async fn post_reload(shared: &Shared) -> Response {
    match shared.reload(Trigger::Post).await {
        Ok(Some(outcome)) => {
            crate::log::info!(
                "reload (POST /admin/reload): applied revision {} fully_applied={} degraded={:?}",
                outcome.revision,
                outcome.fully_applied,
                outcome.degraded
            );
            json_response(
                StatusCode::OK,
                json!({
                    "config_revision": outcome.revision,
                    "loaded_at": outcome.loaded_at,
                    "fully_applied": outcome.fully_applied,
                    "degraded": outcome.degraded,
                }),
            )
        }
        Ok(None) => unreachable!("a POST always rebuilds"),
        Err(ReloadError::Busy) => {
            crate::log::warning!("reload (POST /admin/reload): refused, a reload is in progress");
            error(StatusCode::CONFLICT, "reload in progress")
        }
        Err(ReloadError::Read(m)) => {
            crate::log::error!("reload (POST /admin/reload): failed to read config file: {m}");
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("failed to read config file: {m}"),
            )
        }
        Err(ReloadError::Config(e)) => {
            crate::log::error!("reload (POST /admin/reload): {e}; the running config stays");
            error(StatusCode::BAD_REQUEST, e.to_string())
        }
    }
}

/// The admin router.
pub fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new().fallback(handle).with_state(shared)
}
