//! From an SBProxy (and the SBProxyConfig it names) to the objects of
//! docs/reference.md#objects-the-operator-applies: one pure function,
//! [`render`], used by the `render` command and by the controller, so what
//! a user previews is what is applied.
//!
//! Two properties keep a running fleet calm:
//! - the pod template depends on neither `spec.replicas` nor the config
//!   text, so scaling and config edits restart no pod (the sidecar reloads
//!   the proxy when the mounted ConfigMap changes), except for the few
//!   config facts the pod itself must follow, whose change needs a proxy
//!   restart anyway (`pod_template`);
//! - randomness (a fresh cluster key) comes in through [`RenderOptions`],
//!   so the same inputs always give the same objects.
//!
//! Here: the objects and their names. `pod`: the pod template and the
//! checks of `spec.podTemplate`. `sidecar`: the sidecar's container, which
//! `inject` and the webhook build too. `checks`: the config checks
//! (`ConfigInvalid`, `AcmeStoreNotShared`). `command`: the `render` command.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{
    RollingUpdateStatefulSetStrategy, StatefulSet, StatefulSetSpec, StatefulSetUpdateStrategy,
};
use k8s_openapi::api::core::v1::{
    ConfigMap, PodTemplateSpec, Secret, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use serde_json::Value;

use crate::crd::{self, SBProxy, SBProxyConfig};
use crate::podmonitor::{PodMetricsEndpoint, PodMonitor, PodMonitorSpec};

mod checks;
mod command;
mod pod;
mod sidecar;

use checks::{ConfigFacts, check_config};
use pod::{network_policy_spec, pod_template};

pub use command::command;
pub(crate) use command::{read_input, yaml_documents};
pub(crate) use sidecar::field_env;
pub use sidecar::{
    KeySecret, MeshSettings, READINESS_PERIOD_SECONDS, SidecarSettings, challenge_passthrough_url,
    cluster_key_file, cluster_key_volume, data_volume, restricted_security_context,
    sidecar_container,
};

/// Name of the proxy container.
pub const PROXY_CONTAINER: &str = "proxy";
/// Name of the sidecar (an initContainer with `restartPolicy: Always`).
pub const SIDECAR_CONTAINER: &str = "sbmesh-sidecar";
/// The sidecar binary in the image (absolute: the image has no shell).
pub const SIDECAR_COMMAND: &str = "/usr/local/bin/sbmesh-sidecar";
/// Volume of the ConfigMap holding `sb.yml`.
pub const CONFIG_VOLUME: &str = "sbproxy-config";
/// The emptyDir both containers share (certificates, sidecar state).
pub const DATA_VOLUME: &str = "sbproxy-data";
/// Where the ConfigMap is mounted, in both containers.
pub const CONFIG_DIR: &str = "/etc/sbproxy";
/// Where the shared emptyDir is mounted, in both containers.
pub const DATA_DIR: &str = "/var/lib/sbproxy";
/// The ConfigMap key holding the config text.
pub const CONFIG_KEY: &str = "sb.yml";
/// The key of the generated cluster-key Secret.
pub const CLUSTER_KEY_KEY: &str = "cluster-key";
/// Volume of the cluster-key Secret, in the sidecar only.
pub const CLUSTER_KEY_VOLUME: &str = "sbmesh-cluster-key";
/// Where that Secret is mounted: a directory, never a `subPath`, so the
/// kubelet updates the file in place when the Secret changes and the
/// sidecar re-reads it (`--cluster-key-file`; key rotation,
/// docs/operations.md#rotate-the-cluster-key).
pub const CLUSTER_KEY_DIR: &str = "/etc/sbmesh/cluster-key";
/// The uid (and gid) the sidecar runs as: distroless `nonroot`.
pub const NONROOT_UID: i64 = 65532;
/// Name of the sidecar's admin port: its probes, and the PodMonitor's
/// scrape of `/metrics`.
pub const SIDECAR_ADMIN_PORT: &str = "sidecar-admin";
/// Port of `<name>-svc` that reaches the sidecar's HTTP-01 responder (and,
/// through its passthrough, the proxy's HTTP listener).
pub const ACME_SERVICE_PORT: i32 = 80;
/// Port of `<name>-svc` that reaches the proxy's `proxy.https_bind_port`.
pub const HTTPS_SERVICE_PORT: i32 = 443;
/// The proxy's shutdown grace (its `SBPROXY_SHUTDOWN_GRACE_MS`) when the
/// sidecar restarts it for a certificate (`acme.apply: restart`): sbproxy
/// 1.13 closes its listeners at SIGTERM and exits after twice the grace
/// rounded up to whole seconds (30 s by default: 60 s), so the grace is
/// what each pod's restart costs. 1 s lets requests in flight finish and
/// exits in 2 s. `podTemplate.proxyEnv` may set another.
pub const RESTART_PROXY_GRACE_MS: u64 = 1000;
/// Ports below this need privilege to bind: a capability, or the pod's
/// `net.ipv4.ip_unprivileged_port_start` lowered to them.
const FIRST_UNPRIVILEGED_PORT: i32 = 1024;
/// The sysctl (namespaced per pod, and in the set Pod Security's baseline
/// and restricted profiles allow) that lets a non-root process bind a
/// port at or above its value.
pub const UNPRIVILEGED_PORT_SYSCTL: &str = "net.ipv4.ip_unprivileged_port_start";
/// `app.kubernetes.io/managed-by` of every object the operator makes.
pub const MANAGER: &str = "sbmesh-operator";

/// What the caller supplies so that [`render`] stays pure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderOptions {
    /// Sidecar image for SBProxies whose `spec.sidecar.image` is absent.
    pub sidecar_image: String,
    /// The key of a cluster-key Secret to create: 64 lowercase hex chars
    /// ([`fresh_cluster_key`]). Read only when such a Secret is rendered.
    pub fresh_cluster_key: String,
}

/// The objects of one SBProxy, all in its namespace
/// (docs/reference.md#objects-the-operator-applies).
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// `<name>-proxy`.
    pub stateful_set: StatefulSet,
    /// `<name>-mesh`: headless, gossip and transport ports.
    pub headless_service: Service,
    /// `<name>-svc`: `http`, `acme`, and `https` when the config sets
    /// `proxy.https_bind_port`.
    pub service: Service,
    /// `<name>-config`, key `sb.yml`.
    pub config_map: ConfigMap,
    /// The Secret to create: only when clustering is enabled, no
    /// `clusterSecretRef` names another one, and none exists yet.
    pub cluster_key_secret: Option<Secret>,
    /// `<name>-pdb`: only when replicas > 1.
    pub pdb: Option<PodDisruptionBudget>,
    /// `<name>-mesh`: only with `spec.networkPolicy`.
    pub network_policy: Option<NetworkPolicy>,
    /// `<name>`: only with `spec.podMonitor`.
    pub pod_monitor: Option<PodMonitor>,
    /// `sha256:<hex>` of the config text.
    pub config_hash: String,
}

impl Rendered {
    /// Every object, as JSON, in the order they are applied: ConfigMap,
    /// Secret, Services, StatefulSet, PodDisruptionBudget, NetworkPolicy,
    /// PodMonitor.
    pub fn objects(&self) -> Vec<Value> {
        let mut out = vec![to_json(&self.config_map)];
        if let Some(secret) = &self.cluster_key_secret {
            out.push(to_json(secret));
        }
        out.push(to_json(&self.headless_service));
        out.push(to_json(&self.service));
        out.push(to_json(&self.stateful_set));
        if let Some(pdb) = &self.pdb {
            out.push(to_json(pdb));
        }
        if let Some(policy) = &self.network_policy {
            out.push(to_json(policy));
        }
        if let Some(monitor) = &self.pod_monitor {
            out.push(to_json(monitor));
        }
        out
    }

    /// [`Rendered::objects`] as a YAML stream.
    pub fn objects_yaml(&self) -> String {
        crd::yaml_stream(&self.objects())
    }
}

/// A k8s-openapi object as JSON.
pub(crate) fn to_json<T: serde::Serialize>(object: &T) -> Value {
    // k8s-openapi objects always serialise to JSON.
    serde_json::to_value(object).unwrap_or(Value::Null)
}

/// Why an SBProxy is not applied (docs/reference.md#refusal-reasons).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RefusalReason {
    /// `spec.replicas` is outside 1–128.
    TooManyReplicas,
    /// `spec.configRef` names no SBProxyConfig.
    ConfigNotFound,
    /// `spec.config` is not valid YAML, or its sidecar sections fail `validate`.
    ConfigInvalid,
    /// Several replicas would each order certificates into a pod-local store.
    AcmeStoreNotShared,
    /// `spec.podTemplate` would undo what the operator sets in the pod.
    PodTemplateInvalid,
}

impl RefusalReason {
    /// The reason as written in the `Degraded` condition and the Event.
    pub fn as_str(&self) -> &'static str {
        match self {
            RefusalReason::TooManyReplicas => "TooManyReplicas",
            RefusalReason::ConfigNotFound => "ConfigNotFound",
            RefusalReason::ConfigInvalid => "ConfigInvalid",
            RefusalReason::AcmeStoreNotShared => "AcmeStoreNotShared",
            RefusalReason::PodTemplateInvalid => "PodTemplateInvalid",
        }
    }
}

/// A refusal: nothing is applied; the message goes to `status.lastError`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", reason.as_str())]
pub struct Refusal {
    /// Machine-readable reason.
    pub reason: RefusalReason,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl Refusal {
    fn new(reason: RefusalReason, message: impl Into<String>) -> Self {
        Refusal {
            reason,
            message: message.into(),
        }
    }
}

/// The AcmeStoreNotShared message (docs/reference.md#refusal-reasons) for `replicas`, the ACME block
/// (`proxy.acme`, the proxy's own, or `proxy.extensions.sbmesh.acme`, the
/// sidecar's) and the backend it uses (`redb` when omitted: what both
/// default to).
pub fn acme_store_not_shared_message(replicas: i32, block: &str, backend: &str) -> String {
    format!(
        "spec.replicas is {replicas} and {block}.enabled is true with storage_backend \"{backend}\", \
         which is local to one pod. Each replica would open its own order for the same hostname, \
         and an HTTP-01 challenge load-balanced to a replica that did not open it cannot be answered. \
         Use a shared store (file on an RWX volume, redis, s3, gcs, or azure), set spec.replicas to 1, \
         or issue certificates with cert-manager and leave {block} disabled."
    )
}

/// The ACME blocks of an `sb.yml`: the sidecar's, then the proxy's own.
const ACME_BLOCKS: [&[&str]; 2] = [
    &["proxy", "extensions", "sbmesh", "acme"],
    &["proxy", "acme"],
];

/// Name of the cluster-key Secret the operator creates: `<name>-cluster-key`.
pub fn cluster_key_secret_name(proxy: &SBProxy) -> String {
    format!("{}-cluster-key", proxy.name_any())
}

/// `<name>-mesh`: the headless Service of the mesh, and the NetworkPolicy
/// that guards it.
pub fn mesh_name(instance: &str) -> String {
    format!("{instance}-mesh")
}

/// `<name>-svc`: the Service a user exposes (docs/reference.md#objects-the-operator-applies).
pub fn service_name(instance: &str) -> String {
    format!("{instance}-svc")
}

/// Where the CA's HTTP-01 request lands, as a pod of `proxy` in `ns`
/// reaches it: port 80 of its Service, by the Service's cluster DNS name
/// (kube-proxy sends it to a ready pod, as it sends the CA's request that
/// came in through a load balancer). The sidecar fetches a probe token
/// there before each order (`SBMESH_ACME_CHECK_URL`).
pub fn acme_check_url(proxy: &SBProxy, ns: &str) -> String {
    format!(
        "http://{}.{ns}.svc.{}:{ACME_SERVICE_PORT}",
        service_name(&proxy.name_any()),
        proxy.spec.clustering.cluster_domain
    )
}

/// A fresh cluster key: 32 random bytes as 64 lowercase hex chars.
pub fn fresh_cluster_key() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}

/// The labels of every object (and of the pods).
pub fn labels(instance: &str) -> BTreeMap<String, String> {
    let mut labels = selector_labels(instance);
    labels.insert("app.kubernetes.io/managed-by".into(), MANAGER.into());
    labels
}

/// The labels that select an SBProxy's pods.
pub fn selector_labels(instance: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "sbproxy".to_string()),
        (
            "app.kubernetes.io/instance".to_string(),
            instance.to_string(),
        ),
    ])
}

/// Renders the objects of `proxy`, or says why it must not be applied.
///
/// `config` is the SBProxyConfig named by `spec.configRef` (`None`: not
/// found). `existing_secret` is the `<name>-cluster-key` Secret when it
/// exists: it is then referenced, never rendered again. Owner references
/// are set when the SBProxy has a uid (it has one when read from a cluster).
///
/// Checks, in order: replicas (TooManyReplicas), the config's presence
/// (ConfigNotFound), the config itself (ConfigInvalid), the ACME store
/// against the replica count (AcmeStoreNotShared), then `spec.podTemplate`
/// against what the operator puts in the pod (PodTemplateInvalid).
pub fn render(
    proxy: &SBProxy,
    config: Option<&SBProxyConfig>,
    existing_secret: Option<&Secret>,
    opts: &RenderOptions,
) -> Result<Rendered, Refusal> {
    let spec = &proxy.spec;
    let name = proxy.name_any();
    let ns = proxy.namespace().unwrap_or_else(|| "default".to_string());
    check_replicas(proxy)?;
    let text = &referenced_config(proxy, config, &ns)?.spec.config;
    let facts = check_config(proxy, &ns, text)?;
    let template = pod_template(proxy, &name, &ns, opts, &facts, existing_secret.is_some())?;

    let stamp = Stamp {
        ns: &ns,
        instance: &name,
        owner: owner_reference(proxy),
    };
    let generated_key = spec.clustering.enabled && spec.clustering.cluster_secret_ref.is_none();
    Ok(Rendered {
        stateful_set: stateful_set(proxy, &stamp, template),
        headless_service: headless_service(proxy, &stamp),
        service: service(proxy, &stamp, &facts),
        config_map: ConfigMap {
            metadata: stamp.meta(format!("{name}-config")),
            data: Some(BTreeMap::from([(CONFIG_KEY.to_string(), text.clone())])),
            ..ConfigMap::default()
        },
        cluster_key_secret: (generated_key && existing_secret.is_none())
            .then(|| cluster_key_secret(proxy, &stamp, &opts.fresh_cluster_key)),
        pdb: (spec.replicas > 1).then(|| PodDisruptionBudget {
            metadata: stamp.meta(format!("{name}-pdb")),
            spec: Some(PodDisruptionBudgetSpec {
                max_unavailable: Some(IntOrString::Int(1)),
                selector: Some(stamp.selector()),
                ..PodDisruptionBudgetSpec::default()
            }),
            ..PodDisruptionBudget::default()
        }),
        network_policy: spec.network_policy.then(|| NetworkPolicy {
            metadata: stamp.meta(mesh_name(&name)),
            spec: Some(network_policy_spec(
                proxy,
                &selector_labels(&name),
                facts.https_port,
            )),
        }),
        pod_monitor: spec.pod_monitor.then(|| PodMonitor {
            metadata: stamp.meta(name.clone()),
            spec: PodMonitorSpec {
                selector: stamp.selector(),
                pod_metrics_endpoints: vec![PodMetricsEndpoint {
                    port: SIDECAR_ADMIN_PORT.to_string(),
                    path: "/metrics".to_string(),
                }],
            },
        }),
        config_hash: format!("sha256:{}", sbmesh::sha256_hex(text.as_bytes())),
    })
}

/// TooManyReplicas: `spec.replicas` outside 1 to [`crd::MAX_REPLICAS`].
fn check_replicas(proxy: &SBProxy) -> Result<(), Refusal> {
    let replicas = proxy.spec.replicas;
    if (1..=crd::MAX_REPLICAS).contains(&replicas) {
        return Ok(());
    }
    Err(Refusal::new(
        RefusalReason::TooManyReplicas,
        format!(
            "spec.replicas is {replicas}; an SBProxy runs 1 to {} replicas. Set spec.replicas within that range.",
            crd::MAX_REPLICAS
        ),
    ))
}

/// The SBProxyConfig `spec.configRef` names, or ConfigNotFound.
fn referenced_config<'c>(
    proxy: &SBProxy,
    config: Option<&'c SBProxyConfig>,
    ns: &str,
) -> Result<&'c SBProxyConfig, Refusal> {
    let config_name = proxy
        .spec
        .config_ref
        .name()
        .map_err(|message| Refusal::new(RefusalReason::ConfigNotFound, message))?;
    config.ok_or_else(|| {
        Refusal::new(
            RefusalReason::ConfigNotFound,
            format!(
                "spec.configRef is {config_name:?} but no SBProxyConfig of that name exists in namespace {ns:?}. \
                 Create it, or point spec.configRef at an existing SBProxyConfig."
            ),
        )
    })
}

/// What every object of one SBProxy carries: its namespace, the instance
/// labels, and the SBProxy as controlling owner (when it has a uid).
struct Stamp<'a> {
    ns: &'a str,
    instance: &'a str,
    owner: Option<OwnerReference>,
}

impl Stamp<'_> {
    fn meta(&self, name: String) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.ns.to_string()),
            labels: Some(labels(self.instance)),
            owner_references: self.owner.clone().map(|o| vec![o]),
            ..ObjectMeta::default()
        }
    }

    /// The pods of this SBProxy.
    fn selector(&self) -> LabelSelector {
        LabelSelector {
            match_labels: Some(selector_labels(self.instance)),
            ..LabelSelector::default()
        }
    }
}

/// The generated cluster-key Secret, holding `key`.
fn cluster_key_secret(proxy: &SBProxy, stamp: &Stamp, key: &str) -> Secret {
    Secret {
        // No owner reference: the key outlives the SBProxy's clustering
        // being turned off, and a re-created SBProxy rejoins with it.
        metadata: ObjectMeta {
            owner_references: None,
            ..stamp.meta(cluster_key_secret_name(proxy))
        },
        type_: Some("Opaque".to_string()),
        data: Some(BTreeMap::from([(
            CLUSTER_KEY_KEY.to_string(),
            ByteString(key.as_bytes().to_vec()),
        )])),
        ..Secret::default()
    }
}

/// `<name>-mesh`: headless, the gossip and transport ports.
fn headless_service(proxy: &SBProxy, stamp: &Stamp) -> Service {
    let clustering = &proxy.spec.clustering;
    Service {
        metadata: stamp.meta(mesh_name(stamp.instance)),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_string()),
            // Seeds must resolve before a pod is ready: readiness waits for the mesh.
            publish_not_ready_addresses: Some(true),
            selector: Some(selector_labels(stamp.instance)),
            ports: Some(vec![
                service_port("gossip", "UDP", clustering.gossip_port, "gossip"),
                service_port("transport", "TCP", clustering.transport_port, "transport"),
            ]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// `<name>-svc`: `http`, `acme`, and `https` when the config sets
/// `proxy.https_bind_port`.
fn service(proxy: &SBProxy, stamp: &Stamp, facts: &ConfigFacts) -> Service {
    Service {
        metadata: stamp.meta(service_name(stamp.instance)),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_string()),
            selector: Some(selector_labels(stamp.instance)),
            ports: Some(
                [
                    service_port("http", "TCP", proxy.spec.port, "http"),
                    service_port("acme", "TCP", ACME_SERVICE_PORT, "acme"),
                ]
                .into_iter()
                // A proxy that terminates TLS itself is reachable on 443.
                .chain(
                    facts
                        .https_port
                        .map(|_| service_port("https", "TCP", HTTPS_SERVICE_PORT, "https")),
                )
                .collect(),
            ),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// `<name>-proxy`: `spec.replicas` pods of `template`, started in order and
/// updated one at a time.
fn stateful_set(proxy: &SBProxy, stamp: &Stamp, template: PodTemplateSpec) -> StatefulSet {
    StatefulSet {
        metadata: stamp.meta(format!("{}-proxy", stamp.instance)),
        spec: Some(StatefulSetSpec {
            replicas: Some(proxy.spec.replicas),
            service_name: Some(mesh_name(stamp.instance)),
            pod_management_policy: Some("OrderedReady".to_string()),
            update_strategy: Some(StatefulSetUpdateStrategy {
                type_: Some("RollingUpdate".to_string()),
                rolling_update: Some(RollingUpdateStatefulSetStrategy {
                    partition: Some(0),
                    ..RollingUpdateStatefulSetStrategy::default()
                }),
            }),
            selector: stamp.selector(),
            template,
            ..StatefulSetSpec::default()
        }),
        ..StatefulSet::default()
    }
}

fn owner_reference(proxy: &SBProxy) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: crd::API_VERSION.to_string(),
        kind: "SBProxy".to_string(),
        name: proxy.name_any(),
        uid: proxy.metadata.uid.clone().filter(|uid| !uid.is_empty())?,
        controller: Some(true),
        block_owner_deletion: Some(true),
    })
}

fn service_port(name: &str, protocol: &str, port: i32, target: &str) -> ServicePort {
    ServicePort {
        name: Some(name.to_string()),
        protocol: Some(protocol.to_string()),
        port,
        target_port: Some(IntOrString::String(target.to_string())),
        ..ServicePort::default()
    }
}
