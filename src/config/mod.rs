//! The parts of `sb.yml` the sidecar reads, and how it reads them.
//!
//! `sb.yml` belongs to the proxy (sbproxy 1.13, whose facts are in
//! `docs/` and in [`sbproxy`]). The sidecar reads `proxy.admin` (for the
//! reload POST), its own block `proxy.extensions.sbmesh`, the keys of
//! `origins`, and of `proxy.cluster` / `proxy.acme` only what it needs to
//! detect a conflict with the proxy's own mesh and ACME client. Everything
//! else in the file belongs to the proxy and is accepted as it is; only
//! the sidecar's block is strict (a typo such as `storge_path` there would
//! otherwise silently fall back to a default).
//!
//! Reading is three pure steps, each usable on its own:
//!
//! 1. [`interpolate()`] replaces `${VAR}` and `${VAR:-default}` from an
//!    environment passed in as a function (so tests never touch the process
//!    environment), exactly as the proxy does;
//! 2. [`parse_config`] turns the interpolated text into an [`SbConfig`], collecting
//!    *every* [`Problem`] rather than stopping at the first;
//! 3. [`load_config`] does both for a file on disk and also returns the sha256 of the
//!    raw bytes, which is how a change of the file is recognised.
//!
//! ```
//! use sbmesh::{interpolate, parse_config};
//!
//! let env = |name: &str| (name == "POD").then(|| "demo-proxy-0".to_string());
//! let text = "proxy:\n  extensions:\n    sbmesh:\n      node_id: ${POD}\n";
//! let text = interpolate(text, &env);
//! let cfg = parse_config(&text).unwrap();
//! assert_eq!(cfg.sbmesh().node_id.as_deref(), Some("demo-proxy-0"));
//! ```
//!
//! Cluster keys live in `key`: where a key comes from ([`KeySource`]), how a
//! key ring is written ([`parse_key_ring`]) and how a fresh one is made
//! ([`generate_key`]). Conflicts between the sidecar and the proxy's own
//! blocks are [`config_conflicts`].

mod conflict;
pub(crate) mod hostname;
mod interpolate;
mod key;
mod parse;
pub mod sbproxy;

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use conflict::{SidecarPorts, config_conflicts};
pub use interpolate::{
    Interpolated, Unresolved, interpolate, interpolate_report, unresolved_in, unresolved_message,
};
pub use key::{
    KeyGenError, KeySource, generate_key, key_to_hex, parse_key_ring, resolve_key_source,
};
pub use parse::child_path;
pub(crate) use parse::tsig_secret_bytes;

/// Looks up an environment variable by name; `None` when it is not set.
///
/// Every function here that needs the environment takes one of these, so
/// tests pass a closure over a map and production passes
/// `&|name| std::env::var(name).ok()`.
pub type EnvLookup<'a> = dyn Fn(&str) -> Option<String> + 'a;

/// The Let's Encrypt production directory, the default `acme.directory_url`.
pub(crate) const LETS_ENCRYPT_DIRECTORY: &str = "https://acme-v02.api.letsencrypt.org/directory";

/// The default `proxy.admin.port`: where the proxy's admin API (and its
/// `/admin/reload`) listens.
pub const DEFAULT_PROXY_ADMIN_PORT: u16 = 9090;
/// The default `proxy.admin.bind` of sbproxy 1.13.
pub const DEFAULT_PROXY_ADMIN_BIND: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
/// The user sbproxy 1.13 checks when `proxy.admin` is enabled without one.
pub const DEFAULT_PROXY_ADMIN_USER: &str = "admin";
/// The password sbproxy 1.13 checks when `proxy.admin` is enabled without one.
pub const DEFAULT_PROXY_ADMIN_PASSWORD: &str = "changeme";
/// The default gossip (UDP) port, of the sidecar's mesh and of the proxy's own.
pub const DEFAULT_GOSSIP_PORT: u16 = 7946;
/// The DNS port: of `dns01.nameserver` and of `--acme-dns-resolvers` when
/// they name none, and of every authoritative server DNS-01 asks.
pub const DNS_PORT: u16 = 53;
/// The default transport (TCP) port, of the sidecar's mesh and of the proxy's own.
pub const DEFAULT_TRANSPORT_PORT: u16 = 8946;
/// Most names one certificate may carry (the CA's usual limit), so most
/// origins `certificates: san` accepts.
pub(crate) const MAX_SAN_NAMES: usize = 100;
/// Largest `sb.yml` read. A ConfigMap holds at most 1 MiB; this leaves room
/// for files mounted another way while bounding the work of every re-read.
pub(crate) const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// How bad a [`Problem`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// The file cannot be used as it is; `validate` exits 1 and `run` exits 2.
    Error,
    /// The file works but something in it will not do what its author may
    /// expect (e.g. a wildcard origin, which HTTP-01 cannot certify).
    Warning,
}

/// One thing wrong with the configuration, located by its YAML path (such as
/// `proxy.acme.storage_path`) or, for command-line values, by the flag name.
///
/// Displays as `<path>: <message>`, the format `validate` prints.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{path}: {message}")]
#[non_exhaustive]
pub struct Problem {
    /// Where: a YAML path (`proxy.cluster.seeds[1]`), a flag (`--gossip-port`),
    /// `line L, column C` for interpolation, `(yaml)` for syntax errors,
    /// `(root)` for the document itself, or a file path for read errors.
    pub path: String,
    /// What is wrong and what would be accepted instead.
    pub message: String,
    /// Whether this blocks the configuration or only deserves a look.
    pub severity: Severity,
}

impl Problem {
    /// A problem that makes the configuration unusable.
    pub fn error(path: impl Into<String>, message: impl Into<String>) -> Self {
        Problem {
            path: path.into(),
            message: message.into(),
            severity: Severity::Error,
        }
    }

    /// A problem worth reporting that does not stop the configuration from being used.
    pub fn warning(path: impl Into<String>, message: impl Into<String>) -> Self {
        Problem {
            path: path.into(),
            message: message.into(),
            severity: Severity::Warning,
        }
    }

    /// True for [`Severity::Error`].
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

/// What the sidecar reads from `sb.yml`.
///
/// `Deserialize` exists to round-trip this model (e.g. as JSON); to read an
/// actual `sb.yml`, use [`parse_config`] or [`load_config`], which validate and report
/// every problem with its path.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct SbConfig {
    /// The proxy's own keys the sidecar reads, and the sidecar's block.
    pub proxy: ProxySection,
    /// The keys of the `origins` mapping, as written, in file order. The
    /// hostnames to certify are their normalised forms
    /// (`hostname::normalize`), see `SbConfig::acme_hostnames`.
    pub origins: Vec<String>,
    /// Warnings found while reading the file (unresolved `${NAME}`
    /// references, keys the proxy would refuse), part of [`SbConfig::warnings`].
    #[serde(skip)]
    pub notes: Vec<Problem>,
}

impl SbConfig {
    /// The sidecar's ACME settings (`proxy.extensions.sbmesh.acme`), when
    /// present and enabled.
    pub fn acme(&self) -> Option<&AcmeSection> {
        self.proxy
            .sbmesh
            .as_ref()
            .and_then(|s| s.acme.as_ref())
            .filter(|a| a.enabled)
    }

    /// True when `proxy.extensions.sbmesh.acme.enabled` is true.
    pub(crate) fn acme_enabled(&self) -> bool {
        self.acme().is_some()
    }

    /// The sidecar's block, or an empty one.
    pub fn sbmesh(&self) -> &SbmeshSection {
        static EMPTY: SbmeshSection = SbmeshSection {
            cluster_id: None,
            node_id: None,
            seeds: Vec::new(),
            gossip_port: None,
            transport_port: None,
            advertise_addr: None,
            shared_key: None,
            acme: None,
        };
        self.proxy.sbmesh.as_ref().unwrap_or(&EMPTY)
    }

    /// How certificates are ordered and written (`per_host` when ACME is
    /// off or the key is omitted).
    pub fn certificate_mode(&self) -> CertificateMode {
        self.acme().map(|a| a.certificates).unwrap_or_default()
    }

    /// The challenge the sidecar's ACME uses (`http-01` when ACME is off
    /// or the key is omitted).
    pub fn challenge(&self) -> Challenge {
        self.acme().map(|a| a.challenge).unwrap_or_default()
    }

    /// The hostnames an ACME issuer orders for: the normalised form of every
    /// origin that is a valid hostname (and, with `challenge: dns-01`, a
    /// wildcard such as `*.example.com`), deduplicated, in file order; and
    /// the origins that are not eligible (wildcards under `http-01`), as
    /// written. Empty when ACME is disabled. Invalid origins are problems of
    /// [`parse_config`], so a parsed config with ACME on has none.
    pub(crate) fn acme_hostnames(&self) -> (Vec<String>, Vec<String>) {
        if !self.acme_enabled() {
            return (Vec::new(), Vec::new());
        }
        let dns01 = self.challenge() == Challenge::Dns01;
        let mut hosts: Vec<String> = Vec::new();
        let mut wildcards = Vec::new();
        for origin in &self.origins {
            let name = if dns01 {
                hostname::normalize_wildcard(origin)
            } else if origin.contains('*') {
                wildcards.push(origin.clone());
                continue;
            } else {
                hostname::normalize(origin)
            };
            if let Ok(host) = name
                && !hosts.contains(&host)
            {
                hosts.push(host);
            }
        }
        (hosts, wildcards)
    }

    /// Problems that do not block the configuration: wildcard origins while
    /// ACME is enabled with `http-01` (which cannot prove a wildcard, so
    /// they are never ordered), and a file that still configures the
    /// sidecar the first way (in `proxy.cluster` / `proxy.acme`).
    pub fn warnings(&self) -> Vec<Problem> {
        let mut warnings = self.notes.clone();
        if self.proxy.sbmesh.is_none()
            && (self.proxy.cluster.is_some() || self.proxy.acme.is_some())
        {
            warnings.push(Problem::warning(SBMESH_PATH, MIGRATION_MESSAGE));
        }
        if self.acme_enabled() && self.challenge() == Challenge::Http01 {
            warnings.extend(
                self.origins
                    .iter()
                    .filter(|host| host.contains('*'))
                    .map(|host| {
                        Problem::warning(
                            parse::child_path("origins", host),
                            "wildcard origin is not eligible for an HTTP-01 certificate and will \
                             not be ordered; set acme.challenge: dns-01 (with a dns01 provider) \
                             to order it, or provide its certificate another way",
                        )
                    }),
            );
        }
        warnings
    }
}

/// The YAML path of the sidecar's block.
pub(crate) const SBMESH_PATH: &str = "proxy.extensions.sbmesh";

/// The one line a file gets when it configures the sidecar in the proxy's
/// own blocks (the first version of the contract) and has no sidecar block.
pub(crate) const MIGRATION_MESSAGE: &str = "not found, and the sidecar no longer reads proxy.cluster or \
     proxy.acme (sbproxy itself acts on those blocks: it binds the mesh ports and orders \
     certificates). Move the sidecar's mesh keys (cluster_id, node_id, seeds, gossip_port, \
     transport_port, advertise_addr), its shared_key (was security.shared_key) and its acme \
     block under proxy.extensions.sbmesh, and remove proxy.cluster and proxy.acme unless sbproxy \
     itself should use them";

/// `proxy`: what the sidecar reads of the proxy's own keys, and its own
/// block under `proxy.extensions`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct ProxySection {
    /// `proxy.admin`: the proxy's admin API, where reloads are POSTed.
    pub admin: AdminSection,
    /// `proxy.cluster`, when present: the proxy's **own** mesh, read only
    /// to detect a port conflict with the sidecar's.
    pub cluster: Option<ProxyCluster>,
    /// `proxy.acme`, when present: the proxy's **own** ACME client, read
    /// only to detect a conflict with the sidecar's.
    pub acme: Option<ProxyAcme>,
    /// `proxy.tls_cert_file`: the one certificate the proxy serves, read
    /// to tell whether it is the one `certificates: san` writes.
    pub tls_cert_file: Option<PathBuf>,
    /// `proxy.tls_key_file`, read for the same reason.
    pub tls_key_file: Option<PathBuf>,
    /// `proxy.extensions.sbmesh`: the sidecar's own settings.
    pub sbmesh: Option<SbmeshSection>,
}

/// `proxy.admin`, with sbproxy 1.13's defaults.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct AdminSection {
    /// `enabled`, default `false`.
    pub enabled: bool,
    /// `port`, default [`DEFAULT_PROXY_ADMIN_PORT`].
    pub port: u16,
    /// `bind`, default [`DEFAULT_PROXY_ADMIN_BIND`].
    pub bind: IpAddr,
    /// `username`; when the admin API is enabled and it is omitted, the
    /// proxy's default [`DEFAULT_PROXY_ADMIN_USER`].
    pub username: Option<String>,
    /// `password`; when the admin API is enabled and it is omitted, the
    /// proxy's default [`DEFAULT_PROXY_ADMIN_PASSWORD`].
    pub password: Option<String>,
}

impl Default for AdminSection {
    fn default() -> Self {
        AdminSection {
            enabled: false,
            port: DEFAULT_PROXY_ADMIN_PORT,
            bind: DEFAULT_PROXY_ADMIN_BIND,
            username: None,
            password: None,
        }
    }
}

impl AdminSection {
    /// The credentials the proxy's admin API checks: those written, else
    /// the proxy's defaults while the admin API is enabled.
    ///
    /// Values are as written: an `env:NAME` or `file:PATH` reference is
    /// resolved by [`resolve_field`].
    pub fn credentials(&self) -> Option<(String, String)> {
        if !self.enabled && self.username.is_none() && self.password.is_none() {
            return None;
        }
        Some((
            self.username
                .clone()
                .unwrap_or_else(|| DEFAULT_PROXY_ADMIN_USER.to_owned()),
            self.password
                .clone()
                .unwrap_or_else(|| DEFAULT_PROXY_ADMIN_PASSWORD.to_owned()),
        ))
    }

    /// Base URL of the proxy's admin API as seen from inside the pod:
    /// `http://<bind>:<port>`, loopback when the proxy binds every address.
    pub fn base_url(&self) -> String {
        local_url(SocketAddr::new(self.bind, self.port))
    }
}

/// `http://<ip>:<port>` of a listener as seen from inside its pod: loopback
/// when it listens on every address.
pub fn local_url(listen: SocketAddr) -> String {
    let ip = match listen.ip() {
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}", SocketAddr::new(ip, listen.port()))
}

impl fmt::Debug for AdminSection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminSection")
            .field("enabled", &self.enabled)
            .field("port", &self.port)
            .field("bind", &self.bind)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// Resolves a per-field reference as sbproxy 1.13 does: `env:NAME` is the
/// value of an environment variable, `file:PATH` the content of a file
/// (without its trailing newline), anything else the value itself. `path`
/// locates the setting in the problem; the value never appears in it.
pub fn resolve_field(
    path: &str,
    value: &str,
    env: &EnvLookup<'_>,
    read_file: &dyn Fn(&Path) -> std::io::Result<String>,
) -> Result<String, Problem> {
    if let Some(name) = value.strip_prefix("env:") {
        let name = name.trim();
        return env(name).ok_or_else(|| {
            Problem::error(
                path,
                format!("names the environment variable {name} (env:{name}), which is not set"),
            )
        });
    }
    if let Some(file) = value.strip_prefix("file:") {
        let file = Path::new(file.trim());
        return read_file(file)
            .map(|text| text.trim_end_matches(['\n', '\r']).to_owned())
            .map_err(|e| {
                Problem::error(
                    path,
                    format!(
                        "names the file {} (file:), which cannot be read: {e}",
                        file.display()
                    ),
                )
            });
    }
    Ok(value.to_owned())
}

/// `proxy.cluster`: the proxy's own mesh, which binds these ports itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ProxyCluster {
    /// `proxy.cluster.gossip_port` (UDP), default [`DEFAULT_GOSSIP_PORT`].
    pub gossip_port: u16,
    /// `proxy.cluster.transport_port` (TCP), default [`DEFAULT_TRANSPORT_PORT`].
    pub transport_port: u16,
}

/// `proxy.acme`: the proxy's own ACME client.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ProxyAcme {
    /// `proxy.acme.enabled`.
    pub enabled: bool,
    /// `proxy.acme.storage_backend` as written (sbproxy's default is `redb`).
    pub storage_backend: Option<String>,
}

/// `proxy.extensions.sbmesh`: the sidecar's own settings. Every key is
/// optional; the sidecar's flags and environment variables take precedence
/// over each one.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct SbmeshSection {
    /// `cluster_id`: packets from another cluster id are dropped.
    pub cluster_id: Option<String>,
    /// `node_id`: this member's name in the mesh (often `${SBPROXY_POD_NAME}`).
    pub node_id: Option<String>,
    /// `seeds`: `host` or `host:port` entries, as written (a list, or one
    /// comma-separated string).
    pub seeds: Vec<String>,
    /// `gossip_port` (UDP).
    pub gossip_port: Option<u16>,
    /// `transport_port` (TCP).
    pub transport_port: Option<u16>,
    /// `advertise_addr`: `ip` or `ip:port`, as written.
    pub advertise_addr: Option<String>,
    /// `shared_key`: a [`KeySource`] as written: `env:NAME`, `file:/path`, or
    /// the key ring itself (comma-separated 64-hex-character keys).
    pub shared_key: Option<String>,
    /// `acme`: certificate issuance by the sidecar.
    pub acme: Option<AcmeSection>,
}

impl fmt::Debug for SbmeshSection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SbmeshSection")
            .field("cluster_id", &self.cluster_id)
            .field("node_id", &self.node_id)
            .field("seeds", &self.seeds)
            .field("gossip_port", &self.gossip_port)
            .field("transport_port", &self.transport_port)
            .field("advertise_addr", &self.advertise_addr)
            .field(
                "shared_key",
                &self.shared_key.as_deref().map(KeySource::parse),
            )
            .field("acme", &self.acme)
            .finish()
    }
}

/// `proxy.extensions.sbmesh.acme`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct AcmeSection {
    /// `enabled`, default `false`.
    pub enabled: bool,
    /// `email`: the account contact; optional (Let's Encrypt does not require one).
    pub email: Option<String>,
    /// `directory_url`, default `LETS_ENCRYPT_DIRECTORY`.
    pub directory_url: String,
    /// `ca_root`: a PEM file to trust for a private CA's directory.
    pub ca_root: Option<PathBuf>,
    /// `storage_backend`; `None` when omitted (a store local to this pod is
    /// then used, which is only right for a single replica).
    pub storage_backend: Option<StorageBackend>,
    /// `storage_path`, as written; its form depends on the backend (see
    /// `StorageBackend::path_form`).
    pub storage_path: Option<String>,
    /// `renew_before_days`; `None`: renew when a third of the lifetime remains.
    pub renew_before_days: Option<u32>,
    /// `eab`: external account binding, for CAs that require one.
    pub eab: Option<Eab>,
    /// `certificates`: one certificate per origin, or one for all.
    pub certificates: CertificateMode,
    /// `apply`: how a new certificate reaches the running proxy; `None`
    /// when omitted (the sidecar's default applies, see `--proxy-cert-apply`).
    pub apply: Option<CertApply>,
    /// `challenge`: how the CA is shown control of a name.
    pub challenge: Challenge,
    /// `dns01`: where and how TXT records are written, with `challenge: dns-01`.
    pub dns01: Option<Dns01Section>,
}

impl Default for AcmeSection {
    fn default() -> Self {
        AcmeSection {
            enabled: false,
            email: None,
            directory_url: LETS_ENCRYPT_DIRECTORY.to_string(),
            ca_root: None,
            storage_backend: None,
            storage_path: None,
            renew_before_days: None,
            eab: None,
            certificates: CertificateMode::default(),
            apply: None,
            challenge: Challenge::default(),
            dns01: None,
        }
    }
}

/// `acme.challenge`: how the CA is shown control of a name.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Challenge {
    /// `http-01`: the CA fetches a token from port 80 of the name (any
    /// replica answers it from the shared store). No wildcards.
    #[default]
    #[serde(rename = "http-01")]
    Http01,
    /// `dns-01`: the replica ordering writes a TXT record at
    /// `_acme-challenge.<name>` through the `dns01` provider. Wildcards too.
    #[serde(rename = "dns-01")]
    Dns01,
}

impl Challenge {
    /// Every challenge, as listed to users.
    pub(crate) const ALL: [Challenge; 2] = [Challenge::Http01, Challenge::Dns01];

    /// The name used in `sb.yml` and by the ACME protocol.
    pub fn as_str(self) -> &'static str {
        match self {
            Challenge::Http01 => "http-01",
            Challenge::Dns01 => "dns-01",
        }
    }

    /// The challenge named `name`, if it is one.
    pub(crate) fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == name)
    }
}

/// The default `dns01.propagation_timeout`: how long every authoritative
/// server of the zone has to serve a TXT record before the order fails.
pub const DEFAULT_DNS_PROPAGATION_TIMEOUT: std::time::Duration =
    std::time::Duration::from_secs(120);

/// `acme.dns01`: the DNS provider that writes the challenge's TXT records.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Dns01Section {
    /// `provider`.
    pub provider: DnsProvider,
    /// `nameserver` (rfc2136): `host` or `host:port` (port 53 by default)
    /// of the primary server that takes dynamic updates.
    pub nameserver: Option<String>,
    /// `tsig_key_name` (rfc2136): the TSIG key's name as the server knows it.
    pub tsig_key_name: Option<String>,
    /// `tsig_algorithm` (rfc2136).
    pub tsig_algorithm: TsigAlgorithm,
    /// `tsig_secret` (rfc2136): base64, as written: `env:NAME`, `file:PATH`
    /// or the secret itself (resolved by [`resolve_field`] at each order).
    pub tsig_secret: Option<String>,
    /// `region` (route53).
    pub region: Option<String>,
    /// `hosted_zone_id` (route53): found from the name when omitted.
    pub hosted_zone_id: Option<String>,
    /// `command` (exec): called as `command present|cleanup FQDN VALUE`.
    pub command: Option<PathBuf>,
    /// `propagation_timeout`: how long every authoritative server has to
    /// serve the record, default [`DEFAULT_DNS_PROPAGATION_TIMEOUT`].
    pub propagation_timeout: std::time::Duration,
}

impl Dns01Section {
    /// The block of `provider` with every other key at its default.
    pub fn new(provider: DnsProvider) -> Self {
        Self {
            provider,
            nameserver: None,
            tsig_key_name: None,
            tsig_algorithm: TsigAlgorithm::default(),
            tsig_secret: None,
            region: None,
            hosted_zone_id: None,
            command: None,
            propagation_timeout: DEFAULT_DNS_PROPAGATION_TIMEOUT,
        }
    }
}

impl fmt::Debug for Dns01Section {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secret = self.tsig_secret.as_deref().map(|s| {
            if s.starts_with("env:") || s.starts_with("file:") {
                s
            } else {
                "<redacted>"
            }
        });
        f.debug_struct("Dns01Section")
            .field("provider", &self.provider)
            .field("nameserver", &self.nameserver)
            .field("tsig_key_name", &self.tsig_key_name)
            .field("tsig_algorithm", &self.tsig_algorithm)
            .field("tsig_secret", &secret)
            .field("region", &self.region)
            .field("hosted_zone_id", &self.hosted_zone_id)
            .field("command", &self.command)
            .field("propagation_timeout", &self.propagation_timeout)
            .finish()
    }
}

/// `dns01.provider`: what writes the TXT records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DnsProvider {
    /// Dynamic update (RFC 2136), signed with TSIG, sent to `nameserver`.
    Rfc2136,
    /// The AWS Route 53 API.
    Route53,
    /// A command of the user's: `present|cleanup FQDN VALUE`.
    Exec,
}

impl DnsProvider {
    /// Every provider, as listed to users.
    pub(crate) const ALL: [DnsProvider; 3] = [
        DnsProvider::Rfc2136,
        DnsProvider::Route53,
        DnsProvider::Exec,
    ];

    /// The name used in `sb.yml`, in logs and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            DnsProvider::Rfc2136 => "rfc2136",
            DnsProvider::Route53 => "route53",
            DnsProvider::Exec => "exec",
        }
    }

    /// The provider named `name`, if it is one.
    pub(crate) fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == name)
    }

    /// The keys of `dns01` that belong to this provider.
    pub(crate) fn keys(self) -> &'static [&'static str] {
        match self {
            DnsProvider::Rfc2136 => &[
                "nameserver",
                "tsig_key_name",
                "tsig_algorithm",
                "tsig_secret",
            ],
            DnsProvider::Route53 => &["region", "hosted_zone_id"],
            DnsProvider::Exec => &["command"],
        }
    }
}

/// `dns01.tsig_algorithm`: the MAC of the TSIG signature (RFC 8945).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TsigAlgorithm {
    /// `hmac-sha256`, the default (BIND's `tsig-keygen` default too).
    #[default]
    #[serde(rename = "hmac-sha256")]
    HmacSha256,
    /// `hmac-sha512`.
    #[serde(rename = "hmac-sha512")]
    HmacSha512,
    /// `hmac-md5`: only for old servers that know no other; never a default.
    #[serde(rename = "hmac-md5")]
    HmacMd5,
}

impl TsigAlgorithm {
    /// Every algorithm, as listed to users.
    pub(crate) const ALL: [TsigAlgorithm; 3] = [
        TsigAlgorithm::HmacSha256,
        TsigAlgorithm::HmacSha512,
        TsigAlgorithm::HmacMd5,
    ];

    /// The name used in `sb.yml` (BIND's `algorithm` names).
    pub fn as_str(self) -> &'static str {
        match self {
            TsigAlgorithm::HmacSha256 => "hmac-sha256",
            TsigAlgorithm::HmacSha512 => "hmac-sha512",
            TsigAlgorithm::HmacMd5 => "hmac-md5",
        }
    }

    /// The algorithm named `name` (case-insensitive), if it is one.
    pub(crate) fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|a| a.as_str().eq_ignore_ascii_case(name))
    }
}

/// `acme.certificates`: what is ordered and written for the proxy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CertificateMode {
    /// One certificate per origin, `<cert-dir>/<host>/tls.{crt,key}`.
    #[default]
    PerHost,
    /// One certificate naming every eligible origin, `<cert-dir>/tls.{crt,key}`
    /// (sbproxy 1.13 serves exactly one certificate from files).
    San,
}

impl CertificateMode {
    /// Every mode, as listed to users.
    pub(crate) const ALL: [CertificateMode; 2] = [CertificateMode::PerHost, CertificateMode::San];

    /// The name used in `sb.yml`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            CertificateMode::PerHost => "per_host",
            CertificateMode::San => "san",
        }
    }

    /// The mode named `name`, if it is one.
    pub(crate) fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == name)
    }
}

/// `acme.apply` (and `--proxy-cert-apply`): how a new certificate reaches
/// the running proxy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CertApply {
    /// POST the proxy's reload URL (for proxies that re-read certificate
    /// files on reload).
    #[default]
    Reload,
    /// Restart the proxy process gracefully, one pod at a time across the
    /// fleet (sbproxy 1.13 reads its certificate only at start-up).
    Restart,
    /// Write the files only.
    None,
}

impl CertApply {
    /// Every way, as listed to users.
    pub(crate) const ALL: [CertApply; 3] = [CertApply::Reload, CertApply::Restart, CertApply::None];

    /// The name used in `sb.yml` and on the command line.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            CertApply::Reload => "reload",
            CertApply::Restart => "restart",
            CertApply::None => "none",
        }
    }

    /// The way named `name`, if it is one.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == name)
    }

    /// The accepted names, for messages.
    pub(crate) fn names() -> String {
        Self::ALL.map(Self::as_str).join(", ")
    }
}

/// `acme.eab`: external account binding credentials from the CA.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Eab {
    /// `kid`: the key identifier.
    pub kid: String,
    /// `hmac_key`: the base64url-encoded MAC key.
    pub hmac_key: String,
}

impl fmt::Debug for Eab {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Eab")
            .field("kid", &self.kid)
            .field("hmac_key", &"<redacted>")
            .finish()
    }
}

/// `proxy.acme.storage_backend`: where certificates, account and challenge
/// tokens are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageBackend {
    /// `redis`: shared.
    Redis,
    /// `s3`: shared.
    S3,
    /// `gcs`: shared.
    Gcs,
    /// `azure`: shared.
    Azure,
    /// `file`: a directory; shared when it is on an RWX volume.
    File,
    /// `redb`: a database file in a directory; local to one pod.
    Redb,
    /// `memory`: local to one process, lost on restart.
    Memory,
}

impl StorageBackend {
    /// Every backend, in the order they are listed to users.
    pub(crate) const ALL: [StorageBackend; 7] = [
        StorageBackend::Redis,
        StorageBackend::S3,
        StorageBackend::Gcs,
        StorageBackend::Azure,
        StorageBackend::File,
        StorageBackend::Redb,
        StorageBackend::Memory,
    ];

    /// The name used in `sb.yml`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StorageBackend::Redis => "redis",
            StorageBackend::S3 => "s3",
            StorageBackend::Gcs => "gcs",
            StorageBackend::Azure => "azure",
            StorageBackend::File => "file",
            StorageBackend::Redb => "redb",
            StorageBackend::Memory => "memory",
        }
    }

    /// The backend named `name` in `sb.yml`, if it is one.
    pub(crate) fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.as_str() == name)
    }

    /// Whether `storage_path` must be given for this backend.
    pub(crate) fn needs_path(self) -> bool {
        self != StorageBackend::Memory
    }

    /// Whether every pod can see the same data. `file` counts as shared: it
    /// is, when the directory is an RWX volume, which the config cannot tell.
    pub fn is_shared(self) -> bool {
        !matches!(self, StorageBackend::Redb | StorageBackend::Memory)
    }

    /// What `storage_path` looks like for this backend, for messages.
    pub(crate) fn path_form(self) -> &'static str {
        match self {
            StorageBackend::Redis => "redis://host:port/db, rediss://host:port/db, or host:port",
            StorageBackend::S3 => "s3://bucket/prefix",
            StorageBackend::Gcs => "gs://bucket/prefix",
            StorageBackend::Azure => "az://container/prefix",
            StorageBackend::File => "a directory (an RWX volume when shared across pods)",
            StorageBackend::Redb => "a directory; the database is <dir>/certstore.redb",
            StorageBackend::Memory => "nothing (ignored)",
        }
    }
}

impl fmt::Display for StorageBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Parses interpolated `sb.yml` text.
///
/// Returns the configuration when there is no [`Severity::Error`] (its
/// warnings are then available from [`SbConfig::warnings`]); otherwise every
/// problem found, warnings included, in file order. Never panics, whatever
/// the text.
pub fn parse_config(text: &str) -> Result<SbConfig, Vec<Problem>> {
    parse::parse(text, &[])
}

/// Parses the result of [`interpolate_report`], as [`parse_config`] does: its
/// unresolved references are warnings, and errors where the sidecar's own
/// block uses them.
pub fn parse_interpolated_config(interpolated: &Interpolated) -> Result<SbConfig, Vec<Problem>> {
    if interpolated.oversized {
        return Err(vec![Interpolated::oversized_problem()]);
    }
    parse::parse(&interpolated.text, &interpolated.unresolved)
}

/// A configuration file as read from disk.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Loaded {
    /// The parsed configuration.
    pub config: SbConfig,
    /// Lowercase hex sha256 of the raw file bytes (before interpolation):
    /// the identity of this version of the file.
    pub sha256_hex_of_raw_file: String,
    /// The raw file bytes, before interpolation: what is POSTed to the proxy.
    pub raw: Vec<u8>,
}

/// Reads, interpolates and parses the file at `path`.
///
/// A read error is a single problem whose path is the file path.
pub fn load_config(path: &Path, env: &EnvLookup<'_>) -> Result<Loaded, Vec<Problem>> {
    let raw = read_bounded(path)
        .map_err(|e| vec![Problem::error(path.display().to_string(), e.to_string())])?;
    let config = parse_bytes(&raw, env)?;
    Ok(Loaded {
        config,
        sha256_hex_of_raw_file: sha256_hex(&raw),
        raw,
    })
}

/// Why [`read_bounded`] returned no content.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum ReadError {
    /// The file cannot be read (absent, permissions, a mount mid-swap).
    #[error("cannot read: {0}")]
    Io(#[from] std::io::Error),
    /// The file is larger than [`MAX_CONFIG_BYTES`].
    #[error("{message}")]
    TooLarge {
        /// What [`oversized`] says.
        message: String,
        /// Lowercase hex sha256 of the bytes read (one past the limit), so
        /// that a watcher still tells one oversized version from another.
        sha256_of_prefix: String,
    },
}

/// Reads at most [`MAX_CONFIG_BYTES`] of the file at `path`; a larger file
/// is an error saying so, without reading it whole. The one read of
/// `sb.yml`: `validate`, `run`'s start-up ([`load_config`]) and the reload
/// watcher all go through it, so they agree on what is too large.
pub(crate) fn read_bounded(path: &Path) -> Result<Vec<u8>, ReadError> {
    use std::io::Read as _;
    let file = std::fs::File::open(path)?;
    let mut raw = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut raw)?;
    match oversized(raw.len()) {
        Some(message) => Err(ReadError::TooLarge {
            message,
            sha256_of_prefix: sha256_hex(&raw),
        }),
        None => Ok(raw),
    }
}

/// What is wrong with a file of `len` bytes (read up to one byte past
/// [`MAX_CONFIG_BYTES`]), when it is too large.
pub(crate) fn oversized(len: usize) -> Option<String> {
    (len as u64 > MAX_CONFIG_BYTES).then(|| {
        format!(
            "larger than {} MiB; the sidecar reads at most that much (a ConfigMap holds at most 1 MiB)",
            MAX_CONFIG_BYTES >> 20
        )
    })
}

/// Interpolates and parses raw file bytes, as [`load_config`] does after reading.
pub(crate) fn parse_bytes(raw: &[u8], env: &EnvLookup<'_>) -> Result<SbConfig, Vec<Problem>> {
    let text = std::str::from_utf8(raw).map_err(|e| {
        vec![Problem::error(
            "(file)",
            format!(
                "not valid UTF-8 (first bad byte at offset {}); save the file as UTF-8",
                e.valid_up_to()
            ),
        )]
    })?;
    parse_interpolated_config(&interpolate_report(text, env))
}

/// Lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes))
}

#[cfg(test)]
mod tests;
