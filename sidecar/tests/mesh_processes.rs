//! Issue 2, test 1: five real `sbmesh-sidecar run` processes on
//! 127.0.11.1-5, all on port 7946. They converge; a `kill -9`'d member is
//! marked `down` by everyone; restarted under the same node id it comes back
//! `alive` with a higher incarnation and no stale entry; a SIGTERM'd member
//! leaves (peers see `down`) and its process exits 0.
//!
//! How fast the peers notice is measured in `benches/mesh_scale.rs`, not
//! asserted here: every wait below polls with a generous deadline.

mod common;

use common::{
    Cluster, deadline, describe_exit, incarnation_of, node_entries, state_of, total_nodes,
};

#[test]
fn five_processes_converge_detect_kill_rejoin_and_leave() {
    let mut c = Cluster::start("127.0.11", 5);
    let all = c.all();
    c.wait_converged(&all);

    // ---- kill -9 node-3 ------------------------------------------------
    let victim = c.idx("node-3");
    let victim_id = c.nodes[victim].id().to_string();
    // The highest incarnation anyone (the victim included) knows for it.
    let before = all
        .iter()
        .filter_map(|&i| c.nodes[i].status())
        .filter_map(|v| incarnation_of(&v, &victim_id))
        .max()
        .expect("somebody reports node-3's incarnation");
    eprintln!("node-3 incarnation before kill -9: {before}");

    c.nodes[victim].kill9();
    let survivors: Vec<usize> = all.iter().copied().filter(|&i| i != victim).collect();
    c.wait_until("every survivor shows node-3 down and total_nodes 4", || {
        survivors.iter().all(|&i| {
            c.nodes[i].status().is_some_and(|v| {
                total_nodes(&v) == Some(4) && state_of(&v, &victim_id).as_deref() == Some("down")
            })
        })
    });

    // ---- restart it under the same node id --------------------------------
    c.nodes[victim].restart();
    c.wait_until(
        "every node shows total_nodes 5, node-3 listed once, alive, with a higher incarnation",
        || {
            all.iter().all(|&i| {
                c.nodes[i].status().is_some_and(|v| {
                    let entries = node_entries(&v, &victim_id);
                    total_nodes(&v) == Some(5)
                        && entries.len() == 1
                        && entries[0].get("membership_state").and_then(|s| s.as_str())
                            == Some("alive")
                        && entries[0]
                            .get("incarnation")
                            .and_then(|s| s.as_u64())
                            .is_some_and(|inc| inc > before)
                })
            })
        },
    );
    // And nobody else got lost on the way.
    c.wait_converged(&all);
    for &i in &all {
        let v = c.nodes[i].status().expect("status");
        let ids = common::listed_ids(&v);
        let mut dedup = ids.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(
            ids.len(),
            dedup.len(),
            "{} lists a node twice: {ids:?}",
            c.nodes[i].id()
        );
    }

    // ---- SIGTERM node-5: graceful leave ----------------------------------
    let leaver = c.idx("node-5");
    let leaver_id = c.nodes[leaver].id().to_string();
    c.nodes[leaver].sigterm();
    let rest: Vec<usize> = all.iter().copied().filter(|&i| i != leaver).collect();
    c.wait_until(
        "every peer shows node-5 down and total_nodes 4 after its SIGTERM",
        || {
            rest.iter().all(|&i| {
                c.nodes[i].status().is_some_and(|v| {
                    total_nodes(&v) == Some(4)
                        && state_of(&v, &leaver_id).as_deref() == Some("down")
                })
            })
        },
    );
    let st = c.nodes[leaver].wait_exit(deadline());
    match st {
        Some(st) => assert_eq!(
            st.code(),
            Some(0),
            "node-5 after SIGTERM: {}; log:\n{}",
            describe_exit(st),
            c.nodes[leaver].log_tail(40)
        ),
        None => {
            c.dump();
            panic!("node-5 still runs {:?} after SIGTERM", deadline());
        }
    }
    // The others are still one mesh of 4.
    c.wait_converged(&rest);
}
