//! sbmesh: the gossip mesh, certificate stores, ACME issuer and config
//! reload watcher that let several sbproxy replicas act as one fleet.
//!
//! The `sbmesh-sidecar` binary composes these parts; a Rust proxy can link
//! them in-process instead. Embedding the mesh:
//!
//! ```no_run
//! use std::sync::Arc;
//! use sbmesh::mesh::{Mesh, MeshConfig, NodeMeta, SeedSource, SwimTuning};
//! use sbmesh::metrics::Metrics;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let key = [7u8; 32]; // in production: `sbmesh-sidecar keygen`, from a Secret
//! let mesh = Mesh::start(
//!     MeshConfig {
//!         node_id: "demo-proxy-0".into(),
//!         cluster_id: "demo".into(),
//!         bind: "0.0.0.0".parse()?,
//!         gossip_port: 7946,
//!         transport_port: 8946,
//!         advertise: None,
//!         seeds: SeedSource {
//!             seeds: vec![],
//!             mesh_service: Some("demo-mesh.default.svc.cluster.local".into()),
//!             gossip_port: 7946,
//!         },
//!         keys: vec![key],
//!         key_file: None,
//!         tuning: SwimTuning::default(),
//!     },
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

pub mod acme;
pub mod config;
pub mod http;
pub mod identity;
pub mod mesh;
pub mod metrics;
pub mod proxy;
pub mod reload;
pub mod store;
