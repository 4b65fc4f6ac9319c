//! Reading `sb.yml` as sbproxy 1.13 reads it: `${VAR}` substitution
//! ([`sbmesh::interpolate_report`]), YAML, the strict blocks
//! ([`sbmesh::unknown_keys`]) and the types of the values
//! the stand-in acts on.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::http::{HeaderName, HeaderValue, StatusCode};

use sbmesh::{
    DEFAULT_GOSSIP_PORT, DEFAULT_PROXY_ADMIN_BIND, DEFAULT_PROXY_ADMIN_PASSWORD,
    DEFAULT_PROXY_ADMIN_PORT, DEFAULT_PROXY_ADMIN_USER, DEFAULT_TRANSPORT_PORT, EnvLookup,
    child_path, interpolate_report,
};

use serde_norway::{Mapping, Value};

/// The default `proxy.http_bind_port`.
pub const DEFAULT_HTTP_BIND_PORT: u16 = 8080;
/// The default `proxy.admin.rate_limit_per_minute`.
pub const DEFAULT_RATE_LIMIT_PER_MINUTE: u64 = 240;

/// Top-level keys the stand-in knows; any other one only gets a warning.
const KNOWN_TOP_LEVEL: &[&str] = &["proxy", "origins"];

/// Why a file was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// Not UTF-8, not YAML, an unknown key of a strict block, a wrong type.
    Parse(String),
    /// An `env:NAME` / `file:PATH` field reference that cannot be resolved.
    Resolve(String),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Parse(m) => write!(f, "failed to parse config: {m}"),
            ConfigError::Resolve(m) => write!(f, "failed to resolve config source: {m}"),
        }
    }
}

/// `proxy.admin`, with the defaults of sbproxy 1.13.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminSettings {
    pub enabled: bool,
    pub port: u16,
    pub bind: IpAddr,
    pub username: String,
    pub password: String,
    /// 0: no limit.
    pub rate_limit_per_minute: u64,
    /// Empty: loopback only.
    pub allow_ips: Vec<IpNet>,
}

/// An address or a CIDR block of `proxy.admin.allow_ips`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl IpNet {
    fn parse(text: &str) -> Option<IpNet> {
        let text = text.trim();
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a.parse::<IpAddr>().ok()?, Some(p.parse::<u8>().ok()?)),
            None => (text.parse::<IpAddr>().ok()?, None),
        };
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        (prefix <= max).then_some(IpNet { addr, prefix })
    }

    /// Whether `ip` is inside this block.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// `proxy.cluster`'s ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterPorts {
    pub gossip_port: u16,
    pub transport_port: u16,
}

/// What an origin does with a request (`origins.<host>.action`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `type: mock`: the proxy answers by itself.
    Mock {
        status: StatusCode,
        body: String,
        headers: Vec<(HeaderName, HeaderValue)>,
    },
    /// Any other `type` (`proxy`, ...), or none: the stand-in has no
    /// upstreams, so it answers `502`.
    Unsupported {
        /// The `type` as written; `None` without an action or a type.
        kind: Option<String>,
    },
}

/// `origins`: the hostname as written, lowercased -> its action.
pub type Origins = HashMap<String, Action>;

/// What the stand-in acts on, from one file.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub admin: AdminSettings,
    /// `proxy.admin` as written (after `${VAR}` substitution), to tell
    /// whether a reload changed it (which needs a restart).
    pub admin_block: Value,
    pub http_bind_port: u16,
    pub https_bind_port: Option<u16>,
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    pub cluster: Option<ClusterPorts>,
    pub acme_enabled: bool,
    /// `origins`, shared by every request served with this config.
    pub origins: Arc<Origins>,
    /// Things that do not stop the file (unknown top-level keys,
    /// unresolved `${VAR}`).
    pub warnings: Vec<String>,
}

/// sha256 of the raw bytes, in hex: the `config_revision`.
pub fn revision(raw: &[u8]) -> String {
    hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, raw))
}

/// Reads one file's bytes as sbproxy 1.13 does.
pub fn parse(raw: &[u8], env: &EnvLookup<'_>) -> Result<Settings, ConfigError> {
    let text = std::str::from_utf8(raw)
        .map_err(|e| ConfigError::Parse(format!("the file is not UTF-8: {e}")))?;
    let interpolated = interpolate_report(text, env);
    let mut warnings: Vec<String> = interpolated
        .unresolved
        .iter()
        .map(|u| {
            format!(
                "line {}, column {}: ${{{}}} is kept as written (the variable is not set)",
                u.line, u.column, u.name
            )
        })
        .collect();
    let root: Value = serde_norway::from_str(&interpolated.text)
        .map_err(|e| ConfigError::Parse(format!("invalid YAML: {e}")))?;
    let empty = Value::Mapping(Mapping::new());
    let root = match root {
        Value::Null => empty,
        v @ Value::Mapping(_) => v,
        _ => return Err(parse_err("(root)", "expected a mapping")),
    };
    if let Some(unknown) = sbmesh::unknown_keys(&root).into_iter().next() {
        return Err(parse_err(
            &unknown.path,
            &format!(
                "unknown field, expected one of: {}",
                unknown.accepted.join(", ")
            ),
        ));
    }
    if let Value::Mapping(map) = &root {
        for key in map.keys() {
            let name = key.as_str().map(str::to_owned).unwrap_or_else(|| {
                serde_norway::to_string(key)
                    .unwrap_or_default()
                    .trim()
                    .to_owned()
            });
            if !KNOWN_TOP_LEVEL.contains(&name.as_str()) {
                warnings.push(format!("unknown top-level key {name:?} is ignored"));
            }
        }
    }

    let proxy = block(&root, "proxy", "proxy")?;
    for name in ["admin", "cluster", "acme", "extensions"] {
        block(
            proxy.unwrap_or(&Value::Null),
            name,
            &format!("proxy.{name}"),
        )?;
    }
    let get = |name: &str| proxy.and_then(|p| p.get(name)).filter(|v| !v.is_null());

    let admin_value = get("admin");
    let admin = read_admin(admin_value, env)?;
    let http_bind_port =
        port(get("http_bind_port"), "proxy.http_bind_port")?.unwrap_or(DEFAULT_HTTP_BIND_PORT);
    let https_bind_port = port(get("https_bind_port"), "proxy.https_bind_port")?;
    let tls_cert_file = string(get("tls_cert_file"), "proxy.tls_cert_file")?.map(PathBuf::from);
    let tls_key_file = string(get("tls_key_file"), "proxy.tls_key_file")?.map(PathBuf::from);
    match (&tls_cert_file, &tls_key_file) {
        (Some(_), None) => {
            return Err(parse_err(
                "proxy.tls_key_file",
                "missing: proxy.tls_cert_file is set, so proxy.tls_key_file must be too",
            ));
        }
        (None, Some(_)) => {
            return Err(parse_err(
                "proxy.tls_cert_file",
                "missing: proxy.tls_key_file is set, so proxy.tls_cert_file must be too",
            ));
        }
        _ => {}
    }
    let cluster = match get("cluster") {
        None => None,
        Some(c) => Some(ClusterPorts {
            gossip_port: port(c.get("gossip_port"), "proxy.cluster.gossip_port")?
                .unwrap_or(DEFAULT_GOSSIP_PORT),
            transport_port: port(c.get("transport_port"), "proxy.cluster.transport_port")?
                .unwrap_or(DEFAULT_TRANSPORT_PORT),
        }),
    };
    let acme_enabled = match get("acme") {
        None => false,
        Some(a) => boolean(a.get("enabled"), "proxy.acme.enabled")?.unwrap_or(false),
    };
    let origins = read_origins(block(&root, "origins", "origins")?, &mut warnings)?;
    Ok(Settings {
        admin,
        admin_block: admin_value.cloned().unwrap_or(Value::Null),
        http_bind_port,
        https_bind_port,
        tls_cert_file,
        tls_key_file,
        cluster,
        acme_enabled,
        origins: Arc::new(origins),
        warnings,
    })
}

/// `origins`: every key a hostname, matched case-insensitively. Only
/// `action.type`, and for `mock` its `status`, `body` and `headers`, are
/// read; any other key of an origin is accepted and ignored.
fn read_origins(value: Option<&Value>, warnings: &mut Vec<String>) -> Result<Origins, ConfigError> {
    let mut origins = Origins::new();
    let Some(Value::Mapping(map)) = value else {
        return Ok(origins);
    };
    for (key, origin) in map {
        let host = key_text(key);
        let at = child_path("origins", &host);
        let action = read_action(origin, &at)?;
        let lower = host.to_ascii_lowercase();
        if origins.contains_key(&lower) {
            warnings.push(format!(
                "{at}: the same hostname as an origin above (hostnames are case-insensitive); \
                 the first one answers"
            ));
            continue;
        }
        origins.insert(lower, action);
    }
    Ok(origins)
}

fn read_action(origin: &Value, at: &str) -> Result<Action, ConfigError> {
    let none = Action::Unsupported { kind: None };
    let origin = match origin {
        Value::Null => return Ok(none),
        Value::Mapping(_) => origin,
        other => {
            return Err(parse_err(
                at,
                &format!("expected a mapping, got {}", show(other)),
            ));
        }
    };
    let at = format!("{at}.action");
    let action = match origin.get("action") {
        None | Some(Value::Null) => return Ok(none),
        Some(a @ Value::Mapping(_)) => a,
        Some(other) => {
            return Err(parse_err(
                &at,
                &format!("expected a mapping, got {}", show(other)),
            ));
        }
    };
    let field = |name: &str| action.get(name).filter(|v| !v.is_null());
    let Some(kind) = string(field("type"), &format!("{at}.type"))? else {
        return Ok(none);
    };
    if kind != "mock" {
        return Ok(Action::Unsupported { kind: Some(kind) });
    }
    let status = match field("status") {
        None => StatusCode::OK,
        Some(v) => v
            .as_u64()
            .filter(|s| (200..=599).contains(s))
            .and_then(|s| StatusCode::from_u16(s as u16).ok())
            .ok_or_else(|| {
                parse_err(
                    &format!("{at}.status"),
                    &format!(
                        "expected an HTTP status (an integer 200..599), got {}",
                        show(v)
                    ),
                )
            })?,
    };
    let body = string(field("body"), &format!("{at}.body"))?.unwrap_or_default();
    let mut headers = Vec::new();
    match field("headers") {
        None => {}
        Some(Value::Mapping(map)) => {
            for (name, value) in map {
                let name = key_text(name);
                let path = child_path(&format!("{at}.headers"), &name);
                let header = HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| parse_err(&path, "not a valid HTTP header name"))?;
                let text = match value {
                    Value::String(s) => s.clone(),
                    Value::Number(n) => n.to_string(),
                    Value::Bool(b) => b.to_string(),
                    other => {
                        return Err(parse_err(
                            &path,
                            &format!("expected a string, got {}", show(other)),
                        ));
                    }
                };
                let value = HeaderValue::from_str(&text)
                    .map_err(|_| parse_err(&path, "not a valid HTTP header value"))?;
                headers.push((header, value));
            }
        }
        Some(other) => {
            return Err(parse_err(
                &format!("{at}.headers"),
                &format!(
                    "expected a mapping of header names to values, got {}",
                    show(other)
                ),
            ));
        }
    }
    Ok(Action::Mock {
        status,
        body,
        headers,
    })
}

/// A mapping key as text (YAML allows numbers and booleans as keys).
fn key_text(key: &Value) -> String {
    match key {
        Value::String(s) => s.clone(),
        other => serde_norway::to_string(other)
            .unwrap_or_default()
            .trim()
            .to_owned(),
    }
}

fn read_admin(value: Option<&Value>, env: &EnvLookup<'_>) -> Result<AdminSettings, ConfigError> {
    let field = |name: &str| value.and_then(|v| v.get(name)).filter(|v| !v.is_null());
    let enabled = boolean(field("enabled"), "proxy.admin.enabled")?.unwrap_or(false);
    let port = port(field("port"), "proxy.admin.port")?.unwrap_or(DEFAULT_PROXY_ADMIN_PORT);
    let bind = match string(field("bind"), "proxy.admin.bind")? {
        None => DEFAULT_PROXY_ADMIN_BIND,
        Some(b) => b
            .trim()
            .parse()
            .map_err(|_| parse_err("proxy.admin.bind", &format!("{b:?} is not an IP address")))?,
    };
    let username = match string(field("username"), "proxy.admin.username")? {
        None => DEFAULT_PROXY_ADMIN_USER.to_owned(),
        Some(u) => resolve_source(&u, "proxy.admin.username", env)?,
    };
    let password = match string(field("password"), "proxy.admin.password")? {
        None => DEFAULT_PROXY_ADMIN_PASSWORD.to_owned(),
        Some(p) => resolve_source(&p, "proxy.admin.password", env)?,
    };
    let rate_limit_per_minute = match field("rate_limit_per_minute") {
        None => DEFAULT_RATE_LIMIT_PER_MINUTE,
        Some(v) => v.as_u64().ok_or_else(|| {
            parse_err(
                "proxy.admin.rate_limit_per_minute",
                &format!("expected a non-negative integer, got {}", show(v)),
            )
        })?,
    };
    let allow_ips = match field("allow_ips") {
        None => Vec::new(),
        Some(Value::Sequence(items)) => {
            let mut nets = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let path = format!("proxy.admin.allow_ips[{i}]");
                let net = item.as_str().and_then(IpNet::parse).ok_or_else(|| {
                    parse_err(
                        &path,
                        &format!("expected an IP address or CIDR block, got {}", show(item)),
                    )
                })?;
                nets.push(net);
            }
            nets
        }
        Some(other) => {
            return Err(parse_err(
                "proxy.admin.allow_ips",
                &format!("expected a list of IP addresses, got {}", show(other)),
            ));
        }
    };
    if let Some(enc) = field("prompt_persistence_encryption") {
        boolean(
            enc.get("enabled"),
            "proxy.admin.prompt_persistence_encryption.enabled",
        )?;
    }
    Ok(AdminSettings {
        enabled,
        port,
        bind,
        username,
        password,
        rate_limit_per_minute,
        allow_ips,
    })
}

/// `env:NAME` and `file:PATH` per-field references; anything else is the
/// value itself.
fn resolve_source(value: &str, path: &str, env: &EnvLookup<'_>) -> Result<String, ConfigError> {
    if let Some(name) = value.strip_prefix("env:") {
        env(name).ok_or_else(|| {
            ConfigError::Resolve(format!(
                "{path}: the environment variable {name} is not set"
            ))
        })
    } else if let Some(file) = value.strip_prefix("file:") {
        std::fs::read_to_string(file)
            .map(|s| s.trim_end_matches(['\r', '\n']).to_owned())
            .map_err(|e| ConfigError::Resolve(format!("{path}: cannot read {file}: {e}")))
    } else {
        Ok(value.to_owned())
    }
}

/// The block `name` of `parent`: absent, null, or a mapping.
fn block<'v>(parent: &'v Value, name: &str, path: &str) -> Result<Option<&'v Value>, ConfigError> {
    match parent.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Mapping(_)) => Ok(Some(v)),
        Some(other) => Err(parse_err(
            path,
            &format!("expected a mapping, got {}", show(other)),
        )),
    }
}

fn port(value: Option<&Value>, path: &str) -> Result<Option<u16>, ConfigError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(p @ 1..=65535) => Ok(Some(p as u16)),
            _ => Err(parse_err(
                path,
                &format!("expected a port (an integer 1..65535), got {}", show(v)),
            )),
        },
    }
}

fn boolean(value: Option<&Value>, path: &str) -> Result<Option<bool>, ConfigError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(parse_err(
            path,
            &format!("expected a boolean, got {}", show(v)),
        )),
    }
}

fn string(value: Option<&Value>, path: &str) -> Result<Option<String>, ConfigError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(parse_err(
            path,
            &format!("expected a string, got {}", show(v)),
        )),
    }
}

fn parse_err(path: &str, message: &str) -> ConfigError {
    ConfigError::Parse(format!("{path}: {message}"))
}

/// A value as YAML on one line, for messages.
fn show(value: &Value) -> String {
    let text = serde_norway::to_string(value).unwrap_or_default();
    let text = text.trim().replace('\n', " ");
    if text.chars().count() > 60 {
        format!("{}…", text.chars().take(60).collect::<String>())
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn parse_str(text: &str) -> Result<Settings, ConfigError> {
        parse(text.as_bytes(), &no_env)
    }

    #[test]
    fn defaults() {
        let s = parse_str("").unwrap();
        assert!(!s.admin.enabled);
        assert_eq!(s.admin.port, 9090);
        assert_eq!(s.admin.username, "admin");
        assert_eq!(s.admin.password, "changeme");
        assert_eq!(s.admin.rate_limit_per_minute, 240);
        assert_eq!(s.http_bind_port, 8080);
        assert!(s.cluster.is_none());
    }

    #[test]
    fn strict_blocks_and_types() {
        let e = parse_str("proxy:\n  acme:\n    eab: {kid: a}\n").unwrap_err();
        assert!(e.to_string().contains("proxy.acme.eab"), "{e}");
        let e = parse_str("proxy:\n  admin:\n    port: \"9090\"\n").unwrap_err();
        assert!(e.to_string().contains("proxy.admin.port"), "{e}");
        let e = parse_str("proxy:\n  admin:\n    port: 70000\n").unwrap_err();
        assert!(e.to_string().contains("proxy.admin.port"), "{e}");
        let e = parse_str("proxy:\n  admin:\n    enabled: yes\n").unwrap_err();
        assert!(e.to_string().contains("proxy.admin.enabled"), "{e}");
        let e = parse_str("proxy:\n  cluster:\n    gossip_port: 0\n").unwrap_err();
        assert!(e.to_string().contains("proxy.cluster.gossip_port"), "{e}");
        let e = parse_str("proxy: [1]\n").unwrap_err();
        assert!(
            e.to_string().starts_with("failed to parse config: proxy:"),
            "{e}"
        );
        let s = parse_str("colour: red\nproxy:\n  extensions: {anything: {goes: 1}}\n").unwrap();
        assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
    }

    #[test]
    fn field_references() {
        let env = |n: &str| (n == "PW").then(|| "s3cret".to_string());
        let s = parse(b"proxy:\n  admin:\n    password: env:PW\n", &env).unwrap();
        assert_eq!(s.admin.password, "s3cret");
        let e = parse(b"proxy:\n  admin:\n    password: env:NOPE\n", &env).unwrap_err();
        assert!(matches!(e, ConfigError::Resolve(_)), "{e}");
    }

    #[test]
    fn origins_and_their_actions() {
        let s = parse_str(
            "origins:\n  Demo.Example.com:\n    action: {type: mock, status: 201, body: hi, headers: {X-Config: one, X-N: 3}}\n  plain.example.com:\n    action: {type: mock}\n  api.example.com:\n    action: {type: proxy, url: \"http://web:8080\"}\n  \"*.example.com\": {}\n  bare.example.com:\n",
        )
        .unwrap();
        assert_eq!(s.origins.len(), 5);
        let Action::Mock {
            status,
            body,
            headers,
        } = &s.origins["demo.example.com"]
        else {
            panic!("{:?}", s.origins);
        };
        assert_eq!((status.as_u16(), body.as_str()), (201, "hi"));
        assert_eq!(headers.len(), 2);
        assert_eq!(headers[0].0, "x-config");
        assert_eq!(headers[1].1, "3");
        assert_eq!(
            s.origins["plain.example.com"],
            Action::Mock {
                status: StatusCode::OK,
                body: String::new(),
                headers: Vec::new()
            }
        );
        assert_eq!(
            s.origins["api.example.com"],
            Action::Unsupported {
                kind: Some("proxy".into())
            }
        );
        assert_eq!(
            s.origins["*.example.com"],
            Action::Unsupported { kind: None }
        );
        assert_eq!(
            s.origins["bare.example.com"],
            Action::Unsupported { kind: None }
        );
        assert!(parse_str("origins: {}\n").unwrap().origins.is_empty());
        assert!(parse_str("origins:\n").unwrap().origins.is_empty());
    }

    #[test]
    fn bad_origin_values_are_refused_naming_the_path() {
        for (text, path) in [
            (
                "origins:\n  a.example.com:\n    action: {type: mock, status: \"200\"}\n",
                "origins.\"a.example.com\".action.status:",
            ),
            (
                "origins:\n  a.example.com:\n    action: {type: mock, status: 2.5}\n",
                "origins.\"a.example.com\".action.status:",
            ),
            (
                "origins:\n  a.example.com:\n    action: {type: mock, status: 1000}\n",
                "origins.\"a.example.com\".action.status:",
            ),
            (
                "origins:\n  a.example.com:\n    action: {type: mock, status: 101}\n",
                "origins.\"a.example.com\".action.status:",
            ),
            (
                "origins:\n  a.example.com:\n    action: {type: mock, body: [1]}\n",
                "origins.\"a.example.com\".action.body:",
            ),
            (
                "origins:\n  a.example.com:\n    action: {type: mock, headers: {\"bad name\": x}}\n",
                "origins.\"a.example.com\".action.headers.\"bad name\":",
            ),
            (
                "origins:\n  a.example.com:\n    action: {type: [mock]}\n",
                "origins.\"a.example.com\".action.type:",
            ),
            (
                "origins:\n  a.example.com:\n    action: mock\n",
                "origins.\"a.example.com\".action:",
            ),
            (
                "origins:\n  a.example.com: 3\n",
                "origins.\"a.example.com\":",
            ),
            ("origins: [a.example.com]\n", "origins:"),
        ] {
            let e = parse_str(text).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("failed to parse config: {path}")),
                "{text}: {e}"
            );
        }
        // The same hostname twice: the first answers, with a warning.
        let s = parse_str(
            "origins:\n  a.example.com: {action: {type: mock, body: one}}\n  A.example.com: {action: {type: mock, body: two}}\n",
        )
        .unwrap();
        assert!(matches!(&s.origins["a.example.com"], Action::Mock { body, .. } if body == "one"));
        assert_eq!(s.warnings.len(), 1, "{:?}", s.warnings);
    }

    #[test]
    fn allow_ips() {
        let net = IpNet::parse("10.1.0.0/16").unwrap();
        assert!(net.contains("10.1.2.3".parse().unwrap()));
        assert!(!net.contains("10.2.0.1".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.0.9".parse().unwrap()));
        let all = IpNet::parse("0.0.0.0/0").unwrap();
        assert!(all.contains("192.0.2.1".parse().unwrap()));
        assert!(IpNet::parse("10.0.0.0/33").is_none());
        assert!(
            IpNet::parse("::1")
                .unwrap()
                .contains("::1".parse().unwrap())
        );
    }
}
