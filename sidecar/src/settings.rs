//! Everything `run` needs, resolved once at start: flag > environment >
//! `sb.yml` > default (docs/reference.md#sidecar-flags).
//!
//! [`resolve`] takes the environment as a function so the precedence can be
//! tested without touching the process environment. In production clap has
//! already folded each flag's environment variable into [`RunArgs`]; looking
//! it up again here finds the same value.

use std::fmt;
use std::io::IsTerminal as _;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use sbmesh::{
    CHAIN_FILE, CertApply, CertificateMode, DEFAULT_ADMIN_LISTEN, DEFAULT_CHALLENGE_LISTEN,
    DEFAULT_CLUSTER_DOMAIN, DEFAULT_NAMESPACE, DEFAULT_SHUTDOWN_GRACE, EnvLookup, Flag, FlagKind,
    FlagValue, KEY_FILE, NodeConfig, Problem, ProxyReload, SbConfig, SbmeshSection, SidecarPorts,
    config_conflicts, default_cluster_id, default_node_id, load_config, mesh_service_fqdn,
    normalize_seed, parse_advertise, parse_key_ring, resolve_field, resolve_key_source,
    unresolved_in, unresolved_message, validate_cluster_id, validate_node_id,
};

use crate::cli::RunArgs;

/// The cluster id when nothing else names one.
pub const DEFAULT_CLUSTER_ID: &str = "sbmesh";

/// The resolved settings of `run`: the library's [`NodeConfig`] (every
/// setting the node itself runs with, documented there once) and what
/// only the process around it needs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// What [`sbmesh::Node::start`] runs with. The sidecar always
    /// serves its own admin and challenge listeners and POSTs reloads, so
    /// `admin_listen`, `challenge_listen` and `proxy_reload` are set, as
    /// are `config_path` and `config_sha256`.
    pub node: NodeConfig,
    /// `--log-format`.
    pub log_format: LogFormat,
    /// `--shutdown-grace-ms`.
    pub shutdown_grace: Duration,
    /// What deserves a look but does not stop `run` (printed at start, and
    /// by `validate`).
    pub warnings: Vec<Problem>,
}

/// How logs are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line, for log collectors.
    Json,
    /// Human-readable lines, for a terminal.
    Text,
}

const SHARED_KEY_PATH: &str = "proxy.extensions.sbmesh.shared_key";

/// Reads flag values (falling back to their environment variables) and
/// collects problems.
struct Resolver<'e> {
    env: &'e EnvLookup<'e>,
    problems: Vec<Problem>,
}

impl Resolver<'_> {
    /// The flag's value, else its environment variable's. Empty counts as unset.
    fn text(&self, flag: &Flag, value: Option<&str>) -> Option<String> {
        value
            .map(str::to_string)
            .or_else(|| (self.env)(flag.env))
            .filter(|v| !v.trim().is_empty())
    }

    fn path(&self, flag: &Flag, value: Option<&Path>) -> Option<PathBuf> {
        match value {
            Some(path) if !path.as_os_str().is_empty() => Some(path.to_path_buf()),
            _ => self.text(flag, None).map(PathBuf::from),
        }
    }

    /// A problem with a flag's value, named by the flag.
    fn bad(&mut self, flag: &Flag, message: impl fmt::Display) {
        self.problems.push(Problem::error(
            flag.flag(),
            format!("{message} (from {} or {})", flag.flag(), flag.env),
        ));
    }

    /// The flag's value read as its setting's type ([`FlagValue`]); a bad
    /// value is reported and gives `None`.
    fn get<T: FlagValue>(&mut self, flag: &Flag, value: Option<&str>) -> Option<T> {
        self.parsed(flag, value, |text| T::parse_flag(flag.kind, text))
    }

    /// Sets `into` to the flag's value when one is given; a bad value is
    /// reported and `into` keeps its default.
    fn set<T: FlagValue>(&mut self, flag: &Flag, value: Option<&str>, into: &mut T) {
        if let Some(v) = self.get(flag, value) {
            *into = v;
        }
    }

    /// Parses the flag's value with `parse`; a failure is reported and gives `None`.
    fn parsed<T>(
        &mut self,
        flag: &Flag,
        value: Option<&str>,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Option<T> {
        let text = self.text(flag, value)?;
        match parse(text.trim()) {
            Ok(v) => Some(v),
            Err(message) => {
                self.bad(flag, message);
                None
            }
        }
    }
}

/// Resolves the settings of `run` from its flags, the environment (`env`),
/// the config file they name, and the defaults. `hostname` is the last
/// fallback for the node id.
///
/// Returns every problem found, not just the first: flag and environment
/// values are named by their flag (`--gossip-port: ...`), file values by
/// their YAML path. Files read: the config file and, when set,
/// `--cluster-key-file` (or a `file:` key source). Each default is the
/// flag table's ([`sbmesh::Flag`]), through [`NodeConfig::new`], unless
/// `sb.yml` gives one; `r.set` overrides it with the flag's value.
pub fn resolve(
    args: &RunArgs,
    env: &EnvLookup<'_>,
    hostname: &str,
) -> Result<Settings, Vec<Problem>> {
    let mut r = Resolver {
        env,
        problems: Vec::new(),
    };
    let (mut node, pod) = resolve_identity(&mut r, args, hostname);
    resolve_mesh(&mut r, args, &pod, &mut node);
    let credentials = proxy_admin_credentials(&node.config, r.env).unwrap_or_else(|problems| {
        r.problems.extend(problems);
        None
    });
    resolve_listeners(&mut r, args, credentials.as_ref(), &mut node);
    resolve_proxy(&mut r, args, credentials.as_ref(), &mut node);

    let cert_dir = r.path(&Flag::CERT_DIR, args.cert_dir.as_deref());
    node.cert_dir = cert_dir.unwrap_or(node.cert_dir);
    let state_dir = r.path(&Flag::STATE_DIR, args.state_dir.as_deref());
    node.state_dir = state_dir.unwrap_or(node.state_dir);
    let reload_debounce = args.reload_debounce_ms.as_deref();
    r.set(
        &Flag::RELOAD_DEBOUNCE_MS,
        reload_debounce,
        &mut node.reload.debounce,
    );
    let reload_rescan = args.reload_rescan_secs.as_deref();
    r.set(
        &Flag::RELOAD_RESCAN_SECS,
        reload_rescan,
        &mut node.reload.rescan,
    );
    let lock_ttl = args.acme_order_lock_ttl_secs.as_deref();
    r.set(
        &Flag::ACME_ORDER_LOCK_TTL_SECS,
        lock_ttl,
        &mut node.acme.order_lock_ttl,
    );
    let max_orders = args.acme_max_orders.as_deref();
    r.set(
        &Flag::ACME_MAX_ORDERS,
        max_orders,
        &mut node.acme.max_orders,
    );
    let interval = args.acme_orders_interval_secs.as_deref();
    r.set(
        &Flag::ACME_ORDERS_INTERVAL_SECS,
        interval,
        &mut node.acme.orders_interval,
    );
    let concurrent = args.acme_concurrent_orders.as_deref();
    r.set(
        &Flag::ACME_CONCURRENT_ORDERS,
        concurrent,
        &mut node.acme.concurrent_orders,
    );

    let mut log_format = if std::io::stderr().is_terminal() {
        LogFormat::Text
    } else {
        LogFormat::Json
    };
    r.set(
        &Flag::LOG_FORMAT,
        args.log_format.as_deref(),
        &mut log_format,
    );
    let mut shutdown_grace = DEFAULT_SHUTDOWN_GRACE;
    let grace = args.shutdown_grace_ms.as_deref();
    r.set(&Flag::SHUTDOWN_GRACE_MS, grace, &mut shutdown_grace);

    check_san_files(&mut r, &node);
    r.problems.extend(config_conflicts(
        &node.config,
        SidecarPorts {
            gossip: node.gossip_port,
            transport: node.transport_port,
        },
    ));
    if r.problems.iter().any(Problem::is_error) {
        return Err(r.problems);
    }
    Ok(Settings {
        node,
        log_format,
        shutdown_grace,
        warnings: r.problems,
    })
}

/// What the pod's environment says of where the node runs.
struct Pod {
    ip: Option<IpAddr>,
    namespace: String,
}

/// Reads the config file and names the node: its id and cluster id.
fn resolve_identity(r: &mut Resolver<'_>, args: &RunArgs, hostname: &str) -> (NodeConfig, Pod) {
    let config_path =
        crate::cli::config_path(r.path(&Flag::CONFIG, args.config.as_deref()).as_deref());
    let (config, config_sha256) = match load_config(&config_path, r.env) {
        Ok(loaded) => {
            r.problems.extend(loaded.config.warnings());
            (loaded.config, loaded.sha256_hex_of_raw_file)
        }
        Err(problems) => {
            r.problems.extend(problems);
            (SbConfig::default(), String::new())
        }
    };
    let cluster = config.sbmesh();
    let pod_name = r
        .text(&Flag::POD_NAME, args.pod_name.as_deref())
        .map(|v| v.trim().to_string());
    let mut pod = Pod {
        ip: r.get(&Flag::POD_IP, args.pod_ip.as_deref()),
        namespace: DEFAULT_NAMESPACE.to_string(),
    };
    if let Some(ns) = r.parsed(&Flag::NAMESPACE, args.namespace.as_deref(), parse_namespace) {
        pod.namespace = ns;
    }
    let node_id = resolve_node_id(r, args, cluster, pod_name.as_deref(), hostname);
    let cluster_id = resolve_cluster_id(r, args, cluster, pod_name.as_deref());
    let mut node = NodeConfig::new(node_id, cluster_id, config);
    node.version = env!("CARGO_PKG_VERSION").to_owned();
    node.config_path = Some(config_path);
    node.config_sha256 = Some(config_sha256);
    (node, pod)
}

/// The mesh: ports, seeds, the address peers reach, the cluster key.
fn resolve_mesh(r: &mut Resolver<'_>, args: &RunArgs, pod: &Pod, node: &mut NodeConfig) {
    let cluster = node.config.sbmesh();
    let mut cluster_domain = DEFAULT_CLUSTER_DOMAIN.to_string();
    let domain = args.cluster_domain.as_deref();
    r.set(&Flag::CLUSTER_DOMAIN, domain, &mut cluster_domain);

    node.gossip_port = cluster.gossip_port.unwrap_or(node.gossip_port);
    r.set(
        &Flag::GOSSIP_PORT,
        args.gossip_port.as_deref(),
        &mut node.gossip_port,
    );
    node.transport_port = cluster.transport_port.unwrap_or(node.transport_port);
    let transport = args.transport_port.as_deref();
    r.set(&Flag::TRANSPORT_PORT, transport, &mut node.transport_port);
    let gossip_port = node.gossip_port;

    node.mesh_service = r
        .text(&Flag::MESH_SERVICE, args.mesh_service.as_deref())
        .map(|svc| mesh_service_fqdn(&svc, &pod.namespace, &cluster_domain));
    if let Some(name) = node.mesh_service.as_deref()
        && normalize_seed(name, gossip_port).is_err()
    {
        r.bad(
            &Flag::MESH_SERVICE,
            format!("{name:?} is not a DNS name; expected a Service name such as demo-mesh"),
        );
    }
    node.seeds = resolve_seeds(r, args, cluster, gossip_port);
    r.set(&Flag::BIND, args.bind.as_deref(), &mut node.bind);
    node.advertise = resolve_advertise(r, args, cluster, pod.ip, node.bind, gossip_port);

    node.cluster_key_file = r.path(&Flag::CLUSTER_KEY_FILE, args.cluster_key_file.as_deref());
    let problems_before_key = r.problems.len();
    node.cluster_key = resolve_cluster_key(r, args, cluster, node.cluster_key_file.as_deref());
    let key_was_refused = r.problems.len() > problems_before_key;
    let has_peers = !node.seeds.is_empty() || node.mesh_service.is_some();
    if node.cluster_key.is_none() && !key_was_refused && has_peers {
        r.problems.push(Problem::error(
            Flag::CLUSTER_KEY.flag(),
            format!(
                "the mesh has peers to contact ({}, proxy.extensions.sbmesh.seeds or {}) but no \
                 cluster key to seal its traffic; set {}, {} or {SHARED_KEY_PATH} to a key \
                 generated with `sbmesh-sidecar keygen`",
                Flag::SEEDS.names(),
                Flag::MESH_SERVICE.names(),
                Flag::CLUSTER_KEY.names(),
                Flag::CLUSTER_KEY_FILE.names(),
            ),
        ));
    }
}

/// The sidecar's own listeners and their HTTP Basic credentials.
fn resolve_listeners(
    r: &mut Resolver<'_>,
    args: &RunArgs,
    proxy_credentials: Option<&(String, String)>,
    node: &mut NodeConfig,
) {
    node.admin_listen = Some(DEFAULT_ADMIN_LISTEN);
    r.set(
        &Flag::ADMIN_LISTEN,
        args.admin_listen.as_deref(),
        &mut node.admin_listen,
    );
    node.challenge_listen = Some(DEFAULT_CHALLENGE_LISTEN);
    let challenge = args.challenge_listen.as_deref();
    r.set(
        &Flag::CHALLENGE_LISTEN,
        challenge,
        &mut node.challenge_listen,
    );
    // Empty is off, as unset.
    let passthrough = args.challenge_passthrough.as_deref();
    r.set(
        &Flag::CHALLENGE_PASSTHROUGH,
        passthrough,
        &mut node.challenge_passthrough,
    );
    // Empty is the default, as unset.
    let check = args.acme_check_url.as_deref();
    r.set(&Flag::ACME_CHECK_URL, check, &mut node.acme.check_url);
    let resolvers = args.acme_dns_resolvers.as_deref();
    r.set(
        &Flag::ACME_DNS_RESOLVERS,
        resolvers,
        &mut node.acme.dns_resolvers,
    );

    node.admin_user = r
        .text(&Flag::ADMIN_USER, args.admin_user.as_deref())
        .or_else(|| proxy_credentials.map(|(u, _)| u.clone()));
    node.admin_password = r
        .text(&Flag::ADMIN_PASSWORD, args.admin_password.as_deref())
        .or_else(|| proxy_credentials.map(|(_, p)| p.clone()));
    match (&node.admin_user, &node.admin_password) {
        (Some(_), None) => r.problems.push(Problem::error(
            Flag::ADMIN_PASSWORD.flag(),
            format!(
                "an admin user is set ({} or proxy.admin.username) but no password; HTTP Basic \
                 needs both: set {} or proxy.admin.password",
                Flag::ADMIN_USER.names(),
                Flag::ADMIN_PASSWORD.names(),
            ),
        )),
        (None, Some(_)) => r.problems.push(Problem::error(
            Flag::ADMIN_USER.flag(),
            format!(
                "an admin password is set ({} or proxy.admin.password) but no user; HTTP Basic \
                 needs both: set {} or proxy.admin.username",
                Flag::ADMIN_PASSWORD.names(),
                Flag::ADMIN_USER.names(),
            ),
        )),
        (Some(user), Some(_)) if user.contains(':') => r.bad(
            &Flag::ADMIN_USER,
            "the user must not contain ':' (HTTP Basic separates the user from the password with it)",
        ),
        _ => {}
    }
}

/// The proxy beside the sidecar: where reloads are POSTed, how certificates
/// reach it, what it is called and where its health answers.
fn resolve_proxy(
    r: &mut Resolver<'_>,
    args: &RunArgs,
    credentials: Option<&(String, String)>,
    node: &mut NodeConfig,
) {
    let admin_url = node.config.proxy.admin.base_url();
    let mut url = format!("{admin_url}/admin/reload");
    r.set(
        &Flag::PROXY_RELOAD_URL,
        args.proxy_reload_url.as_deref(),
        &mut url,
    );
    let authorization = r
        .parsed(
            &Flag::PROXY_AUTHORIZATION,
            args.proxy_authorization.as_deref(),
            parse_header_value,
        )
        .or_else(|| {
            let (user, password) = credentials?;
            Some(basic_authorization(user, password))
        });
    node.proxy.reload = Some(ProxyReload::new(url, authorization));

    node.proxy.cert_apply = node.config.acme().and_then(|a| a.apply).unwrap_or_default();
    let apply = args.proxy_cert_apply.as_deref();
    r.set(&Flag::PROXY_CERT_APPLY, apply, &mut node.proxy.cert_apply);
    let restart = &mut node.proxy.restart;
    if let Some(name) = r.parsed(
        &Flag::PROXY_PROCESS_NAME,
        args.proxy_process_name.as_deref(),
        parse_process_name,
    ) {
        restart.process_name = name;
    }
    restart.health_url = format!("{admin_url}/health");
    let health = args.proxy_health_url.as_deref();
    r.set(&Flag::PROXY_HEALTH_URL, health, &mut restart.health_url);
    let interval = args.proxy_restart_interval_secs.as_deref();
    r.set(
        &Flag::PROXY_RESTART_INTERVAL_SECS,
        interval,
        &mut restart.min_interval,
    );
    node.proxy.watch_tls = if args.watch_tls.is_empty() {
        // The environment holds a comma-separated list.
        r.text(&Flag::WATCH_TLS, None)
            .map(|list| {
                list.split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(PathBuf::from)
                    .collect()
            })
            .unwrap_or_default()
    } else {
        args.watch_tls.clone()
    };
    if node.proxy.cert_apply == CertApply::Reload
        && node.config.acme().is_some()
        && node.config.proxy.tls_cert_file.is_some()
    {
        r.problems.push(Problem::warning(
            Flag::PROXY_CERT_APPLY.flag(),
            format!(
                "new certificates are applied by the reload POST, and sbproxy 1.13 reads \
                 proxy.tls_cert_file only at start-up: a renewed certificate would be served only \
                 after the proxy's next restart, the old one until it expires; set \
                 proxy.extensions.sbmesh.acme.apply: restart (or {} restart)",
                Flag::PROXY_CERT_APPLY.flag(),
            ),
        ));
    }
    if node.proxy.cert_apply == CertApply::Restart
        && args.proxy_health_url.is_none()
        && (r.env)(Flag::PROXY_HEALTH_URL.env).is_none()
        && !node.config.proxy.admin.enabled
    {
        r.problems.push(Problem::warning(
            Flag::PROXY_HEALTH_URL.flag(),
            format!(
                "certificates are applied by restarting the proxy, and a restarted proxy counts \
                 as back once its health check answers 200; proxy.admin is not enabled, so the \
                 default (the admin port's /health) will never answer: enable proxy.admin or set \
                 {} (e.g. the data port's /health)",
                Flag::PROXY_HEALTH_URL.names(),
            ),
        ));
    }
}

/// With `certificates: san` the proxy serves the pair it names and the
/// sidecar writes its own: a warning when they are not the same files.
fn check_san_files(r: &mut Resolver<'_>, node: &NodeConfig) {
    if node.config.certificate_mode() != CertificateMode::San {
        return;
    }
    let proxy = &node.config.proxy;
    for (key, named, ours) in [
        ("tls_cert_file", &proxy.tls_cert_file, CHAIN_FILE),
        ("tls_key_file", &proxy.tls_key_file, KEY_FILE),
    ] {
        let ours = node.cert_dir.join(ours);
        if let Some(file) = named.as_ref().filter(|f| **f != ours) {
            r.problems.push(Problem::warning(
                format!("proxy.{key}"),
                format!(
                    "is {}, but with certificates: san the sidecar writes {}; the proxy \
                     will not serve its certificate (point proxy.tls_cert_file and \
                     tls_key_file into the sidecar's {}, or set {})",
                    file.display(),
                    ours.display(),
                    Flag::CERT_DIR.flag(),
                    Flag::CERT_DIR.names(),
                ),
            ));
        }
    }
}

fn resolve_node_id(
    r: &mut Resolver<'_>,
    args: &RunArgs,
    cluster: &SbmeshSection,
    pod_name: Option<&str>,
    hostname: &str,
) -> String {
    /// Where the node id came from, to name it in a problem.
    enum Source {
        Flag,
        File,
        PodName,
        HostName,
    }
    const FILE_KEY: &str = "proxy.extensions.sbmesh.node_id";
    let (node_id, source) = if let Some(id) = r.text(&Flag::NODE_ID, args.node_id.as_deref()) {
        (id.trim().to_string(), Source::Flag)
    } else if let Some(id) = cluster.node_id.as_deref() {
        (id.trim().to_string(), Source::File)
    } else if pod_name.is_some() {
        (default_node_id(pod_name, hostname), Source::PodName)
    } else {
        (default_node_id(None, hostname), Source::HostName)
    };
    if let Err(e) = validate_node_id(&node_id) {
        match source {
            Source::File => r.problems.push(Problem::error(FILE_KEY, e.to_string())),
            Source::HostName => r.problems.push(Problem::error(
                Flag::NODE_ID.flag(),
                format!(
                    "no node id is set and the host name cannot be one: {e}; set {} or {}",
                    Flag::NODE_ID.names(),
                    Flag::POD_NAME.names(),
                ),
            )),
            Source::PodName => r.bad(&Flag::POD_NAME, format!("used as the node id: {e}")),
            Source::Flag => r.bad(&Flag::NODE_ID, e),
        }
    }
    node_id
}

fn resolve_cluster_id(
    r: &mut Resolver<'_>,
    args: &RunArgs,
    cluster: &SbmeshSection,
    pod_name: Option<&str>,
) -> String {
    let explicit = r.text(&Flag::CLUSTER_ID, args.cluster_id.as_deref());
    let from_yml = cluster.cluster_id.as_deref();
    let Some(id) = default_cluster_id(explicit.as_deref(), from_yml, pod_name) else {
        return DEFAULT_CLUSTER_ID.to_string();
    };
    if let Err(e) = validate_cluster_id(&id) {
        if explicit.is_some() {
            r.bad(&Flag::CLUSTER_ID, e);
        } else if from_yml.is_some() {
            r.problems.push(Problem::error(
                "proxy.extensions.sbmesh.cluster_id",
                e.to_string(),
            ));
        } else {
            r.bad(
                &Flag::POD_NAME,
                format!("its StatefulSet part, used as the cluster id: {e}"),
            );
        }
    }
    id
}

fn resolve_seeds(
    r: &mut Resolver<'_>,
    args: &RunArgs,
    cluster: &SbmeshSection,
    gossip_port: u16,
) -> Vec<String> {
    let mut seeds = Vec::new();
    if let Some(list) = r.text(&Flag::SEEDS, args.seeds.as_deref()) {
        for entry in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match normalize_seed(entry, gossip_port) {
                Ok(seed) => seeds.push(seed),
                Err(e) => r.bad(&Flag::SEEDS, e),
            }
        }
    } else {
        for entry in &cluster.seeds {
            match normalize_seed(entry, gossip_port) {
                Ok(seed) => seeds.push(seed),
                Err(e) => r.problems.push(Problem::error(
                    "proxy.extensions.sbmesh.seeds",
                    e.to_string(),
                )),
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    seeds.retain(|seed| seen.insert(seed.clone()));
    seeds
}

fn resolve_advertise(
    r: &mut Resolver<'_>,
    args: &RunArgs,
    cluster: &SbmeshSection,
    pod_ip: Option<IpAddr>,
    bind: IpAddr,
    gossip_port: u16,
) -> Option<SocketAddr> {
    if r.text(&Flag::ADVERTISE, args.advertise.as_deref())
        .is_some()
    {
        return r.parsed(&Flag::ADVERTISE, args.advertise.as_deref(), |text| {
            parse_advertise(text, gossip_port).map_err(|e| e.to_string())
        });
    }
    if let Some(text) = cluster.advertise_addr.as_deref() {
        return match parse_advertise(text, gossip_port) {
            Ok(addr) => Some(addr),
            Err(e) => {
                r.problems.push(Problem::error(
                    "proxy.extensions.sbmesh.advertise_addr",
                    e.to_string(),
                ));
                None
            }
        };
    }
    if let Some(ip) = pod_ip.filter(|ip| !ip.is_unspecified()) {
        return Some(SocketAddr::new(ip, gossip_port));
    }
    (!bind.is_unspecified()).then(|| SocketAddr::new(bind, gossip_port))
}

fn resolve_cluster_key(
    r: &mut Resolver<'_>,
    args: &RunArgs,
    cluster: &SbmeshSection,
    key_file: Option<&Path>,
) -> Option<Vec<[u8; 32]>> {
    let read = |path: &Path| std::fs::read_to_string(path);
    let key_flag = r.text(&Flag::CLUSTER_KEY, args.cluster_key.as_deref());
    match (key_flag, key_file) {
        (Some(_), Some(_)) => {
            r.problems.push(Problem::error(
                Flag::CLUSTER_KEY.flag(),
                format!(
                    "both {} and {} are set; keep one (the file allows key rotation without a \
                     restart)",
                    Flag::CLUSTER_KEY.names(),
                    Flag::CLUSTER_KEY_FILE.names(),
                ),
            ));
            None
        }
        (None, Some(file)) => {
            let text = match read(file) {
                Ok(text) => text,
                Err(e) => {
                    r.bad(
                        &Flag::CLUSTER_KEY_FILE,
                        format!("cannot read {}: {e}", file.display()),
                    );
                    return None;
                }
            };
            match parse_key_ring(&text) {
                Ok(ring) => Some(ring),
                Err(message) => {
                    r.bad(
                        &Flag::CLUSTER_KEY_FILE,
                        format!("{}: {message}", file.display()),
                    );
                    None
                }
            }
        }
        (Some(source), None) => {
            match key_ring_from(&Flag::CLUSTER_KEY.flag(), &source, r.env, &read) {
                Ok(ring) => Some(ring),
                Err(mut problem) => {
                    // Name the environment variable too, as for other flags.
                    problem.message.push_str(&format!(
                        " (from {} or {})",
                        Flag::CLUSTER_KEY.flag(),
                        Flag::CLUSTER_KEY.env
                    ));
                    r.problems.push(problem);
                    None
                }
            }
        }
        (None, None) => {
            let source = cluster.shared_key.as_deref()?;
            // Used now, so an unresolved variable in it is an error (it is
            // only a warning while a flag overrides it).
            if let Some(name) = unresolved_in(source) {
                r.problems
                    .push(Problem::error(SHARED_KEY_PATH, unresolved_message(name)));
                return None;
            }
            match key_ring_from(SHARED_KEY_PATH, source, r.env, &read) {
                Ok(ring) => Some(ring),
                Err(problem) => {
                    r.problems.push(problem);
                    None
                }
            }
        }
    }
}

/// Resolves a key source (`env:`, `file:` or literal) to a parsed key ring.
fn key_ring_from(
    path: &str,
    source: &str,
    env: &EnvLookup<'_>,
    read: &dyn Fn(&Path) -> std::io::Result<String>,
) -> Result<Vec<[u8; 32]>, Problem> {
    let text = resolve_key_source(path, source, env, read)?;
    parse_key_ring(&text).map_err(|message| Problem::error(path, message))
}

/// `Basic base64(user:password)`, the `Authorization` header value for HTTP Basic.
pub fn basic_authorization(user: &str, password: &str) -> String {
    let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    format!("Basic {token}")
}

/// The process environment, for [`resolve`] in production.
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// This machine's host name, the last fallback for the node id: the
/// kernel's, else `HOSTNAME`, else `localhost`.
pub fn system_hostname(env: &EnvLookup<'_>) -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .chain(env("HOSTNAME"))
        .map(|name| name.trim().to_string())
        .find(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// `proxy.admin`'s credentials as the proxy checks them (its defaults while
/// its admin API is enabled), with the `env:` and `file:` references the
/// proxy resolves itself resolved: what `run` falls back to without
/// `--admin-user` / `--admin-password`, and `status` without `--user` /
/// `--password`.
pub fn proxy_admin_credentials(
    config: &SbConfig,
    env: &EnvLookup<'_>,
) -> Result<Option<(String, String)>, Vec<Problem>> {
    let Some((user, password)) = config.proxy.admin.credentials() else {
        return Ok(None);
    };
    let read = |path: &Path| std::fs::read_to_string(path);
    let user = resolve_field("proxy.admin.username", &user, env, &read);
    let password = resolve_field("proxy.admin.password", &password, env, &read);
    match (user, password) {
        (Ok(user), Ok(password)) => Ok(Some((user, password))),
        (user, password) => Err(user.err().into_iter().chain(password.err()).collect()),
    }
}

fn parse_namespace(text: &str) -> Result<String, String> {
    let valid = text.len() <= 63
        && text
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !text.starts_with('-')
        && !text.ends_with('-');
    if valid {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{text:?} is not a namespace name; expected lowercase letters, digits and '-' (at most 63)"
        ))
    }
}

fn parse_header_value(text: &str) -> Result<String, String> {
    if hyper::header::HeaderValue::from_str(text).is_ok() {
        Ok(text.to_string())
    } else {
        Err(
            "the value contains a line break or another control character, which a header \
             cannot carry; expected e.g. \"Basic dXNlcjpwYXNz\" or \"Bearer <token>\""
                .to_string(),
        )
    }
}

fn parse_process_name(text: &str) -> Result<String, String> {
    // /proc/<pid>/comm holds at most 15 bytes of the executable's name.
    if text.is_empty() || text.len() > 15 || text.contains('/') {
        return Err(format!(
            "{text:?} is not a process name; expected the executable's name as /proc/<pid>/comm \
             shows it (1 to 15 characters, no '/'), such as sbproxy"
        ));
    }
    Ok(text.to_owned())
}

impl FlagValue for LogFormat {
    fn parse_flag(_: FlagKind, text: &str) -> Result<Self, String> {
        match text.to_ascii_lowercase().as_str() {
            "json" => Ok(LogFormat::Json),
            "text" => Ok(LogFormat::Text),
            _ => Err(format!(
                "{text:?} is not a log format; expected json or text"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const K1: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    const K2: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

    /// A temporary directory, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "sbmesh-settings-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        fn file(&self, name: &str, contents: &str) -> PathBuf {
            let path = self.0.join(name);
            std::fs::write(&path, contents).unwrap();
            path
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Where the settings POST reloads (always set for the sidecar).
    fn reload(s: &Settings) -> &ProxyReload {
        s.node
            .proxy
            .reload
            .as_ref()
            .expect("the sidecar POSTs reloads")
    }

    /// A config file, its run args and an environment, for one scenario.
    struct Case {
        dir: TempDir,
        args: RunArgs,
        env: HashMap<String, String>,
    }

    impl Case {
        fn new(yml: &str) -> Self {
            let dir = TempDir::new();
            let config = dir.file("sb.yml", yml);
            Case {
                dir,
                args: RunArgs {
                    config: Some(config),
                    ..RunArgs::default()
                },
                env: HashMap::new(),
            }
        }

        fn env(mut self, name: &str, value: &str) -> Self {
            self.env.insert(name.to_string(), value.to_string());
            self
        }

        fn args(mut self, edit: impl FnOnce(&mut RunArgs)) -> Self {
            edit(&mut self.args);
            self
        }

        fn resolve(&self) -> Result<Settings, Vec<Problem>> {
            let env = |name: &str| self.env.get(name).cloned();
            resolve(&self.args, &env, "host-a")
        }

        fn ok(&self) -> Settings {
            match self.resolve() {
                Ok(settings) => settings,
                Err(problems) => panic!("{}", crate::commands::render_problems(&problems)),
            }
        }

        fn problems(&self) -> Vec<String> {
            match self.resolve() {
                Ok(settings) => panic!("expected problems, got {settings:?}"),
                Err(problems) => problems.iter().map(ToString::to_string).collect(),
            }
        }
    }

    const CLUSTER_YML: &str = "
proxy:
  admin: { enabled: true, port: 9191, username: admin, password: secret }
  extensions:
    sbmesh:
      cluster_id: demo
      node_id: ${SBPROXY_POD_NAME}
      seeds: [\"demo-proxy-0.demo-mesh.default.svc.cluster.local\", \"10.0.0.9:7000\"]
      gossip_port: 7100
      transport_port: 8100
      shared_key: \"env:SBPROXY_CLUSTER_KEY\"
origins: { api.example.com: {} }
";

    #[test]
    fn the_reload_post_follows_the_proxys_admin_defaults() {
        // enabled, no credentials: the proxy checks admin / changeme
        let s = Case::new("proxy:\n  admin: { enabled: true, bind: 127.0.4.5, port: 9300 }\n").ok();
        assert_eq!(
            reload(&s).authorization.as_deref(),
            Some(basic_authorization("admin", "changeme").as_str())
        );
        assert_eq!(reload(&s).url, "http://127.0.4.5:9300/admin/reload");
        assert_eq!(
            s.node.proxy.restart.health_url,
            "http://127.0.4.5:9300/health"
        );
        let s = Case::new("proxy:\n  admin: { enabled: true, bind: 0.0.0.0 }\n").ok();
        assert_eq!(reload(&s).url, "http://127.0.0.1:9090/admin/reload");
        // disabled: nothing to authenticate against
        assert_eq!(reload(&Case::new("origins: {}\n").ok()).authorization, None);
    }

    #[test]
    fn san_warns_when_the_proxy_reads_another_pair() {
        let yml = |crt: &str, key: &str| {
            format!(
                "proxy:\n  https_bind_port: 8443\n  tls_cert_file: {crt}\n  tls_key_file: {key}\n  extensions:\n    sbmesh:\n      acme: {{ enabled: true, storage_backend: memory, certificates: san, apply: none }}\n"
            )
        };
        let ours = Case::new(&yml("/certs/tls.crt", "/certs/tls.key"))
            .env("SBMESH_CERT_DIR", "/certs")
            .ok();
        assert!(ours.warnings.is_empty(), "{:?}", ours.warnings);
        let other = Case::new(&yml("/etc/tls/tls.crt", "/certs/tls.key"))
            .env("SBMESH_CERT_DIR", "/certs")
            .ok();
        let paths: Vec<&str> = other.warnings.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(paths, ["proxy.tls_cert_file"]);
        assert!(other.warnings[0].message.contains("/certs/tls.crt"));
    }

    #[test]
    fn a_reload_that_cannot_serve_a_certificate_file_is_a_warning() {
        let yml = |apply: &str| {
            format!(
                "proxy:\n  admin: {{ enabled: true, username: a, password: a-long-secret }}\n  https_bind_port: 8443\n  tls_cert_file: /certs/tls.crt\n  tls_key_file: /certs/tls.key\n  extensions:\n    sbmesh:\n      acme: {{ enabled: true, storage_backend: memory, certificates: san{apply} }}\n"
            )
        };
        let cert_dir = |c: Case| c.env("SBMESH_CERT_DIR", "/certs").ok();
        for (apply, flag) in [
            ("", None),
            (", apply: reload", None),
            (", apply: restart", Some("reload")),
        ] {
            let mut case = Case::new(&yml(apply));
            if let Some(flag) = flag {
                case = case.env("SBMESH_PROXY_CERT_APPLY", flag);
            }
            let s = cert_dir(case);
            let paths: Vec<&str> = s.warnings.iter().map(|w| w.path.as_str()).collect();
            assert_eq!(paths, ["--proxy-cert-apply"], "{apply} {flag:?}");
            assert!(
                s.warnings[0].message.contains("acme.apply: restart"),
                "{}",
                s.warnings[0].message
            );
        }
        // restart, files only, or no certificate file: nothing to say
        for (apply, file) in [
            (", apply: restart", true),
            (", apply: none", true),
            ("", false),
        ] {
            let mut text = yml(apply);
            if !file {
                text = text.replace(
                    "  tls_cert_file: /certs/tls.crt\n  tls_key_file: /certs/tls.key\n",
                    "",
                );
            }
            let s = cert_dir(Case::new(&text));
            assert!(s.warnings.is_empty(), "{apply} {file}: {:?}", s.warnings);
        }
    }

    #[test]
    fn cert_apply_comes_from_the_flag_the_env_the_block_then_reload() {
        let yml = "proxy:\n  extensions:\n    sbmesh:\n      acme: { enabled: true, storage_backend: memory, apply: restart }\n";
        assert_eq!(
            Case::new(yml).ok().node.proxy.cert_apply,
            CertApply::Restart
        );
        assert_eq!(
            Case::new(yml)
                .env("SBMESH_PROXY_CERT_APPLY", "none")
                .ok()
                .node
                .proxy
                .cert_apply,
            CertApply::None
        );
        assert_eq!(
            Case::new("origins: {}\n").ok().node.proxy.cert_apply,
            CertApply::Reload
        );
        let problems = Case::new("origins: {}\n")
            .env("SBMESH_PROXY_CERT_APPLY", "hup")
            .problems();
        assert_eq!(
            problems,
            [
                "--proxy-cert-apply: \"hup\" is not one of: reload, restart, none (from --proxy-cert-apply or SBMESH_PROXY_CERT_APPLY)"
            ]
        );
        let problems = Case::new("origins: {}\n")
            .env("SBMESH_PROXY_PROCESS_NAME", "/usr/bin/sbproxy")
            .problems();
        assert!(
            problems[0].starts_with("--proxy-process-name: "),
            "{problems:?}"
        );
        let s = Case::new("origins: {}\n")
            .env("SBMESH_WATCH_TLS", "/etc/tls/a, /etc/tls/b")
            .ok();
        assert_eq!(
            s.node.proxy.watch_tls,
            [PathBuf::from("/etc/tls/a"), PathBuf::from("/etc/tls/b")]
        );
    }

    #[test]
    fn defaults() {
        let case = Case::new("origins: {}\n");
        let s = case.ok();
        assert_eq!(s.node.config, SbConfig::default());
        assert_eq!(
            s.node.config_sha256,
            Some(sbmesh::sha256_hex(b"origins: {}\n"))
        );
        assert_eq!(s.node.node_id, "host-a");
        assert_eq!(s.node.cluster_id, "sbmesh");
        assert_eq!(s.node.mesh_service, None);
        assert!(s.node.seeds.is_empty());
        assert_eq!(s.node.bind, IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        assert_eq!(s.node.gossip_port, 7946);
        assert_eq!(s.node.transport_port, 8946);
        assert_eq!(s.node.advertise, None);
        assert_eq!(s.node.cluster_key, None);
        assert_eq!(s.node.cluster_key_file, None);
        assert_eq!(s.node.admin_listen, Some("0.0.0.0:9091".parse().unwrap()));
        assert_eq!(s.node.admin_user, None);
        assert_eq!(s.node.admin_password, None);
        assert_eq!(
            s.node.challenge_listen,
            Some("0.0.0.0:8089".parse().unwrap())
        );
        assert_eq!(s.node.challenge_passthrough, None);
        assert_eq!(reload(&s).url, "http://127.0.0.1:9090/admin/reload");
        assert_eq!(reload(&s).authorization, None);
        assert_eq!(s.node.cert_dir, Path::new("/var/lib/sbproxy/certs"));
        assert_eq!(s.node.state_dir, Path::new("/var/lib/sbproxy/sidecar"));
        assert_eq!(s.shutdown_grace, Duration::from_secs(30));
        assert_eq!(s.node.reload.debounce, Duration::from_millis(200));
        assert_eq!(s.node.reload.rescan, Duration::from_secs(30));
        assert_eq!(s.node.acme.order_lock_ttl, Duration::from_secs(60));
        assert_eq!(s.node.acme.max_orders, 300);
        assert_eq!(s.node.acme.orders_interval, Duration::from_secs(3 * 3600));
        assert_eq!(s.node.acme.concurrent_orders, 8);
        assert_eq!(s.node.proxy.cert_apply, CertApply::Reload);
        assert_eq!(s.node.proxy.restart.process_name, "sbproxy");
        assert_eq!(
            s.node.proxy.restart.health_url,
            "http://127.0.0.1:9090/health"
        );
        assert_eq!(s.node.proxy.restart.min_interval, Duration::from_secs(600));
        assert!(s.node.proxy.watch_tls.is_empty());
        let expected_format = if std::io::stderr().is_terminal() {
            LogFormat::Text
        } else {
            LogFormat::Json
        };
        assert_eq!(s.log_format, expected_format);
    }

    #[test]
    fn config_path_from_env_and_default() {
        let case = Case::new("origins: {}\n");
        let path = case.args.config.clone().unwrap();
        let case = case
            .args(|a| a.config = None)
            .env("SBMESH_CONFIG", path.to_str().unwrap());
        assert_eq!(case.ok().node.config_path, Some(path));

        let case = case.args(|a| a.config = None);
        let env = |_: &str| None;
        let problems = resolve(&case.args, &env, "h").unwrap_err();
        if !Path::new(sbmesh::DEFAULT_CONFIG_PATH).exists() {
            assert_eq!(problems[0].path, sbmesh::DEFAULT_CONFIG_PATH);
        }
    }

    #[test]
    fn values_from_sb_yml() {
        let case = Case::new(CLUSTER_YML)
            .env("SBPROXY_POD_NAME", "demo-proxy-1")
            .env("SBPROXY_CLUSTER_KEY", &format!("{K1},{K2}"));
        let s = case.ok();
        assert_eq!(s.node.node_id, "demo-proxy-1");
        assert_eq!(s.node.cluster_id, "demo");
        assert_eq!(s.node.gossip_port, 7100);
        assert_eq!(s.node.transport_port, 8100);
        assert_eq!(
            s.node.seeds,
            [
                "demo-proxy-0.demo-mesh.default.svc.cluster.local:7100",
                "10.0.0.9:7000"
            ]
        );
        let ring = s.node.cluster_key.clone().unwrap();
        assert_eq!(ring.len(), 2);
        assert_eq!(ring[0][1], 1);
        assert_eq!(ring[1][0], 0xff);
        assert_eq!(s.node.admin_user.as_deref(), Some("admin"));
        assert_eq!(s.node.admin_password.as_deref(), Some("secret"));
        assert_eq!(reload(&s).url, "http://127.0.0.1:9191/admin/reload");
        assert_eq!(
            reload(&s).authorization.as_deref(),
            Some("Basic YWRtaW46c2VjcmV0")
        );
    }

    #[test]
    fn precedence_flag_over_env_over_yml_over_default() {
        // (flag, env, expected gossip port)
        let yml = "proxy:\n  extensions:\n    sbmesh: { gossip_port: 7000 }\n";
        let cases = [
            (None, None, 7000),
            (None, Some("7100"), 7100),
            (Some("7200"), Some("7100"), 7200),
            (Some("7200"), None, 7200),
        ];
        for (flag, env, expected) in cases {
            let mut case = Case::new(yml).args(|a| a.gossip_port = flag.map(str::to_string));
            if let Some(env) = env {
                case = case.env("SBMESH_GOSSIP_PORT", env);
            }
            assert_eq!(case.ok().node.gossip_port, expected, "{flag:?} {env:?}");
        }
        assert_eq!(Case::new("origins:\n").ok().node.gossip_port, 7946);

        // string-valued settings, same ladder
        let yml = "proxy:\n  admin: { username: yml-user, password: yml-pw }\n  extensions:\n    sbmesh: { cluster_id: yml-id, node_id: yml-node, advertise_addr: 10.0.0.1 }\n";
        let s = Case::new(yml).ok();
        assert_eq!(
            (
                s.node.cluster_id.as_str(),
                s.node.node_id.as_str(),
                s.node.admin_user.as_deref()
            ),
            ("yml-id", "yml-node", Some("yml-user"))
        );
        assert_eq!(s.node.advertise, Some("10.0.0.1:7946".parse().unwrap()));
        let case = Case::new(yml)
            .env("SBMESH_CLUSTER_ID", "env-id")
            .env("SBMESH_NODE_ID", "env-node")
            .env("SBMESH_ADMIN_USER", "env-user")
            .env("SBMESH_ADVERTISE", "10.0.0.2");
        let s = case.ok();
        assert_eq!(
            (
                s.node.cluster_id.as_str(),
                s.node.node_id.as_str(),
                s.node.admin_user.as_deref()
            ),
            ("env-id", "env-node", Some("env-user"))
        );
        assert_eq!(s.node.advertise, Some("10.0.0.2:7946".parse().unwrap()));
        let s = case
            .args(|a| {
                a.cluster_id = Some("flag-id".into());
                a.node_id = Some("flag-node".into());
                a.admin_user = Some("flag-user".into());
                a.advertise = Some("10.0.0.3:9".into());
            })
            .ok();
        assert_eq!(
            (
                s.node.cluster_id.as_str(),
                s.node.node_id.as_str(),
                s.node.admin_user.as_deref()
            ),
            ("flag-id", "flag-node", Some("flag-user"))
        );
        assert_eq!(s.node.advertise, Some("10.0.0.3:9".parse().unwrap()));
        // the password still comes from the file: each key has its own ladder
        assert_eq!(s.node.admin_password.as_deref(), Some("yml-pw"));
    }

    #[test]
    fn empty_values_fall_through() {
        let case = Case::new("proxy:\n  extensions:\n    sbmesh: { gossip_port: 7000 }\n")
            .env("SBMESH_GOSSIP_PORT", "")
            .args(|a| a.transport_port = Some(String::new()));
        let s = case.ok();
        assert_eq!(s.node.gossip_port, 7000);
        assert_eq!(s.node.transport_port, 8946);
    }

    #[test]
    fn identity_from_the_pod() {
        let s = Case::new("origins: {}\n")
            .env("SBPROXY_POD_NAME", "web-proxy-3")
            .env("SBPROXY_POD_IP", "10.1.2.3")
            .env("SBMESH_NAMESPACE", "prod")
            .env("SBMESH_MESH_SERVICE", "web-mesh")
            .env("SBMESH_CLUSTER_KEY", K1)
            .ok();
        assert_eq!(s.node.node_id, "web-proxy-3");
        assert_eq!(s.node.cluster_id, "web-proxy");
        assert_eq!(
            s.node.mesh_service.as_deref(),
            Some("web-mesh.prod.svc.cluster.local")
        );
        assert_eq!(s.node.advertise, Some("10.1.2.3:7946".parse().unwrap()));

        // not a StatefulSet pod: the fallback cluster id
        let s = Case::new("origins: {}\n")
            .env("SBPROXY_POD_NAME", "laptop")
            .ok();
        assert_eq!(s.node.cluster_id, "sbmesh");
        assert_eq!(s.node.node_id, "laptop");
    }

    #[test]
    fn advertise_fallbacks() {
        // bind IP when it is specific
        let s = Case::new("origins: {}\n")
            .env("SBMESH_BIND", "10.9.9.9")
            .ok();
        assert_eq!(s.node.bind, "10.9.9.9".parse::<IpAddr>().unwrap());
        assert_eq!(s.node.advertise, Some("10.9.9.9:7946".parse().unwrap()));
        // pod IP wins over bind; the gossip port follows the flag
        let s = Case::new("origins: {}\n")
            .env("SBMESH_BIND", "::")
            .env("SBPROXY_POD_IP", "fd00::7")
            .env("SBMESH_GOSSIP_PORT", "7001")
            .ok();
        assert_eq!(s.node.advertise, Some("[fd00::7]:7001".parse().unwrap()));
        // unspecified bind and no pod IP: the runtime picks
        let s = Case::new("origins: {}\n").env("SBMESH_BIND", "::").ok();
        assert_eq!(s.node.advertise, None);
        // --advertise with and without a port
        let s = Case::new("origins: {}\n")
            .args(|a| a.advertise = Some("[fd00::9]".into()))
            .ok();
        assert_eq!(s.node.advertise, Some("[fd00::9]:7946".parse().unwrap()));
    }

    #[test]
    fn mesh_service_and_seeds() {
        let s = Case::new("origins: {}\n")
            .env("SBMESH_MESH_SERVICE", "demo-mesh")
            .env("SBMESH_NAMESPACE", "edge")
            .env("SBMESH_CLUSTER_DOMAIN", "corp.internal")
            .env("SBMESH_SEEDS", " a , b:7001,[fd00::1],10.0.0.1,a ")
            .env("SBMESH_CLUSTER_KEY", K1)
            .ok();
        assert_eq!(
            s.node.mesh_service.as_deref(),
            Some("demo-mesh.edge.svc.corp.internal")
        );
        // duplicates dropped, order kept
        assert_eq!(
            s.node.seeds,
            ["a:7946", "b:7001", "[fd00::1]:7946", "10.0.0.1:7946"]
        );
        assert_eq!(
            s.node.cluster_key,
            Some(vec![parse_key_ring(K1).unwrap()[0]])
        );

        // --seeds replaces sbmesh.seeds, it does not add to them
        let s = Case::new("proxy:\n  extensions:\n    sbmesh: { seeds: [yml-seed] }\n")
            .env("SBMESH_SEEDS", "flag-seed")
            .env("SBMESH_CLUSTER_KEY", K1)
            .ok();
        assert_eq!(s.node.seeds, ["flag-seed:7946"]);
    }

    #[test]
    fn seeds_or_service_without_a_key_is_refused() {
        for case in [
            Case::new("origins: {}\n").env("SBMESH_SEEDS", "a"),
            Case::new("origins: {}\n").env("SBMESH_MESH_SERVICE", "demo-mesh"),
            Case::new("proxy:\n  extensions:\n    sbmesh: { seeds: [a] }\n"),
        ] {
            let problems = case.problems();
            assert_eq!(problems.len(), 1, "{problems:#?}");
            let p = &problems[0];
            assert!(
                p.starts_with("--cluster-key: the mesh has peers to contact"),
                "{p}"
            );
            for name in [
                "--cluster-key",
                "SBMESH_CLUSTER_KEY",
                "--cluster-key-file",
                "proxy.extensions.sbmesh.shared_key",
                "`sbmesh-sidecar keygen`",
            ] {
                assert!(p.contains(name), "{name} missing from {p}");
            }
        }
        // alone, no key is needed
        assert_eq!(Case::new("origins: {}\n").ok().node.cluster_key, None);
    }

    #[test]
    fn key_sources() {
        // literal flag
        let s = Case::new("origins: {}\n")
            .args(|a| a.cluster_key = Some(format!("{K2},{K1}")))
            .ok();
        assert_eq!(s.node.cluster_key.unwrap()[0][0], 0xff);
        // env: in the flag
        let s = Case::new("origins: {}\n")
            .args(|a| a.cluster_key = Some("env:MY_KEY".into()))
            .env("MY_KEY", K1)
            .ok();
        assert_eq!(s.node.cluster_key.unwrap().len(), 1);
        // file: in sb.yml
        let case = Case::new("origins: {}\n");
        let key_path = case.dir.file("key", &format!("{K1}\n"));
        let yml = format!(
            "proxy:\n  extensions:\n    sbmesh: {{ shared_key: \"file:{}\" }}\n",
            key_path.display()
        );
        std::fs::write(case.args.config.as_ref().unwrap(), yml).unwrap();
        assert_eq!(case.ok().node.cluster_key.unwrap().len(), 1);
        // literal in sb.yml
        let s = Case::new(&format!(
            "proxy:\n  extensions:\n    sbmesh: {{ shared_key: \"{K1}\" }}\n"
        ))
        .ok();
        assert_eq!(s.node.cluster_key.unwrap().len(), 1);
        // the flag wins over sb.yml
        let s = Case::new(&format!(
            "proxy:\n  extensions:\n    sbmesh: {{ shared_key: \"{K1}\" }}\n"
        ))
        .env("SBMESH_CLUSTER_KEY", K2)
        .ok();
        assert_eq!(s.node.cluster_key.unwrap()[0][0], 0xff);
    }

    #[test]
    fn key_file_is_a_ring_primary_first() {
        let case = Case::new(&format!(
            "proxy:\n  extensions:\n    sbmesh: {{ shared_key: \"{K1}\" }}\n"
        ));
        let key_file = case
            .dir
            .file("ring", &format!("# rotated in\n{K2}\n\n{K1}\n"));
        let case = case.env("SBMESH_CLUSTER_KEY_FILE", key_file.to_str().unwrap());
        let s = case.ok();
        assert_eq!(s.node.cluster_key_file.as_deref(), Some(key_file.as_path()));
        let ring = s.node.cluster_key.clone().unwrap();
        assert_eq!(ring.len(), 2);
        assert_eq!(ring[0][0], 0xff);
    }

    #[test]
    fn an_unset_variable_in_an_overridden_shared_key_is_not_a_problem() {
        // The operator's pods read the key from a file; a config written for
        // the environment form still passes there, and fails only where the
        // shared key is what the sidecar uses.
        let text = "proxy:\n  extensions:\n    sbmesh: { shared_key: \"${SBMESH_CLUSTER_KEY}\" }\n";
        let case = Case::new(text);
        let key_file = case.dir.file("ring", &format!("{K2}\n"));
        let s = case
            .env("SBMESH_CLUSTER_KEY_FILE", key_file.to_str().unwrap())
            .ok();
        assert_eq!(s.node.cluster_key.unwrap()[0][0], 0xff);
        let problems = Case::new(text).problems();
        assert_eq!(
            problems.last().map(String::as_str),
            Some(
                "proxy.extensions.sbmesh.shared_key: uses ${SBMESH_CLUSTER_KEY}, but the environment variable SBMESH_CLUSTER_KEY is not set; set it, or write ${SBMESH_CLUSTER_KEY:-default}"
            ),
            "{problems:#?}"
        );
    }

    #[test]
    fn key_problems() {
        let case = Case::new("origins: {}\n")
            .args(|a| a.cluster_key = Some(K1.into()))
            .env("SBMESH_CLUSTER_KEY_FILE", "/some/file");
        let problems = case.problems();
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert!(
            problems[0].starts_with("--cluster-key: both --cluster-key"),
            "{}",
            problems[0]
        );

        let problems = Case::new("origins: {}\n")
            .env("SBMESH_CLUSTER_KEY", "nothex")
            .problems();
        assert_eq!(
            problems,
            [
                "--cluster-key: expected 64 hex characters (32 bytes), as printed by `sbmesh-sidecar keygen`; found 6 characters (from --cluster-key or SBMESH_CLUSTER_KEY)"
            ]
        );

        let problems = Case::new("origins: {}\n")
            .args(|a| a.cluster_key_file = Some("/nonexistent/ring".into()))
            .env("SBMESH_SEEDS", "a")
            .problems();
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert!(
            problems[0].starts_with("--cluster-key-file: cannot read /nonexistent/ring: "),
            "{}",
            problems[0]
        );

        let case = Case::new("origins: {}\n");
        let empty = case.dir.file("empty", "# nothing yet\n");
        let problems = case
            .args(|a| a.cluster_key_file = Some(empty.clone()))
            .problems();
        assert!(problems[0].contains(": no key found;"), "{}", problems[0]);

        let problems = Case::new(
            "proxy:\n  extensions:\n    sbmesh:\n      seeds: [a]\n      shared_key: \"env:UNSET_KEY\"\n",
        )
        .problems();
        assert_eq!(
            problems,
            [
                "proxy.extensions.sbmesh.shared_key: environment variable UNSET_KEY (named by env:UNSET_KEY) is not set or empty"
            ]
        );
    }

    /// Each flag of the table, given a value its kind refuses, by flag and
    /// by variable: the problem names that flag and that variable, so each
    /// is parsed as its kind says and read from its own field.
    #[test]
    fn every_flag_is_parsed_as_its_kind() {
        use clap::Parser as _;
        let checked: Vec<&Flag> = Flag::RUN
            .iter()
            .filter(|f| f.kind.invalid_example().is_some())
            .collect();
        assert!(checked.len() > 20, "{} flags checked", checked.len());
        for flag in checked {
            let bad = flag.kind.invalid_example().unwrap();
            let expected = format!("{}: ", flag.flag());
            let from_env = Case::new("origins: {}\n").env(flag.env, bad).problems();
            assert!(
                from_env
                    .iter()
                    .any(|p| p.starts_with(&expected) && p.contains(flag.env)),
                "{} = {bad:?}: {from_env:?}",
                flag.env
            );

            let case = Case::new("origins: {}\n");
            let config = case.args.config.clone().unwrap();
            let mut argv: Vec<std::ffi::OsString> =
                vec!["sbmesh-sidecar".into(), "run".into(), "--config".into()];
            argv.extend([config.into_os_string(), flag.flag().into(), bad.into()]);
            let cli = crate::cli::Cli::try_parse_from(argv).unwrap();
            let crate::cli::Command::Run(args) = cli.command else {
                panic!("not run");
            };
            let from_flag = case.args(|a| *a = *args).problems();
            assert!(
                from_flag.iter().any(|p| p.starts_with(&expected)),
                "{} {bad:?}: {from_flag:?}",
                flag.flag()
            );
        }
    }

    #[test]
    fn every_bad_flag_is_reported_at_once() {
        let case = Case::new("origins: {}\n").args(|a| {
            a.pod_ip = Some("ten".into());
            a.namespace = Some("Prod".into());
            a.node_id = Some("a b".into());
            a.cluster_id = Some("x/y".into());
            a.gossip_port = Some("abc".into());
            a.transport_port = Some("0".into());
            a.bind = Some("any".into());
            a.advertise = Some("0.0.0.0".into());
            a.seeds = Some("udp://x".into());
            a.admin_listen = Some("9091".into());
            a.challenge_listen = Some("localhost:8089".into());
            a.proxy_reload_url = Some("127.0.0.1:9090/admin/reload".into());
            a.proxy_authorization = Some("Basic a\nb".into());
            a.log_format = Some("xml".into());
            a.shutdown_grace_ms = Some("30s".into());
            a.mesh_service = Some("bad service".into());
            a.cluster_key = Some(K1.into());
        });
        let problems = case.problems();
        let paths: Vec<&str> = problems
            .iter()
            .map(|p| p.split_once(": ").unwrap().0)
            .collect();
        assert_eq!(
            paths,
            [
                "--pod-ip",
                "--namespace",
                "--node-id",
                "--cluster-id",
                "--gossip-port",
                "--transport-port",
                "--mesh-service",
                "--seeds",
                "--bind",
                "--advertise",
                "--admin-listen",
                "--challenge-listen",
                "--proxy-reload-url",
                "--proxy-authorization",
                "--log-format",
                "--shutdown-grace-ms",
            ],
            "{problems:#?}"
        );
        let text = problems.join("\n");
        for expected in [
            "--pod-ip: \"ten\" is not an IP address; expected e.g. 10.0.0.5 or fd00::5 (from --pod-ip or SBPROXY_POD_IP)",
            "--gossip-port: \"abc\" is not a port; expected a number from 1 to 65535 (from --gossip-port or SBMESH_GOSSIP_PORT)",
            "--node-id: node id \"a b\" contains ' '",
            "--log-format: \"xml\" is not a log format; expected json or text (from --log-format or SBMESH_LOG_FORMAT)",
            "--shutdown-grace-ms: \"30s\" is not a number of milliseconds; expected e.g. 30000 (from --shutdown-grace-ms or SBPROXY_SHUTDOWN_GRACE_MS)",
            "--advertise: \"0.0.0.0\" is unspecified",
            "--mesh-service: \"bad service.default.svc.cluster.local\" is not a DNS name",
        ] {
            assert!(text.contains(expected), "{expected}\nnot in\n{text}");
        }
    }

    #[test]
    fn file_problems_and_flag_problems_together() {
        let case = Case::new(
            "proxy:\n  extensions:\n    sbmesh:\n      acme: { storage_backend: sqlite }\n",
        )
        .env("SBMESH_GOSSIP_PORT", "x");
        let problems = case.problems();
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(
            problems[0]
                .starts_with("proxy.extensions.sbmesh.acme.storage_backend: unsupported backend")
        );
        assert!(problems[1].starts_with("--gossip-port: "));

        let problems = Case::new("origins: {}\n")
            .args(|a| a.config = Some("/nonexistent/sb.yml".into()))
            .problems();
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].starts_with("/nonexistent/sb.yml: cannot read: "),
            "{}",
            problems[0]
        );
    }

    #[test]
    fn invalid_ids_from_file_or_pod() {
        let problems = Case::new("origins: {}\n")
            .env("SBPROXY_POD_NAME", "a b-0")
            .problems();
        assert_eq!(problems.len(), 2, "{problems:#?}");
        assert!(
            problems[0].starts_with("--pod-name: used as the node id: node id \"a b-0\""),
            "{}",
            problems[0]
        );
        assert!(
            problems[1].starts_with(
                "--pod-name: its StatefulSet part, used as the cluster id: cluster id \"a b\""
            ),
            "{}",
            problems[1]
        );

        let env = |_: &str| None;
        let problems = resolve(&Case::new("origins: {}\n").args, &env, "").unwrap_err();
        assert!(
            problems[0]
                .to_string()
                .starts_with("--node-id: no node id is set and the host name cannot be one"),
            "{:?}",
            problems
        );
    }

    #[test]
    fn admin_credentials_go_together() {
        let problems = Case::new("origins: {}\n")
            .env("SBMESH_ADMIN_USER", "u")
            .problems();
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].starts_with("--admin-password: an admin user is set"),
            "{}",
            problems[0]
        );
        // The proxy's default user goes with a password written alone.
        let s = Case::new("proxy:\n  admin: { password: p }\n").ok();
        assert_eq!(
            (
                s.node.admin_user.as_deref(),
                s.node.admin_password.as_deref()
            ),
            (Some("admin"), Some("p"))
        );
        // env: and file: references, resolved as the proxy resolves them.
        let s = Case::new("proxy:\n  admin: { enabled: true, password: \"env:ADMIN_PW\" }\n")
            .env("ADMIN_PW", "from-env")
            .ok();
        assert_eq!(
            reload(&s).authorization.as_deref(),
            Some(basic_authorization("admin", "from-env").as_str())
        );
        let problems =
            Case::new("proxy:\n  admin: { enabled: true, password: \"env:ADMIN_PW\" }\n")
                .problems();
        assert_eq!(
            problems,
            [
                "proxy.admin.password: names the environment variable ADMIN_PW (env:ADMIN_PW), which is not set"
            ]
        );
        let problems = Case::new("origins: {}\n")
            .env("SBMESH_ADMIN_USER", "a:b")
            .env("SBMESH_ADMIN_PASSWORD", "p")
            .problems();
        assert!(
            problems[0].starts_with("--admin-user: the user must not contain ':'"),
            "{}",
            problems[0]
        );
        let s = Case::new("origins: {}\n")
            .env("SBMESH_ADMIN_USER", "u")
            .env("SBMESH_ADMIN_PASSWORD", "p")
            .ok();
        assert_eq!(
            (
                s.node.admin_user.as_deref(),
                s.node.admin_password.as_deref()
            ),
            (Some("u"), Some("p"))
        );
        // the sidecar's own credentials do not become the proxy's
        assert_eq!(reload(&s).authorization, None);
    }

    #[test]
    fn reload_target_overrides() {
        let s = Case::new("proxy:\n  admin: { port: 9191, username: a, password: b }\n")
            .env(
                "SBMESH_PROXY_RELOAD_URL",
                "https://proxy.local:9443/admin/reload",
            )
            .env("SBMESH_PROXY_AUTHORIZATION", "Bearer t0k")
            .ok();
        assert_eq!(reload(&s).url, "https://proxy.local:9443/admin/reload");
        assert_eq!(reload(&s).authorization.as_deref(), Some("Bearer t0k"));
    }

    /// `--challenge-passthrough`: off unless set (empty is off), flag over
    /// environment, and anything but `http://host:port` refused at start,
    /// naming the flag, its variable and what is accepted.
    #[test]
    fn challenge_passthrough_is_an_http_host_port_url() {
        let passthrough = |s: Settings| s.node.challenge_passthrough.map(|u| u.to_string());
        assert_eq!(passthrough(Case::new("origins: {}\n").ok()), None);
        let off = Case::new("origins: {}\n")
            .env("SBMESH_CHALLENGE_PASSTHROUGH", "")
            .ok();
        assert_eq!(passthrough(off), None);
        let from_env = Case::new("origins: {}\n")
            .env("SBMESH_CHALLENGE_PASSTHROUGH", "http://127.0.0.1:8080")
            .ok();
        assert_eq!(
            passthrough(from_env).as_deref(),
            Some("http://127.0.0.1:8080")
        );
        let flag_wins = Case::new("origins: {}\n")
            .env("SBMESH_CHALLENGE_PASSTHROUGH", "http://127.0.0.1:8080")
            .args(|a| a.challenge_passthrough = Some("http://localhost:8000/".into()))
            .ok();
        assert_eq!(
            passthrough(flag_wins).as_deref(),
            Some("http://localhost:8000")
        );

        for bad in [
            "https://127.0.0.1:8443",
            "127.0.0.1:8080",
            "http://127.0.0.1:8080/app",
        ] {
            let problems = Case::new("origins: {}\n")
                .args(|a| a.challenge_passthrough = Some(bad.into()))
                .problems();
            assert_eq!(problems.len(), 1, "{bad}: {problems:?}");
            let p = &problems[0];
            assert!(
                p.starts_with(&format!(
                    "--challenge-passthrough: {bad:?} is not an http://host:port URL: "
                )) && p.contains("e.g. http://127.0.0.1:8080")
                    && p.ends_with(
                        "(from --challenge-passthrough or SBMESH_CHALLENGE_PASSTHROUGH)"
                    ),
                "{p}"
            );
        }
    }

    #[test]
    fn other_flags() {
        let s = Case::new("origins: {}\n")
            .args(|a| {
                a.admin_listen = Some("[::]:9999".into());
                a.challenge_listen = Some("127.0.0.1:80".into());
                a.cert_dir = Some("/certs".into());
                a.log_format = Some("TEXT".into());
                a.shutdown_grace_ms = Some("1500".into());
            })
            .env("SBMESH_STATE_DIR", "/state")
            .ok();
        assert_eq!(s.node.admin_listen, Some("[::]:9999".parse().unwrap()));
        assert_eq!(
            s.node.challenge_listen,
            Some("127.0.0.1:80".parse().unwrap())
        );
        assert_eq!(s.node.cert_dir, Path::new("/certs"));
        assert_eq!(s.node.state_dir, Path::new("/state"));
        assert_eq!(s.log_format, LogFormat::Text);
        assert_eq!(s.shutdown_grace, Duration::from_millis(1500));
    }

    #[test]
    fn secrets_stay_out_of_debug() {
        let s = Case::new("proxy:\n  admin: { username: a, password: pw-secret }\n")
            .env("SBMESH_CLUSTER_KEY", K1)
            .env("SBMESH_ADMIN_PASSWORD", "admin-secret")
            .ok();
        let debug = format!("{s:?}");
        for secret in [
            "pw-secret",
            "admin-secret",
            K1,
            "YTpwdy1zZWNyZXQ",
            "[0, 1, 2",
        ] {
            assert!(!debug.contains(secret), "{secret} in {debug}");
        }
        assert!(debug.contains("<1 key(s) redacted>"));
    }

    #[test]
    fn basic_header() {
        assert_eq!(
            basic_authorization("admin", "secret"),
            "Basic YWRtaW46c2VjcmV0"
        );
        assert_eq!(basic_authorization("ü", ""), "Basic w7w6");
    }

    #[test]
    fn hostname_fallback() {
        assert!(!system_hostname(&|_| None).is_empty());
    }
}
