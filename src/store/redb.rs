//! `redb`: a single-pod store in one embedded database file,
//! `<dir>/certstore.redb`.
//!
//! Every operation is one redb transaction, so a compare-and-swap reads and
//! writes atomically, and a fenced write reads the lock record and the value
//! and writes in one; write transactions commit durably (fsync) before the
//! call returns. redb is blocking, so each call runs on
//! [`tokio::task::spawn_blocking`].
//!
//! redb holds an exclusive lock on the file: a second process (or a second
//! `open` in this one) gets a [`StoreError::Backend`] naming the file.
//!
//! A record is `version: u64 LE | expiry: u64 LE (unix ms, 0 = none) | value`.
//! Versions come from a counter kept in the same file, so they never repeat,
//! not even for a key that was deleted and created again.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ::redb::{Database, ReadableTable, Table, TableDefinition};
use async_trait::async_trait;

use super::{
    Entry, Store, StoreError, Version, expiry_from, lock, now_unix_ms, validate_key,
    validate_prefix, validate_value,
};

const BACKEND: &str = "redb";
/// The database file inside the configured directory (docs/reference.md#storage-paths).
pub(crate) const FILE_NAME: &str = "certstore.redb";

const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("records");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const NEXT_VERSION: &str = "next_version";
const HEADER_LEN: usize = 16;
/// Page cache; the data set is a few certificates, so keep the sidecar small.
const CACHE_BYTES: usize = 16 << 20;

/// A store in one redb file (`storage_backend: redb`), local to this pod.
pub struct RedbStore {
    db: Arc<Database>,
    path: Arc<PathBuf>,
}

impl fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedbStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl RedbStore {
    /// Opens (creating when missing) `<dir>/certstore.redb`, creating `dir`
    /// too.
    ///
    /// Fails with a [`StoreError::Backend`] naming the file when another
    /// process already has it open.
    pub async fn open(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        let dir = dir.as_ref().to_path_buf();
        let path = Arc::new(dir.join(FILE_NAME));
        let db = {
            let path = Arc::clone(&path);
            tokio::task::spawn_blocking(move || open_blocking(&dir, &path))
        }
        .await
        .map_err(|e| backend(format!("opening {}: {e}", path.display())))??;
        Ok(Self {
            db: Arc::new(db),
            path,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the blocking pool, with redb errors prefixed by the file.
    async fn run<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Database) -> Result<T, Failure> + Send + 'static,
    {
        let db = Arc::clone(&self.db);
        let outcome = tokio::task::spawn_blocking(move || f(&db))
            .await
            .map_err(|e| {
                backend(format!(
                    "{}: blocking task failed: {e}",
                    self.path.display()
                ))
            })?;
        outcome.map_err(|f| f.into_store_error(&self.path))
    }

    /// One write transaction: `f` returns its result and whether it wrote;
    /// a transaction that wrote nothing is aborted instead of committed
    /// (no fsync for a refused create or a lost compare-and-swap).
    async fn write<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Table<&str, &[u8]>, &mut Table<&str, u64>) -> Result<(T, bool), Failure>
            + Send
            + 'static,
    {
        self.run(move |db| {
            let txn = db.begin_write()?;
            let (out, wrote) = {
                let mut records = txn.open_table(RECORDS)?;
                let mut meta = txn.open_table(META)?;
                f(&mut records, &mut meta)?
            };
            if wrote {
                txn.commit()?;
            } else {
                txn.abort()?;
            }
            Ok(out)
        })
        .await
    }
}

fn open_blocking(dir: &Path, path: &Path) -> Result<Database, StoreError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| backend(format!("creating directory {}: {e}", dir.display())))?;
    let db = ::redb::Builder::new()
        .set_cache_size(CACHE_BYTES)
        // The format redb 3 and later read without an upgrade step.
        .create_with_file_format_v3(true)
        .create(path)
        .map_err(|e| match e {
            ::redb::DatabaseError::DatabaseAlreadyOpen => backend(format!(
                "{} is already open in another process (redb locks its file; \
                 a redb store serves one pod: use the file or redis backend to share)",
                path.display()
            )),
            e => backend(format!("opening {}: {e}", path.display())),
        })?;
    // Create both tables up front so that read transactions find them.
    let created = (|| -> Result<(), Failure> {
        let txn = db.begin_write()?;
        txn.open_table(RECORDS)?;
        txn.open_table(META)?;
        txn.commit()?;
        Ok(())
    })();
    created.map_err(|f| f.into_store_error(path))?;
    Ok(db)
}

fn backend(message: String) -> StoreError {
    StoreError::Backend {
        backend: BACKEND,
        message,
    }
}

/// An error inside a blocking closure: already a [`StoreError`], or a redb
/// error still to be prefixed with the file name.
enum Failure {
    Store(StoreError),
    Redb(String),
}

impl Failure {
    fn into_store_error(self, path: &Path) -> StoreError {
        match self {
            Failure::Store(e) => e,
            Failure::Redb(message) => backend(format!("{}: {message}", path.display())),
        }
    }
}

impl<E: Into<::redb::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure::Redb(e.into().to_string())
    }
}

/// A decoded record, borrowing its value.
struct Record<'a> {
    version: u64,
    expires_at_unix_ms: Option<u64>,
    value: &'a [u8],
}

impl Record<'_> {
    fn live(&self, now: u64) -> bool {
        self.expires_at_unix_ms.is_none_or(|at| at > now)
    }

    fn entry(&self) -> Entry {
        Entry {
            value: self.value.to_vec(),
            version: Version(self.version.to_string()),
            expires_at_unix_ms: self.expires_at_unix_ms,
        }
    }
}

fn decode<'a>(key: &str, bytes: &'a [u8]) -> Result<Record<'a>, Failure> {
    let corrupt = || {
        Failure::Store(StoreError::Corrupt {
            key: key.to_owned(),
            message: format!(
                "redb record of {} bytes is shorter than its header",
                bytes.len()
            ),
        })
    };
    let (version, rest) = bytes.split_first_chunk::<8>().ok_or_else(corrupt)?;
    let (expiry, value) = rest.split_first_chunk::<8>().ok_or_else(corrupt)?;
    let expiry = u64::from_le_bytes(*expiry);
    Ok(Record {
        version: u64::from_le_bytes(*version),
        expires_at_unix_ms: (expiry != 0).then_some(expiry),
        value,
    })
}

fn encode(version: u64, ttl: Option<Duration>, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + value.len());
    out.extend_from_slice(&version.to_le_bytes());
    // 0 means "no expiry"; a real expiry is always later than 1970.
    let expiry = expiry_from(ttl).map_or(0, |at| at.max(1));
    out.extend_from_slice(&expiry.to_le_bytes());
    out.extend_from_slice(value);
    out
}

/// Takes the next version from the counter in the same transaction.
fn next_version(meta: &mut Table<&str, u64>) -> Result<u64, Failure> {
    let v = meta.get(NEXT_VERSION)?.map(|g| g.value()).unwrap_or(1);
    meta.insert(NEXT_VERSION, v.saturating_add(1))?;
    Ok(v)
}

/// The version of the live record at `key`, if any.
fn live_version(records: &Table<&str, &[u8]>, key: &str) -> Result<Option<u64>, Failure> {
    let now = now_unix_ms();
    match records.get(key)? {
        Some(guard) => {
            let record = decode(key, guard.value())?;
            Ok(record.live(now).then_some(record.version))
        }
        None => Ok(None),
    }
}

fn insert(
    records: &mut Table<&str, &[u8]>,
    meta: &mut Table<&str, u64>,
    key: &str,
    value: &[u8],
    ttl: Option<Duration>,
) -> Result<Version, Failure> {
    let version = next_version(meta)?;
    records.insert(key, encode(version, ttl, value).as_slice())?;
    Ok(Version(version.to_string()))
}

#[async_trait]
impl Store for RedbStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn is_shared(&self) -> bool {
        false
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        validate_key(key)?;
        let key = key.to_owned();
        self.run(move |db| {
            let txn = db.begin_read()?;
            let records = txn.open_table(RECORDS)?;
            let Some(guard) = records.get(key.as_str())? else {
                return Ok(None);
            };
            let record = decode(&key, guard.value())?;
            Ok(record.live(now_unix_ms()).then(|| record.entry()))
        })
        .await
    }

    async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Version, StoreError> {
        validate_key(key)?;
        validate_value(key, value)?;
        let (key, value) = (key.to_owned(), value.to_vec());
        self.write(move |records, meta| Ok((insert(records, meta, &key, &value, ttl)?, true)))
            .await
    }

    async fn put_if_absent(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        validate_key(key)?;
        validate_value(key, value)?;
        let (key, value) = (key.to_owned(), value.to_vec());
        self.write(move |records, meta| {
            if live_version(records, &key)?.is_some() {
                return Ok((None, false));
            }
            Ok((Some(insert(records, meta, &key, &value, ttl)?), true))
        })
        .await
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
        // A version this store never issued cannot match.
        let Ok(expected) = expected.0.parse::<u64>() else {
            return Ok(None);
        };
        let (key, value) = (key.to_owned(), value.to_vec());
        self.write(move |records, meta| {
            if live_version(records, &key)? != Some(expected) {
                return Ok((None, false));
            }
            Ok((Some(insert(records, meta, &key, &value, ttl)?), true))
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        validate_key(key)?;
        let key = key.to_owned();
        self.write(move |records, _| {
            let now = now_unix_ms();
            let Some(guard) = records.remove(key.as_str())? else {
                return Ok((false, false));
            };
            // A corrupt record is removed too, and counts as removed.
            let live = decode(&key, guard.value()).map_or(true, |r| r.live(now));
            Ok((live, true))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        validate_prefix(prefix)?;
        let prefix = prefix.to_owned();
        self.run(move |db| {
            let now = now_unix_ms();
            let txn = db.begin_read()?;
            let records = txn.open_table(RECORDS)?;
            let mut keys = Vec::new();
            for item in records.range::<&str>(prefix.as_str()..)? {
                let (k, v) = item?;
                let k = k.value();
                if !k.starts_with(prefix.as_str()) {
                    break;
                }
                // Corrupt records are listed, so that `get` reports them.
                if decode(k, v.value()).map_or(true, |r| r.live(now)) {
                    keys.push(k.to_owned());
                }
            }
            Ok(keys)
        })
        .await
    }

    /// The lock record, the value and the write in one write transaction.
    async fn put_fenced(
        &self,
        key: &str,
        value: &[u8],
        lock_key: &str,
        fence: u64,
    ) -> Result<Version, StoreError> {
        super::validate_fenced_write(key, value, lock_key)?;
        let (key, value, lock_key) = (key.to_owned(), value.to_vec(), lock_key.to_owned());
        self.write(move |records, meta| {
            let now = now_unix_ms();
            let lock_guard = records.get(lock_key.as_str())?;
            let lock_record = match &lock_guard {
                Some(guard) => Some(decode(&lock_key, guard.value())?),
                None => None,
            };
            let value_guard = records.get(key.as_str())?;
            let current = match &value_guard {
                Some(guard) => Some(decode(&key, guard.value())?),
                None => None,
            };
            lock::check_fence(
                &key,
                &lock_key,
                fence,
                lock_record.filter(|r| r.live(now)).map(|r| r.value),
                current.filter(|r| r.live(now)).map(|r| r.value),
            )
            .map_err(Failure::Store)?;
            drop(value_guard);
            drop(lock_guard);
            Ok((insert(records, meta, &key, &value, None)?, true))
        })
        .await
    }

    async fn sweep_expired(&self) -> Result<usize, StoreError> {
        self.write(|records, _| {
            let now = now_unix_ms();
            let mut removed = 0;
            // Corrupt records are kept: a sweeper must not destroy evidence.
            records.retain(|k, v| {
                let keep = decode(k, v).map_or(true, |r| r.live(now));
                removed += usize::from(!keep);
                keep
            })?;
            Ok((removed, removed > 0))
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn second_open_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let first = RedbStore::open(dir.path().join("nested")).await.unwrap();
        assert_eq!(
            first.path(),
            dir.path().join("nested").join("certstore.redb")
        );
        let err = RedbStore::open(dir.path().join("nested"))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("certstore.redb"), "{err}");
        assert!(err.contains("already open"), "{err}");
    }

    #[tokio::test]
    async fn data_and_versions_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let v1 = {
            let store = RedbStore::open(dir.path()).await.unwrap();
            store.put("a/b", b"one", None).await.unwrap()
        };
        let store = RedbStore::open(dir.path()).await.unwrap();
        let entry = store.get("a/b").await.unwrap().unwrap();
        assert_eq!(entry.value, b"one");
        assert_eq!(entry.version, v1);
        assert!(store.delete("a/b").await.unwrap());
        let v2 = store.put_if_absent("a/b", b"two", None).await.unwrap();
        assert!(v2.is_some());
        assert_ne!(v2, Some(v1), "a version was reused after reopen");
    }

    #[tokio::test]
    async fn sweep_counts_expired_records() {
        let dir = tempfile::tempdir().unwrap();
        let store = RedbStore::open(dir.path()).await.unwrap();
        store
            .put("t/gone", b"x", Some(Duration::from_millis(1)))
            .await
            .unwrap();
        store.put("t/kept", b"x", None).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while store.get("t/gone").await.unwrap().is_some() {
            assert!(std::time::Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(store.sweep_expired().await.unwrap(), 1);
        assert_eq!(store.sweep_expired().await.unwrap(), 0);
        assert_eq!(store.list("t/").await.unwrap(), vec!["t/kept".to_owned()]);
    }

    #[test]
    fn short_records_are_corrupt_not_a_panic() {
        for len in 0..HEADER_LEN {
            assert!(decode("k", &vec![0u8; len]).is_err());
        }
        let bytes = encode(7, None, b"v");
        let Ok(r) = decode("k", &bytes) else {
            panic!("a fresh record does not decode");
        };
        assert_eq!(
            (r.version, r.expires_at_unix_ms, r.value),
            (7, None, &b"v"[..])
        );
    }
}
