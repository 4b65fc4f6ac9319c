//! Handing certificates to the running proxy (docs/reference.md#certificate-files).
//!
//! - [`RestartCoordinator`]: `apply: restart`. sbproxy 1.13 reads its
//!   certificate files only at start-up, so a new certificate is applied by
//!   a graceful restart: SIGTERM to the process named
//!   `--proxy-process-name` (the pod shares its process namespace), one pod
//!   at a time across the fleet (the lease [`RESTART_LEASE`] in the shared
//!   store), each waiting until `--proxy-health-url` answers 200 again; at
//!   most one restart per pod per 10 minutes. The decisions are the
//!   sans-IO [`restart::RestartCore`].
//! - [`TlsWatcher`]: `--watch-tls DIR`, a mounted `kubernetes.io/tls`
//!   Secret whose valid renewals are applied with the same callback the
//!   ACME manager calls; the decisions are [`watch_tls::TlsDirState`].
//!
//! Wiring (in the sidecar): with `apply: restart`, spawn the coordinator
//! and hand [`RestartCoordinator::requester`] to the ACME manager as
//! `certificates_changed` and to each [`TlsWatcher`] as `apply`; publish
//! [`ProxyStatus::info`] as [`crate::mesh::NodeMeta::proxy`]; add
//! [`restart_readiness`] and [`watch_tls_readiness`] to `/readyz`.

pub(crate) mod coordinator;
pub(crate) mod procs;
pub(crate) mod restart;
pub(crate) mod watch_tls;
pub use coordinator::{ProxyStatus, RestartConfig, RestartCoordinator, restart_readiness};
pub use coordinator::{RESTART_LEASE, restart_lease};
pub use watch_tls::{TlsWatcher, WatchTlsConfig, watch_tls_readiness};
