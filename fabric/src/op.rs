//! The four one-sided operations and their completions, and the key that authorises them.
//!
//! Offsets are relative to the start of the registered region (the PM pool). A list of
//! operations posted together is executed in order and waited for once: one round trip.

use bytes::Bytes;

/// What a caller presents to reach a region: the grant slot, the slot's generation (bumped at
/// each grant, so a re-granted slot never accepts an old key) and a 128-bit secret drawn from
/// the OS CSPRNG when the slot was granted. The grant table compares secrets in constant time.
/// `Debug` does not print the secret.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct AccessKey {
    pub slot: u32,
    pub generation: u32,
    pub secret: [u8; 16],
}

impl std::fmt::Debug for AccessKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessKey")
            .field("slot", &self.slot)
            .field("generation", &self.generation)
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// Compares two byte strings of equal length in time independent of where they differ (the
/// length is not secret). The `black_box` keeps the compiler from turning the fold into an
/// early exit.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| std::hint::black_box(acc | (x ^ y)));
    std::hint::black_box(diff) == 0
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
