//! The parts of `sb.yml` the sidecar reads, and how it reads them.
//!
//! `sb.yml` belongs to the proxy. The sidecar reads only `proxy.admin`,
//! `proxy.cluster`, `proxy.acme` and the keys of `origins`, and ignores
//! everything else in the file. Inside those sections, unknown keys are
//! reported (a typo such as `storge_path` would otherwise silently fall back
//! to a default).
//!
//! Reading is three pure steps, each usable on its own:
//!
//! 1. [`interpolate`] replaces `${VAR}` and `${VAR:-default}` from an
//!    environment passed in as a function (so tests never touch the process
//!    environment);
//! 2. [`parse`] turns the interpolated text into an [`SbConfig`], collecting
//!    *every* [`Problem`] rather than stopping at the first;
//! 3. [`load`] does both for a file on disk and also returns the sha256 of the
//!    raw bytes, which is how a change of the file is recognised.
//!
//! ```
//! use sbmesh::config;
//!
//! let env = |name: &str| (name == "POD").then(|| "demo-proxy-0".to_string());
//! let text = config::interpolate("proxy:\n  cluster:\n    node_id: ${POD}\n", &env).unwrap();
//! let cfg = config::parse(&text).unwrap();
//! assert_eq!(cfg.proxy.cluster.unwrap().node_id.as_deref(), Some("demo-proxy-0"));
//! ```
//!
//! Cluster keys live in [`key`]: where a key comes from ([`KeySource`]), how a
//! key ring is written ([`parse_key_ring`]) and how a fresh one is made
//! ([`generate_key`]).

mod interpolate;
pub mod key;
mod parse;

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use interpolate::interpolate;
pub use key::{
    KeyGenError, KeySource, generate_key, key_to_hex, parse_key_ring, resolve_key_source,
};

/// Looks up an environment variable by name; `None` when it is not set.
///
/// Every function here that needs the environment takes one of these, so
/// tests pass a closure over a map and production passes
/// `&|name| std::env::var(name).ok()`.
pub type EnvLookup<'a> = dyn Fn(&str) -> Option<String> + 'a;

/// The Let's Encrypt production directory, the default `proxy.acme.directory_url`.
pub const LETS_ENCRYPT_DIRECTORY: &str = "https://acme-v02.api.letsencrypt.org/directory";

/// The default `proxy.admin.port`: where the proxy's admin API (and its
/// `/admin/reload`) listens.
pub const DEFAULT_PROXY_ADMIN_PORT: u16 = 9090;

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
/// actual `sb.yml`, use [`parse`] or [`load`], which validate and report
/// every problem with its path.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SbConfig {
    /// The `proxy` section (only its `admin`, `cluster` and `acme` parts).
    pub proxy: ProxySection,
    /// The keys of the `origins` mapping, in file order: the hostnames to certify.
    pub origins: Vec<String>,
}

impl SbConfig {
    /// Problems that do not block the configuration: today, wildcard origins
    /// while ACME is enabled (HTTP-01 cannot prove a wildcard, so they are
    /// never ordered). With ACME disabled nothing is ordered, so nothing is
    /// reported.
    pub fn warnings(&self) -> Vec<Problem> {
        if !self.acme_enabled() {
            return Vec::new();
        }
        self.origins
            .iter()
            .filter(|host| host.contains('*'))
            .map(|host| {
                Problem::warning(
                    parse::child_path("origins", host),
                    "wildcard origin is not eligible for an HTTP-01 certificate and will not be \
                     ordered; provide its certificate another way (e.g. cert-manager with DNS-01)",
                )
            })
            .collect()
    }

    /// The origins an ACME issuer may order certificates for: every origin
    /// except wildcards, in file order.
    pub fn acme_eligible_origins(&self) -> impl Iterator<Item = &str> {
        self.origins
            .iter()
            .map(String::as_str)
            .filter(|host| !host.contains('*'))
    }

    /// True when `proxy.acme.enabled` is true.
    pub fn acme_enabled(&self) -> bool {
        self.proxy.acme.as_ref().is_some_and(|acme| acme.enabled)
    }
}

/// `proxy`: the three sub-sections the sidecar reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProxySection {
    /// `proxy.admin`: the proxy's admin API, where reloads are POSTed.
    pub admin: AdminSection,
    /// `proxy.cluster`: mesh settings; flags and environment override each key.
    pub cluster: Option<ClusterSection>,
    /// `proxy.acme`: certificate issuance.
    pub acme: Option<AcmeSection>,
}

/// `proxy.admin`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdminSection {
    /// `enabled`, default `false`.
    pub enabled: bool,
    /// `port`, default [`DEFAULT_PROXY_ADMIN_PORT`].
    pub port: u16,
    /// `username` for HTTP Basic on the proxy's admin API.
    pub username: Option<String>,
    /// `password` for HTTP Basic on the proxy's admin API.
    pub password: Option<String>,
}

impl Default for AdminSection {
    fn default() -> Self {
        AdminSection {
            enabled: false,
            port: DEFAULT_PROXY_ADMIN_PORT,
            username: None,
            password: None,
        }
    }
}

impl fmt::Debug for AdminSection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminSection")
            .field("enabled", &self.enabled)
            .field("port", &self.port)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// `proxy.cluster`. Every key is optional; the sidecar's flags and
/// environment variables take precedence over each one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClusterSection {
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
    /// `security`: how mesh traffic is sealed.
    pub security: Option<Security>,
}

/// `proxy.cluster.security`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Security {
    /// `mode`; only `shared_key` exists (and is assumed when absent).
    pub mode: SecurityMode,
    /// `shared_key`: a [`KeySource`] as written: `env:NAME`, `file:/path`, or
    /// the key ring itself (comma-separated 64-hex-character keys).
    pub shared_key: Option<String>,
}

impl Default for Security {
    fn default() -> Self {
        Security {
            mode: SecurityMode::SharedKey,
            shared_key: None,
        }
    }
}

impl fmt::Debug for Security {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Security")
            .field("mode", &self.mode)
            .field(
                "shared_key",
                &self.shared_key.as_deref().map(KeySource::parse),
            )
            .finish()
    }
}

/// `proxy.cluster.security.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecurityMode {
    /// Every packet is sealed with a key shared by all members.
    SharedKey,
}

/// `proxy.acme`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AcmeSection {
    /// `enabled`, default `false`.
    pub enabled: bool,
    /// `email`: the account contact; optional (Let's Encrypt does not require one).
    pub email: Option<String>,
    /// `directory_url`, default [`LETS_ENCRYPT_DIRECTORY`].
    pub directory_url: String,
    /// `ca_root`: a PEM file to trust for a private CA's directory.
    pub ca_root: Option<PathBuf>,
    /// `storage_backend`; `None` when omitted (a store local to this pod is
    /// then used, which is only right for a single replica).
    pub storage_backend: Option<StorageBackend>,
    /// `storage_path`, as written; its form depends on the backend (see
    /// [`StorageBackend::path_form`]).
    pub storage_path: Option<String>,
    /// `renew_before_days`; `None`: renew when a third of the lifetime remains.
    pub renew_before_days: Option<u32>,
    /// `eab`: external account binding, for CAs that require one.
    pub eab: Option<Eab>,
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
        }
    }
}

/// `proxy.acme.eab`: external account binding credentials from the CA.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    pub const ALL: [StorageBackend; 7] = [
        StorageBackend::Redis,
        StorageBackend::S3,
        StorageBackend::Gcs,
        StorageBackend::Azure,
        StorageBackend::File,
        StorageBackend::Redb,
        StorageBackend::Memory,
    ];

    /// The name used in `sb.yml`.
    pub fn as_str(self) -> &'static str {
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
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|b| b.as_str() == name)
    }

    /// Whether `storage_path` must be given for this backend.
    pub fn needs_path(self) -> bool {
        self != StorageBackend::Memory
    }

    /// Whether every pod can see the same data. `file` counts as shared: it
    /// is, when the directory is an RWX volume, which the config cannot tell.
    pub fn is_shared(self) -> bool {
        !matches!(self, StorageBackend::Redb | StorageBackend::Memory)
    }

    /// What `storage_path` looks like for this backend, for messages.
    pub fn path_form(self) -> &'static str {
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
pub fn parse(text: &str) -> Result<SbConfig, Vec<Problem>> {
    parse::parse(text)
}

/// A configuration file as read from disk.
#[derive(Debug, Clone, PartialEq, Eq)]
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
pub fn load(path: &Path, env: &EnvLookup<'_>) -> Result<Loaded, Vec<Problem>> {
    let raw = std::fs::read(path).map_err(|e| {
        vec![Problem::error(
            path.display().to_string(),
            format!("cannot read: {e}"),
        )]
    })?;
    let config = parse_bytes(&raw, env)?;
    Ok(Loaded {
        config,
        sha256_hex_of_raw_file: sha256_hex(&raw),
        raw,
    })
}

/// Interpolates and parses raw file bytes, as [`load`] does after reading.
pub fn parse_bytes(raw: &[u8], env: &EnvLookup<'_>) -> Result<SbConfig, Vec<Problem>> {
    let text = std::str::from_utf8(raw).map_err(|e| {
        vec![Problem::error(
            "(file)",
            format!(
                "not valid UTF-8 (first bad byte at offset {}); save the file as UTF-8",
                e.valid_up_to()
            ),
        )]
    })?;
    let text = interpolate(text, env).map_err(|p| vec![p])?;
    parse(&text)
}

/// Lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes))
}

#[cfg(test)]
mod tests;
