//! A deadline on every fabric post of a KN.
//!
//! A post that hangs (a memory node that stopped answering, a connection that went quiet)
//! would otherwise stall its shard for good. After [`POST_DEADLINE`] the post fails with
//! [`FabricError::TimedOut`]. It may still be applied later, so the shard reports its writes
//! as outcome-unknown and ends the session: registering again makes the DPM revoke the old
//! grant (a tcp revoke waits for posts already applying; a verbs revoke deregisters the old
//! key's memory regions, after which the device places nothing more through them) and merge
//! the old log before this KN writes anything new, so a late landing can never overtake a
//! newer write.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dinomo_fabric::{Completion, Fabric, FabricError, FabricStats, Op, Result};

/// How long one post (at most one batch of a few MiB) may take.
pub const POST_DEADLINE: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Deadline {
    inner: Arc<dyn Fabric>,
    limit: Duration,
}

impl Deadline {
    pub fn wrap(inner: Arc<dyn Fabric>, limit: Duration) -> Arc<dyn Fabric> {
        Arc::new(Deadline { inner, limit })
    }
}

#[async_trait]
impl Fabric for Deadline {
    async fn post(&self, ops: &[Op]) -> Result<Vec<Completion>> {
        tokio::time::timeout(self.limit, self.inner.post(ops))
            .await
            .unwrap_or(Err(FabricError::TimedOut {
                after_ms: self.limit.as_millis() as u64,
            }))
    }

    fn stats(&self) -> &FabricStats {
        self.inner.stats()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
}
