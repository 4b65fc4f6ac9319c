//! sbmesh: the gossip mesh, certificate stores, ACME issuer and config
//! reload watcher that let several sbproxy replicas act as one fleet.
//!
//! The `sbmesh-sidecar` binary composes these parts; a Rust proxy can link
//! them in-process instead.
//!
//! # Embedding a node
//!
//! [`node::Node::start`] starts everything the sidecar runs (the mesh,
//! the certificate store, the ACME manager and its challenge responder,
//! the config watcher, the node metadata and readiness) from one
//! [`node::NodeConfig`]. [`tls::CertResolver`] serves the node's
//! certificates from a rustls server: self-signed placeholders at first,
//! then the CA's, each new one from the next handshake on.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use sbmesh::node::{Node, NodeConfig};
//! use sbmesh::tls::{CertResolver, DefaultCertificate};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! // Origins and `proxy.extensions.sbmesh.acme` come from sb.yml, which is
//! // followed: an origin added there is ordered without a restart.
//! let mut cfg = NodeConfig::from_file("demo-proxy-0", "demo", "/etc/sbproxy/sb.yml")?;
//! cfg.cluster_key = Some(vec![[7u8; 32]]); // `sbmesh-sidecar keygen`, from a Secret
//! cfg.mesh_service = Some("demo-mesh.default.svc.cluster.local".into());
//! cfg.challenge_listen = Some("0.0.0.0:80".parse()?); // where HTTP-01 arrives
//! cfg.admin_listen = Some("0.0.0.0:9091".parse()?); // /readyz, /metrics, /admin/*
//! let node = Node::start(cfg).await?;
//!
//! let resolver = CertResolver::following(node.certificates(), DefaultCertificate::First);
//! let tls_config: Arc<rustls::ServerConfig> = Arc::new(sbmesh::tls::server_config(resolver)?);
//! // ... accept connections with `tls_config` (e.g. tokio-rustls) ...
//! # let _ = tls_config;
//!
//! node.shutdown(Duration::from_secs(30)).await; // leaves the mesh, drains
//! # Ok(())
//! # }
//! ```
//!
//! `examples/embed.rs` is a complete HTTPS server built this way.
//!
//! # Embedding the mesh alone
//!
//! ```no_run
//! use std::sync::Arc;
//! use sbmesh::{Mesh, MeshConfig, Metrics, NodeMeta};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let key = [7u8; 32]; // in production: `sbmesh-sidecar keygen`, from a Secret
//! // 0.0.0.0, UDP 7946 and TCP 8946, the default SWIM timing.
//! let mut cfg = MeshConfig::new("demo-proxy-0", "demo", vec![key]);
//! cfg.seeds.mesh_service = Some("demo-mesh.default.svc.cluster.local".into());
//! let mesh = Mesh::start(
//!     cfg,
//!     Arc::new(Metrics::new()),
//!     NodeMeta { version: "0.1.0".into(), ready: true, ..Default::default() },
//! )
//! .await?;
//! if let Some(status) = mesh.status().await {
//!     println!("{} members", status.summary.total_nodes);
//! }
//! mesh.leave().await;
//! # Ok(())
//! # }
//! ```

#![warn(clippy::too_many_lines)]
// Only the code that ships is held to it: the build without tests checks
// every function of it, so test builds need not.
#![cfg_attr(test, allow(clippy::too_many_lines))]

/// Declares internal modules: crate-private, and public only with the
/// `testing` feature, through which this workspace's integration tests and
/// benches reach them. Not part of the API.
macro_rules! internal_mod {
    ($($(#[$attr:meta])* $name:ident;)*) => {
        $(
            $(#[$attr])*
            #[cfg(feature = "testing")]
            pub mod $name;
            $(#[$attr])*
            #[cfg(not(feature = "testing"))]
            pub(crate) mod $name;
        )*
    };
}

pub use mesh::{Mesh, MeshConfig, MeshError, NodeMeta, SeedSource, SwimTuning};
pub use metrics::Metrics;
pub use node::{Node, NodeConfig, NodeError};
pub use store::{Store, StoreError};
pub use tls::{CertResolver, DefaultCertificate, TlsError};

pub mod acme;
pub mod config;
pub mod flags;
pub mod http;
pub mod identity;
pub mod keyring;
pub mod mesh;
pub mod metrics;
pub mod node;
internal_mod! { proxy; }
pub mod reload;
pub mod store;
pub mod tls;
