//! Issue 2: a 3/3 partition of six real sidecar processes heals by itself.
//!
//! Runs inside a private network namespace: the test re-executes its own
//! binary under `unshare -rn` (no root needed; `lo` is brought up inside),
//! starts six nodes on 127.0.21.1-6, cuts {1,2,3} from {4,5,6} with iptables
//! DROP rules on `lo` in both directions, waits until each side marks the
//! other `down`, deletes the rules and waits for one mesh of six again — with
//! the same six processes (no restart).
//!
//! Needs `unshare` (util-linux), `ip` (iproute2) and `iptables`;
//! `scripts/test` installs them. Without `unshare` support the test is
//! skipped with a message, except in CI or under `scripts/test` (which sets
//! `SBMESH_TEST_REQUIRE_SERVERS`), where it fails.

mod common;

use common::{
    Cluster, enter_netns_test, iptables, netns_test_passed, require_iptables, state_of, total_nodes,
};

const TEST_NAME: &str = "three_three_partition_heals_without_restart";

#[test]
fn three_three_partition_heals_without_restart() {
    if !enter_netns_test(TEST_NAME) {
        return;
    }
    require_iptables();

    let c = Cluster::start("127.0.21", 6);
    let all = c.all();
    c.wait_converged(&all);
    let pids: Vec<u32> = all.iter().map(|&i| c.nodes[i].pid().unwrap()).collect();

    let side_a: Vec<usize> = vec![0, 1, 2];
    let side_b: Vec<usize> = vec![3, 4, 5];
    let mut rules: Vec<Vec<String>> = Vec::new();
    for &a in &side_a {
        for &b in &side_b {
            let (ia, ib) = (
                c.nodes[a].opts.ip.to_string(),
                c.nodes[b].opts.ip.to_string(),
            );
            for (src, dst) in [(&ia, &ib), (&ib, &ia)] {
                rules.push(
                    ["INPUT", "-i", "lo", "-s", src, "-d", dst, "-j", "DROP"]
                        .iter()
                        .map(|s| s.to_string())
                        .collect(),
                );
            }
        }
    }
    for r in &rules {
        let mut args = vec!["-A"];
        args.extend(r.iter().map(String::as_str));
        iptables(&args);
    }
    eprintln!("partition: {} DROP rules installed", rules.len());

    let a_ids = c.ids(&side_a);
    let b_ids = c.ids(&side_b);
    c.wait_until(
        "each side shows the other side down and total_nodes 3",
        || {
            let check = |mine: &[usize], own: &[String], other: &[String]| {
                mine.iter().all(|&i| {
                    c.nodes[i].status().is_some_and(|v| {
                        total_nodes(&v) == Some(3)
                            && own
                                .iter()
                                .all(|id| state_of(&v, id).as_deref() == Some("alive"))
                            && other
                                .iter()
                                .all(|id| state_of(&v, id).as_deref() == Some("down"))
                    })
                })
            };
            check(&side_a, &a_ids, &b_ids) && check(&side_b, &b_ids, &a_ids)
        },
    );

    for r in &rules {
        let mut args = vec!["-D"];
        args.extend(r.iter().map(String::as_str));
        iptables(&args);
    }
    eprintln!("partition removed");

    c.wait_converged(&all);
    for (k, &i) in all.iter().enumerate() {
        assert!(
            c.nodes[i].is_running() && c.nodes[i].pid() == Some(pids[k]),
            "{} was restarted or died: {}",
            c.nodes[i].id(),
            c.nodes[i].describe()
        );
    }
    netns_test_passed();
}
