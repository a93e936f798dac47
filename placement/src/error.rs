//! Why a cluster map (or a change to one) was refused.
//!
//! Every constructor and every `with_*` transition of [`crate::ClusterMap`] validates the whole
//! resulting map, so one error type covers construction, transitions and decoding of untrusted
//! bytes (DPM metadata, gRPC). Messages name the offending value and, where it helps, what was
//! expected, so an operator can act on them without reading the code.

use crate::map::KnId;

/// A refused cluster map, map transition or map encoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// Two KNs share one id; ids name log segments and epochs, so they must be unique.
    #[error("duplicate KN id {0} in the cluster map: KN ids must be unique")]
    DuplicateKn(KnId),

    /// A KN without an address cannot be routed to.
    #[error("KN {0} has an empty endpoint: expected host:port of its KvService")]
    EmptyEndpoint(KnId),

    /// `vnodes` outside `1..=max`.
    #[error("vnodes per KN must be between 1 and {max}, got {found}")]
    BadVnodes { found: u32, max: u32 },

    /// `shards_per_kn` outside `1..=max`.
    #[error("shards per KN must be between 1 and {max}, got {found}")]
    BadShards { found: u32, max: u32 },

    /// The global ring would hold more points than [`crate::map::MAX_RING_POINTS`].
    #[error(
        "{kns} KNs x {vnodes} vnodes = {points} ring points, more than the limit of {max}: \
         lower vnodes"
    )]
    RingTooLarge {
        kns: usize,
        vnodes: u32,
        points: u64,
        max: u64,
    },

    /// An operation named a KN that is not in the map.
    #[error("KN {0} is not a member of the cluster map")]
    UnknownKn(KnId),

    /// A replicated key lists an owner that is not in the map.
    #[error("replicated key {key} names owner KN {kn}, which is not a member of the cluster map")]
    UnknownReplicaOwner { key: String, kn: KnId },

    /// A replicated key lists the same owner twice.
    #[error("replicated key {key} lists owner KN {kn} more than once")]
    DuplicateReplicaOwner { key: String, kn: KnId },

    /// The empty key cannot be stored, so it cannot be replicated either.
    #[error("the empty key cannot be replicated")]
    EmptyReplicatedKey,

    /// A replicated key with an empty owner list (de-replicate it instead).
    #[error("replicated key {0} lists no owners: de-replicate it instead")]
    NoReplicaOwners(String),

    /// An encoded map lists the same replicated key twice.
    #[error("replicated key {0} appears more than once in the encoded cluster map")]
    DuplicateReplicatedKey(String),

    /// Map versions start at 1 ([`crate::ClusterMap::new`]); 0 means "no map".
    #[error("cluster map version 0 is invalid: versions start at 1")]
    ZeroVersion,

    /// The map version cannot be bumped any further.
    #[error("cluster map version {0} cannot be incremented without overflowing")]
    VersionExhausted(u64),

    /// The encoding is of a format version this build does not read.
    #[error(
        "cluster map encoding has format version {found}, this build reads format version \
         {expected}"
    )]
    FormatVersion { found: u32, expected: u32 },

    /// The bytes are not a cluster map encoding at all.
    #[error("malformed cluster map encoding: {0}")]
    Malformed(String),
}

/// Renders a key for an error message: lowercase hex, cut after 32 bytes.
pub(crate) fn key_for_display(key: &[u8]) -> String {
    const SHOWN: usize = 32;
    let mut s = crate::map::hex_encode(&key[..key.len().min(SHOWN)]);
    if key.len() > SHOWN {
        s.push_str(&format!("...({} bytes)", key.len()));
    }
    format!("0x{s}")
}
