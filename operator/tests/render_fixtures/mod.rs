//! Inputs shared by the render, inject and manifest tests: the golden
//! scenarios (tests/golden/inputs/*.yaml), fixed render options, and small
//! builders for one-off SBProxies.
#![allow(dead_code)] // each test crate uses a different part

use std::path::{Path, PathBuf};

use sbmesh_operator::crd::{SBProxy, SBProxyConfig};
use sbmesh_operator::render::{self, RenderOptions, Rendered};
use serde_json::Value;

/// The golden scenarios, by file stem.
pub const SCENARIOS: &[&str] = &[
    "one-replica-unclustered",
    "three-replicas-clustered",
    "byo-secret",
    "acme-redis",
    "pod-template",
];

/// The uid every fixture SBProxy gets, as if read from a cluster.
pub const UID: &str = "5b7c8a52-3a5e-4f3b-9a59-0c7e1c2d9e10";

/// A fixed cluster key, so golden output is stable.
pub const KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// The sidecar image passed as the operator's own.
pub const SIDECAR_IMAGE: &str = "ghcr.io/sbproxy/sbmesh:test";

pub fn operator_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn repo_dir() -> PathBuf {
    operator_dir().join("..")
}

/// `Kind/name` of each object, in order.
pub fn kinds(objects: &[Value]) -> Vec<String> {
    objects
        .iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"].as_str().unwrap_or_default(),
                o["metadata"]["name"].as_str().unwrap_or_default()
            )
        })
        .collect()
}

/// Our versions of the manifests of sbproxy's own Kubernetes guide (the
/// shapes its users apply as they are).
pub fn seed_dir() -> PathBuf {
    operator_dir().join("tests/seed_manifests")
}

/// The seed manifests the operator renders, and the one it refuses.
pub const SEEDS_RENDERED: [&str; 4] = ["demo", "hot-reload", "clustered", "acme-redis"];
pub const SEED_REFUSED: &str = "acme-redb";

/// `sbmesh-operator render -f <seed>.yaml`.
pub fn render_seed(name: &str) -> std::process::Output {
    render_file(&seed_dir().join(format!("{name}.yaml")))
}

/// `sbmesh-operator render -f <path>`, as a user runs it.
pub fn render_file(path: &Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_sbmesh-operator"))
        .arg("render")
        .arg("-f")
        .arg(path)
        .env_remove("SBMESH_SIDECAR_IMAGE")
        .output()
        .expect("run sbmesh-operator render")
}

/// The example of a cert-manager certificate mounted into the pods.
pub fn cert_manager_example() -> PathBuf {
    repo_dir().join("examples/k8s/sbproxy-cert-manager.yaml")
}

pub fn golden_dir() -> PathBuf {
    operator_dir().join("tests/golden")
}

pub fn opts() -> RenderOptions {
    RenderOptions {
        sidecar_image: SIDECAR_IMAGE.to_string(),
        fresh_cluster_key: KEY.to_string(),
    }
}

/// Every document of a YAML file, as JSON.
pub fn yaml_docs(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    yaml_docs_of(&text)
}

pub fn yaml_docs_of(text: &str) -> Vec<Value> {
    use serde::Deserialize as _;
    serde_norway::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).expect("valid YAML document"))
        .filter(|v| !v.is_null())
        .collect()
}

/// The SBProxy and SBProxyConfig of a file, the SBProxy with [`UID`].
pub fn load(path: &Path) -> (SBProxy, SBProxyConfig) {
    let mut proxy = None;
    let mut config = None;
    for doc in yaml_docs(path) {
        match doc["kind"].as_str() {
            Some("SBProxy") => proxy = Some(serde_json::from_value(doc).expect("an SBProxy")),
            Some("SBProxyConfig") => {
                config = Some(serde_json::from_value(doc).expect("an SBProxyConfig"))
            }
            other => panic!("{}: unexpected kind {other:?}", path.display()),
        }
    }
    let mut proxy: SBProxy = proxy.expect("an SBProxy document");
    proxy.metadata.uid = Some(UID.to_string());
    (proxy, config.expect("an SBProxyConfig document"))
}

pub fn scenario(name: &str) -> (SBProxy, SBProxyConfig) {
    load(&golden_dir().join("inputs").join(format!("{name}.yaml")))
}

pub fn render_scenario(name: &str) -> Rendered {
    let (proxy, config) = scenario(name);
    render::render(&proxy, Some(&config), None, &opts())
        .unwrap_or_else(|r| panic!("{name} refused: {r}"))
}

/// An SBProxy `demo` in `default` with `spec` (YAML) and [`UID`].
pub fn proxy(spec_yaml: &str) -> SBProxy {
    let spec: Value = serde_norway::from_str(spec_yaml).expect("spec YAML");
    let doc = serde_json::json!({
        "apiVersion": "sbproxy.dev/v1alpha1",
        "kind": "SBProxy",
        "metadata": { "name": "demo", "namespace": "default", "uid": UID },
        "spec": spec,
    });
    serde_json::from_value(doc).expect("an SBProxy")
}

/// An SBProxyConfig `demo` in `default` holding `text`.
pub fn config(text: &str) -> SBProxyConfig {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "sbproxy.dev/v1alpha1",
        "kind": "SBProxyConfig",
        "metadata": { "name": "demo", "namespace": "default" },
        "spec": { "config": text },
    }))
    .expect("an SBProxyConfig")
}
