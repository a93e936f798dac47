//! The persistent hash index (P-CLHT-like buckets, grown by linear hashing) and indirect cells.
//!
//! Why linear hashing: the index must grow into whatever space the pool has free, never into
//! one contiguous table twice the old size (docs/decisions/0004-linear-hashing-index.md). The
//! table grows one bucket at a time, and its buckets live in *chunks*: log-segment-sized
//! pieces of the segment area, found through a directory, so any free segment can hold index.
//!
//! Shape: `2^level + split` home buckets. Bucket `b` lives in chunk `b / chunk_buckets` at
//! `(b % chunk_buckets) * 64`. A key with hash `h` lives in bucket `h mod 2^level`, or in
//! `h mod 2^(level+1)` when that first choice is below `split` (already split this round).
//!
//! Bucket: `next u64 | 3 x (key_hash u64, entry u64) | state u64`. A slot is empty while its
//! entry word is 0. Every word is written with one aligned 8-byte store, so a one-sided READ of
//! a bucket (atomic per 8-byte word) never sees a torn word; a reader may see a slot's hash and
//! entry from two different moments, which is harmless because it always compares the full key
//! in the fetched entry. The state word (last in the bucket, so a reader loads it after the
//! slots) holds [`DEPTH_TAG`] | depth: how many low hash bits every key of this bucket's chain
//! shares. Home and overflow buckets of one chain carry the same depth.
//!
//! Splitting bucket `s` at `level` L into `s` and `n = s + 2^L` (DPM only, one at a time):
//! 1. build `n`'s chain with the entries of `s` whose hash has bit L set; persist it, `n`'s
//!    home state (depth L+1) last: `n` is complete;
//! 2. set depth L+1 on every bucket of `s`'s chain, overflow buckets first and the home bucket
//!    last (the commit point), persisting each;
//! 3. zero the moved entries' slots in `s`'s chain;
//! 4. publish the new shape (one 8-byte store).
//!
//! Readers (KNs, with a shape that may be stale) start at depth `d` given by their shape and
//! check the depth of every bucket they read: a depth above `d` means the chain was split
//! under them, so they follow [`next_home`] to the bucket that holds their key at the deeper
//! depth. Entries are zeroed only after every bucket of the chain shows the new depth, so a
//! reader either sees the entry or the new depth. Chains never lose buckets while the DPM runs
//! (emptied overflow buckets stay linked and are refilled), so a reader never follows a bucket
//! that was reused for another chain.
//!
//! Entry words (in slots and indirect cells) are [`EntryPtr`]: the pool offset of a log entry
//! with its length, so a reader fetches a whole entry with one READ.

use crate::{need, u32_at, u64_at, LayoutError, Result};

pub const BUCKET_SIZE: usize = 64;
pub const SLOTS: usize = 3;
/// Bytes a reader fetches at the header's offset: the immutable header and the shape word.
pub const INDEX_HEADER_SIZE: usize = 128;
pub const INDEX_MAGIC: u64 = u64::from_le_bytes(*b"DNMINDX2");
/// Offset of the mutable shape word inside the index header (its own cache line).
pub const SHAPE_OFFSET: usize = 64;
/// High bits of a live bucket's state word; the low 8 bits are its depth.
pub const DEPTH_TAG: u64 = 0x4450_5448_0000_0000; // "DPTH" in the high half
const DEPTH_MASK: u64 = 0xff;
/// Deepest depth a bucket may claim (hashes are 64 bits).
pub const MAX_DEPTH: u32 = 63;

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

/// The index area (superblock `index_area_off`): the index header (its first
/// [`INDEX_HEADER_SIZE`] bytes) in a 4 KiB page, then the chunk directory, then the cells.
pub const INDEX_AREA_HEADER: u64 = 4096;
/// An indirect cell: one 8-byte word in its own cache line.
pub const CELL_SIZE: u64 = 64;

/// Bytes of a chunk directory for a pool of `max_chunks` segments (4 KiB aligned).
pub const fn directory_len(max_chunks: u64) -> u64 {
    (max_chunks * 8).div_ceil(4096) * 4096
}

/// Where the parts of the index area lie, derived from the superblock alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexArea {
    pub header_off: u64,
    pub directory_off: u64,
    pub max_chunks: u64,
    pub cells_off: u64,
    pub cells: u64,
}

impl IndexArea {
    pub fn of(sb: &crate::superblock::Superblock) -> Self {
        let directory_off = sb.index_area_off + INDEX_AREA_HEADER;
        let max_chunks = sb.segment_count;
        let cells_off = directory_off + directory_len(max_chunks);
        let end = sb.index_area_off + sb.index_area_len;
        IndexArea {
            header_off: sb.index_area_off,
            directory_off,
            max_chunks,
            cells_off,
            cells: end.saturating_sub(cells_off) / CELL_SIZE,
        }
    }

    /// Pool offset of cell `i`.
    pub fn cell(&self, i: u64) -> u64 {
        self.cells_off + i * CELL_SIZE
    }

    /// Which cell lies at pool offset `off`, if any.
    pub fn cell_index(&self, off: u64) -> Option<u64> {
        let i = off.checked_sub(self.cells_off)? / CELL_SIZE;
        (i < self.cells && off.is_multiple_of(CELL_SIZE)).then_some(i)
    }
}

/// The state word of a bucket whose chain has `depth`.
pub const fn depth_word(depth: u32) -> u64 {
    DEPTH_TAG | depth as u64
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

    /// The depth of this bucket's chain, or `None` if the bucket is not (yet) part of the
    /// table (state word without the tag: never initialised, or being built).
    pub fn depth(&self) -> Option<u32> {
        (self.state & !DEPTH_MASK == DEPTH_TAG)
            .then_some((self.state & DEPTH_MASK) as u32)
            .filter(|d| *d <= MAX_DEPTH)
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

/// How many home buckets the table has: `2^level + split`, `split < 2^level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub level: u32,
    pub split: u64,
}

impl Shape {
    pub fn word(self) -> u64 {
        (u64::from(self.level) << 56) | self.split
    }

    pub fn from_word(w: u64) -> Result<Self> {
        let s = Shape {
            level: (w >> 56) as u32,
            split: w & ((1 << 56) - 1),
        };
        if s.level >= MAX_DEPTH || s.split >= 1u64 << s.level {
            return Err(LayoutError::Invalid {
                what: "index shape",
                detail: format!("level {} split {} is impossible", s.level, s.split),
            });
        }
        Ok(s)
    }

    pub fn buckets(self) -> u64 {
        (1u64 << self.level) + self.split
    }

    /// The home bucket of `hash` and the depth of its chain, by this shape.
    pub fn home(self, hash: u64) -> (u64, u32) {
        let b = hash & ((1u64 << self.level) - 1);
        if b < self.split {
            (hash & ((1u64 << (self.level + 1)) - 1), self.level + 1)
        } else {
            (b, self.level)
        }
    }

    /// The shape after one more split.
    pub fn grown(self) -> Shape {
        if self.split + 1 == 1u64 << self.level {
            Shape {
                level: self.level + 1,
                split: 0,
            }
        } else {
            Shape {
                level: self.level,
                split: self.split + 1,
            }
        }
    }
}

/// A reader at `depth` found a bucket of its chain at `bucket_depth`: where does its key live
/// now? Returns `None` if the bucket at hand still covers the key (keep walking this chain at
/// the new depth), or `Some((bucket, depth))` of the home bucket to read instead. Steps one
/// hash bit at a time, because only the bucket one split away is guaranteed to exist.
pub fn next_home(hash: u64, bucket: u64, depth: u32, bucket_depth: u32) -> Option<(u64, u32)> {
    let mut d = depth;
    while d < bucket_depth && d < MAX_DEPTH {
        if hash & (1u64 << d) != 0 {
            return Some((bucket | (1u64 << d), d + 1));
        }
        d += 1;
    }
    None
}

/// The immutable part of the index header (at the pool offset the `INDEX_TABLE` root names),
/// written at format time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexHeader {
    /// Buckets per chunk (a power of two: segment size / 64).
    pub chunk_buckets: u64,
    /// Pool offset of the chunk directory: `max_chunks` words, word `j` = pool offset of
    /// chunk `j` (0 while absent).
    pub directory_off: u64,
    pub max_chunks: u64,
    /// Level of a new table (its first `2^min_level` buckets are made at format time).
    pub min_level: u32,
}

impl IndexHeader {
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..8].copy_from_slice(&INDEX_MAGIC.to_le_bytes());
        b[8..16].copy_from_slice(&self.chunk_buckets.to_le_bytes());
        b[16..24].copy_from_slice(&self.directory_off.to_le_bytes());
        b[24..32].copy_from_slice(&self.max_chunks.to_le_bytes());
        b[32..36].copy_from_slice(&self.min_level.to_le_bytes());
        let crc = crc32c::crc32c(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes the 64-byte immutable header.
    pub fn decode(b: &[u8]) -> Result<Self> {
        need("index header", b, 64)?;
        let magic = u64_at(b, 0);
        if magic != INDEX_MAGIC {
            return Err(LayoutError::BadMagic {
                what: "index header",
                found: magic,
                expected: INDEX_MAGIC,
            });
        }
        let stored = u32_at(b, 60);
        let computed = crc32c::crc32c(&b[..60]);
        if stored != computed {
            return Err(LayoutError::Checksum {
                what: "index header",
                stored,
                computed,
            });
        }
        let h = IndexHeader {
            chunk_buckets: u64_at(b, 8),
            directory_off: u64_at(b, 16),
            max_chunks: u64_at(b, 24),
            min_level: u32_at(b, 32),
        };
        let dir_fits = h
            .max_chunks
            .checked_mul(8)
            .and_then(|n| n.checked_add(h.directory_off))
            .is_some();
        if !h.chunk_buckets.is_power_of_two()
            || h.min_level >= MAX_DEPTH
            || !h.directory_off.is_multiple_of(8)
            || h.max_chunks == 0
            || !dir_fits
        {
            return Err(LayoutError::Invalid {
                what: "index header",
                detail: format!(
                    "chunk of {} buckets, directory at {} with {} chunks, min level {}",
                    h.chunk_buckets, h.directory_off, h.max_chunks, h.min_level
                ),
            });
        }
        Ok(h)
    }

    /// Decodes the header and the shape word from the [`INDEX_HEADER_SIZE`] bytes a reader
    /// fetches.
    pub fn decode_with_shape(b: &[u8]) -> Result<(Self, Shape)> {
        need("index header", b, INDEX_HEADER_SIZE)?;
        let h = Self::decode(b)?;
        let shape = Shape::from_word(u64_at(b, SHAPE_OFFSET))?;
        if shape.level < h.min_level {
            return Err(LayoutError::Invalid {
                what: "index shape",
                detail: format!("level {} below the minimum {}", shape.level, h.min_level),
            });
        }
        Ok((h, shape))
    }

    /// Which chunk holds bucket `b`, and the bucket's byte offset inside it.
    pub fn locate(&self, b: u64) -> (u64, u64) {
        (
            b / self.chunk_buckets,
            (b % self.chunk_buckets) * BUCKET_SIZE as u64,
        )
    }

    /// Pool offset of directory word `chunk`.
    pub fn directory_word(&self, chunk: u64) -> u64 {
        self.directory_off + 8 * chunk
    }
}

/// Why a chain walk over untrusted bytes stopped early.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WalkError {
    /// A `next` pointer (or the start) is outside the image or not 64-byte aligned.
    OutOfBounds(u64),
    /// More buckets than `max_steps`: a cycle, or a chain longer than any the DPM builds.
    TooLong,
}

/// Walks the bucket chain starting at `start` over a pool image, calling `f(offset, bucket)`
/// for each bucket until `f` returns `false` or the chain ends. Every offset is checked
/// against the image and the walk is bounded by `max_steps`, so arbitrary bytes can neither
/// send it out of bounds nor loop forever. The DPM's own traversals and the fuzz target use it.
pub fn walk_chain(
    image: &[u8],
    start: u64,
    max_steps: usize,
    mut f: impl FnMut(u64, &Bucket) -> bool,
) -> std::result::Result<(), WalkError> {
    let mut off = start;
    for _ in 0..max_steps {
        let at = usize::try_from(off).map_err(|_| WalkError::OutOfBounds(off))?;
        if !off.is_multiple_of(BUCKET_SIZE as u64)
            || at.checked_add(BUCKET_SIZE).is_none_or(|e| e > image.len())
        {
            return Err(WalkError::OutOfBounds(off));
        }
        let b = Bucket::decode(&image[at..at + BUCKET_SIZE]).expect("64 bytes");
        if !f(off, &b) || b.next == 0 {
            return Ok(());
        }
        off = b.next;
    }
    Err(WalkError::TooLong)
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

    #[test]
    fn shapes_grow_one_bucket_at_a_time() {
        let mut s = Shape { level: 2, split: 0 };
        for n in 4..40 {
            assert_eq!(s.buckets(), n);
            assert_eq!(Shape::from_word(s.word()), Ok(s));
            // Every hash maps to an existing bucket, with the depth of that bucket.
            for h in 0..256u64 {
                let (b, d) = s.home(h);
                assert!(b < s.buckets());
                assert_eq!(b, h & ((1 << d) - 1));
            }
            s = s.grown();
        }
        assert!(Shape::from_word((3u64 << 56) | 8).is_err());
    }

    #[test]
    fn next_home_steps_one_bit() {
        // Bucket 1 read at depth 1 says depth 3. Hash ...101: bit 1 is clear (stays in 1),
        // bit 2 is set -> bucket 5 at depth 3.
        assert_eq!(next_home(0b101, 1, 1, 3), Some((5, 3)));
        // hash ...011: bit 1 set -> bucket 3 at depth 2 (which may itself have split further).
        assert_eq!(next_home(0b011, 1, 1, 3), Some((3, 2)));
        // hash ...001: bits 1 and 2 clear -> the bucket at hand still covers it.
        assert_eq!(next_home(0b001, 1, 1, 3), None);
        assert_eq!(next_home(0b111, 1, 3, 3), None);
    }

    #[test]
    fn walk_chain_is_bounded() {
        let mut img = vec![0u8; 256];
        // Bucket at 64 links to 128, which links back to 64: a cycle.
        img[64..72].copy_from_slice(&128u64.to_le_bytes());
        img[128..136].copy_from_slice(&64u64.to_le_bytes());
        let mut n = 0;
        assert_eq!(
            walk_chain(&img, 64, 10, |_, _| {
                n += 1;
                true
            }),
            Err(WalkError::TooLong)
        );
        assert_eq!(n, 10);
        img[128..136].copy_from_slice(&1000u64.to_le_bytes());
        assert_eq!(
            walk_chain(&img, 64, 10, |_, _| true),
            Err(WalkError::OutOfBounds(1000))
        );
        img[128..136].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(walk_chain(&img, 64, 10, |_, _| true), Ok(()));
        assert_eq!(
            walk_chain(&img, 3, 10, |_, _| true),
            Err(WalkError::OutOfBounds(3))
        );
    }

    #[test]
    fn header_round_trip_and_refusals() {
        let h = IndexHeader {
            chunk_buckets: 1 << 17,
            directory_off: 4096,
            max_chunks: 127,
            min_level: 10,
        };
        let mut b = vec![0u8; INDEX_HEADER_SIZE];
        b[..64].copy_from_slice(&h.encode());
        b[SHAPE_OFFSET..SHAPE_OFFSET + 8].copy_from_slice(
            &Shape {
                level: 10,
                split: 3,
            }
            .word()
            .to_le_bytes(),
        );
        assert_eq!(
            IndexHeader::decode_with_shape(&b),
            Ok((
                h,
                Shape {
                    level: 10,
                    split: 3
                }
            ))
        );
        b[SHAPE_OFFSET..SHAPE_OFFSET + 8]
            .copy_from_slice(&Shape { level: 9, split: 3 }.word().to_le_bytes());
        assert!(IndexHeader::decode_with_shape(&b).is_err());
        b[9] ^= 1;
        assert!(matches!(
            IndexHeader::decode(&b),
            Err(LayoutError::Checksum { .. })
        ));
        assert_eq!(h.locate((1 << 17) + 5), (1, 5 * 64));
    }
}
