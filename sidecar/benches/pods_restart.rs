//! `certificates: san` + `apply: restart` across 3 pods (sidecar + the
//! real sbproxy in a PID namespace each, 127.0.63.1-3), on Redis and
//! Pebble: prints one markdown row for BENCHMARKS.md.
//!
//! - *served*: from the first pod's start until every proxy serves the CA's
//!   certificate for all 5 names (a verified TLS handshake per name);
//! - *restarts done*: until every proxy was restarted once and answers again;
//! - *most down at once*: the most proxies a 20 ms sampler saw down together
//!   (the goal: never 2);
//! - *longest outage*: the longest stretch any pod had no proxy answering,
//!   next to the proxy's own start time and its exit on SIGTERM with the
//!   pods' `SBPROXY_SHUTDOWN_GRACE_MS` (the goal: outage <= exit + start + 1 s).
//!
//! ```text
//! SBMESH_TEST_SERVERS="redis pebble" \
//!   SBMESH_TEST_RUN="cargo bench -p sbmesh-sidecar --bench pods_restart" scripts/test
//! ```
//!
//! Needs root (PID namespaces). Every pod is killed at the end.

#[path = "../tests/common/mod.rs"]
mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::acme::{Pebble, unique_hosts};
use common::pods::*;
use common::{ORIGIN, deadline, poll_until, sbproxy_bin, write_atomic};
use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, pem::PemObject as _};

fn main() {
    let Some(sbproxy) = sbproxy_bin("pods_restart") else {
        return;
    };
    let Some(pebble) = Pebble::start() else {
        eprintln!("pods_restart: Pebble is not prepared (see the doc comment)");
        return;
    };
    let Ok(redis) = std::env::var("SBMESH_TEST_REDIS_URL") else {
        eprintln!("pods_restart: SBMESH_TEST_REDIS_URL is not set");
        return;
    };
    let base = tempfile::tempdir().expect("temp dir");
    let (start, exit) = proxy_start_and_exit(&sbproxy, base.path());

    let hosts = unique_hosts("bench-san", 5);
    let ips: Vec<Ipv4Addr> = (1..=3).map(|i| Ipv4Addr::new(127, 0, 63, i)).collect();
    for (i, h) in hosts.iter().enumerate() {
        pebble.route(h, ips[i % 3]);
    }
    let config_path = base.path().join("sb.yml");
    write_atomic(&config_path, &san_restart_config(&pebble, &redis, &hosts));
    let cluster_id = format!("bench-pods-{}", std::process::id());
    let t0 = Instant::now();
    let pods = Pod::fleet(&sbproxy, &ips, base.path(), &config_path, |i| {
        fleet_args(i, &ips, &cluster_id, &pebble, base.path())
    });
    assert!(
        poll_until(deadline(), || pods.iter().all(Pod::proxy_up)),
        "the proxies did not start"
    );
    let up = t0.elapsed();
    let sampler = Sampler::start(pods.iter().map(|p| (p.name.clone(), p.ip)).collect());
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pebble.root_pem().as_bytes()) {
        roots.add(cert.expect("root")).expect("root");
    }
    let roots = Arc::new(roots);
    wait_served(&pods, &hosts, &roots);
    let served = t0.elapsed();
    assert!(
        poll_until(deadline(), || pods
            .iter()
            .all(|p| p.restarts() == Some(1) && p.proxy_up())),
        "the restarts did not finish"
    );
    let done = t0.elapsed();
    let seen = sampler.finish();
    let longest = seen
        .longest_outage
        .iter()
        .map(|(_, d)| *d)
        .max()
        .unwrap_or_default();
    println!(
        "| 3 | 5 | {PROXY_GRACE_MS} | {:.2} s | {:.2} s | {:.2} s | {} | {:.2} s | {:.2} s | {:.2} s |",
        up.as_secs_f64(),
        served.as_secs_f64(),
        done.as_secs_f64(),
        seen.most_down.0,
        longest.as_secs_f64(),
        exit.as_secs_f64(),
        start.as_secs_f64(),
    );
    eprintln!("per pod longest outage: {:?}", seen.longest_outage);
}

/// The real proxy alone, 5 times: the slowest time from exec to its data
/// port answering, with a TLS certificate to load, and the slowest from
/// SIGTERM to its exit with the pods' grace period.
fn proxy_start_and_exit(sbproxy: &std::path::Path, base: &std::path::Path) -> (Duration, Duration) {
    let dir = base.join("solo");
    std::fs::create_dir_all(&dir).expect("dir");
    let (crt, key) =
        sbmesh::internal::placeholder::generate(&["solo.example.com".to_owned()], 1_790_000_000)
            .expect("pair");
    std::fs::write(dir.join("tls.crt"), crt).expect("crt");
    std::fs::write(dir.join("tls.key"), key).expect("key");
    let ip = Ipv4Addr::new(127, 0, 63, 10);
    let config = dir.join("sb.yml");
    std::fs::write(
        &config,
        format!(
            "proxy:\n{}  tls_cert_file: {d}/tls.crt\n  tls_key_file: {d}/tls.key\n\
             origins:\n  solo.example.com: {ORIGIN}\n",
            proxy_listeners(),
            d = dir.display()
        ),
    )
    .expect("config");
    let (mut start, mut exit) = (Duration::ZERO, Duration::ZERO);
    for _ in 0..5 {
        let t = Instant::now();
        let mut child = std::process::Command::new(sbproxy)
            .arg("-f")
            .arg(&config)
            .env("POD_IP", ip.to_string())
            .env("SBPROXY_SHUTDOWN_GRACE_MS", PROXY_GRACE_MS.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("sbproxy starts");
        // Polled every 5 ms: the figure is compared with outages.
        let ok = loop {
            if http_get(SocketAddr::from((ip, HTTP_PORT)), "/health", None)
                .is_some_and(|(s, _)| s == 200)
            {
                break true;
            }
            if t.elapsed() > deadline() {
                break false;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        start = start.max(t.elapsed());
        let t = Instant::now();
        // SAFETY: a plain kill(2) of our own child's PID.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let _ = child.wait();
        exit = exit.max(t.elapsed());
        assert!(ok, "sbproxy did not start");
    }
    (start, exit)
}
