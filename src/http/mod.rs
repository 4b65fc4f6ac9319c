//! The admin listener: `/healthz`, `/startupz`, `/readyz`, `/metrics` and `/admin/*`
//! (docs/reference.md#admin-endpoints); serving it and the challenge
//! listener (`listener`); the challenge listener's passthrough to the
//! proxy ([`passthrough`]); the content negotiation of `/metrics`
//! (`negotiate.rs`: OpenMetrics or the Prometheus text format, by `Accept`).

mod auth;
pub(crate) mod listener;
mod negotiate;
pub mod passthrough;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

pub use auth::AdminAuth;

use crate::mesh::Mesh;
use crate::metrics::Metrics;

/// One readiness condition: `None` when it holds, else the reason it
/// does not (shown in `/readyz`).
pub(crate) type ReadinessCheck = Arc<dyn Fn() -> Option<String> + Send + Sync>;

/// Everything the admin endpoints read.
#[derive(Clone)]
pub(crate) struct AdminState {
    /// The mesh node.
    pub mesh: Mesh,
    /// The process's metrics.
    pub metrics: Arc<Metrics>,
    /// Who may call `/admin/*`.
    pub auth: AdminAuth,
    /// Conditions of `/readyz`, all of which must hold.
    pub readiness: Vec<ReadinessCheck>,
    /// Conditions `/readyz` and status report without failing readiness
    /// (a shared store's outage after it first answered).
    pub degraded: Vec<ReadinessCheck>,
    /// Conditions of `/startupz`, all of which must hold.
    pub startup: Vec<ReadinessCheck>,
}

impl AdminState {
    /// The reasons the node is not ready (empty when it is).
    pub(crate) fn not_ready_reasons(&self) -> Vec<String> {
        failing(&self.readiness)
    }

    /// What degrades the node without making it unready (empty when nothing).
    pub(crate) fn degraded_reasons(&self) -> Vec<String> {
        failing(&self.degraded)
    }
}

/// The reasons of the checks that fail.
fn failing(checks: &[ReadinessCheck]) -> Vec<String> {
    checks.iter().filter_map(|check| check()).collect()
}

/// `200` with `ok` when no reason is given, else `503` with
/// `{"<key>": false, "reasons": [...]}`: the answer of `/readyz` and
/// `/startupz`.
fn verdict(reasons: Vec<String>, ok: &'static str, key: &'static str) -> Response {
    if reasons.is_empty() {
        (StatusCode::OK, ok).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({ key: false, "reasons": reasons })),
        )
            .into_response()
    }
}

/// A readiness check that holds once the mesh runs, and fails while every
/// packet this node hears is rejected for clock skew (cut off from the mesh,
/// it would otherwise pass for a node alone).
pub(crate) fn mesh_running(mesh: Mesh) -> ReadinessCheck {
    Arc::new(move || {
        if let Some(isolation) = mesh.clock_skew_isolation() {
            return Some(format!("mesh: {isolation}"));
        }
        (!mesh.is_running())
            .then(|| "mesh: not joined yet (waiting up to 5 s for a peer)".to_owned())
    })
}

/// A degradation while a recent stall of this process may have made peers
/// suspect it ([`Mesh::recent_stall`]).
pub(crate) fn mesh_stalls(mesh: Mesh) -> ReadinessCheck {
    Arc::new(move || mesh.recent_stall())
}

/// The admin router. Serve it with connect info:
/// `axum::serve(listener, router.into_make_service_with_connect_info::<SocketAddr>())`.
pub(crate) fn admin_router(state: AdminState) -> Router {
    let admin = Router::new()
        .route("/admin/cluster/status", get(cluster_status))
        .fallback(|| async { StatusCode::NOT_FOUND })
        .route_layer(middleware::from_fn_with_state(state.clone(), require_admin));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/startupz", get(startupz))
        .route("/metrics", get(metrics))
        .merge(admin)
        .with_state(state)
}

async fn readyz(State(state): State<AdminState>) -> Response {
    let reasons = state.not_ready_reasons();
    let degraded = state.degraded_reasons();
    if reasons.is_empty() && !degraded.is_empty() {
        return (
            StatusCode::OK,
            axum::Json(serde_json::json!({ "ready": true, "degraded": degraded })),
        )
            .into_response();
    }
    verdict(reasons, "ready", "ready")
}

/// `200 started` once every start-up condition holds (the operator's
/// startup probe: the proxy container starts after it), else `503` with
/// the reasons.
async fn startupz(State(state): State<AdminState>) -> Response {
    verdict(failing(&state.startup), "started", "started")
}

/// `/metrics` in the format the `Accept` header prefers: OpenMetrics for a
/// scraper that asks for it first (Prometheus does), the Prometheus text
/// format 0.0.4 otherwise.
async fn metrics(State(state): State<AdminState>, headers: HeaderMap) -> Response {
    let format = negotiate::exposition_for(&headers);
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static(format.content_type()),
            ),
            (header::VARY, HeaderValue::from_static("Accept")),
        ],
        state.metrics.encode_as(format),
    )
        .into_response()
}

async fn cluster_status(State(state): State<AdminState>) -> Response {
    match state.mesh.status().await {
        Some(status) => {
            // The local node's degradations beside the mesh's view (not
            // gossiped: each node says its own).
            let degraded = state.degraded_reasons();
            if degraded.is_empty() {
                return axum::Json(status).into_response();
            }
            let mut body = serde_json::to_value(&status).unwrap_or_default();
            if let Some(object) = body.as_object_mut() {
                object.insert("degraded".to_owned(), serde_json::json!(degraded));
            }
            axum::Json(body).into_response()
        }
        None => (StatusCode::SERVICE_UNAVAILABLE, "mesh stopped").into_response(),
    }
}

async fn require_admin(
    State(state): State<AdminState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request,
    next: Next,
) -> Response {
    let given = req.headers().get(header::AUTHORIZATION);
    match state.auth.check(given, peer.ip()) {
        auth::Verdict::Allow => next.run(req).await,
        auth::Verdict::Challenge => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Basic realm=\"sbmesh\"")],
            "unauthorized\n",
        )
            .into_response(),
        auth::Verdict::LoopbackOnly => (
            StatusCode::FORBIDDEN,
            "/admin/* answers loopback clients only: set --admin-user and --admin-password \
             (or proxy.admin.username/password) to allow remote clients\n",
        )
            .into_response(),
    }
}
