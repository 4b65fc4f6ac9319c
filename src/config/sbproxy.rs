//! What sbproxy 1.13 accepts in the blocks it reads strictly: every nested
//! block of its config rejects unknown keys, except `proxy.extensions`.
//! One table, used by the sidecar (to warn about a key the proxy would
//! refuse) and by the test stand-in of the proxy (to refuse it).

use serde_norway::Value;

/// `(path, keys)` of every strict block the sidecar knows of. A path
/// segment `[]` stands for each item of a list.
pub(crate) const STRICT_BLOCKS: &[(&str, &[&str])] = &[
    (
        "proxy.admin",
        &[
            "enabled",
            "port",
            "username",
            "password",
            "max_log_entries",
            "rate_limit_per_minute",
            "prompt_persistence_path",
            "prompt_persistence_encryption",
            "trace_url_template",
            "tls",
            "bind",
            "allow_ips",
            "cors_origins",
            "operators",
        ],
    ),
    (
        "proxy.admin.prompt_persistence_encryption",
        &["enabled", "key", "previous_keys"],
    ),
    ("proxy.admin.tls", &["cert", "key"]),
    (
        "proxy.admin.operators[]",
        &["username", "password_hash", "role", "tenant"],
    ),
    (
        "proxy.cluster",
        &[
            "cluster_id",
            "node_id",
            "roles",
            "labels",
            "seeds",
            "gossip_port",
            "transport_port",
            "advertise_addr",
            "transport_advertise_addr",
            "model_bind",
            "model_endpoint",
            "state_dir",
            "security",
            "snapshot_ttl_secs",
            "publish_interval_secs",
            "dead_peer_gc_secs",
            "enrollment",
            "deployment_authority",
            "replication",
        ],
    ),
    (
        "proxy.cluster.security",
        &[
            "mode",
            "development",
            "shared_key",
            "cert_file",
            "key_file",
            "ca_file",
            "server_name",
            "key_derivation",
        ],
    ),
    (
        "proxy.cluster.enrollment",
        &["authority_dir", "allow_insecure_http"],
    ),
    (
        "proxy.cluster.deployment_authority",
        &["signing_key_file", "verifying_key_file"],
    ),
    (
        "proxy.cluster.replication",
        &[
            "factor",
            "write_consistency",
            "read_consistency",
            "anti_entropy_interval_secs",
            "tombstone_gc_grace_secs",
            "max_entries",
            "max_value_bytes",
        ],
    ),
    (
        "proxy.acme",
        &[
            "enabled",
            "email",
            "directory_url",
            "challenge_types",
            "storage_backend",
            "storage_path",
            "renew_before_days",
            "ca_root",
        ],
    ),
];

/// A key sbproxy 1.13 refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownKey {
    /// YAML path of the key (`proxy.admin.passwrd`, `proxy.admin.operators[0].x`).
    pub path: String,
    /// The keys its block accepts.
    pub accepted: &'static [&'static str],
}

/// Every key of the strict blocks in `root` (a parsed `sb.yml`) that
/// sbproxy 1.13 does not define, in file order.
pub fn unknown_keys(root: &Value) -> Vec<UnknownKey> {
    let mut found = Vec::new();
    for (path, accepted) in STRICT_BLOCKS {
        for (at, block) in blocks_at(root, path) {
            let Value::Mapping(map) = block else {
                continue;
            };
            for key in map.keys() {
                let name = match key {
                    Value::String(s) => s.clone(),
                    other => serde_norway::to_string(other)
                        .unwrap_or_default()
                        .trim()
                        .to_owned(),
                };
                if !accepted.contains(&name.as_str()) {
                    found.push(UnknownKey {
                        path: format!("{at}.{name}"),
                        accepted,
                    });
                }
            }
        }
    }
    found
}

/// The values at `path` (with `[]` for every list item), each with its
/// concrete path.
fn blocks_at<'v>(root: &'v Value, path: &str) -> Vec<(String, &'v Value)> {
    let mut current = vec![(String::new(), root)];
    for segment in path.split('.') {
        let (name, each) = match segment.strip_suffix("[]") {
            Some(name) => (name, true),
            None => (segment, false),
        };
        let mut next = Vec::new();
        for (at, value) in current {
            let Some(child) = value.get(name) else {
                continue;
            };
            let at = if at.is_empty() {
                name.to_owned()
            } else {
                format!("{at}.{name}")
            };
            if each {
                if let Value::Sequence(items) = child {
                    next.extend(
                        items
                            .iter()
                            .enumerate()
                            .map(|(i, item)| (format!("{at}[{i}]"), item)),
                    );
                }
            } else {
                next.push((at, child));
            }
        }
        current = next;
    }
    current
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_unknown_keys_in_nested_blocks_and_lists() {
        let root: Value = serde_norway::from_str(
            "proxy:\n  admin:\n    bind: 0.0.0.0\n    passwrd: x\n    operators:\n      - {username: a, role: admin}\n      - {usernme: b}\n  cluster:\n    state_dir: /x\n    security: {development: true, colour: red}\n  acme: {enabled: false, eab: {kid: a}}\n  extensions: {anything: {goes: 1}}\n  whatever: 1\n",
        )
        .unwrap();
        let paths: Vec<String> = unknown_keys(&root).into_iter().map(|u| u.path).collect();
        assert_eq!(
            paths,
            [
                "proxy.admin.passwrd",
                "proxy.admin.operators[1].usernme",
                "proxy.cluster.security.colour",
                "proxy.acme.eab",
            ]
        );
    }
}
