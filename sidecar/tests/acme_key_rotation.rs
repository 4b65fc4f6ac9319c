//! Cluster-key rotation with certificates in the store (docs/operations.md#rotate-the-cluster-key):
//! 3 sidecars on `--cluster-key-file`, Redis, Pebble.
//!
//! 1. `[old]` everywhere; certificates issued.
//! 2. `[new, old]` on two pods; one of them restarts (it seals under `new`
//!    from then on) and orders a new host: the other, not restarted,
//!    installs it too. The records sealed under `old` are resealed under
//!    `new`.
//! 3. The third pod restarts while its key file still says `[old]` (the
//!    kubelet updates mounts a pod at a time): it cannot open the records
//!    now sealed under `new`, reports that at warn with the key id, counts
//!    it, orders no replacement and does not spin on the store. Once its
//!    file says `[new, old]` it installs them, without a restart.
//! 4. `[new]` everywhere: a pod that starts now opens every record.
//!
//! Address block: 127.0.91.1-3. The second test rolls the files out a pod
//! at a time, as the kubelet does, and counts every packet (127.0.92.1-3).

mod common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::acme::{
    Pebble, SerialCache, acme_config, handshake_ok, own_certs, redis_from_env, unique_hosts,
};
use common::*;

const NODES: [&str; 3] = ["node-1", "node-2", "node-3"];

fn owner_of(host: &str) -> usize {
    let owner = sbmesh::internal::ownership::owner(host, &NODES).expect("three members");
    NODES.iter().position(|n| *n == owner).expect("a member")
}

fn key_bytes(hex: &str) -> [u8; 32] {
    sbmesh::parse_key_ring(hex).expect("a test key")[0]
}

/// The id a ring key is known by in logs and sealed records.
fn key_id(hex: &str) -> String {
    let ring = sbmesh::KeyRing::new(vec![key_bytes(hex)]).expect("a ring");
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

/// Every node of `nodes` serves `hosts` from its files, one serial per
/// host across them, and lists it in its status.
fn wait_installed(
    cluster: &Cluster,
    pebble: &Pebble,
    nodes: &[usize],
    hosts: &[String],
) -> BTreeMap<String, String> {
    let root = pebble.root_pem();
    let mut agreed = BTreeMap::new();
    // Generous: after a rotation, delivery waits for the paced reseals
    // (one per second per replica), slower on a loaded machine.
    cluster.wait_until_for(
        "every replica installed every certificate",
        Duration::from_secs(180),
        || {
            let mut seen: BTreeMap<String, String> = BTreeMap::new();
            for node in nodes.iter().map(|i| &cluster.nodes[*i]) {
                let Some(status) = node.status() else {
                    return false;
                };
                let certs = own_certs(&status);
                let dir = node.dir.join("certs");
                for h in hosts {
                    let Some(serial) = certs.get(h) else {
                        return false;
                    };
                    if seen.get(h).is_some_and(|s| s != serial)
                        || handshake_ok(&dir, h, &root).is_err()
                    {
                        return false;
                    }
                    let on_disk = std::fs::read_to_string(dir.join(h).join("tls.crt"))
                        .ok()
                        .and_then(|pem| sbmesh::internal::certs::parse_chain(&pem).ok())
                        .map(|f| f.serial);
                    if on_disk.as_ref() != Some(serial) {
                        return false;
                    }
                    seen.insert(h.clone(), serial.clone());
                }
            }
            agreed = seen;
            true
        },
    );
    agreed
}

fn store_ops(node: &Node) -> f64 {
    node.metrics()
        .and_then(|m| metric_sum(&m, "store_operations_total", &[]))
        .unwrap_or(0.0)
}

/// Registered at 0: no value means /metrics did not answer, which fails.
fn missing_key_count(node: &Node) -> f64 {
    let m = node
        .metrics()
        .unwrap_or_else(|| panic!("{}: /metrics did not answer", node.id()));
    metric_sum(
        &m,
        "store_unseal_failures_total",
        &[("reason", "missing_key")],
    )
    .unwrap_or_else(|| {
        panic!(
            "{}: no store_unseal_failures_total{{reason=\"missing_key\"}}",
            node.id()
        )
    })
}

fn restart(cluster: &mut Cluster, i: usize) {
    cluster.nodes[i].sigterm();
    assert!(
        cluster.nodes[i]
            .wait_exit(Duration::from_secs(30))
            .is_some(),
        "{} did not stop on SIGTERM",
        NODES[i]
    );
    cluster.nodes[i].restart();
}

/// Three sidecars on 127.0.`block`.1-3 on `--cluster-key-file` `[old]`,
/// ordering `hosts` on Redis from Pebble, each host's validation routed to
/// a pod that does not order it.
fn three_pods(
    block: u8,
    pebble: &Pebble,
    redis: &str,
    hosts: &[String],
    extra_args: &[&str],
) -> (Cluster, [Ipv4Addr; 3]) {
    let ips: [Ipv4Addr; 3] = [1, 2, 3].map(|d| Ipv4Addr::new(127, 0, block, d));
    let mut cluster = Cluster::new(&format!("127.0.{block}"));
    cluster.cluster_id = format!("key-rotation-{block}-{}", now_unix_ms());
    for h in hosts {
        pebble.route(h, ips[(owner_of(h) + 1) % 3]);
    }
    write_atomic(
        &cluster.config,
        &acme_config(pebble, "redis", redis, hosts, ""),
    );
    let seeds: Vec<_> = ips
        .iter()
        .map(|ip| std::net::SocketAddr::from((*ip, GOSSIP_PORT)))
        .collect();
    for (i, ip) in ips.iter().enumerate() {
        let file = key_file(i, &cluster.dir);
        write_keys(&file, &[KEY_OLD]);
        let mut args = vec![
            "--challenge-listen".to_owned(),
            format!("{ip}:{}", pebble.http_port),
        ];
        args.extend(extra_args.iter().map(|a| a.to_string()));
        cluster.spawn(NodeOpts {
            node_id: NODES[i].to_owned(),
            ip: *ip,
            cluster_id: cluster.cluster_id.clone(),
            key: KeySource::File(file),
            seeds: seeds.clone(),
            extra_args: args,
        });
    }
    (cluster, ips)
}

/// Stops pod `i` and starts it again with no certificate files, as a new
/// pod starts: what it installs comes from the store.
fn restart_without_files(cluster: &mut Cluster, i: usize) {
    cluster.nodes[i].sigterm();
    assert!(
        cluster.nodes[i]
            .wait_exit(Duration::from_secs(30))
            .is_some(),
        "{} did not stop on SIGTERM",
        NODES[i]
    );
    std::fs::remove_dir_all(cluster.nodes[i].dir.join("certs")).expect("cert dir");
    cluster.nodes[i].restart();
}

fn log_lines_with(node: &Node, needles: &[&str]) -> usize {
    std::fs::read_to_string(&node.log_path)
        .unwrap_or_default()
        .lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .count()
}

/// [`log_lines_with`] in the log of the node's current process only.
fn current_log_lines_with(node: &Node, needles: &[&str]) -> usize {
    let log = std::fs::read_to_string(&node.log_path).unwrap_or_default();
    let current = log.rsplit("=== spawn #").next().unwrap_or_default();
    current
        .lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .count()
}

#[test]
fn rotated_key_file_reaches_the_store_and_every_replica_installs_new_certificates() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let Some(redis) = redis_from_env() else {
        return;
    };
    let first = unique_hosts("rot-a", 3);
    let (mut cluster, ips) = three_pods(
        91,
        &pebble,
        &redis,
        &first,
        &["--acme-order-lock-ttl-secs", "10"],
    );
    let (restarted, stayed, lagging) = (0, 1, 2);
    let before_rotation = wait_installed(&cluster, &pebble, &[0, 1, 2], &first);

    // 2. `[new, old]` on two pods; one restarts and orders a new host.
    let reloads = reload_counts(&cluster);
    for i in [restarted, stayed] {
        write_keys(&key_file(i, &cluster.dir), &[KEY_NEW, KEY_OLD]);
    }
    cluster.wait_until("the rotated pods reloaded their key files", || {
        [restarted, stayed]
            .iter()
            .all(|i| count_in_log(&cluster.nodes[*i], "cluster key ring reloaded") > reloads[*i])
    });
    restart(&mut cluster, restarted);
    let added: Vec<String> = (0..)
        .map(|i| unique_hosts(&format!("rot-b{i}"), 1).remove(0))
        .find(|h| owner_of(h) == restarted)
        .into_iter()
        .collect();
    pebble.route(&added[0], ips[stayed]);
    let all: Vec<String> = first.iter().chain(&added).cloned().collect();
    write_atomic(
        &cluster.config,
        &acme_config(&pebble, "redis", &redis, &all, ""),
    );
    wait_installed(&cluster, &pebble, &[restarted, stayed], &all);
    // Every record and the account move to the new primary.
    let resealed = |cluster: &Cluster| {
        let certs: usize = cluster
            .nodes
            .iter()
            .map(|n| log_lines_with(n, &["certificate record resealed", &key_id(KEY_NEW)]))
            .sum();
        let account: usize = cluster
            .nodes
            .iter()
            .map(|n| log_lines_with(n, &["ACME account record resealed", &key_id(KEY_NEW)]))
            .sum();
        certs >= first.len() && account >= 1
    };
    cluster.wait_until("the records sealed under the old key are resealed", || {
        resealed(&cluster)
    });

    // 3. The lagging pod restarts on `[old]`.
    restart(&mut cluster, lagging);
    let new_id = key_id(KEY_NEW);
    cluster.wait_until("the lagging pod reports what it cannot open", || {
        let node = &cluster.nodes[lagging];
        current_log_lines_with(node, &["WARN", &new_id, "not in the cluster key ring"]) >= 1
            && missing_key_count(node) >= 1.0
    });
    // Not spinning on the unreadable records: a modest store cadence, and
    // one warning per key id, not one per read.
    let node = &cluster.nodes[lagging];
    let (ops0, t0) = (store_ops(node), Instant::now());
    cluster.wait_until("10 s of store traffic measured", || {
        t0.elapsed() >= Duration::from_secs(10)
    });
    let rate = (store_ops(node) - ops0) / t0.elapsed().as_secs_f64();
    eprintln!(
        "{}: {rate:.1} store operations/s while its records were unreadable",
        NODES[lagging]
    );
    assert!(
        rate < 20.0,
        "{} read the store {rate:.0} times/s with unreadable records",
        NODES[lagging]
    );
    assert_eq!(
        current_log_lines_with(node, &["WARN", &new_id, "not in the cluster key ring"]),
        1,
        "one warning per key id:\n{}",
        node.log_tail(40)
    );
    // Its certificates on disk are kept meanwhile.
    let root = pebble.root_pem();
    for h in &first {
        handshake_ok(&node.dir.join("certs"), h, &root)
            .unwrap_or_else(|e| panic!("{} lost {h}: {e}", NODES[lagging]));
    }
    // Its file catches up: it installs everything, without a restart.
    write_keys(&key_file(lagging, &cluster.dir), &[KEY_NEW, KEY_OLD]);
    let after_rotation = wait_installed(&cluster, &pebble, &[0, 1, 2], &all);
    for h in &first {
        assert_eq!(
            before_rotation.get(h),
            after_rotation.get(h),
            "{h} was re-ordered by the rotation"
        );
    }

    // 4. `[new]` everywhere; a pod that starts now opens every record.
    let reloads = reload_counts(&cluster);
    for i in 0..3 {
        write_keys(&key_file(i, &cluster.dir), &[KEY_NEW]);
    }
    wait_key_reloads(&cluster, &reloads);
    // It starts with no files (a new pod): everything comes from the store.
    restart_without_files(&mut cluster, stayed);
    wait_installed(&cluster, &pebble, &[0, 1, 2], &all);
    assert_eq!(
        missing_key_count(&cluster.nodes[stayed]),
        0.0,
        "{}",
        cluster.nodes[stayed].log_tail(40)
    );
    // One certificate per host at the CA: the rotation ordered nothing.
    let mut cache = SerialCache::default();
    for (h, n) in pebble.issued_counts(&all, &mut cache) {
        assert_eq!(n, 1, "Pebble issued {n} certificates for {h}");
    }
    for n in &cluster.nodes {
        assert!(n.is_running(), "{} exited: {}", n.id(), n.describe());
    }
}

/// Sum of `name{labels}` over every node's `/metrics`.
fn total(cluster: &Cluster, name: &str, labels: &[(&str, &str)]) -> f64 {
    cluster.metric_total(&cluster.all(), name, labels)
}

/// Every node lists every node (itself included) with `key_id`.
fn every_view_shows_key(cluster: &Cluster, key_id: &str) -> bool {
    cluster.nodes.iter().all(|viewer| {
        viewer.status().is_some_and(|v| {
            cluster.nodes.iter().all(|n| {
                node_entries(&v, n.id())
                    .first()
                    .is_some_and(|e| e["key_id"] == key_id)
            })
        })
    })
}

/// The kubelet's way with a mounted Secret: each pod's file changes on its
/// own, a pod at a time. Waits until pod `i` has read it, then `gap` more
/// before the next pod (the next pod's update comes later).
fn roll_key_files(cluster: &Cluster, keys: &[&str], gap: Duration) {
    for (i, node) in cluster.nodes.iter().enumerate() {
        let before = count_in_log(node, "cluster key ring reloaded");
        write_keys(&key_file(i, &cluster.dir), keys);
        cluster.wait_until(&format!("{} read its key file", node.id()), || {
            count_in_log(node, "cluster key ring reloaded") > before
        });
        let t = Instant::now();
        cluster.wait_until("the gap between two pods' updates", || t.elapsed() >= gap);
    }
}

/// docs/operations.md#rotate-the-cluster-key: `[old]` → `[new, old]` →
/// `[new]`, file by file, one pod at a time with a delay between pods: no member is ever marked down, no
/// packet fails to decrypt, and the certificates stored before the rotation
/// are still delivered after it (to a pod that starts with no files).
///
/// Address block: 127.0.92.1-3.
#[test]
fn a_rotation_rolled_out_pod_by_pod_drops_no_packet_and_keeps_the_certificates() {
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let Some(redis) = redis_from_env() else {
        return;
    };
    let hosts = unique_hosts("roll", 2);
    let (mut cluster, _) = three_pods(92, &pebble, &redis, &hosts, &[]);
    let all = cluster.all();
    cluster.wait_converged(&all);
    let before = wait_installed(&cluster, &pebble, &all, &hosts);
    let old_id = sbmesh::display_key_id(&key_bytes(KEY_OLD));
    let new_id = sbmesh::display_key_id(&key_bytes(KEY_NEW));
    cluster.wait_until("every view shows the old key everywhere", || {
        every_view_shows_key(&cluster, &old_id)
    });
    let pids: Vec<Option<u32>> = cluster.nodes.iter().map(Node::pid).collect();
    const DECRYPT: (&str, &str) = ("reason", "decrypt");
    const DOWN: (&str, &str) = ("state", "down");
    let rejected = "mesh_packets_rejected_total";
    let changes = "mesh_member_state_changes_total";
    let (decrypt0, down0) = (
        total(&cluster, rejected, &[DECRYPT]),
        total(&cluster, changes, &[DOWN]),
    );

    // The new key first, pod by pod; then, once every node seals with it
    // (what the operator's grace waits for), the old key goes, pod by pod.
    let gap = Duration::from_secs(3);
    roll_key_files(&cluster, &[KEY_NEW, KEY_OLD], gap);
    cluster.wait_until("every view shows the new key everywhere", || {
        every_view_shows_key(&cluster, &new_id)
    });
    roll_key_files(&cluster, &[KEY_NEW], gap);
    // Traffic under the final ring: a full probe round and more.
    let t = Instant::now();
    cluster.wait_until("10 s of traffic on [new]", || {
        t.elapsed() >= Duration::from_secs(10)
    });
    cluster.wait_converged(&all);
    assert_eq!(
        total(&cluster, rejected, &[DECRYPT]) - decrypt0,
        0.0,
        "packets failed to decrypt during the rotation"
    );
    assert_eq!(
        total(&cluster, changes, &[DOWN]) - down0,
        0.0,
        "a member was marked down during the rotation"
    );
    for (i, n) in cluster.nodes.iter().enumerate() {
        assert_eq!(n.pid(), pids[i], "{} was restarted", NODES[i]);
    }

    // A pod that starts now, with no files, gets the certificates stored
    // before the rotation (resealed under the new key) from the store.
    let fresh = 1;
    restart_without_files(&mut cluster, fresh);
    let after = wait_installed(&cluster, &pebble, &all, &hosts);
    assert_eq!(before, after, "the same certificates, not new ones");
    assert_eq!(
        missing_key_count(&cluster.nodes[fresh]),
        0.0,
        "{}",
        cluster.nodes[fresh].log_tail(40)
    );
    let mut cache = SerialCache::default();
    for (h, n) in pebble.issued_counts(&hosts, &mut cache) {
        assert_eq!(n, 1, "Pebble issued {n} certificates for {h}");
    }
}
