//! Pods that should have had the sidecar and did not get it: created in an
//! opted-in place while no webhook replica answered (the configuration's
//! `failurePolicy: Ignore` then admits them as they are). The leader finds
//! them and says so, once per pod: a Warning Event `SidecarNotInjected` on
//! the pod, `sbmesh_injections_total{result="missed"}`, and a log line with
//! the pod's namespace and name. Never silent, never a restart: deleting a
//! pod is the user's call (the Event says how).
//!
//! It keeps two caches fed by watches (pod metadata in its scope, and the
//! namespaces labelled `sbproxy.dev/inject=enabled`) and looks at them every
//! [`SCAN`]. A pod the webhook answered carries `sbproxy.dev/injected`; one
//! without it in an opted-in place ([`candidates`]) is read whole once: it
//! is missed when it has no `sbmesh-sidecar` and mounts `sb.yml` at
//! `/etc/sbproxy` (a proxy).

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use tracing::{debug, warn};

use crate::admit::{DISABLED, ENABLED, INJECT, INJECTED_ANNOTATION};
use crate::reconcile::{Context, Scope};
use crate::render;
use crate::telemetry::Injection;

/// How often the caches are looked at.
pub const SCAN: Duration = Duration::from_secs(10);
/// The Event's reason.
pub const REASON: &str = "SidecarNotInjected";

/// The pods of `pods` in an opted-in place (a namespace of `opted_in` and
/// not opted out, or annotated `enabled`) that the webhook did not answer
/// (no `sbproxy.dev/injected`), are not being deleted, are not the
/// operator's own (an SBProxy's, its own), and are not in `seen`.
pub fn candidates<'a>(
    pods: &'a [Arc<PartialObjectMeta<Pod>>],
    opted_in: &BTreeSet<String>,
    seen: &HashSet<String>,
) -> Vec<&'a PartialObjectMeta<Pod>> {
    pods.iter()
        .map(Arc::as_ref)
        .filter(|p| {
            let asked = p.annotations().get(INJECT).map(String::as_str);
            let in_labelled = p
                .metadata
                .namespace
                .as_ref()
                .is_some_and(|ns| opted_in.contains(ns));
            let opted = match asked {
                Some(DISABLED) => false,
                Some(ENABLED) => true,
                _ => in_labelled,
            };
            opted
                && !p.annotations().contains_key(INJECTED_ANNOTATION)
                && p.metadata.deletion_timestamp.is_none()
                && p.labels()
                    .get("app.kubernetes.io/managed-by")
                    .map(String::as_str)
                    != Some(render::MANAGER)
                && !seen.contains(&uid(p))
        })
        .collect()
}

fn uid(p: &PartialObjectMeta<Pod>) -> String {
    p.metadata.uid.clone().unwrap_or_default()
}

/// Whether a whole pod needed the sidecar and lacks it.
pub fn lacks_sidecar(pod: &Pod) -> bool {
    let Some(spec) = &pod.spec else { return false };
    let has_sidecar = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .any(|c| c.name == render::SIDECAR_CONTAINER);
    let reads_sb_yml = spec
        .containers
        .iter()
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .any(|m| m.mount_path.trim_end_matches('/') == render::CONFIG_DIR);
    !has_sidecar && reads_sb_yml
}

/// Runs until `stop` resolves (the leader's task).
pub async fn run(ctx: Arc<Context>, scope: Scope, stop: impl Future<Output = ()> + Send + 'static) {
    let (pods, pods_writer) = reflector::store::<PartialObjectMeta<Pod>>();
    let (namespaces, ns_writer) = reflector::store::<PartialObjectMeta<Namespace>>();
    let pod_stream = reflector::reflector(
        pods_writer,
        watcher(
            scope.api::<PartialObjectMeta<Pod>>(&ctx.client),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .for_each(|event| async move {
        if let Err(e) = event {
            warn!(error = %e, "watching pods for missed injections");
        }
    });
    let labelled = watcher::Config::default().labels(&format!("{INJECT}={ENABLED}"));
    let ns_stream = reflector::reflector(
        ns_writer,
        watcher(
            Api::<PartialObjectMeta<Namespace>>::all(ctx.client.clone()),
            labelled,
        ),
    )
    .default_backoff()
    .for_each(|event| async move {
        if let Err(e) = event {
            warn!(error = %e, "watching the namespaces labelled {INJECT}={ENABLED}");
        }
    });
    let scan = scan_forever(ctx, pods, namespaces);
    tokio::select! {
        _ = pod_stream => {}
        _ = ns_stream => {}
        _ = scan => {}
        _ = stop => {}
    }
}

async fn scan_forever(
    ctx: Arc<Context>,
    pods: Store<PartialObjectMeta<Pod>>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
) {
    // Pods looked at (reported, or found fine): not read again.
    let mut seen = HashSet::new();
    let _ = pods.wait_until_ready().await;
    let _ = namespaces.wait_until_ready().await;
    loop {
        let opted_in: BTreeSet<String> = namespaces.state().iter().map(|n| n.name_any()).collect();
        let state = pods.state();
        let found: Vec<(String, String, String)> = candidates(&state, &opted_in, &seen)
            .into_iter()
            .map(|p| (p.namespace().unwrap_or_default(), p.name_any(), uid(p)))
            .collect();
        for (ns, name, uid) in found {
            match Api::<Pod>::namespaced(ctx.client.clone(), &ns)
                .get_opt(&name)
                .await
            {
                Ok(Some(pod)) => {
                    if lacks_sidecar(&pod) {
                        report(&ctx, &pod).await;
                    } else {
                        debug!(pod = %format!("{ns}/{name}"), "opted in without the webhook's mark, but has the sidecar or is no proxy");
                    }
                    seen.insert(uid);
                }
                Ok(None) => {}
                Err(e) => {
                    warn!(pod = %format!("{ns}/{name}"), error = %e, "cannot read the pod to check for a missed injection; looked at again next scan")
                }
            }
        }
        // Forget pods that are gone.
        let live: HashSet<String> = state.iter().map(|p| uid(p)).collect();
        seen.retain(|u| live.contains(u));
        tokio::time::sleep(SCAN).await;
    }
}

async fn report(ctx: &Context, pod: &Pod) {
    let who = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
    ctx.metrics.injection(Injection::missed);
    warn!(pod = %who, result = Injection::missed.as_str(), "created in an opted-in place without the sbmesh sidecar: no injection webhook replica answered its admission");
    let note = format!(
        "created without the sbmesh sidecar although opted in ({INJECT}): no replica of the \
         injection webhook answered its admission (failurePolicy Ignore admitted it as it is). \
         Delete the pod (e.g. kubectl rollout restart of its workload) to have it created \
         with the sidecar."
    );
    let event = Event {
        type_: EventType::Warning,
        reason: REASON.to_string(),
        note: Some(note),
        action: "Inject".to_string(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &pod.object_ref(&())).await {
        warn!(pod = %who, error = %e, "could not publish the SidecarNotInjected Event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn meta(ns: &str, name: &str, annotations: &[(&str, &str)]) -> Arc<PartialObjectMeta<Pod>> {
        let metadata = ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            uid: Some(format!("{ns}-{name}")),
            annotations: Some(
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        };
        Arc::new(PartialObjectMeta {
            metadata,
            ..PartialObjectMeta::default()
        })
    }

    #[test]
    fn only_opted_in_pods_the_webhook_did_not_answer_are_candidates() {
        let mut sbproxy = (*meta("on", "demo-0", &[])).clone();
        sbproxy.metadata.labels = Some(
            [(
                "app.kubernetes.io/managed-by".to_string(),
                render::MANAGER.to_string(),
            )]
            .into(),
        );
        let pods = vec![
            meta("on", "missed-0", &[]),
            meta("on", "answered-0", &[(INJECTED_ANNOTATION, "1.0.0")]),
            meta("on", "out-0", &[(INJECT, DISABLED)]),
            meta("off", "plain-0", &[]),
            meta("off", "asked-0", &[(INJECT, ENABLED)]),
            meta("on", "seen-0", &[]),
            Arc::new(sbproxy),
        ];
        let opted_in = BTreeSet::from(["on".to_string()]);
        let seen = HashSet::from(["on-seen-0".to_string()]);
        let names: Vec<String> = candidates(&pods, &opted_in, &seen)
            .iter()
            .map(|p| p.name_any())
            .collect();
        assert_eq!(names, ["missed-0", "asked-0"]);
    }
}
