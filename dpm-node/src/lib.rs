//! dinomo-dpm-node: the disaggregated-PM node. It owns the pool (a mapped file, real PM on a
//! DAX filesystem), merges the log segments KV nodes write into a persistent hash index,
//! collects garbage, and keeps cluster metadata. Its CPU stays off the request path.
//!
//! Modules: [`pool`] (the file and its areas), [`prefault`] (faulting it in at start), [`index`] (P-CLHT-like table), [`segments`]
//! (allocator, log chains, live bytes), [`cells`] (indirect cells), [`merge`] (log -> index), [`gc`],
//! [`fenced_procs`] (shm KNs fenced while still running), [`metastore`], [`replication`]
//! (backups mirroring the pool), [`limits`] (what
//! callers may send), [`dpm`] (the whole node as a library), [`service`] (gRPC), [`config`],
//! [`server`] (runs it).

pub mod cells;
pub mod cli;
pub mod config;
pub mod dpm;
pub mod error;
pub mod fenced_procs;
pub mod gc;
pub mod index;
pub mod limits;
pub mod merge;
pub mod metastore;
pub mod pool;
pub mod pool_lock;
pub mod prefault;
pub mod replication;
pub mod segments;
pub mod server;
pub mod service;
pub mod testkit;
pub mod verbs_pins;

pub use dpm::{Dpm, Registration};
pub use error::{DpmError, Result};
