//! ACME across replicas at scale: `SBMESH_BENCH_HOSTS` (100) hostnames, 3
//! real sidecars on 127.0.32.1-3 sharing Redis. Prints one markdown row for
//! BENCHMARKS.md: the time from the start of the processes until all
//! certificates are on every replica (status of every node lists every
//! host with one agreed serial), and how many certificates Pebble issued
//! for those hostnames (counted at the CA).
//!
//! `SBMESH_BENCH_CHALLENGE` picks the challenge:
//! - `http-01` (the default): Pebble resolves every hostname to a replica
//!   that did not order it;
//! - `dns-01`: the hostnames are in the BIND zone of `scripts/test`, the
//!   rfc2136 provider writes the TXT records, Pebble looks them up there;
//! - `wildcard`: one `*.<apex>` and `<apex>` pair in one SAN certificate
//!   over DNS-01, `SBMESH_BENCH_RUNS` (5) fleets one after another; the
//!   row gives each run's time to every replica serving it.
//!
//! Needs the servers of `scripts/test`; the simplest way to run it:
//!
//! ```text
//! SBMESH_TEST_SERVERS="redis pebble dns" \
//!   SBMESH_TEST_RUN="cargo bench -p sbmesh-sidecar --bench acme_scale" scripts/test
//! ```
//!
//! Every process started is killed at the end, by PID.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Instant;

use common::acme::{
    Pebble, SerialCache, TRIO, acme_config, dns_server, dns01_acme, own_certs, rfc2136_provider,
    spawn_trio, unique_hosts, unique_names, write_tsig_secret,
};
use common::*;

const NODES: [&str; 3] = TRIO;

/// How a run proves its names.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Challenge {
    Http01,
    Dns01,
    Wildcard,
}

/// What every run needs.
struct Setup {
    challenge: Challenge,
    pebble: Pebble,
    redis: String,
    bin: std::path::PathBuf,
    /// BIND, for DNS-01.
    bind: Option<SocketAddr>,
    scratch: tempfile::TempDir,
}

fn main() {
    // `cargo bench` passes --bench; nothing else to parse.
    let challenge = match std::env::var("SBMESH_BENCH_CHALLENGE").as_deref() {
        Err(_) | Ok("http-01") => Challenge::Http01,
        Ok("dns-01") => Challenge::Dns01,
        Ok("wildcard") => Challenge::Wildcard,
        Ok(other) => {
            eprintln!(
                "acme_scale: SBMESH_BENCH_CHALLENGE={other}: expected http-01, dns-01 or wildcard"
            );
            return;
        }
    };
    let bind = match challenge {
        Challenge::Http01 => None,
        _ => match dns_server::server() {
            Some(bind) => Some(bind),
            None => return,
        },
    };
    let pebble = match bind {
        None => Pebble::start(),
        Some(bind) => Pebble::start_resolving_with(bind),
    };
    let Some(pebble) = pebble else {
        eprintln!("acme_scale: Pebble is not prepared (see the doc comment)");
        return;
    };
    let Ok(redis) = std::env::var("SBMESH_TEST_REDIS_URL") else {
        eprintln!("acme_scale: SBMESH_TEST_REDIS_URL is not set");
        return;
    };
    let setup = Setup {
        challenge,
        pebble,
        redis,
        bin: std::env::var_os("SBMESH_SIDECAR_BIN")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(sidecar_bin),
        bind,
        scratch: tempfile::tempdir().expect("scratch"),
    };
    match challenge {
        Challenge::Wildcard => wildcard_runs(&setup),
        _ => scale(&setup),
    }
}

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// `hosts` as origins, with `mode` certificates, proven as `setup` says.
fn config(setup: &Setup, hosts: &[String], mode: &str) -> String {
    let extra = match setup.bind {
        None => String::new(),
        Some(bind) => dns01_acme(
            mode,
            &rfc2136_provider(bind, &write_tsig_secret(setup.scratch.path())),
        ),
    };
    acme_config(&setup.pebble, "redis", &setup.redis, hosts, &extra)
}

/// Starts 3 sidecars on 127.0.32.1-3 with `config` and waits until every
/// one lists each of `watched` with one agreed serial: the time from the
/// start, and the fleet.
fn run_fleet(setup: &Setup, config: &str, watched: &[String]) -> (f64, Cluster) {
    let ips = [1, 2, 3].map(|d| Ipv4Addr::new(127, 0, 32, d));
    if setup.bind.is_none() {
        // HTTP-01: each validation lands on a replica that did not order.
        for h in watched {
            let owner = sbmesh::internal::ownership::owner(h, &NODES).expect("members");
            let i = NODES.iter().position(|x| *x == owner).expect("member");
            setup.pebble.route(h, ips[(i + 1) % 3]);
        }
    }
    let mut cluster = Cluster::new("127.0.32");
    cluster.bin = setup.bin.clone();
    cluster.cluster_id = format!("bench-{}", now_unix_ms());
    write_atomic(&cluster.config, config);
    let started = Instant::now();
    spawn_trio(&mut cluster, ips, |ip| match setup.bind {
        None => vec![
            "--challenge-listen".into(),
            format!("{ip}:{}", setup.pebble.http_port),
        ],
        Some(bind) => vec!["--acme-dns-resolvers".into(), bind.to_string()],
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
                for h in watched {
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
    (elapsed.as_secs_f64(), cluster)
}

/// `SBMESH_BENCH_HOSTS` hostnames, one certificate each.
fn scale(setup: &Setup) {
    let n = env_number("SBMESH_BENCH_HOSTS", 100);
    let hosts: Vec<String> = match setup.challenge {
        Challenge::Http01 => unique_hosts("bench", n),
        _ => unique_names(dns_server::ZONE, n),
    };
    let (elapsed, cluster) = run_fleet(setup, &config(setup, &hosts, "per_host"), &hosts);
    let delivery = delivery_delays(&cluster, &hosts);
    let mut cache = SerialCache::default();
    let counts = setup.pebble.issued_counts(&hosts, &mut cache);
    let issued: usize = counts.values().sum();
    let dup = counts.values().filter(|c| **c > 1).count();
    let orders = cluster.metric_total(&cluster.all(), "acme_orders_total", &[("result", "issued")]);
    let challenge = if setup.bind.is_some() {
        "dns-01"
    } else {
        "http-01"
    };
    println!(
        "| challenge | hostnames | replicas | all certificates on every replica | issued by the CA | hosts issued twice | acme_orders_total{{issued}} | issuance → files on every replica, p50 / max |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    println!(
        "| {challenge} | {n} | 3 | {elapsed:.2} s | {issued} | {dup} | {orders} | {delivery} |"
    );
}

/// `SBMESH_BENCH_RUNS` fleets, each ordering `*.<apex>` and `<apex>` in
/// one certificate over DNS-01.
fn wildcard_runs(setup: &Setup) {
    let runs = env_number("SBMESH_BENCH_RUNS", 5);
    let mut times = Vec::new();
    let mut issued = 0;
    for _ in 0..runs {
        let apex = unique_names(dns_server::ZONE, 1).remove(0);
        let hosts = vec![format!("*.{apex}"), apex.clone()];
        let (elapsed, cluster) = run_fleet(setup, &config(setup, &hosts, "san"), &hosts[..1]);
        drop(cluster);
        times.push(elapsed);
        let mut cache = SerialCache::default();
        issued += setup
            .pebble
            .issued_counts(&hosts, &mut cache)
            .values()
            .max()
            .copied()
            .unwrap_or(0);
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "| replicas | runs | start → every replica serves *.apex and apex, each run | median | certificates issued |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "| 3 | {runs} | {} | {:.2} s | {issued} |",
        times
            .iter()
            .map(|t| format!("{t:.2} s"))
            .collect::<Vec<_>>()
            .join(", "),
        sorted[sorted.len() / 2]
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
