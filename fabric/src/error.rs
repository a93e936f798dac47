//! Errors of the fabric. One enum for every backend, so that callers (KN shards, the DPM's
//! tests) handle "access revoked" or "connection lost" the same way whatever carries the bytes.

use std::io;

/// What went wrong with a posted operation or a region.
#[derive(Debug, thiserror::Error)]
pub enum FabricError {
    /// The access key was revoked (the caller was fenced) or never granted.
    #[error(
        "access denied: the key for grant slot {slot} is not valid (revoked or never granted)"
    )]
    AccessDenied { slot: u32 },
    /// The key was revoked while the post was being applied: the caller's own CPU applies shm
    /// posts and was between its check and the end of the post when the fence came. Its
    /// operations may or may not have been applied, and the fence (with the merge after it)
    /// may not have seen them: a WRITE of such a post has an unknown outcome, never "done".
    #[error(
        "access revoked during the post (grant slot {slot}): the caller was fenced while its \
         operations were being applied; they may or may not have taken effect"
    )]
    RevokedDuringPost { slot: u32 },
    /// A WRITE, CAS or FAA addressed bytes outside the key's write window (its open segments,
    /// and for CAS the indirect-cell space): nothing of the post was applied.
    #[error(
        "outside the write window of grant slot {slot}: {len} bytes at offset {offset} are not \
         in an open segment of this caller (CAS also reaches the cell space; READ reaches \
         everything)"
    )]
    OutsideWindow { slot: u32, offset: u64, len: u64 },
    /// shm: a range this post wrote in left the key's window while the post was being applied
    /// (the segment was sealed under the caller). Like [`FabricError::RevokedDuringPost`], the
    /// post's outcome is unknown.
    #[error(
        "the write window of grant slot {slot} lost the range of {len} bytes at offset {offset} \
         during the post (the segment was sealed under the caller); the operations may or may \
         not have taken effect"
    )]
    WindowClosedDuringPost { slot: u32, offset: u64, len: u64 },
    /// A key's write window already has its maximum number of ranges.
    #[error(
        "the write window of grant slot {slot} already has {limit} ranges; seal a segment first"
    )]
    WindowFull { slot: u32, limit: usize },
    /// An operation addressed bytes outside the registered region.
    #[error("out of bounds: offset {offset} + len {len} exceeds the region of {region_len} bytes")]
    OutOfBounds {
        offset: u64,
        len: u64,
        region_len: u64,
    },
    /// Atomic operations need an 8-byte aligned address.
    #[error("misaligned atomic at offset {offset}: CAS, FAA and word reads need 8-byte alignment")]
    Misaligned { offset: u64 },
    /// The transport failed; operations of this post may or may not have been applied.
    #[error("transport failed: {0}")]
    Transport(String),
    /// The peer answered with bytes that do not parse.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A post got no completion within its deadline. It may still be applied later: the
    /// caller must treat its outcome as unknown and stop using this session.
    #[error("no completion within {after_ms} ms")]
    TimedOut { after_ms: u64 },
    /// Injected by a fault plan (tests only).
    #[error("injected fault: {0}")]
    Injected(&'static str),
    /// Mapping or persisting a region failed.
    #[error("region I/O on {path}: {source}")]
    Region { path: String, source: io::Error },
    /// A configuration value is not usable.
    #[error("invalid fabric configuration: {0}")]
    Config(String),
}

impl FabricError {
    /// True when retrying on the same connection cannot help (the caller was fenced or made a
    /// programming error); false for transport trouble.
    pub fn is_permanent(&self) -> bool {
        !matches!(
            self,
            FabricError::Transport(_) | FabricError::Injected(_) | FabricError::TimedOut { .. }
        )
    }

    /// True when the error proves the caller's key is no longer valid (it was fenced, or the
    /// memory node restarted), rather than a network problem: the caller must register again.
    /// A [`FabricError::RevokedDuringPost`] or [`FabricError::WindowClosedDuringPost`] also
    /// leaves the post's outcome unknown.
    pub fn is_revoked(&self) -> bool {
        matches!(
            self,
            FabricError::AccessDenied { .. }
                | FabricError::RevokedDuringPost { .. }
                | FabricError::WindowClosedDuringPost { .. }
        )
    }
}

pub type Result<T, E = FabricError> = std::result::Result<T, E>;
