//! Cluster-key rotation with certificates in the store (SPEC section 11):
//! 3 sidecars on `--cluster-key-file`, Redis, Pebble. The file goes
//! `[old]` -> `[new, old]` on every pod, one pod restarts (it seals under
//! `new` from then on) and orders a new host: every replica, restarted or
//! not, installs that certificate. Then `[new]` everywhere: a record sealed
//! only under `old` cannot be opened; it is reported at warn with the key
//! id, counted, and read again at a modest cadence (not at every wake-up).
//!
//! Address block: 127.0.91.1-3.

mod common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::acme::{Pebble, acme_config, handshake_ok, own_certs, redis_from_env, unique_hosts};
use common::*;

const NODES: [&str; 3] = ["node-1", "node-2", "node-3"];

fn owner_of(host: &str) -> usize {
    let owner = sbmesh::acme::ownership::owner(host, &NODES).expect("three members");
    NODES.iter().position(|n| *n == owner).expect("a member")
}

fn key_bytes(hex: &str) -> [u8; 32] {
    sbmesh::config::parse_key_ring(hex).expect("a test key")[0]
}

/// The id a ring key is known by in logs and sealed records.
fn key_id(hex: &str) -> String {
    let ring = sbmesh::mesh::seal::KeyRing::new(vec![key_bytes(hex)]).expect("a ring");
    format!("{:08x}", ring.primary_id())
}

fn key_file(node: usize, dir: &Path) -> PathBuf {
    dir.join(format!("cluster-key-{}", NODES[node]))
}

/// Writes a pod's key file as the kubelet does: whole, at once.
fn write_keys(path: &Path, keys: &[&str]) {
    let mut text = keys.join("\n");
    text.push('\n');
    write_atomic(path, &text);
}

fn count_in_log(node: &Node, needle: &str) -> usize {
    std::fs::read_to_string(&node.log_path)
        .unwrap_or_default()
        .matches(needle)
        .count()
}

/// Waits until every node has read its key file anew (the file is
/// polled), judged by the log line the key-file watcher writes.
fn wait_key_reloads(cluster: &Cluster, before: &[usize]) {
    cluster.wait_until("every node reloaded its key file", || {
        cluster
            .nodes
            .iter()
            .zip(before)
            .all(|(n, b)| count_in_log(n, "cluster key ring reloaded") > *b)
    });
}

fn reload_counts(cluster: &Cluster) -> Vec<usize> {
    cluster
        .nodes
        .iter()
        .map(|n| count_in_log(n, "cluster key ring reloaded"))
        .collect()
}

/// Every node serves `hosts` from its files, one serial per host
/// across the fleet, and lists it in its status.
fn wait_installed(
    cluster: &Cluster,
    pebble: &Pebble,
    hosts: &[String],
) -> BTreeMap<String, String> {
    let root = pebble.root_pem();
    let mut agreed = BTreeMap::new();
    cluster.wait_until("every replica installed every certificate", || {
        let mut seen: BTreeMap<String, String> = BTreeMap::new();
        for node in &cluster.nodes {
            let Some(status) = node.status() else {
                return false;
            };
            let certs = own_certs(&status);
            let dir = node.dir.join("certs");
            for h in hosts {
                let Some(serial) = certs.get(h) else {
                    return false;
                };
                if seen.get(h).is_some_and(|s| s != serial) || handshake_ok(&dir, h, &root).is_err()
                {
                    return false;
                }
                let on_disk = std::fs::read_to_string(dir.join(h).join("tls.crt"))
                    .ok()
                    .and_then(|pem| sbmesh::acme::certs::parse_chain(&pem).ok())
                    .map(|f| f.serial);
                if on_disk.as_ref() != Some(serial) {
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

fn store_ops(node: &Node) -> f64 {
    node.metrics()
        .and_then(|m| metric_sum(&m, "store_operations_total", &[]))
        .unwrap_or(0.0)
}

#[test]
fn rotated_key_file_reaches_the_store_and_every_replica_installs_new_certificates() {
    let Some(pebble) = Pebble::from_env() else {
        return;
    };
    let Some(redis) = redis_from_env() else {
        return;
    };
    let ips: [Ipv4Addr; 3] = [1, 2, 3].map(|d| Ipv4Addr::new(127, 0, 91, d));
    let mut cluster = Cluster::new("127.0.91");
    cluster.cluster_id = format!("key-rotation-{}", now_unix_ms());
    let first = unique_hosts("rot-a", 3);
    for h in &first {
        pebble.route(h, ips[(owner_of(h) + 1) % 3]);
    }
    write_atomic(
        &cluster.config,
        &acme_config(&pebble, "redis", &redis, &first, ""),
    );
    let seeds: Vec<_> = ips
        .iter()
        .map(|ip| std::net::SocketAddr::from((*ip, GOSSIP_PORT)))
        .collect();
    for (i, ip) in ips.iter().enumerate() {
        let file = key_file(i, &cluster.dir);
        write_keys(&file, &[KEY_OLD]);
        cluster.spawn(NodeOpts {
            node_id: NODES[i].to_owned(),
            ip: *ip,
            cluster_id: cluster.cluster_id.clone(),
            key: KeySource::File(file),
            seeds: seeds.clone(),
            extra_args: vec![
                "--challenge-listen".to_owned(),
                format!("{ip}:{}", pebble.http_port),
                "--acme-order-lock-ttl-secs".to_owned(),
                "10".to_owned(),
            ],
        });
    }
    let before_rotation = wait_installed(&cluster, &pebble, &first);

    // Step 1 of the rotation: `[new, old]` on every pod.
    let reloads = reload_counts(&cluster);
    for i in 0..3 {
        write_keys(&key_file(i, &cluster.dir), &[KEY_NEW, KEY_OLD]);
    }
    wait_key_reloads(&cluster, &reloads);

    // One pod restarts (it reads `[new, old]` at start and seals under
    // `new`), and orders a host of its own.
    let restarted = 0;
    cluster.nodes[restarted].sigterm();
    assert!(
        cluster.nodes[restarted]
            .wait_exit(Duration::from_secs(30))
            .is_some(),
        "{} did not stop on SIGTERM",
        NODES[restarted]
    );
    cluster.nodes[restarted].restart();
    cluster.wait_converged(&[0, 1, 2]);
    let added: Vec<String> = (0..)
        .map(|i| unique_hosts(&format!("rot-b{i}"), 1).remove(0))
        .find(|h| owner_of(h) == restarted)
        .into_iter()
        .collect();
    pebble.route(&added[0], ips[(restarted + 1) % 3]);
    let all: Vec<String> = first.iter().chain(&added).cloned().collect();
    write_atomic(
        &cluster.config,
        &acme_config(&pebble, "redis", &redis, &all, ""),
    );
    let after_rotation = wait_installed(&cluster, &pebble, &all);
    for h in &first {
        assert_eq!(
            before_rotation.get(h),
            after_rotation.get(h),
            "{h} was not re-ordered by the rotation"
        );
    }

    // Step 2: `[new]` everywhere. The first hosts' records are still
    // sealed under `old` (nothing renewed them): a pod that starts now
    // cannot open them, says so at warn with the key id, counts it, and
    // keeps the certificates it has on disk.
    let reloads = reload_counts(&cluster);
    for i in 0..3 {
        write_keys(&key_file(i, &cluster.dir), &[KEY_NEW]);
    }
    wait_key_reloads(&cluster, &reloads);
    let probe = 1;
    cluster.nodes[probe].sigterm();
    assert!(
        cluster.nodes[probe]
            .wait_exit(Duration::from_secs(30))
            .is_some(),
        "{} did not stop on SIGTERM",
        NODES[probe]
    );
    cluster.nodes[probe].restart();
    let old_id = key_id(KEY_OLD);
    let node = &cluster.nodes[probe];
    cluster.wait_until("the unreadable records are reported and counted", || {
        let warned = std::fs::read_to_string(&node.log_path)
            .unwrap_or_default()
            .lines()
            .any(|l| l.contains("WARN") && l.contains(&old_id) && l.contains("key ring"));
        let counted = node
            .metrics()
            .and_then(|m| {
                metric_sum(
                    &m,
                    "store_unseal_failures_total",
                    &[("reason", "missing_key")],
                )
            })
            .is_some_and(|n| n >= 1.0);
        warned && counted
    });
    // Warned once per key id, not once per read.
    let warns_at = count_in_log(node, &old_id);
    // Not spinning on the unreadable records: a modest store cadence.
    let (ops0, t0) = (store_ops(node), Instant::now());
    cluster.wait_until("10 s of store traffic measured", || {
        t0.elapsed() >= Duration::from_secs(10)
    });
    let rate = (store_ops(node) - ops0) / t0.elapsed().as_secs_f64();
    assert!(
        rate < 20.0,
        "{} read the store {rate:.0} times/s with unreadable records",
        NODES[probe]
    );
    assert!(
        count_in_log(node, &old_id) <= warns_at + first.len(),
        "the missing key was logged at every read:\n{}",
        node.log_tail(40)
    );
    let root = pebble.root_pem();
    for h in &all {
        handshake_ok(&node.dir.join("certs"), h, &root)
            .unwrap_or_else(|e| panic!("{} lost {h}: {e}", NODES[probe]));
    }
    for n in &cluster.nodes {
        assert!(n.is_running(), "{} exited: {}", n.id(), n.describe());
    }
}
