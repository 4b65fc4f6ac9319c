//! Who a mesh member is: the identity foca gossips about.

use std::net::SocketAddr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Generations advance by this much when a member renews its identity after
/// being declared down, so `generation + foca incarnation` (what status
/// reports as `incarnation`) keeps growing: foca's own incarnation is a u16.
pub const RENEW_STEP: u64 = 1 << 16;

/// A member's identity on the wire.
///
/// Two identities with the same `node_id` are the same member at different
/// times: the higher `generation` wins (a restarted pod rejoins under its
/// name and replaces its stale entry, whatever its new IP).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NodeIdentity {
    /// The member's name (`--node-id`), unique in the cluster. Shared:
    /// foca compares members by name on every update it applies, scanning
    /// its whole member list, so taking the name must not allocate.
    pub node_id: Arc<str>,
    /// Where the member receives gossip datagrams.
    pub gossip: SocketAddr,
    /// TCP port of the member's transport, on the gossip IP.
    pub transport_port: u16,
    /// Unix milliseconds at the member's start, advanced by [`RENEW_STEP`]
    /// at every rejoin.
    pub generation: u64,
}

impl NodeIdentity {
    /// The member's transport (TCP) address.
    pub fn transport(&self) -> SocketAddr {
        SocketAddr::new(self.gossip.ip(), self.transport_port)
    }
}

impl foca::Identity for NodeIdentity {
    type Addr = Arc<str>;

    fn renew(&self) -> Option<Self> {
        Some(Self {
            generation: self.generation.saturating_add(RENEW_STEP),
            ..self.clone()
        })
    }

    fn addr(&self) -> Arc<str> {
        self.node_id.clone()
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.generation > adversary.generation
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use foca::Identity;

    fn id(generation: u64) -> NodeIdentity {
        NodeIdentity {
            node_id: "demo-proxy-0".into(),
            gossip: "10.0.0.5:7946".parse().unwrap(),
            transport_port: 8946,
            generation,
        }
    }

    #[test]
    fn restarted_member_wins_over_stale_entry() {
        assert!(id(2_000).win_addr_conflict(&id(1_000)));
        assert!(!id(1_000).win_addr_conflict(&id(2_000)));
        let renewed = id(1_000).renew().unwrap();
        assert!(renewed.win_addr_conflict(&id(1_000)));
        assert_eq!(&*renewed.addr(), "demo-proxy-0");
    }
}
