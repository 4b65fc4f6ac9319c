//! The seeded chaos run on the real cluster for 10 minutes (BENCHMARKS.md,
//! "A fleet's life"): the faults of a fleet's life at random on 6-minute
//! certificates, with names added and a renewal's order holder killed,
//! then one certificate per set of names per renewal, no expired
//! certificate ever served, no crash, the fleet whole again
//! ([`cluster::chaos::run`]; its 120 s run is a test in `cluster_life`).
//! Run it on release images (`scripts/cluster images`), as users run.
//!
//! `SBMESH_SOAK_SECS` (default 600) and `SBMESH_SOAK_SEED` (default from
//! the clock; printed, and the same seed replays the run). Needs the
//! cluster and the cluster-scope operator (the header of
//! `operator/benches/cluster_timeline.rs`), then:
//!
//! ```text
//! SBMESH_SOAK_SEED=1001 cargo bench --profile dev -p sbmesh-operator --bench cluster_chaos
//! ```

#[path = "../tests/cluster/mod.rs"]
mod cluster;

use cluster::Cluster;

fn main() {
    let Some(c) = Cluster::from_env() else {
        eprintln!("cluster_chaos: no cluster; see the header of operator/benches/cluster_chaos.rs");
        return;
    };
    let (secs, seed) = cluster::chaos::settings(600);
    cluster::chaos::run(&c, secs, seed);
}
