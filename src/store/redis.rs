//! `redis`: a store every replica shares, on one Redis (or Valkey) server.
//!
//! # Layout
//!
//! Each store key is one Redis string at `<namespace>:<key>` (namespace
//! `sbmesh` unless [`RedisStore::with_namespace`] says otherwise). Its bytes
//! are a fixed 52-byte header and then the value:
//!
//! ```text
//! "sbm1" | version: 32 lowercase hex chars | expiry: 16 hex chars (unix ms, 0 = none) | value
//! ```
//!
//! The version is 128 random bits, so a key that is deleted and created
//! again never gets a version an old reader still holds. The expiry is kept
//! natively with `PX`; the header only repeats it for [`Entry`].
//!
//! # Atomicity
//!
//! `get`, `put`, `put_if_absent` (`SET NX PX`) and `delete` are single
//! commands; `compare_and_swap` and `put_fenced` (the lock record's fence
//! and the value's checked, then the write) are Lua scripts (`EVALSHA`,
//! loaded on first use), so every operation is atomic on the server. Keys and values
//! always travel as command arguments, never spliced into command text.
//!
//! # Failures
//!
//! The connection is a [`ConnectionManager`], which reconnects by itself
//! when the connection drops; it is opened lazily, so
//! [`RedisStore::connect`] succeeds while Redis is still down. Every
//! operation is bounded by the operation timeout and ends in
//! [`StoreError::Timeout`] or [`StoreError::Backend`], never a hang. A
//! write that fails that way may or may not have been applied.
//!
//! The manager only replaces a connection that reports an I/O error; one
//! that silently stops answering (a frozen server, a peer gone from the
//! network) would be kept until the kernel gives up on it, minutes later.
//! So an operation that times out, or a connection that could not be set
//! up (refused password, …), makes the store start over with a fresh
//! manager.
//!
//! # Expiry and clocks
//!
//! An [`Entry`]'s `expires_at_unix_ms` is this process's clock before the
//! write plus the TTL, while Redis counts the TTL from when it receives the
//! write. So Redis keeps a record up to one round trip past the reported
//! expiry and never drops it before, whatever the clocks say: a lease
//! holder that trusts `expires_at_unix_ms` stops before anyone else can
//! take over.
//!
//! Lease locks use no Redis TTL (their record must outlive the lease):
//! they judge expiry on the server's clock, which
//! [`Store::clock_offset_ms`] reads with `TIME` (cached, see
//! `super::clock`), so replicas whose clocks disagree still agree on it.

use std::fmt;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Client, ErrorKind, RedisError, Script};
use async_trait::async_trait;

use super::clock::{ClockSync, Reading};
use super::{
    Entry, Store, StoreError, Version, now_unix_ms, validate_key, validate_prefix, validate_value,
};

const BACKEND: &str = "redis";

/// The key namespace used unless [`RedisStore::with_namespace`] changes it.
pub(crate) const DEFAULT_NAMESPACE: &str = "sbmesh";

const MAGIC: &[u8; 4] = b"sbm1";
const VERSION_LEN: usize = 32;
const EXPIRY_LEN: usize = 16;
const HEADER_LEN: usize = MAGIC.len() + VERSION_LEN + EXPIRY_LEN;

/// Longest TTL passed to Redis (about 300 years); Redis refuses `PX`
/// values whose absolute time overflows.
const MAX_TTL_MS: u64 = 10_000_000_000_000;

/// Keys fetched per `SCAN` round trip.
const SCAN_COUNT: u64 = 1000;

/// Replaces the record only when its header carries the expected version.
/// `KEYS[1]`: the Redis key. `ARGV[1]`: expected version; `ARGV[2]`: the new
/// record; `ARGV[3]`: TTL in ms, '' for none, '0' when the new record is
/// already expired (so it is removed). Returns 1 when swapped, 0 otherwise.
/// The offsets match the header layout (`MAGIC`, then `VERSION_LEN` chars).
const CAS_LUA: &str = r"
local cur = redis.call('GET', KEYS[1])
if not cur or string.sub(cur, 1, 4) ~= 'sbm1' or string.sub(cur, 5, 36) ~= ARGV[1] then
  return 0
end
if ARGV[3] == '' then
  redis.call('SET', KEYS[1], ARGV[2])
elseif ARGV[3] == '0' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 1
";

/// A fenced write ([`Store::put_fenced`]): checks the lock record's fence
/// and the current value's, then writes, all in one script.
/// `KEYS[1]`: the value's Redis key; `KEYS[2]`: the lock record's. `ARGV[1]`: the
/// writer's fence (decimal); `ARGV[2]`: the new record. Returns `{1, ''}`
/// when written, `{0, newest}` when a newer fence exists, `{-1, why}` for
/// a lock record that is not one. The offsets match the header layout
/// (`HEADER_LEN` bytes, then the fenced value's magic and u64 fence).
const FENCED_LUA: &str = r"
local fence = tonumber(ARGV[1])
local lock = redis.call('GET', KEYS[2])
if lock then
  if string.sub(lock, 1, 4) ~= 'sbm1' then
    return {-1, 'lock record without the sbm1 header'}
  end
  local ok, rec = pcall(cjson.decode, string.sub(lock, 53))
  if not ok or type(rec) ~= 'table' or type(rec['fence']) ~= 'number' then
    return {-1, 'not a lock record'}
  end
  if rec['fence'] > fence then
    return {0, string.format('%.0f', rec['fence'])}
  end
end
local cur = redis.call('GET', KEYS[1])
if cur and string.len(cur) >= 64 then
  local magic = string.sub(cur, 53, 56)
  if magic == 'sbf1' or magic == 'sbfc' then
    local f = 0
    for i = 57, 64 do
      f = f * 256 + string.byte(cur, i)
    end
    if f > fence then
      return {0, string.format('%.0f', f)}
    end
  end
end
redis.call('SET', KEYS[1], ARGV[2])
return {1, ''}
";

/// A store on a Redis server, shared by every replica that points at the
/// same server, database and namespace (`storage_backend: redis`).
pub struct RedisStore {
    client: Client,
    /// The current manager, and how many times it has been replaced.
    conn: Mutex<(u64, ConnectionManager)>,
    /// `<namespace>:`, prepended to every key.
    key_prefix: String,
    /// The URL with any password hidden, for messages.
    target: String,
    op_timeout: Duration,
    cas: Script,
    fenced: Script,
    clock: ClockSync,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("target", &self.target)
            .field("namespace", &self.namespace())
            .field("op_timeout", &self.op_timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Prepares a store on `url_or_host_port`: `redis://[user:password@]host:port/db`,
    /// `rediss://…` (TLS, the server verified against the system roots;
    /// point `SSL_CERT_FILE` at a private CA), or a bare `host:port`
    /// (plain, db 0).
    ///
    /// Connects lazily: this fails only on a malformed address or setting,
    /// and succeeds while Redis is down (operations then fail until it
    /// answers). Every operation, connecting included, gets `op_timeout`.
    /// Must be called within a Tokio runtime.
    pub async fn connect(url_or_host_port: &str, op_timeout: Duration) -> Result<Self, StoreError> {
        let url = normalize_url(url_or_host_port)?;
        let target = redact_url(&url);
        if op_timeout.is_zero() {
            return Err(StoreError::Config(
                "the redis operation timeout must be greater than zero".into(),
            ));
        }
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(StoreError::Config(
                "the redis store must be created within a Tokio runtime".into(),
            ));
        }
        let client = Client::open(url.as_str()).map_err(|e| {
            StoreError::Config(format!(
                "storage_path {target:?} is not a usable Redis URL ({e}); expected redis://host:port/db, rediss://host:port/db or host:port"
            ))
        })?;
        let conn = new_manager(&client, op_timeout)
            .map_err(|e| StoreError::Config(format!("redis store for {target}: {e}")))?;
        Ok(Self {
            client,
            conn: Mutex::new((0, conn)),
            key_prefix: format!("{DEFAULT_NAMESPACE}:"),
            target,
            op_timeout,
            cas: Script::new(CAS_LUA),
            fenced: Script::new(FENCED_LUA),
            clock: ClockSync::new(),
        })
    }

    /// Puts every key under `<namespace>:` instead of `sbmesh:`, so that
    /// several clusters (or test runs) can share one database. The
    /// namespace has the form of a store key (see [`validate_key`]).
    pub fn with_namespace(mut self, namespace: &str) -> Result<Self, StoreError> {
        validate_key(namespace)
            .map_err(|e| StoreError::Config(format!("redis key namespace: {e}")))?;
        self.key_prefix = format!("{namespace}:");
        Ok(self)
    }

    /// The key namespace.
    pub(crate) fn namespace(&self) -> &str {
        self.key_prefix
            .strip_suffix(':')
            .unwrap_or(&self.key_prefix)
    }

    /// The server address, with any password hidden.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// Checks that the server answers (for readiness).
    pub async fn ping(&self) -> Result<(), StoreError> {
        let _: String = self
            .run("ping", |mut conn| async move {
                ::redis::cmd("PING").query_async(&mut conn).await
            })
            .await?;
        Ok(())
    }

    fn redis_key(&self, key: &str) -> String {
        format!("{}{key}", self.key_prefix)
    }

    fn lock_conn(&self) -> std::sync::MutexGuard<'_, (u64, ConnectionManager)> {
        // Held only to clone or replace a handle: a panic elsewhere cannot
        // leave it half-updated.
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces manager number `generation` with a fresh one, unless
    /// another operation already did.
    fn start_over(&self, generation: u64) {
        let mut conn = self.lock_conn();
        if conn.0 == generation
            && let Ok(fresh) = new_manager(&self.client, self.op_timeout)
        {
            *conn = (generation + 1, fresh);
        }
    }

    /// Runs one operation on the current connection within the timeout,
    /// mapping its errors.
    async fn run<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: Future<Output = Result<T, RedisError>>,
    {
        let (generation, conn) = self.lock_conn().clone();
        match tokio::time::timeout(self.op_timeout, f(conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                if needs_new_manager(&e) {
                    self.start_over(generation);
                }
                Err(StoreError::Backend {
                    backend: BACKEND,
                    message: format!("{op} on {}: {e}", self.target),
                })
            }
            Err(_) => {
                self.start_over(generation);
                Err(StoreError::Timeout {
                    backend: BACKEND,
                    op,
                    after: self.op_timeout,
                })
            }
        }
    }
}

/// A lazily connecting manager. Reconnect attempts back off briefly and
/// give up within about a second, so an outage surfaces as errors quickly;
/// the next operation starts a new attempt, so recovery is as quick.
fn new_manager(client: &Client, op_timeout: Duration) -> Result<ConnectionManager, RedisError> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(op_timeout))
        // The operation timeout bounds responses (and starts over on expiry).
        .set_response_timeout(None)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_millis(500))
        .set_number_of_retries(3);
    ConnectionManager::new_lazy_with_config(client.clone(), config)
}

/// Whether an error may leave the manager stuck: it reconnects after I/O
/// errors by itself, and a server's reply to a command (WRONGTYPE, a script
/// error, …) says nothing about the connection; any other error may come
/// from a connection that could not be set up (a refused password), which
/// the manager would keep returning.
fn needs_new_manager(e: &RedisError) -> bool {
    !matches!(
        e.kind(),
        ErrorKind::Io
            | ErrorKind::Server(_)
            | ErrorKind::Extension
            | ErrorKind::UnexpectedReturnType
    )
}

/// How a write's TTL maps onto Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expiry {
    /// No TTL.
    Never,
    /// `PX` this many ms (at least 1).
    Px(u64),
    /// A TTL under 1 ms: the record is expired as soon as it is written,
    /// as in every other backend (and Redis refuses `PX 0`).
    Already,
}

/// The Redis expiry of a write starting at `now`, and the absolute expiry
/// the record reports.
fn plan_expiry(ttl: Option<Duration>, now: u64) -> (Expiry, Option<u64>) {
    match ttl {
        None => (Expiry::Never, None),
        Some(ttl) => {
            let ms = u64::try_from(ttl.as_millis())
                .unwrap_or(u64::MAX)
                .min(MAX_TTL_MS);
            let at = Some(now.saturating_add(ms));
            if ms == 0 {
                (Expiry::Already, at)
            } else {
                (Expiry::Px(ms), at)
            }
        }
    }
}

fn new_version() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn is_version(s: &str) -> bool {
    s.len() == VERSION_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn encode(version: &str, expires_at_unix_ms: Option<u64>, value: &[u8]) -> Vec<u8> {
    let mut rec = Vec::with_capacity(HEADER_LEN + value.len());
    rec.extend_from_slice(MAGIC);
    rec.extend_from_slice(version.as_bytes());
    rec.extend_from_slice(format!("{:016x}", expires_at_unix_ms.unwrap_or(0)).as_bytes());
    rec.extend_from_slice(value);
    rec
}

fn decode(mut rec: Vec<u8>) -> Result<Entry, &'static str> {
    if rec.len() < HEADER_LEN || !rec.starts_with(MAGIC) {
        return Err("not an sbmesh record (no 'sbm1' header)");
    }
    let version = std::str::from_utf8(&rec[MAGIC.len()..MAGIC.len() + VERSION_LEN])
        .ok()
        .filter(|v| is_version(v))
        .ok_or("malformed version in the header")?
        .to_owned();
    let expiry = std::str::from_utf8(&rec[MAGIC.len() + VERSION_LEN..HEADER_LEN])
        .ok()
        .filter(|e| e.bytes().all(|b| b.is_ascii_hexdigit()))
        .and_then(|e| u64::from_str_radix(e, 16).ok())
        .ok_or("malformed expiry in the header")?;
    let value = rec.split_off(HEADER_LEN);
    Ok(Entry {
        value,
        version: Version(version),
        expires_at_unix_ms: (expiry != 0).then_some(expiry),
    })
}

/// Accepts `redis://…`, `rediss://…` or a bare `host:port`; returns a URL
/// for the redis crate.
fn normalize_url(input: &str) -> Result<String, StoreError> {
    let input = input.trim();
    if input.is_empty() {
        return Err(StoreError::Config(
            "storage_path is empty; the redis backend needs redis://host:port/db, rediss://host:port/db or host:port".into(),
        ));
    }
    match input.split_once("://") {
        None => Ok(format!("redis://{input}")),
        Some(("redis" | "rediss", _)) => Ok(input.to_owned()),
        Some((scheme, _)) => Err(StoreError::Config(format!(
            "storage_path {:?}: unsupported scheme {scheme:?} for the redis backend; use redis://host:port/db, rediss://host:port/db or host:port",
            redact_url(input)
        ))),
    }
}

/// The URL with the password (after `user:`, up to the last `@`) hidden.
fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let rest = match rest.rfind('@') {
        Some(at) => {
            let (userinfo, host) = rest.split_at(at);
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***{host}"),
                None if scheme.is_some() => rest.to_owned(),
                // Without a scheme, anything before '@' is suspect.
                None => format!("***{host}"),
            }
        }
        None => rest.to_owned(),
    };
    match scheme {
        Some(scheme) => format!("{scheme}://{rest}"),
        None => rest,
    }
}

/// Escapes Redis glob metacharacters so `s` matches only itself.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\' | '^' | '-') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[async_trait]
impl Store for RedisStore {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn is_shared(&self) -> bool {
        true
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        validate_key(key)?;
        let rkey = self.redis_key(key);
        let rec: Option<Vec<u8>> = self
            .run("get", |mut conn| async move {
                ::redis::cmd("GET").arg(&rkey).query_async(&mut conn).await
            })
            .await?;
        rec.map(decode)
            .transpose()
            .map_err(|message| StoreError::Corrupt {
                key: key.to_owned(),
                message: message.to_owned(),
            })
    }

    async fn put(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Version, StoreError> {
        validate_key(key)?;
        validate_value(key, value)?;
        let (expiry, at) = plan_expiry(ttl, now_unix_ms());
        let version = new_version();
        let rkey = self.redis_key(key);
        let mut cmd = ::redis::Cmd::new();
        match expiry {
            // Written and expired at once: nothing remains.
            Expiry::Already => cmd.arg("DEL").arg(&rkey),
            Expiry::Never => cmd.arg("SET").arg(&rkey).arg(encode(&version, at, value)),
            Expiry::Px(ms) => cmd
                .arg("SET")
                .arg(&rkey)
                .arg(encode(&version, at, value))
                .arg("PX")
                .arg(ms),
        };
        self.run("put", |mut conn| async move {
            cmd.query_async::<::redis::Value>(&mut conn).await
        })
        .await?;
        Ok(Version(version))
    }

    async fn put_if_absent(
        &self,
        key: &str,
        value: &[u8],
        ttl: Option<Duration>,
    ) -> Result<Option<Version>, StoreError> {
        validate_key(key)?;
        validate_value(key, value)?;
        let (expiry, at) = plan_expiry(ttl, now_unix_ms());
        let version = new_version();
        let rkey = self.redis_key(key);
        let mut cmd = ::redis::Cmd::new();
        match expiry {
            // Nothing would remain to store, but whether the write "wins"
            // still depends on the key.
            Expiry::Already => cmd.arg("EXISTS").arg(&rkey),
            Expiry::Never => cmd
                .arg("SET")
                .arg(&rkey)
                .arg(encode(&version, at, value))
                .arg("NX"),
            Expiry::Px(ms) => cmd
                .arg("SET")
                .arg(&rkey)
                .arg(encode(&version, at, value))
                .arg("NX")
                .arg("PX")
                .arg(ms),
        };
        let reply: ::redis::Value = self
            .run("put_if_absent", |mut conn| async move {
                cmd.query_async(&mut conn).await
            })
            .await?;
        let created = match (expiry, reply) {
            (Expiry::Already, ::redis::Value::Int(n)) => n == 0,
            // SET NX: OK when set, nil when the key exists.
            (_, ::redis::Value::Okay) => true,
            (_, ::redis::Value::Nil) => false,
            (_, other) => {
                return Err(StoreError::Backend {
                    backend: BACKEND,
                    message: format!(
                        "put_if_absent on {}: unexpected reply {other:?}",
                        self.target
                    ),
                });
            }
        };
        Ok(created.then_some(Version(version)))
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
        if !is_version(&expected.0) {
            // Not a version this backend hands out: it cannot match.
            return Ok(None);
        }
        let (expiry, at) = plan_expiry(ttl, now_unix_ms());
        let version = new_version();
        let px = match expiry {
            Expiry::Never => String::new(),
            Expiry::Px(ms) => ms.to_string(),
            Expiry::Already => "0".to_owned(),
        };
        let mut invocation = self.cas.key(self.redis_key(key));
        invocation
            .arg(&expected.0)
            .arg(encode(&version, at, value))
            .arg(px);
        let swapped: i64 = self
            .run("compare_and_swap", |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        Ok((swapped == 1).then_some(Version(version)))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        validate_key(key)?;
        let rkey = self.redis_key(key);
        // DEL does not count a key that has expired.
        let removed: i64 = self
            .run("delete", |mut conn| async move {
                ::redis::cmd("DEL").arg(&rkey).query_async(&mut conn).await
            })
            .await?;
        Ok(removed > 0)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        validate_prefix(prefix)?;
        let full_prefix = self.redis_key(prefix);
        let pattern = format!("{}*", glob_escape(&full_prefix));
        let raw: Vec<Vec<u8>> = self
            .run("list", |mut conn| async move {
                let mut keys = Vec::new();
                let mut cursor: u64 = 0;
                loop {
                    let (next, batch): (u64, Vec<Vec<u8>>) = ::redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(SCAN_COUNT)
                        .query_async(&mut conn)
                        .await?;
                    keys.extend(batch);
                    if next == 0 {
                        return Ok(keys);
                    }
                    cursor = next;
                }
            })
            .await?;
        // SCAN leaves out expired keys but may return a key twice; keys
        // that are not store keys (written by something else) are skipped.
        let mut keys: Vec<String> = raw
            .into_iter()
            .filter_map(|k| String::from_utf8(k).ok())
            .filter(|k| k.starts_with(&full_prefix))
            .filter_map(|k| k.strip_prefix(&self.key_prefix).map(str::to_owned))
            .filter(|k| validate_key(k).is_ok())
            .collect();
        keys.sort();
        keys.dedup();
        Ok(keys)
    }

    /// One script (`FENCED_LUA`) checks both fences and writes. Both keys
    /// must live on one server (no Redis Cluster across slots), which this
    /// backend assumes throughout.
    async fn put_fenced(
        &self,
        key: &str,
        value: &[u8],
        lock_key: &str,
        fence: u64,
    ) -> Result<Version, StoreError> {
        super::validate_fenced_write(key, value, lock_key)?;
        let version = new_version();
        let mut invocation = self.fenced.key(self.redis_key(key));
        invocation
            .key(self.redis_key(lock_key))
            .arg(fence.to_string())
            .arg(encode(&version, None, value));
        let (status, detail): (i64, String) = self
            .run("put_fenced", |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        match status {
            1 => Ok(Version(version)),
            0 => Err(StoreError::Fenced {
                key: key.to_owned(),
                fence,
                // Lua numbers are doubles: exact for any fence below 2^53.
                newest: detail.parse().unwrap_or(u64::MAX),
            }),
            _ => Err(StoreError::Corrupt {
                key: lock_key.to_owned(),
                message: detail,
            }),
        }
    }

    /// The server's clock (`TIME`, microseconds).
    async fn clock_offset_ms(&self) -> Result<i64, StoreError> {
        self.clock
            .offset(BACKEND, || async {
                let (secs, micros): (u64, u64) = self
                    .run("time", |mut conn| async move {
                        ::redis::cmd("TIME").query_async(&mut conn).await
                    })
                    .await?;
                Ok(Reading {
                    server_ms: secs.saturating_mul(1000).saturating_add(micros / 1000),
                    resolution_ms: 1,
                })
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let v = new_version();
        assert!(is_version(&v), "{v}");
        for (value, at) in [
            (&b""[..], None),
            (&b"\x00\xffchain"[..], Some(1_700_000_000_123)),
        ] {
            let rec = encode(&v, at, value);
            assert_eq!(rec.len(), HEADER_LEN + value.len());
            let e = decode(rec).unwrap();
            assert_eq!(e.value, value);
            assert_eq!(e.version.0, v);
            assert_eq!(e.expires_at_unix_ms, at);
        }
        assert_ne!(new_version(), new_version());
    }

    #[test]
    fn corrupt_records_are_errors() {
        let good = encode(&new_version(), None, b"x");
        assert!(decode(good[..HEADER_LEN - 1].to_vec()).is_err());
        assert!(decode(b"a plain value written by someone else".to_vec()).is_err());
        let mut bad_version = good.clone();
        bad_version[4] = b'Z';
        assert!(decode(bad_version).is_err());
        let mut bad_expiry = good;
        bad_expiry[HEADER_LEN - 1] = b'+';
        assert!(decode(bad_expiry).is_err());
    }

    #[test]
    fn lua_offsets_match_the_header() {
        let magic = std::str::from_utf8(MAGIC).unwrap();
        assert!(CAS_LUA.contains(&format!("string.sub(cur, 1, {}) ~= '{magic}'", MAGIC.len())));
        assert!(CAS_LUA.contains(&format!(
            "string.sub(cur, {}, {}) ~= ARGV[1]",
            MAGIC.len() + 1,
            MAGIC.len() + VERSION_LEN
        )));
    }

    #[test]
    fn fenced_lua_offsets_match_the_headers() {
        use crate::store::lock::{CLAIM_MAGIC, FENCED_HEADER_LEN, FENCED_MAGIC};
        let body = HEADER_LEN + 1;
        assert!(FENCED_LUA.contains(&format!("string.sub(lock, {body}))")));
        assert!(FENCED_LUA.contains(&format!(
            "string.len(cur) >= {}",
            HEADER_LEN + FENCED_HEADER_LEN
        )));
        assert!(FENCED_LUA.contains(&format!(
            "string.sub(cur, {body}, {})",
            HEADER_LEN + FENCED_MAGIC.len()
        )));
        for magic in [FENCED_MAGIC, CLAIM_MAGIC] {
            let magic = std::str::from_utf8(magic).unwrap();
            assert!(FENCED_LUA.contains(&format!("'{magic}'")));
        }
        assert!(FENCED_LUA.contains(&format!(
            "for i = {}, {} do",
            HEADER_LEN + FENCED_MAGIC.len() + 1,
            HEADER_LEN + FENCED_HEADER_LEN
        )));
    }

    #[test]
    fn expiry_plans() {
        assert_eq!(plan_expiry(None, 1000), (Expiry::Never, None));
        assert_eq!(
            plan_expiry(Some(Duration::from_millis(1500)), 1000),
            (Expiry::Px(1500), Some(2500))
        );
        assert_eq!(
            plan_expiry(Some(Duration::from_micros(999)), 1000),
            (Expiry::Already, Some(1000))
        );
        assert_eq!(
            plan_expiry(Some(Duration::MAX), 1000),
            (Expiry::Px(MAX_TTL_MS), Some(1000 + MAX_TTL_MS))
        );
    }

    #[test]
    fn urls() {
        assert_eq!(
            normalize_url("redis.default.svc:6379").unwrap(),
            "redis://redis.default.svc:6379"
        );
        assert_eq!(
            normalize_url(" rediss://h:6380/2 ").unwrap(),
            "rediss://h:6380/2"
        );
        assert!(normalize_url("").is_err());
        let err = normalize_url("http://:hunter2@h:1")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unsupported scheme"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");

        assert_eq!(
            redact_url("redis://:hunter2@h:6379/0"),
            "redis://:***@h:6379/0"
        );
        assert_eq!(
            redact_url("rediss://app:p@ss:w@rd@h:6380/1"),
            "rediss://app:***@h:6380/1"
        );
        assert_eq!(redact_url("redis://app@h:6379"), "redis://app@h:6379");
        assert_eq!(redact_url("redis://h:6379/0"), "redis://h:6379/0");
        assert_eq!(redact_url("secret@h:1"), "***@h:1");
    }

    #[test]
    fn globs_are_escaped() {
        assert_eq!(glob_escape("sbmesh:certs/a.b_c"), "sbmesh:certs/a.b_c");
        assert_eq!(glob_escape(r"a*b?c[d]e\f^g-h"), r"a\*b\?c\[d\]e\\f\^g\-h");
    }

    #[test]
    fn stuck_connection_errors() {
        let io = RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(!needs_new_manager(&io));
        let auth = RedisError::from((ErrorKind::AuthenticationFailed, "WRONGPASS"));
        assert!(needs_new_manager(&auth));
    }

    #[tokio::test]
    async fn bad_configuration_is_refused() {
        let d = Duration::from_secs(1);
        assert!(matches!(
            RedisStore::connect("127.0.0.1:6379", Duration::ZERO).await,
            Err(StoreError::Config(_))
        ));
        match RedisStore::connect("redis://:hunter2@h:not-a-port/0", d).await {
            Err(StoreError::Config(msg)) => assert!(!msg.contains("hunter2"), "{msg}"),
            other => panic!("{other:?}"),
        }
        // No server needed: connecting is lazy.
        let store = RedisStore::connect("127.0.0.1:6379", d).await.unwrap();
        assert_eq!(store.namespace(), DEFAULT_NAMESPACE);
        assert_eq!(store.backend(), "redis");
        assert!(store.is_shared());
        assert!(store.with_namespace("a:b").is_err());
        let store = RedisStore::connect("redis://:hunter2@127.0.0.1:6379/3", d)
            .await
            .unwrap()
            .with_namespace("test/run-1")
            .unwrap();
        assert_eq!(store.namespace(), "test/run-1");
        let debug = format!("{store:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
    }
}
