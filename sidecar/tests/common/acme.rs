//! The ACME CA as the process-level tests reach it: a Pebble and
//! pebble-challtestsrv of the test's own (`Pebble::start`).
//!
//! What a user would check is checked from the outside: the certificates
//! Pebble says it issued (its log, then `/cert-status-by-serial/` on its
//! management port), and a real TLS handshake with each node's
//! `tls.crt`/`tls.key` verified against Pebble's root.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};

use super::http_raw;

#[path = "../../../tests/pebble_server/mod.rs"]
pub mod pebble_server;

use pebble_server::{Endpoints, PebbleServer};

#[path = "../../../tests/dns_server/mod.rs"]
pub mod dns_server;

/// This test's CA: its own Pebble and pebble-challtestsrv (see
/// `pebble_server` for why each test has its own), stopped when the last
/// clone is dropped; its [`Endpoints`] by `Deref`.
#[derive(Clone, Debug)]
pub struct Pebble {
    server: Arc<PebbleServer>,
}

impl std::ops::Deref for Pebble {
    type Target = Endpoints;
    fn deref(&self) -> &Endpoints {
        &self.server.endpoints
    }
}

impl From<PebbleServer> for Pebble {
    fn from(server: PebbleServer) -> Self {
        Pebble {
            server: Arc::new(server),
        }
    }
}

impl Pebble {
    /// Starts this test's CA, or `None` (test skipped) when `scripts/test`
    /// did not prepare Pebble.
    pub fn start() -> Option<Pebble> {
        PebbleServer::start(&pebble_server::test_name()).map(Pebble::from)
    }

    /// [`Pebble::start`], looking names up at `dns` (the BIND of the
    /// DNS-01 tests) instead of pebble-challtestsrv.
    pub fn start_resolving_with(dns: SocketAddr) -> Option<Pebble> {
        PebbleServer::start_resolving_with(&pebble_server::test_name(), Some(dns)).map(Pebble::from)
    }

    /// Makes Pebble resolve `host` to `ip` only (its validations go there).
    pub fn route(&self, host: &str, ip: std::net::Ipv4Addr) {
        // add-a appends to what the name had: clear it first.
        self.challtestsrv_post("/clear-a", &format!(r#"{{"host":"{host}."}}"#));
        self.challtestsrv_post(
            "/add-a",
            &format!(r#"{{"host":"{host}.","addresses":["{ip}"]}}"#),
        );
    }

    fn challtestsrv_post(&self, path: &str, body: &str) {
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.challtestsrv,
            body.len()
        );
        let resp = http_raw(self.challtestsrv, req.as_bytes())
            .unwrap_or_else(|e| panic!("challtestsrv {path}: {e}"));
        assert_eq!(
            resp.status,
            200,
            "challtestsrv {path} {body}: {}",
            resp.text()
        );
    }

    /// GET on the management interface (HTTPS, trusting `ca_root`).
    pub fn management_get(&self, path: &str) -> io::Result<(u16, String)> {
        let addr: SocketAddr = self
            .management
            .trim_start_matches("https://")
            .trim_end_matches('/')
            .parse()
            .map_err(|_| io::Error::other("management URL is https://ip:port"))?;
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca_root)
            .map_err(|e| io::Error::other(format!("{}: {e}", self.ca_root.display())))?
        {
            roots
                .add(cert.map_err(|e| io::Error::other(e.to_string()))?)
                .map_err(|e| io::Error::other(e.to_string()))?;
        }
        let config = ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = ServerName::IpAddress(addr.ip().into());
        let conn = ClientConnection::new(Arc::new(config), name)
            .map_err(|e| io::Error::other(e.to_string()))?;
        let sock = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        sock.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut tls = rustls::StreamOwned::new(conn, sock);
        write!(
            tls,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        let mut raw = Vec::new();
        match tls.read_to_end(&mut raw) {
            Ok(_) => {}
            // Pebble closes without close_notify.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof && !raw.is_empty() => {}
            Err(e) => return Err(e),
        }
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)
        } else {
            body.to_owned()
        };
        Ok((status, body))
    }

    /// Pebble's root certificate (PEM), which every chain must verify against.
    pub fn root_pem(&self) -> String {
        let (status, body) = self.management_get("/roots/0").expect("GET /roots/0");
        assert_eq!(status, 200, "GET /roots/0: {body}");
        body
    }

    /// How many certificates Pebble issued for each of `hosts`, counted at
    /// the CA: every serial in its log, resolved to its certificate.
    pub fn issued_counts(
        &self,
        hosts: &[String],
        cache: &mut SerialCache,
    ) -> BTreeMap<String, usize> {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        for line in log.lines() {
            let Some(rest) = line.split("Issued certificate serial ").nth(1) else {
                continue;
            };
            let serial = rest.split_whitespace().next().unwrap_or("").to_owned();
            if serial.is_empty() || cache.names.contains_key(&serial) {
                continue;
            }
            let (status, body) = self
                .management_get(&format!("/cert-status-by-serial/{serial}"))
                .expect("GET /cert-status-by-serial");
            let names = if status == 200 {
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let pem = v["Certificate"].as_str().unwrap_or("");
                sbmesh::internal::certs::parse_chain(pem)
                    .map(|f| f.dns_names)
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            cache.names.insert(serial, names);
        }
        let mut counts: BTreeMap<String, usize> = hosts.iter().map(|h| (h.clone(), 0)).collect();
        for names in cache.names.values() {
            for name in names {
                if let Some(c) = counts.get_mut(name) {
                    *c += 1;
                }
            }
        }
        counts
    }
}

/// Serials already resolved to their names (Pebble's log only grows).
#[derive(Default)]
pub struct SerialCache {
    names: HashMap<String, Vec<String>>,
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

/// Does what a TLS client of the proxy would do with the files a node
/// wrote for `host`: a handshake against a server presenting
/// `tls.crt`/`tls.key`, verified against `root_pem` for the name `host`.
/// `Err` says what failed.
pub fn handshake_ok(cert_dir: &Path, host: &str, root_pem: &str) -> Result<(), String> {
    handshake_with(&cert_dir.join(host), host, root_pem)
}

/// [`handshake_ok`] with the files in `dir` and the client asking for
/// `sni` (a name a SAN or wildcard certificate covers).
pub fn handshake_with(dir: &Path, sni: &str, root_pem: &str) -> Result<(), String> {
    let host = sni;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("tls.crt"))
        .map_err(|e| format!("tls.crt: {e}"))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("tls.crt: {e}"))?;
    let key =
        PrivateKeyDer::from_pem_file(dir.join("tls.key")).map_err(|e| format!("tls.key: {e}"))?;
    let server = ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("server config: {e}"))?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(root_pem.as_bytes()) {
        roots
            .add(cert.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let client = ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let name = ServerName::try_from(host.to_owned()).map_err(|e| e.to_string())?;
    let mut c = ClientConnection::new(Arc::new(client), name).map_err(|e| e.to_string())?;
    let mut s = ServerConnection::new(Arc::new(server)).map_err(|e| e.to_string())?;
    for _ in 0..20 {
        if !c.is_handshaking() && !s.is_handshaking() {
            return Ok(());
        }
        let mut buf = Vec::new();
        while c.wants_write() {
            c.write_tls(&mut buf).map_err(|e| e.to_string())?;
        }
        let mut rd: &[u8] = &buf;
        while !rd.is_empty() {
            s.read_tls(&mut rd).map_err(|e| e.to_string())?;
        }
        s.process_new_packets()
            .map_err(|e| format!("server: {e}"))?;
        let mut buf = Vec::new();
        while s.wants_write() {
            s.write_tls(&mut buf).map_err(|e| e.to_string())?;
        }
        let mut rd: &[u8] = &buf;
        while !rd.is_empty() {
            c.read_tls(&mut rd).map_err(|e| e.to_string())?;
        }
        c.process_new_packets()
            .map_err(|e| format!("client (verifying against Pebble's root): {e}"))?;
    }
    Err("handshake did not finish".to_owned())
}

/// The node ids of a three-replica fleet.
pub const TRIO: [&str; 3] = ["node-1", "node-2", "node-3"];

/// Spawns `node-1..3` of `cluster` on `ips`, seeded with each other, each
/// with the flags `args` gives for its address.
pub fn spawn_trio(
    cluster: &mut super::Cluster,
    ips: [std::net::Ipv4Addr; 3],
    args: impl Fn(std::net::Ipv4Addr) -> Vec<String>,
) {
    let seeds: Vec<_> = ips
        .iter()
        .map(|ip| SocketAddr::from((*ip, super::GOSSIP_PORT)))
        .collect();
    for (i, ip) in ips.iter().enumerate() {
        let opts = super::NodeOpts {
            node_id: TRIO[i].to_owned(),
            ip: *ip,
            cluster_id: cluster.cluster_id.clone(),
            key: super::KeySource::Hex(cluster.key.clone()),
            seeds: seeds.clone(),
            extra_args: args(*ip),
        };
        cluster.spawn(opts);
    }
}

/// `count` hostnames no other test (or earlier run) uses, under `<tag>.test`.
pub fn unique_hosts(tag: &str, count: usize) -> Vec<String> {
    unique_names(&format!("{tag}.test"), count)
}

/// `count` names directly under `parent` (a zone of the tests' BIND, say)
/// no other test (or earlier run) uses.
pub fn unique_names(parent: &str, count: usize) -> Vec<String> {
    let run = format!(
        "{:x}{:04x}",
        super::now_unix_ms() % 0xffff_ffff,
        std::process::id() % 0xffff
    );
    (0..count).map(|i| format!("h{i}-{run}.{parent}")).collect()
}

/// The `sb.yml` of an ACME-enabled fleet.
pub fn acme_config(
    pebble: &Pebble,
    backend: &str,
    path: &str,
    hosts: &[String],
    extra_acme: &str,
) -> String {
    let mut s = format!(
        "proxy:\n  admin:\n    enabled: true\n    port: 9090\n  extensions:\n    sbmesh:\n      \
         acme:\n        enabled: true\n        email: ops@example.com\n        directory_url: \"{}\"\n        \
         ca_root: \"{}\"\n        storage_backend: {backend}\n        storage_path: \"{path}\"\n\
         {extra_acme}origins:\n",
        pebble.directory,
        pebble.ca_root.display()
    );
    if hosts.is_empty() {
        s = s.replace("origins:\n", "origins: {}\n");
    }
    for h in hosts {
        s.push_str(&format!("  \"{h}\": {{}}\n"));
    }
    s
}

/// The `acme:` lines of a DNS-01 fleet (after `storage_path`, as
/// [`acme_config`]'s `extra_acme`): `certificates: <mode>`, `dns-01`, and
/// the `dns01` block of `provider_lines` (written at 10 spaces).
pub fn dns01_acme(mode: &str, provider_lines: &str) -> String {
    format!(
        "        certificates: {mode}\n        challenge: dns-01\n        dns01:\n{provider_lines}\
         \x20         propagation_timeout: 30s\n"
    )
}

/// The `dns01` lines of the rfc2136 provider at `bind`, with the key
/// sbmesh-sha256. whose secret is in `secret_file`.
pub fn rfc2136_provider(bind: SocketAddr, secret_file: &Path) -> String {
    format!(
        "          provider: rfc2136\n          nameserver: \"{bind}\"\n          \
         tsig_key_name: sbmesh-sha256.\n          tsig_secret: \"file:{}\"\n",
        secret_file.display()
    )
}

/// Writes the secret of the key sbmesh-sha256. into `dir`, where sidecars
/// read it (`file:`; the harness keeps SBMESH_* variables from them).
pub fn write_tsig_secret(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tsig.secret");
    std::fs::write(&path, format!("{}\n", dns_server::secret("sha256"))).expect("write the secret");
    path
}

/// The CA's certificates a node's status lists for itself (placeholders
/// left out): host -> serial.
pub fn own_certs(status: &serde_json::Value) -> BTreeMap<String, String> {
    status["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|n| n["local"] == true)
        .flat_map(|n| n["certificates"].as_array().cloned().unwrap_or_default())
        // A self-signed placeholder is no certificate from the CA.
        .filter(|c| c["placeholder"] != true)
        .filter_map(|c| {
            Some((
                c["host"].as_str()?.to_owned(),
                c["serial"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// The Redis `scripts/test` started (`SBMESH_TEST_REDIS_URL`). `None`, and
/// the test skips, only when the suite does not require its servers.
pub fn redis_from_env() -> Option<String> {
    std::env::var("SBMESH_TEST_REDIS_URL")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .or_else(|| {
            super::required::missing(
                "redis",
                "SBMESH_TEST_REDIS_URL is not set",
                "scripts/test starts Redis",
            )
        })
}
