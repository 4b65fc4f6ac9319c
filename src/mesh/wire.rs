//! What travels inside sealed packets: the datagram envelope and the TCP
//! transport's messages. Everything here is decoded only after the packet
//! authenticated (see `seal`), and still never trusted for sizes.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::mesh::member::NodeIdentity;
use crate::mesh::meta::{MetaDigest, MetaRecord};
use crate::mesh::seal::{Channel, MAX_FRAME, Reject, Sealer};

/// Kinds of datagram payload.
pub(crate) const KIND_FOCA: u8 = 0;
pub(crate) const KIND_HELLO: u8 = 1;
pub(crate) const KIND_HELLO_ACK: u8 = 2;
pub(crate) const KIND_LEAVE: u8 = 3;
/// "You are suspected": sent by every member that hears of a suspicion,
/// to the suspect (see `suspicion`). Naming generation 0, a ring probe
/// (see `ring`): answered the same way, never a suspicion.
pub(crate) const KIND_CHECK: u8 = 4;
/// The suspect's answer: alive, at this incarnation (the refutation).
pub(crate) const KIND_CHECK_ACK: u8 = 5;
/// A member's metadata digest (`MetaDigest`, its record inline when small),
/// sent straight to a member that just came up instead of gossiped to all.
pub(crate) const KIND_DIGEST: u8 = 6;
/// Probe a member for the sender (a [`Check`] of it) and pass its answer
/// on: the indirect step of the monitoring ring (`ring.rs`).
pub(crate) const KIND_PING_REQ: u8 = 7;

/// Body of a check and of its answer: a member and an incarnation (the
/// suspected one in a check, the refuting one in the answer).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Check {
    pub id: NodeIdentity,
    pub incarnation: u16,
}

/// A member as carried by a full-state exchange.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct WireMember {
    pub id: NodeIdentity,
    pub incarnation: u16,
    /// 0 alive, 1 suspect, 2 down.
    pub state: u8,
}

/// Everything a member knows: exchanged on join and periodically.
///
/// Metadata travels as stamps (owner, epoch, version); whole records only
/// when the sender asked for them (`want_records`, on join), so the
/// periodic exchange stays small however large the records are.
///
/// The periodic exchange opens with the view's digest and its buckets
/// alone (`view`, `buckets`, no members): a peer whose view has the same
/// digest answers with its digest alone, so a steady mesh exchanges about
/// 200 bytes instead of every member both ways. A peer whose view differs
/// answers with the parts of it whose [`ViewBuckets`] differ (all of it to
/// a version without buckets).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub(crate) struct FullState {
    pub from: Option<NodeIdentity>,
    pub members: Vec<WireMember>,
    pub stamps: Vec<MetaDigest>,
    pub records: Vec<MetaRecord>,
    pub want_records: bool,
    /// The sender's [`ViewDigest`] of what both ends know about the others.
    /// On the wire after the message (see [`encode`]), so that the versions
    /// before it, which stop reading at the message's end, still talk.
    #[serde(skip)]
    pub view: Option<ViewDigest>,
    /// The same view split in [`VIEW_BUCKETS`] parts by owner, each hashed
    /// alone: after the view digest on the wire, where the versions before
    /// them stop reading. Only with `view`.
    #[serde(skip)]
    pub buckets: Option<Box<ViewBuckets>>,
}

/// A hash of a member's view of the mesh without the two ends of an
/// exchange: every other member with its incarnation and state, and every
/// metadata stamp. Two members that agree on all of it have the same one.
pub(crate) type ViewDigest = [u8; 16];

/// How many parts [`ViewBuckets`] splits a view in.
pub(crate) const VIEW_BUCKETS: usize = 16;

/// A view's entries by owner ([`view_bucket`]), each part hashed alone
/// (8 bytes): a difference in one member or record costs an exchange
/// one part of the view, not all of it.
pub(crate) type ViewBuckets = [[u8; 8]; VIEW_BUCKETS];

/// The part of a view that holds the entries of `node_id`: the same on
/// every member and version (its place on the ring, unlike the
/// per-process member key).
pub(crate) fn view_bucket(node_id: &str) -> usize {
    (crate::mesh::ring::position(node_id) % VIEW_BUCKETS as u64) as usize
}

/// The plain bytes of a transport message: postcard, then a full state's
/// view digest when it has one, then its buckets when it has them.
pub(crate) fn encode(msg: &TcpMsg) -> Result<Vec<u8>, postcard::Error> {
    let mut plain = postcard::to_allocvec(msg)?;
    if let TcpMsg::PushPull(FullState {
        view: Some(v),
        buckets,
        ..
    }) = msg
    {
        plain.extend_from_slice(v);
        for b in buckets.iter().flat_map(|b| b.iter()) {
            plain.extend_from_slice(b);
        }
    }
    Ok(plain)
}

/// Reads what [`encode`] wrote, or what a version without buckets or
/// without view digests wrote (less or nothing after the message).
pub(crate) fn decode(plain: &[u8]) -> Result<TcpMsg, postcard::Error> {
    let (mut msg, rest) = postcard::take_from_bytes::<TcpMsg>(plain)?;
    if let TcpMsg::PushPull(state) = &mut msg {
        let (view, rest) = rest.split_at_checked(size_of::<ViewDigest>()).unzip();
        state.view = view.and_then(|v| v.try_into().ok());
        state.buckets = rest
            .and_then(|r| r.get(..size_of::<ViewBuckets>()))
            .map(|r| {
                let mut out = Box::new([[0u8; 8]; VIEW_BUCKETS]);
                for (o, c) in out.iter_mut().zip(r.chunks_exact(8)) {
                    o.copy_from_slice(c);
                }
                out
            });
    }
    Ok(msg)
}

/// Messages of the TCP transport: one request, one reply per connection.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum TcpMsg {
    PushPull(FullState),
    MetaRequest(String),
    MetaReply(Option<MetaRecord>),
}

/// Errors of one TCP exchange.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The socket failed.
    #[error("transport i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The frame was refused by the seal or did not decode.
    #[error("frame rejected ({})", .0.label())]
    Rejected(Reject),
    /// The peer took too long.
    #[error("transport timed out")]
    Timeout,
}

/// Writes one sealed frame: a big-endian u32 length, then the sealed bytes.
/// Returns the bytes written.
pub(crate) async fn write_frame<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    sealer: &Sealer,
    key_id: Option<u32>,
    msg: &TcpMsg,
    now_ms: u64,
) -> Result<usize, WireError> {
    let plain = encode(msg).map_err(|_| WireError::Rejected(Reject::Decode))?;
    let mut sealed = Vec::with_capacity(plain.len() + Sealer::overhead() + 4);
    sealed.extend_from_slice(&[0; 4]);
    sealer
        .seal_with(Channel::Tcp, key_id, &plain, now_ms, &mut sealed)
        .map_err(|_| WireError::Rejected(Reject::Size))?;
    let len = sealed.len() - 4;
    if len > MAX_FRAME {
        return Err(WireError::Rejected(Reject::Size));
    }
    sealed[..4].copy_from_slice(&(len as u32).to_be_bytes());
    w.write_all(&sealed).await?;
    w.flush().await?;
    Ok(sealed.len())
}

/// Largest first frame of an inbound connection, in bytes: the request,
/// read before anything on the connection authenticated.
///
/// A request is a metadata request or a full-state push without records
/// (members and metadata stamps, about 150 bytes per member with long pod
/// names, plus at most 256 KiB of small records inline in their stamps), so
/// 1 MiB holds several thousand members; replies may be up to
/// [`MAX_REPLY_FRAME`].
pub(crate) const MAX_REQUEST_FRAME: usize = 1 << 20;

/// Largest reply, read from a peer we chose to call (a full state with
/// every member's metadata on join): the seal's limit.
pub(crate) const MAX_REPLY_FRAME: usize = MAX_FRAME;

/// The buffer a frame's body starts in; it grows with the bytes that
/// actually arrive, never to the announced length up front.
const FIRST_CHUNK: usize = 16 << 10;

/// Reads one sealed frame of at most `max` bytes. Returns the message, the
/// bytes read and the id of the key that opened it.
///
/// The announced length is checked against `max`, then the clear header
/// against the seal (version, cluster, key id) before the body is read, and
/// the body is buffered as it arrives: a peer that announces 16 MiB and
/// stalls holds a few KiB, not 16 MiB.
pub(crate) async fn read_frame<R: AsyncReadExt + Unpin>(
    r: &mut R,
    sealer: &Sealer,
    max: usize,
    now_ms: impl Fn() -> u64,
) -> Result<(TcpMsg, usize, u32), WireError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max.min(MAX_FRAME) || len < Sealer::overhead() {
        return Err(WireError::Rejected(Reject::Size));
    }
    let header_len = Sealer::clear_header_len();
    let mut buf = vec![0u8; header_len];
    r.read_exact(&mut buf).await?;
    sealer
        .check_clear_header(&buf)
        .map_err(WireError::Rejected)?;
    buf.reserve_exact(len.min(FIRST_CHUNK) - header_len);
    let body = (len - header_len) as u64;
    let got = (&mut *r).take(body).read_to_end(&mut buf).await?;
    if (got as u64) < body {
        return Err(WireError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    let (plain, key_id) = sealer
        .unseal_keyed(Channel::Tcp, &buf, now_ms())
        .map_err(WireError::Rejected)?;
    drop(buf);
    let msg = decode(&plain).map_err(|_| WireError::Rejected(Reject::Decode))?;
    Ok((msg, len + 4, key_id))
}

#[cfg(test)]
mod tests {
    //! The decode half of "nothing from the network can panic us": what
    //! comes out of an authenticated packet is still decoded defensively.
    //! (The unseal half is `tests/mesh_seal_props.rs`.)

    use super::*;
    use crate::mesh::meta::{DigestHandler, MetaDigest, Relay, Wanted};
    use foca::{AccumulatingRuntime, Foca, PostcardCodec};
    use proptest::prelude::*;
    use rand::SeedableRng;

    fn foca() -> Foca<NodeIdentity, PostcardCodec, rand::rngs::StdRng, DigestHandler> {
        let me = NodeIdentity::new("me".into(), "127.0.0.1:7946".parse().unwrap(), 8946, 1);
        let mut config = foca::Config::simple();
        config.max_packet_size = std::num::NonZeroUsize::new(1400).unwrap();
        Foca::with_custom_broadcast(
            me,
            config,
            rand::rngs::StdRng::seed_from_u64(7),
            PostcardCodec,
            DigestHandler::new("me", Wanted::default(), Relay::default()),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 100_000, ..ProptestConfig::default() })]

        #[test]
        fn decoding_arbitrary_payloads_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..1500)) {
            let _ = postcard::from_bytes::<TcpMsg>(&bytes);
            let _ = postcard::from_bytes::<NodeIdentity>(&bytes);
            let _ = postcard::from_bytes::<MetaDigest>(&bytes);
            let mut f = foca();
            let mut rt = AccumulatingRuntime::new();
            let _ = f.handle_data(&bytes, &mut rt);
        }
    }

    #[test]
    fn a_greeting_with_a_digest_still_reads_as_the_bare_identity() {
        // A hello or its answer is `(identity, digest)`; a sidecar from
        // before the digest was added reads the identity alone and must
        // not refuse the rest (a rolling upgrade).
        let id = NodeIdentity::new("a".into(), "127.0.0.1:7946".parse().unwrap(), 8946, 5);
        let digest = MetaDigest {
            node_id: "a".into(),
            epoch: 5,
            version: 2,
            inline: Some(b"{}".to_vec().into()),
        };
        let body = postcard::to_allocvec(&(id.clone(), digest.clone())).unwrap();
        assert_eq!(postcard::from_bytes::<NodeIdentity>(&body).unwrap(), id);
        let (read, rest) = postcard::take_from_bytes::<NodeIdentity>(&body).unwrap();
        assert_eq!(read, id);
        assert_eq!(postcard::from_bytes::<MetaDigest>(rest).unwrap(), digest);
    }

    #[test]
    fn a_view_digest_and_its_buckets_ride_after_the_message_where_older_versions_stop_reading() {
        let id = NodeIdentity::new("a".into(), "127.0.0.1:7946".parse().unwrap(), 8946, 5);
        let state = FullState {
            from: Some(id.clone()),
            members: vec![WireMember {
                id: id.clone(),
                incarnation: 3,
                state: 1,
            }],
            view: Some([9; 16]),
            buckets: Some(Box::new(std::array::from_fn(|i| [i as u8; 8]))),
            ..FullState::default()
        };
        let plain = encode(&TcpMsg::PushPull(state)).unwrap();
        // What a sidecar with view digests and before buckets reads of it.
        let (_, rest) = postcard::take_from_bytes::<TcpMsg>(&plain).unwrap();
        assert_eq!(rest.get(..16), Some(&[9u8; 16][..]));
        // What a sidecar before view digests does with it: reads the
        // message, members and all, and leaves the digest alone.
        let Ok(TcpMsg::PushPull(old)) = postcard::from_bytes::<TcpMsg>(&plain) else {
            panic!("an older version cannot read the exchange");
        };
        assert_eq!((old.from.as_ref(), old.members.len()), (Some(&id), 1));
        assert_eq!(old.view, None);
        let Ok(TcpMsg::PushPull(new)) = decode(&plain) else {
            panic!("the exchange does not read back");
        };
        assert_eq!(new.view, Some([9; 16]));
        assert_eq!(new.buckets.map(|b| b[15]), Some([15; 8]));
        assert_eq!(new.members[0].incarnation, 3);
        // A digest without buckets (that version's) reads as such.
        let mut digest_only =
            postcard::to_allocvec(&TcpMsg::PushPull(FullState::default())).unwrap();
        digest_only.extend_from_slice(&[7; 16]);
        let Ok(TcpMsg::PushPull(read)) = decode(&digest_only) else {
            panic!("a digest without buckets does not read");
        };
        assert_eq!((read.view, read.buckets), (Some([7; 16]), None));
        // And what such a sidecar sends reads as a full state without one.
        let older = postcard::to_allocvec(&TcpMsg::PushPull(FullState::default())).unwrap();
        let Ok(TcpMsg::PushPull(read)) = decode(&older) else {
            panic!("an older version's exchange does not read");
        };
        assert_eq!(read.view, None);
    }

    fn sealer(cluster: &str) -> Sealer {
        Sealer::new(
            cluster,
            crate::keyring::KeyRing::new(vec![[7; 32]]).unwrap(),
        )
    }

    async fn sealed_request(sealer: &Sealer) -> Vec<u8> {
        let mut out = Vec::new();
        let msg = TcpMsg::MetaRequest("node-2".into());
        write_frame(&mut out, sealer, None, &msg, crate::mesh::runtime::now_ms())
            .await
            .unwrap();
        out
    }

    /// The body of a frame is never waited for (nor buffered) when its
    /// clear header already fails: here a 16 MiB frame of another cluster
    /// whose sender then stalls.
    #[tokio::test]
    async fn a_frame_of_another_cluster_is_refused_after_its_header() {
        let foreign = sealed_request(&sealer("other")).await;
        let (mut client, mut server) = tokio::io::duplex(64 << 10);
        client
            .write_all(&(MAX_FRAME as u32).to_be_bytes())
            .await
            .unwrap();
        client
            .write_all(&foreign[4..4 + Sealer::clear_header_len()])
            .await
            .unwrap();
        let ours = sealer("ours");
        let read = read_frame(&mut server, &ours, MAX_FRAME, crate::mesh::runtime::now_ms);
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), read).await;
        assert!(
            matches!(got, Ok(Err(WireError::Rejected(Reject::Cluster)))),
            "refused as another cluster's at once: {got:?}"
        );
        drop(client);
    }

    #[tokio::test]
    async fn a_first_frame_over_the_request_limit_is_refused_before_its_body() {
        let (mut client, mut server) = tokio::io::duplex(1024);
        client
            .write_all(&((MAX_REQUEST_FRAME + 1) as u32).to_be_bytes())
            .await
            .unwrap();
        let s = sealer("ours");
        let read = read_frame(
            &mut server,
            &s,
            MAX_REQUEST_FRAME,
            crate::mesh::runtime::now_ms,
        );
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), read).await;
        assert!(
            matches!(got, Ok(Err(WireError::Rejected(Reject::Size)))),
            "refused by its length: {got:?}"
        );
    }

    #[tokio::test]
    async fn a_frame_arriving_in_pieces_opens() {
        let s = sealer("ours");
        let frame = sealed_request(&s).await;
        let (mut client, mut server) = tokio::io::duplex(64);
        let writer = tokio::spawn(async move {
            for piece in frame.chunks(7) {
                client.write_all(piece).await.unwrap();
                tokio::task::yield_now().await;
            }
            client
        });
        let (msg, n, _) = read_frame(
            &mut server,
            &s,
            MAX_REQUEST_FRAME,
            crate::mesh::runtime::now_ms,
        )
        .await
        .unwrap();
        drop(writer.await.unwrap());
        assert!(
            matches!(msg, TcpMsg::MetaRequest(ref id) if id == "node-2"),
            "{msg:?}"
        );
        assert!(n > Sealer::overhead());
    }

    #[test]
    fn a_large_announced_length_does_not_allocate() {
        // A frame whose postcard vector length claims 2^60 elements.
        let bytes = [0u8, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f];
        assert!(postcard::from_bytes::<TcpMsg>(&bytes).is_err());
    }
}
