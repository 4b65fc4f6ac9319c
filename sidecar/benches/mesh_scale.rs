//! Mesh at scale: N real `sbmesh-sidecar run` processes, one per 127.0.31.y
//! address, all on port 7946, each seeded with the full list (as a
//! StatefulSet's pods are). Prints one markdown table row for BENCHMARKS.md.
//!
//! ```text
//! SBMESH_BENCH_N=32  cargo bench -p sbmesh-sidecar --bench mesh_scale
//! SBMESH_BENCH_N=128 cargo bench -p sbmesh-sidecar --bench mesh_scale
//! # false `down` events under 10 % random loss on lo, 10 minutes, in `unshare -rn`:
//! SBMESH_BENCH_N=32 SBMESH_BENCH_LOSS=0.10 SBMESH_BENCH_SECS=600 \
//!     cargo bench -p sbmesh-sidecar --bench mesh_scale
//! ```
//!
//! `cargo bench` builds the sidecar with the bench profile (= release) and
//! this bench runs that binary (`target/release/sbmesh-sidecar`);
//! `SBMESH_SIDECAR_BIN=path` runs another one.
//!
//! Measured (status = `GET /admin/cluster/status`, polled every 100 ms —
//! `SBMESH_BENCH_POLL_MS` — per node from 16 threads):
//! - converge: from the moment the last process was spawned until every
//!   node's status shows `total_nodes = N`;
//! - kill -9: from the SIGKILL of one node until every survivor shows it
//!   `down`;
//! - SIGTERM: from the SIGTERM of another node until every survivor shows it
//!   `down` (and its exit code);
//! - bytes/node/s: `mesh_bytes_sent_total` (udp + tcp) deltas per node over
//!   `SBMESH_BENCH_STEADY_SECS` (20) at steady state, after
//!   `SBMESH_BENCH_SETTLE_SECS` (30) of settling (the join tail);
//! - RSS: VmRSS of every process at steady state, median and max.
//!
//! With `SBMESH_BENCH_LOSS=p` the bench re-executes itself inside
//! `unshare -rn`, converges without loss, then adds
//! `iptables -A INPUT -i lo -m statistic --mode random --probability p -j DROP`
//! for `SBMESH_BENCH_SECS` (600) seconds, polls every status every 2 s for
//! `down`/`suspect` entries, and at the end counts false `down` transitions as
//! the increase of `mesh_member_state_changes_total{state="down"}` summed over
//! all nodes (nobody is killed in that mode, so every one is false).
//!
//! Every wait is bounded (`SBMESH_BENCH_TIMEOUT_SECS`, 180 s) and every
//! process started is killed at the end, by PID.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;
use serde::Deserialize;
use serde_json::Value;

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("{name}={s:?} does not parse")),
        Err(_) => default,
    }
}

fn fetch_status(addr: SocketAddr) -> Option<Value> {
    let r = http_get(
        addr,
        "/admin/cluster/status",
        Some((ADMIN_USER, ADMIN_PASSWORD)),
    )
    .ok()?;
    if r.status != 200 {
        return None;
    }
    serde_json::from_slice(&r.body).ok()
}

fn fetch_metric(addr: SocketAddr, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    for _ in 0..5 {
        if let Ok(r) = http_get(addr, "/metrics", None)
            && r.status == 200
        {
            return Some(metric_sum(&r.text(), name, labels).unwrap_or(0.0));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    None
}

/// The part of `/admin/cluster/status` the bench reads; serde skips the
/// rest without building it (a status of 128 members is ~40 KB).
#[derive(Deserialize)]
struct Brief {
    summary: BriefSummary,
    nodes: Vec<BriefNode>,
}

#[derive(Deserialize)]
struct BriefSummary {
    total_nodes: u64,
}

#[derive(Deserialize)]
struct BriefNode {
    node_id: String,
    membership_state: String,
}

impl Brief {
    fn state_of(&self, id: &str) -> Option<&str> {
        let mut it = self.nodes.iter().filter(|n| n.node_id == id);
        match (it.next(), it.next()) {
            (Some(n), None) => Some(n.membership_state.as_str()),
            _ => None,
        }
    }
}

fn fetch_brief(addr: SocketAddr) -> Option<Brief> {
    let r = http_get(
        addr,
        "/admin/cluster/status",
        Some((ADMIN_USER, ADMIN_PASSWORD)),
    )
    .ok()?;
    if r.status != 200 {
        return None;
    }
    serde_json::from_slice(&r.body).ok()
}

/// Polls every address's status every `interval` (from up to 16 threads)
/// until `pred` holds on it; returns per address the time since `t0` at
/// which it was first seen to hold, or `None` if it never did before
/// `timeout`. A node is no longer polled once it passed.
fn poll_all(
    addrs: &[SocketAddr],
    t0: Instant,
    interval: Duration,
    timeout: Duration,
    pred: impl Fn(&Brief) -> bool + Sync,
) -> Vec<Option<Duration>> {
    let results = Mutex::new(vec![None; addrs.len()]);
    let threads = addrs.len().clamp(1, 16);
    let end = Instant::now() + timeout;
    std::thread::scope(|s| {
        for t in 0..threads {
            let (results, pred) = (&results, &pred);
            s.spawn(move || {
                let mut pending: Vec<usize> = (t..addrs.len()).step_by(threads).collect();
                while !pending.is_empty() && Instant::now() < end {
                    let round = Instant::now();
                    pending.retain(|&i| {
                        let ok = fetch_brief(addrs[i]).is_some_and(|b| pred(&b));
                        if ok {
                            results.lock().unwrap()[i] = Some(t0.elapsed());
                        }
                        !ok
                    });
                    if let Some(rest) = interval.checked_sub(round.elapsed()) {
                        std::thread::sleep(rest);
                    }
                }
            });
        }
    });
    results.into_inner().unwrap()
}

fn secs(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64())
}

/// "max (p50 …)" of a phase, or "> timeout" naming the laggards.
fn summarize(what: &str, r: &[Option<Duration>], ids: &[String], timeout: Duration) -> String {
    let mut done: Vec<Duration> = r.iter().flatten().copied().collect();
    done.sort();
    if done.len() == r.len() && !done.is_empty() {
        let max = *done.last().unwrap();
        let p50 = done[done.len() / 2];
        eprintln!(
            "{what}: all {} in {} s (p50 {} s)",
            r.len(),
            secs(max),
            secs(p50)
        );
        secs(max)
    } else {
        let missing: Vec<&String> = r
            .iter()
            .zip(ids)
            .filter(|(d, _)| d.is_none())
            .map(|(_, id)| id)
            .collect();
        eprintln!(
            "{what}: TIMEOUT after {timeout:?}: {} of {} never did: {:?}",
            missing.len(),
            r.len(),
            missing
        );
        format!(
            "> {} (timeout, {} missing)",
            timeout.as_secs(),
            missing.len()
        )
    }
}

fn mib(kib: u64) -> String {
    format!("{:.1}", kib as f64 / 1024.0)
}

fn main() {
    let n: u8 = env_or("SBMESH_BENCH_N", 32);
    assert!((2..=250).contains(&n), "SBMESH_BENCH_N must be 2..=250");
    let loss: Option<f64> = std::env::var("SBMESH_BENCH_LOSS").ok().map(|s| {
        s.parse()
            .expect("SBMESH_BENCH_LOSS is a probability like 0.10")
    });
    let loss_secs: u64 = env_or("SBMESH_BENCH_SECS", 600);
    let steady_secs: u64 = env_or("SBMESH_BENCH_STEADY_SECS", 20);
    // Joining disseminates every member's metadata once; steady state is
    // what follows.
    let settle_secs: u64 = env_or("SBMESH_BENCH_SETTLE_SECS", 30);
    let timeout = Duration::from_secs(env_or("SBMESH_BENCH_TIMEOUT_SECS", 180));
    let interval = Duration::from_millis(env_or("SBMESH_BENCH_POLL_MS", 100));
    let prefix: String = env_or("SBMESH_BENCH_PREFIX", "127.0.31".to_string());

    if loss.is_some() {
        if std::env::var_os(IN_NETNS_ENV).is_none() {
            if let Err(why) = netns_available() {
                eprintln!("the loss mode needs a private network namespace: {why}");
                std::process::exit(1);
            }
            eprintln!("re-running inside `unshare -rn`");
            let st = Command::new(tool("unshare"))
                .arg("-rn")
                .arg("--")
                .arg(std::env::current_exe().expect("current_exe"))
                .args(std::env::args_os().skip(1))
                .env(IN_NETNS_ENV, "1")
                .status()
                .expect("run unshare");
            std::process::exit(st.code().unwrap_or(1));
        }
        netns_setup();
        require_iptables();
    }

    let bin = std::env::var_os("SBMESH_SIDECAR_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(sidecar_bin);
    eprintln!("sidecar binary: {}", bin.display());

    let mut c = Cluster::new(&prefix);
    c.bin = bin;
    for i in 1..=n {
        let o = c.default_opts(i, n);
        c.spawn(o);
    }
    let t_last_start = Instant::now();
    let ids: Vec<String> = c.nodes.iter().map(|x| x.id().to_string()).collect();
    let addrs: Vec<SocketAddr> = c.nodes.iter().map(Node::admin_addr).collect();
    let nn = u64::from(n);

    // ---- convergence -------------------------------------------------------------
    let conv = poll_all(&addrs, t_last_start, interval, timeout, |b| {
        b.summary.total_nodes == nn
    });
    let converge = summarize("converge", &conv, &ids, timeout);
    if let Some(k) = conv.iter().position(Option::is_none) {
        let v = fetch_status(addrs[k]);
        eprintln!(
            "{} total_nodes: {:?}; log tail:\n{}",
            ids[k],
            v.as_ref().and_then(total_nodes),
            c.nodes[k].log_tail(20)
        );
    }

    // ---- steady state: bytes and RSS -------------------------------------------------
    std::thread::sleep(Duration::from_secs(settle_secs));
    let sample = || -> Vec<Option<(Instant, f64)>> {
        addrs
            .iter()
            .map(|&a| fetch_metric(a, "mesh_bytes_sent_total", &[]).map(|b| (Instant::now(), b)))
            .collect()
    };
    let s0 = sample();
    std::thread::sleep(Duration::from_secs(steady_secs));
    let s1 = sample();
    let mut rates: Vec<f64> = s0
        .iter()
        .zip(&s1)
        .filter_map(|(a, b)| match (a, b) {
            (Some((t0, b0)), Some((t1, b1))) => {
                Some((b1 - b0) / t1.duration_since(*t0).as_secs_f64())
            }
            _ => None,
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    let bytes = if rates.is_empty() {
        "n/a".to_string()
    } else {
        let mean = rates.iter().sum::<f64>() / rates.len() as f64;
        format!("{mean:.0} / {:.0}", rates.last().unwrap())
    };
    eprintln!(
        "bytes sent per node per second (mean / max over {} nodes): {bytes}",
        rates.len()
    );
    let mut rss: Vec<u64> = c.nodes.iter().filter_map(Node::rss_kib).collect();
    rss.sort();
    let rss_s = if rss.is_empty() {
        "n/a".to_string()
    } else {
        format!(
            "{} / {}",
            mib(rss[rss.len() / 2]),
            mib(*rss.last().unwrap())
        )
    };
    eprintln!("RSS MiB (median / max): {rss_s}");

    if let Some(p) = loss {
        // ---- false downs under random loss ---------------------------------------------
        let downs = |addrs: &[SocketAddr]| -> f64 {
            addrs
                .iter()
                .filter_map(|&a| {
                    fetch_metric(a, "mesh_member_state_changes_total", &[("state", "down")])
                })
                .sum()
        };
        let base = downs(&addrs);
        let prob = format!("{p}");
        let rule = [
            "INPUT",
            "-i",
            "lo",
            "-m",
            "statistic",
            "--mode",
            "random",
            "--probability",
            &prob,
            "-j",
            "DROP",
        ];
        let mut add = vec!["-A"];
        add.extend(rule);
        iptables(&add);
        eprintln!("{p} random loss on lo for {loss_secs} s");
        let end = Instant::now() + Duration::from_secs(loss_secs);
        let seen_down = Mutex::new(BTreeSet::<(String, String)>::new());
        let suspect_obs = Mutex::new(0u64);
        while Instant::now() < end {
            let round = Instant::now();
            std::thread::scope(|s| {
                for chunk in addrs
                    .chunks(addrs.len().div_ceil(8))
                    .zip(ids.chunks(ids.len().div_ceil(8)))
                {
                    let (seen_down, suspect_obs) = (&seen_down, &suspect_obs);
                    s.spawn(move || {
                        for (a, observer) in chunk.0.iter().zip(chunk.1) {
                            let Some(v) = fetch_status(*a) else { continue };
                            for e in v
                                .get("nodes")
                                .and_then(Value::as_array)
                                .into_iter()
                                .flatten()
                            {
                                let id = e.get("node_id").and_then(Value::as_str).unwrap_or("?");
                                match e.get("membership_state").and_then(Value::as_str) {
                                    Some("down") => {
                                        seen_down
                                            .lock()
                                            .unwrap()
                                            .insert((observer.clone(), id.to_string()));
                                    }
                                    Some("suspect") => *suspect_obs.lock().unwrap() += 1,
                                    _ => {}
                                }
                            }
                        }
                    });
                }
            });
            if let Some(rest) = Duration::from_secs(2).checked_sub(round.elapsed()) {
                std::thread::sleep(rest);
            }
        }
        let mut del = vec!["-D"];
        del.extend(rule);
        iptables(&del);
        let false_downs = downs(&addrs) - base;
        let seen = seen_down.into_inner().unwrap();
        eprintln!(
            "false down transitions: {false_downs}; (observer, member) pairs seen down: {}; suspect observations: {}",
            seen.len(),
            suspect_obs.into_inner().unwrap()
        );
        for (o, m) in seen.iter().take(20) {
            eprintln!("  {o} saw {m} down");
        }
        println!();
        println!(
            "| N | loss | duration | converge (s) | bytes/node/s (mean / max) | RSS MiB (median / max) | false downs (counter) | pairs seen down (polled) |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        println!(
            "| {n} | {:.0} % | {loss_secs} s | {converge} | {bytes} | {rss_s} | {false_downs} | {} |",
            p * 100.0,
            seen.len()
        );
        return;
    }

    // ---- kill -9 ----------------------------------------------------------------------
    let victim = usize::from(n) / 2;
    let victim_id = ids[victim].clone();
    let survivors: Vec<usize> = (0..addrs.len()).filter(|&i| i != victim).collect();
    let t0 = Instant::now();
    c.nodes[victim].kill9();
    let sub: Vec<SocketAddr> = survivors.iter().map(|&i| addrs[i]).collect();
    let sub_ids: Vec<String> = survivors.iter().map(|&i| ids[i].clone()).collect();
    let det = poll_all(&sub, t0, interval, timeout, |b| {
        b.state_of(&victim_id) == Some("down")
    });
    let kill_detect = summarize("kill -9 detected", &det, &sub_ids, timeout);

    // ---- SIGTERM ------------------------------------------------------------------------
    let leaver = (victim + 1) % usize::from(n);
    let leaver_id = ids[leaver].clone();
    let rest: Vec<usize> = survivors.iter().copied().filter(|&i| i != leaver).collect();
    let sub: Vec<SocketAddr> = rest.iter().map(|&i| addrs[i]).collect();
    let sub_ids: Vec<String> = rest.iter().map(|&i| ids[i].clone()).collect();
    let t0 = Instant::now();
    c.nodes[leaver].sigterm();
    let det = poll_all(&sub, t0, interval, timeout, |b| {
        b.state_of(&leaver_id) == Some("down")
    });
    let term_detect = summarize("SIGTERM seen", &det, &sub_ids, timeout);
    let exit = match c.nodes[leaver].wait_exit(Duration::from_secs(40)) {
        Some(st) => describe_exit(st),
        None => "still running after 40 s".to_string(),
    };
    eprintln!("SIGTERM'd node: {exit}");

    println!();
    println!(
        "| N | converge after last start (s) | kill -9: all survivors see down (s) | SIGTERM: all see down (s) | bytes/node/s (mean / max) | RSS MiB (median / max) |"
    );
    println!("|---|---|---|---|---|---|");
    println!("| {n} | {converge} | {kill_detect} | {term_detect} | {bytes} | {rss_s} |");
    drop(c); // kills every process by PID
}
