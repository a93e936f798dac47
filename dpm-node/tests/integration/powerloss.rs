//! Power-loss crash test: the DPM runs over a pool mapped with durability
//! `simulated-power-loss`, so the pool's region keeps a shadow of every line persisted so far.
//! Two KN-like writers (sharing the DPM's mapping, so their persists are recorded too) log
//! puts, overwrites and deletes while the test drives explicit MergeAll, garbage collection with
//! cleaning, metadata updates, and indirect cells (installed, written by log + CAS as a KN
//! does, removed); the index starts small and grows many times. Two profiles: `MIXED` (small
//! values, frequent GC) and `FILLING` (large values, GC only when an append finds the pool
//! full, as an operator would: the pool fills again and again).
//!
//! A persist hook takes crash images at sampled persist numbers, spread over every phase. The
//! hook runs as a persist begins, so an image is a power failure right before that persist's
//! write-back: every line not equal to its persisted state (the stores since the previous
//! persists) is dropped, kept or torn (see `dinomo_fabric::powerloss`). The writers' ledger is
//! copied in the same critical section.
//!
//! A checker thread opens each image as a pool, MergeAlls both KNs and checks that:
//! - every acknowledged write (log batch, cell CAS, metadata update) is there with its value,
//!   or with a value attempted later (whose acknowledgement the crash may have cut off);
//!   nothing never attempted is there;
//! - the index can be walked as KNs read it: every slot's entry decodes, carries a key of its
//!   hash, and no key is indexed twice;
//! - the live-byte counters equal a recount from the index (`Dpm::check_accounting`), also
//!   after a garbage-collection pass over the recovered pool.
//!
//! The workload runs twice with the same seed: once to count persists per phase, once to take
//! the images at persist numbers chosen from those counts (the merge worker's timing varies a
//! little between the passes). `DINOMO_POWERLOSS_SEED` and `DINOMO_POWERLOSS_CRASHES` override
//! the seed and the number of crash points (per test). The first failing images are kept under
//! the system temp dir (the paths are printed) with their persist number and image seed, so
//! they can be opened again (durability process-crash, create = false).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;
use std::time::Instant;

use dinomo_dpm_node::config::{DpmConfig, DpmConfigFile};
use dinomo_dpm_node::testkit::{LocalSource, LogRecord, LogWriter};
use dinomo_dpm_node::{Dpm, DpmError};
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::{FabricExt, PmRegion, PowerLossImage, PowerLossStats};
use dinomo_layout::index::EntryPtr;
use dinomo_layout::log::{decode_entry, LogOp};
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const KNS: [u32; 2] = [1, 2];
const META_NAMES: u32 = 6;
const MAX_CELLS: usize = 4;
const DEFAULT_SEED: u64 = 0x9e3c_0a5f_1d2b_4c67;

/// The shape of a run.
#[derive(Debug, Clone, Copy)]
struct Profile {
    name: &'static str,
    pool_size: &'static str,
    /// Keys `k0..k{keys}`; key i belongs to KN `KNS[i % 2]`.
    keys: u32,
    steps: u64,
    /// Value lengths: mostly `value_min..=value_max`, one in twenty up to `value_big`.
    value_min: u16,
    value_max: u16,
    value_big: u16,
    /// Of the 8 in 100 steps that may run a GC pass, how many do (a full pool also runs GC).
    gc_slots: u32,
    /// Crash points, unless DINOMO_POWERLOSS_CRASHES says otherwise.
    crashes: u64,
    /// The pool must fill up at least once.
    expect_full: bool,
}

/// Small values, many keys, GC often: the index grows many times, GC cleans.
const MIXED: Profile = Profile {
    name: "mixed",
    pool_size: "16MiB",
    keys: 1200,
    steps: 2500,
    value_min: 8,
    value_max: 300,
    value_big: 2000,
    gc_slots: 8,
    crashes: 700,
    expect_full: false,
};

/// Large values and more live data than the pool holds: allocations fail (after the DPM's own
/// merge-and-collect attempt to make room), index growth waits for space, and the cleaner
/// runs against a full pool.
const FILLING: Profile = Profile {
    name: "filling",
    pool_size: "8MiB",
    keys: 1400,
    steps: 2500,
    value_min: 2000,
    value_max: 8000,
    value_big: 16000,
    gc_slots: 1,
    crashes: 400,
    expect_full: true,
};

/// What the system was doing when a persist happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
enum Phase {
    Register = 0,
    Append,
    CellWrite,
    BackgroundMerge,
    MergeAll,
    MergeAllSeal,
    Gc,
    Metadata,
    CellInstall,
    CellRemove,
}

const PHASES: [Phase; 10] = [
    Phase::Register,
    Phase::Append,
    Phase::CellWrite,
    Phase::BackgroundMerge,
    Phase::MergeAll,
    Phase::MergeAllSeal,
    Phase::Gc,
    Phase::Metadata,
    Phase::CellInstall,
    Phase::CellRemove,
];

/// Crash points wanted per phase (scaled to the total asked for; a phase with fewer persists
/// gives all it has and the rest goes to the others).
fn weight(p: Phase) -> u64 {
    match p {
        Phase::Register => 1,
        Phase::Append => 30,
        Phase::CellWrite => 8,
        Phase::BackgroundMerge => 15,
        Phase::MergeAll => 15,
        Phase::MergeAllSeal => 8,
        Phase::Gc => 15,
        Phase::Metadata => 5,
        Phase::CellInstall => 3,
        Phase::CellRemove => 3,
    }
}

/// One write of a key or metadata name: its version and value length (0: a delete).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct W {
    version: u64,
    len: u16,
}

/// A key's history as the writer knows it.
#[derive(Debug, Clone, Default)]
struct History {
    /// The last acknowledged write.
    acked: Option<W>,
    /// Writes attempted after it (in flight when a crash image is taken).
    pending: Vec<W>,
}

impl History {
    fn attempt(&mut self, w: W) {
        self.pending.push(w);
    }
    /// A write that was refused before anything was written.
    fn forget(&mut self, w: W) {
        self.pending.retain(|p| p.version != w.version);
    }
    fn ack(&mut self, w: W) {
        self.pending.retain(|p| p.version > w.version);
        self.acked = Some(w);
    }
    /// The last value the writer tried to give it (None: absent).
    fn last_len(&self) -> u16 {
        self.pending
            .last()
            .or(self.acked.as_ref())
            .map_or(0, |w| w.len)
    }
}

#[derive(Debug, Clone, Default)]
struct Ledger {
    keys: Vec<History>,
    meta: Vec<History>,
}

fn key(i: u32) -> Vec<u8> {
    format!("k{i}").into_bytes()
}

fn value(i: u32, w: W) -> Vec<u8> {
    let mut v = format!("k{i}:{}:", w.version).into_bytes();
    v.resize(v.len().max(usize::from(w.len)), b'.');
    v
}

fn meta_name(i: u32) -> String {
    format!("powerloss/{i}")
}

fn meta_value(i: u32, w: W) -> Vec<u8> {
    let mut v = format!("m{i}:{}:", w.version).into_bytes();
    v.resize(v.len().max(usize::from(w.len)), b'#');
    v
}

/// Whether `found` is a state the key may have after the crash.
fn allowed(h: &History, found: Option<&[u8]>, render: impl Fn(W) -> Vec<u8>) -> bool {
    let outcomes = h.acked.iter().chain(&h.pending);
    let mut any = h.acked.is_none() && found.is_none();
    for w in outcomes {
        any |= match (w.len, found) {
            (0, None) => true,
            (0, Some(_)) | (_, None) => false,
            (_, Some(f)) => f == render(*w).as_slice(),
        };
    }
    any
}

/// A crash image and what the writers knew at that moment.
struct Crash {
    persist: u64,
    /// The workload step it happened in.
    step: u64,
    seed: u64,
    phase: Phase,
    image: PowerLossImage,
    ledger: Ledger,
}

/// Which persist numbers of each phase become crash points (pass two).
#[derive(Debug, Default)]
struct Plan {
    at: HashMap<Phase, HashSet<u64>>,
}

/// State the persist hook shares with the driver.
struct Shared {
    phase: AtomicU8,
    step: AtomicU64,
    /// Persists seen per phase (pass one: the counts; pass two: the position in the plan).
    counts: Mutex<BTreeMap<Phase, u64>>,
    ledger: Mutex<Ledger>,
    plan: Option<Plan>,
    tx: Mutex<Option<SyncSender<Crash>>>,
    base_seed: u64,
}

impl Shared {
    fn set_phase(&self, p: Phase) {
        self.phase.store(p as u8, Ordering::Release);
    }

    fn hook(&self, region: &PmRegion, n: u64) {
        // The merge workers run sealed segments on their own threads.
        let phase = if std::thread::current()
            .name()
            .is_some_and(|t| t.starts_with("merge-"))
        {
            Phase::BackgroundMerge
        } else {
            PHASES[usize::from(self.phase.load(Ordering::Acquire))]
        };
        let idx = {
            let mut c = self.counts.lock();
            let e = c.entry(phase).or_insert(0);
            *e += 1;
            *e
        };
        let Some(plan) = &self.plan else {
            return;
        };
        if !plan.at.get(&phase).is_some_and(|s| s.contains(&idx)) {
            return;
        }
        let seed = self.base_seed ^ n.wrapping_mul(0x2545_f491_4f6c_dd1d);
        // The ledger lock is held across the image: no write is attempted or acknowledged in
        // between, so every acknowledged write was persisted before the image, and every byte
        // in the image was written by a write the copy knows as attempted.
        let guard = self.ledger.lock();
        let image = region
            .power_loss_image(seed)
            .expect("a simulated-power-loss region");
        let ledger = guard.clone();
        drop(guard);
        let tx = self.tx.lock().clone();
        if let Some(tx) = tx {
            let _ = tx.send(Crash {
                persist: n,
                step: self.step.load(Ordering::Acquire),
                seed,
                phase,
                image,
                ledger,
            });
        }
    }
}

fn base_config(dir: &Path, pool_size: &str, durability: &str, create: bool) -> DpmConfig {
    DpmConfigFile {
        pool_size: pool_size.parse().unwrap(),
        segment_size: "64KiB".parse().unwrap(),
        metadata_size: "64KiB".parse().unwrap(),
        initial_index_buckets: 64,
        merge_workers: 1,
        // Garbage collection runs only when the test says so.
        gc_interval_ms: 3_600_000,
        clean_threshold: 0.5,
        durability: durability.parse().unwrap(),
        create,
        ..DpmConfigFile::in_process(dir.join("pool"))
    }
    .validate()
    .unwrap()
}

type Writer = LogWriter<ShmFabric, LocalSource>;

/// What a run of the workload did.
#[derive(Debug, Default)]
struct Run {
    persists: u64,
    /// Steps during which the index grew, and GC passes that cleaned or freed segments.
    grew: HashSet<u64>,
    cleaned: HashSet<u64>,
    freed: HashSet<u64>,
    /// Steps in which an append found the pool full (and room was made).
    full: HashSet<u64>,
    resizes: u64,
    gc: (u64, u64, u64),
    /// Appends refused because the pool was full, and other operations refused for it.
    full_appends: u64,
    full_other: u64,
    final_stats: String,
}

impl Run {
    /// `Some` on success; `None` when the pool is full (counted); panics on anything else.
    fn unless_full<T>(&mut self, what: &str, r: dinomo_dpm_node::Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(DpmError::PoolFull { .. }) => {
                self.full_other += 1;
                None
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }

    fn gc(&mut self, dpm: &Dpm, step: u64) {
        let Some(r) = self.unless_full("GC", dpm.gc().run_once()) else {
            return;
        };
        if r.cleaned > 0 {
            self.cleaned.insert(step);
        }
        if r.freed > 0 {
            self.freed.insert(step);
        }
        self.gc.0 += r.freed;
        self.gc.1 += r.cleaned;
        self.gc.2 += r.moved_entries;
    }

    /// What an operator does about a full pool: merge, collect (twice: a cleaned segment is
    /// freed by the next pass).
    fn make_room(&mut self, shared: &Shared, dpm: &Dpm, step: u64) {
        shared.set_phase(Phase::MergeAll);
        for kn in KNS {
            self.unless_full("MergeAll", dpm.merge_all(kn, false));
        }
        shared.set_phase(Phase::Gc);
        self.gc(dpm, step);
        self.gc(dpm, step);
    }
}

/// Runs the workload once over a fresh pool in `dir`.
async fn workload(dir: &Path, p: Profile, seed: u64, shared: Arc<Shared>) -> Run {
    std::fs::create_dir_all(dir).unwrap();
    let dpm = Dpm::open(base_config(dir, p.pool_size, "simulated-power-loss", true)).unwrap();
    let region = dpm.pool().region().clone();
    let s = shared.clone();
    region
        .set_persist_hook(Some(Arc::new(move |r: &PmRegion, n| s.hook(r, n))))
        .unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut version = 0u64;

    shared.set_phase(Phase::Register);
    let register = |kn: u32| {
        let reg = dpm.register_kn(Some(kn), "powerloss").unwrap();
        let fabric = ShmFabric::from_parts(region.clone(), dpm.grants().clone(), reg.key);
        let source = LocalSource {
            dpm: dpm.clone(),
            kn,
            epoch: reg.epoch,
        };
        LogWriter::new(fabric, source)
    };
    let mut writers: HashMap<u32, Writer> = HashMap::new();
    for kn in KNS {
        writers.insert(kn, register(kn));
    }
    // Cells: key -> (cell offset, the entry word it holds).
    let mut cells: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    let kn_of = |k: u32| KNS[(k % 2) as usize];
    let mut run = Run::default();
    let mut resizes = dpm.stats().index_resizes;

    let value_len = |rng: &mut StdRng| {
        let max = if rng.random_bool(0.05) {
            p.value_big
        } else {
            p.value_max
        };
        rng.random_range(p.value_min..=max)
    };

    for step in 1..=p.steps {
        let now = dpm.stats().index_resizes;
        if now != resizes {
            // A resize is counted when done; the background merge may have done it too.
            run.grew.insert(step - 1);
            resizes = now;
        }
        shared.step.store(step, Ordering::Release);
        let roll = rng.random_range(0..100u32);
        let kn = KNS[rng.random_range(0..KNS.len())];
        match roll {
            // Log batches: new keys, overwrites, deletes.
            0..=59 => {
                shared.set_phase(Phase::Append);
                let n = rng.random_range(1..=6);
                let mut picked = HashSet::new();
                let mut batch = Vec::new();
                let mut writes = Vec::new();
                {
                    let mut ledger = shared.ledger.lock();
                    for _ in 0..n {
                        let k = rng.random_range(0..p.keys / 2) * 2 + (kn - KNS[0]);
                        if cells.contains_key(&k) || !picked.insert(k) {
                            continue;
                        }
                        let h = &mut ledger.keys[k as usize];
                        version += 1;
                        let len = if h.last_len() == 0 || rng.random_bool(0.75) {
                            value_len(&mut rng)
                        } else {
                            0
                        };
                        let w = W { version, len };
                        h.attempt(w);
                        writes.push((k, w));
                        batch.push(record(k, w));
                    }
                }
                if batch.is_empty() {
                    continue;
                }
                let appended = writers.get_mut(&kn).unwrap().append(&batch).await;
                let full = refused_for_space(appended);
                let mut ledger = shared.ledger.lock();
                for (k, w) in writes {
                    if full {
                        ledger.keys[k as usize].forget(w);
                    } else {
                        ledger.keys[k as usize].ack(w);
                    }
                }
                drop(ledger);
                if full {
                    run.full_appends += 1;
                    run.full.insert(step);
                    run.make_room(&shared, &dpm, step);
                }
            }
            // A write of a replicated key, as a KN does it: log, then swing the cell.
            60..=67 if !cells.is_empty() => {
                shared.set_phase(Phase::CellWrite);
                let k = *cells.keys().nth(rng.random_range(0..cells.len())).unwrap();
                let (off, cur) = cells[&k];
                version += 1;
                let len = if rng.random_bool(0.8) {
                    value_len(&mut rng)
                } else {
                    0
                };
                let w = W { version, len };
                shared.ledger.lock().keys[k as usize].attempt(w);
                let writer = writers.get_mut(&kn_of(k)).unwrap();
                let appended = writer.append(&[record(k, w)]).await;
                let ptr = match appended {
                    Ok(ptrs) => ptrs[0],
                    Err(e) => {
                        refused_for_space::<()>(Err(e));
                        shared.ledger.lock().keys[k as usize].forget(w);
                        run.full_appends += 1;
                        run.full.insert(step);
                        run.make_room(&shared, &dpm, step);
                        continue;
                    }
                };
                let old = writer.fabric().cas(off, cur, ptr.to_word()).await.unwrap();
                assert_eq!(old, cur, "the cell of k{k} moved under the test");
                cells.insert(k, (off, ptr.to_word()));
                shared.ledger.lock().keys[k as usize].ack(w);
            }
            60..=67 => {}
            68..=75 => {
                shared.set_phase(Phase::MergeAll);
                run.unless_full("MergeAll", dpm.merge_all(kn, false));
            }
            76..=78 => {
                shared.set_phase(Phase::MergeAllSeal);
                // Its open segment is sealed even when the merge stops short, and its session
                // ended (a KN may not append to segments sealed under it): the writer
                // registers again, as a KN does, and starts a new segment.
                let r = dpm.merge_all(kn, true);
                writers.get_mut(&kn).unwrap().abandon();
                writers.insert(kn, register(kn));
                run.unless_full("MergeAll and seal", r);
            }
            79..=86 if roll - 79 < p.gc_slots => {
                shared.set_phase(Phase::Gc);
                run.gc(&dpm, step);
            }
            79..=86 => {}
            87..=92 => {
                shared.set_phase(Phase::Metadata);
                let i = rng.random_range(0..META_NAMES);
                version += 1;
                let len = if rng.random_bool(0.85) {
                    rng.random_range(1..=400)
                } else {
                    0
                };
                let w = W { version, len };
                shared.ledger.lock().meta[i as usize].attempt(w);
                let v = (len > 0).then(|| meta_value(i, w));
                dpm.put_metadata(&meta_name(i), v.as_deref()).unwrap();
                shared.ledger.lock().meta[i as usize].ack(w);
            }
            // Replicate a key: its owner pauses (here: nothing in flight) and its log is merged.
            93..=96 if cells.len() < MAX_CELLS => {
                let k = rng.random_range(0..p.keys / 2) * 2 + (kn - KNS[0]);
                if cells.contains_key(&k) {
                    continue;
                }
                shared.set_phase(Phase::MergeAll);
                if run
                    .unless_full("MergeAll", dpm.merge_all(kn, false))
                    .is_none()
                {
                    continue;
                }
                shared.set_phase(Phase::CellInstall);
                let Some(off) = run.unless_full("install_cell", dpm.install_cell(&key(k))) else {
                    continue;
                };
                let cur = region.word(off).unwrap().load(Ordering::Acquire);
                cells.insert(k, (off, cur));
            }
            93..=96 => {}
            // De-replicate one.
            _ => {
                let Some(&k) = cells.keys().next() else {
                    continue;
                };
                shared.set_phase(Phase::MergeAll);
                if run
                    .unless_full("MergeAll", dpm.merge_all(kn_of(k), false))
                    .is_none()
                {
                    continue;
                }
                shared.set_phase(Phase::CellRemove);
                if let Some(removed) = run.unless_full("remove_cell", dpm.remove_cell(&key(k))) {
                    assert!(removed);
                    cells.remove(&k);
                }
            }
        }
    }
    region.set_persist_hook(None).unwrap();
    let st = dpm.stats();
    if st.index_resizes != resizes {
        run.grew.insert(p.steps);
    }
    run.persists = region.persist_count();
    run.resizes = st.index_resizes;
    run.final_stats = format!(
        "{} keys indexed in {} buckets after {} resizes; {} of {} segments free",
        st.index_items, st.index_buckets, st.index_resizes, st.segments_free, st.segments_total
    );
    dpm.shutdown();
    run
}

/// Whether an append was refused because the pool is full (nothing was written: segments are
/// allocated before the WRITE). Panics on any other error.
fn refused_for_space<T>(r: dinomo_dpm_node::Result<T>) -> bool {
    match r {
        Ok(_) => false,
        Err(DpmError::PoolFull { .. }) => true,
        Err(e) => panic!("append: {e}"),
    }
}

fn record(k: u32, w: W) -> LogRecord {
    LogRecord {
        op: if w.len == 0 {
            LogOp::Delete
        } else {
            LogOp::Put
        },
        version: w.version,
        key: key(k),
        value: if w.len == 0 { vec![] } else { value(k, w) },
    }
}

/// Spreads `k` crash points over persists `1..=count` of a phase, each at a random place in
/// its stretch.
fn spread(rng: &mut StdRng, count: u64, k: u64) -> HashSet<u64> {
    if k >= count {
        return (1..=count).collect();
    }
    (0..k)
        .map(|j| {
            let lo = j * count / k;
            let hi = ((j + 1) * count / k).max(lo + 1);
            1 + rng.random_range(lo..hi)
        })
        .collect()
}

fn plan(
    counts: &BTreeMap<Phase, u64>,
    total: u64,
    rng: &mut StdRng,
) -> (Plan, BTreeMap<Phase, u64>) {
    let sum_w: u64 = PHASES
        .iter()
        .filter(|p| counts.get(p).copied().unwrap_or(0) > 0)
        .map(|&p| weight(p))
        .sum();
    let mut want: BTreeMap<Phase, u64> = PHASES
        .iter()
        .map(|&p| {
            let have = counts.get(&p).copied().unwrap_or(0);
            (p, (total * weight(p)).div_ceil(sum_w.max(1)).min(have))
        })
        .collect();
    // Phases with fewer persists than their share leave the rest to the others.
    loop {
        let short = total.saturating_sub(want.values().sum());
        let open: Vec<Phase> = PHASES
            .iter()
            .copied()
            .filter(|p| want[p] < counts.get(p).copied().unwrap_or(0))
            .collect();
        if short == 0 || open.is_empty() {
            break;
        }
        let each = short.div_ceil(open.len() as u64);
        for p in open {
            let have = counts[&p];
            let w = want.get_mut(&p).unwrap();
            *w = (*w + each).min(have);
        }
    }
    let at = want
        .iter()
        .map(|(&p, &k)| (p, spread(rng, counts.get(&p).copied().unwrap_or(0), k)))
        .collect();
    (Plan { at }, want)
}

/// What the checker found over every image.
#[derive(Debug, Default)]
struct Findings {
    images: u64,
    by_phase: BTreeMap<Phase, u64>,
    steps: Vec<u64>,
    lines: PowerLossStats,
    acked_checked: u64,
    lost: u64,
    unexpected: u64,
    failed_opens: u64,
    index_errors: u64,
    accounting_errors: u64,
    /// Crash points with a problem.
    failed_images: u64,
    /// The first few, each with its first problems.
    failures: Vec<String>,
}

/// Failing images kept on disk (each up to a pool's size) and failures described in full.
const KEEP_FAILING_IMAGES: u64 = 5;
const DESCRIBE_FAILURES: usize = 10;

impl Findings {
    fn fail(&mut self, c: &Crash, keep: &Path, problems: &[String]) {
        self.failed_images += 1;
        let kept = if self.failed_images <= KEEP_FAILING_IMAGES {
            let path = keep.join(format!("persist-{}-seed-{:x}.pool", c.persist, c.seed));
            std::fs::create_dir_all(keep).unwrap();
            c.image.write_to(&path).unwrap();
            format!("kept at {}", path.display())
        } else {
            "not kept".to_string()
        };
        if self.failures.len() < DESCRIBE_FAILURES {
            self.failures.push(format!(
                "crash at persist {} (phase {:?}, workload step {}, image seed {:#x}, {kept}): \
                 {} problems, first: {}",
                c.persist,
                c.phase,
                c.step,
                c.seed,
                problems.len(),
                problems[..problems.len().min(3)].join(" | ")
            ));
        }
    }
}

/// Opens every crash image it receives as a pool and checks it.
fn checker(rx: Receiver<Crash>, work: PathBuf, keep: PathBuf) -> Findings {
    let mut f = Findings::default();
    for c in rx {
        f.images += 1;
        *f.by_phase.entry(c.phase).or_insert(0) += 1;
        f.steps.push(c.step);
        f.lines.add(&c.image.stats);
        let dir = work.join("img");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        c.image.write_to(&dir.join("pool")).unwrap();
        let problems = check_image(&dir, &c, &mut f);
        if !problems.is_empty() {
            f.fail(&c, &keep, &problems);
        }
    }
    f
}

fn check_image(dir: &Path, c: &Crash, f: &mut Findings) -> Vec<String> {
    let mut problems = Vec::new();
    // The pool's sizes come from its superblock; the configured ones are not used.
    let dpm = match Dpm::open(base_config(dir, "16MiB", "process-crash", false)) {
        Ok(d) => d,
        Err(e) => {
            f.failed_opens += 1;
            return vec![format!("the pool does not open: {e}")];
        }
    };
    for kn in KNS {
        if let Err(e) = dpm.merge_all(kn, true) {
            f.failed_opens += 1;
            problems.push(format!("MergeAll of KN {kn} failed: {e}"));
            return problems;
        }
    }
    check_contents(&dpm, c, f, &mut problems, "after MergeAll", true);
    check_index_walk(&dpm, f, &mut problems);
    if let Err(e) = dpm.check_accounting() {
        f.accounting_errors += 1;
        problems.push(format!("live bytes after MergeAll: {e}"));
    }
    // The counters decide what garbage collection frees: one pass over the recovered pool, and
    // everything must still be there.
    match dpm.gc().run_once() {
        Ok(_) => {
            if let Err(e) = dpm.check_accounting() {
                f.accounting_errors += 1;
                problems.push(format!("live bytes after a GC pass: {e}"));
            }
            check_contents(&dpm, c, f, &mut problems, "after a GC pass", false);
        }
        Err(e) => problems.push(format!("a GC pass over the recovered pool failed: {e}")),
    }
    dpm.shutdown();
    problems
}

/// `count`: add the acknowledged writes checked to the totals (once per image).
fn check_contents(
    dpm: &Dpm,
    c: &Crash,
    f: &mut Findings,
    problems: &mut Vec<String>,
    when: &str,
    count: bool,
) {
    for (i, h) in c.ledger.keys.iter().enumerate() {
        let i = i as u32;
        let found = match dpm.lookup(&key(i)) {
            Ok(v) => v.map(|x| x.value),
            Err(e) => {
                f.index_errors += 1;
                problems.push(format!("{when}: lookup of k{i} failed: {e}"));
                continue;
            }
        };
        f.acked_checked += u64::from(count && h.acked.is_some());
        if !allowed(h, found.as_deref(), |w| value(i, w)) {
            if h.acked.is_some() {
                f.lost += 1;
            } else {
                f.unexpected += 1;
            }
            problems.push(format!(
                "{when}: k{i} is {:?}, acknowledged {:?}, attempted after {:?}",
                found.as_deref().map(String::from_utf8_lossy),
                h.acked,
                h.pending
            ));
        }
    }
    for (i, h) in c.ledger.meta.iter().enumerate() {
        let i = i as u32;
        let found = dpm.get_metadata(&meta_name(i));
        f.acked_checked += u64::from(count && h.acked.is_some());
        if !allowed(h, found.as_deref(), |w| meta_value(i, w)) {
            if h.acked.is_some() {
                f.lost += 1;
            } else {
                f.unexpected += 1;
            }
            problems.push(format!(
                "{when}: metadata {} is {:?}, acknowledged {:?}, attempted after {:?}",
                meta_name(i),
                found.as_deref().map(String::from_utf8_lossy),
                h.acked,
                h.pending
            ));
        }
    }
}

/// Walks the index as a KN reads it: each slot's entry is fetched and decoded, and must hold a
/// key of the slot's hash; no key is indexed twice.
fn check_index_walk(dpm: &Dpm, f: &mut Findings, problems: &mut Vec<String>) {
    let mut seen = HashSet::new();
    let mut bad = Vec::new();
    let walk = dpm.index().for_each(|hash, p: EntryPtr| {
        if bad.len() >= 3 {
            return;
        }
        let len = if p.len == 0 { 4096 } else { u64::from(p.len) };
        let bytes = match dpm.pool().view(p.offset, len) {
            Ok(b) => b,
            Err(e) => return bad.push(format!("slot entry {p:?} out of the pool: {e}")),
        };
        match decode_entry(bytes) {
            Ok((e, _)) => {
                if dinomo_layout::key_hash(e.key) != hash {
                    bad.push(format!(
                        "entry {p:?} of key {:?} is in a slot of another hash",
                        e.key
                    ));
                } else if !seen.insert(e.key.to_vec()) {
                    bad.push(format!(
                        "key {:?} is indexed twice",
                        String::from_utf8_lossy(e.key)
                    ));
                }
            }
            Err(e) => bad.push(format!("slot entry {p:?} does not decode: {e}")),
        }
    });
    if let Err(e) = walk {
        bad.push(format!("the index walk failed: {e}"));
    }
    if !bad.is_empty() {
        f.index_errors += 1;
        problems.extend(bad.into_iter().map(|b| format!("index: {b}")));
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| {
            let v = v.trim();
            v.strip_prefix("0x")
                .map_or_else(|| v.parse().ok(), |h| u64::from_str_radix(h, 16).ok())
        })
        .unwrap_or(default)
}

fn fresh_shared(
    p: Profile,
    seed: u64,
    plan: Option<Plan>,
    tx: Option<SyncSender<Crash>>,
) -> Arc<Shared> {
    Arc::new(Shared {
        phase: AtomicU8::new(Phase::Register as u8),
        step: AtomicU64::new(0),
        counts: Mutex::new(BTreeMap::new()),
        ledger: Mutex::new(Ledger {
            keys: vec![History::default(); p.keys as usize],
            meta: vec![History::default(); META_NAMES as usize],
        }),
        plan,
        tx: Mutex::new(tx),
        base_seed: seed,
    })
}

#[tokio::test]
async fn acknowledged_writes_survive_simulated_power_loss() {
    power_loss_test(MIXED).await;
}

#[tokio::test]
async fn acknowledged_writes_survive_power_loss_while_the_pool_fills() {
    power_loss_test(FILLING).await;
}

async fn power_loss_test(p: Profile) {
    let seed = env_u64("DINOMO_POWERLOSS_SEED", DEFAULT_SEED);
    let crashes = env_u64("DINOMO_POWERLOSS_CRASHES", p.crashes);
    let start = Instant::now();
    // Images are written and opened in memory-backed files when /dev/shm is there.
    let scratch = if Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm").unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };

    // Pass one: how many persists each phase makes.
    let counting = fresh_shared(p, seed, None, None);
    let one = workload(&scratch.path().join("one"), p, seed, counting.clone()).await;
    let counts = counting.counts.lock().clone();
    let (plan, wanted) = plan(&counts, crashes, &mut StdRng::seed_from_u64(seed ^ 1));
    let pass_one = start.elapsed();

    // Pass two: the same workload, with crash images at the planned persists.
    let (tx, rx) = sync_channel(2);
    let work = scratch.path().join("check");
    let keep = std::env::temp_dir().join(format!("dinomo-powerloss-{}-{seed:x}", p.name));
    let checker = std::thread::spawn(move || checker(rx, work, keep));
    let imaging = fresh_shared(p, seed, Some(plan), Some(tx));
    let two = workload(&scratch.path().join("two"), p, seed, imaging.clone()).await;
    imaging.tx.lock().take();
    let f = checker.join().unwrap();
    let elapsed = start.elapsed();

    let during = |steps: &HashSet<u64>| f.steps.iter().filter(|s| steps.contains(s)).count();
    let name = p.name;
    println!(
        "[{name}] seed {seed:#x}: {} persists in pass one ({:.1?}), {} in pass two; pass two: \
         {}; GC freed {} segments, cleaned {} ({} entries moved); pool full: {} appends \
         refused, {} other operations",
        one.persists,
        pass_one,
        two.persists,
        two.final_stats,
        two.gc.0,
        two.gc.1,
        two.gc.2,
        two.full_appends,
        two.full_other
    );
    println!("[{name}] persists per phase (pass one): {counts:?}");
    println!("[{name}] crash points planned per phase: {wanted:?}");
    println!(
        "[{name}] crash points: {} (images by phase: {:?})",
        f.images, f.by_phase
    );
    println!(
        "[{name}] crash points in steps where the index grew: {} ({} such steps); in GC \
         passes that cleaned: {}; that freed: {}; in steps that found the pool full: {}",
        during(&two.grew),
        two.grew.len(),
        during(&two.cleaned),
        during(&two.freed),
        during(&two.full)
    );
    println!(
        "[{name}] lines: {} differing from the persisted state, {} dropped, {} kept, {} torn",
        f.lines.differing, f.lines.dropped, f.lines.kept, f.lines.torn
    );
    println!(
        "[{name}] acknowledged writes checked: {}; lost: {}; unexpected values: {}; failed \
         opens: {}; index errors: {}; accounting errors: {}; failing crash points: {}; total \
         {:.1?}",
        f.acked_checked,
        f.lost,
        f.unexpected,
        f.failed_opens,
        f.index_errors,
        f.accounting_errors,
        f.failed_images,
        elapsed
    );
    for p in &f.failures {
        println!("[{name}] FAILURE {p}");
    }
    assert!(
        f.failed_images == 0,
        "{} of {} crash points failed, first: {:?}",
        f.failed_images,
        f.images,
        f.failures.first()
    );
    // The crash points are planned from a counting run and taken in a replay; background
    // merges race with the explicit ones, so the replay's persists per phase differ a little
    // and some planned points never come (356 of 400 were taken once on a loaded CI machine,
    // with nothing lost): the floor is 80%, not 90%.
    assert!(
        f.images >= crashes * 4 / 5,
        "only {} crash images of {crashes} planned",
        f.images
    );
    assert!(
        f.lines.dropped > 0 && f.lines.kept > 0 && f.lines.torn > 0,
        "the simulation did nothing: {:?}",
        f.lines
    );
    assert!(
        two.resizes >= 3,
        "the index grew only {} times",
        two.resizes
    );
    assert!(
        during(&two.grew) > 0 && during(&two.cleaned) > 0,
        "no crash point while the index grew or while GC cleaned"
    );
    if p.expect_full {
        assert!(
            during(&two.full) > 0,
            "no crash point while the pool was full ({} appends refused)",
            two.full_appends
        );
    }
    // Background merges race with the explicit ones (whichever takes a sealed segment first
    // merges it), so some seeds have none; every phase the driver runs must be covered.
    for p in PHASES.into_iter().filter(|&p| p != Phase::BackgroundMerge) {
        assert!(
            f.by_phase.get(&p).copied().unwrap_or(0) > 0,
            "no crash point in phase {p:?}"
        );
    }
}
