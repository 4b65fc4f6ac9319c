//! Whether a test whose server or tool is missing fails or skips, decided
//! in one place for every test crate of the workspace (each includes this
//! file with `#[path]`; the servers' helpers include it too, so one test
//! crate may load it twice: `#[allow(clippy::duplicate_mod)]` where it is).
//!
//! A run meant to test everything cannot pass by skipping: the test fails
//! when `scripts/test` started every server (`SBMESH_TEST_REQUIRE_SERVERS=1`)
//! and whenever `CI` is set, whatever else the environment says. A
//! developer's targeted run (`SBMESH_TEST_SERVERS=redis scripts/test store_`,
//! or `cargo test` alone) prints a SKIP line and passes.

#![allow(dead_code)]

/// A variable of the environment, as `std::env::var(..).ok()` reads it.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// `CI` is set, to anything but the empty string, `false` or `0`.
pub fn in_ci() -> bool {
    in_ci_of(&process_env)
}

/// [`in_ci`] of `env`.
pub fn in_ci_of(env: Env) -> bool {
    env("CI").is_some_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Whether a missing server fails the test instead of skipping it.
pub fn servers_required() -> bool {
    servers_required_of(&process_env)
}

/// [`servers_required`] of `env`.
pub fn servers_required_of(env: Env) -> bool {
    in_ci_of(env) || env("SBMESH_TEST_REQUIRE_SERVERS").as_deref() == Some("1")
}

/// Whether a missing cluster fails a cluster test (`scripts/test` sets
/// `SBMESH_TEST_CLUSTER_REQUIRED=1` for the phase that starts the cluster).
pub fn cluster_required() -> bool {
    cluster_required_of(&process_env)
}

/// [`cluster_required`] of `env`.
pub fn cluster_required_of(env: Env) -> bool {
    in_ci_of(env) || env("SBMESH_TEST_CLUSTER_REQUIRED").as_deref() == Some("1")
}

/// What `test` does without `what`: fails (a panic naming `what` and
/// `hint`, how to get it) when servers are required, else prints a SKIP
/// line and gives `None`.
#[track_caller]
pub fn missing<T>(test: &str, what: &str, hint: &str) -> Option<T> {
    assert!(
        !servers_required(),
        "{test}: {what}, and every server is required here (CI, or \
         SBMESH_TEST_REQUIRE_SERVERS=1): {hint}"
    );
    eprintln!("SKIP {test}: {what} ({hint})");
    None
}
