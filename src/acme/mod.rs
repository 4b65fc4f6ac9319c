//! The ACME issuer shared by every replica of a fleet.
//!
//! Data flow, one way: hostnames (the keys of `origins`) -> ownership
//! (rendezvous hashing over the alive mesh members) -> order lock (a lease in
//! the shared store) -> order (instant-acme) -> key authorization published
//! to the store -> any replica's responder answers the CA -> certificate
//! (sealed in the store) -> every replica writes its files -> reload.
//!
//! Every record lives under the keys built by [`layout`], so one store can be
//! shared by the replicas of a cluster without any other coordination.

pub mod layout;

pub mod account;
pub mod certs;
pub mod challenge;
pub mod deliver;
pub mod http_client;
pub mod issuer;
pub mod manager;
pub(crate) mod order;
pub mod outcome;
pub mod ownership;
pub mod placeholder;
pub mod plan;
pub mod schedule;
pub mod unit;
pub(crate) mod unit_files;
