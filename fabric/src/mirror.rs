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

/// True when a post changes the region (WRITE, CAS or FAA).
pub fn mutates(ops: &[Op]) -> bool {
    ops.iter().any(|op| !matches!(op, Op::Read { .. }))
}
