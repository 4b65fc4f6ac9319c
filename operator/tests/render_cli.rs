//! `sbmesh-operator render`, run as a user would: the built binary.

mod render_fixtures;

use std::io::Write as _;
use std::process::{Command, Output, Stdio};

use render_fixtures as fx;
use serde_json::Value;

fn operator(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sbmesh-operator"))
        .args(args)
        .env_remove("SBMESH_SIDECAR_IMAGE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sbmesh-operator");
    let mut input = child.stdin.take().unwrap();
    input
        .write_all(stdin.unwrap_or_default().as_bytes())
        .unwrap();
    drop(input);
    child.wait_with_output().expect("sbmesh-operator output")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn input(name: &str) -> String {
    fx::golden_dir()
        .join("inputs")
        .join(format!("{name}.yaml"))
        .display()
        .to_string()
}

#[test]
fn render_prints_the_objects_as_a_yaml_stream() {
    let out = operator(&["render", "-f", &input("three-replicas-clustered")], None);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let docs = fx::yaml_docs_of(&text(&out.stdout));
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ConfigMap",
            "Secret",
            "Service",
            "Service",
            "StatefulSet",
            "PodDisruptionBudget"
        ]
    );
    // A freshly generated key, 64 lowercase hex chars (base64 in `data`).
    let key = docs[1]["data"]["cluster-key"].as_str().unwrap();
    let key: k8s_openapi::ByteString = serde_json::from_value(Value::String(key.into())).unwrap();
    let key = String::from_utf8(key.0).unwrap();
    assert_eq!(key.len(), 64);
    assert!(key.chars().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(key, fx::KEY);
    // The operator's own image is the default sidecar image.
    let sidecar = &docs[4]["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(sidecar["image"], sbmesh_operator::cli::DEFAULT_IMAGE);
}

#[test]
fn render_matches_the_library_except_for_the_key_and_the_uid() {
    for name in fx::SCENARIOS {
        let out = operator(
            &[
                "render",
                "--sidecar-image",
                fx::SIDECAR_IMAGE,
                "-f",
                &input(name),
            ],
            None,
        );
        assert!(out.status.success(), "{name}: {}", text(&out.stderr));
        let mut cli = fx::yaml_docs_of(&text(&out.stdout));
        let mut lib = fx::render_scenario(name).objects();
        for doc in cli.iter_mut().chain(lib.iter_mut()) {
            // Files carry no uid: no owner reference. The Secret's key is random.
            doc["metadata"]
                .as_object_mut()
                .unwrap()
                .remove("ownerReferences");
            if doc["kind"] == "Secret" {
                doc["data"]["cluster-key"] = Value::Null;
            }
        }
        assert_eq!(cli, lib, "{name}");
    }
}

#[test]
fn render_reads_several_files_and_stdin() {
    let text_in = std::fs::read_to_string(input("byo-secret")).unwrap();
    let out = operator(
        &["render", "-f", "-", "-f", &input("one-replica-unclustered")],
        Some(&text_in),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let docs = fx::yaml_docs_of(&text(&out.stdout));
    let names: Vec<&str> = docs
        .iter()
        .map(|d| d["metadata"]["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"edge-proxy") && names.contains(&"solo-proxy"),
        "{names:?}"
    );
}

#[test]
fn a_refusal_exits_1_with_the_message_on_stderr() {
    let refused = "apiVersion: sbproxy.dev/v1alpha1\nkind: SBProxyConfig\nmetadata: { name: demo }\nspec:\n  config: |\n    proxy:\n      acme: { enabled: true, storage_backend: memory }\n---\napiVersion: sbproxy.dev/v1alpha1\nkind: SBProxy\nmetadata: { name: demo }\nspec: { image: sbproxy, configRef: { name: demo }, replicas: 2 }\n";
    let out = operator(&["render", "-f", "-"], Some(refused));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stdout),
        "",
        "nothing is printed for a refused SBProxy"
    );
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("SBProxy default/demo refused (AcmeStoreNotShared): spec.replicas is 2 and proxy.acme.enabled is true with storage_backend \"memory\", which is local to one pod."),
        "{stderr}"
    );

    // The config lives in another namespace: not found.
    let elsewhere = "apiVersion: sbproxy.dev/v1alpha1\nkind: SBProxyConfig\nmetadata: { name: demo, namespace: other }\nspec: { config: '' }\n---\napiVersion: sbproxy.dev/v1alpha1\nkind: SBProxy\nmetadata: { name: demo }\nspec: { image: sbproxy, configRef: { name: demo } }\n";
    let out = operator(&["render", "-f", "-"], Some(elsewhere));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("(ConfigNotFound)"),
        "{}",
        text(&out.stderr)
    );

    // A pod template that would undo the operator's own pod.
    let template = "apiVersion: sbproxy.dev/v1alpha1\nkind: SBProxyConfig\nmetadata: { name: demo }\nspec: { config: 'proxy: {}' }\n---\napiVersion: sbproxy.dev/v1alpha1\nkind: SBProxy\nmetadata: { name: demo }\nspec:\n  image: sbproxy\n  configRef: demo\n  podTemplate:\n    proxyVolumeMounts: [{ name: tls, mountPath: /etc/tls }]\n";
    let out = operator(&["render", "-f", "-"], Some(template));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stdout), "");
    assert_eq!(
        text(&out.stderr).trim(),
        "SBProxy default/demo refused (PodTemplateInvalid): \
         spec.podTemplate.proxyVolumeMounts[0].name is \"tls\", but the pod has no volume of that \
         name. Name one of its volumes (sbproxy-config, sbproxy-data), or add \"tls\" to \
         spec.podTemplate.volumes."
    );
}

#[test]
fn other_kinds_are_skipped_with_one_note_and_invalid_crs_are_errors_naming_the_file() {
    // Alone, another kind leaves nothing to render.
    let out = operator(
        &["render", "-f", "-"],
        Some("apiVersion: v1\nkind: ConfigMap\nmetadata: { name: x }\n"),
    );
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        text(&out.stderr).trim(),
        "note: skipped 1 document(s) of other kinds, which render does not read (it renders SBProxy and SBProxyConfig; apply the rest yourself): ConfigMap x (- (document 1))\n\
         error: no SBProxy document in the files given; nothing to render"
    );
    // Beside an SBProxy, two of them: rendered, one note for both.
    let bundle = "apiVersion: v1\nkind: Secret\nmetadata: { name: demo-admin }\nstringData: { authorization: Basic eDp5 }\n---\n\
        apiVersion: sbproxy.dev/v1alpha1\nkind: SBProxyConfig\nmetadata: { name: demo-config }\nspec: { config: \"origins: {}\" }\n---\n\
        apiVersion: v1\nkind: ConfigMap\nmetadata: { name: other }\n---\n\
        apiVersion: sbproxy.dev/v1alpha1\nkind: SBProxy\nmetadata: { name: demo }\nspec: { image: sbproxy, configRef: demo-config }\n";
    let out = operator(&["render", "-f", "-"], Some(bundle));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stderr).trim(),
        "note: skipped 2 document(s) of other kinds, which render does not read (it renders SBProxy and SBProxyConfig; apply the rest yourself): Secret demo-admin (- (document 1)), ConfigMap other (- (document 3))"
    );
    assert!(text(&out.stdout).contains("name: demo-proxy"));

    let out = operator(&["render", "-f", "-"], Some("metadata: { name: x }\n"));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("- (document 1): a document without a kind"),
        "{}",
        text(&out.stderr)
    );

    let bad = "apiVersion: sbproxy.dev/v1alpha1\nkind: SBProxy\nmetadata: { name: demo }\nspec: { image: sbproxy, configRef: { name: demo }, port: 9090 }\n";
    let out = operator(&["render", "-f", "-"], Some(bad));
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("the SBProxy is not valid:"), "{stderr}");
    assert!(
        stderr.contains(sbmesh_operator::crd::DISTINCT_PORTS_MESSAGE),
        "{stderr}"
    );

    let out = operator(&["render", "-f", "/nonexistent/sbproxy.yaml"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("cannot read /nonexistent/sbproxy.yaml"));
}
