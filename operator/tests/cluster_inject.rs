//! Sidecar injection by the operator's admission webhook on the real
//! cluster (SPEC section 13): the real kube-apiserver calls the webhook
//! through its Service, as it does for Linkerd's and Istio's injectors.
//!
//! A user's own StatefulSet of the real sbproxy, written without a sidecar,
//! in a namespace labelled `sbproxy.dev/inject=enabled`: every pod gets the
//! sidecar `inject` would add and the three form a mesh. Without the label,
//! or with the opt-out annotation, no pod gets it; an SBProxy's own pods
//! are not injected twice.

mod cluster;

use std::time::Duration;

use cluster::{
    Cluster, Namespace, OPERATOR_NAMESPACE, dry_run_pod, percentile, sidecars, wait_for,
};

/// What a user writes beside the StatefulSet for a mesh: the ConfigMap with
/// sb.yml, the headless Service and the cluster-key Secret.
fn supporting_objects(ns: &str) -> String {
    format!(
        r#"{config}---
apiVersion: v1
kind: Service
metadata: {{ name: edge-mesh, namespace: {ns} }}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector: {{ app: edge }}
  ports:
  - {{ name: gossip, port: 7946, protocol: UDP }}
  - {{ name: transport, port: 8946, protocol: TCP }}
---
apiVersion: v1
kind: Secret
metadata: {{ name: edge-cluster-key, namespace: {ns} }}
stringData: {{ cluster-key: "{key}" }}
"#,
        key = sbmesh_operator::render::fresh_cluster_key(),
        config = cluster::edge_config(ns, "edge"),
    )
}

/// The user's StatefulSet of the real sbproxy: no sidecar, the restricted
/// standard's security settings, `annotations` on its pod template.
fn statefulset(ns: &str, replicas: usize, annotations: &str) -> String {
    format!(
        r#"apiVersion: apps/v1
kind: StatefulSet
metadata: {{ name: edge, namespace: {ns} }}
spec:
  replicas: {replicas}
  serviceName: edge-mesh
  podManagementPolicy: Parallel
  selector:
    matchLabels: {{ app: edge }}
  template:
    metadata:
      labels: {{ app: edge }}
      annotations: {{ {annotations} }}
    spec:
      securityContext:
        runAsNonRoot: true
        runAsUser: 65532
        runAsGroup: 65532
        fsGroup: 65532
        seccompProfile: {{ type: RuntimeDefault }}
      containers:
      - name: proxy
        image: soapbucket/sbproxy:1.13.0
        imagePullPolicy: Never
        ports:
        - {{ name: http, containerPort: 8080 }}
        securityContext:
          allowPrivilegeEscalation: false
          capabilities: {{ drop: [ALL] }}
        volumeMounts:
        - {{ name: config, mountPath: /etc/sbproxy, readOnly: true }}
      volumes:
      - name: config
        configMap: {{ name: edge-config }}
"#
    )
}

/// `sbmesh_injections_total{result}` over the operator's replicas.
fn injections(c: &Cluster, result: &str) -> f64 {
    c.operator_pods(OPERATOR_NAMESPACE)
        .iter()
        .filter_map(|p| {
            let ip = p["status"]["podIP"].as_str()?;
            let (_, body) = cluster::curl(&[&format!("http://{ip}:8080/metrics")]).ok()?;
            body.lines().find_map(|l| {
                l.strip_prefix(&format!("sbmesh_injections_total{{result=\"{result}\"}} "))?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
        })
        .sum()
}

/// Waits until the webhook answers: both operator replicas Ready (their
/// readiness waits for the serving certificate) and the configuration's
/// `caBundle` written.
fn webhook_ready(c: &Cluster) {
    c.operator();
    wait_for(
        "the injection webhook's caBundle written and both operator replicas Ready",
        Duration::from_secs(120),
        || {
            let conf = c.get(&["mutatingwebhookconfiguration", "sbmesh-sidecar-injector"])?;
            let hooks = conf["webhooks"].as_array()?;
            let bundled = hooks.iter().all(|h| {
                h["clientConfig"]["caBundle"]
                    .as_str()
                    .is_some_and(|b| !b.is_empty())
            });
            let pods = c.operator_pods(OPERATOR_NAMESPACE);
            (bundled && pods.len() == 2 && pods.iter().all(cluster::pod_ready)).then_some(())
        },
    );
}

/// Tests 1 and 3 of the issue: a labelled namespace that enforces the
/// restricted standard; a user's StatefulSet annotated with its mesh
/// Service and key Secret; every pod injected, admitted, meshed.
#[test]
fn a_labelled_namespaces_own_statefulset_gets_the_sidecar_and_forms_a_mesh() {
    let Some(c) = Cluster::from_env() else { return };
    webhook_ready(&c);
    let ns = Namespace::new(
        &c,
        "e2e-webhook",
        &[
            ("sbproxy.dev/inject", "enabled"),
            ("pod-security.kubernetes.io/enforce", "restricted"),
            ("pod-security.kubernetes.io/enforce-version", "latest"),
        ],
    );
    let injected_before = injections(&c, "injected");
    c.apply(&supporting_objects(&ns.name));
    c.apply(&statefulset(
        &ns.name,
        3,
        "sbproxy.dev/mesh-service: edge-mesh, sbproxy.dev/cluster-key-secret: edge-cluster-key",
    ));
    // A pod refused (by the restricted standard, or by the webhook) never
    // exists; the StatefulSet's events say why.
    let pods = wait_for("3 Ready injected pods", Duration::from_secs(240), || {
        let refused = ns.refused_creations();
        assert!(refused.is_empty(), "pods refused: {refused}");
        let pods = ns.pods("app=edge");
        (pods.len() == 3 && pods.iter().all(cluster::pod_ready)).then_some(pods)
    });
    for pod in &pods {
        let name = &pod["metadata"]["name"];
        assert_eq!(sidecars(pod), 1, "{name}: one sbmesh-sidecar");
        assert!(
            pod["metadata"]["annotations"]["sbproxy.dev/injected"].is_string(),
            "{name} carries sbproxy.dev/injected"
        );
        let sidecar = pod["spec"]["initContainers"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["name"] == "sbmesh-sidecar"))
            .expect("the sidecar as a native sidecar");
        assert_eq!(sidecar["image"], c.sbmesh_image.as_str(), "{name}");
    }
    cluster::mesh_of(&pods, 3);
    // As a user checks it: `sbmesh-sidecar status` in a pod.
    let status = ns
        .kubectl(&[
            "exec",
            "edge-1",
            "-c",
            "sbmesh-sidecar",
            "--",
            "/usr/local/bin/sbmesh-sidecar",
            "status",
        ])
        .expect("sbmesh-sidecar status in edge-1");
    eprintln!("sbmesh-sidecar status in edge-1:\n{status}");
    assert!(
        status.contains("cluster edge, local node edge-1: 3 nodes ("),
        "{status}"
    );
    let injected = injections(&c, "injected") - injected_before;
    assert!(
        injected >= 3.0,
        "sbmesh_injections_total{{result=\"injected\"}} rose by {injected}, not 3"
    );
}

/// Test 2 of the issue: no label, no sidecar; the label and the opt-out
/// annotation, no sidecar; an SBProxy's own pods in a labelled namespace
/// keep their one sidecar.
#[test]
fn no_label_or_opted_out_gets_no_sidecar_and_an_sbproxy_is_not_injected_twice() {
    let Some(c) = Cluster::from_env() else { return };
    webhook_ready(&c);
    let plain = Namespace::new(&c, "e2e-webhook-off", &[]);
    c.apply(&supporting_objects(&plain.name));
    c.apply(&statefulset(&plain.name, 1, ""));
    let labelled = Namespace::new(&c, "e2e-webhook-out", &[("sbproxy.dev/inject", "enabled")]);
    c.apply(&supporting_objects(&labelled.name));
    c.apply(&statefulset(
        &labelled.name,
        1,
        "sbproxy.dev/inject: disabled",
    ));
    c.apply(&labelled.seed("clustered"));
    for (ns, why) in [(&plain, "no label"), (&labelled, "opted out")] {
        let pods = ns.ready("app=edge", &format!("edge ({why})"), 1);
        assert_eq!(sidecars(&pods[0]), 0, "{why}: injected");
        assert!(
            pods[0]["metadata"]["annotations"]["sbproxy.dev/injected"].is_null(),
            "{why}"
        );
    }
    let fleet = labelled.ready_pods("demo", 3);
    for pod in &fleet {
        let name = &pod["metadata"]["name"];
        assert_eq!(sidecars(pod), 1, "{name}: the SBProxy's one sidecar");
        assert!(
            pod["metadata"]["annotations"]["sbproxy.dev/injected"].is_null(),
            "{name} went through the webhook"
        );
    }
    // The operator's own pods carry the opt-out: they never wait on
    // their own webhook.
    for pod in c.operator_pods(OPERATOR_NAMESPACE) {
        assert_eq!(
            pod["metadata"]["annotations"]["sbproxy.dev/inject"],
            "disabled"
        );
    }
}

/// The leader Lease's holder.
fn leader(c: &Cluster) -> String {
    c.get(&["-n", OPERATOR_NAMESPACE, "lease", cluster::LEADER_LEASE])
        .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
        .expect("the leader Lease's holder")
}

/// Test 4 of the issue: both replicas answer admissions. The leading
/// operator pod is deleted (as a drain or a rollout does) while pods are
/// created: every creation before, during and after is injected, the ones
/// after by the standby (asserted from its log), and a replacement is
/// Ready beside it.
#[test]
fn with_the_leader_deleted_pods_are_still_injected() {
    let Some(c) = Cluster::from_env() else { return };
    webhook_ready(&c);
    let ns = Namespace::new(
        &c,
        "e2e-webhook-leader",
        &[("sbproxy.dev/inject", "enabled")],
    );
    let (pod, _) = dry_run_pod(&ns);
    assert_eq!(sidecars(&pod), 1, "injected before the deletion");
    let killed = leader(&c);
    let standby = operator_pod_names(&c)
        .into_iter()
        .find(|p| *p != killed)
        .expect("a standby operator pod beside the leader");
    let standby_before = admissions(&c, &standby, &ns);
    c.must(&[
        "-n",
        OPERATOR_NAMESPACE,
        "delete",
        "pod",
        &killed,
        "--wait=false",
    ]);
    // Creations for 30 s, and on until the deleted pod is gone and five
    // more were made: a pod being deleted keeps answering on its open
    // connections through its grace period, so only once it is gone must
    // the standby answer.
    let start = std::time::Instant::now();
    let mut creations = 0;
    let mut after_gone = 0;
    while start.elapsed() < Duration::from_secs(30) || after_gone < 5 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the deleted leader {killed} still there 120 s after its deletion"
        );
        if !operator_pod_names(&c).contains(&killed) {
            after_gone += 1;
        }
        let (pod, _) = dry_run_pod(&ns);
        assert_eq!(
            sidecars(&pod),
            1,
            "a pod created {:.1} s after the leader's deletion has no sidecar",
            start.elapsed().as_secs_f64()
        );
        creations += 1;
    }
    // With the deleted pod gone, the creations went to the standby or to
    // the replacement once Ready (the API server's connection to the
    // Service lands on either).
    let by_standby = admissions(&c, &standby, &ns) - standby_before;
    let replacement = cluster::wait_for(
        &format!("a Ready replacement of {killed}"),
        Duration::from_secs(90),
        || {
            c.operator_pods(OPERATOR_NAMESPACE)
                .into_iter()
                .find(|p| {
                    p["metadata"]["name"] != killed.as_str()
                        && p["metadata"]["name"] != standby.as_str()
                        && cluster::pod_ready(p)
                })
                .and_then(|p| p["metadata"]["name"].as_str().map(str::to_string))
        },
    );
    let by_replacement = admissions(&c, &replacement, &ns);
    assert!(
        by_standby + by_replacement >= 5,
        "of the {creations} creations after the deletion, the standby {standby} answered \
         {by_standby} and the replacement {replacement} {by_replacement}: the five made after \
         {killed} was gone went to neither"
    );
    let now = leader(&c);
    eprintln!(
        "leader {killed} deleted: {creations} creations in {:.0} s, every one injected, \
         {by_standby} answered by the standby {standby} and {by_replacement} by the replacement \
         {replacement}; leader now {now}",
        start.elapsed().as_secs_f64()
    );
    c.operator();
}

/// The names of the operator's pods.
fn operator_pod_names(c: &Cluster) -> Vec<String> {
    c.operator_pods(OPERATOR_NAMESPACE)
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .collect()
}

/// How many admissions of pods in `ns` the operator pod `pod` logged (it
/// logs each one it answers, with the pod's namespace).
fn admissions(c: &Cluster, pod: &str, ns: &Namespace) -> usize {
    let logs = c.must(&["-n", OPERATOR_NAMESPACE, "logs", pod]);
    let marker = format!("{}/", ns.name);
    logs.lines()
        .filter(|l| l.contains("admission") && l.contains(&marker))
        .count()
}

/// Test 5 of the issue: the serving certificate renews while pods are
/// created. The operator runs with 60-s certificates (renewed every 40 s)
/// from a fresh Secret; every creation is injected across two renewals and
/// 20 s after the second, and the CA in `caBundle` never changes. The creations' latency is the webhook's figure (BENCHMARKS.md).
#[test]
fn the_serving_certificate_renews_and_no_creation_goes_without_the_sidecar() {
    let Some(c) = Cluster::from_env() else { return };
    webhook_ready(&c);
    let ns = Namespace::new(
        &c,
        "e2e-webhook-renew",
        &[("sbproxy.dev/inject", "enabled")],
    );
    let set_lifetime = |value: Option<&str>| {
        let setting = match value {
            Some(v) => format!("SBMESH_WEBHOOK_CERT_LIFETIME_SECS={v}"),
            None => "SBMESH_WEBHOOK_CERT_LIFETIME_SECS-".to_string(),
        };
        c.must(&[
            "-n",
            OPERATOR_NAMESPACE,
            "set",
            "env",
            "deployment/sbmesh-operator",
            &setting,
        ]);
        c.must(&[
            "-n",
            OPERATOR_NAMESPACE,
            "rollout",
            "status",
            "deployment/sbmesh-operator",
            "--timeout=180s",
        ]);
    };
    // The shortest life the operator takes: renewed every 40 s.
    set_lifetime(Some("60"));
    // A fresh Secret with a 60-s certificate (a new CA too: this one
    // change of caBundle is before the window).
    c.must(&[
        "-n",
        OPERATOR_NAMESPACE,
        "delete",
        "secret",
        "sbmesh-operator-webhook-tls",
    ]);
    let secret = |key: &str| {
        c.get(&[
            "-n",
            OPERATOR_NAMESPACE,
            "secret",
            "sbmesh-operator-webhook-tls",
        ])
        .and_then(|s| s["data"][key].as_str().map(str::to_string))
    };
    let bundle = || {
        c.get(&["mutatingwebhookconfiguration", "sbmesh-sidecar-injector"])
            .and_then(|m| {
                m["webhooks"][0]["clientConfig"]["caBundle"]
                    .as_str()
                    .map(str::to_string)
            })
    };
    let ca = wait_for(
        "a new webhook CA in caBundle",
        Duration::from_secs(60),
        || {
            let ca = secret("ca.crt")?;
            (bundle().as_deref() == Some(ca.as_str())).then_some(ca)
        },
    );
    // Both replicas serve the new certificate once each has read the
    // Secret (every 10 s).
    std::thread::sleep(Duration::from_secs(12));
    // The window: until two renewals are done and both replicas have read
    // the second (their 10-s reads, twice over), or 150 s.
    let mut certificates = std::collections::BTreeSet::new();
    let mut latencies = Vec::new();
    let start = std::time::Instant::now();
    let mut renewed_twice: Option<std::time::Instant> = None;
    while start.elapsed() < Duration::from_secs(150)
        && renewed_twice.is_none_or(|at| at.elapsed() < Duration::from_secs(20))
    {
        if let Some(crt) = secret("tls.crt") {
            certificates.insert(crt);
        }
        if certificates.len() >= 3 && renewed_twice.is_none() {
            renewed_twice = Some(std::time::Instant::now());
        }
        let (pod, took) = dry_run_pod(&ns);
        assert_eq!(
            sidecars(&pod),
            1,
            "a creation {:.1} s into the renewals has no sidecar",
            start.elapsed().as_secs_f64()
        );
        latencies.push(took);
        assert_eq!(
            secret("ca.crt").as_deref(),
            Some(ca.as_str()),
            "the CA changed"
        );
        assert_eq!(bundle().as_deref(), Some(ca.as_str()), "caBundle changed");
    }
    let n = latencies.len();
    eprintln!(
        "renewals: {} serving certificates over {:.0} s, {n} creations all injected; \
         kubectl create --dry-run=server p50 {:.0} ms, p99 {:.0} ms",
        certificates.len(),
        start.elapsed().as_secs_f64(),
        percentile(&mut latencies, 0.5).as_secs_f64() * 1000.0,
        percentile(&mut latencies, 0.99).as_secs_f64() * 1000.0,
    );
    assert!(
        certificates.len() >= 3,
        "{} certificates: no two renewals",
        certificates.len()
    );
    set_lifetime(None);
    c.operator();
}

/// Test 6 of the issue: with the operator scaled to 0, a pod created in an
/// opted-in namespace is admitted without the sidecar at once (no endpoint
/// behind the webhook's Service: `failurePolicy: Ignore`), as the
/// reference says; once the operator is back, it reports the pod: a Warning
/// Event `SidecarNotInjected` on it, `sbmesh_injections_total{result="missed"}`
/// and a log line naming it.
#[test]
fn with_the_operator_at_zero_a_pod_goes_without_the_sidecar_and_is_reported_once_it_is_back() {
    let Some(c) = Cluster::from_env() else { return };
    webhook_ready(&c);
    let ns = Namespace::new(&c, "e2e-webhook-down", &[("sbproxy.dev/inject", "enabled")]);
    c.apply(&supporting_objects(&ns.name));
    let took = {
        let _stopped = c.operator_stopped();
        let start = std::time::Instant::now();
        c.apply(&statefulset(&ns.name, 1, ""));
        let pod = wait_for("the pod edge-0 created", Duration::from_secs(60), || {
            ns.get(&["pod", "edge-0"])
        });
        let took = start.elapsed();
        assert_eq!(sidecars(&pod), 0, "injected with no operator running?");
        took
    };
    eprintln!(
        "operator at 0: edge-0 admitted without the sidecar {:.1} s after the apply",
        took.as_secs_f64()
    );
    let back = std::time::Instant::now();
    let event = wait_for(
        "a SidecarNotInjected Event on edge-0",
        Duration::from_secs(120),
        || {
            let events = ns.get(&[
                "events",
                "--field-selector",
                "reason=SidecarNotInjected,involvedObject.name=edge-0",
            ])?;
            events["items"].as_array()?.first().cloned()
        },
    );
    eprintln!(
        "reported {:.1} s after the operator was back: {}",
        back.elapsed().as_secs_f64(),
        event["message"]
    );
    assert_eq!(event["type"], "Warning");
    assert!(
        injections(&c, "missed") >= 1.0,
        "no missed injection counted"
    );
    let logged = c.operator_pods(OPERATOR_NAMESPACE).iter().any(|p| {
        let name = p["metadata"]["name"].as_str().unwrap_or_default();
        c.kubectl(&["-n", OPERATOR_NAMESPACE, "logs", name])
            .is_ok_and(|l| l.contains(&format!("{}/edge-0", ns.name)) && l.contains("missed"))
    });
    assert!(logged, "no operator log line names {}/edge-0", ns.name);
    // Deleted, it comes back with the sidecar.
    ns.kubectl(&["delete", "pod", "edge-0"])
        .expect("kubectl delete pod");
    let pods = ns.ready("app=edge", "edge after its deletion", 1);
    assert_eq!(sidecars(&pods[0]), 1);
}
