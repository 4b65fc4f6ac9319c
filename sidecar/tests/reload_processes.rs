//! Hot reload across real sidecar processes: after a ConfigMap-style change,
//! each sidecar POSTs its proxy once, and every node's status shows every
//! node's new config hash (docs/reference.md#cluster-status, docs/reference.md#hot-reload).

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::Cluster;

/// A stand-in proxy admin: answers 200 to every request, counting them.
fn stand_in_proxy(ip: &str) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind(format!("{ip}:0")).expect("bind stand-in proxy");
    let url = format!("http://{}/admin/reload", listener.local_addr().unwrap());
    let posts = Arc::new(AtomicUsize::new(0));
    let counter = posts.clone();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            if buf.starts_with(b"POST /admin/reload") {
                counter.fetch_add(1, Ordering::SeqCst);
            }
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    (url, posts)
}

#[test]
fn a_config_change_reaches_every_proxy_and_every_status() {
    let (url, posts) = stand_in_proxy("127.0.22.100");
    let mut c = Cluster::new("127.0.22");
    for i in 1..=3 {
        let mut o = c.default_opts(i, 3);
        o.extra_args = vec![
            "--proxy-reload-url".into(),
            url.clone(),
            "--reload-debounce-ms".into(),
            "50".into(),
        ];
        c.spawn(o);
    }
    let all = c.all();
    c.wait_converged(&all);
    let before = sbmesh::config::sha256_hex(common::SB_YML.as_bytes());
    c.wait_until("every node shows the initial config hash", || {
        all.iter().all(|&i| {
            c.nodes[i]
                .status()
                .is_some_and(|s| s["summary"]["config_hashes"][format!("sha256:{before}")] == 3)
        })
    });
    assert_eq!(
        posts.load(Ordering::SeqCst),
        0,
        "unchanged content was POSTed"
    );

    // An editor-style replace of the shared file (all three read it).
    let new = format!("{}# edited\n", common::SB_YML);
    let tmp = c.config.with_extension("yml.tmp");
    std::fs::write(&tmp, &new).unwrap();
    std::fs::rename(&tmp, &c.config).unwrap();
    let after = format!("sha256:{}", sbmesh::config::sha256_hex(new.as_bytes()));
    c.wait_until("every node shows every node's new config hash", || {
        all.iter().all(|&i| {
            c.nodes[i].status().is_some_and(|s| {
                s["summary"]["config_hashes"][after.as_str()] == 3
                    && s["nodes"]
                        .as_array()
                        .is_some_and(|n| n.iter().all(|n| n["last_reload"]["result"] == "ok"))
            })
        })
    });
    assert_eq!(posts.load(Ordering::SeqCst), 3, "one POST per sidecar");
}
