//! Metrics of handing certificates to the running proxy: `sbmesh_proxy_*`
//! and `sbmesh_watch_tls_rejected_total`
//! (docs/reference.md#proxy-hand-off-metrics).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::ReasonLabels;

/// Metrics of handing certificates to the running proxy.
pub struct ProxyMetrics {
    /// `sbmesh_proxy_restarts_total{reason="certificate"}` (docs/reference.md#proxy-hand-off-metrics).
    pub restarts: Family<ReasonLabels, Counter>,
    /// `sbmesh_proxy_restart_failing`: 1 while the last certificate restart
    /// failed (no proxy process could be signalled, or it did not answer its
    /// health URL again in time) and the proxy has not answered since; the
    /// same condition fails `/readyz` with its reason.
    pub restart_failing: Gauge,
    /// `sbmesh_watch_tls_rejected_total{reason}`: certificate pairs in a
    /// `--watch-tls` directory that were not applied, by reason.
    pub watch_tls_rejected: Family<ReasonLabels, Counter>,
}

impl ProxyMetrics {
    /// Reasons of `sbmesh_watch_tls_rejected_total`.
    pub(crate) const WATCH_TLS_REASONS: [&'static str; 4] =
        ["incomplete", "too_large", "unparsable", "mismatch"];

    /// Registers the hand-off's metrics in `registry`, every reason at zero.
    pub(super) fn register(registry: &mut Registry) -> Self {
        let proxy = ProxyMetrics {
            restarts: Family::default(),
            restart_failing: Gauge::default(),
            watch_tls_rejected: Family::default(),
        };
        let _ = proxy.restarts.get_or_create(&ReasonLabels {
            reason: "certificate",
        });
        for reason in ProxyMetrics::WATCH_TLS_REASONS {
            let _ = proxy
                .watch_tls_rejected
                .get_or_create(&ReasonLabels { reason });
        }
        registry.register(
            "sbmesh_proxy_restarts",
            "Graceful proxy restarts (SIGTERM) signalled by this node, by reason",
            proxy.restarts.clone(),
        );
        registry.register(
            "sbmesh_proxy_restart_failing",
            "1 while the last certificate restart of the proxy failed (not signalled, or not healthy again in time) and the proxy has not answered since, else 0",
            proxy.restart_failing.clone(),
        );
        registry.register(
            "sbmesh_watch_tls_rejected",
            "Certificate pairs in --watch-tls directories not applied, by reason",
            proxy.watch_tls_rejected.clone(),
        );
        proxy
    }

    /// Counts one proxy restart for a new certificate.
    pub(crate) fn restarted_for_certificate(&self) {
        self.restarts
            .get_or_create(&ReasonLabels {
                reason: "certificate",
            })
            .inc();
    }

    /// Counts one rejected `--watch-tls` pair.
    pub(crate) fn watch_tls_rejected(&self, reason: &'static str) {
        self.watch_tls_rejected
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use super::super::tests::assert_exposes;

    #[test]
    fn exposes_proxy_names() {
        let m = Metrics::new();
        m.proxy.watch_tls_rejected("mismatch");
        let text = m.encode();
        assert_exposes(
            &text,
            &[
                "sbmesh_proxy_restart_failing 0",
                "sbmesh_proxy_restarts_total{reason=\"certificate\"} 0",
                "sbmesh_watch_tls_rejected_total{reason=\"mismatch\"} 1",
                "sbmesh_watch_tls_rejected_total{reason=\"incomplete\"} 0",
            ],
        );
        m.proxy.restarted_for_certificate();
        assert!(
            m.encode()
                .contains("sbmesh_proxy_restarts_total{reason=\"certificate\"} 1")
        );
    }
}
