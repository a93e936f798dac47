//! Executing operations against a mapped region: the memory-node side semantics shared by the
//! shm backend (run by the caller's CPU) and the tcp NIC (run by the memory node's task).
//!
//! Invariants: operations run in posting order; a WRITE is persisted before the next operation
//! runs, so its completion means durable; CAS and FAA are atomic with respect to every other
//! CAS/FAA and 8-byte aligned store on the region, from any process.

use std::sync::atomic::Ordering;

use bytes::Bytes;

use crate::error::{FabricError, Result};
use crate::op::{Completion, Op};
use crate::pm::PmRegion;

/// Checks every operation's bounds and alignment before any is applied, so a bad post has no
/// effect at all.
pub fn validate(region: &PmRegion, ops: &[Op]) -> Result<()> {
    for op in ops {
        match op {
            Op::Read { offset, len } => region.check(*offset, u64::from(*len))?,
            Op::Write { offset, data } => region.check(*offset, data.len() as u64)?,
            Op::Cas { offset, .. } | Op::Faa { offset, .. } => {
                region.check(*offset, 8)?;
                if !offset.is_multiple_of(8) {
                    return Err(FabricError::Misaligned { offset: *offset });
                }
            }
        }
    }
    Ok(())
}

/// Applies operations like [`apply`], ordered against the region's mirror (see
/// [`crate::mirror`]): a post that changes the region runs under the mirror gate shared, so its
/// stores are recorded before any reader can take the gate; a post that reads takes the gate
/// exclusively once it has applied. The caller then waits for [`PmRegion::mirror_barrier`] before
/// it answers. Without a mirror this is [`apply`].
pub fn apply_mirrored(region: &PmRegion, ops: &[Op]) -> Result<Vec<Completion>> {
    if !region.is_mirrored() {
        return apply(region, ops);
    }
    let out = if crate::mirror::mutates(ops) {
        let _shared = region.mirror_gate().read();
        apply(region, ops)
    } else {
        apply(region, ops)
    };
    // A READ may have seen another post's store whose record is still being made: wait for
    // the changes in progress (the exclusive gate), so the barrier that follows covers them.
    if ops.iter().any(|op| matches!(op, Op::Read { .. })) {
        drop(region.mirror_gate().write());
    }
    out
}

/// Applies validated operations in order.
pub fn apply(region: &PmRegion, ops: &[Op]) -> Result<Vec<Completion>> {
    validate(region, ops)?;
    let mut out = Vec::with_capacity(ops.len());
    for op in ops {
        out.push(apply_one(region, op)?);
    }
    Ok(out)
}

fn apply_one(region: &PmRegion, op: &Op) -> Result<Completion> {
    Ok(match op {
        Op::Read { offset, len } => {
            let mut buf = vec![0u8; *len as usize];
            region.read(*offset, &mut buf)?;
            Completion::Read(Bytes::from(buf))
        }
        Op::Write { offset, data } => {
            region.write_durable(*offset, data)?;
            Completion::Written
        }
        Op::Cas {
            offset,
            expected,
            new,
        } => {
            let w = region.word(*offset)?;
            let old = match w.compare_exchange(*expected, *new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(v) | Err(v) => v,
            };
            region.persist(*offset, 8)?;
            Completion::Cas { old }
        }
        Op::Faa { offset, add } => {
            let old = region.word(*offset)?.fetch_add(*add, Ordering::AcqRel);
            region.persist(*offset, 8)?;
            Completion::Faa { old }
        }
    })
}
