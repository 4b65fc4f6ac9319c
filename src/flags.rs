//! The flags of `sbmesh-sidecar run`: each one's long name, environment
//! variable, value name, kind, default and meaning, written once.
//!
//! Everything that names a flag reads it from here: the sidecar's command
//! line (clap is built from `Flag::RUN`), its settings resolution (a problem
//! names `--flag` and `ENV` from the entry), its tests (they iterate
//! `Flag::RUN`), the operator (the environment it gives the sidecar container)
//! and the documentation ([`Flag::markdown_table`], which a test compares with
//! `docs/reference.md`). Precedence is the sidecar's: flag > environment >
//! `sb.yml` > default; a default here is the last of those.
//!
//! ```
//! use sbmesh::Flag;
//!
//! assert_eq!(Flag::GOSSIP_PORT.flag(), "--gossip-port");
//! assert_eq!(Flag::GOSSIP_PORT.env, "SBMESH_GOSSIP_PORT");
//! assert_eq!(Flag::by_env("SBMESH_GOSSIP_PORT"), Some(&Flag::GOSSIP_PORT));
//! assert!(Flag::markdown_table().contains("| `--gossip-port` | `SBMESH_GOSSIP_PORT` |"));
//! ```
//!
//! Each default is a typed constant here, and the parts of [`crate::node`]
//! take theirs from it (ports are `sb.yml`'s and live in [`crate::config`]);
//! [`FlagValue`] reads a flag's text as the type of its setting. This
//! module imports nothing from the parts that use it.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use crate::config::{
    CertApply, DEFAULT_GOSSIP_PORT, DEFAULT_PROXY_ADMIN_PORT, DEFAULT_TRANSPORT_PORT, DNS_PORT,
};

/// The default `--config`: where sbproxy's image keeps `sb.yml`.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/sbproxy/sb.yml";
/// The default `--namespace`.
pub const DEFAULT_NAMESPACE: &str = "default";
/// The default `--cluster-domain`: Kubernetes' default DNS domain.
pub const DEFAULT_CLUSTER_DOMAIN: &str = "cluster.local";
/// The default `--bind`: every IPv4 address.
pub(crate) const DEFAULT_BIND: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
/// The default `--admin-listen`.
pub const DEFAULT_ADMIN_LISTEN: SocketAddr = SocketAddr::new(DEFAULT_BIND, 9091);
/// The default `--challenge-listen`.
pub const DEFAULT_CHALLENGE_LISTEN: SocketAddr = SocketAddr::new(DEFAULT_BIND, 8089);
/// The default `--cert-dir`.
pub(crate) const DEFAULT_CERT_DIR: &str = "/var/lib/sbproxy/certs";
/// The default `--state-dir`.
pub(crate) const DEFAULT_STATE_DIR: &str = "/var/lib/sbproxy/sidecar";
/// The default `--shutdown-grace-ms`.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_millis(30_000);
/// The default `--proxy-process-name`: sbproxy's `/proc/<pid>/comm`.
pub(crate) const DEFAULT_PROXY_PROCESS_NAME: &str = "sbproxy";
/// The default `--reload-debounce-ms`: the wait after a config file event
/// before it is read, so an editor's several writes make one reload.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(200);
/// The default `--reload-rescan-secs`: the full re-read that catches what
/// inotify missed (a ConfigMap's `..data` swap on some kernels).
pub(crate) const DEFAULT_RESCAN: Duration = Duration::from_secs(30);
/// The default `--acme-concurrent-orders`: orders one replica runs at once.
pub(crate) const DEFAULT_ACME_CONCURRENT_ORDERS: usize = 8;
/// The default `--acme-max-orders`: new orders the whole cluster may place
/// per account and interval (well under Let's Encrypt's 300 per 3 hours).
pub(crate) const DEFAULT_ACME_MAX_ORDERS: u32 = 300;
/// The default `--acme-orders-interval-secs`: the interval of
/// [`DEFAULT_ACME_MAX_ORDERS`].
pub(crate) const DEFAULT_ACME_ORDERS_INTERVAL: Duration = Duration::from_secs(3 * 3600);
/// The default `--acme-order-lock-ttl-secs`: a replica that dies mid-order
/// blocks the host for at most this long.
pub(crate) const DEFAULT_ACME_ORDER_LOCK_TTL: Duration = Duration::from_secs(60);
/// The default `--proxy-restart-interval-secs`: at most one restart per pod
/// per 10 minutes.
pub(crate) const DEFAULT_PROXY_RESTART_INTERVAL: Duration = Duration::from_secs(600);

/// One flag of `run` and the environment variable that stands in for it.
#[derive(Debug, PartialEq, Eq)]
pub struct Flag {
    /// The long name without its dashes: `gossip-port`.
    pub long: &'static str,
    /// The environment variable: `SBMESH_GOSSIP_PORT`.
    pub env: &'static str,
    /// What `--help` shows as the value: `PORT`.
    pub value_name: &'static str,
    /// The form of the value, which decides how it is parsed.
    pub kind: FlagKind,
    /// What applies when neither the flag nor the variable is set.
    pub default: FlagDefault,
    /// What it does, one line.
    pub help: &'static str,
}

impl Flag {
    /// The flag as typed: `--gossip-port`.
    pub fn flag(&self) -> String {
        format!("--{}", self.long)
    }

    /// The flag and its variable, as messages name them:
    /// `--gossip-port / SBMESH_GOSSIP_PORT`.
    pub fn names(&self) -> String {
        format!("--{} / {}", self.long, self.env)
    }

    /// The default in words, `None` when there is none.
    pub(crate) fn default_text(&self) -> Option<String> {
        self.default.text()
    }

    /// The line `--help` shows: the meaning, then `[default: ...]`.
    pub fn help_line(&self) -> String {
        match self.default_text() {
            Some(default) => format!("{} [default: {default}]", self.help),
            None => self.help.to_owned(),
        }
    }

    /// Whether the value is a secret: `--help` never shows it from the
    /// environment.
    pub fn is_secret(&self) -> bool {
        self.kind == FlagKind::Secret
    }
}

/// The form of a flag's value; the sidecar parses each kind with one parser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlagKind {
    /// Free text.
    Text,
    /// A name with rules (a namespace, a node id, a DNS name, a process name).
    Name,
    /// A file or directory.
    Path,
    /// Several directories: the flag repeated, or a comma-separated list.
    Paths,
    /// A comma-separated list.
    List,
    /// An IP address.
    Ip,
    /// An IP address, with or without a port.
    IpPort,
    /// A port, 1 to 65535.
    Port,
    /// An `ip:port` to listen on.
    Listen,
    /// An `http://` or `https://` URL.
    Url,
    /// An `http://host:port` URL and nothing more: where requests are
    /// passed, each with its own path.
    HttpOrigin,
    /// A number of milliseconds.
    Millis,
    /// A positive number of seconds.
    Secs,
    /// A positive whole number.
    Count,
    /// One of a few words, listed in the help.
    Choice,
    /// A secret (a key, a password, a header value): never shown.
    Secret,
}

impl FlagKind {
    /// A value of the right shape for no flag of this kind, for tests that
    /// check each flag is parsed as its kind says; `None` for kinds that
    /// accept any text. Not part of the API.
    #[doc(hidden)]
    pub fn invalid_example(self) -> Option<&'static str> {
        match self {
            FlagKind::Name => Some("not/a/name"),
            FlagKind::Ip => Some("10.0.0"),
            FlagKind::IpPort => Some("10.0.0:7946"),
            FlagKind::Port => Some("65536"),
            FlagKind::Listen => Some("9091"),
            FlagKind::Url => Some("ftp://example.com/"),
            FlagKind::HttpOrigin => Some("https://127.0.0.1:8443"),
            FlagKind::Millis => Some("soon"),
            FlagKind::Secs | FlagKind::Count => Some("0"),
            FlagKind::Choice => Some("no-such-choice"),
            FlagKind::Text
            | FlagKind::Path
            | FlagKind::Paths
            | FlagKind::List
            | FlagKind::Secret => None,
        }
    }
}

/// What a flag is when neither it nor its environment variable is set.
#[derive(Clone, Copy)]
pub enum FlagDefault {
    /// Nothing: the setting stays unset.
    None,
    /// A fixed value, one of the library's constants.
    Value(&'static (dyn fmt::Display + Sync)),
    /// Worked out from other inputs (`sb.yml`, the pod, other flags).
    Words(&'static str),
    /// Worked out from other inputs, naming a constant (made when asked).
    Template(fn() -> String),
}

impl FlagDefault {
    /// The default in words, `None` for [`FlagDefault::None`].
    pub(crate) fn text(&self) -> Option<String> {
        match self {
            FlagDefault::None => None,
            FlagDefault::Value(value) => Some(value.to_string()),
            FlagDefault::Words(words) => Some((*words).to_owned()),
            FlagDefault::Template(make) => Some(make()),
        }
    }
}

impl fmt::Debug for FlagDefault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.text() {
            Some(text) => write!(f, "{text:?}"),
            None => f.write_str("None"),
        }
    }
}

impl PartialEq for FlagDefault {
    fn eq(&self, other: &Self) -> bool {
        self.text() == other.text()
    }
}

impl Eq for FlagDefault {}

/// A [`Duration`] shown as whole milliseconds.
struct Millis(Duration);

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.as_millis())
    }
}

/// A [`Duration`] shown as whole seconds.
struct Secs(Duration);

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.as_secs())
    }
}

const SBMESH: &str = "proxy.extensions.sbmesh";

impl Flag {
    /// `--config`.
    pub const CONFIG: Flag = Flag {
        long: "config",
        env: "SBMESH_CONFIG",
        value_name: "FILE",
        kind: FlagKind::Path,
        default: FlagDefault::Value(&DEFAULT_CONFIG_PATH),
        help: "The proxy's config file, read only",
    };
    /// `--pod-name`.
    pub const POD_NAME: Flag = Flag {
        long: "pod-name",
        env: "SBPROXY_POD_NAME",
        value_name: "NAME",
        kind: FlagKind::Text,
        default: FlagDefault::None,
        help: "This pod's name, <statefulset>-<ordinal> (downward API)",
    };
    /// `--pod-ip`.
    pub const POD_IP: Flag = Flag {
        long: "pod-ip",
        env: "SBPROXY_POD_IP",
        value_name: "IP",
        kind: FlagKind::Ip,
        default: FlagDefault::None,
        help: "This pod's IP (downward API)",
    };
    /// `--namespace`.
    pub const NAMESPACE: Flag = Flag {
        long: "namespace",
        env: "SBMESH_NAMESPACE",
        value_name: "NS",
        kind: FlagKind::Name,
        default: FlagDefault::Value(&DEFAULT_NAMESPACE),
        help: "This pod's namespace",
    };
    /// `--node-id`.
    pub const NODE_ID: Flag = Flag {
        long: "node-id",
        env: "SBMESH_NODE_ID",
        value_name: "ID",
        kind: FlagKind::Name,
        default: FlagDefault::Template(|| {
            format!("{SBMESH}.node_id, else the pod name, else the host name")
        }),
        help: "This member's name in the mesh",
    };
    /// `--cluster-id`.
    pub const CLUSTER_ID: Flag = Flag {
        long: "cluster-id",
        env: "SBMESH_CLUSTER_ID",
        value_name: "ID",
        kind: FlagKind::Name,
        default: FlagDefault::Template(|| {
            format!("{SBMESH}.cluster_id, else the StatefulSet name")
        }),
        help: "Packets from another cluster id are dropped",
    };
    /// `--mesh-service`.
    pub const MESH_SERVICE: Flag = Flag {
        long: "mesh-service",
        env: "SBMESH_MESH_SERVICE",
        value_name: "SVC",
        kind: FlagKind::Name,
        default: FlagDefault::None,
        help: "Headless Service whose A/AAAA records (<svc>.<namespace>.svc.<domain>) are seeds",
    };
    /// `--cluster-domain`.
    pub const CLUSTER_DOMAIN: Flag = Flag {
        long: "cluster-domain",
        env: "SBMESH_CLUSTER_DOMAIN",
        value_name: "DOMAIN",
        kind: FlagKind::Text,
        default: FlagDefault::Value(&DEFAULT_CLUSTER_DOMAIN),
        help: "Kubernetes cluster DNS domain",
    };
    /// `--seeds`.
    pub const SEEDS: Flag = Flag {
        long: "seeds",
        env: "SBMESH_SEEDS",
        value_name: "HOST:PORT,...",
        kind: FlagKind::List,
        default: FlagDefault::Template(|| format!("{SBMESH}.seeds")),
        help: "Comma-separated host:port seeds, re-resolved periodically",
    };
    /// `--bind`.
    pub const BIND: Flag = Flag {
        long: "bind",
        env: "SBMESH_BIND",
        value_name: "IP",
        kind: FlagKind::Ip,
        default: FlagDefault::Value(&DEFAULT_BIND),
        help: "IP the gossip (UDP) and transport (TCP) sockets bind; :: for IPv6",
    };
    /// `--advertise`.
    pub const ADVERTISE: Flag = Flag {
        long: "advertise",
        env: "SBMESH_ADVERTISE",
        value_name: "IP[:PORT]",
        kind: FlagKind::IpPort,
        default: FlagDefault::Template(|| {
            format!(
                "{SBMESH}.advertise_addr, else the pod IP, else the bind IP when not unspecified"
            )
        }),
        help: "ip or ip:port peers use to reach us",
    };
    /// `--gossip-port`.
    pub const GOSSIP_PORT: Flag = Flag {
        long: "gossip-port",
        env: "SBMESH_GOSSIP_PORT",
        value_name: "PORT",
        kind: FlagKind::Port,
        default: FlagDefault::Template(|| {
            format!("{SBMESH}.gossip_port, else {DEFAULT_GOSSIP_PORT}")
        }),
        help: "Gossip port, UDP",
    };
    /// `--transport-port`.
    pub const TRANSPORT_PORT: Flag = Flag {
        long: "transport-port",
        env: "SBMESH_TRANSPORT_PORT",
        value_name: "PORT",
        kind: FlagKind::Port,
        default: FlagDefault::Template(|| {
            format!("{SBMESH}.transport_port, else {DEFAULT_TRANSPORT_PORT}")
        }),
        help: "Transport port, TCP",
    };
    /// `--cluster-key`.
    pub const CLUSTER_KEY: Flag = Flag {
        long: "cluster-key",
        env: "SBMESH_CLUSTER_KEY",
        value_name: "HEX[,HEX...]",
        kind: FlagKind::Secret,
        default: FlagDefault::Template(|| format!("{SBMESH}.shared_key")),
        help: "64 hex chars (32 bytes); a comma-separated list is a key ring, first key primary. \
               env:NAME and file:/path also work",
    };
    /// `--cluster-key-file`.
    pub const CLUSTER_KEY_FILE: Flag = Flag {
        long: "cluster-key-file",
        env: "SBMESH_CLUSTER_KEY_FILE",
        value_name: "FILE",
        kind: FlagKind::Path,
        default: FlagDefault::None,
        help: "File with one key per line, first is primary; re-read when it changes",
    };
    /// `--admin-listen`.
    pub const ADMIN_LISTEN: Flag = Flag {
        long: "admin-listen",
        env: "SBMESH_ADMIN_LISTEN",
        value_name: "ADDR",
        kind: FlagKind::Listen,
        default: FlagDefault::Value(&DEFAULT_ADMIN_LISTEN),
        help: "Address of /healthz, /readyz, /metrics and /admin/*",
    };
    /// `--admin-user`.
    pub const ADMIN_USER: Flag = Flag {
        long: "admin-user",
        env: "SBMESH_ADMIN_USER",
        value_name: "USER",
        kind: FlagKind::Text,
        default: FlagDefault::Words("proxy.admin.username"),
        help: "HTTP Basic user for /admin/*",
    };
    /// `--admin-password`.
    pub const ADMIN_PASSWORD: Flag = Flag {
        long: "admin-password",
        env: "SBMESH_ADMIN_PASSWORD",
        value_name: "PASSWORD",
        kind: FlagKind::Secret,
        default: FlagDefault::Words("proxy.admin.password"),
        help: "HTTP Basic password for /admin/*",
    };
    /// `--challenge-listen`.
    pub const CHALLENGE_LISTEN: Flag = Flag {
        long: "challenge-listen",
        env: "SBMESH_CHALLENGE_LISTEN",
        value_name: "ADDR",
        kind: FlagKind::Listen,
        default: FlagDefault::Value(&DEFAULT_CHALLENGE_LISTEN),
        help: "Address of the ACME HTTP-01 responder",
    };
    /// `--challenge-passthrough`.
    pub const CHALLENGE_PASSTHROUGH: Flag = Flag {
        long: "challenge-passthrough",
        env: "SBMESH_CHALLENGE_PASSTHROUGH",
        value_name: "URL",
        kind: FlagKind::HttpOrigin,
        default: FlagDefault::None,
        help: "The proxy's plain HTTP listener, http://host:port, to which the challenge listener \
               passes every request outside /.well-known/acme-challenge/; unset or empty: those get \
               404",
    };
    /// `--acme-check-url`.
    pub const ACME_CHECK_URL: Flag = Flag {
        long: "acme-check-url",
        env: "SBMESH_ACME_CHECK_URL",
        value_name: "URL",
        kind: FlagKind::HttpOrigin,
        default: FlagDefault::Template(|| "this replica's challenge listener".to_owned()),
        help: "Where the CA's HTTP-01 request lands, as reached from this pod, http://host:port (the \
               Service in front of the replicas). Before the CA is told to validate, a probe token \
               is published and fetched there; the order waits until it is answered",
    };
    /// `--acme-dns-resolvers`.
    pub const ACME_DNS_RESOLVERS: Flag = Flag {
        long: "acme-dns-resolvers",
        env: "SBMESH_ACME_DNS_RESOLVERS",
        value_name: "ADDRS",
        kind: FlagKind::List,
        default: FlagDefault::Words("the nameservers of /etc/resolv.conf"),
        help: "DNS-01: the recursive resolvers asked for _acme-challenge CNAMEs, the record's zone \
               and the zone's name servers, ip or ip:port (port 53), comma-separated; the record \
               itself is checked at each authoritative server",
    };
    /// `--proxy-reload-url`.
    pub const PROXY_RELOAD_URL: Flag = Flag {
        long: "proxy-reload-url",
        env: "SBMESH_PROXY_RELOAD_URL",
        value_name: "URL",
        kind: FlagKind::Url,
        default: FlagDefault::Template(|| {
            format!(
                "http://127.0.0.1:<proxy.admin.port or {DEFAULT_PROXY_ADMIN_PORT}>/admin/reload"
            )
        }),
        help: "Where reloads are POSTed",
    };
    /// `--proxy-authorization`.
    pub const PROXY_AUTHORIZATION: Flag = Flag {
        long: "proxy-authorization",
        env: "SBMESH_PROXY_AUTHORIZATION",
        value_name: "VALUE",
        kind: FlagKind::Secret,
        default: FlagDefault::Words("Basic from proxy.admin.username/password"),
        help: "Full Authorization header value for the reload POST",
    };
    /// `--cert-dir`.
    pub const CERT_DIR: Flag = Flag {
        long: "cert-dir",
        env: "SBMESH_CERT_DIR",
        value_name: "DIR",
        kind: FlagKind::Path,
        default: FlagDefault::Value(&DEFAULT_CERT_DIR),
        help: "Certificates handed to the proxy",
    };
    /// `--state-dir`.
    pub const STATE_DIR: Flag = Flag {
        long: "state-dir",
        env: "SBMESH_STATE_DIR",
        value_name: "DIR",
        kind: FlagKind::Path,
        default: FlagDefault::Value(&DEFAULT_STATE_DIR),
        help: "Local state, e.g. the redb store",
    };
    /// `--log-format`.
    pub const LOG_FORMAT: Flag = Flag {
        long: "log-format",
        env: "SBMESH_LOG_FORMAT",
        value_name: "FORMAT",
        kind: FlagKind::Choice,
        default: FlagDefault::Words("json when stderr is not a terminal, else text"),
        help: "json or text",
    };
    /// `--shutdown-grace-ms`.
    pub const SHUTDOWN_GRACE_MS: Flag = Flag {
        long: "shutdown-grace-ms",
        env: "SBPROXY_SHUTDOWN_GRACE_MS",
        value_name: "MS",
        kind: FlagKind::Millis,
        default: FlagDefault::Value(&Millis(DEFAULT_SHUTDOWN_GRACE)),
        help: "Drain budget after SIGTERM/SIGINT, in milliseconds",
    };
    /// `--reload-debounce-ms`.
    pub const RELOAD_DEBOUNCE_MS: Flag = Flag {
        long: "reload-debounce-ms",
        env: "SBMESH_RELOAD_DEBOUNCE_MS",
        value_name: "MS",
        kind: FlagKind::Millis,
        default: FlagDefault::Value(&Millis(DEFAULT_DEBOUNCE)),
        help: "Quiet time after a config change before it is validated and POSTed, in milliseconds",
    };
    /// `--reload-rescan-secs`.
    pub const RELOAD_RESCAN_SECS: Flag = Flag {
        long: "reload-rescan-secs",
        env: "SBMESH_RELOAD_RESCAN_SECS",
        value_name: "SECS",
        kind: FlagKind::Secs,
        default: FlagDefault::Value(&Secs(DEFAULT_RESCAN)),
        help: "Full re-read of the config file as a safety net, every N seconds",
    };
    /// `--acme-order-lock-ttl-secs`.
    pub const ACME_ORDER_LOCK_TTL_SECS: Flag = Flag {
        long: "acme-order-lock-ttl-secs",
        env: "SBMESH_ACME_ORDER_LOCK_TTL_SECS",
        value_name: "SECS",
        kind: FlagKind::Secs,
        default: FlagDefault::Value(&Secs(DEFAULT_ACME_ORDER_LOCK_TTL)),
        help: "Lease of a hostname's order lock, in seconds: a replica that dies mid-order holds \
               the hostname back at most this long",
    };
    /// `--acme-max-orders`.
    pub const ACME_MAX_ORDERS: Flag = Flag {
        long: "acme-max-orders",
        env: "SBMESH_ACME_MAX_ORDERS",
        value_name: "N",
        kind: FlagKind::Count,
        default: FlagDefault::Value(&DEFAULT_ACME_MAX_ORDERS),
        help: "New ACME orders the whole cluster may place per account and interval \
               (see --acme-orders-interval-secs)",
    };
    /// `--acme-orders-interval-secs`.
    pub const ACME_ORDERS_INTERVAL_SECS: Flag = Flag {
        long: "acme-orders-interval-secs",
        env: "SBMESH_ACME_ORDERS_INTERVAL_SECS",
        value_name: "SECS",
        kind: FlagKind::Secs,
        default: FlagDefault::Value(&Secs(DEFAULT_ACME_ORDERS_INTERVAL)),
        help: "The interval of --acme-max-orders, in seconds",
    };
    /// `--acme-concurrent-orders`.
    pub const ACME_CONCURRENT_ORDERS: Flag = Flag {
        long: "acme-concurrent-orders",
        env: "SBMESH_ACME_CONCURRENT_ORDERS",
        value_name: "N",
        kind: FlagKind::Count,
        default: FlagDefault::Value(&DEFAULT_ACME_CONCURRENT_ORDERS),
        help: "Orders this replica runs at once",
    };
    /// `--proxy-cert-apply`.
    pub const PROXY_CERT_APPLY: Flag = Flag {
        long: "proxy-cert-apply",
        env: "SBMESH_PROXY_CERT_APPLY",
        value_name: "HOW",
        kind: FlagKind::Choice,
        default: FlagDefault::Template(|| {
            format!(
                "{SBMESH}.acme.apply, else {}",
                CertApply::default().as_str()
            )
        }),
        help: "How a new certificate reaches the running proxy: reload (POST the reload URL), \
               restart (SIGTERM the proxy process, one pod at a time across the fleet) or none \
               (files only)",
    };
    /// `--proxy-process-name`.
    pub const PROXY_PROCESS_NAME: Flag = Flag {
        long: "proxy-process-name",
        env: "SBMESH_PROXY_PROCESS_NAME",
        value_name: "NAME",
        kind: FlagKind::Name,
        default: FlagDefault::Value(&DEFAULT_PROXY_PROCESS_NAME),
        help: "The proxy's process name, as /proc/<pid>/comm shows it, for --proxy-cert-apply \
               restart",
    };
    /// `--proxy-health-url`.
    pub const PROXY_HEALTH_URL: Flag = Flag {
        long: "proxy-health-url",
        env: "SBMESH_PROXY_HEALTH_URL",
        value_name: "URL",
        kind: FlagKind::Url,
        default: FlagDefault::Template(|| {
            format!("http://127.0.0.1:<proxy.admin.port or {DEFAULT_PROXY_ADMIN_PORT}>/health")
        }),
        help: "What must answer 200 before a restarted proxy counts as back",
    };
    /// `--proxy-restart-interval-secs`.
    pub const PROXY_RESTART_INTERVAL_SECS: Flag = Flag {
        long: "proxy-restart-interval-secs",
        env: "SBMESH_PROXY_RESTART_INTERVAL_SECS",
        value_name: "SECS",
        kind: FlagKind::Secs,
        default: FlagDefault::Value(&Secs(DEFAULT_PROXY_RESTART_INTERVAL)),
        help: "At most one proxy restart per pod this often, in seconds, for --proxy-cert-apply \
               restart",
    };
    /// `--watch-tls`.
    pub const WATCH_TLS: Flag = Flag {
        long: "watch-tls",
        env: "SBMESH_WATCH_TLS",
        value_name: "DIR",
        kind: FlagKind::Paths,
        default: FlagDefault::None,
        help: "A directory holding tls.crt and tls.key (a mounted cert-manager Secret); a changed, \
               matching pair is applied to the proxy with --proxy-cert-apply. Repeatable; the \
               environment takes a comma-separated list",
    };
}

/// A setting's type: how the text of a flag (or of its variable) becomes
/// it. The parser is chosen by the type; the flag's [`FlagKind`] only picks
/// the unit where one type has two (a [`Duration`] in milliseconds or
/// seconds) and whether text must be a URL.
///
/// ```
/// use std::time::Duration;
/// use sbmesh::{Flag, FlagValue};
///
/// let debounce = Duration::parse_flag(Flag::RELOAD_DEBOUNCE_MS.kind, "250");
/// assert_eq!(debounce, Ok(Duration::from_millis(250)));
/// let port = u16::parse_flag(Flag::GOSSIP_PORT.kind, "0");
/// assert!(port.unwrap_err().contains("expected a number from 1 to 65535"));
/// ```
pub trait FlagValue: Sized {
    /// Reads `text` (trimmed, not empty) as the value of a flag of `kind`;
    /// the error says what was wrong and what would be accepted.
    fn parse_flag(kind: FlagKind, text: &str) -> Result<Self, String>;
}

impl<T: FlagValue> FlagValue for Option<T> {
    fn parse_flag(kind: FlagKind, text: &str) -> Result<Self, String> {
        T::parse_flag(kind, text).map(Some)
    }
}

impl FlagValue for String {
    fn parse_flag(kind: FlagKind, text: &str) -> Result<Self, String> {
        match kind {
            FlagKind::Url => parse_http_url(text),
            _ => Ok(text.to_owned()),
        }
    }
}

impl FlagValue for PathBuf {
    fn parse_flag(_: FlagKind, text: &str) -> Result<Self, String> {
        Ok(PathBuf::from(text))
    }
}

impl FlagValue for IpAddr {
    fn parse_flag(_: FlagKind, text: &str) -> Result<Self, String> {
        text.parse().map_err(|_| {
            format!("{text:?} is not an IP address; expected e.g. 10.0.0.5 or fd00::5")
        })
    }
}

impl FlagValue for SocketAddr {
    fn parse_flag(_: FlagKind, text: &str) -> Result<Self, String> {
        text.parse().map_err(|_| {
            format!(
                "{text:?} is not a listen address; expected ip:port such as 0.0.0.0:9091 \
                 ([::]:9091 for IPv6)"
            )
        })
    }
}

impl FlagValue for u16 {
    fn parse_flag(_: FlagKind, text: &str) -> Result<Self, String> {
        match text.parse::<u16>() {
            Ok(port) if port != 0 => Ok(port),
            _ => Err(format!(
                "{text:?} is not a port; expected a number from 1 to 65535"
            )),
        }
    }
}

impl FlagValue for usize {
    fn parse_flag(_: FlagKind, text: &str) -> Result<Self, String> {
        match text.parse::<usize>() {
            Ok(0) | Err(_) => Err(format!(
                "{text:?} is not a positive whole number; expected e.g. 16"
            )),
            Ok(n) => Ok(n),
        }
    }
}

impl FlagValue for u32 {
    fn parse_flag(kind: FlagKind, text: &str) -> Result<Self, String> {
        let n = usize::parse_flag(kind, text)?;
        u32::try_from(n).map_err(|_| format!("{text:?} is too large"))
    }
}

impl FlagValue for Duration {
    fn parse_flag(kind: FlagKind, text: &str) -> Result<Self, String> {
        if kind == FlagKind::Millis {
            return text.parse::<u64>().map(Duration::from_millis).map_err(|_| {
                format!("{text:?} is not a number of milliseconds; expected e.g. 30000")
            });
        }
        match text.parse::<u64>() {
            Ok(0) | Err(_) => Err(format!(
                "{text:?} is not a positive number of seconds; expected e.g. 30"
            )),
            Ok(n) => Ok(Duration::from_secs(n)),
        }
    }
}

/// DNS servers: `ip` or `ip:port` (port 53), comma-separated.
impl FlagValue for Vec<SocketAddr> {
    fn parse_flag(_: FlagKind, text: &str) -> Result<Self, String> {
        text.split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| {
                t.parse::<SocketAddr>()
                    .or_else(|_| t.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, DNS_PORT)))
                    .map_err(|_| {
                        format!(
                            "{t:?} is not a DNS server address; expected ip or ip:port, such as \
                             10.96.0.10 or 127.0.0.1:5353 ([fd00::a]:53 for IPv6)"
                        )
                    })
            })
            .collect()
    }
}

impl FlagValue for CertApply {
    fn parse_flag(_: FlagKind, text: &str) -> Result<Self, String> {
        CertApply::from_name(text)
            .ok_or_else(|| format!("{text:?} is not one of: {}", CertApply::names()))
    }
}

/// An `http://` or `https://` URL with a host, as given.
fn parse_http_url(text: &str) -> Result<String, String> {
    let uri: hyper::Uri = text.parse().map_err(|_| {
        format!("{text:?} is not a URL; expected e.g. http://127.0.0.1:9090/admin/reload")
    })?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http" | "https"), Some(_)) => Ok(text.to_string()),
        _ => Err(format!(
            "{text:?} is not an http(s) URL; expected e.g. http://127.0.0.1:9090/admin/reload"
        )),
    }
}

impl Flag {
    /// Every flag of `run`, in the order `--help` lists them.
    pub const RUN: &[Flag] = &[
        Flag::CONFIG,
        Flag::POD_NAME,
        Flag::POD_IP,
        Flag::NAMESPACE,
        Flag::NODE_ID,
        Flag::CLUSTER_ID,
        Flag::MESH_SERVICE,
        Flag::CLUSTER_DOMAIN,
        Flag::SEEDS,
        Flag::BIND,
        Flag::ADVERTISE,
        Flag::GOSSIP_PORT,
        Flag::TRANSPORT_PORT,
        Flag::CLUSTER_KEY,
        Flag::CLUSTER_KEY_FILE,
        Flag::ADMIN_LISTEN,
        Flag::ADMIN_USER,
        Flag::ADMIN_PASSWORD,
        Flag::CHALLENGE_LISTEN,
        Flag::CHALLENGE_PASSTHROUGH,
        Flag::PROXY_RELOAD_URL,
        Flag::PROXY_AUTHORIZATION,
        Flag::CERT_DIR,
        Flag::STATE_DIR,
        Flag::LOG_FORMAT,
        Flag::SHUTDOWN_GRACE_MS,
        Flag::RELOAD_DEBOUNCE_MS,
        Flag::RELOAD_RESCAN_SECS,
        Flag::ACME_ORDER_LOCK_TTL_SECS,
        Flag::ACME_MAX_ORDERS,
        Flag::ACME_ORDERS_INTERVAL_SECS,
        Flag::ACME_CONCURRENT_ORDERS,
        Flag::ACME_CHECK_URL,
        Flag::ACME_DNS_RESOLVERS,
        Flag::PROXY_CERT_APPLY,
        Flag::PROXY_PROCESS_NAME,
        Flag::PROXY_HEALTH_URL,
        Flag::PROXY_RESTART_INTERVAL_SECS,
        Flag::WATCH_TLS,
    ];

    /// The flag whose long name (with or without the leading `--`) is `long`.
    pub fn by_long(long: &str) -> Option<&'static Flag> {
        let long = long.strip_prefix("--").unwrap_or(long);
        Flag::RUN.iter().find(|flag| flag.long == long)
    }

    /// The flag whose environment variable is `env`.
    pub fn by_env(env: &str) -> Option<&'static Flag> {
        Flag::RUN.iter().find(|flag| flag.env == env)
    }

    /// `Flag::RUN` as a Markdown table, one row per flag:
    /// `| flag | environment | default | meaning |`. A fixed default is
    /// written as code, one worked out from other inputs in words, none as `—`.
    pub fn markdown_table() -> String {
        let mut out =
            String::from("| flag | environment | default | meaning |\n|---|---|---|---|\n");
        for flag in Flag::RUN {
            let default = match flag.default {
                FlagDefault::None => "—".to_owned(),
                FlagDefault::Value(value) => format!("`{value}`"),
                FlagDefault::Words(_) | FlagDefault::Template(_) => {
                    flag.default_text().unwrap_or_default()
                }
            };
            out.push_str(&format!(
                "| `{}` | `{}` | {} | {} |\n",
                flag.flag(),
                flag.env,
                escape_cell(&default),
                escape_cell(flag.help)
            ));
        }
        out
    }
}

/// A table cell's text with its `|` escaped, so it stays one cell.
fn escape_cell(text: &str) -> String {
    text.replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn names_and_variables_are_unique_and_well_formed() {
        let mut longs = HashSet::new();
        let mut envs = HashSet::new();
        for flag in Flag::RUN {
            assert!(longs.insert(flag.long), "--{} twice", flag.long);
            assert!(envs.insert(flag.env), "{} twice", flag.env);
            assert!(
                flag.long
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                "--{}",
                flag.long
            );
            assert!(
                flag.env.starts_with("SBMESH_") || flag.env.starts_with("SBPROXY_"),
                "{}",
                flag.env
            );
            assert!(
                !flag.help.ends_with('.'),
                "--{}: no final period",
                flag.long
            );
        }
    }

    #[test]
    fn the_contracts_defaults() {
        let default = |flag: &Flag| flag.default_text();
        assert_eq!(
            default(&Flag::CONFIG).as_deref(),
            Some("/etc/sbproxy/sb.yml")
        );
        assert_eq!(default(&Flag::NAMESPACE).as_deref(), Some("default"));
        assert_eq!(
            default(&Flag::CLUSTER_DOMAIN).as_deref(),
            Some("cluster.local")
        );
        assert_eq!(default(&Flag::BIND).as_deref(), Some("0.0.0.0"));
        assert!(
            default(&Flag::GOSSIP_PORT)
                .unwrap()
                .ends_with(", else 7946")
        );
        assert!(
            default(&Flag::TRANSPORT_PORT)
                .unwrap()
                .ends_with(", else 8946")
        );
        assert_eq!(
            default(&Flag::ADMIN_LISTEN).as_deref(),
            Some("0.0.0.0:9091")
        );
        assert_eq!(
            default(&Flag::CHALLENGE_LISTEN).as_deref(),
            Some("0.0.0.0:8089")
        );
        assert_eq!(
            default(&Flag::PROXY_RELOAD_URL).as_deref(),
            Some("http://127.0.0.1:<proxy.admin.port or 9090>/admin/reload")
        );
        assert_eq!(
            default(&Flag::CERT_DIR).as_deref(),
            Some("/var/lib/sbproxy/certs")
        );
        assert_eq!(
            default(&Flag::STATE_DIR).as_deref(),
            Some("/var/lib/sbproxy/sidecar")
        );
        assert_eq!(default(&Flag::SHUTDOWN_GRACE_MS).as_deref(), Some("30000"));
        assert!(
            default(&Flag::PROXY_CERT_APPLY)
                .unwrap()
                .ends_with(", else reload")
        );
        assert_eq!(
            default(&Flag::PROXY_PROCESS_NAME).as_deref(),
            Some("sbproxy")
        );
        assert_eq!(default(&Flag::POD_NAME), None);
        assert_eq!(
            Flag::GOSSIP_PORT.help_line(),
            "Gossip port, UDP [default: proxy.extensions.sbmesh.gossip_port, else 7946]"
        );
    }

    #[test]
    fn markdown_has_a_row_per_flag() {
        let table = Flag::markdown_table();
        let mut lines = table.lines();
        assert_eq!(
            lines.next(),
            Some("| flag | environment | default | meaning |")
        );
        assert_eq!(lines.next(), Some("|---|---|---|---|"));
        let rows: Vec<&str> = lines.collect();
        assert_eq!(rows.len(), Flag::RUN.len());
        assert_eq!(
            rows[0],
            "| `--config` | `SBMESH_CONFIG` | `/etc/sbproxy/sb.yml` | The proxy's config file, read only |"
        );
        assert!(
            rows.iter()
                .any(|r| r.starts_with("| `--pod-name` | `SBPROXY_POD_NAME` | — |"))
        );
    }

    #[test]
    fn lookups() {
        assert_eq!(Flag::by_long("--cert-dir"), Some(&Flag::CERT_DIR));
        assert_eq!(Flag::by_long("cert-dir"), Some(&Flag::CERT_DIR));
        assert_eq!(
            Flag::by_env("SBPROXY_SHUTDOWN_GRACE_MS"),
            Some(&Flag::SHUTDOWN_GRACE_MS)
        );
        assert_eq!(Flag::by_env("SBMESH_NOPE"), None);
    }
}
