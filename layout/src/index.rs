//! The persistent hash index (P-CLHT-like) and indirect cells.
//!
//! A table is `bucket_count` (a power of two) 64-byte buckets, chained through overflow buckets.
//! Bucket: `next u64 | 3 x (key_hash u64, entry u64) | state u64`. A slot is empty while its
//! entry word is 0. Every word is written with one aligned 8-byte store, so a one-sided READ of
//! a bucket (atomic per 8-byte word) never sees a torn word; a reader may see a slot's hash and
//! entry from two different moments, which is harmless because it always compares the full key
//! in the fetched entry (P-CLHT's out-of-place values give the same guarantee).
//!
//! Writers (the DPM's merge workers) never change a slot from one live key to another: deletes
//! zero the entry word first, then the hash. New overflow buckets are fully written and persisted
//! before the `next` word that links them is stored.
//!
//! Resize builds a whole new table, publishes it by one 8-byte store of the root word, then
//! marks every bucket of the old table RETIRED; a reader that fetches a retired bucket re-reads
//! the root. Writers are paused for the whole resize, so the old table is never stale while it
//! is reachable.
//!
//! Entry words (in slots and indirect cells) are [`EntryPtr`]: the pool offset of a log entry
//! with its length, so a reader fetches a whole entry with one READ.

use crate::{need, u32_at, u64_at, LayoutError, Result};

pub const BUCKET_SIZE: usize = 64;
pub const SLOTS: usize = 3;
pub const TABLE_HEADER_SIZE: usize = 64;
pub const TABLE_MAGIC: u64 = u64::from_le_bytes(*b"DNMTABLE");
/// Value of a bucket's state word once its table has been replaced.
pub const RETIRED: u64 = 0x5245_5449_5245_4421; // "RETIRED!"

/// Byte offset of slot `i`'s hash word inside a bucket (its entry word follows).
pub const fn slot_hash_offset(i: usize) -> usize {
    8 + i * 16
}
pub const fn slot_entry_offset(i: usize) -> usize {
    16 + i * 16
}
pub const STATE_OFFSET: usize = 56;

const OFFSET_BITS: u32 = 48;
const OFFSET_MASK: u64 = (1 << OFFSET_BITS) - 1;

/// Where a log entry lies: pool offset (48 bits) and length in 8-byte units (16 bits; 0 when
/// the entry is longer than 512 KiB, and the reader must fetch its header first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EntryPtr {
    pub offset: u64,
    /// Padded length in bytes, or 0 when unknown.
    pub len: u32,
}

impl EntryPtr {
    pub fn new(offset: u64, len: usize) -> Self {
        assert!(
            offset & !OFFSET_MASK == 0 && offset.is_multiple_of(8) && offset != 0,
            "bad entry offset {offset}"
        );
        let units = len.div_ceil(8);
        let len = if units <= u16::MAX as usize {
            (units * 8) as u32
        } else {
            0
        };
        EntryPtr { offset, len }
    }

    pub fn to_word(self) -> u64 {
        self.offset | (u64::from(self.len / 8) << OFFSET_BITS)
    }

    /// `None` for the empty word 0.
    pub fn from_word(w: u64) -> Option<Self> {
        (w != 0).then(|| EntryPtr {
            offset: w & OFFSET_MASK,
            len: ((w >> OFFSET_BITS) as u32) * 8,
        })
    }
}

/// A decoded bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Bucket {
    pub next: u64,
    pub slots: [(u64, u64); SLOTS],
    pub state: u64,
}

impl Bucket {
    pub fn decode(b: &[u8]) -> Result<Self> {
        need("index bucket", b, BUCKET_SIZE)?;
        let mut slots = [(0, 0); SLOTS];
        for (i, s) in slots.iter_mut().enumerate() {
            *s = (
                u64_at(b, slot_hash_offset(i)),
                u64_at(b, slot_entry_offset(i)),
            );
        }
        Ok(Bucket {
            next: u64_at(b, 0),
            slots,
            state: u64_at(b, STATE_OFFSET),
        })
    }

    pub fn encode(&self) -> [u8; BUCKET_SIZE] {
        let mut b = [0u8; BUCKET_SIZE];
        b[0..8].copy_from_slice(&self.next.to_le_bytes());
        for (i, (h, e)) in self.slots.iter().enumerate() {
            b[slot_hash_offset(i)..slot_hash_offset(i) + 8].copy_from_slice(&h.to_le_bytes());
            b[slot_entry_offset(i)..slot_entry_offset(i) + 8].copy_from_slice(&e.to_le_bytes());
        }
        b[STATE_OFFSET..].copy_from_slice(&self.state.to_le_bytes());
        b
    }

    pub fn is_retired(&self) -> bool {
        self.state == RETIRED
    }

    /// Entries whose slot hash equals `hash`: candidates whose key must be compared.
    pub fn candidates(&self, hash: u64) -> impl Iterator<Item = (usize, EntryPtr)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(move |(i, &(h, e))| {
                if h == hash {
                    EntryPtr::from_word(e).map(|p| (i, p))
                } else {
                    None
                }
            })
    }
}

/// The header of one table, written before the root points at it and never changed after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableHeader {
    pub bucket_count: u64,
    /// Pool offset of bucket 0; buckets are contiguous.
    pub buckets_off: u64,
    /// How many resizes led to this table.
    pub generation: u64,
}

impl TableHeader {
    pub fn encode(&self) -> [u8; TABLE_HEADER_SIZE] {
        let mut b = [0u8; TABLE_HEADER_SIZE];
        b[0..8].copy_from_slice(&TABLE_MAGIC.to_le_bytes());
        b[8..16].copy_from_slice(&self.bucket_count.to_le_bytes());
        b[16..24].copy_from_slice(&self.buckets_off.to_le_bytes());
        b[24..32].copy_from_slice(&self.generation.to_le_bytes());
        let crc = crc32c::crc32c(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        need("index table header", b, TABLE_HEADER_SIZE)?;
        let magic = u64_at(b, 0);
        if magic != TABLE_MAGIC {
            return Err(LayoutError::BadMagic {
                what: "index table header",
                found: magic,
                expected: TABLE_MAGIC,
            });
        }
        let stored = u32_at(b, 60);
        let computed = crc32c::crc32c(&b[..60]);
        if stored != computed {
            return Err(LayoutError::Checksum {
                what: "index table header",
                stored,
                computed,
            });
        }
        let h = TableHeader {
            bucket_count: u64_at(b, 8),
            buckets_off: u64_at(b, 16),
            generation: u64_at(b, 24),
        };
        // The bucket array must fit in 64-bit offsets, so `home_bucket` cannot overflow.
        let fits = h
            .bucket_count
            .checked_mul(BUCKET_SIZE as u64)
            .and_then(|n| n.checked_add(h.buckets_off))
            .is_some();
        if !h.bucket_count.is_power_of_two() || !h.buckets_off.is_multiple_of(64) || !fits {
            return Err(LayoutError::Invalid {
                what: "index table header",
                detail: format!(
                    "bucket count {} / offset {} invalid",
                    h.bucket_count, h.buckets_off
                ),
            });
        }
        Ok(h)
    }

    /// Pool offset of the home bucket of `hash`.
    pub fn home_bucket(&self, hash: u64) -> u64 {
        self.buckets_off + (hash & (self.bucket_count - 1)) * BUCKET_SIZE as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_ptr_words() {
        let p = EntryPtr::new(4096, 30);
        assert_eq!(p.len, 32);
        assert_eq!(EntryPtr::from_word(p.to_word()), Some(p));
        assert_eq!(EntryPtr::from_word(0), None);
        let big = EntryPtr::new(8, 1 << 20);
        assert_eq!(EntryPtr::from_word(big.to_word()).unwrap().len, 0);
    }
}
