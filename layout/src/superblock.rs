//! The superblock: the first 4 KiB of the pool. It names the format version and where every
//! area lies. Written once when the pool is formatted; never changed afterwards (all mutable
//! roots live in the areas it points to), so it cannot be torn by a crash after formatting.
//!
//! Areas, in pool order: superblock | root area | segment table | metadata | index area |
//! segments. Every offset is 4 KiB aligned; segments are `segment_size` aligned.

use crate::{need, u32_at, u64_at, LayoutError, Result, FORMAT_VERSION};

pub const MAGIC: u64 = u64::from_le_bytes(*b"DINOMOPL");
pub const SUPERBLOCK_SIZE: u64 = 4096;
/// Bytes covered by the checksum: every field before it.
const ENCODED: usize = 128;

/// Where each area of the pool lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    pub pool_len: u64,
    pub pool_id: u64,
    pub created_unix: u64,
    pub segment_size: u64,
    pub segment_count: u64,
    /// Area of mutable 8-byte roots (see [`crate::meta::Roots`]).
    pub roots_off: u64,
    pub segment_table_off: u64,
    pub metadata_off: u64,
    pub metadata_len: u64,
    pub index_area_off: u64,
    pub index_area_len: u64,
    pub segments_off: u64,
}

impl Superblock {
    pub fn encode(&self) -> [u8; ENCODED + 4] {
        let mut b = [0u8; ENCODED + 4];
        b[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        let words = [
            self.pool_len,
            self.pool_id,
            self.created_unix,
            self.segment_size,
            self.segment_count,
            self.roots_off,
            self.segment_table_off,
            self.metadata_off,
            self.metadata_len,
            self.index_area_off,
            self.index_area_len,
            self.segments_off,
        ];
        for (i, w) in words.iter().enumerate() {
            b[16 + i * 8..24 + i * 8].copy_from_slice(&w.to_le_bytes());
        }
        let crc = crc32c::crc32c(&b[..ENCODED]);
        b[ENCODED..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a superblock: magic, version, checksum, then that the areas are in
    /// order, aligned and inside `pool_len` (so a corrupted offset can never send a reader out of
    /// the mapping).
    pub fn decode(b: &[u8]) -> Result<Self> {
        need("superblock", b, ENCODED + 4)?;
        let magic = u64_at(b, 0);
        if magic != MAGIC {
            return Err(LayoutError::BadMagic {
                what: "superblock",
                found: magic,
                expected: MAGIC,
            });
        }
        let version = u32_at(b, 8);
        if version != FORMAT_VERSION {
            return Err(LayoutError::Version {
                what: "pool",
                found: version,
                expected: FORMAT_VERSION,
            });
        }
        let stored = u32_at(b, ENCODED);
        let computed = crc32c::crc32c(&b[..ENCODED]);
        if stored != computed {
            return Err(LayoutError::Checksum {
                what: "superblock",
                stored,
                computed,
            });
        }
        let w = |i: usize| u64_at(b, 16 + i * 8);
        let sb = Superblock {
            pool_len: w(0),
            pool_id: w(1),
            created_unix: w(2),
            segment_size: w(3),
            segment_count: w(4),
            roots_off: w(5),
            segment_table_off: w(6),
            metadata_off: w(7),
            metadata_len: w(8),
            index_area_off: w(9),
            index_area_len: w(10),
            segments_off: w(11),
        };
        sb.validate()?;
        Ok(sb)
    }

    fn validate(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(LayoutError::Invalid {
                what: "superblock",
                detail,
            })
        };
        if self.segment_size < 64 << 10 || !self.segment_size.is_power_of_two() {
            return bad(format!(
                "segment size {} is not a power of two >= 64 KiB",
                self.segment_size
            ));
        }
        let areas = [
            ("roots", self.roots_off, crate::meta::ROOTS_SIZE),
            (
                "segment table",
                self.segment_table_off,
                self.segment_count
                    .saturating_mul(crate::segment::TABLE_ENTRY_SIZE),
            ),
            ("metadata", self.metadata_off, self.metadata_len),
            ("index area", self.index_area_off, self.index_area_len),
            (
                "segments",
                self.segments_off,
                self.segment_count.saturating_mul(self.segment_size),
            ),
        ];
        let mut end = SUPERBLOCK_SIZE;
        for (name, off, len) in areas {
            if !off.is_multiple_of(4096) || off < end {
                return bad(format!(
                    "{name} area at {off} overlaps the previous area or is unaligned"
                ));
            }
            end = match off.checked_add(len) {
                Some(e) => e,
                None => return bad(format!("{name} area length {len} overflows")),
            };
        }
        if end > self.pool_len {
            return bad(format!(
                "areas end at {end}, past the pool length {}",
                self.pool_len
            ));
        }
        if !self.segments_off.is_multiple_of(self.segment_size) {
            return bad("segments area is not aligned to the segment size".into());
        }
        Ok(())
    }

    /// Lays out a pool of `pool_len` bytes with segments of `segment_size` bytes. The index
    /// area is small and fixed: the index header, the chunk directory (a word per segment) and
    /// `max_cells` indirect cells; the index's buckets live in segments (see crate::index).
    pub fn plan(
        pool_len: u64,
        segment_size: u64,
        metadata_len: u64,
        max_cells: u64,
    ) -> Result<Self> {
        let bad = |detail: String| {
            Err(LayoutError::Invalid {
                what: "pool plan",
                detail,
            })
        };
        if !segment_size.is_power_of_two() || segment_size < 64 << 10 {
            return bad(format!(
                "segment size {segment_size} must be a power of two >= 64 KiB"
            ));
        }
        if max_cells > 1 << 20 {
            return bad(format!(
                "{max_cells} indirect cells is more than the 1048576 a pool may hold"
            ));
        }
        // Checked: absurd sizes (from a config file) must be refused, not wrap around.
        let too_big = || {
            LayoutError::Invalid {
            what: "pool plan",
            detail: format!(
                "pool of {pool_len} bytes, {metadata_len} bytes of metadata, segments of {segment_size} bytes: \
                 the areas do not fit in 64-bit offsets"
            ),
        }
        };
        let up = |x: u64, a: u64| x.checked_next_multiple_of(a).ok_or_else(too_big);
        let roots_off = SUPERBLOCK_SIZE;
        let segment_table_off = up(roots_off + crate::meta::ROOTS_SIZE, 4096)?;
        // Upper bound of segments, to size the table before knowing the heap.
        let max_segments = pool_len / segment_size;
        let metadata_off = up(
            segment_table_off + max_segments * crate::segment::TABLE_ENTRY_SIZE,
            4096,
        )?;
        let metadata_len = up(metadata_len.max(8192), 4096)?;
        let index_area_off = metadata_off.checked_add(metadata_len).ok_or_else(too_big)?;
        let index_area_len = up(
            crate::index::INDEX_AREA_HEADER
                + crate::index::directory_len(max_segments)
                + max_cells * crate::index::CELL_SIZE,
            4096,
        )?;
        let segments_off = up(
            index_area_off
                .checked_add(index_area_len)
                .ok_or_else(too_big)?,
            segment_size,
        )?;
        if segments_off >= pool_len {
            return bad(format!(
                "a pool of {pool_len} bytes has no room for segments"
            ));
        }
        let segment_count = (pool_len - segments_off) / segment_size;
        if segment_count < 4 {
            return bad(format!(
                "a pool of {pool_len} bytes holds only {segment_count} segments of {segment_size}; need at least 4"
            ));
        }
        let sb = Superblock {
            pool_len,
            pool_id: 0,
            created_unix: 0,
            segment_size,
            segment_count,
            roots_off,
            segment_table_off,
            metadata_off,
            metadata_len,
            index_area_off,
            index_area_len,
            segments_off,
        };
        sb.validate()?;
        Ok(sb)
    }

    /// Pool offset of segment `id`.
    pub fn segment_offset(&self, id: u64) -> u64 {
        self.segments_off + id * self.segment_size
    }

    /// Which segment holds pool offset `off`, if any.
    pub fn segment_of(&self, off: u64) -> Option<u64> {
        if off < self.segments_off {
            return None;
        }
        let id = (off - self.segments_off) / self.segment_size;
        (id < self.segment_count).then_some(id)
    }
}
