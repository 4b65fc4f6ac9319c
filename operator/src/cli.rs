//! Command line of `sbmesh-operator` (docs/reference.md#operator-commands).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Image used for the sidecar (and the operator Deployment) when nothing
/// else names one: this build's own image.
pub const DEFAULT_IMAGE: &str = concat!("ghcr.io/sbproxy/sbmesh:", env!("CARGO_PKG_VERSION"));

/// `sbmesh-operator`
#[derive(Debug, Parser)]
#[command(
    name = "sbmesh-operator",
    version,
    about = "Renders and applies sbproxy StatefulSets that carry the sbmesh sidecar"
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the controller.
    Run(RunArgs),
    /// Print the CustomResourceDefinitions as YAML.
    Crds,
    /// Print CRDs, ServiceAccount, RBAC and the operator Deployment as YAML.
    Install(InstallArgs),
    /// Print exactly the objects `run` would apply for SBProxy/SBProxyConfig documents.
    Render(RenderArgs),
    /// Add the sidecar to an existing StatefulSet or Deployment manifest.
    Inject(InjectArgs),
}

/// `run`
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Watch SBProxies in this namespace only (default: the operator's own,
    /// from the service account, else `default`).
    #[arg(
        long,
        env = "SBMESH_OPERATOR_NAMESPACE",
        conflicts_with = "all_namespaces"
    )]
    pub namespace: Option<String>,
    /// Watch SBProxies in every namespace.
    #[arg(long)]
    pub all_namespaces: bool,
    /// Reconcile without taking the leader Lease (one replica only).
    #[arg(long)]
    pub no_leader_election: bool,
    /// Where `/metrics` and `/healthz` are served.
    #[arg(long, env = "SBMESH_METRICS_LISTEN", default_value = "0.0.0.0:8080")]
    pub metrics_listen: SocketAddr,
    /// Sidecar image for SBProxies that do not name one.
    #[arg(long, env = "SBMESH_SIDECAR_IMAGE", default_value = DEFAULT_IMAGE)]
    pub sidecar_image: String,
    /// Namespace of the leader Lease (default: the operator's own namespace).
    #[arg(long, env = "SBMESH_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Identity in the leader Lease (default: the pod name, else the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Drain budget for in-flight reconciles after SIGTERM/SIGINT.
    #[arg(long, env = "SBPROXY_SHUTDOWN_GRACE_MS", default_value_t = 30_000)]
    pub shutdown_grace_ms: u64,
    /// `json` or `text` (default: json when stderr is not a terminal).
    #[arg(long, env = "SBMESH_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Where the injection webhook is served (HTTPS, every replica).
    #[arg(
        long,
        env = "SBMESH_WEBHOOK_LISTEN",
        default_value_t = SocketAddr::from(([0, 0, 0, 0], crate::webhook::DEFAULT_PORT))
    )]
    pub webhook_listen: SocketAddr,
    /// Life of the webhook's serving certificate, in seconds; renewed when
    /// a third of it is left.
    #[arg(
        long,
        env = "SBMESH_WEBHOOK_CERT_LIFETIME_SECS",
        default_value_t = crate::webhook::DEFAULT_LIFETIME.as_secs(),
        value_parser = clap::value_parser!(u64).range(60..=crate::webhook::MAX_LIFETIME.as_secs())
    )]
    pub webhook_cert_lifetime_secs: u64,
}

/// RBAC scope of `install`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RbacScope {
    /// A Role and RoleBinding: the operator manages its own namespace.
    Namespace,
    /// A ClusterRole and ClusterRoleBinding: every namespace.
    Cluster,
}

/// `install`
#[derive(Debug, Clone, Args)]
pub struct InstallArgs {
    /// Namespace the operator runs in.
    #[arg(long, default_value = "sbmesh-system")]
    pub namespace: String,
    /// What the operator may manage.
    #[arg(long, value_enum, default_value = "namespace")]
    pub rbac_scope: RbacScope,
    /// Operator (and default sidecar) image.
    #[arg(long, default_value = DEFAULT_IMAGE)]
    pub image: String,
}

/// `render`
#[derive(Debug, Clone, Args)]
pub struct RenderArgs {
    /// YAML files with SBProxy and SBProxyConfig documents (`-` for stdin).
    #[arg(short = 'f', long = "filename", required = true)]
    pub files: Vec<PathBuf>,
    /// Sidecar image for SBProxies that do not name one.
    #[arg(long, env = "SBMESH_SIDECAR_IMAGE", default_value = DEFAULT_IMAGE)]
    pub sidecar_image: String,
}

/// `inject`
#[derive(Debug, Clone, Args)]
pub struct InjectArgs {
    /// The StatefulSet or Deployment manifest (`-` for stdin).
    #[arg(short = 'f', long = "filename")]
    pub file: PathBuf,
    /// Sidecar image.
    #[arg(long, default_value = DEFAULT_IMAGE)]
    pub sidecar_image: String,
    /// Cluster id (default: the workload's name).
    #[arg(long)]
    pub cluster_id: Option<String>,
    /// Headless Service whose records are the mesh seeds.
    #[arg(long)]
    pub mesh_service: Option<String>,
}

/// Writes a command's output to stdout. A reader that stopped reading
/// (`install | head`) is not an error: the command ends quietly, as
/// shell tools do; any other write error is.
pub fn print_out(text: &str) -> anyhow::Result<std::process::ExitCode> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(std::process::ExitCode::SUCCESS),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(std::process::ExitCode::SUCCESS),
        Err(e) => Err(anyhow::anyhow!("cannot write to stdout: {e}")),
    }
}
