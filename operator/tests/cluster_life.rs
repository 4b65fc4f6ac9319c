//! A fleet's life on the real cluster: the events an operator of a fleet
//! lives through, made by Kubernetes itself (the StatefulSet controller
//! replacing pods, the kubelet swapping a Secret volume, the eviction API
//! honouring the PodDisruptionBudget, the operator's watches against a
//! user's edits). Each scenario runs on a 3-replica clustered SBProxy with
//! the sidecar's ACME ([`Fleet`]: Redis, Pebble through the Service) and
//! checks what a user would: the mesh formed, the certificate served by
//! every proxy, no new order at the CA, no pod restarted that the scenario
//! did not restart.
//!
//! Each prints how long the fleet took to be whole again ("whole again
//! after"), the figures BENCHMARKS.md reports.

mod cluster;

use std::collections::BTreeSet;
use std::time::Duration;

use cluster::{
    ADMIN, Cluster, Fleet, Namespace, Sampler, metric, pod_ip, ready_ips, sidecar_status,
    wait_every, wait_for,
};
use serde_json::Value;

/// A member as one sidecar's status lists it.
#[derive(Debug, PartialEq)]
struct Member {
    state: String,
    address: String,
    incarnation: u64,
}

impl std::fmt::Display for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} #{}", self.state, self.address, self.incarnation)
    }
}

/// Samples, every 250 ms, how many of the fleet's pods are Ready (and not
/// being deleted), and the fewest members any of those pods' sidecars
/// counts (`total_nodes`).
fn availability(c: &Cluster, ns: &str) -> Sampler<(usize, usize)> {
    let c = c.clone();
    let ns = ns.to_string();
    Sampler::start(Duration::from_millis(250), move || {
        let ips = ready_ips(&c, &ns);
        let fewest = ips
            .iter()
            .filter_map(|ip| sidecar_status(ip, ADMIN))
            .filter_map(|s| s["summary"]["total_nodes"].as_u64())
            .min()
            .unwrap_or(0);
        (ips.len(), fewest as usize)
    })
}

/// Asserts that at every sample at least `n` pods were Ready and every
/// Ready pod's sidecar counted at least `n` members.
fn never_below(what: &str, samples: &[(Duration, (usize, usize))], n: usize) {
    assert!(samples.len() > 10, "{what}: only {} samples", samples.len());
    let low: Vec<String> = samples
        .iter()
        .filter(|(_, (ready, fewest))| *ready < n || *fewest < n)
        .map(|(t, (ready, fewest))| {
            format!(
                "{:.2} s: {ready} Ready, fewest members {fewest}",
                t.as_secs_f64()
            )
        })
        .collect();
    assert!(
        low.is_empty(),
        "{what}: fewer than {n} Ready pods or mesh members at {} of {} samples:\n{}",
        low.len(),
        samples.len(),
        low.join("\n")
    );
    let least = samples.iter().map(|(_, (r, _))| *r).min().unwrap_or(0);
    eprintln!(
        "{what}: {} samples, fewest Ready pods {least}",
        samples.len()
    );
}

/// Scale 3 → 5 → 2 → 3 through `spec.replicas`: after each step the mesh
/// has exactly the replicas (every sidecar's `total_nodes`), the pods that
/// stayed were neither replaced nor restarted, and the new pods serve the
/// certificate from the store: no new order at the CA.
#[test]
fn scaling_3_5_2_3_the_mesh_follows_and_nothing_restarts_or_orders() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let fleet = Fleet::deploy(&c, "life-scale", 4, |m| m);
    let mut before = fleet.identities();
    for n in [5usize, 2, 3] {
        fleet.patch(&format!(r#"{{"spec":{{"replicas":{n}}}}}"#));
        let (pods, took) = fleet.whole(n);
        eprintln!(
            "scale to {n}: whole again after {:.1} s",
            took.as_secs_f64()
        );
        let now = cluster::identities(&pods);
        for (name, identity) in &now {
            if let Some(old) = before.get(name) {
                assert_eq!(
                    identity, old,
                    "scale to {n}: {name} was replaced or restarted"
                );
            }
        }
        before = now;
    }
    assert_eq!(fleet.new_validations(&c), 0, "orders placed at the CA");
}

/// `kubectl delete pod demo-proxy-1`, then the same with `--grace-period=0
/// --force`: the StatefulSet brings the pod back under its name, it rejoins
/// under its node id (listed once), the other sidecars saw it go and come
/// back, the others were not restarted, and no order was placed.
#[test]
fn a_deleted_pod_comes_back_under_its_name_and_rejoins() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let fleet = Fleet::deploy(&c, "life-delete", 5, |m| m);
    let ns = fleet.ns.name.clone();
    for force in [false, true] {
        let before = fleet.identities();
        let uid = before["demo-proxy-1"].0.clone();
        // What demo-proxy-0's sidecar says of demo-proxy-1.
        let watcher = pod_ip(&fleet.ns.proxy_pods("demo")[0]);
        let seen = Sampler::start(Duration::from_millis(200), move || {
            sidecar_status(&watcher, ADMIN).map(|s| {
                s["nodes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|n| n["node_id"] == "demo-proxy-1")
                    .map(|n| Member {
                        state: n["membership_state"].as_str().unwrap_or("").to_string(),
                        address: n["address"].as_str().unwrap_or("").to_string(),
                        incarnation: n["incarnation"].as_u64().unwrap_or(0),
                    })
                    .collect::<Vec<_>>()
            })
        });
        let mut args = vec!["delete", "pod", "demo-proxy-1", "--wait=false"];
        if force {
            args.extend(["--grace-period=0", "--force"]);
        }
        fleet
            .ns
            .kubectl(&args)
            .unwrap_or_else(|e| panic!("kubectl -n {ns} {}: {e}", args.join(" ")));
        wait_for("demo-proxy-1 replaced", Duration::from_secs(120), || {
            let p = fleet.ns.get(&["pod", "demo-proxy-1"])?;
            (p["metadata"]["uid"] != uid.as_str()).then_some(())
        });
        let (pods, took) = fleet.whole(3);
        let what = if force { "force-deleted" } else { "deleted" };
        eprintln!("pod {what}: whole again after {:.1} s", took.as_secs_f64());
        let views: Vec<Vec<Member>> = seen.finish().into_iter().filter_map(|(_, v)| v).collect();
        let mut changes: Vec<String> = views
            .iter()
            .map(|v| {
                v.iter()
                    .map(Member::to_string)
                    .collect::<Vec<_>>()
                    .join(" + ")
            })
            .collect();
        changes.dedup();
        eprintln!("{what}: demo-proxy-0's view of demo-proxy-1: {changes:?}");
        let (first, last) = match (views.first(), views.last()) {
            (Some(f), Some(l)) if f.len() == 1 && l.len() == 1 => (&f[0], &l[0]),
            _ => panic!("{what}: demo-proxy-1 listed once at the start and the end: {changes:?}"),
        };
        let new_ip = pod_ip(&pods[1]);
        assert!(
            last.state == "alive"
                && last.address.starts_with(&format!("{new_ip}:"))
                && last.incarnation > first.incarnation,
            "{what}: demo-proxy-1 rejoined under its node id, alive at the new pod's \
             address {new_ip} with a higher incarnation: {changes:?}"
        );
        // A pod deleted with its grace leaves the mesh (SIGTERM); one
        // force-deleted may be replaced before the others' failure
        // detection notices (the new one's higher incarnation wins).
        if !force {
            assert!(
                views.iter().flatten().any(|m| m.state == "down"),
                "{what}: demo-proxy-0 never saw demo-proxy-1 leave: {changes:?}"
            );
        }
        let after = fleet.identities();
        for name in ["demo-proxy-0", "demo-proxy-2"] {
            assert_eq!(after[name], before[name], "{what}: {name} was disturbed");
        }
    }
    assert_eq!(fleet.new_validations(&c), 0, "orders placed at the CA");
}

/// `kubectl rollout restart`, then a new sidecar image tag in
/// `spec.sidecar.image`: the StatefulSet replaces one pod at a time
/// (OrderedReady): a sampler shows at least two pods Ready and every Ready
/// sidecar in a mesh of at least two at every moment; the fleet is whole
/// after each step, with the same certificate and no new order.
#[test]
fn a_rolling_restart_and_a_new_sidecar_image_keep_two_pods_serving() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let fleet = Fleet::deploy(&c, "life-roll", 6, |m| m);
    let ns = fleet.ns.name.clone();

    let before = fleet.identities();
    let sampler = availability(&c, &ns);
    fleet
        .ns
        .kubectl(&["rollout", "restart", "statefulset/demo-proxy"])
        .expect("kubectl rollout restart");
    replaced(&fleet, &before, "the rollout");
    let (_, took) = fleet.whole(3);
    eprintln!(
        "rollout restart: whole again {:.1} s after the last pod was replaced",
        took.as_secs_f64()
    );
    never_below("rollout restart", &sampler.finish(), 2);

    // The same image under a new tag: what an upgrade's manifest change is
    // to the StatefulSet.
    let sts = fleet
        .ns
        .get(&["statefulset", "demo-proxy"])
        .expect("StatefulSet");
    let image = sts["spec"]["template"]["spec"]["initContainers"][0]["image"]
        .as_str()
        .expect("the sidecar's image")
        .to_string();
    let (repo, _) = image.rsplit_once(':').expect("an image with a tag");
    let tagged = format!("{repo}:life-roll");
    cluster::tag_image(&c, &image, &tagged);
    let before = fleet.identities();
    let sampler = availability(&c, &ns);
    fleet.patch(&format!(
        r#"{{"spec":{{"sidecar":{{"image":"{tagged}"}}}}}}"#
    ));
    rolled_to(&fleet, &tagged, &before);
    let (_, took) = fleet.whole(3);
    eprintln!(
        "new sidecar image: whole again {:.1} s after the last pod was replaced",
        took.as_secs_f64()
    );
    never_below("new sidecar image", &sampler.finish(), 2);
    cluster::untag_image(&c, &tagged);
    assert_eq!(fleet.new_validations(&c), 0, "orders placed at the CA");
}

/// Waits until each of the fleet's 3 pods is a new one since `before`, and
/// asserts that each runs the sidecar `image`: a roll to that image is
/// done.
fn rolled_to(fleet: &Fleet, image: &str, before: &cluster::Identities) {
    for pod in replaced(fleet, before, &format!("the roll to {image}")) {
        assert_eq!(
            pod["spec"]["initContainers"][0]["image"], image,
            "{} runs another sidecar",
            pod["metadata"]["name"]
        );
    }
}

/// Every pod evicted through the eviction API at once, as `kubectl drain`
/// does, retried while refused: the PodDisruptionBudget (maxUnavailable 1)
/// refuses the evictions beyond one, so at least two pods are Ready and
/// every Ready sidecar counts at least two members at every moment; the
/// fleet ends whole, every pod replaced, the certificate the same.
#[test]
fn evicting_every_pod_at_once_is_held_to_one_at_a_time_by_the_budget() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let fleet = Fleet::deploy(&c, "life-drain", 7, |m| m);
    let ns = fleet.ns.name.clone();
    let before = fleet.identities();
    let sampler = availability(&c, &ns);
    let start = std::time::Instant::now();
    let (evicted, refused) = cluster::evict_all(&c, &ns, before.keys().cloned().collect());
    replaced(&fleet, &before, "the evictions");
    let (_, took) = fleet.whole(3);
    eprintln!(
        "drain: {evicted} evictions, {refused} refused by the budget; whole again {:.1} s after the last replacement ({:.1} s from the first eviction)",
        took.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    never_below("drain", &sampler.finish(), 2);
    assert_eq!(evicted, 3, "every pod evicted once");
    assert!(
        refused > 0,
        "the budget refused no eviction: was there one? (kubectl -n {ns} get pdb)"
    );
    assert_eq!(fleet.new_validations(&c), 0, "orders placed at the CA");
}

/// `kubectl annotate sbproxy demo sbproxy.dev/rotate-cluster-key=…`: the
/// operator writes `[new, old]` and tells each pod, the real kubelet
/// updates each pod's Secret volume, every sidecar seals with the new key,
/// and after `keyRotationGraceSeconds` the Secret holds `[new]` and every
/// sidecar reloads a ring of one key:
/// `status.clusterKey` goes Rotating → Stable, no sidecar rejected a packet
/// it could not open, no container restarted, and a pod replaced afterwards
/// still gets the certificate sealed in the store before the rotation.
#[test]
fn rotating_the_cluster_key_drops_no_packet_and_restarts_nothing() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    // Far below the kubelet's periodic sync (60-90 s): only the operator
    // telling each pod makes every kubelet write the Secret within it; a
    // pod left to its periodic sync still holds `[old]` when the others
    // hold `[new]`, cannot open their packets and fails the decrypt check.
    let fleet = Fleet::deploy(&c, "life-rotate", 8, |m| {
        m.replacen(
            "clustering: { enabled: true }",
            "clustering: { enabled: true, keyRotationGraceSeconds: 20 }",
            1,
        )
    });
    let key_of = |p: &Value| p["status"]["clusterKey"].clone();
    let first = wait_for("status.clusterKey", Duration::from_secs(60), || {
        let k = key_of(&fleet.ns.get(&["sbproxy", "demo"])?);
        (k["phase"] == "Stable").then_some(k)
    });
    let before = fleet.identities();
    let start = std::time::Instant::now();
    fleet
        .ns
        .kubectl(&[
            "annotate",
            "sbproxy",
            "demo",
            "sbproxy.dev/rotate-cluster-key=life-1",
        ])
        .expect("kubectl annotate");
    let rotating = wait_for(
        "status.clusterKey Rotating",
        Duration::from_secs(60),
        || {
            let k = key_of(&fleet.ns.get(&["sbproxy", "demo"])?);
            (k["phase"] == "Rotating" && k["keyId"] != first["keyId"]).then_some(k)
        },
    );
    let new_id = rotating["keyId"].as_str().expect("keyId").to_string();
    let pods = fleet.ns.proxy_pods("demo");
    wait_for(
        &format!("every sidecar sealing with key {new_id}"),
        Duration::from_secs(240),
        || {
            pods.iter()
                .all(|p| {
                    sidecar_status(&pod_ip(p), ADMIN).is_some_and(|s| {
                        s["nodes"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .any(|n| n["local"] == true && n["key_id"] == new_id.as_str())
                    })
                })
                .then_some(())
        },
    );
    let every_pod_new = start.elapsed();
    wait_for("status.clusterKey Stable", Duration::from_secs(240), || {
        let k = key_of(&fleet.ns.get(&["sbproxy", "demo"])?);
        (k["phase"] == "Stable" && k["keyId"] == new_id.as_str()).then_some(())
    });
    let stable = start.elapsed();
    // The Secret's keys, one per line: only the new one now.
    let keys = cluster_key(&fleet);
    assert_eq!(
        keys.lines().filter(|l| !l.trim().is_empty()).count(),
        1,
        "the Secret holds the new key only"
    );
    // Every sidecar reloads that ring of one key (its log says so), and the
    // mesh keeps going on it.
    wait_for(
        "every sidecar reloading the ring of the new key only",
        Duration::from_secs(120),
        || {
            pods.iter()
                .all(|p| {
                    let name = p["metadata"]["name"].as_str().unwrap_or_default();
                    fleet
                        .ns
                        .kubectl(&["logs", name, "-c", "sbmesh-sidecar"])
                        .is_ok_and(|logs| {
                            // JSON in a pod (`"keys":1`), text on a terminal.
                            logs.lines().any(|l| {
                                l.contains("cluster key ring reloaded")
                                    && (l.contains("\"keys\":1") || l.contains("keys=1"))
                            })
                        })
                })
                .then_some(())
        },
    );
    let one_key = start.elapsed();
    let (_, took) = fleet.whole(3);
    eprintln!(
        "key rotation: every sidecar on the new key {:.1} s after the annotation, Stable at {:.1} s, \
         every sidecar on the new key only at {:.1} s, whole {:.1} s later",
        every_pod_new.as_secs_f64(),
        stable.as_secs_f64(),
        one_key.as_secs_f64(),
        took.as_secs_f64()
    );
    for p in &pods {
        let ip = pod_ip(p);
        // Registered at 0: no value means /metrics did not answer.
        let decrypt = metric(&ip, "mesh_packets_rejected_total{reason=\"decrypt\"}")
            .unwrap_or_else(|| panic!("{}: no decrypt count at /metrics", p["metadata"]["name"]));
        assert_eq!(
            decrypt, 0.0,
            "{}: packets it could not open",
            p["metadata"]["name"]
        );
    }
    assert_eq!(
        fleet.identities(),
        before,
        "a pod was replaced or restarted"
    );
    // A pod that starts now reads the store with the new key only.
    fleet
        .ns
        .kubectl(&["delete", "pod", "demo-proxy-2"])
        .expect("kubectl delete pod");
    let (_, took) = fleet.whole(3);
    eprintln!(
        "key rotation: a replaced pod whole {:.1} s after its deletion",
        took.as_secs_f64()
    );
    assert_eq!(fleet.new_validations(&c), 0, "orders placed at the CA");
}

/// Two writers: a field the operator owns edited by hand (the StatefulSet's
/// replicas, a key of the rendered ConfigMap) is put back; an annotation a
/// user adds to the StatefulSet is left alone; a user's server-side apply
/// of an owned field under another field manager gets Kubernetes' conflict,
/// naming the operator.
#[test]
fn a_field_the_operator_owns_is_put_back_and_a_users_own_is_left() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(&c, "life-writers", &[]);
    c.apply(&ns.seed("clustered"));
    ns.ready_pods("demo", 3);

    let replicas = |ns: &Namespace| {
        ns.get(&["statefulset", "demo-proxy"])
            .and_then(|s| s["spec"]["replicas"].as_i64())
    };
    ns.kubectl(&["scale", "statefulset", "demo-proxy", "--replicas=5"])
        .expect("kubectl scale");
    let back = wait_for(
        "the StatefulSet's replicas put back to 3",
        Duration::from_secs(60),
        || (replicas(&ns) == Some(3)).then(std::time::Instant::now),
    );
    let _ = back;
    ns.ready_pods("demo", 3);

    let cm = ns.get(&["configmap", "demo-config"]).expect("ConfigMap");
    let data = cm["data"].as_object().expect("data").clone();
    let (key, value) = data.iter().next().expect("a key");
    let patch = serde_json::json!({"data": {key.clone(): "tampered: true\n"}}).to_string();
    ns.kubectl(&[
        "patch",
        "configmap",
        "demo-config",
        "--type=merge",
        "-p",
        &patch,
    ])
    .expect("kubectl patch configmap");
    wait_for(
        &format!("the ConfigMap's {key} put back"),
        Duration::from_secs(60),
        || {
            let cm = ns.get(&["configmap", "demo-config"])?;
            (cm["data"][key.as_str()] == *value).then_some(())
        },
    );

    ns.kubectl(&[
        "annotate",
        "statefulset",
        "demo-proxy",
        "example.com/owner=team-a",
    ])
    .expect("kubectl annotate");
    // A reconcile after it: the replicas edited again and put back again.
    ns.kubectl(&["scale", "statefulset", "demo-proxy", "--replicas=4"])
        .expect("kubectl scale");
    wait_for(
        "the StatefulSet's replicas put back to 3 again",
        Duration::from_secs(60),
        || (replicas(&ns) == Some(3)).then_some(()),
    );
    let sts = ns.get(&["statefulset", "demo-proxy"]).expect("StatefulSet");
    assert_eq!(
        sts["metadata"]["annotations"]["example.com/owner"], "team-a",
        "the user's annotation was removed: {}",
        sts["metadata"]["annotations"]
    );

    let mine = format!(
        "apiVersion: apps/v1\nkind: StatefulSet\nmetadata: {{name: demo-proxy, namespace: {}}}\nspec: {{replicas: 4}}\n",
        ns.name
    );
    let err = c
        .kubectl_with(
            &[
                "apply",
                "--server-side",
                "--field-manager=team-a",
                "-f",
                "-",
            ],
            Some(&mine),
        )
        .expect_err("a server-side apply of the operator's field without --force-conflicts");
    assert!(
        err.contains("conflict")
            && err.contains("sbmesh-operator")
            && err.contains(".spec.replicas"),
        "the conflict names the operator's field manager and the field: {err}"
    );
    assert_eq!(replicas(&ns), Some(3), "a refused apply changed nothing");
    ns.ready_pods("demo", 3);
}

/// Each sidecar's `total_nodes`, asked at the pods' addresses (no API
/// server needed), every 250 ms.
fn mesh_sizes(ips: Vec<String>) -> Sampler<Vec<Option<u64>>> {
    Sampler::start(Duration::from_millis(250), move || {
        ips.iter()
            .map(|ip| sidecar_status(ip, ADMIN).and_then(|s| s["summary"]["total_nodes"].as_u64()))
            .collect()
    })
}

/// The control plane restarts under a running fleet: kube-apiserver, then
/// etcd behind it. After each, an edit of the config made at once reaches
/// the rendered ConfigMap and every proxy (the operator's watches came
/// back and it reconciled); the sidecars never noticed (they do not talk
/// to the API: every one counted 3 members at every sample); no container
/// restarted but the operator's leader, which exits when it cannot renew
/// its Lease (the contract) and comes back as a follower.
///
/// It runs alone (`.config/nextest.toml`): the other tests' kubectl calls
/// wait out the API server's restart, but their fleets' timing does not.
#[test]
fn the_control_plane_restarts_under_the_fleet_and_the_sidecars_never_notice() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let fleet = Fleet::deploy(&c, "life-control-plane", 9, |m| m);
    let before = fleet.identities();
    let operator_before = cluster::identities(&c.operator_pods(cluster::OPERATOR_NAMESPACE));
    let ips = fleet.ips();
    let sizes = mesh_sizes(ips.clone());
    // Each edit is a new answer of an existing origin (a new origin would
    // be a new name for the certificate: an order), seen by every proxy
    // once the edit reached it.
    let host = fleet.names[0].clone();
    let mut manifest = fleet.manifest.clone();
    let mut body = format!("{host}\\n");
    for part in ["kube-apiserver", "etcd"] {
        let start = std::time::Instant::now();
        cluster::restart_parts(&[part]);
        let down = start.elapsed();
        let next_body = format!("after {part}\\n");
        let next = manifest.replacen(
            &format!("body: \"{body}\""),
            &format!("body: \"{next_body}\""),
            1,
        );
        assert_ne!(next, manifest, "no body {body:?} of {host} to edit");
        (manifest, body) = (next, next_body);
        let edited = std::time::Instant::now();
        wait_for(
            &format!("the edit applied after restarting {part}"),
            Duration::from_secs(120),
            || c.kubectl_with(&["apply", "-f", "-"], Some(&manifest)).ok(),
        );
        for ip in &ips {
            cluster::wait_for_answer(
                &format!("http://{ip}:8080/"),
                &host,
                &format!("after {part}\n"),
                Duration::from_secs(120),
            );
        }
        eprintln!(
            "{part} restarted in {:.1} s; an edit made then reached every proxy {:.1} s later",
            down.as_secs_f64(),
            edited.elapsed().as_secs_f64()
        );
    }
    let samples = sizes.finish();
    let short: Vec<String> = samples
        .iter()
        .filter(|(_, s)| s.iter().any(|n| *n != Some(3)))
        .map(|(t, s)| format!("{:.2} s: {s:?}", t.as_secs_f64()))
        .collect();
    assert!(
        samples.len() > 20 && short.is_empty(),
        "every sidecar counts 3 members at every one of {} samples; not at:\n{}",
        samples.len(),
        short.join("\n")
    );
    let (_, took) = fleet.whole(3);
    eprintln!(
        "control plane restarted: whole {:.1} s after the last edit arrived",
        took.as_secs_f64()
    );
    assert_eq!(
        fleet.identities(),
        before,
        "a proxy pod was replaced or restarted"
    );
    // The leader that could not renew its Lease while the API server was
    // away exits 0 by contract (SPEC section 9) and comes back as a
    // follower in place: the same pods, each restarted at most once.
    c.operator();
    let operator_after = cluster::identities(&c.operator_pods(cluster::OPERATOR_NAMESPACE));
    let restarted: Vec<&String> = operator_after
        .iter()
        .filter(|(name, now)| operator_before.get(*name) != Some(*now))
        .map(|(name, _)| name)
        .collect();
    for (name, (uid, counts)) in &operator_after {
        let (old_uid, old_counts) = operator_before
            .get(name)
            .unwrap_or_else(|| panic!("operator pod {name} is new: {operator_before:?}"));
        assert_eq!(uid, old_uid, "operator pod {name} was replaced");
        for ((_, now), (_, then)) in counts.iter().zip(old_counts) {
            assert!(
                now - then <= 1,
                "operator pod {name} restarted {} times",
                now - then
            );
        }
    }
    eprintln!(
        "control plane restarted: operator pods restarted (a lost Lease exits): {restarted:?}"
    );
    assert_eq!(fleet.new_validations(&c), 0, "orders placed at the CA");
}

/// Waits until every sidecar (at `ips`) wrote one and the same certificate
/// naming `name`; returns its serial.
fn written_everywhere(ips: &[String], name: &str) -> String {
    wait_for(
        &format!("every sidecar writing the certificate for {name}"),
        Duration::from_secs(240),
        || {
            let serials: BTreeSet<String> = ips
                .iter()
                .map(|ip| {
                    written(ip)
                        .into_iter()
                        .find(|(names, _)| names.iter().any(|n| n == name))
                        .map(|(_, s)| s)
                })
                .collect::<Option<_>>()?;
            (serials.len() == 1).then(|| serials.into_iter().next())?
        },
    )
}

/// The local certificates a pod's sidecar reports: (names, serial).
fn written(ip: &str) -> Vec<(Vec<String>, String)> {
    cluster::local_certificates(ip)
        .iter()
        .map(|c| {
            let names = c["names"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect();
            (names, cluster::serial_of(c))
        })
        .collect()
}

/// The shared store goes away under a running fleet: Redis restarted
/// while an order is in flight (a name added to the config), then Redis
/// answering nothing for 2 minutes (`CLIENT PAUSE`, every connection
/// hanging, as an unreachable server looks to a client). The new name is
/// ordered once and reaches every sidecar; meanwhile every pod stays Ready
/// and in the Service and every proxy keeps serving the certificate it
/// has; `/readyz` and the status say the store is away; everything
/// resumes by itself.
///
/// The Redis it restarts and pauses and the Pebble whose issuances it
/// counts are its own, so it runs beside the other tests.
#[test]
fn the_store_goes_away_and_the_fleet_keeps_serving() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let (c, _pebble) = c.with_own_pebble(None);
    let (c, mut redis) = c.with_own_redis();
    let fleet = Fleet::deploy(&c, "life-store", 10, |m| m);
    let ips = fleet.ips();

    // 1. Redis restarted while the order for a new name is in flight.
    let added = format!("c.{}.test", fleet.ns.name);
    cluster::add_a(&c, &added, &fleet.service_ip);
    let next = cluster::with_origin(&fleet.manifest, &added);
    let validations = cluster::validations_for(&c, &added);
    // Its own Pebble: every issuance and failed validation is this test's.
    let (issued, invalid) = (cluster::issued(&c), cluster::invalid_authorizations(&c));
    c.apply(&next);
    wait_for(
        &format!("the order for {added} at the CA"),
        Duration::from_secs(120),
        || (cluster::validations_for(&c, &added) > validations).then_some(()),
    );
    redis.restart();
    let serial = written_everywhere(&ips, &added);
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        cluster::issued(&c) - issued,
        1,
        "certificates the CA issued across the Redis restart"
    );
    eprintln!(
        "redis restarted mid-order: one certificate with {added} (serial {serial}), written by \
         every sidecar; validations of {added}: {}, failed validations: {}",
        cluster::validations_for(&c, &added) - validations,
        cluster::invalid_authorizations(&c) - invalid
    );

    // The proxies restart onto it one at a time (`apply: restart`; one
    // whose proxy restarted at deploy waits out its 10-minute interval):
    // settled before the store goes away, so that a restart's moment of
    // unreadiness is not counted against the store below.
    let c3 = c.clone();
    let ns3 = fleet.ns.name.clone();
    let mut last = None;
    wait_every(
        "the served certificates unchanged for 10 s, every pod Ready",
        Duration::from_secs(150),
        Duration::from_secs(10),
        || {
            let now: Vec<Option<String>> = ips
                .iter()
                .map(|ip| cluster::served_serial(&added, ip, 8443))
                .collect();
            let settled = ready_ips(&c3, &ns3).len() == 3 && last.as_ref() == Some(&now);
            last = Some(now);
            settled.then_some(())
        },
    );

    // 2. Redis answers nothing for 2 minutes. (The proxies' restarts onto
    // the added name's certificate are done: none may happen from here.)
    let before = fleet.identities();
    redis
        .pause(Duration::from_secs(120))
        .unwrap_or_else(|e| panic!("{e}"));
    let paused = std::time::Instant::now();
    let c2 = c.clone();
    let ns = fleet.ns.name.clone();
    let sampler = Sampler::start(Duration::from_secs(1), move || ready_ips(&c2, &ns).len());
    let said = wait_for(
        "every pod's /readyz saying the store is away, still 200",
        Duration::from_secs(60),
        || {
            ips.iter()
                .map(|ip| {
                    let (code, body) =
                        cluster::curl(&["--max-time", "2", &format!("http://{ip}:9091/readyz")])
                            .ok()?;
                    (code == 200 && body.contains("\"degraded\"") && body.contains("store"))
                        .then_some(body)
                })
                .collect::<Option<Vec<_>>>()
        },
    );
    eprintln!("redis paused: /readyz says {}", said[0]);
    let status = sidecar_status(&ips[0], ADMIN).expect("status");
    assert!(
        status["degraded"].to_string().contains("store"),
        "the status says the store is away: {}",
        status["degraded"]
    );
    // Served all along.
    while paused.elapsed() < Duration::from_secs(110) {
        for name in &fleet.names {
            for ip in &ips {
                let served = cluster::served_serial(name, ip, 8443);
                assert!(
                    served.as_deref() == Some(fleet.serial.as_str())
                        || served.as_deref() == Some(serial.as_str()),
                    "{ip} serves {name} while the store is away: {served:?}, not {} or {serial}",
                    fleet.serial
                );
            }
        }
        std::thread::sleep(Duration::from_secs(5));
    }
    wait_for(
        "every pod's /readyz plain ready again",
        Duration::from_secs(90),
        || {
            ips.iter()
                .all(|ip| {
                    cluster::curl(&["--max-time", "2", &format!("http://{ip}:9091/readyz")])
                        .is_ok_and(|(code, body)| code == 200 && !body.contains("degraded"))
                })
                .then_some(())
        },
    );
    let samples = sampler.finish();
    let fewest = samples.iter().map(|(_, n)| *n).min().unwrap_or(0);
    assert_eq!(
        fewest,
        3,
        "Ready pods while the store was away (every second): {:?}",
        samples.iter().map(|(_, n)| *n).collect::<Vec<_>>()
    );
    eprintln!(
        "redis paused 120 s: 3 pods Ready at every one of {} samples; resumed {:.1} s after the pause began",
        samples.len(),
        paused.elapsed().as_secs_f64()
    );
    assert_eq!(
        fleet.identities(),
        before,
        "a pod was replaced or restarted"
    );
}

/// The cluster key ring the operator made for SBProxy `demo`, one key per
/// line, as the Secret holds it (kubectl decodes the data).
fn cluster_key(fleet: &Fleet) -> String {
    fleet
        .ns
        .kubectl(&[
            "get",
            "secret",
            "demo-cluster-key",
            "-o",
            "go-template={{index .data \"cluster-key\" | base64decode}}",
        ])
        .expect("the cluster-key Secret")
}

/// Waits until the fleet's 3 pods are all new since `before` (other UIDs)
/// and Ready: the StatefulSet controller replaced the workload.
fn replaced(fleet: &Fleet, before: &cluster::Identities, what: &str) -> Vec<Value> {
    wait_for(
        &format!("every pod replaced and Ready after {what}"),
        Duration::from_secs(300),
        || {
            let pods = fleet.ns.proxy_pods("demo");
            let all_new = pods.len() == 3
                && pods.iter().all(|p| {
                    cluster::pod_ready(p)
                        && before
                            .get(p["metadata"]["name"].as_str().unwrap_or_default())
                            .is_none_or(|(uid, _)| p["metadata"]["uid"] != uid.as_str())
                });
            all_new.then_some(pods)
        },
    )
}

/// `spec.clustering.enabled` turned off and on again: the workload is
/// replaced each time as the reference says (the pods without, then with,
/// the mesh Service and the key), the key Secret is kept with the same
/// key, the certificate stays readable and served throughout (the store's
/// records are sealed with that key), and the mesh re-forms on the same
/// key: no order at the CA, no packet it could not open.
#[test]
fn clustering_turned_off_and_on_keeps_the_key_and_the_certificate() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let fleet = Fleet::deploy(&c, "life-flip", 11, |m| m);
    let key = cluster_key(&fleet);
    let key_id = wait_for("status.clusterKey", Duration::from_secs(60), || {
        let k = fleet.ns.get(&["sbproxy", "demo"])?["status"]["clusterKey"].clone();
        (k["phase"] == "Stable").then(|| k["keyId"].as_str().map(String::from))?
    });

    let before = fleet.identities();
    let start = std::time::Instant::now();
    fleet.patch(r#"{"spec":{"clustering":{"enabled":false}}}"#);
    let pods = replaced(&fleet, &before, "clustering off");
    let off = start.elapsed();
    let pod = &pods[0];
    let sidecar = pod["spec"]["initContainers"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "sbmesh-sidecar"))
        .expect("the sidecar");
    assert!(
        !sidecar["env"].to_string().contains("SBMESH_MESH_SERVICE"),
        "a pod without clustering has no mesh to join: {}",
        sidecar["env"]
    );
    for pod in &pods {
        let ip = pod_ip(pod);
        let status = sidecar_status(&ip, ADMIN).expect("status");
        assert_eq!(
            status["summary"]["total_nodes"], 1,
            "{}: a sidecar without clustering is alone: {}",
            pod["metadata"]["name"], status["summary"]
        );
        for name in &fleet.names {
            let served = wait_for(
                &format!("{name} served by {ip}"),
                Duration::from_secs(60),
                || cluster::served_serial(name, &ip, 8443),
            );
            assert_eq!(
                served, fleet.serial,
                "{}: serves another certificate for {name} with clustering off",
                pod["metadata"]["name"]
            );
        }
    }
    assert_eq!(cluster_key(&fleet), key, "the key Secret is kept as it was");
    eprintln!(
        "clustering off: every pod replaced and serving {:.1} s after the patch",
        off.as_secs_f64()
    );

    let before = fleet.identities();
    let start = std::time::Instant::now();
    fleet.patch(r#"{"spec":{"clustering":{"enabled":true}}}"#);
    replaced(&fleet, &before, "clustering on");
    let (_, took) = fleet.whole(3);
    eprintln!(
        "clustering on: whole {:.1} s after the patch ({:.1} s after the last replacement)",
        start.elapsed().as_secs_f64(),
        took.as_secs_f64()
    );
    assert_eq!(cluster_key(&fleet), key, "the key Secret is kept as it was");
    for ip in fleet.ips() {
        let status = sidecar_status(&ip, ADMIN).expect("status");
        let local = status["nodes"]
            .as_array()
            .and_then(|n| n.iter().find(|m| m["local"] == true).cloned())
            .expect("the local node");
        assert_eq!(
            local["key_id"],
            key_id.as_str(),
            "{ip} seals with the same key"
        );
        let decrypt = metric(&ip, "mesh_packets_rejected_total{reason=\"decrypt\"}")
            .unwrap_or_else(|| panic!("{ip}: no decrypt count at /metrics"));
        assert_eq!(decrypt, 0.0, "{ip}: packets it could not open");
    }
    assert_eq!(fleet.new_validations(&c), 0, "orders placed at the CA");
}

/// The replica placing an order dies mid-order: a name is added, and while
/// Pebble validates its order (the validation routed to a listener that
/// accepts and never answers, so the order stays in flight at the CA with
/// its lock held) the sidecar holding it, found by
/// `sbmesh_acme_orders_in_progress`, is killed with SIGKILL (nothing
/// released). The order is completed without waiting out the lock's lease
/// (its node's next process takes over its own predecessor's lock), every
/// sidecar writes the certificate, and the CA issued exactly one.
///
/// The Pebble whose issuances it counts is its own.
#[test]
fn the_order_holder_killed_mid_order_the_order_completes_once() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let (c, _pebble) = c.with_own_pebble(None);
    let fleet = Fleet::deploy(&c, "life-holder", 12, |m| m);
    let pods = fleet.ns.proxy_pods("demo");
    let before = fleet.identities();
    let added = format!("c.{}.test", fleet.ns.name);
    let stall = cluster::host_port_80(&c, Duration::from_secs(240));
    cluster::add_a(&c, &added, &c.host_ip);
    let next = cluster::with_origin(&fleet.manifest, &added);
    let issued = cluster::issued(&c);
    c.apply(&next);
    let mut held = Vec::new();
    let holder = wait_for(
        &format!("Pebble validating the order for {added}, one sidecar holding it"),
        Duration::from_secs(120),
        || {
            while let Ok((s, _)) = stall.accept() {
                held.push(s);
            }
            if held.is_empty() {
                return None;
            }
            let holding: Vec<&Value> = pods
                .iter()
                .filter(|p| metric(&pod_ip(p), "sbmesh_acme_orders_in_progress") == Some(1.0))
                .collect();
            (holding.len() == 1).then(|| holding[0].clone())
        },
    );
    let name = holder["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    // From now on Pebble's validations reach the fleet.
    cluster::add_a(&c, &added, &fleet.service_ip);
    let killed = std::time::Instant::now();
    cluster::kill_container(&c, &cluster::container_id(&holder, "sbmesh-sidecar"));
    let serial = written_everywhere(&fleet.ips(), &added);
    let took = killed.elapsed();
    drop(held);
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(
        cluster::issued(&c) - issued,
        1,
        "certificates the CA issued for the order whose holder was killed"
    );
    eprintln!(
        "order holder {name} killed while Pebble validated: one certificate with {added} (serial {serial}) \
         written by every sidecar {:.1} s after the kill",
        took.as_secs_f64()
    );
    // Only the killed sidecar restarted, once, in its pod. (A proxy may
    // have restarted: `apply: restart` delivers the new certificate so.)
    let after = fleet.identities();
    for (pod, (uid, counts)) in &after {
        let (old_uid, old_counts) = &before[pod];
        assert_eq!(uid, old_uid, "{pod} was replaced");
        for ((container, now), (_, then)) in counts.iter().zip(old_counts) {
            if container != "sbmesh-sidecar" {
                continue;
            }
            let expected = i64::from(*pod == name);
            assert_eq!(
                now - then,
                expected,
                "{pod}'s {container} restarted {} times",
                now - then
            );
        }
    }
}

/// What one sidecar's status says of a member: its membership state, or
/// `None` when it does not list it (or does not answer).
fn state_of(ip: &str, node: &str) -> Option<String> {
    let status = sidecar_status(ip, ADMIN)?;
    status["nodes"]
        .as_array()?
        .iter()
        .find(|m| m["node_id"] == node)
        .and_then(|m| m["membership_state"].as_str().map(String::from))
}

/// The longest run of consecutive samples in which some watcher did not
/// list the member as alive, as (from, to) sample times; `None` when every
/// watcher listed it alive at every sample.
fn longest_not_alive(samples: &[(Duration, Vec<Option<String>>)]) -> Option<(Duration, Duration)> {
    let mut longest: Option<(Duration, Duration)> = None;
    let mut from = None;
    for (t, views) in samples {
        if views.iter().all(|v| v.as_deref() == Some("alive")) {
            from = None;
            continue;
        }
        let start = *from.get_or_insert(*t);
        if longest.is_none_or(|(a, b)| b - a < *t - start) {
            longest = Some((start, *t));
        }
    }
    longest
}

/// A node under pressure: one pod's sidecar CPU-limited hard while the
/// others are not, then stopped outright.
///
/// 1. An in-place resize to `limits.cpu: 20m` (the kubelet's CFS quota,
///    checked in its cgroup), under a steady load of status requests, for
///    40 s: the kernel throttles it, and its peers never list it as
///    anything but alive; `/readyz` stays plain ready.
/// 2. Frozen for 5 s (the cgroup freezer: a stall no quota can explain).
///    Its log names the stall and its length, `/readyz` says why (200,
///    `degraded`), and its peers list it alive again within a few seconds of
///    the thaw: not down for longer than its stall.
///
/// Nothing restarts.
#[test]
fn a_sidecar_starved_of_cpu_says_so_and_is_not_lost() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let fleet = Fleet::deploy(&c, "life-cpu", 13, |m| m);
    let pods = fleet.ns.proxy_pods("demo");
    let starved = "demo-proxy-1";
    let ip = pod_ip(&pods[1]);
    let id = cluster::container_id(&pods[1], "sbmesh-sidecar");
    let watchers: Vec<String> = [&pods[0], &pods[2]].iter().map(|p| pod_ip(p)).collect();
    let before = fleet.identities();
    let watch = || {
        let w = watchers.clone();
        Sampler::start(Duration::from_millis(250), move || {
            w.iter().map(|ip| state_of(ip, starved)).collect::<Vec<_>>()
        })
    };
    let readyz = {
        let ip = ip.clone();
        move || {
            cluster::curl(&["--max-time", "2", &format!("http://{ip}:9091/readyz")]).map_or_else(
                |e| format!("no answer: {e}"),
                |(code, body)| format!("{code} {body}"),
            )
        }
    };

    // 1. Throttled.
    fleet
        .ns
        .kubectl(&[
            "patch",
            "pod",
            starved,
            "--subresource",
            "resize",
            "-p",
            r#"{"spec":{"initContainers":[{"name":"sbmesh-sidecar","resources":{"requests":{"cpu":"20m"},"limits":{"cpu":"20m"}}}]}}"#,
        ])
        .expect("an in-place resize of the sidecar's CPU");
    // The kubelet (1.33) resizes a running native sidecar only once it
    // holds the sidecar's first liveness result (computeInitContainerActions
    // stops at "not probed yet"), and that first success starts no pod
    // sync: a resize admitted before it waits for the periodic resync,
    // 60-90 s later. Any change to the pod starts a sync, so the test
    // touches an annotation every 5 s until the quota is there.
    let resized = std::time::Instant::now();
    let mut nudges = 0;
    let throttled_before = wait_for(
        "the kubelet's CPU quota (2 ms per 100 ms) in the sidecar's cgroup",
        Duration::from_secs(60),
        || match cluster::container_cpu(&c, &id)? {
            (Some(2000), throttled) => Some(throttled),
            _ => {
                if resized.elapsed() > Duration::from_secs(5 * (nudges + 1)) {
                    nudges += 1;
                    let _ = fleet.ns.kubectl(&[
                        "annotate",
                        "pod",
                        starved,
                        "--overwrite",
                        &format!("sbmesh.test/resize-nudge={nudges}"),
                    ]);
                }
                None
            }
        },
    );
    let views = watch();
    let ready = Sampler::start(Duration::from_millis(500), readyz.clone());
    // Two clients asking for its status back to back.
    let loads: Vec<Sampler<bool>> = (0..2)
        .map(|_| {
            let ip = ip.clone();
            Sampler::start(Duration::from_millis(20), move || {
                sidecar_status(&ip, ADMIN).is_some()
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs(40));
    let load: Vec<(Duration, bool)> = loads.into_iter().flat_map(Sampler::finish).collect();
    let (views, ready) = (views.finish(), ready.finish());
    let throttled_periods =
        cluster::container_cpu(&c, &id).map_or(0, |(_, n)| n) - throttled_before;
    eprintln!(
        "throttled to 20m: {} status requests ({} answered), {throttled_periods} periods throttled",
        load.len(),
        load.iter().filter(|(_, ok)| *ok).count()
    );
    assert!(
        throttled_periods > 0,
        "the kernel never throttled the sidecar: no pressure was made"
    );
    assert_eq!(
        longest_not_alive(&views),
        None,
        "a peer listed the throttled {starved} as other than alive"
    );
    let not_ready: Vec<&String> = ready
        .iter()
        .map(|(_, r)| r)
        .filter(|r| *r != "200 ready")
        .collect();
    assert!(
        not_ready.is_empty(),
        "/readyz of the throttled sidecar: {not_ready:?}"
    );

    // 2. Stopped for 5 s.
    let views = watch();
    let frozen = std::time::Instant::now();
    cluster::pause_container(&c, &id);
    std::thread::sleep(Duration::from_secs(5));
    cluster::resume_container(&c, &id);
    let thawed = frozen.elapsed();
    let said = wait_for(
        "/readyz saying why after the stall",
        Duration::from_secs(30),
        || {
            let r = readyz();
            (r.starts_with("200") && r.contains("degraded") && r.contains("was not running"))
                .then_some(r)
        },
    );
    let back = wait_for(
        &format!("every peer listing {starved} alive after the thaw"),
        Duration::from_secs(30),
        || {
            watchers
                .iter()
                .all(|w| state_of(w, starved).as_deref() == Some("alive"))
                .then(|| frozen.elapsed())
        },
    );
    std::thread::sleep(Duration::from_secs(2));
    let views = views.finish();
    let logs = fleet
        .ns
        .kubectl(&["logs", starved, "-c", "sbmesh-sidecar", "--since=60s"])
        .unwrap_or_default();
    let stall_line = logs
        .lines()
        .find(|l| l.contains("this process was not running"))
        .unwrap_or_else(|| panic!("{starved}'s log names no stall:\n{logs}"));
    eprintln!("stopped {:.1} s: log: {stall_line}", thawed.as_secs_f64());
    eprintln!("stopped: /readyz: {said}");
    let longest = longest_not_alive(&views);
    if let Some((from, to)) = longest {
        eprintln!(
            "stopped: a peer listed it other than alive from {:.2} s to {:.2} s after the freeze; \
             every peer listed it alive {:.2} s after the freeze ({:.2} s after the thaw)",
            from.as_secs_f64(),
            to.as_secs_f64(),
            back.as_secs_f64(),
            (back - thawed).as_secs_f64()
        );
        assert!(
            to - from <= thawed + Duration::from_secs(1),
            "{starved} was not listed alive for {:.2} s, longer than its {:.1} s stall",
            (to - from).as_secs_f64(),
            thawed.as_secs_f64()
        );
    }
    assert!(
        back - thawed < Duration::from_secs(5),
        "every peer listed {starved} alive {:.1} s after the thaw",
        (back - thawed).as_secs_f64()
    );
    assert_eq!(
        fleet.identities(),
        before,
        "a pod was replaced or restarted"
    );
}

/// The node restarts: a power cut (`scripts/cluster power-cut`: every part
/// of the node killed at once, containers included, what a reboot loses
/// dropped) and its return from what is on disk. Every pod comes back (the
/// same pods, their containers started again in new sandboxes at new
/// addresses), the mesh re-forms, every proxy serves every certificate
/// from the store, and the CA sees no new order.
///
/// It runs alone (`.config/nextest.toml`): it stops everything.
#[test]
fn the_node_loses_power_and_the_fleet_comes_back_from_the_store() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let fleet = Fleet::deploy(&c, "life-power", 14, |m| m);
    let before = fleet.identities();
    let ips_before = fleet.ips();
    let start = std::time::Instant::now();
    cluster::power_cut();
    let node_back = start.elapsed();
    let (pods, _) = fleet.whole(3);
    let whole = start.elapsed();
    let after = cluster::identities(&pods);
    for (name, (uid, counts)) in &after {
        let (old_uid, old_counts) = before
            .get(name)
            .unwrap_or_else(|| panic!("{name} is new: {before:?}"));
        assert_eq!(
            uid, old_uid,
            "{name} was replaced, not restarted on the node"
        );
        for ((container, now), (_, then)) in counts.iter().zip(old_counts) {
            assert!(
                now > then,
                "{name}'s {container} did not restart: the power cut did not reach it"
            );
        }
    }
    let ips_after = fleet.ips();
    eprintln!(
        "power cut: node Ready again {:.1} s after the cut, the fleet whole {:.1} s after it \
         (addresses {ips_before:?} → {ips_after:?})",
        node_back.as_secs_f64(),
        whole.as_secs_f64()
    );
    assert_eq!(fleet.new_validations(&c), 0, "orders placed at the CA");
    c.operator();
}

/// The image the build of `PREVIOUS_SIDECAR` in `scripts/cluster` carries.
const PREVIOUS_IMAGE: &str = "ghcr.io/sbproxy/sbmesh:previous";

/// Upgrade across versions: a fleet running the previous sidecar (the
/// commit `scripts/cluster` pins as `PREVIOUS_SIDECAR`) rolled to this
/// tree's image on a live fleet. At every 250 ms sample at least two pods
/// are Ready and each Ready sidecar counts at least two members, also
/// while the two versions run side by side (the mixed-version mesh never
/// splits), and no sidecar of either version rejects a packet it cannot
/// decode; the fleet ends whole with the same certificate, no order placed.
#[test]
fn a_rolling_upgrade_from_the_previous_sidecar_never_splits_the_mesh() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let fleet = Fleet::deploy(&c, "life-upgrade", 15, |m| {
        m.replacen(
            "  clustering: { enabled: true }\n",
            &format!(
                "  clustering: {{ enabled: true }}\n  sidecar: {{ image: {PREVIOUS_IMAGE} }}\n"
            ),
            1,
        )
    });
    let ns = fleet.ns.name.clone();
    let pods = fleet.ns.proxy_pods("demo");
    assert!(
        pods.iter()
            .all(|p| p["spec"]["initContainers"][0]["image"] == PREVIOUS_IMAGE),
        "the fleet runs the previous sidecar"
    );
    let current = c.sbmesh_image.clone();
    let before = fleet.identities();
    // Each Ready pod: its sidecar's image, the members it counts, and the
    // packets it could not decode.
    let c2 = c.clone();
    let sampler = Sampler::start(Duration::from_millis(250), move || {
        cluster::ready_fleet_pods(&c2, &ns)
            .iter()
            .map(|p| {
                let ip = pod_ip(p);
                let members = sidecar_status(&ip, ADMIN)
                    .and_then(|s| s["summary"]["total_nodes"].as_u64())
                    .unwrap_or(0);
                // Registered at 0 (by both versions): None is /metrics
                // not answering, counted below.
                let undecoded = metric(&ip, "mesh_packets_rejected_total{reason=\"decode\"}");
                (
                    p["spec"]["initContainers"][0]["image"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    members,
                    undecoded,
                )
            })
            .collect::<Vec<_>>()
    });
    fleet.patch(&format!(
        r#"{{"spec":{{"sidecar":{{"image":"{current}"}}}}}}"#
    ));
    rolled_to(&fleet, &current, &before);
    let (_, took) = fleet.whole(3);
    let samples = sampler.finish();
    let low: Vec<String> = samples
        .iter()
        .filter(|(_, ready)| ready.len() < 2 || ready.iter().any(|(_, m, _)| *m < 2))
        .map(|(t, ready)| format!("{:.2} s: {ready:?}", t.as_secs_f64()))
        .collect();
    assert!(
        samples.len() > 10 && low.is_empty(),
        "fewer than 2 Ready pods, or a sidecar counting fewer than 2 members, at {} of {} samples:\n{}",
        low.len(),
        samples.len(),
        low.join("\n")
    );
    let mixed = samples
        .iter()
        .filter(|(_, ready)| {
            ready.iter().any(|(i, _, _)| i == PREVIOUS_IMAGE)
                && ready.iter().any(|(i, _, _)| *i == current)
        })
        .count();
    assert!(
        mixed > 0,
        "no sample saw both versions Ready at once: the mixed mesh was never tried"
    );
    // The decode counts were read, from both versions.
    let readings = samples.iter().flat_map(|(_, ready)| ready.iter());
    let unread = readings.clone().filter(|(_, _, u)| u.is_none()).count();
    let read_from = |image: &str| {
        readings
            .clone()
            .any(|(i, _, u)| i.as_str() == image && u.is_some())
    };
    assert!(
        read_from(PREVIOUS_IMAGE) && read_from(&current) && unread * 10 <= readings.clone().count(),
        "the decode counts were not read: {unread} of {} readings without /metrics, from the \
         previous image {}, from the current one {}",
        readings.clone().count(),
        read_from(PREVIOUS_IMAGE),
        read_from(&current)
    );
    let undecoded: Vec<String> = samples
        .iter()
        .flat_map(|(t, ready)| {
            ready
                .iter()
                .filter(|(_, _, u)| u.is_some_and(|u| u > 0.0))
                .map(move |r| format!("{:.2} s: {r:?}", t.as_secs_f64()))
        })
        .collect();
    assert!(
        undecoded.is_empty(),
        "packets a sidecar could not decode during the upgrade:\n{}",
        undecoded.join("\n")
    );
    eprintln!(
        "upgrade from the previous sidecar: {mixed} of {} samples with both versions Ready, each \
         sidecar counting ≥ 2; whole {:.1} s after the last pod was replaced",
        samples.len(),
        took.as_secs_f64()
    );
    assert_eq!(fleet.new_validations(&c), 0, "orders placed at the CA");
}

/// A seeded chaos run on the real cluster ([`cluster::chaos`]): the faults
/// of scenarios 2, 3, 4, 5, 7, 9 and 13 at random for `SBMESH_SOAK_SECS`
/// (here 120 s by default: CI's short run; `operator/benches/cluster_chaos.rs`
/// runs 10 minutes) from `SBMESH_SOAK_SEED`, on certificates that live
/// 3 minutes, with names added and a renewal's order holder killed: one
/// certificate per set of names per renewal, no proxy ever serving an
/// expired one, no crash, the fleet whole again after the last fault.
///
/// It runs alone (`.config/nextest.toml`): it restarts the control plane
/// every test uses (its Pebble and Redis are its own).
#[test]
fn a_seeded_chaos_run_loses_no_certificate_and_crashes_nothing() {
    let Some(c) = Cluster::from_env() else { return };
    let (secs, seed) = cluster::chaos::settings(120);
    cluster::chaos::run(&c, secs, seed);
}
