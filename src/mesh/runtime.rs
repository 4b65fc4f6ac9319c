//! The async shell around foca: one task owns the state machine and moves
//! bytes (UDP gossip, TCP full-state and metadata exchanges) and time.
//!
//! Flow: socket -> unseal -> envelope -> foca -> notifications -> view and
//! metrics. Outbound: foca -> envelope -> seal -> socket.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use foca::{AccumulatingRuntime, Foca, Member, OwnedNotification, PostcardCodec, Timer};
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::mesh::discovery::SeedSource;
use crate::mesh::member::NodeIdentity;
use crate::mesh::meta::{DigestHandler, MAX_META_BYTES, MetaDigest, MetaRecord, NodeMeta, Wanted};
use crate::mesh::seal::{
    Channel, Isolation, KeyRing, MAX_DATAGRAM, REPLAY_WINDOW_MS, Reject, Sealer, SkewWatch,
    SkewedPeer,
};
use crate::mesh::view::{ClockSkewPeer, ClusterStatus, MemberInfo, MemberState, NodeStatus};
use crate::mesh::wire::{self, FullState, TcpMsg, WireError, WireMember};
use crate::metrics::{Metrics, PeerState, StateLabels, Transport};

/// Largest foca payload inside one datagram (before sealing).
const MAX_FOCA_PACKET: usize = 1400;
/// How long a node without peers waits before it calls itself running.
const ALONE_READY_AFTER: Duration = Duration::from_secs(5);
/// One TCP exchange, connect to last byte.
const TCP_TIMEOUT: Duration = Duration::from_secs(5);

/// SWIM timing. The defaults were chosen from measurements (BENCHMARKS.md):
/// fast failure detection on a LAN without false downs at 10 % loss.
#[derive(Clone, Debug)]
pub struct SwimTuning {
    /// How often a random member is probed.
    pub probe_period: Duration,
    /// How long a direct probe may take before indirect probes are sent.
    pub probe_rtt: Duration,
    /// How many members are asked to probe indirectly.
    pub indirect_probes: usize,
    /// How long a suspect has to refute before it is declared down.
    pub suspect_to_down_after: Duration,
    /// Gossip period while updates are pending.
    pub gossip_interval: Duration,
    /// Members gossiped to per period.
    pub gossip_fanout: usize,
    /// How often down members are re-contacted (partition healing).
    pub announce_down_interval: Duration,
    /// Full-state TCP exchange with one random member, at cluster size
    /// <= 32; scaled up logarithmically beyond.
    pub push_pull_interval: Duration,
    /// How long down members stay listed.
    pub remove_down_after: Duration,
}

impl Default for SwimTuning {
    fn default() -> Self {
        Self {
            probe_period: Duration::from_millis(1000),
            probe_rtt: Duration::from_millis(400),
            indirect_probes: 5,
            suspect_to_down_after: Duration::from_millis(3000),
            gossip_interval: Duration::from_millis(200),
            gossip_fanout: 3,
            announce_down_interval: Duration::from_secs(10),
            push_pull_interval: Duration::from_secs(30),
            remove_down_after: Duration::from_secs(3600),
        }
    }
}

impl SwimTuning {
    fn foca_config(&self, cluster_size: usize) -> foca::Config {
        let n = cluster_size.max(1) as f64;
        // memberlist's rule: retransmit 4 * log10(n + 1) times.
        let max_tx = (4.0 * (n + 1.0).log10()).ceil().clamp(3.0, 30.0) as u8;
        let nz =
            |v: usize| std::num::NonZeroUsize::new(v.max(1)).unwrap_or(std::num::NonZeroUsize::MIN);
        foca::Config {
            probe_period: self.probe_period,
            probe_rtt: self.probe_rtt,
            num_indirect_probes: nz(self.indirect_probes),
            max_transmissions: std::num::NonZeroU8::new(max_tx).unwrap_or(std::num::NonZeroU8::MIN),
            suspect_to_down_after: self.suspect_to_down_after,
            remove_down_after: Some(self.remove_down_after),
            max_packet_size: nz(MAX_FOCA_PACKET),
            notify_down_members: true,
            periodic_announce: Some(foca::PeriodicParams {
                frequency: Duration::from_secs(30),
                num_members: nz(1),
            }),
            periodic_announce_to_down_members: Some(foca::PeriodicParams {
                frequency: self.announce_down_interval,
                num_members: nz(2),
            }),
            periodic_gossip: Some(foca::PeriodicParams {
                frequency: self.gossip_interval,
                num_members: nz(self.gossip_fanout),
            }),
        }
    }

    fn push_pull_every(&self, cluster_size: usize) -> Duration {
        // Like memberlist: beyond 32 members, back off by log2(n / 32) + 1.
        let scale = if cluster_size <= 32 {
            1.0
        } else {
            (cluster_size as f64 / 32.0).log2().ceil() + 1.0
        };
        self.push_pull_interval.mul_f64(scale)
    }
}

/// What a mesh node needs to start.
#[derive(Clone, Debug)]
pub struct MeshConfig {
    /// This member's name.
    pub node_id: String,
    /// Packets from another cluster id are dropped.
    pub cluster_id: String,
    /// IP both sockets bind.
    pub bind: IpAddr,
    /// UDP port.
    pub gossip_port: u16,
    /// TCP port.
    pub transport_port: u16,
    /// Address peers reach us at; `None` picks the bind IP, or the IP the
    /// kernel would use towards the first seed.
    pub advertise: Option<SocketAddr>,
    /// Seed names and the headless Service.
    pub seeds: SeedSource,
    /// Key ring, primary first.
    pub keys: Vec<[u8; 32]>,
    /// Re-read when it changes: one key per line, primary first.
    pub key_file: Option<PathBuf>,
    /// SWIM timing.
    pub tuning: SwimTuning,
}

/// Errors starting the mesh.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// A socket could not be bound.
    #[error("cannot bind {what} socket on {addr}: {source}")]
    Bind {
        /// `gossip (UDP)` or `transport (TCP)`.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The key ring is unusable.
    #[error("cluster key: {0}")]
    Key(String),
    /// The node id is unusable.
    #[error("node id {0:?}: {1}")]
    NodeId(String, &'static str),
}

enum Command {
    Status(oneshot::Sender<ClusterStatus>),
    Members(oneshot::Sender<Vec<MemberInfo>>),
    Seeds(Vec<SocketAddr>),
    PushPullIn(FullState, oneshot::Sender<FullState>),
    PushPullDone(FullState),
    MetaIn(String, oneshot::Sender<Option<MetaRecord>>),
    MetaFetched(Option<MetaRecord>, String),
    SetMeta(NodeMeta),
    Leave(oneshot::Sender<()>),
}

/// Flags the driver publishes for cheap reads from other tasks.
#[derive(Default)]
struct Shared {
    running: AtomicBool,
    has_peers: AtomicBool,
    /// The last hello round greeted seeds that are not members (yet).
    seeds_unknown: AtomicBool,
    /// Written by the driver for every authenticated datagram; read by
    /// `/readyz` without a round trip to the driver.
    skew: Mutex<SkewWatch>,
}

impl Shared {
    fn skew(&self) -> MutexGuard<'_, SkewWatch> {
        // A poisoned watch is still a consistent set of entries.
        self.skew.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A running mesh node. Cheap to clone; the node stops when [`Mesh::leave`]
/// is called or every handle is dropped.
#[derive(Clone)]
pub struct Mesh {
    cmd: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    local: Arc<NodeIdentity>,
    sealer: Arc<Sealer>,
    /// The sealer's ring as it changes, for the store's at-rest ring.
    rings: Arc<tokio::sync::watch::Sender<Arc<KeyRing>>>,
}

impl Mesh {
    /// Binds the sockets and starts the node: it contacts its seeds and
    /// greets again those that are not members yet, and re-resolves them every 10 s.
    pub async fn start(
        cfg: MeshConfig,
        metrics: Arc<Metrics>,
        meta: NodeMeta,
    ) -> Result<Mesh, MeshError> {
        if cfg.node_id.is_empty() || cfg.node_id.len() > 253 {
            return Err(MeshError::NodeId(
                cfg.node_id,
                "must be 1 to 253 characters",
            ));
        }
        let ring = KeyRing::new(cfg.keys.clone()).map_err(|e| MeshError::Key(e.to_string()))?;
        let rings = Arc::new(tokio::sync::watch::Sender::new(Arc::new(ring.clone())));
        let sealer = Arc::new(Sealer::new(&cfg.cluster_id, ring));

        let udp_addr = SocketAddr::new(cfg.bind, cfg.gossip_port);
        let udp = UdpSocket::bind(udp_addr)
            .await
            .map_err(|source| MeshError::Bind {
                what: "gossip (UDP)",
                addr: udp_addr,
                source,
            })?;
        // The driver sends with try_send_to, which fails with WouldBlock
        // until tokio's reactor has seen the new socket writable: without
        // this wait the first hello round, sent right away, is lost whole.
        let _ = udp.writable().await;
        let tcp_addr = SocketAddr::new(cfg.bind, cfg.transport_port);
        let tcp = TcpListener::bind(tcp_addr)
            .await
            .map_err(|source| MeshError::Bind {
                what: "transport (TCP)",
                addr: tcp_addr,
                source,
            })?;
        let gossip_port = udp
            .local_addr()
            .map(|a| a.port())
            .unwrap_or(cfg.gossip_port);
        let transport_port = tcp
            .local_addr()
            .map(|a| a.port())
            .unwrap_or(cfg.transport_port);

        let advertise = match cfg.advertise {
            Some(a) => a,
            None => SocketAddr::new(pick_advertise_ip(cfg.bind, &cfg.seeds).await, gossip_port),
        };
        let local = NodeIdentity {
            node_id: cfg.node_id.clone(),
            gossip: advertise,
            transport_port,
            generation: now_ms(),
        };
        info!(node_id = %local.node_id, gossip = %advertise, transport_port, cluster_id = %cfg.cluster_id, "mesh starting");

        let (cmd_tx, cmd_rx) = mpsc::channel(1024);
        let shared = Arc::new(Shared::default());
        let wanted = Wanted::default();
        let foca = Foca::with_custom_broadcast(
            local.clone(),
            cfg.tuning.foca_config(1),
            StdRng::from_rng(&mut rand::rng()),
            PostcardCodec,
            DigestHandler::new(&local.node_id, wanted.clone()),
        );
        let udp = Arc::new(udp);

        tokio::spawn(accept_loop(
            tcp,
            sealer.clone(),
            metrics.clone(),
            cmd_tx.clone(),
        ));
        tokio::spawn(seed_loop(cfg.seeds.clone(), cmd_tx.clone(), shared.clone()));
        if let Some(path) = cfg.key_file.clone() {
            tokio::spawn(key_file_loop(
                path,
                sealer.clone(),
                rings.clone(),
                cmd_tx.downgrade(),
            ));
        }

        let local_record = MetaRecord {
            node_id: local.node_id.clone(),
            epoch: local.generation,
            version: 1,
            json: encode_meta(&meta),
        };
        let first_push_pull = cfg.tuning.push_pull_interval;
        let driver = Driver {
            foca,
            rt: AccumulatingRuntime::new(),
            udp,
            sealer: sealer.clone(),
            metrics,
            tuning: cfg.tuning,
            started: Instant::now(),
            timers: BinaryHeap::new(),
            timer_slots: HashMap::new(),
            timer_seq: 0,
            last_seen: HashMap::new(),
            metas: HashMap::new(),
            local_meta: local_record,
            wanted,
            fetching: HashSet::new(),
            seeds: Vec::new(),
            advertise,
            cluster_id: cfg.cluster_id,
            pushed_on_join: false,
            next_push_pull: Instant::now() + first_push_pull,
            sized_for: 1,
            leaving: false,
            last_digest: Instant::now(),
            peer_keys: HashMap::new(),
            cmd_tx: cmd_tx.downgrade(),
            shared: shared.clone(),
        };
        tokio::spawn(driver.run(cmd_rx));
        Ok(Mesh {
            cmd: cmd_tx,
            shared,
            local: Arc::new(local),
            sealer,
            rings,
        })
    }

    /// This node's identity as first announced.
    pub fn local(&self) -> &NodeIdentity {
        &self.local
    }

    /// Joined a cluster, or alone for 5 s with no peer answering (a node
    /// that hears only packets rejected for clock skew is not alone: see
    /// [`Mesh::clock_skew_isolation`]).
    pub fn is_running(&self) -> bool {
        self.shared.running.load(Ordering::Relaxed)
    }

    /// `Some` while every authenticated packet of the last 30 s was
    /// rejected for clock skew: this node, or every peer it hears, has a
    /// clock more than 30 s off, and it is cut off from the mesh.
    pub fn clock_skew_isolation(&self) -> Option<Isolation> {
        self.shared.skew().isolation(Instant::now())
    }

    /// The peers whose packets were rejected for clock skew in the last
    /// minute.
    pub fn clock_skewed_peers(&self) -> Vec<SkewedPeer> {
        self.shared.skew().peers(Instant::now())
    }

    /// Whether any peer is alive or suspect.
    pub fn has_peers(&self) -> bool {
        self.shared.has_peers.load(Ordering::Relaxed)
    }

    /// Replaces the key ring (the key file does this by itself).
    pub fn set_keys(&self, keys: Vec<[u8; 32]>) -> Result<(), MeshError> {
        let ring = KeyRing::new(keys).map_err(|e| MeshError::Key(e.to_string()))?;
        self.sealer.set_ring(ring.clone());
        self.rings.send_replace(Arc::new(ring));
        Ok(())
    }

    /// The key ring, now and at every change ([`Mesh::set_keys`], the key
    /// file): what the store's at-rest ring follows
    /// ([`crate::store::sealed::AtRestRing::following`]).
    pub fn key_rings(&self) -> tokio::sync::watch::Receiver<Arc<KeyRing>> {
        self.rings.subscribe()
    }

    /// Publishes new metadata for this node (at most 64 KiB as JSON).
    pub async fn set_meta(&self, meta: NodeMeta) {
        let _ = self.cmd.send(Command::SetMeta(meta)).await;
    }

    /// The cluster as this node sees it.
    pub async fn status(&self) -> Option<ClusterStatus> {
        let (tx, rx) = oneshot::channel();
        self.cmd.send(Command::Status(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Every known member, this node included.
    pub async fn members(&self) -> Vec<MemberInfo> {
        let (tx, rx) = oneshot::channel();
        if self.cmd.send(Command::Members(tx)).await.is_err() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// Leaves the cluster: peers are told directly and see this node `down`
    /// at once. The node stops answering afterwards.
    pub async fn leave(&self) {
        let (tx, rx) = oneshot::channel();
        if self.cmd.send(Command::Leave(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

struct Driver {
    foca: Foca<NodeIdentity, PostcardCodec, StdRng, DigestHandler>,
    rt: AccumulatingRuntime<NodeIdentity>,
    udp: Arc<UdpSocket>,
    sealer: Arc<Sealer>,
    metrics: Arc<Metrics>,
    tuning: SwimTuning,
    started: Instant,
    timers: BinaryHeap<Reverse<(Instant, u64)>>,
    timer_slots: HashMap<u64, Timer<NodeIdentity>>,
    timer_seq: u64,
    last_seen: HashMap<String, Instant>,
    metas: HashMap<String, MetaRecord>,
    local_meta: MetaRecord,
    wanted: Wanted,
    fetching: HashSet<String>,
    seeds: Vec<SocketAddr>,
    advertise: SocketAddr,
    cluster_id: String,
    pushed_on_join: bool,
    next_push_pull: Instant,
    sized_for: usize,
    leaving: bool,
    last_digest: Instant,
    /// The ring key each peer last used: answering in kind keeps peers on
    /// different rings of a rolling rotation talking.
    peer_keys: HashMap<SocketAddr, u32>,
    cmd_tx: mpsc::WeakSender<Command>,
    shared: Arc<Shared>,
}

impl Driver {
    async fn run(mut self, mut cmd_rx: mpsc::Receiver<Command>) {
        let mut buf = vec![0u8; MAX_DATAGRAM + 1];
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let udp = self.udp.clone();
        loop {
            let next_timer = self
                .timers
                .peek()
                .map(|Reverse((at, _))| *at)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                r = udp.recv_from(&mut buf) => match r {
                    Ok((n, from)) => self.on_datagram(&buf[..n], n > MAX_DATAGRAM, from),
                    Err(e) => debug!(error = %e, "gossip recv failed"),
                },
                _ = tokio::time::sleep_until(next_timer.into()) => self.fire_timers(),
                cmd = cmd_rx.recv() => match cmd {
                    Some(Command::Leave(done)) => {
                        self.leave().await;
                        let _ = done.send(());
                        return;
                    }
                    Some(cmd) => self.on_command(cmd),
                    None => return,
                },
                _ = tick.tick() => self.on_tick(),
            }
            self.flush().await;
        }
    }

    fn on_datagram(&mut self, packet: &[u8], truncated: bool, from: SocketAddr) {
        self.metrics.mesh.received(Transport::udp, packet.len());
        if truncated {
            self.metrics.mesh.rejected(Reject::Size.label());
            return;
        }
        let plain = match self.sealer.unseal_keyed(Channel::Udp, packet, now_ms()) {
            Ok((p, key_id)) => {
                self.shared.skew().accepted(Instant::now());
                if self.peer_keys.len() > 4096 {
                    self.peer_keys.clear();
                }
                self.peer_keys.insert(from, key_id);
                p
            }
            Err(r @ Reject::ClockSkew { offset_ms }) => {
                self.metrics.mesh.rejected(r.label());
                self.clock_skewed(from, offset_ms);
                return;
            }
            Err(r) => {
                self.metrics.mesh.rejected(r.label());
                debug!(%from, reason = r.label(), "datagram rejected");
                return;
            }
        };
        let Some((&kind, body)) = plain.split_first() else {
            self.metrics.mesh.rejected(Reject::Decode.label());
            return;
        };
        match kind {
            wire::KIND_FOCA => {
                if let Err(e) = self.foca.handle_data(body, &mut self.rt) {
                    self.count_foca_error(&e);
                }
                // A digest just arrived: fetch its record now, not at the tick.
                if self.wanted.lock().is_ok_and(|w| !w.is_empty()) {
                    self.fetch_wanted();
                }
            }
            wire::KIND_HELLO | wire::KIND_HELLO_ACK | wire::KIND_LEAVE => {
                let Ok(id) = postcard::from_bytes::<NodeIdentity>(body) else {
                    self.metrics.mesh.rejected(Reject::Decode.label());
                    return;
                };
                if id.node_id == self.foca.identity().node_id {
                    return;
                }
                match kind {
                    wire::KIND_HELLO => {
                        let me = self.foca.identity().clone();
                        self.send_envelope(from, wire::KIND_HELLO_ACK, &me);
                        // Both sides learn each other from the hello itself:
                        // no feed bursts when a node greets 100+ seeds.
                        self.learn(id);
                    }
                    wire::KIND_HELLO_ACK => {
                        let transport = (id.transport(), self.peer_keys.get(&id.gossip).copied());
                        self.learn(id);
                        if !self.pushed_on_join {
                            self.pushed_on_join = true;
                            self.push_pull(transport, true);
                        }
                    }
                    _ => {
                        let members = std::iter::once(Member::down(id));
                        if let Err(e) = self.foca.apply_many(members, true, &mut self.rt) {
                            debug!(error = %e, "applying a leave failed");
                        }
                    }
                }
            }
            _ => self.metrics.mesh.rejected(Reject::Decode.label()),
        }
    }

    /// A datagram from `from` authenticated but was stamped `offset_ms`
    /// away from our clock, beyond the window: warn, at most once a minute
    /// per peer, since every packet of a skewed peer fails alike.
    fn clock_skewed(&self, from: SocketAddr, offset_ms: i64) {
        let warning = self.shared.skew().rejected(from, offset_ms, Instant::now());
        match warning {
            Some(w) => warn!(
                peer = %w.peer,
                offset_ms = w.offset_ms,
                suppressed = w.suppressed,
                "mesh packet rejected for clock skew: it authenticated, but the peer's clock is \
                 {:+.1} s from ours, beyond the {} s window; this node's clock or the peer's is \
                 wrong (check NTP); logged once a minute per peer",
                w.offset_ms as f64 / 1000.0,
                REPLAY_WINDOW_MS / 1000,
            ),
            None => debug!(%from, offset_ms, "datagram rejected for clock skew"),
        }
    }

    /// Tells foca a member is alive because it just authenticated to us.
    /// Not gossiped: every member greets its seeds itself, and a node
    /// greeting 100+ seeds would otherwise flood the gossip backlog.
    fn learn(&mut self, id: NodeIdentity) {
        let update = std::iter::once(Member::alive(id));
        if let Err(e) = self.foca.apply_many(update, false, &mut self.rt) {
            debug!(error = %e, "member not applied");
        }
    }

    /// Every member foca knows but ourselves: after a restart foca may hold
    /// our previous identity (declared down); that is us, not a peer.
    fn peers(&self) -> impl Iterator<Item = &Member<NodeIdentity>> {
        let me = &self.foca.identity().node_id;
        self.foca
            .iter_membership_state()
            .filter(move |m| &m.id().node_id != me)
    }

    fn count_foca_error(&self, e: &foca::Error) {
        match e {
            foca::Error::Decode(_)
            | foca::Error::MalformedPacket
            | foca::Error::CustomBroadcast(_) => {
                self.metrics.mesh.rejected(Reject::Decode.label());
            }
            foca::Error::DataTooBig => self.metrics.mesh.rejected(Reject::Size.label()),
            other => debug!(error = %other, "foca refused a packet"),
        }
    }

    fn send_envelope(&mut self, to: SocketAddr, kind: u8, id: &NodeIdentity) {
        let mut plain = vec![kind];
        if let Ok(body) = postcard::to_allocvec(id) {
            plain.extend_from_slice(&body);
        }
        self.send_plain(to, &plain);
    }

    fn send_plain(&mut self, to: SocketAddr, plain: &[u8]) {
        let Some(sealed) = self.seal_for(to, plain) else {
            return;
        };
        match self.udp.try_send_to(&sealed, to) {
            Ok(n) => self.metrics.mesh.sent(Transport::udp, n),
            Err(e) => debug!(%to, error = %e, "gossip send failed"),
        }
    }

    /// Seals a datagram for `to`, in the ring key that peer last used.
    fn seal_for(&self, to: SocketAddr, plain: &[u8]) -> Option<Vec<u8>> {
        let mut sealed = Vec::with_capacity(plain.len() + Sealer::overhead());
        let key = self.peer_keys.get(&to).copied();
        self.sealer
            .seal_with(Channel::Udp, key, plain, now_ms(), &mut sealed)
            .ok()?;
        Some(sealed)
    }

    fn fire_timers(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, seq))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            if let Some(timer) = self.timer_slots.remove(&seq)
                && let Err(e) = self.foca.handle_timer(timer, &mut self.rt)
            {
                debug!(error = %e, "timer failed");
            }
        }
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Status(reply) => {
                let _ = reply.send(self.status());
            }
            Command::Members(reply) => {
                let mut out: Vec<MemberInfo> = self
                    .peers()
                    .map(|m| MemberInfo {
                        node_id: m.id().node_id.clone(),
                        state: m.state().into(),
                        local: false,
                    })
                    .collect();
                out.push(MemberInfo {
                    node_id: self.foca.identity().node_id.clone(),
                    state: MemberState::Alive,
                    local: true,
                });
                let _ = reply.send(out);
            }
            Command::Seeds(seeds) => {
                self.seeds = seeds.into_iter().filter(|s| *s != self.advertise).collect();
                self.hello_seeds();
            }
            Command::PushPullIn(remote, reply) => {
                let records = remote.want_records;
                self.merge(remote);
                let _ = reply.send(self.full_state(records));
            }
            Command::PushPullDone(remote) => self.merge(remote),
            Command::MetaIn(node_id, reply) => {
                let rec = if node_id == self.local_meta.node_id {
                    Some(self.local_meta.clone())
                } else {
                    self.metas.get(&node_id).cloned()
                };
                let _ = reply.send(rec);
            }
            Command::MetaFetched(rec, node_id) => {
                self.fetching.remove(&node_id);
                if let Some(rec) = rec {
                    self.store_meta(rec);
                }
            }
            Command::SetMeta(meta) => self.set_local_meta(&meta),
            Command::Leave(_) => {}
        }
    }

    /// Seeds that are not alive members get a hello; the reply names them
    /// so foca can announce to them.
    fn hello_seeds(&mut self) {
        let known: HashSet<SocketAddr> = self.foca.iter_members().map(|m| m.id().gossip).collect();
        let me = self.foca.identity().clone();
        let targets: Vec<SocketAddr> = self
            .seeds
            .iter()
            .filter(|s| !known.contains(s))
            .copied()
            .collect();
        self.shared
            .seeds_unknown
            .store(!targets.is_empty(), Ordering::Relaxed);
        for seed in targets {
            self.send_envelope(seed, wire::KIND_HELLO, &me);
        }
    }

    fn on_tick(&mut self) {
        let active = self.foca.num_members();
        self.shared.has_peers.store(active > 0, Ordering::Relaxed);
        // Hearing only packets rejected for clock skew is not being alone.
        let alone = self.started.elapsed() >= ALONE_READY_AFTER
            && self.shared.skew().isolation(Instant::now()).is_none();
        if !self.shared.running.load(Ordering::Relaxed) && (active > 0 || alone) {
            self.shared.running.store(true, Ordering::Relaxed);
        }
        // Re-size foca's retransmissions as the cluster grows or shrinks.
        let size = active + 1;
        if size.next_power_of_two() != self.sized_for.next_power_of_two() {
            self.sized_for = size;
            if let Err(e) = self.foca.set_config(self.tuning.foca_config(size)) {
                debug!(error = %e, "foca config not changed");
            }
        }
        self.update_gauges();
        self.fetch_wanted();
        if Instant::now() >= self.next_push_pull {
            self.next_push_pull = Instant::now() + self.tuning.push_pull_every(size);
            if let Some(peer) = self.random_alive() {
                let key = self.peer_keys.get(&peer.gossip).copied();
                self.push_pull((peer.transport(), key), false);
            }
        }
        // Forget metadata of members foca forgot.
        let present: HashSet<String> = self.peers().map(|m| m.id().node_id.clone()).collect();
        self.metas.retain(|k, _| present.contains(k));
        self.last_seen.retain(|k, _| present.contains(k));
    }

    fn update_gauges(&self) {
        let mut counts = [0i64; 3];
        for m in self.peers() {
            counts[match m.state() {
                foca::State::Alive => 0,
                foca::State::Suspect => 1,
                foca::State::Down => 2,
            }] += 1;
        }
        for (i, state) in [PeerState::alive, PeerState::suspect, PeerState::down]
            .into_iter()
            .enumerate()
        {
            self.metrics
                .mesh
                .peer_count
                .get_or_create(&StateLabels { state })
                .set(counts[i]);
        }
    }

    fn random_alive(&self) -> Option<NodeIdentity> {
        let alive: Vec<&Member<NodeIdentity>> = self.foca.iter_members().collect();
        if alive.is_empty() {
            return None;
        }
        let i = (rand::random::<u64>() % alive.len() as u64) as usize;
        Some(alive[i].id().clone())
    }

    fn fetch_wanted(&mut self) {
        let wanted: Vec<MetaDigest> = match self.wanted.lock() {
            Ok(mut w) => std::mem::take(&mut *w),
            Err(_) => return,
        };
        let mut still = Vec::new();
        for d in wanted {
            let have = self.metas.get(&d.node_id).map(|r| r.stamp());
            if have.is_some_and(|h| h >= (d.epoch, d.version)) {
                continue;
            }
            if let Some(rec) = d.record() {
                self.store_meta(rec);
                continue;
            }
            let owner = self
                .foca
                .iter_members()
                .find(|m| m.id().node_id == d.node_id)
                .map(|m| {
                    (
                        m.id().transport(),
                        self.peer_keys.get(&m.id().gossip).copied(),
                    )
                });
            let Some(addr) = owner else {
                still.push(d);
                continue;
            };
            if self.fetching.insert(d.node_id.clone()) {
                tokio::spawn(fetch_meta(
                    addr,
                    d.node_id.clone(),
                    self.sealer.clone(),
                    self.metrics.clone(),
                    self.cmd_tx.clone(),
                ));
            }
            still.push(d);
        }
        // Keep digests until their record arrived (a fetch can fail).
        if let Ok(mut w) = self.wanted.lock() {
            w.extend(still);
        }
    }

    fn push_pull(&self, (addr, key): (SocketAddr, Option<u32>), want_records: bool) {
        let mut state = self.full_state(false);
        state.want_records = want_records;
        tokio::spawn(push_pull(
            addr,
            key,
            state,
            self.sealer.clone(),
            self.metrics.clone(),
            self.cmd_tx.clone(),
        ));
    }

    fn full_state(&self, with_records: bool) -> FullState {
        let mut members: Vec<WireMember> = self
            .peers()
            .map(|m| WireMember {
                id: m.id().clone(),
                incarnation: m.incarnation(),
                state: match m.state() {
                    foca::State::Alive => 0,
                    foca::State::Suspect => 1,
                    foca::State::Down => 2,
                },
            })
            .collect();
        members.push(WireMember {
            id: self.foca.identity().clone(),
            incarnation: 0,
            state: 0,
        });
        let records: Vec<MetaRecord> = if with_records {
            self.metas
                .values()
                .chain(std::iter::once(&self.local_meta))
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        let stamps = self
            .metas
            .values()
            .chain(std::iter::once(&self.local_meta))
            .map(|r| MetaDigest::of(r, false))
            .collect();
        FullState {
            from: Some(self.foca.identity().clone()),
            members,
            stamps,
            records,
            want_records: false,
        }
    }

    fn merge(&mut self, remote: FullState) {
        let me = self.foca.identity().node_id.clone();
        let updates: Vec<Member<NodeIdentity>> = remote
            .members
            .into_iter()
            .filter(|m| m.id.node_id != me)
            .map(|m| {
                let state = match m.state {
                    0 => foca::State::Alive,
                    1 => foca::State::Suspect,
                    _ => foca::State::Down,
                };
                Member::new(m.id, m.incarnation, state)
            })
            .collect();
        if let Err(e) = self
            .foca
            .apply_many(updates.into_iter(), false, &mut self.rt)
        {
            debug!(error = %e, "full state not applied");
        }
        for rec in remote.records {
            if rec.node_id != me {
                self.store_meta(rec);
            }
        }
        // Newer metadata than ours: fetch it from its owner.
        let stale: Vec<MetaDigest> = remote
            .stamps
            .into_iter()
            .filter(|d| {
                d.node_id != me
                    && self
                        .metas
                        .get(&d.node_id)
                        .is_none_or(|r| r.stamp() < (d.epoch, d.version))
            })
            .collect();
        if !stale.is_empty()
            && let Ok(mut w) = self.wanted.lock()
        {
            w.extend(stale);
        }
    }

    fn store_meta(&mut self, rec: MetaRecord) {
        if rec.json.len() > MAX_META_BYTES {
            self.metrics.mesh.rejected(Reject::Size.label());
            return;
        }
        let newer = self
            .metas
            .get(&rec.node_id)
            .is_none_or(|have| rec.stamp() > have.stamp());
        if newer {
            self.metas.insert(rec.node_id.clone(), rec);
        }
    }

    fn set_local_meta(&mut self, meta: &NodeMeta) {
        let json = encode_meta(meta);
        if json.len() > MAX_META_BYTES {
            warn!(
                bytes = json.len(),
                "node metadata over 64 KiB not published"
            );
            return;
        }
        if json == self.local_meta.json {
            return;
        }
        self.local_meta.json = json;
        self.local_meta.version += 1;
        self.broadcast_local_meta();
    }

    fn broadcast_local_meta(&mut self) {
        self.last_digest = Instant::now();
        let digest = MetaDigest::of(&self.local_meta, true);
        if let Ok(bytes) = postcard::to_allocvec(&digest)
            && let Err(e) = self.foca.add_broadcast(&bytes)
        {
            debug!(error = %e, "metadata digest not queued");
        }
    }

    fn status(&self) -> ClusterStatus {
        let now = Instant::now();
        let local_meta = self.local_meta.meta();
        let me = self.foca.identity();
        let mut nodes = vec![NodeStatus {
            node_id: me.node_id.clone(),
            local: true,
            address: me.gossip.to_string(),
            membership_state: MemberState::Alive,
            incarnation: me.generation,
            last_seen_ms_ago: 0,
            health: if local_meta.ready {
                "healthy"
            } else {
                "unhealthy"
            }
            .into(),
            clock_skew: self
                .shared
                .skew()
                .peers(now)
                .iter()
                .map(ClockSkewPeer::from)
                .collect(),
            version: Some(local_meta.version),
            config_hash: local_meta.config_hash,
            last_reload: local_meta.last_reload,
            certificates: local_meta.certificates,
            acme: local_meta.acme,
            proxy: local_meta.proxy,
        }];
        let mut others: Vec<NodeStatus> = self
            .peers()
            .map(|m| {
                let id = m.id();
                let meta = self.metas.get(&id.node_id).map(|r| r.meta());
                let state: MemberState = m.state().into();
                let ready = meta.as_ref().is_some_and(|m| m.ready);
                let meta = meta.unwrap_or_default();
                NodeStatus {
                    node_id: id.node_id.clone(),
                    local: false,
                    address: id.gossip.to_string(),
                    membership_state: state,
                    incarnation: id.generation,
                    last_seen_ms_ago: self
                        .last_seen
                        .get(&id.node_id)
                        .map(|t| now.duration_since(*t).as_millis() as u64)
                        .unwrap_or(u64::MAX / 2),
                    health: if state == MemberState::Alive && ready {
                        "healthy"
                    } else {
                        "unhealthy"
                    }
                    .into(),
                    clock_skew: Vec::new(),
                    version: (!meta.version.is_empty()).then_some(meta.version),
                    config_hash: meta.config_hash,
                    last_reload: meta.last_reload,
                    certificates: meta.certificates,
                    acme: meta.acme,
                    proxy: meta.proxy,
                }
            })
            .collect();
        others.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        nodes.extend(others);
        ClusterStatus {
            schema_version: 1,
            cluster_id: self.cluster_id.clone(),
            local_node_id: me.node_id.clone(),
            generated_at_unix_ms: now_ms(),
            summary: ClusterStatus::summarize(&nodes),
            nodes,
        }
    }

    async fn leave(&mut self) {
        self.leaving = true;
        let me = self.foca.identity().clone();
        let peers: Vec<SocketAddr> = self.foca.iter_members().map(|m| m.id().gossip).collect();
        // Tell every active peer directly (twice: datagrams get lost), so
        // the whole cluster sees us down at once instead of after gossip.
        for _ in 0..2 {
            for p in &peers {
                self.send_envelope(*p, wire::KIND_LEAVE, &me);
            }
        }
        if let Err(e) = self.foca.leave_cluster(&mut self.rt) {
            debug!(error = %e, "leave failed");
        }
        self.flush().await;
        info!(peers = peers.len(), "left the mesh");
    }

    /// Sends what foca queued, schedules its timers, applies notifications.
    async fn flush(&mut self) {
        while let Some(n) = self.rt.to_notify() {
            self.on_notification(n);
        }
        while let Some((after, timer)) = self.rt.to_schedule() {
            self.timer_seq += 1;
            self.timers
                .push(Reverse((Instant::now() + after, self.timer_seq)));
            self.timer_slots.insert(self.timer_seq, timer);
        }
        while let Some((to, data)) = self.rt.to_send() {
            let mut plain = Vec::with_capacity(data.len() + 1);
            plain.push(wire::KIND_FOCA);
            plain.extend_from_slice(&data);
            let Some(sealed) = self.seal_for(to.gossip, &plain) else {
                continue;
            };
            match self.udp.send_to(&sealed, to.gossip).await {
                Ok(n) => self.metrics.mesh.sent(Transport::udp, n),
                Err(e) => debug!(to = %to.gossip, error = %e, "gossip send failed"),
            }
        }
    }

    fn on_notification(&mut self, n: OwnedNotification<NodeIdentity>) {
        let change = |state| {
            self.metrics
                .mesh
                .state_changes
                .get_or_create(&StateLabels { state })
                .inc();
        };
        match n {
            OwnedNotification::DataReceived(h) => {
                self.last_seen.insert(h.src.node_id.clone(), Instant::now());
            }
            OwnedNotification::MemberUp(id) => {
                change(PeerState::alive);
                info!(node_id = %id.node_id, address = %id.gossip, "member up");
                self.last_seen.insert(id.node_id.clone(), Instant::now());
                // A newcomer learns our metadata from our digest.
                self.republish_digest(false);
                self.update_gauges();
            }
            OwnedNotification::MemberDown(id) => {
                change(PeerState::down);
                info!(node_id = %id.node_id, "member down");
                self.update_gauges();
            }
            OwnedNotification::Rename(old, new) => {
                debug!(node_id = %new.node_id, old = old.generation, new = new.generation, "member identity renewed");
            }
            OwnedNotification::Active => {
                info!("joined the mesh");
                self.shared.running.store(true, Ordering::Relaxed);
            }
            OwnedNotification::Idle => info!("no active peers"),
            OwnedNotification::Rejoin(id) => {
                info!(
                    generation = id.generation,
                    "rejoined the mesh under a renewed identity"
                );
                self.republish_digest(true);
            }
            OwnedNotification::Defunct if !self.leaving => warn!("declared down by the cluster"),
            _ => {}
        }
    }

    /// Sends our digest around again (newcomers, rejoins). Re-adding the
    /// same digest is a no-op for foca, so the version moves; at most every
    /// 2 s, so a burst of joins costs one broadcast, not one per member.
    fn republish_digest(&mut self, force: bool) {
        if !force && self.last_digest.elapsed() < Duration::from_secs(2) {
            return;
        }
        self.local_meta.version += 1;
        self.broadcast_local_meta();
    }
}

fn encode_meta(meta: &NodeMeta) -> Vec<u8> {
    serde_json::to_vec(meta).unwrap_or_default()
}

/// Unix time in milliseconds.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

async fn pick_advertise_ip(bind: IpAddr, seeds: &SeedSource) -> IpAddr {
    if !bind.is_unspecified() {
        return bind;
    }
    // The IP the kernel would route to the first seed from.
    if let Some(seed) = seeds.resolve().await.into_iter().next() {
        let any: SocketAddr = if seed.is_ipv4() {
            "0.0.0.0:0".parse().unwrap_or(seed)
        } else {
            "[::]:0".parse().unwrap_or(seed)
        };
        if let Ok(s) = std::net::UdpSocket::bind(any)
            && s.connect(seed).is_ok()
            && let Ok(local) = s.local_addr()
        {
            return local.ip();
        }
    }
    if bind.is_ipv4() {
        IpAddr::from([127, 0, 0, 1])
    } else {
        IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
    }
}

/// Seeds are re-resolved (and the unknown ones greeted) this often once
/// every seed is a member.
const SEED_REFRESH: Duration = Duration::from_secs(10);
/// ... this often while the node is alone: pods of a StatefulSet come up
/// one by one.
const SEED_RETRY_ALONE: Duration = Duration::from_secs(1);
/// With peers but seeds still unknown, the first retry comes this soon and
/// the next ones twice as late each, up to [`SEED_REFRESH`].
const SEED_RETRY_FIRST: Duration = Duration::from_millis(500);

async fn seed_loop(src: SeedSource, cmd: mpsc::Sender<Command>, shared: Arc<Shared>) {
    let mut retry = SEED_RETRY_FIRST;
    loop {
        let seeds = src.resolve().await;
        if cmd.send(Command::Seeds(seeds)).await.is_err() {
            return;
        }
        // A hello is lost when its seed was not up yet or a datagram was
        // dropped (a full buffer during a 100+ node start, loss); a member
        // not greeted is otherwise learnt only at the next refresh or
        // full-state exchange. A seed that stays unknown (a dead static
        // seed) costs one hello per refresh, as before.
        let wait = if !shared.has_peers.load(Ordering::Relaxed) {
            SEED_RETRY_ALONE
        } else if shared.seeds_unknown.load(Ordering::Relaxed) {
            let wait = retry;
            retry = (retry * 2).min(SEED_REFRESH);
            wait
        } else {
            retry = SEED_RETRY_FIRST;
            SEED_REFRESH
        };
        tokio::time::sleep(wait).await;
    }
}

async fn key_file_loop(
    path: PathBuf,
    sealer: Arc<Sealer>,
    rings: Arc<tokio::sync::watch::Sender<Arc<KeyRing>>>,
    alive: mpsc::WeakSender<Command>,
) {
    let mut last: Option<Vec<u8>> = None;
    loop {
        if alive.upgrade().is_none() {
            return;
        }
        match tokio::fs::read(&path).await {
            Ok(bytes) if last.as_ref() != Some(&bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                match crate::config::parse_key_ring(&text).map(KeyRing::new) {
                    Ok(Ok(ring)) => {
                        if last.is_some() {
                            info!(path = %path.display(), keys = ring.len(), "cluster key ring reloaded");
                        }
                        sealer.set_ring(ring.clone());
                        rings.send_replace(Arc::new(ring));
                    }
                    Ok(Err(e)) => warn!(path = %path.display(), error = %e, "key file ignored"),
                    Err(e) => warn!(path = %path.display(), error = %e, "key file ignored"),
                }
                last = Some(bytes);
            }
            Ok(_) => {}
            Err(e) => {
                warn!(path = %path.display(), error = %e, "key file unreadable; keeping the current keys")
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// How long an inbound transport connection may take to deliver its whole
/// first frame. A peer writes it right after connecting (at most
/// [`wire::MAX_REQUEST_FRAME`], milliseconds on a LAN), so a connection
/// that has not is idle or trickling, and only holds a slot.
const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(2);
/// Inbound connections whose first frame has not opened yet, in all. With
/// [`wire::MAX_REQUEST_FRAME`] this bounds what unauthenticated peers can
/// make us buffer to 64 MiB (a few KiB while they stall).
const MAX_UNAUTHENTICATED: usize = 64;
/// The same, per source (an IPv4 address, an IPv6 /64: what one host
/// gets), so one source cannot take all the slots.
const MAX_UNAUTHENTICATED_PER_SOURCE: usize = 8;
/// Authenticated inbound exchanges served at once; more wait their turn.
const MAX_INBOUND_EXCHANGES: usize = 64;
/// Refused connections are logged at most this often (with a count).
const REFUSED_WARN_EVERY: Duration = Duration::from_secs(10);

/// Inbound connections still in the unauthenticated phase, oldest first.
///
/// At a limit the oldest one (of the source, else overall) is closed to make
/// room: a peer delivers its first frame within milliseconds, so the oldest
/// is all but always idle, whereas refusing the newest would let anyone
/// holding idle connections lock every peer out.
#[derive(Default)]
struct Unauthenticated {
    next_id: u64,
    /// Source and how to close it, by the order of arrival.
    conns: std::collections::BTreeMap<u64, (IpAddr, oneshot::Sender<()>)>,
}

impl Unauthenticated {
    /// Closes a connection if one must go before one more from `source` is
    /// admitted; returns the reason. A connection whose first frame opened
    /// meanwhile has left the table, or ignores the signal: only the
    /// unauthenticated phase can be cut short.
    fn make_room(&mut self, source: IpAddr) -> Option<&'static str> {
        let mut of_source = self
            .conns
            .iter()
            .filter(|(_, (ip, _))| *ip == source)
            .map(|(id, _)| *id);
        let oldest_of_source = of_source.next();
        let count_of_source = oldest_of_source.map_or(0, |_| 1 + of_source.count());
        let (reason, id) = if count_of_source >= MAX_UNAUTHENTICATED_PER_SOURCE {
            ("source_limit", oldest_of_source?)
        } else if self.conns.len() >= MAX_UNAUTHENTICATED {
            ("limit", *self.conns.keys().next()?)
        } else {
            return None;
        };
        let (_, close) = self.conns.remove(&id)?;
        let _ = close.send(());
        Some(reason)
    }

    /// Registers a new connection; the receiver fires when it must close.
    fn admit(&mut self, source: IpAddr) -> (u64, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let id = self.next_id;
        self.next_id += 1;
        self.conns.insert(id, (source, tx));
        (id, rx)
    }
}

/// The source a connection counts against: its IPv4 address (also when
/// mapped into IPv6), else its IPv6 /64.
fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from_bits(
                v6.to_bits() & !((1u128 << 64) - 1),
            )),
        },
    }
}

/// Takes a connection out of [`Unauthenticated`] when its first frame is
/// done with.
struct Admitted {
    table: Arc<std::sync::Mutex<Unauthenticated>>,
    id: u64,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        lock(&self.table).conns.remove(&self.id);
    }
}

fn lock(table: &std::sync::Mutex<Unauthenticated>) -> std::sync::MutexGuard<'_, Unauthenticated> {
    // The table stays consistent whatever panicked while holding it.
    table
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A warning at most every [`REFUSED_WARN_EVERY`], with how many were held back.
struct RefusedLog {
    last: std::sync::Mutex<Option<Instant>>,
    held_back: std::sync::atomic::AtomicU64,
}

impl RefusedLog {
    /// Counts and logs a connection closed before it authenticated.
    fn refused(&self, metrics: &Metrics, peer: SocketAddr, reason: &'static str) {
        metrics.mesh.connection_refused(reason);
        self.warn(
            peer,
            reason,
            "transport connection closed before it authenticated (idle, too slow, or too many \
             from one source); see mesh_transport_connections_refused_total",
        );
    }

    /// Logs a first frame that did not open (counted by the caller in
    /// `mesh_packets_rejected_total`).
    fn rejected(&self, peer: SocketAddr, reason: &'static str) {
        self.warn(
            peer,
            reason,
            "transport connection closed: its first frame was rejected (too large, another \
             cluster, an unknown key, stale or replayed); see mesh_packets_rejected_total",
        );
    }

    fn warn(&self, peer: SocketAddr, reason: &'static str, message: &'static str) {
        let now = Instant::now();
        let due = {
            let mut last = self
                .last
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let due = last.is_none_or(|t| now.duration_since(t) >= REFUSED_WARN_EVERY);
            if due {
                *last = Some(now);
            }
            due
        };
        if due {
            let held_back = self.held_back.swap(0, Ordering::Relaxed);
            warn!(%peer, reason, held_back, "{message}");
        } else {
            self.held_back.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn accept_loop(
    listener: TcpListener,
    sealer: Arc<Sealer>,
    metrics: Arc<Metrics>,
    cmd: mpsc::Sender<Command>,
) {
    let table = Arc::new(std::sync::Mutex::new(Unauthenticated::default()));
    let exchanges = Arc::new(tokio::sync::Semaphore::new(MAX_INBOUND_EXCHANGES));
    let log = Arc::new(RefusedLog {
        last: std::sync::Mutex::new(None),
        held_back: std::sync::atomic::AtomicU64::new(0),
    });
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                debug!(error = %e, "transport accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let source = source_of(peer.ip());
        let (made_room, (id, closed)) = {
            let mut t = lock(&table);
            (t.make_room(source), t.admit(source))
        };
        if let Some(reason) = made_room {
            log.refused(&metrics, peer, reason);
        }
        let admitted = Admitted {
            table: table.clone(),
            id,
        };
        let (sealer, metrics, cmd) = (sealer.clone(), metrics.clone(), cmd.clone());
        let (exchanges, log) = (exchanges.clone(), log.clone());
        tokio::spawn(async move {
            let first = (admitted, closed);
            serve_conn(
                stream, peer, first, &sealer, &metrics, &cmd, &exchanges, &log,
            )
            .await
        });
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_conn(
    mut stream: TcpStream,
    peer: SocketAddr,
    (admitted, closed): (Admitted, oneshot::Receiver<()>),
    sealer: &Sealer,
    metrics: &Metrics,
    cmd: &mpsc::Sender<Command>,
    exchanges: &tokio::sync::Semaphore,
    log: &RefusedLog,
) {
    let first = tokio::select! {
        first = tokio::time::timeout(
            FIRST_FRAME_TIMEOUT,
            wire::read_frame(&mut stream, sealer, wire::MAX_REQUEST_FRAME, now_ms),
        ) => first,
        // Closed to make room (counted by the accept loop).
        _ = closed => return,
    };
    drop(admitted);
    let (msg, n, key_id) = match first {
        Ok(Ok(frame)) => frame,
        Ok(Err(WireError::Rejected(r))) => {
            metrics.mesh.rejected(r.label());
            log.rejected(peer, r.label());
            return;
        }
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "transport exchange failed");
            return;
        }
        Err(_) => {
            log.refused(metrics, peer, "timeout");
            return;
        }
    };
    metrics.mesh.received(Transport::tcp, n);
    let answer = async {
        let _permit = exchanges.acquire().await.map_err(|_| WireError::Timeout)?;
        answer(&mut stream, msg, key_id, sealer, metrics, cmd).await
    };
    match tokio::time::timeout(TCP_TIMEOUT, answer).await {
        Ok(Ok(())) => {}
        Ok(Err(WireError::Rejected(r))) => {
            metrics.mesh.rejected(r.label());
            debug!(%peer, reason = r.label(), "transport frame rejected");
        }
        Ok(Err(e)) => debug!(%peer, error = %e, "transport exchange failed"),
        Err(_) => debug!(%peer, "transport exchange timed out"),
    }
}

/// Answers one authenticated request.
async fn answer(
    stream: &mut TcpStream,
    msg: TcpMsg,
    key_id: u32,
    sealer: &Sealer,
    metrics: &Metrics,
    cmd: &mpsc::Sender<Command>,
) -> Result<(), WireError> {
    let reply = match msg {
        TcpMsg::PushPull(state) => {
            let (tx, rx) = oneshot::channel();
            cmd.send(Command::PushPullIn(state, tx))
                .await
                .map_err(|_| WireError::Timeout)?;
            TcpMsg::PushPull(rx.await.map_err(|_| WireError::Timeout)?)
        }
        TcpMsg::MetaRequest(node_id) => {
            let (tx, rx) = oneshot::channel();
            cmd.send(Command::MetaIn(node_id, tx))
                .await
                .map_err(|_| WireError::Timeout)?;
            TcpMsg::MetaReply(rx.await.map_err(|_| WireError::Timeout)?)
        }
        TcpMsg::MetaReply(_) => return Err(WireError::Rejected(Reject::Decode)),
    };
    let n = wire::write_frame(stream, sealer, Some(key_id), &reply, now_ms()).await?;
    metrics.mesh.sent(Transport::tcp, n);
    Ok(())
}

async fn exchange(
    (addr, key): (SocketAddr, Option<u32>),
    msg: TcpMsg,
    sealer: &Sealer,
    metrics: &Metrics,
) -> Result<TcpMsg, WireError> {
    let run = async {
        let mut stream = TcpStream::connect(addr).await?;
        let n = wire::write_frame(&mut stream, sealer, key, &msg, now_ms()).await?;
        metrics.mesh.sent(Transport::tcp, n);
        let (reply, n, _) =
            wire::read_frame(&mut stream, sealer, wire::MAX_REPLY_FRAME, now_ms).await?;
        metrics.mesh.received(Transport::tcp, n);
        Ok(reply)
    };
    match tokio::time::timeout(TCP_TIMEOUT, run).await {
        Ok(r) => {
            if let Err(WireError::Rejected(reason)) = &r {
                metrics.mesh.rejected(reason.label());
            }
            r
        }
        Err(_) => Err(WireError::Timeout),
    }
}

async fn push_pull(
    addr: SocketAddr,
    key: Option<u32>,
    state: FullState,
    sealer: Arc<Sealer>,
    metrics: Arc<Metrics>,
    cmd: mpsc::WeakSender<Command>,
) {
    match exchange((addr, key), TcpMsg::PushPull(state), &sealer, &metrics).await {
        Ok(TcpMsg::PushPull(remote)) => {
            if let Some(cmd) = cmd.upgrade() {
                let _ = cmd.send(Command::PushPullDone(remote)).await;
            }
        }
        Ok(_) => metrics.mesh.rejected(Reject::Decode.label()),
        Err(e) => debug!(%addr, error = %e, "full-state exchange failed"),
    }
}

async fn fetch_meta(
    (addr, key): (SocketAddr, Option<u32>),
    node_id: String,
    sealer: Arc<Sealer>,
    metrics: Arc<Metrics>,
    cmd: mpsc::WeakSender<Command>,
) {
    let rec = match exchange(
        (addr, key),
        TcpMsg::MetaRequest(node_id.clone()),
        &sealer,
        &metrics,
    )
    .await
    {
        Ok(TcpMsg::MetaReply(rec)) => rec.filter(|r| r.node_id == node_id),
        Ok(_) => None,
        Err(e) => {
            debug!(%addr, error = %e, "metadata fetch failed");
            None
        }
    };
    if let Some(cmd) = cmd.upgrade() {
        let _ = cmd.send(Command::MetaFetched(rec, node_id)).await;
    }
}

#[cfg(test)]
mod transport_limit_tests {
    //! Who is closed when the unauthenticated phase is full.

    use super::*;

    fn ip(a: u8, b: u8) -> IpAddr {
        IpAddr::from([10, 0, a, b])
    }

    #[test]
    fn an_ipv6_source_is_its_64_and_a_mapped_ipv4_its_address() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(source_of(a), source_of(b));
        assert_ne!(source_of(a), source_of(other));
        let mapped: IpAddr = "::ffff:10.0.0.7".parse().unwrap();
        assert_eq!(source_of(mapped), IpAddr::from([10, 0, 0, 7]));
    }

    #[test]
    fn the_oldest_of_a_full_source_makes_room_then_the_oldest_overall() {
        let mut t = Unauthenticated::default();
        let mut closed = Vec::new();
        for _ in 0..MAX_UNAUTHENTICATED_PER_SOURCE {
            closed.push(t.admit(ip(0, 1)));
        }
        // Another source is not affected by 10.0.0.1 being full.
        assert_eq!(t.make_room(ip(0, 2)), None);
        assert_eq!(t.make_room(ip(0, 1)), Some("source_limit"));
        let (oldest, mut signal) = closed.remove(0);
        assert_eq!(
            signal.try_recv(),
            Ok(()),
            "the oldest of 10.0.0.1 is told to close"
        );
        assert!(!t.conns.contains_key(&oldest));
        assert!(closed.iter_mut().all(|(_, s)| s.try_recv().is_err()));

        // Fill up from many sources: the oldest overall goes.
        let mut b = 0u8;
        while t.conns.len() < MAX_UNAUTHENTICATED {
            b += 1;
            closed.push(t.admit(ip(1, b)));
        }
        assert_eq!(t.make_room(ip(2, 1)), Some("limit"));
        let (oldest, signal) = &mut closed[0];
        assert_eq!(
            signal.try_recv(),
            Ok(()),
            "the oldest overall is told to close"
        );
        assert!(!t.conns.contains_key(oldest));
    }
}
