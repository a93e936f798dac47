//! The session keeper: notices that this KN's DPM session died and registers it again.
//!
//! A session dies when the dpm-node restarts (its grant table is new, so every fabric post is
//! denied), when the KN is fenced, or when the DPM forgets it. Calls that see it die mark it
//! lost (see `dpm_link`); an idle KN would never make such a call, so the keeper also probes
//! the fabric with one 8-byte READ and the control path with one call every [`PROBE_EVERY`]. A lost session is registered again
//! under the same id (with a backoff while the DPM is unreachable); shards see the new
//! generation and start over on it.
//!
//! Health: [`SessionHealth::healthy`] is false while the session has been lost, or the DPM
//! unreachable, for longer than [`UNHEALTHY_AFTER`]; the KN's Stats heartbeat reports that, so
//! a KN that cannot write is not mistaken for a working one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use dinomo_fabric::{Fabric, FabricExt};

use crate::dpm_link::DpmLink;

/// How often an idle KN checks that its session still works.
pub const PROBE_EVERY: Duration = Duration::from_millis(500);
/// How long one probe READ may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// A KN whose session has been broken this long reports itself unhealthy.
pub const UNHEALTHY_AFTER: Duration = Duration::from_secs(5);
/// Longest wait between two registration attempts while the DPM is unreachable.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Since when the session has been broken (0 = it works), in ms after `epoch`.
#[derive(Debug)]
pub struct SessionHealth {
    epoch: Instant,
    broken_since_ms: AtomicU64,
}

impl Default for SessionHealth {
    fn default() -> Self {
        SessionHealth {
            epoch: Instant::now(),
            broken_since_ms: AtomicU64::new(0),
        }
    }
}

impl SessionHealth {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    fn broken(&self) {
        let now = self.now_ms();
        let _ = self
            .broken_since_ms
            .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire);
    }

    fn working(&self) {
        self.broken_since_ms.store(0, Ordering::Release);
    }

    /// How long the session has been broken (`None`: it works).
    pub fn broken_for(&self) -> Option<Duration> {
        match self.broken_since_ms.load(Ordering::Acquire) {
            0 => None,
            since => Some(Duration::from_millis(self.now_ms().saturating_sub(since))),
        }
    }

    /// False once the session has been broken for longer than [`UNHEALTHY_AFTER`].
    pub fn healthy(&self) -> bool {
        self.broken_for().is_none_or(|d| d <= UNHEALTHY_AFTER)
    }
}

/// Runs until the link is dropped (the node stopped).
pub async fn keep(link: Weak<DpmLink>, health: Arc<SessionHealth>, probe_offset: u64) {
    let mut fabric: Option<(Arc<dyn Fabric>, u64)> = None;
    let mut backoff = PROBE_EVERY;
    loop {
        tokio::time::sleep(backoff).await;
        let Some(link) = link.upgrade() else { return };
        backoff = PROBE_EVERY;
        let generation = link.generation();
        if link.is_lost() {
            health.broken();
            match link.reregister(generation).await {
                Ok(_) => {
                    health.working();
                    fabric = None;
                }
                Err(e) => {
                    tracing::warn!(kn = link.kn_id, error = %e, "re-registration failed; retrying");
                    backoff = MAX_BACKOFF;
                }
            }
            continue;
        }
        // A handle of the current session (a new one after a re-registration).
        if fabric.as_ref().is_none_or(|(_, g)| *g != generation) {
            fabric = match link.connect_fabric().await {
                Ok(c) => Some((c.fabric, c.generation)),
                Err(e) => {
                    // A refused grant marked the session lost already (dpm_link).
                    health.broken();
                    tracing::debug!(kn = link.kn_id, error = %e, "fabric connect failed");
                    backoff = MAX_BACKOFF;
                    continue;
                }
            };
        }
        let (f, g) = fabric.clone().expect("set above");
        match tokio::time::timeout(PROBE_TIMEOUT, f.read(probe_offset, 8)).await {
            // With shm the fabric works without the dpm-node: the control path must answer too.
            Ok(Ok(_)) => match link.pending().await {
                Ok(_) => health.working(),
                Err(e) => {
                    health.broken();
                    tracing::debug!(kn = link.kn_id, error = %e, "the DPM does not answer");
                    backoff = MAX_BACKOFF;
                }
            },
            Ok(Err(e)) if e.is_revoked() => {
                health.broken();
                link.mark_lost(
                    g,
                    "a fabric READ was denied (the DPM restarted or fenced us)",
                );
            }
            Ok(Err(e)) => {
                // The connection may be gone (tcp): connect again next time.
                health.broken();
                tracing::debug!(kn = link.kn_id, error = %e, "fabric probe failed");
                fabric = None;
            }
            Err(_) => {
                health.broken();
                fabric = None;
            }
        }
    }
}
