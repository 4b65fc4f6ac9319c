//! The seed's manifests as written, `kubectl apply`-ed to the real cluster
//! that `scripts/cluster up` starts, under the cluster-scope operator that
//! `cluster_install` leaves installed (`scripts/test` runs that first).
//! Each test has a namespace of its own (the manifests' `namespace:
//! default` is the only thing changed) and checks what a user would check
//! with kubectl, curl and the sidecar's status.

mod cluster;

use std::time::{Duration, Instant};

use cluster::{
    ADMIN, Cluster, LEADER_LEASE, Namespace, OPERATOR_DEPLOYMENT, OPERATOR_NAMESPACE,
    acme_manifest, add_a, container_id, curl, dns01_manifest, dns01_txt, identities,
    invalid_authorizations, issued, kill_container, metric, mock_answer, pebble_root, pod_ip,
    serves_tls, sidecar_status, sidecar_status_forwarded, tls_verified, wait_every, wait_for,
    wait_for_answer,
};
use serde_json::json;

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

    let hashes = cluster::mesh_of(&pods, 3);
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
    let before = identities(&pods);
    let hash_before = ns.condition("demo", "Ready", "True", None)["status"]["configHash"].clone();
    for pod in &pods {
        let url = format!("http://{}:8080/", pod_ip(pod));
        wait_for_answer(
            &url,
            "demo.example.com",
            &mock_answer("hello\n"),
            Duration::from_secs(60),
        );
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
            &mock_answer("hello, edited\n"),
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
    // The operator told every pod of the new config (its annotation),
    // which is what makes the kubelet write it at once.
    for pod in ns.proxy_pods("demo") {
        assert_eq!(
            pod["metadata"]["annotations"]["sbproxy.dev/config-hash"], hash,
            "{}'s config-hash annotation",
            pod["metadata"]["name"]
        );
    }

    // Two more edits in quick succession: sampled every 100 ms, no proxy
    // ever answers an older config after a newer one.
    let bodies = ["hello, edited\n", "second edit\n", "third edit\n"];
    let second = edited.replace("body: \"hello, edited\\n\"", "body: \"second edit\\n\"");
    let third = second.replace("body: \"second edit\\n\"", "body: \"third edit\\n\"");
    assert!(
        second != edited && third != second,
        "the edits change the body"
    );
    c.apply(&second);
    std::thread::sleep(Duration::from_millis(300));
    c.apply(&third);
    let urls: Vec<String> = pods
        .iter()
        .map(|p| format!("http://{}:8080/", pod_ip(p)))
        .collect();
    let newest = bodies.len() - 1;
    let mut seen = vec![0usize; urls.len()];
    let deadline = Instant::now() + Duration::from_secs(180);
    while seen.iter().any(|&v| v < newest) {
        assert!(
            Instant::now() < deadline,
            "not every proxy answered the third edit within 180 s: {seen:?}"
        );
        for (k, url) in urls.iter().enumerate() {
            let Ok((200, got)) = curl(&["-H", "Host: demo.example.com", url]) else {
                continue;
            };
            let Some(v) = bodies.iter().position(|b| mock_answer(b) == got) else {
                panic!("{url} answered {got:?}, no config of this test");
            };
            assert!(
                v >= seen[k],
                "{url} went back from edit {} to edit {v}",
                seen[k]
            );
            seen[k] = v;
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    let after = identities(&ns.proxy_pods("demo"));
    assert_eq!(
        before, after,
        "the same pods (by UID), no container restarted"
    );
}

/// The guide's "dataplane ACME" seed: the proxy's own ACME on the shared
/// Redis the seed names.
///
/// As the guide writes it, sbproxy 1.13 does not start: its own ACME turns
/// TLS on, the seed sets no `proxy.https_bind_port`, and the proxy exits
/// with "https_bind_port must be set to use TLS" (which `sbproxy validate`
/// does not catch). The sidecar's log says so, naming the fix.
///
/// With `https_bind_port: 8443` added the seed runs: every pod Ready, each
/// proxy's own ACME on the Redis at the seed's name, serving TLS on 8443
/// (its fallback certificate: no CA is reachable from the cluster), the
/// block in the ConfigMap as written, and the sidecars order nothing.
#[test]
fn the_proxys_own_acme_block_is_left_to_the_proxy_and_the_sidecars_order_nothing() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    // The seed's storage_path, as the cluster's DNS answers it for a pod.
    let store = "redis.default.svc.cluster.local:6379";
    let (host, port) = store.split_once(':').expect("host:port");
    let redis = cluster::resolve(&c, host)
        .unwrap_or_else(|e| panic!("{host} at the cluster's DNS ({}): {e}", c.node_ip));
    let pong = cluster::redis_ping(&redis, port);
    assert_eq!(
        pong.as_deref(),
        Ok("PONG"),
        "Redis at {host} ({redis}:{port})"
    );

    // As written: the proxy exits at start-up, and the sidecar said why.
    let as_written = Namespace::new(&c, "e2e-acme-redis-seed", &[]);
    let seed = as_written.seed("acme-redis");
    assert!(seed.contains(&format!("storage_path: {store}")), "{seed}");
    assert!(!seed.contains("https_bind_port"), "{seed}");
    c.apply(&seed);
    let pod = wait_for(
        "a proxy container of the seed as written exited",
        Duration::from_secs(120),
        || {
            as_written.proxy_pods("demo").into_iter().find(|p| {
                p["status"]["containerStatuses"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|s| {
                        s["name"] == "proxy"
                            && (s["restartCount"].as_u64() > Some(0)
                                || !s["lastState"]["terminated"].is_null()
                                || !s["state"]["terminated"].is_null())
                    })
            })
        },
    );
    let name = pod["metadata"]["name"].as_str().expect("name").to_string();
    let exited = wait_for(
        &format!("{name}: the proxy's log of its exit"),
        Duration::from_secs(60),
        || {
            // The run that exited: the previous one once restarted.
            [&["--previous"][..], &[]].iter().find_map(|extra| {
                let mut args = vec!["logs", name.as_str(), "-c", "proxy"];
                args.extend_from_slice(extra);
                let log = as_written.kubectl(&args).ok()?;
                log.contains("https_bind_port must be set to use TLS")
                    .then_some(log)
            })
        },
    );
    assert!(exited.contains("Fatal"), "{exited}");
    let sidecar_log = as_written
        .kubectl(&["logs", &name, "-c", "sbmesh-sidecar"])
        .expect("the sidecar's log");
    assert!(
        sidecar_log.lines().any(|l| l.contains("proxy.acme.enabled")
            && l.contains("https_bind_port must be set to use TLS")
            && l.contains("set proxy.https_bind_port")),
        "{name}: the sidecar's log does not say why the proxy exits:\n{sidecar_log}"
    );
    drop(as_written);

    // With the port the seed lacks: the proxy's own ACME runs.
    let ns = Namespace::new(&c, "e2e-acme-redis", &[]);
    let seed = ns.seed("acme-redis");
    let fixed = seed.replace(
        "      http_bind_port: 8080\n",
        "      http_bind_port: 8080\n      https_bind_port: 8443\n",
    );
    assert_ne!(fixed, seed, "the seed's http_bind_port line moved");
    c.apply(&fixed);
    let pods = ns.ready_pods("demo", 2);
    ns.condition("demo", "Ready", "True", None);
    // The proxy's config is the user's, its acme block as written.
    let config = ns
        .get(&["configmap", "demo-config"])
        .expect("ConfigMap demo-config")["data"]["sb.yml"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        config.contains("  acme:\n    enabled: true\n") && config.contains(store),
        "the proxy's acme block in the ConfigMap it mounts:\n{config}"
    );
    for pod in &pods {
        let name = pod["metadata"]["name"].as_str().expect("name");
        let ip = pod_ip(pod);
        // The proxy's own ACME: its store on the seed's Redis, an order for
        // the seed's origin, and TLS on 8443 meanwhile.
        let log = wait_for(
            &format!("{name}: the proxy's ACME on its Redis store"),
            Duration::from_secs(60),
            || {
                let log = ns.kubectl(&["logs", name, "-c", "proxy"]).ok()?;
                (log.contains("cert store backend: redis")
                    && log.contains("issuing via ACME")
                    && log.contains("api.example.com"))
                .then_some(log)
            },
        );
        assert!(!log.contains("redis get failed"), "{name}: {log}");
        let (code, _) = curl(&[
            "-k",
            "--resolve",
            &format!("api.example.com:8443:{ip}"),
            "https://api.example.com:8443/.well-known/sbmesh-e2e",
        ])
        .unwrap_or_else(|e| panic!("{name}: TLS on 8443: {e}"));
        assert_ne!(code, 0, "{name}: no HTTP answer over TLS on 8443");

        let status = sidecar_status_forwarded(&c, &ns.name, name);
        assert_eq!(status["local_node_id"], name, "{status}");
        let local = status["nodes"]
            .as_array()
            .and_then(|nodes| nodes.iter().find(|n| n["local"] == true))
            .unwrap_or_else(|| panic!("{name}: no local node in {status}"));
        assert_eq!(local["certificates"], json!([]), "{name}: {status}");
        for result in ["issued", "failed", "skipped"] {
            let sample = format!("acme_orders_total{{result=\"{result}\"}}");
            assert_eq!(metric(&ip, &sample), Some(0.0), "{name} ({ip}): {sample}");
        }
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
    // The namespace enforces: a pod that breaks the standard (no security
    // context: it may run as root, escalate and keep every capability) is
    // refused, with the admission's message.
    let unrestricted = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: not-restricted, namespace: {}}}\n\
         spec:\n  containers:\n  - name: c\n    image: soapbucket/sbproxy:1.13.0\n    \
         imagePullPolicy: Never\n",
        ns.name
    );
    let refused = c
        .kubectl_with(&["apply", "-f", "-"], Some(&unrestricted))
        .expect_err("a pod without a security context admitted where restricted is enforced");
    assert!(
        refused.contains("violates PodSecurity \"restricted:latest\"")
            && refused.contains("runAsNonRoot != true"),
        "{refused}"
    );
    assert!(ns.get(&["pod", "not-restricted"]).is_none());

    c.apply(&ns.seed("clustered"));
    // A refused pod never exists; the StatefulSet's events say why.
    wait_for(
        "3 Ready pods under restricted",
        Duration::from_secs(240),
        || {
            let events = ns.refused_creations();
            assert!(events.is_empty(), "pods refused under restricted: {events}");
            let pods = ns.proxy_pods("demo");
            (pods.len() == 3 && pods.iter().all(cluster::pod_ready)).then_some(())
        },
    );
    cluster::mesh_of(&ns.proxy_pods("demo"), 3);
}

/// The Lease's holder and its renewTime.
fn lease(c: &Cluster) -> Option<(String, String)> {
    let lease = c.get(&["-n", OPERATOR_NAMESPACE, "lease", LEADER_LEASE])?;
    Some((
        lease["spec"]["holderIdentity"]
            .as_str()
            .unwrap_or("")
            .to_string(),
        lease["spec"]["renewTime"]
            .as_str()
            .unwrap_or("")
            .to_string(),
    ))
}

/// The ConfigMap `demo-config` of `ns` carries `text`.
fn config_has(ns: &Namespace, text: &str) -> bool {
    ns.get(&["configmap", "demo-config"])
        .and_then(|cm| cm["data"]["sb.yml"].as_str().map(|t| t.contains(text)))
        .unwrap_or(false)
}

/// Two hand-offs of the operator's Lease, each with an SBProxy edit that
/// only the new leader can apply:
///
/// 1. The leader's pod deleted (SIGTERM): it releases the Lease as it
///    stops. The edit is made once that pod is gone.
/// 2. The leader frozen through the runtime (a hung process, a partitioned
///    node: it can neither renew nor release), then killed with SIGKILL:
///    the Lease must expire. The edit is made at once and lands while no
///    operator leads; nothing applies it until the standby holds the
///    Lease. (SIGKILL alone restarts the container in place, under the
///    same identity, which takes its own Lease back at once.)
#[test]
fn the_standby_takes_the_lease_released_or_expired_and_applies_an_edit_made_meanwhile() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(&c, "e2e-leader", &[]);
    let manifest = ns.seed("demo");
    c.apply(&manifest);
    ns.condition("demo", "Ready", "True", None);

    // 1. Released.
    let (leader, _) = lease(&c).expect("the Lease");
    let start = Instant::now();
    c.must(&[
        "-n",
        OPERATOR_NAMESPACE,
        "delete",
        "pod",
        &leader,
        "--wait=false",
    ]);
    let next = wait_every(
        "a new Lease holder after the leader's pod was deleted",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || lease(&c).filter(|(h, _)| h != &leader && !h.is_empty()),
    )
    .0;
    eprintln!(
        "released: {next} holds the Lease {:.1} s after the delete of {leader}",
        start.elapsed().as_secs_f64()
    );
    wait_for(
        &format!("pod {leader} gone"),
        Duration::from_secs(90),
        || {
            c.get(&["-n", OPERATOR_NAMESPACE, "pod", &leader])
                .is_none()
                .then_some(())
        },
    );
    let edited = manifest.replace("hello from sbproxy", "hello after the release");
    assert_ne!(edited, manifest);
    let edit = Instant::now();
    c.apply(&edited);
    wait_for(
        "the edit made after the release in the ConfigMap",
        Duration::from_secs(60),
        || config_has(&ns, "hello after the release").then_some(()),
    );
    eprintln!(
        "released: edit applied {:.1} s after it was made",
        edit.elapsed().as_secs_f64()
    );

    // 2. Expired: both replicas back, then the leader frozen and killed.
    c.operator();
    let (leader, _) = lease(&c).expect("the Lease");
    let pod = c
        .get(&["-n", OPERATOR_NAMESPACE, "pod", &leader])
        .unwrap_or_else(|| panic!("the leader's pod {leader}"));
    let id = container_id(&pod, OPERATOR_DEPLOYMENT);
    let start = Instant::now();
    cluster::pause_container(&c, &id);
    let edited = manifest.replace("hello from sbproxy", "hello after the expiry");
    c.apply(&edited);
    // A renewal already on the wire when it froze may still land.
    std::thread::sleep(Duration::from_secs(1));
    let (holder, renewed) = lease(&c).expect("the Lease");
    assert_eq!(holder, leader, "the Lease moved within 1 s of the freeze");
    let next = wait_every(
        "a new Lease holder after the leader froze",
        Duration::from_secs(90),
        Duration::from_millis(200),
        || {
            let (holder, renew) = lease(&c)?;
            if holder == leader {
                // No renewal and no release by the frozen leader, and
                // nothing applied the edit while no one led.
                assert_eq!(
                    renew, renewed,
                    "the frozen leader {leader} renewed the Lease"
                );
                assert!(
                    !config_has(&ns, "hello after the expiry"),
                    "the edit was applied while {leader} was frozen and held the Lease"
                );
                return None;
            }
            assert!(
                !holder.is_empty(),
                "the Lease was released while its leader {leader} was frozen"
            );
            Some(holder)
        },
    );
    let handoff = start.elapsed().as_secs_f64();
    kill_container(&c, &id);
    cluster::resume_container(&c, &id);
    wait_for(
        "the edit made while no operator led in the ConfigMap",
        Duration::from_secs(60),
        || config_has(&ns, "hello after the expiry").then_some(()),
    );
    eprintln!(
        "expired: {next} holds the Lease {handoff:.1} s after {leader} froze; the edit applied \
         {:.1} s after it was made",
        start.elapsed().as_secs_f64()
    );
    // The killed leader's pod comes back and follows.
    c.operator();
    let (holder, _) = lease(&c).expect("the Lease");
    assert_eq!(holder, next, "the new leader keeps the Lease");
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
    // A Pebble of its own: the certificates and failed validations it
    // counts are this test's alone.
    let (c, _pebble) = c.with_own_pebble(None);
    let ns = Namespace::new(&c, "e2e-acme", &[]);
    let names = ["a.e2e.test", "b.e2e.test", "c.e2e.test"];
    let issued_before = issued(&c);
    let invalid_before = invalid_authorizations(&c);
    c.apply(&acme_manifest(&c, &ns.name, &names, 1));
    // Pebble resolves each name to the Service, as a public DNS record
    // would point at a LoadBalancer in front of it.
    let ip = ns.wait_cluster_ip("demo-svc");
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
    // A fresh deploy's Service has no ready endpoint for its first
    // seconds: the order waited for one instead of failing at the CA.
    assert_eq!(
        invalid_authorizations(&c) - invalid_before,
        0,
        "validations Pebble failed"
    );
}

/// DNS-01 on the real cluster: a wildcard origin and its apex, ordered by
/// 3 replicas from the cluster's BIND (`rfc2136`, the TSIG secret from a
/// Secret through `sidecarEnv`), validated by Pebble through the zone's
/// authoritative server, never through the pods. One replica writes the
/// TXT records and removes them; Pebble issues one certificate; every
/// proxy serves it for the apex and for any name under it.
#[test]
fn a_wildcard_is_issued_over_dns01_once_and_every_proxy_serves_it() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let (c, _pebble) = c.with_own_pebble(None);
    let ns = Namespace::new(&c, "e2e-dns01", &[]);
    // A name of this run's own: BIND outlives the namespace, and a record
    // a failed run left must not be taken for this run's.
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis();
    let apex = format!("r{run:x}.{}.{}", ns.name, c.dns01_zone);
    let wildcard = format!("*.{apex}");
    let issued_before = issued(&c);
    let invalid_before = invalid_authorizations(&c);
    let applied = Instant::now();
    c.apply(&dns01_manifest(&c, &ns.name, &[&wildcard, &apex], 2));
    let root = pebble_root(&c);
    let pods = ns.ready_pods("demo", 3);
    let names = [format!("www.{apex}"), format!("api.{apex}"), apex.clone()];
    for pod in &pods {
        for name in &names {
            wait_for(
                &format!(
                    "{name} served by {} with Pebble's certificate",
                    pod["metadata"]["name"]
                ),
                Duration::from_secs(240),
                || tls_verified(&root, name, &pod_ip(pod), 8443).then_some(()),
            );
        }
    }
    eprintln!(
        "every proxy serves the wildcard and the apex {:.1} s after the apply",
        applied.elapsed().as_secs_f64()
    );
    // The records are gone once the CA is done.
    let challenge = format!("_acme-challenge.{apex}");
    wait_for(
        &format!("BIND serving no TXT at {challenge}"),
        Duration::from_secs(30),
        || dns01_txt(&c, &challenge).is_empty().then_some(()),
    );
    // One writer: the replica that held the order wrote both values (the
    // wildcard's and the apex's, one name) and removed both.
    let count = |op: &str| -> Vec<f64> {
        let sample =
            format!("acme_dns_updates_total{{provider=\"rfc2136\",op=\"{op}\",result=\"ok\"}}");
        pods.iter()
            .map(|p| metric(&pod_ip(p), &sample).unwrap_or(0.0))
            .collect()
    };
    let (presents, cleanups) = (count("present"), count("cleanup"));
    assert_eq!(
        presents.iter().filter(|n| **n > 0.0).count(),
        1,
        "replicas that wrote a TXT record: {presents:?}"
    );
    assert_eq!(presents.iter().sum::<f64>(), 2.0, "TXT records written");
    assert_eq!(cleanups, presents, "each writer removed what it wrote");
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(issued(&c) - issued_before, 1, "certificates Pebble issued");
    assert_eq!(
        invalid_authorizations(&c) - invalid_before,
        0,
        "validations Pebble failed"
    );
}

/// The Service in front of the replicas sends the CA's request nowhere
/// (its selector matches no pod): the order waits, saying why in every
/// sidecar's status and in `sbmesh_acme_orders_waiting`, and the CA hears
/// nothing (no order, no failed validation); once the Service is fixed,
/// the order completes and every proxy serves the certificate.
///
/// The operator is stopped meanwhile: it would put the selector back
/// within a second. Starting it again is the fix.
#[test]
fn an_unanswered_challenge_waits_with_a_reason_and_completes_once_the_service_is_fixed() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(&c, "e2e-acme-wait", &[]);
    let name = "w.e2e.test";
    let issued_before = issued(&c);
    let invalid_before = invalid_authorizations(&c);
    c.apply(&acme_manifest(&c, &ns.name, &[name], 3));
    let ip = ns.wait_cluster_ip("demo-svc");
    add_a(&c, name, &ip);
    let stopped = c.operator_stopped();
    c.kubectl(&[
        "-n",
        &ns.name,
        "patch",
        "service",
        "demo-svc",
        "--type=merge",
        "-p",
        r#"{"spec":{"selector":{"app.kubernetes.io/instance":"nowhere"}}}"#,
    ])
    .expect("the Service's selector pointed nowhere");
    let pods = ns.ready_pods("demo", 3);
    let check_url = format!("http://demo-svc.{}.svc.cluster.local:80", ns.name);
    let (waiting_ip, reason) = wait_for(
        "a sidecar's status saying why the order waits",
        Duration::from_secs(120),
        || {
            pods.iter().find_map(|p| {
                let s = sidecar_status(&pod_ip(p), ADMIN)?;
                let local = s["nodes"].as_array()?.iter().find(|n| n["local"] == true)?;
                let waiting = local["acme"]["waiting"].as_array()?.first()?.clone();
                Some((pod_ip(p), waiting))
            })
        },
    );
    assert_eq!(reason["host"], name, "{reason}");
    let text = reason["reason"].as_str().unwrap_or_default();
    assert!(
        text.contains(&format!(
            "the challenge for {name} is not answered at {check_url}"
        )),
        "{reason}"
    );
    assert_eq!(
        metric(&waiting_ip, "sbmesh_acme_orders_waiting"),
        Some(1.0),
        "the waiting sidecar's gauge"
    );
    assert!(
        metric(
            &waiting_ip,
            "sbmesh_acme_challenge_checks_total{result=\"unreachable\"}"
        )
        .is_some_and(|n| n >= 1.0),
        "the unreachable checks counted"
    );
    // Still waiting a while later, and the CA heard of nothing.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(issued(&c), issued_before, "certificates Pebble issued");
    assert_eq!(
        invalid_authorizations(&c),
        invalid_before,
        "validations Pebble failed"
    );

    // The operator puts its selector back: the order goes through.
    drop(stopped);
    let root = pebble_root(&c);
    for pod in ns.ready_pods("demo", 3) {
        wait_for(
            &format!(
                "{name} served by {} with Pebble's certificate",
                pod["metadata"]["name"]
            ),
            Duration::from_secs(240),
            || serves_tls(&root, name, &pod_ip(&pod), 8443).then_some(()),
        );
    }
    assert_eq!(issued(&c) - issued_before, 1, "certificates Pebble issued");
    assert_eq!(
        invalid_authorizations(&c),
        invalid_before,
        "validations Pebble failed"
    );
    wait_for(
        "no order waiting in any status",
        Duration::from_secs(60),
        || {
            ns.ready_pods("demo", 3)
                .iter()
                .all(|p| {
                    sidecar_status(&pod_ip(p), ADMIN).is_some_and(|s| {
                        s["nodes"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .all(|n| n["acme"]["waiting"].is_null())
                    })
                })
                .then_some(())
        },
    );
}

/// A StatefulSet of the user's own, given the sidecar by `inject`: an edit
/// of the ConfigMap it reads reaches every proxy without a restart, and the
/// operator told each pod of the ConfigMap's new version (the pod update
/// that makes its kubelet write the volume at once, not at its next
/// periodic sync).
#[test]
fn an_edit_of_an_injected_workloads_configmap_reaches_its_pods_through_the_operator() {
    let Some(c) = Cluster::from_env() else { return };
    c.operator();
    let ns = Namespace::new(&c, "e2e-inject", &[]);
    let config_map = |body: &str| cluster::edge_config(&ns.name, body);
    let workload = format!(
        r#"apiVersion: apps/v1
kind: StatefulSet
metadata: {{ name: edge, namespace: {ns} }}
spec:
  replicas: 2
  serviceName: edge-mesh
  selector:
    matchLabels: {{ app: edge }}
  template:
    metadata:
      labels: {{ app: edge }}
    spec:
      securityContext: {{ runAsNonRoot: true, runAsUser: 65532, runAsGroup: 65532, fsGroup: 65532 }}
      containers:
      - name: proxy
        image: soapbucket/sbproxy:1.13.0
        ports:
        - {{ name: http, containerPort: 8080 }}
        volumeMounts:
        - {{ name: config, mountPath: /etc/sbproxy, readOnly: true }}
      volumes:
      - name: config
        configMap: {{ name: edge-config }}
"#,
        ns = ns.name
    );
    let file = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-inject.yaml");
    std::fs::write(&file, workload).expect("writing the workload");
    let injected = cluster::operator(&["inject", "-f", &file.display().to_string()]);
    let _ = std::fs::remove_file(&file);
    assert!(
        injected.contains("sbproxy.dev/config-map: edge-config"),
        "inject labels the pods with their ConfigMap:\n{injected}"
    );
    c.apply(&config_map("v1"));
    c.apply(&injected);
    let pods = ns.ready("app=edge", "the StatefulSet edge", 2);
    let before = identities(&pods);
    let urls: Vec<String> = pods
        .iter()
        .map(|p| format!("http://{}:8080/", pod_ip(p)))
        .collect();
    for url in &urls {
        wait_for_answer(url, "edge.example.com", "v1\n", Duration::from_secs(60));
    }

    let start = Instant::now();
    c.apply(&config_map("v2"));
    for url in &urls {
        wait_for_answer(url, "edge.example.com", "v2\n", Duration::from_secs(180));
    }
    eprintln!(
        "ConfigMap edit -> every injected proxy: {:.1} s",
        start.elapsed().as_secs_f64()
    );
    let version = ns
        .get(&["configmap", "edge-config"])
        .and_then(|m| {
            m["metadata"]["resourceVersion"]
                .as_str()
                .map(str::to_string)
        })
        .expect("the ConfigMap's resourceVersion");
    wait_for(
        "every injected pod annotated with the ConfigMap's new version",
        Duration::from_secs(30),
        || {
            let pods = ns.pods("app=edge");
            (pods.len() == 2
                && pods.iter().all(|p| {
                    p["metadata"]["annotations"]["sbproxy.dev/config-map-version"]
                        == version.as_str()
                }))
            .then_some(())
        },
    );
    let after = identities(&ns.pods("app=edge"));
    assert_eq!(
        before, after,
        "the same pods (by UID), no container restarted"
    );
}

/// The sidecar's image the cluster runs is the one the Dockerfile states
/// (issue 54, "what is tested is what ships"): read back from the
/// cluster's containerd, its user, entrypoint, command and exposed ports
/// are the Dockerfile's last stage's, and every file it copies is there
/// with the owner it gives (the binaries, `/var/lib/sbproxy` and the
/// folders the builder makes under it, writable by 65532).
#[test]
fn the_sidecar_image_is_what_the_dockerfile_states() {
    let Some(c) = Cluster::from_env() else { return };
    let dockerfile = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../Dockerfile");
    let want = cluster::image::stated(&dockerfile);
    assert!(
        want.files.len() >= 4 && !want.entrypoint.is_empty() && !want.user.is_empty(),
        "the Dockerfile's last stage read as {want:?}"
    );
    let got = cluster::image::imported(&c, &c.sbmesh_image, &want);
    assert_eq!(
        got, want,
        "the image {} against the Dockerfile",
        c.sbmesh_image
    );
    eprintln!("{}: {want:?}", c.sbmesh_image);
}
