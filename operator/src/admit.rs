//! The injection webhook's decision, without I/O: an AdmissionReview's
//! bytes in, the AdmissionReview to answer (or why the bytes are not one)
//! out, with what happened for the metric and the log (SPEC section 13,
//! docs/reference.md#sidecar-injection-by-webhook).
//!
//! The API server sends only pods that opted in (the configuration's
//! namespace selector and match conditions, [`crate::webhook`]); the
//! decision checks the opt-out and the pod itself again, so a pod sent by a
//! hand-edited configuration is still decided as the reference says. The
//! container is the one `inject` adds ([`crate::inject::inject_pod`]).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Pod, PodTemplateSpec};
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use serde_json::Value;

use crate::inject::{self, InjectError, InjectOptions};
use crate::render;
pub use crate::telemetry::Injection;

/// Namespace label and pod annotation: `enabled` opts in, on a pod
/// `disabled` opts out.
pub const INJECT: &str = "sbproxy.dev/inject";
/// Pod annotation the webhook sets on a pod it injected: the operator's
/// version.
pub const INJECTED_ANNOTATION: &str = "sbproxy.dev/injected";
/// Pod annotation: `SBMESH_CLUSTER_ID` (default: the workload's name).
pub const CLUSTER_ID_ANNOTATION: &str = "sbproxy.dev/cluster-id";
/// Pod annotation: the headless Service of the mesh (default: no mesh).
pub const MESH_SERVICE_ANNOTATION: &str = "sbproxy.dev/mesh-service";
/// Pod annotation: the Secret whose `cluster-key` is the key ring
/// (default with a mesh: `<workload>-cluster-key`).
pub const CLUSTER_KEY_SECRET_ANNOTATION: &str = "sbproxy.dev/cluster-key-secret";
/// Pod annotation: the sidecar image (default: the operator's
/// `--sidecar-image`).
pub const SIDECAR_IMAGE_ANNOTATION: &str = "sbproxy.dev/sidecar-image";

/// The values of [`INJECT`].
pub const ENABLED: &str = "enabled";
pub const DISABLED: &str = "disabled";

/// What the webhook answers one request with, and what to count and log.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The AdmissionReview to send back.
    pub review: Value,
    /// What happened.
    pub result: Injection,
    /// The pod as `namespace/name` (a pod created from `generateName`
    /// shows it with `*`: its name is not chosen yet).
    pub pod: String,
    /// Why, in a sentence (the log line; the warning a user sees in
    /// `kubectl` for a skipped or unreadable pod).
    pub reason: String,
}

/// Why the request bytes are not an AdmissionReview (answered `400`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "not an AdmissionReview of admission.k8s.io/v1 with a request: {0} \
     (the webhook accepts what a Kubernetes API server sends to a mutating webhook)"
)]
pub struct Malformed(pub String);

/// What the webhook knows besides the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Defaults {
    /// The sidecar image when the pod names none.
    pub sidecar_image: String,
    /// [`INJECTED_ANNOTATION`]'s value.
    pub version: String,
}

/// Decides one AdmissionReview.
pub fn admit(body: &[u8], defaults: &Defaults) -> Result<Decision, Malformed> {
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(|e| Malformed(e.to_string()))?;
    let request: AdmissionRequest<DynamicObject> =
        review.try_into().map_err(|e| Malformed(format!("{e}")))?;
    let pod_name = pod_name(&request);
    let answer = |response: AdmissionResponse, result, reason: String| Decision {
        review: wire(response),
        result,
        pod: pod_name.clone(),
        reason,
    };
    let skip = |reason: String| {
        let response = AdmissionResponse::from(&request);
        answer(response, Injection::skipped, reason)
    };
    if request.operation != Operation::Create
        || request.kind.kind != "Pod"
        || !request.kind.group.is_empty()
    {
        return Ok(skip(format!(
            "not a pod creation ({:?} of {}): nothing to inject",
            request.operation, request.kind.kind
        )));
    }
    let pod: Option<Pod> = request
        .object
        .as_ref()
        .and_then(|o| serde_json::to_value(o).ok())
        .and_then(|v| serde_json::from_value(v).ok());
    let Some(pod) = pod else {
        let reason = "the request's object is not a Pod the webhook can read: admitted without \
                      the sidecar"
            .to_string();
        let mut response = AdmissionResponse::from(&request);
        response.warnings = Some(vec![format!("sbmesh: {reason}")]);
        return Ok(answer(response, Injection::unreadable, reason));
    };
    let asked = match Asked::read(&pod) {
        Ok(asked) => asked,
        Err(message) => {
            let response = AdmissionResponse::from(&request).deny(message.clone());
            return Ok(answer(response, Injection::refused, message));
        }
    };
    if asked.inject == Some(false) {
        return Ok(skip(format!("{INJECT}: {DISABLED}: opted out")));
    }
    if has_sidecar(&pod) {
        return Ok(skip(format!(
            "it has a container named {} already",
            render::SIDECAR_CONTAINER
        )));
    }
    let workload = workload_name(&pod);
    let opts = InjectOptions {
        sidecar_image: asked
            .sidecar_image
            .unwrap_or_else(|| defaults.sidecar_image.clone()),
        cluster_id: asked.cluster_id,
        mesh_service: asked.mesh_service,
        cluster_key_secret: asked.cluster_key_secret,
    };
    let mut template = PodTemplateSpec {
        metadata: Some(pod.metadata.clone()),
        spec: pod.spec.clone(),
    };
    match inject::inject_pod(&mut template, "Pod", &workload, &opts) {
        Ok(()) => {}
        Err(InjectError::NoConfigMount) => {
            let reason = format!(
                "no container mounts a volume at {}: not an sbproxy pod, admitted without the \
                 sidecar",
                render::CONFIG_DIR
            );
            let mut response = AdmissionResponse::from(&request);
            response.warnings = Some(vec![format!("sbmesh: {reason}")]);
            return Ok(answer(response, Injection::skipped, reason));
        }
        Err(e) => return Ok(skip(format!("{e}: admitted without the sidecar"))),
    }
    let patch = injection_patch(&pod, template, &defaults.version);
    let reason = format!(
        "sidecar {} added (cluster id {}, {})",
        opts.sidecar_image,
        opts.cluster_id.as_deref().unwrap_or(&workload),
        match &opts.mesh_service {
            Some(s) => format!("mesh Service {s}"),
            None => "no mesh".to_string(),
        }
    );
    match AdmissionResponse::from(&request).with_patch(patch) {
        Ok(response) => Ok(answer(response, Injection::injected, reason)),
        Err(e) => Ok(skip(format!(
            "the patch did not serialise ({e}): admitted without the sidecar"
        ))),
    }
}

/// Whether the pod has a container (or init container) named as the
/// sidecar already.
fn has_sidecar(pod: &Pod) -> bool {
    pod.spec.as_ref().is_some_and(|s| {
        s.containers
            .iter()
            .chain(s.init_containers.iter().flatten())
            .any(|c| c.name == render::SIDECAR_CONTAINER)
    })
}

/// The JSON patch from `pod` to the pod `inject` made of it (`template`),
/// marked with [`INJECTED_ANNOTATION`] (`version`).
fn injection_patch(pod: &Pod, template: PodTemplateSpec, version: &str) -> json_patch::Patch {
    let before = serde_json::to_value(pod).unwrap_or(Value::Null);
    let mut after = pod.clone();
    let mut meta = template.metadata.unwrap_or_default();
    meta.annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(INJECTED_ANNOTATION.to_string(), version.to_string());
    after.metadata = meta;
    after.spec = template.spec;
    let after = serde_json::to_value(&after).unwrap_or(Value::Null);
    json_patch::diff(&before, &after)
}

/// The AdmissionReview as the API server's own webhooks write it: the
/// patch as base64 (a Go `[]byte`), where serde would write a list of
/// numbers.
fn wire(response: AdmissionResponse) -> Value {
    let patch = response.patch.clone();
    let mut review = serde_json::to_value(response.into_review()).unwrap_or(Value::Null);
    if let (Some(bytes), Some(slot)) = (patch, review.pointer_mut("/response/patch")) {
        *slot = serde_json::to_value(ByteString(bytes)).unwrap_or(Value::Null);
    }
    review
}

/// What a pod's annotations ask for, checked.
#[derive(Debug, Default)]
struct Asked {
    /// [`INJECT`]: `Some(true)` enabled, `Some(false)` disabled.
    inject: Option<bool>,
    sidecar_image: Option<String>,
    cluster_id: Option<String>,
    mesh_service: Option<String>,
    cluster_key_secret: Option<String>,
}

impl Asked {
    /// Reads the annotations; `Err` names the first value not accepted
    /// and what would be.
    fn read(pod: &Pod) -> Result<Asked, String> {
        let empty = BTreeMap::new();
        let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
        let get = |key: &str| annotations.get(key).map(String::as_str);
        let refuse = |key: &str, value: &str, accepted: &str| {
            Err(format!(
                "sbmesh: annotation {key}: {value:?} is not accepted: expected {accepted}"
            ))
        };
        let inject = match get(INJECT) {
            None => None,
            Some(ENABLED) => Some(true),
            Some(DISABLED) => Some(false),
            Some(other) => return refuse(INJECT, other, "\"enabled\" or \"disabled\""),
        };
        let mut asked = Asked {
            inject,
            ..Asked::default()
        };
        if let Some(image) = get(SIDECAR_IMAGE_ANNOTATION) {
            if image.is_empty() || image.chars().any(char::is_whitespace) {
                return refuse(
                    SIDECAR_IMAGE_ANNOTATION,
                    image,
                    "an image reference without spaces, e.g. ghcr.io/sbproxy/sbmesh:1.0.0",
                );
            }
            asked.sidecar_image = Some(image.to_string());
        }
        for (key, slot, max) in [
            (CLUSTER_ID_ANNOTATION, &mut asked.cluster_id, 253),
            (MESH_SERVICE_ANNOTATION, &mut asked.mesh_service, 63),
            (
                CLUSTER_KEY_SECRET_ANNOTATION,
                &mut asked.cluster_key_secret,
                253,
            ),
        ] {
            if let Some(value) = get(key) {
                if !dns_name(value, max) {
                    return refuse(
                        key,
                        value,
                        &format!(
                            "a DNS name of at most {max} characters: lowercase letters, digits, \
                             '-' and '.', starting and ending with a letter or digit"
                        ),
                    );
                }
                *slot = Some(value.to_string());
            }
        }
        if asked
            .mesh_service
            .as_deref()
            .is_some_and(|s| s.contains('.'))
        {
            return refuse(
                MESH_SERVICE_ANNOTATION,
                asked.mesh_service.as_deref().unwrap_or_default(),
                "a Service name of this namespace (no '.')",
            );
        }
        Ok(asked)
    }
}

/// A DNS-1123 name of at most `max` characters.
fn dns_name(s: &str, max: usize) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    !s.is_empty()
        && s.len() <= max
        && edge(s.chars().next())
        && edge(s.chars().last())
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
}

/// The workload a pod belongs to, as `inject` names it from its manifest:
/// the owning StatefulSet's name; a ReplicaSet owner's name without its
/// pod-template hash (the Deployment's); else the pod's `generateName`
/// without its last `-`, else the pod's name.
pub fn workload_name(pod: &Pod) -> String {
    let meta = &pod.metadata;
    let owner = meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true));
    if let Some(owner) = owner {
        if owner.kind == "ReplicaSet"
            && let Some(hash) = meta
                .labels
                .as_ref()
                .and_then(|l| l.get("pod-template-hash"))
            && let Some(base) = owner.name.strip_suffix(&format!("-{hash}"))
        {
            return base.to_string();
        }
        return owner.name.clone();
    }
    if let Some(base) = meta.generate_name.as_deref().filter(|g| !g.is_empty()) {
        return base.trim_end_matches('-').to_string();
    }
    meta.name.clone().unwrap_or_else(|| "sbproxy".to_string())
}

/// `namespace/name`, or `namespace/generateName*` before the name is chosen.
fn pod_name(request: &AdmissionRequest<DynamicObject>) -> String {
    let ns = request.namespace.as_deref().unwrap_or_default();
    if !request.name.is_empty() {
        return format!("{ns}/{}", request.name);
    }
    let generate = request
        .object
        .as_ref()
        .and_then(|o| o.metadata.generate_name.clone())
        .unwrap_or_default();
    format!("{ns}/{generate}*")
}
