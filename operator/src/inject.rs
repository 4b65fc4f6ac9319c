//! `inject`: adds the sbmesh sidecar to a StatefulSet or Deployment manifest
//! a user already has, with the same container definition `render` gives an
//! SBProxy ([`render::sidecar_container`]).
//!
//! Injecting twice gives the same manifest: a container already named
//! `sbmesh-sidecar` (an older injection, or a hand-written sidecar among
//! the containers) is replaced, in place when it is already an
//! initContainer.
//!
//! When `sb.yml` comes from a ConfigMap volume, the pod template is
//! labelled with the ConfigMap's name ([`CONFIG_MAP_LABEL`]): the operator,
//! when it runs, then tells each such pod of an edit of that ConfigMap at
//! once ([`crate::injected`]).

use std::process::ExitCode;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{PodSpec, PodTemplateSpec, VolumeMount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use serde_json::Value;

use crate::cli::InjectArgs;
use crate::crd;
use crate::injected::CONFIG_MAP_LABEL;
use crate::render::{self, KeySecret, MeshSettings, SidecarSettings};

/// Kinds `inject` accepts.
pub const ACCEPTED_KINDS: &str = "StatefulSet or Deployment (apps/v1)";

/// Why a manifest cannot be injected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InjectError {
    /// Not exactly one document.
    #[error("expected one StatefulSet or Deployment document, found {0} documents")]
    DocumentCount(usize),
    /// Another kind.
    #[error("kind {0:?} cannot be injected; expected a {ACCEPTED_KINDS}")]
    Kind(String),
    /// The document does not deserialise as its kind.
    #[error("not a valid {kind}: {message}")]
    Invalid {
        /// The kind.
        kind: String,
        /// What serde said.
        message: String,
    },
    /// The workload has no pod template spec.
    #[error("the {0} has no spec.template.spec to add the sidecar to")]
    NoPodSpec(String),
    /// No volume holds sb.yml where the sidecar reads it.
    #[error(
        "no container mounts a volume at {dir}: mount the ConfigMap that holds sb.yml there in the \
         proxy container (the sidecar reads {dir}/{key}), then inject again",
        dir = render::CONFIG_DIR,
        key = render::CONFIG_KEY
    )]
    NoConfigMount,
}

/// What `inject` needs besides the manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectOptions {
    /// The sidecar image.
    pub sidecar_image: String,
    /// `SBMESH_CLUSTER_ID`; `None`: the workload's name.
    pub cluster_id: Option<String>,
    /// Headless Service of the mesh seeds; `None`: the sidecar runs alone.
    pub mesh_service: Option<String>,
    /// The Secret whose `cluster-key` is the key ring, with a mesh;
    /// `None`: `<workload>-cluster-key`.
    pub cluster_key_secret: Option<String>,
}

/// Adds the sidecar to `manifest` (one StatefulSet or Deployment, as JSON)
/// and returns the whole manifest.
pub fn inject(manifest: &Value, opts: &InjectOptions) -> Result<Value, InjectError> {
    let kind = manifest
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let invalid = |e: serde_json::Error| InjectError::Invalid {
        kind: kind.to_string(),
        message: e.to_string(),
    };
    match kind {
        "StatefulSet" => {
            let mut sts: StatefulSet = serde_json::from_value(manifest.clone()).map_err(invalid)?;
            let name = sts.name_any();
            let template = sts
                .spec
                .as_mut()
                .map(|s| &mut s.template)
                .ok_or_else(|| InjectError::NoPodSpec(kind.to_string()))?;
            inject_pod(template, kind, &name, opts)?;
            Ok(serde_json::to_value(&sts).unwrap_or(Value::Null))
        }
        "Deployment" => {
            let mut deploy: Deployment =
                serde_json::from_value(manifest.clone()).map_err(invalid)?;
            let name = deploy.name_any();
            let template = deploy
                .spec
                .as_mut()
                .map(|s| &mut s.template)
                .ok_or_else(|| InjectError::NoPodSpec(kind.to_string()))?;
            inject_pod(template, kind, &name, opts)?;
            Ok(serde_json::to_value(&deploy).unwrap_or(Value::Null))
        }
        other => Err(InjectError::Kind(other.to_string())),
    }
}

fn mounted_at<'a>(pod: &'a PodSpec, path: &str) -> Option<&'a VolumeMount> {
    pod.containers
        .iter()
        .filter(|c| c.name != render::SIDECAR_CONTAINER)
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .find(|m| m.mount_path.trim_end_matches('/') == path)
}

/// The longest label value Kubernetes accepts.
const LABEL_VALUE_MAX: usize = 63;

/// Adds the sidecar to one pod template (`kind` names what holds it in the
/// errors; `workload` is the default cluster id and key Secret prefix):
/// what `inject` does to a manifest's template and the webhook
/// ([`crate::admit`]) to a pod.
pub fn inject_pod(
    template: &mut PodTemplateSpec,
    kind: &str,
    workload: &str,
    opts: &InjectOptions,
) -> Result<(), InjectError> {
    let PodTemplateSpec { metadata, spec } = template;
    let pod = spec
        .as_mut()
        .ok_or_else(|| InjectError::NoPodSpec(kind.to_string()))?;
    // The sidecar reads the config the proxy reads: the same volume.
    let config_volume = mounted_at(pod, render::CONFIG_DIR)
        .map(|m| m.name.clone())
        .ok_or(InjectError::NoConfigMount)?;
    let config_map = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == config_volume)
        .and_then(|v| v.config_map.as_ref())
        .map(|c| c.name.clone())
        .filter(|name| !name.is_empty() && name.len() <= LABEL_VALUE_MAX);
    // What the operator's config nudge finds the pods by.
    let labels = metadata
        .get_or_insert_with(ObjectMeta::default)
        .labels
        .get_or_insert_with(Default::default);
    match config_map {
        Some(name) => labels.insert(CONFIG_MAP_LABEL.to_string(), name),
        None => labels.remove(CONFIG_MAP_LABEL),
    };
    // Certificates go where the proxy reads them: a volume already mounted
    // at /var/lib/sbproxy, else a new shared emptyDir in every container.
    let data_volume = match mounted_at(pod, render::DATA_DIR) {
        Some(m) => m.name.clone(),
        None => {
            let volumes = pod.volumes.get_or_insert_with(Vec::new);
            if !volumes.iter().any(|v| v.name == render::DATA_VOLUME) {
                volumes.push(render::data_volume(render::DATA_VOLUME));
            }
            for container in &mut pod.containers {
                let mounts = container.volume_mounts.get_or_insert_with(Vec::new);
                if !mounts
                    .iter()
                    .any(|m| m.mount_path.trim_end_matches('/') == render::DATA_DIR)
                {
                    mounts.push(VolumeMount {
                        name: render::DATA_VOLUME.to_string(),
                        mount_path: render::DATA_DIR.to_string(),
                        ..VolumeMount::default()
                    });
                }
            }
            render::DATA_VOLUME.to_string()
        }
    };

    let mesh = opts.mesh_service.as_ref().map(|service| MeshSettings {
        service: service.clone(),
        cluster_domain: crd::default_cluster_domain(),
        gossip_port: crd::default_gossip_port(),
        transport_port: crd::default_transport_port(),
    });
    let cluster_key = mesh.as_ref().map(|_| KeySecret {
        name: opts
            .cluster_key_secret
            .clone()
            .unwrap_or_else(|| format!("{workload}-cluster-key")),
        key: render::CLUSTER_KEY_KEY.to_string(),
    });
    // The key ring reaches the sidecar as a file (rotation without restarts).
    if let Some(secret) = &cluster_key {
        let volumes = pod.volumes.get_or_insert_with(Vec::new);
        volumes.retain(|v| v.name != render::CLUSTER_KEY_VOLUME);
        volumes.push(render::cluster_key_volume(secret));
    }
    let sidecar = render::sidecar_container(&SidecarSettings {
        image: opts.sidecar_image.clone(),
        cluster_id: opts
            .cluster_id
            .clone()
            .unwrap_or_else(|| workload.to_string()),
        admin_port: crd::default_sidecar_admin_port(),
        challenge_port: crd::default_challenge_port(),
        // Unknown here: the sidecar takes proxy.admin.port from sb.yml.
        proxy_admin_port: None,
        // Off: which port the proxy serves plain HTTP on is not known here
        // (and a guess would turn port 80's 404s into 502s). The header
        // says how to turn it on.
        proxy_http_port: None,
        acme_check_url: None,
        mesh,
        cluster_key,
        authorization: None,
        resources: None,
        config_volume,
        data_volume,
    });

    // A hand-written sidecar among the regular containers gives way to the
    // native one.
    pod.containers
        .retain(|c| c.name != render::SIDECAR_CONTAINER);
    let init = pod.init_containers.get_or_insert_with(Vec::new);
    match init
        .iter_mut()
        .find(|c| c.name == render::SIDECAR_CONTAINER)
    {
        Some(existing) => *existing = sidecar,
        None => init.push(sidecar),
    }
    Ok(())
}

/// The comment printed above the manifest: what else the user must create,
/// and how config edits reach the pods (`config_map`: the ConfigMap the
/// pods are labelled with, if any).
pub fn header(workload: &str, opts: &InjectOptions, config_map: Option<&str>) -> String {
    let mut text = String::from(
        "# The sbmesh sidecar was added by `sbmesh-operator inject` (a native sidecar:\n\
         # an initContainer with restartPolicy: Always).\n\
         # It runs as uid 65532 and writes certificate keys with mode 0600 under\n\
         # /var/lib/sbproxy/certs: run the proxy container as uid 65532 too to read them.\n",
    );
    match &opts.mesh_service {
        Some(service) => text.push_str(&format!(
            "# inject creates no other object. For the mesh, create:\n\
             # - the headless Service {service:?} (clusterIP: None, publishNotReadyAddresses: true,\n\
             #   ports gossip {gossip}/UDP and transport {transport}/TCP, selecting these pods);\n\
             # - the Secret \"{workload}-cluster-key\" with the cluster key:\n\
             #   kubectl create secret generic {workload}-cluster-key --from-literal=cluster-key=\"$(sbmesh-sidecar keygen)\"\n",
            gossip = crd::default_gossip_port(),
            transport = crd::default_transport_port(),
        )),
        None => text.push_str(
            "# No --mesh-service: each pod runs a mesh of one. inject creates no other object.\n",
        ),
    }
    match config_map {
        Some(name) => text.push_str(&format!(
            "# The pods are labelled {CONFIG_MAP_LABEL}: {name}. With sbmesh-operator\n\
             # running (cluster scope, or in this namespace), an edit of that ConfigMap reaches\n\
             # them within about a second; without it, at the kubelet's next sync (up to 90 s).\n"
        )),
        None => text.push_str(
            "# sb.yml is not a configMap volume whose name fits a label (63 characters): an edit\n\
             # reaches the pods at the kubelet's next sync only (up to 90 s).\n",
        ),
    }
    text
}

/// The `inject` command: reads the manifest (`-` for stdin), prints it with
/// the sidecar added, under a comment saying what else to create.
pub fn command(args: &InjectArgs) -> anyhow::Result<ExitCode> {
    let text = render::read_input(&args.file)?;
    let file = args.file.display();
    let docs = render::yaml_documents(&text).map_err(|e| anyhow::anyhow!("{file}: {e:#}"))?;
    let [manifest] = docs.as_slice() else {
        anyhow::bail!("{file}: {}", InjectError::DocumentCount(docs.len()));
    };
    let opts = InjectOptions {
        sidecar_image: args.sidecar_image.clone(),
        cluster_id: args.cluster_id.clone(),
        mesh_service: args.mesh_service.clone(),
        cluster_key_secret: None,
    };
    let injected = inject(manifest, &opts).map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
    let workload = manifest
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let config_map = injected
        .pointer("/spec/template/metadata/labels")
        .and_then(|l| l.get(CONFIG_MAP_LABEL))
        .and_then(Value::as_str);
    crate::cli::print_out(&format!(
        "{}{}",
        header(workload, &opts, config_map),
        crate::crd::yaml_stream(&[injected])
    ))
}
