//! The cluster key ring: which keys exist, which one encrypts, and the keys
//! derived from them.
//!
//! Below the mesh, the store and ACME, which all use it: the mesh seals its
//! packets under the ring (`crate::mesh::seal`), the store seals records
//! at rest under a key derived from it (`crate::store::sealed`), and ACME
//! seals its account and certificate keys through the store's sealing. It
//! imports nothing from any of them. Where a ring comes from (a file, an environment
//! variable, `sb.yml`) and how it is written is configuration
//! (`crate::config::key`).

use std::fmt;
use std::sync::Arc;

use aws_lc_rs::aead::{AES_256_GCM, LessSafeKey, UnboundKey};
use aws_lc_rs::{digest, hkdf};

/// HKDF salt for every key derived from a ring key. Purposes are separated by
/// the HKDF `info` label, not by the salt.
const HKDF_SALT: &[u8] = b"sbmesh mesh v1";

/// HKDF label of the AES-256-GCM key that seals mesh packets. The ring
/// derives this one itself, once per key, since every packet needs it.
/// Other layers (the store) must pick their own labels so their keys are
/// independent.
pub(crate) const MESH_AEAD_LABEL: &[u8] = b"mesh-aead";

/// Domain separator of the key id hash.
const KEY_ID_DOMAIN: &[u8] = b"sbmesh-key-id\0";

/// Errors building a key ring or deriving a key from it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyRingError {
    /// `KeyRing::new` was given no keys.
    #[error("the mesh key ring is empty: configure at least one 32-byte key")]
    EmptyRing,
    /// Two ring keys have the same id.
    #[error(
        "mesh key #{index} has key id {id:08x}, like an earlier key: remove the repeated key \
         (if the keys differ, their ids collide by chance; generate a new key)"
    )]
    DuplicateKey {
        /// Position of the second key in the list given to `KeyRing::new`.
        index: usize,
        /// The shared key id.
        id: u32,
    },
    /// `KeyRing::derive` was asked for a key id the ring does not hold.
    #[error("key id {id:08x} is not in the mesh key ring")]
    UnknownKey {
        /// The key id asked for.
        id: u32,
    },
    /// The aws-lc-rs HKDF or AES-GCM key setup reported a failure.
    #[error("the AES-GCM or HKDF primitive failed")]
    Crypto,
}

/// One ring key: its raw bytes (for [`KeyRing::derive`]), its id and the mesh
/// packet AEAD key derived from it once, up front (every packet needs one,
/// and an HKDF per packet would be wasted work).
struct RingKey {
    id: u32,
    raw: [u8; 32],
    aead: LessSafeKey,
}

/// The cluster's symmetric keys.
///
/// The first key is the *primary*: it seals every outgoing packet. Every key
/// opens incoming packets. A rotation without dropped packets therefore
/// takes three rollouts:
///
/// 1. `[old, new]` everywhere: every node can open `new`, all still seal with `old`;
/// 2. `[new, old]` everywhere: all seal with `new`, stragglers' `old` still opens;
/// 3. `[new]` everywhere.
///
/// A receiver finds the key by its 4-byte id (the first 4 bytes of
/// SHA-256(`"sbmesh-key-id\0"` ‖ key)), never by trial decryption.
///
/// Non-empty by construction. Cloning is cheap (the keys are shared).
/// `Debug` prints key ids only.
#[derive(Clone)]
pub struct KeyRing {
    keys: Arc<Keys>,
}

/// The primary is held apart from the rest so "non-empty" is a property of
/// the type rather than a runtime check.
struct Keys {
    primary: RingKey,
    rest: Vec<RingKey>,
}

impl Keys {
    fn iter(&self) -> impl Iterator<Item = &RingKey> {
        std::iter::once(&self.primary).chain(&self.rest)
    }
}

impl KeyRing {
    /// Builds a ring from raw 32-byte keys, primary first.
    ///
    /// # Errors
    /// [`KeyRingError::EmptyRing`] when `keys` is empty;
    /// [`KeyRingError::DuplicateKey`] when two keys share an id (the same key
    /// listed twice, or a 2⁻³² id collision between different keys);
    /// [`KeyRingError::Crypto`] if the key derivation primitive fails.
    pub fn new(keys: Vec<[u8; 32]>) -> Result<Self, KeyRingError> {
        let mut built: Vec<RingKey> = Vec::with_capacity(keys.len());
        for (index, raw) in keys.into_iter().enumerate() {
            let id = key_id(&raw);
            if built.iter().any(|k| k.id == id) {
                return Err(KeyRingError::DuplicateKey { index, id });
            }
            let mut aead_bytes = hkdf_expand(&raw, MESH_AEAD_LABEL)?;
            let unbound =
                UnboundKey::new(&AES_256_GCM, &aead_bytes).map_err(|_| KeyRingError::Crypto);
            aead_bytes.fill(0);
            built.push(RingKey {
                id,
                raw,
                aead: LessSafeKey::new(unbound?),
            });
        }
        let mut built = built.into_iter();
        let primary = built.next().ok_or(KeyRingError::EmptyRing)?;
        Ok(Self {
            keys: Arc::new(Keys {
                primary,
                rest: built.collect(),
            }),
        })
    }

    /// Id of the primary key, the one that seals.
    pub fn primary_id(&self) -> u32 {
        self.primary().id
    }

    /// The primary key's id as `/admin/cluster/status` shows it
    /// ([`display_key_id`]).
    pub(crate) fn display_id(&self) -> String {
        display_key_id(&self.primary().raw)
    }

    /// Number of keys in the ring (at least 1).
    pub(crate) fn len(&self) -> usize {
        1 + self.keys.rest.len()
    }

    /// Always `false`: `KeyRing::new` refuses an empty ring.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Key ids in ring order, primary first.
    pub(crate) fn ids(&self) -> Vec<u32> {
        self.keys.iter().map(|k| k.id).collect()
    }

    /// Whether a key with this id is in the ring.
    pub(crate) fn contains(&self, key_id: u32) -> bool {
        self.find(key_id).is_some()
    }

    /// Derives a 32-byte key for another purpose from the ring key `key_id`:
    /// HKDF-SHA256(salt = `"sbmesh mesh v1"`, ikm = key, info = `label`).
    ///
    /// Each purpose must use its own `label` (the mesh uses
    /// [`MESH_AEAD_LABEL`]); store the key id next to whatever the derived
    /// key protects so it can be found again after a rotation.
    ///
    /// # Errors
    /// [`KeyRingError::UnknownKey`] when no key has this id;
    /// [`KeyRingError::Crypto`] if the key derivation primitive fails.
    pub(crate) fn derive(&self, key_id: u32, label: &[u8]) -> Result<[u8; 32], KeyRingError> {
        let key = self
            .find(key_id)
            .ok_or(KeyRingError::UnknownKey { id: key_id })?;
        hkdf_expand(&key.raw, label)
    }

    /// `KeyRing::derive` with the primary key.
    ///
    /// # Errors
    /// [`KeyRingError::Crypto`] if the key derivation primitive fails.
    pub fn derive_primary(&self, label: &[u8]) -> Result<[u8; 32], KeyRingError> {
        hkdf_expand(&self.primary().raw, label)
    }

    fn primary(&self) -> &RingKey {
        &self.keys.primary
    }

    /// `(id, AEAD key)` of the primary key, for sealing a mesh packet.
    pub(crate) fn primary_aead(&self) -> (u32, &LessSafeKey) {
        let key = self.primary();
        (key.id, &key.aead)
    }

    /// The mesh packet AEAD key with this id, for opening.
    pub(crate) fn aead(&self, key_id: u32) -> Option<&LessSafeKey> {
        self.find(key_id).map(|k| &k.aead)
    }

    fn find(&self, key_id: u32) -> Option<&RingKey> {
        // Rings hold one to three keys: a scan beats a map.
        self.keys.iter().find(|k| k.id == key_id)
    }
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<String> = self.keys.iter().map(|k| format!("{:08x}", k.id)).collect();
        f.debug_struct("KeyRing").field("key_ids", &ids).finish()
    }
}

/// A key as people compare it: the first 8 hex characters of SHA-256 of the
/// 32-byte key. What each node's `key_id` in `/admin/cluster/status` and the
/// operator's `status.clusterKey.keyId` show, so a rotation can be followed
/// from either (`xxd -r -p <<< "$KEY" | sha256sum | cut -c1-8`). Not the id
/// in a sealed packet's header (`KeyRing::ids`, domain-separated).
pub fn display_key_id(raw: &[u8; 32]) -> String {
    let head = digest_head(&digest::digest(&digest::SHA256, raw));
    head.iter().map(|b| format!("{b:02x}")).collect()
}

/// Key id: first 4 bytes (big-endian) of SHA-256("sbmesh-key-id\0" ‖ key).
fn key_id(raw: &[u8; 32]) -> u32 {
    let mut ctx = digest::Context::new(&digest::SHA256);
    ctx.update(KEY_ID_DOMAIN);
    ctx.update(raw);
    u32::from_be_bytes(digest_head(&ctx.finish()))
}

/// The first 4 bytes of a SHA-256 digest (zero-padded if shorter, which a
/// digest never is); no panic path.
fn digest_head(digest: &digest::Digest) -> [u8; 4] {
    digest
        .as_ref()
        .first_chunk::<4>()
        .copied()
        .unwrap_or_default()
}

fn hkdf_expand(ikm: &[u8; 32], label: &[u8]) -> Result<[u8; 32], KeyRingError> {
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, HKDF_SALT).extract(ikm);
    let info = [label];
    // HKDF_SHA256 as the length type asks for 32 bytes, its digest size.
    let okm = prk
        .expand(&info, hkdf::HKDF_SHA256)
        .map_err(|_| KeyRingError::Crypto)?;
    let mut out = [0u8; 32];
    okm.fill(&mut out).map_err(|_| KeyRingError::Crypto)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_key_id_is_the_head_of_the_keys_sha256() {
        // sha256 of 32 zero bytes: 66687aad f862bd77 …
        assert_eq!(display_key_id(&[0u8; 32]), "66687aad");
        let ring = KeyRing::new(vec![[0u8; 32], [1u8; 32]]).unwrap();
        assert_eq!(ring.display_id(), "66687aad", "the primary's");
    }

    #[test]
    fn empty_ring_is_refused() {
        assert!(matches!(KeyRing::new(vec![]), Err(KeyRingError::EmptyRing)));
    }

    #[test]
    fn repeated_key_is_refused() {
        let err = KeyRing::new(vec![[1; 32], [2; 32], [1; 32]]).unwrap_err();
        assert!(
            matches!(err, KeyRingError::DuplicateKey { index: 2, .. }),
            "{err}"
        );
    }

    #[test]
    fn ids_follow_ring_order_and_the_documented_hash() {
        let ring = KeyRing::new(vec![[7; 32], [9; 32]]).unwrap();
        let mut ctx = digest::Context::new(&digest::SHA256);
        ctx.update(b"sbmesh-key-id\0");
        ctx.update(&[7; 32]);
        let d = ctx.finish();
        let want = u32::from_be_bytes([d.as_ref()[0], d.as_ref()[1], d.as_ref()[2], d.as_ref()[3]]);
        assert_eq!(ring.primary_id(), want);
        assert_eq!(ring.ids(), vec![key_id(&[7; 32]), key_id(&[9; 32])]);
        assert_eq!(ring.len(), 2);
        assert!(!ring.is_empty());
        assert!(ring.contains(key_id(&[9; 32])));
        assert!(!ring.contains(0));
    }

    #[test]
    fn derive_separates_labels_and_keys_and_matches_hkdf() {
        let ring = KeyRing::new(vec![[1; 32], [2; 32]]).unwrap();
        let [a, b] = [ring.ids()[0], ring.ids()[1]];
        let store_a = ring.derive(a, b"store").unwrap();
        assert_eq!(store_a, ring.derive_primary(b"store").unwrap());
        assert_ne!(store_a, ring.derive(a, b"other").unwrap());
        assert_ne!(store_a, ring.derive(b, b"store").unwrap());
        assert_ne!(store_a, [1; 32]);
        assert!(matches!(
            ring.derive(0xdead_beef, b"store"),
            Err(KeyRingError::UnknownKey { id: 0xdead_beef })
        ));
        // Deterministic: a clone and a rebuilt ring derive the same key.
        let again = KeyRing::new(vec![[1; 32]]).unwrap();
        assert_eq!(again.derive(a, b"store").unwrap(), store_a);
        assert_eq!(ring.clone().derive(a, b"store").unwrap(), store_a);
    }

    #[test]
    fn errors_tell_the_fix() {
        let msg = KeyRing::new(vec![[0x11; 32], [0x11; 32]])
            .unwrap_err()
            .to_string();
        assert!(msg.contains("remove the repeated key"), "{msg}");
        let msg = KeyRing::new(vec![]).unwrap_err().to_string();
        assert!(msg.contains("at least one"), "{msg}");
    }

    #[test]
    fn debug_shows_ids_not_keys() {
        let ring = KeyRing::new(vec![[0xab; 32]]).unwrap();
        let shown = format!("{ring:?}");
        assert!(
            shown.contains(&format!("{:08x}", ring.primary_id())),
            "{shown}"
        );
        assert!(!shown.contains("171"), "{shown}"); // 0xab as decimal
        assert!(!shown.to_lowercase().contains("abab"), "{shown}");
    }
}
