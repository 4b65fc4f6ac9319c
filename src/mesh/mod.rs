//! The SWIM mesh: foca driven over sealed UDP datagrams and TCP frames.
//!
//! Start a node with [`Mesh::start`]; ask it for the cluster with
//! [`Mesh::status`]; publish this node's metadata with `Mesh::set_meta`;
//! leave gracefully with [`Mesh::leave`].

mod core;
internal_mod! { discovery; }
mod intern;
internal_mod! { member; }
internal_mod! { meta; }
mod ring;
mod runtime;
internal_mod! { seal; }
internal_mod! {
    /// Built only for tests and benches.
    #[cfg(any(test, feature = "testing"))]
    sim;
}
mod suspicion;
internal_mod! { view; }
mod wire;

pub use self::core::SwimTuning;
pub use discovery::SeedSource;
pub use member::NodeIdentity;
pub use meta::{AcmeInfo, CertificateInfo, LastReload, NodeMeta, ProxyInfo};
pub use runtime::{Mesh, MeshConfig, MeshError};
pub use view::{ClusterStatus, MemberInfo, MemberState, NodeStatus, Summary};
