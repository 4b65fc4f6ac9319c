//! The config checks: `ConfigInvalid`, then `AcmeStoreNotShared`.

use std::collections::BTreeMap;

use kube::ResourceExt;
use sbmesh::{Flag, Interpolated, Problem};

use serde_norway::Value as Yaml;

use crate::crd::{self, SBProxy};

use super::sidecar::{challenge_passthrough_url, cluster_key_file};
use super::{
    ACME_BLOCKS, CONFIG_DIR, CONFIG_KEY, DATA_DIR, Refusal, RefusalReason, acme_check_url,
    acme_store_not_shared_message, mesh_name,
};

/// What the sidecar's environment will hold, as far as it is known before a
/// pod exists: literal values the operator sets, and stand-ins of the right
/// form for what only the pod knows (its name, its IP, Secret values).
/// The literal values of `spec.podTemplate.sidecarEnv` are known too (one
/// that would change the operator's is refused: PodTemplateInvalid). Every
/// other variable is unknown: unset in the sidecar unless the image sets it,
/// or set from a Secret, so a value that depends on one is left for the
/// sidecar to check.
fn known_env<'p>(proxy: &'p SBProxy, ns: &str) -> BTreeMap<&'p str, String> {
    let spec = &proxy.spec;
    let name = proxy.name_any();
    let mut env = BTreeMap::from([
        (Flag::POD_NAME.env, format!("{name}-proxy-0")),
        ("HOSTNAME", format!("{name}-proxy-0")),
        // TEST-NET-1: any address of the right form.
        (Flag::POD_IP.env, "192.0.2.1".to_string()),
        (Flag::NAMESPACE.env, ns.to_string()),
        (Flag::CLUSTER_ID.env, name.clone()),
        (Flag::CONFIG.env, format!("{CONFIG_DIR}/{CONFIG_KEY}")),
        (
            Flag::ADMIN_LISTEN.env,
            format!("0.0.0.0:{}", spec.sidecar.admin_port),
        ),
        (
            Flag::CHALLENGE_LISTEN.env,
            format!("0.0.0.0:{}", spec.sidecar.challenge_port),
        ),
        (Flag::CERT_DIR.env, format!("{DATA_DIR}/certs")),
        (Flag::STATE_DIR.env, format!("{DATA_DIR}/sidecar")),
        (
            Flag::PROXY_RELOAD_URL.env,
            format!("http://127.0.0.1:{}/admin/reload", spec.admin_port),
        ),
        (
            Flag::CHALLENGE_PASSTHROUGH.env,
            challenge_passthrough_url(spec.port),
        ),
        (Flag::ACME_CHECK_URL.env, acme_check_url(proxy, ns)),
    ]);
    if spec.clustering.enabled {
        env.insert(Flag::MESH_SERVICE.env, mesh_name(&name));
        env.insert(
            Flag::CLUSTER_DOMAIN.env,
            spec.clustering.cluster_domain.clone(),
        );
        env.insert(
            Flag::GOSSIP_PORT.env,
            spec.clustering.gossip_port.to_string(),
        );
        env.insert(
            Flag::TRANSPORT_PORT.env,
            spec.clustering.transport_port.to_string(),
        );
        env.insert(Flag::CLUSTER_KEY_FILE.env, cluster_key_file());
    }
    if spec.admin_auth_secret_ref.is_some() {
        env.insert(
            Flag::PROXY_AUTHORIZATION.env,
            "Basic c2JtZXNoOnNibWVzaA==".to_string(),
        );
    }
    let literals = spec
        .pod_template
        .iter()
        .flat_map(|t| &t.sidecar_env)
        .filter(|var| var.value_from.is_none());
    for var in literals {
        env.entry(var.name.as_str())
            .or_insert_with(|| var.value.clone().unwrap_or_default());
    }
    env
}

/// What the other objects need from an accepted config.
pub(super) struct ConfigFacts {
    /// The sidecar restarts the proxy: `SBMESH_PROXY_CERT_APPLY` in
    /// `sidecarEnv`, else `sbmesh.acme.apply`, is `restart`.
    pub(super) restarts_proxy: bool,
    /// `proxy.https_bind_port`: a port of the proxy the NetworkPolicy
    /// admits, `<name>-svc` exposes as 443 and the proxy container declares.
    pub(super) https_port: Option<i32>,
    /// `proxy.http_bind_port`, when the config sets it (`spec.port` is the
    /// one the objects use; this only counts for [`low_port_privileges`](super::pod::low_port_privileges)).
    pub(super) http_port: Option<i32>,
}

/// ConfigInvalid and AcmeStoreNotShared, in that order (the documented message
/// wins for `storage_backend: sqlite`, which the sidecar refuses as unknown).
pub(super) fn check_config(proxy: &SBProxy, ns: &str, text: &str) -> Result<ConfigFacts, Refusal> {
    let config_name = proxy.spec.config_ref.name().unwrap_or_default();
    let invalid = |problems: Vec<String>| {
        Refusal::new(
            RefusalReason::ConfigInvalid,
            format!(
                "SBProxyConfig {config_name:?} in namespace {ns:?}: spec.config is not a valid sb.yml:\n{}",
                problems.join("\n")
            ),
        )
    };
    if text.len() > crd::MAX_CONFIG_BYTES {
        return Err(invalid(vec![format!(
            "(file): {} bytes; a ConfigMap holds at most {} (1 MiB)",
            text.len(),
            crd::MAX_CONFIG_BYTES
        )]));
    }

    let env = known_env(proxy, ns);
    let interpolated = sbmesh::interpolate_report(text, &|var| env.get(var).cloned());
    let reading = Reading {
        raw: serde_norway::from_str(text).ok(),
        tree: serde_norway::from_str::<Yaml>(&interpolated.text)
            .ok()
            .and_then(|mut v| v.apply_merge().ok().map(|()| v)),
        env,
    };
    let not_shared = acme_store_not_shared(proxy, &reading);
    let view = sidecar_view(&reading, &interpolated);
    let restarts_proxy = view.restarts_proxy;
    // AcmeStoreNotShared says more about that backend than ConfigInvalid.
    let skip = not_shared
        .as_ref()
        .map(|(block, _)| format!("{block}.storage_backend"));
    let problems = blocking_problems(proxy, &reading, view, skip.as_deref());
    if !problems.is_empty() {
        return Err(invalid(problems));
    }
    if let Some((block, backend)) = not_shared {
        return Err(Refusal::new(
            RefusalReason::AcmeStoreNotShared,
            acme_store_not_shared_message(proxy.spec.replicas, &block, &backend),
        ));
    }
    Ok(ConfigFacts {
        restarts_proxy,
        https_port: reading.proxy_port("https_bind_port"),
        http_port: reading.proxy_port("http_bind_port"),
    })
}

/// A config text as the checks read it.
struct Reading<'p> {
    /// The sidecar's environment, as far as it is known ([`known_env`]).
    env: BTreeMap<&'p str, String>,
    /// The text as written, to tell which values depend on unknown
    /// variables. It may fail to parse where the interpolated text does
    /// not; then nothing is excused.
    raw: Option<Yaml>,
    /// The interpolated text, its merge keys applied.
    tree: Option<Yaml>,
}

impl Reading<'_> {
    fn is_known(&self, var: &str) -> bool {
        self.env.contains_key(var)
    }

    /// A sidecar port: its environment, then the file, then its default.
    fn sidecar_port(&self, var: &str, from_file: Option<u16>, default: u16) -> u16 {
        self.env
            .get(var)
            .and_then(|v| v.trim().parse::<u16>().ok())
            .or(from_file)
            .unwrap_or(default)
    }

    /// `proxy.<key>` as a port, when the config sets one other than 0.
    fn proxy_port(&self, key: &str) -> Option<i32> {
        self.tree
            .as_ref()
            .and_then(|t| yaml_at(t, &["proxy", key]))
            .and_then(scalar_text)
            .and_then(|p| p.trim().parse::<u16>().ok())
            .filter(|p| *p != 0)
            .map(i32::from)
    }

    /// A clash with the sidecar's port written with a variable the operator
    /// cannot know (and not set by spec.clustering): left to the sidecar.
    fn sidecar_port_unknown(&self, path: &str) -> bool {
        [
            ("gossip_port", Flag::GOSSIP_PORT.env),
            ("transport_port", Flag::TRANSPORT_PORT.env),
        ]
        .iter()
        .any(|(key, var)| {
            path == format!("proxy.cluster.{key}")
                && !self.is_known(var)
                && value_depends_on_unknown(
                    self.raw.as_ref(),
                    &format!("proxy.extensions.sbmesh.{key}"),
                    &|v| self.is_known(v),
                )
        })
    }
}

/// AcmeStoreNotShared: either ACME block, enabled, on a store local to one
/// pod, with more than one replica, as (the block's path, the backend). A
/// backend that depends on a variable the operator cannot know is left to
/// the sidecar.
fn acme_store_not_shared(proxy: &SBProxy, reading: &Reading) -> Option<(String, String)> {
    ACME_BLOCKS.iter().find_map(|block| {
        let acme = reading.tree.as_ref().and_then(|t| yaml_at(t, block))?;
        let enabled = acme.get("enabled").and_then(Yaml::as_bool) == Some(true);
        let backend = acme
            .get("storage_backend")
            .and_then(scalar_text)
            .map(|b| b.trim().to_owned())
            .filter(|b| !b.is_empty())
            .unwrap_or_else(|| "redb".to_owned());
        let mut raw_path = block.to_vec();
        raw_path.push("storage_backend");
        let backend_unknown = reading
            .raw
            .as_ref()
            .and_then(|r| yaml_at(r, &raw_path))
            .is_some_and(|v| mentions_unknown(v, &|var| reading.is_known(var)));
        let local = matches!(backend.as_str(), "redb" | "memory" | "sqlite");
        (proxy.spec.replicas > 1 && enabled && local && !backend_unknown)
            .then(|| (block.join("."), backend))
    })
}

/// What the sidecar makes of a config: the problems of parsing it, the
/// conflicts of a parsed file with the sidecar's ports, apart (a conflict
/// is about the value at its path: a port left to its default clashes
/// whatever else the block holds, so only that value can excuse it), and
/// whether it restarts the proxy.
struct SidecarView {
    problems: Vec<Problem>,
    conflicts: Vec<Problem>,
    restarts_proxy: bool,
}

fn sidecar_view(reading: &Reading, interpolated: &Interpolated) -> SidecarView {
    let config = match sbmesh::parse_interpolated_config(interpolated) {
        Ok(config) => config,
        Err(problems) => {
            return SidecarView {
                problems,
                conflicts: Vec::new(),
                restarts_proxy: false,
            };
        }
    };
    let sbmesh = config.sbmesh();
    // The sidecar's precedence: its environment, then the file.
    let apply = reading
        .env
        .get(Flag::PROXY_CERT_APPLY.env)
        .and_then(|v| sbmesh::CertApply::from_name(v.trim()))
        .or_else(|| sbmesh.acme.as_ref().and_then(|a| a.apply));
    let ports = sbmesh::SidecarPorts {
        gossip: reading.sidecar_port(
            Flag::GOSSIP_PORT.env,
            sbmesh.gossip_port,
            sbmesh::DEFAULT_GOSSIP_PORT,
        ),
        transport: reading.sidecar_port(
            Flag::TRANSPORT_PORT.env,
            sbmesh.transport_port,
            sbmesh::DEFAULT_TRANSPORT_PORT,
        ),
    };
    SidecarView {
        problems: Vec::new(),
        conflicts: sbmesh::config_conflicts(&config, ports),
        restarts_proxy: apply == Some(sbmesh::CertApply::Restart),
    }
}

/// The errors that refuse the config (ConfigInvalid), one line each: the
/// sidecar's and [`admin_port_problem`], but for the one at `skip` and those
/// about a value the operator cannot know (left to the sidecar).
fn blocking_problems(
    proxy: &SBProxy,
    reading: &Reading,
    view: SidecarView,
    skip: Option<&str>,
) -> Vec<String> {
    let raw = reading.raw.as_ref();
    let is_known = |var: &str| reading.is_known(var);
    let mut problems = view.problems;
    problems.extend(admin_port_problem(proxy, reading.tree.as_ref()));
    problems
        .into_iter()
        .filter(Problem::is_error)
        .filter(|p| Some(p.path.as_str()) != skip)
        .filter(|p| !depends_on_unknown(raw, &p.path, &is_known))
        .chain(
            view.conflicts
                .into_iter()
                .filter(Problem::is_error)
                .filter(|p| !value_depends_on_unknown(raw, &p.path, &is_known))
                .filter(|p| !reading.sidecar_port_unknown(&p.path)),
        )
        .map(|p| p.to_string())
        .collect()
}

/// The sidecar POSTs reloads to `spec.adminPort`: a config whose
/// `proxy.admin.port` says otherwise would never be reloaded.
fn admin_port_problem(proxy: &SBProxy, tree: Option<&Yaml>) -> Option<Problem> {
    let port = tree.and_then(|t| yaml_at(t, &["proxy", "admin", "port"]))?;
    let port = scalar_text(port)?;
    let port: i64 = port.trim().parse().ok()?;
    (port != i64::from(proxy.spec.admin_port)).then(|| {
        Problem::error(
            "proxy.admin.port",
            format!(
                "is {port} but spec.adminPort of the SBProxy is {}; the sidecar POSTs reloads to \
                 spec.adminPort, so make the two equal",
                proxy.spec.admin_port
            ),
        )
    })
}

fn yaml_at<'a>(value: &'a Yaml, keys: &[&str]) -> Option<&'a Yaml> {
    keys.iter().try_fold(value, |v, key| v.get(*key))
}

fn scalar_text(value: &Yaml) -> Option<String> {
    match value {
        Yaml::String(s) => Some(s.clone()),
        Yaml::Number(n) => Some(n.to_string()),
        Yaml::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Whether the problem at `path` (as sbmesh writes paths:
/// `proxy.extensions.sbmesh.seeds[1]`, `origins."a.example.com"`) concerns
/// a value written with a `${VAR}` the operator cannot know. When the path
/// does not exist as written, its nearest existing ancestor is looked at
/// (conflicts use [`value_depends_on_unknown`] instead).
fn depends_on_unknown(raw: Option<&Yaml>, path: &str, is_known: &dyn Fn(&str) -> bool) -> bool {
    walk(raw, path).is_some_and(|(node, _)| mentions_unknown(node, is_known))
}

/// Whether the value at exactly `path` exists as written and references a
/// variable the operator cannot know (no ancestor is looked at).
fn value_depends_on_unknown(
    raw: Option<&Yaml>,
    path: &str,
    is_known: &dyn Fn(&str) -> bool,
) -> bool {
    walk(raw, path).is_some_and(|(node, exact)| exact && mentions_unknown(node, is_known))
}

/// The node at `path` in `raw`, or its nearest existing ancestor, and
/// whether it is the node itself. `None` for locations that are not YAML
/// paths.
fn walk<'y>(raw: Option<&'y Yaml>, path: &str) -> Option<(&'y Yaml, bool)> {
    let (mut node, segments) = (raw?, path_segments(path)?);
    for segment in &segments {
        let next = match segment {
            Segment::Key(key) => node.get(key.as_str()),
            Segment::Index(i) => node.get(*i),
        };
        match next {
            Some(next) => node = next,
            None => return Some((node, false)),
        }
    }
    Some((node, true))
}

enum Segment {
    Key(String),
    Index(usize),
}

/// Splits a problem path into keys and indexes; `None` for the locations
/// that are not YAML paths (`line 2, column 5`, `(yaml)`, `(root)`).
fn path_segments(path: &str) -> Option<Vec<Segment>> {
    if path.starts_with('(') || path.starts_with("line ") {
        return None;
    }
    let mut segments = Vec::new();
    let mut chars = path.chars().peekable();
    while chars.peek().is_some() {
        match chars.peek() {
            Some('.') => {
                chars.next();
            }
            Some('"') => {
                chars.next();
                let mut key = String::new();
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => key.extend(chars.next()),
                        '"' => break,
                        c => key.push(c),
                    }
                }
                segments.push(Segment::Key(key));
            }
            Some('[') => {
                chars.next();
                let digits: String = chars.by_ref().take_while(|c| *c != ']').collect();
                segments.push(Segment::Index(digits.parse().ok()?));
            }
            _ => {
                let mut key = String::new();
                while let Some(&c) = chars.peek() {
                    if c == '.' || c == '[' {
                        break;
                    }
                    key.push(c);
                    chars.next();
                }
                segments.push(Segment::Key(key));
            }
        }
    }
    Some(segments)
}

/// Whether any key or scalar under `value` references an unknown variable.
fn mentions_unknown(value: &Yaml, is_known: &dyn Fn(&str) -> bool) -> bool {
    match value {
        Yaml::String(s) => references(s).any(|var| !is_known(var)),
        Yaml::Sequence(items) => items.iter().any(|v| mentions_unknown(v, is_known)),
        Yaml::Mapping(map) => map
            .iter()
            .any(|(k, v)| mentions_unknown(k, is_known) || mentions_unknown(v, is_known)),
        Yaml::Tagged(tagged) => mentions_unknown(&tagged.value, is_known),
        _ => false,
    }
}

/// The variable names of the `${NAME...}` references in `text`, skipping
/// `$${` escapes (nested defaults included).
pub(super) fn references(text: &str) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    (0..bytes.len()).filter_map(move |i| {
        let opens = bytes[i] == b'$' && bytes.get(i + 1) == Some(&b'{');
        let escaped = i > 0 && bytes[i - 1] == b'$';
        if !opens || escaped {
            return None;
        }
        let rest = &text[i + 2..];
        let len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        Some(&rest[..len])
    })
}
