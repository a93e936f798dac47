//! Log segments: the persistent allocator, per-KN log chains, and per-segment live-byte
//! counters.
//!
//! The segment table in PM is the record (dinomo_layout::segment). DRAM holds what can be
//! rebuilt from it and from the index at open: the free list, each KN's chain of unmerged
//! segments in chain order, and live bytes per segment (bytes of entries the index points at).
//!
//! Allocation persists the segment header, then the table words, then the state word last, so
//! a crash leaves the segment either free or fully handed out.
//!
//! Reserves: free segments are handed out by [`Tier`]. KN logs get a segment only while more
//! than every reserve is free; a KN batch of deletes may dip into the delete reserve (deletes
//! are how a full pool gets space back); index growth (splits) may dip into nothing but its own
//! reserve, index overflow buckets (without which a merge cannot finish) only leave the
//! cleaner's reserve, and the cleaner may take the last segment (cleaning frees more than it
//! takes). So a full pool always lets merges, deletes and compaction make progress.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dinomo_layout::index::EntryPtr;
use dinomo_layout::log::ENTRY_HEADER;
use dinomo_layout::meta::Roots;
use dinomo_layout::segment::{SegState, SegmentHeader, TableEntry, HEADER_SIZE, INDEX_OWNER};
use parking_lot::Mutex;

use crate::error::{DpmError, Result};
use crate::pool::Pool;

/// The owner id of segments the cleaner writes (not a KN).
pub const CLEANER_KN: u32 = u32::MAX;
/// The cleaner's log.
pub const CLEANER_LOG: LogId = LogId {
    kn: CLEANER_KN,
    stream: 0,
};

/// What a KN is told about a segment it may append to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentGrant {
    pub segment_id: u64,
    /// Pool offset of the segment.
    pub offset: u64,
    pub len: u64,
    pub chain_seq: u64,
    /// Offset inside the segment of the first batch.
    pub first_batch: u64,
    /// Chain value the first batch chains from.
    pub chain_seed: u32,
}

/// Merge progress of a segment, packed in its table entry's last word: the offset of the next
/// batch to merge (low 32 bits) and the chain value there (high 32 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    pub offset: u32,
    pub chain: u32,
}

impl Progress {
    pub fn word(self) -> u64 {
        u64::from(self.offset) | (u64::from(self.chain) << 32)
    }
    pub fn from_word(w: u64) -> Self {
        Progress {
            offset: w as u32,
            chain: (w >> 32) as u32,
        }
    }
}

/// A log: one KN writes one log per shard (its stream). Merge order is chain order within a
/// log; logs are independent (their keys are disjoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogId {
    pub kn: u32,
    pub stream: u16,
}

/// One log's unmerged segments (Open or Sealed), by chain position.
#[derive(Debug, Default)]
pub struct Chain {
    pub pending: BTreeMap<u64, u64>,
    pub next_seq: u64,
}

/// A chain's bookkeeping and its merge lock, kept apart so that allocating, sealing and
/// reading stats (short critical sections on `state`) never wait for a merge in progress
/// (which holds `merging` for as long as it takes).
#[derive(Debug, Default)]
pub struct ChainHandle {
    pub state: Mutex<Chain>,
    pub merging: Mutex<()>,
}

/// Who asks for a free segment; decides how deep into the reserves it may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// A KN log segment for ordinary writes.
    Log,
    /// A KN log segment for a batch of deletes only.
    Deletes,
    /// A chunk of home buckets for an index split (splits are optional: the index works,
    /// with longer chains, without them).
    IndexSplit,
    /// Overflow buckets a merge needs to index a new key.
    IndexOverflow,
    /// The cleaner's target segment.
    Cleaner,
}

/// Free segments kept back from each tier (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserves {
    pub cleaner: u64,
    pub index: u64,
    pub deletes: u64,
}

impl Reserves {
    /// Reserves for a pool of `count` segments: together at most a quarter of the pool; the
    /// cleaner first, then deletes, then the index.
    pub fn for_pool(count: u64) -> Self {
        let mut left = count / 4;
        let mut take = |want: u64| {
            let n = want.min(left);
            left -= n;
            n
        };
        let cleaner = take(1);
        let deletes = take(1);
        let index = take(1);
        Reserves {
            cleaner: cleaner + take(1),
            deletes,
            index: index + take(1),
        }
    }

    /// Free segments that must remain after an allocation by `tier`, when the index may
    /// need `index_need` segments for logs not merged yet.
    pub fn kept_from(&self, tier: Tier, index_need: u64) -> u64 {
        match tier {
            Tier::Cleaner => 0,
            Tier::IndexOverflow => self.cleaner,
            Tier::IndexSplit => self.cleaner + self.index,
            // Deletes need no index space, and they are what gives space back: refusing them
            // for index room that earlier puts may need would leave a full pool stuck.
            Tier::Deletes => self.cleaner,
            Tier::Log => self.cleaner + self.deletes + self.index.max(index_need),
        }
    }

    pub fn total(&self) -> u64 {
        self.cleaner + self.deletes + self.index
    }
}

#[derive(Debug)]
pub struct Segments {
    pool: Arc<Pool>,
    reserves: Reserves,
    /// Segments the index may still need to index what KNs have logged but not merged yet
    /// (set by the DPM before each KN allocation); kept free from KN log allocations.
    index_need: AtomicU64,
    /// KN log segments granted for deletes only (this run): they need no index space.
    deletes_only: Mutex<std::collections::HashSet<u64>>,
    /// `verify_accounting`: changes to live bytes are serialised by this lock and checked.
    verify: Option<Mutex<()>>,
    mismatches: AtomicU64,
    free: Mutex<VecDeque<u64>>,
    live_bytes: Vec<AtomicU64>,
    chains: Mutex<HashMap<LogId, Arc<ChainHandle>>>,
}

impl Segments {
    /// Rebuilds the DRAM state from the segment table.
    pub fn open(pool: Arc<Pool>) -> Result<Self> {
        let count = pool.superblock().segment_count;
        let mut free = VecDeque::new();
        let mut chains: HashMap<LogId, Chain> = HashMap::new();
        for id in 0..count {
            let e = pool.read_table_entry(id)?;
            match e.state {
                SegState::Free => free.push_back(id),
                // Index chunks: Index::open validates them and frees the ones it does not use.
                SegState::Index => {}
                SegState::Open | SegState::Sealed => {
                    let c = chains
                        .entry(LogId {
                            kn: e.kn_id,
                            stream: e.stream,
                        })
                        .or_default();
                    c.pending.insert(e.chain_seq, id);
                    c.next_seq = c.next_seq.max(e.chain_seq + 1);
                }
                SegState::Merged => {
                    let c = chains
                        .entry(LogId {
                            kn: e.kn_id,
                            stream: e.stream,
                        })
                        .or_default();
                    c.next_seq = c.next_seq.max(e.chain_seq + 1);
                }
            }
        }
        Ok(Segments {
            reserves: Reserves::for_pool(count),
            index_need: AtomicU64::new(0),
            deletes_only: Mutex::default(),
            verify: None,
            mismatches: AtomicU64::new(0),
            pool,
            free: Mutex::new(free),
            live_bytes: (0..count).map(|_| AtomicU64::new(0)).collect(),
            chains: Mutex::new(
                chains
                    .into_iter()
                    .map(|(k, c)| {
                        (
                            k,
                            Arc::new(ChainHandle {
                                state: Mutex::new(c),
                                merging: Mutex::new(()),
                            }),
                        )
                    })
                    .collect(),
            ),
        })
    }

    pub fn count(&self) -> u64 {
        self.live_bytes.len() as u64
    }

    pub fn free_count(&self) -> usize {
        self.free.lock().len()
    }

    pub fn reserves(&self) -> Reserves {
        self.reserves
    }

    /// Sets how many segments the index may need for the logs not merged yet.
    pub fn set_index_need(&self, segments: u64) {
        self.index_need.store(segments, Ordering::Relaxed);
    }

    /// KN log segments sealed and waiting for (or under) merge, over all KNs.
    pub fn sealed_log_segments(&self) -> u64 {
        self.count_unmerged_log_segments(|id| {
            self.pool
                .read_table_entry(id)
                .is_ok_and(|e| e.state == SegState::Sealed)
        })
    }

    /// KN log segments not yet fully merged (open or sealed) that may hold puts, over all KNs
    /// (segments granted for deletes only are left out: they need no index space).
    pub fn unmerged_log_segments(&self) -> u64 {
        let deletes_only = self.deletes_only.lock().clone();
        self.count_unmerged_log_segments(|id| !deletes_only.contains(&id))
    }

    /// KN log segments not yet fully merged for which `counts(id)` holds.
    fn count_unmerged_log_segments(&self, counts: impl Fn(u64) -> bool) -> u64 {
        self.chains()
            .iter()
            .filter(|(log, _)| log.kn != CLEANER_KN)
            .map(|(_, c)| {
                c.state
                    .lock()
                    .pending
                    .values()
                    .filter(|&&id| counts(id))
                    .count() as u64
            })
            .sum()
    }

    /// Takes a free segment for `tier`, or says why the pool is full for it.
    fn take_free(&self, tier: Tier) -> Result<u64> {
        let mut free = self.free.lock();
        let kept = self
            .reserves
            .kept_from(tier, self.index_need.load(Ordering::Relaxed));
        if free.len() as u64 <= kept {
            return Err(DpmError::PoolFull {
                free: free.len() as u64,
                total: self.count(),
                kept,
                tier,
            });
        }
        Ok(free.pop_front().expect("checked non-empty"))
    }

    /// Index segments (chunks) recorded in the table: (segment id, entry).
    pub fn index_segments(&self) -> Result<Vec<(u64, TableEntry)>> {
        let mut v = Vec::new();
        for id in 0..self.count() {
            let e = self.pool.read_table_entry(id)?;
            if e.state == SegState::Index {
                v.push((id, e));
            }
        }
        Ok(v)
    }

    /// Hands a free segment to the index as chunk `chunk` of `kind` (CHUNK_BUCKETS or
    /// CHUNK_OVERFLOW): zeroed and persisted first, then recorded in the table, so a crash
    /// leaves it either free or a zeroed index segment (which Index::open frees if no directory
    /// word or chain uses it). Returns (segment id, pool offset).
    pub fn allocate_index_chunk(&self, kind: u16, chunk: u64, tier: Tier) -> Result<(u64, u64)> {
        let id = self.take_free(tier)?;
        let sb = self.pool.superblock();
        let offset = sb.segment_offset(id);
        let zero = vec![0u8; 1 << 20];
        let mut at = offset;
        let end = offset + sb.segment_size;
        let region = self.pool.region();
        let done = (|| -> Result<()> {
            while at < end {
                let n = (end - at).min(zero.len() as u64);
                region.write(at, &zero[..n as usize])?;
                at += n;
            }
            region.persist(offset, sb.segment_size)?;
            self.pool.store_table_word(id, 1, 0)?;
            self.pool.store_table_word(id, 2, chunk)?;
            self.pool.store_table_word(id, 3, 0)?;
            self.pool.store_table_word(
                id,
                0,
                TableEntry::state_word(SegState::Index, INDEX_OWNER, kind),
            )
        })();
        if let Err(e) = done {
            self.free.lock().push_front(id);
            return Err(e);
        }
        metrics::counter!("dinomo_dpm_index_chunks_allocated_total").increment(1);
        Ok((id, offset))
    }

    /// Returns an index segment that nothing references to the free list.
    pub fn free_index_chunk(&self, id: u64) -> Result<()> {
        self.free(id)
    }
    pub fn chain(&self, log: LogId) -> Arc<ChainHandle> {
        self.chains.lock().entry(log).or_default().clone()
    }

    /// Every chain, ordered by log id.
    pub fn chains(&self) -> Vec<(LogId, Arc<ChainHandle>)> {
        let mut v: Vec<_> = self
            .chains
            .lock()
            .iter()
            .map(|(k, c)| (*k, c.clone()))
            .collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// The chains of one KN (one per stream), ordered by stream.
    pub fn chains_of(&self, kn: u32) -> Vec<(LogId, Arc<ChainHandle>)> {
        self.chains()
            .into_iter()
            .filter(|(k, _)| k.kn == kn)
            .collect()
    }

    /// Hands a free segment to a log (a KN's stream, or the cleaner) as the next segment of its
    /// chain.
    pub fn allocate(&self, log: LogId, epoch: u64, tier: Tier) -> Result<SegmentGrant> {
        let kn = log.kn;
        let chain = self.chain(log);
        let mut chain = chain.state.lock();
        let id = self.take_free(tier)?;
        let generation = self
            .pool
            .root(Roots::SEGMENT_GENERATION)
            .fetch_add(1, Ordering::AcqRel)
            + 1;
        self.pool.persist_root(Roots::SEGMENT_GENERATION);
        let chain_seq = chain.next_seq;
        let header = SegmentHeader {
            kn_id: kn,
            epoch,
            segment_id: id,
            generation,
            chain_seq,
            stream: log.stream,
        };
        let sb = self.pool.superblock();
        let offset = sb.segment_offset(id);
        self.pool.region().write_durable(offset, &header.encode())?;
        let seed = header.chain_seed();
        let start = Progress {
            offset: HEADER_SIZE as u32,
            chain: seed,
        };
        self.pool.store_table_word(id, 1, generation)?;
        self.pool.store_table_word(id, 2, chain_seq)?;
        self.pool.store_table_word(id, 3, start.word())?;
        self.pool.store_table_word(
            id,
            0,
            TableEntry::state_word(SegState::Open, kn, log.stream),
        )?;
        self.live_bytes[id as usize].store(0, Ordering::Relaxed);
        chain.pending.insert(chain_seq, id);
        chain.next_seq += 1;
        let mut deletes_only = self.deletes_only.lock();
        if tier == Tier::Deletes {
            deletes_only.insert(id);
        } else {
            deletes_only.remove(&id);
        }
        metrics::counter!("dinomo_dpm_segments_allocated_total").increment(1);
        Ok(SegmentGrant {
            segment_id: id,
            offset,
            len: sb.segment_size,
            chain_seq,
            first_batch: HEADER_SIZE as u64,
            chain_seed: seed,
        })
    }

    /// Checks that `id` is a segment of `kn` in one of `states`.
    pub fn entry_of(&self, kn: u32, id: u64) -> Result<TableEntry> {
        if id >= self.count() {
            return Err(DpmError::BadSegment {
                segment: id,
                detail: format!("no such segment (pool has {})", self.count()),
            });
        }
        let e = self.pool.read_table_entry(id)?;
        if e.kn_id != kn || e.state == SegState::Free {
            return Err(DpmError::BadSegment {
                segment: id,
                detail: format!(
                    "not a segment of KN {kn} (state {:?}, owner {})",
                    e.state, e.kn_id
                ),
            });
        }
        Ok(e)
    }

    /// Marks an open segment sealed (idempotent).
    pub fn seal(&self, kn: u32, id: u64) -> Result<()> {
        let e = self.entry_of(kn, id)?;
        if e.state == SegState::Open {
            self.set_state(id, SegState::Sealed)?;
        }
        Ok(())
    }

    /// Changes a segment's state, keeping its owner and stream.
    pub fn set_state(&self, id: u64, state: SegState) -> Result<()> {
        let e = self.pool.read_table_entry(id)?;
        self.pool
            .store_table_word(id, 0, TableEntry::state_word(state, e.kn_id, e.stream))
    }

    pub fn set_progress(&self, id: u64, p: Progress) -> Result<()> {
        self.pool.store_table_word(id, 3, p.word())
    }

    /// Returns a merged segment with no live entry to the free list.
    pub fn free(&self, id: u64) -> Result<()> {
        // Under the free-list lock, so one segment can never enter the list twice.
        let mut free = self.free.lock();
        if self.pool.read_table_entry(id)?.state == SegState::Free {
            tracing::error!(
                segment = id,
                "refusing to free a segment that is already free"
            );
            return Ok(());
        }
        self.pool
            .store_table_word(id, 0, TableEntry::state_word(SegState::Free, 0, 0))?;
        free.push_back(id);
        metrics::counter!("dinomo_dpm_segments_freed_total").increment(1);
        Ok(())
    }

    /// Padded length of the entry at `ptr` (from the pointer, or its header for huge entries).
    pub fn entry_len(&self, ptr: EntryPtr) -> Result<u64> {
        if ptr.len != 0 {
            return Ok(u64::from(ptr.len));
        }
        let head = self.pool.view(ptr.offset, ENTRY_HEADER as u64)?;
        Ok(dinomo_layout::log::entry_len_from_header(head).expect("header length") as u64)
    }

    /// Segment and padded length of an indexed entry. Only pointers the DPM itself indexed
    /// come here (merged entries were checked by the scan), so failure means a corrupt pool.
    fn live_extent(&self, ptr: EntryPtr) -> Result<(u64, u64)> {
        let seg = self
            .pool
            .superblock()
            .segment_of(ptr.offset)
            .ok_or_else(|| DpmError::BadSegment {
                segment: u64::MAX,
                detail: format!("entry at {} is outside the segments", ptr.offset),
            })?;
        Ok((seg, self.entry_len(ptr)?))
    }

    /// Adds (`delta` >= 0) or removes the bytes of the entry at `ptr` to its segment's live
    /// bytes. Infallible for the caller, so an index change and its accounting cannot be
    /// separated by an error; a pointer that cannot be measured (corrupt pool) is logged and
    /// counted, and the recount check reports it.
    pub fn add_live(&self, ptr: EntryPtr, delta: i64) {
        let (seg, len) = match self.live_extent(ptr) {
            Ok(x) => x,
            Err(e) => {
                metrics::counter!("dinomo_dpm_accounting_errors_total").increment(1);
                tracing::error!(error = %e, "cannot account for an indexed entry");
                return;
            }
        };
        if delta >= 0 {
            self.live_bytes[seg as usize].fetch_add(len, Ordering::Relaxed);
        } else {
            self.live_bytes[seg as usize].fetch_sub(len, Ordering::Relaxed);
        }
    }

    /// Live bytes per segment as the index says now (for [`crate::Dpm::check_accounting`]).
    pub fn recount(&self, index: &crate::index::Index) -> Result<Vec<u64>> {
        let mut v = vec![0u64; self.live_bytes.len()];
        let mut err = None;
        index.for_each(|_, p| match self.live_extent(p) {
            Ok((seg, len)) => v[seg as usize] += len,
            Err(e) => err = Some(e),
        })?;
        err.map_or(Ok(v), Err)
    }

    /// Turns on the `verify_accounting` debug check (before the DPM starts its threads).
    pub fn enable_verification(&mut self) {
        self.verify = Some(Mutex::new(()));
    }

    /// With verification on: a guard that keeps every other counted change out while the
    /// caller changes the index and the counters, then checks them (see [`Self::verify`]).
    pub fn accounting_guard(&self) -> Option<parking_lot::MutexGuard<'_, ()>> {
        self.verify.as_ref().map(|m| m.lock())
    }

    /// With verification on (and the guard held): compares every counter with a recount.
    pub fn verify(&self, index: &crate::index::Index, after: &str) -> Result<()> {
        if self.verify.is_none() {
            return Ok(());
        }
        if let Some(diff) = self.diff(index)? {
            self.mismatches.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("dinomo_dpm_accounting_mismatches_total").increment(1);
            tracing::error!(after, %diff, "live-byte counters differ from a recount");
            return Err(DpmError::Accounting(format!("after {after}: {diff}")));
        }
        Ok(())
    }

    /// Mismatches the verification found so far.
    pub fn accounting_mismatches(&self) -> u64 {
        self.mismatches.load(Ordering::Relaxed)
    }

    /// The first segments whose counter differs from a recount, if any.
    pub fn diff(&self, index: &crate::index::Index) -> Result<Option<String>> {
        let recount = self.recount(index)?;
        let diffs: Vec<String> = recount
            .iter()
            .enumerate()
            .filter(|(id, &n)| n != self.live_bytes(*id as u64))
            .take(5)
            .map(|(id, n)| {
                format!(
                    "segment {id}: counter {} but the index points at {n} bytes",
                    self.live_bytes(id as u64)
                )
            })
            .collect();
        Ok((!diffs.is_empty()).then(|| diffs.join("; ")))
    }

    /// Sum of all segments' live bytes.
    pub fn total_live_bytes(&self) -> u64 {
        self.live_bytes
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .sum()
    }

    pub fn live_bytes(&self, id: u64) -> u64 {
        self.live_bytes[id as usize].load(Ordering::Relaxed)
    }
}
