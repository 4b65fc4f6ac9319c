//! The one metrics registry of a process, with the metric names of
//! docs/reference.md#metrics. Every component takes an `Arc<Metrics>` and records into it;
//! `/metrics` encodes the registry in the exposition the scraper asks for
//! ([`Exposition::from_accept`]): OpenMetrics 1.0.0, or the Prometheus text
//! format 0.0.4.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

/// Membership state of a peer, as a label value.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum PeerState {
    /// Answering probes.
    alive,
    /// Failed a probe; not yet declared down.
    suspect,
    /// Declared down (or left).
    down,
}

/// `{state="alive|suspect|down"}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    /// The membership state.
    pub state: PeerState,
}

/// `{reason="decrypt|cluster|replay|clock_skew|decode|size"}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Why the packet was dropped.
    pub reason: &'static str,
}

/// Transport of a byte count, as a label value.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Transport {
    /// Gossip datagrams.
    udp,
    /// Stream frames.
    tcp,
}

/// `{transport="udp|tcp"}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransportLabels {
    /// The transport.
    pub transport: Transport,
}

/// Mesh metrics (docs/reference.md#mesh-metrics).
pub struct MeshMetrics {
    /// `mesh_peer_count{state}`: peers by state, self excluded.
    pub peer_count: Family<StateLabels, Gauge>,
    /// `mesh_member_state_changes_total{state}`.
    pub state_changes: Family<StateLabels, Counter>,
    /// `mesh_packets_rejected_total{reason}`.
    pub packets_rejected: Family<ReasonLabels, Counter>,
    /// `mesh_bytes_sent_total{transport}`.
    pub bytes_sent: Family<TransportLabels, Counter>,
    /// `mesh_bytes_received_total{transport}`.
    pub bytes_received: Family<TransportLabels, Counter>,
    /// `mesh_transport_connections_refused_total{reason}`: inbound
    /// transport connections closed before their first frame opened, by
    /// [`TRANSPORT_REFUSED_REASONS`].
    pub connections_refused: Family<ReasonLabels, Counter>,
    /// The counters of `bytes_sent` and `bytes_received` by [`Transport`]
    /// (udp, tcp), looked up once: counting a datagram is an atomic add,
    /// not a hash of its labels under the family's lock.
    sent_by: [Counter; 2],
    received_by: [Counter; 2],
}

/// Reasons of `mesh_transport_connections_refused_total`: `source_limit`
/// (the oldest unauthenticated connection of a source IP closed to make room
/// for a new one), `limit` (the same, across all sources), `timeout` (no
/// complete first frame in time). A first frame that arrives but does not
/// open is counted in `mesh_packets_rejected_total` instead.
pub const TRANSPORT_REFUSED_REASONS: [&str; 3] = ["source_limit", "limit", "timeout"];

/// `{listener="admin|challenge",reason="limit|header_timeout"}` of
/// `sbmesh_http_connections_closed_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    /// `admin` or `challenge`.
    pub listener: &'static str,
    /// `limit`: an idle connection closed (or a new one refused) at the
    /// connection limit; `header_timeout`: no complete request head in time.
    pub reason: &'static str,
}

/// Metrics of the admin and challenge HTTP listeners.
pub struct HttpMetrics {
    /// `sbmesh_http_connections_closed_total{listener,reason}`.
    pub connections_closed: Family<ListenerLabels, Counter>,
    /// `sbmesh_challenge_passthrough_total{result}`: requests the challenge
    /// listener handed to the proxy, by [`PASSTHROUGH_RESULTS`].
    pub challenge_passthrough: Family<ResultLabels, Counter>,
}

/// Results of `sbmesh_challenge_passthrough_total`, in this order: `ok`
/// (the proxy answered, whatever its status), `error` (it did not: the
/// client got `502`), `too_large` (the request body was over the limit:
/// `413`, see [`crate::http::passthrough`]).
pub const PASSTHROUGH_RESULTS: [&str; 3] = ["ok", "error", "too_large"];

impl MeshMetrics {
    /// Counts one rejected packet.
    pub fn rejected(&self, reason: &'static str) {
        self.packets_rejected
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Counts one inbound transport connection refused before it authenticated.
    pub fn connection_refused(&self, reason: &'static str) {
        self.connections_refused
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Counts bytes sent on a transport.
    pub fn sent(&self, transport: Transport, bytes: usize) {
        self.sent_by[transport as usize].inc_by(bytes as u64);
    }

    /// Counts bytes received on a transport.
    pub fn received(&self, transport: Transport, bytes: usize) {
        self.received_by[transport as usize].inc_by(bytes as u64);
    }
}

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

/// `{backend,op}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendOpLabels {
    /// Backend name (`Store::backend`).
    pub backend: &'static str,
    /// Operation, as in [`StoreOpLabels::op`].
    pub op: &'static str,
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
    /// Counts one store operation.
    pub fn operation(&self, backend: &'static str, op: &'static str, result: &'static str) {
        self.operations
            .get_or_create(&StoreOpLabels {
                backend,
                op,
                result,
            })
            .inc();
    }

    /// Records how long one store operation took.
    pub fn observe(&self, backend: &'static str, op: &'static str, took: std::time::Duration) {
        self.operation_seconds
            .get_or_create(&BackendOpLabels { backend, op })
            .observe(took.as_secs_f64());
    }

    /// Counts one lease lock acquisition.
    pub fn lock_acquired(&self, backend: &'static str) {
        self.lock_acquired
            .get_or_create(&BackendLabels { backend })
            .inc();
    }

    /// Counts one record that could not be opened.
    pub fn unseal_failed(&self, reason: &'static str) {
        self.unseal_failures
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }
}

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
    pub const WATCH_TLS_REASONS: [&'static str; 4] =
        ["incomplete", "too_large", "unparsable", "mismatch"];

    /// Counts one proxy restart for a new certificate.
    pub fn restarted_for_certificate(&self) {
        self.restarts
            .get_or_create(&ReasonLabels {
                reason: "certificate",
            })
            .inc();
    }

    /// Counts one rejected `--watch-tls` pair.
    pub fn watch_tls_rejected(&self, reason: &'static str) {
        self.watch_tls_rejected
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }
}

/// `{result=...}`
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// The outcome.
    pub result: &'static str,
}

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
    pub fn set_not_after(&self, host: &str, not_after_unix: i64) {
        self.write().insert(host.to_owned(), not_after_unix);
    }

    /// Forgets `host`.
    pub fn remove(&self, host: &str) {
        self.write().remove(host);
    }

    /// Seconds left for each host at `now_unix`, by host.
    pub fn seconds_left_at(&self, now_unix: i64) -> Vec<(String, i64)> {
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

impl AcmeMetrics {
    /// Counts one order outcome: `issued`, `failed` or `skipped`.
    pub fn order(&self, result: &'static str) {
        self.orders.get_or_create(&ResultLabels { result }).inc();
    }

    /// Counts one challenge request: `hit`, `miss` or `rejected`.
    pub fn challenge(&self, result: &'static str) {
        self.challenge_requests
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// Sets the expiry gauge of `host` to `seconds_left` now; it counts down
    /// from there.
    pub fn set_expiry(&self, host: &str, seconds_left: i64) {
        self.cert_expiry_seconds
            .set_not_after(host, unix_now().saturating_add(seconds_left));
    }

    /// Drops the expiry gauge of a host no longer served.
    pub fn forget_host(&self, host: &str) {
        self.cert_expiry_seconds.remove(host);
    }
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
        let (bytes_sent, bytes_received) = (Family::default(), Family::default());
        // Pre-created, in `Transport`'s order: a scrape shows them at zero.
        let by_transport = |family: &Family<TransportLabels, Counter>| {
            [Transport::udp, Transport::tcp]
                .map(|transport| family.get_or_create(&TransportLabels { transport }).clone())
        };
        let mesh = MeshMetrics {
            peer_count: Family::default(),
            state_changes: Family::default(),
            packets_rejected: Family::default(),
            sent_by: by_transport(&bytes_sent),
            received_by: by_transport(&bytes_received),
            bytes_sent,
            bytes_received,
            connections_refused: Family::default(),
        };
        for state in [PeerState::alive, PeerState::suspect, PeerState::down] {
            let _ = mesh.peer_count.get_or_create(&StateLabels { state });
            let _ = mesh.state_changes.get_or_create(&StateLabels { state });
        }
        for reason in [
            "decrypt",
            "cluster",
            "replay",
            "clock_skew",
            "decode",
            "size",
        ] {
            let _ = mesh
                .packets_rejected
                .get_or_create(&ReasonLabels { reason });
        }
        registry.register(
            "mesh_peer_count",
            "Peers known to this node by membership state, self excluded",
            mesh.peer_count.clone(),
        );
        registry.register(
            "mesh_member_state_changes",
            "Membership state changes observed, by new state",
            mesh.state_changes.clone(),
        );
        registry.register(
            "mesh_packets_rejected",
            "Mesh packets dropped, by reason",
            mesh.packets_rejected.clone(),
        );
        registry.register(
            "mesh_bytes_sent",
            "Sealed mesh bytes sent, by transport",
            mesh.bytes_sent.clone(),
        );
        registry.register(
            "mesh_bytes_received",
            "Sealed mesh bytes received, by transport",
            mesh.bytes_received.clone(),
        );
        for reason in TRANSPORT_REFUSED_REASONS {
            let _ = mesh
                .connections_refused
                .get_or_create(&ReasonLabels { reason });
        }
        registry.register(
            "mesh_transport_connections_refused",
            "Inbound transport connections closed before their first frame authenticated, by reason",
            mesh.connections_refused.clone(),
        );
        let http = HttpMetrics {
            connections_closed: Family::default(),
            challenge_passthrough: Family::default(),
        };
        for listener in ["admin", "challenge"] {
            for reason in ["limit", "header_timeout"] {
                let _ = http
                    .connections_closed
                    .get_or_create(&ListenerLabels { listener, reason });
            }
        }
        registry.register(
            "sbmesh_http_connections_closed",
            "Admin and challenge connections closed by the listener's limits, by listener and reason",
            http.connections_closed.clone(),
        );
        for result in PASSTHROUGH_RESULTS {
            let _ = http
                .challenge_passthrough
                .get_or_create(&ResultLabels { result });
        }
        registry.register(
            "sbmesh_challenge_passthrough",
            "Requests the challenge listener passed to the proxy (--challenge-passthrough), by result",
            http.challenge_passthrough.clone(),
        );
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
        let acme = AcmeMetrics {
            orders: Family::default(),
            challenge_requests: Family::default(),
            cert_expiry_seconds: CertExpiry::default(),
        };
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
            "sbproxy_cert_expiry_seconds",
            "Seconds until the notAfter of the certificate written for each host",
            acme.cert_expiry_seconds.clone(),
        );
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
    pub fn encode_as(&self, format: Exposition) -> String {
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
/// text format 0.0.4 names it with `_total` and has no end marker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exposition {
    /// OpenMetrics 1.0.0 text.
    OpenMetrics,
    /// Prometheus text format 0.0.4.
    PrometheusText,
}

impl Exposition {
    /// The format to answer a request with this `Accept` header (several
    /// header lines joined with `,`): OpenMetrics when the client lists
    /// `application/openmetrics-text` with a q-value above zero and at least
    /// that of anything text 0.0.4 would satisfy (`text/plain`, `text/*`,
    /// `*/*`); the text format otherwise, including no header, `*/*` alone
    /// and a header that cannot be read.
    ///
    /// Prometheus lists OpenMetrics first with the highest q by default
    /// (`scrape_protocols`), so it gets OpenMetrics; curl and browsers get
    /// the text format.
    pub fn from_accept(accept: Option<&str>) -> Self {
        let Some(accept) = accept else {
            return Exposition::PrometheusText;
        };
        let mut openmetrics = 0.0_f32;
        let mut text = 0.0_f32;
        for range in accept.split(',') {
            let Some(range) = MediaRange::parse(range) else {
                continue;
            };
            let (kind, sub) = (range.kind.as_str(), range.subtype.as_str());
            if (kind, sub) == ("application", "openmetrics-text") {
                openmetrics = openmetrics.max(range.q);
            } else if (kind, sub) == ("text", "plain")
                || (kind == "text" || kind == "*") && sub == "*"
            {
                text = text.max(range.q);
            }
        }
        if openmetrics > 0.0 && openmetrics >= text {
            Exposition::OpenMetrics
        } else {
            Exposition::PrometheusText
        }
    }

    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Exposition::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Exposition::PrometheusText => {
                prometheus_client::encoding::prometheus_text::CONTENT_TYPE
            }
        }
    }
}

/// One element of an `Accept` header: `type/subtype;param=value;q=0.5`,
/// type and subtype lowercased, `q` in 0..=1 (1 when absent).
struct MediaRange {
    kind: String,
    subtype: String,
    q: f32,
}

impl MediaRange {
    /// `None` for an element that is not `type/subtype`; a q-value that is
    /// not a number makes the range unacceptable (q = 0).
    fn parse(element: &str) -> Option<Self> {
        let mut parts = element.split(';');
        let (kind, subtype) = parts.next()?.trim().split_once('/')?;
        let (kind, subtype) = (kind.trim(), subtype.trim());
        if kind.is_empty() || subtype.is_empty() {
            return None;
        }
        let mut q = 1.0;
        for param in parts {
            if let Some((name, value)) = param.split_once('=')
                && name.trim().eq_ignore_ascii_case("q")
            {
                q = value
                    .trim()
                    .parse::<f32>()
                    .ok()
                    .filter(|q| q.is_finite())
                    .map_or(0.0, |q| q.clamp(0.0, 1.0));
            }
        }
        Some(MediaRange {
            kind: kind.to_ascii_lowercase(),
            subtype: subtype.to_ascii_lowercase(),
            q,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every one of `lines` is in the exposition `text`.
    fn assert_exposes(text: &str, lines: &[&str]) {
        for line in lines {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn exposes_spec_names_at_zero() {
        let m = Metrics::new();
        m.mesh.rejected("replay");
        let text = m.encode();
        assert_exposes(
            &text,
            &[
                "mesh_peer_count{state=\"alive\"} 0",
                "mesh_member_state_changes_total{state=\"down\"} 0",
                "mesh_packets_rejected_total{reason=\"replay\"} 1",
                "mesh_packets_rejected_total{reason=\"clock_skew\"} 0",
                "mesh_bytes_sent_total{transport=\"udp\"} 0",
                "mesh_bytes_received_total{transport=\"tcp\"} 0",
            ],
        );
    }

    #[test]
    fn bytes_are_counted_under_their_own_transport() {
        let m = Metrics::new();
        m.mesh.sent(Transport::udp, 5);
        m.mesh.sent(Transport::udp, 2);
        m.mesh.sent(Transport::tcp, 11);
        m.mesh.received(Transport::tcp, 13);
        let text = m.encode();
        assert_exposes(
            &text,
            &[
                "mesh_bytes_sent_total{transport=\"udp\"} 7",
                "mesh_bytes_sent_total{transport=\"tcp\"} 11",
                "mesh_bytes_received_total{transport=\"udp\"} 0",
                "mesh_bytes_received_total{transport=\"tcp\"} 13",
            ],
        );
    }

    #[test]
    fn exposes_listener_limit_names_at_zero() {
        let m = Metrics::new();
        m.mesh.connection_refused("timeout");
        let text = m.encode();
        assert_exposes(
            &text,
            &[
                "mesh_transport_connections_refused_total{reason=\"timeout\"} 1",
                "mesh_transport_connections_refused_total{reason=\"source_limit\"} 0",
                "sbmesh_http_connections_closed_total{listener=\"admin\",reason=\"header_timeout\"} 0",
                "sbmesh_http_connections_closed_total{listener=\"challenge\",reason=\"limit\"} 0",
                "sbmesh_challenge_passthrough_total{result=\"ok\"} 0",
                "sbmesh_challenge_passthrough_total{result=\"error\"} 0",
                "sbmesh_challenge_passthrough_total{result=\"too_large\"} 0",
            ],
        );
    }

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

    /// Prometheus' own `Accept` (default `scrape_protocols`, 2.49 and later).
    const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0;q=0.5,\
        application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2";

    #[test]
    fn accept_chooses_openmetrics_only_when_asked_for_first() {
        use Exposition::{OpenMetrics, PrometheusText};
        for (accept, want) in [
            (None, PrometheusText),
            (Some(""), PrometheusText),
            (Some("*/*"), PrometheusText),
            (Some("text/plain"), PrometheusText),
            (Some("text/plain;version=0.0.4"), PrometheusText),
            (
                Some("text/html,application/xhtml+xml,*/*;q=0.8"),
                PrometheusText,
            ),
            (Some(PROMETHEUS_ACCEPT), OpenMetrics),
            // Prometheus 2.0 to 2.48.
            (
                Some(
                    "application/openmetrics-text; version=0.0.1,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                OpenMetrics,
            ),
            (Some("application/openmetrics-text"), OpenMetrics),
            (
                Some("Application/OpenMetrics-Text; Version=1.0.0"),
                OpenMetrics,
            ),
            (
                Some("application/openmetrics-text;version=1.0.0;charset=utf-8"),
                OpenMetrics,
            ),
            // Prometheus with `scrape_protocols: [PrometheusText0.0.4, ...]`.
            (
                Some(
                    "text/plain;version=0.0.4;q=0.5,application/openmetrics-text;version=1.0.0;q=0.4,*/*;q=0.3",
                ),
                PrometheusText,
            ),
            // The highest q wins wherever it is listed; a tie goes to the
            // format named explicitly.
            (
                Some("text/plain;q=0.2, application/openmetrics-text;q=0.9"),
                OpenMetrics,
            ),
            (
                Some("application/openmetrics-text;q=0.3, text/*;q=0.4"),
                PrometheusText,
            ),
            (
                Some("application/openmetrics-text;q=0.5, */*;q=0.5"),
                OpenMetrics,
            ),
            (
                Some("application/openmetrics-text ; q = 0.7 , */* ; q=0.6"),
                OpenMetrics,
            ),
            // q=0 means "not acceptable"; a malformed q too.
            (Some("application/openmetrics-text;q=0"), PrometheusText),
            (Some("application/openmetrics-text;q=high"), PrometheusText),
            (Some("application/openmetrics-text;q=NaN"), PrometheusText),
            // Ranges that match neither, and garbage, are ignored.
            (Some("application/json"), PrometheusText),
            (Some("application/*"), PrometheusText),
            (Some(",,;;/,application/openmetrics-text"), OpenMetrics),
            (Some("openmetrics"), PrometheusText),
        ] {
            assert_eq!(Exposition::from_accept(accept), want, "Accept: {accept:?}");
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

    /// The lines that carry values, in order.
    fn samples(text: &str) -> Vec<&str> {
        text.lines().filter(|l| !l.starts_with('#')).collect()
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
        // Every sample belongs to the family its TYPE line declares.
        let mut family = "";
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap_or_default();
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap_or_default();
                assert_eq!(name, family, "sample {line:?} outside its family");
            }
        }
    }

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
