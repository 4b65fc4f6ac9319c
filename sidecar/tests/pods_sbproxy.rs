//! Three pods, each a sidecar beside the real sbproxy 1.13
//! (`SBMESH_TEST_SBPROXY`) in a PID namespace of its own, as Kubernetes runs
//! them with `shareProcessNamespace: true`: `certificates: san` +
//! `apply: restart` on a real Redis and a real Pebble.
//!
//! What a user checks: every proxy ends up *serving* one certificate with
//! all the names (a TLS handshake against its port, verified against
//! Pebble's root for each name), the one the fleet's status agrees on; the
//! CA issued one certificate; the proxies were restarted one at a time
//! (a sampler watches them: never two down at once); adding an origin
//! issues one more certificate, served after one more rolling restart.
//!
//! And `--watch-tls`: a cert-manager Secret mounted into the pod, swapped
//! by the kubelet, reaches the proxy by a restart; a pair whose key does not
//! match its certificate never does, and is reported.
//!
//! Address blocks 127.0.61.1-3 and 127.0.62.1. Needs root (PID namespaces), Redis, Pebble,
//! and the real sbproxy (`scripts/test` finds it).

mod common;
#[path = "../../tests/kubelet/mod.rs"]
mod kubelet;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use common::acme::{Pebble, SerialCache, redis_from_env, unique_hosts};
use common::pods::*;
use common::{ORIGIN, deadline, poll_until, sbproxy_bin, write_atomic};
use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, pem::PemObject as _};

#[test]
fn san_certificates_are_served_after_rolling_restarts() {
    let Some(sbproxy) = sbproxy_bin("san_certificates_are_served_after_rolling_restarts") else {
        return;
    };
    let Some(pebble) = Pebble::start() else {
        return;
    };
    let Some(redis) = redis_from_env() else {
        return;
    };
    let base = tempfile::tempdir().unwrap();
    let config_path = base.path().join("sb.yml");
    let mut hosts = unique_hosts("san", 5);
    let ips: Vec<Ipv4Addr> = (1..=3).map(|i| Ipv4Addr::new(127, 0, 61, i)).collect();
    // Each validation goes to some replica, most not the one that ordered.
    for (i, h) in hosts.iter().enumerate() {
        pebble.route(h, ips[i % 3]);
    }
    write_atomic(&config_path, &san_restart_config(&pebble, &redis, &hosts));
    let cluster_id = format!("pods-{}", std::process::id());
    let pods = Pod::fleet(&sbproxy, &ips, base.path(), &config_path, |i| {
        fleet_args(i, &ips, &cluster_id, &pebble, base.path())
    });

    // The placeholders let every proxy start before any certificate exists.
    assert!(
        poll_until(deadline(), || pods.iter().all(Pod::proxy_up)),
        "the proxies did not start on their placeholders:\n{}",
        pods.iter().map(Pod::logs).collect::<String>()
    );
    let sampler = Sampler::start(pods.iter().map(|p| (p.name.clone(), p.ip)).collect());

    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pebble.root_pem().as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let roots = Arc::new(roots);
    let first = wait_served(&pods, &hosts, &roots);
    assert!(
        poll_until(deadline(), || pods.iter().all(|p| p.restarts() == Some(1))),
        "each proxy restarted once: {:?}",
        pods.iter().map(Pod::restarts).collect::<Vec<_>>()
    );
    let mut cache = SerialCache::default();
    let counts = pebble.issued_counts(&hosts, &mut cache);
    assert!(counts.values().all(|n| *n == 1), "Pebble issued {counts:?}");

    // A pod added now (a scale-up) starts its proxy after the sidecar's
    // startup probe, as the operator's pods do: the stored certificate is
    // written by then, so its proxy serves it from its first start, with
    // no restart and no order.
    let mut ips4 = ips.clone();
    ips4.push(Ipv4Addr::new(127, 0, 61, 4));
    let added = Pod::spawn_as(
        &sbproxy,
        "pod-3",
        ips4[3],
        base.path(),
        &config_path,
        &fleet_args(3, &ips4, &cluster_id, &pebble, base.path()),
        true,
    );
    assert!(
        poll_until(deadline(), || hosts
            .iter()
            .all(|h| added.served_serial(h, &roots).as_ref() == Ok(&first))),
        "the added pod's proxy does not serve the fleet's certificate:\n{}",
        added.logs()
    );
    assert_eq!(
        added.restarts(),
        Some(0),
        "the added pod's proxy was restarted:\n{}",
        added.logs()
    );
    assert!(
        added.logs().contains("startup probe passed"),
        "{}",
        added.logs()
    );
    // Ready, and staying so: nothing is left to restart the proxy for.
    for _ in 0..5 {
        assert_eq!(
            http_get(
                SocketAddr::from((added.ip, SIDECAR_ADMIN_PORT)),
                "/readyz",
                None
            ),
            Some((200, "ready".to_owned())),
            "the added pod's readiness:\n{}",
            added.logs()
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    drop(added);
    assert_eq!(
        pebble
            .issued_counts(&hosts, &mut cache)
            .values()
            .sum::<usize>(),
        hosts.len(),
        "no order for the added pod"
    );

    // One more origin: one more certificate, one more rolling restart.
    hosts.push(unique_hosts("san6", 1).remove(0));
    pebble.route(&hosts[5], ips[2]);
    write_atomic(&config_path, &san_restart_config(&pebble, &redis, &hosts));
    let second = wait_served(&pods, &hosts, &roots);
    assert_ne!(first, second);
    assert!(
        poll_until(deadline(), || pods.iter().all(|p| p.restarts() == Some(2))),
        "each proxy restarted twice: {:?}",
        pods.iter().map(Pod::restarts).collect::<Vec<_>>()
    );
    let counts = pebble.issued_counts(&hosts, &mut cache);
    assert_eq!(counts[&hosts[5]], 1, "Pebble issued {counts:?}");
    assert!(
        hosts[..5].iter().all(|h| counts[h] == 2),
        "Pebble issued {counts:?}"
    );

    let (most_down, which) = sampler.finish().most_down;
    assert!(
        most_down <= 1,
        "{most_down} proxies were down at once: {which:?}\n{}",
        pods.iter().map(Pod::logs).collect::<String>()
    );
}

#[test]
fn a_cert_manager_secret_swap_reaches_the_proxy_and_a_mismatched_pair_never_does() {
    let Some(sbproxy) = sbproxy_bin(
        "a_cert_manager_secret_swap_reaches_the_proxy_and_a_mismatched_pair_never_does",
    ) else {
        return;
    };
    let base = tempfile::tempdir().unwrap();
    let secret = base.path().join("secret");
    std::fs::create_dir_all(&secret).unwrap();
    let names = vec!["a.example.com".to_owned()];
    let pair = |at: u64| sbmesh::internal::placeholder::generate(&names, at).unwrap();
    let serial = |chain: &str| sbmesh::internal::certs::parse_chain(chain).unwrap().serial;
    let (crt_a, key_a) = pair(1_790_000_000);
    let (crt_b, key_b) = pair(1_790_000_100);
    let (crt_c, _) = pair(1_790_000_200);
    let mut mount =
        kubelet::Kubelet::with_files(&secret, &[("tls.crt", &crt_a), ("tls.key", &key_a)]);

    let ip = Ipv4Addr::new(127, 0, 62, 1);
    let config_path = base.path().join("sb.yml");
    write_atomic(
        &config_path,
        &format!(
            "proxy:\n{listeners}  \
             tls_cert_file: {dir}/tls.crt\n  tls_key_file: {dir}/tls.key\n\
             origins:\n  a.example.com: {ORIGIN}\n",
            listeners = proxy_listeners(),
            dir = secret.display()
        ),
    );
    let args: Vec<String> = [
        "--node-id",
        "tls-0",
        "--bind",
        &ip.to_string(),
        "--admin-listen",
        &format!("{ip}:{SIDECAR_ADMIN_PORT}"),
        "--challenge-listen",
        &format!("{ip}:8089"),
        "--state-dir",
        &base.path().join("tls-0/state").display().to_string(),
        "--cert-dir",
        &base.path().join("tls-0/certs").display().to_string(),
        "--watch-tls",
        &secret.display().to_string(),
        "--proxy-cert-apply",
        "restart",
        "--proxy-restart-interval-secs",
        "1",
        "--log-format",
        "text",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let pod = Pod::spawn(&sbproxy, "tls-0", ip, base.path(), &config_path, &args);
    let serves = |want: &str| {
        poll_until(deadline(), || {
            pod.served_serial_unverified("a.example.com").as_deref() == Ok(want)
        })
    };
    assert!(
        serves(&serial(&crt_a)),
        "the proxy does not serve the mounted pair:\n{}",
        pod.logs()
    );
    let readyz = || {
        http_get(SocketAddr::from((ip, SIDECAR_ADMIN_PORT)), "/readyz", None).unwrap_or_default()
    };
    assert!(
        poll_until(deadline(), || readyz().0 == 200),
        "not ready: {:?}\n{}",
        readyz(),
        pod.logs()
    );

    // A renewal: the kubelet swaps both keys at once.
    mount.publish_files(&[("tls.crt", &crt_b), ("tls.key", &key_b)]);
    assert!(
        serves(&serial(&crt_b)),
        "the renewed pair is not served:\n{}",
        pod.logs()
    );
    assert!(
        poll_until(deadline(), || pod.restarts() == Some(1)),
        "restarts: {:?}",
        pod.restarts()
    );

    // A key that does not match its certificate: never applied, reported.
    mount.publish_files(&[("tls.crt", &crt_c), ("tls.key", &key_b)]);
    assert!(
        poll_until(deadline(), || {
            let (status, body) = readyz();
            status == 503 && body.contains(&secret.display().to_string())
        }),
        "the mismatched pair is not reported: {:?}\n{}",
        readyz(),
        pod.logs()
    );
    let metrics = http_get(SocketAddr::from((ip, SIDECAR_ADMIN_PORT)), "/metrics", None)
        .unwrap_or_default()
        .1;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("sbmesh_watch_tls_rejected_total{reason=\"mismatch\"} 1")),
        "{metrics}"
    );
    assert_eq!(pod.restarts(), Some(1));
    assert_eq!(
        pod.served_serial_unverified("a.example.com").as_deref(),
        Ok(serial(&crt_b).as_str())
    );
}
