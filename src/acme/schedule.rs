//! When to renew, when to retry, and whether an order is allowed at all:
//! pure functions of the certificate, the CA's answers and the clock (unix
//! seconds, passed in) and of a jitter in `[0, 1)` (passed in), so every
//! rule is tested without sleeps.
//!
//! - [`renew_at`]: the renewal time of a certificate (docs/reference.md#acme).
//! - [`Failures`]: backoff after failed orders, 1 min doubling to 6 h,
//!   never before the CA's `Retry-After`.
//! - [`IssuanceHistory`]: at most [`DUPLICATE_LIMIT`] certificates for the
//!   same hostname set in [`DUPLICATE_WINDOW_SECS`] (Let's Encrypt's
//!   duplicate certificate limit), kept in the store per hostname set.
//! - [`OrderBudget`]: a cap on new orders per account per interval.
//! - [`UnitOrderState`]: the failures and the CA's renewal information of
//!   one certificate, kept in the store so that every replica (a restarted
//!   one, the next owner) honours the same backoff and `Retry-After`.

use serde::{Deserialize, Serialize};

/// Validity of a certificate, unix seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CertTimes {
    /// notBefore.
    pub not_before_unix: u64,
    /// notAfter.
    pub not_after_unix: u64,
}

/// A renewal window suggested by the CA (ACME Renewal Information,
/// RFC 9773 `suggestedWindow`), unix seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AriWindow {
    /// `suggestedWindow.start`.
    pub start_unix: u64,
    /// `suggestedWindow.end`.
    pub end_unix: u64,
}

const DAY: u64 = 24 * 3600;

/// Jitter moves a renewal earlier by up to this fraction of the renewal
/// margin (the time between the renewal point and notAfter).
const JITTER_FRACTION: f64 = 0.1;

fn clamp_jitter(jitter: f64) -> f64 {
    if jitter.is_finite() {
        jitter.clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// `x * f` for `f` in `[0, 1]`, rounded down, without overflow.
fn fraction(x: u64, f: f64) -> u64 {
    ((x as f64) * f).floor().clamp(0.0, x as f64) as u64
}

/// When to renew the certificate, unix seconds. A time at or before the
/// current time means "renew now" (see `renew_delay_secs`).
///
/// 1. With an ARI window from the CA (and `start <= end`): a point inside
///    it, `start + jitter * (end - start)`, but never later than a tenth of
///    the lifetime before notAfter (a CA answer cannot make us serve an
///    expired certificate). A window in the past means now: that is how a
///    CA asks for early renewal (e.g. before a revocation).
/// 2. Else with `renew_before_days`: that many days before notAfter, and up
///    to 10% of that margin earlier by jitter (so replicas and hosts
///    issued together spread out, and never later than configured). Only
///    when the margin is less than half the lifetime: on a short-lived
///    certificate (6 days, with `renew_before_days: 30`) it would mean
///    renewing at issuance, forever; rule 3 applies instead.
/// 3. Else when one third of the lifetime remains, and up to 10% of that
///    third earlier by jitter (90-day certificate: between day 57 and 60).
///
/// Never earlier than notBefore. `jitter` is clamped to `[0, 1]` (NaN: 0).
pub(crate) fn renew_at(
    cert: CertTimes,
    renew_before_days: Option<u32>,
    ari: Option<AriWindow>,
    jitter: f64,
) -> u64 {
    let jitter = clamp_jitter(jitter);
    let lifetime = cert.not_after_unix.saturating_sub(cert.not_before_unix);
    let at = match ari.filter(|w| w.start_unix <= w.end_unix) {
        Some(window) => {
            let pick = window.start_unix + fraction(window.end_unix - window.start_unix, jitter);
            pick.min(cert.not_after_unix.saturating_sub(lifetime / 10))
        }
        None => {
            let margin = renew_before_days
                .filter(|_| !renew_before_ignored(cert, renew_before_days))
                .map(|days| u64::from(days) * DAY)
                .unwrap_or(lifetime / 3);
            let early = fraction(margin, JITTER_FRACTION * jitter);
            cert.not_after_unix
                .saturating_sub(margin)
                .saturating_sub(early)
        }
    };
    at.max(cert.not_before_unix)
}

/// Whether [`renew_at`] sets `renew_before_days` aside for `cert` (rule 2's
/// condition): the margin is at least half the lifetime, so the one-third
/// rule applies instead. The manager warns when it does, once per
/// certificate. `false` without `renew_before_days`.
pub(crate) fn renew_before_ignored(cert: CertTimes, renew_before_days: Option<u32>) -> bool {
    let lifetime = cert.not_after_unix.saturating_sub(cert.not_before_unix);
    renew_before_days.is_some_and(|days| u64::from(days) * DAY >= lifetime / 2)
}

/// Seconds to wait from `now` until `renew_at` (0 when due).
#[cfg(test)]
pub(crate) fn renew_delay_secs(renew_at: u64, now: u64) -> u64 {
    renew_at.saturating_sub(now)
}

/// First retry delay after a failure.
pub(crate) const BACKOFF_INITIAL_SECS: u64 = 60;
/// Longest retry delay.
pub(crate) const BACKOFF_MAX_SECS: u64 = 6 * 3600;
/// Longest `Retry-After` honoured: a larger value (a broken or hostile
/// answer) is treated as this.
pub(crate) const RETRY_AFTER_MAX_SECS: u64 = 7 * DAY;

/// Consecutive failed attempts for one hostname (or the account), and when
/// to try again.
#[derive(Default, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failures {
    /// Consecutive failures since the last success.
    pub count: u32,
    /// When the last one happened, unix seconds.
    pub last_failure_unix: u64,
    /// The CA's `Retry-After` of the last failure, as a unix time.
    pub retry_after_unix: Option<u64>,
}

impl Failures {
    /// Records a failure at `now`, with the CA's `Retry-After` (seconds)
    /// when it sent one (capped at [`RETRY_AFTER_MAX_SECS`]).
    pub(crate) fn record(&mut self, now: u64, retry_after_secs: Option<u64>) {
        self.count = self.count.saturating_add(1);
        self.last_failure_unix = now;
        self.retry_after_unix =
            retry_after_secs.map(|secs| now.saturating_add(secs.min(RETRY_AFTER_MAX_SECS)));
    }

    /// The current backoff: 60 s after the first failure, doubling with each
    /// further one, at most 6 h; 0 without failures.
    pub(crate) fn backoff_secs(&self) -> u64 {
        match self.count {
            0 => 0,
            n => {
                // 60 << 9 > 6 h already: no overflow possible past that.
                let doublings = (n - 1).min(16);
                (BACKOFF_INITIAL_SECS << doublings).min(BACKOFF_MAX_SECS)
            }
        }
    }

    /// The earliest time of the next attempt: the last failure plus the
    /// backoff, and never before `Retry-After`. 0 (any time) without
    /// failures.
    pub fn next_attempt_unix(&self) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let backoff = self.last_failure_unix.saturating_add(self.backoff_secs());
        backoff.max(self.retry_after_unix.unwrap_or(0))
    }

    /// Forgets every failure (after a success).
    pub(crate) fn clear(&mut self) {
        *self = Self::default();
    }
}

/// How often the CA's renewal information is asked for when it sends no
/// `Retry-After` (RFC 9773 suggests a few times a day).
pub(crate) const ARI_DEFAULT_SECS: u64 = 6 * 3600;
/// Shortest wait before asking again, whatever `Retry-After` says: a CA
/// that answers 0 must not make us ask in a loop.
pub(crate) const ARI_MIN_SECS: u64 = 60;
/// Longest wait honoured: the window of a short-lived certificate (or an
/// early renewal asked before a revocation) must not go unseen for days.
pub(crate) const ARI_MAX_SECS: u64 = 24 * 3600;

/// When to ask the CA for renewal information again after an answer at
/// `now` that carried `retry_after_secs` (RFC 9773 section 4.3: not before
/// `Retry-After`), within [`ARI_MIN_SECS`]..=[`ARI_MAX_SECS`].
pub(crate) fn ari_next_check(now: u64, retry_after_secs: Option<u64>) -> u64 {
    let wait = retry_after_secs
        .unwrap_or(ARI_DEFAULT_SECS)
        .clamp(ARI_MIN_SECS, ARI_MAX_SECS);
    now.saturating_add(wait)
}

/// The CA's last renewal-information answer for one certificate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AriCheck {
    /// The certificate it is about (serial, lowercase hex).
    pub serial: String,
    /// The suggested window; `None` when the question failed.
    pub window: Option<AriWindow>,
    /// Not asked again before this time, unix seconds.
    pub next_check_unix: u64,
}

/// What the replicas share about ordering one certificate unit (stored at
/// [`crate::acme::layout::order_state`], changed by compare-and-swap): its
/// consecutive failures, so the backoff survives a restart and an
/// ownership change, and the CA's renewal information with its
/// `Retry-After`, so the next owner does not ask again at once.
#[derive(Default, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitOrderState {
    /// Failures since the last success.
    #[serde(default)]
    pub failures: Failures,
    /// The last renewal-information answer.
    #[serde(default)]
    pub ari: Option<AriCheck>,
}

impl UnitOrderState {
    /// `Err(t)` while the failures say not to order before `t`.
    pub(crate) fn backing_off(&self, now: u64) -> Result<(), u64> {
        let next = self.failures.next_attempt_unix();
        if self.failures.count > 0 && now < next {
            Err(next)
        } else {
            Ok(())
        }
    }

    /// The stored renewal information for `serial`, while it is fresh.
    pub(crate) fn fresh_ari(&self, serial: &str, now: u64) -> Option<&AriCheck> {
        self.ari
            .as_ref()
            .filter(|a| a.serial == serial && now < a.next_check_unix)
    }
}

/// Most certificates for the same set of hostnames in
/// [`DUPLICATE_WINDOW_SECS`] (Let's Encrypt: 5 per 7 days).
pub(crate) const DUPLICATE_LIMIT: usize = 5;
/// The sliding window of [`DUPLICATE_LIMIT`].
pub(crate) const DUPLICATE_WINDOW_SECS: u64 = 7 * 24 * 3600;

/// When certificates for one hostname set were issued (stored at
/// [`crate::acme::layout::issued`]), to stay under the CA's duplicate limit
/// whichever replica orders.
#[derive(Default, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IssuanceHistory {
    /// Issuance times, unix seconds, oldest first.
    pub issued_unix: Vec<u64>,
}

impl IssuanceHistory {
    /// `Ok` when one more issuance at `now` stays within the limit, else
    /// `Err(t)`: the earliest time it would (when enough of the issuances
    /// in the window have left it).
    pub(crate) fn allows(&self, now: u64) -> Result<(), u64> {
        let mut recent: Vec<u64> = self
            .issued_unix
            .iter()
            .copied()
            .filter(|t| t.saturating_add(DUPLICATE_WINDOW_SECS) > now)
            .collect();
        if recent.len() < DUPLICATE_LIMIT {
            return Ok(());
        }
        recent.sort_unstable();
        // One more is allowed once all but LIMIT - 1 of them have left.
        let must_leave = recent.len() - DUPLICATE_LIMIT;
        Err(recent[must_leave].saturating_add(DUPLICATE_WINDOW_SECS))
    }

    /// Records an issuance at `now` and drops those that left the window.
    pub(crate) fn record(&mut self, now: u64) {
        self.issued_unix.push(now);
        self.issued_unix
            .retain(|t| t.saturating_add(DUPLICATE_WINDOW_SECS) > now);
        self.issued_unix.sort_unstable();
    }
}

/// A cap on new orders per account: at most `max_orders` in each interval
/// of `interval_secs` (an interval starts with the first order after the
/// previous one ended). Stored at [`crate::acme::layout::order_budget`] so
/// the cap holds for the whole cluster. `max_orders = 0` refuses every
/// order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderBudget {
    /// Orders allowed per interval.
    pub max_orders: u32,
    /// Length of an interval, seconds.
    pub interval_secs: u64,
    /// Start of the current interval, unix seconds.
    pub window_start_unix: u64,
    /// Orders taken in the current interval.
    pub used: u32,
}

impl OrderBudget {
    /// A fresh budget (its first interval starts with its first order).
    pub(crate) fn new(max_orders: u32, interval_secs: u64) -> Self {
        Self {
            max_orders,
            interval_secs,
            window_start_unix: 0,
            used: 0,
        }
    }

    /// When the current interval ends.
    pub(crate) fn window_end_unix(&self) -> u64 {
        self.window_start_unix.saturating_add(self.interval_secs)
    }

    /// Takes one order at `now`: `Ok`, or `Err(t)` with the time the
    /// interval resets. A clock that went back stays in the current
    /// interval.
    pub(crate) fn try_take(&mut self, now: u64) -> Result<(), u64> {
        if now >= self.window_end_unix() {
            self.window_start_unix = now;
            self.used = 0;
        }
        if self.used < self.max_orders {
            self.used += 1;
            Ok(())
        } else {
            Err(self.window_end_unix())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T0: u64 = 1_750_000_000;

    fn cert(days: u64) -> CertTimes {
        CertTimes {
            not_before_unix: T0,
            not_after_unix: T0 + days * DAY,
        }
    }

    fn day_of(at: u64) -> f64 {
        (at - T0) as f64 / DAY as f64
    }

    #[test]
    fn lets_encrypt_90_days_renews_around_day_60() {
        let c = cert(90);
        assert_eq!(renew_at(c, None, None, 0.0), T0 + 60 * DAY);
        let latest_jitter = renew_at(c, None, None, 0.999_999);
        assert!(
            (57.0..60.0).contains(&day_of(latest_jitter)),
            "{}",
            day_of(latest_jitter)
        );
        // Not due on day 56, due on day 61.
        assert!(renew_at(c, None, None, 0.5) > T0 + 56 * DAY);
        assert_eq!(
            renew_delay_secs(renew_at(c, None, None, 0.5), T0 + 61 * DAY),
            0
        );
    }

    #[test]
    fn renew_before_days() {
        let c = cert(90);
        assert_eq!(renew_at(c, Some(30), None, 0.0), T0 + 60 * DAY);
        assert_eq!(renew_at(c, Some(10), None, 0.0), T0 + 80 * DAY);
        // Jitter: up to 10% of the 10-day margin earlier (1 day).
        let j = renew_at(c, Some(10), None, 0.999);
        assert!((T0 + 79 * DAY..T0 + 80 * DAY).contains(&j));
        // Zero days: renew at notAfter at the latest.
        assert_eq!(renew_at(c, Some(0), None, 0.0), c.not_after_unix);
    }

    #[test]
    fn short_lived_certificates() {
        let c = cert(6);
        // 1/3 of 6 days remaining: day 4.
        assert_eq!(renew_at(c, None, None, 0.0), T0 + 4 * DAY);
        // 30 days before the end of a 6-day certificate would renew at
        // issuance forever: the default rule applies.
        assert_eq!(renew_at(c, Some(30), None, 0.0), T0 + 4 * DAY);
        // 2 days (< half of 6) is honoured.
        assert_eq!(renew_at(c, Some(2), None, 0.0), T0 + 4 * DAY);
        assert_eq!(renew_at(c, Some(1), None, 0.0), T0 + 5 * DAY);
        // The manager is told when the setting is set aside (and warns).
        assert!(renew_before_ignored(c, Some(30)));
        assert!(renew_before_ignored(c, Some(3)));
        assert!(!renew_before_ignored(c, Some(2)));
        assert!(!renew_before_ignored(c, None));
        assert!(!renew_before_ignored(cert(90), Some(30)));
        assert!(renew_before_ignored(cert(90), Some(45)));
        // Degenerate: notAfter <= notBefore never renews before notBefore.
        let odd = CertTimes {
            not_before_unix: T0,
            not_after_unix: T0 - 10,
        };
        assert_eq!(renew_at(odd, None, None, 0.5), T0);
    }

    #[test]
    fn ari_window_wins() {
        let c = cert(90);
        let w = AriWindow {
            start_unix: T0 + 40 * DAY,
            end_unix: T0 + 42 * DAY,
        };
        assert_eq!(renew_at(c, Some(10), Some(w), 0.0), w.start_unix);
        assert_eq!(renew_at(c, None, Some(w), 0.5), T0 + 41 * DAY);
        // A window in the past (early renewal asked): due now.
        let past = AriWindow {
            start_unix: T0 - 2 * DAY,
            end_unix: T0 - DAY,
        };
        let at = renew_at(c, None, Some(past), 0.3);
        assert_eq!(at, T0);
        assert_eq!(renew_delay_secs(at, T0 + 5), 0);
        // A window past notAfter is capped at a tenth of the lifetime before it.
        let late = AriWindow {
            start_unix: T0 + 100 * DAY,
            end_unix: T0 + 101 * DAY,
        };
        assert_eq!(renew_at(c, None, Some(late), 0.0), T0 + 81 * DAY);
        // An inverted window is ignored.
        let bad = AriWindow {
            start_unix: T0 + 50 * DAY,
            end_unix: T0 + 49 * DAY,
        };
        assert_eq!(renew_at(c, None, Some(bad), 0.0), T0 + 60 * DAY);
    }

    #[test]
    fn odd_jitter_values_are_clamped() {
        let c = cert(90);
        for j in [f64::NAN, -1.0, f64::NEG_INFINITY] {
            assert_eq!(renew_at(c, None, None, j), T0 + 60 * DAY);
        }
        for j in [1.0, 7.0, f64::INFINITY] {
            let at = renew_at(c, None, None, j);
            assert!((T0 + 57 * DAY..=T0 + 60 * DAY).contains(&at));
        }
    }

    proptest! {
        #[test]
        fn jitter_stays_inside_bounds(
            nb in 0u64..4_000_000_000,
            life in 0u64..(400 * DAY),
            days in proptest::option::of(0u32..400),
            ari in proptest::option::of((0u64..4_000_000_000, 0u64..(10 * DAY))),
            jitter in 0.0f64..1.0,
        ) {
            let c = CertTimes { not_before_unix: nb, not_after_unix: nb + life };
            let ari = ari.map(|(s, len)| AriWindow { start_unix: s, end_unix: s + len });
            let at = renew_at(c, days, ari, jitter);
            prop_assert!(at >= c.not_before_unix);
            prop_assert!(at <= c.not_after_unix.max(c.not_before_unix));
            match ari {
                Some(w) => {
                    let cap = c.not_after_unix - life / 10;
                    prop_assert!(at <= w.end_unix.max(c.not_before_unix));
                    prop_assert!(at >= w.start_unix.min(cap).max(c.not_before_unix));
                }
                None => {
                    let margin = days.map(|d| u64::from(d) * DAY).filter(|m| *m < life / 2).unwrap_or(life / 3);
                    let latest = c.not_after_unix - margin;
                    let earliest = latest.saturating_sub(margin / 10 + 1);
                    prop_assert!(at <= latest.max(c.not_before_unix));
                    prop_assert!(at >= earliest.max(c.not_before_unix));
                }
            }
        }
    }

    #[test]
    fn backoff_doubles_to_six_hours() {
        let mut f = Failures::default();
        assert_eq!(f.next_attempt_unix(), 0);
        let mut seen = Vec::new();
        let mut now = T0;
        for _ in 0..12 {
            f.record(now, None);
            seen.push(f.next_attempt_unix() - now);
            now += 1;
        }
        assert_eq!(
            seen,
            [
                60, 120, 240, 480, 960, 1920, 3840, 7680, 15360, 21600, 21600, 21600
            ]
        );
        f.count = u32::MAX - 1;
        f.record(now, None);
        f.record(now, None);
        assert_eq!(f.count, u32::MAX);
        assert_eq!(f.next_attempt_unix(), now + 21600);
        f.clear();
        assert_eq!(f, Failures::default());
        assert_eq!(f.next_attempt_unix(), 0);
    }

    #[test]
    fn retry_after_is_honoured() {
        let mut f = Failures::default();
        // Retry-After beyond the 60 s backoff wins.
        f.record(T0, Some(3600));
        assert_eq!(f.next_attempt_unix(), T0 + 3600);
        // Shorter than the backoff: the backoff wins.
        f.record(T0 + 10, Some(5));
        assert_eq!(f.next_attempt_unix(), T0 + 10 + 120);
        // A new failure without Retry-After forgets the old one.
        f.record(T0 + 20, None);
        assert_eq!(f.next_attempt_unix(), T0 + 20 + 240);
        // Absurd values are capped at 7 days.
        f.record(T0, Some(u64::MAX));
        assert_eq!(f.next_attempt_unix(), T0 + RETRY_AFTER_MAX_SECS);
        // Serde round trip (kept in the store).
        let json = serde_json::to_string(&f).unwrap();
        assert_eq!(serde_json::from_str::<Failures>(&json).unwrap(), f);
    }

    #[test]
    fn sixth_duplicate_in_seven_days_waits_for_the_oldest() {
        let mut h = IssuanceHistory::default();
        let times = [T0, T0 + DAY, T0 + 2 * DAY, T0 + 3 * DAY, T0 + 4 * DAY];
        for t in times {
            assert_eq!(h.allows(t), Ok(()));
            h.record(t);
        }
        let now = T0 + 5 * DAY;
        assert_eq!(h.allows(now), Err(T0 + DUPLICATE_WINDOW_SECS));
        assert_eq!(
            h.allows(T0 + DUPLICATE_WINDOW_SECS - 1),
            Err(T0 + DUPLICATE_WINDOW_SECS)
        );
        assert_eq!(h.allows(T0 + DUPLICATE_WINDOW_SECS), Ok(()));
        h.record(T0 + DUPLICATE_WINDOW_SECS);
        // The oldest left the window when recording.
        assert_eq!(h.issued_unix.len(), 5);
        assert_eq!(h.issued_unix[0], T0 + DAY);
        assert_eq!(
            h.allows(T0 + DUPLICATE_WINDOW_SECS),
            Err(T0 + DAY + DUPLICATE_WINDOW_SECS)
        );
    }

    #[test]
    fn duplicate_guard_with_more_than_the_limit_recorded() {
        // Written by replicas racing (or by hand): 7 in the window.
        let h = IssuanceHistory {
            issued_unix: vec![T0 + 6, T0, T0 + 1, T0 + 2, T0 + 3, T0 + 4, T0 + 5],
        };
        // 7 recent: 3 must leave (T0, T0+1, T0+2) before one more fits.
        assert_eq!(h.allows(T0 + 10), Err(T0 + 2 + DUPLICATE_WINDOW_SECS));
        // Issuances in the future (clock skew between replicas) count too.
        let skew = IssuanceHistory {
            issued_unix: vec![T0 + 100; 5],
        };
        assert!(skew.allows(T0).is_err());
    }

    #[test]
    fn shared_state_backs_off_and_keeps_fresh_renewal_information() {
        let mut state = UnitOrderState::default();
        assert_eq!(state.backing_off(T0), Ok(()));
        state.failures.record(T0, None);
        assert_eq!(state.backing_off(T0 + 59), Err(T0 + 60));
        assert_eq!(state.backing_off(T0 + 60), Ok(()));
        state.ari = Some(AriCheck {
            serial: "0a".into(),
            window: None,
            next_check_unix: T0 + 100,
        });
        assert!(state.fresh_ari("0a", T0 + 99).is_some());
        assert!(state.fresh_ari("0a", T0 + 100).is_none());
        assert!(state.fresh_ari("0b", T0).is_none());
        // Old records (without the fields) read as empty.
        let old: UnitOrderState = serde_json::from_str("{}").unwrap();
        assert_eq!(old, UnitOrderState::default());
        let json = serde_json::to_string(&state).unwrap();
        assert_eq!(
            serde_json::from_str::<UnitOrderState>(&json).unwrap(),
            state
        );
    }

    #[test]
    fn renewal_information_is_asked_again_after_retry_after() {
        assert_eq!(ari_next_check(T0, Some(3600)), T0 + 3600);
        assert_eq!(ari_next_check(T0, None), T0 + ARI_DEFAULT_SECS);
        // A CA answering 0 is not asked in a loop; a huge value is capped.
        assert_eq!(ari_next_check(T0, Some(0)), T0 + ARI_MIN_SECS);
        assert_eq!(ari_next_check(T0, Some(u64::MAX)), T0 + ARI_MAX_SECS);
    }

    #[test]
    fn budget_resets_per_interval() {
        let mut b = OrderBudget::new(3, 3600);
        for i in 0..3 {
            assert_eq!(b.try_take(T0 + i), Ok(()));
        }
        assert_eq!(b.try_take(T0 + 10), Err(T0 + 3600));
        assert_eq!(b.try_take(T0 + 3599), Err(T0 + 3600));
        // Clock back: still the same interval.
        assert_eq!(b.try_take(T0 - 100), Err(T0 + 3600));
        assert_eq!(b.try_take(T0 + 3600), Ok(()));
        assert_eq!(b.window_start_unix, T0 + 3600);
        assert_eq!(b.used, 1);
        let mut none = OrderBudget::new(0, 60);
        assert_eq!(none.try_take(T0), Err(T0 + 60));
        let json = serde_json::to_string(&b).unwrap();
        assert_eq!(serde_json::from_str::<OrderBudget>(&json).unwrap(), b);
    }
}
