//! Errors of the DPM library. The gRPC service maps each to a status in one place
//! (service.rs); callers in this crate only propagate.

use dinomo_fabric::FabricError;
use dinomo_layout::LayoutError;

#[derive(Debug, thiserror::Error)]
pub enum DpmError {
    /// The pool file cannot be used; the message says what was found.
    #[error("pool {path}: {detail}")]
    BadPool { path: String, detail: String },
    #[error("pool {path}: {source}")]
    Layout { path: String, source: LayoutError },
    #[error(transparent)]
    Fabric(#[from] FabricError),
    #[error("no free log segment left ({count} segments in the pool, all in use)")]
    OutOfSegments { count: u64 },
    #[error("the index heap is full ({used} of {len} bytes used); format a larger pool or raise index_fraction")]
    IndexHeapFull { used: u64, len: u64 },
    #[error("KN {kn} is not registered")]
    UnknownKn { kn: u32 },
    #[error("KN {kn} epoch {epoch} is fenced (the DPM accepts epoch {fence} or later)")]
    Fenced { kn: u32, epoch: u64, fence: u64 },
    #[error("KN id {kn} is out of range (0..{max})")]
    KnOutOfRange { kn: u32, max: u32 },
    #[error("segment {segment}: {detail}")]
    BadSegment { segment: u64, detail: String },
    #[error("metadata of {len} bytes does not fit the {cap}-byte metadata area")]
    MetadataTooLarge { len: usize, cap: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("configuration: {0}")]
    Config(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T, E = DpmError> = std::result::Result<T, E>;
