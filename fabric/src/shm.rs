//! The shm backend: the caller maps the pool file itself (MAP_SHARED) and performs the loads,
//! stores, atomics and persists with its own CPU. Truly one-sided: the memory node's CPU does
//! nothing. Access is checked against the grant table (also mapped) before every post, and
//! again after it: a post whose key was revoked while it was being applied (the caller was
//! fenced meanwhile, and may have been paused or descheduled between its check and its
//! stores) fails with `FabricError::RevokedDuringPost`, so it is never acknowledged as done;
//! its bytes may still have landed after the fence returned (see grants.rs).
//!
//! Write windows are checked the same way: every WRITE, CAS and FAA must lie in the window the
//! memory node published for the key in the grant table (else `FabricError::OutsideWindow`,
//! nothing applied), and after the stores the window is re-checked: a post whose range left
//! the window meanwhile (its segment was sealed under the caller) fails with
//! `FabricError::WindowClosedDuringPost`, outcome unknown. The caller maps the pool
//! read-write and can read the grant table's secrets, so these checks stop a buggy caller,
//! not a malicious one: shm is a single-trust-domain fabric (docs/operations.md).

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;

use crate::error::Result;
use crate::exec;
use crate::grants::GrantTable;
use crate::op::{AccessKey, Completion, Op};
use crate::pm::{DurabilityRequest, PmRegion};
use crate::stats::FabricStats;
use crate::Fabric;

/// A caller's shm handle.
#[derive(Debug)]
pub struct ShmFabric {
    region: Arc<PmRegion>,
    grants: Arc<GrantTable>,
    key: AccessKey,
    stats: FabricStats,
}

impl ShmFabric {
    /// Maps the pool at `pool` and its grant table, as a KN in another process does.
    pub fn connect(pool: &Path, key: AccessKey, durability: DurabilityRequest) -> Result<Self> {
        let region = Arc::new(PmRegion::open(pool, durability)?);
        let grants = Arc::new(GrantTable::open(&GrantTable::path_for(pool))?);
        grants.check(key)?;
        Ok(Self::from_parts(region, grants, key))
    }

    /// A handle on mappings this process already has (tests, tools in the DPM process).
    pub fn from_parts(region: Arc<PmRegion>, grants: Arc<GrantTable>, key: AccessKey) -> Self {
        ShmFabric {
            region,
            grants,
            key,
            stats: FabricStats::default(),
        }
    }

    pub fn region(&self) -> &Arc<PmRegion> {
        &self.region
    }

    /// The grant table this handle checks its key against (its own mapping of the file).
    pub fn grants(&self) -> &Arc<GrantTable> {
        &self.grants
    }
}

#[async_trait]
impl Fabric for ShmFabric {
    async fn post(&self, ops: &[Op]) -> Result<Vec<Completion>> {
        self.grants.check(self.key)?;
        exec::validate(&self.region, ops)?;
        let seq = self.grants.check_window(self.key, ops)?;
        self.grants.run_post_hook(self.key);
        self.stats.record_post(ops);
        let done = exec::apply(&self.region, ops);
        // Nothing in the memory node can wait for this CPU: a fence may have revoked the key,
        // or a seal taken a segment out of the window (and the DPM merged the log), between
        // the check and the stores. Such a post is not done, whatever the stores did; the
        // caller must treat it as outcome unknown.
        self.grants.recheck_post(self.key, ops, seq)?;
        done
    }

    fn stats(&self) -> &FabricStats {
        &self.stats
    }

    fn backend(&self) -> &'static str {
        "shm"
    }
}
