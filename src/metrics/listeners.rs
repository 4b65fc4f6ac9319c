//! The admin and challenge listeners' metrics: `sbmesh_http_*` and
//! `sbmesh_challenge_passthrough_total`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::ResultLabels;

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
/// `413`, see [`Passthrough`](crate::Passthrough)).
pub const PASSTHROUGH_RESULTS: [&str; 3] = ["ok", "error", "too_large"];

impl HttpMetrics {
    /// Registers the listeners' families in `registry`, every fixed label
    /// set at zero.
    pub(super) fn register(registry: &mut Registry) -> Self {
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
        http
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use super::super::tests::assert_exposes;

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
}
