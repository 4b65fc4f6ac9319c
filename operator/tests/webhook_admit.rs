//! The injection webhook's decision (`admit::admit`) on AdmissionReviews as
//! the API server sends them: the pods of the `inject` examples get exactly
//! the sidecar `inject` gives their workload, opting out and a sidecar
//! already there are left alone, and bad input is refused or passed
//! through as docs/reference.md says, never a crash.

mod render_fixtures;

use base64::Engine as _;
use render_fixtures as fx;
use sbmesh_operator::admit::{self, Defaults, Injection};
use sbmesh_operator::inject::{self, InjectOptions};
use serde_json::{Value, json};

fn example(name: &str) -> Value {
    fx::yaml_docs(&fx::repo_dir().join("examples/k8s").join(name)).remove(0)
}

fn defaults() -> Defaults {
    Defaults {
        sidecar_image: fx::SIDECAR_IMAGE.to_string(),
        version: "9.9.9".to_string(),
    }
}

/// The pod a workload's controller creates from its template: its
/// metadata (name, owner, annotations) and the template's spec.
fn pod_of(workload: &Value, name: &str, owner: (&str, &str), annotations: Value) -> Value {
    let template = &workload["spec"]["template"];
    let mut labels = template["metadata"]["labels"].clone();
    if owner.0 == "ReplicaSet" {
        labels["pod-template-hash"] = json!("5d8f7c6b9");
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "edge",
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": owner.0, "name": owner.1,
                "uid": "0b1c", "controller": true,
            }],
        },
        "spec": template["spec"].clone(),
    })
}

fn review(pod: &Value, operation: &str) -> Vec<u8> {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": { "group": "", "version": "v1", "kind": "Pod" },
            "resource": { "group": "", "version": "v1", "resource": "pods" },
            "requestKind": { "group": "", "version": "v1", "kind": "Pod" },
            "requestResource": { "group": "", "version": "v1", "resource": "pods" },
            "name": pod["metadata"]["name"],
            "namespace": "edge",
            "operation": operation,
            "userInfo": { "username": "system:serviceaccount:kube-system:statefulset-controller" },
            "object": pod,
            "oldObject": null,
            "dryRun": false,
            "options": { "apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions" },
        },
    })
    .to_string()
    .into_bytes()
}

/// The pod's volume of the key ring's Secret.
fn key_volume(pod: &Value) -> Value {
    pod["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["secret"]["secretName"].is_string())
        .expect("the key ring's volume")
        .clone()
}

/// The response's patch applied to `pod`.
fn patched(pod: &Value, decision: &admit::Decision) -> Value {
    let response = &decision.review["response"];
    assert_eq!(response["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
    assert_eq!(response["allowed"], true);
    assert_eq!(response["patchType"], "JSONPatch");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().expect("a patch"))
        .expect("base64");
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
    let mut out = pod.clone();
    json_patch::patch(&mut out, &patch).expect("the patch applies to the pod it was made for");
    out
}

#[test]
fn a_statefulsets_pod_gets_exactly_the_sidecar_inject_gives_its_template() {
    let sts = example("inject-statefulset.yaml");
    let annotations = json!({
        "sbproxy.dev/mesh-service": "edge-mesh",
        "sbproxy.dev/cluster-key-secret": "edge-key",
    });
    let pod = pod_of(&sts, "edge-1", ("StatefulSet", "edge"), annotations);
    let decision = admit::admit(&review(&pod, "CREATE"), &defaults()).expect("a review");
    assert_eq!(decision.result, Injection::injected, "{}", decision.reason);
    assert_eq!(decision.pod, "edge/edge-1");
    let after = patched(&pod, &decision);

    // `inject` on the workload with the same settings: the same pod spec,
    // so the webhook, `inject` and `render` (one `sidecar_container`)
    // cannot drift apart.
    let by_inject = inject::inject(
        &sts,
        &InjectOptions {
            sidecar_image: fx::SIDECAR_IMAGE.to_string(),
            cluster_id: None,
            mesh_service: Some("edge-mesh".to_string()),
            cluster_key_secret: Some("edge-key".to_string()),
        },
    )
    .unwrap();
    assert_eq!(after["spec"], by_inject["spec"]["template"]["spec"]);
    assert_eq!(
        after["metadata"]["labels"],
        by_inject["spec"]["template"]["metadata"]["labels"]
    );
    assert_eq!(
        after["metadata"]["annotations"]["sbproxy.dev/injected"],
        "9.9.9"
    );
    let init = after["spec"]["initContainers"].as_array().unwrap();
    let side = init.iter().find(|c| c["name"] == "sbmesh-sidecar").unwrap();
    let env = |name: &str| {
        side["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].clone())
    };
    assert_eq!(
        env("SBMESH_CLUSTER_ID"),
        Some(json!("edge")),
        "the StatefulSet's name"
    );
    assert_eq!(env("SBMESH_MESH_SERVICE"), Some(json!("edge-mesh")));
    let key_volume = key_volume(&after);
    assert_eq!(key_volume["secret"]["secretName"], "edge-key");

    // Admitted again (a re-sent request, a second configuration): left
    // alone, as it has the sidecar now.
    let again = admit::admit(&review(&after, "CREATE"), &defaults()).unwrap();
    assert_eq!(again.result, Injection::skipped);
    assert!(again.review["response"]["patch"].is_null());
}

#[test]
fn a_deployments_pod_is_named_after_the_deployment_and_takes_its_annotations() {
    let deploy = example("inject-deployment.yaml");
    let name = deploy["metadata"]["name"].as_str().unwrap().to_string();
    let annotations = json!({
        "sbproxy.dev/inject": "enabled",
        "sbproxy.dev/mesh-service": "web-mesh",
        "sbproxy.dev/cluster-id": "blue",
        "sbproxy.dev/sidecar-image": "registry.local/sbmesh:dev",
    });
    let mut pod = pod_of(
        &deploy,
        "",
        ("ReplicaSet", &format!("{name}-5d8f7c6b9")),
        annotations,
    );
    pod["metadata"]["generateName"] = json!(format!("{name}-5d8f7c6b9-"));
    let decision = admit::admit(&review(&pod, "CREATE"), &defaults()).unwrap();
    assert_eq!(decision.result, Injection::injected, "{}", decision.reason);
    assert_eq!(decision.pod, format!("edge/{name}-5d8f7c6b9-*"));
    let after = patched(&pod, &decision);
    let side = after["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "sbmesh-sidecar")
        .unwrap()
        .clone();
    assert_eq!(side["image"], "registry.local/sbmesh:dev");
    let text = side.to_string();
    assert!(
        text.contains("\"blue\""),
        "cluster id from the annotation: {text}"
    );
    let key_volume = key_volume(&after);
    assert_eq!(
        key_volume["secret"]["secretName"],
        format!("{name}-cluster-key").as_str(),
        "the Deployment's name, not the ReplicaSet's"
    );
}

#[test]
fn opted_out_a_sidecar_already_there_and_not_a_proxy_are_admitted_as_they_are() {
    let sts = example("inject-statefulset.yaml");
    let owner = ("StatefulSet", "edge");
    let out = pod_of(
        &sts,
        "edge-0",
        owner,
        json!({ "sbproxy.dev/inject": "disabled" }),
    );
    let d = admit::admit(&review(&out, "CREATE"), &defaults()).unwrap();
    assert_eq!(d.result, Injection::skipped);
    assert!(d.reason.contains("opted out"), "{}", d.reason);
    assert_eq!(d.review["response"]["allowed"], true);
    assert!(d.review["response"]["patch"].is_null());

    // No volume at /etc/sbproxy: not a proxy; a warning kubectl shows.
    let mut busybox = pod_of(&sts, "edge-0", owner, json!({}));
    busybox["spec"] = json!({ "containers": [{ "name": "sh", "image": "busybox" }] });
    let d = admit::admit(&review(&busybox, "CREATE"), &defaults()).unwrap();
    assert_eq!(d.result, Injection::skipped);
    assert!(d.review["response"]["patch"].is_null());
    let warning = d.review["response"]["warnings"][0].as_str().unwrap();
    assert!(warning.contains("/etc/sbproxy"), "{warning}");

    // An update is not ours to change.
    let pod = pod_of(&sts, "edge-0", owner, json!({}));
    let d = admit::admit(&review(&pod, "UPDATE"), &defaults()).unwrap();
    assert_eq!(d.result, Injection::skipped);
    assert!(d.review["response"]["patch"].is_null());
}

#[test]
fn an_annotation_with_a_value_not_accepted_is_refused_naming_it() {
    let sts = example("inject-statefulset.yaml");
    for (key, value, says) in [
        ("sbproxy.dev/inject", "yes", "\"enabled\" or \"disabled\""),
        ("sbproxy.dev/mesh-service", "Edge_Mesh", "DNS name"),
        ("sbproxy.dev/mesh-service", "mesh.other-ns", "no '.'"),
        ("sbproxy.dev/cluster-key-secret", "", "DNS name"),
        ("sbproxy.dev/sidecar-image", "an image", "without spaces"),
    ] {
        let pod = pod_of(
            &sts,
            "edge-0",
            ("StatefulSet", "edge"),
            json!({ key: value }),
        );
        let d = admit::admit(&review(&pod, "CREATE"), &defaults()).unwrap();
        assert_eq!(d.result, Injection::refused, "{key}: {value}");
        let response = &d.review["response"];
        assert_eq!(response["allowed"], false);
        let message = response["status"]["message"].as_str().unwrap();
        assert!(
            message.contains(key) && message.contains(says),
            "{key}={value:?}: {message}"
        );
    }
}

#[test]
fn what_is_not_an_admission_review_is_malformed_and_an_unreadable_pod_passes() {
    for body in [
        &b"not json"[..],
        br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
        br#"{"kind":"Pod","apiVersion":"v1"}"#,
        b"",
    ] {
        let e = admit::admit(body, &defaults()).expect_err("malformed");
        assert!(e.to_string().contains("AdmissionReview"), "{e}");
    }
    let sts = example("inject-statefulset.yaml");
    let mut pod = pod_of(&sts, "edge-0", ("StatefulSet", "edge"), json!({}));
    pod["spec"]["containers"] = json!("not a list");
    let d = admit::admit(&review(&pod, "CREATE"), &defaults()).unwrap();
    assert_eq!(d.result, Injection::unreadable);
    assert_eq!(d.review["response"]["allowed"], true);
    assert!(d.review["response"]["warnings"][0].is_string());
}
