//! Property tests of the mesh packet seal: whatever arrives from the network,
//! `unseal` returns (never panics), accepts nothing that `seal` did not
//! produce, and accepts each sealed packet exactly once.

use std::sync::LazyLock;

use super::{Channel, MAX_DATAGRAM, REPLAY_WINDOW_MS, Reject, Sealer};
use crate::keyring::KeyRing;
use proptest::prelude::*;

const CLUSTER: &str = "props";
const T0: u64 = 1_700_000_000_000;
const HEADER_LEN: usize = 25;
const KEY: [u8; 32] = [0x42; 32];
const OLD_KEY: [u8; 32] = [0x17; 32];

fn sealer() -> Sealer {
    Sealer::new(CLUSTER, KeyRing::new(vec![KEY, OLD_KEY]).unwrap())
}

/// One sender for every test, and one receiver per test: `Sealer` is `Sync`,
/// and a receiver shared across a test's cases exercises its replay cache
/// over the whole run. Tests run on parallel threads with clocks of their
/// own, so they must not share a replay cache.
static TX: LazyLock<Sealer> = LazyLock::new(sealer);
static RX_JUNK: LazyLock<Sealer> = LazyLock::new(sealer);
static RX_MUTATED: LazyLock<Sealer> = LazyLock::new(sealer);
static RX_ONCE: LazyLock<Sealer> = LazyLock::new(sealer);
static RX_SKEW: LazyLock<Sealer> = LazyLock::new(sealer);

/// The first 13 bytes (version, cluster tag, key id) of a genuine packet, so
/// random tails get past the cheap header checks to the AEAD.
static GENUINE_PREFIX: LazyLock<Vec<u8>> = LazyLock::new(|| {
    let mut out = Vec::new();
    TX.seal(Channel::Udp, b"", T0, &mut out).unwrap();
    out.truncate(13);
    out
});

fn channel() -> impl Strategy<Value = Channel> {
    prop_oneof![Just(Channel::Udp), Just(Channel::Tcp)]
}

/// A receive time: near the senders' clock, or anywhere at all.
fn now() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => (T0 - 2 * REPLAY_WINDOW_MS)..(T0 + 2 * REPLAY_WINDOW_MS),
        1 => any::<u64>(),
    ]
}

/// Bytes that did not come out of `seal`.
#[derive(Debug, Clone)]
enum Junk {
    /// Anything, including empty and over-long inputs.
    Random(Vec<u8>),
    /// Version 1, our cluster tag and a key id in the ring, then random
    /// nonce, ciphertext and tag: only the AEAD stands in the way.
    GenuineHeader(Vec<u8>),
    /// Version 1 and our cluster tag, random key id onwards.
    GenuineCluster(Vec<u8>),
}

impl Junk {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Junk::Random(b) => b.clone(),
            Junk::GenuineHeader(tail) => [&GENUINE_PREFIX[..], tail].concat(),
            Junk::GenuineCluster(tail) => [&GENUINE_PREFIX[..9], tail].concat(),
        }
    }
}

fn junk() -> impl Strategy<Value = Junk> {
    let len = 0..MAX_DATAGRAM + 100;
    prop_oneof![
        prop::collection::vec(any::<u8>(), len.clone()).prop_map(Junk::Random),
        prop::collection::vec(any::<u8>(), len.clone()).prop_map(Junk::GenuineHeader),
        prop::collection::vec(any::<u8>(), len).prop_map(Junk::GenuineCluster),
    ]
}

/// A change to a genuine packet.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit {
        at: prop::sample::Index,
        bit: u8,
    },
    SetByte {
        at: prop::sample::Index,
        value: u8,
    },
    Truncate {
        at: prop::sample::Index,
    },
    Append(Vec<u8>),
    Insert {
        at: prop::sample::Index,
        value: u8,
    },
    Remove {
        at: prop::sample::Index,
    },
    /// Overwrite a run of bytes starting at `at`.
    Overwrite {
        at: prop::sample::Index,
        bytes: Vec<u8>,
    },
    /// Keep this packet's header, take the body of another genuine packet.
    SwapBody {
        other_payload: Vec<u8>,
    },
    /// Several of the above, applied in turn.
    Many(Vec<Mutation>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let leaf = prop_oneof![
        (any::<prop::sample::Index>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        (any::<prop::sample::Index>(), any::<u8>())
            .prop_map(|(at, value)| Mutation::SetByte { at, value }),
        any::<prop::sample::Index>().prop_map(|at| Mutation::Truncate { at }),
        prop::collection::vec(any::<u8>(), 1..40).prop_map(Mutation::Append),
        (any::<prop::sample::Index>(), any::<u8>())
            .prop_map(|(at, value)| Mutation::Insert { at, value }),
        any::<prop::sample::Index>().prop_map(|at| Mutation::Remove { at }),
        (
            any::<prop::sample::Index>(),
            prop::collection::vec(any::<u8>(), 1..32)
        )
            .prop_map(|(at, bytes)| Mutation::Overwrite { at, bytes }),
        prop::collection::vec(any::<u8>(), 0..64)
            .prop_map(|other_payload| Mutation::SwapBody { other_payload }),
    ];
    leaf.prop_recursive(2, 6, 4, |inner| {
        prop::collection::vec(inner, 2..4).prop_map(Mutation::Many)
    })
}

impl Mutation {
    fn apply(&self, packet: &mut Vec<u8>, channel: Channel) {
        match self {
            Mutation::FlipBit { at, bit } => {
                if !packet.is_empty() {
                    let i = at.index(packet.len());
                    packet[i] ^= 1 << bit;
                }
            }
            Mutation::SetByte { at, value } => {
                if !packet.is_empty() {
                    let i = at.index(packet.len());
                    packet[i] = *value;
                }
            }
            Mutation::Truncate { at } => {
                if !packet.is_empty() {
                    packet.truncate(at.index(packet.len()));
                }
            }
            Mutation::Append(bytes) => packet.extend_from_slice(bytes),
            Mutation::Insert { at, value } => {
                let i = at.index(packet.len() + 1);
                packet.insert(i, *value);
            }
            Mutation::Remove { at } => {
                if !packet.is_empty() {
                    packet.remove(at.index(packet.len()));
                }
            }
            Mutation::Overwrite { at, bytes } => {
                if !packet.is_empty() {
                    let start = at.index(packet.len());
                    for (dst, src) in packet[start..].iter_mut().zip(bytes) {
                        *dst = *src;
                    }
                }
            }
            Mutation::SwapBody { other_payload } => {
                let mut other = Vec::new();
                TX.seal(channel, other_payload, T0, &mut other).unwrap();
                packet.truncate(HEADER_LEN.min(packet.len()));
                packet.extend_from_slice(&other[HEADER_LEN..]);
            }
            Mutation::Many(all) => {
                for m in all {
                    m.apply(packet, channel);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100_000, ..ProptestConfig::default() })]

    /// Bytes that never came out of `seal` are rejected, whatever they are.
    #[test]
    fn bytes_not_from_seal_are_rejected(junk in junk(), channel in channel(), now in now()) {
        let bytes = junk.bytes();
        let got = RX_JUNK.unseal(channel, &bytes, now);
        match (&junk, got) {
            (_, Ok(payload)) => prop_assert!(false, "accepted junk as {payload:?}"),
            // Past the version and cluster checks, only the AEAD (or the
            // length) can be what stops it.
            (Junk::GenuineHeader(_) | Junk::GenuineCluster(_), Err(reject)) => {
                prop_assert!(matches!(reject, Reject::Decrypt | Reject::Size), "{reject:?}");
            }
            (Junk::Random(_), Err(_)) => {}
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20_000, ..ProptestConfig::default() })]

    /// A genuine packet changed in any way is rejected, and a "change" that
    /// leaves it intact still opens (once).
    #[test]
    fn mutated_packets_are_rejected(
        payload in prop::collection::vec(any::<u8>(), 0..300),
        channel in channel(),
        mutation in mutation(),
    ) {
        let mut packet = Vec::new();
        TX.seal(channel, &payload, T0, &mut packet).unwrap();
        let mut mutated = packet.clone();
        mutation.apply(&mut mutated, channel);

        let got = RX_MUTATED.unseal(channel, &mutated, T0);
        if mutated == packet {
            prop_assert_eq!(got, Ok(payload));
        } else {
            prop_assert!(got.is_err(), "accepted a mutated packet");
            // The forgery did not burn the genuine packet's nonce.
            prop_assert_eq!(RX_MUTATED.unseal(channel, &packet, T0), Ok(payload));
        }
        prop_assert_eq!(RX_MUTATED.unseal(channel, &packet, T0), Err(Reject::Replay));
    }

    /// A genuine packet, received within the window, opens exactly once, and
    /// never on the other channel.
    #[test]
    fn genuine_packet_unseals_exactly_once(
        payload in prop::collection::vec(any::<u8>(), 0..2000),
        channel in channel(),
        skew in -(REPLAY_WINDOW_MS as i64)..=(REPLAY_WINDOW_MS as i64),
        now in T0..T0 + 86_400_000,
    ) {
        let payload = &payload[..payload.len().min(channel.max_payload())];
        let sent = now.checked_add_signed(skew).unwrap();
        let mut packet = Vec::new();
        TX.seal(channel, payload, sent, &mut packet).unwrap();

        let other = match channel {
            Channel::Udp => Channel::Tcp,
            Channel::Tcp => Channel::Udp,
        };
        let on_other = RX_ONCE.unseal(other, &packet, now);
        prop_assert!(matches!(on_other, Err(Reject::Decrypt | Reject::Size)), "{on_other:?}");

        prop_assert_eq!(RX_ONCE.unseal(channel, &packet, now), Ok(payload.to_vec()));
        prop_assert_eq!(RX_ONCE.unseal(channel, &packet, now), Err(Reject::Replay));
        prop_assert_eq!(RX_ONCE.unseal(other, &packet, now).is_err(), true);
    }

    /// A genuine packet stamped outside the window is `ClockSkew` with
    /// exactly its offset (sender minus receiver), never `Replay`, and does
    /// not burn its nonce: at the sender's own time it opens.
    #[test]
    fn genuine_packet_outside_the_window_is_clock_skew_with_its_offset(
        payload in prop::collection::vec(any::<u8>(), 0..300),
        channel in channel(),
        skew in prop_oneof![
            -(1i64 << 40)..-(REPLAY_WINDOW_MS as i64),
            (REPLAY_WINDOW_MS as i64 + 1)..(1i64 << 40),
        ],
        now in T0..T0 + 86_400_000,
    ) {
        let sent = now.checked_add_signed(skew).unwrap();
        let mut packet = Vec::new();
        TX.seal(channel, &payload, sent, &mut packet).unwrap();
        prop_assert_eq!(
            RX_SKEW.unseal(channel, &packet, now),
            Err(Reject::ClockSkew { offset_ms: skew })
        );
        prop_assert_eq!(RX_SKEW.unseal(channel, &packet, sent), Ok(payload));
    }
}
