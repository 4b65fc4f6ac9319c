//! Who a mesh member is: the identity foca gossips about.

use std::hash::{BuildHasher, RandomState};
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};

use crate::mesh::intern::{Interner, NAMES};

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
/// Build it with `NodeIdentity::new`: foca's address of the member is a
/// hash of `node_id` taken there (and on decoding). The name and addresses
/// are read through `Place` (`id.node_id`, `id.gossip`,
/// `id.transport_port`).
///
/// 24 bytes: foca keeps a `Vec` of these, one per member, and scans it for
/// every update it applies, so each node holds N of them and the simulator
/// N². The place behind the pointer is interned: every identity of a member
/// in the process shares one.
#[derive(Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(from = "IdentityFields<Arc<str>>")]
pub struct NodeIdentity {
    /// foca's address of the member: a hash of `node_id`, never sent.
    /// foca finds a member by comparing the address of every member it
    /// holds, on every update it applies; a `u64` kept inline makes that a
    /// scan of its member list instead of a pointer chase per member.
    /// First, so that comparing identities rejects early.
    addr: u64,
    /// Unix milliseconds at the member's start, advanced by `RENEW_STEP`
    /// at every rejoin.
    pub generation: u64,
    place: Arc<Place>,
}

/// Who a member is and where it listens: the part of its identity that
/// stays the same across its rejoins, shared by all copies of it.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct Place {
    /// The member's name (`--node-id`), unique in the cluster.
    pub node_id: Arc<str>,
    /// Where the member receives gossip datagrams.
    pub gossip: SocketAddr,
    /// TCP port of the member's transport, on the gossip IP.
    pub transport_port: u16,
}

static PLACES: Interner<Place> = Interner::new();

/// An identity reads as its place: `id.node_id`, `id.gossip`.
impl Deref for NodeIdentity {
    type Target = Place;

    fn deref(&self) -> &Place {
        &self.place
    }
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("node_id", &self.node_id)
            .field("gossip", &self.gossip)
            .field("transport_port", &self.transport_port)
            .field("generation", &self.generation)
            .finish()
    }
}

/// What goes on the wire (postcard: the fields in this order), and what
/// decoding fills in before the address is computed.
#[derive(Serialize, Deserialize)]
#[serde(rename = "NodeIdentity")]
struct IdentityFields<N> {
    node_id: N,
    gossip: SocketAddr,
    transport_port: u16,
    generation: u64,
}

impl From<IdentityFields<Arc<str>>> for NodeIdentity {
    fn from(f: IdentityFields<Arc<str>>) -> Self {
        Self::new(f.node_id, f.gossip, f.transport_port, f.generation)
    }
}

impl Serialize for NodeIdentity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        IdentityFields {
            node_id: &*self.node_id,
            gossip: self.gossip,
            transport_port: self.transport_port,
            generation: self.generation,
        }
        .serialize(s)
    }
}

impl NodeIdentity {
    /// The identity of the member `node_id`.
    pub(crate) fn new(
        node_id: Arc<str>,
        gossip: SocketAddr,
        transport_port: u16,
        generation: u64,
    ) -> Self {
        // A place already held carries the interned name; only a new one
        // needs it interned (every datagram decodes identities).
        let place = PLACES.get_or_insert(
            Place {
                node_id,
                gossip,
                transport_port,
            },
            |p| {
                Arc::new(Place {
                    node_id: NAMES.intern(p.node_id),
                    ..p
                })
            },
        );
        Self {
            addr: Self::addr_of(&place.node_id),
            generation,
            place,
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
    pub(crate) fn transport(&self) -> SocketAddr {
        SocketAddr::new(self.gossip.ip(), self.transport_port)
    }
}

/// Hashes a map keyed by foca's address of a member (or another hash of
/// its name) by the key itself: it is a hash already.
#[derive(Default)]
pub(crate) struct AddrHasher(u64);

impl std::hash::Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is expected; anything else still hashes.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, addr: u64) {
        self.0 = addr;
    }
}

/// A map by foca's address of a member, or another hash of its name.
pub(crate) type ByAddr<V> =
    std::collections::HashMap<u64, V, std::hash::BuildHasherDefault<AddrHasher>>;

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

    #[test]
    fn an_identity_is_small_and_its_copies_share_the_place() {
        // foca's member list holds one of these per member.
        assert_eq!(std::mem::size_of::<foca::Member<NodeIdentity>>(), 32);
        let decoded: NodeIdentity =
            postcard::from_bytes(&postcard::to_allocvec(&id(7)).unwrap()).unwrap();
        assert!(Arc::ptr_eq(&decoded.place, &id(8).place));
        assert!(Arc::ptr_eq(&decoded.node_id, &id(9).node_id));
        let moved = NodeIdentity::new(
            "demo-proxy-0".into(),
            "10.0.0.6:7946".parse().unwrap(),
            8946,
            7,
        );
        assert_ne!(moved, decoded);
        assert_eq!(moved.addr(), decoded.addr());
    }
}
