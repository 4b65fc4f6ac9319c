//! ACME DNS-01 across replicas, with real processes, a real CA (Pebble)
//! and a real authoritative DNS server (BIND 9, which `scripts/test`
//! starts: zone dns01.test on 127.0.0.1:53, TSIG keys sbmesh-*.). Pebble
//! looks the TXT records up at BIND, so it sees exactly what the replica
//! holding the order wrote. Checked from the outside: the certificates
//! Pebble says it issued, a TLS handshake with each node's files for a
//! name the wildcard covers, and `dig` at BIND afterwards.
//!
//! Address blocks: 127.0.61.x (wildcard and apex), 127.0.62.x (the holder
//! killed mid-order), 127.0.63.x (a refused update in status).

mod common;
mod doc_check;

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Instant;

use common::acme::{
    Pebble, SerialCache, acme_config, dns01_acme, handshake_with, own_certs, redis_from_env,
    rfc2136_provider, spawn_trio, unique_names, write_tsig_secret,
};
use common::*;

use common::acme::dns_server::{self, ZONE};

/// A name under the test zone no other test or run uses.
fn unique_apex() -> String {
    unique_names(ZONE, 1).remove(0)
}

/// The TXT values BIND serves at `name`, as `dig` prints them.
fn dig_txt(bind: SocketAddr, name: &str) -> Vec<String> {
    let out = Command::new("dig")
        .args([
            &format!("@{}", bind.ip()),
            "-p",
            &bind.port().to_string(),
            "+short",
            "TXT",
            name,
        ])
        .output()
        .expect("dig (apt-get install bind9-dnsutils)");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().trim_matches('"').to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

/// Starts `node-1..3` on `ips`, seeded with each other, asking `bind` as
/// their resolver.
fn fleet(prefix: &str, ips: [Ipv4Addr; 3], bind: SocketAddr, config: &str) -> Cluster {
    let mut cluster = Cluster::new(prefix);
    cluster.cluster_id = format!("dns01-{}", prefix.replace('.', "-"));
    write_atomic(&cluster.config, config);
    spawn_trio(&mut cluster, ips, |_| {
        vec![
            "--acme-dns-resolvers".to_owned(),
            bind.to_string(),
            "--acme-order-lock-ttl-secs".to_owned(),
            "10".to_owned(),
        ]
    });
    cluster
}

/// The servers of a DNS-01 test: BIND, a Pebble that looks names up
/// there, and Redis; `None` (skipped) without them.
fn servers() -> Option<(SocketAddr, Pebble, String)> {
    let bind = dns_server::server()?;
    let pebble = Pebble::start_resolving_with(bind)?;
    Some((bind, pebble, redis_from_env()?))
}

/// Waits until every node lists the CA's certificate for the SAN set whose
/// first name is `host`; its serial.
fn wait_all_serve(cluster: &Cluster, host: &str) -> String {
    let mut serial = String::new();
    cluster.wait_until(
        &format!("every node lists the CA's certificate for {host}"),
        || {
            let mut seen = None;
            for node in &cluster.nodes {
                let Some(status) = node.status() else {
                    return false;
                };
                let Some(s) = own_certs(&status).get(host).cloned() else {
                    return false;
                };
                if seen.as_ref().is_some_and(|x| *x != s) {
                    return false;
                }
                seen = Some(s);
            }
            serial = seen.unwrap_or_default();
            true
        },
    );
    serial
}

/// The checks once the fleet has its certificate: one issuance at the CA,
/// every node's files serve a name the wildcard covers and the apex, and
/// BIND serves no challenge record any more.
fn check_issued_once(cluster: &Cluster, pebble: &Pebble, bind: SocketAddr, apex: &str) {
    let wildcard = format!("*.{apex}");
    let serial = wait_all_serve(cluster, &wildcard);
    let mut cache = SerialCache::default();
    let counts = pebble.issued_counts(&[wildcard.clone(), apex.to_owned()], &mut cache);
    assert_eq!(
        counts.values().copied().collect::<Vec<_>>(),
        [1, 1],
        "Pebble issued one certificate naming both {wildcard} and {apex}: {counts:?}"
    );
    let root = pebble.root_pem();
    for node in &cluster.nodes {
        let dir = node.dir.join("certs");
        for sni in [
            format!("www.{apex}"),
            format!("api.{apex}"),
            apex.to_owned(),
        ] {
            if let Err(e) = handshake_with(&dir, &sni, &root) {
                panic!("{} {sni}: {e}", node.id());
            }
        }
        let facts = sbmesh::internal::certs::parse_chain(
            &std::fs::read_to_string(dir.join("tls.crt")).expect("tls.crt"),
        )
        .expect("a certificate");
        assert_eq!(facts.serial, serial, "{} serves the one serial", node.id());
    }
    let challenge = format!("_acme-challenge.{apex}");
    let left = dig_txt(bind, &challenge);
    assert!(left.is_empty(), "TXT {challenge} left at BIND: {left:?}");
    let all = cluster.all();
    let presents = cluster.metric_total(
        &all,
        "acme_dns_updates_total",
        &[("provider", "rfc2136"), ("op", "present"), ("result", "ok")],
    );
    let cleanups = cluster.metric_total(
        &all,
        "acme_dns_updates_total",
        &[("provider", "rfc2136"), ("op", "cleanup"), ("result", "ok")],
    );
    assert_eq!(
        (presents, cleanups),
        (2.0, 2.0),
        "two records written and removed in all"
    );
}

#[test]
fn a_wildcard_and_its_apex_are_issued_once_and_every_replica_serves_them() {
    let Some((bind, pebble, redis)) = servers() else {
        return;
    };
    let scratch = tempfile::tempdir().expect("scratch");
    let apex = unique_apex();
    let hosts = [format!("*.{apex}"), apex.clone()];
    let extra = dns01_acme(
        "san",
        &rfc2136_provider(bind, &write_tsig_secret(scratch.path())),
    );
    let config = acme_config(&pebble, "redis", &redis, &hosts, &extra);
    let started = Instant::now();
    let cluster = fleet("127.0.61", ips(61), bind, &config);
    check_issued_once(&cluster, &pebble, bind, &apex);
    eprintln!(
        "every replica serves *.{apex} and {apex} {:.2} s after the start",
        started.elapsed().as_secs_f64()
    );
}

/// The holder of the order writes its records and dies before the CA is
/// told to look: the next holder removes what it left, orders, and the CA
/// issues one certificate; no record is left.
#[test]
fn the_order_holder_killed_after_writing_the_record_is_taken_over() {
    let Some((bind, pebble, redis)) = servers() else {
        return;
    };
    let scratch = tempfile::tempdir().expect("scratch");
    let secret = dns_server::secret("sha256");
    // An exec hook that writes with nsupdate; the first present it is
    // asked for, it writes, says which process asked, and hangs there.
    let hook = scratch.path().join("dns-hook");
    let hang = scratch.path().join("hang-once");
    let hung = scratch.path().join("hung-by");
    std::fs::write(&hang, "").expect("marker");
    std::fs::write(
        &hook,
        format!(
            "#!/bin/sh\nset -e\nop=add; [ \"$1\" = cleanup ] && op=delete\n\
             printf 'server {ip} {port}\\nupdate %s %s 60 TXT \"%s\"\\nsend\\n' \"$op\" \"$2\" \"$3\" \\\n\
             | nsupdate -y 'hmac-sha256:sbmesh-sha256.:{secret}'\n\
             if [ \"$1\" = present ] && rm {hang} 2>/dev/null; then echo $PPID > {hung}; sleep 600; fi\n",
            ip = bind.ip(),
            port = bind.port(),
            hang = hang.display(),
            hung = hung.display(),
        ),
    )
    .expect("hook");
    std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let apex = unique_apex();
    let hosts = [format!("*.{apex}"), apex.clone()];
    let extra = dns01_acme(
        "san",
        &format!(
            "          provider: exec\n          command: \"{}\"\n",
            hook.display()
        ),
    );
    let config = acme_config(&pebble, "redis", &redis, &hosts, &extra);
    let mut cluster = fleet("127.0.62", ips(62), bind, &config);
    // The holder hangs with its first record written.
    assert!(
        poll_until(deadline(), || hung.exists()),
        "no replica wrote a record"
    );
    let pid: u32 = std::fs::read_to_string(&hung)
        .expect("hung-by")
        .trim()
        .parse()
        .expect("a pid");
    let holder = cluster
        .nodes
        .iter()
        .position(|n| n.pid() == Some(pid))
        .expect("the hook's parent is a sidecar");
    let challenge = format!("_acme-challenge.{apex}");
    assert_eq!(
        dig_txt(bind, &challenge).len(),
        1,
        "the holder's record is written"
    );
    cluster.nodes[holder].kill9();
    // The others: the lock expires (10 s), the next holder clears the
    // record, orders, and every survivor serves the certificate.
    let survivors: Vec<usize> = (0..3).filter(|i| *i != holder).collect();
    let wildcard = format!("*.{apex}");
    cluster.wait_until("both survivors serve the certificate", || {
        survivors.iter().all(|i| {
            cluster.nodes[*i]
                .status()
                .is_some_and(|s| own_certs(&s).contains_key(&wildcard))
        })
    });
    let mut cache = SerialCache::default();
    let counts = pebble.issued_counts(&hosts, &mut cache);
    assert_eq!(
        counts.values().copied().collect::<Vec<_>>(),
        [1, 1],
        "one certificate at the CA: {counts:?}"
    );
    let left = dig_txt(bind, &challenge);
    assert!(left.is_empty(), "TXT {challenge} left at BIND: {left:?}");
    let log: String = survivors
        .iter()
        .map(|i| cluster.nodes[*i].log_tail(400))
        .collect();
    assert!(
        log.contains("removing DNS-01 records an earlier order left"),
        "the next holder says it removed the dead holder's record"
    );
}

fn ips(c: u8) -> [Ipv4Addr; 3] {
    [1, 2, 3].map(|d| Ipv4Addr::new(127, 0, c, d))
}

/// A key the server's policy refuses: the order fails, and status says
/// why (the server's code), which host, and when it is tried again.
#[test]
fn a_refused_update_is_in_status_with_the_servers_code() {
    let Some((bind, pebble, redis)) = servers() else {
        return;
    };
    let scratch = tempfile::tempdir().expect("scratch");
    let secret = scratch.path().join("narrow.secret");
    std::fs::write(&secret, dns_server::secret("narrow")).expect("secret");
    // The narrow key may write only in delegated.test, not in dns01.test.
    let provider = rfc2136_provider(bind, &secret).replace("sbmesh-sha256.", "sbmesh-narrow.");
    let host = unique_apex();
    let config = acme_config(
        &pebble,
        "redis",
        &redis,
        std::slice::from_ref(&host),
        &dns01_acme("per_host", &provider),
    );
    let cluster = fleet("127.0.63", ips(63), bind, &config);
    let mut seen = serde_json::Value::Null;
    let mut status = serde_json::Value::Null;
    cluster.wait_until(
        "a node lists the failing order with the server's code",
        || {
            cluster.nodes.iter().filter_map(|n| n.status()).any(|s| {
                let failing = s["nodes"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|n| n["local"] == true)
                    .flat_map(|n| n["acme"]["failing"].as_array().cloned().unwrap_or_default())
                    .find(|f| f["host"] == host.as_str());
                match failing {
                    Some(f) => {
                        seen = f;
                        status = s.clone();
                        true
                    }
                    None => false,
                }
            })
        },
    );
    let error = seen["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("REFUSED") && error.contains("update policy"),
        "the error names the server's answer: {seen}"
    );
    let since = seen["since_unix"]
        .as_u64()
        .expect("since_unix in the failing entry");
    let retry_at = seen["retry_at_unix"]
        .as_u64()
        .expect("retry_at_unix in the failing entry");
    assert!(retry_at > since, "a next attempt after the failure: {seen}");
    let problems: Vec<String> = doc_check::status_schema()
        .iter_errors(&status)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    assert!(
        problems.is_empty(),
        "status outside docs/status.schema.json: {problems:?}"
    );
}
