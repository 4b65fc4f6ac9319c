//! Suspicion as every member holds it, on top of foca (two of Lifeguard's
//! ideas).
//!
//! foca times a suspicion only on the member whose own probe failed; the
//! rest of the cluster waits for that member's `down` to reach them, and the
//! suspected member learns of the suspicion only when gossip happens to
//! carry it there. Here every member that hears of a suspicion:
//!
//! - asks the suspect directly (a *check*, up to [`CHECKS`] times): a live
//!   suspect learns it is suspected at once and refutes, and its answer is
//!   the refutation, delivered to the asker without waiting for gossip
//!   (Lifeguard's "buddy system");
//! - times the suspicion itself and declares the member down when it
//!   expires unrefuted, so a member that missed the `down` gossip does not
//!   keep a dead peer for tens of seconds;
//! - pushes its deadlines back when it was itself starved of CPU (a timer
//!   ran late): time it did not see pass is no evidence.
//!
//! And [`LocalHealth`], Lifeguard's local health multiplier: a node that
//! misses acks, has to refute suspicions of itself or runs its timers late
//! is more likely overloaded than surrounded by failures, so it probes and
//! gossips less often and waits longer for acks until probes succeed again.
//!
//! Pure bookkeeping: the core feeds it what it hears and asks what is due.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut};
use foca::{Codec, Header, Member, PostcardCodec, State};

use crate::mesh::member::NodeIdentity;

/// Checks sent per suspicion, [`CHECK_EVERY`] apart: at 10 % loss one
/// check and its answer both arrive 81 % of the time, three tries 99.3 %.
pub(crate) const CHECKS: u8 = 3;
/// Gap between checks of one suspect.
pub(crate) const CHECK_EVERY: Duration = Duration::from_millis(250);
/// A timer this late means the node itself was not running.
pub(crate) const STARVED_AFTER: Duration = Duration::from_millis(250);

/// The highest [`LocalHealth`] score: timings stretched at most 9-fold
/// (Lifeguard's and memberlist's bound).
pub(crate) const HEALTH_MAX: u8 = 8;

/// Lifeguard's local health multiplier: a score in `0..=HEALTH_MAX`, up by
/// one for each direct probe left unanswered, each suspicion of this node
/// it must refute and each stall of its own timers; down by one for each
/// direct probe answered in time. The probe period, the wait for a direct
/// ack and the gossip period are stretched by `1 + score`.
///
/// A healthy node in a healthy cluster stays at 0: at 10 % loss a direct
/// probe fails 19 % of the time and succeeds 81 %, so the score drifts back
/// down at once. Under overload (every node late, most acks missed) the
/// whole cluster backs off instead of flooding itself with suspicions and
/// refutations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LocalHealth {
    score: u8,
}

impl LocalHealth {
    /// Something pointed at this node being slow.
    pub(crate) fn worse(&mut self) {
        self.score = self.score.saturating_add(1).min(HEALTH_MAX);
    }

    /// A direct probe was answered in time.
    pub(crate) fn better(&mut self) {
        self.score = self.score.saturating_sub(1);
    }

    pub(crate) fn score(self) -> u8 {
        self.score
    }

    /// `d` stretched by the score.
    pub(crate) fn scale(self, d: Duration) -> Duration {
        d * (1 + u32::from(self.score))
    }
}

#[derive(Debug)]
struct Entry {
    id: NodeIdentity,
    incarnation: u16,
    expires: Instant,
    next_check: Option<Instant>,
    checks_left: u8,
}

/// What is due now.
#[derive(Debug, Default)]
pub(crate) struct Due {
    /// Suspects to check again.
    pub checks: Vec<(NodeIdentity, u16)>,
    /// Suspicions that expired unrefuted.
    pub expired: Vec<(NodeIdentity, u16)>,
}

/// The suspicions this member holds, by member name.
#[derive(Debug, Default)]
pub(crate) struct Suspicions {
    by_name: BTreeMap<Arc<str>, Entry>,
}

impl Suspicions {
    /// `id` is suspected at `incarnation`. Returns whether this is news (the
    /// caller checks the suspect at once; the next checks are timed here).
    pub(crate) fn suspect(
        &mut self,
        id: &NodeIdentity,
        incarnation: u16,
        now: Instant,
        timeout: Duration,
    ) -> bool {
        if let Some(e) = self.by_name.get(&id.node_id)
            && (e.id.generation, e.incarnation) >= (id.generation, incarnation)
        {
            return false;
        }
        self.by_name.insert(
            id.node_id.clone(),
            Entry {
                id: id.clone(),
                incarnation,
                expires: now + timeout,
                next_check: Some(now + CHECK_EVERY),
                checks_left: CHECKS - 1,
            },
        );
        true
    }

    /// `id` is known alive at `incarnation` (a refutation, or a newer
    /// identity): a suspicion of an older one is over.
    pub(crate) fn alive(&mut self, id: &NodeIdentity, incarnation: u16) {
        if self
            .by_name
            .get(&id.node_id)
            .is_some_and(|e| (id.generation, incarnation) > (e.id.generation, e.incarnation))
        {
            self.by_name.remove(&id.node_id);
        }
    }

    /// The member is gone (down, or forgotten): nothing left to time.
    pub(crate) fn forget(&mut self, node_id: &str) {
        self.by_name.remove(node_id);
    }

    /// When [`Suspicions::due`] has something.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        self.by_name
            .values()
            .flat_map(|e| [Some(e.expires), e.next_check])
            .flatten()
            .min()
    }

    /// Checks and expiries due at `now`; expired suspicions are dropped.
    pub(crate) fn due(&mut self, now: Instant) -> Due {
        let mut due = Due::default();
        for e in self.by_name.values_mut() {
            if e.expires <= now {
                due.expired.push((e.id.clone(), e.incarnation));
            } else if e.next_check.is_some_and(|t| t <= now) {
                due.checks.push((e.id.clone(), e.incarnation));
                e.checks_left = e.checks_left.saturating_sub(1);
                e.next_check = (e.checks_left > 0).then(|| now + CHECK_EVERY);
            }
        }
        self.by_name.retain(|_, e| e.expires > now);
        due
    }

    /// This node was not running for `by` (its timers ran that late).
    pub(crate) fn delay(&mut self, by: Duration) {
        for e in self.by_name.values_mut() {
            e.expires += by;
        }
    }

    /// How many suspicions are held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_name.len()
    }
}

/// What foca decoded from the packets it was handed: every member update,
/// and each sender as alive at the incarnation its header carries.
pub(crate) type Heard = Arc<Mutex<Vec<(NodeIdentity, u16, State)>>>;

/// foca's codec: postcard, as foca's own, noting on the way what it
/// decodes. foca applies member updates and keeps them to itself; reading
/// them here costs no second decoding of every packet.
pub(crate) struct HearingCodec {
    pub(crate) heard: Heard,
}

impl HearingCodec {
    fn note(&self, id: &NodeIdentity, incarnation: u16, state: State) {
        if let Ok(mut heard) = self.heard.lock() {
            heard.push((id.clone(), incarnation, state));
        }
    }
}

impl Codec<NodeIdentity> for HearingCodec {
    type Error = postcard::Error;

    fn encode_header(
        &mut self,
        header: &Header<NodeIdentity>,
        buf: impl BufMut,
    ) -> Result<(), Self::Error> {
        PostcardCodec.encode_header(header, buf)
    }

    fn decode_header(&mut self, buf: impl Buf) -> Result<Header<NodeIdentity>, Self::Error> {
        let header: Header<NodeIdentity> = PostcardCodec.decode_header(buf)?;
        // Anything a member sends carries its incarnation: a higher one
        // refutes.
        self.note(&header.src, header.src_incarnation, State::Alive);
        Ok(header)
    }

    fn encode_member(
        &mut self,
        member: &Member<NodeIdentity>,
        buf: impl BufMut,
    ) -> Result<(), Self::Error> {
        PostcardCodec.encode_member(member, buf)
    }

    fn decode_member(&mut self, buf: impl Buf) -> Result<Member<NodeIdentity>, Self::Error> {
        let member: Member<NodeIdentity> = PostcardCodec.decode_member(buf)?;
        self.note(member.id(), member.incarnation(), member.state());
        Ok(member)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str, generation: u64) -> NodeIdentity {
        NodeIdentity::new(
            name.into(),
            "10.0.0.5:7946".parse().unwrap(),
            8946,
            generation,
        )
    }

    #[test]
    fn local_health_stretches_timings_within_bounds() {
        let mut h = LocalHealth::default();
        let second = Duration::from_secs(1);
        assert_eq!(h.scale(second), second);
        h.better();
        assert_eq!(h.score(), 0, "never below 0");
        for _ in 0..20 {
            h.worse();
        }
        assert_eq!(h.score(), HEALTH_MAX);
        assert_eq!(h.scale(second), 9 * second);
        h.better();
        assert_eq!(
            h.scale(Duration::from_millis(300)),
            Duration::from_millis(2400)
        );
    }

    #[test]
    fn a_suspicion_is_checked_then_expires_unless_refuted() {
        let t0 = Instant::now();
        let mut s = Suspicions::default();
        let timeout = Duration::from_secs(2);
        assert!(s.suspect(&id("a", 1), 3, t0, timeout));
        assert!(
            !s.suspect(&id("a", 1), 3, t0, timeout),
            "the same suspicion is not news"
        );
        let mut checks = 0;
        let mut t = t0;
        while s.len() > 0 {
            t = s.next_due().unwrap();
            let due = s.due(t);
            checks += due.checks.len();
            if !due.expired.is_empty() {
                assert_eq!(due.expired, vec![(id("a", 1), 3)]);
            }
        }
        assert_eq!(
            checks,
            usize::from(CHECKS - 1),
            "the first check is the caller's"
        );
        assert_eq!(t, t0 + timeout);

        // Refuted: a higher incarnation, or a newer identity.
        assert!(s.suspect(&id("a", 1), 3, t0, timeout));
        s.alive(&id("a", 1), 3);
        assert_eq!(
            s.len(),
            1,
            "alive at the suspected incarnation refutes nothing"
        );
        s.alive(&id("a", 1), 4);
        assert_eq!(s.len(), 0);
        assert!(s.suspect(&id("a", 1), 3, t0, timeout));
        s.alive(&id("a", 2), 0);
        assert_eq!(s.len(), 0);
    }

    #[test]
    fn a_starved_node_pushes_its_deadlines_back() {
        let t0 = Instant::now();
        let mut s = Suspicions::default();
        s.suspect(&id("a", 1), 0, t0, Duration::from_secs(1));
        s.delay(Duration::from_millis(1500));
        assert!(s.due(t0 + Duration::from_secs(2)).expired.is_empty());
        assert_eq!(s.due(t0 + Duration::from_millis(2500)).expired.len(), 1);
    }
}
