//! The one object of another project the operator writes: prometheus-operator's
//! `PodMonitor` (`monitoring.coreos.com/v1`), with only the fields it sets.
//!
//! Its CRD comes with prometheus-operator and may be absent from a cluster,
//! so the operator neither installs nor watches it: it applies one only when
//! `spec.podMonitor` asks, and reports a cluster that does not serve the kind
//! ([`crate::reconcile`]).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// `PodMonitor.spec`: which pods Prometheus scrapes, and where.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "monitoring.coreos.com",
    version = "v1",
    kind = "PodMonitor",
    namespaced,
    derive = "PartialEq",
    // prometheus-operator owns the CRD and its schema.
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct PodMonitorSpec {
    /// The pods, in the PodMonitor's own namespace.
    pub selector: LabelSelector,
    /// What to scrape in each pod.
    pub pod_metrics_endpoints: Vec<PodMetricsEndpoint>,
}

/// One scrape target of each selected pod.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct PodMetricsEndpoint {
    /// Name of the container port.
    pub port: String,
    /// HTTP path.
    pub path: String,
}
