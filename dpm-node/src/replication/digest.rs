//! Chunk digests of a pool, for the incremental copy: a backup that already holds a pool
//! answers its attach with the digest of each chunk, and the primary copies only the chunks
//! whose digest differs from its own (see [`super::replicator`] for why skipping an equal
//! chunk is the same as copying it).
//!
//! Invariants:
//! - Both sides cut the pool in the chunks the attach names (a power of two, at least
//!   [`MIN_CHUNK_BYTES`], at most [`MAX_CHUNKS`] of them) and hash with the key the primary
//!   draws for each attach.
//! - A digest is keyed BLAKE3 over the chunk's bytes, truncated to 128 bits: clients choose
//!   much of what a pool holds, and without the key they cannot make a chunk that digests like
//!   another one (a keyed cryptographic hash, not a fast checksum, for that reason).
//! - A backup's digests are of bytes made durable first, when its pool promises more than
//!   surviving a process crash ([`file_digests`] with `sync`): a skipped chunk is never
//!   rewritten, so nothing else would make it durable before the backup records its copy
//!   complete.

use std::fs::File;
use std::os::unix::fs::FileExt;

/// The smallest chunk (also what one WRITE of the copy carries).
pub const MIN_CHUNK_BYTES: u64 = 1 << 20;
/// Most chunks of one pool: bounds the attach's answer (16 bytes each: 1 MiB).
pub const MAX_CHUNKS: u64 = 1 << 16;
/// Bytes of one chunk's digest on the wire.
pub const DIGEST_BYTES: usize = 16;
/// Bytes of the key an attach carries.
pub const KEY_BYTES: usize = 32;

/// The digest key of one attach.
pub type Key = [u8; KEY_BYTES];

/// The chunk size for a pool of `pool_bytes`: 1 MiB, or the next power of two that keeps the
/// pool within 65,536 chunks.
pub fn chunk_bytes_for(pool_bytes: u64) -> u64 {
    pool_bytes
        .div_ceil(MAX_CHUNKS)
        .next_power_of_two()
        .max(MIN_CHUNK_BYTES)
}

/// Whether `chunk_bytes` may cut a pool of `pool_bytes` (what a backup accepts).
pub fn valid_chunk_bytes(pool_bytes: u64, chunk_bytes: u64) -> bool {
    chunk_bytes.is_power_of_two()
        && chunk_bytes >= MIN_CHUNK_BYTES
        && chunk_count(pool_bytes, chunk_bytes) <= MAX_CHUNKS
}

/// How many chunks of `chunk_bytes` cover `pool_bytes` (the last may be short).
pub fn chunk_count(pool_bytes: u64, chunk_bytes: u64) -> u64 {
    pool_bytes.div_ceil(chunk_bytes)
}

/// The digest of one chunk's bytes.
pub fn digest(key: &Key, bytes: &[u8]) -> u128 {
    let h = blake3::keyed_hash(key, bytes);
    u128::from_le_bytes(h.as_bytes()[..DIGEST_BYTES].try_into().expect("16 bytes"))
}

/// The digests of the first `len` bytes of the pool file `file`, chunk by chunk, as the attach
/// answers them. With `sync` the file is synced first (see the module doc); then each chunk
/// is read with `pread` (an I/O error is an error, not a SIGBUS through a mapping), except the
/// chunks the file system reports as holes (`SEEK_DATA`): zeroes, known without reading them.
/// Reading a hole would fill the page cache with zero pages (a 1 GiB pool holding 20 MiB took
/// 2.1 s to digest on the test VM through its mapping). Holes are trusted after a sync, or on
/// file systems known to report pages written through a mapping and not yet written back as
/// data (ext4, XFS, btrfs, tmpfs); elsewhere every chunk is read.
///
/// Reads what the pool holds: call it off the async runtime's threads.
pub fn file_digests(
    file: &File,
    len: u64,
    chunk_bytes: u64,
    key: &Key,
    sync: bool,
) -> std::io::Result<Vec<u8>> {
    if sync {
        file.sync_data()?;
    }
    let trust_holes = sync || holes_reported_before_writeback(file);
    let mut out = Vec::with_capacity(chunk_count(len, chunk_bytes) as usize * DIGEST_BYTES);
    let mut buf = vec![0u8; chunk_bytes.min(len) as usize];
    let full_zero = digest(key, &vec![0u8; chunk_bytes.min(len) as usize]);
    let mut off = 0;
    while off < len {
        let n = chunk_bytes.min(len - off);
        let d = if trust_holes && n == chunk_bytes.min(len) && !has_data(file, off, off + n) {
            full_zero
        } else {
            let chunk = &mut buf[..n as usize];
            file.read_exact_at(chunk, off)?;
            digest(key, chunk)
        };
        out.extend_from_slice(&d.to_le_bytes());
        off += n;
    }
    Ok(out)
}

/// Whether `file` lies on a file system whose `SEEK_DATA` counts dirty pages not yet written
/// back (delayed allocation included): ext4, XFS, btrfs, tmpfs.
fn holes_reported_before_writeback(file: &File) -> bool {
    use std::os::fd::AsRawFd;
    const EXT4: i64 = 0xEF53;
    const XFS: i64 = 0x5846_5342;
    const BTRFS: i64 = 0x9123_683E;
    const TMPFS: i64 = 0x0102_1994;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: fstatfs writes a statfs into the buffer it is given, on a descriptor borrowed
    // for the call.
    if unsafe { libc::fstatfs(file.as_raw_fd(), st.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: fstatfs succeeded, so it filled the struct.
    #[allow(clippy::unnecessary_cast)] // f_type is i64 here, another integer on other targets
    let kind = unsafe { st.assume_init() }.f_type as i64;
    [EXT4, XFS, BTRFS, TMPFS].contains(&kind)
}

/// Whether `file` may hold data in `[start, end)`: false only when the file system says the
/// range is a hole (`SEEK_DATA` finds no data before `end`); any doubt reads the chunk.
fn has_data(file: &File, start: u64, end: u64) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(start) = libc::off_t::try_from(start) else {
        return true;
    };
    // SAFETY: lseek on a descriptor this function borrows; it only moves the file offset,
    // which nothing else uses (the pool is read with pread and written through its mapping).
    let at = unsafe { libc::lseek(file.as_raw_fd(), start, libc::SEEK_DATA) };
    if at < 0 {
        // ENXIO: no data from `start` to the end of the file.
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO);
    }
    (at as u64) < end
}

/// The digests of a pool of `pool_bytes` that holds only zeroes (a backup's fresh pool),
/// without reading one.
pub fn zero_digests(pool_bytes: u64, chunk_bytes: u64, key: &Key) -> Vec<u8> {
    let count = chunk_count(pool_bytes, chunk_bytes);
    let full = digest(key, &vec![0u8; chunk_bytes.min(pool_bytes) as usize]).to_le_bytes();
    let mut out = Vec::with_capacity(count as usize * DIGEST_BYTES);
    for i in 0..count {
        let n = chunk_bytes.min(pool_bytes - i * chunk_bytes);
        if n == chunk_bytes.min(pool_bytes) {
            out.extend_from_slice(&full);
        } else {
            out.extend_from_slice(&digest(key, &vec![0u8; n as usize]).to_le_bytes());
        }
    }
    out
}

/// What the primary knows of a backup's pool when it starts copying: the digests it answered.
#[derive(Debug, Clone)]
pub struct BackupChunks {
    pub chunk_bytes: u64,
    key: Key,
    digests: Vec<u128>,
    /// The digest of a whole chunk of zeroes (most of a young pool).
    zero: u128,
}

impl BackupChunks {
    /// Checks an attach's answer against the pool's size; `Err` says what is wrong.
    pub fn from_wire(
        pool_bytes: u64,
        chunk_bytes: u64,
        key: Key,
        wire: &[u8],
    ) -> Result<Self, String> {
        let want = chunk_count(pool_bytes, chunk_bytes) as usize * DIGEST_BYTES;
        if wire.len() != want {
            return Err(format!(
                "{} bytes of chunk digests for a pool of {pool_bytes} bytes in chunks of \
                 {chunk_bytes}: expected {want}",
                wire.len()
            ));
        }
        let digests = wire
            .chunks_exact(DIGEST_BYTES)
            .map(|d| u128::from_le_bytes(d.try_into().expect("16 bytes")))
            .collect();
        let zero = digest(&key, &vec![0u8; chunk_bytes.min(pool_bytes) as usize]);
        Ok(BackupChunks {
            chunk_bytes,
            key,
            digests,
            zero,
        })
    }

    /// Whether the backup's chunk `index` holds exactly `bytes`. A chunk of zeroes is
    /// compared without hashing it.
    pub fn holds(&self, index: u64, bytes: &[u8]) -> bool {
        let Some(&held) = self.digests.get(index as usize) else {
            return false;
        };
        if bytes.len() as u64 == self.chunk_bytes && is_zero(bytes) {
            return held == self.zero;
        }
        held == digest(&self.key, bytes)
    }
}

/// Whether `b` holds only zero bytes: compared with a page of zeroes, which the standard
/// library does with `memcmp`, fast in any build. A replica's first copy checks every chunk of
/// the pool, and in the debug build on the emulated test VM that copy once took 31 s for a
/// 64 MiB pool and two backups (mostly reading words one bounds-checked call at a time, see
/// `PmRegion::read_words`; a word loop here was part of it).
pub fn is_zero(b: &[u8]) -> bool {
    const ZEROES: [u8; 4096] = [0; 4096];
    b.chunks(ZEROES.len()).all(|c| c == &ZEROES[..c.len()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use dinomo_fabric::{DurabilityRequest, PmRegion};

    #[test]
    fn chunks_are_one_mib_until_the_pool_needs_more_than_65536() {
        assert_eq!(chunk_bytes_for(4096), 1 << 20);
        assert_eq!(chunk_bytes_for(64 << 30), 1 << 20);
        assert_eq!(chunk_bytes_for((64 << 30) + 4096), 2 << 20);
        assert_eq!(chunk_bytes_for(1 << 40), 16 << 20);
        for len in [4096, 64 << 30, (64 << 30) + 4096, 1 << 40] {
            assert!(valid_chunk_bytes(len, chunk_bytes_for(len)));
        }
        assert!(
            valid_chunk_bytes(1 << 30, 4 << 20),
            "larger chunks are fine"
        );
        assert!(!valid_chunk_bytes(1 << 30, 3 << 20));
        assert!(!valid_chunk_bytes(1 << 30, 4096));
        assert!(!valid_chunk_bytes(1 << 40, 1 << 20), "too many chunks");
    }

    #[test]
    fn is_zero_finds_a_single_byte_anywhere() {
        assert!(is_zero(&[]));
        for len in [1, 7, 4095, 4096, 4097, 3 * 4096 + 13] {
            let mut b = vec![0u8; len];
            assert!(is_zero(&b), "{len} zeroes");
            for at in [0, len / 2, len - 1] {
                b[at] = 0x80;
                assert!(!is_zero(&b), "byte {at} of {len}");
                b[at] = 0;
            }
        }
    }

    /// A zero-filled pool's digests are what `zero_digests` computes without reading, a byte
    /// written through a mapping changes exactly its chunk's digest (it is data, not a hole),
    /// and another key changes every digest.
    #[test]
    fn digests_follow_the_bytes_and_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p");
        let len = (3 << 20) + 8192; // a short last chunk
        let r = PmRegion::create(&path, len, DurabilityRequest::ProcessCrash).unwrap();
        let file = File::open(&path).unwrap();
        let chunk = chunk_bytes_for(len);
        let key = [7u8; KEY_BYTES];
        let zero = file_digests(&file, len, chunk, &key, false).unwrap();
        assert_eq!(zero, zero_digests(len, chunk, &key));
        assert_eq!(zero.len(), 4 * DIGEST_BYTES);
        r.write_durable((2 << 20) + 64, &[1u8; 8]).unwrap();
        let changed = file_digests(&file, len, chunk, &key, false).unwrap();
        for i in 0..4 {
            let (a, b) = (
                &zero[i * DIGEST_BYTES..][..DIGEST_BYTES],
                &changed[i * DIGEST_BYTES..][..DIGEST_BYTES],
            );
            assert_eq!(a == b, i != 2, "chunk {i}");
        }
        let other_key = file_digests(&file, len, chunk, &[8u8; KEY_BYTES], true).unwrap();
        assert!(changed
            .chunks(DIGEST_BYTES)
            .zip(other_key.chunks(DIGEST_BYTES))
            .all(|(a, b)| a != b));

        let known = BackupChunks::from_wire(len, chunk, key, &changed).unwrap();
        let mut buf = vec![0u8; chunk as usize];
        r.read(2 << 20, &mut buf).unwrap();
        assert!(known.holds(2, &buf));
        let zeroes = vec![0u8; chunk as usize];
        assert!(
            known.holds(0, &zeroes),
            "a zero chunk, compared without hashing"
        );
        assert!(!known.holds(2, &zeroes));
        assert!(!known.holds(1, &buf));
        assert!(!known.holds(9, &buf), "out of range holds nothing");
        assert!(BackupChunks::from_wire(len, chunk, key, &changed[16..]).is_err());
    }
}
