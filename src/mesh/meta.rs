//! Node metadata: what every member tells the others about itself (version,
//! config hash, readiness, last reload, certificates).
//!
//! A record can be up to [`MAX_META_BYTES`], too large for a datagram, so
//! gossip carries only a small digest (`node_id`, epoch, version); a member
//! that sees a newer digest than it holds fetches the record over TCP from
//! its owner. Full-state exchanges carry the records too, as a safety net.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::mesh::intern::{Interner, JSON, NAMES};
use crate::mesh::member::{ByAddr, NodeIdentity};

/// Largest encoded metadata record accepted or produced.
pub(crate) const MAX_META_BYTES: usize = 64 * 1024;

/// Result of the last config reload, as shown in status.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastReload {
    /// `ok`, `failed`, `refused` or `invalid`.
    pub result: String,
    /// When it happened.
    pub at_unix_ms: u64,
}

/// A certificate a node has written for the proxy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertificateInfo {
    /// The hostname; for the SAN certificate (`certificates: san`), its
    /// first name (the names are sorted).
    pub host: String,
    /// Expiry, unix seconds.
    pub not_after_unix: u64,
    /// Serial number, hex.
    pub serial: String,
    /// Every name of the certificate (for the SAN certificate, the whole
    /// set). Left empty when the certificate names `host` only, which
    /// keeps per-host metadata small.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
    /// The file is a self-signed placeholder written until the CA's
    /// certificate arrives (docs/reference.md#certificate-files).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub placeholder: bool,
}

/// A node's ACME state beyond its certificates, as shown in status.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AcmeInfo {
    /// Origins that cannot be ordered over HTTP-01 (wildcards).
    pub not_eligible: Vec<String>,
    /// Why the node does not order certificates, when it does not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    /// Orders the node holds back because their challenge is not answered
    /// where the CA's request lands (docs/reference.md#the-challenge-check).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waiting: Vec<OrderWaiting>,
    /// Orders that failed and back off, with the error of the last
    /// attempt (at most [`MAX_FAILING_IN_META`], by host).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub failing: Vec<OrderFailing>,
}

/// Most failing orders a node lists in its metadata (each with its error).
pub const MAX_FAILING_IN_META: usize = 10;
/// Longest error a failing order lists, in characters.
pub const MAX_FAILING_ERROR: usize = 400;

/// An order that failed: the certificate, since when it fails, when it is
/// tried again, and why the last attempt failed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct OrderFailing {
    /// The certificate's host (for a SAN certificate, its first name).
    pub host: String,
    /// Failing since, unix seconds.
    pub since_unix: u64,
    /// The next attempt, unix seconds.
    pub retry_at_unix: u64,
    /// The last attempt's error.
    pub error: String,
}

/// An order held back until its challenge is answered, as shown in status.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct OrderWaiting {
    /// The certificate's host (for a SAN certificate, its first name).
    pub host: String,
    /// Waiting since, unix seconds.
    pub since_unix: u64,
    /// What the last check found.
    pub reason: String,
}

/// A node's proxy restarts for certificates (`apply: restart`), as shown
/// in status: `"proxy": { "restarts": 0, "last_restart_unix_ms": null }`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProxyInfo {
    /// Graceful restarts signalled since the sidecar started.
    pub restarts: u64,
    /// When the last one was signalled, unix milliseconds.
    pub last_restart_unix_ms: Option<u64>,
}

/// What a node says about itself.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NodeMeta {
    /// sbmesh version of the node.
    pub version: String,
    /// `sha256:<hex>` of the config the proxy runs, when known.
    pub config_hash: Option<String>,
    /// The node's own readiness (`/readyz`).
    pub ready: bool,
    /// The last reload the node delivered to its proxy.
    pub last_reload: Option<LastReload>,
    /// Certificates the node has handed to its proxy.
    pub certificates: Vec<CertificateInfo>,
    /// ACME state (present once ACME is enabled).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub acme: Option<AcmeInfo>,
    /// Proxy restarts (present when certificates are applied by restart).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxyInfo>,
    /// The node's primary cluster key, as
    /// [`crate::keyring::display_key_id`] shows it (set by the mesh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// The ids of every key the node opens, primary first, as a sealed
    /// packet's header carries them (`crate::keyring::KeyRing::ids`;
    /// set by the mesh). A peer seals to this node with its own primary
    /// only once this lists it, so a rotation rolled out pod by pod drops
    /// no packet (docs in `crate::mesh::runtime`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub key_ring: Vec<u32>,
}

/// The key ring a record's JSON lists ([`NodeMeta::key_ring`]); empty for
/// a node from before it was published, or JSON that does not parse.
pub(crate) fn key_ring_of(json: &[u8]) -> Vec<u32> {
    #[derive(Deserialize)]
    struct Ring {
        #[serde(default)]
        key_ring: Vec<u32>,
    }
    serde_json::from_slice::<Ring>(json)
        .map(|r| r.key_ring)
        .unwrap_or_default()
}

/// A node's metadata as exchanged between members.
///
/// Name and JSON are shared (`Arc`): every member holds every other's
/// record, and a copy handed on (a full-state reply, a record that only
/// changed its version) costs no allocation. On the wire they are a string
/// and a byte sequence, as `String` and `Vec<u8>` were.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct MetaRecord {
    /// Owner of the record.
    pub node_id: Arc<str>,
    /// The owner's boot generation: a restarted owner starts versions anew.
    pub epoch: u64,
    /// Increases at every change within an epoch.
    pub version: u64,
    /// JSON of [`NodeMeta`] (JSON so that newer fields pass through older
    /// members unharmed).
    pub json: Arc<[u8]>,
}

impl MetaRecord {
    /// Ordering key: a record replaces another of the same node when newer.
    pub(crate) fn stamp(&self) -> (u64, u64) {
        (self.epoch, self.version)
    }

    /// The decoded metadata; a record that does not decode reads as empty.
    pub(crate) fn meta(&self) -> NodeMeta {
        serde_json::from_slice(&self.json).unwrap_or_default()
    }
}

/// The records a node holds of its peers, by owner.
///
/// Every member holds every other's record, so a node holds N and the
/// simulator N²: each is one pointer, to a record interned with its name
/// and JSON (one copy per process, however many cores hold it), in a hash
/// map keyed by a fixed 64-bit hash of the owner's name. In a B-tree keyed
/// by the name, every comparison followed two pointers to the bytes, and
/// at N = 10,000 those misses were half the simulator's time. The hash is
/// the ring's, the same in every process, and the map hashes it no
/// further, so the order (and a simulated run) repeats exactly.
/// Two names on one hash are kept apart: the later ones by name, aside.
pub(crate) struct Records {
    by_hash: ByAddr<Arc<MetaRecord>>,
    /// Records whose owner's hash another owner's record holds.
    collided: BTreeMap<Arc<str>, Arc<MetaRecord>>,
    hash: fn(&str) -> u64,
}

impl Default for Records {
    fn default() -> Self {
        Self::hashed_by(crate::mesh::ring::position)
    }
}

static RECORDS: Interner<MetaRecord> = Interner::new();

impl Records {
    fn hashed_by(hash: fn(&str) -> u64) -> Self {
        Self {
            by_hash: ByAddr::default(),
            collided: BTreeMap::new(),
            hash,
        }
    }

    /// The record of `node_id`.
    pub(crate) fn get(&self, node_id: &str) -> Option<&MetaRecord> {
        match self.by_hash.get(&(self.hash)(node_id)) {
            Some(rec) if *rec.node_id == *node_id => Some(rec),
            _ if self.collided.is_empty() => None,
            _ => self.collided.get(node_id).map(|r| &**r),
        }
    }

    /// Holds `rec`, replacing the record of its owner.
    pub(crate) fn put(&mut self, rec: MetaRecord) -> &MetaRecord {
        let rec = RECORDS.intern_value(MetaRecord {
            node_id: NAMES.intern(rec.node_id),
            json: JSON.intern(rec.json),
            ..rec
        });
        let hash = (self.hash)(&rec.node_id);
        let aside = match self.by_hash.get(&hash) {
            Some(held) => held.node_id != rec.node_id,
            None => self.collided.contains_key(&rec.node_id),
        };
        if aside {
            let name = rec.node_id.clone();
            self.collided.insert(name.clone(), rec);
            &self.collided[&name]
        } else {
            self.by_hash.insert(hash, rec);
            &self.by_hash[&hash]
        }
    }

    /// Forgets the record of `node_id`, returning it.
    pub(crate) fn remove(&mut self, node_id: &str) -> Option<MetaRecord> {
        let hash = (self.hash)(node_id);
        let rec = match self.by_hash.get(&hash) {
            Some(held) if *held.node_id == *node_id => self.by_hash.remove(&hash),
            _ => self.collided.remove(node_id),
        };
        rec.map(Arc::unwrap_or_clone)
    }

    /// Every record.
    pub(crate) fn values(&self) -> impl Iterator<Item = &MetaRecord> {
        self.by_hash
            .values()
            .chain(self.collided.values())
            .map(|r| &**r)
    }

    /// How many records are held.
    pub(crate) fn len(&self) -> usize {
        self.by_hash.len() + self.collided.len()
    }
}

/// Records up to this size ride inside the gossiped digest itself, so
/// nobody has to fetch them over TCP (the usual case: a few hundred bytes).
pub(crate) const MAX_INLINE_META: usize = 640;

/// The gossiped announcement that a node's metadata changed; small records
/// travel inline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct MetaDigest {
    pub node_id: Arc<str>,
    pub epoch: u64,
    pub version: u64,
    pub inline: Option<Arc<[u8]>>,
}

impl MetaDigest {
    /// The digest of a record, carrying it inline when it is small.
    pub(crate) fn of(rec: &MetaRecord, inline: bool) -> Self {
        Self {
            node_id: rec.node_id.clone(),
            epoch: rec.epoch,
            version: rec.version,
            inline: (inline && rec.json.len() <= MAX_INLINE_META).then(|| rec.json.clone()),
        }
    }

    /// The record it carries, if inline.
    pub(crate) fn record(&self) -> Option<MetaRecord> {
        self.inline.as_ref().map(|json| MetaRecord {
            node_id: self.node_id.clone(),
            epoch: self.epoch,
            version: self.version,
            json: json.clone(),
        })
    }
}

impl foca::Invalidates for MetaDigest {
    fn invalidates(&self, other: &Self) -> bool {
        self.node_id == other.node_id && (self.epoch, self.version) >= (other.epoch, other.version)
    }
}

/// Digests seen but whose records are not yet fetched; shared between the
/// broadcast handler (inside foca) and the driver that fetches.
pub(crate) type Wanted = Arc<Mutex<Vec<MetaDigest>>>;

/// Digests heard by gossip and still to be passed on, the newest per owner,
/// oldest first: handed to foca a few at a time
/// ([`crate::mesh::machine`]'s `RELAY_BACKLOG`) instead of all at once. foca
/// fills a packet by popping its whole custom-broadcast heap whenever the
/// room left is smaller than the next digest (`Broadcasts::
/// fill_with_len_prefix`), so a backlog of one digest per member made
/// every packet O(N log N): a third of all CPU of a 512-pod start
/// (BENCHMARKS.md, "N = 512").
#[derive(Debug, Default)]
pub(crate) struct RelayQueue {
    pending: VecDeque<MetaDigest>,
}

impl RelayQueue {
    /// Queues `d`, replacing an older digest of the same owner in place.
    fn push(&mut self, d: MetaDigest) {
        match self.pending.iter_mut().find(|p| p.node_id == d.node_id) {
            Some(p) if (p.epoch, p.version) < (d.epoch, d.version) => *p = d,
            Some(_) => {}
            None => self.pending.push_back(d),
        }
    }

    /// The oldest digest still to pass on.
    pub(crate) fn pop(&mut self) -> Option<MetaDigest> {
        let d = self.pending.pop_front();
        if self.pending.is_empty() && self.pending.capacity() > 0 {
            // Sized for a mass change (a start): not kept afterwards.
            self.pending = VecDeque::new();
        }
        d
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

/// Shared between the broadcast handler (inside foca) and the core.
pub(crate) type Relay = Arc<Mutex<RelayQueue>>;

/// foca's custom-broadcast handler for metadata digests.
pub(crate) struct DigestHandler {
    local: String,
    /// Newest stamp seen per owner, by the owner's member address (a hash
    /// of its name, see `NodeIdentity::addr_of`): one small entry per
    /// member, no copy of the name; a B-tree holds it in ~34 B per member
    /// (a hash map at twice the members' count in slots: ~51).
    seen: BTreeMap<u64, (u64, u64)>,
    wanted: Wanted,
    relay: Relay,
}

impl DigestHandler {
    pub(crate) fn new(local: &str, wanted: Wanted, relay: Relay) -> Self {
        Self {
            local: local.to_owned(),
            seen: BTreeMap::new(),
            wanted,
            relay,
        }
    }
}

/// A digest that did not decode.
#[derive(Debug, thiserror::Error)]
#[error("metadata digest does not decode: {0}")]
pub(crate) struct DigestError(#[from] postcard::Error);

impl foca::BroadcastHandler<NodeIdentity> for DigestHandler {
    type Key = MetaDigest;
    type Error = DigestError;

    fn receive_item(
        &mut self,
        data: &[u8],
        sender: Option<&NodeIdentity>,
    ) -> Result<Option<MetaDigest>, DigestError> {
        let digest: MetaDigest = postcard::from_bytes(data)?;
        let stamp = (digest.epoch, digest.version);
        let owner = NodeIdentity::addr_of(&digest.node_id);
        let seen = self.seen.entry(owner).or_default();
        // foca names the sender of what came in a packet, and none for
        // what the core hands it (`add_broadcast`): that is transmitted
        // from now on; what was heard waits in the relay queue.
        if sender.is_none() {
            *seen = (*seen).max(stamp);
            return Ok(Some(digest));
        }
        if *seen >= stamp {
            return Ok(None);
        }
        *seen = stamp;
        if *digest.node_id != *self.local
            && let Ok(mut wanted) = self.wanted.lock()
        {
            wanted.push(digest.clone());
        }
        if let Ok(mut relay) = self.relay.lock() {
            relay.push(digest);
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use foca::BroadcastHandler;

    fn rec(name: &str, version: u64) -> MetaRecord {
        MetaRecord {
            node_id: name.into(),
            epoch: 1,
            version,
            json: Arc::from(&b"{}"[..]),
        }
    }

    #[test]
    fn records_are_found_by_owner_whatever_the_hash() {
        // The ring's hash, and one under which every name collides.
        for mut records in [Records::default(), Records::hashed_by(|_| 7)] {
            for name in ["a", "b", "c"] {
                records.put(rec(name, 1));
            }
            records.put(rec("b", 2));
            assert_eq!(records.len(), 3);
            assert_eq!(records.get("b").map(|r| r.version), Some(2));
            assert!(records.get("d").is_none());
            // The first holder of the hash leaves; the others stay apart
            // and a newer record of one replaces it, not a second copy.
            assert_eq!(records.remove("a").map(|r| r.version), Some(1));
            assert!(records.remove("a").is_none());
            records.put(rec("c", 3));
            records.put(rec("a", 4));
            assert_eq!(records.len(), 3);
            let mut held: Vec<_> = records
                .values()
                .map(|r| (r.node_id.to_string(), r.version))
                .collect();
            held.sort();
            assert_eq!(held, [("a".into(), 4), ("b".into(), 2), ("c".into(), 3)]);
        }
    }

    #[test]
    fn proxy_info_serializes_as_in_the_spec() {
        let meta = NodeMeta {
            proxy: Some(ProxyInfo::default()),
            ..Default::default()
        };
        let json = serde_json::to_value(&meta).unwrap();
        assert_eq!(
            json["proxy"],
            serde_json::json!({ "restarts": 0, "last_restart_unix_ms": null })
        );
        // Absent when restarts are not the apply mode; old records decode.
        let json = serde_json::to_value(NodeMeta::default()).unwrap();
        assert!(json.get("proxy").is_none());
        let old: NodeMeta = serde_json::from_str(r#"{"version":"0.1.0"}"#).unwrap();
        assert_eq!(old.proxy, None);
    }

    #[test]
    fn newer_digest_is_wanted_and_queued_for_relay_once() {
        let wanted = Wanted::default();
        let relay = Relay::default();
        let mut h = DigestHandler::new("a", wanted.clone(), relay.clone());
        let d = |v| {
            postcard::to_allocvec(&MetaDigest {
                node_id: "b".into(),
                epoch: 1,
                version: v,
                inline: None,
            })
            .unwrap()
        };
        let peer = NodeIdentity::new("c".into(), "127.0.0.1:7946".parse().unwrap(), 8946, 1);
        let heard = Some(&peer);
        // Heard by gossip: queued, not handed to foca's own backlog.
        for v in [2, 2, 1, 3] {
            assert!(h.receive_item(&d(v), heard).unwrap().is_none());
        }
        assert_eq!(wanted.lock().unwrap().len(), 2, "versions 2 and 3");
        let queued = relay.lock().unwrap().pop().expect("one digest queued");
        assert_eq!(queued.version, 3, "the newest replaced the older in place");
        assert!(relay.lock().unwrap().is_empty());
        // Handed over by the core (no sender): admitted, and not queued again.
        assert!(h.receive_item(&d(3), None).unwrap().is_some());
        assert!(h.receive_item(&d(3), heard).unwrap().is_none());
        assert!(relay.lock().unwrap().is_empty());
        assert!(h.receive_item(b"\xff\xff", heard).is_err());
    }

    #[test]
    fn certificate_info_stays_small_and_reads_old_records() {
        let plain = CertificateInfo {
            host: "a.test".into(),
            not_after_unix: 1,
            serial: "0a".into(),
            ..Default::default()
        };
        let json = serde_json::to_string(&plain).unwrap();
        assert_eq!(
            json,
            r#"{"host":"a.test","not_after_unix":1,"serial":"0a"}"#
        );
        assert_eq!(
            serde_json::from_str::<CertificateInfo>(&json).unwrap(),
            plain
        );
        let san = CertificateInfo {
            names: vec!["a.test".into(), "b.test".into()],
            placeholder: true,
            ..plain
        };
        let json = serde_json::to_string(&san).unwrap();
        assert!(
            json.ends_with(r#""names":["a.test","b.test"],"placeholder":true}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<CertificateInfo>(&json).unwrap(), san);
    }

    #[test]
    fn records_and_digests_encode_as_with_owned_strings_and_bytes() {
        // The types as they were (String, Vec<u8>): what older members
        // send and expect.
        #[derive(Serialize)]
        struct OldRecord {
            node_id: String,
            epoch: u64,
            version: u64,
            json: Vec<u8>,
        }
        #[derive(Serialize)]
        struct OldDigest {
            node_id: String,
            epoch: u64,
            version: u64,
            inline: Option<Vec<u8>>,
        }
        let json = br#"{"version":"0.1.0","ready":true}"#;
        let rec = MetaRecord {
            node_id: "sbproxy-7".into(),
            epoch: 1_800_000_000_000,
            version: 300,
            json: json[..].into(),
        };
        let old = OldRecord {
            node_id: "sbproxy-7".into(),
            epoch: 1_800_000_000_000,
            version: 300,
            json: json.to_vec(),
        };
        let bytes = postcard::to_allocvec(&rec).unwrap();
        assert_eq!(bytes, postcard::to_allocvec(&old).unwrap());
        assert_eq!(postcard::from_bytes::<MetaRecord>(&bytes).unwrap(), rec);
        for inline in [true, false] {
            let digest = MetaDigest::of(&rec, inline);
            let old = OldDigest {
                node_id: old.node_id.clone(),
                epoch: old.epoch,
                version: old.version,
                inline: inline.then(|| old.json.clone()),
            };
            let bytes = postcard::to_allocvec(&digest).unwrap();
            assert_eq!(bytes, postcard::to_allocvec(&old).unwrap());
            assert_eq!(postcard::from_bytes::<MetaDigest>(&bytes).unwrap(), digest);
        }
    }

    #[test]
    fn unknown_json_fields_pass() {
        let r = MetaRecord {
            node_id: "b".into(),
            epoch: 1,
            version: 1,
            json: br#"{"version":"9.9.9","ready":true,"future":[1,2]}"#[..].into(),
        };
        let m = r.meta();
        assert_eq!(m.version, "9.9.9");
        assert!(m.ready);
    }
}
