//! `inject` on the StatefulSet and Deployment examples: the sidecar is the
//! one `render` makes, injecting twice changes nothing, and what cannot be
//! injected is said plainly.

mod render_fixtures;

use std::process::Command;

use render_fixtures as fx;
use sbmesh_operator::inject::{self, InjectError, InjectOptions};
use serde_json::{Value, json};

fn example(name: &str) -> Value {
    let docs = fx::yaml_docs(&fx::repo_dir().join("examples/k8s").join(name));
    assert_eq!(docs.len(), 1);
    docs.into_iter().next().unwrap()
}

fn opts(mesh: Option<&str>) -> InjectOptions {
    InjectOptions {
        sidecar_image: fx::SIDECAR_IMAGE.to_string(),
        cluster_id: None,
        mesh_service: mesh.map(str::to_string),
        cluster_key_secret: None,
    }
}

fn pod(manifest: &Value) -> &Value {
    &manifest["spec"]["template"]["spec"]
}

fn env_of<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
}

#[test]
fn a_statefulset_gets_the_native_sidecar_and_the_shared_volume() {
    let out = inject::inject(
        &example("inject-statefulset.yaml"),
        &opts(Some("edge-mesh")),
    )
    .unwrap();
    let pod = pod(&out);
    let init = pod["initContainers"].as_array().unwrap();
    assert_eq!(init.len(), 1);
    let side = &init[0];
    assert_eq!(side["name"], "sbmesh-sidecar");
    assert_eq!(side["restartPolicy"], "Always");
    assert_eq!(side["image"], fx::SIDECAR_IMAGE);
    assert_eq!(env_of(side, "SBMESH_CLUSTER_ID").unwrap()["value"], "edge");
    assert_eq!(
        env_of(side, "SBMESH_MESH_SERVICE").unwrap()["value"],
        "edge-mesh"
    );
    // The key ring as a file from the Secret's volume (rotation without
    // restarts), not an environment variable.
    assert!(env_of(side, "SBMESH_CLUSTER_KEY").is_none());
    assert_eq!(
        env_of(side, "SBMESH_CLUSTER_KEY_FILE").unwrap()["value"],
        "/etc/sbmesh/cluster-key/cluster-key"
    );
    let key_volume = pod["volumes"]
        .as_array()
        .and_then(|v| v.iter().find(|v| v["name"] == "sbmesh-cluster-key"))
        .expect("the cluster-key volume");
    assert_eq!(
        key_volume["secret"],
        json!({ "secretName": "edge-cluster-key", "items": [{ "key": "cluster-key", "path": "cluster-key" }] })
    );
    // The proxy's admin port is not known here: sb.yml's proxy.admin.port decides.
    assert!(env_of(side, "SBMESH_PROXY_RELOAD_URL").is_none());
    // The sidecar reads the proxy's own config volume.
    assert_eq!(
        side["volumeMounts"],
        json!([
            { "name": "config", "mountPath": "/etc/sbproxy", "readOnly": true },
            { "name": "sbproxy-data", "mountPath": "/var/lib/sbproxy" },
            { "name": "sbmesh-cluster-key", "mountPath": "/etc/sbmesh/cluster-key", "readOnly": true },
        ])
    );
    // A new emptyDir, mounted in the proxy too.
    assert!(
        pod["volumes"]
            .as_array()
            .unwrap()
            .contains(&json!({ "name": "sbproxy-data", "emptyDir": {} }))
    );
    let proxy_mounts = pod["containers"][0]["volumeMounts"].as_array().unwrap();
    assert!(
        proxy_mounts.contains(&json!({ "name": "sbproxy-data", "mountPath": "/var/lib/sbproxy" }))
    );
    // The rest of the manifest is untouched.
    assert_eq!(out["spec"]["replicas"], 2);
    assert_eq!(out["spec"]["serviceName"], "edge-mesh");
    assert_eq!(out["metadata"]["name"], "edge");
}

#[test]
fn the_pods_are_labelled_with_the_configmap_they_read() {
    let sts = example("inject-statefulset.yaml");
    let labels = |m: &Value| m["spec"]["template"]["metadata"]["labels"].clone();
    let out = inject::inject(&sts, &opts(None)).unwrap();
    assert_eq!(labels(&out)["sbproxy.dev/config-map"], "edge-config");
    // The workload's own labels stay (the selector still matches).
    assert_eq!(
        labels(&out)["app"],
        sts["spec"]["template"]["metadata"]["labels"]["app"]
    );
    // Not a ConfigMap volume (or a name too long for a label): no label,
    // and one left from an earlier injection goes.
    let mut projected = out.clone();
    projected["spec"]["template"]["spec"]["volumes"][0] = json!({
        "name": "config",
        "projected": { "sources": [{ "configMap": { "name": "edge-config" } }] }
    });
    let again = inject::inject(&projected, &opts(None)).unwrap();
    assert!(
        labels(&again).get("sbproxy.dev/config-map").is_none(),
        "{}",
        labels(&again)
    );
    let mut long = sts.clone();
    long["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] = "c".repeat(64).into();
    let out = inject::inject(&long, &opts(None)).unwrap();
    assert!(labels(&out).get("sbproxy.dev/config-map").is_none());
}

#[test]
fn the_injected_sidecar_is_the_rendered_one() {
    // Same settings on both sides: cluster id, mesh, ports, image.
    let rendered = fx::render_scenario("three-replicas-clustered");
    let rendered_sidecar = serde_json::to_value(
        &rendered
            .stateful_set
            .spec
            .unwrap()
            .template
            .spec
            .unwrap()
            .init_containers
            .unwrap()[0],
    )
    .unwrap();
    let mut sts = example("inject-statefulset.yaml");
    sts["metadata"]["name"] = "demo".into();
    let pod_spec = sts["spec"]["template"]["spec"].as_object_mut().unwrap();
    pod_spec["volumes"][0]["name"] = "sbproxy-config".into();
    pod_spec["containers"][0]["volumeMounts"][0]["name"] = "sbproxy-config".into();
    let out = inject::inject(&sts, &opts(Some("demo-mesh"))).unwrap();
    let mut injected = pod(&out)["initContainers"][0].clone();
    // Only render knows the proxy's admin port (spec.adminPort), its
    // HTTP port (spec.port, where port 80 passes ordinary requests) and
    // the Service the CA's request comes through: inject leaves the
    // passthrough off, and the challenge check on the sidecar's own
    // listener.
    let mut expected = rendered_sidecar;
    let env = expected["env"].as_array_mut().unwrap();
    env.retain(|e| {
        e["name"] != "SBMESH_PROXY_RELOAD_URL"
            && e["name"] != "SBMESH_CHALLENGE_PASSTHROUGH"
            && e["name"] != "SBMESH_ACME_CHECK_URL"
    });
    assert!(
        injected["env"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["name"] != "SBMESH_CHALLENGE_PASSTHROUGH"),
        "inject sets no passthrough: {injected}"
    );
    injected["env"]
        .as_array_mut()
        .unwrap()
        .sort_by_key(|e| e["name"].to_string());
    expected["env"]
        .as_array_mut()
        .unwrap()
        .sort_by_key(|e| e["name"].to_string());
    assert_eq!(injected, expected);
}

#[test]
fn injecting_twice_changes_nothing() {
    for (file, mesh) in [
        ("inject-statefulset.yaml", Some("edge-mesh")),
        ("inject-statefulset.yaml", None),
        ("inject-deployment.yaml", None),
    ] {
        let once = inject::inject(&example(file), &opts(mesh)).unwrap();
        let twice = inject::inject(&once, &opts(mesh)).unwrap();
        assert_eq!(once, twice, "{file}");
    }
}

#[test]
fn a_new_image_replaces_the_old_sidecar_in_place() {
    let once = inject::inject(&example("inject-deployment.yaml"), &opts(None)).unwrap();
    let mut newer = opts(None);
    newer.sidecar_image = "ghcr.io/sbproxy/sbmesh:9.9.9".into();
    let twice = inject::inject(&once, &newer).unwrap();
    let init = pod(&twice)["initContainers"].as_array().unwrap();
    assert_eq!(init.len(), 1);
    assert_eq!(init[0]["image"], "ghcr.io/sbproxy/sbmesh:9.9.9");
}

#[test]
fn a_deployment_reuses_its_volume_and_a_hand_written_sidecar_gives_way() {
    let mut deploy = example("inject-deployment.yaml");
    deploy["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({ "name": "sbmesh-sidecar", "image": "old", "args": ["run"] }));
    let mut o = opts(None);
    o.cluster_id = Some("web".into());
    let out = inject::inject(&deploy, &o).unwrap();
    let pod = pod(&out);
    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1, "the old sidecar container is gone");
    let side = &pod["initContainers"][0];
    assert_eq!(env_of(side, "SBMESH_CLUSTER_ID").unwrap()["value"], "web");
    assert!(env_of(side, "SBMESH_MESH_SERVICE").is_none());
    assert_eq!(
        side["volumeMounts"][1],
        json!({ "name": "certs", "mountPath": "/var/lib/sbproxy" })
    );
    assert_eq!(
        pod["volumes"].as_array().unwrap().len(),
        2,
        "no extra emptyDir"
    );
}

#[test]
fn what_cannot_be_injected_is_refused_with_the_fix() {
    let job = json!({ "apiVersion": "batch/v1", "kind": "Job", "metadata": { "name": "j" } });
    let e = inject::inject(&job, &opts(None)).unwrap_err();
    assert_eq!(e, InjectError::Kind("Job".into()));
    assert_eq!(
        e.to_string(),
        "kind \"Job\" cannot be injected; expected a StatefulSet or Deployment (apps/v1)"
    );

    let mut no_config = example("inject-deployment.yaml");
    no_config["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .remove(0);
    let e = inject::inject(&no_config, &opts(None)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "no container mounts a volume at /etc/sbproxy: mount the ConfigMap that holds sb.yml there \
         in the proxy container (the sidecar reads /etc/sbproxy/sb.yml), then inject again"
    );
}

#[test]
fn the_inject_command_prints_what_else_to_create() {
    let path = fx::repo_dir().join("examples/k8s/inject-statefulset.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_sbmesh-operator"))
        .args([
            "inject",
            "-f",
            path.to_str().unwrap(),
            "--mesh-service",
            "edge-mesh",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.starts_with("# The sbmesh sidecar was added by `sbmesh-operator inject`"));
    assert!(
        stdout.contains("the headless Service \"edge-mesh\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("kubectl create secret generic edge-cluster-key"),
        "{stdout}"
    );
    assert!(
        stdout.contains("# The pods are labelled sbproxy.dev/config-map: edge-config."),
        "{stdout}"
    );
    let docs = fx::yaml_docs_of(&stdout);
    assert_eq!(docs.len(), 1);
    assert_eq!(docs[0]["kind"], "StatefulSet");
    assert_eq!(pod(&docs[0])["initContainers"][0]["name"], "sbmesh-sidecar");

    let two = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: b}\n";
    let tmp = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(tmp.path(), two).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sbmesh-operator"))
        .args(["inject", "-f", tmp.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("expected one StatefulSet or Deployment document, found 2 documents")
    );
}
