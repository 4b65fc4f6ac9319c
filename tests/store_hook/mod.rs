//! A store wrapper for tests: each operation goes through a [`Hook`] first,
//! which may count it, fail it or hold it, and then to the store it wraps.
//! Every method of [`Store`] is forwarded, `put_fenced`, `sweep_expired`
//! and `clock_offset_ms` included (the wrapped store's own, as the trait
//! asks of a wrapper, not the trait's defaults).

#![allow(dead_code)]

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sbmesh::{Entry, Store, StoreError, Version};

/// An operation of [`Store`], as a [`Hook`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Get,
    Put,
    PutIfAbsent,
    CompareAndSwap,
    Delete,
    List,
    SweepExpired,
    PutFenced,
    ClockOffset,
}

impl Op {
    /// Whether the operation writes a value (`put`, `put_if_absent`,
    /// `compare_and_swap`, `put_fenced`).
    pub fn writes(self) -> bool {
        matches!(
            self,
            Op::Put | Op::PutIfAbsent | Op::CompareAndSwap | Op::PutFenced
        )
    }
}

/// What a test does before each operation.
#[async_trait]
pub trait Hook: Send + Sync + 'static {
    /// Called before `op` on `key` (the prefix for `list`, empty for
    /// `sweep_expired` and `clock_offset_ms`). An error is the operation's
    /// answer, in the wrapped store's place; a future that never ends is a
    /// hanging store.
    async fn before(&self, op: Op, key: &str) -> Result<(), StoreError>;
}

/// A backend error, as a store that cannot be reached answers.
pub fn unreachable(backend: &'static str, message: &str) -> StoreError {
    StoreError::Backend {
        backend,
        message: message.into(),
    }
}

/// `inner` behind `hook`.
pub struct Hooked<H> {
    pub inner: Arc<dyn Store>,
    pub hook: H,
    shared: bool,
}

impl<H: Hook> Hooked<H> {
    /// Shared as `inner` is.
    pub fn new(inner: Arc<dyn Store>, hook: H) -> Arc<Self> {
        let shared = inner.is_shared();
        Arc::new(Self {
            inner,
            hook,
            shared,
        })
    }

    /// Said to be shared whatever `inner` is (a memory store standing for
    /// a shared one: a replica with peers orders only on a shared store).
    pub fn shared(inner: Arc<dyn Store>, hook: H) -> Arc<Self> {
        Arc::new(Self {
            inner,
            hook,
            shared: true,
        })
    }
}

impl<H> fmt::Debug for Hooked<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hooked")
            .field("inner", &self.inner)
            .finish()
    }
}

#[async_trait]
impl<H: Hook> Store for Hooked<H> {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn is_shared(&self) -> bool {
        self.shared
    }
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        self.hook.before(Op::Get, key).await?;
        self.inner.get(key).await
    }
    async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Version, StoreError> {
        self.hook.before(Op::Put, key).await?;
        self.inner.put(key, value, ttl).await
    }
    async fn put_if_absent(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        self.hook.before(Op::PutIfAbsent, key).await?;
        self.inner.put_if_absent(key, value, ttl).await
    }
    async fn compare_and_swap(
        &self,
        key: &str,
        expected: &Version,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        self.hook.before(Op::CompareAndSwap, key).await?;
        self.inner.compare_and_swap(key, expected, value, ttl).await
    }
    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.hook.before(Op::Delete, key).await?;
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        self.hook.before(Op::List, prefix).await?;
        self.inner.list(prefix).await
    }
    async fn sweep_expired(&self) -> Result<usize, StoreError> {
        self.hook.before(Op::SweepExpired, "").await?;
        self.inner.sweep_expired().await
    }
    async fn put_fenced(
        &self,
        key: &str,
        value: &[u8],
        lock_key: &str,
        fence: u64,
    ) -> Result<Version, StoreError> {
        self.hook.before(Op::PutFenced, key).await?;
        self.inner.put_fenced(key, value, lock_key, fence).await
    }
    async fn clock_offset_ms(&self) -> Result<i64, StoreError> {
        self.hook.before(Op::ClockOffset, "").await?;
        self.inner.clock_offset_ms().await
    }
}
