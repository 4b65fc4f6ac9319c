//! The `gcs` backend without a GCS server.
//!
//! No emulator available here accepts `object_store`'s GCS writes
//! (fake-gcs-server's XML API refuses them), so GCS is covered this way:
//!
//! - `gs://` URLs and the `GOOGLE_*` credential settings: parsed, and
//!   refused with the part or variable named (below, no network);
//! - the wire protocol: one scripted exchange with an HTTP responder that
//!   answers as the GCS XML API documents, checking what the backend sends
//!   (object path, record bytes, `x-goog-if-generation-match` for create and
//!   for compare-and-swap) and how it reads the answers (412 = lost, the
//!   generation as the version). The responder is a script, not a GCS
//!   implementation: it proves the requests, not GCS's atomicity;
//! - everything else is the code S3 and Azure run against moto and Azurite
//!   (`store_conformance.rs`, `store_object.rs`, `store_lock.rs`): one
//!   `ObjectBackend`, the same record format and the same conditional-write
//!   logic; only `object_store`'s client differs.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sbmesh::{ObjectBackend, ObjectLocation, Store, StoreError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config_error(path: &str, options: &[(&str, &str)]) -> String {
    match ObjectBackend::open_with_options(path, options.iter().copied()) {
        Err(StoreError::Config(m)) => m,
        Err(other) => panic!("{path}: not a configuration error: {other:?}"),
        Ok(store) => panic!("{path} {options:?}: opened {store:?}"),
    }
}

#[test]
fn gs_urls_parse() {
    let l = ObjectLocation::parse("gs://certs-bucket/sbmesh/prod/").unwrap();
    assert_eq!(
        (l.backend(), l.bucket(), l.prefix()),
        ("gcs", "certs-bucket", "sbmesh/prod")
    );
    let l = ObjectLocation::parse("gs://my_bucket.example.com").unwrap();
    assert_eq!((l.bucket(), l.prefix()), ("my_bucket.example.com", ""));

    for (path, part) in [
        ("gs://", "bucket name \"\""),
        ("gs://Certs/p", "GCS bucket names"),
        ("gs://_certs/p", "GCS bucket names"),
        ("gs://ce/p", "GCS bucket names"),
        ("gs://certs/p/../q", "prefix \"p/../q\""),
        ("gs://certs/p?generation=1", "'?'"),
        ("gcs://certs/p", "unknown scheme \"gcs\""),
    ] {
        let m = config_error(path, &[]);
        assert!(m.contains(part), "{path}: {m}");
        assert!(m.contains("gs://bucket/prefix"), "{path}: {m}");
    }
}

#[test]
fn credential_settings_are_named_in_errors() {
    let m = config_error(
        "gs://certs/p",
        &[("google_service_account", "/nonexistent/sbmesh-sa.json")],
    );
    assert!(
        m.contains("GOOGLE_SERVICE_ACCOUNT=/nonexistent/sbmesh-sa.json"),
        "{m}"
    );

    // The key itself is a secret: named, never printed.
    let secret = r#"{"private_key": "SECRET-MATERIAL", "client_email": "x"}"#;
    let m = config_error("gs://certs/p", &[("google_service_account_key", secret)]);
    assert!(m.contains("GOOGLE_SERVICE_ACCOUNT_KEY"), "{m}");
    assert!(!m.contains("SECRET-MATERIAL"), "secret printed: {m}");

    let bad_pem = r#"{"private_key": "SECRET-MATERIAL", "private_key_id": "k",
                      "client_email": "sa@p.iam.gserviceaccount.com"}"#;
    let m = config_error("gs://certs/p", &[("google_service_account_key", bad_pem)]);
    assert!(m.contains("GOOGLE_SERVICE_ACCOUNT_KEY"), "{m}");
    assert!(!m.contains("SECRET-MATERIAL"), "secret printed: {m}");

    let m = config_error(
        "gs://certs/p",
        &[
            ("google_service_account", "/x.json"),
            ("google_service_account_key", "{}"),
        ],
    );
    assert!(
        m.contains("GOOGLE_SERVICE_ACCOUNT") && m.contains("GOOGLE_SERVICE_ACCOUNT_KEY"),
        "{m}"
    );

    let m = config_error(
        "gs://certs/p",
        &[("google_application_credentials", "/nonexistent/adc.json")],
    );
    assert!(
        m.contains("GOOGLE_APPLICATION_CREDENTIALS=/nonexistent/adc.json"),
        "{m}"
    );

    let m = config_error("gs://certs/p", &[("google_base_url", "127.0.0.1:9")]);
    assert!(
        m.contains("GOOGLE_BASE_URL") && m.contains("http://"),
        "{m}"
    );
}

/// `open` reads `GOOGLE_*` from the process environment: checked in a
/// child process, so this one's environment stays untouched.
#[test]
fn open_reads_google_variables() {
    if std::env::var_os("SBMESH_GCS_ENV_CHILD").is_some() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "gcs_env_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SBMESH_GCS_ENV_CHILD", "1")
        .env("GOOGLE_SERVICE_ACCOUNT", "/nonexistent/from-env.json")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("gcs_env_child: checked"),
        "child ran nothing: {stdout}"
    );
}

#[test]
fn gcs_env_child() {
    if std::env::var_os("SBMESH_GCS_ENV_CHILD").is_none() {
        return;
    }
    match ObjectBackend::open("gs://certs/p") {
        Err(StoreError::Config(m)) => {
            assert!(
                m.contains("GOOGLE_SERVICE_ACCOUNT=/nonexistent/from-env.json"),
                "{m}"
            )
        }
        other => panic!("{other:?}"),
    }
    println!("gcs_env_child: checked");
}

// ---------------------------------------------------------------------------
// The wire protocol, against a scripted responder.
// ---------------------------------------------------------------------------

/// One request as the responder received it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// An answer: status and extra headers and body.
type Answer = (u16, Vec<(&'static str, String)>, Vec<u8>);

/// Serves `answers` in order, one per request, recording the requests.
async fn responder(answers: Vec<Answer>) -> (u16, Arc<Mutex<Vec<Seen>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let script = Arc::new(Mutex::new(answers.into_iter()));
    let log = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let (log, script) = (Arc::clone(&log), Arc::clone(&script));
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    // Head, then the body by Content-Length.
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
                    let mut lines = head.split("\r\n");
                    let mut first = lines.next().unwrap_or("").split(' ');
                    let method = first.next().unwrap_or("").to_owned();
                    let path = first.next().unwrap_or("").to_owned();
                    let headers: Vec<(String, String)> = lines
                        .filter_map(|l| l.split_once(':'))
                        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
                        .collect();
                    let len: usize = headers
                        .iter()
                        .find(|(k, _)| k == "content-length")
                        .and_then(|(_, v)| v.parse().ok())
                        .unwrap_or(0);
                    while buf.len() < head_end + len {
                        let mut chunk = [0u8; 4096];
                        match conn.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let body = buf[head_end..head_end + len].to_vec();
                    buf.drain(..head_end + len);
                    log.lock().unwrap().push(Seen {
                        method,
                        path,
                        headers,
                        body,
                    });
                    let (status, extra, body) = script.lock().unwrap().next().unwrap_or((
                        500,
                        vec![],
                        b"script exhausted".to_vec(),
                    ));
                    let mut out =
                        format!("HTTP/1.1 {status} X\r\ncontent-length: {}\r\n", body.len());
                    for (k, v) in extra {
                        out.push_str(&format!("{k}: {v}\r\n"));
                    }
                    out.push_str("\r\n");
                    let mut bytes = out.into_bytes();
                    bytes.extend_from_slice(&body);
                    if conn.write_all(&bytes).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, seen)
}

/// A GCS client on the responder: a service account with OAuth disabled
/// (as for an emulator), so no token exchange happens.
fn gcs_store(port: u16) -> ObjectBackend {
    let account = format!(
        r#"{{"private_key": "unused", "private_key_id": "unused",
             "client_email": "test@example.iam.gserviceaccount.com",
             "gcs_base_url": "http://127.0.0.1:{port}", "disable_oauth": true}}"#
    );
    ObjectBackend::open_with_options(
        "gs://certs/sb/prod",
        [
            ("google_service_account_key", account),
            ("google_allow_http", "true".to_owned()),
        ],
    )
    .unwrap()
    .with_timeout(Duration::from_secs(20))
}

fn record(expires_at_unix_ms: u64, value: &[u8]) -> Vec<u8> {
    let mut r = b"sbm1".to_vec();
    r.extend_from_slice(&expires_at_unix_ms.to_be_bytes());
    r.extend_from_slice(&[9u8; 8]);
    r.extend_from_slice(value);
    r
}

fn object_headers(etag: &str, generation: u64) -> Vec<(&'static str, String)> {
    vec![
        ("etag", format!("\"{etag}\"")),
        ("x-goog-generation", generation.to_string()),
        ("last-modified", "Sun, 29 Nov 2026 12:00:00 GMT".to_owned()),
    ]
}

/// `put_if_absent` over an expired record, then a stale compare-and-swap,
/// then a read of a missing key: what goes over the wire and how the
/// answers are read.
#[tokio::test]
async fn gcs_conditional_writes_on_the_wire() {
    let expired = record(1, b"old");
    let (port, seen) = responder(vec![
        // Create (generation 0): the object exists.
        (
            412,
            vec![],
            b"<Error><Code>PreconditionFailed</Code></Error>".to_vec(),
        ),
        // Read it: an expired record, generation 7.
        (200, object_headers("e7", 7), expired),
        // Replace it, conditional on generation 7: accepted as generation 8.
        (200, object_headers("e8", 8), vec![]),
        // Compare-and-swap on generation 8: someone got there first.
        (
            412,
            vec![],
            b"<Error><Code>PreconditionFailed</Code></Error>".to_vec(),
        ),
        // A read of a missing key.
        (
            404,
            vec![],
            b"<Error><Code>NoSuchKey</Code></Error>".to_vec(),
        ),
    ])
    .await;
    let store = gcs_store(port);
    assert_eq!(store.backend(), "gcs");
    assert!(store.is_shared());

    let v = store
        .put_if_absent("acme/lock", b"mine", Some(Duration::from_secs(60)))
        .await
        .unwrap()
        .expect("took over the expired record");
    assert!(
        v.0.contains("\"8\""),
        "the version carries the generation: {v}"
    );
    assert_eq!(
        store
            .compare_and_swap("acme/lock", &v, b"again", None)
            .await
            .unwrap(),
        None,
        "412 on a compare-and-swap is a lost race"
    );
    assert_eq!(store.get("other").await.unwrap(), None);

    let seen = seen.lock().unwrap().clone();
    let calls: Vec<(&str, &str, Option<&str>)> = seen
        .iter()
        .map(|s| {
            (
                s.method.as_str(),
                s.path.as_str(),
                s.header("x-goog-if-generation-match"),
            )
        })
        .collect();
    assert_eq!(
        calls,
        [
            // `object_store` sends the object name as one escaped segment.
            ("PUT", "/certs/sb%2Fprod%2Facme%2Flock", Some("0")),
            ("GET", "/certs/sb%2Fprod%2Facme%2Flock", None),
            ("PUT", "/certs/sb%2Fprod%2Facme%2Flock", Some("7")),
            ("PUT", "/certs/sb%2Fprod%2Facme%2Flock", Some("8")),
            ("GET", "/certs/sb%2Fprod%2Fother", None),
        ]
    );
    // The same record format as on S3 and Azure: header, then the value.
    for (i, value) in [(0, &b"mine"[..]), (2, b"mine"), (3, b"again")] {
        let body = &seen[i].body;
        assert_eq!(&body[..4], b"sbm1", "request {i}");
        assert_eq!(&body[20..], value, "request {i}");
    }
    let expiry = u64::from_be_bytes(seen[2].body[4..12].try_into().unwrap());
    assert!(expiry > sbmesh::now_unix_ms(), "the TTL is in the record");
}

/// A missing bucket is an error, not an empty store (GCS answers
/// `NoSuchBucket`, as S3 does).
#[tokio::test]
async fn gcs_missing_bucket_is_an_error() {
    let (port, _) = responder(vec![(
        404,
        vec![],
        b"<Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist.</Message></Error>"
            .to_vec(),
    )])
    .await;
    let e = gcs_store(port).get("k").await.unwrap_err();
    assert!(
        e.to_string().contains("bucket \"certs\" does not exist"),
        "{e}"
    );
}
