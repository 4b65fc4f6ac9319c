//! The lease lock ([`sbmesh::LeaseLock`]) on every backend: the same
//! checks (in [`checks`]) run on memory, redb and file always, and on Redis,
//! S3 and Azure when `scripts/test` started them (their environment
//! variables set). Without a server's variable a check prints `SKIP` and
//! passes, unless `SBMESH_TEST_REQUIRE_SERVERS=1`, when it fails.
//!
//! - 16 contenders × 100 rounds: exactly one winner per round, fences
//!   strictly increasing, both through release and through expiry (a
//!   shared manual clock makes leases expire instantly);
//! - 16 tasks polling `acquire` for 100 critical sections: never two inside
//!   at once, and a fenced counter ends at exactly 100;
//! - expiry takeover in real time: the holder that stopped renewing loses
//!   the lease after its TTL and its late fenced write is refused;
//! - the fenced write's race: a stale holder whose write passed the lock
//!   check and stalled (a [`Pausing`] store holds it there) while another
//!   holder took over is refused when it resumes, over an existing value
//!   and over none; on object stores, a stale write that lands while the
//!   takeover is still claiming the key is read by that claim (the new
//!   lease starts from it) and later ones are refused;
//! - release only by the holder;
//! - `LeaseKeeper`: keeps a lease over many TTLs, and reports the loss
//!   before the expiry when the store stops answering (errors or hangs) or
//!   another holder takes over;
//! - sealed (encrypted) records through the store.

mod object_servers;
mod store_hook;

use object_servers::server_env;
use store_hook::{Hook, Hooked, Op};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use sbmesh::internal::instrumented::Instrumented;
use sbmesh::internal::sealed::{open_record, seal_record};
use sbmesh::{
    Clock, Entry, FileStore, KeeperTiming, KeyRing, Lease, LeaseKeeper, LeaseLock, LockError,
    LostReason, MemoryStore, Metrics, RedbStore, Store, StoreError, Version, get_fenced,
    now_unix_ms, put_fenced,
};

/// A store under test and whatever must outlive it (a temp directory).
struct Fixture {
    store: Arc<dyn Store>,
    /// Multiplies the real-time TTLs of the keeper checks: a slow server
    /// (moto, Azurite) under a parallel test run needs more slack.
    slow: u32,
    _dir: Option<tempfile::TempDir>,
}

impl From<Arc<dyn Store>> for Fixture {
    fn from(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            slow: 1,
            _dir: None,
        }
    }
}

// ---------------------------------------------------------------------------
// Constructors, one per backend.

async fn memory_store() -> Option<Fixture> {
    Some(Fixture::from(Arc::new(MemoryStore::new()) as Arc<dyn Store>))
}

async fn redb_store() -> Option<Fixture> {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = RedbStore::open(dir.path()).await.expect("open redb store");
    Some(Fixture {
        store: Arc::new(store),
        slow: 1,
        _dir: Some(dir),
    })
}

async fn file_store() -> Option<Fixture> {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = FileStore::open(dir.path().join("store"))
        .await
        .expect("open file store");
    Some(Fixture {
        store: Arc::new(store),
        slow: 1,
        _dir: Some(dir),
    })
}

/// Redis at `SBMESH_TEST_REDIS_URL`, under a random namespace per check.
async fn redis_store() -> Option<Fixture> {
    let url = server_env("SBMESH_TEST_REDIS_URL")?;
    let namespace = format!("lock-{:016x}", rand::random::<u64>());
    let store = sbmesh::RedisStore::connect(&url, Duration::from_secs(5))
        .await
        .expect("redis store")
        .with_namespace(&namespace)
        .expect("namespace");
    Some(Fixture::from(Arc::new(store) as Arc<dyn Store>))
}

/// S3 (moto) at `SBMESH_TEST_S3_ENDPOINT`, in a new bucket per check.
async fn s3_store() -> Option<Fixture> {
    let endpoint = server_env("SBMESH_TEST_S3_ENDPOINT")?;
    Some(Fixture {
        slow: 3,
        ..Fixture::from(object_servers::s3_store(&endpoint).await)
    })
}

/// Azure Blob (Azurite) at `SBMESH_TEST_AZURE_BLOB_ENDPOINT`, in a new
/// container per check.
async fn azure_store() -> Option<Fixture> {
    let endpoint = server_env("SBMESH_TEST_AZURE_BLOB_ENDPOINT")?;
    Some(Fixture {
        slow: 3,
        ..Fixture::from(object_servers::azure_store(&endpoint).await)
    })
}

/// One test per check for one backend.
macro_rules! backend_suite {
    ($backend:ident, $ctor:path) => {
        mod $backend {
            use super::*;
            backend_suite!(@checks $ctor;
                one_winner_per_round_with_increasing_fences,
                acquire_excludes_and_a_fenced_counter_is_exact,
                expired_holder_is_taken_over_and_fenced_out,
                stale_write_after_takeover_is_refused,
                stale_first_write_after_takeover_is_refused,
                stale_write_during_a_claim_is_absorbed,
                release_only_by_holder,
                keeper_holds_across_many_ttls,
                keeper_reports_takeover,
                keeper_reports_unreachable_store_before_expiry,
                keeper_reports_hanging_store_before_expiry,
                sealed_records_round_trip_through_the_store,
            );
        }
    };
    (@checks $ctor:path; $($check:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                match $ctor().await {
                    Some(fixture) => checks::$check(fixture.store.clone(), fixture.slow).await,
                    None => eprintln!("SKIP {}: backend not available", stringify!($check)),
                }
            }
        )+
    };
}

backend_suite!(memory, memory_store);
backend_suite!(redb, redb_store);
backend_suite!(file, file_store);
backend_suite!(redis, redis_store);
backend_suite!(s3, s3_store);
backend_suite!(azure, azure_store);

// ---------------------------------------------------------------------------
// Helpers

/// A wall clock the test moves by hand, starting at the real time.
#[derive(Clone)]
struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    fn new() -> Self {
        Self(Arc::new(AtomicU64::new(now_unix_ms())))
    }
    fn clock(&self) -> Clock {
        let t = Arc::clone(&self.0);
        Arc::new(move || t.load(Ordering::SeqCst))
    }
    fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }
}

/// The real clock shifted by `ahead` (a replica whose clock runs fast).
fn skewed_clock(ahead: Duration) -> Clock {
    Arc::new(move || now_unix_ms() + ahead.as_millis() as u64)
}

/// How a [`Flaky`] store misbehaves.
const HEALTHY: u64 = 0;
const FAILING: u64 = 1;
const HANGING: u64 = 2;

/// Switched to fail every operation or to hang, as an unreachable server
/// does.
struct Gate {
    mode: AtomicU64,
}

#[async_trait]
impl Hook for Gate {
    async fn before(&self, _op: Op, _key: &str) -> Result<(), StoreError> {
        match self.mode.load(Ordering::SeqCst) {
            FAILING => Err(store_hook::unreachable("flaky", "connection refused")),
            HANGING => std::future::pending().await,
            _ => Ok(()),
        }
    }
}

/// A store behind a [`Gate`].
type Flaky = Hooked<Gate>;

impl Hooked<Gate> {
    fn flaky(inner: Arc<dyn Store>) -> Arc<Self> {
        Hooked::new(
            inner,
            Gate {
                mode: AtomicU64::new(HEALTHY),
            },
        )
    }
}

/// Wraps a store and, once armed with a lock key, stalls the next fenced
/// write right after it read that lock record: the moment a two-step
/// fenced write has passed its check and not yet written.
///
/// For stores that check both keys in one step (`atomic`), the wrapper
/// reads the lock record itself (as a two-step write would), stalls, then
/// forwards the write to the store's own `put_fenced`. For the others
/// (object stores) it does not forward: the trait's default protocol then
/// runs through this wrapper, and the stall lands inside it, between its
/// lock check and its value write.
#[derive(Debug)]
struct Pausing {
    inner: Arc<dyn Store>,
    atomic: bool,
    armed: std::sync::Mutex<Option<String>>,
    paused: tokio::sync::Notify,
    resume: tokio::sync::Notify,
}

impl Pausing {
    fn new(inner: Arc<dyn Store>) -> Arc<Self> {
        let atomic = !matches!(inner.backend(), "s3" | "gcs" | "azure");
        Arc::new(Self {
            inner,
            atomic,
            armed: std::sync::Mutex::new(None),
            paused: tokio::sync::Notify::new(),
            resume: tokio::sync::Notify::new(),
        })
    }

    fn arm(&self, lock_key: &str) {
        *self.armed.lock().unwrap() = Some(lock_key.to_owned());
    }

    /// Stalls here if armed for `key` (once).
    async fn stall_after(&self, key: &str) {
        let hit = {
            let mut armed = self.armed.lock().unwrap();
            if armed.as_deref() == Some(key) {
                *armed = None;
                true
            } else {
                false
            }
        };
        if hit {
            self.paused.notify_one();
            self.resume.notified().await;
        }
    }
}

#[async_trait]
impl Store for Pausing {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn is_shared(&self) -> bool {
        self.inner.is_shared()
    }
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        let got = self.inner.get(key).await;
        self.stall_after(key).await;
        got
    }
    async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Version, StoreError> {
        self.inner.put(key, value, ttl).await
    }
    async fn put_if_absent(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        self.inner.put_if_absent(key, value, ttl).await
    }
    async fn compare_and_swap(
        &self,
        key: &str,
        expected: &Version,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        self.inner.compare_and_swap(key, expected, value, ttl).await
    }
    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        self.inner.list(prefix).await
    }
    async fn put_fenced(
        &self,
        key: &str,
        value: &[u8],
        lock_key: &str,
        fence: u64,
    ) -> Result<Version, StoreError> {
        if !self.atomic {
            return sbmesh::put_fenced_by_claims(self, key, value, lock_key, fence).await;
        }
        // The check a two-step write would make, then the stall.
        let _ = self.get(lock_key).await?;
        self.inner.put_fenced(key, value, lock_key, fence).await
    }
    async fn clock_offset_ms(&self) -> Result<i64, StoreError> {
        self.inner.clock_offset_ms().await
    }
}

/// Waits (polling, generous deadline) until `held` reads false; returns the
/// wall-clock time at which the keeper flagged the loss.
async fn wait_lost(held: &mut tokio::sync::watch::Receiver<bool>, within: Duration) -> u64 {
    tokio::time::timeout(within, held.wait_for(|h| !*h))
        .await
        .expect("the keeper did not report the loss in time")
        .expect("keeper dropped");
    now_unix_ms()
}

// ---------------------------------------------------------------------------
// The checks

mod checks {
    use super::*;

    const CONTENDERS: usize = 16;
    const ROUNDS: usize = 100;
    /// More than an object store's whole-second clock can move the offset.
    const OFFSET_SLACK: Duration = Duration::from_secs(2);

    /// 16 contenders try at once in each of 100 rounds. Even rounds end with
    /// the winner's release, odd rounds with its lease expiring (a shared
    /// manual clock jumps past the TTL). Exactly one contender wins each
    /// round, and the winners' fences strictly increase.
    pub async fn one_winner_per_round_with_increasing_fences(store: Arc<dyn Store>, _slow: u32) {
        let clock = ManualClock::new();
        let ttl = Duration::from_secs(30);
        let barrier = Arc::new(tokio::sync::Barrier::new(CONTENDERS));
        let mut tasks = Vec::new();
        for i in 0..CONTENDERS {
            let lock = LeaseLock::new(Arc::clone(&store), "contention").with_clock(clock.clock());
            let barrier = Arc::clone(&barrier);
            let clock = clock.clone();
            tasks.push(tokio::spawn(async move {
                let holder = format!("contender-{i}");
                let mut won = Vec::new();
                for round in 0..ROUNDS {
                    barrier.wait().await;
                    let got = lock.try_acquire(&holder, ttl).await.expect("try_acquire");
                    // Nobody releases before everyone has tried.
                    let leader = barrier.wait().await.is_leader();
                    if let Some(lease) = got {
                        assert_eq!(lease.holder, holder);
                        if round % 2 == 0 {
                            assert!(lock.release(&lease).await.expect("release"));
                        }
                        won.push((round, lease.fence));
                    }
                    barrier.wait().await;
                    if round % 2 == 1 && leader {
                        // Past the TTL by more than the store clock's
                        // resolution: a slow run (moto) refreshes the
                        // cached offset every 30 s, and a refined midpoint
                        // may be up to half a second lower, which would
                        // leave an exact `ttl` short of the expiry.
                        clock.advance(ttl + OFFSET_SLACK);
                    }
                }
                won
            }));
        }
        let mut winners: Vec<Vec<u64>> = vec![Vec::new(); ROUNDS];
        for task in tasks {
            for (round, fence) in task.await.expect("contender panicked") {
                winners[round].push(fence);
            }
        }
        let mut last = 0;
        for (round, fences) in winners.iter().enumerate() {
            assert_eq!(fences.len(), 1, "round {round}: winners' fences {fences:?}");
            assert!(
                fences[0] > last,
                "round {round}: fence {} after {last}",
                fences[0]
            );
            last = fences[0];
        }
        let lock = LeaseLock::new(store, "contention");
        let record = lock.current().await.unwrap().expect("lock record kept");
        assert_eq!(record.fence, last);
    }

    /// 16 tasks take the lock with `acquire` (polling) until 100 critical
    /// sections have run: never two inside at once, and a counter kept with
    /// fenced writes ends at exactly 100, its fences rising with it.
    pub async fn acquire_excludes_and_a_fenced_counter_is_exact(store: Arc<dyn Store>, _slow: u32) {
        const SECTIONS: u64 = 100;
        const COUNTER: &str = "sections/counter";
        let inside = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for i in 0..CONTENDERS {
            // Waiters poll gently: 15 of them must not starve the holder
            // on a slow server (moto serves one request at a time).
            let lock = LeaseLock::new(Arc::clone(&store), "sections")
                .with_poll_interval(Duration::from_millis(5), Duration::from_millis(40));
            let store = Arc::clone(&store);
            let inside = Arc::clone(&inside);
            tasks.push(tokio::spawn(async move {
                let holder = format!("worker-{i}");
                let mut log = Vec::new();
                loop {
                    let lease = lock
                        .acquire(&holder, Duration::from_secs(30), Duration::from_secs(120))
                        .await
                        .expect("acquire")
                        .expect("acquired within 120 s");
                    assert!(
                        !inside.swap(true, Ordering::SeqCst),
                        "two holders inside at once"
                    );
                    // Stay inside a moment, so an intruder would be seen.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    let count = match get_fenced(store.as_ref(), COUNTER).await.expect("read") {
                        Some(entry) => {
                            // Older, or this lease's own where the takeover
                            // claimed the key (object stores).
                            assert!(entry.fence <= lease.fence, "counter fence newer");
                            u64::from_be_bytes(entry.value.try_into().expect("8 bytes"))
                        }
                        None => 0,
                    };
                    let done = count >= SECTIONS;
                    if !done {
                        put_fenced(store.as_ref(), COUNTER, &(count + 1).to_be_bytes(), &lease)
                            .await
                            .expect("fenced write under a held lease");
                        log.push((count + 1, lease.fence));
                    }
                    inside.store(false, Ordering::SeqCst);
                    assert!(lock.release(&lease).await.expect("release"));
                    if done {
                        return log;
                    }
                }
            }));
        }
        let mut log = Vec::new();
        for task in tasks {
            log.extend(task.await.expect("worker panicked"));
        }
        log.sort();
        assert_eq!(log.len() as u64, SECTIONS);
        for (i, (count, _)) in log.iter().enumerate() {
            assert_eq!(*count, i as u64 + 1);
        }
        assert!(
            log.windows(2).all(|w| w[0].1 < w[1].1),
            "fences do not rise with the counter: {log:?}"
        );
        let last = get_fenced(store.as_ref(), COUNTER).await.unwrap().unwrap();
        assert_eq!(last.value, SECTIONS.to_be_bytes());
    }

    /// Real time: a holder that stops renewing loses the lease once its TTL
    /// has passed (not before), a waiter takes it with the next fence, and
    /// the old holder's late writes are refused.
    pub async fn expired_holder_is_taken_over_and_fenced_out(store: Arc<dyn Store>, _slow: u32) {
        let ttl = Duration::from_millis(400);
        let lock = LeaseLock::new(Arc::clone(&store), "expiry");
        let old = lock.try_acquire("stalled", ttl).await.unwrap().unwrap();
        put_fenced(store.as_ref(), "guarded/value", b"old", &old)
            .await
            .expect("write while held");

        let waiter = lock
            .clone()
            .with_poll_interval(Duration::from_millis(5), Duration::from_millis(20));
        let new = waiter
            .acquire("waiter", ttl, Duration::from_secs(20))
            .await
            .unwrap()
            .expect("taken over after the TTL");
        let acquired_at = new.expires_at_unix_ms - ttl.as_millis() as u64;
        assert!(
            acquired_at >= old.expires_at_unix_ms,
            "taken over at {acquired_at}, before the expiry {}",
            old.expires_at_unix_ms
        );
        assert_eq!(new.fence, old.fence + 1);

        // The stalled holder wakes up.
        match put_fenced(store.as_ref(), "guarded/value", b"late", &old).await {
            Err(StoreError::Fenced { fence, newest, .. }) => {
                assert_eq!((fence, newest), (old.fence, new.fence));
            }
            other => panic!("late write not refused: {other:?}"),
        }
        match lock.renew(&old).await {
            Err(LockError::Lost {
                reason: LostReason::TakenOver { holder, fence },
                ..
            }) => assert_eq!((holder.as_str(), fence), ("waiter", new.fence)),
            other => panic!("renewal of a lost lease: {other:?}"),
        }
        assert!(!lock.release(&old).await.unwrap());

        put_fenced(store.as_ref(), "guarded/value", b"new", &new)
            .await
            .unwrap();
        let value = get_fenced(store.as_ref(), "guarded/value")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (value.value.as_slice(), value.fence),
            (&b"new"[..], new.fence)
        );

        // A value written under a newer fence is never overwritten by an
        // older one, even when the lock record does not say so (a writer
        // that passed the record check just before the takeover).
        let unrelated_old = Lease {
            name: "other-lock".into(),
            ..old.clone()
        };
        assert!(matches!(
            put_fenced(store.as_ref(), "guarded/value", b"race", &unrelated_old).await,
            Err(StoreError::Fenced { .. })
        ));
        assert_eq!(
            get_fenced(store.as_ref(), "guarded/value")
                .await
                .unwrap()
                .unwrap()
                .value,
            b"new"
        );
    }

    /// A stale holder's fenced write passes the lock check and stalls; the
    /// lease expires and another holder takes it over; the stalled write
    /// then resumes and is refused, and the value is the one written
    /// before the takeover.
    pub async fn stale_write_after_takeover_is_refused(store: Arc<dyn Store>, _slow: u32) {
        stale_write_race(store, true).await;
    }

    /// The same race on a key the stale holder writes for the first time.
    pub async fn stale_first_write_after_takeover_is_refused(store: Arc<dyn Store>, _slow: u32) {
        stale_write_race(store, false).await;
    }

    async fn stale_write_race(store: Arc<dyn Store>, existing: bool) {
        const KEY: &str = "race/value";
        let clock = ManualClock::new();
        let ttl = Duration::from_secs(30);
        let lock = LeaseLock::new(Arc::clone(&store), "race").with_clock(clock.clock());
        let stale = lock.try_acquire("stale", ttl).await.unwrap().unwrap();
        if existing {
            put_fenced(store.as_ref(), KEY, b"before", &stale)
                .await
                .expect("write while held");
        }

        let pausing = Pausing::new(Arc::clone(&store));
        pausing.arm(lock.key());
        let writer = {
            let pausing = Arc::clone(&pausing);
            let stale = stale.clone();
            tokio::spawn(async move { put_fenced(pausing.as_ref(), KEY, b"late", &stale).await })
        };
        tokio::time::timeout(Duration::from_secs(30), pausing.paused.notified())
            .await
            .expect("the stale write did not reach its lock check");

        // The stale holder's lease expires; another holder takes over.
        clock.advance(ttl);
        let new = lock
            .try_acquire("new", ttl)
            .await
            .unwrap()
            .expect("taken over after the TTL");
        assert_eq!(new.fence, stale.fence + 1);

        pausing.resume.notify_one();
        let late = tokio::time::timeout(Duration::from_secs(30), writer)
            .await
            .expect("the stale write did not finish")
            .expect("writer panicked");
        match late {
            Err(StoreError::Fenced { fence, newest, .. }) => {
                assert_eq!((fence, newest), (stale.fence, new.fence));
            }
            other => panic!("stale write after the takeover not refused: {other:?}"),
        }
        let value = get_fenced(store.as_ref(), KEY).await.unwrap();
        if existing {
            assert_eq!(value.expect("value kept").value, b"before");
        } else {
            assert_eq!(value, None, "the stale write landed");
        }

        // The new holder writes; the stale one still cannot.
        put_fenced(store.as_ref(), KEY, b"new", &new).await.unwrap();
        assert!(matches!(
            put_fenced(store.as_ref(), KEY, b"later", &stale).await,
            Err(StoreError::Fenced { .. })
        ));
        let value = get_fenced(store.as_ref(), KEY).await.unwrap().unwrap();
        assert_eq!(
            (value.value.as_slice(), value.fence),
            (&b"new"[..], new.fence)
        );
    }

    /// Object stores only (the claims protocol): the stale write lands
    /// after the takeover's lock record write but before its claim of the
    /// key. The claim reads it and raises it to the new fence, so the new
    /// lease starts from that value, and the stale holder cannot write
    /// again. (Where the check and write are one step there is no such
    /// window: the atomic backends skip this.)
    pub async fn stale_write_during_a_claim_is_absorbed(store: Arc<dyn Store>, _slow: u32) {
        const KEY: &str = "race/value";
        let clock = ManualClock::new();
        let ttl = Duration::from_secs(30);
        let stale_side = Pausing::new(Arc::clone(&store));
        if stale_side.atomic {
            return;
        }
        let lock = LeaseLock::new(Arc::clone(&store), "race").with_clock(clock.clock());
        let stale = lock.try_acquire("stale", ttl).await.unwrap().unwrap();
        put_fenced(store.as_ref(), KEY, b"before", &stale)
            .await
            .unwrap();

        stale_side.arm(lock.key());
        let writer = {
            let stale_side = Arc::clone(&stale_side);
            let stale = stale.clone();
            tokio::spawn(async move { put_fenced(stale_side.as_ref(), KEY, b"late", &stale).await })
        };
        tokio::time::timeout(Duration::from_secs(30), stale_side.paused.notified())
            .await
            .expect("the stale write did not reach its lock check");

        // The takeover writes the lock record, reads the key to claim it,
        // and stalls there.
        clock.advance(ttl);
        let new_side = Pausing::new(Arc::clone(&store));
        new_side.arm(KEY);
        let taker = {
            let lock = LeaseLock::new(Arc::clone(&new_side) as Arc<dyn Store>, "race")
                .with_clock(clock.clock());
            tokio::spawn(async move { lock.try_acquire("new", ttl).await })
        };
        tokio::time::timeout(Duration::from_secs(30), new_side.paused.notified())
            .await
            .expect("the takeover did not reach its claim");

        // The stale write lands first ...
        stale_side.resume.notify_one();
        tokio::time::timeout(Duration::from_secs(30), writer)
            .await
            .expect("the stale write did not finish")
            .expect("writer panicked")
            .expect("a write before the claim lands");
        // ... and the claim, retried, takes it over.
        new_side.resume.notify_one();
        let new = tokio::time::timeout(Duration::from_secs(30), taker)
            .await
            .expect("the takeover did not finish")
            .expect("taker panicked")
            .unwrap()
            .expect("taken over");
        let value = get_fenced(store.as_ref(), KEY).await.unwrap().unwrap();
        assert_eq!(
            (value.value.as_slice(), value.fence),
            (&b"late"[..], new.fence)
        );
        assert!(matches!(
            put_fenced(store.as_ref(), KEY, b"again", &stale).await,
            Err(StoreError::Fenced { .. })
        ));
    }

    /// Only the holder of the current lease releases it; after a release
    /// the next lease comes at once with the next fence, and the released
    /// lease can no longer be renewed or released.
    pub async fn release_only_by_holder(store: Arc<dyn Store>, _slow: u32) {
        let ttl = Duration::from_secs(30);
        let lock = LeaseLock::new(Arc::clone(&store), "release");
        let lease = lock.try_acquire("owner", ttl).await.unwrap().unwrap();
        assert!(lock.try_acquire("other", ttl).await.unwrap().is_none());
        // Same holder id again: still held, not handed out twice.
        assert!(lock.try_acquire("owner", ttl).await.unwrap().is_none());

        let impostor = Lease {
            holder: "other".into(),
            ..lease.clone()
        };
        assert!(!lock.release(&impostor).await.unwrap());
        let stale = Lease {
            fence: lease.fence - 1,
            ..lease.clone()
        };
        assert!(!lock.release(&stale).await.unwrap());
        assert!(lock.try_acquire("other", ttl).await.unwrap().is_none());

        let renewed = lock.renew(&lease).await.unwrap();
        assert_eq!(renewed.fence, lease.fence);
        assert!(renewed.expires_at_unix_ms >= lease.expires_at_unix_ms);

        assert!(lock.release(&renewed).await.unwrap());
        assert!(!lock.release(&renewed).await.unwrap());
        assert!(matches!(
            lock.renew(&renewed).await,
            Err(LockError::Lost {
                reason: LostReason::Released,
                ..
            })
        ));
        let next = lock.try_acquire("other", ttl).await.unwrap().unwrap();
        assert_eq!(next.fence, lease.fence + 1);
        let record = lock.current().await.unwrap().unwrap();
        assert_eq!((record.holder.as_str(), record.released), ("other", false));
    }

    /// A kept lease outlives many TTLs: a contender waiting three TTLs does
    /// not get it; once the keeper releases, it does at once.
    pub async fn keeper_holds_across_many_ttls(store: Arc<dyn Store>, slow: u32) {
        let ttl = Duration::from_millis(1_000) * slow;
        let lock = LeaseLock::new(Arc::clone(&store), "kept");
        let lease = lock.try_acquire("keeper", ttl).await.unwrap().unwrap();
        let keeper = LeaseKeeper::spawn(lock.clone(), lease.clone());
        let contender = lock
            .clone()
            .with_poll_interval(Duration::from_millis(10), Duration::from_millis(30));
        assert!(
            contender
                .acquire("contender", ttl, ttl * 3)
                .await
                .unwrap()
                .is_none(),
            "a kept lease was taken"
        );
        assert!(keeper.is_held());
        assert!(keeper.lease().expires_at_unix_ms > lease.expires_at_unix_ms);
        assert_eq!(keeper.lease().fence, lease.fence);
        assert!(keeper.release().await.unwrap());
        let next = contender.try_acquire("contender", ttl).await.unwrap();
        assert_eq!(next.expect("free after release").fence, lease.fence + 1);
    }

    /// A contender whose view of the store's time is a TTL ahead (a test
    /// clock: real skew no longer does this, see `store_lock_processes`)
    /// takes the lease over; the keeper's next renewal sees it and reports
    /// the loss.
    pub async fn keeper_reports_takeover(store: Arc<dyn Store>, slow: u32) {
        let ttl = Duration::from_millis(600) * slow;
        let lock = LeaseLock::new(Arc::clone(&store), "takeover");
        let lease = lock.try_acquire("keeper", ttl).await.unwrap().unwrap();
        let keeper = LeaseKeeper::spawn(lock.clone(), lease.clone());
        let mut held = keeper.held();
        let skewed = lock.clone().with_clock(skewed_clock(ttl * 2));
        let thief = skewed
            .try_acquire("fast-clock", ttl * 10)
            .await
            .unwrap()
            .expect("a fast clock sees the lease expired");
        assert_eq!(thief.fence, lease.fence + 1);
        wait_lost(&mut held, Duration::from_secs(10)).await;
        assert!(!keeper.is_held());
        assert!(matches!(
            put_fenced(store.as_ref(), "guarded/k", b"x", &keeper.lease()).await,
            Err(StoreError::Fenced { .. })
        ));
        // The keeper does not release a lease it lost.
        assert!(!keeper.release().await.unwrap());
        assert_eq!(lock.current().await.unwrap().unwrap().holder, "fast-clock");
    }

    /// The store starts failing every operation: the keeper reports the
    /// loss before the lease's expiry.
    pub async fn keeper_reports_unreachable_store_before_expiry(store: Arc<dyn Store>, slow: u32) {
        keeper_outage(store, FAILING, slow).await;
    }

    /// The store stops answering (operations hang): same.
    pub async fn keeper_reports_hanging_store_before_expiry(store: Arc<dyn Store>, slow: u32) {
        keeper_outage(store, HANGING, slow).await;
    }

    async fn keeper_outage(store: Arc<dyn Store>, mode: u64, slow: u32) {
        let ttl = Duration::from_millis(1_500) * slow;
        let flaky = Flaky::flaky(store);
        let lock = LeaseLock::new(Arc::clone(&flaky) as Arc<dyn Store>, "outage");
        let lease = lock.try_acquire("keeper", ttl).await.unwrap().unwrap();
        let keeper = LeaseKeeper::spawn_with(lock.clone(), lease, KeeperTiming::for_ttl(ttl));
        let mut held = keeper.held();
        // Let a renewal or two succeed first.
        let first = keeper.lease().expires_at_unix_ms;
        tokio::time::timeout(Duration::from_secs(10), async {
            while keeper.lease().expires_at_unix_ms == first {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("no renewal");
        assert!(keeper.is_held());

        flaky.hook.mode.store(mode, Ordering::SeqCst);
        let last_expiry = keeper.lease().expires_at_unix_ms;
        let flagged_at = wait_lost(&mut held, Duration::from_secs(10)).await;
        let expiry = keeper.lease().expires_at_unix_ms;
        assert_eq!(expiry, last_expiry, "renewed while the store was down");
        assert!(
            flagged_at < expiry,
            "loss reported at {flagged_at}, not before the expiry {expiry}"
        );
        drop(keeper);
    }

    /// Private keys sealed under the cluster ring survive the store; a
    /// reader without the key gets `MissingKey`, a record copied to another
    /// key does not open, and rotation keeps old records readable.
    pub async fn sealed_records_round_trip_through_the_store(store: Arc<dyn Store>, _slow: u32) {
        let old = KeyRing::new(vec![[3; 32]]).unwrap();
        let key = "acme/accounts/test/key";
        let sealed = seal_record(Some(&old), key, b"-----BEGIN PRIVATE KEY-----").unwrap();
        store.put(key, &sealed, None).await.unwrap();
        let read = store.get(key).await.unwrap().unwrap().value;
        assert_eq!(
            open_record(Some(&old), key, &read).unwrap(),
            b"-----BEGIN PRIVATE KEY-----"
        );

        let stranger = KeyRing::new(vec![[4; 32]]).unwrap();
        for ring in [None, Some(&stranger)] {
            match open_record(ring, key, &read) {
                Err(StoreError::MissingKey { key_id, .. }) => assert_eq!(key_id, old.primary_id()),
                other => panic!("expected MissingKey, got {other:?}"),
            }
        }

        let moved = "certs/other.example/key";
        store.put(moved, &read, None).await.unwrap();
        let copy = store.get(moved).await.unwrap().unwrap().value;
        assert!(matches!(
            open_record(Some(&old), moved, &copy),
            Err(StoreError::Corrupt { .. })
        ));

        let rotated = KeyRing::new(vec![[4; 32], [3; 32]]).unwrap();
        assert!(open_record(Some(&rotated), key, &read).is_ok());
        let resealed = seal_record(Some(&rotated), key, b"k2").unwrap();
        store.put(key, &resealed, None).await.unwrap();
        let read = store.get(key).await.unwrap().unwrap().value;
        assert_eq!(open_record(Some(&stranger), key, &read).unwrap(), b"k2");
    }
}

// ---------------------------------------------------------------------------
// Backend-independent behaviour (memory store)

/// Renewal extends from now; a lease that lapsed is not revived even when
/// nobody took it; an expired lease is free to the next holder.
#[tokio::test]
async fn renewal_extends_and_expiry_is_final() {
    let clock = ManualClock::new();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let lock = LeaseLock::new(store, "renew").with_clock(clock.clock());
    let ttl = Duration::from_millis(1_000);
    let lease = lock.try_acquire("a", ttl).await.unwrap().unwrap();
    assert_eq!(lease.fence, 1);
    clock.advance(Duration::from_millis(999));
    assert!(lock.try_acquire("b", ttl).await.unwrap().is_none());
    let renewed = lock.renew(&lease).await.unwrap();
    assert_eq!(renewed.expires_at_unix_ms, lease.expires_at_unix_ms + 999);
    clock.advance(ttl);
    match lock.renew(&renewed).await {
        Err(LockError::Lost {
            reason: LostReason::Expired { at_unix_ms },
            fence: 1,
            ..
        }) => assert_eq!(at_unix_ms, renewed.expires_at_unix_ms),
        other => panic!("expired lease renewed: {other:?}"),
    }
    let next = lock.try_acquire("b", ttl).await.unwrap().unwrap();
    assert_eq!(next.fence, 2);
}

/// `acquire` gives up after `wait` with `None`, and passes through errors
/// that retrying cannot fix.
#[tokio::test]
async fn acquire_times_out_and_reports_bad_requests() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let lock = LeaseLock::new(Arc::clone(&store), "busy");
    let _held = lock
        .try_acquire("a", Duration::from_secs(60))
        .await
        .unwrap()
        .unwrap();
    let started = tokio::time::Instant::now();
    assert!(
        lock.acquire("b", Duration::from_secs(1), Duration::from_millis(300))
            .await
            .unwrap()
            .is_none()
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(matches!(
        lock.try_acquire("", Duration::from_secs(1)).await,
        Err(StoreError::Config(_))
    ));
    assert!(matches!(
        lock.try_acquire("a", Duration::ZERO).await,
        Err(StoreError::Config(_))
    ));
    let bad = LeaseLock::new(Arc::clone(&store), "../etc");
    assert!(matches!(
        bad.try_acquire("a", Duration::from_secs(1)).await,
        Err(StoreError::InvalidKey { .. })
    ));
    store.put("locks/garbage", b"not json", None).await.unwrap();
    assert!(matches!(
        LeaseLock::new(store, "garbage")
            .acquire("a", Duration::from_secs(1), Duration::from_secs(5))
            .await,
        Err(StoreError::Corrupt { .. })
    ));
}

/// A store that keeps failing: `acquire` retries until `wait`, then returns
/// the store's error.
#[tokio::test]
async fn acquire_returns_the_store_error_after_wait() {
    let flaky = Flaky::flaky(Arc::new(MemoryStore::new()));
    flaky.hook.mode.store(FAILING, Ordering::SeqCst);
    let lock = LeaseLock::new(flaky as Arc<dyn Store>, "down");
    assert!(matches!(
        lock.acquire("a", Duration::from_secs(1), Duration::from_millis(200))
            .await,
        Err(StoreError::Backend { .. })
    ));
}

/// Acquisitions are counted in `store_lock_acquired_total{backend}`.
#[tokio::test]
async fn acquisitions_are_counted() {
    let metrics = Arc::new(Metrics::new());
    let store: Arc<dyn Store> = Arc::new(Instrumented::new(
        Arc::new(MemoryStore::new()),
        Arc::clone(&metrics),
    ));
    let lock = LeaseLock::new(store, "counted").with_metrics(Arc::clone(&metrics));
    let ttl = Duration::from_secs(10);
    let lease = lock.try_acquire("a", ttl).await.unwrap().unwrap();
    assert!(lock.try_acquire("b", ttl).await.unwrap().is_none());
    lock.renew(&lease).await.unwrap();
    lock.release(&lease).await.unwrap();
    lock.try_acquire("b", ttl).await.unwrap().unwrap();
    let text = metrics.encode();
    assert!(
        text.contains(r#"store_lock_acquired_total{backend="memory"} 2"#),
        "{text}"
    );
    assert!(
        text.contains(
            r#"store_operations_total{backend="memory",op="put_if_absent",result="ok"} 1"#
        ),
        "{text}"
    );
}
