//! The custom resources: `SBProxy` (a fleet of sbproxy pods carrying the
//! sidecar) and `SBProxyConfig` (the `sb.yml` they read). Group
//! `sbproxy.dev`, version `v1alpha1`, both namespaced (docs/reference.md#custom-resources).
//!
//! The CRDs are generated from these types, so the schema the apiserver
//! enforces (defaults, ranges, CEL rules) and the structs the controller
//! reads cannot drift apart. [`validate`] runs the same checks locally (the
//! `render` command and the tests use it; no apiserver needed).

use std::process::ExitCode;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, EnvVar, LocalObjectReference, PodSecurityContext, ResourceRequirements, Toleration,
    TopologySpreadConstraint, Volume, VolumeMount,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// API group of both resources.
pub const GROUP: &str = "sbproxy.dev";
/// API version of both resources.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of both resources.
pub const API_VERSION: &str = "sbproxy.dev/v1alpha1";
/// Largest `spec.replicas` accepted.
pub const MAX_REPLICAS: i32 = 128;
/// Largest `SBProxyConfig.spec.config`, in bytes (a ConfigMap holds at most 1 MiB).
pub const MAX_CONFIG_BYTES: usize = 1024 * 1024;

/// The message of the rule that keeps the TCP ports of one pod apart.
pub const DISTINCT_PORTS_MESSAGE: &str = "the TCP ports of one pod must be distinct: port, adminPort, \
     sidecar.adminPort, sidecar.challengePort and clustering.transportPort";

// Each pair once: CEL has no set type in every apiserver version, and ten
// comparisons cost less than a list-building macro in the cost estimate.
const DISTINCT_PORTS_RULE: &str = "self.port != self.adminPort \
     && self.port != self.sidecar.adminPort \
     && self.port != self.sidecar.challengePort \
     && self.port != self.clustering.transportPort \
     && self.adminPort != self.sidecar.adminPort \
     && self.adminPort != self.sidecar.challengePort \
     && self.adminPort != self.clustering.transportPort \
     && self.sidecar.adminPort != self.sidecar.challengePort \
     && self.sidecar.adminPort != self.clustering.transportPort \
     && self.sidecar.challengePort != self.clustering.transportPort";

/// A fleet of sbproxy pods, each carrying the sbmesh sidecar: the operator
/// turns it into a StatefulSet, its Services, ConfigMap, cluster-key Secret
/// and PodDisruptionBudget, and when asked a NetworkPolicy and a PodMonitor.
// `printcolumn(type_ = ...)` repeats by design, one per column.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "sbproxy.dev",
    version = "v1alpha1",
    kind = "SBProxy",
    plural = "sbproxies",
    shortname = "sbp",
    namespaced,
    status = "SBProxyStatus",
    derive = "PartialEq",
    doc = "A fleet of sbproxy pods carrying the sbmesh sidecar (mesh, ACME, hot reload).",
    printcolumn(name = "Replicas", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
    printcolumn(
        name = "Config hash",
        type_ = "string",
        json_path = ".status.configHash"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    cel
)]
#[x_kube(validation = Rule::new(DISTINCT_PORTS_RULE).message(DISTINCT_PORTS_MESSAGE))]
#[serde(rename_all = "camelCase")]
pub struct SBProxySpec {
    /// The sbproxy image.
    #[schemars(length(min = 1))]
    pub image: String,
    /// The SBProxyConfig (in this namespace) whose `spec.config` is the
    /// sb.yml, by name: `configRef: demo-config`. The first form,
    /// `{name: demo-config}`, is read too.
    pub config_ref: ConfigRef,
    /// Number of pods, 1 to 128.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 1, max = 128))]
    pub replicas: i32,
    /// The proxy's HTTP port (the `http` port of the `<name>-svc` Service).
    #[serde(default = "default_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// The proxy's admin port: where the sidecar POSTs `/admin/reload`.
    #[serde(default = "default_admin_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub admin_port: i32,
    /// Resources of the proxy container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// A Secret key holding the full `Authorization` header value for the
    /// reload POST (handed to the sidecar as `SBMESH_PROXY_AUTHORIZATION`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_auth_secret_ref: Option<SecretKeyRef>,
    /// The gossip mesh between the pods.
    #[serde(default)]
    pub clustering: Clustering,
    /// The sbmesh sidecar container.
    #[serde(default)]
    pub sidecar: SidecarSpec,
    /// What real clusters need in the pods beyond the operator's own:
    /// scheduling, identity, extra volumes, mounts and environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_template: Option<PodTemplate>,
    /// Render a NetworkPolicy `<name>-mesh`: the mesh ports admit only pods
    /// of this SBProxy; the proxy's ports, the challenge port and the
    /// sidecar's admin port (for Prometheus) admit anyone.
    #[serde(default)]
    pub network_policy: bool,
    /// Render a prometheus-operator PodMonitor `<name>` scraping the
    /// sidecar's `/metrics`. Only when asked: its CRD may not exist.
    #[serde(default)]
    pub pod_monitor: bool,
}

/// `spec.podTemplate`: each field optional, copied into the StatefulSet's
/// pod template. What would undo the operator's own settings (its labels,
/// volumes, mount paths, environment) is refused (`PodTemplateInvalid`),
/// naming the field to change instead.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodTemplate {
    /// Pod labels, added to the operator's `app.kubernetes.io/name`,
    /// `instance` and `managed-by` (which cannot be changed: they select
    /// the pods).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Pod annotations.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Pod `nodeSelector`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Pod `tolerations`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Pod `affinity`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// Pod `topologySpreadConstraints`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub topology_spread_constraints: Vec<TopologySpreadConstraint>,
    /// Pod `priorityClassName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub priority_class_name: Option<String>,
    /// Pod `serviceAccountName` (default: the namespace's `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub service_account_name: Option<String>,
    /// Pod `imagePullSecrets`, for both images.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// The pod's security context, merged over the operator's field by
    /// field: a field set here wins, the operator's other fields stay
    /// (`runAsNonRoot`, `runAsUser`/`runAsGroup`/`fsGroup` 65532,
    /// `seccompProfile: RuntimeDefault`). The sidecar keeps its own
    /// container security context; the proxy runs as the pod's user, and
    /// reads the certificate keys the sidecar writes (mode 0600, uid 65532)
    /// only as that same user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_context: Option<PodSecurityContext>,
    /// Pod `terminationGracePeriodSeconds` (Kubernetes' default: 30). Keep
    /// it above the sidecar's drain budget (`SBPROXY_SHUTDOWN_GRACE_MS`,
    /// 30 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub termination_grace_period_seconds: Option<i64>,
    /// Extra pod volumes (a cert-manager `kubernetes.io/tls` Secret, …),
    /// named apart from the operator's (`sbproxy-config`, `sbproxy-data`,
    /// `sbmesh-cluster-key`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<Volume>,
    /// Extra mounts of the proxy container, outside the operator's mount
    /// paths (`/etc/sbproxy`, `/var/lib/sbproxy`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proxy_volume_mounts: Vec<VolumeMount>,
    /// Extra mounts of the sidecar container, outside the operator's mount
    /// paths (`/etc/sbproxy`, `/var/lib/sbproxy`, `/etc/sbmesh/cluster-key`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sidecar_volume_mounts: Vec<VolumeMount>,
    /// Extra environment of the proxy container (not the variables the
    /// operator sets there).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proxy_env: Vec<EnvVar>,
    /// Extra environment of the sidecar container (`SBMESH_WATCH_TLS`, …;
    /// not the variables the operator sets there, which come from other
    /// spec fields).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sidecar_env: Vec<EnvVar>,
}

/// `spec.configRef`: the SBProxyConfig's name as a string
/// (`configRef: demo-config`), as sbproxy's own CRD has it, or this
/// project's first form, `{name: demo-config}`, which objects already
/// written keep.
///
/// A structural schema cannot say "string or object": every node needs one
/// type, except one with `x-kubernetes-preserve-unknown-fields`, and a CEL
/// rule cannot see into a node without a type (the apiserver would refuse
/// the CRD when it compiles the rule). A second CRD version with a
/// conversion webhook would need a served webhook and its certificate for a
/// field rename. So the field is kept as written and read here: both forms
/// work, and anything else is refused at reconcile (`ConfigNotFound`, with
/// [`ConfigRef::name`]'s message) instead of failing to decode, which
/// would hide the object from the controller.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(transparent)]
pub struct ConfigRef(pub Value);

impl ConfigRef {
    /// The string form.
    pub fn named(name: &str) -> Self {
        Self(Value::String(name.to_string()))
    }

    /// The SBProxyConfig's name, or what is wrong and what is accepted.
    pub fn name(&self) -> Result<&str, String> {
        match &self.0 {
            Value::String(s) if !s.is_empty() => return Ok(s),
            Value::Object(m) if m.len() == 1 => {
                if let Some(Value::String(s)) = m.get("name")
                    && !s.is_empty()
                {
                    return Ok(s);
                }
            }
            _ => {}
        }
        Err(format!(
            "spec.configRef is {}; it must name an SBProxyConfig in this namespace, \
             as a string (configRef: demo-config) or in the first form (configRef: {{name: demo-config}})",
            self.0
        ))
    }
}

impl schemars::JsonSchema for ConfigRef {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ConfigRef".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Name of an SBProxyConfig in the same namespace: `configRef: demo-config`. The first form, `{name: demo-config}`, is read too.",
            "x-kubernetes-preserve-unknown-fields": true
        })
    }
}

/// `spec.adminAuthSecretRef`: a key of a Secret in the same namespace.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(length(min = 1))]
    pub name: String,
    /// Key in the Secret.
    #[serde(default = "default_authorization_key")]
    #[schemars(length(min = 1))]
    pub key: String,
}

/// `spec.clustering.clusterSecretRef`: a key of a Secret in the same namespace
/// holding the cluster key ring (64 hex chars per key, comma-separated).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ClusterSecretRef {
    /// Name of the Secret.
    #[schemars(length(min = 1))]
    pub name: String,
    /// Key in the Secret.
    #[serde(default = "default_cluster_key_key")]
    #[schemars(length(min = 1))]
    pub key: String,
}

/// `spec.clustering`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Clustering {
    /// Form a gossip mesh between the pods (seeds from the `<name>-mesh`
    /// headless Service, sealed with the cluster key).
    #[serde(default)]
    pub enabled: bool,
    /// Gossip port (UDP).
    #[serde(default = "default_gossip_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub gossip_port: i32,
    /// Transport port (TCP).
    #[serde(default = "default_transport_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub transport_port: i32,
    /// The Secret holding the cluster key. Absent: the operator creates
    /// `<name>-cluster-key` once and never overwrites it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_secret_ref: Option<ClusterSecretRef>,
    /// The cluster's DNS domain (for the headless Service's records).
    #[serde(default = "default_cluster_domain")]
    #[schemars(length(min = 1))]
    pub cluster_domain: String,
    /// During a cluster-key rotation (annotation
    /// `sbproxy.dev/rotate-cluster-key`), how long the Secret holds
    /// `[new, old]` before the old key is dropped. Keep it well beyond the
    /// kubelet's update of a mounted Secret (about a minute): a pod still
    /// on the old file when the old key goes cannot talk to the others.
    #[serde(default = "default_key_rotation_grace_seconds")]
    #[schemars(range(min = 1, max = 86400))]
    pub key_rotation_grace_seconds: i64,
}

impl Default for Clustering {
    fn default() -> Self {
        Clustering {
            enabled: false,
            gossip_port: default_gossip_port(),
            transport_port: default_transport_port(),
            cluster_secret_ref: None,
            cluster_domain: default_cluster_domain(),
            key_rotation_grace_seconds: default_key_rotation_grace_seconds(),
        }
    }
}

/// `spec.sidecar`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SidecarSpec {
    /// The sidecar image (default: the operator's own image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    pub image: Option<String>,
    /// Resources of the sidecar container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// The sidecar's admin port (`/healthz`, `/readyz`, `/metrics`, `/admin/*`).
    #[serde(default = "default_sidecar_admin_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub admin_port: i32,
    /// The sidecar's ACME HTTP-01 responder (the `acme` port 80 of `<name>-svc`).
    #[serde(default = "default_challenge_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub challenge_port: i32,
}

impl Default for SidecarSpec {
    fn default() -> Self {
        SidecarSpec {
            image: None,
            resources: None,
            admin_port: default_sidecar_admin_port(),
            challenge_port: default_challenge_port(),
        }
    }
}

/// What the operator last did with an SBProxy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SBProxyStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `sha256:<hex>` of the applied `spec.config` text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_hash: Option<String>,
    /// Pods of the StatefulSet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Ready pods of the StatefulSet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    /// The message of the last refusal; absent when the spec is applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// `Ready` and `Degraded`.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The cluster key of a Secret the operator made (absent with
    /// `clusterSecretRef` or without clustering).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_key: Option<ClusterKeyStatus>,
}

/// `status.clusterKey`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct ClusterKeyStatus {
    /// The primary key, as each node's `key_id` in `/admin/cluster/status`
    /// shows it: the first 8 hex characters of its SHA-256.
    pub key_id: String,
    /// `Stable`, or `Rotating` while the Secret holds `[new, old]`.
    pub phase: String,
    /// When the primary key became primary (the last rotation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotated_at: Option<String>,
}

/// The `sb.yml` an SBProxy reads, as text.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[kube(
    group = "sbproxy.dev",
    version = "v1alpha1",
    kind = "SBProxyConfig",
    plural = "sbproxyconfigs",
    shortname = "sbpc",
    namespaced,
    derive = "PartialEq",
    doc = "The sb.yml of an SBProxy, as text; an edit reaches the pods without a restart.",
    cel
)]
pub struct SBProxyConfigSpec {
    /// The sb.yml text (at most 1 MiB).
    #[schemars(length(max = 1_048_576))]
    pub config: String,
}

fn default_replicas() -> i32 {
    1
}
fn default_port() -> i32 {
    8080
}
// The sidecar's and the proxy's own defaults, read from where sbmesh
// defines them (its flag table and config), so a pod the operator renders
// and a sidecar started by hand agree.
fn default_admin_port() -> i32 {
    i32::from(sbmesh::DEFAULT_PROXY_ADMIN_PORT)
}
pub(crate) fn default_gossip_port() -> i32 {
    i32::from(sbmesh::DEFAULT_GOSSIP_PORT)
}
pub(crate) fn default_transport_port() -> i32 {
    i32::from(sbmesh::DEFAULT_TRANSPORT_PORT)
}
pub(crate) fn default_cluster_domain() -> String {
    sbmesh::DEFAULT_CLUSTER_DOMAIN.to_string()
}
pub(crate) fn default_sidecar_admin_port() -> i32 {
    i32::from(sbmesh::DEFAULT_ADMIN_LISTEN.port())
}
pub(crate) fn default_challenge_port() -> i32 {
    i32::from(sbmesh::DEFAULT_CHALLENGE_LISTEN.port())
}
fn default_key_rotation_grace_seconds() -> i64 {
    300
}
fn default_authorization_key() -> String {
    "authorization".to_string()
}
fn default_cluster_key_key() -> String {
    "cluster-key".to_string()
}

/// Both CustomResourceDefinitions: SBProxy, then SBProxyConfig.
pub fn crds() -> Vec<CustomResourceDefinition> {
    vec![SBProxy::crd(), SBProxyConfig::crd()]
}

/// [`crds`] as a YAML stream (`---` between documents): what `crds` prints
/// and what `deploy/crds.yaml` holds.
pub fn crds_yaml() -> String {
    let docs: Vec<Value> = crds()
        .iter()
        .map(|crd| serde_json::to_value(crd).unwrap_or(Value::Null))
        .collect();
    yaml_stream(&docs)
}

/// Serialises `docs` as one YAML stream, each document after a `---` line.
/// Shared by every command that prints objects.
pub fn yaml_stream(docs: &[Value]) -> String {
    let mut out = String::new();
    for doc in docs {
        out.push_str("---\n");
        // A serde_json::Value always serialises (string keys, finite numbers).
        out.push_str(&serde_norway::to_string(doc).unwrap_or_default());
    }
    out
}

/// The `crds` command: prints [`crds_yaml`].
pub fn command() -> anyhow::Result<ExitCode> {
    crate::cli::print_out(&crds_yaml())
}

/// Checks an SBProxy or SBProxyConfig object (as JSON) the way the
/// apiserver would: the generated openAPIV3Schema (types, required fields,
/// ranges, lengths, no unknown fields, as `kubectl apply` with strict field
/// validation), then the CEL rules on the defaulted object.
///
/// Returns every problem as `<json.path>: <message>`. An object of another
/// kind is one problem naming the kinds accepted.
pub fn validate(object: &Value) -> Result<(), Vec<String>> {
    let kind = object.get("kind").and_then(Value::as_str).unwrap_or("");
    let crd = match kind {
        "SBProxy" => SBProxy::crd(),
        "SBProxyConfig" => SBProxyConfig::crd(),
        other => {
            return Err(vec![format!(
                "kind: {other:?} is not a kind of this operator; expected SBProxy or SBProxyConfig"
            )]);
        }
    };
    let schema = crd
        .spec
        .versions
        .first()
        .and_then(|v| v.schema.as_ref())
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or(Value::Null);

    let object = without_nulls(object);
    let mut json_schema = strict_json_schema(&schema);
    // The apiserver checks these itself; the CRD schema leaves them out.
    if let Some(props) = json_schema
        .get_mut("properties")
        .and_then(Value::as_object_mut)
    {
        props.insert(
            "apiVersion".into(),
            serde_json::json!({"type": "string", "enum": [API_VERSION]}),
        );
        props.insert("kind".into(), serde_json::json!({"type": "string"}));
        props
            .entry("metadata")
            .or_insert_with(|| serde_json::json!({"type": "object"}));
    }
    let validator = jsonschema::draft4::new(&json_schema).map_err(|e| {
        vec![format!(
            "(schema): the generated schema does not compile: {e}"
        )]
    })?;
    let mut problems: Vec<String> = validator
        .iter_errors(&object)
        .map(|e| {
            let path = e.instance_path().to_string();
            let path = if path.is_empty() {
                "(root)".to_string()
            } else {
                path.trim_start_matches('/').replace('/', ".")
            };
            format!("{path}: {e}")
        })
        .collect();
    if problems.is_empty()
        && let Err(errors) =
            kube::core::cel::Validator::new().validate_with_defaults(&schema, &object, None)
    {
        problems.extend(errors.into_vec().into_iter().map(|e| e.to_string()));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

/// `value` without null object members: the apiserver drops a null the
/// schema does not allow, and treats an absent field as the default.
fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

/// An openAPIV3Schema as a JSON Schema (draft 4, which OpenAPI 3.0 schemas
/// follow) that refuses unknown fields where the apiserver would prune them:
/// `kubectl apply` validates fields strictly by default, so an unknown field
/// is a mistake the user hears about.
fn strict_json_schema(schema: &Value) -> Value {
    match schema {
        Value::Object(map) => {
            let mut out: serde_json::Map<String, Value> = map
                .iter()
                .map(|(k, v)| {
                    // The members of `properties` are field names, not keywords.
                    let v = if k == "properties" {
                        match v {
                            Value::Object(props) => Value::Object(
                                props
                                    .iter()
                                    .map(|(name, s)| (name.clone(), strict_json_schema(s)))
                                    .collect(),
                            ),
                            other => other.clone(),
                        }
                    } else {
                        strict_json_schema(v)
                    };
                    (k.clone(), v)
                })
                .collect();
            let preserves = out
                .get("x-kubernetes-preserve-unknown-fields")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            if out.contains_key("properties")
                && !out.contains_key("additionalProperties")
                && !preserves
            {
                out.insert("additionalProperties".to_string(), Value::Bool(false));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(strict_json_schema).collect()),
        other => other.clone(),
    }
}
