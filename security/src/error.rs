//! What can go wrong while loading credentials or building a secured channel.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error("{0}")]
    Missing(String),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    BadCertificate { path: PathBuf, reason: String },
    #[error("bad address {addr:?}: {reason}")]
    BadAddress { addr: String, reason: String },
    #[error("issuing a certificate: {0}")]
    Issue(String),
}
