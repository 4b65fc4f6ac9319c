//! `s3`, `gcs` and `azure`: one backend over the `object_store` crate.
//!
//! `storage_path` is `s3://bucket/prefix`, `gs://bucket/prefix` or
//! `az://container/prefix` (the prefix is optional); credentials and
//! endpoints come from the standard environment variables (`AWS_*`,
//! `GOOGLE_*`, `AZURE_STORAGE_*`), read by `object_store`'s own `from_env`
//! builders. The bucket or container must exist: this backend never creates
//! one (object stores treat that as an administrative act with its own
//! permissions).
//!
//! Each key is one object, `<prefix>/<key>`, holding a 20-byte header and
//! the value:
//!
//! ```text
//! b"sbm1" | expiry, unix ms, u64 big-endian (0 = never) | 8 random bytes | value
//! ```
//!
//! The random bytes make every write's content unique, so an S3 ETag (an MD5
//! of the content) changes on every write, even when the value does not: a
//! compare-and-swap against a stale ETag can never succeed by coincidence.
//!
//! Atomicity comes from the stores' conditional writes: `put_if_absent` is
//! `PutMode::Create` (`If-None-Match: *`, or generation 0 on GCS), and
//! `compare_and_swap` is `PutMode::Update` (`If-Match: <etag>`, or the
//! generation on GCS). A [`Version`] carries the ETag, the object version
//! and the expiry of the record it names; because the ETag pins the content,
//! the expiry in the version is exact, and compare-and-swap against an
//! expired record fails without a request.
//!
//! Conditional writes cover one object, so a fenced write cannot check the
//! lock record in the same step: this backend uses the trait's default,
//! [`super::lock::put_fenced_by_claims`] (the fence lives in the value's own
//! compare-and-swap; see "Fences" in [`super::lock`]).
//!
//! The store's clock ([`Store::clock_offset_ms`], for lease expiry) is the
//! `Last-Modified` the service gives a probe object `<prefix>/~clock-<hex>`,
//! written, read with `HEAD` and deleted (three requests, every 30 s):
//! whole seconds, so each reading bounds the offset to about a second, and
//! successive readings narrow it (`super::clock`).
//!
//! What object stores cannot do: `object_store` has no conditional delete,
//! so [`Store::delete`] and [`Store::sweep_expired`] delete unconditionally.
//! The sweeper re-reads a record's ETag right before deleting it, which
//! leaves a window of one round trip in which a record that replaced the
//! expired one could be deleted. Expired records read as absent whether or
//! not they have been swept, so sweeping is only housekeeping; nothing that
//! needs a guarantee (the lease lock) should rely on a delete.
//!
//! Every operation runs under one budget ([`ObjectBackend::with_timeout`],
//! 10 s by default) and fails with [`StoreError::Timeout`] past it; the
//! client's own retries give up after half the default budget, so a dead
//! endpoint reports its error rather than a bare timeout. A missing bucket
//! or container is an error, never an empty store.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::path::Path;
use object_store::{
    ClientConfigKey, GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode,
    PutOptions, PutPayload, RetryConfig, UpdateVersion,
};

use super::clock::{ClockSync, Reading};
use super::{
    Entry, Store, StoreError, Version, expiry_from, now_unix_ms, validate_key, validate_prefix,
    validate_value,
};

/// Magic bytes at the start of every record.
const MAGIC: [u8; 4] = *b"sbm1";
/// Magic, expiry, nonce.
const HEADER_LEN: usize = 20;
/// Header reads in flight at once during `list` and `sweep_expired`.
const LIST_CONCURRENCY: usize = 16;
/// `put_if_absent` attempts while the key keeps changing underneath.
const CREATE_ATTEMPTS: usize = 5;

/// Which object store a `storage_path` names, and where in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectLocation {
    backend: &'static str,
    bucket: String,
    prefix: String,
}

impl ObjectLocation {
    /// Parses `s3://bucket/prefix`, `gs://bucket/prefix` or
    /// `az://container/prefix` (prefix optional, trailing `/` ignored).
    /// Pure: reads no environment and builds no client, so configuration
    /// validation can call it.
    pub fn parse(storage_path: &str) -> Result<Self, StoreError> {
        let bad = |what: String| {
            Err(StoreError::Config(format!(
                "storage_path {storage_path:?}: {what}; expected s3://bucket/prefix, \
                 gs://bucket/prefix or az://container/prefix (prefix optional)"
            )))
        };
        let Some((scheme, rest)) = storage_path.split_once("://") else {
            return bad("no scheme".into());
        };
        let backend = match scheme {
            "s3" => "s3",
            "gs" => "gcs",
            "az" => "azure",
            other => return bad(format!("unknown scheme {other:?}")),
        };
        if let Some(c) = rest
            .chars()
            .find(|c| matches!(c, '?' | '#' | '@' | ':' | '\\') || c.is_whitespace())
        {
            return bad(format!(
                "{c:?} is not allowed (no query, fragment, user, port or spaces)"
            ));
        }
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_end_matches('/');
        if let Err(why) = check_bucket(backend, bucket) {
            let what = if backend == "azure" {
                "container"
            } else {
                "bucket"
            };
            return bad(format!("{what} name {bucket:?}: {why}"));
        }
        if !prefix.is_empty()
            && let Err(StoreError::InvalidKey { reason, .. }) = validate_key(prefix)
        {
            return bad(format!(
                "prefix {prefix:?}: {reason}; the prefix is '/'-separated segments of \
                 [A-Za-z0-9._-]"
            ));
        }
        Ok(Self {
            backend,
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
        })
    }

    /// `"s3"`, `"gcs"` or `"azure"`: the `storage_backend` this path is for.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// The bucket (S3, GCS) or container (Azure).
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The prefix inside it, without leading or trailing `/`; may be empty.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The object that holds `key` (a valid key).
    fn object(&self, key: &str) -> Result<Path, StoreError> {
        let full = if self.prefix.is_empty() {
            key.to_owned()
        } else {
            format!("{}/{key}", self.prefix)
        };
        // Cannot fail for a valid key under a valid prefix; mapped anyway.
        Path::parse(&full).map_err(|_| StoreError::InvalidKey {
            key: key.chars().take(80).collect(),
            reason: "not a valid object path",
        })
    }

    /// The key an object holds, if it lies under the prefix and is a key.
    fn key_of<'a>(&self, object: &'a Path) -> Option<&'a str> {
        let path = object.as_ref();
        let key = if self.prefix.is_empty() {
            path
        } else {
            path.strip_prefix(self.prefix.as_str())?.strip_prefix('/')?
        };
        validate_key(key).is_ok().then_some(key)
    }
}

/// Object store naming rules, loosely: enough to catch a typo in the URL
/// before the first request, with the rule in the message.
fn check_bucket(backend: &str, name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("missing");
    }
    let (allowed, rule): (fn(u8) -> bool, &'static str) = match backend {
        "s3" => (
            |b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-'),
            "S3 bucket names are 3-63 characters of a-z, 0-9, '.' and '-', starting and ending \
             with a letter or digit",
        ),
        "gcs" => (
            |b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_'),
            "GCS bucket names are 3-63 characters of a-z, 0-9, '.', '_' and '-', starting and \
             ending with a letter or digit",
        ),
        _ => (
            |b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-',
            "Azure container names are 3-63 characters of a-z, 0-9 and single '-', starting \
             and ending with a letter or digit",
        ),
    };
    let bytes = name.as_bytes();
    let edges_ok = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !(3..=63).contains(&bytes.len())
        || !bytes.iter().all(|&b| allowed(b))
        || !edges_ok(bytes.first())
        || !edges_ok(bytes.last())
        || (backend == "azure" && name.contains("--"))
    {
        return Err(rule);
    }
    Ok(())
}

/// A [`Store`] on S3, GCS or Azure Blob Storage (`storage_backend: s3 | gcs
/// | azure`). Shared by every replica that points at the same location.
pub struct ObjectBackend {
    location: ObjectLocation,
    store: Arc<dyn ObjectStore>,
    timeout: Duration,
    clock: ClockSync,
}

impl fmt::Debug for ObjectBackend {
    // Not derived: the client's Debug would show its credential provider.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectBackend")
            .field("location", &self.location)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ObjectBackend {
    /// Budget for one store operation (all its requests and retries).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

    /// Opens the store that `storage_path` names, with credentials and
    /// endpoint from the environment:
    ///
    /// - `s3`: `AWS_ACCESS_KEY_ID` + `AWS_SECRET_ACCESS_KEY` (or the pod's
    ///   web identity / instance role), `AWS_REGION`, `AWS_ENDPOINT_URL`
    ///   for an S3-compatible service, `AWS_ALLOW_HTTP=true` for plain HTTP.
    /// - `gcs`: `GOOGLE_SERVICE_ACCOUNT` (a key file) or
    ///   `GOOGLE_SERVICE_ACCOUNT_KEY` (the JSON itself) or
    ///   `GOOGLE_APPLICATION_CREDENTIALS`, else the metadata server.
    /// - `azure`: `AZURE_STORAGE_ACCOUNT_NAME` with
    ///   `AZURE_STORAGE_ACCOUNT_KEY`, `AZURE_STORAGE_SAS_KEY`, a service
    ///   principal (`AZURE_STORAGE_CLIENT_ID`, `…_CLIENT_SECRET`,
    ///   `…_TENANT_ID`) or managed identity; `AZURE_STORAGE_ENDPOINT` for a
    ///   non-default endpoint; `AZURE_STORAGE_USE_EMULATOR=true` for Azurite.
    ///
    /// Builds the client only (no request is made); the bucket or container
    /// must already exist.
    pub fn open(storage_path: &str) -> Result<Self, StoreError> {
        Self::open_with_options(storage_path, std::iter::empty::<(&str, &str)>())
    }

    /// Like [`open`](Self::open), with `object_store` configuration keys
    /// (`aws_endpoint`, `azure_storage_account_key`, `google_service_account`,
    /// …, as their environment variables lowercased) applied over the
    /// environment. For embedding, and for tests that must not change the
    /// process environment.
    pub fn open_with_options<I, K, V>(storage_path: &str, options: I) -> Result<Self, StoreError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: Into<String>,
    {
        let location = ObjectLocation::parse(storage_path)?;
        let options: Vec<(String, String)> = options
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_ascii_lowercase(), v.into()))
            .collect();
        // Retries give up well inside the operation budget, so a dead
        // endpoint reports its own error rather than a bare timeout.
        let retry = RetryConfig {
            max_retries: 3,
            retry_timeout: Self::DEFAULT_TIMEOUT / 2,
            ..RetryConfig::default()
        };
        let store: Arc<dyn ObjectStore> = match location.backend {
            "s3" => Arc::new(build_s3(&location, &options, retry)?),
            "gcs" => Arc::new(build_gcs(&location, &options, retry)?),
            _ => Arc::new(build_azure(&location, &options, retry)?),
        };
        Ok(Self {
            location,
            store,
            timeout: Self::DEFAULT_TIMEOUT,
            clock: ClockSync::new(),
        })
    }

    /// Sets the budget for one operation; past it the operation fails with
    /// [`StoreError::Timeout`].
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Where the records live.
    pub fn location(&self) -> &ObjectLocation {
        &self.location
    }

    async fn timed<T>(
        &self,
        op: &'static str,
        work: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.timeout, work)
            .await
            .unwrap_or(Err(StoreError::Timeout {
                backend: self.location.backend,
                op,
                after: self.timeout,
            }))
    }

    fn backend_error(&self, e: object_store::Error) -> StoreError {
        if missing_bucket(&e) {
            let what = if self.location.backend == "azure" {
                "container"
            } else {
                "bucket"
            };
            return StoreError::Backend {
                backend: self.location.backend,
                message: format!(
                    "{what} {:?} does not exist: create it first (sbmesh never creates \
                     one); {e}",
                    self.location.bucket
                ),
            };
        }
        backend_error(self.location.backend, e)
    }

    /// Writes one record at `path` under `mode`; the caller decides which
    /// errors are a lost condition.
    async fn write(
        &self,
        path: &Path,
        value: &[u8],
        ttl: Option<Duration>,
        mode: PutMode,
    ) -> Result<Version, object_store::Error> {
        let expires_at = expiry_from(ttl);
        let payload = PutPayload::from(encode(value, expires_at));
        let r = self
            .store
            .put_opts(path, payload, PutOptions::from(mode))
            .await?;
        Ok(version_of(r.e_tag, r.version, expires_at))
    }

    /// The whole record at `key`, expired or not; `None` when absent.
    async fn read(&self, key: &str) -> Result<Option<(ObjectMeta, Header, Vec<u8>)>, StoreError> {
        let path = self.location.object(key)?;
        let got = match self.store.get_opts(&path, GetOptions::default()).await {
            Ok(got) => got,
            Err(e) if is_absent(&e) => return Ok(None),
            Err(e) => return Err(self.backend_error(e)),
        };
        // Bound the allocation before reading the body.
        if got.meta.size > (HEADER_LEN + super::MAX_VALUE_BYTES) as u64 {
            return Err(StoreError::Corrupt {
                key: key.to_owned(),
                message: format!("object is {} bytes, over the value limit", got.meta.size),
            });
        }
        let meta = got.meta.clone();
        let bytes = got.bytes().await.map_err(|e| self.backend_error(e))?;
        let header = decode_header(&bytes).map_err(|message| StoreError::Corrupt {
            key: key.to_owned(),
            message: message.to_owned(),
        })?;
        Ok(Some((meta, header, bytes[HEADER_LEN..].to_vec())))
    }

    /// Every record under `prefix` with its header (`None`: not a record
    /// of ours), expired ones included.
    async fn scan(
        &self,
        prefix: &str,
    ) -> Result<Vec<(String, ObjectMeta, Option<Header>)>, StoreError> {
        // object_store lists whole path segments: list the directory the
        // prefix ends in, then filter by the plain string prefix.
        let dir = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let root = match (self.location.prefix.is_empty(), dir.is_empty()) {
            (true, true) => None,
            (true, false) => Some(dir.to_owned()),
            (false, true) => Some(self.location.prefix.clone()),
            (false, false) => Some(format!("{}/{dir}", self.location.prefix)),
        };
        let root = root
            .map(|r| Path::parse(r).map_err(|e| self.backend_error(e.into())))
            .transpose()?;
        let mut listing = self.store.list(root.as_ref());
        let mut metas = Vec::new();
        // Polled by hand: the stream's trait methods are callable on the
        // trait object without pulling in a futures crate.
        while let Some(item) = std::future::poll_fn(|cx| listing.as_mut().poll_next(cx)).await {
            let meta = item.map_err(|e| self.backend_error(e))?;
            if let Some(key) = self.location.key_of(&meta.location)
                && key.starts_with(prefix)
            {
                metas.push((key.to_owned(), meta));
            }
        }

        let mut out = Vec::with_capacity(metas.len());
        let mut tasks = tokio::task::JoinSet::new();
        let mut pending = metas.into_iter();
        loop {
            while tasks.len() < LIST_CONCURRENCY {
                let Some((key, meta)) = pending.next() else {
                    break;
                };
                let store = Arc::clone(&self.store);
                tasks.spawn(async move { (key, read_header(&*store, meta).await) });
            }
            let Some(joined) = tasks.join_next().await else {
                break;
            };
            let (key, read) = joined.map_err(|e| StoreError::Backend {
                backend: self.location.backend,
                message: format!("header read task failed: {e}"),
            })?;
            match read {
                Ok(Some((meta, header))) => out.push((key, meta, header)),
                // Deleted since the listing.
                Ok(None) => {}
                Err(e) => return Err(self.backend_error(e)),
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }
}

fn build_s3(
    location: &ObjectLocation,
    options: &[(String, String)],
    retry: RetryConfig,
) -> Result<impl ObjectStore, StoreError> {
    let mut b = AmazonS3Builder::from_env();
    for (k, v) in options {
        let key = k
            .parse::<AmazonS3ConfigKey>()
            .map_err(|_| unknown_option("s3", k))?;
        b = b.with_config(key, v.as_str());
    }
    let get = |key: AmazonS3ConfigKey| b.get_config_value(&key).filter(|v| !v.is_empty());
    match (
        get(AmazonS3ConfigKey::AccessKeyId),
        get(AmazonS3ConfigKey::SecretAccessKey),
    ) {
        (Some(_), None) => {
            return Err(config(
                "s3",
                "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not: set both for static \
                 keys, or neither to use the pod's web identity or instance role",
            ));
        }
        (None, Some(_)) => {
            return Err(config(
                "s3",
                "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not: set both for static \
                 keys, or neither to use the pod's web identity or instance role",
            ));
        }
        _ => {}
    }
    let endpoint = get(AmazonS3ConfigKey::S3Endpoint)
        .map(|e| ("AWS_ENDPOINT_URL_S3", e))
        .or_else(|| get(AmazonS3ConfigKey::Endpoint).map(|e| ("AWS_ENDPOINT_URL", e)));
    if let Some((var, url)) = &endpoint {
        let allow_http = get(AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
            .is_some_and(|v| v.eq_ignore_ascii_case("true"));
        check_endpoint("s3", var, url, allow_http, "AWS_ALLOW_HTTP")?;
    }
    b.with_bucket_name(&location.bucket)
        .with_retry(retry)
        .build()
        .map_err(|e| {
            config(
                "s3",
                &format!(
                    "{e}; the client is configured from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, \
                     AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL and AWS_ALLOW_HTTP"
                ),
            )
        })
}

fn build_gcs(
    location: &ObjectLocation,
    options: &[(String, String)],
    retry: RetryConfig,
) -> Result<impl ObjectStore, StoreError> {
    let mut b = GoogleCloudStorageBuilder::from_env();
    for (k, v) in options {
        let key = k
            .parse::<GoogleConfigKey>()
            .map_err(|_| unknown_option("gcs", k))?;
        b = b.with_config(key, v.as_str());
    }
    let get = |key: GoogleConfigKey| b.get_config_value(&key).filter(|v| !v.is_empty());
    let account = get(GoogleConfigKey::ServiceAccount);
    let account_key = get(GoogleConfigKey::ServiceAccountKey);
    let adc = get(GoogleConfigKey::ApplicationCredentials);
    if account.is_some() && account_key.is_some() {
        return Err(config(
            "gcs",
            "both GOOGLE_SERVICE_ACCOUNT (a key file) and GOOGLE_SERVICE_ACCOUNT_KEY (the key \
             itself) are set: set one",
        ));
    }
    if let Some(url) = get(GoogleConfigKey::BaseUrl) {
        // object_store's GCS client allows plain HTTP by default.
        check_endpoint("gcs", "GOOGLE_BASE_URL", &url, true, "")?;
    }
    // Which setting the credentials came from, for the error message (the
    // key itself is a secret and is never printed).
    let source = match (&account, &account_key, &adc) {
        (Some(path), _, _) => format!("GOOGLE_SERVICE_ACCOUNT={path}"),
        (None, Some(_), _) => "GOOGLE_SERVICE_ACCOUNT_KEY".to_owned(),
        (None, None, Some(path)) => format!("GOOGLE_APPLICATION_CREDENTIALS={path}"),
        (None, None, None) => "application default credentials".to_owned(),
    };
    b.with_bucket_name(&location.bucket)
        .with_retry(retry)
        .build()
        .map_err(|e| {
            config(
                "gcs",
                &format!(
                    "credentials from {source}: {e}; the client is configured from \
                     GOOGLE_SERVICE_ACCOUNT, GOOGLE_SERVICE_ACCOUNT_KEY or \
                     GOOGLE_APPLICATION_CREDENTIALS, else the metadata server"
                ),
            )
        })
}

fn build_azure(
    location: &ObjectLocation,
    options: &[(String, String)],
    retry: RetryConfig,
) -> Result<impl ObjectStore, StoreError> {
    let mut b = MicrosoftAzureBuilder::from_env();
    for (k, v) in options {
        let key = k
            .parse::<AzureConfigKey>()
            .map_err(|_| unknown_option("azure", k))?;
        b = b.with_config(key, v.as_str());
    }
    let get = |key: AzureConfigKey| b.get_config_value(&key).filter(|v| !v.is_empty());
    let emulator = get(AzureConfigKey::UseEmulator).is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if !emulator && get(AzureConfigKey::AccountName).is_none() {
        return Err(config(
            "azure",
            "AZURE_STORAGE_ACCOUNT_NAME is not set (or set AZURE_STORAGE_USE_EMULATOR=true for \
             Azurite)",
        ));
    }
    if let Some(key) = get(AzureConfigKey::AccessKey) {
        use base64::Engine as _;
        if base64::engine::general_purpose::STANDARD
            .decode(key.trim())
            .is_err()
        {
            return Err(config(
                "azure",
                "AZURE_STORAGE_ACCOUNT_KEY is not valid base64 (copy the key as the portal \
                 shows it)",
            ));
        }
    }
    if let Some(url) = get(AzureConfigKey::Endpoint) {
        let allow_http = get(AzureConfigKey::Client(ClientConfigKey::AllowHttp))
            .is_some_and(|v| v.eq_ignore_ascii_case("true"));
        check_endpoint(
            "azure",
            "AZURE_STORAGE_ENDPOINT",
            &url,
            allow_http,
            "AZURE_ALLOW_HTTP",
        )?;
    }
    b.with_container_name(&location.bucket)
        .with_retry(retry)
        .build()
        .map_err(|e| {
            config(
                "azure",
                &format!(
                    "{e}; the client is configured from AZURE_STORAGE_ACCOUNT_NAME, \
                     AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_KEY, AZURE_STORAGE_CLIENT_ID, \
                     AZURE_STORAGE_CLIENT_SECRET, AZURE_STORAGE_TENANT_ID, AZURE_STORAGE_ENDPOINT \
                     and AZURE_STORAGE_USE_EMULATOR"
                ),
            )
        })
}

/// An endpoint override must be an http(s) URL, and plain HTTP only when
/// allowed explicitly (the client would refuse it at the first request).
fn check_endpoint(
    backend: &str,
    var: &str,
    url: &str,
    allow_http: bool,
    allow_var: &str,
) -> Result<(), StoreError> {
    let rest = if let Some(rest) = url.strip_prefix("https://") {
        rest
    } else if let Some(rest) = url.strip_prefix("http://") {
        if !allow_http {
            return Err(config(
                backend,
                &format!("{var} is {url:?}, plain HTTP: set {allow_var}=true to allow it"),
            ));
        }
        rest
    } else {
        return Err(config(
            backend,
            &format!("{var} is {url:?}: expected an http:// or https:// URL"),
        ));
    };
    if rest.is_empty() || rest.starts_with('/') {
        return Err(config(
            backend,
            &format!("{var} is {url:?}: the URL has no host"),
        ));
    }
    Ok(())
}

fn config(backend: &str, message: &str) -> StoreError {
    StoreError::Config(format!("{backend} storage: {message}"))
}

fn unknown_option(backend: &str, key: &str) -> StoreError {
    config(
        backend,
        &format!("unknown object_store option {key:?} for this backend"),
    )
}

fn backend_error(backend: &'static str, e: object_store::Error) -> StoreError {
    let hint = match (&e, backend) {
        (
            object_store::Error::Unauthenticated { .. }
            | object_store::Error::PermissionDenied { .. },
            "s3",
        ) => "; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the pod's role",
        (
            object_store::Error::Unauthenticated { .. }
            | object_store::Error::PermissionDenied { .. },
            "gcs",
        ) => "; check GOOGLE_SERVICE_ACCOUNT / GOOGLE_APPLICATION_CREDENTIALS",
        (
            object_store::Error::Unauthenticated { .. }
            | object_store::Error::PermissionDenied { .. },
            _,
        ) => "; check AZURE_STORAGE_ACCOUNT_NAME and its key, SAS or identity",
        _ => "",
    };
    StoreError::Backend {
        backend,
        message: format!("{e}{hint}"),
    }
}

/// Whether a conditional write failed on its condition (rather than on the
/// service): `Create` reports `AlreadyExists`; `Update` reports
/// `Precondition`, or `NotFound` when the object is gone (Azure; S3 and GCS
/// say `Precondition` for that too).
fn lost_condition(e: &object_store::Error) -> bool {
    matches!(
        e,
        object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }
    ) || is_absent(e)
}

/// The object is not there (but the bucket is).
fn is_absent(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::NotFound { .. }) && !missing_bucket(e)
}

/// A 404 about the bucket or container rather than the object: without
/// this, a misspelt bucket would read as an empty store. The services say
/// so in the error body, which `object_store` keeps in the message.
fn missing_bucket(e: &object_store::Error) -> bool {
    let message = e.to_string();
    message.contains("NoSuchBucket") || message.contains("ContainerNotFound")
}

/// A record's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    expires_at_unix_ms: Option<u64>,
}

impl Header {
    fn live(&self, now: u64) -> bool {
        self.expires_at_unix_ms.is_none_or(|at| at > now)
    }
}

fn encode(value: &[u8], expires_at_unix_ms: Option<u64>) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + value.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&expires_at_unix_ms.unwrap_or(0).to_be_bytes());
    out.extend_from_slice(&rand::random::<u64>().to_ne_bytes());
    out.extend_from_slice(value);
    out
}

fn decode_header(bytes: &[u8]) -> Result<Header, &'static str> {
    if bytes.len() < HEADER_LEN {
        return Err("shorter than the record header (not written by sbmesh?)");
    }
    if bytes[..4] != MAGIC {
        return Err("no sbmesh record header (not written by sbmesh?)");
    }
    let mut at = [0u8; 8];
    at.copy_from_slice(&bytes[4..12]);
    let at = u64::from_be_bytes(at);
    Ok(Header {
        expires_at_unix_ms: (at != 0).then_some(at),
    })
}

/// Reads just the header of a listed object, with the object's metadata as
/// that read saw it (a listing's ETag may be spelt differently than a
/// read's); `Ok(None)` when it is gone, a `None` header when it is not one
/// of our records.
async fn read_header(
    store: &dyn ObjectStore,
    meta: ObjectMeta,
) -> Result<Option<(ObjectMeta, Option<Header>)>, object_store::Error> {
    if meta.size < HEADER_LEN as u64 {
        return Ok(Some((meta, None)));
    }
    let options = GetOptions {
        range: Some(GetRange::Bounded(0..HEADER_LEN as u64)),
        ..GetOptions::default()
    };
    let got = match store.get_opts(&meta.location, options).await {
        Ok(got) => got,
        Err(e) if is_absent(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = got.meta.clone();
    let bytes = got.bytes().await?;
    Ok(Some((meta, decode_header(&bytes).ok())))
}

/// Whether two reads saw the same object (ETags compared without quotes).
fn same_etag(a: &ObjectMeta, b: &ObjectMeta) -> bool {
    let tag = |m: &ObjectMeta| m.e_tag.as_deref().map(|t| t.trim_matches('"').to_owned());
    tag(a).is_some() && tag(a) == tag(b)
}

/// The opaque version: the ETag, the object version (GCS generation, or an
/// S3/Azure version id where versioning is on) and the record's expiry.
fn version_of(e_tag: Option<String>, version: Option<String>, expires_at: Option<u64>) -> Version {
    Version(serde_json::to_string(&(e_tag, version, expires_at)).unwrap_or_default())
}

type VersionParts = (Option<String>, Option<String>, Option<u64>);

fn parse_version(v: &Version) -> Option<VersionParts> {
    serde_json::from_str(&v.0).ok()
}

#[async_trait]
impl Store for ObjectBackend {
    fn backend(&self) -> &'static str {
        self.location.backend
    }

    fn is_shared(&self) -> bool {
        true
    }

    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        validate_key(key)?;
        self.timed("get", async {
            let Some((meta, header, value)) = self.read(key).await? else {
                return Ok(None);
            };
            if !header.live(now_unix_ms()) {
                return Ok(None);
            }
            Ok(Some(Entry {
                value,
                version: version_of(meta.e_tag, meta.version, header.expires_at_unix_ms),
                expires_at_unix_ms: header.expires_at_unix_ms,
            }))
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
        let path = self.location.object(key)?;
        self.timed("put", async {
            self.write(&path, value, ttl, PutMode::Overwrite)
                .await
                .map_err(|e| self.backend_error(e))
        })
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
        let path = self.location.object(key)?;
        self.timed("put_if_absent", async {
            for _ in 0..CREATE_ATTEMPTS {
                match self.write(&path, value, ttl, PutMode::Create).await {
                    Ok(v) => return Ok(Some(v)),
                    Err(e) if lost_condition(&e) => {}
                    Err(e) => return Err(self.backend_error(e)),
                }
                // It exists: live means we lost; expired means replace it,
                // conditionally on the very record we judged expired.
                let Some((meta, header, _)) = self.read(key).await? else {
                    continue; // deleted meanwhile: create again
                };
                if header.live(now_unix_ms()) {
                    return Ok(None);
                }
                let expected = UpdateVersion {
                    e_tag: meta.e_tag,
                    version: meta.version,
                };
                match self
                    .write(&path, value, ttl, PutMode::Update(expected))
                    .await
                {
                    Ok(v) => return Ok(Some(v)),
                    // Replaced or deleted meanwhile: look again.
                    Err(e) if lost_condition(&e) => continue,
                    Err(e) => return Err(self.backend_error(e)),
                }
            }
            // The key changed under every attempt: others keep writing it.
            Ok(None)
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
        // Not a version this backend made, or one of an expired record (the
        // ETag pins the content, so its expiry is exact): a conflict.
        let Some((e_tag, version, expires_at)) = parse_version(expected) else {
            return Ok(None);
        };
        if e_tag.is_none() && version.is_none() {
            return Ok(None);
        }
        if expires_at.is_some_and(|at| at <= now_unix_ms()) {
            return Ok(None);
        }
        let path = self.location.object(key)?;
        self.timed("compare_and_swap", async {
            let mode = PutMode::Update(UpdateVersion { e_tag, version });
            match self.write(&path, value, ttl, mode).await {
                Ok(v) => Ok(Some(v)),
                Err(e) if lost_condition(&e) => Ok(None),
                Err(e) => Err(self.backend_error(e)),
            }
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        validate_key(key)?;
        self.timed("delete", async {
            let path = self.location.object(key)?;
            let live = match self.read(key).await {
                Ok(Some((_, header, _))) => header.live(now_unix_ms()),
                Ok(None) => return Ok(false),
                // A foreign or damaged object at this key: remove it all the same.
                Err(StoreError::Corrupt { .. }) => true,
                Err(e) => return Err(e),
            };
            match self.store.delete(&path).await {
                Ok(()) => Ok(live),
                Err(e) if is_absent(&e) => Ok(live),
                Err(e) => Err(self.backend_error(e)),
            }
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        validate_prefix(prefix)?;
        self.timed("list", async {
            let now = now_unix_ms();
            Ok(self
                .scan(prefix)
                .await?
                .into_iter()
                // A record we cannot read is listed: `get` reports it.
                .filter(|(_, _, header)| header.is_none_or(|h| h.live(now)))
                .map(|(key, _, _)| key)
                .collect())
        })
        .await
    }

    // `put_fenced` is the trait's default, `lock::put_fenced_by_claims`:
    // conditional writes here cover one object only (see the module docs).

    /// The service's clock: the `Last-Modified` it gives a probe object
    /// just written (whole seconds, so each reading bounds the offset to
    /// about a second, narrowed by later readings; see `super::clock`).
    async fn clock_offset_ms(&self) -> Result<i64, StoreError> {
        self.clock
            .offset(self.location.backend, || {
                self.timed("clock", async {
                    // `~` is outside the key alphabet: never a key, never listed.
                    let name = format!("~clock-{:016x}", rand::random::<u64>());
                    let path = if self.location.prefix.is_empty() {
                        Path::from(name)
                    } else {
                        Path::from(format!("{}/{name}", self.location.prefix))
                    };
                    self.store
                        .put(&path, PutPayload::from_static(b"clock probe"))
                        .await
                        .map_err(|e| self.backend_error(e))?;
                    let head = self.store.head(&path).await;
                    // Best effort: a leftover probe is a few bytes, never read.
                    let _ = self.store.delete(&path).await;
                    let meta = head.map_err(|e| self.backend_error(e))?;
                    Ok(Reading {
                        server_ms: u64::try_from(meta.last_modified.timestamp_millis())
                            .unwrap_or(0),
                        resolution_ms: 1_000,
                    })
                })
            })
            .await
    }

    async fn sweep_expired(&self) -> Result<usize, StoreError> {
        self.timed("sweep_expired", async {
            let now = now_unix_ms();
            let mut removed = 0;
            for (_, meta, header) in self.scan("").await? {
                if header.is_none_or(|h| h.live(now)) {
                    continue;
                }
                // Still the record we judged expired? (No conditional delete
                // in object_store: this narrows the race to one round trip.)
                match self.store.head(&meta.location).await {
                    Ok(now_meta) if same_etag(&now_meta, &meta) => {}
                    Ok(_) => continue,
                    Err(e) if is_absent(&e) => continue,
                    Err(e) => return Err(self.backend_error(e)),
                }
                match self.store.delete(&meta.location).await {
                    Ok(()) => removed += 1,
                    Err(e) if is_absent(&e) => {}
                    Err(e) => return Err(self.backend_error(e)),
                }
            }
            Ok(removed)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let rec = encode(b"hello", Some(1234));
        assert_eq!(rec.len(), HEADER_LEN + 5);
        assert_eq!(
            decode_header(&rec).unwrap(),
            Header {
                expires_at_unix_ms: Some(1234)
            }
        );
        assert_eq!(&rec[HEADER_LEN..], b"hello");
        let rec = encode(b"", None);
        assert_eq!(decode_header(&rec).unwrap().expires_at_unix_ms, None);
        // Same value, different content: the ETag changes on every write.
        assert_ne!(encode(b"x", None), encode(b"x", None));
        assert!(decode_header(b"sbm1").is_err());
        assert!(decode_header(&[0u8; 40]).is_err());
    }

    #[test]
    fn version_round_trip() {
        let v = version_of(Some("\"abc\"".into()), Some("17".into()), Some(5));
        assert_eq!(
            parse_version(&v),
            Some((Some("\"abc\"".into()), Some("17".into()), Some(5)))
        );
        assert_eq!(parse_version(&Version("3".into())), None);
    }

    #[test]
    fn locations() {
        let l = ObjectLocation::parse("s3://certs/sbmesh/prod/").unwrap();
        assert_eq!(
            (l.backend(), l.bucket(), l.prefix()),
            ("s3", "certs", "sbmesh/prod")
        );
        assert_eq!(l.object("acme/x").unwrap().as_ref(), "sbmesh/prod/acme/x");
        assert_eq!(l.key_of(&Path::from("sbmesh/prod/acme/x")), Some("acme/x"));
        assert_eq!(l.key_of(&Path::from("sbmesh/prodx/acme")), None);
        assert_eq!(l.key_of(&Path::from("other/acme")), None);
        let l = ObjectLocation::parse("az://my-container").unwrap();
        assert_eq!(
            (l.backend(), l.bucket(), l.prefix()),
            ("azure", "my-container", "")
        );
        assert_eq!(l.key_of(&Path::from("a/b")), Some("a/b"));
    }
}
