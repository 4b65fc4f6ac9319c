//! The test servers `scripts/test` starts, as the tests reach them: the
//! environment variables that name them ([`server_env`]), and S3 (moto) and
//! Azure Blob (Azurite) stores for tests: each call makes a
//! fresh bucket or container, so tests (and nextest's one process per test)
//! never see each other's records.
//!
//! `object_store` creates neither buckets nor containers, and production
//! expects them to exist; the tests create them here with one plain request
//! through `object_store`'s own HTTP client: moto takes an unsigned
//! `PUT /<bucket>`, Azurite needs `PUT /<account>/<container>?restype=container`
//! signed with its well-known development key (`AzureAuthorizer` signs it).

#![allow(dead_code)]

#[allow(clippy::duplicate_mod)]
#[path = "../required/mod.rs"]
mod required;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use object_store::azure::{AzureAccessKey, AzureAuthorizer, AzureCredential};
use object_store::client::{HttpConnector, HttpRequest, HttpRequestBody, ReqwestConnector};
use object_store::{ClientOptions, HeaderValue};
use sbmesh::{ObjectBackend, Store};

/// Azurite's account and key: public, documented, the same everywhere.
/// <https://learn.microsoft.com/azure/storage/common/storage-use-azurite#well-known-storage-account-and-key>
pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
pub const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// A bucket or container name no other test (or earlier run) uses.
pub fn unique_name(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "sbmesh-{tag}-{}-{}-{:08x}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        rand::random::<u32>()
    )
}

/// The `object_store` options for moto at `endpoint` (the same values
/// `scripts/test` exports as `AWS_*`; given explicitly so a test does not
/// depend on the process environment).
pub fn s3_options(endpoint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("aws_endpoint", endpoint.trim_end_matches('/').to_owned()),
        ("aws_allow_http", "true".to_owned()),
        ("aws_access_key_id", "testing".to_owned()),
        ("aws_secret_access_key", "testing".to_owned()),
        ("aws_region", "us-east-1".to_owned()),
    ]
}

/// The `object_store` options for Azurite at `endpoint`
/// (`http://127.0.0.1:P/devstoreaccount1`): the production code path with
/// an explicit endpoint, not `object_store`'s emulator shortcut.
pub fn azure_options(endpoint: &str) -> Vec<(&'static str, String)> {
    vec![
        ("azure_storage_account_name", AZURITE_ACCOUNT.to_owned()),
        ("azure_storage_account_key", AZURITE_KEY.to_owned()),
        (
            "azure_storage_endpoint",
            endpoint.trim_end_matches('/').to_owned(),
        ),
        ("azure_allow_http", "true".to_owned()),
    ]
}

/// A store in a new bucket on moto at `endpoint`, under prefix `sbmesh`.
pub async fn s3_store(endpoint: &str) -> Arc<dyn Store> {
    let bucket = unique_name("s3");
    create_s3_bucket(endpoint, &bucket).await;
    let store =
        ObjectBackend::open_with_options(&format!("s3://{bucket}/sbmesh"), s3_options(endpoint))
            .expect("open s3 store");
    Arc::new(store)
}

/// A store in a new container on Azurite at `endpoint`, under prefix
/// `sbmesh`.
pub async fn azure_store(endpoint: &str) -> Arc<dyn Store> {
    let container = unique_name("az");
    create_azure_container(endpoint, &container).await;
    let store = ObjectBackend::open_with_options(
        &format!("az://{container}/sbmesh"),
        azure_options(endpoint),
    )
    .expect("open azure store");
    Arc::new(store)
}

/// `PUT /<bucket>` on moto (it does not check signatures).
pub async fn create_s3_bucket(endpoint: &str, bucket: &str) {
    let url = format!("{}/{bucket}", endpoint.trim_end_matches('/'));
    send(put_request(&url), &url).await;
}

/// `PUT ?restype=container` on Azurite, signed with the development key.
pub async fn create_azure_container(endpoint: &str, container: &str) {
    let url = format!(
        "{}/{container}?restype=container",
        endpoint.trim_end_matches('/')
    );
    let mut request = put_request(&url);
    let credential = AzureCredential::AccessKey(AzureAccessKey::try_new(AZURITE_KEY).expect("key"));
    AzureAuthorizer::new(&credential, AZURITE_ACCOUNT)
        .try_authorize(&mut request)
        .expect("sign container request");
    send(request, &url).await;
}

/// An empty `PUT` (the `http` crate's builder is not reachable through
/// `object_store`, so the parts are set one by one).
fn put_request(url: &str) -> HttpRequest {
    let mut request = HttpRequest::new(HttpRequestBody::from(Vec::new()));
    *request.method_mut() = "PUT".parse().expect("method");
    *request.uri_mut() = url.parse().expect("url");
    request
        .headers_mut()
        .insert("content-length", HeaderValue::from_static("0"));
    request
}

async fn send(request: HttpRequest, url: &str) {
    let client = ReqwestConnector::default()
        .connect(&ClientOptions::new().with_allow_http(true))
        .expect("http client");
    let response = client
        .execute(request)
        .await
        .unwrap_or_else(|e| panic!("PUT {url}: {e}"));
    let status = response.status();
    assert!(status.is_success(), "PUT {url}: {status}");
}

/// Whether a missing server fails the run instead of skipping
/// (tests/required/mod.rs says when).
pub fn require_servers() -> bool {
    required::servers_required()
}

/// The value of a server's environment variable; `None` (and a SKIP line)
/// when unset, or a panic when servers are required.
pub fn server_env(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v),
        _ => required::missing(
            var,
            &format!("{var} is not set"),
            "run the suite through scripts/test, which starts the servers and sets it",
        ),
    }
}
