//! Mirroring a region's persists to replicas (the memory node's backups, docs/decisions/0007).
//!
//! A [`PersistMirror`] installed on a [`PmRegion`] is told of every persist, after the local
//! write-back, with the range it covered; it copies the covered 64-byte lines, whole (as CLWB
//! writes back whole lines), and ships them to the replicas in the order it was told. A replica
//! that applies them in that order always holds a state the primary's persistence domain went
//! through, with possibly some lines newer: exactly what a power failure of the primary may
//! leave (see [`crate::powerloss`]), so the same recovery makes it consistent.
//!
//! Recording does not wait for the replicas: the order alone keeps a replica consistent.
//! What a caller is told is durable must wait for them: the tcp NIC answers a post only after
//! [`PmRegion::mirror_barrier`] (every line recorded before it is at every replica that must
//! acknowledge), and the memory node does the same before it answers a control request.
//!
//! Visibility: a READ must not observe a store that may still be lost with the primary (a KN
//! that read another KN's CAS on an indirect cell would serve a value the replicas never got).
//! A post that changes the region runs under [`PmRegion::mirror_gate`] shared, so its stores
//! and their records are made together; a post that reads (only, or also) takes the gate
//! exclusively once it has applied, which waits for the changes in progress to be recorded,
//! and then waits for the barrier like a write. Stores of the memory node's own CPU (merge, GC, metadata) are not
//! gated: what a KN may read of them is either rebuilt by recovery (index pieces) or answered
//! through the control path, which waits for the barrier.
//!
//! On fabrics whose posts never reach the memory node's CPU (shm, verbs) none of this runs for
//! a KN's posts: the KN forwards each store, and each indirect-cell read, to the memory node,
//! which persists the ranges (recording them) and answers after the barrier (`ForwardWrites`,
//! docs/decisions/0007 "One-sided fabrics").

use std::future::Future;
use std::pin::Pin;

use crate::error::Result;
use crate::op::Op;
use crate::pm::PmRegion;

/// A future that resolves when the replicas acknowledged (or failed to).
pub type BarrierFuture = Pin<Box<dyn Future<Output = Result<()>> + Send + 'static>>;

/// Receives a region's persists and ships them to the replicas.
pub trait PersistMirror: Send + Sync + std::fmt::Debug {
    /// `[offset, offset + len)` was just persisted locally: queue its lines for every replica.
    /// May block only to bound the bytes queued; never waits for an acknowledgement.
    fn record(&self, region: &PmRegion, offset: u64, len: u64) -> Result<()>;

    /// Resolves once every line recorded before this call is durable at every replica that
    /// must acknowledge, or with an error when one of them cannot (the caller must not say
    /// "durable"; what it did stays applied on the primary, with an unknown outcome).
    fn barrier(&self) -> BarrierFuture;
}

/// The mirror of a region whose replication ended for good (its node stops, or was deposed):
/// records nothing, and every barrier fails with the reason. Installed in place of the
/// replicator rather than removing the mirror: a region without a mirror passes every barrier
/// at once, so a control call or a post that applied its change just before the stop, and
/// takes its barrier just after, would be acknowledged on this node alone.
#[derive(Debug)]
pub struct Ended(pub String);

impl PersistMirror for Ended {
    fn record(&self, _region: &PmRegion, _offset: u64, _len: u64) -> Result<()> {
        Ok(())
    }

    fn barrier(&self) -> BarrierFuture {
        Box::pin(std::future::ready(Err(
            crate::error::FabricError::Transport(self.0.clone()),
        )))
    }
}

/// True when a post changes the region (WRITE, CAS or FAA).
pub fn mutates(ops: &[Op]) -> bool {
    ops.iter().any(|op| !matches!(op, Op::Read { .. }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A region whose replication ended fails every barrier; without a mirror it would pass.
    #[tokio::test]
    async fn an_ended_mirror_fails_every_barrier() {
        let dir = tempfile::tempdir().unwrap();
        let r = PmRegion::create(
            &dir.path().join("p"),
            1 << 20,
            crate::pm::DurabilityRequest::ProcessCrash,
        )
        .unwrap();
        assert!(
            r.mirror_barrier().await.is_ok(),
            "no mirror: passes at once"
        );
        r.set_mirror(Some(std::sync::Arc::new(Ended("stopping".into()))));
        r.write_durable(0, &[1u8; 64]).unwrap();
        let e = r.mirror_barrier().await.unwrap_err();
        assert!(e.to_string().contains("stopping"), "{e}");
    }
}
