//! Which ring key to seal a packet for a given peer with, so that a key
//! rotation rolled out one pod at a time (the kubelet updates a mounted
//! Secret pod by pod, up to a minute apart) drops no packet:
//! `[old]` → `[new, old]` → `[new]`, file by file.
//!
//! Sealing with our primary as soon as our file says `[new, old]` would cut
//! us off from every peer still on `[old]`; answering each peer in the key
//! it last used (all that was done before) keeps everyone on `old` until
//! the old key is dropped, and the pod that drops it first then misses the
//! packets its peers still seal under `old`. So each node publishes the ids
//! of the keys it opens ([`crate::mesh::meta::NodeMeta::key_ring`]), and a
//! packet for a peer is sealed:
//!
//! 1. with our primary, when the peer's published ring holds it;
//! 2. else with the key the peer last sealed to us with (a peer from before
//!    rings were published, or whose record has not arrived yet);
//! 3. else with our primary (first contact).
//!
//! The rotation's order makes (1) safe: a ring only grows during `[new,
//! old]`, and `old` goes only after every node published `new`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

/// Peers at most remembered per map before it is emptied (a cluster is
/// at most 128 pods; addresses of pods gone accumulate slowly).
const MAX_PEERS: usize = 4096;

/// What the shell knows of each peer's keys.
#[derive(Debug, Default)]
pub(crate) struct PeerKeys {
    /// The ring key each peer (by gossip address) last sealed to us with.
    last_used: HashMap<SocketAddr, u32>,
    /// The node id at each gossip address (member up, identity renewed).
    node_at: HashMap<SocketAddr, Arc<str>>,
    /// The ring each node published.
    rings: HashMap<Arc<str>, Vec<u32>>,
}

impl PeerKeys {
    /// A packet from `from` opened with `key_id`.
    pub(crate) fn heard(&mut self, from: SocketAddr, key_id: u32) {
        bound(&mut self.last_used);
        self.last_used.insert(from, key_id);
    }

    /// `node_id` is the member at `gossip`.
    pub(crate) fn member(&mut self, gossip: SocketAddr, node_id: &Arc<str>) {
        bound(&mut self.node_at);
        self.node_at.insert(gossip, node_id.clone());
    }

    /// `node_id` published the ring `ids` (empty: it publishes none).
    pub(crate) fn ring(&mut self, node_id: Arc<str>, ids: Vec<u32>) {
        if ids.is_empty() {
            self.rings.remove(&node_id);
            return;
        }
        bound(&mut self.rings);
        self.rings.insert(node_id, ids);
    }

    /// The key to seal with for the peer at `gossip`, given our primary:
    /// `None` means our primary (see the module docs for the order).
    pub(crate) fn key_for(&self, gossip: SocketAddr, primary: u32) -> Option<u32> {
        let published = self
            .node_at
            .get(&gossip)
            .and_then(|node| self.rings.get(node));
        if published.is_some_and(|ids| ids.contains(&primary)) {
            return None;
        }
        self.last_used.get(&gossip).copied()
    }
}

fn bound<K, V>(map: &mut HashMap<K, V>) {
    if map.len() >= MAX_PEERS {
        map.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: u32 = 0x0bad;
    const NEW: u32 = 0x0a11;

    fn addr(i: u8) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, i], 7946))
    }

    /// Node `i` at `addr(i)`, named `n<i>`.
    fn known(k: &mut PeerKeys, i: u8) -> Arc<str> {
        let name: Arc<str> = format!("n{i}").into();
        k.member(addr(i), &name);
        name
    }

    #[test]
    fn a_rotation_pod_by_pod_seals_each_packet_in_a_key_its_peer_opens() {
        // We are on [new, old]; peer 1 still on [old], peer 2 on [new, old].
        let mut k = PeerKeys::default();
        let (n1, n2) = (known(&mut k, 1), known(&mut k, 2));
        k.ring(n1.clone(), vec![OLD]);
        k.ring(n2.clone(), vec![NEW, OLD]);
        k.heard(addr(1), OLD);
        k.heard(addr(2), OLD);
        assert_eq!(k.key_for(addr(1), NEW), Some(OLD), "peer 1 cannot open new");
        assert_eq!(k.key_for(addr(2), NEW), None, "peer 2 opens our primary");
        // Peer 1's file catches up: its record says so before it seals with new.
        k.ring(n1.clone(), vec![NEW, OLD]);
        assert_eq!(k.key_for(addr(1), NEW), None);
        // The old key goes everywhere: still the primary for both.
        k.ring(n1, vec![NEW]);
        k.ring(n2, vec![NEW]);
        assert_eq!(k.key_for(addr(1), NEW), None);
        assert_eq!(k.key_for(addr(2), NEW), None);
    }

    #[test]
    fn without_a_published_ring_the_peer_is_answered_in_kind() {
        let mut k = PeerKeys::default();
        assert_eq!(k.key_for(addr(1), NEW), None, "first contact: primary");
        k.heard(addr(1), OLD);
        assert_eq!(k.key_for(addr(1), NEW), Some(OLD), "no record yet");
        let n1 = known(&mut k, 1);
        k.ring(n1.clone(), vec![OLD]);
        assert_eq!(k.key_for(addr(1), NEW), Some(OLD));
        // A record without a ring (an older sidecar) forgets the ring.
        k.ring(n1, vec![]);
        k.heard(addr(1), NEW);
        assert_eq!(k.key_for(addr(1), NEW), Some(NEW));
    }
}
