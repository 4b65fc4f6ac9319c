//! ACME across replicas at scale: `SBMESH_BENCH_HOSTS` (100) hostnames, 3
//! real sidecars on 127.0.32.1-3 sharing Redis, Pebble resolving every
//! hostname to a replica that did not order it. Prints one markdown row for
//! BENCHMARKS.md: the time from the start of the processes until all
//! certificates are on every replica (status of every node lists every
//! host with one agreed serial), and how many certificates Pebble issued
//! for those hostnames (counted at the CA).
//!
//! Needs the servers of `scripts/test`; the simplest way to run it:
//!
//! ```text
//! SBMESH_TEST_SERVERS="redis pebble" scripts/test --bench acme   # starts servers, prints the env
//! # or, with Redis running and the variables of both exported
//! # (SBMESH_TEST_REDIS_URL, SBMESH_TEST_PEBBLE_DIR; the bench starts its own Pebble):
//! cargo bench -p sbmesh-sidecar --bench acme_scale
//! ```
//!
//! Every process started is killed at the end, by PID.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Instant;

use common::acme::{Pebble, SerialCache, TRIO, acme_config, own_certs, spawn_trio, unique_hosts};
use common::*;

const NODES: [&str; 3] = TRIO;

fn main() {
    // `cargo bench` passes --bench; nothing else to parse.
    let Some(pebble) = Pebble::start() else {
        eprintln!("acme_scale: Pebble is not prepared (see the doc comment)");
        return;
    };
    let Ok(redis) = std::env::var("SBMESH_TEST_REDIS_URL") else {
        eprintln!("acme_scale: SBMESH_TEST_REDIS_URL is not set");
        return;
    };
    let n: usize = std::env::var("SBMESH_BENCH_HOSTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    let bin = std::env::var_os("SBMESH_SIDECAR_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(sidecar_bin);
    let hosts = unique_hosts("bench", n);
    let ips = [
        Ipv4Addr::new(127, 0, 32, 1),
        Ipv4Addr::new(127, 0, 32, 2),
        Ipv4Addr::new(127, 0, 32, 3),
    ];
    for h in &hosts {
        let owner = sbmesh::acme::ownership::owner(h, &NODES).expect("members");
        let i = NODES.iter().position(|x| *x == owner).expect("member");
        pebble.route(h, ips[(i + 1) % 3]);
    }
    let mut cluster = Cluster::new("127.0.32");
    cluster.bin = bin;
    cluster.cluster_id = format!("bench-{}", now_unix_ms());
    write_atomic(
        &cluster.config,
        &acme_config(&pebble, "redis", &redis, &hosts, ""),
    );
    let started = Instant::now();
    spawn_trio(&mut cluster, ips, |ip| {
        vec![
            "--challenge-listen".into(),
            format!("{ip}:{}", pebble.http_port),
        ]
    });
    let mut done_at = None;
    cluster.wait_until_for(
        "every replica has every certificate",
        std::time::Duration::from_secs(180),
        || {
            let mut agreed: BTreeMap<String, String> = BTreeMap::new();
            for node in &cluster.nodes {
                let Some(status) = node.status() else {
                    return false;
                };
                let own = own_certs(&status);
                for h in &hosts {
                    match (own.get(h), agreed.get(h)) {
                        (None, _) => return false,
                        (Some(s), Some(a)) if s != a => return false,
                        (Some(s), _) => {
                            agreed.insert(h.clone(), s.clone());
                        }
                    }
                }
            }
            done_at = Some(started.elapsed());
            true
        },
    );
    let elapsed = done_at.unwrap_or_else(|| started.elapsed());
    let delivery = delivery_delays(&cluster, &hosts);
    let mut cache = SerialCache::default();
    let counts = pebble.issued_counts(&hosts, &mut cache);
    let issued: usize = counts.values().sum();
    let dup = counts.values().filter(|c| **c > 1).count();
    let orders = cluster.metric_total(&cluster.all(), "acme_orders_total", &[("result", "issued")]);
    println!(
        "| hostnames | replicas | all certificates on every replica | issued by the CA | hosts issued twice | acme_orders_total{{issued}} | issuance → files on every replica, p50 / max |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {n} | 3 | {:.2} s | {issued} | {dup} | {orders} | {delivery} |",
        elapsed.as_secs_f64()
    );
}

/// From each node's log: when the ordering replica logged "certificate
/// issued" for a host, and when each replica logged "certificate written
/// for the proxy" for it. Returns "p50 / max" of the per-host delay until
/// the last replica wrote its files.
fn delivery_delays(cluster: &Cluster, hosts: &[String]) -> String {
    let mut issued: BTreeMap<String, f64> = BTreeMap::new();
    let mut written: BTreeMap<String, f64> = BTreeMap::new();
    for node in &cluster.nodes {
        let log = std::fs::read_to_string(&node.log_path).unwrap_or_default();
        for line in log.lines() {
            let Some(t) = seconds_of_day(line) else {
                continue;
            };
            // The manager logs a certificate by its unit: per host, the host.
            let Some(host) = field(line, "unit=") else {
                continue;
            };
            if line.contains("certificate issued") {
                issued.insert(host, t);
            } else if line.contains("certificate written for the proxy") {
                let e = written.entry(host).or_insert(t);
                *e = e.max(t);
            }
        }
    }
    let mut delays: Vec<f64> = hosts
        .iter()
        .filter_map(|h| Some(written.get(h)? - issued.get(h)?))
        .collect();
    if delays.is_empty() {
        return "n/a".to_owned();
    }
    delays.sort_by(|a, b| a.total_cmp(b));
    format!(
        "{:.0} ms / {:.0} ms",
        delays[delays.len() / 2] * 1000.0,
        delays[delays.len() - 1] * 1000.0
    )
}

/// `2026-11-29T17:44:36.472858Z ...` -> seconds since midnight.
fn seconds_of_day(line: &str) -> Option<f64> {
    let time = line.get(11..26)?;
    let h: f64 = time.get(0..2)?.parse().ok()?;
    let m: f64 = time.get(3..5)?.parse().ok()?;
    let s: f64 = time.get(6..)?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

fn field(line: &str, key: &str) -> Option<String> {
    let rest = line.split(key).nth(1)?;
    Some(rest.split_whitespace().next()?.trim_matches('"').to_owned())
}
