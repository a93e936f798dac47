//! The mechanics under the policies: one slot per cached key, in one hash table, and two
//! orders over the slots.
//!
//! * Every cached key has exactly one [`Slot`] in `slots`, found through `table` (a
//!   `hashbrown::HashTable<u32>` of slot indices, keyed by a hash of the key bytes). A slot
//!   is either a *value* (its `value` indexes the value bytes in `vals`) or a *shortcut*
//!   (`value == NIL`); there is no way to hold a key twice, which is what makes "never both a
//!   value and a shortcut" structural rather than a convention. Value bytes live in a
//!   separate slab so that shortcut slots (the many small entries) do not pay for a `Bytes`
//!   handle.
//! * Values are threaded on an intrusive doubly linked list in recency order (head = least
//!   recently used). Shortcuts are threaded on per-count lists ("frequency buckets") kept in a
//!   `BTreeMap<count, bucket>`; within a bucket the head is the shortcut that reached that
//!   count first. A slot is on exactly one list, so both orders share the same `prev`/`next`
//!   fields.
//! * Costs: touching a value, bumping a shortcut's count, finding the LRU value and the LFU
//!   shortcut are O(1) list operations plus at most two O(log #distinct counts) map
//!   operations. Nothing scans.
//! * `value_bytes` / `shortcut_bytes` are always the sum of [`value_cost`] / [`shortcut_cost`]
//!   over the slots of each kind, and `values_as_shortcuts_bytes` the sum of [`shortcut_cost`]
//!   over the value slots; every mutation goes through [`Store::link`]/[`Store::unlink`] which
//!   keep them exact.
//!
//! This module does not know about budgets or policies: [`super::Cache`] decides what to
//! insert, demote, promote and evict; the store only does it.

use std::collections::BTreeMap;
use std::hash::BuildHasher;

use bytes::Bytes;
use dinomo_layout::index::EntryPtr;
use hashbrown::{DefaultHashBuilder, HashTable};

use super::{Shortcut, SHORTCUT_OVERHEAD, VALUE_OVERHEAD};

const NIL: u32 = u32::MAX;

/// Bytes charged to the budget for a key cached as a value.
pub(crate) fn value_cost(key_len: usize, value_len: usize) -> usize {
    key_len
        .saturating_add(value_len)
        .saturating_add(VALUE_OVERHEAD)
}

/// Bytes charged to the budget for a key cached as a shortcut.
pub(crate) fn shortcut_cost(key_len: usize) -> usize {
    key_len.saturating_add(SHORTCUT_OVERHEAD)
}

/// One cached key: 64 bytes on 64-bit targets (checked by a test against the overhead
/// constants).
#[derive(Debug)]
pub(crate) struct Slot {
    pub key: Box<[u8]>,
    pub shortcut: Shortcut,
    /// Access count; survives promotion and demotion.
    pub hits: u64,
    prev: u32,
    next: u32,
    /// Index of the value in `Store::vals`, or `NIL` for a shortcut entry.
    value: u32,
}

impl Default for Slot {
    /// An unused slot: owns no heap memory.
    fn default() -> Self {
        Slot {
            key: Box::default(),
            shortcut: Shortcut {
                ptr: EntryPtr { offset: 0, len: 0 },
                version: 0,
            },
            hits: 0,
            prev: NIL,
            next: NIL,
            value: NIL,
        }
    }
}

impl Slot {
    pub fn is_value(&self) -> bool {
        self.value != NIL
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    head: u32,
    tail: u32,
}

/// What a removed slot held.
#[derive(Debug)]
pub(crate) struct Removed {
    pub key: Box<[u8]>,
    pub shortcut: Shortcut,
    pub hits: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Store {
    hasher: DefaultHashBuilder,
    table: HashTable<u32>,
    slots: Vec<Slot>,
    /// Indices of unused slots in `slots`.
    free: Vec<u32>,
    /// Value bytes of the value slots (unused entries hold an empty, unallocated `Bytes`).
    vals: Vec<Bytes>,
    /// Indices of unused entries in `vals`.
    vals_free: Vec<u32>,
    /// LRU end of the value list.
    lru_head: u32,
    /// MRU end of the value list.
    lru_tail: u32,
    buckets: BTreeMap<u64, Bucket>,
    pub values: usize,
    pub shortcuts: usize,
    pub value_bytes: usize,
    pub shortcut_bytes: usize,
    /// What the values would cost as shortcuts: the sum of [`shortcut_cost`] over the value
    /// slots (the floor of `value_bytes` under demotion).
    pub values_as_shortcuts_bytes: usize,
}

impl Store {
    pub fn new() -> Self {
        Store {
            lru_head: NIL,
            lru_tail: NIL,
            ..Default::default()
        }
    }

    pub fn used_bytes(&self) -> usize {
        self.value_bytes + self.shortcut_bytes
    }

    pub fn slot(&self, idx: u32) -> &Slot {
        &self.slots[idx as usize]
    }

    /// The value bytes of a value slot, `None` for a shortcut.
    pub fn value(&self, idx: u32) -> Option<&Bytes> {
        let v = self.slots[idx as usize].value;
        (v != NIL).then(|| &self.vals[v as usize])
    }

    pub fn cost(&self, idx: u32) -> usize {
        let s = &self.slots[idx as usize];
        match self.value(idx) {
            Some(v) => value_cost(s.key.len(), v.len()),
            None => shortcut_cost(s.key.len()),
        }
    }

    fn alloc_value(&mut self, value: Bytes) -> u32 {
        match self.vals_free.pop() {
            Some(i) => {
                self.vals[i as usize] = value;
                i
            }
            None => {
                self.vals.push(value);
                (self.vals.len() - 1) as u32
            }
        }
    }

    fn free_value(&mut self, v: u32) {
        self.vals[v as usize] = Bytes::new();
        self.vals_free.push(v);
    }

    pub fn find(&self, key: &[u8]) -> Option<u32> {
        let hash = self.hasher.hash_one(key);
        let slots = &self.slots;
        self.table
            .find(hash, |&i| &*slots[i as usize].key == key)
            .copied()
    }

    /// The least recently used value.
    pub fn lru_value(&self) -> Option<u32> {
        (self.lru_head != NIL).then_some(self.lru_head)
    }

    /// The least frequently used shortcut (ties: the one that reached its count first).
    pub fn lfu_shortcut(&self) -> Option<u32> {
        self.buckets.values().next().map(|b| b.head)
    }

    /// Values from least to most recently used.
    pub fn lru_iter(&self) -> LruIter<'_> {
        LruIter {
            store: self,
            cur: self.lru_head,
        }
    }

    /// Shortcuts from least to most frequently used.
    pub fn lfu_iter(&self) -> LfuIter<'_> {
        LfuIter {
            store: self,
            buckets: self.buckets.values(),
            cur: NIL,
        }
    }

    /// Inserts a key that is not cached. The caller has made room.
    pub fn insert(
        &mut self,
        key: &[u8],
        value: Option<Bytes>,
        shortcut: Shortcut,
        hits: u64,
    ) -> u32 {
        debug_assert!(self.find(key).is_none(), "key inserted twice");
        let value = match value {
            Some(v) => self.alloc_value(v),
            None => NIL,
        };
        let slot = Slot {
            key: key.into(),
            shortcut,
            hits,
            prev: NIL,
            next: NIL,
            value,
        };
        let idx = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = slot;
                i
            }
            None => {
                let i = u32::try_from(self.slots.len())
                    .ok()
                    .filter(|&i| i != NIL)
                    .expect("more than 2^32-1 cached keys");
                self.slots.push(slot);
                i
            }
        };
        let hash = self.hasher.hash_one(key);
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.table
            .insert_unique(hash, idx, |&i| hasher.hash_one(&*slots[i as usize].key));
        self.link(idx);
        idx
    }

    pub fn remove(&mut self, idx: u32) -> Removed {
        self.unlink(idx);
        let hash = self.hasher.hash_one(&*self.slots[idx as usize].key);
        match self.table.find_entry(hash, |&i| i == idx) {
            Ok(e) => {
                e.remove();
            }
            Err(_) => unreachable!("slot {idx} not in the table"),
        }
        let slot = std::mem::take(&mut self.slots[idx as usize]);
        self.free.push(idx);
        if slot.value != NIL {
            self.free_value(slot.value);
        }
        if self.table.is_empty() {
            // Nothing is cached: give the slabs back (e.g. after a budget cut to zero).
            self.slots = Vec::new();
            self.free = Vec::new();
            self.vals = Vec::new();
            self.vals_free = Vec::new();
        }
        Removed {
            key: slot.key,
            shortcut: slot.shortcut,
            hits: slot.hits,
        }
    }

    /// A value hit: count it and make it the most recently used.
    pub fn touch_value(&mut self, idx: u32) {
        self.unlink(idx);
        let s = &mut self.slots[idx as usize];
        s.hits = s.hits.saturating_add(1);
        self.link(idx);
    }

    /// A shortcut hit: count it (moves it to the next frequency bucket).
    pub fn bump_shortcut(&mut self, idx: u32) {
        self.unlink(idx);
        let s = &mut self.slots[idx as usize];
        s.hits = s.hits.saturating_add(1);
        self.link(idx);
    }

    /// Value -> shortcut in place (keeps the key's count and shortcut).
    pub fn demote(&mut self, idx: u32) {
        debug_assert!(self.slots[idx as usize].is_value());
        self.unlink(idx);
        let v = std::mem::replace(&mut self.slots[idx as usize].value, NIL);
        self.free_value(v);
        self.link(idx);
    }

    /// Shortcut -> value in place (keeps the key's count and shortcut). The caller has made
    /// room.
    pub fn promote(&mut self, idx: u32, value: Bytes) {
        debug_assert!(!self.slots[idx as usize].is_value());
        self.unlink(idx);
        self.slots[idx as usize].value = self.alloc_value(value);
        self.link(idx);
    }

    /// A cached key written: its shortcut and value replaced in place, its count kept, and
    /// it becomes the most recently used value (what removing and inserting it again does,
    /// as far as anything outside the store can see: the slot and the slabs are kept even
    /// when it is the only key). The caller has made room.
    pub fn rewrite(&mut self, idx: u32, shortcut: Shortcut, value: Bytes) {
        self.unlink(idx);
        let old = self.slots[idx as usize].value;
        if old != NIL {
            self.free_value(old);
        }
        let v = self.alloc_value(value);
        let s = &mut self.slots[idx as usize];
        s.shortcut = shortcut;
        s.value = v;
        self.link(idx);
    }

    /// Puts a slot on its list (LRU tail for values, its count's bucket tail for shortcuts)
    /// and adds its cost.
    fn link(&mut self, idx: u32) {
        let cost = self.cost(idx);
        let tail = if self.slots[idx as usize].is_value() {
            self.values += 1;
            self.value_bytes += cost;
            self.values_as_shortcuts_bytes += shortcut_cost(self.slots[idx as usize].key.len());
            let tail = self.lru_tail;
            self.lru_tail = idx;
            if tail == NIL {
                self.lru_head = idx;
            }
            tail
        } else {
            self.shortcuts += 1;
            self.shortcut_bytes += cost;
            let hits = self.slots[idx as usize].hits;
            let b = self.buckets.entry(hits).or_insert(Bucket {
                head: idx,
                tail: NIL,
            });
            let tail = b.tail;
            b.tail = idx;
            tail
        };
        self.slots[idx as usize].prev = tail;
        self.slots[idx as usize].next = NIL;
        if tail != NIL {
            self.slots[tail as usize].next = idx;
        }
    }

    /// Takes a slot off its list and subtracts its cost.
    fn unlink(&mut self, idx: u32) {
        let cost = self.cost(idx);
        let (prev, next, is_value, hits) = {
            let s = &self.slots[idx as usize];
            (s.prev, s.next, s.is_value(), s.hits)
        };
        if prev != NIL {
            self.slots[prev as usize].next = next;
        }
        if next != NIL {
            self.slots[next as usize].prev = prev;
        }
        if is_value {
            self.values -= 1;
            self.value_bytes -= cost;
            self.values_as_shortcuts_bytes -= shortcut_cost(self.slots[idx as usize].key.len());
            if self.lru_head == idx {
                self.lru_head = next;
            }
            if self.lru_tail == idx {
                self.lru_tail = prev;
            }
        } else {
            self.shortcuts -= 1;
            self.shortcut_bytes -= cost;
            let b = self
                .buckets
                .get_mut(&hits)
                .expect("shortcut's frequency bucket exists");
            if b.head == idx {
                b.head = next;
            }
            if b.tail == idx {
                b.tail = prev;
            }
            if b.head == NIL {
                self.buckets.remove(&hits);
            }
        }
        let s = &mut self.slots[idx as usize];
        s.prev = NIL;
        s.next = NIL;
    }

    /// Walks every structure and checks it against the counters (tests only).
    #[cfg(test)]
    pub fn check(&self) {
        let live: Vec<u32> = self.table.iter().copied().collect();
        assert_eq!(live.len(), self.values + self.shortcuts);
        assert_eq!(live.len() + self.free.len(), self.slots.len());
        assert_eq!(self.values + self.vals_free.len(), self.vals.len());
        let (mut vb, mut sb, mut nv, mut ns, mut vsb) = (0, 0, 0, 0, 0);
        for &i in &live {
            let s = self.slot(i);
            assert_eq!(self.find(&s.key), Some(i));
            if s.is_value() {
                nv += 1;
                vb += self.cost(i);
                vsb += shortcut_cost(s.key.len());
            } else {
                ns += 1;
                sb += self.cost(i);
            }
        }
        assert_eq!(
            (nv, ns, vb, sb),
            (
                self.values,
                self.shortcuts,
                self.value_bytes,
                self.shortcut_bytes
            )
        );
        assert_eq!(vsb, self.values_as_shortcuts_bytes);
        // The LRU list holds exactly the values, linked both ways.
        let mut n = 0;
        let mut prev = NIL;
        let mut cur = self.lru_head;
        while cur != NIL {
            assert!(self.slot(cur).is_value());
            assert_eq!(self.slot(cur).prev, prev);
            prev = cur;
            cur = self.slot(cur).next;
            n += 1;
        }
        assert_eq!(prev, self.lru_tail);
        assert_eq!(n, self.values);
        // The buckets hold exactly the shortcuts, each in the bucket of its count.
        let mut n = 0;
        for (&hits, b) in &self.buckets {
            let mut prev = NIL;
            let mut cur = b.head;
            assert_ne!(cur, NIL, "empty bucket kept");
            while cur != NIL {
                let s = self.slot(cur);
                assert!(!s.is_value());
                assert_eq!(s.hits, hits);
                assert_eq!(s.prev, prev);
                prev = cur;
                cur = s.next;
                n += 1;
            }
            assert_eq!(prev, b.tail);
        }
        assert_eq!(n, self.shortcuts);
        assert_eq!(self.lfu_iter().count(), self.shortcuts);
    }
}

/// Shortcut slot indices from least to most frequently used.
#[derive(Debug)]
pub(crate) struct LfuIter<'a> {
    store: &'a Store,
    buckets: std::collections::btree_map::Values<'a, u64, Bucket>,
    cur: u32,
}

impl Iterator for LfuIter<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.cur == NIL {
            self.cur = self.buckets.next()?.head;
        }
        let idx = self.cur;
        self.cur = self.store.slot(idx).next;
        Some(idx)
    }
}

/// Value slot indices from least to most recently used.
#[derive(Debug)]
pub(crate) struct LruIter<'a> {
    store: &'a Store,
    cur: u32,
}

impl Iterator for LruIter<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.cur == NIL {
            return None;
        }
        let idx = self.cur;
        self.cur = self.store.slot(idx).next;
        Some(idx)
    }
}
