//! `install`: everything a cluster needs to run the operator, as one YAML
//! stream, so that `sbmesh-operator install | kubectl apply -f -` is the
//! whole installation: the CRDs, the operator's Namespace, its
//! ServiceAccount, RBAC with exactly the verbs the controller uses, and a
//! 2-replica Deployment (one leads through the Lease, the other waits).

use std::collections::BTreeMap;
use std::process::ExitCode;

use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations,
    ServiceReference, WebhookClientConfig,
};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::core::v1::{
    Container, ContainerPort, EnvVar, HTTPGetAction, Namespace, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, ResourceRequirements, SeccompProfile, Service, ServiceAccount,
    ServicePort, ServiceSpec,
};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    LabelSelector, LabelSelectorRequirement, ObjectMeta,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde_json::Value;

use crate::admit;
use crate::cli::{InstallArgs, RbacScope};
use crate::crd;
use crate::render::{self, NONROOT_UID, field_env, restricted_security_context, to_json};
use crate::webhook;

/// Name of the ServiceAccount, the Deployment, and the (Cluster)Role.
pub const OPERATOR_NAME: &str = "sbmesh-operator";
/// Name of the Role (and RoleBinding) for the leader Lease.
pub const LEADER_ROLE_NAME: &str = "sbmesh-operator-leader";
/// The operator binary in the image.
pub const OPERATOR_COMMAND: &str = "/usr/local/bin/sbmesh-operator";
/// Port of `/metrics` and `/healthz` (`run --metrics-listen`).
pub const METRICS_PORT: i32 = 8080;
/// Name of the ClusterRole (and binding) of the injection webhook: its
/// configuration's `caBundle`, whatever the scope.
pub const WEBHOOK_ROLE_NAME: &str = "sbmesh-operator-webhook";

/// One RBAC rule: an API group, its resources, and the verbs on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// API group (`""` is the core group).
    pub api_group: &'static str,
    /// Resources (and subresources, as `statefulsets/status`).
    pub resources: &'static [&'static str],
    /// Verbs.
    pub verbs: &'static [&'static str],
}

/// Every call the controller makes on the objects it manages, and nothing
/// more (least privilege). Granted in the watched namespace (Role) or in
/// all of them (ClusterRole). The controller's code and this table change
/// together.
pub const CONTROLLER_RULES: &[Rule] = &[
    Rule {
        api_group: "sbproxy.dev",
        resources: &["sbproxies"],
        verbs: &["list", "watch"],
    },
    Rule {
        api_group: "sbproxy.dev",
        resources: &["sbproxies/status"],
        verbs: &["patch"],
    },
    Rule {
        api_group: "sbproxy.dev",
        resources: &["sbproxyconfigs"],
        verbs: &["get", "list", "watch"],
    },
    // The StatefulSet's status (replicas, readyReplicas) comes with the
    // object in the apply answer and the watch: no statefulsets/status rule.
    Rule {
        api_group: "apps",
        resources: &["statefulsets"],
        verbs: &["list", "watch", "create", "patch"],
    },
    Rule {
        api_group: "",
        resources: &["services"],
        verbs: &["list", "watch", "create", "patch"],
    },
    // The ConfigMaps of injected pods are read by name (their
    // resourceVersion) and watched with every other ConfigMap of the scope.
    Rule {
        api_group: "",
        resources: &["configmaps"],
        verbs: &["get", "list", "watch", "create", "patch"],
    },
    Rule {
        api_group: "policy",
        resources: &["poddisruptionbudgets"],
        verbs: &["get", "list", "watch", "create", "patch", "delete"],
    },
    Rule {
        api_group: "networking.k8s.io",
        resources: &["networkpolicies"],
        verbs: &["get", "list", "watch", "create", "patch", "delete"],
    },
    // A config edit reaches the pods at once: each pod of the SBProxy is
    // annotated with the config's hash (each injected pod with its
    // ConfigMap's version, watched), which makes its kubelet sync the
    // ConfigMap volume now instead of at its next periodic sync. A pod
    // opted in for injection without the webhook's mark is read whole
    // once (crate::missed).
    Rule {
        api_group: "",
        resources: &["pods"],
        verbs: &["get", "list", "watch", "patch"],
    },
    // prometheus-operator's kind, which may not be served: applied and
    // removed by name, never watched.
    Rule {
        api_group: "monitoring.coreos.com",
        resources: &["podmonitors"],
        verbs: &["get", "create", "patch", "delete"],
    },
    // The cluster-key Secret is read by name and created once: never
    // listed, watched, updated or deleted.
    Rule {
        api_group: "",
        resources: &["secrets"],
        verbs: &["get", "create", "patch"],
    },
    Rule {
        api_group: "events.k8s.io",
        resources: &["events"],
        verbs: &["create", "patch"],
    },
];

/// The leader Lease (`sbproxy-operator-leader`), always in the operator's
/// own namespace, whatever the scope.
pub const LEADER_RULES: &[Rule] = &[Rule {
    api_group: "coordination.k8s.io",
    resources: &["leases"],
    verbs: &["get", "create", "update"],
}];

/// The RBAC rules of `rules` as Kubernetes PolicyRules.
pub fn policy_rules(rules: &[Rule]) -> Vec<PolicyRule> {
    rules
        .iter()
        .map(|rule| PolicyRule {
            api_groups: Some(vec![rule.api_group.to_string()]),
            resources: Some(rule.resources.iter().map(|r| r.to_string()).collect()),
            verbs: rule.verbs.iter().map(|v| v.to_string()).collect(),
            ..PolicyRule::default()
        })
        .collect()
}

/// The operator's pods, as its Deployment and the webhook's Service select them.
fn selector() -> BTreeMap<String, String> {
    BTreeMap::from([
        (
            "app.kubernetes.io/name".to_string(),
            OPERATOR_NAME.to_string(),
        ),
        (
            "app.kubernetes.io/component".to_string(),
            "operator".to_string(),
        ),
    ])
}

fn labels() -> BTreeMap<String, String> {
    let mut labels = selector();
    labels.insert(
        "app.kubernetes.io/managed-by".to_string(),
        OPERATOR_NAME.to_string(),
    );
    labels
}

fn meta(name: &str, namespace: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        namespace: namespace.map(str::to_string),
        labels: Some(labels()),
        ..ObjectMeta::default()
    }
}

fn subject(ns: &str) -> Vec<Subject> {
    vec![Subject {
        kind: "ServiceAccount".to_string(),
        name: OPERATOR_NAME.to_string(),
        namespace: Some(ns.to_string()),
        ..Subject::default()
    }]
}

fn role_ref(kind: &str, name: &str) -> RoleRef {
    RoleRef {
        api_group: "rbac.authorization.k8s.io".to_string(),
        kind: kind.to_string(),
        name: name.to_string(),
    }
}

/// Every object of the installation, in the order `kubectl apply` needs
/// them: CRDs, Namespace, ServiceAccount, RBAC, Deployment.
pub fn install_objects(args: &InstallArgs) -> Vec<Value> {
    let ns = args.namespace.as_str();
    let mut out: Vec<Value> = crd::crds().iter().map(to_json).collect();
    out.push(to_json(&Namespace {
        metadata: meta(ns, None),
        ..Namespace::default()
    }));
    out.push(to_json(&ServiceAccount {
        metadata: meta(OPERATOR_NAME, Some(ns)),
        ..ServiceAccount::default()
    }));
    match args.rbac_scope {
        RbacScope::Namespace => {
            out.push(to_json(&Role {
                metadata: meta(OPERATOR_NAME, Some(ns)),
                rules: Some(policy_rules(CONTROLLER_RULES)),
            }));
            out.push(to_json(&RoleBinding {
                metadata: meta(OPERATOR_NAME, Some(ns)),
                role_ref: role_ref("Role", OPERATOR_NAME),
                subjects: Some(subject(ns)),
            }));
        }
        RbacScope::Cluster => {
            out.push(to_json(&ClusterRole {
                metadata: meta(OPERATOR_NAME, None),
                rules: Some(policy_rules(CONTROLLER_RULES)),
                ..ClusterRole::default()
            }));
            out.push(to_json(&ClusterRoleBinding {
                metadata: meta(OPERATOR_NAME, None),
                role_ref: role_ref("ClusterRole", OPERATOR_NAME),
                subjects: Some(subject(ns)),
            }));
        }
    }
    out.push(to_json(&Role {
        metadata: meta(LEADER_ROLE_NAME, Some(ns)),
        rules: Some(policy_rules(LEADER_RULES)),
    }));
    out.push(to_json(&RoleBinding {
        metadata: meta(LEADER_ROLE_NAME, Some(ns)),
        role_ref: role_ref("Role", LEADER_ROLE_NAME),
        subjects: Some(subject(ns)),
    }));
    out.push(to_json(&ClusterRole {
        metadata: meta(WEBHOOK_ROLE_NAME, None),
        rules: Some(vec![
            PolicyRule {
                api_groups: Some(vec!["admissionregistration.k8s.io".to_string()]),
                resources: Some(vec!["mutatingwebhookconfigurations".to_string()]),
                resource_names: Some(vec![webhook::CONFIGURATION.to_string()]),
                verbs: vec!["get".to_string(), "patch".to_string()],
                ..PolicyRule::default()
            },
            // Which namespaces opted in, for the pods the webhook missed
            // (crate::missed): labels only, nothing written.
            PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["namespaces".to_string()]),
                verbs: vec!["list".to_string(), "watch".to_string()],
                ..PolicyRule::default()
            },
        ]),
        ..ClusterRole::default()
    }));
    out.push(to_json(&ClusterRoleBinding {
        metadata: meta(WEBHOOK_ROLE_NAME, None),
        role_ref: role_ref("ClusterRole", WEBHOOK_ROLE_NAME),
        subjects: Some(subject(ns)),
    }));
    out.push(to_json(&deployment(args)));
    out.push(to_json(&webhook_service(ns)));
    out.push(to_json(&webhook_configuration(args)));
    out
}

/// The Service in front of every replica's webhook listener.
fn webhook_service(ns: &str) -> Service {
    Service {
        metadata: meta(webhook::SERVICE, Some(ns)),
        spec: Some(ServiceSpec {
            selector: Some(selector()),
            ports: Some(vec![ServicePort {
                name: Some("webhook".to_string()),
                port: webhook::SERVICE_PORT,
                target_port: Some(IntOrString::String("webhook".to_string())),
                protocol: Some("TCP".to_string()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// The CEL condition: the pod has no container named `sbmesh-sidecar`.
fn no_sidecar_yet() -> MatchCondition {
    let name = render::SIDECAR_CONTAINER;
    MatchCondition {
        name: "no-sidecar-yet".to_string(),
        expression: format!(
            "!object.spec.containers.exists(c, c.name == '{name}') && \
             (!has(object.spec.initContainers) || \
             !object.spec.initContainers.exists(c, c.name == '{name}'))"
        ),
    }
}

/// The annotation `sbproxy.dev/inject` as CEL reads it (`''` when absent).
fn inject_annotation() -> String {
    format!(
        "(has(object.metadata.annotations) && '{key}' in object.metadata.annotations ? \
         object.metadata.annotations['{key}'] : '')",
        key = admit::INJECT
    )
}

/// The MutatingWebhookConfiguration: pods of a labelled namespace not
/// opted out, and pods annotated in any other namespace (the operator's
/// own only with `--rbac-scope namespace`); the `caBundle` is written by the
/// operator (docs/reference.md#sidecar-injection-by-webhook says why
/// `failurePolicy: Ignore` and 5 s).
fn webhook_configuration(args: &InstallArgs) -> MutatingWebhookConfiguration {
    let ns = args.namespace.as_str();
    let scoped = |mut expressions: Vec<LabelSelectorRequirement>| {
        if args.rbac_scope == RbacScope::Namespace {
            expressions.push(LabelSelectorRequirement {
                key: "kubernetes.io/metadata.name".to_string(),
                operator: "In".to_string(),
                values: Some(vec![ns.to_string()]),
            });
        }
        LabelSelector {
            match_expressions: Some(expressions),
            ..LabelSelector::default()
        }
    };
    let label = |operator: &str| LabelSelectorRequirement {
        key: admit::INJECT.to_string(),
        operator: operator.to_string(),
        values: Some(vec![admit::ENABLED.to_string()]),
    };
    let hook = |name: &str, namespaces: LabelSelector, asked: String| MutatingWebhook {
        name: name.to_string(),
        admission_review_versions: vec!["v1".to_string()],
        client_config: WebhookClientConfig {
            service: Some(ServiceReference {
                name: webhook::SERVICE.to_string(),
                namespace: ns.to_string(),
                path: Some(webhook::PATH.to_string()),
                port: Some(webhook::SERVICE_PORT),
            }),
            ..WebhookClientConfig::default()
        },
        failure_policy: Some("Ignore".to_string()),
        timeout_seconds: Some(webhook::TIMEOUT_SECONDS),
        side_effects: "None".to_string(),
        reinvocation_policy: Some("Never".to_string()),
        match_policy: Some("Equivalent".to_string()),
        namespace_selector: Some(namespaces),
        match_conditions: Some(vec![
            MatchCondition {
                name: "asked-for".to_string(),
                expression: asked,
            },
            no_sidecar_yet(),
        ]),
        rules: Some(vec![RuleWithOperations {
            api_groups: Some(vec![String::new()]),
            api_versions: Some(vec!["v1".to_string()]),
            operations: Some(vec!["CREATE".to_string()]),
            resources: Some(vec!["pods".to_string()]),
            scope: Some("Namespaced".to_string()),
        }]),
        ..MutatingWebhook::default()
    };
    let annotation = inject_annotation();
    MutatingWebhookConfiguration {
        metadata: meta(webhook::CONFIGURATION, None),
        webhooks: Some(vec![
            // A labelled namespace: every pod but those opted out.
            hook(
                "namespace.inject.sbproxy.dev",
                scoped(vec![label("In")]),
                format!("{annotation} != '{}'", admit::DISABLED),
            ),
            // Elsewhere: pods that carry the annotation (a value other than
            // enabled or disabled reaches the webhook, which refuses it).
            hook(
                "pod.inject.sbproxy.dev",
                scoped(vec![label("NotIn")]),
                format!(
                    "{annotation} != '' && {annotation} != '{}'",
                    admit::DISABLED
                ),
            ),
        ]),
    }
}

fn deployment(args: &InstallArgs) -> Deployment {
    Deployment {
        metadata: meta(OPERATOR_NAME, Some(args.namespace.as_str())),
        spec: Some(DeploymentSpec {
            // One leads; the other takes the Lease within 15 s when it goes.
            replicas: Some(2),
            selector: LabelSelector {
                match_labels: Some(selector()),
                ..LabelSelector::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels()),
                    // Its own pods never wait on its webhook.
                    annotations: Some(BTreeMap::from([(
                        admit::INJECT.to_string(),
                        admit::DISABLED.to_string(),
                    )])),
                    ..ObjectMeta::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(OPERATOR_NAME.to_string()),
                    // SIGTERM drains in-flight reconciles within
                    // SBPROXY_SHUTDOWN_GRACE_MS (30 s): leave room for it.
                    termination_grace_period_seconds: Some(40),
                    security_context: Some(PodSecurityContext {
                        run_as_non_root: Some(true),
                        run_as_user: Some(NONROOT_UID),
                        run_as_group: Some(NONROOT_UID),
                        seccomp_profile: Some(SeccompProfile {
                            type_: "RuntimeDefault".to_string(),
                            ..SeccompProfile::default()
                        }),
                        ..PodSecurityContext::default()
                    }),
                    containers: vec![operator_container(args)],
                    ..PodSpec::default()
                }),
            },
            ..DeploymentSpec::default()
        }),
        ..Deployment::default()
    }
}

/// The operator's container: `run` for the chosen scope, its metrics and
/// webhook ports, probes on the metrics port.
fn operator_container(args: &InstallArgs) -> Container {
    let mut run_args = vec!["run".to_string()];
    let mut env = vec![
        EnvVar {
            name: "SBMESH_SIDECAR_IMAGE".to_string(),
            value: Some(args.image.clone()),
            ..EnvVar::default()
        },
        field_env("POD_NAME", "metadata.name"),
        field_env("SBMESH_LEASE_NAMESPACE", "metadata.namespace"),
    ];
    match args.rbac_scope {
        RbacScope::Namespace => {
            run_args.extend(["--namespace".to_string(), args.namespace.clone()]);
            env.push(field_env("SBMESH_OPERATOR_NAMESPACE", "metadata.namespace"));
        }
        RbacScope::Cluster => run_args.push("--all-namespaces".to_string()),
    }
    let probe = |path: &str| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_string()),
            port: IntOrString::String("metrics".to_string()),
            ..HTTPGetAction::default()
        }),
        period_seconds: Some(10),
        ..Probe::default()
    };
    Container {
        name: OPERATOR_NAME.to_string(),
        image: Some(args.image.clone()),
        command: Some(vec![OPERATOR_COMMAND.to_string()]),
        args: Some(run_args),
        env: Some(env),
        ports: Some(vec![
            ContainerPort {
                name: Some("metrics".to_string()),
                container_port: METRICS_PORT,
                protocol: Some("TCP".to_string()),
                ..ContainerPort::default()
            },
            ContainerPort {
                name: Some("webhook".to_string()),
                container_port: i32::from(webhook::DEFAULT_PORT),
                protocol: Some("TCP".to_string()),
                ..ContainerPort::default()
            },
        ]),
        liveness_probe: Some(probe("/healthz")),
        // Ready once its webhook can answer (its Service routes admissions
        // to ready replicas only).
        readiness_probe: Some(probe("/readyz")),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".to_string(), Quantity("50m".to_string())),
                ("memory".to_string(), Quantity("64Mi".to_string())),
            ])),
            limits: Some(BTreeMap::from([(
                "memory".to_string(),
                Quantity("256Mi".to_string()),
            )])),
            ..ResourceRequirements::default()
        }),
        security_context: Some(restricted_security_context()),
        ..Container::default()
    }
}

/// [`install_objects`] as a YAML stream.
pub fn install_yaml(args: &InstallArgs) -> String {
    crd::yaml_stream(&install_objects(args))
}

/// The `install` command: prints [`install_yaml`].
pub fn command(args: &InstallArgs) -> anyhow::Result<ExitCode> {
    crate::cli::print_out(&install_yaml(args))
}
