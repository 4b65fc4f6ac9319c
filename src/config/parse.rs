//! From interpolated `sb.yml` text to [`SbConfig`], reading the YAML tree
//! field by field so that every problem is collected with its path, where a
//! derived `Deserialize` would stop at the first.

use std::path::PathBuf;

use base64::Engine as _;
use serde_norway::{Mapping, Value};

use super::key::KeySource;
use super::{
    AcmeSection, AdminSection, ClusterSection, Eab, Problem, ProxySection, SbConfig, Security,
    SecurityMode, StorageBackend,
};
use crate::identity;

const ADMIN_KEYS: &[&str] = &["enabled", "port", "username", "password"];
const CLUSTER_KEYS: &[&str] = &[
    "cluster_id",
    "node_id",
    "seeds",
    "gossip_port",
    "transport_port",
    "advertise_addr",
    "security",
];
const SECURITY_KEYS: &[&str] = &["mode", "shared_key"];
const ACME_KEYS: &[&str] = &[
    "enabled",
    "email",
    "directory_url",
    "ca_root",
    "storage_backend",
    "storage_path",
    "renew_before_days",
    "eab",
];
const EAB_KEYS: &[&str] = &["kid", "hmac_key"];

/// The default gossip port, used only to check the form of seeds and
/// `advertise_addr` here; the sidecar applies the real one.
const CHECK_PORT: u16 = 7946;

pub(super) fn parse(text: &str) -> Result<SbConfig, Vec<Problem>> {
    let mut value: Value = serde_norway::from_str(text).map_err(|e| vec![syntax_problem(&e)])?;
    value.apply_merge().map_err(|e| {
        vec![Problem::error(
            "(yaml)",
            format!("cannot apply merge keys (<<): {e}"),
        )]
    })?;
    let root = match &value {
        Value::Mapping(root) => root,
        Value::Null => {
            return Err(vec![Problem::error(
                "(root)",
                "the document is empty; expected a mapping with `proxy` and `origins`",
            )]);
        }
        other => {
            return Err(vec![Problem::error(
                "(root)",
                format!(
                    "expected a mapping with `proxy` and `origins` at the top level, found {}",
                    describe(other)
                ),
            )]);
        }
    };

    let mut problems = Vec::new();
    let proxy = match root.get("proxy") {
        None | Some(Value::Null) => None,
        Some(Value::Mapping(proxy)) => Some(proxy),
        Some(other) => {
            problems.push(Problem::error(
                "proxy",
                format!(
                    "expected a mapping (with admin, cluster, acme, ...), found {}",
                    describe(other)
                ),
            ));
            None
        }
    };
    let section = |name: &str| proxy.and_then(|p| p.get(name));
    let admin = read_admin(section("admin"), &mut problems);
    let cluster = read_cluster(section("cluster"), &mut problems);
    let acme = read_acme(section("acme"), &mut problems);
    let origins = read_origins(root.get("origins"), &mut problems);

    let config = SbConfig {
        proxy: ProxySection {
            admin,
            cluster,
            acme,
        },
        origins,
    };
    problems.extend(config.warnings());
    if problems.iter().any(Problem::is_error) {
        Err(problems)
    } else {
        Ok(config)
    }
}

fn syntax_problem(e: &serde_norway::Error) -> Problem {
    let mut message = e.to_string();
    if let Some(at) = e.location()
        && !message.contains(" at line ")
    {
        message.push_str(&format!(" at line {} column {}", at.line(), at.column()));
    }
    Problem::error("(yaml)", message)
}

fn read_admin(value: Option<&Value>, problems: &mut Vec<Problem>) -> AdminSection {
    let mut admin = AdminSection::default();
    let Some(mut f) = Fields::open(value, "proxy.admin", ADMIN_KEYS, problems) else {
        return admin;
    };
    if let Some(enabled) = f.boolean("enabled") {
        admin.enabled = enabled;
    }
    if let Some(port) = f.port("port") {
        admin.port = port;
    }
    admin.username = f.string("username");
    if admin.username.as_deref().is_some_and(|u| u.contains(':')) {
        f.error(
            "username",
            "must not contain ':' (HTTP Basic separates the user name from the password with it)",
        );
    }
    admin.password = f.string("password");
    admin
}

fn read_cluster(value: Option<&Value>, problems: &mut Vec<Problem>) -> Option<ClusterSection> {
    let mut f = Fields::open(value, "proxy.cluster", CLUSTER_KEYS, problems)?;
    let mut cluster = ClusterSection {
        cluster_id: f.string("cluster_id"),
        node_id: f.string("node_id"),
        ..ClusterSection::default()
    };
    if let Some(Err(e)) = cluster
        .cluster_id
        .as_deref()
        .map(identity::validate_cluster_id)
    {
        f.error("cluster_id", e.to_string());
    }
    if let Some(Err(e)) = cluster.node_id.as_deref().map(identity::validate_node_id) {
        f.error("node_id", e.to_string());
    }
    for (path, seed) in f.string_list("seeds") {
        match identity::normalize_seed(&seed, CHECK_PORT) {
            Ok(_) => cluster.seeds.push(seed.trim().to_string()),
            Err(e) => f.problems.push(Problem::error(path, e.to_string())),
        }
    }
    cluster.gossip_port = f.port("gossip_port");
    cluster.transport_port = f.port("transport_port");
    cluster.advertise_addr = f.string("advertise_addr");
    if let Some(Err(e)) = cluster
        .advertise_addr
        .as_deref()
        .map(|a| identity::parse_advertise(a, CHECK_PORT))
    {
        f.error("advertise_addr", e.to_string());
    }
    cluster.security = read_security(&mut f);
    Some(cluster)
}

fn read_security(cluster: &mut Fields<'_, '_>) -> Option<Security> {
    let path = cluster.child("security");
    let mut f = Fields::open(
        cluster.get("security"),
        &path,
        SECURITY_KEYS,
        cluster.problems,
    )?;
    let mut security = Security::default();
    match f.string("mode").as_deref() {
        None | Some("shared_key") => {}
        Some(other) => f.error(
            "mode",
            format!(
                "unsupported mode {:?}; supported: shared_key",
                shorten(other)
            ),
        ),
    }
    security.mode = SecurityMode::SharedKey;
    security.shared_key = f.string("shared_key");
    if let Some(Err(message)) = security
        .shared_key
        .as_deref()
        .map(|s| KeySource::parse(s).check())
    {
        f.error("shared_key", message);
    }
    Some(security)
}

fn read_acme(value: Option<&Value>, problems: &mut Vec<Problem>) -> Option<AcmeSection> {
    let mut f = Fields::open(value, "proxy.acme", ACME_KEYS, problems)?;
    let mut acme = AcmeSection::default();
    if let Some(enabled) = f.boolean("enabled") {
        acme.enabled = enabled;
    }
    acme.email = f.string("email");
    if let Some(email) = acme.email.as_deref() {
        let address = email.strip_prefix("mailto:").unwrap_or(email);
        let valid = address
            .split_once('@')
            .is_some_and(|(user, domain)| !user.is_empty() && domain.contains('.'))
            && !address.chars().any(char::is_whitespace);
        if !valid {
            f.error(
                "email",
                format!(
                    "{:?} is not an email address; expected one such as ops@example.com",
                    shorten(email)
                ),
            );
        }
    }
    if let Some(url) = f.string("directory_url") {
        let valid = ["https://", "http://"].iter().any(|scheme| {
            url.strip_prefix(scheme)
                .is_some_and(|rest| !rest.is_empty())
        });
        if !valid {
            f.error(
                "directory_url",
                format!(
                    "{:?} is not an http(s) URL; expected the CA's ACME directory, such as {}",
                    shorten(&url),
                    super::LETS_ENCRYPT_DIRECTORY
                ),
            );
        }
        acme.directory_url = url;
    }
    acme.ca_root = f.string("ca_root").map(PathBuf::from);
    let backend_name = f.string("storage_backend");
    acme.storage_backend = backend_name.as_deref().and_then(|name| {
        let backend = StorageBackend::from_name(name);
        if backend.is_none() {
            let supported: Vec<&str> = StorageBackend::ALL.iter().map(|b| b.as_str()).collect();
            f.error(
                "storage_backend",
                format!(
                    "unsupported backend {:?}; supported: {}",
                    shorten(name),
                    supported.join(", ")
                ),
            );
        }
        backend
    });
    acme.storage_path = f.string("storage_path");
    match (acme.storage_backend, acme.storage_path.as_deref()) {
        (Some(backend), Some(path)) => {
            if let Err(message) = check_storage_path(backend, path) {
                f.error("storage_path", message);
            }
        }
        (Some(backend), None) if acme.enabled && backend.needs_path() => f.error(
            "storage_path",
            format!(
                "required for storage_backend {:?}; expected {}",
                backend.as_str(),
                backend.path_form()
            ),
        ),
        _ => {}
    }
    acme.renew_before_days = f.days("renew_before_days");
    acme.eab = read_eab(&mut f);
    Some(acme)
}

fn read_eab(acme: &mut Fields<'_, '_>) -> Option<Eab> {
    let path = acme.child("eab");
    let mut f = Fields::open(acme.get("eab"), &path, EAB_KEYS, acme.problems)?;
    let kid = f.string("kid");
    if kid.is_none() {
        f.error(
            "kid",
            "required: the key identifier the CA gave for external account binding",
        );
    }
    let hmac_key = f.string("hmac_key");
    match hmac_key.as_deref() {
        None => f.error(
            "hmac_key",
            "required: the base64url-encoded HMAC key the CA gave with the key id",
        ),
        Some(key) => {
            let decoded = base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(key.trim().trim_end_matches('='));
            if !decoded.is_ok_and(|bytes| !bytes.is_empty()) {
                f.error(
                    "hmac_key",
                    "not base64url; expected the base64url-encoded HMAC key the CA gave with the key id",
                );
            }
        }
    }
    Some(Eab {
        kid: kid.unwrap_or_default(),
        hmac_key: hmac_key.unwrap_or_default(),
    })
}

/// Checks the form of `storage_path` for `backend` (SPEC section 2).
fn check_storage_path(backend: StorageBackend, path: &str) -> Result<(), String> {
    let url_with = |schemes: &[&str]| {
        schemes.iter().any(|scheme| {
            path.strip_prefix(scheme)
                .is_some_and(|rest| !rest.is_empty() && !rest.starts_with('/'))
        })
    };
    let valid = match backend {
        StorageBackend::Redis => {
            url_with(&["redis://", "rediss://"])
                || (!path.contains("://")
                    && path.rsplit_once(':').is_some_and(|(host, port)| {
                        !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0)
                    }))
        }
        StorageBackend::S3 => url_with(&["s3://"]),
        StorageBackend::Gcs => url_with(&["gs://"]),
        StorageBackend::Azure => url_with(&["az://"]),
        StorageBackend::File | StorageBackend::Redb => !path.contains("://"),
        StorageBackend::Memory => true,
    };
    if valid {
        Ok(())
    } else {
        Err(format!(
            "{:?} is not a {backend} location; expected {}",
            shorten(path),
            backend.path_form()
        ))
    }
}

fn read_origins(value: Option<&Value>, problems: &mut Vec<Problem>) -> Vec<String> {
    let map = match value {
        None | Some(Value::Null) => return Vec::new(),
        Some(Value::Mapping(map)) => map,
        Some(other) => {
            problems.push(Problem::error(
                "origins",
                format!(
                    "expected a mapping from hostname to origin settings, found {}",
                    describe(other)
                ),
            ));
            return Vec::new();
        }
    };
    let mut origins = Vec::with_capacity(map.len());
    for key in map.keys() {
        match key {
            Value::String(host) if !host.trim().is_empty() => origins.push(host.clone()),
            other => problems.push(Problem::error(
                child_path("origins", &key_text(other)),
                format!("expected a hostname as key, found {}", describe(other)),
            )),
        }
    }
    origins
}

/// A YAML mapping read key by key, reporting into `problems` under `path`.
struct Fields<'a, 'p> {
    map: &'a Mapping,
    path: String,
    problems: &'p mut Vec<Problem>,
}

impl<'a, 'p> Fields<'a, 'p> {
    /// Opens the section `value` at `path`. Absent or null: `None`, silently.
    /// Not a mapping: a problem and `None`. Keys outside `allowed` are reported.
    fn open(
        value: Option<&'a Value>,
        path: &str,
        allowed: &[&str],
        problems: &'p mut Vec<Problem>,
    ) -> Option<Self> {
        let map = match value {
            None | Some(Value::Null) => return None,
            Some(Value::Mapping(map)) => map,
            Some(other) => {
                problems.push(Problem::error(
                    path,
                    format!(
                        "expected a mapping with keys {}, found {}",
                        allowed.join(", "),
                        describe(other)
                    ),
                ));
                return None;
            }
        };
        for key in map.keys() {
            if !matches!(key, Value::String(k) if allowed.contains(&k.as_str())) {
                let name = key_text(key);
                let mut message = format!("unknown field; expected one of: {}", allowed.join(", "));
                if let Some(near) = closest(&name, allowed) {
                    message.push_str(&format!(" (did you mean {near}?)"));
                }
                problems.push(Problem::error(child_path(path, &name), message));
            }
        }
        Some(Fields {
            map,
            path: path.to_string(),
            problems,
        })
    }

    fn child(&self, key: &str) -> String {
        child_path(&self.path, key)
    }

    /// The value at `key`; `None` when absent or null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn error(&mut self, key: &str, message: impl Into<String>) {
        let path = self.child(key);
        self.problems.push(Problem::error(path, message));
    }

    /// A scalar as text. Numbers and booleans are taken as written (as YAML
    /// would deserialize them into a string). Empty or blank counts as absent,
    /// so an unset `${VAR}` leaves the setting to its default.
    fn string(&mut self, key: &str) -> Option<String> {
        let text = match self.get(key)? {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            other => {
                let message = format!("expected a string, found {}", describe(other));
                self.error(key, message);
                return None;
            }
        };
        (!text.trim().is_empty()).then_some(text)
    }

    fn boolean(&mut self, key: &str) -> Option<bool> {
        match self.get(key)? {
            Value::Bool(b) => Some(*b),
            other => {
                let message = format!("expected true or false, found {}", describe(other));
                self.error(key, message);
                None
            }
        }
    }

    /// A whole number in `range`; a string of digits is accepted too.
    fn integer(&mut self, key: &str, range: (u64, u64), what: &str) -> Option<u64> {
        let value = self.get(key)?;
        let number = match value {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.trim().parse::<u64>().ok(),
            _ => None,
        };
        match number {
            Some(n) if (range.0..=range.1).contains(&n) => Some(n),
            _ => {
                let message = format!(
                    "expected {what} from {} to {}, found {}",
                    range.0,
                    range.1,
                    describe(value)
                );
                self.error(key, message);
                None
            }
        }
    }

    fn port(&mut self, key: &str) -> Option<u16> {
        self.integer(key, (1, 65535), "a port number")
            .and_then(|n| u16::try_from(n).ok())
    }

    fn days(&mut self, key: &str) -> Option<u32> {
        self.integer(key, (1, 365), "a whole number of days")
            .and_then(|n| u32::try_from(n).ok())
    }

    /// A list of strings, each with its own path; a single string is taken as
    /// a comma-separated list. Blank entries are dropped.
    fn string_list(&mut self, key: &str) -> Vec<(String, String)> {
        let path = self.child(key);
        match self.get(key) {
            None => Vec::new(),
            Some(Value::String(s)) => s
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| (path.clone(), s.to_string()))
                .collect(),
            Some(Value::Sequence(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let item_path = format!("{path}[{i}]");
                    match item {
                        Value::String(s) if s.trim().is_empty() => {}
                        Value::String(s) => out.push((item_path, s.clone())),
                        other => self.problems.push(Problem::error(
                            item_path,
                            format!("expected a string, found {}", describe(other)),
                        )),
                    }
                }
                out
            }
            Some(other) => {
                let message = format!("expected a list of strings, found {}", describe(other));
                self.error(key, message);
                Vec::new()
            }
        }
    }
}

/// `parent.key`, quoting `key` when it is not a plain identifier
/// (`origins."api.example.com"`).
pub(super) fn child_path(parent: &str, key: &str) -> String {
    let plain = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if plain {
        format!("{parent}.{key}")
    } else {
        format!("{parent}.{:?}", shorten(key))
    }
}

fn key_text(key: &Value) -> String {
    match key {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Null => "null".to_string(),
        _ => "<complex key>".to_string(),
    }
}

/// How a value is named in messages.
fn describe(value: &Value) -> String {
    match value {
        Value::Null => "nothing (null)".to_string(),
        Value::Bool(b) => format!("a boolean ({b})"),
        Value::Number(n) => format!("a number ({n})"),
        Value::String(s) => format!("the string {:?}", shorten(s)),
        Value::Sequence(_) => "a list".to_string(),
        Value::Mapping(_) => "a mapping".to_string(),
        Value::Tagged(tagged) => format!("a value tagged {}", tagged.tag),
    }
}

/// At most 60 characters of `text`, so a pasted blob does not flood a message.
fn shorten(text: &str) -> String {
    if text.chars().count() <= 60 {
        text.to_string()
    } else {
        let mut cut: String = text.chars().take(60).collect();
        cut.push('…');
        cut
    }
}

/// The allowed key nearest to `name`, when it is close enough to be a typo.
fn closest<'k>(name: &str, allowed: &[&'k str]) -> Option<&'k str> {
    allowed
        .iter()
        .map(|candidate| (edit_distance(name, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= 2.max(candidate.len() / 4))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != *cb);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        previous = current;
    }
    previous[b.len()]
}
