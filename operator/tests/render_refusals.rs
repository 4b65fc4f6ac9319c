//! Every refusal of docs/reference.md#refusal-reasons, with its reason and message, and
//! the order in which they are checked. The sidecar's settings are in
//! `proxy.extensions.sbmesh`; `proxy.cluster` and `proxy.acme` are the
//! proxy's own, checked only for conflicts and for a local ACME store.

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

/// The sidecar's ACME enabled; `backend_lines` are indented for its block
/// (8 spaces).
fn acme_config(backend_lines: &str) -> String {
    format!(
        "proxy:\n  admin: {{ enabled: true, port: 9090 }}\n  extensions:\n    sbmesh:\n      acme:\n        enabled: true\n        email: ops@example.com\n{backend_lines}origins:\n  \"demo.example.com\": {{}}\n"
    )
}

/// The proxy's own ACME enabled (sbproxy orders the certificates itself);
/// `backend_lines` are indented for `proxy.acme` (4 spaces).
fn proxy_acme_config(backend_lines: &str) -> String {
    format!(
        "proxy:\n  admin: {{ enabled: true, port: 9090 }}\n  acme:\n    enabled: true\n    email: ops@example.com\n{backend_lines}origins:\n  \"demo.example.com\": {{}}\n"
    )
}

/// `lines` (indented for it, 6 spaces) as the sidecar's block.
fn sbmesh_config(lines: &str) -> String {
    format!("proxy:\n  admin: {{ enabled: true, port: 9090 }}\n  extensions:\n    sbmesh:\n{lines}")
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
        "spec.configRef is \"demo\" but no SBProxyConfig of that name exists in namespace \"default\". \
         Create it, or point spec.configRef at an existing SBProxyConfig."
    );
}

#[test]
fn config_ref_is_read_in_both_forms_and_anything_else_is_refused() {
    // sbproxy's own form (a string) and this project's first form ({name}).
    for form in ["configRef: demo\n", "configRef: { name: demo }\n"] {
        let proxy = fx::proxy(&format!("image: sbproxy\n{form}"));
        assert_eq!(proxy.spec.config_ref.name(), Ok("demo"), "{form}");
        render::render(&proxy, Some(&fx::config(PLAIN_CONFIG)), None, &fx::opts())
            .unwrap_or_else(|r| panic!("{form}: refused: {r}"));
    }
    // Neither: decoded all the same (the controller must see the object to
    // report on it), and refused naming what was written and both forms.
    for (form, shown) in [
        ("configRef: 5\n", "5"),
        ("configRef: \"\"\n", "\"\""),
        ("configRef: {}\n", "{}"),
        ("configRef: { name: \"\" }\n", "{\"name\":\"\"}"),
        (
            "configRef: { name: demo, kind: SBProxyConfig }\n",
            "{\"kind\":\"SBProxyConfig\",\"name\":\"demo\"}",
        ),
        ("configRef: [demo]\n", "[\"demo\"]"),
    ] {
        let proxy = fx::proxy(&format!("image: sbproxy\n{form}"));
        let r = render::render(&proxy, Some(&fx::config(PLAIN_CONFIG)), None, &fx::opts())
            .expect_err(form);
        assert_eq!(r.reason, RefusalReason::ConfigNotFound, "{form}");
        assert_eq!(
            r.message,
            format!(
                "spec.configRef is {shown}; it must name an SBProxyConfig in this namespace, \
                 as a string (configRef: demo-config) or in the first form (configRef: {{name: demo-config}})"
            ),
            "{form}"
        );
    }
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
    let config = sbmesh_config(
        "      acme:\n        enabled: true\n        storge_path: x\n        email: not-an-email\n",
    );
    let r = refuse("", Some(&config));
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    let lines: Vec<&str> = r.message.lines().skip(1).collect();
    assert_eq!(
        lines,
        [
            "proxy.extensions.sbmesh.acme.storge_path: unknown field; expected one of: enabled, email, directory_url, ca_root, eab, storage_backend, storage_path, renew_before_days, certificates, apply, challenge, dns01 (did you mean storage_path?)",
            "proxy.extensions.sbmesh.acme.email: \"not-an-email\" is not an email address; expected one such as ops@example.com",
        ],
        "{}",
        r.message
    );
}

#[test]
fn the_proxys_own_keys_are_not_the_sidecars_problems() {
    // Keys of sbproxy 1.13's proxy.admin, proxy.cluster and proxy.acme,
    // none of which the sidecar uses, on ports that do not clash.
    accept(
        "clustering: { enabled: true }\nreplicas: 3\n",
        "proxy:\n  admin: { enabled: true, port: 9090, max_log_entries: 500, rate_limit_per_minute: 60 }\n  cluster:\n    roles: [gateway]\n    gossip_port: 7947\n    transport_port: 8947\n    replication: { factor: 2 }\n  acme:\n    enabled: false\n    challenge_types: [http-01]\n  http_bind_port: 8080\norigins:\n  \"demo.example.com\": {}\n",
    );
    // A key sbproxy would refuse is the sidecar's warning, not a refusal.
    accept(
        "",
        "proxy:\n  admin: { enabled: true, port: 9090 }\n  acme: { enabled: false, eab: { kid: k, hmac_key: aGVsbG8 } }\n",
    );
    // An unknown key in the sidecar's own block is a problem.
    let r = refuse("", Some(&sbmesh_config("      gossip_prot: 7946\n")));
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message
            .contains("\nproxy.extensions.sbmesh.gossip_prot: unknown field; expected one of: "),
        "{}",
        r.message
    );
}

#[test]
fn warnings_are_not_refusals() {
    // A wildcard origin is only a warning (it is never ordered).
    accept(
        "",
        &acme_config(
            "        storage_backend: redb\n        storage_path: /var/lib/sbproxy/sidecar\n",
        )
        .replace("demo.example.com", "*.example.com"),
    );
    // The first form of the contract without a conflict: one warning line
    // from the sidecar (it no longer reads proxy.acme), no refusal.
    accept(
        "",
        "proxy:\n  admin: { enabled: true, port: 9090 }\n  acme: { enabled: false }\n",
    );
    // An unresolved variable in a value the sidecar does not use.
    accept(
        "",
        "proxy:\n  admin: { enabled: true, port: 9090 }\norigins:\n  \"demo.example.com\": { action: { type: proxy, url: \"${BACKEND_URL}\" } }\n",
    );
}

#[test]
fn variables_of_the_pod_are_known_and_checked_with_their_form() {
    accept(
        "clustering: { enabled: true }\n",
        &sbmesh_config(
            "      cluster_id: ${SBMESH_CLUSTER_ID}\n      node_id: ${SBPROXY_POD_NAME}\n      advertise_addr: \"${SBPROXY_POD_IP}:7946\"\n      shared_key: \"${SBMESH_CLUSTER_KEY}\"\n",
        ),
    );
    // Known, so still checked: a pod IP with a bad port is wrong whatever the IP.
    let r = refuse(
        "",
        Some(&sbmesh_config(
            "      advertise_addr: \"${SBPROXY_POD_IP}:99999\"\n",
        )),
    );
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message
            .contains("\nproxy.extensions.sbmesh.advertise_addr: "),
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
        &acme_config("        storage_backend: redis\n        storage_path: ${REDIS_URL}\n"),
    );
    accept("", &sbmesh_config("      gossip_port: ${GOSSIP:-7946}\n"));
    // Kept as written (not replaced by nothing), and an error for the
    // sidecar where it uses the value; the operator cannot tell.
    accept("", &sbmesh_config("      node_id: ${MY_NODE}\n"));
    accept(
        "replicas: 3\n",
        &acme_config("        storage_backend: ${ACME_BACKEND}\n        storage_path: /x\n"),
    );
    // A literal next to it is still checked.
    let r = refuse(
        "",
        Some(&sbmesh_config(
            "      gossip_port: ${GOSSIP}\n      transport_port: 0\n",
        )),
    );
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message
            .contains("proxy.extensions.sbmesh.transport_port: "),
        "{}",
        r.message
    );
    assert!(!r.message.contains("gossip_port"), "{}", r.message);
}

#[test]
fn an_unclosed_variable_reference_is_kept_as_written() {
    // As the proxy does: the text stays, and where the sidecar uses the
    // value it is checked as it is.
    let r = refuse(
        "",
        Some(&sbmesh_config("      node_id: ${SBPROXY_POD_NAME\n")),
    );
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message.contains(
            "\nproxy.extensions.sbmesh.node_id: node id \"${SBPROXY_POD_NAME\" contains '$'"
        ),
        "{}",
        r.message
    );
    // Where it does not, it is the proxy's business.
    accept(
        "",
        "proxy:\n  admin: { enabled: true, port: 9090 }\n  http_bind_port: ${PORT\n",
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

/// The documented message (docs/reference.md#refusal-reasons), for the proxy's own `proxy.acme`.
fn spec_message(n: i32, backend: &str) -> String {
    format!(
        "spec.replicas is {n} and proxy.acme.enabled is true with storage_backend \"{backend}\", which is local to one pod. Each replica would open its own order for the same hostname, and an HTTP-01 challenge load-balanced to a replica that did not open it cannot be answered. Use a shared store (file on an RWX volume, redis, s3, gcs, or azure), set spec.replicas to 1, or issue certificates with cert-manager and leave proxy.acme disabled."
    )
}

/// The same message for the sidecar's block (`proxy.extensions.sbmesh.acme`).
fn sidecar_message(n: i32, backend: &str) -> String {
    format!(
        "spec.replicas is {n} and proxy.extensions.sbmesh.acme.enabled is true with storage_backend \"{backend}\", which is local to one pod. Each replica would open its own order for the same hostname, and an HTTP-01 challenge load-balanced to a replica that did not open it cannot be answered. Use a shared store (file on an RWX volume, redis, s3, gcs, or azure), set spec.replicas to 1, or issue certificates with cert-manager and leave proxy.extensions.sbmesh.acme disabled."
    )
}

/// `(backend lines without indentation, backend named in the message)`.
const LOCAL_STORES: &[(&str, &str)] = &[
    (
        "storage_backend: redb\nstorage_path: /var/lib/sbproxy/sidecar\n",
        "redb",
    ),
    ("storage_backend: memory\n", "memory"),
    // The sidecar does not know sqlite at all; the documented message still wins.
    (
        "storage_backend: sqlite\nstorage_path: /data/acme.db\n",
        "sqlite",
    ),
    // Omitted: a pod-local redb store, for the sidecar as for sbproxy.
    ("", "redb"),
    ("storage_backend: \"\"\n", "redb"),
];

fn indent(lines: &str, by: usize) -> String {
    lines.lines().map(|l| format!("{:by$}{l}\n", "")).collect()
}

#[test]
fn the_proxys_own_local_acme_store_with_several_replicas_is_refused_with_the_spec_message() {
    for (lines, backend) in LOCAL_STORES {
        let r = refuse("replicas: 3\n", Some(&proxy_acme_config(&indent(lines, 4))));
        assert_eq!(
            r.reason,
            RefusalReason::AcmeStoreNotShared,
            "{lines:?}: {}",
            r.message
        );
        assert_eq!(r.message, spec_message(3, backend), "{lines:?}");
    }
    assert_eq!(
        render::acme_store_not_shared_message(7, "proxy.acme", "redb"),
        spec_message(7, "redb")
    );
}

#[test]
fn the_sidecars_local_acme_store_with_several_replicas_is_refused_naming_its_block() {
    for (lines, backend) in LOCAL_STORES {
        let r = refuse("replicas: 3\n", Some(&acme_config(&indent(lines, 8))));
        assert_eq!(
            r.reason,
            RefusalReason::AcmeStoreNotShared,
            "{lines:?}: {}",
            r.message
        );
        assert_eq!(r.message, sidecar_message(3, backend), "{lines:?}");
    }
    assert_eq!(
        render::acme_store_not_shared_message(2, "proxy.extensions.sbmesh.acme", "memory"),
        sidecar_message(2, "memory")
    );
}

#[test]
fn a_local_acme_store_is_fine_for_one_replica_or_with_acme_off() {
    for config in [acme_config as fn(&str) -> String, proxy_acme_config] {
        let by = if config("").contains("sbmesh") { 8 } else { 4 };
        accept(
            "replicas: 1\n",
            &config(&indent(
                "storage_backend: redb\nstorage_path: /var/lib/sbproxy/sidecar\n",
                by,
            )),
        );
        accept("replicas: 1\n", &config(""));
        for shared in [
            "storage_backend: redis\nstorage_path: redis://redis:6379/0\n",
            "storage_backend: s3\nstorage_path: s3://bucket/acme\n",
            "storage_backend: file\nstorage_path: /shared/acme\n",
        ] {
            accept("replicas: 3\n", &config(&indent(shared, by)));
        }
    }
    accept(
        "replicas: 3\n",
        "proxy:\n  acme:\n    enabled: false\n    storage_backend: memory\n",
    );
    accept(
        "replicas: 3\n",
        &sbmesh_config("      acme:\n        enabled: false\n        storage_backend: memory\n"),
    );
}

#[test]
fn each_acme_block_is_checked_for_a_local_store() {
    // Both enabled: the conflict, reported before any local store.
    let config = "proxy:\n  acme: { enabled: true, storage_backend: memory }\n  extensions:\n    sbmesh:\n      acme: { enabled: true, email: ops@example.com }\norigins:\n  \"demo.example.com\": {}\n";
    let r = refuse("replicas: 2\n", Some(config));
    assert_eq!(r.reason, RefusalReason::ConfigInvalid, "{}", r.message);
    // The sidecar's on and local, the proxy's off: the sidecar's is named.
    let config = config.replace(
        "{ enabled: true, storage_backend",
        "{ enabled: false, storage_backend",
    );
    let r = refuse("replicas: 2\n", Some(&config));
    assert_eq!(r.reason, RefusalReason::AcmeStoreNotShared, "{}", r.message);
    assert_eq!(r.message, sidecar_message(2, "redb"));
    // The sidecar's on and shared, the proxy's off and local: accepted.
    accept(
        "replicas: 3\n",
        &acme_config(
            "        storage_backend: redis\n        storage_path: redis://redis:6379/0\n",
        )
        .replace(
            "  extensions:",
            "  acme: { enabled: false, storage_backend: redb }\n  extensions:",
        ),
    );
    // The sidecar's off, the proxy's on and local: the proxy's is named.
    let config = "proxy:\n  acme: { enabled: true, storage_backend: memory }\n  extensions:\n    sbmesh:\n      acme: { enabled: false, storage_backend: redb }\n";
    let r = refuse("replicas: 2\n", Some(config));
    assert_eq!(r.reason, RefusalReason::AcmeStoreNotShared, "{}", r.message);
    assert_eq!(r.message, spec_message(2, "memory"));
}

#[test]
fn sqlite_with_one_replica_is_what_the_sidecar_says_it_is() {
    let r = refuse(
        "",
        Some(&acme_config(
            "        storage_backend: sqlite\n        storage_path: /data\n",
        )),
    );
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message.contains(
            "\nproxy.extensions.sbmesh.acme.storage_backend: unsupported backend \"sqlite\"; supported: redis, s3, gcs, azure, file, redb, memory"
        ),
        "{}",
        r.message
    );
}

#[test]
fn an_invalid_config_is_reported_before_a_local_store() {
    let config = acme_config(
        "        storage_backend: redb\n        storage_path: /var/lib/sbproxy/sidecar\n        renew_before_days: 0\n",
    );
    let r = refuse("replicas: 3\n", Some(&config));
    assert_eq!(r.reason, RefusalReason::ConfigInvalid, "{}", r.message);
}

#[test]
fn a_refusal_displays_its_reason_and_message() {
    let r = refuse("", None);
    assert!(
        r.to_string()
            .starts_with("ConfigNotFound: spec.configRef is \"demo\"")
    );
}

/// The sidecar's line for a clash of the proxy's own mesh with its `key`.
fn clash_line(key: &str, proto: &str, port: u16, flag: &str, env: &str) -> String {
    format!(
        "\nproxy.cluster.{key}: sbproxy's own mesh (proxy.cluster) binds {proto} {port}, the same port as the sidecar's {key} (proxy.extensions.sbmesh.{key} / {flag} / {env}); both run in the pod's network, so one of them cannot start. Remove proxy.cluster and let the sidecar form the mesh, or give one of them another port"
    )
}

#[test]
fn the_proxys_own_mesh_on_the_sidecars_ports_is_invalid() {
    // proxy.cluster present, both meshes on the default ports.
    for cluster in [
        "  cluster: {}\n",
        "  cluster:\n    node_id: ${SBPROXY_POD_NAME}\n",
        "  cluster:\n    gossip_port: 7946\n    transport_port: 8946\n",
    ] {
        let config = format!("proxy:\n  admin: {{ enabled: true, port: 9090 }}\n{cluster}");
        let r = refuse(
            "replicas: 3\nclustering: { enabled: true }\n",
            Some(&config),
        );
        assert_eq!(r.reason, RefusalReason::ConfigInvalid, "{cluster}");
        assert!(
            r.message.contains(&clash_line(
                "gossip_port",
                "UDP",
                7946,
                "--gossip-port",
                "SBMESH_GOSSIP_PORT"
            )),
            "{}",
            r.message
        );
        assert!(
            r.message.contains(&clash_line(
                "transport_port",
                "TCP",
                8946,
                "--transport-port",
                "SBMESH_TRANSPORT_PORT"
            )),
            "{}",
            r.message
        );
    }
    // Only one port the same: only that one is reported.
    let r = refuse(
        "clustering: { enabled: true, gossipPort: 17946 }\n",
        Some("proxy:\n  cluster: { gossip_port: 7946 }\n"),
    );
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(!r.message.contains("gossip_port"), "{}", r.message);
    assert!(
        r.message.contains("\nproxy.cluster.transport_port: "),
        "{}",
        r.message
    );
    // An unknown variable elsewhere in proxy.cluster does not excuse the
    // clash of an omitted (default) port.
    let r = refuse(
        "clustering: { enabled: true }\n",
        Some("proxy:\n  cluster:\n    cluster_id: ${PROXY_MESH}\n"),
    );
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message.contains("\nproxy.cluster.gossip_port: "),
        "{}",
        r.message
    );
}

#[test]
fn the_proxys_own_mesh_on_other_ports_is_fine() {
    accept(
        "replicas: 3\nclustering: { enabled: true }\n",
        "proxy:\n  admin: { enabled: true, port: 9090 }\n  cluster:\n    gossip_port: 7947\n    transport_port: 8947\n",
    );
    // Or the sidecar's mesh moved away (spec.clustering sets its ports).
    accept(
        "replicas: 3\nclustering: { enabled: true, gossipPort: 17946, transportPort: 18946 }\n",
        "proxy:\n  admin: { enabled: true, port: 9090 }\n  cluster: {}\n",
    );
    // A proxy port the operator cannot know is left to the sidecar.
    accept(
        "clustering: { enabled: true }\n",
        "proxy:\n  cluster:\n    gossip_port: ${PROXY_GOSSIP}\n    transport_port: ${PROXY_TRANSPORT}\n",
    );
    // So is a port of the sidecar's own when spec.clustering does not set it.
    let config = "proxy:\n  cluster: { transport_port: 8947 }\n  extensions:\n    sbmesh:\n      gossip_port: ${MESH_GOSSIP:-7946}\n";
    accept("", config);
    let r = refuse("clustering: { enabled: true }\n", Some(config));
    assert_eq!(r.reason, RefusalReason::ConfigInvalid);
    assert!(
        r.message.contains("\nproxy.cluster.gossip_port: "),
        "{}",
        r.message
    );
}

#[test]
fn the_proxys_own_acme_with_the_sidecars_is_invalid() {
    let config =
        acme_config("        storage_backend: redis\n        storage_path: redis://redis:6379/0\n")
            .replace("  extensions:", "  acme: { enabled: true }\n  extensions:");
    for replicas in ["replicas: 1\n", "replicas: 3\n"] {
        let r = refuse(replicas, Some(&config));
        assert_eq!(r.reason, RefusalReason::ConfigInvalid, "{}", r.message);
        assert!(
            r.message.ends_with(
                "\nproxy.acme.enabled: true while the sidecar's ACME (proxy.extensions.sbmesh.acme.enabled) is on too: sbproxy would order the same hostnames itself, in every pod. Set proxy.acme.enabled: false (or remove proxy.acme) to let the sidecar issue for the whole fleet, or set proxy.extensions.sbmesh.acme.enabled: false"
            ),
            "{}",
            r.message
        );
    }
    // Either one alone is fine.
    accept(
        "",
        &config.replace("acme: { enabled: true }", "acme: { enabled: false }"),
    );
    accept("", &proxy_acme_config(""));
}

// ---------------------------------------------------------------------------
// spec.podTemplate (docs/reference.md#sbproxy): what the schema cannot say.

const CLUSTERED: &str = "clustering: { enabled: true }\n";

/// The refusal of `pod_template` (YAML, indented for `podTemplate:`) on
/// the base spec plus `spec_extra`.
fn refuse_template(spec_extra: &str, pod_template: &str) -> Refusal {
    let r = refuse(
        &format!("{spec_extra}podTemplate:\n{pod_template}"),
        Some(PLAIN_CONFIG),
    );
    assert_eq!(r.reason, RefusalReason::PodTemplateInvalid, "{}", r.message);
    r
}

fn accept_template(spec_extra: &str, pod_template: &str) {
    accept(
        &format!("{spec_extra}podTemplate:\n{pod_template}"),
        PLAIN_CONFIG,
    );
}

#[test]
fn pod_template_invalid_has_its_name() {
    assert_eq!(
        RefusalReason::PodTemplateInvalid.as_str(),
        "PodTemplateInvalid"
    );
}

#[test]
fn a_label_that_would_change_the_operators_is_refused() {
    for (key, own) in [
        ("app.kubernetes.io/name", "sbproxy"),
        ("app.kubernetes.io/instance", "demo"),
        ("app.kubernetes.io/managed-by", "sbmesh-operator"),
    ] {
        let r = refuse_template("", &format!("  labels: {{ {key}: other }}\n"));
        assert_eq!(
            r.message,
            format!(
                "spec.podTemplate.labels[\"{key}\"] is \"other\", but the operator sets that label to \
                 \"{own}\": app.kubernetes.io/name and app.kubernetes.io/instance select the \
                 SBProxy's pods (StatefulSet, Services, PodDisruptionBudget), and \
                 app.kubernetes.io/managed-by marks them as the operator's. Remove it from \
                 spec.podTemplate.labels; any other label is accepted."
            )
        );
        // The same value changes nothing.
        accept_template("", &format!("  labels: {{ {key}: {own} }}\n"));
    }
    accept_template(
        "",
        "  labels: { app.kubernetes.io/part-of: edge, team: a }\n",
    );
}

#[test]
fn a_volume_named_as_the_operators_is_refused() {
    let r = refuse_template(
        "",
        "  volumes:\n    - { name: sbproxy-data, emptyDir: {} }\n",
    );
    assert_eq!(
        r.message,
        "spec.podTemplate.volumes[0].name is \"sbproxy-data\", the name of a volume the operator \
         puts in the pod (sbproxy-config, sbproxy-data). Rename it, and the mounts that use it; \
         any other name is accepted."
    );
    // The cluster key's volume is the operator's when it mounts the key.
    let r = refuse_template(
        CLUSTERED,
        "  volumes:\n    - { name: sbmesh-cluster-key, emptyDir: {} }\n",
    );
    assert_eq!(
        r.message,
        "spec.podTemplate.volumes[0].name is \"sbmesh-cluster-key\", the name of a volume the \
         operator puts in the pod (sbproxy-config, sbproxy-data, sbmesh-cluster-key). Rename it, \
         and the mounts that use it; any other name is accepted."
    );
}

#[test]
fn two_volumes_of_one_name_are_refused() {
    let r = refuse_template(
        "",
        "  volumes:\n    - { name: tls, secret: { secretName: a } }\n    - { name: other, emptyDir: {} }\n    - { name: tls, secret: { secretName: b } }\n",
    );
    assert_eq!(
        r.message,
        "spec.podTemplate.volumes[2].name is \"tls\", as is spec.podTemplate.volumes[0].name; \
         each volume of a pod needs its own name. Rename one of them."
    );
}

#[test]
fn a_mount_of_a_volume_nobody_defines_is_refused() {
    let r = refuse_template(
        "",
        "  volumes:\n    - { name: tls, secret: { secretName: a } }\n  proxyVolumeMounts:\n    - { name: tsl, mountPath: /etc/tls }\n",
    );
    assert_eq!(
        r.message,
        "spec.podTemplate.proxyVolumeMounts[0].name is \"tsl\", but the pod has no volume of that \
         name. Name one of its volumes (sbproxy-config, sbproxy-data, tls), or add \"tsl\" to \
         spec.podTemplate.volumes."
    );
    // Without clustering the cluster key is no volume of the pod.
    let r = refuse_template(
        "",
        "  sidecarVolumeMounts:\n    - { name: sbmesh-cluster-key, mountPath: /keys }\n",
    );
    assert_eq!(
        r.message,
        "spec.podTemplate.sidecarVolumeMounts[0].name is \"sbmesh-cluster-key\", but the pod has \
         no volume of that name. Name one of its volumes (sbproxy-config, sbproxy-data), or add \
         \"sbmesh-cluster-key\" to spec.podTemplate.volumes."
    );
    // The operator's own volumes may be mounted elsewhere.
    accept_template(
        "",
        "  proxyVolumeMounts:\n    - { name: sbproxy-config, mountPath: /srv/sb.yml, subPath: sb.yml }\n",
    );
}

#[test]
fn a_mount_at_or_under_the_operators_paths_is_refused() {
    let volume = "  volumes:\n    - { name: extra, emptyDir: {} }\n";
    for (spec_extra, field, path, own, own_volume, container, own_paths) in [
        (
            "",
            "proxyVolumeMounts",
            "/etc/sbproxy",
            "/etc/sbproxy",
            "sbproxy-config",
            "proxy",
            "/etc/sbproxy, /var/lib/sbproxy",
        ),
        (
            "",
            "proxyVolumeMounts",
            "/var/lib/sbproxy/certs/",
            "/var/lib/sbproxy",
            "sbproxy-data",
            "proxy",
            "/etc/sbproxy, /var/lib/sbproxy",
        ),
        (
            "",
            "sidecarVolumeMounts",
            "/etc//sbproxy/./extra",
            "/etc/sbproxy",
            "sbproxy-config",
            "sbmesh-sidecar",
            "/etc/sbproxy, /var/lib/sbproxy",
        ),
        (
            CLUSTERED,
            "sidecarVolumeMounts",
            "/etc/sbmesh/cluster-key/next",
            "/etc/sbmesh/cluster-key",
            "sbmesh-cluster-key",
            "sbmesh-sidecar",
            "/etc/sbproxy, /var/lib/sbproxy, /etc/sbmesh/cluster-key",
        ),
    ] {
        let r = refuse_template(
            spec_extra,
            &format!("{volume}  {field}:\n    - {{ name: extra, mountPath: \"{path}\" }}\n"),
        );
        assert_eq!(
            r.message,
            format!(
                "spec.podTemplate.{field}[0].mountPath is \"{path}\", at or under {own}, where the \
                 operator mounts {own_volume} in the {container} container. Mount it outside the \
                 operator's paths there ({own_paths})."
            )
        );
    }
    // Beside them, above them, and the key's path in the proxy (which does
    // not get the key) are fine.
    accept_template(
        CLUSTERED,
        &format!(
            "{volume}  proxyVolumeMounts:\n    - {{ name: extra, mountPath: /etc/sbproxy2 }}\n    - {{ name: extra, mountPath: /etc/sbmesh/cluster-key }}\n  sidecarVolumeMounts:\n    - {{ name: extra, mountPath: /var/lib }}\n"
        ),
    );
}

#[test]
fn a_variable_the_operator_sets_is_refused_naming_where_it_comes_from() {
    for (spec_extra, field, var, container, source) in [
        (
            "",
            "sidecarEnv",
            "SBMESH_CLUSTER_ID",
            "sbmesh-sidecar",
            "comes from metadata.name, the SBProxy's name",
        ),
        (
            "",
            "sidecarEnv",
            "SBMESH_ADMIN_LISTEN",
            "sbmesh-sidecar",
            "comes from spec.sidecar.adminPort: set that instead",
        ),
        (
            "",
            "proxyEnv",
            "SBPROXY_POD_NAME",
            "proxy",
            "is the pod's name (downward API metadata.name)",
        ),
        (
            CLUSTERED,
            "sidecarEnv",
            "SBMESH_GOSSIP_PORT",
            "sbmesh-sidecar",
            "comes from spec.clustering.gossipPort: set that instead",
        ),
        (
            "adminAuthSecretRef: { name: admin }\n",
            "sidecarEnv",
            "SBMESH_PROXY_AUTHORIZATION",
            "sbmesh-sidecar",
            "comes from spec.adminAuthSecretRef: set that instead",
        ),
    ] {
        let r = refuse_template(
            spec_extra,
            &format!("  {field}:\n    - {{ name: {var}, value: x }}\n"),
        );
        assert_eq!(
            r.message,
            format!(
                "spec.podTemplate.{field}[0].name is {var}, which the operator sets on the \
                 {container} container: it {source}. Remove it from spec.podTemplate.{field}; any \
                 variable the operator does not set is accepted."
            )
        );
    }
    // With the key file, the key itself too: the sidecar takes one or the other.
    let r = refuse_template(
        CLUSTERED,
        "  sidecarEnv:\n    - { name: SBMESH_CLUSTER_KEY, value: x }\n",
    );
    assert_eq!(
        r.message,
        "spec.podTemplate.sidecarEnv[0].name is SBMESH_CLUSTER_KEY, but the operator gives the \
         sbmesh-sidecar container SBMESH_CLUSTER_KEY_FILE, and the sidecar takes one or the \
         other: the key comes from the Secret of spec.clustering.clusterSecretRef (else \
         <metadata.name>-cluster-key), mounted as a file: set clusterSecretRef instead. Remove \
         it from spec.podTemplate.sidecarEnv; any variable the operator does not set is accepted."
    );
    // What the operator does not set on that container is the user's.
    accept_template(
        "",
        "  sidecarEnv:\n    - { name: SBMESH_GOSSIP_PORT, value: \"7000\" }\n    - { name: SBMESH_CLUSTER_KEY, value: x }\n    - { name: SBPROXY_SHUTDOWN_GRACE_MS, value: \"20000\" }\n  proxyEnv:\n    - { name: SBMESH_CLUSTER_ID, value: x }\n",
    );
}

#[test]
fn every_variable_the_operator_sets_says_where_it_comes_from() {
    // Everything on: each variable of either container, refused, names its
    // source (none falls through to a generic answer).
    let spec = "clustering: { enabled: true }\nadminAuthSecretRef: { name: admin }\n";
    let (mut proxy, config) = (
        fx::proxy(&format!("{BASE}{spec}")),
        fx::config(PLAIN_CONFIG),
    );
    let rendered = render::render(&proxy, Some(&config), None, &fx::opts()).expect("accepted");
    let pod = rendered.stateful_set.spec.unwrap().template.spec.unwrap();
    let containers = [
        ("proxyEnv", pod.containers[0].clone()),
        ("sidecarEnv", pod.init_containers.unwrap()[0].clone()),
    ];
    for (field, container) in containers {
        for var in container.env.unwrap() {
            let mut knobs = sbmesh_operator::crd::PodTemplate::default();
            let user = k8s_openapi::api::core::v1::EnvVar {
                name: var.name.clone(),
                value: Some("x".into()),
                ..Default::default()
            };
            match field {
                "proxyEnv" => knobs.proxy_env = vec![user],
                _ => knobs.sidecar_env = vec![user],
            }
            proxy.spec.pod_template = Some(knobs);
            let r = render::render(&proxy, Some(&config), None, &fx::opts()).expect_err(&var.name);
            assert_eq!(r.reason, RefusalReason::PodTemplateInvalid);
            assert!(
                !r.message.contains("the operator's own"),
                "{}: {}",
                var.name,
                r.message
            );
        }
    }
}

#[test]
fn every_problem_of_a_pod_template_is_listed_on_its_own_line() {
    let r = refuse_template(
        "",
        "  labels: { app.kubernetes.io/instance: x }\n  volumes:\n    - { name: sbproxy-config, emptyDir: {} }\n  sidecarEnv:\n    - { name: SBMESH_CONFIG, value: /tmp/sb.yml }\n",
    );
    let lines: Vec<&str> = r.message.lines().collect();
    assert_eq!(lines.len(), 3, "{}", r.message);
    assert!(
        lines[0].starts_with("spec.podTemplate.labels[\"app.kubernetes.io/instance\"] is \"x\"")
    );
    assert!(lines[1].starts_with("spec.podTemplate.volumes[0].name is \"sbproxy-config\""));
    assert!(lines[2].starts_with("spec.podTemplate.sidecarEnv[0].name is SBMESH_CONFIG"));
}

#[test]
fn the_config_is_checked_before_the_pod_template() {
    let proxy = fx::proxy(&format!(
        "{BASE}podTemplate:\n  sidecarEnv:\n    - {{ name: SBMESH_CONFIG, value: x }}\n"
    ));
    let r = render::render(&proxy, None, None, &fx::opts()).expect_err("refused");
    assert_eq!(r.reason, RefusalReason::ConfigNotFound);
}

#[test]
fn a_literal_of_sidecar_env_is_known_to_the_config_checks() {
    let config =
        acme_config("        storage_backend: ${ACME_BACKEND}\n        storage_path: /x\n");
    // Unknown: left to the sidecar.
    accept("replicas: 3\n", &config);
    // Set from a Secret: still unknown.
    accept(
        "replicas: 3\npodTemplate:\n  sidecarEnv:\n    - name: ACME_BACKEND\n      valueFrom: { secretKeyRef: { name: s, key: k } }\n",
        &config,
    );
    // A literal: known, so the local store is refused as if written out.
    let proxy = fx::proxy(&format!(
        "{BASE}replicas: 3\npodTemplate:\n  sidecarEnv:\n    - {{ name: ACME_BACKEND, value: redb }}\n"
    ));
    let r = render::render(&proxy, Some(&fx::config(&config)), None, &fx::opts())
        .expect_err("a local store");
    assert_eq!(r.reason, RefusalReason::AcmeStoreNotShared);
    assert_eq!(r.message, sidecar_message(3, "redb"));
}
