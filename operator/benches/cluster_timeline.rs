//! The mission's timeline on the real cluster (BENCHMARKS.md, "On a real
//! Kubernetes"): `kubectl apply` of a clustered SBProxy with the sidecar's
//! ACME (3 replicas, one `san` certificate for 3 names from Pebble) -> all
//! pods Ready -> mesh formed -> every proxy serves the CA's certificate;
//! then SBProxyConfig edits -> every proxy runs them, split into the
//! kubelet's ConfigMap propagation (apply -> the `..data` swap in the pod's
//! volume) and the sidecar's part (swap -> reload POST delivered), and the
//! proxy answering the new config.
//!
//! Needs the cluster and the cluster-scope operator:
//!
//! ```text
//! scripts/cluster up && SBMESH_CLUSTER_PROFILE=debug scripts/cluster images
//! eval "$(scripts/cluster env)" && export SBMESH_TEST_KUBECONFIG=$KUBECONFIG
//! target/debug/sbmesh-operator install --rbac-scope cluster | kubectl apply -f -
//! cargo bench --profile dev -p sbmesh-operator --bench cluster_timeline
//! ```
//!
//! `SBMESH_BENCH_EDITS` (default 3) config edits are timed.

#[path = "../tests/cluster/mod.rs"]
mod cluster;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cluster::{
    Cluster, Namespace, acme_manifest, add_a, curl, pebble_root, pod_ip, serves_tls,
    sidecar_status, wait_for,
};

const NAMES: [&str; 3] = ["a.bench.test", "b.bench.test", "c.bench.test"];

fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

/// When the kubelet last swapped the ConfigMap volume of pod `uid` (the
/// `..data` symlink's change time), in unix ms: the node's own files.
fn swapped_at_ms(uid: &str) -> Option<f64> {
    let state = std::env::var("SBMESH_CLUSTER_STATE").unwrap_or("/var/lib/sbmesh-cluster".into());
    let link = format!(
        "{state}/kubelet/root/pods/{uid}/volumes/kubernetes.io~configmap/sbproxy-config/..data"
    );
    let meta = std::fs::symlink_metadata(link).ok()?;
    use std::os::unix::fs::MetadataExt;
    Some(meta.ctime() as f64 * 1000.0 + meta.ctime_nsec() as f64 / 1e6)
}

fn main() {
    let Some(c) = Cluster::from_env() else {
        eprintln!(
            "cluster_timeline: no cluster; see the header of operator/benches/cluster_timeline.rs"
        );
        return;
    };
    let edits: usize = std::env::var("SBMESH_BENCH_EDITS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    c.operator();
    let ns = Namespace::new(&c, "bench-timeline", &[]);

    let t0 = Instant::now();
    let manifest = acme_manifest(&c, &ns.name, &NAMES, 2);
    c.apply(&manifest);
    let ip = wait_for("demo-svc", Duration::from_secs(60), || {
        ns.get(&["service", "demo-svc"])?["spec"]["clusterIP"]
            .as_str()
            .map(str::to_string)
    });
    for name in NAMES {
        add_a(&c, name, &ip);
    }
    let pods = ns.ready_pods("demo", 3);
    let ready = t0.elapsed();
    wait_for("the mesh formed", Duration::from_secs(120), || {
        pods.iter()
            .all(|p| {
                sidecar_status(&pod_ip(p), Some(("admin", "secret")))
                    .is_some_and(|s| s["summary"]["healthy_nodes"] == 3)
            })
            .then_some(())
    });
    let mesh = t0.elapsed();
    let root = pebble_root(&c);
    wait_for(
        "every proxy serving Pebble's certificate",
        Duration::from_secs(300),
        || {
            let pods = ns.proxy_pods("demo");
            (pods.len() == 3
                && pods.iter().all(|p| {
                    cluster::pod_ready(p)
                        && NAMES.iter().all(|n| serves_tls(&root, n, &pod_ip(p), 8443))
                }))
            .then_some(())
        },
    );
    let served = t0.elapsed();
    println!(
        "apply -> 3 pods Ready          {:6.1} s",
        ready.as_secs_f64()
    );
    println!(
        "apply -> mesh formed           {:6.1} s",
        mesh.as_secs_f64()
    );
    println!(
        "apply -> every proxy serves it {:6.1} s",
        served.as_secs_f64()
    );

    // Resident memory of the two processes of each pod, side by side.
    println!("\nRSS per pod (MiB): proxy | sidecar");
    for p in ns.proxy_pods("demo") {
        let rss = |container: &str| {
            cluster::container_rss(&c, &cluster::container_id(&p, container))
                .map_or(f64::NAN, |b| b as f64 / 1048576.0)
        };
        println!(
            "  {:<14} {:6.1} | {:6.1}",
            p["metadata"]["name"].as_str().unwrap_or("?"),
            rss("proxy"),
            rss("sbmesh-sidecar")
        );
    }

    // Config edits: the body of one origin, changed each time.
    let mut rows = Vec::new();
    let mut current = manifest;
    for i in 1..=edits {
        let body = format!("edit {i}");
        let next = current.replacen(
            &format!(
                "body: \"{}\\n\"",
                if i == 1 {
                    NAMES[0].to_string()
                } else {
                    format!("edit {}", i - 1)
                }
            ),
            &format!("body: \"{body}\\n\""),
            1,
        );
        assert_ne!(next, current, "edit {i} changed nothing");
        let pods = ns.ready_pods("demo", 3);
        let applied = unix_ms();
        c.apply(&next);
        let mut served_at = vec![None; pods.len()];
        let deadline = Instant::now() + Duration::from_secs(300);
        while served_at.iter().any(Option::is_none) {
            assert!(
                Instant::now() < deadline,
                "edit {i} not served within 300 s"
            );
            for (k, p) in pods.iter().enumerate() {
                if served_at[k].is_none() {
                    let url = format!("http://{}:8080/", pod_ip(p));
                    if curl(&["-H", &format!("Host: {}", NAMES[0]), &url])
                        .is_ok_and(|(code, got)| code == 200 && got == format!("{body}\n"))
                    {
                        served_at[k] = Some(unix_ms());
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for (k, p) in pods.iter().enumerate() {
            let uid = p["metadata"]["uid"].as_str().unwrap_or_default();
            let swapped = swapped_at_ms(uid).unwrap_or(f64::NAN);
            let status = sidecar_status(&pod_ip(p), Some(("admin", "secret")));
            let local = status.as_ref().and_then(|s| {
                s["nodes"]
                    .as_array()?
                    .iter()
                    .find(|n| n["local"] == true)
                    .cloned()
            });
            let posted = local
                .as_ref()
                .and_then(|n| n["last_reload"]["at_unix_ms"].as_f64())
                .unwrap_or_else(|| {
                    eprintln!("no reload delivered in the status: {local:?}");
                    f64::NAN
                });
            let served = served_at[k].unwrap_or(f64::NAN);
            rows.push((swapped - applied, posted - swapped, served - applied));
        }
        current = next;
    }
    println!(
        "\nconfig edit, per pod (ms): kubelet propagation | sidecar: swap -> reload delivered | apply -> proxy serves it"
    );
    for (kubelet, sidecar, total) in &rows {
        println!("  {kubelet:9.0} | {sidecar:6.0} | {total:9.0}");
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "median: kubelet {:.0} ms, sidecar {:.0} ms, total {:.0} ms (n = {})",
        median(rows.iter().map(|r| r.0).collect()),
        median(rows.iter().map(|r| r.1).collect()),
        median(rows.iter().map(|r| r.2).collect()),
        rows.len()
    );

    // A new certificate (one more name in the `san` set) -> every proxy
    // serves it, by `apply: restart`, one pod at a time.
    let name = "d.bench.test";
    add_a(&c, name, &ip);
    let origin = format!(
        "    origins:\n      \"{name}\":\n        action: {{ type: static, status_code: 200, body: \"{name}\\n\" }}\n"
    );
    let next = current.replacen("    origins:\n", &origin, 1);
    assert_ne!(next, current, "no origins line to add {name} under");
    let applied = Instant::now();
    c.apply(&next);
    let pods = ns.ready_pods("demo", 3);
    let issued = wait_for(
        &format!("a certificate for {name} in a sidecar's status"),
        Duration::from_secs(300),
        || {
            pods.iter()
                .any(|p| {
                    sidecar_status(&pod_ip(p), Some(("admin", "secret"))).is_some_and(|s| {
                        s["nodes"].as_array().into_iter().flatten().any(|n| {
                            n["certificates"]
                                .as_array()
                                .into_iter()
                                .flatten()
                                .any(|cert| {
                                    cert["placeholder"] != true
                                        && cert["names"]
                                            .as_array()
                                            .is_some_and(|ns| ns.iter().any(|x| x == name))
                                })
                        })
                    })
                })
                .then(Instant::now)
        },
    );
    let issued_ms = unix_ms() - issued.elapsed().as_secs_f64() * 1000.0;
    // At most one restart per pod per --proxy-restart-interval-secs (600 s):
    // the first certificate's restarts above hold this one back.
    wait_for(
        &format!("every proxy serving {name}"),
        Duration::from_secs(900),
        || {
            let pods = ns.proxy_pods("demo");
            (pods.len() == 3
                && pods
                    .iter()
                    .all(|p| serves_tls(&root, name, &pod_ip(p), 8443)))
            .then_some(())
        },
    );
    let served = Instant::now();
    let restarts: Vec<i64> = ns
        .proxy_pods("demo")
        .iter()
        .map(|p| {
            cluster::restarts(p)
                .into_iter()
                .find(|(n, _)| n == "proxy")
                .map_or(-1, |(_, r)| r)
        })
        .collect();
    // When each pod's sidecar signalled its proxy, after the issuance.
    let signalled: Vec<String> = ns
        .proxy_pods("demo")
        .iter()
        .map(|p| {
            sidecar_status(&pod_ip(p), Some(("admin", "secret")))
                .and_then(|s| {
                    s["nodes"]
                        .as_array()?
                        .iter()
                        .find(|n| n["local"] == true)?["proxy"]["last_restart_unix_ms"]
                        .as_f64()
                })
                .map_or("?".into(), |at| {
                    format!("{:.1} s", (at - issued_ms) / 1000.0)
                })
        })
        .collect();
    println!(
        "\nnew certificate ({name} added): apply -> issued {:.1} s, issued -> every proxy serves it {:.1} s; each proxy signalled at issued + {signalled:?}; proxy restarts per pod: {restarts:?}",
        (issued - applied).as_secs_f64(),
        (served - issued).as_secs_f64()
    );
}
