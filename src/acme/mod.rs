//! The ACME issuer shared by every replica of a fleet.
//!
//! Data flow, one way: hostnames (the keys of `origins`) -> ownership
//! (rendezvous hashing over the alive mesh members) -> order lock (a lease in
//! the shared store) -> order (instant-acme) -> key authorization published
//! to the store -> any replica's responder answers the CA -> certificate
//! (sealed in the store) -> every replica writes its files -> reload.
//!
//! Every record lives under the keys built by `layout`, so one store can be
//! shared by the replicas of a cluster without any other coordination.

internal_mod! {
    layout;
    account;
    certs;
    challenge;
    deliver;
    dns01;
    http_client;
    issuer;
    machine;
    manager;
    outcome;
    ownership;
    placeholder;
    reach;
    schedule;
    unit;
}
pub use deliver::{CHAIN_FILE, KEY_FILE};
pub use manager::AcmeLimits;
pub(crate) mod order;
pub(crate) mod unit_files;
