//! Running the stand-in `sbproxy` as a real process on 127.0.0.1, and
//! talking HTTP/1.1 to it.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;

pub const BIN: &str = env!("CARGO_BIN_EXE_sbproxy");
pub const DEADLINE: Duration = Duration::from_secs(30);

/// A TCP port that was free a moment ago (and, for the mesh, free on UDP too).
pub fn free_port() -> u16 {
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if UdpSocket::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Writes `text` to `path` atomically (a reader never sees half of it).
pub fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp-write");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes))
}

/// A config with the admin API on `admin` and the data port on `http`,
/// plus `extra_admin` lines (indented 4) and `extra_proxy` lines
/// (indented 2).
pub fn config(admin: u16, http: u16, extra_admin: &str, extra_proxy: &str) -> String {
    format!(
        "proxy:\n  http_bind_port: {http}\n  admin:\n    enabled: true\n    port: {admin}\n{extra_admin}{extra_proxy}"
    )
}

pub struct Proxy {
    pub child: Child,
    stderr: Arc<Mutex<String>>,
    pub admin_port: u16,
}

impl Proxy {
    /// Starts the binary with `-f path` and `env`.
    pub fn spawn(path: &Path, admin_port: u16, env: &[(&str, &str)]) -> Proxy {
        Self::spawn_args(&["-f".as_ref(), path.as_os_str()], admin_port, env)
    }

    pub fn spawn_args(args: &[&std::ffi::OsStr], admin_port: u16, env: &[(&str, &str)]) -> Proxy {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .env("SBPROXY_STANDIN_BIND", "127.0.0.1")
            .env_remove("SB_CONFIG_FILE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn sbproxy stand-in");
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut pipe = child.stderr.take().unwrap();
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Proxy {
            child,
            stderr,
            admin_port,
        }
    }

    /// Starts it and waits for its admin `/healthz`.
    pub fn start(path: &Path, admin_port: u16, env: &[(&str, &str)]) -> Proxy {
        let mut p = Self::spawn(path, admin_port, env);
        p.wait_ready();
        p
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Waits until the stand-in's stderr holds `needle` (the pipe is read
    /// by a thread, so a line may trail what it reports).
    pub fn wait_stderr(&self, needle: &str) {
        let until = Instant::now() + DEADLINE;
        while !self.stderr().contains(needle) {
            assert!(
                Instant::now() < until,
                "{needle:?} not logged:\n{}",
                self.stderr()
            );
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
    }

    pub fn wait_ready(&mut self) {
        let until = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the stand-in exited ({status}):\n{}", self.stderr());
            }
            if let Some((200, _)) = try_request(self.admin_port, "GET", "/healthz", None) {
                return;
            }
            assert!(
                Instant::now() < until,
                "not ready in time:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the process to end; its status and full stderr.
    pub fn wait_exit(&mut self) -> (ExitStatus, String) {
        let until = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the reader thread see the end of the pipe.
                let wait_pipe = Instant::now() + Duration::from_secs(5);
                let mut last = self.stderr();
                while Instant::now() < wait_pipe {
                    std::thread::sleep(Duration::from_millis(20));
                    let now = self.stderr();
                    if now == last {
                        break;
                    }
                    last = now;
                }
                return (status, last);
            }
            assert!(Instant::now() < until, "still running:\n{}", self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{name}");
    }

    pub fn request(&self, method: &str, path: &str, auth: Option<(&str, &str)>) -> (u16, String) {
        request(self.admin_port, method, path, auth)
    }

    /// `POST /admin/reload`, again while it answers 409 (the proxy's own
    /// watcher may be reloading at that moment).
    pub fn reload(&self, auth: (&str, &str)) -> (u16, serde_json::Value) {
        let until = Instant::now() + DEADLINE;
        loop {
            let (status, body) = self.request("POST", "/admin/reload", Some(auth));
            if status != 409 || Instant::now() > until {
                let json = serde_json::from_str(&body)
                    .unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
                return (status, json);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The stand-in-only `GET /admin/config/revision`.
    pub fn revision(&self, auth: (&str, &str)) -> String {
        let (status, body) = self.request("GET", "/admin/config/revision", Some(auth));
        assert_eq!(status, 200, "{body}");
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        json["config_revision"].as_str().unwrap().to_owned()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request to 127.0.0.1:`port`; status and body.
pub fn request(port: u16, method: &str, path: &str, auth: Option<(&str, &str)>) -> (u16, String) {
    let (status, _, body) = request_full(port, method, path, auth, &[]);
    (status, body)
}

/// Status, raw head and body.
pub fn request_full(
    port: u16,
    method: &str,
    path: &str,
    auth: Option<(&str, &str)>,
    extra_headers: &[&str],
) -> (u16, String, String) {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    conn.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\nContent-Length: 0\r\n"
    );
    if let Some((user, pass)) = auth {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
        head.push_str(&format!("Authorization: Basic {token}\r\n"));
    }
    for h in extra_headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes()).unwrap();
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).unwrap();
    parse_response(&raw)
}

/// One HTTP/1.1 request to 127.0.0.1:`port` with `Host: host`; status,
/// raw head and body.
pub fn request_to_host(port: u16, method: &str, path: &str, host: &str) -> (u16, String, String) {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    conn.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).unwrap();
    parse_response(&raw)
}

pub fn parse_response(raw: &[u8]) -> (u16, String, String) {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {text:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (status, head.to_owned(), body.to_owned())
}

/// Like [`request`], but `None` while nothing answers.
pub fn try_request(
    port: u16,
    method: &str,
    path: &str,
    auth: Option<(&str, &str)>,
) -> Option<(u16, String)> {
    let mut conn = TcpStream::connect(("127.0.0.1", port)).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    if let Some((user, pass)) = auth {
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
        head.push_str(&format!("Authorization: Basic {token}\r\n"));
    }
    head.push_str("\r\n");
    conn.write_all(head.as_bytes()).ok()?;
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).ok()?;
    if !String::from_utf8_lossy(&raw).contains("\r\n\r\n") {
        return None;
    }
    let (status, _, body) = parse_response(&raw);
    Some((status, body))
}

/// A temporary directory with `sb.yml` in it.
pub struct ConfigDir {
    pub dir: tempfile::TempDir,
}

impl ConfigDir {
    pub fn new(text: &str) -> ConfigDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("sb.yml"), text).unwrap();
        ConfigDir { dir }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.path().join("sb.yml")
    }

    pub fn write(&self, text: &str) {
        write_atomic(&self.path(), text);
    }
}
