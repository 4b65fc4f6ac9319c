//! Lease locks on any [`Store`]: at most one holder per name at a time, with
//! an expiry, renewal and a fencing token.
//!
//! # The record
//!
//! A lock named `n` is the JSON record at `locks/n`:
//!
//! ```json
//! {"v":1,"holder":"proxy-0/4f1c","fence":7,"expires_at_unix_ms":1795960276000,"released":false}
//! ```
//!
//! It is created once (create-only) and never deleted: release marks it
//! `released`, so the fence only ever grows. Every change after creation
//! is a compare-and-swap against the version just read, so when several
//! waiters see a released or expired lease, exactly one of them replaces it
//! and the others see a conflict. The record is written without a store
//! TTL: expiry is the `expires_at_unix_ms` inside it, judged by the reader
//! (`lease_state`, a pure function of the record and the time). A record
//! may also list `guards`, the keys written through
//! [`put_fenced_by_claims`] (absent otherwise; readers of the plain format
//! ignore it).
//!
//! # Fences
//!
//! Each acquisition takes `fence = previous + 1` (1 for a new lock). A
//! holder that paused past its expiry (GC, a stalled node) may still
//! believe it holds the lease; [`put_fenced`] makes its late writes
//! harmless: the value carries the writer's fence, and the write is
//! refused when the lock record or the value already carries a newer one.
//! The check and the write are one atomic step ([`Store::put_fenced`]), so
//! a writer that was checked before a takeover and writes after it is
//! refused too:
//!
//! - memory: both keys under its one mutex; redb: one write transaction;
//!   file: under the `flock` of both keys (taken in key order), which a
//!   takeover's compare-and-swap of the lock record also takes; redis: one
//!   Lua script reading the lock record (`cjson`) and the value's header.
//! - object stores (S3, GCS, Azure) have conditional writes on one object
//!   only, so the fence lives in the value's own compare-and-swap
//!   ([`put_fenced_by_claims`]): a key is first registered in the lock
//!   record (compare-and-swap on it, under a fence not older than the
//!   record's), and each takeover, before it hands out its lease, claims
//!   every registered key by rewriting it under the new fence (or writing
//!   a claim marker, which reads as absent). A stale write that lands
//!   before the claim is read by it (as if written before the takeover);
//!   one that comes later loses its compare-and-swap to the claim, and the
//!   newer fence then refuses it.
//!
//! # Clocks
//!
//! Expiries are written and judged on the store's clock, never another
//! replica's: [`LeaseLock::store_now`] is this process's clock plus the
//! offset the store reports ([`Store::clock_offset_ms`]: Redis `TIME`, the
//! object store's `Last-Modified` of a probe it writes, the file volume's
//! modification time of a probe file; 0 for memory and redb, which live in
//! one process). The offset is learned every 30 s and cached
//! (`super::clock`), so a replica whose own clock is minutes off takes
//! an expired lease when the store's clock says so, and a live one never.
//! What remains is the offset's error: below a millisecond plus a round
//! trip on Redis and local disks, up to about a second on object stores
//! (whole-second timestamps, narrowed by successive readings);
//! [`LeaseKeeper`]'s safety margin (a sixth of the TTL) must exceed it
//! twice, so keep TTLs on object stores at 10 s or more. Fences protect
//! the data in any case. The local clock is injectable
//! ([`LeaseLock::with_clock`]) for tests: the store's time moves with it.
//!
//! # Holders
//!
//! A holder id names one contender: the node id plus something unique to
//! the process (a random suffix) is right. A lease still held under the same
//! holder id is not handed out again: a restarted process waits for its old
//! lease to expire rather than share it with a predecessor that may still be
//! running.
//! A caller that knows its predecessor is dead (a pod name runs once)
//! ends that lease with `LeaseLock::release_predecessor` instead.

use std::fmt;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Store, StoreError, Version, now_unix_ms};
use crate::metrics::Metrics;

/// Key prefix of lock records.
pub(crate) const LOCK_PREFIX: &str = "locks/";
/// Longest holder id.
pub(crate) const MAX_HOLDER_LEN: usize = 256;
/// Format version written in lock records.
const RECORD_FORMAT: u8 = 1;
/// Magic prefix of a fenced value ([`put_fenced`]).
pub(crate) const FENCED_MAGIC: &[u8; 4] = b"sbf1";
/// Magic prefix of a claim marker: a guarded key that had no value when a
/// new lease claimed it ([`put_fenced_by_claims`]); reads as absent.
pub(crate) const CLAIM_MAGIC: &[u8; 4] = b"sbfc";
/// Bytes before the value in a fenced value: the magic and the fence (u64
/// big-endian).
pub(crate) const FENCED_HEADER_LEN: usize = FENCED_MAGIC.len() + 8;
/// Most keys one lock guards under [`put_fenced_by_claims`].
pub(crate) const MAX_GUARDED_KEYS: usize = 64;
/// Compare-and-swap attempts of one fenced write or release before giving
/// up (each lost attempt means another writer made progress).
const MAX_CAS_ATTEMPTS: usize = 32;

/// A source of wall-clock unix milliseconds.
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// The lock record at `locks/<name>` (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockRecord {
    /// Record format, 1.
    pub v: u8,
    /// The current (or, when released, the last) holder.
    pub holder: String,
    /// Fence of the current (or last) lease.
    pub fence: u64,
    /// When the lease expires, unix milliseconds.
    pub expires_at_unix_ms: u64,
    /// Released by its holder.
    pub released: bool,
}

/// The record as stored: the public fields, plus the keys written under
/// [`put_fenced_by_claims`] (absent when there are none, so the format
/// stays the one older versions read and write).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct StoredRecord {
    #[serde(flatten)]
    record: LockRecord,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    guards: Vec<String>,
}

/// What a lock record means at a given time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LeaseState {
    /// No record yet: the first lease gets fence 1.
    Vacant,
    /// Released or expired: the next lease gets `last_fence + 1`.
    Free {
        /// Fence of the last lease.
        last_fence: u64,
    },
    /// Held until `expires_at_unix_ms`.
    Held {
        /// Fence of the current lease.
        fence: u64,
        /// When it expires.
        expires_at_unix_ms: u64,
    },
}

/// Whether a lease that expires at `expires_at_unix_ms` has expired at
/// `now_unix_ms` (the expiry instant itself counts as expired).
pub(crate) fn is_expired(expires_at_unix_ms: u64, now_unix_ms: u64) -> bool {
    now_unix_ms >= expires_at_unix_ms
}

/// The state of a lock given its record (if any) at time `now_unix_ms`.
pub(crate) fn lease_state(record: Option<&LockRecord>, now_unix_ms: u64) -> LeaseState {
    match record {
        None => LeaseState::Vacant,
        Some(r) if r.released || is_expired(r.expires_at_unix_ms, now_unix_ms) => {
            LeaseState::Free {
                last_fence: r.fence,
            }
        }
        Some(r) => LeaseState::Held {
            fence: r.fence,
            expires_at_unix_ms: r.expires_at_unix_ms,
        },
    }
}

/// The last instant at which a holder may still count on a lease expiring
/// at `expires_at_unix_ms`: a renewal not confirmed by then is reported as
/// lost, `safety_margin` before anyone else can take the lease.
pub(crate) fn renewal_deadline(expires_at_unix_ms: u64, safety_margin: Duration) -> u64 {
    expires_at_unix_ms.saturating_sub(duration_ms(safety_margin))
}

/// Whether `record` still shows `lease` as held at `now_unix_ms`; if not,
/// why. Renewal and release act only on a lease that is still theirs.
pub(crate) fn check_held(
    record: Option<&LockRecord>,
    lease: &Lease,
    now_unix_ms: u64,
) -> Result<(), LostReason> {
    let Some(r) = record else {
        return Err(LostReason::Missing);
    };
    if r.fence != lease.fence || r.holder != lease.holder {
        return Err(LostReason::TakenOver {
            holder: r.holder.clone(),
            fence: r.fence,
        });
    }
    if r.released {
        return Err(LostReason::Released);
    }
    if is_expired(r.expires_at_unix_ms, now_unix_ms) {
        return Err(LostReason::Expired {
            at_unix_ms: r.expires_at_unix_ms,
        });
    }
    Ok(())
}

/// A lease: proof that `holder` held lock `name` under `fence` until
/// `expires_at_unix_ms`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The lock name.
    pub name: String,
    /// Who holds it.
    pub holder: String,
    /// The fencing token: strictly greater than every earlier lease's.
    pub fence: u64,
    /// When it expires unless renewed, unix milliseconds.
    pub expires_at_unix_ms: u64,
    /// Version of the lock record as this lease last wrote it.
    pub version: Version,
    /// The lease duration, applied again by each renewal.
    pub ttl: Duration,
}

/// Why a lease is no longer held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LostReason {
    /// Another lease (or the same holder's later one) replaced it.
    TakenOver {
        /// The holder now on record.
        holder: String,
        /// Its fence.
        fence: u64,
    },
    /// It was released.
    Released,
    /// It expired before it was renewed.
    Expired {
        /// When.
        at_unix_ms: u64,
    },
    /// The lock record is gone (deleted by hand).
    Missing,
    /// A renewal could not be confirmed before the safety margin.
    NotConfirmed,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LostReason::TakenOver { holder, fence } => {
                write!(f, "taken over by {holder:?} with fence {fence}")
            }
            LostReason::Released => f.write_str("released"),
            LostReason::Expired { at_unix_ms } => write!(f, "expired at {at_unix_ms} (unix ms)"),
            LostReason::Missing => f.write_str("the lock record was deleted"),
            LostReason::NotConfirmed => {
                f.write_str("a renewal was not confirmed before the safety margin")
            }
        }
    }
}

/// Why renewing or releasing failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// The lease is no longer held: stop acting under it.
    #[error("lease on lock {name:?} (fence {fence}) is lost: {reason}")]
    Lost {
        /// The lock name.
        name: String,
        /// The lost lease's fence.
        fence: u64,
        /// Why.
        reason: LostReason,
    },
    /// The store failed; whether the lease is still held is unknown.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A lease lock named `name` in `store`. Cheap to clone.
#[derive(Clone)]
pub struct LeaseLock {
    store: Arc<dyn Store>,
    name: String,
    key: String,
    clock: Clock,
    /// The store's clock minus this process's, as last learned (shared by
    /// clones, so a keeper uses what its lock's acquisition learned).
    offset: Arc<AtomicI64>,
    metrics: Option<Arc<Metrics>>,
    poll_min: Duration,
    poll_max: Duration,
}

impl fmt::Debug for LeaseLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseLock")
            .field("backend", &self.store.backend())
            .field("name", &self.name)
            .finish()
    }
}

/// Outcome of one acquisition attempt.
enum Attempt {
    Acquired(Lease),
    /// Held by someone else until then (`None`: lost a race just now).
    Busy(Option<u64>),
}

impl LeaseLock {
    /// The lock `name` (the store key is `locks/<name>`, so `name` follows
    /// the key rules of [`super::validate_key`]; an invalid name makes every
    /// operation fail with [`StoreError::InvalidKey`]).
    pub fn new(store: Arc<dyn Store>, name: &str) -> Self {
        Self {
            store,
            name: name.to_owned(),
            key: format!("{LOCK_PREFIX}{name}"),
            clock: Arc::new(now_unix_ms),
            offset: Arc::new(AtomicI64::new(0)),
            metrics: None,
            poll_min: Duration::from_millis(50),
            poll_max: Duration::from_millis(250),
        }
    }

    /// Counts acquisitions in `store_lock_acquired_total{backend}`.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Uses another local wall clock (unix milliseconds), for tests: the
    /// store's clock is then this clock plus the store's offset
    /// ([`Store::clock_offset_ms`], measured against the real clock), so a
    /// test clock that jumps makes the store's time jump with it.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// How long [`LeaseLock::acquire`] pauses between attempts: a random
    /// duration in `min..=max` (default 50..=250 ms), shortened to wake when
    /// the current lease expires.
    pub fn with_poll_interval(mut self, min: Duration, max: Duration) -> Self {
        self.poll_min = min.min(max);
        self.poll_max = max.max(min);
        self
    }

    /// The lock name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The store key of the lock record.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The store's time as of the last offset learned (no store request).
    fn now(&self) -> u64 {
        let local = i64::try_from((self.clock)()).unwrap_or(i64::MAX);
        let now = local.saturating_add(self.offset.load(Ordering::Relaxed));
        u64::try_from(now).unwrap_or(0)
    }

    /// The store's time, unix ms: the clock lease expiries are written and
    /// judged on (see "Clocks" in the module docs). Asks the store for its
    /// offset, which the store caches.
    pub async fn store_now(&self) -> Result<u64, StoreError> {
        let offset = self.store.clock_offset_ms().await?;
        self.offset.store(offset, Ordering::Relaxed);
        Ok(self.now())
    }

    /// The lock record as stored now, if any.
    pub async fn current(&self) -> Result<Option<LockRecord>, StoreError> {
        Ok(self.read().await?.map(|(stored, _)| stored.record))
    }

    async fn read(&self) -> Result<Option<(StoredRecord, Version)>, StoreError> {
        match self.store.get(&self.key).await? {
            None => Ok(None),
            Some(entry) => Ok(Some((
                decode_stored(&self.key, &entry.value)?,
                entry.version,
            ))),
        }
    }

    /// One attempt: the lease when the lock was vacant, released or expired
    /// and this call won it; `None` when it is held (by anyone, `holder`
    /// included) or another contender won the race.
    ///
    /// # Errors
    /// [`StoreError::Config`] for an empty or over-long holder or a zero
    /// TTL; [`StoreError::Corrupt`] when the lock record is not one; the
    /// store's errors. After a [`StoreError::Timeout`] the write may have
    /// happened: the lease is then held by `holder` until it expires.
    pub async fn try_acquire(
        &self,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        match self.attempt(holder, ttl).await? {
            Attempt::Acquired(lease) => Ok(Some(lease)),
            Attempt::Busy(_) => Ok(None),
        }
    }

    async fn attempt(&self, holder: &str, ttl: Duration) -> Result<Attempt, StoreError> {
        check_request(holder, ttl)?;
        let current = self.read().await?;
        let now = self.store_now().await?;
        let fence = match lease_state(current.as_ref().map(|(r, _)| &r.record), now) {
            LeaseState::Held {
                expires_at_unix_ms, ..
            } => return Ok(Attempt::Busy(Some(expires_at_unix_ms))),
            LeaseState::Vacant => 1,
            LeaseState::Free { last_fence } => last_fence.saturating_add(1),
        };
        let record = LockRecord {
            v: RECORD_FORMAT,
            holder: holder.to_owned(),
            fence,
            expires_at_unix_ms: now.saturating_add(duration_ms(ttl)),
            released: false,
        };
        let guards = current
            .as_ref()
            .map(|(r, _)| r.guards.clone())
            .unwrap_or_default();
        let stored = StoredRecord { record, guards };
        let bytes = encode_stored(&stored);
        // No store TTL: the record (and its fence) must outlive the lease.
        let written = match &current {
            None => self.store.put_if_absent(&self.key, &bytes, None).await?,
            Some((_, version)) => {
                self.store
                    .compare_and_swap(&self.key, version, &bytes, None)
                    .await?
            }
        };
        let Some(version) = written else {
            return Ok(Attempt::Busy(None));
        };
        let StoredRecord { record, guards } = stored;
        // Writers under older fences are shut out of the guarded keys
        // before this lease is handed out (see "Fences").
        for key in &guards {
            if let Err(e) = claim(self.store.as_ref(), key, fence).await {
                let lease = Lease {
                    name: self.name.clone(),
                    holder: record.holder.clone(),
                    fence,
                    expires_at_unix_ms: record.expires_at_unix_ms,
                    version: version.clone(),
                    ttl,
                };
                // Not handed out: free it for the next attempt at once.
                let _ = self.release(&lease).await;
                return Err(e);
            }
        }
        if let Some(metrics) = &self.metrics {
            metrics.store.lock_acquired(self.store.backend());
        }
        Ok(Attempt::Acquired(Lease {
            name: self.name.clone(),
            holder: record.holder,
            fence,
            expires_at_unix_ms: record.expires_at_unix_ms,
            version,
            ttl,
        }))
    }

    /// Tries until the lease is won or `wait` has passed (`None` then),
    /// pausing a random poll interval between attempts (see
    /// [`LeaseLock::with_poll_interval`]). Store failures (`Backend`,
    /// `Timeout`) are retried until `wait` has passed and the last one is
    /// returned then; other errors return at once.
    pub async fn acquire(
        &self,
        holder: &str,
        ttl: Duration,
        wait: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        let deadline = Instant::now() + wait;
        loop {
            let (busy_until, last_error) = match self.attempt(holder, ttl).await {
                Ok(Attempt::Acquired(lease)) => return Ok(Some(lease)),
                Ok(Attempt::Busy(until)) => (until, None),
                Err(e @ (StoreError::Backend { .. } | StoreError::Timeout { .. })) => {
                    (None, Some(e))
                }
                Err(e) => return Err(e),
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return match last_error {
                    Some(e) => Err(e),
                    None => Ok(None),
                };
            }
            let until_expiry = busy_until.map(|at| {
                // Wake just after the expiry, not before it.
                Duration::from_millis(at.saturating_sub(self.now()).saturating_add(1))
            });
            let jitter = random_between(self.poll_min, self.poll_max);
            tokio::time::sleep(poll_pause(jitter, until_expiry, left)).await;
        }
    }

    /// Extends `lease` by its TTL from now. Refused once it was released,
    /// expired or taken over: a lease that lapsed is not revived, because a
    /// holder must not trust work done while it might not have held it.
    pub async fn renew(&self, lease: &Lease) -> Result<Lease, LockError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (stored, version) = self.read_held(lease).await?;
            let now = self.store_now().await?;
            let renewed = StoredRecord {
                record: LockRecord {
                    expires_at_unix_ms: now.saturating_add(duration_ms(lease.ttl)),
                    ..stored.record
                },
                guards: stored.guards,
            };
            if let Some(version) = self
                .store
                .compare_and_swap(&self.key, &version, &encode_stored(&renewed), None)
                .await?
            {
                return Ok(Lease {
                    expires_at_unix_ms: renewed.record.expires_at_unix_ms,
                    version,
                    ..lease.clone()
                });
            }
            // Changed since the read: a takeover (the next read says so) or
            // a concurrent renewal of this same lease (try again).
        }
        Err(contention(&self.key).into())
    }

    /// Reads the record and checks the lease is still held.
    async fn read_held(&self, lease: &Lease) -> Result<(StoredRecord, Version), LockError> {
        let current = self.read().await?;
        let now = self.store_now().await?;
        check_held(current.as_ref().map(|(r, _)| &r.record), lease, now)
            .map_err(|reason| self.lost(lease, reason))?;
        current.ok_or_else(|| self.lost(lease, LostReason::Missing))
    }

    fn lost(&self, lease: &Lease, reason: LostReason) -> LockError {
        LockError::Lost {
            name: self.name.clone(),
            fence: lease.fence,
            reason,
        }
    }

    /// Releases `lease` so a waiter can take the lock at once; the record
    /// keeps its fence. `true` when released (an expired lease that nobody
    /// took over yet counts); `false` when it was released already or taken
    /// over, in which case nothing is written.
    pub async fn release(&self, lease: &Lease) -> Result<bool, StoreError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let current = self.read().await?;
            let now = self.store_now().await?;
            let Some((StoredRecord { record, guards }, version)) = current else {
                return Ok(false);
            };
            if record.holder != lease.holder || record.fence != lease.fence || record.released {
                return Ok(false);
            }
            let released = StoredRecord {
                record: LockRecord {
                    released: true,
                    expires_at_unix_ms: record.expires_at_unix_ms.min(now),
                    ..record
                },
                guards,
            };
            if self
                .store
                .compare_and_swap(&self.key, &version, &encode_stored(&released), None)
                .await?
                .is_some()
            {
                return Ok(true);
            }
            // A concurrent renewal by our own keeper changed the version.
        }
        Err(contention(&self.key))
    }
}

fn check_request(holder: &str, ttl: Duration) -> Result<(), StoreError> {
    if holder.is_empty() || holder.len() > MAX_HOLDER_LEN {
        return Err(StoreError::Config(format!(
            "lock holder id must be 1 to {MAX_HOLDER_LEN} bytes, got {}",
            holder.len()
        )));
    }
    if duration_ms(ttl) == 0 {
        return Err(StoreError::Config(
            "lease TTL must be at least 1 ms".to_owned(),
        ));
    }
    Ok(())
}

/// The pause before the next acquisition attempt: the jittered poll
/// interval, cut short when the lease expires sooner, and never past the
/// caller's deadline.
pub(crate) fn poll_pause(
    jitter: Duration,
    until_expiry: Option<Duration>,
    left: Duration,
) -> Duration {
    let pause = match until_expiry {
        Some(expiry) => jitter.min(expiry),
        None => jitter,
    };
    pause.min(left)
}

fn random_between(min: Duration, max: Duration) -> Duration {
    let (lo, hi) = (duration_ms(min), duration_ms(max));
    if hi <= lo {
        return min;
    }
    Duration::from_millis(rand::random_range(lo..=hi))
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
fn encode_record(record: &LockRecord) -> Vec<u8> {
    encode_stored(&StoredRecord {
        record: record.clone(),
        guards: Vec::new(),
    })
}

#[cfg(test)]
fn decode_record(key: &str, bytes: &[u8]) -> Result<LockRecord, StoreError> {
    decode_stored(key, bytes).map(|s| s.record)
}

fn encode_stored(stored: &StoredRecord) -> Vec<u8> {
    // Serializing a struct of strings, integers and bools cannot fail.
    serde_json::to_vec(stored).unwrap_or_default()
}

/// The fence of the lock record `bytes` stored at `key`: what a backend's
/// atomic [`Store::put_fenced`] compares with the writer's.
///
/// # Errors
/// [`StoreError::Corrupt`] when `bytes` is not a lock record.
pub(crate) fn record_fence(key: &str, bytes: &[u8]) -> Result<u64, StoreError> {
    decode_stored(key, bytes).map(|s| s.record.fence)
}

fn decode_stored(key: &str, bytes: &[u8]) -> Result<StoredRecord, StoreError> {
    let stored: StoredRecord = serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        key: key.to_owned(),
        message: format!("not a lock record: {e}"),
    })?;
    let record = &stored.record;
    if record.v != RECORD_FORMAT {
        return Err(StoreError::Corrupt {
            key: key.to_owned(),
            message: format!(
                "lock record format {} (this version reads {RECORD_FORMAT})",
                record.v
            ),
        });
    }
    Ok(stored)
}

fn contention(key: &str) -> StoreError {
    StoreError::Backend {
        backend: "lock",
        message: format!(
            "{key}: compare-and-swap lost {MAX_CAS_ATTEMPTS} times in a row; too much contention"
        ),
    }
}

impl LeaseLock {
    /// Ends the lease of `predecessor`, a holder the caller knows to be
    /// gone (its own previous process: a restarted pod with the same node
    /// id and another boot id), so the next acquisition need not wait out
    /// its expiry. Marks the record released by compare-and-swap against
    /// the version read here; the fence stays, and the next lease takes
    /// `fence + 1` as after any release, so the predecessor's late writes
    /// are still refused. `true` when it released that lease; `false` when
    /// the record names another holder, is released already, or changed
    /// meanwhile (nothing is written then).
    pub(crate) async fn release_predecessor(&self, predecessor: &str) -> Result<bool, StoreError> {
        let Some((mut stored, version)) = self.read().await? else {
            return Ok(false);
        };
        let record = &mut stored.record;
        if record.holder != predecessor || record.released {
            return Ok(false);
        }
        record.released = true;
        record.expires_at_unix_ms = record.expires_at_unix_ms.min(self.now());
        // The guards stay: the next acquisition claims them under its fence.
        Ok(self
            .store
            .compare_and_swap(&self.key, &version, &encode_stored(&stored), None)
            .await?
            .is_some())
    }
}

// ---------------------------------------------------------------------------
// Fenced writes

/// A value written by [`put_fenced`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FencedEntry {
    /// The bytes, without the fence header.
    pub value: Vec<u8>,
    /// The fence it was written under, or a later one that claimed it
    /// ([`put_fenced_by_claims`]: on object stores a takeover raises the
    /// fence of the keys its lock guards, keeping their values).
    pub fence: u64,
    /// Its version in the store.
    pub version: Version,
}

/// Writes `value` at `key` under `lease`'s fence, unless a newer fence
/// exists: either on the lock record `locks/<lease.name>` or in the value
/// already at `key`. The value is stored with a 12-byte header carrying
/// the fence (read it back with [`get_fenced`]). The check and the write
/// are one atomic step ([`Store::put_fenced`]), so once a newer lease has
/// been handed out no write under this one lands, and a value written
/// under a newer fence is never overwritten by an older one.
///
/// Guard each key with one lock name only: fences of different locks are
/// not comparable. A value at `key` that was not written by `put_fenced`
/// counts as fence 0.
///
/// # Errors
/// [`StoreError::Fenced`] when a newer fence exists; the store's errors.
pub async fn put_fenced(
    store: &dyn Store,
    key: &str,
    value: &[u8],
    lease: &Lease,
) -> Result<Version, StoreError> {
    let lock_key = format!("{LOCK_PREFIX}{}", lease.name);
    let bytes = fenced_bytes(FENCED_MAGIC, lease.fence, value);
    store.put_fenced(key, &bytes, &lock_key, lease.fence).await
}

fn fenced_bytes(magic: &[u8; 4], fence: u64, value: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(FENCED_HEADER_LEN + value.len());
    bytes.extend_from_slice(magic);
    bytes.extend_from_slice(&fence.to_be_bytes());
    bytes.extend_from_slice(value);
    bytes
}

/// The fence a stored value was written (or claimed) under: 0 for a value
/// not written by [`put_fenced`].
pub(crate) fn value_fence(bytes: &[u8]) -> u64 {
    match bytes.first_chunk::<4>() {
        Some(magic) if magic == FENCED_MAGIC || magic == CLAIM_MAGIC => {
            split_fenced_any(bytes).map_or(0, |(fence, _)| fence)
        }
        _ => 0,
    }
}

/// [`Store::put_fenced`] on single-key operations alone, for stores that
/// cannot check two keys in one step (object stores), and the default.
///
/// `bytes` is the fenced value, `fence` its fence. First the lock record
/// at `lock_key` must show no newer fence and list `key` among the keys it
/// guards (added by compare-and-swap on the lock record); then the value
/// is replaced by compare-and-swap unless it carries a newer fence. Every
/// takeover changes the lock record by compare-and-swap too, and before
/// handing out its lease raises the fence of every guarded key (rewriting
/// each value under the new fence, or writing a claim marker where there
/// is none). So a stale writer's value write either lands before that
/// claim (and the new holder's claim reads it: it was, in effect, written
/// before the takeover) or fails its compare-and-swap against the claimed
/// value, whose fence then refuses it; and a key it registers after the
/// takeover fails the lock record's compare-and-swap.
///
/// # Errors
/// [`StoreError::Fenced`]; [`StoreError::Config`] past
/// `MAX_GUARDED_KEYS` keys for one lock; the store's errors.
pub async fn put_fenced_by_claims<S: Store + ?Sized>(
    store: &S,
    key: &str,
    bytes: &[u8],
    lock_key: &str,
    fence: u64,
) -> Result<Version, StoreError> {
    let mut registered = false;
    for _ in 0..MAX_CAS_ATTEMPTS {
        // A lock record deleted by hand keeps no fence to check against.
        let Some(entry) = store.get(lock_key).await? else {
            registered = true;
            break;
        };
        let mut stored = decode_stored(lock_key, &entry.value)?;
        if stored.record.fence > fence {
            return Err(fenced(key, fence, stored.record.fence));
        }
        if stored.guards.iter().any(|g| g == key) {
            registered = true;
            break;
        }
        if stored.guards.len() >= MAX_GUARDED_KEYS {
            return Err(StoreError::Config(format!(
                "lock {lock_key:?} already guards {MAX_GUARDED_KEYS} keys; guard {key:?} with another lock"
            )));
        }
        stored.guards.push(key.to_owned());
        if store
            .compare_and_swap(lock_key, &entry.version, &encode_stored(&stored), None)
            .await?
            .is_some()
        {
            registered = true;
            break;
        }
        // The record changed (a renewal, or a takeover): look again.
    }
    if !registered {
        return Err(contention(lock_key));
    }
    for _ in 0..MAX_CAS_ATTEMPTS {
        let written = match store.get(key).await? {
            None => store.put_if_absent(key, bytes, None).await?,
            Some(existing) => {
                let existing_fence = value_fence(&existing.value);
                if existing_fence > fence {
                    return Err(fenced(key, fence, existing_fence));
                }
                store
                    .compare_and_swap(key, &existing.version, bytes, None)
                    .await?
            }
        };
        if let Some(version) = written {
            return Ok(version);
        }
    }
    Err(contention(key))
}

/// Raises the fence of the guarded `key` to `fence` (see
/// [`put_fenced_by_claims`]): the same value under the new fence, or a
/// claim marker where there is no value.
async fn claim(store: &dyn Store, key: &str, fence: u64) -> Result<(), StoreError> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let written = match store.get(key).await? {
            None => {
                store
                    .put_if_absent(key, &fenced_bytes(CLAIM_MAGIC, fence, &[]), None)
                    .await?
            }
            Some(existing) => {
                if value_fence(&existing.value) >= fence {
                    return Ok(());
                }
                let claimed = match existing.value.first_chunk::<4>() {
                    Some(m) if m == FENCED_MAGIC || m == CLAIM_MAGIC => {
                        let (_, value) = split_fenced_any(&existing.value).unwrap_or((0, &[]));
                        fenced_bytes(m, fence, value)
                    }
                    // Written without put_fenced: kept as the value.
                    _ => fenced_bytes(FENCED_MAGIC, fence, &existing.value),
                };
                store
                    .compare_and_swap(key, &existing.version, &claimed, None)
                    .await?
            }
        };
        if written.is_some() {
            return Ok(());
        }
    }
    Err(contention(key))
}

/// Reads a value written by [`put_fenced`]; a claim marker (a guarded key
/// with no value yet) reads as absent.
///
/// # Errors
/// [`StoreError::Corrupt`] when the value at `key` was not written by
/// [`put_fenced`]; the store's errors.
pub async fn get_fenced(store: &dyn Store, key: &str) -> Result<Option<FencedEntry>, StoreError> {
    let Some(entry) = store.get(key).await? else {
        return Ok(None);
    };
    if entry.value.starts_with(CLAIM_MAGIC) {
        return Ok(None);
    }
    let (fence, value) = split_fenced(&entry.value).ok_or_else(|| StoreError::Corrupt {
        key: key.to_owned(),
        message: "not a fenced value (written without put_fenced)".to_owned(),
    })?;
    Ok(Some(FencedEntry {
        value: value.to_vec(),
        fence,
        version: entry.version,
    }))
}

fn split_fenced(bytes: &[u8]) -> Option<(u64, &[u8])> {
    bytes.strip_prefix(FENCED_MAGIC)?;
    split_fenced_any(bytes)
}

/// The fence and value after either magic (not checked).
fn split_fenced_any(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let rest = bytes.get(FENCED_MAGIC.len()..)?;
    let (fence, value) = rest.split_first_chunk::<8>()?;
    Some((u64::from_be_bytes(*fence), value))
}

/// The decision of an atomic fenced write, for a backend that reads both
/// records under its own lock or transaction: refuses when the live lock
/// record at `lock_key` or the live value at `key` carries a newer fence
/// than `fence`.
///
/// # Errors
/// [`StoreError::Fenced`] when a newer fence exists; [`StoreError::Corrupt`]
/// when the lock record is not one.
pub(crate) fn check_fence(
    key: &str,
    lock_key: &str,
    fence: u64,
    lock_record: Option<&[u8]>,
    value: Option<&[u8]>,
) -> Result<(), StoreError> {
    let newest = lock_record
        .map(|bytes| record_fence(lock_key, bytes))
        .transpose()?
        .unwrap_or(0)
        .max(value.map_or(0, value_fence));
    if newest > fence {
        return Err(fenced(key, fence, newest));
    }
    Ok(())
}

fn fenced(key: &str, fence: u64, newest: u64) -> StoreError {
    StoreError::Fenced {
        key: key.to_owned(),
        fence,
        newest,
    }
}

// ---------------------------------------------------------------------------
// Keeping a lease

/// When a [`LeaseKeeper`] renews and when it gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeeperTiming {
    /// Pause after a confirmed renewal before the next one.
    pub renew_every: Duration,
    /// Pause after a failed renewal attempt (store error) before retrying.
    pub retry_every: Duration,
    /// A renewal not confirmed by `expires_at - safety_margin` makes the
    /// keeper report the lease lost.
    pub safety_margin: Duration,
}

impl KeeperTiming {
    /// Renew every third of the TTL, retry every fifteenth, report loss a
    /// sixth of the TTL before the expiry.
    pub fn for_ttl(ttl: Duration) -> Self {
        Self {
            renew_every: ttl / 3,
            retry_every: (ttl / 15).max(Duration::from_millis(5)),
            safety_margin: ttl / 6,
        }
    }
}

/// Renews a lease in a background task and says as soon as it is lost.
///
/// [`LeaseKeeper::held`] flips to `false` (once, for good) when a renewal
/// is refused (taken over, released, expired) or cannot be confirmed by
/// `expires_at - safety_margin` (store unreachable, slow, or a run of
/// errors): the holder learns of the loss *before* another contender can
/// take the lease, and must stop acting under it. Dropping the keeper stops
/// renewing (the lease then expires); [`LeaseKeeper::release`] releases it.
///
/// ```no_run
/// # use std::{sync::Arc, time::Duration};
/// # use sbmesh::{LeaseKeeper, LeaseLock, Store};
/// # async fn demo(store: Arc<dyn Store>) -> Result<(), Box<dyn std::error::Error>> {
/// let lock = LeaseLock::new(store, "order-api.example.com");
/// let ttl = Duration::from_secs(30);
/// if let Some(lease) = lock.acquire("proxy-0/4f1c", ttl, Duration::from_secs(60)).await? {
///     let keeper = LeaseKeeper::spawn(lock, lease);
///     let mut held = keeper.held();
///     tokio::select! {
///         _ = held.wait_for(|held| !*held) => { /* lost: abandon the work */ }
///         _ = async { /* the work, writing with put_fenced(.., &keeper.lease()) */ } => {}
///     }
///     keeper.release().await?;
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct LeaseKeeper {
    lock: LeaseLock,
    lease: Arc<Mutex<Lease>>,
    held: watch::Receiver<bool>,
    task: JoinHandle<()>,
}

impl LeaseKeeper {
    /// Starts renewing `lease` with [`KeeperTiming::for_ttl`].
    pub fn spawn(lock: LeaseLock, lease: Lease) -> Self {
        let timing = KeeperTiming::for_ttl(lease.ttl);
        Self::spawn_with(lock, lease, timing)
    }

    /// Starts renewing `lease` with the given timing.
    pub fn spawn_with(lock: LeaseLock, lease: Lease, timing: KeeperTiming) -> Self {
        let (tx, held) = watch::channel(true);
        let shared = Arc::new(Mutex::new(lease.clone()));
        let task = tokio::spawn(keep(lock.clone(), lease, timing, tx, Arc::clone(&shared)));
        Self {
            lock,
            lease: shared,
            held,
            task,
        }
    }

    /// "Still held": `true` until the lease is known or feared lost.
    pub fn held(&self) -> watch::Receiver<bool> {
        self.held.clone()
    }

    /// Whether the lease is still held, as far as the keeper knows.
    pub fn is_held(&self) -> bool {
        *self.held.borrow()
    }

    /// The lease as last renewed (its fence never changes).
    pub fn lease(&self) -> Lease {
        self.lease
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops renewing and releases the lease; `false` when it was no
    /// longer held.
    pub async fn release(self) -> Result<bool, StoreError> {
        self.task.abort();
        let lease = self.lease();
        self.lock.release(&lease).await
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn keep(
    lock: LeaseLock,
    mut lease: Lease,
    timing: KeeperTiming,
    held: watch::Sender<bool>,
    shared: Arc<Mutex<Lease>>,
) {
    let mut pause = timing.renew_every;
    loop {
        let deadline = renewal_deadline(lease.expires_at_unix_ms, timing.safety_margin);
        let left = Duration::from_millis(deadline.saturating_sub(lock.now()));
        // Sleep no further than the deadline: waking there with the
        // renewal unconfirmed is itself the loss.
        tokio::time::sleep(pause.min(left)).await;
        let left = Duration::from_millis(deadline.saturating_sub(lock.now()));
        if left.is_zero() {
            return report_lost(&lock, &lease, &held, LostReason::NotConfirmed);
        }
        match tokio::time::timeout(left, lock.renew(&lease)).await {
            Ok(Ok(renewed)) => {
                lease = renewed;
                *shared.lock().unwrap_or_else(PoisonError::into_inner) = lease.clone();
                pause = timing.renew_every;
            }
            Ok(Err(LockError::Lost { reason, .. })) => {
                return report_lost(&lock, &lease, &held, reason);
            }
            Ok(Err(LockError::Store(e))) => {
                tracing::warn!(lock = %lock.name, fence = lease.fence, error = %e, "lease renewal failed; retrying");
                pause = timing.retry_every;
            }
            Err(_) => return report_lost(&lock, &lease, &held, LostReason::NotConfirmed),
        }
    }
}

fn report_lost(lock: &LeaseLock, lease: &Lease, held: &watch::Sender<bool>, reason: LostReason) {
    tracing::warn!(lock = %lock.name, fence = lease.fence, %reason, "lease lost");
    held.send_replace(false);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(fence: u64, expires: u64, released: bool) -> LockRecord {
        LockRecord {
            v: 1,
            holder: "a".into(),
            fence,
            expires_at_unix_ms: expires,
            released,
        }
    }

    fn lease(holder: &str, fence: u64) -> Lease {
        Lease {
            name: "n".into(),
            holder: holder.into(),
            fence,
            expires_at_unix_ms: 1_000,
            version: Version("1".into()),
            ttl: Duration::from_millis(100),
        }
    }

    #[test]
    fn expiry_is_inclusive() {
        assert!(!is_expired(1_000, 999));
        assert!(is_expired(1_000, 1_000));
        assert!(is_expired(1_000, 1_001));
        assert!(is_expired(0, 0));
    }

    #[test]
    fn lease_state_from_record_and_time() {
        assert_eq!(lease_state(None, 5), LeaseState::Vacant);
        assert_eq!(
            lease_state(Some(&record(3, 1_000, false)), 999),
            LeaseState::Held {
                fence: 3,
                expires_at_unix_ms: 1_000
            }
        );
        assert_eq!(
            lease_state(Some(&record(3, 1_000, false)), 1_000),
            LeaseState::Free { last_fence: 3 }
        );
        // Released before expiry: free at once, fence kept.
        assert_eq!(
            lease_state(Some(&record(3, 1_000, true)), 10),
            LeaseState::Free { last_fence: 3 }
        );
    }

    #[test]
    fn held_check_names_the_reason() {
        let mine = lease("a", 3);
        assert_eq!(
            check_held(Some(&record(3, 1_000, false)), &mine, 999),
            Ok(())
        );
        assert_eq!(
            check_held(Some(&record(3, 1_000, false)), &mine, 1_000),
            Err(LostReason::Expired { at_unix_ms: 1_000 })
        );
        assert_eq!(
            check_held(Some(&record(3, 1_000, true)), &mine, 10),
            Err(LostReason::Released)
        );
        assert_eq!(
            check_held(Some(&record(4, 1_000, false)), &mine, 10),
            Err(LostReason::TakenOver {
                holder: "a".into(),
                fence: 4
            })
        );
        assert!(matches!(
            check_held(Some(&record(3, 1_000, false)), &lease("b", 3), 10),
            Err(LostReason::TakenOver { .. })
        ));
        assert_eq!(check_held(None, &mine, 10), Err(LostReason::Missing));
    }

    #[test]
    fn renewal_deadline_keeps_the_margin() {
        assert_eq!(
            renewal_deadline(10_000, Duration::from_millis(1_500)),
            8_500
        );
        assert_eq!(renewal_deadline(100, Duration::from_secs(1)), 0);
        let t = KeeperTiming::for_ttl(Duration::from_secs(30));
        assert_eq!(t.renew_every, Duration::from_secs(10));
        assert_eq!(t.safety_margin, Duration::from_secs(5));
        // Two renewals fit before the deadline.
        assert!(t.renew_every * 2 < Duration::from_secs(30) - t.safety_margin);
    }

    #[test]
    fn poll_pause_wakes_at_expiry_and_deadline() {
        let ms = Duration::from_millis;
        assert_eq!(poll_pause(ms(200), None, ms(1_000)), ms(200));
        assert_eq!(poll_pause(ms(200), Some(ms(30)), ms(1_000)), ms(30));
        assert_eq!(poll_pause(ms(200), Some(ms(500)), ms(1_000)), ms(200));
        assert_eq!(poll_pause(ms(200), None, ms(10)), ms(10));
        for _ in 0..100 {
            let j = random_between(ms(50), ms(250));
            assert!(j >= ms(50) && j <= ms(250));
        }
        assert_eq!(random_between(ms(7), ms(7)), ms(7));
    }

    #[test]
    fn records_round_trip_and_reject_garbage() {
        let r = record(9, 123, true);
        assert_eq!(decode_record("k", &encode_record(&r)).unwrap(), r);
        assert!(matches!(
            decode_record("k", b"{}"),
            Err(StoreError::Corrupt { .. })
        ));
        let mut future = r.clone();
        future.v = 2;
        assert!(matches!(
            decode_record("k", &encode_record(&future)),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[test]
    fn fenced_values_split() {
        let mut bytes = FENCED_MAGIC.to_vec();
        bytes.extend_from_slice(&7u64.to_be_bytes());
        bytes.extend_from_slice(b"abc");
        assert_eq!(split_fenced(&bytes), Some((7, &b"abc"[..])));
        assert_eq!(split_fenced(b"sbf1\0\0"), None);
        assert_eq!(split_fenced(b"plain"), None);
    }

    #[test]
    fn stored_records_keep_the_plain_format_without_guards() {
        let plain = br#"{"v":1,"holder":"a","fence":4,"expires_at_unix_ms":9,"released":false}"#;
        let stored = decode_stored("k", plain).unwrap();
        assert!(stored.guards.is_empty());
        assert_eq!(encode_stored(&stored), plain.to_vec());
        assert_eq!(record_fence("k", plain).unwrap(), 4);
        let guarded = StoredRecord {
            guards: vec!["certs/a".into()],
            ..stored
        };
        let bytes = encode_stored(&guarded);
        assert_eq!(decode_stored("k", &bytes).unwrap(), guarded);
        // What an older reader decodes: the plain record.
        let older: LockRecord = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(older, guarded.record);
        assert!(record_fence("k", b"[]").is_err());
    }

    #[test]
    fn value_fences_of_each_form() {
        assert_eq!(value_fence(&fenced_bytes(FENCED_MAGIC, 7, b"abc")), 7);
        assert_eq!(value_fence(&fenced_bytes(CLAIM_MAGIC, 9, b"")), 9);
        assert_eq!(value_fence(b"plain value"), 0);
        assert_eq!(value_fence(b"sbf1\0"), 0);
        assert_eq!(value_fence(b""), 0);
    }

    #[tokio::test]
    async fn claims_register_keys_and_takeovers_raise_them() {
        use crate::store::memory::MemoryStore;
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let lock = LeaseLock::new(Arc::clone(&store), "n");
        let ttl = Duration::from_secs(30);
        let first = lock.try_acquire("a", ttl).await.unwrap().unwrap();
        let bytes = fenced_bytes(FENCED_MAGIC, first.fence, b"v");
        put_fenced_by_claims(store.as_ref(), "k/v", &bytes, lock.key(), first.fence)
            .await
            .unwrap();
        let (stored, _) = lock.read().await.unwrap().unwrap();
        assert_eq!(stored.guards, vec!["k/v".to_owned()]);
        // A guarded key that lost its value gets a claim marker.
        let bytes = fenced_bytes(FENCED_MAGIC, first.fence, b"w");
        put_fenced_by_claims(store.as_ref(), "k/w", &bytes, lock.key(), first.fence)
            .await
            .unwrap();
        store.delete("k/w").await.unwrap();
        assert!(lock.release(&first).await.unwrap());

        let second = lock.try_acquire("b", ttl).await.unwrap().unwrap();
        let v = get_fenced(store.as_ref(), "k/v").await.unwrap().unwrap();
        assert_eq!((v.value.as_slice(), v.fence), (&b"v"[..], second.fence));
        assert_eq!(get_fenced(store.as_ref(), "k/w").await.unwrap(), None);
        let marker = store.get("k/w").await.unwrap().unwrap();
        assert_eq!(value_fence(&marker.value), second.fence);
        // The guards survive renewals, releases and takeovers.
        let renewed = lock.renew(&second).await.unwrap();
        assert!(lock.release(&renewed).await.unwrap());
        let (stored, _) = lock.read().await.unwrap().unwrap();
        assert_eq!(stored.guards.len(), 2);

        // Past the limit: a clear error naming the lock.
        let third = lock.try_acquire("c", ttl).await.unwrap().unwrap();
        for i in 2..MAX_GUARDED_KEYS {
            let bytes = fenced_bytes(FENCED_MAGIC, third.fence, b"x");
            put_fenced_by_claims(
                store.as_ref(),
                &format!("k/{i}"),
                &bytes,
                lock.key(),
                third.fence,
            )
            .await
            .unwrap();
        }
        let bytes = fenced_bytes(FENCED_MAGIC, third.fence, b"x");
        match put_fenced_by_claims(store.as_ref(), "k/over", &bytes, lock.key(), third.fence).await
        {
            Err(StoreError::Config(message)) => assert!(message.contains("locks/n"), "{message}"),
            other => panic!("over the guard limit: {other:?}"),
        }
    }

    #[test]
    fn requests_are_checked() {
        assert!(check_request("", Duration::from_secs(1)).is_err());
        assert!(check_request(&"h".repeat(257), Duration::from_secs(1)).is_err());
        assert!(check_request("h", Duration::ZERO).is_err());
        assert!(check_request("h", Duration::from_millis(1)).is_ok());
    }
}
