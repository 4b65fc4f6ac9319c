//! The SWIM mesh: foca driven over sealed UDP datagrams and TCP frames.
//!
//! Start a node with [`Mesh::start`]; ask it for the cluster with
//! [`Mesh::status`]; publish this node's metadata with `Mesh::set_meta`;
//! leave gracefully with [`Mesh::leave`].

pub(crate) mod discovery;
mod intern;
mod machine;
pub(crate) mod member;
pub(crate) mod meta;
mod ring;
mod runtime;
pub(crate) mod seal;
/// For the benches and tests (`sbmesh::internal::sim`); no binary calls it.
pub(crate) mod sim;
mod suspicion;
mod transport;
pub(crate) mod view;
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
