//! `sbmesh-sidecar run`: starts the library's [`Node`] with the resolved
//! settings (everything the sidecar does lives there, so a proxy embedding
//! the library gets the same), and runs it until SIGTERM/SIGINT, then
//! drains.

use anyhow::anyhow;
use sbmesh::{Drain, Node, NodeError};
use tracing::{info, warn};

use crate::settings::Settings;

/// Exit code after a clean drain.
pub const EXIT_OK: i32 = 0;
/// Exit code when the drain budget ran out.
pub const EXIT_DRAIN_TIMEOUT: i32 = 1;

/// A start-up error in the words of the command line.
fn in_flag_terms(e: NodeError) -> anyhow::Error {
    match e {
        NodeError::Bind { what, addr, source } => {
            anyhow!(source).context(format!("binding --{what}-listen {addr}"))
        }
        NodeError::Reload(e) => anyhow!("--proxy-reload-url / --proxy-authorization: {e}"),
        other => anyhow!(other),
    }
}

/// Runs the sidecar; returns the process exit code.
pub async fn run(settings: Settings) -> anyhow::Result<i32> {
    let node = Node::start(settings.node).await.map_err(in_flag_terms)?;
    let shown =
        |addr: Option<std::net::SocketAddr>| addr.map_or_else(String::new, |a| a.to_string());
    info!(
        admin = %shown(node.admin_addr()),
        challenge = %shown(node.challenge_addr()),
        "sidecar running"
    );
    // Start-up code runs once; its pages need not stay resident.
    tokio::spawn(async {
        tokio::time::sleep(crate::memory::STARTUP_SETTLE).await;
        let _ = tokio::task::spawn_blocking(crate::memory::release_startup_pages).await;
    });

    let signal = shutdown_signal().await;
    info!(
        signal,
        grace_ms = settings.shutdown_grace.as_millis() as u64,
        "draining"
    );
    match node.shutdown(settings.shutdown_grace).await {
        Drain::Clean => {
            info!("drained");
            Ok(EXIT_OK)
        }
        Drain::TimedOut => {
            warn!("drain budget ran out");
            Ok(EXIT_DRAIN_TIMEOUT)
        }
    }
}

async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return "SIGINT";
        }
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = tokio::signal::ctrl_c() => "SIGINT",
    }
}
