//! The KN's DRAM cache of values and shortcuts, one instance per shard (DAC, paper §3.3).
//!
//! A shard owns its [`Cache`] outright: every method takes `&mut self`, there are no locks.
//!
//! # What is cached
//! A key is cached either as a *value* (the value bytes plus the [`Shortcut`] to its log
//! entry, so a hit costs 0 round trips and the KN can still verify or refresh through the
//! shortcut) or as a *shortcut* (a hit costs one READ of the entry), never both at once.
//! A miss costs an index traversal (the caller measures how many RTs).
//!
//! # Invariants
//! * **Budget.** `value_bytes + shortcut_bytes <= budget_bytes` after every call, where a
//!   value costs `key.len() + value.len() + VALUE_OVERHEAD` and a shortcut
//!   `key.len() + SHORTCUT_OVERHEAD`. Under [`Policy::Static`] the value part also stays
//!   within its share (`budget * value_percent / 100`, rounded down) and the shortcut part
//!   within the rest.
//! * **Freshness.** What the cache returns for a key is exactly what the last
//!   [`Cache::on_write`] / [`Cache::on_miss_read`] / promotion told it for *that* key; the
//!   cache never invents or mixes entries. Entries that may have gone stale (the KN found a
//!   moved entry, or a delete) are dropped by [`Cache::invalidate`].
//! * **Counts.** Each cached key carries its access count: its entry count (below) plus
//!   one per lookup that found it. The count survives promotion, demotion and
//!   [`Cache::on_write`] / [`Cache::on_miss_read`] of a cached key; a key that leaves the
//!   cache forgets it.
//!
//! # Orders (see `store`)
//! Values are kept in LRU order, shortcuts in LFU order. Both are intrusive lists over one
//! slab of slots found through one `hashbrown::HashTable` (the `lru` crate was not used: it
//! would need a second map for shortcuts, so a key could be in two places, and its nodes are
//! larger). Shortcuts sit in frequency buckets (`BTreeMap<count, list>`); within one count
//! the shortcut that reached it first goes first. Every operation is O(1) list work plus
//! O(log #distinct counts); nothing scans the cache.
//!
//! # Policies
//! * [`Policy::Dac`] (Table 3). BEGIN: while the whole value fits in free space, misses and
//!   writes cache the value. MISS: otherwise cache the shortcut, making room by DEMOTING the
//!   LRU value to a shortcut (repeatedly), and only when no value is left EVICTING the LFU
//!   shortcut. HIT of shortcut P: PROMOTE per Eq. 1, generalised to demotions (see "Promotion
//!   may demote" below): the victims are taken, cheapest per byte freed first, from two
//!   candidates at a time, the next LFU shortcut other than P (penalty `hits * avg_miss_rts`,
//!   frees its shortcut) and the next LRU value (penalty `hits * avg_shortcut_hit_rts`, frees
//!   its value bytes beyond its shortcut), until P's value fits once P's own shortcut bytes
//!   and the free space are counted; promote iff
//!   `hits(P) * avg_shortcut_hit_rts >= sum of the victims' penalties`, then evict / demote
//!   them. With no value cached this is Eq. 1 exactly. A value that cannot fit even with every
//!   other shortcut gone and every value demoted is not promoted; values are never evicted
//!   to promote. Writes are placed like misses (the KN knows where it wrote).
//! * [`Policy::ShortcutOnly`] (DINOMO-S): shortcuts only, LFU eviction.
//! * [`Policy::ValueOnly`]: values only, LRU eviction.
//! * [`Policy::Static`]: a fixed split. Misses and writes cache the value in the value area
//!   (LRU) if it fits there at all; the value area makes room by demoting its LRU values into
//!   the shortcut area (LFU eviction there; dropped if the area is too small). A value larger
//!   than the whole value area is cached as a shortcut in the shortcut area instead. A
//!   shortcut hit moves the key back into the value area (it is now the most recently used),
//!   so the value area holds the most recently used keys and the shortcut area the next most
//!   frequently used ones. `static-0` behaves as shortcut-only, `static-100` as value-only.
//!
//! # Access counts age (LFU with dynamic aging)
//! A key entering the cache starts at `max(1, L)`, where `L` is the count of the last
//! shortcut evicted to make room (monotone; 0 until the first eviction), instead of at 1.
//! Both the LFU order and Eq. 1 use these counts. This is LFU-DA with the new key placed at
//! the frontier rather than one above it (so that a stream of one-time keys does not raise
//! `L`). Why: with plain counts, a resident key's count grows with its age, a key that was
//! evicted comes back at 1, and Eq. 1 then judges every resident shortcut worth several
//! newcomers. Under uniform reads DAC kept promoting old shortcuts, evicting newcomers, taking
//! misses, demoting the new values again: up to 20% more RTs/op than the best static policy
//! at mid-size caches (the "dac, plain LFU" row of the `sim` tables). With aging, a returning
//! key competes at the level of the keys being evicted, and Eq. 1 only promotes keys that
//! are really hit more often. With no eviction so far (`L = 0`) counts are plain counts.
//!
//! # Promotion may demote (a deviation from Table 3)
//! Table 3 demotes values only on a MISS that needs room, and Eq. 1 only weighs evicting
//! shortcuts. So the value set changes only through misses, and a cache large enough to hold
//! every key's shortcut (with 1 KB values, from about 13% of the data on) hardly ever misses:
//! whatever values the cache took first stay, however cold. A load phase fills the cache with
//! the values written first (then demotes the older ones to make room for the later keys'
//! shortcuts), so after a load the hot keys are shortcuts and the values cold keys; a hot
//! shortcut only becomes a value by out-hitting N ~ 8 LFU shortcuts times `avg_miss_rts` (a
//! 1 KB value costs about nine 24-byte-key shortcuts), and only the misses of the shortcuts
//! so evicted demote the cold values, one per miss. Issue 12 measured DAC 46% above
//! value-only in RTs/op with about 23% of its hits on shortcuts (YCSB-C, zipf 0.99, 1 KB
//! values, caches about half the data, 2 s of warm-up); the `ycsb_*` tables of `sim`
//! reproduce it (233% of the best at half the data, 21% shortcut hits). It is mostly the speed
//! of adaptation: with 33 times the warm-up, Table 3's DAC gets to 0.076 RTs/op there
//! (value-only 0.144, this DAC 0.062).
//!
//! So a promotion may also DEMOTE LRU values, when that costs fewer RTs per byte than evicting
//! shortcuts, and the value set turns over on hits too: a cold value (few hits) yields to a
//! hot shortcut at once, a value hit more often than the candidate stays. Demoting costs no
//! miss (the key keeps its shortcut), so with one value demoted the trade is P's hits at 0 RTs
//! instead of 1 against V's hits at 1 RT instead of 0. The miss path stays Table 3's. The
//! `sim` tables print both variants ("dac, Table 3 promote" is the published one): no
//! 64-byte-value column is more than 2% worse (one is 4% better), and DAC is now the best
//! policy in every 1 KB column (it was up to 2.9 times the best; docs/dac-1kb.md has the
//! tables and the dac-bench grids). The cost is CPU: more promotions (each copies a value),
//! up to about twice as many under uniform reads at mid-size caches.
//!
//! # Round-trip averages
//! `avg_shortcut_hit_rts` and `avg_miss_rts` are exponentially weighted moving averages of the
//! RTs reported to [`Cache::on_shortcut_read`] and [`Cache::on_miss_read`], with weight
//! [`RTS_EWMA_ALPHA`] (= 0.05: about the last 20 observations dominate) and initial values
//! 1.0 and 2.0 (paper: "Avg. shortcut hit RT is always one"; a miss is at least a bucket READ
//! plus an entry READ).
//!
//! # Memory accounting
//! [`VALUE_OVERHEAD`] and [`SHORTCUT_OVERHEAD`] are the bytes a cached entry really costs
//! besides its key and value bytes, on a 64-bit target. Both kinds: the 64-byte slot, ~8
//! bytes of hash table (a `u32` index and a control byte at 7/8 load) and the allocator's
//! header/rounding of the key's boxed copy (16) = 88. Shortcuts add a share of a frequency
//! bucket (24, as if every shortcut had a count of its own) = 112. Values add their `Bytes`
//! handle in the value slab (32), the value's own allocation header (16) and the shared
//! header `bytes` allocates on the first clone (32) = 168. A test checks the constants
//! against `size_of`. Values are copied on insertion so the cache never pins a larger buffer
//! (e.g. the whole READ of an entry) than it accounts for. Not counted: the slabs' spare
//! capacity after the cache shrinks (released when it empties).

mod policy;
mod store;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

use std::fmt;

use bytes::Bytes;
use dinomo_layout::index::EntryPtr;

pub use policy::{ParsePolicyError, Policy};
use store::{shortcut_cost, value_cost, Store};

/// Where a value handed to the cache lives. The cache keeps only buffers of their own: a view
/// into a larger buffer (a READ's, with the entry's header and key) would keep all of it alive
/// while the budget counts only the value.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// A buffer of its own (a write's value): kept as it is.
    Own,
    /// A view into a larger buffer: copied when kept.
    View,
}

impl Source {
    fn keep(self, value: Bytes) -> Bytes {
        match self {
            Source::Own => value,
            Source::View => Bytes::copy_from_slice(&value),
        }
    }
}

/// Bytes a value entry costs besides `key.len() + value.len()`.
pub const VALUE_OVERHEAD: usize = 168;
/// Bytes a shortcut entry costs besides `key.len()`.
pub const SHORTCUT_OVERHEAD: usize = 112;
// Demotion must always free bytes, or DAC's room-making loop could spin.
const _: () = assert!(VALUE_OVERHEAD > SHORTCUT_OVERHEAD);
/// Weight of the newest observation in the RT moving averages.
pub const RTS_EWMA_ALPHA: f64 = 0.05;
/// Initial average RTs of a shortcut hit.
pub const INITIAL_SHORTCUT_HIT_RTS: f64 = 1.0;
/// Initial average RTs of a miss (index traversal and entry READ).
pub const INITIAL_MISS_RTS: f64 = 2.0;

/// Where a key's latest entry lies in DPM, and the version written there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shortcut {
    pub ptr: EntryPtr,
    pub version: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// Bytes of DRAM this cache may account for (see the module doc for entry costs).
    pub budget_bytes: usize,
    pub policy: Policy,
}

/// The result of [`Cache::lookup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// 0 RTs. The shortcut is where the value lives, for verification or refresh.
    Value { value: Bytes, shortcut: Shortcut },
    /// 1 RT: the caller READs the entry, then calls [`Cache::on_shortcut_read`].
    Shortcut(Shortcut),
    /// The caller traverses the index, then calls [`Cache::on_miss_read`].
    Miss,
}

#[derive(Default, Clone, Debug, PartialEq, Eq)]
pub struct CacheStats {
    pub value_hits: u64,
    pub shortcut_hits: u64,
    pub misses: u64,
    /// Shortcuts turned into values.
    pub promotions: u64,
    /// Values turned into shortcuts.
    pub demotions: u64,
    /// Entries dropped to make room (not counting invalidations).
    pub evictions: u64,
    /// Keys cached as values now.
    pub values: usize,
    /// Keys cached as shortcuts now.
    pub shortcuts: usize,
    /// Budget bytes used by values now.
    pub value_bytes: usize,
    /// Budget bytes used by shortcuts now.
    pub shortcut_bytes: usize,
}

/// A shard's cache. See the module documentation.
pub struct Cache {
    budget: usize,
    policy: Policy,
    store: Store,
    value_hits: u64,
    shortcut_hits: u64,
    misses: u64,
    promotions: u64,
    demotions: u64,
    evictions: u64,
    avg_shortcut_hit_rts: f64,
    avg_miss_rts: f64,
    /// Reused by promotion checks (the victims of Eq. 1: slot, and whether it is demoted).
    scratch: Vec<(u32, bool)>,
    /// LFU-DA aging base: the count of the last shortcut evicted (monotone). Keys entering
    /// the cache start at `age_base + 1`.
    age_base: u64,
    /// Whether counts age (always on outside tests; the simulation compares both).
    aging: bool,
    /// Whether a promotion may demote LRU values to make room (always on outside tests; the
    /// simulation compares both).
    demote_to_promote: bool,
}

impl fmt::Debug for Cache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cache")
            .field("budget", &self.budget)
            .field("policy", &self.policy)
            .field("avg_shortcut_hit_rts", &self.avg_shortcut_hit_rts)
            .field("avg_miss_rts", &self.avg_miss_rts)
            .field("stats", &self.stats())
            .finish()
    }
}

fn ewma(avg: &mut f64, sample: u32) {
    *avg += RTS_EWMA_ALPHA * (f64::from(sample) - *avg);
}

/// A candidate for making room for a promotion: a shortcut to evict or a value to demote.
struct Victim {
    idx: u32,
    demote: bool,
    /// RTs the key's past hits would have cost more: as a miss (evicted shortcut) or as a
    /// shortcut hit (demoted value) instead of what they cost now.
    penalty: f64,
    /// Budget bytes this frees.
    freed: usize,
}

impl Victim {
    fn evict(store: &Store, idx: u32, avg_miss_rts: f64) -> Self {
        let s = store.slot(idx);
        Victim {
            idx,
            demote: false,
            penalty: s.hits as f64 * avg_miss_rts,
            freed: shortcut_cost(s.key.len()),
        }
    }

    fn demote(store: &Store, idx: u32, avg_shortcut_hit_rts: f64) -> Self {
        let s = store.slot(idx);
        let len = store.value(idx).map_or(0, Bytes::len);
        Victim {
            idx,
            demote: true,
            penalty: s.hits as f64 * avg_shortcut_hit_rts,
            freed: value_cost(s.key.len(), len) - shortcut_cost(s.key.len()),
        }
    }

    /// Less penalty per byte freed than `other` (cross-multiplied; `freed` is never 0).
    fn cheaper_than(&self, other: &Victim) -> bool {
        self.penalty * (other.freed as f64) < other.penalty * (self.freed as f64)
    }
}

impl Cache {
    pub fn new(cfg: CacheConfig) -> Self {
        let policy = match cfg.policy {
            Policy::Static { value_percent } => Policy::Static {
                value_percent: value_percent.min(100),
            },
            p => p,
        };
        Cache {
            budget: cfg.budget_bytes,
            policy,
            store: Store::new(),
            value_hits: 0,
            shortcut_hits: 0,
            misses: 0,
            promotions: 0,
            demotions: 0,
            evictions: 0,
            avg_shortcut_hit_rts: INITIAL_SHORTCUT_HIT_RTS,
            avg_miss_rts: INITIAL_MISS_RTS,
            scratch: Vec::new(),
            age_base: 0,
            aging: true,
            demote_to_promote: true,
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Looks a key up and counts the access (frequency) and the hit kind. A Value hit is
    /// 0 round trips; a Shortcut hit means the caller will READ the entry (1 RT).
    pub fn lookup(&mut self, key: &[u8]) -> Lookup {
        let Some(idx) = self.store.find(key) else {
            self.misses += 1;
            return Lookup::Miss;
        };
        if self.store.slot(idx).is_value() {
            self.value_hits += 1;
            self.store.touch_value(idx);
            Lookup::Value {
                value: self.store.value(idx).expect("value slot").clone(),
                shortcut: self.store.slot(idx).shortcut,
            }
        } else {
            self.shortcut_hits += 1;
            self.store.bump_shortcut(idx);
            Lookup::Shortcut(self.store.slot(idx).shortcut)
        }
    }

    /// After a shortcut hit was served with `rts` round trips (normally 1): DAC may PROMOTE
    /// the shortcut to a value per Eq. 1; static-X moves it into the value area; the other
    /// policies keep it. `value` must be what the READ through the cached shortcut returned.
    /// A no-op (besides the RT average) if `key` is not cached as a shortcut.
    pub fn on_shortcut_read(&mut self, key: &[u8], value: Bytes, rts: u32) {
        ewma(&mut self.avg_shortcut_hit_rts, rts);
        let Some(idx) = self.store.find(key) else {
            return;
        };
        if self.store.slot(idx).is_value() {
            return;
        }
        match self.policy {
            Policy::Dac => self.try_promote_dac(idx, value),
            Policy::Static { value_percent } => {
                let (value_area, _) = self.areas(value_percent);
                if value_cost(key.len(), value.len()) <= value_area {
                    let old = self.store.remove(idx);
                    self.promotions += 1;
                    let value = Bytes::copy_from_slice(&value);
                    self.place_value_static(&old.key, value, old.shortcut, Some(old.hits));
                }
            }
            Policy::ShortcutOnly | Policy::ValueOnly => {}
        }
    }

    /// After a miss was served by an index traversal costing `rts` round trips (updates the
    /// moving average of miss RTs): cache per policy (DAC: the value while it fits in free
    /// space, else the shortcut, making room by DEMOTING LRU values, else EVICTING the LFU
    /// shortcut). If `key` happens to be cached already, the entry is replaced and its count
    /// kept.
    pub fn on_miss_read(&mut self, key: &[u8], shortcut: Shortcut, value: Bytes, rts: u32) {
        ewma(&mut self.avg_miss_rts, rts);
        let hits = self.take(key);
        self.place(key, shortcut, value, Source::View, hits);
    }

    /// The KN itself wrote `key` (it knows where): replace any cached entry; DAC caches the
    /// value if there is free space (Table 3 BEGIN), otherwise the shortcut; the key's access
    /// count is kept (a key not cached gets the initial count, see the module doc). `value`
    /// must be a buffer of its own (a write's is: see `ShardOp::Put`); it is kept as it is.
    pub fn on_write(&mut self, key: &[u8], shortcut: Shortcut, value: Bytes) {
        let hits = match self.store.find(key) {
            Some(idx) => {
                // What taking the key out and placing it again does when the new value fits
                // in the room the old entry leaves (DAC then caches the value, with the count
                // kept, at the recent end): done in place, without hashing the key twice more
                // and reallocating it.
                let room = self.free_bytes() + self.store.cost(idx);
                if matches!(self.policy, Policy::Dac) && value_cost(key.len(), value.len()) <= room
                {
                    self.store.rewrite(idx, shortcut, value);
                    return;
                }
                Some(self.store.remove(idx).hits)
            }
            None => None,
        };
        self.place(key, shortcut, value, Source::Own, hits);
    }

    /// [`Cache::on_write`] as it was before its in-place path: the key taken out and placed
    /// again (tests compare the two).
    #[cfg(test)]
    pub(crate) fn on_write_by_replacing(&mut self, key: &[u8], shortcut: Shortcut, value: Bytes) {
        let hits = self.take(key);
        self.place(key, shortcut, value, Source::Own, hits);
    }

    /// Shortcut found stale (entry moved/changed) or key deleted: drop whatever is cached
    /// for it.
    pub fn invalidate(&mut self, key: &[u8]) {
        self.take(key);
    }

    /// Changes the budget (reconfiguration); demotes/evicts down to it. A larger budget is
    /// filled by later misses, writes and promotions.
    pub fn set_budget(&mut self, bytes: usize) {
        self.budget = bytes;
        match self.policy {
            Policy::Dac => {
                while self.store.used_bytes() > self.budget {
                    if !self.demote_lru_or_evict_lfu() {
                        break;
                    }
                }
            }
            Policy::ShortcutOnly => self.evict_lfu_until(self.budget, 0),
            Policy::ValueOnly => self.evict_lru_until(self.budget, 0),
            Policy::Static { value_percent } => {
                let (value_area, shortcut_area) = self.areas(value_percent);
                while self.store.value_bytes > value_area {
                    let lru = self.store.lru_value().expect("value bytes without values");
                    self.demote_static(lru, shortcut_area);
                }
                self.evict_lfu_until(shortcut_area, 0);
            }
        }
        debug_assert!(self.store.used_bytes() <= self.budget);
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            value_hits: self.value_hits,
            shortcut_hits: self.shortcut_hits,
            misses: self.misses,
            promotions: self.promotions,
            demotions: self.demotions,
            evictions: self.evictions,
            values: self.store.values,
            shortcuts: self.store.shortcuts,
            value_bytes: self.store.value_bytes,
            shortcut_bytes: self.store.shortcut_bytes,
        }
    }

    /// Moving average of the RTs of misses (index traversal + entry READ).
    pub fn avg_miss_rts(&self) -> f64 {
        self.avg_miss_rts
    }

    /// Moving average of the RTs of shortcut hits.
    pub fn avg_shortcut_hit_rts(&self) -> f64 {
        self.avg_shortcut_hit_rts
    }

    // ----- internals -----

    fn free_bytes(&self) -> usize {
        self.budget.saturating_sub(self.store.used_bytes())
    }

    /// (value area, shortcut area) of a static split.
    fn areas(&self, value_percent: u8) -> (usize, usize) {
        let v = (self.budget as u128 * u128::from(value_percent) / 100) as usize;
        (v, self.budget - v)
    }

    /// Drops `key` if cached, returning its count.
    fn take(&mut self, key: &[u8]) -> Option<u64> {
        let idx = self.store.find(key)?;
        Some(self.store.remove(idx).hits)
    }

    /// Caches a key that is not cached (after a miss or a write) per the policy; `hits` is
    /// the count it had if it was cached until now.
    fn place(
        &mut self,
        key: &[u8],
        shortcut: Shortcut,
        value: Bytes,
        source: Source,
        hits: Option<u64>,
    ) {
        let vcost = value_cost(key.len(), value.len());
        let scost = shortcut_cost(key.len());
        match self.policy {
            Policy::Dac => {
                if vcost <= self.free_bytes() {
                    let value = source.keep(value);
                    self.admit(key, Some(value), shortcut, hits);
                } else if scost <= self.budget {
                    while self.free_bytes() < scost {
                        if !self.demote_lru_or_evict_lfu() {
                            unreachable!("an empty cache has room for a shortcut that fits");
                        }
                    }
                    self.admit(key, None, shortcut, hits);
                }
            }
            Policy::ShortcutOnly => {
                if scost <= self.budget {
                    self.evict_lfu_until(self.budget, scost);
                    self.admit(key, None, shortcut, hits);
                }
            }
            Policy::ValueOnly => {
                if vcost <= self.budget {
                    self.evict_lru_until(self.budget, vcost);
                    let value = source.keep(value);
                    self.admit(key, Some(value), shortcut, hits);
                }
            }
            Policy::Static { value_percent } => {
                let (value_area, shortcut_area) = self.areas(value_percent);
                if vcost <= value_area {
                    let value = source.keep(value);
                    self.place_value_static(key, value, shortcut, hits);
                } else if scost <= shortcut_area {
                    self.evict_lfu_until(shortcut_area, scost);
                    self.admit(key, None, shortcut, hits);
                }
            }
        }
    }

    /// Inserts a key the caller made room for, with the count it had if it was cached until
    /// now (a refresh or a rewrite), else the initial count: computed only now so that
    /// evictions made for this key have already raised the aging base.
    fn admit(&mut self, key: &[u8], value: Option<Bytes>, shortcut: Shortcut, hits: Option<u64>) {
        let hits = hits.unwrap_or_else(|| self.initial_count());
        self.store.insert(key, value, shortcut, hits);
    }

    /// The count a key starts with when it enters the cache: one access, or the aging base
    /// (the count of the last shortcut evicted) if that is higher (LFU-DA).
    fn initial_count(&self) -> u64 {
        if self.aging {
            self.age_base.max(1)
        } else {
            1
        }
    }

    /// Drops a shortcut to make room; raises the aging base to its count (LFU-DA).
    fn evict_shortcut(&mut self, idx: u32) {
        let hits = self.store.remove(idx).hits;
        if self.aging {
            self.age_base = self.age_base.max(hits);
        }
        self.evictions += 1;
    }

    /// DAC's room-making step: demote the LRU value, or if there is none evict the LFU
    /// shortcut. False if the cache is empty.
    fn demote_lru_or_evict_lfu(&mut self) -> bool {
        if let Some(v) = self.store.lru_value() {
            self.store.demote(v);
            self.demotions += 1;
        } else if let Some(s) = self.store.lfu_shortcut() {
            self.evict_shortcut(s);
        } else {
            return false;
        }
        true
    }

    /// Evicts LFU shortcuts until `shortcut_bytes + extra <= limit` (or none is left).
    fn evict_lfu_until(&mut self, limit: usize, extra: usize) {
        while self.store.shortcut_bytes + extra > limit {
            let Some(s) = self.store.lfu_shortcut() else {
                break;
            };
            self.evict_shortcut(s);
        }
    }

    /// Evicts LRU values until `value_bytes + extra <= limit` (or none is left).
    fn evict_lru_until(&mut self, limit: usize, extra: usize) {
        while self.store.value_bytes + extra > limit {
            let Some(v) = self.store.lru_value() else {
                break;
            };
            self.store.remove(v);
            self.evictions += 1;
        }
    }

    /// Eq. 1, with demotions among the candidates (see the module doc). `idx` is a shortcut
    /// that was just hit (its count includes this hit).
    fn try_promote_dac(&mut self, idx: u32, value: Bytes) {
        let slot = self.store.slot(idx);
        let vcost = value_cost(slot.key.len(), value.len());
        let released = shortcut_cost(slot.key.len());
        // The most room there can be: every other shortcut evicted and, if promotion may
        // demote, every value demoted (their shortcuts stay). Checked first so that the walk
        // below always ends once the room is found.
        let floor = if self.demote_to_promote {
            self.store.values_as_shortcuts_bytes
        } else {
            self.store.value_bytes
        };
        if vcost > self.budget.saturating_sub(floor) {
            return;
        }
        // Room the value has once P's own shortcut is gone.
        let room = self.free_bytes() + released;
        let mut need = vcost.saturating_sub(room);
        let benefit = slot.hits as f64 * self.avg_shortcut_hit_rts;
        let (hit_rts, miss_rts) = (self.avg_shortcut_hit_rts, self.avg_miss_rts);
        let mut cost = 0.0;
        self.scratch.clear();
        if need > 0 {
            let store = &self.store;
            let mut evictable = store
                .lfu_iter()
                .filter(|&j| j != idx)
                .map(|j| Victim::evict(store, j, miss_rts))
                .peekable();
            let demote_ok = self.demote_to_promote;
            let mut demotable = store
                .lru_iter()
                .take_while(|_| demote_ok)
                .map(|j| Victim::demote(store, j, hit_rts))
                .peekable();
            while need > 0 {
                // The cheaper candidate per byte freed; an eviction on a tie (Table 3).
                let v = match (evictable.peek(), demotable.peek()) {
                    (Some(e), Some(d)) if d.cheaper_than(e) => demotable.next(),
                    (Some(_), _) => evictable.next(),
                    (None, _) => demotable.next(),
                };
                let Some(v) = v else {
                    // Unreachable after the check above; kept so a bug cannot break the budget.
                    return;
                };
                cost += v.penalty;
                if cost > benefit {
                    // The penalty only grows with more victims.
                    return;
                }
                need = need.saturating_sub(v.freed);
                self.scratch.push((v.idx, v.demote));
            }
        }
        let victims = std::mem::take(&mut self.scratch);
        for &(j, demote) in &victims {
            if demote {
                self.store.demote(j);
                self.demotions += 1;
            } else {
                self.evict_shortcut(j);
            }
        }
        self.scratch = victims;
        self.store.promote(idx, Bytes::copy_from_slice(&value));
        self.promotions += 1;
        debug_assert!(self.store.used_bytes() <= self.budget);
    }

    /// Static: inserts a value into the value area (the caller checked it fits the area),
    /// demoting LRU values into the shortcut area to make room.
    fn place_value_static(
        &mut self,
        key: &[u8],
        value: Bytes,
        shortcut: Shortcut,
        hits: Option<u64>,
    ) {
        let Policy::Static { value_percent } = self.policy else {
            unreachable!("static placement under {}", self.policy)
        };
        let (value_area, shortcut_area) = self.areas(value_percent);
        let vcost = value_cost(key.len(), value.len());
        while self.store.value_bytes + vcost > value_area {
            let lru = self
                .store
                .lru_value()
                .expect("value area over-full without values");
            self.demote_static(lru, shortcut_area);
        }
        self.admit(key, Some(value), shortcut, hits);
    }

    /// Static: moves value `idx` to the shortcut area (LFU eviction there), or drops it if
    /// its shortcut cannot fit the area at all.
    fn demote_static(&mut self, idx: u32, shortcut_area: usize) {
        let scost = shortcut_cost(self.store.slot(idx).key.len());
        if scost <= shortcut_area {
            self.evict_lfu_until(shortcut_area, scost);
            self.store.demote(idx);
            self.demotions += 1;
        } else {
            self.store.remove(idx);
            self.evictions += 1;
        }
    }

    /// Plain access counts instead of LFU-DA (tests only: the simulation compares both).
    #[cfg(test)]
    fn set_count_aging(&mut self, on: bool) {
        self.aging = on;
    }

    /// Table 3's promotion as published: Eq. 1 over LFU shortcuts only, never demoting a
    /// value to promote (tests only: the simulation compares both).
    #[cfg(test)]
    fn set_demote_to_promote(&mut self, on: bool) {
        self.demote_to_promote = on;
    }

    /// What is cached for `key`, without counting an access (tests only).
    #[cfg(test)]
    fn peek(&self, key: &[u8]) -> Lookup {
        match self.store.find(key) {
            None => Lookup::Miss,
            Some(i) => {
                let shortcut = self.store.slot(i).shortcut;
                match self.store.value(i) {
                    Some(v) => Lookup::Value {
                        value: v.clone(),
                        shortcut,
                    },
                    None => Lookup::Shortcut(shortcut),
                }
            }
        }
    }

    /// The key's access count if cached (tests only).
    #[cfg(test)]
    fn hits(&self, key: &[u8]) -> Option<u64> {
        self.store.find(key).map(|i| self.store.slot(i).hits)
    }

    /// Checks every invariant of the module doc that is checkable from inside (tests only).
    #[cfg(test)]
    fn check(&self) {
        self.store.check();
        assert!(
            self.store.used_bytes() <= self.budget,
            "over budget: {} > {}",
            self.store.used_bytes(),
            self.budget
        );
        match self.policy {
            Policy::ShortcutOnly => assert_eq!(self.store.values, 0),
            Policy::ValueOnly => assert_eq!(self.store.shortcuts, 0),
            Policy::Static { value_percent } => {
                let (va, sa) = self.areas(value_percent);
                assert!(self.store.value_bytes <= va);
                assert!(self.store.shortcut_bytes <= sa);
            }
            Policy::Dac => {}
        }
    }
}
