//! What the unseal checks saw of other nodes' clocks: which peers send
//! packets that authenticate but are stamped outside the replay window, when
//! to warn about them, and whether such packets are all this node gets.
//!
//! Sans-IO: the shell reports each authenticated packet's outcome with a
//! monotonic `now`. Not the wall clock: that is the clock that may be off,
//! and NTP may step it while we watch.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::REPLAY_WINDOW_MS;

/// A node whose every authenticated packet for this long was a
/// [`Reject::ClockSkew`](super::Reject::ClockSkew) is isolated by clock
/// skew (see [`SkewWatch::isolation`]).
pub const SKEW_WINDOW: Duration = Duration::from_secs(30);

/// A skewed peer stays listed for this long after its last skewed packet,
/// and gets at most one warn line per this interval.
pub const SKEW_REMEMBER: Duration = Duration::from_secs(60);

/// Most peers tracked at once. Only packets that authenticate under a ring
/// key get here, so this bounds what a key holder sending from many source
/// addresses can make us keep; the least recently skewed peer makes room.
const MAX_PEERS: usize = 1024;

/// Most warn lines per [`SKEW_REMEMBER`] over all peers. Captured packets
/// replayed after the window also land here, and UDP source addresses can
/// be spoofed, so "one line per peer" alone would let a replayer write one
/// line per packet; beyond this budget, lines wait (counted as suppressed).
const MAX_WARNINGS: u32 = 16;

/// The skewed peers seen recently, and when a packet was last accepted.
#[derive(Debug, Default)]
pub struct SkewWatch {
    peers: HashMap<SocketAddr, Entry>,
    last_accepted: Option<Instant>,
    /// Start of the current warn-line budget period, and lines written in it.
    budget: Option<(Instant, u32)>,
}

#[derive(Debug)]
struct Entry {
    offset_ms: i64,
    last: Instant,
    rejected: u64,
    /// When its last warn line was written; `None` before the first.
    logged: Option<Instant>,
    suppressed: u64,
}

/// A warn line that is due: the first skewed packet of a peer, or the first
/// one after [`SKEW_REMEMBER`] since its previous line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkewWarning {
    /// Where the packet came from.
    pub peer: SocketAddr,
    /// Its sender time minus ours, in milliseconds.
    pub offset_ms: i64,
    /// Skewed packets from this peer since its previous line, not logged.
    pub suppressed: u64,
}

/// A peer whose packets were rejected for clock skew within
/// [`SKEW_REMEMBER`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkewedPeer {
    /// The source address of its packets.
    pub address: SocketAddr,
    /// Sender time minus ours of its latest rejected packet, in milliseconds
    /// (positive: its clock is ahead of ours).
    pub offset_ms: i64,
    /// Its packets rejected for clock skew since it was first listed.
    pub rejected: u64,
    /// Since its latest rejected packet.
    pub last_ago: Duration,
}

/// Every authenticated packet of the last [`SKEW_WINDOW`] was rejected for
/// clock skew: this node is cut off from the mesh by its clock or by all of
/// its peers' clocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Isolation {
    /// The peers whose packets were rejected in that window, by address.
    pub peers: Vec<SkewedPeer>,
}

impl SkewWatch {
    /// An empty watch.
    #[cfg(test)]
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A packet passed every check.
    pub(crate) fn accepted(&mut self, now: Instant) {
        self.last_accepted = Some(now);
    }

    /// A packet from `peer` authenticated but was `offset_ms` outside the
    /// window. Returns the warn line to write, if one is due.
    pub(crate) fn rejected(
        &mut self,
        peer: SocketAddr,
        offset_ms: i64,
        now: Instant,
    ) -> Option<SkewWarning> {
        if !self.peers.contains_key(&peer) {
            self.forget_old(now);
            if self.peers.len() >= MAX_PEERS
                && let Some(oldest) = self
                    .peers
                    .iter()
                    .min_by_key(|(_, e)| e.last)
                    .map(|(a, _)| *a)
            {
                self.peers.remove(&oldest);
            }
            self.peers.insert(
                peer,
                Entry {
                    offset_ms,
                    last: now,
                    rejected: 0,
                    logged: None,
                    suppressed: 0,
                },
            );
        }
        let due = {
            let e = self.peers.get_mut(&peer)?;
            e.offset_ms = offset_ms;
            e.last = now;
            e.rejected += 1;
            e.logged
                .is_none_or(|at| now.saturating_duration_since(at) >= SKEW_REMEMBER)
        };
        let logged = due && self.spend_warning(now);
        let e = self.peers.get_mut(&peer)?;
        if !logged {
            e.suppressed += 1;
            return None;
        }
        e.logged = Some(now);
        Some(SkewWarning {
            peer,
            offset_ms,
            suppressed: std::mem::take(&mut e.suppressed),
        })
    }

    /// Takes one line from the budget of the current period, if any is left.
    fn spend_warning(&mut self, now: Instant) -> bool {
        let (start, used) = match self.budget {
            Some((start, used)) if now.saturating_duration_since(start) < SKEW_REMEMBER => {
                (start, used)
            }
            _ => (now, 0),
        };
        if used >= MAX_WARNINGS {
            return false;
        }
        self.budget = Some((start, used + 1));
        true
    }

    /// The peers rejected for clock skew within [`SKEW_REMEMBER`], by address.
    pub(crate) fn peers(&self, now: Instant) -> Vec<SkewedPeer> {
        self.peers_within(SKEW_REMEMBER, now)
    }

    /// `Some` when packets were rejected for clock skew within
    /// [`SKEW_WINDOW`] and none was accepted in that time.
    pub(crate) fn isolation(&self, now: Instant) -> Option<Isolation> {
        let accepted_recently = self
            .last_accepted
            .is_some_and(|t| now.saturating_duration_since(t) <= SKEW_WINDOW);
        if accepted_recently {
            return None;
        }
        let peers = self.peers_within(SKEW_WINDOW, now);
        (!peers.is_empty()).then_some(Isolation { peers })
    }

    fn peers_within(&self, within: Duration, now: Instant) -> Vec<SkewedPeer> {
        let mut out: Vec<SkewedPeer> = self
            .peers
            .iter()
            .filter_map(|(address, e)| {
                let last_ago = now.saturating_duration_since(e.last);
                (last_ago <= within).then_some(SkewedPeer {
                    address: *address,
                    offset_ms: e.offset_ms,
                    rejected: e.rejected,
                    last_ago,
                })
            })
            .collect();
        out.sort_by_key(|p| p.address);
        out
    }

    /// Drops peers silent for longer than [`SKEW_REMEMBER`]; their next
    /// skewed packet starts a new entry (and a new warn line).
    fn forget_old(&mut self, now: Instant) {
        self.peers
            .retain(|_, e| now.saturating_duration_since(e.last) <= SKEW_REMEMBER);
    }
}

/// `+60.0 s`: an offset as a person reads it.
pub(super) fn seconds(offset_ms: i64) -> String {
    format!("{:+.1} s", offset_ms as f64 / 1000.0)
}

impl fmt::Display for Isolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 3;
        write!(
            f,
            "clock skew: every authenticated mesh packet of the last {} s was stamped more than \
             {} s away from this node's clock (sender minus ours: ",
            SKEW_WINDOW.as_secs(),
            REPLAY_WINDOW_MS / 1000
        )?;
        for (i, p) in self.peers.iter().take(SHOWN).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{} from {}", seconds(p.offset_ms), p.address)?;
        }
        if self.peers.len() > SHOWN {
            write!(f, ", and {} more peers", self.peers.len() - SHOWN)?;
        }
        f.write_str("); this node's clock or its peers' clocks are wrong: check NTP")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(i: u8) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, i], 7946))
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn first_skewed_packet_of_a_peer_warns_then_one_line_per_minute_with_the_count() {
        let t0 = Instant::now();
        let mut w = SkewWatch::new();
        assert_eq!(
            w.rejected(addr(3), 60_012, t0),
            Some(SkewWarning {
                peer: addr(3),
                offset_ms: 60_012,
                suppressed: 0
            })
        );
        // One packet a second for the next 59 s: no line.
        for s in 1..60 {
            assert_eq!(w.rejected(addr(3), 60_000, t0 + secs(s)), None, "at {s} s");
        }
        // A minute after the first line: the next one, with what it held back.
        assert_eq!(
            w.rejected(addr(3), 59_990, t0 + secs(60)),
            Some(SkewWarning {
                peer: addr(3),
                offset_ms: 59_990,
                suppressed: 59
            })
        );
        assert_eq!(w.rejected(addr(3), 59_990, t0 + secs(61)), None);
    }

    #[test]
    fn each_peer_is_rate_limited_on_its_own() {
        let t0 = Instant::now();
        let mut w = SkewWatch::new();
        assert!(w.rejected(addr(1), -60_000, t0).is_some());
        assert!(w.rejected(addr(2), -60_000, t0 + secs(1)).is_some());
        assert!(w.rejected(addr(1), -60_000, t0 + secs(2)).is_none());
        assert!(w.rejected(addr(2), -60_000, t0 + secs(2)).is_none());
    }

    #[test]
    fn a_peer_silent_for_a_minute_is_forgotten_and_warns_again() {
        let t0 = Instant::now();
        let mut w = SkewWatch::new();
        assert!(w.rejected(addr(3), 60_000, t0).is_some());
        assert_eq!(w.peers(t0 + secs(60)).len(), 1);
        assert!(w.peers(t0 + secs(61)).is_empty());
        // Another peer's packet prunes it; its own next packet is news again.
        assert!(w.rejected(addr(4), 60_000, t0 + secs(61)).is_some());
        assert_eq!(w.peers.len(), 1);
        let again = w.rejected(addr(3), 61_000, t0 + secs(62)).unwrap();
        assert_eq!(again.suppressed, 0);
        assert_eq!(w.peers(t0 + secs(62))[0].rejected, 1);
    }

    #[test]
    fn peers_list_the_latest_offset_and_count_by_address() {
        let t0 = Instant::now();
        let mut w = SkewWatch::new();
        w.rejected(addr(9), 60_000, t0);
        w.rejected(addr(2), -45_000, t0);
        w.rejected(addr(9), 61_000, t0 + secs(5));
        let peers = w.peers(t0 + secs(7));
        assert_eq!(
            peers,
            vec![
                SkewedPeer {
                    address: addr(2),
                    offset_ms: -45_000,
                    rejected: 1,
                    last_ago: secs(7)
                },
                SkewedPeer {
                    address: addr(9),
                    offset_ms: 61_000,
                    rejected: 2,
                    last_ago: secs(2)
                },
            ]
        );
    }

    #[test]
    fn only_skewed_packets_for_the_window_is_isolation() {
        let t0 = Instant::now();
        let mut w = SkewWatch::new();
        // Nothing at all (alone): not isolated by skew.
        assert_eq!(w.isolation(t0), None);
        w.rejected(addr(1), -60_000, t0);
        w.rejected(addr(2), -60_500, t0 + secs(1));
        let iso = w.isolation(t0 + secs(2)).expect("isolated");
        assert_eq!(iso.peers.len(), 2);
        // The skewed packets age out of the window: just alone again.
        assert_eq!(w.isolation(t0 + secs(32)), None);
    }

    #[test]
    fn one_skewed_peer_among_healthy_ones_is_not_isolation() {
        let t0 = Instant::now();
        let mut w = SkewWatch::new();
        w.accepted(t0);
        for s in 1..40 {
            w.rejected(addr(3), 60_000, t0 + secs(s));
            if s % 2 == 0 {
                w.accepted(t0 + secs(s));
            }
            assert_eq!(w.isolation(t0 + secs(s)), None, "at {s} s");
        }
        // The healthy peers fall silent: 30 s later only skew is left.
        assert_eq!(w.isolation(t0 + secs(38 + 30)), None);
        w.rejected(addr(3), 60_000, t0 + secs(69));
        assert!(w.isolation(t0 + secs(69)).is_some());
        // One accepted packet ends it.
        w.accepted(t0 + secs(70));
        assert_eq!(w.isolation(t0 + secs(70)), None);
    }

    #[test]
    fn isolation_names_the_offsets_the_peers_and_the_fix() {
        let t0 = Instant::now();
        let mut w = SkewWatch::new();
        for i in 1..=5 {
            w.rejected(addr(i), -60_000 - i64::from(i) * 100, t0);
        }
        let text = w.isolation(t0).unwrap().to_string();
        assert!(text.starts_with("clock skew: "), "{text}");
        assert!(text.contains("-60.1 s from 127.0.0.1:7946"), "{text}");
        assert!(text.contains("-60.3 s from 127.0.0.3:7946"), "{text}");
        assert!(!text.contains("127.0.0.4"), "{text}");
        assert!(text.contains("and 2 more peers"), "{text}");
        assert!(text.contains("check NTP"), "{text}");
        assert_eq!(seconds(60_012), "+60.0 s");
        assert_eq!(seconds(-1_260), "-1.3 s");
    }

    #[test]
    fn warn_lines_over_all_peers_are_bounded_per_minute() {
        // Replayed captures from spoofed source addresses: each a "new peer".
        let t0 = Instant::now();
        let mut w = SkewWatch::new();
        let warned = (0..100u8)
            .filter(|&i| {
                w.rejected(addr(i), -90_000, t0 + Duration::from_millis(u64::from(i)))
                    .is_some()
            })
            .count();
        assert_eq!(warned, MAX_WARNINGS as usize);
        // A minute on, a held-back peer gets its line, with its count.
        let late = w.rejected(addr(99), -90_000, t0 + secs(60)).unwrap();
        assert_eq!(late.suppressed, 1);
        // Every packet is still tracked for status.
        assert_eq!(w.peers(t0 + secs(60)).len(), 100);
    }

    #[test]
    fn tracked_peers_stay_bounded() {
        let t0 = Instant::now();
        let mut w = SkewWatch::new();
        for i in 0..(MAX_PEERS as u32 + 50) {
            let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i);
            let t = t0 + Duration::from_millis(u64::from(i));
            w.rejected(SocketAddr::from((ip, 7946)), 60_000, t);
        }
        assert_eq!(w.peers.len(), MAX_PEERS);
        // The least recently skewed made room.
        assert!(
            !w.peers
                .contains_key(&SocketAddr::from(([10, 0, 0, 0], 7946)))
        );
    }
}
