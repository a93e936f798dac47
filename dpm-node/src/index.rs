//! The DPM's side of the persistent hash index: lookups, in-place updates by merge workers,
//! and resize. Formats and the reader-side argument are in dinomo_layout::index.
//!
//! Concurrency: readers (here and KNs over the fabric) take no locks. Writers hold the table
//! lock shared plus the stripe lock of the key's home bucket (a chain belongs to one home
//! bucket, so the stripe covers the whole chain); resize holds the table lock exclusively.
//!
//! Persistence order: a slot's hash word, then its entry word, then the cache line is
//! persisted; an overflow bucket is persisted before the `next` word that links it. Slot words
//! are single aligned 8-byte stores.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dinomo_layout::index::{
    slot_entry_offset, slot_hash_offset, Bucket, EntryPtr, TableHeader, BUCKET_SIZE, RETIRED,
    SLOTS, STATE_OFFSET, TABLE_HEADER_SIZE,
};
use dinomo_layout::log::ENTRY_HEADER;
use dinomo_layout::meta::Roots;
use parking_lot::{Mutex, RwLock};

use crate::error::{DpmError, Result};
use crate::pool::Pool;

const STRIPES: usize = 1024;
/// Resize when the average bucket holds more than this many items (of 3 slots).
const MAX_LOAD: f64 = 2.25;

#[derive(Debug, Clone, Copy)]
struct Table {
    header_off: u64,
    header: TableHeader,
}

/// The index of one pool.
#[derive(Debug)]
pub struct Index {
    pool: Arc<Pool>,
    table: RwLock<Table>,
    stripes: Vec<Mutex<()>>,
    items: AtomicU64,
    resizes: AtomicU64,
}

impl Index {
    /// Opens the index of `pool`, creating its first table (`initial_buckets`, rounded up to a
    /// power of two) if the pool is new, and finishing a resize a crash interrupted.
    pub fn open(pool: Arc<Pool>, initial_buckets: u64) -> Result<Self> {
        let root = pool.root(Roots::INDEX_TABLE).load(Ordering::Acquire);
        let table = if root == 0 {
            let t = create_table(&pool, initial_buckets.next_power_of_two().max(64), 0)?;
            pool.root(Roots::INDEX_TABLE)
                .store(t.header_off, Ordering::Release);
            pool.persist_root(Roots::INDEX_TABLE);
            t
        } else {
            read_table(&pool, root)?
        };
        let prev = pool.root(Roots::INDEX_PREV_TABLE).load(Ordering::Acquire);
        if prev != 0 {
            tracing::warn!(
                prev,
                "finishing the retirement of an index table interrupted by a crash"
            );
            retire_table(&pool, &read_table(&pool, prev)?)?;
            pool.root(Roots::INDEX_PREV_TABLE)
                .store(0, Ordering::Release);
            pool.persist_root(Roots::INDEX_PREV_TABLE);
        }
        let index = Index {
            pool,
            table: RwLock::new(table),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            items: AtomicU64::new(0),
            resizes: AtomicU64::new(0),
        };
        let mut n = 0;
        index.for_each(|_, _| n += 1)?;
        index.items.store(n, Ordering::Relaxed);
        Ok(index)
    }

    pub fn items(&self) -> u64 {
        self.items.load(Ordering::Relaxed)
    }

    pub fn bucket_count(&self) -> u64 {
        self.table.read().header.bucket_count
    }

    pub fn resizes(&self) -> u64 {
        self.resizes.load(Ordering::Relaxed)
    }

    /// Pool offset of the current table header (what KNs read from the root word).
    pub fn table_header_offset(&self) -> u64 {
        self.table.read().header_off
    }

    fn bucket(&self, off: u64) -> Result<Bucket> {
        Ok(Bucket::decode(self.pool.view(off, BUCKET_SIZE as u64)?).expect("64 bytes"))
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

    /// The entry of `key`, if indexed.
    pub fn lookup(&self, key: &[u8], hash: u64) -> Result<Option<EntryPtr>> {
        let t = self.table.read();
        let mut off = t.header.home_bucket(hash);
        loop {
            let b = self.bucket(off)?;
            for (_, p) in b.candidates(hash) {
                if self.entry_has_key(p, key)? {
                    return Ok(Some(p));
                }
            }
            if b.next == 0 {
                return Ok(None);
            }
            off = b.next;
        }
    }

    fn stripe(&self, t: &Table, hash: u64) -> &Mutex<()> {
        &self.stripes[(hash & (t.header.bucket_count - 1)) as usize % STRIPES]
    }

    /// Points `key` at `ptr`; returns the entry it replaced.
    pub fn upsert(&self, key: &[u8], hash: u64, ptr: EntryPtr) -> Result<Option<EntryPtr>> {
        let replaced = {
            let t = self.table.read();
            let _g = self.stripe(&t, hash).lock();
            self.upsert_locked(&t, key, hash, ptr)?
        };
        if replaced.is_none() {
            let n = self.items.fetch_add(1, Ordering::Relaxed) + 1;
            self.maybe_resize(n)?;
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
        let mut off = t.header.home_bucket(hash);
        let mut free: Option<(u64, usize)> = None;
        let last = loop {
            let b = self.bucket(off)?;
            for (i, &(h, e)) in b.slots.iter().enumerate() {
                match EntryPtr::from_word(e) {
                    None => {
                        free.get_or_insert((off, i));
                    }
                    Some(p) if h == hash && self.entry_has_key(p, key)? => {
                        self.store_slot_entry(off, i, ptr.to_word())?;
                        return Ok(Some(p));
                    }
                    Some(_) => {}
                }
            }
            if b.next == 0 {
                break off;
            }
            off = b.next;
        };
        let region = self.pool.region();
        if let Some((boff, i)) = free {
            region
                .word(boff + slot_hash_offset(i) as u64)?
                .store(hash, Ordering::Release);
            region
                .word(boff + slot_entry_offset(i) as u64)?
                .store(ptr.to_word(), Ordering::Release);
            region.persist(boff, BUCKET_SIZE as u64)?;
            return Ok(None);
        }
        // Chain full: a new overflow bucket, persisted before it is linked.
        let nb = heap_alloc(&self.pool, BUCKET_SIZE as u64)?;
        let mut bucket = Bucket::default();
        bucket.slots[0] = (hash, ptr.to_word());
        region.write_durable(nb, &bucket.encode())?;
        region.word(last)?.store(nb, Ordering::Release);
        region.persist(last, 8)?;
        Ok(None)
    }

    fn store_slot_entry(&self, bucket_off: u64, slot: usize, word: u64) -> Result<()> {
        let at = bucket_off + slot_entry_offset(slot) as u64;
        self.pool.region().word(at)?.store(word, Ordering::Release);
        self.pool.region().persist(at, 8)?;
        Ok(())
    }

    /// Removes `key`; returns the entry it pointed at.
    pub fn remove(&self, key: &[u8], hash: u64) -> Result<Option<EntryPtr>> {
        let t = self.table.read();
        let _g = self.stripe(&t, hash).lock();
        let mut off = t.header.home_bucket(hash);
        loop {
            let b = self.bucket(off)?;
            for (i, p) in b.candidates(hash) {
                if self.entry_has_key(p, key)? {
                    self.store_slot_entry(off, i, 0)?;
                    self.items.fetch_sub(1, Ordering::Relaxed);
                    return Ok(Some(p));
                }
            }
            if b.next == 0 {
                return Ok(None);
            }
            off = b.next;
        }
    }

    /// Repoints `key` from `old` to `new` only if it still points at `old` (the cleaner moving a
    /// live entry while merges go on). Returns whether it did.
    pub fn replace_if(&self, hash: u64, old: EntryPtr, new: EntryPtr) -> Result<bool> {
        let t = self.table.read();
        let _g = self.stripe(&t, hash).lock();
        let mut off = t.header.home_bucket(hash);
        loop {
            let b = self.bucket(off)?;
            for (i, &(h, e)) in b.slots.iter().enumerate() {
                if h == hash && e == old.to_word() {
                    self.store_slot_entry(off, i, new.to_word())?;
                    return Ok(true);
                }
            }
            if b.next == 0 {
                return Ok(false);
            }
            off = b.next;
        }
    }

    /// Calls `f(hash, entry)` for every indexed entry.
    pub fn for_each(&self, mut f: impl FnMut(u64, EntryPtr)) -> Result<()> {
        let t = self.table.read();
        for i in 0..t.header.bucket_count {
            let mut off = t.header.buckets_off + i * BUCKET_SIZE as u64;
            loop {
                let b = self.bucket(off)?;
                for &(h, e) in &b.slots {
                    if let Some(p) = EntryPtr::from_word(e) {
                        f(h, p);
                    }
                }
                if b.next == 0 {
                    break;
                }
                off = b.next;
            }
        }
        Ok(())
    }

    fn maybe_resize(&self, items: u64) -> Result<()> {
        let count = self.table.read().header.bucket_count;
        if (items as f64) <= count as f64 * MAX_LOAD {
            return Ok(());
        }
        let mut t = self.table.write();
        if t.header.bucket_count != count {
            return Ok(()); // another writer resized meanwhile
        }
        let old = *t;
        let new = create_table(&self.pool, count * 2, old.header.generation + 1)?;
        // Rehash every entry; keys are unique, so no key comparison is needed.
        let region = self.pool.region();
        let mut entries = Vec::with_capacity(items as usize);
        {
            let mut collect = |h: u64, p: EntryPtr| entries.push((h, p));
            for i in 0..old.header.bucket_count {
                let mut off = old.header.buckets_off + i * BUCKET_SIZE as u64;
                loop {
                    let b = self.bucket(off)?;
                    for &(h, e) in &b.slots {
                        if let Some(p) = EntryPtr::from_word(e) {
                            collect(h, p);
                        }
                    }
                    if b.next == 0 {
                        break;
                    }
                    off = b.next;
                }
            }
        }
        for (h, p) in entries {
            let mut off = new.header.home_bucket(h);
            'place: loop {
                let b = self.bucket(off)?;
                for (i, &(_, e)) in b.slots.iter().enumerate() {
                    if e == 0 {
                        region
                            .word(off + slot_hash_offset(i) as u64)?
                            .store(h, Ordering::Relaxed);
                        region
                            .word(off + slot_entry_offset(i) as u64)?
                            .store(p.to_word(), Ordering::Relaxed);
                        break 'place;
                    }
                }
                if b.next == 0 {
                    let nb = heap_alloc(&self.pool, BUCKET_SIZE as u64)?;
                    let mut bucket = Bucket::default();
                    bucket.slots[0] = (h, p.to_word());
                    region.write(nb, &bucket.encode())?;
                    region.persist(nb, BUCKET_SIZE as u64)?;
                    region.word(off)?.store(nb, Ordering::Release);
                    break;
                }
                off = b.next;
            }
        }
        // Persist the whole new table (overflow buckets were persisted one by one).
        region.persist(
            new.header.buckets_off,
            new.header.bucket_count * BUCKET_SIZE as u64,
        )?;
        self.pool
            .root(Roots::INDEX_PREV_TABLE)
            .store(old.header_off, Ordering::Release);
        self.pool.persist_root(Roots::INDEX_PREV_TABLE);
        self.pool
            .root(Roots::INDEX_TABLE)
            .store(new.header_off, Ordering::Release);
        self.pool.persist_root(Roots::INDEX_TABLE);
        retire_table(&self.pool, &old)?;
        self.pool
            .root(Roots::INDEX_PREV_TABLE)
            .store(0, Ordering::Release);
        self.pool.persist_root(Roots::INDEX_PREV_TABLE);
        *t = new;
        self.resizes.fetch_add(1, Ordering::Relaxed);
        tracing::info!(buckets = new.header.bucket_count, items, "index resized");
        Ok(())
    }
}

/// Allocates `len` bytes (64-byte aligned) from the index heap. Space is never returned: a crash
/// between allocation and use leaks it, and retired tables stay allocated (geometric growth
/// bounds the waste by the size of the live table).
pub fn heap_alloc(pool: &Pool, len: u64) -> Result<u64> {
    let sb = pool.superblock();
    let len = len.div_ceil(64) * 64;
    let next = pool.root(Roots::HEAP_NEXT);
    let at = next.fetch_add(len, Ordering::AcqRel);
    let end = sb.index_heap_off + sb.index_heap_len;
    if at < sb.index_heap_off || at + len > end {
        next.fetch_sub(len, Ordering::AcqRel);
        return Err(DpmError::IndexHeapFull {
            used: at - sb.index_heap_off,
            len: sb.index_heap_len,
        });
    }
    pool.persist_root(Roots::HEAP_NEXT);
    Ok(at)
}

fn create_table(pool: &Pool, bucket_count: u64, generation: u64) -> Result<Table> {
    let header_off = heap_alloc(
        pool,
        TABLE_HEADER_SIZE as u64 + bucket_count * BUCKET_SIZE as u64,
    )?;
    let header = TableHeader {
        bucket_count,
        buckets_off: header_off + TABLE_HEADER_SIZE as u64,
        generation,
    };
    // Heap space may have held an older table or bucket only if it was leaked by a crash before
    // use; zero it so every bucket starts empty.
    let region = pool.region();
    let zero = vec![0u8; 1 << 20];
    let mut at = header.buckets_off;
    let end = header.buckets_off + bucket_count * BUCKET_SIZE as u64;
    while at < end {
        let n = (end - at).min(zero.len() as u64);
        region.write(at, &zero[..n as usize])?;
        at += n;
    }
    region.persist(header.buckets_off, end - header.buckets_off)?;
    region.write_durable(header_off, &header.encode())?;
    Ok(Table { header_off, header })
}

fn read_table(pool: &Pool, off: u64) -> Result<Table> {
    let header =
        TableHeader::decode(pool.view(off, TABLE_HEADER_SIZE as u64)?).map_err(|source| {
            DpmError::Layout {
                path: pool.path(),
                source,
            }
        })?;
    let sb = pool.superblock();
    let end = header.buckets_off + header.bucket_count * BUCKET_SIZE as u64;
    if header.buckets_off < sb.index_heap_off || end > sb.index_heap_off + sb.index_heap_len {
        return Err(DpmError::BadPool {
            path: pool.path(),
            detail: format!("index table at {off} lies outside the index heap"),
        });
    }
    Ok(Table {
        header_off: off,
        header,
    })
}

fn retire_table(pool: &Pool, t: &Table) -> Result<()> {
    let region = pool.region();
    for i in 0..t.header.bucket_count {
        let mut off = t.header.buckets_off + i * BUCKET_SIZE as u64;
        loop {
            region
                .word(off + STATE_OFFSET as u64)?
                .store(RETIRED, Ordering::Release);
            region.persist(off + STATE_OFFSET as u64, 8)?;
            let next = region.word(off)?.load(Ordering::Acquire);
            if next == 0 {
                break;
            }
            off = next;
        }
    }
    let _ = SLOTS;
    Ok(())
}
