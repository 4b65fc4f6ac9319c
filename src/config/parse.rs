//! From interpolated `sb.yml` text to [`SbConfig`], reading the YAML tree
//! field by field so that every problem is collected with its path, where a
//! derived `Deserialize` would stop at the first.
//!
//! Strict (unknown keys are problems) only inside the sidecar's block
//! `proxy.extensions.sbmesh`; the proxy's own blocks are read for the few
//! values the sidecar uses, and a key sbproxy 1.13 would refuse there is a
//! warning (the proxy's own error, said early).

use std::net::IpAddr;
use std::path::PathBuf;

use base64::Engine as _;
use serde_norway::{Mapping, Value};

use super::interpolate::Unresolved;
use super::key::KeySource;
use super::{
    AcmeSection, AdminSection, CertApply, CertificateMode, Challenge, DEFAULT_GOSSIP_PORT,
    DEFAULT_TRANSPORT_PORT, DNS_PORT, Dns01Section, DnsProvider, Eab, MAX_SAN_NAMES, Problem,
    ProxyAcme, ProxyCluster, ProxySection, SBMESH_PATH, SbConfig, SbmeshSection, StorageBackend,
    TsigAlgorithm, hostname, sbproxy,
};
use crate::identity;

const SBMESH_KEYS: &[&str] = &[
    "cluster_id",
    "node_id",
    "seeds",
    "gossip_port",
    "transport_port",
    "advertise_addr",
    "shared_key",
    "acme",
];
const ACME_KEYS: &[&str] = &[
    "enabled",
    "email",
    "directory_url",
    "ca_root",
    "eab",
    "storage_backend",
    "storage_path",
    "renew_before_days",
    "certificates",
    "apply",
    "challenge",
    "dns01",
];
const EAB_KEYS: &[&str] = &["kid", "hmac_key"];
/// Every key of `dns01`: the provider's own ([`DnsProvider::keys`]) and these.
const DNS01_COMMON_KEYS: &[&str] = &["provider", "propagation_timeout"];
/// The range of `dns01.propagation_timeout`, seconds.
const PROPAGATION_TIMEOUT_RANGE: (u64, u64) = (1, 3600);

/// Lifetime of the certificates the public CAs whose directories are known
/// here issue, to check `renew_before_days` before any certificate exists.
const KNOWN_LIFETIMES: &[(&str, u32)] = &[
    ("https://acme-v02.api.letsencrypt.org/directory", 90),
    ("https://acme-staging-v02.api.letsencrypt.org/directory", 90),
];

/// The default gossip port, used only to check the form of seeds and
/// `advertise_addr` here; the sidecar applies the real one.
const CHECK_PORT: u16 = DEFAULT_GOSSIP_PORT;

/// Parses interpolated text in which the references `unresolved` were left
/// as written: each is a warning, and an error where the sidecar's own
/// block uses it.
pub(super) fn parse(text: &str, unresolved: &[Unresolved]) -> Result<SbConfig, Vec<Problem>> {
    let mut value: Value = serde_norway::from_str(text).map_err(|e| vec![syntax_problem(&e)])?;
    value.apply_merge().map_err(|e| {
        vec![Problem::error(
            "(yaml)",
            format!("cannot apply merge keys (<<): {e}"),
        )]
    })?;
    let root = root_mapping(&value)?;
    let mut problems: Vec<Problem> = unresolved.iter().map(Unresolved::warning).collect();
    problems.extend(sbproxy_unknown_keys(&value));
    let proxy = match root.get("proxy") {
        None | Some(Value::Null) => None,
        Some(Value::Mapping(proxy)) => Some(proxy),
        Some(other) => {
            problems.push(Problem::error(
                "proxy",
                format!(
                    "expected a mapping (with admin, extensions, ...), found {}",
                    describe(other)
                ),
            ));
            None
        }
    };
    let mut ctx = Ctx {
        problems,
        unresolved,
    };
    let section = |name: &str| proxy.and_then(|p| p.get(name));
    let admin = read_admin(section("admin"), &mut ctx);
    let cluster = read_proxy_cluster(section("cluster"), &mut ctx);
    let acme = read_proxy_acme(section("acme"), &mut ctx);
    let mut top = Fields::lenient(proxy, "proxy", &mut ctx);
    let tls_cert_file = top
        .as_mut()
        .and_then(|f| f.string("tls_cert_file"))
        .map(PathBuf::from);
    let tls_key_file = top
        .as_mut()
        .and_then(|f| f.string("tls_key_file"))
        .map(PathBuf::from);
    drop(top);
    if let Some(path) = tls_without_port(proxy, acme.as_ref(), tls_cert_file.is_some()) {
        ctx.problems.push(Problem::warning(path, TLS_WITHOUT_PORT));
    }
    let sbmesh = read_sbmesh(section("extensions"), &mut ctx);
    let acme_on = sbmesh
        .as_ref()
        .and_then(|s| s.acme.as_ref())
        .filter(|a| a.enabled);
    let origins = read_origins(root.get("origins"), acme_on, &mut ctx);

    let config = SbConfig {
        proxy: ProxySection {
            admin,
            cluster,
            acme,
            tls_cert_file,
            tls_key_file,
            sbmesh,
        },
        origins,
        notes: Vec::new(),
    };
    let (errors, notes): (Vec<Problem>, Vec<Problem>) =
        ctx.problems.into_iter().partition(Problem::is_error);
    let config = SbConfig { notes, ..config };
    if errors.is_empty() {
        Ok(config)
    } else {
        let mut problems = errors;
        problems.extend(config.warnings());
        Err(problems)
    }
}

/// The document's top-level mapping, or the one problem it has instead.
fn root_mapping(value: &Value) -> Result<&Mapping, Vec<Problem>> {
    match value {
        Value::Mapping(root) => Ok(root),
        Value::Null => Err(vec![Problem::error(
            "(root)",
            "the document is empty; expected a mapping with `proxy` and `origins`",
        )]),
        other => Err(vec![Problem::error(
            "(root)",
            format!(
                "expected a mapping with `proxy` and `origins` at the top level, found {}",
                describe(other)
            ),
        )]),
    }
}

/// A warning for each key sbproxy 1.13 itself refuses, naming what its
/// block accepts and the nearest of those.
fn sbproxy_unknown_keys(value: &Value) -> Vec<Problem> {
    sbproxy::unknown_keys(value)
        .into_iter()
        .map(|unknown| {
            let mut message = format!(
                "sbproxy 1.13 refuses this key, and with it the whole file; its block accepts: {}",
                unknown.accepted.join(", ")
            );
            if unknown.path == "proxy.acme.eab" {
                message.push_str(
                    " (external account binding for the sidecar's ACME goes in \
                     proxy.extensions.sbmesh.acme.eab)",
                );
            } else if let Some(near) = closest(
                unknown.path.rsplit('.').next().unwrap_or_default(),
                unknown.accepted,
            ) {
                message.push_str(&format!(" (did you mean {near}?)"));
            }
            Problem::warning(unknown.path, message)
        })
        .collect()
}

/// Why sbproxy 1.13 exits at start-up when TLS is on without a TLS port.
const TLS_WITHOUT_PORT: &str = "sbproxy 1.13 does not start with this and no \
     proxy.https_bind_port: it turns TLS on, and the proxy exits with \
     \"https_bind_port must be set to use TLS\"; set proxy.https_bind_port (8443, say)";

/// Where a config turns the proxy's TLS on (its own ACME, else a
/// certificate file) without `proxy.https_bind_port`.
fn tls_without_port(
    proxy: Option<&Mapping>,
    acme: Option<&ProxyAcme>,
    cert_file: bool,
) -> Option<&'static str> {
    let port = proxy
        .and_then(|p| p.get("https_bind_port"))
        .is_some_and(|v| !v.is_null());
    if port {
        None
    } else if acme.is_some_and(|a| a.enabled) {
        Some("proxy.acme.enabled")
    } else if cert_file {
        Some("proxy.tls_cert_file")
    } else {
        None
    }
}

fn syntax_problem(e: &serde_norway::Error) -> Problem {
    let mut message = e.to_string();
    // The YAML crate's own words for its memory guards say little to
    // someone who did not write a parser.
    if message.starts_with("repetition limit exceeded") {
        message = format!(
            "{message}: the aliases (*name) expand to far more nodes than the file holds \
             (an alias bomb such as \"billion laughs\"); write the repeated parts out, \
             or reference each anchor fewer times"
        );
    } else if message.starts_with("recursion limit exceeded") {
        message = format!(
            "{message}: the document nests too deeply; flatten the nested lists and mappings"
        );
    }
    if let Some(at) = e.location()
        && !message.contains(" at line ")
    {
        message.push_str(&format!(" at line {} column {}", at.line(), at.column()));
    }
    Problem::error("(yaml)", message)
}

/// What every reader shares: the problems found so far and the
/// environment references left unresolved.
struct Ctx<'u> {
    problems: Vec<Problem>,
    unresolved: &'u [Unresolved],
}

fn read_admin(value: Option<&Value>, ctx: &mut Ctx<'_>) -> AdminSection {
    let mut admin = AdminSection::default();
    let Some(mut f) = Fields::lenient(value.and_then(Value::as_mapping), "proxy.admin", ctx) else {
        return admin;
    };
    if let Some(enabled) = f.boolean("enabled") {
        admin.enabled = enabled;
    }
    if let Some(port) = f.port("port") {
        admin.port = port;
    }
    if let Some(bind) = f.string("bind") {
        match bind.trim().parse::<IpAddr>() {
            Ok(ip) => admin.bind = ip,
            Err(_) => f.error(
                "bind",
                format!(
                    "{:?} is not an IP address; expected one such as 127.0.0.1 or 0.0.0.0",
                    shorten(&bind)
                ),
            ),
        }
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

fn read_proxy_cluster(value: Option<&Value>, ctx: &mut Ctx<'_>) -> Option<ProxyCluster> {
    let mut f = Fields::lenient(value.and_then(Value::as_mapping), "proxy.cluster", ctx)?;
    Some(ProxyCluster {
        gossip_port: f.port("gossip_port").unwrap_or(DEFAULT_GOSSIP_PORT),
        transport_port: f.port("transport_port").unwrap_or(DEFAULT_TRANSPORT_PORT),
    })
}

fn read_proxy_acme(value: Option<&Value>, ctx: &mut Ctx<'_>) -> Option<ProxyAcme> {
    let mut f = Fields::lenient(value.and_then(Value::as_mapping), "proxy.acme", ctx)?;
    Some(ProxyAcme {
        enabled: f.boolean("enabled").unwrap_or(false),
        storage_backend: f.string("storage_backend"),
    })
}

fn read_sbmesh(extensions: Option<&Value>, ctx: &mut Ctx<'_>) -> Option<SbmeshSection> {
    match extensions {
        None | Some(Value::Null) | Some(Value::Mapping(_)) => {}
        Some(other) => {
            ctx.problems.push(Problem::error(
                "proxy.extensions",
                format!(
                    "expected a mapping of extension blocks (the sidecar's is sbmesh), found {}",
                    describe(other)
                ),
            ));
            return None;
        }
    }
    let mut f = Fields::open(
        extensions.and_then(|e| e.get("sbmesh")),
        SBMESH_PATH,
        SBMESH_KEYS,
        ctx,
    )?;
    let mut s = SbmeshSection {
        cluster_id: f.string("cluster_id"),
        node_id: f.string("node_id"),
        ..SbmeshSection::default()
    };
    if let Some(Err(e)) = s.cluster_id.as_deref().map(identity::validate_cluster_id) {
        f.error("cluster_id", e.to_string());
    }
    if let Some(Err(e)) = s.node_id.as_deref().map(identity::validate_node_id) {
        f.error("node_id", e.to_string());
    }
    for (path, seed) in f.string_list("seeds") {
        match identity::normalize_seed(&seed, CHECK_PORT) {
            Ok(_) => s.seeds.push(seed.trim().to_string()),
            Err(e) => f.ctx.problems.push(Problem::error(path, e.to_string())),
        }
    }
    s.gossip_port = f.port("gossip_port");
    s.transport_port = f.port("transport_port");
    s.advertise_addr = f.string("advertise_addr");
    if let Some(Err(e)) = s
        .advertise_addr
        .as_deref()
        .map(|a| identity::parse_advertise(a, CHECK_PORT))
    {
        f.error("advertise_addr", e.to_string());
    }
    // `--cluster-key` or `--cluster-key-file` (the operator's pods use the
    // file) override it, and then it is not used: an unresolved variable in
    // it is reported where it is used ([`super::unresolved_in`]), not here.
    s.shared_key = f.without_strictness(|f| f.string("shared_key"));
    if let Some(Err(message)) = s
        .shared_key
        .as_deref()
        .filter(|k| super::unresolved_in(k).is_none())
        .map(|k| KeySource::parse(k).check())
    {
        f.error("shared_key", message);
    }
    s.acme = read_acme(&mut f);
    Some(s)
}

fn read_acme(sbmesh: &mut Fields<'_, '_, '_>) -> Option<AcmeSection> {
    let path = sbmesh.child("acme");
    let value = sbmesh.get("acme");
    let mut f = Fields::open(value, &path, ACME_KEYS, sbmesh.ctx)?;
    let mut acme = AcmeSection::default();
    if let Some(enabled) = f.boolean("enabled") {
        acme.enabled = enabled;
    }
    read_acme_ca(&mut f, &mut acme);
    read_acme_store(&mut f, &mut acme);
    acme.renew_before_days = f.days("renew_before_days");
    if let Some(days) = acme.renew_before_days
        && let Some((_, lifetime)) = KNOWN_LIFETIMES
            .iter()
            .find(|(url, _)| *url == acme.directory_url.trim())
        && days * 2 >= *lifetime
    {
        f.error(
            "renew_before_days",
            format!(
                "{days} is at least half of the {lifetime}-day lifetime of this CA's \
                 certificates, so every certificate would be due again as soon as it is issued; \
                 use less than {} (or omit it: renewal then starts when a third of the lifetime \
                 remains)",
                lifetime / 2
            ),
        );
    }
    if let Some(mode) = f.string("certificates") {
        match CertificateMode::from_name(mode.trim()) {
            Some(m) => acme.certificates = m,
            None => f.error(
                "certificates",
                format!(
                    "{:?} is not a certificate mode; expected per_host (one certificate per \
                     origin) or san (one certificate for all origins, what sbproxy 1.13 serves)",
                    shorten(&mode)
                ),
            ),
        }
    }
    if let Some(apply) = f.string("apply") {
        match CertApply::from_name(apply.trim()) {
            Some(a) => acme.apply = Some(a),
            None => f.error(
                "apply",
                format!(
                    "{:?} is not a way to apply certificates; expected one of: {}",
                    shorten(&apply),
                    CertApply::names()
                ),
            ),
        }
    }
    acme.eab = read_eab(&mut f);
    if let Some(challenge) = f.string("challenge") {
        match Challenge::from_name(challenge.trim()) {
            Some(c) => acme.challenge = c,
            None => f.error(
                "challenge",
                format!(
                    "{:?} is not a challenge; expected http-01 (the CA fetches a token from \
                     port 80 of each name) or dns-01 (a TXT record written through dns01; \
                     wildcards too)",
                    shorten(&challenge)
                ),
            ),
        }
    }
    acme.dns01 = read_dns01(&mut f);
    match (acme.challenge, &acme.dns01) {
        (Challenge::Dns01, None) if acme.enabled => f.error(
            "dns01",
            "required with challenge: dns-01: the provider that writes the TXT records \
             (provider: rfc2136, route53 or exec, and its keys)",
        ),
        (Challenge::Http01, Some(_)) => f.error(
            "dns01",
            "set, but challenge is http-01 (the default), which never uses it; set \
             challenge: dns-01, or remove dns01",
        ),
        _ => {}
    }
    Some(acme)
}

/// `acme.email`, `directory_url` and `ca_root`: who the account is and
/// which CA it talks to.
fn read_acme_ca(f: &mut Fields<'_, '_, '_>, acme: &mut AcmeSection) {
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
}

/// `acme.storage_backend` and `storage_path`, checked together.
fn read_acme_store(f: &mut Fields<'_, '_, '_>, acme: &mut AcmeSection) {
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
}

/// Every key `dns01` accepts, for messages.
fn dns01_keys() -> Vec<&'static str> {
    let mut keys = vec![DNS01_COMMON_KEYS[0]];
    for provider in DnsProvider::ALL {
        keys.extend_from_slice(provider.keys());
    }
    keys.extend_from_slice(&DNS01_COMMON_KEYS[1..]);
    keys
}

fn read_dns01(acme: &mut Fields<'_, '_, '_>) -> Option<Dns01Section> {
    let path = acme.child("dns01");
    let value = acme.get("dns01");
    let keys = dns01_keys();
    let mut f = Fields::open(value, &path, &keys, acme.ctx)?;
    let names = || {
        DnsProvider::ALL
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let provider = match f.string("provider") {
        None => {
            f.error("provider", format!("required: one of {}", names()));
            return None;
        }
        Some(name) => match DnsProvider::from_name(name.trim()) {
            Some(p) => p,
            None => {
                f.error(
                    "provider",
                    format!(
                        "{:?} is not a DNS provider; expected one of {}",
                        shorten(&name),
                        names()
                    ),
                );
                return None;
            }
        },
    };
    // A key of another provider would be silently ignored: say so.
    for other in DnsProvider::ALL.into_iter().filter(|p| *p != provider) {
        for key in other.keys() {
            if f.get(key).is_some() && !provider.keys().contains(key) {
                f.error(
                    key,
                    format!(
                        "belongs to provider {}, not {}; the keys of {} are: {}",
                        other.as_str(),
                        provider.as_str(),
                        provider.as_str(),
                        provider.keys().join(", ")
                    ),
                );
            }
        }
    }
    let mut dns = Dns01Section::new(provider);
    if let Some(timeout) = f.string("propagation_timeout") {
        match read_seconds(&timeout, PROPAGATION_TIMEOUT_RANGE) {
            Some(secs) => dns.propagation_timeout = std::time::Duration::from_secs(secs),
            None => f.error(
                "propagation_timeout",
                format!(
                    "{:?} is not a duration from {}s to {}s; expected seconds such as 120s, \
                     2m or 120",
                    shorten(&timeout),
                    PROPAGATION_TIMEOUT_RANGE.0,
                    PROPAGATION_TIMEOUT_RANGE.1
                ),
            ),
        }
    }
    match provider {
        DnsProvider::Rfc2136 => read_rfc2136(&mut f, &mut dns),
        DnsProvider::Route53 => {
            dns.region = f.string("region").map(|r| r.trim().to_owned());
            dns.hosted_zone_id = f.string("hosted_zone_id").map(|z| z.trim().to_owned());
        }
        DnsProvider::Exec => {
            dns.command = f.string("command").map(PathBuf::from);
            match &dns.command {
                None => f.error(
                    "command",
                    "required with provider exec: the program called as `present|cleanup FQDN \
                     VALUE`",
                ),
                Some(command) if !command.is_absolute() => f.error(
                    "command",
                    format!(
                        "{:?} is not an absolute path; expected the program's full path, such \
                         as /etc/sbmesh/dns-hook",
                        shorten(&command.display().to_string())
                    ),
                ),
                Some(_) => {}
            }
        }
    }
    Some(dns)
}

fn read_rfc2136(f: &mut Fields<'_, '_, '_>, dns: &mut Dns01Section) {
    dns.nameserver = f.string("nameserver").map(|n| n.trim().to_owned());
    match dns.nameserver.as_deref() {
        None => f.error(
            "nameserver",
            "required with provider rfc2136: the primary server that takes dynamic updates, \
             host or host:port (port 53 by default)",
        ),
        Some(ns) => {
            if let Err(e) = identity::normalize_seed(ns, DNS_PORT) {
                f.error(
                    "nameserver",
                    format!(
                        "{e} (the primary that takes dynamic updates: host or host:port, port \
                         {DNS_PORT} by default)"
                    ),
                );
            }
        }
    }
    if let Some(name) = f.string("tsig_algorithm") {
        match TsigAlgorithm::from_name(name.trim()) {
            Some(a) => dns.tsig_algorithm = a,
            None => f.error(
                "tsig_algorithm",
                format!(
                    "{:?} is not a TSIG algorithm; expected hmac-sha256 (the default), \
                     hmac-sha512, or hmac-md5 (old servers only)",
                    shorten(&name)
                ),
            ),
        }
    }
    dns.tsig_key_name = f.string("tsig_key_name").map(|n| n.trim().to_owned());
    dns.tsig_secret = f.string("tsig_secret").map(|s| s.trim().to_owned());
    match (&dns.tsig_key_name, &dns.tsig_secret) {
        (Some(_), None) => f.error(
            "tsig_secret",
            "required with tsig_key_name: the key's base64 secret, as env:NAME, file:PATH or \
             the value",
        ),
        (None, Some(_)) => f.error(
            "tsig_key_name",
            "required with tsig_secret: the key's name as the server knows it",
        ),
        _ => {}
    }
    if let Some(name) = dns.tsig_key_name.as_deref()
        && hickory_proto::rr::Name::from_ascii(name).is_err()
    {
        f.error(
            "tsig_key_name",
            format!(
                "{:?} is not a DNS name; expected the key's name, such as sbmesh-acme.",
                shorten(name)
            ),
        );
    }
    if let Some(secret) = dns.tsig_secret.as_deref()
        && !secret.starts_with("env:")
        && !secret.starts_with("file:")
        && tsig_secret_bytes(secret).is_err()
    {
        f.error(
            "tsig_secret",
            "not base64; expected the key's secret as BIND's tsig-keygen prints it, or \
             env:NAME / file:PATH naming where it is",
        );
    }
}

/// The bytes of a TSIG secret written in base64 (standard alphabet, as
/// BIND writes it; padding optional).
pub(crate) fn tsig_secret_bytes(secret: &str) -> Result<Vec<u8>, String> {
    let text: String = secret.chars().filter(|c| !c.is_whitespace()).collect();
    let engine = base64::engine::general_purpose::STANDARD_NO_PAD;
    match engine.decode(text.trim_end_matches('=')) {
        Ok(bytes) if !bytes.is_empty() => Ok(bytes),
        Ok(_) => Err("empty".to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// Seconds written as `120`, `120s`, `2m` or `1h`, within `range`.
fn read_seconds(text: &str, range: (u64, u64)) -> Option<u64> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, "s"),
    };
    let scale = match unit.trim() {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return None,
    };
    let secs = number.parse::<u64>().ok()?.checked_mul(scale)?;
    (range.0..=range.1).contains(&secs).then_some(secs)
}

fn read_eab(acme: &mut Fields<'_, '_, '_>) -> Option<Eab> {
    let path = acme.child("eab");
    let value = acme.get("eab");
    let mut f = Fields::open(value, &path, EAB_KEYS, acme.ctx)?;
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

/// The keys of `origins` as written. With the sidecar's ACME on, each one
/// must be a hostname (wildcards are warnings of [`SbConfig::warnings`]),
/// and `certificates: san` takes at most [`MAX_SAN_NAMES`].
fn read_origins(
    value: Option<&Value>,
    acme: Option<&AcmeSection>,
    ctx: &mut Ctx<'_>,
) -> Vec<String> {
    let map = match value {
        None | Some(Value::Null) => return Vec::new(),
        Some(Value::Mapping(map)) => map,
        Some(other) => {
            ctx.problems.push(Problem::error(
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
    let mut eligible = std::collections::HashSet::new();
    for key in map.keys() {
        let host = match key {
            Value::String(host) if !host.trim().is_empty() => host,
            other => {
                ctx.problems.push(Problem::error(
                    child_path("origins", &key_text(other)),
                    format!("expected a hostname as key, found {}", describe(other)),
                ));
                continue;
            }
        };
        origins.push(host.clone());
        let dns01 = acme.is_some_and(|a| a.challenge == Challenge::Dns01);
        if acme.is_none() || (host.contains('*') && !dns01) {
            continue;
        }
        let name = if dns01 {
            hostname::normalize_wildcard(host)
        } else {
            hostname::normalize(host)
        };
        match name {
            Ok(name) => {
                eligible.insert(name);
            }
            Err(message) => ctx.problems.push(Problem::error(
                child_path("origins", host),
                format!(
                    "{message} (origins are certified by the sidecar's ACME; each key must be a hostname)"
                ),
            )),
        }
    }
    if acme.is_some_and(|a| a.certificates == CertificateMode::San)
        && eligible.len() > MAX_SAN_NAMES
    {
        ctx.problems.push(Problem::error(
            "origins",
            format!(
                "{} hostnames, but certificates: san puts every one in a single certificate and \
                 a CA accepts at most {MAX_SAN_NAMES} names in one; use certificates: per_host, \
                 or split the origins across SBProxy fleets",
                eligible.len()
            ),
        ));
    }
    origins
}

/// Checks the form of `storage_path` for `backend` (docs/reference.md#storage-paths).
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

/// A YAML mapping read key by key, reporting into the shared [`Ctx`] under `path`.
struct Fields<'a, 'c, 'u> {
    map: &'a Mapping,
    path: String,
    ctx: &'c mut Ctx<'u>,
    /// The sidecar's own block (unknown keys and unresolved `${NAME}`s are
    /// problems), not one of the proxy's.
    strict: bool,
}

impl<'a, 'c, 'u> Fields<'a, 'c, 'u> {
    /// Opens the section `value` at `path`. Absent or null: `None`, silently.
    /// Not a mapping: a problem and `None`. Keys outside `allowed` are reported.
    fn open(
        value: Option<&'a Value>,
        path: &str,
        allowed: &[&str],
        ctx: &'c mut Ctx<'u>,
    ) -> Option<Self> {
        let map = match value {
            None | Some(Value::Null) => return None,
            Some(Value::Mapping(map)) => map,
            Some(other) => {
                ctx.problems.push(Problem::error(
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
                ctx.problems
                    .push(Problem::error(child_path(path, &name), message));
            }
        }
        Some(Fields {
            map,
            path: path.to_string(),
            ctx,
            strict: true,
        })
    }

    /// A mapping of the proxy's, whose other keys are the proxy's business,
    /// and whose values the proxy reads as written, `${NAME}`s included.
    fn lenient(map: Option<&'a Mapping>, path: &str, ctx: &'c mut Ctx<'u>) -> Option<Self> {
        Some(Fields {
            map: map?,
            path: path.to_string(),
            ctx,
            strict: false,
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
        self.ctx.problems.push(Problem::error(path, message));
    }

    /// A scalar as text. Numbers and booleans are taken as written (as YAML
    /// would deserialize them into a string). Empty or blank counts as absent,
    /// so `${VAR:-}` leaves the setting to its default. In the sidecar's
    /// block, a value that still holds an unresolved `${NAME}` is an error:
    /// the sidecar would use it. In the proxy's blocks it is kept as the
    /// proxy keeps it (the proxy checks the same literal credentials).
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
        if let Some(name) = self
            .ctx
            .unresolved
            .iter()
            .map(|u| u.name.as_str())
            .find(|name| self.strict && text.contains(&format!("${{{name}}}")))
        {
            let message = super::unresolved_message(name);
            self.error(key, message);
            return None;
        }
        (!text.trim().is_empty()).then_some(text)
    }
    /// `read` with unresolved variables kept as written, like the proxy's
    /// own blocks.
    fn without_strictness<T>(&mut self, read: impl FnOnce(&mut Self) -> T) -> T {
        let strict = std::mem::replace(&mut self.strict, false);
        let out = read(self);
        self.strict = strict;
        out
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
                        other => self.ctx.problems.push(Problem::error(
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
/// (`origins."api.example.com"`): how a problem names a YAML path.
pub fn child_path(parent: &str, key: &str) -> String {
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
