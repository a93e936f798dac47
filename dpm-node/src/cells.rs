//! Indirect cells of replicated (hot) keys (DINOMO 3.4): which keys have one, where, and which
//! log segments their current values pin.
//!
//! A cell is an 8-byte word in its own cache line of the index area's cell space
//! ([`IndexArea`]) holding an [`EntryPtr`] word; the key's owner KNs
//! READ it and swing it with one-sided CAS, so the DPM does not see its updates. While a key has
//! a cell, the cell, not the index, is the key's value of record: merges still apply the key's
//! log entries to the index (in no useful order across KNs), and de-replication writes the
//! cell's value back into the index once every owner's log is merged.
//!
//! Invariant (garbage collection): a segment that holds the entry a cell points to is neither
//! freed nor cleaned. The GC checks this right before acting on a merged segment, which is race
//! free: a cell only ever moves to an entry its KN has just written, in a segment that is still
//! open for that KN, never into an already merged one.
//!
//! Space: the cell space has a fixed number of cells; which are in use is rebuilt at open from
//! the metadata records (`cell/<hex key>` -> offset), so a cell removed (or allocated by an
//! install that crashed before its record) is free again.

use std::collections::BTreeMap;

use dinomo_layout::index::{EntryPtr, IndexArea};
use parking_lot::RwLock;

use crate::error::{DpmError, Result};
use crate::pool::Pool;

/// The live cells: key -> pool offset of its word.
#[derive(Debug)]
pub struct Cells {
    area: IndexArea,
    by_key: RwLock<BTreeMap<Vec<u8>, u64>>,
}

impl Cells {
    pub fn new(area: IndexArea) -> Self {
        Cells {
            area,
            by_key: RwLock::default(),
        }
    }

    /// Records the cell of `key` found in the metadata at open; false if the offset is not a
    /// cell of this pool or is already taken.
    pub fn claim(&self, key: &[u8], offset: u64) -> bool {
        let mut m = self.by_key.write();
        if self.area.cell_index(offset).is_none() || m.values().any(|&o| o == offset) {
            return false;
        }
        m.insert(key.to_vec(), offset);
        true
    }

    /// Gives `key` a free cell (the lowest) and returns its offset.
    pub fn allocate(&self, key: &[u8]) -> Result<u64> {
        let mut m = self.by_key.write();
        let used: std::collections::HashSet<u64> = m.values().copied().collect();
        let off = (0..self.area.cells)
            .map(|i| self.area.cell(i))
            .find(|o| !used.contains(o))
            .ok_or(DpmError::CellsFull {
                cells: self.area.cells,
            })?;
        m.insert(key.to_vec(), off);
        Ok(off)
    }

    pub fn remove(&self, key: &[u8]) -> Option<u64> {
        self.by_key.write().remove(key)
    }

    pub fn get(&self, key: &[u8]) -> Option<u64> {
        self.by_key.read().get(key).copied()
    }

    pub fn len(&self) -> usize {
        self.by_key.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entry a cell points to now (`None`: the key does not exist).
    pub fn current(pool: &Pool, offset: u64) -> Option<EntryPtr> {
        let w = pool
            .region()
            .word(offset)
            .ok()?
            .load(std::sync::atomic::Ordering::Acquire);
        EntryPtr::from_word(w)
    }

    /// The offsets of the live cells' words.
    pub fn offsets(&self) -> Vec<u64> {
        self.by_key.read().values().copied().collect()
    }

    /// Whether any cell points into segment `id` at this moment.
    pub fn pins(&self, pool: &Pool, id: u64) -> bool {
        let sb = pool.superblock();
        self.by_key.read().values().any(|&off| {
            Self::current(pool, off).is_some_and(|p| sb.segment_of(p.offset) == Some(id))
        })
    }
}
