//! What `render` makes of an SBProxy: golden files for four scenarios, and
//! the properties that keep a fleet calm (scaling and config edits touch
//! only what they must).
//!
//! Regenerate the golden files after an intended change with
//! `UPDATE_GOLDEN=1 cargo test -p sbmesh-operator --test render_golden`,
//! then read the diff.

mod render_fixtures;
#[allow(clippy::duplicate_mod)]
#[path = "../../tests/required/mod.rs"]
mod required;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Container, EnvVar, Secret};
use render_fixtures as fx;
use sbmesh_operator::render::{self, Rendered};
use serde_json::Value;

#[test]
fn golden_scenarios() {
    // Only `UPDATE_GOLDEN=1` rewrites, and never under CI, where the files
    // are what is checked.
    let update = std::env::var("UPDATE_GOLDEN").as_deref() == Ok("1");
    assert!(
        !(update && required::in_ci()),
        "UPDATE_GOLDEN=1 under CI would rewrite the golden files instead of checking them"
    );
    let mut stale = Vec::new();
    for name in fx::SCENARIOS {
        let path = fx::golden_dir().join(format!("{name}.yaml"));
        let actual = fx::render_scenario(name).objects_yaml();
        if update {
            std::fs::write(&path, &actual).expect("write golden file");
            continue;
        }
        let expected = std::fs::read_to_string(&path).unwrap_or_default();
        if expected != actual {
            stale.push(format!(
                "{}\n--- expected\n{expected}\n--- actual\n{actual}",
                path.display()
            ));
        }
    }
    assert!(
        stale.is_empty(),
        "rendered objects differ from the golden files; if the change is intended, run \
         `UPDATE_GOLDEN=1 cargo test -p sbmesh-operator --test render_golden` and review the diff:\n{}",
        stale.join("\n")
    );
}

fn sidecar(r: &Rendered) -> Container {
    let pod = r
        .stateful_set
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    let init = pod.init_containers.as_ref().expect("initContainers");
    assert_eq!(init.len(), 1);
    init[0].clone()
}

fn proxy_container(r: &Rendered) -> Container {
    let pod = r
        .stateful_set
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    assert_eq!(pod.containers.len(), 1);
    pod.containers[0].clone()
}

fn env<'a>(c: &'a Container, name: &str) -> Option<&'a EnvVar> {
    c.env.as_ref().unwrap().iter().find(|e| e.name == name)
}

fn env_value(c: &Container, name: &str) -> Option<String> {
    env(c, name).and_then(|e| e.value.clone())
}

fn secret_ref(c: &Container, name: &str) -> Option<(String, String)> {
    let r = env(c, name)?.value_from.as_ref()?.secret_key_ref.as_ref()?;
    Some((r.name.clone(), r.key.clone()))
}

/// The Secret (name, key) the sidecar's key ring comes from: mounted as a
/// directory in the sidecar alone, read with `--cluster-key-file`. No
/// `subPath` (the kubelet would not update it) and no environment variable
/// (an env value never changes in a running pod).
fn key_ring_secret(r: &Rendered) -> Option<(String, String)> {
    let pod = r.stateful_set.spec.as_ref()?.template.spec.as_ref()?;
    let side = sidecar(r);
    assert!(env(&side, "SBMESH_CLUSTER_KEY").is_none());
    assert_eq!(
        env_value(&side, "SBMESH_CLUSTER_KEY_FILE")?,
        render::cluster_key_file()
    );
    let mount = side
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == render::CLUSTER_KEY_VOLUME)?;
    assert_eq!(mount.mount_path, render::CLUSTER_KEY_DIR);
    assert_eq!(mount.read_only, Some(true));
    assert_eq!(mount.sub_path, None);
    assert!(
        pod.containers
            .iter()
            .flat_map(|c| c.volume_mounts.iter().flatten())
            .all(|m| m.name != render::CLUSTER_KEY_VOLUME),
        "the proxy does not get the key"
    );
    let secret = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == render::CLUSTER_KEY_VOLUME)?
        .secret
        .as_ref()?;
    let items = secret.items.as_ref()?;
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].path, render::CLUSTER_KEY_KEY);
    Some((secret.secret_name.clone()?, items[0].key.clone()))
}

fn field_ref(c: &Container, name: &str) -> Option<String> {
    Some(
        env(c, name)?
            .value_from
            .as_ref()?
            .field_ref
            .as_ref()?
            .field_path
            .clone(),
    )
}

#[test]
fn objects_are_named_labelled_and_owned_as_the_spec_says() {
    let r = fx::render_scenario("three-replicas-clustered");
    let objects = r.objects();
    let names: Vec<(&str, &str)> = objects
        .iter()
        .map(|o| {
            (
                o["kind"].as_str().unwrap(),
                o["metadata"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            ("ConfigMap", "demo-config"),
            ("Secret", "demo-cluster-key"),
            ("Service", "demo-mesh"),
            ("Service", "demo-svc"),
            ("StatefulSet", "demo-proxy"),
            ("PodDisruptionBudget", "demo-pdb"),
        ]
    );
    for o in &objects {
        let kind = o["kind"].as_str().unwrap();
        assert_eq!(o["metadata"]["namespace"], "default", "{kind}");
        let labels = &o["metadata"]["labels"];
        assert_eq!(labels["app.kubernetes.io/name"], "sbproxy", "{kind}");
        assert_eq!(labels["app.kubernetes.io/instance"], "demo", "{kind}");
        assert_eq!(
            labels["app.kubernetes.io/managed-by"], "sbmesh-operator",
            "{kind}"
        );
        let owners = &o["metadata"]["ownerReferences"];
        if kind == "Secret" {
            assert!(
                owners.is_null(),
                "the Secret outlives the SBProxy: {owners}"
            );
        } else {
            assert_eq!(
                owners,
                &serde_json::json!([{
                    "apiVersion": "sbproxy.dev/v1alpha1", "kind": "SBProxy", "name": "demo",
                    "uid": fx::UID, "controller": true, "blockOwnerDeletion": true,
                }]),
                "{kind}"
            );
        }
    }
    assert_eq!(
        r.config_map
            .data
            .as_ref()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["sb.yml"]
    );
}

#[test]
fn without_a_uid_no_owner_reference_is_invented() {
    let (mut proxy, config) = fx::scenario("three-replicas-clustered");
    proxy.metadata.uid = None;
    let r = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    assert!(
        r.objects()
            .iter()
            .all(|o| o["metadata"]["ownerReferences"].is_null())
    );
}

#[test]
fn statefulset_and_services_follow_the_spec() {
    let r = fx::render_scenario("three-replicas-clustered");
    let sts = r.stateful_set.spec.as_ref().unwrap();
    assert_eq!(sts.replicas, Some(3));
    assert_eq!(sts.service_name.as_deref(), Some("demo-mesh"));
    assert_eq!(sts.pod_management_policy.as_deref(), Some("OrderedReady"));
    assert_eq!(
        sts.update_strategy.as_ref().unwrap().type_.as_deref(),
        Some("RollingUpdate")
    );
    let selector = sts.selector.match_labels.as_ref().unwrap();
    assert_eq!(selector.len(), 2);
    assert_eq!(selector["app.kubernetes.io/instance"], "demo");
    assert!(
        sts.template
            .metadata
            .as_ref()
            .unwrap()
            .annotations
            .is_none()
    );

    let side = sidecar(&r);
    assert_eq!(side.name, "sbmesh-sidecar");
    assert_eq!(
        side.restart_policy.as_deref(),
        Some("Always"),
        "a native sidecar"
    );
    assert_eq!(side.image.as_deref(), Some(fx::SIDECAR_IMAGE));
    assert_eq!(side.args.as_deref(), Some(&["run".to_string()][..]));
    let readiness = side
        .readiness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(readiness.path.as_deref(), Some("/readyz"));
    let liveness = side
        .liveness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(liveness.path.as_deref(), Some("/healthz"));
    assert_eq!(
        field_ref(&side, "SBPROXY_POD_NAME").as_deref(),
        Some("metadata.name")
    );
    assert_eq!(
        field_ref(&side, "SBPROXY_POD_IP").as_deref(),
        Some("status.podIP")
    );
    assert_eq!(
        field_ref(&side, "SBMESH_NAMESPACE").as_deref(),
        Some("metadata.namespace")
    );
    for (name, value) in [
        ("SBMESH_CLUSTER_ID", "demo"),
        ("SBMESH_MESH_SERVICE", "demo-mesh"),
        ("SBMESH_CLUSTER_DOMAIN", "cluster.local"),
        ("SBMESH_GOSSIP_PORT", "7946"),
        ("SBMESH_TRANSPORT_PORT", "8946"),
        ("SBMESH_ADMIN_LISTEN", "0.0.0.0:9091"),
        ("SBMESH_CHALLENGE_LISTEN", "0.0.0.0:8089"),
        (
            "SBMESH_PROXY_RELOAD_URL",
            "http://127.0.0.1:9090/admin/reload",
        ),
        ("SBMESH_CERT_DIR", "/var/lib/sbproxy/certs"),
        ("SBMESH_STATE_DIR", "/var/lib/sbproxy/sidecar"),
        ("SBMESH_CONFIG", "/etc/sbproxy/sb.yml"),
    ] {
        assert_eq!(env_value(&side, name).as_deref(), Some(value), "{name}");
    }
    assert_eq!(
        key_ring_secret(&r),
        Some(("demo-cluster-key".into(), "cluster-key".into()))
    );
    let sc = side.security_context.as_ref().unwrap();
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.run_as_user, Some(65532));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref(),
        Some(&["ALL".to_string()][..])
    );

    let proxy = proxy_container(&r);
    assert_eq!(
        proxy.image.as_deref(),
        Some("ghcr.io/sbproxy/sbproxy:1.4.0")
    );
    let ready = proxy
        .readiness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(ready.path.as_deref(), Some("/health"));
    let http = &proxy.ports.as_ref().unwrap()[0];
    assert_eq!(
        (http.name.as_deref(), http.container_port),
        (Some("http"), 8080)
    );
    for c in [&side, &proxy] {
        let mounts: Vec<(&str, &str, Option<bool>)> = c
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .map(|m| (m.name.as_str(), m.mount_path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            mounts[..2],
            [
                ("sbproxy-config", "/etc/sbproxy", Some(true)),
                ("sbproxy-data", "/var/lib/sbproxy", None)
            ],
            "{}",
            c.name
        );
    }
    let volumes = sts
        .template
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .as_ref()
        .unwrap();
    assert_eq!(volumes[0].config_map.as_ref().unwrap().name, "demo-config");
    assert!(volumes[1].empty_dir.is_some());

    let mesh = r.headless_service.spec.as_ref().unwrap();
    assert_eq!(mesh.cluster_ip.as_deref(), Some("None"));
    assert_eq!(mesh.publish_not_ready_addresses, Some(true));
    let ports: Vec<(&str, &str, i32)> = mesh
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p.name.as_deref().unwrap(),
                p.protocol.as_deref().unwrap(),
                p.port,
            )
        })
        .collect();
    assert_eq!(ports, [("gossip", "UDP", 7946), ("transport", "TCP", 8946)]);
    let svc = r.service.spec.as_ref().unwrap();
    let ports: Vec<(&str, i32, Value)> = svc
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p.name.as_deref().unwrap(),
                p.port,
                serde_json::to_value(&p.target_port).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        ports,
        [("http", 8080, "http".into()), ("acme", 80, "acme".into())]
    );
    // `acme` is the sidecar's challenge port.
    let acme = side
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.name.as_deref() == Some("acme"));
    assert_eq!(acme.unwrap().container_port, 8089);

    let pdb = r.pdb.as_ref().unwrap().spec.as_ref().unwrap();
    assert_eq!(serde_json::to_value(&pdb.max_unavailable).unwrap(), 1);
    assert!(r.config_hash.starts_with("sha256:"));
}

#[test]
fn one_replica_unclustered_has_no_mesh_no_secret_and_no_pdb() {
    let r = fx::render_scenario("one-replica-unclustered");
    assert!(r.pdb.is_none());
    assert!(r.cluster_key_secret.is_none());
    let side = sidecar(&r);
    for name in [
        "SBMESH_MESH_SERVICE",
        "SBMESH_CLUSTER_KEY",
        "SBMESH_CLUSTER_KEY_FILE",
        "SBMESH_GOSSIP_PORT",
        "SBMESH_PROXY_AUTHORIZATION",
    ] {
        assert!(env(&side, name).is_none(), "{name}");
    }
    assert_eq!(
        env_value(&side, "SBMESH_CLUSTER_ID").as_deref(),
        Some("solo")
    );
    // The headless Service is still there: the StatefulSet's serviceName needs it.
    assert_eq!(
        r.headless_service.metadata.name.as_deref(),
        Some("solo-mesh")
    );
    assert_eq!(r.stateful_set.spec.as_ref().unwrap().replicas, Some(1));
}

#[test]
fn a_user_secret_is_referenced_and_none_is_created() {
    let r = fx::render_scenario("byo-secret");
    assert!(r.cluster_key_secret.is_none());
    let side = sidecar(&r);
    assert_eq!(
        key_ring_secret(&r),
        Some(("edge-mesh-key".into(), "ring".into()))
    );
    assert_eq!(
        env_value(&side, "SBMESH_CLUSTER_DOMAIN").as_deref(),
        Some("k8s.example.internal")
    );
    assert_eq!(
        env_value(&side, "SBMESH_GOSSIP_PORT").as_deref(),
        Some("17946")
    );
    assert_eq!(
        env_value(&side, "SBMESH_PROXY_RELOAD_URL").as_deref(),
        Some("http://127.0.0.1:9190/admin/reload")
    );
    assert!(
        r.objects()
            .iter()
            .all(|o| o["metadata"]["namespace"] == "edge")
    );
}

#[test]
fn the_generated_secret_holds_the_key_and_is_rendered_only_when_absent() {
    let (proxy, config) = fx::scenario("three-replicas-clustered");
    let r = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    let secret = r.cluster_key_secret.expect("a Secret to create");
    assert_eq!(secret.metadata.name.as_deref(), Some("demo-cluster-key"));
    assert_eq!(render::cluster_key_secret_name(&proxy), "demo-cluster-key");
    assert_eq!(
        secret.data.as_ref().unwrap()["cluster-key"],
        ByteString(fx::KEY.as_bytes().to_vec())
    );

    // It exists: referenced, never rendered again (never overwritten).
    let existing = Secret {
        metadata: secret.metadata.clone(),
        ..Secret::default()
    };
    let again = render::render(&proxy, Some(&config), Some(&existing), &fx::opts()).unwrap();
    assert!(again.cluster_key_secret.is_none());
    assert_eq!(again.stateful_set, r.stateful_set);
}

#[test]
fn fresh_cluster_keys_are_64_hex_chars_and_differ() {
    let a = render::fresh_cluster_key();
    let b = render::fresh_cluster_key();
    assert_eq!(a.len(), 64);
    assert!(
        a.chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    );
    assert_ne!(a, b);
}

#[test]
fn reload_authorization_and_pinned_sidecar_image_come_from_the_spec() {
    let r = fx::render_scenario("acme-redis");
    let side = sidecar(&r);
    assert_eq!(
        side.image.as_deref(),
        Some("ghcr.io/sbproxy/sbmesh:0.1.0-pinned")
    );
    assert_eq!(
        secret_ref(&side, "SBMESH_PROXY_AUTHORIZATION"),
        Some(("shop-admin".into(), "authorization".into()))
    );
    assert_eq!(
        env_value(&side, "SBMESH_ADMIN_LISTEN").as_deref(),
        Some("0.0.0.0:9191")
    );
    let svc_ports = r.service.spec.as_ref().unwrap().ports.clone().unwrap();
    assert_eq!(svc_ports[1].port, 80);
    let acme = side
        .ports
        .as_ref()
        .unwrap()
        .iter()
        .find(|p| p.name.as_deref() == Some("acme"));
    assert_eq!(acme.unwrap().container_port, 8189);
    let limits = side.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert_eq!(limits["memory"].0, "384Mi");
}

/// Everything but `path` in `a` and `b` is equal; returns both values at `path`.
fn differ_only_at(a: &Value, b: &Value, path: &str) -> (Value, Value) {
    let mut a = a.clone();
    let mut b = b.clone();
    let va = a.pointer_mut(path).map(Value::take).unwrap_or(Value::Null);
    let vb = b.pointer_mut(path).map(Value::take).unwrap_or(Value::Null);
    assert_eq!(a, b, "objects differ outside {path}");
    (va, vb)
}

#[test]
fn scaling_changes_only_the_statefulset_replicas() {
    let (mut proxy, config) = fx::scenario("three-replicas-clustered");
    let three = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    proxy.spec.replicas = 5;
    let five = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();

    let (a, b) = differ_only_at(
        &serde_json::to_value(&three.stateful_set).unwrap(),
        &serde_json::to_value(&five.stateful_set).unwrap(),
        "/spec/replicas",
    );
    assert_eq!((a, b), (3.into(), 5.into()));
    // The pod template, structurally: no pod restarts.
    assert_eq!(
        three.stateful_set.spec.as_ref().unwrap().template,
        five.stateful_set.spec.as_ref().unwrap().template
    );
    assert_eq!(three.pdb, five.pdb);
    assert!(five.pdb.is_some());
    assert_eq!(three.config_map, five.config_map);
    assert_eq!(three.service, five.service);
    assert_eq!(three.headless_service, five.headless_service);
    assert_eq!(three.cluster_key_secret, five.cluster_key_secret);
    assert_eq!(three.config_hash, five.config_hash);

    // Down to one: the PDB goes (a single pod cannot tolerate one unavailable), the template stays.
    proxy.spec.replicas = 1;
    let one = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    assert!(one.pdb.is_none());
    assert_eq!(
        one.stateful_set.spec.as_ref().unwrap().template,
        three.stateful_set.spec.as_ref().unwrap().template
    );
}

#[test]
fn a_config_edit_changes_only_the_configmap_and_the_hash() {
    let (proxy, mut config) = fx::scenario("acme-redis");
    let before = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    config.spec.config = config
        .spec
        .config
        .replace("http://api:8080", "http://api-v2:8080");
    let after = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();

    let (a, b) = differ_only_at(
        &serde_json::to_value(&before.config_map).unwrap(),
        &serde_json::to_value(&after.config_map).unwrap(),
        "/data/sb.yml",
    );
    assert_ne!(a, b);
    assert_eq!(b, config.spec.config.as_str());
    assert_ne!(before.config_hash, after.config_hash);
    assert_eq!(
        after.config_hash,
        format!(
            "sha256:{}",
            sbmesh::sha256_hex(config.spec.config.as_bytes())
        )
    );
    assert_eq!(before.stateful_set, after.stateful_set);
    assert_eq!(before.service, after.service);
    assert_eq!(before.headless_service, after.headless_service);
    assert_eq!(before.pdb, after.pdb);
    assert_eq!(before.cluster_key_secret, after.cluster_key_secret);
}

#[test]
fn image_and_port_changes_roll_the_pods() {
    let (mut proxy, config) = fx::scenario("three-replicas-clustered");
    let before = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    proxy.spec.image = "ghcr.io/sbproxy/sbproxy:1.5.0".into();
    let after = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    assert_ne!(
        before.stateful_set.spec.as_ref().unwrap().template,
        after.stateful_set.spec.as_ref().unwrap().template
    );
}

#[test]
fn render_is_deterministic() {
    for name in fx::SCENARIOS {
        assert_eq!(
            fx::render_scenario(name),
            fx::render_scenario(name),
            "{name}"
        );
    }
}

#[test]
fn the_pods_share_a_process_namespace_and_shorten_the_proxys_grace_exactly_when_the_sidecar_restarts_the_proxy()
 {
    let render_with = |apply: &str, proxy_env: &str| {
        let proxy = fx::proxy(&format!("image: sbproxy\nconfigRef: demo\n{proxy_env}"));
        let text = format!(
            "proxy:\n  admin: {{ enabled: true, port: 9090 }}\n  extensions:\n    sbmesh:\n      acme: {{ enabled: true, email: ops@example.com, storage_backend: memory{apply} }}\norigins:\n  \"demo.example.com\": {{ action: {{ type: static, status_code: 200, body: ok }} }}\n"
        );
        render::render(&proxy, Some(&fx::config(&text)), None, &fx::opts())
            .unwrap_or_else(|r| panic!("{apply}: refused: {r}"))
    };
    let grace = |r: &Rendered| env_value(&proxy_container(r), "SBPROXY_SHUTDOWN_GRACE_MS");
    // `restart` signals the proxy's process: it must be visible, and the
    // proxy drains for 1 s (it exits in 2 s), not its own 30 s (60 s).
    let restart = render_with(", apply: restart", "");
    assert_eq!(pod_spec(&restart).share_process_namespace, Some(true));
    assert_eq!(grace(&restart).as_deref(), Some("1000"));
    assert_eq!(
        render::RESTART_PROXY_GRACE_MS.to_string(),
        grace(&restart).unwrap()
    );
    // The sidecar's own drain is not the proxy's.
    assert!(env(&sidecar(&restart), "SBPROXY_SHUTDOWN_GRACE_MS").is_none());
    // A grace the user gives the proxy wins.
    let theirs = render_with(
        ", apply: restart",
        "podTemplate:\n  proxyEnv: [{ name: SBPROXY_SHUTDOWN_GRACE_MS, value: \"5000\" }]\n",
    );
    assert_eq!(grace(&theirs).as_deref(), Some("5000"));
    let names = proxy_container(&theirs)
        .env
        .unwrap()
        .iter()
        .filter(|e| e.name == "SBPROXY_SHUTDOWN_GRACE_MS")
        .count();
    assert_eq!(names, 1, "one SBPROXY_SHUTDOWN_GRACE_MS");
    // reload (the default) and none need no shared namespace and leave
    // the proxy's grace alone.
    for apply in ["", ", apply: reload", ", apply: none"] {
        let r = render_with(apply, "");
        assert_eq!(pod_spec(&r).share_process_namespace, None, "{apply}");
        assert_eq!(grace(&r), None, "{apply}");
    }
}

// ---------------------------------------------------------------------------
// spec.podTemplate, spec.networkPolicy, spec.podMonitor (docs/reference.md#sbproxy)

fn pod_spec(r: &Rendered) -> k8s_openapi::api::core::v1::PodSpec {
    r.stateful_set
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .clone()
        .unwrap()
}

#[test]
fn pod_template_knobs_are_added_after_the_operators_own() {
    let r = fx::render_scenario("pod-template");
    let template = &r.stateful_set.spec.as_ref().unwrap().template;
    let labels = template.metadata.as_ref().unwrap().labels.as_ref().unwrap();
    assert_eq!(labels["team"], "platform");
    assert_eq!(labels["app.kubernetes.io/instance"], "edge");
    assert_eq!(labels["app.kubernetes.io/managed-by"], "sbmesh-operator");
    assert_eq!(
        r.stateful_set.spec.as_ref().unwrap().selector.match_labels,
        Some(render::selector_labels("edge")),
        "the selector is the operator's"
    );
    let pod = pod_spec(&r);
    assert_eq!(pod.service_account_name.as_deref(), Some("edge-proxy"));
    assert_eq!(pod.priority_class_name.as_deref(), Some("edge-critical"));
    assert_eq!(pod.termination_grace_period_seconds, Some(45));
    assert_eq!(pod.tolerations.as_ref().map(Vec::len), Some(1));
    assert!(pod.affinity.is_some());
    assert_eq!(
        pod.topology_spread_constraints.as_ref().map(Vec::len),
        Some(1)
    );
    assert_eq!(
        pod.image_pull_secrets.as_ref().unwrap()[0].name,
        "registry-edge"
    );

    // Merged field by field: theirs win, the operator's others stay.
    let sc = pod.security_context.as_ref().unwrap();
    assert_eq!(sc.supplemental_groups.as_deref(), Some(&[2000][..]));
    assert_eq!(
        sc.seccomp_profile.as_ref().unwrap().type_,
        "Localhost",
        "their seccompProfile replaces the operator's whole"
    );
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.fs_group, Some(65532));

    // Volumes and mounts: the operator's first, theirs after.
    let volumes: Vec<&str> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(
        volumes,
        [
            "sbproxy-config",
            "sbproxy-data",
            "sbmesh-cluster-key",
            "edge-tls"
        ]
    );
    for c in [proxy_container(&r), sidecar(&r)] {
        let last = c.volume_mounts.as_ref().unwrap().last().unwrap().clone();
        assert_eq!(
            (last.name.as_str(), last.mount_path.as_str()),
            ("edge-tls", "/etc/tls/edge"),
            "{}",
            c.name
        );
    }
    let side = sidecar(&r);
    assert_eq!(
        env_value(&side, "SBMESH_WATCH_TLS").as_deref(),
        Some("/etc/tls/edge")
    );
    assert_eq!(
        secret_ref(&side, "SBMESH_ADMIN_PASSWORD"),
        Some(("edge-admin".into(), "password".into()))
    );
    assert_eq!(
        env_value(&proxy_container(&r), "RUST_LOG").as_deref(),
        Some("info")
    );
    assert!(env(&proxy_container(&r), "SBMESH_WATCH_TLS").is_none());
    // SBMESH_PROXY_CERT_APPLY=restart in the sidecar's environment wins
    // over the file (which says nothing): the proxy must be visible to it.
    assert_eq!(pod.share_process_namespace, Some(true));
}

#[test]
fn an_empty_pod_template_and_the_extras_off_change_nothing() {
    for name in fx::SCENARIOS {
        let (mut proxy, config) = fx::scenario(name);
        if proxy.spec.pod_template.is_some() {
            continue;
        }
        let before = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
        proxy.spec.pod_template = Some(Default::default());
        proxy.spec.network_policy = false;
        proxy.spec.pod_monitor = false;
        let after = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
        assert_eq!(before.objects_yaml(), after.objects_yaml(), "{name}");
    }
}

#[test]
fn scaling_with_every_knob_set_changes_only_the_replicas() {
    let (mut proxy, config) = fx::scenario("pod-template");
    let three = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    proxy.spec.replicas = 7;
    let seven = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    assert_eq!(
        three.stateful_set.spec.as_ref().unwrap().template,
        seven.stateful_set.spec.as_ref().unwrap().template
    );
    assert_eq!(three.network_policy, seven.network_policy);
    assert_eq!(three.pod_monitor, seven.pod_monitor);
}

/// One ingress rule: its peers' pod selectors (as JSON text; `None`: from
/// anywhere) and its (protocol, port) pairs.
type IngressRule = (Option<Vec<String>>, Vec<(String, Value)>);

fn ingress_ports(r: &Rendered) -> Vec<IngressRule> {
    let spec = r.network_policy.as_ref().unwrap().spec.as_ref().unwrap();
    spec.ingress
        .iter()
        .flatten()
        .map(|rule| {
            let from = rule.from.as_ref().map(|peers| {
                peers
                    .iter()
                    .map(|p| serde_json::to_string(&p.pod_selector).unwrap())
                    .collect()
            });
            let ports = rule
                .ports
                .iter()
                .flatten()
                .map(|p| {
                    (
                        p.protocol.clone().unwrap(),
                        serde_json::to_value(&p.port).unwrap(),
                    )
                })
                .collect();
            (from, ports)
        })
        .collect()
}

#[test]
fn the_network_policy_admits_the_mesh_from_its_own_pods_and_the_rest_from_anywhere() {
    let r = fx::render_scenario("pod-template");
    let policy = r.network_policy.as_ref().unwrap();
    assert_eq!(policy.metadata.name.as_deref(), Some("edge-mesh"));
    let spec = policy.spec.as_ref().unwrap();
    assert_eq!(
        spec.policy_types.as_deref(),
        Some(&["Ingress".to_string()][..])
    );
    assert!(spec.egress.is_none());
    let own_pods = serde_json::to_string(&Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
            match_labels: Some(render::selector_labels("edge")),
            ..Default::default()
        },
    ))
    .unwrap();
    assert_eq!(serde_json::to_string(&spec.pod_selector).unwrap(), own_pods);
    let tcp = |p: i32| ("TCP".to_string(), Value::from(p));
    assert_eq!(
        ingress_ports(&r),
        [
            (
                Some(vec![own_pods]),
                vec![("UDP".to_string(), Value::from(7946)), tcp(8946)]
            ),
            // spec.port, the config's https_bind_port, the challenge port,
            // the sidecar's admin port (Prometheus).
            (None, vec![tcp(8080), tcp(8443), tcp(8089), tcp(9091)]),
        ]
    );

    // Without clustering there is no mesh to admit; other ports follow the spec.
    let proxy = fx::proxy(
        "image: sbproxy\nconfigRef: demo\nnetworkPolicy: true\nport: 8000\nsidecar: { adminPort: 9300, challengePort: 8300 }\n",
    );
    let config = fx::config("proxy:\n  admin: { enabled: true, port: 9090 }\n");
    let r = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    assert_eq!(
        ingress_ports(&r),
        [(None, vec![tcp(8000), tcp(8300), tcp(9300)])]
    );
    assert!(r.pod_monitor.is_none());
}

#[test]
fn the_pod_monitor_scrapes_the_sidecars_admin_port_by_name() {
    let r = fx::render_scenario("pod-template");
    let monitor = r.pod_monitor.as_ref().unwrap();
    assert_eq!(monitor.metadata.name.as_deref(), Some("edge"));
    let endpoint = &monitor.spec.pod_metrics_endpoints[0];
    assert_eq!(endpoint.path, "/metrics");
    // The port it names is the sidecar's, where /metrics is served.
    let side = sidecar(&r);
    let port = side
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(endpoint.port.as_str()))
        .expect("a port of the sidecar by that name");
    assert_eq!(port.container_port, admin_port_of(&side));
    assert_eq!(
        monitor.spec.selector.match_labels,
        Some(render::selector_labels("edge"))
    );
}

/// The port of the sidecar's `SBMESH_ADMIN_LISTEN`.
fn admin_port_of(side: &Container) -> i32 {
    env_value(side, "SBMESH_ADMIN_LISTEN")
        .and_then(|v| v.rsplit(':').next()?.parse().ok())
        .unwrap()
}

// ---------------------------------------------------------------------------
// The Service a user exposes (docs/reference.md#objects-the-operator-applies)

/// `<name>-svc`'s ports as (name, port, targetPort).
fn service_ports(r: &Rendered) -> Vec<(String, i32, Value)> {
    r.service
        .spec
        .as_ref()
        .unwrap()
        .ports
        .iter()
        .flatten()
        .map(|p| {
            (
                p.name.clone().unwrap(),
                p.port,
                serde_json::to_value(&p.target_port).unwrap(),
            )
        })
        .collect()
}

/// A container's ports as (name, containerPort).
fn container_ports(c: &Container) -> Vec<(String, i32)> {
    c.ports
        .iter()
        .flatten()
        .map(|p| (p.name.clone().unwrap(), p.container_port))
        .collect()
}

#[test]
fn port_80_passes_ordinary_requests_to_the_proxys_http_port() {
    for name in fx::SCENARIOS {
        let (proxy, _) = fx::scenario(name);
        let r = fx::render_scenario(name);
        assert_eq!(
            env_value(&sidecar(&r), "SBMESH_CHALLENGE_PASSTHROUGH"),
            Some(format!("http://127.0.0.1:{}", proxy.spec.port)),
            "{name}"
        );
        // The port the Service's `http` reaches is the one passed to.
        assert_eq!(
            container_ports(&proxy_container(&r))[0],
            ("http".to_string(), proxy.spec.port),
            "{name}"
        );
    }
    let proxy = fx::proxy("image: sbproxy\nconfigRef: demo\nport: 8000\n");
    let config = fx::config("proxy:\n  admin: { enabled: true, port: 9090 }\n");
    let r = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    assert_eq!(
        env_value(&sidecar(&r), "SBMESH_CHALLENGE_PASSTHROUGH").as_deref(),
        Some("http://127.0.0.1:8000")
    );
    // The value the sidecar is given is one it accepts.
    let url = env_value(&sidecar(&r), "SBMESH_CHALLENGE_PASSTHROUGH").unwrap();
    assert!(sbmesh::Upstream::parse(&url).is_ok());
}

#[test]
fn the_service_exposes_443_when_the_config_binds_https() {
    // proxy.https_bind_port: 8443.
    let r = fx::render_scenario("pod-template");
    assert_eq!(
        service_ports(&r),
        [
            ("http".to_string(), 8080, "http".into()),
            ("acme".to_string(), 80, "acme".into()),
            ("https".to_string(), 443, "https".into()),
        ]
    );
    assert_eq!(
        container_ports(&proxy_container(&r)),
        [
            ("http".to_string(), 8080),
            ("admin".to_string(), 9090),
            ("https".to_string(), 8443),
        ]
    );

    // No https_bind_port: no https port anywhere.
    for name in ["three-replicas-clustered", "byo-secret", "acme-redis"] {
        let r = fx::render_scenario(name);
        assert!(
            service_ports(&r).iter().all(|(n, ..)| n != "https"),
            "{name}"
        );
        assert!(
            container_ports(&proxy_container(&r))
                .iter()
                .all(|(n, _)| n != "https"),
            "{name}"
        );
    }

    // A config that starts binding HTTPS rolls the pods (the proxy must
    // restart to bind it anyway) and opens 443; nothing else changes.
    let (proxy, mut config) = fx::scenario("three-replicas-clustered");
    let before = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    config.spec.config =
        config
            .spec
            .config
            .replacen("proxy:\n", "proxy:\n  https_bind_port: 9443\n", 1);
    let after = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    assert_eq!(
        service_ports(&after).last().unwrap(),
        &("https".to_string(), 443, "https".into())
    );
    assert_eq!(
        container_ports(&proxy_container(&after)).last().unwrap(),
        &("https".to_string(), 9443)
    );
    let (a, b) = differ_only_at(
        &serde_json::to_value(&before.stateful_set).unwrap(),
        &serde_json::to_value(&after.stateful_set).unwrap(),
        "/spec/template/spec/containers/0/ports",
    );
    assert_ne!(a, b);
    assert_eq!(before.headless_service, after.headless_service);
}

/// (capabilities the proxy adds, capabilities it drops, the pod's sysctls).
type Privileges = (
    Option<Vec<String>>,
    Option<Vec<String>>,
    Vec<(String, String)>,
);

fn low_port_privileges(spec: &str, config: &str) -> Privileges {
    let proxy = fx::proxy(&format!("image: sbproxy\nconfigRef: demo\n{spec}"));
    let r = render::render(&proxy, Some(&fx::config(config)), None, &fx::opts())
        .unwrap_or_else(|e| panic!("{spec} {config}: {e}"));
    let caps = proxy_container(&r)
        .security_context
        .unwrap()
        .capabilities
        .unwrap();
    let side_caps = sidecar(&r).security_context.unwrap().capabilities.unwrap();
    assert_eq!(side_caps.add, None, "the sidecar adds nothing");
    assert_eq!(side_caps.drop, Some(vec!["ALL".to_string()]));
    let sysctls = pod_spec(&r)
        .security_context
        .unwrap()
        .sysctls
        .unwrap_or_default()
        .into_iter()
        .map(|s| (s.name, s.value))
        .collect();
    (caps.add, caps.drop, sysctls)
}

#[test]
fn ports_below_1024_get_what_binding_them_as_non_root_needs() {
    const CONFIG: &str = "proxy:\n  admin: { enabled: true, port: 9090 }\n";
    let all = Some(vec!["ALL".to_string()]);
    let bind = Some(vec!["NET_BIND_SERVICE".to_string()]);
    let sysctl = |port: &str| {
        vec![(
            "net.ipv4.ip_unprivileged_port_start".to_string(),
            port.to_string(),
        )]
    };
    // Every port at 1024 or above (the defaults): nothing added.
    assert_eq!(low_port_privileges("", CONFIG), (None, all.clone(), vec![]));
    // The proxy's HTTP port.
    assert_eq!(
        low_port_privileges("port: 80\n", CONFIG),
        (bind.clone(), all.clone(), sysctl("80"))
    );
    // The config's HTTPS port, the lowest counting.
    assert_eq!(
        low_port_privileges(
            "port: 8080\n",
            "proxy:\n  admin: { enabled: true, port: 9090 }\n  https_bind_port: 443\n"
        ),
        (bind.clone(), all.clone(), sysctl("443"))
    );
    assert_eq!(
        low_port_privileges(
            "port: 80\n",
            "proxy:\n  admin: { enabled: true, port: 9090 }\n  http_bind_port: 80\n  https_bind_port: 443\n"
        ),
        (bind.clone(), all.clone(), sysctl("80"))
    );
    // Only the sidecar's challenge port: the sysctl, no capability for the
    // proxy (the sidecar, dropping all, binds through the sysctl).
    assert_eq!(
        low_port_privileges("sidecar: { challengePort: 80 }\n", CONFIG),
        (None, all, sysctl("80"))
    );
}
