//! Leader election for the `kubernetes` orchestrator: a `coordination.k8s.io/v1` Lease names
//! the one monitor that may act, and carries the note the leader leaves for whoever leads next.
//!
//! It owns this monitor's side of the Lease: its holder identity, reading the Lease, creating it
//! when absent, renewing it, taking it over once expired, and the leader's note, the annotation
//! [`LEADER_NOTE`] (`dinomo.io/leader-note`). It owns no decision about what a leader does: the
//! monitor asks [`is_leader`](LeaderLease::is_leader) through
//! [`Orchestrator::is_leader`](crate::orchestrator::Orchestrator::is_leader) and starts a new
//! monitor term at the DPM (`Monitor::lead`); the dpm replica set's watcher writes and reads
//! the note (monitor/src/dpm_replicas; docs/decisions/0007-dpm-replication.md).
//!
//! The Lease's fields, as this module writes them:
//! - `holderIdentity`: this monitor's identity (the config's, else `$HOSTNAME`, else
//!   `monitor-{pid}`); no holder means the Lease was released.
//! - `leaseDurationSeconds`: this monitor's `lease_duration_secs`. Another holder's Lease is
//!   judged by the duration that holder wrote (by ours when it wrote none).
//! - `acquireTime`: when the current holder took it; a renewal keeps it, a takeover (and the
//!   creation) sets it to now.
//! - `renewTime`: now, at every write of the spec.
//! - `leaseTransitions`: 0 at creation, one more at each takeover.
//! - `metadata.annotations[dinomo.io/leader-note]`: the leader's note, see below.
//!
//! Invariants:
//! - **Leadership:** a monitor acts only while its last `is_leader()` returned true less than
//!   `lease_duration_secs / 2` ago; the monitor calls it every epoch, which must be shorter
//!   than that. A rival takes the Lease over only after `renewTime + leaseDurationSeconds` has
//!   passed, by which time the old leader stopped acting half a lease earlier (this assumes
//!   the monitors' clocks agree to within that margin). Every write of the Lease carries the
//!   `resourceVersion` it read, so of two monitors racing for it exactly one wins; the loser
//!   gets 409 Conflict and is not leader. The clock assumption is not load-bearing for
//!   safety: a new leader starts a new monitor term at the DPM, which refuses the old
//!   leader's fences, merges and map publishes from then on (see `Monitor::lead`).
//! - **The note is written only while this monitor holds the Lease:** a PUT conditional on the
//!   `resourceVersion` read, and none at all unless the Lease names this monitor as holder. A
//!   monitor that took the Lease over meanwhile made that version old, so the write conflicts
//!   (false) instead of overwriting its renewal. Removing a note that is not there writes
//!   nothing.
//! - **Renewals and takeovers keep the annotation:** they rewrite only the spec, so the note
//!   of a dead leader is there for the monitor that takes over from it.
//! - **One caller at a time:** every read-and-write of the Lease (renewal, takeover, note)
//!   holds one lock, shared by the orchestrator's clones: the monitor's loops and the dpm
//!   replica watcher ask concurrently, and two interleaved renewals make the second PUT
//!   conflict (read as "not the leader", which drops the monitor's term at the DPM). Reading
//!   the note is a single GET and takes no lock.

use std::sync::Arc;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::PostParams;
use kube::{Api, Client};

use super::{platform, KubernetesConfig};
use crate::orchestrator::Result;

/// The Lease annotation that carries the leader's note
/// ([`Orchestrator::set_leader_note`](crate::orchestrator::Orchestrator::set_leader_note)).
pub const LEADER_NOTE: &str = "dinomo.io/leader-note";

/// This monitor's handle on the Lease that elects the active monitor. Clones share the lock
/// that makes the Lease's reads-and-writes one at a time.
#[derive(Clone)]
pub(super) struct LeaderLease {
    leases: Api<Lease>,
    /// The namespace of the Lease (the orchestrator's).
    namespace: String,
    /// The Lease's name (`lease_name` in the config).
    name: String,
    /// The Lease holder identity actually used.
    identity: String,
    /// How long a Lease stays valid after its last renewal (`lease_duration_secs`).
    duration_secs: u32,
    /// Wall clock for Lease times; a plain fn so tests can pin it.
    now: fn() -> Timestamp,
    /// Held across one read-and-renew of the Lease: the monitor's loops and the dpm replica
    /// watcher ask concurrently, and two interleaved renewals make the second PUT conflict
    /// (read as "not the leader", which drops the monitor's term at the DPM).
    lease_round: Arc<tokio::sync::Mutex<()>>,
}

impl LeaderLease {
    /// The Lease `config.lease_name` in `namespace`, held under `config.identity` (empty:
    /// `$HOSTNAME`, or `monitor-{pid}` when that is unset).
    pub(super) fn new(
        client: Client,
        namespace: &str,
        config: &KubernetesConfig,
        now: fn() -> Timestamp,
    ) -> Self {
        let identity = if !config.identity.is_empty() {
            config.identity.clone()
        } else {
            std::env::var("HOSTNAME")
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| format!("monitor-{}", std::process::id()))
        };
        Self {
            leases: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            name: config.lease_name.clone(),
            identity,
            duration_secs: config.lease_duration_secs,
            now,
            lease_round: Arc::new(tokio::sync::Mutex::new(())),
        }
    }

    /// The identity this monitor holds the Lease under.
    pub(super) fn identity(&self) -> &str {
        &self.identity
    }

    /// Whether this monitor holds the Lease now, having created, renewed or taken it over
    /// ([`Orchestrator::is_leader`](crate::orchestrator::Orchestrator::is_leader)). A conflict
    /// (another monitor wrote the Lease first) is `false`, not an error.
    pub(super) async fn is_leader(&self) -> Result<bool> {
        let _one_renewal_at_a_time = self.lease_round.lock().await;
        let name = &self.name;
        let what = format!("Lease {}/{name}", self.namespace);
        let now = (self.now)();
        let existing = self
            .leases
            .get_opt(name)
            .await
            .map_err(|e| platform(&format!("reading {what}"), e))?;
        let Some(mut lease) = existing else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(self.lease_spec(now, now, 0)),
            };
            return match self.leases.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                // Another monitor created it first: it leads.
                Err(kube::Error::Api(s)) if s.is_already_exists() || s.is_conflict() => Ok(false),
                Err(e) => Err(platform(&format!("creating {what}"), e)),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.as_deref().unwrap_or("");
        let transitions = spec.lease_transitions.unwrap_or(0);
        if holder == self.identity {
            let acquired = spec.acquire_time.map_or(now, |t| t.0);
            lease.spec = Some(self.lease_spec(now, acquired, transitions));
            return self.write_lease(&lease, "renewing").await;
        }
        // A Lease with no holder was released; otherwise it is free once its last renewal
        // is older than its duration (the holder's duration, as it wrote it).
        let free = holder.is_empty() || {
            let renewed = spec.renew_time.or(spec.acquire_time).map(|t| t.0);
            let duration = spec
                .lease_duration_seconds
                .unwrap_or(i32::try_from(self.duration_secs).unwrap_or(i32::MAX));
            renewed.is_none_or(|r| {
                now.duration_since(r) > SignedDuration::from_secs(i64::from(duration))
            })
        };
        if !free {
            return Ok(false);
        }
        lease.spec = Some(self.lease_spec(now, now, transitions.saturating_add(1)));
        self.write_lease(&lease, "taking over").await
    }

    /// Writes (`Some`) or removes (`None`) the leader's note on the Lease, only while this
    /// monitor holds it; false when it does not, or another monitor wrote the Lease first
    /// ([`Orchestrator::set_leader_note`](crate::orchestrator::Orchestrator::set_leader_note)).
    pub(super) async fn set_leader_note(&self, note: Option<&str>) -> Result<bool> {
        let _one_write_at_a_time = self.lease_round.lock().await;
        let name = &self.name;
        let Some(mut lease) = self
            .leases
            .get_opt(name)
            .await
            .map_err(|e| platform(&format!("reading Lease {}/{name}", self.namespace), e))?
        else {
            return Ok(false);
        };
        let holder = lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.as_deref());
        if holder != Some(self.identity.as_str()) {
            return Ok(false);
        }
        let annotations = lease
            .metadata
            .annotations
            .get_or_insert_with(Default::default);
        match note {
            Some(note) => {
                annotations.insert(LEADER_NOTE.to_string(), note.to_string());
            }
            None => {
                if annotations.remove(LEADER_NOTE).is_none() {
                    return Ok(true);
                }
            }
        }
        // Conditional on the resourceVersion read: a monitor that took the Lease meanwhile
        // makes it a conflict (false), not an overwrite of its renewal.
        self.write_lease(&lease, "writing the leader's note on")
            .await
    }

    /// The note the last leader left on the Lease, if any.
    pub(super) async fn leader_note(&self) -> Result<Option<String>> {
        let name = &self.name;
        let lease = self
            .leases
            .get_opt(name)
            .await
            .map_err(|e| platform(&format!("reading Lease {}/{name}", self.namespace), e))?;
        Ok(lease.and_then(|l| l.metadata.annotations?.remove(LEADER_NOTE)))
    }

    /// The Lease we write to take or keep leadership.
    fn lease_spec(&self, now: Timestamp, acquired: Timestamp, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.identity.clone()),
            lease_duration_seconds: Some(i32::try_from(self.duration_secs).unwrap_or(i32::MAX)),
            acquire_time: Some(MicroTime(acquired)),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(transitions),
            ..LeaseSpec::default()
        }
    }

    /// Replaces the Lease (conditional on its resourceVersion); a conflict means another
    /// monitor wrote it first, so we are not leader.
    async fn write_lease(&self, lease: &Lease, doing: &str) -> Result<bool> {
        match self
            .leases
            .replace(&self.name, &PostParams::default(), lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.is_conflict() => Ok(false),
            Err(e) => Err(platform(
                &format!("{doing} Lease {}/{}", self.namespace, self.name),
                e,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::super::test_support::{expect, finish, status, with_script};
    use super::LEADER_NOTE;
    use crate::orchestrator::{Orchestrator, OrchestratorError};

    const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/dinomo/leases";
    const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/dinomo/leases/dinomo-monitor";
    /// `fixed_now()` and offsets from it, as Kubernetes writes MicroTime.
    const NOW: &str = "2023-11-14T22:13:20.000000Z";
    const NOW_MINUS_5S: &str = "2023-11-14T22:13:15.000000Z";
    const NOW_MINUS_20S: &str = "2023-11-14T22:13:00.000000Z";
    const EARLIER: &str = "2023-11-14T20:00:00.000000Z";

    fn lease(
        holder: &str,
        version: &str,
        acquired: &str,
        renewed: &str,
        transitions: i32,
    ) -> Value {
        json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": { "name": "dinomo-monitor", "namespace": "dinomo", "resourceVersion": version },
            "spec": {
                "holderIdentity": holder,
                "leaseDurationSeconds": 15,
                "acquireTime": acquired,
                "renewTime": renewed,
                "leaseTransitions": transitions,
            },
        })
    }

    #[tokio::test]
    async fn lease_is_created_when_absent() {
        let created = json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": { "name": "dinomo-monitor" },
            "spec": {
                "holderIdentity": "monitor-a",
                "leaseDurationSeconds": 15,
                "acquireTime": NOW,
                "renewTime": NOW,
                "leaseTransitions": 0,
            },
        });
        let (orch, server) = with_script(vec![
            expect("GET", LEASE).reply(
                404,
                status(404, "NotFound", "leases \"dinomo-monitor\" not found"),
            ),
            expect("POST", LEASES)
                .body(created)
                .reply(201, lease("monitor-a", "1", NOW, NOW, 0)),
        ]);
        let result = orch.is_leader().await;
        finish(orch, server).await;
        assert!(result.expect("is_leader"));
    }

    #[tokio::test]
    async fn lease_created_concurrently_by_another_monitor_is_not_ours() {
        let (orch, server) = with_script(vec![
            expect("GET", LEASE).reply(404, status(404, "NotFound", "not found")),
            expect("POST", LEASES)
                .body(json!({
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": { "name": "dinomo-monitor" },
                    "spec": {
                        "holderIdentity": "monitor-a", "leaseDurationSeconds": 15,
                        "acquireTime": NOW, "renewTime": NOW, "leaseTransitions": 0,
                    },
                }))
                .reply(
                    409,
                    status(
                        409,
                        "AlreadyExists",
                        "leases \"dinomo-monitor\" already exists",
                    ),
                ),
        ]);
        let result = orch.is_leader().await;
        finish(orch, server).await;
        assert!(!result.expect("is_leader"));
    }

    #[tokio::test]
    async fn own_lease_is_renewed() {
        let (orch, server) = with_script(vec![
            expect("GET", LEASE).reply(200, lease("monitor-a", "7", EARLIER, NOW_MINUS_5S, 2)),
            expect("PUT", LEASE)
                .body(lease("monitor-a", "7", EARLIER, NOW, 2))
                .reply(200, lease("monitor-a", "8", EARLIER, NOW, 2)),
        ]);
        let result = orch.is_leader().await;
        finish(orch, server).await;
        assert!(result.expect("is_leader"));
    }

    #[tokio::test]
    async fn fresh_lease_of_another_monitor_is_left_alone() {
        let (orch, server) = with_script(vec![
            expect("GET", LEASE).reply(200, lease("monitor-b", "7", EARLIER, NOW_MINUS_5S, 2))
        ]);
        let result = orch.is_leader().await;
        finish(orch, server).await;
        assert!(!result.expect("is_leader"));
    }

    #[tokio::test]
    async fn expired_lease_of_another_monitor_is_taken_over() {
        let (orch, server) = with_script(vec![
            expect("GET", LEASE).reply(200, lease("monitor-b", "7", EARLIER, NOW_MINUS_20S, 2)),
            expect("PUT", LEASE)
                .body(lease("monitor-a", "7", NOW, NOW, 3))
                .reply(200, lease("monitor-a", "8", NOW, NOW, 3)),
        ]);
        let result = orch.is_leader().await;
        finish(orch, server).await;
        assert!(result.expect("is_leader"));
    }

    #[tokio::test]
    async fn conflict_on_lease_replace_means_not_leader() {
        let (orch, server) = with_script(vec![
            expect("GET", LEASE).reply(200, lease("monitor-a", "7", EARLIER, NOW_MINUS_5S, 2)),
            expect("PUT", LEASE)
                .body(lease("monitor-a", "7", EARLIER, NOW, 2))
                .reply(
                    409,
                    status(409, "Conflict", "Operation cannot be fulfilled on leases.coordination.k8s.io \"dinomo-monitor\": the object has been modified"),
                ),
        ]);
        let result = orch.is_leader().await;
        finish(orch, server).await;
        assert!(!result.expect("a conflict is not an error"));
    }

    /// `lease` with the leader's note `note` (`Some("")`: an empty annotations map).
    fn noted(mut lease: Value, note: Option<&str>) -> Value {
        lease["metadata"]["annotations"] = match note {
            Some("") => json!({}),
            Some(n) => json!({ LEADER_NOTE: n }),
            None => return lease,
        };
        lease
    }

    #[tokio::test]
    async fn the_leader_writes_its_note_on_its_lease() {
        let held = lease("monitor-a", "7", EARLIER, NOW_MINUS_5S, 2);
        let (orch, server) = with_script(vec![
            expect("GET", LEASE).reply(200, held.clone()),
            expect("PUT", LEASE)
                .body(noted(held, Some("b1:7700 3 1700000000000")))
                .reply(200, lease("monitor-a", "8", EARLIER, NOW_MINUS_5S, 2)),
        ]);
        let result = orch.set_leader_note(Some("b1:7700 3 1700000000000")).await;
        finish(orch, server).await;
        assert!(result.expect("set_leader_note"));
    }

    #[tokio::test]
    async fn a_monitor_that_does_not_hold_the_lease_writes_no_note() {
        let (orch, server) = with_script(vec![
            expect("GET", LEASE).reply(200, lease("monitor-b", "7", EARLIER, NOW_MINUS_5S, 2)),
            expect("GET", LEASE).reply(404, status(404, "NotFound", "not found")),
        ]);
        let theirs = orch.set_leader_note(Some("b1:7700 3 1")).await;
        let none = orch.set_leader_note(Some("b1:7700 3 1")).await;
        finish(orch, server).await;
        assert!(!theirs.expect("another's Lease"));
        assert!(!none.expect("no Lease"));
    }

    #[tokio::test]
    async fn a_note_written_over_a_changed_lease_is_not_written() {
        let held = lease("monitor-a", "7", EARLIER, NOW_MINUS_5S, 2);
        let (orch, server) = with_script(vec![
            expect("GET", LEASE).reply(200, held.clone()),
            expect("PUT", LEASE)
                .body(noted(held, Some("b1:7700 3 1")))
                .reply(409, status(409, "Conflict", "the object has been modified")),
        ]);
        let result = orch.set_leader_note(Some("b1:7700 3 1")).await;
        finish(orch, server).await;
        assert!(!result.expect("a conflict is not an error"));
    }

    #[tokio::test]
    async fn the_note_survives_renewals_and_takeovers_and_is_read_and_removed() {
        let note = "b2:7700 3 1700000000000";
        let (orch, server) = with_script(vec![
            // Renewed: the note stays.
            expect("GET", LEASE).reply(
                200,
                noted(
                    lease("monitor-a", "7", EARLIER, NOW_MINUS_5S, 2),
                    Some(note),
                ),
            ),
            expect("PUT", LEASE)
                .body(noted(lease("monitor-a", "7", EARLIER, NOW, 2), Some(note)))
                .reply(200, lease("monitor-a", "8", EARLIER, NOW, 2)),
            // Another monitor's expired Lease taken over: its note stays, for the new leader.
            expect("GET", LEASE).reply(
                200,
                noted(
                    lease("monitor-b", "9", EARLIER, NOW_MINUS_20S, 2),
                    Some(note),
                ),
            ),
            expect("PUT", LEASE)
                .body(noted(lease("monitor-a", "9", NOW, NOW, 3), Some(note)))
                .reply(200, lease("monitor-a", "10", NOW, NOW, 3)),
            // Read by the new leader, then removed.
            expect("GET", LEASE).reply(
                200,
                noted(lease("monitor-a", "10", NOW, NOW, 3), Some(note)),
            ),
            expect("GET", LEASE).reply(
                200,
                noted(lease("monitor-a", "10", NOW, NOW, 3), Some(note)),
            ),
            expect("PUT", LEASE)
                .body(noted(lease("monitor-a", "10", NOW, NOW, 3), Some("")))
                .reply(200, lease("monitor-a", "11", NOW, NOW, 3)),
            // Nothing to remove: no write.
            expect("GET", LEASE).reply(200, lease("monitor-a", "11", NOW, NOW, 3)),
        ]);
        let renewed = orch.is_leader().await;
        let taken = orch.is_leader().await;
        let read = orch.leader_note().await;
        let removed = orch.set_leader_note(None).await;
        let again = orch.set_leader_note(None).await;
        finish(orch, server).await;
        assert!(renewed.expect("renewal") && taken.expect("takeover"));
        assert_eq!(read.expect("leader_note").as_deref(), Some(note));
        assert!(removed.expect("removal") && again.expect("nothing to remove"));
    }

    #[tokio::test]
    async fn lease_read_failure_is_a_platform_error() {
        let (orch, server) = with_script(vec![expect("GET", LEASE).reply(
            403,
            status(
                403,
                "Forbidden",
                "leases is forbidden: User cannot get resource",
            ),
        )]);
        let result = orch.is_leader().await;
        finish(orch, server).await;
        match result {
            Err(OrchestratorError::Platform(msg)) => {
                assert!(msg.contains("reading Lease dinomo/dinomo-monitor"), "{msg}");
                assert!(msg.contains("403 Forbidden: leases is forbidden"), "{msg}");
            }
            other => panic!("expected a Platform error, got {other:?}"),
        }
    }
}
