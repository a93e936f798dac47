//! dinomo-fabric: the one-sided memory fabric between KV nodes and the DPM, and the PM regions
//! it reaches.
//!
//! A [`Fabric`] handle belongs to one caller (a KN shard, a test, the DPM's own tools). It posts
//! READ, WRITE, CAS and FAA operations against one registered region with an [`AccessKey`];
//! operations posted together run in order and are waited for once (one round trip, doorbell
//! batching). A completed WRITE is durable at the memory node. Every handle counts its round
//! trips, operations and bytes in the same way on every backend.
//!
//! Backends: [`shm`] (same host, the caller maps the pool and the memory node's CPU does
//! nothing), [`tcp`] (an emulated NIC task in the memory node), and `verbs` (feature `rdma`).
//! [`conformance`] is the one test suite every backend must pass.

pub mod conformance;
pub mod error;
pub mod exec;
pub mod fault;
pub mod grants;
pub mod mirror;
pub mod op;
pub mod pinning;
pub mod pm;
pub mod powerloss;
pub mod shm;
pub mod stats;
pub mod tcp;
#[cfg(feature = "rdma")]
pub mod verbs;

use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;

pub use error::{FabricError, Result};
pub use op::{AccessKey, Completion, Op};
pub use pm::{Durability, DurabilityRequest, PmRegion};
pub use powerloss::{PersistHook, PowerLossImage, PowerLossStats};
pub use stats::{FabricStats, StatsSnapshot};

/// A caller's handle on one remote region.
#[async_trait]
pub trait Fabric: Send + Sync + fmt::Debug {
    /// Posts `ops` together and waits for all of them: one round trip. Completions come back in
    /// posting order. On error, operations before the failing one may have been applied.
    async fn post(&self, ops: &[Op]) -> Result<Vec<Completion>>;

    /// This handle's counters.
    fn stats(&self) -> &FabricStats;

    /// The backend's name: "shm", "tcp" or "verbs".
    fn backend(&self) -> &'static str;
}

/// Single-operation conveniences over [`Fabric::post`]; each is one round trip.
#[async_trait]
pub trait FabricExt: Fabric {
    async fn read(&self, offset: u64, len: u32) -> Result<Bytes> {
        let mut c = self.post(&[Op::Read { offset, len }]).await?;
        c.pop()
            .and_then(Completion::into_read)
            .ok_or_else(|| FabricError::Protocol("READ completed without data".into()))
    }

    async fn write(&self, offset: u64, data: Bytes) -> Result<()> {
        self.post(&[Op::Write { offset, data }]).await.map(|_| ())
    }

    /// Compare-and-swap; returns the old value (the swap happened iff it equals `expected`).
    async fn cas(&self, offset: u64, expected: u64, new: u64) -> Result<u64> {
        let c = self
            .post(&[Op::Cas {
                offset,
                expected,
                new,
            }])
            .await?;
        c.first()
            .and_then(Completion::old_value)
            .ok_or_else(|| FabricError::Protocol("CAS completed without a value".into()))
    }

    /// Fetch-and-add; returns the old value.
    async fn faa(&self, offset: u64, add: u64) -> Result<u64> {
        let c = self.post(&[Op::Faa { offset, add }]).await?;
        c.first()
            .and_then(Completion::old_value)
            .ok_or_else(|| FabricError::Protocol("FAA completed without a value".into()))
    }
}

impl<T: Fabric + ?Sized> FabricExt for T {}

macro_rules! forward_fabric {
    ($ty:ty) => {
        #[async_trait]
        impl<T: Fabric + ?Sized> Fabric for $ty {
            async fn post(&self, ops: &[Op]) -> Result<Vec<Completion>> {
                (**self).post(ops).await
            }
            fn stats(&self) -> &FabricStats {
                (**self).stats()
            }
            fn backend(&self) -> &'static str {
                (**self).backend()
            }
        }
    };
}
forward_fabric!(Box<T>);
forward_fabric!(std::sync::Arc<T>);
