//! What the operator tells the outside world about itself: logs on stderr,
//! and `/metrics` + `/healthz` on `--metrics-listen`.
//!
//! Metric names (prefix `sbmesh_operator_`):
//! - `reconciles_total{result="ok|refused|error"}`: finished reconciles,
//! - `reconcile_duration_seconds`: histogram of reconcile durations,
//! - `leader`: 1 while this process holds the leader Lease (or runs
//!   without leader election), else 0,
//! - `config_nudges_total{result="patched|failed"}`: pods annotated with a
//!   new config's hash or cluster key's ids so their kubelet writes it at
//!   once (failed: the pod reads it at the kubelet's next periodic sync
//!   instead).

use std::io::IsTerminal;
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tracing::warn;
use tracing_subscriber::EnvFilter;

/// How a reconcile ended, as a label value.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ReconcileResult {
    /// Objects applied and status written.
    ok,
    /// The spec was refused (docs/reference.md#refusal-reasons): no workload change.
    refused,
    /// An API call failed; the error policy requeues with backoff.
    error,
}

/// `{result="ok|refused|error"}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// How the reconcile ended.
    pub result: ReconcileResult,
}

/// How telling a pod of a new config ended, as a label value.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum NudgeResult {
    /// The pod's annotation was patched.
    patched,
    /// The pods could not be listed, or one could not be patched.
    failed,
}

/// `{result="patched|failed"}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NudgeLabels {
    /// How it ended.
    pub result: NudgeResult,
}

/// What the webhook did with one request: the `result` label of
/// `sbmesh_injections_total` (docs/reference.md lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Injection {
    /// The sidecar was added.
    injected,
    /// Admitted as it is: opted out, has the sidecar already, not a
    /// proxy (no `sb.yml` mount), or not a pod creation.
    skipped,
    /// Refused: an annotation of ours has a value the reference does not
    /// accept.
    refused,
    /// Admitted as it is: the request's object is not a pod we can read.
    unreadable,
    /// Not an AdmissionReview: answered `400`.
    malformed,
    /// Found afterwards by the operator: created in an opted-in place
    /// without the sidecar while no replica answered (the operator's check of opted-in pods).
    missed,
}

impl Injection {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Injection::injected => "injected",
            Injection::skipped => "skipped",
            Injection::refused => "refused",
            Injection::unreadable => "unreadable",
            Injection::malformed => "malformed",
            Injection::missed => "missed",
        }
    }
}

/// `{result}` of `sbmesh_injections_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct InjectionLabels {
    /// What happened.
    pub result: Injection,
}

/// The operator's one metrics registry.
pub struct Metrics {
    registry: Registry,
    /// `sbmesh_operator_reconciles_total{result}`.
    pub reconciles: Family<ResultLabels, Counter>,
    /// `sbmesh_operator_reconcile_duration_seconds`.
    pub reconcile_duration: Histogram,
    /// `sbmesh_operator_leader`: 1 while this process may reconcile.
    pub leader: Gauge,
    /// `sbmesh_operator_config_nudges_total{result}`.
    pub config_nudges: Family<NudgeLabels, Counter>,
    /// `sbmesh_injections_total{result}` (SPEC section 13 names it
    /// without the operator's prefix).
    pub injections: Family<InjectionLabels, Counter>,
}

impl Metrics {
    /// A fresh registry with every operator metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let reconciles = Family::<ResultLabels, Counter>::default();
        // Reconciles are a handful of API round trips: milliseconds when
        // the API server is healthy, seconds when it is not.
        let reconcile_duration = Histogram::new([
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ]);
        let leader = Gauge::default();
        registry.register(
            "sbmesh_operator_reconciles",
            "Finished reconciles of SBProxies, by result",
            reconciles.clone(),
        );
        registry.register_with_unit(
            "sbmesh_operator_reconcile_duration",
            "Duration of one SBProxy reconcile",
            Unit::Seconds,
            reconcile_duration.clone(),
        );
        registry.register(
            "sbmesh_operator_leader",
            "1 while this process holds the leader Lease and runs the controller, else 0",
            leader.clone(),
        );
        let config_nudges = Family::<NudgeLabels, Counter>::default();
        registry.register(
            "sbmesh_operator_config_nudges",
            "Pods annotated with a new config's hash so that their kubelet writes it at once, by result",
            config_nudges.clone(),
        );
        let injections = Family::<InjectionLabels, Counter>::default();
        registry.register(
            "sbmesh_injections",
            "Pod admissions the injection webhook answered, and opted-in pods found without the sidecar (missed), by result",
            injections.clone(),
        );
        Self {
            registry,
            reconciles,
            reconcile_duration,
            leader,
            config_nudges,
            injections,
        }
    }

    /// Counts one pod told (or not) of a new config.
    pub fn nudged(&self, result: NudgeResult) {
        self.config_nudges
            .get_or_create(&NudgeLabels { result })
            .inc();
    }

    /// Counts one admission (or one missed pod).
    pub fn injection(&self, result: Injection) {
        self.injections
            .get_or_create(&InjectionLabels { result })
            .inc();
    }

    /// Records one finished reconcile.
    pub fn observe_reconcile(&self, result: ReconcileResult, took: Duration) {
        self.reconciles
            .get_or_create(&ResultLabels { result })
            .inc();
        self.reconcile_duration.observe(took.as_secs_f64());
    }

    /// How many reconciles ended with `result` so far.
    pub fn reconciles_with(&self, result: ReconcileResult) -> u64 {
        self.reconciles
            .get_or_create(&ResultLabels { result })
            .get()
    }

    /// Sets the leader gauge.
    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// The registry in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; an error here would be a
        // prometheus-client bug, and an empty page is the safe answer.
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The `/metrics`, `/healthz` and `/readyz` router; `webhook` is the
/// injection webhook's certificate, which `/readyz` waits for.
pub fn router(metrics: Arc<Metrics>, webhook: Arc<crate::webhook::Current>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(
                            header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.encode(),
                    )
                        .into_response()
                }
            }),
        )
        // Alive is all this says: a follower is healthy too, and a leader
        // that cannot reach the API server exits by itself when its Lease
        // cannot be renewed.
        .route("/healthz", get(|| async { (StatusCode::OK, "ok\n") }))
        // Ready once the webhook has its serving certificate: the webhook's
        // Service sends admissions only to replicas that can answer them.
        .route(
            "/readyz",
            get(move || {
                let webhook = webhook.clone();
                async move {
                    if webhook.loaded() {
                        (StatusCode::OK, "ready\n")
                    } else {
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            "the injection webhook has no serving certificate yet (see the log)\n",
                        )
                    }
                }
            }),
        )
}

/// Serves [`router`] on `listener` until `stop` turns true.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    webhook: Arc<crate::webhook::Current>,
    mut stop: watch::Receiver<bool>,
) {
    let shutdown = async move {
        let _ = stop.wait_for(|s| *s).await;
    };
    if let Err(e) = axum::serve(listener, router(metrics, webhook))
        .with_graceful_shutdown(shutdown)
        .await
    {
        warn!(error = %e, "metrics listener failed");
    }
}

/// Installs the global tracing subscriber on stderr: JSON when `format` is
/// `json`, or when it is unset and stderr is not a terminal (a pod's log);
/// text otherwise. `RUST_LOG` overrides the `info` filter.
pub fn init_logging(format: Option<&str>) -> anyhow::Result<()> {
    let json = match format {
        Some("json") => true,
        Some("text") => false,
        Some(other) => anyhow::bail!("--log-format {other:?}: expected \"json\" or \"text\""),
        None => !std::io::stderr().is_terminal(),
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    // A second install (tests calling `run` twice) keeps the first one.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_as_documented() {
        let m = Metrics::new();
        m.observe_reconcile(ReconcileResult::refused, Duration::from_millis(3));
        m.set_leader(true);
        let text = m.encode();
        assert!(
            text.contains("sbmesh_operator_reconciles_total{result=\"refused\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("sbmesh_operator_reconcile_duration_seconds_count 1"),
            "{text}"
        );
        assert!(text.contains("sbmesh_operator_leader 1"), "{text}");
        assert_eq!(m.reconciles_with(ReconcileResult::refused), 1);
        assert_eq!(m.reconciles_with(ReconcileResult::ok), 0);
    }
}
