//! A deterministic simulator of many mesh nodes: the shipping core
//! ([`crate::mesh::machine`]) on one virtual clock, with datagram latency,
//! jitter and loss, transport exchanges as request/reply messages, pod
//! start patterns and faults (kill, SIGTERM, partition, CPU starvation).
//! The same seed gives the same run, event for event.
//!
//! For the benchmark (`benches/mesh_sim.rs`) and the core's tests; not
//! part of a running sidecar.

// Reached by the benches and tests through `sbmesh::internal::sim`; no
// binary calls it, so a link keeps none of it. Some of its probes serve
// only its own tests.
#![allow(dead_code)]

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::mesh::machine::{Event, Machine, Output, SwimTuning};
use crate::mesh::member::NodeIdentity;
use crate::mesh::meta::{MetaRecord, NodeMeta};
use crate::mesh::seal::Sealer;
use crate::mesh::view::{ClusterStatus, MemberState};
use crate::mesh::wire::{self, FullState, TcpMsg};

/// Gossip port every simulated pod listens on (as in a StatefulSet).
const GOSSIP_PORT: u16 = 7946;
/// Transport port every simulated pod listens on.
const TRANSPORT_PORT: u16 = 7947;
/// How long a DNS lookup of the headless Service takes.
const RESOLVE_DELAY: Duration = Duration::from_millis(1);
/// Unix time of the simulation's start (for generations and status).
const BASE_UNIX_MS: u64 = 1_800_000_000_000;
/// A TCP frame's length prefix.
const FRAME_LEN_BYTES: usize = 4;

/// How the pods come up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// All at t = 0.
    Burst,
    /// One every so often (a Parallel StatefulSet as the kubelet gets to it).
    Spread(Duration),
    /// Each once the previous one is running (`/readyz`): OrderedReady.
    Ordered,
    /// None by itself: the caller starts nodes (`Sim::start`).
    Manual,
}

/// What a node resolves its seeds to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seeds {
    /// The headless Service: every started pod that has not died.
    Service,
    /// A fixed list of every pod's address, started or not (what a static
    /// `--seeds` list gives).
    All,
    /// The first pod only (`--seeds sbproxy-0`).
    First,
}

/// A simulation's parameters.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// How many pods.
    pub nodes: usize,
    /// Seeds the simulator's RNG and every node's.
    pub seed: u64,
    /// One-way datagram latency.
    pub latency: Duration,
    /// Latency varies uniformly by up to this much either way.
    pub jitter: Duration,
    /// Probability that a datagram is lost.
    pub loss: f64,
    /// How the pods come up.
    pub start: Start,
    /// What seeds resolve to.
    pub seeds: Seeds,
    /// SWIM timing of every node.
    pub tuning: SwimTuning,
    /// Datagrams a stalled pod's gossip socket holds ([`Sim::stall`]); the
    /// rest are dropped, and its core is told so when the stall ends, as
    /// the shell tells it of the socket's drop counter.
    pub rcvbuf: usize,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            nodes: 3,
            seed: 1,
            latency: Duration::from_micros(200),
            jitter: Duration::from_micros(50),
            loss: 0.0,
            start: Start::Burst,
            seeds: Seeds::Service,
            tuning: SwimTuning::default(),
            rcvbuf: usize::MAX,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Life {
    NotStarted,
    Up,
    /// Killed or left: its sockets are closed.
    Gone,
}

struct Node {
    core: Option<Machine>,
    id: NodeIdentity,
    life: Life,
    /// The wake-up queued for the core's next timer.
    wake: Option<Duration>,
    /// Starved of CPU until then: inputs wait.
    stalled_until: Option<Duration>,
    backlog: Vec<Msg>,
    /// Datagrams in `backlog`, and those dropped for want of room.
    queued_datagrams: usize,
    dropped: u64,
    /// Seed resolves asked for.
    resolves: u64,
    /// The longest stall its core reported (`Event::Stalled`), and how
    /// many it reported.
    longest_stall: Duration,
    stalls: u32,
    /// Network group; nodes in different groups cannot reach each other.
    group: u8,
    /// Peers alive or suspect, kept from the core's up/down events.
    active: usize,
    /// Saw the watched node down.
    saw_down: bool,
    sent_bytes: u64,
    /// Of which transport frames.
    sent_tcp: u64,
    /// The largest transport frame since [`Sim::take_largest_frame`].
    largest_frame: u64,
    /// Wake-ups for its core's timers (a process's wake-ups when idle).
    timer_wakes: u64,
    /// Metadata fetches out now, and the most that were out at once.
    fetches_out: usize,
    most_fetches_out: usize,
    /// Metadata fetches started in all.
    fetches: u64,
    started_at: Option<Duration>,
}

/// Kept small (boxed states, the sender by index): every message in flight
/// sits in the event queue, whose sifts move it, millions of times a
/// virtual second at N = 1000.
enum Msg {
    Datagram {
        /// The sending pod; its gossip address is the datagram's source.
        from: usize,
        plain: Vec<u8>,
    },
    PushPullRequest {
        from: usize,
        state: Box<FullState>,
    },
    PushPullReply {
        state: Box<FullState>,
    },
    MetaRequest {
        from: usize,
        node_id: String,
    },
    MetaReply {
        rec: Option<Box<MetaRecord>>,
        node_id: String,
    },
    Seeds,
}

enum Ev {
    Deliver { to: usize, msg: Msg },
    Wake { node: usize },
    Start { node: usize },
    StallEnd { node: usize },
}

struct Queued {
    at: Duration,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Queued {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// The event queue: events by (time, sequence), in slices of 2^[`SLICE_SHIFT`]
/// ns of virtual time, each a small heap. One heap of every event in flight
/// (millions at N = 10,000, when every pod greets its seeds at once) missed
/// the cache at every level of every sift; here a pop sifts a heap of the
/// current slice only. The order is exactly the one heap's.
#[derive(Default)]
struct Calendar {
    slices: BTreeMap<u64, BinaryHeap<Reverse<Queued>>>,
    /// Emptied heaps, kept for their allocation (small ones only).
    spare: Vec<BinaryHeap<Reverse<Queued>>>,
}

/// A [`Calendar`] slice is 2^16 ns of virtual time: about 65 µs, a third
/// of the default latency.
const SLICE_SHIFT: u32 = 16;

impl Calendar {
    fn slice(at: Duration) -> u64 {
        (at.as_nanos() >> SLICE_SHIFT) as u64
    }

    fn push(&mut self, q: Queued) {
        let spare = &mut self.spare;
        self.slices
            .entry(Self::slice(q.at))
            .or_insert_with(|| spare.pop().unwrap_or_default())
            .push(Reverse(q));
    }

    fn pop(&mut self) -> Option<Queued> {
        let mut first = self.slices.first_entry()?;
        let Reverse(q) = first.get_mut().pop()?;
        if first.get().is_empty() {
            let heap = first.remove();
            // Not the few swollen by a burst: they would hold its peak.
            if self.spare.len() < 64 && heap.capacity() <= 1024 {
                self.spare.push(heap);
            }
        }
        Some(q)
    }

    fn next_at(&self) -> Option<Duration> {
        let (_, heap) = self.slices.first_key_value()?;
        heap.peek().map(|Reverse(q)| q.at)
    }
}

/// N mesh cores on one virtual clock.
pub struct Sim {
    cfg: SimConfig,
    base: Instant,
    now: Duration,
    rng: StdRng,
    nodes: Vec<Node>,
    by_addr: HashMap<SocketAddr, usize>,
    queue: Calendar,
    seq: u64,
    trace: DefaultHasher,
    events: u64,
    /// The next pod an ordered start brings up.
    next_ordered: usize,
    /// Whose down the nodes are watching for ([`Sim::kill`]).
    watched: Option<usize>,
    watched_id: Option<Arc<str>>,
    /// Members declared down, over every node (false downs, when nobody died).
    downs: u64,
    /// Pods up now.
    up: usize,
    /// Pods that saw the watched pod down since [`Sim::watch`]: while fewer
    /// than the survivors, the O(N) check is skipped.
    saw_down_count: usize,
    /// Starts queued but not yet run.
    pending_starts: usize,
    /// Links cut both ways (lower index first), beside the groups.
    cut: BTreeSet<(usize, usize)>,
}

impl Sim {
    /// A cluster of pods that are not started yet; the start pattern is
    /// queued.
    pub fn new(cfg: SimConfig) -> Self {
        let rng = StdRng::seed_from_u64(cfg.seed);
        let mut nodes = Vec::with_capacity(cfg.nodes);
        let mut by_addr = HashMap::with_capacity(cfg.nodes);
        for i in 0..cfg.nodes {
            let gossip = SocketAddr::new(pod_ip(i), GOSSIP_PORT);
            by_addr.insert(gossip, i);
            nodes.push(Node {
                core: None,
                id: NodeIdentity::new(format!("sbproxy-{i}").into(), gossip, TRANSPORT_PORT, 0),
                life: Life::NotStarted,
                wake: None,
                stalled_until: None,
                queued_datagrams: 0,
                dropped: 0,
                resolves: 0,
                longest_stall: Duration::ZERO,
                stalls: 0,
                backlog: Vec::new(),
                group: 0,
                active: 0,
                saw_down: false,
                sent_bytes: 0,
                sent_tcp: 0,
                largest_frame: 0,
                timer_wakes: 0,
                fetches_out: 0,
                most_fetches_out: 0,
                fetches: 0,
                started_at: None,
            });
        }
        let mut sim = Self {
            base: Instant::now(),
            now: Duration::ZERO,
            rng,
            nodes,
            by_addr,
            queue: Calendar::default(),
            seq: 0,
            trace: DefaultHasher::new(),
            events: 0,
            next_ordered: 0,
            watched: None,
            watched_id: None,
            downs: 0,
            up: 0,
            saw_down_count: 0,
            pending_starts: 0,
            cut: BTreeSet::new(),
            cfg,
        };
        match sim.cfg.start {
            Start::Burst => {
                (0..sim.cfg.nodes).for_each(|i| sim.push(Duration::ZERO, Ev::Start { node: i }))
            }
            Start::Spread(every) => (0..sim.cfg.nodes).for_each(|i| {
                sim.push(every * i as u32, Ev::Start { node: i });
            }),
            Start::Ordered => {
                if sim.cfg.nodes > 0 {
                    sim.next_ordered = 1;
                    sim.push(Duration::ZERO, Ev::Start { node: 0 });
                }
            }
            Start::Manual => {}
        }
        sim
    }

    /// Virtual time since the start.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// Events processed so far.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// A hash of every event processed so far: equal runs, equal hashes.
    pub(crate) fn trace_hash(&self) -> u64 {
        self.trace.finish()
    }

    /// How many times a node saw a member go down, over all nodes.
    pub fn downs(&self) -> u64 {
        self.downs
    }

    /// How many pods.
    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether there are no pods.
    pub(crate) fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Pod `i`'s node id.
    pub fn node_id(&self, i: usize) -> &str {
        &self.nodes[i].id.node_id
    }

    /// When pod `i` last started.
    pub fn started_at(&self, i: usize) -> Option<Duration> {
        self.nodes[i].started_at
    }

    /// Whether pod `i` is up (started, not killed, not left).
    pub fn is_up(&self, i: usize) -> bool {
        self.nodes[i].life == Life::Up
    }

    /// Whether pod `i` would answer `/readyz`.
    pub(crate) fn is_running(&self, i: usize) -> bool {
        self.nodes[i].core.as_ref().is_some_and(Machine::running)
    }

    /// Bytes pod `i` sent, datagrams and transport frames, sealed.
    pub fn bytes_sent(&self, i: usize) -> u64 {
        self.nodes[i].sent_bytes
    }

    /// Of [`Sim::bytes_sent`], transport frames.
    pub fn tcp_bytes_sent(&self, i: usize) -> u64 {
        self.nodes[i].sent_tcp
    }

    /// The largest transport frame pod `i` sent since the last call.
    pub(crate) fn take_largest_frame(&mut self, i: usize) -> u64 {
        std::mem::take(&mut self.nodes[i].largest_frame)
    }

    /// The most metadata fetches pod `i` had out at once.
    pub(crate) fn most_fetches_out(&self, i: usize) -> usize {
        self.nodes[i].most_fetches_out
    }

    /// How many metadata fetches pod `i` started in all.
    pub(crate) fn fetches(&self, i: usize) -> u64 {
        self.nodes[i].fetches
    }

    /// How often pod `i` woke for its timers.
    pub(crate) fn timer_wakes(&self, i: usize) -> u64 {
        self.nodes[i].timer_wakes
    }

    /// Pod `i`'s `/admin/cluster/status`.
    pub fn status(&self, i: usize) -> Option<ClusterStatus> {
        let unix_ms = BASE_UNIX_MS + self.now.as_millis() as u64;
        self.nodes[i]
            .core
            .as_ref()
            .map(|c| c.status(self.base + self.now, unix_ms))
    }

    /// How pod `i` sees pod `j`.
    pub fn sees(&self, i: usize, j: usize) -> Option<MemberState> {
        let core = self.nodes[i].core.as_ref()?;
        core.peer_state(&self.nodes[j].id.node_id)
    }

    /// Whether every pod that is up counts every other pod that is up as
    /// alive or suspect, and no more (what `total_nodes` shows). Cheap: kept
    /// from events; [`Sim::converged_exactly`] checks the cores themselves.
    pub fn converged(&self) -> bool {
        if !self.all_started() {
            return false;
        }
        let up = self.nodes.iter().filter(|n| n.life == Life::Up).count();
        up > 0
            && self
                .nodes
                .iter()
                .filter(|n| n.life == Life::Up)
                .all(|n| n.active + 1 == up)
    }

    /// Pods that are up but do not count every other pod that is up yet,
    /// with how many peers each counts.
    pub fn lagging(&self) -> Vec<(usize, usize)> {
        let up = self.nodes.iter().filter(|n| n.life == Life::Up).count();
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.life == Life::Up && n.active + 1 != up)
            .map(|(i, n)| (i, n.active))
            .collect()
    }

    /// [`Sim::converged`] asked of every core (O(N²)).
    pub fn converged_exactly(&self) -> bool {
        if !self.all_started() {
            return false;
        }
        let up = self.nodes.iter().filter(|n| n.life == Life::Up).count();
        self.nodes
            .iter()
            .filter(|n| n.life == Life::Up)
            .filter_map(|n| n.core.as_ref())
            .all(|c| {
                let [alive, suspect, _] = c.peer_counts();
                alive + suspect + 1 == up
            })
    }

    /// Whether no start is queued or waiting for readiness.
    pub(crate) fn all_started(&self) -> bool {
        self.pending_starts == 0
            && (self.cfg.start != Start::Ordered || self.next_ordered >= self.nodes.len())
    }

    /// Whether every pod that is up has seen the watched pod go down (kept
    /// from events).
    pub fn watched_down_everywhere(&self) -> bool {
        // Every survivor flipped its mark since the watch began, so fewer
        // flips than survivors (all pods up but perhaps the watched) cannot
        // be all: O(1) for the simulator's per-event checks.
        if self.saw_down_count + 1 < self.up {
            return false;
        }
        self.nodes
            .iter()
            .enumerate()
            .filter(|(i, n)| n.life == Life::Up && Some(*i) != self.watched)
            .all(|(_, n)| n.saw_down)
    }

    /// Starts pod `i` now (again, if it was gone: a restarted pod, same
    /// name and address, a newer generation).
    pub(crate) fn start(&mut self, i: usize) {
        self.push(self.now, Ev::Start { node: i });
    }

    /// Kills pod `i` without a word (kill -9, node lost); the others watch
    /// for it to go down.
    pub fn kill(&mut self, i: usize) {
        self.watch(i);
        self.gone(i);
    }

    /// SIGTERM: pod `i` leaves the cluster gracefully.
    pub(crate) fn terminate(&mut self, i: usize) {
        self.watch(i);
        let now = self.base + self.now;
        if let Some(core) = self.nodes[i].core.as_mut() {
            core.leave(now);
        }
        self.drain(i);
        self.gone(i);
    }

    /// Starves pod `i` of CPU for `d` (SIGSTOP): its inputs and timers wait,
    /// then all run at once.
    pub fn stall(&mut self, i: usize, d: Duration) {
        let until = self.now + d;
        self.nodes[i].stalled_until = Some(until);
        self.push(until, Ev::StallEnd { node: i });
    }

    /// How many times pod `i` has asked for its seeds.
    pub(crate) fn resolves(&self, i: usize) -> u64 {
        self.nodes[i].resolves
    }

    /// The longest time pod `i`'s core found its timers late (it was not
    /// running), as it reported it.
    pub(crate) fn longest_stall(&self, i: usize) -> Duration {
        self.nodes[i].longest_stall
    }

    /// How many stalls pod `i`'s core reported.
    pub(crate) fn stalls(&self, i: usize) -> u32 {
        self.nodes[i].stalls
    }

    /// Tells pod `i`'s core its gossip socket dropped `dropped` datagrams
    /// (as the shell does once a second).
    pub(crate) fn report_drops(&mut self, i: usize, dropped: u64) {
        let now = self.base + self.now;
        if let Some(core) = self.nodes[i].core.as_mut() {
            core.handle_receive_drops(dropped, now);
        }
        self.drain(i);
        self.schedule_wake(i);
    }

    /// Puts pod `i` in network group `g`: pods in different groups cannot
    /// reach each other. Everyone in group 0 is one network again.
    pub(crate) fn set_group(&mut self, i: usize, g: u8) {
        self.nodes[i].group = g;
    }

    /// Cuts the link between pods `i` and `j`, both ways: each still
    /// reaches everyone else.
    pub(crate) fn cut_link(&mut self, i: usize, j: usize) {
        self.cut.insert((i.min(j), i.max(j)));
    }

    /// Changes the datagram loss from now on.
    pub fn set_loss(&mut self, loss: f64) {
        self.cfg.loss = loss;
    }

    /// Publishes new metadata on pod `i`.
    pub(crate) fn set_meta(&mut self, i: usize, meta: &NodeMeta) {
        let now = self.base + self.now;
        if let Some(core) = self.nodes[i].core.as_mut() {
            core.set_local_meta(meta, now);
        }
        self.drain(i);
        self.schedule_wake(i);
    }

    /// Runs events up to virtual time `t`; the clock ends at `t`.
    pub fn run_until(&mut self, t: Duration) {
        while self.queue.next_at().is_some_and(|at| at <= t) {
            self.step();
        }
        self.now = self.now.max(t);
    }

    /// Runs until `done` holds (checked after every event) or virtual time
    /// `limit`; returns when it held.
    pub fn run_while_not(
        &mut self,
        limit: Duration,
        mut done: impl FnMut(&Sim) -> bool,
    ) -> Option<Duration> {
        if done(self) {
            return Some(self.now);
        }
        while self.queue.next_at().is_some_and(|at| at <= limit) {
            self.step();
            if done(self) {
                return Some(self.now);
            }
        }
        self.now = self.now.max(limit);
        None
    }

    fn watch(&mut self, i: usize) {
        self.watched = Some(i);
        self.watched_id = Some(self.nodes[i].id.node_id.clone());
        for n in &mut self.nodes {
            n.saw_down = false;
        }
        self.saw_down_count = 0;
    }

    fn gone(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        if n.life == Life::Up {
            self.up -= 1;
        }
        n.life = Life::Gone;
        n.core = None;
        n.backlog.clear();
        n.queued_datagrams = 0;
        n.dropped = 0;
        n.stalled_until = None;
        n.wake = None;
        n.active = 0;
    }

    fn push(&mut self, at: Duration, ev: Ev) {
        self.seq += 1;
        if matches!(ev, Ev::Start { .. }) {
            self.pending_starts += 1;
        }
        self.queue.push(Queued {
            at,
            seq: self.seq,
            ev,
        });
    }

    fn step(&mut self) {
        let Some(q) = self.queue.pop() else {
            return;
        };
        self.now = q.at;
        self.events += 1;
        (q.at, q.seq).hash(&mut self.trace);
        match q.ev {
            Ev::Start { node } => {
                self.pending_starts -= 1;
                self.on_start(node);
            }
            Ev::Wake { node } => {
                if self.nodes[node].wake != Some(q.at) {
                    return;
                }
                self.nodes[node].wake = None;
                if self.nodes[node].stalled_until.is_some() {
                    return;
                }
                self.nodes[node].timer_wakes += 1;
                self.wake(node);
            }
            Ev::Deliver { to, msg } => {
                let n = &mut self.nodes[to];
                if n.life != Life::Up {
                    return;
                }
                if n.stalled_until.is_some() {
                    if matches!(msg, Msg::Datagram { .. }) {
                        if n.queued_datagrams >= self.cfg.rcvbuf {
                            n.dropped += 1;
                            return;
                        }
                        n.queued_datagrams += 1;
                    }
                    n.backlog.push(msg);
                    return;
                }
                self.deliver(to, msg);
                self.schedule_wake(to);
            }
            Ev::StallEnd { node } => {
                if self.nodes[node].stalled_until != Some(q.at) {
                    return;
                }
                self.nodes[node].stalled_until = None;
                self.nodes[node].queued_datagrams = 0;
                for msg in std::mem::take(&mut self.nodes[node].backlog) {
                    self.deliver(node, msg);
                }
                let dropped = std::mem::take(&mut self.nodes[node].dropped);
                if dropped > 0 {
                    self.report_drops(node, dropped);
                }
                if self.nodes[node].life == Life::Up {
                    self.wake(node);
                }
            }
        }
    }

    fn on_start(&mut self, i: usize) {
        let now = self.base + self.now;
        let n = &mut self.nodes[i];
        if n.life == Life::Up {
            return;
        }
        // A restarted pod: same name and address, a newer generation.
        n.id.generation = BASE_UNIX_MS + self.now.as_millis() as u64 + 1;
        let seed = self.cfg.seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let meta = NodeMeta {
            version: "sim".into(),
            ready: true,
            ..Default::default()
        };
        self.up += 1;
        n.core = Some(Machine::new(
            n.id.clone(),
            "sim".into(),
            self.cfg.tuning.clone(),
            &meta,
            StdRng::seed_from_u64(seed ^ n.id.generation),
            now,
        ));
        n.life = Life::Up;
        n.active = 0;
        n.wake = None;
        n.started_at = Some(self.now);
        self.wake(i);
    }

    fn wake(&mut self, i: usize) {
        let now = self.base + self.now;
        if let Some(core) = self.nodes[i].core.as_mut() {
            core.handle_timeout(now);
        }
        self.drain(i);
        self.schedule_wake(i);
        self.after_input(i);
    }

    fn schedule_wake(&mut self, i: usize) {
        let Some(core) = self.nodes[i].core.as_ref() else {
            return;
        };
        let Some(at) = core.poll_timeout() else {
            return;
        };
        let at = at.saturating_duration_since(self.base).max(self.now);
        if self.nodes[i].wake.is_none_or(|w| at < w) {
            self.nodes[i].wake = Some(at);
            self.push(at, Ev::Wake { node: i });
        }
    }

    /// A transport reply of node `i`: its bytes counted as the wire would
    /// carry them, then delivered to `to` after a link latency.
    fn reply(
        &mut self,
        i: usize,
        to: usize,
        frame: TcpMsg,
        msg: impl FnOnce(TcpMsg) -> Option<Msg>,
    ) {
        self.sent_frame(i, &frame);
        if let Some(msg) = msg(frame) {
            let at = self.now + self.latency();
            self.push(at, Ev::Deliver { to, msg });
        }
    }

    fn deliver(&mut self, i: usize, msg: Msg) {
        let now = self.base + self.now;
        let source = match &msg {
            Msg::Datagram { from, .. } => self.nodes[*from].id.gossip,
            _ => self.nodes[i].id.gossip,
        };
        let Some(core) = self.nodes[i].core.as_mut() else {
            return;
        };
        match msg {
            Msg::Datagram { plain, .. } => core.handle_datagram(&plain, source, now),
            Msg::PushPullRequest { from, state } => {
                let reply = core.handle_push_pull_request(*state, now);
                self.reply(i, from, TcpMsg::PushPull(reply), |frame| match frame {
                    TcpMsg::PushPull(state) => Some(Msg::PushPullReply {
                        state: Box::new(state),
                    }),
                    _ => None,
                });
            }
            Msg::PushPullReply { state } => core.handle_push_pull_reply(*state, now),
            Msg::MetaRequest { from, node_id } => {
                let rec = core.meta_record(&node_id);
                self.reply(i, from, TcpMsg::MetaReply(rec), |frame| match frame {
                    TcpMsg::MetaReply(rec) => Some(Msg::MetaReply {
                        rec: rec.map(Box::new),
                        node_id,
                    }),
                    _ => None,
                });
            }
            Msg::MetaReply { rec, node_id } => {
                core.handle_meta_fetched(rec.map(|r| *r), &node_id, now);
                let n = &mut self.nodes[i];
                n.fetches_out = n.fetches_out.saturating_sub(1);
            }
            Msg::Seeds => {
                let seeds = self.seeds();
                if let Some(core) = self.nodes[i].core.as_mut() {
                    core.handle_seeds(seeds, now);
                }
            }
        }
        self.drain(i);
        self.after_input(i);
    }

    /// Ordered starts: the next pod comes up once this one is running.
    fn after_input(&mut self, i: usize) {
        if self.cfg.start == Start::Ordered
            && self.next_ordered < self.nodes.len()
            && i + 1 == self.next_ordered
            && self.is_running(i)
        {
            let next = self.next_ordered;
            self.next_ordered += 1;
            self.push(self.now, Ev::Start { node: next });
        }
    }

    fn seeds(&self) -> Vec<SocketAddr> {
        let pods = match self.cfg.seeds {
            Seeds::First => &self.nodes[..1.min(self.nodes.len())],
            _ => &self.nodes[..],
        };
        pods.iter()
            .filter(|n| self.cfg.seeds != Seeds::Service || n.life == Life::Up)
            .map(|n| n.id.gossip)
            .collect()
    }

    fn latency(&mut self) -> Duration {
        let j = self.cfg.jitter.as_nanos() as i64;
        let d = if j > 0 {
            self.rng.random_range(-j..=j)
        } else {
            0
        };
        let l = self.cfg.latency.as_nanos() as i64 + d;
        Duration::from_nanos(l.max(0) as u64)
    }

    fn reachable(&self, from: usize, to: SocketAddr) -> Option<usize> {
        let j = *self.by_addr.get(&to)?;
        (self.nodes[j].life == Life::Up
            && self.nodes[j].group == self.nodes[from].group
            && !self.cut.contains(&(from.min(j), from.max(j))))
        .then_some(j)
    }

    /// Carries out what core `i` asked for.
    fn drain(&mut self, i: usize) {
        while let Some(out) = self.nodes[i].core.as_mut().and_then(Machine::poll_output) {
            match out {
                Output::Send { to, plain } => {
                    self.nodes[i].sent_bytes += (plain.len() + Sealer::overhead()) as u64;
                    plain.len().hash(&mut self.trace);
                    let lost = self.cfg.loss > 0.0 && self.rng.random_bool(self.cfg.loss.min(1.0));
                    let Some(j) = self.reachable(i, to).filter(|_| !lost) else {
                        continue;
                    };
                    let at = self.now + self.latency();
                    self.push(
                        at,
                        Ev::Deliver {
                            to: j,
                            msg: Msg::Datagram { from: i, plain },
                        },
                    );
                }
                Output::PushPull { to, state } => {
                    let msg = TcpMsg::PushPull(state);
                    self.sent_frame(i, &msg);
                    let TcpMsg::PushPull(state) = msg else {
                        continue;
                    };
                    // Refused: the shell logs it and nothing comes back.
                    let Some(j) = self.reachable(i, to.gossip) else {
                        continue;
                    };
                    // Connect, then the request: two trips.
                    let at = self.now + self.latency() + self.latency();
                    self.push(
                        at,
                        Ev::Deliver {
                            to: j,
                            msg: Msg::PushPullRequest {
                                from: i,
                                state: Box::new(state),
                            },
                        },
                    );
                }
                Output::FetchMeta { from, node_id } => {
                    let n = &mut self.nodes[i];
                    n.fetches_out += 1;
                    n.fetches += 1;
                    n.most_fetches_out = n.most_fetches_out.max(n.fetches_out);
                    let msg = TcpMsg::MetaRequest(node_id);
                    self.sent_frame(i, &msg);
                    let TcpMsg::MetaRequest(node_id) = msg else {
                        continue;
                    };
                    let at = self.now + self.latency() + self.latency();
                    let (to, msg) = match self.reachable(i, from.gossip) {
                        Some(j) => (j, Msg::MetaRequest { from: i, node_id }),
                        None => (i, Msg::MetaReply { rec: None, node_id }),
                    };
                    self.push(at, Ev::Deliver { to, msg });
                }
                Output::ResolveSeeds => {
                    self.nodes[i].resolves += 1;
                    self.push(
                        self.now + RESOLVE_DELAY,
                        Ev::Deliver {
                            to: i,
                            msg: Msg::Seeds,
                        },
                    );
                }
                Output::Event(e) => self.on_event(i, e),
            }
        }
    }

    fn sent_frame(&mut self, i: usize, msg: &TcpMsg) {
        let n = frame_bytes(msg) as u64;
        self.nodes[i].sent_bytes += n;
        self.nodes[i].sent_tcp += n;
        self.nodes[i].largest_frame = self.nodes[i].largest_frame.max(n);
    }

    fn on_event(&mut self, i: usize, e: Event) {
        let watched = self.watched_id.as_deref();
        let n = &mut self.nodes[i];
        match e {
            Event::MemberUp(id) if id.node_id != n.id.node_id => n.active += 1,
            Event::MemberDown(id) if id.node_id != n.id.node_id => {
                self.downs += 1;
                n.active = n.active.saturating_sub(1);
                if watched == Some(&*id.node_id) && !n.saw_down {
                    n.saw_down = true;
                    self.saw_down_count += 1;
                }
            }
            Event::Stalled { late } => {
                n.longest_stall = n.longest_stall.max(late);
                n.stalls += 1;
            }
            _ => {}
        }
    }
}

/// Pod `i`'s IP: 10.0.0.1 onwards.
fn pod_ip(i: usize) -> IpAddr {
    let v = (10u32 << 24) + 1 + i as u32;
    IpAddr::V4(Ipv4Addr::from(v))
}

/// Bytes a transport frame takes on the wire: length prefix and seal
/// around the postcard message.
fn frame_bytes(msg: &TcpMsg) -> usize {
    let body = wire::encode(msg).map_or(0, |plain| plain.len());
    FRAME_LEN_BYTES + Sealer::overhead() + body
}
