//! One ACME account per cluster and directory, created once and kept in the
//! shared store, and the error type of every ACME operation.
//!
//! [`load_or_create`] reads the credentials at [`layout::account`] (sealed
//! with the cluster key ring, since they hold the account's private key).
//! When there are none it takes the lease lock [`layout::account_lock`],
//! reads again (another replica may have just created them), creates the
//! account and writes the credentials create-only: N replicas starting
//! together create one account, and should the lock ever fail them (a
//! lease that expired mid-creation) the create-only write still leaves one
//! set of credentials that everyone then uses.
//!
//! Stored credentials are checked with the CA on every load (a
//! `newAccount` with `onlyReturnExisting`): an account the CA no longer
//! knows (a test CA that restarted, a deactivated account) is replaced
//! under the lock by a compare-and-swap on the stale record, so replicas do
//! not each replace it.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use base64::Engine;
use base64::prelude::{BASE64_STANDARD, BASE64_URL_SAFE, BASE64_URL_SAFE_NO_PAD};
use bytes::Bytes;
use hyper::header::USER_AGENT;
use hyper::{Method, Request};
use instant_acme::{Account, AccountCredentials, BodyWrapper, ExternalAccountKey, Key, NewAccount};
use rustls::pki_types::PrivateKeyDer;
use serde::{Deserialize, Serialize};

use super::http_client::{AcmeHttpClient, RequestError, RetryAfterCapture, error_chain};
use super::layout;
use crate::config::{AcmeSection, Eab};
use crate::keyring::KeyRing;
use crate::store::lock::LeaseLock;
use crate::store::sealed::{open_record, seal_record, sealed_key_id};
use crate::store::{Store, StoreError, Version};

/// How long the account lock is held at most (creation is three requests).
const ACCOUNT_LOCK_TTL: Duration = Duration::from_secs(120);
/// How long a replica waits for another one that is creating the account.
const ACCOUNT_LOCK_WAIT: Duration = Duration::from_secs(150);
/// Format version of the stored account record.
const RECORD_FORMAT: u8 = 1;
/// Rounds of load / create before giving up (each lost round means another
/// replica made progress).
const MAX_ROUNDS: usize = 4;

/// The ACME problem types after which retrying the same request cannot
/// succeed until someone changes the configuration or the hostname.
const PERMANENT_PROBLEMS: &[&str] = &[
    "malformed",
    "rejectedIdentifier",
    "unsupportedIdentifier",
    "externalAccountRequired",
    "invalidContact",
    "unsupportedContact",
    "badSignatureAlgorithm",
    "badPublicKey",
    "badCSR",
    "userActionRequired",
    "accountDoesNotExist",
];

/// Why an ACME operation failed. [`AcmeError::is_retryable`] tells the
/// caller whether to back off and try again, [`AcmeError::retry_after`]
/// when the CA asked it to come back.
#[derive(Debug, thiserror::Error)]
pub enum AcmeError {
    /// The configuration cannot work; nothing changes until it is fixed.
    #[error("ACME configuration: {0}")]
    Config(String),
    /// The CA could not be reached, or did not answer in time.
    #[error(
        "cannot reach the ACME CA to {op}: {message}; check directory_url, ca_root and the network path to the CA"
    )]
    Unreachable {
        /// What was being done.
        op: &'static str,
        /// What failed, with its causes.
        message: String,
        /// `Retry-After` of the last response, if any.
        retry_after: Option<Duration>,
    },
    /// The CA refused a request with a problem document (RFC 8555 6.7).
    #[error(
        "the ACME CA refused to {op}: {problem_type}: {detail}{}",
        hint(problem_type)
    )]
    Refused {
        /// What was being done.
        op: &'static str,
        /// The problem type without `urn:ietf:params:acme:error:`.
        problem_type: String,
        /// The CA's explanation, subproblems included.
        detail: String,
        /// The HTTP status of the problem, when the CA gave it.
        status: Option<u16>,
        /// When to come back (`Retry-After`), if the CA said so.
        retry_after: Option<Duration>,
    },
    /// The CA could not validate the HTTP-01 challenge of `host`.
    #[error(
        "HTTP-01 validation of {host} failed: {problem_type}: {detail}; the CA fetches http://{host}/.well-known/acme-challenge/<token>: port 80 of {host} must reach a replica's challenge listener, and every replica must share the store"
    )]
    Validation {
        /// The identifier that failed.
        host: String,
        /// The problem type without its URN prefix.
        problem_type: String,
        /// The CA's explanation.
        detail: String,
    },
    /// The CA could not validate the DNS-01 challenge of `host`.
    #[error(
        "DNS-01 validation of {host} failed: {problem_type}: {detail}; the CA looks up the TXT record at _acme-challenge of the name (its CNAMEs followed) from the zone's authoritative servers, which all served it when the CA was told to look"
    )]
    DnsValidation {
        /// The identifier that failed.
        host: String,
        /// The problem type without its URN prefix.
        problem_type: String,
        /// The CA's explanation.
        detail: String,
    },
    /// A DNS-01 step of this replica failed: the provider, a lookup, or
    /// the wait for every authoritative server to serve the record.
    #[error("DNS-01: {message}")]
    Dns {
        /// What failed and where.
        message: String,
    },
    /// The order did not reach the next state within the polling budget.
    #[error(
        "ACME order timed out trying to {op}: the CA did not move the order on in time; try again later"
    )]
    Timeout {
        /// What was being waited for.
        op: &'static str,
        /// When the CA asked to poll next, if it did.
        retry_after: Option<Duration>,
    },
    /// The caller's order lease was lost: another replica may be ordering
    /// the same hostnames now, so this order was abandoned.
    #[error(
        "order for {hosts:?} abandoned: this replica lost its order lease (another replica may be ordering now)"
    )]
    LeaseLost {
        /// The hostnames of the abandoned order.
        hosts: Vec<String>,
    },
    /// Another replica has held the account lock for too long.
    #[error(
        "lock {lock:?} was still held by another replica after {waited:?}; it expires on its own if that replica died"
    )]
    LockBusy {
        /// The lock name.
        lock: String,
        /// How long this replica waited.
        waited: Duration,
    },
    /// The shared store failed.
    #[error("store failed while trying to {op}: {source}")]
    Store {
        /// What was being done.
        op: &'static str,
        /// The store's error.
        #[source]
        source: StoreError,
    },
    /// The CA answered something this client cannot use.
    #[error("unexpected answer from the ACME CA trying to {op}: {message}")]
    Protocol {
        /// What was being done.
        op: &'static str,
        /// What was wrong.
        message: String,
    },
}

/// `text` as one line: line breaks and other control characters become
/// spaces, so an error with a CA's multi-line explanation stays one
/// record in a line-based log collector.
pub(crate) fn one_line(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    for part in text.split(|c: char| c.is_control()) {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(part);
    }
    std::borrow::Cow::Owned(out)
}

fn hint(problem_type: &str) -> &'static str {
    match problem_type {
        "rateLimited" => "; the CA rate-limits this account or hostname: waiting as it asked",
        "rejectedIdentifier" | "unsupportedIdentifier" => {
            "; the CA will not issue for this hostname: remove it from origins or use another CA"
        }
        "externalAccountRequired" => {
            "; this CA requires external account binding: set proxy.extensions.sbmesh.acme.eab {kid, hmac_key}"
        }
        "invalidContact" | "unsupportedContact" => {
            "; fix proxy.extensions.sbmesh.acme.email (or remove it)"
        }
        "userActionRequired" => "; the CA needs the account holder to act (new terms of service?)",
        "accountDoesNotExist" => "; the stored account is unknown to the CA",
        _ => "",
    }
}

impl AcmeError {
    /// Maps an instant-acme error from `op`; `capture` holds the
    /// `Retry-After` of the response that caused it.
    pub(crate) fn from_acme(
        op: &'static str,
        err: instant_acme::Error,
        capture: &RetryAfterCapture,
    ) -> Self {
        use instant_acme::Error as E;
        let retry_after = capture.remaining();
        match err {
            E::Api(problem) => {
                let problem_type = problem
                    .r#type
                    .as_deref()
                    .map(|t| t.strip_prefix("urn:ietf:params:acme:error:").unwrap_or(t))
                    .unwrap_or("unknown")
                    .to_owned();
                let mut detail = problem.detail.clone().unwrap_or_default();
                for sub in &problem.subproblems {
                    detail.push_str("; ");
                    detail.push_str(&sub.to_string());
                }
                // The CA's text goes into one log line.
                let detail = one_line(&detail).into_owned();
                AcmeError::Refused {
                    op,
                    problem_type,
                    detail,
                    status: problem.status,
                    retry_after,
                }
            }
            E::Timeout(next) => AcmeError::Timeout {
                op,
                retry_after: next
                    .map(|at| at.saturating_duration_since(std::time::Instant::now()))
                    .or(retry_after),
            },
            E::Other(inner) if inner.is::<RequestError>() => AcmeError::Unreachable {
                op,
                message: one_line(&inner.to_string()).into_owned(),
                retry_after,
            },
            E::Hyper(e) => AcmeError::Unreachable {
                op,
                message: one_line(&error_chain(&e)).into_owned(),
                retry_after,
            },
            E::InvalidUri(e) => AcmeError::Config(format!(
                "an ACME URL is not valid ({e}); check proxy.extensions.sbmesh.acme.directory_url"
            )),
            other => AcmeError::Protocol {
                op,
                message: one_line(&error_chain(&other)).into_owned(),
            },
        }
    }

    /// Whether the failed request never reached the CA: a newOrder that
    /// could not be sent (no connection, no nonce) did not count against
    /// the CA's limits, nor against the cluster's order budget.
    pub(crate) fn never_reached_ca(&self) -> bool {
        matches!(self, AcmeError::Unreachable { op, .. } if *op == "create the order")
    }

    /// Whether retrying later (with backoff) can succeed without a change
    /// of configuration.
    pub fn is_retryable(&self) -> bool {
        match self {
            AcmeError::Config(_) => false,
            AcmeError::Refused { problem_type, .. } => {
                !PERMANENT_PROBLEMS.contains(&problem_type.as_str())
            }
            _ => true,
        }
    }

    /// Whether the CA said this account or hostname hit a rate limit.
    pub fn is_rate_limited(&self) -> bool {
        matches!(self, AcmeError::Refused { problem_type, status, .. }
            if problem_type == "rateLimited" || *status == Some(429))
    }

    /// How long the CA asked to wait before the next attempt, if it did.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            AcmeError::Unreachable { retry_after, .. }
            | AcmeError::Refused { retry_after, .. }
            | AcmeError::Timeout { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// The ACME problem type (without its URN prefix), when the CA sent one.
    pub fn problem_type(&self) -> Option<&str> {
        match self {
            AcmeError::Refused { problem_type, .. }
            | AcmeError::Validation { problem_type, .. }
            | AcmeError::DnsValidation { problem_type, .. } => Some(problem_type),
            _ => None,
        }
    }

    fn store(op: &'static str) -> impl FnOnce(StoreError) -> AcmeError {
        move |source| AcmeError::Store { op, source }
    }
}

/// What [`load_or_create`] needs to know about the CA and the account.
#[derive(Clone, PartialEq, Eq)]
pub struct AccountSettings {
    /// The ACME directory URL.
    pub directory_url: String,
    /// A PEM file whose certificates are the only trust anchors for the
    /// directory's TLS (a private CA); `None`: the platform's trust store.
    pub ca_root: Option<PathBuf>,
    /// The account contact, as `mailto:<email>`.
    pub email: Option<String>,
    /// External account binding, for CAs that require it.
    pub eab: Option<Eab>,
}

impl fmt::Debug for AccountSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AccountSettings")
            .field("directory_url", &self.directory_url)
            .field("ca_root", &self.ca_root)
            .field("email", &self.email)
            .field("eab", &self.eab)
            .finish()
    }
}

impl AccountSettings {
    /// The settings of `proxy.acme`.
    pub(crate) fn from_config(acme: &AcmeSection) -> Self {
        Self {
            directory_url: acme.directory_url.trim().to_owned(),
            ca_root: acme.ca_root.clone(),
            email: acme.email.clone().filter(|e| !e.trim().is_empty()),
            eab: acme.eab.clone(),
        }
    }

    /// [`layout::directory_id`] of the directory URL.
    pub fn directory_id(&self) -> String {
        layout::directory_id(&self.directory_url)
    }
}

/// What the directory document says beyond its endpoints.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct DirectoryInfo {
    /// The ACME Renewal Information endpoint (RFC 9773), when offered.
    pub renewal_info: Option<String>,
    /// The terms of service the account agrees to.
    pub terms_of_service: Option<String>,
    /// Whether new accounts need external account binding.
    pub external_account_required: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct DirectoryDoc {
    new_nonce: Option<String>,
    new_account: Option<String>,
    new_order: Option<String>,
    renewal_info: Option<String>,
    #[serde(default)]
    meta: DirectoryMeta,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct DirectoryMeta {
    terms_of_service: Option<String>,
    #[serde(default)]
    external_account_required: bool,
}

/// The cluster's account at one directory, ready to order. Cheap to clone.
#[derive(Clone)]
pub struct AcmeAccount {
    account: Account,
    directory_url: String,
    directory: DirectoryInfo,
}

impl fmt::Debug for AcmeAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcmeAccount")
            .field("id", &self.account.id())
            .field("directory_url", &self.directory_url)
            .field("directory", &self.directory)
            .finish()
    }
}

impl AcmeAccount {
    /// The instant-acme account (shares its HTTP client with every clone).
    pub(crate) fn account(&self) -> &Account {
        &self.account
    }

    /// The account URL at the CA.
    pub fn id(&self) -> &str {
        self.account.id()
    }

    /// The directory URL.
    pub(crate) fn directory_url(&self) -> &str {
        &self.directory_url
    }

    /// Whether the CA offers ACME Renewal Information (RFC 9773).
    pub(crate) fn offers_ari(&self) -> bool {
        self.directory.renewal_info.is_some()
    }
}

/// The record at [`layout::account`] (JSON, sealed with the ring).
#[derive(Serialize, Deserialize)]
struct AccountRecord {
    v: u8,
    /// The account URL, for people reading the store.
    account_id: String,
    credentials: AccountCredentials,
    created_by: String,
    created_at_unix: u64,
}

/// The cluster's account at `settings.directory_url`: loaded from `store`
/// when it is there, else created once for the whole cluster (see the
/// module docs). `holder` names this replica in the account lock (node id
/// plus something unique to the process).
///
/// # Errors
/// [`AcmeError::Config`] for an unreadable `ca_root`, a bad EAB key, a CA
/// that requires EAB when none is set, or stored credentials that cannot be
/// opened with the ring; the CA's and the store's errors otherwise.
pub async fn load_or_create(
    store: &Arc<dyn Store>,
    ring: Option<&KeyRing>,
    settings: &AccountSettings,
    holder: &str,
) -> Result<AcmeAccount, AcmeError> {
    let capture = RetryAfterCapture::new();
    capture
        .scope(load_or_create_inner(
            store, ring, settings, holder, &capture,
        ))
        .await
}

async fn load_or_create_inner(
    store: &Arc<dyn Store>,
    ring: Option<&KeyRing>,
    settings: &AccountSettings,
    holder: &str,
    capture: &RetryAfterCapture,
) -> Result<AcmeAccount, AcmeError> {
    let http = AcmeHttpClient::new(settings.ca_root.as_deref())
        .map_err(|e| AcmeError::Config(e.to_string()))?;
    let directory = fetch_directory(&http, &settings.directory_url, capture).await?;
    let dir_id = settings.directory_id();
    let key = layout::account(&dir_id);
    let done = |account: Account| AcmeAccount {
        account,
        directory_url: settings.directory_url.clone(),
        directory: directory.clone(),
    };

    for _ in 0..MAX_ROUNDS {
        // The version of a record the CA no longer knows (to replace it).
        let stale = match read_record(store, ring, &key).await? {
            Some((record, version)) => {
                match restore(&http, settings, &record.credentials, capture).await {
                    Ok(account) => return Ok(done(account)),
                    Err(e) if e.problem_type() == Some("accountDoesNotExist") => {
                        tracing::warn!(
                            account = %record.account_id,
                            directory = %settings.directory_url,
                            "the ACME CA no longer knows the stored account; creating a new one"
                        );
                        Some(version)
                    }
                    Err(e) => return Err(e),
                }
            }
            None => None,
        };

        let lock = LeaseLock::new(Arc::clone(store), &layout::account_lock(&dir_id));
        let Some(lease) = lock
            .acquire(holder, ACCOUNT_LOCK_TTL, ACCOUNT_LOCK_WAIT)
            .await
            .map_err(AcmeError::store("take the account lock"))?
        else {
            return Err(AcmeError::LockBusy {
                lock: lock.name().to_owned(),
                waited: ACCOUNT_LOCK_WAIT,
            });
        };
        let created = create_under_lock(
            store,
            ring,
            settings,
            &http,
            &directory,
            &key,
            stale.as_ref(),
            holder,
            capture,
        )
        .await;
        if let Err(e) = lock.release(&lease).await {
            // It expires on its own; the account work is what matters.
            tracing::warn!(lock = lock.name(), error = %e, "could not release the account lock");
        }
        if let Some(account) = created? {
            return Ok(done(account));
        }
        // Someone else wrote the record meanwhile: load theirs.
    }
    Err(AcmeError::Store {
        op: "settle on one stored account",
        source: StoreError::Backend {
            backend: store.backend(),
            message: format!("the record at {key:?} kept changing during {MAX_ROUNDS} attempts"),
        },
    })
}

/// Under the account lock: creates the account unless the record changed
/// since `stale` was read (then `None`: the caller loads what is there).
#[allow(clippy::too_many_arguments)]
async fn create_under_lock(
    store: &Arc<dyn Store>,
    ring: Option<&KeyRing>,
    settings: &AccountSettings,
    http: &AcmeHttpClient,
    directory: &DirectoryInfo,
    key: &str,
    stale: Option<&Version>,
    holder: &str,
    capture: &RetryAfterCapture,
) -> Result<Option<Account>, AcmeError> {
    let now = store
        .get(key)
        .await
        .map_err(AcmeError::store("read the account record"))?;
    if now.as_ref().map(|e| &e.version) != stale {
        return Ok(None);
    }
    if directory.external_account_required && settings.eab.is_none() {
        return Err(AcmeError::Config(format!(
            "the CA at {} requires external account binding: set proxy.extensions.sbmesh.acme.eab {{kid, hmac_key}} from the CA's account page",
            settings.directory_url
        )));
    }
    let eab = settings
        .eab
        .as_ref()
        .map(external_account_key)
        .transpose()?;
    let contact = settings
        .email
        .as_ref()
        .map(|e| format!("mailto:{}", e.trim()));
    let contacts: Vec<&str> = contact.iter().map(String::as_str).collect();
    let (account, credentials) = Account::builder_with_http(Box::new(http.clone()))
        .create(
            &NewAccount {
                contact: &contacts,
                terms_of_service_agreed: true,
                only_return_existing: false,
            },
            settings.directory_url.clone(),
            eab.as_ref(),
        )
        .await
        .map_err(|e| AcmeError::from_acme("create the ACME account", e, capture))?;
    let record = AccountRecord {
        v: RECORD_FORMAT,
        account_id: account.id().to_owned(),
        credentials,
        created_by: holder.to_owned(),
        created_at_unix: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    let json = serde_json::to_vec(&record).map_err(|e| AcmeError::Protocol {
        op: "encode the account record",
        message: e.to_string(),
    })?;
    let bytes =
        seal_record(ring, key, &json).map_err(AcmeError::store("seal the account record"))?;
    let written = match stale {
        None => store.put_if_absent(key, &bytes, None).await,
        Some(version) => store.compare_and_swap(key, version, &bytes, None).await,
    }
    .map_err(AcmeError::store("store the account record"))?;
    if written.is_none() {
        // Lost a race (our lease expired mid-creation): the account just
        // created stays unused at the CA, the stored one wins.
        tracing::warn!(
            account = %account.id(),
            "another replica stored an account first; using theirs"
        );
        return Ok(None);
    }
    tracing::info!(account = %account.id(), directory = %settings.directory_url, "created the cluster's ACME account");
    Ok(Some(account))
}

async fn read_record(
    store: &Arc<dyn Store>,
    ring: Option<&KeyRing>,
    key: &str,
) -> Result<Option<(AccountRecord, Version)>, AcmeError> {
    let Some(entry) = store
        .get(key)
        .await
        .map_err(AcmeError::store("read the account record"))?
    else {
        return Ok(None);
    };
    let json = open_record(ring, key, &entry.value).map_err(|e| match e {
        StoreError::MissingKey { .. } => AcmeError::Config(format!(
            "{e}; or delete {key:?} from the store to create a new account"
        )),
        other => AcmeError::Store {
            op: "open the account record",
            source: other,
        },
    })?;
    let record: AccountRecord = serde_json::from_slice(&json).map_err(|e| AcmeError::Store {
        op: "decode the account record",
        source: StoreError::Corrupt {
            key: key.to_owned(),
            message: format!("not an account record ({e}); delete it to create a new account"),
        },
    })?;
    Ok(Some((record, entry.version)))
}

/// Rewrites the account record of `directory_url` under `ring`'s primary
/// key when it is sealed under an older ring key, so that the old key can
/// leave the key file without locking every later pod out of the account.
/// By compare-and-swap on the version read: a record replaced meanwhile
/// is left alone. Whether it was rewritten.
///
/// # Errors
/// The store's; [`StoreError::MissingKey`] when the record is sealed under
/// a key `ring` lacks.
pub(crate) async fn reseal_account(
    store: &dyn Store,
    ring: &KeyRing,
    directory_url: &str,
) -> Result<bool, StoreError> {
    let key = layout::account(&layout::directory_id(directory_url.trim()));
    let Some(entry) = store.get(&key).await? else {
        return Ok(false);
    };
    let Some(from) = sealed_key_id(&entry.value) else {
        return Ok(false);
    };
    let to = ring.primary_id();
    if from == to {
        return Ok(false);
    }
    let json = open_record(Some(ring), &key, &entry.value)?;
    let bytes = seal_record(Some(ring), &key, &json)?;
    let written = store
        .compare_and_swap(&key, &entry.version, &bytes, None)
        .await?
        .is_some();
    if written {
        tracing::info!(
            from_key_id = %format!("{from:08x}"),
            to_key_id = %format!("{to:08x}"),
            "ACME account record resealed under the primary cluster key"
        );
    }
    Ok(written)
}

/// The stored account, confirmed with the CA (`onlyReturnExisting`).
async fn restore(
    http: &AcmeHttpClient,
    settings: &AccountSettings,
    credentials: &AccountCredentials,
    capture: &RetryAfterCapture,
) -> Result<Account, AcmeError> {
    let pkcs8 = credentials.private_key().clone_key();
    let key = Key::from_pkcs8_der(pkcs8.clone_key()).map_err(|e| {
        AcmeError::Config(format!(
            "the stored account key is not usable ({e}); delete the account record from the store to create a new account"
        ))
    })?;
    let (account, _) = Account::builder_with_http(Box::new(http.clone()))
        .from_key(
            (key, PrivateKeyDer::Pkcs8(pkcs8)),
            settings.directory_url.clone(),
        )
        .await
        .map_err(|e| AcmeError::from_acme("look up the stored ACME account", e, capture))?;
    Ok(account)
}

fn external_account_key(eab: &Eab) -> Result<ExternalAccountKey, AcmeError> {
    let encoded = eab.hmac_key.trim();
    let decoded = BASE64_URL_SAFE_NO_PAD
        .decode(encoded)
        .or_else(|_| BASE64_URL_SAFE.decode(encoded))
        .or_else(|_| BASE64_STANDARD.decode(encoded))
        .map_err(|e| {
            AcmeError::Config(format!(
                "proxy.extensions.sbmesh.acme.eab.hmac_key is not base64url ({e}); paste the MAC key exactly as the CA shows it"
            ))
        })?;
    if decoded.is_empty() || eab.kid.trim().is_empty() {
        return Err(AcmeError::Config(
            "proxy.extensions.sbmesh.acme.eab needs both kid and hmac_key".to_owned(),
        ));
    }
    Ok(ExternalAccountKey::new(eab.kid.trim().to_owned(), &decoded))
}

/// GETs the directory document: proves the CA is reachable and trusted,
/// and tells whether it offers ARI and requires EAB.
async fn fetch_directory(
    http: &AcmeHttpClient,
    url: &str,
    capture: &RetryAfterCapture,
) -> Result<DirectoryInfo, AcmeError> {
    const OP: &str = "fetch the ACME directory";
    let request = Request::builder()
        .method(Method::GET)
        .uri(url)
        .header(USER_AGENT, concat!("sbmesh/", env!("CARGO_PKG_VERSION")))
        .body(BodyWrapper::<Bytes>::default())
        .map_err(|e| {
            AcmeError::Config(format!(
                "proxy.extensions.sbmesh.acme.directory_url {url:?} is not a valid URL: {e}"
            ))
        })?;
    let (parts, body) = http
        .send(request)
        .await
        .map_err(|e| AcmeError::from_acme(OP, e, capture))?;
    if !parts.status.is_success() {
        return Err(AcmeError::Unreachable {
            op: OP,
            message: format!("GET {url} answered {}", parts.status),
            retry_after: capture.remaining(),
        });
    }
    let doc: DirectoryDoc = serde_json::from_slice(&body).map_err(|e| {
        AcmeError::Config(format!(
            "proxy.extensions.sbmesh.acme.directory_url {url} is not an ACME directory (its JSON does not parse: {e})"
        ))
    })?;
    if doc.new_nonce.is_none() || doc.new_account.is_none() || doc.new_order.is_none() {
        return Err(AcmeError::Config(format!(
            "proxy.extensions.sbmesh.acme.directory_url {url} is not an ACME directory (newNonce, newAccount or newOrder missing)"
        )));
    }
    Ok(DirectoryInfo {
        renewal_info: doc.renewal_info,
        terms_of_service: doc.meta.terms_of_service,
        external_account_required: doc.meta.external_account_required,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_account_sealed_under_an_older_ring_key_is_resealed_under_the_primary() {
        use crate::store::memory::MemoryStore;
        const OLD: [u8; 32] = [3; 32];
        const NEW: [u8; 32] = [4; 32];
        let url = "https://ca.example/dir";
        let key = layout::account(&layout::directory_id(url));
        let store = MemoryStore::new();
        let old = KeyRing::new(vec![OLD]).unwrap();
        let rotated = KeyRing::new(vec![NEW, OLD]).unwrap();
        // Nothing stored: nothing to do.
        assert!(!reseal_account(&store, &rotated, url).await.unwrap());
        let sealed = seal_record(Some(&old), &key, b"{\"account\":1}").unwrap();
        store.put(&key, &sealed, None).await.unwrap();
        // Under the primary already: left alone.
        assert!(!reseal_account(&store, &old, url).await.unwrap());
        assert!(reseal_account(&store, &rotated, url).await.unwrap());
        let entry = store.get(&key).await.unwrap().unwrap();
        assert_eq!(sealed_key_id(&entry.value), Some(rotated.primary_id()));
        // The old key can go now.
        let after = KeyRing::new(vec![NEW]).unwrap();
        assert_eq!(
            open_record(Some(&after), &key, &entry.value).unwrap(),
            b"{\"account\":1}"
        );
        assert!(!reseal_account(&store, &after, url).await.unwrap());
        // A ring that lacks the record's key: an error naming it, nothing written.
        let stranger = KeyRing::new(vec![[5; 32]]).unwrap();
        assert!(matches!(
            reseal_account(&store, &stranger, url).await,
            Err(StoreError::MissingKey { .. })
        ));
        assert_eq!(store.get(&key).await.unwrap().unwrap().value, entry.value);
    }

    #[test]
    fn logged_errors_are_one_line() {
        assert_eq!(one_line("plain"), "plain");
        assert_eq!(
            one_line("Fetching http://a.test/x:\n  Connection refused\r\n"),
            "Fetching http://a.test/x: Connection refused"
        );
        let e = AcmeError::Refused {
            op: "create the order",
            problem_type: "malformed".into(),
            detail: "x".into(),
            status: None,
            retry_after: None,
        };
        assert!(
            e.to_string()
                .starts_with("the ACME CA refused to create the order:"),
            "{e}"
        );
        let e = AcmeError::Unreachable {
            op: "create the order",
            message: "connection refused".into(),
            retry_after: None,
        };
        assert!(
            e.to_string()
                .starts_with("cannot reach the ACME CA to create the order:"),
            "{e}"
        );
        assert!(e.never_reached_ca());
        let e = AcmeError::Unreachable {
            op: "finalize the order",
            message: "connection reset".into(),
            retry_after: None,
        };
        assert!(!e.never_reached_ca(), "the order exists at the CA");
    }

    #[test]
    fn permanent_problems_are_not_retryable() {
        let refused = |t: &str| AcmeError::Refused {
            op: "x",
            problem_type: t.to_owned(),
            detail: String::new(),
            status: None,
            retry_after: Some(Duration::from_secs(3)),
        };
        assert!(!refused("rejectedIdentifier").is_retryable());
        assert!(refused("rateLimited").is_retryable());
        assert!(refused("rateLimited").is_rate_limited());
        assert_eq!(
            refused("serverInternal").retry_after(),
            Some(Duration::from_secs(3))
        );
        assert!(!AcmeError::Config("x".into()).is_retryable());
        assert!(AcmeError::LeaseLost { hosts: vec![] }.is_retryable());
    }

    #[test]
    fn eab_key_decodes() {
        let eab = Eab {
            kid: "kid-1".into(),
            hmac_key: "zWNDZM6eQGHWpSRTPal5eIUYFTu7EajVIoguysqZ9wG44nMEtx3MUAsUDkMTQ12W".into(),
        };
        external_account_key(&eab).unwrap();
        let bad = Eab {
            kid: "kid-1".into(),
            hmac_key: "not base64 !!".into(),
        };
        let err = external_account_key(&bad).err().unwrap().to_string();
        assert!(err.contains("hmac_key"), "{err}");
    }
}
