//! Who a mesh member is: the identity foca gossips about.

use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

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
///
/// Build it with [`NodeIdentity::new`]: foca's address of the member is a
/// hash of `node_id` taken there (and on decoding), so `node_id` must not
/// be changed afterwards.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "IdentityFields")]
pub struct NodeIdentity {
    /// foca's address of the member: a hash of `node_id`, never sent.
    /// foca finds a member by comparing the address of every member it
    /// holds, on every update it applies; a `u64` kept inline makes that a
    /// scan of its member list instead of a pointer chase and a refcount
    /// per member. First, so that comparing identities rejects early.
    #[serde(skip_serializing)]
    addr: u64,
    /// The member's name (`--node-id`), unique in the cluster.
    pub node_id: Arc<str>,
    /// Where the member receives gossip datagrams.
    pub gossip: SocketAddr,
    /// TCP port of the member's transport, on the gossip IP.
    pub transport_port: u16,
    /// Unix milliseconds at the member's start, advanced by [`RENEW_STEP`]
    /// at every rejoin.
    pub generation: u64,
}

/// What goes on the wire (postcard: the fields in this order), and what
/// decoding fills in before the address is computed.
#[derive(Deserialize)]
struct IdentityFields {
    node_id: Arc<str>,
    gossip: SocketAddr,
    transport_port: u16,
    generation: u64,
}

impl From<IdentityFields> for NodeIdentity {
    fn from(f: IdentityFields) -> Self {
        Self::new(f.node_id, f.gossip, f.transport_port, f.generation)
    }
}

impl NodeIdentity {
    /// The identity of the member `node_id`.
    pub fn new(
        node_id: Arc<str>,
        gossip: SocketAddr,
        transport_port: u16,
        generation: u64,
    ) -> Self {
        Self {
            addr: Self::addr_of(&node_id),
            node_id,
            gossip,
            transport_port,
            generation,
        }
    }

    /// foca's address of a member named `node_id`.
    ///
    /// Two names with the same hash would be taken for one member (the
    /// higher generation replacing the other's entry), so the hash is
    /// SipHash keyed at random once per process: names are chosen by
    /// people and pods, never to collide under a key they cannot know, and
    /// by chance two of 10,000 names share a 64-bit hash with probability
    /// about 10⁸ / 2⁶⁵ ≈ 3·10⁻¹². The address never leaves the process, so
    /// processes need not agree on it.
    pub(crate) fn addr_of(node_id: &str) -> u64 {
        static KEYS: OnceLock<RandomState> = OnceLock::new();
        KEYS.get_or_init(RandomState::new).hash_one(node_id)
    }

    /// The member's transport (TCP) address.
    pub fn transport(&self) -> SocketAddr {
        SocketAddr::new(self.gossip.ip(), self.transport_port)
    }
}

impl foca::Identity for NodeIdentity {
    type Addr = u64;

    fn renew(&self) -> Option<Self> {
        Some(Self {
            generation: self.generation.saturating_add(RENEW_STEP),
            ..self.clone()
        })
    }

    fn addr(&self) -> u64 {
        self.addr
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
        NodeIdentity::new(
            "demo-proxy-0".into(),
            "10.0.0.5:7946".parse().unwrap(),
            8946,
            generation,
        )
    }

    #[test]
    fn restarted_member_wins_over_stale_entry() {
        assert!(id(2_000).win_addr_conflict(&id(1_000)));
        assert!(!id(1_000).win_addr_conflict(&id(2_000)));
        let renewed = id(1_000).renew().unwrap();
        assert!(renewed.win_addr_conflict(&id(1_000)));
        assert_eq!(renewed.addr(), id(1_000).addr());
        assert_eq!(&*renewed.node_id, "demo-proxy-0");
    }

    #[test]
    fn the_address_follows_the_name_alone() {
        let other = NodeIdentity::new("demo-proxy-1".into(), id(1).gossip, 8946, 1);
        assert_ne!(id(1).addr(), other.addr());
        let moved = NodeIdentity::new("demo-proxy-0".into(), other.gossip, 1, 9);
        assert_eq!(id(1).addr(), moved.addr());
    }

    #[test]
    fn the_wire_encoding_is_the_four_fields_as_before() {
        // Pinned bytes: mixed-version clusters exchange these in every
        // hello and every foca packet, so the cheap address must not show.
        let bytes = postcard::to_allocvec(&id(0x0102_0304_0506)).unwrap();
        let mut want = vec![12];
        want.extend_from_slice(b"demo-proxy-0");
        want.extend_from_slice(&[0, 10, 0, 0, 5]); // SocketAddr::V4, the IP
        want.extend_from_slice(&[0x8a, 0x3e]); // port 7946, varint
        want.extend_from_slice(&[0xf2, 0x45]); // transport port 8946, varint
        want.extend_from_slice(&[0x86, 0x8a, 0x90, 0x98, 0xa0, 0x20]); // generation, varint
        assert_eq!(bytes, want);
        let back: NodeIdentity = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, id(0x0102_0304_0506));
        assert_eq!(back.addr(), id(0).addr());
    }
}
