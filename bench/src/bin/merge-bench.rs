//! merge-bench: DINOMO Figure 4 scaled to one machine: how fast the DPM's merge workers fold
//! KN logs into the index, against the rate at which KNs can write logs when they never wait
//! for merging ("log-write max").
//!
//! Workload (as in the paper): insert-only, 8-byte keys, 1 KiB values (`--value-size`), each KN
//! logging batches of `--batch` entries, one WRITE per batch, through the fabric. Every key is
//! written once; KN `j` of `K` owns the keys `j, j+K, j+2K, ...` (ownership partitioning).
//!
//! Phases, each on a fresh pool:
//! 1. log-write max, once over shm and once over tcp: `--kns` writer tasks (one registered KN
//!    each) write `--entries` entries in total as fast as they can. Segments are allocated from
//!    the DPM as they fill, as a KN does, but their seals are *deferred*: the writers' segment
//!    source only records them, so every segment stays open while the clock runs and the merge
//!    workers (which skip open segments) never run. That `entries_merged` is still 0 when the
//!    clock stops is checked. Nothing is merged afterwards: the pool is thrown away.
//! 2. merge, once per `--workers` count: the logs (`--entries` entries over `--kns` chains) are
//!    generated over shm the same way (untimed), then the clock starts, every segment is sealed
//!    (in chain order) and the clock stops when the DPM's background merge workers have left no
//!    pending segment. That is the path the DPM runs; it merges the chains of different KNs in
//!    parallel, one worker per chain at a time, so at most min(workers, kns) chains are merged
//!    at once. After each run, `--check-keys` random keys are looked up through `Dpm::lookup`
//!    and compared with what was written; a mismatch makes the program exit non-zero.
//!
//! The clock of a merge run stops when the index holds every key (a lock-free counter) and
//! `stats()` then shows no pending segment: polling `stats()` in a loop would take the chain
//! locks, which makes a merge worker that finds a chain locked skip it and nap.
//!
//! Each fresh pool's segment area is zero-filled before use (`--no-prefault` to skip), so that
//! the timed writes do not pay first-touch page-cache allocation, which registered RDMA memory
//! never does. Index-heap pages are left to the DPM (its table creation zero-fills them).
//!
//! Every row is measured `--repeat` times, rounds interleaved (all rows, then all rows again),
//! each on a fresh pool; the table shows medians and the min..max spread. Absolute numbers on a
//! small shared VM are noisy; read the ratios within one run. On 2 cores 4 merge workers cannot
//! scale beyond 2.
//!
//! `cargo run --release -p dinomo-bench --bin merge-bench -- --help`

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use async_trait::async_trait;
use clap::Parser;
use dinomo_bench::{human_size, thousands, write_json, Align, Table};
use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::segments::SegmentGrant;
use dinomo_dpm_node::testkit::{LogRecord, LogWriter, SegmentSource};
use dinomo_dpm_node::Dpm;
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::tcp::{TcpFabric, TcpNic};
use dinomo_fabric::{DurabilityRequest, Fabric};
use dinomo_layout::log::{batch_len, entry_len, LogOp};
use dinomo_layout::meta::Roots;
use dinomo_layout::segment::HEADER_SIZE;
use dinomo_layout::superblock::Superblock;
use dinomo_node_common::config::ByteSize;
use dinomo_node_common::parse_size;
use rand::Rng as _;
use serde::Serialize;

/// Key size of the workload (the paper's 8-byte keys).
const KEY_SIZE: usize = 8;
const METADATA_LEN: u64 = 1 << 20;
const MAX_CELLS: u64 = 64;
/// Split threshold of the index (items per bucket), to estimate the index space needed.
const INDEX_MAX_LOAD: f64 = 2.25;
const INDEX_BUCKET: u64 = 64;
/// Longest a merge run may take before the program gives up.
const MERGE_TIMEOUT: Duration = Duration::from_secs(600);
/// Never-written keys looked up by the correctness check (must not be found).
const ABSENT_KEYS: u64 = 10;

const WRITE_NOTE: &str = "log-write max: segments are allocated as they fill but their seals \
are deferred until the clock stops, so every segment stays open and the merge workers (which \
skip open segments) never run; entries_merged = 0 is checked when the clock stops";

const MERGE_NOTE: &str = "merge: logs pre-generated over shm with merging off (untimed); the \
clock covers sealing every segment and the DPM's background merge workers draining them \
(pending_segments all zero)";

const NOISE_NOTE: &str = "absolute numbers on a small shared VM are noisy from run to run; \
read the ratios measured within this one run";

#[derive(Parser, Debug)]
#[command(
    name = "merge-bench",
    about = "DINOMO Figure 4: DPM merge throughput vs the KNs' log-write max rate"
)]
struct Args {
    /// Entries written per log-write run and merged per merge run (total over all KNs).
    #[arg(long, default_value_t = 400_000)]
    entries: u64,

    /// Writer KNs (one log chain each).
    #[arg(long, default_value_t = 4)]
    kns: u32,

    /// Entries per batch (one WRITE).
    #[arg(long, default_value_t = 16)]
    batch: usize,

    /// Value size in bytes (keys are 8 bytes).
    #[arg(long, default_value_t = 1024)]
    value_size: usize,

    /// Merge worker counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    workers: Vec<usize>,

    /// Directory for the pool files (default: a fresh temporary directory). Pass a directory on
    /// a DAX mount to measure real persistent memory.
    #[arg(long)]
    pool_dir: Option<PathBuf>,

    /// Log segment size (a power of two >= 64KiB).
    #[arg(long, default_value = "8MiB")]
    segment_size: String,

    /// Pool size (default: 1GiB, grown when the logs and the index would not fit).
    #[arg(long)]
    pool_size: Option<String>,

    /// Buckets of the first index table; the index resizes (doubles) as the merge fills it.
    #[arg(long, default_value_t = 16384)]
    initial_buckets: u64,

    /// Durability of the pool mapping: auto (DAX when MAP_SYNC works), dax, msync, process-crash.
    #[arg(long, default_value = "auto")]
    durability: String,

    /// Measurements of every row, each on a fresh pool, interleaved round by round; the table
    /// shows the median (and the spread).
    #[arg(long, default_value_t = 7)]
    repeat: usize,

    /// Do not pre-fault the segment area of each new pool before it is written (by default it
    /// is zero-filled first, so that first-touch page faults, which registered RDMA memory
    /// does not take, are not timed).
    #[arg(long)]
    no_prefault: bool,

    /// Random keys looked up and compared with what was written, after each merge run.
    #[arg(long, default_value_t = 1000)]
    check_keys: usize,

    /// Tokio worker threads (writer tasks and the in-process tcp NIC share them).
    #[arg(long, default_value_t = 2)]
    threads: usize,

    /// Also write the figures, with the configuration, as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// A segment source that hands out segments like `LocalSource` but only records seals, so that
/// nothing becomes mergeable until [`DeferredSeals::seal_all`].
#[derive(Debug)]
struct DeferredSeals {
    dpm: Arc<Dpm>,
    kn: u32,
    epoch: u64,
    deferred: std::sync::Mutex<Vec<u64>>,
}

#[async_trait]
impl SegmentSource for DeferredSeals {
    async fn allocate(&self) -> dinomo_dpm_node::Result<SegmentGrant> {
        self.dpm.allocate_segment(self.kn, 0, self.epoch, false)
    }

    async fn seal(&self, segment: u64) -> dinomo_dpm_node::Result<u64> {
        self.deferred.lock().expect("not poisoned").push(segment);
        Ok(self.dpm.pending_segments(self.kn))
    }
}

impl DeferredSeals {
    /// Seals every recorded segment, in chain order.
    fn seal_all(&self) -> Result<usize> {
        let segs = std::mem::take(&mut *self.deferred.lock().expect("not poisoned"));
        for &s in &segs {
            self.dpm
                .seal_segment(self.kn, self.epoch, s)
                .with_context(|| format!("sealing segment {s} of KN {}", self.kn))?;
        }
        Ok(segs.len())
    }
}

/// The value written for key `id`: the key's bytes at both ends, a fixed pattern between.
fn fill_value(buf: &mut [u8], id: u64) {
    let k = id.to_le_bytes();
    let head = buf.len().min(KEY_SIZE);
    buf[..head].copy_from_slice(&k[..head]);
    if buf.len() >= 2 * KEY_SIZE {
        let n = buf.len();
        buf[n - KEY_SIZE..].copy_from_slice(&k);
    }
}

fn value_template(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ 0x5a)
        .collect()
}

fn key_of(id: u64) -> [u8; KEY_SIZE] {
    id.to_le_bytes()
}

/// Keys owned by KN index `j` of `kns`: `j, j+kns, ...` below `total`.
fn keys_of(j: u32, kns: u32, total: u64) -> u64 {
    let (j, k) = (u64::from(j), u64::from(kns));
    if j >= total {
        0
    } else {
        (total - j).div_ceil(k)
    }
}

#[derive(Debug)]
struct WriterOut {
    kn: u32,
    entries: u64,
    bytes_written: u64,
    started: Instant,
    finished: Instant,
    source: Arc<DeferredSeals>,
}

/// Forwards to a shared [`DeferredSeals`], so that the caller keeps it after the writer is gone.
#[derive(Debug)]
struct Shared(Arc<DeferredSeals>);

#[async_trait]
impl SegmentSource for Shared {
    async fn allocate(&self) -> dinomo_dpm_node::Result<SegmentGrant> {
        self.0.allocate().await
    }
    async fn seal(&self, segment: u64) -> dinomo_dpm_node::Result<u64> {
        self.0.seal(segment).await
    }
}

#[derive(Debug, Clone, Copy)]
struct Shape {
    kns: u32,
    total: u64,
    batch: usize,
    value_size: usize,
}

/// One KN: writes its keys in batches as fast as it can; the last segment's seal is deferred too.
async fn write_log<F: Fabric>(
    mut w: LogWriter<F, Shared>,
    j: u32,
    shape: Shape,
    start: Arc<tokio::sync::Barrier>,
) -> Result<WriterOut> {
    let count = keys_of(j, shape.kns, shape.total);
    let template = value_template(shape.value_size);
    let mut recs: Vec<LogRecord> = (0..shape.batch)
        .map(|_| LogRecord {
            op: LogOp::Put,
            version: 0,
            key: vec![0; KEY_SIZE],
            value: template.clone(),
        })
        .collect();
    let mut id = u64::from(j);
    let mut left = count;
    start.wait().await;
    let started = Instant::now();
    while left > 0 {
        let n = (shape.batch as u64).min(left) as usize;
        for r in &mut recs[..n] {
            r.key.copy_from_slice(&key_of(id));
            fill_value(&mut r.value, id);
            r.version = id + 1;
            id += u64::from(shape.kns);
        }
        w.append(&recs[..n]).await?;
        left -= n as u64;
        // Let every KN task progress (on shm a WRITE completes without yielding).
        tokio::task::yield_now().await;
    }
    w.seal().await?;
    let finished = Instant::now();
    let bytes_written = w.fabric().stats().snapshot().bytes_written;
    Ok(WriterOut {
        kn: w.source().0.kn,
        entries: count,
        bytes_written,
        started,
        finished,
        source: w.source().0.clone(),
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Shm,
    Tcp,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Shm => "shm",
            Backend::Tcp => "tcp",
        }
    }
}

/// What all KNs of one write run did.
#[derive(Debug)]
struct WriteRun {
    entries: u64,
    log_bytes: u64,
    elapsed: Duration,
    sources: Vec<Arc<DeferredSeals>>,
}

/// Registers `shape.kns` KNs and has them write their logs over `backend`, timed from the
/// common start to the last KN's end. Seals stay deferred.
async fn write_logs(dpm: &Arc<Dpm>, backend: Backend, shape: Shape) -> Result<WriteRun> {
    let durability: DurabilityRequest = dpm.config.durability;
    let nic = match backend {
        Backend::Shm => None,
        Backend::Tcp => {
            let addr: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
            Some(
                TcpNic::start(addr, dpm.pool().region().clone(), dpm.grants().clone())
                    .await
                    .context("starting the tcp fabric NIC")?,
            )
        }
    };
    let start = Arc::new(tokio::sync::Barrier::new(shape.kns as usize));
    let mut tasks = Vec::new();
    for j in 0..shape.kns {
        let reg = dpm
            .register_kn(Some(j), "merge-bench")
            .with_context(|| format!("registering KN {j}"))?;
        let source = Shared(Arc::new(DeferredSeals {
            dpm: dpm.clone(),
            kn: j,
            epoch: reg.epoch,
            deferred: std::sync::Mutex::new(Vec::new()),
        }));
        let start = start.clone();
        let task = match &nic {
            None => {
                let f = ShmFabric::connect(&dpm.config.pool_path, reg.key, durability)
                    .context("mapping the pool (shm fabric)")?;
                let w = LogWriter::new(f, source);
                tokio::spawn(write_log(w, j, shape, start))
            }
            Some(nic) => {
                let f = TcpFabric::connect(nic.local_addr(), reg.key)
                    .await
                    .context("connecting to the tcp fabric NIC")?;
                let w = LogWriter::new(f, source);
                tokio::spawn(write_log(w, j, shape, start))
            }
        };
        tasks.push(task);
    }
    let mut outs = Vec::new();
    for t in tasks {
        outs.push(t.await.context("a writer task panicked")??);
    }
    drop(nic);
    let first = outs
        .iter()
        .map(|o| o.started)
        .min()
        .expect("at least one KN");
    let last = outs
        .iter()
        .map(|o| o.finished)
        .max()
        .expect("at least one KN");
    outs.sort_by_key(|o| o.kn);
    Ok(WriteRun {
        entries: outs.iter().map(|o| o.entries).sum(),
        log_bytes: outs.iter().map(|o| o.bytes_written).sum(),
        elapsed: last - first,
        sources: outs.into_iter().map(|o| o.source).collect(),
    })
}

/// Everything needed to open a fresh pool.
#[derive(Debug, Clone)]
struct PoolPlan {
    pool_size: u64,
    segment_size: u64,
    segments_needed: u64,
    durability: String,
    initial_buckets: u64,
    prefault: bool,
    pool_dir: Option<PathBuf>,
}

/// A fresh pool in its own directory, removed when dropped (after the DPM is shut down).
#[derive(Debug)]
struct Fresh {
    dpm: Arc<Dpm>,
    _dir: tempfile::TempDir,
}

impl Drop for Fresh {
    fn drop(&mut self) {
        self.dpm.shutdown();
    }
}

fn open_fresh(plan: &PoolPlan, merge_workers: usize) -> Result<Fresh> {
    let b = {
        let mut b = tempfile::Builder::new();
        b.prefix("merge-bench");
        b
    };
    let dir = match &plan.pool_dir {
        Some(d) => b
            .tempdir_in(d)
            .with_context(|| format!("creating a directory in {}", d.display()))?,
        None => b.tempdir().context("creating a temporary directory")?,
    };
    let cfg = DpmConfigFile {
        pool_size: ByteSize(plan.pool_size),
        segment_size: ByteSize(plan.segment_size),
        metadata_size: ByteSize(METADATA_LEN),
        durability: plan
            .durability
            .parse()
            .map_err(|e| anyhow::anyhow!("--durability: {e}"))?,
        merge_workers,
        initial_index_buckets: plan.initial_buckets,
        ..DpmConfigFile::in_process(dir.path().join("pool"))
    }
    .validate()
    .context("DPM configuration")?;
    let dpm = Dpm::open(cfg).context("opening the DPM")?;
    if plan.prefault {
        // Zero-fill the (free, never written) segment area so that the timed writes do not
        // allocate page-cache pages on first touch.
        let sb = *dpm.pool().superblock();
        let region = dpm.pool().region();
        let zeros = vec![0u8; 1 << 20];
        let mut at = sb.segments_off;
        while at < sb.pool_len {
            let n = (sb.pool_len - at).min(zeros.len() as u64);
            region.write(at, &zeros[..n as usize])?;
            at += n;
        }
    }
    Ok(Fresh { dpm, _dir: dir })
}

/// One measurement of one row.
#[derive(Debug, Clone, Default)]
struct Sample {
    entries: u64,
    log_bytes: u64,
    elapsed: Duration,
    merged_during_write: Option<u64>,
    index_items: Option<u64>,
    index_buckets: Option<u64>,
    index_resizes: Option<u64>,
    segments_merged: Option<u64>,
    check_sampled: Option<usize>,
    check_failed: Option<usize>,
}

impl Sample {
    fn rate(&self) -> f64 {
        self.entries as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// What a row measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Write(Backend),
    Merge(usize),
}

impl Kind {
    fn name(self) -> String {
        match self {
            Kind::Write(b) => format!("log-write max ({})", b.name()),
            Kind::Merge(1) => "merge 1 worker".into(),
            Kind::Merge(w) => format!("merge {w} workers"),
        }
    }
}

/// One row of the report: the median over its samples.
#[derive(Debug, Clone, Serialize)]
struct Row {
    name: String,
    /// "log-write" or "merge".
    phase: &'static str,
    backend: Option<&'static str>,
    merge_workers: Option<usize>,
    /// Entries per sample.
    entries: u64,
    /// Bytes of log (entries plus batch framing) written or merged per sample.
    log_bytes: u64,
    samples: usize,
    /// Median over the samples.
    elapsed_s: f64,
    /// Median over the samples.
    entries_per_sec: f64,
    entries_per_sec_min: f64,
    entries_per_sec_max: f64,
    /// Every sample, in the order measured.
    entries_per_sec_samples: Vec<f64>,
    /// Log megabytes (10^6 bytes) per second, at the median rate.
    mb_per_sec: f64,
    /// Median entries/s over the median of log-write max (shm).
    ratio_to_write_max_shm: f64,
    /// Largest number of entries merged by the DPM when a write clock stopped (must be 0).
    merged_during_write: Option<u64>,
    index_items: Option<u64>,
    index_buckets: Option<u64>,
    index_resizes: Option<u64>,
    segments_merged: Option<u64>,
    /// Keys looked up over all samples.
    check_sampled: Option<usize>,
    /// Problems found over all samples (0: correct).
    check_failed: Option<usize>,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn sum_opt<T: Copy + std::iter::Sum<T>>(v: impl Iterator<Item = Option<T>>) -> Option<T> {
    let all: Vec<T> = v.flatten().collect();
    (!all.is_empty()).then(|| all.into_iter().sum())
}

fn row_of(kind: Kind, samples: &[Sample]) -> Row {
    let rates: Vec<f64> = samples.iter().map(Sample::rate).collect();
    let times: Vec<f64> = samples.iter().map(|s| s.elapsed.as_secs_f64()).collect();
    let last = samples.last().cloned().unwrap_or_default();
    let rate = median(&rates);
    let per_entry = last.log_bytes as f64 / (last.entries.max(1)) as f64;
    Row {
        name: kind.name(),
        phase: match kind {
            Kind::Write(_) => "log-write",
            Kind::Merge(_) => "merge",
        },
        backend: match kind {
            Kind::Write(b) => Some(b.name()),
            Kind::Merge(_) => None,
        },
        merge_workers: match kind {
            Kind::Write(_) => None,
            Kind::Merge(w) => Some(w),
        },
        entries: last.entries,
        log_bytes: last.log_bytes,
        samples: samples.len(),
        elapsed_s: median(&times),
        entries_per_sec: rate,
        entries_per_sec_min: rates.iter().copied().fold(f64::INFINITY, f64::min),
        entries_per_sec_max: rates.iter().copied().fold(0.0, f64::max),
        entries_per_sec_samples: rates,
        mb_per_sec: rate * per_entry / 1e6,
        ratio_to_write_max_shm: 0.0,
        merged_during_write: samples.iter().filter_map(|s| s.merged_during_write).max(),
        index_items: last.index_items,
        index_buckets: last.index_buckets,
        index_resizes: last.index_resizes,
        segments_merged: last.segments_merged,
        check_sampled: sum_opt(samples.iter().map(|s| s.check_sampled)),
        check_failed: sum_opt(samples.iter().map(|s| s.check_failed)),
    }
}

fn human_mb(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

async fn log_write_max(plan: &PoolPlan, shape: Shape, backend: Backend) -> Result<Sample> {
    let fresh = open_fresh(plan, 1)?;
    let run = write_logs(&fresh.dpm, backend, shape).await?;
    let merged = fresh.dpm.stats().entries_merged;
    ensure!(
        merged == 0,
        "{merged} entries were merged while the clock ran: merging was not off"
    );
    Ok(Sample {
        entries: run.entries,
        log_bytes: run.log_bytes,
        elapsed: run.elapsed,
        merged_during_write: Some(merged),
        ..Default::default()
    })
}

/// Looks up `n` random written keys (and a few never written) and compares them with what was
/// written. Returns the number of failures and prints the first few.
fn check_sample(dpm: &Dpm, shape: Shape, n: usize) -> Result<usize> {
    let mut rng = rand::rng();
    let template = value_template(shape.value_size);
    let mut failed = 0;
    let mut report = |what: String| {
        failed += 1;
        if failed <= 5 {
            eprintln!("  CHECK FAILED: {what}");
        }
    };
    for _ in 0..n {
        let id = rng.random_range(0..shape.total);
        let mut want = template.clone();
        fill_value(&mut want, id);
        match dpm.lookup(&key_of(id))? {
            None => report(format!("key {id} not found")),
            Some(f) if f.value != want => report(format!("key {id}: wrong value")),
            Some(f) if f.version != id + 1 => report(format!(
                "key {id}: version {} (wrote {})",
                f.version,
                id + 1
            )),
            Some(_) => {}
        }
    }
    for id in shape.total..shape.total + ABSENT_KEYS {
        if dpm.lookup(&key_of(id))?.is_some() {
            report(format!("key {id} was never written but is found"));
        }
    }
    Ok(failed)
}

async fn merge_run(
    plan: &PoolPlan,
    shape: Shape,
    workers: usize,
    check_keys: usize,
) -> Result<Sample> {
    let fresh = open_fresh(plan, workers)?;
    let dpm = &fresh.dpm;
    let gen_run = write_logs(dpm, Backend::Shm, shape).await?;
    let before = dpm.stats();
    ensure!(
        before.entries_merged == 0,
        "{} entries were merged while generating the logs",
        before.entries_merged
    );
    let pending: u64 = before.pending_segments.values().sum();

    let t0 = Instant::now();
    let mut sealed = 0;
    for s in &gen_run.sources {
        sealed += s.seal_all()?;
    }
    // Wait without touching the chain locks: a merge worker that finds a chain locked (by
    // `stats()`) skips it and may nap, so polling `stats()` would perturb the measurement.
    // The index's item count is lock-free; once every key is in, `stats()` confirms that no
    // segment is pending (waiting for the workers to finish their bookkeeping).
    loop {
        if dpm.index().items() >= shape.total {
            let s = dpm.stats();
            if s.pending_segments.values().all(|&p| p == 0) {
                break;
            }
        }
        ensure!(
            t0.elapsed() < MERGE_TIMEOUT,
            "merge with {workers} workers not done after {MERGE_TIMEOUT:?}: {:?}",
            dpm.stats().pending_segments
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = t0.elapsed();
    ensure!(
        sealed as u64 == pending,
        "sealed {sealed} segments but {pending} were pending"
    );

    let st = dpm.stats();
    let mut failed = check_sample(dpm, shape, check_keys)?;
    if st.entries_merged != shape.total {
        eprintln!(
            "  CHECK FAILED: {} entries merged, {} written",
            st.entries_merged, shape.total
        );
        failed += 1;
    }
    if st.index_items != shape.total {
        eprintln!(
            "  CHECK FAILED: the index holds {} items, {} keys were written",
            st.index_items, shape.total
        );
        failed += 1;
    }
    Ok(Sample {
        entries: st.entries_merged,
        log_bytes: gen_run.log_bytes,
        elapsed,
        index_items: Some(st.index_items),
        index_buckets: Some(st.index_buckets),
        index_resizes: Some(st.index_resizes),
        segments_merged: Some(sealed as u64),
        check_sampled: Some(check_keys),
        check_failed: Some(failed),
        ..Default::default()
    })
}

/// Sizes the pool so that the logs of one run and the index fit.
fn plan_pool(args: &Args, shape: Shape) -> Result<PoolPlan> {
    let segment_size = parse_size(&args.segment_size)
        .map_err(anyhow::Error::msg)
        .context("--segment-size")?;
    let batch_bytes = batch_len(shape.batch * entry_len(KEY_SIZE, shape.value_size)) as u64;
    ensure!(
        HEADER_SIZE as u64 + batch_bytes <= segment_size,
        "a batch of {} entries ({batch_bytes} bytes) does not fit a segment of {}",
        shape.batch,
        human_size(segment_size)
    );
    let per_segment = (segment_size - HEADER_SIZE as u64) / batch_bytes;
    let segments_needed: u64 = (0..shape.kns)
        .map(|j| {
            keys_of(j, shape.kns, shape.total)
                .div_ceil(shape.batch as u64)
                .div_ceil(per_segment)
        })
        .sum::<u64>()
        + 4;
    // Home buckets plus overflow buckets, generously; the index lives in segments.
    let final_buckets = ((shape.total as f64 / INDEX_MAX_LOAD) as u64 + 1)
        .next_power_of_two()
        .max(args.initial_buckets.next_power_of_two());
    let index_needed = 2 * final_buckets * INDEX_BUCKET + 2 * segment_size;
    let index_segments = index_needed.div_ceil(segment_size);
    let fits = |len: u64| -> Result<bool> {
        let sb = Superblock::plan(len, segment_size, METADATA_LEN, MAX_CELLS)
            .map_err(|e| anyhow::anyhow!("pool plan: {e}"))?;
        // A quarter of the segments may be kept in reserve (Reserves::for_pool).
        Ok(sb.segment_count * 3 / 4 >= segments_needed + index_segments)
    };
    let pool_size = match &args.pool_size {
        Some(s) => {
            let len = parse_size(s)
                .map_err(anyhow::Error::msg)
                .context("--pool-size")?;
            ensure!(
                fits(len)?,
                "--pool-size {s}: too small for {segments_needed} segments of {} and ~{} of index",
                human_size(segment_size),
                human_mb(index_needed)
            );
            len
        }
        None => {
            let mut len: u64 = 1 << 30;
            while !fits(len)? {
                len += 256 << 20;
            }
            len
        }
    };
    Ok(PoolPlan {
        pool_size,
        segment_size,
        segments_needed,
        durability: args.durability.clone(),
        initial_buckets: args.initial_buckets,
        prefault: !args.no_prefault,
        pool_dir: args.pool_dir.clone(),
    })
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    bench: &'static str,
    cores: usize,
    tokio_threads: usize,
    entries: u64,
    kns: u32,
    batch: usize,
    key_size: usize,
    value_size: usize,
    segment_size: u64,
    pool_size: u64,
    initial_index_buckets: u64,
    durability: String,
    prefault: bool,
    repeat: usize,
    pool_dir: Option<String>,
    write_note: &'static str,
    merge_note: &'static str,
    noise_note: &'static str,
    checks_ok: bool,
    rows: &'a [Row],
}

async fn run(args: Args, cores: usize) -> Result<bool> {
    ensure!(
        args.kns >= 1 && args.kns <= Roots::MAX_KNS,
        "--kns must be 1..={}",
        Roots::MAX_KNS
    );
    ensure!(args.batch >= 1, "--batch must be at least 1");
    ensure!(args.repeat >= 1, "--repeat must be at least 1");
    ensure!(
        args.entries >= u64::from(args.kns),
        "--entries must be at least --kns"
    );
    ensure!(!args.workers.is_empty(), "--workers is empty");
    if let Some(w) = args.workers.iter().find(|w| !(1..=64).contains(*w)) {
        bail!("--workers {w}: must be 1..=64");
    }
    let _: DurabilityRequest = args
        .durability
        .parse()
        .map_err(|e| anyhow::anyhow!("--durability: {e}"))?;
    let shape = Shape {
        kns: args.kns,
        total: args.entries,
        batch: args.batch,
        value_size: args.value_size,
    };
    let plan = plan_pool(&args, shape)?;
    // The durability the mapping really gets (auto resolves to DAX or process-crash).
    let durability = open_fresh(&plan, 1)?.dpm.pool().durability().to_string();

    println!("merge-bench: DINOMO Figure 4 (DPM merge throughput vs log-write max), insert-only");
    println!(
        "  {} entries per run, {} KNs, batches of {} entries (one WRITE each), {}-byte keys, \
         {}-byte values",
        thousands(args.entries as f64),
        args.kns,
        args.batch,
        KEY_SIZE,
        args.value_size,
    );
    println!(
        "  fresh pool of {} per measurement ({} segments of {} needed, {}), first index table \
         {} buckets; durability: {durability}",
        human_size(plan.pool_size),
        plan.segments_needed,
        human_size(plan.segment_size),
        if plan.prefault {
            "segment area pre-faulted"
        } else {
            "not pre-faulted"
        },
        args.initial_buckets,
    );
    println!(
        "  {} rounds, rows interleaved; the table shows medians. cores: {cores}; tokio threads: \
         {}",
        args.repeat, args.threads
    );
    let max_workers = args.workers.iter().copied().max().unwrap_or(1);
    if max_workers > cores {
        println!(
            "  WARNING: this machine has {cores} cores: {max_workers} merge workers cannot scale \
             beyond {cores}"
        );
    }
    if max_workers > args.kns as usize {
        println!(
            "  WARNING: one chain is merged by one worker at a time, so with {} KN chains at most \
             {} workers merge at once",
            args.kns, args.kns
        );
    }
    println!("  note: {NOISE_NOTE}");
    println!("  note: {WRITE_NOTE}");
    println!("  note: {MERGE_NOTE}");
    println!();

    let mut kinds = vec![Kind::Write(Backend::Shm), Kind::Write(Backend::Tcp)];
    kinds.extend(args.workers.iter().map(|&w| Kind::Merge(w)));
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); kinds.len()];
    for round in 1..=args.repeat {
        for (k, &kind) in kinds.iter().enumerate() {
            let s = match kind {
                Kind::Write(b) => log_write_max(&plan, shape, b).await?,
                Kind::Merge(w) => merge_run(&plan, shape, w, args.check_keys).await?,
            };
            let extra = match (s.index_resizes, s.index_items, s.check_failed) {
                (Some(z), Some(i), Some(f)) => format!(
                    "; {} segments; index {} items, {z} resizes; check {}",
                    s.segments_merged.unwrap_or(0),
                    thousands(i as f64),
                    if f == 0 {
                        format!("ok ({} keys + {ABSENT_KEYS} absent)", args.check_keys)
                    } else {
                        format!("FAILED ({f} problems)")
                    }
                ),
                _ => format!(
                    "; merged while timed: {}",
                    s.merged_during_write.unwrap_or(0)
                ),
            };
            eprintln!(
                "  round {round}/{}: {:<20} {:>11} entries/s  ({} entries, {} of log, {:.3} s{extra})",
                args.repeat,
                kind.name(),
                thousands(s.rate()),
                thousands(s.entries as f64),
                human_mb(s.log_bytes),
                s.elapsed.as_secs_f64(),
            );
            samples[k].push(s);
        }
    }
    let mut rows: Vec<Row> = kinds
        .iter()
        .zip(&samples)
        .map(|(&k, s)| row_of(k, s))
        .collect();
    let base = rows[0].entries_per_sec;
    for r in &mut rows {
        r.ratio_to_write_max_shm = r.entries_per_sec / base.max(1e-9);
    }

    let mut t = Table::new(&[
        ("", Align::Left),
        ("entries/s", Align::Right),
        ("MB/s", Align::Right),
        ("vs log-write max (shm)", Align::Right),
        ("min..max entries/s", Align::Right),
        ("resizes / items", Align::Right),
        ("check", Align::Left),
    ]);
    for r in &rows {
        t.row(vec![
            r.name.clone(),
            thousands(r.entries_per_sec),
            format!("{:.0}", r.mb_per_sec),
            format!("{:.2}x", r.ratio_to_write_max_shm),
            format!(
                "{}..{}",
                thousands(r.entries_per_sec_min),
                thousands(r.entries_per_sec_max)
            ),
            match (r.index_resizes, r.index_items) {
                (Some(z), Some(i)) => format!("{z} / {}", thousands(i as f64)),
                _ => "-".into(),
            },
            match (r.check_failed, r.merged_during_write) {
                (Some(0), _) => format!("ok ({} lookups)", r.check_sampled.unwrap_or(0)),
                (Some(f), _) => format!("FAILED ({f})"),
                (None, Some(0)) => "merged while timed: 0".into(),
                (None, Some(m)) => format!("MERGED WHILE TIMED: {m}"),
                (None, None) => String::new(),
            },
        ]);
    }
    println!();
    print!("{}", t.render());
    println!(
        "Medians of {} rounds. MB/s counts log bytes (entries plus batch framing; 1 MB = 10^6 B). \
         Ratios are median entries/s over the median of log-write max (shm) of this run.",
        args.repeat
    );

    let checks_ok = rows.iter().all(|r| r.check_failed.unwrap_or(0) == 0);
    println!(
        "correctness: {}",
        if checks_ok {
            "every merge run passed (sampled lookups, absent keys, item and merged-entry counts)"
        } else {
            "FAILED (see above)"
        }
    );
    if let Some(path) = &args.json {
        let report = Report {
            bench: "merge-bench",
            cores,
            tokio_threads: args.threads,
            entries: args.entries,
            kns: args.kns,
            batch: args.batch,
            key_size: KEY_SIZE,
            value_size: args.value_size,
            segment_size: plan.segment_size,
            pool_size: plan.pool_size,
            initial_index_buckets: args.initial_buckets,
            durability,
            prefault: plan.prefault,
            repeat: args.repeat,
            pool_dir: args.pool_dir.as_ref().map(|p| p.display().to_string()),
            write_note: WRITE_NOTE,
            merge_note: MERGE_NOTE,
            noise_note: NOISE_NOTE,
            checks_ok,
            rows: &rows,
        };
        write_json(path, &report)?;
        println!("wrote {}", path.display());
    }
    Ok(checks_ok)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads.max(1))
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let ok = rt.block_on(run(args, cores))?;
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}
