//! The mesh at scale in one process: N shipping mesh cores on the
//! simulator's virtual clock (`sbmesh::internal::sim`), no sockets.
//!
//! ```text
//! cargo bench -p sbmesh --bench mesh_sim
//! SBMESH_SIM_N=1000 SBMESH_SIM_START=spread cargo bench -p sbmesh --bench mesh_sim
//! ```
//!
//! Env: `SBMESH_SIM_N` (128), `SBMESH_SIM_LOSS` (0), `SBMESH_SIM_LATENCY_US`
//! (200, jitter a quarter of it), `SBMESH_SIM_START` (`burst`, `spread` = one
//! pod every 10 ms, `ordered` = each pod once the previous one runs),
//! `SBMESH_SIM_SEEDS` (`service` = started pods, `all` = every pod's address
//! from the start), `SBMESH_SIM_SEED` (1), `SBMESH_SIM_STEADY_S` (60: the
//! window bytes/node/s is measured over).
//!
//! Reports, in virtual time: convergence after the last start (every live
//! node counts N alive or suspect), kill -9 detection (every survivor lists
//! the killed node down), bytes/node/s in a steady mesh (sealed datagrams and
//! transport frames); and the simulator's wall time, peak RSS, live heap
//! (a counting allocator) per member entry at steady state, and events.
//! Convergence and detection are checked every 5 ms of virtual time.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sbmesh::internal::sim::{Seeds, Sim, SimConfig, Start};

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The system allocator, counting the bytes live: RSS keeps pages freed
/// after the join's peak, the count says what the cores hold.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
/// The most [`LIVE`] has been.
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let live = LIVE.fetch_add(new_size, Ordering::Relaxed) + new_size;
        PEAK.fetch_max(live, Ordering::Relaxed);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Heap bytes allocated and not freed, MiB (requested sizes, without the
/// allocator's own overhead).
fn live_mib() -> f64 {
    LIVE.load(Ordering::Relaxed) as f64 / (1 << 20) as f64
}

/// Peak resident set of this process (`VmHWM`), MiB.
fn peak_rss_mib() -> f64 {
    proc_status_mib("VmHWM:")
}

/// Resident set of this process now (`VmRSS`), MiB.
fn rss_mib() -> f64 {
    proc_status_mib("VmRSS:")
}

fn proc_status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Hands the allocator's free pages back to the system (glibc keeps them:
/// a join's garbage, spread through the heap, would otherwise hold RSS at
/// twice the live heap, and at N = 10,000 past this machine's memory).
fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: glibc's malloc_trim takes any pad and only releases
        // pages no allocation uses.
        unsafe {
            malloc_trim(0);
        }
    }
}

/// Serves allocations of 32 KiB and more (foca's member lists, full states)
/// from their own mappings, given back whole when freed, so they do not
/// leave holes in the heap as they grow during a join.
fn map_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const M_MMAP_THRESHOLD: i32 = -3;
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        // SAFETY: a documented glibc tunable, set before anything large is
        // allocated.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 32 * 1024);
        }
    }
}

/// How often (virtual time) the O(N) checks run.
const CHECK_EVERY: Duration = Duration::from_millis(5);

fn secs(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

fn main() {
    map_large_allocations();
    let n: usize = env("SBMESH_SIM_N", 128);
    let latency = Duration::from_micros(env("SBMESH_SIM_LATENCY_US", 200));
    let start_name: String = env("SBMESH_SIM_START", "burst".to_string());
    let start = match start_name.as_str() {
        "spread" => Start::Spread(Duration::from_millis(10)),
        "ordered" => Start::Ordered,
        _ => Start::Burst,
    };
    let seeds = match env("SBMESH_SIM_SEEDS", "service".to_string()).as_str() {
        "all" => Seeds::All,
        _ => Seeds::Service,
    };
    let cfg = SimConfig {
        nodes: n,
        seed: env("SBMESH_SIM_SEED", 1),
        latency,
        jitter: latency / 4,
        loss: env("SBMESH_SIM_LOSS", 0.0),
        start,
        seeds,
        ..SimConfig::default()
    };
    let steady = Duration::from_secs(env("SBMESH_SIM_STEADY_S", 60));
    println!("mesh_sim: {cfg:?}");
    let wall = Instant::now();
    let limit = Duration::from_secs(env("SBMESH_SIM_LIMIT_S", 600));
    let mut sim = Sim::new(cfg);

    // Checked every 5 ms of virtual time (a check is O(N)).
    let mut shown = Instant::now();
    let converged = loop {
        if sim.converged() {
            break Some(sim.now());
        }
        if sim.now() >= limit {
            break None;
        }
        let next = sim.now() + CHECK_EVERY;
        sim.run_until(next);
        if next.as_millis().is_multiple_of(100) {
            trim();
        }
        // Every virtual second, and every minute of wall time (a virtual
        // second of a 10,000-pod join takes several).
        if next.as_millis().is_multiple_of(1000) || shown.elapsed() >= Duration::from_secs(60) {
            shown = Instant::now();
            let lagging = sim.lagging();
            eprintln!(
                "  t={} events={} wall={} rss={:.0} MiB heap={:.0} MiB; {} pods not converged (pod, peers seen): {:?}",
                secs(next),
                sim.events(),
                secs(wall.elapsed()),
                rss_mib(),
                live_mib(),
                lagging.len(),
                &lagging[..lagging.len().min(5)]
            );
        }
    };
    let last_start = (0..n)
        .filter_map(|i| sim.started_at(i))
        .max()
        .unwrap_or_default();
    let Some(at) = converged else {
        println!(
            "no convergence within {} (virtual); {} events, wall {}",
            secs(limit),
            sim.events(),
            secs(wall.elapsed())
        );
        std::process::exit(1);
    };
    let exact = sim.converged_exactly();
    println!(
        "converged: {} after the last start (last start at {}, converged at {}; cores agree: {exact}); wall {}",
        secs(at - last_start),
        secs(last_start),
        secs(at),
        secs(wall.elapsed())
    );

    // Steady state: let the join traffic settle, then count a window.
    sim.run_until(sim.now() + Duration::from_secs(10));
    let sent = |s: &Sim| (0..n).map(|i| s.bytes_sent(i)).sum::<u64>();
    let sent_tcp = |s: &Sim| (0..n).map(|i| s.tcp_bytes_sent(i)).sum::<u64>();
    let (b0, t0, downs0) = (sent(&sim), sent_tcp(&sim), sim.downs());
    let each0: Vec<u64> = (0..n).map(|i| sim.bytes_sent(i)).collect();
    sim.run_until(sim.now() + steady);
    let per = |b: u64| b as f64 / n as f64 / steady.as_secs_f64();
    let (busiest, most) = (0..n)
        .map(|i| (i, sim.bytes_sent(i) - each0[i]))
        .max_by_key(|&(_, b)| b)
        .unwrap_or((0, 0));
    println!(
        "steady: {:.0} bytes/node/s ({:.0} of it transport), busiest {} {:.0}, over {}; false downs {}; wall {}",
        per(sent(&sim) - b0),
        per(sent_tcp(&sim) - t0),
        sim.node_id(busiest),
        most as f64 / steady.as_secs_f64(),
        secs(steady),
        sim.downs() - downs0,
        secs(wall.elapsed())
    );
    trim();
    let live = live_mib();
    println!(
        "memory at steady state: heap live {live:.0} MiB = {:.0} B per member entry (N² = {} entries), RSS {:.0} MiB",
        live * (1 << 20) as f64 / (n * n) as f64,
        n * n,
        rss_mib()
    );

    let victim = n / 2;
    let killed_at = sim.now();
    sim.kill(victim);
    let detected = sim.run_while_not(
        killed_at + Duration::from_secs(120),
        Sim::watched_down_everywhere,
    );
    match detected {
        Some(t) => println!(
            "kill -9 of {}: seen down by every survivor {} after; wall {}",
            sim.node_id(victim),
            secs(t - killed_at),
            secs(wall.elapsed())
        ),
        None => println!(
            "kill -9 of {}: not seen down everywhere within 120 s",
            sim.node_id(victim)
        ),
    }
    println!(
        "simulator: {} events, wall {}, peak RSS {:.0} MiB, heap live at the end {:.0} MiB, at most {:.0} MiB",
        sim.events(),
        secs(wall.elapsed()),
        peak_rss_mib(),
        live_mib(),
        PEAK.load(Ordering::Relaxed) as f64 / (1 << 20) as f64
    );
}
