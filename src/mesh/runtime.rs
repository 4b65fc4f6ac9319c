//! The async shell around the mesh core ([`crate::mesh::machine`]): one task
//! owns the core and moves bytes (UDP gossip, TCP full-state and metadata
//! exchanges) and time; metrics and log lines are made here.
//!
//! Flow: socket -> unseal -> core -> outputs -> seal -> socket; core events
//! -> metrics and logs.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::net::{TcpListener, UdpSocket};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::keyring::KeyRing;
use crate::mesh::discovery::SeedSource;
use crate::mesh::machine::{Event, Machine, Output, SwimTuning};
use crate::mesh::member::NodeIdentity;
use crate::mesh::meta::{MetaRecord, NodeMeta, key_ring_of};
use crate::mesh::ring;
use crate::mesh::seal::{
    Channel, Isolation, MAX_DATAGRAM, PeerKeys, REPLAY_WINDOW_MS, Reject, Sealer, SkewWatch,
    SkewedPeer,
};
use crate::mesh::suspicion;
use crate::mesh::transport::{accept_loop, fetch_meta, push_pull};
use crate::mesh::view::{ClockSkewPeer, ClusterStatus, MemberInfo};
use crate::mesh::wire::FullState;
use crate::metrics::{Metrics, PeerState, StateLabels, Transport};

/// Datagrams read ahead of late timers, at most (a flood must not hold
/// the timers back for long).
const MAX_BACKLOG_READ: usize = 256;
/// A stall of this process this long is logged as a warning: it shows in
/// the peers' probes (the ring's direct probe waits 300 ms, its indirect
/// ones 300 ms more, then a suspicion lasts 1.5 s), and explains a false
/// `down` of this node.
const STALL_WARNING: Duration = Duration::from_secs(1);
/// How long a stall of [`STALL_WARNING`] or more stays in `/readyz`'s and
/// status's `degraded` ([`Mesh::recent_stall`]): long enough for a probe,
/// a scrape or an operator to see why peers suspected this node.
const STALL_REPORTED: Duration = Duration::from_secs(60);

/// What a mesh node needs to start. [`MeshConfig::new`] fills in the
/// defaults; change the public fields after that.
#[derive(Clone, Debug)]
#[non_exhaustive]
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

impl MeshConfig {
    /// A member named `node_id` of `cluster_id` sealing with `keys`
    /// (primary first): both sockets on `0.0.0.0` at the default ports
    /// (7946 UDP, 8946 TCP), no seeds, the default SWIM timing.
    pub fn new(
        node_id: impl Into<String>,
        cluster_id: impl Into<String>,
        keys: Vec<[u8; 32]>,
    ) -> Self {
        Self {
            node_id: node_id.into(),
            cluster_id: cluster_id.into(),
            bind: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            gossip_port: crate::config::DEFAULT_GOSSIP_PORT,
            transport_port: crate::config::DEFAULT_TRANSPORT_PORT,
            advertise: None,
            seeds: SeedSource {
                seeds: Vec::new(),
                mesh_service: None,
                gossip_port: crate::config::DEFAULT_GOSSIP_PORT,
            },
            keys,
            key_file: None,
            tuning: SwimTuning::default(),
        }
    }
}

/// Errors starting the mesh.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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

pub(super) enum Command {
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
    /// See [`Mesh::view_changes`].
    view_changes: AtomicU64,
    /// Written by the driver for every authenticated datagram; read by
    /// `/readyz` without a round trip to the driver.
    skew: Mutex<SkewWatch>,
    /// The last stall of [`STALL_WARNING`] or more: when it ended, and how
    /// long the process was not running.
    stall: Mutex<Option<(Instant, Duration)>>,
}

impl Shared {
    fn skew(&self) -> MutexGuard<'_, SkewWatch> {
        // A poisoned watch is still a consistent set of entries.
        self.skew.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stall(&self) -> MutexGuard<'_, Option<(Instant, Duration)>> {
        self.stall.lock().unwrap_or_else(PoisonError::into_inner)
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

/// The gossip (UDP) and transport (TCP) sockets on `cfg.bind`, and the
/// ports they got (the ones asked for, or the kernel's pick for 0).
async fn bind_sockets(cfg: &MeshConfig) -> Result<(UdpSocket, TcpListener, u16, u16), MeshError> {
    let failed = |what: &'static str, addr| move |source| MeshError::Bind { what, addr, source };
    let udp_addr = SocketAddr::new(cfg.bind, cfg.gossip_port);
    let udp = UdpSocket::bind(udp_addr)
        .await
        .map_err(failed("gossip (UDP)", udp_addr))?;
    let rcvbuf = enlarge_receive_buffer(&udp, GOSSIP_RECEIVE_BUFFER);
    debug!(
        bytes = rcvbuf,
        asked = GOSSIP_RECEIVE_BUFFER,
        "gossip socket receive buffer"
    );
    let tcp_addr = SocketAddr::new(cfg.bind, cfg.transport_port);
    let tcp = TcpListener::bind(tcp_addr)
        .await
        .map_err(failed("transport (TCP)", tcp_addr))?;
    let gossip_port = udp
        .local_addr()
        .map(|a| a.port())
        .unwrap_or(cfg.gossip_port);
    let transport_port = tcp
        .local_addr()
        .map(|a| a.port())
        .unwrap_or(cfg.transport_port);
    Ok((udp, tcp, gossip_port, transport_port))
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
        let mut meta = meta;
        stamp_ring(&mut meta, &ring);
        let rings = Arc::new(tokio::sync::watch::Sender::new(Arc::new(ring.clone())));
        let sealer = Arc::new(Sealer::new(&cfg.cluster_id, ring));

        let (udp, tcp, gossip_port, transport_port) = bind_sockets(&cfg).await?;

        let advertise = match cfg.advertise {
            Some(a) => a,
            None => SocketAddr::new(pick_advertise_ip(cfg.bind, &cfg.seeds).await, gossip_port),
        };
        // Never the generation a ring probe names, even with a clock at
        // the Unix epoch: a check of it is a ring probe, not a suspicion.
        let generation = now_ms().max(ring::PING_GENERATION + 1);
        let local = NodeIdentity::new(
            cfg.node_id.as_str().into(),
            advertise,
            transport_port,
            generation,
        );
        info!(node_id = %local.node_id, gossip = %advertise, transport_port, cluster_id = %cfg.cluster_id, "mesh starting");

        let (cmd_tx, cmd_rx) = mpsc::channel(1024);
        let shared = Arc::new(Shared::default());
        let udp = Arc::new(udp);

        tokio::spawn(accept_loop(
            tcp,
            sealer.clone(),
            metrics.clone(),
            cmd_tx.clone(),
        ));
        if let Some(path) = cfg.key_file.clone() {
            tokio::spawn(key_file_loop(
                path,
                sealer.clone(),
                rings.clone(),
                cmd_tx.downgrade(),
            ));
        }

        let core = Machine::new(
            local.clone(),
            cfg.cluster_id,
            cfg.tuning,
            &meta,
            StdRng::from_rng(&mut rand::rng()),
            Instant::now(),
        );
        let drops_seen = receive_drops(&udp).unwrap_or(0);
        let driver = Driver {
            core,
            udp,
            sealer: sealer.clone(),
            metrics,
            seeds: cfg.seeds,
            resolving: false,
            next_gauges: Instant::now(),
            drops_seen,
            counts_seen: [0; 3],
            peer_keys: PeerKeys::default(),
            cmd_tx: cmd_tx.downgrade(),
            shared: shared.clone(),
            meta,
            rings: rings.subscribe(),
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
    /// `Mesh::clock_skew_isolation`).
    pub fn is_running(&self) -> bool {
        self.shared.running.load(Ordering::Relaxed)
    }

    /// `Some` while every authenticated packet of the last 30 s was
    /// rejected for clock skew: this node, or every peer it hears, has a
    /// clock more than 30 s off, and it is cut off from the mesh.
    pub(crate) fn clock_skew_isolation(&self) -> Option<Isolation> {
        self.shared.skew().isolation(Instant::now())
    }

    /// Said while a stall of this process (its timers ran at least 1 s
    /// late: CPU starved or throttled, or stopped) ended less than a
    /// minute ago: why peers may have suspected it or declared it down.
    pub(crate) fn recent_stall(&self) -> Option<String> {
        let (ended, late) = (*self.shared.stall())?;
        let ago = ended.elapsed();
        (ago < STALL_REPORTED).then(|| {
            format!(
                "mesh: this process was not running for {:.1} s, {} s ago (CPU starved or \
                 throttled, or stopped): peers may have suspected it or declared it down",
                late.as_secs_f64(),
                ago.as_secs()
            )
        })
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

    /// A count that moves whenever a member comes up, goes down, is
    /// suspected, renews its identity or changes its record, and when the
    /// number of alive, suspect or down members changed (looked at once a
    /// second, which is when a suspect that refuted shows). A caller that
    /// polls [`Mesh::status`] for members, states and records can skip
    /// building it while the count holds (at N = 512 a build parses 511
    /// records: about half a millisecond).
    pub fn view_changes(&self) -> u64 {
        self.shared.view_changes.load(Ordering::Acquire)
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
    pub(crate) fn key_rings(&self) -> tokio::sync::watch::Receiver<Arc<KeyRing>> {
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

/// Asks the kernel for a gossip receive buffer this large (memberlist
/// asks for the same). It holds a burst, not a steady load: a newcomer's
/// greeting is answered by every seed at once (~500 answers at N = 512),
/// and a process that was not running finds every datagram of that time
/// queued. The default (`net.core.rmem_default`, 208 KiB) holds ~150
/// small datagrams; what overflows is lost, probes and hellos among them
/// (BENCHMARKS.md, "A larger gossip receive buffer"). Memory is taken only
/// while datagrams wait; the kernel caps the size at `net.core.rmem_max`.
const GOSSIP_RECEIVE_BUFFER: usize = 2 << 20;

/// Sets `socket`'s receive buffer to `bytes` (as far as the kernel allows);
/// the size it then has (the kernel counts its bookkeeping in it, and
/// reports twice what was granted), or 0 when it cannot tell.
#[cfg(unix)]
fn enlarge_receive_buffer(socket: &UdpSocket, bytes: usize) -> usize {
    use std::os::fd::AsRawFd;
    let fd = socket.as_raw_fd();
    let want = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: both calls read or write one c_int, whose size is passed.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&raw const want).cast(),
            size,
        );
        let mut got: libc::c_int = 0;
        let mut len = size;
        let rc = libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&raw mut got).cast(),
            &mut len,
        );
        if rc == 0 {
            usize::try_from(got).unwrap_or(0)
        } else {
            0
        }
    }
}

#[cfg(not(unix))]
fn enlarge_receive_buffer(_: &UdpSocket, _: usize) -> usize {
    0
}

/// How many datagrams the kernel has dropped on `socket` (its receive
/// buffer full): `SO_MEMINFO`'s drop counter, a `u32` that wraps. `None`
/// where that option does not exist.
#[cfg(target_os = "linux")]
fn receive_drops(socket: &UdpSocket) -> Option<u32> {
    use std::os::fd::AsRawFd;
    // SK_MEMINFO_VARS entries since Linux 4.4; older kernels write fewer.
    let mut info = [0u32; 9];
    let mut len = std::mem::size_of_val(&info) as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `info`, which has
    // room for them, and sets `len` to what it wrote.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_MEMINFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    let at = libc::SK_MEMINFO_DROPS as usize;
    (rc == 0 && len as usize > at * 4).then(|| info[at])
}

#[cfg(not(target_os = "linux"))]
fn receive_drops(_: &UdpSocket) -> Option<u32> {
    None
}

struct Driver {
    core: Machine,
    udp: Arc<UdpSocket>,
    sealer: Arc<Sealer>,
    metrics: Arc<Metrics>,
    seeds: SeedSource,
    resolving: bool,
    next_gauges: Instant,
    /// The gossip socket's drop counter when last read (once a second).
    drops_seen: u32,
    /// Alive, suspect and down peers when last counted (once a second).
    counts_seen: [usize; 3],
    /// Which key each peer opens: a rotation rolled out pod by pod drops
    /// no packet ([`PeerKeys`]).
    peer_keys: PeerKeys,
    cmd_tx: mpsc::WeakSender<Command>,
    shared: Arc<Shared>,
    /// The metadata last published, for republishing it with a new ring.
    meta: NodeMeta,
    /// Every key ring change (the key file, [`Mesh::set_keys`]): our
    /// metadata's `key_id` and `key_ring` follow it.
    rings: tokio::sync::watch::Receiver<Arc<KeyRing>>,
}

impl Driver {
    async fn run(mut self, mut cmd_rx: mpsc::Receiver<Command>) {
        let mut buf = vec![0u8; MAX_DATAGRAM + 1];
        let udp = self.udp.clone();
        self.flush().await;
        loop {
            let next_timer = self
                .core
                .poll_timeout()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                r = udp.recv_from(&mut buf) => match r {
                    Ok((n, from)) => self.on_datagram(&buf[..n], n > MAX_DATAGRAM, from),
                    Err(e) => debug!(error = %e, "gossip recv failed"),
                },
                _ = tokio::time::sleep_until(next_timer.into()) => {
                    // Woken this late, the process was not running: what
                    // queued in the socket meanwhile (the ack of a probe in
                    // flight, checks of us) is read before the timers judge.
                    if Instant::now() >= next_timer + suspicion::STARVED_AFTER {
                        for _ in 0..MAX_BACKLOG_READ {
                            let Ok((n, from)) = udp.try_recv_from(&mut buf) else { break };
                            self.on_datagram(&buf[..n], n > MAX_DATAGRAM, from);
                        }
                    }
                    let now = Instant::now();
                    self.core
                        .set_skew_isolated(self.shared.skew().isolation(now).is_some());
                    self.core.handle_timeout(now);
                    if now >= self.next_gauges {
                        self.next_gauges = now + Duration::from_secs(1);
                        self.update_gauges();
                        if let Some(drops) = receive_drops(&self.udp) {
                            let dropped = drops.wrapping_sub(self.drops_seen);
                            self.drops_seen = drops;
                            self.core.handle_receive_drops(dropped.into(), now);
                        }
                    }
                }
                Ok(()) = self.rings.changed() => {
                    let ring = Arc::clone(&self.rings.borrow_and_update());
                    if stamp_ring(&mut self.meta, &ring) {
                        self.core.set_local_meta(&self.meta, Instant::now());
                    }
                }
                cmd = cmd_rx.recv() => match cmd {
                    Some(Command::Leave(done)) => {
                        self.core.leave(Instant::now());
                        self.flush().await;
                        let _ = done.send(());
                        return;
                    }
                    Some(cmd) => self.on_command(cmd),
                    None => return,
                },
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
                self.peer_keys.heard(from, key_id);
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
        self.core.handle_datagram(&plain, from, Instant::now());
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

    /// The key to seal with for the peer at `gossip`: the primary we
    /// publish (named, so that a ring changing meanwhile cannot swap in a
    /// key the peer was not checked for), or one the peer opens.
    fn key_for(&self, gossip: SocketAddr) -> Option<u32> {
        let primary = self.meta.key_ring.first().copied()?;
        Some(self.peer_keys.key_for(gossip, primary).unwrap_or(primary))
    }

    /// Seals a datagram for `to`, in a key that peer opens.
    fn seal_for(&self, to: SocketAddr, plain: &[u8]) -> Option<Vec<u8>> {
        let mut sealed = Vec::with_capacity(plain.len() + Sealer::overhead());
        let key = self.key_for(to);
        self.sealer
            .seal_with(Channel::Udp, key, plain, now_ms(), &mut sealed)
            .ok()?;
        Some(sealed)
    }

    /// The transport address of a member, and the key to seal for it.
    fn transport_of(&self, id: &NodeIdentity) -> (SocketAddr, Option<u32>) {
        (id.transport(), self.key_for(id.gossip))
    }

    fn on_command(&mut self, cmd: Command) {
        let now = Instant::now();
        match cmd {
            Command::Status(reply) => {
                let mut status = self.core.status(now, now_ms());
                if let Some(local) = status.nodes.first_mut() {
                    local.clock_skew = self
                        .shared
                        .skew()
                        .peers(now)
                        .iter()
                        .map(ClockSkewPeer::from)
                        .collect();
                }
                let _ = reply.send(status);
            }
            Command::Members(reply) => {
                let _ = reply.send(self.core.members());
            }
            Command::Seeds(seeds) => {
                self.resolving = false;
                self.core.handle_seeds(seeds, now);
            }
            Command::PushPullIn(remote, reply) => {
                let _ = reply.send(self.core.handle_push_pull_request(remote, now));
            }
            Command::PushPullDone(remote) => self.core.handle_push_pull_reply(remote, now),
            Command::MetaIn(node_id, reply) => {
                let _ = reply.send(self.core.meta_record(&node_id));
            }
            Command::MetaFetched(rec, node_id) => {
                self.core.handle_meta_fetched(rec, &node_id, now);
            }
            Command::SetMeta(meta) => {
                self.meta = NodeMeta {
                    key_id: self.meta.key_id.take(),
                    key_ring: std::mem::take(&mut self.meta.key_ring),
                    ..meta
                };
                self.core.set_local_meta(&self.meta, now);
            }
            Command::Leave(_) => {}
        }
    }

    fn update_gauges(&mut self) {
        let counts = self.core.peer_counts();
        if counts != self.counts_seen {
            self.counts_seen = counts;
            self.view_changed();
        }
        for (i, state) in [PeerState::alive, PeerState::suspect, PeerState::down]
            .into_iter()
            .enumerate()
        {
            self.metrics
                .mesh
                .peer_count
                .get_or_create(&StateLabels { state })
                .set(counts[i] as i64);
        }
    }

    /// Carries out what the core asked for; publishes its flags.
    async fn flush(&mut self) {
        while let Some(out) = self.core.poll_output() {
            match out {
                Output::Send { to, plain } => {
                    let Some(sealed) = self.seal_for(to, &plain) else {
                        continue;
                    };
                    // Awaited, not `try_send_to`: that fails with WouldBlock
                    // until the reactor has seen the new socket writable
                    // (the whole first hello round was lost so) and while a
                    // 127-hello burst fills the send buffer.
                    match self.udp.send_to(&sealed, to).await {
                        Ok(n) => self.metrics.mesh.sent(Transport::udp, n),
                        Err(e) => debug!(%to, error = %e, "gossip send failed"),
                    }
                }
                Output::PushPull { to, state } => {
                    tokio::spawn(push_pull(
                        self.transport_of(&to),
                        state,
                        self.sealer.clone(),
                        self.metrics.clone(),
                        self.cmd_tx.clone(),
                    ));
                }
                Output::FetchMeta { from, node_id } => {
                    tokio::spawn(fetch_meta(
                        self.transport_of(&from),
                        node_id,
                        self.sealer.clone(),
                        self.metrics.clone(),
                        self.cmd_tx.clone(),
                    ));
                }
                Output::ResolveSeeds => {
                    if !self.resolving {
                        self.resolving = true;
                        tokio::spawn(resolve_seeds(self.seeds.clone(), self.cmd_tx.clone()));
                    }
                }
                Output::Event(e) => self.on_event(e),
            }
        }
        self.shared
            .running
            .store(self.core.running(), Ordering::Relaxed);
        self.shared
            .has_peers
            .store(self.core.has_peers(), Ordering::Relaxed);
    }

    /// Moves [`Mesh::view_changes`].
    fn view_changed(&self) {
        self.shared.view_changes.fetch_add(1, Ordering::Release);
    }

    fn on_event(&mut self, e: Event) {
        if matches!(
            e,
            Event::MemberUp(_)
                | Event::MemberDown(_)
                | Event::Suspected(_)
                | Event::Renamed { .. }
                | Event::RecordChanged { .. }
        ) {
            self.view_changed();
        }
        let change = |state| {
            self.metrics
                .mesh
                .state_changes
                .get_or_create(&StateLabels { state })
                .inc();
        };
        match e {
            Event::MemberUp(id) => {
                self.peer_keys.member(id.gossip, &id.node_id);
                change(PeerState::alive);
                info!(node_id = %id.node_id, address = %id.gossip, "member up");
                self.update_gauges();
            }
            Event::MemberDown(id) => {
                change(PeerState::down);
                info!(node_id = %id.node_id, "member down");
                self.update_gauges();
            }
            Event::Suspected(id) => {
                change(PeerState::suspect);
                debug!(node_id = %id.node_id, "member suspected");
            }
            Event::Renamed { old, new } => {
                self.peer_keys.member(new.gossip, &new.node_id);
                debug!(node_id = %new.node_id, old = old.generation, new = new.generation, "member identity renewed");
            }
            Event::Rejected(r) => self.metrics.mesh.rejected(r.label()),
            Event::Joined => info!("joined the mesh"),
            Event::Idle => info!("no active peers"),
            Event::Rejoined { generation } => {
                info!(generation, "rejoined the mesh under a renewed identity");
            }
            Event::Defunct => warn!("declared down by the cluster"),
            Event::RecordChanged { node_id, json } => {
                self.peer_keys.ring(node_id, key_ring_of(&json));
            }
            Event::LocalMetaTooLarge { bytes } => {
                warn!(bytes, "node metadata over 64 KiB not published");
            }
            Event::Left { peers } => info!(peers, "left the mesh"),
            Event::Stalled { late } if late >= STALL_WARNING => {
                *self.shared.stall() = Some((Instant::now(), late));
                warn!(
                    late_ms = late.as_millis() as u64,
                    "this process was not running (CPU starved or throttled, or stopped): peers may have suspected it"
                );
            }
            // The core's local-health line says so at debug level already.
            Event::Stalled { .. } => {}
        }
    }
}

/// Puts `ring`'s primary id (as status shows it) and every key id in our
/// metadata; whether anything changed.
fn stamp_ring(meta: &mut NodeMeta, ring: &KeyRing) -> bool {
    let (key_id, key_ring) = (Some(ring.display_id()), ring.ids());
    let changed = meta.key_id != key_id || meta.key_ring != key_ring;
    meta.key_id = key_id;
    meta.key_ring = key_ring;
    changed
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

/// Resolves the seeds once, for the core (which decides how often).
async fn resolve_seeds(src: SeedSource, cmd: mpsc::WeakSender<Command>) {
    let seeds = src.resolve().await;
    if let Some(cmd) = cmd.upgrade() {
        let _ = cmd.send(Command::Seeds(seeds)).await;
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

#[cfg(all(test, target_os = "linux"))]
mod receive_drop_tests {
    use super::*;

    #[tokio::test]
    async fn the_drop_counter_counts_what_a_full_socket_lost() {
        let rx = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert_eq!(receive_drops(&rx), Some(0));
        // Nothing is read: the receive buffer (a few hundred KiB) fills.
        let payload = [7u8; 1200];
        let to = rx.local_addr().unwrap();
        for _ in 0..4000 {
            tx.send_to(&payload, to).unwrap();
        }
        let dropped = receive_drops(&rx).unwrap();
        assert!(dropped > 0, "a full buffer drops");
        assert!(dropped < 4000, "what fitted was kept: {dropped} dropped");
    }

    #[tokio::test]
    async fn the_gossip_socket_gets_the_largest_receive_buffer_the_kernel_allows() {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Linux grants up to rmem_max and reports twice what it granted
        // (its bookkeeping); the default is rmem_default, not doubled.
        assert_eq!(
            enlarge_receive_buffer(&socket, GOSSIP_RECEIVE_BUFFER),
            2 * GOSSIP_RECEIVE_BUFFER.min(max)
        );
    }
}
