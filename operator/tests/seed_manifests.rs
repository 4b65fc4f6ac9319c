//! The manifests sbproxy's own Kubernetes guide publishes, in their shapes
//! (`tests/seed_manifests/`): `render` takes them as they are — `configRef`
//! as a string, an admin Secret in the same stream — and refuses the one
//! the guide says must be refused, naming "redb". kubernetes-validate
//! checks what they render in `tests/manifests_validate.rs`.

mod render_fixtures;

use render_fixtures as fx;

fn kinds_and_names(stdout: &[u8]) -> Vec<String> {
    fx::kinds(&fx::yaml_docs_of(&String::from_utf8_lossy(stdout)))
}

#[test]
fn the_guides_manifests_render_as_they_are() {
    for name in fx::SEEDS_RENDERED {
        let out = fx::render_seed(name);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{name}: {stderr}");
        let objects = kinds_and_names(&out.stdout);
        for want in [
            "StatefulSet/demo-proxy",
            "Service/demo-mesh",
            "Service/demo-svc",
            "ConfigMap/demo-config",
            "PodDisruptionBudget/demo-pdb",
        ] {
            assert!(
                objects.iter().any(|o| o == want),
                "{name}: no {want} in {objects:?}"
            );
        }
        assert_eq!(
            objects.iter().any(|o| o == "Secret/demo-cluster-key"),
            name == "clustered",
            "{name}: the cluster key only where clustering is on: {objects:?}"
        );
        if name == "hot-reload" {
            assert_eq!(
                stderr.trim(),
                format!(
                    "note: skipped 1 document(s) of other kinds, which render does not read \
                     (it renders SBProxy and SBProxyConfig; apply the rest yourself): \
                     Secret demo-admin ({} (document 1))",
                    fx::seed_dir().join("hot-reload.yaml").display()
                )
            );
        } else {
            assert_eq!(stderr.trim(), "", "{name}");
        }
    }
}

#[test]
fn the_guides_admin_secret_reaches_the_sidecar() {
    let out = fx::render_seed("hot-reload");
    let docs = fx::yaml_docs_of(&String::from_utf8_lossy(&out.stdout));
    let sts = docs
        .iter()
        .find(|d| d["kind"] == "StatefulSet")
        .expect("a StatefulSet");
    let sidecar = sts["spec"]["template"]["spec"]["initContainers"]
        .as_array()
        .and_then(|c| {
            c.iter()
                .find(|c| c["name"] == sbmesh_operator::render::SIDECAR_CONTAINER)
        })
        .expect("the sidecar");
    let env = sidecar["env"].as_array().expect("env");
    let auth = env
        .iter()
        .find(|e| e["name"] == "SBMESH_PROXY_AUTHORIZATION")
        .expect("SBMESH_PROXY_AUTHORIZATION");
    assert_eq!(
        auth["valueFrom"]["secretKeyRef"],
        serde_json::json!({ "name": "demo-admin", "key": "authorization" })
    );
}

#[test]
fn the_guides_redb_fleet_is_refused_naming_redb() {
    let out = fx::render_seed(fx::SEED_REFUSED);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(out.stdout, Vec::<u8>::new(), "nothing printed");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.trim(),
        "SBProxy default/demo refused (AcmeStoreNotShared): spec.replicas is 2 and \
         proxy.acme.enabled is true with storage_backend \"redb\", which is local to one pod. \
         Each replica would open its own order for the same hostname, and an HTTP-01 challenge \
         load-balanced to a replica that did not open it cannot be answered. Use a shared store \
         (file on an RWX volume, redis, s3, gcs, or azure), set spec.replicas to 1, or issue \
         certificates with cert-manager and leave proxy.acme disabled."
    );
}

#[test]
fn every_custom_resource_of_the_guide_passes_the_schema() {
    for name in fx::SEEDS_RENDERED.iter().chain([&fx::SEED_REFUSED]) {
        let path = fx::seed_dir().join(format!("{name}.yaml"));
        for doc in fx::yaml_docs(&path) {
            if doc["apiVersion"] == sbmesh_operator::crd::API_VERSION
                && let Err(problems) = sbmesh_operator::crd::validate(&doc)
            {
                panic!("{name}: {}", problems.join("\n"));
            }
        }
    }
}
