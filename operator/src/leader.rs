//! Leader election on a `coordination.k8s.io/v1` Lease (docs/reference.md#operator-run):
//! `sbproxy-operator-leader` in the operator's namespace, 15 s duration,
//! renewed every 5 s, acquisition retried every 2 s.
//!
//! The algorithm is client-go's: every write is a GET followed by a PUT
//! carrying the `resourceVersion` that was read, so two candidates racing
//! for the Lease cannot both win (the loser gets 409 Conflict). Whether a
//! foreign holder has expired is judged on this process's monotonic clock,
//! from the moment the Lease record was last seen to change, never by
//! comparing `renewTime` with the local wall clock, so node clock skew
//! cannot make two leaders.
//!
//! Why not kube-lease-manager: it cannot express "retry every 2 s" (a
//! follower sleeps until the holder's expiry), it renews with an
//! unconditional strategic-merge patch (so a holder whose Lease was taken
//! over rewrites the new holder's `renewTime` before noticing), and it
//! relies on server-side-apply ownership conflicts for mutual exclusion.
//!
//! [`Observer`] is the pure decision core; [`Elector`] is the thin shell
//! that moves Lease objects to and from the API server.

use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use tracing::{debug, info, warn};

/// Name of the leader Lease.
pub const LEASE_NAME: &str = "sbproxy-operator-leader";
/// `leaseDurationSeconds` written by the holder.
pub const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How often the holder renews.
pub const RENEW_INTERVAL: Duration = Duration::from_secs(5);
/// How often a follower tries to take the Lease, and how soon a failed
/// renewal is retried.
pub const RETRY_INTERVAL: Duration = Duration::from_secs(2);
/// The holder gives up (and the process exits) when it has not renewed
/// for this long: 5 s before its Lease can expire for the others, so it
/// has stopped before anyone else may start.
pub const RENEW_DEADLINE: Duration = Duration::from_secs(10);
/// Upper bound of one GET+PUT round, so a hung connection cannot hold the
/// renew loop past [`RENEW_DEADLINE`].
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(4);

/// Where the service account's namespace is mounted in a pod.
pub const SERVICE_ACCOUNT_NAMESPACE_FILE: &str =
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// Parameters of one candidate.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// Lease name.
    pub name: String,
    /// Lease namespace.
    pub namespace: String,
    /// This candidate's `holderIdentity`.
    pub identity: String,
    /// `leaseDurationSeconds`.
    pub duration: Duration,
    /// Renewal period of the holder.
    pub renew_interval: Duration,
    /// Acquisition (and failed-renewal) retry period.
    pub retry_interval: Duration,
    /// The holder gives up after this long without a successful renewal.
    pub renew_deadline: Duration,
}

impl LeaseConfig {
    /// The documented Lease (`sbproxy-operator-leader`, 15 s / 5 s / 2 s).
    pub fn new(namespace: impl Into<String>, identity: impl Into<String>) -> Self {
        Self {
            name: LEASE_NAME.to_owned(),
            namespace: namespace.into(),
            identity: identity.into(),
            duration: LEASE_DURATION,
            renew_interval: RENEW_INTERVAL,
            retry_interval: RETRY_INTERVAL,
            renew_deadline: RENEW_DEADLINE,
        }
    }
}

/// The operator's own namespace: the service account's, when running in a
/// pod; else the client's default namespace (the kubeconfig context's, or
/// `default`).
pub fn own_namespace(client: &Client) -> String {
    std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE_FILE)
        .ok()
        .map(|ns| ns.trim().to_owned())
        .filter(|ns| !ns.is_empty())
        .unwrap_or_else(|| client.default_namespace().to_owned())
}

/// This host's name (a pod's name, in a pod), for the Lease identity.
pub fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| format!("sbmesh-operator-{}", std::process::id()))
}

/// What a candidate should do after reading the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// We hold it: write a fresh `renewTime`.
    Renew,
    /// It is free, or its holder stopped renewing: take it.
    Acquire,
    /// Someone else holds it and renews it.
    Wait {
        /// The current holder.
        holder: String,
    },
}

/// Pure decision core: remembers the last Lease record seen and when (on
/// the caller's monotonic clock) it last changed.
#[derive(Debug, Default)]
pub struct Observer {
    last: Option<(LeaseSpec, Instant)>,
}

impl Observer {
    /// Records `spec` as read (or written) at `now`; the clock of a
    /// foreign holder restarts only when the record changes.
    pub fn observe(&mut self, spec: &LeaseSpec, now: Instant) {
        match &self.last {
            Some((seen, _)) if seen == spec => {}
            _ => self.last = Some((spec.clone(), now)),
        }
    }

    /// Observes `spec` at `now` and decides what `identity` should do.
    /// `default_duration` applies when the record names none.
    pub fn step(
        &mut self,
        spec: &LeaseSpec,
        identity: &str,
        now: Instant,
        default_duration: Duration,
    ) -> Step {
        self.observe(spec, now);
        let changed_at = self.last.as_ref().map_or(now, |(_, at)| *at);
        let holder = spec.holder_identity.as_deref().filter(|h| !h.is_empty());
        match holder {
            None => Step::Acquire,
            Some(h) if h == identity => Step::Renew,
            Some(h) => {
                let duration = spec
                    .lease_duration_seconds
                    .and_then(|s| u64::try_from(s).ok())
                    .filter(|s| *s > 0)
                    .map_or(default_duration, Duration::from_secs);
                if now.saturating_duration_since(changed_at) >= duration {
                    Step::Acquire
                } else {
                    Step::Wait {
                        holder: h.to_owned(),
                    }
                }
            }
        }
    }
}

/// Result of one GET+PUT round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Attempt {
    /// This process holds the Lease now.
    Holding,
    /// Another candidate holds it.
    Following {
        /// Its identity (empty when it is not known yet).
        holder: String,
    },
}

/// Why [`Elector::hold`] returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Held {
    /// The caller asked to stop; the Lease is still ours (release it).
    Stopped,
    /// Leadership is gone: someone else holds the Lease, or it could not be
    /// renewed within [`RENEW_DEADLINE`].
    Lost {
        /// What happened, for the log.
        reason: String,
    },
}

/// One leader-election candidate.
pub struct Elector {
    api: Api<Lease>,
    config: LeaseConfig,
    observer: Observer,
}

impl Elector {
    /// A candidate for `config`'s Lease.
    pub fn new(client: Client, config: LeaseConfig) -> Self {
        Self {
            api: Api::namespaced(client, &config.namespace),
            config,
            observer: Observer::default(),
        }
    }

    /// This candidate's parameters.
    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// One round: GET the Lease (POST it, held by us, when absent); if we
    /// hold it or may take it, PUT it back with the `resourceVersion` read.
    pub async fn try_acquire_or_renew(&mut self) -> Result<Attempt, kube::Error> {
        let now = Instant::now();
        let Some(lease) = self.api.get_opt(&self.config.name).await? else {
            return self.create().await;
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let step = self
            .observer
            .step(&spec, &self.config.identity, now, self.config.duration);
        let acquire = match step {
            Step::Wait { holder } => return Ok(Attempt::Following { holder }),
            Step::Acquire => true,
            Step::Renew => false,
        };
        let stamp = MicroTime(Timestamp::now());
        let mut next = spec.clone();
        if acquire {
            next.holder_identity = Some(self.config.identity.clone());
            next.acquire_time = Some(stamp.clone());
            next.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        }
        next.renew_time = Some(stamp);
        next.lease_duration_seconds = Some(duration_secs(self.config.duration));
        let mut updated = lease;
        updated.spec = Some(next);
        // metadata.resourceVersion is the one read above: a write by anyone
        // in between makes this PUT fail with 409 instead of winning twice.
        let written = self
            .api
            .replace(&self.config.name, &PostParams::default(), &updated)
            .await?;
        self.observer
            .observe(&written.spec.unwrap_or_default(), Instant::now());
        if acquire {
            info!(lease = %self.config.name, identity = %self.config.identity, "acquired the leader Lease");
        }
        Ok(Attempt::Holding)
    }

    async fn create(&mut self) -> Result<Attempt, kube::Error> {
        let stamp = MicroTime(Timestamp::now());
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.config.name.clone()),
                namespace: Some(self.config.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.config.identity.clone()),
                acquire_time: Some(stamp.clone()),
                renew_time: Some(stamp),
                lease_duration_seconds: Some(duration_secs(self.config.duration)),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        match self.api.create(&PostParams::default(), &lease).await {
            Ok(created) => {
                self.observer
                    .observe(&created.spec.unwrap_or_default(), Instant::now());
                info!(lease = %self.config.name, identity = %self.config.identity, "created and acquired the leader Lease");
                Ok(Attempt::Holding)
            }
            // Another candidate created it first; the next round reads it.
            Err(kube::Error::Api(s)) if s.is_already_exists() => Ok(Attempt::Following {
                holder: String::new(),
            }),
            Err(e) => Err(e),
        }
    }

    async fn attempt(&mut self) -> Result<Attempt, String> {
        match tokio::time::timeout(ATTEMPT_TIMEOUT, self.try_acquire_or_renew()).await {
            Ok(Ok(a)) => Ok(a),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {ATTEMPT_TIMEOUT:?}")),
        }
    }

    /// Returns once this process holds the Lease, trying every retry
    /// interval. Errors are logged and retried: a follower has nothing
    /// better to do.
    pub async fn acquire(&mut self) {
        let mut last_holder = None;
        let mut last_error = None;
        loop {
            match self.attempt().await {
                Ok(Attempt::Holding) => return,
                Ok(Attempt::Following { holder }) => {
                    if last_holder.as_ref() != Some(&holder) && !holder.is_empty() {
                        info!(lease = %self.config.name, %holder, "following");
                    }
                    last_holder = Some(holder);
                    last_error = None;
                }
                // Once per distinct error: a follower retries every 2 s, and
                // a missing RBAC rule must show without flooding the log.
                Err(e) if last_error.as_ref() != Some(&e) => {
                    warn!(lease = %self.config.name, error = %e, "could not try the leader Lease; retrying");
                    last_error = Some(e);
                }
                Err(e) => {
                    debug!(lease = %self.config.name, error = %e, "could not try the leader Lease")
                }
            }
            tokio::time::sleep(self.config.retry_interval).await;
        }
    }

    /// Renews every renew interval until `stop` resolves or leadership is
    /// lost. Call it right after [`Elector::acquire`] returned.
    pub async fn hold(&mut self, stop: impl Future<Output = ()>) -> Held {
        let mut renewed_at = Instant::now();
        let mut wait = self.config.renew_interval;
        tokio::pin!(stop);
        loop {
            tokio::select! {
                biased;
                _ = &mut stop => return Held::Stopped,
                _ = tokio::time::sleep(wait) => {}
            }
            match self.attempt().await {
                Ok(Attempt::Holding) => {
                    renewed_at = Instant::now();
                    wait = self.config.renew_interval;
                }
                Ok(Attempt::Following { holder }) => {
                    return Held::Lost {
                        reason: format!("the Lease is now held by {holder:?}"),
                    };
                }
                Err(e) => {
                    if renewed_at.elapsed() >= self.config.renew_deadline {
                        return Held::Lost {
                            reason: format!(
                                "not renewed for {:?} (last error: {e})",
                                self.config.renew_deadline
                            ),
                        };
                    }
                    warn!(lease = %self.config.name, error = %e, "renewing the leader Lease failed; retrying");
                    wait = self.config.retry_interval;
                }
            }
        }
    }

    /// Gives the Lease up if this process holds it, so a follower takes
    /// over within one retry interval instead of a whole lease duration.
    /// Returns whether it was held.
    pub async fn release(&mut self) -> Result<bool, kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.config.name).await? else {
            return Ok(false);
        };
        let mut spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return Ok(false);
        }
        spec.holder_identity = None;
        spec.acquire_time = None;
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        spec.lease_duration_seconds = Some(1);
        lease.spec = Some(spec);
        self.api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await?;
        info!(lease = %self.config.name, identity = %self.config.identity, "released the leader Lease");
        Ok(true)
    }
}

fn duration_secs(d: Duration) -> i32 {
    i32::try_from(d.as_secs()).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: Option<&str>, renew_secs: i64, duration: Option<i32>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            renew_time: Some(MicroTime(
                Timestamp::from_second(1_700_000_000 + renew_secs).unwrap_or(Timestamp::UNIX_EPOCH),
            )),
            lease_duration_seconds: duration,
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn free_lease_is_taken() {
        let mut o = Observer::default();
        let t0 = Instant::now();
        assert_eq!(
            o.step(&LeaseSpec::default(), "a", t0, LEASE_DURATION),
            Step::Acquire
        );
        assert_eq!(
            o.step(&spec(Some(""), 0, Some(1)), "a", t0, LEASE_DURATION),
            Step::Acquire
        );
    }

    #[test]
    fn own_lease_is_renewed() {
        let mut o = Observer::default();
        assert_eq!(
            o.step(
                &spec(Some("a"), 0, Some(15)),
                "a",
                Instant::now(),
                LEASE_DURATION
            ),
            Step::Renew
        );
    }

    #[test]
    fn foreign_lease_expires_on_the_local_clock_only_when_it_stops_changing() {
        let mut o = Observer::default();
        let t0 = Instant::now();
        let wait = Step::Wait { holder: "b".into() };
        assert_eq!(
            o.step(&spec(Some("b"), 0, Some(15)), "a", t0, LEASE_DURATION),
            wait
        );
        // b renews at +10 s: its clock restarts, so +20 s is not expired.
        let t10 = t0 + Duration::from_secs(10);
        assert_eq!(
            o.step(&spec(Some("b"), 10, Some(15)), "a", t10, LEASE_DURATION),
            wait
        );
        let t20 = t0 + Duration::from_secs(20);
        assert_eq!(
            o.step(&spec(Some("b"), 10, Some(15)), "a", t20, LEASE_DURATION),
            wait
        );
        // Unchanged for 15 s after the last change seen: take it.
        let t25 = t0 + Duration::from_secs(25);
        assert_eq!(
            o.step(&spec(Some("b"), 10, Some(15)), "a", t25, LEASE_DURATION),
            Step::Acquire
        );
    }

    #[test]
    fn renew_time_from_a_skewed_clock_does_not_matter() {
        let mut o = Observer::default();
        let t0 = Instant::now();
        // A renewTime an hour in the past (skewed writer) is still a live
        // lease when this process has just seen it change.
        let stale = spec(Some("b"), -3600, Some(15));
        assert_eq!(
            o.step(&stale, "a", t0, LEASE_DURATION),
            Step::Wait { holder: "b".into() }
        );
    }

    #[test]
    fn missing_duration_uses_the_default() {
        let mut o = Observer::default();
        let t0 = Instant::now();
        let s = spec(Some("b"), 0, None);
        assert_eq!(
            o.step(&s, "a", t0, LEASE_DURATION),
            Step::Wait { holder: "b".into() }
        );
        assert_eq!(
            o.step(&s, "a", t0 + Duration::from_secs(14), LEASE_DURATION),
            Step::Wait { holder: "b".into() }
        );
        assert_eq!(
            o.step(&s, "a", t0 + Duration::from_secs(15), LEASE_DURATION),
            Step::Acquire
        );
    }

    #[test]
    fn spec_parameters() {
        let c = LeaseConfig::new("ns", "me");
        assert_eq!(c.name, "sbproxy-operator-leader");
        assert_eq!(c.duration, Duration::from_secs(15));
        assert_eq!(c.renew_interval, Duration::from_secs(5));
        assert_eq!(c.retry_interval, Duration::from_secs(2));
        assert!(c.renew_deadline < c.duration);
    }
}
