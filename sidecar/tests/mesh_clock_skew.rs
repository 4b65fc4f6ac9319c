//! Issue 11, item 3 (mesh side): clock skew is visible and safe. Three real
//! `sbmesh-sidecar run` processes on 127.0.63.1-3; node-3 runs under
//! libfaketime with its wall clock 60 s ahead (monotonic clock untouched, so
//! its timers run normally), beyond the 30 s window of the mesh seal.
//!
//! Its packets still authenticate, so every node must name the problem:
//! `mesh_packets_rejected_total{reason="clock_skew"}` (not `replay`), a warn
//! line with the peer and the measured offset, the skewed peers in the local
//! node's `clock_skew` of `/admin/cluster/status`; and node-3, which hears
//! nothing but skewed packets, must not pass for a node alone: its `/readyz`
//! is 503 naming clock skew, while the two healthy nodes stay ready.
//!
//! Two cases: node-3 skewed from its start (127.0.63.*), and node-3's clock
//! jumping 60 s ahead after the mesh formed, then back (127.0.64.*): it
//! drops out, is not ready although it once joined, and rejoins.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    Cluster, Node, metric_sum, now_unix_ms, sidecar_bin, state_of, total_nodes, write_atomic,
};
use serde_json::Value;

const SKEW_SECS: i64 = 60;
const REJECTED: &str = "mesh_packets_rejected_total";

/// The libfaketime preload library (Debian's `faketime` package), if any.
fn libfaketime() -> Option<PathBuf> {
    let mut dirs = vec![
        PathBuf::from("/usr/lib/faketime"),
        PathBuf::from("/usr/local/lib/faketime"),
    ];
    // Multiarch: /usr/lib/<triplet>/faketime.
    if let Ok(entries) = fs::read_dir("/usr/lib") {
        dirs.extend(entries.flatten().map(|e| e.path().join("faketime")));
    }
    dirs.into_iter()
        .map(|d| d.join("libfaketime.so.1"))
        .find(|p| p.is_file())
}

/// How node-3's wall clock is set.
enum Fake<'a> {
    /// `SKEW_SECS` ahead from the start.
    Ahead,
    /// Whatever offset this file holds (`+0s`, `+60s`), re-read every second.
    File(&'a Path),
}

/// A script that runs the sidecar under libfaketime, its monotonic clock
/// untouched. `exec` keeps the PID (and the parent-death signal), so the
/// harness signals and reaps the sidecar itself.
fn skewed_sidecar(dir: &Path, lib: &Path, fake: Fake<'_>) -> PathBuf {
    let how = match fake {
        Fake::Ahead => format!("export FAKETIME='+{SKEW_SECS}s'\n"),
        Fake::File(path) => format!(
            "export FAKETIME_TIMESTAMP_FILE='{}'\nexport FAKETIME_CACHE_DURATION=1\n",
            path.display()
        ),
    };
    let script = dir.join("sidecar-skewed");
    fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             export LD_PRELOAD='{}'\n\
             {how}\
             export FAKETIME_DONT_FAKE_MONOTONIC=1\n\
             exec '{}' \"$@\"\n",
            lib.display(),
            sidecar_bin().display()
        ),
    )
    .expect("write the faketime wrapper");
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).expect("chmod the wrapper");
    script
}

fn rejected(n: &Node, reason: &str) -> f64 {
    n.metrics()
        .and_then(|m| metric_sum(&m, REJECTED, &[("reason", reason)]))
        .unwrap_or(0.0)
}

/// `(status, body)` of `/readyz`.
fn readyz(n: &Node) -> Option<(u16, String)> {
    let r = n.get("/readyz", None).ok()?;
    Some((r.status, r.text()))
}

/// The local node's `clock_skew` entries as `(address, offset_ms, rejected_packets)`.
fn skewed_peers(v: &Value) -> Vec<(String, i64, u64)> {
    v.get("nodes")
        .and_then(Value::as_array)
        .and_then(|nodes| {
            nodes
                .iter()
                .find(|n| n.get("local").and_then(Value::as_bool) == Some(true))
        })
        .and_then(|local| local.get("clock_skew"))
        .and_then(Value::as_array)
        .map(|peers| {
            peers
                .iter()
                .filter_map(|p| {
                    Some((
                        p.get("address")?.as_str()?.to_string(),
                        p.get("offset_ms")?.as_i64()?,
                        p.get("rejected_packets")?.as_u64()?,
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn near(offset_ms: i64, want_secs: i64) -> bool {
    (offset_ms - want_secs * 1000).abs() <= 5_000
}

/// Whether the node's status is stamped about `secs` away from our clock.
fn clock_off_by(n: &Node, secs: i64) -> bool {
    n.status().is_some_and(|v| {
        v.get("generated_at_unix_ms")
            .and_then(Value::as_u64)
            .is_some_and(|t| near(t as i64 - now_unix_ms() as i64, secs))
    })
}

fn need_libfaketime() -> Option<PathBuf> {
    libfaketime().or_else(|| {
        common::required::missing(
            "mesh_clock_skew",
            "libfaketime not found",
            "apt-get install -y faketime (scripts/test does)",
        )
    })
}

/// The warn lines about clock skew in a node's log, as `(peer, offset_ms)`.
fn skew_warnings(n: &Node) -> Vec<(String, i64)> {
    let log = fs::read_to_string(&n.log_path).unwrap_or_default();
    log.lines()
        .filter(|l| l.contains("WARN") && l.contains("clock skew"))
        .filter_map(|l| {
            let field = |name: &str| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(name))
                    .map(str::to_string)
            };
            Some((field("peer=")?, field("offset_ms=")?.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_node_60s_ahead_is_named_by_every_node_and_is_not_ready() {
    let Some(lib) = need_libfaketime() else {
        return;
    };
    let started = Instant::now();
    let mut c = Cluster::new("127.0.63");
    for i in 1..=2 {
        let o = c.default_opts(i, 3);
        c.spawn(o);
    }
    let wrapper = skewed_sidecar(&c.dir, &lib, Fake::Ahead);
    let skewed = Node::spawn(&wrapper, &c.config, &c.dir, c.default_opts(3, 3));
    c.nodes.push(skewed);
    let (healthy, skewed) = ([0, 1], 2);
    let skewed_addr = c.gossip_addr(3).to_string();
    let healthy_addrs = [c.gossip_addr(1).to_string(), c.gossip_addr(2).to_string()];

    // The premise: node-3's wall clock really is ahead (libfaketime works).
    c.wait_until(
        "node-3's status is stamped about 60 s ahead of ours",
        || clock_off_by(&c.nodes[skewed], SKEW_SECS),
    );
    c.wait_converged(&healthy);

    c.wait_until(
        "every node counts clock_skew rejections: node-3 from both peers, both peers from node-3",
        || (0..3).all(|i| rejected(&c.nodes[i], "clock_skew") >= 1.0),
    );

    c.wait_until(
        "node-3's /readyz is 503 naming clock skew and the offset",
        || {
            readyz(&c.nodes[skewed]).is_some_and(|(status, body)| {
                status == 503
                    && body.contains("clock skew")
                    && (body.contains("-60.") || body.contains("-59."))
            })
        },
    );
    c.wait_until("node-1 and node-2 are ready", || {
        healthy
            .iter()
            .all(|&i| readyz(&c.nodes[i]).is_some_and(|(s, _)| s == 200))
    });

    c.wait_until(
        "status: node-1 and node-2 list node-3 in clock_skew at about +60 s; node-3 lists both at about -60 s",
        || {
            let peers_ok = healthy.iter().all(|&i| {
                c.nodes[i].status().is_some_and(|v| {
                    skewed_peers(&v)
                        .iter()
                        .any(|(a, off, _)| *a == skewed_addr && near(*off, SKEW_SECS))
                })
            });
            let skewed_ok = c.nodes[skewed].status().is_some_and(|v| {
                let peers = skewed_peers(&v);
                healthy_addrs.iter().all(|want| {
                    peers
                        .iter()
                        .any(|(a, off, _)| a == want && near(*off, -SKEW_SECS))
                })
            });
            peers_ok && skewed_ok
        },
    );

    c.wait_until(
        "a warn line with the peer and the offset on every node",
        || {
            healthy.iter().all(|&i| {
                skew_warnings(&c.nodes[i])
                    .iter()
                    .any(|(p, off)| *p == skewed_addr && near(*off, SKEW_SECS))
            }) && healthy_addrs.iter().all(|want| {
                skew_warnings(&c.nodes[skewed])
                    .iter()
                    .any(|(p, off)| p == want && near(*off, -SKEW_SECS))
            })
        },
    );

    // It lasts, past the 30 s window and the 5 s "alone" rule: node-3 is
    // never ready, node-1 and node-2 always are, sampled every half second.
    let hold_until = Instant::now() + Duration::from_secs(35);
    while Instant::now() < hold_until {
        let (status, body) = readyz(&c.nodes[skewed]).expect("node-3 answers /readyz");
        assert!(
            status == 503 && body.contains("clock skew"),
            "node-3 /readyz {status}: {body}"
        );
        for &i in &healthy {
            let (status, body) = readyz(&c.nodes[i]).expect("/readyz answers");
            assert_eq!(status, 200, "{} /readyz: {body}", c.nodes[i].id());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    if let Some((_, body)) = readyz(&c.nodes[skewed]) {
        eprintln!("node-3 /readyz: {body}");
    }
    let v = c.nodes[skewed].status().expect("node-3 status");
    if let Some(local) = v.pointer("/nodes/0") {
        eprintln!("node-3 local status entry: {local}");
    }
    let local_health = v
        .pointer("/nodes/0/health")
        .and_then(Value::as_str)
        .map(str::to_string);
    assert_eq!(local_health.as_deref(), Some("unhealthy"), "node-3: {v}");

    // Skewed packets are never called replays, and never make members.
    for i in 0..3 {
        let n = &c.nodes[i];
        assert_eq!(
            rejected(n, "replay"),
            0.0,
            "{}: replay rejections with only clock skew going on",
            n.id()
        );
    }
    for &i in &healthy {
        let v = c.nodes[i].status().expect("status");
        assert_eq!(
            total_nodes(&v),
            Some(2),
            "{} counts the skewed node as a member: {v}",
            c.nodes[i].id()
        );
    }

    // Rate-limited: at most one line per peer per started minute, though
    // node-3 greets its seeds every second.
    let minutes = started.elapsed().as_secs() / 60 + 1;
    for i in 0..3 {
        let lines = skew_warnings(&c.nodes[i]);
        for peer in [&skewed_addr, &healthy_addrs[0], &healthy_addrs[1]] {
            let count = lines.iter().filter(|(p, _)| p == peer).count() as u64;
            assert!(
                count <= minutes,
                "{}: {count} warn lines about {peer} in {minutes} minute(s):\n{}",
                c.nodes[i].id(),
                c.nodes[i].log_tail(40)
            );
        }
    }
    let healthy_skew: f64 = healthy
        .iter()
        .map(|&i| rejected(&c.nodes[i], "clock_skew"))
        .sum();
    eprintln!(
        "clock_skew rejections after {:.1}s: node-1+node-2 {healthy_skew}, node-3 {}",
        started.elapsed().as_secs_f64(),
        rejected(&c.nodes[skewed], "clock_skew")
    );
}

#[test]
fn a_clock_jumping_60s_ahead_after_joining_drops_out_is_not_ready_and_rejoins() {
    let Some(lib) = need_libfaketime() else {
        return;
    };
    let mut c = Cluster::new("127.0.64");
    for i in 1..=2 {
        let o = c.default_opts(i, 3);
        c.spawn(o);
    }
    let offset_file = c.dir.join("node-3-faketime");
    write_atomic(&offset_file, "+0s\n");
    let wrapper = skewed_sidecar(&c.dir, &lib, Fake::File(&offset_file));
    let node3 = Node::spawn(&wrapper, &c.config, &c.dir, c.default_opts(3, 3));
    c.nodes.push(node3);
    let (all, healthy, skewed) = (c.all(), [0, 1], 2);
    let skewed_addr = c.gossip_addr(3).to_string();
    let skewed_id = c.nodes[skewed].id().to_string();

    c.wait_converged(&all);
    c.wait_until("every node is ready", || {
        all.iter()
            .all(|&i| readyz(&c.nodes[i]).is_some_and(|(s, _)| s == 200))
    });

    // ---- node-3's clock jumps 60 s ahead ---------------------------------
    write_atomic(&offset_file, &format!("+{SKEW_SECS}s\n"));
    c.wait_until(
        "node-3's status is stamped about 60 s ahead of ours",
        || clock_off_by(&c.nodes[skewed], SKEW_SECS),
    );
    c.wait_until(
        "node-1 and node-2 show node-3 down and list it in clock_skew at about +60 s",
        || {
            healthy.iter().all(|&i| {
                c.nodes[i].status().is_some_and(|v| {
                    total_nodes(&v) == Some(2)
                        && state_of(&v, &skewed_id).as_deref() == Some("down")
                        && skewed_peers(&v)
                            .iter()
                            .any(|(a, off, _)| *a == skewed_addr && near(*off, SKEW_SECS))
                })
            })
        },
    );
    // node-3 joined once (so it "runs"), yet it is not ready now.
    c.wait_until("node-3's /readyz is 503 naming clock skew", || {
        readyz(&c.nodes[skewed])
            .is_some_and(|(status, body)| status == 503 && body.contains("clock skew"))
    });
    for &i in &healthy {
        let (status, body) = readyz(&c.nodes[i]).expect("/readyz answers");
        assert_eq!(status, 200, "{} /readyz: {body}", c.nodes[i].id());
    }
    for i in 0..3 {
        let n = &c.nodes[i];
        assert!(
            rejected(n, "clock_skew") >= 1.0,
            "{}: no clock_skew counted",
            n.id()
        );
        assert_eq!(rejected(n, "replay"), 0.0, "{}: replay rejections", n.id());
    }
    assert!(
        skew_warnings(&c.nodes[0])
            .iter()
            .any(|(p, off)| *p == skewed_addr && near(*off, SKEW_SECS)),
        "node-1 logged no warn line about node-3:\n{}",
        c.nodes[0].log_tail(40)
    );

    // ---- and back: node-3 rejoins and is ready again ---------------------
    write_atomic(&offset_file, "+0s\n");
    c.wait_converged(&all);
    c.wait_until("node-3 is ready again", || {
        readyz(&c.nodes[skewed]).is_some_and(|(s, _)| s == 200)
    });
}
