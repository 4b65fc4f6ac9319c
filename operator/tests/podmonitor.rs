//! The PodMonitor the operator renders, against prometheus-operator's
//! PodMonitor fields (`tests/podmonitor.schema.json`, written for these
//! tests from its API reference; kubernetes-validate knows built-in kinds
//! only).

mod render_fixtures;

use render_fixtures as fx;
use serde_json::{Value, json};

fn validator() -> jsonschema::Validator {
    let path = fx::operator_dir().join("tests/podmonitor.schema.json");
    let text = std::fs::read_to_string(&path).expect("read the schema");
    let schema: Value = serde_json::from_str(&text).expect("the schema is JSON");
    jsonschema::draft7::new(&schema).expect("the schema compiles")
}

fn problems(monitor: &Value) -> Vec<String> {
    validator()
        .iter_errors(monitor)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

fn rendered_monitor() -> Value {
    fx::render_scenario("pod-template")
        .objects()
        .into_iter()
        .find(|o| o["kind"] == "PodMonitor")
        .expect("a PodMonitor")
}

#[test]
fn the_rendered_pod_monitor_has_prometheus_operators_fields() {
    let monitor = rendered_monitor();
    assert_eq!(problems(&monitor), Vec::<String>::new(), "{monitor:#}");
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(monitor["metadata"]["name"], "edge");
    assert_eq!(monitor["metadata"]["namespace"], "edge");
    assert_eq!(
        monitor["metadata"]["labels"]["app.kubernetes.io/managed-by"],
        "sbmesh-operator"
    );
    assert_eq!(monitor["metadata"]["ownerReferences"][0]["kind"], "SBProxy");
}

#[test]
fn the_schema_refuses_what_prometheus_operator_would() {
    // Guards the check above: a schema that passed everything would prove nothing.
    let good = rendered_monitor();
    type Edit = fn(&mut Value);
    let bad: [(&str, Edit); 7] = [
        ("an unknown endpoint field", |m| {
            m["spec"]["podMetricsEndpoints"][0]["pth"] = json!("/metrics")
        }),
        ("a port number where a port name goes", |m| {
            m["spec"]["podMetricsEndpoints"][0]["port"] = json!(9091)
        }),
        ("a scheme it does not know", |m| {
            m["spec"]["podMetricsEndpoints"][0]["scheme"] = json!("ftp")
        }),
        ("an interval that is not a duration", |m| {
            m["spec"]["podMetricsEndpoints"][0]["interval"] = json!("30 seconds")
        }),
        ("no selector", |m| {
            m["spec"].as_object_mut().unwrap().remove("selector");
        }),
        ("another kind", |m| m["kind"] = json!("ServiceMonitor")),
        ("an unknown spec field", |m| {
            m["spec"]["endpoints"] = json!([])
        }),
    ];
    for (what, edit) in bad {
        let mut monitor = good.clone();
        edit(&mut monitor);
        assert!(!problems(&monitor).is_empty(), "{what} passed: {monitor:#}");
    }
    // What prometheus-operator documents is accepted.
    let mut rich = good.clone();
    rich["spec"]["jobLabel"] = json!("app.kubernetes.io/name");
    rich["spec"]["namespaceSelector"] = json!({ "matchNames": ["edge"] });
    rich["spec"]["sampleLimit"] = json!(10000);
    rich["spec"]["podMetricsEndpoints"] = json!([{
        "port": "sidecar-admin", "path": "/metrics", "interval": "30s",
        "scrapeTimeout": "10s", "scheme": "http", "honorLabels": true,
        "relabelings": [{
            "sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "pod", "action": "replace",
        }],
    }]);
    assert_eq!(problems(&rich), Vec::<String>::new());
}
