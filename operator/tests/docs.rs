//! `docs/reference.md` stays true to the operator: every subcommand, long
//! flag and environment variable that `sbmesh-operator ... --help` prints,
//! and every field of the CRDs `sbmesh-operator crds` prints (spec and
//! status, two levels deep, as dotted paths such as
//! `spec.clustering.gossipPort`).

#[path = "../../sidecar/tests/doc_check/mod.rs"]
mod doc_check;

use std::path::PathBuf;
use std::process::Command;

use doc_check::{mentions, read_doc, undocumented_options};
use serde::Deserialize as _;
use serde_json::Value;

fn operator_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sbmesh-operator"))
}

#[test]
fn every_flag_and_variable_of_the_help_is_documented() {
    let missing = undocumented_options(
        &operator_bin(),
        &["run", "crds", "install", "render", "inject"],
        &read_doc("reference.md"),
    );
    assert!(
        missing.is_empty(),
        "docs/reference.md lacks:\n  {}",
        missing.join("\n  ")
    );
}

/// Dotted paths of `schema`'s properties under `prefix`, down to `depth`
/// levels. A core/v1 `resources` object is not descended into: it is
/// Kubernetes' ResourceRequirements, documented there.
fn field_paths(schema: &Value, prefix: &str, depth: usize, out: &mut Vec<String>) {
    let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
        return;
    };
    for (name, child) in properties {
        let path = format!("{prefix}.{name}");
        out.push(path.clone());
        if depth > 1 && name != "resources" {
            field_paths(child, &path, depth - 1, out);
        }
    }
}

fn field_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '.' || c == '_'
}

#[test]
fn every_crd_field_is_documented() {
    let out = Command::new(operator_bin())
        .arg("crds")
        .output()
        .expect("run sbmesh-operator crds");
    assert!(out.status.success(), "sbmesh-operator crds failed");
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let reference = read_doc("reference.md");
    let mut missing = Vec::new();
    let mut kinds = Vec::new();
    for document in serde_norway::Deserializer::from_str(&text) {
        let crd = Value::deserialize(document).expect("a YAML document");
        let kind = crd["spec"]["names"]["kind"]
            .as_str()
            .expect("spec.names.kind")
            .to_owned();
        if !mentions(&reference, &format!("### {kind}"), field_char) {
            missing.push(format!("a section `### {kind}`"));
        }
        let schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"];
        let mut paths = Vec::new();
        for top in ["spec", "status"] {
            if let Some(part) = schema.get(top) {
                field_paths(part, top, 2, &mut paths);
            }
        }
        assert!(!paths.is_empty(), "{kind}: no fields found in the CRD");
        for path in paths {
            if !mentions(&reference, &format!("`{path}`"), field_char) {
                missing.push(format!("{kind}: `{path}`"));
            }
        }
        kinds.push(kind);
    }
    assert_eq!(kinds, ["SBProxy", "SBProxyConfig"], "the CRDs printed");
    assert!(
        missing.is_empty(),
        "docs/reference.md lacks:\n  {}",
        missing.join("\n  ")
    );
}
