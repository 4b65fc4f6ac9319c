//! The `file` store between processes, as pods share an RWX volume: child
//! processes (this test binary, re-executed with [`ROLE_ENV`] set) work on
//! one directory at the same moment.
//!
//! - compare-and-swap counter: N processes × 100 increments end at N × 100;
//! - create-only races: of 8 processes creating the same key, exactly one
//!   wins, and the stored value is the winner's.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sbmesh::{FileStore, Store};

/// What a child process does: `cas` or `create`.
const ROLE_ENV: &str = "SBMESH_FILE_STORE_CHILD_ROLE";
/// The store directory.
const STORE_ENV: &str = "SBMESH_FILE_STORE_CHILD_STORE";
/// The directory for start and result files (outside the store).
const SYNC_ENV: &str = "SBMESH_FILE_STORE_CHILD_SYNC";
/// The child's number.
const ID_ENV: &str = "SBMESH_FILE_STORE_CHILD_ID";

const COUNTER_KEY: &str = "processes/counter";
const INCREMENTS: u64 = 100;
const RACE_KEYS: usize = 20;
const DEADLINE: Duration = Duration::from_secs(120);

/// The child processes' entry point; a no-op in a normal test run.
#[test]
fn child_process_entry() {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return;
    };
    let env = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} unset"));
    let store_dir = PathBuf::from(env(STORE_ENV));
    let sync = PathBuf::from(env(SYNC_ENV));
    let id: u32 = env(ID_ENV).parse().expect("child id");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let store = FileStore::open(&store_dir).await.expect("open store");
        // Start together: report ready, wait for the parent's go.
        std::fs::write(sync.join(format!("ready-{id}")), b"").expect("ready file");
        wait_for_file(&sync.join("go")).await;
        match role.as_str() {
            "cas" => increment(&store).await,
            "create" => {
                let mut won = String::new();
                for k in 0..RACE_KEYS {
                    let key = format!("processes/race-{k}");
                    let created = store
                        .put_if_absent(&key, &id.to_be_bytes(), None)
                        .await
                        .expect("put_if_absent");
                    if created.is_some() {
                        won.push_str(&format!("{k}\n"));
                    }
                }
                std::fs::write(sync.join(format!("won-{id}")), won).expect("result file");
            }
            other => panic!("unknown role {other}"),
        }
    });
}

async fn increment(store: &FileStore) {
    for _ in 0..INCREMENTS {
        loop {
            let entry = store.get(COUNTER_KEY).await.expect("get").expect("counter");
            let n: u64 = std::str::from_utf8(&entry.value)
                .expect("utf-8")
                .parse()
                .expect("number");
            let next = (n + 1).to_string();
            if store
                .compare_and_swap(COUNTER_KEY, &entry.version, next.as_bytes(), None)
                .await
                .expect("compare_and_swap")
                .is_some()
            {
                break;
            }
        }
    }
}

async fn wait_for_file(path: &Path) {
    let deadline = Instant::now() + DEADLINE;
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Starts `n` children in `role` on `store_dir`, releases them together
/// and waits for all to succeed.
fn run_children(role: &str, n: u32, store_dir: &Path, sync: &Path) {
    let exe = std::env::current_exe().expect("test binary");
    let mut children: Vec<(u32, Child)> = (0..n)
        .map(|id| {
            let child = Command::new(&exe)
                .args(["--exact", "child_process_entry", "--nocapture"])
                .env(ROLE_ENV, role)
                .env(STORE_ENV, store_dir)
                .env(SYNC_ENV, sync)
                .env(ID_ENV, id.to_string())
                .stdin(Stdio::null())
                // The harness's chatter; a child's panic goes to stderr.
                .stdout(Stdio::null())
                .spawn()
                .expect("spawn child");
            (id, child)
        })
        .collect();
    let deadline = Instant::now() + DEADLINE;
    let kill_all = |children: &mut Vec<(u32, Child)>| {
        for (_, c) in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    while (0..n).any(|id| !sync.join(format!("ready-{id}")).exists()) {
        if Instant::now() > deadline
            || children
                .iter_mut()
                .any(|(_, c)| matches!(c.try_wait(), Ok(Some(_))))
        {
            kill_all(&mut children);
            panic!("children did not all start");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::fs::write(sync.join("go"), b"").expect("go file");
    for (id, child) in children.iter_mut() {
        loop {
            match child.try_wait().expect("wait") {
                Some(status) => {
                    assert!(status.success(), "child {id} failed: {status}");
                    break;
                }
                None if Instant::now() > deadline => {
                    let _ = child.kill();
                    panic!("child {id} hung");
                }
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

#[test]
fn cas_counter_across_processes() {
    const PROCESSES: u32 = 4;
    let dir = tempfile::tempdir().expect("temp dir");
    let (store_dir, sync) = (dir.path().join("store"), dir.path().join("sync"));
    std::fs::create_dir_all(&sync).expect("sync dir");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let store = runtime.block_on(FileStore::open(&store_dir)).expect("open");
    runtime
        .block_on(store.put(COUNTER_KEY, b"0", None))
        .expect("put");

    run_children("cas", PROCESSES, &store_dir, &sync);

    let entry = runtime
        .block_on(store.get(COUNTER_KEY))
        .expect("get")
        .expect("counter");
    assert_eq!(
        std::str::from_utf8(&entry.value).expect("utf-8"),
        (u64::from(PROCESSES) * INCREMENTS).to_string(),
        "lost updates between processes"
    );
}

#[test]
fn create_race_across_processes_has_one_winner() {
    const PROCESSES: u32 = 8;
    let dir = tempfile::tempdir().expect("temp dir");
    let (store_dir, sync) = (dir.path().join("store"), dir.path().join("sync"));
    std::fs::create_dir_all(&sync).expect("sync dir");

    run_children("create", PROCESSES, &store_dir, &sync);

    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let store = runtime.block_on(FileStore::open(&store_dir)).expect("open");
    let mut winners: Vec<Vec<u32>> = vec![Vec::new(); RACE_KEYS];
    for id in 0..PROCESSES {
        let won = std::fs::read_to_string(sync.join(format!("won-{id}"))).expect("result file");
        for k in won.lines() {
            winners[k.parse::<usize>().expect("key number")].push(id);
        }
    }
    for (k, ids) in winners.iter().enumerate() {
        assert_eq!(ids.len(), 1, "race-{k}: winners {ids:?}");
        let entry = runtime
            .block_on(store.get(&format!("processes/race-{k}")))
            .expect("get")
            .expect("created");
        assert_eq!(
            entry.value,
            ids[0].to_be_bytes(),
            "race-{k}: the stored value is not the winner's"
        );
    }
}
