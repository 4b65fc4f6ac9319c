//! The short subcommands: `validate`, `keygen` and `status`.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::body::Bytes;
use hyper::{Request, StatusCode, header};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use sbmesh::{
    DEFAULT_ADMIN_LISTEN, EnvLookup, Flag, Problem, generate_key, key_to_hex, load_config,
    local_url,
};

use serde_json::Value;

use crate::cli::{DEFAULT_ADMIN_URL, RunArgs, StatusArgs, ValidateArgs};
use crate::settings;
use crate::settings::{basic_authorization, process_env};

/// How long `status` waits for the admin endpoint, per step.
const STATUS_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest status document `status` reads.
const MAX_STATUS_BODY: usize = 16 * 1024 * 1024;

/// `sbmesh-sidecar validate`: checks the file the way `run` reads it (with
/// the process environment for `${VAR}`), prints the report on stdout and
/// returns the exit code: 1 on any error, else 0.
pub fn validate(args: &ValidateArgs) -> i32 {
    let (report, code) = validate_report(&args.config, &process_env);
    print_out(&report);
    code
}

/// Writes a command's output to stdout; a reader that stopped reading
/// (`status | head`) ends it quietly instead of a panic.
pub fn print_out(text: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

/// What `validate` prints for the file at `path`, and its exit code: one
/// problem per line as `<yaml.path>: <message>` (warnings prefixed with
/// `warning: `), then `ok: <path>` when there is no error.
///
/// The settings are resolved exactly as `run` resolves them, environment
/// included (`SBMESH_*`), so a conflict that the pod's environment avoids
/// is not reported, and one it causes is.
pub fn validate_report(path: &Path, env: &EnvLookup<'_>) -> (String, i32) {
    let args = RunArgs {
        config: Some(path.to_path_buf()),
        ..RunArgs::default()
    };
    let problems = match settings::resolve(&args, env, &settings::system_hostname(env)) {
        Ok(settings) => settings.warnings,
        Err(problems) => problems,
    };
    let mut report = render_problems(&problems);
    if problems.iter().any(Problem::is_error) {
        (report, 1)
    } else {
        let _ = writeln!(report, "ok: {}", path.display());
        (report, 0)
    }
}

/// Problems one per line, as `validate` prints them: `<path>: <message>`,
/// warnings prefixed with `warning: `. `run` prints its configuration errors
/// the same way before exiting 2.
pub fn render_problems(problems: &[Problem]) -> String {
    let mut out = String::new();
    for problem in problems {
        let prefix = if problem.is_error() { "" } else { "warning: " };
        let _ = writeln!(out, "{prefix}{problem}");
    }
    out
}

/// `sbmesh-sidecar keygen`: a fresh random 32-byte key as 64 lowercase hex
/// characters (no newline).
pub fn keygen() -> anyhow::Result<String> {
    let key = generate_key()?;
    Ok(key_to_hex(&key))
}

/// Where `status` asks, and with which HTTP Basic credentials, when the
/// flags do not say: as `run` reads them, so that on a pod the command
/// needs no flags.
///
/// - The URL: `--admin`, else `SBMESH_ADMIN_LISTEN` (loopback when it
///   listens on every address), else [`DEFAULT_ADMIN_URL`].
/// - The credentials: `--user` / `--password` (or `SBMESH_ADMIN_USER` /
///   `SBMESH_ADMIN_PASSWORD`), else `proxy.admin.username` / `password` of
///   `--config` (`env:` and `file:` references resolved, the proxy's
///   defaults while its admin API is enabled). The default config path is
///   skipped when absent; a path given and unreadable is an error.
pub fn status_target(
    args: &StatusArgs,
    env: &EnvLookup<'_>,
) -> anyhow::Result<(String, Option<(String, String)>)> {
    let listen_env = Flag::ADMIN_LISTEN.env;
    let url = match (&args.admin, env(listen_env)) {
        (Some(url), _) => url.clone(),
        (None, Some(listen)) => {
            let addr = listen.trim().parse::<std::net::SocketAddr>().map_err(|_| {
                anyhow!(
                    "{listen_env} is {listen:?}, not an ip:port such as {}; \
                     fix it, or give --admin http://HOST:PORT",
                    DEFAULT_ADMIN_LISTEN
                )
            })?;
            local_url(addr)
        }
        (None, None) => DEFAULT_ADMIN_URL.to_owned(),
    };
    let written = match (&args.user, &args.password) {
        (Some(_), Some(_)) => None,
        _ => {
            let path = crate::cli::config_path(args.config.as_deref());
            // The default path is skipped when absent; a path given is read.
            if args.config.is_none() && !path.exists() {
                None
            } else {
                load_config(&path, env)
                    .and_then(|loaded| settings::proxy_admin_credentials(&loaded.config, env))
                    .map_err(|problems| {
                        anyhow!(
                            "reading the credentials from {} (proxy.admin): {}give --user and \
                             --password instead",
                            path.display(),
                            render_problems(&problems)
                        )
                    })?
            }
        }
    };
    // Each one given wins over the file's, as in `run`.
    let user = args
        .user
        .clone()
        .or_else(|| written.as_ref().map(|w| w.0.clone()));
    let password = args.password.clone().or_else(|| written.map(|w| w.1));
    match (user, password) {
        (Some(user), Some(password)) => Ok((url, Some((user, password)))),
        (None, None) => Ok((url, None)),
        _ => bail!(
            "--user and --password go together, and no proxy.admin credentials of --config give \
             the other; give both or neither"
        ),
    }
}

/// `sbmesh-sidecar status`: fetches `<admin_url>/admin/cluster/status`
/// (HTTP Basic when `user` and `password` are given) and renders it with
/// [`render_status_table`].
pub async fn status(
    admin_url: &str,
    user: Option<&str>,
    password: Option<&str>,
) -> anyhow::Result<String> {
    let url = format!("{}/admin/cluster/status", admin_url.trim_end_matches('/'));
    let uri: hyper::Uri = url
        .parse()
        .map_err(|_| anyhow!("{admin_url:?} is not a URL; expected e.g. {DEFAULT_ADMIN_URL}"))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        bail!(
            "{admin_url:?}: expected an http:// URL such as {DEFAULT_ADMIN_URL} (the admin listener speaks plain HTTP)"
        );
    }
    let mut request = Request::get(uri).header(header::ACCEPT, "application/json");
    match (user, password) {
        (Some(user), Some(password)) => {
            request = request.header(header::AUTHORIZATION, basic_authorization(user, password));
        }
        (None, None) => {}
        _ => bail!("--user and --password go together; give both or neither"),
    }
    let request = request
        .body(Empty::<Bytes>::new())
        .context("building the request (is the user name or password a valid header value?)")?;

    let client = Client::builder(TokioExecutor::new()).build_http();
    let response = tokio::time::timeout(STATUS_TIMEOUT, client.request(request))
        .await
        .map_err(|_| anyhow!("{url}: no answer within {} s", STATUS_TIMEOUT.as_secs()))?
        .with_context(|| format!("cannot reach {url}"))?;
    let code = response.status();
    let body = tokio::time::timeout(
        STATUS_TIMEOUT,
        Limited::new(response.into_body(), MAX_STATUS_BODY).collect(),
    )
    .await
    .map_err(|_| {
        anyhow!(
            "{url}: the answer did not finish within {} s",
            STATUS_TIMEOUT.as_secs()
        )
    })?
    .map_err(|e| anyhow!("{url}: reading the answer: {e}"))?
    .to_bytes();

    match code {
        StatusCode::OK => {}
        StatusCode::UNAUTHORIZED => bail!(
            "{url}: 401 Unauthorized; pass --user and --password (the sidecar's --admin-user and \
             --admin-password, which default to proxy.admin.username and password)"
        ),
        other => {
            let excerpt: String = String::from_utf8_lossy(&body).chars().take(300).collect();
            bail!("{url}: {other}: {}", excerpt.trim());
        }
    }
    let document: Value =
        serde_json::from_slice(&body).with_context(|| format!("{url}: the answer is not JSON"))?;
    Ok(render_status_table(&document))
}

/// Renders an `/admin/cluster/status` document (docs/reference.md#cluster-status) as a header
/// (cluster id, local node, totals, config hash agreement) and a table with
/// the columns NODE, ADDRESS, STATE, HEALTH, INCARNATION, LAST SEEN,
/// CONFIG HASH (shortened) and VERSION. Missing or mistyped fields show as
/// `-`; never panics.
pub fn render_status_table(status: &Value) -> String {
    let summary = status.get("summary").unwrap_or(&Value::Null);
    let count = |key: &str| summary.get(key).and_then(Value::as_u64).unwrap_or(0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "cluster {}, local node {}: {} nodes ({} healthy, {} suspect, {} down)",
        text(status, "cluster_id"),
        text(status, "local_node_id"),
        count("total_nodes"),
        count("healthy_nodes"),
        count("suspect_nodes"),
        count("down_nodes"),
    );
    if let Some(line) = config_line(summary) {
        let _ = writeln!(out, "{line}");
    }

    for reason in status
        .get("degraded")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
    {
        let _ = writeln!(out, "degraded: {reason}");
    }

    let nodes = status
        .get("nodes")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    if nodes.is_empty() {
        out.push_str("(no nodes)\n");
        return out;
    }
    let mut rows: Vec<[String; 8]> = vec![[
        "NODE".into(),
        "ADDRESS".into(),
        "STATE".into(),
        "HEALTH".into(),
        "INCARNATION".into(),
        "LAST SEEN".into(),
        "CONFIG HASH".into(),
        "VERSION".into(),
    ]];
    rows.extend(nodes.iter().map(node_row));
    out.push('\n');
    let widths: Vec<usize> = (0..8)
        .map(|col| {
            rows.iter()
                .map(|row| row[col].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in &rows {
        let mut line = String::new();
        for (col, cell) in row.iter().enumerate() {
            let _ = write!(line, "{cell:<width$}  ", width = widths[col]);
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The summary's config hashes: the one all nodes run, or how they differ.
fn config_line(summary: &Value) -> Option<String> {
    let hashes = summary.get("config_hashes").and_then(Value::as_object)?;
    let mut hashes: Vec<(String, u64)> = hashes
        .iter()
        .map(|(hash, n)| (short_hash(hash), n.as_u64().unwrap_or(0)))
        .collect();
    hashes.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let listed: Vec<String> = hashes
        .iter()
        .map(|(hash, n)| format!("{hash} on {n} node{}", if *n == 1 { "" } else { "s" }))
        .collect();
    match listed.len() {
        0 => None,
        1 => Some(format!("config: {}", listed[0])),
        _ => Some(format!("config differs: {}", listed.join(", "))),
    }
}

/// One node's row of the table.
fn node_row(node: &Value) -> [String; 8] {
    let local = node.get("local").and_then(Value::as_bool).unwrap_or(false);
    let mut name = text(node, "node_id");
    if local {
        name.push_str(" (local)");
    }
    let last_seen = match node.get("last_seen_ms_ago").and_then(Value::as_u64) {
        _ if local => "-".to_string(),
        Some(ms) => ago(ms),
        None => "-".to_string(),
    };
    let hash = node
        .get("config_hash")
        .and_then(Value::as_str)
        .map_or_else(|| "-".to_string(), short_hash);
    [
        name,
        text(node, "address"),
        text(node, "membership_state"),
        text(node, "health"),
        node.get("incarnation")
            .and_then(Value::as_u64)
            .map_or_else(|| "-".to_string(), |n| n.to_string()),
        last_seen,
        hash,
        text(node, "version"),
    ]
}

/// A string field, or `-`; control characters are dropped so a hostile
/// document cannot move the terminal cursor.
fn text(value: &Value, key: &str) -> String {
    match value.get(key) {
        Some(Value::String(s)) if !s.is_empty() => s.chars().filter(|c| !c.is_control()).collect(),
        Some(Value::Number(n)) => n.to_string(),
        _ => "-".to_string(),
    }
}

/// `sha256:4f1c2a…` → the first 12 characters of the digest.
fn short_hash(hash: &str) -> String {
    let digest = hash.strip_prefix("sha256:").unwrap_or(hash);
    let short: String = digest
        .chars()
        .filter(|c| !c.is_control())
        .take(12)
        .collect();
    if short.is_empty() {
        "-".to_string()
    } else {
        short
    }
}

fn ago(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..60 => format!("{s}s ago"),
        60..3600 => format!("{}m{:02}s ago", s / 60, s % 60),
        3600..86_400 => format!("{}h{:02}m ago", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h ago", s / 86_400, s % 86_400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    fn status_args(config: Option<&Path>) -> StatusArgs {
        StatusArgs {
            admin: None,
            config: config.map(Path::to_path_buf),
            user: None,
            password: None,
        }
    }

    fn env_of<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn status_reads_the_admin_listener_and_the_proxys_credentials_as_run_does() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("sb.yml");
        std::fs::write(
            &config,
            "proxy:\n  admin: { enabled: true, username: ops, password: \"env:ADMIN_PW\" }\n",
        )
        .unwrap();
        let vars = [
            ("SBMESH_ADMIN_LISTEN", "0.0.0.0:9300"),
            ("ADMIN_PW", "s3cret"),
        ];
        let (url, creds) = status_target(&status_args(Some(&config)), &env_of(&vars)).unwrap();
        assert_eq!(url, "http://127.0.0.1:9300");
        assert_eq!(creds, Some(("ops".into(), "s3cret".into())));

        // A flag wins over the file, each on its own; --admin over the env.
        let mut args = status_args(Some(&config));
        args.admin = Some("http://10.0.0.5:9091".into());
        args.password = Some("given".into());
        let (url, creds) = status_target(&args, &env_of(&vars)).unwrap();
        assert_eq!(url, "http://10.0.0.5:9091");
        assert_eq!(creds, Some(("ops".into(), "given".into())));

        // An unresolvable reference names the field and the way out.
        let e = status_target(&status_args(Some(&config)), &env_of(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("proxy.admin.password"), "{e}");
        assert!(e.contains("ADMIN_PW"), "{e}");
        assert!(e.ends_with("give --user and --password instead"), "{e}");
    }

    #[test]
    fn status_without_a_config_file_or_listener_uses_the_defaults() {
        let dir = tempfile::tempdir().unwrap();
        // A path given that is missing is an error (only the default path
        // is skipped when absent).
        let missing = dir.path().join("nope.yml");
        let e = status_target(&status_args(Some(&missing)), &env_of(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope.yml"), "{e}");
        // No admin block: no credentials, loopback-only access.
        let config = dir.path().join("sb.yml");
        std::fs::write(&config, "origins: {}\n").unwrap();
        let (url, creds) = status_target(&status_args(Some(&config)), &env_of(&[])).unwrap();
        assert_eq!((url.as_str(), creds), (DEFAULT_ADMIN_URL, None));
        let e = status_target(
            &status_args(Some(&config)),
            &env_of(&[("SBMESH_ADMIN_LISTEN", "9091")]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("SBMESH_ADMIN_LISTEN is \"9091\""), "{e}");
    }

    fn example() -> Value {
        json!({
            "schema_version": 1,
            "cluster_id": "demo",
            "local_node_id": "demo-proxy-0",
            "generated_at_unix_ms": 1795960276000u64,
            "summary": {
                "total_nodes": 3, "healthy_nodes": 2, "suspect_nodes": 1, "down_nodes": 1,
                "config_hashes": {
                    "sha256:4f1c2a9b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f": 3,
                    "sha256:9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b": 1
                }
            },
            "nodes": [
                {
                    "node_id": "demo-proxy-0", "local": true, "address": "10.0.0.5:7946",
                    "membership_state": "alive", "incarnation": 2, "last_seen_ms_ago": 0,
                    "health": "healthy", "version": "0.1.0",
                    "config_hash": "sha256:4f1c2a9b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f",
                    "last_reload": { "result": "ok", "at_unix_ms": 1795960270000u64 },
                    "certificates": []
                },
                {
                    "node_id": "demo-proxy-1", "local": false, "address": "10.0.0.6:7946",
                    "membership_state": "suspect", "incarnation": 14, "last_seen_ms_ago": 4200,
                    "health": "unhealthy", "version": "0.1.0",
                    "config_hash": "sha256:4f1c2a9b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f"
                },
                {
                    "node_id": "demo-proxy-2", "local": false, "address": "10.0.0.7:7946",
                    "membership_state": "down", "incarnation": 1, "last_seen_ms_ago": 3_723_000,
                    "health": "unhealthy", "version": "0.0.9",
                    "config_hash": "sha256:9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b"
                }
            ]
        })
    }

    #[test]
    fn table_from_the_spec_shape() {
        let table = render_status_table(&example());
        let expected = "\
cluster demo, local node demo-proxy-0: 3 nodes (2 healthy, 1 suspect, 1 down)
config differs: 4f1c2a9b3c4d on 3 nodes, 9a8b7c6d5e4f on 1 node

NODE                  ADDRESS        STATE    HEALTH     INCARNATION  LAST SEEN  CONFIG HASH   VERSION
demo-proxy-0 (local)  10.0.0.5:7946  alive    healthy    2            -          4f1c2a9b3c4d  0.1.0
demo-proxy-1          10.0.0.6:7946  suspect  unhealthy  14           4s ago     4f1c2a9b3c4d  0.1.0
demo-proxy-2          10.0.0.7:7946  down     unhealthy  1            1h02m ago  9a8b7c6d5e4f  0.0.9
";
        assert_eq!(table, expected);
    }

    #[test]
    fn one_config_hash_is_stated_once() {
        let mut doc = example();
        doc["summary"]["config_hashes"] = json!({ "sha256:abc": 3 });
        let table = render_status_table(&doc);
        assert!(table.contains("\nconfig: abc on 3 nodes\n"), "{table}");
    }

    #[test]
    fn a_degradation_is_said_under_the_header() {
        let mut doc = example();
        doc["degraded"] = json!(["store: redis: connection refused"]);
        let table = render_status_table(&doc);
        assert!(
            table.contains("\ndegraded: store: redis: connection refused\n"),
            "{table}"
        );
    }

    #[test]
    fn odd_documents_never_panic() {
        for doc in [
            json!(null),
            json!([]),
            json!("x"),
            json!({}),
            json!({ "nodes": "nope", "summary": [] }),
            json!({ "nodes": [null, 1, {}, { "node_id": 5, "incarnation": -1, "config_hash": "" }] }),
            json!({ "cluster_id": "a\u{1b}[2Jb", "nodes": [{ "node_id": "x\ny", "address": "\r" }] }),
        ] {
            let table = render_status_table(&doc);
            assert!(table.starts_with("cluster "), "{table}");
            assert!(!table.contains('\u{1b}'), "{table:?}");
        }
        let table = render_status_table(&json!({}));
        assert_eq!(
            table,
            "cluster -, local node -: 0 nodes (0 healthy, 0 suspect, 0 down)\n(no nodes)\n"
        );
        let table = render_status_table(&json!({ "nodes": [{}] }));
        assert!(
            table
                .lines()
                .last()
                .unwrap()
                .split_whitespace()
                .all(|c| c == "-"),
            "{table}"
        );
    }

    #[test]
    fn durations() {
        assert_eq!(ago(999), "0s ago");
        assert_eq!(ago(59_999), "59s ago");
        assert_eq!(ago(60_000), "1m00s ago");
        assert_eq!(ago(3_599_000), "59m59s ago");
        assert_eq!(ago(3_600_000), "1h00m ago");
        assert_eq!(ago(90_000_000), "1d01h ago");
        assert_eq!(
            ago(u64::MAX),
            format!(
                "{}d{:02}h ago",
                u64::MAX / 1000 / 86_400,
                u64::MAX / 1000 % 86_400 / 3600
            )
        );
    }

    #[test]
    fn keys_are_64_lowercase_hex() {
        let a = keygen().unwrap();
        let b = keygen().unwrap();
        assert_eq!(a.len(), 64);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        );
        assert_ne!(a, b);
        assert_eq!(sbmesh::parse_key_ring(&a).unwrap().len(), 1);
    }

    /// A file in its own temporary directory, removed on drop.
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new(name: &str, contents: &str) -> Self {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "sbmesh-commands-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(name);
            std::fs::write(&path, contents).unwrap();
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            if let Some(dir) = self.0.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }

    #[test]
    fn validate_ok_with_and_without_warnings() {
        let file = TempFile::new(
            "sb.yml",
            "proxy:\n  admin: { port: 9090 }\norigins: { a.example.com: {} }\n",
        );
        let (report, code) = validate_report(&file.0, &|_| None);
        assert_eq!(code, 0);
        assert_eq!(report, format!("ok: {}\n", file.0.display()));

        let file = TempFile::new(
            "sb.yml",
            "proxy:\n  extensions:\n    sbmesh:\n      acme: { enabled: true, storage_backend: memory }\norigins: { '*.example.com': {} }\n",
        );
        let (report, code) = validate_report(&file.0, &|_| None);
        assert_eq!(code, 0);
        assert!(
            report.starts_with("warning: origins.\"*.example.com\": wildcard origin"),
            "{report}"
        );
        assert!(
            report.ends_with(&format!("ok: {}\n", file.0.display())),
            "{report}"
        );
    }

    #[test]
    fn validate_lists_every_problem() {
        let file = TempFile::new(
            "sb.yml",
            "proxy:\n  extensions:\n    sbmesh:\n      gossip_port: \"${PORT:-abc}\"\n      acme: { enabled: true, storage_backend: sqlite, storge_path: x }\norigins: { '*.example.com': {} }\n",
        );
        let (report, code) = validate_report(&file.0, &|_| None);
        assert_eq!(code, 1);
        assert_eq!(
            report,
            "\
proxy.extensions.sbmesh.gossip_port: expected a port number from 1 to 65535, found the string \"abc\"
proxy.extensions.sbmesh.acme.storge_path: unknown field; expected one of: enabled, email, directory_url, ca_root, eab, storage_backend, storage_path, renew_before_days, certificates, apply, challenge, dns01 (did you mean storage_path?)
proxy.extensions.sbmesh.acme.storage_backend: unsupported backend \"sqlite\"; supported: redis, s3, gcs, azure, file, redb, memory
warning: origins.\"*.example.com\": wildcard origin is not eligible for an HTTP-01 certificate and will not be ordered; set acme.challenge: dns-01 (with a dns01 provider) to order it, or provide its certificate another way
"
        );
        // the environment is used for ${VAR}
        let (report, code) =
            validate_report(&file.0, &|name| (name == "PORT").then(|| "7946".into()));
        assert_eq!(code, 1);
        assert!(!report.contains("gossip_port"), "{report}");

        let (report, code) = validate_report(Path::new("/nonexistent/sb.yml"), &|_| None);
        assert_eq!(code, 1);
        assert!(
            report.starts_with("/nonexistent/sb.yml: cannot read: "),
            "{report}"
        );
    }

    /// Serves one canned HTTP answer and hands back the request it got.
    async fn serve_once(answer: String) -> (String, tokio::task::JoinHandle<String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = Vec::new();
            let mut buf = [0u8; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = socket.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                request.extend_from_slice(&buf[..n]);
            }
            socket.write_all(answer.as_bytes()).await.unwrap();
            socket.shutdown().await.unwrap();
            String::from_utf8_lossy(&request).into_owned()
        });
        (url, task)
    }

    fn http_answer(status: &str, body: &str) -> String {
        format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    }

    #[tokio::test]
    async fn status_fetches_with_basic_auth_and_renders() {
        let (url, server) = serve_once(http_answer("200 OK", &example().to_string())).await;
        let table = status(&format!("{url}/"), Some("admin"), Some("secret"))
            .await
            .unwrap();
        assert_eq!(table, render_status_table(&example()));
        let request = server.await.unwrap();
        assert!(
            request.starts_with("GET /admin/cluster/status HTTP/1.1\r\n"),
            "{request}"
        );
        assert!(
            request
                .to_ascii_lowercase()
                .contains("authorization: basic ywrtaw46c2vjcmv0\r\n"),
            "{request}"
        );
    }

    #[tokio::test]
    async fn status_explains_401_and_other_errors() {
        let (url, _server) = serve_once(http_answer("401 Unauthorized", "")).await;
        let e = status(&url, None, None).await.unwrap_err().to_string();
        assert!(
            e.contains("401 Unauthorized; pass --user and --password"),
            "{e}"
        );

        let (url, _server) =
            serve_once(http_answer("503 Service Unavailable", "{\"ready\":false}")).await;
        let e = status(&url, None, None).await.unwrap_err().to_string();
        assert!(
            e.ends_with("503 Service Unavailable: {\"ready\":false}"),
            "{e}"
        );

        let (url, _server) = serve_once(http_answer("200 OK", "<html>")).await;
        let e = status(&url, None, None).await.unwrap_err().to_string();
        assert!(e.ends_with("the answer is not JSON"), "{e}");

        let e = status("https://x:1", None, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected an http:// URL"), "{e}");
        let e = status("not a url", None, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a URL"), "{e}");
        let e = status(DEFAULT_ADMIN_URL, Some("u"), None)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("go together"), "{e}");
    }

    #[tokio::test]
    async fn status_reports_unreachable_admin() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let e = status(&url, None, None).await.unwrap_err();
        assert!(e.to_string().starts_with("cannot reach "), "{e:#}");
    }
}
