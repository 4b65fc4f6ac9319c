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

internal_mod! { layout; }

internal_mod! { account; }
internal_mod! { certs; }
internal_mod! { challenge; }
internal_mod! { deliver; }
pub use deliver::{CHAIN_FILE, KEY_FILE};
internal_mod! { http_client; }
internal_mod! { issuer; }
internal_mod! { manager; }
pub use manager::AcmeLimits;
pub(crate) mod order;
internal_mod! { outcome; }
internal_mod! { ownership; }
internal_mod! { placeholder; }
internal_mod! { plan; }
internal_mod! { schedule; }
internal_mod! { unit; }
pub(crate) mod unit_files;
