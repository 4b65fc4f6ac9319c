//! The one metrics registry of a process, with the metric names of SPEC
//! section 8. Every component takes an `Arc<Metrics>` and records into it;
//! `/metrics` encodes the registry in the Prometheus text format.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

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

/// Mesh metrics (SPEC section 8).
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
}

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
        self.bytes_sent
            .get_or_create(&TransportLabels { transport })
            .inc_by(bytes as u64);
    }

    /// Counts bytes received on a transport.
    pub fn received(&self, transport: Transport, bytes: usize) {
        self.bytes_received
            .get_or_create(&TransportLabels { transport })
            .inc_by(bytes as u64);
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

/// Certificate store metrics (SPEC section 8).
pub struct StoreMetrics {
    /// `store_operations_total{backend,op,result}`.
    pub operations: Family<StoreOpLabels, Counter>,
    /// `store_lock_acquired_total{backend}`.
    pub lock_acquired: Family<BackendLabels, Counter>,
    /// `store_unseal_failures_total{reason}`: records read but not opened
    /// (`missing_key`: sealed under a key no longer in the ring).
    pub unseal_failures: Family<ReasonLabels, Counter>,
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

/// Config reloader metrics (SPEC section 8).
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
    /// `sbmesh_proxy_restarts_total{reason="certificate"}` (SPEC section 8).
    pub restarts: Family<ReasonLabels, Counter>,
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

/// ACME metrics (SPEC section 8).
pub struct AcmeMetrics {
    /// `acme_orders_total{result="issued|failed|skipped"}`.
    pub orders: Family<ResultLabels, Counter>,
    /// `acme_challenge_requests_total{result="hit|miss|rejected"}`.
    pub challenge_requests: Family<ResultLabels, Counter>,
    /// `sbproxy_cert_expiry_seconds{host}`: seconds until notAfter.
    pub cert_expiry_seconds: Family<HostLabels, Gauge>,
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

    /// Sets the expiry gauge of `host`.
    pub fn set_expiry(&self, host: &str, seconds_left: i64) {
        self.cert_expiry_seconds
            .get_or_create(&HostLabels {
                host: host.to_owned(),
            })
            .set(seconds_left);
    }

    /// Drops the expiry gauge of a host no longer served.
    pub fn forget_host(&self, host: &str) {
        self.cert_expiry_seconds.remove(&HostLabels {
            host: host.to_owned(),
        });
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered (and the label sets that are
    /// fixed by the SPEC pre-created, so a scrape shows them at zero).
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let mesh = MeshMetrics {
            peer_count: Family::default(),
            state_changes: Family::default(),
            packets_rejected: Family::default(),
            bytes_sent: Family::default(),
            bytes_received: Family::default(),
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
        for transport in [Transport::udp, Transport::tcp] {
            let _ = mesh
                .bytes_sent
                .get_or_create(&TransportLabels { transport });
            let _ = mesh
                .bytes_received
                .get_or_create(&TransportLabels { transport });
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
        let store = StoreMetrics {
            operations: Family::default(),
            lock_acquired: Family::default(),
            unseal_failures: Family::default(),
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
            cert_expiry_seconds: Family::default(),
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

    /// The Prometheus/OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(4096);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_spec_names_at_zero() {
        let m = Metrics::new();
        m.mesh.rejected("replay");
        let text = m.encode();
        for name in [
            "mesh_peer_count{state=\"alive\"} 0",
            "mesh_member_state_changes_total{state=\"down\"} 0",
            "mesh_packets_rejected_total{reason=\"replay\"} 1",
            "mesh_packets_rejected_total{reason=\"clock_skew\"} 0",
            "mesh_bytes_sent_total{transport=\"udp\"} 0",
            "mesh_bytes_received_total{transport=\"tcp\"} 0",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }

    #[test]
    fn exposes_listener_limit_names_at_zero() {
        let m = Metrics::new();
        m.mesh.connection_refused("timeout");
        let text = m.encode();
        for name in [
            "mesh_transport_connections_refused_total{reason=\"timeout\"} 1",
            "mesh_transport_connections_refused_total{reason=\"source_limit\"} 0",
            "sbmesh_http_connections_closed_total{listener=\"admin\",reason=\"header_timeout\"} 0",
            "sbmesh_http_connections_closed_total{listener=\"challenge\",reason=\"limit\"} 0",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }

    #[test]
    fn exposes_reloader_names() {
        let m = Metrics::new();
        m.reloader.config_invalid.inc();
        let text = m.encode();
        for name in [
            "reloader_reloads_total 0",
            "reloader_reloads_failed_total 0",
            "reloader_last_reload_successful 0",
            "reloader_last_reload_success_timestamp_seconds 0",
            "reloader_config_invalid_total 1",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }

    #[test]
    fn exposes_acme_names() {
        let m = Metrics::new();
        m.acme.order("issued");
        m.acme.challenge("rejected");
        m.acme.set_expiry("a.example.com", 3600);
        let text = m.encode();
        for name in [
            "acme_orders_total{result=\"issued\"} 1",
            "acme_orders_total{result=\"skipped\"} 0",
            "acme_challenge_requests_total{result=\"rejected\"} 1",
            "acme_challenge_requests_total{result=\"hit\"} 0",
            "sbproxy_cert_expiry_seconds{host=\"a.example.com\"} 3600",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        m.acme.forget_host("a.example.com");
        assert!(!m.encode().contains("a.example.com"));
    }

    #[test]
    fn exposes_proxy_names() {
        let m = Metrics::new();
        m.proxy.watch_tls_rejected("mismatch");
        let text = m.encode();
        for name in [
            "sbmesh_proxy_restarts_total{reason=\"certificate\"} 0",
            "sbmesh_watch_tls_rejected_total{reason=\"mismatch\"} 1",
            "sbmesh_watch_tls_rejected_total{reason=\"incomplete\"} 0",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        m.proxy.restarted_for_certificate();
        assert!(
            m.encode()
                .contains("sbmesh_proxy_restarts_total{reason=\"certificate\"} 1")
        );
    }

    #[test]
    fn exposes_store_names() {
        let m = Metrics::new();
        m.store.operation("redis", "get", "miss");
        m.store.lock_acquired("redis");
        m.store.unseal_failed("missing_key");
        let text = m.encode();
        for name in [
            "store_operations_total{backend=\"redis\",op=\"get\",result=\"miss\"} 1",
            "store_lock_acquired_total{backend=\"redis\"} 1",
            "store_unseal_failures_total{reason=\"missing_key\"} 1",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
    }
}
