//! Store throughput and lease lock latency, per backend.
//!
//! ```text
//! cargo bench --bench store_ops
//! SBMESH_TEST_REDIS_URL=redis://127.0.0.1:6379/0 cargo bench --bench store_ops
//! SBMESH_BENCH_BACKENDS=memory,redis cargo bench --bench store_ops
//! ```
//!
//! For each backend available (memory, redb, file always; redis when
//! `SBMESH_TEST_REDIS_URL` is set; s3 (moto) when `SBMESH_TEST_S3_ENDPOINT`
//! is, azure (Azurite) when `SBMESH_TEST_AZURE_BLOB_ENDPOINT` is, each in a
//! fresh bucket or container; `scripts/test` prints how it starts them):
//! `get` and `put` operations per second, sequential and
//! from 8 concurrent tasks, and the latency of an uncontended lease
//! `try_acquire` + `release` (p50/p99 over up to 1000 rounds), and fenced
//! writes (`put_fenced` under one held lease) per second from 1 task. Each
//! measurement stops at its operation count or its time budget, whichever
//! comes first, so a backend takes a few seconds. Prints a markdown table.

#[path = "../tests/object_servers/mod.rs"]
mod object_servers;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sbmesh::{FileStore, LeaseLock, MemoryStore, RedbStore, Store, put_fenced};

/// Budget of one throughput measurement.
const THROUGHPUT_BUDGET: Duration = Duration::from_millis(800);
/// Most operations of one throughput measurement.
const MAX_OPS: usize = 200_000;
/// Budget of the lock latency measurement.
const LOCK_BUDGET: Duration = Duration::from_secs(2);
const LOCK_ROUNDS: usize = 1_000;
const CONCURRENCY: usize = 8;
/// Distinct keys written and read (a certificate store holds a few hundred).
const KEYS: usize = 256;
/// A certificate chain's size.
const VALUE_BYTES: usize = 4_096;

/// Failed operations of the current backend.
static ERRORS: AtomicUsize = AtomicUsize::new(0);

struct Row {
    backend: String,
    get_seq: f64,
    get_par: f64,
    put_seq: f64,
    put_par: f64,
    fenced_seq: f64,
    lock_p50: Duration,
    lock_p99: Duration,
    lock_rounds: usize,
    /// Acquire + release rounds per second.
    lock_rate: f64,
    errors: usize,
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("runtime");
    let wanted: Option<Vec<String>> = std::env::var("SBMESH_BENCH_BACKENDS")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().to_owned()).collect());
    let want = |name: &str| wanted.as_ref().is_none_or(|w| w.iter().any(|n| n == name));
    let env = |var: &str| std::env::var(var).ok().filter(|v| !v.trim().is_empty());

    let mut rows = Vec::new();
    runtime.block_on(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut stores: Vec<(String, Arc<dyn Store>)> = Vec::new();
        if want("memory") {
            stores.push(("memory".into(), Arc::new(MemoryStore::new())));
        }
        if want("redb") {
            let store = RedbStore::open(dir.path().join("redb"))
                .await
                .expect("redb");
            stores.push(("redb".into(), Arc::new(store)));
        }
        if want("file") {
            let store = FileStore::open(dir.path().join("file"))
                .await
                .expect("file");
            stores.push(("file".into(), Arc::new(store)));
        }
        if want("redis") {
            if let Some(url) = env("SBMESH_TEST_REDIS_URL") {
                let namespace = format!("bench-{:016x}", rand::random::<u64>());
                let store = sbmesh::RedisStore::connect(&url, Duration::from_secs(5))
                    .await
                    .expect("redis")
                    .with_namespace(&namespace)
                    .expect("namespace");
                stores.push(("redis".into(), Arc::new(store)));
            } else {
                eprintln!("redis: skipped (SBMESH_TEST_REDIS_URL not set)");
            }
        }
        if want("s3") {
            match env("SBMESH_TEST_S3_ENDPOINT") {
                Some(endpoint) => stores.push((
                    "s3 (moto)".into(),
                    object_servers::s3_store(&endpoint).await,
                )),
                None => eprintln!("s3: skipped (SBMESH_TEST_S3_ENDPOINT not set)"),
            }
        }
        if want("azure") {
            match env("SBMESH_TEST_AZURE_BLOB_ENDPOINT") {
                Some(endpoint) => stores.push((
                    "azure (Azurite)".into(),
                    object_servers::azure_store(&endpoint).await,
                )),
                None => eprintln!("azure: skipped (SBMESH_TEST_AZURE_BLOB_ENDPOINT not set)"),
            }
        }
        for (name, store) in stores {
            eprintln!("{name}: measuring");
            rows.push(measure(name, store).await);
        }
    });

    println!(
        "| backend | get/s (1 task) | get/s ({CONCURRENCY} tasks) | put/s (1 task) | put/s ({CONCURRENCY} tasks) | fenced put/s (1 task) | lock acquire+release p50 | p99 | acquire+release/s | rounds | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {:.0} | {} | {} |",
            r.backend,
            r.get_seq,
            r.get_par,
            r.put_seq,
            r.put_par,
            r.fenced_seq,
            fmt_latency(r.lock_p50),
            fmt_latency(r.lock_p99),
            r.lock_rate,
            r.lock_rounds,
            r.errors
        );
    }
}

async fn measure(backend: String, store: Arc<dyn Store>) -> Row {
    ERRORS.store(0, Ordering::Relaxed);
    let value = vec![0x5a; VALUE_BYTES];
    // Fill the keys the get runs read.
    for k in 0..KEYS {
        if let Err(e) = store.put(&key(k), &value, None).await {
            eprintln!("{backend}: filling {}: {e}", key(k));
            ERRORS.fetch_add(1, Ordering::Relaxed);
        }
    }
    let put_seq = throughput(&store, 1, Op::Put).await;
    let put_par = throughput(&store, CONCURRENCY, Op::Put).await;
    let get_seq = throughput(&store, 1, Op::Get).await;
    let get_par = throughput(&store, CONCURRENCY, Op::Get).await;
    let fenced_seq = fenced_throughput(&store).await;
    let (lock_p50, lock_p99, lock_rounds, lock_rate) = lock_latency(&store).await;
    for k in 0..KEYS {
        let _ = store.delete(&key(k)).await;
    }
    Row {
        backend,
        get_seq,
        get_par,
        put_seq,
        put_par,
        fenced_seq,
        lock_p50,
        lock_p99,
        lock_rounds,
        lock_rate,
        errors: ERRORS.load(Ordering::Relaxed),
    }
}

fn key(k: usize) -> String {
    format!("bench/certs/host-{k}.example.com/chain")
}

#[derive(Clone, Copy)]
enum Op {
    Get,
    Put,
}

/// Operations per second over `tasks` concurrent tasks; failed operations
/// are counted in [`ERRORS`] (and printed), not in the rate.
async fn throughput(store: &Arc<dyn Store>, tasks: usize, op: Op) -> f64 {
    let started = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let store = Arc::clone(store);
        handles.push(tokio::spawn(async move {
            let value = vec![0xa5; VALUE_BYTES];
            let mut done = 0usize;
            let mut attempts = 0usize;
            while attempts < MAX_OPS / tasks && started.elapsed() < THROUGHPUT_BUDGET {
                let k = key((t * 7919 + attempts) % KEYS);
                attempts += 1;
                let result = match op {
                    Op::Get => store.get(&k).await.map(drop),
                    Op::Put => store.put(&k, &value, None).await.map(drop),
                };
                match result {
                    Ok(()) => done += 1,
                    Err(e) => {
                        if ERRORS.fetch_add(1, Ordering::Relaxed) < 5 {
                            eprintln!("{} {k}: {e}", store.backend());
                        }
                    }
                }
            }
            done
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await.expect("task");
    }
    total as f64 / started.elapsed().as_secs_f64()
}

/// Fenced writes per second from one task, all under one held lease,
/// cycling over the keys (so each replaces a value of the same fence).
async fn fenced_throughput(store: &Arc<dyn Store>) -> f64 {
    let lock = LeaseLock::new(Arc::clone(store), "bench-fenced");
    let lease = match lock.try_acquire("bench", Duration::from_secs(300)).await {
        Ok(Some(lease)) => lease,
        other => {
            eprintln!("{} fenced: no lease: {other:?}", store.backend());
            ERRORS.fetch_add(1, Ordering::Relaxed);
            return 0.0;
        }
    };
    let value = vec![0xa5; VALUE_BYTES];
    let started = Instant::now();
    let mut done = 0usize;
    let mut attempts = 0usize;
    while attempts < MAX_OPS && started.elapsed() < THROUGHPUT_BUDGET {
        let k = format!("bench/fenced/host-{}.example.com", attempts % KEYS);
        attempts += 1;
        match put_fenced(store.as_ref(), &k, &value, &lease).await {
            Ok(_) => done += 1,
            Err(e) => {
                if ERRORS.fetch_add(1, Ordering::Relaxed) < 5 {
                    eprintln!("{} fenced {k}: {e}", store.backend());
                }
            }
        }
    }
    let rate = done as f64 / started.elapsed().as_secs_f64();
    let _ = lock.release(&lease).await;
    for k in 0..KEYS {
        let _ = store
            .delete(&format!("bench/fenced/host-{k}.example.com"))
            .await;
    }
    rate
}

/// p50, p99, count and rate of uncontended `try_acquire` + `release` rounds.
async fn lock_latency(store: &Arc<dyn Store>) -> (Duration, Duration, usize, f64) {
    let mut generation = 0;
    let mut lock = LeaseLock::new(Arc::clone(store), "bench-lock-0");
    let ttl = Duration::from_secs(30);
    let started = Instant::now();
    let mut samples = Vec::with_capacity(LOCK_ROUNDS);
    while samples.len() < LOCK_ROUNDS && started.elapsed() < LOCK_BUDGET {
        let t = Instant::now();
        let released = match lock.try_acquire("bench", ttl).await {
            Ok(Some(lease)) => lock.release(&lease).await,
            Ok(None) => Ok(false),
            Err(e) => Err(e),
        };
        match released {
            Ok(true) => samples.push(t.elapsed()),
            other => {
                if ERRORS.fetch_add(1, Ordering::Relaxed) < 5 {
                    eprintln!("{} lock round: {other:?}", store.backend());
                }
                // The lease may still be on record: go on with a fresh lock.
                generation += 1;
                lock = LeaseLock::new(Arc::clone(store), &format!("bench-lock-{generation}"));
            }
        }
    }
    let rate = samples.len() as f64 / started.elapsed().as_secs_f64();
    if samples.is_empty() {
        return (Duration::ZERO, Duration::ZERO, 0, 0.0);
    }
    samples.sort();
    let pick = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i]
    };
    (pick(0.50), pick(0.99), samples.len(), rate)
}

fn fmt_latency(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        format!("{} µs", d.as_micros())
    } else {
        format!("{:.2} ms", d.as_secs_f64() * 1_000.0)
    }
}
