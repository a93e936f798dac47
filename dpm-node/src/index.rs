//! The DPM's side of the persistent hash index: lookups, in-place updates by merge workers, and
//! growth by linear hashing into chunks taken from the segment area. Formats, the split
//! protocol and the reader-side argument are in dinomo_layout::index; the design and why it
//! replaced whole-table doubling are in docs/decisions/0004-linear-hashing-index.md.
//!
//! Concurrency: readers (here and KNs over the fabric) take no locks. Writers hold the table
//! lock shared plus the stripe lock of the key's home bucket (the home bucket does not change
//! while the table lock is held shared); a split holds the table lock exclusively for the one
//! chain it splits.
//!
//! Persistence order:
//! - a slot in a free position: hash word persisted, then entry word persisted (so a torn line
//!   can never show a live entry under a stale hash);
//! - an overflow bucket is persisted before the `next` word that links it;
//! - a split: new chain persisted (its home state last), then depths on the old chain (home
//!   last: the commit point), then moved slots zeroed, then the shape word. [`Index::open`]
//!   finishes a committed split or erases an uncommitted one.
//!
//! Space: home buckets live in bucket chunks named by the directory; overflow buckets are
//! carved from overflow chunks. Chains never give buckets back while the DPM runs (a KN may be
//! walking them); at open every overflow bucket no chain reaches is free again, and an overflow
//! chunk none of whose buckets is reached goes back to the segment pool.
//!
//! Failure: an upsert either changes one slot (or links one new bucket) or fails with nothing
//! changed. Growth never fails an upsert: a split that finds no free segment is skipped (chains
//! get longer) and retried later.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dinomo_layout::index::{
    depth_word, slot_entry_offset, slot_hash_offset, Bucket, EntryPtr, IndexArea, IndexHeader,
    Shape, BUCKET_SIZE, INDEX_HEADER_SIZE, SHAPE_OFFSET, STATE_OFFSET,
};
use dinomo_layout::log::ENTRY_HEADER;
use dinomo_layout::meta::Roots;
use dinomo_layout::segment::{CHUNK_BUCKETS, CHUNK_OVERFLOW};
use parking_lot::{Mutex, RwLock};

use crate::error::{DpmError, Result};
use crate::pool::Pool;
use crate::segments::{Segments, Tier};

const STRIPES: usize = 1024;
/// Split when the average home bucket holds more than this many items (of 3 slots).
const MAX_LOAD: f64 = 2.25;
/// Longest chain any walk follows; a longer one means a corrupt pool (or a cycle).
pub const MAX_CHAIN: usize = 1 << 20;
/// Inserts to let pass before trying again after a split found no free segment.
const SPLIT_BACKOFF: u64 = 4096;

/// What the DRAM copy of the table knows: the shape and where each bucket chunk lies.
#[derive(Debug)]
struct Table {
    shape: Shape,
    /// Pool offset of bucket chunk `j` (0: not allocated).
    chunks: Vec<u64>,
}

/// Overflow buckets not linked into any chain.
#[derive(Debug, Default)]
struct Overflow {
    free: Vec<u64>,
    /// Segment ids of overflow chunks.
    chunks: Vec<u64>,
}

/// The index of one pool.
#[derive(Debug)]
pub struct Index {
    pool: Arc<Pool>,
    segments: Arc<Segments>,
    header: IndexHeader,
    header_off: u64,
    table: RwLock<Table>,
    overflow: Mutex<Overflow>,
    stripes: Vec<Mutex<()>>,
    items: AtomicU64,
    splits: AtomicU64,
    /// Inserts still to pass before the next split attempt (after one found the pool full).
    split_backoff: AtomicU64,
    /// Set when a persist failed after its store (see [`Index::poison`]).
    poisoned: std::sync::atomic::AtomicBool,
}

/// Sizes of the index, for stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexSpace {
    pub buckets: u64,
    pub bucket_chunks: u64,
    pub overflow_chunks: u64,
    /// Bytes of segments holding index buckets.
    pub bytes: u64,
}

impl Index {
    /// Opens the index of `pool`, creating it (with `2^ceil(log2(initial_buckets))` home
    /// buckets, at most one chunk) if the pool is new, finishing or erasing a split a crash
    /// interrupted, and giving back index space nothing uses.
    pub fn open(pool: Arc<Pool>, segments: Arc<Segments>, initial_buckets: u64) -> Result<Self> {
        let area = IndexArea::of(pool.superblock());
        let chunk_buckets = pool.superblock().segment_size / BUCKET_SIZE as u64;
        let root = pool.root(Roots::INDEX_TABLE).load(Ordering::Acquire);
        let index_segments = segments.index_segments()?;
        if root == 0 {
            // A new pool, or a crash before the first table was published: anything an earlier
            // attempt allocated is unreferenced.
            for (id, _) in &index_segments {
                segments.free_index_chunk(*id)?;
            }
            let min_level = initial_buckets
                .clamp(64, chunk_buckets)
                .next_power_of_two()
                .trailing_zeros();
            create(&pool, &segments, &area, chunk_buckets, min_level)?;
            return Self::open(pool, segments, initial_buckets);
        } else if root != area.header_off {
            return Err(bad(
                &pool,
                format!("the index root names {root}, not the index area"),
            ));
        }
        let mut head = [0u8; INDEX_HEADER_SIZE];
        pool.region().read(area.header_off, &mut head)?;
        let (header, shape) =
            IndexHeader::decode_with_shape(&head).map_err(|source| DpmError::Layout {
                path: pool.path(),
                source,
            })?;
        if header.chunk_buckets != chunk_buckets
            || header.directory_off != area.directory_off
            || header.max_chunks != area.max_chunks
        {
            return Err(bad(
                &pool,
                format!("index header {header:?} does not match the pool"),
            ));
        }
        let sb = *pool.superblock();
        let mut chunks = vec![0u64; header.max_chunks as usize];
        let mut used_segments = HashSet::new();
        for (j, c) in chunks.iter_mut().enumerate() {
            let off = pool
                .region()
                .word(header.directory_word(j as u64))?
                .load(Ordering::Acquire);
            if off == 0 {
                continue;
            }
            let seg = sb.segment_of(off).filter(|&s| sb.segment_offset(s) == off);
            let entry = seg.map(|s| pool.read_table_entry(s)).transpose()?;
            match (seg, entry) {
                (Some(s), Some(e))
                    if e.state == dinomo_layout::segment::SegState::Index
                        && e.stream == CHUNK_BUCKETS
                        && e.chain_seq == j as u64 =>
                {
                    used_segments.insert(s);
                    *c = off;
                }
                _ => {
                    return Err(bad(
                        &pool,
                        format!("directory word {j} names {off}, which is not bucket chunk {j}"),
                    ))
                }
            }
        }
        let index = Index {
            pool,
            segments,
            header,
            header_off: area.header_off,
            table: RwLock::new(Table { shape, chunks }),
            overflow: Mutex::new(Overflow::default()),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            items: AtomicU64::new(0),
            splits: AtomicU64::new(0),
            split_backoff: AtomicU64::new(0),
            poisoned: std::sync::atomic::AtomicBool::new(false),
        };
        // Bucket chunks the directory does not name were allocated by a split that crashed
        // before recording them.
        for (id, e) in &index_segments {
            if e.stream == CHUNK_BUCKETS && !used_segments.contains(id) {
                index.segments.free_index_chunk(*id)?;
            }
        }
        index.recover_split()?;
        index.rebuild_overflow(&index_segments)?;
        let mut n = 0;
        index.for_each(|_, _| n += 1)?;
        index.items.store(n, Ordering::Relaxed);
        Ok(index)
    }

    /// Finishes (new chain complete) or erases (incomplete) the split the shape says is next.
    fn recover_split(&self) -> Result<()> {
        let mut t = self.table.write();
        let shape = t.shape;
        let n = shape.buckets();
        let (chunk, _) = self.header.locate(n);
        if t.chunks.get(chunk as usize).is_none_or(|&c| c == 0) {
            return Ok(());
        }
        let n_off = self.bucket_off(&t, n);
        let nb = self.bucket(n_off)?;
        if nb.depth() == Some(shape.level + 1) {
            tracing::warn!(
                bucket = shape.split,
                level = shape.level,
                "finishing an index split interrupted by a crash"
            );
            self.commit_split(&mut t)?;
        } else if nb != Bucket::default() {
            tracing::warn!(
                bucket = shape.split,
                level = shape.level,
                "erasing an index split interrupted by a crash before it was complete"
            );
            self.pool
                .region()
                .write_durable(n_off, &[0u8; BUCKET_SIZE])?;
        }
        Ok(())
    }

    /// Frees every overflow bucket no chain reaches, and every overflow chunk none of whose
    /// buckets is reached.
    fn rebuild_overflow(
        &self,
        index_segments: &[(u64, dinomo_layout::segment::TableEntry)],
    ) -> Result<()> {
        let mut reached = HashSet::new();
        {
            let t = self.table.read();
            for b in 0..t.shape.buckets() {
                let home = self.bucket_off(&t, b);
                self.walk(home, |off, _| {
                    if off != home {
                        reached.insert(off);
                    }
                    true
                })?;
            }
        }
        let sb = *self.pool.superblock();
        let mut ov = self.overflow.lock();
        for (id, e) in index_segments {
            if e.stream != CHUNK_OVERFLOW {
                continue;
            }
            let start = sb.segment_offset(*id);
            let offs =
                (0..sb.segment_size / BUCKET_SIZE as u64).map(|i| start + i * BUCKET_SIZE as u64);
            if offs.clone().any(|o| reached.contains(&o)) {
                ov.chunks.push(*id);
                // Popped from the end: hand out low offsets first.
                ov.free.extend(offs.rev().filter(|o| !reached.contains(o)));
            } else {
                self.segments.free_index_chunk(*id)?;
            }
        }
        Ok(())
    }

    pub fn items(&self) -> u64 {
        self.items.load(Ordering::Relaxed)
    }

    pub fn bucket_count(&self) -> u64 {
        self.table.read().shape.buckets()
    }

    /// Buckets split so far by this process.
    pub fn resizes(&self) -> u64 {
        self.splits.load(Ordering::Relaxed)
    }

    pub fn space(&self) -> IndexSpace {
        let t = self.table.read();
        let bucket_chunks = t.chunks.iter().filter(|&&c| c != 0).count() as u64;
        let overflow_chunks = self.overflow.lock().chunks.len() as u64;
        IndexSpace {
            buckets: t.shape.buckets(),
            bucket_chunks,
            overflow_chunks,
            bytes: (bucket_chunks + overflow_chunks) * self.pool.superblock().segment_size,
        }
    }

    /// Bytes of buckets in use (home and linked overflow) and bytes allocated but not in use
    /// (free overflow buckets, home buckets not yet split into the last chunk): what the
    /// admission of new log segments weighs against (see `Dpm::allocate_segment`).
    pub fn usage(&self) -> (u64, u64) {
        let t = self.table.read();
        let ov = self.overflow.lock();
        let per_chunk = self.header.chunk_buckets;
        let home_allocated = t.chunks.iter().filter(|&&c| c != 0).count() as u64 * per_chunk;
        let home_used = t.shape.buckets();
        let overflow_free = ov.free.len() as u64;
        let overflow_used = ov.chunks.len() as u64 * per_chunk - overflow_free;
        let b = BUCKET_SIZE as u64;
        (
            (home_used + overflow_used) * b,
            (home_allocated.saturating_sub(home_used) + overflow_free) * b,
        )
    }

    /// Pool offset of the index header (what KNs read from the root word).
    pub fn table_header_offset(&self) -> u64 {
        self.header_off
    }

    fn bucket_off(&self, t: &Table, b: u64) -> u64 {
        let (chunk, within) = self.header.locate(b);
        t.chunks[chunk as usize] + within
    }

    fn bucket(&self, off: u64) -> Result<Bucket> {
        Ok(Bucket::decode(self.pool.view(off, BUCKET_SIZE as u64)?).expect("64 bytes"))
    }

    /// Calls `f(offset, bucket)` along the chain from `start` until it returns false.
    fn walk(&self, start: u64, mut f: impl FnMut(u64, &Bucket) -> bool) -> Result<()> {
        let mut off = start;
        for _ in 0..MAX_CHAIN {
            let b = self.bucket(off)?;
            if !f(off, &b) || b.next == 0 {
                return Ok(());
            }
            off = b.next;
        }
        Err(bad(
            &self.pool,
            format!("the index chain from {start} does not end"),
        ))
    }

    /// Does the entry at `ptr` hold `key`? Merged entries were CRC-checked when merged, so only
    /// the key is compared here.
    fn entry_has_key(&self, ptr: EntryPtr, key: &[u8]) -> Result<bool> {
        let head = self.pool.view(ptr.offset, ENTRY_HEADER as u64)?;
        let key_len = u16::from_le_bytes([head[6], head[7]]) as usize;
        if key_len != key.len() {
            return Ok(false);
        }
        Ok(self
            .pool
            .view(ptr.offset + ENTRY_HEADER as u64, key_len as u64)?
            == key)
    }

    /// Finds `key` in the chain from `home`: (bucket offset, slot, entry).
    fn find(&self, home: u64, key: &[u8], hash: u64) -> Result<Option<(u64, usize, EntryPtr)>> {
        let mut found = None;
        let mut err = None;
        self.walk(home, |off, b| {
            for (i, p) in b.candidates(hash) {
                match self.entry_has_key(p, key) {
                    Ok(true) => {
                        found = Some((off, i, p));
                        return false;
                    }
                    Ok(false) => {}
                    Err(e) => {
                        err = Some(e);
                        return false;
                    }
                }
            }
            true
        })?;
        err.map_or(Ok(found), Err)
    }

    /// The entry of `key`, if indexed.
    pub fn lookup(&self, key: &[u8], hash: u64) -> Result<Option<EntryPtr>> {
        let t = self.table.read();
        let (b, _) = t.shape.home(hash);
        Ok(self
            .find(self.bucket_off(&t, b), key, hash)?
            .map(|(_, _, p)| p))
    }

    fn stripe(&self, t: &Table, hash: u64) -> &Mutex<()> {
        &self.stripes[(t.shape.home(hash).0 % STRIPES as u64) as usize]
    }

    /// Points `key` at `ptr`; returns the entry it replaced. On error nothing was changed.
    pub fn upsert(&self, key: &[u8], hash: u64, ptr: EntryPtr) -> Result<Option<EntryPtr>> {
        self.check_poisoned()?;
        let replaced = {
            let t = self.table.read();
            let _g = self.stripe(&t, hash).lock();
            self.upsert_locked(&t, key, hash, ptr)?
        };
        if replaced.is_none() {
            let n = self.items.fetch_add(1, Ordering::Relaxed) + 1;
            self.maybe_split(n);
        }
        Ok(replaced)
    }

    fn upsert_locked(
        &self,
        t: &Table,
        key: &[u8],
        hash: u64,
        ptr: EntryPtr,
    ) -> Result<Option<EntryPtr>> {
        let (b, depth) = t.shape.home(hash);
        let home = self.bucket_off(t, b);
        if let Some((off, i, old)) = self.find(home, key, hash)? {
            self.store_slot_entry(off, i, ptr.to_word())?;
            return Ok(Some(old));
        }
        let mut free: Option<(u64, usize)> = None;
        let mut last = home;
        self.walk(home, |off, b| {
            last = off;
            if let Some(i) = b.slots.iter().position(|&(_, e)| e == 0) {
                free = Some((off, i));
                return false;
            }
            true
        })?;
        let region = self.pool.region();
        if let Some((boff, i)) = free {
            let hash_at = boff + slot_hash_offset(i) as u64;
            region.word(hash_at)?.store(hash, Ordering::Release);
            region.persist(hash_at, 8)?;
            self.store_slot_entry(boff, i, ptr.to_word())?;
            return Ok(None);
        }
        // Chain full: a new overflow bucket, persisted before it is linked.
        let nb = self.alloc_overflow(Tier::IndexOverflow)?;
        let bucket = Bucket {
            slots: [(hash, ptr.to_word()), (0, 0), (0, 0)],
            state: depth_word(depth),
            ..Bucket::default()
        };
        if let Err(e) = region.write_durable(nb, &bucket.encode()) {
            self.overflow.lock().free.push(nb);
            return Err(e.into());
        }
        region.word(last)?.store(nb, Ordering::Release);
        region.persist(last, 8).map_err(|e| self.poison(e.into()))?;
        Ok(None)
    }

    /// Stores and persists a slot's entry word. The store is visible before the persist, so a
    /// persist error leaves the slot changed without its accounting: the index is poisoned.
    fn store_slot_entry(&self, bucket_off: u64, slot: usize, word: u64) -> Result<()> {
        let at = bucket_off + slot_entry_offset(slot) as u64;
        self.pool.region().word(at)?.store(word, Ordering::Release);
        self.pool
            .region()
            .persist(at, 8)
            .map_err(|e| self.poison(e.into()))
    }

    /// Marks the index unusable until the DPM restarts (a persist failed after a store).
    fn poison(&self, e: DpmError) -> DpmError {
        self.poisoned.store(true, Ordering::Release);
        tracing::error!(error = %e, "a persist of the index failed after its store; refusing index changes until the dpm-node restarts");
        e
    }

    fn check_poisoned(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(bad(
                &self.pool,
                "an earlier persist of the index failed; restart the dpm-node (it repairs the index at open)".into(),
            ));
        }
        Ok(())
    }

    /// An unlinked overflow bucket, from the free list or a new overflow chunk.
    fn alloc_overflow(&self, tier: Tier) -> Result<u64> {
        let mut ov = self.overflow.lock();
        if let Some(off) = ov.free.pop() {
            return Ok(off);
        }
        let (id, start) = self
            .segments
            .allocate_index_chunk(CHUNK_OVERFLOW, 0, tier)?;
        ov.chunks.push(id);
        let n = self.pool.superblock().segment_size / BUCKET_SIZE as u64;
        ov.free
            .extend((1..n).rev().map(|i| start + i * BUCKET_SIZE as u64));
        Ok(start)
    }

    /// Removes `key`; returns the entry it pointed at.
    pub fn remove(&self, key: &[u8], hash: u64) -> Result<Option<EntryPtr>> {
        self.check_poisoned()?;
        let t = self.table.read();
        let _g = self.stripe(&t, hash).lock();
        let home = self.bucket_off(&t, t.shape.home(hash).0);
        let Some((off, i, p)) = self.find(home, key, hash)? else {
            return Ok(None);
        };
        self.store_slot_entry(off, i, 0)?;
        self.items.fetch_sub(1, Ordering::Relaxed);
        Ok(Some(p))
    }

    /// Repoints `key` from `old` to `new` only if it still points at `old` (the cleaner moving a
    /// live entry while merges go on). Returns whether it did.
    pub fn replace_if(&self, hash: u64, old: EntryPtr, new: EntryPtr) -> Result<bool> {
        self.check_poisoned()?;
        let t = self.table.read();
        let _g = self.stripe(&t, hash).lock();
        let home = self.bucket_off(&t, t.shape.home(hash).0);
        let mut at = None;
        self.walk(home, |off, b| {
            at = b
                .slots
                .iter()
                .position(|&(h, e)| h == hash && e == old.to_word())
                .map(|i| (off, i));
            at.is_none()
        })?;
        match at {
            Some((off, i)) => {
                self.store_slot_entry(off, i, new.to_word())?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Calls `f(hash, entry)` for every indexed entry.
    pub fn for_each(&self, mut f: impl FnMut(u64, EntryPtr)) -> Result<()> {
        let t = self.table.read();
        for b in 0..t.shape.buckets() {
            self.walk(self.bucket_off(&t, b), |_, bucket| {
                for &(h, e) in &bucket.slots {
                    if let Some(p) = EntryPtr::from_word(e) {
                        f(h, p);
                    }
                }
                true
            })?;
        }
        Ok(())
    }

    /// Splits buckets while the load is above [`MAX_LOAD`]. Never fails the caller: a split
    /// that finds no free segment is retried after [`SPLIT_BACKOFF`] inserts.
    fn maybe_split(&self, items: u64) {
        let backing_off = self
            .split_backoff
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if backing_off {
            return;
        }
        if (items as f64) <= self.table.read().shape.buckets() as f64 * MAX_LOAD {
            return;
        }
        let mut t = self.table.write();
        while (self.items() as f64) > t.shape.buckets() as f64 * MAX_LOAD {
            match self.split_one(&mut t) {
                Ok(true) => {}
                Ok(false) => {
                    self.split_backoff.store(SPLIT_BACKOFF, Ordering::Relaxed);
                    metrics::counter!("dinomo_dpm_index_splits_deferred_total").increment(1);
                    tracing::debug!(
                        buckets = t.shape.buckets(),
                        items = self.items(),
                        "index split deferred: no free segment outside the reserves"
                    );
                    return;
                }
                Err(e) => {
                    self.split_backoff.store(SPLIT_BACKOFF, Ordering::Relaxed);
                    tracing::error!(error = %e, "index split failed; will retry later");
                    return;
                }
            }
        }
    }

    /// Splits the next bucket. Ok(false): no space for it (nothing changed).
    fn split_one(&self, t: &mut Table) -> Result<bool> {
        let shape = t.shape;
        let n = shape.buckets();
        let (chunk, _) = self.header.locate(n);
        if t.chunks[chunk as usize] == 0 {
            match self
                .segments
                .allocate_index_chunk(CHUNK_BUCKETS, chunk, Tier::IndexSplit)
            {
                Ok((_, off)) => {
                    let w = self.header.directory_word(chunk);
                    self.pool.region().word(w)?.store(off, Ordering::Release);
                    self.pool.region().persist(w, 8)?;
                    t.chunks[chunk as usize] = off;
                }
                Err(DpmError::PoolFull { .. }) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        let bit = 1u64 << shape.level;
        let s_off = self.bucket_off(t, shape.split);
        let mut moving = Vec::new();
        self.walk(s_off, |_, b| {
            moving.extend(
                b.slots
                    .iter()
                    .filter(|&&(h, e)| e != 0 && h & bit != 0)
                    .copied(),
            );
            true
        })?;
        // The new chain: home bucket plus overflow buckets, 3 entries each.
        let groups: Vec<&[(u64, u64)]> = moving.chunks(3).collect();
        let mut overflow = Vec::new();
        for _ in 1..groups.len() {
            match self.alloc_overflow(Tier::IndexSplit) {
                Ok(o) => overflow.push(o),
                Err(e) => {
                    self.overflow.lock().free.extend(overflow);
                    return match e {
                        DpmError::PoolFull { .. } => Ok(false),
                        e => Err(e),
                    };
                }
            }
        }
        let depth = depth_word(shape.level + 1);
        let region = self.pool.region();
        let n_off = self.bucket_off(t, n);
        let mut next = 0;
        for (i, group) in groups.iter().enumerate().rev() {
            let mut b = Bucket {
                next,
                ..Bucket::default()
            };
            b.slots[..group.len()].copy_from_slice(group);
            if i == 0 {
                // The home bucket: its state word, persisted last, says "complete".
                region.write_durable(n_off, &b.encode())?;
            } else {
                b.state = depth;
                region.write_durable(overflow[i - 1], &b.encode())?;
                next = overflow[i - 1];
            }
        }
        region
            .word(n_off + STATE_OFFSET as u64)?
            .store(depth, Ordering::Release);
        region.persist(n_off + STATE_OFFSET as u64, 8)?;
        // Past this point the split must complete: a half-committed split retried as a new one
        // would rebuild the new chain from what is left and lose keys. Only an I/O error can
        // stop it here; the index then refuses every change until the DPM is restarted, and
        // Index::open finishes the split.
        if let Err(e) = self.commit_split(t) {
            return Err(self.poison(e));
        }
        self.splits.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("dinomo_dpm_index_splits_total").increment(1);
        Ok(true)
    }

    /// Steps 2-4 of a split whose new chain is complete (also run by recovery, so every step
    /// is idempotent): the old chain's depths (home last), the moved slots zeroed, the shape.
    fn commit_split(&self, t: &mut Table) -> Result<()> {
        let shape = t.shape;
        let bit = 1u64 << shape.level;
        let depth = depth_word(shape.level + 1);
        let s_off = self.bucket_off(t, shape.split);
        let mut chain = Vec::new();
        self.walk(s_off, |off, b| {
            chain.push((off, *b));
            true
        })?;
        let region = self.pool.region();
        for (off, _) in chain.iter().rev() {
            region
                .word(off + STATE_OFFSET as u64)?
                .store(depth, Ordering::Release);
            region.persist(off + STATE_OFFSET as u64, 8)?;
        }
        for (off, b) in &chain {
            for (i, &(h, e)) in b.slots.iter().enumerate() {
                if e != 0 && h & bit != 0 {
                    self.store_slot_entry(*off, i, 0)?;
                }
            }
        }
        let grown = shape.grown();
        let at = self.header_off + SHAPE_OFFSET as u64;
        region.word(at)?.store(grown.word(), Ordering::Release);
        region.persist(at, 8)?;
        t.shape = grown;
        Ok(())
    }
}

/// Writes a new index: its first bucket chunk, the home buckets' depths, the shape and the
/// header, and publishes it through the root word last.
fn create(
    pool: &Pool,
    segments: &Segments,
    area: &IndexArea,
    chunk_buckets: u64,
    min_level: u32,
) -> Result<()> {
    let region = pool.region();
    let (_, chunk0) = segments.allocate_index_chunk(CHUNK_BUCKETS, 0, Tier::Cleaner)?;
    let depth = depth_word(min_level);
    for b in 0..1u64 << min_level {
        region
            .word(chunk0 + b * BUCKET_SIZE as u64 + STATE_OFFSET as u64)?
            .store(depth, Ordering::Relaxed);
    }
    region.persist(chunk0, (1u64 << min_level) * BUCKET_SIZE as u64)?;
    let header = IndexHeader {
        chunk_buckets,
        directory_off: area.directory_off,
        max_chunks: area.max_chunks,
        min_level,
    };
    region.write_durable(header.directory_word(0), &chunk0.to_le_bytes())?;
    let shape = Shape {
        level: min_level,
        split: 0,
    };
    region.write_durable(
        area.header_off + SHAPE_OFFSET as u64,
        &shape.word().to_le_bytes(),
    )?;
    region.write_durable(area.header_off, &header.encode())?;
    pool.root(Roots::INDEX_TABLE)
        .store(area.header_off, Ordering::Release);
    pool.persist_root(Roots::INDEX_TABLE);
    Ok(())
}

fn bad(pool: &Pool, detail: String) -> DpmError {
    DpmError::BadPool {
        path: pool.path(),
        detail,
    }
}
