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

pub(crate) mod account;
pub(crate) mod certs;
pub(crate) mod challenge;
pub(crate) mod deliver;
pub(crate) mod dns01;
pub(crate) mod http_client;
pub(crate) mod issuer;
pub(crate) mod layout;
pub(crate) mod machine;
pub(crate) mod manager;
pub(crate) mod outcome;
pub(crate) mod ownership;
pub(crate) mod placeholder;
pub(crate) mod reach;
pub(crate) mod schedule;
pub(crate) mod unit;
pub use deliver::{CHAIN_FILE, KEY_FILE};
pub use manager::AcmeLimits;
pub(crate) mod order;
pub(crate) mod unit_files;
