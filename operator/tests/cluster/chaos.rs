//! A seeded chaos run on the real cluster: the faults of a fleet's life
//! (operator/tests/cluster_life.rs) at random, from a seed that replays
//! them. Its short run is a test (`cluster_life`), its 10-minute runs a
//! bench (`operator/benches/cluster_chaos.rs`, BENCHMARKS.md).

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::Value;

use super::{Cluster, Fleet, Sampler};

/// The seeded random numbers of a chaos run (SplitMix64): the same seed,
/// the same faults in the same order and pauses.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One container's last termination as the kubelet reports it: (pod UID,
/// pod name, container, restart count, exit code, reason).
type Termination = (String, String, String, i64, i64, String);

/// Every container of `pods` that terminated before, with how.
fn terminations(pods: &[Value]) -> Vec<Termination> {
    pods.iter()
        .flat_map(|p| {
            super::container_statuses(p)
                .filter_map(|s| {
                    let t = &s["lastState"]["terminated"];
                    t.is_object().then(|| {
                        (
                            p["metadata"]["uid"]
                                .as_str()
                                .unwrap_or_default()
                                .to_string(),
                            p["metadata"]["name"]
                                .as_str()
                                .unwrap_or_default()
                                .to_string(),
                            s["name"].as_str().unwrap_or_default().to_string(),
                            s["restartCount"].as_i64().unwrap_or(0),
                            t["exitCode"].as_i64().unwrap_or(-1),
                            t["reason"].as_str().unwrap_or_default().to_string(),
                        )
                    })
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The shortest run: a fault lands every 3-12 s, so this many seconds
/// make [`MIN_FAULTS`] at the least.
pub const MIN_SECS: u64 = 60;
/// The fewest faults a run must have applied to count as a chaos run.
pub const MIN_FAULTS: usize = 5;

/// The run's length and seed: `SBMESH_SOAK_SECS` (else `default_secs`)
/// and `SBMESH_SOAK_SEED` (else one from the clock). A value that is not
/// a whole number, or a run shorter than [`MIN_SECS`], fails: a chaos run
/// that applies no fault must not pass.
pub fn settings(default_secs: u64) -> (u64, u64) {
    parse_settings(
        std::env::var("SBMESH_SOAK_SECS").ok().as_deref(),
        std::env::var("SBMESH_SOAK_SEED").ok().as_deref(),
        default_secs,
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn parse_settings(
    secs: Option<&str>,
    seed: Option<&str>,
    default_secs: u64,
) -> Result<(u64, u64), String> {
    let secs = match secs {
        None => default_secs,
        Some(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|s| *s >= MIN_SECS)
            .ok_or_else(|| {
                format!(
                    "SBMESH_SOAK_SECS={v:?}: the run's length in whole seconds, at least {MIN_SECS}"
                )
            })?,
    };
    let seed = match seed {
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
        Some(v) => v.trim().parse::<u64>().map_err(|_| {
            format!("SBMESH_SOAK_SEED={v:?}: a whole number (the seed a run printed)")
        })?,
    };
    Ok((secs, seed))
}

#[test]
fn a_bad_or_empty_setting_fails() {
    assert_eq!(parse_settings(None, Some("7"), 120), Ok((120, 7)));
    assert_eq!(
        parse_settings(Some("600"), Some("1001"), 120),
        Ok((600, 1001))
    );
    for secs in ["0", "59", "ten", "-5", ""] {
        assert!(
            parse_settings(Some(secs), Some("1"), 120).is_err(),
            "SBMESH_SOAK_SECS={secs} taken"
        );
    }
    assert!(parse_settings(None, Some("x"), 120).is_err());
}

/// Runs the chaos: the faults of scenarios 2, 3, 4, 5, 7, 9 and 13 at
/// random, a random 3–12 s apart, for `secs`, from `seed` (printed; the
/// same seed replays the same faults in the same order). Then asserts: the
/// fleet is whole again (the mesh converged, every proxy serving the
/// certificate), the CA saw no new order (0 duplicate certificates), and no
/// container ended but by the run's own hand (a SIGKILL it sent, or a
/// graceful exit): 0 crashes.
pub fn run(c: &Cluster, secs: u64, seed: u64) {
    c.operator();
    eprintln!(
        "chaos: seed {seed}, {secs} s (SBMESH_SOAK_SEED={seed} SBMESH_SOAK_SECS={secs} replays it)"
    );
    let fleet = Fleet::deploy(c, "life-chaos", 2, |m| {
        m.replacen(
            "clustering: { enabled: true }",
            "clustering: { enabled: true, keyRotationGraceSeconds: 100 }",
            1,
        )
    });
    let ns = fleet.ns.name.clone();
    let mut dice = Dice(seed);
    // Every termination seen, sampled every second (a pod deleted later
    // takes its history with it).
    let (c2, ns2) = (c.clone(), ns.clone());
    let seen = Sampler::start(Duration::from_secs(1), move || {
        terminations(
            &c2.get(&["-n", &ns2, "pods"])
                .and_then(|l| l["items"].as_array().cloned())
                .unwrap_or_default(),
        )
    });
    // SIGKILLs sent, by pod UID.
    let mut kills: std::collections::BTreeMap<String, i64> = Default::default();
    let start = std::time::Instant::now();
    let mut faults = Vec::new();
    let mut not_applied = 0;
    let mut last = start;
    while start.elapsed() < Duration::from_secs(secs) {
        let pod = format!("demo-proxy-{}", dice.below(3));
        // What was done, or why nothing was (then it is not counted).
        let fault: Result<String, String> = match dice.below(8) {
            0 => fleet
                .ns
                .kubectl(&["delete", "pod", &pod, "--wait=false"])
                .map(|_| format!("delete {pod}")),
            1 => fleet
                .ns
                .kubectl(&[
                    "delete",
                    "pod",
                    &pod,
                    "--grace-period=0",
                    "--force",
                    "--wait=false",
                ])
                .map(|_| format!("force-delete {pod}")),
            2 => {
                // A replica dies (the order holder's death when it holds one).
                let killed = fleet.ns.get(&["pod", &pod]).and_then(|p| {
                    let id = super::running_container_id(&p, "sbmesh-sidecar")?;
                    super::try_kill_container(c, &id).ok()?;
                    Some(p["metadata"]["uid"].as_str()?.to_string())
                });
                match killed {
                    Some(uid) => {
                        *kills.entry(uid).or_default() += 1;
                        Ok(format!("SIGKILL {pod}'s sidecar"))
                    }
                    None => Err(format!("SIGKILL {pod}'s sidecar: not running")),
                }
            }
            3 => fleet
                .ns
                .kubectl(&[
                    "annotate",
                    "--overwrite",
                    "sbproxy",
                    "demo",
                    &format!("sbproxy.dev/rotate-cluster-key=chaos-{}", faults.len()),
                ])
                .map(|_| "rotate the cluster key".to_string()),
            4 => fleet
                .ns
                .kubectl(&["rollout", "restart", "statefulset/demo-proxy"])
                .map(|_| "rollout restart".to_string()),
            5 => {
                let names = fleet.identities().keys().cloned().collect();
                let (evicted, refused) = super::evict_all(c, &ns, names);
                Ok(format!("drain: {evicted} evicted, {refused} refused"))
            }
            6 => {
                let part = ["kube-apiserver", "etcd"][dice.below(2) as usize];
                super::restart_parts(&[part]);
                Ok(format!("restart {part}"))
            }
            _ => {
                super::restart_parts(&["redis"]);
                Ok("restart redis".to_string())
            }
        };
        match fault {
            Ok(fault) => {
                eprintln!("chaos: {:>6.1} s: {fault}", start.elapsed().as_secs_f64());
                faults.push(fault);
            }
            Err(why) => {
                eprintln!(
                    "chaos: {:>6.1} s: not applied ({why}), not counted",
                    start.elapsed().as_secs_f64()
                );
                not_applied += 1;
            }
        }
        last = std::time::Instant::now();
        std::thread::sleep(Duration::from_millis(3000 + dice.below(9000)));
    }
    let (pods, _) = fleet.whole(3);
    let converged = last.elapsed();
    let mut terminated: BTreeSet<Termination> =
        seen.finish().into_iter().flat_map(|(_, t)| t).collect();
    terminated.extend(terminations(&pods));
    let crashes: Vec<&Termination> = terminated
        .iter()
        .filter(|(uid, _, container, restarts, code, reason)| {
            let ours = *code == 0
                || *code == 143
                || (*code == 137
                    && reason != "OOMKilled"
                    && container == "sbmesh-sidecar"
                    && kills.get(uid).is_some_and(|k| k >= restarts));
            !ours
        })
        .collect();
    eprintln!(
        "chaos: seed {seed}: {} faults applied ({not_applied} not) in {:.0} s; whole {:.1} s after the last one; {} terminations, {} SIGKILLs sent",
        faults.len(),
        (last - start).as_secs_f64(),
        converged.as_secs_f64(),
        terminated.len(),
        kills.values().sum::<i64>()
    );
    assert!(
        faults.len() >= MIN_FAULTS,
        "seed {seed}: {} faults applied in {secs} s ({not_applied} not applied): a chaos run \
         needs {MIN_FAULTS} at the least",
        faults.len()
    );
    assert!(
        crashes.is_empty(),
        "seed {seed}: containers that ended by no hand of the run: {crashes:?}"
    );
    assert_eq!(
        fleet.new_validations(c),
        0,
        "seed {seed}: orders placed at the CA (the fleet's certificate was in the store throughout)"
    );
}
