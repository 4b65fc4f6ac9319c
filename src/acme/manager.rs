//! The loop that keeps every eligible origin certified on every replica.
//!
//! Each replica runs one [`AcmeManager`]. It keeps a set of certificate
//! *units* ([`CertUnit`]: an id, the names, where the files go), built from
//! the configuration by [`wanted_units`]: with `certificates: per_host`
//! one unit per eligible origin, with `certificates: san` one unit for all
//! of them. For every unit it
//! - follows the configuration: re-read on every change (added hosts get a
//!   certificate, removed ones stop being renewed; in `san` mode a changed
//!   origin set is a new unit, ordered once, while the old certificate's
//!   files keep being served until the new ones are written);
//! - writes a self-signed placeholder for the unit's names before the
//!   first real certificate exists on disk ([`crate::acme::placeholder`]),
//!   so a proxy that needs its files at start-up can start; the real
//!   certificate replaces it exactly as a renewal does;
//! - delivers: whenever the shared store holds a newer certificate for a
//!   unit than the one on disk, it writes `<cert-dir>/<host>/tls.{crt,key}`
//!   (per host) or `<cert-dir>/tls.{crt,key}` (san) and calls
//!   `certificates_changed`. It learns of new certificates from the mesh
//!   (every node lists the certificates it wrote in its metadata) and, as a
//!   safety net, by reading the store now and then;
//! - orders: a unit that has no valid certificate, or whose renewal time
//!   came, is ordered by exactly one replica, the rendezvous owner of the
//!   unit id among the alive members, under the unit's lease lock in the
//!   store. After taking the lock it reads the store again, so a
//!   certificate another replica stored meanwhile is used instead of
//!   ordered twice.
//!
//! The decisions are pure: what to read, order, ask the CA about and
//! write as a placeholder is decided by the state machine in
//! [`crate::acme::machine`] (from the mesh's members and announced serials,
//! the configuration, the answers of the store, CA and disk tasks, and a
//! clock passed in), over the unit model of [`crate::acme::unit`].
//!
//! This file is the shell around it: the public handle ([`AcmeManager`],
//! its [`AcmeManagerConfig`] and [`AcmeInputs`]) and the `Runner`, which
//! gathers the machine's inputs and executes its actions. The tasks it
//! spawns for them are `acme/order.rs`'s (an order, a renewal
//! window question, a reseal) and `acme/unit_files.rs`'s (the
//! files on disk); they answer with typed values
//! ([`crate::acme::outcome`]).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{Mutex, Semaphore, mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::acme::account::one_line;
use crate::acme::certs::CertRecord;
use crate::acme::challenge::ChallengeBook;
use crate::acme::issuer::Issuer;
use crate::acme::layout;
use crate::acme::machine::{Action, Input, Machine, Now, Ordering, Report, Settings, StoredCert};
use crate::acme::order::{AriTask, Dns01Slot, OrderJob, Reseal, read_record_sealed};
use crate::acme::outcome::{OrderError, OrderOutcome};
use crate::acme::reach::ReachCheck;
use crate::acme::schedule::Failures;
use crate::acme::unit::{AcmeStatus, CertUnit, UnitFiles, wanted_units};
use crate::acme::unit_files::{self, read_local, write_placeholder};
use crate::config::{AcmeSection, SbConfig};
use crate::flags;
use crate::http::passthrough::Upstream;
use crate::keyring::KeyRing;
use crate::mesh::{MemberState, Mesh};
use crate::metrics::Metrics;
use crate::store::sealed::AtRestRing;
use crate::store::{Store, now_unix_ms};

/// How much ordering a fleet may do, and where its challenges are checked
/// first: the `--acme-*` settings of the sidecar, whose defaults are the
/// flag table's ([`Flag`](crate::Flag)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcmeLimits {
    /// Orders this replica runs at once (`--acme-concurrent-orders`).
    pub concurrent_orders: usize,
    /// New orders the whole cluster may place per account and interval
    /// (`--acme-max-orders`).
    pub max_orders: u32,
    /// The interval of `max_orders` (`--acme-orders-interval-secs`).
    pub orders_interval: Duration,
    /// Lease of a host's order lock; a replica that dies mid-order blocks
    /// the host for at most this long (`--acme-order-lock-ttl-secs`).
    pub order_lock_ttl: Duration,
    /// Where the CA's HTTP-01 request lands, as reached from this node
    /// (`--acme-check-url`): before an order reaches the CA, a probe token
    /// published to the store must be answered there
    /// (docs/reference.md#the-challenge-check). `None` in a `NodeConfig`:
    /// this node's own challenge listener (`challenge_listen`) is asked;
    /// `None` for the manager (no listener either): nothing is checked.
    pub check_url: Option<Upstream>,
    /// The recursive resolvers DNS-01 asks for a name's CNAMEs, its zone
    /// and the zone's name servers (`--acme-dns-resolvers`); empty: the
    /// `nameserver`s of `/etc/resolv.conf`.
    pub dns_resolvers: Vec<std::net::SocketAddr>,
}

impl Default for AcmeLimits {
    fn default() -> Self {
        Self {
            concurrent_orders: flags::DEFAULT_ACME_CONCURRENT_ORDERS,
            max_orders: flags::DEFAULT_ACME_MAX_ORDERS,
            orders_interval: flags::DEFAULT_ACME_ORDERS_INTERVAL,
            order_lock_ttl: flags::DEFAULT_ACME_ORDER_LOCK_TTL,
            check_url: None,
            dns_resolvers: Vec::new(),
        }
    }
}

/// How the manager behaves; the defaults suit production.
#[derive(Clone, Debug)]
pub struct AcmeManagerConfig {
    /// This replica's node id (the mesh's).
    pub node_id: String,
    /// Random per process start: with the node id it makes this process's
    /// lock holder id (`AcmeManagerConfig::holder_id`), so a restarted
    /// pod tells its own previous leases from those of live replicas.
    pub boot_id: String,
    /// Where certificates are written for the proxy.
    pub cert_dir: PathBuf,
    /// The cluster key ring: certificate records and account credentials
    /// are sealed with a key derived from it. It follows the mesh's ring
    /// (the key file) when built with `AtRestRing::following`.
    pub key_ring: AtRestRing,
    /// How much ordering the fleet may do.
    pub limits: AcmeLimits,
    /// Pause after start before a node with no peer orders alone, so the
    /// mesh view (and with it ownership) has formed. With peers, orders
    /// start once the set of alive members has held still for 1 s.
    pub settle: Duration,
    /// Every host's store record is read this often, whatever the mesh
    /// says (the safety net).
    pub full_check_every: Duration,
    /// Hosts without a certificate on disk are looked up this often.
    pub missing_check_every: Duration,
}

impl AcmeManagerConfig {
    /// Production defaults for `node_id` writing into `cert_dir`.
    pub fn new(node_id: impl Into<String>, cert_dir: impl Into<PathBuf>) -> Self {
        Self {
            node_id: node_id.into(),
            boot_id: format!("{:016x}", rand::random::<u64>()),
            cert_dir: cert_dir.into(),
            key_ring: AtRestRing::plain(),
            limits: AcmeLimits::default(),
            settle: Duration::from_secs(3),
            full_check_every: Duration::from_secs(60),
            missing_check_every: Duration::from_secs(2),
        }
    }

    /// The holder id of this process's leases: `<node id>/<boot id>`.
    pub(crate) fn holder_id(&self) -> String {
        format!("{}/{}", self.node_id, self.boot_id)
    }
}

/// What the manager calls after it wrote new certificate files.
pub(crate) type CertificatesChanged = Arc<dyn Fn() + Send + Sync>;

/// The manager's inputs.
pub struct AcmeInputs {
    /// The shared certificate store.
    pub store: Arc<dyn Store>,
    /// The mesh: alive members decide ownership, peers' metadata announce
    /// new certificates.
    pub mesh: Mesh,
    /// Where counters go.
    pub metrics: Arc<Metrics>,
    /// The current configuration; a change is picked up at once.
    pub config: watch::Receiver<Arc<SbConfig>>,
    /// Called after certificate files changed, to hand them to the proxy
    /// (a reload POST, a restart, or nothing: the sidecar's
    /// `--proxy-cert-apply`).
    pub certificates_changed: CertificatesChanged,
    /// The challenge responder's book, where orders publish key authorizations.
    pub book: Arc<ChallengeBook>,
}

/// A running manager. Dropping it stops the loop (orders in flight are
/// abandoned; their leases expire).
pub struct AcmeManager {
    /// For tests; the node reads the channel it made itself.
    status: watch::Receiver<AcmeStatus>,
    task: JoinHandle<()>,
}

impl Drop for AcmeManager {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl AcmeManager {
    /// Starts the loop.
    pub fn spawn(cfg: AcmeManagerConfig, inputs: AcmeInputs) -> Self {
        Self::spawn_into(cfg, inputs, watch::channel(AcmeStatus::default()).0)
    }

    /// Starts the loop, publishing its status into `status` (a channel the
    /// caller made before the manager could start, e.g. before the store
    /// opened).
    pub(crate) fn spawn_into(
        cfg: AcmeManagerConfig,
        inputs: AcmeInputs,
        status: watch::Sender<AcmeStatus>,
    ) -> Self {
        Self {
            status: status.subscribe(),
            task: tokio::spawn(Runner::new(cfg, inputs, status).run()),
        }
    }

    /// This node's certificates and ACME state, updated as they change.
    pub fn status(&self) -> watch::Receiver<AcmeStatus> {
        self.status.clone()
    }
}

// ---------------------------------------------------------------------------
// The Runner: the async shell around the machine

/// Least time between two reseals of one replica: after a key rotation
/// every record is rewritten once, by whichever replica gets to it first,
/// spread out so that the store sees a trickle (a reseal is about six
/// operations), not a burst.
const RESEAL_PACE: Duration = Duration::from_secs(1);

/// Failed orders are logged at warn at most once per this interval: one
/// line with the count and a few examples (each unit's at debug), so a CA
/// that is down does not write one line per origin.
const FAILURE_SUMMARY_EVERY: Duration = Duration::from_secs(30);
/// Units named in a summary line.
const FAILURE_EXAMPLES: usize = 3;

/// The failed (or deferred) orders not yet summarised.
struct FailedOrders {
    /// What happened to them: "failed" or "deferred".
    what: &'static str,
    count: usize,
    /// The first few: unit id, its failure count, its next attempt, the error.
    examples: Vec<(String, u32, u64, String)>,
    last_summary: Option<Instant>,
}

impl FailedOrders {
    fn new(what: &'static str) -> Self {
        Self {
            what,
            count: 0,
            examples: Vec::new(),
            last_summary: None,
        }
    }

    fn note(&mut self, id: &str, failures: &Failures, error: &str) {
        self.count += 1;
        if self.examples.len() < FAILURE_EXAMPLES {
            self.examples.push((
                id.to_owned(),
                failures.count,
                failures.next_attempt_unix(),
                error.to_owned(),
            ));
        }
    }

    /// Logs what was noted, when the last line is old enough (the first
    /// failure after a quiet spell is logged at once).
    fn summarise(&mut self, now: Instant) {
        if self.count == 0
            || self
                .last_summary
                .is_some_and(|at| now.duration_since(at) < FAILURE_SUMMARY_EVERY)
        {
            return;
        }
        self.last_summary = Some(now);
        let count = std::mem::take(&mut self.count);
        let examples = std::mem::take(&mut self.examples);
        let Some((id, failures, next_attempt_unix, error)) = examples.first() else {
            return;
        };
        let what = self.what;
        if count == 1 {
            warn!(unit = %id, failures, next_attempt_unix, "order {what}: {error}");
        } else {
            let units: Vec<&str> = examples.iter().map(|e| e.0.as_str()).collect();
            warn!(
                count,
                examples = %units.join(", "),
                "{count} orders {what} (each tried again later; per unit at debug); {id}: {error}"
            );
        }
    }
}

/// The mesh as the machine was last told it.
struct MeshSeen {
    /// [`Mesh::view_changes`] when the status was read.
    changes: u64,
    alive: Vec<String>,
    has_peers: bool,
    skew_isolated: bool,
}

/// The async shell around [`Machine`]: it gathers the machine's inputs
/// (the mesh's view, the configuration, the answers of its tasks), feeds
/// them in, and executes the actions (store reads, orders, ARI questions,
/// file writes, status, logs and metrics).
struct Runner {
    cfg: AcmeManagerConfig,
    store: Arc<dyn Store>,
    mesh: Mesh,
    metrics: Arc<Metrics>,
    config_rx: watch::Receiver<Arc<SbConfig>>,
    certificates_changed: CertificatesChanged,
    book: Arc<ChallengeBook>,
    status_tx: watch::Sender<AcmeStatus>,
    machine: Machine,
    not_eligible: Vec<String>,
    acme: Option<AcmeSection>,
    issuer: Arc<Mutex<Option<Arc<Issuer>>>>,
    /// The DNS-01 provider, built by the first DNS-01 order of a `dns01` block.
    dns01: Dns01Slot,
    /// One reseal at a time, [`RESEAL_PACE`] apart (see `spawn_read`).
    reseals: Arc<Semaphore>,
    /// What the machine was last told about ARI.
    ari_offered: bool,
    /// What the machine was last told about the mesh: the status (every
    /// member's record parsed) is read again only when the view moved.
    mesh_seen: Option<MeshSeen>,
    events_tx: mpsc::UnboundedSender<Input>,
    events_rx: mpsc::UnboundedReceiver<Input>,
    reload_pending: bool,
    failed_orders: FailedOrders,
    deferred_orders: FailedOrders,
    /// The challenge check of every order, when there is one.
    reach: Option<Arc<ReachCheck>>,
}

/// The ring after its next change; never, once nobody can change it (a
/// fixed ring's sender is gone) or there is none.
async fn next_ring(rings: &mut Option<watch::Receiver<Arc<KeyRing>>>) -> Option<Arc<KeyRing>> {
    let Some(rx) = rings else {
        return std::future::pending().await;
    };
    if rx.changed().await.is_err() {
        *rings = None;
        return std::future::pending().await;
    }
    Some(Arc::clone(&rx.borrow_and_update()))
}

/// The shell's clock, read once per input.
fn now() -> Now {
    Now {
        mono: Instant::now(),
        unix_ms: now_unix_ms(),
    }
}

impl Runner {
    fn new(
        cfg: AcmeManagerConfig,
        inputs: AcmeInputs,
        status_tx: watch::Sender<AcmeStatus>,
    ) -> Self {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let settings = Settings {
            node_id: cfg.node_id.clone(),
            max_concurrent_orders: cfg.limits.concurrent_orders.max(1),
            settle: cfg.settle,
            full_check_every: cfg.full_check_every,
            missing_check_every: cfg.missing_check_every,
            store_backend: inputs.store.backend().to_owned(),
            store_shared: inputs.store.is_shared(),
        };
        let reach = cfg
            .limits
            .check_url
            .clone()
            .map(|target| Arc::new(ReachCheck::new(target, inputs.metrics.clone())));
        Self {
            reach,
            store: inputs.store,
            mesh: inputs.mesh,
            metrics: inputs.metrics,
            config_rx: inputs.config,
            certificates_changed: inputs.certificates_changed,
            book: inputs.book,
            status_tx,
            machine: Machine::new(settings, now()),
            not_eligible: Vec::new(),
            acme: None,
            issuer: Arc::new(Mutex::new(None)),
            dns01: Dns01Slot::default(),
            reseals: Arc::new(Semaphore::new(1)),
            ari_offered: false,
            mesh_seen: None,
            events_tx,
            events_rx,
            reload_pending: false,
            failed_orders: FailedOrders::new("failed"),
            deferred_orders: FailedOrders::new("deferred"),
            cfg,
        }
    }

    async fn run(mut self) {
        self.apply_config();
        let mut rings = self.cfg.key_ring.subscribe();
        let mut primary = self.cfg.key_ring.current().map(|r| r.primary_id());
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                changed = self.config_rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    self.apply_config();
                }
                Some(input) = self.events_rx.recv() => self.answer(input),
                Some(ring) = next_ring(&mut rings) => {
                    let now_primary = Some(ring.primary_id());
                    if now_primary != primary {
                        primary = now_primary;
                        self.feed(Input::KeyRingChanged);
                    }
                }
            }
            // Drain whatever else arrived, so one pass covers a batch.
            while let Ok(input) = self.events_rx.try_recv() {
                self.answer(input);
            }
            self.failed_orders.summarise(Instant::now());
            self.deferred_orders.summarise(Instant::now());
            self.observe_mesh().await;
            self.feed(Input::Tick);
            if self.reload_pending {
                self.reload_pending = false;
                (self.certificates_changed)();
            }
        }
    }

    /// Feeds `input` and executes the actions; the answers of the actions
    /// done in place (file writes) are fed right after.
    fn feed(&mut self, input: Input) {
        let mut queue = VecDeque::from([input]);
        while let Some(input) = queue.pop_front() {
            for action in self.machine.step(input, now()) {
                queue.extend(self.execute(action));
            }
        }
    }

    /// Picks up the units (and ACME settings) of the current config.
    fn apply_config(&mut self) {
        let config = self.config_rx.borrow_and_update().clone();
        let (wanted, wildcards) = wanted_units(&config);
        for wildcard in &wildcards {
            // The config's own warnings say it at warn level (at start-up
            // and with every reload): once is enough.
            if !self.not_eligible.contains(wildcard) {
                debug!(
                    origin = %wildcard,
                    "wildcard origin is not eligible for an HTTP-01 certificate; it will not be ordered"
                );
            }
        }
        self.not_eligible = wildcards.clone();
        let acme = config.acme().cloned();
        if acme.as_ref().map(issuer_identity) != self.acme.as_ref().map(issuer_identity) {
            // A new directory, contact or trust: the next order builds a new issuer.
            if let Ok(mut issuer) = self.issuer.try_lock() {
                *issuer = None;
            }
        }
        let ordering = acme.as_ref().map(|a| Ordering {
            renew_before_days: a.renew_before_days,
        });
        self.acme = acme;
        let units = wanted
            .into_iter()
            .map(|unit| {
                let local = read_local(&unit, &self.cfg.cert_dir);
                (unit, local)
            })
            .collect();
        self.feed(Input::ConfigChanged {
            units,
            not_eligible: wildcards,
            ordering,
        });
        // A pass right away: new units are read, and the status shows
        // their placeholders at once.
        self.feed(Input::Tick);
    }

    /// Logs and counts an answer of a task, then feeds it.
    fn answer(&mut self, input: Input) {
        match &input {
            Input::RecordRead { id, result: Err(e) } => {
                debug!(unit = %id, error = %e, "certificate store read failed; files left as they are");
            }
            Input::AriAnswered { id, window, .. } => {
                debug!(unit = %id, ?window, "renewal window from the CA");
            }
            Input::OrderFinished { id, outcome } => match outcome {
                OrderOutcome::Issued(record) => {
                    self.metrics.acme.order("issued");
                    info!(unit = %id, names = record.hosts.len(), serial = %record.serial, not_after = record.not_after_unix, "certificate issued");
                }
                OrderOutcome::AlreadyValid(_) => {
                    self.metrics.acme.order("skipped");
                    debug!(unit = %id, "another replica stored a valid certificate meanwhile");
                }
                OrderOutcome::Busy { wait } => {
                    debug!(unit = %id, wait_ms = wait.as_millis() as u64, "another replica holds the order lock");
                }
                // Not an order: nothing reached the CA (the report logs it).
                OrderOutcome::Unanswered(why) => debug!(unit = %id, "challenge check: {why}"),
                OrderOutcome::BackingOff(failures) => debug!(
                    unit = %id,
                    failures = failures.count,
                    next_attempt_unix = failures.next_attempt_unix(),
                    "backing off as the shared failure record says"
                ),
                OrderOutcome::Deferred { until, why, .. } => {
                    self.metrics.acme.order("skipped");
                    debug!(unit = %id, until, "order deferred: {why}");
                }
                OrderOutcome::Failed { error, .. } => {
                    self.metrics.acme.order("failed");
                    let error = error.to_string();
                    debug!(unit = %id, "order failed: {}", one_line(&error));
                }
            },
            _ => {}
        }
        self.feed(input);
    }

    /// Tells the machine what the mesh sees: the alive members, the
    /// certificates the peers announce, whether clock skew cuts this node
    /// off; and whether the CA offers renewal information.
    async fn observe_mesh(&mut self) {
        if let Some(offered) = self
            .issuer
            .try_lock()
            .ok()
            .map(|i| i.as_ref().is_some_and(|i| i.offers_ari()))
            .filter(|offered| *offered != self.ari_offered)
        {
            self.ari_offered = offered;
            self.feed(Input::AriOffered(offered));
        }
        if self.machine.is_empty() {
            return;
        }
        let changes = self.mesh.view_changes();
        let has_peers = self.mesh.has_peers();
        let isolation = self.mesh.clock_skew_isolation();
        if let Some(isolation) = &isolation {
            debug!(
                ?isolation,
                "not ordering: this node is cut off from the mesh by clock skew"
            );
        }
        let skew_isolated = isolation.is_some();
        if let Some(seen) = self.mesh_seen.as_mut().filter(|s| s.changes == changes) {
            if (seen.has_peers, seen.skew_isolated) != (has_peers, skew_isolated) {
                (seen.has_peers, seen.skew_isolated) = (has_peers, skew_isolated);
                let alive = seen.alive.clone();
                self.feed(Input::Members {
                    alive,
                    has_peers,
                    skew_isolated,
                });
            }
            return;
        }
        let Some(status) = self.mesh.status().await else {
            return;
        };
        let alive: Vec<String> = status
            .nodes
            .iter()
            .filter(|n| n.membership_state == MemberState::Alive)
            .map(|n| n.node_id.clone())
            .collect();
        self.feed(Input::Members {
            alive: alive.clone(),
            has_peers,
            skew_isolated,
        });
        self.mesh_seen = Some(MeshSeen {
            changes,
            alive,
            has_peers,
            skew_isolated,
        });
        let certs = status
            .nodes
            .into_iter()
            .filter(|n| !n.local)
            .flat_map(|n| n.certificates)
            .collect();
        self.feed(Input::PeerCerts(certs));
    }

    /// Does what the machine asked; the answer of what is done in place.
    fn execute(&mut self, action: Action) -> Option<Input> {
        match action {
            Action::Report(report) => self.report(report),
            Action::ReadRecord(unit) => self.spawn_read(unit),
            Action::InstallRecord { unit, record } => return Some(self.install(&unit, &record)),
            Action::WritePlaceholder(unit) => {
                let result = write_placeholder(&unit, &self.cfg.cert_dir, now_unix_ms() / 1000);
                match &result {
                    Ok(_) => {
                        info!(unit = %unit.id, names = unit.names.len(), "placeholder certificate written until the CA's arrives");
                    }
                    Err(e) => {
                        warn!(unit = %unit.id, dir = %self.cfg.cert_dir.display(), error = %e, "cannot write a placeholder certificate");
                    }
                }
                return Some(Input::PlaceholderWritten {
                    id: unit.id,
                    result,
                });
            }
            Action::PlaceOrder {
                unit,
                known,
                renew_before_days,
            } => self.spawn_order(unit, known, renew_before_days),
            Action::AskAri { unit, serial } => self.spawn_ari(unit, serial),
            Action::ResealAccount => self.spawn_account_reseal(),
            Action::CertificatesChanged => self.reload_pending = true,
            Action::PublishStatus(status) => {
                let waiting = i64::try_from(status.waiting.len()).unwrap_or(i64::MAX);
                self.metrics.acme.orders_waiting.set(waiting);
                self.status_tx.send_if_modified(|s| {
                    if *s == status {
                        false
                    } else {
                        *s = status;
                        true
                    }
                });
            }
        }
        None
    }

    fn report(&mut self, report: Report) {
        match report {
            Report::UnitRemoved(unit) => {
                match &unit.files {
                    UnitFiles::Host(host) => {
                        info!(host = %host, "origin removed: its certificate is no longer renewed");
                    }
                    UnitFiles::San => info!(
                        unit = %unit.id,
                        names = unit.names.len(),
                        "origin set changed: the SAN certificate of the old set is no longer renewed; \
                         its files are served until the new set's certificate is written"
                    ),
                }
                for name in &unit.names {
                    self.metrics.acme.forget_host(name);
                }
            }
            Report::UnitAdded(unit) => {
                if let UnitFiles::San = unit.files {
                    info!(unit = %unit.id, names = ?unit.names, "SAN certificate unit");
                }
            }
            Report::Expiry {
                names,
                not_after_unix,
            } => {
                for name in &names {
                    self.metrics
                        .acme
                        .set_expiry(name, seconds_left(not_after_unix));
                }
            }
            Report::Refusal(refusal) => {
                if let Some(r) = refusal {
                    warn!("{r}");
                    self.metrics.acme.order("skipped");
                }
            }
            Report::Waiting { id, reason } => match reason {
                Some(reason) => warn!(unit = %id, "order waits: {reason}"),
                None => {
                    info!(unit = %id, "order no longer waits: its challenge was answered where the CA's request lands")
                }
            },
            Report::OrderFailed {
                id,
                deferred,
                failures,
                error,
            } => {
                let orders = if deferred {
                    &mut self.deferred_orders
                } else {
                    &mut self.failed_orders
                };
                orders.note(&id, &failures, &one_line(&error));
            }
            Report::RenewBeforeIgnored {
                unit,
                serial,
                days,
                lifetime_secs,
            } => warn!(
                host = %unit.record_host(),
                unit = %unit.id,
                serial = %serial,
                renew_before_days = days,
                lifetime_days = lifetime_secs as f64 / 86_400.0,
                "renew_before_days is at least half of this certificate's lifetime; \
                 renewing when one third of its lifetime remains instead"
            ),
        }
    }

    /// Writes a record's certificate as the unit's files.
    fn install(&self, unit: &CertUnit, record: &CertRecord) -> Input {
        let result = unit_files::install(unit, &self.cfg.cert_dir, record);
        match &result {
            Ok((_, true)) => {
                info!(unit = %unit.id, serial = %record.serial, "certificate written for the proxy");
            }
            Ok((_, false)) => {}
            Err(e) => {
                warn!(unit = %unit.id, dir = %self.cfg.cert_dir.display(), error = %e, "cannot write certificate files");
            }
        }
        Input::Installed {
            id: unit.id.clone(),
            result,
        }
    }

    fn spawn_order(
        &self,
        unit: CertUnit,
        known: Option<StoredCert>,
        renew_before_days: Option<u32>,
    ) {
        let id = unit.id.clone();
        let events = self.events_tx.clone();
        let Some(acme) = self.acme.clone() else {
            // The machine orders only with an `acme` section; should the
            // two ever disagree, the unit is free again at once.
            let _ = events.send(Input::OrderFinished {
                id,
                outcome: OrderOutcome::Failed {
                    error: OrderError::NoAcmeSection,
                    shared: None,
                },
            });
            return;
        };
        let job = OrderJob {
            known,
            unit,
            node_id: self.cfg.node_id.clone(),
            holder: self.cfg.holder_id(),
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            ring: self.cfg.key_ring.clone(),
            limits: self.cfg.limits.clone(),
            renew_before_days,
            acme,
            issuer: self.issuer.clone(),
            book: self.book.clone(),
            reach: self.reach.clone(),
            dns01: self.dns01.clone(),
        };
        tokio::spawn(async move {
            let outcome = job.run().await;
            let _ = events.send(Input::OrderFinished { id, outcome });
        });
    }

    /// Asks the CA for a unit's renewal window (ARI), through the shared
    /// state; only once an issuer exists (the account is loaded).
    fn spawn_ari(&self, unit: CertUnit, serial: String) {
        let Some(issuer) = self.issuer.try_lock().ok().and_then(|i| i.clone()) else {
            return;
        };
        let Some(acme) = &self.acme else {
            return;
        };
        let dir_id = layout::directory_id(&acme.directory_url);
        let task = AriTask {
            store: self.store.clone(),
            ring: self.cfg.key_ring.clone(),
            events: self.events_tx.clone(),
            state_key: layout::order_state(&dir_id, &layout::hostname_set_id(&unit.names)),
            id: unit.id.clone(),
            unit,
            serial,
            issuer,
        };
        tokio::spawn(task.run());
    }

    /// After a key rotation, moves the account record to the new primary
    /// key (see [`crate::acme::account::reseal_account`]); a no-op read
    /// otherwise, once per full check.
    fn spawn_account_reseal(&self) {
        let (Some(acme), Some(ring)) = (&self.acme, self.cfg.key_ring.current()) else {
            return;
        };
        let (store, ring_handle, metrics) = (
            self.store.clone(),
            self.cfg.key_ring.clone(),
            self.metrics.clone(),
        );
        let directory_url = acme.directory_url.clone();
        tokio::spawn(async move {
            if let Err(e) =
                crate::acme::account::reseal_account(store.as_ref(), &ring, &directory_url).await
            {
                ring_handle.report(&e, &metrics);
                debug!(error = %e, "ACME account record not resealed; tried again at the next full check");
            }
        });
    }

    fn spawn_read(&self, unit: CertUnit) {
        let store = self.store.clone();
        let ring = self.cfg.key_ring.clone();
        let metrics = self.metrics.clone();
        let events = self.events_tx.clone();
        // Any replica that can reseal does (the owner's key file may lag),
        // under this process's holder id so that this node's own orders
        // recognise the lease; paced, so a rotation is a trickle.
        let (holder, lock_ttl) = (self.cfg.holder_id(), self.cfg.limits.order_lock_ttl);
        let reseals = self.reseals.clone();
        tokio::spawn(async move {
            let current = ring.current();
            let result = read_record_sealed(store.as_ref(), current.as_deref(), &unit).await;
            let stale_key = match (&result, &current) {
                (Ok(Some((_, Some(key_id)))), Some(current)) => *key_id != current.primary_id(),
                _ => false,
            };
            let result = result.map(|r| r.map(|(record, _)| record));
            if let Err(e) = &result {
                ring.report(e, &metrics);
            }
            let _ = events.send(Input::RecordRead {
                id: unit.id.clone(),
                result,
            });
            let Some(current) = current.filter(|_| stale_key) else {
                return;
            };
            let Ok(_permit) = reseals.acquire().await else {
                return;
            };
            let reseal = Reseal {
                store: &store,
                ring: &current,
                unit: &unit,
                holder: &holder,
                lock_ttl,
                metrics: &metrics,
            };
            if let Err(e) = reseal.run().await {
                debug!(unit = %unit.id, error = %e, "certificate record not resealed; tried again at the next read");
            }
            tokio::time::sleep(RESEAL_PACE).await;
        });
    }
}

fn seconds_left(not_after_unix: u64) -> i64 {
    not_after_unix as i64 - (now_unix_ms() / 1000) as i64
}

/// The parts of the ACME settings an issuer is built from.
fn issuer_identity(acme: &AcmeSection) -> String {
    format!(
        "{}\n{:?}\n{:?}\n{}",
        acme.directory_url,
        acme.ca_root,
        acme.email,
        acme.eab.as_ref().map(|e| e.kid.as_str()).unwrap_or("")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acme::order::is_own_predecessor;

    #[test]
    fn a_pod_recognises_its_own_previous_process() {
        let me = "proxy-0/00aa";
        assert!(is_own_predecessor("proxy-0/11bb", "proxy-0", me));
        assert!(!is_own_predecessor(me, "proxy-0", me));
        assert!(!is_own_predecessor("proxy-1/11bb", "proxy-0", me));
        assert!(!is_own_predecessor("proxy-01/11bb", "proxy-0", me));
        // The bare node id of an older version: not recognisably ours.
        assert!(!is_own_predecessor("proxy-0", "proxy-0", me));
        assert!(!is_own_predecessor("proxy-0/", "proxy-0", me));
        let a = AcmeManagerConfig::new("proxy-0", "/certs");
        let b = AcmeManagerConfig::new("proxy-0", "/certs");
        assert!(a.holder_id().starts_with("proxy-0/"));
        assert_ne!(a.holder_id(), b.holder_id(), "a boot id per start");
        assert!(is_own_predecessor(
            &a.holder_id(),
            "proxy-0",
            &b.holder_id()
        ));
    }
}
