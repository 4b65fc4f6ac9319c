//! `install`: the whole installation, with exactly the RBAC the controller
//! needs, for both scopes.

mod render_fixtures;

use std::process::Command;

use render_fixtures as fx;
use sbmesh_operator::cli::{InstallArgs, RbacScope};
use sbmesh_operator::install;
use serde_json::{Value, json};

fn args(scope: RbacScope) -> InstallArgs {
    InstallArgs {
        namespace: "sbmesh-system".into(),
        rbac_scope: scope,
        image: "ghcr.io/sbproxy/sbmesh:1.2.3".into(),
    }
}

/// The controller's rules, written out here (not taken from the const) so
/// that a change to the table has to be made on purpose in two places.
fn expected_controller_rules() -> Value {
    json!([
        { "apiGroups": ["sbproxy.dev"], "resources": ["sbproxies"], "verbs": ["list", "watch"] },
        { "apiGroups": ["sbproxy.dev"], "resources": ["sbproxies/status"], "verbs": ["patch"] },
        { "apiGroups": ["sbproxy.dev"], "resources": ["sbproxyconfigs"], "verbs": ["get", "list", "watch"] },
        { "apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["list", "watch", "create", "patch"] },
        { "apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch", "create", "patch"] },
        { "apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "create", "patch"] },
        { "apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "list", "watch", "create", "patch", "delete"] },
        { "apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "list", "watch", "create", "patch", "delete"] },
        { "apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"] },
        { "apiGroups": ["monitoring.coreos.com"], "resources": ["podmonitors"], "verbs": ["get", "create", "patch", "delete"] },
        { "apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "patch"] },
        { "apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"] },
    ])
}

fn expected_leader_rules() -> Value {
    json!([
        { "apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"] },
    ])
}

fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn env<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
}

#[test]
fn namespace_scope_is_a_role_in_the_operator_namespace() {
    let objects = install::install_objects(&args(RbacScope::Namespace));
    assert_eq!(
        fx::kinds(&objects),
        [
            "CustomResourceDefinition/sbproxies.sbproxy.dev",
            "CustomResourceDefinition/sbproxyconfigs.sbproxy.dev",
            "Namespace/sbmesh-system",
            "ServiceAccount/sbmesh-operator",
            "Role/sbmesh-operator",
            "RoleBinding/sbmesh-operator",
            "Role/sbmesh-operator-leader",
            "RoleBinding/sbmesh-operator-leader",
            "ClusterRole/sbmesh-operator-webhook",
            "ClusterRoleBinding/sbmesh-operator-webhook",
            "Deployment/sbmesh-operator",
            "Service/sbmesh-operator-webhook",
            "MutatingWebhookConfiguration/sbmesh-sidecar-injector",
        ]
    );
    let role = find(&objects, "Role", "sbmesh-operator");
    assert_eq!(role["metadata"]["namespace"], "sbmesh-system");
    assert_eq!(role["rules"], expected_controller_rules());
    let leader = find(&objects, "Role", "sbmesh-operator-leader");
    assert_eq!(leader["rules"], expected_leader_rules());
    for binding in ["sbmesh-operator", "sbmesh-operator-leader"] {
        let b = find(&objects, "RoleBinding", binding);
        assert_eq!(
            b["roleRef"],
            json!({ "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": binding })
        );
        assert_eq!(
            b["subjects"],
            json!([{ "kind": "ServiceAccount", "name": "sbmesh-operator", "namespace": "sbmesh-system" }])
        );
    }

    let deploy = find(&objects, "Deployment", "sbmesh-operator");
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["args"], json!(["run", "--namespace", "sbmesh-system"]));
    assert_eq!(
        env(c, "SBMESH_OPERATOR_NAMESPACE").unwrap()["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
}

#[test]
fn cluster_scope_is_a_cluster_role_and_the_lease_stays_namespaced() {
    let objects = install::install_objects(&args(RbacScope::Cluster));
    assert_eq!(
        fx::kinds(&objects)[4..8],
        [
            "ClusterRole/sbmesh-operator",
            "ClusterRoleBinding/sbmesh-operator",
            "Role/sbmesh-operator-leader",
            "RoleBinding/sbmesh-operator-leader",
        ]
    );
    let role = find(&objects, "ClusterRole", "sbmesh-operator");
    assert!(role["metadata"]["namespace"].is_null());
    assert_eq!(role["rules"], expected_controller_rules());
    assert_eq!(
        find(&objects, "Role", "sbmesh-operator-leader")["rules"],
        expected_leader_rules()
    );
    assert!(
        !objects
            .iter()
            .any(|o| o["kind"] == "Role" && o["metadata"]["name"] == "sbmesh-operator")
    );

    let deploy = find(&objects, "Deployment", "sbmesh-operator");
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["args"], json!(["run", "--all-namespaces"]));
    // run refuses --all-namespaces together with a namespace.
    assert!(env(c, "SBMESH_OPERATOR_NAMESPACE").is_none());
}

#[test]
fn the_deployment_runs_two_hardened_replicas() {
    let objects = install::install_objects(&args(RbacScope::Namespace));
    let deploy = find(&objects, "Deployment", "sbmesh-operator");
    assert_eq!(deploy["metadata"]["namespace"], "sbmesh-system");
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "sbmesh-operator");
    let c = &pod["containers"][0];
    assert_eq!(c["image"], "ghcr.io/sbproxy/sbmesh:1.2.3");
    assert_eq!(c["command"], json!(["/usr/local/bin/sbmesh-operator"]));
    assert_eq!(
        env(c, "SBMESH_SIDECAR_IMAGE").unwrap()["value"],
        "ghcr.io/sbproxy/sbmesh:1.2.3"
    );
    assert_eq!(
        env(c, "POD_NAME").unwrap()["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    assert_eq!(
        c["ports"],
        json!([
            { "name": "metrics", "containerPort": 8080, "protocol": "TCP" },
            { "name": "webhook", "containerPort": 10250, "protocol": "TCP" },
        ])
    );
    assert_eq!(
        c["livenessProbe"]["httpGet"],
        json!({ "path": "/healthz", "port": "metrics" })
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"],
        json!({ "path": "/readyz", "port": "metrics" }),
        "ready once its webhook can answer"
    );
    assert_eq!(
        deploy["spec"]["template"]["metadata"]["annotations"]["sbproxy.dev/inject"], "disabled",
        "its own pods never wait on its webhook"
    );
    let sc = &c["securityContext"];
    assert_eq!(sc["runAsNonRoot"], true);
    assert_eq!(sc["runAsUser"], 65532);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert!(c["resources"]["requests"].is_object());
}

#[test]
fn the_install_command_prints_the_same_objects() {
    for (scope, flag) in [
        (RbacScope::Namespace, "namespace"),
        (RbacScope::Cluster, "cluster"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_sbmesh-operator"))
            .args([
                "install",
                "--namespace",
                "sbmesh-system",
                "--rbac-scope",
                flag,
                "--image",
                "ghcr.io/sbproxy/sbmesh:1.2.3",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let docs = fx::yaml_docs_of(&String::from_utf8(out.stdout).unwrap());
        assert_eq!(docs, install::install_objects(&args(scope)), "{flag}");
    }
}

/// The webhook's objects: the Service on 443 to the pods' `webhook` port,
/// and the configuration: two webhooks (a labelled namespace; a pod's own
/// annotation elsewhere) that send only opted-in pods without a sidecar,
/// `failurePolicy: Ignore`, 5 s, no side effects; the ClusterRole may only
/// write that configuration and list namespaces.
#[test]
fn the_webhook_is_a_service_a_configuration_and_a_narrow_cluster_role() {
    let objects = install::install_objects(&args(RbacScope::Cluster));
    let svc = find(&objects, "Service", "sbmesh-operator-webhook");
    assert_eq!(svc["metadata"]["namespace"], "sbmesh-system");
    assert_eq!(
        svc["spec"]["ports"],
        json!([{ "name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP" }])
    );
    let deploy = find(&objects, "Deployment", "sbmesh-operator");
    assert_eq!(
        svc["spec"]["selector"],
        deploy["spec"]["selector"]["matchLabels"]
    );
    let conf = find(
        &objects,
        "MutatingWebhookConfiguration",
        "sbmesh-sidecar-injector",
    );
    let hooks = conf["webhooks"].as_array().unwrap();
    let names: Vec<&str> = hooks.iter().map(|h| h["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["namespace.inject.sbproxy.dev", "pod.inject.sbproxy.dev"]
    );
    for h in hooks {
        assert_eq!(h["failurePolicy"], "Ignore");
        assert_eq!(h["timeoutSeconds"], 5);
        assert_eq!(h["sideEffects"], "None");
        assert_eq!(h["admissionReviewVersions"], json!(["v1"]));
        assert_eq!(
            h["clientConfig"]["service"],
            json!({ "name": "sbmesh-operator-webhook", "namespace": "sbmesh-system", "path": "/inject", "port": 443 })
        );
        assert!(
            h["clientConfig"]["caBundle"].is_null(),
            "written by the operator"
        );
        assert_eq!(
            h["rules"],
            json!([{ "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"], "scope": "Namespaced" }])
        );
        let conditions = h["matchConditions"].to_string();
        assert!(conditions.contains("sbmesh-sidecar"), "{conditions}");
    }
    assert_eq!(
        hooks[0]["namespaceSelector"],
        json!({ "matchExpressions": [{ "key": "sbproxy.dev/inject", "operator": "In", "values": ["enabled"] }] })
    );
    assert_eq!(
        hooks[1]["namespaceSelector"],
        json!({ "matchExpressions": [{ "key": "sbproxy.dev/inject", "operator": "NotIn", "values": ["enabled"] }] })
    );
    let role = find(&objects, "ClusterRole", "sbmesh-operator-webhook");
    assert_eq!(
        role["rules"],
        json!([
            { "apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"], "resourceNames": ["sbmesh-sidecar-injector"], "verbs": ["get", "patch"] },
            { "apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"] },
        ])
    );

    // Namespace scope: its own namespace only.
    let objects = install::install_objects(&args(RbacScope::Namespace));
    let conf = find(
        &objects,
        "MutatingWebhookConfiguration",
        "sbmesh-sidecar-injector",
    );
    for h in conf["webhooks"].as_array().unwrap() {
        let exprs = h["namespaceSelector"]["matchExpressions"]
            .as_array()
            .unwrap();
        assert!(exprs.contains(&json!({
            "key": "kubernetes.io/metadata.name", "operator": "In", "values": ["sbmesh-system"]
        })));
    }
}

/// `install | head -0`: the reader is gone before the first write; the
/// command ends quietly (exit 0, no panic on the closed pipe), as shell
/// tools do.
#[test]
fn install_into_a_closed_pipe_ends_quietly() {
    use std::process::Stdio;
    for args in [&["install"][..], &["crds"][..]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sbmesh-operator"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("sbmesh-operator runs");
        // The read end closes before the command writes a byte.
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("it exits");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?}: {stderr}", out.status);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
