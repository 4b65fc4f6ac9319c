//! Pods on one machine, for the tests and benchmarks that run the sidecar
//! beside the real sbproxy (`SBMESH_TEST_SBPROXY`): each pod is `unshare
//! --pid --fork --kill-child --mount-proc` running the sidecar and, in a
//! loop that plays the kubelet's restarts, the proxy, both on the pod's
//! 127.0.x.y address (the proxy's `proxy.bind_address`), so the sidecar
//! finds exactly its own proxy in `/proc`. Needs root.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use serde_json::Value;

use super::acme::Pebble;
use super::{ORIGIN, deadline, poll_until, sidecar_bin};

pub const KEY: &str = "5a1d2c3b4a59687766554433221100ffeeddccbbaa99887766554433221100aa";
pub const HTTP_PORT: u16 = 8080;
pub const HTTPS_PORT: u16 = 8443;
pub const PROXY_ADMIN_PORT: u16 = 9090;
pub const SIDECAR_ADMIN_PORT: u16 = 9091;

pub fn standin_bin() -> PathBuf {
    let bin = sidecar_bin().with_file_name("sbproxy");
    assert!(
        bin.exists(),
        "{} is missing: build the stand-in proxy with `cargo build -p sbmesh-standin`",
        bin.display()
    );
    bin
}

/// How long the proxy drains on SIGTERM in these pods: sbproxy exits
/// after twice this, rounded up to whole seconds (its grace period, then
/// as long again for its runtimes), and closes its listeners at once.
pub const PROXY_GRACE_MS: u64 = 1000;

/// The lines of a `proxy:` block that put the proxy's listeners on the
/// pod's address and its admin API (reload, health) beside them.
pub fn proxy_listeners() -> String {
    format!(
        "  bind_address: \"${{POD_IP}}\"\n  http_bind_port: {HTTP_PORT}\n  \
         https_bind_port: {HTTPS_PORT}\n  \
         admin: {{ enabled: true, bind: \"${{POD_IP}}\", port: {PROXY_ADMIN_PORT} }}\n"
    )
}

/// One pod: `unshare --pid --fork --kill-child --mount-proc` running the
/// sidecar and, in a loop playing the kubelet's restarts, `proxy` (the
/// real sbproxy).
pub struct Pod {
    pub name: String,
    pub ip: Ipv4Addr,
    pub dir: PathBuf,
    child: Child,
}

impl Pod {
    pub fn spawn(
        proxy: &Path,
        name: &str,
        ip: Ipv4Addr,
        base: &Path,
        config: &Path,
        args: &[String],
    ) -> Pod {
        Self::spawn_as(proxy, name, ip, base, config, args, false)
    }

    /// [`Pod::spawn`], with the operator's startup probe when
    /// `startup_probe`: the proxy starts once the sidecar's `/startupz` (on
    /// `ip`'s admin port) answers 200, as the kubelet starts a pod's
    /// containers after its native sidecar's startup probe passes.
    pub fn spawn_as(
        proxy: &Path,
        name: &str,
        ip: Ipv4Addr,
        base: &Path,
        config: &Path,
        args: &[String],
        startup_probe: bool,
    ) -> Pod {
        let dir = base.join(name);
        // The kubelet's startup probe: a GET every 200 ms until 200.
        let probe = if startup_probe {
            format!(
                "until (exec 3<>/dev/tcp/{ip}/{SIDECAR_ADMIN_PORT} && \
                 printf 'GET /startupz HTTP/1.0\\r\\n\\r\\n' >&3 && head -1 <&3 | grep -q ' 200 ') 2>/dev/null; \
                 do sleep 0.2; done\n\
                 echo \"startup probe passed\" >> '{dir}/proxy.log'\n",
                dir = dir.display()
            )
        } else {
            String::new()
        };
        std::fs::create_dir_all(dir.join("certs")).unwrap();
        let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
        let script = format!(
            "#!/bin/bash\n\
             export POD_IP={ip} CERT_DIR='{certs}' SBPROXY_SHUTDOWN_GRACE_MS={PROXY_GRACE_MS} NO_COLOR=1\n\
             '{sidecar}' run --config '{config}' {args} >> '{dir}/sidecar.log' 2>&1 &\n\
             {probe}\
             while true; do\n\
               '{proxy}' -f '{config}' >> '{dir}/proxy.log' 2>&1\n\
               echo \"proxy exited: $?\" >> '{dir}/proxy.log'\n\
               sleep 0.2\n\
             done\n",
            certs = dir.join("certs").display(),
            sidecar = sidecar_bin().display(),
            proxy = proxy.display(),
            config = config.display(),
            args = quoted.join(" "),
            dir = dir.display(),
        );
        let script_path = dir.join("pod.sh");
        std::fs::write(&script_path, script).unwrap();
        let child = Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "--mount-proc", "bash"])
            .arg(&script_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("unshare runs (needs root)");
        Pod {
            name: name.to_owned(),
            ip,
            dir,
            child,
        }
    }

    /// One pod `pod-i` on each of `ips`, its sidecar run with `args(i)`.
    pub fn fleet(
        proxy: &Path,
        ips: &[Ipv4Addr],
        base: &Path,
        config: &Path,
        args: impl Fn(usize) -> Vec<String>,
    ) -> Vec<Pod> {
        ips.iter()
            .enumerate()
            .map(|(i, ip)| Pod::spawn(proxy, &format!("pod-{i}"), *ip, base, config, &args(i)))
            .collect()
    }

    /// The proxy's data port answers `/health`.
    pub fn proxy_up(&self) -> bool {
        http_get(SocketAddr::from((self.ip, HTTP_PORT)), "/health", None)
            .is_some_and(|(status, _)| status == 200)
    }

    pub fn status(&self) -> Option<Value> {
        let (status, body) = http_get(
            SocketAddr::from((self.ip, SIDECAR_ADMIN_PORT)),
            "/admin/cluster/status",
            Some("YWRtaW46Y2hhbmdlbWU="), // admin:changeme, the proxy's defaults
        )?;
        (status == 200).then(|| serde_json::from_str(&body).ok())?
    }

    /// This node's own entry in its status.
    pub fn own_entry(&self) -> Option<Value> {
        let status = self.status()?;
        status["nodes"]
            .as_array()?
            .iter()
            .find(|n| n["local"] == true)
            .cloned()
    }

    /// The real (not placeholder) SAN certificate this node wrote: serial and names.
    pub fn written(&self) -> Option<(String, BTreeSet<String>)> {
        let me = self.own_entry()?;
        let cert = me["certificates"]
            .as_array()?
            .iter()
            .find(|c| c["placeholder"] != true)?
            .clone();
        let names = cert["names"]
            .as_array()?
            .iter()
            .filter_map(|n| n.as_str().map(str::to_owned))
            .collect();
        Some((cert["serial"].as_str()?.to_owned(), names))
    }

    pub fn restarts(&self) -> Option<u64> {
        self.own_entry()?["proxy"]["restarts"].as_u64()
    }

    /// The serial of the certificate the proxy serves for `host`, verified
    /// against `roots` for that name.
    pub fn served_serial(&self, host: &str, roots: &Arc<RootCertStore>) -> Result<String, String> {
        let client = ClientConfig::builder()
            .with_root_certificates(roots.clone())
            .with_no_client_auth();
        self.served_serial_with(host, client)
    }

    /// The serial of the certificate the proxy serves for `host`, whoever
    /// issued it.
    pub fn served_serial_unverified(&self, host: &str) -> Result<String, String> {
        let client = ClientConfig::builder()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate))
            .with_no_client_auth();
        self.served_serial_with(host, client)
    }

    pub fn served_serial_with(&self, host: &str, client: ClientConfig) -> Result<String, String> {
        let name = ServerName::try_from(host.to_owned()).map_err(|e| e.to_string())?;
        let conn = ClientConnection::new(Arc::new(client), name).map_err(|e| e.to_string())?;
        let tcp = TcpStream::connect_timeout(
            &SocketAddr::from((self.ip, HTTPS_PORT)),
            Duration::from_secs(2),
        )
        .map_err(|e| e.to_string())?;
        tcp.set_read_timeout(Some(Duration::from_secs(5))).ok();
        let mut tls = StreamOwned::new(conn, tcp);
        tls.write_all(
            format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .map_err(|e| format!("handshake or write: {e}"))?;
        let mut reply = Vec::new();
        let _ = tls.read_to_end(&mut reply);
        let leaf = tls
            .conn
            .peer_certificates()
            .and_then(|c| c.first())
            .ok_or("no peer certificate")?;
        let pem = pem_of(leaf);
        sbmesh::internal::certs::parse_chain(&pem)
            .map(|f| f.serial)
            .map_err(|e| e.to_string())
    }

    pub fn logs(&self) -> String {
        let tail = |file: &str| {
            let text = std::fs::read_to_string(self.dir.join(file)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(40)..].join("\n")
        };
        format!(
            "--- {} sidecar.log\n{}\n--- {} proxy.log\n{}\n",
            self.name,
            tail("sidecar.log"),
            self.name,
            tail("proxy.log")
        )
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        // --kill-child: the whole PID namespace goes with it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Accepts any server certificate: the watch-tls test compares what is
/// served with what was mounted, and self-signed pairs verify nowhere.
#[derive(Debug)]
pub struct AnyCertificate;

impl rustls::client::danger::ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        rustls::crypto::aws_lc_rs::default_provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

pub fn pem_of(der: &CertificateDer<'_>) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(chunk).unwrap());
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

/// A plain HTTP/1.1 GET; `(status, body)`, `None` when nothing answers.
pub fn http_get(addr: SocketAddr, path: &str, basic: Option<&str>) -> Option<(u16, String)> {
    http_get_host(addr, &addr.to_string(), path, basic)
}

/// [`http_get`] for Host `host`.
pub fn http_get_host(
    addr: SocketAddr,
    host: &str,
    path: &str,
    basic: Option<&str>,
) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(300)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let auth = basic
        .map(|b| format!("Authorization: Basic {b}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let status = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

pub fn san_restart_config(pebble: &Pebble, redis: &str, hosts: &[String]) -> String {
    let mut s = format!(
        "proxy:\n{listeners}  \
         tls_cert_file: ${{CERT_DIR}}/tls.crt\n  tls_key_file: ${{CERT_DIR}}/tls.key\n  \
         extensions:\n    sbmesh:\n      acme:\n        enabled: true\n        \
         email: ops@example.com\n        directory_url: \"{}\"\n        ca_root: \"{}\"\n        \
         storage_backend: redis\n        storage_path: \"{redis}\"\n        \
         certificates: san\n        apply: restart\norigins:\n",
        pebble.directory,
        pebble.ca_root.display(),
        listeners = proxy_listeners(),
    );
    for h in hosts {
        s.push_str(&format!("  \"{h}\": {ORIGIN}\n"));
    }
    s
}

/// Watches every proxy's data port every 20 ms until stopped: the most
/// proxies seen down at once, and each pod's longest outage.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

/// What a [`Sampler`] saw.
#[derive(Clone, Debug, Default)]
pub struct Seen {
    /// The most pods down in one sample, and which.
    pub most_down: (usize, Vec<String>),
    /// Per pod, its longest stretch without an answering proxy.
    pub longest_outage: Vec<(String, Duration)>,
}

impl Sampler {
    pub fn start(targets: Vec<(String, Ipv4Addr)>) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Seen {
            most_down: (0, Vec::new()),
            longest_outage: targets
                .iter()
                .map(|(n, _)| (n.clone(), Duration::ZERO))
                .collect(),
        }));
        let (s, w) = (stop.clone(), seen.clone());
        let handle = std::thread::spawn(move || {
            let mut since: Vec<Option<Instant>> = vec![None; targets.len()];
            while !s.load(Ordering::Relaxed) {
                let now = Instant::now();
                let mut down = Vec::new();
                let mut seen = w.lock().unwrap();
                for (i, (name, ip)) in targets.iter().enumerate() {
                    let up = http_get(SocketAddr::from((*ip, HTTP_PORT)), "/health", None)
                        .is_some_and(|(st, _)| st == 200);
                    if up {
                        since[i] = None;
                    } else {
                        let start = *since[i].get_or_insert(now);
                        let outage = now.duration_since(start);
                        if outage > seen.longest_outage[i].1 {
                            seen.longest_outage[i].1 = outage;
                        }
                        down.push(name.clone());
                    }
                }
                if down.len() > seen.most_down.0 {
                    seen.most_down = (down.len(), down);
                }
                drop(seen);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Sampler {
            stop,
            seen,
            handle: Some(handle),
        }
    }

    /// Stops sampling; what was seen.
    pub fn finish(mut self) -> Seen {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        self.seen.lock().unwrap().clone()
    }
}

/// Waits until every pod's proxy serves, for every host, the certificate
/// whose names are exactly `hosts` and which every node's status lists;
/// returns its serial.
pub fn wait_served(pods: &[Pod], hosts: &[String], roots: &Arc<RootCertStore>) -> String {
    let want: BTreeSet<String> = hosts.iter().cloned().collect();
    let mut serial = String::new();
    let ok = poll_until(deadline() * 3, || {
        let written: Vec<_> = pods.iter().map(Pod::written).collect();
        let Some(Some((first, names))) = written.first().cloned() else {
            return false;
        };
        if names != want
            || !written
                .iter()
                .all(|w| w.as_ref().map(|w| &w.0) == Some(&first))
        {
            return false;
        }
        let served = pods.iter().all(|p| {
            hosts
                .iter()
                .all(|h| p.served_serial(h, roots).as_deref() == Ok(first.as_str()))
        });
        if served {
            serial = first;
        }
        served
    });
    if !ok {
        let mut report = String::new();
        for p in pods {
            report.push_str(&format!(
                "{}: written {:?}, served {:?}\n",
                p.name,
                p.written(),
                p.served_serial(&hosts[0], roots)
            ));
            report.push_str(&p.logs());
        }
        panic!("the fleet did not serve the certificate for {hosts:?}:\n{report}");
    }
    serial
}

/// The sidecar flags of pod `i` of a fleet on `ips`: its addresses, the
/// others as seeds, Pebble's challenge port, its own directories under
/// `base`, short lock and restart intervals.
pub fn fleet_args(
    i: usize,
    ips: &[Ipv4Addr],
    cluster_id: &str,
    pebble: &Pebble,
    base: &Path,
) -> Vec<String> {
    let mut args = mesh_args(i, ips, cluster_id, base);
    args.extend([
        "--challenge-listen".to_owned(),
        format!("{}:{}", ips[i], pebble.http_port),
        "--acme-order-lock-ttl-secs".to_owned(),
        "10".to_owned(),
        "--proxy-restart-interval-secs".to_owned(),
        "1".to_owned(),
    ]);
    args
}

/// Pod `i`'s sidecar in a mesh of `ips`: its names, addresses and folders
/// under `base/pod-i`, a 50 ms reload debounce, text logs.
pub fn mesh_args(i: usize, ips: &[Ipv4Addr], cluster_id: &str, base: &Path) -> Vec<String> {
    let ip = ips[i];
    let seeds: Vec<String> = ips.iter().map(|ip| format!("{ip}:7946")).collect();
    vec![
        "--node-id".to_owned(),
        format!("pod-{i}"),
        "--cluster-id".to_owned(),
        cluster_id.to_owned(),
        "--cluster-key".to_owned(),
        KEY.to_owned(),
        "--bind".to_owned(),
        ip.to_string(),
        "--seeds".to_owned(),
        seeds.join(","),
        "--admin-listen".to_owned(),
        format!("{ip}:{SIDECAR_ADMIN_PORT}"),
        "--cert-dir".to_owned(),
        base.join(format!("pod-{i}/certs")).display().to_string(),
        "--state-dir".to_owned(),
        base.join(format!("pod-{i}/state")).display().to_string(),
        "--reload-debounce-ms".to_owned(),
        "50".to_owned(),
        "--log-format".to_owned(),
        "text".to_owned(),
    ]
}
