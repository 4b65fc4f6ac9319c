//! The one metrics registry of a process, with the metric names of
//! docs/reference.md#metrics. Every component takes an `Arc<Metrics>` and
//! records into it; `/metrics` encodes the registry in the `Exposition`
//! the scraper asks for (negotiated in `crate::http`): OpenMetrics 1.0.0,
//! or the Prometheus text format 0.0.4.
//!
//! Each group of metrics is one file that declares its families, their
//! label sets and the one place their names are written (its `register`):
//! [`MeshMetrics`], [`HttpMetrics`] (the admin and challenge listeners),
//! [`StoreMetrics`], [`ReloaderMetrics`], [`AcmeMetrics`] and
//! [`ProxyMetrics`]. [`Metrics::new`] registers them in that order, which is
//! the order of the exposition.

mod acme;
mod listeners;
mod mesh;
mod proxy;
mod reloader;
mod store;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::registry::Registry;

pub use acme::{AcmeMetrics, CertExpiry, HostLabels};
pub use listeners::{HttpMetrics, ListenerLabels, PASSTHROUGH_RESULTS};
pub use mesh::{
    MeshMetrics, PeerState, StateLabels, TRANSPORT_REFUSED_REASONS, Transport, TransportLabels,
};
pub use proxy::ProxyMetrics;
pub use reloader::ReloaderMetrics;
pub use store::{
    BackendLabels, BackendOpLabels, STORE_SECONDS_BUCKETS, StoreMetrics, StoreOpLabels,
};

/// `{reason=...}`: why a packet was dropped (`mesh_packets_rejected_total`:
/// `decrypt|cluster|replay|clock_skew|decode|size`), a connection refused,
/// a record not opened, the proxy restarted or a certificate pair rejected.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// The reason.
    pub reason: &'static str,
}

/// `{result=...}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// The outcome.
    pub result: &'static str,
}

/// All metrics of one process.
pub struct Metrics {
    registry: Registry,
    /// The mesh's metrics.
    pub mesh: MeshMetrics,
    /// The admin and challenge listeners' metrics.
    pub http: HttpMetrics,
    /// The certificate store's metrics.
    pub store: StoreMetrics,
    /// The config reloader's metrics.
    pub reloader: ReloaderMetrics,
    /// The ACME issuer's and challenge responder's metrics.
    pub acme: AcmeMetrics,
    /// Certificates handed to the running proxy (restarts, `--watch-tls`).
    pub proxy: ProxyMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered (and the label sets that are
    /// fixed by docs/reference.md#metrics pre-created, so a scrape shows them at zero).
    pub fn new() -> Self {
        let mut registry = Registry::default();
        // Registration order is exposition order: keep it.
        let mesh = MeshMetrics::register(&mut registry);
        let http = HttpMetrics::register(&mut registry);
        let store = StoreMetrics::register(&mut registry);
        let reloader = ReloaderMetrics::register(&mut registry);
        let acme = AcmeMetrics::register(&mut registry);
        let proxy = ProxyMetrics::register(&mut registry);
        Self {
            registry,
            mesh,
            http,
            store,
            reloader,
            acme,
            proxy,
        }
    }

    /// Mutable access for components that register their own families.
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The OpenMetrics text exposition (what tests and embedders read).
    pub fn encode(&self) -> String {
        self.encode_as(Exposition::OpenMetrics)
    }

    /// The registry in the given exposition format.
    pub(crate) fn encode_as(&self, format: Exposition) -> String {
        let mut out = String::with_capacity(4096);
        // Writing into a String cannot fail.
        let _ = match format {
            Exposition::OpenMetrics => {
                prometheus_client::encoding::text::encode(&mut out, &self.registry)
            }
            Exposition::PrometheusText => {
                prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
            }
        };
        out
    }
}

/// The text formats `/metrics` answers in.
///
/// Both carry the same families and samples. OpenMetrics names a counter
/// family without `_total` in `# TYPE`, and ends with `# EOF`; the Prometheus
/// text format 0.0.4 names it with `_total` and has no end marker. Which one
/// a request gets is the admin router's content negotiation
/// (`crate::http`, from the `Accept` header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Exposition {
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
    /// Prometheus text format 0.0.4.
    PrometheusText,
}

impl Exposition {
    /// The `Content-Type` of a response in this format.
    pub(crate) fn content_type(self) -> &'static str {
        match self {
            Exposition::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Exposition::PrometheusText => {
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Every one of `lines` is in the exposition `text`.
    pub(crate) fn assert_exposes(text: &str, lines: &[&str]) {
        for line in lines {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn content_types_name_the_format() {
        assert_eq!(
            Exposition::OpenMetrics.content_type(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8"
        );
        assert_eq!(
            Exposition::PrometheusText.content_type(),
            "text/plain; version=0.0.4; charset=utf-8"
        );
    }

    /// The lines that carry values, sorted, with a histogram bucket's
    /// bound written one way (`le="1.0"` in OpenMetrics is `le="1"` in the
    /// Prometheus text format, and the two order a histogram's lines
    /// differently).
    fn samples(text: &str) -> Vec<String> {
        let mut out: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| match l.split_once("le=\"") {
                Some((head, rest)) => match rest.split_once('"') {
                    Some((bound, tail)) => {
                        let bound = bound.strip_suffix(".0").unwrap_or(bound);
                        format!("{head}le=\"{bound}\"{tail}")
                    }
                    None => l.to_owned(),
                },
                None => l.to_owned(),
            })
            .collect();
        out.sort();
        out
    }

    #[test]
    fn both_expositions_carry_the_same_samples() {
        let m = Metrics::new();
        m.mesh.rejected("decrypt");
        m.store.operation("redis", "put", "error");
        m.acme.set_expiry("a.example.com", 86_400);
        m.reloader.last_reload_success_timestamp_seconds.set(1.5e9);
        let open = m.encode_as(Exposition::OpenMetrics);
        let text = m.encode_as(Exposition::PrometheusText);
        assert_eq!(samples(&open), samples(&text));
        assert!(
            text.contains(
                "store_operations_total{backend=\"redis\",op=\"put\",result=\"error\"} 1\n"
            ),
            "{text}"
        );
        assert_eq!(m.encode(), open, "encode() is the OpenMetrics form");
    }

    #[test]
    fn openmetrics_ends_with_eof_and_types_counters_without_total() {
        let open = Metrics::new().encode_as(Exposition::OpenMetrics);
        assert!(open.ends_with("# EOF\n"), "{open}");
        assert!(
            open.contains("# TYPE mesh_packets_rejected counter\n"),
            "{open}"
        );
    }

    #[test]
    fn prometheus_text_types_counters_with_total_and_has_no_eof() {
        let m = Metrics::new();
        m.store.operation("redb", "get", "ok");
        let text = m.encode_as(Exposition::PrometheusText);
        assert!(!text.contains("# EOF"), "{text}");
        assert!(!text.contains("_created"), "{text}");
        assert!(!text.contains("# UNIT"), "{text}");
        for line in [
            "# TYPE mesh_packets_rejected_total counter\n",
            "# HELP mesh_packets_rejected_total Mesh packets dropped, by reason.\n",
            "# TYPE store_operations_total counter\n",
            "# TYPE reloader_reloads_failed_total counter\n",
            "# TYPE sbmesh_proxy_restarts_total counter\n",
            "# TYPE mesh_peer_count gauge\n",
            "# TYPE sbproxy_cert_expiry_seconds gauge\n",
            "# TYPE sbmesh_proxy_restart_failing gauge\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        // Every sample belongs to the family its TYPE line declares (a
        // histogram's as its _bucket, _sum and _count).
        let (mut family, mut kind) = ("", "");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut words = rest.split(' ');
                family = words.next().unwrap_or_default();
                kind = words.next().unwrap_or_default();
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap_or_default();
                let name = match kind {
                    "histogram" => ["_bucket", "_sum", "_count"]
                        .iter()
                        .find_map(|s| name.strip_suffix(s))
                        .unwrap_or(name),
                    _ => name,
                };
                assert_eq!(name, family, "sample {line:?} outside its family");
            }
        }
    }
}
