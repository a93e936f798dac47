//! Log segments: their header (written by the DPM when it hands the segment to a KN) and the
//! DPM's segment table (one 32-byte entry per segment: state, owner, allocation generation,
//! position in the owner's log chain, merge progress).
//!
//! Invariants: a segment's header is persisted before the KN is told the segment exists; the
//! generation is strictly increasing across allocations of the same segment, so the log checksum
//! chain (seeded from the header) never accepts a batch left over from an earlier use.

use crate::{need, u32_at, u64_at, LayoutError, Result, FORMAT_VERSION};

pub const HEADER_MAGIC: u64 = u64::from_le_bytes(*b"DNMSEG01");
pub const HEADER_SIZE: usize = 64;
pub const TABLE_ENTRY_SIZE: u64 = 32;

/// The first 64 bytes of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    pub kn_id: u32,
    /// The KN's registration epoch when the segment was allocated.
    pub epoch: u64,
    pub segment_id: u64,
    /// Allocation generation of this segment (from the segment table).
    pub generation: u64,
    /// Position in the log's chain (0, 1, 2, ...): merge order across segments.
    pub chain_seq: u64,
    /// Which of the KN's logs (one per shard) this segment belongs to.
    pub stream: u16,
}

impl SegmentHeader {
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        b[0..8].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&self.kn_id.to_le_bytes());
        b[12..16].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[16..24].copy_from_slice(&self.epoch.to_le_bytes());
        b[24..32].copy_from_slice(&self.segment_id.to_le_bytes());
        b[32..40].copy_from_slice(&self.generation.to_le_bytes());
        b[40..48].copy_from_slice(&self.chain_seq.to_le_bytes());
        b[48..50].copy_from_slice(&self.stream.to_le_bytes());
        let crc = crc32c::crc32c(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self> {
        need("segment header", b, HEADER_SIZE)?;
        let magic = u64_at(b, 0);
        if magic != HEADER_MAGIC {
            return Err(LayoutError::BadMagic {
                what: "segment header",
                found: magic,
                expected: HEADER_MAGIC,
            });
        }
        let version = u32_at(b, 12);
        if version != FORMAT_VERSION {
            return Err(LayoutError::Version {
                what: "segment",
                found: version,
                expected: FORMAT_VERSION,
            });
        }
        let stored = u32_at(b, 60);
        let computed = crc32c::crc32c(&b[..60]);
        if stored != computed {
            return Err(LayoutError::Checksum {
                what: "segment header",
                stored,
                computed,
            });
        }
        Ok(SegmentHeader {
            kn_id: u32_at(b, 8),
            epoch: u64_at(b, 16),
            segment_id: u64_at(b, 24),
            generation: u64_at(b, 32),
            chain_seq: u64_at(b, 40),
            stream: u16::from_le_bytes([b[48], b[49]]),
        })
    }

    /// The seed of the segment's batch checksum chain: the header's own checksum, which covers
    /// the generation.
    pub fn chain_seed(&self) -> u32 {
        let b = self.encode();
        u32_at(&b, 60)
    }
}

/// Life cycle of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum SegState {
    Free = 0,
    /// Handed to a KN, which appends batches to it.
    Open = 1,
    /// The KN will not append any more; waiting for (or under) merge.
    Sealed = 2,
    /// Every batch is in the index; waits for its entries to die.
    Merged = 3,
    /// Holds index buckets, not a log: a chunk of home buckets (stream [`CHUNK_BUCKETS`],
    /// chain_seq = chunk number) or of overflow buckets (stream [`CHUNK_OVERFLOW`]). Owner is
    /// [`INDEX_OWNER`].
    Index = 4,
}

/// Stream value of an index segment holding home buckets.
pub const CHUNK_BUCKETS: u16 = 0;
/// Stream value of an index segment holding overflow buckets.
pub const CHUNK_OVERFLOW: u16 = 1;
/// Owner (kn_id) recorded for index segments.
pub const INDEX_OWNER: u32 = u32::MAX - 1;

impl SegState {
    pub fn from_u8(v: u8) -> Result<Self> {
        Ok(match v {
            0 => SegState::Free,
            1 => SegState::Open,
            2 => SegState::Sealed,
            3 => SegState::Merged,
            4 => SegState::Index,
            other => {
                return Err(LayoutError::Invalid {
                    what: "segment table",
                    detail: format!("unknown segment state {other}"),
                })
            }
        })
    }
}

/// One segment-table entry. Word 0 packs state and owner so that a state change is a single
/// atomic 8-byte store: `state u8 | 0 u8 | stream u16 | kn_id u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableEntry {
    pub state: SegState,
    pub kn_id: u32,
    /// The KN's log (one per shard) the segment belongs to; merge order is per (kn, stream).
    pub stream: u16,
    pub generation: u64,
    pub chain_seq: u64,
    /// Offset inside the segment up to which batches are merged (the start of the next batch).
    pub merged_upto: u64,
}

impl TableEntry {
    pub const FREE: TableEntry = TableEntry {
        state: SegState::Free,
        kn_id: 0,
        stream: 0,
        generation: 0,
        chain_seq: 0,
        merged_upto: 0,
    };

    pub fn state_word(state: SegState, kn_id: u32, stream: u16) -> u64 {
        (state as u64) | (u64::from(stream) << 16) | (u64::from(kn_id) << 32)
    }

    pub fn words(&self) -> [u64; 4] {
        [
            Self::state_word(self.state, self.kn_id, self.stream),
            self.generation,
            self.chain_seq,
            self.merged_upto,
        ]
    }

    pub fn from_words(w: [u64; 4]) -> Result<Self> {
        Ok(TableEntry {
            state: SegState::from_u8(w[0] as u8)?,
            kn_id: (w[0] >> 32) as u32,
            stream: (w[0] >> 16) as u16,
            generation: w[1],
            chain_seq: w[2],
            merged_upto: w[3],
        })
    }
}
