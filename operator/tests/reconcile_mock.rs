//! The reconciler against a scripted API server (tower-test): every request
//! it makes is checked in order, and any request the script does not list
//! fails the test.

mod mock_apiserver;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use mock_apiserver::{Answer, Expect, Seen, finish, pair};
use sbmesh_operator::crd::{SBProxy, SBProxyConfig};
use sbmesh_operator::reconcile::{self, Context, error_policy, proxies_for_config, reconcile};
use sbmesh_operator::render::{self, RenderOptions};
use sbmesh_operator::telemetry::{Metrics, ReconcileResult};
use serde_json::{Value, json};

const CONFIG: &str = "/apis/sbproxy.dev/v1alpha1/namespaces/default/sbproxyconfigs/demo-sbyml";
const STATUS: &str = "/apis/sbproxy.dev/v1alpha1/namespaces/default/sbproxies/demo/status";
const SECRETS: &str = "/api/v1/namespaces/default/secrets";
const SECRET: &str = "/api/v1/namespaces/default/secrets/demo-cluster-key";
const STS: &str = "/apis/apps/v1/namespaces/default/statefulsets/demo-proxy";
const MESH: &str = "/api/v1/namespaces/default/services/demo-mesh";
const SVC: &str = "/api/v1/namespaces/default/services/demo-svc";
const CM: &str = "/api/v1/namespaces/default/configmaps/demo-config";
const PODS: &str = "/api/v1/namespaces/default/pods";
const PDB: &str = "/apis/policy/v1/namespaces/default/poddisruptionbudgets/demo-pdb";
const NETPOL: &str = "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies/demo-mesh";
const PODMON: &str = "/apis/monitoring.coreos.com/v1/namespaces/default/podmonitors/demo";
const EVENTS: &str = "/apis/events.k8s.io/v1/namespaces/default/events";

/// The sidecar's ACME on a shared store.
const SB_YML: &str = "\
proxy:
  admin: { enabled: true, port: 9090 }
  extensions:
    sbmesh:
      acme:
        enabled: true
        email: ops@example.com
        storage_backend: redis
        storage_path: redis://redis.default.svc.cluster.local:6379/0
origins:
  \"api.example.com\": {}
";

/// The proxy's own ACME (sbproxy orders the certificates itself) on a store
/// local to one pod: refused for more than one replica with the documented message.
const SB_YML_REDB: &str = "\
proxy:
  admin: { enabled: true, port: 9090 }
  acme:
    enabled: true
    email: ops@example.com
    storage_backend: redb
    storage_path: /var/lib/sbproxy/certs
origins:
  \"api.example.com\": {}
";

const ACME_NOT_SHARED_3_REDB: &str = "spec.replicas is 3 and proxy.acme.enabled is true with storage_backend \"redb\", which is local to one pod. Each replica would open its own order for the same hostname, and an HTTP-01 challenge load-balanced to a replica that did not open it cannot be answered. Use a shared store (file on an RWX volume, redis, s3, gcs, or azure), set spec.replicas to 1, or issue certificates with cert-manager and leave proxy.acme disabled.";

fn proxy_json(replicas: i32, clustered: bool) -> Value {
    json!({
        "apiVersion": "sbproxy.dev/v1alpha1",
        "kind": "SBProxy",
        "metadata": {
            "name": "demo", "namespace": "default", "generation": 1,
            "uid": "6d1f3c0e-0000-4000-8000-000000000001", "resourceVersion": "41",
        },
        "spec": {
            "image": "ghcr.io/sbproxy/sbproxy:0.9.0",
            "configRef": { "name": "demo-sbyml" },
            "replicas": replicas,
            "port": 8080,
            "adminPort": 9090,
            "clustering": {
                "enabled": clustered, "gossipPort": 7946, "transportPort": 8946,
                "clusterDomain": "cluster.local",
            },
            "sidecar": { "adminPort": 9091, "challengePort": 8089 },
        },
    })
}

fn config_json(text: &str) -> Value {
    json!({
        "apiVersion": "sbproxy.dev/v1alpha1",
        "kind": "SBProxyConfig",
        "metadata": { "name": "demo-sbyml", "namespace": "default", "resourceVersion": "12" },
        "spec": { "config": text },
    })
}

fn with_status(mut proxy: Value, status: &Value) -> Value {
    proxy["status"] = status.clone();
    proxy
}

fn proxy(v: &Value) -> Arc<SBProxy> {
    Arc::new(serde_json::from_value(v.clone()).expect("fixture is an SBProxy"))
}

fn context(client: kube::Client) -> (Arc<Context>, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let ctx = Context::new(
        client,
        "ghcr.io/sbproxy/sbmesh:test",
        metrics.clone(),
        reconcile::reporter(Some("op-test".into())),
    );
    (Arc::new(ctx), metrics)
}

/// The LIST of the SBProxy's pods after the ConfigMap's apply, answered
/// with these pods' metadata.
fn pods_listed(items: Value) -> Expect {
    Expect::get(
        PODS,
        Some(json!({
            "apiVersion": "meta.k8s.io/v1",
            "kind": "PartialObjectMetadataList",
            "metadata": {},
            "items": items,
        })),
    )
}

fn no_pods() -> Expect {
    pods_listed(json!([]))
}

fn applied(path: &str) -> Expect {
    Expect::patch(path, json!({}))
}

fn sts_applied(replicas: i32, ready: i32) -> Expect {
    Expect::patch(
        STS,
        json!({ "status": { "replicas": replicas, "readyReplicas": ready, "availableReplicas": ready } }),
    )
}

/// The applies of fixture `p` with `replicas` ready pods (more than one),
/// up to the PodDisruptionBudget; its pods are listed (to be told of the
/// config) only while its status shows no config hash yet.
fn applied_ready(replicas: i32, p: &Value) -> Vec<Expect> {
    let mut script = vec![
        sts_applied(replicas, replicas),
        applied(MESH),
        applied(SVC),
        applied(CM),
    ];
    if p["status"]["configHash"].is_null() {
        script.push(no_pods());
    }
    script.push(applied(PDB));
    script
}

fn find<'a>(seen: &'a [Seen], method: &str, path: &str) -> &'a Seen {
    seen.iter()
        .find(|s| s.method == method && s.path == path)
        .unwrap_or_else(|| panic!("no {method} {path}"))
}

fn condition<'a>(status: &'a Value, type_: &str) -> &'a Value {
    status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no {type_} condition in {status}"))
}

fn assert_applied_with_ssa(s: &Seen, kind: &str, name: &str) {
    assert_eq!(
        s.query("fieldManager"),
        Some("sbmesh-operator"),
        "{}",
        s.path
    );
    assert_eq!(s.query("force"), Some("true"), "{}", s.path);
    assert_eq!(
        s.content_type.as_deref(),
        Some("application/apply-patch+yaml"),
        "{}",
        s.path
    );
    assert_eq!(s.body["kind"], kind, "{}", s.path);
    assert_eq!(s.body["metadata"]["name"], name, "{}", s.path);
}

fn cluster_key(secret: &Value) -> String {
    let secret: Secret = serde_json::from_value(secret.clone()).expect("a Secret");
    if let Some(v) = secret.data.as_ref().and_then(|d| d.get("cluster-key")) {
        return String::from_utf8(v.0.clone()).expect("utf-8 key");
    }
    secret
        .string_data
        .as_ref()
        .and_then(|d| d.get("cluster-key"))
        .cloned()
        .expect("cluster-key in data or stringData")
}

#[tokio::test]
async fn first_reconcile_creates_the_key_and_applies_then_the_next_ones_create_nothing() {
    // (a) First reconcile of a clustered 3-replica SBProxy.
    let p = proxy_json(3, true);
    let (client, server) = pair();
    let (ctx, metrics) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, Some(config_json(SB_YML))),
        Expect::get(SECRET, None),
        Expect::create(SECRETS),
        sts_applied(3, 0),
        applied(MESH),
        applied(SVC),
        applied(CM),
        no_pods(),
        applied(PDB),
        Expect::get(NETPOL, None),
        // A cluster without prometheus-operator: the kind itself is not
        // served, and a real apiserver says so in plain text.
        Expect::get(PODMON, None).answer(Answer::Text(
            http::StatusCode::NOT_FOUND,
            "404 page not found",
        )),
        Expect::patch_status(STATUS, p.clone()),
        Expect::create(EVENTS),
        Expect::create(EVENTS),
    ]);
    let action = reconcile(proxy(&p), ctx).await.expect("first reconcile");
    let seen = finish(task).await;
    assert_eq!(action, Action::requeue(Duration::from_secs(300)));
    assert_eq!(metrics.reconciles_with(ReconcileResult::ok), 1);

    let secret = &find(&seen, "POST", SECRETS).body;
    assert_eq!(secret["metadata"]["name"], "demo-cluster-key");
    let key = cluster_key(secret);
    assert_eq!(key.len(), 64, "{key}");
    assert!(key.chars().all(|c| c.is_ascii_hexdigit()), "{key}");
    assert!(
        secret["metadata"]["ownerReferences"].is_null(),
        "the Secret outlives its SBProxy: no owner reference"
    );

    assert_applied_with_ssa(&seen[3], "StatefulSet", "demo-proxy");
    assert_eq!(seen[3].body["spec"]["replicas"], 3);
    assert_applied_with_ssa(&seen[4], "Service", "demo-mesh");
    assert_applied_with_ssa(&seen[5], "Service", "demo-svc");
    assert_applied_with_ssa(&seen[6], "ConfigMap", "demo-config");
    assert_eq!(seen[6].body["data"]["sb.yml"], SB_YML);
    assert_applied_with_ssa(&seen[8], "PodDisruptionBudget", "demo-pdb");

    let patch = &seen[11];
    assert_eq!(
        patch.content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    let status = &patch.body["status"];
    let config: SBProxyConfig = serde_json::from_value(config_json(SB_YML)).expect("config");
    let expected = render::render(
        &proxy(&p),
        Some(&config),
        None,
        &RenderOptions {
            sidecar_image: "ghcr.io/sbproxy/sbmesh:test".into(),
            fresh_cluster_key: "00".repeat(32),
        },
    )
    .unwrap_or_else(|r| panic!("fixture refused: {}", r.message));
    assert_eq!(status["configHash"], expected.config_hash.as_str());
    assert!(expected.config_hash.starts_with("sha256:"));
    assert_eq!(status["observedGeneration"], 1);
    assert_eq!(status["replicas"], 3);
    assert_eq!(status["readyReplicas"], 0);
    assert!(
        status
            .as_object()
            .is_some_and(|s| s.contains_key("lastError"))
    );
    assert!(status["lastError"].is_null(), "lastError cleared: {status}");
    let degraded = condition(status, "Degraded");
    assert_eq!(
        (&degraded["status"], &degraded["reason"]),
        (&json!("False"), &json!("Reconciled"))
    );
    let ready = condition(status, "Ready");
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&json!("False"), &json!("ReplicasNotReady"))
    );

    let event = &seen[12].body;
    assert_eq!(event["type"], "Normal");
    assert_eq!(event["reason"], "ClusterKeyCreated");
    assert!(
        event["note"]
            .as_str()
            .is_some_and(|n| n.contains("created Secret demo-cluster-key")),
        "{event}"
    );
    let event = &seen[13].body;
    assert_eq!(event["type"], "Normal");
    assert_eq!(event["reason"], "Applied");
    assert!(
        event["note"]
            .as_str()
            .is_some_and(|n| n.contains("StatefulSet demo-proxy")),
        "{event}"
    );

    // (b) Second reconcile: the Secret exists, the pods turned ready. No
    // Secret POST, no Event; the status patch moves Ready only.
    let first_status = status.clone();
    let p2 = with_status(p.clone(), &first_status);
    let (client, server) = pair();
    let (ctx, _) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, Some(config_json(SB_YML))),
        Expect::get(SECRET, Some(secret.clone())),
        sts_applied(3, 3),
        applied(MESH),
        applied(SVC),
        applied(CM),
        applied(PDB),
        Expect::get(NETPOL, None),
        Expect::get(PODMON, None),
        Expect::patch_status(STATUS, p2.clone()),
    ]);
    reconcile(proxy(&p2), ctx).await.expect("second reconcile");
    let seen = finish(task).await;
    let status = &seen[9].body["status"];
    assert_eq!(status["configHash"], first_status["configHash"]);
    let ready = condition(status, "Ready");
    assert_eq!(
        (&ready["status"], &ready["reason"]),
        (&json!("True"), &json!("AllReplicasReady"))
    );
    assert_eq!(
        condition(status, "Degraded")["lastTransitionTime"],
        condition(&first_status, "Degraded")["lastTransitionTime"],
        "an unchanged condition keeps its lastTransitionTime"
    );

    // (c) Third reconcile, nothing changed anywhere: applies only.
    let p3 = with_status(p.clone(), status);
    let (client, server) = pair();
    let (ctx, _) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, Some(config_json(SB_YML))),
        Expect::get(SECRET, Some(secret.clone())),
        sts_applied(3, 3),
        applied(MESH),
        applied(SVC),
        applied(CM),
        applied(PDB),
        Expect::get(NETPOL, None),
        Expect::get(PODMON, None),
    ]);
    reconcile(proxy(&p3), ctx).await.expect("third reconcile");
    finish(task).await;
}

/// Runs one refusal: the script allows only the reads, the status patch
/// and the Warning Event. Returns the status patch and the Event.
async fn refused(p: Value, config: Option<Value>, reason: &str) -> (Value, Value) {
    let (client, server) = pair();
    let (ctx, metrics) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, config),
        Expect::get(SECRET, None),
        Expect::patch_status(STATUS, p.clone()),
        Expect::create(EVENTS),
    ]);
    let action = reconcile(proxy(&p), ctx)
        .await
        .expect("a refusal is not an error");
    let seen = finish(task).await;
    assert_eq!(action, Action::requeue(Duration::from_secs(60)), "{reason}");
    assert_eq!(metrics.reconciles_with(ReconcileResult::refused), 1);
    assert_eq!(metrics.reconciles_with(ReconcileResult::ok), 0);

    let status = seen[2].body["status"].clone();
    let degraded = condition(&status, "Degraded");
    assert_eq!(
        (&degraded["status"], &degraded["reason"]),
        (&json!("True"), &json!(reason))
    );
    assert_eq!(condition(&status, "Ready")["status"], "False");
    let message = status["lastError"]
        .as_str()
        .expect("lastError set")
        .to_owned();
    assert!(!message.is_empty());
    assert_eq!(degraded["message"], message.as_str());

    let event = seen[3].body.clone();
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reason"], reason);
    assert_eq!(event["note"], message.as_str());
    (status, event)
}

#[tokio::test]
async fn too_many_replicas_is_refused_without_workload_calls() {
    let (status, _) = refused(
        proxy_json(200, true),
        Some(config_json(SB_YML)),
        "TooManyReplicas",
    )
    .await;
    assert!(
        status["lastError"]
            .as_str()
            .is_some_and(|m| m.contains("128")),
        "{status}"
    );
}

#[tokio::test]
async fn missing_config_is_refused_without_workload_calls() {
    let (status, _) = refused(proxy_json(3, true), None, "ConfigNotFound").await;
    assert!(
        status["lastError"]
            .as_str()
            .is_some_and(|m| m.contains("demo-sbyml")),
        "{status}"
    );
}

#[tokio::test]
async fn invalid_config_is_refused_without_workload_calls() {
    refused(
        proxy_json(3, true),
        Some(config_json("proxy: [unclosed\n")),
        "ConfigInvalid",
    )
    .await;
}

#[tokio::test]
async fn the_proxys_own_mesh_on_the_sidecars_ports_is_refused_without_workload_calls() {
    let config = SB_YML.replace(
        "  extensions:",
        "  cluster: { cluster_id: demo }\n  extensions:",
    );
    let (status, _) = refused(
        proxy_json(3, true),
        Some(config_json(&config)),
        "ConfigInvalid",
    )
    .await;
    let message = status["lastError"].as_str().unwrap();
    assert!(
        message.contains(
            "\nproxy.cluster.gossip_port: sbproxy's own mesh (proxy.cluster) binds UDP 7946"
        ),
        "{message}"
    );
}

#[tokio::test]
async fn local_acme_store_with_replicas_is_refused_with_the_spec_message() {
    let (status, event) = refused(
        proxy_json(3, true),
        Some(config_json(SB_YML_REDB)),
        "AcmeStoreNotShared",
    )
    .await;
    assert_eq!(status["lastError"], ACME_NOT_SHARED_3_REDB);
    assert_eq!(event["note"], ACME_NOT_SHARED_3_REDB);
}

#[tokio::test]
async fn a_fixed_spec_clears_the_refusal() {
    let refused_status = json!({
        "observedGeneration": 1,
        "lastError": ACME_NOT_SHARED_3_REDB,
        "conditions": [
            { "type": "Ready", "status": "False", "reason": "AcmeStoreNotShared", "message": "x",
              "lastTransitionTime": "2025-01-01T00:00:00Z", "observedGeneration": 1 },
            { "type": "Degraded", "status": "True", "reason": "AcmeStoreNotShared", "message": "x",
              "lastTransitionTime": "2025-01-01T00:00:00Z", "observedGeneration": 1 },
        ],
    });
    let mut p = with_status(proxy_json(1, false), &refused_status);
    p["metadata"]["generation"] = json!(2);
    let (client, server) = pair();
    let (ctx, _) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, Some(config_json(SB_YML_REDB))),
        Expect::get(SECRET, None),
        sts_applied(1, 1),
        applied(MESH),
        applied(SVC),
        applied(CM),
        no_pods(),
        Expect::get(PDB, None),
        Expect::get(NETPOL, None),
        Expect::get(PODMON, None),
        Expect::patch_status(STATUS, p.clone()),
        Expect::create(EVENTS),
    ]);
    reconcile(proxy(&p), ctx).await.expect("reconcile");
    let seen = finish(task).await;
    let status = &seen[10].body["status"];
    assert!(
        status
            .as_object()
            .is_some_and(|s| s.contains_key("lastError"))
            && status["lastError"].is_null()
    );
    assert_eq!(status["observedGeneration"], 2);
    let degraded = condition(status, "Degraded");
    assert_eq!(degraded["status"], "False");
    assert_ne!(
        degraded["lastTransitionTime"], "2025-01-01T00:00:00Z",
        "Degraded flipped: new time"
    );
    assert_eq!(condition(status, "Ready")["status"], "True");
    assert_eq!(seen[11].body["type"], "Normal");
}

/// A pod's metadata as a list of pods answers it.
fn pod_meta(name: &str, hash: Option<&str>) -> Value {
    let mut meta = json!({ "name": name, "namespace": "default" });
    if let Some(h) = hash {
        meta["annotations"] = json!({ reconcile::CONFIG_HASH_ANNOTATION: h });
    }
    json!({ "apiVersion": "v1", "kind": "Pod", "metadata": meta })
}

#[tokio::test]
async fn each_pod_without_the_configs_hash_is_annotated_with_it_and_a_refused_patch_fails_nothing()
{
    let p = proxy_json(1, false);
    let hash = render::render(
        &serde_json::from_value(p.clone()).unwrap(),
        Some(&serde_json::from_value(config_json(SB_YML_REDB)).unwrap()),
        None,
        &RenderOptions {
            sidecar_image: "ghcr.io/sbproxy/sbmesh:test".into(),
            fresh_cluster_key: String::new(),
        },
    )
    .expect("renders")
    .config_hash;
    let (client, server) = pair();
    let (ctx, metrics) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, Some(config_json(SB_YML_REDB))),
        Expect::get(SECRET, None),
        sts_applied(1, 1),
        applied(MESH),
        applied(SVC),
        applied(CM),
        pods_listed(json!([
            pod_meta("demo-proxy-0", Some(&hash)),
            pod_meta("demo-proxy-1", Some("sha256:older")),
            pod_meta("demo-proxy-2", None),
        ])),
        Expect::patch(format!("{PODS}/demo-proxy-1"), json!({})),
        Expect::patch(format!("{PODS}/demo-proxy-2"), json!({}))
            .answer(Answer::Failure(http::StatusCode::FORBIDDEN, "Forbidden")),
        Expect::get(PDB, None),
        Expect::get(NETPOL, None),
        Expect::get(PODMON, None),
        Expect::patch_status(STATUS, p.clone()),
        Expect::create(EVENTS),
    ]);
    reconcile(proxy(&p), ctx)
        .await
        .expect("a refused patch fails no reconcile");
    let seen = finish(task).await;
    assert_eq!(
        seen[6].query("labelSelector"),
        Some("app.kubernetes.io/instance=demo,app.kubernetes.io/name=sbproxy"),
        "the SBProxy's own pods, by its selector"
    );
    for patched in [&seen[7], &seen[8]] {
        assert_eq!(
            patched.content_type.as_deref(),
            Some("application/merge-patch+json")
        );
        assert_eq!(
            patched.body,
            json!({ "metadata": { "annotations": { "sbproxy.dev/config-hash": hash } } }),
            "only the annotation: nothing in the pod's spec changes, nothing restarts"
        );
    }
    let text = metrics.encode();
    for line in [
        "sbmesh_operator_config_nudges_total{result=\"patched\"} 1",
        "sbmesh_operator_config_nudges_total{result=\"failed\"} 1",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }
}

#[tokio::test]
async fn scaling_to_one_replica_deletes_the_pdb() {
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": { "name": "demo-cluster-key", "namespace": "default" },
        "data": { "cluster-key": "MTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMTExMQ==" },
    });
    let pdb = json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {
            "name": "demo-pdb", "namespace": "default", "uid": "pdb-uid-1",
            "labels": {
                "app.kubernetes.io/name": "sbproxy",
                "app.kubernetes.io/instance": "demo",
                "app.kubernetes.io/managed-by": "sbmesh-operator",
            },
        },
        "spec": { "maxUnavailable": 1 },
    });
    let mut p = proxy_json(1, true);
    p["metadata"]["generation"] = json!(2);
    let (client, server) = pair();
    let (ctx, _) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, Some(config_json(SB_YML))),
        Expect::get(SECRET, Some(secret)),
        sts_applied(1, 1),
        applied(MESH),
        applied(SVC),
        applied(CM),
        no_pods(),
        Expect::get(PDB, Some(pdb)),
        Expect::delete(PDB),
        Expect::get(NETPOL, None),
        Expect::get(PODMON, None),
        Expect::patch_status(STATUS, p.clone()),
        Expect::create(EVENTS),
        Expect::create(EVENTS),
    ]);
    reconcile(proxy(&p), ctx).await.expect("reconcile");
    let seen = finish(task).await;
    assert_eq!(seen[2].body["spec"]["replicas"], 1);
    assert_eq!(
        seen[8].body["preconditions"]["uid"], "pdb-uid-1",
        "never deletes a recreated PDB"
    );
    assert_eq!(seen[12].body["reason"], "PodDisruptionBudgetDeleted");
    assert!(
        seen[12].body["note"]
            .as_str()
            .is_some_and(|n| n.contains("deleted PodDisruptionBudget demo-pdb")),
        "{}",
        seen[12].body
    );
    assert_eq!(seen[13].body["reason"], "Applied");
}

/// Clustering off with the key Secret kept from when it was on: the pods
/// keep the key (it seals the store's records: without it they could not
/// open the certificate and would order another), the Secret is neither
/// written nor rotated, and the status has no `clusterKey`. A foreign PDB
/// is left alone.
#[tokio::test]
async fn one_unclustered_replica_keeps_a_kept_key_and_leaves_a_foreign_pdb() {
    let foreign = json!({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": { "name": "demo-pdb", "namespace": "default", "uid": "theirs" },
        "spec": { "minAvailable": 1 },
    });
    let mut p = proxy_json(1, false);
    p["metadata"]["annotations"] = json!({ "sbproxy.dev/rotate-cluster-key": "r1" });
    let (client, server) = pair();
    let (ctx, _) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, Some(config_json(SB_YML))),
        Expect::get(SECRET, Some(key_secret(&format!("{KEY_OLD}\n"), json!({})))),
        sts_applied(1, 1),
        applied(MESH),
        applied(SVC),
        applied(CM),
        no_pods(),
        Expect::get(PDB, Some(foreign)),
        Expect::get(NETPOL, None),
        Expect::get(PODMON, None),
        Expect::patch_status(STATUS, p.clone()),
        Expect::create(EVENTS),
    ]);
    reconcile(proxy(&p), ctx).await.expect("reconcile");
    let seen = finish(task).await;
    assert!(
        seen.iter()
            .all(|s| !s.path.contains("/secrets") || s.method == "GET"),
        "the kept Secret is only read"
    );
    let sts = find(&seen, "PATCH", STS).body.to_string();
    assert!(
        sts.contains("SBMESH_CLUSTER_KEY_FILE")
            && sts.contains("\"secretName\":\"demo-cluster-key\""),
        "the pods keep the key: {sts}"
    );
    assert!(
        !sts.contains("SBMESH_MESH_SERVICE"),
        "and form no mesh: {sts}"
    );
    let status = find(&seen, "PATCH", STATUS).body.clone();
    assert!(status["status"]["clusterKey"].is_null(), "{status}");
}

#[tokio::test]
async fn an_api_error_is_recorded_and_retried_with_backoff() {
    let p = proxy_json(1, false);
    let (client, server) = pair();
    let (ctx, metrics) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, Some(config_json(SB_YML))),
        Expect::get(SECRET, None),
        Expect::patch(STS, json!({})).answer(Answer::Failure(
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
        )),
        Expect::patch_status(STATUS, p.clone()),
    ]);
    let obj = proxy(&p);
    let err = reconcile(obj.clone(), ctx.clone())
        .await
        .expect_err("apply failed");
    assert_eq!(
        error_policy(obj.clone(), &err, ctx.clone()),
        Action::requeue(Duration::from_secs(5))
    );
    assert_eq!(
        error_policy(obj.clone(), &err, ctx.clone()),
        Action::requeue(Duration::from_secs(10))
    );
    drop(ctx);
    let seen = finish(task).await;
    let last_error = seen[3].body["status"]["lastError"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        last_error.contains("StatefulSet default/demo-proxy"),
        "{last_error}"
    );
    assert_eq!(
        seen[3].body["status"].as_object().map(|s| s.len()),
        Some(1),
        "only lastError: conditions stay as they were"
    );
    assert_eq!(metrics.reconciles_with(ReconcileResult::error), 1);
}

#[test]
fn a_config_maps_to_exactly_the_proxies_that_reference_it_in_its_namespace() {
    let mk = |name: &str, ns: &str, config: &str| -> Arc<SBProxy> {
        let mut v = proxy_json(1, false);
        v["metadata"]["name"] = json!(name);
        v["metadata"]["namespace"] = json!(ns);
        v["spec"]["configRef"]["name"] = json!(config);
        proxy(&v)
    };
    let proxies = vec![
        mk("a", "default", "shared"),
        mk("b", "default", "other"),
        mk("c", "default", "shared"),
        mk("d", "prod", "shared"),
    ];
    let config = |ns: Option<&str>| -> SBProxyConfig {
        let mut v = config_json("proxy: {}\n");
        v["metadata"]["name"] = json!("shared");
        match ns {
            Some(ns) => v["metadata"]["namespace"] = json!(ns),
            None => {
                if let Some(m) = v["metadata"].as_object_mut() {
                    m.remove("namespace");
                }
            }
        }
        serde_json::from_value(v).expect("config")
    };
    let names = |refs: Vec<ObjectRef<SBProxy>>| -> Vec<String> {
        let mut n: Vec<String> = refs
            .iter()
            .map(|r| format!("{}/{}", r.namespace.as_deref().unwrap_or("-"), r.name))
            .collect();
        n.sort();
        n
    };
    assert_eq!(
        names(proxies_for_config(&config(Some("default")), &proxies)),
        ["default/a", "default/c"]
    );
    assert_eq!(
        names(proxies_for_config(&config(Some("prod")), &proxies)),
        ["prod/d"]
    );
    assert!(proxies_for_config(&config(Some("staging")), &proxies).is_empty());
    assert!(proxies_for_config(&config(None), &proxies).is_empty());
}

#[tokio::test]
async fn a_proxy_being_deleted_gets_no_call() {
    let mut p = proxy_json(3, true);
    p["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
    let (client, server) = pair();
    let (ctx, _) = context(client);
    let task = server.run(vec![]);
    let action = reconcile(proxy(&p), ctx).await.expect("reconcile");
    finish(task).await;
    assert_eq!(action, Action::await_change());
}

// ---------------------------------------------------------------------------
// Cluster-key rotation (docs/operations.md#rotate-the-cluster-key)

const KEY_OLD: &str = "1111111111111111111111111111111111111111111111111111111111111111";

fn key_secret(ring: &str, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": { "name": "demo-cluster-key", "namespace": "default", "annotations": annotations },
        "data": { "cluster-key": base64(ring) },
    })
}

fn base64(text: &str) -> Value {
    serde_json::to_value(k8s_openapi::ByteString(text.as_bytes().to_vec())).unwrap()
}

fn annotated(mut p: Value, value: &str, grace_s: i64) -> Value {
    p["metadata"]["annotations"] = json!({ sbmesh_operator::rotation::ROTATE_ANNOTATION: value });
    p["spec"]["clustering"]["keyRotationGraceSeconds"] = json!(grace_s);
    p
}

/// The requests of one reconcile of the clustered 3-replica fixture with the
/// Secret as `secret`: its PATCH and the nudge of its one pod when
/// `writes`, then the applies, then
/// `tail` (status patch, Events).
async fn reconcile_with(
    p: &Value,
    secret: Value,
    writes: bool,
    tail: Vec<Expect>,
) -> (Action, Vec<Seen>) {
    let (client, server) = pair();
    let (ctx, _) = context(client);
    let mut script = vec![
        Expect::get(CONFIG, Some(config_json(SB_YML))),
        Expect::get(SECRET, Some(secret)),
    ];
    if writes {
        // The Secret, then its pods told of it (their kubelet writes the
        // volume at once).
        script.extend([
            Expect::patch(SECRET, json!({ "apiVersion": "v1", "kind": "Secret" })),
            pods_listed(json!([pod_meta("demo-proxy-0", None)])),
            Expect::patch(format!("{PODS}/demo-proxy-0"), json!({})),
        ]);
    }
    script.extend(applied_ready(3, p));
    script.extend([Expect::get(NETPOL, None), Expect::get(PODMON, None)]);
    script.extend(tail);
    let task = server.run(script);
    let action = reconcile(proxy(p), ctx).await.expect("reconcile");
    (action, finish(task).await)
}

fn ring_of(patch: &Value) -> String {
    let secret: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret", "data": patch["data"].clone(),
    }))
    .unwrap();
    String::from_utf8(secret.data.unwrap()["cluster-key"].0.clone()).unwrap()
}

#[tokio::test]
async fn a_rotation_writes_new_then_old_waits_the_grace_then_drops_the_old_key() {
    use sbmesh_operator::rotation::{self, ROTATED_AT_ANNOTATION, ROTATED_FOR_ANNOTATION};
    let base = proxy_json(3, true);
    // Before: no annotation. The key is reported, nothing is written.
    let (_, before) = reconcile_with(
        &base,
        key_secret(&format!("{KEY_OLD}\n"), json!({})),
        false,
        vec![
            Expect::patch_status(STATUS, base.clone()),
            Expect::create(EVENTS),
        ],
    )
    .await;
    let stable = &find(&before, "PATCH", STATUS).body["status"]["clusterKey"];
    assert_eq!(stable["phase"], "Stable");
    assert_eq!(stable["keyId"], rotation::key_id(KEY_OLD).as_str());
    let sts_before = find(&before, "PATCH", STS).body.clone();

    // (1) Annotated: the Secret gets [new, old] in one merge patch, with
    // the marks; status Rotating; an Event; a recheck at the grace's end.
    let p = annotated(base.clone(), "2026-12-02", 300);
    let (action, seen) = reconcile_with(
        &p,
        key_secret(&format!("{KEY_OLD}\n"), json!({})),
        true,
        vec![
            Expect::patch_status(STATUS, p.clone()),
            Expect::create(EVENTS),
            Expect::create(EVENTS),
        ],
    )
    .await;
    let patch = &find(&seen, "PATCH", SECRET).body;
    let ring = ring_of(patch);
    let lines: Vec<&str> = ring.lines().collect();
    assert_eq!(lines.len(), 2, "{ring}");
    assert_eq!(lines[1], KEY_OLD, "the old key second");
    assert_ne!(lines[0], KEY_OLD);
    assert_eq!(
        patch["metadata"]["annotations"][ROTATED_FOR_ANNOTATION],
        "2026-12-02"
    );
    let rotated_at = patch["metadata"]["annotations"][ROTATED_AT_ANNOTATION]
        .as_str()
        .unwrap()
        .to_string();
    let status = &find(&seen, "PATCH", STATUS).body["status"]["clusterKey"];
    assert_eq!(status["phase"], "Rotating");
    assert_eq!(status["keyId"], rotation::key_id(lines[0]).as_str());
    assert_eq!(status["rotatedAt"], rotated_at.as_str());
    let told = |seen: &[Seen]| {
        find(seen, "PATCH", &format!("{PODS}/demo-proxy-0")).body["metadata"]["annotations"]
            [reconcile::CLUSTER_KEY_IDS_ANNOTATION]
            .clone()
    };
    let (new_id, old_id) = (rotation::key_id(lines[0]), rotation::key_id(KEY_OLD));
    assert_eq!(
        told(&seen),
        format!("{new_id},{old_id}").as_str(),
        "each pod told of the ring, so its kubelet writes it now, not at its next sync"
    );
    let event = seen
        .iter()
        .find(|s| s.path == EVENTS && s.body["reason"] == "ClusterKeyRotating")
        .expect("a ClusterKeyRotating Event");
    assert_eq!(event.body["type"], "Normal");
    assert_eq!(action, Action::requeue(Duration::from_secs(300)));
    assert_eq!(
        find(&seen, "PATCH", STS).body,
        sts_before,
        "the StatefulSet apply body is byte-identical: no pod restarts"
    );

    // (2) Inside the grace: nothing is written, however often.
    let during = key_secret(
        &ring,
        json!({ ROTATED_FOR_ANNOTATION: "2026-12-02", ROTATED_AT_ANNOTATION: rotated_at }),
    );
    let p2 = with_status(p.clone(), &find(&seen, "PATCH", STATUS).body["status"]);
    for _ in 0..2 {
        // No Secret write, no status patch, no Event (the script has none).
        let (action, seen) = reconcile_with(&p2, during.clone(), false, vec![]).await;
        assert_eq!(find(&seen, "PATCH", STS).body, sts_before);
        assert!(
            action != Action::requeue(reconcile::REQUEUE_APPLIED),
            "rechecked at the grace's end, not the usual 5 min"
        );
    }

    // (3) After the grace (its start moved back past it): [new] only,
    // status Stable, and again the same StatefulSet.
    let long_ago = "2026-01-01T00:00:00Z";
    let after = key_secret(
        &ring,
        json!({ ROTATED_FOR_ANNOTATION: "2026-12-02", ROTATED_AT_ANNOTATION: long_ago }),
    );
    let (_, seen) = reconcile_with(
        &p2,
        after,
        true,
        vec![
            Expect::patch_status(STATUS, p2.clone()),
            Expect::create(EVENTS),
        ],
    )
    .await;
    assert!(
        seen.iter()
            .any(|s| s.path == EVENTS && s.body["reason"] == "ClusterKeyRotated")
    );
    let patch = &find(&seen, "PATCH", SECRET).body;
    assert_eq!(ring_of(patch), format!("{}\n", lines[0]));
    assert_eq!(told(&seen), new_id.as_str());
    assert!(
        patch.get("metadata").is_none(),
        "the marks are kept: {patch}"
    );
    let status = &find(&seen, "PATCH", STATUS).body["status"]["clusterKey"];
    assert_eq!(status["phase"], "Stable");
    assert_eq!(status["keyId"], rotation::key_id(lines[0]).as_str());
    assert_eq!(find(&seen, "PATCH", STS).body, sts_before);

    // (4) Settled: the same annotation writes nothing more.
    let settled = key_secret(
        &format!("{}\n", lines[0]),
        json!({ ROTATED_FOR_ANNOTATION: "2026-12-02", ROTATED_AT_ANNOTATION: long_ago }),
    );
    let p4 = with_status(p2.clone(), &find(&seen, "PATCH", STATUS).body["status"]);
    reconcile_with(&p4, settled, false, vec![]).await;
}

#[tokio::test]
async fn a_cluster_secret_ref_secret_is_never_read_or_written_by_a_rotation() {
    let mut p = annotated(proxy_json(3, true), "now", 300);
    p["spec"]["clustering"]["clusterSecretRef"] = json!({ "name": "mine", "key": "ring" });
    let (client, server) = pair();
    let (ctx, _) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, Some(config_json(SB_YML))),
        Expect::create(EVENTS),
        sts_applied(3, 3),
        applied(MESH),
        applied(SVC),
        applied(CM),
        no_pods(),
        applied(PDB),
        Expect::get(NETPOL, None),
        Expect::get(PODMON, None),
        Expect::patch_status(STATUS, p.clone()),
        Expect::create(EVENTS),
    ]);
    reconcile(proxy(&p), ctx).await.expect("reconcile");
    let seen = finish(task).await;
    assert!(
        seen.iter().all(|s| !s.path.contains("/secrets")),
        "no Secret request at all"
    );
    let warning = &seen[1].body;
    assert_eq!(warning["type"], "Warning");
    assert_eq!(warning["reason"], "ClusterKeyNotRotated");
    assert!(
        find(&seen, "PATCH", STATUS).body["status"]
            .get("clusterKey")
            .is_none_or(Value::is_null)
    );
}

// ---------------------------------------------------------------------------
// NetworkPolicy and PodMonitor (docs/reference.md#sbproxy)

fn with_extras(mut p: Value, network_policy: bool, pod_monitor: bool) -> Value {
    p["spec"]["networkPolicy"] = json!(network_policy);
    p["spec"]["podMonitor"] = json!(pod_monitor);
    p
}

/// An object as the operator applied it earlier: its labels and a uid.
fn ours(api_version: &str, kind: &str, name: &str, uid: &str) -> Value {
    json!({
        "apiVersion": api_version, "kind": kind,
        "metadata": {
            "name": name, "namespace": "default", "uid": uid,
            "labels": {
                "app.kubernetes.io/name": "sbproxy",
                "app.kubernetes.io/instance": "demo",
                "app.kubernetes.io/managed-by": "sbmesh-operator",
            },
        },
        "spec": {},
    })
}

#[tokio::test]
async fn network_policy_and_pod_monitor_are_applied_when_asked_and_deleted_when_turned_off() {
    let secret = key_secret(&format!("{KEY_OLD}\n"), json!({}));
    // On: both applied by server-side apply, after the other objects; no
    // GET of either.
    let p = with_extras(proxy_json(3, true), true, true);
    let (client, server) = pair();
    let (ctx, _) = context(client);
    let task = server.run(
        vec![
            Expect::get(CONFIG, Some(config_json(SB_YML))),
            Expect::get(SECRET, Some(secret.clone())),
        ]
        .into_iter()
        .chain(applied_ready(3, &p))
        .chain([
            applied(NETPOL),
            applied(PODMON),
            Expect::patch_status(STATUS, p.clone()),
            Expect::create(EVENTS),
        ])
        .collect(),
    );
    let action = reconcile(proxy(&p), ctx).await.expect("reconcile");
    let seen = finish(task).await;
    assert_eq!(action, Action::requeue(reconcile::REQUEUE_APPLIED));
    let policy = find(&seen, "PATCH", NETPOL);
    assert_applied_with_ssa(policy, "NetworkPolicy", "demo-mesh");
    assert_eq!(policy.body["apiVersion"], "networking.k8s.io/v1");
    assert_eq!(
        policy.body["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"],
        "demo"
    );
    let monitor = find(&seen, "PATCH", PODMON);
    assert_applied_with_ssa(monitor, "PodMonitor", "demo");
    assert_eq!(monitor.body["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(
        monitor.body["spec"]["podMetricsEndpoints"],
        json!([{ "port": "sidecar-admin", "path": "/metrics" }])
    );
    let status = &find(&seen, "PATCH", STATUS).body["status"];
    assert_eq!(condition(status, "Degraded")["status"], "False");
    let applied_note = seen[11].body["note"].as_str().unwrap_or_default();
    assert!(
        applied_note.contains("NetworkPolicy demo-mesh")
            && applied_note.contains("PodMonitor demo"),
        "{applied_note}"
    );

    // Off: each is found as the operator made it and deleted, uid-guarded,
    // with an Event each.
    let mut off = with_status(with_extras(proxy_json(3, true), false, false), status);
    off["metadata"]["generation"] = json!(2);
    let (client, server) = pair();
    let (ctx, _) = context(client);
    let task = server.run(
        vec![
            Expect::get(CONFIG, Some(config_json(SB_YML))),
            Expect::get(SECRET, Some(secret)),
        ]
        .into_iter()
        .chain(applied_ready(3, &off))
        .chain([
            Expect::get(
                NETPOL,
                Some(ours(
                    "networking.k8s.io/v1",
                    "NetworkPolicy",
                    "demo-mesh",
                    "np-uid-1",
                )),
            ),
            Expect::delete(NETPOL),
            Expect::get(
                PODMON,
                Some(ours(
                    "monitoring.coreos.com/v1",
                    "PodMonitor",
                    "demo",
                    "pm-uid-1",
                )),
            ),
            Expect::delete(PODMON),
            Expect::patch_status(STATUS, off.clone()),
            Expect::create(EVENTS),
            Expect::create(EVENTS),
            Expect::create(EVENTS),
        ])
        .collect(),
    );
    reconcile(proxy(&off), ctx).await.expect("reconcile");
    let seen = finish(task).await;
    assert_eq!(
        find(&seen, "DELETE", NETPOL).body["preconditions"]["uid"],
        "np-uid-1"
    );
    assert_eq!(
        find(&seen, "DELETE", PODMON).body["preconditions"]["uid"],
        "pm-uid-1"
    );
    let reasons: Vec<&str> = seen
        .iter()
        .filter(|s| s.path == EVENTS)
        .map(|s| s.body["reason"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        reasons,
        ["NetworkPolicyDeleted", "PodMonitorDeleted", "Applied"]
    );
    assert!(
        seen.iter()
            .all(|s| s.method != "PATCH" || (s.path != NETPOL && s.path != PODMON)),
        "nothing applied once turned off"
    );
}

#[tokio::test]
async fn a_cluster_without_prometheus_operator_gets_everything_else_and_says_what_is_missing() {
    const NOT_SERVED: &str = "spec.podMonitor is true, but this cluster does not serve \
        monitoring.coreos.com/v1 PodMonitor (applying PodMonitor default/demo answered 404). \
        Install prometheus-operator (its CRDs), or set spec.podMonitor to false; everything else \
        is applied.";
    let p = with_extras(proxy_json(1, false), false, true);
    let (client, server) = pair();
    let (ctx, metrics) = context(client);
    let task = server.run(vec![
        Expect::get(CONFIG, Some(config_json(SB_YML))),
        // Without clustering too: a key kept from when it was on.
        Expect::get(SECRET, None),
        sts_applied(1, 1),
        applied(MESH),
        applied(SVC),
        applied(CM),
        no_pods(),
        Expect::get(PDB, None),
        Expect::get(NETPOL, None),
        // What an apiserver without the CRD answers for the kind: plain
        // text, no `Status` (kube reads its reason as unparsable).
        Expect::patch(PODMON, json!({})).answer(Answer::Text(
            http::StatusCode::NOT_FOUND,
            "404 page not found",
        )),
        Expect::patch_status(STATUS, p.clone()),
        Expect::create(EVENTS),
        Expect::create(EVENTS),
    ]);
    let action = reconcile(proxy(&p), ctx).await.expect("not an error");
    let seen = finish(task).await;
    assert_eq!(
        action,
        Action::requeue(Duration::from_secs(60)),
        "looked at again soon: installing prometheus-operator clears it"
    );
    assert_eq!(metrics.reconciles_with(ReconcileResult::ok), 1);
    let status = &find(&seen, "PATCH", STATUS).body["status"];
    assert_eq!(status["lastError"], NOT_SERVED);
    let degraded = condition(status, "Degraded");
    assert_eq!(
        (
            &degraded["status"],
            &degraded["reason"],
            &degraded["message"]
        ),
        (
            &json!("True"),
            &json!("PodMonitorNotServed"),
            &json!(NOT_SERVED)
        )
    );
    assert_eq!(
        condition(status, "Ready")["status"],
        "True",
        "the pods are fine"
    );
    assert!(status["configHash"].is_string(), "the rest is applied");
    let events: Vec<&Seen> = seen.iter().filter(|s| s.path == EVENTS).collect();
    assert_eq!(events[0].body["reason"], "Applied");
    assert!(
        !events[0].body["note"]
            .as_str()
            .unwrap_or_default()
            .contains("PodMonitor"),
        "{}",
        events[0].body
    );
    assert_eq!(events[1].body["type"], "Warning");
    assert_eq!(events[1].body["reason"], "PodMonitorNotServed");
    assert_eq!(events[1].body["note"], NOT_SERVED);
}

#[tokio::test]
async fn an_invalid_pod_template_is_refused_without_workload_calls() {
    let mut p = proxy_json(3, true);
    p["spec"]["podTemplate"] =
        json!({ "sidecarEnv": [{ "name": "SBMESH_CLUSTER_ID", "value": "other" }] });
    let (status, _) = refused(p, Some(config_json(SB_YML)), "PodTemplateInvalid").await;
    assert!(
        status["lastError"].as_str().is_some_and(
            |m| m.starts_with("spec.podTemplate.sidecarEnv[0].name is SBMESH_CLUSTER_ID")
        ),
        "{status}"
    );
}
