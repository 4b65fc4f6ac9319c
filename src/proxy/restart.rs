//! The decisions of `apply: restart` (docs/reference.md#certificate-files), without I/O: when a
//! restart is due, what to do next, and when a restarted proxy counts as
//! back. The shell ([`super::coordinator`]) performs each [`Step`] and
//! reports its outcome; time is passed in (unix milliseconds).
//!
//! One restart goes: take the fleet lease, SIGTERM the proxy, probe its
//! health until it answers 200 *after* it was seen down or the signalled
//! process is gone (a proxy that restarts between two probes is never seen
//! down, and one still draining answers 200 before it goes), release the
//! lease. At most one restart starts per `min_interval`: a request inside
//! that window waits for its end, and any number of requests meanwhile
//! collapse into that one restart (finding no process to signal is not a
//! restart: tried again after a minute). A proxy that is not back within
//! `give_up_after` is reported (the problem string) and the lease released;
//! its health keeps being probed, and the problem clears when it answers.

use std::time::Duration;

/// What the shell should do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Nothing until [`RestartCore::request`].
    Idle,
    /// Nothing before this time (unix ms), or a new request.
    WaitUntil(u64),
    /// Take the fleet lease; report [`RestartCore::lease_acquired`], or
    /// [`RestartCore::lease_failed`] on a store error (a lease still busy
    /// is no outcome: ask [`RestartCore::next`] again).
    AcquireLease,
    /// Signal the proxy; report [`RestartCore::signalled`].
    Signal,
    /// Probe the proxy's health (after the probe interval); report
    /// [`RestartCore::probed`].
    Probe,
    /// Release the lease; report [`RestartCore::released`].
    ReleaseLease,
}

/// What signalling found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SignalOutcome {
    /// At least one process got SIGTERM.
    Signalled,
    /// No process was signalled; the message says why (for status).
    NotSignalled(String),
    /// No restart is needed: every proxy process running started after
    /// the files were written (it read them at its start), or none runs
    /// yet and it will. The message says which (for the log).
    NotNeeded(String),
}

/// One health probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Probe {
    /// The health URL answered 200.
    pub healthy: bool,
    /// None of the signalled processes is running any more.
    pub signalled_gone: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Phase {
    /// No restart in progress.
    Idle,
    /// Waiting for the fleet lease.
    Acquiring,
    /// Holding the lease, about to signal.
    Holding,
    /// Signalled at `since`, waiting for the proxy to be back.
    Waiting { since: u64, seen_down: bool },
    /// Done (back, gave up, or nothing signalled): release the lease.
    Releasing { then_recover: bool },
    /// Gave up waiting; the lease is released, health still probed so the
    /// problem clears once the proxy answers.
    Recovering,
}

/// The restart state machine of one pod.
#[derive(Clone, Debug)]
pub(crate) struct RestartCore {
    min_interval_ms: u64,
    give_up_after_ms: u64,
    retry_after_ms: u64,
    health_url: String,
    phase: Phase,
    wanted: bool,
    /// The last attempt (signal or failure to signal): the window start.
    last_attempt: Option<u64>,
    /// No lease attempt before this (after a store error).
    retry_at: u64,
    restarts: u64,
    last_restart: Option<u64>,
    problem: Option<String>,
}

/// How long after a store error the lease is tried again.
pub(crate) const LEASE_RETRY_AFTER: Duration = Duration::from_secs(5);

/// How long after finding nothing to signal the next attempt is made.
pub(crate) const NOT_SIGNALLED_RETRY_AFTER: Duration = Duration::from_secs(60);

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl RestartCore {
    /// A core allowing one restart per `min_interval`, giving up on a proxy
    /// not back within `give_up_after`; `health_url` only names the URL in
    /// the problem string.
    pub(crate) fn new(min_interval: Duration, give_up_after: Duration, health_url: &str) -> Self {
        Self {
            min_interval_ms: ms(min_interval),
            give_up_after_ms: ms(give_up_after),
            retry_after_ms: ms(LEASE_RETRY_AFTER),
            health_url: health_url.to_owned(),
            phase: Phase::Idle,
            wanted: false,
            last_attempt: None,
            retry_at: 0,
            restarts: 0,
            last_restart: None,
            problem: None,
        }
    }

    /// New certificate files were written: a restart is wanted.
    pub(crate) fn request(&mut self) {
        self.wanted = true;
    }

    /// Whether a requested restart has not started yet.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> bool {
        self.wanted
    }

    /// Restarts signalled so far.
    pub(crate) fn restarts(&self) -> u64 {
        self.restarts
    }

    /// When the last restart was signalled (unix ms).
    pub(crate) fn last_restart_unix_ms(&self) -> Option<u64> {
        self.last_restart
    }

    /// Why the proxy is not known to be fine, if it is not.
    pub(crate) fn problem(&self) -> Option<&str> {
        self.problem.as_deref()
    }

    /// Whether the shell should hold the lease now (for its bookkeeping).
    #[cfg(test)]
    pub(crate) fn holds_lease(&self) -> bool {
        matches!(
            self.phase,
            Phase::Holding | Phase::Waiting { .. } | Phase::Releasing { .. }
        )
    }

    /// The earliest time a new restart may start.
    fn window_end(&self) -> u64 {
        let window = self
            .last_attempt
            .map_or(0, |at| at.saturating_add(self.min_interval_ms));
        window.max(self.retry_at)
    }

    /// What to do at `now`.
    pub(crate) fn next(&mut self, now: u64) -> Step {
        match &self.phase {
            Phase::Idle | Phase::Recovering => {
                let recovering = self.phase == Phase::Recovering;
                if !self.wanted {
                    return if recovering { Step::Probe } else { Step::Idle };
                }
                let start = self.window_end();
                if now < start {
                    return if recovering {
                        Step::Probe
                    } else {
                        Step::WaitUntil(start)
                    };
                }
                self.phase = Phase::Acquiring;
                Step::AcquireLease
            }
            Phase::Acquiring => Step::AcquireLease,
            Phase::Holding => Step::Signal,
            Phase::Waiting { since, .. } => {
                if now.saturating_sub(*since) >= self.give_up_after_ms {
                    self.problem = Some(format!(
                        "proxy did not answer 200 at {} within {} s of its restart; \
                         the restart lease was released",
                        self.health_url,
                        self.give_up_after_ms / 1000
                    ));
                    self.phase = Phase::Releasing { then_recover: true };
                    return Step::ReleaseLease;
                }
                Step::Probe
            }
            Phase::Releasing { .. } => Step::ReleaseLease,
        }
    }

    /// The lease was taken.
    pub(crate) fn lease_acquired(&mut self) {
        if self.phase == Phase::Acquiring {
            self.phase = Phase::Holding;
        }
    }

    /// Before the lease: no restart is needed after all (the proxy read the
    /// new files, or will at its start). Nothing waited for, no window
    /// spent, no problem.
    pub(crate) fn not_needed(&mut self) {
        if self.phase == Phase::Acquiring {
            self.wanted = false;
            self.problem = None;
            self.phase = Phase::Idle;
        }
    }

    /// Taking the lease failed (store error): try again after a pause.
    pub(crate) fn lease_failed(&mut self, now: u64) {
        if self.phase == Phase::Acquiring {
            self.retry_at = now.saturating_add(self.retry_after_ms);
            self.phase = Phase::Idle;
        }
    }

    /// The outcome of signalling at `now`. Requests up to this point are
    /// served by this restart (the files were written before the signal).
    pub(crate) fn signalled(&mut self, now: u64, outcome: SignalOutcome) {
        if self.phase != Phase::Holding {
            return;
        }
        match outcome {
            SignalOutcome::Signalled => {
                self.last_attempt = Some(now);
                self.wanted = false;
                self.restarts += 1;
                self.last_restart = Some(now);
                self.phase = Phase::Waiting {
                    since: now,
                    seen_down: false,
                };
            }
            SignalOutcome::NotNeeded(_) => {
                // Not a restart: nothing to wait for, no window spent.
                self.wanted = false;
                self.problem = None;
                self.phase = Phase::Releasing {
                    then_recover: false,
                };
            }
            SignalOutcome::NotSignalled(why) => {
                // Not a restart: still wanted, tried again in a minute (the
                // proxy may be between two runs), without a log storm.
                self.retry_at = now.saturating_add(ms(NOT_SIGNALLED_RETRY_AFTER));
                self.problem = Some(why);
                self.phase = Phase::Releasing {
                    then_recover: false,
                };
            }
        }
    }

    /// A health probe's result.
    pub(crate) fn probed(&mut self, probe: Probe) {
        match &mut self.phase {
            Phase::Waiting { seen_down, .. } => {
                if !probe.healthy {
                    *seen_down = true;
                } else if *seen_down || probe.signalled_gone {
                    self.problem = None;
                    self.phase = Phase::Releasing {
                        then_recover: false,
                    };
                }
            }
            Phase::Recovering if probe.healthy => {
                self.problem = None;
                self.phase = Phase::Idle;
            }
            _ => {}
        }
    }

    /// The lease was released (or releasing failed: it expires by itself).
    pub(crate) fn released(&mut self) {
        if let Phase::Releasing { then_recover } = self.phase {
            self.phase = if then_recover {
                Phase::Recovering
            } else {
                Phase::Idle
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: u64 = 600_000;
    const GIVE_UP: u64 = 300_000;

    fn core() -> RestartCore {
        RestartCore::new(
            Duration::from_millis(MIN),
            Duration::from_millis(GIVE_UP),
            "http://127.0.0.1:9090/health",
        )
    }

    const DOWN: Probe = Probe {
        healthy: false,
        signalled_gone: false,
    };
    const UP_SAME: Probe = Probe {
        healthy: true,
        signalled_gone: false,
    };
    const UP_NEW: Probe = Probe {
        healthy: true,
        signalled_gone: true,
    };

    /// Drives one restart from a request to the signal at `now`.
    fn signal_at(c: &mut RestartCore, now: u64) {
        assert_eq!(c.next(now), Step::AcquireLease);
        // Still waiting for the lease: the same step again.
        assert_eq!(c.next(now), Step::AcquireLease);
        c.lease_acquired();
        assert!(c.holds_lease());
        assert_eq!(c.next(now), Step::Signal);
        c.signalled(now, SignalOutcome::Signalled);
    }

    #[test]
    fn idle_until_requested() {
        let mut c = core();
        assert_eq!(c.next(1_000), Step::Idle);
        assert!(!c.pending());
        c.request();
        assert!(c.pending());
        assert_eq!(c.next(1_000), Step::AcquireLease);
    }

    #[test]
    fn a_restart_waits_for_down_then_up() {
        let mut c = core();
        c.request();
        signal_at(&mut c, 1_000);
        assert_eq!(c.restarts(), 1);
        assert_eq!(c.last_restart_unix_ms(), Some(1_000));
        assert!(!c.pending());
        // Still draining, old process answering: not back yet.
        assert_eq!(c.next(1_500), Step::Probe);
        c.probed(UP_SAME);
        assert_eq!(c.next(2_000), Step::Probe);
        c.probed(DOWN);
        assert_eq!(c.next(2_500), Step::Probe);
        c.probed(UP_SAME);
        assert_eq!(c.next(3_000), Step::ReleaseLease);
        assert_eq!(c.next(3_000), Step::ReleaseLease);
        c.released();
        assert!(!c.holds_lease());
        assert_eq!(c.next(3_000), Step::Idle);
        assert_eq!(c.problem(), None);
    }

    #[test]
    fn a_quick_restart_counts_by_the_process_being_gone() {
        let mut c = core();
        c.request();
        signal_at(&mut c, 1_000);
        c.probed(UP_NEW);
        assert_eq!(c.next(1_200), Step::ReleaseLease);
        c.released();
        assert_eq!(c.next(1_200), Step::Idle);
    }

    #[test]
    fn down_and_gone_is_not_back() {
        let mut c = core();
        c.request();
        signal_at(&mut c, 1_000);
        c.probed(Probe {
            healthy: false,
            signalled_gone: true,
        });
        assert_eq!(c.next(1_200), Step::Probe);
    }

    #[test]
    fn requests_inside_the_window_collapse_into_one_at_its_end() {
        let mut c = core();
        c.request();
        signal_at(&mut c, 1_000);
        c.probed(UP_NEW);
        c.next(1_100);
        c.released();
        // Three changes inside the window.
        c.request();
        c.request();
        assert_eq!(c.next(2_000), Step::WaitUntil(1_000 + MIN));
        c.request();
        assert_eq!(c.next(1_000 + MIN - 1), Step::WaitUntil(1_000 + MIN));
        signal_at(&mut c, 1_000 + MIN);
        assert_eq!(c.restarts(), 2);
        c.probed(UP_NEW);
        c.next(1_000 + MIN);
        c.released();
        // Nothing more: the three collapsed into one.
        assert_eq!(c.next(1_000 + 3 * MIN), Step::Idle);
    }

    #[test]
    fn a_request_during_a_restart_leads_to_one_more_after_the_window() {
        let mut c = core();
        c.request();
        signal_at(&mut c, 1_000);
        c.request();
        c.probed(UP_NEW);
        assert_eq!(c.next(1_100), Step::ReleaseLease);
        c.released();
        assert_eq!(c.next(1_100), Step::WaitUntil(1_000 + MIN));
        assert_eq!(c.next(1_000 + MIN), Step::AcquireLease);
    }

    #[test]
    fn gives_up_after_the_budget_and_recovers_later() {
        let mut c = core();
        c.request();
        signal_at(&mut c, 1_000);
        c.probed(DOWN);
        assert_eq!(c.next(1_000 + GIVE_UP - 1), Step::Probe);
        c.probed(DOWN);
        assert_eq!(c.next(1_000 + GIVE_UP), Step::ReleaseLease);
        let problem = c.problem().unwrap().to_owned();
        assert!(problem.contains("did not answer 200"), "{problem}");
        assert!(
            problem.contains("http://127.0.0.1:9090/health"),
            "{problem}"
        );
        assert!(problem.contains("300 s"), "{problem}");
        c.released();
        assert!(!c.holds_lease());
        // Still probed while the problem stands.
        assert_eq!(c.next(1_000 + GIVE_UP + 1), Step::Probe);
        c.probed(DOWN);
        assert!(c.problem().is_some());
        assert_eq!(c.next(1_000 + GIVE_UP + 2), Step::Probe);
        c.probed(UP_SAME);
        assert_eq!(c.problem(), None);
        assert_eq!(c.next(1_000 + GIVE_UP + 3), Step::Idle);
    }

    #[test]
    fn a_request_while_recovering_waits_for_the_window_then_restarts() {
        let mut c = core();
        c.request();
        signal_at(&mut c, 1_000);
        assert_eq!(c.next(1_000 + GIVE_UP), Step::ReleaseLease);
        c.released();
        c.request();
        assert_eq!(c.next(2_000 + GIVE_UP), Step::Probe);
        assert_eq!(c.next(1_000 + MIN), Step::AcquireLease);
    }

    #[test]
    fn nothing_signalled_reports_releases_and_retries_after_a_minute() {
        let mut c = core();
        c.request();
        assert_eq!(c.next(1_000), Step::AcquireLease);
        c.lease_acquired();
        assert_eq!(c.next(1_000), Step::Signal);
        c.signalled(1_000, SignalOutcome::NotSignalled("not found".into()));
        assert_eq!(c.problem(), Some("not found"));
        assert_eq!(c.restarts(), 0);
        assert_eq!(c.last_restart_unix_ms(), None);
        assert_eq!(c.next(1_000), Step::ReleaseLease);
        c.released();
        assert!(c.pending());
        let retry = 1_000 + ms(NOT_SIGNALLED_RETRY_AFTER);
        assert_eq!(c.next(1_001), Step::WaitUntil(retry));
        signal_at(&mut c, retry);
        c.probed(UP_NEW);
        assert_eq!(c.problem(), None);
    }

    #[test]
    fn a_proxy_that_already_read_the_files_is_not_restarted_and_spends_no_window() {
        let mut c = core();
        c.request();
        assert_eq!(c.next(1_000), Step::AcquireLease);
        c.lease_acquired();
        assert_eq!(c.next(1_000), Step::Signal);
        c.signalled(1_000, SignalOutcome::NotNeeded("started after".into()));
        assert_eq!(
            (c.restarts(), c.last_restart_unix_ms(), c.problem()),
            (0, None, None)
        );
        assert_eq!(c.next(1_000), Step::ReleaseLease);
        c.released();
        assert!(!c.pending());
        assert_eq!(c.next(1_001), Step::Idle);
        // The next request restarts at once: no window was spent.
        c.request();
        assert_eq!(c.next(1_002), Step::AcquireLease);
        // Found out before the lease: nothing to release either.
        c.not_needed();
        assert_eq!((c.pending(), c.problem()), (false, None));
        assert_eq!(c.next(1_003), Step::Idle);
    }

    #[test]
    fn a_store_error_retries_the_lease_after_a_pause() {
        let mut c = core();
        c.request();
        assert_eq!(c.next(1_000), Step::AcquireLease);
        c.lease_failed(1_000);
        let retry = 1_000 + ms(LEASE_RETRY_AFTER);
        assert_eq!(c.next(1_001), Step::WaitUntil(retry));
        assert_eq!(c.next(retry), Step::AcquireLease);
    }

    #[test]
    fn outcomes_out_of_turn_are_ignored() {
        let mut c = core();
        c.lease_acquired();
        c.signalled(5, SignalOutcome::Signalled);
        c.probed(UP_NEW);
        c.released();
        c.lease_failed(5);
        assert_eq!(c.restarts(), 0);
        assert_eq!(c.next(5), Step::Idle);
    }
}
