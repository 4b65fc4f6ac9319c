//! `memory`: a process-local store for tests and single-pod setups.
//!
//! One `Mutex<BTreeMap>` holds every record, so each operation (a fenced
//! write's check of two keys included) is trivially atomic; versions come from a counter that never repeats within the
//! process, so a deleted-and-recreated key never reuses a version.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;

use super::{
    Entry, Store, StoreError, Version, expiry_from, lock, now_unix_ms, validate_key,
    validate_prefix, validate_value,
};

const BACKEND: &str = "memory";

/// One stored value with its version counter and expiry.
#[derive(Debug)]
struct Record {
    value: Vec<u8>,
    version: u64,
    expires_at_unix_ms: Option<u64>,
}

impl Record {
    fn live(&self, now: u64) -> bool {
        self.expires_at_unix_ms.is_none_or(|at| at > now)
    }
}

#[derive(Debug, Default)]
struct Inner {
    records: BTreeMap<String, Record>,
    next_version: u64,
}

impl Inner {
    fn live(&self, key: &str, now: u64) -> Option<&Record> {
        self.records.get(key).filter(|r| r.live(now))
    }

    fn write(&mut self, key: &str, value: &[u8], ttl: Option<Duration>) -> Version {
        self.next_version += 1;
        let version = self.next_version;
        self.records.insert(
            key.to_owned(),
            Record {
                value: value.to_vec(),
                version,
                expires_at_unix_ms: expiry_from(ttl),
            },
        );
        Version(version.to_string())
    }
}

/// A store that lives in this process only (`storage_backend: memory`).
///
/// Expired records read as absent at once and are physically removed by
/// [`Store::sweep_expired`] or when the key is written again.
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a half-written record
        // (every mutation is a single map insert/remove), so poisoning is
        // safe to ignore.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn is_shared(&self) -> bool {
        false
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        validate_key(key)?;
        let inner = self.lock();
        Ok(inner.live(key, now_unix_ms()).map(|r| Entry {
            value: r.value.clone(),
            version: Version(r.version.to_string()),
            expires_at_unix_ms: r.expires_at_unix_ms,
        }))
    }

    async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Version, StoreError> {
        validate_key(key)?;
        validate_value(key, value)?;
        Ok(self.lock().write(key, value, ttl))
    }

    async fn put_if_absent(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        validate_key(key)?;
        validate_value(key, value)?;
        let mut inner = self.lock();
        if inner.live(key, now_unix_ms()).is_some() {
            return Ok(None);
        }
        Ok(Some(inner.write(key, value, ttl)))
    }

    async fn compare_and_swap(
        &self,
        key: &str,
        expected: &Version,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        validate_key(key)?;
        validate_value(key, value)?;
        let mut inner = self.lock();
        match inner.live(key, now_unix_ms()) {
            Some(r) if r.version.to_string() == expected.0 => {
                Ok(Some(inner.write(key, value, ttl)))
            }
            _ => Ok(None),
        }
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        validate_key(key)?;
        let now = now_unix_ms();
        Ok(self.lock().records.remove(key).is_some_and(|r| r.live(now)))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        validate_prefix(prefix)?;
        let now = now_unix_ms();
        let inner = self.lock();
        Ok(inner
            .records
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .filter(|(_, r)| r.live(now))
            .map(|(k, _)| k.clone())
            .collect())
    }

    async fn sweep_expired(&self) -> Result<usize, StoreError> {
        let now = now_unix_ms();
        let mut inner = self.lock();
        let before = inner.records.len();
        inner.records.retain(|_, r| r.live(now));
        Ok(before - inner.records.len())
    }

    /// The check of both fences and the write, under the one mutex.
    async fn put_fenced(
        &self,
        key: &str,
        value: &[u8],
        lock_key: &str,
        fence: u64,
    ) -> Result<Version, StoreError> {
        super::validate_fenced_write(key, value, lock_key)?;
        let now = now_unix_ms();
        let mut inner = self.lock();
        lock::check_fence(
            key,
            lock_key,
            fence,
            inner.live(lock_key, now).map(|r| r.value.as_slice()),
            inner.live(key, now).map(|r| r.value.as_slice()),
        )?;
        Ok(inner.write(key, value, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sweep_counts_expired_records() {
        let store = MemoryStore::new();
        store
            .put("t/gone", b"x", Some(Duration::from_millis(1)))
            .await
            .unwrap();
        store.put("t/kept", b"x", None).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while store.get("t/gone").await.unwrap().is_some() {
            assert!(std::time::Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert_eq!(store.sweep_expired().await.unwrap(), 1);
        assert_eq!(store.sweep_expired().await.unwrap(), 0);
        assert_eq!(store.list("t/").await.unwrap(), vec!["t/kept".to_owned()]);
        assert!(!store.is_shared());
    }
}
