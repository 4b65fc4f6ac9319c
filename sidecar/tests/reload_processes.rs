//! Hot reload across pods, each a sidecar beside the real sbproxy 1.13
//! (`SBMESH_TEST_SBPROXY`), all reading one config file as a ConfigMap's
//! mount is read: after an editor-style replace of it, every proxy answers
//! with the new config, every sidecar POSTed its own proxy's
//! `/admin/reload` exactly once (the proxy's audit log says so), and every
//! node's status shows every node's new config hash
//! (docs/reference.md#cluster-status, docs/reference.md#hot-reload).
//!
//! Both reloads are live, as in a pod: the proxy's own file watcher and the
//! sidecar's POST (the proxy's `config_audit` lines tell them apart by
//! `source`).
//!
//! Address block 127.0.22.1-3. Needs root (PID namespaces) and the real
//! sbproxy (`scripts/test` finds it).

mod common;

use std::net::{Ipv4Addr, SocketAddr};

use common::pods::{HTTP_PORT, Pod, http_get_host, mesh_args, proxy_listeners};
use common::{deadline, poll_until, sbproxy_bin, write_atomic};

const HOST: &str = "reload.example.com";

/// The pods' config: the proxy's listeners on the pod's address, one
/// origin answering `body`.
fn config(body: &str) -> String {
    format!(
        "proxy:\n{}origins:\n  \"{HOST}\": {{ action: {{ type: static, status_code: 200, body: \"{body}\" }} }}\n",
        proxy_listeners()
    )
}

/// What the proxy of `pod` answers for [`HOST`].
fn answer(pod: &Pod) -> Option<String> {
    http_get_host(SocketAddr::from((pod.ip, HTTP_PORT)), HOST, "/", None)
        .and_then(|(status, body)| (status == 200).then_some(body))
}

/// The reloads the proxy of `pod` logged: `(POSTs to /admin/reload, its
/// own watcher's reloads)`.
fn proxy_reloads(pod: &Pod) -> (usize, usize) {
    let log = std::fs::read_to_string(pod.dir.join("proxy.log")).unwrap_or_default();
    let posts = log
        .lines()
        .filter(|l| l.contains("admin action") && l.contains("method=POST path=/admin/reload"))
        .count();
    let watched = log
        .lines()
        .filter(|l| l.contains("config_audit") && l.contains("\"source\":\"file_watcher\""))
        .count();
    (posts, watched)
}

/// Every pod's status shows all three nodes on `hash` (`sha256:...`), each
/// with `last_reload.result == want` when `want` is given.
fn every_status_shows(pods: &[Pod], hash: &str, want: Option<&str>) -> bool {
    pods.iter().all(|p| {
        p.status().is_some_and(|s| {
            s["summary"]["config_hashes"][hash] == 3
                && want.is_none_or(|want| {
                    s["nodes"]
                        .as_array()
                        .is_some_and(|n| n.iter().all(|n| n["last_reload"]["result"] == want))
                })
        })
    })
}

#[test]
fn a_config_change_reaches_every_proxy_and_every_status() {
    let Some(sbproxy) = sbproxy_bin("a_config_change_reaches_every_proxy_and_every_status") else {
        return;
    };
    let base = tempfile::tempdir().unwrap();
    // The config in a folder of its own, as a ConfigMap's mount is.
    let etc = base.path().join("etc");
    std::fs::create_dir_all(&etc).unwrap();
    let config_path = etc.join("sb.yml");
    let before = config("before");
    write_atomic(&config_path, &before);
    let ips: Vec<Ipv4Addr> = (1..=3).map(|i| Ipv4Addr::new(127, 0, 22, i)).collect();
    let cluster_id = format!("reload-{}", std::process::id());
    let pods = Pod::fleet(&sbproxy, &ips, base.path(), &config_path, |i| {
        let mut args = mesh_args(i, &ips, &cluster_id, base.path());
        args.extend(["--challenge-listen".to_owned(), format!("{}:8089", ips[i])]);
        args
    });
    let logs = || pods.iter().map(Pod::logs).collect::<String>();

    assert!(
        poll_until(deadline(), || pods
            .iter()
            .all(|p| answer(p).as_deref() == Some("before"))),
        "every proxy answering \"before\" for {HOST}:\n{}",
        logs()
    );
    let hash = |text: &str| format!("sha256:{}", sbmesh::sha256_hex(text.as_bytes()));
    assert!(
        poll_until(deadline(), || every_status_shows(
            &pods,
            &hash(&before),
            None
        )),
        "every node showing the initial config hash on every node:\n{}",
        logs()
    );
    for p in &pods {
        assert_eq!(
            proxy_reloads(p).0,
            0,
            "{}: the sidecar POSTed a reload of unchanged content:\n{}",
            p.name,
            p.logs()
        );
    }

    // An editor-style replace of the shared file.
    let after = config("after");
    write_atomic(&config_path, &after);
    assert!(
        poll_until(deadline(), || pods
            .iter()
            .all(|p| answer(p).as_deref() == Some("after"))),
        "every proxy answering \"after\" for {HOST}: {:?}\n{}",
        pods.iter().map(answer).collect::<Vec<_>>(),
        logs()
    );
    assert!(
        poll_until(deadline(), || every_status_shows(
            &pods,
            &hash(&after),
            Some("ok")
        )),
        "every node showing every node's new config hash, reloaded ok:\n{}",
        logs()
    );
    // A second POST would come within the debounce (50 ms); wait well past it.
    std::thread::sleep(std::time::Duration::from_secs(1));
    for p in &pods {
        let (posts, watched) = proxy_reloads(p);
        assert_eq!(
            posts,
            1,
            "{}: POSTs to the proxy's /admin/reload after one edit:\n{}",
            p.name,
            p.logs()
        );
        assert!(
            watched >= 1,
            "{}: the proxy's own watcher did not reload the edit:\n{}",
            p.name,
            p.logs()
        );
    }
}
