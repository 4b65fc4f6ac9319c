//! ACME across replicas, with real processes and a real CA (Pebble):
//! 3 sidecars share a store; Pebble resolves every hostname to a replica
//! that did NOT order it, so every validation is answered from the shared
//! store by another replica. Checked from the outside: the certificates
//! Pebble says it issued, each node's files (a TLS handshake verified
//! against Pebble's root), status and metrics.
//!
//! Address blocks: Redis fleet 127.0.0.2-4 (as the issue names them), file
//! .52, S3 .53, kill -9 .54, Redis outage .55, config reload .56, local
//! store refusal .57.

mod common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::acme::{
    Pebble, SerialCache, TRIO, acme_config, handshake_ok, own_certs, redis_from_env, spawn_trio,
    unique_hosts,
};
use common::*;

#[path = "../../tests/redis_server/mod.rs"]
mod redis_server;

const NODES: [&str; 3] = TRIO;

/// Which node orders `host`: its rendezvous owner among all three.
fn owner_of(host: &str) -> usize {
    let owner = sbmesh::internal::ownership::owner(host, &NODES).expect("three members");
    NODES.iter().position(|n| *n == owner).expect("a member")
}

/// Starts `node-1..3` on `ips`, seeded with each other, serving challenges
/// on Pebble's HTTP port, with `config` as their sb.yml.
fn fleet(
    prefix: &str,
    ips: [Ipv4Addr; 3],
    pebble: &Pebble,
    config: &str,
    extra: &[&str],
) -> Cluster {
    let mut cluster = Cluster::new(prefix);
    cluster.cluster_id = format!("acme-{}", prefix.replace('.', "-"));
    write_atomic(&cluster.config, config);
    spawn_trio(&mut cluster, ips, |ip| {
        let mut args = vec![
            "--challenge-listen".to_owned(),
            format!("{ip}:{}", pebble.http_port),
            "--acme-order-lock-ttl-secs".to_owned(),
            "10".to_owned(),
            "--reload-debounce-ms".to_owned(),
            "50".to_owned(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    });
    cluster
}

/// Routes each host to the replica after its owner, so the validation
/// lands on a replica that did not order it.
fn route_away_from_owner(pebble: &Pebble, hosts: &[String], ips: &[Ipv4Addr; 3]) {
    for h in hosts {
        pebble.route(h, ips[(owner_of(h) + 1) % 3]);
    }
}

/// Waits until every node lists every host, with one serial per host
/// across the fleet; returns host -> serial.
fn wait_all_certified(cluster: &Cluster, hosts: &[String]) -> BTreeMap<String, String> {
    let mut agreed = BTreeMap::new();
    cluster.wait_until("every node lists every host with the same serial", || {
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        for node in &cluster.nodes {
            let Some(status) = node.status() else {
                return false;
            };
            let certs = own_certs(&status);
            for h in hosts {
                let Some(serial) = certs.get(h) else {
                    return false;
                };
                if seen.get(h).is_some_and(|s| s != serial) {
                    return false;
                }
                seen.insert(h.clone(), serial.clone());
            }
        }
        agreed = seen;
        true
    });
    agreed
}

/// The checks every shared-store scenario makes once all is issued.
fn check_fleet(cluster: &Cluster, pebble: &Pebble, hosts: &[String], expect_owner_split: bool) {
    let serials = wait_all_certified(cluster, hosts);
    // At the CA: exactly one certificate per host.
    let mut cache = SerialCache::default();
    let counts = pebble.issued_counts(hosts, &mut cache);
    for (h, n) in &counts {
        assert_eq!(
            *n, 1,
            "Pebble issued {n} certificates for {h} (all: {counts:?})"
        );
    }
    // In the metrics: one issued order per host in all, each by its owner.
    let all = cluster.all();
    let issued = cluster.metric_total(&all, "acme_orders_total", &[("result", "issued")]);
    assert_eq!(
        issued as usize,
        hosts.len(),
        "acme_orders_total{{result=issued}} over the fleet"
    );
    if expect_owner_split {
        for (i, node) in cluster.nodes.iter().enumerate() {
            let owned = hosts.iter().filter(|h| owner_of(h) == i).count();
            let m = cluster.metric_total(&[i], "acme_orders_total", &[("result", "issued")]);
            assert_eq!(
                m as usize,
                owned,
                "{} owns {owned} hosts and should have ordered exactly those",
                node.id()
            );
        }
        // Every validation went to a replica that did not order the host,
        // and was answered: those replicas counted hits.
        let hits =
            cluster.metric_total(&all, "acme_challenge_requests_total", &[("result", "hit")]);
        assert!(hits >= hosts.len() as f64, "challenge hits {hits}");
    }
    // On disk: every node holds every chain, verifying against Pebble's
    // root with its key, the key private to the owner.
    let root = pebble.root_pem();
    for node in &cluster.nodes {
        let dir = node.dir.join("certs");
        for h in hosts {
            if let Err(e) = handshake_ok(&dir, h, &root) {
                panic!("{} {h}: {e}", node.id());
            }
            let mode = std::fs::metadata(dir.join(h).join("tls.key"))
                .expect("tls.key")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{} {h}/tls.key mode", node.id());
            let facts = sbmesh::internal::certs::parse_chain(
                &std::fs::read_to_string(dir.join(h).join("tls.crt")).expect("tls.crt"),
            )
            .expect("a certificate");
            assert_eq!(
                Some(&facts.serial),
                serials.get(h),
                "{} {h} serial",
                node.id()
            );
        }
        let m = node.metrics().unwrap_or_default();
        for h in hosts {
            assert!(
                m.contains(&format!("sbproxy_cert_expiry_seconds{{host=\"{h}\"}}")),
                "{} has no expiry gauge for {h}",
                node.id()
            );
        }
    }
}

fn ips(a: u8, b: u8, c: u8, first: u8) -> [Ipv4Addr; 3] {
    [
        Ipv4Addr::new(a, b, c, first),
        Ipv4Addr::new(a, b, c, first + 1),
        Ipv4Addr::new(a, b, c, first + 2),
    ]
}

#[test]
fn redis_fleet_issues_each_host_once_and_every_replica_gets_it() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let Some(redis) = redis_from_env() else {
        return;
    };
    let hosts = unique_hosts("redis", 10);
    let ips = ips(127, 0, 0, 2);
    route_away_from_owner(&pebble, &hosts, &ips);
    let config = acme_config(&pebble, "redis", &redis, &hosts, "");
    let cluster = fleet("127.0.0", ips, &pebble, &config, &[]);
    check_fleet(&cluster, &pebble, &hosts, true);
}

#[test]
fn file_store_fleet_issues_each_host_once() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let shared = tempfile::tempdir().expect("shared dir");
    let hosts = unique_hosts("file", 10);
    let ips = ips(127, 0, 52, 1);
    route_away_from_owner(&pebble, &hosts, &ips);
    let config = acme_config(
        &pebble,
        "file",
        &shared.path().display().to_string(),
        &hosts,
        "",
    );
    let cluster = fleet("127.0.52", ips, &pebble, &config, &[]);
    check_fleet(&cluster, &pebble, &hosts, true);
}

#[test]
fn s3_fleet_issues_each_host_once() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let Some(endpoint) = std::env::var("SBMESH_TEST_S3_ENDPOINT")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .or_else(|| {
            required::missing(
                "s3_fleet_issues_each_host_once",
                "SBMESH_TEST_S3_ENDPOINT is not set",
                "scripts/test starts moto",
            )
        })
    else {
        return;
    };
    // moto takes an unsigned bucket creation.
    let bucket = format!(
        "sbmesh-acme-{}-{}",
        std::process::id(),
        now_unix_ms() % 1_000_000
    );
    let addr: std::net::SocketAddr = endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .expect("endpoint is http://ip:port");
    let req = format!(
        "PUT /{bucket} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let resp = http_raw(addr, req.as_bytes()).expect("create bucket");
    assert_eq!(resp.status, 200, "create bucket: {}", resp.text());
    let hosts = unique_hosts("s3", 10);
    let ips = ips(127, 0, 53, 1);
    route_away_from_owner(&pebble, &hosts, &ips);
    let config = acme_config(&pebble, "s3", &format!("s3://{bucket}/fleet"), &hosts, "");
    let cluster = fleet("127.0.53", ips, &pebble, &config, &[]);
    check_fleet(&cluster, &pebble, &hosts, true);
}

/// The owner of a host dies (kill -9) while Pebble is validating its
/// order: another replica completes the host once the order lock's lease
/// expires, and Pebble still issued exactly one certificate. While the
/// lease runs out, the live replicas make a few store operations a second
/// (the busy lock is looked at every few seconds, not in a loop).
#[test]
fn kill_9_mid_order_another_replica_completes_it() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let shared = tempfile::tempdir().expect("shared dir");
    let hosts = unique_hosts("kill", 1);
    let host = &hosts[0];
    let ips = ips(127, 0, 54, 1);
    // The first validation goes to an address that accepts and never
    // answers: the order stays in flight, its lease held.
    let stall_ip = Ipv4Addr::new(127, 0, 54, 99);
    let stall = TcpListener::bind((stall_ip, pebble.http_port)).expect("bind stall listener");
    stall.set_nonblocking(true).expect("nonblocking");
    pebble.route(host, stall_ip);
    let config = acme_config(
        &pebble,
        "file",
        &shared.path().display().to_string(),
        &hosts,
        "",
    );
    let mut cluster = fleet("127.0.54", ips, &pebble, &config, &[]);
    let owner = owner_of(host);
    let mut held = Vec::new();
    cluster.wait_until("Pebble is validating the owner's order", || {
        while let Ok((s, _)) = stall.accept() {
            held.push(s);
        }
        !held.is_empty()
    });
    let killed_at = Instant::now();
    cluster.nodes[owner].kill9();
    // From now on validations reach a live replica.
    let next = (owner + 1) % 3;
    pebble.route(host, ips[next]);
    let live: Vec<usize> = (0..3).filter(|i| *i != owner).collect();
    let store_ops = |i: usize| {
        cluster.nodes[i]
            .metrics()
            .and_then(|m| metric_sum(&m, "store_operations_total", &[]))
            .unwrap_or(0.0)
    };
    let ops_before: Vec<f64> = live.iter().map(|&i| store_ops(i)).collect();
    cluster.wait_until("the live replicas have the certificate", || {
        live.iter().all(|&i| {
            cluster.nodes[i]
                .status()
                .is_some_and(|s| own_certs(&s).contains_key(host))
        })
    });
    let waited = killed_at.elapsed().as_secs_f64();
    eprintln!("completed {waited:.1}s after the kill");
    // While the dead owner's lease ran out, the new owner looked at the
    // lock every few seconds: a few store operations a second, not a spin.
    for (k, &i) in live.iter().enumerate() {
        let ops = store_ops(i) - ops_before[k];
        let rate = ops / waited;
        eprintln!(
            "{}: {ops} store operations in {waited:.1}s ({rate:.1}/s)",
            cluster.nodes[i].id()
        );
        assert!(
            rate < 20.0,
            "{} made {ops} store operations in {waited:.1}s ({rate:.0}/s) while the dead owner's lease ran out",
            cluster.nodes[i].id()
        );
    }
    let mut cache = SerialCache::default();
    let counts = pebble.issued_counts(&hosts, &mut cache);
    assert_eq!(counts[host], 1, "one certificate for {host} at Pebble");
    let root = pebble.root_pem();
    for &i in &live {
        handshake_ok(&cluster.nodes[i].dir.join("certs"), host, &root)
            .unwrap_or_else(|e| panic!("{}: {e}", cluster.nodes[i].id()));
    }
    drop(held);
}

fn file_digest(path: &Path) -> Option<(Vec<u8>, std::time::SystemTime)> {
    let bytes = std::fs::read(path).ok()?;
    let mtime = std::fs::metadata(path).ok()?.modified().ok()?;
    Some((bytes, mtime))
}

/// Redis goes away for 20 s while the fleet runs: nobody crashes, the
/// certificate files stay as they are, and a host added meanwhile is
/// issued once Redis is back.
#[test]
fn redis_outage_keeps_files_and_issuance_resumes() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let Some(bin) = redis_server::binary("redis_outage_keeps_files_and_issuance_resumes") else {
        return;
    };
    let mut redis = redis_server::RedisServer::start(&bin);
    let mut hosts = unique_hosts("outage", 3);
    let ips = ips(127, 0, 55, 1);
    route_away_from_owner(&pebble, &hosts, &ips);
    let config = acme_config(&pebble, "redis", &redis.url(), &hosts, "");
    let cluster = fleet("127.0.55", ips, &pebble, &config, &[]);
    wait_all_certified(&cluster, &hosts);
    let files: Vec<_> = cluster
        .nodes
        .iter()
        .flat_map(|n| {
            hosts
                .iter()
                .flat_map(|h| {
                    let d = n.dir.join("certs").join(h);
                    [d.join("tls.crt"), d.join("tls.key")]
                })
                .collect::<Vec<_>>()
        })
        .map(|p| {
            let d = file_digest(&p).expect("cert file");
            (p, d)
        })
        .collect();

    redis.kill();
    let down_at = Instant::now();
    // A host added while the store is away.
    let added = unique_hosts("outage-added", 1).remove(0);
    pebble.route(&added, ips[(owner_of(&added) + 1) % 3]);
    hosts.push(added.clone());
    write_atomic(
        &cluster.config,
        &acme_config(&pebble, "redis", &redis.url(), &hosts, ""),
    );
    while down_at.elapsed() < Duration::from_secs(20) {
        for n in &cluster.nodes {
            assert!(n.is_running(), "{} exited during the outage", n.id());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    for (p, d) in &files {
        assert_eq!(
            file_digest(p).as_ref(),
            Some(d),
            "{} changed during the outage",
            p.display()
        );
    }
    redis.restart();
    wait_all_certified(&cluster, &hosts);
    let mut cache = SerialCache::default();
    let counts = pebble.issued_counts(&hosts, &mut cache);
    for (h, n) in &counts {
        assert_eq!(*n, 1, "Pebble issued {n} certificates for {h}");
    }
}

/// Origins follow the config without a restart: an added host is
/// issued, a removed one is no longer tracked (nor renewed).
#[test]
fn hostnames_follow_config_reloads() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let shared = tempfile::tempdir().expect("shared dir");
    let path = shared.path().display().to_string();
    let ips = ips(127, 0, 56, 1);
    let first = unique_hosts("reload-a", 2);
    route_away_from_owner(&pebble, &first, &ips);
    let cluster = fleet(
        "127.0.56",
        ips,
        &pebble,
        &acme_config(&pebble, "file", &path, &first, ""),
        &[],
    );
    wait_all_certified(&cluster, &first);
    let pids: Vec<_> = cluster.nodes.iter().map(|n| n.pid()).collect();

    let added = unique_hosts("reload-b", 1);
    route_away_from_owner(&pebble, &added, &ips);
    let now_hosts = vec![first[1].clone(), added[0].clone()];
    write_atomic(
        &cluster.config,
        &acme_config(&pebble, "file", &path, &now_hosts, ""),
    );
    wait_all_certified(&cluster, &now_hosts);
    let removed = &first[0];
    cluster.wait_until("the removed host is no longer tracked", || {
        cluster.nodes.iter().all(|n| {
            n.status()
                .is_some_and(|s| !own_certs(&s).contains_key(removed))
                && n.metrics()
                    .is_some_and(|m| !m.contains(&format!("host=\"{removed}\"")))
        })
    });
    let after: Vec<_> = cluster.nodes.iter().map(|n| n.pid()).collect();
    assert_eq!(pids, after, "no process restarted");
    let mut cache = SerialCache::default();
    let counts = pebble.issued_counts(&[first.clone(), added].concat(), &mut cache);
    for (h, n) in &counts {
        assert_eq!(*n, 1, "Pebble issued {n} certificates for {h}");
    }
}

/// Replicas on pod-local stores (`memory`) see each other in the mesh:
/// neither orders, and each says why in its status and log.
#[test]
fn pod_local_store_with_peers_refuses_to_order() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let hosts = unique_hosts("local", 1);
    let ips = ips(127, 0, 57, 1);
    let config = acme_config(&pebble, "memory", "", &hosts, "");
    let cluster = fleet("127.0.57", ips, &pebble, &config, &[]);
    cluster.wait_converged(&cluster.all());
    cluster.wait_until("every node reports the refusal", || {
        cluster.nodes.iter().all(|n| {
            n.status().is_some_and(|s| {
                s["nodes"].as_array().into_iter().flatten().any(|e| {
                    e["local"] == true
                        && e["acme"]["refusal"]
                            .as_str()
                            .is_some_and(|r| r.contains("\"memory\"") && r.contains("shared store"))
                })
            })
        })
    });
    for n in &cluster.nodes {
        // Registered at 0: a missing value is /metrics not answering.
        let m = n
            .metrics()
            .unwrap_or_else(|| panic!("{}: /metrics did not answer", n.id()));
        assert_eq!(
            metric_sum(&m, "acme_orders_total", &[("result", "issued")]),
            Some(0.0),
            "{} ordered",
            n.id()
        );
        assert!(
            n.log_tail(400).contains("not ordering certificates"),
            "{} did not log the refusal",
            n.id()
        );
    }
}

/// A CA that is down for account creation, on `ip`: it serves its
/// directory and nonces, and answers every other request with a 503
/// problem document whose explanation has a line break (as a CA's
/// multi-line detail can). Returns its directory URL; the thread ends with
/// the test process.
fn ca_that_is_down(ip: Ipv4Addr) -> String {
    use std::io::{Read, Write};
    let listener = TcpListener::bind((ip, 0)).expect("bind the CA that is down");
    let base = format!("http://{}", listener.local_addr().expect("local addr"));
    let url = format!("{base}/directory");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let base = base.clone();
            std::thread::spawn(move || {
                let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
                // The request line and headers, then the body they announce.
                let mut req = Vec::new();
                let mut buf = [0u8; 8192];
                let head_end = loop {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                    if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&req[..head_end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                while req.len() < head_end + length {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
                let (status, kind, body) = if path == "/directory" {
                    let body = format!(
                        r#"{{"newNonce":"{base}/nonce","newAccount":"{base}/account","newOrder":"{base}/order"}}"#
                    );
                    ("200 OK", "application/json", body)
                } else if path == "/nonce" {
                    ("200 OK", "text/plain", String::new())
                } else {
                    let body = r#"{"type":"urn:ietf:params:acme:error:serverInternal","detail":"the CA is down\nfor maintenance","status":503}"#;
                    (
                        "503 Service Unavailable",
                        "application/problem+json",
                        body.to_owned(),
                    )
                };
                let _ = write!(
                    conn,
                    "HTTP/1.1 {status}\r\ncontent-type: {kind}\r\nreplay-nonce: bm9uY2U\r\ncache-control: no-store\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    url
}

/// A CA that is down, 300 origins and a wildcard, one sidecar: the log
/// says each thing once and on one line. The wildcard warning appears
/// once; the failed orders are summarised in a few warn lines (not one per
/// origin); every record is one line (the CA's line break does not split
/// it).
#[test]
fn a_ca_that_is_down_is_reported_in_a_few_one_line_warnings() {
    let ip = Ipv4Addr::new(127, 0, 58, 1);
    let directory = ca_that_is_down(Ipv4Addr::new(127, 0, 58, 9));
    let hosts: Vec<String> = (0..300).map(|i| format!("h{i}.down.test")).collect();
    let mut config = format!(
        "proxy:\n  admin:\n    enabled: true\n    port: 9090\n  extensions:\n    sbmesh:\n      \
         acme:\n        enabled: true\n        email: ops@example.com\n        directory_url: \"{directory}\"\n        \
         storage_backend: memory\norigins:\n  \"*.wild.down.test\": {{}}\n"
    );
    for h in &hosts {
        config.push_str(&format!("  \"{h}\": {{}}\n"));
    }
    let mut cluster = Cluster::new("127.0.58");
    write_atomic(&cluster.config, &config);
    let mut opts = cluster.default_opts(1, 1);
    opts.ip = ip;
    opts.seeds = Vec::new();
    cluster.spawn(opts);
    let node = &cluster.nodes[0];
    // Until the failures are reported: in a summary (the first failure is
    // logged at once, the others together a little later), or in more warn
    // lines than a summary would take.
    cluster.wait_until(
        "every origin's first attempt failed and was reported",
        || {
            let log = node.log_tail(100_000);
            node.metrics().is_some_and(|m| {
                metric_sum(&m, "acme_orders_total", &[("result", "failed")]).unwrap_or(0.0)
                    >= hosts.len() as f64
            }) && (log.contains("orders failed") || log.matches(" WARN ").count() > 10)
        },
    );
    let log = std::fs::read_to_string(&node.log_path).expect("the node's log");
    let records: Vec<&str> = log
        .lines()
        .filter(|l| !l.starts_with("=== spawn"))
        .collect();
    // Text format: every record starts with its timestamp (RFC 3339).
    let stray: Vec<&&str> = records
        .iter()
        .filter(|l| {
            !l.get(..4)
                .is_some_and(|y| y.bytes().all(|b| b.is_ascii_digit()))
        })
        .collect();
    assert!(
        stray.is_empty(),
        "lines that are not a record of their own: {stray:#?}"
    );
    let wildcard = records
        .iter()
        .filter(|l| l.contains("*.wild.down.test") && l.contains("not eligible"))
        .count();
    assert_eq!(wildcard, 1, "the wildcard warning, once:\n{log}");
    let warns: Vec<&&str> = records.iter().filter(|l| l.contains(" WARN ")).collect();
    assert!(
        warns.len() <= 10,
        "{} warn lines for {} failed origins:\n{}",
        warns.len(),
        hosts.len(),
        truncate(
            &warns
                .iter()
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join("\n"),
            4000
        )
    );
    assert!(
        warns
            .iter()
            .any(|l| l.contains("orders failed") && l.contains("for maintenance")),
        "a summary that says what failed and why:\n{}",
        truncate(&log, 4000)
    );
}
