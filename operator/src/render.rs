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

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::{
    RollingUpdateStatefulSetStrategy, StatefulSet, StatefulSetSpec, StatefulSetUpdateStrategy,
};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMap, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource,
    EnvVar, EnvVarSource, HTTPGetAction, KeyToPath, ObjectFieldSelector, PodSecurityContext,
    PodSpec, PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile, Secret,
    SecretKeySelector, SecretVolumeSource, SecurityContext, Service, ServicePort, ServiceSpec,
    Sysctl, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use sbmesh::config::{Interpolated, Problem};
use sbmesh::flags;
use serde_json::Value;
use serde_norway::Value as Yaml;

use crate::crd::{self, PodTemplate, SBProxy, SBProxyConfig};
use crate::podmonitor::{PodMetricsEndpoint, PodMonitor, PodMonitorSpec};

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
        config_hash: format!("sha256:{}", sbmesh::config::sha256_hex(text.as_bytes())),
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

/// The pod template: the operator's pod, then `spec.podTemplate` on top
/// ([`add_pod_knobs`]). Reads neither `spec.replicas` nor the config text,
/// except three facts of the config (`facts`), each of which needs a proxy
/// restart anyway:
/// - whether the sidecar restarts the proxy: it signals the proxy's
///   process, which only a shared process namespace lets it see
///   (docs/reference.md#certificate-files);
/// - `proxy.https_bind_port`: the proxy container's `https` port;
/// - whether a port the pod binds is below 1024 (`proxy.http_bind_port`
///   and `https_bind_port` among them): see [`low_port_privileges`].
///
/// No other config edit rolls the pods.
///
/// Every container is admitted by Pod Security's `restricted` profile: the
/// pod runs as non-root 65532 with the runtime's seccomp profile, and each
/// container drops every capability and cannot gain privileges.
fn pod_template(
    proxy: &SBProxy,
    name: &str,
    ns: &str,
    opts: &RenderOptions,
    facts: &ConfigFacts,
    has_key_secret: bool,
) -> Result<PodTemplateSpec, Refusal> {
    let spec = &proxy.spec;
    let mesh = spec.clustering.enabled.then(|| MeshSettings {
        service: mesh_name(name),
        cluster_domain: spec.clustering.cluster_domain.clone(),
        gossip_port: spec.clustering.gossip_port,
        transport_port: spec.clustering.transport_port,
    });
    // The key seals the store's records as well as the mesh: a pod keeps
    // it with clustering turned off (the operator's Secret is kept then),
    // or it could not open the certificate its fleet stored and would
    // order another.
    let cluster_key = match &spec.clustering.cluster_secret_ref {
        Some(r) => Some(KeySecret {
            name: r.name.clone(),
            key: r.key.clone(),
        }),
        None => (spec.clustering.enabled || has_key_secret).then(|| KeySecret {
            name: cluster_key_secret_name(proxy),
            key: CLUSTER_KEY_KEY.to_string(),
        }),
    };
    let key_volume = cluster_key.as_ref().map(cluster_key_volume);
    let sidecar = sidecar_container(&SidecarSettings {
        image: spec
            .sidecar
            .image
            .clone()
            .unwrap_or_else(|| opts.sidecar_image.clone()),
        cluster_id: name.to_string(),
        admin_port: spec.sidecar.admin_port,
        challenge_port: spec.sidecar.challenge_port,
        proxy_admin_port: Some(spec.admin_port),
        proxy_http_port: Some(spec.port),
        acme_check_url: Some(acme_check_url(proxy, ns)),
        mesh,
        cluster_key,
        authorization: spec
            .admin_auth_secret_ref
            .as_ref()
            .map(|r| (r.name.clone(), r.key.clone())),
        resources: spec.sidecar.resources.clone(),
        config_volume: CONFIG_VOLUME.to_string(),
        data_volume: DATA_VOLUME.to_string(),
    });
    let (proxy_capability, unprivileged_port_start) = low_port_privileges(proxy, facts);
    let proxy_container = proxy_container(proxy, facts, proxy_capability);
    let mut template = PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels(name)),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            init_containers: Some(vec![sidecar]),
            containers: vec![proxy_container],
            share_process_namespace: facts.restarts_proxy.then_some(true),
            // Both containers run as the sidecar's user: the certificate
            // keys it writes for the proxy are 0600 (docs/reference.md#certificate-files), so the
            // proxy must be the same user to read them. fsGroup makes the
            // shared emptyDir writable by it.
            security_context: Some(pod_security_context(unprivileged_port_start)),
            volumes: Some(
                [
                    Volume {
                        name: CONFIG_VOLUME.to_string(),
                        config_map: Some(ConfigMapVolumeSource {
                            name: format!("{name}-config"),
                            ..ConfigMapVolumeSource::default()
                        }),
                        ..Volume::default()
                    },
                    data_volume(DATA_VOLUME),
                ]
                .into_iter()
                .chain(key_volume)
                .collect(),
            ),
            ..PodSpec::default()
        }),
    };
    if let Some(knobs) = &spec.pod_template {
        add_pod_knobs(&mut template, knobs)?;
    }
    if facts.restarts_proxy {
        set_restart_grace(&mut template);
    }
    Ok(template)
}

/// The pod's security context: both containers as the sidecar's
/// non-root user, the runtime's seccomp profile, and the lowest port a
/// process may bind without privilege when a port below 1024 needs it.
fn pod_security_context(unprivileged_port_start: Option<i32>) -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(NONROOT_UID),
        run_as_group: Some(NONROOT_UID),
        fs_group: Some(NONROOT_UID),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_string(),
            ..SeccompProfile::default()
        }),
        sysctls: unprivileged_port_start.map(|port| {
            vec![Sysctl {
                name: UNPRIVILEGED_PORT_SYSCTL.to_string(),
                value: port.to_string(),
            }]
        }),
        ..PodSecurityContext::default()
    }
}

/// The proxy container: `spec.image` with its `http`, `admin` (and, when the
/// config sets `proxy.https_bind_port`, `https`) ports, the two mounts it
/// shares with the sidecar, and `capability` (when a port of the proxy is
/// below 1024: [`low_port_privileges`]) as the only one it keeps.
fn proxy_container(proxy: &SBProxy, facts: &ConfigFacts, capability: Option<&str>) -> Container {
    let spec = &proxy.spec;
    Container {
        name: PROXY_CONTAINER.to_string(),
        image: Some(spec.image.clone()),
        ports: Some(
            [
                container_port("http", spec.port, "TCP"),
                container_port("admin", spec.admin_port, "TCP"),
            ]
            .into_iter()
            .chain(facts.https_port.map(|p| container_port("https", p, "TCP")))
            .collect(),
        ),
        // The proxy interpolates ${SBPROXY_POD_NAME} and ${SBPROXY_POD_IP}
        // in sb.yml as the sidecar does.
        env: Some(vec![
            field_env(flags::POD_NAME.env, "metadata.name"),
            field_env(flags::POD_IP.env, "status.podIP"),
        ]),
        readiness_probe: Some(readiness_probe("/health", "http")),
        resources: spec.resources.clone(),
        volume_mounts: Some(vec![
            mount(CONFIG_VOLUME, CONFIG_DIR, true),
            mount(DATA_VOLUME, DATA_DIR, false),
        ]),
        // The root file system is left writable: what the proxy writes
        // outside /var/lib/sbproxy is its own business.
        security_context: Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_string()]),
                add: capability.map(|c| vec![c.to_string()]),
            }),
            ..SecurityContext::default()
        }),
        ..Container::default()
    }
}

/// The proxy container's shutdown grace in restart mode
/// ([`RESTART_PROXY_GRACE_MS`]), unless `podTemplate.proxyEnv` set it.
fn set_restart_grace(template: &mut PodTemplateSpec) {
    let name = flags::SHUTDOWN_GRACE_MS.env;
    let proxy = template
        .spec
        .iter_mut()
        .flat_map(|pod| pod.containers.iter_mut())
        .find(|c| c.name == PROXY_CONTAINER);
    if let Some(proxy) = proxy {
        let env = proxy.env.get_or_insert_with(Vec::new);
        if !env.iter().any(|e| e.name == name) {
            env.push(value_env(name, &RESTART_PROXY_GRACE_MS.to_string()));
        }
    }
}

/// What a pod whose ports go below 1024 needs to bind them as uid 65532:
/// - the proxy container adds back `NET_BIND_SERVICE` (the one capability the
///   `restricted` profile lets a container add) when one of the proxy's
///   ports (`spec.port`, `spec.adminPort`, `proxy.http_bind_port`,
///   `proxy.https_bind_port`) is below 1024. That alone serves a proxy
///   binary that carries the file capability: the container runtime gives a
///   non-root process no ambient capabilities;
/// - so the pod also gets `net.ipv4.ip_unprivileged_port_start` set to its
///   lowest port below 1024 (the proxy's or the sidecar's), which lets any
///   non-root process of the pod bind from there up.
///
/// `(None, None)` when every port is 1024 or above, as by default.
fn low_port_privileges(
    proxy: &SBProxy,
    facts: &ConfigFacts,
) -> (Option<&'static str>, Option<i32>) {
    let spec = &proxy.spec;
    let proxy_ports = [spec.port, spec.admin_port]
        .into_iter()
        .chain(facts.http_port)
        .chain(facts.https_port);
    let sidecar_ports = [spec.sidecar.admin_port, spec.sidecar.challenge_port]
        .into_iter()
        .chain(
            spec.clustering
                .enabled
                .then_some([spec.clustering.gossip_port, spec.clustering.transport_port])
                .into_iter()
                .flatten(),
        );
    let low = |port: &i32| *port < FIRST_UNPRIVILEGED_PORT;
    let capability = proxy_ports
        .clone()
        .any(|p| low(&p))
        .then_some("NET_BIND_SERVICE");
    let lowest = proxy_ports.chain(sidecar_ports).filter(low).min();
    (capability, lowest)
}

/// Adds `spec.podTemplate` to the operator's pod `template`, or refuses it
/// (`PodTemplateInvalid`, every problem on its own line) where it would
/// undo what the operator set: "the operator's own" is what `template`
/// holds before, so these checks follow whatever the pod gets.
fn add_pod_knobs(template: &mut PodTemplateSpec, knobs: &PodTemplate) -> Result<(), Refusal> {
    let meta = template.metadata.get_or_insert_with(ObjectMeta::default);
    let Some(pod) = template.spec.as_mut() else {
        return Ok(());
    };
    let own_labels = meta.labels.clone().unwrap_or_default();
    let mut problems = label_problems(&own_labels, knobs);
    let own_volumes: Vec<&str> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    problems.extend(volume_problems(&own_volumes, knobs));
    let volume_names: Vec<&str> = own_volumes
        .iter()
        .copied()
        .chain(knobs.volumes.iter().map(|v| v.name.as_str()))
        .collect();

    let sidecars = pod.init_containers.iter_mut().flatten();
    let containers = pod.containers.iter_mut().chain(sidecars);
    for container in containers {
        let (mounts_field, mounts, env_field, env) = match container.name.as_str() {
            PROXY_CONTAINER => (
                "proxyVolumeMounts",
                &knobs.proxy_volume_mounts,
                "proxyEnv",
                &knobs.proxy_env,
            ),
            SIDECAR_CONTAINER => (
                "sidecarVolumeMounts",
                &knobs.sidecar_volume_mounts,
                "sidecarEnv",
                &knobs.sidecar_env,
            ),
            _ => continue,
        };
        problems.extend(mount_problems(
            container,
            mounts_field,
            mounts,
            &volume_names,
        ));
        problems.extend(env_problems(container, env_field, env));
        if !mounts.is_empty() {
            container
                .volume_mounts
                .get_or_insert_with(Vec::new)
                .extend(mounts.iter().cloned());
        }
        if !env.is_empty() {
            container
                .env
                .get_or_insert_with(Vec::new)
                .extend(env.iter().cloned());
        }
    }
    if !problems.is_empty() {
        return Err(Refusal::new(
            RefusalReason::PodTemplateInvalid,
            problems.join("\n"),
        ));
    }

    copy_pod_knobs(meta, pod, knobs);
    Ok(())
}

/// Labels of `spec.podTemplate` that would change one the operator sets.
fn label_problems(own: &BTreeMap<String, String>, knobs: &PodTemplate) -> Vec<String> {
    let mut problems = Vec::new();
    for (key, value) in &knobs.labels {
        if let Some(own) = own.get(key).filter(|own| *own != value) {
            problems.push(format!(
                "spec.podTemplate.labels[{key:?}] is {value:?}, but the operator sets that label to \
                 {own:?}: app.kubernetes.io/name and app.kubernetes.io/instance select the \
                 SBProxy's pods (StatefulSet, Services, PodDisruptionBudget), and \
                 app.kubernetes.io/managed-by marks them as the operator's. Remove it from \
                 spec.podTemplate.labels; any other label is accepted."
            ));
        }
    }
    problems
}

/// Volumes of `spec.podTemplate` named as one of the operator's
/// (`own_volumes`) or as an earlier one of their own.
fn volume_problems(own_volumes: &[&str], knobs: &PodTemplate) -> Vec<String> {
    let mut problems = Vec::new();
    for (i, volume) in knobs.volumes.iter().enumerate() {
        if own_volumes.contains(&volume.name.as_str()) {
            problems.push(format!(
                "spec.podTemplate.volumes[{i}].name is {:?}, the name of a volume the operator \
                 puts in the pod ({}). Rename it, and the mounts that use it; any other name is \
                 accepted.",
                volume.name,
                own_volumes.join(", ")
            ));
        } else if let Some(first) = knobs.volumes[..i]
            .iter()
            .position(|v| v.name == volume.name)
        {
            problems.push(format!(
                "spec.podTemplate.volumes[{i}].name is {:?}, as is \
                 spec.podTemplate.volumes[{first}].name; each volume of a pod needs its own name. \
                 Rename one of them.",
                volume.name
            ));
        }
    }
    problems
}

/// The pod-wide knobs of `spec.podTemplate`, once they were found sound.
fn copy_pod_knobs(meta: &mut ObjectMeta, pod: &mut PodSpec, knobs: &PodTemplate) {
    if !knobs.labels.is_empty() {
        meta.labels
            .get_or_insert_with(BTreeMap::new)
            .extend(knobs.labels.clone());
    }
    // The operator sets none of these itself.
    meta.annotations = (!knobs.annotations.is_empty()).then(|| knobs.annotations.clone());
    pod.node_selector = (!knobs.node_selector.is_empty()).then(|| knobs.node_selector.clone());
    pod.tolerations = non_empty(&knobs.tolerations);
    pod.affinity = knobs.affinity.clone();
    pod.topology_spread_constraints = non_empty(&knobs.topology_spread_constraints);
    pod.priority_class_name = knobs.priority_class_name.clone();
    pod.service_account_name = knobs.service_account_name.clone();
    pod.image_pull_secrets = non_empty(&knobs.image_pull_secrets);
    pod.termination_grace_period_seconds = knobs.termination_grace_period_seconds;
    if let Some(theirs) = &knobs.security_context {
        pod.security_context = Some(merged_security_context(
            pod.security_context.take().unwrap_or_default(),
            theirs,
        ));
    }
    if !knobs.volumes.is_empty() {
        pod.volumes
            .get_or_insert_with(Vec::new)
            .extend(knobs.volumes.iter().cloned());
    }
}

fn non_empty<T: Clone>(list: &[T]) -> Option<Vec<T>> {
    (!list.is_empty()).then(|| list.to_vec())
}

/// The problems of the user's `mounts` (`spec.podTemplate.<field>`) for
/// `container`, as the operator made it: each must name a volume of
/// `volume_names`, and stay out of the operator's mount paths there.
fn mount_problems(
    container: &Container,
    field: &str,
    mounts: &[VolumeMount],
    volume_names: &[&str],
) -> Vec<String> {
    let own: Vec<&VolumeMount> = container.volume_mounts.iter().flatten().collect();
    let own_paths: Vec<&str> = own.iter().map(|m| m.mount_path.as_str()).collect();
    let mut problems = Vec::new();
    for (i, mount) in mounts.iter().enumerate() {
        if !volume_names.contains(&mount.name.as_str()) {
            problems.push(format!(
                "spec.podTemplate.{field}[{i}].name is {:?}, but the pod has no volume of that \
                 name. Name one of its volumes ({}), or add {:?} to spec.podTemplate.volumes.",
                mount.name,
                volume_names.join(", "),
                mount.name
            ));
        }
        if let Some(taken) = own
            .iter()
            .find(|m| at_or_under(&mount.mount_path, &m.mount_path))
        {
            problems.push(format!(
                "spec.podTemplate.{field}[{i}].mountPath is {:?}, at or under {}, where the \
                 operator mounts {} in the {} container. Mount it outside the operator's paths \
                 there ({}).",
                mount.mount_path,
                taken.mount_path,
                taken.name,
                container.name,
                own_paths.join(", ")
            ));
        }
    }
    problems
}

/// The problems of the user's `env` (`spec.podTemplate.<field>`) for
/// `container`, as the operator made it: none may set a variable the
/// operator sets there (its value comes from another spec field).
fn env_problems(container: &Container, field: &str, env: &[EnvVar]) -> Vec<String> {
    let own: Vec<&str> = container
        .env
        .iter()
        .flatten()
        .map(|e| e.name.as_str())
        .collect();
    let mut problems = Vec::new();
    for (i, var) in env.iter().enumerate() {
        let name = var.name.as_str();
        let why = if own.contains(&name) {
            format!(
                "which the operator sets on the {} container: it {}",
                container.name,
                set_from(name)
            )
        } else if name == flags::CLUSTER_KEY.env && own.contains(&flags::CLUSTER_KEY_FILE.env) {
            // The sidecar refuses both at once.
            format!(
                "but the operator gives the {} container {}, and the sidecar takes one or the \
                 other: the key {}",
                container.name,
                flags::CLUSTER_KEY_FILE.env,
                set_from(flags::CLUSTER_KEY_FILE.env)
            )
        } else {
            continue;
        };
        problems.push(format!(
            "spec.podTemplate.{field}[{i}].name is {name}, {why}. Remove it from \
             spec.podTemplate.{field}; any variable the operator does not set is accepted."
        ));
    }
    problems
}

/// Where the value of a variable the operator sets comes from, for the
/// message refusing the same variable in `proxyEnv` or `sidecarEnv`.
fn set_from(var: &str) -> &'static str {
    let from = [
        (
            &flags::POD_NAME,
            "is the pod's name (downward API metadata.name)",
        ),
        (
            &flags::POD_IP,
            "is the pod's IP (downward API status.podIP)",
        ),
        (
            &flags::NAMESPACE,
            "is the pod's namespace (downward API metadata.namespace)",
        ),
        (
            &flags::CLUSTER_ID,
            "comes from metadata.name, the SBProxy's name",
        ),
        (
            &flags::CONFIG,
            "is the sb.yml of the SBProxyConfig that spec.configRef names, mounted at /etc/sbproxy",
        ),
        (
            &flags::ADMIN_LISTEN,
            "comes from spec.sidecar.adminPort: set that instead",
        ),
        (
            &flags::CHALLENGE_LISTEN,
            "comes from spec.sidecar.challengePort: set that instead",
        ),
        (
            &flags::CERT_DIR,
            "is in the volume shared with the proxy (/var/lib/sbproxy), where the proxy reads the certificates",
        ),
        (
            &flags::STATE_DIR,
            "is in the pod's shared volume (/var/lib/sbproxy)",
        ),
        (
            &flags::PROXY_RELOAD_URL,
            "comes from spec.adminPort: set that instead",
        ),
        (
            &flags::CHALLENGE_PASSTHROUGH,
            "comes from spec.port, the proxy's HTTP listener, to which the challenge port (the \
             Service's port 80) passes every request that is not an ACME challenge",
        ),
        (
            &flags::ACME_CHECK_URL,
            "is port 80 of the Service <metadata.name>-svc the operator makes, where the CA's \
             HTTP-01 request lands",
        ),
        (
            &flags::MESH_SERVICE,
            "is the headless Service <metadata.name>-mesh the operator makes",
        ),
        (
            &flags::CLUSTER_DOMAIN,
            "comes from spec.clustering.clusterDomain: set that instead",
        ),
        (
            &flags::GOSSIP_PORT,
            "comes from spec.clustering.gossipPort: set that instead",
        ),
        (
            &flags::TRANSPORT_PORT,
            "comes from spec.clustering.transportPort: set that instead",
        ),
        (
            &flags::CLUSTER_KEY_FILE,
            "comes from the Secret of spec.clustering.clusterSecretRef (else <metadata.name>-cluster-key), \
             mounted as a file: set clusterSecretRef instead",
        ),
        (
            &flags::PROXY_AUTHORIZATION,
            "comes from spec.adminAuthSecretRef: set that instead",
        ),
    ];
    from.iter()
        .find(|(flag, _)| flag.env == var)
        .map_or("is the operator's own", |(_, why)| why)
}

/// Whether `path` is `dir` or lies under it, by path components
/// (`/etc/sbproxy2` is not under `/etc/sbproxy`; `/etc//sbproxy/` is it).
fn at_or_under(path: &str, dir: &str) -> bool {
    let (path, dir) = (path_components(path), path_components(dir));
    path.len() >= dir.len() && path[..dir.len()] == dir[..]
}

fn path_components(path: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            part => out.push(part),
        }
    }
    out
}

/// `theirs` over `own`, field by field: each field `theirs` sets wins
/// whole (a `seccompProfile` of theirs replaces the operator's), the
/// operator's other fields stay.
fn merged_security_context(
    own: PodSecurityContext,
    theirs: &PodSecurityContext,
) -> PodSecurityContext {
    // As JSON objects, an unset field is an absent member.
    let (Value::Object(mut merged), Value::Object(theirs)) = (to_json(&own), to_json(theirs))
    else {
        return own;
    };
    merged.extend(theirs);
    serde_json::from_value(Value::Object(merged)).unwrap_or(own)
}

/// `<name>-mesh`'s rules. Ingress only (egress stays open: the sidecar
/// reaches the CA, the store and the DNS, the proxy its origins):
/// - the mesh (gossip UDP, transport TCP) from the pods of this SBProxy
///   alone, when clustering is on: nothing else has the cluster key;
/// - from anywhere: the proxy's data ports (`spec.port`, and the config's
///   `proxy.https_bind_port` when it has one), the challenge port (the
///   CA validates from the internet, through `<name>-svc`), and the
///   sidecar's admin port, so that Prometheus, wherever it runs, can scrape
///   `/metrics` (`/admin/*` there answers loopback or Basic auth only).
///
/// The proxy's admin port is not admitted: sbproxy binds it on 127.0.0.1
/// and only the sidecar, in the same pod, calls it.
fn network_policy_spec(
    proxy: &SBProxy,
    selector: &BTreeMap<String, String>,
    https_port: Option<i32>,
) -> NetworkPolicySpec {
    let spec = &proxy.spec;
    let pods = || LabelSelector {
        match_labels: Some(selector.clone()),
        ..LabelSelector::default()
    };
    let port = |protocol: &str, port: i32| NetworkPolicyPort {
        protocol: Some(protocol.to_string()),
        port: Some(IntOrString::Int(port)),
        ..NetworkPolicyPort::default()
    };
    let mesh = spec.clustering.enabled.then(|| NetworkPolicyIngressRule {
        from: Some(vec![NetworkPolicyPeer {
            pod_selector: Some(pods()),
            ..NetworkPolicyPeer::default()
        }]),
        ports: Some(vec![
            port("UDP", spec.clustering.gossip_port),
            port("TCP", spec.clustering.transport_port),
        ]),
    });
    let open = NetworkPolicyIngressRule {
        from: None,
        ports: Some(
            std::iter::once(spec.port)
                .chain(https_port)
                .chain([spec.sidecar.challenge_port, spec.sidecar.admin_port])
                .map(|p| port("TCP", p))
                .collect(),
        ),
    };
    NetworkPolicySpec {
        pod_selector: Some(pods()),
        policy_types: Some(vec!["Ingress".to_string()]),
        ingress: Some(mesh.into_iter().chain([open]).collect()),
        ..NetworkPolicySpec::default()
    }
}

/// The file the sidecar reads its key ring from (`--cluster-key-file`).
pub fn cluster_key_file() -> String {
    format!("{CLUSTER_KEY_DIR}/{CLUSTER_KEY_KEY}")
}

/// The cluster-key Secret as a volume: its key `key` as the file
/// [`cluster_key_file`] reads, whatever the Secret calls it.
pub fn cluster_key_volume(secret: &KeySecret) -> Volume {
    Volume {
        name: CLUSTER_KEY_VOLUME.to_string(),
        secret: Some(SecretVolumeSource {
            secret_name: Some(secret.name.clone()),
            items: Some(vec![KeyToPath {
                key: secret.key.clone(),
                path: CLUSTER_KEY_KEY.to_string(),
                ..KeyToPath::default()
            }]),
            // The default mode (0644): a pod `inject` adds the sidecar to may
            // have no fsGroup, and the sidecar's user must read it.
            ..SecretVolumeSource::default()
        }),
        ..Volume::default()
    }
}

/// The shared emptyDir.
pub fn data_volume(name: &str) -> Volume {
    Volume {
        name: name.to_string(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }
}

/// The mesh part of the sidecar's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshSettings {
    /// Headless Service whose records are the seeds.
    pub service: String,
    /// Cluster DNS domain.
    pub cluster_domain: String,
    /// Gossip port (UDP).
    pub gossip_port: i32,
    /// Transport port (TCP).
    pub transport_port: i32,
}

/// Where the cluster key ring is: a Secret and its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySecret {
    /// The Secret.
    pub name: String,
    /// Its key holding the ring.
    pub key: String,
}

/// Everything the sidecar container is built from; `render` and `inject`
/// both fill one in, so the two never disagree on the container.
#[derive(Debug, Clone, PartialEq)]
pub struct SidecarSettings {
    /// Image.
    pub image: String,
    /// `SBMESH_CLUSTER_ID`.
    pub cluster_id: String,
    /// Admin listener port (probes, metrics).
    pub admin_port: i32,
    /// HTTP-01 responder port.
    pub challenge_port: i32,
    /// The proxy's admin port, for the reload URL; `None`: the sidecar's own
    /// default (`proxy.admin.port` from sb.yml, else 9090).
    pub proxy_admin_port: Option<i32>,
    /// The proxy's plain HTTP port in the same pod, where the challenge
    /// listener passes every request outside `/.well-known/acme-challenge/`
    /// (`SBMESH_CHALLENGE_PASSTHROUGH`); `None`: no passthrough, those get
    /// `404`.
    pub proxy_http_port: Option<i32>,
    /// Where the CA's request lands, as the pod reaches it
    /// (`SBMESH_ACME_CHECK_URL`, [`acme_check_url`]); `None`: the sidecar
    /// checks its own challenge listener.
    pub acme_check_url: Option<String>,
    /// The gossip mesh; `None`: the sidecar runs alone.
    pub mesh: Option<MeshSettings>,
    /// The cluster key ring, mounted as [`cluster_key_file`]: it seals the
    /// mesh and the store's records; `None`: records are written plain.
    pub cluster_key: Option<KeySecret>,
    /// Secret name and key of the reload `Authorization` header.
    pub authorization: Option<(String, String)>,
    /// Resources; `None`: small requests, no limits.
    pub resources: Option<ResourceRequirements>,
    /// Volume holding sb.yml, mounted at [`CONFIG_DIR`].
    pub config_volume: String,
    /// Shared volume, mounted at [`DATA_DIR`].
    pub data_volume: String,
}

/// The sidecar as a native sidecar: an initContainer with `restartPolicy:
/// Always`, so it starts before the proxy, stays up beside it, and stops
/// after it.
pub fn sidecar_container(s: &SidecarSettings) -> Container {
    let mut env = vec![
        field_env(flags::POD_NAME.env, "metadata.name"),
        field_env(flags::POD_IP.env, "status.podIP"),
        field_env(flags::NAMESPACE.env, "metadata.namespace"),
        value_env(flags::CLUSTER_ID.env, &s.cluster_id),
        value_env(flags::CONFIG.env, &format!("{CONFIG_DIR}/{CONFIG_KEY}")),
        value_env(
            flags::ADMIN_LISTEN.env,
            &format!("0.0.0.0:{}", s.admin_port),
        ),
        value_env(
            flags::CHALLENGE_LISTEN.env,
            &format!("0.0.0.0:{}", s.challenge_port),
        ),
        value_env(flags::CERT_DIR.env, &format!("{DATA_DIR}/certs")),
        value_env(flags::STATE_DIR.env, &format!("{DATA_DIR}/sidecar")),
    ];
    if let Some(port) = s.proxy_admin_port {
        env.push(value_env(
            flags::PROXY_RELOAD_URL.env,
            &format!("http://127.0.0.1:{port}/admin/reload"),
        ));
    }
    if let Some(port) = s.proxy_http_port {
        env.push(value_env(
            flags::CHALLENGE_PASSTHROUGH.env,
            &challenge_passthrough_url(port),
        ));
    }
    if let Some(url) = &s.acme_check_url {
        env.push(value_env(flags::ACME_CHECK_URL.env, url));
    }
    let mut ports = vec![
        container_port(SIDECAR_ADMIN_PORT, s.admin_port, "TCP"),
        container_port("acme", s.challenge_port, "TCP"),
    ];
    if let Some(mesh) = &s.mesh {
        env.extend([
            value_env(flags::MESH_SERVICE.env, &mesh.service),
            value_env(flags::CLUSTER_DOMAIN.env, &mesh.cluster_domain),
            value_env(flags::GOSSIP_PORT.env, &mesh.gossip_port.to_string()),
            value_env(flags::TRANSPORT_PORT.env, &mesh.transport_port.to_string()),
        ]);
        ports.push(container_port("gossip", mesh.gossip_port, "UDP"));
        ports.push(container_port("transport", mesh.transport_port, "TCP"));
    }
    if s.cluster_key.is_some() {
        env.push(value_env(flags::CLUSTER_KEY_FILE.env, &cluster_key_file()));
    }
    if let Some((secret, key)) = &s.authorization {
        env.push(secret_env(flags::PROXY_AUTHORIZATION.env, secret, key));
    }
    Container {
        name: SIDECAR_CONTAINER.to_string(),
        image: Some(s.image.clone()),
        command: Some(vec![SIDECAR_COMMAND.to_string()]),
        args: Some(vec!["run".to_string()]),
        restart_policy: Some("Always".to_string()),
        env: Some(env),
        ports: Some(ports),
        // The kubelet starts the proxy container once this passes (a native
        // sidecar's startup probe): the stored certificates are written by
        // then, so a proxy that reads its certificate once at start-up
        // serves the CA's, not a placeholder it would be restarted for.
        // The sidecar lets it pass after 5 s whatever the store does.
        startup_probe: Some(Probe {
            failure_threshold: Some(30),
            ..readiness_probe("/startupz", SIDECAR_ADMIN_PORT)
        }),
        readiness_probe: Some(readiness_probe("/readyz", SIDECAR_ADMIN_PORT)),
        liveness_probe: Some(Probe {
            // Generous: a stuck process, not a slow CA, is what this catches.
            failure_threshold: Some(6),
            ..http_probe("/healthz", SIDECAR_ADMIN_PORT)
        }),
        resources: Some(
            s.resources
                .clone()
                .unwrap_or_else(default_sidecar_resources),
        ),
        volume_mounts: Some(
            [
                mount(&s.config_volume, CONFIG_DIR, true),
                mount(&s.data_volume, DATA_DIR, false),
            ]
            .into_iter()
            .chain(
                s.cluster_key
                    .as_ref()
                    .map(|_| mount(CLUSTER_KEY_VOLUME, CLUSTER_KEY_DIR, true)),
            )
            .collect(),
        ),
        security_context: Some(restricted_security_context()),
        ..Container::default()
    }
}

/// Where the sidecar passes port 80's ordinary requests: the proxy's HTTP
/// listener in the same pod.
pub fn challenge_passthrough_url(proxy_http_port: i32) -> String {
    format!("http://127.0.0.1:{proxy_http_port}")
}

/// Non-root 65532, read-only root file system, no capabilities, no
/// privilege escalation: the sidecar and the operator run under it.
pub fn restricted_security_context() -> SecurityContext {
    SecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(NONROOT_UID),
        run_as_group: Some(NONROOT_UID),
        read_only_root_filesystem: Some(true),
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_string()]),
            ..Capabilities::default()
        }),
        ..SecurityContext::default()
    }
}

/// Requests that let the scheduler count the sidecar; no limits, so a
/// burst of ACME work is never throttled or killed.
fn default_sidecar_resources() -> ResourceRequirements {
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_string(), Quantity("50m".to_string())),
            ("memory".to_string(), Quantity("64Mi".to_string())),
        ])),
        ..ResourceRequirements::default()
    }
}

fn container_port(name: &str, port: i32, protocol: &str) -> ContainerPort {
    ContainerPort {
        name: Some(name.to_string()),
        container_port: port,
        protocol: Some(protocol.to_string()),
        ..ContainerPort::default()
    }
}

/// How often the kubelet asks whether a container is ready.
///
/// Every second: a pod counts as Ready within a second of its processes
/// being up (the StatefulSet starts pods one after the other, each once
/// the one before is Ready, and the ACME check waits for a Ready endpoint
/// behind the Service), and a pod that stops answering leaves the
/// Service's endpoints after 3 failed probes (3 s) instead of 30 s. The
/// cost is one local HTTP GET per second per container.
pub const READINESS_PERIOD_SECONDS: i32 = 1;

fn readiness_probe(path: &str, port: &str) -> Probe {
    Probe {
        period_seconds: Some(READINESS_PERIOD_SECONDS),
        ..http_probe(path, port)
    }
}

fn http_probe(path: &str, port: &str) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_string()),
            port: IntOrString::String(port.to_string()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(10),
        ..Probe::default()
    }
}

fn mount(volume: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: volume.to_string(),
        mount_path: path.to_string(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

fn value_env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.to_string()),
        ..EnvVar::default()
    }
}

/// An environment variable from the downward API (`fieldRef`).
pub(crate) fn field_env(name: &str, field: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: field.to_string(),
                ..ObjectFieldSelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

fn secret_env(name: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.to_string(),
                key: key.to_string(),
                ..SecretKeySelector::default()
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

// ---------------------------------------------------------------------------
// The config checks: ConfigInvalid, then AcmeStoreNotShared.

/// What the sidecar's environment will hold, as far as it is known before a
/// pod exists: literal values the operator sets, and stand-ins of the right
/// form for what only the pod knows (its name, its IP, Secret values).
/// The literal values of `spec.podTemplate.sidecarEnv` are known too (one
/// that would change the operator's is refused: PodTemplateInvalid). Every
/// other variable is unknown: unset in the sidecar unless the image sets it,
/// or set from a Secret, so a value that depends on one is left for the
/// sidecar to check.
fn known_env<'p>(proxy: &'p SBProxy, ns: &str) -> BTreeMap<&'p str, String> {
    let spec = &proxy.spec;
    let name = proxy.name_any();
    let mut env = BTreeMap::from([
        (flags::POD_NAME.env, format!("{name}-proxy-0")),
        ("HOSTNAME", format!("{name}-proxy-0")),
        // TEST-NET-1: any address of the right form.
        (flags::POD_IP.env, "192.0.2.1".to_string()),
        (flags::NAMESPACE.env, ns.to_string()),
        (flags::CLUSTER_ID.env, name.clone()),
        (flags::CONFIG.env, format!("{CONFIG_DIR}/{CONFIG_KEY}")),
        (
            flags::ADMIN_LISTEN.env,
            format!("0.0.0.0:{}", spec.sidecar.admin_port),
        ),
        (
            flags::CHALLENGE_LISTEN.env,
            format!("0.0.0.0:{}", spec.sidecar.challenge_port),
        ),
        (flags::CERT_DIR.env, format!("{DATA_DIR}/certs")),
        (flags::STATE_DIR.env, format!("{DATA_DIR}/sidecar")),
        (
            flags::PROXY_RELOAD_URL.env,
            format!("http://127.0.0.1:{}/admin/reload", spec.admin_port),
        ),
        (
            flags::CHALLENGE_PASSTHROUGH.env,
            challenge_passthrough_url(spec.port),
        ),
        (flags::ACME_CHECK_URL.env, acme_check_url(proxy, ns)),
    ]);
    if spec.clustering.enabled {
        env.insert(flags::MESH_SERVICE.env, mesh_name(&name));
        env.insert(
            flags::CLUSTER_DOMAIN.env,
            spec.clustering.cluster_domain.clone(),
        );
        env.insert(
            flags::GOSSIP_PORT.env,
            spec.clustering.gossip_port.to_string(),
        );
        env.insert(
            flags::TRANSPORT_PORT.env,
            spec.clustering.transport_port.to_string(),
        );
        env.insert(flags::CLUSTER_KEY_FILE.env, cluster_key_file());
    }
    if spec.admin_auth_secret_ref.is_some() {
        env.insert(
            flags::PROXY_AUTHORIZATION.env,
            "Basic c2JtZXNoOnNibWVzaA==".to_string(),
        );
    }
    let literals = spec
        .pod_template
        .iter()
        .flat_map(|t| &t.sidecar_env)
        .filter(|var| var.value_from.is_none());
    for var in literals {
        env.entry(var.name.as_str())
            .or_insert_with(|| var.value.clone().unwrap_or_default());
    }
    env
}

/// What the other objects need from an accepted config.
struct ConfigFacts {
    /// The sidecar restarts the proxy: `SBMESH_PROXY_CERT_APPLY` in
    /// `sidecarEnv`, else `sbmesh.acme.apply`, is `restart`.
    restarts_proxy: bool,
    /// `proxy.https_bind_port`: a port of the proxy the NetworkPolicy
    /// admits, `<name>-svc` exposes as 443 and the proxy container declares.
    https_port: Option<i32>,
    /// `proxy.http_bind_port`, when the config sets it (`spec.port` is the
    /// one the objects use; this only counts for [`low_port_privileges`]).
    http_port: Option<i32>,
}

/// ConfigInvalid and AcmeStoreNotShared, in that order (the documented message
/// wins for `storage_backend: sqlite`, which the sidecar refuses as unknown).
fn check_config(proxy: &SBProxy, ns: &str, text: &str) -> Result<ConfigFacts, Refusal> {
    let config_name = proxy.spec.config_ref.name().unwrap_or_default();
    let invalid = |problems: Vec<String>| {
        Refusal::new(
            RefusalReason::ConfigInvalid,
            format!(
                "SBProxyConfig {config_name:?} in namespace {ns:?}: spec.config is not a valid sb.yml:\n{}",
                problems.join("\n")
            ),
        )
    };
    if text.len() > crd::MAX_CONFIG_BYTES {
        return Err(invalid(vec![format!(
            "(file): {} bytes; a ConfigMap holds at most {} (1 MiB)",
            text.len(),
            crd::MAX_CONFIG_BYTES
        )]));
    }

    let env = known_env(proxy, ns);
    let interpolated = sbmesh::config::interpolate_report(text, &|var| env.get(var).cloned());
    let reading = Reading {
        raw: serde_norway::from_str(text).ok(),
        tree: serde_norway::from_str::<Yaml>(&interpolated.text)
            .ok()
            .and_then(|mut v| v.apply_merge().ok().map(|()| v)),
        env,
    };
    let not_shared = acme_store_not_shared(proxy, &reading);
    let view = sidecar_view(&reading, &interpolated);
    let restarts_proxy = view.restarts_proxy;
    // AcmeStoreNotShared says more about that backend than ConfigInvalid.
    let skip = not_shared
        .as_ref()
        .map(|(block, _)| format!("{block}.storage_backend"));
    let problems = blocking_problems(proxy, &reading, view, skip.as_deref());
    if !problems.is_empty() {
        return Err(invalid(problems));
    }
    if let Some((block, backend)) = not_shared {
        return Err(Refusal::new(
            RefusalReason::AcmeStoreNotShared,
            acme_store_not_shared_message(proxy.spec.replicas, &block, &backend),
        ));
    }
    Ok(ConfigFacts {
        restarts_proxy,
        https_port: reading.proxy_port("https_bind_port"),
        http_port: reading.proxy_port("http_bind_port"),
    })
}

/// A config text as the checks read it.
struct Reading<'p> {
    /// The sidecar's environment, as far as it is known ([`known_env`]).
    env: BTreeMap<&'p str, String>,
    /// The text as written, to tell which values depend on unknown
    /// variables. It may fail to parse where the interpolated text does
    /// not; then nothing is excused.
    raw: Option<Yaml>,
    /// The interpolated text, its merge keys applied.
    tree: Option<Yaml>,
}

impl Reading<'_> {
    fn is_known(&self, var: &str) -> bool {
        self.env.contains_key(var)
    }

    /// A sidecar port: its environment, then the file, then its default.
    fn sidecar_port(&self, var: &str, from_file: Option<u16>, default: u16) -> u16 {
        self.env
            .get(var)
            .and_then(|v| v.trim().parse::<u16>().ok())
            .or(from_file)
            .unwrap_or(default)
    }

    /// `proxy.<key>` as a port, when the config sets one other than 0.
    fn proxy_port(&self, key: &str) -> Option<i32> {
        self.tree
            .as_ref()
            .and_then(|t| yaml_at(t, &["proxy", key]))
            .and_then(scalar_text)
            .and_then(|p| p.trim().parse::<u16>().ok())
            .filter(|p| *p != 0)
            .map(i32::from)
    }

    /// A clash with the sidecar's port written with a variable the operator
    /// cannot know (and not set by spec.clustering): left to the sidecar.
    fn sidecar_port_unknown(&self, path: &str) -> bool {
        [
            ("gossip_port", flags::GOSSIP_PORT.env),
            ("transport_port", flags::TRANSPORT_PORT.env),
        ]
        .iter()
        .any(|(key, var)| {
            path == format!("proxy.cluster.{key}")
                && !self.is_known(var)
                && value_depends_on_unknown(
                    self.raw.as_ref(),
                    &format!("proxy.extensions.sbmesh.{key}"),
                    &|v| self.is_known(v),
                )
        })
    }
}

/// AcmeStoreNotShared: either ACME block, enabled, on a store local to one
/// pod, with more than one replica, as (the block's path, the backend). A
/// backend that depends on a variable the operator cannot know is left to
/// the sidecar.
fn acme_store_not_shared(proxy: &SBProxy, reading: &Reading) -> Option<(String, String)> {
    ACME_BLOCKS.iter().find_map(|block| {
        let acme = reading.tree.as_ref().and_then(|t| yaml_at(t, block))?;
        let enabled = acme.get("enabled").and_then(Yaml::as_bool) == Some(true);
        let backend = acme
            .get("storage_backend")
            .and_then(scalar_text)
            .map(|b| b.trim().to_owned())
            .filter(|b| !b.is_empty())
            .unwrap_or_else(|| "redb".to_owned());
        let mut raw_path = block.to_vec();
        raw_path.push("storage_backend");
        let backend_unknown = reading
            .raw
            .as_ref()
            .and_then(|r| yaml_at(r, &raw_path))
            .is_some_and(|v| mentions_unknown(v, &|var| reading.is_known(var)));
        let local = matches!(backend.as_str(), "redb" | "memory" | "sqlite");
        (proxy.spec.replicas > 1 && enabled && local && !backend_unknown)
            .then(|| (block.join("."), backend))
    })
}

/// What the sidecar makes of a config: the problems of parsing it, the
/// conflicts of a parsed file with the sidecar's ports, apart (a conflict
/// is about the value at its path: a port left to its default clashes
/// whatever else the block holds, so only that value can excuse it), and
/// whether it restarts the proxy.
struct SidecarView {
    problems: Vec<Problem>,
    conflicts: Vec<Problem>,
    restarts_proxy: bool,
}

fn sidecar_view(reading: &Reading, interpolated: &Interpolated) -> SidecarView {
    let config = match sbmesh::config::parse_interpolated(interpolated) {
        Ok(config) => config,
        Err(problems) => {
            return SidecarView {
                problems,
                conflicts: Vec::new(),
                restarts_proxy: false,
            };
        }
    };
    let sbmesh = config.sbmesh();
    // The sidecar's precedence: its environment, then the file.
    let apply = reading
        .env
        .get(flags::PROXY_CERT_APPLY.env)
        .and_then(|v| sbmesh::config::CertApply::from_name(v.trim()))
        .or_else(|| sbmesh.acme.as_ref().and_then(|a| a.apply));
    let ports = sbmesh::config::SidecarPorts {
        gossip: reading.sidecar_port(
            flags::GOSSIP_PORT.env,
            sbmesh.gossip_port,
            sbmesh::config::DEFAULT_GOSSIP_PORT,
        ),
        transport: reading.sidecar_port(
            flags::TRANSPORT_PORT.env,
            sbmesh.transport_port,
            sbmesh::config::DEFAULT_TRANSPORT_PORT,
        ),
    };
    SidecarView {
        problems: Vec::new(),
        conflicts: sbmesh::config::conflicts(&config, ports),
        restarts_proxy: apply == Some(sbmesh::config::CertApply::Restart),
    }
}

/// The errors that refuse the config (ConfigInvalid), one line each: the
/// sidecar's and [`admin_port_problem`], but for the one at `skip` and those
/// about a value the operator cannot know (left to the sidecar).
fn blocking_problems(
    proxy: &SBProxy,
    reading: &Reading,
    view: SidecarView,
    skip: Option<&str>,
) -> Vec<String> {
    let raw = reading.raw.as_ref();
    let is_known = |var: &str| reading.is_known(var);
    let mut problems = view.problems;
    problems.extend(admin_port_problem(proxy, reading.tree.as_ref()));
    problems
        .into_iter()
        .filter(Problem::is_error)
        .filter(|p| Some(p.path.as_str()) != skip)
        .filter(|p| !depends_on_unknown(raw, &p.path, &is_known))
        .chain(
            view.conflicts
                .into_iter()
                .filter(Problem::is_error)
                .filter(|p| !value_depends_on_unknown(raw, &p.path, &is_known))
                .filter(|p| !reading.sidecar_port_unknown(&p.path)),
        )
        .map(|p| p.to_string())
        .collect()
}

/// The sidecar POSTs reloads to `spec.adminPort`: a config whose
/// `proxy.admin.port` says otherwise would never be reloaded.
fn admin_port_problem(proxy: &SBProxy, tree: Option<&Yaml>) -> Option<Problem> {
    let port = tree.and_then(|t| yaml_at(t, &["proxy", "admin", "port"]))?;
    let port = scalar_text(port)?;
    let port: i64 = port.trim().parse().ok()?;
    (port != i64::from(proxy.spec.admin_port)).then(|| {
        Problem::error(
            "proxy.admin.port",
            format!(
                "is {port} but spec.adminPort of the SBProxy is {}; the sidecar POSTs reloads to \
                 spec.adminPort, so make the two equal",
                proxy.spec.admin_port
            ),
        )
    })
}

fn yaml_at<'a>(value: &'a Yaml, keys: &[&str]) -> Option<&'a Yaml> {
    keys.iter().try_fold(value, |v, key| v.get(*key))
}

fn scalar_text(value: &Yaml) -> Option<String> {
    match value {
        Yaml::String(s) => Some(s.clone()),
        Yaml::Number(n) => Some(n.to_string()),
        Yaml::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Whether the problem at `path` (as sbmesh writes paths:
/// `proxy.extensions.sbmesh.seeds[1]`, `origins."a.example.com"`) concerns
/// a value written with a `${VAR}` the operator cannot know. When the path
/// does not exist as written, its nearest existing ancestor is looked at
/// (conflicts use [`value_depends_on_unknown`] instead).
fn depends_on_unknown(raw: Option<&Yaml>, path: &str, is_known: &dyn Fn(&str) -> bool) -> bool {
    walk(raw, path).is_some_and(|(node, _)| mentions_unknown(node, is_known))
}

/// Whether the value at exactly `path` exists as written and references a
/// variable the operator cannot know (no ancestor is looked at).
fn value_depends_on_unknown(
    raw: Option<&Yaml>,
    path: &str,
    is_known: &dyn Fn(&str) -> bool,
) -> bool {
    walk(raw, path).is_some_and(|(node, exact)| exact && mentions_unknown(node, is_known))
}

/// The node at `path` in `raw`, or its nearest existing ancestor, and
/// whether it is the node itself. `None` for locations that are not YAML
/// paths.
fn walk<'y>(raw: Option<&'y Yaml>, path: &str) -> Option<(&'y Yaml, bool)> {
    let (mut node, segments) = (raw?, path_segments(path)?);
    for segment in &segments {
        let next = match segment {
            Segment::Key(key) => node.get(key.as_str()),
            Segment::Index(i) => node.get(*i),
        };
        match next {
            Some(next) => node = next,
            None => return Some((node, false)),
        }
    }
    Some((node, true))
}

enum Segment {
    Key(String),
    Index(usize),
}

/// Splits a problem path into keys and indexes; `None` for the locations
/// that are not YAML paths (`line 2, column 5`, `(yaml)`, `(root)`).
fn path_segments(path: &str) -> Option<Vec<Segment>> {
    if path.starts_with('(') || path.starts_with("line ") {
        return None;
    }
    let mut segments = Vec::new();
    let mut chars = path.chars().peekable();
    while chars.peek().is_some() {
        match chars.peek() {
            Some('.') => {
                chars.next();
            }
            Some('"') => {
                chars.next();
                let mut key = String::new();
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => key.extend(chars.next()),
                        '"' => break,
                        c => key.push(c),
                    }
                }
                segments.push(Segment::Key(key));
            }
            Some('[') => {
                chars.next();
                let digits: String = chars.by_ref().take_while(|c| *c != ']').collect();
                segments.push(Segment::Index(digits.parse().ok()?));
            }
            _ => {
                let mut key = String::new();
                while let Some(&c) = chars.peek() {
                    if c == '.' || c == '[' {
                        break;
                    }
                    key.push(c);
                    chars.next();
                }
                segments.push(Segment::Key(key));
            }
        }
    }
    Some(segments)
}

/// Whether any key or scalar under `value` references an unknown variable.
fn mentions_unknown(value: &Yaml, is_known: &dyn Fn(&str) -> bool) -> bool {
    match value {
        Yaml::String(s) => references(s).any(|var| !is_known(var)),
        Yaml::Sequence(items) => items.iter().any(|v| mentions_unknown(v, is_known)),
        Yaml::Mapping(map) => map
            .iter()
            .any(|(k, v)| mentions_unknown(k, is_known) || mentions_unknown(v, is_known)),
        Yaml::Tagged(tagged) => mentions_unknown(&tagged.value, is_known),
        _ => false,
    }
}

/// The variable names of the `${NAME...}` references in `text`, skipping
/// `$${` escapes (nested defaults included).
fn references(text: &str) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    (0..bytes.len()).filter_map(move |i| {
        let opens = bytes[i] == b'$' && bytes.get(i + 1) == Some(&b'{');
        let escaped = i > 0 && bytes[i - 1] == b'$';
        if !opens || escaped {
            return None;
        }
        let rest = &text[i + 2..];
        let len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        Some(&rest[..len])
    })
}

// ---------------------------------------------------------------------------
// The `render` command.

/// The `render` command: reads SBProxy and SBProxyConfig documents from every
/// `-f` file and prints, for each SBProxy, exactly the objects `run` would
/// apply (a cluster-key Secret with a freshly generated key). A refusal is
/// printed on stderr and the exit status is 1.
pub fn command(args: &crate::cli::RenderArgs) -> anyhow::Result<ExitCode> {
    let mut proxies = Vec::new();
    let mut configs = Vec::new();
    let mut skipped = Vec::new();
    for file in &args.files {
        let text = read_input(file)?;
        for (index, doc) in yaml_documents(&text)
            .with_context(|| format!("{}: not a YAML stream", file.display()))?
            .into_iter()
            .enumerate()
        {
            let at = format!("{} (document {})", file.display(), index + 1);
            let Some(kind) = doc.get("kind").and_then(Value::as_str) else {
                anyhow::bail!(
                    "{at}: a document without a kind; render reads SBProxy and SBProxyConfig ({})",
                    crd::API_VERSION
                );
            };
            // Other kinds of a `kubectl apply -f` bundle (the admin Secret,
            // a Certificate) are the user's to apply: skipped.
            if kind != "SBProxy" && kind != "SBProxyConfig" {
                let name = doc
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or("(no name)");
                skipped.push(format!("{kind} {name} ({at})"));
                continue;
            }
            if let Err(problems) = crd::validate(&doc) {
                anyhow::bail!("{at}: the {kind} is not valid:\n{}", problems.join("\n"));
            }
            if kind == "SBProxy" {
                let mut proxy: SBProxy =
                    serde_json::from_value(doc).with_context(|| format!("{at}: not an SBProxy"))?;
                proxy
                    .metadata
                    .namespace
                    .get_or_insert_with(|| "default".to_string());
                proxies.push((at, proxy));
            } else {
                let mut config: SBProxyConfig = serde_json::from_value(doc)
                    .with_context(|| format!("{at}: not an SBProxyConfig"))?;
                config
                    .metadata
                    .namespace
                    .get_or_insert_with(|| "default".to_string());
                configs.push(config);
            }
        }
    }
    if !skipped.is_empty() {
        eprintln!(
            "note: skipped {} document(s) of other kinds, which render does not read (it renders SBProxy and SBProxyConfig; apply the rest yourself): {}",
            skipped.len(),
            skipped.join(", ")
        );
    }
    if proxies.is_empty() {
        anyhow::bail!("no SBProxy document in the files given; nothing to render");
    }

    let mut out = String::new();
    let mut refused = false;
    for (at, proxy) in &proxies {
        if proxy
            .metadata
            .name
            .as_deref()
            .unwrap_or_default()
            .is_empty()
        {
            anyhow::bail!("{at}: the SBProxy has no metadata.name");
        }
        let config = configs.iter().find(|c| {
            c.metadata
                .name
                .as_deref()
                .is_some_and(|n| proxy.spec.config_ref.name() == Ok(n))
                && c.metadata.namespace == proxy.metadata.namespace
        });
        let opts = RenderOptions {
            sidecar_image: args.sidecar_image.clone(),
            fresh_cluster_key: fresh_cluster_key(),
        };
        match render(proxy, config, None, &opts) {
            Ok(rendered) => out.push_str(&rendered.objects_yaml()),
            Err(refusal) => {
                eprintln!(
                    "SBProxy {}/{} refused ({}): {}",
                    proxy.namespace().unwrap_or_default(),
                    proxy.name_any(),
                    refusal.reason.as_str(),
                    refusal.message
                );
                refused = true;
            }
        }
    }
    if refused {
        return Ok(ExitCode::FAILURE);
    }
    crate::cli::print_out(&out)
}

/// The text of `path`, or of stdin for `-`.
pub(crate) fn read_input(path: &Path) -> anyhow::Result<String> {
    if path.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("cannot read stdin")?;
        Ok(text)
    } else {
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
    }
}

/// The documents of a YAML stream, as JSON; empty documents are skipped.
pub(crate) fn yaml_documents(text: &str) -> anyhow::Result<Vec<Value>> {
    use serde::Deserialize as _;
    let mut docs = Vec::new();
    for (index, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(doc)
            .with_context(|| format!("document {}: not valid YAML", index + 1))?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}
