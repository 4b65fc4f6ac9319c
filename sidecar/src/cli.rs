//! The command line: `sbmesh-sidecar run | validate | status | keygen`.
//!
//! Every `run` flag has an environment variable (SPEC section 1). Values are
//! kept as text here and checked by [`crate::settings::resolve`], which
//! reports every bad value at once, named by its flag, in the same format as
//! `validate`; defaults are applied there too, because several of them come
//! from `sb.yml` (flag > environment > `sb.yml` > default).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// The default `--config`.
pub const DEFAULT_CONFIG: &str = "/etc/sbproxy/sb.yml";

/// The default `status --admin`.
pub const DEFAULT_ADMIN_URL: &str = "http://127.0.0.1:9091";

/// `sbmesh-sidecar`: runs beside an sbproxy container.
#[derive(Debug, Parser)]
#[command(
    name = "sbmesh-sidecar",
    version,
    about,
    propagate_version = true,
    args_override_self = true
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the sidecar: the mesh, ACME HTTP-01 challenges, certificate files
    /// and proxy reloads.
    Run(Box<RunArgs>),
    /// Check sb.yml the way `run` reads it; print one problem per line.
    Validate(ValidateArgs),
    /// Print the cluster as a table, from a sidecar's /admin/cluster/status.
    Status(StatusArgs),
    /// Print a fresh random cluster key (32 bytes as 64 hex characters).
    Keygen,
}

/// Flags of `run`. Each is optional here: absence lets the next source in
/// the precedence (environment, then `sb.yml`, then the default) decide.
#[derive(Debug, Clone, Default, Args)]
pub struct RunArgs {
    /// The proxy's config file, read only [default: /etc/sbproxy/sb.yml]
    #[arg(long, env = "SBMESH_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// This pod's name, <statefulset>-<ordinal> (downward API)
    #[arg(long, env = "SBPROXY_POD_NAME", value_name = "NAME")]
    pub pod_name: Option<String>,

    /// This pod's IP (downward API)
    #[arg(long, env = "SBPROXY_POD_IP", value_name = "IP")]
    pub pod_ip: Option<String>,

    /// This pod's namespace [default: default]
    #[arg(long, env = "SBMESH_NAMESPACE", value_name = "NS")]
    pub namespace: Option<String>,

    /// This member's name in the mesh [default: proxy.extensions.sbmesh.node_id, else the pod name, else the host name]
    #[arg(long, env = "SBMESH_NODE_ID", value_name = "ID")]
    pub node_id: Option<String>,

    /// Packets from another cluster id are dropped [default: proxy.extensions.sbmesh.cluster_id, else the StatefulSet name]
    #[arg(long, env = "SBMESH_CLUSTER_ID", value_name = "ID")]
    pub cluster_id: Option<String>,

    /// Headless Service whose A/AAAA records (<svc>.<namespace>.svc.<domain>) are seeds
    #[arg(long, env = "SBMESH_MESH_SERVICE", value_name = "SVC")]
    pub mesh_service: Option<String>,

    /// Kubernetes cluster DNS domain [default: cluster.local]
    #[arg(long, env = "SBMESH_CLUSTER_DOMAIN", value_name = "DOMAIN")]
    pub cluster_domain: Option<String>,

    /// Comma-separated host:port seeds, re-resolved periodically [default: proxy.extensions.sbmesh.seeds]
    #[arg(long, env = "SBMESH_SEEDS", value_name = "HOST:PORT,...")]
    pub seeds: Option<String>,

    /// IP the gossip (UDP) and transport (TCP) sockets bind; :: for IPv6 [default: 0.0.0.0]
    #[arg(long, env = "SBMESH_BIND", value_name = "IP")]
    pub bind: Option<String>,

    /// ip or ip:port peers use to reach us [default: proxy.extensions.sbmesh.advertise_addr, else the pod IP, else the bind IP when not unspecified]
    #[arg(long, env = "SBMESH_ADVERTISE", value_name = "IP[:PORT]")]
    pub advertise: Option<String>,

    /// Gossip port, UDP [default: proxy.extensions.sbmesh.gossip_port, else 7946]
    #[arg(long, env = "SBMESH_GOSSIP_PORT", value_name = "PORT")]
    pub gossip_port: Option<String>,

    /// Transport port, TCP [default: proxy.extensions.sbmesh.transport_port, else 8946]
    #[arg(long, env = "SBMESH_TRANSPORT_PORT", value_name = "PORT")]
    pub transport_port: Option<String>,

    /// 64 hex chars (32 bytes); a comma-separated list is a key ring, first key primary. env:NAME and file:/path also work [default: proxy.extensions.sbmesh.security.shared_key]
    #[arg(
        long,
        env = "SBMESH_CLUSTER_KEY",
        value_name = "HEX[,HEX...]",
        hide_env_values = true
    )]
    pub cluster_key: Option<String>,

    /// File with one key per line, first is primary; re-read when it changes
    #[arg(long, env = "SBMESH_CLUSTER_KEY_FILE", value_name = "FILE")]
    pub cluster_key_file: Option<PathBuf>,

    /// Address of /healthz, /readyz, /metrics and /admin/* [default: 0.0.0.0:9091]
    #[arg(long, env = "SBMESH_ADMIN_LISTEN", value_name = "ADDR")]
    pub admin_listen: Option<String>,

    /// HTTP Basic user for /admin/* [default: proxy.admin.username]
    #[arg(long, env = "SBMESH_ADMIN_USER", value_name = "USER")]
    pub admin_user: Option<String>,

    /// HTTP Basic password for /admin/* [default: proxy.admin.password]
    #[arg(
        long,
        env = "SBMESH_ADMIN_PASSWORD",
        value_name = "PASSWORD",
        hide_env_values = true
    )]
    pub admin_password: Option<String>,

    /// Address of the ACME HTTP-01 responder [default: 0.0.0.0:8089]
    #[arg(long, env = "SBMESH_CHALLENGE_LISTEN", value_name = "ADDR")]
    pub challenge_listen: Option<String>,

    /// Where reloads are POSTed [default: http://127.0.0.1:<proxy.admin.port or 9090>/admin/reload]
    #[arg(long, env = "SBMESH_PROXY_RELOAD_URL", value_name = "URL")]
    pub proxy_reload_url: Option<String>,

    /// Full Authorization header value for the reload POST [default: Basic from proxy.admin.username/password]
    #[arg(
        long,
        env = "SBMESH_PROXY_AUTHORIZATION",
        value_name = "VALUE",
        hide_env_values = true
    )]
    pub proxy_authorization: Option<String>,

    /// Certificates handed to the proxy [default: /var/lib/sbproxy/certs]
    #[arg(long, env = "SBMESH_CERT_DIR", value_name = "DIR")]
    pub cert_dir: Option<PathBuf>,

    /// Local state, e.g. the redb store [default: /var/lib/sbproxy/sidecar]
    #[arg(long, env = "SBMESH_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

    /// json or text [default: json when stderr is not a terminal, else text]
    #[arg(long, env = "SBMESH_LOG_FORMAT", value_name = "FORMAT")]
    pub log_format: Option<String>,

    /// Drain budget after SIGTERM/SIGINT, in milliseconds [default: 30000]
    #[arg(long, env = "SBPROXY_SHUTDOWN_GRACE_MS", value_name = "MS")]
    pub shutdown_grace_ms: Option<String>,

    /// Quiet time after a config change before it is validated and POSTed,
    /// in milliseconds [default: 200]
    #[arg(long, env = "SBMESH_RELOAD_DEBOUNCE_MS", value_name = "MS")]
    pub reload_debounce_ms: Option<String>,

    /// Full re-read of the config file as a safety net, every N seconds
    /// [default: 30]
    #[arg(long, env = "SBMESH_RELOAD_RESCAN_SECS", value_name = "SECS")]
    pub reload_rescan_secs: Option<String>,

    /// Lease of a hostname's order lock, in seconds: a replica that dies
    /// mid-order holds the hostname back at most this long [default: 60]
    #[arg(long, env = "SBMESH_ACME_ORDER_LOCK_TTL_SECS", value_name = "SECS")]
    pub acme_order_lock_ttl_secs: Option<String>,

    /// New ACME orders the whole cluster may place per account and
    /// interval (see --acme-orders-interval-secs) [default: 300]
    #[arg(long, env = "SBMESH_ACME_MAX_ORDERS", value_name = "N")]
    pub acme_max_orders: Option<String>,

    /// The interval of --acme-max-orders, in seconds [default: 10800]
    #[arg(long, env = "SBMESH_ACME_ORDERS_INTERVAL_SECS", value_name = "SECS")]
    pub acme_orders_interval_secs: Option<String>,

    /// Orders this replica runs at once [default: 8]
    #[arg(long, env = "SBMESH_ACME_CONCURRENT_ORDERS", value_name = "N")]
    pub acme_concurrent_orders: Option<String>,

    /// How a new certificate reaches the running proxy: reload (POST the
    /// reload URL), restart (SIGTERM the proxy process, one pod at a time
    /// across the fleet) or none (files only) [default: proxy.extensions.sbmesh.acme.apply, else reload]
    #[arg(long, env = "SBMESH_PROXY_CERT_APPLY", value_name = "HOW")]
    pub proxy_cert_apply: Option<String>,

    /// The proxy's process name, as /proc/<pid>/comm shows it, for
    /// --proxy-cert-apply restart [default: sbproxy]
    #[arg(long, env = "SBMESH_PROXY_PROCESS_NAME", value_name = "NAME")]
    pub proxy_process_name: Option<String>,

    /// What must answer 200 before a restarted proxy counts as back
    /// [default: http://127.0.0.1:<proxy.admin.port or 9090>/health]
    #[arg(long, env = "SBMESH_PROXY_HEALTH_URL", value_name = "URL")]
    pub proxy_health_url: Option<String>,

    /// At most one proxy restart per pod this often, in seconds, for
    /// --proxy-cert-apply restart [default: 600]
    #[arg(long, env = "SBMESH_PROXY_RESTART_INTERVAL_SECS", value_name = "SECS")]
    pub proxy_restart_interval_secs: Option<String>,

    /// A directory holding tls.crt and tls.key (a mounted cert-manager
    /// Secret); a changed, matching pair is applied to the proxy with
    /// --proxy-cert-apply. Repeatable; the environment takes a comma-separated list
    #[arg(
        long,
        env = "SBMESH_WATCH_TLS",
        value_name = "DIR",
        value_delimiter = ','
    )]
    pub watch_tls: Vec<PathBuf>,
}

/// Flags of `validate`.
#[derive(Debug, Clone, Args)]
pub struct ValidateArgs {
    /// The file to check
    #[arg(long, env = "SBMESH_CONFIG", value_name = "FILE", default_value = DEFAULT_CONFIG)]
    pub config: PathBuf,
}

/// Flags of `status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// Base URL of a sidecar's admin listener [default: from
    /// SBMESH_ADMIN_LISTEN as `run` reads it, else http://127.0.0.1:9091]
    #[arg(long, value_name = "URL")]
    pub admin: Option<String>,

    /// The proxy's config, for the credentials when --user and --password
    /// are not given: proxy.admin.username / password, as `run` reads them
    /// [default: /etc/sbproxy/sb.yml, skipped when absent]
    #[arg(long, env = "SBMESH_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// HTTP Basic user (the sidecar's --admin-user)
    #[arg(long, env = "SBMESH_ADMIN_USER", value_name = "USER")]
    pub user: Option<String>,

    /// HTTP Basic password (the sidecar's --admin-password)
    #[arg(
        long,
        env = "SBMESH_ADMIN_PASSWORD",
        value_name = "PASSWORD",
        hide_env_values = true
    )]
    pub password: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn run_flags_parse_as_text() {
        let cli = Cli::try_parse_from([
            "sbmesh-sidecar",
            "run",
            "--config",
            "/tmp/sb.yml",
            "--gossip-port",
            "abc",
            "--seeds",
            "a:1,b",
            "--shutdown-grace-ms",
            "5",
        ])
        .unwrap();
        let Command::Run(args) = cli.command else {
            panic!("not run");
        };
        assert_eq!(
            args.config.as_deref(),
            Some(std::path::Path::new("/tmp/sb.yml"))
        );
        // checked later, by settings::resolve, with every other problem
        assert_eq!(args.gossip_port.as_deref(), Some("abc"));
        assert_eq!(args.seeds.as_deref(), Some("a:1,b"));
        assert_eq!(args.shutdown_grace_ms.as_deref(), Some("5"));
    }

    #[test]
    fn every_spec_flag_has_its_env_var() {
        let command = Cli::command();
        let run = command.find_subcommand("run").unwrap();
        let expected = [
            ("config", "SBMESH_CONFIG"),
            ("pod-name", "SBPROXY_POD_NAME"),
            ("pod-ip", "SBPROXY_POD_IP"),
            ("namespace", "SBMESH_NAMESPACE"),
            ("node-id", "SBMESH_NODE_ID"),
            ("cluster-id", "SBMESH_CLUSTER_ID"),
            ("mesh-service", "SBMESH_MESH_SERVICE"),
            ("cluster-domain", "SBMESH_CLUSTER_DOMAIN"),
            ("seeds", "SBMESH_SEEDS"),
            ("bind", "SBMESH_BIND"),
            ("advertise", "SBMESH_ADVERTISE"),
            ("gossip-port", "SBMESH_GOSSIP_PORT"),
            ("transport-port", "SBMESH_TRANSPORT_PORT"),
            ("cluster-key", "SBMESH_CLUSTER_KEY"),
            ("cluster-key-file", "SBMESH_CLUSTER_KEY_FILE"),
            ("admin-listen", "SBMESH_ADMIN_LISTEN"),
            ("admin-user", "SBMESH_ADMIN_USER"),
            ("admin-password", "SBMESH_ADMIN_PASSWORD"),
            ("challenge-listen", "SBMESH_CHALLENGE_LISTEN"),
            ("proxy-reload-url", "SBMESH_PROXY_RELOAD_URL"),
            ("proxy-authorization", "SBMESH_PROXY_AUTHORIZATION"),
            ("cert-dir", "SBMESH_CERT_DIR"),
            ("state-dir", "SBMESH_STATE_DIR"),
            ("log-format", "SBMESH_LOG_FORMAT"),
            ("shutdown-grace-ms", "SBPROXY_SHUTDOWN_GRACE_MS"),
            // Issue 4 (hot reload) adds these two.
            ("reload-debounce-ms", "SBMESH_RELOAD_DEBOUNCE_MS"),
            ("reload-rescan-secs", "SBMESH_RELOAD_RESCAN_SECS"),
            // Issue 6 (ACME): limits of the issuer.
            (
                "acme-order-lock-ttl-secs",
                "SBMESH_ACME_ORDER_LOCK_TTL_SECS",
            ),
            ("acme-max-orders", "SBMESH_ACME_MAX_ORDERS"),
            (
                "acme-orders-interval-secs",
                "SBMESH_ACME_ORDERS_INTERVAL_SECS",
            ),
            ("acme-concurrent-orders", "SBMESH_ACME_CONCURRENT_ORDERS"),
            ("proxy-cert-apply", "SBMESH_PROXY_CERT_APPLY"),
            ("proxy-process-name", "SBMESH_PROXY_PROCESS_NAME"),
            ("proxy-health-url", "SBMESH_PROXY_HEALTH_URL"),
            (
                "proxy-restart-interval-secs",
                "SBMESH_PROXY_RESTART_INTERVAL_SECS",
            ),
            ("watch-tls", "SBMESH_WATCH_TLS"),
        ];
        for (long, env) in expected {
            let arg = run
                .get_arguments()
                .find(|a| a.get_long() == Some(long))
                .unwrap_or_else(|| panic!("--{long} missing"));
            assert_eq!(
                arg.get_env().and_then(|e| e.to_str()),
                Some(env),
                "--{long}"
            );
        }
        let longs = run
            .get_arguments()
            .filter(|a| a.get_long().is_some())
            .count();
        assert_eq!(
            longs,
            expected.len(),
            "run has flags the SPEC does not list"
        );
    }

    #[test]
    fn other_subcommands() {
        let cli = Cli::try_parse_from(["sbmesh-sidecar", "validate", "--config", "x.yml"]).unwrap();
        assert!(
            matches!(cli.command, Command::Validate(ValidateArgs { config }) if config == std::path::Path::new("x.yml"))
        );

        let cli = Cli::try_parse_from([
            "sbmesh-sidecar",
            "status",
            "--admin",
            "http://10.0.0.5:9091",
            "--user",
            "u",
            "--password",
            "p",
        ])
        .unwrap();
        let Command::Status(status) = cli.command else {
            panic!("not status");
        };
        assert_eq!(status.admin.as_deref(), Some("http://10.0.0.5:9091"));
        assert_eq!(status.user.as_deref(), Some("u"));
        assert_eq!(status.password.as_deref(), Some("p"));

        let cli = Cli::try_parse_from(["sbmesh-sidecar", "keygen"]).unwrap();
        assert!(matches!(cli.command, Command::Keygen));

        assert!(Cli::try_parse_from(["sbmesh-sidecar"]).is_err());
        assert!(Cli::try_parse_from(["sbmesh-sidecar", "run", "--no-such-flag"]).is_err());
    }
}
