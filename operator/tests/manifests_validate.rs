//! Every manifest the operator prints passes `kubernetes-validate --strict
//! -k 1.33.0` (the official schemas of Kubernetes 1.33, offline): the
//! rendered objects of the golden scenarios and the examples, the `install`
//! output of both scopes, `deploy/crds.yaml`, the `inject` outputs and the
//! workload examples they start from.
//!
//! `scripts/test` installs kubernetes-validate and exports
//! `SBMESH_TEST_KUBE_VALIDATE`. Without it the test prints SKIP, unless
//! `SBMESH_TEST_REQUIRE_SERVERS=1` (a full `scripts/test` run), where it
//! fails. kubernetes-validate knows built-in kinds only (it merely warns
//! about an SBProxy), so the CRs are checked elsewhere (SBProxy and
//! SBProxyConfig against the generated CRD schema in `tests/crds.rs`, the
//! PodMonitor in `tests/podmonitor.rs`), and every document given here must
//! be reported as passed: a kind it skipped would be a hole.

mod render_fixtures;
#[allow(clippy::duplicate_mod)]
#[path = "../../tests/required/mod.rs"]
mod required;

use std::path::{Path, PathBuf};
use std::process::Command;

use render_fixtures as fx;
use sbmesh_operator::cli::{InstallArgs, RbacScope};
use sbmesh_operator::crd;
use sbmesh_operator::inject::{self, InjectOptions};
use sbmesh_operator::install;
use sbmesh_operator::render;
use serde_json::Value;

const KUBERNETES_VERSION: &str = "1.33.0";

fn kube_validate() -> Option<PathBuf> {
    match std::env::var_os("SBMESH_TEST_KUBE_VALIDATE") {
        Some(path) if !path.is_empty() => Some(PathBuf::from(path)),
        _ => required::missing(
            "kubernetes-validate",
            "SBMESH_TEST_KUBE_VALIDATE is not set",
            "scripts/test installs kubernetes-validate and sets it",
        ),
    }
}

/// Runs kubernetes-validate on `docs` written to `dir/name.yaml`; every
/// document must be reported as passed.
fn check(tool: &Path, dir: &Path, name: &str, docs: &[Value]) -> Result<(), String> {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, crd::yaml_stream(docs)).expect("write manifest");
    check_file(tool, &path, docs.len())
}

fn check_file(tool: &Path, path: &Path, documents: usize) -> Result<(), String> {
    let out = Command::new(tool)
        .args(["--strict", "-k", KUBERNETES_VERSION])
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", tool.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report = format!("{stdout}{stderr}");
    let passed = report
        .lines()
        .filter(|l| l.contains(" passed for resource "))
        .count();
    if out.status.success() && passed == documents && !report.contains("WARN") {
        Ok(())
    } else {
        Err(format!(
            "{}: exit {:?}, {passed} of {documents} documents passed:\n{report}",
            path.display(),
            out.status.code()
        ))
    }
}

/// The groups of the custom resources the operator reads or writes, and
/// of the Certificate of the cert-manager example.
const CUSTOM_GROUPS: [&str; 3] = ["sbproxy.dev/", "monitoring.coreos.com/", "cert-manager.io/"];

/// Only the built-in kinds of `docs` (the custom ones are checked elsewhere).
fn built_in(docs: Vec<Value>) -> Vec<Value> {
    docs.into_iter()
        .filter(|d| {
            let api_version = d["apiVersion"].as_str().unwrap_or_default();
            !CUSTOM_GROUPS.iter().any(|g| api_version.starts_with(g))
        })
        .collect()
}

#[test]
fn every_printed_manifest_passes_kubernetes_validate() {
    let Some(tool) = kube_validate() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let mut failures = Vec::new();
    let mut record = |result: Result<(), String>| {
        if let Err(e) = result {
            failures.push(e);
        }
    };

    for name in fx::SCENARIOS {
        record(check(
            &tool,
            dir.path(),
            &format!("render-{name}"),
            &built_in(fx::render_scenario(name).objects()),
        ));
    }
    // The examples, rendered as a user would, Secret and all.
    for example in ["sbproxy-redis.yaml", "sbproxy-redb.yaml"] {
        let (mut proxy, config) = fx::load(&fx::repo_dir().join("examples/k8s").join(example));
        proxy.metadata.uid = None;
        let rendered = render::render(&proxy, Some(&config), None, &fx::opts())
            .unwrap_or_else(|r| panic!("{example} refused: {r}"));
        record(check(
            &tool,
            dir.path(),
            &format!("example-{example}"),
            &rendered.objects(),
        ));
    }
    // The cert-manager example through the command a user runs: what it
    // renders (the NetworkPolicy included), and its own Service.
    let example = fx::cert_manager_example();
    let out = fx::render_file(&example);
    assert!(out.status.success(), "the cert-manager example is refused");
    let rendered = fx::yaml_docs_of(&String::from_utf8_lossy(&out.stdout));
    assert!(rendered.iter().any(|d| d["kind"] == "NetworkPolicy"));
    record(check(
        &tool,
        dir.path(),
        "example-cert-manager-rendered",
        &rendered,
    ));
    record(check(
        &tool,
        dir.path(),
        "example-cert-manager-own",
        &built_in(fx::yaml_docs(&example)),
    ));
    // The guide's manifests as they are (tests/seed_manifests.rs), through
    // the command a user runs.
    for name in fx::SEEDS_RENDERED {
        let out = fx::render_seed(name);
        assert!(out.status.success(), "{name} refused");
        let docs = fx::yaml_docs_of(&String::from_utf8_lossy(&out.stdout));
        record(check(&tool, dir.path(), &format!("seed-{name}"), &docs));
    }
    for (scope, name) in [
        (RbacScope::Namespace, "namespace"),
        (RbacScope::Cluster, "cluster"),
    ] {
        let args = InstallArgs {
            namespace: "sbmesh-system".into(),
            rbac_scope: scope,
            image: sbmesh_operator::cli::DEFAULT_IMAGE.into(),
        };
        record(check(
            &tool,
            dir.path(),
            &format!("install-{name}"),
            &install::install_objects(&args),
        ));
    }
    let crds = fx::repo_dir().join("deploy/crds.yaml");
    record(check_file(&tool, &crds, fx::yaml_docs(&crds).len()));

    for (example, mesh) in [
        ("inject-statefulset.yaml", Some("edge-mesh")),
        ("inject-statefulset.yaml", None),
        ("inject-deployment.yaml", None),
    ] {
        let path = fx::repo_dir().join("examples/k8s").join(example);
        record(check_file(&tool, &path, 1));
        let manifest = fx::yaml_docs(&path).remove(0);
        let opts = InjectOptions {
            sidecar_image: fx::SIDECAR_IMAGE.into(),
            cluster_id: None,
            mesh_service: mesh.map(str::to_string),
            cluster_key_secret: None,
        };
        let injected = inject::inject(&manifest, &opts).expect("inject");
        let name = format!(
            "inject-{}-{}",
            example.trim_end_matches(".yaml"),
            mesh.unwrap_or("alone")
        );
        record(check(&tool, dir.path(), &name, &[injected]));
    }
    // Files under examples/k8s with built-in kinds only, whole.
    for entry in std::fs::read_dir(fx::repo_dir().join("examples/k8s")).unwrap() {
        let path = entry.unwrap().path();
        let docs = fx::yaml_docs(&path);
        let own = built_in(docs.clone());
        if !own.is_empty() && own.len() == docs.len() {
            record(check_file(&tool, &path, docs.len()));
        }
    }

    assert!(
        failures.is_empty(),
        "kubernetes-validate refused:\n{}",
        failures.join("\n")
    );
}

#[test]
fn kubernetes_validate_does_refuse_a_bad_manifest() {
    // Guards the check above: a tool that passed everything would prove nothing.
    let Some(tool) = kube_validate() else { return };
    let dir = tempfile::tempdir().expect("temp dir");
    let mut sts =
        serde_json::to_value(fx::render_scenario("one-replica-unclustered").stateful_set).unwrap();
    sts["spec"]["replicaz"] = Value::from(3);
    let err = check(&tool, dir.path(), "bad", &[sts]).expect_err("a bad StatefulSet must fail");
    assert!(err.contains("replicaz"), "{err}");
}
