//! Mesh nodes in one process on real sockets: join, metadata propagation,
//! graceful leave, and a key ring that does not match.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sbmesh::{ClusterStatus, MemberState, Mesh, MeshConfig, Metrics, NodeMeta};

const KEY: [u8; 32] = [0x42; 32];

async fn node(
    name: &str,
    ip: &str,
    seeds: Vec<String>,
    keys: Vec<[u8; 32]>,
) -> (Mesh, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let mut cfg = MeshConfig::new(name, "inproc", keys);
    cfg.bind = ip.parse().unwrap();
    (cfg.gossip_port, cfg.transport_port) = (0, 0);
    (cfg.seeds.seeds, cfg.seeds.gossip_port) = (seeds, 0);
    let mesh = Mesh::start(
        cfg,
        metrics.clone(),
        NodeMeta {
            version: "test".into(),
            ready: true,
            ..Default::default()
        },
    )
    .await
    .expect("mesh starts");
    (mesh, metrics)
}

async fn wait_for(mesh: &Mesh, what: &str, pred: impl Fn(&ClusterStatus) -> bool) -> ClusterStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = mesh.status().await.expect("mesh answers");
        if pred(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; last status: {s:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn addr(m: &Mesh) -> String {
    let a: SocketAddr = m.local().gossip;
    a.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_join_share_metadata_and_leave() {
    let (a, _) = node("a", "127.0.31.1", vec![], vec![KEY]).await;
    let (b, _) = node("b", "127.0.31.2", vec![addr(&a)], vec![KEY]).await;
    let (c, _) = node("c", "127.0.31.3", vec![addr(&a)], vec![KEY]).await;
    for m in [&a, &b, &c] {
        wait_for(m, "3 members", |s| s.summary.total_nodes == 3).await;
    }
    let moved = |m: &Mesh, since: u64| m.view_changes() != since;
    let view_before_meta = a.view_changes();

    // Metadata published on c reaches a.
    c.set_meta(NodeMeta {
        version: "test".into(),
        ready: true,
        config_hash: Some("sha256:abc".into()),
        proxy: Some(sbmesh::ProxyInfo {
            restarts: 2,
            last_restart_unix_ms: Some(1_795_960_276_000),
        }),
        ..Default::default()
    })
    .await;
    let s = wait_for(&a, "c's config hash", |s| {
        s.nodes
            .iter()
            .any(|n| n.node_id == "c" && n.config_hash.as_deref() == Some("sha256:abc"))
    })
    .await;
    assert_eq!(s.summary.config_hashes.get("sha256:abc"), Some(&1));
    // A changed record moves the view's change count.
    assert!(moved(&a, view_before_meta));
    // Its proxy restarts show in status (`nodes[].proxy`).
    let json = serde_json::to_value(&s).unwrap();
    let c_json = json["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node_id"] == "c")
        .unwrap();
    assert_eq!(
        c_json["proxy"],
        serde_json::json!({ "restarts": 2, "last_restart_unix_ms": 1_795_960_276_000u64 })
    );
    // A node without restarts shows none.
    let a_json = json["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["node_id"] == "a")
        .unwrap();
    assert!(a_json.get("proxy").is_none());

    // A graceful leave shows as down on the others, and moves the count.
    let view_before_leave = [a.view_changes(), c.view_changes()];
    b.leave().await;
    for (m, since) in [&a, &c].into_iter().zip(view_before_leave) {
        let s = wait_for(m, "b down", |s| {
            s.nodes
                .iter()
                .any(|n| n.node_id == "b" && n.membership_state == MemberState::Down)
        })
        .await;
        assert_eq!(s.summary.total_nodes, 2);
        assert_eq!(s.summary.down_nodes, 1);
        assert!(moved(m, since));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_another_key_never_joins() {
    let (a, metrics) = node("a", "127.0.32.1", vec![], vec![KEY]).await;
    let (x, _) = node("x", "127.0.32.2", vec![addr(&a)], vec![[0x13; 32]]).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !metrics
        .encode()
        .contains("mesh_packets_rejected_total{reason=\"decrypt\"} ")
        || {
            let t = metrics.encode();
            t.contains("mesh_packets_rejected_total{reason=\"decrypt\"} 0\n")
        }
    {
        assert!(Instant::now() < deadline, "no decrypt rejection counted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(a.status().await.unwrap().summary.total_nodes, 1);
    assert_eq!(x.status().await.unwrap().summary.total_nodes, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_nodes_form_a_mesh() {
    // Skip quietly only where the host has no IPv6 loopback at all.
    if std::net::UdpSocket::bind("[::1]:0").is_err() {
        eprintln!("SKIP: no IPv6 loopback on this host");
        return;
    }
    let (a, _) = node("a6", "::1", vec![], vec![KEY]).await;
    let (b, _) = node("b6", "::1", vec![addr(&a)], vec![KEY]).await;
    for m in [&a, &b] {
        let s = wait_for(m, "2 members over IPv6", |s| s.summary.total_nodes == 2).await;
        assert!(
            s.nodes.iter().all(|n| n.address.starts_with("[::1]:")),
            "{s:#?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rings_new_old_and_old_interoperate() {
    let old = [0x01; 32];
    let new = [0x02; 32];
    let (a, _) = node("a", "127.0.33.1", vec![], vec![new, old]).await;
    let (b, _) = node("b", "127.0.33.2", vec![addr(&a)], vec![old]).await;
    for m in [&a, &b] {
        wait_for(m, "2 members across a key rotation", |s| {
            s.summary.total_nodes == 2
        })
        .await;
    }
}
