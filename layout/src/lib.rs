//! dinomo-layout: the bytes on persistent memory, shared by KV nodes (which write log segments
//! and read the index with one-sided operations) and the DPM (which formats the pool, merges,
//! and collects garbage). Pure encode/decode and traversal helpers; no I/O.
//!
//! Every structure is little-endian, 8-byte aligned, and described byte by byte in
//! docs/formats.md. Anything read back from PM is untrusted: decoders check magic, version,
//! lengths and checksums and return [`LayoutError`], never panic.

pub mod index;
pub mod log;
pub mod meta;
pub mod segment;
pub mod superblock;

/// The pool format this code reads and writes. Bumped on any incompatible change.
pub const FORMAT_VERSION: u32 = 2;

/// Why bytes read from PM were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("{what}: bad magic (found {found:#018x}, expected {expected:#018x})")]
    BadMagic {
        what: &'static str,
        found: u64,
        expected: u64,
    },
    #[error("{what}: format version {found} found, this build reads version {expected}")]
    Version {
        what: &'static str,
        found: u32,
        expected: u32,
    },
    #[error("{what}: checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum {
        what: &'static str,
        stored: u32,
        computed: u32,
    },
    #[error("{what}: need {need} bytes, have {have}")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    #[error("{what}: {detail}")]
    Invalid { what: &'static str, detail: String },
}

pub type Result<T, E = LayoutError> = std::result::Result<T, E>;

/// The key hash used by the index and by placement on PM. Stable across processes, builds and
/// versions of this crate (xxh3-64 with seed 0): changing it is a format change.
pub fn key_hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(key)
}

/// Rounds `n` up to a multiple of 8.
pub const fn align8(n: usize) -> usize {
    (n + 7) & !7
}

pub(crate) fn need(what: &'static str, buf: &[u8], need: usize) -> Result<()> {
    if buf.len() < need {
        Err(LayoutError::Truncated {
            what,
            need,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
