//! Garbage collection of log segments.
//!
//! - A merged segment with no live byte (no index slot points into it) is freed.
//! - A merged segment whose live bytes are below `clean_threshold` of its written bytes, or of
//!   half its capacity if less was written (below 90% when the pool is nearly full), is
//!   cleaned, sparsest first: its live entries are copied, as one checksummed batch, into a
//!   segment the cleaner
//!   owns, and each index slot is moved from the old copy to the new one only if it still points
//!   at the old copy (a merge may have replaced it meanwhile). The old segment then has no live
//!   byte and is freed by a later pass.
//!
//! - A segment holding the entry an indirect cell points to is skipped (see [`crate::cells`]),
//!   and so is a segment of a KN whose fenced process may still write into it (see
//!   [`crate::fenced_procs`]).
//! - With backups and KNs on a one-sided fabric (they forward what they store), a pass first
//!   has the backups acknowledge every live cell's word that changed since they last did (see
//!   [`Gc::ship_cells`]), and skips the segments of every word a backup may hold: a cell whose
//!   CAS its KN never forwarded must not point, at a backup, into a segment this pass frees.
//!
//! Crash safety: the copy is persisted before any slot points at it; a crash mid-clean leaves
//! unreferenced copies (dead bytes in the cleaner's segment) and the old entries still indexed.
//! At open, the cleaner's open segment is marked merged (see Dpm::open).
//!
//! Space: the cleaner allocates with [`Tier::Cleaner`], which may take the last free segments
//! (KNs and index growth leave it a reserve), so compaction can always make progress.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use dinomo_layout::index::EntryPtr;
use dinomo_layout::log::{entry_len, scan, BatchBuilder, LogOp};
use dinomo_layout::segment::{SegState, HEADER_SIZE};
use parking_lot::Mutex;

use crate::cells::Cells;
use crate::error::{DpmError, Result};
use crate::fenced_procs::FencedProcs;
use crate::index::Index;
use crate::pool::Pool;
use crate::segments::{Progress, SegmentGrant, Segments, Tier, CLEANER_LOG};

/// Under space pressure, clean any merged segment less live than this (cleaning a segment
/// that is 90% live gains 10% of a segment for a segment's worth of copying).
const PRESSURE_CLEAN_THRESHOLD: f64 = 0.9;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GcReport {
    pub freed: u64,
    pub cleaned: u64,
    pub moved_entries: u64,
}

#[derive(Debug)]
struct Target {
    grant: SegmentGrant,
    pos: u64,
    chain: u32,
}

#[derive(Debug)]
pub struct Gc {
    pool: Arc<Pool>,
    index: Arc<Index>,
    segments: Arc<Segments>,
    cells: Arc<Cells>,
    /// KNs with a fenced process that may still write: their segments are left alone.
    fenced_procs: Arc<FencedProcs>,
    /// Clean merged segments whose live bytes are below this fraction of their written bytes
    /// (or of half the segment, if less was written).
    clean_threshold: f64,
    target: Mutex<Option<Target>>,
    /// One pass at a time (the GC thread, or a full pool's allocation making room): two passes
    /// would both free the same dead segment.
    pass: Mutex<()>,
    /// Passes finished (tests wait on it instead of sleeping).
    passes: std::sync::atomic::AtomicU64,
    /// Set when KNs forward what they store ([`Gc::forward`]): the runtime whose timers the
    /// backups' barrier uses.
    forwarded: std::sync::OnceLock<tokio::runtime::Handle>,
    /// Cell offset -> the word the backups last acknowledged from [`Gc::ship_cells`] (in
    /// memory: after a restart every cell is shipped once more).
    shipped_cells: Mutex<HashMap<u64, u64>>,
}

/// Copies of one cell a pass makes while KNs keep swinging it (see [`Gc::ship_cells`]).
const MAX_CELL_COPIES: u32 = 8;

impl Gc {
    pub fn new(
        pool: Arc<Pool>,
        index: Arc<Index>,
        segments: Arc<Segments>,
        cells: Arc<Cells>,
        fenced_procs: Arc<FencedProcs>,
        clean_threshold: f64,
    ) -> Self {
        Gc {
            pool,
            index,
            segments,
            cells,
            fenced_procs,
            clean_threshold,
            target: Mutex::new(None),
            pass: Mutex::new(()),
            passes: std::sync::atomic::AtomicU64::new(0),
            forwarded: std::sync::OnceLock::new(),
            shipped_cells: Mutex::new(HashMap::new()),
        }
    }

    /// From now on every pass ships the indirect cells to the pool's backups first (KNs store
    /// into this replicated pool without the memory node's CPU: shm, verbs). Passes run on
    /// the GC thread or an allocation's blocking thread, where waiting is fine.
    pub fn forward(&self, runtime: tokio::runtime::Handle) {
        let _ = self.forwarded.set(runtime);
    }

    /// With forwarding on: records into the mirror every live cell's word that changed since
    /// the backups last acknowledged it, and waits until they hold it; returns the segments
    /// of every word the backups may hold for a cell (the shipped words, and the words read
    /// around each copy), which the pass must not free or clean, besides those the cells
    /// point into when it checks.
    ///
    /// Why: a KN swings a cell with a CAS the primary's CPU never sees and forwards it after;
    /// a KN that dies or is fenced in between (or whose forward failed) leaves the new word on
    /// the primary alone, and the backups' cell pointing at the entry it replaced. Once the
    /// index moved past that entry (a merge), nothing here would pin its segment, and freeing
    /// it would leave a promoted backup's cell pointing into reused bytes.
    ///
    /// What a copy records is the word at some moment between the reads around it (the
    /// mirror copies the bytes when it records them, [`dinomo_fabric::mirror::PersistMirror::record`]): when both
    /// read the same word, that is the word recorded. A cell cannot leave a word and return
    /// to it between the reads: it moves only to entries written after the one it points at,
    /// and the same word could be written again only at the same offset of a freed and
    /// reused segment, which no pass frees while this one (holding the pass lock) runs. A
    /// cell that keeps changing under the copy is copied again, a few times at most; then the
    /// pass acts on nothing ([`DpmError::CellsChurning`]).
    ///
    /// The backups' acknowledged words are kept across changes of the backup set: a backup
    /// that attaches later is given a copy of the pool taken after those words were stored,
    /// so it holds them or newer words of the same cells, and a newer word differs from the
    /// kept one and is shipped at the next pass.
    fn ship_cells(&self) -> Result<HashSet<u64>> {
        let Some(rt) = self.forwarded.get() else {
            return Ok(HashSet::new());
        };
        let mut shipped = self.shipped_cells.lock();
        let live: HashSet<u64> = self.cells.offsets().into_iter().collect();
        shipped.retain(|offset, _| live.contains(offset));
        let sb = self.pool.superblock();
        let region = self.pool.region();
        let read = |offset: u64| -> Result<u64> {
            Ok(region
                .word(offset)?
                .load(std::sync::atomic::Ordering::Acquire))
        };
        let mut pinned = HashSet::new();
        let mut pin = |word: u64| {
            if let Some(id) = EntryPtr::from_word(word).and_then(|p| sb.segment_of(p.offset)) {
                pinned.insert(id);
            }
        };
        let mut recorded = Vec::new();
        for &offset in &live {
            let mut before = read(offset)?;
            pin(before);
            if shipped.get(&offset) == Some(&before) {
                // Unchanged since the backups acknowledged it.
                continue;
            }
            let mut copies = 0;
            loop {
                region.persist(offset, 8)?;
                copies += 1;
                let after = read(offset)?;
                pin(after);
                if after == before {
                    recorded.push((offset, after));
                    break;
                }
                if copies == MAX_CELL_COPIES {
                    return Err(DpmError::CellsChurning { offset, copies });
                }
                before = after;
            }
        }
        if !recorded.is_empty() {
            rt.block_on(region.mirror_barrier()).map_err(|e| {
                DpmError::Replication(format!(
                    "the indirect cells are not at the backups ({e}): nothing freed or \
                     cleaned this pass"
                ))
            })?;
            shipped.extend(recorded);
        }
        Ok(pinned)
    }

    /// One pass over the segment table: frees dead segments, then cleans sparse ones, the
    /// sparsest first. When free segments run short (the pool is nearly full), every merged
    /// segment that is not nearly all live is a candidate, so deletes and overwrites give
    /// space back even when they leave segments half full. A segment that fails to clean is
    /// logged and skipped; the pass goes on with the others.
    pub fn run_once(&self) -> Result<GcReport> {
        let r = self.pass_locked();
        self.passes
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        r
    }

    /// How many passes have finished since the node started.
    pub fn passes(&self) -> u64 {
        self.passes.load(std::sync::atomic::Ordering::Acquire)
    }

    fn pass_locked(&self) -> Result<GcReport> {
        let _pass = self.pass.lock();
        let shipped_pins = self.ship_cells()?;
        let mut report = GcReport::default();
        let current_target = self.target.lock().as_ref().map(|t| t.grant.segment_id);
        let mut sparse = Vec::new();
        let capacity = self.pool.superblock().segment_size - HEADER_SIZE as u64;
        for id in 0..self.segments.count() {
            if Some(id) == current_target {
                continue;
            }
            let e = self.pool.read_table_entry(id)?;
            if e.state != SegState::Merged {
                continue;
            }
            if shipped_pins.contains(&id)
                || (!self.cells.is_empty() && self.cells.pins(&self.pool, id))
            {
                continue;
            }
            // Its KN's fenced process may still copy a batch in (shm): reused, the segment
            // would take that copy over another KN's acknowledged data.
            if self.fenced_procs.holds(e.kn_id) {
                continue;
            }
            let live = self.segments.live_bytes(id);
            if live == 0 {
                self.segments.free(id)?;
                report.freed += 1;
                continue;
            }
            // Against what was written, but at least half the segment: a nearly empty
            // segment that is all live (abandoned after a crash or a failed WRITE, the
            // cleaner's last target at a restart) is sparse too; measured only against what
            // was written it would never be cleaned, and one per crash would leak until the
            // pool is full. Not against the whole capacity: a full segment's unused tail
            // (batches do not pack it exactly) would make the cleaner re-clean its own
            // output under pressure, forever.
            let written = u64::from(Progress::from_word(e.merged_upto).offset)
                .saturating_sub(HEADER_SIZE as u64);
            if written > 0 {
                sparse.push((live as f64 / written.max(capacity / 2) as f64, id));
            }
        }
        let threshold = if self.under_pressure() {
            PRESSURE_CLEAN_THRESHOLD.max(self.clean_threshold)
        } else {
            self.clean_threshold
        };
        sparse.retain(|&(ratio, _)| threshold > 0.0 && ratio < threshold);
        sparse.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, id) in sparse {
            let cleaned = {
                let _accounting = self.segments.accounting_guard();
                self.clean(id).and_then(|moved| {
                    self.segments
                        .verify(&self.index, "cleaning")
                        .map(|()| moved)
                })
            };
            match cleaned {
                Ok(moved) => {
                    report.moved_entries += moved;
                    report.cleaned += 1;
                }
                Err(e) => {
                    metrics::counter!("dinomo_dpm_gc_clean_errors_total").increment(1);
                    tracing::warn!(segment = id, error = %e, "cleaning a segment failed; skipping it this pass");
                    if matches!(e, crate::error::DpmError::PoolFull { .. }) {
                        break; // no target segment: nothing else can be cleaned either
                    }
                }
            }
        }
        metrics::counter!("dinomo_dpm_gc_freed_segments_total").increment(report.freed);
        metrics::counter!("dinomo_dpm_gc_cleaned_segments_total").increment(report.cleaned);
        Ok(report)
    }

    /// Free segments are no more than the reserves plus a small margin.
    fn under_pressure(&self) -> bool {
        let margin = (self.segments.count() / 16).max(2);
        (self.segments.free_count() as u64) <= self.segments.reserves().total() + margin
    }

    /// Copies the live entries of merged segment `id` to the cleaner's segment.
    fn clean(&self, id: u64) -> Result<u64> {
        let e = self.pool.read_table_entry(id)?;
        let sb = self.pool.superblock();
        let seg_off = sb.segment_offset(id);
        let view = self.pool.view(seg_off, sb.segment_size)?;
        let seed = dinomo_layout::segment::SegmentHeader::decode(&view[..HEADER_SIZE])
            .map(|h| h.chain_seed())
            .map_err(|err| crate::error::DpmError::BadSegment {
                segment: id,
                detail: err.to_string(),
            })?;
        let end = Progress::from_word(e.merged_upto).offset as usize;
        // Live entries: the index still points at them.
        let mut live = Vec::new();
        for batch in scan(&view[..end], HEADER_SIZE, seed) {
            for (at, entry) in batch.entries {
                if entry.op != LogOp::Put {
                    continue;
                }
                let ptr = EntryPtr::new(
                    seg_off + at as u64,
                    entry_len(entry.key.len(), entry.value.len()),
                );
                let hash = dinomo_layout::key_hash(entry.key);
                if self.index.lookup(entry.key, hash)? == Some(ptr) {
                    live.push((ptr, hash, entry));
                }
            }
        }
        // Copy in batches of at most a quarter segment, so every batch fits a fresh segment.
        let mut chunks: Vec<&[(EntryPtr, u64, dinomo_layout::log::EntryRef<'_>)]> = Vec::new();
        let (mut start, mut bytes) = (0, 0u64);
        for (i, (p, _, _)) in live.iter().enumerate() {
            if i > start && bytes + u64::from(p.len) > sb.segment_size / 4 {
                chunks.push(&live[start..i]);
                (start, bytes) = (i, 0);
            }
            bytes += u64::from(p.len);
        }
        if start < live.len() {
            chunks.push(&live[start..]);
        }
        let mut moved = 0;
        for chunk in chunks {
            let mut b = BatchBuilder::new();
            let offsets: Vec<usize> = chunk
                .iter()
                .map(|(_, _, en)| b.push(LogOp::Put, en.version, en.key, en.value))
                .collect();
            let need = b.encoded_len() as u64;
            let mut guard = self.target.lock();
            let target = self.target_with_room(&mut guard, need)?;
            let (bytes, chain) = b.finish(target.chain);
            let base = target.grant.offset + target.pos;
            self.pool.region().write_durable(base, &bytes)?;
            target.pos += bytes.len() as u64;
            target.chain = chain;
            self.segments.set_progress(
                target.grant.segment_id,
                Progress {
                    offset: target.pos as u32,
                    chain,
                },
            )?;
            drop(guard);
            for ((old, hash, _), off) in chunk.iter().zip(offsets) {
                let new = EntryPtr::new(base + off as u64, old.len as usize);
                if self.index.replace_if(*hash, *old, new)? {
                    self.segments.add_live(new, 1);
                    self.segments.add_live(*old, -1);
                    moved += 1;
                }
            }
        }
        Ok(moved)
    }

    fn target_with_room<'a>(
        &self,
        guard: &'a mut Option<Target>,
        need: u64,
    ) -> Result<&'a mut Target> {
        let full = guard.as_ref().is_some_and(|t| t.pos + need > t.grant.len);
        if full {
            let t = guard.take().expect("checked");
            self.segments
                .set_state(t.grant.segment_id, SegState::Merged)?;
            let chain = self.segments.chain(CLEANER_LOG);
            chain.state.lock().pending.remove(&t.grant.chain_seq);
        }
        if guard.is_none() {
            let grant = self.segments.allocate(CLEANER_LOG, 0, Tier::Cleaner)?;
            *guard = Some(Target {
                grant,
                pos: grant.first_batch,
                chain: grant.chain_seed,
            });
        }
        Ok(guard.as_mut().expect("set above"))
    }

    /// Marks the cleaner's current segment merged (shutdown).
    pub fn close(&self) -> Result<()> {
        if let Some(t) = self.target.lock().take() {
            self.segments
                .set_state(t.grant.segment_id, SegState::Merged)?;
            self.segments
                .chain(CLEANER_LOG)
                .state
                .lock()
                .pending
                .remove(&t.grant.chain_seq);
        }
        Ok(())
    }
}
