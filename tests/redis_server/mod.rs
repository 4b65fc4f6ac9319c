//! A private `redis-server` for tests that must stop, freeze or restart it
//! (the shared one from `scripts/test` must stay up for everyone else).

#![allow(dead_code)]

#[allow(clippy::duplicate_mod)]
#[path = "../required/mod.rs"]
mod required;

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `redis-server` binary, or `None` (with a SKIP line) when it is not
/// installed and `SBMESH_TEST_REQUIRE_SERVERS` does not demand it.
pub fn binary(test: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("redis-server"))
        .find(|p| p.is_file());
    found.or_else(|| {
        required::missing(
            test,
            "redis-server is not installed",
            "apt-get install -y redis-server",
        )
    })
}

/// A free TCP port on 127.0.0.1 (free when asked; good enough for tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port on 127.0.0.1")
}

/// One `redis-server` process on 127.0.0.1, in its own temp dir, without
/// persistence. Stopped (SIGKILL by PID) when dropped.
pub struct RedisServer {
    binary: PathBuf,
    dir: tempfile::TempDir,
    pub port: u16,
    extra: Vec<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a plain server on a free port.
    pub fn start(binary: &Path) -> Self {
        Self::start_with(binary, free_port(), Vec::new())
    }

    /// Starts a server listening on `port`, with extra arguments (for TLS:
    /// `--port 0 --tls-port <port> …`, and then `port` is the TLS port).
    pub fn start_with(binary: &Path, port: u16, extra: Vec<String>) -> Self {
        let mut server = Self {
            binary: binary.to_owned(),
            dir: tempfile::tempdir().expect("temp dir"),
            port,
            extra,
            child: None,
        };
        server.spawn();
        server
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server is running").id()
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new(&self.binary);
        cmd.args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--daemonize", "no", "--loglevel", "warning"]);
        if self.extra.is_empty() {
            cmd.args(["--port", &self.port.to_string()]);
        } else {
            cmd.args(&self.extra);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "redis-server on port {} exited at start: {status}",
                    self.port
                );
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not listen within 15 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL by PID, and reap it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Sends a signal (`STOP`, `CONT`) to the server's PID (with the
    /// shell's `kill`, which needs no extra package).
    pub fn signal(&self, sig: &str) {
        let status = Command::new("sh")
            .args(["-c", "kill -s \"$0\" \"$1\""])
            .arg(sig)
            .arg(self.pid().to_string())
            .status()
            .expect("run sh");
        assert!(status.success(), "kill -s {sig} {} failed", self.pid());
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
