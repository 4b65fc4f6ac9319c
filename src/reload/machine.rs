//! The reload state machine: which content to POST, when, and what a result
//! means. Pure and clock-injected: every input carries `now`, the outputs say
//! what to do, and the async shell ([`super::Reloader`]) only moves bytes and
//! time.
//!
//! Rules (docs/reference.md#hot-reload):
//! - at most one POST in flight; content seen meanwhile collapses into one
//!   more POST of the newest content once the in-flight one finishes;
//! - content whose sha256 equals the last delivered one is not POSTed again
//!   (unless a certificate change forces one more reload);
//! - invalid content is never POSTed and leaves the delivered hash as it was;
//! - `200` delivered; `409` retry after [`BUSY_RETRY`]; `400` refused, no
//!   retry until the content changes; anything else retries with an
//!   exponential backoff from [`BACKOFF_START`] up to [`BACKOFF_MAX`];
//! - every certificate change reloads, refused content or not: the proxy
//!   is asked once more (it may have been fixed meanwhile, and a proxy that
//!   re-reads its certificates on reload needs that POST to serve them).

use std::time::{Duration, Instant};

/// Retry delay after a `409` (the proxy is busy reloading).
pub(crate) const BUSY_RETRY: Duration = Duration::from_millis(500);
/// First retry delay after a failed POST.
pub(crate) const BACKOFF_START: Duration = Duration::from_millis(500);
/// Largest retry delay after repeated failures.
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// How the proxy answered a reload POST.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum PostOutcome {
    /// `200`: the proxy now runs the content.
    Delivered,
    /// `409`: a reload is already running in the proxy.
    Busy,
    /// `400`: the proxy refused this content.
    Refused,
    /// Any other status (`Some`), or no answer at all (`None`: connection
    /// error or timeout).
    Failed {
        /// The HTTP status, when there was one.
        status: Option<u16>,
    },
}

/// An input of the machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Input {
    /// The config file was read (after the debounce) and validated.
    ContentSeen {
        /// Lowercase hex sha256 of the raw file bytes.
        sha256: String,
        /// Whether the content passed validation.
        valid: bool,
    },
    /// The in-flight POST finished.
    PostResult(PostOutcome),
    /// Certificates changed: reload the current content once more.
    CertificatesChanged,
    /// Time passed (a [`Action::WaitUntil`] deadline was reached).
    Tick,
}

/// Something a step reports, for metrics and status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Report {
    /// The proxy accepted a POST of this content.
    Delivered {
        /// Lowercase hex sha256 of the delivered content.
        sha256: String,
    },
    /// The POST failed (`409`, another status or no answer); it will be
    /// retried.
    Failed,
    /// The proxy refused the content (`400`); not retried until it changes.
    Refused,
    /// New content failed validation; it is not POSTed.
    Invalid,
}

/// What the shell must do after a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Record this outcome (metrics, status).
    Report(Report),
    /// Start a POST; feed its outcome back as [`Input::PostResult`].
    Post {
        /// Lowercase hex sha256 of the content being delivered.
        sha256: String,
    },
    /// Feed [`Input::Tick`] at this instant (a retry is due then). A step
    /// without this action means no timer is needed.
    WaitUntil(Instant),
}

/// The reload state machine. See the module documentation for the rules.
#[derive(Clone, Debug)]
pub(crate) struct Machine {
    /// The content the proxy is known to run.
    delivered: Option<String>,
    /// The content being POSTed, and whether that POST was forced.
    in_flight: Option<(String, bool)>,
    /// The newest content seen, and whether it was valid.
    current: Option<(String, bool)>,
    /// Content the proxy refused with `400`.
    refused: Option<String>,
    /// One more POST is owed even if the content is delivered already.
    forced: bool,
    /// No POST before this instant.
    retry_at: Option<Instant>,
    /// Delay after the next failure.
    backoff: Duration,
}

impl Machine {
    /// A machine whose proxy is known to run `delivered` (lowercase hex
    /// sha256), or nothing known when `None` (the first valid content seen
    /// is then POSTed).
    pub(crate) fn new(delivered: Option<String>) -> Self {
        Self {
            delivered,
            in_flight: None,
            current: None,
            refused: None,
            forced: false,
            retry_at: None,
            backoff: BACKOFF_START,
        }
    }

    /// The content the proxy is known to run.
    #[cfg(test)]
    pub(crate) fn delivered(&self) -> Option<&str> {
        self.delivered.as_deref()
    }

    /// The content being POSTed right now.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> Option<&str> {
        self.in_flight.as_ref().map(|(sha, _)| sha.as_str())
    }

    /// The content refused by the proxy (`400`), when it is still current.
    #[cfg(test)]
    pub(crate) fn refused(&self) -> Option<&str> {
        self.refused.as_deref()
    }

    /// Feeds one input at `now`; returns what to do, reports first, then at
    /// most one of [`Action::Post`] or [`Action::WaitUntil`].
    pub(crate) fn step(&mut self, input: Input, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        match input {
            Input::ContentSeen { sha256, valid } => {
                let same = self
                    .current
                    .as_ref()
                    .is_some_and(|(sha, ok)| *sha == sha256 && *ok == valid);
                if !same {
                    if self.refused.as_deref() != Some(sha256.as_str()) {
                        self.refused = None;
                    }
                    if !valid {
                        actions.push(Action::Report(Report::Invalid));
                    }
                    self.current = Some((sha256, valid));
                }
            }
            Input::PostResult(outcome) => {
                // A result without a POST in flight is stale: ignore it.
                if let Some((sha, forced)) = self.in_flight.take() {
                    actions.push(Action::Report(self.on_result(sha, forced, outcome, now)));
                }
            }
            Input::CertificatesChanged => self.forced = true,
            Input::Tick => {}
        }
        if let Some(next) = self.poll(now) {
            actions.push(next);
        }
        actions
    }

    fn on_result(
        &mut self,
        sha: String,
        forced: bool,
        outcome: PostOutcome,
        now: Instant,
    ) -> Report {
        match outcome {
            PostOutcome::Delivered => {
                self.backoff = BACKOFF_START;
                self.retry_at = None;
                self.delivered = Some(sha.clone());
                Report::Delivered { sha256: sha }
            }
            PostOutcome::Refused => {
                self.backoff = BACKOFF_START;
                self.retry_at = None;
                // Only remember the refusal while that content is current:
                // newer content already replaced it otherwise.
                if self.current.as_ref().is_some_and(|(cur, _)| *cur == sha) {
                    self.refused = Some(sha);
                }
                Report::Refused
            }
            PostOutcome::Busy => {
                self.forced |= forced;
                self.retry_at = Some(now + BUSY_RETRY);
                Report::Failed
            }
            PostOutcome::Failed { .. } => {
                self.forced |= forced;
                self.retry_at = Some(now + self.backoff);
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                Report::Failed
            }
        }
    }

    /// What to do next, given the state.
    fn poll(&mut self, now: Instant) -> Option<Action> {
        if self.in_flight.is_some() {
            return None;
        }
        let (sha, valid) = self.current.as_ref()?;
        if !valid || (self.refused.as_ref() == Some(sha) && !self.forced) {
            return None;
        }
        if self.delivered.as_ref() == Some(sha) && !self.forced {
            return None;
        }
        if let Some(at) = self.retry_at {
            if at > now {
                return Some(Action::WaitUntil(at));
            }
            self.retry_at = None;
        }
        let sha = sha.clone();
        self.in_flight = Some((sha.clone(), self.forced));
        self.forced = false;
        Some(Action::Post { sha256: sha })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn seen(sha: &str) -> Input {
        Input::ContentSeen {
            sha256: sha.into(),
            valid: true,
        }
    }

    fn invalid(sha: &str) -> Input {
        Input::ContentSeen {
            sha256: sha.into(),
            valid: false,
        }
    }

    fn post(sha: &str) -> Action {
        Action::Post { sha256: sha.into() }
    }

    fn delivered(sha: &str) -> Action {
        Action::Report(Report::Delivered { sha256: sha.into() })
    }

    fn ok() -> Input {
        Input::PostResult(PostOutcome::Delivered)
    }

    fn failed(status: Option<u16>) -> Input {
        Input::PostResult(PostOutcome::Failed { status })
    }

    #[test]
    fn first_content_is_posted_and_delivered() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        assert_eq!(m.step(seen("a"), t0), vec![post("a")]);
        assert_eq!(m.in_flight(), Some("a"));
        assert_eq!(m.step(ok(), t0), vec![delivered("a")]);
        assert_eq!(m.delivered(), Some("a"));
        assert_eq!(m.in_flight(), None);
    }

    #[test]
    fn known_delivered_content_is_not_posted() {
        let t0 = Instant::now();
        let mut m = Machine::new(Some("a".into()));
        assert!(m.step(seen("a"), t0).is_empty());
        assert!(m.step(seen("a"), t0 + ms(30_000)).is_empty());
        assert!(m.step(Input::Tick, t0 + ms(60_000)).is_empty());
    }

    #[test]
    fn unchanged_content_is_never_posted_twice() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        assert_eq!(m.step(seen("a"), t0), vec![post("a")]);
        // Seen again while in flight (a rescan): nothing more.
        assert!(m.step(seen("a"), t0).is_empty());
        assert_eq!(m.step(ok(), t0), vec![delivered("a")]);
        assert!(m.step(seen("a"), t0 + ms(1)).is_empty());
    }

    #[test]
    fn changes_during_a_post_collapse_into_one_post_of_the_newest() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        assert_eq!(m.step(seen("a"), t0), vec![post("a")]);
        for sha in ["b", "c", "d"] {
            assert!(m.step(seen(sha), t0).is_empty(), "no second POST in flight");
        }
        assert_eq!(m.step(ok(), t0), vec![delivered("a"), post("d")]);
        assert_eq!(m.step(ok(), t0), vec![delivered("d")]);
        assert!(m.step(Input::Tick, t0).is_empty());
    }

    #[test]
    fn change_back_to_delivered_content_during_post_reposts() {
        // a delivered, b in flight, file back to a: the proxy ends up on b
        // unless a is POSTed again.
        let t0 = Instant::now();
        let mut m = Machine::new(Some("a".into()));
        assert_eq!(m.step(seen("b"), t0), vec![post("b")]);
        assert!(m.step(seen("a"), t0).is_empty());
        assert_eq!(m.step(ok(), t0), vec![delivered("b"), post("a")]);
    }

    #[test]
    fn invalid_content_is_never_posted_and_keeps_delivered() {
        let t0 = Instant::now();
        let mut m = Machine::new(Some("a".into()));
        assert_eq!(
            m.step(invalid("x"), t0),
            vec![Action::Report(Report::Invalid)]
        );
        assert_eq!(m.delivered(), Some("a"));
        // The same invalid content again (rescan) is not reported twice.
        assert!(m.step(invalid("x"), t0).is_empty());
        assert_eq!(m.step(seen("b"), t0), vec![post("b")]);
    }

    #[test]
    fn invalid_content_during_a_post_cancels_the_follow_up() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        assert_eq!(m.step(seen("a"), t0), vec![post("a")]);
        assert!(m.step(seen("b"), t0).is_empty());
        assert_eq!(
            m.step(invalid("x"), t0),
            vec![Action::Report(Report::Invalid)]
        );
        // The file is now invalid: no follow-up POST, and no retry either.
        assert_eq!(m.step(ok(), t0), vec![delivered("a")]);
        assert_eq!(
            m.step(failed(None), t0),
            vec![],
            "stale result without a POST in flight is ignored"
        );
    }

    #[test]
    fn failed_post_with_invalid_content_now_is_not_retried() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        assert_eq!(m.step(seen("a"), t0), vec![post("a")]);
        m.step(invalid("x"), t0);
        assert_eq!(
            m.step(failed(Some(500)), t0),
            vec![Action::Report(Report::Failed)]
        );
        assert!(m.step(Input::Tick, t0 + ms(60_000)).is_empty());
    }

    #[test]
    fn busy_retries_after_500_ms() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        m.step(seen("a"), t0);
        assert_eq!(
            m.step(Input::PostResult(PostOutcome::Busy), t0),
            vec![
                Action::Report(Report::Failed),
                Action::WaitUntil(t0 + ms(500))
            ]
        );
        assert_eq!(
            m.step(Input::Tick, t0 + ms(499)),
            vec![Action::WaitUntil(t0 + ms(500))]
        );
        assert_eq!(m.step(Input::Tick, t0 + ms(500)), vec![post("a")]);
        // 409 does not grow the backoff.
        assert_eq!(
            m.step(Input::PostResult(PostOutcome::Busy), t0 + ms(500)),
            vec![
                Action::Report(Report::Failed),
                Action::WaitUntil(t0 + ms(1000))
            ]
        );
    }

    #[test]
    fn failures_back_off_exponentially_up_to_30_s_and_reset_on_success() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        m.step(seen("a"), t0);
        let mut now = t0;
        let mut delays = Vec::new();
        for _ in 0..10 {
            let actions = m.step(failed(Some(503)), now);
            let Some(Action::WaitUntil(at)) = actions.last().cloned() else {
                panic!("expected a wait, got {actions:?}");
            };
            delays.push((at - now).as_millis());
            now = at;
            assert_eq!(m.step(Input::Tick, now), vec![post("a")]);
        }
        assert_eq!(
            delays,
            vec![
                500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000, 30000
            ]
        );
        assert_eq!(m.step(ok(), now), vec![delivered("a")]);
        m.step(seen("b"), now);
        let actions = m.step(failed(None), now);
        assert_eq!(actions.last(), Some(&Action::WaitUntil(now + ms(500))));
    }

    #[test]
    fn new_content_waits_for_a_scheduled_retry() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        m.step(seen("a"), t0);
        m.step(failed(None), t0);
        assert_eq!(
            m.step(seen("b"), t0 + ms(100)),
            vec![Action::WaitUntil(t0 + ms(500))]
        );
        assert_eq!(m.step(Input::Tick, t0 + ms(500)), vec![post("b")]);
    }

    #[test]
    fn refused_content_is_not_retried_until_it_changes() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        m.step(seen("a"), t0);
        assert_eq!(
            m.step(Input::PostResult(PostOutcome::Refused), t0),
            vec![Action::Report(Report::Refused)]
        );
        assert_eq!(m.refused(), Some("a"));
        assert!(m.step(seen("a"), t0 + ms(30_000)).is_empty());
        assert!(m.step(Input::Tick, t0 + ms(60_000)).is_empty());
        assert_eq!(m.step(seen("b"), t0 + ms(60_001)), vec![post("b")]);
        assert_eq!(m.refused(), None);
        assert_eq!(m.step(ok(), t0 + ms(60_002)), vec![delivered("b")]);
        assert!(m.step(Input::Tick, t0 + ms(60_003)).is_empty());
    }

    #[test]
    fn certificate_change_reloads_while_the_content_is_refused() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        m.step(seen("a"), t0);
        m.step(Input::PostResult(PostOutcome::Refused), t0);
        assert_eq!(m.refused(), Some("a"));
        // docs/reference.md#hot-reload: every certificate change reloads; exactly one POST.
        assert_eq!(
            m.step(Input::CertificatesChanged, t0 + ms(1_000)),
            vec![post("a")]
        );
        assert!(
            m.step(Input::CertificatesChanged, t0 + ms(1_001))
                .is_empty()
        );
        assert_eq!(
            m.step(Input::PostResult(PostOutcome::Refused), t0 + ms(1_002)),
            vec![
                Action::Report(Report::Refused),
                // The second change came while the first POST was in flight.
                post("a")
            ]
        );
        assert_eq!(
            m.step(Input::PostResult(PostOutcome::Refused), t0 + ms(1_003)),
            vec![Action::Report(Report::Refused)]
        );
        // Refused again: config-only events still do not retry it.
        assert!(m.step(seen("a"), t0 + ms(30_000)).is_empty());
        assert!(m.step(Input::Tick, t0 + ms(60_000)).is_empty());
        // A later certificate change that the proxy accepts delivers it.
        assert_eq!(
            m.step(Input::CertificatesChanged, t0 + ms(61_000)),
            vec![post("a")]
        );
        assert_eq!(m.step(ok(), t0 + ms(61_001)), vec![delivered("a")]);
        assert!(m.step(Input::Tick, t0 + ms(61_002)).is_empty());
    }

    #[test]
    fn refusal_of_superseded_content_does_not_block_the_newest() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        m.step(seen("a"), t0);
        m.step(seen("b"), t0);
        assert_eq!(
            m.step(Input::PostResult(PostOutcome::Refused), t0),
            vec![Action::Report(Report::Refused), post("b")]
        );
    }

    #[test]
    fn content_changing_back_to_refused_content_is_posted_again() {
        let t0 = Instant::now();
        let mut m = Machine::new(Some("z".into()));
        m.step(seen("a"), t0);
        m.step(Input::PostResult(PostOutcome::Refused), t0);
        assert!(
            m.step(invalid("x"), t0)
                .contains(&Action::Report(Report::Invalid))
        );
        assert_eq!(m.step(seen("a"), t0), vec![post("a")]);
    }

    #[test]
    fn certificates_changed_forces_one_more_post_of_delivered_content() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        m.step(seen("a"), t0);
        m.step(ok(), t0);
        assert_eq!(m.step(Input::CertificatesChanged, t0), vec![post("a")]);
        // More certificate changes while in flight collapse into one.
        assert!(m.step(Input::CertificatesChanged, t0).is_empty());
        assert!(m.step(Input::CertificatesChanged, t0).is_empty());
        assert_eq!(m.step(ok(), t0), vec![delivered("a"), post("a")]);
        assert_eq!(m.step(ok(), t0), vec![delivered("a")]);
        assert!(m.step(Input::Tick, t0).is_empty());
    }

    #[test]
    fn forced_post_that_fails_is_retried() {
        let t0 = Instant::now();
        let mut m = Machine::new(Some("a".into()));
        m.step(seen("a"), t0);
        assert_eq!(m.step(Input::CertificatesChanged, t0), vec![post("a")]);
        assert_eq!(
            m.step(failed(None), t0),
            vec![
                Action::Report(Report::Failed),
                Action::WaitUntil(t0 + ms(500))
            ]
        );
        assert_eq!(m.step(Input::Tick, t0 + ms(500)), vec![post("a")]);
        assert_eq!(m.step(ok(), t0 + ms(501)), vec![delivered("a")]);
        assert!(m.step(Input::Tick, t0 + ms(2000)).is_empty());
    }

    #[test]
    fn certificates_changed_before_any_content_waits_for_content() {
        let t0 = Instant::now();
        let mut m = Machine::new(Some("a".into()));
        assert!(m.step(Input::CertificatesChanged, t0).is_empty());
        assert_eq!(m.step(seen("a"), t0), vec![post("a")]);
    }

    #[test]
    fn certificates_changed_with_invalid_content_waits_for_valid_content() {
        let t0 = Instant::now();
        let mut m = Machine::new(Some("a".into()));
        m.step(invalid("x"), t0);
        assert!(m.step(Input::CertificatesChanged, t0).is_empty());
        assert_eq!(m.step(seen("a"), t0), vec![post("a")]);
    }

    #[test]
    fn stale_result_is_ignored() {
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        assert!(m.step(ok(), t0).is_empty());
        assert_eq!(m.delivered(), None);
    }

    #[test]
    fn never_two_posts_in_flight_under_random_inputs() {
        // A small deterministic pseudo-random walk over every input kind.
        let t0 = Instant::now();
        let mut m = Machine::new(None);
        let mut in_flight = false;
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut now = t0;
        for _ in 0..10_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            now += ms(seed % 300);
            let input = match seed % 9 {
                0..=2 => seen(["a", "b", "c"][(seed >> 8) as usize % 3]),
                3 => invalid("x"),
                4 => Input::CertificatesChanged,
                5 => Input::Tick,
                _ if in_flight => Input::PostResult(match (seed >> 8) % 4 {
                    0 => PostOutcome::Delivered,
                    1 => PostOutcome::Busy,
                    2 => PostOutcome::Refused,
                    _ => PostOutcome::Failed { status: None },
                }),
                _ => Input::Tick,
            };
            if matches!(input, Input::PostResult(_)) {
                in_flight = false;
            }
            for action in m.step(input, now) {
                match action {
                    Action::Post { sha256 } => {
                        assert!(!in_flight, "second POST while one is in flight");
                        assert_ne!(sha256, "x", "invalid content POSTed");
                        in_flight = true;
                    }
                    Action::WaitUntil(at) => assert!(at > now),
                    Action::Report(_) => {}
                }
            }
        }
    }
}
