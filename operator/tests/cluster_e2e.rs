//! The seed's manifests as written, `kubectl apply`-ed to the real cluster
//! that `scripts/cluster up` starts, under the cluster-scope operator that
//! `cluster_install` leaves installed (`scripts/test` runs that first).
//! Each test has a namespace of its own (the manifests' `namespace:
//! default` is the only thing changed) and checks what a user would check
//! with kubectl, curl and the sidecar's status.

mod cluster;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cluster::{
    Cluster, LEADER_LEASE, Namespace, OPERATOR_NAMESPACE, acme_manifest, add_a, curl, issued,
    metric, pebble_root, pod_ip, restarts, serves_tls, sidecar_status, wait_for, wait_for_answer,
};
use serde_json::Value;

const ADMIN: Option<(&str, &str)> = Some(("admin", "secret"));

/// Every sidecar of `pods` sees `n` alive nodes, the same config hash everywhere.
fn mesh_of(pods: &[Value], n: usize) -> BTreeMap<String, Value> {
    wait_for(
        &format!("every sidecar's status showing {n} alive nodes"),
        Duration::from_secs(120),
        || {
            let mut hashes = BTreeMap::new();
            for pod in pods {
                let s = sidecar_status(&pod_ip(pod), ADMIN)?;
                let alive = s["nodes"]
                    .as_array()?
                    .iter()
                    .filter(|n| n["membership_state"] == "alive")
                    .count();
                if s["summary"]["total_nodes"] != n || alive != n {
                    return None;
                }
                hashes.insert(
                    pod["metadata"]["name"].as_str()?.to_string(),
                    s["summary"]["config_hashes"].clone(),
                );
            }
            Some(hashes)
        },
    )
}

#[test]
fn clustered_pods_form_a_mesh_through_the_headless_service() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(&c, "e2e-clustered", &[]);
    c.apply(&ns.seed("clustered"));
    let pods = ns.ready_pods("demo", 3);
    ns.condition("demo", "Ready", "True", Some("AllReplicasReady"));

    // Seeds come from CoreDNS's records of demo-mesh, not from a list.
    let sts = ns.get(&["statefulset", "demo-proxy"]).expect("StatefulSet");
    let sidecar = &sts["spec"]["template"]["spec"]["initContainers"][0];
    let env: Vec<&str> = sidecar["env"]
        .as_array()
        .expect("env")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(env.contains(&"SBMESH_MESH_SERVICE"), "{env:?}");
    assert!(!env.contains(&"SBMESH_SEEDS"), "{env:?}");

    let hashes = mesh_of(&pods, 3);
    let distinct: std::collections::BTreeSet<String> =
        hashes.values().map(|h| h.to_string()).collect();
    assert_eq!(distinct.len(), 1, "one config hash everywhere: {hashes:?}");
    for pod in &pods {
        let ip = pod_ip(pod);
        let alive = wait_for(
            &format!("mesh_peer_count{{state=\"alive\"}} 2 on {ip}"),
            Duration::from_secs(60),
            || metric(&ip, "mesh_peer_count{state=\"alive\"}").filter(|v| *v == 2.0),
        );
        assert_eq!(alive, 2.0);
    }
    // `sbmesh-sidecar status`, as a user runs it against one pod.
    if let Ok(bin) = std::env::var("SBMESH_TEST_SIDECAR_BIN") {
        let out = std::process::Command::new(bin)
            .args([
                "status",
                "--admin",
                &format!("http://{}:9091", pod_ip(&pods[0])),
            ])
            .args(["--user", "admin", "--password", "secret"])
            .output()
            .expect("sbmesh-sidecar status");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("3 nodes (3 healthy, 0 suspect, 0 down)"),
            "{text}"
        );
    }
}

#[test]
fn a_config_edit_reaches_every_proxy_without_a_restart() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(&c, "e2e-hot-reload", &[]);
    let manifest = ns.seed("hot-reload");
    c.apply(&manifest);
    let pods = ns.ready_pods("demo", 2);
    let before: Vec<_> = pods.iter().map(restarts).collect();
    let hash_before = ns.condition("demo", "Ready", "True", None)["status"]["configHash"].clone();
    for pod in &pods {
        let url = format!("http://{}:8080/", pod_ip(pod));
        wait_for_answer(&url, "demo.example.com", "hello\n", Duration::from_secs(60));
    }

    let edited = manifest.replace("body: \"hello\\n\"", "body: \"hello, edited\\n\"");
    assert_ne!(
        edited, manifest,
        "the seed's body is where the test edits it"
    );
    let start = Instant::now();
    c.apply(&edited);
    for pod in &pods {
        let url = format!("http://{}:8080/", pod_ip(pod));
        wait_for_answer(
            &url,
            "demo.example.com",
            "hello, edited\n",
            Duration::from_secs(180),
        );
    }
    eprintln!(
        "edit -> every proxy: {:.1} s",
        start.elapsed().as_secs_f64()
    );

    // The SBProxy's status and every sidecar agree on the new hash.
    let hash = wait_for(
        "the new configHash in status",
        Duration::from_secs(60),
        || {
            let p = ns.get(&["sbproxy", "demo"])?;
            let h = p["status"]["configHash"].clone();
            (h.is_string() && h != hash_before).then_some(h)
        },
    );
    let hash = hash.as_str().expect("hash").to_string();
    wait_for(
        "every sidecar reporting the SBProxy's new configHash (for every node it knows)",
        Duration::from_secs(60),
        || {
            pods.iter()
                .all(|pod| {
                    sidecar_status(&pod_ip(pod), ADMIN).is_some_and(|s| {
                        let hashes = s["summary"]["config_hashes"]
                            .as_object()
                            .cloned()
                            .unwrap_or_default();
                        hashes.len() == 1 && hashes.contains_key(&hash)
                    })
                })
                .then_some(())
        },
    );
    let after: Vec<_> = ns.proxy_pods("demo").iter().map(restarts).collect();
    assert_eq!(before, after, "no container restarted");
}

#[test]
fn the_proxys_own_acme_on_redis_runs_and_the_sidecars_order_nothing() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(&c, "e2e-acme-redis", &[]);
    c.apply(&ns.seed("acme-redis"));
    let pods = ns.ready_pods("demo", 2);
    ns.condition("demo", "Ready", "True", None);
    for pod in &pods {
        let ip = pod_ip(pod);
        let s = sidecar_status(&ip, None);
        // /admin/* answers loopback only without credentials: the metrics say it.
        assert!(
            s.is_none()
                || s.as_ref()
                    .is_some_and(|s| s["nodes"][0]["certificates"] == Value::Array(vec![]))
        );
        for result in ["issued", "failed", "skipped"] {
            let orders = metric(&ip, &format!("acme_orders_total{{result=\"{result}\"}}"));
            assert!(
                orders.unwrap_or(0.0) == 0.0,
                "{ip}: acme_orders_total{{result={result}}} = {orders:?}"
            );
        }
        // The proxy's own ACME block is there, for the proxy.
        let logs = ns
            .kubectl(&[
                "logs",
                pod["metadata"]["name"].as_str().expect("name"),
                "-c",
                "proxy",
            ])
            .expect("proxy logs");
        assert!(logs.to_ascii_lowercase().contains("acme"), "{logs}");
    }
}

#[test]
fn redb_with_two_replicas_is_refused() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(&c, "e2e-acme-redb", &[]);
    c.apply(&ns.seed("acme-redb"));
    let p = ns.condition("demo", "Degraded", "True", Some("AcmeStoreNotShared"));
    let message = p["status"]["lastError"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(message.contains("storage_backend \"redb\""), "{message}");
    let describe = ns
        .kubectl(&["describe", "sbproxy", "demo"])
        .expect("describe");
    assert!(describe.contains("AcmeStoreNotShared"), "{describe}");
    assert!(describe.contains("which is local to one pod"), "{describe}");
    assert!(
        ns.get(&["statefulset", "demo-proxy"]).is_none(),
        "no workload"
    );
    assert!(ns.proxy_pods("demo").is_empty(), "no pods");
}

#[test]
fn the_clustered_sbproxy_runs_under_the_restricted_pod_security_standard() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(
        &c,
        "e2e-restricted",
        &[
            ("pod-security.kubernetes.io/enforce", "restricted"),
            ("pod-security.kubernetes.io/enforce-version", "latest"),
        ],
    );
    c.apply(&ns.seed("clustered"));
    // A refused pod never exists; the StatefulSet's events say why.
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        let pods = ns.proxy_pods("demo");
        if pods.len() == 3 && pods.iter().all(cluster::pod_ready) {
            break;
        }
        let events = ns
            .kubectl(&[
                "get",
                "events",
                "--field-selector",
                "reason=FailedCreate",
                "-o",
                "custom-columns=M:.message",
                "--no-headers",
            ])
            .unwrap_or_default();
        assert!(
            events.trim().is_empty(),
            "pods refused under restricted: {events}"
        );
        assert!(
            Instant::now() < deadline,
            "no 3 Ready pods under restricted"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    mesh_of(&ns.proxy_pods("demo"), 3);
}

#[test]
fn the_standby_takes_the_lease_and_applies_an_edit_made_during_the_hand_off() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(&c, "e2e-leader", &[]);
    let manifest = ns.seed("demo");
    c.apply(&manifest);
    ns.condition("demo", "Ready", "True", None);

    let leader = c
        .get(&["-n", OPERATOR_NAMESPACE, "lease", LEADER_LEASE])
        .expect("lease")["spec"]["holderIdentity"]
        .as_str()
        .expect("holder")
        .to_string();
    let start = Instant::now();
    c.must(&[
        "-n",
        OPERATOR_NAMESPACE,
        "delete",
        "pod",
        &leader,
        "--wait=false",
    ]);
    // The edit lands while no operator leads.
    let edited = manifest.replace("hello from sbproxy", "hello after the hand-off");
    assert_ne!(edited, manifest);
    c.apply(&edited);
    let new_leader = wait_for("a new Lease holder", Duration::from_secs(60), || {
        let lease = c.get(&["-n", OPERATOR_NAMESPACE, "lease", LEADER_LEASE])?;
        let holder = lease["spec"]["holderIdentity"].as_str()?.to_string();
        (holder != leader && !holder.is_empty()).then_some(holder)
    });
    eprintln!(
        "hand-off: {new_leader} holds the Lease {:.1} s after the delete",
        start.elapsed().as_secs_f64()
    );
    let cm = wait_for("the edit in the ConfigMap", Duration::from_secs(60), || {
        let cm = ns.get(&["configmap", "demo-config"])?;
        let text = cm["data"]["sb.yml"].as_str()?.to_string();
        text.contains("hello after the hand-off").then_some(text)
    });
    assert!(cm.contains("hello after the hand-off"));
    eprintln!(
        "edit applied {:.1} s after the delete",
        start.elapsed().as_secs_f64()
    );
}

/// The sidecar's ACME (`proxy.extensions.sbmesh.acme`) on 3 replicas, a
/// Redis the pods reach and Pebble's directory: Pebble validates every
/// hostname through `demo-svc` port 80, so kube-proxy picks the pod that
/// answers; one certificate is issued for the names (`san`), and every
/// proxy serves it, through the Service's `https` port and on each pod.
#[test]
fn the_sidecars_acme_issues_through_the_service_and_every_proxy_serves_it() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(&c, "e2e-acme", &[]);
    let names = ["a.e2e.test", "b.e2e.test", "c.e2e.test"];
    let issued_before = issued(&c);
    c.apply(&acme_manifest(&c, &ns.name, &names, 1));
    // Pebble resolves each name to the Service, as a public DNS record
    // would point at a LoadBalancer in front of it.
    let ip = wait_for("the Service demo-svc", Duration::from_secs(60), || {
        ns.get(&["service", "demo-svc"])?["spec"]["clusterIP"]
            .as_str()
            .map(str::to_string)
    });
    for name in names {
        add_a(&c, name, &ip);
    }
    let root = pebble_root(&c);
    let pods = ns.ready_pods("demo", 3);
    // Every proxy, through the Service and on its own address, serves the
    // CA's certificate for every name.
    for name in names {
        let resolve = format!("{name}:443:{ip}");
        wait_for(
            &format!("{name} served with Pebble's certificate through demo-svc:443"),
            Duration::from_secs(240),
            || {
                let (code, body) = curl(&[
                    "--cacert",
                    &root,
                    "--resolve",
                    &resolve,
                    &format!("https://{name}/"),
                ])
                .ok()?;
                (code == 200 && body == format!("{name}\n")).then_some(())
            },
        );
    }
    for pod in ns.ready_pods("demo", 3) {
        for name in names {
            wait_for(
                &format!(
                    "{name} served by {} with Pebble's certificate",
                    pod["metadata"]["name"]
                ),
                Duration::from_secs(240),
                || serves_tls(&root, name, &pod_ip(&pod), 8443).then_some(()),
            );
        }
    }
    assert_eq!(pods.len(), 3);
    // Port 80 of the Service carries the challenge (Pebble's validations
    // above) and ordinary HTTP, passed to the proxy; a challenge path never is.
    wait_for_answer(
        &format!("http://{ip}/"),
        names[0],
        &format!("{}\n", names[0]),
        Duration::from_secs(30),
    );
    let host = format!("Host: {}", names[0]);
    let (code, body) = curl(&[
        "-H",
        &host,
        &format!("http://{ip}/.well-known/acme-challenge/not-a-token"),
    ])
    .expect("curl");
    assert_eq!(code, 404, "an unknown token through port 80: {body}");
    // One certificate for the three names: exactly one issuance at the CA.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(issued(&c) - issued_before, 1, "certificates Pebble issued");
}
