//! The SWIM mesh: foca driven over sealed UDP datagrams and TCP frames.
//!
//! Start a node with [`Mesh::start`]; ask it for the cluster with
//! [`Mesh::status`]; publish this node's metadata with `Mesh::set_meta`;
//! leave gracefully with [`Mesh::leave`].

mod machine;
internal_mod! {
    discovery;
    member;
    meta;
    seal;
    /// Built only for tests and benches.
    #[cfg(any(test, feature = "testing"))]
    sim;
    view;
}
mod intern;
mod ring;
mod runtime;
mod suspicion;
mod wire;

pub use discovery::SeedSource;
pub use machine::SwimTuning;
pub use member::NodeIdentity;
pub use meta::{
    AcmeInfo, CertificateInfo, LastReload, MAX_FAILING_ERROR, MAX_FAILING_IN_META, NodeMeta,
    OrderFailing, OrderWaiting, ProxyInfo,
};
pub use runtime::{Mesh, MeshConfig, MeshError};
pub use view::{ClusterStatus, MemberInfo, MemberState, NodeStatus, Summary};
