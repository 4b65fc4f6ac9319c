//! Serving the admin and challenge routers on ports anyone can reach:
//! a header-read timeout, which also closes idle keep-alive connections, and
//! a connection limit that closes the oldest idle connection to admit a new
//! one, so `/healthz`, `/readyz` and the CA's validation requests keep being
//! answered however many idle or trickling connections are open.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinSet};
use tower::ServiceExt;
use tracing::{debug, warn};

use crate::metrics::{ListenerLabels, Metrics};

/// How long a connection may take to send a complete request head, counted
/// from its opening or the end of the previous response: a slowloris
/// connection and an idle keep-alive one are closed after this long.
/// Probes and the CA send their request at once; Prometheus reconnects.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// On shutdown, how long a connection without a request in flight may take
/// to close by itself before it is dropped.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// Most connections one listener keeps open: a quarter of the process's
/// file descriptor limit (the rest is for the other listener, the mesh, the
/// store and the proxy), at most 1024.
pub(crate) fn max_connections() -> usize {
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    (nofile / 4).clamp(32, 1024) as usize
}

/// What [`serve`] is given.
pub struct Listener {
    /// `admin` or `challenge`: the `listener` label and the log field.
    pub name: &'static str,
    /// Open connections kept at most (see `max_connections`).
    pub max_connections: usize,
    /// See [`HEADER_READ_TIMEOUT`].
    pub header_read_timeout: Duration,
}

/// One open connection: its requests in flight, and how to close it.
struct Conn {
    in_flight: Arc<AtomicUsize>,
    handle: AbortHandle,
}

/// Serves `router` (with `ConnectInfo<SocketAddr>`) on `listener` until
/// `stop` turns true, then lets connections finish their current request.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Listener,
    metrics: Arc<Metrics>,
    mut stop: watch::Receiver<bool>,
) {
    let conns: Arc<Mutex<BTreeMap<u64, Conn>>> = Arc::default();
    let mut tasks = JoinSet::new();
    let mut next_id = 0u64;
    let mut warned_full = false;
    loop {
        while tasks.try_join_next().is_some() {}
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, mostly: wait for some to close.
                    debug!(listener = limits.name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stopped(&mut stop) => break,
        };
        let mut table = conns.lock().unwrap_or_else(PoisonError::into_inner);
        if table.len() >= limits.max_connections {
            let idle = table
                .iter()
                .find(|(_, c)| c.in_flight.load(Ordering::Relaxed) == 0)
                .map(|(id, _)| *id);
            count_closed(&metrics, limits.name, "limit");
            if !warned_full {
                warned_full = true;
                warn!(
                    listener = limits.name,
                    max_connections = limits.max_connections,
                    "connection limit reached: closing the oldest idle connections to admit new \
                     ones (see sbmesh_http_connections_closed_total)"
                );
            }
            match idle.and_then(|id| table.remove(&id)) {
                Some(oldest) => oldest.handle.abort(),
                // Every connection is in a request: refuse this one.
                None => continue,
            }
        } else if table.len() < limits.max_connections / 2 {
            warned_full = false;
        }
        let id = next_id;
        next_id += 1;
        let in_flight = Arc::new(AtomicUsize::new(0));
        let conn = connection(
            stream,
            peer,
            router.clone(),
            in_flight.clone(),
            limits.header_read_timeout,
            stop.clone(),
        );
        let (conns_ref, metrics_ref) = (conns.clone(), metrics.clone());
        let name = limits.name;
        // Registered under the lock, so the task cannot leave the table
        // before it entered it.
        let handle = tasks.spawn(async move {
            if conn.await {
                count_closed(&metrics_ref, name, "header_timeout");
            }
            conns_ref
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&id);
        });
        table.insert(id, Conn { in_flight, handle });
    }
    drop(listener);
    // Idle connections close at once; busy ones after their response.
    while tasks.join_next().await.is_some() {}
}

fn count_closed(metrics: &Metrics, listener: &'static str, reason: &'static str) {
    metrics
        .http
        .connections_closed
        .get_or_create(&ListenerLabels { listener, reason })
        .inc();
}

/// Serves one connection; true when it was closed by the header timeout.
async fn connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    router: Router,
    in_flight: Arc<AtomicUsize>,
    header_read_timeout: Duration,
    mut stop: watch::Receiver<bool>,
) -> bool {
    let requests = in_flight.clone();
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        let busy = InFlight::enter(requests.clone());
        let router = router.clone();
        async move {
            let response = router.oneshot(req).await;
            // Busy until the body is sent (or the connection drops it): a
            // long response (one passed through from the proxy) is not an
            // idle connection the limit may close.
            response.map(|r| {
                r.map(|body| {
                    Body::new(body.map_frame(move |frame| {
                        let _busy = &busy;
                        frame
                    }))
                })
            })
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        _ = stopped(&mut stop) => {
            // Idle connections close at once, a request in flight is
            // answered; one that is half-way through a request head is
            // not waited for (the header timeout would hold the drain).
            conn.as_mut().graceful_shutdown();
            loop {
                tokio::select! {
                    r = conn.as_mut() => break r,
                    _ = tokio::time::sleep(SHUTDOWN_GRACE) => {
                        if in_flight.load(Ordering::Relaxed) == 0 {
                            break Ok(());
                        }
                    }
                }
            }
        }
    };
    match result {
        Ok(()) => false,
        Err(e) if e.is_timeout() => true,
        Err(e) => {
            debug!(%peer, error = %e, "http connection ended with an error");
            false
        }
    }
}

/// Counts a request in flight on its connection while it lives (until its
/// response body is sent), so the limit closes only connections that wait
/// for a request.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn enter(count: Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Self(count)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Resolves once `stop` is true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
