//! Certificate stores: one [`Store`] trait, several backends, and a lease
//! lock ([`lock`]) that works on any of them.
//!
//! Keys are path-like strings (`acme/accounts/<id>`, `certs/<host>/chain`):
//! segments of `[A-Za-z0-9._-]`, never `.` or `..`, joined by `/`
//! ([`validate_key`]); each backend maps them safely onto its namespace.
//!
//! Every value carries an opaque [`Version`] (a counter, or an object
//! store's ETag) for compare-and-swap, and may carry an expiry: an expired
//! record reads as absent everywhere, whether or not the backend has
//! physically removed it yet.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

pub(crate) mod clock;
pub mod file;
pub(crate) mod instrumented;
pub mod lock;
pub mod memory;
pub mod object;
pub(crate) mod open;
pub mod redb;
pub mod redis;
pub(crate) mod sealed;
/// An opaque version of a stored value: compare-and-swap succeeds only
/// against the version the caller read.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Version(pub String);

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stored value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The bytes.
    pub value: Vec<u8>,
    /// Its version, for [`Store::compare_and_swap`].
    pub version: Version,
    /// When it stops existing, unix milliseconds.
    pub expires_at_unix_ms: Option<u64>,
}

/// Largest value a store accepts (certificate chains are a few KiB).
pub const MAX_VALUE_BYTES: usize = 1 << 20;
/// Longest key.
pub const MAX_KEY_LEN: usize = 512;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The key is not of the accepted form.
    #[error(
        "invalid store key {key:?}: {reason}; keys are '/'-separated segments of [A-Za-z0-9._-] (not '.' or '..'), at most 512 bytes"
    )]
    InvalidKey {
        /// The key.
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The value is over [`MAX_VALUE_BYTES`].
    #[error("value for {key:?} is {len} bytes; the limit is {MAX_VALUE_BYTES}")]
    TooLarge {
        /// The key.
        key: String,
        /// Its length.
        len: usize,
    },
    /// The backend did not answer in time.
    #[error("{backend} store timed out after {after:?} during {op}")]
    Timeout {
        /// Backend name.
        backend: &'static str,
        /// Operation.
        op: &'static str,
        /// The budget.
        after: Duration,
    },
    /// The backend failed (connection, I/O, permission, server error).
    #[error("{backend} store: {message}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// What it said.
        message: String,
    },
    /// A stored record does not have the expected shape.
    #[error("corrupt record at {key:?}: {message}")]
    Corrupt {
        /// The key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// The configuration names something the store cannot use.
    #[error("store configuration: {0}")]
    Config(String),
    /// An encrypted record cannot be opened with the current key ring.
    #[error(
        "record {key:?} is encrypted under cluster key id {key_id:08x}, which is not in the key ring; add that key to --cluster-key / the key file"
    )]
    MissingKey {
        /// The key.
        key: String,
        /// The key id it was sealed with.
        key_id: u32,
    },
    /// A fenced write lost: a newer lease holder exists.
    #[error("write to {key:?} refused: lease fence {fence} is stale (newest is {newest})")]
    Fenced {
        /// The key.
        key: String,
        /// The writer's fence.
        fence: u64,
        /// The newest fence seen.
        newest: u64,
    },
}

/// A key-value store shared by the replicas (or local to one, for `redb`
/// and `memory`). All operations are atomic per key.
#[async_trait]
pub trait Store: Send + Sync + fmt::Debug {
    /// Backend name, as in `storage_backend` and the metrics label.
    fn backend(&self) -> &'static str;

    /// Whether every replica sees the same data.
    fn is_shared(&self) -> bool;

    /// The value, or `None` when absent or expired.
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError>;

    /// Writes unconditionally; returns the new version.
    async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Version, StoreError>;

    /// Creates the key only when it is absent (or expired); `None` when it
    /// exists.
    async fn put_if_absent(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError>;

    /// Replaces the value only when its version is still `expected`; `None`
    /// on a conflict (changed, deleted or expired meanwhile).
    async fn compare_and_swap(
        &self,
        key: &str,
        expected: &Version,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError>;

    /// Removes the key; `true` when something was removed.
    async fn delete(&self, key: &str) -> Result<bool, StoreError>;

    /// Keys under `prefix` (a plain string prefix), sorted, expired ones
    /// left out.
    async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError>;

    /// Physically removes expired records; returns how many. Backends with
    /// native expiry return 0.
    async fn sweep_expired(&self) -> Result<usize, StoreError> {
        Ok(0)
    }

    /// Writes `value` (a fenced value, see [`lock::put_fenced`]) at `key`
    /// as one atomic step with its check: refused with
    /// [`StoreError::Fenced`] when the lock record at `lock_key` carries a
    /// fence newer than `fence`, or the value at `key` was written under a
    /// newer one. No write under an older fence can land after a newer
    /// lease was taken.
    ///
    /// The default is [`lock::put_fenced_by_claims`], correct on any store
    /// whose single-key operations are atomic (it registers `key` in the
    /// lock record, and each takeover raises the fence of every registered
    /// key before the new lease is handed out); backends that can check two
    /// keys in one step (memory, redb, file, redis) do that instead, in one
    /// round trip. A wrapper should forward this to the store it wraps.
    async fn put_fenced(
        &self,
        key: &str,
        value: &[u8],
        lock_key: &str,
        fence: u64,
    ) -> Result<Version, StoreError> {
        lock::put_fenced_by_claims(self, key, value, lock_key, fence).await
    }

    /// Milliseconds to add to this process's clock ([`now_unix_ms`]) to get
    /// the store's clock, which every replica reads alike: lease expiries
    /// are written and judged on it, so a replica whose own clock is off
    /// neither takes live leases nor keeps expired ones. `0` (the default)
    /// for stores local to one process (memory, redb); the server's clock
    /// for redis (`TIME`) and object stores (`Last-Modified`); the
    /// filesystem's timestamps for file. Backends cache it (`clock`).
    async fn clock_offset_ms(&self) -> Result<i64, StoreError> {
        Ok(0)
    }
}

/// Checks a key against the accepted form (see the module docs).
pub fn validate_key(key: &str) -> Result<(), StoreError> {
    let bad = |reason| {
        Err(StoreError::InvalidKey {
            key: key.chars().take(80).collect(),
            reason,
        })
    };
    if key.is_empty() {
        return bad("empty");
    }
    if key.len() > MAX_KEY_LEN {
        return bad("too long");
    }
    for seg in key.split('/') {
        if seg.is_empty() {
            return bad("empty segment (leading, trailing or double '/')");
        }
        if seg == "." || seg == ".." {
            return bad("'.' and '..' segments are not allowed");
        }
        if !seg
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return bad("character outside [A-Za-z0-9._-]");
        }
    }
    Ok(())
}

/// Checks a list prefix: empty, or a key prefix (may end in `/`).
pub fn validate_prefix(prefix: &str) -> Result<(), StoreError> {
    if prefix.is_empty() {
        return Ok(());
    }
    validate_key(prefix.strip_suffix('/').unwrap_or(prefix))
}

/// The checks before a fenced write ([`Store::put_fenced`]), one step for
/// every backend that implements it itself: both keys and the value.
pub(crate) fn validate_fenced_write(
    key: &str,
    value: &[u8],
    lock_key: &str,
) -> Result<(), StoreError> {
    validate_key(key)?;
    validate_key(lock_key)?;
    validate_value(key, value)
}

/// Checks a value's size.
pub fn validate_value(key: &str, value: &[u8]) -> Result<(), StoreError> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(StoreError::TooLarge {
            key: key.to_owned(),
            len: value.len(),
        });
    }
    Ok(())
}

/// Unix time in milliseconds (stores compare expiries against it).
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The absolute expiry for a TTL starting now.
pub(crate) fn expiry_from(ttl: Option<Duration>) -> Option<u64> {
    ttl.map(|t| now_unix_ms().saturating_add(t.as_millis() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        for ok in [
            "a",
            "acme/accounts/x-1",
            "certs/api.example.com/chain",
            "a_b.c",
        ] {
            validate_key(ok).unwrap();
        }
        for bad in [
            "",
            "/a",
            "a/",
            "a//b",
            "../etc/passwd",
            "a/../b",
            ".",
            "a b",
            "a\0b",
            "a:b",
            "ü",
            "a\\b",
            "*",
            "a\r\nSET x",
        ] {
            assert!(validate_key(bad).is_err(), "{bad:?} accepted");
        }
        assert!(validate_key(&"a".repeat(513)).is_err());
        validate_prefix("").unwrap();
        validate_prefix("certs/").unwrap();
        assert!(validate_prefix("../").is_err());
    }
}
