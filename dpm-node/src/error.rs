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
    /// A backup that must not become the primary (its copy is not a consistent image, or it
    /// could not serve its pool on the fabric it is configured for).
    #[error("this backup cannot be promoted: {detail}")]
    NotPromotable { detail: String },
    /// A Promote while this backup is being promoted already (by an earlier call, whose
    /// caller may not have had the answer): ALREADY_EXISTS, so a caller tells it from a
    /// refusal that changed nothing.
    #[error("this backup is being promoted already (an earlier Promote); poll Status until it answers as the primary")]
    BeingPromoted,
    /// Another process serves the pool (see `pool_lock`).
    #[error(
        "pool {pool} is in use: another dpm-node process{holder} holds its lock {lock}; two \
         processes serving one pool would corrupt it, so stop the other one first"
    )]
    PoolInUse {
        pool: String,
        lock: String,
        holder: String,
    },
    #[error(transparent)]
    Fabric(#[from] FabricError),
    /// No free segment for this kind of use: what is full and what to do.
    #[error(
        "the pool is full: {free} of {total} segments are free and {kept} are kept in reserve \
         (for the cleaner, index growth and deletes), so a {tier:?} allocation is refused; \
         delete or overwrite keys to free space (the cleaner compacts what they leave), or \
         move the data to a larger pool"
    )]
    PoolFull {
        free: u64,
        total: u64,
        kept: u64,
        tier: crate::segments::Tier,
    },
    #[error("all {cells} indirect cells of the pool are in use; de-replicate a key first")]
    CellsFull { cells: u64 },
    #[error("KN {kn} is not registered")]
    UnknownKn { kn: u32 },
    #[error("KN {kn} epoch {epoch} is fenced (the DPM accepts epoch {fence} or later)")]
    Fenced { kn: u32, epoch: u64, fence: u64 },
    /// The KN's epoch was granted by another dpm-node process (this one restarted, or took
    /// over as the primary): on shm the KN may still store into the old process's pool file.
    #[error(
        "KN {kn} epoch {epoch} is not a session of this dpm-node (it restarted, or took over \
         from another primary)"
    )]
    NoSession { kn: u32, epoch: u64 },
    /// A KN fenced under the cluster map published now asked to renew its serving lease: it
    /// may serve again only under a later map (which the fencing reconfiguration publishes).
    #[error(
        "KN {kn} was fenced under the cluster map published now; it may serve again only \
         once a new map is published"
    )]
    FencedUnderMap { kn: u32 },
    #[error("KN id {kn} is out of range (0..{max})")]
    KnOutOfRange { kn: u32, max: u32 },
    #[error("segment {segment}: {detail}")]
    BadSegment { segment: u64, detail: String },
    /// A compare-and-swap of a metadata entry found another value than the caller expected.
    #[error(
        "metadata {name:?} is {found}, not {expected} as the caller expected: it changed since \
         it was read (another writer, e.g. another monitor, published first); re-read it and \
         start over from the current value"
    )]
    MetadataChanged {
        name: String,
        /// What the caller expected ("absent" or "a value of N bytes").
        expected: String,
        found: String,
    },
    /// A call carried a monitor term older than the newest one started: it comes from a
    /// monitor that was deposed.
    #[error(
        "monitor term {term} is stale: term {newest} was started since, so another monitor \
         leads; this monitor must stop acting and re-check its leadership"
    )]
    StaleMonitorTerm { term: u64, newest: u64 },
    /// The cluster map may only be published with CompareAndPutMetadata (and never deleted).
    #[error(
        "metadata \"cluster/map\" is published only with CompareAndPutMetadata over the map it \
         replaces, and never deleted; {0}"
    )]
    MapNotByCas(&'static str),
    /// A map published at the DPM must be the next version of the one it replaces.
    #[error(
        "cluster map version {offered} does not follow {}: a publish is exactly version {}; \
         re-read the published map and start over from it",
        published_map(.published),
        .published.saturating_add(1)
    )]
    MapVersion {
        /// The published map's version (0: none published).
        published: u64,
        offered: u64,
    },
    /// A caller would add a metadata entry beyond [`crate::limits::MAX_METADATA_ENTRIES`].
    #[error(
        "metadata {name:?} is not added: the DPM holds {entries} metadata entries, the most it \
         keeps; delete unused ones first"
    )]
    MetadataFull { name: String, entries: usize },
    #[error("metadata of {len} bytes does not fit the {cap}-byte metadata area")]
    MetadataTooLarge { len: usize, cap: usize },
    /// The `verify_accounting` debug check found counters that differ from a recount.
    #[error("live-byte accounting differs from the index: {0}")]
    Accounting(String),
    /// A primary of an older replica term asked a backup to take its writes: a newer primary
    /// attached since (docs/decisions/0007-dpm-replication.md).
    #[error(
        "replica term {given} is refused: this backup accepted term {current} from another \
         primary, so a newer (or competing) primary exists; this primary must stop"
    )]
    StaleTerm { given: u64, current: u64 },
    /// An attaching primary's pool image is older than the term this backup accepted since.
    #[error(
        "replication: this backup accepted term {current}, newer than term {image} under which \
         the attaching primary's pool last served: another primary has served since, and this \
         pool may lack what it acknowledged; this primary must stop (promote the backup that \
         holds the newest copy instead)"
    )]
    StaleImage { image: u64, current: u64 },
    /// An attaching primary's pool image is of the term this backup accepted but is not the
    /// image it follows (another start of that term, or an older generation of its replica
    /// set: see `replication::image`).
    #[error(
        "replication: this backup refuses the attaching primary's pool: {detail}; copying it \
         over this backup could lose acknowledged writes, so this primary must stop"
    )]
    SupersededImage { detail: String },
    /// A CopyComplete call named another copy than the one in progress at the backup (a newer
    /// attach replaced it, or the backup restarted).
    #[error("replication: this backup refuses to mark the copy complete: {detail}")]
    StaleCopy { detail: String },
    /// A primary was asked to open a pool whose copy marker says a backup's copy of it was
    /// never finished (docs/decisions/0007-dpm-replication.md).
    #[error(
        "pool {pool}: refusing to open it as a primary: {marker} says it holds an unfinished \
         copy (term {term}) that a backup was receiving from its primary when it stopped. Such \
         a pool mixes copied chunks with zeroed ones; recovery would make it look consistent \
         while data is lost. Recover from the primary's own pool, or from a backup whose \
         marker says \"complete\" (one that was in sync). To open this one anyway, accepting \
         the loss, start the dpm-node with --accept-incomplete-copy"
    )]
    IncompleteCopy {
        pool: String,
        marker: String,
        term: u64,
    },
    /// A replication request reached a node in the other role, or the replicas did not
    /// acknowledge.
    #[error("replication: {0}")]
    Replication(String),
    /// A GC pass did not act because KNs kept swinging an indirect cell while it was copied
    /// to the backups (a passing condition: the next pass tries again).
    #[error(
        "the indirect cell at {offset} changed under each of {copies} copies to the backups: \
         nothing freed or cleaned this pass (KNs keep swinging it; the next pass tries again)"
    )]
    CellsChurning { offset: u64, copies: u32 },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("configuration: {0}")]
    Config(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

fn published_map(version: &u64) -> String {
    match version {
        0 => "an empty DPM (no map published)".to_string(),
        v => format!("the published version {v}"),
    }
}

pub type Result<T, E = DpmError> = std::result::Result<T, E>;
