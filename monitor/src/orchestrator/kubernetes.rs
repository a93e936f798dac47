//! The `kubernetes` orchestrator: KNs are the pods of one StatefulSet, scaled through the
//! Kubernetes API (kube-rs), and a `coordination.k8s.io/v1` Lease elects the one monitor that
//! may act.
//!
//! It owns the mapping between KN ids and pods, the scaling requests, the reading of pod status
//! and, through its `lease` module, the Lease. It owns no KN state: the KNs register with the
//! DPM themselves, and the monitor publishes the cluster map.
//!
//! Conventions and invariants:
//! - **KN id = pod ordinal + 1.** Pod `{statefulset}-0` is KN 1, `{statefulset}-{i}` is KN
//!   `i + 1` (KN id 0 is never used). The chart derives each KN container's id from its pod
//!   ordinal the same way; this backend only relies on the convention. Ordinals start at 0
//!   (`spec.ordinals.start` must stay unset).
//! - The endpoint of KN `i` is the pod's stable DNS name through the headless service:
//!   `{statefulset}-{i-1}.{service}.{namespace}.svc:{kn_port}`.
//! - A StatefulSet grows by its next ordinal and shrinks from its highest, so `add_kn` always
//!   adds KN `replicas + 1` and `remove_kn` removes only KN `replicas`; every other removal is
//!   refused and [`Orchestrator::removal_choice`] always picks the highest id (any KN may go,
//!   since no data moves).
//! - Every change of `spec.replicas` is a merge patch that carries the `resourceVersion` just
//!   read, so it fails (409) instead of scaling twice when someone else changed the
//!   StatefulSet in between.
//! - `add_kn` returns once the new pod is Ready. The chart's readiness probe checks the
//!   KvService, which a KN serves only after it registered with the DPM, so Ready means
//!   "registered and serving" (the trait's invariant). If the pod is not Ready within
//!   `ready_timeout_ms`, the scale-up is rolled back so no half-started KN is left behind.
//! - A restarted pod keeps its ordinal and so its KN id: it is a new incarnation of the same
//!   KN, which the DPM fences by KN id and epoch.
//! - **Leadership** belongs to the `lease` module (`kubernetes/lease.rs`): a monitor acts only
//!   while it holds the Lease, and every write of the Lease carries the `resourceVersion` it
//!   read; its docs give the timing, the Lease's fields, the leader's note and the invariants.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use dinomo_placement::{KnId, KnInfo};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client};
use serde::Deserialize;
use serde_json::json;

use super::{Orchestrator, OrchestratorError, Result};
use lease::LeaderLease;

mod lease;
#[cfg(test)]
mod test_support;

pub use lease::LEADER_NOTE;

/// Where the KN StatefulSet lives and how this monitor identifies itself in the Lease.
///
/// Durations follow the project's config convention (`_secs` / `_ms` integer fields).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesConfig {
    /// Namespace of the StatefulSet, its pods and the Lease. Empty: the client's default
    /// namespace (in a pod, the pod's own namespace).
    pub namespace: String,
    /// Name of the KN StatefulSet; its pods are `{statefulset}-{ordinal}`.
    pub statefulset: String,
    /// Headless service that gives the KN pods their DNS names.
    pub service: String,
    /// Port of the KN's KvService.
    pub kn_port: u16,
    /// Name of the Lease that elects the active monitor.
    pub lease_name: String,
    /// This monitor's holder identity in the Lease. Empty: `$HOSTNAME` (the pod name in
    /// Kubernetes), or `monitor-{pid}` when that is unset.
    pub identity: String,
    /// How long a Lease stays valid after its last renewal.
    pub lease_duration_secs: u32,
    /// How long `add_kn` waits for the new pod to be Ready, and how long a started pod may
    /// stay not Ready before `failed_kns` reports it.
    pub ready_timeout_ms: u64,
    /// How long `remove_kn` waits for the removed pod to be gone (its grace period, during
    /// which the KN seals its logs, plus a margin).
    pub stop_timeout_ms: u64,
    /// How often pod status is polled while waiting.
    pub poll_interval_ms: u64,
}

impl Default for KubernetesConfig {
    fn default() -> Self {
        Self {
            namespace: String::new(),
            statefulset: "dinomo-kn".into(),
            service: "dinomo-kn".into(),
            kn_port: 7800,
            lease_name: "dinomo-monitor".into(),
            identity: String::new(),
            lease_duration_secs: 15,
            ready_timeout_ms: 120_000,
            stop_timeout_ms: 60_000,
            poll_interval_ms: 500,
        }
    }
}

/// Runs KNs as the pods of a StatefulSet. See the module docs for the conventions.
#[derive(Clone)]
pub struct KubernetesOrchestrator {
    config: KubernetesConfig,
    /// The namespace actually used (the config's, or the client's default).
    namespace: String,
    statefulsets: Api<StatefulSet>,
    pods: Api<Pod>,
    /// Wall clock for pod ages (the Lease has the same one for its times); a plain fn so tests
    /// can pin it.
    now: fn() -> Timestamp,
    /// The Lease that elects the one monitor that may act, and its leader's note.
    lease: LeaderLease,
}

impl std::fmt::Debug for KubernetesOrchestrator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The kube `Api`s carry a client whose Debug output says nothing useful.
        f.debug_struct("KubernetesOrchestrator")
            .field("namespace", &self.namespace)
            .field("identity", &self.lease.identity())
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KubernetesOrchestrator {
    /// An orchestrator that talks to the API server through `client`.
    pub fn new(client: Client, config: KubernetesConfig) -> Self {
        Self::with_clock(client, config, Timestamp::now)
    }

    /// [`KubernetesOrchestrator::new`] with the wall clock `now` (tests pin it).
    fn with_clock(client: Client, config: KubernetesConfig, now: fn() -> Timestamp) -> Self {
        let namespace = if config.namespace.is_empty() {
            client.default_namespace().to_string()
        } else {
            config.namespace.clone()
        };
        Self {
            statefulsets: Api::namespaced(client.clone(), &namespace),
            pods: Api::namespaced(client.clone(), &namespace),
            lease: LeaderLease::new(client, &namespace, &config, now),
            namespace,
            config,
            now,
        }
    }

    /// An orchestrator with a client configured from the environment: the in-cluster service
    /// account when running in a pod, else `$KUBECONFIG` / `~/.kube/config`.
    pub async fn from_env(config: KubernetesConfig) -> Result<Self> {
        let client = Client::try_default().await.map_err(|e| {
            OrchestratorError::Platform(format!("connecting to the Kubernetes API server: {e}"))
        })?;
        Ok(Self::new(client, config))
    }

    /// The namespace this orchestrator works in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The identity this monitor holds the Lease under.
    pub fn identity(&self) -> &str {
        self.lease.identity()
    }

    /// The pod that runs KN `kn` (`kn` >= 1; KN 0 does not exist, every caller checks).
    pub fn pod_name(&self, kn: KnId) -> String {
        debug_assert!(kn >= 1, "KN ids start at 1");
        format!("{}-{}", self.config.statefulset, kn - 1)
    }

    /// The KvService endpoint of KN `kn` (`kn` >= 1), by the pod's stable DNS name.
    pub fn endpoint(&self, kn: KnId) -> String {
        format!(
            "{}.{}.{}.svc:{}",
            self.pod_name(kn),
            self.config.service,
            self.namespace,
            self.config.kn_port
        )
    }

    /// The StatefulSet's replica count now: KNs 1..=replicas are its pods.
    pub async fn replicas(&self) -> Result<KnId> {
        Ok(self.read_statefulset("reading the KV StatefulSet").await?.0)
    }

    /// The KN id of a pod of our StatefulSet, from its name; `None` for any other pod.
    fn kn_of_pod(&self, pod_name: &str) -> Option<KnId> {
        let ordinal = pod_name
            .strip_prefix(self.config.statefulset.as_str())?
            .strip_prefix('-')?;
        // Reject "+1", "01" and the like, which parse but are not names the controller makes.
        if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        if ordinal.len() > 1 && ordinal.starts_with('0') {
            return None;
        }
        ordinal.parse::<KnId>().ok()?.checked_add(1)
    }

    fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.config.poll_interval_ms.max(1))
    }

    /// Reads the StatefulSet: its replica count (as KN count), its resourceVersion (for
    /// conditional patches) and the object itself.
    async fn read_statefulset(&self, doing: &str) -> Result<(KnId, String, StatefulSet)> {
        let sts = self
            .statefulsets
            .get(&self.config.statefulset)
            .await
            .map_err(|e| self.api_error(doing, "reading", e))?;
        let replicas = sts.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
        let replicas = KnId::try_from(replicas).map_err(|_| {
            OrchestratorError::Platform(format!(
                "{doing}: StatefulSet {}/{} has a negative replica count {replicas}",
                self.namespace, self.config.statefulset
            ))
        })?;
        let version = sts.metadata.resource_version.clone().unwrap_or_default();
        Ok((replicas, version, sts))
    }

    /// Sets `spec.replicas`, conditional on the StatefulSet still being at `version`.
    /// Returns the resourceVersion after the change.
    async fn set_replicas(&self, replicas: KnId, version: &str, doing: &str) -> Result<String> {
        // A merge patch that names metadata.resourceVersion is applied only if the object is
        // still at that version, so a concurrent change makes this fail instead of doubling it.
        let patch = json!({
            "metadata": { "resourceVersion": version },
            "spec": { "replicas": replicas },
        });
        let sts = self
            .statefulsets
            .patch(
                &self.config.statefulset,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
            .map_err(|e| self.api_error(doing, &format!("setting replicas to {replicas} of"), e))?;
        Ok(sts.metadata.resource_version.unwrap_or_default())
    }

    /// Turns a kube error into a Platform error that says what was being done.
    fn api_error(&self, doing: &str, action: &str, err: kube::Error) -> OrchestratorError {
        let what = format!(
            "{doing}: {action} StatefulSet {}/{}",
            self.namespace, self.config.statefulset
        );
        platform(&what, err)
    }

    /// Waits for the pod of KN `kn` to be Ready; errors out after `ready_timeout_ms`.
    async fn wait_ready(&self, kn: KnId) -> Result<()> {
        let name = self.pod_name(kn);
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(self.config.ready_timeout_ms);
        loop {
            // A transient API error while waiting is not a failed start: keep polling and
            // report the last thing seen if the deadline passes.
            let last = match self.pods.get_opt(&name).await {
                Ok(Some(pod)) if is_ready(&pod) => return Ok(()),
                Ok(Some(pod)) => format!("pod phase {}", phase(&pod).unwrap_or("unknown")),
                Ok(None) => "the pod does not exist yet".into(),
                Err(e) => format!("reading the pod failed: {}", describe(&e)),
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(OrchestratorError::Platform(format!(
                    "KN {kn} (pod {}/{name}) was not Ready within {} ms; last seen: {last}",
                    self.namespace, self.config.ready_timeout_ms
                )));
            }
            tokio::time::sleep(self.poll_interval()).await;
        }
    }

    /// Waits for the pod of KN `kn` to be gone (its KN stopped and sealed its logs).
    async fn wait_gone(&self, kn: KnId) -> Result<()> {
        let name = self.pod_name(kn);
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(self.config.stop_timeout_ms);
        loop {
            let last = match self.pods.get_opt(&name).await {
                Ok(None) => return Ok(()),
                Ok(Some(_)) => "the pod still exists".to_string(),
                Err(e) => format!("reading the pod failed: {}", describe(&e)),
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(OrchestratorError::Platform(format!(
                    "KN {kn} (pod {}/{name}) did not stop within {} ms; last seen: {last}",
                    self.namespace, self.config.stop_timeout_ms
                )));
            }
            tokio::time::sleep(self.poll_interval()).await;
        }
    }

    /// Whether a pod of a KN that should run counts as failed (see `failed_kns`).
    fn pod_failed(&self, pod: &Pod, now: Timestamp) -> bool {
        if pod.metadata.deletion_timestamp.is_some() {
            return true;
        }
        let Some(status) = &pod.status else {
            return false;
        };
        // Succeeded counts too: a KN that exits cleanly no longer serves.
        if matches!(status.phase.as_deref(), Some("Failed") | Some("Succeeded")) {
            return true;
        }
        let crashed = status.container_statuses.iter().flatten().any(|c| {
            c.state.as_ref().is_some_and(|s| {
                s.terminated.is_some()
                    || s.waiting
                        .as_ref()
                        .is_some_and(|w| w.reason.as_deref() == Some("CrashLoopBackOff"))
            })
        });
        if crashed {
            return true;
        }
        // Not Ready is normal while a pod starts; past ready_timeout it means the KN hangs or
        // lost its DPM (its readiness probe fails).
        let not_ready = ready_condition(pod) == Some(false);
        let started_long_ago = status.start_time.as_ref().is_some_and(|t| {
            now.duration_since(t.0)
                > SignedDuration::from_millis(
                    i64::try_from(self.config.ready_timeout_ms).unwrap_or(i64::MAX),
                )
        });
        not_ready && started_long_ago
    }
}

#[async_trait]
impl Orchestrator for KubernetesOrchestrator {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    async fn add_kn(&self) -> Result<KnInfo> {
        let (replicas, version, _) = self.read_statefulset("adding a KN").await?;
        let kn = replicas + 1;
        let version_after = self
            .set_replicas(kn, &version, &format!("adding KN {kn}"))
            .await?;
        if let Err(e) = self.wait_ready(kn).await {
            // Roll back so the next add_kn does not stack a new KN on a stuck one. Conditional
            // like every scale: if someone changed the StatefulSet meanwhile, leave it to them.
            return Err(
                match self
                    .set_replicas(replicas, &version_after, &format!("rolling back KN {kn}"))
                    .await
                {
                    Ok(_) => e,
                    Err(rollback) => OrchestratorError::Platform(format!("{e}; {rollback}")),
                },
            );
        }
        Ok(KnInfo {
            id: kn,
            endpoint: self.endpoint(kn),
        })
    }

    async fn remove_kn(&self, kn: KnId) -> Result<()> {
        if kn == 0 {
            return Err(OrchestratorError::UnknownKn(kn));
        }
        let doing = format!("removing KN {kn}");
        let (replicas, version, _) = self.read_statefulset(&doing).await?;
        if kn > replicas {
            return Err(OrchestratorError::UnknownKn(kn));
        }
        if kn < replicas {
            return Err(OrchestratorError::Refused(format!(
                "KN {kn} is pod {}, but a StatefulSet only shrinks from its highest ordinal \
                 ({}, KN {replicas}); remove KN {replicas} instead (any KN can go, no data moves)",
                self.pod_name(kn),
                self.pod_name(replicas),
            )));
        }
        self.set_replicas(replicas - 1, &version, &doing).await?;
        // The kubelet sends SIGTERM and the KN seals its logs within its grace period; the
        // trait promises a stopped KN, so wait for the pod to be gone.
        self.wait_gone(kn).await
    }

    async fn fail_kn(&self, kn: KnId) -> Result<()> {
        if kn == 0 {
            return Err(OrchestratorError::UnknownKn(kn));
        }
        let name = self.pod_name(kn);
        // Grace period 0: the containers are killed at once, as a crash would. The
        // StatefulSet controller then recreates the pod: a new incarnation of the same KN id.
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        };
        match self.pods.delete(&name, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.is_not_found() => Err(OrchestratorError::UnknownKn(kn)),
            Err(e) => Err(platform(
                &format!("failing KN {kn}: deleting pod {}/{name}", self.namespace),
                e,
            )),
        }
    }

    /// Reads the StatefulSet (replica count, and its `spec.selector.matchLabels` to list its
    /// pods; `matchExpressions` are not used, the pod-name check below makes up for it) and
    /// reports every KN `1..=replicas` whose pod is missing, being deleted, Failed or
    /// Succeeded, has a container terminated or in CrashLoopBackOff, or has been not Ready
    /// for longer than `ready_timeout_ms` since it started. Pods beyond the replica count are
    /// being scaled away and are not reported.
    async fn failed_kns(&self) -> Result<Vec<KnId>> {
        let doing = "reading KN failures";
        let (replicas, _, sts) = self.read_statefulset(doing).await?;
        let labels: BTreeMap<String, String> = sts
            .spec
            .and_then(|s| s.selector.match_labels)
            .unwrap_or_default();
        if labels.is_empty() {
            // Listing without a selector would read every pod in the namespace.
            return Err(OrchestratorError::Platform(format!(
                "{doing}: StatefulSet {}/{} has no spec.selector.matchLabels",
                self.namespace, self.config.statefulset
            )));
        }
        let selector = labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let pods = self
            .pods
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| {
                platform(
                    &format!("{doing}: listing pods {selector} in {}", self.namespace),
                    e,
                )
            })?;
        let now = (self.now)();
        let mut pods_by_kn: BTreeMap<KnId, &Pod> = BTreeMap::new();
        for pod in &pods.items {
            if let Some(kn) = pod.metadata.name.as_deref().and_then(|n| self.kn_of_pod(n)) {
                pods_by_kn.insert(kn, pod);
            }
        }
        Ok((1..=replicas)
            .filter(|kn| match pods_by_kn.get(kn) {
                None => true,
                Some(pod) => self.pod_failed(pod, now),
            })
            .collect())
    }

    /// The candidate with the highest id: only the highest ordinal can be removed from a
    /// StatefulSet, and since no data moves any KN may go. Once the highest KNs are removed,
    /// the highest candidate is the highest running KN; if it is not (a higher KN is busy),
    /// `remove_kn` refuses and the monitor retries next epoch.
    fn removal_choice(&self, candidates: &[KnId]) -> Option<KnId> {
        candidates.iter().copied().max()
    }

    async fn is_leader(&self) -> Result<bool> {
        self.lease.is_leader().await
    }

    async fn set_leader_note(&self, note: Option<&str>) -> Result<bool> {
        self.lease.set_leader_note(note).await
    }

    async fn leader_note(&self) -> Result<Option<String>> {
        self.lease.leader_note().await
    }
}

/// A Platform error: `what` was being done and the API server (or transport) said `err`.
fn platform(what: &str, err: kube::Error) -> OrchestratorError {
    OrchestratorError::Platform(format!("{what}: {}", describe(&err)))
}

/// The useful part of a kube error: the API server's status message when there is one.
fn describe(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(s) => {
            let message = if s.message.is_empty() {
                "no message"
            } else {
                s.message.as_str()
            };
            if s.reason.is_empty() {
                format!("API server answered {}: {message}", s.code)
            } else {
                format!("API server answered {} {}: {message}", s.code, s.reason)
            }
        }
        other => other.to_string(),
    }
}

fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref()?.phase.as_deref()
}

/// The pod's Ready condition: `Some(true)`/`Some(false)`, `None` when not reported yet.
fn ready_condition(pod: &Pod) -> Option<bool> {
    pod.status
        .as_ref()?
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status == "True")
}

/// Ready and not on its way out (a terminating pod may still report Ready for a while).
fn is_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none() && ready_condition(pod) == Some(true)
}

/// Tests against a mock API server (`test_support`); the Lease's own are in `lease`.
#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;
    use serde_json::Value;

    const STS: &str = "/apis/apps/v1/namespaces/dinomo/statefulsets/dinomo-kn";
    const PODS: &str = "/api/v1/namespaces/dinomo/pods";

    fn sts(replicas: u32, version: &str) -> Value {
        json!({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": { "name": "dinomo-kn", "namespace": "dinomo", "resourceVersion": version },
            "spec": {
                "replicas": replicas,
                "serviceName": "dinomo-kn",
                "selector": { "matchLabels": {
                    "app.kubernetes.io/name": "dinomo",
                    "app.kubernetes.io/component": "kn",
                } },
                "template": {},
            },
        })
    }

    fn pod(name: &str, status: Value) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": { "name": name, "namespace": "dinomo" },
            "status": status,
        })
    }

    fn running(ready: bool) -> Value {
        json!({
            "phase": "Running",
            "startTime": "2023-11-14T22:00:00Z",
            "conditions": [
                { "type": "PodScheduled", "status": "True" },
                { "type": "Ready", "status": if ready { "True" } else { "False" } },
            ],
        })
    }

    fn replicas_patch(version: &str, replicas: u32) -> Value {
        json!({ "metadata": { "resourceVersion": version }, "spec": { "replicas": replicas } })
    }

    #[tokio::test]
    async fn add_kn_scales_up_and_waits_for_ready() {
        let pod_uri = format!("{PODS}/dinomo-kn-3");
        let (orch, server) = with_script(vec![
            expect("GET", STS).reply(200, sts(3, "100")),
            expect("PATCH", STS)
                .body(replicas_patch("100", 4))
                .reply(200, sts(4, "101")),
            expect("GET", &pod_uri).reply(
                404,
                status(404, "NotFound", "pods \"dinomo-kn-3\" not found"),
            ),
            expect("GET", &pod_uri).reply(200, pod("dinomo-kn-3", running(false))),
            expect("GET", &pod_uri).reply(200, pod("dinomo-kn-3", running(true))),
        ]);
        let added = orch.add_kn().await;
        finish(orch, server).await;
        let added = added.expect("add_kn");
        assert_eq!(added.id, 4);
        assert_eq!(added.endpoint, "dinomo-kn-3.dinomo-kn.dinomo.svc:7800");
    }

    #[tokio::test]
    async fn add_kn_reports_a_conflicting_scale_as_platform_error() {
        let (orch, server) = with_script(vec![
            expect("GET", STS).reply(200, sts(3, "100")),
            expect("PATCH", STS)
                .body(replicas_patch("100", 4))
                .reply(409, status(409, "Conflict", "the object has been modified")),
        ]);
        let result = orch.add_kn().await;
        finish(orch, server).await;
        match result {
            Err(OrchestratorError::Platform(msg)) => {
                assert!(msg.contains("adding KN 4"), "{msg}");
                assert!(msg.contains("setting replicas to 4"), "{msg}");
                assert!(
                    msg.contains("409 Conflict: the object has been modified"),
                    "{msg}"
                );
            }
            other => panic!("expected a Platform error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn add_kn_times_out_and_rolls_back() {
        let (orch, mut handle) = orchestrator_with(KubernetesConfig {
            ready_timeout_ms: 40,
            poll_interval_ms: 5,
            ..config()
        });
        // The number of polls depends on timing, so this server answers GETs of the pod
        // until the roll-back PATCH arrives.
        let server = tokio::spawn(async move {
            let (req, send) = handle.next_request().await.expect("GET sts");
            answer(0, req, send, expect("GET", STS).reply(200, sts(3, "100"))).await;
            let (req, send) = handle.next_request().await.expect("PATCH sts");
            let ex = expect("PATCH", STS)
                .body(replicas_patch("100", 4))
                .reply(200, sts(4, "101"));
            answer(1, req, send, ex).await;
            let mut polls = 0;
            loop {
                let (req, send) = handle.next_request().await.expect("poll or roll back");
                if req.method() == http::Method::GET {
                    polls += 1;
                    let ex = expect("GET", format!("{PODS}/dinomo-kn-3"))
                        .reply(200, pod("dinomo-kn-3", running(false)));
                    answer(1 + polls, req, send, ex).await;
                } else {
                    let ex = expect("PATCH", STS)
                        .body(replicas_patch("101", 3))
                        .reply(200, sts(3, "102"));
                    answer(2 + polls, req, send, ex).await;
                    break;
                }
            }
            assert!(polls >= 2, "polled only {polls} times");
            if let Some((req, _)) = handle.next_request().await {
                panic!("unexpected request {} {}", req.method(), req.uri());
            }
        });
        let result = orch.add_kn().await;
        finish(orch, server).await;
        match result {
            Err(OrchestratorError::Platform(msg)) => {
                assert!(
                    msg.contains("KN 4 (pod dinomo/dinomo-kn-3) was not Ready within 40 ms"),
                    "{msg}"
                );
                assert!(msg.contains("pod phase Running"), "{msg}");
            }
            other => panic!("expected a Platform error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn remove_kn_of_the_highest_kn_scales_down_and_waits_for_the_pod() {
        let pod_uri = format!("{PODS}/dinomo-kn-3");
        let mut terminating = pod("dinomo-kn-3", running(true));
        terminating["metadata"]["deletionTimestamp"] = json!("2023-11-14T22:13:20Z");
        let (orch, server) = with_script(vec![
            expect("GET", STS).reply(200, sts(4, "200")),
            expect("PATCH", STS)
                .body(replicas_patch("200", 3))
                .reply(200, sts(3, "201")),
            expect("GET", &pod_uri).reply(200, terminating),
            expect("GET", &pod_uri).reply(
                404,
                status(404, "NotFound", "pods \"dinomo-kn-3\" not found"),
            ),
        ]);
        let result = orch.remove_kn(4).await;
        finish(orch, server).await;
        result.expect("remove_kn");
    }

    #[tokio::test]
    async fn remove_kn_of_a_lower_kn_is_refused_without_a_write() {
        let (orch, server) = with_script(vec![expect("GET", STS).reply(200, sts(4, "200"))]);
        let result = orch.remove_kn(2).await;
        finish(orch, server).await;
        match result {
            Err(OrchestratorError::Refused(msg)) => {
                assert!(msg.contains("KN 2 is pod dinomo-kn-1"), "{msg}");
                assert!(msg.contains("remove KN 4 instead"), "{msg}");
            }
            other => panic!("expected Refused, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn remove_kn_of_an_unknown_kn() {
        // KN 0 does not exist by convention: no request at all.
        let (orch, server) = with_script(vec![]);
        let result = orch.remove_kn(0).await;
        finish(orch, server).await;
        assert!(
            matches!(result, Err(OrchestratorError::UnknownKn(0))),
            "{result:?}"
        );

        let (orch, server) = with_script(vec![expect("GET", STS).reply(200, sts(4, "200"))]);
        let result = orch.remove_kn(5).await;
        finish(orch, server).await;
        assert!(
            matches!(result, Err(OrchestratorError::UnknownKn(5))),
            "{result:?}"
        );
    }

    #[tokio::test]
    async fn fail_kn_deletes_the_pod_with_no_grace_period() {
        let mut deleted = pod("dinomo-kn-1", running(true));
        deleted["metadata"]["deletionTimestamp"] = json!("2023-11-14T22:13:20Z");
        let (orch, server) = with_script(vec![expect("DELETE", format!("{PODS}/dinomo-kn-1"))
            .body(json!({ "gracePeriodSeconds": 0 }))
            .reply(200, deleted)]);
        let result = orch.fail_kn(2).await;
        finish(orch, server).await;
        result.expect("fail_kn");
    }

    #[tokio::test]
    async fn fail_kn_of_a_missing_pod_is_unknown() {
        let (orch, server) = with_script(vec![expect("DELETE", format!("{PODS}/dinomo-kn-8"))
            .body(json!({ "gracePeriodSeconds": 0 }))
            .reply(
                404,
                status(404, "NotFound", "pods \"dinomo-kn-8\" not found"),
            )]);
        let result = orch.fail_kn(9).await;
        finish(orch, server).await;
        assert!(
            matches!(result, Err(OrchestratorError::UnknownKn(9))),
            "{result:?}"
        );
    }

    #[tokio::test]
    async fn failed_kns_reads_pod_status() {
        // Started recently, so only the CrashLoopBackOff rule can report it.
        let crash_loop = json!({
            "phase": "Running",
            "startTime": "2023-11-14T22:13:18Z",
            "conditions": [{ "type": "Ready", "status": "False" }],
            "containerStatuses": [{
                "name": "kv-node", "image": "dinomo", "imageID": "", "ready": false,
                "restartCount": 4,
                "state": { "waiting": { "reason": "CrashLoopBackOff" } },
            }],
        });
        let failed = json!({ "phase": "Failed", "startTime": "2023-11-14T22:00:00Z" });
        // Started 2 s ago: not Ready yet is normal (ready_timeout is 30 s).
        let starting = json!({
            "phase": "Running",
            "startTime": "2023-11-14T22:13:18Z",
            "conditions": [{ "type": "Ready", "status": "False" }],
        });
        // Started 13 minutes ago and still not Ready: hung.
        let hung = running(false);
        let mut terminating = pod("dinomo-kn-6", running(true));
        terminating["metadata"]["deletionTimestamp"] = json!("2023-11-14T22:13:20Z");
        let list = json!({
            "apiVersion": "v1",
            "kind": "PodList",
            "metadata": { "resourceVersion": "300" },
            "items": [
                pod("dinomo-kn-0", running(true)),
                pod("dinomo-kn-1", failed.clone()),
                pod("dinomo-kn-2", crash_loop),
                // dinomo-kn-3 (KN 4) is missing.
                pod("dinomo-kn-4", starting),
                pod("dinomo-kn-5", hung),
                terminating,
                // Beyond the replica count (being scaled away): not reported.
                pod("dinomo-kn-7", failed.clone()),
                // Not a pod of this StatefulSet although the labels match.
                pod("dinomo-kn-canary", failed),
            ],
        });
        let (orch, server) = with_script(vec![
            expect("GET", STS).reply(200, sts(7, "300")),
            expect(
                "GET",
                format!(
                    "{PODS}?labelSelector=app.kubernetes.io%2Fcomponent%3Dkn%2Capp.kubernetes.io%2Fname%3Ddinomo"
                ),
            )
            .reply(200, list),
        ]);
        let result = orch.failed_kns().await;
        finish(orch, server).await;
        assert_eq!(result.expect("failed_kns"), vec![2, 3, 4, 6, 7]);
    }

    #[tokio::test]
    async fn failed_kns_reports_a_terminated_container() {
        // Started recently and not yet marked not Ready: only the terminated container tells.
        let oom_killed = json!({
            "phase": "Running",
            "startTime": "2023-11-14T22:13:18Z",
            "containerStatuses": [{
                "name": "kv-node", "image": "dinomo", "imageID": "", "ready": false,
                "restartCount": 0,
                "state": { "terminated": { "exitCode": 137, "reason": "OOMKilled" } },
            }],
        });
        let list = json!({
            "apiVersion": "v1", "kind": "PodList", "metadata": {},
            "items": [pod("dinomo-kn-0", running(true)), pod("dinomo-kn-1", oom_killed)],
        });
        let (orch, server) = with_script(vec![
            expect("GET", STS).reply(200, sts(2, "300")),
            expect(
                "GET",
                format!(
                    "{PODS}?labelSelector=app.kubernetes.io%2Fcomponent%3Dkn%2Capp.kubernetes.io%2Fname%3Ddinomo"
                ),
            )
            .reply(200, list),
        ]);
        let result = orch.failed_kns().await;
        finish(orch, server).await;
        assert_eq!(result.expect("failed_kns"), vec![2]);
    }

    #[tokio::test]
    async fn failed_kns_are_none_when_all_pods_are_ready() {
        let list = json!({
            "apiVersion": "v1", "kind": "PodList", "metadata": {},
            "items": [pod("dinomo-kn-0", running(true)), pod("dinomo-kn-1", running(true))],
        });
        let (orch, server) = with_script(vec![
            expect("GET", STS).reply(200, sts(2, "300")),
            expect(
                "GET",
                format!(
                    "{PODS}?labelSelector=app.kubernetes.io%2Fcomponent%3Dkn%2Capp.kubernetes.io%2Fname%3Ddinomo"
                ),
            )
            .reply(200, list),
        ]);
        let result = orch.failed_kns().await;
        finish(orch, server).await;
        assert_eq!(result.expect("failed_kns"), Vec::<KnId>::new());
    }

    #[tokio::test]
    async fn removal_choice_is_the_highest_candidate() {
        let (orch, server) = with_script(vec![]);
        assert_eq!(orch.removal_choice(&[2, 5, 3]), Some(5));
        assert_eq!(orch.removal_choice(&[]), None);
        assert_eq!(orch.name(), "kubernetes");
        finish(orch, server).await;
    }

    #[tokio::test]
    async fn pod_names_map_to_kn_ids() {
        let (orch, server) = with_script(vec![]);
        assert_eq!(orch.kn_of_pod("dinomo-kn-0"), Some(1));
        assert_eq!(orch.kn_of_pod("dinomo-kn-12"), Some(13));
        assert_eq!(orch.kn_of_pod("dinomo-kn-01"), None);
        assert_eq!(orch.kn_of_pod("dinomo-kn-+1"), None);
        assert_eq!(orch.kn_of_pod("dinomo-kn-"), None);
        assert_eq!(orch.kn_of_pod("dinomo-knx-1"), None);
        assert_eq!(orch.kn_of_pod("other-0"), None);
        assert_eq!(orch.pod_name(1), "dinomo-kn-0");
        assert_eq!(orch.endpoint(13), "dinomo-kn-12.dinomo-kn.dinomo.svc:7800");
        finish(orch, server).await;
    }

    #[tokio::test]
    async fn empty_namespace_means_the_client_default() {
        let (orch, _handle) = orchestrator_with(KubernetesConfig {
            namespace: String::new(),
            ..config()
        });
        assert_eq!(orch.namespace(), "default");
        assert_eq!(orch.identity(), "monitor-a");
    }

    #[test]
    fn config_parses_with_defaults_and_rejects_unknown_fields() {
        let parsed: KubernetesConfig =
            toml::from_str("namespace = \"prod\"\nkn_port = 7100\nready_timeout_ms = 5000\n")
                .expect("config");
        assert_eq!(
            parsed,
            KubernetesConfig {
                namespace: "prod".into(),
                kn_port: 7100,
                ready_timeout_ms: 5000,
                ..KubernetesConfig::default()
            }
        );
        assert_eq!(parsed.statefulset, "dinomo-kn");
        assert_eq!(parsed.lease_duration_secs, 15);
        let e = toml::from_str::<KubernetesConfig>("replicas = 3\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("replicas"),
            "an unknown field is refused by name: {e}"
        );
    }
}
