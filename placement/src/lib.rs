//! dinomo-placement: who owns which key (paper §3.4) and the versioned cluster map that says so
//! (§3.5, DESIGN §6). Pure computation: no I/O, no async, no clocks.
//!
//! - [`ring`] holds the consistent-hash ring with virtual nodes (global ring: key -> KN). Its vnode
//!   positions are a cluster-wide format.
//! - [`shard`] holds the local mapping key -> shard inside a KN.
//! - [`map`] holds [`ClusterMap`]: KN membership + ring parameters + replicated keys, its validated
//!   transitions, the exact set of KNs a transition affects, and its versioned encoding.
//! - [`error`] holds [`PlacementError`].
//!
//! Every process (client, routing node, KN, monitor) computes placement from the same map with
//! this crate, so placement depends only on the map's contents and on [`key_hash`].

pub mod error;
pub mod map;
pub mod ring;
pub mod shard;

/// The key hash placement uses (xxh3-64, seed 0), shared with the DPM index so a key is hashed
/// once per request.
pub use dinomo_layout::key_hash;

pub use error::PlacementError;
pub use map::{ClusterMap, KnId, KnInfo, MAP_FORMAT_VERSION};
pub use ring::{vnode_position, HashRing, RingNode};
pub use shard::shard_of_hash;
