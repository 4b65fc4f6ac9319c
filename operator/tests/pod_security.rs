//! Every pod the operator makes is admitted by a namespace labelled
//! `pod-security.kubernetes.io/enforce: restricted`: the pod templates
//! `render` prints for the seed manifests (and the golden scenarios, and
//! proxies on ports below 1024), and the operator Deployment `install`
//! prints, are each checked against the rules of the Pod Security
//! Standards' `restricted` profile (which includes `baseline`), as the
//! PodSecurity admission controller of Kubernetes 1.33 applies them
//! (<https://kubernetes.io/docs/concepts/security/pod-security-standards/>).
//! Every violation is listed, with the field that breaks the rule.

mod render_fixtures;

use std::process::Command;

use render_fixtures as fx;
use sbmesh_operator::render;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------
// The profile

/// Capabilities `restricted` lets a container add.
const ADDABLE_CAPABILITIES: [&str; 1] = ["NET_BIND_SERVICE"];

/// Volume types `restricted` allows.
const ALLOWED_VOLUME_TYPES: [&str; 8] = [
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
];

/// The sysctls `baseline` allows (the kubelet's safe set).
const SAFE_SYSCTLS: [&str; 10] = [
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
];

/// SELinux types `baseline` allows (besides none).
const SELINUX_TYPES: [&str; 4] = [
    "container_t",
    "container_init_t",
    "container_kvm_t",
    "container_engine_t",
];

fn is_true(v: &Value) -> bool {
    v.as_bool() == Some(true)
}

/// The violations of `restricted` in a pod template (`metadata` + `spec`),
/// each as `<where>: <rule>`.
fn restricted_violations(template: &Value) -> Vec<String> {
    let spec = &template["spec"];
    let pod_sc = &spec["securityContext"];
    let mut out = Vec::new();
    let mut bad = |at: String, rule: &str| out.push(format!("{at}: {rule}"));

    // baseline: host namespaces, HostProcess.
    for field in ["hostNetwork", "hostPID", "hostIPC"] {
        if is_true(&spec[field]) {
            bad(format!("spec.{field}"), "host namespaces are not allowed");
        }
    }
    if is_true(&pod_sc["windowsOptions"]["hostProcess"]) {
        bad(
            "spec.securityContext.windowsOptions.hostProcess".into(),
            "HostProcess pods are not allowed",
        );
    }
    // baseline: sysctls.
    for (i, sysctl) in pod_sc["sysctls"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let name = sysctl["name"].as_str().unwrap_or_default();
        if !SAFE_SYSCTLS.contains(&name) {
            bad(
                format!("spec.securityContext.sysctls[{i}] ({name})"),
                "only the safe sysctls are allowed",
            );
        }
    }
    // baseline: hostPath; restricted: volume types.
    for (i, volume) in spec["volumes"].as_array().into_iter().flatten().enumerate() {
        let name = volume["name"].as_str().unwrap_or_default();
        let types: Vec<&String> = volume
            .as_object()
            .into_iter()
            .flat_map(|o| o.keys())
            .filter(|k| *k != "name")
            .collect();
        for kind in types {
            if !ALLOWED_VOLUME_TYPES.contains(&kind.as_str()) {
                bad(
                    format!("spec.volumes[{i}] ({name}).{kind}"),
                    "volume type not allowed (hostPath never; only configMap, csi, downwardAPI, \
                     emptyDir, ephemeral, persistentVolumeClaim, projected, secret)",
                );
            }
        }
    }
    // Pod-level settings the containers inherit.
    check_security_context(pod_sc, "spec.securityContext", &mut bad);
    let pod_non_root = is_true(&pod_sc["runAsNonRoot"]);
    let pod_seccomp = seccomp_ok(&pod_sc["seccompProfile"]);
    // baseline: AppArmor annotations.
    for (key, value) in template["metadata"]["annotations"]
        .as_object()
        .into_iter()
        .flatten()
    {
        if key.starts_with("container.apparmor.security.beta.kubernetes.io/") {
            let value = value.as_str().unwrap_or_default();
            if value != "runtime/default" && !value.starts_with("localhost/") {
                bad(
                    format!("metadata.annotations[{key}]"),
                    "AppArmor must be runtime/default or localhost/*",
                );
            }
        }
    }

    for list in ["initContainers", "containers", "ephemeralContainers"] {
        for (i, c) in spec[list].as_array().into_iter().flatten().enumerate() {
            let name = c["name"].as_str().unwrap_or_default();
            let at = format!("spec.{list}[{i}] ({name})");
            let sc = &c["securityContext"];
            if is_true(&sc["privileged"]) {
                bad(
                    format!("{at}.securityContext.privileged"),
                    "privileged containers are not allowed",
                );
            }
            if is_true(&sc["windowsOptions"]["hostProcess"]) {
                bad(
                    format!("{at}.securityContext.windowsOptions.hostProcess"),
                    "HostProcess containers are not allowed",
                );
            }
            if sc["procMount"].as_str().is_some_and(|m| m != "Default") {
                bad(
                    format!("{at}.securityContext.procMount"),
                    "procMount must be Default",
                );
            }
            for (j, port) in c["ports"].as_array().into_iter().flatten().enumerate() {
                if port["hostPort"].as_i64().is_some_and(|p| p != 0) {
                    bad(
                        format!("{at}.ports[{j}].hostPort"),
                        "host ports are not allowed",
                    );
                }
            }
            check_security_context(sc, &format!("{at}.securityContext"), &mut bad);
            // restricted: no privilege escalation, explicitly.
            if sc["allowPrivilegeEscalation"].as_bool() != Some(false) {
                bad(
                    format!("{at}.securityContext.allowPrivilegeEscalation"),
                    "must be false",
                );
            }
            // restricted: runAsNonRoot, here or on the pod, never false here.
            match sc["runAsNonRoot"].as_bool() {
                Some(false) => bad(
                    format!("{at}.securityContext.runAsNonRoot"),
                    "must not be false",
                ),
                None if !pod_non_root => bad(
                    format!("{at}.securityContext.runAsNonRoot"),
                    "must be true (here or in spec.securityContext)",
                ),
                _ => {}
            }
            // restricted: seccomp RuntimeDefault or Localhost, here or on the pod.
            if sc["seccompProfile"].is_null() && !pod_seccomp {
                bad(
                    format!("{at}.securityContext.seccompProfile"),
                    "must be RuntimeDefault or Localhost (here or in spec.securityContext)",
                );
            }
            // restricted: drop ALL, add NET_BIND_SERVICE at most.
            let caps = &sc["capabilities"];
            let drops_all = caps["drop"]
                .as_array()
                .is_some_and(|d| d.iter().any(|c| c == "ALL"));
            if !drops_all {
                bad(
                    format!("{at}.securityContext.capabilities.drop"),
                    "must include ALL",
                );
            }
            for added in caps["add"].as_array().into_iter().flatten() {
                let added = added.as_str().unwrap_or_default();
                if !ADDABLE_CAPABILITIES.contains(&added) {
                    bad(
                        format!("{at}.securityContext.capabilities.add ({added})"),
                        "only NET_BIND_SERVICE may be added",
                    );
                }
            }
        }
    }
    out
}

fn seccomp_ok(profile: &Value) -> bool {
    matches!(
        profile["type"].as_str(),
        Some("RuntimeDefault" | "Localhost")
    )
}

/// The rules a pod's or a container's securityContext must keep either
/// way: no root uid, no Unconfined seccomp, AppArmor and SELinux within
/// what `baseline` allows.
fn check_security_context(sc: &Value, at: &str, bad: &mut impl FnMut(String, &str)) {
    if sc["runAsUser"].as_i64() == Some(0) {
        bad(format!("{at}.runAsUser"), "must not be 0 (root)");
    }
    let seccomp = &sc["seccompProfile"];
    if !seccomp.is_null() && !seccomp_ok(seccomp) {
        bad(
            format!("{at}.seccompProfile.type"),
            "must be RuntimeDefault or Localhost",
        );
    }
    if let Some(kind) = sc["appArmorProfile"]["type"].as_str()
        && kind != "RuntimeDefault"
        && kind != "Localhost"
    {
        bad(
            format!("{at}.appArmorProfile.type"),
            "must be RuntimeDefault or Localhost",
        );
    }
    let selinux = &sc["seLinuxOptions"];
    if let Some(kind) = selinux["type"].as_str()
        && !kind.is_empty()
        && !SELINUX_TYPES.contains(&kind)
    {
        bad(
            format!("{at}.seLinuxOptions.type"),
            "SELinux type not allowed",
        );
    }
    for field in ["user", "role"] {
        if selinux[field].as_str().is_some_and(|v| !v.is_empty()) {
            bad(format!("{at}.seLinuxOptions.{field}"), "must not be set");
        }
    }
}

// ---------------------------------------------------------------------------
// The pods the operator makes

/// `(Kind/name, pod template)` of every workload among `objects`.
fn pod_templates(objects: &[Value]) -> Vec<(String, Value)> {
    objects
        .iter()
        .filter_map(|o| {
            let kind = o["kind"].as_str()?;
            let template = match kind {
                "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
                    o["spec"]["template"].clone()
                }
                "CronJob" => o["spec"]["jobTemplate"]["spec"]["template"].clone(),
                "Pod" => json!({ "metadata": o["metadata"], "spec": o["spec"] }),
                _ => return None,
            };
            Some((
                format!("{kind}/{}", o["metadata"]["name"].as_str()?),
                template,
            ))
        })
        .collect()
}

/// Checks every pod template of `objects` (from `source`); returns the
/// templates checked and every violation, each prefixed by where it is.
fn check_all(source: &str, objects: &[Value], violations: &mut Vec<String>) -> usize {
    let templates = pod_templates(objects);
    for (workload, template) in &templates {
        for v in restricted_violations(template) {
            violations.push(format!("{source} {workload} {v}"));
        }
    }
    templates.len()
}

fn assert_none(violations: &[String]) {
    assert!(
        violations.is_empty(),
        "pods that a namespace enforcing `restricted` would refuse:\n  {}",
        violations.join("\n  ")
    );
}

#[test]
fn the_rendered_seed_manifests_are_restricted() {
    let mut violations = Vec::new();
    for name in fx::SEEDS_RENDERED {
        let out = fx::render_seed(name);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let objects = fx::yaml_docs_of(&String::from_utf8_lossy(&out.stdout));
        let checked = check_all(
            &format!("render -f {name}.yaml:"),
            &objects,
            &mut violations,
        );
        assert_eq!(checked, 1, "{name}: one StatefulSet");
    }
    assert_none(&violations);
}

#[test]
fn the_golden_scenarios_and_low_ports_are_restricted() {
    let mut violations = Vec::new();
    for name in fx::SCENARIOS {
        let objects = fx::render_scenario(name).objects();
        check_all(&format!("{name}:"), &objects, &mut violations);
    }
    // Ports below 1024: the proxy adds NET_BIND_SERVICE (allowed), the pod
    // a safe sysctl.
    let config = fx::config(
        "proxy:\n  admin: { enabled: true, port: 9090 }\n  http_bind_port: 80\n  https_bind_port: 443\n",
    );
    let proxy = fx::proxy(
        "image: sbproxy\nconfigRef: demo\nport: 80\nclustering: { enabled: true }\nsidecar: { challengePort: 81 }\n",
    );
    let rendered = render::render(&proxy, Some(&config), None, &fx::opts()).unwrap();
    let sts = serde_json::to_value(&rendered.stateful_set).unwrap();
    let proxy_caps =
        &sts["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"];
    assert_eq!(proxy_caps["add"], json!(["NET_BIND_SERVICE"]));
    check_all("ports 80/443:", &rendered.objects(), &mut violations);
    assert_none(&violations);
}

#[test]
fn the_installed_operator_is_restricted() {
    let mut violations = Vec::new();
    for scope in ["namespace", "cluster"] {
        let out = Command::new(env!("CARGO_BIN_EXE_sbmesh-operator"))
            .args([
                "install",
                "--namespace",
                "sbmesh-system",
                "--rbac-scope",
                scope,
            ])
            .output()
            .expect("run sbmesh-operator install");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let objects = fx::yaml_docs_of(&String::from_utf8_lossy(&out.stdout));
        let checked = check_all(
            &format!("install --rbac-scope {scope}:"),
            &objects,
            &mut violations,
        );
        assert!(checked >= 1, "{scope}: no workload in the install output");
    }
    assert_none(&violations);
}

/// The check is no rubber stamp: a pod breaking each rule is refused for
/// each, and the proxy container as it was before it dropped every
/// capability is refused for that.
#[test]
fn the_check_names_every_rule_a_pod_breaks() {
    let bad = json!({
        "metadata": { "annotations": {
            "container.apparmor.security.beta.kubernetes.io/app": "unconfined"
        } },
        "spec": {
            "hostNetwork": true, "hostPID": true, "hostIPC": true,
            "securityContext": {
                "runAsUser": 0,
                "seccompProfile": { "type": "Unconfined" },
                "sysctls": [{ "name": "kernel.msgmax", "value": "1" }],
                "seLinuxOptions": { "type": "spc_t", "user": "root" }
            },
            "volumes": [
                { "name": "host", "hostPath": { "path": "/" } },
                { "name": "nfs", "nfs": { "server": "x", "path": "/" } },
                { "name": "ok", "emptyDir": {} }
            ],
            "containers": [{
                "name": "app",
                "ports": [{ "containerPort": 80, "hostPort": 80 }],
                "securityContext": {
                    "privileged": true,
                    "runAsNonRoot": false,
                    "procMount": "Unmasked",
                    "capabilities": { "add": ["SYS_ADMIN", "NET_BIND_SERVICE"] }
                }
            }]
        }
    });
    let found = restricted_violations(&bad);
    for expected in [
        "spec.hostNetwork: ",
        "spec.hostPID: ",
        "spec.hostIPC: ",
        "spec.securityContext.sysctls[0] (kernel.msgmax): ",
        "spec.volumes[0] (host).hostPath: ",
        "spec.volumes[1] (nfs).nfs: ",
        "spec.securityContext.runAsUser: ",
        "spec.securityContext.seccompProfile.type: ",
        "spec.securityContext.seLinuxOptions.type: ",
        "spec.securityContext.seLinuxOptions.user: ",
        "metadata.annotations[container.apparmor.security.beta.kubernetes.io/app]: ",
        "spec.containers[0] (app).securityContext.privileged: ",
        "spec.containers[0] (app).securityContext.procMount: ",
        "spec.containers[0] (app).ports[0].hostPort: ",
        "spec.containers[0] (app).securityContext.allowPrivilegeEscalation: ",
        "spec.containers[0] (app).securityContext.runAsNonRoot: must not be false",
        "spec.containers[0] (app).securityContext.seccompProfile: ",
        "spec.containers[0] (app).securityContext.capabilities.drop: ",
        "spec.containers[0] (app).securityContext.capabilities.add (SYS_ADMIN): ",
    ] {
        assert!(
            found.iter().any(|v| v.starts_with(expected)),
            "{expected:?} not in {found:#?}"
        );
    }
    assert_eq!(found.len(), 19, "{found:#?}");

    // The proxy container with what it had before: no capabilities dropped.
    let rendered = fx::render_scenario("three-replicas-clustered");
    let mut sts = serde_json::to_value(&rendered.stateful_set).unwrap();
    sts["spec"]["template"]["spec"]["containers"][0]["securityContext"] =
        json!({ "allowPrivilegeEscalation": false });
    assert_eq!(
        restricted_violations(&sts["spec"]["template"]),
        ["spec.containers[0] (proxy).securityContext.capabilities.drop: must include ALL"]
    );
}
