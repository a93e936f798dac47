//! Mutable roots and the cluster-metadata area.
//!
//! Roots: a 4 KiB area of 8-byte words, each changed by one atomic store (or CAS) and then
//! persisted: where the index header is, and the counters that must never go backwards
//! (segment generations, KN registration epochs).
//!
//! Metadata: two slots (A/B), each `seq u64 | len u32 | crc u32 | bytes`. An update writes the
//! slot not holding the newest valid copy, persists it, and is then the newest (higher seq), so
//! a crash in the middle leaves the previous copy readable.

use crate::{need, u32_at, u64_at, LayoutError, Result};

pub const ROOTS_SIZE: u64 = 4096;

/// Offsets of the root words inside the roots area.
#[derive(Debug, Clone, Copy)]
pub struct Roots;

impl Roots {
    /// Pool offset of the index header (the start of the index area); 0 until the index is
    /// created. Word 8 is reserved (format 1's heap pointer).
    pub const INDEX_TABLE: u64 = 0;
    /// Last segment allocation generation handed out.
    pub const SEGMENT_GENERATION: u64 = 16;
    /// Last KN registration epoch handed out.
    pub const KN_EPOCH: u64 = 24;
    // Word 32 is reserved (format 1's table being retired).
    /// First word of the per-KN fence table: word `KN_FENCE + 8 * kn_id` holds the lowest
    /// epoch the DPM still accepts from that KN.
    pub const KN_FENCE: u64 = 512;
    /// KN ids that fit the fence table.
    pub const MAX_KNS: u32 = ((ROOTS_SIZE - 512) / 8) as u32;
}

pub const SLOT_HEADER: usize = 16;

/// Encodes a metadata slot image.
pub fn encode_slot(seq: u64, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(SLOT_HEADER + data.len());
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&(data.len() as u32).to_le_bytes());
    b.extend_from_slice(&[0u8; 4]);
    b.extend_from_slice(data);
    let mut crc = crc32c::crc32c(&b[..12]);
    crc = crc32c::crc32c_append(crc, data);
    b[12..16].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Decodes a metadata slot; `Ok(None)` for a never-written (all-zero header) slot.
pub fn decode_slot(b: &[u8]) -> Result<Option<(u64, &[u8])>> {
    need("metadata slot", b, SLOT_HEADER)?;
    let seq = u64_at(b, 0);
    let len = u32_at(b, 8) as usize;
    if seq == 0 && len == 0 && u32_at(b, 12) == 0 {
        return Ok(None);
    }
    need("metadata slot", b, SLOT_HEADER + len)?;
    let data = &b[SLOT_HEADER..SLOT_HEADER + len];
    let computed = crc32c::crc32c_append(crc32c::crc32c(&b[..12]), data);
    let stored = u32_at(b, 12);
    if stored != computed {
        return Err(LayoutError::Checksum {
            what: "metadata slot",
            stored,
            computed,
        });
    }
    Ok(Some((seq, data)))
}
