//! What the object store backend (`s3`, `azure`; `gcs` in `store_gcs.rs`)
//! must do beyond the conformance suite: what it leaves physically, what
//! it does with objects it did not write, how prefixes separate stores, and
//! how it fails (a missing bucket, a dead or silent endpoint, bad
//! credentials, configuration that names the wrong variable).
//!
//! Server checks run against moto (`SBMESH_TEST_S3_ENDPOINT`) and Azurite
//! (`SBMESH_TEST_AZURE_BLOB_ENDPOINT`) when `scripts/test` started them,
//! and print `SKIP` otherwise (fail, with `SBMESH_TEST_REQUIRE_SERVERS=1`).
//! The rest needs no server.

mod object_servers;

use object_servers::server_env;

use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use sbmesh::{ObjectBackend, Store, StoreError};

/// One object store server with a fresh bucket: our store on `prefix`, and
/// a raw `object_store` client on the same bucket to look underneath.
struct Bucket {
    url_scheme: &'static str,
    bucket: String,
    options: Vec<(&'static str, String)>,
    raw: Arc<dyn ObjectStore>,
}

impl Bucket {
    async fn s3() -> Option<Self> {
        let endpoint = server_env("SBMESH_TEST_S3_ENDPOINT")?;
        let bucket = object_servers::unique_name("s3");
        object_servers::create_s3_bucket(&endpoint, &bucket).await;
        let options = object_servers::s3_options(&endpoint);
        let mut raw = AmazonS3Builder::new().with_bucket_name(&bucket);
        for (k, v) in &options {
            raw = raw.with_config(k.parse().unwrap(), v);
        }
        Some(Self {
            url_scheme: "s3",
            bucket,
            options,
            raw: Arc::new(raw.build().unwrap()),
        })
    }

    async fn azure() -> Option<Self> {
        let endpoint = server_env("SBMESH_TEST_AZURE_BLOB_ENDPOINT")?;
        let bucket = object_servers::unique_name("az");
        object_servers::create_azure_container(&endpoint, &bucket).await;
        let options = object_servers::azure_options(&endpoint);
        let mut raw = MicrosoftAzureBuilder::new().with_container_name(&bucket);
        for (k, v) in &options {
            raw = raw.with_config(k.parse().unwrap(), v);
        }
        Some(Self {
            url_scheme: "az",
            bucket,
            options,
            raw: Arc::new(raw.build().unwrap()),
        })
    }

    fn store(&self, prefix: &str) -> ObjectBackend {
        ObjectBackend::open_with_options(
            &format!("{}://{}/{prefix}", self.url_scheme, self.bucket),
            self.options.clone(),
        )
        .unwrap()
    }

    /// Every object name in the bucket, sorted.
    async fn objects(&self) -> Vec<String> {
        let mut names = Vec::new();
        let mut listing = self.raw.list(None);
        while let Some(meta) = std::future::poll_fn(|cx| listing.as_mut().poll_next(cx)).await {
            names.push(meta.unwrap().location.to_string());
        }
        names.sort();
        names
    }

    async fn put_raw(&self, name: &str, bytes: &[u8]) {
        self.raw
            .put(
                &Path::parse(name).unwrap(),
                PutPayload::from(bytes.to_vec()),
            )
            .await
            .unwrap();
    }
}

/// Runs one check against moto and Azurite.
macro_rules! on_servers {
    ($($check:ident),* $(,)?) => {
        mod s3 {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    if let Some(b) = super::Bucket::s3().await {
                        super::checks::$check(b).await;
                    }
                }
            )*
        }
        mod azure {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    if let Some(b) = super::Bucket::azure().await {
                        super::checks::$check(b).await;
                    }
                }
            )*
        }
    };
}

on_servers!(
    records_are_one_object_each_under_the_prefix,
    sweep_removes_expired_objects_only,
    prefixes_separate_stores,
    foreign_objects_are_reported_not_misread,
    missing_bucket_is_an_error_not_an_empty_store,
    wrong_credentials_are_a_backend_error,
);

mod checks {
    use super::*;

    const SHORT_TTL: Duration = Duration::from_millis(300);

    async fn wait_absent(store: &dyn Store, key: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while store.get(key).await.unwrap().is_some() {
            assert!(Instant::now() < deadline, "{key} outlived its TTL");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn records_are_one_object_each_under_the_prefix(b: Bucket) {
        let store = b.store("sbmesh/prod");
        store
            .put("certs/a.example/chain", b"pem", None)
            .await
            .unwrap();
        store
            .put_if_absent("acme/lock", b"me", Some(Duration::from_secs(60)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            b.objects().await,
            ["sbmesh/prod/acme/lock", "sbmesh/prod/certs/a.example/chain"]
        );
        // The record: 20-byte header (magic, expiry, nonce), then the value.
        let raw = b
            .raw
            .get(&Path::parse("sbmesh/prod/certs/a.example/chain").unwrap())
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(&raw[..4], b"sbm1");
        assert_eq!(&raw[4..12], &[0u8; 8], "no expiry is stored as 0");
        assert_eq!(&raw[20..], b"pem");
    }

    pub async fn sweep_removes_expired_objects_only(b: Bucket) {
        let store = b.store("s");
        store.put("gone/1", b"x", Some(SHORT_TTL)).await.unwrap();
        store.put("gone/2", b"x", Some(SHORT_TTL)).await.unwrap();
        store
            .put("later", b"x", Some(Duration::from_secs(600)))
            .await
            .unwrap();
        store.put("kept", b"x", None).await.unwrap();
        wait_absent(&store, "gone/1").await;
        wait_absent(&store, "gone/2").await;
        // Expired but not yet swept: still there underneath, absent above.
        assert_eq!(b.objects().await.len(), 4);
        assert_eq!(store.list("").await.unwrap(), ["kept", "later"]);

        assert_eq!(store.sweep_expired().await.unwrap(), 2);
        assert_eq!(b.objects().await, ["s/kept", "s/later"]);
        assert_eq!(store.sweep_expired().await.unwrap(), 0);
    }

    pub async fn prefixes_separate_stores(b: Bucket) {
        // "p" must not see "pq" (a string prefix of its name) nor the
        // bucket root; the root store sees everything as keys.
        let p = b.store("p");
        let pq = b.store("pq");
        let nested = b.store("p/inner");
        p.put("k", b"p", None).await.unwrap();
        pq.put("k", b"pq", None).await.unwrap();
        nested.put("k", b"nested", None).await.unwrap();
        assert_eq!(p.get("k").await.unwrap().unwrap().value, b"p");
        assert_eq!(pq.get("k").await.unwrap().unwrap().value, b"pq");
        assert_eq!(pq.list("").await.unwrap(), ["k"]);
        // A store whose prefix lies inside another's sees it as keys: the
        // operator chooses disjoint prefixes.
        assert_eq!(p.list("").await.unwrap(), ["inner/k", "k"]);
        assert_eq!(nested.list("").await.unwrap(), ["k"]);
        let root = ObjectBackend::open_with_options(
            &format!("{}://{}", b.url_scheme, b.bucket),
            b.options.clone(),
        )
        .unwrap();
        assert_eq!(root.list("").await.unwrap(), ["p/inner/k", "p/k", "pq/k"]);
        assert_eq!(root.list("p/").await.unwrap(), ["p/inner/k", "p/k"]);
    }

    pub async fn foreign_objects_are_reported_not_misread(b: Bucket) {
        let store = b.store("s");
        // Not our format, at a valid key; one too short for a header; and
        // names that are not keys at all.
        b.put_raw("s/foreign", b"-----BEGIN CERTIFICATE----- not ours")
            .await;
        b.put_raw("s/short", b"sbm").await;
        b.put_raw("s/has space", b"x").await;
        b.put_raw("s/a:b", b"x").await;
        store.put("ours", b"v", None).await.unwrap();

        for key in ["foreign", "short"] {
            match store.get(key).await {
                Err(StoreError::Corrupt { key: k, message }) => {
                    assert_eq!(k, key);
                    assert!(message.contains("not written by sbmesh"), "{message}");
                }
                other => panic!("get({key}) = {other:?}"),
            }
            // Conditional writes never treat it as absent.
            assert!(store.put_if_absent(key, b"x", None).await.is_err());
        }
        // Listed (get reports the problem), non-keys left out, and the
        // sweeper leaves all of them alone.
        assert_eq!(store.list("").await.unwrap(), ["foreign", "ours", "short"]);
        assert_eq!(store.sweep_expired().await.unwrap(), 0);
        assert_eq!(b.objects().await.len(), 5);
        // An operator can still remove it through the store.
        assert!(store.delete("foreign").await.unwrap());
        assert_eq!(b.objects().await.len(), 4);
    }

    pub async fn missing_bucket_is_an_error_not_an_empty_store(b: Bucket) {
        let missing = ObjectBackend::open_with_options(
            &format!("{}://{}-missing/p", b.url_scheme, b.bucket),
            b.options.clone(),
        )
        .unwrap();
        let e = missing.get("k").await.unwrap_err();
        assert!(matches!(e, StoreError::Backend { .. }), "{e:?}");
        assert!(e.to_string().contains("does not exist"), "{e}");
        for r in [
            missing.put("k", b"v", None).await.map(drop),
            missing.put_if_absent("k", b"v", None).await.map(drop),
            missing.list("").await.map(drop),
            missing.delete("k").await.map(drop),
        ] {
            assert!(matches!(r, Err(StoreError::Backend { .. })), "{r:?}");
        }
    }

    pub async fn wrong_credentials_are_a_backend_error(b: Bucket) {
        // moto accepts any signature; Azurite checks the shared key.
        if b.url_scheme != "az" {
            return;
        }
        let mut options = b.options.clone();
        for (k, v) in &mut options {
            if *k == "azure_storage_account_key" {
                *v = "d3JvbmcgYnV0IHZhbGlkIGJhc2U2NA==".to_owned();
            }
        }
        let store =
            ObjectBackend::open_with_options(&format!("az://{}/p", b.bucket), options).unwrap();
        let e = store.put("k", b"v", None).await.unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                StoreError::Backend {
                    backend: "azure",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(msg.contains("AZURE_STORAGE_ACCOUNT_NAME"), "no hint: {msg}");
    }
}

// ---------------------------------------------------------------------------
// Without a server.
// ---------------------------------------------------------------------------

/// The error of opening `path` with `options`, over a blank slate: the
/// settings `scripts/test` exports (`AWS_*`) are cleared first, so the
/// check does not depend on the environment it runs in.
fn config_error(path: &str, options: &[(&str, &str)]) -> String {
    let blank: &[(&str, &str)] = if path.starts_with("s3://") {
        &[
            ("aws_access_key_id", ""),
            ("aws_secret_access_key", ""),
            ("aws_endpoint", ""),
            ("aws_endpoint_url_s3", ""),
            ("aws_allow_http", "false"),
        ]
    } else {
        &[
            ("azure_storage_account_name", ""),
            ("azure_storage_account_key", ""),
            ("azure_storage_endpoint", ""),
            ("azure_allow_http", "false"),
            ("azure_storage_use_emulator", "false"),
        ]
    };
    let all = blank.iter().chain(options).copied();
    match ObjectBackend::open_with_options(path, all) {
        Err(StoreError::Config(m)) => m,
        Err(other) => panic!("{path} {options:?}: not a configuration error: {other:?}"),
        Ok(store) => panic!("{path} {options:?}: opened {store:?}"),
    }
}

#[test]
fn configuration_errors_name_the_variable() {
    let m = config_error("s3://b-1/p", &[("aws_access_key_id", "AKIA")]);
    assert!(m.contains("AWS_SECRET_ACCESS_KEY"), "{m}");
    let m = config_error("s3://b-1/p", &[("aws_secret_access_key", "s")]);
    assert!(m.contains("AWS_ACCESS_KEY_ID"), "{m}");
    let m = config_error(
        "s3://b-1/p",
        &[
            ("aws_endpoint", "http://127.0.0.1:9"),
            ("aws_allow_http", "false"),
        ],
    );
    assert!(
        m.contains("AWS_ENDPOINT_URL") && m.contains("AWS_ALLOW_HTTP=true"),
        "{m}"
    );
    let m = config_error("s3://b-1/p", &[("aws_endpoint", "127.0.0.1:9000")]);
    assert!(
        m.contains("AWS_ENDPOINT_URL") && m.contains("http://"),
        "{m}"
    );
    let m = config_error("s3://b-1/p", &[("aws_no_such_option", "1")]);
    assert!(m.contains("aws_no_such_option"), "{m}");

    let m = config_error(
        "az://c-1/p",
        &[
            ("azure_storage_account_name", ""),
            ("azure_storage_use_emulator", "false"),
        ],
    );
    assert!(m.contains("AZURE_STORAGE_ACCOUNT_NAME"), "{m}");
    let m = config_error(
        "az://c-1/p",
        &[
            ("azure_storage_account_name", "acct"),
            ("azure_storage_account_key", "not base64!"),
        ],
    );
    assert!(
        m.contains("AZURE_STORAGE_ACCOUNT_KEY") && !m.contains("not base64!"),
        "{m}"
    );
    let m = config_error(
        "az://c-1/p",
        &[
            ("azure_storage_account_name", "acct"),
            ("azure_storage_endpoint", "http://127.0.0.1:10000/acct"),
        ],
    );
    assert!(
        m.contains("AZURE_STORAGE_ENDPOINT") && m.contains("AZURE_ALLOW_HTTP"),
        "{m}"
    );
}

#[test]
fn urls_name_the_wrong_part() {
    for (path, part) in [
        ("bucket/prefix", "no scheme"),
        ("sqlite://b/p", "unknown scheme \"sqlite\""),
        ("s3a://b/p", "unknown scheme \"s3a\""),
        ("s3://", "bucket name \"\""),
        ("s3:///p", "bucket name \"\""),
        ("s3://My_Bucket/p", "bucket name \"My_Bucket\""),
        ("s3://ab/p", "bucket name \"ab\""),
        ("az://my--container/p", "container name \"my--container\""),
        ("az://my.container/p", "container name \"my.container\""),
        ("s3://bucket/../etc", "prefix \"../etc\""),
        ("s3://bucket/a//b", "prefix \"a//b\""),
        ("s3://bucket/p?versionId=1", "'?'"),
        ("s3://user@bucket/p", "'@'"),
        ("s3://bucket:9000/p", "':'"),
    ] {
        let m = config_error(path, &[]);
        assert!(m.contains(part), "{path}: {m}");
        assert!(
            m.contains("s3://bucket/prefix"),
            "{path}: no accepted form in {m}"
        );
    }
}

/// Keys are checked before any request: nothing reaches the network.
#[tokio::test]
async fn invalid_keys_fail_before_any_request() {
    let store = ObjectBackend::open_with_options("s3://bucket/p", silent_s3(dead_port()))
        .unwrap()
        .with_timeout(Duration::from_secs(30));
    let started = Instant::now();
    for key in ["../x", "a//b", "a b", ""] {
        assert!(matches!(
            store.get(key).await,
            Err(StoreError::InvalidKey { .. })
        ));
    }
    assert!(started.elapsed() < Duration::from_secs(1));
}

fn dead_port() -> u16 {
    // Bound then dropped: nothing listens there (good enough for a test).
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn silent_s3(port: u16) -> Vec<(&'static str, String)> {
    object_servers::s3_options(&format!("http://127.0.0.1:{port}"))
}

/// A server that accepts connections and never answers: every operation
/// ends in `Timeout` within its budget, naming the operation.
#[tokio::test]
async fn a_silent_endpoint_times_out() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        loop {
            if let Ok((c, _)) = listener.accept().await {
                conns.push(c);
            }
        }
    });
    let budget = Duration::from_millis(700);
    let store = ObjectBackend::open_with_options("s3://bucket/p", silent_s3(port))
        .unwrap()
        .with_timeout(budget);
    let started = Instant::now();
    let results = [
        ("get", store.get("k").await.map(drop)),
        ("put", store.put("k", b"v", None).await.map(drop)),
        (
            "put_if_absent",
            store.put_if_absent("k", b"v", None).await.map(drop),
        ),
        ("list", store.list("").await.map(drop)),
        ("sweep_expired", store.sweep_expired().await.map(drop)),
    ];
    for (op, r) in results {
        match r {
            Err(StoreError::Timeout {
                backend: "s3",
                op: o,
                after,
            }) => {
                assert_eq!((o, after), (op, budget));
            }
            other => panic!("{op}: {other:?}"),
        }
    }
    assert!(started.elapsed() < budget * 5 + Duration::from_secs(2));
    held.abort();
}

/// Nothing listens: the error says so (the retries give up inside the
/// operation budget, so it is the cause, not a bare timeout).
#[tokio::test]
async fn a_dead_endpoint_is_a_backend_error() {
    let store = ObjectBackend::open_with_options("s3://bucket/p", silent_s3(dead_port())).unwrap();
    let started = Instant::now();
    let e = store.get("k").await.unwrap_err();
    assert!(
        matches!(e, StoreError::Backend { backend: "s3", .. }),
        "{e:?}"
    );
    assert!(started.elapsed() < ObjectBackend::DEFAULT_TIMEOUT, "{e}");
}

/// The production path end to end: `open` with nothing but the standard
/// environment variables reaches moto and Azurite (Azurite through
/// `AZURE_STORAGE_USE_EMULATOR`, as a developer would run it). In a child
/// process, so this process's environment stays untouched.
#[tokio::test]
async fn open_from_the_environment_reaches_the_servers() {
    if std::env::var_os("SBMESH_OBJECT_ENV_CHILD").is_some() {
        return;
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    child
        .args([
            "env_servers_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SBMESH_OBJECT_ENV_CHILD", "1");
    for var in [
        "AWS_ENDPOINT_URL",
        "AWS_ALLOW_HTTP",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_REGION",
    ] {
        child.env_remove(var);
    }
    let mut checked = Vec::new();
    if let Some(endpoint) = server_env("SBMESH_TEST_S3_ENDPOINT") {
        let bucket = object_servers::unique_name("s3");
        object_servers::create_s3_bucket(&endpoint, &bucket).await;
        child
            .env("SBMESH_CHILD_S3_PATH", format!("s3://{bucket}/env"))
            .env("AWS_ENDPOINT_URL", &endpoint)
            .env("AWS_ALLOW_HTTP", "true")
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "testing")
            .env("AWS_REGION", "us-east-1");
        checked.push("s3");
    }
    if let Some(endpoint) = server_env("SBMESH_TEST_AZURE_BLOB_ENDPOINT") {
        let container = object_servers::unique_name("az");
        object_servers::create_azure_container(&endpoint, &container).await;
        // The emulator mode wants the server root, without the account.
        let root = endpoint
            .trim_end_matches('/')
            .trim_end_matches(object_servers::AZURITE_ACCOUNT)
            .trim_end_matches('/');
        child
            .env("SBMESH_CHILD_AZ_PATH", format!("az://{container}/env"))
            .env("AZURE_STORAGE_USE_EMULATOR", "true")
            .env("AZURITE_BLOB_STORAGE_URL", root);
        checked.push("azure");
    }
    if checked.is_empty() {
        return;
    }
    let out = child.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for backend in checked {
        assert!(
            stdout.contains(&format!("env_servers_child: {backend} ok")),
            "{backend} not checked: {stdout}"
        );
    }
}

#[tokio::test]
async fn env_servers_child() {
    if std::env::var_os("SBMESH_OBJECT_ENV_CHILD").is_none() {
        return;
    }
    for (var, backend) in [
        ("SBMESH_CHILD_S3_PATH", "s3"),
        ("SBMESH_CHILD_AZ_PATH", "azure"),
    ] {
        let Ok(path) = std::env::var(var) else {
            continue;
        };
        let store = ObjectBackend::open(&path).unwrap();
        assert_eq!(store.backend(), backend);
        let v = store.put_if_absent("k", b"from env", None).await.unwrap();
        assert!(v.is_some());
        assert_eq!(store.get("k").await.unwrap().unwrap().value, b"from env");
        println!("env_servers_child: {backend} ok");
    }
}

/// `open` (without options) reads the process environment: checked in a
/// child process, so this process's environment stays untouched.
#[test]
fn open_reads_the_environment() {
    if std::env::var_os("SBMESH_OBJECT_ENV_CHILD").is_some() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["env_child", "--exact", "--nocapture", "--test-threads=1"])
        .env("SBMESH_OBJECT_ENV_CHILD", "1")
        .env("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env("AZURE_STORAGE_ACCOUNT_NAME", "acct")
        .env("AZURE_STORAGE_ACCOUNT_KEY", "%%%")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("env_child: checked"),
        "child ran nothing: {stdout}"
    );
}

#[test]
fn env_child() {
    if std::env::var_os("SBMESH_OBJECT_ENV_CHILD").is_none() {
        return;
    }
    let m = match ObjectBackend::open("s3://bucket-1/p") {
        Err(StoreError::Config(m)) => m,
        other => panic!("{other:?}"),
    };
    assert!(m.contains("AWS_SECRET_ACCESS_KEY"), "{m}");
    let m = match ObjectBackend::open("az://container-1/p") {
        Err(StoreError::Config(m)) => m,
        other => panic!("{other:?}"),
    };
    assert!(m.contains("AZURE_STORAGE_ACCOUNT_KEY"), "{m}");
    println!("env_child: checked");
}
