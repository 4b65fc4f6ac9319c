//! The cluster as one node sees it: the JSON of `/admin/cluster/status`
//! (docs/reference.md#cluster-status, docs/status.schema.json) and the
//! member list other components use.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::mesh::meta::{AcmeInfo, CertificateInfo, LastReload, ProxyInfo};
use crate::mesh::seal::SkewedPeer;

/// A member's membership state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MemberState {
    /// Answering probes.
    Alive,
    /// Failed a probe, not yet declared down.
    Suspect,
    /// Declared down, or left.
    Down,
}

impl From<foca::State> for MemberState {
    fn from(s: foca::State) -> Self {
        match s {
            foca::State::Alive => Self::Alive,
            foca::State::Suspect => Self::Suspect,
            foca::State::Down => Self::Down,
        }
    }
}

/// `/admin/cluster/status`, schema version 1.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// Always 1 for this shape.
    pub schema_version: u32,
    /// The cluster id.
    pub cluster_id: String,
    /// This node's id.
    pub local_node_id: String,
    /// When the snapshot was taken.
    pub generated_at_unix_ms: u64,
    /// Counts.
    pub summary: Summary,
    /// Every member, the local node first, then by node id.
    pub nodes: Vec<NodeStatus>,
}

/// Counts over the members.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Alive or suspect members, the local node included.
    pub total_nodes: usize,
    /// Members whose `health` is `healthy`.
    pub healthy_nodes: usize,
    /// Members in `suspect`.
    pub suspect_nodes: usize,
    /// Members in `down` (still listed until forgotten).
    pub down_nodes: usize,
    /// How many alive or suspect members run each config hash.
    pub config_hashes: BTreeMap<String, usize>,
}

/// One member.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Its node id.
    pub node_id: String,
    /// Whether it is the node answering.
    pub local: bool,
    /// Its gossip address.
    pub address: String,
    /// `alive`, `suspect` or `down`.
    pub membership_state: MemberState,
    /// The member's generation: unix ms at its start, advanced at every
    /// rejoin, so a restarted member always shows a higher one.
    pub incarnation: u64,
    /// Since a packet from it was last authenticated (0 for the local node).
    pub last_seen_ms_ago: u64,
    /// `healthy` when alive and its own readiness holds.
    pub health: String,
    /// On the local node only: the peers whose packets it rejected for
    /// clock skew in the last minute. Such a peer is not a member (its
    /// packets never reach foca), so this is where it shows. Absent when
    /// there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clock_skew: Vec<ClockSkewPeer>,
    /// Its sbmesh version, once its metadata arrived.
    pub version: Option<String>,
    /// The config its proxy runs.
    pub config_hash: Option<String>,
    /// Its last config reload.
    pub last_reload: Option<LastReload>,
    /// Certificates it has written.
    pub certificates: Vec<CertificateInfo>,
    /// Its ACME state: wildcard origins it does not order, and why it does
    /// not order at all when it does not. Absent while ACME is disabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acme: Option<AcmeInfo>,
    /// Its proxy restarts for certificates (`apply: restart`; zero
    /// restarts in the other modes). Every node publishes it; absent only
    /// before a node's first metadata.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxyInfo>,
    /// Its primary cluster key (first 8 hex characters of its SHA-256): the
    /// key it seals with. Absent for a member from before it was published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
}

/// A peer whose mesh packets authenticated but were stamped outside the
/// 30 s window (`nodes[].clock_skew`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockSkewPeer {
    /// The source address of its packets.
    pub address: String,
    /// Its clock minus ours, in milliseconds, from its latest rejected
    /// packet: positive when its clock is ahead.
    pub offset_ms: i64,
    /// Its packets rejected for clock skew since it was first listed.
    pub rejected_packets: u64,
    /// Since its latest rejected packet.
    pub last_rejected_ms_ago: u64,
}

impl From<&SkewedPeer> for ClockSkewPeer {
    fn from(p: &SkewedPeer) -> Self {
        Self {
            address: p.address.to_string(),
            offset_ms: p.offset_ms,
            rejected_packets: p.rejected,
            last_rejected_ms_ago: u64::try_from(p.last_ago.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

impl ClusterStatus {
    /// Builds the summary from the node list.
    pub(crate) fn summarize(nodes: &[NodeStatus]) -> Summary {
        let mut s = Summary {
            total_nodes: 0,
            healthy_nodes: 0,
            suspect_nodes: 0,
            down_nodes: 0,
            config_hashes: BTreeMap::new(),
        };
        for n in nodes {
            match n.membership_state {
                MemberState::Alive => s.total_nodes += 1,
                MemberState::Suspect => {
                    s.total_nodes += 1;
                    s.suspect_nodes += 1;
                }
                MemberState::Down => s.down_nodes += 1,
            }
            if n.health == "healthy" {
                s.healthy_nodes += 1;
            }
            if n.membership_state != MemberState::Down
                && let Some(h) = &n.config_hash
            {
                *s.config_hashes.entry(h.clone()).or_default() += 1;
            }
        }
        s
    }
}

/// A member as other components (ACME ownership) see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberInfo {
    /// Its node id.
    pub node_id: String,
    /// Its state.
    pub state: MemberState,
    /// Whether it is this node.
    pub local: bool,
}
