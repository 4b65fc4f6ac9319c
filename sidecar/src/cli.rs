//! The command line: `sbmesh-sidecar run | validate | status | keygen`.
//!
//! Every `run` flag has an environment variable (docs/reference.md#sidecar-flags). Values are
//! kept as text here and checked by [`crate::settings::resolve`], which
//! reports every bad value at once, named by its flag, in the same format as
//! `validate`; defaults are applied there too, because several of them come
//! from `sb.yml` (flag > environment > `sb.yml` > default). Each flag's
//! name, variable, value name and help come from its entry in
//! [`sbmesh::Flag`], the one place a flag is defined.

use std::path::PathBuf;

use clap::{Arg, Args, Parser, Subcommand};
use sbmesh::{DEFAULT_CONFIG_PATH, Flag, FlagKind};

/// The config file to read: the one `--config` gave, else
/// [`DEFAULT_CONFIG_PATH`] (the one place the default is applied).
pub fn config_path(given: Option<&std::path::Path>) -> PathBuf {
    given.map_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH), PathBuf::from)
}

/// The default `status --admin`: the default `--admin-listen` seen from
/// the same host (a test keeps the two together).
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

/// Flags of `run`. Each field is the flag of the same name in
/// [`Flag::RUN`], which gives its long name, environment variable, value
/// name and help. Each is optional here: absence lets the next source in
/// the precedence (environment, then `sb.yml`, then the default) decide.
#[derive(Debug, Clone, Default, Args)]
pub struct RunArgs {
    #[arg(described_by = &Flag::CONFIG)]
    pub config: Option<PathBuf>,
    #[arg(described_by = &Flag::POD_NAME)]
    pub pod_name: Option<String>,
    #[arg(described_by = &Flag::POD_IP)]
    pub pod_ip: Option<String>,
    #[arg(described_by = &Flag::NAMESPACE)]
    pub namespace: Option<String>,
    #[arg(described_by = &Flag::NODE_ID)]
    pub node_id: Option<String>,
    #[arg(described_by = &Flag::CLUSTER_ID)]
    pub cluster_id: Option<String>,
    #[arg(described_by = &Flag::MESH_SERVICE)]
    pub mesh_service: Option<String>,
    #[arg(described_by = &Flag::CLUSTER_DOMAIN)]
    pub cluster_domain: Option<String>,
    #[arg(described_by = &Flag::SEEDS)]
    pub seeds: Option<String>,
    #[arg(described_by = &Flag::BIND)]
    pub bind: Option<String>,
    #[arg(described_by = &Flag::ADVERTISE)]
    pub advertise: Option<String>,
    #[arg(described_by = &Flag::GOSSIP_PORT)]
    pub gossip_port: Option<String>,
    #[arg(described_by = &Flag::TRANSPORT_PORT)]
    pub transport_port: Option<String>,
    #[arg(described_by = &Flag::CLUSTER_KEY)]
    pub cluster_key: Option<String>,
    #[arg(described_by = &Flag::CLUSTER_KEY_FILE)]
    pub cluster_key_file: Option<PathBuf>,
    #[arg(described_by = &Flag::ADMIN_LISTEN)]
    pub admin_listen: Option<String>,
    #[arg(described_by = &Flag::ADMIN_USER)]
    pub admin_user: Option<String>,
    #[arg(described_by = &Flag::ADMIN_PASSWORD)]
    pub admin_password: Option<String>,
    #[arg(described_by = &Flag::CHALLENGE_LISTEN)]
    pub challenge_listen: Option<String>,
    #[arg(described_by = &Flag::CHALLENGE_PASSTHROUGH)]
    pub challenge_passthrough: Option<String>,
    #[arg(described_by = &Flag::ACME_CHECK_URL)]
    pub acme_check_url: Option<String>,
    #[arg(described_by = &Flag::ACME_DNS_RESOLVERS)]
    pub acme_dns_resolvers: Option<String>,
    #[arg(described_by = &Flag::PROXY_RELOAD_URL)]
    pub proxy_reload_url: Option<String>,
    #[arg(described_by = &Flag::PROXY_AUTHORIZATION)]
    pub proxy_authorization: Option<String>,
    #[arg(described_by = &Flag::CERT_DIR)]
    pub cert_dir: Option<PathBuf>,
    #[arg(described_by = &Flag::STATE_DIR)]
    pub state_dir: Option<PathBuf>,
    #[arg(described_by = &Flag::LOG_FORMAT)]
    pub log_format: Option<String>,
    #[arg(described_by = &Flag::SHUTDOWN_GRACE_MS)]
    pub shutdown_grace_ms: Option<String>,
    #[arg(described_by = &Flag::RELOAD_DEBOUNCE_MS)]
    pub reload_debounce_ms: Option<String>,
    #[arg(described_by = &Flag::RELOAD_RESCAN_SECS)]
    pub reload_rescan_secs: Option<String>,
    #[arg(described_by = &Flag::ACME_ORDER_LOCK_TTL_SECS)]
    pub acme_order_lock_ttl_secs: Option<String>,
    #[arg(described_by = &Flag::ACME_MAX_ORDERS)]
    pub acme_max_orders: Option<String>,
    #[arg(described_by = &Flag::ACME_ORDERS_INTERVAL_SECS)]
    pub acme_orders_interval_secs: Option<String>,
    #[arg(described_by = &Flag::ACME_CONCURRENT_ORDERS)]
    pub acme_concurrent_orders: Option<String>,
    #[arg(described_by = &Flag::PROXY_CERT_APPLY)]
    pub proxy_cert_apply: Option<String>,
    #[arg(described_by = &Flag::PROXY_PROCESS_NAME)]
    pub proxy_process_name: Option<String>,
    #[arg(described_by = &Flag::PROXY_HEALTH_URL)]
    pub proxy_health_url: Option<String>,
    #[arg(described_by = &Flag::PROXY_RESTART_INTERVAL_SECS)]
    pub proxy_restart_interval_secs: Option<String>,
    #[arg(described_by = &Flag::WATCH_TLS)]
    pub watch_tls: Vec<PathBuf>,
}

/// Builds a clap argument from its entry in [`Flag::RUN`], so that the
/// derive above names each flag and nothing else.
trait DescribedBy {
    fn described_by(self, flag: &Flag) -> Self;
}

impl DescribedBy for Arg {
    fn described_by(self, flag: &Flag) -> Self {
        let arg = self
            .long(flag.long)
            .env(flag.env)
            .value_name(flag.value_name)
            .help(flag.help_line())
            .hide_env_values(flag.is_secret());
        match flag.kind {
            // Repeatable, one value each time (the derive, seeing no
            // `long` of its own, would take this for a positional and
            // accept several); the environment holds a comma-separated list.
            FlagKind::Paths => arg.num_args(1).value_delimiter(','),
            _ => arg,
        }
    }
}

/// Flags of `validate`.
#[derive(Debug, Clone, Args)]
pub struct ValidateArgs {
    /// The file to check
    #[arg(
        long,
        env = Flag::CONFIG.env,
        value_name = Flag::CONFIG.value_name,
        default_value = DEFAULT_CONFIG_PATH
    )]
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
    #[arg(long, env = Flag::CONFIG.env, value_name = Flag::CONFIG.value_name)]
    pub config: Option<PathBuf>,

    /// HTTP Basic user (the sidecar's --admin-user)
    #[arg(long, env = Flag::ADMIN_USER.env, value_name = Flag::ADMIN_USER.value_name)]
    pub user: Option<String>,

    /// HTTP Basic password (the sidecar's --admin-password)
    #[arg(
        long,
        env = Flag::ADMIN_PASSWORD.env,
        value_name = Flag::ADMIN_PASSWORD.value_name,
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
            "--watch-tls",
            "/a",
            "--watch-tls",
            "/b,/c",
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
        assert_eq!(
            args.watch_tls,
            ["/a", "/b", "/c"].map(std::path::PathBuf::from)
        );
    }

    #[test]
    fn run_has_exactly_the_flags_of_the_table() {
        let command = Cli::command();
        let run = command.find_subcommand("run").unwrap();
        for flag in Flag::RUN {
            let arg = run
                .get_arguments()
                .find(|a| a.get_long() == Some(flag.long))
                .unwrap_or_else(|| panic!("--{} missing", flag.long));
            assert_eq!(
                arg.get_env().and_then(|e| e.to_str()),
                Some(flag.env),
                "--{}",
                flag.long
            );
            // The field that holds a flag is named after it, so the derive
            // cannot hand one flag's value to another's field.
            assert_eq!(
                arg.get_id().as_str(),
                flag.long.replace('-', "_"),
                "--{}",
                flag.long
            );
            assert_eq!(
                arg.get_value_names().map(|v| v[0].as_str()),
                Some(flag.value_name)
            );
            assert_eq!(
                arg.get_help().map(ToString::to_string),
                Some(flag.help_line())
            );
            assert_eq!(arg.is_hide_env_values_set(), flag.is_secret());
        }
        let longs = run
            .get_arguments()
            .filter(|a| a.get_long().is_some())
            .count();
        assert_eq!(longs, Flag::RUN.len(), "run has flags the table lacks");
    }

    #[test]
    fn status_defaults_to_runs_admin_listener() {
        assert_eq!(
            DEFAULT_ADMIN_URL,
            format!("http://127.0.0.1:{}", sbmesh::DEFAULT_ADMIN_LISTEN.port())
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
