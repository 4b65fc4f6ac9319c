//! The sidecar beside the real proxy's file: it accepts what sbproxy 1.13
//! accepts (docs/reference.md#config-file, docs/reference.md#the-proxy), refuses the real conflicts
//! with one line naming both settings and the fix, tells a file written for
//! the first contract where its settings went, and survives bad input.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{ORIGIN, sidecar_bin};

/// Runs the sidecar with a clean environment plus `env`.
fn sidecar(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(sidecar_bin());
    cmd.args(args).stdin(Stdio::null());
    for (name, _) in std::env::vars() {
        if name.starts_with("SBMESH_") || name.starts_with("SBPROXY_") {
            cmd.env_remove(name);
        }
    }
    for (name, value) in env {
        cmd.env(name, value);
    }
    cmd.output().expect("sidecar runs")
}

fn validate(path: &Path, env: &[(&str, &str)]) -> (i32, String) {
    let out = sidecar(&["validate", "--config", path.to_str().unwrap()], env);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn write(dir: &Path, name: &str, text: &[u8]) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Files a new user of sbproxy writes, each accepted by the real proxy
/// (`sbproxy validate`, checked below): a clustered one with what its mesh
/// requires, admin `bind` and `allow_ips` with a password of its own,
/// its own ACME with `challenge_types`, and the sidecar beside them on
/// other ports or with its own ACME off. `{origin}` is [`ORIGIN`].
const ACCEPTED: &[&str] = &[
    "proxy:\n  admin: { enabled: true, bind: 0.0.0.0, allow_ips: [10.0.0.0/8], password: s3cret-admin, max_log_entries: 500, cors_origins: [] }\norigins:\n  a.example.com: {origin}\n",
    "proxy:\n  cluster:\n    cluster_id: edge\n    node_id: edge-0\n    state_dir: /var/lib/sbproxy/cluster\n    roles: [gateway]\n    labels: { zone: a }\n    snapshot_ttl_secs: 30\n    gossip_port: 7000\n    transport_port: 8000\n    security: { mode: shared_key, development: true, shared_key: 0f1e2d3c4b5a69788796a5b4c3d2e1f0 }\n  extensions:\n    sbmesh: {}\norigins: {}\n",
    "proxy:\n  https_bind_port: 8443\n  acme:\n    enabled: true\n    email: ops@example.com\n    challenge_types: [http-01]\n    storage_backend: redb\n    storage_path: /var/lib/sbproxy/certs\n    renew_before_days: 30\norigins:\n  a.example.com: {origin}\n",
    "proxy:\n  http_bind_port: 8080\n  https_bind_port: 8443\n  tls_cert_file: /var/lib/sbproxy/certs/tls.crt\n  tls_key_file: /var/lib/sbproxy/certs/tls.key\n  extensions:\n    page_shield: { enabled: true }\n    sbmesh:\n      acme: { enabled: true, storage_backend: memory, certificates: san, apply: restart }\norigins:\n  a.example.com: {origin}\n  b.example.com: {origin}\n",
    "listen: 0.0.0.0:8080\nunknown_top_level: [1, 2]\nproxy:\n  admin: { enabled: true }\norigins:\n  \"*.example.com\": { action: { type: static, status_code: 200, body: \"$${not_a_var}\" } }\n",
];

/// [`ACCEPTED`]'s files as written.
fn accepted() -> Vec<String> {
    ACCEPTED
        .iter()
        .map(|t| t.replace("{origin}", ORIGIN))
        .collect()
}

#[test]
fn files_the_proxy_accepts_validate() {
    let dir = tempfile::tempdir().unwrap();
    for (i, text) in accepted().iter().enumerate() {
        let path = write(dir.path(), &format!("ok{i}.yml"), text.as_bytes());
        let (code, report) = validate(&path, &[]);
        assert_eq!(code, 0, "file {i}:\n{text}\n{report}");
        assert!(
            !report
                .lines()
                .any(|l| !l.starts_with("warning: ") && !l.starts_with("ok: ")),
            "file {i}: {report}"
        );
    }
}

#[test]
fn conflicts_are_one_line_each_and_run_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let ports = write(
        dir.path(),
        "ports.yml",
        b"proxy:\n  cluster: { state_dir: /x }\n  extensions:\n    sbmesh: {}\n",
    );
    let (code, report) = validate(&ports, &[]);
    assert_eq!(code, 1, "{report}");
    let lines: Vec<&str> = report.lines().collect();
    assert_eq!(
        lines,
        [
            "proxy.cluster.gossip_port: sbproxy's own mesh (proxy.cluster) binds UDP 7946, the same port as the sidecar's gossip_port (proxy.extensions.sbmesh.gossip_port / --gossip-port / SBMESH_GOSSIP_PORT); both run in the pod's network, so one of them cannot start. Remove proxy.cluster and let the sidecar form the mesh, or give one of them another port",
            "proxy.cluster.transport_port: sbproxy's own mesh (proxy.cluster) binds TCP 8946, the same port as the sidecar's transport_port (proxy.extensions.sbmesh.transport_port / --transport-port / SBMESH_TRANSPORT_PORT); both run in the pod's network, so one of them cannot start. Remove proxy.cluster and let the sidecar form the mesh, or give one of them another port",
        ]
    );
    // The pod's environment moves the sidecar away: no conflict.
    let (code, report) = validate(
        &ports,
        &[
            ("SBMESH_GOSSIP_PORT", "7947"),
            ("SBMESH_TRANSPORT_PORT", "8947"),
        ],
    );
    assert_eq!(code, 0, "{report}");
    // Only one of them moved: the other still conflicts.
    let (code, report) = validate(&ports, &[("SBMESH_GOSSIP_PORT", "7947")]);
    assert_eq!(code, 1, "{report}");
    assert!(
        report.starts_with("proxy.cluster.transport_port: "),
        "{report}"
    );

    let acme = write(
        dir.path(),
        "acme.yml",
        b"proxy:\n  https_bind_port: 8443\n  acme: { enabled: true }\n  extensions:\n    sbmesh:\n      acme: { enabled: true, storage_backend: memory }\norigins:\n  a.example.com: {}\n",
    );
    let (code, report) = validate(&acme, &[]);
    assert_eq!(code, 1, "{report}");
    assert_eq!(
        report.trim_end(),
        "proxy.acme.enabled: true while the sidecar's ACME (proxy.extensions.sbmesh.acme.enabled) is on too: sbproxy would order the same hostnames itself, in every pod. Set proxy.acme.enabled: false (or remove proxy.acme) to let the sidecar issue for the whole fleet, or set proxy.extensions.sbmesh.acme.enabled: false"
    );
    for path in [&ports, &acme] {
        let out = sidecar(&["run", "--config", path.to_str().unwrap()], &[]);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).starts_with("proxy."),
            "{out:?}"
        );
    }
}

#[test]
fn a_file_for_the_first_contract_gets_one_migration_line() {
    let dir = tempfile::tempdir().unwrap();
    let old = write(
        dir.path(),
        "old.yml",
        b"proxy:\n  cluster:\n    cluster_id: demo\n    gossip_port: 7000\n    transport_port: 8000\n  acme:\n    enabled: false\norigins: {}\n",
    );
    let (code, report) = validate(&old, &[]);
    assert_eq!(code, 0, "{report}");
    let warnings: Vec<&str> = report
        .lines()
        .filter(|l| l.starts_with("warning: "))
        .collect();
    assert_eq!(warnings.len(), 1, "{report}");
    assert!(
        warnings[0].starts_with("warning: proxy.extensions.sbmesh: not found, and the sidecar no longer reads proxy.cluster or proxy.acme"),
        "{report}"
    );
}

#[test]
fn an_origin_with_a_port_is_refused_when_acme_is_on() {
    // A bad origin is refused only with the sidecar's ACME on.
    let dir = tempfile::tempdir().unwrap();
    let port = write(
        dir.path(),
        "port.yml",
        b"proxy:\n  extensions:\n    sbmesh:\n      acme: { enabled: true, storage_backend: memory }\norigins:\n  \"api.example.com:8443\": {}\n",
    );
    let (code, report) = validate(&port, &[]);
    assert_eq!(code, 1, "{report}");
    assert!(
        report.starts_with("origins.\"api.example.com:8443\": has a port (8443)"),
        "{report}"
    );
}

#[test]
fn bad_input_is_a_clear_error_never_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    // 20 MiB: refused by size, without parsing it.
    let mut big = b"origins:\n".to_vec();
    while big.len() < 20 << 20 {
        big.extend_from_slice(b"  # a comment line of padding, padding, padding, padding\n");
    }
    let path = write(dir.path(), "big.yml", &big);
    let (code, report) = validate(&path, &[]);
    assert_eq!(code, 1, "{report}");
    assert!(report.contains("larger than 16 MiB"), "{report}");

    // Billion laughs: refused by the YAML reader's alias limit.
    let mut bomb = String::from("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for i in 1..10 {
        let p = i - 1;
        bomb.push_str(&format!(
            "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
        ));
    }
    let path = write(dir.path(), "bomb.yml", bomb.as_bytes());
    let (code, report) = validate(&path, &[]);
    assert_eq!(code, 1, "{report}");
    assert!(report.starts_with("(yaml): "), "{report}");

    // Not UTF-8.
    let path = write(
        dir.path(),
        "latin1.yml",
        b"origins:\n  caf\xe9.example.com: {}\n",
    );
    let (code, report) = validate(&path, &[]);
    assert_eq!(code, 1, "{report}");
    assert!(report.starts_with("(file): not valid UTF-8"), "{report}");

    // 10,000 origins: per_host takes them, san refuses them in one line.
    let mut many = String::from(
        "proxy:\n  extensions:\n    sbmesh:\n      acme: { enabled: true, storage_backend: memory }\norigins:\n",
    );
    for i in 0..10_000 {
        many.push_str(&format!("  h{i}.example.com: {{}}\n"));
    }
    let path = write(dir.path(), "many.yml", many.as_bytes());
    let (code, report) = validate(&path, &[]);
    assert_eq!(code, 0, "{report}");
    let san = many.replace(
        "storage_backend: memory }",
        "storage_backend: memory, certificates: san }",
    );
    let path = write(dir.path(), "many-san.yml", san.as_bytes());
    let (code, report) = validate(&path, &[]);
    assert_eq!(code, 1, "{report}");
    assert_eq!(report.lines().count(), 1, "{report}");
    assert!(
        report.starts_with("origins: 10000 hostnames, but certificates: san"),
        "{report}"
    );
}

/// One value for every key sbproxy 1.13 defines in `proxy.admin`,
/// `proxy.cluster` and `proxy.acme` (docs/reference.md#the-proxy), as
/// `(block, key: value)`; a further line is a key the real proxy requires
/// beside it (the block's other keys come from [`CLUSTER_REQUIRED`]).
const SECTION_10_KEYS: &[(&str, &str)] = &[
    ("admin", "enabled: true"),
    ("admin", "port: 9390"),
    ("admin", "username: ops"),
    ("admin", "password: s3cret"),
    ("admin", "max_log_entries: 500"),
    ("admin", "rate_limit_per_minute: 120"),
    ("admin", "prompt_persistence_path: /tmp/prompts"),
    (
        "admin",
        "prompt_persistence_encryption: { enabled: false, key: k, previous_keys: [] }",
    ),
    (
        "admin",
        "trace_url_template: \"https://trace.example.com/{id}\"",
    ),
    ("admin", "tls: { cert: /etc/a.crt, key: /etc/a.key }"),
    ("admin", "bind: 127.0.0.1"),
    ("admin", "allow_ips: [10.0.0.0/8]"),
    ("admin", "cors_origins: [\"https://console.example.com\"]"),
    (
        "admin",
        "operators: [{ username: o, password_hash: h, role: admin, tenant: t }]",
    ),
    ("cluster", "cluster_id: mesh"),
    ("cluster", "node_id: n0"),
    ("cluster", "roles: [gateway, worker, authority]"),
    ("cluster", "labels: { zone: a }"),
    ("cluster", "seeds: [\"p-0.p:7000\"]"),
    ("cluster", "advertise_addr: 127.0.0.1:7000"),
    ("cluster", "transport_advertise_addr: 127.0.0.1:8000"),
    (
        "cluster",
        "model_bind: 0.0.0.0:9500\nroles: [worker]\nmodel_endpoint: http://models:9500",
    ),
    ("cluster", "model_endpoint: http://models:9500"),
    ("cluster", "state_dir: /tmp/cluster-state"),
    (
        "cluster",
        "security: { mode: shared_key, development: true, shared_key: 00112233445566778899aabbccddeeff, key_derivation: hkdf }",
    ),
    ("cluster", "snapshot_ttl_secs: 30"),
    ("cluster", "publish_interval_secs: 5"),
    ("cluster", "dead_peer_gc_secs: 600"),
    (
        "cluster",
        "enrollment: { authority_dir: /tmp/auth, allow_insecure_http: true }\nroles: [authority]",
    ),
    (
        "cluster",
        "deployment_authority: { signing_key_file: s, verifying_key_file: v }\nroles: [authority]",
    ),
    (
        "cluster",
        "replication: { factor: 3, write_consistency: quorum, read_consistency: one, anti_entropy_interval_secs: 60, tombstone_gc_grace_secs: 600, max_entries: 10, max_value_bytes: 10 }",
    ),
    ("acme", "enabled: true"),
    ("acme", "email: ops@example.com"),
    (
        "acme",
        "directory_url: https://acme-v02.api.letsencrypt.org/directory",
    ),
    ("acme", "challenge_types: [http-01]"),
    ("acme", "storage_backend: redb"),
    ("acme", "storage_path: /tmp/acme"),
    ("acme", "renew_before_days: 30"),
    ("acme", "ca_root: /etc/ca.pem"),
];

/// The lines the real sbproxy requires in any `proxy.cluster` block
/// (`cluster_id`, `node_id`, `roles`, `state_dir`, a `security` it can
/// use), on ports away from the sidecar's (a real conflict is a problem,
/// tested above, not what the table is about); an entry's own line for a
/// key replaces the one here.
const CLUSTER_REQUIRED: &[&str] = &[
    "cluster_id: mesh",
    "node_id: n0",
    "roles: [gateway]",
    "state_dir: /tmp/cluster-state",
    "security: { mode: shared_key, development: true, shared_key: 0123456789abcdef0123456789abcdef }",
    "gossip_port: 7000",
    "transport_port: 8000",
];

/// The key a `key: value` line sets.
fn key_of(line: &str) -> &str {
    line.split(':').next().unwrap_or("").trim()
}

/// A `proxy.<block>` with `entry`'s lines (and, for `cluster`, what
/// [`CLUSTER_REQUIRED`] adds), indented for the block.
fn block(block: &str, entry: &[&str]) -> String {
    let mut lines: Vec<&str> = entry.to_vec();
    if block == "cluster" {
        let set: Vec<&str> = lines.iter().map(|l| key_of(l)).collect();
        lines.extend(
            CLUSTER_REQUIRED
                .iter()
                .filter(|l| !set.contains(&key_of(l))),
        );
    }
    let body: String = lines.iter().map(|l| format!("    {l}\n")).collect();
    format!("  {block}:\n{body}")
}

/// What the real sbproxy says of `config`: `Ok` when its own `validate`
/// accepts it, else its words.
fn sbproxy_validate(bin: &Path, config: &Path) -> Result<(), String> {
    let out = Command::new(bin)
        .arg("validate")
        .arg(config)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .output()
        .expect("sbproxy runs");
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[test]
fn the_sidecar_accepts_every_file_the_real_proxy_accepts() {
    let Some(sbproxy) =
        common::sbproxy_bin("the_sidecar_accepts_every_file_the_real_proxy_accepts")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut files: Vec<(String, String)> = Vec::new();
    // The admin block is on in every file: cluster enrollment needs it.
    for (name, entry) in SECTION_10_KEYS {
        let lines: Vec<&str> = entry.lines().collect();
        let admin = if *name == "admin" {
            String::new()
        } else {
            block("admin", &["enabled: true"])
        };
        files.push((
            format!("proxy.{name}.{}", key_of(lines[0])),
            format!(
                "proxy:\n{admin}{}origins:\n  a.example.com: {ORIGIN}\n",
                block(name, &lines)
            ),
        ));
    }
    // Every key at once, beside the sidecar's block: the cluster's roles
    // are all three, which its other keys need.
    let all = |name: &str| -> Vec<&str> {
        let mut lines: Vec<&str> = SECTION_10_KEYS
            .iter()
            .filter(|(b, _)| *b == name)
            .flat_map(|(_, e)| e.lines())
            .filter(|l| key_of(l) != "roles")
            .collect();
        // A key an entry repeats as another's companion is written once.
        let mut seen = std::collections::BTreeSet::new();
        lines.retain(|l| seen.insert(key_of(l)));
        if name == "cluster" {
            lines.push("roles: [gateway, worker, authority]");
        }
        lines
    };
    files.push((
        "every key".to_owned(),
        format!(
            "proxy:\n  http_bind_port: 8080\n{}{}{}  extensions:\n    sbmesh: {{ acme: {{ enabled: false }} }}\norigins:\n  a.example.com: {ORIGIN}\n",
            block("admin", &all("admin")),
            block("cluster", &all("cluster")),
            block("acme", &all("acme")),
        ),
    ));
    files.extend(
        accepted()
            .into_iter()
            .enumerate()
            .map(|(i, t)| (format!("seed example {i}"), t)),
    );
    // The comparison must tell: the proxy refuses these, and says why.
    for (text, says) in [
        (
            "proxy:\n  admin: { passwrd: x }\n",
            "unknown field `passwrd`",
        ),
        (
            "proxy:\n  acme: { eab: { kid: k, hmac_key: aGk } }\n",
            "unknown field `eab`",
        ),
        ("origins:\n  a.example.com: {}\n", "missing field `action`"),
    ] {
        let path = write(dir.path(), "refused.yml", text.as_bytes());
        let why =
            sbproxy_validate(&sbproxy, &path).expect_err(&format!("the real proxy took {text}"));
        assert!(why.contains(says), "{text}: {why}");
    }
    let mut not_taken = Vec::new();
    for (i, (what, text)) in files.iter().enumerate() {
        let path = write(dir.path(), &format!("t{i}.yml"), text.as_bytes());
        if let Err(why) = sbproxy_validate(&sbproxy, &path) {
            not_taken.push(format!("{what}:\n{text}{why}"));
            continue;
        }
        let (code, report) = validate(&path, &[]);
        assert_eq!(
            code, 0,
            "{what}: the real proxy accepts it, the sidecar does not:\n{text}\n{report}"
        );
        // Nor may the sidecar warn that the proxy would refuse it.
        assert!(
            !report.contains("sbproxy 1.13 refuses"),
            "{what}: the real proxy accepts it, the sidecar says it refuses it:\n{text}\n{report}"
        );
    }
    assert!(
        not_taken.is_empty(),
        "the real proxy refused:\n{}",
        not_taken.join("\n")
    );
}

/// What the real proxy does with `config`: `Ok` while it still runs after
/// 3 s (then stopped), else its exit and output.
fn sbproxy_start(bin: &Path, config: &Path) -> Result<(), String> {
    let mut child = Command::new(bin)
        .arg("--config")
        .arg(config)
        .env("NO_COLOR", "1")
        .env("SBPROXY_SHUTDOWN_GRACE_MS", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("sbproxy runs");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    while std::time::Instant::now() < deadline {
        if child.try_wait().expect("wait").is_some() {
            let out = child.wait_with_output().expect("output");
            return Err(format!(
                "{}: {}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    Ok(())
}

/// `sbproxy validate` accepts TLS turned on (its own ACME, or a certificate
/// file) without `proxy.https_bind_port`, and then the proxy exits at
/// start-up: the sidecar's `validate` says so, at the key that turned TLS
/// on, and names the fix; with the port the proxy starts and the sidecar
/// says nothing of it.
#[test]
fn tls_without_a_tls_port_passes_the_proxys_validate_but_not_its_start_and_the_sidecar_warns() {
    let Some(sbproxy) = common::sbproxy_bin(
        "tls_without_a_tls_port_passes_the_proxys_validate_but_not_its_start_and_the_sidecar_warns",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // The listeners on an address of their own; the certificate files exist.
    let crt = dir.path().join("tls.crt");
    let key = dir.path().join("tls.key");
    let (pem, key_pem) =
        sbmesh::internal::placeholder::generate(&["a.example.com".to_owned()], 1_790_000_000)
            .unwrap();
    std::fs::write(&crt, pem).unwrap();
    std::fs::write(&key, key_pem).unwrap();
    let listen = "  bind_address: 127.0.23.1\n  http_bind_port: 8080\n";
    for (at, tls) in [
        (
            "proxy.acme.enabled",
            "  acme: { enabled: true, email: ops@example.com, storage_backend: memory }\n"
                .to_owned(),
        ),
        (
            "proxy.tls_cert_file",
            format!(
                "  tls_cert_file: {}\n  tls_key_file: {}\n",
                crt.display(),
                key.display()
            ),
        ),
    ] {
        let text = format!("proxy:\n{listen}{tls}origins:\n  a.example.com: {ORIGIN}\n");
        let path = write(dir.path(), "no-port.yml", text.as_bytes());
        sbproxy_validate(&sbproxy, &path)
            .unwrap_or_else(|why| panic!("{at}: the real proxy's validate refused it: {why}"));
        let exit = sbproxy_start(&sbproxy, &path).expect_err(&format!(
            "{at}: the real proxy started without https_bind_port:\n{text}"
        ));
        assert!(
            exit.contains("https_bind_port must be set to use TLS"),
            "{at}: {exit}"
        );
        let (code, report) = validate(&path, &[]);
        assert_eq!(code, 0, "{at}: a warning, not an error:\n{report}");
        assert!(
            report
                .lines()
                .any(|l| l.starts_with(&format!("warning: {at}: "))
                    && l.contains("https_bind_port must be set to use TLS")
                    && l.contains("set proxy.https_bind_port")),
            "{at}: the sidecar did not warn:\n{report}"
        );

        let with_port = text.replace(listen, &format!("{listen}  https_bind_port: 8443\n"));
        let path = write(dir.path(), "port.yml", with_port.as_bytes());
        sbproxy_start(&sbproxy, &path)
            .unwrap_or_else(|why| panic!("{at}: with https_bind_port:\n{with_port}{why}"));
        let (code, report) = validate(&path, &[]);
        assert_eq!(code, 0, "{report}");
        assert!(!report.contains("https_bind_port"), "{at}: {report}");
    }
}
