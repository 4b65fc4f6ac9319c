//! Where the ACME issuer keeps its records in the shared store, and the names
//! of its lease locks. One home for the layout, so every replica (whatever
//! its version) reads what another wrote.
//!
//! ```text
//! acme/<dir>/account          account credentials (sealed)
//! acme/<dir>/issued/<set>     issuance history of one hostname set
//! acme/<dir>/budget           new-order budget of the account
//! acme/<dir>/state/<set>      failures and renewal information of one certificate unit
//! acme/<dir>/dns01/<set>     DNS-01 TXT records written and not removed yet (the ledger)
//! acme/challenges/<token>     key authorization of a pending HTTP-01 challenge (expires)
//! acme/certs/<host>           chain, key and facts of a host's certificate (sealed)
//! acme/san/<set>              the same for the one certificate of `certificates: san` (sealed)
//! locks: acme-account-<dir>, acme-order-<host>, acme-order-san-<set>
//! ```
//!
//! `<dir>` is [`directory_id`] of the directory URL, so a switch from a
//! staging to a production CA starts a new account and history. `<set>` is
//! [`hostname_set_id`] of the certificate's names: a changed origin set is
//! a new record (and a new order), the old one is simply no longer read.
//! The SAN certificate's unit id (ownership, logs) is [`san_unit_id`].

use crate::config::sha256_hex;

/// Short, stable id of an ACME directory URL (16 hex chars of its sha256).
pub fn directory_id(directory_url: &str) -> String {
    sha256_hex(directory_url.trim().as_bytes())[..16].to_owned()
}

/// Account credentials of the cluster at one directory.
pub fn account(dir_id: &str) -> String {
    format!("acme/{dir_id}/account")
}

/// Lock held while an account is created.
pub(crate) fn account_lock(dir_id: &str) -> String {
    format!("acme-account-{dir_id}")
}

/// Issuance history of one hostname set (see [`hostname_set_id`]).
pub fn issued(dir_id: &str, set_id: &str) -> String {
    format!("acme/{dir_id}/issued/{set_id}")
}

/// The new-order budget of the account.
pub fn order_budget(dir_id: &str) -> String {
    format!("acme/{dir_id}/budget")
}

/// What the replicas share about ordering the certificate of one hostname
/// set (see [`hostname_set_id`]; a per-host unit is the set of its host):
/// failures and the CA's renewal information.
pub fn order_state(dir_id: &str, set_id: &str) -> String {
    format!("acme/{dir_id}/state/{set_id}")
}

/// The DNS-01 ledger of the hostname set `set_id`: the TXT records its
/// order wrote and has not removed yet.
pub(crate) fn dns_ledger(dir_id: &str, set_id: &str) -> String {
    format!("acme/{dir_id}/dns01/{set_id}")
}

/// `host` as a store key segment and a folder name: a wildcard's `*`
/// (neither a key character nor a comfortable file name) spelt
/// `wildcard_` (`*.example.com` is `wildcard_.example.com`, as Caddy
/// spells it). A hostname has no `_`, so no hostname meets it.
pub(crate) fn host_segment(host: &str) -> std::borrow::Cow<'_, str> {
    match host.strip_prefix("*.") {
        Some(rest) => std::borrow::Cow::Owned(format!("wildcard_.{rest}")),
        None => std::borrow::Cow::Borrowed(host),
    }
}

/// Pending HTTP-01 challenge of `token`.
pub(crate) fn challenge(token: &str) -> String {
    format!("acme/challenges/{token}")
}

/// Prefix of every certificate record (for listing).
pub(crate) const CERTS_PREFIX: &str = "acme/certs/";

/// Certificate record of `host` (lowercase).
pub fn certificate(host: &str) -> String {
    format!("{CERTS_PREFIX}{}", host_segment(host))
}

/// Lock held while one DNS-01 TXT record name (absolute, its trailing dot
/// dropped, lowercase) is changed: orders of different certificates that
/// write one name (a wildcard's and its apex's) change it one at a time.
pub(crate) fn dns_record_lock(fqdn: &str) -> String {
    format!(
        "acme-dns01-{}",
        fqdn.trim_end_matches('.').to_ascii_lowercase()
    )
}

/// Lock held while `host` is ordered.
pub(crate) fn order_lock(host: &str) -> String {
    format!("acme-order-{}", host_segment(host))
}

/// Prefix of the SAN certificate records (for listing).
pub const SAN_PREFIX: &str = "acme/san/";

/// Certificate record of the SAN certificate for the hostname set `set_id`
/// ([`hostname_set_id`]).
pub(crate) fn san_certificate(set_id: &str) -> String {
    format!("{SAN_PREFIX}{set_id}")
}

/// Lock held while the SAN certificate of `set_id` is ordered.
pub(crate) fn san_order_lock(set_id: &str) -> String {
    format!("acme-order-san-{set_id}")
}

/// Id of the SAN certificate unit for the hostname set `set_id`: the name
/// its owner is chosen by (rendezvous hashing) and logged under. Never a
/// hostname (it has a `:`), so it cannot collide with a per-host unit.
pub(crate) fn san_unit_id(set_id: &str) -> String {
    format!("san:{set_id}")
}

/// Id of a set of hostnames: order-independent, case-insensitive.
pub fn hostname_set_id(hosts: &[String]) -> String {
    let mut sorted: Vec<String> = hosts.iter().map(|h| h.to_ascii_lowercase()).collect();
    sorted.sort();
    sorted.dedup();
    sha256_hex(sorted.join("\n").as_bytes())[..32].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::validate_key;

    #[test]
    fn every_key_is_a_valid_store_key() {
        let dir = directory_id("https://acme-v02.api.letsencrypt.org/directory");
        assert_eq!(dir.len(), 16);
        let set = hostname_set_id(&["b.example.com".into(), "A.example.com".into()]);
        for key in [
            account(&dir),
            issued(&dir, &set),
            order_budget(&dir),
            order_state(&dir, &set),
            challenge("abc_DEF-123"),
            certificate("api.example.com"),
            certificate("*.example.com"),
            san_certificate(&set),
            dns_ledger(&dir, &set),
        ] {
            validate_key(&key).unwrap();
        }
        assert_eq!(
            certificate("*.example.com"),
            "acme/certs/wildcard_.example.com"
        );
        // Locks are store keys too (under the lock prefix).
        validate_key(&format!("locks/{}", san_order_lock(&set))).unwrap();
        validate_key(&format!("locks/{}", order_lock("*.example.com"))).unwrap();
        assert!(san_unit_id(&set).starts_with("san:"));
        assert!(!san_certificate(&set).starts_with(CERTS_PREFIX));
    }

    #[test]
    fn set_id_ignores_order_and_case() {
        let a = hostname_set_id(&["b.example.com".into(), "A.example.com".into()]);
        let b = hostname_set_id(&["a.example.com".into(), "b.example.com".into()]);
        assert_eq!(a, b);
        assert_ne!(a, hostname_set_id(&["a.example.com".into()]));
    }
}
