//! Log segments: the persistent allocator, per-KN log chains, and per-segment live-byte
//! counters.
//!
//! The segment table in PM is the record (dinomo_layout::segment). DRAM holds what can be
//! rebuilt from it and from the index at open: the free list, each KN's chain of unmerged
//! segments in chain order, and live bytes per segment (bytes of entries the index points at).
//!
//! Allocation persists the segment header, then the table words, then the state word last, so
//! a crash leaves the segment either free or fully handed out.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dinomo_layout::index::EntryPtr;
use dinomo_layout::log::ENTRY_HEADER;
use dinomo_layout::meta::Roots;
use dinomo_layout::segment::{SegState, SegmentHeader, TableEntry, HEADER_SIZE};
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

#[derive(Debug)]
pub struct Segments {
    pool: Arc<Pool>,
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
    pub fn allocate(&self, log: LogId, epoch: u64) -> Result<SegmentGrant> {
        let kn = log.kn;
        let chain = self.chain(log);
        let mut chain = chain.state.lock();
        let id = self
            .free
            .lock()
            .pop_front()
            .ok_or(DpmError::OutOfSegments {
                count: self.count(),
            })?;
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
        self.pool
            .store_table_word(id, 0, TableEntry::state_word(SegState::Free, 0, 0))?;
        self.free.lock().push_back(id);
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

    pub fn add_live(&self, ptr: EntryPtr, delta: i64) -> Result<()> {
        let Some(seg) = self.pool.superblock().segment_of(ptr.offset) else {
            return Err(DpmError::BadSegment {
                segment: u64::MAX,
                detail: format!("entry at {} is outside the segments", ptr.offset),
            });
        };
        let len = self.entry_len(ptr)?;
        if delta >= 0 {
            self.live_bytes[seg as usize].fetch_add(len, Ordering::Relaxed);
        } else {
            self.live_bytes[seg as usize].fetch_sub(len, Ordering::Relaxed);
        }
        Ok(())
    }

    pub fn live_bytes(&self, id: u64) -> u64 {
        self.live_bytes[id as usize].load(Ordering::Relaxed)
    }
}
