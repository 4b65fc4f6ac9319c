//! Sealing mesh packets: AES-256-GCM under the cluster key ring, bound to the
//! cluster, the format version and the transport, with a replay window.
//!
//! Sans-IO: the caller passes the clock (`now_unix_ms`) and the bytes; the
//! only ambient input is the system RNG for nonces. Every UDP datagram and
//! every TCP frame of the mesh (docs/reference.md#the-mesh) goes through [`Sealer::seal_with`]
//! on the way out and [`Sealer::unseal_keyed`] on the way in; a [`Reject`] names the
//! `reason` label of `mesh_packets_rejected_total` (docs/reference.md#mesh-metrics).
//!
//! # Wire format (version 1)
//!
//! ```text
//! offset  size  field
//!  0       1    version        = FORMAT_VERSION (1)
//!  1       8    cluster_tag    = SHA-256("sbmesh-cluster\0" || cluster_id)[..8]
//!  9       4    key_id         (u32 big-endian) = SHA-256("sbmesh-key-id\0" || key)[..4]
//! 13      12    nonce          random, fresh for every packet
//! 25       n    ciphertext     AES-256-GCM of (sender_unix_ms u64 BE || payload)
//! 25+n    16    tag            GCM tag
//! ```
//!
//! `n = 8 + payload.len()`, so a packet is [`Sealer::overhead`] (49) bytes
//! longer than its payload. The first 25 bytes are the *clear header*.
//!
//! Associated data: `"sbmesh" || version || channel || cluster_id || clear header`,
//! where `channel` is 1 for UDP and 2 for TCP. The cluster id and version
//! are authenticated in full (the 8-byte tag only lets a receiver drop a
//! foreign cluster's packets cheaply and count them as `cluster`), and a UDP
//! datagram cannot be replayed as a TCP frame or the other way round.
//!
//! The AES key of each ring key is HKDF-SHA256(salt = `"sbmesh mesh v1"`,
//! ikm = key, info = `"mesh-aead"`); see [`KeyRing`].
//!
//! # Checks on the way in, in order
//!
//! 1. length below [`Sealer::overhead`] or above the channel's limit
//!    ([`MAX_DATAGRAM`] for UDP, [`MAX_FRAME`] for TCP) → [`Reject::Size`];
//! 2. unknown version → [`Reject::Decode`];
//! 3. cluster tag of another cluster → [`Reject::Cluster`];
//! 4. key id not in the ring, or authentication fails → [`Reject::Decrypt`];
//! 5. sender time more than [`REPLAY_WINDOW_MS`] away from ours →
//!    [`Reject::ClockSkew`], with the measured offset;
//! 6. nonce already accepted within the window → [`Reject::Replay`].
//!
//! Step 5 is its own reason because a packet that authenticates but is
//! stamped outside the window is, in practice, a peer whose clock (or ours)
//! is off: every one of its packets fails the same way, and the node is cut
//! off from the mesh without a trace under `replay`. A packet captured and
//! replayed more than 30 s later lands there too; its "offset" is then its
//! age. [`SkewWatch`] therefore judges by the pattern over time, not by one
//! packet: a skewed peer fails on every packet, and a node that hears
//! nothing but skewed packets is isolated (and not ready).
//!
//! A nonce is recorded only after steps 1-5 pass, so forged packets cannot
//! fill the replay cache; see the cache's bounds and trade-off on
//! [`REPLAY_CACHE_CAPACITY`]. Nothing here panics on input bytes, and the
//! way in allocates only the associated data and a copy of the packet, whose
//! length was bounded in step 1 (a TCP shell must likewise bound a frame's
//! length prefix by [`MAX_FRAME`] before reading the frame).
//!
//! # Nonces and key lifetime
//!
//! Nonces are 96 random bits, so one key should seal at most 2³² packets
//! (NIST SP 800-38D's bound for random GCM nonces; the chance of any nonce
//! repeating is then about 2⁻³³). The count is per key across the whole
//! cluster: 100 nodes gossiping 10 packets per second reach it in about 50
//! days, 100 nodes at 1 000 per second in about 12 hours. Rotate keys (see
//! [`KeyRing`]) well within that.

mod peer_keys;
#[cfg(test)]
mod props;
mod replay;
mod skew;

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use aws_lc_rs::aead::{Aad, NONCE_LEN as GCM_NONCE_LEN, Nonce};
use aws_lc_rs::digest;
use rand::TryRng;

use crate::keyring::KeyRing;

pub(crate) use peer_keys::PeerKeys;
use replay::ReplayCache;
pub use skew::{Isolation, SkewWatch, SkewedPeer};

/// Version byte of the wire format this module writes and reads.
pub(crate) const FORMAT_VERSION: u8 = 1;

/// Largest sealed UDP packet accepted (and produced), in bytes. A UDP
/// payload may be at most `MAX_DATAGRAM - Sealer::overhead()` bytes.
pub const MAX_DATAGRAM: usize = 1500;

/// Largest sealed TCP frame accepted (and produced), in bytes.
pub(crate) const MAX_FRAME: usize = 16 << 20;

/// A packet whose sender time differs from ours by more than this is a
/// [`Reject::ClockSkew`]; nonces are remembered for as long.
pub const REPLAY_WINDOW_MS: u64 = 30_000;

/// Most nonces the replay cache holds (one per accepted packet still inside
/// the window).
///
/// Filling it takes a key holder delivering more than about 4 400 fresh
/// packets per second to one node. When full, the nonce closest to leaving
/// the window is forgotten, so that one packet could be replayed until its
/// window ends. Refusing packets instead would let one chatty or compromised
/// peer cut a node off from the mesh, while a replayed SWIM message is at
/// worst a stale ping or a membership update foca already knows. At this
/// capacity the cache peaks around 13 MB.
pub(crate) const REPLAY_CACHE_CAPACITY: usize = 262_144;

const VERSION_LEN: usize = 1;
const CLUSTER_TAG_LEN: usize = 8;
const KEY_ID_LEN: usize = 4;
const NONCE_LEN: usize = GCM_NONCE_LEN;
const HEADER_LEN: usize = VERSION_LEN + CLUSTER_TAG_LEN + KEY_ID_LEN + NONCE_LEN;
const TIMESTAMP_LEN: usize = 8;
const TAG_LEN: usize = 16;
const OVERHEAD: usize = HEADER_LEN + TIMESTAMP_LEN + TAG_LEN;

/// Prefix of the associated data, before the version byte.
const AAD_DOMAIN: &[u8] = b"sbmesh";
/// Domain separator of the cluster tag hash.
const CLUSTER_TAG_DOMAIN: &[u8] = b"sbmesh-cluster\0";

/// The transport a packet travels on. It is authenticated with the packet,
/// so a UDP datagram replayed into a TCP stream (or the reverse) fails to
/// open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    /// SWIM datagrams on the gossip port.
    Udp,
    /// Frames on the transport port (full-state exchange, large metadata).
    Tcp,
}

impl Channel {
    /// Largest sealed packet accepted on this channel.
    pub(crate) fn max_packet(self) -> usize {
        match self {
            Channel::Udp => MAX_DATAGRAM,
            Channel::Tcp => MAX_FRAME,
        }
    }

    /// Largest payload that [`Sealer::seal_with`] accepts for this channel (for
    /// UDP, the foca `max_packet_size` to configure).
    pub fn max_payload(self) -> usize {
        self.max_packet() - OVERHEAD
    }

    /// The `transport` label value of the mesh byte counters: `"udp"` or `"tcp"`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Channel::Udp => "udp",
            Channel::Tcp => "tcp",
        }
    }

    /// The byte bound into the associated data.
    fn aad_byte(self) -> u8 {
        match self {
            Channel::Udp => 1,
            Channel::Tcp => 2,
        }
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// Why an incoming packet was dropped. Each is one `reason` of
/// `mesh_packets_rejected_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Reject {
    /// Unknown key id, or the packet failed authentication (tampered, other
    /// key, other channel, or not a packet at all).
    #[error("packet failed authentication or names a key not in the ring")]
    Decrypt,
    /// The packet belongs to another cluster.
    #[error("packet belongs to another cluster")]
    Cluster,
    /// The packet was already accepted once (its nonce is in the replay
    /// cache).
    #[error("packet was seen before (replay)")]
    Replay,
    /// The packet authenticated, but its sender time is more than
    /// [`REPLAY_WINDOW_MS`] away from ours: the sender's clock or ours is off
    /// (or the packet is a replay older than the window).
    #[error(
        "packet authenticated but its sender time is {offset_ms} ms off ours, beyond the \
         {window_s} s window: the sender's clock or ours is wrong (check NTP)",
        window_s = REPLAY_WINDOW_MS / 1000
    )]
    ClockSkew {
        /// Sender time minus ours, in milliseconds: positive when the
        /// sender's clock is ahead of ours.
        offset_ms: i64,
    },
    /// Unknown format version.
    #[error("packet has an unknown format version")]
    Decode,
    /// Too short to be a sealed packet, or longer than the channel allows.
    #[error("packet is too short or too long for its channel")]
    Size,
}

impl Reject {
    /// Every reason (the clock skew one with a zero offset), for
    /// registering metric series up front.
    #[cfg(test)]
    pub(crate) const ALL: [Reject; 6] = [
        Reject::Decrypt,
        Reject::Cluster,
        Reject::Replay,
        Reject::ClockSkew { offset_ms: 0 },
        Reject::Decode,
        Reject::Size,
    ];

    /// The `reason` label value of `mesh_packets_rejected_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Reject::Decrypt => "decrypt",
            Reject::Cluster => "cluster",
            Reject::Replay => "replay",
            Reject::ClockSkew { .. } => "clock_skew",
            Reject::Decode => "decode",
            Reject::Size => "size",
        }
    }
}

/// Errors sealing a packet (the ring's own are [`crate::keyring::KeyRingError`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// The payload does not fit one sealed packet on this channel.
    #[error(
        "a {len}-byte payload does not fit one sealed {channel} packet: at most {max} payload \
         bytes (split it, or send it over tcp)"
    )]
    TooLarge {
        /// The channel asked for.
        channel: Channel,
        /// The payload's length.
        len: usize,
        /// [`Channel::max_payload`] of that channel.
        max: usize,
    },
    /// The system random number generator failed to produce a nonce.
    #[error("the system random number generator failed")]
    Random,
    /// An aws-lc-rs primitive (HKDF or AES-GCM) reported a failure.
    #[error("the AES-GCM or HKDF primitive failed")]
    Crypto,
}

/// Seals and unseals mesh packets for one cluster.
///
/// `Send + Sync`: share one in an `Arc` between the UDP and TCP tasks. The
/// key ring can be swapped at run time (`Sealer::set_ring`); the replay
/// cache is shared by both channels and survives rotations.
pub struct Sealer {
    cluster_id: String,
    cluster_tag: [u8; CLUSTER_TAG_LEN],
    ring: RwLock<Arc<KeyRing>>,
    replay: Mutex<ReplayCache>,
}

impl Sealer {
    /// A sealer for `cluster_id` with the given keys.
    pub fn new(cluster_id: &str, ring: KeyRing) -> Self {
        Self::with_replay_capacity(cluster_id, ring, REPLAY_CACHE_CAPACITY)
    }

    fn with_replay_capacity(cluster_id: &str, ring: KeyRing, capacity: usize) -> Self {
        let mut ctx = digest::Context::new(&digest::SHA256);
        ctx.update(CLUSTER_TAG_DOMAIN);
        ctx.update(cluster_id.as_bytes());
        Self {
            cluster_id: cluster_id.to_owned(),
            cluster_tag: prefix(ctx.finish().as_ref()),
            ring: RwLock::new(Arc::new(ring)),
            replay: Mutex::new(ReplayCache::new(capacity)),
        }
    }

    /// Replaces the key ring (key rotation). Packets being sealed or opened
    /// concurrently finish with the ring they started with.
    pub(crate) fn set_ring(&self, ring: KeyRing) {
        // A poisoned lock still holds a whole Arc: nothing to repair.
        *self.ring.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(ring);
    }

    /// The current key ring.
    #[cfg(test)]
    pub(crate) fn ring(&self) -> KeyRing {
        KeyRing::clone(&self.current_ring())
    }

    /// Bytes [`Sealer::seal_with`] adds to a payload: 25 header, 8 timestamp, 16 tag.
    pub(crate) fn overhead() -> usize {
        OVERHEAD
    }

    /// Bytes of the clear header (version, cluster tag, key id, nonce).
    pub(crate) fn clear_header_len() -> usize {
        HEADER_LEN
    }

    /// The checks of [`Sealer::unseal_keyed`] that need only the clear header
    /// (version, cluster tag, key id in the ring), so a TCP shell can drop a
    /// frame before reading or buffering its body.
    ///
    /// # Errors
    /// The [`Reject`] that `unseal` would give for this header.
    pub(crate) fn check_clear_header(&self, header: &[u8]) -> Result<(), Reject> {
        let Some(header) = header.first_chunk::<HEADER_LEN>() else {
            return Err(Reject::Size);
        };
        let header = Header::parse(header);
        if header.version != FORMAT_VERSION {
            return Err(Reject::Decode);
        }
        if header.cluster_tag != self.cluster_tag {
            return Err(Reject::Cluster);
        }
        match self.current_ring().aead(header.key_id) {
            Some(_) => Ok(()),
            None => Err(Reject::Decrypt),
        }
    }

    /// Seals `payload` under the primary key with a fresh random nonce and
    /// `now_unix_ms` as the sender time, and appends the packet to `out`.
    ///
    /// # Errors
    /// `SealError::TooLarge` if `payload` exceeds
    /// [`Channel::max_payload`]; `SealError::Random` if the OS random
    /// number generator fails; `SealError::Crypto` if aws-lc-rs fails.
    /// On error `out` is left as it was.
    #[cfg(test)]
    pub fn seal(
        &self,
        channel: Channel,
        payload: &[u8],
        now_unix_ms: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), SealError> {
        self.seal_with(channel, None, payload, now_unix_ms, out)
    }

    /// Like `Sealer::seal` (the tests'), but under the ring key `key_id` when the ring
    /// still holds it (else the primary). The mesh answers a peer in the
    /// key that peer used, so a peer still on `[old]` keeps talking to one
    /// already on `[new, old]` during a rolling rotation.
    pub(crate) fn seal_with(
        &self,
        channel: Channel,
        key_id: Option<u32>,
        payload: &[u8],
        now_unix_ms: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), SealError> {
        if payload.len() > channel.max_payload() {
            return Err(SealError::TooLarge {
                channel,
                len: payload.len(),
                max: channel.max_payload(),
            });
        }
        let mut nonce = [0u8; NONCE_LEN];
        // Straight from the OS: aws-lc's RAND_bytes would first seed its
        // jitter-entropy DRBG tree, ~30 ms of CPU at every process start.
        rand::rngs::SysRng
            .try_fill_bytes(&mut nonce)
            .map_err(|_| SealError::Random)?;

        let ring = self.current_ring();
        let (key_id, key) = match key_id.and_then(|id| ring.aead(id).map(|k| (id, k))) {
            Some(chosen) => chosen,
            None => ring.primary_aead(),
        };

        let mut header = [0u8; HEADER_LEN];
        let (version, rest) = header.split_at_mut(VERSION_LEN);
        let (tag, rest) = rest.split_at_mut(CLUSTER_TAG_LEN);
        let (id, nonce_field) = rest.split_at_mut(KEY_ID_LEN);
        version.copy_from_slice(&[FORMAT_VERSION]);
        tag.copy_from_slice(&self.cluster_tag);
        id.copy_from_slice(&key_id.to_be_bytes());
        nonce_field.copy_from_slice(&nonce);

        let start = out.len();
        out.reserve(OVERHEAD + payload.len());
        out.extend_from_slice(&header);
        out.extend_from_slice(&now_unix_ms.to_be_bytes());
        out.extend_from_slice(payload);
        let sealed = key.seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(self.aad(channel, &header)),
            &mut out[start + HEADER_LEN..],
        );
        match sealed {
            Ok(tag) => {
                out.extend_from_slice(tag.as_ref());
                Ok(())
            }
            Err(_) => {
                out.truncate(start);
                Err(SealError::Crypto)
            }
        }
    }

    /// Checks and opens one packet received on `channel` at `now_unix_ms`,
    /// returning its payload. The checks and their order are in the module
    /// documentation. A packet is accepted at most once.
    ///
    /// # Errors
    /// The [`Reject`] of the first check that failed.
    #[cfg(test)]
    pub fn unseal(
        &self,
        channel: Channel,
        packet: &[u8],
        now_unix_ms: u64,
    ) -> Result<Vec<u8>, Reject> {
        self.unseal_keyed(channel, packet, now_unix_ms)
            .map(|(payload, _)| payload)
    }

    /// Like `Sealer::unseal` (the tests'), also returning the id of the ring key that
    /// opened the packet.
    pub(crate) fn unseal_keyed(
        &self,
        channel: Channel,
        packet: &[u8],
        now_unix_ms: u64,
    ) -> Result<(Vec<u8>, u32), Reject> {
        if packet.len() < OVERHEAD || packet.len() > channel.max_packet() {
            return Err(Reject::Size);
        }
        let Some((header, body)) = packet.split_first_chunk::<HEADER_LEN>() else {
            return Err(Reject::Size);
        };
        let Header {
            version,
            cluster_tag,
            key_id,
            nonce,
        } = Header::parse(header);
        if version != FORMAT_VERSION {
            return Err(Reject::Decode);
        }
        if cluster_tag != self.cluster_tag {
            return Err(Reject::Cluster);
        }

        let ring = self.current_ring();
        let key = ring.aead(key_id).ok_or(Reject::Decrypt)?;
        // Bounded by the channel limit checked above.
        let mut buf = body.to_vec();
        let plain_len = key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(self.aad(channel, header)),
                &mut buf,
            )
            .map_err(|_| Reject::Decrypt)?
            .len();
        buf.truncate(plain_len);

        let Some(sender_ms) = buf.first_chunk::<TIMESTAMP_LEN>().copied() else {
            // Unreachable: the length check leaves at least 8 plaintext bytes.
            return Err(Reject::Decode);
        };
        let sender_ms = u64::from_be_bytes(sender_ms);
        if now_unix_ms.abs_diff(sender_ms) > REPLAY_WINDOW_MS {
            return Err(Reject::ClockSkew {
                offset_ms: offset_ms(sender_ms, now_unix_ms),
            });
        }
        let fresh = self
            .replay
            .lock()
            // The cache stays consistent even if a holder panicked mid-way
            // (at worst one nonce is in the set but not the heap, or the
            // reverse), so keep using it rather than failing every packet.
            .unwrap_or_else(PoisonError::into_inner)
            .insert(nonce, sender_ms, now_unix_ms);
        if !fresh {
            return Err(Reject::Replay);
        }
        buf.drain(..TIMESTAMP_LEN);
        Ok((buf, key_id))
    }

    fn current_ring(&self) -> Arc<KeyRing> {
        Arc::clone(&self.ring.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// `"sbmesh" || version || channel || cluster_id || clear header`.
    fn aad(&self, channel: Channel, header: &[u8; HEADER_LEN]) -> Vec<u8> {
        let mut aad = Vec::with_capacity(AAD_DOMAIN.len() + 2 + self.cluster_id.len() + HEADER_LEN);
        aad.extend_from_slice(AAD_DOMAIN);
        aad.push(FORMAT_VERSION);
        aad.push(channel.aad_byte());
        aad.extend_from_slice(self.cluster_id.as_bytes());
        aad.extend_from_slice(header);
        aad
    }

    #[cfg(test)]
    fn replay_len(&self) -> usize {
        self.replay
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sealer")
            .field("cluster_id", &self.cluster_id)
            .field("ring", &*self.current_ring())
            .finish_non_exhaustive()
    }
}

/// `sender - now` in milliseconds, saturated to the `i64` range (a garbage
/// timestamp from a key holder must not overflow).
fn offset_ms(sender_ms: u64, now_ms: u64) -> i64 {
    let diff = i128::from(sender_ms) - i128::from(now_ms);
    i64::try_from(diff).unwrap_or(if diff < 0 { i64::MIN } else { i64::MAX })
}

/// The clear header's fields.
struct Header {
    version: u8,
    cluster_tag: [u8; CLUSTER_TAG_LEN],
    key_id: u32,
    nonce: [u8; NONCE_LEN],
}

impl Header {
    fn parse(header: &[u8; HEADER_LEN]) -> Self {
        let [version, rest @ ..] = header;
        let (cluster_tag, rest) = split::<CLUSTER_TAG_LEN>(rest);
        let (key_id, nonce) = split::<KEY_ID_LEN>(rest);
        Header {
            version: *version,
            cluster_tag,
            key_id: u32::from_be_bytes(key_id),
            nonce: prefix(nonce),
        }
    }
}

/// First `N` bytes of `bytes` (zero-padded if shorter, which a SHA-256
/// digest or a fixed-size header never is); written without indexing so it
/// has no panic path.
fn prefix<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0u8; N];
    for (dst, src) in out.iter_mut().zip(bytes) {
        *dst = *src;
    }
    out
}

/// Splits `N` bytes off the front (zero-padded if short, which a fixed-size
/// header never is), without a panic path.
fn split<const N: usize>(bytes: &[u8]) -> ([u8; N], &[u8]) {
    match bytes.split_first_chunk::<N>() {
        Some((head, rest)) => (*head, rest),
        None => (prefix(bytes), &[]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLUSTER: &str = "prod-eu";
    const T0: u64 = 1_700_000_000_000;
    const OLD: [u8; 32] = [0x11; 32];
    const NEW: [u8; 32] = [0x22; 32];

    fn ring(keys: &[[u8; 32]]) -> KeyRing {
        KeyRing::new(keys.to_vec()).unwrap()
    }

    fn sealer(keys: &[[u8; 32]]) -> Sealer {
        Sealer::new(CLUSTER, ring(keys))
    }

    fn seal(s: &Sealer, channel: Channel, payload: &[u8], now: u64) -> Vec<u8> {
        let mut out = Vec::new();
        s.seal(channel, payload, now, &mut out).unwrap();
        out
    }

    #[test]
    fn sealer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Sealer>();
        check::<Arc<Sealer>>();
        check::<KeyRing>();
    }

    #[test]
    fn round_trip_on_both_channels() {
        let tx = sealer(&[OLD]);
        let rx = sealer(&[OLD]);
        for channel in [Channel::Udp, Channel::Tcp] {
            for payload in [&b""[..], b"ping", &[0xa5; 1000]] {
                let packet = seal(&tx, channel, payload, T0);
                assert_eq!(packet.len(), payload.len() + Sealer::overhead());
                assert_eq!(rx.unseal(channel, &packet, T0 + 5).unwrap(), payload);
            }
        }
    }

    #[test]
    fn header_layout_matches_the_documented_format() {
        let s = sealer(&[OLD]);
        let packet = seal(&s, Channel::Udp, b"x", T0);
        assert_eq!(packet[0], FORMAT_VERSION);
        let mut ctx = digest::Context::new(&digest::SHA256);
        ctx.update(b"sbmesh-cluster\0");
        ctx.update(CLUSTER.as_bytes());
        assert_eq!(&packet[1..9], &ctx.finish().as_ref()[..8]);
        assert_eq!(&packet[9..13], &s.ring().primary_id().to_be_bytes());
        assert_eq!(Sealer::overhead(), 49);
        assert_eq!(HEADER_LEN, 25);
    }

    #[test]
    fn nonces_are_fresh_per_packet() {
        let s = sealer(&[OLD]);
        let a = seal(&s, Channel::Udp, b"same", T0);
        let b = seal(&s, Channel::Udp, b"same", T0);
        assert_ne!(a[13..25], b[13..25]);
        assert_ne!(a, b);
    }

    #[test]
    fn seal_appends_to_existing_output() {
        let tx = sealer(&[OLD]);
        let rx = sealer(&[OLD]);
        let mut out = b"prefix".to_vec();
        tx.seal(Channel::Tcp, b"one", T0, &mut out).unwrap();
        let first_end = out.len();
        tx.seal(Channel::Tcp, b"two", T0, &mut out).unwrap();
        assert_eq!(&out[..6], b"prefix");
        assert_eq!(
            rx.unseal(Channel::Tcp, &out[6..first_end], T0).unwrap(),
            b"one"
        );
        assert_eq!(
            rx.unseal(Channel::Tcp, &out[first_end..], T0).unwrap(),
            b"two"
        );
    }

    #[test]
    fn rotation_rings_interoperate_both_ways() {
        let rotated = sealer(&[NEW, OLD]);
        let legacy = sealer(&[OLD]);
        let staged = sealer(&[OLD, NEW]);
        // [old] -> [new, old]: opened with the secondary key.
        let p = seal(&legacy, Channel::Udp, b"from legacy", T0);
        assert_eq!(
            rotated.unseal(Channel::Udp, &p, T0).unwrap(),
            b"from legacy"
        );
        // [old, new] seals with old, so [old] opens it.
        let p = seal(&staged, Channel::Udp, b"from staged", T0);
        assert_eq!(legacy.unseal(Channel::Udp, &p, T0).unwrap(), b"from staged");
        // [new, old] seals with new: [old, new] opens it, [old] cannot.
        let p = seal(&rotated, Channel::Udp, b"from rotated", T0);
        assert_eq!(
            staged.unseal(Channel::Udp, &p, T0).unwrap(),
            b"from rotated"
        );
        assert_eq!(legacy.unseal(Channel::Udp, &p, T0), Err(Reject::Decrypt));
    }

    #[test]
    fn unknown_sender_key_is_decrypt() {
        let stranger = sealer(&[[0x33; 32]]);
        let rx = sealer(&[NEW, OLD]);
        let p = seal(&stranger, Channel::Udp, b"hi", T0);
        assert_eq!(rx.unseal(Channel::Udp, &p, T0), Err(Reject::Decrypt));
    }

    #[test]
    fn spoofed_key_id_with_wrong_key_is_decrypt() {
        // Same key id in the header, different key material: auth must fail.
        let rx = sealer(&[OLD]);
        let mut p = seal(&sealer(&[[0x44; 32]]), Channel::Udp, b"hi", T0);
        p[9..13].copy_from_slice(&rx.ring().primary_id().to_be_bytes());
        assert_eq!(rx.unseal(Channel::Udp, &p, T0), Err(Reject::Decrypt));
    }

    #[test]
    fn other_cluster_is_cluster() {
        let other = Sealer::new("prod-us", ring(&[OLD]));
        let p = seal(&other, Channel::Udp, b"hi", T0);
        assert_eq!(
            sealer(&[OLD]).unseal(Channel::Udp, &p, T0),
            Err(Reject::Cluster)
        );
    }

    #[test]
    fn every_flipped_bit_is_rejected_with_the_right_reason() {
        let tx = sealer(&[OLD]);
        let rx = sealer(&[OLD]);
        let packet = seal(&tx, Channel::Udp, b"membership update", T0);
        for byte in 0..packet.len() {
            for bit in 0..8 {
                let mut p = packet.clone();
                p[byte] ^= 1 << bit;
                let want = match byte {
                    0 => Reject::Decode,
                    1..=8 => Reject::Cluster,
                    _ => Reject::Decrypt,
                };
                assert_eq!(
                    rx.unseal(Channel::Udp, &p, T0),
                    Err(want),
                    "byte {byte} bit {bit}"
                );
            }
        }
        // Nothing forged was recorded, and the genuine packet still opens.
        assert_eq!(rx.replay_len(), 0);
        assert_eq!(
            rx.unseal(Channel::Udp, &packet, T0).unwrap(),
            b"membership update"
        );
    }

    #[test]
    fn truncated_or_extended_packets_are_rejected() {
        let rx = sealer(&[OLD]);
        let packet = seal(&sealer(&[OLD]), Channel::Tcp, b"frame", T0);
        for len in 0..packet.len() {
            let want = if len < OVERHEAD {
                Reject::Size
            } else {
                Reject::Decrypt
            };
            assert_eq!(
                rx.unseal(Channel::Tcp, &packet[..len], T0),
                Err(want),
                "len {len}"
            );
        }
        let mut longer = packet.clone();
        longer.push(0);
        assert_eq!(rx.unseal(Channel::Tcp, &longer, T0), Err(Reject::Decrypt));
    }

    #[test]
    fn replayed_packet_is_replay() {
        let tx = sealer(&[OLD]);
        let rx = sealer(&[OLD]);
        let p = seal(&tx, Channel::Udp, b"once", T0);
        assert_eq!(rx.unseal(Channel::Udp, &p, T0).unwrap(), b"once");
        assert_eq!(rx.unseal(Channel::Udp, &p, T0 + 1), Err(Reject::Replay));
        assert_eq!(
            rx.unseal(Channel::Udp, &p, T0 + REPLAY_WINDOW_MS),
            Err(Reject::Replay)
        );
        // Past the window the timestamp check catches it first; its
        // "offset" is then the packet's age.
        assert_eq!(
            rx.unseal(Channel::Udp, &p, T0 + REPLAY_WINDOW_MS + 1),
            Err(Reject::ClockSkew {
                offset_ms: -(REPLAY_WINDOW_MS as i64) - 1
            })
        );
    }

    #[test]
    fn replay_window_is_inclusive_and_symmetric() {
        let tx = sealer(&[OLD]);
        let rx = sealer(&[OLD]);
        for (sent, now, ok) in [
            (T0, T0 + REPLAY_WINDOW_MS, true),
            (T0, T0 + REPLAY_WINDOW_MS + 1, false),
            (T0 + REPLAY_WINDOW_MS, T0, true),
            (T0 + REPLAY_WINDOW_MS + 1, T0, false),
            (T0 - 31_000, T0, false), // stale
            (T0 + 31_000, T0, false), // from the future
            (0, u64::MAX, false),
            (u64::MAX, 0, false),
        ] {
            let p = seal(&tx, Channel::Udp, b"t", sent);
            let got = rx.unseal(Channel::Udp, &p, now);
            if ok {
                assert_eq!(got.unwrap(), b"t", "sent {sent} now {now}");
            } else {
                assert!(
                    matches!(got, Err(Reject::ClockSkew { .. })),
                    "sent {sent} now {now}: {got:?}"
                );
            }
        }
    }

    #[test]
    fn sender_time_outside_the_window_is_clock_skew_with_the_signed_offset() {
        let tx = sealer(&[OLD]);
        let rx = sealer(&[OLD]);
        // The sender's clock is 60 s ahead of ours, then 60 s behind.
        for (sent, want) in [(T0 + 60_000, 60_000), (T0 - 60_000, -60_000)] {
            let p = seal(&tx, Channel::Udp, b"skewed", sent);
            assert_eq!(
                rx.unseal(Channel::Udp, &p, T0),
                Err(Reject::ClockSkew { offset_ms: want })
            );
            let p = seal(&tx, Channel::Tcp, b"skewed", sent);
            assert_eq!(
                rx.unseal(Channel::Tcp, &p, T0),
                Err(Reject::ClockSkew { offset_ms: want })
            );
        }
        // Extreme timestamps saturate instead of overflowing.
        let p = seal(&tx, Channel::Udp, b"far", u64::MAX);
        assert_eq!(
            rx.unseal(Channel::Udp, &p, 0),
            Err(Reject::ClockSkew {
                offset_ms: i64::MAX
            })
        );
        let p = seal(&tx, Channel::Udp, b"far", 0);
        assert_eq!(
            rx.unseal(Channel::Udp, &p, u64::MAX),
            Err(Reject::ClockSkew {
                offset_ms: i64::MIN
            })
        );
        assert_eq!(rx.replay_len(), 0);
    }

    #[test]
    fn clock_skew_is_decided_only_after_authentication() {
        let rx = sealer(&[OLD]);
        // Skewed and forged, or skewed and from another cluster: the earlier
        // check names it, so a stranger cannot pose as a skewed peer.
        let mut forged = seal(&sealer(&[OLD]), Channel::Udp, b"x", T0 + 60_000);
        let last = forged.len() - 1;
        forged[last] ^= 1;
        assert_eq!(rx.unseal(Channel::Udp, &forged, T0), Err(Reject::Decrypt));
        let other = Sealer::new("prod-us", ring(&[OLD]));
        let p = seal(&other, Channel::Udp, b"x", T0 + 60_000);
        assert_eq!(rx.unseal(Channel::Udp, &p, T0), Err(Reject::Cluster));
        let p = seal(&sealer(&[NEW]), Channel::Udp, b"x", T0 + 60_000);
        assert_eq!(rx.unseal(Channel::Udp, &p, T0), Err(Reject::Decrypt));
    }

    #[test]
    fn skewed_packet_is_not_remembered_and_opens_once_the_clocks_agree() {
        let tx = sealer(&[OLD]);
        let rx = sealer(&[OLD]);
        let p = seal(&tx, Channel::Udp, b"early", T0 + 45_000);
        assert_eq!(
            rx.unseal(Channel::Udp, &p, T0),
            Err(Reject::ClockSkew { offset_ms: 45_000 })
        );
        assert_eq!(rx.replay_len(), 0);
        // Our clock caught up: the same packet opens, once; then it is a replay.
        assert_eq!(rx.unseal(Channel::Udp, &p, T0 + 20_000).unwrap(), b"early");
        assert_eq!(
            rx.unseal(Channel::Udp, &p, T0 + 20_001),
            Err(Reject::Replay)
        );
    }

    #[test]
    fn stale_packet_does_not_enter_the_cache() {
        let tx = sealer(&[OLD]);
        let rx = sealer(&[OLD]);
        let p = seal(&tx, Channel::Udp, b"late", T0);
        assert_eq!(
            rx.unseal(Channel::Udp, &p, T0 + 60_000),
            Err(Reject::ClockSkew { offset_ms: -60_000 })
        );
        assert_eq!(rx.replay_len(), 0);
    }

    #[test]
    fn oversized_is_size_on_both_ends() {
        let tx = sealer(&[OLD]);
        let rx = sealer(&[OLD]);
        let max = Channel::Udp.max_payload();
        assert_eq!(max, MAX_DATAGRAM - OVERHEAD);
        let p = seal(&tx, Channel::Udp, &vec![7; max], T0);
        assert_eq!(p.len(), MAX_DATAGRAM);
        assert_eq!(rx.unseal(Channel::Udp, &p, T0).unwrap().len(), max);

        let mut out = b"keep".to_vec();
        let err = tx
            .seal(Channel::Udp, &vec![7; max + 1], T0, &mut out)
            .unwrap_err();
        assert_eq!(
            err,
            SealError::TooLarge {
                channel: Channel::Udp,
                len: max + 1,
                max
            }
        );
        assert_eq!(out, b"keep", "output untouched on error");

        // A datagram-sized limit does not apply to TCP, the frame limit does.
        let big = seal(&tx, Channel::Tcp, &vec![7; max + 1], T0);
        assert_eq!(rx.unseal(Channel::Udp, &big, T0), Err(Reject::Size));
        assert_eq!(rx.unseal(Channel::Tcp, &big, T0).unwrap().len(), max + 1);
        assert_eq!(
            rx.unseal(Channel::Tcp, &vec![0; MAX_FRAME + 1], T0),
            Err(Reject::Size)
        );
        assert!(matches!(
            tx.seal(
                Channel::Tcp,
                &vec![0; MAX_FRAME - OVERHEAD + 1],
                T0,
                &mut Vec::new()
            ),
            Err(SealError::TooLarge {
                channel: Channel::Tcp,
                ..
            })
        ));
    }

    #[test]
    fn largest_frame_round_trips() {
        let tx = sealer(&[OLD]);
        let p = seal(&tx, Channel::Tcp, &vec![1; Channel::Tcp.max_payload()], T0);
        assert_eq!(p.len(), MAX_FRAME);
        assert!(sealer(&[OLD]).unseal(Channel::Tcp, &p, T0).is_ok());
    }

    #[test]
    fn udp_packet_fed_as_tcp_is_decrypt_and_vice_versa() {
        let tx = sealer(&[OLD]);
        let rx = sealer(&[OLD]);
        let udp = seal(&tx, Channel::Udp, b"dgram", T0);
        assert_eq!(rx.unseal(Channel::Tcp, &udp, T0), Err(Reject::Decrypt));
        let tcp = seal(&tx, Channel::Tcp, b"frame", T0);
        assert_eq!(rx.unseal(Channel::Udp, &tcp, T0), Err(Reject::Decrypt));
        // The failed attempts did not burn the nonces.
        assert_eq!(rx.unseal(Channel::Udp, &udp, T0).unwrap(), b"dgram");
        assert_eq!(rx.unseal(Channel::Tcp, &tcp, T0).unwrap(), b"frame");
    }

    #[test]
    fn unknown_version_is_decode() {
        let rx = sealer(&[OLD]);
        let mut p = seal(&sealer(&[OLD]), Channel::Udp, b"v", T0);
        for v in [0, 2, 0xff] {
            p[0] = v;
            assert_eq!(rx.unseal(Channel::Udp, &p, T0), Err(Reject::Decode));
        }
    }

    #[test]
    fn set_ring_rotates_at_run_time() {
        let node_a = sealer(&[OLD]);
        let node_b = sealer(&[OLD]);
        let before = seal(&node_a, Channel::Udp, b"before", T0);

        // Step 1: both can open NEW, both still seal with OLD.
        node_a.set_ring(ring(&[OLD, NEW]));
        node_b.set_ring(ring(&[OLD, NEW]));
        assert_eq!(node_a.ring().primary_id(), ring(&[OLD]).primary_id());
        // Step 2: A seals with NEW; B, not yet switched, opens it.
        node_a.set_ring(ring(&[NEW, OLD]));
        let p = seal(&node_a, Channel::Udp, b"new key", T0);
        assert_eq!(&p[9..13], &ring(&[NEW]).primary_id().to_be_bytes());
        assert_eq!(node_b.unseal(Channel::Udp, &p, T0).unwrap(), b"new key");
        // Step 3: B drops OLD; a packet sealed under OLD no longer opens.
        node_b.set_ring(ring(&[NEW]));
        assert_eq!(
            node_b.unseal(Channel::Udp, &before, T0),
            Err(Reject::Decrypt)
        );
        // The replay cache survives the rotation.
        node_b.set_ring(ring(&[NEW, OLD]));
        assert_eq!(node_b.unseal(Channel::Udp, &p, T0), Err(Reject::Replay));
        assert_eq!(node_b.unseal(Channel::Udp, &before, T0).unwrap(), b"before");
    }

    #[test]
    fn full_replay_cache_stays_bounded() {
        let tx = sealer(&[OLD]);
        let rx = Sealer::with_replay_capacity(CLUSTER, ring(&[OLD]), 8);
        let first = seal(&tx, Channel::Udp, b"0", T0);
        assert!(rx.unseal(Channel::Udp, &first, T0).is_ok());
        for i in 1..20u64 {
            let p = seal(&tx, Channel::Udp, b"n", T0 + i);
            assert!(rx.unseal(Channel::Udp, &p, T0 + i).is_ok());
            assert!(rx.replay_len() <= 8);
        }
        // The documented trade-off: the evicted (oldest) nonce opens again.
        assert!(rx.unseal(Channel::Udp, &first, T0 + 20).is_ok());
    }

    #[test]
    fn concurrent_unseal_accepts_a_packet_once() {
        let tx = sealer(&[OLD]);
        let rx = Arc::new(sealer(&[OLD]));
        let packets: Arc<Vec<Vec<u8>>> = Arc::new(
            (0..200)
                .map(|i| seal(&tx, Channel::Udp, &[i as u8], T0))
                .collect(),
        );
        let accepted: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let rx = Arc::clone(&rx);
                    let packets = Arc::clone(&packets);
                    scope.spawn(move || {
                        packets
                            .iter()
                            .filter(|p| rx.unseal(Channel::Udp, p, T0).is_ok())
                            .count()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(accepted, 200);
    }

    #[test]
    fn reject_labels_match_the_metric_spec() {
        let labels: Vec<_> = Reject::ALL.iter().map(|r| r.label()).collect();
        assert_eq!(
            labels,
            [
                "decrypt",
                "cluster",
                "replay",
                "clock_skew",
                "decode",
                "size"
            ]
        );
        assert_eq!(Reject::ClockSkew { offset_ms: -5 }.label(), "clock_skew");
        assert_eq!(Channel::Udp.label(), "udp");
        assert_eq!(Channel::Tcp.to_string(), "tcp");
    }

    #[test]
    fn clock_skew_error_names_the_offset_and_the_fix() {
        let msg = Reject::ClockSkew { offset_ms: 60_123 }.to_string();
        assert!(msg.contains("60123 ms"), "{msg}");
        assert!(msg.contains("30 s window"), "{msg}");
        assert!(msg.contains("NTP"), "{msg}");
    }

    #[test]
    fn debug_does_not_leak_keys() {
        let shown = format!("{:?}", sealer(&[[0x5a; 32]]));
        assert!(shown.contains(CLUSTER), "{shown}");
        assert!(!shown.contains("90,"), "{shown}"); // 0x5a as a decimal array element
    }
}
