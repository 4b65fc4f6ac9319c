//! `examples/k8s/sbproxy-cert-manager.yaml`: a cert-manager Certificate's
//! Secret mounted into the proxy (which serves it) and the sidecar (which
//! watches it and restarts the proxy on a renewal), rendered as a user
//! would. kubernetes-validate checks the objects in
//! `tests/manifests_validate.rs`; the CRs pass the CRD schema in
//! `tests/crds.rs`.

mod render_fixtures;

use render_fixtures as fx;
use serde_json::Value;

fn rendered() -> (Vec<Value>, String) {
    let out = fx::render_file(&fx::cert_manager_example());
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    (
        fx::yaml_docs_of(&String::from_utf8_lossy(&out.stdout)),
        stderr,
    )
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind}"))
}

fn container<'a>(pod: &'a Value, list: &str, name: &str) -> &'a Value {
    pod[list]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no {name} in {list}"))
}

fn mount_path<'a>(container: &'a Value, volume: &str) -> Option<&'a str> {
    container["volumeMounts"]
        .as_array()?
        .iter()
        .find(|m| m["name"] == volume)?["mountPath"]
        .as_str()
}

#[test]
fn render_skips_the_certificate_and_the_service_with_one_note() {
    let (_, stderr) = rendered();
    let path = fx::cert_manager_example();
    assert_eq!(
        stderr.trim(),
        format!(
            "note: skipped 2 document(s) of other kinds, which render does not read (it renders \
             SBProxy and SBProxyConfig; apply the rest yourself): Certificate demo-tls ({p} \
             (document 1)), Service demo-https ({p} (document 4))",
            p = path.display()
        )
    );
}

#[test]
fn the_certificates_secret_reaches_the_proxy_and_the_watching_sidecar() {
    let (docs, _) = rendered();
    let example = fx::yaml_docs(&fx::cert_manager_example());
    let secret = of_kind(&example, "Certificate")["spec"]["secretName"]
        .as_str()
        .expect("secretName");

    let pod = &of_kind(&docs, "StatefulSet")["spec"]["template"]["spec"];
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["secret"]["secretName"] == secret)
        .expect("a volume of the Certificate's Secret");
    let volume = volume["name"].as_str().unwrap();

    let proxy = container(pod, "containers", "proxy");
    let sidecar = container(pod, "initContainers", "sbmesh-sidecar");
    let dir = mount_path(proxy, volume).expect("mounted in the proxy");
    assert_eq!(mount_path(sidecar, volume), Some(dir), "the same directory");

    // The sidecar watches that directory and restarts the proxy with what
    // it finds there: the pods share a process namespace for it.
    let env = sidecar["env"].as_array().unwrap();
    let value = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
    };
    assert_eq!(value("SBMESH_WATCH_TLS"), Some(dir));
    assert_eq!(value("SBMESH_PROXY_CERT_APPLY"), Some("restart"));
    assert_eq!(pod["shareProcessNamespace"], true);

    // The proxy serves the files of that directory.
    let config = of_kind(&docs, "ConfigMap")["data"]["sb.yml"]
        .as_str()
        .unwrap();
    let config: Value = serde_norway::from_str(config).unwrap();
    assert_eq!(
        config["proxy"]["tls_cert_file"],
        format!("{dir}/tls.crt").as_str()
    );
    assert_eq!(
        config["proxy"]["tls_key_file"],
        format!("{dir}/tls.key").as_str()
    );

    // HTTPS is admitted by the NetworkPolicy and reached by the example's Service.
    let https = config["proxy"]["https_bind_port"].as_i64().unwrap();
    let policy = of_kind(&docs, "NetworkPolicy");
    let open: Vec<i64> = policy["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|rule| rule.get("from").is_none())
        .flat_map(|rule| rule["ports"].as_array().unwrap().iter())
        .filter_map(|p| p["port"].as_i64())
        .collect();
    assert!(open.contains(&https), "{open:?}");
    let service = of_kind(&example, "Service");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], https);
    let pod_labels = &of_kind(&docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"];
    for (key, value) in service["spec"]["selector"].as_object().unwrap() {
        assert_eq!(&pod_labels[key], value, "the Service selects the pods");
    }
}
