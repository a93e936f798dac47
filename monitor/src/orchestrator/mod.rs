//! Orchestrators: how the monitor gets, stops and watches KV nodes. The monitor decides *what*
//! to do (policy engine, reconfiguration); an orchestrator does it on a platform:
//!
//! - [`local`]: KNs are child processes of the monitor (the embedded default, `dinomo up`);
//! - [`kubernetes`]: KNs are the pods of a StatefulSet; scaling patches its replicas, failures
//!   are read from pod status, and a Lease makes sure that one monitor acts at a time;
//! - [`external`]: KNs are started by someone else (containers, systemd); the monitor adopts
//!   the ones that register with the DPM.
//!
//! Invariants every backend keeps:
//! - `add_kn` returns only once the new KN is registered with the DPM and serving its
//!   KvService at the returned endpoint (it owns nothing until the monitor publishes a map
//!   that includes it);
//! - `remove_kn` is called only after a map without the KN was published and its in-flight
//!   requests drained; it stops the KN gracefully (it seals its logs on the way out);
//! - KN ids are never reused for a different KN while the old one may still write (the DPM
//!   fences by KN id and epoch, so a restarted KN with the same id is a new incarnation).

pub mod external;
pub mod kubernetes;
pub mod local;

use std::fmt::Debug;

use async_trait::async_trait;
use dinomo_placement::{KnId, KnInfo};

/// What went wrong in an orchestrator.
#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    /// The platform refused or failed the request (process spawn, API server error, ...).
    #[error("{0}")]
    Platform(String),
    /// The KN is not one this orchestrator runs.
    #[error("KN {0} is not managed by this orchestrator")]
    UnknownKn(KnId),
    /// The action is impossible on this platform (e.g. no more KNs may be started).
    #[error("{0}")]
    Refused(String),
}

pub type Result<T> = std::result::Result<T, OrchestratorError>;

/// A platform that runs KV nodes.
#[async_trait]
pub trait Orchestrator: Send + Sync + Debug {
    /// "local", "kubernetes" or "external", for logs and the Status RPC.
    fn name(&self) -> &'static str;

    /// Starts one more KN and returns its id and KvService endpoint once it serves.
    async fn add_kn(&self) -> Result<KnInfo>;

    /// Stops a KN gracefully (the monitor already published a map without it).
    async fn remove_kn(&self, kn: KnId) -> Result<()>;

    /// Kills a KN abruptly, as a crash would (experiments and `dinomo admin fail-kn`).
    async fn fail_kn(&self, kn: KnId) -> Result<()>;

    /// KNs the platform itself reports as dead (process exited, pod failed or not ready)
    /// among those it runs. The monitor also detects failures by missed heartbeats.
    async fn failed_kns(&self) -> Result<Vec<KnId>>;

    /// Which of `candidates` (all under-utilised, least busy first) to remove. Any KN can go,
    /// since no data moves; a StatefulSet can only shrink from its highest ordinal.
    fn removal_choice(&self, candidates: &[KnId]) -> Option<KnId> {
        candidates.first().copied()
    }

    /// Whether this monitor may act now (holds the Lease); renews it. Called every epoch and
    /// probe round, before each admin action and before each step of a reconfiguration
    /// (`Monitor::lead`). When it first returns true the monitor starts a new monitor term at
    /// the DPM, which refuses the calls of older terms: a rival that still believes it leads
    /// is stopped there, whatever this method told it.
    async fn is_leader(&self) -> Result<bool> {
        Ok(true)
    }

    /// Leaves `note` beside the leadership for whoever leads next (`None` removes it): on
    /// Kubernetes an annotation of the Lease, written only while this monitor holds it (false:
    /// it does not, or another monitor wrote the Lease first). The dpm replica set's watcher
    /// records there the promotion it is about to ask for (monitor/src/dpm_replicas). A
    /// platform with one monitor keeps nothing: nobody takes over from it.
    async fn set_leader_note(&self, _note: Option<&str>) -> Result<bool> {
        Ok(true)
    }

    /// The note the last leader left ([`Orchestrator::set_leader_note`]), if any.
    async fn leader_note(&self) -> Result<Option<String>> {
        Ok(None)
    }
}
