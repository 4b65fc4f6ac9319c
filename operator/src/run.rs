//! `sbmesh-operator run`: logging, the API client, `/metrics` + `/healthz`
//! (+ `/readyz`), the injection webhook (every replica), leader election,
//! then the controller, until a signal or a lost Lease.
//!
//! Exit codes: 0 after SIGTERM/SIGINT once in-flight reconciles drained (and
//! the Lease was released), 0 when leadership is lost (a Deployment
//! restarts the process as a follower), 1 when the drain budget
//! (`--shutdown-grace-ms`) ran out, or on a startup error.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use kube::Client;
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::admit;
use crate::cli::RunArgs;
use crate::leader::{self, Elector, Held, LeaseConfig};
use crate::reconcile::{self, Context, Scope};
use crate::telemetry::{self, Metrics};
use crate::webhook;

/// Exit code after a clean stop.
pub const EXIT_OK: u8 = 0;
/// Exit code when in-flight reconciles outlived the drain budget.
pub const EXIT_DRAIN_TIMEOUT: u8 = 1;

/// Why the controller stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// SIGTERM or SIGINT.
    Signal,
    /// Another process holds the Lease now.
    LostLease,
}

/// The `run` command.
pub fn command(args: RunArgs) -> anyhow::Result<ExitCode> {
    telemetry::init_logging(args.log_format.as_deref())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let code = runtime.block_on(run(args));
    // Reconciles that outlived the drain budget, and open watch requests,
    // must not hold the exit.
    runtime.shutdown_timeout(Duration::from_millis(500));
    Ok(ExitCode::from(code?))
}

/// Runs the operator; returns the process exit code.
pub async fn run(args: RunArgs) -> anyhow::Result<u8> {
    // Handlers first: a SIGTERM during startup or while following must
    // still end the process cleanly.
    let (stop_tx, mut stop_rx) = watch::channel::<Option<Stop>>(None);
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = sigterm.recv() => info!("SIGTERM: stopping"),
                _ = sigint.recv() => info!("SIGINT: stopping"),
            }
            stop_tx.send_replace(Some(Stop::Signal));
        });
    }

    let client = Client::try_default()
        .await
        .context("no Kubernetes API configuration (KUBECONFIG, ~/.kube/config or the in-cluster service account)")?;
    let own_namespace = leader::own_namespace(&client);
    let scope = if args.all_namespaces {
        Scope::All
    } else {
        Scope::Namespace(
            args.namespace
                .clone()
                .unwrap_or_else(|| own_namespace.clone()),
        )
    };
    let identity = args.identity.clone().unwrap_or_else(leader::hostname);
    let webhook = webhook::Settings {
        listen: args.webhook_listen,
        namespace: own_namespace.clone(),
        lifetime: Duration::from_secs(args.webhook_cert_lifetime_secs),
        defaults: admit::Defaults {
            sidecar_image: args.sidecar_image.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        },
    };
    let plan = Plan {
        lease: (!args.no_leader_election).then(|| {
            let namespace = args.lease_namespace.clone().unwrap_or(own_namespace);
            LeaseConfig::new(namespace, identity.clone())
        }),
        scope,
        identity,
        sidecar_image: args.sidecar_image.clone(),
        grace: Duration::from_millis(args.shutdown_grace_ms),
    };
    let metrics = Arc::new(Metrics::new());

    let (http_stop_tx, http_stop_rx) = watch::channel(false);
    let listener = TcpListener::bind(args.metrics_listen)
        .await
        .with_context(|| format!("binding --metrics-listen {}", args.metrics_listen))?;
    let metrics_addr = listener
        .local_addr()
        .context("reading the metrics address")?;
    info!(addr = %metrics_addr, "serving /metrics and /healthz");
    let current = Arc::new(webhook::Current::default());
    let http = tokio::spawn(telemetry::serve(
        listener,
        metrics.clone(),
        current.clone(),
        http_stop_rx.clone(),
    ));
    // Every replica answers admissions, leader or not.
    let webhook_listener = TcpListener::bind(webhook.listen)
        .await
        .with_context(|| format!("binding --webhook-listen {}", webhook.listen))?;
    let webhook = tokio::spawn(webhook::run(
        client.clone(),
        webhook_listener,
        webhook,
        metrics.clone(),
        current,
        http_stop_rx,
    ));

    let code = lead_and_reconcile(plan, client, metrics, (stop_tx, &mut stop_rx)).await;

    http_stop_tx.send_replace(true);
    let _ = tokio::time::timeout(Duration::from_secs(2), http).await;
    let _ = tokio::time::timeout(webhook::DRAIN + Duration::from_secs(1), webhook).await;
    Ok(code)
}

/// What `run` resolved from the command line and the environment.
struct Plan {
    /// The leader Lease; `None` with `--no-leader-election`.
    lease: Option<LeaseConfig>,
    scope: Scope,
    identity: String,
    sidecar_image: String,
    /// Drain budget after a stop.
    grace: Duration,
}

async fn lead_and_reconcile(
    plan: Plan,
    client: Client,
    metrics: Arc<Metrics>,
    (stop_tx, stop_rx): (
        watch::Sender<Option<Stop>>,
        &mut watch::Receiver<Option<Stop>>,
    ),
) -> u8 {
    let mut elector = match plan.lease {
        None => {
            info!("leader election disabled");
            None
        }
        Some(config) => {
            info!(lease = %config.name, namespace = %config.namespace, identity = %config.identity, "waiting for the leader Lease");
            Some(Elector::new(client.clone(), config))
        }
    };

    if let Some(el) = elector.as_mut() {
        tokio::select! {
            _ = el.acquire() => {}
            _ = stop_rx.wait_for(Option::is_some) => {
                // The acquire round in flight may have won just now.
                release(el).await;
                return EXIT_OK;
            }
        }
    }
    metrics.set_leader(true);

    // The Lease is renewed while the controller runs and while it drains,
    // so no other process starts before this one has stopped.
    let (keeper_stop_tx, keeper_stop_rx) = watch::channel(false);
    let keeper = keep_lease(elector, &stop_tx, keeper_stop_rx);

    let ctx = Arc::new(Context::new(
        client,
        plan.sidecar_image,
        metrics.clone(),
        reconcile::reporter(Some(plan.identity)),
    ));
    let grace = plan.grace;
    let drained = control_until_stopped(ctx, plan.scope, stop_rx, grace).await;
    metrics.set_leader(false);
    let reason = *stop_rx.borrow();
    if drained {
        info!("in-flight reconciles drained");
    } else {
        warn!(
            grace_ms = grace.as_millis(),
            "drain budget ran out with reconciles in flight"
        );
    }

    if let Some(keeper) = keeper {
        keeper_stop_tx.send_replace(true);
        match keeper.await {
            Ok((mut el, Held::Stopped)) => release(&mut el).await,
            Ok((_, Held::Lost { .. })) => {}
            Err(e) => warn!(error = %e, "the Lease renewal task failed"),
        }
    }

    match reason {
        // Leadership loss ends the process whatever the drain did: a new
        // leader is already at work, and a restart makes this a follower.
        Some(Stop::LostLease) => EXIT_OK,
        Some(Stop::Signal) if drained => EXIT_OK,
        Some(Stop::Signal) => EXIT_DRAIN_TIMEOUT,
        None => {
            warn!("the controller stopped without being asked to");
            EXIT_DRAIN_TIMEOUT
        }
    }
}

/// Renews the Lease (when there is an elector) until `stop` says true; a
/// Lease lost meanwhile stops the process (`stop_tx`), unless a signal
/// came first. Ends with the elector and how the holding ended.
fn keep_lease(
    elector: Option<Elector>,
    stop_tx: &watch::Sender<Option<Stop>>,
    mut stop: watch::Receiver<bool>,
) -> Option<tokio::task::JoinHandle<(Elector, Held)>> {
    elector.map(|mut el| {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            let held = el
                .hold(async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await;
            if let Held::Lost { reason } = &held {
                warn!(%reason, "lost the leader Lease: stopping");
                // A signal that came first keeps its reason.
                stop_tx.send_if_modified(|s| {
                    if s.is_none() {
                        *s = Some(Stop::LostLease);
                        true
                    } else {
                        false
                    }
                });
            }
            (el, held)
        })
    })
}

/// Runs the controllers (SBProxies, injected pods, missed injections)
/// until a stop, then waits for the reconciles in flight for at most
/// `grace`: whether they all ended.
async fn control_until_stopped(
    ctx: Arc<Context>,
    scope: Scope,
    stop_rx: &mut watch::Receiver<Option<Stop>>,
    grace: Duration,
) -> bool {
    let trigger = |mut rx: watch::Receiver<Option<Stop>>| async move {
        let _ = rx.wait_for(Option::is_some).await;
    };
    info!(scope = ?scope, "starting the controller");
    let running = ctx.clone();
    let injected = crate::injected::run(ctx.clone(), scope.clone(), trigger(stop_rx.clone()));
    let missed = crate::missed::run(ctx.clone(), scope.clone(), trigger(stop_rx.clone()));
    let controller = reconcile::run(ctx, scope, trigger(stop_rx.clone()));
    let controller = async move {
        futures::join!(controller, injected, missed);
    };
    tokio::pin!(controller);
    let mut stopped = stop_rx.clone();
    tokio::select! {
        _ = &mut controller => true,
        // Stopped and nothing in flight (see `Context::in_flight`).
        _ = async {
            let _ = stopped.wait_for(Option::is_some).await;
            while running.in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        } => true,
        _ = async {
            let _ = stop_rx.wait_for(Option::is_some).await;
            tokio::time::sleep(grace).await;
        } => false,
    }
}

async fn release(el: &mut Elector) {
    match tokio::time::timeout(Duration::from_secs(5), el.release()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => warn!(error = %e, "could not release the leader Lease; it expires by itself"),
        Err(_) => warn!("releasing the leader Lease timed out; it expires by itself"),
    }
}
