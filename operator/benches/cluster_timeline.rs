//! The mission's timeline on the real cluster (BENCHMARKS.md, "On a real
//! Kubernetes"):
//!
//! 1. `kubectl apply` of a clustered SBProxy with the sidecar's ACME (3
//!    replicas, one `san` certificate for 3 names from Pebble) -> all pods
//!    Ready -> mesh formed -> every proxy serves the CA's certificate (also
//!    after the last pod's first Ready), and the validations Pebble failed;
//!    `SBMESH_BENCH_DEPLOYS` (default 1) such deploys, each in a fresh
//!    namespace, the last one kept for the steps below;
//! 2. `SBMESH_BENCH_EDITS` (default 3) SBProxyConfig edits -> every proxy
//!    answers them, split into the kubelet's part (apply -> the `..data`
//!    swap in the pod's volume) and the sidecar's (swap -> reload POST
//!    delivered), each proxy sampled every 100 ms: an answer older than one
//!    it gave before counts as a regression;
//! 3. `SBMESH_BENCH_ANCHOR_EDITS` (default 3) edits the anchors' way: the
//!    operator stopped, the ConfigMap written directly, so only the
//!    kubelet's periodic sync carries them (what configmap-reload and
//!    prometheus-config-reloader users wait for);
//! 4. scale 3 -> 5 -> the new pods serve the certificate (no new order);
//! 5. with short-lived certificates from Pebble (the cluster started with
//!    `SBMESH_CLUSTER_CERT_VALIDITY_SECS`, under 30 minutes): the
//!    certificate renewed -> every sidecar wrote it -> every proxy serves
//!    it, for `apply: restart` (the fleet above) and `apply: reload` (a
//!    second fleet deployed beside it, its own names and store), side by
//!    side; 1000 s puts the renewal (a third of the lifetime before
//!    notAfter) past the 10-minute restart interval of the first
//!    certificate's restart;
//! 6. one more name in the `san` set -> issued -> every proxy serves it
//!    (`SBMESH_BENCH_NEW_NAME=0` leaves it out: with `apply: restart` it
//!    waits out the 10-minute restart interval).
//!
//! Needs the cluster and the cluster-scope operator:
//!
//! ```text
//! SBMESH_CLUSTER_CERT_VALIDITY_SECS=1000 scripts/cluster up
//! scripts/cluster images      # release images, as the Dockerfile builds them
//! eval "$(scripts/cluster env)" && export SBMESH_TEST_KUBECONFIG=$KUBECONFIG
//! target/debug/sbmesh-operator install --rbac-scope cluster | kubectl apply -f -
//! cargo bench --profile dev -p sbmesh-operator --bench cluster_timeline
//! ```

#[path = "../tests/cluster/mod.rs"]
mod cluster;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cluster::{
    ADMIN, Cluster, Namespace, acme_manifest, add_a, curl, invalid_authorizations, issued,
    pebble_root, pod_ip, served_serial, serves_tls, sidecar_status, wait_every, wait_for,
};
use serde_json::Value;

const NAMES: [&str; 3] = ["a.bench.test", "b.bench.test", "c.bench.test"];

/// One SBProxy `demo` of the bench: its names, its Redis database, and how
/// its sidecars apply a new certificate.
struct Fleet {
    names: &'static [&'static str],
    db: u8,
    apply: &'static str,
}

/// The fleet every step runs on.
const MAIN: Fleet = Fleet {
    names: &NAMES,
    db: 2,
    apply: "restart",
};

/// The second fleet of the renewal step, beside the first: names of its
/// own (Pebble's DNS points each name at one Service).
const RELOAD: Fleet = Fleet {
    names: &[
        "a.reload.bench.test",
        "b.reload.bench.test",
        "c.reload.bench.test",
    ],
    db: 3,
    apply: "reload",
};

/// Certificates living less than this are renewed within a run.
const SHORT_LIVED: Duration = Duration::from_secs(1800);

fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}

fn env_count(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
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

fn name_of(pod: &Value) -> String {
    pod["metadata"]["name"].as_str().unwrap_or("?").to_string()
}

fn main() {
    let Some(c) = Cluster::from_env() else {
        eprintln!(
            "cluster_timeline: no cluster; see the header of operator/benches/cluster_timeline.rs"
        );
        return;
    };
    let edits = env_count("SBMESH_BENCH_EDITS", 3);
    let anchor = env_count("SBMESH_BENCH_ANCHOR_EDITS", 3);
    c.operator();

    // Fresh deploys before the one the rest runs on: each from nothing to
    // every proxy serving the CA's certificate.
    let deploys = env_count("SBMESH_BENCH_DEPLOYS", 1).max(1);
    let invalid_before = invalid_authorizations(&c);
    let mut after_ready = Vec::new();
    for _ in 1..deploys {
        // One name: each deploy waits until the one before is gone (its
        // pods would otherwise still write to the same store).
        let ns = Namespace::new(&c, "bench-deploy", &[]);
        let (_, served_after_ready) = deploy(&c, &ns, &MAIN);
        after_ready.push(served_after_ready);
    }
    let _ = c.kubectl(&[
        "delete",
        "namespace",
        "bench-deploy",
        "--ignore-not-found",
        "--wait=true",
        "--timeout=120s",
    ]);
    let ns = Namespace::new(&c, "bench-timeline", &[]);
    let (manifest, served_after_ready) = deploy(&c, &ns, &MAIN);
    after_ready.push(served_after_ready);
    if deploys > 1 {
        after_ready.sort_by(f64::total_cmp);
        println!(
            "\n{deploys} fresh deploys: every proxy serves the certificate the last pod's first Ready + p50 {:.1} s, max {:.1} s; validations the CA failed over all of them: {}",
            after_ready[after_ready.len() / 2],
            after_ready[after_ready.len() - 1],
            invalid_authorizations(&c) - invalid_before
        );
    }
    let ip = ns.cluster_ip("demo-svc");
    let root = pebble_root(&c);
    rss(&c, &ns);
    let lifetime = expires_in(&ns);
    let reload = (lifetime < SHORT_LIVED).then(|| {
        println!("\nthe second fleet, apply: reload, for the renewal step");
        let reload = Namespace::new(&c, "bench-reload", &[]);
        deploy(&c, &reload, &RELOAD);
        reload
    });

    let mut current = manifest;
    let mut body = NAMES[0].to_string();
    let rows = config_edits(&c, &ns, edits, &mut current, &mut body);
    report_edits("the operator's nudge", &rows);
    let rows = anchor_edits(&c, &ns, anchor, &mut body);
    report_edits("the anchors' way: kubelet only", &rows);
    scale_up(&c, &ns, &root);
    match &reload {
        Some(reload) => std::thread::scope(|s| {
            s.spawn(|| renewal(&ns, &MAIN, Duration::from_secs(300)));
            s.spawn(|| renewal(reload, &RELOAD, Duration::from_secs(60)));
        }),
        None => println!(
            "\nrenewal: skipped, the certificate expires in {} s; start the cluster with SBMESH_CLUSTER_CERT_VALIDITY_SECS=1000 for it",
            lifetime.as_secs()
        ),
    }
    if env_count("SBMESH_BENCH_NEW_NAME", 1) > 0 {
        new_name(&c, &ns, &root, &ip, current);
    }
}

/// One fresh deploy in `ns`, from `kubectl apply` to every proxy serving
/// the CA's certificate, printed; the manifest and how long after the last
/// pod's first Ready every proxy served the certificate (s).
fn deploy(c: &Cluster, ns: &Namespace, fleet: &Fleet) -> (String, f64) {
    let invalid_before = invalid_authorizations(c);
    let issued_before = issued(c);
    let t0 = Instant::now();
    let manifest = acme_manifest(c, &ns.name, fleet.names, fleet.db);
    let manifest = manifest.replacen("apply: restart", &format!("apply: {}", fleet.apply), 1);
    assert!(
        manifest.contains(&format!("apply: {}", fleet.apply)),
        "acme_manifest has no apply line"
    );
    c.apply(&manifest);
    let ip = ns.wait_cluster_ip("demo-svc");
    for name in fleet.names {
        add_a(c, name, &ip);
    }
    let root = pebble_root(c);
    // When each pod was first seen Ready (the API every 200 ms).
    let first_ready = Mutex::new(BTreeMap::<String, Duration>::new());
    let sampling = AtomicBool::new(true);
    let (ready, mesh, served) = std::thread::scope(|s| {
        s.spawn(|| {
            while sampling.load(Ordering::Relaxed) {
                for p in ns.proxy_pods("demo") {
                    if cluster::pod_ready(&p) {
                        let mut seen = first_ready.lock().unwrap();
                        seen.entry(name_of(&p)).or_insert(t0.elapsed());
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        // The sampler stops even when a wait below panics: the scope would
        // otherwise wait for it forever.
        struct Stop<'a>(&'a AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Relaxed);
            }
        }
        let _stop = Stop(&sampling);
        first_certificate(ns, &root, t0, fleet)
    });
    let first_ready = first_ready.into_inner().unwrap();
    let last_ready = first_ready.values().max().copied().unwrap_or_default();
    println!(
        "apply -> 3 pods Ready at once  {:6.1} s; each pod's first Ready: {}",
        ready.as_secs_f64(),
        first_ready
            .iter()
            .map(|(p, t)| format!("{p} {:.1} s", t.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "apply -> mesh formed           {:6.1} s",
        mesh.as_secs_f64()
    );
    let what = if fleet.apply == "reload" {
        "every sidecar wrote it"
    } else {
        "every proxy serves it"
    };
    println!(
        "apply -> {what} {:6.1} s = the last pod's first Ready + {:.1} s",
        served.as_secs_f64(),
        (served.saturating_sub(last_ready)).as_secs_f64()
    );
    println!(
        "certificates issued: {}; validations the CA failed: {}",
        issued(c) - issued_before,
        invalid_authorizations(c) - invalid_before
    );
    (manifest, served.saturating_sub(last_ready).as_secs_f64())
}

/// apply -> 3 pods Ready -> mesh formed -> every proxy serving the CA's
/// certificate, each from `t0`.
///
/// With `apply: reload`, every sidecar writing it instead: sbproxy 1.13
/// reads its certificate file only at start-up, so a proxy that started on
/// the placeholder keeps serving that (counted and printed).
fn first_certificate(
    ns: &Namespace,
    root: &str,
    t0: Instant,
    fleet: &Fleet,
) -> (Duration, Duration, Duration) {
    let names = fleet.names;
    let pods = ns.ready_pods("demo", 3);
    let ready = t0.elapsed();
    wait_for("the mesh formed", Duration::from_secs(120), || {
        pods.iter()
            .all(|p| {
                sidecar_status(&pod_ip(p), ADMIN)
                    .is_some_and(|s| s["summary"]["healthy_nodes"] == 3)
            })
            .then_some(())
    });
    let mesh = t0.elapsed();
    if fleet.apply == "reload" {
        wait_for(
            "every sidecar writing Pebble's certificate",
            Duration::from_secs(300),
            || pods.iter().all(|p| !written(p).is_empty()).then_some(()),
        );
        let written = t0.elapsed();
        let serving = pods
            .iter()
            .filter(|p| names.iter().all(|n| serves_tls(root, n, &pod_ip(p), 8443)))
            .count();
        println!(
            "apply: reload, every sidecar wrote the certificate; proxies serving it: {serving} of {}",
            pods.len()
        );
        return (ready, mesh, written);
    }
    wait_for(
        "every proxy serving Pebble's certificate",
        Duration::from_secs(300),
        || {
            let pods = ns.proxy_pods("demo");
            (pods.len() == 3
                && pods.iter().all(|p| {
                    cluster::pod_ready(p)
                        && names.iter().all(|n| serves_tls(root, n, &pod_ip(p), 8443))
                }))
            .then_some(())
        },
    );
    (ready, mesh, t0.elapsed())
}

/// Resident memory of the two processes of each pod, side by side.
fn rss(c: &Cluster, ns: &Namespace) {
    println!("\nRSS per pod (MiB): proxy | sidecar");
    for p in ns.proxy_pods("demo") {
        let rss = |container: &str| {
            cluster::container_rss(c, &cluster::container_id(&p, container))
                .map_or(f64::NAN, |b| b as f64 / 1048576.0)
        };
        println!(
            "  {:<14} {:6.1} | {:6.1}",
            name_of(&p),
            rss("proxy"),
            rss("sbmesh-sidecar")
        );
    }
}

/// One edit's figures for one pod, ms from the write: the kubelet's swap,
/// the sidecar's reload after it, the proxy answering.
struct Row {
    kubelet: f64,
    sidecar: f64,
    total: f64,
}

/// The body of NAMES[0]'s origin in the manifest, `"<body>\n"`.
fn origin_body(body: &str) -> String {
    format!("body: \"{body}\\n\"")
}

/// Applies `edit` (which writes the new config somewhere) and samples every
/// pod every 100 ms until each answers `body`; `versions` holds the last
/// edit number each pod answered, and an older answer after it is counted
/// in `regressions`.
fn timed_edit(
    ns: &Namespace,
    number: usize,
    body: &str,
    versions: &mut BTreeMap<String, usize>,
    regressions: &mut usize,
    edit: impl FnOnce(),
) -> Vec<Row> {
    let pods = ns.ready_pods("demo", 3);
    let applied = unix_ms();
    edit();
    let mut served_at = vec![None; pods.len()];
    let deadline = Instant::now() + Duration::from_secs(300);
    while served_at.iter().any(Option::is_none) {
        assert!(
            Instant::now() < deadline,
            "edit {number} not served within 300 s"
        );
        for (k, p) in pods.iter().enumerate() {
            let url = format!("http://{}:8080/", pod_ip(p));
            let Ok((200, got)) = curl(&["-H", &format!("Host: {}", NAMES[0]), &url]) else {
                continue;
            };
            // "edit N\n" as JSON, or the first config's body.
            let answered = got
                .trim_matches('"')
                .strip_prefix("edit ")
                .and_then(|rest| rest.trim_end_matches("\\n").parse::<usize>().ok())
                .unwrap_or(0);
            let last = versions.entry(name_of(p)).or_insert(0);
            if answered < *last {
                *regressions += 1;
                eprintln!("{} answered edit {answered} after edit {last}", name_of(p));
            }
            *last = answered.max(*last);
            if served_at[k].is_none() && got.contains(body) {
                served_at[k] = Some(unix_ms());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    pods.iter()
        .enumerate()
        .map(|(k, p)| {
            let uid = p["metadata"]["uid"].as_str().unwrap_or_default();
            let swapped = swapped_at_ms(uid).unwrap_or(f64::NAN);
            let posted = sidecar_status(&pod_ip(p), ADMIN)
                .and_then(|s| {
                    s["nodes"]
                        .as_array()?
                        .iter()
                        .find(|n| n["local"] == true)?["last_reload"]["at_unix_ms"]
                        .as_f64()
                })
                .unwrap_or(f64::NAN);
            Row {
                kubelet: swapped - applied,
                sidecar: posted - swapped,
                total: served_at[k].unwrap_or(f64::NAN) - applied,
            }
        })
        .collect()
}

/// `n` edits of the body of one origin, `edit <i>` (counting on from
/// `body`'s number), each written by `write(old, new)` (the body lines of
/// the YAML) and timed; what is printed under `what`: older configs served
/// after newer ones, and container restarts.
fn edits(
    ns: &Namespace,
    n: usize,
    body: &mut String,
    what: &str,
    mut write: impl FnMut(&str, &str),
) -> Vec<Row> {
    let mut rows = Vec::new();
    let mut versions = BTreeMap::new();
    let mut regressions = 0;
    let restarts_before = restarts(ns);
    let first: usize = body
        .strip_prefix("edit ")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    for i in first + 1..=first + n {
        let next_body = format!("edit {i}");
        let (old, new) = (origin_body(body), origin_body(&next_body));
        rows.extend(timed_edit(
            ns,
            i,
            &next_body,
            &mut versions,
            &mut regressions,
            || write(&old, &new),
        ));
        *body = next_body;
    }
    println!(
        "\n{what}: {n} edits; an older config served after a newer one: {regressions} times; container restarts: {}",
        restarts(ns) - restarts_before
    );
    rows
}

/// `n` SBProxyConfig edits through the operator (`current`, the manifest,
/// follows them).
fn config_edits(
    c: &Cluster,
    ns: &Namespace,
    n: usize,
    current: &mut String,
    body: &mut String,
) -> Vec<Row> {
    edits(
        ns,
        n,
        body,
        "config edits through the operator",
        |old, new| {
            let next = current.replacen(old, new, 1);
            assert_ne!(&next, current, "the edit changed nothing");
            c.apply(&next);
            *current = next;
        },
    )
}

/// `n` edits the anchors' way: the operator stopped, the ConfigMap
/// written directly; only the kubelet's periodic sync carries them. The
/// operator is started again at the end (it writes the SBProxyConfig's
/// content back, which the proxies then reload).
fn anchor_edits(c: &Cluster, ns: &Namespace, n: usize, body: &mut String) -> Vec<Row> {
    if n == 0 {
        return Vec::new();
    }
    let _stopped = c.operator_stopped();
    edits(ns, n, body, "the anchors' way", |old, new| {
        let mut cm = ns
            .get(&["configmap", "demo-config"])
            .expect("the ConfigMap");
        let text = cm["data"]["sb.yml"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let next = text.replacen(old, new, 1);
        assert_ne!(next, text, "the anchor edit changed nothing");
        cm["data"]["sb.yml"] = next.into();
        cm["metadata"]
            .as_object_mut()
            .map(|m| m.remove("resourceVersion"));
        c.kubectl_with(&["apply", "-f", "-"], Some(&cm.to_string()))
            .expect("the ConfigMap written");
    })
}

fn report_edits(what: &str, rows: &[Row]) {
    if rows.is_empty() {
        return;
    }
    println!(
        "config edit, {what}, per pod (ms): kubelet propagation | sidecar: swap -> reload delivered | apply -> proxy serves it"
    );
    for r in rows {
        println!("  {:9.0} | {:6.0} | {:9.0}", r.kubelet, r.sidecar, r.total);
    }
    let quantiles = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[v.len() - 1])
    };
    let (k50, kmax) = quantiles(rows.iter().map(|r| r.kubelet).collect());
    let (s50, smax) = quantiles(rows.iter().map(|r| r.sidecar).collect());
    let (t50, tmax) = quantiles(rows.iter().map(|r| r.total).collect());
    println!(
        "{what}: p50 / max (ms): kubelet {k50:.0} / {kmax:.0}, sidecar {s50:.0} / {smax:.0}, apply -> proxy serves it {t50:.0} / {tmax:.0} (n = {})",
        rows.len()
    );
}

/// Container restarts of the SBProxy's pods, summed.
fn restarts(ns: &Namespace) -> i64 {
    ns.proxy_pods("demo")
        .iter()
        .flat_map(cluster::restarts)
        .map(|(_, r)| r)
        .sum()
}

/// Scale 3 -> 5: the new pods Ready and serving the certificate, without a
/// new order.
fn scale_up(c: &Cluster, ns: &Namespace, root: &str) {
    let issued_before = issued(c);
    let start = Instant::now();
    c.kubectl(&[
        "-n",
        &ns.name,
        "patch",
        "sbproxy",
        "demo",
        "--type=merge",
        "-p",
        r#"{"spec":{"replicas":5}}"#,
    ])
    .expect("scaled to 5");
    let pods = ns.ready_pods("demo", 5);
    let ready = start.elapsed();
    wait_for(
        "the 5 proxies serving the certificate",
        Duration::from_secs(300),
        || {
            pods.iter()
                .all(|p| NAMES.iter().all(|n| serves_tls(root, n, &pod_ip(p), 8443)))
                .then_some(())
        },
    );
    let served = start.elapsed();
    let new_pod_restarts: Vec<String> = ns
        .proxy_pods("demo")
        .iter()
        .filter(|p| matches!(name_of(p).as_str(), "demo-proxy-3" | "demo-proxy-4"))
        .map(|p| {
            let proxy = cluster::restarts(p)
                .into_iter()
                .find(|(n, _)| n == "proxy")
                .map_or(-1, |(_, r)| r);
            format!("{} {proxy}", name_of(p))
        })
        .collect();
    println!(
        "\nscale 3 -> 5: 5 pods Ready {:.1} s, every proxy serves the certificate {:.1} s; orders placed: {}; proxy restarts of the new pods: {}",
        ready.as_secs_f64(),
        served.as_secs_f64(),
        issued(c) - issued_before,
        new_pod_restarts.join(", ")
    );
}

/// A new certificate (one more name in the `san` set) -> every proxy
/// serves it, by `apply: restart`, one pod at a time.
fn new_name(c: &Cluster, ns: &Namespace, root: &str, ip: &str, current: String) {
    let name = "d.bench.test";
    add_a(c, name, ip);
    let origin = format!(
        "    origins:\n      \"{name}\":\n        action: {{ type: static, status_code: 200, body: \"{name}\\n\" }}\n"
    );
    let next = current.replacen("    origins:\n", &origin, 1);
    assert_ne!(next, current, "no origins line to add {name} under");
    let applied = Instant::now();
    c.apply(&next);
    let pods = ns.proxy_pods("demo");
    let issued = wait_for(
        &format!("a certificate for {name} in a sidecar's status"),
        Duration::from_secs(300),
        || {
            pods.iter()
                .any(|p| {
                    sidecar_status(&pod_ip(p), ADMIN).is_some_and(|s| {
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
    // At most one restart per pod per --proxy-restart-interval-secs (600 s):
    // the first certificate's restarts hold this one back.
    wait_for(
        &format!("every proxy serving {name}"),
        Duration::from_secs(900),
        || {
            let pods = ns.proxy_pods("demo");
            pods.iter()
                .all(|p| serves_tls(root, name, &pod_ip(p), 8443))
                .then_some(())
        },
    );
    let served = Instant::now();
    println!(
        "\nnew certificate ({name} added): apply -> issued {:.1} s, issued -> every proxy serves it {:.1} s",
        (issued - applied).as_secs_f64(),
        (served - issued).as_secs_f64()
    );
}

/// The certificates a pod's sidecar reports for its own node: (serial
/// without leading zeros, notAfter) of each one the CA issued.
fn written(pod: &Value) -> Vec<(String, u64)> {
    cluster::local_certificates(&pod_ip(pod))
        .iter()
        .map(|c| {
            (
                cluster::serial_of(c),
                c["not_after_unix"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// How long until the first pod's certificate expires.
fn expires_in(ns: &Namespace) -> Duration {
    let pods = ns.proxy_pods("demo");
    let not_after = pods
        .first()
        .and_then(|p| written(p).first().map(|(_, t)| *t))
        .expect("a written certificate");
    Duration::from_secs(not_after.saturating_sub(unix_ms() as u64 / 1000))
}

/// The certificate renewed -> every sidecar wrote it -> every proxy serves
/// it (each pod's TLS port sampled every 200 ms, for at most
/// `served_limit` after the last write), with the proxy restarts it took.
fn renewal(ns: &Namespace, fleet: &Fleet, served_limit: Duration) {
    let pods = ns.proxy_pods("demo");
    let name = fleet.names[0];
    let (old, _) = written(&pods[0])
        .into_iter()
        .next()
        .expect("a written certificate");
    let restarts_before = restarts(ns);
    let due = expires_in(ns);
    let (new, issued) = wait_every(
        &format!("the renewed certificate of {}", ns.name),
        due + Duration::from_secs(120),
        Duration::from_millis(200),
        || {
            pods.iter()
                .flat_map(written)
                .find(|(serial, _)| *serial != old)
                .map(|(serial, _)| (serial, Instant::now()))
        },
    );
    let all_written = wait_every(
        &format!(
            "every sidecar of {} writing the renewed certificate",
            ns.name
        ),
        Duration::from_secs(60),
        Duration::from_millis(200),
        || {
            pods.iter()
                .all(|p| written(p).iter().any(|(s, _)| *s == new))
                .then(Instant::now)
        },
    );
    let mut serving = 0;
    let mut served = None;
    while all_written.elapsed() < served_limit {
        let pods = ns.proxy_pods("demo");
        serving = pods
            .iter()
            .filter(|p| served_serial(name, &pod_ip(p), 8443).as_deref() == Some(new.as_str()))
            .count();
        if serving == pods.len() {
            served = Some(Instant::now());
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let served = match served {
        Some(t) => format!("every proxy serves it {:.1} s", (t - issued).as_secs_f64()),
        None => format!(
            "{serving} of {} proxies serve it {} s after the last write",
            pods.len(),
            served_limit.as_secs()
        ),
    };
    println!(
        "\nrenewal, apply: {}: issued -> every sidecar wrote it {:.1} s, {served}; proxy restarts: {}",
        fleet.apply,
        (all_written - issued).as_secs_f64(),
        restarts(ns) - restarts_before
    );
}
