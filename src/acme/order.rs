//! The shell's tasks that talk to the CA and to the shared order state,
//! each spawned by the manager's `Runner` for one action of the core and
//! answering with one input:
//! - [`OrderJob`]: one order, from the unit's lease lock to the stored
//!   certificate, as named steps (the shared backoff, the lock, the store
//!   read again under it, the CA's duplicate limit, the account, the
//!   cluster's order budget, the order, the stored record, the issuance
//!   history); it ends in an [`OrderOutcome`];
//! - [`AriTask`]: one question to the CA for a certificate's renewal
//!   window, shared through the same per-unit state record as the
//!   failures ([`UnitOrderState`]);
//! - [`Reseal`]: a certificate record moved to the primary cluster key,
//!   under the same order lock as an order.
//!
//! They share the store helpers below: the unit's certificate record read
//! and checked ([`read_record`]), and JSON records changed by
//! compare-and-swap (the order state, the issuance history, the budget).

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::{Mutex, mpsc};
use tracing::{debug, info, warn};

use crate::acme::account::AcmeError;
use crate::acme::account::{AccountSettings, load_or_create, one_line};
use crate::acme::certs::{CertRecord, parse_chain};
use crate::acme::challenge::ChallengeBook;
use crate::acme::dns01::{Dns01, Dns01Order, DnsError};
use crate::acme::issuer::{Issued, Issuer, Proof, certificate_identifier};
use crate::acme::layout;
use crate::acme::machine::{Input, StoredCert, jitter};
use crate::acme::manager::AcmeLimits;
use crate::acme::outcome::{Deferral, OrderError, OrderOutcome};
use crate::acme::reach::ReachCheck;
use crate::acme::schedule::{
    AriCheck, AriWindow, CertTimes, Failures, IssuanceHistory, OrderBudget, UnitOrderState,
    ari_next_check, renew_at,
};
use crate::acme::unit::{CertUnit, check_record};
use crate::config::{AcmeSection, Challenge};
use crate::keyring::KeyRing;
use crate::metrics::Metrics;
use crate::store::lock::{Lease, LeaseKeeper, LeaseLock, get_fenced, put_fenced};
use crate::store::sealed::{AtRestRing, sealed_key_id};
use crate::store::{Store, StoreError, now_unix_ms};

/// The DNS-01 provider last built, with the `dns01` block it was built for.
pub(crate) type Dns01Slot =
    Arc<std::sync::Mutex<Option<(crate::config::Dns01Section, Arc<Dns01>)>>>;

/// Whether the lease holder `holder` is a previous process of the node
/// `node_id` (same node id, another boot id), as opposed to `me` itself
/// or another node. A StatefulSet pod name runs once at a time, so that
/// process is dead and its lease can be taken over at once.
pub(crate) fn is_own_predecessor(holder: &str, node_id: &str, me: &str) -> bool {
    holder != me
        && holder
            .strip_prefix(node_id)
            .and_then(|rest| rest.strip_prefix('/'))
            .is_some_and(|boot| !boot.is_empty() && !boot.contains('/'))
}

/// A busy order lock is looked at again this often at most (or at its
/// expiry, when sooner): often enough to notice a release, rare enough to
/// cost next to nothing while another replica orders.
const BUSY_RECHECK: Duration = Duration::from_secs(5);
/// And not sooner than this, whatever the lock record's expiry says (a
/// clock that disagrees with the holder's must not make us spin).
const BUSY_MIN_WAIT: Duration = Duration::from_secs(1);

/// How long the CA's certificate is kept while its write to the store
/// fails (the store restarting, unreachable): written as soon as the
/// store answers within this, instead of lost and ordered again (a second
/// certificate at the CA for the same names).
const ISSUED_WRITE_PATIENCE: Duration = Duration::from_secs(120);
/// The first pause between two writes of the CA's certificate; doubled
/// each time, up to [`ISSUED_WRITE_MAX_PAUSE`].
const ISSUED_WRITE_FIRST_PAUSE: Duration = Duration::from_millis(500);
const ISSUED_WRITE_MAX_PAUSE: Duration = Duration::from_secs(8);

/// How long to leave a lock alone that is held until `expires_at_unix_ms`.
fn busy_wait(expires_at_unix_ms: u64, now_unix_ms: u64) -> Duration {
    Duration::from_millis(expires_at_unix_ms.saturating_sub(now_unix_ms))
        .clamp(BUSY_MIN_WAIT, BUSY_RECHECK)
}

/// One order, from lock to stored certificate.
pub(crate) struct OrderJob {
    pub(crate) unit: CertUnit,
    pub(crate) node_id: String,
    /// This process's lock holder id (`<node id>/<boot id>`).
    pub(crate) holder: String,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) ring: AtRestRing,
    /// The lock's lease, the cluster's order budget, the DNS-01 resolvers.
    pub(crate) limits: AcmeLimits,
    pub(crate) renew_before_days: Option<u32>,
    /// The certificate the scheduler saw when it decided to order.
    pub(crate) known: Option<StoredCert>,
    pub(crate) acme: AcmeSection,
    /// Built (and the account loaded) by the first order that needs it.
    pub(crate) issuer: Arc<Mutex<Option<Arc<Issuer>>>>,
    pub(crate) book: Arc<ChallengeBook>,
    /// Where the CA's request lands, checked before each order
    /// ([`crate::acme::reach`]); `None`: not checked.
    pub(crate) reach: Option<Arc<ReachCheck>>,
    /// The DNS-01 provider of the `dns01` block it was built for, shared
    /// by every order until the block changes.
    pub(crate) dns01: Dns01Slot,
}

/// A step of an order: what the next step needs, or (`Err`) the outcome
/// the order ends with here.
type Step<T> = Result<T, OrderOutcome>;

/// What [`OrderJob::try_lock`] got.
enum LockAttempt {
    /// The unit's lease: order under it.
    Held(Lease),
    /// Another replica holds it: leave it alone this long.
    Busy(Duration),
}

fn failed(error: OrderError) -> OrderOutcome {
    OrderOutcome::Failed {
        error,
        shared: None,
    }
}

fn deferred(until: u64, why: Deferral) -> OrderOutcome {
    OrderOutcome::Deferred {
        until,
        why,
        shared: None,
    }
}

impl OrderJob {
    fn dir_id(&self) -> String {
        layout::directory_id(&self.acme.directory_url)
    }

    fn set_id(&self) -> String {
        layout::hostname_set_id(&self.unit.names)
    }

    /// Orders the unit; what the order learnt (a failure, a deferral, an
    /// issuance) is shared with every replica through the unit's state.
    pub(crate) async fn run(self) -> OrderOutcome {
        let now = now_unix_ms() / 1000;
        let state_key = layout::order_state(&self.dir_id(), &self.set_id());
        if let Some(held) = self.shared_backoff(&state_key, now).await {
            return held;
        }
        let outcome = self.lock_and_order().await;
        self.share(&state_key, now, outcome).await
    }

    /// The backoff of every replica's failures: a restarted replica or
    /// the next owner honours what the last attempt learnt. `Some` when
    /// it says to wait, or cannot be read (fail closed: try later).
    async fn shared_backoff(&self, state_key: &str, now: u64) -> Option<OrderOutcome> {
        match read_json::<UnitOrderState>(self.store.as_ref(), state_key).await {
            Ok(state) => {
                let state = state.unwrap_or_default();
                let waiting = state.backing_off(now).is_err();
                waiting.then_some(OrderOutcome::BackingOff(state.failures))
            }
            Err(e) => Some(failed(OrderError::SharedState(e))),
        }
    }

    /// Records `outcome` in the unit's shared state: a failure or a
    /// deferral counts towards the backoff, an issuance clears it.
    async fn share(&self, state_key: &str, now: u64, outcome: OrderOutcome) -> OrderOutcome {
        match outcome {
            OrderOutcome::Failed { error, .. } => {
                let retry_after_secs = error.retry_after_secs();
                let shared = self.share_failure(state_key, now, retry_after_secs).await;
                OrderOutcome::Failed { error, shared }
            }
            OrderOutcome::Deferred { until, why, .. } => {
                let wait = Some(until.saturating_sub(now));
                let shared = self.share_failure(state_key, now, wait).await;
                OrderOutcome::Deferred { until, why, shared }
            }
            OrderOutcome::Issued(record) => {
                self.clear_failures(state_key).await;
                OrderOutcome::Issued(record)
            }
            other => other,
        }
    }

    /// Records a failure at `now` in the shared state; the failures as
    /// stored, or `None` when the store did not take it (the caller then
    /// backs off on its own).
    async fn share_failure(
        &self,
        key: &str,
        now: u64,
        retry_after_secs: Option<u64>,
    ) -> Option<Failures> {
        let mut stored = None;
        let result = update_json(self.store.as_ref(), key, |s: Option<UnitOrderState>| {
            let mut s = s.unwrap_or_default();
            s.failures.record(now, retry_after_secs);
            stored = Some(s.failures.clone());
            Ok::<_, std::convert::Infallible>(s)
        })
        .await;
        match result {
            Ok(_) => stored,
            Err(e) => {
                warn!(unit = %self.unit.id, error = %one_line(&e.to_string()), "failure not recorded in the shared store; only this replica backs off");
                None
            }
        }
    }

    async fn clear_failures(&self, key: &str) {
        let cleared = update_json(
            self.store.as_ref(),
            key,
            |s: Option<UnitOrderState>| match s {
                Some(mut s) if s.failures.count > 0 => {
                    s.failures.clear();
                    Ok(s)
                }
                _ => Err(()),
            },
        )
        .await;
        if let Err(e) = cleared {
            warn!(unit = %self.unit.id, error = %one_line(&e.to_string()), "shared failure count not cleared; the next attempt may wait for its backoff");
        }
    }

    async fn lock_and_order(&self) -> OrderOutcome {
        let lock = LeaseLock::new(self.store.clone(), &self.unit.lock_name())
            .with_metrics(self.metrics.clone());
        let lease = match self.try_lock(&lock).await {
            Ok(LockAttempt::Held(lease)) => lease,
            Ok(LockAttempt::Busy(wait)) => return OrderOutcome::Busy { wait },
            Err(e) => return failed(OrderError::Lock(e)),
        };
        let keeper = LeaseKeeper::spawn(lock, lease);
        // Counted until this function returns, the lock released.
        let _in_progress = self.metrics.acme.order_in_progress();
        let outcome = match self.locked(&keeper).await {
            Ok(record) => OrderOutcome::Issued(Box::new(record)),
            Err(ended) => ended,
        };
        if let Err(e) = keeper.release().await {
            debug!(unit = %self.unit.id, error = %e, "order lock not released; it expires by itself");
        }
        outcome
    }

    /// The lease, or how long to leave the lock alone. A lease of this
    /// node's previous process (same node id, another boot id: it is dead,
    /// a pod name runs once) is taken over at once instead of waited out.
    async fn try_lock(&self, lock: &LeaseLock) -> Result<LockAttempt, StoreError> {
        if let Some(lease) = lock
            .try_acquire(&self.holder, self.limits.order_lock_ttl)
            .await?
        {
            return Ok(LockAttempt::Held(lease));
        }
        let Some(record) = lock.current().await? else {
            // Lost a race for a new lock just now: someone else has it.
            return Ok(LockAttempt::Busy(BUSY_RECHECK));
        };
        if !record.released && is_own_predecessor(&record.holder, &self.node_id, &self.holder) {
            if lock.release_predecessor(&record.holder).await? {
                info!(unit = %self.unit.id, previous = %record.holder, fence = record.fence, "taking over the order lock of this node's previous process");
            }
            return Ok(
                match lock
                    .try_acquire(&self.holder, self.limits.order_lock_ttl)
                    .await?
                {
                    Some(lease) => LockAttempt::Held(lease),
                    None => LockAttempt::Busy(BUSY_MIN_WAIT),
                },
            );
        }
        debug!(unit = %self.unit.id, holder = %record.holder, expires_at_unix_ms = record.expires_at_unix_ms, "order lock held by another replica");
        // The lease's expiry is on the store's clock, not this node's.
        let now = lock.store_now().await?;
        Ok(LockAttempt::Busy(busy_wait(record.expires_at_unix_ms, now)))
    }

    /// The order under its lock, step by step.
    async fn locked(&self, keeper: &LeaseKeeper) -> Step<CertRecord> {
        let now = now_unix_ms() / 1000;
        let replaces = self.read_again(now).await?;
        let dns = self.dns01().map_err(|e| failed(OrderError::Order(e)))?;
        // Before the CA hears of it: a validation the CA cannot complete
        // is a failure it counts, and a backoff here. (DNS-01 is checked
        // where it is written: every authoritative server serves it.)
        if let Some(reach) = self.reach.as_ref().filter(|_| dns.is_none()) {
            reach
                .check(&self.book, &self.unit.names)
                .await
                .map_err(OrderOutcome::Unanswered)?;
        }
        let history_key = self.keep_duplicate_limit(now).await?;
        let dns_order = dns.as_deref().map(|dns| {
            let ledger = layout::dns_ledger(&self.dir_id(), &self.set_id());
            Dns01Order::new(dns, &self.store, ledger, keeper.lease(), &self.holder)
        });
        if let Some(dns_order) = &dns_order {
            // What a replica that died mid-order left goes first.
            dns_order
                .clear_leftovers()
                .await
                .map_err(|e| failed(OrderError::Order(e)))?;
        }
        // The directory and the account first: an attempt that never
        // reaches the CA does not spend the budget.
        let issuer = self.issuer().await.map_err(failed)?;
        let window = self.spend_budget(now).await?;
        let proof = match &dns_order {
            Some(order) => Proof::Dns01(order),
            None => Proof::Http01,
        };
        let issued = self.order(&issuer, keeper, replaces, window, proof).await?;
        let record = self.store_certificate(issued, keeper).await?;
        self.record_issuance(&history_key, now).await;
        Ok(record)
    }

    /// Another replica may have stored a certificate between our last
    /// read and the lock: use it rather than order a second one. Else the
    /// chain the new certificate replaces (named to the CA, ARI
    /// `replaces`, when it offers renewal information), if any.
    async fn read_again(&self, now: u64) -> Step<Option<String>> {
        let ring = self.ring.current();
        match read_record(self.store.as_ref(), ring.as_deref(), &self.unit).await {
            Ok(Some(record)) if now < self.renewal_time(&record) => {
                Err(OrderOutcome::AlreadyValid(Box::new(record)))
            }
            Ok(Some(record)) => Ok(Some(record.chain_pem)),
            Ok(None) => Ok(None),
            Err(StoreError::Corrupt { message, .. }) => {
                warn!(unit = %self.unit.id, "stored certificate unusable ({}); ordering a new one", one_line(&message));
                Ok(None)
            }
            Err(e) => {
                self.ring.report(&e, &self.metrics);
                Err(failed(OrderError::ReadRecord(e)))
            }
        }
    }

    /// When `record` is due for renewal, as the scheduler computes it.
    fn renewal_time(&self, record: &CertRecord) -> u64 {
        let times = CertTimes {
            not_before_unix: record.not_before_unix,
            not_after_unix: record.not_after_unix,
        };
        // The CA's window applies to the certificate it was given for.
        let ari = self
            .known
            .as_ref()
            .filter(|k| k.serial == record.serial)
            .and_then(|k| k.ari);
        let jitter = jitter(&self.unit.id, &record.serial);
        renew_at(times, self.renew_before_days, ari, jitter)
    }

    /// The CA's duplicate limit for this hostname set: the key of its
    /// issuance history while one more issuance keeps it. Without the
    /// history the limit cannot be kept: no order, the backoff tries
    /// again later.
    async fn keep_duplicate_limit(&self, now: u64) -> Step<String> {
        let key = layout::issued(&self.dir_id(), &self.set_id());
        let history = read_json::<IssuanceHistory>(self.store.as_ref(), &key)
            .await
            .map_err(|e| failed(OrderError::DuplicateGuard(e)))?;
        match history.unwrap_or_default().allows(now) {
            Ok(()) => Ok(key),
            Err(until) => Err(deferred(until, Deferral::DuplicateLimit)),
        }
    }

    /// Takes one order from the cluster's budget: the start of the
    /// interval it was taken from (to give it back).
    async fn spend_budget(&self, now: u64) -> Step<u64> {
        let key = layout::order_budget(&self.dir_id());
        match take_budget(self.store.as_ref(), &key, &self.limits, now).await {
            Ok(Budget::Taken { window_start }) => Ok(window_start),
            Ok(Budget::Spent { until }) => Err(deferred(
                until,
                Deferral::BudgetSpent {
                    max_orders: self.limits.max_orders,
                },
            )),
            Err(e) => Err(failed(OrderError::Budget(e))),
        }
    }

    /// The order at the CA, while the lease is held.
    async fn order(
        &self,
        issuer: &Issuer,
        keeper: &LeaseKeeper,
        replaces: Option<String>,
        window_start: u64,
        proof: Proof<'_>,
    ) -> Step<Issued> {
        let replaces = replaces
            .filter(|_| issuer.offers_ari())
            .and_then(|chain| certificate_identifier(&chain).ok());
        let ordered = issuer
            .order_replacing(&self.unit.names, Some(keeper.held()), replaces, proof)
            .await;
        match ordered {
            Ok(issued) => Ok(issued),
            Err(e) => {
                if e.never_reached_ca() {
                    // The newOrder request did not reach the CA: the
                    // budget was not spent.
                    let key = layout::order_budget(&self.dir_id());
                    let given = give_back_budget(self.store.as_ref(), &key, window_start).await;
                    if let Err(give) = given {
                        debug!(unit = %self.unit.id, error = %give, "order budget not given back");
                    }
                }
                Err(failed(OrderError::Order(e)))
            }
        }
    }

    /// The CA's certificate as a record, stored under the lease (fenced:
    /// it cannot undo a newer certificate once the lease is lost).
    async fn store_certificate(&self, issued: Issued, keeper: &LeaseKeeper) -> Step<CertRecord> {
        let facts =
            parse_chain(&issued.chain_pem).map_err(|e| failed(OrderError::IssuedCertificate(e)))?;
        let record = CertRecord {
            host: self.unit.record_host().to_owned(),
            hosts: facts.dns_names.clone(),
            chain_pem: issued.chain_pem,
            key_pem: issued.key_pem,
            not_before_unix: facts.not_before_unix,
            not_after_unix: facts.not_after_unix,
            serial: facts.serial,
            issued_at_unix: now_unix_ms() / 1000,
            issued_by: self.node_id.clone(),
        };
        let key = self.unit.store_key();
        let bytes = record
            .encode(self.ring.current().as_deref(), &key)
            .map_err(|e| failed(OrderError::Seal(e)))?;
        self.write_issued(&key, &bytes, keeper)
            .await
            .map_err(|e| failed(OrderError::StoreCertificate(e)))?;
        Ok(record)
    }

    /// The fenced write of the CA's certificate, tried again while the
    /// store fails (not when a newer lease holder refuses it) for up to
    /// [`ISSUED_WRITE_PATIENCE`]: the certificate exists at the CA, and
    /// losing it would order a second one. A write after the lease
    /// lapsed is still refused if another replica took the lock since.
    async fn write_issued(
        &self,
        key: &str,
        bytes: &[u8],
        keeper: &LeaseKeeper,
    ) -> Result<(), StoreError> {
        let started = tokio::time::Instant::now();
        let mut pause = ISSUED_WRITE_FIRST_PAUSE;
        let mut retried = false;
        loop {
            match put_fenced(self.store.as_ref(), key, bytes, &keeper.lease()).await {
                Ok(_) => {
                    if retried {
                        info!(unit = %self.unit.id, "the CA's certificate is stored: the store answers again");
                    }
                    return Ok(());
                }
                Err(e @ (StoreError::Timeout { .. } | StoreError::Backend { .. }))
                    if started.elapsed() + pause < ISSUED_WRITE_PATIENCE =>
                {
                    if !retried {
                        warn!(unit = %self.unit.id, error = %one_line(&e.to_string()), "the CA issued the certificate but the store did not take it; keeping it and writing it again");
                        retried = true;
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(ISSUED_WRITE_MAX_PAUSE);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Counts the issuance towards the duplicate limit; a failure is only
    /// logged (the certificate is stored).
    async fn record_issuance(&self, history_key: &str, now: u64) {
        let recorded = update_json(
            self.store.as_ref(),
            history_key,
            |history: Option<IssuanceHistory>| {
                let mut history = history.unwrap_or_default();
                history.record(now);
                Ok::<_, std::convert::Infallible>(history)
            },
        )
        .await;
        if let Err(e) = recorded {
            warn!(unit = %self.unit.id, error = %one_line(&e.to_string()), "issuance history not recorded");
        }
    }

    /// The DNS-01 provider of the settings, when the challenge is DNS-01:
    /// the one already built for this `dns01` block, else a new one, kept
    /// for the next orders (an edited block builds another; a rotated
    /// secret is read at each update anyway).
    fn dns01(&self) -> Result<Option<Arc<Dns01>>, AcmeError> {
        if self.acme.challenge != Challenge::Dns01 {
            return Ok(None);
        }
        let section =
            self.acme.dns01.as_ref().ok_or_else(|| {
                AcmeError::Config("challenge: dns-01 needs a dns01 block".to_owned())
            })?;
        let env = |name: &str| std::env::var(name).ok();
        built_for(&self.dns01, section, || {
            Dns01::new(
                section,
                &self.limits.dns_resolvers,
                env,
                self.metrics.clone(),
            )
            .map(Arc::new)
            .map_err(|e| match e {
                DnsError::Config(message) => AcmeError::Config(message),
                other => AcmeError::Dns {
                    message: other.to_string(),
                },
            })
        })
        .map(Some)
    }

    /// The shared issuer, built (and the account loaded or created) on
    /// first use.
    async fn issuer(&self) -> Result<Arc<Issuer>, OrderError> {
        let mut slot = self.issuer.lock().await;
        if let Some(issuer) = slot.as_ref() {
            return Ok(issuer.clone());
        }
        let account = load_or_create(
            &self.store,
            self.ring.current().as_deref(),
            &AccountSettings::from_config(&self.acme),
            &self.holder,
        )
        .await
        .map_err(OrderError::Account)?;
        info!(account = %account.id(), directory = %account.directory_url(), "ACME account ready");
        let issuer = Arc::new(Issuer::new(
            account,
            self.book.clone(),
            self.node_id.clone(),
        ));
        *slot = Some(issuer.clone());
        Ok(issuer)
    }
}

/// The value in `slot` when it was built for `key`, else a new one from
/// `build`, kept there for the next caller (a failed build keeps nothing).
fn built_for<K: PartialEq + Clone, V: Clone, E>(
    slot: &std::sync::Mutex<Option<(K, V)>>,
    key: &K,
    build: impl FnOnce() -> Result<V, E>,
) -> Result<V, E> {
    let mut slot = slot.lock().expect("not poisoned");
    if let Some((built, value)) = slot.as_ref()
        && built == key
    {
        return Ok(value.clone());
    }
    let value = build()?;
    *slot = Some((key.clone(), value.clone()));
    Ok(value)
}

/// What [`take_budget`] did.
enum Budget {
    /// One order taken from the interval starting at `window_start`.
    Taken { window_start: u64 },
    /// The interval's orders are spent until `until` (unix seconds).
    Spent { until: u64 },
}

/// Takes one order from the budget at `key` (see [`Budget`]).
async fn take_budget(
    store: &dyn Store,
    key: &str,
    limits: &AcmeLimits,
    now: u64,
) -> Result<Budget, StoreError> {
    let (max, interval) = (limits.max_orders, limits.orders_interval);
    let mut window_start = 0;
    let taken = update_json(store, key, |budget: Option<OrderBudget>| {
        // A changed limit starts a fresh budget.
        let mut budget = budget
            .filter(|b| b.max_orders == max && b.interval_secs == interval.as_secs())
            .unwrap_or_else(|| OrderBudget::new(max, interval.as_secs()));
        budget.try_take(now).map(|()| {
            window_start = budget.window_start_unix;
            budget
        })
    })
    .await?;
    Ok(match taken {
        Update::Written => Budget::Taken { window_start },
        Update::Declined(until) => Budget::Spent { until },
    })
}

/// Returns an order taken in the interval starting at `window` that never
/// reached the CA (a later interval starts full anyway).
async fn give_back_budget(store: &dyn Store, key: &str, window: u64) -> Result<(), StoreError> {
    update_json(store, key, |budget: Option<OrderBudget>| match budget {
        Some(mut b) if b.window_start_unix == window && b.used > 0 => {
            b.used -= 1;
            Ok(b)
        }
        _ => Err(()),
    })
    .await
    .map(|_| ())
}

/// The JSON record at `key`, `None` when absent; a record that does not
/// decode is [`StoreError::Corrupt`] (naming the key, so it can be fixed
/// or deleted).
async fn read_json<T: serde::de::DeserializeOwned>(
    store: &dyn Store,
    key: &str,
) -> Result<Option<T>, StoreError> {
    match store.get(key).await? {
        None => Ok(None),
        Some(entry) => {
            serde_json::from_slice(&entry.value)
                .map(Some)
                .map_err(|e| StoreError::Corrupt {
                    key: key.to_owned(),
                    message: format!("not the expected JSON record ({e}); delete it to reset"),
                })
        }
    }
}

/// What [`update_json`] did.
enum Update<E> {
    /// The new value is stored.
    Written,
    /// `change` declined with this; nothing was written.
    Declined(E),
}

/// Read-modify-write of the JSON record at `key` by compare-and-swap,
/// again while other replicas win the race. `change` gets the current value
/// (`None` when absent or unreadable) and returns the one to write, or an
/// `Err` to write nothing ([`Update::Declined`]).
async fn update_json<T, E>(
    store: &dyn Store,
    key: &str,
    mut change: impl FnMut(Option<T>) -> Result<T, E>,
) -> Result<Update<E>, StoreError>
where
    T: Serialize + serde::de::DeserializeOwned,
{
    for _ in 0..32 {
        let current = store.get(key).await?;
        let value = current
            .as_ref()
            .and_then(|e| serde_json::from_slice::<T>(&e.value).ok());
        let next = match change(value) {
            Ok(next) => next,
            Err(e) => return Ok(Update::Declined(e)),
        };
        let bytes = serde_json::to_vec(&next).map_err(|e| StoreError::Corrupt {
            key: key.to_owned(),
            message: format!("cannot encode: {e}"),
        })?;
        let written = match &current {
            None => store.put_if_absent(key, &bytes, None).await?,
            Some(e) => {
                store
                    .compare_and_swap(key, &e.version, &bytes, None)
                    .await?
            }
        };
        if written.is_some() {
            return Ok(Update::Written);
        }
    }
    Err(StoreError::Backend {
        backend: "acme",
        message: format!("{key}: compare-and-swap kept losing; too much contention"),
    })
}

/// Reads and checks the certificate record of `unit`: `None` when there is
/// none; an error when it cannot be read or is not usable (corrupt, wrong
/// names, key not matching).
async fn read_record(
    store: &dyn Store,
    ring: Option<&KeyRing>,
    unit: &CertUnit,
) -> Result<Option<CertRecord>, StoreError> {
    Ok(read_record_sealed(store, ring, unit)
        .await?
        .map(|(record, _)| record))
}

/// [`read_record`], with the ring key id the record is sealed under
/// (`None`: a plain record).
pub(crate) async fn read_record_sealed(
    store: &dyn Store,
    ring: Option<&KeyRing>,
    unit: &CertUnit,
) -> Result<Option<(CertRecord, Option<u32>)>, StoreError> {
    let key = unit.store_key();
    let Some(entry) = get_fenced(store, &key).await? else {
        return Ok(None);
    };
    let record = CertRecord::decode(ring, &key, &entry.value)?;
    check_record(unit, &record).map_err(|message| StoreError::Corrupt {
        key: key.clone(),
        message,
    })?;
    Ok(Some((record, sealed_key_id(&entry.value))))
}

/// Rewrites a certificate record sealed under an older ring key under the
/// primary, so that the old key can leave the key file (the operator drops
/// it after its grace period) without leaving the record unreadable to
/// the next pod. Under the unit's order lock, and only while the record is
/// still the one read: a replica ordering the unit holds the lock (this
/// one then leaves the record alone), and the fenced write cannot undo a
/// newer certificate.
pub(crate) struct Reseal<'a> {
    pub(crate) store: &'a Arc<dyn Store>,
    pub(crate) ring: &'a KeyRing,
    pub(crate) unit: &'a CertUnit,
    pub(crate) holder: &'a str,
    pub(crate) lock_ttl: Duration,
    pub(crate) metrics: &'a Arc<Metrics>,
}

impl Reseal<'_> {
    /// Whether the record was rewritten.
    pub(crate) async fn run(&self) -> Result<bool, StoreError> {
        let lock = LeaseLock::new(self.store.clone(), &self.unit.lock_name())
            .with_metrics(self.metrics.clone());
        let Some(lease) = lock.try_acquire(self.holder, self.lock_ttl).await? else {
            return Ok(false);
        };
        let written = self.locked(&lease).await;
        if let Err(e) = lock.release(&lease).await {
            debug!(unit = %self.unit.id, error = %e, "order lock not released; it expires by itself");
        }
        written
    }

    async fn locked(&self, lease: &Lease) -> Result<bool, StoreError> {
        let key = self.unit.store_key();
        let Some(entry) = get_fenced(self.store.as_ref(), &key).await? else {
            return Ok(false);
        };
        let Some(from) = sealed_key_id(&entry.value) else {
            return Ok(false);
        };
        let to = self.ring.primary_id();
        if from == to {
            return Ok(false);
        }
        let record = CertRecord::decode(Some(self.ring), &key, &entry.value)?;
        let bytes = record.encode(Some(self.ring), &key)?;
        put_fenced(self.store.as_ref(), &key, &bytes, lease).await?;
        info!(
            unit = %self.unit.id,
            from_key_id = %format!("{from:08x}"),
            to_key_id = %format!("{to:08x}"),
            "certificate record resealed under the primary cluster key"
        );
        Ok(true)
    }
}

/// One question to the CA for a certificate's renewal window, through
/// the shared state: a fresh answer in the store (another replica's, or
/// an earlier process's, with the CA's `Retry-After`) is used instead of
/// asking again; a new answer is stored for the others.
pub(crate) struct AriTask {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) ring: AtRestRing,
    pub(crate) events: mpsc::UnboundedSender<Input>,
    pub(crate) state_key: String,
    pub(crate) id: String,
    pub(crate) unit: CertUnit,
    pub(crate) serial: String,
    pub(crate) issuer: Arc<Issuer>,
}

impl AriTask {
    pub(crate) async fn run(self) {
        let now = now_unix_ms() / 1000;
        let shared = read_json::<UnitOrderState>(self.store.as_ref(), &self.state_key).await;
        if let Ok(Some(state)) = &shared
            && let Some(check) = state.fresh_ari(&self.serial, now)
        {
            self.report(check.window, check.next_check_unix);
            return;
        }
        let ring = self.ring.current();
        let Ok(Some(record)) = read_record(self.store.as_ref(), ring.as_deref(), &self.unit).await
        else {
            return;
        };
        if record.serial != self.serial {
            return;
        }
        let (window, retry_after) = match self.issuer.renewal_info(&record.chain_pem).await {
            Ok(Some(w)) => (
                Some(AriWindow {
                    start_unix: w.start_unix,
                    end_unix: w.end_unix,
                }),
                Some(w.check_again_after.as_secs()),
            ),
            Ok(None) => (None, None),
            Err(e) => {
                warn!(unit = %self.id, error = %one_line(&e.to_string()), "ACME renewal information unavailable");
                (None, e.retry_after().map(|d| d.as_secs()))
            }
        };
        let next_check_unix = ari_next_check(now, retry_after);
        let check = AriCheck {
            serial: self.serial.clone(),
            window,
            next_check_unix,
        };
        let stored = update_json(
            self.store.as_ref(),
            &self.state_key,
            |s: Option<UnitOrderState>| {
                let mut s = s.unwrap_or_default();
                s.ari = Some(check.clone());
                Ok::<_, std::convert::Infallible>(s)
            },
        )
        .await;
        if let Err(e) = stored {
            debug!(unit = %self.id, error = %e, "renewal information not shared");
        }
        self.report(window, next_check_unix);
    }

    fn report(&self, window: Option<AriWindow>, next_check_unix: u64) {
        let _ = self.events.send(Input::AriAnswered {
            id: self.id.clone(),
            serial: self.serial.clone(),
            window,
            next_check_unix,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acme::machine::{Hold, HostView, due_for_order};

    #[test]
    fn the_dns01_provider_is_built_once_per_block() {
        let slot = std::sync::Mutex::new(None);
        let mut builds = 0;
        let mut get = |key: &str| {
            built_for(&slot, &key.to_owned(), || {
                builds += 1;
                Ok::<_, ()>(Arc::new(builds))
            })
            .unwrap()
        };
        let first = get("a");
        assert!(
            Arc::ptr_eq(&first, &get("a")),
            "the same block: the same provider"
        );
        let other = get("b");
        assert!(!Arc::ptr_eq(&first, &other), "an edited block: a new one");
        assert!(Arc::ptr_eq(&other, &get("b")));
        assert_eq!(builds, 2);
        // A build that fails keeps nothing: the next order tries again.
        let failed: Result<Arc<i32>, &str> = built_for(&slot, &"c".to_owned(), || Err("no secret"));
        assert!(failed.is_err());
        assert_eq!(
            slot.lock().unwrap().as_ref().map(|(k, _)| k.clone()),
            Some("b".to_owned())
        );
    }

    #[test]
    fn a_busy_lock_waits_for_its_expiry_or_a_recheck() {
        let mut view = HostView {
            checked: true,
            ..HostView::default()
        };
        view.lock_busy_until = 1_005;
        assert_eq!(
            due_for_order("a.test", &view, true, None, 1_000),
            Err(Hold::LockBusy(1_005))
        );
        assert_eq!(due_for_order("a.test", &view, true, None, 1_005), Ok(()));
        // At the expiry when it is near, a few seconds on when it is far,
        // and never in a loop when the holder's clock disagrees.
        assert_eq!(
            busy_wait(10_000 + 2_500, 10_000),
            Duration::from_millis(2_500)
        );
        assert_eq!(busy_wait(10_000 + 60_000, 10_000), BUSY_RECHECK);
        assert_eq!(busy_wait(5_000, 10_000), BUSY_MIN_WAIT);
    }
}
