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
//! [`crate::acme::plan`] (from the mesh's members and announced serials,
//! the configuration, the answers of the store, CA and disk tasks, and a
//! clock passed in), with [`wanted_units`], [`due_for_order`] and
//! [`CertUnit::names_fit`]. The async shell here gathers those inputs and
//! executes the machine's actions: it moves records between the store,
//! the CA and the disk.

use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, Semaphore, mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use crate::acme::account::{AccountSettings, load_or_create, one_line};
use crate::acme::certs::{CertRecord, key_matches, parse_chain};
use crate::acme::challenge::ChallengeBook;
use crate::acme::deliver::{host_dir, read_pair, write_pair};
use crate::acme::issuer::{Issuer, certificate_identifier};
use crate::acme::keys;
use crate::acme::placeholder::is_placeholder;
use crate::acme::plan::{
    Action, Input, Local, Machine, Now, OrderOutcome, Ordering, Report, Settings,
};
pub use crate::acme::plan::{Hold, HostView, StoredCert, due_for_order};
use crate::acme::plan::{jitter, needs_placeholder};
use crate::acme::schedule::{
    AriCheck, AriWindow, CertTimes, Failures, IssuanceHistory, OrderBudget, UnitOrderState,
    ari_next_check, renew_at,
};
use crate::config::{AcmeSection, CertificateMode, SbConfig};
use crate::keyring::KeyRing;
use crate::mesh::{CertificateInfo, MemberState, Mesh};
use crate::metrics::Metrics;
use crate::store::lock::{Lease, LeaseKeeper, LeaseLock, get_fenced, put_fenced};
use crate::store::sealed::{AtRestRing, sealed_key_id};
use crate::store::{Store, StoreError, now_unix_ms};

/// Orders one replica runs at once, by default (`--acme-concurrent-orders`).
pub const DEFAULT_MAX_CONCURRENT_ORDERS: usize = 8;
/// New orders the whole cluster may place per account and interval, by
/// default (`--acme-max-orders`).
pub const DEFAULT_MAX_ORDERS_PER_INTERVAL: u32 = 300;
/// The interval of [`DEFAULT_MAX_ORDERS_PER_INTERVAL`] (`--acme-orders-interval-secs`).
pub const DEFAULT_ORDER_INTERVAL: Duration = Duration::from_secs(3 * 3600);
/// The lease of a host's order lock, by default (`--acme-order-lock-ttl-secs`).
pub const DEFAULT_ORDER_LOCK_TTL: Duration = Duration::from_secs(60);

/// How the manager behaves; the defaults suit production.
#[derive(Clone, Debug)]
pub struct AcmeManagerConfig {
    /// This replica's node id (the mesh's).
    pub node_id: String,
    /// Random per process start: with the node id it makes this process's
    /// lock holder id ([`AcmeManagerConfig::holder_id`]), so a restarted
    /// pod tells its own previous leases from those of live replicas.
    pub boot_id: String,
    /// Where certificates are written for the proxy.
    pub cert_dir: PathBuf,
    /// The cluster key ring: certificate records and account credentials
    /// are sealed with a key derived from it. It follows the mesh's ring
    /// (the key file) when built with [`AtRestRing::following`].
    pub key_ring: AtRestRing,
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
            boot_id: format!("{:016x}", rand::random::<u64>()),
            cert_dir: cert_dir.into(),
            key_ring: AtRestRing::plain(),
            max_concurrent_orders: DEFAULT_MAX_CONCURRENT_ORDERS,
            max_orders_per_interval: DEFAULT_MAX_ORDERS_PER_INTERVAL,
            order_interval: DEFAULT_ORDER_INTERVAL,
            order_lock_ttl: DEFAULT_ORDER_LOCK_TTL,
            settle: Duration::from_secs(3),
            full_check_every: Duration::from_secs(60),
            missing_check_every: Duration::from_secs(2),
        }
    }

    /// The holder id of this process's leases: `<node id>/<boot id>`.
    pub fn holder_id(&self) -> String {
        format!("{}/{}", self.node_id, self.boot_id)
    }
}

/// Whether the lease holder `holder` is a previous process of the node
/// `node_id` (same node id, another boot id), as opposed to `me` itself
/// or another node. A StatefulSet pod name runs once at a time, so that
/// process is dead and its lease can be taken over at once.
pub fn is_own_predecessor(holder: &str, node_id: &str, me: &str) -> bool {
    holder != me
        && holder
            .strip_prefix(node_id)
            .and_then(|rest| rest.strip_prefix('/'))
            .is_some_and(|boot| !boot.is_empty() && !boot.contains('/'))
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

/// What the manager calls after it wrote new certificate files.
pub type CertificatesChanged = Arc<dyn Fn() + Send + Sync>;

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

/// Where a unit's files go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UnitFiles {
    /// `<cert-dir>/<host>/tls.{crt,key}` (`certificates: per_host`).
    Host(String),
    /// `<cert-dir>/tls.{crt,key}` (`certificates: san`).
    San,
}

/// One certificate the manager keeps ordered, stored and on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertUnit {
    /// Stable id: the hostname (per host) or [`keys::san_unit_id`] of the
    /// name set (san). Ownership (rendezvous hashing), the renewal jitter
    /// and the manager's bookkeeping go by it.
    pub id: String,
    /// The names to order, lowercase; sorted and deduplicated for a SAN
    /// unit. Never empty.
    pub names: Vec<String>,
    /// Where the files go.
    pub files: UnitFiles,
}

impl CertUnit {
    /// The unit of one host (`certificates: per_host`).
    pub fn per_host(host: &str) -> Self {
        Self {
            id: host.to_owned(),
            names: vec![host.to_owned()],
            files: UnitFiles::Host(host.to_owned()),
        }
    }

    /// The SAN unit of `names` (sorted and deduplicated here); `None` when
    /// there are none.
    pub fn san(names: impl IntoIterator<Item = String>) -> Option<Self> {
        let names: Vec<String> = names
            .into_iter()
            .map(|n| n.to_ascii_lowercase())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        if names.is_empty() {
            return None;
        }
        Some(Self {
            id: keys::san_unit_id(&keys::hostname_set_id(&names)),
            names,
            files: UnitFiles::San,
        })
    }

    /// The name its store record is filed under ([`CertRecord::host`]) and
    /// status lists as `host`: the host, or the first of the SAN names.
    pub fn record_host(&self) -> &str {
        &self.names[0]
    }

    /// Its certificate record in the store.
    pub fn store_key(&self) -> String {
        match &self.files {
            UnitFiles::Host(host) => keys::certificate(host),
            UnitFiles::San => keys::san_certificate(&keys::hostname_set_id(&self.names)),
        }
    }

    /// Its order lock.
    pub fn lock_name(&self) -> String {
        match &self.files {
            UnitFiles::Host(host) => keys::order_lock(host),
            UnitFiles::San => keys::san_order_lock(&keys::hostname_set_id(&self.names)),
        }
    }

    /// The directory of its `tls.crt` and `tls.key`.
    pub fn dir(&self, cert_dir: &Path) -> std::io::Result<PathBuf> {
        match &self.files {
            UnitFiles::Host(host) => host_dir(cert_dir, host),
            UnitFiles::San => Ok(cert_dir.to_owned()),
        }
    }

    /// Whether a certificate naming `dns_names` serves this unit: one that
    /// names the host (per host), or exactly the unit's names (san: a
    /// certificate of another origin set is the old one, to replace).
    pub fn names_fit(&self, dns_names: &[String]) -> bool {
        match &self.files {
            UnitFiles::Host(host) => dns_names.iter().any(|n| n.eq_ignore_ascii_case(host)),
            UnitFiles::San => {
                let got: BTreeSet<String> =
                    dns_names.iter().map(|n| n.to_ascii_lowercase()).collect();
                got.len() == self.names.len() && got.iter().eq(self.names.iter())
            }
        }
    }

    /// Whether a peer's status entry announces a certificate of this unit
    /// (a placeholder never does).
    pub fn announced_by(&self, info: &CertificateInfo) -> bool {
        if info.placeholder {
            return false;
        }
        match &self.files {
            UnitFiles::Host(host) => info.host == *host,
            UnitFiles::San if info.names.is_empty() => {
                self.names.len() == 1 && info.host == self.names[0]
            }
            UnitFiles::San => self.names_fit(&info.names),
        }
    }
}

/// The units `config` asks for, and the wildcards that are not eligible:
/// one unit per eligible origin (`per_host`), or one for all of them
/// (`san`; none when there is no eligible origin). The config layer
/// refuses more than [`crate::config::MAX_SAN_NAMES`] names for `san`.
pub fn wanted_units(config: &SbConfig) -> (Vec<CertUnit>, Vec<String>) {
    let (mut hosts, wildcards) = config.acme_hostnames();
    // In name order, whatever the file's order, as every replica sees them.
    hosts.sort();
    let units = match config.certificate_mode() {
        CertificateMode::PerHost => hosts.iter().map(|h| CertUnit::per_host(h)).collect(),
        CertificateMode::San => CertUnit::san(hosts).into_iter().collect(),
    };
    (units, wildcards)
}

/// Writes a self-signed placeholder for `unit` into `cert_dir`.
fn write_placeholder(unit: &CertUnit, cert_dir: &Path, now: u64) -> Result<Local, String> {
    let (chain, key) =
        crate::acme::placeholder::generate(&unit.names, now).map_err(|e| e.to_string())?;
    let dir = unit.dir(cert_dir).map_err(|e| e.to_string())?;
    write_pair(&dir, &chain, &key).map_err(|e| e.to_string())?;
    let facts = parse_chain(&chain).map_err(|e| e.to_string())?;
    Ok(Local {
        serial: facts.serial,
        not_after_unix: facts.not_after_unix,
        names: facts.dns_names,
        placeholder: true,
    })
}

/// Writes a placeholder for every certificate `config` asks for that has
/// nothing usable in `cert_dir` yet, before anything else runs: a proxy
/// that reads its certificate files at start-up (sbproxy with
/// `tls_cert_file`) can then start while the store, the mesh and the CA
/// are still on their way. The manager does the same later for new
/// origins. Returns the units written, or the first error.
pub fn write_startup_placeholders(config: &SbConfig, cert_dir: &Path) -> Result<usize, String> {
    let now = now_unix_ms() / 1000;
    let mut written = 0;
    for unit in wanted_units(config).0 {
        if needs_placeholder(&unit, read_local(&unit, cert_dir).as_ref(), now) {
            write_placeholder(&unit, cert_dir, now).map_err(|e| format!("{}: {e}", unit.id))?;
            written += 1;
        }
    }
    Ok(written)
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

/// Least time between two reseals of one replica: after a key rotation
/// every record is rewritten once, by whichever replica gets to it first,
/// spread out so that the store sees a trickle (a reseal is about six
/// operations), not a burst.
const RESEAL_PACE: Duration = Duration::from_secs(1);

/// Reads what is on disk for `unit`.
fn read_local(unit: &CertUnit, cert_dir: &Path) -> Option<Local> {
    let (chain, _key) = read_pair(&unit.dir(cert_dir).ok()?)?;
    let facts = parse_chain(&chain).ok()?;
    Some(Local {
        placeholder: is_placeholder(&chain),
        serial: facts.serial,
        not_after_unix: facts.not_after_unix,
        names: facts.dns_names,
    })
}

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
            max_concurrent_orders: cfg.max_concurrent_orders.max(1),
            settle: cfg.settle,
            full_check_every: cfg.full_check_every,
            missing_check_every: cfg.missing_check_every,
            store_backend: inputs.store.backend().to_owned(),
            store_shared: inputs.store.is_shared(),
        };
        Self {
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
                    debug!(unit = %id, "order failed: {error}");
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
                orders.note(&id, &failures, &error);
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
        let written = unit
            .dir(&self.cfg.cert_dir)
            .and_then(|dir| write_pair(&dir, &record.chain_pem, &record.key_pem));
        let result = match written {
            Ok(changed) => {
                if changed {
                    info!(unit = %unit.id, serial = %record.serial, "certificate written for the proxy");
                }
                let local = Local {
                    serial: record.serial.clone(),
                    not_after_unix: record.not_after_unix,
                    names: record.hosts.clone(),
                    placeholder: false,
                };
                Ok((local, changed))
            }
            Err(e) => {
                warn!(unit = %unit.id, dir = %self.cfg.cert_dir.display(), error = %e, "cannot write certificate files");
                Err(e.to_string())
            }
        };
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
                outcome: failed("no acme section in the configuration".into(), None),
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
            lock_ttl: self.cfg.order_lock_ttl,
            budget: (self.cfg.max_orders_per_interval, self.cfg.order_interval),
            renew_before_days,
            acme,
            issuer: self.issuer.clone(),
            book: self.book.clone(),
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
        let dir_id = keys::directory_id(&acme.directory_url);
        let task = AriTask {
            store: self.store.clone(),
            ring: self.cfg.key_ring.clone(),
            events: self.events_tx.clone(),
            state_key: keys::order_state(&dir_id, &keys::hostname_set_id(&unit.names)),
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
        let (holder, lock_ttl) = (self.cfg.holder_id(), self.cfg.order_lock_ttl);
        let reseals = self.reseals.clone();
        tokio::spawn(async move {
            let current = ring.current();
            let result = read_record_sealed(store.as_ref(), current.as_deref(), &unit).await;
            let stale_key = match (&result, &current) {
                (Ok(Some((_, Some(key_id)))), Some(current)) => *key_id != current.primary_id(),
                _ => false,
            };
            let result = result.map(|r| r.map(|(record, _)| record)).map_err(|e| {
                ring.report(&e, &metrics);
                e.to_string()
            });
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

/// One question to the CA for a certificate's renewal window, through
/// the shared state: a fresh answer in the store (another replica's, or
/// an earlier process's, with the CA's `Retry-After`) is used instead of
/// asking again; a new answer is stored for the others.
struct AriTask {
    store: Arc<dyn Store>,
    ring: AtRestRing,
    events: mpsc::UnboundedSender<Input>,
    state_key: String,
    id: String,
    unit: CertUnit,
    serial: String,
    issuer: Arc<Issuer>,
}

impl AriTask {
    async fn run(self) {
        let now = now_unix_ms() / 1000;
        let shared = read_json::<UnitOrderState>(self.store.as_ref(), &self.state_key).await;
        if let Ok(Some(state)) = &shared
            && let Some(check) = state.fresh_ari(&self.serial, now)
        {
            self.report(check.window, check.next_check_unix);
            return;
        }
        let ring = self.ring.current();
        let Ok(Some(record)) = read_record(self.store.as_ref(), ring.as_deref(), &self.unit).await
        else {
            return;
        };
        if record.serial != self.serial {
            return;
        }
        let (window, retry_after) = match self.issuer.renewal_info(&record.chain_pem).await {
            Ok(Some(w)) => (
                Some(AriWindow {
                    start_unix: w.start_unix,
                    end_unix: w.end_unix,
                }),
                Some(w.check_again_after.as_secs()),
            ),
            Ok(None) => (None, None),
            Err(e) => {
                warn!(unit = %self.id, error = %one_line(&e.to_string()), "ACME renewal information unavailable");
                (None, e.retry_after().map(|d| d.as_secs()))
            }
        };
        let next_check_unix = ari_next_check(now, retry_after);
        let check = AriCheck {
            serial: self.serial.clone(),
            window,
            next_check_unix,
        };
        let stored = update_json(
            self.store.as_ref(),
            &self.state_key,
            |s: Option<UnitOrderState>| {
                let mut s = s.unwrap_or_default();
                s.ari = Some(check.clone());
                Ok::<_, std::convert::Infallible>(s)
            },
        )
        .await;
        if let Err(e) = stored {
            debug!(unit = %self.id, error = %e, "renewal information not shared");
        }
        self.report(window, next_check_unix);
    }

    fn report(&self, window: Option<AriWindow>, next_check_unix: u64) {
        let _ = self.events.send(Input::AriAnswered {
            id: self.id.clone(),
            serial: self.serial.clone(),
            window,
            next_check_unix,
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

/// Reads and checks the certificate record of `unit`: `None` when there is
/// none; an error when it cannot be read or is not usable (corrupt, wrong
/// names, key not matching).
async fn read_record(
    store: &dyn Store,
    ring: Option<&KeyRing>,
    unit: &CertUnit,
) -> Result<Option<CertRecord>, StoreError> {
    Ok(read_record_sealed(store, ring, unit)
        .await?
        .map(|(record, _)| record))
}

/// [`read_record`], with the ring key id the record is sealed under
/// (`None`: a plain record).
async fn read_record_sealed(
    store: &dyn Store,
    ring: Option<&KeyRing>,
    unit: &CertUnit,
) -> Result<Option<(CertRecord, Option<u32>)>, StoreError> {
    let key = unit.store_key();
    let Some(entry) = get_fenced(store, &key).await? else {
        return Ok(None);
    };
    let record = CertRecord::decode(ring, &key, &entry.value)?;
    check_record(unit, &record).map_err(|message| StoreError::Corrupt {
        key: key.clone(),
        message,
    })?;
    Ok(Some((record, sealed_key_id(&entry.value))))
}

/// Rewrites a certificate record sealed under an older ring key under the
/// primary, so that the old key can leave the key file (the operator drops
/// it after its grace period) without leaving the record unreadable to
/// the next pod. Under the unit's order lock, and only while the record is
/// still the one read: a replica ordering the unit holds the lock (this
/// one then leaves the record alone), and the fenced write cannot undo a
/// newer certificate.
struct Reseal<'a> {
    store: &'a Arc<dyn Store>,
    ring: &'a KeyRing,
    unit: &'a CertUnit,
    holder: &'a str,
    lock_ttl: Duration,
    metrics: &'a Arc<Metrics>,
}

impl Reseal<'_> {
    /// Whether the record was rewritten.
    async fn run(&self) -> Result<bool, StoreError> {
        let lock = LeaseLock::new(self.store.clone(), &self.unit.lock_name())
            .with_metrics(self.metrics.clone());
        let Some(lease) = lock.try_acquire(self.holder, self.lock_ttl).await? else {
            return Ok(false);
        };
        let written = self.locked(&lease).await;
        if let Err(e) = lock.release(&lease).await {
            debug!(unit = %self.unit.id, error = %e, "order lock not released; it expires by itself");
        }
        written
    }

    async fn locked(&self, lease: &crate::store::lock::Lease) -> Result<bool, StoreError> {
        let key = self.unit.store_key();
        let Some(entry) = get_fenced(self.store.as_ref(), &key).await? else {
            return Ok(false);
        };
        let Some(from) = sealed_key_id(&entry.value) else {
            return Ok(false);
        };
        let to = self.ring.primary_id();
        if from == to {
            return Ok(false);
        }
        let record = CertRecord::decode(Some(self.ring), &key, &entry.value)?;
        let bytes = record.encode(Some(self.ring), &key)?;
        put_fenced(self.store.as_ref(), &key, &bytes, lease).await?;
        info!(
            unit = %self.unit.id,
            from_key_id = %format!("{from:08x}"),
            to_key_id = %format!("{to:08x}"),
            "certificate record resealed under the primary cluster key"
        );
        Ok(true)
    }
}

/// A record is used only when it is what it claims: the unit's (filed
/// under its host; a certificate naming the host, or for a SAN unit
/// exactly its names), with a key that matches the leaf.
fn check_record(unit: &CertUnit, record: &CertRecord) -> Result<(), String> {
    let host = unit.record_host();
    if record.host != host {
        return Err(format!("record is for {:?}, not {host:?}", record.host));
    }
    let facts = parse_chain(&record.chain_pem).map_err(|e| e.to_string())?;
    if !unit.names_fit(&facts.dns_names) {
        return Err(match unit.files {
            UnitFiles::Host(_) => format!("certificate does not name {host:?}"),
            UnitFiles::San => format!(
                "certificate names {:?}, not exactly the {} names of the set",
                facts.dns_names,
                unit.names.len()
            ),
        });
    }
    match key_matches(&record.chain_pem, &record.key_pem) {
        Ok(true) => Ok(()),
        Ok(false) => Err("private key does not match the certificate".to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// One order, from lock to stored certificate.
struct OrderJob {
    unit: CertUnit,
    node_id: String,
    /// This process's lock holder id (`<node id>/<boot id>`).
    holder: String,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    ring: AtRestRing,
    lock_ttl: Duration,
    budget: (u32, Duration),
    renew_before_days: Option<u32>,
    /// The certificate the scheduler saw when it decided to order.
    known: Option<StoredCert>,
    acme: AcmeSection,
    issuer: Arc<Mutex<Option<Arc<Issuer>>>>,
    book: Arc<ChallengeBook>,
}

/// A busy order lock is looked at again this often at most (or at its
/// expiry, when sooner): often enough to notice a release, rare enough to
/// cost next to nothing while another replica orders.
const BUSY_RECHECK: Duration = Duration::from_secs(5);
/// And not sooner than this, whatever the lock record's expiry says (a
/// clock that disagrees with the holder's must not make us spin).
const BUSY_MIN_WAIT: Duration = Duration::from_secs(1);

/// How long to leave a lock alone that is held until `expires_at_unix_ms`.
fn busy_wait(expires_at_unix_ms: u64, now_unix_ms: u64) -> Duration {
    Duration::from_millis(expires_at_unix_ms.saturating_sub(now_unix_ms))
        .clamp(BUSY_MIN_WAIT, BUSY_RECHECK)
}

impl OrderJob {
    fn dir_id(&self) -> String {
        keys::directory_id(&self.acme.directory_url)
    }

    fn state_key(&self) -> String {
        keys::order_state(&self.dir_id(), &keys::hostname_set_id(&self.unit.names))
    }

    async fn run(self) -> OrderOutcome {
        let now = now_unix_ms() / 1000;
        let state_key = self.state_key();
        // The backoff of every replica's failures: a restarted replica or
        // the next owner honours what the last attempt learnt.
        match read_json::<UnitOrderState>(self.store.as_ref(), &state_key).await {
            Ok(state) => {
                let state = state.unwrap_or_default();
                if state.backing_off(now).is_err() {
                    return OrderOutcome::BackingOff(state.failures);
                }
            }
            // Unknown backoff: do not order (fail closed), try later.
            Err(e) => return failed(format!("reading the shared order state: {e}"), None),
        }
        let outcome = self.lock_and_order().await;
        match outcome {
            OrderOutcome::Failed {
                error,
                retry_after_secs,
                ..
            } => {
                let shared = self.share_failure(&state_key, now, retry_after_secs).await;
                OrderOutcome::Failed {
                    error,
                    retry_after_secs,
                    shared,
                }
            }
            OrderOutcome::Deferred { until, why, .. } => {
                let shared = self
                    .share_failure(&state_key, now, Some(until.saturating_sub(now)))
                    .await;
                OrderOutcome::Deferred { until, why, shared }
            }
            OrderOutcome::Issued(record) => {
                let cleared = update_json(
                    self.store.as_ref(),
                    &state_key,
                    |s: Option<UnitOrderState>| match s {
                        Some(mut s) if s.failures.count > 0 => {
                            s.failures.clear();
                            Ok(s)
                        }
                        _ => Err(()),
                    },
                )
                .await;
                if let Err(e) = cleared {
                    warn!(unit = %self.unit.id, error = %one_line(&e.to_string()), "shared failure count not cleared; the next attempt may wait for its backoff");
                }
                OrderOutcome::Issued(record)
            }
            other => other,
        }
    }

    /// Records a failure at `now` in the shared state; the failures as
    /// stored, or `None` when the store did not take it (the caller then
    /// backs off on its own).
    async fn share_failure(
        &self,
        key: &str,
        now: u64,
        retry_after_secs: Option<u64>,
    ) -> Option<Failures> {
        let mut stored = None;
        let result = update_json(self.store.as_ref(), key, |s: Option<UnitOrderState>| {
            let mut s = s.unwrap_or_default();
            s.failures.record(now, retry_after_secs);
            stored = Some(s.failures.clone());
            Ok::<_, std::convert::Infallible>(s)
        })
        .await;
        match result {
            Ok(_) => stored,
            Err(e) => {
                warn!(unit = %self.unit.id, error = %one_line(&e.to_string()), "failure not recorded in the shared store; only this replica backs off");
                None
            }
        }
    }

    async fn lock_and_order(&self) -> OrderOutcome {
        let lock = LeaseLock::new(self.store.clone(), &self.unit.lock_name())
            .with_metrics(self.metrics.clone());
        let lease = match self.try_lock(&lock).await {
            Ok(Ok(lease)) => lease,
            Ok(Err(wait)) => return OrderOutcome::Busy { wait },
            Err(e) => return failed(format!("order lock: {e}"), None),
        };
        let keeper = LeaseKeeper::spawn(lock, lease);
        let outcome = self.locked(&keeper).await;
        if let Err(e) = keeper.release().await {
            debug!(unit = %self.unit.id, error = %e, "order lock not released; it expires by itself");
        }
        outcome
    }

    /// The lease, or how long to leave the lock alone. A lease of this
    /// node's previous process (same node id, another boot id: it is dead,
    /// a pod name runs once) is taken over at once instead of waited out.
    async fn try_lock(&self, lock: &LeaseLock) -> Result<Result<Lease, Duration>, StoreError> {
        if let Some(lease) = lock.try_acquire(&self.holder, self.lock_ttl).await? {
            return Ok(Ok(lease));
        }
        let Some(record) = lock.current().await? else {
            // Lost a race for a new lock just now: someone else has it.
            return Ok(Err(BUSY_RECHECK));
        };
        if !record.released && is_own_predecessor(&record.holder, &self.node_id, &self.holder) {
            if lock.release_predecessor(&record.holder).await? {
                info!(unit = %self.unit.id, previous = %record.holder, fence = record.fence, "taking over the order lock of this node's previous process");
            }
            if let Some(lease) = lock.try_acquire(&self.holder, self.lock_ttl).await? {
                return Ok(Ok(lease));
            }
            return Ok(Err(BUSY_MIN_WAIT));
        }
        debug!(unit = %self.unit.id, holder = %record.holder, expires_at_unix_ms = record.expires_at_unix_ms, "order lock held by another replica");
        // The lease's expiry is on the store's clock, not this node's.
        let now = lock.store_now().await?;
        Ok(Err(busy_wait(record.expires_at_unix_ms, now)))
    }

    async fn locked(&self, keeper: &LeaseKeeper) -> OrderOutcome {
        let now = now_unix_ms() / 1000;
        // The certificate this order replaces, named to the CA (ARI
        // `replaces`) when it offers renewal information.
        let mut replaces = None;
        // Another replica may have stored a certificate between our last
        // read and the lock: use it rather than order a second one.
        let ring = self.ring.current();
        match read_record(self.store.as_ref(), ring.as_deref(), &self.unit).await {
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
                    jitter(&self.unit.id, &record.serial),
                );
                if now < at {
                    return OrderOutcome::AlreadyValid(Box::new(record));
                }
                replaces = Some(record.chain_pem);
            }
            Ok(None) => {}
            Err(StoreError::Corrupt { message, .. }) => {
                warn!(unit = %self.unit.id, "stored certificate unusable ({}); ordering a new one", one_line(&message));
            }
            Err(e) => {
                self.ring.report(&e, &self.metrics);
                return failed(format!("reading the store: {e}"), None);
            }
        }
        let hosts = self.unit.names.clone();
        let dir_id = self.dir_id();
        let history_key = keys::issued(&dir_id, &keys::hostname_set_id(&hosts));
        match check_history(self.store.as_ref(), &history_key, now).await {
            Ok(Ok(())) => {}
            Ok(Err(until)) => {
                return OrderOutcome::Deferred {
                    until,
                    why: format!(
                        "this hostname set was issued {} times in the last 7 days (the CA's duplicate limit)",
                        crate::acme::schedule::DUPLICATE_LIMIT
                    ),
                    shared: None,
                };
            }
            // Without the history the duplicate limit cannot be kept: no
            // order, the backoff tries again later.
            Err(e) => return failed(format!("duplicate guard: {e}; no order placed"), None),
        }
        // The directory and the account first: an attempt that never
        // reaches the CA does not spend the budget.
        let issuer = match self.issuer().await {
            Ok(issuer) => issuer,
            Err((error, retry_after)) => return failed(error, retry_after),
        };
        let budget_key = keys::order_budget(&dir_id);
        let window = match take_budget(self.store.as_ref(), &budget_key, self.budget, now).await {
            Ok(Ok(window)) => window,
            Ok(Err(until)) => {
                return OrderOutcome::Deferred {
                    until,
                    why: format!(
                        "the cluster placed its {} new orders of this interval",
                        self.budget.0
                    ),
                    shared: None,
                };
            }
            Err(e) => return failed(format!("order budget: {e}"), None),
        };
        let replaces = replaces
            .filter(|_| issuer.offers_ari())
            .and_then(|chain| certificate_identifier(&chain).ok());
        let issued = match issuer
            .order_replacing(&hosts, Some(keeper.held()), replaces)
            .await
        {
            Ok(issued) => issued,
            Err(e) => {
                if e.never_reached_ca() {
                    // The newOrder request did not reach the CA: the
                    // budget was not spent.
                    if let Err(give) =
                        give_back_budget(self.store.as_ref(), &budget_key, window).await
                    {
                        debug!(unit = %self.unit.id, error = %give, "order budget not given back");
                    }
                }
                let retry_after = e.retry_after().map(|d| d.as_secs());
                return failed(e.to_string(), retry_after);
            }
        };
        let facts = match parse_chain(&issued.chain_pem) {
            Ok(f) => f,
            Err(e) => return failed(format!("the CA's certificate: {e}"), None),
        };
        let record = CertRecord {
            host: self.unit.record_host().to_owned(),
            hosts: facts.dns_names.clone(),
            chain_pem: issued.chain_pem,
            key_pem: issued.key_pem,
            not_before_unix: facts.not_before_unix,
            not_after_unix: facts.not_after_unix,
            serial: facts.serial,
            issued_at_unix: now_unix_ms() / 1000,
            issued_by: self.node_id.clone(),
        };
        let key = self.unit.store_key();
        let bytes = match record.encode(self.ring.current().as_deref(), &key) {
            Ok(b) => b,
            Err(e) => return failed(e.to_string(), None),
        };
        if let Err(e) = put_fenced(self.store.as_ref(), &key, &bytes, &keeper.lease()).await {
            return failed(format!("storing the certificate: {e}"), None);
        }
        if let Err(e) = record_issuance(self.store.as_ref(), &history_key, now).await {
            warn!(unit = %self.unit.id, error = %one_line(&e.to_string()), "issuance history not recorded");
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
        let account = load_or_create(
            &self.store,
            self.ring.current().as_deref(),
            &AccountSettings::from_config(&self.acme),
            &self.holder,
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
        error: one_line(&error).into_owned(),
        retry_after_secs,
        shared: None,
    }
}

/// Whether one more issuance for the set at `key` keeps the duplicate
/// limit (`Ok(Err(t))`: not before `t`); an error when the history cannot
/// be read, so that no order goes out unguarded.
async fn check_history(
    store: &dyn Store,
    key: &str,
    now: u64,
) -> Result<Result<(), u64>, StoreError> {
    let history = read_json::<IssuanceHistory>(store, key).await?;
    Ok(history.unwrap_or_default().allows(now))
}

/// The JSON record at `key`, `None` when absent; a record that does not
/// decode is [`StoreError::Corrupt`] (naming the key, so it can be fixed
/// or deleted).
async fn read_json<T: serde::de::DeserializeOwned>(
    store: &dyn Store,
    key: &str,
) -> Result<Option<T>, StoreError> {
    match store.get(key).await? {
        None => Ok(None),
        Some(entry) => {
            serde_json::from_slice(&entry.value)
                .map(Some)
                .map_err(|e| StoreError::Corrupt {
                    key: key.to_owned(),
                    message: format!("not the expected JSON record ({e}); delete it to reset"),
                })
        }
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

/// Takes one order from the budget at `key`: `Ok(Ok(window_start))` (the
/// interval it was taken from, for [`give_back_budget`]), or
/// `Ok(Err(t))` when the interval's orders are spent until `t`.
async fn take_budget(
    store: &dyn Store,
    key: &str,
    (max, interval): (u32, Duration),
    now: u64,
) -> Result<Result<u64, u64>, StoreError> {
    let mut window = 0;
    let taken = update_json(store, key, |budget: Option<OrderBudget>| {
        // A changed limit starts a fresh budget.
        let mut budget = budget
            .filter(|b| b.max_orders == max && b.interval_secs == interval.as_secs())
            .unwrap_or_else(|| OrderBudget::new(max, interval.as_secs()));
        budget.try_take(now).map(|()| {
            window = budget.window_start_unix;
            budget
        })
    })
    .await?;
    Ok(taken.map(|()| window))
}

/// Returns an order taken in the interval starting at `window` that never
/// reached the CA (a later interval starts full anyway).
async fn give_back_budget(store: &dyn Store, key: &str, window: u64) -> Result<(), StoreError> {
    update_json(store, key, |budget: Option<OrderBudget>| match budget {
        Some(mut b) if b.window_start_unix == window && b.used > 0 => {
            b.used -= 1;
            Ok(b)
        }
        _ => Err(()),
    })
    .await
    .map(|_| ())
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
    fn a_busy_lock_waits_for_its_expiry_or_a_recheck() {
        let mut view = HostView {
            checked: true,
            ..HostView::default()
        };
        view.lock_busy_until = 1_005;
        assert_eq!(
            due_for_order("a.test", &view, true, None, 1_000),
            Err(Hold::LockBusy(1_005))
        );
        assert_eq!(due_for_order("a.test", &view, true, None, 1_005), Ok(()));
        // At the expiry when it is near, a few seconds on when it is far,
        // and never in a loop when the holder's clock disagrees.
        assert_eq!(
            busy_wait(10_000 + 2_500, 10_000),
            Duration::from_millis(2_500)
        );
        assert_eq!(busy_wait(10_000 + 60_000, 10_000), BUSY_RECHECK);
        assert_eq!(busy_wait(5_000, 10_000), BUSY_MIN_WAIT);
    }

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
            "proxy:\n  extensions:\n    sbmesh:\n      acme: { enabled: true, email: a@b.c }\norigins:\n  \"API.example.com.\": {}\n  \"*.example.com\": {}\n  \"b.example.com\": {}\n",
        )
        .unwrap();
        let (hosts, wildcards) = config.acme_hostnames();
        assert_eq!(
            hosts.into_iter().collect::<Vec<_>>(),
            vec!["api.example.com".to_owned(), "b.example.com".to_owned()]
        );
        assert_eq!(wildcards, vec!["*.example.com".to_owned()]);
        let disabled = crate::config::parse("origins:\n  a.example.com: {}\n").unwrap();
        assert!(disabled.acme_hostnames().0.is_empty());
    }

    fn config(mode: &str, origins: &[&str]) -> SbConfig {
        let mut text = format!(
            "proxy:\n  extensions:\n    sbmesh:\n      acme: {{ enabled: true, email: a@b.c, certificates: {mode} }}\norigins:\n"
        );
        for o in origins {
            text.push_str(&format!("  \"{o}\": {{}}\n"));
        }
        crate::config::parse(&text).unwrap()
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn per_host_mode_makes_one_unit_per_origin() {
        let cfg = config(
            "per_host",
            &["B.example.com", "a.example.com", "*.w.example.com"],
        );
        let (units, wildcards) = wanted_units(&cfg);
        assert_eq!(wildcards, names(&["*.w.example.com"]));
        assert_eq!(
            units,
            vec![
                CertUnit::per_host("a.example.com"),
                CertUnit::per_host("b.example.com")
            ]
        );
        let unit = &units[0];
        assert_eq!(unit.id, "a.example.com");
        assert_eq!(unit.store_key(), keys::certificate("a.example.com"));
        assert_eq!(unit.lock_name(), keys::order_lock("a.example.com"));
        assert_eq!(
            unit.dir(Path::new("/certs")).unwrap(),
            Path::new("/certs/a.example.com")
        );
        // The default mode is per host.
        let default = crate::config::parse(
            "proxy:\n  extensions:\n    sbmesh:\n      acme: { enabled: true, email: a@b.c }\norigins:\n  a.example.com: {}\n",
        )
        .unwrap();
        assert_eq!(
            wanted_units(&default).0,
            vec![CertUnit::per_host("a.example.com")]
        );
    }

    #[test]
    fn san_mode_makes_one_unit_of_every_eligible_origin() {
        let cfg = config(
            "san",
            &[
                "c.example.com",
                "A.example.com",
                "b.example.com.",
                "*.w.example.com",
            ],
        );
        let (units, wildcards) = wanted_units(&cfg);
        assert_eq!(wildcards, names(&["*.w.example.com"]));
        assert_eq!(units.len(), 1);
        let unit = &units[0];
        let set = names(&["a.example.com", "b.example.com", "c.example.com"]);
        assert_eq!(unit.names, set);
        assert_eq!(unit.files, UnitFiles::San);
        assert_eq!(unit.record_host(), "a.example.com");
        let set_id = keys::hostname_set_id(&set);
        assert_eq!(unit.id, format!("san:{set_id}"));
        assert_eq!(unit.store_key(), keys::san_certificate(&set_id));
        assert_eq!(unit.lock_name(), keys::san_order_lock(&set_id));
        assert_eq!(unit.dir(Path::new("/certs")).unwrap(), Path::new("/certs"));
        // The id does not depend on the order of the origins; another set
        // is another unit.
        let same = config("san", &["b.example.com", "c.example.com", "a.example.com"]);
        assert_eq!(wanted_units(&same).0, units);
        let more = config(
            "san",
            &[
                "a.example.com",
                "b.example.com",
                "c.example.com",
                "d.example.com",
            ],
        );
        assert_ne!(wanted_units(&more).0[0].id, unit.id);
        // No eligible origin: no unit.
        assert!(
            wanted_units(&config("san", &["*.w.example.com"]))
                .0
                .is_empty()
        );
    }

    #[test]
    fn a_san_record_is_valid_only_for_exactly_its_names() {
        let set = names(&["a.example.com", "b.example.com", "c.example.com"]);
        let unit = CertUnit::san(set.clone()).unwrap();
        let record = |cert_names: &[String], host: &str| {
            let (chain_pem, key_pem) =
                crate::acme::placeholder::generate(cert_names, 1_800_000_000).unwrap();
            CertRecord {
                host: host.to_owned(),
                hosts: cert_names.to_vec(),
                chain_pem,
                key_pem,
                not_before_unix: 0,
                not_after_unix: 0,
                serial: "01".into(),
                issued_at_unix: 0,
                issued_by: "n".into(),
            }
        };
        // Same names in another order: valid.
        let reordered = names(&["c.example.com", "a.example.com", "b.example.com"]);
        assert_eq!(
            check_record(&unit, &record(&reordered, "a.example.com")),
            Ok(())
        );
        // A subset or a superset is another set's certificate.
        let fewer = names(&["a.example.com", "b.example.com"]);
        let err = check_record(&unit, &record(&fewer, "a.example.com")).unwrap_err();
        assert!(err.contains("not exactly the 3 names"), "{err}");
        let mut more = set.clone();
        more.push("d.example.com".into());
        assert!(check_record(&unit, &record(&more, "a.example.com")).is_err());
        // Filed under another host.
        assert!(check_record(&unit, &record(&set, "b.example.com")).is_err());
        // A key of another certificate.
        let mut mismatched = record(&set, "a.example.com");
        mismatched.key_pem = record(&set, "a.example.com").key_pem;
        assert!(check_record(&unit, &mismatched).is_err());
        // Per host, a certificate that names the host (among others) does.
        let per_host = CertUnit::per_host("b.example.com");
        assert_eq!(
            check_record(&per_host, &record(&set, "b.example.com")),
            Ok(())
        );
        assert!(check_record(&per_host, &record(&fewer[..1], "b.example.com")).is_err());
    }

    #[test]
    fn a_peer_announces_a_unit_by_host_or_by_its_names() {
        let info = |host: &str, list: &[&str], placeholder: bool| CertificateInfo {
            host: host.into(),
            not_after_unix: 1,
            serial: "0a".into(),
            names: names(list),
            placeholder,
        };
        let host = CertUnit::per_host("a.example.com");
        assert!(host.announced_by(&info("a.example.com", &[], false)));
        assert!(!host.announced_by(&info("a.example.com", &[], true)));
        assert!(!host.announced_by(&info("b.example.com", &[], false)));
        let san = CertUnit::san(names(&["b.example.com", "a.example.com"])).unwrap();
        assert!(san.announced_by(&info(
            "a.example.com",
            &["a.example.com", "b.example.com"],
            false
        )));
        assert!(!san.announced_by(&info("a.example.com", &["a.example.com"], false)));
        assert!(!san.announced_by(&info("a.example.com", &[], false)));
        assert!(!san.announced_by(&info(
            "a.example.com",
            &["a.example.com", "b.example.com"],
            true
        )));
    }

    #[test]
    fn placeholders_fill_only_what_has_no_real_certificate() {
        let now = 1_800_000_000;
        let san = CertUnit::san(names(&["a.example.com", "b.example.com"])).unwrap();
        let local = |list: &[&str], placeholder: bool, not_after_unix: u64| Local {
            serial: "01".into(),
            not_after_unix,
            names: names(list),
            placeholder,
        };
        let week = now + 7 * 86_400;
        assert!(needs_placeholder(&san, None, now));
        // A placeholder for these names, fresh: kept.
        let fresh = local(&["b.example.com", "a.example.com"], true, week);
        assert!(!needs_placeholder(&san, Some(&fresh), now));
        // About to expire, or for another set: written anew.
        assert!(needs_placeholder(&san, Some(&fresh), week - 3600));
        let other = local(&["a.example.com"], true, week);
        assert!(needs_placeholder(&san, Some(&other), now));
        // Never over a real certificate, even the old set's (served until
        // the new one arrives) or an expired one.
        assert!(!needs_placeholder(
            &san,
            Some(&local(&["a.example.com"], false, week)),
            now
        ));
        assert!(!needs_placeholder(
            &san,
            Some(&local(&["a.example.com", "b.example.com"], false, 1)),
            now
        ));
        let host = CertUnit::per_host("a.example.com");
        assert!(needs_placeholder(&host, None, now));
        assert!(!needs_placeholder(
            &host,
            Some(&local(&["a.example.com"], false, week)),
            now
        ));
    }

    #[test]
    fn a_placeholder_on_disk_is_recognised_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let san = CertUnit::san(names(&["a.example.com", "b.example.com"])).unwrap();
        let (chain, key) =
            crate::acme::placeholder::generate(&san.names, now_unix_ms() / 1000).unwrap();
        write_pair(dir.path(), &chain, &key).unwrap();
        let local = read_local(&san, dir.path()).unwrap();
        assert!(local.placeholder);
        assert!(
            !local.is_real_for(&san),
            "a placeholder is not the CA's certificate"
        );
        // Per host: its own directory, nothing there yet.
        assert!(read_local(&CertUnit::per_host("a.example.com"), dir.path()).is_none());
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
