//! Errors of the SDK.

use tonic::Code;

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum ClientError {
    /// Insert of a key that exists.
    #[error("the key already exists")]
    AlreadyExists,
    /// Update of a key that does not exist.
    #[error("the key does not exist")]
    NotFound,
    /// The request is malformed (empty or oversized key or value...): fix it, retrying won't help.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A write failed in a way that hides whether it was applied (the KN or the connection
    /// died while it was in flight). Read the key to find out.
    #[error("outcome unknown: {0}")]
    OutcomeUnknown(String),
    /// The cluster's memory pool is full: the write was not applied. The message says what is
    /// full and what to do (delete or overwrite keys, or use a larger pool); retrying the
    /// same write right away won't help.
    #[error("resource exhausted: {0}")]
    ResourceExhausted(String),
    /// The cluster refused this caller's identity (no client certificate, or one whose role
    /// may not make this call): nothing was applied, and retrying with the same credentials
    /// won't help. The message names the call and the role it needs.
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// The deadline passed while the cluster was unavailable or reconfiguring.
    #[error("deadline exceeded after {attempts} attempts; last error: {last}")]
    DeadlineExceeded { attempts: u32, last: String },
    /// No routing node answered, or none has a cluster map yet.
    #[error("no cluster map: {0}")]
    NoMap(String),
    #[error("{0}")]
    Other(String),
}

impl ClientError {
    pub(crate) fn from_final_status(s: &tonic::Status) -> Self {
        match s.code() {
            Code::AlreadyExists => ClientError::AlreadyExists,
            Code::NotFound => ClientError::NotFound,
            Code::InvalidArgument => ClientError::InvalidArgument(s.message().to_string()),
            Code::ResourceExhausted => ClientError::ResourceExhausted(s.message().to_string()),
            _ => ClientError::Other(format!("{:?}: {}", s.code(), s.message())),
        }
    }
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;
