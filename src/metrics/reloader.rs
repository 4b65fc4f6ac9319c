//! The config reloader's metrics: `reloader_*` (docs/reference.md#reload-metrics).

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Config reloader metrics (docs/reference.md#reload-metrics).
pub struct ReloaderMetrics {
    /// `reloader_reloads_total`: reload POSTs answered or failed.
    pub reloads: Counter,
    /// `reloader_reloads_failed_total`: reload POSTs that did not deliver.
    pub reloads_failed: Counter,
    /// `reloader_last_reload_successful`: 1 when the last POST delivered.
    pub last_reload_successful: Gauge,
    /// `reloader_last_reload_success_timestamp_seconds`: unix time of the
    /// last delivered POST.
    pub last_reload_success_timestamp_seconds: Gauge<f64, AtomicU64>,
    /// `reloader_config_invalid_total`: new config contents that failed
    /// validation (and were not POSTed).
    pub config_invalid: Counter,
}

impl ReloaderMetrics {
    /// Registers the reloader's metrics in `registry`.
    pub(super) fn register(registry: &mut Registry) -> Self {
        let reloader = ReloaderMetrics {
            reloads: Counter::default(),
            reloads_failed: Counter::default(),
            last_reload_successful: Gauge::default(),
            last_reload_success_timestamp_seconds: Gauge::default(),
            config_invalid: Counter::default(),
        };
        registry.register(
            "reloader_reloads",
            "Config reload POSTs to the proxy, whatever their result",
            reloader.reloads.clone(),
        );
        registry.register(
            "reloader_reloads_failed",
            "Config reload POSTs that did not deliver (refused, busy, other status, no answer)",
            reloader.reloads_failed.clone(),
        );
        registry.register(
            "reloader_last_reload_successful",
            "1 when the last config reload POST delivered, else 0",
            reloader.last_reload_successful.clone(),
        );
        registry.register(
            "reloader_last_reload_success_timestamp_seconds",
            "Unix time of the last delivered config reload",
            reloader.last_reload_success_timestamp_seconds.clone(),
        );
        registry.register(
            "reloader_config_invalid",
            "New config file contents that failed validation and were not POSTed",
            reloader.config_invalid.clone(),
        );
        reloader
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use super::super::tests::assert_exposes;

    #[test]
    fn exposes_reloader_names() {
        let m = Metrics::new();
        m.reloader.config_invalid.inc();
        let text = m.encode();
        assert_exposes(
            &text,
            &[
                "reloader_reloads_total 0",
                "reloader_reloads_failed_total 0",
                "reloader_last_reload_successful 0",
                "reloader_last_reload_success_timestamp_seconds 0",
                "reloader_config_invalid_total 1",
            ],
        );
    }
}
