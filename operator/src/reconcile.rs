//! The SBProxy controller: SBProxy + SBProxyConfig -> [`render::render`]
//! -> server-side apply -> status (docs/reference.md#custom-resources).
//!
//! It watches SBProxies (one namespace or all), the objects it owns
//! (StatefulSet, Services, ConfigMap, PodDisruptionBudget, NetworkPolicy —
//! so a pod becoming ready re-reconciles and the status follows), and
//! SBProxyConfigs: an edit of one reconciles, within seconds, every SBProxy
//! of its namespace whose `spec.configRef` names it ([`proxies_for_config`]).
//!
//! # API calls
//!
//! The install RBAC must grant exactly these (plus the Lease verbs of
//! [`crate::leader`]):
//!
//! | group | resource | verbs | why |
//! |---|---|---|---|
//! | `sbproxy.dev` | `sbproxies` | list, watch | the primary watch |
//! | `sbproxy.dev` | `sbproxies/status` | patch | status merge patch |
//! | `sbproxy.dev` | `sbproxyconfigs` | get, list, watch | GET the referenced config; watch for edits |
//! | `apps` | `statefulsets` | list, watch, create, patch | owned watch; server-side apply (its answer carries replicas / readyReplicas) |
//! | core | `services`, `configmaps` | list, watch, create, patch | owned watch; server-side apply |
//! | `policy` | `poddisruptionbudgets` | get, list, watch, create, patch, delete | owned watch; apply; GET + DELETE when replicas drop to 1 |
//! | `networking.k8s.io` | `networkpolicies` | get, list, watch, create, patch, delete | owned watch; apply with `spec.networkPolicy`; GET + DELETE without |
//! | `monitoring.coreos.com` | `podmonitors` | get, create, patch, delete | apply with `spec.podMonitor`; GET + DELETE without. Never watched: prometheus-operator's CRD may be absent, and a watch of a kind not served fails forever |
//! | core | `secrets` | get, create, patch | the cluster key: GET, then POST once; a merge PATCH of the operator's own Secret during a rotation ([`crate::rotation`]); never list, watch, update or delete, and never a `clusterSecretRef` Secret |
//! | `events.k8s.io` | `events` | create, patch | Normal/Warning Events (a repeat is a patch of the series) |
//! | core | `pods` | list, patch | the config nudge (`nudge_pods`): LIST the SBProxy's pods by label, merge PATCH the annotation `sbproxy.dev/config-hash` of those that lack the config's hash, and `sbproxy.dev/cluster-key-ids` after a write of the cluster-key Secret |
//!
//! Calls made per reconcile, in order: GET the SBProxyConfig; GET the
//! cluster-key Secret (only with clustering on and no `clusterSecretRef`);
//! then either (refusal) PATCH status when it changed + POST a Warning
//! Event, or (applied) POST the Secret when render asks for one, PATCH the
//! Secret when a key rotation moves (then a Normal Event, and LIST the
//! pods and PATCH each one's cluster-key-ids annotation), PATCH
//! (apply) StatefulSet, headless Service, Service, ConfigMap, then (when
//! the config's hash is not `status.configHash` yet) LIST the pods and
//! PATCH each one whose config-hash annotation differs, then the PDB
//! or, without one, GET + DELETE of a PDB left from a larger scale; the
//! same for the NetworkPolicy and then the PodMonitor (applied when the spec
//! asks, else GET + DELETE of one left from before); PATCH status when it
//! changed; POST Normal Events for a created Secret, a deleted object, and
//! a changed spec or config. An SBProxy being deleted gets no call. After
//! an API error: a best-effort PATCH of `status.lastError`.
//!
//! A cluster without prometheus-operator answers the PodMonitor's apply
//! with 404 (the kind is not served). That fails nothing else: everything
//! else is applied, and the status says what is missing (`Degraded=True`,
//! reason `PodMonitorNotServed`, `lastError` naming prometheus-operator), a
//! Warning Event too, and the SBProxy is looked at again after 60 s, so
//! installing prometheus-operator (or turning `spec.podMonitor` off) clears
//! it within a minute.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value, json};
use tracing::{debug, info, warn};

use crate::crd::{ClusterKeyStatus, SBProxy, SBProxyConfig, SBProxyStatus};
use crate::render::{self, Refusal, RenderOptions, Rendered};
use crate::rotation;
use crate::telemetry::{Metrics, NudgeResult, ReconcileResult};

/// Field manager of every server-side apply (docs/reference.md#objects-the-operator-applies).
pub const FIELD_MANAGER: &str = "sbmesh-operator";
/// `reportingController` of the Events.
pub const REPORTING_CONTROLLER: &str = "sbmesh-operator";
/// Periodic re-check of an applied SBProxy: repairs drift nobody watches.
pub const REQUEUE_APPLIED: Duration = Duration::from_secs(5 * 60);
/// Re-check of a refused SBProxy (docs/reference.md#refusal-reasons), or of one whose
/// PodMonitor the cluster does not serve.
pub const REQUEUE_REFUSED: Duration = Duration::from_secs(60);
/// First retry after an API error; doubles per consecutive failure.
pub const ERROR_BACKOFF_FIRST: Duration = Duration::from_secs(5);
/// Longest retry delay after API errors.
pub const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(5 * 60);
/// Label every rendered object carries; the owned watches select on it so
/// the operator caches only its own ConfigMaps, Services, etc.
pub const MANAGED_BY_SELECTOR: &str = "app.kubernetes.io/managed-by=sbmesh-operator";
/// Coalesces bursts of watch events (a rollout's status updates) into one
/// reconcile; small enough that a config edit still lands within seconds.
const DEBOUNCE: Duration = Duration::from_millis(500);
/// An Event note is at most 1 kB (events.k8s.io/v1).
const EVENT_NOTE_MAX: usize = 1024;

/// Condition type: every replica is ready.
pub const READY: &str = "Ready";
/// Condition type: the spec was refused, or a part of it could not be
/// applied (True), or it is applied (False).
pub const DEGRADED: &str = "Degraded";
/// `Degraded` reason (and Warning Event reason) when the cluster does not
/// serve the PodMonitor kind that `spec.podMonitor` asks for.
pub const POD_MONITOR_NOT_SERVED: &str = "PodMonitorNotServed";

/// A reconcile that could not finish; the error policy retries it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A call to the API server failed.
    #[error("{verb} {what}: {source}")]
    Kube {
        /// What was attempted (`get`, `apply`, …).
        verb: &'static str,
        /// The object (`Secret ns/name`).
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The SBProxy came without a namespace (it is a namespaced kind, so
    /// only a broken watch answer could do this).
    #[error("SBProxy {0} has no namespace")]
    NoNamespace(String),
}

impl Error {
    fn kube(verb: &'static str, what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
        let what = what.into();
        move |source| Error::Kube { verb, what, source }
    }
}

/// What every reconcile shares.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Sidecar image for SBProxies that do not name one.
    pub sidecar_image: String,
    /// Metrics registry.
    pub metrics: Arc<Metrics>,
    /// Event recorder.
    pub recorder: Recorder,
    /// Consecutive failures per SBProxy, for the error backoff.
    failures: Mutex<HashMap<ObjectRef<SBProxy>, u32>>,
    /// Reconciles running now (see [`Context::in_flight`]).
    in_flight: AtomicUsize,
}

impl Context {
    /// A context whose Events are reported as `reporter`.
    pub fn new(
        client: Client,
        sidecar_image: impl Into<String>,
        metrics: Arc<Metrics>,
        reporter: Reporter,
    ) -> Self {
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            sidecar_image: sidecar_image.into(),
            metrics,
            failures: Mutex::new(HashMap::new()),
            in_flight: AtomicUsize::new(0),
        }
    }

    /// How many reconciles are running now. A drain waits for this to be 0
    /// rather than only for the controller's stream to end: a stop that
    /// comes before the controller's caches are first filled leaves kube's
    /// runner waiting for them forever, with nothing in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    fn failures(&self) -> std::sync::MutexGuard<'_, HashMap<ObjectRef<SBProxy>, u32>> {
        // The map holds plain counters: a panic elsewhere cannot leave it
        // half-updated, so a poisoned lock is still usable.
        self.failures.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Counts one running reconcile for as long as it lives.
struct InFlight<'a>(&'a Context);

impl<'a> InFlight<'a> {
    fn enter(ctx: &'a Context) -> Self {
        ctx.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(ctx)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The Event reporter for this process.
pub fn reporter(instance: Option<String>) -> Reporter {
    Reporter {
        controller: REPORTING_CONTROLLER.to_owned(),
        instance,
    }
}

/// Which SBProxies the controller watches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// One namespace.
    Namespace(String),
    /// Every namespace.
    All,
}

impl Scope {
    pub(crate) fn api<K>(&self, client: &Client) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        match self {
            Scope::Namespace(ns) => Api::namespaced(client.clone(), ns),
            Scope::All => Api::all(client.clone()),
        }
    }
}

/// The SBProxies of `config`'s namespace whose `spec.configRef` is
/// `config`'s name: what an edit of `config` must reconcile.
pub fn proxies_for_config(
    config: &SBProxyConfig,
    proxies: &[Arc<SBProxy>],
) -> Vec<ObjectRef<SBProxy>> {
    let Some(ns) = config.metadata.namespace.as_deref() else {
        return Vec::new();
    };
    let name = config.name_any();
    proxies
        .iter()
        .filter(|p| {
            p.metadata.namespace.as_deref() == Some(ns) && p.spec.config_ref.name() == Ok(&name)
        })
        .map(|p| ObjectRef::from_obj(p.as_ref()))
        .collect()
}

/// The controller, wired: SBProxies in `scope`, the objects they own, and
/// SBProxyConfig edits mapped through the controller's own SBProxy cache.
pub fn controller(client: &Client, scope: &Scope) -> Controller<SBProxy> {
    let owned = || watcher::Config::default().labels(MANAGED_BY_SELECTOR);
    let controller = Controller::new(scope.api::<SBProxy>(client), watcher::Config::default())
        .with_config(controller::Config::default().debounce(DEBOUNCE));
    let proxies = controller.store();
    controller
        .owns(scope.api::<StatefulSet>(client), owned())
        .owns(scope.api::<Service>(client), owned())
        .owns(scope.api::<ConfigMap>(client), owned())
        .owns(scope.api::<PodDisruptionBudget>(client), owned())
        .owns(scope.api::<NetworkPolicy>(client), owned())
        .watches(
            scope.api::<SBProxyConfig>(client),
            watcher::Config::default(),
            move |config| proxies_for_config(&config, &proxies.state()),
        )
}

/// Runs the controller until `stop` resolves and every in-flight reconcile
/// has finished (the caller bounds that wait).
pub async fn run(
    ctx: Arc<Context>,
    scope: Scope,
    stop: impl Future<Output = ()> + Send + Sync + 'static,
) {
    controller(&ctx.client, &scope)
        .graceful_shutdown_on(stop)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            match result {
                Ok((proxy, action)) => debug!(%proxy, ?action, "reconciled"),
                // error_policy already logged it.
                Err(controller::Error::ReconcilerFailed(..)) => {}
                Err(e) => warn!(error = %e, "controller"),
            }
        })
        .await;
}

/// How one reconcile ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Applied; look again sooner than usual when a key rotation waits.
    Applied(Option<Duration>),
    Refused,
    /// Being deleted: the garbage collector removes the owned objects;
    /// applying them again would only race it.
    Deleting,
}

/// Reconciles one SBProxy. `Ok` requeues after 5 min when applied, after
/// 60 s when refused, and waits for a change (making no call) while the
/// SBProxy is being deleted; `Err` goes to [`error_policy`].
pub async fn reconcile(proxy: Arc<SBProxy>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _running = InFlight::enter(&ctx);
    let started = Instant::now();
    let outcome = reconcile_proxy(&proxy, &ctx).await;
    let result = match &outcome {
        Ok(Outcome::Applied(_) | Outcome::Deleting) => ReconcileResult::ok,
        Ok(Outcome::Refused) => ReconcileResult::refused,
        Err(_) => ReconcileResult::error,
    };
    ctx.metrics.observe_reconcile(result, started.elapsed());
    match outcome {
        Ok(outcome) => {
            ctx.failures().remove(&ObjectRef::from_obj(proxy.as_ref()));
            Ok(match outcome {
                Outcome::Applied(recheck) => {
                    Action::requeue(recheck.map_or(REQUEUE_APPLIED, |r| r.min(REQUEUE_APPLIED)))
                }
                Outcome::Refused => Action::requeue(REQUEUE_REFUSED),
                Outcome::Deleting => Action::await_change(),
            })
        }
        Err(e) => {
            record_error(&proxy, &ctx, &e).await;
            Err(e)
        }
    }
}

/// Requeues a failed SBProxy with exponential backoff ([`error_backoff`]).
pub fn error_policy(proxy: Arc<SBProxy>, error: &Error, ctx: Arc<Context>) -> Action {
    let failures = {
        let mut map = ctx.failures();
        let n = map.entry(ObjectRef::from_obj(proxy.as_ref())).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let delay = error_backoff(failures);
    warn!(
        proxy = %ObjectRef::from_obj(proxy.as_ref()),
        %error,
        failures,
        retry_in_s = delay.as_secs(),
        "reconcile failed"
    );
    Action::requeue(delay)
}

/// Delay before retry number `failures` (1-based): 5 s, 10 s, 20 s, …, at
/// most 5 min.
pub fn error_backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    ERROR_BACKOFF_FIRST
        .saturating_mul(1u32 << doublings)
        .min(ERROR_BACKOFF_MAX)
}

async fn reconcile_proxy(proxy: &SBProxy, ctx: &Context) -> Result<Outcome, Error> {
    let name = proxy.name_any();
    let ns = proxy
        .metadata
        .namespace
        .clone()
        .ok_or_else(|| Error::NoNamespace(name.clone()))?;
    if proxy.metadata.deletion_timestamp.is_some() {
        return Ok(Outcome::Deleting);
    }
    // A configRef that names nothing is refused by render (ConfigNotFound).
    let config = match proxy.spec.config_ref.name() {
        Ok(config_name) => Api::<SBProxyConfig>::namespaced(ctx.client.clone(), &ns)
            .get_opt(config_name)
            .await
            .map_err(Error::kube(
                "get",
                format!("SBProxyConfig {ns}/{config_name}"),
            ))?,
        Err(_) => None,
    };

    // The generated key lives in a Secret the operator owns only when the
    // user names none; a clusterSecretRef Secret is theirs and not read.
    // Read with clustering off too: a Secret kept from when it was on still
    // seals the store's records, and the pods keep it (render).
    let own_key = proxy.spec.clustering.cluster_secret_ref.is_none();
    let generated_key = proxy.spec.clustering.enabled && own_key;
    let existing_secret = if own_key {
        let secret_name = render::cluster_key_secret_name(proxy);
        Api::<Secret>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&secret_name)
            .await
            .map_err(Error::kube("get", format!("Secret {ns}/{secret_name}")))?
    } else {
        None
    };
    let opts = RenderOptions {
        sidecar_image: ctx.sidecar_image.clone(),
        // Randomness only when a Secret may be created from it.
        fresh_cluster_key: if generated_key && existing_secret.is_none() {
            render::fresh_cluster_key()
        } else {
            String::new()
        },
    };
    let requested = proxy.annotations().get(rotation::ROTATE_ANNOTATION);
    if requested.is_some() && proxy.spec.clustering.cluster_secret_ref.is_some() {
        publish(
            proxy,
            ctx,
            EventType::Warning,
            "ClusterKeyNotRotated",
            "Rotate",
            format!(
                "{} is set, but spec.clustering.clusterSecretRef names a Secret of yours: \
                 the operator never writes it. Rotate it yourself (new key first, then drop the \
                 old one), or remove clusterSecretRef to let the operator own the key.",
                rotation::ROTATE_ANNOTATION
            ),
        )
        .await;
    }
    let grace = Duration::from_secs(
        u64::try_from(proxy.spec.clustering.key_rotation_grace_seconds).unwrap_or(1),
    );
    let key = match &existing_secret {
        // Clustering off: the key is kept as it is, not rotated.
        Some(_) if !generated_key => KeyState::None,
        Some(secret) => match rotation::plan(
            requested.map(String::as_str),
            secret,
            grace,
            Timestamp::now(),
            &render::fresh_cluster_key,
        ) {
            Ok(plan) => KeyState::Planned(plan),
            Err(message) => {
                warn!(proxy = %format!("{ns}/{name}"), %message, "cluster key left as it is");
                KeyState::Unknown
            }
        },
        None if generated_key => KeyState::Fresh(rotation::key_id(&opts.fresh_cluster_key)),
        None => KeyState::None,
    };
    match render::render(proxy, config.as_ref(), existing_secret.as_ref(), &opts) {
        Ok(rendered) => {
            let recheck = apply(proxy, &ns, ctx, rendered, key).await?;
            Ok(Outcome::Applied(recheck))
        }
        Err(refusal) => {
            refuse(proxy, &ns, ctx, &refusal).await?;
            Ok(Outcome::Refused)
        }
    }
}

/// A refusal changes no workload: status and a Warning Event only.
async fn refuse(proxy: &SBProxy, ns: &str, ctx: &Context, refusal: &Refusal) -> Result<(), Error> {
    let reason = refusal.reason.as_str();
    info!(proxy = %format!("{ns}/{}", proxy.name_any()), reason, message = %refusal.message, "refused");
    let old = proxy.status.clone().unwrap_or_default();
    let new = refused_status(proxy, refusal, Timestamp::now());
    if new != old {
        patch_status(proxy, ns, ctx, &new).await?;
    }
    publish(
        proxy,
        ctx,
        EventType::Warning,
        reason,
        "Refuse",
        refusal.message.clone(),
    )
    .await;
    Ok(())
}

/// The cluster key as this reconcile finds it.
enum KeyState {
    /// No operator-made Secret (no clustering, or `clusterSecretRef`).
    None,
    /// About to be created with a key of this id.
    Fresh(String),
    /// The Secret exists: what to do with it ([`rotation::plan`]).
    Planned(rotation::Plan),
    /// The Secret exists but does not parse: left alone, status kept.
    Unknown,
}

/// An object created, deleted or written, as the Normal Event that tells
/// of it: (reason, note).
type Change = (&'static str, String);

/// What applying the objects found: the facts the status is made of.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Observed {
    /// `status.replicas` of the StatefulSet as the apply answered it;
    /// `None` before the StatefulSet controller has written a status.
    replicas: Option<i32>,
    /// `status.readyReplicas` of that answer (absent: 0).
    ready_replicas: i32,
    /// Why the PodMonitor `spec.podMonitor` asks for is missing: the cluster
    /// does not serve its kind. Everything else was applied.
    pod_monitor_not_served: Option<String>,
}

/// Applies `rendered` (the API calls, in the order of the module doc), then
/// writes the status [`applied_status`] makes of what they answered, then
/// the Events; returns when to look again (a key rotation waiting, or a
/// PodMonitor kind the cluster does not serve).
async fn apply(
    proxy: &SBProxy,
    ns: &str,
    ctx: &Context,
    rendered: Rendered,
    key: KeyState,
) -> Result<Option<Duration>, Error> {
    let old = proxy.status.clone().unwrap_or_default();
    let mut changes = Vec::new();
    let (cluster_key, mut recheck) =
        settle_cluster_key(proxy, ns, ctx, key, &old, &mut changes).await?;
    if let Some(secret) = &rendered.cluster_key_secret {
        changes.extend(create_cluster_key_secret(ctx, ns, secret).await?);
    }
    let observed = apply_objects(proxy, ns, ctx, &rendered, &mut changes).await?;
    if observed.pod_monitor_not_served.is_some() {
        recheck = Some(recheck.map_or(REQUEUE_REFUSED, |r| r.min(REQUEUE_REFUSED)));
    }

    let new = applied_status(
        proxy,
        &rendered.config_hash,
        cluster_key,
        &observed,
        Timestamp::now(),
    );
    // Objects change when the spec or the config does; a requeue or a pod
    // turning ready changes none, and publishes no Event.
    let spec_changed =
        old.observed_generation != new.observed_generation || old.config_hash != new.config_hash;
    if new != old {
        patch_status(proxy, ns, ctx, &new).await?;
    }
    announce(proxy, ns, ctx, &rendered, changes, spec_changed, observed).await;
    Ok(recheck)
}

/// Carries out the cluster key's plan: writes the Secret when a rotation
/// moves (its Event into `changes`). Returns the status's `clusterKey` and
/// when the rotation wants to be looked at again.
async fn settle_cluster_key(
    proxy: &SBProxy,
    ns: &str,
    ctx: &Context,
    key: KeyState,
    old: &SBProxyStatus,
    changes: &mut Vec<Change>,
) -> Result<(Option<ClusterKeyStatus>, Option<Duration>), Error> {
    Ok(match key {
        KeyState::None => (None, None),
        KeyState::Fresh(key_id) => (
            Some(ClusterKeyStatus {
                key_id,
                phase: rotation::STABLE.to_string(),
                rotated_at: None,
            }),
            None,
        ),
        KeyState::Unknown => (old.cluster_key.clone(), None),
        KeyState::Planned(plan) => {
            if let Some(write) = &plan.write {
                write_cluster_key(proxy, ns, ctx, write).await?;
                changes.push((write.reason, write.note.clone()));
                let ids = rotation::ring_ids(&write.ring);
                nudge_pods(ctx, ns, &proxy.name_any(), CLUSTER_KEY_IDS_ANNOTATION, &ids).await;
            }
            (Some(plan.status), plan.recheck_in)
        }
    })
}

/// POSTs the rendered cluster-key Secret; the Event when it was created.
async fn create_cluster_key_secret(
    ctx: &Context,
    ns: &str,
    secret: &Secret,
) -> Result<Option<Change>, Error> {
    let secret_name = secret.name_any();
    // POST, never PUT/PATCH: an existing key (made by a concurrent
    // reconcile or by hand) is kept, whatever it holds.
    match Api::<Secret>::namespaced(ctx.client.clone(), ns)
        .create(&PostParams::default(), secret)
        .await
    {
        Ok(_) => Ok(Some((
            "ClusterKeyCreated",
            format!("created Secret {secret_name} with a fresh cluster key"),
        ))),
        Err(kube::Error::Api(s)) if s.is_already_exists() => {
            debug!(secret = %secret_name, "cluster-key Secret already exists; kept");
            Ok(None)
        }
        Err(e) => Err(Error::kube("create", format!("Secret {ns}/{secret_name}"))(
            e,
        )),
    }
}

/// Server-side applies the workload objects, then each optional one or the
/// removal of what this operator made of it before (their Events into
/// `changes`); returns what the StatefulSet's answer and the PodMonitor's
/// apply said.
async fn apply_objects(
    proxy: &SBProxy,
    ns: &str,
    ctx: &Context,
    rendered: &Rendered,
    changes: &mut Vec<Change>,
) -> Result<Observed, Error> {
    let name = proxy.name_any();
    let client = &ctx.client;
    let sts = server_side_apply(client, ns, &rendered.stateful_set).await?;
    server_side_apply(client, ns, &rendered.headless_service).await?;
    server_side_apply(client, ns, &rendered.service).await?;
    server_side_apply(client, ns, &rendered.config_map).await?;
    // Only for a config the status does not show yet: a reconcile for a
    // pod turning ready, a scale or a periodic check lists no pods (a pod
    // started since read the ConfigMap at its start).
    let shown = proxy.status.as_ref().and_then(|s| s.config_hash.as_deref());
    if shown != Some(rendered.config_hash.as_str()) {
        nudge_pods(
            ctx,
            ns,
            &name,
            CONFIG_HASH_ANNOTATION,
            &rendered.config_hash,
        )
        .await;
    }
    // An optional object the spec no longer asks for is removed when this
    // operator made it, so what runs is what `render` shows.
    changes.extend(
        apply_or_remove(
            proxy,
            ns,
            ctx,
            rendered.pdb.as_ref(),
            &format!("{name}-pdb"),
            // docs/reference.md#objects-the-operator-applies: a PDB only when replicas > 1.
            ("PodDisruptionBudgetDeleted", "one replica needs none"),
        )
        .await?,
    );
    changes.extend(
        apply_or_remove(
            proxy,
            ns,
            ctx,
            rendered.network_policy.as_ref(),
            &render::mesh_name(&name),
            ("NetworkPolicyDeleted", "spec.networkPolicy is off"),
        )
        .await?,
    );
    let monitor = apply_or_remove(
        proxy,
        ns,
        ctx,
        rendered.pod_monitor.as_ref(),
        &name,
        ("PodMonitorDeleted", "spec.podMonitor is off"),
    )
    .await;
    let pod_monitor_not_served = match monitor {
        Ok(deleted) => {
            changes.extend(deleted);
            None
        }
        // An apply creates a missing object: a 404 is the kind itself.
        Err(Error::Kube {
            verb: "apply",
            source: kube::Error::Api(status),
            ..
        }) if not_found(&status) => Some(format!(
            "spec.podMonitor is true, but this cluster does not serve \
             monitoring.coreos.com/v1 PodMonitor (applying PodMonitor {ns}/{name} \
             answered 404). Install prometheus-operator (its CRDs), or set \
             spec.podMonitor to false; everything else is applied."
        )),
        Err(e) => return Err(e),
    };
    let sts_status = sts.status.as_ref();
    Ok(Observed {
        replicas: sts_status.map(|s| s.replicas),
        ready_replicas: sts_status.and_then(|s| s.ready_replicas).unwrap_or(0),
        pod_monitor_not_served,
    })
}

/// Annotation on each pod of an SBProxy: the hash (`sha256:<hex>`) of the
/// config the operator last wrote to its ConfigMap and told the pod about.
pub const CONFIG_HASH_ANNOTATION: &str = "sbproxy.dev/config-hash";
/// Annotation on each pod of an SBProxy: the key ids (`<id>[,<id>]`,
/// primary first) of the ring the operator last wrote to its cluster-key
/// Secret and told the pod about.
pub const CLUSTER_KEY_IDS_ANNOTATION: &str = "sbproxy.dev/cluster-key-ids";

/// Makes a config edit (or a cluster-key write) reach every pod within
/// about a second.
///
/// The kubelet writes a ConfigMap or Secret volume's new content only when
/// it syncs the pod: at its periodic sync (every 60-90 s), or at once when
/// the pod object changes. So after writing the ConfigMap the operator
/// annotates each pod of the SBProxy with the config's hash
/// ([`CONFIG_HASH_ANNOTATION`]), and after writing the cluster-key Secret
/// with the ring's key ids ([`CLUSTER_KEY_IDS_ANNOTATION`]): a metadata
/// change, nothing restarts, and each kubelet rewrites the volume from its
/// cache, which a watch keeps current. The kubelet writes a volume
/// atomically (a `..data` symlink swap), and its cache only moves forward,
/// so a pod never goes back to an older config or key ring.
///
/// Best effort: a pod whose patch fails (RBAC of an older install, the API
/// server busy) still gets the file at the kubelet's next sync; the
/// failure is logged and counted (`sbmesh_operator_config_nudges_total`),
/// and the reconcile goes on. A pod already annotated with this value is
/// left alone. Called only when the ConfigMap's config is not the one
/// `status.configHash` shows, or the Secret was just written, so a
/// reconcile without a change makes no call at all.
async fn nudge_pods(ctx: &Context, ns: &str, name: &str, annotation: &str, value: &str) {
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns);
    let selector = render::selector_labels(name)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let list = match pods
        .list_metadata(&kube::api::ListParams::default().labels(&selector))
        .await
    {
        Ok(list) => list,
        Err(e) => {
            ctx.metrics.nudged(NudgeResult::failed);
            warn!(proxy = %format!("{ns}/{name}"), %annotation, error = %e, "cannot list the pods to tell them of the new file; they read it at the kubelet's next sync (up to 90 s)");
            return;
        }
    };
    for pod in list.items {
        if let Err(e) = tell_pod(ctx, &pods, &pod.metadata, annotation, value).await {
            ctx.metrics.nudged(NudgeResult::failed);
            warn!(pod = %format!("{ns}/{}", pod.name_any()), %annotation, error = %e, "cannot tell the pod of the new file; it reads it at the kubelet's next sync (up to 90 s)");
        }
    }
}

/// Tells one pod of a config: merge-patches its annotation `key` to
/// `value`, a metadata change that makes its kubelet sync the pod, and its
/// ConfigMap volume, at once. Nothing to do for a pod that carries the
/// value already or is being deleted; a pod gone meanwhile is no error
/// (its replacement reads the ConfigMap at start). Each patch is counted
/// (`sbmesh_operator_config_nudges_total{result="patched"}`); the caller
/// counts and reports a failure.
pub(crate) async fn tell_pod(
    ctx: &Context,
    pods: &Api<Pod>,
    pod: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    key: &str,
    value: &str,
) -> Result<(), kube::Error> {
    let current = pod.annotations.as_ref().and_then(|a| a.get(key));
    if pod.deletion_timestamp.is_some() || current.map(String::as_str) == Some(value) {
        return Ok(());
    }
    let name = pod.name.as_deref().unwrap_or_default();
    let patch = json!({ "metadata": { "annotations": { key: value } } });
    match pods
        .patch_metadata(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            ctx.metrics.nudged(NudgeResult::patched);
            debug!(pod = %name, annotation = %key, %value, "pod told of its config");
            Ok(())
        }
        Err(kube::Error::Api(status)) if not_found(&status) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The status of an applied SBProxy, made of what its apply observed (no
/// API call): `Ready` when every desired replica is ready, `Degraded` when
/// the cluster does not serve the PodMonitor kind, the config hash and
/// replica counts of what runs. A condition's `lastTransitionTime` stays
/// that of `proxy`'s status while its status does not change, else `now`.
fn applied_status(
    proxy: &SBProxy,
    config_hash: &str,
    cluster_key: Option<ClusterKeyStatus>,
    observed: &Observed,
    now: Timestamp,
) -> SBProxyStatus {
    let old = proxy.status.as_ref().map_or(&[][..], |s| &s.conditions[..]);
    let generation = proxy.metadata.generation;
    let desired = proxy.spec.replicas;
    let ready = observed.ready_replicas;
    let all_ready = ready == desired && observed.replicas == Some(desired);
    let ready_reason = if all_ready {
        "AllReplicasReady"
    } else {
        "ReplicasNotReady"
    };
    let ready_message = format!("{ready}/{desired} replicas ready");
    let degraded = match &observed.pod_monitor_not_served {
        Some(message) => (true, POD_MONITOR_NOT_SERVED, message.as_str()),
        None => (false, "Reconciled", "the spec is applied"),
    };
    SBProxyStatus {
        observed_generation: generation,
        config_hash: Some(config_hash.to_owned()),
        replicas: Some(observed.replicas.unwrap_or(0)),
        ready_replicas: Some(ready),
        last_error: observed.pod_monitor_not_served.clone(),
        conditions: vec![
            condition(
                old,
                READY,
                all_ready,
                ready_reason,
                &ready_message,
                generation,
                now,
            ),
            condition(
                old, DEGRADED, degraded.0, degraded.1, degraded.2, generation, now,
            ),
        ],
        cluster_key,
    }
}

/// The status of a refused SBProxy: `Ready` False and `Degraded` True with
/// the refusal's reason and message, which is also `lastError`. The last
/// applied configHash and replica counts stay: they still describe what
/// runs.
fn refused_status(proxy: &SBProxy, refusal: &Refusal, now: Timestamp) -> SBProxyStatus {
    let old = proxy.status.clone().unwrap_or_default();
    let generation = proxy.metadata.generation;
    let reason = refusal.reason.as_str();
    let message = &refusal.message;
    let conditions = vec![
        condition(
            &old.conditions,
            READY,
            false,
            reason,
            message,
            generation,
            now,
        ),
        condition(
            &old.conditions,
            DEGRADED,
            true,
            reason,
            message,
            generation,
            now,
        ),
    ];
    SBProxyStatus {
        observed_generation: generation,
        last_error: Some(message.clone()),
        conditions,
        ..old
    }
}

/// The Events and logs of an apply: one Normal Event per created or deleted
/// object, `Applied` when the spec or config changed, and a Warning while
/// the cluster does not serve the PodMonitor kind.
async fn announce(
    proxy: &SBProxy,
    ns: &str,
    ctx: &Context,
    rendered: &Rendered,
    changes: Vec<Change>,
    spec_changed: bool,
    observed: Observed,
) {
    let name = proxy.name_any();
    let not_served = observed.pod_monitor_not_served;
    // One reason per kind of change: the Recorder folds repeats of a
    // reason into a series that keeps the first note, so a note must not
    // carry what varies between repeats (hashes, replica counts).
    for (reason, note) in changes {
        info!(proxy = %format!("{ns}/{name}"), reason, %note, "object created or deleted");
        publish(proxy, ctx, EventType::Normal, reason, "Apply", note).await;
    }
    if spec_changed {
        info!(
            proxy = %format!("{ns}/{name}"),
            generation = ?proxy.metadata.generation,
            config_hash = %rendered.config_hash,
            replicas = proxy.spec.replicas,
            "applied"
        );
        let note = applied_note(rendered, not_served.is_none());
        publish(proxy, ctx, EventType::Normal, "Applied", "Apply", note).await;
    }
    if let Some(message) = not_served {
        warn!(proxy = %format!("{ns}/{name}"), %message, "PodMonitor not applied");
        publish(
            proxy,
            ctx,
            EventType::Warning,
            POD_MONITOR_NOT_SERVED,
            "Apply",
            message,
        )
        .await;
    }
}

/// The note of the `Applied` Event: every object applied, by name.
fn applied_note(rendered: &Rendered, pod_monitor_applied: bool) -> String {
    let mut note = format!(
        "applied StatefulSet {}, Services {} and {}, ConfigMap {}",
        rendered.stateful_set.name_any(),
        rendered.headless_service.name_any(),
        rendered.service.name_any(),
        rendered.config_map.name_any(),
    );
    if let Some(pdb) = &rendered.pdb {
        note.push_str(&format!(", PodDisruptionBudget {}", pdb.name_any()));
    }
    if let Some(policy) = &rendered.network_policy {
        note.push_str(&format!(", NetworkPolicy {}", policy.name_any()));
    }
    if let Some(monitor) = rendered
        .pod_monitor
        .as_ref()
        .filter(|_| pod_monitor_applied)
    {
        note.push_str(&format!(", PodMonitor {}", monitor.name_any()));
    }
    note
}

/// A merge patch of the operator's cluster-key Secret: the ring and the
/// rotation marks in one write.
async fn write_cluster_key(
    proxy: &SBProxy,
    ns: &str,
    ctx: &Context,
    write: &rotation::Write,
) -> Result<(), Error> {
    let secret_name = render::cluster_key_secret_name(proxy);
    let mut patch = json!({
        "data": { render::CLUSTER_KEY_KEY: ByteString(write.ring.as_bytes().to_vec()) },
    });
    if !write.annotations.is_empty() {
        patch["metadata"] = json!({ "annotations": write.annotations });
    }
    Api::<Secret>::namespaced(ctx.client.clone(), ns)
        .patch(&secret_name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(Error::kube("patch", format!("Secret {ns}/{secret_name}")))?;
    info!(secret = %format!("{ns}/{secret_name}"), reason = write.reason, note = %write.note, "cluster key written");
    Ok(())
}

/// A namespaced kind with a static type, as the calls below read and
/// write it.
trait Namespaced:
    Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType: Default>
    + Clone
    + Debug
    + Serialize
    + DeserializeOwned
{
}

impl<K> Namespaced for K where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType: Default>
        + Clone
        + Debug
        + Serialize
        + DeserializeOwned
{
}

async fn server_side_apply<K>(client: &Client, ns: &str, obj: &K) -> Result<K, Error>
where
    K: Namespaced,
{
    let name = obj.name_any();
    let what = || format!("{} {ns}/{name}", K::kind(&K::DynamicType::default()));
    Api::<K>::namespaced(client.clone(), ns)
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(obj),
        )
        .await
        .map_err(|source| Error::Kube {
            verb: "apply",
            what: what(),
            source,
        })
}

/// Applies `object` when the spec asks for it (`Some`), else deletes the
/// `K` called `name` that this operator made before; returns the Event of
/// a deletion, as (`reason`, a note ending with `why`).
async fn apply_or_remove<K>(
    proxy: &SBProxy,
    ns: &str,
    ctx: &Context,
    object: Option<&K>,
    name: &str,
    (reason, why): (&'static str, &str),
) -> Result<Option<(&'static str, String)>, Error>
where
    K: Namespaced,
{
    if let Some(object) = object {
        server_side_apply(&ctx.client, ns, object).await?;
        return Ok(None);
    }
    let deleted = delete_stale::<K>(proxy, ns, ctx, name).await?;
    Ok(deleted.then(|| {
        let kind = K::kind(&K::DynamicType::default()).into_owned();
        (reason, format!("deleted {kind} {name}: {why}"))
    }))
}

/// Deletes the `K` called `name` when it exists and is this operator's for
/// `proxy` (its managed-by and instance labels); true when it was deleted.
/// Only its metadata is read: an object edited by hand (or a PodMonitor of
/// a newer prometheus-operator) need not match the fields the operator
/// writes. A kind the cluster does not serve answers 404 like a missing
/// object.
async fn delete_stale<K>(
    proxy: &SBProxy,
    ns: &str,
    ctx: &Context,
    name: &str,
) -> Result<bool, Error>
where
    K: Namespaced,
{
    let what = format!("{} {ns}/{name}", K::kind(&K::DynamicType::default()));
    let api = Api::<K>::namespaced(ctx.client.clone(), ns);
    let existing = match api.get_metadata(name).await {
        Ok(existing) => existing,
        Err(kube::Error::Api(s)) if not_found(&s) => return Ok(false),
        Err(e) => return Err(Error::kube("get", what)(e)),
    };
    let labels = existing.labels();
    let ours = labels
        .get("app.kubernetes.io/managed-by")
        .map(String::as_str)
        == Some(FIELD_MANAGER)
        && labels.get("app.kubernetes.io/instance") == Some(&proxy.name_any());
    if !ours {
        debug!(object = %what, "not made by this operator; left alone");
        return Ok(false);
    }
    // The uid precondition: never delete an object recreated since the GET.
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: existing.uid(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if not_found(&s) || s.is_conflict() => Ok(false),
        Err(e) => Err(Error::kube("delete", what)(e)),
    }
}

/// A missing object, or a kind the cluster does not serve: the apiserver
/// answers the latter with a plain-text `404 page not found`, which kube
/// reads as a `Status` whose reason is not `NotFound`, so the code decides.
fn not_found(status: &kube::core::Status) -> bool {
    status.is_not_found() || status.code == 404
}

/// `existing`'s condition of `type_` updated; `lastTransitionTime` moves
/// (to `now`) only when the status does.
fn condition(
    existing: &[Condition],
    type_: &str,
    status: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
    now: Timestamp,
) -> Condition {
    let status = if status { "True" } else { "False" };
    let last_transition_time = existing
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Condition {
        type_: type_.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message: message.to_owned(),
        observed_generation: generation,
        last_transition_time,
    }
}

/// Merge patch of the status subresource. Explicit nulls clear fields the
/// new status no longer has (`lastError` after a fixed refusal).
async fn patch_status(
    proxy: &SBProxy,
    ns: &str,
    ctx: &Context,
    status: &SBProxyStatus,
) -> Result<(), Error> {
    let name = proxy.name_any();
    let body = json!({ "status": status_patch(status) });
    Api::<SBProxy>::namespaced(ctx.client.clone(), ns)
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&body))
        .await
        .map_err(Error::kube(
            "patch status of",
            format!("SBProxy {ns}/{name}"),
        ))?;
    Ok(())
}

fn status_patch(status: &SBProxyStatus) -> Value {
    let mut map = match serde_json::to_value(status) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    };
    for key in [
        "observedGeneration",
        "configHash",
        "replicas",
        "readyReplicas",
        "lastError",
        "clusterKey",
    ] {
        map.entry(key).or_insert(Value::Null);
    }
    Value::Object(map)
}

/// Best effort: an API error is written to `status.lastError` so `kubectl
/// get -o yaml` shows why nothing changes. The error policy retries anyway.
async fn record_error(proxy: &SBProxy, ctx: &Context, error: &Error) {
    let Some(ns) = proxy.metadata.namespace.as_deref() else {
        return;
    };
    let message = error.to_string();
    if proxy.status.as_ref().and_then(|s| s.last_error.as_deref()) == Some(message.as_str()) {
        return;
    }
    let body = json!({ "status": { "lastError": message } });
    if let Err(e) = Api::<SBProxy>::namespaced(ctx.client.clone(), ns)
        .patch_status(
            &proxy.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&body),
        )
        .await
    {
        debug!(error = %e, "could not record the error in status.lastError");
    }
}

/// Publishes an Event about `proxy`. Events are advisory: a failure is
/// logged, never fails the reconcile.
async fn publish(
    proxy: &SBProxy,
    ctx: &Context,
    type_: EventType,
    reason: &str,
    action: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(truncate(note, EVENT_NOTE_MAX)),
        action: action.to_owned(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &proxy.object_ref(&())).await {
        warn!(error = %e, reason, "could not publish an Event");
    }
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max.saturating_sub(3);
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_five_minutes() {
        assert_eq!(error_backoff(1), Duration::from_secs(5));
        assert_eq!(error_backoff(2), Duration::from_secs(10));
        assert_eq!(error_backoff(3), Duration::from_secs(20));
        assert_eq!(error_backoff(7), Duration::from_secs(300));
        assert_eq!(error_backoff(u32::MAX), Duration::from_secs(300));
        assert_eq!(error_backoff(0), Duration::from_secs(5));
    }

    #[test]
    fn transition_time_moves_only_with_the_status() {
        let then = Time(Timestamp::UNIX_EPOCH);
        let old = vec![Condition {
            type_: READY.into(),
            status: "False".into(),
            reason: "ReplicasNotReady".into(),
            message: "0/3 replicas ready".into(),
            observed_generation: Some(1),
            last_transition_time: then.clone(),
        }];
        let same = condition(
            &old,
            READY,
            false,
            "ReplicasNotReady",
            "1/3 replicas ready",
            Some(2),
            Timestamp::now(),
        );
        assert_eq!(same.last_transition_time, then);
        assert_eq!(same.message, "1/3 replicas ready");
        let flipped = condition(
            &old,
            READY,
            true,
            "AllReplicasReady",
            "3/3 replicas ready",
            Some(2),
            Timestamp::now(),
        );
        assert_ne!(flipped.last_transition_time, then);
    }

    /// An SBProxy of `replicas` at generation 2, with `status` as last written.
    fn proxy(replicas: i32, status: Value) -> SBProxy {
        let mut proxy = json!({
            "apiVersion": "sbproxy.dev/v1alpha1",
            "kind": "SBProxy",
            "metadata": { "name": "demo", "namespace": "default", "generation": 2 },
            "spec": {
                "image": "ghcr.io/sbproxy/sbproxy:0.9.0",
                "configRef": { "name": "demo-sbyml" },
                "replicas": replicas,
            },
        });
        if !status.is_null() {
            proxy["status"] = status;
        }
        serde_json::from_value(proxy).expect("an SBProxy")
    }

    fn observed(replicas: Option<i32>, ready: i32) -> Observed {
        Observed {
            replicas,
            ready_replicas: ready,
            pod_monitor_not_served: None,
        }
    }

    /// (type, status, reason, message) of each condition, as `kubectl get
    /// -o yaml` lists them.
    fn conditions(status: &SBProxyStatus) -> Vec<(&str, &str, &str, &str)> {
        status
            .conditions
            .iter()
            .map(|c| {
                assert_eq!(c.observed_generation, Some(2));
                (
                    c.type_.as_str(),
                    c.status.as_str(),
                    c.reason.as_str(),
                    c.message.as_str(),
                )
            })
            .collect()
    }

    #[test]
    fn applied_and_every_replica_ready_is_ready_and_not_degraded() {
        let p = proxy(3, Value::Null);
        let status = applied_status(
            &p,
            "sha256:ab",
            None,
            &observed(Some(3), 3),
            Timestamp::now(),
        );
        assert_eq!(
            conditions(&status),
            [
                ("Ready", "True", "AllReplicasReady", "3/3 replicas ready"),
                ("Degraded", "False", "Reconciled", "the spec is applied"),
            ]
        );
        assert_eq!(status.observed_generation, Some(2));
        assert_eq!(status.config_hash.as_deref(), Some("sha256:ab"));
        assert_eq!((status.replicas, status.ready_replicas), (Some(3), Some(3)));
        assert_eq!(status.last_error, None);
    }

    #[test]
    fn applied_but_not_all_ready_is_not_ready() {
        let p = proxy(3, Value::Null);
        let now = Timestamp::now();
        // The StatefulSet controller has not written a status yet.
        let fresh = applied_status(&p, "sha256:ab", None, &observed(None, 0), now);
        assert_eq!(
            conditions(&fresh)[0],
            ("Ready", "False", "ReplicasNotReady", "0/3 replicas ready")
        );
        assert_eq!((fresh.replicas, fresh.ready_replicas), (Some(0), Some(0)));
        // Scaling up: every pod that exists is ready, but not every one wanted.
        let scaling = applied_status(&p, "sha256:ab", None, &observed(Some(2), 3), now);
        assert_eq!(
            conditions(&scaling)[0],
            ("Ready", "False", "ReplicasNotReady", "3/3 replicas ready")
        );
    }

    #[test]
    fn a_pod_monitor_not_served_degrades_and_says_why() {
        let p = proxy(1, Value::Null);
        let seen = Observed {
            pod_monitor_not_served: Some("install prometheus-operator".into()),
            ..observed(Some(1), 1)
        };
        let status = applied_status(&p, "sha256:ab", None, &seen, Timestamp::now());
        assert_eq!(
            conditions(&status),
            [
                ("Ready", "True", "AllReplicasReady", "1/1 replicas ready"),
                (
                    "Degraded",
                    "True",
                    POD_MONITOR_NOT_SERVED,
                    "install prometheus-operator"
                ),
            ]
        );
        assert_eq!(
            status.last_error.as_deref(),
            Some("install prometheus-operator")
        );
    }

    #[test]
    fn applied_after_a_refusal_clears_last_error_and_keeps_the_cluster_key() {
        let then = "2026-01-01T00:00:00Z";
        let p = proxy(
            1,
            json!({
                "lastError": "refused",
                "conditions": [
                    { "type": "Ready", "status": "True", "reason": "AllReplicasReady",
                      "message": "1/1 replicas ready", "lastTransitionTime": then },
                    { "type": "Degraded", "status": "True", "reason": "ConfigInvalid",
                      "message": "refused", "lastTransitionTime": then },
                ],
            }),
        );
        let key = ClusterKeyStatus {
            key_id: "0123abcd".into(),
            phase: rotation::STABLE.into(),
            rotated_at: None,
        };
        let now = Timestamp::now();
        let status = applied_status(
            &p,
            "sha256:ab",
            Some(key.clone()),
            &observed(Some(1), 1),
            now,
        );
        assert_eq!(status.last_error, None);
        assert_eq!(status.cluster_key, Some(key));
        let times: Vec<String> = status
            .conditions
            .iter()
            .map(|c| c.last_transition_time.0.to_string())
            .collect();
        // Ready stayed True; Degraded turned False now.
        assert_eq!(times, [then.to_string(), now.to_string()]);
    }

    #[test]
    fn a_refusal_is_not_ready_and_degraded_and_keeps_what_runs() {
        let p = proxy(
            3,
            json!({ "configHash": "sha256:old", "replicas": 3, "readyReplicas": 3 }),
        );
        let refusal = Refusal {
            reason: render::RefusalReason::ConfigInvalid,
            message: "spec.config is not a valid sb.yml".into(),
        };
        let status = refused_status(&p, &refusal, Timestamp::now());
        assert_eq!(
            conditions(&status),
            [
                (
                    "Ready",
                    "False",
                    "ConfigInvalid",
                    "spec.config is not a valid sb.yml"
                ),
                (
                    "Degraded",
                    "True",
                    "ConfigInvalid",
                    "spec.config is not a valid sb.yml"
                ),
            ]
        );
        assert_eq!(
            status.last_error.as_deref(),
            Some("spec.config is not a valid sb.yml")
        );
        assert_eq!(status.observed_generation, Some(2));
        assert_eq!(status.config_hash.as_deref(), Some("sha256:old"));
        assert_eq!((status.replicas, status.ready_replicas), (Some(3), Some(3)));
    }

    #[test]
    fn status_patch_clears_absent_fields() {
        let p = status_patch(&SBProxyStatus::default());
        assert_eq!(p["lastError"], Value::Null);
        assert!(p.as_object().is_some_and(|m| m.contains_key("lastError")));
        assert_eq!(p["conditions"], json!([]));
    }

    #[test]
    fn truncate_keeps_char_boundaries() {
        let s = "é".repeat(600);
        let t = truncate(s, EVENT_NOTE_MAX);
        assert!(t.len() <= EVENT_NOTE_MAX);
        assert!(t.ends_with("..."));
        assert_eq!(truncate("short".into(), 10), "short");
    }
}
