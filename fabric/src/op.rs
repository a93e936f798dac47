//! The four one-sided operations and their completions, and the key that authorises them.
//!
//! Offsets are relative to the start of the registered region (the PM pool). A list of
//! operations posted together is executed in order and waited for once: one round trip.

use bytes::Bytes;

/// What a caller presents to reach a region: the grant slot and its token. The token's high 32
/// bits are the slot's generation, so a re-granted slot never accepts an old token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AccessKey {
    pub slot: u32,
    pub token: u64,
}

impl AccessKey {
    /// The generation part of the token (bumped each time the slot is granted).
    pub fn generation(&self) -> u32 {
        (self.token >> 32) as u32
    }
}

/// One one-sided operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Read `len` bytes at `offset`.
    Read { offset: u64, len: u32 },
    /// Write `data` at `offset`; complete means durable at the memory node.
    Write { offset: u64, data: Bytes },
    /// Compare-and-swap the 8-byte aligned word at `offset`; completes with the old value.
    Cas {
        offset: u64,
        expected: u64,
        new: u64,
    },
    /// Fetch-and-add on the 8-byte aligned word at `offset`; completes with the old value.
    Faa { offset: u64, add: u64 },
}

impl Op {
    /// Bytes this operation moves over the wire in payload (not headers).
    pub fn payload_len(&self) -> u64 {
        match self {
            Op::Read { len, .. } => u64::from(*len),
            Op::Write { data, .. } => data.len() as u64,
            Op::Cas { .. } | Op::Faa { .. } => 8,
        }
    }

    pub fn offset(&self) -> u64 {
        match self {
            Op::Read { offset, .. }
            | Op::Write { offset, .. }
            | Op::Cas { offset, .. }
            | Op::Faa { offset, .. } => *offset,
        }
    }
}

/// The completion of one operation, in the order the operations were posted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    Read(Bytes),
    Written,
    /// The value found before the CAS; the swap happened iff it equals `expected`.
    Cas {
        old: u64,
    },
    Faa {
        old: u64,
    },
}

impl Completion {
    pub fn into_read(self) -> Option<Bytes> {
        match self {
            Completion::Read(b) => Some(b),
            _ => None,
        }
    }

    pub fn old_value(&self) -> Option<u64> {
        match self {
            Completion::Cas { old } | Completion::Faa { old } => Some(*old),
            _ => None,
        }
    }
}
