//! The sidecar's container (shared by `render`, `inject` and the webhook)
//! and the volumes, probes and environment it is made of.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    HTTPGetAction, KeyToPath, ObjectFieldSelector, Probe, ResourceRequirements, SecretKeySelector,
    SecretVolumeSource, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sbmesh::Flag;

use super::{
    CLUSTER_KEY_DIR, CLUSTER_KEY_KEY, CLUSTER_KEY_VOLUME, CONFIG_DIR, CONFIG_KEY, DATA_DIR,
    NONROOT_UID, SIDECAR_ADMIN_PORT, SIDECAR_COMMAND, SIDECAR_CONTAINER,
};

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
    /// (`SBMESH_ACME_CHECK_URL`, [`acme_check_url`](super::acme_check_url)); `None`: the sidecar
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
        field_env(Flag::POD_NAME.env, "metadata.name"),
        field_env(Flag::POD_IP.env, "status.podIP"),
        field_env(Flag::NAMESPACE.env, "metadata.namespace"),
        value_env(Flag::CLUSTER_ID.env, &s.cluster_id),
        value_env(Flag::CONFIG.env, &format!("{CONFIG_DIR}/{CONFIG_KEY}")),
        value_env(Flag::ADMIN_LISTEN.env, &format!("0.0.0.0:{}", s.admin_port)),
        value_env(
            Flag::CHALLENGE_LISTEN.env,
            &format!("0.0.0.0:{}", s.challenge_port),
        ),
        value_env(Flag::CERT_DIR.env, &format!("{DATA_DIR}/certs")),
        value_env(Flag::STATE_DIR.env, &format!("{DATA_DIR}/sidecar")),
    ];
    if let Some(port) = s.proxy_admin_port {
        env.push(value_env(
            Flag::PROXY_RELOAD_URL.env,
            &format!("http://127.0.0.1:{port}/admin/reload"),
        ));
    }
    if let Some(port) = s.proxy_http_port {
        env.push(value_env(
            Flag::CHALLENGE_PASSTHROUGH.env,
            &challenge_passthrough_url(port),
        ));
    }
    if let Some(url) = &s.acme_check_url {
        env.push(value_env(Flag::ACME_CHECK_URL.env, url));
    }
    let mut ports = vec![
        container_port(SIDECAR_ADMIN_PORT, s.admin_port, "TCP"),
        container_port("acme", s.challenge_port, "TCP"),
    ];
    if let Some(mesh) = &s.mesh {
        env.extend([
            value_env(Flag::MESH_SERVICE.env, &mesh.service),
            value_env(Flag::CLUSTER_DOMAIN.env, &mesh.cluster_domain),
            value_env(Flag::GOSSIP_PORT.env, &mesh.gossip_port.to_string()),
            value_env(Flag::TRANSPORT_PORT.env, &mesh.transport_port.to_string()),
        ]);
        ports.push(container_port("gossip", mesh.gossip_port, "UDP"));
        ports.push(container_port("transport", mesh.transport_port, "TCP"));
    }
    if s.cluster_key.is_some() {
        env.push(value_env(Flag::CLUSTER_KEY_FILE.env, &cluster_key_file()));
    }
    if let Some((secret, key)) = &s.authorization {
        env.push(secret_env(Flag::PROXY_AUTHORIZATION.env, secret, key));
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

pub(super) fn container_port(name: &str, port: i32, protocol: &str) -> ContainerPort {
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

pub(super) fn readiness_probe(path: &str, port: &str) -> Probe {
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

pub(super) fn mount(volume: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: volume.to_string(),
        mount_path: path.to_string(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

pub(super) fn value_env(name: &str, value: &str) -> EnvVar {
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
