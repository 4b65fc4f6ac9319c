//! The sidecar beside the real proxy's file: it accepts what sbproxy 1.13
//! accepts (docs/reference.md#config-file, docs/reference.md#the-proxy), refuses the real conflicts
//! with one line naming both settings and the fix, tells a file written for
//! the first contract where its settings went, and survives bad input.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::sidecar_bin;

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

/// Files a new user of sbproxy writes, each accepted by the proxy: a
/// clustered one with `state_dir`, development security, admin `bind`,
/// `allow_ips`, its own ACME with `challenge_types`, and the sidecar beside
/// them on other ports or with its own ACME off.
const ACCEPTED: &[&str] = &[
    "proxy:\n  admin: { enabled: true, bind: 0.0.0.0, allow_ips: [10.0.0.0/8], max_log_entries: 500, cors_origins: [] }\norigins:\n  a.example.com: {}\n",
    "proxy:\n  cluster:\n    cluster_id: edge\n    state_dir: /var/lib/sbproxy/cluster\n    roles: [gateway]\n    labels: { zone: a }\n    snapshot_ttl_secs: 30\n    gossip_port: 7000\n    transport_port: 8000\n    security: { mode: shared_key, development: true }\n  extensions:\n    sbmesh: {}\norigins: {}\n",
    "proxy:\n  acme:\n    enabled: true\n    email: ops@example.com\n    challenge_types: [http-01]\n    storage_backend: redb\n    storage_path: /var/lib/sbproxy/certs\n    renew_before_days: 30\norigins:\n  a.example.com: {}\n",
    "proxy:\n  http_bind_port: 8080\n  https_bind_port: 8443\n  tls_cert_file: /var/lib/sbproxy/certs/tls.crt\n  tls_key_file: /var/lib/sbproxy/certs/tls.key\n  extensions:\n    page_shield: { enabled: true }\n    sbmesh:\n      acme: { enabled: true, storage_backend: memory, certificates: san, apply: restart }\norigins:\n  a.example.com: {}\n  b.example.com: {}\n",
    "listen: 0.0.0.0:8080\nunknown_top_level: [1, 2]\nproxy:\n  admin: { enabled: true, password: \"$${not_a_var}\" }\norigins:\n  \"*.example.com\": {}\n",
];

#[test]
fn files_the_proxy_accepts_validate() {
    let dir = tempfile::tempdir().unwrap();
    for (i, text) in ACCEPTED.iter().enumerate() {
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
        b"proxy:\n  acme: { enabled: true }\n  extensions:\n    sbmesh:\n      acme: { enabled: true, storage_backend: memory }\norigins:\n  a.example.com: {}\n",
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
/// `(block, key: value)`.
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
    ("cluster", "advertise_addr: 127.0.0.1"),
    ("cluster", "transport_advertise_addr: 127.0.0.1:8000"),
    ("cluster", "model_bind: 0.0.0.0:9500"),
    ("cluster", "model_endpoint: http://models:9500"),
    ("cluster", "state_dir: /tmp/cluster-state"),
    (
        "cluster",
        "security: { mode: shared_key, development: true, shared_key: k, cert_file: c, key_file: k, ca_file: a, server_name: s, key_derivation: hkdf }",
    ),
    ("cluster", "snapshot_ttl_secs: 30"),
    ("cluster", "publish_interval_secs: 5"),
    ("cluster", "dead_peer_gc_secs: 600"),
    (
        "cluster",
        "enrollment: { authority_dir: /tmp/auth, allow_insecure_http: false }",
    ),
    (
        "cluster",
        "deployment_authority: { signing_key_file: s, verifying_key_file: v }",
    ),
    (
        "cluster",
        "replication: { factor: 3, write_consistency: quorum, read_consistency: one, anti_entropy_interval_secs: 60, tombstone_gc_grace_secs: 60, max_entries: 10, max_value_bytes: 10 }",
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

/// Whether the stand-in sbproxy starts on `config` (its data port
/// answers) rather than refusing it (exits). The admin API binds
/// `proxy.admin.bind` (127.0.0.1:9090 by default), which a test running
/// beside this one may hold for a moment: a start that failed only
/// because an address was in use is tried again.
fn standin_accepts(config: &Path, ip: std::net::Ipv4Addr) -> bool {
    let bin = sidecar_bin().with_file_name("sbproxy");
    assert!(
        bin.exists(),
        "{} is missing: cargo build -p sbmesh-standin",
        bin.display()
    );
    for _ in 0..20 {
        let mut child = Command::new(&bin)
            .arg("-f")
            .arg(config)
            .env("SBPROXY_STANDIN_BIND", ip.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("stand-in runs");
        let addr = std::net::SocketAddr::from((ip, 8080));
        let accepted = common::poll_until(common::deadline(), || {
            std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(200))
                .is_ok()
                || child.try_wait().ok().flatten().is_some()
        }) && child.try_wait().ok().flatten().is_none();
        let _ = child.kill();
        let output = child.wait_with_output().expect("stand-in output");
        let stderr = String::from_utf8_lossy(&output.stderr).to_lowercase();
        if accepted || !stderr.contains("address already in use") {
            return accepted;
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    false
}

#[test]
fn the_sidecar_accepts_every_file_the_stand_in_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let mut files: Vec<(String, String)> = Vec::new();
    for (block, entry) in SECTION_10_KEYS {
        // The proxy's own mesh on other ports than the sidecar's: a real
        // conflict is a problem (tested above), not what this table is about.
        let ports = if *block == "cluster" {
            "\n    gossip_port: 7000\n    transport_port: 8000"
        } else {
            ""
        };
        files.push((
            format!("proxy.{block}.{entry}"),
            format!("proxy:\n  {block}:\n    {entry}{ports}\norigins:\n  a.example.com: {{}}\n"),
        ));
    }
    // Every key at once, beside the sidecar's block.
    let all = |block: &str| -> String {
        SECTION_10_KEYS
            .iter()
            .filter(|(b, _)| *b == block)
            .map(|(_, e)| format!("    {e}\n"))
            .collect()
    };
    files.push((
        "every key".to_owned(),
        format!(
            "proxy:\n  http_bind_port: 8080\n  admin:\n{}  cluster:\n{}    gossip_port: 7000\n    transport_port: 8000\n  acme:\n{}  extensions:\n    sbmesh: {{ acme: {{ enabled: false }} }}\norigins:\n  a.example.com: {{}}\n",
            all("admin"),
            all("cluster"),
            all("acme")
        ),
    ));
    // The seed examples; the proxy loads the TLS pair they name at start.
    let certs = dir.path().join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    let (crt, key) =
        sbmesh::acme::placeholder::generate(&["a.example.com".to_owned()], 1_790_000_000).unwrap();
    std::fs::write(certs.join("tls.crt"), crt).unwrap();
    std::fs::write(certs.join("tls.key"), key).unwrap();
    files.extend(ACCEPTED.iter().enumerate().map(|(i, t)| {
        (
            format!("seed example {i}"),
            t.replace("/var/lib/sbproxy/certs", &certs.display().to_string()),
        )
    }));
    // The table must tell: the stand-in refuses these, as sbproxy does.
    let refused = [
        "proxy:\n  admin: { passwrd: x }\n",
        "proxy:\n  acme: { eab: { kid: k, hmac_key: aGk } }\n",
    ];
    for (i, text) in refused.iter().enumerate() {
        let path = write(dir.path(), &format!("refused{i}.yml"), text.as_bytes());
        let ip = std::net::Ipv4Addr::new(127, 0, 64, 200 + i as u8);
        assert!(!standin_accepts(&path, ip), "the stand-in took {text}");
    }
    let mut not_taken = Vec::new();
    for (i, (what, text)) in files.iter().enumerate() {
        let path = write(dir.path(), &format!("t{i}.yml"), text.as_bytes());
        let ip = std::net::Ipv4Addr::new(127, 0, 64, 1 + (i % 150) as u8);
        if !standin_accepts(&path, ip) {
            not_taken.push(what.clone());
            continue;
        }
        let (code, report) = validate(&path, &[]);
        assert_eq!(
            code, 0,
            "{what}: the stand-in accepts it, the sidecar does not:\n{text}\n{report}"
        );
    }
    assert!(not_taken.is_empty(), "the stand-in refused {not_taken:?}");
}
