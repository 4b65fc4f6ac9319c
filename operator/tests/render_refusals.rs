//! Every refusal of SPEC section 9, with its reason and message, and the
//! order in which they are checked.

mod render_fixtures;

use render_fixtures as fx;
use sbmesh_operator::render::{self, Refusal, RefusalReason};

const BASE: &str = "image: ghcr.io/sbproxy/sbproxy:1.4.0\nconfigRef: { name: demo }\n";

const PLAIN_CONFIG: &str =
    "proxy:\n  admin: { enabled: true, port: 9090 }\norigins:\n  \"demo.example.com\": {}\n";

fn refuse(spec_extra: &str, config: Option<&str>) -> Refusal {
    let proxy = fx::proxy(&format!("{BASE}{spec_extra}"));
    let config = config.map(fx::config);
    render::render(&proxy, config.as_ref(), None, &fx::opts()).expect_err("a refusal")
}

fn accept(spec_extra: &str, config: &str) {
    let proxy = fx::proxy(&format!("{BASE}{spec_extra}"));
    if let Err(r) = render::render(&proxy, Some(&fx::config(config)), None, &fx::opts()) {
        panic!("refused: {r}\nconfig:\n{config}");
    }
}

fn acme_config(backend_line: &str) -> String {
    format!(
        "proxy:\n  admin: {{ enabled: true, port: 9090 }}\n  acme:\n    enabled: true\n    email: ops@example.com\n{backend_line}origins:\n  \"demo.example.com\": {{}}\n"
    )
}

#[test]
fn reasons_have_their_camel_case_names() {
    assert_eq!(RefusalReason::TooManyReplicas.as_str(), "TooManyReplicas");
    assert_eq!(RefusalReason::ConfigNotFound.as_str(), "ConfigNotFound");
    assert_eq!(RefusalReason::ConfigInvalid.as_str(), "ConfigInvalid");
    assert_eq!(
        RefusalReason::AcmeStoreNotShared.as_str(),
        "AcmeStoreNotShared"
    );
}

#[test]
fn more_than_128_replicas_is_refused() {
    let r = refuse("replicas: 129\n", Some(PLAIN_CONFIG));
    assert_eq!(r.reason, RefusalReason::TooManyReplicas);
    assert_eq!(
        r.message,
        "spec.replicas is 129; an SBProxy runs 1 to 128 replicas. Set spec.replicas within that range."
    );
    accept("replicas: 128\n", PLAIN_CONFIG);
}

#[test]
fn fewer_than_one_replica_is_refused_with_the_range() {
    let r = refuse("replicas: 0\n", Some(PLAIN_CONFIG));
    assert_eq!(r.reason, RefusalReason::TooManyReplicas);
    assert_eq!(
        r.message,
        "spec.replicas is 0; an SBProxy runs 1 to 128 replicas. Set spec.replicas within that range."
    );
}

#[test]
fn a_missing_config_is_refused_naming_it_and_its_namespace() {
    let r = refuse("", None);
    assert_eq!(r.reason, RefusalReason::ConfigNotFound);
    assert_eq!(
        r.message,
        "spec.configRef.name is \"demo\" but no SBProxyConfig of that name exists in namespace \"default\". \
         Create it, or point spec.configRef.name at an existing SBProxyConfig."
    );
}

#[test]
fn replicas_are_checked_before_the_config() {
    let r = refuse("replicas: 500\n", None);
    assert_eq!(r.reason, RefusalReason::TooManyReplicas);
}

#[test]
fn a_config_that_is_not_yaml_is_invalid() {
    let r = refuse("", Some("proxy: [unclosed\n"));
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message.starts_with(
            "SBProxyConfig \"demo\" in namespace \"default\": spec.config is not a valid sb.yml:\n(yaml): "
        ),
        "{}",
        r.message
    );
}

#[test]
fn sidecar_problems_are_listed_by_yaml_path() {
    let config = "proxy:\n  admin: { enabled: true, port: 9090 }\n  acme:\n    enabled: true\n    storge_path: x\n    email: not-an-email\n";
    let r = refuse("", Some(config));
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    let lines: Vec<&str> = r.message.lines().skip(1).collect();
    assert_eq!(
        lines,
        [
            "proxy.acme.storge_path: unknown field; expected one of: enabled, email, directory_url, ca_root, storage_backend, storage_path, renew_before_days, eab (did you mean storage_path?)",
            "proxy.acme.email: \"not-an-email\" is not an email address; expected one such as ops@example.com",
        ],
        "{}",
        r.message
    );
}

#[test]
fn warnings_are_not_refusals() {
    // A wildcard origin is only a warning (it is never ordered).
    accept(
        "",
        &acme_config("    storage_backend: redb\n    storage_path: /var/lib/sbproxy/sidecar\n")
            .replace("demo.example.com", "*.example.com"),
    );
}

#[test]
fn variables_of_the_pod_are_known_and_checked_with_their_form() {
    accept(
        "clustering: { enabled: true }\n",
        "proxy:\n  admin: { enabled: true, port: 9090 }\n  cluster:\n    cluster_id: ${SBMESH_CLUSTER_ID}\n    node_id: ${SBPROXY_POD_NAME}\n    advertise_addr: \"${SBPROXY_POD_IP}:7946\"\n    security: { shared_key: \"${SBMESH_CLUSTER_KEY}\" }\n",
    );
    // Known, so still checked: a pod IP with a bad port is wrong whatever the IP.
    let r = refuse(
        "",
        Some("proxy:\n  cluster:\n    advertise_addr: \"${SBPROXY_POD_IP}:99999\"\n"),
    );
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message.contains("\nproxy.cluster.advertise_addr: "),
        "{}",
        r.message
    );
}

#[test]
fn a_value_from_a_variable_the_operator_cannot_know_is_left_to_the_sidecar() {
    // REDIS_URL may be set in the image; unset here it would make
    // storage_path missing, which must not refuse a config that may be valid.
    accept(
        "replicas: 3\n",
        &acme_config("    storage_backend: redis\n    storage_path: ${REDIS_URL}\n"),
    );
    accept("", "proxy:\n  cluster:\n    gossip_port: ${GOSSIP:-7946}\n");
    // A literal next to it is still checked.
    let r = refuse(
        "",
        Some("proxy:\n  cluster:\n    gossip_port: ${GOSSIP}\n    transport_port: 0\n"),
    );
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message.contains("proxy.cluster.transport_port: "),
        "{}",
        r.message
    );
    assert!(!r.message.contains("gossip_port"), "{}", r.message);
}

#[test]
fn a_malformed_variable_reference_is_invalid() {
    let r = refuse(
        "",
        Some("proxy:\n  cluster:\n    node_id: ${SBPROXY_POD_NAME\n"),
    );
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message.contains("\nline 3, column 14: unterminated `${`"),
        "{}",
        r.message
    );
}

#[test]
fn an_admin_port_other_than_spec_admin_port_is_invalid() {
    let r = refuse("adminPort: 9190\n", Some(PLAIN_CONFIG));
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message.ends_with(
            "\nproxy.admin.port: is 9090 but spec.adminPort of the SBProxy is 9190; the sidecar POSTs \
             reloads to spec.adminPort, so make the two equal"
        ),
        "{}",
        r.message
    );
    // Omitted in the config: nothing to compare.
    accept("adminPort: 9190\n", "proxy:\n  admin: { enabled: true }\n");
}

fn spec_message(n: i32, backend: &str) -> String {
    format!(
        "spec.replicas is {n} and proxy.acme.enabled is true with storage_backend \"{backend}\", which is local to one pod. Each replica would open its own order for the same hostname, and an HTTP-01 challenge load-balanced to a replica that did not open it cannot be answered. Use a shared store (file on an RWX volume, redis, s3, gcs, or azure), set spec.replicas to 1, or issue certificates with cert-manager and leave proxy.acme disabled."
    )
}

#[test]
fn a_local_acme_store_with_several_replicas_is_refused_with_the_spec_message() {
    for (line, backend) in [
        (
            "    storage_backend: redb\n    storage_path: /var/lib/sbproxy/sidecar\n",
            "redb",
        ),
        ("    storage_backend: memory\n", "memory"),
        // The sidecar does not know sqlite at all; the SPEC message still wins.
        (
            "    storage_backend: sqlite\n    storage_path: /data/acme.db\n",
            "sqlite",
        ),
        // Omitted: the sidecar would use a pod-local redb store.
        ("", ""),
    ] {
        let r = refuse("replicas: 3\n", Some(&acme_config(line)));
        assert_eq!(
            r.reason,
            RefusalReason::AcmeStoreNotShared,
            "{backend:?}: {}",
            r.message
        );
        assert_eq!(r.message, spec_message(3, backend), "{backend:?}");
    }
    assert_eq!(
        render::acme_store_not_shared_message(7, "redb"),
        spec_message(7, "redb")
    );
}

#[test]
fn a_local_acme_store_is_fine_for_one_replica_or_with_acme_off() {
    accept(
        "replicas: 1\n",
        &acme_config("    storage_backend: redb\n    storage_path: /var/lib/sbproxy/sidecar\n"),
    );
    accept("replicas: 1\n", &acme_config(""));
    accept(
        "replicas: 3\n",
        "proxy:\n  acme:\n    enabled: false\n    storage_backend: memory\n",
    );
    for shared in [
        "    storage_backend: redis\n    storage_path: redis://redis:6379/0\n",
        "    storage_backend: s3\n    storage_path: s3://bucket/acme\n",
        "    storage_backend: file\n    storage_path: /shared/acme\n",
    ] {
        accept("replicas: 3\n", &acme_config(shared));
    }
}

#[test]
fn sqlite_with_one_replica_is_what_the_sidecar_says_it_is() {
    let r = refuse(
        "",
        Some(&acme_config(
            "    storage_backend: sqlite\n    storage_path: /data\n",
        )),
    );
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message.contains(
            "\nproxy.acme.storage_backend: unsupported backend \"sqlite\"; supported: redis, s3, gcs, azure, file, redb, memory"
        ),
        "{}",
        r.message
    );
}

#[test]
fn an_invalid_config_is_reported_before_a_local_store() {
    let config = acme_config(
        "    storage_backend: redb\n    storage_path: /var/lib/sbproxy/sidecar\n    renew_before_days: 0\n",
    );
    let r = refuse("replicas: 3\n", Some(&config));
    assert_eq!(r.reason, RefusalReason::ConfigInvalid, "{}", r.message);
}

#[test]
fn a_refusal_displays_its_reason_and_message() {
    let r = refuse("", None);
    assert!(
        r.to_string()
            .starts_with("ConfigNotFound: spec.configRef.name is \"demo\"")
    );
}
