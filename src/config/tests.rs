use super::*;
use proptest::prelude::*;

const K1: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

const FULL: &str = r#"
listen: 0.0.0.0:8080          # top-level keys of the proxy's are its business
proxy:
  log_level: debug
  admin: { enabled: true, port: 9191, username: admin, password: secret, bind: 0.0.0.0 }
  https_bind_port: 8443
  tls_cert_file: /var/lib/sbproxy/certs/tls.crt
  tls_key_file: /var/lib/sbproxy/certs/tls.key
  extensions:
    page_shield: { enabled: true }
    sbmesh:
      cluster_id: demo
      node_id: demo-proxy-0
      seeds: ["demo-proxy-0.demo-mesh.default.svc.cluster.local:7946", "10.0.0.9"]
      gossip_port: 7000
      transport_port: 8000
      advertise_addr: "10.0.0.5:7946"
      shared_key: "env:SBPROXY_CLUSTER_KEY"
      acme:
        enabled: true
        email: ops@example.com
        directory_url: https://acme-staging-v02.api.letsencrypt.org/directory
        ca_root: /etc/sbmesh/acme-root.pem
        storage_backend: redis
        storage_path: redis://redis.default.svc.cluster.local:6379/0
        renew_before_days: 30
        eab: { kid: "kid-1", hmac_key: "c2VjcmV0LWhtYWMta2V5" }
        certificates: san
        apply: restart
origins:
  "api.example.com": { upstream: http://api:8080 }
  "WWW.example.com":
    upstream: http://www:8080
  "bücher.example": {}
"#;

/// Every key sbproxy 1.13 defines in `proxy.admin`, `proxy.cluster` and
/// `proxy.acme` (docs/reference.md#the-proxy), written out here so that the
/// table in `sbproxy.rs` is checked against the contract.
const EVERY_PROXY_KEY: &str = r#"
proxy:
  http_bind_port: 8080
  https_bind_port: 8443
  tls_cert_file: /var/lib/sbproxy/certs/tls.crt
  tls_key_file: /var/lib/sbproxy/certs/tls.key
  admin:
    enabled: true
    port: 9090
    username: admin
    password: changeme
    max_log_entries: 1000
    rate_limit_per_minute: 240
    prompt_persistence_path: /var/lib/sbproxy/prompts
    prompt_persistence_encryption: { enabled: true, key: "env:PROMPT_KEY", previous_keys: [] }
    trace_url_template: "https://trace.example.com/{trace_id}"
    tls: { cert: /etc/admin/tls.crt, key: /etc/admin/tls.key }
    bind: 0.0.0.0
    allow_ips: ["10.0.0.0/8"]
    cors_origins: ["https://console.example.com"]
    operators:
      - { username: ops, password_hash: "$$argon2id$$v=19", role: admin, tenant: default }
  cluster:
    cluster_id: proxy-mesh
    node_id: ${SBPROXY_POD_NAME:-n0}
    roles: [gateway, worker, authority]
    labels: { zone: a }
    seeds: ["p-0.p:7000"]
    gossip_port: 7000
    transport_port: 8000
    advertise_addr: 10.0.0.5
    transport_advertise_addr: 10.0.0.5:8000
    model_bind: 0.0.0.0:9500
    model_endpoint: http://models:9500
    state_dir: /var/lib/sbproxy/cluster
    security:
      mode: shared_key
      development: true
      shared_key: "env:SBPROXY_CLUSTER_KEY"
      cert_file: /etc/c.crt
      key_file: /etc/c.key
      ca_file: /etc/ca.crt
      server_name: mesh.local
      key_derivation: hkdf
    snapshot_ttl_secs: 30
    publish_interval_secs: 5
    dead_peer_gc_secs: 600
    enrollment: { authority_dir: /var/lib/auth, allow_insecure_http: false }
    deployment_authority: { signing_key_file: /etc/s.key, verifying_key_file: /etc/v.key }
    replication:
      factor: 3
      write_consistency: quorum
      read_consistency: one
      anti_entropy_interval_secs: 60
      tombstone_gc_grace_secs: 3600
      max_entries: 100000
      max_value_bytes: 65536
  acme:
    enabled: false
    email: ops@example.com
    directory_url: https://acme-v02.api.letsencrypt.org/directory
    challenge_types: [http-01]
    storage_backend: redb
    storage_path: /var/lib/sbproxy/certs
    renew_before_days: 30
    ca_root: /etc/ca.pem
origins:
  "api.example.com": {}
"#;

fn problems(text: &str) -> Vec<String> {
    match parse_config(text) {
        Ok(cfg) => cfg.warnings().iter().map(ToString::to_string).collect(),
        Err(problems) => problems.iter().map(ToString::to_string).collect(),
    }
}

fn errors(text: &str) -> Vec<String> {
    match parse_config(text) {
        Ok(cfg) => panic!("expected problems, parsed {cfg:?}"),
        Err(problems) => problems
            .iter()
            .filter(|p| p.is_error())
            .map(ToString::to_string)
            .collect(),
    }
}

fn one_error(text: &str) -> String {
    let errors = errors(text);
    assert_eq!(errors.len(), 1, "{errors:#?}");
    errors.into_iter().next().unwrap_or_default()
}

/// `proxy.extensions.sbmesh.acme` with `body` (written at 4 spaces).
fn acme(body: &str) -> String {
    let body: String = body.lines().map(|l| format!("        {l}\n")).collect();
    format!("proxy:\n  extensions:\n    sbmesh:\n      acme:\n{body}")
}

/// `proxy.extensions.sbmesh` with `body` (written at 6 spaces).
fn sbmesh(body: &str) -> String {
    format!("proxy:\n  extensions:\n    sbmesh:\n{body}")
}

#[test]
fn full_example_parses() {
    let cfg = parse_config(FULL).unwrap();
    let admin = &cfg.proxy.admin;
    assert!(admin.enabled);
    assert_eq!(admin.port, 9191);
    assert_eq!(admin.base_url(), "http://127.0.0.1:9191");
    assert_eq!(
        admin.credentials(),
        Some(("admin".to_owned(), "secret".to_owned()))
    );
    assert_eq!(
        cfg.proxy.tls_key_file.as_deref(),
        Some(Path::new("/var/lib/sbproxy/certs/tls.key"))
    );
    assert_eq!(
        cfg.proxy.tls_cert_file.as_deref(),
        Some(Path::new("/var/lib/sbproxy/certs/tls.crt"))
    );
    assert!(cfg.proxy.cluster.is_none() && cfg.proxy.acme.is_none());
    let s = cfg.sbmesh();
    assert_eq!(s.cluster_id.as_deref(), Some("demo"));
    assert_eq!(s.node_id.as_deref(), Some("demo-proxy-0"));
    assert_eq!(s.seeds.len(), 2);
    assert_eq!(s.gossip_port, Some(7000));
    assert_eq!(s.transport_port, Some(8000));
    assert_eq!(s.advertise_addr.as_deref(), Some("10.0.0.5:7946"));
    assert_eq!(s.shared_key.as_deref(), Some("env:SBPROXY_CLUSTER_KEY"));
    let acme = cfg.acme().unwrap();
    assert_eq!(acme.email.as_deref(), Some("ops@example.com"));
    assert_eq!(acme.storage_backend, Some(StorageBackend::Redis));
    assert_eq!(acme.renew_before_days, Some(30));
    assert_eq!(acme.eab.as_ref().unwrap().kid, "kid-1");
    assert_eq!(acme.certificates, CertificateMode::San);
    assert_eq!(acme.apply, Some(CertApply::Restart));
    assert_eq!(cfg.certificate_mode(), CertificateMode::San);
    assert_eq!(
        cfg.origins,
        ["api.example.com", "WWW.example.com", "bücher.example"]
    );
    assert_eq!(
        cfg.acme_hostnames().0,
        [
            "api.example.com",
            "www.example.com",
            "xn--bcher-kva.example"
        ]
    );
    assert!(cfg.warnings().is_empty(), "{:?}", cfg.warnings());
}

#[test]
fn defaults() {
    let cfg = parse_config("origins:\n  a.example.com: {}\n").unwrap();
    assert_eq!(cfg.proxy.admin, AdminSection::default());
    assert_eq!(cfg.proxy.admin.port, DEFAULT_PROXY_ADMIN_PORT);
    assert_eq!(cfg.proxy.admin.base_url(), "http://127.0.0.1:9090");
    assert!(cfg.proxy.sbmesh.is_none());
    assert!(!cfg.acme_enabled());
    assert_eq!(cfg.certificate_mode(), CertificateMode::PerHost);
    // ACME off: nothing to order
    assert_eq!(cfg.acme_hostnames(), (vec![], vec![]));
    let acme = AcmeSection::default();
    assert_eq!(acme.directory_url, LETS_ENCRYPT_DIRECTORY);
    assert_eq!(acme.apply, None);
}

#[test]
fn admin_defaults_are_the_proxys() {
    // enabled without credentials: the proxy checks admin / changeme
    let cfg = parse_config("proxy:\n  admin: { enabled: true }\n").unwrap();
    assert_eq!(
        cfg.proxy.admin.credentials(),
        Some(("admin".to_owned(), "changeme".to_owned()))
    );
    let cfg = parse_config("proxy:\n  admin: { enabled: true, password: s3cret }\n").unwrap();
    assert_eq!(
        cfg.proxy.admin.credentials(),
        Some(("admin".to_owned(), "s3cret".to_owned()))
    );
    // disabled: no admin API, so only what is written
    assert_eq!(
        parse_config("proxy:\n  admin: {}\n")
            .unwrap()
            .proxy
            .admin
            .credentials(),
        None
    );
    // bind decides where the reload POST goes
    let cfg = parse_config("proxy:\n  admin: { bind: 127.0.3.4, port: 9000 }\n").unwrap();
    assert_eq!(cfg.proxy.admin.base_url(), "http://127.0.3.4:9000");
    let cfg = parse_config("proxy:\n  admin: { bind: \"::\" }\n").unwrap();
    assert_eq!(cfg.proxy.admin.base_url(), "http://[::1]:9090");
    assert_eq!(
        one_error("proxy:\n  admin: { bind: localhost }\n"),
        "proxy.admin.bind: \"localhost\" is not an IP address; expected one such as 127.0.0.1 or 0.0.0.0"
    );
}

#[test]
fn every_key_the_proxy_defines_is_accepted() {
    let env = |name: &str| (name == "SBPROXY_POD_NAME").then(|| "p-0".to_owned());
    let text = interpolate(EVERY_PROXY_KEY, &env);
    let cfg = parse_config(&text).unwrap();
    // Only the line saying the sidecar's settings now live elsewhere.
    let w = cfg.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert_eq!(w[0].path, SBMESH_PATH);
    assert_eq!(
        cfg.proxy.cluster,
        Some(ProxyCluster {
            gossip_port: 7000,
            transport_port: 8000
        })
    );
    assert_eq!(
        cfg.proxy.acme,
        Some(ProxyAcme {
            enabled: false,
            storage_backend: Some("redb".to_owned())
        })
    );
    // And the sidecar's block beside all of it.
    let with_block = text.replace(
        "\norigins:",
        "\n  extensions:\n    sbmesh: { gossip_port: 7946, acme: { enabled: true } }\norigins:",
    );
    let cfg = parse_config(&with_block).unwrap();
    assert!(cfg.acme_enabled());
    assert!(cfg.warnings().is_empty(), "{:?}", cfg.warnings());
}

#[test]
fn keys_the_proxy_refuses_are_warnings() {
    let w = problems("proxy:\n  admin: { passwrd: x }\n");
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].starts_with("proxy.admin.passwrd: sbproxy 1.13 refuses this key"),
        "{}",
        w[0]
    );
    assert!(w[0].contains("(did you mean password?)"), "{}", w[0]);
    let w = problems("proxy:\n  acme: { eab: { kid: k, hmac_key: aGk } }\n");
    assert!(
        w.iter()
            .any(|l| l.starts_with("proxy.acme.eab: ")
                && l.contains("proxy.extensions.sbmesh.acme.eab")),
        "{w:?}"
    );
    // never an error: the file is the proxy's
    assert!(parse_config("proxy:\n  cluster: { colour: red }\n").is_ok());
}

#[test]
fn a_file_with_only_the_old_blocks_gets_the_migration_line() {
    for text in [
        "proxy:\n  cluster: { cluster_id: demo }\n",
        "proxy:\n  acme: { enabled: false }\n",
    ] {
        let cfg = parse_config(text).unwrap();
        let w = cfg.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(w[0].path, SBMESH_PATH);
        assert!(
            w[0].message.contains("no longer reads proxy.cluster"),
            "{}",
            w[0]
        );
        // nothing is read from them for the sidecar
        assert_eq!(*cfg.sbmesh(), SbmeshSection::default());
    }
    // with the sidecar's block, the proxy's blocks are the proxy's
    let cfg = parse_config("proxy:\n  cluster: {}\n  extensions: { sbmesh: {} }\n").unwrap();
    assert!(cfg.warnings().is_empty());
}

#[test]
fn the_sidecar_block_is_strict() {
    assert_eq!(
        one_error(&sbmesh("      gossip_prt: 7000\n")),
        "proxy.extensions.sbmesh.gossip_prt: unknown field; expected one of: cluster_id, node_id, seeds, gossip_port, transport_port, advertise_addr, shared_key, acme (did you mean gossip_port?)"
    );
    let e = one_error(&acme("storge_path: /x\n"));
    assert!(
        e.starts_with("proxy.extensions.sbmesh.acme.storge_path: unknown field; expected one of: enabled, email, directory_url, ca_root, eab, storage_backend, storage_path, renew_before_days, certificates, apply"),
        "{e}"
    );
    assert!(e.ends_with("(did you mean storage_path?)"), "{e}");
    assert_eq!(
        one_error(&sbmesh("      gossip_port: abc\n")),
        "proxy.extensions.sbmesh.gossip_port: expected a port number from 1 to 65535, found the string \"abc\""
    );
    assert!(
        one_error(&sbmesh("      seeds: [\"a:b:c:d\"]\n"))
            .starts_with("proxy.extensions.sbmesh.seeds[0]: ")
    );
    assert!(
        one_error(&sbmesh("      shared_key: abc\n"))
            .starts_with("proxy.extensions.sbmesh.shared_key: ")
    );
    assert!(one_error(&sbmesh("      shared_key: abc\n")).contains("keygen"));
    assert!(parse_config(&sbmesh(&format!("      shared_key: \"{K1}\"\n"))).is_ok());
    assert_eq!(
        one_error("proxy:\n  extensions: [sbmesh]\n"),
        "proxy.extensions: expected a mapping of extension blocks (the sidecar's is sbmesh), found a list"
    );
    assert!(
        one_error(&sbmesh("      acme: yes\n"))
            .starts_with("proxy.extensions.sbmesh.acme: expected a mapping")
    );
}

#[test]
fn certificates_and_apply() {
    assert!(one_error(&acme("certificates: one\n")).starts_with(
        "proxy.extensions.sbmesh.acme.certificates: \"one\" is not a certificate mode; expected per_host"
    ));
    assert_eq!(
        one_error(&acme("apply: hup\n")),
        "proxy.extensions.sbmesh.acme.apply: \"hup\" is not a way to apply certificates; expected one of: reload, restart, none"
    );
    for (name, mode) in [
        ("reload", CertApply::Reload),
        ("restart", CertApply::Restart),
        ("none", CertApply::None),
    ] {
        let cfg = parse_config(&acme(&format!("enabled: true\napply: {name}\n"))).unwrap();
        assert_eq!(cfg.acme().unwrap().apply, Some(mode));
    }
}

#[test]
fn origins_are_hostnames_when_acme_is_on() {
    let text = |origins: &str| format!("{}origins:\n{origins}", acme("enabled: true\n"));
    let e = one_error(&text("  \"api.example.com:8443\": {}\n"));
    assert!(
        e.starts_with("origins.\"api.example.com:8443\": has a port (8443)"),
        "{e}"
    );
    assert!(one_error(&text("  \"a..b\": {}\n")).contains("empty label"));
    assert!(one_error(&text(&format!("  {}.com: {{}}\n", "a".repeat(64)))).contains("at most 63"));
    // ACME off: the proxy's business
    assert!(parse_config("origins:\n  \"api.example.com:8443\": {}\n").is_ok());
    // normalised, deduplicated
    let cfg = parse_config(&text(
        "  API.example.com: {}\n  api.example.com.: {}\n  \"*.example.com\": {}\n",
    ))
    .unwrap();
    assert_eq!(
        cfg.acme_hostnames(),
        (
            vec!["api.example.com".to_owned()],
            vec!["*.example.com".to_owned()]
        )
    );
}

#[test]
fn san_takes_at_most_100_names() {
    let origins = |n: usize| -> String {
        (0..n)
            .map(|i| format!("  h{i}.example.com: {{}}\n"))
            .collect()
    };
    let san = acme("enabled: true\ncertificates: san\n");
    assert!(parse_config(&format!("{san}origins:\n{}", origins(100))).is_ok());
    let e = one_error(&format!("{san}origins:\n{}", origins(101)));
    assert!(
        e.starts_with("origins: 101 hostnames, but certificates: san"),
        "{e}"
    );
    // per_host takes any number
    let per_host = acme("enabled: true\n");
    assert!(parse_config(&format!("{per_host}origins:\n{}", origins(10_000))).is_ok());
}

#[test]
fn renew_before_days_at_half_the_lifetime_is_a_problem() {
    let e = one_error(&acme("renew_before_days: 45\n"));
    assert!(
        e.starts_with("proxy.extensions.sbmesh.acme.renew_before_days: 45 is at least half of the 90-day lifetime"),
        "{e}"
    );
    assert!(parse_config(&acme("renew_before_days: 44\n")).is_ok());
    // a CA whose lifetime is not known here: checked against each certificate
    assert!(
        parse_config(&acme(
            "renew_before_days: 60\ndirectory_url: https://ca.internal/dir\n"
        ))
        .is_ok()
    );
}

#[test]
fn unresolved_variables_are_kept_with_a_warning_and_refused_where_used() {
    let env = |_: &str| None;
    // The proxy's value: kept, a warning.
    let text = "proxy:\n  cluster:\n    node_id: ${POD}\n  extensions: { sbmesh: {} }\n";
    let interpolated = interpolate_report(text, &env);
    let cfg = parse_interpolated_config(&interpolated).unwrap();
    let w: Vec<String> = cfg.warnings().iter().map(ToString::to_string).collect();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].starts_with("line 3, column 14: ${POD} is kept as written"),
        "{}",
        w[0]
    );
    // The sidecar's value: an error naming the variable.
    let text = sbmesh("      node_id: ${POD}\n");
    let problems = parse_interpolated_config(&interpolate_report(&text, &env)).unwrap_err();
    let errors: Vec<String> = problems
        .iter()
        .filter(|p| p.is_error())
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        errors,
        [
            "proxy.extensions.sbmesh.node_id: uses ${POD}, but the environment variable POD is not set; set it, or write ${POD:-default}"
        ]
    );
    // The proxy's own value keeps it, as the proxy does: its admin API
    // checks that very literal, so the reload POST must send it.
    let text = "proxy:\n  admin: { enabled: true, password: \"${ADMIN_PW}\" }\n";
    let cfg = parse_interpolated_config(&interpolate_report(text, &env)).unwrap();
    assert_eq!(cfg.proxy.admin.password.as_deref(), Some("${ADMIN_PW}"));
    assert_eq!(cfg.warnings().len(), 1, "{:?}", cfg.warnings());
    // A default resolves it.
    let text = sbmesh("      node_id: ${POD:-n0}\n");
    let cfg = parse_interpolated_config(&interpolate_report(&text, &env)).unwrap();
    assert_eq!(cfg.sbmesh().node_id.as_deref(), Some("n0"));
}

#[test]
fn conflicts_with_the_proxys_own_mesh_and_acme() {
    let ports = SidecarPorts {
        gossip: DEFAULT_GOSSIP_PORT,
        transport: DEFAULT_TRANSPORT_PORT,
    };
    let cfg = parse_config("proxy:\n  cluster: { state_dir: /x }\n  extensions: { sbmesh: {} }\n")
        .unwrap();
    let found: Vec<String> = config_conflicts(&cfg, ports)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].starts_with("proxy.cluster.gossip_port: sbproxy's own mesh (proxy.cluster) binds UDP 7946, the same port as the sidecar's gossip_port (proxy.extensions.sbmesh.gossip_port / --gossip-port / SBMESH_GOSSIP_PORT)"), "{}", found[0]);
    assert!(found[0].contains("Remove proxy.cluster"), "{}", found[0]);
    assert!(
        found[1].starts_with(
            "proxy.cluster.transport_port: sbproxy's own mesh (proxy.cluster) binds TCP 8946"
        ),
        "{}",
        found[1]
    );
    // other ports: no conflict
    assert!(
        config_conflicts(
            &cfg,
            SidecarPorts {
                gossip: 7947,
                transport: 8947
            }
        )
        .is_empty()
    );
    let cfg =
        parse_config("proxy:\n  cluster: { gossip_port: 7000, transport_port: 8000 }\n").unwrap();
    assert!(config_conflicts(&cfg, ports).is_empty());

    let text = format!(
        "proxy:\n  acme: {{ enabled: true }}\n{}",
        &acme("enabled: true\n")["proxy:\n".len()..]
    );
    let cfg = parse_config(&text).unwrap();
    let found = config_conflicts(&cfg, ports);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].path, "proxy.acme.enabled");
    assert!(
        found[0].message.contains("Set proxy.acme.enabled: false"),
        "{}",
        found[0]
    );
    assert!(
        found[0]
            .message
            .contains("proxy.extensions.sbmesh.acme.enabled"),
        "{}",
        found[0]
    );
    // the proxy's ACME alone is the proxy's business
    let cfg = parse_config("proxy:\n  acme: { enabled: true }\n").unwrap();
    assert!(config_conflicts(&cfg, ports).is_empty());
}

#[test]
fn wildcard_origins_are_warnings_when_acme_is_enabled() {
    let text = format!(
        "{}origins:\n  \"*.example.com\": {{}}\n  a.example.com: {{}}\n",
        acme("enabled: true\n")
    );
    let cfg = parse_config(&text).unwrap();
    let w = cfg.warnings();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].path, "origins.\"*.example.com\"");
    assert!(!w[0].is_error());
    assert!(
        parse_config("origins:\n  \"*.example.com\": {}\n")
            .unwrap()
            .warnings()
            .is_empty()
    );
}

#[test]
fn empty_values_count_as_absent() {
    let cfg = parse_config(&sbmesh(
        "      node_id: \"\"\n      cluster_id: \"  \"\n      gossip_port:\n",
    ))
    .unwrap();
    assert_eq!(cfg.sbmesh().node_id, None);
    assert_eq!(cfg.sbmesh().cluster_id, None);
    assert_eq!(cfg.sbmesh().gossip_port, None);
}

#[test]
fn merge_keys_are_applied() {
    let text = "base: &b { gossip_port: 7100 }\nproxy:\n  extensions:\n    sbmesh:\n      <<: *b\n      transport_port: 8100\n";
    let cfg = parse_config(text).unwrap();
    let s = cfg.sbmesh();
    assert_eq!((s.gossip_port, s.transport_port), (Some(7100), Some(8100)));
}

#[test]
fn documents_that_are_not_mappings() {
    assert_eq!(
        one_error(""),
        "(root): the document is empty; expected a mapping with `proxy` and `origins`"
    );
    assert!(one_error("- a\n").starts_with("(root): expected a mapping"));
    assert!(one_error("proxy: 3\n").starts_with("proxy: expected a mapping"));
    assert!(one_error("origins: [a]\n").starts_with("origins: expected a mapping"));
}

#[test]
fn a_yaml_bomb_is_refused_quickly() {
    let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
    for i in 1..12 {
        text.push_str(&format!(
            "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n",
            p = i - 1
        ));
    }
    let started = std::time::Instant::now();
    let e = one_error(&text);
    assert!(e.starts_with("(yaml): "), "{e}");
    // The message says what is wrong in the file's terms.
    assert!(e.contains("aliases") && e.contains("billion laughs"), "{e}");
    // Bounded work: refused long before expanding 10^12 nodes.
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
}

#[test]
fn substitution_cannot_multiply_the_file_past_the_bound() {
    // 64 references to a 1 MiB variable: a 1 KiB file that would parse as
    // 64 MiB of text.
    let big = "x".repeat(1 << 20);
    let env = |name: &str| (name == "BIG").then(|| big.clone());
    let text = format!("origins: {{}}\n{}", "# ${BIG}\n".repeat(64));
    let interpolated = interpolate_report(&text, &env);
    assert!(interpolated.oversized);
    assert!(interpolated.text.len() as u64 <= MAX_CONFIG_BYTES);
    let problems = parse_interpolated_config(&interpolated).unwrap_err();
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0]
            .message
            .starts_with("larger than 16 MiB once ${VAR} references are substituted"),
        "{}",
        problems[0].message
    );
    // Under the bound, substitution works as before.
    let text = format!("origins: {{}}\n{}", "# ${BIG}\n".repeat(8));
    let interpolated = interpolate_report(&text, &env);
    assert!(!interpolated.oversized);
    assert!(parse_interpolated_config(&interpolated).is_ok());
}

#[test]
fn many_unresolved_references_are_located_in_one_pass() {
    // A 1 MiB ConfigMap of unset references: each is located from the
    // previous one. (Locating each from the start of the file took over
    // two minutes here; the bound below only catches such a hang.)
    let lines = 80_000;
    let text = format!("origins: {{}}\n{}", "# é ${UNSET_X}\n".repeat(lines));
    let started = std::time::Instant::now();
    let interpolated = interpolate_report(&text, &|_| None);
    assert!(started.elapsed() < std::time::Duration::from_secs(30));
    assert_eq!(interpolated.unresolved.len(), lines);
    let last = interpolated.unresolved.last().unwrap();
    assert_eq!((last.line, last.column), (lines + 1, 5));
    let first = &interpolated.unresolved[0];
    assert_eq!((first.line, first.column), (2, 5));
}

#[test]
fn syntax_errors_carry_line_and_column() {
    let e = one_error("proxy:\n  admin:\n    port: 1\n   bad: [\n");
    assert!(e.starts_with("(yaml): "), "{e}");
    assert!(e.contains("line 4"), "{e}");
    let e = one_error("a: 1\na: 2\n");
    assert_eq!(
        e,
        "(yaml): duplicate entry with key \"a\" at line 1 column 1"
    );
    let e = one_error("a: 1\n---\nb: 2\n");
    assert!(e.contains("more than one document"), "{e}");
    let e = one_error("a: *nope\n");
    assert!(e.contains("unknown anchor at line 1 column 4"), "{e}");
}

#[test]
fn storage_backends() {
    assert_eq!(
        one_error(&acme("    storage_backend: sqlite\n")),
        "proxy.extensions.sbmesh.acme.storage_backend: unsupported backend \"sqlite\"; supported: redis, s3, gcs, azure, file, redb, memory"
    );
    assert!(
        one_error(&acme("    storage_backend: Redis\n")).contains("unsupported backend \"Redis\"")
    );
    for name in ["redis", "s3", "gcs", "azure", "file", "redb", "memory"] {
        let cfg = parse_config(&acme(&format!("    storage_backend: {name}\n"))).unwrap();
        assert_eq!(
            cfg.sbmesh()
                .acme
                .as_ref()
                .unwrap()
                .storage_backend
                .map(StorageBackend::as_str),
            Some(name)
        );
    }
}

#[test]
fn storage_paths_per_backend() {
    let good = [
        ("redis", "redis://redis:6379/0"),
        ("redis", "rediss://user:pw@redis.example.com:6380"),
        ("redis", "redis.default.svc:6379"),
        ("redis", "10.0.0.1:6379"),
        ("s3", "s3://bucket/prefix"),
        ("s3", "s3://bucket"),
        ("gcs", "gs://bucket/prefix"),
        ("azure", "az://container/prefix"),
        ("file", "/var/lib/sbproxy/store"),
        ("file", "relative/dir"),
        ("redb", "/var/lib/sbproxy/sidecar"),
        ("memory", "anything at all"),
    ];
    for (backend, path) in good {
        let text = acme(&format!(
            "    enabled: true\n    storage_backend: {backend}\n    storage_path: \"{path}\"\n"
        ));
        assert!(
            parse_config(&text).is_ok(),
            "{backend} {path}: {:?}",
            parse_config(&text)
        );
    }
    let bad = [
        (
            "redis",
            "http://redis:6379",
            "redis://host:port/db, rediss://host:port/db, or host:port",
        ),
        ("redis", "redis", "redis://host:port/db"),
        ("redis", "redis://", "redis://host:port/db"),
        ("redis", "redis:0", "host:port"),
        ("s3", "bucket/prefix", "s3://bucket/prefix"),
        ("s3", "s3://", "s3://bucket/prefix"),
        ("s3", "gs://bucket", "s3://bucket/prefix"),
        ("gcs", "s3://bucket", "gs://bucket/prefix"),
        ("azure", "azure://c/p", "az://container/prefix"),
        ("azure", "az:///p", "az://container/prefix"),
        ("file", "s3://bucket", "a directory"),
        ("redb", "redis://x:1", "a directory"),
    ];
    for (backend, path, expected) in bad {
        let text = acme(&format!(
            "    storage_backend: {backend}\n    storage_path: \"{path}\"\n"
        ));
        let e = one_error(&text);
        assert!(
            e.starts_with(&format!(
                "proxy.extensions.sbmesh.acme.storage_path: \"{path}\" is not a {backend} location; expected "
            )),
            "{e}"
        );
        assert!(e.contains(expected), "{e}");
    }
}

#[test]
fn storage_path_required_when_enabled() {
    for backend in ["redis", "s3", "gcs", "azure", "file", "redb"] {
        let e = one_error(&acme(&format!(
            "    enabled: true\n    storage_backend: {backend}\n"
        )));
        let form = StorageBackend::from_name(backend).unwrap().path_form();
        assert_eq!(
            e,
            format!(
                "proxy.extensions.sbmesh.acme.storage_path: required for storage_backend \"{backend}\"; expected {form}"
            )
        );
        // disabled: not needed yet
        assert!(parse_config(&acme(&format!("    storage_backend: {backend}\n"))).is_ok());
    }
    assert!(parse_config(&acme("    enabled: true\n    storage_backend: memory\n")).is_ok());
}

#[test]
fn acme_field_checks() {
    assert_eq!(
        one_error(&acme("    email: ops\n")),
        "proxy.extensions.sbmesh.acme.email: \"ops\" is not an email address; expected one such as ops@example.com"
    );
    assert!(errors(&acme("    email: a b@example.com\n")).len() == 1);
    assert!(parse_config(&acme("    email: mailto:ops@example.com\n")).is_ok());
    assert_eq!(
        one_error(&acme("    directory_url: acme.example.com/dir\n")),
        "proxy.extensions.sbmesh.acme.directory_url: \"acme.example.com/dir\" is not an http(s) URL; expected the CA's ACME directory, such as https://acme-v02.api.letsencrypt.org/directory"
    );
    assert!(parse_config(&acme("    directory_url: https://pebble:14000/dir\n")).is_ok());
    assert_eq!(
        errors(&acme("    eab: {}\n")),
        [
            "proxy.extensions.sbmesh.acme.eab.kid: required: the key identifier the CA gave for external account binding",
            "proxy.extensions.sbmesh.acme.eab.hmac_key: required: the base64url-encoded HMAC key the CA gave with the key id",
        ]
    );
    assert_eq!(
        one_error(&acme("    eab: { kid: k, hmac_key: \"not base64!\" }\n")),
        "proxy.extensions.sbmesh.acme.eab.hmac_key: not base64url; expected the base64url-encoded HMAC key the CA gave with the key id"
    );
    assert!(parse_config(&acme("    eab: { kid: k, hmac_key: \"aGk-_w==\" }\n")).is_ok());
}

#[test]
fn problem_display_and_constructors() {
    let p = Problem::error("a.b", "broken");
    assert_eq!(p.to_string(), "a.b: broken");
    assert!(p.is_error());
    let w = Problem::warning("c", "look");
    assert_eq!(w.to_string(), "c: look");
    assert!(!w.is_error());
}

#[test]
fn secrets_are_redacted_in_debug() {
    let text = format!(
        "proxy:\n  admin: {{ username: u, password: pw-secret }}\n  extensions:\n    sbmesh:\n      shared_key: \"{K1}\"\n      acme:\n        eab: {{ kid: k, hmac_key: aGstc2VjcmV0 }}\n"
    );
    let debug = format!("{:?}", parse_config(&text).unwrap());
    assert!(!debug.contains("pw-secret"), "{debug}");
    assert!(!debug.contains(K1), "{debug}");
    assert!(!debug.contains("aGstc2VjcmV0"), "{debug}");
    assert!(debug.contains("<redacted>"));
    let debug = format!(
        "{:?}",
        parse_config("proxy:\n  extensions:\n    sbmesh: { shared_key: \"env:KEY\" }\n").unwrap()
    );
    assert!(debug.contains("Env(\"KEY\")"), "{debug}");
}

#[test]
fn serializes_to_json_and_back() {
    let cfg = parse_config(FULL).unwrap();
    let json = serde_json::to_string(&cfg).unwrap();
    let back: SbConfig = serde_json::from_str(&json).unwrap();
    assert_eq!(back, cfg);
    let defaults: SbConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(defaults, SbConfig::default());
}

#[test]
fn storage_backend_properties() {
    assert!(StorageBackend::File.is_shared());
    assert!(!StorageBackend::Redb.is_shared());
    assert!(!StorageBackend::Memory.needs_path());
    assert_eq!(StorageBackend::Gcs.to_string(), "gcs");
    assert_eq!(StorageBackend::from_name("sqlite"), None);
}

/// A file in its own temporary directory, removed on drop.
struct TempFile {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

impl TempFile {
    fn new(contents: &[u8]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sb.yml");
        std::fs::write(&path, contents).unwrap();
        TempFile { _dir: dir, path }
    }
}

#[test]
fn load_interpolates_and_hashes_the_raw_file() {
    let raw = b"proxy:\n  extensions:\n    sbmesh:\n      node_id: ${POD}\n      gossip_port: ${PORT:-7001}\n";
    let file = TempFile::new(raw);
    let env = |name: &str| (name == "POD").then(|| "demo-proxy-3".to_string());
    let loaded = load_config(&file.path, &env).unwrap();
    let s = loaded.config.sbmesh();
    assert_eq!(s.node_id.as_deref(), Some("demo-proxy-3"));
    assert_eq!(s.gossip_port, Some(7001));
    assert_eq!(loaded.raw, raw);
    assert_eq!(loaded.sha256_hex_of_raw_file, sha256_hex(raw));
    // a well-known vector
    assert_eq!(
        sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}

#[test]
fn load_reports_read_errors_with_the_file_path() {
    let problems = load_config(Path::new("/nonexistent/sb.yml"), &|_| None).unwrap_err();
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].path, "/nonexistent/sb.yml");
    assert!(
        problems[0].message.starts_with("cannot read: "),
        "{}",
        problems[0].message
    );
}

#[test]
fn load_reports_bad_encoding() {
    let file = TempFile::new(b"a: \xff\xfe\n");
    let problems = load_config(&file.path, &|_| None).unwrap_err();
    assert_eq!(problems[0].path, "(file)");
    assert!(problems[0].message.contains("UTF-8"));
}

#[test]
fn load_refuses_a_file_larger_than_the_bound() {
    let mut big = b"origins:\n".to_vec();
    while big.len() as u64 <= MAX_CONFIG_BYTES {
        big.extend_from_slice(
            b"  # padding padding padding padding padding padding padding padding\n",
        );
    }
    let file = TempFile::new(&big);
    let problems = load_config(&file.path, &|_| None).unwrap_err();
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0].message.starts_with("larger than 16 MiB"),
        "{}",
        problems[0].message
    );
}

proptest! {
    #[test]
    fn parse_never_panics(text in "\\PC*") {
        let _ = parse_config(&text);
    }

    #[test]
    fn parse_never_panics_on_yamlish_text(
        text in "(proxy:\n  (admin|cluster|acme|extensions|sbmesh|eab):\n    [a-z_]{1,12}: [\\[\\]{}a-z0-9:\"'*&!-]{0,10}\n){0,6}"
    ) {
        let _ = parse_config(&text);
    }

    #[test]
    fn interpolate_never_panics(text in "[$\\{\\}:\\-a-zA-Z_0-9\n é]{0,40}") {
        let env = |name: &str| name.len().is_multiple_of(2).then(|| "v".to_string());
        let _ = interpolate(&text, &env);
    }

    #[test]
    fn text_without_dollar_is_unchanged(text in "[^$]{0,200}") {
        prop_assert_eq!(interpolate(&text, &|_| Some("x".to_string())), text);
    }
}

#[test]
fn tls_on_without_a_tls_port_is_a_warning_naming_the_port() {
    // sbproxy 1.13's own ACME, or a certificate file, without
    // proxy.https_bind_port: the proxy exits at start-up.
    let acme = "proxy:\n  acme: { enabled: true, storage_backend: redis, storage_path: r:6379 }\n";
    let w = problems(acme);
    assert!(
        w.iter().any(|l| l.starts_with("proxy.acme.enabled: ")
            && l.contains("https_bind_port must be set to use TLS")
            && l.contains("set proxy.https_bind_port")),
        "{w:?}"
    );
    let file = "proxy:\n  tls_cert_file: /c.crt\n  tls_key_file: /c.key\n";
    let w = problems(file);
    assert!(
        w.iter().any(|l| l.starts_with("proxy.tls_cert_file: ")),
        "{w:?}"
    );
    // With the port, or with neither, nothing is said.
    for text in [
        acme.replace("proxy:\n", "proxy:\n  https_bind_port: 8443\n"),
        file.replace("proxy:\n", "proxy:\n  https_bind_port: 8443\n"),
        "proxy:\n  acme: { enabled: false }\n".to_owned(),
    ] {
        let w = problems(&text);
        assert!(
            !w.iter().any(|l| l.contains("https_bind_port")),
            "{text}: {w:?}"
        );
    }
}

const DNS01_RFC2136: &str = "enabled: true\nstorage_backend: memory\nchallenge: dns-01\n\
    dns01:\n  provider: rfc2136\n  nameserver: \"10.0.0.53\"\n  tsig_key_name: sbmesh-acme.\n  \
    tsig_secret: \"env:SBMESH_TSIG_SECRET\"\n";

#[test]
fn dns01_orders_wildcards_and_reads_its_provider() {
    let text = format!(
        "{}origins:\n  \"*.Example.com\": {{}}\n  example.com: {{}}\n",
        acme(&format!("{DNS01_RFC2136}certificates: san\n"))
    );
    let cfg = parse_config(&text).unwrap();
    assert!(cfg.warnings().is_empty(), "{:?}", cfg.warnings());
    assert_eq!(cfg.challenge(), Challenge::Dns01);
    assert_eq!(
        cfg.acme_hostnames(),
        (
            vec!["*.example.com".to_owned(), "example.com".to_owned()],
            vec![]
        )
    );
    let dns = cfg.acme().unwrap().dns01.as_ref().unwrap();
    assert_eq!(dns.provider, DnsProvider::Rfc2136);
    assert_eq!(dns.nameserver.as_deref(), Some("10.0.0.53"));
    assert_eq!(dns.tsig_algorithm, TsigAlgorithm::HmacSha256);
    assert_eq!(dns.propagation_timeout, DEFAULT_DNS_PROPAGATION_TIMEOUT);
    // The secret as written, never printed.
    let literal = parse_config(&acme(
        &DNS01_RFC2136.replace("env:SBMESH_TSIG_SECRET", "c2VjcmV0LXNlY3JldA=="),
    ))
    .unwrap();
    let debug = format!("{:?}", literal.acme().unwrap().dns01);
    assert!(
        !debug.contains("c2VjcmV0") && debug.contains("<redacted>"),
        "{debug}"
    );
}

#[test]
fn dns01_problems_name_the_key_and_what_is_accepted() {
    let cases: &[(&str, &str, &str)] = &[
        // (acme body, path, words of the message)
        (
            "enabled: true\nchallenge: dns-02\n",
            "acme.challenge",
            "expected http-01",
        ),
        (
            "enabled: true\nchallenge: dns-01\n",
            "acme.dns01",
            "required with challenge: dns-01",
        ),
        (
            "enabled: true\ndns01: { provider: exec, command: /bin/true }\n",
            "acme.dns01",
            "challenge is http-01",
        ),
        (
            "enabled: true\nchallenge: dns-01\ndns01: { provider: bind }\n",
            "acme.dns01.provider",
            "rfc2136, route53, exec",
        ),
        (
            "enabled: true\nchallenge: dns-01\ndns01: { provider: exec, command: /x, nameservr: a }\n",
            "acme.dns01.nameservr",
            "(did you mean nameserver?)",
        ),
        (
            "enabled: true\nchallenge: dns-01\ndns01: { provider: exec, command: /x, region: eu-west-1 }\n",
            "acme.dns01.region",
            "belongs to provider route53, not exec",
        ),
        (
            "enabled: true\nchallenge: dns-01\ndns01: { provider: exec, command: hook.sh }\n",
            "acme.dns01.command",
            "not an absolute path",
        ),
        (
            "enabled: true\nchallenge: dns-01\ndns01: { provider: rfc2136 }\n",
            "acme.dns01.nameserver",
            "required with provider rfc2136",
        ),
        (
            "enabled: true\nchallenge: dns-01\ndns01: { provider: rfc2136, nameserver: \"ns:99999\" }\n",
            "acme.dns01.nameserver",
            "host or host:port",
        ),
        (
            "enabled: true\nchallenge: dns-01\ndns01: { provider: rfc2136, nameserver: ns1.example.com, tsig_algorithm: hmac-sha1 }\n",
            "acme.dns01.tsig_algorithm",
            "hmac-sha256 (the default), hmac-sha512, or hmac-md5",
        ),
        (
            "enabled: true\nchallenge: dns-01\ndns01: { provider: rfc2136, nameserver: ns1.example.com, tsig_key_name: k. }\n",
            "acme.dns01.tsig_secret",
            "required with tsig_key_name",
        ),
        (
            "enabled: true\nchallenge: dns-01\ndns01: { provider: rfc2136, nameserver: ns1.example.com, tsig_key_name: k., tsig_secret: \"not base64!\" }\n",
            "acme.dns01.tsig_secret",
            "not base64",
        ),
        (
            "enabled: true\nchallenge: dns-01\ndns01: { provider: exec, command: /x, propagation_timeout: 2h }\n",
            "acme.dns01.propagation_timeout",
            "from 1s to 3600s",
        ),
    ];
    for (body, path, says) in cases {
        let problems = errors(&acme(body));
        let path = format!("proxy.extensions.sbmesh.{path}: ");
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with(&path) && p.contains(says)),
            "{body:?}: want {path}... {says:?}, got {problems:?}"
        );
    }
    // A wildcard that is not one whole first label, under dns-01.
    let text = format!(
        "{}origins:\n  \"a.*.example.com\": {{}}\n",
        acme(DNS01_RFC2136)
    );
    let problems = errors(&text);
    assert!(
        problems.iter().any(|p| p.contains("whole first label")),
        "{problems:?}"
    );
    // Durations: seconds, s, m, h.
    for (written, secs) in [("90", 90), ("45s", 45), ("2m", 120), ("1h", 3600)] {
        let cfg = parse_config(&acme(&format!(
            "enabled: true\nchallenge: dns-01\ndns01: {{ provider: exec, command: /x, propagation_timeout: {written} }}\n"
        )))
        .unwrap();
        assert_eq!(
            cfg.acme()
                .unwrap()
                .dns01
                .as_ref()
                .unwrap()
                .propagation_timeout,
            std::time::Duration::from_secs(secs),
            "{written}"
        );
    }
}
