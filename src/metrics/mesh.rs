//! The mesh's metrics: `mesh_*` (docs/reference.md#mesh-metrics).

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::ReasonLabels;

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

/// Reasons of `mesh_packets_rejected_total`: the labels of
/// [`crate::mesh::seal::Reject`].
const REJECTED_REASONS: [&str; 6] = [
    "decrypt",
    "cluster",
    "replay",
    "clock_skew",
    "decode",
    "size",
];

/// Reasons of `mesh_transport_connections_refused_total`: `source_limit`
/// (the oldest unauthenticated connection of a source IP closed to make room
/// for a new one), `limit` (the same, across all sources), `timeout` (no
/// complete first frame in time). A first frame that arrives but does not
/// open is counted in `mesh_packets_rejected_total` instead.
pub const TRANSPORT_REFUSED_REASONS: [&str; 3] = ["source_limit", "limit", "timeout"];

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

impl MeshMetrics {
    /// Registers the mesh's families in `registry`, with every fixed label
    /// set pre-created so a scrape shows it at zero.
    pub(super) fn register(registry: &mut Registry) -> Self {
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
        for reason in REJECTED_REASONS {
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
        mesh
    }

    /// Counts one rejected packet.
    pub(crate) fn rejected(&self, reason: &'static str) {
        self.packets_rejected
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Counts one inbound transport connection refused before it authenticated.
    pub(crate) fn connection_refused(&self, reason: &'static str) {
        self.connections_refused
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Counts bytes sent on a transport.
    pub(crate) fn sent(&self, transport: Transport, bytes: usize) {
        self.sent_by[transport as usize].inc_by(bytes as u64);
    }

    /// Counts bytes received on a transport.
    pub(crate) fn received(&self, transport: Transport, bytes: usize) {
        self.received_by[transport as usize].inc_by(bytes as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::super::Metrics;
    use super::super::tests::assert_exposes;
    use super::*;

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
}
