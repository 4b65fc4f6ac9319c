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

impl Endpoints {
    /// A Pebble on 127.0.0.1 listening on `acme` (ACME) and `mgmt`
    /// (management), validating HTTP-01 on `http`, with challtestsrv's
    /// management on `chall`; both logs in `dir`.
    pub fn local(
        acme: u16,
        mgmt: u16,
        http: u16,
        chall: u16,
        ca_root: PathBuf,
        dir: &Path,
    ) -> Self {
        Self {
            directory: format!("https://127.0.0.1:{acme}/dir"),
            ca_root,
            management: format!("https://127.0.0.1:{mgmt}"),
            http_port: http,
            challtestsrv: SocketAddr::from(([127, 0, 0, 1], chall)),
            log: dir.join("pebble.log"),
            challtestsrv_log: dir.join("challtestsrv.log"),
        }
    }
}

/// One test's Pebble (ACME and management listeners) and
/// pebble-challtestsrv (Pebble's DNS, steered over its management port),
/// ended when dropped.
#[derive(Debug)]
pub struct PebbleServer {
    pub endpoints: Endpoints,
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

impl PebbleServer {
    /// Starts both servers for `test`; `None` (a SKIP line) when
    /// `SBMESH_TEST_PEBBLE_DIR` is not set, a panic when it is not set but
    /// `SBMESH_TEST_REQUIRE_SERVERS=1`, or when the servers do not start.
    pub fn start(test: &str) -> Option<Self> {
        let base = match std::env::var(DIR_VAR) {
            Ok(v) if !v.trim().is_empty() => PathBuf::from(v),
            _ => {
                assert!(
                    std::env::var("SBMESH_TEST_REQUIRE_SERVERS").as_deref() != Ok("1"),
                    "{test}: {DIR_VAR} is not set but SBMESH_TEST_REQUIRE_SERVERS=1: run the \
                     suite through scripts/test, which prepares Pebble"
                );
                eprintln!("SKIP {test}: {DIR_VAR} is not set (scripts/test prepares Pebble)");
                return None;
            }
        };
        let mut last = String::new();
        for _ in 0..ATTEMPTS {
            match Self::try_start(&base, test) {
                Ok(server) => return Some(server),
                Err(why) => last = why,
            }
        }
        panic!("{test}: Pebble did not start in {ATTEMPTS} attempts; the last: {last}");
    }

    fn try_start(base: &Path, test: &str) -> Result<Self, String> {
        let tls = base.join("tls");
        let dir = tempfile::Builder::new()
            .prefix(&format!("{test}-"))
            .tempdir_in(base)
            .map_err(|e| format!("a folder in {}: {e}", base.display()))?;
        let [acme, mgmt, http, tls_port, dns, chall] = [(); 6].map(|_| free_port());
        let config = dir.path().join("pebble.json");
        let json = serde_json::json!({ "pebble": {
            "listenAddress": format!("127.0.0.1:{acme}"),
            "managementListenAddress": format!("127.0.0.1:{mgmt}"),
            "certificate": tls.join("leaf.pem"),
            "privateKey": tls.join("leaf.key"),
            "httpPort": http,
            "tlsPort": tls_port,
            "ocspResponderURL": "",
            "externalAccountBindingRequired": false,
        }});
        std::fs::write(&config, json.to_string())
            .map_err(|e| format!("{}: {e}", config.display()))?;
        let ends = Endpoints::local(acme, mgmt, http, chall, tls.join("ca.pem"), dir.path());
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
                .args(["-dns01", &format!("127.0.0.1:{dns}")])
                .args(["-http01", "", "-https01", "", "-tlsalpn01", ""])
                .args(["-management", &format!("127.0.0.1:{chall}")]),
            &ends.challtestsrv_log,
            "pebble-challtestsrv",
        )?;
        // From here the children are the server's: dropping it ends them.
        let pebble_child = match spawn(
            Command::new("pebble")
                .arg("-config")
                .arg(&config)
                .args(["-dnsserver", &format!("127.0.0.1:{dns}")])
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
            dir: Some(dir),
            pebble: pebble_child,
            chall: chall_child,
        };
        server.wait_listening(&[acme, mgmt], &[chall])?;
        Ok(server)
    }

    /// Waits until Pebble listens on `pebble` and challtestsrv on `chall`;
    /// `Err` with the exited server's log when one of them exits.
    fn wait_listening(&mut self, pebble: &[u16], chall: &[u16]) -> Result<(), String> {
        let deadline = Instant::now() + START;
        let waits = pebble
            .iter()
            .map(|p| (*p, "pebble"))
            .chain(chall.iter().map(|p| (*p, "pebble-challtestsrv")));
        for (port, what) in waits {
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
            let _ = Command::new("sh")
                .args(["-c", "kill -s QUIT \"$0\""])
                .arg(self.pebble.id().to_string())
                .status();
            let deadline = Instant::now() + Duration::from_secs(5);
            while matches!(self.pebble.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        for child in [&mut self.pebble, &mut self.chall] {
            let _ = child.kill();
            let _ = child.wait();
        }
        if failed && let Some(dir) = self.dir.take() {
            eprintln!(
                "Pebble's log (its goroutines at the failure at the end) and \
                 pebble-challtestsrv's are kept in {}",
                dir.keep().display()
            );
        }
    }
}
