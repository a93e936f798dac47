//! Merging KN logs into the index, in log order.
//!
//! A KN's log is a chain of segments; each is merged from its persisted progress (offset and
//! chain value of the next batch) to its valid end, found by the batch checksum chain, so a torn
//! last batch is never indexed. Every entry's CRC is checked by the scan before anything is
//! indexed. Progress is persisted after each batch; re-merging a batch after a crash is
//! idempotent (the same keys get the same pointers).
//!
//! Parallelism: logs of different KNs are merged at the same time by the worker pool; one log is
//! merged by one worker at a time (its chain lock), which keeps each KN's entries in order.
//! Ownership partitioning means two KNs never log the same key, so order across logs does not
//! matter.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_layout::index::EntryPtr;
use dinomo_layout::log::{entry_len, scan, LogOp};
use dinomo_layout::segment::{SegState, SegmentHeader, HEADER_SIZE};
use parking_lot::{Condvar, Mutex};

use crate::error::{DpmError, Result};
use crate::index::Index;
use crate::pool::Pool;
use crate::segments::{ChainHandle, LogId, Progress, Segments};

/// Which segments of a chain a merge covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeMode {
    /// Sealed segments only, in chain order, stopping at the first open one (background
    /// workers): a log's later segments wait for an earlier one that is still open (e.g. one
    /// abandoned after a failed WRITE and not sealed yet).
    Sealed,
    /// Everything written so far, open segments included, which stay open (reconfiguration:
    /// the KN lives on).
    All,
    /// Everything, sealing open segments first (the KN is dead or fenced).
    AllAndSeal,
}

/// Totals of one merge call.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MergeReport {
    pub segments: u64,
    pub batches: u64,
    pub entries: u64,
    /// Segment scans that ended on bytes that are not a valid batch: a torn last batch, or
    /// stale bytes from an earlier use of the segment. Nothing past such a point is indexed.
    pub invalid_tails: u64,
}

impl MergeReport {
    fn add(&mut self, o: MergeReport) {
        self.segments += o.segments;
        self.batches += o.batches;
        self.entries += o.entries;
        self.invalid_tails += o.invalid_tails;
    }
}

/// First and longest pause before a background worker retries a log whose merge failed.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Merger {
    pool: Arc<Pool>,
    index: Arc<Index>,
    segments: Arc<Segments>,
    entries_total: AtomicU64,
    wake: (Mutex<bool>, Condvar),
    /// Logs whose last background merge failed: when to try again and the pause after that,
    /// so a merge that cannot progress (say, no space for index buckets) neither spins nor
    /// floods the log.
    retry: Mutex<HashMap<LogId, (Instant, Duration)>>,
    /// Background passes finished (tests wait on it instead of sleeping).
    passes: AtomicU64,
    /// Set when KNs store into this replicated pool one-sidedly (shm, verbs): merges ship the
    /// batches they index to the backups first, waiting on this runtime ([`Merger::forward`]).
    forwarded: std::sync::OnceLock<tokio::runtime::Handle>,
    /// Per segment, the part its KN forwarded and the backups acknowledged (ForwardWrites):
    /// a merge need not ship it again. In memory only: after a restart everything is shipped.
    forwarded_prefix: Mutex<HashMap<u64, ForwardedPrefix>>,
}

/// Pool offsets `[start, end)` of one use (`generation`) of a segment that its KN forwarded.
/// A KN writes a segment's batches in order and forwards each before the next (it abandons the
/// segment when a forward fails), so what it forwarded is one range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ForwardedPrefix {
    generation: u64,
    start: u64,
    end: u64,
}

impl Merger {
    pub fn new(pool: Arc<Pool>, index: Arc<Index>, segments: Arc<Segments>) -> Self {
        Merger {
            pool,
            index,
            segments,
            entries_total: AtomicU64::new(0),
            wake: (Mutex::new(false), Condvar::new()),
            retry: Mutex::new(HashMap::new()),
            passes: AtomicU64::new(0),
            forwarded: std::sync::OnceLock::new(),
            forwarded_prefix: Mutex::new(HashMap::new()),
        }
    }

    /// `[offset, end)` of use `generation` of `segment` was forwarded by its KN and is at the
    /// backups. Kept as one range per segment: a range that does not continue it replaces it
    /// (whatever is left out is shipped by the merge, as if never forwarded).
    pub fn note_forwarded(&self, segment: u64, generation: u64, offset: u64, end: u64) {
        let mut m = self.forwarded_prefix.lock();
        let next = ForwardedPrefix {
            generation,
            start: offset,
            end,
        };
        match m.get_mut(&segment) {
            Some(p) if p.generation == generation && p.end == offset => p.end = end,
            Some(p) if p.generation == generation && p.start <= offset && end <= p.end => {}
            _ => {
                m.insert(segment, next);
            }
        }
    }

    /// From now on every merge ships the batches it indexes to the pool's backups and waits
    /// for them (on `runtime`, whose timers the barrier uses) before indexing: KNs store into
    /// this replicated pool without the memory node's CPU (shm, verbs). Merges run on threads
    /// outside the runtime's workers (merge workers, the blocking pool), where waiting is fine.
    pub fn forward(&self, runtime: tokio::runtime::Handle) {
        let _ = self.forwarded.set(runtime);
    }

    pub fn entries_merged(&self) -> u64 {
        self.entries_total.load(Ordering::Relaxed)
    }

    /// Wakes the workers (a segment was sealed).
    pub fn notify(&self) {
        *self.wake.0.lock() = true;
        self.wake.1.notify_all();
    }

    /// Merges segment `id` of `kn` from its progress to its valid end. Returns the report and
    /// whether the scan reached a clean end (false: it stopped at a torn or corrupt batch).
    pub fn merge_segment(&self, kn: u32, id: u64) -> Result<(MergeReport, bool)> {
        let entry = self.segments.entry_of(kn, id)?;
        let sb = self.pool.superblock();
        let seg_off = sb.segment_offset(id);
        let view = self.pool.view(seg_off, sb.segment_size)?;
        let header =
            SegmentHeader::decode(&view[..HEADER_SIZE]).map_err(|e| DpmError::BadSegment {
                segment: id,
                detail: format!("header unreadable: {e}"),
            })?;
        if header.segment_id != id || header.generation != entry.generation || header.kn_id != kn {
            return Err(DpmError::BadSegment {
                segment: id,
                detail: format!(
                    "header says segment {} generation {} of KN {}, table says generation {} of KN {kn}",
                    header.segment_id, header.generation, header.kn_id, entry.generation
                ),
            });
        }
        let progress = Progress::from_word(entry.merged_upto);
        let mut s = scan(view, progress.offset as usize, progress.chain);
        let mut report = MergeReport::default();
        let region = self.pool.region();
        if let Some(rt) = self.forwarded.get() {
            // KNs store into this replicated pool without this node's CPU (shm, verbs): a
            // batch whose ForwardWrites never completed (its KN died, or the call failed) is
            // here alone. Ship every batch about to be indexed, and wait until the backups
            // hold them, before the index points at them: a backup never gets an index line
            // before the bytes it points at, and no KN reads through the index a write that
            // this node's loss could take back.
            // What its KN forwarded is there already (acknowledged by the backups).
            let shipped = self
                .forwarded_prefix
                .lock()
                .get(&id)
                .copied()
                .filter(|p| p.generation == entry.generation);
            let batches: Vec<_> = s.by_ref().collect();
            let mut recorded = false;
            for batch in &batches {
                let (at, len) = (seg_off + batch.offset as u64, batch.len as u64);
                if shipped.is_some_and(|p| p.start <= at && at + len <= p.end) {
                    continue;
                }
                region.persist(at, len)?;
                metrics::counter!("dinomo_dpm_merge_shipped_bytes_total").increment(len);
                recorded = true;
            }
            if recorded {
                rt.block_on(region.mirror_barrier()).map_err(|e| {
                    DpmError::Replication(format!(
                        "segment {id} of KN {kn} is not at the backups yet ({e}); merged later"
                    ))
                })?;
            }
            for batch in batches {
                self.index_batch(id, seg_off, batch, &mut report)?;
            }
        } else {
            // A batch in a sealed segment was persisted before its KN sealed it. In a segment
            // still open, the KN may be between storing a batch and persisting it (a batch is
            // visible, checksums and all, before it is durable): persist it before indexing
            // it, so the index never points at bytes a power failure could take back.
            let open = entry.state == SegState::Open;
            for batch in s.by_ref() {
                if open {
                    region.persist(seg_off + batch.offset as u64, batch.len as u64)?;
                }
                self.index_batch(id, seg_off, batch, &mut report)?;
            }
        }
        let clean = s.stop_reason().is_none();
        if let Some(why) = s.stop_reason() {
            report.invalid_tails += 1;
            tracing::debug!(segment = id, kn, at = s.end(), %why, "log scan stopped before a torn or corrupt batch");
        }
        self.entries_total
            .fetch_add(report.entries, Ordering::Relaxed);
        metrics::counter!("dinomo_dpm_merged_entries_total").increment(report.entries);
        metrics::counter!("dinomo_dpm_merged_batches_total").increment(report.batches);
        Ok((report, clean))
    }

    /// Indexes one scanned batch of segment `id` (at pool offset `seg_off`) and records the
    /// segment's merge progress past it.
    fn index_batch(
        &self,
        id: u64,
        seg_off: u64,
        batch: dinomo_layout::log::ScannedBatch<'_>,
        report: &mut MergeReport,
    ) -> Result<()> {
        for (at, e) in &batch.entries {
            let ptr = EntryPtr::new(seg_off + *at as u64, entry_len(e.key.len(), e.value.len()));
            let hash = dinomo_layout::key_hash(e.key);
            // The index changes first and either fully or not at all; the accounting that
            // follows cannot fail, so a failed merge leaves the counters matching the index.
            let old = match e.op {
                LogOp::Put => {
                    let old = self.index.upsert(e.key, hash, ptr)?;
                    self.segments.add_live(ptr, 1);
                    old
                }
                LogOp::Delete => self.index.remove(e.key, hash)?,
            };
            if let Some(old) = old {
                self.segments.add_live(old, -1);
            }
        }
        report.batches += 1;
        report.entries += batch.entries.len() as u64;
        self.segments.set_progress(
            id,
            Progress {
                offset: (batch.offset + batch.len) as u32,
                chain: batch.chain,
            },
        )
    }

    /// Merges one log's chain according to `mode`, in chain order. The caller holds
    /// `chain.merging`; the chain's bookkeeping is locked only briefly, so allocation and
    /// sealing go on meanwhile.
    pub fn merge_chain(
        &self,
        log: LogId,
        chain: &ChainHandle,
        mode: MergeMode,
    ) -> Result<MergeReport> {
        let kn = log.kn;
        let mut report = MergeReport::default();
        let _accounting = self.segments.accounting_guard();
        let result = self.merge_chain_locked(kn, chain, mode, &mut report);
        self.segments.verify(&self.index, "a merge")?;
        result.map(|()| report)
    }

    fn merge_chain_locked(
        &self,
        kn: u32,
        chain: &ChainHandle,
        mode: MergeMode,
        report: &mut MergeReport,
    ) -> Result<()> {
        let pending: Vec<(u64, u64)> = chain
            .state
            .lock()
            .pending
            .iter()
            .map(|(s, id)| (*s, *id))
            .collect();
        for (seq, id) in pending {
            let state = self.pool.read_table_entry(id)?.state;
            let sealed = match (state, mode) {
                (SegState::Sealed, _) => true,
                (SegState::Open, MergeMode::Sealed) => break,
                (SegState::Open, MergeMode::All) => false,
                (SegState::Open, MergeMode::AllAndSeal) => {
                    self.segments.set_state(id, SegState::Sealed)?;
                    true
                }
                (other, _) => {
                    // Merged or free: stale DRAM entry; drop it.
                    tracing::warn!(
                        segment = id,
                        ?other,
                        "unexpected state of a pending segment"
                    );
                    chain.state.lock().pending.remove(&seq);
                    continue;
                }
            };
            let (r, _) = self.merge_segment(kn, id)?;
            report.add(r);
            if sealed {
                self.segments.set_state(id, SegState::Merged)?;
                chain.state.lock().pending.remove(&seq);
                report.segments += 1;
                metrics::counter!("dinomo_dpm_merged_segments_total").increment(1);
            }
        }
        Ok(())
    }

    /// Synchronous MergeAll for one KN: every one of its logs.
    pub fn merge_all(&self, kn: u32, mode: MergeMode) -> Result<MergeReport> {
        let mut report = MergeReport::default();
        for (log, chain) in self.segments.chains_of(kn) {
            let _merging = chain.merging.lock();
            report.add(self.merge_chain(log, &chain, mode)?);
        }
        Ok(report)
    }

    /// One pass of a background worker over every chain with sealed work; returns the entries
    /// merged.
    /// How many background passes (over every chain) have finished.
    pub fn passes(&self) -> u64 {
        self.passes.load(Ordering::Acquire)
    }

    fn work_once(&self, worker: usize) -> u64 {
        let merged = self.work_pass(worker);
        self.passes.fetch_add(1, Ordering::AcqRel);
        merged
    }

    fn work_pass(&self, worker: usize) -> u64 {
        let mut chains = self.segments.chains();
        if chains.is_empty() {
            return 0;
        }
        let n = chains.len();
        chains.rotate_left(worker % n);
        let mut merged = 0;
        for (log, chain) in chains {
            let Some(_merging) = chain.merging.try_lock() else {
                continue;
            };
            let Some(first) = chain.state.lock().pending.values().next().copied() else {
                continue;
            };
            if !self
                .pool
                .read_table_entry(first)
                .is_ok_and(|e| e.state == SegState::Sealed)
            {
                continue;
            }
            if self
                .retry
                .lock()
                .get(&log)
                .is_some_and(|(at, _)| Instant::now() < *at)
            {
                continue;
            }
            let kn = log.kn;
            match self.merge_chain(log, &chain, MergeMode::Sealed) {
                Ok(r) => {
                    merged += r.entries.max(r.segments);
                    if self.retry.lock().remove(&log).is_some() {
                        tracing::info!(kn, stream = log.stream, "merging a KN log works again");
                    }
                }
                Err(e) => {
                    metrics::counter!("dinomo_dpm_merge_errors_total").increment(1);
                    let mut retry = self.retry.lock();
                    let pause = retry
                        .get(&log)
                        .map_or(RETRY_FIRST, |(_, p)| (*p * 2).min(RETRY_MAX));
                    retry.insert(log, (Instant::now() + pause, pause));
                    tracing::error!(kn, stream = log.stream, error = %e, retry_in = ?pause, "merging a KN log failed");
                }
            }
        }
        merged
    }

    /// Starts `n` merge worker threads; they stop when `stop` is set (and notified).
    pub fn spawn_workers(
        self: &Arc<Self>,
        n: usize,
        stop: Arc<AtomicBool>,
    ) -> Vec<std::thread::JoinHandle<()>> {
        (0..n)
            .map(|w| {
                let me = self.clone();
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name(format!("merge-{w}"))
                    .spawn(move || {
                        while !stop.load(Ordering::Acquire) {
                            if me.work_once(w) == 0 {
                                let mut woken = me.wake.0.lock();
                                if !*woken {
                                    me.wake.1.wait_for(&mut woken, Duration::from_millis(20));
                                }
                                *woken = false;
                            }
                        }
                    })
                    .expect("spawning a merge worker")
            })
            .collect()
    }
}
