//! The store's clock, as seen from this process: an offset to add to the
//! local wall clock, learned from the store's server (see
//! [`super::Store::clock_offset_ms`]) and cached.
//!
//! One reading of the server's time `s` (with resolution `r`: the true time
//! was in `s..s + r`) taken between local instants `a` and `b` bounds the
//! offset to `s - b ..= s + r - a`. [`ClockSync`] keeps the intersection of
//! the bounds of successive readings (so a coarse clock, such as an object
//! store's whole-second `Last-Modified`, is narrowed down by readings that
//! fall at other sub-second phases) and uses its midpoint. When a reading
//! does not overlap the bounds kept so far (a clock was stepped), it starts
//! over from that reading.
//!
//! The offset is to the local *wall* clock, which can be stepped (NTP, a
//! resumed VM, an operator) while the cached offset is still young. Each
//! use therefore checks the wall clock against the monotonic clock since
//! the offset was confirmed: a step of more than [`STEP_TOLERANCE_MS`] moves
//! the offset the other way by as much (the monotonic clock measures the
//! step to the millisecond, so no reading is needed). Without it, a node whose
//! clock jumped 60 s ahead saw another replica's fresh lease as expired
//! and took it over: two orders for one name (the chaos soak's seed
//! 3758827632676915).

use std::future::Future;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use super::{StoreError, now_unix_ms};

/// How long one offset is used before the server is asked again.
pub(crate) const REFRESH: Duration = Duration::from_secs(30);
/// Past this age an offset is not used even when a refresh fails, and
/// bounds are not narrowed with readings this far apart (clocks drift).
pub(crate) const STALE: Duration = Duration::from_secs(300);

/// More than this between how far the wall clock moved and how far the
/// monotonic clock did, since the offset was confirmed, is a step of the
/// wall clock rather than drift (which the [`REFRESH`] reading absorbs).
pub(crate) const STEP_TOLERANCE_MS: i64 = 250;

/// Bounds on the offset (server minus local, ms), and when last confirmed:
/// at the monotonic `at`, when the wall clock read `wall_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Bounds {
    lo: i64,
    hi: i64,
    at: Instant,
    wall_ms: u64,
}

impl Bounds {
    /// How far the wall clock (now `wall_now`) was stepped since the
    /// bounds were confirmed: what it moved beyond the monotonic clock.
    fn wall_step(&self, wall_now: u64) -> i64 {
        let elapsed = i64::try_from(self.at.elapsed().as_millis()).unwrap_or(i64::MAX);
        let moved = i64::try_from(wall_now)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(self.wall_ms).unwrap_or(i64::MAX));
        moved.saturating_sub(elapsed)
    }

    /// The same bounds after the wall clock was stepped by `step` ms: the
    /// server did not move, so the offset moves the other way.
    fn shift(&mut self, step: i64) {
        self.lo = self.lo.saturating_sub(step);
        self.hi = self.hi.saturating_sub(step);
        self.wall_ms = u64::try_from(
            i64::try_from(self.wall_ms)
                .unwrap_or(i64::MAX)
                .saturating_add(step),
        )
        .unwrap_or(0);
    }
}

/// After a failed reading, how long the last offset is used before the
/// server is asked again (a store that is down is not asked at every lock
/// operation).
pub(crate) const RETRY: Duration = Duration::from_secs(5);

/// A cached offset from the local clock to a server's (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct ClockSync {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    bounds: Option<Bounds>,
    /// When the last reading failed, while readings keep failing.
    failed_at: Option<Instant>,
}

/// One reading: the server said `server_ms`, meaning a time in
/// `server_ms..server_ms + resolution_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reading {
    /// The time the server reported, unix ms (rounded down).
    pub server_ms: u64,
    /// How coarse that time is, ms (1 for a millisecond clock).
    pub resolution_ms: u64,
}

impl ClockSync {
    /// No offset known yet.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// The offset, from the cache while it is younger than [`REFRESH`],
    /// else from a new reading by `read`. When the reading fails, an offset
    /// younger than [`STALE`] is still used (with one warning per run of
    /// failures, and no new reading for [`RETRY`]); otherwise the
    /// reading's error is returned.
    pub(crate) async fn offset<F, Fut>(
        &self,
        backend: &'static str,
        read: F,
    ) -> Result<i64, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Reading, StoreError>>,
    {
        self.offset_on(backend, read, now_unix_ms).await
    }

    /// [`ClockSync::offset`] against the wall clock `wall` (tests step it).
    async fn offset_on<F, Fut>(
        &self,
        backend: &'static str,
        read: F,
        wall: impl Fn() -> u64,
    ) -> Result<i64, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Reading, StoreError>>,
    {
        let mut state = self.state.lock().await;
        if let Some(b) = state.bounds.as_mut() {
            let step = b.wall_step(wall());
            if step.abs() > STEP_TOLERANCE_MS {
                tracing::info!(
                    backend,
                    step_ms = step,
                    "the local wall clock was stepped; the store's clock offset follows"
                );
                b.shift(step);
            }
        }
        if let Some(b) = state.bounds {
            let usable = b.at.elapsed() < STALE;
            let resting = state.failed_at.is_some_and(|at| at.elapsed() < RETRY);
            if b.at.elapsed() < REFRESH || (usable && resting) {
                return Ok(midpoint(b));
            }
        }
        let before = wall();
        let reading = read().await;
        let after = wall();
        match reading {
            Ok(reading) => {
                let bounds = narrow(state.bounds, reading, before, after, Instant::now());
                *state = State {
                    bounds: Some(bounds),
                    failed_at: None,
                };
                Ok(midpoint(bounds))
            }
            Err(e) => {
                let first = state.failed_at.is_none();
                state.failed_at = Some(Instant::now());
                match state.bounds {
                    Some(b) if b.at.elapsed() < STALE => {
                        if first {
                            tracing::warn!(backend, error = %e, "reading the store's clock failed; using the last offset");
                        }
                        Ok(midpoint(b))
                    }
                    _ => Err(e),
                }
            }
        }
    }
}

/// The bounds after `reading`, taken between local `before` and `after`.
fn narrow(
    previous: Option<Bounds>,
    reading: Reading,
    before: u64,
    after: u64,
    now: Instant,
) -> Bounds {
    let server = i64::try_from(reading.server_ms).unwrap_or(i64::MAX);
    let local = |t: u64| i64::try_from(t).unwrap_or(i64::MAX);
    let resolution = i64::try_from(reading.resolution_ms.max(1)).unwrap_or(i64::MAX);
    let lo = server.saturating_sub(local(after.max(before)));
    let hi = server
        .saturating_add(resolution)
        .saturating_sub(local(before));
    let wall_ms = after.max(before);
    let fresh = Bounds {
        lo,
        hi,
        at: now,
        wall_ms,
    };
    match previous {
        Some(p) if now.duration_since(p.at) < STALE && p.lo <= hi && lo <= p.hi => Bounds {
            lo: p.lo.max(lo),
            hi: p.hi.min(hi),
            at: now,
            wall_ms,
        },
        _ => fresh,
    }
}

fn midpoint(b: Bounds) -> i64 {
    b.lo + (b.hi - b.lo) / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_bound_the_offset_and_narrow_it() {
        let now = Instant::now();
        // A whole-second clock read while the local clock went 10_000..10_040.
        let first = narrow(
            None,
            Reading {
                server_ms: 70_000,
                resolution_ms: 1_000,
            },
            10_000,
            10_040,
            now,
        );
        assert_eq!((first.lo, first.hi), (59_960, 61_000));
        // Later, another phase: the bounds are intersected.
        let second = narrow(
            Some(first),
            Reading {
                server_ms: 71_000,
                resolution_ms: 1_000,
            },
            10_700,
            10_740,
            now,
        );
        assert_eq!((second.lo, second.hi), (60_260, 61_000));
        assert_eq!(midpoint(second), 60_630);
        // A clock step: no overlap, start over.
        let stepped = narrow(
            Some(second),
            Reading {
                server_ms: 10_000,
                resolution_ms: 1,
            },
            10_000,
            10_002,
            now,
        );
        assert_eq!((stepped.lo, stepped.hi), (-2, 1));
    }

    #[tokio::test]
    async fn cached_until_refresh_and_errors_fall_back() {
        let sync = ClockSync::new();
        let offset = sync
            .offset("test", || async {
                Ok(Reading {
                    server_ms: now_unix_ms() + 60_000,
                    resolution_ms: 1,
                })
            })
            .await
            .unwrap();
        assert!((59_900..=60_100).contains(&offset), "{offset}");
        // Fresh: the reader is not called again.
        let cached = sync
            .offset("test", || async { panic!("read while fresh") })
            .await
            .unwrap();
        assert_eq!(cached, offset);
        let failing = ClockSync::new();
        assert!(
            failing
                .offset("test", || async {
                    Err(StoreError::Backend {
                        backend: "test",
                        message: "down".into(),
                    })
                })
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn a_stepped_wall_clock_moves_the_offset_the_other_way() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let wall = AtomicU64::new(1_000_000);
        let clock = || wall.load(Ordering::Relaxed);
        let sync = ClockSync::new();
        // The store is 5 s ahead.
        let first = sync.offset_on(
            "test",
            || async {
                Ok(Reading {
                    server_ms: 1_005_000,
                    resolution_ms: 1,
                })
            },
            clock,
        );
        assert_eq!(first.await.unwrap(), 5_000);
        async fn cached(sync: &ClockSync, wall: &AtomicU64) -> i64 {
            let read = || async { panic!("read while the offset is fresh") };
            let clock = || wall.load(Ordering::Relaxed);
            sync.offset_on("test", read, clock).await.unwrap()
        }
        // The wall clock jumps 60 s ahead; the store's did not move. (A
        // lease judged on the old offset would look 60 s older.)
        wall.fetch_add(60_000, Ordering::Relaxed);
        assert_eq!(cached(&sync, &wall).await, -55_000);
        // And back.
        wall.fetch_sub(60_000, Ordering::Relaxed);
        assert_eq!(cached(&sync, &wall).await, 5_000);
        // Within the tolerance it is drift, left to the next reading.
        wall.fetch_add(100, Ordering::Relaxed);
        assert_eq!(cached(&sync, &wall).await, 5_000);
    }
}
