//! The config nudge for pods `inject` gave the sidecar: an edit of the
//! ConfigMap such a pod reads reaches it within about a second, as an
//! SBProxy's config edit does ([`crate::reconcile`]'s nudge).
//!
//! `inject` labels the pod template with the ConfigMap's name
//! ([`CONFIG_MAP_LABEL`]). This controller watches the labelled pods and the
//! ConfigMaps of its scope; when a ConfigMap changes, each pod that reads it
//! is annotated with the ConfigMap's `resourceVersion`
//! ([`CONFIG_VERSION_ANNOTATION`]). A pod update makes its kubelet sync the
//! pod's volumes at once, instead of at its next periodic sync (60-90 s).
//! Nothing restarts, and the kubelet's swap of the volume is atomic and
//! only moves forward. A pod the operator cannot patch (or no operator at
//! all) still reads the edit at the kubelet's next sync.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::Api;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use tracing::{debug, warn};

use crate::reconcile::{Context, Scope, tell_pod};
use crate::telemetry::NudgeResult;

/// Pod label `inject` sets: the name of the ConfigMap that holds the pod's
/// `sb.yml`.
pub const CONFIG_MAP_LABEL: &str = "sbproxy.dev/config-map";

/// Pod annotation: the `resourceVersion` of that ConfigMap the operator
/// last told the pod of.
pub const CONFIG_VERSION_ANNOTATION: &str = "sbproxy.dev/config-map-version";

/// A failed nudge is tried again after this long.
const RETRY: Duration = Duration::from_secs(10);

/// The labelled pods of `config_map`'s namespace that read it.
pub fn pods_reading(config_map: &ConfigMap, pods: &[Arc<Pod>]) -> Vec<ObjectRef<Pod>> {
    let Some(ns) = config_map.metadata.namespace.as_deref() else {
        return Vec::new();
    };
    let name = config_map.name_any();
    pods.iter()
        .filter(|p| {
            p.metadata.namespace.as_deref() == Some(ns)
                && p.labels().get(CONFIG_MAP_LABEL) == Some(&name)
        })
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect()
}

/// The controller, wired: labelled pods in `scope`, and ConfigMap changes
/// mapped to the pods that read them through the controller's pod cache.
fn controller(ctx: &Context, scope: &Scope) -> Controller<Pod> {
    let client = &ctx.client;
    let controller = Controller::new(
        scope.api::<Pod>(client),
        watcher::Config::default().labels(CONFIG_MAP_LABEL),
    );
    let pods = controller.store();
    controller.watches(
        scope.api::<ConfigMap>(client),
        watcher::Config::default(),
        move |config_map| pods_reading(&config_map, &pods.state()),
    )
}

/// Runs the controller until `stop` resolves.
pub async fn run(
    ctx: Arc<Context>,
    scope: Scope,
    stop: impl Future<Output = ()> + Send + Sync + 'static,
) {
    controller(&ctx, &scope)
        .graceful_shutdown_on(stop)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((pod, _)) => debug!(%pod, "injected pod checked"),
                Err(controller::Error::ReconcilerFailed(..)) => {}
                Err(e) => warn!(error = %e, "injected pods' controller"),
            }
        })
        .await;
}

/// Annotates `pod` with its ConfigMap's `resourceVersion` when it does not
/// carry it yet.
async fn reconcile(pod: Arc<Pod>, ctx: Arc<Context>) -> Result<Action, kube::Error> {
    let (Some(ns), Some(name)) = (pod.namespace(), pod.labels().get(CONFIG_MAP_LABEL)) else {
        return Ok(Action::await_change());
    };
    let config_maps = Api::<ConfigMap>::namespaced(ctx.client.clone(), &ns);
    let Some(version) = config_maps
        .get_metadata_opt(name)
        .await?
        .and_then(|m| m.metadata.resource_version)
    else {
        // Created later: its creation triggers this again.
        return Ok(Action::await_change());
    };
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ns);
    tell_pod(&ctx, &pods, pod.meta(), CONFIG_VERSION_ANNOTATION, &version).await?;
    Ok(Action::await_change())
}

fn error_policy(pod: Arc<Pod>, error: &kube::Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.nudged(NudgeResult::failed);
    warn!(pod = %format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any()), %error, "cannot tell the pod of its ConfigMap; it reads it at the kubelet's next sync (up to 90 s)");
    Action::requeue(RETRY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(ns: &str, name: &str, config_map: Option<&str>) -> Arc<Pod> {
        Arc::new(Pod {
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                labels: config_map.map(|c| [(CONFIG_MAP_LABEL.to_string(), c.to_string())].into()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        })
    }

    #[test]
    fn a_configmap_maps_to_the_pods_of_its_namespace_that_read_it() {
        let config_map = ConfigMap {
            metadata: ObjectMeta {
                namespace: Some("a".into()),
                name: Some("edge-config".into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        };
        let pods = [
            pod("a", "edge-0", Some("edge-config")),
            pod("a", "edge-1", Some("edge-config")),
            pod("a", "other-0", Some("other-config")),
            pod("b", "edge-0", Some("edge-config")),
            pod("a", "plain-0", None),
        ];
        let names: Vec<String> = pods_reading(&config_map, &pods)
            .into_iter()
            .map(|r| format!("{}/{}", r.namespace.unwrap_or_default(), r.name))
            .collect();
        assert_eq!(names, ["a/edge-0", "a/edge-1"]);
    }
}
