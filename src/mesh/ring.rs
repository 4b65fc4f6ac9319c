//! Coordinated probing: a monitoring ring beside foca's random probe.
//!
//! foca probes one member per period in its own shuffled order, so in any
//! period a dead member escapes all N - 1 probers with probability about
//! e^-1: a third of kills wait a second period or more before anyone finds
//! them (BENCHMARKS.md, "Why the kill -9 tail stays above 4 s"). Here every
//! member also probes its **successor** on a ring that every member orders
//! the same way: by [`position`], a hash of its name that is the same in
//! every process (foca's address of a member is keyed per process). While
//! views agree, every member is probed by its predecessor in every period,
//! so a dead member is suspected one period and two probe round trips after
//! it died at the latest.
//!
//! - A ring probe is a check ([`crate::mesh::wire::Check`]) of the member's
//!   name at generation [`PING_GENERATION`], which no member has: every
//!   sidecar since the checks were added answers it with its identity and
//!   incarnation, and none takes it for a suspicion of itself.
//! - Unanswered after `probe_rtt`, it is sent again and `indirect_probes`
//!   other members are asked to probe the member for us
//!   (`KIND_PING_REQ`); a helper passes the member's answer on to us.
//! - Unanswered after another `probe_rtt`, the member is suspected, as
//!   foca's own probe would: the suspicion is gossiped, and every member
//!   times it and checks the suspect (`suspicion.rs`).
//!
//! foca's random probe stays, at a longer period
//! ([`crate::mesh::SwimTuning::random_probe_period`]), for members no ring
//! reaches while views differ.
//!
//! Pure bookkeeping: the core asks [`Ring::poll`] what is due and does it.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use foca::{Member, State};

use crate::mesh::member::NodeIdentity;

/// The generation a ring probe names: no member has it (generations are
/// Unix milliseconds at start, and the mesh starts at 1 at the least), so
/// the check is answered and never taken for a suspicion.
pub(crate) const PING_GENERATION: u64 = 0;

/// Probes relayed for others at once; the oldest goes first beyond.
const MAX_RELAYS: usize = 16;

/// After a member comes up, no ring probe for this long: it is most likely
/// still starting (a process at 100 % CPU answers late), and while pods
/// come up one after another the ring waits for them to settle. 512 pods
/// started at once on 2 cores, probed at once, kept one another suspected
/// (BENCHMARKS.md). foca's random probe goes on meanwhile.
pub(crate) const SETTLE: Duration = Duration::from_secs(5);

/// What [`Ring::poll`] says is due.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// A period begins: probe the successor.
    Period,
    /// The direct probe went unanswered: send it again and ask others.
    Indirect(NodeIdentity),
    /// Nobody got an answer: suspect the member at this incarnation.
    Suspect(NodeIdentity, u16),
}

#[derive(Debug)]
struct Probe {
    target: NodeIdentity,
    incarnation: u16,
    indirect: bool,
    due: Instant,
}

#[derive(Debug)]
struct Relayed {
    /// foca's address of the member probed.
    target: u64,
    to: SocketAddr,
    until: Instant,
}

/// This member's ring probe, and the probes it relays for others.
#[derive(Debug)]
pub(crate) struct Ring {
    next_period: Instant,
    probe: Option<Probe>,
    relays: Vec<Relayed>,
    /// The successor found last, until the membership changes: finding it
    /// hashes every member's name.
    successor: Option<NodeIdentity>,
    /// No probe before this: a member came up lately ([`SETTLE`]).
    settled_at: Instant,
}

/// The identity a ring probe of `target` names.
pub(crate) fn ping_id(target: &NodeIdentity) -> NodeIdentity {
    NodeIdentity::new(
        target.node_id.clone(),
        target.gossip,
        target.transport_port,
        PING_GENERATION,
    )
}

/// A member's place on the ring: FNV-1a of its name, then MurmurHash3's
/// 64-bit finalizer so that names differing in one character spread over
/// the ring. Every member, in every process and version, must compute the
/// same: never keyed, never changed (the view's parts, `wire::view_bucket`,
/// are cut by it too).
pub(crate) fn position(node_id: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The alive member after `me` (a node id) on the ring: the least
/// distance forward from our [`position`] to its, wrapping; names break
/// ties. Also whether it is simply the next member: false when a suspect
/// lies between, which may be alive again by the next period.
pub(crate) fn successor<'a>(
    me: &str,
    members: impl Iterator<Item = &'a Member<NodeIdentity>>,
) -> Option<(&'a Member<NodeIdentity>, bool)> {
    let from = position(me);
    let mut next: Option<((u64, &str), &Member<NodeIdentity>)> = None;
    let mut next_alive = next;
    for m in members {
        let name = &*m.id().node_id;
        if name == me || m.state() == State::Down {
            continue;
        }
        let key = (position(name).wrapping_sub(from), name);
        if next.is_none_or(|(k, _)| key < k) {
            next = Some((key, m));
        }
        if m.state() == State::Alive && next_alive.is_none_or(|(k, _)| key < k) {
            next_alive = Some((key, m));
        }
    }
    let (_, found) = next_alive?;
    Some((found, next.is_some_and(|(_, m)| std::ptr::eq(m, found))))
}

impl Ring {
    /// The first period starts `period` after `now`.
    pub(crate) fn new(now: Instant, period: Duration) -> Self {
        Self {
            next_period: now + period,
            probe: None,
            relays: Vec::new(),
            successor: None,
            settled_at: now,
        }
    }

    /// The successor found last, if the membership has not changed since.
    pub(crate) fn successor(&self) -> Option<&NodeIdentity> {
        self.successor.as_ref()
    }

    /// Keeps `successor` until [`Ring::members_changed`].
    pub(crate) fn keep_successor(&mut self, successor: NodeIdentity) {
        self.successor = Some(successor);
    }

    /// A member went down or was renamed.
    pub(crate) fn members_changed(&mut self) {
        self.successor = None;
    }

    /// A member came up at `now`: the ring waits [`SETTLE`] to probe.
    pub(crate) fn member_up(&mut self, now: Instant) {
        self.successor = None;
        self.settled_at = now + SETTLE;
    }

    /// When [`Ring::poll`] next has something to do.
    pub(crate) fn next_due(&self) -> Instant {
        match &self.probe {
            Some(p) => p.due.min(self.next_period),
            None => self.next_period,
        }
    }

    /// What is due at `now`, one step at a time; `rtt` and `period` as
    /// local health stretches them now.
    pub(crate) fn poll(&mut self, now: Instant, rtt: Duration, period: Duration) -> Option<Step> {
        if let Some(p) = self.probe.as_mut()
            && p.due <= now
        {
            if !p.indirect {
                p.indirect = true;
                p.due = now + rtt;
                return Some(Step::Indirect(p.target.clone()));
            }
            let p = self.probe.take()?;
            return Some(Step::Suspect(p.target, p.incarnation));
        }
        if self.next_period <= now {
            // From now, not from when it was due: a stalled node does not
            // catch up on periods it slept through.
            self.next_period = now + period;
            if self.probe.is_none() && now >= self.settled_at {
                return Some(Step::Period);
            }
        }
        None
    }

    /// A probe of `target` (held at `incarnation`) went out; it is judged
    /// at `due`.
    pub(crate) fn probe(&mut self, target: NodeIdentity, incarnation: u16, due: Instant) {
        self.probe = Some(Probe {
            target,
            incarnation,
            indirect: false,
            due,
        });
    }

    /// `id` answered a check: if it is the member being probed (by name: a
    /// restart under a newer generation answers too), the probe ends.
    /// `Some(true)` when the direct probe was answered in time.
    pub(crate) fn answered(&mut self, id: &NodeIdentity) -> Option<bool> {
        if self
            .probe
            .as_ref()
            .is_some_and(|p| p.target.node_id == id.node_id)
        {
            return self.probe.take().map(|p| !p.indirect);
        }
        None
    }

    /// This node was not running for `late`: the probe in flight gets
    /// that time back (its answer may be waiting in the socket).
    pub(crate) fn delay(&mut self, late: Duration) {
        if let Some(p) = self.probe.as_mut() {
            p.due += late;
        }
    }

    /// We probe `target` for `to` until `until`.
    pub(crate) fn relay(&mut self, target: u64, to: SocketAddr, now: Instant, until: Instant) {
        self.relays.retain(|r| r.until > now);
        if self.relays.len() >= MAX_RELAYS {
            self.relays.remove(0);
        }
        self.relays.push(Relayed { target, to, until });
    }

    /// Whom to pass `target`'s answer on to.
    pub(crate) fn relays_for(&mut self, target: u64, now: Instant) -> Vec<SocketAddr> {
        if self.relays.is_empty() {
            return Vec::new();
        }
        let mut to = Vec::new();
        self.relays.retain(|r| {
            if r.target == target && r.until > now {
                to.push(r.to);
                false
            } else {
                r.until > now
            }
        });
        if self.relays.is_empty() {
            self.relays = Vec::new();
        }
        to
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ring started now, with the default probe_rtt and period.
    fn ring() -> (Ring, Instant, Duration, Duration) {
        let t0 = Instant::now();
        let (rtt, period) = (Duration::from_millis(300), Duration::from_secs(1));
        (Ring::new(t0, period), t0, rtt, period)
    }

    fn id(name: &str) -> NodeIdentity {
        NodeIdentity::new(name.into(), "127.0.0.1:7946".parse().unwrap(), 7947, 1_000)
    }

    #[test]
    fn every_member_has_one_predecessor_on_the_ring() {
        let members: Vec<Member<NodeIdentity>> = (0..50)
            .map(|i| Member::alive(id(&format!("sbproxy-{i}"))))
            .collect();
        let mut probed = std::collections::HashMap::new();
        for m in &members {
            let (s, next) = successor(&m.id().node_id, members.iter()).unwrap();
            assert!(next);
            assert_ne!(s.id(), m.id());
            *probed.entry(s.id().node_id.clone()).or_insert(0) += 1;
        }
        assert_eq!(probed.len(), 50, "every member is someone's successor");
        assert!(probed.values().all(|&n| n == 1));
    }

    #[test]
    fn every_process_places_a_name_alike() {
        // Fixed values: a hash keyed per process (as foca's addresses are)
        // would give every member its own ring, and some none probing them.
        // FNV-1a and MurmurHash3's finalizer, computed independently.
        assert_eq!(position(""), 0xefd0_1f60_ba99_2926);
        assert_eq!(position("demo-proxy-0"), 0xcd26_d95f_db0a_6187);
    }

    #[test]
    fn the_successor_skips_members_not_alive() {
        let mut members: Vec<Member<NodeIdentity>> = ["b", "c", "d"]
            .iter()
            .map(|n| Member::alive(id(n)))
            .collect();
        let first = successor("a", members.iter()).unwrap().0.id().clone();
        for m in &mut members {
            if m.id() == &first {
                *m = Member::new(first.clone(), 0, State::Suspect);
            }
        }
        let (next, simply_next) = successor("a", members.iter()).unwrap();
        assert_ne!(next.id(), &first);
        assert!(!simply_next, "a suspect lies between: not to be kept");
        assert!(successor("a", std::iter::empty()).is_none());
    }

    #[test]
    fn an_unanswered_probe_goes_indirect_then_suspects() {
        let (mut r, t0, rtt, period) = ring();
        assert_eq!(r.poll(t0, rtt, period), None);
        let t1 = t0 + period;
        assert_eq!(r.poll(t1, rtt, period), Some(Step::Period));
        r.probe(id("b"), 3, t1 + rtt);
        assert_eq!(r.next_due(), t1 + rtt);
        assert_eq!(r.poll(t1 + rtt, rtt, period), Some(Step::Indirect(id("b"))));
        assert_eq!(r.poll(t1 + rtt, rtt, period), None);
        let t2 = t1 + rtt * 2;
        assert_eq!(r.poll(t2, rtt, period), Some(Step::Suspect(id("b"), 3)));
        assert_eq!(r.answered(&id("b")), None, "judged already");
        assert_eq!(r.poll(t1 + period, rtt, period), Some(Step::Period));
    }

    #[test]
    fn an_answer_ends_the_probe_and_says_whether_it_was_in_time() {
        let (mut r, t0, rtt, period) = ring();
        r.probe(id("b"), 0, t0 + rtt);
        assert_eq!(r.answered(&id("c")), None);
        assert_eq!(r.answered(&id("b")), Some(true));
        r.probe(id("b"), 0, t0 + rtt);
        r.poll(t0 + rtt, rtt, period);
        let renewed = NodeIdentity::new("b".into(), "127.0.0.1:7946".parse().unwrap(), 7947, 2_000);
        assert_eq!(r.answered(&renewed), Some(false), "by name, late");
        assert_eq!(
            r.poll(t0 + rtt * 3, rtt, period),
            None,
            "nothing to suspect"
        );
    }

    #[test]
    fn no_probe_until_the_members_settle() {
        let (mut r, t0, rtt, period) = ring();
        r.member_up(t0);
        let mut t = t0;
        while t < t0 + SETTLE {
            t += period;
            let step = r.poll(t, rtt, period);
            assert_eq!(step.is_some(), t >= t0 + SETTLE, "at {:?}", t - t0);
        }
    }

    #[test]
    fn a_stall_gives_the_probe_its_time_back() {
        let (mut r, t0, rtt, period) = ring();
        r.probe(id("b"), 0, t0 + rtt);
        r.delay(Duration::from_secs(2));
        assert_eq!(r.poll(t0 + rtt, rtt, period), None);
        assert_eq!(r.next_due(), t0 + period);
    }

    #[test]
    fn relays_pass_an_answer_on_once_and_expire() {
        let t0 = Instant::now();
        let mut r = Ring::new(t0, Duration::from_secs(1));
        let (a, b): (SocketAddr, SocketAddr) = (
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.1:2".parse().unwrap(),
        );
        let until = t0 + Duration::from_millis(600);
        r.relay(7, a, t0, until);
        r.relay(7, b, t0, until);
        r.relay(8, a, t0, until);
        assert_eq!(r.relays_for(7, t0), vec![a, b]);
        assert!(r.relays_for(7, t0).is_empty());
        assert!(r.relays_for(8, until).is_empty(), "expired");
        for i in 0..40 {
            r.relay(i, a, t0, until);
        }
        assert_eq!(r.relays.len(), MAX_RELAYS);
        assert_eq!(r.relays_for(39, t0), vec![a]);
        assert!(r.relays_for(0, t0).is_empty(), "the oldest went first");
    }
}
