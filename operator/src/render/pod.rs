//! The pod template: the operator's pod, `spec.podTemplate` on top, and
//! the checks that keep a user's knobs from undoing what the operator set.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, EnvVar, PodSecurityContext, PodSpec,
    PodTemplateSpec, SeccompProfile, SecurityContext, Sysctl, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sbmesh::Flag;
use serde_json::Value;

use crate::crd::{PodTemplate, SBProxy};

use super::checks::ConfigFacts;
use super::sidecar::{
    KeySecret, MeshSettings, SidecarSettings, cluster_key_volume, container_port, data_volume,
    field_env, mount, readiness_probe, sidecar_container, value_env,
};
use super::{
    CLUSTER_KEY_KEY, CONFIG_DIR, CONFIG_VOLUME, DATA_DIR, DATA_VOLUME, FIRST_UNPRIVILEGED_PORT,
    NONROOT_UID, PROXY_CONTAINER, RESTART_PROXY_GRACE_MS, Refusal, RefusalReason, RenderOptions,
    SIDECAR_CONTAINER, UNPRIVILEGED_PORT_SYSCTL, acme_check_url, cluster_key_secret_name, labels,
    mesh_name, to_json,
};

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
pub(super) fn pod_template(
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
            field_env(Flag::POD_NAME.env, "metadata.name"),
            field_env(Flag::POD_IP.env, "status.podIP"),
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
    let name = Flag::SHUTDOWN_GRACE_MS.env;
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
pub(super) fn low_port_privileges(
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
        } else if name == Flag::CLUSTER_KEY.env && own.contains(&Flag::CLUSTER_KEY_FILE.env) {
            // The sidecar refuses both at once.
            format!(
                "but the operator gives the {} container {}, and the sidecar takes one or the \
                 other: the key {}",
                container.name,
                Flag::CLUSTER_KEY_FILE.env,
                set_from(Flag::CLUSTER_KEY_FILE.env)
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
            &Flag::POD_NAME,
            "is the pod's name (downward API metadata.name)",
        ),
        (&Flag::POD_IP, "is the pod's IP (downward API status.podIP)"),
        (
            &Flag::NAMESPACE,
            "is the pod's namespace (downward API metadata.namespace)",
        ),
        (
            &Flag::CLUSTER_ID,
            "comes from metadata.name, the SBProxy's name",
        ),
        (
            &Flag::CONFIG,
            "is the sb.yml of the SBProxyConfig that spec.configRef names, mounted at /etc/sbproxy",
        ),
        (
            &Flag::ADMIN_LISTEN,
            "comes from spec.sidecar.adminPort: set that instead",
        ),
        (
            &Flag::CHALLENGE_LISTEN,
            "comes from spec.sidecar.challengePort: set that instead",
        ),
        (
            &Flag::CERT_DIR,
            "is in the volume shared with the proxy (/var/lib/sbproxy), where the proxy reads the certificates",
        ),
        (
            &Flag::STATE_DIR,
            "is in the pod's shared volume (/var/lib/sbproxy)",
        ),
        (
            &Flag::PROXY_RELOAD_URL,
            "comes from spec.adminPort: set that instead",
        ),
        (
            &Flag::CHALLENGE_PASSTHROUGH,
            "comes from spec.port, the proxy's HTTP listener, to which the challenge port (the \
             Service's port 80) passes every request that is not an ACME challenge",
        ),
        (
            &Flag::ACME_CHECK_URL,
            "is port 80 of the Service <metadata.name>-svc the operator makes, where the CA's \
             HTTP-01 request lands",
        ),
        (
            &Flag::MESH_SERVICE,
            "is the headless Service <metadata.name>-mesh the operator makes",
        ),
        (
            &Flag::CLUSTER_DOMAIN,
            "comes from spec.clustering.clusterDomain: set that instead",
        ),
        (
            &Flag::GOSSIP_PORT,
            "comes from spec.clustering.gossipPort: set that instead",
        ),
        (
            &Flag::TRANSPORT_PORT,
            "comes from spec.clustering.transportPort: set that instead",
        ),
        (
            &Flag::CLUSTER_KEY_FILE,
            "comes from the Secret of spec.clustering.clusterSecretRef (else <metadata.name>-cluster-key), \
             mounted as a file: set clusterSecretRef instead",
        ),
        (
            &Flag::PROXY_AUTHORIZATION,
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
pub(super) fn network_policy_spec(
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
