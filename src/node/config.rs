//! What a node is started with: [`NodeConfig`] and the proxy settings in it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use crate::acme::manager::AcmeLimits;
use crate::config::DEFAULT_PROXY_ADMIN_PORT;
use crate::config::{CertApply, SbConfig};
use crate::flags::{DEFAULT_CERT_DIR, DEFAULT_PROXY_PROCESS_NAME, DEFAULT_STATE_DIR};
use crate::http::passthrough::Upstream;
use crate::mesh::SwimTuning;
use crate::proxy::RestartConfig;
use crate::reload::ReloadTiming;

use super::NodeError;

#[cfg(doc)]
use super::Node;

/// Where and how reloads are POSTed to a proxy in another process.
#[derive(Clone)]
#[non_exhaustive]
pub struct ProxyReload {
    /// `http://…/admin/reload` (`--proxy-reload-url`).
    pub url: String,
    /// The full `Authorization` header value (`--proxy-authorization`).
    pub authorization: Option<String>,
}

impl ProxyReload {
    /// POSTs to `url` (`http://…/admin/reload`), with this `Authorization`
    /// header value when set.
    pub fn new(url: impl Into<String>, authorization: Option<String>) -> Self {
        Self {
            url: url.into(),
            authorization,
        }
    }
}

impl std::fmt::Debug for ProxyReload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyReload")
            .field("url", &self.url)
            .field(
                "authorization",
                &self.authorization.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// How a restarted proxy is found and awaited (`cert_apply: Restart`).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ProxyRestart {
    /// The proxy's `/proc/<pid>/comm` (`--proxy-process-name`).
    pub process_name: String,
    /// What must answer 200 before a restarted proxy counts as back.
    pub health_url: String,
    /// At most one restart per pod this often.
    pub min_interval: Duration,
}

impl Default for ProxyRestart {
    fn default() -> Self {
        let health_url = format!("http://127.0.0.1:{DEFAULT_PROXY_ADMIN_PORT}/health");
        let d = RestartConfig::new("", DEFAULT_PROXY_PROCESS_NAME, &health_url);
        Self {
            process_name: d.process_name,
            health_url: d.health_url,
            min_interval: d.min_interval,
        }
    }
}

/// Everything [`Node::start`] needs. [`NodeConfig::new`] (or
/// [`NodeConfig::from_file`]) fills in the defaults of docs/reference.md#sidecar-flags; change the
/// public fields after that.
#[derive(Clone)]
#[non_exhaustive]
pub struct NodeConfig {
    /// This member's name in the mesh.
    pub node_id: String,
    /// Packets from another cluster id are dropped.
    pub cluster_id: String,
    /// The version this node announces in its metadata (default: the
    /// library's).
    pub version: String,
    /// The `sb.yml` to follow: origins added or removed there are ordered
    /// or dropped without a restart. `None`: [`NodeConfig::config`] is
    /// used as it is, for the node's whole life.
    pub config_path: Option<PathBuf>,
    /// The configuration as read at start-up (origins, `acme`, the store).
    pub config: SbConfig,
    /// Lowercase hex sha256 of the file [`NodeConfig::config`] was read
    /// from: announced as this node's config hash, and not POSTed again.
    pub config_sha256: Option<String>,
    /// IP the gossip (UDP) and transport (TCP) sockets bind.
    pub bind: IpAddr,
    /// UDP port.
    pub gossip_port: u16,
    /// TCP port.
    pub transport_port: u16,
    /// The address peers reach this node at; `None` lets the mesh pick.
    pub advertise: Option<SocketAddr>,
    /// `host:port` seeds, re-resolved.
    pub seeds: Vec<String>,
    /// A headless Service name whose records are seeds.
    pub mesh_service: Option<String>,
    /// The cluster key ring, primary first. `None`: the node runs alone
    /// with an ephemeral key (peers could not read it).
    pub cluster_key: Option<Vec<[u8; 32]>>,
    /// A key file re-read when it changes (rotation without restart).
    pub cluster_key_file: Option<PathBuf>,
    /// SWIM timing.
    pub swim: SwimTuning,
    /// Where the node serves [`Node::admin_router`] itself; `None`: it
    /// does not (serve the router yourself, or not at all).
    pub admin_listen: Option<SocketAddr>,
    /// HTTP Basic user for `/admin/*`.
    pub admin_user: Option<String>,
    /// HTTP Basic password for `/admin/*`.
    pub admin_password: Option<String>,
    /// Where the node serves [`Node::challenge_router`] (HTTP-01) itself;
    /// `None`: serve the router yourself on the port the CA reaches.
    pub challenge_listen: Option<SocketAddr>,
    /// The proxy's plain HTTP listener, where [`Node::challenge_router`]
    /// passes every request outside `/.well-known/acme-challenge/`
    /// ([`Passthrough`](crate::Passthrough)); `None`: those get `404`.
    pub challenge_passthrough: Option<Upstream>,
    /// When the config file is read again.
    pub reload: ReloadTiming,
    /// Where certificate files are written (docs/reference.md#certificate-files).
    pub cert_dir: PathBuf,
    /// Local state (e.g. the redb store).
    pub state_dir: PathBuf,
    /// A proxy in another process: reload POSTs and certificate hand-off.
    pub proxy: ProxySettings,
    /// How much ordering the fleet may do.
    pub acme: AcmeLimits,
}

/// The proxy beside the node, in another process: where its reloads are
/// POSTed and how new certificates reach it (the `--proxy-*` and
/// `--watch-tls` flags). The default is an embedding process's: no POST,
/// [`CertApply::None`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ProxySettings {
    /// The proxy to POST reloads to. `None` (an embedding process): the
    /// config file is still followed ([`Node::config`]) but nobody is
    /// POSTed.
    pub reload: Option<ProxyReload>,
    /// How a new certificate reaches the proxy (`--proxy-cert-apply`). An
    /// embedding process serving [`Node::certificates`] wants
    /// [`CertApply::None`].
    pub cert_apply: CertApply,
    /// Used when `cert_apply` is [`CertApply::Restart`].
    pub restart: ProxyRestart,
    /// Directories with a `tls.crt` / `tls.key` pair to hand to the proxy
    /// when they change (`--watch-tls`).
    pub watch_tls: Vec<PathBuf>,
}

impl Default for ProxySettings {
    fn default() -> Self {
        Self {
            reload: None,
            cert_apply: CertApply::None,
            restart: ProxyRestart::default(),
            watch_tls: Vec::new(),
        }
    }
}

impl std::fmt::Debug for NodeConfig {
    /// Every field; the key ring, the admin password and the reload's
    /// `Authorization` are redacted.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redacted = |set: bool| if set { Some("<redacted>") } else { None };
        f.debug_struct("NodeConfig")
            .field("node_id", &self.node_id)
            .field("cluster_id", &self.cluster_id)
            .field("version", &self.version)
            .field("config_path", &self.config_path)
            .field("config", &self.config)
            .field("config_sha256", &self.config_sha256)
            .field("bind", &self.bind)
            .field("gossip_port", &self.gossip_port)
            .field("transport_port", &self.transport_port)
            .field("advertise", &self.advertise)
            .field("seeds", &self.seeds)
            .field("mesh_service", &self.mesh_service)
            .field(
                "cluster_key",
                &self
                    .cluster_key
                    .as_ref()
                    .map(|ring| format!("<{} key(s) redacted>", ring.len())),
            )
            .field("cluster_key_file", &self.cluster_key_file)
            .field("swim", &self.swim)
            .field("admin_listen", &self.admin_listen)
            .field("admin_user", &self.admin_user)
            .field("admin_password", &redacted(self.admin_password.is_some()))
            .field("challenge_listen", &self.challenge_listen)
            .field("challenge_passthrough", &self.challenge_passthrough)
            .field("reload", &self.reload)
            .field("cert_dir", &self.cert_dir)
            .field("state_dir", &self.state_dir)
            .field("proxy", &self.proxy)
            .field("acme", &self.acme)
            .finish()
    }
}

impl NodeConfig {
    /// A node named `node_id` in `cluster_id` with the configuration
    /// `config` (fixed: set [`NodeConfig::config_path`] to follow a file),
    /// and the defaults of docs/reference.md#sidecar-flags: mesh on `0.0.0.0:7946` (UDP) and `:8946`
    /// (TCP), no cluster key (alone), no listener of its own, no reload
    /// POST, `cert_apply: none`, `/var/lib/sbproxy/{certs,sidecar}`.
    pub fn new(
        node_id: impl Into<String>,
        cluster_id: impl Into<String>,
        config: SbConfig,
    ) -> Self {
        Self {
            node_id: node_id.into(),
            cluster_id: cluster_id.into(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            config_path: None,
            config,
            config_sha256: None,
            bind: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            gossip_port: crate::config::DEFAULT_GOSSIP_PORT,
            transport_port: crate::config::DEFAULT_TRANSPORT_PORT,
            advertise: None,
            seeds: Vec::new(),
            mesh_service: None,
            cluster_key: None,
            cluster_key_file: None,
            swim: SwimTuning::default(),
            admin_listen: None,
            admin_user: None,
            admin_password: None,
            challenge_listen: None,
            challenge_passthrough: None,
            reload: ReloadTiming::default(),
            cert_dir: PathBuf::from(DEFAULT_CERT_DIR),
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            proxy: ProxySettings::default(),
            acme: AcmeLimits::default(),
        }
    }

    /// The config hash as announced and reported (`sha256:<hex>`).
    pub(crate) fn config_hash(&self) -> Option<String> {
        self.config_sha256.as_ref().map(|h| format!("sha256:{h}"))
    }

    /// [`NodeConfig::new`] with the configuration read from `path`
    /// (`${VAR}` references resolved from the process environment), and
    /// that file followed for changes.
    pub fn from_file(
        node_id: impl Into<String>,
        cluster_id: impl Into<String>,
        path: impl Into<PathBuf>,
    ) -> Result<Self, NodeError> {
        let path = path.into();
        let env = |name: &str| std::env::var(name).ok();
        let loaded =
            crate::config::load_config(&path, &env).map_err(|problems| NodeError::Config {
                path: path.clone(),
                problems: problems
                    .iter()
                    .filter(|p| p.is_error())
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            })?;
        let mut cfg = Self::new(node_id, cluster_id, loaded.config);
        cfg.config_path = Some(path);
        cfg.config_sha256 = Some(loaded.sha256_hex_of_raw_file);
        Ok(cfg)
    }
}
