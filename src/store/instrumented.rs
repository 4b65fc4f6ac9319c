//! A [`Store`] decorator that counts every operation in
//! `store_operations_total{backend,op,result}` and times it in
//! `store_operation_duration_seconds{backend,op}` (docs/reference.md#store-metrics).
//!
//! `result` is `ok`, `error`, `conflict` (a create-only write found the key,
//! a compare-and-swap lost, or a fenced write was refused) or `miss` (a `get` found nothing, a `delete`
//! removed nothing). Lock acquisitions are counted by the lock itself
//! ([`super::lock::LeaseLock::with_metrics`]).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::{Entry, Store, StoreError, Version};
use crate::metrics::Metrics;

/// Operation labels, as the metric shows them. Readings of the store's
/// clock are not counted: the backend caches them, and asks the server
/// about twice a minute.
pub(crate) const OPS: [&str; 8] = [
    "get",
    "put",
    "put_if_absent",
    "compare_and_swap",
    "delete",
    "list",
    "sweep_expired",
    "put_fenced",
];

/// Counts the operations of the store it wraps.
pub struct Instrumented<S: ?Sized> {
    inner: Arc<S>,
    metrics: Arc<Metrics>,
}

impl<S: Store + ?Sized> Instrumented<S> {
    /// Wraps `inner`; the `ok` and `error` series of every operation of this
    /// backend are created at zero, so a scrape shows them before any use.
    pub fn new(inner: Arc<S>, metrics: Arc<Metrics>) -> Self {
        let backend = inner.backend();
        for op in OPS {
            for result in ["ok", "error"] {
                let _ = metrics
                    .store
                    .operations
                    .get_or_create(&crate::metrics::StoreOpLabels {
                        backend,
                        op,
                        result,
                    });
            }
        }
        let _ = metrics
            .store
            .lock_acquired
            .get_or_create(&crate::metrics::BackendLabels { backend });
        Self { inner, metrics }
    }

    fn count<T>(
        &self,
        op: &'static str,
        started: Instant,
        result: &Result<T, StoreError>,
        outcome: impl Fn(&T) -> &'static str,
    ) {
        self.metrics
            .store
            .observe(self.inner.backend(), op, started.elapsed());
        let label = match result {
            Ok(value) => outcome(value),
            Err(StoreError::Fenced { .. }) => "conflict",
            Err(_) => "error",
        };
        self.metrics
            .store
            .operation(self.inner.backend(), op, label);
    }
}

impl<S: Store + ?Sized> fmt::Debug for Instrumented<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Instrumented").field(&self.inner).finish()
    }
}

fn ok<T>(_: &T) -> &'static str {
    "ok"
}

fn found<T>(value: &Option<T>) -> &'static str {
    if value.is_some() { "ok" } else { "miss" }
}

fn written<T>(value: &Option<T>) -> &'static str {
    if value.is_some() { "ok" } else { "conflict" }
}

#[async_trait]
impl<S: Store + ?Sized> Store for Instrumented<S> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn is_shared(&self) -> bool {
        self.inner.is_shared()
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let started = Instant::now();
        let result = self.inner.get(key).await;
        self.count("get", started, &result, found);
        result
    }

    async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Version, StoreError> {
        let started = Instant::now();
        let result = self.inner.put(key, value, ttl).await;
        self.count("put", started, &result, ok);
        result
    }

    async fn put_if_absent(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        let started = Instant::now();
        let result = self.inner.put_if_absent(key, value, ttl).await;
        self.count("put_if_absent", started, &result, written);
        result
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: &Version,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        let started = Instant::now();
        let result = self.inner.compare_and_swap(key, expected, value, ttl).await;
        self.count("compare_and_swap", started, &result, written);
        result
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let started = Instant::now();
        let result = self.inner.delete(key).await;
        self.count("delete", started, &result, |removed| {
            if *removed { "ok" } else { "miss" }
        });
        result
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let started = Instant::now();
        let result = self.inner.list(prefix).await;
        self.count("list", started, &result, ok);
        result
    }

    async fn sweep_expired(&self) -> Result<usize, StoreError> {
        let started = Instant::now();
        let result = self.inner.sweep_expired().await;
        self.count("sweep_expired", started, &result, ok);
        result
    }

    async fn put_fenced(
        &self,
        key: &str,
        value: &[u8],
        lock_key: &str,
        fence: u64,
    ) -> Result<Version, StoreError> {
        let started = Instant::now();
        let result = self.inner.put_fenced(key, value, lock_key, fence).await;
        self.count("put_fenced", started, &result, ok);
        result
    }

    async fn clock_offset_ms(&self) -> Result<i64, StoreError> {
        self.inner.clock_offset_ms().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::memory::MemoryStore;

    #[tokio::test]
    async fn counts_results_by_operation() {
        let metrics = Arc::new(Metrics::new());
        let store = Instrumented::new(Arc::new(MemoryStore::new()), Arc::clone(&metrics));
        assert_eq!(store.backend(), "memory");
        assert!(store.get("a").await.unwrap().is_none());
        let v = store.put("a", b"1", None).await.unwrap();
        assert!(
            store
                .put_if_absent("a", b"2", None)
                .await
                .unwrap()
                .is_none()
        );
        assert!(
            store
                .compare_and_swap("a", &v, b"3", None)
                .await
                .unwrap()
                .is_some()
        );
        assert!(
            store
                .compare_and_swap("a", &v, b"4", None)
                .await
                .unwrap()
                .is_none()
        );
        assert!(store.get("a").await.unwrap().is_some());
        assert!(store.delete("a").await.unwrap());
        assert!(!store.delete("a").await.unwrap());
        assert!(store.get("../x").await.is_err());
        assert_eq!(store.list("").await.unwrap(), Vec::<String>::new());

        let text = metrics.encode();
        for line in [
            r#"store_operations_total{backend="memory",op="get",result="miss"} 1"#,
            r#"store_operations_total{backend="memory",op="get",result="ok"} 1"#,
            r#"store_operations_total{backend="memory",op="get",result="error"} 1"#,
            r#"store_operations_total{backend="memory",op="put",result="ok"} 1"#,
            r#"store_operations_total{backend="memory",op="put_if_absent",result="conflict"} 1"#,
            r#"store_operations_total{backend="memory",op="compare_and_swap",result="ok"} 1"#,
            r#"store_operations_total{backend="memory",op="compare_and_swap",result="conflict"} 1"#,
            r#"store_operations_total{backend="memory",op="delete",result="ok"} 1"#,
            r#"store_operations_total{backend="memory",op="delete",result="miss"} 1"#,
            r#"store_operations_total{backend="memory",op="list",result="ok"} 1"#,
            r#"store_operations_total{backend="memory",op="sweep_expired",result="ok"} 0"#,
            r#"store_lock_acquired_total{backend="memory"} 0"#,
            // Every operation timed, whatever its result: two gets
            // answered and one refused.
            r#"store_operation_duration_seconds_count{backend="memory",op="get"} 3"#,
            r#"store_operation_duration_seconds_count{backend="memory",op="delete"} 2"#,
            r#"store_operation_duration_seconds_bucket{le="10.0",backend="memory",op="put"} 1"#,
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[tokio::test]
    async fn works_behind_dyn_store() {
        let metrics = Arc::new(Metrics::new());
        let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let store: Arc<dyn Store> = Arc::new(Instrumented::new(inner, Arc::clone(&metrics)));
        store.put("k", b"v", None).await.unwrap();
        assert!(
            metrics
                .encode()
                .contains(r#"store_operations_total{backend="memory",op="put",result="ok"} 1"#)
        );
    }
}
