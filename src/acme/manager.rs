//! The loop that keeps every eligible origin certified on every replica.
//!
//! Each replica runs one [`AcmeManager`]. It
//! - follows the configuration: the eligible keys of `origins` are the
//!   hostnames to certify, re-read on every change (added hosts get a
//!   certificate, removed ones stop being renewed);
//! - delivers: whenever the shared store holds a newer certificate for a
//!   host than the one on disk, it writes `<cert-dir>/<host>/tls.{crt,key}`
//!   and asks the proxy to reload. It learns of new certificates from the
//!   mesh (every node lists the certificates it wrote in its metadata) and,
//!   as a safety net, by reading the store now and then;
//! - orders: a host that has no valid certificate, or whose renewal time
//!   came, is ordered by exactly one replica, its rendezvous owner among the
//!   alive members, under the host's lease lock in the store. After taking
//!   the lock it reads the store again, so a certificate another replica
//!   stored meanwhile is used instead of ordered twice.
//!
//! The decisions are pure ([`due_for_order`]); the async shell only moves
//! records between the store, the CA and the disk.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, Semaphore, mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::acme::account::{AccountSettings, load_or_create};
use crate::acme::certs::{CertRecord, key_matches, parse_chain};
use crate::acme::challenge::ChallengeBook;
use crate::acme::deliver::{read_cert_files, write_cert_files};
use crate::acme::issuer::Issuer;
use crate::acme::keys;
use crate::acme::ownership::owner;
use crate::acme::schedule::{
    AriWindow, CertTimes, Failures, IssuanceHistory, OrderBudget, renew_at,
};
use crate::config::{AcmeSection, SbConfig};
use crate::mesh::seal::KeyRing;
use crate::mesh::{CertificateInfo, MemberState, Mesh};
use crate::metrics::Metrics;
use crate::reload::ReloadTrigger;
use crate::store::lock::{LeaseKeeper, LeaseLock, get_fenced, put_fenced};
use crate::store::{Store, StoreError, now_unix_ms};

/// How the manager behaves; the defaults suit production.
#[derive(Clone, Debug)]
pub struct AcmeManagerConfig {
    /// This replica's node id (the mesh's).
    pub node_id: String,
    /// Where certificates are written for the proxy.
    pub cert_dir: PathBuf,
    /// The cluster key ring: certificate records and account credentials
    /// are sealed with a key derived from it.
    pub key_ring: Option<KeyRing>,
    /// Orders this replica runs at once.
    pub max_concurrent_orders: usize,
    /// New orders the whole cluster may place per account and interval.
    pub max_orders_per_interval: u32,
    /// The interval of `max_orders_per_interval`.
    pub order_interval: Duration,
    /// Lease of a host's order lock; a replica that dies mid-order blocks
    /// the host for at most this long.
    pub order_lock_ttl: Duration,
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
            cert_dir: cert_dir.into(),
            key_ring: None,
            max_concurrent_orders: 8,
            max_orders_per_interval: 300,
            order_interval: Duration::from_secs(3 * 3600),
            order_lock_ttl: Duration::from_secs(60),
            settle: Duration::from_secs(3),
            full_check_every: Duration::from_secs(60),
            missing_check_every: Duration::from_secs(2),
        }
    }
}

/// What this node says about its certificates (in its mesh metadata and
/// thus in every node's `/admin/cluster/status`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcmeStatus {
    /// Certificates written for the proxy, by host.
    pub certificates: Vec<CertificateInfo>,
    /// Origins that cannot be ordered over HTTP-01 (wildcards).
    pub not_eligible: Vec<String>,
    /// Why this node does not order, when it does not.
    pub refusal: Option<String>,
}

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
    /// Asks the proxy to reload after certificate files changed.
    pub reload: ReloadTrigger,
    /// The challenge responder's book, where orders publish key authorizations.
    pub book: Arc<ChallengeBook>,
}

/// A running manager. Dropping it stops the loop (orders in flight are
/// abandoned; their leases expire).
pub struct AcmeManager {
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
    pub fn spawn_into(
        cfg: AcmeManagerConfig,
        inputs: AcmeInputs,
        status: watch::Sender<AcmeStatus>,
    ) -> Self {
        let receiver = status.subscribe();
        let task = tokio::spawn(Runner::new(cfg, inputs, status).run());
        Self {
            status: receiver,
            task,
        }
    }

    /// This node's certificates and ACME state, updated as they change.
    pub fn status(&self) -> watch::Receiver<AcmeStatus> {
        self.status.clone()
    }
}

// ---------------------------------------------------------------------------
// Pure decisions

/// Why a host is not ordered now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Its certificate is valid until the renewal time (unix seconds).
    Valid(u64),
    /// Failures: the next attempt is at this time (unix seconds).
    BackingOff(u64),
    /// The store has not been read for it yet.
    Unchecked,
    /// Another replica owns it.
    NotOwner,
    /// An order is in flight.
    InFlight,
}

/// What the scheduler knows of one host.
#[derive(Clone, Debug, Default)]
pub struct HostView {
    /// The certificate in the store, when one was read.
    pub stored: Option<StoredCert>,
    /// Whether the store was read at least once since the host appeared.
    pub checked: bool,
    /// The failure history of this replica's orders for it.
    pub failures: Failures,
    /// Whether this replica is ordering it now.
    pub in_flight: bool,
}

/// Facts of a stored certificate the scheduler needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredCert {
    /// Serial, lowercase hex.
    pub serial: String,
    /// Validity.
    pub times: CertTimes,
    /// The CA's renewal window, when it offers ARI.
    pub ari: Option<AriWindow>,
}

/// Whether `host` should be ordered by this replica at `now`: `Ok(())` to
/// order, else why not. `is_owner` is the rendezvous verdict.
pub fn due_for_order(
    host: &str,
    view: &HostView,
    is_owner: bool,
    renew_before_days: Option<u32>,
    now: u64,
) -> Result<(), Hold> {
    if view.in_flight {
        return Err(Hold::InFlight);
    }
    if !view.checked {
        return Err(Hold::Unchecked);
    }
    if let Some(stored) = &view.stored {
        let at = renew_at(
            stored.times,
            renew_before_days,
            stored.ari,
            jitter(host, &stored.serial),
        );
        if now < at {
            return Err(Hold::Valid(at));
        }
    }
    if view.failures.count > 0 {
        let next = view.failures.next_attempt_unix();
        if now < next {
            return Err(Hold::BackingOff(next));
        }
    }
    if !is_owner {
        return Err(Hold::NotOwner);
    }
    Ok(())
}

/// Every replica computes the same jitter for a certificate, so they agree
/// on when it is due and only its owner acts.
fn jitter(host: &str, serial: &str) -> f64 {
    let digest = crate::config::sha256_hex(format!("{host}\n{serial}").as_bytes());
    let n = u64::from_str_radix(&digest[..13], 16).unwrap_or(0);
    n as f64 / (1u64 << 52) as f64
}

/// The hosts `config` asks for: eligible origins, lowercased, without a
/// trailing dot, deduplicated; and the wildcards that are not eligible.
pub fn wanted_hosts(config: &SbConfig) -> (BTreeSet<String>, Vec<String>) {
    if !config.acme_enabled() {
        return (BTreeSet::new(), Vec::new());
    }
    let mut hosts = BTreeSet::new();
    let mut wildcards = Vec::new();
    for origin in &config.origins {
        let host = origin.trim_end_matches('.').to_ascii_lowercase();
        if host.contains('*') {
            wildcards.push(origin.clone());
        } else if !host.is_empty() {
            hosts.insert(host);
        }
    }
    (hosts, wildcards)
}

/// Why this node must not order with this store, if it must not.
pub fn local_store_refusal(backend: &str, shared: bool, has_peers: bool) -> Option<String> {
    (!shared && has_peers).then(|| {
        format!(
            "not ordering certificates: this node has peers in the mesh but storage_backend \
             \"{backend}\" is local to this pod, so a challenge sent to another replica could \
             not be answered and each replica would order the same hostnames; use a shared \
             store (file on an RWX volume, redis, s3, gcs or azure)"
        )
    })
}

// ---------------------------------------------------------------------------
// The async shell

/// What the tasks report to the loop.
enum Event {
    /// A store read for `host` finished.
    Stored {
        host: String,
        result: Result<Option<CertRecord>, String>,
    },
    /// An order task ended.
    Ordered { host: String, outcome: OrderOutcome },
    /// The CA's renewal window (ARI) for the certificate `serial` of `host`.
    Ari {
        host: String,
        serial: String,
        window: Option<AriWindow>,
    },
}

/// How long the set of alive members must hold still before orders start.
const VIEW_STABLE_FOR: Duration = Duration::from_secs(1);

/// How often the owner of a host asks the CA for its renewal window when
/// the directory offers ARI (RFC 9773 suggests a few times a day).
const ARI_EVERY: Duration = Duration::from_secs(6 * 3600);

/// How an order task ended.
enum OrderOutcome {
    /// A certificate was issued and stored.
    Issued(Box<CertRecord>),
    /// The store already held a valid certificate (another replica's).
    AlreadyValid(Box<CertRecord>),
    /// Another replica holds the host's lock.
    Busy,
    /// Not allowed before this time: duplicate or order limits.
    Deferred { until: u64, why: String },
    /// It failed.
    Failed {
        error: String,
        retry_after_secs: Option<u64>,
    },
}

/// The certificate on disk.
#[derive(Clone, Debug)]
struct Local {
    serial: String,
    not_after_unix: u64,
}

#[derive(Default)]
struct HostState {
    view: HostView,
    local: Option<Local>,
    /// Serial announced by a peer that we have not read from the store yet.
    wanted_serial: Option<String>,
    fetching: bool,
    next_check: Option<Instant>,
    /// When the CA was last asked for the renewal window, and for which serial.
    ari_asked: Option<(Instant, String)>,
}

struct Runner {
    cfg: AcmeManagerConfig,
    store: Arc<dyn Store>,
    mesh: Mesh,
    metrics: Arc<Metrics>,
    config_rx: watch::Receiver<Arc<SbConfig>>,
    reload: ReloadTrigger,
    book: Arc<ChallengeBook>,
    status_tx: watch::Sender<AcmeStatus>,
    hosts: BTreeMap<String, HostState>,
    not_eligible: Vec<String>,
    acme: Option<AcmeSection>,
    issuer: Arc<Mutex<Option<Arc<Issuer>>>>,
    slots: Arc<Semaphore>,
    events_tx: mpsc::UnboundedSender<Event>,
    events_rx: mpsc::UnboundedReceiver<Event>,
    started: Instant,
    refusal: Option<String>,
    reload_pending: bool,
    last_full_check: Instant,
    /// The alive members at the last step, and since when they are so.
    last_alive: Vec<String>,
    view_changed: Instant,
}

impl Runner {
    fn new(
        cfg: AcmeManagerConfig,
        inputs: AcmeInputs,
        status_tx: watch::Sender<AcmeStatus>,
    ) -> Self {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let slots = Arc::new(Semaphore::new(cfg.max_concurrent_orders.max(1)));
        Self {
            store: inputs.store,
            mesh: inputs.mesh,
            metrics: inputs.metrics,
            config_rx: inputs.config,
            reload: inputs.reload,
            book: inputs.book,
            status_tx,
            hosts: BTreeMap::new(),
            not_eligible: Vec::new(),
            acme: None,
            issuer: Arc::new(Mutex::new(None)),
            slots,
            events_tx,
            events_rx,
            started: Instant::now(),
            refusal: None,
            reload_pending: false,
            last_full_check: Instant::now(),
            last_alive: Vec::new(),
            view_changed: Instant::now(),
            cfg,
        }
    }

    async fn run(mut self) {
        self.apply_config();
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
                Some(event) = self.events_rx.recv() => self.handle(event),
            }
            // Drain whatever else arrived, so one reload covers a batch.
            while let Ok(event) = self.events_rx.try_recv() {
                self.handle(event);
            }
            if self.reload_pending {
                self.reload_pending = false;
                self.reload.certificates_changed();
                self.publish_status();
            }
            self.step().await;
        }
    }

    /// Picks up the hostnames (and ACME settings) of the current config.
    fn apply_config(&mut self) {
        let config = self.config_rx.borrow_and_update().clone();
        let (wanted, wildcards) = wanted_hosts(&config);
        for wildcard in &wildcards {
            if !self.not_eligible.contains(wildcard) {
                warn!(
                    origin = %wildcard,
                    "wildcard origin is not eligible for an HTTP-01 certificate; it will not be ordered"
                );
            }
        }
        self.not_eligible = wildcards;
        let removed: Vec<String> = self
            .hosts
            .keys()
            .filter(|h| !wanted.contains(*h))
            .cloned()
            .collect();
        for host in removed {
            info!(host = %host, "origin removed: its certificate is no longer renewed");
            self.hosts.remove(&host);
            self.metrics.acme.forget_host(&host);
        }
        for host in wanted {
            if self.hosts.contains_key(&host) {
                continue;
            }
            let mut state = HostState::default();
            if let Some((chain, _key)) = read_cert_files(&self.cfg.cert_dir, &host)
                && let Ok(facts) = parse_chain(&chain)
            {
                self.metrics
                    .acme
                    .set_expiry(&host, seconds_left(facts.not_after_unix));
                state.local = Some(Local {
                    serial: facts.serial,
                    not_after_unix: facts.not_after_unix,
                });
            }
            self.hosts.insert(host, state);
        }
        let acme = config.proxy.acme.clone().filter(|a| a.enabled);
        if acme.as_ref().map(issuer_identity) != self.acme.as_ref().map(issuer_identity) {
            // A new directory, contact or trust: the next order builds a new issuer.
            if let Ok(mut issuer) = self.issuer.try_lock() {
                *issuer = None;
            }
        }
        self.acme = acme;
        self.publish_status();
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Stored { host, result } => {
                let Some(state) = self.hosts.get_mut(&host) else {
                    return;
                };
                state.fetching = false;
                match result {
                    Ok(record) => {
                        state.view.checked = true;
                        if let Some(record) = record {
                            self.take_record(&host, record);
                        } else if let Some(state) = self.hosts.get_mut(&host) {
                            state.view.stored = None;
                        }
                    }
                    Err(e) => {
                        debug!(host = %host, error = %e, "certificate store read failed; files left as they are");
                    }
                }
            }
            Event::Ari {
                host,
                serial,
                window,
            } => {
                if let Some(stored) = self
                    .hosts
                    .get_mut(&host)
                    .and_then(|s| s.view.stored.as_mut())
                    .filter(|s| s.serial == serial)
                {
                    if stored.ari != window {
                        debug!(host = %host, ?window, "renewal window from the CA");
                    }
                    stored.ari = window;
                }
            }
            Event::Ordered { host, outcome } => {
                if let Some(state) = self.hosts.get_mut(&host) {
                    state.view.in_flight = false;
                }
                let now = now_unix_ms() / 1000;
                match outcome {
                    OrderOutcome::Issued(record) => {
                        self.metrics.acme.order("issued");
                        info!(host = %host, serial = %record.serial, not_after = record.not_after_unix, "certificate issued");
                        if let Some(state) = self.hosts.get_mut(&host) {
                            state.view.failures.clear();
                        }
                        self.take_record(&host, *record);
                    }
                    OrderOutcome::AlreadyValid(record) => {
                        self.metrics.acme.order("skipped");
                        debug!(host = %host, "another replica stored a valid certificate meanwhile");
                        self.take_record(&host, *record);
                    }
                    OrderOutcome::Busy => {
                        debug!(host = %host, "another replica is ordering it");
                        if let Some(state) = self.hosts.get_mut(&host) {
                            state.next_check = Some(Instant::now() + Duration::from_secs(1));
                        }
                    }
                    OrderOutcome::Deferred { until, why } => {
                        self.metrics.acme.order("skipped");
                        warn!(host = %host, until, "order deferred: {why}");
                        if let Some(state) = self.hosts.get_mut(&host) {
                            state
                                .view
                                .failures
                                .record(now, Some(until.saturating_sub(now)));
                        }
                    }
                    OrderOutcome::Failed {
                        error,
                        retry_after_secs,
                    } => {
                        self.metrics.acme.order("failed");
                        if let Some(state) = self.hosts.get_mut(&host) {
                            state.view.failures.record(now, retry_after_secs);
                            warn!(
                                host = %host,
                                failures = state.view.failures.count,
                                next_attempt_unix = state.view.failures.next_attempt_unix(),
                                "order failed: {error}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A record read from the store (or just issued): remember it, and
    /// write it to disk when it is newer than what the proxy has.
    fn take_record(&mut self, host: &str, record: CertRecord) {
        let Some(state) = self.hosts.get_mut(host) else {
            return;
        };
        state.view.checked = true;
        // The CA's window stays with the certificate it was given for.
        let ari = state
            .view
            .stored
            .as_ref()
            .filter(|s| s.serial == record.serial)
            .and_then(|s| s.ari);
        state.view.stored = Some(StoredCert {
            serial: record.serial.clone(),
            times: CertTimes {
                not_before_unix: record.not_before_unix,
                not_after_unix: record.not_after_unix,
            },
            ari,
        });
        if state.wanted_serial.as_deref() == Some(record.serial.as_str()) {
            state.wanted_serial = None;
        }
        let newer = match &state.local {
            None => true,
            Some(local) => {
                local.serial != record.serial && record.not_after_unix >= local.not_after_unix
            }
        };
        if !newer {
            return;
        }
        match write_cert_files(&self.cfg.cert_dir, host, &record.chain_pem, &record.key_pem) {
            Ok(changed) => {
                state.local = Some(Local {
                    serial: record.serial.clone(),
                    not_after_unix: record.not_after_unix,
                });
                self.metrics
                    .acme
                    .set_expiry(host, seconds_left(record.not_after_unix));
                if changed {
                    info!(host = %host, serial = %record.serial, "certificate written for the proxy");
                    self.reload_pending = true;
                }
            }
            Err(e) => {
                warn!(host = %host, dir = %self.cfg.cert_dir.display(), error = %e, "cannot write certificate files");
            }
        }
    }

    fn publish_status(&self) {
        let certificates = self
            .hosts
            .iter()
            .filter_map(|(host, s)| {
                s.local.as_ref().map(|l| CertificateInfo {
                    host: host.clone(),
                    not_after_unix: l.not_after_unix,
                    serial: l.serial.clone(),
                })
            })
            .collect();
        let status = AcmeStatus {
            certificates,
            not_eligible: self.not_eligible.clone(),
            refusal: self.refusal.clone(),
        };
        self.status_tx.send_if_modified(|s| {
            if *s == status {
                false
            } else {
                *s = status;
                true
            }
        });
    }

    /// One pass: learn from the mesh, read the store where due, order
    /// what this replica owns and is due.
    async fn step(&mut self) {
        if self.hosts.is_empty() {
            return;
        }
        let Some(status) = self.mesh.status().await else {
            return;
        };
        // Peers announce the certificates they wrote: a serial we do not
        // have is a reason to read the store now.
        for node in status.nodes.iter().filter(|n| !n.local) {
            for cert in &node.certificates {
                if let Some(state) = self.hosts.get_mut(&cert.host) {
                    let have = state.local.as_ref().map(|l| l.serial.as_str());
                    let known = state.view.stored.as_ref().map(|s| s.serial.as_str());
                    if have != Some(cert.serial.as_str()) && known != Some(cert.serial.as_str()) {
                        state.wanted_serial = Some(cert.serial.clone());
                    }
                }
            }
        }
        let now_instant = Instant::now();
        let full = now_instant.duration_since(self.last_full_check) >= self.cfg.full_check_every;
        if full {
            self.last_full_check = now_instant;
        }
        let missing_every = self.cfg.missing_check_every;
        let mut reads = Vec::new();
        for (host, state) in &mut self.hosts {
            if state.fetching {
                continue;
            }
            let due_check = state.next_check.is_none_or(|t| now_instant >= t);
            let want = full
                || !state.view.checked
                || state.wanted_serial.is_some()
                || (state.local.is_none() && due_check)
                || (state.next_check.is_some() && due_check);
            if want {
                state.fetching = true;
                state.next_check = state.local.is_none().then(|| now_instant + missing_every);
                reads.push(host.clone());
            }
        }
        for host in reads {
            self.spawn_read(host);
        }

        // Ordering.
        let Some(acme) = self.acme.clone() else {
            return;
        };
        let has_peers = self.mesh.has_peers();
        let refusal = local_store_refusal(self.store.backend(), self.store.is_shared(), has_peers);
        if refusal != self.refusal {
            if let Some(r) = &refusal {
                warn!("{r}");
                self.metrics.acme.order("skipped");
            }
            self.refusal = refusal;
            self.publish_status();
        }
        if self.refusal.is_some() {
            return;
        }
        let alive: Vec<String> = status
            .nodes
            .iter()
            .filter(|n| n.membership_state == MemberState::Alive)
            .map(|n| n.node_id.clone())
            .collect();
        // Ownership is only as good as the view: order once the set of
        // alive members has held still for a moment (members joining at
        // start, or one going down), so that replicas agree on owners.
        if alive != self.last_alive {
            self.last_alive = alive.clone();
            self.view_changed = Instant::now();
        }
        let stable = self.view_changed.elapsed() >= VIEW_STABLE_FOR;
        let settled = has_peers || self.started.elapsed() >= self.cfg.settle;
        if !(stable && settled) {
            return;
        }
        let members: Vec<&str> = alive.iter().map(String::as_str).collect();
        let now = now_unix_ms() / 1000;
        self.ask_ari(&members);
        let mut to_order = Vec::new();
        for (host, state) in &self.hosts {
            let is_owner = owner(host, &members) == Some(self.cfg.node_id.as_str());
            if due_for_order(host, &state.view, is_owner, acme.renew_before_days, now).is_ok() {
                to_order.push(host.clone());
            }
        }
        for host in to_order {
            let Ok(permit) = self.slots.clone().try_acquire_owned() else {
                break;
            };
            let known = self.hosts.get_mut(&host).and_then(|state| {
                state.view.in_flight = true;
                state.view.stored.clone()
            });
            let job = OrderJob {
                known,
                host: host.clone(),
                node_id: self.cfg.node_id.clone(),
                store: self.store.clone(),
                metrics: self.metrics.clone(),
                ring: self.cfg.key_ring.clone(),
                lock_ttl: self.cfg.order_lock_ttl,
                budget: (self.cfg.max_orders_per_interval, self.cfg.order_interval),
                renew_before_days: acme.renew_before_days,
                acme: acme.clone(),
                issuer: self.issuer.clone(),
                book: self.book.clone(),
            };
            let events = self.events_tx.clone();
            tokio::spawn(async move {
                let outcome = job.run().await;
                drop(permit);
                let _ = events.send(Event::Ordered { host, outcome });
            });
        }
    }

    /// The owner of a host asks the CA for its renewal window (ARI) when
    /// the directory offers it: at each new certificate, then every
    /// [`ARI_EVERY`]. Only once an issuer exists (the account is loaded).
    fn ask_ari(&mut self, members: &[&str]) {
        let Some(issuer) = self.issuer.try_lock().ok().and_then(|i| i.clone()) else {
            return;
        };
        if !issuer.offers_ari() {
            return;
        }
        let now = Instant::now();
        for (host, state) in &mut self.hosts {
            let Some(stored) = &state.view.stored else {
                continue;
            };
            if owner(host, members) != Some(self.cfg.node_id.as_str()) {
                continue;
            }
            let fresh = state.ari_asked.as_ref().is_some_and(|(at, serial)| {
                *serial == stored.serial && now.duration_since(*at) < ARI_EVERY
            });
            if fresh {
                continue;
            }
            state.ari_asked = Some((now, stored.serial.clone()));
            let (store, ring, events) = (
                self.store.clone(),
                self.cfg.key_ring.clone(),
                self.events_tx.clone(),
            );
            let (host, serial, issuer) = (host.clone(), stored.serial.clone(), issuer.clone());
            tokio::spawn(async move {
                let Ok(Some(record)) = read_record(store.as_ref(), ring.as_ref(), &host).await
                else {
                    return;
                };
                if record.serial != serial {
                    return;
                }
                let window =
                    issuer
                        .renewal_window(&record.chain_pem)
                        .await
                        .map(|(start_unix, end_unix)| AriWindow {
                            start_unix,
                            end_unix,
                        });
                let _ = events.send(Event::Ari {
                    host,
                    serial,
                    window,
                });
            });
        }
    }

    fn spawn_read(&self, host: String) {
        let store = self.store.clone();
        let ring = self.cfg.key_ring.clone();
        let events = self.events_tx.clone();
        tokio::spawn(async move {
            let result = read_record(store.as_ref(), ring.as_ref(), &host)
                .await
                .map_err(|e| e.to_string());
            let _ = events.send(Event::Stored { host, result });
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

/// Reads and checks the certificate record of `host`: `None` when there is
/// none; an error when it cannot be read or is not usable (corrupt, wrong
/// host, key not matching).
async fn read_record(
    store: &dyn Store,
    ring: Option<&KeyRing>,
    host: &str,
) -> Result<Option<CertRecord>, StoreError> {
    let key = keys::certificate(host);
    let Some(entry) = get_fenced(store, &key).await? else {
        return Ok(None);
    };
    let record = CertRecord::decode(ring, &key, &entry.value)?;
    check_record(host, &record).map_err(|message| StoreError::Corrupt {
        key: key.clone(),
        message,
    })?;
    Ok(Some(record))
}

/// A record is used only when it is what it claims: the host's, with a
/// key that matches the leaf.
fn check_record(host: &str, record: &CertRecord) -> Result<(), String> {
    if record.host != host {
        return Err(format!("record is for {:?}, not {host:?}", record.host));
    }
    let facts = parse_chain(&record.chain_pem).map_err(|e| e.to_string())?;
    if !facts.dns_names.iter().any(|n| n.eq_ignore_ascii_case(host)) {
        return Err(format!("certificate does not name {host:?}"));
    }
    match key_matches(&record.chain_pem, &record.key_pem) {
        Ok(true) => Ok(()),
        Ok(false) => Err("private key does not match the certificate".to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// One order, from lock to stored certificate.
struct OrderJob {
    host: String,
    node_id: String,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    ring: Option<KeyRing>,
    lock_ttl: Duration,
    budget: (u32, Duration),
    renew_before_days: Option<u32>,
    /// The certificate the scheduler saw when it decided to order.
    known: Option<StoredCert>,
    acme: AcmeSection,
    issuer: Arc<Mutex<Option<Arc<Issuer>>>>,
    book: Arc<ChallengeBook>,
}

impl OrderJob {
    async fn run(self) -> OrderOutcome {
        let lock = LeaseLock::new(self.store.clone(), &keys::order_lock(&self.host))
            .with_metrics(self.metrics.clone());
        let lease = match lock.try_acquire(&self.node_id, self.lock_ttl).await {
            Ok(Some(lease)) => lease,
            Ok(None) => return OrderOutcome::Busy,
            Err(e) => return failed(format!("order lock: {e}"), None),
        };
        let keeper = LeaseKeeper::spawn(lock, lease);
        let outcome = self.locked(&keeper).await;
        if let Err(e) = keeper.release().await {
            debug!(host = %self.host, error = %e, "order lock not released; it expires by itself");
        }
        outcome
    }

    async fn locked(&self, keeper: &LeaseKeeper) -> OrderOutcome {
        let now = now_unix_ms() / 1000;
        // Another replica may have stored a certificate between our last
        // read and the lock: use it rather than order a second one.
        match read_record(self.store.as_ref(), self.ring.as_ref(), &self.host).await {
            Ok(Some(record)) => {
                let times = CertTimes {
                    not_before_unix: record.not_before_unix,
                    not_after_unix: record.not_after_unix,
                };
                // The CA's window applies to the certificate it was given for.
                let ari = self
                    .known
                    .as_ref()
                    .filter(|k| k.serial == record.serial)
                    .and_then(|k| k.ari);
                let at = renew_at(
                    times,
                    self.renew_before_days,
                    ari,
                    jitter(&self.host, &record.serial),
                );
                if now < at {
                    return OrderOutcome::AlreadyValid(Box::new(record));
                }
            }
            Ok(None) => {}
            Err(StoreError::Corrupt { message, .. }) => {
                warn!(host = %self.host, "stored certificate unusable ({message}); ordering a new one");
            }
            Err(e) => return failed(format!("reading the store: {e}"), None),
        }
        let hosts = vec![self.host.clone()];
        let dir_id = keys::directory_id(&self.acme.directory_url);
        let history_key = keys::issued(&dir_id, &keys::hostname_set_id(&hosts));
        if let Err(until) = check_history(self.store.as_ref(), &history_key, now).await {
            return OrderOutcome::Deferred {
                until,
                why: format!(
                    "this hostname set was issued {} times in the last 7 days (the CA's duplicate limit)",
                    crate::acme::schedule::DUPLICATE_LIMIT
                ),
            };
        }
        let budget_key = keys::order_budget(&dir_id);
        match take_budget(self.store.as_ref(), &budget_key, self.budget, now).await {
            Ok(Ok(())) => {}
            Ok(Err(until)) => {
                return OrderOutcome::Deferred {
                    until,
                    why: format!(
                        "the cluster placed its {} new orders of this interval",
                        self.budget.0
                    ),
                };
            }
            Err(e) => return failed(format!("order budget: {e}"), None),
        }
        let issuer = match self.issuer().await {
            Ok(issuer) => issuer,
            Err((error, retry_after)) => return failed(error, retry_after),
        };
        let issued = match issuer.order(&hosts, Some(keeper.held())).await {
            Ok(issued) => issued,
            Err(e) => {
                let retry_after = e.retry_after().map(|d| d.as_secs());
                return failed(e.to_string(), retry_after);
            }
        };
        let facts = match parse_chain(&issued.chain_pem) {
            Ok(f) => f,
            Err(e) => return failed(format!("the CA's certificate: {e}"), None),
        };
        let record = CertRecord {
            host: self.host.clone(),
            hosts: facts.dns_names.clone(),
            chain_pem: issued.chain_pem,
            key_pem: issued.key_pem,
            not_before_unix: facts.not_before_unix,
            not_after_unix: facts.not_after_unix,
            serial: facts.serial,
            issued_at_unix: now_unix_ms() / 1000,
            issued_by: self.node_id.clone(),
        };
        let key = keys::certificate(&self.host);
        let bytes = match record.encode(self.ring.as_ref(), &key) {
            Ok(b) => b,
            Err(e) => return failed(e.to_string(), None),
        };
        if let Err(e) = put_fenced(self.store.as_ref(), &key, &bytes, &keeper.lease()).await {
            return failed(format!("storing the certificate: {e}"), None);
        }
        if let Err(e) = record_issuance(self.store.as_ref(), &history_key, now).await {
            warn!(host = %self.host, error = %e, "issuance history not recorded");
        }
        OrderOutcome::Issued(Box::new(record))
    }

    /// The shared issuer, built (and the account loaded or created) on
    /// first use.
    async fn issuer(&self) -> Result<Arc<Issuer>, (String, Option<u64>)> {
        let mut slot = self.issuer.lock().await;
        if let Some(issuer) = slot.as_ref() {
            return Ok(issuer.clone());
        }
        let holder = format!("{}/{}", self.node_id, std::process::id());
        let account = load_or_create(
            &self.store,
            self.ring.as_ref(),
            &AccountSettings::from_config(&self.acme),
            &holder,
        )
        .await
        .map_err(|e| {
            (
                format!("ACME account: {e}"),
                e.retry_after().map(|d| d.as_secs()),
            )
        })?;
        info!(account = %account.id(), directory = %account.directory_url(), "ACME account ready");
        let issuer = Arc::new(Issuer::new(
            account,
            self.book.clone(),
            self.node_id.clone(),
        ));
        *slot = Some(issuer.clone());
        Ok(issuer)
    }
}

fn failed(error: String, retry_after_secs: Option<u64>) -> OrderOutcome {
    OrderOutcome::Failed {
        error,
        retry_after_secs,
    }
}

async fn check_history(store: &dyn Store, key: &str, now: u64) -> Result<(), u64> {
    match store.get(key).await {
        Ok(Some(entry)) => match serde_json::from_slice::<IssuanceHistory>(&entry.value) {
            Ok(history) => history.allows(now),
            Err(_) => Ok(()),
        },
        // The guard must not block issuance when the store hiccups: the
        // order itself goes through the store again right after.
        _ => Ok(()),
    }
}

async fn record_issuance(store: &dyn Store, key: &str, now: u64) -> Result<(), StoreError> {
    update_json(store, key, |history: Option<IssuanceHistory>| {
        let mut history = history.unwrap_or_default();
        history.record(now);
        Ok::<_, std::convert::Infallible>(history)
    })
    .await
    .map(|_| ())
}

async fn take_budget(
    store: &dyn Store,
    key: &str,
    (max, interval): (u32, Duration),
    now: u64,
) -> Result<Result<(), u64>, StoreError> {
    update_json(store, key, |budget: Option<OrderBudget>| {
        // A changed limit starts a fresh budget.
        let mut budget = budget
            .filter(|b| b.max_orders == max && b.interval_secs == interval.as_secs())
            .unwrap_or_else(|| OrderBudget::new(max, interval.as_secs()));
        budget.try_take(now).map(|()| budget)
    })
    .await
}

/// Read-modify-write of the JSON record at `key` by compare-and-swap,
/// again while other replicas win the race. `change` gets the current value
/// (`None` when absent or unreadable) and returns the one to write, or an
/// `Err` to write nothing.
async fn update_json<T, E>(
    store: &dyn Store,
    key: &str,
    mut change: impl FnMut(Option<T>) -> Result<T, E>,
) -> Result<Result<(), E>, StoreError>
where
    T: Serialize + serde::de::DeserializeOwned,
{
    for _ in 0..32 {
        let current = store.get(key).await?;
        let value = current
            .as_ref()
            .and_then(|e| serde_json::from_slice::<T>(&e.value).ok());
        let next = match change(value) {
            Ok(next) => next,
            Err(e) => return Ok(Err(e)),
        };
        let bytes = serde_json::to_vec(&next).map_err(|e| StoreError::Corrupt {
            key: key.to_owned(),
            message: format!("cannot encode: {e}"),
        })?;
        let written = match &current {
            None => store.put_if_absent(key, &bytes, None).await?,
            Some(e) => {
                store
                    .compare_and_swap(key, &e.version, &bytes, None)
                    .await?
            }
        };
        if written.is_some() {
            return Ok(Ok(()));
        }
    }
    Err(StoreError::Backend {
        backend: "acme",
        message: format!("{key}: compare-and-swap kept losing; too much contention"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(not_before: u64, not_after: u64) -> StoredCert {
        StoredCert {
            serial: "01".into(),
            times: CertTimes {
                not_before_unix: not_before,
                not_after_unix: not_after,
            },
            ari: None,
        }
    }

    #[test]
    fn an_unchecked_host_is_never_ordered() {
        let view = HostView::default();
        assert_eq!(
            due_for_order("a.test", &view, true, None, 1_000),
            Err(Hold::Unchecked)
        );
    }

    #[test]
    fn a_missing_certificate_is_ordered_by_its_owner_only() {
        let view = HostView {
            checked: true,
            ..HostView::default()
        };
        assert_eq!(due_for_order("a.test", &view, true, None, 1_000), Ok(()));
        assert_eq!(
            due_for_order("a.test", &view, false, None, 1_000),
            Err(Hold::NotOwner)
        );
    }

    #[test]
    fn a_valid_certificate_waits_for_its_renewal_time() {
        let day = 86_400;
        let view = HostView {
            checked: true,
            stored: Some(stored(0, 90 * day)),
            ..HostView::default()
        };
        match due_for_order("a.test", &view, true, None, 10 * day) {
            Err(Hold::Valid(at)) => assert!(at > 10 * day && at < 90 * day),
            other => panic!("{other:?}"),
        }
        assert_eq!(due_for_order("a.test", &view, true, None, 89 * day), Ok(()));
        assert_eq!(
            due_for_order("a.test", &view, true, Some(30), 50 * day),
            Err(Hold::Valid(renew_at(
                view.stored.as_ref().unwrap().times,
                Some(30),
                None,
                jitter("a.test", "01")
            )))
        );
    }

    #[test]
    fn failures_back_off_and_in_flight_blocks() {
        let mut view = HostView {
            checked: true,
            ..HostView::default()
        };
        view.failures.record(1_000, None);
        assert!(matches!(
            due_for_order("a.test", &view, true, None, 1_001),
            Err(Hold::BackingOff(_))
        ));
        assert_eq!(due_for_order("a.test", &view, true, None, 100_000), Ok(()));
        view.in_flight = true;
        assert_eq!(
            due_for_order("a.test", &view, true, None, 100_000),
            Err(Hold::InFlight)
        );
    }

    #[test]
    fn every_replica_computes_the_same_jitter() {
        assert_eq!(jitter("a.test", "0a"), jitter("a.test", "0a"));
        assert_ne!(jitter("a.test", "0a"), jitter("a.test", "0b"));
        for i in 0..1000 {
            let j = jitter(&format!("h{i}.test"), "01");
            assert!((0.0..1.0).contains(&j));
        }
    }

    #[test]
    fn wanted_hosts_normalise_and_report_wildcards() {
        let config = crate::config::parse(
            "proxy:\n  acme: { enabled: true, email: a@b.c }\norigins:\n  \"API.example.com.\": {}\n  \"*.example.com\": {}\n  \"b.example.com\": {}\n",
        )
        .unwrap();
        let (hosts, wildcards) = wanted_hosts(&config);
        assert_eq!(
            hosts.into_iter().collect::<Vec<_>>(),
            vec!["api.example.com".to_owned(), "b.example.com".to_owned()]
        );
        assert_eq!(wildcards, vec!["*.example.com".to_owned()]);
        let disabled = crate::config::parse("origins:\n  a.example.com: {}\n").unwrap();
        assert!(wanted_hosts(&disabled).0.is_empty());
    }

    #[test]
    fn a_pod_local_store_with_peers_refuses() {
        assert!(local_store_refusal("redb", false, false).is_none());
        assert!(local_store_refusal("redis", true, true).is_none());
        let msg = local_store_refusal("redb", false, true).unwrap();
        assert!(
            msg.contains("\"redb\"") && msg.contains("shared store"),
            "{msg}"
        );
    }
}
