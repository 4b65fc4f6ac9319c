//! Encryption at rest for records that hold private keys (the ACME account
//! key, certificate keys): AES-256-GCM under a key derived from the cluster
//! key ring, so a shared store (Redis, a bucket, a volume) never holds a
//! private key in the clear when the cluster has a key.
//!
//! # Record format
//!
//! ```text
//! plain (no cluster key):   0x50 ('P') | plaintext
//! sealed (AES-256-GCM v1):  0xA5 | key_id (u32 BE) | nonce (12) | ciphertext | tag (16)
//! ```
//!
//! The format byte and the key id are in the clear, so a reader finds the
//! ring key by id (never by trial decryption) and a record sealed under a
//! key that has left the ring gives [`StoreError::MissingKey`] naming that
//! id, never garbage. The AES key is
//! `HKDF-SHA256(ring key, info = "store-at-rest")` ([`STORE_AT_REST_LABEL`],
//! see [`KeyRing::derive`]), independent of the mesh's packet key.
//!
//! Associated data: `"sbmesh-store-at-rest\0" || format || key_id || store key`.
//! Binding the store key means a sealed record copied to another key
//! (another host's certificate, the account key) fails to open.
//!
//! # Rotation
//!
//! Records are sealed under the ring's primary key and open under any key
//! still in the ring, so the key ring's three-step rotation (see
//! [`KeyRing`]) applies: keep the old key in the ring until every record sealed under it
//! has been rewritten (certificates are rewritten at each renewal; a record
//! can be resealed explicitly by opening and sealing it again).
//!
//! The ring used here is an [`AtRestRing`]: it follows the mesh's key ring
//! (and with it `--cluster-key-file`), so a replica that was not restarted
//! opens what a restarted one sealed under the new primary. A record sealed
//! under a key that left the ring is reported once a minute per key id at
//! warn ([`AtRestRing::report`]) and counted in
//! `store_unseal_failures_total{reason="missing_key"}`.
//!
//! # Plain records when a ring exists
//!
//! A plain record is accepted even when the reader has a ring: that is how
//! a single pod that ran without a cluster key migrates to a cluster (its
//! records are resealed when next written). The flip side: whoever can
//! write to the store can plant a plain record. Anyone with write access to
//! the store can already delete or replace certificates, so this adds no
//! capability an attacker with store write access lacks; it only means the
//! encryption protects confidentiality, not provenance.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use aws_lc_rs::rand;
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::keyring::KeyRing;
use crate::metrics::Metrics;

use super::StoreError;

/// HKDF label of the at-rest key ([`KeyRing::derive`]).
pub(crate) const STORE_AT_REST_LABEL: &[u8] = b"store-at-rest";

/// Format byte of a plain record (`'P'`).
pub(crate) const FORMAT_PLAIN: u8 = 0x50;
/// Format byte of an AES-256-GCM sealed record (version 1).
pub(crate) const FORMAT_AES256GCM_V1: u8 = 0xA5;

const AAD_DOMAIN: &[u8] = b"sbmesh-store-at-rest\0";
const KEY_ID_LEN: usize = 4;
const TAG_LEN: usize = 16;
const SEALED_HEADER_LEN: usize = 1 + KEY_ID_LEN + NONCE_LEN;
/// Where `seal`/`open` failures of the crypto primitive are attributed.
const CRYPTO: &str = "at-rest encryption";

/// Bytes a sealed record adds to its plaintext (format, key id, nonce, tag).
pub(crate) const SEALED_OVERHEAD: usize = SEALED_HEADER_LEN + TAG_LEN;

/// How often a record sealed under one missing key id is logged at warn;
/// in between it is logged at debug (still counted), so a store full of
/// such records cannot flood the log.
pub(crate) const MISSING_KEY_WARN_EVERY: Duration = Duration::from_secs(60);

/// The key ring records are sealed and opened with, as it is now: `None`
/// (plain records, no cluster key), a fixed ring, or one that follows a
/// ring that changes (the mesh's, `Mesh::key_rings`) so that a rotation of
/// the key file reaches the store too. Cheap to clone; clones share the
/// ring and the warn rate limit.
#[derive(Clone, Default)]
pub struct AtRestRing {
    ring: Option<watch::Receiver<Arc<KeyRing>>>,
    warned: Arc<Mutex<WarnLimit>>,
}

impl AtRestRing {
    /// No cluster key: records are written plain.
    pub(crate) fn plain() -> Self {
        Self::default()
    }

    /// Always `ring` (an embedder's fixed key, tests).
    #[cfg(test)]
    pub(crate) fn fixed(ring: KeyRing) -> Self {
        // The sender is dropped: the receiver keeps the last value.
        let (_, rx) = watch::channel(Arc::new(ring));
        Self::following(rx)
    }

    /// Whatever ring `rings` holds at each use.
    pub(crate) fn following(rings: watch::Receiver<Arc<KeyRing>>) -> Self {
        Self {
            ring: Some(rings),
            warned: Arc::default(),
        }
    }

    /// Every later change of the ring (`None` for [`AtRestRing::plain`]).
    pub(crate) fn subscribe(&self) -> Option<watch::Receiver<Arc<KeyRing>>> {
        self.ring.clone()
    }

    /// The ring to seal or open with now.
    pub(crate) fn current(&self) -> Option<Arc<KeyRing>> {
        self.ring.as_ref().map(|rx| Arc::clone(&rx.borrow()))
    }

    /// Counts and logs a read that failed because the record is sealed
    /// under a key id the ring lacks; other errors are left to the caller.
    /// Warn at most once per [`MISSING_KEY_WARN_EVERY`] per key id.
    pub(crate) fn report(&self, error: &StoreError, metrics: &Metrics) {
        let StoreError::MissingKey { key, key_id } = error else {
            return;
        };
        metrics.store.unseal_failed("missing_key");
        let ring = self
            .current()
            .map(|r| format!("{r:?}"))
            .unwrap_or_else(|| "none (no cluster key)".to_owned());
        let first = self
            .warned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .allow(*key_id, Instant::now());
        let key_id = format!("{key_id:08x}");
        if first {
            warn!(
                store_key = %key, %key_id, %ring,
                "store record sealed under a key that is not in the cluster key ring: \
                 it cannot be opened; put that key back in the key file (after the primary), \
                 or delete the record to have it written anew"
            );
        } else {
            debug!(store_key = %key, %key_id, "store record sealed under a missing key");
        }
    }
}

impl fmt::Debug for AtRestRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AtRestRing").field(&self.current()).finish()
    }
}

/// When each key id was last warned about.
#[derive(Default)]
struct WarnLimit {
    last: HashMap<u32, Instant>,
}

impl WarnLimit {
    /// Whether a warning for `key_id` may be logged at `now`.
    fn allow(&mut self, key_id: u32, now: Instant) -> bool {
        match self.last.get(&key_id) {
            Some(at) if now.saturating_duration_since(*at) < MISSING_KEY_WARN_EVERY => false,
            _ => {
                // Key ids come from store bytes: bound the map.
                if self.last.len() >= 1024 {
                    self.last.clear();
                }
                self.last.insert(key_id, now);
                true
            }
        }
    }
}

/// Seals `plaintext` for storage at `key_name`: under the ring's primary
/// key when `ring` is given, else as a plain record.
///
/// # Errors
/// [`StoreError::Backend`] only if the crypto primitive (HKDF, the RNG)
/// fails.
pub fn seal_record(
    ring: Option<&KeyRing>,
    key_name: &str,
    plaintext: &[u8],
) -> Result<Vec<u8>, StoreError> {
    let Some(ring) = ring else {
        let mut out = Vec::with_capacity(1 + plaintext.len());
        out.push(FORMAT_PLAIN);
        out.extend_from_slice(plaintext);
        return Ok(out);
    };
    let key_id = ring.primary_id();
    let aead = aead_key(ring, key_id)?;
    let mut nonce = [0u8; NONCE_LEN];
    rand::fill(&mut nonce).map_err(|_| crypto_error("the random number generator failed"))?;

    let mut out = Vec::with_capacity(SEALED_OVERHEAD + plaintext.len());
    out.push(FORMAT_AES256GCM_V1);
    out.extend_from_slice(&key_id.to_be_bytes());
    out.extend_from_slice(&nonce);
    let mut body = plaintext.to_vec();
    let tag = aead
        .seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(aad(FORMAT_AES256GCM_V1, key_id, key_name)),
            &mut body,
        )
        .map_err(|_| crypto_error("sealing failed"))?;
    out.extend_from_slice(&body);
    out.extend_from_slice(tag.as_ref());
    Ok(out)
}

/// Opens a record read from `key_name` (see the module docs for the format).
///
/// # Errors
/// - [`StoreError::MissingKey`]: sealed under a key id that `ring` lacks, or
///   sealed while `ring` is `None`;
/// - [`StoreError::Corrupt`]: empty, unknown format, truncated, or the
///   authentication failed (altered, or moved from another store key).
pub fn open_record(
    ring: Option<&KeyRing>,
    key_name: &str,
    bytes: &[u8],
) -> Result<Vec<u8>, StoreError> {
    let corrupt = |message: &str| StoreError::Corrupt {
        key: key_name.to_owned(),
        message: message.to_owned(),
    };
    let Some((&format, rest)) = bytes.split_first() else {
        return Err(corrupt("empty record (no format byte)"));
    };
    match format {
        FORMAT_PLAIN => Ok(rest.to_vec()),
        FORMAT_AES256GCM_V1 => {
            if bytes.len() < SEALED_OVERHEAD {
                return Err(corrupt("sealed record shorter than its header and tag"));
            }
            let (id_bytes, rest) = rest.split_at(KEY_ID_LEN);
            let (nonce_bytes, body) = rest.split_at(NONCE_LEN);
            let key_id = u32::from_be_bytes(to_array(id_bytes));
            let ring = match ring {
                Some(ring) if ring.contains(key_id) => ring,
                _ => {
                    return Err(StoreError::MissingKey {
                        key: key_name.to_owned(),
                        key_id,
                    });
                }
            };
            let aead = aead_key(ring, key_id)?;
            let mut body = body.to_vec();
            let opened = aead
                .open_in_place(
                    Nonce::assume_unique_for_key(to_array(nonce_bytes)),
                    Aad::from(aad(format, key_id, key_name)),
                    &mut body,
                )
                .map_err(|_| {
                    corrupt(
                        "authentication failed: the record was altered or belongs to another store key",
                    )
                })?;
            Ok(opened.to_vec())
        }
        other => Err(corrupt(&format!(
            "unknown at-rest format byte 0x{other:02x} (this version reads 0x50 plain and 0xa5 AES-256-GCM)"
        ))),
    }
}

/// The key id a record is sealed under; `None` for a plain record (or bytes
/// too short to say). Lets a caller find records still sealed under an old
/// key before dropping it from the ring.
pub(crate) fn sealed_key_id(bytes: &[u8]) -> Option<u32> {
    match bytes {
        [FORMAT_AES256GCM_V1, a, b, c, d, ..] => Some(u32::from_be_bytes([*a, *b, *c, *d])),
        _ => None,
    }
}

fn aead_key(ring: &KeyRing, key_id: u32) -> Result<LessSafeKey, StoreError> {
    let mut raw = ring
        .derive(key_id, STORE_AT_REST_LABEL)
        .map_err(|e| crypto_error(&e.to_string()))?;
    let unbound = UnboundKey::new(&AES_256_GCM, &raw);
    raw.fill(0);
    unbound
        .map(LessSafeKey::new)
        .map_err(|_| crypto_error("key setup failed"))
}

fn aad(format: u8, key_id: u32, key_name: &str) -> Vec<u8> {
    let mut aad = Vec::with_capacity(AAD_DOMAIN.len() + 1 + KEY_ID_LEN + key_name.len());
    aad.extend_from_slice(AAD_DOMAIN);
    aad.push(format);
    aad.extend_from_slice(&key_id.to_be_bytes());
    aad.extend_from_slice(key_name.as_bytes());
    aad
}

/// The first `N` bytes (zero-padded when shorter, which the length checks
/// above rule out); no indexing, so no panic path.
fn to_array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    for (dst, src) in out.iter_mut().zip(bytes) {
        *dst = *src;
    }
    out
}

fn crypto_error(message: &str) -> StoreError {
    StoreError::Backend {
        backend: CRYPTO,
        message: message.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: [u8; 32] = [1; 32];
    const NEW: [u8; 32] = [2; 32];

    fn ring(keys: &[[u8; 32]]) -> KeyRing {
        KeyRing::new(keys.to_vec()).unwrap()
    }

    #[test]
    fn round_trip_and_format() {
        let r = ring(&[NEW]);
        let sealed = seal_record(Some(&r), "acme/accounts/a", b"private key").unwrap();
        assert_eq!(sealed.len(), b"private key".len() + SEALED_OVERHEAD);
        assert_eq!(sealed[0], FORMAT_AES256GCM_V1);
        assert_eq!(sealed_key_id(&sealed), Some(r.primary_id()));
        assert!(!sealed.windows(11).any(|w| w == b"private key"));
        assert_eq!(
            open_record(Some(&r), "acme/accounts/a", &sealed).unwrap(),
            b"private key"
        );
        // Fresh nonce each time.
        assert_ne!(
            sealed,
            seal_record(Some(&r), "acme/accounts/a", b"private key").unwrap()
        );
        // Empty plaintext works too.
        let empty = seal_record(Some(&r), "k", b"").unwrap();
        assert_eq!(open_record(Some(&r), "k", &empty).unwrap(), b"");
    }

    #[test]
    fn plain_without_ring_and_accepted_with_one() {
        let plain = seal_record(None, "k", b"abc").unwrap();
        assert_eq!(plain, b"Pabc");
        assert_eq!(sealed_key_id(&plain), None);
        assert_eq!(open_record(None, "k", &plain).unwrap(), b"abc");
        // Migration: a pod that gained a cluster key still reads its records.
        assert_eq!(
            open_record(Some(&ring(&[NEW])), "k", &plain).unwrap(),
            b"abc"
        );
    }

    #[test]
    fn missing_key_is_a_clear_error() {
        let r = ring(&[OLD]);
        let sealed = seal_record(Some(&r), "certs/a/key", b"secret").unwrap();
        for reader in [None, Some(ring(&[NEW]))] {
            let err = open_record(reader.as_ref(), "certs/a/key", &sealed).unwrap_err();
            match &err {
                StoreError::MissingKey { key, key_id } => {
                    assert_eq!(key, "certs/a/key");
                    assert_eq!(*key_id, r.primary_id());
                }
                other => panic!("expected MissingKey, got {other:?}"),
            }
            assert!(
                err.to_string().contains(&format!("{:08x}", r.primary_id())),
                "{err}"
            );
        }
    }

    #[test]
    fn rotation_opens_old_records_while_the_old_key_is_in_the_ring() {
        let before = ring(&[OLD]);
        let sealed_old = seal_record(Some(&before), "k", b"v").unwrap();
        let during = ring(&[NEW, OLD]);
        assert_eq!(open_record(Some(&during), "k", &sealed_old).unwrap(), b"v");
        let resealed = seal_record(Some(&during), "k", b"v").unwrap();
        assert_eq!(sealed_key_id(&resealed), Some(during.primary_id()));
        let after = ring(&[NEW]);
        assert_eq!(open_record(Some(&after), "k", &resealed).unwrap(), b"v");
        assert!(matches!(
            open_record(Some(&after), "k", &sealed_old),
            Err(StoreError::MissingKey { .. })
        ));
    }

    #[test]
    fn at_rest_ring_follows_its_source() {
        assert!(AtRestRing::plain().current().is_none());
        let (tx, rx) = watch::channel(Arc::new(ring(&[OLD])));
        let follower = AtRestRing::following(rx);
        let sealed_old = seal_record(follower.current().as_deref(), "k", b"v").unwrap();
        tx.send_replace(Arc::new(ring(&[NEW, OLD])));
        let now = follower.current().unwrap();
        assert_eq!(now.primary_id(), ring(&[NEW]).primary_id());
        let sealed_new = seal_record(Some(&now), "k", b"v").unwrap();
        assert_eq!(sealed_key_id(&sealed_new), Some(now.primary_id()));
        assert_eq!(open_record(Some(&now), "k", &sealed_old).unwrap(), b"v");
        // A clone sees the same source.
        tx.send_replace(Arc::new(ring(&[NEW])));
        let clone = follower.clone();
        assert!(matches!(
            open_record(clone.current().as_deref(), "k", &sealed_old),
            Err(StoreError::MissingKey { .. })
        ));
    }

    #[test]
    fn missing_keys_are_counted_and_warned_once_a_minute_per_key() {
        let metrics = Metrics::new();
        let r = AtRestRing::fixed(ring(&[NEW]));
        let missing = StoreError::MissingKey {
            key: "certs/a".to_owned(),
            key_id: 7,
        };
        r.report(&missing, &metrics);
        r.report(&missing, &metrics);
        r.report(
            &StoreError::Corrupt {
                key: "k".to_owned(),
                message: "x".to_owned(),
            },
            &metrics,
        );
        assert!(
            metrics
                .encode()
                .contains(r#"store_unseal_failures_total{reason="missing_key"} 2"#),
            "{}",
            metrics.encode()
        );

        let mut limit = WarnLimit::default();
        let t0 = Instant::now();
        assert!(limit.allow(7, t0));
        assert!(!limit.allow(7, t0 + Duration::from_secs(59)));
        assert!(limit.allow(8, t0 + Duration::from_secs(59)));
        assert!(limit.allow(7, t0 + MISSING_KEY_WARN_EVERY));
    }

    #[test]
    fn moved_or_altered_records_fail() {
        let r = ring(&[NEW]);
        let sealed = seal_record(Some(&r), "certs/a.example/key", b"secret").unwrap();
        assert!(matches!(
            open_record(Some(&r), "certs/b.example/key", &sealed),
            Err(StoreError::Corrupt { .. })
        ));
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x01;
            let res = open_record(Some(&r), "certs/a.example/key", &bad);
            assert!(
                matches!(
                    res,
                    Err(StoreError::Corrupt { .. } | StoreError::MissingKey { .. })
                ),
                "flip at {i}: {res:?}"
            );
        }
        for len in 0..SEALED_OVERHEAD {
            assert!(open_record(Some(&r), "certs/a.example/key", &sealed[..len]).is_err());
        }
        assert!(matches!(
            open_record(Some(&r), "k", b"\x07zzz"),
            Err(StoreError::Corrupt { .. })
        ));
    }
}
