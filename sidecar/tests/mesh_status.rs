//! The admin listener and the mesh's defences, against real sidecar
//! processes (docs/reference.md: cluster status, the mesh, metrics):
//!
//! - `/admin/cluster/status` field by field, Basic auth, `/healthz`,
//!   `/readyz`, the mesh metric names (127.0.12.*);
//! - a node with a wrong key and one with another cluster id never join, and
//!   the rejections are counted by reason (127.0.13.*);
//! - random UDP datagrams and TCP bytes are counted and change nothing
//!   (127.0.14.*);
//! - key rotation through `--cluster-key-file` without restart (127.0.15.*);
//! - key rings `[old,new]`+`[old]` (127.0.16.*) and `[new,old]`+`[old]`
//!   (127.0.18.*) form a mesh;
//! - a captured sealed packet replayed, tampered with or truncated is
//!   rejected and counted (127.0.17.*).
//!
//! Each test has its own 127.0.X.* block so they run in parallel.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const REJECTED: &str = "mesh_packets_rejected_total";
/// Mesh bytes each node must receive while a mesh is watched for flapping.
const STABLE_BYTES: f64 = 2000.0;

// ---------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------

fn field<'a>(v: &'a Value, key: &str, ctx: &str) -> &'a Value {
    v.get(key)
        .unwrap_or_else(|| panic!("{ctx}: missing key {key:?} in {v}"))
}

fn u64_field(v: &Value, key: &str, ctx: &str) -> u64 {
    field(v, key, ctx)
        .as_u64()
        .unwrap_or_else(|| panic!("{ctx}: {key:?} is not a non-negative integer: {v}"))
}

fn str_field<'a>(v: &'a Value, key: &str, ctx: &str) -> &'a str {
    field(v, key, ctx)
        .as_str()
        .unwrap_or_else(|| panic!("{ctx}: {key:?} is not a string: {v}"))
}

fn is_sha256_tag(s: &str) -> bool {
    s.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.chars()
                .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c))
    })
}

fn warn_extra_keys(v: &Value, known: &[&str], ctx: &str) {
    if let Some(o) = v.as_object() {
        let extra: Vec<&String> = o.keys().filter(|k| !known.contains(&k.as_str())).collect();
        if !extra.is_empty() {
            eprintln!("note: {ctx} has keys beyond docs/reference.md#cluster-status: {extra:?}");
        }
    }
}

/// Sum of `mesh_packets_rejected_total` over all reasons on one node.
fn rejected_all(n: &Node) -> f64 {
    n.metrics()
        .and_then(|m| metric_sum(&m, REJECTED, &[]))
        .unwrap_or(0.0)
}

fn rejected(n: &Node, reason: &str) -> f64 {
    n.metrics()
        .and_then(|m| metric_sum(&m, REJECTED, &[("reason", reason)]))
        .unwrap_or(0.0)
}

fn rejected_by_reason(n: &Node) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    if let Some(m) = n.metrics() {
        for l in m.lines() {
            if let Some((name, labels, v)) = parse_sample(l)
                && name == REJECTED
            {
                let r = labels
                    .iter()
                    .find(|(k, _)| k == "reason")
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default();
                *out.entry(r).or_insert(0.0) += v;
            }
        }
    }
    out
}

fn bytes_received(n: &Node) -> f64 {
    n.metrics()
        .and_then(|m| metric_sum(&m, "mesh_bytes_received_total", &[]))
        .unwrap_or(0.0)
}

fn state_changes(c: &Cluster, members: &[usize], state: &str) -> f64 {
    c.metric_total(
        members,
        "mesh_member_state_changes_total",
        &[("state", state)],
    )
}

/// After convergence: wait for more traffic (every node received at least
/// `extra` more mesh bytes: several probe periods and a suspicion timeout
/// at the default tuning), then check that the mesh is still the same and
/// that nobody went `suspect` or `down` meanwhile.
fn still_converged_after_traffic(c: &Cluster, members: &[usize], extra: f64) {
    let suspect0 = state_changes(c, members, "suspect");
    let down0 = state_changes(c, members, "down");
    let base: Vec<f64> = members
        .iter()
        .map(|&i| bytes_received(&c.nodes[i]))
        .collect();
    c.wait_until(
        &format!("every node received {extra} more mesh bytes"),
        || {
            members
                .iter()
                .zip(&base)
                .all(|(&i, b)| bytes_received(&c.nodes[i]) >= b + extra)
        },
    );
    let (suspect1, down1) = (
        state_changes(c, members, "suspect"),
        state_changes(c, members, "down"),
    );
    if !c.converged(members) || suspect1 > suspect0 || down1 > down0 {
        c.dump();
        panic!(
            "{:?} did not stay one healthy mesh: suspect transitions {suspect0} -> {suspect1}, \
             down transitions {down0} -> {down1}",
            c.ids(members)
        );
    }
}

// ---------------------------------------------------------------------------
// status JSON, auth, health, metrics
// ---------------------------------------------------------------------------

#[test]
fn status_json_auth_health_and_metrics_follow_the_spec() {
    let c = Cluster::start("127.0.12", 3);
    let all = c.all();
    let ids = c.ids(&all);

    for n in &c.nodes {
        c.wait_until(&format!("{} /healthz answers", n.id()), || {
            n.get("/healthz", None).is_ok_and(|r| r.status == 200)
        });
    }
    c.wait_converged(&all);
    c.wait_until("every node shows healthy_nodes 3", || {
        c.nodes.iter().all(|n| {
            n.status().is_some_and(|v| {
                v.pointer("/summary/healthy_nodes").and_then(Value::as_u64) == Some(3)
            })
        })
    });

    // ---- /healthz, /readyz ------------------------------------------------
    for n in &c.nodes {
        let r = n.get("/healthz", None).expect("GET /healthz");
        assert_eq!(r.status, 200, "/healthz on {}", n.id());
        assert_eq!(r.text().trim(), "ok", "/healthz body on {}", n.id());
        c.wait_until(&format!("{} /readyz is 200", n.id()), || {
            n.get("/readyz", None).is_ok_and(|r| r.status == 200)
        });
    }

    // ---- Basic auth -----------------------------------------------------
    let n0 = &c.nodes[0];
    let path = "/admin/cluster/status";
    let host = n0.admin_addr();
    let cases: Vec<(&str, std::io::Result<HttpResponse>)> = vec![
        ("no credentials", n0.get(path, None)),
        ("wrong password", n0.get(path, Some((ADMIN_USER, "not-the-password")))),
        ("wrong user", n0.get(path, Some(("root", ADMIN_PASSWORD)))),
        ("empty password", n0.get(path, Some((ADMIN_USER, "")))),
        (
            "password with a suffix",
            n0.get(path, Some((ADMIN_USER, &format!("{ADMIN_PASSWORD}x")))),
        ),
        (
            "not base64",
            http_raw(
                host,
                format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Basic %%%\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            ),
        ),
        (
            "bearer scheme",
            http_raw(
                host,
                format!(
                    "GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
                    base64(format!("{ADMIN_USER}:{ADMIN_PASSWORD}").as_bytes())
                )
                .as_bytes(),
            ),
        ),
    ];
    for (what, r) in cases {
        let r = r.unwrap_or_else(|e| panic!("{what}: request failed: {e}"));
        assert_eq!(
            r.status,
            401,
            "{what}: expected 401, got {} {}",
            r.status,
            r.text()
        );
        assert_eq!(
            r.header("www-authenticate"),
            Some(r#"Basic realm="sbmesh""#),
            "{what}: WWW-Authenticate header"
        );
        assert!(
            !r.text().contains("local_node_id"),
            "{what}: the 401 body leaks the status: {}",
            r.text()
        );
    }
    let ok = n0
        .get(path, Some((ADMIN_USER, ADMIN_PASSWORD)))
        .expect("GET status");
    assert_eq!(ok.status, 200);
    assert!(
        ok.header("content-type")
            .is_some_and(|t| t.starts_with("application/json")),
        "content-type {:?}",
        ok.header("content-type")
    );

    // ---- status JSON, field by field (docs/reference.md#cluster-status) ------
    let now = now_unix_ms();
    let mut hashes = Vec::new();
    for n in &c.nodes {
        let v = n.status().expect("status");
        let ctx = format!("status of {}", n.id());
        warn_extra_keys(
            &v,
            &[
                "schema_version",
                "cluster_id",
                "local_node_id",
                "generated_at_unix_ms",
                "summary",
                "nodes",
            ],
            &ctx,
        );
        assert_eq!(u64_field(&v, "schema_version", &ctx), 1, "{ctx}");
        assert_eq!(str_field(&v, "cluster_id", &ctx), CLUSTER_ID, "{ctx}");
        assert_eq!(str_field(&v, "local_node_id", &ctx), n.id(), "{ctx}");
        let gen_at = u64_field(&v, "generated_at_unix_ms", &ctx);
        assert!(
            gen_at.abs_diff(now) < 60_000,
            "{ctx}: generated_at_unix_ms {gen_at} is not close to now {now}"
        );

        let s = field(&v, "summary", &ctx);
        let sctx = format!("{ctx}.summary");
        warn_extra_keys(
            s,
            &[
                "total_nodes",
                "healthy_nodes",
                "suspect_nodes",
                "down_nodes",
                "config_hashes",
            ],
            &sctx,
        );
        assert_eq!(u64_field(s, "total_nodes", &sctx), 3, "{sctx}");
        assert_eq!(u64_field(s, "healthy_nodes", &sctx), 3, "{sctx}");
        assert_eq!(u64_field(s, "suspect_nodes", &sctx), 0, "{sctx}");
        assert_eq!(u64_field(s, "down_nodes", &sctx), 0, "{sctx}");
        let ch = field(s, "config_hashes", &sctx)
            .as_object()
            .unwrap_or_else(|| panic!("{sctx}.config_hashes is not an object: {s}"));
        assert_eq!(ch.len(), 1, "{sctx}: one sb.yml, one hash: {s}");
        let (hash, count) = ch.iter().next().unwrap();
        assert!(is_sha256_tag(hash), "{sctx}: config_hashes key {hash:?}");
        assert_eq!(count.as_u64(), Some(3), "{sctx}: config_hashes count");

        let nodes = field(&v, "nodes", &ctx)
            .as_array()
            .unwrap_or_else(|| panic!("{ctx}: nodes is not an array"));
        assert_eq!(nodes.len(), 3, "{ctx}: nodes");
        let mut seen: Vec<String> = Vec::new();
        for e in nodes {
            let id = str_field(e, "node_id", &ctx).to_string();
            let ectx = format!("{ctx}.nodes[{id}]");
            warn_extra_keys(
                e,
                &[
                    "node_id",
                    "local",
                    "address",
                    "membership_state",
                    "incarnation",
                    "last_seen_ms_ago",
                    "health",
                    "version",
                    "config_hash",
                    "last_reload",
                    "certificates",
                ],
                &ectx,
            );
            let peer = &c.nodes[c.idx(&id)];
            let local = field(e, "local", &ectx)
                .as_bool()
                .unwrap_or_else(|| panic!("{ectx}: local is not a bool"));
            assert_eq!(local, id == n.id(), "{ectx}: local");
            let addr: SocketAddr = str_field(e, "address", &ectx)
                .parse()
                .unwrap_or_else(|err| panic!("{ectx}: address is not ip:port: {err}"));
            assert_eq!(addr, peer.gossip_addr(), "{ectx}: address");
            assert_eq!(str_field(e, "membership_state", &ectx), "alive", "{ectx}");
            u64_field(e, "incarnation", &ectx);
            let seen_ago = u64_field(e, "last_seen_ms_ago", &ectx);
            if local {
                assert_eq!(seen_ago, 0, "{ectx}: last_seen_ms_ago of the local node");
            } else {
                assert!(seen_ago < 60_000, "{ectx}: last_seen_ms_ago {seen_ago}");
            }
            assert_eq!(str_field(e, "health", &ectx), "healthy", "{ectx}");
            assert_eq!(
                str_field(e, "version", &ectx),
                env!("CARGO_PKG_VERSION"),
                "{ectx}: version"
            );
            let h = str_field(e, "config_hash", &ectx);
            assert!(is_sha256_tag(h), "{ectx}: config_hash {h:?}");
            assert_eq!(h, hash, "{ectx}: config_hash vs summary.config_hashes");
            let lr = field(e, "last_reload", &ectx);
            if !lr.is_null() {
                let lctx = format!("{ectx}.last_reload");
                let res = str_field(lr, "result", &lctx);
                assert!(!res.is_empty(), "{lctx}: result");
                u64_field(lr, "at_unix_ms", &lctx);
            }
            let certs = field(e, "certificates", &ectx)
                .as_array()
                .unwrap_or_else(|| panic!("{ectx}: certificates is not an array"));
            for cert in certs {
                str_field(cert, "host", &ectx);
                u64_field(cert, "not_after_unix", &ectx);
                str_field(cert, "serial", &ectx);
            }
            seen.push(id);
        }
        seen.sort();
        assert_eq!(seen, ids, "{ctx}: node ids");
        hashes.push(hash.clone());
    }
    hashes.dedup();
    assert_eq!(
        hashes.len(),
        1,
        "all nodes read the same sb.yml: {hashes:?}"
    );

    // ---- metrics (docs/reference.md#metrics) --------------------------------
    c.wait_until("every node's mesh_peer_count{state=\"alive\"} is 2", || {
        c.nodes.iter().all(|n| {
            n.metrics()
                .and_then(|m| metric_sum(&m, "mesh_peer_count", &[("state", "alive")]))
                == Some(2.0)
        })
    });
    for n in &c.nodes {
        let r = n.get("/metrics", None).expect("GET /metrics");
        assert_eq!(r.status, 200, "/metrics needs no auth");
        let m = r.text();
        for name in [
            "mesh_peer_count",
            "mesh_bytes_sent_total",
            "mesh_bytes_received_total",
            "mesh_member_state_changes_total",
        ] {
            assert!(
                metric_sum(&m, name, &[]).is_some(),
                "{}: no sample of {name} in /metrics:\n{m}",
                n.id()
            );
        }
        assert!(
            metric_family_present(&m, REJECTED),
            "{}: {REJECTED} is not declared in /metrics:\n{m}",
            n.id()
        );
        for dir in ["mesh_bytes_sent_total", "mesh_bytes_received_total"] {
            let udp = metric_sum(&m, dir, &[("transport", "udp")]).unwrap_or(0.0);
            assert!(udp > 0.0, "{}: {dir}{{transport=\"udp\"}} is {udp}", n.id());
        }
        assert_eq!(
            metric_sum(&m, "mesh_peer_count", &[("state", "down")]),
            Some(0.0),
            "{}: down peers (the gauge is registered at 0)",
            n.id()
        );
    }
}

// ---------------------------------------------------------------------------
// wrong key, other cluster id
// ---------------------------------------------------------------------------

#[test]
fn wrong_key_and_other_cluster_never_join_and_are_counted() {
    let mut c = Cluster::start("127.0.13", 3);
    let members = vec![0, 1, 2];
    c.wait_converged(&members);

    let mut wrong_key = c.default_opts(4, 3);
    wrong_key.node_id = "intruder-wrong-key".into();
    wrong_key.key = KeySource::Hex(KEY_WRONG.into());
    let mut other_cluster = c.default_opts(5, 3);
    other_cluster.node_id = "intruder-other-cluster".into();
    other_cluster.cluster_id = "another-cluster".into();
    let ik = c.spawn(wrong_key);
    let ic = c.spawn(other_cluster);
    let intruders = ["intruder-wrong-key", "intruder-other-cluster"];

    // The intruders are alone, so they keep calling their seeds: wait for
    // several rounds of rejections, checking the membership on every poll.
    let rounds = 3.0 * members.len() as f64;
    let mut violation: Option<String> = None;
    c.wait_until(
        &format!("the members rejected {rounds} packets for reason decrypt and {rounds} for reason cluster"),
        || {
            for &i in &members {
                if let Some(v) = c.nodes[i].status() {
                    let listed = listed_set(&v);
                    if let Some(bad) = intruders.iter().find(|id| listed.contains(**id)) {
                        violation.get_or_insert(format!("{} lists {bad}: {}", c.nodes[i].id(), v));
                    }
                }
            }
            violation.is_some()
                || (c.metric_total(&members, REJECTED, &[("reason", "decrypt")]) >= rounds
                    && c.metric_total(&members, REJECTED, &[("reason", "cluster")]) >= rounds)
        },
    );
    if let Some(v) = violation {
        c.dump();
        panic!("an intruder appeared in the membership: {v}");
    }
    for &i in &members {
        eprintln!(
            "{} rejected: {:?}",
            c.nodes[i].id(),
            rejected_by_reason(&c.nodes[i])
        );
    }
    // The cluster is intact and lists neither intruder.
    assert!(c.converged(&members), "the cluster was disturbed");
    for &i in &members {
        let v = c.nodes[i].status().expect("status");
        assert_eq!(listed_set(&v).len(), 3, "{}: {v}", c.nodes[i].id());
    }
    // Both intruders are alone.
    for i in [ik, ic] {
        let n = &c.nodes[i];
        assert!(n.is_running(), "{} died: {}", n.id(), n.describe());
        let v = n.status().expect("intruder status");
        assert_eq!(total_nodes(&v), Some(1), "{} sees others: {v}", n.id());
    }
}

// ---------------------------------------------------------------------------
// random garbage
// ---------------------------------------------------------------------------

#[test]
fn random_udp_and_tcp_garbage_is_counted_and_harmless() {
    let c = Cluster::start("127.0.14", 3);
    let all = c.all();
    c.wait_converged(&all);
    let target = &c.nodes[0];
    let mut rng = Rng::seeded();

    // ---- UDP -----------------------------------------------------------------
    let base = rejected_all(target);
    let sock = UdpSocket::bind("127.0.14.200:0").expect("bind sender");
    let mut sizes: Vec<usize> = (0..120).map(|_| 1 + rng.below(1500) as usize).collect();
    sizes.extend([1, 2, 16, 40, 9000, 65_000]);
    for &len in &sizes {
        sock.send_to(&rng.bytes(len), target.gossip_addr())
            .expect("send garbage datagram");
        // pace, so the receive buffer never overflows
        std::thread::sleep(Duration::from_millis(2));
    }
    let sent = sizes.len() as f64;
    c.wait_until(
        &format!("node-1 counted all {sent} garbage datagrams as rejected"),
        || rejected_all(target) >= base + sent,
    );
    eprintln!("after UDP garbage: {:?}", rejected_by_reason(target));

    // ---- TCP -----------------------------------------------------------------
    let base = rejected_all(target);
    let mut streams: Vec<Vec<u8>> = vec![rng.bytes(4096), vec![0xff; 64]];
    let mut big = vec![0x7f; 8];
    big.extend(rng.bytes(100_000));
    streams.push(big);
    for bytes in &streams {
        let mut s = TcpStream::connect_timeout(&target.transport_addr(), Duration::from_secs(2))
            .expect("connect to the transport port");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // The node may close as soon as it sees a bad frame: write errors are fine.
        let _ = s.write_all(bytes);
        let _ = s.shutdown(Shutdown::Write);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    c.wait_until(
        &format!("node-1 counted the {} garbage TCP streams", streams.len()),
        || rejected_all(target) >= base + streams.len() as f64,
    );
    eprintln!("after TCP garbage: {:?}", rejected_by_reason(target));

    // ---- nothing changed -------------------------------------------------------
    assert!(target.is_running(), "node-1 died: {}", target.describe());
    let r = target.get("/healthz", None).expect("healthz");
    assert_eq!(r.status, 200);
    assert!(c.converged(&all), "membership changed after garbage");
    still_converged_after_traffic(&c, &all, STABLE_BYTES);
}

// ---------------------------------------------------------------------------
// captured packets: replay, tamper, truncate
// ---------------------------------------------------------------------------

enum Captured {
    Udp { from: SocketAddr, bytes: Vec<u8> },
    Tcp { from: SocketAddr, bytes: Vec<u8> },
}

/// Listens on a seed address nobody runs a node on; the nodes contact it
/// (announce / join) with real sealed traffic, which we keep.
fn capture_from_ghost(c: &Cluster, udp: &UdpSocket, tcp: &TcpListener) -> Captured {
    udp.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    tcp.set_nonblocking(true).unwrap();
    let end = Instant::now() + deadline();
    let mut tcp_capture: Option<(Instant, Captured)> = None;
    let mut buf = vec![0u8; 70_000];
    while Instant::now() < end {
        if let Ok((n, from)) = udp.recv_from(&mut buf)
            && n > 0
        {
            return Captured::Udp {
                from,
                bytes: buf[..n].to_vec(),
            };
        }
        if tcp_capture.is_none()
            && let Ok((mut s, from)) = tcp.accept()
        {
            s.set_nonblocking(false).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(1000)))
                .unwrap();
            let mut bytes = Vec::new();
            let mut chunk = [0u8; 16384];
            while let Ok(n) = s.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                bytes.extend_from_slice(&chunk[..n]);
            }
            if !bytes.is_empty() {
                tcp_capture = Some((Instant::now(), Captured::Tcp { from, bytes }));
            }
        }
        // Prefer a datagram; settle for the TCP stream 5 s after it came.
        if tcp_capture
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() > Duration::from_secs(5))
        {
            break;
        }
    }
    tcp_capture.map(|(_, cap)| cap).unwrap_or_else(|| {
        c.dump();
        panic!(
            "no node sent anything to the seed 127.0.17.99 within {:?}",
            deadline()
        )
    })
}

#[test]
fn captured_packets_replayed_tampered_or_truncated_are_rejected() {
    let ghost_udp = UdpSocket::bind("127.0.17.99:7946").expect("bind ghost UDP");
    let ghost_tcp = TcpListener::bind("127.0.17.99:8946").expect("bind ghost TCP");
    let ghost: SocketAddr = "127.0.17.99:7946".parse().unwrap();

    let mut c = Cluster::new("127.0.17");
    for i in 1..=3 {
        let mut o = c.default_opts(i, 3);
        o.seeds.push(ghost);
        c.spawn(o);
    }
    let all = c.all();
    let captured = capture_from_ghost(&c, &ghost_udp, &ghost_tcp);
    c.wait_converged(&all);

    let (from, bytes, is_udp) = match captured {
        Captured::Udp { from, bytes } => (from, bytes, true),
        Captured::Tcp { from, bytes } => (from, bytes, false),
    };
    // Replay at a node that did not send it.
    let sender = all
        .iter()
        .copied()
        .find(|&i| c.nodes[i].opts.ip == from.ip())
        .unwrap_or_else(|| panic!("captured traffic from unknown address {from}"));
    let target_i = all.iter().copied().find(|&i| i != sender).unwrap();
    let target = &c.nodes[target_i];
    eprintln!(
        "captured {} bytes over {} from {}; replaying at {}",
        bytes.len(),
        if is_udp { "UDP" } else { "TCP" },
        c.nodes[sender].id(),
        target.id()
    );

    let send = |payload: &[u8]| {
        if is_udp {
            ghost_udp
                .send_to(payload, target.gossip_addr())
                .expect("send datagram");
        } else {
            let mut s =
                TcpStream::connect_timeout(&target.transport_addr(), Duration::from_secs(2))
                    .expect("connect transport");
            s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let _ = s.write_all(payload);
            let _ = s.shutdown(Shutdown::Write);
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
        }
        std::thread::sleep(Duration::from_millis(20));
    };

    let base_replay = rejected(target, "replay");
    let base_all = rejected_all(target);
    // The same sealed bytes twice: the second copy is a replay.
    send(&bytes);
    send(&bytes);
    c.wait_until(
        &format!(
            "{} counts the second copy as reason=\"replay\"",
            target.id()
        ),
        || rejected(target, "replay") >= base_replay + 1.0,
    );

    // One bit flipped in the middle, one in the last byte (the AEAD tag), a truncation.
    let mut mid = bytes.clone();
    let m = mid.len() / 2;
    mid[m] ^= 0x01;
    let mut tail = bytes.clone();
    *tail.last_mut().unwrap() ^= 0x80;
    let trunc = bytes[..bytes.len() / 2].to_vec();
    let base_after_replay = rejected_all(target);
    for p in [&mid, &tail, &trunc] {
        send(p);
    }
    c.wait_until(
        &format!("{} counts the tampered and truncated copies", target.id()),
        || rejected_all(target) >= base_after_replay + 3.0,
    );
    eprintln!(
        "{} rejected (was {base_all} in total before): {:?}",
        target.id(),
        rejected_by_reason(target)
    );

    assert!(c.converged(&all), "membership changed");
    still_converged_after_traffic(&c, &all, STABLE_BYTES);
}

// ---------------------------------------------------------------------------
// key rotation and key rings
// ---------------------------------------------------------------------------

#[test]
fn key_rotation_through_the_key_file_without_restart() {
    let mut c = Cluster::new("127.0.15");
    let mut files = Vec::new();
    for i in 1..=3 {
        let kf = c.dir.join(format!("cluster-key-{i}"));
        write_atomic(&kf, &format!("{KEY_OLD}\n"));
        let mut o = c.default_opts(i, 3);
        o.key = KeySource::File(kf.clone());
        files.push(kf);
        c.spawn(o);
    }
    let members = vec![0, 1, 2];
    c.wait_converged(&members);
    let pids: Vec<Option<u32>> = c.nodes.iter().map(Node::pid).collect();
    // Each node's entry shows the key it seals with, in every node's view.
    let key_id = |hex: &str| sbmesh::display_key_id(&sbmesh::parse_key_ring(hex).unwrap()[0]);
    let every_view_shows = |c: &Cluster, viewers: &[usize], shown: &[usize], id: &str| {
        viewers.iter().all(|&i| {
            c.nodes[i].status().is_some_and(|v| {
                shown.iter().all(|&j| {
                    node_entries(&v, c.nodes[j].id())
                        .first()
                        .is_some_and(|n| n["key_id"] == id)
                })
            })
        })
    };
    let (old_id, new_id) = (key_id(KEY_OLD), key_id(KEY_NEW));
    assert_ne!(old_id, new_id);
    c.wait_until(
        "every view shows every member's key_id as the old key's",
        || every_view_shows(&c, &members, &members, &old_id),
    );

    // Step 1: [new, old] everywhere. A node that only knows the new key can
    // join only once the members have re-read their files.
    for f in &files {
        write_atomic(f, &format!("{KEY_NEW}\n{KEY_OLD}\n"));
    }
    let mut probe_new = c.default_opts(4, 3);
    probe_new.key = KeySource::Hex(KEY_NEW.into());
    let p4 = c.spawn(probe_new);
    let with_probe = vec![0, 1, 2, p4];
    c.wait_converged(&with_probe);
    c.wait_until(
        "every view shows every node's key_id as the new key's",
        || every_view_shows(&c, &with_probe, &with_probe, &new_id),
    );

    // Step 2: [new] only. A node with the old key is now refused.
    for f in &files {
        write_atomic(f, &format!("{KEY_NEW}\n"));
    }
    let base = c.metric_total(&members, REJECTED, &[("reason", "decrypt")]);
    let mut probe_old = c.default_opts(5, 3);
    probe_old.node_id = "node-5-old-key".into();
    probe_old.key = KeySource::Hex(KEY_OLD.into());
    c.spawn(probe_old);
    c.wait_until(
        "members reject the old key (decrypt) and show the old-key node absent or down, with 4 alive",
        || {
            c.metric_total(&members, REJECTED, &[("reason", "decrypt")]) > base
                && with_probe.iter().all(|&i| {
                    c.nodes[i].status().is_some_and(|v| {
                        total_nodes(&v) == Some(4)
                            && matches!(
                                state_of(&v, "node-5-old-key").as_deref(),
                                None | Some("down")
                            )
                            && node_entries(&v, "node-5-old-key").len() <= 1
                    })
                })
        },
    );
    c.wait_converged(&with_probe);
    for (k, &i) in members.iter().enumerate() {
        assert_eq!(
            c.nodes[i].pid(),
            pids[k],
            "{} was restarted",
            c.nodes[i].id()
        );
        assert!(
            c.nodes[i].is_running(),
            "{}: {}",
            c.nodes[i].id(),
            c.nodes[i].describe()
        );
    }
}

fn rings_interoperate(prefix: &str, ring_a: &str, ring_b: &str) {
    let mut c = Cluster::new(prefix);
    let mut a = c.default_opts(1, 2);
    a.key = KeySource::Hex(ring_a.into());
    let mut b = c.default_opts(2, 2);
    b.key = KeySource::Hex(ring_b.into());
    c.spawn(a);
    c.spawn(b);
    let all = c.all();
    c.wait_converged(&all);
    still_converged_after_traffic(&c, &all, STABLE_BYTES);
    for n in &c.nodes {
        eprintln!("{} rejected: {:?}", n.id(), rejected_by_reason(n));
    }
}

/// `[old, new]` (new key installed as a secondary) with `[old]`: the first
/// step of a rotation, which "first key encrypts, all decrypt" allows.
#[test]
fn key_ring_old_new_forms_a_mesh_with_old() {
    rings_interoperate("127.0.16", &format!("{KEY_OLD},{KEY_NEW}"), KEY_OLD);
}

/// `[new, old]` with `[old]`, as issue 2 states ("rings `[new, old]` and
/// `[old]` interoperate").
#[test]
fn key_ring_new_old_forms_a_mesh_with_old() {
    rings_interoperate("127.0.18", &format!("{KEY_NEW},{KEY_OLD}"), KEY_OLD);
}
