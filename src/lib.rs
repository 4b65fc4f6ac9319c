//! sbmesh: the gossip mesh, certificate stores, ACME issuer and config
//! reload watcher that let several sbproxy replicas act as one fleet.
//!
//! The `sbmesh-sidecar` binary composes these parts; a Rust proxy can link
//! them in-process instead.
//!
//! # Embedding a node
//!
//! [`Node::start`] starts everything the sidecar runs (the mesh,
//! the certificate store, the ACME manager and its challenge responder,
//! the config watcher, the node metadata and readiness) from one
//! [`NodeConfig`]. [`tls::CertResolver`] serves the node's
//! certificates from a rustls server: self-signed placeholders at first,
//! then the CA's, each new one from the next handshake on.
//!
//! ```no_run
//! use std::sync::Arc;
//! use std::time::Duration;
//! use sbmesh::tls::{CertResolver, DefaultCertificate};
//! use sbmesh::{Node, NodeConfig};
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

mod acme;
mod config;
mod flags;
mod http;
mod identity;
mod keyring;
mod mesh;
mod metrics;
mod node;
mod proxy;
mod reload;
mod resolver;
mod store;

// The API: every public item of the crate is re-exported here, and only
// here. The modules are private; what they declare `pub` and is not named
// below is for the crate itself (or for `internal`, further down). One
// namespace is kept, `tls`, because the contract (SPEC section 6) names it.

// Embedding a node (its certificates are served by `tls`, below).
pub use node::{
    Drain, Node, NodeCertificate, NodeConfig, NodeError, ProxyReload, ProxyRestart, ProxySettings,
};

/// Serving the node's certificates from a rustls server: [`CertResolver`]
/// (a rustls `ResolvesServerCert`) follows
/// [`Node::certificates`](crate::Node::certificates), so a new
/// certificate is served from the next handshake on, without a reload or a
/// restart.
///
/// [`CertResolver`]: tls::CertResolver
pub mod tls {
    pub use crate::resolver::{CertResolver, DefaultCertificate, TlsError, server_config};
}

// The mesh alone, and what a node tells the others.
pub use identity::{
    AddrError, IdError, default_cluster_id, default_node_id, mesh_service_fqdn, normalize_seed,
    parse_advertise, validate_cluster_id, validate_node_id,
};
pub use keyring::{KeyRing, KeyRingError, display_key_id};
pub use mesh::{
    AcmeInfo, CertificateInfo, ClusterStatus, LastReload, MAX_FAILING_ERROR, MAX_FAILING_IN_META,
    MemberInfo, MemberState, Mesh, MeshConfig, MeshError, NodeIdentity, NodeMeta, NodeStatus,
    OrderFailing, OrderWaiting, ProxyInfo, SeedSource, Summary, SwimTuning,
};

// sb.yml: its model, reading it, and its defaults.
pub use config::sbproxy::{UnknownKey, unknown_keys};
pub use config::{
    AcmeSection, AdminSection, CertApply, CertificateMode, Challenge,
    DEFAULT_DNS_PROPAGATION_TIMEOUT, DEFAULT_GOSSIP_PORT, DEFAULT_PROXY_ADMIN_BIND,
    DEFAULT_PROXY_ADMIN_PASSWORD, DEFAULT_PROXY_ADMIN_PORT, DEFAULT_PROXY_ADMIN_USER,
    DEFAULT_TRANSPORT_PORT, DNS_PORT, Dns01Section, DnsProvider, Eab, EnvLookup, Interpolated,
    KeyGenError, KeySource, Loaded, Problem, ProxyAcme, ProxyCluster, ProxySection, SbConfig,
    SbmeshSection, Severity, SidecarPorts, StorageBackend, TsigAlgorithm, Unresolved, child_path,
    config_conflicts, generate_key, interpolate, interpolate_report, key_to_hex, load_config,
    local_url, parse_config, parse_interpolated_config, parse_key_ring, resolve_field,
    resolve_key_source, sha256_hex, unresolved_in, unresolved_message,
};

// The sidecar's flags, each written once.
pub use flags::{
    DEFAULT_ADMIN_LISTEN, DEFAULT_CHALLENGE_LISTEN, DEFAULT_CLUSTER_DOMAIN, DEFAULT_CONFIG_PATH,
    DEFAULT_NAMESPACE, DEFAULT_SHUTDOWN_GRACE, Flag, FlagDefault, FlagKind, FlagValue,
};

// Certificate stores and their lease locks.
pub use store::file::FileStore;
pub use store::lock::{
    Clock, FencedEntry, KeeperTiming, Lease, LeaseKeeper, LeaseLock, LockError, LockRecord,
    LostReason, get_fenced, put_fenced, put_fenced_by_claims,
};
pub use store::memory::MemoryStore;
pub use store::object::{ObjectBackend, ObjectLocation};
pub use store::redb::RedbStore;
pub use store::redis::RedisStore;
pub use store::{
    Entry, MAX_KEY_LEN, MAX_VALUE_BYTES, Store, StoreError, Version, now_unix_ms, validate_key,
    validate_prefix, validate_value,
};

// ACME: where certificates are written, how fast orders may go.
pub use acme::{AcmeLimits, CHAIN_FILE, KEY_FILE};

// Following the proxy's config and reloading it.
pub use reload::{
    ReloadError, ReloadStatus, ReloadTiming, Reloader, ReloaderConfig, ReloaderHandle,
};

// The HTTP listeners' parts an embedder mounts.
pub use http::AdminAuth;
pub use http::passthrough::{InvalidUpstream, Passthrough, Upstream, with_passthrough};

// Metrics: one registry, and the label sets of its families.
pub use metrics::{
    AcmeMetrics, BackendLabels, BackendOpLabels, CertExpiry, HostLabels, HttpMetrics,
    ListenerLabels, MeshMetrics, Metrics, PASSTHROUGH_RESULTS, PeerState, ProxyMetrics,
    ReasonLabels, ReloaderMetrics, ResultLabels, STORE_SECONDS_BUCKETS, StateLabels, StoreMetrics,
    StoreOpLabels, TRANSPORT_REFUSED_REASONS, Transport, TransportLabels,
};

/// The crate's internals that this workspace's own tests, benches and
/// stand-ins reach: the simulator, the protocol cores' parts, the ACME and
/// store helpers the test servers drive. **Not part of the API**: hidden
/// from the docs and free to change in any release; an embedder uses the
/// items above. Each module here is named after the one it opens.
#[doc(hidden)]
pub mod internal {
    pub mod account {
        pub use crate::acme::account::{AccountSettings, AcmeError, load_or_create};
    }
    pub mod certs {
        pub use crate::acme::certs::{CertRecord, parse_chain};
    }
    pub mod challenge {
        pub use crate::acme::challenge::{ChallengeBook, Lookup, challenge_router};
    }
    pub mod http_client {
        pub use crate::acme::http_client::AcmeHttpClient;
    }
    pub mod issuer {
        pub use crate::acme::issuer::{Issuer, certificate_identifier};
    }
    pub mod layout {
        pub use crate::acme::layout::{
            SAN_PREFIX, account, certificate, directory_id, hostname_set_id, issued, order_budget,
            order_state,
        };
    }
    pub mod manager {
        pub use crate::acme::manager::{AcmeInputs, AcmeManager, AcmeManagerConfig};
    }
    pub mod ownership {
        pub use crate::acme::ownership::owner;
    }
    pub mod placeholder {
        pub use crate::acme::placeholder::{generate, is_placeholder};
    }
    pub mod schedule {
        pub use crate::acme::schedule::{IssuanceHistory, OrderBudget, UnitOrderState};
    }
    pub mod unit {
        pub use crate::acme::unit::CertUnit;
    }
    pub mod listener {
        pub use crate::http::listener::{HEADER_READ_TIMEOUT, Listener, serve};
    }
    pub mod member {
        pub use crate::mesh::member::RENEW_STEP;
    }
    pub mod sim {
        pub use crate::mesh::sim::{Seeds, Sim, SimConfig, Start};
    }
    pub mod proxy {
        pub use crate::proxy::procs::terminate;
        pub use crate::proxy::{
            ProxyStatus, RESTART_LEASE, RestartConfig, RestartCoordinator, TlsWatcher,
            WatchTlsConfig, restart_lease, restart_readiness, watch_tls_readiness,
        };
    }
    pub mod instrumented {
        pub use crate::store::instrumented::Instrumented;
    }
    pub mod sealed {
        pub use crate::store::sealed::{open_record, seal_record};
    }
}
