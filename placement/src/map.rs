//! The versioned cluster map: KN membership, ring parameters and the replicated-key table
//! (DESIGN §6, paper §3.4-3.5).
//!
//! The map of record lives in DPM metadata; routing nodes serve it, clients and KNs cache it.
//! Every process derives ownership from the map alone, so two processes holding the same map
//! (same `version`) agree on every key's owners, shard and endpoint.
//!
//! # Invariants (checked by [`ClusterMap::validate`], which every constructor, transition and
//! `decode` runs)
//!
//! - `version >= 1`; each `with_*` transition returns `version + 1` and leaves `self` intact.
//! - KN ids are unique and every endpoint is non-empty; `kns` is kept sorted by id.
//! - `1 <= vnodes <= MAX_VNODES`, `1 <= shards_per_kn <= MAX_SHARDS_PER_KN`, and the global
//!   ring holds at most [`MAX_RING_POINTS`] points. These bounds exist because a map decoded
//!   from untrusted bytes must not be able to make a process allocate without limit.
//! - Every replicated key is non-empty and lists one or more distinct owners, all members.
//!
//! # Ownership
//!
//! A key's ring owner is given by the global [`HashRing`] over the member ids. A replicated key
//! (selective replication, paper §3.4) is instead owned by exactly the KNs in its list; its ring
//! owner has no special role unless the list names it. [`ClusterMap::owners`] and
//! [`ClusterMap::is_owner`] apply this rule; [`ClusterMap::owner`] is the ring alone.
//!
//! # Encoding
//!
//! [`ClusterMap::encode`] writes compact JSON:
//!
//! ```text
//! {"format_version":1,"version":7,"vnodes":128,"shards_per_kn":4,
//!  "kns":[{"id":1,"endpoint":"10.0.0.5:7000"}, ...],
//!  "replicated":[{"key_hex":"686f74","owners":[1,3]}, ...]}
//! ```
//!
//! Replicated keys are arbitrary bytes, hence hex. `decode` reads `format_version` first and
//! refuses any other version with [`PlacementError::FormatVersion`] before looking at the
//! rest; unknown fields are refused, not ignored, so a newer writer cannot be half-understood.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use crate::error::{key_for_display, PlacementError};
use crate::ring::HashRing;
use crate::shard::shard_of_hash;

/// A KV node's id: unique in the cluster, stable across restarts of that KN.
pub type KnId = u32;

/// The cluster-map encoding this build writes and reads.
pub const MAP_FORMAT_VERSION: u32 = 1;
/// Upper bound on virtual nodes per KN.
pub const MAX_VNODES: u32 = 4096;
/// Upper bound on shards per KN.
pub const MAX_SHARDS_PER_KN: u32 = 1024;
/// Upper bound on `kns.len() * vnodes` (16 MiB of ring at 16 bytes a point).
pub const MAX_RING_POINTS: u64 = 1 << 20;

/// One member KN.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KnInfo {
    /// The KN's id.
    pub id: KnId,
    /// `host:port` of the KN's KvService.
    pub endpoint: String,
}

/// The versioned cluster map. Build it with [`ClusterMap::new`] or [`ClusterMap::decode`] and
/// change it with the `with_*` transitions, which validate and bump the version.
///
/// The fields are public for reading. Writing them directly skips validation and the version
/// bump; the map stays correct (the cached ring notices it is stale) but every ring lookup then
/// rebuilds the ring, so don't.
#[derive(Clone)]
pub struct ClusterMap {
    /// Monotonic map version, starting at 1.
    pub version: u64,
    /// Member KNs, sorted by id.
    pub kns: Vec<KnInfo>,
    /// Virtual nodes per KN on the global ring. 64 keeps every KN within 0.5x-1.5x of its fair
    /// share all but very rarely; 128 or more is the better default.
    pub vnodes: u32,
    /// Shards (workers) per KN on the local ring.
    pub shards_per_kn: u32,
    /// Replicated (hot) keys and the KNs that share their ownership.
    pub replicated: BTreeMap<Vec<u8>, Vec<KnId>>,
    /// The global ring, built on first use.
    ring: OnceLock<RingCache>,
}

/// The ring plus the inputs it was built from, so a stale cache is detected rather than used.
#[derive(Clone)]
struct RingCache {
    vnodes: u32,
    ids: Vec<KnId>,
    ring: HashRing<KnId>,
}

impl RingCache {
    fn build(map: &ClusterMap) -> Self {
        let ids: Vec<KnId> = map.kns.iter().map(|k| k.id).collect();
        RingCache {
            vnodes: map.vnodes,
            ring: HashRing::new(ids.iter().copied(), map.vnodes),
            ids,
        }
    }

    fn matches(&self, map: &ClusterMap) -> bool {
        self.vnodes == map.vnodes
            && self.ids.len() == map.kns.len()
            && self.ids.iter().zip(&map.kns).all(|(&id, kn)| id == kn.id)
    }
}

impl PartialEq for ClusterMap {
    fn eq(&self, other: &Self) -> bool {
        // The ring is derived state; equal inputs give equal rings.
        self.version == other.version
            && self.kns == other.kns
            && self.vnodes == other.vnodes
            && self.shards_per_kn == other.shards_per_kn
            && self.replicated == other.replicated
    }
}

impl Eq for ClusterMap {}

impl fmt::Debug for ClusterMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let replicated: BTreeMap<String, &Vec<KnId>> = self
            .replicated
            .iter()
            .map(|(k, v)| (key_for_display(k), v))
            .collect();
        f.debug_struct("ClusterMap")
            .field("version", &self.version)
            .field("kns", &self.kns)
            .field("vnodes", &self.vnodes)
            .field("shards_per_kn", &self.shards_per_kn)
            .field("replicated", &replicated)
            .finish_non_exhaustive()
    }
}

impl ClusterMap {
    /// The first map of a cluster: version 1, no replicated keys. `kns` may be empty (a
    /// cluster whose KNs have not registered yet) and in any order.
    pub fn new(kns: Vec<KnInfo>, vnodes: u32, shards_per_kn: u32) -> Result<Self, PlacementError> {
        Self::assemble(1, kns, vnodes, shards_per_kn, BTreeMap::new())
    }

    /// Sorts, builds and validates a map.
    fn assemble(
        version: u64,
        mut kns: Vec<KnInfo>,
        vnodes: u32,
        shards_per_kn: u32,
        replicated: BTreeMap<Vec<u8>, Vec<KnId>>,
    ) -> Result<Self, PlacementError> {
        kns.sort_by_key(|k| k.id);
        let map = ClusterMap {
            version,
            kns,
            vnodes,
            shards_per_kn,
            replicated,
            ring: OnceLock::new(),
        };
        map.validate()?;
        Ok(map)
    }

    /// Checks every invariant in the module doc.
    pub fn validate(&self) -> Result<(), PlacementError> {
        if self.version == 0 {
            return Err(PlacementError::ZeroVersion);
        }
        if !(1..=MAX_VNODES).contains(&self.vnodes) {
            return Err(PlacementError::BadVnodes {
                found: self.vnodes,
                max: MAX_VNODES,
            });
        }
        if !(1..=MAX_SHARDS_PER_KN).contains(&self.shards_per_kn) {
            return Err(PlacementError::BadShards {
                found: self.shards_per_kn,
                max: MAX_SHARDS_PER_KN,
            });
        }
        let mut ids = BTreeSet::new();
        for kn in &self.kns {
            if !ids.insert(kn.id) {
                return Err(PlacementError::DuplicateKn(kn.id));
            }
            if kn.endpoint.trim().is_empty() {
                return Err(PlacementError::EmptyEndpoint(kn.id));
            }
        }
        let points = self.kns.len() as u64 * u64::from(self.vnodes);
        if points > MAX_RING_POINTS {
            return Err(PlacementError::RingTooLarge {
                kns: self.kns.len(),
                vnodes: self.vnodes,
                points,
                max: MAX_RING_POINTS,
            });
        }
        for (key, owners) in &self.replicated {
            if key.is_empty() {
                return Err(PlacementError::EmptyReplicatedKey);
            }
            if owners.is_empty() {
                return Err(PlacementError::NoReplicaOwners(key_for_display(key)));
            }
            let mut seen = BTreeSet::new();
            for &kn in owners {
                if !ids.contains(&kn) {
                    return Err(PlacementError::UnknownReplicaOwner {
                        key: key_for_display(key),
                        kn,
                    });
                }
                if !seen.insert(kn) {
                    return Err(PlacementError::DuplicateReplicaOwner {
                        key: key_for_display(key),
                        kn,
                    });
                }
            }
        }
        Ok(())
    }

    /// The global ring over the current members.
    fn ring(&self) -> Cow<'_, HashRing<KnId>> {
        let cache = self.ring.get_or_init(|| RingCache::build(self));
        if cache.matches(self) {
            Cow::Borrowed(&cache.ring)
        } else {
            // Fields were written directly after the ring was cached: correct but slow.
            Cow::Owned(RingCache::build(self).ring)
        }
    }

    /// The key's owner on the global ring, ignoring replication; `None` if the map has no KNs.
    /// To route a request or check ownership use [`owners`](Self::owners) /
    /// [`is_owner`](Self::is_owner), which honour replicated keys.
    pub fn owner(&self, key: &[u8]) -> Option<KnId> {
        self.owner_by_hash(crate::key_hash(key))
    }

    /// [`owner`](Self::owner) for a precomputed [`crate::key_hash`].
    pub fn owner_by_hash(&self, key_hash: u64) -> Option<KnId> {
        self.ring().owner(key_hash)
    }

    /// The KNs allowed to serve `key`: its list if it is replicated, otherwise its ring owner
    /// (empty only if the map has no KNs).
    pub fn owners(&self, key: &[u8]) -> Vec<KnId> {
        match self.replicated.get(key) {
            Some(owners) => owners.clone(),
            None => self.owner(key).into_iter().collect(),
        }
    }

    /// Whether `kn` may serve `key` under this map (a KN answers WRONG_OWNER otherwise).
    pub fn is_owner(&self, kn: KnId, key: &[u8]) -> bool {
        match self.replicated.get(key) {
            Some(owners) => owners.contains(&kn),
            None => self.owner(key) == Some(kn),
        }
    }

    /// Whether `key` is in the replicated-key table.
    pub fn is_replicated(&self, key: &[u8]) -> bool {
        self.replicated.contains_key(key)
    }

    /// The first `n` distinct KNs clockwise from the key on the global ring, ring owner first:
    /// natural candidates when the monitor raises a key's replication factor to `n`.
    pub fn replica_candidates(&self, key: &[u8], n: usize) -> Vec<KnId> {
        self.ring().owners(crate::key_hash(key), n)
    }

    /// The shard (in `0..shards_per_kn`) that owns `key` inside its KN: the local ring. See
    /// [`crate::shard`] for why this spreads one KN's keys evenly.
    pub fn shard_of(&self, key: &[u8]) -> u32 {
        shard_of_hash(crate::key_hash(key), self.shards_per_kn)
    }

    /// [`shard_of`](Self::shard_of) for a precomputed [`crate::key_hash`].
    pub fn shard_of_hash(&self, key_hash: u64) -> u32 {
        shard_of_hash(key_hash, self.shards_per_kn)
    }

    /// The KvService endpoint of a member KN.
    pub fn endpoint(&self, kn: KnId) -> Option<&str> {
        self.kns
            .iter()
            .find(|k| k.id == kn)
            .map(|k| k.endpoint.as_str())
    }

    /// Whether `kn` is a member.
    pub fn contains(&self, kn: KnId) -> bool {
        self.kns.iter().any(|k| k.id == kn)
    }

    /// The member ids, ascending.
    pub fn kn_ids(&self) -> impl Iterator<Item = KnId> + '_ {
        self.kns.iter().map(|k| k.id)
    }

    fn next_version(&self) -> Result<u64, PlacementError> {
        self.version
            .checked_add(1)
            .ok_or(PlacementError::VersionExhausted(self.version))
    }

    /// This map plus one KN, at `version + 1`. Refuses a duplicate id or an empty endpoint.
    pub fn with_kn_added(&self, kn: KnInfo) -> Result<Self, PlacementError> {
        let mut kns = self.kns.clone();
        kns.push(kn);
        Self::assemble(
            self.next_version()?,
            kns,
            self.vnodes,
            self.shards_per_kn,
            self.replicated.clone(),
        )
    }

    /// This map without KN `kn`, at `version + 1`. The KN is also dropped from every
    /// replicated key's owner list; a key left with no owners stops being replicated and falls
    /// back to its ring owner.
    pub fn with_kn_removed(&self, kn: KnId) -> Result<Self, PlacementError> {
        if !self.contains(kn) {
            return Err(PlacementError::UnknownKn(kn));
        }
        let kns = self.kns.iter().filter(|k| k.id != kn).cloned().collect();
        let replicated = self
            .replicated
            .iter()
            .filter_map(|(key, owners)| {
                let rest: Vec<KnId> = owners.iter().copied().filter(|&o| o != kn).collect();
                (!rest.is_empty()).then(|| (key.clone(), rest))
            })
            .collect();
        Self::assemble(
            self.next_version()?,
            kns,
            self.vnodes,
            self.shards_per_kn,
            replicated,
        )
    }

    /// This map with `key` replicated over `owners` (in the given order, which is kept), at
    /// `version + 1`. Owners must be distinct members. Empty `owners` de-replicates the key
    /// (a no-op apart from the version bump if it was not replicated).
    pub fn with_replicated(&self, key: Vec<u8>, owners: Vec<KnId>) -> Result<Self, PlacementError> {
        if key.is_empty() {
            return Err(PlacementError::EmptyReplicatedKey);
        }
        let mut replicated = self.replicated.clone();
        if owners.is_empty() {
            replicated.remove(&key);
        } else {
            replicated.insert(key, owners);
        }
        Self::assemble(
            self.next_version()?,
            self.kns.clone(),
            self.vnodes,
            self.shards_per_kn,
            replicated,
        )
    }

    /// The KNs whose ownership differs between `self` and `next`, ascending (paper §3.5 step
    /// 1: the KNs that take part in the reconfiguration; every other KN owns exactly the same
    /// keys in both maps and may switch maps asynchronously).
    ///
    /// Exact: ring ownership is compared arc by arc over both rings' vnode boundaries
    /// ([`HashRing::changed_nodes`]); then every key replicated in either map whose owner set
    /// differs between the maps adds both its old and its new owners. (A key becoming
    /// replicated therefore involves its ring owner too: it must stop caching the value and
    /// its pending log entries must be merged before the other owners read the key.)
    pub fn changed_ranges(&self, next: &ClusterMap) -> Vec<KnId> {
        let mut changed: BTreeSet<KnId> = self
            .ring()
            .changed_nodes(&next.ring())
            .into_iter()
            .collect();
        let keys: BTreeSet<&Vec<u8>> = self
            .replicated
            .keys()
            .chain(next.replicated.keys())
            .collect();
        for key in keys {
            let before: BTreeSet<KnId> = self.owners(key).into_iter().collect();
            let after: BTreeSet<KnId> = next.owners(key).into_iter().collect();
            // A key entering or leaving the replicated table changes how it is served (index
            // or indirect cell) even when its owners stay the same: they must be paused and
            // their logs merged before the cell is created or written back.
            let mode_changes =
                self.replicated.contains_key(key) != next.replicated.contains_key(key);
            if before != after || mode_changes {
                changed.extend(before);
                changed.extend(after);
            }
        }
        changed.into_iter().collect()
    }

    /// The map as bytes, for DPM metadata and gRPC (format in the module doc).
    pub fn encode(&self) -> Vec<u8> {
        let wire = WireMap {
            format_version: MAP_FORMAT_VERSION,
            version: self.version,
            vnodes: self.vnodes,
            shards_per_kn: self.shards_per_kn,
            kns: self.kns.clone(),
            replicated: self
                .replicated
                .iter()
                .map(|(key, owners)| WireReplicated {
                    key_hex: hex_encode(key),
                    owners: owners.clone(),
                })
                .collect(),
        };
        // Integers, strings and sequences only: serializing to a Vec cannot fail.
        serde_json::to_vec(&wire).expect("a cluster map always serializes to JSON")
    }

    /// Reads bytes written by [`encode`](Self::encode) (possibly by another process or build).
    /// Untrusted input: refuses other format versions, unknown fields and any map that breaks
    /// an invariant, never panics.
    pub fn decode(bytes: &[u8]) -> Result<Self, PlacementError> {
        let probe: VersionProbe = serde_json::from_slice(bytes)
            .map_err(|e| PlacementError::Malformed(format!("not a cluster map object: {e}")))?;
        let found = probe.format_version.ok_or_else(|| {
            PlacementError::Malformed("the format_version field is missing".to_string())
        })?;
        if found != MAP_FORMAT_VERSION {
            return Err(PlacementError::FormatVersion {
                found,
                expected: MAP_FORMAT_VERSION,
            });
        }
        let wire: WireMap =
            serde_json::from_slice(bytes).map_err(|e| PlacementError::Malformed(e.to_string()))?;
        let mut replicated = BTreeMap::new();
        for entry in wire.replicated {
            let key = hex_decode(&entry.key_hex).ok_or_else(|| {
                PlacementError::Malformed(format!(
                    "replicated key_hex {:?} is not hex",
                    truncate(&entry.key_hex, 80)
                ))
            })?;
            if replicated.contains_key(&key) {
                return Err(PlacementError::DuplicateReplicatedKey(key_for_display(
                    &key,
                )));
            }
            replicated.insert(key, entry.owners);
        }
        Self::assemble(
            wire.version,
            wire.kns,
            wire.vnodes,
            wire.shards_per_kn,
            replicated,
        )
    }
}

/// Reads only the format version, so an encoding of another version is refused by version
/// rather than by whichever of its fields this build happens not to know.
#[derive(Deserialize)]
struct VersionProbe {
    format_version: Option<u32>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireMap {
    format_version: u32,
    version: u64,
    vnodes: u32,
    shards_per_kn: u32,
    kns: Vec<KnInfo>,
    replicated: Vec<WireReplicated>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireReplicated {
    key_hex: String,
    owners: Vec<KnId>,
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex_encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    s
}

/// Bytes of a hex string (either case); `None` if it has odd length or a non-hex character.
fn hex_decode(s: &str) -> Option<Vec<u8>> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) {
        return None;
    }
    b.chunks_exact(2)
        .map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?))
        .collect()
}

fn truncate(s: &str, max_chars: usize) -> String {
    s.chars().take(max_chars).collect()
}

#[cfg(test)]
mod tests;
