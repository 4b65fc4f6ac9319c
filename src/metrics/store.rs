//! The certificate store's metrics: `store_*` (docs/reference.md#store-metrics).

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::ReasonLabels;

/// `{backend,op,result}` of `store_operations_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StoreOpLabels {
    /// Backend name (`Store::backend`).
    pub backend: &'static str,
    /// Operation: `get`, `put`, `put_if_absent`, `compare_and_swap`, `delete`, `list`, `sweep_expired`.
    pub op: &'static str,
    /// `ok`, `error`, `conflict` (create-only or compare-and-swap lost) or `miss` (absent).
    pub result: &'static str,
}

/// `{backend}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    /// Backend name (`Store::backend`).
    pub backend: &'static str,
}

/// `{backend,op}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendOpLabels {
    /// Backend name (`Store::backend`).
    pub backend: &'static str,
    /// Operation, as in [`StoreOpLabels::op`].
    pub op: &'static str,
}

/// Certificate store metrics (docs/reference.md#store-metrics).
pub struct StoreMetrics {
    /// `store_operations_total{backend,op,result}`.
    pub operations: Family<StoreOpLabels, Counter>,
    /// `store_lock_acquired_total{backend}`.
    pub lock_acquired: Family<BackendLabels, Counter>,
    /// `store_unseal_failures_total{reason}`: records read but not opened
    /// (`missing_key`: sealed under a key no longer in the ring).
    pub unseal_failures: Family<ReasonLabels, Counter>,
    /// `store_operation_duration_seconds{backend,op}`: how long each store
    /// operation took, whatever its result (a failing backend shows as slow
    /// here before it shows as errors: timeouts).
    pub operation_seconds: Family<BackendOpLabels, Histogram, fn() -> Histogram>,
}

/// Buckets of `store_operation_duration_seconds`: from a local store's
/// sub-millisecond read to an object store's multi-second timeout.
pub const STORE_SECONDS_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5, 10.0,
];

fn store_seconds_histogram() -> Histogram {
    Histogram::new(STORE_SECONDS_BUCKETS)
}

impl StoreMetrics {
    /// Registers the store's families in `registry` (`missing_key` at zero).
    pub(super) fn register(registry: &mut Registry) -> Self {
        let store = StoreMetrics {
            operations: Family::default(),
            lock_acquired: Family::default(),
            unseal_failures: Family::default(),
            operation_seconds: Family::new_with_constructor(store_seconds_histogram),
        };
        registry.register(
            "store_operations",
            "Certificate store operations, by backend, operation and result",
            store.operations.clone(),
        );
        registry.register(
            "store_lock_acquired",
            "Lease locks acquired in the certificate store, by backend",
            store.lock_acquired.clone(),
        );
        let _ = store.unseal_failures.get_or_create(&ReasonLabels {
            reason: "missing_key",
        });
        registry.register(
            "store_operation_duration_seconds",
            "Time taken by certificate store operations, by backend and operation, whatever the result",
            store.operation_seconds.clone(),
        );
        registry.register(
            "store_unseal_failures",
            "Store records read but not opened, by reason (missing_key: sealed under a key no longer in the cluster key ring)",
            store.unseal_failures.clone(),
        );
        store
    }

    /// Counts one store operation.
    pub(crate) fn operation(&self, backend: &'static str, op: &'static str, result: &'static str) {
        self.operations
            .get_or_create(&StoreOpLabels {
                backend,
                op,
                result,
            })
            .inc();
    }

    /// Records how long one store operation took.
    pub(crate) fn observe(&self, backend: &'static str, op: &'static str, took: Duration) {
        self.operation_seconds
            .get_or_create(&BackendOpLabels { backend, op })
            .observe(took.as_secs_f64());
    }

    /// Counts one lease lock acquisition.
    pub(crate) fn lock_acquired(&self, backend: &'static str) {
        self.lock_acquired
            .get_or_create(&BackendLabels { backend })
            .inc();
    }

    /// Counts one record that could not be opened.
    pub(crate) fn unseal_failed(&self, reason: &'static str) {
        self.unseal_failures
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use super::super::tests::assert_exposes;

    #[test]
    fn exposes_store_names() {
        let m = Metrics::new();
        m.store.operation("redis", "get", "miss");
        m.store.lock_acquired("redis");
        m.store.unseal_failed("missing_key");
        let text = m.encode();
        assert_exposes(
            &text,
            &[
                "store_operations_total{backend=\"redis\",op=\"get\",result=\"miss\"} 1",
                "store_lock_acquired_total{backend=\"redis\"} 1",
                "store_unseal_failures_total{reason=\"missing_key\"} 1",
            ],
        );
    }
}
