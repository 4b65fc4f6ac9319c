//! The CRDs: the committed `deploy/crds.yaml` matches the code, the schema
//! defaults what docs/reference.md#sbproxy says, its ranges and CEL rules refuse what they
//! must, and the example CRs pass all of it.

mod render_fixtures;

use kube::core::cel::apply_defaults;
use kube::{CustomResourceExt, Resource};
use render_fixtures as fx;
use sbmesh_operator::crd::{self, SBProxy, SBProxyConfig, SBProxySpec};
use serde_json::{Value, json};

#[test]
fn deploy_crds_yaml_is_what_the_code_generates() {
    let path = fx::repo_dir().join("deploy/crds.yaml");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == crd::crds_yaml(),
        "{} differs from the CRDs the code generates; run \
         `cargo run -p sbmesh-operator -- crds > deploy/crds.yaml` and commit it",
        path.display()
    );
}

#[test]
fn crds_command_prints_crds_yaml() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sbmesh-operator"))
        .arg("crds")
        .output()
        .expect("run sbmesh-operator crds");
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), crd::crds_yaml());
}

#[test]
fn names_scope_columns_and_subresources() {
    let crds = crd::crds();
    assert_eq!(crds.len(), 2);
    let proxy = &crds[0];
    assert_eq!(
        proxy.metadata.name.as_deref(),
        Some("sbproxies.sbproxy.dev")
    );
    assert_eq!(proxy.spec.group, "sbproxy.dev");
    assert_eq!(proxy.spec.scope, "Namespaced");
    assert_eq!(proxy.spec.names.kind, "SBProxy");
    assert_eq!(
        proxy.spec.names.short_names.as_deref(),
        Some(&["sbp".to_string()][..])
    );
    let version = &proxy.spec.versions[0];
    assert_eq!(version.name, "v1alpha1");
    let columns: Vec<(&str, &str)> = version
        .additional_printer_columns
        .as_ref()
        .unwrap()
        .iter()
        .map(|c| (c.name.as_str(), c.json_path.as_str()))
        .collect();
    assert_eq!(
        columns,
        [
            ("Replicas", ".spec.replicas"),
            ("Ready", ".status.readyReplicas"),
            ("Config hash", ".status.configHash"),
            ("Age", ".metadata.creationTimestamp"),
        ]
    );
    assert!(version.subresources.as_ref().unwrap().status.is_some());

    let config = &crds[1];
    assert_eq!(
        config.metadata.name.as_deref(),
        Some("sbproxyconfigs.sbproxy.dev")
    );
    assert_eq!(config.spec.scope, "Namespaced");
    assert_eq!(
        config.spec.names.short_names.as_deref(),
        Some(&["sbpc".to_string()][..])
    );
    assert_eq!(SBProxyConfig::api_version(&()), "sbproxy.dev/v1alpha1");
}

fn schema_of<K: CustomResourceExt>() -> Value {
    let crd = K::crd();
    serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap()
}

fn minimal_proxy() -> Value {
    json!({
        "apiVersion": "sbproxy.dev/v1alpha1",
        "kind": "SBProxy",
        "metadata": { "name": "demo", "namespace": "default" },
        "spec": { "image": "ghcr.io/sbproxy/sbproxy:1.4.0", "configRef": { "name": "demo" } },
    })
}

#[test]
fn the_schema_defaults_what_the_spec_says_and_serde_agrees() {
    let defaulted = apply_defaults(&schema_of::<SBProxy>(), &minimal_proxy());
    let spec = &defaulted["spec"];
    assert_eq!(spec["replicas"], 1);
    assert_eq!(spec["port"], 8080);
    assert_eq!(spec["adminPort"], 9090);
    assert_eq!(
        spec["clustering"],
        json!({ "enabled": false, "gossipPort": 7946, "transportPort": 8946, "clusterDomain": "cluster.local", "keyRotationGraceSeconds": 300 })
    );
    assert_eq!(spec["networkPolicy"], false);
    assert_eq!(spec["podMonitor"], false);
    assert!(spec.get("podTemplate").is_none());
    assert_eq!(
        spec["sidecar"],
        json!({ "adminPort": 9091, "challengePort": 8089 })
    );

    // What the apiserver stores and what the controller reads agree.
    let from_serde: SBProxy = serde_json::from_value(minimal_proxy()).unwrap();
    let from_schema: SBProxy = serde_json::from_value(defaulted).unwrap();
    assert_eq!(from_serde.spec, from_schema.spec);

    // Keys of secret references default too.
    let with_refs = json!({
        "spec": { "image": "i", "configRef": { "name": "c" },
                  "adminAuthSecretRef": { "name": "a" },
                  "clustering": { "enabled": true, "clusterSecretRef": { "name": "k" } } }
    });
    let d = apply_defaults(&schema_of::<SBProxy>(), &with_refs);
    assert_eq!(d["spec"]["adminAuthSecretRef"]["key"], "authorization");
    assert_eq!(
        d["spec"]["clustering"]["clusterSecretRef"]["key"],
        "cluster-key"
    );
    assert_eq!(d["spec"]["clustering"]["gossipPort"], 7946);
    let spec: SBProxySpec = serde_json::from_value(with_refs["spec"].clone()).unwrap();
    assert_eq!(spec.admin_auth_secret_ref.unwrap().key, "authorization");
    assert_eq!(
        spec.clustering.cluster_secret_ref.unwrap().key,
        "cluster-key"
    );
}

fn with_spec(patch: Value) -> Value {
    let mut doc = minimal_proxy();
    let spec = doc["spec"].as_object_mut().unwrap();
    for (k, v) in patch.as_object().unwrap() {
        spec.insert(k.clone(), v.clone());
    }
    doc
}

fn problems(doc: &Value) -> String {
    crd::validate(doc)
        .err()
        .map(|p| p.join("\n"))
        .unwrap_or_default()
}

#[test]
fn duplicate_ports_are_refused_by_the_cel_rule() {
    for (patch, what) in [
        (json!({ "adminPort": 8080 }), "port = adminPort"),
        (
            json!({ "sidecar": { "adminPort": 9090 } }),
            "adminPort = sidecar.adminPort",
        ),
        (
            json!({ "sidecar": { "challengePort": 8080 } }),
            "port = sidecar.challengePort",
        ),
        (
            json!({ "clustering": { "transportPort": 9091 } }),
            "sidecar.adminPort = transportPort",
        ),
    ] {
        let doc = with_spec(patch);
        let p = problems(&doc);
        assert!(p.contains(crd::DISTINCT_PORTS_MESSAGE), "{what}: {p:?}");

        // kube's generated client-side check says the same.
        let proxy: SBProxy = serde_json::from_value(doc).unwrap();
        let errors = proxy.validate_cel().expect_err(what);
        assert!(
            errors.to_string().contains(crd::DISTINCT_PORTS_MESSAGE),
            "{what}: {errors}"
        );
    }
    // The gossip port is UDP: it may share a number with a TCP port.
    let ok = with_spec(json!({ "clustering": { "gossipPort": 8080 } }));
    assert_eq!(problems(&ok), "");
    let proxy: SBProxy = serde_json::from_value(ok).unwrap();
    assert!(proxy.validate_cel().is_ok());
}

#[test]
fn ranges_and_required_fields_are_refused_by_the_schema() {
    for (patch, path) in [
        (json!({ "replicas": 0 }), "spec.replicas"),
        (json!({ "replicas": 129 }), "spec.replicas"),
        (json!({ "port": 0 }), "spec.port"),
        (json!({ "adminPort": 65536 }), "spec.adminPort"),
        (
            json!({ "sidecar": { "challengePort": 70000 } }),
            "spec.sidecar.challengePort",
        ),
        (json!({ "image": "" }), "spec.image"),
        (json!({ "replica": 3 }), "spec"),
        (
            json!({ "clustering": { "enabled": "yes" } }),
            "spec.clustering.enabled",
        ),
        (json!({ "networkPolicy": "yes" }), "spec.networkPolicy"),
        // The pod template's fields are Kubernetes' own types, checked as such.
        (
            json!({ "podTemplate": { "volumez": [] } }),
            "spec.podTemplate",
        ),
        (
            json!({ "podTemplate": { "terminationGracePeriodSeconds": -1 } }),
            "spec.podTemplate.terminationGracePeriodSeconds",
        ),
        (
            json!({ "podTemplate": { "volumes": [{ "secret": { "secretName": "tls" } }] } }),
            "spec.podTemplate.volumes.0",
        ),
        (
            json!({ "podTemplate": { "tolerations": [{ "key": "a", "tolerationSeconds": "soon" }] } }),
            "spec.podTemplate.tolerations.0.tolerationSeconds",
        ),
        (
            json!({ "podTemplate": { "sidecarEnv": [{ "value": "x" }] } }),
            "spec.podTemplate.sidecarEnv.0",
        ),
    ] {
        let p = problems(&with_spec(patch.clone()));
        assert!(p.starts_with(&format!("{path}: ")), "{patch}: {p:?}");
    }
    let mut no_image = minimal_proxy();
    no_image["spec"].as_object_mut().unwrap().remove("image");
    assert!(
        problems(&no_image).contains("\"image\" is a required property"),
        "{}",
        problems(&no_image)
    );

    let big = json!({
        "apiVersion": "sbproxy.dev/v1alpha1", "kind": "SBProxyConfig",
        "metadata": { "name": "c" }, "spec": { "config": "x".repeat(1_048_577) },
    });
    assert!(problems(&big).starts_with("spec.config: "));
    let other = json!({ "apiVersion": "v1", "kind": "ConfigMap" });
    assert_eq!(
        crd::validate(&other).unwrap_err(),
        ["kind: \"ConfigMap\" is not a kind of this operator; expected SBProxy or SBProxyConfig"]
    );
}

#[test]
fn the_example_crs_pass_the_schema_and_the_cel_rules() {
    let dir = fx::repo_dir().join("examples/k8s");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("examples/k8s") {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        for doc in fx::yaml_docs(&path) {
            if doc["apiVersion"] != crd::API_VERSION {
                continue;
            }
            if let Err(p) = crd::validate(&doc) {
                panic!("{}: {}", path.display(), p.join("\n"));
            }
            if doc["kind"] == "SBProxy" {
                let proxy: SBProxy = serde_json::from_value(doc).unwrap();
                proxy
                    .validate_cel()
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
            checked += 1;
        }
    }
    assert!(
        checked >= 6,
        "expected three SBProxies and three SBProxyConfigs, checked {checked}"
    );
}

#[test]
fn the_golden_inputs_pass_the_schema_too() {
    for name in fx::SCENARIOS {
        let path = fx::golden_dir().join("inputs").join(format!("{name}.yaml"));
        for doc in fx::yaml_docs(&path) {
            if let Err(p) = crd::validate(&doc) {
                panic!("{}: {}", path.display(), p.join("\n"));
            }
        }
    }
}
