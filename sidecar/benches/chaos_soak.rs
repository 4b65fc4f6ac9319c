//! The chaos soak of issue 11 for 30 minutes (`SBMESH_CHAOS_SECS`, default
//! 1800): the same harness and invariants as `tests/chaos_soak.rs` (see
//! `tests/common/chaos.rs`). Prints the seed first and one markdown row for
//! BENCHMARKS.md last; exits 1 when an invariant broke, with every broken
//! one listed. `SBMESH_CHAOS_SEED=<seed>` replays a schedule.
//!
//! ```text
//! SBMESH_TEST_SERVERS="redis pebble" \
//!   SBMESH_TEST_RUN="cargo build --release -p sbmesh-standin && cargo bench -p sbmesh-sidecar --bench chaos_soak" \
//!   scripts/test
//! ```
//!
//! (The soak starts its own Redis and Pebble inside its network namespace;
//! scripts/test installs them, libfaketime and iptables; the servers it
//! starts outside are not used.) Needs root.

#[path = "../tests/common/chaos.rs"]
mod chaos;
#[path = "../tests/common/mod.rs"]
mod common;

fn main() {
    if !chaos::enter_netns_bench() {
        return;
    }
    let seed = chaos::seed_from_env();
    let secs = chaos::secs_from_env(1800);
    let outcome = chaos::run(seed, secs);
    let result = chaos::report(&outcome);
    if let Err(report) = &result {
        eprintln!("{report}");
    }
    println!(
        "| {} | {} s | {} | {} | {} |",
        outcome.seed,
        outcome.secs,
        outcome.faults,
        outcome.failures.len(),
        outcome.notes.join("; ")
    );
    if result.is_err() {
        std::process::exit(1);
    }
}
