//! The `external` orchestrator: KV nodes are started and stopped by someone else (docker
//! compose, systemd, a person at a shell); the monitor adopts the ones that register.
//!
//! A KN started with `--id I --dpm ...` registers with the DPM, which records the endpoint it
//! registered from (`admin::registered_kns`). [`Orchestrator::add_kn`] adopts such a KN: the
//! lowest id that is not in the published map and whose `grpc.health.v1` says SERVING (it is
//! registered with a live DPM session and holds the map), waiting up to `adopt_timeout` for
//! one to appear. So to grow the cluster, start a KN and let the policy (or
//! `dinomo admin add-kn`) take it in.
//!
//! Invariants:
//! - Nothing here starts, stops or kills a process: `remove_kn` only confirms that the KN is
//!   out of the map (it stays up, owning nothing, and may be adopted again: a KN that gains
//!   keys resets its caches first, `KvNode::install_map`), and `fail_kn` is refused.
//! - A KN counts as failed only by the monitor's own probes (missed heartbeats): there is no
//!   platform to ask.
//! - Registration records outlive their KN, so a record is never adopted without a health
//!   check that answers SERVING from the recorded endpoint. A KN that restarts under the same
//!   id registers a new epoch, which fences its earlier incarnation at the DPM.

use std::time::{Duration, Instant};

use async_trait::async_trait;
use dinomo_client::admin;
use dinomo_node_common::health::{self, Probed};
use dinomo_placement::{KnId, KnInfo};

use super::{Orchestrator, OrchestratorError, Result};

/// How long one health check of a candidate KN may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often `add_kn` looks again for a KN to adopt.
const ADOPT_POLL: Duration = Duration::from_millis(500);

/// KNs run by someone else, adopted once they register.
#[derive(Debug)]
pub struct ExternalOrchestrator {
    dpm: String,
    adopt_timeout: Duration,
}

impl ExternalOrchestrator {
    /// Adopts KNs registered at the dpm-node `dpm`; `add_kn` waits up to `adopt_timeout`.
    pub fn new(dpm: String, adopt_timeout: Duration) -> Self {
        ExternalOrchestrator { dpm, adopt_timeout }
    }

    /// The registered KNs outside the published map that answer SERVING, lowest id first.
    pub async fn adoptable(&self) -> Result<Vec<KnInfo>> {
        let map = admin::published_map(&self.dpm)
            .await
            .map_err(|e| OrchestratorError::Platform(e.to_string()))?;
        let registered = admin::registered_kns(&self.dpm)
            .await
            .map_err(|e| OrchestratorError::Platform(e.to_string()))?;
        let outside: Vec<KnInfo> = registered
            .into_iter()
            .filter(|k| !map.as_ref().is_some_and(|m| m.contains(k.id)))
            .collect();
        let answers = futures::future::join_all(
            outside
                .iter()
                .map(|k| health::check(&k.endpoint, dinomo_security::Service::Kv, PROBE_TIMEOUT)),
        )
        .await;
        Ok(outside
            .into_iter()
            .zip(answers)
            .filter(|(_, a)| *a == Ok(Probed::Serving))
            .map(|(k, _)| k)
            .collect())
    }
}

#[async_trait]
impl Orchestrator for ExternalOrchestrator {
    fn name(&self) -> &'static str {
        "external"
    }

    async fn add_kn(&self) -> Result<KnInfo> {
        let deadline = Instant::now() + self.adopt_timeout;
        loop {
            if let Some(kn) = self.adoptable().await?.into_iter().next() {
                tracing::info!(kn = kn.id, endpoint = %kn.endpoint, "adopting a registered KN");
                return Ok(kn);
            }
            if Instant::now() >= deadline {
                return Err(OrchestratorError::Refused(format!(
                    "no KN to adopt: none registered at the dpm-node {} outside the map answers \
                     SERVING (waited {:?}); the external orchestrator starts no KNs, so start \
                     one (`dinomo kv-node --id N --dpm {}`) and try again",
                    self.dpm, self.adopt_timeout, self.dpm
                )));
            }
            tokio::time::sleep(ADOPT_POLL).await;
        }
    }

    async fn remove_kn(&self, kn: KnId) -> Result<()> {
        tracing::info!(
            kn,
            "KN out of the map; it keeps running, owning nothing, until whoever started it \
             stops it (or it is adopted again)"
        );
        Ok(())
    }

    async fn fail_kn(&self, kn: KnId) -> Result<()> {
        Err(OrchestratorError::Refused(format!(
            "the external orchestrator cannot kill KN {kn}: kill it where it runs (docker kill, \
             systemctl kill); the monitor detects the failure by its missed heartbeats"
        )))
    }

    async fn failed_kns(&self) -> Result<Vec<KnId>> {
        Ok(Vec::new())
    }
}
