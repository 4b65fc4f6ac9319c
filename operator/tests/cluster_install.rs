//! Installing the operator on the real cluster as a user does:
//! `sbmesh-operator install | kubectl apply -f -`, first with
//! `--rbac-scope namespace`, then `cluster`. The operator runs as its own
//! ServiceAccount under exactly the RBAC `install` renders (a 403 anywhere
//! fails the test), 2 replicas, one holding the Lease; the guide's basic
//! SBProxy answers through its Service.
//!
//! `scripts/test` runs this binary before `cluster_e2e`, alone: it leaves
//! the cluster-scope operator installed for those tests.

mod cluster;

use std::time::Duration;

use cluster::{
    Cluster, LEADER_LEASE, Namespace, OPERATOR_DEPLOYMENT, OPERATOR_NAMESPACE, mock_answer,
    operator, wait_for, wait_for_answer,
};

/// Waits for the operator Deployment in `ns` to have its 2 replicas
/// available and one of its pods to hold the Lease; answers the holder.
fn operator_running(c: &Cluster, ns: &str) -> String {
    wait_for(
        &format!("2 available operator replicas in {ns}"),
        Duration::from_secs(180),
        || {
            let d = c.get(&["-n", ns, "deployment", OPERATOR_DEPLOYMENT])?;
            (d["spec"]["replicas"] == 2 && d["status"]["availableReplicas"] == 2).then_some(())
        },
    );
    wait_for(
        &format!("the Lease {ns}/{LEADER_LEASE} held by a running operator pod"),
        Duration::from_secs(120),
        || {
            let lease = c.get(&["-n", ns, "lease", LEADER_LEASE])?;
            let holder = lease["spec"]["holderIdentity"].as_str()?.to_string();
            c.operator_pods(ns)
                .iter()
                .any(|p| p["metadata"]["name"] == holder.as_str() && cluster::pod_ready(p))
                .then_some(holder)
        },
    )
}

/// Every running operator pod in `ns` runs as the `sbmesh-operator`
/// ServiceAccount with that account's token mounted: read from the pods,
/// not from what `install` printed.
fn runs_as_its_own_service_account(c: &Cluster, ns: &str) {
    let pods: Vec<_> = c
        .operator_pods(ns)
        .into_iter()
        .filter(|p| p["status"]["phase"] == "Running")
        .collect();
    assert_eq!(pods.len(), 2, "2 running operator pods in {ns}");
    for pod in &pods {
        let name = &pod["metadata"]["name"];
        assert_eq!(
            pod["spec"]["serviceAccountName"], "sbmesh-operator",
            "operator pod {ns}/{name} runs as its own ServiceAccount"
        );
        assert_ne!(
            pod["spec"]["automountServiceAccountToken"], false,
            "operator pod {ns}/{name} has its ServiceAccount's token"
        );
    }
}

/// No request of the operator's was refused: its logs name no 403.
fn no_forbidden(c: &Cluster, ns: &str) {
    let pods = c.operator_pods(ns);
    assert!(
        !pods.is_empty(),
        "no operator pod in {ns} whose logs to read"
    );
    for pod in &pods {
        let name = pod["metadata"]["name"].as_str().expect("name");
        let logs = c.must(&["-n", ns, "logs", name]);
        assert!(
            !logs.trim().is_empty(),
            "operator pod {ns}/{name} logged nothing"
        );
        for line in logs.lines() {
            let lower = line.to_ascii_lowercase();
            assert!(
                !lower.contains("forbidden") && !line.contains(" 403") && !line.contains("\"403"),
                "operator pod {ns}/{name} was refused something: {line}"
            );
        }
    }
}

/// The basic SBProxy of the guide in `ns.name`: Ready, and the proxy answers
/// through `demo-svc`.
fn basic_answers(ns: &Namespace) {
    let c = Cluster::from_env().expect("cluster");
    c.apply(&ns.seed("demo"));
    ns.condition("demo", "Ready", "True", None);
    let pods = ns.ready_pods("demo", 2);
    assert_eq!(pods.len(), 2);
    let url = format!("http://{}:8080/", ns.cluster_ip("demo-svc"));
    wait_for_answer(
        &url,
        "demo.example.com",
        &mock_answer("hello from sbproxy\n"),
        Duration::from_secs(60),
    );
}

#[test]
fn install_namespace_scope_then_cluster_scope() {
    let Some(c) = Cluster::from_env() else { return };

    // 1. Namespace scope: the operator manages its own namespace only.
    let scoped = Namespace::new(&c, "e2e-install", &[]);
    let yaml = operator(&[
        "install",
        "--namespace",
        &scoped.name,
        "--rbac-scope",
        "namespace",
    ]);
    c.apply(&yaml);
    let leader = operator_running(&c, &scoped.name);
    eprintln!("namespace scope: {leader} holds the Lease");
    runs_as_its_own_service_account(&c, &scoped.name);
    basic_answers(&scoped);
    no_forbidden(&c, &scoped.name);
    c.must(&[
        "delete",
        "namespace",
        &scoped.name,
        "--wait=true",
        "--timeout=180s",
    ]);
    // Its cluster-wide objects (the webhook's; the cluster-scope install
    // below makes them again).
    c.must(&[
        "delete",
        "mutatingwebhookconfiguration",
        "sbmesh-sidecar-injector",
    ]);
    c.must(&["delete", "clusterrole", "sbmesh-operator-webhook"]);
    c.must(&["delete", "clusterrolebinding", "sbmesh-operator-webhook"]);
    drop(scoped);

    // 2. Cluster scope, in its default namespace; left installed for cluster_e2e.
    let _ = c.kubectl(&[
        "delete",
        "namespace",
        OPERATOR_NAMESPACE,
        "--wait=true",
        "--timeout=180s",
    ]);
    c.apply(&operator(&["install", "--rbac-scope", "cluster"]));
    let leader = operator_running(&c, OPERATOR_NAMESPACE);
    eprintln!("cluster scope: {leader} holds the Lease");
    runs_as_its_own_service_account(&c, OPERATOR_NAMESPACE);
    let basic = Namespace::new(&c, "e2e-basic", &[]);
    basic_answers(&basic);
    no_forbidden(&c, OPERATOR_NAMESPACE);
}
