//! ACME DNS-01 (docs/reference.md#dns-01): the TXT records that prove a
//! name, written and removed by the one replica that holds the order's
//! lock, through a provider:
//!
//! - `rfc2136`: a dynamic update (RFC 2136) signed with TSIG, sent to the
//!   zone's primary server (`rfc2136.rs`);
//! - `exec`: a command of the user's, `present|cleanup FQDN VALUE`;
//! - `route53`: the AWS API (`route53.rs`).
//!
//! Before the CA is told to look, every authoritative server of the zone
//! must serve every value (`lookup`; for Route 53, its own `INSYNC`): no
//! fixed sleep. What was written is
//! kept in the store's ledger of the unit (the order's `dns01` record,
//! [`Ledger`]) before it is written, so the next holder of the lock removes
//! what a replica that died left behind.
//!
//! `wire` builds and reads the messages without I/O; `transport` moves
//! their bytes; this file and the providers are the shell.

mod exec;
mod lookup;
mod rfc2136;
mod route53;
mod transport;
mod wire;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::rr::Name;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use tracing::{debug, info, warn};

use crate::acme::account::AcmeError;
use crate::acme::layout;
use crate::config::{Dns01Section, DnsProvider};
use crate::metrics::Metrics;
use crate::store::lock::{Lease, LeaseKeeper, LeaseLock, get_fenced, put_fenced};
use crate::store::{Store, StoreError};

/// How long a change of a TXT record waits for another order's change of
/// the same name, at least (twice the lock's TTL when that is longer).
const RECORD_LOCK_WAIT: Duration = Duration::from_secs(120);

pub(crate) use lookup::Resolvers;

/// Looks up an environment variable (the process's; a test's map).
pub(crate) type Env = fn(&str) -> Option<String>;

/// Why a DNS-01 step failed; each names what was wrong and where.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DnsError {
    /// The `dns01` settings cannot work (a secret missing, no resolver).
    #[error("DNS-01 settings: {0}")]
    Config(String),
    /// A DNS server did not answer.
    #[error("the DNS server {server} did not answer ({detail}) while trying to {op}")]
    Unreachable {
        server: String,
        op: &'static str,
        detail: String,
    },
    /// The primary does not serve a zone holding the name.
    #[error(
        "the DNS server {server} serves no zone holding {fqdn} ({detail}); nameserver must be \
         the primary of the zone the record goes in (after _acme-challenge CNAMEs)"
    )]
    NoZone {
        server: String,
        fqdn: String,
        detail: String,
    },
    /// The server refused the update.
    #[error("the DNS server {server} refused to {op} the TXT record {fqdn}: {why}")]
    Refused {
        server: String,
        op: &'static str,
        fqdn: String,
        why: String,
    },
    /// A resolver could not answer a question the check needs.
    #[error("cannot look up {rtype} {name}: {detail}")]
    Lookup {
        name: String,
        rtype: String,
        detail: String,
    },
    /// Not every authoritative server served the record in time.
    #[error(
        "TXT {fqdn} not served by every authoritative server within {timeout:?} \
         (propagation_timeout): {pending}"
    )]
    NotPropagated {
        fqdn: String,
        timeout: Duration,
        pending: String,
    },
    /// The exec provider's command failed.
    #[error("{command} {op} failed: {detail}")]
    Hook {
        command: String,
        op: &'static str,
        detail: String,
    },
    /// A provider's API refused or failed a call.
    #[error("DNS provider {provider} failed to {op}: {detail}")]
    Provider {
        provider: &'static str,
        op: &'static str,
        detail: String,
    },
}

/// One TXT record of a DNS-01 challenge: where and what.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TxtRecord {
    /// Absolute name, with its trailing dot (after CNAMEs).
    pub(crate) fqdn: String,
    /// The challenge's value (base64url of the key authorization's digest).
    pub(crate) value: String,
}

impl TxtRecord {
    fn name(&self) -> Result<Name, DnsError> {
        Name::from_ascii(&self.fqdn)
            .map_err(|e| DnsError::Config(format!("{}: not a DNS name: {e}", self.fqdn)))
    }
}

/// The store's record of the TXT records an order wrote and has not
/// removed yet (written before each is, emptied once all are removed).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Ledger {
    /// The provider they were written through.
    pub(crate) provider: String,
    /// The lock holder that wrote them.
    pub(crate) holder: String,
    pub(crate) records: Vec<TxtRecord>,
}

enum Provider {
    Rfc2136(rfc2136::Rfc2136),
    Exec(exec::Exec),
    Route53(Box<route53::Route53>),
}

impl Provider {
    /// Whether a change returns only once the zone's authoritative servers
    /// serve it (Route 53's `INSYNC`, on servers that are all Route 53's):
    /// the change's own wait is then the propagation, and nobody else asks.
    fn confirms_propagation(&self) -> bool {
        matches!(self, Provider::Route53(_))
    }
}

/// The DNS-01 side of orders: the provider, the resolvers and the
/// propagation time-out of one `dns01` block.
pub(crate) struct Dns01 {
    kind: DnsProvider,
    provider: Provider,
    resolvers: Resolvers,
    propagation_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Dns01 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dns01")
            .field("provider", &self.kind)
            .field("resolvers", &self.resolvers)
            .finish_non_exhaustive()
    }
}

impl Dns01 {
    /// The provider of `section`, its secrets resolved through `env` and
    /// the file system; `resolvers` are `--acme-dns-resolvers` (empty:
    /// `/etc/resolv.conf`). Built once per `dns01` block and kept for every
    /// order (the Route 53 credentials and client with it).
    pub(crate) fn new(
        section: &Dns01Section,
        resolvers: &[SocketAddr],
        env: Env,
        metrics: Arc<Metrics>,
    ) -> Result<Self, DnsError> {
        let provider = match section.provider {
            DnsProvider::Rfc2136 => Provider::Rfc2136(rfc2136::Rfc2136::new(section, env)?),
            DnsProvider::Exec => Provider::Exec(exec::Exec::new(section)?),
            DnsProvider::Route53 => Provider::Route53(Box::new(route53::Route53::new(section)?)),
        };
        Ok(Self {
            kind: section.provider,
            provider,
            resolvers: Resolvers::new(resolvers)?,
            propagation_timeout: section.propagation_timeout,
            metrics,
        })
    }

    /// The provider's name, as `sb.yml` writes it.
    pub(crate) fn provider_name(&self) -> &'static str {
        self.kind.as_str()
    }

    /// The TXT record proving `host` (`*.` dropped), CNAMEs followed.
    pub(crate) async fn record_for(
        &self,
        host: &str,
        value: String,
    ) -> Result<TxtRecord, DnsError> {
        let name = self.resolvers.challenge_name(host).await?;
        Ok(TxtRecord {
            fqdn: name.to_string(),
            value,
        })
    }

    /// Writes `record`.
    pub(crate) async fn present(&self, record: &TxtRecord) -> Result<(), DnsError> {
        let started = Instant::now();
        let result = self.change(record, true).await;
        self.metrics
            .acme
            .dns_update(self.provider_name(), "present", result.is_ok());
        if self.provider.confirms_propagation() && result.is_ok() {
            self.metrics
                .acme
                .dns_propagation_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        result
    }

    /// Removes `record` (nothing when it is not there).
    pub(crate) async fn cleanup(&self, record: &TxtRecord) -> Result<(), DnsError> {
        let result = self.change(record, false).await;
        self.metrics
            .acme
            .dns_update(self.provider_name(), "cleanup", result.is_ok());
        result
    }

    async fn change(&self, record: &TxtRecord, add: bool) -> Result<(), DnsError> {
        let fqdn = record.name()?;
        match &self.provider {
            Provider::Rfc2136(p) => p.change(&fqdn, &record.value, add).await,
            Provider::Exec(p) => p.run(add, &record.fqdn, &record.value).await,
            Provider::Route53(p) => p.change(&fqdn, &record.value, add).await,
        }
    }

    /// Waits until every authoritative server of each record's zone serves
    /// every value at its name; records the time in
    /// `acme_dns_propagation_seconds`.
    pub(crate) async fn wait_served(&self, records: &[TxtRecord]) -> Result<(), DnsError> {
        if self.provider.confirms_propagation() {
            return Ok(());
        }
        let started = Instant::now();
        let mut by_name: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for r in records {
            by_name.entry(&r.fqdn).or_default().push(r.value.clone());
        }
        for (fqdn, values) in by_name {
            let name = Name::from_ascii(fqdn)
                .map_err(|e| DnsError::Config(format!("{fqdn}: not a DNS name: {e}")))?;
            let zone = self.resolvers.zone_of(&name).await?;
            let authorities = self.resolvers.authorities(&zone).await?;
            let left = self.propagation_timeout.saturating_sub(started.elapsed());
            lookup::wait_served(&authorities, &name, &values, left)
                .await
                .map_err(|e| match e {
                    DnsError::NotPropagated { fqdn, pending, .. } => DnsError::NotPropagated {
                        fqdn,
                        timeout: self.propagation_timeout,
                        pending,
                    },
                    other => other,
                })?;
        }
        self.metrics
            .acme
            .dns_propagation_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(())
    }
}

/// The DNS-01 side of one order, under its lock: what it writes is noted
/// in the unit's ledger (fenced by the lease) before it is written, and
/// removed when the order ends.
pub(crate) struct Dns01Order<'a> {
    dns: &'a Dns01,
    store: &'a Arc<dyn Store>,
    ledger_key: String,
    lease: Lease,
    holder: &'a str,
    /// Written by this order and not removed yet.
    written: std::sync::Mutex<Vec<TxtRecord>>,
}

impl std::fmt::Debug for Dns01Order<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dns01Order")
            .field("dns", &self.dns)
            .field("ledger_key", &self.ledger_key)
            .finish_non_exhaustive()
    }
}

fn dns_error(e: impl std::fmt::Display) -> AcmeError {
    AcmeError::Dns {
        message: e.to_string(),
    }
}

impl<'a> Dns01Order<'a> {
    /// The order of the unit whose ledger is `ledger_key`, under `lease`.
    pub(crate) fn new(
        dns: &'a Dns01,
        store: &'a Arc<dyn Store>,
        ledger_key: String,
        lease: Lease,
        holder: &'a str,
    ) -> Self {
        Self {
            dns,
            store,
            ledger_key,
            lease,
            holder,
            written: std::sync::Mutex::new(Vec::new()),
        }
    }

    async fn read_ledger(&self) -> Result<Ledger, StoreError> {
        match get_fenced(self.store.as_ref(), &self.ledger_key).await? {
            None => Ok(Ledger::default()),
            Some(entry) => serde_json::from_slice(&entry.value).map_err(|e| StoreError::Corrupt {
                key: self.ledger_key.clone(),
                message: format!("not a DNS-01 ledger ({e}); delete it to reset"),
            }),
        }
    }

    async fn write_ledger(&self, records: Vec<TxtRecord>) -> Result<(), StoreError> {
        let ledger = Ledger {
            provider: self.dns.provider_name().to_owned(),
            holder: self.holder.to_owned(),
            records,
        };
        let bytes = serde_json::to_vec(&ledger).map_err(|e| StoreError::Corrupt {
            key: self.ledger_key.clone(),
            message: format!("cannot encode: {e}"),
        })?;
        put_fenced(self.store.as_ref(), &self.ledger_key, &bytes, &self.lease)
            .await
            .map(|_| ())
    }

    /// Writes (`add`) or removes `record`, holding the store's lock of its
    /// name ([`layout::dns_record_lock`]). Two orders of different
    /// certificates can write one name at once (`*.example.com` and
    /// `example.com`, ordered per host by two replicas), and a provider
    /// whose change reads the name's values and writes them back (Route 53
    /// keeps one set per name) would lose one of them; under the lock the
    /// two changes take turns. The lock has the order lock's TTL and is
    /// renewed while the change runs, so a holder that dies mid-change
    /// frees the name when it frees its order.
    async fn change(&self, record: &TxtRecord, add: bool) -> Result<(), AcmeError> {
        let lock = LeaseLock::new(
            Arc::clone(self.store),
            &layout::dns_record_lock(&record.fqdn),
        );
        let ttl = self.lease.ttl;
        let wait = RECORD_LOCK_WAIT.max(ttl * 2);
        let lease = lock
            .acquire(self.holder, ttl, wait)
            .await
            .map_err(|source| AcmeError::Store {
                op: "lock the DNS-01 record's name",
                source,
            })?
            .ok_or_else(|| {
                dns_error(format!(
                    "{}: another order held this name's lock for {}s; the order tries again later",
                    record.fqdn,
                    wait.as_secs()
                ))
            })?;
        let keeper = LeaseKeeper::spawn(lock, lease);
        let changed = if add {
            self.dns.present(record).await
        } else {
            self.dns.cleanup(record).await
        };
        if let Err(e) = keeper.release().await {
            debug!(fqdn = %record.fqdn, error = %e, "DNS-01 record lock not released; it expires");
        }
        changed.map_err(dns_error)
    }

    /// Removes the records an earlier holder of the lock wrote and did not
    /// remove (it died, or its removal failed); how many there were.
    pub(crate) async fn clear_leftovers(&self) -> Result<usize, AcmeError> {
        let ledger = self
            .read_ledger()
            .await
            .map_err(|source| AcmeError::Store {
                op: "read the DNS-01 ledger",
                source,
            })?;
        if ledger.records.is_empty() {
            return Ok(0);
        }
        info!(
            ledger = %self.ledger_key,
            previous = %ledger.holder,
            records = ledger.records.len(),
            provider = %ledger.provider,
            "removing DNS-01 records an earlier order left"
        );
        let mut left = Vec::new();
        for record in &ledger.records {
            if let Err(e) = self.change(record, false).await {
                warn!(fqdn = %record.fqdn, error = %e, "DNS-01 record left by an earlier order not removed");
                left.push(record.clone());
            }
        }
        let count = ledger.records.len();
        self.write_ledger(left.clone())
            .await
            .map_err(|source| AcmeError::Store {
                op: "write the DNS-01 ledger",
                source,
            })?;
        if left.is_empty() {
            Ok(count)
        } else {
            Err(dns_error(format!(
                "{} record(s) an earlier order wrote could not be removed; the order waits \
                 until they are",
                left.len()
            )))
        }
    }

    /// Writes a TXT record for each `(name, value)` (noted in the ledger
    /// first), then waits until every authoritative server serves them all.
    pub(crate) async fn present_all(&self, values: Vec<(String, String)>) -> Result<(), AcmeError> {
        let mut records = Vec::with_capacity(values.len());
        for (name, value) in values {
            records.push(self.dns.record_for(&name, value).await.map_err(dns_error)?);
        }
        let mut noted = self.written.lock().expect("not poisoned").clone();
        noted.extend(records.iter().cloned());
        self.write_ledger(noted)
            .await
            .map_err(|source| AcmeError::Store {
                op: "write the DNS-01 ledger",
                source,
            })?;
        for record in &records {
            self.written
                .lock()
                .expect("not poisoned")
                .push(record.clone());
            self.change(record, true).await?;
            debug!(fqdn = %record.fqdn, provider = self.dns.provider_name(), "DNS-01 record written");
        }
        self.dns.wait_served(&records).await.map_err(dns_error)
    }

    /// Removes every record this order wrote; the ledger is emptied when
    /// all went (a record left stays in it for the next holder).
    pub(crate) async fn cleanup_all(&self) {
        let written = std::mem::take(&mut *self.written.lock().expect("not poisoned"));
        if written.is_empty() {
            return;
        }
        let mut left = Vec::new();
        for record in written {
            if let Err(e) = self.change(&record, false).await {
                warn!(fqdn = %record.fqdn, error = %e, "DNS-01 record not removed; the next order of this certificate removes it");
                left.push(record);
            }
        }
        if let Err(e) = self.write_ledger(left).await {
            debug!(ledger = %self.ledger_key, error = %e, "DNS-01 ledger not updated");
        }
    }
}

#[cfg(test)]
mod tests;
