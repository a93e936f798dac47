//! dinomo-kv-node: a KV node (KN). It holds exclusive ownership of the key ranges its cluster
//! map gives it, splits them again over shards (one task each: cache, log writer, unmerged
//! log), caches values and shortcuts with DAC, writes batched log entries to its own DPM log
//! segments with one one-sided WRITE per batch, and reads the DPM's index and entries with
//! one-sided READs.
//!
//! Modules: [`node`] (the KN as a library), [`shard`] (the data path), [`cache`] (DAC and the
//! static policies), [`remote_index`] (index traversal over the fabric), [`unmerged`],
//! [`dpm_link`] (control calls to the DPM), [`lease`] (serve only while the map is fresh), [`stats`], [`service`] (gRPC), `wire` (the
//! binary data path beside gRPC), `listener` (the port both share), [`config`], [`server`].

pub mod cache;
pub mod cli;
pub mod config;
pub mod deadline;
pub mod dpm_link;
pub mod error;
pub mod lease;
mod listener;
pub mod node;
pub mod remote_index;
pub mod server;
pub mod service;
pub mod session;
pub mod shard;
pub mod stats;
pub mod unmerged;
mod wire;

pub use error::{KvError, KvResult};
pub use node::KvNode;
