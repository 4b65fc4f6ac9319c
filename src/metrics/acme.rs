//! The ACME issuer's and challenge responder's metrics: `acme_*`,
//! `sbproxy_cert_expiry_seconds`, and the challenge check's
//! `sbmesh_acme_challenge_checks_total` and `sbmesh_acme_orders_waiting`,
//! and `sbmesh_acme_orders_in_progress` (docs/reference.md#acme-metrics).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

use super::ResultLabels;

/// `{host=...}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HostLabels {
    /// The certificate's hostname.
    pub host: String,
}

/// ACME metrics (docs/reference.md#acme-metrics).
pub struct AcmeMetrics {
    /// `acme_orders_total{result="issued|failed|skipped"}`.
    pub orders: Family<ResultLabels, Counter>,
    /// `acme_challenge_requests_total{result="hit|miss|rejected"}`.
    pub challenge_requests: Family<ResultLabels, Counter>,
    /// `sbproxy_cert_expiry_seconds{host}`: seconds until notAfter.
    pub cert_expiry_seconds: CertExpiry,
    /// `sbmesh_acme_challenge_checks_total{result="answered|unreachable|wrong_answer|store"}`.
    pub challenge_checks: Family<ResultLabels, Counter>,
    /// `sbmesh_acme_orders_waiting`: certificates whose order waits for
    /// its challenge to be answered where the CA's request lands.
    pub orders_waiting: Gauge,
    /// `sbmesh_acme_orders_in_progress`: orders this node holds the lock
    /// of, from taking it to its release (`AcmeMetrics::order_in_progress`).
    pub orders_in_progress: Gauge,
    /// `acme_dns_updates_total{provider,op,result}`: TXT records written
    /// (`op="present"`) and removed (`op="cleanup"`) through the DNS-01
    /// provider, `result="ok|error"`.
    pub dns_updates: Family<DnsUpdateLabels, Counter>,
    /// `acme_dns_propagation_seconds`: from a TXT record written to every
    /// authoritative server of its zone serving it.
    pub dns_propagation_seconds: Histogram,
}

/// `{provider,op,result}` of `acme_dns_updates_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DnsUpdateLabels {
    /// `rfc2136`, `route53` or `exec`.
    pub provider: &'static str,
    /// `present` or `cleanup`.
    pub op: &'static str,
    /// `ok` or `error`.
    pub result: &'static str,
}

/// Buckets of `acme_dns_propagation_seconds`: a local primary answers in
/// milliseconds, a provider's anycast network in tens of seconds.
pub const DNS_PROPAGATION_BUCKETS: [f64; 12] = [
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// An order counted in `sbmesh_acme_orders_in_progress` until dropped.
pub(crate) struct InProgress(Gauge);

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Results of `sbmesh_acme_challenge_checks_total`, each declared at zero.
pub(crate) const CHALLENGE_CHECK_RESULTS: [&str; 4] =
    ["answered", "unreachable", "wrong_answer", "store"];

impl AcmeMetrics {
    /// Registers the ACME families in `registry`, every result at zero.
    pub(super) fn register(registry: &mut Registry) -> Self {
        let acme = AcmeMetrics {
            orders: Family::default(),
            challenge_requests: Family::default(),
            cert_expiry_seconds: CertExpiry::default(),
            challenge_checks: Family::default(),
            orders_waiting: Gauge::default(),
            orders_in_progress: Gauge::default(),
            dns_updates: Family::default(),
            dns_propagation_seconds: Histogram::new(DNS_PROPAGATION_BUCKETS),
        };
        for result in CHALLENGE_CHECK_RESULTS {
            let _ = acme
                .challenge_checks
                .get_or_create(&ResultLabels { result });
        }
        for result in ["issued", "failed", "skipped"] {
            let _ = acme.orders.get_or_create(&ResultLabels { result });
        }
        for result in ["hit", "miss", "rejected"] {
            let _ = acme
                .challenge_requests
                .get_or_create(&ResultLabels { result });
        }
        registry.register(
            "acme_orders",
            "ACME orders this node placed or passed over, by result",
            acme.orders.clone(),
        );
        registry.register(
            "acme_challenge_requests",
            "HTTP-01 challenge requests answered by this node, by result",
            acme.challenge_requests.clone(),
        );
        registry.register(
            "sbmesh_acme_challenge_checks",
            "Probe tokens fetched where the CA's HTTP-01 request lands before an order, by result",
            acme.challenge_checks.clone(),
        );
        registry.register(
            "sbmesh_acme_orders_waiting",
            "Certificates whose order waits until its challenge is answered where the CA's request lands",
            acme.orders_waiting.clone(),
        );
        registry.register(
            "sbmesh_acme_orders_in_progress",
            "ACME orders this node is placing now: their lock held, from taking it to its release",
            acme.orders_in_progress.clone(),
        );
        registry.register(
            "acme_dns_updates",
            "DNS-01 TXT records written (present) and removed (cleanup) through the provider, by result",
            acme.dns_updates.clone(),
        );
        registry.register(
            "acme_dns_propagation_seconds",
            "Seconds from a DNS-01 TXT record written to every authoritative server of its zone serving it",
            acme.dns_propagation_seconds.clone(),
        );
        registry.register(
            "sbproxy_cert_expiry_seconds",
            "Seconds until the notAfter of the certificate written for each host",
            acme.cert_expiry_seconds.clone(),
        );
        acme
    }

    /// Counts an order whose lock this node just took in
    /// `sbmesh_acme_orders_in_progress`, until the guard is dropped.
    pub(crate) fn order_in_progress(&self) -> InProgress {
        self.orders_in_progress.inc();
        InProgress(self.orders_in_progress.clone())
    }

    /// Counts one DNS-01 update through `provider`: `op` is `present` or
    /// `cleanup`.
    pub(crate) fn dns_update(&self, provider: &'static str, op: &'static str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.dns_updates
            .get_or_create(&DnsUpdateLabels {
                provider,
                op,
                result,
            })
            .inc();
    }

    /// Counts one order outcome: `issued`, `failed` or `skipped`.
    pub(crate) fn order(&self, result: &'static str) {
        self.orders.get_or_create(&ResultLabels { result }).inc();
    }

    /// Counts one challenge request: `hit`, `miss` or `rejected`.
    #[cfg(test)]
    pub(crate) fn challenge(&self, result: &'static str) {
        self.challenge_requests
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// Counts one challenge check of a name (`CHALLENGE_CHECK_RESULTS`).
    pub(crate) fn challenge_check(&self, result: &'static str) {
        self.challenge_checks
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// Sets the expiry gauge of `host` to `seconds_left` now; it counts down
    /// from there.
    pub(crate) fn set_expiry(&self, host: &str, seconds_left: i64) {
        self.cert_expiry_seconds
            .set_not_after(host, unix_now().saturating_add(seconds_left));
    }

    /// Drops the expiry gauge of a host no longer served.
    pub(crate) fn forget_host(&self, host: &str) {
        self.cert_expiry_seconds.remove(host);
    }
}

/// `sbproxy_cert_expiry_seconds{host}`: each host's notAfter, read out as the
/// seconds left at scrape time, so the gauge counts down between renewals
/// (a value set once would stand still while a renewal keeps failing, and
/// an alert on it would never fire). The family is always declared, with no
/// sample until a certificate is written.
#[derive(Clone, Debug, Default)]
pub struct CertExpiry {
    not_after_unix: Arc<RwLock<BTreeMap<String, i64>>>,
}

impl CertExpiry {
    /// Records the notAfter (unix seconds) of `host`'s certificate.
    pub(crate) fn set_not_after(&self, host: &str, not_after_unix: i64) {
        self.write().insert(host.to_owned(), not_after_unix);
    }

    /// Forgets `host`.
    pub(crate) fn remove(&self, host: &str) {
        self.write().remove(host);
    }

    /// Seconds left for each host at `now_unix`, by host.
    pub(crate) fn seconds_left_at(&self, now_unix: i64) -> Vec<(String, i64)> {
        self.read()
            .iter()
            .map(|(host, not_after)| (host.clone(), not_after.saturating_sub(now_unix)))
            .collect()
    }

    // A panic elsewhere while holding the lock leaves a map that is still
    // whole (each operation is one insert or remove): keep using it.
    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, i64>> {
        self.not_after_unix
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, i64>> {
        self.not_after_unix
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl TypedMetric for CertExpiry {
    const TYPE: MetricType = MetricType::Gauge;
}

impl EncodeMetric for CertExpiry {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (host, seconds_left) in self.seconds_left_at(unix_now()) {
            encoder
                .encode_family(&HostLabels { host })?
                .encode_gauge(&seconds_left)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use super::super::tests::assert_exposes;
    use super::*;

    #[test]
    fn exposes_acme_names() {
        let m = Metrics::new();
        m.acme.order("issued");
        m.acme.challenge("rejected");
        assert!(
            m.encode()
                .contains("# TYPE sbproxy_cert_expiry_seconds gauge\n"),
            "the expiry family is declared before any certificate"
        );
        m.acme.set_expiry("a.example.com", 3600);
        let text = m.encode();
        assert_exposes(
            &text,
            &[
                "acme_orders_total{result=\"issued\"} 1",
                "acme_orders_total{result=\"skipped\"} 0",
                "acme_challenge_requests_total{result=\"rejected\"} 1",
                "acme_challenge_requests_total{result=\"hit\"} 0",
            ],
        );
        // Seconds left when scraped: at most what was set, a moment later.
        let left = text
            .lines()
            .find_map(|l| l.strip_prefix("sbproxy_cert_expiry_seconds{host=\"a.example.com\"} "))
            .and_then(|v| v.parse::<i64>().ok());
        assert!(
            left.is_some_and(|s| (0..=3600).contains(&s) && s > 3000),
            "{text}"
        );
        m.acme.forget_host("a.example.com");
        assert!(!m.encode().contains("a.example.com"));
    }

    #[test]
    fn cert_expiry_counts_down_to_not_after() {
        let expiry = CertExpiry::default();
        expiry.set_not_after("b.example.com", 1_000_000);
        expiry.set_not_after("a.example.com", 2_000_000);
        assert_eq!(
            expiry.seconds_left_at(900_000),
            [
                ("a.example.com".to_owned(), 1_100_000),
                ("b.example.com".to_owned(), 100_000)
            ]
        );
        // Past notAfter it goes negative, as a certificate already expired.
        assert_eq!(
            expiry.seconds_left_at(1_000_060)[1],
            ("b.example.com".to_owned(), -60)
        );
        expiry.set_not_after("b.example.com", 9_000_000);
        expiry.remove("a.example.com");
        assert_eq!(
            expiry.seconds_left_at(1_000_000),
            [("b.example.com".to_owned(), 8_000_000)]
        );
    }
}
