//! The data, TLS and cluster sockets.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::get;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{mpsc, watch};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::admin::Shared;
use crate::config::Action;
use crate::log::{info, warning};

/// Resolves when `shutdown` turns true.
pub async fn stopped(mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// The plain HTTP data port. A request whose Host is one of the running
/// config's `origins` gets that origin's answer ([`origin_layer`]);
/// otherwise `GET /health` is 200 (no origin matches the Host) and anything
/// else 404.
pub fn data_router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .layer(middleware::from_fn_with_state(shared, origin_layer))
}

/// The TLS port: the origins as on the data port; for any other Host,
/// `GET /` and `GET /health` are 200, so a client can complete a request
/// over the certificate it was served.
pub fn tls_router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/health", get(|| async { "ok" }))
        .layer(middleware::from_fn_with_state(shared, origin_layer))
}

/// Answers a request for a configured origin, from the config running now
/// (read per request, so a reload or the watcher changes the answer from
/// the moment the revision changes); hands any other request to `next`.
async fn origin_layer(State(shared): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let origins = shared.origins();
    let action = request_host(&request).and_then(|host| origins.get(&host));
    match action {
        None => next.run(request).await,
        Some(Action::Mock {
            status,
            body,
            headers,
        }) => {
            let mut response = Response::new(Body::from(body.clone()));
            *response.status_mut() = *status;
            for (name, value) in headers {
                response.headers_mut().append(name.clone(), value.clone());
            }
            response
        }
        Some(Action::Unsupported { kind }) => {
            let what = match kind {
                Some(kind) => format!("action type {kind:?}"),
                None => "no action".to_owned(),
            };
            let mut response = Response::new(Body::from(format!(
                "sbproxy stand-in: this origin has {what}; the stand-in has no upstreams \
                 and answers only mock actions\n"
            )));
            *response.status_mut() = StatusCode::BAD_GATEWAY;
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            );
            response
        }
    }
}

/// The request's hostname: the Host header (else the URI's authority),
/// without the port, lowercased.
fn request_host(request: &Request) -> Option<String> {
    let raw = match request.headers().get(header::HOST) {
        Some(h) => h.to_str().ok()?,
        None => request.uri().authority()?.as_str(),
    };
    let raw = raw.trim();
    let host = if let Some(rest) = raw.strip_prefix('[') {
        // An IPv6 literal: `[::1]:8080`.
        &raw[..rest.find(']')? + 2]
    } else {
        raw.rsplit_once(':').map_or(raw, |(host, _port)| host)
    };
    Some(host.to_ascii_lowercase())
}

/// The certificate chain (leaf first) and key, read once.
pub fn load_tls(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .and_then(|iter| iter.collect::<Result<_, _>>())
        .map_err(|e| format!("proxy.tls_cert_file {}: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "proxy.tls_cert_file {}: no PEM certificate in the file",
            cert.display()
        ));
    }
    let private = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| format!("proxy.tls_key_file {}: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_no_client_auth()
        .with_single_cert(certs, private)
        .map_err(|e| {
            format!(
                "proxy.tls_cert_file / proxy.tls_key_file ({}, {}): {e}",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// TLS connections, handshaken, for `axum::serve`.
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Accepts on `tcp` until `shutdown`, each handshake in its own task.
    pub fn new(
        tcp: TcpListener,
        config: Arc<ServerConfig>,
        shutdown: watch::Receiver<bool>,
    ) -> io::Result<Self> {
        let local = tcp.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(config);
        tokio::spawn(async move {
            let stop = stopped(shutdown);
            tokio::pin!(stop);
            loop {
                let (stream, peer) = tokio::select! {
                    _ = &mut stop => break,
                    accepted = tcp.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            warning!("TLS accept: {e}");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                };
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => warning!("TLS handshake from {peer}: {e}"),
                        Err(_) => warning!("TLS handshake from {peer}: timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { rx, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(conn) => conn,
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

/// Holds the proxy's own mesh ports (`proxy.cluster`) until `shutdown`:
/// datagrams are read and dropped, connections accepted and closed.
pub fn hold_cluster_ports(udp: UdpSocket, tcp: TcpListener, shutdown: watch::Receiver<bool>) {
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        let stop = stopped(stop);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                _ = udp.recv_from(&mut buf) => {}
            }
        }
    });
    tokio::spawn(async move {
        let stop = stopped(shutdown);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                accepted = tcp.accept() => {
                    if let Ok((conn, peer)) = accepted {
                        info!("cluster transport: closing a connection from {peer} (the stand-in has no mesh)");
                        drop(conn);
                    }
                }
            }
        }
    });
}
