//! The injection webhook's cost on the real cluster (BENCHMARKS.md,
//! "Sidecar injection by webhook"): `SBMESH_BENCH_CREATIONS` (default 200)
//! pod creations through admission (`kubectl create --dry-run=server`: the
//! webhooks run, nothing is stored) in a namespace labelled
//! `sbproxy.dev/inject=enabled` and as many in one without the label,
//! interleaved; the p50/p99 of each and their difference (what the webhook
//! adds); then the RSS of each operator replica.
//!
//! Needs the cluster and the cluster-scope operator (the header of
//! `operator/benches/cluster_timeline.rs`), then:
//!
//! ```text
//! cargo bench --profile dev -p sbmesh-operator --bench cluster_webhook
//! ```

#[path = "../tests/cluster/mod.rs"]
mod cluster;

use std::time::Duration;

use cluster::{Cluster, Namespace, OPERATOR_NAMESPACE, dry_run_pod, percentile, sidecars};

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let Some(c) = Cluster::from_env() else {
        eprintln!(
            "cluster_webhook: no cluster; see the header of operator/benches/cluster_webhook.rs"
        );
        return;
    };
    let n: usize = std::env::var("SBMESH_BENCH_CREATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    c.operator();
    let on = Namespace::new(&c, "bench-webhook-on", &[("sbproxy.dev/inject", "enabled")]);
    let off = Namespace::new(&c, "bench-webhook-off", &[]);
    // Warm both paths (kubectl's discovery cache, the API server's
    // connections to the webhook).
    for _ in 0..10 {
        dry_run_pod(&on);
        dry_run_pod(&off);
    }
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let (pod, took) = dry_run_pod(&on);
        assert_eq!(
            sidecars(&pod),
            1,
            "a creation in the labelled namespace went uninjected"
        );
        with.push(took);
        let (pod, took) = dry_run_pod(&off);
        assert_eq!(sidecars(&pod), 0);
        without.push(took);
    }
    let (w50, w99) = (percentile(&mut with, 0.5), percentile(&mut with, 0.99));
    let (o50, o99) = (
        percentile(&mut without, 0.5),
        percentile(&mut without, 0.99),
    );
    println!(
        "pod creation through admission, {n} each (kubectl create --dry-run=server, the process included):\n  \
         injected:     p50 {:.1} ms, p99 {:.1} ms\n  \
         not opted in: p50 {:.1} ms, p99 {:.1} ms\n  \
         added by the webhook: p50 {:.1} ms, p99 {:.1} ms",
        ms(w50),
        ms(w99),
        ms(o50),
        ms(o99),
        ms(w50.saturating_sub(o50)),
        ms(w99.saturating_sub(o99)),
    );
    for pod in c.operator_pods(OPERATOR_NAMESPACE) {
        let name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let rss = cluster::running_container_id(&pod, "sbmesh-operator")
            .and_then(|id| cluster::container_rss(&c, &id));
        match rss {
            Some(bytes) => println!("RSS of {name}: {:.1} MiB", bytes as f64 / 1048576.0),
            None => println!("RSS of {name}: not found"),
        }
    }
}
