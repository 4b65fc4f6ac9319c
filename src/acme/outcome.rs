//! How the shell's tasks end, as the pure core ([`crate::acme::machine`])
//! reads them: an order's [`OrderOutcome`] (with [`Deferral`] and
//! [`OrderError`]) and a placeholder write's [`PlaceholderError`].
//!
//! Typed, so the core, the backoff and the logs get the same value: the
//! core asks [`OrderError::retry_after_secs`] how long the CA wants it to
//! wait, the shell logs the `Display` text (the same words as before these
//! types existed; log searches and tests match on them).

use std::fmt;
use std::io;
use std::time::Duration;

use crate::acme::account::AcmeError;
use crate::acme::certs::{CertError, CertRecord};
use crate::acme::reach::Unanswered;
use crate::acme::schedule::{DUPLICATE_LIMIT, Failures};
use crate::store::StoreError;

/// How an order task ended.
#[derive(Debug)]
pub(crate) enum OrderOutcome {
    /// A certificate was issued and stored.
    Issued(Box<CertRecord>),
    /// The store already held a valid certificate (another replica's).
    AlreadyValid(Box<CertRecord>),
    /// Another holder has the unit's lock: leave it alone this long.
    Busy {
        /// Until the lease's expiry, or a re-check to notice a release.
        wait: Duration,
    },
    /// The challenge of a name was not answered where the CA's request
    /// lands ([`crate::acme::reach`]): nothing was sent to the CA, and the
    /// order waits (no failure, no backoff).
    Unanswered(Unanswered),
    /// The shared failures of the unit (another replica's or an earlier
    /// process's attempts) say to wait: nothing was tried.
    BackingOff(Failures),
    /// Not allowed before this time: duplicate or order limits.
    Deferred {
        /// Unix seconds.
        until: u64,
        /// Which limit.
        why: Deferral,
        /// The failures as now shared in the store (`None`: not stored).
        shared: Option<Failures>,
    },
    /// It failed.
    Failed {
        /// What went wrong; its `Retry-After`, when the CA sent one.
        error: OrderError,
        /// The failures as now shared in the store (`None`: not stored).
        shared: Option<Failures>,
    },
}

/// The cluster-wide limit that deferred an order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum Deferral {
    /// The hostname set was issued [`DUPLICATE_LIMIT`] times in the last
    /// 7 days (the CA's duplicate limit).
    DuplicateLimit,
    /// The account's new orders of this interval are spent.
    BudgetSpent {
        /// The orders the interval allows.
        max_orders: u32,
    },
}

impl fmt::Display for Deferral {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Deferral::DuplicateLimit => write!(
                f,
                "this hostname set was issued {DUPLICATE_LIMIT} times in the last 7 days (the CA's duplicate limit)"
            ),
            Deferral::BudgetSpent { max_orders } => write!(
                f,
                "the cluster placed its {max_orders} new orders of this interval"
            ),
        }
    }
}

/// Why an order failed, by the step that failed. Every failure backs the
/// unit off (see [`crate::acme::schedule::Failures`]), honouring the CA's
/// `Retry-After` ([`OrderError::retry_after_secs`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum OrderError {
    /// The machine ordered without an `acme` section (they disagree).
    #[error("no acme section in the configuration")]
    NoAcmeSection,
    /// The unit's shared failures and renewal information could not be
    /// read: its backoff is unknown, so nothing is ordered (fail closed).
    #[error("reading the shared order state: {0}")]
    SharedState(#[source] StoreError),
    /// The unit's order lock could not be taken.
    #[error("order lock: {0}")]
    Lock(#[source] StoreError),
    /// The store could not be read again under the lock.
    #[error("reading the store: {0}")]
    ReadRecord(#[source] StoreError),
    /// The issuance history could not be read: without it the duplicate
    /// limit cannot be kept.
    #[error("duplicate guard: {0}; no order placed")]
    DuplicateGuard(#[source] StoreError),
    /// The ACME account could not be loaded or created.
    #[error("ACME account: {0}")]
    Account(#[source] AcmeError),
    /// The account's order budget could not be read or taken.
    #[error("order budget: {0}")]
    Budget(#[source] StoreError),
    /// The CA did not issue.
    #[error(transparent)]
    Order(AcmeError),
    /// The CA's certificate cannot be read.
    #[error("the CA's certificate: {0}")]
    IssuedCertificate(#[source] CertError),
    /// The certificate record could not be sealed.
    #[error(transparent)]
    Seal(StoreError),
    /// The certificate record could not be written.
    #[error("storing the certificate: {0}")]
    StoreCertificate(#[source] StoreError),
}

impl OrderError {
    /// Whether trying again later (with backoff) can succeed without a
    /// change of configuration: not without an `acme` section, nor after a
    /// CA's permanent refusal ([`AcmeError::is_retryable`]).
    #[cfg(test)]
    pub(crate) fn is_retryable(&self) -> bool {
        match self {
            OrderError::NoAcmeSection => false,
            OrderError::Account(e) | OrderError::Order(e) => e.is_retryable(),
            _ => true,
        }
    }

    /// How long the CA asked to wait (its `Retry-After`), in seconds.
    pub(crate) fn retry_after_secs(&self) -> Option<u64> {
        match self {
            OrderError::Account(e) | OrderError::Order(e) => e.retry_after().map(|d| d.as_secs()),
            _ => None,
        }
    }
}

/// Why a placeholder could not be written for a unit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum PlaceholderError {
    /// The self-signed certificate could not be made.
    #[error(transparent)]
    Make(CertError),
    /// Its files could not be written.
    #[error(transparent)]
    Write(io::Error),
    /// What was made cannot be read back.
    #[error(transparent)]
    Read(CertError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_texts_are_the_logs_of_before() {
        let store = || StoreError::Backend {
            backend: "redis",
            message: "down".into(),
        };
        assert_eq!(
            OrderError::DuplicateGuard(store()).to_string(),
            "duplicate guard: redis store: down; no order placed"
        );
        assert_eq!(OrderError::Seal(store()).to_string(), "redis store: down");
        assert_eq!(
            Deferral::BudgetSpent { max_orders: 300 }.to_string(),
            "the cluster placed its 300 new orders of this interval"
        );
        assert_eq!(
            Deferral::DuplicateLimit.to_string(),
            format!(
                "this hostname set was issued {DUPLICATE_LIMIT} times in the last 7 days (the CA's duplicate limit)"
            )
        );
    }

    #[test]
    fn only_the_ca_says_how_long_to_wait_and_what_is_permanent() {
        let refused = |problem_type: &str| AcmeError::Refused {
            op: "create the order",
            problem_type: problem_type.into(),
            detail: "no".into(),
            status: Some(429),
            retry_after: Some(Duration::from_secs(1800)),
        };
        let limited = OrderError::Order(refused("rateLimited"));
        assert_eq!(limited.retry_after_secs(), Some(1800));
        assert!(limited.is_retryable());
        assert!(!OrderError::Account(refused("rejectedIdentifier")).is_retryable());
        assert!(!OrderError::NoAcmeSection.is_retryable());
        let store = OrderError::Lock(StoreError::Config("x".into()));
        assert_eq!(store.retry_after_secs(), None);
        assert!(store.is_retryable());
    }
}
