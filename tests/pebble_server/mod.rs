//! A private Pebble and pebble-challtestsrv for one test.
//!
//! One Pebble shared by the whole suite can deadlock: Pebble 2.4 (and its
//! main branch as of 2026-12) takes an authorization's write lock in its
//! authz handler and then its store's read lock (looking up the account),
//! while a new order takes the store's read lock and then every
//! authorization's read lock (`FindValidAuthorization`); with a third
//! request waiting for the store's write lock (a new account, order or
//! challenge), Go's `RWMutex` admits no new reader and all three wait for
//! ever. Many tests' clients at once against one Pebble meet that sooner or
//! later (a goroutine dump of a wedged Pebble shows exactly these three);
//! a Pebble per test keeps each one's clients apart and its store small.
//!
//! `scripts/test` makes the TLS material of Pebble's listener once and
//! names its folder in `SBMESH_TEST_PEBBLE_DIR`; each test's servers run in
//! a folder of their own inside it, removed when the test passes and kept
//! (with Pebble's goroutines dumped into its log) when it fails.

#![allow(dead_code)]

#[allow(clippy::duplicate_mod)]
#[path = "../required/mod.rs"]
mod required;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The variable `scripts/test` sets to the folder of Pebble's TLS material.
pub const DIR_VAR: &str = "SBMESH_TEST_PEBBLE_DIR";

/// How long the two servers have to listen.
const START: Duration = Duration::from_secs(15);

/// Tries at new ports when a server could not bind (another test's server
/// took a port between our probe and its bind).
const ATTEMPTS: usize = 3;

/// The ports of one Pebble and its pebble-challtestsrv on 127.0.0.1.
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    /// Pebble's ACME listener.
    pub acme: u16,
    /// Pebble's management listener.
    pub mgmt: u16,
    /// Where Pebble sends HTTP-01 validations (nothing of Pebble's listens).
    pub http: u16,
    /// Where Pebble sends TLS-ALPN-01 validations.
    pub tls: u16,
    /// pebble-challtestsrv's DNS, Pebble's resolver.
    pub dns: u16,
    /// pebble-challtestsrv's management listener.
    pub chall: u16,
}

impl Ports {
    /// Ports free when asked (a clash with another test is retried).
    fn free() -> Self {
        let [acme, mgmt, http, tls, dns, chall] = [(); 6].map(|_| free_port());
        Self {
            acme,
            mgmt,
            http,
            tls,
            dns,
            chall,
        }
    }
}

/// Where a Pebble and its pebble-challtestsrv answer, and their logs.
#[derive(Clone, Debug)]
pub struct Endpoints {
    /// `https://127.0.0.1:P/dir`.
    pub directory: String,
    /// The CA of Pebble's own TLS listener.
    pub ca_root: PathBuf,
    /// `https://127.0.0.1:P`: roots, intermediates, certificate status.
    pub management: String,
    /// Where Pebble sends HTTP-01 validations (nothing of Pebble's listens).
    pub http_port: u16,
    /// pebble-challtestsrv's management listener (`/add-a`, `/clear-a`).
    pub challtestsrv: SocketAddr,
    /// Pebble's log ("Issued certificate serial …" lines; its goroutines
    /// when the test failed).
    pub log: PathBuf,
    /// pebble-challtestsrv's log.
    pub challtestsrv_log: PathBuf,
}

/// One test's Pebble (ACME and management listeners) and
/// pebble-challtestsrv (Pebble's DNS, steered over its management port),
/// ended when dropped.
#[derive(Debug)]
pub struct PebbleServer {
    pub endpoints: Endpoints,
    /// The folder, when it is the server's own (removed unless it failed).
    dir: Option<tempfile::TempDir>,
    pebble: Child,
    chall: Child,
}

impl std::ops::Deref for PebbleServer {
    type Target = Endpoints;
    fn deref(&self) -> &Endpoints {
        &self.endpoints
    }
}

/// The running test's name, as its harness names the thread it runs on
/// (`module::test` becomes `module-test`), or a bench's program name, for
/// the servers' folder.
pub fn test_name() -> String {
    match std::thread::current().name() {
        Some(name) if name != "main" => name.replace("::", "-"),
        _ => std::env::current_exe()
            .ok()
            .and_then(|exe| exe.file_stem().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "pebble".to_owned()),
    }
}

/// A free TCP port on 127.0.0.1 (free when asked; a clash is retried).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port on 127.0.0.1")
}

/// The folder `scripts/test` prepared (`SBMESH_TEST_PEBBLE_DIR`); `None`
/// (a SKIP line for `test`) when it is not set, a panic when it is not set
/// but `SBMESH_TEST_REQUIRE_SERVERS=1`.
pub fn base_dir(test: &str) -> Option<PathBuf> {
    match std::env::var(DIR_VAR) {
        Ok(v) if !v.trim().is_empty() => Some(PathBuf::from(v)),
        _ => required::missing(
            test,
            &format!("{DIR_VAR} is not set"),
            "run the suite through scripts/test, which prepares Pebble",
        ),
    }
}

impl PebbleServer {
    /// Starts both servers for `test` on free ports, in a folder of their
    /// own; `None` as [`base_dir`], a panic when they do not start.
    pub fn start(test: &str) -> Option<Self> {
        Self::start_resolving_with(test, None)
    }

    /// [`PebbleServer::start`], with Pebble's lookups (DNS-01 TXT records,
    /// CAA) sent to `dns` (an authoritative server of the test zones)
    /// instead of pebble-challtestsrv.
    pub fn start_resolving_with(test: &str, dns: Option<SocketAddr>) -> Option<Self> {
        let base = base_dir(test)?;
        let mut last = String::new();
        for _ in 0..ATTEMPTS {
            let dir = tempfile::Builder::new()
                .prefix(&format!("{test}-"))
                .tempdir_in(&base)
                .unwrap_or_else(|e| panic!("{test}: a folder in {}: {e}", base.display()));
            match Self::launch(&base, dir.path(), Ports::free(), dns) {
                Ok(mut server) => {
                    server.dir = Some(dir);
                    return Some(server);
                }
                Err(why) => last = why,
            }
        }
        panic!("{test}: Pebble did not start in {ATTEMPTS} attempts; the last: {last}");
    }

    /// Starts both servers on `ports`, with their files in `dir`, which
    /// stays the caller's (the chaos soak's fixed ports in its own network
    /// namespace, its logs kept with the rest of its run).
    pub fn start_in(test: &str, dir: &Path, ports: Ports) -> Result<Self, String> {
        let base = std::env::var(DIR_VAR)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .ok_or_else(|| {
                format!("{test}: {DIR_VAR} is not set (scripts/test prepares Pebble)")
            })?;
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        Self::launch(Path::new(&base), dir, ports, None)
    }

    /// pebble-challtestsrv, then Pebble, with the TLS material of `base`,
    /// until both listen; `Err` with the log of one that exits.
    fn launch(
        base: &Path,
        dir: &Path,
        ports: Ports,
        resolver: Option<SocketAddr>,
    ) -> Result<Self, String> {
        let tls = base.join("tls");
        let config = dir.join("pebble.json");
        let json = serde_json::json!({ "pebble": {
            "listenAddress": format!("127.0.0.1:{}", ports.acme),
            "managementListenAddress": format!("127.0.0.1:{}", ports.mgmt),
            "certificate": tls.join("leaf.pem"),
            "privateKey": tls.join("leaf.key"),
            "httpPort": ports.http,
            "tlsPort": ports.tls,
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false,
        }});
        std::fs::write(&config, json.to_string())
            .map_err(|e| format!("{}: {e}", config.display()))?;
        let ends = Endpoints {
            directory: format!("https://127.0.0.1:{}/dir", ports.acme),
            ca_root: tls.join("ca.pem"),
            management: format!("https://127.0.0.1:{}", ports.mgmt),
            http_port: ports.http,
            challtestsrv: SocketAddr::from(([127, 0, 0, 1], ports.chall)),
            log: dir.join("pebble.log"),
            challtestsrv_log: dir.join("challtestsrv.log"),
        };
        let dns = format!("127.0.0.1:{}", ports.dns);
        let spawn = |cmd: &mut Command, log: &Path, what: &str| {
            let out = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
            let err = out.try_clone().map_err(|e| e.to_string())?;
            cmd.stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .map_err(|e| format!("run {what} (apt-get install -y pebble): {e}"))
        };
        let chall_child = spawn(
            Command::new("pebble-challtestsrv")
                .args(["-defaultIPv4", "127.0.0.1", "-defaultIPv6", ""])
                .args(["-dns01", &dns])
                .args(["-http01", "", "-https01", "", "-tlsalpn01", ""])
                .args(["-management", &format!("127.0.0.1:{}", ports.chall)]),
            &ends.challtestsrv_log,
            "pebble-challtestsrv",
        )?;
        // From here the children are the server's: dropping it ends them.
        let pebble_child = match spawn(
            Command::new("pebble")
                .arg("-config")
                .arg(&config)
                .args([
                    "-dnsserver",
                    &resolver.map_or_else(|| dns.clone(), |r| r.to_string()),
                ])
                // Validations at once, a fresh nonce always accepted, and
                // no authorization reused: every order is validated.
                .env("PEBBLE_VA_NOSLEEP", "1")
                .env("PEBBLE_WFE_NONCEREJECT", "0")
                .env("PEBBLE_AUTHZREUSE", "0"),
            &ends.log,
            "pebble",
        ) {
            Ok(child) => child,
            Err(e) => {
                let mut chall_child = chall_child;
                let _ = chall_child.kill();
                let _ = chall_child.wait();
                return Err(e);
            }
        };
        let mut server = Self {
            endpoints: ends,
            dir: None,
            pebble: pebble_child,
            chall: chall_child,
        };
        server.wait_listening(&[
            (ports.acme, "pebble"),
            (ports.mgmt, "pebble"),
            (ports.chall, "pebble-challtestsrv"),
        ])?;
        Ok(server)
    }

    /// Waits until each `(port, server)` listens; `Err` with the exited
    /// server's log when one of them exits.
    fn wait_listening(&mut self, waits: &[(u16, &str)]) -> Result<(), String> {
        let deadline = Instant::now() + START;
        for &(port, what) in waits {
            while TcpStream::connect(("127.0.0.1", port)).is_err() {
                for (child, log, name) in [
                    (&mut self.pebble, &self.endpoints.log, "pebble"),
                    (
                        &mut self.chall,
                        &self.endpoints.challtestsrv_log,
                        "pebble-challtestsrv",
                    ),
                ] {
                    if let Ok(Some(status)) = child.try_wait() {
                        let text = std::fs::read_to_string(log).unwrap_or_default();
                        return Err(format!("{name} exited at start ({status}): {text}"));
                    }
                }
                if Instant::now() > deadline {
                    return Err(format!(
                        "{what} did not listen on 127.0.0.1:{port} within {START:?} (its log: {})",
                        self.endpoints.log.display()
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Ok(())
    }
}

impl Drop for PebbleServer {
    fn drop(&mut self) {
        let failed = std::thread::panicking();
        if failed {
            // Go prints every goroutine's stack on SIGQUIT, then exits: a
            // wedged Pebble shows what it waits for.
            // SAFETY: kill(2) of our own child's PID, not yet reaped.
            unsafe { libc::kill(self.pebble.id() as libc::pid_t, libc::SIGQUIT) };
            let deadline = Instant::now() + Duration::from_secs(5);
            while matches!(self.pebble.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        for child in [&mut self.pebble, &mut self.chall] {
            let _ = child.kill();
            let _ = child.wait();
        }
        // A folder of the caller's stays; a failed test's own is kept.
        if failed && let Some(dir) = self.dir.take() {
            eprintln!(
                "Pebble's log (its goroutines at the failure at the end) and \
                 pebble-challtestsrv's are kept in {}",
                dir.keep().display()
            );
        }
    }
}
