//! DNS-01 against the real BIND 9 `scripts/test` starts (`dns`): the
//! zones dns01.test and delegated.test on `SBMESH_TEST_DNS_SERVER`, and
//! the TSIG keys sbmesh-<name>. whose secrets are `SBMESH_TEST_TSIG_<NAME>`.
//! Each test writes under names of its own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::rr::{Name, RecordType};

use super::transport::exchange;
use super::{Dns01, Dns01Order, DnsError, TxtRecord, wire};
use crate::config::{Dns01Section, DnsProvider, TsigAlgorithm};
use crate::metrics::Metrics;
use crate::store::Store;
use crate::store::lock::LeaseLock;
use crate::store::memory::MemoryStore;

#[path = "../../../tests/dns_server/mod.rs"]
mod dns_server;
#[allow(clippy::duplicate_mod)]
#[path = "../../../tests/required/mod.rs"]
mod required;

use dns_server::{DELEGATED_ZONE as DELEGATED, ZONE, secret, secret_var, server};

/// A label no other test or run uses.
fn unique(tag: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{tag}-{:x}-{}-{}",
        crate::store::now_unix_ms() % 0xffff_ffff,
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn rfc2136(server: SocketAddr, key: &str, algorithm: TsigAlgorithm) -> Dns01Section {
    Dns01Section {
        nameserver: Some(server.to_string()),
        tsig_key_name: Some(format!("sbmesh-{key}.")),
        tsig_algorithm: algorithm,
        tsig_secret: Some(format!("env:{}", secret_var(key))),
        ..Dns01Section::new(DnsProvider::Rfc2136)
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn dns(section: &Dns01Section, server: SocketAddr) -> Dns01 {
    Dns01::new(section, &[server], env, Arc::new(Metrics::new())).expect("settings")
}

/// What BIND serves at `fqdn` now (asked as the CA asks, without recursion).
async fn served(server: SocketAddr, fqdn: &str) -> Vec<String> {
    let name = Name::from_ascii(fqdn).unwrap();
    let answer = exchange(server, &wire::query(1, &name, RecordType::TXT, false))
        .await
        .expect("BIND answers");
    wire::txt_values(&answer, &name)
}

/// Makes `_acme-challenge.<host>` a CNAME to `target` with the admin key.
async fn cname(server: SocketAddr, host: &str, target: &str) {
    use hickory_proto::op::update_message;
    use hickory_proto::rr::rdata::CNAME;
    use hickory_proto::rr::{RData, Record, RecordSet};
    let name = Name::from_ascii(format!("_acme-challenge.{host}.")).unwrap();
    let mut rrset = RecordSet::new(name.clone(), RecordType::CNAME, 0);
    rrset.insert(
        Record::from_rdata(
            name,
            60,
            RData::CNAME(CNAME(Name::from_ascii(target).unwrap())),
        ),
        0,
    );
    let mut m = update_message::create(rrset, Name::from_ascii(format!("{ZONE}.")).unwrap(), false);
    m.metadata.id = 9;
    let key = wire::TsigKey {
        name: Name::from_ascii("sbmesh-admin.").unwrap(),
        algorithm: TsigAlgorithm::HmacSha256,
        secret: crate::config::tsig_secret_bytes(&secret("admin")).unwrap(),
    };
    wire::sign(&mut m, &key, crate::store::now_unix_ms() / 1000).unwrap();
    let answer = exchange(server, &m).await.unwrap();
    wire::update_result(&answer).expect("the admin key makes the CNAME");
}

#[tokio::test]
async fn each_tsig_algorithm_writes_is_served_and_removes_the_record() {
    let Some(server) = server() else { return };
    for (key, algorithm) in [
        ("sha256", TsigAlgorithm::HmacSha256),
        ("sha512", TsigAlgorithm::HmacSha512),
        ("md5", TsigAlgorithm::HmacMd5),
    ] {
        let dns = dns(&rfc2136(server, key, algorithm), server);
        let host = format!("{}.{ZONE}", unique(key));
        let record = dns.record_for(&host, format!("value-{key}")).await.unwrap();
        assert_eq!(record.fqdn, format!("_acme-challenge.{host}."));
        dns.present(&record)
            .await
            .unwrap_or_else(|e| panic!("{key}: {e}"));
        dns.wait_served(std::slice::from_ref(&record))
            .await
            .unwrap();
        assert_eq!(
            served(server, &record.fqdn).await,
            std::slice::from_ref(&record.value)
        );
        dns.cleanup(&record).await.unwrap();
        assert!(
            served(server, &record.fqdn).await.is_empty(),
            "{key}: removed"
        );
        // Removing what is not there is no error (a cleanup run twice).
        dns.cleanup(&record).await.unwrap();
    }
}

#[tokio::test]
async fn a_wildcard_and_its_apex_share_one_name_with_two_values() {
    let Some(server) = server() else { return };
    let dns = dns(
        &rfc2136(server, "sha256", TsigAlgorithm::HmacSha256),
        server,
    );
    let apex = format!("{}.{ZONE}", unique("apex"));
    let a = dns
        .record_for(&apex, "apex-value".to_owned())
        .await
        .unwrap();
    let w = dns
        .record_for(&format!("*.{apex}"), "wildcard-value".to_owned())
        .await
        .unwrap();
    assert_eq!(a.fqdn, w.fqdn, "one _acme-challenge name for both");
    dns.present(&a).await.unwrap();
    dns.present(&w).await.unwrap();
    dns.wait_served(&[a.clone(), w.clone()]).await.unwrap();
    let mut values = served(server, &a.fqdn).await;
    values.sort();
    assert_eq!(values, ["apex-value", "wildcard-value"]);
    dns.cleanup(&a).await.unwrap();
    assert_eq!(
        served(server, &a.fqdn).await,
        ["wildcard-value"],
        "only its own value goes"
    );
    dns.cleanup(&w).await.unwrap();
    assert!(served(server, &a.fqdn).await.is_empty());
}

#[tokio::test]
async fn a_refused_key_says_the_servers_codes() {
    let Some(server) = server() else { return };
    let host = format!("{}.{ZONE}", unique("refused"));
    let record = TxtRecord {
        fqdn: format!("_acme-challenge.{host}."),
        value: "v".to_owned(),
    };
    // The right name with another secret: BADSIG.
    let mut wrong = rfc2136(server, "sha256", TsigAlgorithm::HmacSha256);
    wrong.tsig_secret = Some("c2VjcmV0LW5vdC1rbm93bi10by1iaW5k".to_owned());
    let e = dns(&wrong, server)
        .present(&record)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("NOTAUTH") && e.contains("BADSIG"), "{e}");
    // A name the server does not know: BADKEY.
    let mut unknown = rfc2136(server, "sha256", TsigAlgorithm::HmacSha256);
    unknown.tsig_key_name = Some("no-such-key.".to_owned());
    let e = dns(&unknown, server)
        .present(&record)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("NOTAUTH") && e.contains("BADKEY"), "{e}");
    // A key the policy does not allow in this zone: REFUSED.
    let narrow = rfc2136(server, "narrow", TsigAlgorithm::HmacSha256);
    let e = dns(&narrow, server)
        .present(&record)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("REFUSED") && e.contains("update policy"), "{e}");
    assert!(
        served(server, &record.fqdn).await.is_empty(),
        "nothing written"
    );
}

#[tokio::test]
async fn a_zone_the_server_does_not_serve_and_a_server_that_is_not_there() {
    let Some(server) = server() else { return };
    let dns1 = dns(
        &rfc2136(server, "sha256", TsigAlgorithm::HmacSha256),
        server,
    );
    let record = TxtRecord {
        fqdn: "_acme-challenge.www.example.org.".to_owned(),
        value: "v".to_owned(),
    };
    let e = dns1.present(&record).await.unwrap_err();
    assert!(matches!(e, DnsError::NoZone { .. }), "{e}");
    assert!(e.to_string().contains("REFUSED"), "{e}");
    // Nothing listens there: said as unreachable, within the exchange's limit.
    let closed = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let gone = closed.local_addr().unwrap();
    drop(closed);
    let mut section = rfc2136(gone, "sha256", TsigAlgorithm::HmacSha256);
    section.nameserver = Some(gone.to_string());
    let started = std::time::Instant::now();
    let e = Dns01::new(&section, &[server], env, Arc::new(Metrics::new()))
        .unwrap()
        .present(&TxtRecord {
            fqdn: format!("_acme-challenge.{}.{ZONE}.", unique("gone")),
            value: "v".to_owned(),
        })
        .await
        .unwrap_err();
    assert!(matches!(e, DnsError::Unreachable { .. }), "{e}");
    assert!(e.to_string().contains(&gone.to_string()), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(12),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_missing_secret_is_named() {
    let Some(server) = server() else { return };
    let mut section = rfc2136(server, "sha256", TsigAlgorithm::HmacSha256);
    section.tsig_secret = Some("env:SBMESH_NO_SUCH_SECRET".to_owned());
    let e = Dns01::new(&section, &[server], env, Arc::new(Metrics::new())).unwrap_err();
    assert!(
        matches!(&e, DnsError::Config(m) if m.contains("SBMESH_NO_SUCH_SECRET")),
        "{e}"
    );
    section.tsig_secret = Some("file:/nonexistent/tsig.secret".to_owned());
    let e = Dns01::new(&section, &[server], env, Arc::new(Metrics::new())).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/tsig.secret"), "{e}");
}

#[tokio::test]
async fn a_cname_delegates_the_challenge_to_another_zone() {
    let Some(server) = server() else { return };
    let label = unique("cname");
    let host = format!("{label}.{ZONE}");
    let target = format!("_acme-challenge.{label}.{DELEGATED}.");
    cname(server, &host, &target).await;
    // The narrow key may write only in the delegated zone, which is enough.
    let dns = dns(
        &rfc2136(server, "narrow", TsigAlgorithm::HmacSha256),
        server,
    );
    let record = dns.record_for(&host, "delegated".to_owned()).await.unwrap();
    assert_eq!(record.fqdn, target, "the CNAME followed");
    dns.present(&record).await.unwrap();
    dns.wait_served(std::slice::from_ref(&record))
        .await
        .unwrap();
    assert_eq!(served(server, &target).await, ["delegated"]);
    dns.cleanup(&record).await.unwrap();
    assert!(served(server, &target).await.is_empty());
}

#[tokio::test]
async fn propagation_times_out_naming_the_server_that_lacks_the_value() {
    let Some(server) = server() else { return };
    let mut section = rfc2136(server, "sha256", TsigAlgorithm::HmacSha256);
    section.propagation_timeout = Duration::from_secs(1);
    let dns = dns(&section, server);
    let record = TxtRecord {
        fqdn: format!("_acme-challenge.{}.{ZONE}.", unique("never")),
        value: "never-written".to_owned(),
    };
    let e = dns.wait_served(&[record]).await.unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, DnsError::NotPropagated { .. }), "{text}");
    assert!(
        text.contains("ns1.dns01.test.") && text.contains("1s"),
        "{text}"
    );
}

#[tokio::test]
async fn the_exec_provider_runs_the_users_command() {
    let Some(server) = server() else { return };
    let dir = tempfile::tempdir().unwrap();
    let hook = dir.path().join("dns-hook");
    let log = dir.path().join("calls");
    // What a user writes: nsupdate with its own key, and a log of calls.
    std::fs::write(
        &hook,
        format!(
            "#!/bin/sh\nset -e\necho \"$@\" >> {log}\nop=add; [ \"$1\" = cleanup ] && op=delete\n\
             printf 'server {ip} {port}\\nupdate %s %s 60 TXT \"%s\"\\nsend\\n' \"$op\" \"$2\" \"$3\" \\\n\
             | nsupdate -y \"hmac-sha256:sbmesh-sha256.:$SBMESH_TEST_TSIG_SHA256\"\n",
            log = log.display(),
            ip = server.ip(),
            port = server.port()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let section = Dns01Section {
        command: Some(hook.clone()),
        propagation_timeout: Duration::from_secs(10),
        ..Dns01Section::new(DnsProvider::Exec)
    };
    let dns = dns(&section, server);
    let host = format!("{}.{ZONE}", unique("exec"));
    let record = dns
        .record_for(&host, "exec-value".to_owned())
        .await
        .unwrap();
    dns.present(&record).await.unwrap();
    dns.wait_served(std::slice::from_ref(&record))
        .await
        .unwrap();
    assert_eq!(served(server, &record.fqdn).await, ["exec-value"]);
    dns.cleanup(&record).await.unwrap();
    assert!(served(server, &record.fqdn).await.is_empty());
    let calls = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        calls,
        format!(
            "present {0} exec-value\ncleanup {0} exec-value\n",
            record.fqdn
        )
    );
    // A failing command: its status and stderr in the error.
    let failing = dir.path().join("failing");
    std::fs::write(
        &failing,
        "#!/bin/sh\necho 'no credentials for zone' >&2\nexit 3\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &failing,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let section = Dns01Section {
        command: Some(PathBuf::from(&failing)),
        ..section
    };
    let e = super::Dns01::new(&section, &[server], env, Arc::new(Metrics::new()))
        .unwrap()
        .present(&record)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("exit status: 3") && e.contains("no credentials for zone"),
        "{e}"
    );
}

/// moto's endpoint (`scripts/test`'s `s3` server, which serves Route 53
/// too, and exports `AWS_ENDPOINT_URL` and test credentials), or `None`.
fn moto() -> Option<String> {
    match std::env::var("SBMESH_TEST_S3_ENDPOINT") {
        Ok(v) => Some(v),
        Err(_) => required::missing(
            "route53",
            "SBMESH_TEST_S3_ENDPOINT is not set",
            "scripts/test starts moto",
        ),
    }
}

/// Creates the hosted zone `name` at moto; its id.
async fn create_zone(r53: &super::route53::Route53, name: &str) -> String {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><CreateHostedZoneRequest \
         xmlns=\"https://route53.amazonaws.com/doc/2013-04-01/\"><Name>{name}</Name>\
         <CallerReference>{}</CallerReference></CreateHostedZoneRequest>",
        unique("ref")
    );
    let bytes = r53
        .call(
            "create a zone",
            hyper::Method::POST,
            "/hostedzone",
            Some(body),
        )
        .await
        .expect("moto creates the zone");
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let id = text
        .split("<Id>")
        .nth(1)
        .and_then(|rest| rest.split("</Id>").next())
        .expect("a zone id");
    id.trim_start_matches("/hostedzone/").to_owned()
}

#[tokio::test]
async fn route53_adds_and_removes_one_value_of_a_shared_name() {
    if moto().is_none() {
        return;
    }
    let section = Dns01Section::new(DnsProvider::Route53);
    let r53 = super::route53::Route53::new(&section).expect("route53");
    let zone = format!("{}.test.", unique("r53"));
    let id = create_zone(&r53, &zone).await;
    // Found from the name (no hosted_zone_id), a wildcard and its apex on
    // one name.
    let fqdn = format!("_acme-challenge.{zone}");
    let apex = TxtRecord {
        fqdn: fqdn.clone(),
        value: "apex-value".to_owned(),
    };
    let wildcard = TxtRecord {
        fqdn: fqdn.clone(),
        value: "wildcard-value".to_owned(),
    };
    let metrics = Arc::new(Metrics::new());
    let dns = Dns01::new(&section, &[], env, metrics.clone()).expect("settings");
    dns.present(&apex).await.unwrap();
    dns.present(&wildcard).await.unwrap();
    dns.wait_served(&[apex.clone(), wildcard.clone()])
        .await
        .unwrap();
    assert!(
        metrics
            .encode()
            .contains("acme_dns_propagation_seconds_count 2"),
        "each change's wait to INSYNC observed"
    );
    let mut values = r53.values(&id, &fqdn).await.unwrap();
    values.sort();
    assert_eq!(values, ["apex-value", "wildcard-value"]);
    dns.cleanup(&apex).await.unwrap();
    assert_eq!(r53.values(&id, &fqdn).await.unwrap(), ["wildcard-value"]);
    dns.cleanup(&wildcard).await.unwrap();
    assert!(r53.values(&id, &fqdn).await.unwrap().is_empty());
    // Removing what is not there is no error.
    dns.cleanup(&wildcard).await.unwrap();
    // The zone given by id.
    let given = Dns01Section {
        hosted_zone_id: Some(id.clone()),
        ..Dns01Section::new(DnsProvider::Route53)
    };
    let dns = Dns01::new(&given, &[], env, Arc::new(Metrics::new())).unwrap();
    let deep = TxtRecord {
        fqdn: format!("_acme-challenge.a.b.{zone}"),
        value: "deep".to_owned(),
    };
    dns.present(&deep).await.unwrap();
    assert_eq!(r53.values(&id, &deep.fqdn).await.unwrap(), ["deep"]);
    dns.cleanup(&deep).await.unwrap();
    // A name in no zone of the account: said so.
    let dns = Dns01::new(&section, &[], env, Arc::new(Metrics::new())).unwrap();
    let e = dns
        .present(&TxtRecord {
            fqdn: format!("_acme-challenge.{}.nowhere.", unique("x")),
            value: "v".to_owned(),
        })
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("no hosted zone of this account holds"), "{e}");
}

/// Orders of different certificates that write one name at once (a
/// wildcard's and its apex's, ordered per host by two replicas) take turns
/// under the name's lock in the store. Route 53 keeps one set of values
/// per name, changed by reading it and writing it back: without the turns,
/// all but one of the values written at once are lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn route53_orders_writing_one_name_at_once_lose_no_value() {
    if moto().is_none() {
        return;
    }
    let section = Dns01Section::new(DnsProvider::Route53);
    let r53 = super::route53::Route53::new(&section).expect("route53");
    let zone = format!("{}.test.", unique("r53race"));
    let id = create_zone(&r53, &zone).await;
    let fqdn = format!("_acme-challenge.{zone}");
    let dns = Dns01::new(&section, &[], env, Arc::new(Metrics::new())).expect("settings");
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mut held = Vec::new();
    for i in 0..6 {
        let holder = format!("replica-{i}");
        let lease = LeaseLock::new(Arc::clone(&store), &format!("order-{i}"))
            .try_acquire(&holder, Duration::from_secs(300))
            .await
            .unwrap()
            .expect("a free order lock");
        held.push((holder, format!("acme/dir/dns01/set-{i}"), lease));
    }
    let orders: Vec<Dns01Order<'_>> = held
        .iter()
        .map(|(holder, ledger, lease)| {
            Dns01Order::new(&dns, &store, ledger.clone(), lease.clone(), holder)
        })
        .collect();
    let records: Vec<TxtRecord> = (0..6)
        .map(|i| TxtRecord {
            fqdn: fqdn.clone(),
            value: format!("value-{i}"),
        })
        .collect();
    let (orders, records) = (&orders, &records);
    let at_once = |add: bool| async move {
        let (a, b, c, d, e, f) = tokio::join!(
            orders[0].change(&records[0], add),
            orders[1].change(&records[1], add),
            orders[2].change(&records[2], add),
            orders[3].change(&records[3], add),
            orders[4].change(&records[4], add),
            orders[5].change(&records[5], add),
        );
        for result in [a, b, c, d, e, f] {
            result.expect("the change");
        }
    };
    at_once(true).await;
    let mut values = r53.values(&id, &fqdn).await.unwrap();
    values.sort();
    let all: Vec<String> = (0..6).map(|i| format!("value-{i}")).collect();
    assert_eq!(values, all, "every order's value at {fqdn}");
    at_once(false).await;
    let left = r53.values(&id, &fqdn).await.unwrap();
    assert!(left.is_empty(), "left at {fqdn}: {left:?}");
}
