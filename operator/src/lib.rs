//! `sbmesh-operator`: turns an `SBProxy` (and the `SBProxyConfig` it names)
//! into a StatefulSet whose pods carry the sbmesh sidecar, with its Services,
//! ConfigMap, cluster-key Secret and PodDisruptionBudget (and, when asked,
//! a NetworkPolicy and a PodMonitor).
//!
//! It renders and applies objects, nothing else: reloads, pod addresses and
//! ACME belong to the sidecar. One pure function, [`render::render`], makes
//! the objects for both the `render` command and the controller, so what a
//! user previews is what is applied.

#![warn(clippy::too_many_lines)]
// Only the code that ships is held to it: the build without tests checks
// every function of it, so test builds need not.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod admit;
pub mod cli;
pub mod crd;
pub mod inject;
pub mod injected;
pub mod install;
pub mod leader;
pub mod missed;
pub mod podmonitor;
pub mod reconcile;
pub mod render;
pub mod rotation;
pub mod run;
pub mod telemetry;
pub mod webhook;
