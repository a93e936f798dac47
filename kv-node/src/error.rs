//! Errors of a KV operation, and the one place they become gRPC statuses.

use dinomo_proto::MAP_VERSION_TRAILER;
use tonic::{Code, Status};

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("key not found")]
    NotFound,
    #[error("update of a missing key (use mode UPSERT or INSERT to create it)")]
    UpdateMissing,
    #[error("insert of an existing key (use mode UPSERT or UPDATE to replace it)")]
    AlreadyExists,
    #[error("wrong owner: KN {kn} does not own this key under cluster map version {map_version}; refresh the map and retry at the owner")]
    WrongOwner { kn: u32, map_version: u64 },
    /// A PrepareMap or CommitMap whose map is not the next version after this KN's (checked
    /// after taking the published map).
    #[error(
        "{rpc} of cluster map version {offered} refused: this KN has map version {kn} \
         (after taking the published map if it was behind), and a map change moves exactly \
         one version on, to {}",
        .kn.saturating_add(1)
    )]
    MapVersion {
        rpc: &'static str,
        kn: u64,
        offered: u64,
    },
    #[error("unavailable: {0}; retry after a backoff")]
    Unavailable(String),
    /// The DPM's pool is full; the message says what is full and what to do.
    #[error("resource exhausted: {0}")]
    ResourceExhausted(String),
    #[error("outcome unknown: {0}; the write may or may not have been applied")]
    OutcomeUnknown(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl KvError {
    pub fn code(&self) -> Code {
        match self {
            KvError::InvalidArgument(_) => Code::InvalidArgument,
            KvError::NotFound | KvError::UpdateMissing => Code::NotFound,
            KvError::AlreadyExists => Code::AlreadyExists,
            KvError::WrongOwner { .. } | KvError::MapVersion { .. } => Code::FailedPrecondition,
            KvError::Unavailable(_) => Code::Unavailable,
            KvError::ResourceExhausted(_) => Code::ResourceExhausted,
            KvError::OutcomeUnknown(_) => Code::Unknown,
            KvError::Internal(_) => Code::Internal,
        }
    }

    pub fn map_version(&self) -> u64 {
        match self {
            KvError::WrongOwner { map_version, .. } => *map_version,
            _ => 0,
        }
    }
}

impl From<KvError> for Status {
    fn from(e: KvError) -> Status {
        let mut s = Status::new(e.code(), e.to_string());
        // Marks the status as the KN's own answer (not a transport failure on the way).
        s.metadata_mut().insert(
            dinomo_proto::KN_ANSWER_TRAILER,
            tonic::metadata::MetadataValue::from_static("1"),
        );
        if let KvError::WrongOwner { map_version, .. } = e {
            if let Ok(v) = map_version.to_string().parse() {
                s.metadata_mut().insert(MAP_VERSION_TRAILER, v);
            }
        }
        s
    }
}

impl From<dinomo_fabric::FabricError> for KvError {
    fn from(e: dinomo_fabric::FabricError) -> Self {
        KvError::Unavailable(format!("DPM fabric: {e}"))
    }
}

pub type KvResult<T> = Result<T, KvError>;
