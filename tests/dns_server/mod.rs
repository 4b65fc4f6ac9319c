//! The BIND 9 `scripts/test` starts for the DNS-01 tests (its `dns`
//! server): authoritative for [`ZONE`] and [`DELEGATED_ZONE`] on
//! [`SERVER_VAR`], with the TSIG keys `sbmesh-<name>.` whose secrets are
//! `SBMESH_TEST_TSIG_<NAME>` (`sha256`, `sha512`, `md5`: TXT in both zones;
//! `narrow`: TXT in the delegated zone only; `admin`: anything).

#![allow(dead_code)]

#[allow(clippy::duplicate_mod)]
#[path = "../required/mod.rs"]
mod required;

use std::net::SocketAddr;

/// The variable naming BIND's `ip:port`.
pub const SERVER_VAR: &str = "SBMESH_TEST_DNS_SERVER";
/// The zone the tests' names are in.
pub const ZONE: &str = "dns01.test";
/// The zone `_acme-challenge` CNAMEs delegate to.
pub const DELEGATED_ZONE: &str = "delegated.test";

/// BIND's address, or `None` (a SKIP line) when `scripts/test` did not
/// start it; a panic when it did not but `SBMESH_TEST_REQUIRE_SERVERS=1`.
pub fn server() -> Option<SocketAddr> {
    match std::env::var(SERVER_VAR) {
        Ok(v) => Some(v.parse().expect("SBMESH_TEST_DNS_SERVER is ip:port")),
        Err(_) => required::missing(
            "DNS-01",
            &format!("{SERVER_VAR} is not set"),
            "scripts/test starts BIND",
        ),
    }
}

/// The variable holding the secret of the key `sbmesh-<key>.`.
pub fn secret_var(key: &str) -> String {
    format!("SBMESH_TEST_TSIG_{}", key.to_uppercase())
}

/// The secret of the key `sbmesh-<key>.`.
pub fn secret(key: &str) -> String {
    let var = secret_var(key);
    std::env::var(&var).unwrap_or_else(|_| panic!("{var}: scripts/test sets it with BIND"))
}
