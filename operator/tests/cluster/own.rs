//! Servers of a test's own on the node (`scripts/cluster pebble`, `redis`).
//!
//! A test that counts what the CA did, restarts or pauses its store, or
//! wants certificates of a lifetime of its own takes a Pebble or a Redis
//! here instead of the cluster's, and so runs beside the other tests
//! instead of alone: [`Cluster::with_own_pebble`] and
//! [`Cluster::with_own_redis`] give a [`Cluster`] whose Pebble or Redis
//! settings name the test's server, so every helper that takes a
//! `&Cluster` (the manifests, [`super::issued`], [`super::pebble_root`],
//! [`super::Fleet`]) uses it unchanged.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Cluster, curl, redis_ping};

/// The first of the ports of this test process's servers: Pebble's
/// directory, its management API (the next port) and Redis (the one after).
/// Each test runs in a process of its own (nextest), so the PID keeps two
/// running tests apart; the ports stay below the node's ephemeral range
/// and the Services' NodePorts.
fn base_port() -> u16 {
    20_000 + (std::process::id() % 2_500) as u16 * 4
}

/// A server of a test's own: its process, ended when dropped.
pub struct Own {
    what: String,
    args: Vec<String>,
    child: Option<Child>,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Own {
    /// Starts `scripts/cluster ARGS` and waits until `ready` holds.
    fn start(what: &str, args: Vec<String>, ready: impl Fn() -> bool) -> Own {
        let dir = tempfile::Builder::new()
            .prefix(&format!("own-{}-", args[0]))
            .tempdir()
            .expect("a folder for the server's log");
        let mut own = Own {
            what: what.to_string(),
            log: dir.path().join("server.log"),
            args,
            child: None,
            _dir: dir,
        };
        own.spawn(ready);
        own
    }

    fn spawn(&mut self, ready: impl Fn() -> bool) {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/cluster");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("the server's log");
        let child = Command::new("bash")
            .arg(&script)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log again"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("scripts/cluster {}: {e}", self.args.join(" ")));
        self.child = Some(child);
        let start = Instant::now();
        while !ready() {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "{} (scripts/cluster {}) exited ({status}) before it answered:\n{}",
                    self.what,
                    self.args.join(" "),
                    self.log_text()
                );
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{} (scripts/cluster {}) did not answer within 30 s:\n{}",
                self.what,
                self.args.join(" "),
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Where its log is.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// SIGTERM, then SIGKILL after 10 s; waits for the end.
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Own {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A Redis of a test's own ([`Cluster::with_own_redis`]).
pub struct OwnRedis {
    server: Own,
    host: String,
    port: String,
}

impl OwnRedis {
    /// `CLIENT PAUSE` for `length`: every client's command hangs until it
    /// ends, as an unreachable server looks to a client.
    pub fn pause(&self, length: Duration) -> Result<(), String> {
        let url = format!("redis://{}:{}", self.host, self.port);
        let ms = length.as_millis().to_string();
        let out = Command::new("redis-cli")
            .args(["-u", &url, "CLIENT", "PAUSE", &ms, "ALL"])
            .output()
            .map_err(|e| format!("redis-cli: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "CLIENT PAUSE: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Stopped (SIGTERM) and started again on its port, what it held kept
    /// (its append-only file), as `scripts/cluster restart redis` does to
    /// the cluster's; returns once it answers.
    pub fn restart(&mut self) {
        self.server.stop();
        let (host, port) = (self.host.clone(), self.port.clone());
        self.server.spawn(move || redis_ping(&host, &port).is_ok());
    }
}

impl Cluster {
    /// This cluster with a Pebble of the test's own: certificates
    /// `validity` long (Pebble's default when `None`), its log and counts
    /// the test's alone. The server ends when the second value drops.
    pub fn with_own_pebble(&self, validity: Option<Duration>) -> (Cluster, Own) {
        let port = base_port();
        let mut args = vec!["pebble".to_string(), port.to_string()];
        if let Some(v) = validity {
            args.push(v.as_secs().to_string());
        }
        let directory = format!("https://{}:{port}/dir", self.node_ip);
        let ca = self.ca.clone();
        let dir = directory.clone();
        let server = Own::start("a Pebble of the test's own", args, move || {
            curl(&["--cacert", &ca, &dir]).is_ok_and(|(code, _)| code == 200)
        });
        let mut c = self.clone();
        c.acme_directory = directory;
        c.acme_management = format!("https://{}:{}", self.node_ip, port + 1);
        c.pebble_log = server.log.display().to_string();
        (c, server)
    }

    /// This cluster with a Redis of the test's own (database numbers as
    /// in the cluster's): the test may restart or pause it
    /// ([`OwnRedis::restart`], `CLIENT PAUSE`) without touching another
    /// test's store.
    pub fn with_own_redis(&self) -> (Cluster, OwnRedis) {
        let port = (base_port() + 2).to_string();
        let (host, p) = (self.node_ip.clone(), port.clone());
        let server = Own::start(
            "a Redis of the test's own",
            vec!["redis".to_string(), port.clone()],
            move || redis_ping(&host, &p).is_ok(),
        );
        let mut c = self.clone();
        c.redis_url = format!("redis://{}:{port}", self.node_ip);
        (
            c,
            OwnRedis {
                server,
                host: self.node_ip.clone(),
                port,
            },
        )
    }
}

/// A certificate Pebble issued: its serial, the names it covers and when
/// it is valid (Unix seconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    pub serial: String,
    pub names: Vec<String>,
    pub not_before: i64,
    pub not_after: i64,
}

/// Every certificate the cluster's Pebble (or the test's own, for a
/// [`Cluster::with_own_pebble`]) issued so far, in the order it issued
/// them: the serials from its log, the names from its management API.
pub fn issued_certificates(c: &Cluster) -> Vec<Issued> {
    let log = std::fs::read_to_string(&c.pebble_log)
        .unwrap_or_else(|e| panic!("Pebble's log {}: {e}", c.pebble_log));
    log.lines()
        .filter_map(|l| {
            let rest = l.split("Issued certificate serial ").nth(1)?;
            rest.split_whitespace().next().map(str::to_string)
        })
        .map(|serial| {
            let url = format!("{}/cert-status-by-serial/{serial}", c.acme_management);
            let (code, body) = curl(&["--cacert", &c.ca, &url])
                .unwrap_or_else(|e| panic!("Pebble's management API ({url}): {e}"));
            assert_eq!(code, 200, "{url}: {body}");
            let status: serde_json::Value =
                serde_json::from_str(&body).unwrap_or_else(|e| panic!("{url}: {e}: {body}"));
            let pem = status["Certificate"]
                .as_str()
                .unwrap_or_else(|| panic!("{url}: no Certificate: {body}"));
            let (names, not_before, not_after) = names_of(pem);
            Issued {
                serial,
                names,
                not_before,
                not_after,
            }
        })
        .collect()
}

/// The DNS names of a PEM certificate's subjectAltName, sorted, and its
/// notBefore and notAfter (Unix seconds), read as the operator reads its
/// webhook's certificate.
fn names_of(pem: &str) -> (Vec<String>, i64, i64) {
    let cert = sbmesh_operator::webhook::served(pem)
        .unwrap_or_else(|e| panic!("a certificate from Pebble: {e}"));
    let unix = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs() as i64)
    };
    let mut names = cert.names;
    names.sort();
    (names, unix(cert.not_before), unix(cert.not_after))
}
