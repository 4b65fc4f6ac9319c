//! `sbproxy`: a test double of the sbproxy 1.13 reverse proxy, built to
//! the facts in `docs/reference.md#the-proxy`, for tests only (sbproxy
//! itself cannot be built on the test machines). It behaves as that section
//! says the real proxy does, and nothing more:
//!
//! - config from `-f FILE` / `--config FILE`, else `SB_CONFIG_FILE`;
//!   `${VAR}` substitution and the strict blocks come from the `sbmesh`
//!   library (one definition of each fact); it refuses to start (exit 1,
//!   the key named on stderr) on an unknown key of a strict block or a
//!   value of the wrong type; unknown top-level keys only warn;
//! - `proxy.admin`: `/healthz`, `/livez`, `/health`, `/readyz` and
//!   `POST /admin/reload` (HTTP Basic, `allow_ips`, `rate_limit_per_minute`);
//!   changes to `proxy.admin` need a restart (`degraded: ["proxy.admin"]`);
//! - the data port (`proxy.http_bind_port`), the TLS port
//!   (`proxy.https_bind_port`, the certificate read once at start-up, for
//!   every SNI name, never re-read), the proxy's own mesh ports when
//!   `proxy.cluster` is present, a log line when `proxy.acme.enabled`;
//! - `origins` on the data and TLS ports: a request whose Host (port
//!   stripped, case-insensitive) is an origin's hostname gets, whatever its
//!   method and path, a `mock` action's `status` (200), `body` ("") and
//!   `headers`; any other action (`proxy`, ...) or none gets `502` with a
//!   short text body (the stand-in has no upstreams and dials nothing).
//!   Another Host: `GET /health` is 200 (both ports), `GET /` 200 on the TLS
//!   port, anything else 404. The origins are those of the config running
//!   now: a reload or the watcher changes them together with the revision,
//!   a refused file does not. A `status` that is not an integer 200..599,
//!   a `body` that is not a string, a header that is not a valid name and
//!   value refuse the file (the path named); other keys of an origin are
//!   ignored. No wildcard matching (`*.example.com` is only that literal
//!   Host);
//! - its own watcher of the config file's directory (250 ms quiet, skipped
//!   when the sha256 is unchanged);
//! - SIGTERM / SIGINT drain within `SBPROXY_SHUTDOWN_GRACE_MS` (default
//!   30000) and exit 0; SIGHUP is logged and ignored.
//!
//! Test-only knobs (the real proxy has none of them):
//!
//! - `SBPROXY_STANDIN_BIND` (an IP): where the data, TLS and cluster
//!   sockets listen instead of `0.0.0.0`, so several pods can share one
//!   machine on 127.0.x.y (the admin API listens on `proxy.admin.bind`,
//!   as the real proxy does);
//! - `SBPROXY_STANDIN_RELOAD_MS` (default 50): how long a rebuild takes,
//!   so a test can provoke `409 reload in progress`;
//! - `SBPROXY_STANDIN_START_DELAY_MS` (default 0): a sleep before anything
//!   is bound, as the proxy's start-up time;
//! - `GET /admin/config/revision` on the admin port (HTTP Basic): the
//!   revision running now, e.g. what the watcher applied.

mod admin;
mod config;
mod log;
mod serve;
mod watch;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::net::{TcpListener, UdpSocket};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch as wch;

use crate::admin::{Applied, Shared};
use crate::log::{error, info, warning};

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            error!("cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(run());
    let code = match result {
        Ok(()) => 0,
        Err(message) => {
            error!("{message}");
            1
        }
    };
    // Do not wait for the watcher's thread or stray connections.
    std::process::exit(code);
}

fn config_path() -> Result<PathBuf, String> {
    let mut args = std::env::args().skip(1);
    let mut path = None;
    while let Some(arg) = args.next() {
        if arg == "-f" || arg == "--config" {
            path = Some(
                args.next()
                    .ok_or_else(|| format!("{arg} needs a file name"))?,
            );
        } else if let Some(p) = arg.strip_prefix("--config=") {
            path = Some(p.to_owned());
        } else {
            warning!("argument {arg:?} is ignored by the stand-in");
        }
    }
    path.or_else(|| {
        std::env::var("SB_CONFIG_FILE")
            .ok()
            .filter(|p| !p.is_empty())
    })
    .map(PathBuf::from)
    .ok_or_else(|| "no config file: pass -f FILE / --config FILE or set SB_CONFIG_FILE".into())
}

fn env_ms(name: &str, default: u64) -> Result<Duration, String> {
    match std::env::var(name) {
        Err(_) => Ok(Duration::from_millis(default)),
        Ok(v) => v
            .trim()
            .parse()
            .map(Duration::from_millis)
            .map_err(|_| format!("{name}={v:?}: expected a number of milliseconds")),
    }
}

async fn bind_tcp(addr: SocketAddr, what: &str) -> Result<TcpListener, String> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on TCP {addr} ({what}): {e}"))
}

async fn run() -> Result<(), String> {
    let path = config_path()?;
    let reload_delay = env_ms("SBPROXY_STANDIN_RELOAD_MS", 50)?;
    let start_delay = env_ms("SBPROXY_STANDIN_START_DELAY_MS", 0)?;
    let grace = env_ms("SBPROXY_SHUTDOWN_GRACE_MS", 30_000)?;
    let bind_ip: IpAddr = match std::env::var("SBPROXY_STANDIN_BIND") {
        Err(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|_| format!("SBPROXY_STANDIN_BIND={v:?}: expected an IP address"))?,
    };
    info!(
        "sbproxy stand-in (sbproxy 1.13 test double) starting, config {}",
        path.display()
    );

    let raw = std::fs::read(&path)
        .map_err(|e| format!("failed to read config file {}: {e}", path.display()))?;
    let settings = config::parse(&raw, &|name| std::env::var(name).ok())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    for w in &settings.warnings {
        warning!("{}: {w}", path.display());
    }
    let tls = match (&settings.tls_cert_file, &settings.tls_key_file) {
        (Some(cert), Some(key)) => Some(serve::load_tls(cert, key)?),
        _ => None,
    };
    if settings
        .admin_block
        .get("tls")
        .is_some_and(|t| !t.is_null())
    {
        warning!(
            "proxy.admin.tls is accepted, but the stand-in serves the admin API over plain HTTP"
        );
    }
    if settings.https_bind_port.is_some() && tls.is_none() && !settings.acme_enabled {
        return Err(
            "proxy.https_bind_port is set but proxy.tls_cert_file / proxy.tls_key_file are not"
                .into(),
        );
    }

    let mut term = signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM: {e}"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| format!("SIGINT: {e}"))?;
    let mut hup = signal(SignalKind::hangup()).map_err(|e| format!("SIGHUP: {e}"))?;
    if !start_delay.is_zero() {
        info!(
            "start-up delay of {} ms (SBPROXY_STANDIN_START_DELAY_MS)",
            start_delay.as_millis()
        );
        tokio::select! {
            _ = tokio::time::sleep(start_delay) => {}
            _ = term.recv() => { info!("SIGTERM during start-up; exiting"); return Ok(()) }
            _ = int.recv() => { info!("SIGINT during start-up; exiting"); return Ok(()) }
        }
    }

    let applied = Applied {
        revision: config::revision(&raw),
        loaded_at: log::rfc3339(SystemTime::now()),
        settings: settings.clone(),
    };
    let shared = Arc::new(Shared::new(path.clone(), applied, reload_delay));
    let (stop_tx, stop_rx) = wch::channel(false);
    let mut servers = tokio::task::JoinSet::new();

    if settings.admin.enabled {
        let addr = SocketAddr::new(settings.admin.bind, settings.admin.port);
        let listener = bind_tcp(addr, "proxy.admin.bind / proxy.admin.port").await?;
        info!("admin API listening on {addr}");
        let app = admin::router(shared.clone()).into_make_service_with_connect_info::<SocketAddr>();
        let stop = serve::stopped(stop_rx.clone());
        servers.spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(stop)
                .await
        });
    } else {
        info!("admin API disabled (proxy.admin.enabled is not true)");
    }

    let addr = SocketAddr::new(bind_ip, settings.http_bind_port);
    let listener = bind_tcp(addr, "proxy.http_bind_port").await?;
    info!("HTTP listening on {addr}");
    let stop = serve::stopped(stop_rx.clone());
    let app = serve::data_router(shared.clone());
    servers.spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stop)
            .await
    });

    match (settings.https_bind_port, tls) {
        (Some(port), Some(tls)) => {
            let addr = SocketAddr::new(bind_ip, port);
            let tcp = bind_tcp(addr, "proxy.https_bind_port").await?;
            let listener = serve::TlsListener::new(tcp, tls, stop_rx.clone())
                .map_err(|e| format!("TLS listener: {e}"))?;
            info!(
                "HTTPS listening on {addr} (certificate from {}, read once)",
                settings
                    .tls_cert_file
                    .as_deref()
                    .unwrap_or_else(|| "".as_ref())
                    .display()
            );
            let stop = serve::stopped(stop_rx.clone());
            let app = serve::tls_router(shared.clone());
            servers.spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(stop)
                    .await
            });
        }
        (Some(port), None) => warning!(
            "proxy.https_bind_port {port}: no proxy.tls_cert_file; the stand-in does not \
             serve ACME certificates, so no TLS listener"
        ),
        (None, _) => {}
    }

    if let Some(cluster) = settings.cluster {
        let gossip = SocketAddr::new(bind_ip, cluster.gossip_port);
        let udp = UdpSocket::bind(gossip).await.map_err(|e| {
            format!(
                "cannot bind UDP {gossip} (proxy.cluster.gossip_port {}): {e}",
                cluster.gossip_port
            )
        })?;
        let transport = SocketAddr::new(bind_ip, cluster.transport_port);
        let tcp = bind_tcp(
            transport,
            &format!("proxy.cluster.transport_port {}", cluster.transport_port),
        )
        .await?;
        info!("cluster: gossip listening on UDP {gossip}, transport on TCP {transport}");
        serve::hold_cluster_ports(udp, tcp, stop_rx.clone());
    }
    if settings.acme_enabled {
        info!(
            "proxy.acme.enabled: the real proxy would run its own ACME client for the \
             hostnames it has now, every 12 h (the stand-in does nothing)"
        );
    }

    let _watcher = watch::spawn(shared.clone(), stop_rx.clone())?;
    info!("started");

    let which = loop {
        tokio::select! {
            _ = term.recv() => break "SIGTERM",
            _ = int.recv() => break "SIGINT",
            _ = hup.recv() => info!("SIGHUP ignored (sbproxy 1.13 does not reload or re-read certificates on SIGHUP)"),
            Some(done) = servers.join_next() => {
                // A server ended on its own: only an I/O error does that.
                let _ = stop_tx.send(true);
                return Err(format!("a listener stopped: {done:?}"));
            }
        }
    };
    info!(
        "{which}: shutting down, draining for up to {} ms",
        grace.as_millis()
    );
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(grace, async {
        while servers.join_next().await.is_some() {}
    })
    .await;
    match drained {
        Ok(()) => info!("shutdown complete"),
        Err(_) => warning!("shutdown: grace period over, closing the remaining connections"),
    }
    Ok(())
}
