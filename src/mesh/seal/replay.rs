//! The bounded set of nonces seen inside the replay window.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};

use super::{NONCE_LEN, REPLAY_WINDOW_MS};

type NonceBytes = [u8; NONCE_LEN];

/// Nonces of authenticated packets, each kept until its packet falls out of
/// the replay window.
///
/// A packet stamped `sender_ms` is accepted only while
/// `|now - sender_ms| <= REPLAY_WINDOW_MS`, so its nonce must be remembered
/// until `now > sender_ms + REPLAY_WINDOW_MS` and no longer. Expiries are not
/// in arrival order (senders' clocks differ by up to the window), hence a
/// min-heap on expiry rather than a FIFO queue.
///
/// Memory is bounded by `capacity` entries (about 50 bytes each between the
/// set and the heap: some 13 MB at the default 262 144, reached only under
/// that load; capacity grows on demand). Only authenticated
/// packets get here, so filling it takes a key holder sending more than
/// `capacity / 60 s` (about 4 400) fresh packets per second to this node.
/// When full, the entry closest to expiry is dropped: that one packet
/// becomes replayable for the rest of its window. The alternative, refusing
/// new packets while full, would let one chatty or compromised peer cut a
/// node off from the whole mesh; a replayed SWIM message is at worst a stale
/// ping or an already-known membership update, which foca ignores.
///
/// Time is the caller's clock. If it steps backwards after entries were
/// pruned, packets from the pruned span could be replayed once more; the
/// same trade (liveness over a replay of already-delivered gossip) applies.
#[derive(Debug)]
pub(super) struct ReplayCache {
    capacity: usize,
    seen: HashSet<NonceBytes>,
    by_expiry: BinaryHeap<Reverse<(u64, NonceBytes)>>,
}

impl ReplayCache {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            seen: HashSet::new(),
            by_expiry: BinaryHeap::new(),
        }
    }

    /// Records `nonce` and returns `true` if it was not already present
    /// (the packet is fresh), or returns `false` (a replay).
    pub(super) fn insert(&mut self, nonce: NonceBytes, sender_ms: u64, now_ms: u64) -> bool {
        self.prune(now_ms);
        if self.seen.contains(&nonce) {
            return false;
        }
        while self.seen.len() >= self.capacity {
            if !self.pop_oldest() {
                break;
            }
        }
        self.seen.insert(nonce);
        self.by_expiry
            .push(Reverse((sender_ms.saturating_add(REPLAY_WINDOW_MS), nonce)));
        true
    }

    /// Number of nonces remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.seen.len()
    }

    /// Forgets nonces whose packets would now be refused as stale anyway.
    fn prune(&mut self, now_ms: u64) {
        while let Some(Reverse((expiry, _))) = self.by_expiry.peek() {
            if *expiry >= now_ms {
                break;
            }
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) -> bool {
        match self.by_expiry.pop() {
            Some(Reverse((_, nonce))) => {
                self.seen.remove(&nonce);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nonce(i: u32) -> NonceBytes {
        let mut n = [0u8; NONCE_LEN];
        n[..4].copy_from_slice(&i.to_be_bytes());
        n
    }

    #[test]
    fn seen_nonce_is_a_replay_until_its_window_ends() {
        let mut cache = ReplayCache::new(16);
        let t = 1_000_000;
        assert!(cache.insert(nonce(1), t, t));
        assert!(!cache.insert(nonce(1), t, t + 1));
        // Still remembered at the last instant the packet itself is acceptable.
        assert!(!cache.insert(nonce(1), t, t + REPLAY_WINDOW_MS));
        // Afterwards it is pruned: the timestamp check rejects it first anyway.
        assert!(cache.insert(nonce(2), t + 1, t + REPLAY_WINDOW_MS + 1));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn expiry_follows_sender_time_not_arrival_order() {
        let mut cache = ReplayCache::new(16);
        let now = 1_000_000;
        // Arrives first but was stamped later: must outlive the second one.
        assert!(cache.insert(nonce(1), now + 20_000, now));
        assert!(cache.insert(nonce(2), now - 20_000, now));
        // At now + 15 s, nonce 2 (expiry now + 10 s) is gone, nonce 1 is not.
        assert!(cache.insert(nonce(3), now, now + 15_000));
        assert_eq!(cache.len(), 2);
        assert!(!cache.insert(nonce(1), now + 20_000, now + 15_000));
    }

    #[test]
    fn full_cache_drops_the_entry_closest_to_expiry() {
        let mut cache = ReplayCache::new(3);
        let now = 1_000_000;
        assert!(cache.insert(nonce(1), now, now));
        assert!(cache.insert(nonce(2), now - 5_000, now));
        assert!(cache.insert(nonce(3), now + 5_000, now));
        assert!(cache.insert(nonce(4), now, now));
        assert_eq!(cache.len(), 3);
        assert!(
            cache.insert(nonce(2), now - 5_000, now),
            "oldest was evicted"
        );
        assert!(!cache.insert(nonce(3), now + 5_000, now));
        assert!(cache.len() <= 3);
    }

    #[test]
    fn extreme_timestamps_do_not_overflow() {
        let mut cache = ReplayCache::new(4);
        assert!(cache.insert(nonce(1), u64::MAX, u64::MAX));
        assert!(!cache.insert(nonce(1), u64::MAX, u64::MAX));
        assert!(cache.insert(nonce(2), 0, 0));
    }
}
