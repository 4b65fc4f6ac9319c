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
//! ([`lease_state`], a pure function of the record and the time).
//!
//! # Fences
//!
//! Each acquisition takes `fence = previous + 1` (1 for a new lock). A
//! holder that paused past its expiry (GC, a stalled node) may still
//! believe it holds the lease; [`put_fenced`] makes its late writes
//! harmless: it refuses when the lock record already carries a newer fence,
//! and it embeds the writer's fence in the value and replaces a value only
//! if that value's fence is not newer, so a value written under fence 8 is
//! never overwritten under fence 7.
//!
//! # Clocks
//!
//! Expiry compares wall-clock unix milliseconds ([`now_unix_ms`]) of
//! different replicas, so their clocks must agree to well within the TTL
//! (NTP keeps them within milliseconds). A replica whose clock runs ahead by
//! `d` takes an expired lease up to `d` early; [`LeaseKeeper`]'s safety
//! margin absorbs skew smaller than the margin, and fences protect the data
//! in any case. The clock is injectable ([`LeaseLock::with_clock`]) for
//! tests.
//!
//! # Holders
//!
//! A holder id names one contender: the node id plus something unique to
//! the process (a random suffix) is right. A lease still held under the same
//! holder id is not handed out again: a restarted process waits for its old
//! lease to expire rather than share it with a predecessor that may still be
//! running.
//! A caller that knows its predecessor is dead (a pod name runs once)
//! ends that lease with [`LeaseLock::release_predecessor`] instead.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Store, StoreError, Version, now_unix_ms};
use crate::metrics::Metrics;

/// Key prefix of lock records.
pub const LOCK_PREFIX: &str = "locks/";
/// Longest holder id.
pub const MAX_HOLDER_LEN: usize = 256;
/// Format version written in lock records.
const RECORD_FORMAT: u8 = 1;
/// Magic prefix of a fenced value ([`put_fenced`]).
const FENCED_MAGIC: &[u8; 4] = b"sbf1";
const FENCED_HEADER_LEN: usize = FENCED_MAGIC.len() + 8;
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

/// What a lock record means at a given time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseState {
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
pub fn is_expired(expires_at_unix_ms: u64, now_unix_ms: u64) -> bool {
    now_unix_ms >= expires_at_unix_ms
}

/// The state of a lock given its record (if any) at time `now_unix_ms`.
pub fn lease_state(record: Option<&LockRecord>, now_unix_ms: u64) -> LeaseState {
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
pub fn renewal_deadline(expires_at_unix_ms: u64, safety_margin: Duration) -> u64 {
    expires_at_unix_ms.saturating_sub(duration_ms(safety_margin))
}

/// Whether `record` still shows `lease` as held at `now_unix_ms`; if not,
/// why. Renewal and release act only on a lease that is still theirs.
pub fn check_held(
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

    /// Uses another wall clock (unix milliseconds), for tests.
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
    pub fn name(&self) -> &str {
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

    fn now(&self) -> u64 {
        (self.clock)()
    }

    /// The lock record as stored now, if any.
    pub async fn current(&self) -> Result<Option<LockRecord>, StoreError> {
        Ok(self.read().await?.map(|(record, _)| record))
    }

    async fn read(&self) -> Result<Option<(LockRecord, Version)>, StoreError> {
        match self.store.get(&self.key).await? {
            None => Ok(None),
            Some(entry) => Ok(Some((
                decode_record(&self.key, &entry.value)?,
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
        let now = self.now();
        let fence = match lease_state(current.as_ref().map(|(r, _)| r), now) {
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
        let bytes = encode_record(&record);
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
            let (record, version) = self.read_held(lease).await?;
            let now = self.now();
            let renewed = LockRecord {
                expires_at_unix_ms: now.saturating_add(duration_ms(lease.ttl)),
                ..record
            };
            if let Some(version) = self
                .store
                .compare_and_swap(&self.key, &version, &encode_record(&renewed), None)
                .await?
            {
                return Ok(Lease {
                    expires_at_unix_ms: renewed.expires_at_unix_ms,
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
    async fn read_held(&self, lease: &Lease) -> Result<(LockRecord, Version), LockError> {
        let current = self.read().await?;
        let now = self.now();
        check_held(current.as_ref().map(|(r, _)| r), lease, now)
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
            let now = self.now();
            let Some((record, version)) = current else {
                return Ok(false);
            };
            if record.holder != lease.holder || record.fence != lease.fence || record.released {
                return Ok(false);
            }
            let released = LockRecord {
                released: true,
                expires_at_unix_ms: record.expires_at_unix_ms.min(now),
                ..record
            };
            if self
                .store
                .compare_and_swap(&self.key, &version, &encode_record(&released), None)
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
pub fn poll_pause(jitter: Duration, until_expiry: Option<Duration>, left: Duration) -> Duration {
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

fn encode_record(record: &LockRecord) -> Vec<u8> {
    // Serializing a struct of strings, integers and bools cannot fail.
    serde_json::to_vec(record).unwrap_or_default()
}

fn decode_record(key: &str, bytes: &[u8]) -> Result<LockRecord, StoreError> {
    let record: LockRecord = serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        key: key.to_owned(),
        message: format!("not a lock record: {e}"),
    })?;
    if record.v != RECORD_FORMAT {
        return Err(StoreError::Corrupt {
            key: key.to_owned(),
            message: format!(
                "lock record format {} (this version reads {RECORD_FORMAT})",
                record.v
            ),
        });
    }
    Ok(record)
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
    pub async fn release_predecessor(&self, predecessor: &str) -> Result<bool, StoreError> {
        let Some((record, version)) = self.read().await? else {
            return Ok(false);
        };
        if record.holder != predecessor || record.released {
            return Ok(false);
        }
        let released = LockRecord {
            released: true,
            expires_at_unix_ms: record.expires_at_unix_ms.min(self.now()),
            ..record
        };
        Ok(self
            .store
            .compare_and_swap(&self.key, &version, &encode_record(&released), None)
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
    /// The fence it was written under.
    pub fence: u64,
    /// Its version in the store.
    pub version: Version,
}

/// Writes `value` at `key` under `lease`'s fence, unless a newer fence
/// exists: either on the lock record `locks/<lease.name>` or in the value
/// already at `key`. The value is stored with an 12-byte header carrying
/// the fence (read it back with [`get_fenced`]), and replaced by
/// compare-and-swap, so a value written under a newer fence is never
/// overwritten by an older one.
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
    if let Some(entry) = store.get(&lock_key).await? {
        let record = decode_record(&lock_key, &entry.value)?;
        if record.fence > lease.fence {
            return Err(fenced(key, lease.fence, record.fence));
        }
    }
    let mut bytes = Vec::with_capacity(FENCED_HEADER_LEN + value.len());
    bytes.extend_from_slice(FENCED_MAGIC);
    bytes.extend_from_slice(&lease.fence.to_be_bytes());
    bytes.extend_from_slice(value);
    for _ in 0..MAX_CAS_ATTEMPTS {
        let written = match store.get(key).await? {
            None => store.put_if_absent(key, &bytes, None).await?,
            Some(existing) => {
                let existing_fence = split_fenced(&existing.value).map_or(0, |(fence, _)| fence);
                if existing_fence > lease.fence {
                    return Err(fenced(key, lease.fence, existing_fence));
                }
                store
                    .compare_and_swap(key, &existing.version, &bytes, None)
                    .await?
            }
        };
        if let Some(version) = written {
            return Ok(version);
        }
    }
    Err(contention(key))
}

/// Reads a value written by [`put_fenced`].
///
/// # Errors
/// [`StoreError::Corrupt`] when the value at `key` was not written by
/// [`put_fenced`]; the store's errors.
pub async fn get_fenced(store: &dyn Store, key: &str) -> Result<Option<FencedEntry>, StoreError> {
    let Some(entry) = store.get(key).await? else {
        return Ok(None);
    };
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
    let rest = bytes.strip_prefix(FENCED_MAGIC)?;
    let (fence, value) = rest.split_first_chunk::<8>()?;
    Some((u64::from_be_bytes(*fence), value))
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
/// # use sbmesh::store::{Store, lock::{LeaseKeeper, LeaseLock}};
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
    fn requests_are_checked() {
        assert!(check_request("", Duration::from_secs(1)).is_err());
        assert!(check_request(&"h".repeat(257), Duration::from_secs(1)).is_err());
        assert!(check_request("h", Duration::ZERO).is_err());
        assert!(check_request("h", Duration::from_millis(1)).is_ok());
    }
}
