//! The ACME manager's scheduling as a pure state machine: which store
//! records to read, which units to order, when to ask the CA for a renewal
//! window, which placeholders to write, and what a task's answer means.
//!
//! Sans-IO like [`crate::reload::machine`]: every input comes with [`Now`]
//! (the monotonic instant for timers, the unix time for certificate times),
//! the outputs say what to do, and the async shell
//! ([`crate::acme::manager`]) only gathers inputs (the mesh's members and
//! their announced serials, the configuration, the answers of its store,
//! CA and disk tasks) and executes the actions. No mesh, store or clock in
//! here, so the rules below are unit-tested with a fake clock.
//!
//! The core knows the unit model ([`crate::acme::unit`]) and the typed
//! answers of the shell's tasks ([`crate::acme::outcome`], store and I/O
//! errors as they are), never the shell itself: nothing here imports
//! from `manager`.
//!
//! Rules:
//! - a unit is ordered only by the rendezvous owner among the alive
//!   members, once that set has held still for [`VIEW_STABLE_FOR`] (and,
//!   alone, once [`Settings::settle`] passed since start), never while this
//!   node is cut off by clock skew, never with a pod-local store and peers,
//!   at most [`Settings::max_concurrent_orders`] at once;
//! - a busy order lock is left alone for the wait its task reported;
//!   failures (this replica's, or the shared ones another replica or an
//!   earlier process recorded) back off, honouring the CA's `Retry-After`
//!   (see [`due_for_order`]);
//! - a unit's record is read when it appears, when a peer announces a
//!   serial we have not read, every [`Settings::missing_check_every`] while
//!   it has no real certificate on disk, at every full check, and not again
//!   for [`READ_RETRY_AFTER_ERROR`] after a failed read;
//! - a read record newer than the files is installed; a placeholder is
//!   written where nothing usable is on disk (see [`needs_placeholder`]).

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::time::{Duration, Instant};

use crate::acme::certs::CertRecord;
use crate::acme::layout;
use crate::acme::outcome::{OrderOutcome, PlaceholderError};
use crate::acme::ownership::owner;
use crate::acme::schedule::{AriWindow, CertTimes, Failures, renew_at, renew_before_ignored};
use crate::acme::unit::{
    AcmeStatus, CertUnit, Local, UnitFiles, local_store_refusal, needs_placeholder,
};
use crate::mesh::{
    CertificateInfo, MAX_FAILING_ERROR, MAX_FAILING_IN_META, OrderFailing, OrderWaiting,
};
use crate::store::StoreError;

/// How long the set of alive members must hold still before orders start.
pub(crate) const VIEW_STABLE_FOR: Duration = Duration::from_secs(1);

/// How often the owner of a unit asks the CA for its renewal window when
/// the directory offers ARI (RFC 9773 suggests a few times a day).
pub(crate) const ARI_EVERY: Duration = Duration::from_secs(6 * 3600);

/// How long an order whose challenge was not answered where the CA's
/// request lands ([`crate::acme::reach`]) waits before it checks again,
/// after waiting `waited` seconds: every second for the first minute (a
/// fresh deploy's pods turn Ready within it, and the certificate should
/// follow within a second), then every 10 s (a Service left broken costs
/// a probe per name every 10 s, not every second).
pub(crate) fn unanswered_wait(waited: u64) -> u64 {
    if waited < 60 { 1 } else { 10 }
}

/// Pause before a unit's store record is read again after a failed read.
pub(crate) const READ_RETRY_AFTER_ERROR: Duration = Duration::from_secs(5);

/// Why a host is not ordered now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Hold {
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
    /// Another holder has the unit's order lock: look again at this time
    /// (unix seconds; its expiry, or sooner to notice a release).
    LockBusy(u64),
}

/// What the scheduler knows of one host.
#[derive(Clone, Debug, Default)]
pub(crate) struct HostView {
    /// The certificate in the store, when one was read.
    pub stored: Option<StoredCert>,
    /// Whether the store was read at least once since the host appeared.
    pub checked: bool,
    /// The failure history of this replica's orders for it.
    pub failures: Failures,
    /// Whether this replica is ordering it now.
    pub in_flight: bool,
    /// The order lock was busy: not tried again before this time (unix
    /// seconds; 0: no wait).
    pub lock_busy_until: u64,
}

/// Facts of a stored certificate the scheduler needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoredCert {
    /// Serial, lowercase hex.
    pub serial: String,
    /// Validity.
    pub times: CertTimes,
    /// The CA's renewal window, when it offers ARI.
    pub ari: Option<AriWindow>,
}

/// Whether `host` should be ordered by this replica at `now`: `Ok(())` to
/// order, else why not. `is_owner` is the rendezvous verdict.
pub(crate) fn due_for_order(
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
    if now < view.lock_busy_until {
        return Err(Hold::LockBusy(view.lock_busy_until));
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
pub(crate) fn jitter(host: &str, serial: &str) -> f64 {
    let digest = crate::config::sha256_hex(format!("{host}\n{serial}").as_bytes());
    let n = u64::from_str_radix(&digest[..13], 16).unwrap_or(0);
    n as f64 / (1u64 << 52) as f64
}

/// The time of a step, passed in: the monotonic instant drives the
/// machine's timers, the wall-clock time is compared with certificate
/// times, lock waits and backoffs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Now {
    /// Monotonic time.
    pub mono: Instant,
    /// Wall-clock time, unix milliseconds.
    pub unix_ms: u64,
}

impl Now {
    /// The wall-clock time in unix seconds.
    pub(crate) fn unix(&self) -> u64 {
        self.unix_ms / 1000
    }
}

/// The machine's fixed settings.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    /// This replica's node id, as the mesh lists it among the members.
    pub node_id: String,
    /// Orders this replica runs at once.
    pub max_concurrent_orders: usize,
    /// Alone, no order before this long after start.
    pub settle: Duration,
    /// Every unit's record is read this often.
    pub full_check_every: Duration,
    /// Units without a real certificate on disk are looked up this often.
    pub missing_check_every: Duration,
    /// The store's backend name, for the refusal message.
    pub store_backend: String,
    /// Whether the store is shared between replicas.
    pub store_shared: bool,
}

/// The ACME part of the configuration the machine needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ordering {
    /// `renew_before_days` of the `acme` section.
    pub renew_before_days: Option<u32>,
}

/// An input of the machine.
#[derive(Debug)]
pub(crate) enum Input {
    /// The configuration (re)read: the units it asks for, each with what
    /// is on disk for it (used for units not known yet), the wildcards
    /// that are not eligible, and whether (and how) to order at all.
    ConfigChanged {
        /// The wanted units, with their files on disk.
        units: Vec<(CertUnit, Option<Local>)>,
        /// Wildcard origins, not ordered.
        not_eligible: Vec<String>,
        /// `None`: no `acme` section, nothing is ordered.
        ordering: Option<Ordering>,
    },
    /// The mesh's view: the alive members (this node included), whether
    /// it has peers, and whether clock skew cuts this node off.
    Members {
        /// Node ids of the alive members.
        alive: Vec<String>,
        /// Whether the mesh has peers.
        has_peers: bool,
        /// Whether this node is cut off from the mesh by clock skew.
        skew_isolated: bool,
    },
    /// The certificates the peers announce in their metadata.
    PeerCerts(Vec<CertificateInfo>),
    /// Whether the CA offers renewal information (ARI); known once the
    /// account is loaded.
    AriOffered(bool),
    /// A [`Action::ReadRecord`] finished.
    RecordRead {
        /// The unit id.
        id: String,
        /// The record, `None` when there is none, or why it is unusable.
        result: Result<Option<CertRecord>, StoreError>,
    },
    /// A [`Action::InstallRecord`] finished.
    Installed {
        /// The unit id.
        id: String,
        /// What is on disk now and whether the files changed, or why they
        /// could not be written.
        result: Result<(Local, bool), io::Error>,
    },
    /// A [`Action::WritePlaceholder`] finished.
    PlaceholderWritten {
        /// The unit id.
        id: String,
        /// The placeholder on disk now, or why it could not be written.
        result: Result<Local, PlaceholderError>,
    },
    /// A [`Action::PlaceOrder`] finished.
    OrderFinished {
        /// The unit id.
        id: String,
        /// How it ended.
        outcome: OrderOutcome,
    },
    /// The CA's renewal window for the certificate `serial` of `id`, and
    /// when to ask again (unix seconds).
    AriAnswered {
        /// The unit id.
        id: String,
        /// The certificate asked about.
        serial: String,
        /// The window, when the CA gave one.
        window: Option<AriWindow>,
        /// Not asked again before this (unix seconds).
        next_check_unix: u64,
    },
    /// Time passed: decide what is due. The shell sends it after each
    /// batch of other inputs, and at least every few hundred milliseconds.
    Tick,
    /// The cluster key ring's primary changed (a rotation).
    KeyRingChanged,
}

/// Something a step reports, for logs and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Report {
    /// A unit left the configuration: its certificate is not renewed.
    UnitRemoved(CertUnit),
    /// A unit appeared.
    UnitAdded(CertUnit),
    /// The certificate of these names ends at this time (unix seconds).
    Expiry {
        /// The names.
        names: Vec<String>,
        /// End of validity.
        not_after_unix: u64,
    },
    /// Why this node does not order changed (`None`: it orders again).
    Refusal(Option<String>),
    /// Why the unit's order waits changed (`None`: it no longer waits).
    Waiting {
        /// The unit id.
        id: String,
        /// The challenge check's finding ([`crate::acme::reach`]).
        reason: Option<String>,
    },
    /// An order failed (or was deferred); the unit backs off like this.
    OrderFailed {
        /// The unit id.
        id: String,
        /// Deferred by a limit, rather than failed.
        deferred: bool,
        /// The failures the backoff goes by.
        failures: Failures,
        /// What went wrong, as logged: the text of the order's
        /// [`crate::acme::outcome::OrderError`] or
        /// [`crate::acme::outcome::Deferral`].
        error: String,
    },
    /// `renew_before_days` is set aside for this certificate (at least
    /// half of its lifetime).
    RenewBeforeIgnored {
        /// The unit.
        unit: CertUnit,
        /// The certificate.
        serial: String,
        /// The configured days.
        days: u32,
        /// Its lifetime, seconds.
        lifetime_secs: u64,
    },
}

/// What the shell must do after a step.
#[derive(Clone, Debug)]
pub(crate) enum Action {
    /// Record this (logs, metrics).
    Report(Report),
    /// Read the unit's record from the store; answer with
    /// [`Input::RecordRead`].
    ReadRecord(CertUnit),
    /// Write this record's certificate as the unit's files; answer with
    /// [`Input::Installed`].
    InstallRecord {
        /// The unit.
        unit: CertUnit,
        /// The record read or issued.
        record: Box<CertRecord>,
    },
    /// Write a placeholder for the unit; answer with
    /// [`Input::PlaceholderWritten`].
    WritePlaceholder(CertUnit),
    /// Order the unit; answer with [`Input::OrderFinished`].
    PlaceOrder {
        /// The unit.
        unit: CertUnit,
        /// The certificate the machine knew when it decided.
        known: Option<StoredCert>,
        /// The renewal setting to order under.
        renew_before_days: Option<u32>,
    },
    /// Ask the CA for the renewal window of the unit's certificate
    /// `serial`; answer with [`Input::AriAnswered`] (or nothing).
    AskAri {
        /// The unit.
        unit: CertUnit,
        /// The certificate.
        serial: String,
    },
    /// Move the ACME account record to the primary cluster key.
    ResealAccount,
    /// Certificate files changed: hand them to the proxy.
    CertificatesChanged,
    /// Publish this status.
    PublishStatus(AcmeStatus),
}

/// What the machine knows of one unit.
#[derive(Clone, Debug)]
struct UnitState {
    unit: CertUnit,
    view: HostView,
    local: Option<Local>,
    /// Serial announced by a peer that we have not read from the store yet.
    wanted_serial: Option<String>,
    fetching: bool,
    /// After a failed store read, no read before this: a record that
    /// cannot be opened (or a store that fails) must not be read again at
    /// every wake-up while a peer keeps announcing its serial.
    read_retry_at: Option<Instant>,
    next_check: Option<Instant>,
    /// Not before this time (unix seconds) is the CA asked again for the
    /// renewal window of the certificate with this serial.
    ari_next: Option<(u64, String)>,
    /// The serial last reported for an ignored `renew_before_days`.
    renew_warned: Option<String>,
    /// Writing a placeholder failed; not tried again for this unit.
    placeholder_failed: bool,
    /// A placeholder write is under way (its answer not in yet).
    placeholder_pending: bool,
    /// Certificate installs under way: no placeholder over them.
    installing: u32,
    /// Its order waits: the challenge was not answered where the CA's
    /// request lands (since when, unix seconds, and why).
    waiting: Option<(u64, String)>,
    /// Its last order failed: since when (unix seconds) and why.
    failing: Option<(u64, String)>,
}

impl UnitState {
    fn new(unit: CertUnit, local: Option<Local>) -> Self {
        Self {
            unit,
            view: HostView::default(),
            local,
            wanted_serial: None,
            fetching: false,
            read_retry_at: None,
            next_check: None,
            ari_next: None,
            renew_warned: None,
            waiting: None,
            failing: None,
            placeholder_failed: false,
            placeholder_pending: false,
            installing: 0,
        }
    }

    /// Whether the proxy has a real certificate for this unit's names (not
    /// a placeholder, not the certificate of an older SAN set).
    fn has_real(&self) -> bool {
        self.local
            .as_ref()
            .is_some_and(|l| l.is_real_for(&self.unit))
    }
}

/// The scheduling state machine. See the module documentation.
#[derive(Clone, Debug)]
pub(crate) struct Machine {
    settings: Settings,
    /// By unit id.
    units: BTreeMap<String, UnitState>,
    not_eligible: Vec<String>,
    ordering: Option<Ordering>,
    started: Instant,
    last_full_check: Instant,
    /// The next tick is a full check (the cluster key ring changed).
    full_check_due: bool,
    /// The alive members at the last [`Input::Members`], and since when
    /// they are so.
    alive: Vec<String>,
    view_changed: Instant,
    has_peers: bool,
    skew_isolated: bool,
    ari_offered: bool,
    refusal: Option<String>,
    /// What the status shows changed: published once per step.
    status_dirty: bool,
}

impl Machine {
    /// Whether the configuration asks for no certificate at all.
    pub(crate) fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// A machine started at `now`, knowing no unit and no member yet.
    pub(crate) fn new(settings: Settings, now: Now) -> Self {
        Self {
            settings,
            units: BTreeMap::new(),
            not_eligible: Vec::new(),
            ordering: None,
            started: now.mono,
            last_full_check: now.mono,
            full_check_due: false,
            alive: Vec::new(),
            view_changed: now.mono,
            has_peers: false,
            skew_isolated: false,
            ari_offered: false,
            refusal: None,
            status_dirty: false,
        }
    }

    /// The failures a unit's backoff goes by (for tests and diagnostics).
    #[cfg(test)]
    pub(crate) fn failures(&self, id: &str) -> Option<&Failures> {
        self.units.get(id).map(|s| &s.view.failures)
    }

    /// Feeds one input at `now`; returns what to do. Answers and view
    /// updates only change the state: what is due (reads, renewal window
    /// questions, orders) is decided at [`Input::Tick`], once per pass of
    /// the shell over a batch of inputs, so that thousands of answers do
    /// not cost thousands of passes over every unit.
    pub(crate) fn step(&mut self, input: Input, now: Now) -> Vec<Action> {
        let mut out = Vec::new();
        match input {
            Input::ConfigChanged {
                units,
                not_eligible,
                ordering,
            } => {
                self.config_changed(units, not_eligible, ordering, now, &mut out);
                self.publish(&mut out);
            }
            Input::Members {
                alive,
                has_peers,
                skew_isolated,
            } => {
                if alive != self.alive {
                    self.alive = alive;
                    self.view_changed = now.mono;
                }
                if has_peers != self.has_peers {
                    self.has_peers = has_peers;
                    self.status_dirty = true;
                }
                self.skew_isolated = skew_isolated;
            }
            Input::PeerCerts(certs) => self.peer_certs(&certs),
            Input::AriOffered(offered) => self.ari_offered = offered,
            Input::RecordRead { id, result } => self.record_read(&id, result, now, &mut out),
            Input::Installed { id, result } => self.installed(&id, result, &mut out),
            Input::PlaceholderWritten { id, result } => {
                if let Some(state) = self.units.get_mut(&id) {
                    state.placeholder_pending = false;
                    match result {
                        Ok(local) => state.local = Some(local),
                        // Not tried again for this unit (the shell warns).
                        Err(_) => state.placeholder_failed = true,
                    }
                    self.status_dirty = true;
                }
            }
            Input::OrderFinished { id, outcome } => {
                self.order_finished(&id, outcome, now, &mut out)
            }
            Input::AriAnswered {
                id,
                serial,
                window,
                next_check_unix,
            } => {
                if let Some(state) = self.units.get_mut(&id) {
                    if state.ari_next.as_ref().is_some_and(|(_, s)| *s == serial) {
                        state.ari_next = Some((next_check_unix, serial.clone()));
                    }
                    if let Some(stored) = state.view.stored.as_mut().filter(|s| s.serial == serial)
                    {
                        stored.ari = window;
                    }
                }
            }
            Input::Tick => {
                self.plan(now, &mut out);
                self.publish(&mut out);
            }
            // The old key may leave the key file once the grace of a
            // rotation ends: every record (each read reseals one sealed
            // under an older key) and the account move to the new primary
            // at once, not at the next full check.
            Input::KeyRingChanged => self.full_check_due = true,
        }
        out
    }

    /// The status, when what it shows changed: once per tick (and at a
    /// config change), not at every answer, which with thousands of units
    /// would rebuild it thousands of times per pass.
    fn publish(&mut self, out: &mut Vec<Action>) {
        if std::mem::take(&mut self.status_dirty) {
            out.push(Action::PublishStatus(self.status()));
        }
    }

    /// Whether every unit's store record was read once and what it held
    /// is written for the proxy (a proxy started now gets every stored
    /// certificate), and, when this node has peers, every unit has the
    /// CA's certificate on disk: a peer is most likely ordering what the
    /// store lacks (a fleet's first pods start one after another), and a
    /// proxy that starts on the placeholder is restarted seconds later.
    /// `/startupz` bounds the wait. What changes it marks the status dirty:
    /// a unit added (config change), its first read, an install's end, the
    /// node's first or last peer.
    fn settled(&self) -> bool {
        self.units.values().all(|s| {
            s.view.checked
                && s.installing == 0
                && (!self.has_peers || s.local.as_ref().is_some_and(|l| l.is_real_for(&s.unit)))
        })
    }

    /// The status of what is on disk now.
    pub(crate) fn status(&self) -> AcmeStatus {
        let certificates = self
            .units
            .values()
            .filter_map(|s| {
                let l = s.local.as_ref()?;
                let mut names = l.names.clone();
                names.sort();
                names.dedup();
                let (host, names) = match &s.unit.files {
                    // A per-host certificate lists its names only when it
                    // has more than the host (keeps metadata small).
                    UnitFiles::Host(host) => {
                        let only_host = names.len() == 1 && names[0] == *host;
                        (host.clone(), if only_host { Vec::new() } else { names })
                    }
                    UnitFiles::San => (
                        names
                            .first()
                            .cloned()
                            .unwrap_or_else(|| s.unit.record_host().to_owned()),
                        names,
                    ),
                };
                Some(CertificateInfo {
                    host,
                    not_after_unix: l.not_after_unix,
                    serial: l.serial.clone(),
                    names,
                    placeholder: l.placeholder,
                })
            })
            .collect();
        let waiting = self
            .units
            .values()
            .filter_map(|s| {
                let (since, reason) = s.waiting.as_ref()?;
                Some(OrderWaiting {
                    host: s.unit.record_host().to_owned(),
                    since_unix: *since,
                    reason: reason.clone(),
                })
            })
            .collect();
        let mut failing: Vec<OrderFailing> = self
            .units
            .values()
            .filter_map(|s| {
                let (since, error) = s.failing.as_ref()?;
                Some(OrderFailing {
                    host: s.unit.record_host().to_owned(),
                    since_unix: *since,
                    retry_at_unix: s.view.failures.next_attempt_unix(),
                    error: error.chars().take(MAX_FAILING_ERROR).collect(),
                })
            })
            .collect();
        failing.sort_by(|a, b| a.host.cmp(&b.host));
        failing.truncate(MAX_FAILING_IN_META);
        AcmeStatus {
            certificates,
            not_eligible: self.not_eligible.clone(),
            refusal: self.refusal.clone(),
            waiting,
            failing,
            settled: self.settled(),
        }
    }

    fn config_changed(
        &mut self,
        wanted: Vec<(CertUnit, Option<Local>)>,
        not_eligible: Vec<String>,
        ordering: Option<Ordering>,
        now: Now,
        out: &mut Vec<Action>,
    ) {
        self.not_eligible = not_eligible;
        let wanted_ids: BTreeSet<&str> = wanted.iter().map(|(u, _)| u.id.as_str()).collect();
        let removed: Vec<String> = self
            .units
            .keys()
            .filter(|id| !wanted_ids.contains(id.as_str()))
            .cloned()
            .collect();
        for id in removed {
            if let Some(state) = self.units.remove(&id) {
                out.push(Action::Report(Report::UnitRemoved(state.unit)));
            }
        }
        for (unit, local) in wanted {
            if self.units.contains_key(&unit.id) {
                continue;
            }
            if let Some(l) = local.as_ref().filter(|l| !l.placeholder) {
                out.push(Action::Report(Report::Expiry {
                    names: unit.names.clone(),
                    not_after_unix: l.not_after_unix,
                }));
            }
            out.push(Action::Report(Report::UnitAdded(unit.clone())));
            self.units
                .insert(unit.id.clone(), UnitState::new(unit, local));
        }
        self.write_placeholders(now, out);
        self.ordering = ordering;
        // A pod that starts after a rotation moves the account to the new
        // primary at once (then once per full check).
        if self.ordering.is_some() {
            out.push(Action::ResealAccount);
        }
        self.status_dirty = true;
    }

    /// Peers announce the certificates they wrote: a serial we do not have
    /// is a reason to read the store now.
    fn peer_certs(&mut self, certs: &[CertificateInfo]) {
        for cert in certs {
            // Per host the unit id is the host; a SAN entry lists its
            // names, whose set id names the unit.
            let san_id = (!cert.names.is_empty())
                .then(|| layout::san_unit_id(&layout::hostname_set_id(&cert.names)));
            let id = san_id
                .filter(|id| self.units.contains_key(id))
                .unwrap_or_else(|| cert.host.clone());
            if let Some(state) = self
                .units
                .get_mut(&id)
                .filter(|s| s.unit.announced_by(cert))
            {
                let have = state.local.as_ref().map(|l| l.serial.as_str());
                let known = state.view.stored.as_ref().map(|s| s.serial.as_str());
                if have != Some(cert.serial.as_str()) && known != Some(cert.serial.as_str()) {
                    state.wanted_serial = Some(cert.serial.clone());
                }
            }
        }
    }

    fn record_read(
        &mut self,
        id: &str,
        result: Result<Option<CertRecord>, StoreError>,
        now: Now,
        out: &mut Vec<Action>,
    ) {
        let Some(state) = self.units.get_mut(id) else {
            return;
        };
        state.fetching = false;
        state.read_retry_at = result.is_err().then(|| now.mono + READ_RETRY_AFTER_ERROR);
        match result {
            Ok(Some(record)) => self.take_record(id, record, out),
            Ok(None) => {
                self.status_dirty |= !state.view.checked;
                state.view.checked = true;
                state.view.stored = None;
            }
            // The shell logs it; the files stay as they are.
            Err(_) => {}
        }
    }

    /// A record read from the store (or just issued): remember it, and
    /// install it when it is newer than what the proxy has (always over a
    /// placeholder or the certificate of another SAN set).
    fn take_record(&mut self, id: &str, record: CertRecord, out: &mut Vec<Action>) {
        let Some(state) = self.units.get_mut(id) else {
            return;
        };
        self.status_dirty |= !state.view.checked;
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
            Some(_) if !state.has_real() => true,
            Some(local) => {
                local.serial != record.serial && record.not_after_unix >= local.not_after_unix
            }
        };
        if newer {
            state.installing += 1;
            out.push(Action::InstallRecord {
                unit: state.unit.clone(),
                record: Box::new(record),
            });
        }
    }

    fn installed(
        &mut self,
        id: &str,
        result: Result<(Local, bool), io::Error>,
        out: &mut Vec<Action>,
    ) {
        let Some(state) = self.units.get_mut(id) else {
            return;
        };
        state.installing = state.installing.saturating_sub(1);
        // A failed write is tried again at the next read (the shell warns).
        if let Ok((local, changed)) = result {
            out.push(Action::Report(Report::Expiry {
                names: state.unit.names.clone(),
                not_after_unix: local.not_after_unix,
            }));
            if changed {
                out.push(Action::CertificatesChanged);
            }
            state.local = Some(local);
        }
        self.status_dirty = true;
    }

    fn order_finished(&mut self, id: &str, outcome: OrderOutcome, now: Now, out: &mut Vec<Action>) {
        let Some(state) = self.units.get_mut(id) else {
            return;
        };
        state.view.in_flight = false;
        let now_ms = now.unix_ms;
        let now = now.unix();
        if let OrderOutcome::Unanswered(unanswered) = &outcome {
            let since = state.waiting.as_ref().map_or(now, |(since, _)| *since);
            state.view.lock_busy_until =
                now.saturating_add(unanswered_wait(now.saturating_sub(since)));
            let reason = unanswered.to_string();
            if state.waiting.as_ref().map(|(_, r)| r) != Some(&reason) {
                out.push(Action::Report(Report::Waiting {
                    id: id.to_owned(),
                    reason: Some(reason.clone()),
                }));
                self.status_dirty = true;
            }
            state.waiting = Some((since, reason));
            return;
        }
        if state.waiting.take().is_some() {
            out.push(Action::Report(Report::Waiting {
                id: id.to_owned(),
                reason: None,
            }));
            self.status_dirty = true;
        }
        match outcome {
            OrderOutcome::Unanswered(_) => {}
            OrderOutcome::Issued(record) => {
                state.view.failures.clear();
                if state.failing.take().is_some() {
                    self.status_dirty = true;
                }
                self.take_record(id, *record, out);
            }
            OrderOutcome::AlreadyValid(record) => {
                if state.failing.take().is_some() {
                    self.status_dirty = true;
                }
                self.take_record(id, *record, out)
            }
            OrderOutcome::Busy { wait } => {
                // Not before the lease's expiry (or a re-check a few
                // seconds on): every wake-up must not send another attempt
                // to the store.
                let until_ms = now_ms.saturating_add(wait.as_millis() as u64);
                state.view.lock_busy_until = until_ms.div_ceil(1000);
            }
            OrderOutcome::BackingOff(failures) => state.view.failures = failures,
            OrderOutcome::Deferred { until, why, shared } => {
                match shared {
                    Some(f) => state.view.failures = f,
                    None => state
                        .view
                        .failures
                        .record(now, Some(until.saturating_sub(now))),
                }
                out.push(Action::Report(Report::OrderFailed {
                    id: id.to_owned(),
                    deferred: true,
                    failures: state.view.failures.clone(),
                    error: why.to_string(),
                }));
            }
            OrderOutcome::Failed { error, shared } => {
                match shared {
                    Some(f) => state.view.failures = f,
                    None => state.view.failures.record(now, error.retry_after_secs()),
                }
                let error = error.to_string();
                let since = state.failing.as_ref().map_or(now, |(since, _)| *since);
                state.failing = Some((since, error.clone()));
                self.status_dirty = true;
                out.push(Action::Report(Report::OrderFailed {
                    id: id.to_owned(),
                    deferred: false,
                    failures: state.view.failures.clone(),
                    error,
                }));
            }
        }
    }

    /// A placeholder for every unit that has nothing usable on disk yet.
    /// Ordering goes by the store alone, and the proxy is not asked to
    /// reload for it (a proxy reads it at start-up; reloading a running
    /// one for it would only disturb).
    fn write_placeholders(&mut self, now: Now, out: &mut Vec<Action>) {
        for state in self.units.values_mut() {
            if state.placeholder_failed
                || state.placeholder_pending
                || state.installing > 0
                || !needs_placeholder(&state.unit, state.local.as_ref(), now.unix())
            {
                continue;
            }
            state.placeholder_pending = true;
            out.push(Action::WritePlaceholder(state.unit.clone()));
        }
    }

    /// The store reads due now: every unit at a full check, else the ones
    /// not read yet, wanted, or missing their CA certificate.
    fn plan_reads(&mut self, now: Now, full: bool, out: &mut Vec<Action>) {
        let missing_every = self.settings.missing_check_every;
        for state in self.units.values_mut() {
            if state.fetching || state.read_retry_at.is_some_and(|t| now.mono < t) {
                continue;
            }
            // A placeholder or an older SAN set's certificate is as good
            // as missing: look for the real one often.
            let missing = !state.has_real();
            let due_check = state.next_check.is_none_or(|t| now.mono >= t);
            let want = full
                || !state.view.checked
                || state.wanted_serial.is_some()
                || (missing && due_check)
                || (state.next_check.is_some() && due_check);
            if want {
                state.fetching = true;
                state.next_check = missing.then(|| now.mono + missing_every);
                out.push(Action::ReadRecord(state.unit.clone()));
            }
        }
    }

    /// What is due now: reads, then (when this node may order) renewal
    /// window questions and orders.
    fn plan(&mut self, now: Now, out: &mut Vec<Action>) {
        if self.units.is_empty() {
            return;
        }
        let full = std::mem::take(&mut self.full_check_due)
            || now.mono.saturating_duration_since(self.last_full_check)
                >= self.settings.full_check_every;
        if full {
            self.last_full_check = now.mono;
            // New units got theirs with the config; this renews the ones
            // close to expiry while the CA's certificate is still missing.
            self.write_placeholders(now, out);
            if self.ordering.is_some() {
                out.push(Action::ResealAccount);
            }
        }
        self.plan_reads(now, full, out);

        let Some(ordering) = self.ordering.clone() else {
            return;
        };
        self.report_ignored_renew_before(ordering.renew_before_days, out);
        let refusal = local_store_refusal(
            &self.settings.store_backend,
            self.settings.store_shared,
            self.has_peers,
        );
        if refusal != self.refusal {
            self.refusal = refusal.clone();
            self.status_dirty = true;
            out.push(Action::Report(Report::Refusal(refusal)));
        }
        // Cut off by clock skew, this node sees no peers and would think it
        // owns every hostname; the mesh logs the skew and /readyz says it.
        if self.refusal.is_some() || self.skew_isolated {
            return;
        }
        // Ownership is only as good as the view: order once the set of
        // alive members has held still for a moment (members joining at
        // start, or one going down), so that replicas agree on owners.
        let stable = now.mono.saturating_duration_since(self.view_changed) >= VIEW_STABLE_FOR;
        let settled = self.has_peers
            || now.mono.saturating_duration_since(self.started) >= self.settings.settle;
        if !(stable && settled) {
            return;
        }
        let members: Vec<&str> = self.alive.iter().map(String::as_str).collect();
        let me = self.settings.node_id.as_str();
        if self.ari_offered {
            for (id, state) in &mut self.units {
                let Some(stored) = &state.view.stored else {
                    continue;
                };
                if owner(id, &members) != Some(me) {
                    continue;
                }
                let fresh = state
                    .ari_next
                    .as_ref()
                    .is_some_and(|(at, serial)| *serial == stored.serial && now.unix() < *at);
                if fresh {
                    continue;
                }
                // Until the answer says otherwise (it says when to ask
                // again): one question at a time.
                state.ari_next = Some((now.unix() + ARI_EVERY.as_secs(), stored.serial.clone()));
                out.push(Action::AskAri {
                    unit: state.unit.clone(),
                    serial: stored.serial.clone(),
                });
            }
        }
        let mut in_flight = self.units.values().filter(|s| s.view.in_flight).count();
        for (id, state) in &mut self.units {
            if in_flight >= self.settings.max_concurrent_orders.max(1) {
                break;
            }
            let is_owner = owner(id, &members) == Some(me);
            if due_for_order(
                id,
                &state.view,
                is_owner,
                ordering.renew_before_days,
                now.unix(),
            )
            .is_ok()
            {
                state.view.in_flight = true;
                in_flight += 1;
                out.push(Action::PlaceOrder {
                    unit: state.unit.clone(),
                    known: state.view.stored.clone(),
                    renew_before_days: ordering.renew_before_days,
                });
            }
        }
    }

    /// Reports, once per certificate serial, when `renew_before_days` is
    /// set aside for a stored certificate because it is at least half of
    /// its lifetime (the one-third rule applies then, see
    /// [`crate::acme::schedule::renew_at`]).
    fn report_ignored_renew_before(
        &mut self,
        renew_before_days: Option<u32>,
        out: &mut Vec<Action>,
    ) {
        let Some(days) = renew_before_days else {
            return;
        };
        for state in self.units.values_mut() {
            let Some(stored) = &state.view.stored else {
                continue;
            };
            if state.renew_warned.as_deref() == Some(stored.serial.as_str())
                || !renew_before_ignored(stored.times, renew_before_days)
            {
                continue;
            }
            out.push(Action::Report(Report::RenewBeforeIgnored {
                unit: state.unit.clone(),
                serial: stored.serial.clone(),
                days,
                lifetime_secs: stored
                    .times
                    .not_after_unix
                    .saturating_sub(stored.times.not_before_unix),
            }));
            state.renew_warned = Some(stored.serial.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::acme::account::AcmeError;
    use crate::acme::outcome::OrderError;
    use crate::acme::placeholder::PLACEHOLDER_REFRESH_SECS;
    use crate::acme::reach::Unanswered;

    const START_UNIX: u64 = 1_800_000_000;
    const DAY: u64 = 86_400;

    /// A fake clock: both times move together, only when told.
    struct Clock {
        start: Instant,
        elapsed: Duration,
    }

    impl Clock {
        fn new() -> Self {
            Self {
                start: Instant::now(),
                elapsed: Duration::ZERO,
            }
        }

        fn now(&self) -> Now {
            Now {
                mono: self.start + self.elapsed,
                unix_ms: START_UNIX * 1000 + self.elapsed.as_millis() as u64,
            }
        }

        fn unix(&self) -> u64 {
            self.now().unix()
        }

        fn advance(&mut self, by: Duration) {
            self.elapsed += by;
        }
    }

    /// A machine for node `me`, with the production cadences, a shared
    /// store, and the clock.
    struct Rig {
        machine: Machine,
        clock: Clock,
    }

    fn settings(me: &str) -> Settings {
        Settings {
            node_id: me.into(),
            max_concurrent_orders: 8,
            settle: Duration::from_secs(3),
            full_check_every: Duration::from_secs(60),
            missing_check_every: Duration::from_secs(2),
            store_backend: "redis".into(),
            store_shared: true,
        }
    }

    impl Rig {
        fn with(settings: Settings, hosts: &[&str]) -> Self {
            let clock = Clock::new();
            let mut machine = Machine::new(settings, clock.now());
            machine.step(
                Input::ConfigChanged {
                    units: hosts
                        .iter()
                        .map(|h| (CertUnit::per_host(h), None))
                        .collect(),
                    not_eligible: Vec::new(),
                    ordering: Some(Ordering {
                        renew_before_days: None,
                    }),
                },
                clock.now(),
            );
            Self { machine, clock }
        }

        fn new(me: &str, hosts: &[&str]) -> Self {
            Self::with(settings(me), hosts)
        }

        fn step(&mut self, input: Input) -> Vec<Action> {
            self.machine.step(input, self.clock.now())
        }

        fn members(&mut self, alive: &[&str], skew_isolated: bool) -> Vec<Action> {
            self.step(Input::Members {
                alive: alive.iter().map(|s| s.to_string()).collect(),
                has_peers: alive.len() > 1,
                skew_isolated,
            })
        }

        /// One pass of the shell: a tick, every store read it asks for
        /// answered with "nothing stored"; the actions of the tick.
        fn tick(&mut self) -> Vec<Action> {
            let actions = self.step(Input::Tick);
            for id in reads(&actions) {
                self.step(Input::RecordRead {
                    id,
                    result: Ok(None),
                });
            }
            actions
        }

        /// Passes the shell makes over `total`, one every 250 ms, with the
        /// mesh view fed before each (as the shell does); the units ordered
        /// meanwhile.
        fn run_for(&mut self, total: Duration, alive: &[&str], skewed: bool) -> Vec<String> {
            let mut ordered = Vec::new();
            let end = self.clock.elapsed + total;
            while self.clock.elapsed < end {
                self.clock.advance(Duration::from_millis(250));
                self.members(alive, skewed);
                self.step(Input::PeerCerts(Vec::new()));
                ordered.extend(orders(&self.tick()));
            }
            ordered
        }

        fn finish(&mut self, id: &str, outcome: OrderOutcome) -> Vec<Action> {
            self.step(Input::OrderFinished {
                id: id.into(),
                outcome,
            })
        }
    }

    fn orders(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::PlaceOrder { unit, .. } => Some(unit.id.clone()),
                _ => None,
            })
            .collect()
    }

    fn reads(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::ReadRecord(unit) => Some(unit.id.clone()),
                _ => None,
            })
            .collect()
    }

    fn record(host: &str, serial: &str, not_before: u64, not_after: u64) -> CertRecord {
        CertRecord {
            host: host.into(),
            hosts: vec![host.into()],
            chain_pem: "chain".into(),
            key_pem: "key".into(),
            not_before_unix: not_before,
            not_after_unix: not_after,
            serial: serial.into(),
            issued_at_unix: not_before,
            issued_by: "b".into(),
        }
    }

    /// A host owned by `who` among `members`.
    fn host_owned_by(who: &str, members: &[&str]) -> String {
        (0..)
            .map(|i| format!("h{i}.example.com"))
            .find(|h| owner(h, members) == Some(who))
            .unwrap_or_default()
    }

    /// A single node past its settle time, whose unit is being ordered.
    fn ordering_alone(host: &str) -> Rig {
        let mut rig = Rig::new("a", &[host]);
        let ordered = rig.run_for(Duration::from_secs(4), &["a"], false);
        assert_eq!(
            ordered,
            vec![host.to_owned()],
            "ordered once, alone, after settling"
        );
        rig
    }

    #[test]
    fn a_new_primary_key_moves_the_account_at_once() {
        let reseals = |actions: &[Action]| {
            actions
                .iter()
                .filter(|a| matches!(a, Action::ResealAccount))
                .count()
        };
        let mut rig = Rig::new("a", &["a.example.com", "b.example.com"]);
        rig.tick();
        let quiet = rig.tick();
        assert_eq!((reseals(&quiet), reads(&quiet).len()), (0, 0), "{quiet:?}");
        assert!(rig.step(Input::KeyRingChanged).is_empty());
        // The next pass reads every record (a read reseals one sealed under
        // an older key) and moves the account, long before a full check.
        let moved = rig.tick();
        assert_eq!(reseals(&moved), 1, "{moved:?}");
        assert_eq!(
            reads(&moved),
            vec!["a.example.com".to_owned(), "b.example.com".to_owned()]
        );
        // Without an acme section there is no account to move.
        let mut machine = Machine::new(settings("a"), rig.clock.now());
        machine.step(Input::KeyRingChanged, rig.clock.now());
        assert_eq!(reseals(&machine.step(Input::Tick, rig.clock.now())), 0);
    }

    #[test]
    fn a_busy_lock_is_left_alone_until_its_wait_passed() {
        let host = "a.example.com";
        let mut rig = ordering_alone(host);
        let busy = Duration::from_secs(5);
        rig.finish(host, OrderOutcome::Busy { wait: busy });
        // Twenty passes with views, peer lists and read answers in between:
        // no new attempt while the lease holder may still be at it.
        let early = rig.run_for(busy - Duration::from_millis(500), &["a"], false);
        assert!(
            early.is_empty(),
            "ordered again while the lock is busy: {early:?}"
        );
        let later = rig.run_for(Duration::from_secs(2), &["a"], false);
        assert_eq!(
            later,
            vec![host.to_owned()],
            "tried again once the wait passed"
        );
    }

    #[test]
    fn an_unanswered_challenge_waits_without_a_failure_and_says_why_until_it_is_answered() {
        let host = "a.example.com";
        let mut rig = ordering_alone(host);
        let unanswered = || {
            OrderOutcome::Unanswered(Unanswered::Unreachable {
                host: host.into(),
                target: "http://demo-svc:80".into(),
                error: "connection refused".into(),
            })
        };
        let waiting_reports = |actions: &[Action]| -> Vec<Option<String>> {
            actions
                .iter()
                .filter_map(|a| match a {
                    Action::Report(Report::Waiting { reason, .. }) => Some(reason.clone()),
                    _ => None,
                })
                .collect()
        };
        let actions = rig.finish(host, unanswered());
        let said = waiting_reports(&actions);
        assert_eq!(said.len(), 1, "{actions:?}");
        assert!(
            said[0]
                .as_deref()
                .is_some_and(|r| r.contains("not answered at http://demo-svc:80")),
            "{said:?}"
        );
        let status = rig.machine.status();
        assert_eq!(status.waiting.len(), 1, "{status:?}");
        assert_eq!(status.waiting[0].host, host);
        let since = status.waiting[0].since_unix;
        // Not a failure: no backoff, tried again after a second.
        assert_eq!(rig.machine.units[host].view.failures.count, 0);
        let again = rig.run_for(Duration::from_millis(1500), &["a"], false);
        assert_eq!(
            again,
            vec![host.to_owned()],
            "checked again within a second"
        );
        // The same reason again is not said again, and keeps its start.
        let actions = rig.finish(host, unanswered());
        assert!(waiting_reports(&actions).is_empty(), "{actions:?}");
        assert_eq!(rig.machine.status().waiting[0].since_unix, since);
        // After a minute of waiting, every 10 s.
        rig.clock.advance(Duration::from_secs(60));
        rig.run_for(Duration::from_secs(1), &["a"], false);
        rig.finish(host, unanswered());
        let early = rig.run_for(Duration::from_secs(8), &["a"], false);
        assert!(early.is_empty(), "{early:?}");
        assert_eq!(rig.run_for(Duration::from_secs(3), &["a"], false).len(), 1);
        // Answered at last, and issued: the status no longer says it waits.
        let now = rig.clock.unix();
        let actions = rig.finish(
            host,
            OrderOutcome::Issued(Box::new(record(host, "01", now, now + 90 * 86_400))),
        );
        assert_eq!(waiting_reports(&actions), vec![None], "{actions:?}");
        assert!(rig.machine.status().waiting.is_empty());
    }

    /// The store's record of `id` (serial `serial`, 90 days) read, and its
    /// install for the proxy done.
    fn read_and_install(rig: &mut Rig, id: &str, serial: &str) {
        let now = rig.clock.unix();
        let install = rig.step(Input::RecordRead {
            id: id.into(),
            result: Ok(Some(record(id, serial, now, now + 90 * DAY))),
        });
        assert!(
            install
                .iter()
                .any(|a| matches!(a, Action::InstallRecord { .. })),
            "{install:?}"
        );
        rig.step(Input::Installed {
            id: id.into(),
            result: Ok((
                Local {
                    names: vec![id.into()],
                    serial: serial.into(),
                    not_after_unix: now + 90 * DAY,
                    placeholder: false,
                },
                true,
            )),
        });
    }

    /// `settled` of the status these actions publish, if they publish one.
    fn published(actions: &[Action]) -> Option<bool> {
        actions.iter().find_map(|a| match a {
            Action::PublishStatus(s) => Some(s.settled),
            _ => None,
        })
    }

    #[test]
    fn the_status_says_settled_once_every_record_was_read_and_written() {
        // Nothing stored: settled at its first read, published at once.
        let mut rig = Rig::new("a", &["a.example.com"]);
        assert!(!rig.machine.status().settled, "nothing read yet");
        assert_eq!(reads(&rig.step(Input::Tick)).len(), 1);
        rig.step(Input::RecordRead {
            id: "a.example.com".into(),
            result: Ok(None),
        });
        assert_eq!(published(&rig.step(Input::Tick)), Some(true));

        let mut rig = Rig::new("a", &["a.example.com", "b.example.com"]);
        // a: nothing stored; b: a certificate, to be written.
        let asked = reads(&rig.step(Input::Tick));
        assert_eq!(asked.len(), 2, "{asked:?}");
        rig.step(Input::RecordRead {
            id: "a.example.com".into(),
            result: Ok(None),
        });
        let now = rig.clock.unix();
        let install = rig.step(Input::RecordRead {
            id: "b.example.com".into(),
            result: Ok(Some(record("b.example.com", "0b", now, now + 90 * DAY))),
        });
        assert!(
            install
                .iter()
                .any(|a| matches!(a, Action::InstallRecord { .. })),
            "{install:?}"
        );
        assert_eq!(
            published(&rig.step(Input::Tick)),
            Some(false),
            "b is being written"
        );
        let written = Local {
            names: vec!["b.example.com".into()],
            serial: "0b".into(),
            not_after_unix: now + 90 * DAY,
            placeholder: false,
        };
        rig.step(Input::Installed {
            id: "b.example.com".into(),
            result: Ok((written, true)),
        });
        assert_eq!(published(&rig.step(Input::Tick)), Some(true));
    }

    #[test]
    fn with_peers_a_unit_without_the_cas_certificate_is_not_settled() {
        // A fleet's second pod: a peer is ordering what the store lacks.
        let mut rig = Rig::new("b", &["a.example.com"]);
        rig.members(&["a", "b"], false);
        assert_eq!(reads(&rig.step(Input::Tick)).len(), 1);
        rig.step(Input::RecordRead {
            id: "a.example.com".into(),
            result: Ok(None),
        });
        assert_eq!(published(&rig.step(Input::Tick)), Some(false));
        // The peer's certificate arrives and is written: settled.
        read_and_install(&mut rig, "a.example.com", "0a");
        assert_eq!(published(&rig.step(Input::Tick)), Some(true));

        // Alone (a fleet's first pod), nothing stored: settled at its first
        // read, and unsettled again when a peer appears.
        let mut rig = Rig::new("a", &["a.example.com"]);
        rig.step(Input::Tick);
        rig.step(Input::RecordRead {
            id: "a.example.com".into(),
            result: Ok(None),
        });
        assert_eq!(published(&rig.step(Input::Tick)), Some(true));
        rig.members(&["a", "b"], false);
        assert_eq!(published(&rig.step(Input::Tick)), Some(false));
    }

    #[test]
    fn a_skew_isolated_node_orders_nothing_until_it_is_healthy() {
        let hosts = ["a.example.com", "b.example.com", "c.example.com"];
        let mut rig = Rig::new("a", &hosts);
        // Cut off by skew, it sees itself alone and would own everything.
        let ordered = rig.run_for(Duration::from_secs(30), &["a"], true);
        assert!(ordered.is_empty(), "ordered while isolated: {ordered:?}");
        // Healthy again: its view (alone) holds still, then it orders.
        let ordered = rig.run_for(Duration::from_secs(2), &["a"], false);
        assert_eq!(ordered.len(), hosts.len(), "{ordered:?}");
    }

    #[test]
    fn skew_isolation_stops_orders_of_a_node_with_peers_too() {
        let members = ["a", "b"];
        let mine = host_owned_by("a", &members);
        let mut rig = Rig::new("a", &[&mine]);
        let ordered = rig.run_for(Duration::from_secs(10), &members, true);
        assert!(ordered.is_empty(), "{ordered:?}");
        let ordered = rig.run_for(Duration::from_secs(2), &members, false);
        assert_eq!(ordered, vec![mine]);
    }

    #[test]
    fn a_shared_backoff_read_by_the_next_owner_is_honoured() {
        let host = "a.example.com";
        // Another replica failed three times, the last just now: this
        // replica's order task read that from the shared state.
        let mut rig = ordering_alone(host);
        let shared = Failures {
            count: 3,
            last_failure_unix: rig.clock.unix(),
            retry_after_unix: None,
        };
        let next = shared.next_attempt_unix();
        assert_eq!(next, rig.clock.unix() + 240);
        rig.finish(host, OrderOutcome::BackingOff(shared.clone()));
        assert_eq!(rig.machine.failures(host), Some(&shared));
        let early = rig.run_for(Duration::from_secs(239), &["a"], false);
        assert!(
            early.is_empty(),
            "ordered inside the shared backoff: {early:?}"
        );
        let later = rig.run_for(Duration::from_secs(2), &["a"], false);
        assert_eq!(later, vec![host.to_owned()]);
    }

    #[test]
    fn retry_after_is_honoured_beyond_the_backoff() {
        let host = "a.example.com";
        let mut rig = ordering_alone(host);
        // The CA said "Retry-After: 1800" on the first failure, whose own
        // backoff would be 60 s; the store did not take the failure, so
        // this replica records it itself.
        rig.finish(
            host,
            OrderOutcome::Failed {
                error: OrderError::Order(AcmeError::Refused {
                    op: "create the order",
                    problem_type: "rateLimited".into(),
                    detail: "rate limited".into(),
                    status: Some(429),
                    retry_after: Some(Duration::from_secs(1800)),
                }),
                shared: None,
            },
        );
        let early = rig.run_for(Duration::from_secs(1790), &["a"], false);
        assert!(early.is_empty(), "ordered before Retry-After: {early:?}");
        let later = rig.run_for(Duration::from_secs(20), &["a"], false);
        assert_eq!(later, vec![host.to_owned()]);
    }

    #[test]
    fn a_failing_order_is_in_status_with_its_error_until_it_issues() {
        let host = "a.example.com";
        let mut rig = ordering_alone(host);
        let failed = || OrderOutcome::Failed {
            error: OrderError::Order(AcmeError::Dns {
                message: "TXT _acme-challenge.a.example.com. not served by every \
                          authoritative server within 120s"
                    .into(),
            }),
            shared: None,
        };
        let first = rig.clock.unix();
        rig.finish(host, failed());
        let status = rig.machine.status();
        let [failing] = status.failing.as_slice() else {
            panic!("one failing order: {:?}", status.failing);
        };
        assert_eq!(failing.host, host);
        assert_eq!(failing.since_unix, first);
        assert!(
            failing
                .error
                .contains("not served by every authoritative server")
        );
        assert_eq!(
            failing.retry_at_unix,
            rig.machine.failures(host).unwrap().next_attempt_unix()
        );
        // Failing again keeps the first failure's time.
        let ordered = rig.run_for(Duration::from_secs(61), &["a"], false);
        assert_eq!(ordered, vec![host.to_owned()]);
        rig.finish(host, failed());
        assert_eq!(rig.machine.status().failing[0].since_unix, first);
        // Issued: no longer failing.
        let ordered = rig.run_for(Duration::from_secs(121), &["a"], false);
        assert_eq!(ordered, vec![host.to_owned()]);
        let now = rig.clock.unix();
        rig.finish(
            host,
            OrderOutcome::Issued(Box::new(record(host, "01", now, now + 90 * 86_400))),
        );
        assert!(rig.machine.status().failing.is_empty());
    }

    #[test]
    fn a_failure_reports_the_shared_backoff() {
        let host = "a.example.com";
        let mut rig = ordering_alone(host);
        let shared = Failures {
            count: 2,
            last_failure_unix: rig.clock.unix(),
            retry_after_unix: Some(rig.clock.unix() + 600),
        };
        let actions = rig.finish(
            host,
            OrderOutcome::Failed {
                error: OrderError::Order(AcmeError::Unreachable {
                    op: "create the order",
                    message: "CA down".into(),
                    retry_after: Some(Duration::from_secs(600)),
                }),
                shared: Some(shared.clone()),
            },
        );
        assert!(actions.iter().any(|a| matches!(
            a,
            Action::Report(Report::OrderFailed { id, deferred: false, failures, .. })
                if id == host && *failures == shared
        )));
        let early = rig.run_for(Duration::from_secs(590), &["a"], false);
        assert!(early.is_empty(), "{early:?}");
        assert_eq!(
            rig.run_for(Duration::from_secs(20), &["a"], false),
            vec![host.to_owned()]
        );
    }

    #[test]
    fn only_the_owner_orders_and_only_once_the_view_holds_still() {
        let both = ["a", "b"];
        let mine = host_owned_by("a", &both);
        let theirs = host_owned_by("b", &both);
        let mut rig = Rig::new("a", &[&mine, &theirs]);
        let ordered = rig.run_for(Duration::from_secs(5), &both, false);
        assert_eq!(ordered, vec![mine.clone()], "only its own unit");
        rig.finish(
            &mine,
            OrderOutcome::Issued(Box::new(record(
                &mine,
                "01",
                rig.clock.unix(),
                rig.clock.unix() + 90 * DAY,
            ))),
        );
        // b goes: its unit moves to a, but not before the new view held
        // still for VIEW_STABLE_FOR.
        rig.members(&["a"], false);
        let right_after = rig.run_for(VIEW_STABLE_FOR - Duration::from_millis(250), &["a"], false);
        assert!(
            right_after.is_empty(),
            "ordered on an unsettled view: {right_after:?}"
        );
        let ordered = rig.run_for(Duration::from_millis(500), &["a"], false);
        assert_eq!(ordered, vec![theirs.clone()]);
        // A view that keeps changing never orders.
        let mut rig = Rig::new("a", &[&mine]);
        let mut ordered = Vec::new();
        for round in 0..40 {
            let alive: &[&str] = if round % 2 == 0 { &both } else { &["a", "c"] };
            ordered.extend(rig.run_for(Duration::from_millis(500), alive, false));
        }
        assert!(ordered.is_empty(), "{ordered:?}");
    }

    #[test]
    fn a_pod_local_store_with_peers_orders_nothing() {
        let mut settings = settings("a");
        settings.store_backend = "redb".into();
        settings.store_shared = false;
        let both = ["a", "b"];
        let mine = host_owned_by("a", &both);
        let mut rig = Rig::with(settings, &[&mine]);
        rig.members(&both, false);
        let actions = rig.tick();
        assert!(actions.iter().any(|a| matches!(
            a,
            Action::Report(Report::Refusal(Some(r))) if r.contains("redb")
        )));
        assert!(
            rig.run_for(Duration::from_secs(10), &both, false)
                .is_empty()
        );
        assert!(rig.machine.status().refusal.is_some());
    }

    #[test]
    fn a_missing_certificate_is_looked_up_at_its_cadence_and_a_real_one_is_not() {
        let host = "a.example.com";
        let mut rig = Rig::new("a", &[host]);
        // At once (unchecked), then every missing_check_every.
        let first = rig.tick();
        assert_eq!(reads(&first), vec![host.to_owned()]);
        let mut read_at = Vec::new();
        for _ in 0..40 {
            rig.clock.advance(Duration::from_millis(250));
            if !reads(&rig.tick()).is_empty() {
                read_at.push(rig.clock.elapsed.as_millis());
            }
        }
        assert_eq!(read_at, vec![2000, 4000, 6000, 8000, 10000]);
        // A store read in flight is not repeated.
        rig.clock.advance(Duration::from_secs(2));
        assert_eq!(reads(&rig.step(Input::Tick)).len(), 1);
        rig.clock.advance(Duration::from_secs(2));
        assert!(
            reads(&rig.step(Input::Tick)).is_empty(),
            "a second read while one runs"
        );
        // A real certificate arrives: installed, then read only at the
        // full check.
        let now = rig.clock.unix();
        let got = rig.step(Input::RecordRead {
            id: host.into(),
            result: Ok(Some(record(host, "01", now, now + 90 * DAY))),
        });
        let installed = got.iter().any(|a| {
            matches!(a, Action::InstallRecord { unit, record } if unit.id == host && record.serial == "01")
        });
        assert!(installed, "{got:?}");
        let answer = rig.step(Input::Installed {
            id: host.into(),
            result: Ok((
                Local {
                    serial: "01".into(),
                    not_after_unix: now + 90 * DAY,
                    names: vec![host.into()],
                    placeholder: false,
                },
                true,
            )),
        });
        assert!(
            answer
                .iter()
                .any(|a| matches!(a, Action::CertificatesChanged))
        );
        let mut read_at = Vec::new();
        while rig.clock.elapsed < Duration::from_secs(130) {
            rig.clock.advance(Duration::from_millis(250));
            if !reads(&rig.tick()).is_empty() {
                read_at.push(rig.clock.elapsed.as_secs());
            }
        }
        // The check already scheduled while it was missing, then only the
        // full checks.
        assert_eq!(read_at, vec![14, 60, 120]);
    }

    #[test]
    fn a_peer_announcement_is_read_at_once_but_a_failed_read_waits() {
        let host = "a.example.com";
        let mut rig = Rig::new("a", &[host]);
        let now = rig.clock.unix();
        rig.step(Input::RecordRead {
            id: host.into(),
            result: Ok(Some(record(host, "01", now, now + 90 * DAY))),
        });
        rig.step(Input::Installed {
            id: host.into(),
            result: Ok((
                Local {
                    serial: "01".into(),
                    not_after_unix: now + 90 * DAY,
                    names: vec![host.into()],
                    placeholder: false,
                },
                true,
            )),
        });
        assert!(reads(&rig.tick()).is_empty());
        let announce = |serial: &str| {
            Input::PeerCerts(vec![CertificateInfo {
                host: host.into(),
                not_after_unix: now + 90 * DAY,
                serial: serial.into(),
                names: Vec::new(),
                placeholder: false,
            }])
        };
        // What we have already: nothing to read.
        rig.step(announce("01"));
        assert!(reads(&rig.tick()).is_empty());
        // A new serial: read at the next pass.
        rig.step(announce("02"));
        assert_eq!(reads(&rig.step(Input::Tick)), vec![host.to_owned()]);
        // The record cannot be opened: not read again for a while, however
        // often the peer announces it.
        rig.step(Input::RecordRead {
            id: host.into(),
            result: Err(unreadable("sealed under a key not in the ring")),
        });
        let mut read_at = Vec::new();
        for _ in 0..24 {
            rig.clock.advance(Duration::from_millis(250));
            rig.step(announce("02"));
            let actions = rig.step(Input::Tick);
            if !reads(&actions).is_empty() {
                read_at.push(rig.clock.elapsed.as_millis());
                rig.step(Input::RecordRead {
                    id: host.into(),
                    result: Err(unreadable("still not")),
                });
            }
        }
        assert_eq!(read_at, vec![5000]);
    }

    #[test]
    fn placeholders_are_written_where_nothing_usable_is_on_disk() {
        let clock = Clock::new();
        let mut machine = Machine::new(settings("a"), clock.now());
        let now = clock.unix();
        let real = Local {
            serial: "01".into(),
            not_after_unix: now + 90 * DAY,
            names: vec!["b.example.com".into()],
            placeholder: false,
        };
        let actions = machine.step(
            Input::ConfigChanged {
                units: vec![
                    (CertUnit::per_host("a.example.com"), None),
                    (CertUnit::per_host("b.example.com"), Some(real)),
                ],
                not_eligible: vec!["*.example.com".into()],
                ordering: None,
            },
            clock.now(),
        );
        let written: Vec<&str> = actions
            .iter()
            .filter_map(|a| match a {
                Action::WritePlaceholder(u) => Some(u.id.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(written, vec!["a.example.com"], "only where nothing real is");
        assert!(
            actions.iter().all(|a| !matches!(a, Action::ResealAccount)),
            "no acme section: no account"
        );
        let status = actions.iter().find_map(|a| match a {
            Action::PublishStatus(s) => Some(s),
            _ => None,
        });
        assert_eq!(
            status.map(|s| s.not_eligible.clone()),
            Some(vec!["*.example.com".to_owned()])
        );
        // The write fails: not tried again, not even at the full check.
        machine.step(
            Input::PlaceholderWritten {
                id: "a.example.com".into(),
                result: Err(PlaceholderError::Write(io::Error::other(
                    "read-only file system",
                ))),
            },
            clock.now(),
        );
        let mut later = clock.now();
        later.mono += Duration::from_secs(61);
        later.unix_ms += 61_000;
        let actions = machine.step(Input::Tick, later);
        assert!(
            actions
                .iter()
                .all(|a| !matches!(a, Action::WritePlaceholder(_))),
            "{actions:?}"
        );
        // Nothing is ordered without an acme section.
        assert!(orders(&actions).is_empty());
    }

    #[test]
    fn a_placeholder_about_to_expire_is_renewed_at_the_full_check() {
        let clock = Clock::new();
        let mut machine = Machine::new(settings("a"), clock.now());
        let now = clock.unix();
        let unit = CertUnit::per_host("a.example.com");
        let old = Local {
            serial: "p1".into(),
            not_after_unix: now + PLACEHOLDER_REFRESH_SECS + 30,
            names: unit.names.clone(),
            placeholder: true,
        };
        let actions = machine.step(
            Input::ConfigChanged {
                units: vec![(unit.clone(), Some(old))],
                not_eligible: Vec::new(),
                ordering: None,
            },
            clock.now(),
        );
        assert!(
            actions
                .iter()
                .all(|a| !matches!(a, Action::WritePlaceholder(_)))
        );
        let mut later = clock.now();
        later.mono += Duration::from_secs(60);
        later.unix_ms += 60_000;
        let actions = machine.step(Input::Tick, later);
        assert!(
            actions
                .iter()
                .any(|a| matches!(a, Action::WritePlaceholder(u) if *u == unit)),
            "{actions:?}"
        );
    }

    #[test]
    fn no_placeholder_over_a_certificate_being_installed() {
        let host = "a.example.com";
        let mut rig = Rig::new("a", &[host]);
        rig.step(Input::PlaceholderWritten {
            id: host.into(),
            result: Ok(Local {
                serial: "p1".into(),
                not_after_unix: rig.clock.unix() + 60,
                names: vec![host.into()],
                placeholder: true,
            }),
        });
        // At the full check, the real certificate's read answer and the
        // placeholder renewal meet: the install wins.
        rig.clock.advance(Duration::from_secs(60));
        let now = rig.clock.unix();
        rig.step(Input::RecordRead {
            id: host.into(),
            result: Ok(Some(record(host, "01", now, now + 90 * DAY))),
        });
        let actions = rig.step(Input::Tick);
        assert!(
            actions
                .iter()
                .all(|a| !matches!(a, Action::WritePlaceholder(_))),
            "{actions:?}"
        );
    }

    #[test]
    fn at_most_max_concurrent_orders_run_at_once() {
        let hosts: Vec<String> = (0..5).map(|i| format!("h{i}.example.com")).collect();
        let refs: Vec<&str> = hosts.iter().map(String::as_str).collect();
        let mut settings = settings("a");
        settings.max_concurrent_orders = 2;
        let mut rig = Rig::with(settings, &refs);
        let ordered = rig.run_for(Duration::from_secs(10), &["a"], false);
        assert_eq!(ordered.len(), 2, "{ordered:?}");
        let now = rig.clock.unix();
        rig.finish(
            &ordered[0],
            OrderOutcome::Issued(Box::new(record(&ordered[0], "01", now, now + 90 * DAY))),
        );
        let more = rig.run_for(Duration::from_secs(1), &["a"], false);
        assert_eq!(more.len(), 1, "{more:?}");
    }

    #[test]
    fn the_owner_asks_the_ca_for_a_renewal_window_once_until_told_to_ask_again() {
        let both = ["a", "b"];
        let mine = host_owned_by("a", &both);
        let theirs = host_owned_by("b", &both);
        let mut rig = Rig::new("a", &[&mine, &theirs]);
        let now = rig.clock.unix();
        for host in [&mine, &theirs] {
            rig.step(Input::RecordRead {
                id: host.clone(),
                result: Ok(Some(record(host, "01", now, now + 90 * DAY))),
            });
        }
        let asked = |actions: &[Action]| -> Vec<String> {
            actions
                .iter()
                .filter_map(|a| match a {
                    Action::AskAri { unit, serial } => Some(format!("{}#{serial}", unit.id)),
                    _ => None,
                })
                .collect()
        };
        // No ARI at the CA (or no account yet): nothing asked.
        let mut got = Vec::new();
        for _ in 0..20 {
            rig.clock.advance(Duration::from_millis(250));
            rig.members(&both, false);
            got.extend(asked(&rig.step(Input::Tick)));
        }
        assert!(got.is_empty(), "{got:?}");
        rig.step(Input::AriOffered(true));
        let first = asked(&rig.step(Input::Tick));
        assert_eq!(first, vec![format!("{mine}#01")], "the owner's unit only");
        // The answer says when to ask again: not before.
        let window = AriWindow {
            start_unix: now + 10 * DAY,
            end_unix: now + 11 * DAY,
        };
        rig.step(Input::AriAnswered {
            id: mine.clone(),
            serial: "01".into(),
            window: Some(window),
            next_check_unix: rig.clock.unix() + 3600,
        });
        let mut got = Vec::new();
        for _ in 0..3599 {
            rig.clock.advance(Duration::from_secs(1));
            got.extend(asked(&rig.step(Input::Tick)));
        }
        assert!(got.is_empty(), "{got:?}");
        rig.clock.advance(Duration::from_secs(2));
        assert_eq!(asked(&rig.step(Input::Tick)), vec![format!("{mine}#01")]);
        // The window moved the renewal inside it: ordered there, not at
        // two thirds of the lifetime.
        rig.clock.advance(Duration::from_secs(11 * DAY));
        let ordered = rig.run_for(Duration::from_secs(1), &both, false);
        assert_eq!(ordered, vec![mine.clone()]);
    }

    /// A record the store holds but this node cannot use.
    fn unreadable(message: &str) -> StoreError {
        StoreError::Corrupt {
            key: "acme/certs/a.example.com".into(),
            message: message.into(),
        }
    }

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
}
