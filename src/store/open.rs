//! Opening the store that `proxy.acme.storage_backend` and `storage_path`
//! name (docs/reference.md#storage-paths), counted in the store metrics, and the readiness
//! probe behind `/readyz`'s "the store answered".

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::file::FileStore;
use super::instrumented::Instrumented;
use super::memory::MemoryStore;
use super::object::{ObjectBackend, ObjectLocation};
use super::redb::RedbStore;
use super::redis::RedisStore;
use super::{Store, StoreError};
use crate::config::StorageBackend;
use crate::metrics::Metrics;

/// Budget of every Redis operation, connecting included.
pub(crate) const REDIS_OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Budget of one readiness probe.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// The key the readiness probe reads (it need not exist).
pub(crate) const PROBE_KEY: &str = "sbmesh/readyz-probe";

/// Opens the store for `backend`, wrapped so that every operation is counted
/// in `store_operations_total`.
///
/// `storage_path` is read as docs/reference.md#storage-paths says for each backend. For
/// `redb` and `file` an empty `storage_path` means `state_dir` (redb:
/// `<state_dir>/certstore.redb`; file: `<state_dir>/certstore`); `memory`
/// ignores both.
///
/// Must be called within a Tokio runtime. Network backends connect lazily:
/// an unreachable server is an error of the first operation (see [`probe`]),
/// not of this call; a malformed `storage_path` is a
/// [`StoreError::Config`] here.
#[cfg(test)]
pub(crate) async fn open_store(
    backend: StorageBackend,
    storage_path: &str,
    state_dir: &Path,
    metrics: Arc<Metrics>,
) -> Result<Arc<dyn Store>, StoreError> {
    open(backend, storage_path, state_dir, None, metrics).await
}

/// `open_store` for the replicas of one cluster: on Redis, whose database
/// several clusters may share, keys live under the namespace
/// `sbmesh/<cluster_id>` (the other backends name their place in
/// `storage_path` already).
pub(crate) async fn open_cluster_store(
    backend: StorageBackend,
    storage_path: &str,
    state_dir: &Path,
    cluster_id: &str,
    metrics: Arc<Metrics>,
) -> Result<Arc<dyn Store>, StoreError> {
    let namespace = format!("{}/{cluster_id}", super::redis::DEFAULT_NAMESPACE);
    open(backend, storage_path, state_dir, Some(&namespace), metrics).await
}

async fn open(
    backend: StorageBackend,
    storage_path: &str,
    state_dir: &Path,
    redis_namespace: Option<&str>,
    metrics: Arc<Metrics>,
) -> Result<Arc<dyn Store>, StoreError> {
    let storage_path = storage_path.trim();
    let needs_path = |what: &str| {
        if storage_path.is_empty() {
            Err(StoreError::Config(format!(
                "storage_backend {backend} needs storage_path: {what}",
                what = if what.is_empty() {
                    backend.path_form()
                } else {
                    what
                }
            )))
        } else {
            Ok(())
        }
    };
    let store: Arc<dyn Store> = match backend {
        StorageBackend::Memory => instrument(MemoryStore::new(), metrics),
        StorageBackend::Redis => {
            needs_path("")?;
            let mut store = RedisStore::connect(storage_path, REDIS_OP_TIMEOUT).await?;
            if let Some(namespace) = redis_namespace {
                store = store.with_namespace(namespace)?;
            }
            instrument(store, metrics)
        }
        StorageBackend::Redb => instrument(
            RedbStore::open(local_dir(storage_path, state_dir, None)).await?,
            metrics,
        ),
        StorageBackend::File => instrument(
            FileStore::open(local_dir(storage_path, state_dir, Some("certstore"))).await?,
            metrics,
        ),
        StorageBackend::S3 | StorageBackend::Gcs | StorageBackend::Azure => {
            needs_path("")?;
            let named = ObjectLocation::parse(storage_path)?.backend();
            if named != backend.as_str() {
                return Err(StoreError::Config(format!(
                    "storage_backend is {backend} but storage_path {storage_path:?} is a {named} location; expected {}",
                    backend.path_form()
                )));
            }
            instrument(ObjectBackend::open(storage_path)?, metrics)
        }
    };
    Ok(store)
}

fn instrument<S: Store + 'static>(store: S, metrics: Arc<Metrics>) -> Arc<dyn Store> {
    Arc::new(Instrumented::new(Arc::new(store), metrics))
}

/// The directory of a local backend: `storage_path`, else `state_dir`
/// (joined with `sub` when given).
fn local_dir(storage_path: &str, state_dir: &Path, sub: Option<&str>) -> PathBuf {
    if storage_path.is_empty() {
        match sub {
            Some(sub) => state_dir.join(sub),
            None => state_dir.to_path_buf(),
        }
    } else {
        PathBuf::from(storage_path)
    }
}

/// Whether the store answers: a `get` of [`PROBE_KEY`] (absent is fine)
/// within [`PROBE_TIMEOUT`].
///
/// `/readyz` checks are synchronous; run this periodically in a task and
/// let the check read the last outcome.
pub(crate) async fn probe(store: &dyn Store) -> Result<(), StoreError> {
    match tokio::time::timeout(PROBE_TIMEOUT, store.get(PROBE_KEY)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(StoreError::Timeout {
            backend: store.backend(),
            op: "probe",
            after: PROBE_TIMEOUT,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_opens_counted_and_answers_the_probe() {
        let metrics = Arc::new(Metrics::new());
        let store = open_store(
            StorageBackend::Memory,
            "",
            Path::new("/nonexistent"),
            Arc::clone(&metrics),
        )
        .await
        .unwrap();
        assert_eq!(store.backend(), "memory");
        probe(store.as_ref()).await.unwrap();
        assert!(
            metrics
                .encode()
                .contains(r#"store_operations_total{backend="memory",op="get",result="miss"} 1"#)
        );
    }

    #[tokio::test]
    async fn shared_backends_need_a_path() {
        for backend in [
            StorageBackend::Redis,
            StorageBackend::S3,
            StorageBackend::Gcs,
            StorageBackend::Azure,
        ] {
            let err = open_store(backend, " ", Path::new("/tmp"), Arc::new(Metrics::new()))
                .await
                .unwrap_err();
            assert!(
                matches!(&err, StoreError::Config(m) if m.contains("storage_path")),
                "{backend}: {err}"
            );
        }
    }

    #[tokio::test]
    async fn object_paths_must_match_the_backend() {
        let err = open_store(
            StorageBackend::S3,
            "az://container/prefix",
            Path::new("/tmp"),
            Arc::new(Metrics::new()),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&err, StoreError::Config(m) if m.contains("s3://bucket/prefix")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn local_backends_open_in_the_state_dir() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = Arc::new(Metrics::new());
        let redb = open_store(StorageBackend::Redb, "", dir.path(), Arc::clone(&metrics))
            .await
            .unwrap();
        assert_eq!(redb.backend(), "redb");
        probe(redb.as_ref()).await.unwrap();
        assert!(dir.path().join("certstore.redb").is_file());
        let file = open_store(StorageBackend::File, "", dir.path(), Arc::clone(&metrics))
            .await
            .unwrap();
        assert_eq!(file.backend(), "file");
        file.put("a", b"1", None).await.unwrap();
        assert!(dir.path().join("certstore").is_dir());
        assert!(
            metrics
                .encode()
                .contains(r#"store_operations_total{backend="file",op="put",result="ok"} 1"#)
        );
    }

    #[test]
    fn local_dirs_default_to_the_state_dir() {
        let state = Path::new("/state");
        assert_eq!(local_dir("", state, None), Path::new("/state"));
        assert_eq!(
            local_dir("", state, Some("certstore")),
            Path::new("/state/certstore")
        );
        assert_eq!(local_dir("/data", state, None), Path::new("/data"));
    }
}
