//! fabric-bench: latency, throughput and round trips per operation of each fabric backend.
//!
//! For every backend asked for (shm, tcp, and verbs in a build with `--features rdma`) it
//! measures READ (64 B, 4 KiB), WRITE (64 B, 4 KiB, and a 1 MiB batch written as one WRITE, as
//! a KN flushes a log batch), CAS, FAA and a doorbell-batched post of 8 64-byte READs, each in
//! two modes:
//! - `single`: one caller, one post outstanding at a time;
//! - `pipelined`: `--depth` posts in flight at once on the same handle (that many tasks share
//!   it, each posting one at a time). On shm a post completes synchronously inside the caller,
//!   so there the concurrency is bounded by the runtime's worker threads.
//!
//! Round trips are counted from the handle's own stats (not inferred from time): a single post
//! must come out at 1.00 RTs/op, the 8-READ doorbell post at 0.125. A cell that does not is
//! reported and makes the program exit non-zero. CAS and FAA results are checked against the
//! words in the region after each cell.
//!
//! Every loop is bounded by a count (`--ops` per cell, `--big-ops` for the 1 MiB cells), never
//! by time. The default run finishes well within a minute on 2 cores.
//!
//! Absolute numbers on a small shared machine are noisy (on a 2-core VM the tcp "NIC" task and
//! the client share the same cores); shm vs tcp is meaningful as a ratio measured in the same
//! run, which the program prints after the main table. Latency is per post; ops/s counts
//! operations (8 per doorbell post).
//!
//! `cargo run --release -p dinomo-bench --bin fabric-bench -- --help`

use std::any::Any;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use dinomo_bench::{human_size, thousands, write_json, Align, Cell, Latencies, Table};
use dinomo_fabric::grants::GrantTable;
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::tcp::{TcpFabric, TcpNic};
use dinomo_fabric::{Completion, DurabilityRequest, Fabric, Op, PmRegion};
use serde::Serialize;

const NOISE_NOTE: &str =
    "absolute numbers on this machine are noisy (small shared VM; the tcp NIC task and \
the client share the same cores). Read shm vs tcp as a ratio measured in this same run. RTs/op \
is counted from each handle's stats, not timed.";

const DEFAULT_BACKENDS: &str = if cfg!(feature = "rdma") {
    "shm,tcp,verbs"
} else {
    "shm,tcp"
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Largest `--depth` (the pool layout gives every in-flight task its own words and slots).
const MAX_DEPTH: usize = 256;
/// READs in one doorbell-batched post.
const DOORBELL: usize = 8;

#[derive(Parser, Debug)]
#[command(
    name = "fabric-bench",
    about = "Latency, ops/s and round trips per op of each fabric backend"
)]
struct Args {
    /// Backends to measure, comma-separated (verbs needs a build with --features rdma).
    #[arg(long, value_enum, value_delimiter = ',', default_value = DEFAULT_BACKENDS)]
    backends: Vec<Backend>,

    /// Operations measured per cell (warm-up excluded).
    #[arg(long, default_value_t = 20_000)]
    ops: u64,

    /// Operations measured per 1 MiB WRITE cell.
    #[arg(long, default_value_t = 500)]
    big_ops: u64,

    /// Posts in flight at once on one handle in the pipelined mode.
    #[arg(long, default_value_t = 16)]
    depth: usize,

    /// Directory for the pool file (default: a fresh temporary directory). Pass a directory on
    /// a DAX mount to measure real persistent memory.
    #[arg(long)]
    pool_dir: Option<PathBuf>,

    /// Durability of the pool mapping: auto (DAX when MAP_SYNC works), dax, msync, process-crash.
    #[arg(long, default_value = "auto")]
    durability: DurabilityRequest,

    /// Also write every cell, with the configuration, as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,

    /// Tokio worker threads (client tasks and the in-process tcp NIC share them).
    #[arg(long, default_value_t = 2)]
    threads: usize,

    /// Address the verbs NIC listens on (an address of an RDMA-capable interface).
    #[cfg(feature = "rdma")]
    #[arg(long, default_value = "127.0.0.1:0")]
    verbs_addr: SocketAddr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Backend {
    Shm,
    Tcp,
    Verbs,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Shm => "shm",
            Backend::Tcp => "tcp",
            Backend::Verbs => "verbs",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Cas,
    Faa,
    /// `DOORBELL` READs in one post.
    ReadBatch,
}

#[derive(Debug, Clone, Copy)]
struct Workload {
    kind: Kind,
    /// Payload bytes per operation.
    size: u32,
}

impl Workload {
    fn label(&self) -> String {
        match self.kind {
            Kind::Read => "READ".into(),
            Kind::Write => "WRITE".into(),
            Kind::Cas => "CAS".into(),
            Kind::Faa => "FAA".into(),
            Kind::ReadBatch => format!("READ x{DOORBELL}"),
        }
    }

    fn ops_per_post(&self) -> u64 {
        if self.kind == Kind::ReadBatch {
            DOORBELL as u64
        } else {
            1
        }
    }
}

const WORKLOADS: [Workload; 8] = [
    Workload {
        kind: Kind::Read,
        size: 64,
    },
    Workload {
        kind: Kind::Read,
        size: 4096,
    },
    Workload {
        kind: Kind::Write,
        size: 64,
    },
    Workload {
        kind: Kind::Write,
        size: 4096,
    },
    Workload {
        kind: Kind::Write,
        size: 1 << 20,
    },
    Workload {
        kind: Kind::Cas,
        size: 8,
    },
    Workload {
        kind: Kind::Faa,
        size: 8,
    },
    Workload {
        kind: Kind::ReadBatch,
        size: 64,
    },
];

/// Where each in-flight task works in the pool, so that tasks never share a word or a slot.
#[derive(Debug, Clone, Copy)]
struct Layout {
    depth: usize,
}

impl Layout {
    const SMALL_BASE: u64 = MIB;
    const SMALL_SLOT: u64 = 64 * KIB;
    const FAA_BASE: u64 = 32 * KIB;

    fn cas_word(&self, task: usize) -> u64 {
        task as u64 * 64
    }

    fn faa_word(&self, task: usize) -> u64 {
        Self::FAA_BASE + task as u64 * 64
    }

    /// One of 16 4-KiB slots of the task, by iteration.
    fn small(&self, task: usize, i: u64) -> u64 {
        Self::SMALL_BASE + task as u64 * Self::SMALL_SLOT + (i % 16) * 4 * KIB
    }

    fn big_base(&self) -> u64 {
        (Self::SMALL_BASE + self.depth as u64 * Self::SMALL_SLOT).div_ceil(MIB) * MIB
    }

    fn big(&self, task: usize) -> u64 {
        self.big_base() + task as u64 * MIB
    }

    fn pool_len(&self) -> u64 {
        self.big_base() + self.depth as u64 * MIB
    }
}

/// The memory node: the pool, its grant table, and the directory holding them.
#[derive(Debug)]
struct Node {
    _tmp: Option<tempfile::TempDir>,
    pool: PathBuf,
    region: Arc<PmRegion>,
    grants: Arc<GrantTable>,
}

impl Node {
    fn create(dir: Option<&Path>, len: u64, durability: DurabilityRequest) -> Result<Self> {
        let (tmp, dir) = match dir {
            Some(d) => {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
                (None, d.to_path_buf())
            }
            None => {
                let t = tempfile::Builder::new().prefix("fabric-bench").tempdir()?;
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
        };
        let pool = dir.join(format!("fabric-bench-{}.pool", std::process::id()));
        let region = Arc::new(PmRegion::create(&pool, len, durability)?);
        let grants = Arc::new(GrantTable::create(&GrantTable::path_for(&pool), 16)?);
        // Touch every page once, so that no cell pays first-fault costs.
        let chunk: Vec<u8> = (0..MIB).map(|i| (i % 251) as u8).collect();
        let mut off = 0;
        while off < len {
            let n = (len - off).min(MIB);
            region.write(off, &chunk[..n as usize])?;
            off += n;
        }
        region.persist(0, len)?;
        Ok(Node {
            _tmp: tmp,
            pool,
            region,
            grants,
        })
    }

    fn word(&self, offset: u64) -> Result<u64> {
        Ok(self.region.word(offset)?.load(Ordering::Acquire))
    }

    fn reset_word(&self, offset: u64) -> Result<()> {
        self.region.word(offset)?.store(0, Ordering::Release);
        self.region.persist(offset, 8)?;
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(GrantTable::path_for(&self.pool));
        let _ = std::fs::remove_file(&self.pool);
    }
}

/// A connected handle, and whatever must stay alive for it to work (the tcp/verbs NIC).
struct Connected {
    fabric: Arc<dyn Fabric>,
    _keep: Option<Box<dyn Any + Send>>,
    /// How the caller's side maps the pool (shm only).
    note: Option<String>,
}

async fn connect(backend: Backend, node: &Node, args: &Args) -> Result<Connected> {
    // The benchmark writes anywhere in its region: a window over all of it.
    let key = node
        .grants
        .grant_with_window(&[dinomo_fabric::grants::WindowRange::write(
            0,
            node.region.len(),
        )])?;
    match backend {
        Backend::Shm => {
            let f = ShmFabric::connect(&node.pool, key, args.durability)?;
            let note = format!(
                "shm handle maps the pool with durability {}",
                f.region().durability()
            );
            Ok(Connected {
                fabric: Arc::new(f),
                _keep: None,
                note: Some(note),
            })
        }
        Backend::Tcp => {
            let nic = TcpNic::start(
                SocketAddr::from(([127, 0, 0, 1], 0)),
                node.region.clone(),
                node.grants.clone(),
            )
            .await?;
            let f = TcpFabric::connect(nic.local_addr(), key).await?;
            Ok(Connected {
                fabric: Arc::new(f),
                _keep: Some(Box::new(nic)),
                note: None,
            })
        }
        Backend::Verbs => connect_verbs(node, args, key).await,
    }
}

#[cfg(feature = "rdma")]
async fn connect_verbs(
    node: &Node,
    args: &Args,
    key: dinomo_fabric::AccessKey,
) -> Result<Connected> {
    use dinomo_fabric::verbs::{VerbsFabric, VerbsNic};
    let nic = VerbsNic::start(args.verbs_addr, node.region.clone(), node.grants.clone())
        .await
        .with_context(|| format!("starting the verbs NIC on {}", args.verbs_addr))?;
    let f = VerbsFabric::connect(nic.local_addr(), key).await?;
    Ok(Connected {
        fabric: Arc::new(f),
        _keep: Some(Box::new(nic)),
        note: None,
    })
}

#[cfg(not(feature = "rdma"))]
async fn connect_verbs(
    _node: &Node,
    _args: &Args,
    _key: dinomo_fabric::AccessKey,
) -> Result<Connected> {
    bail!("the verbs backend needs a build with --features rdma")
}

/// Builds the operations of post number `i` of `task`.
fn build_post(
    w: Workload,
    layout: Layout,
    task: usize,
    i: u64,
    data: &Bytes,
    expected: u64,
) -> Vec<Op> {
    match w.kind {
        Kind::Read => vec![Op::Read {
            offset: layout.small(task, i),
            len: w.size,
        }],
        Kind::Write if u64::from(w.size) > 4 * KIB => {
            vec![Op::Write {
                offset: layout.big(task),
                data: data.clone(),
            }]
        }
        Kind::Write => vec![Op::Write {
            offset: layout.small(task, i),
            data: data.clone(),
        }],
        Kind::Cas => vec![Op::Cas {
            offset: layout.cas_word(task),
            expected,
            new: expected + 1,
        }],
        Kind::Faa => vec![Op::Faa {
            offset: layout.faa_word(task),
            add: 1,
        }],
        Kind::ReadBatch => (0..DOORBELL as u64)
            .map(|k| Op::Read {
                offset: layout.small(task, i * DOORBELL as u64 + k),
                len: w.size,
            })
            .collect(),
    }
}

/// `posts` posts of `task`, one at a time. Returns the per-post latencies.
async fn run_task(
    fabric: Arc<dyn Fabric>,
    w: Workload,
    layout: Layout,
    task: usize,
    posts: u64,
    data: Bytes,
) -> Result<Latencies> {
    let mut lat = Latencies::with_capacity(posts as usize);
    // CAS/FAA words start at 0 (reset before each measured run), and only this task uses them.
    let mut expected = 0u64;
    for i in 0..posts {
        let ops = build_post(w, layout, task, i, &data, expected);
        let t0 = Instant::now();
        let completions = fabric.post(&ops).await?;
        lat.record(t0.elapsed());
        ensure!(
            completions.len() == ops.len(),
            "{} completions for a post of {} operations",
            completions.len(),
            ops.len()
        );
        for c in &completions {
            match (w.kind, c) {
                (Kind::Read | Kind::ReadBatch, Completion::Read(b))
                    if b.len() == w.size as usize => {}
                (Kind::Write, Completion::Written) => {}
                (Kind::Cas, Completion::Cas { old }) => {
                    ensure!(
                        *old == expected,
                        "task {task}: CAS found {old}, expected {expected}"
                    );
                    expected += 1;
                }
                (Kind::Faa, Completion::Faa { old }) => {
                    ensure!(
                        *old == expected,
                        "task {task}: FAA found {old}, expected {expected}"
                    );
                    expected += 1;
                }
                (k, c) => bail!("unexpected completion for {k:?}: {c:?}"),
            }
        }
    }
    Ok(lat)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Single,
    Pipelined,
}

/// Measures one cell: warm-up, then `ops` operations in `mode`.
async fn measure(
    backend: &str,
    fabric: &Arc<dyn Fabric>,
    node: &Node,
    layout: Layout,
    w: Workload,
    mode: Mode,
    ops: u64,
) -> Result<Cell> {
    let per_post = w.ops_per_post();
    let posts = (ops / per_post).max(1);
    let depth = match mode {
        Mode::Single => 1,
        Mode::Pipelined => layout.depth.min(posts as usize),
    };
    let data = Bytes::from(
        (0..u64::from(w.size))
            .map(|i| (i * 7 + 1) as u8)
            .collect::<Vec<u8>>(),
    );

    let reset = |depth: usize| -> Result<()> {
        for t in 0..depth {
            node.reset_word(layout.cas_word(t))?;
            node.reset_word(layout.faa_word(t))?;
        }
        Ok(())
    };
    let warmup = (posts / 10).clamp(1, 200);
    reset(1)?;
    run_task(fabric.clone(), w, layout, 0, warmup, data.clone()).await?;
    reset(depth)?;

    let per_task: Vec<u64> = (0..depth as u64)
        .map(|t| posts / depth as u64 + u64::from(t < posts % depth as u64))
        .collect();
    let before = fabric.stats().snapshot();
    let start = Instant::now();
    let mut lat = match mode {
        Mode::Single => run_task(fabric.clone(), w, layout, 0, posts, data).await?,
        Mode::Pipelined => {
            let mut set = tokio::task::JoinSet::new();
            for (t, n) in per_task.iter().enumerate() {
                set.spawn(run_task(fabric.clone(), w, layout, t, *n, data.clone()));
            }
            let mut all = Latencies::with_capacity(posts as usize);
            while let Some(r) = set.join_next().await {
                all.merge(r.context("a pipelined task panicked")??);
            }
            all
        }
    };
    let elapsed = start.elapsed();
    let delta = fabric.stats().snapshot().since(&before);

    // The words CAS and FAA worked on must hold exactly the number of successful operations.
    for (t, n) in per_task.iter().enumerate() {
        let (word, name) = match w.kind {
            Kind::Cas => (layout.cas_word(t), "CAS"),
            Kind::Faa => (layout.faa_word(t), "FAA"),
            _ => continue,
        };
        let v = node.word(word)?;
        ensure!(
            v == *n,
            "{backend}: after {n} {name}s task {t}'s word holds {v}"
        );
    }

    let measured_ops = posts * per_post;
    ensure!(
        lat.len() as u64 == posts,
        "{} latencies for {posts} posts",
        lat.len()
    );
    let secs = elapsed.as_secs_f64().max(1e-9);
    Ok(Cell {
        backend: backend.to_string(),
        op: w.label(),
        size_bytes: u64::from(w.size),
        mode: match mode {
            Mode::Single => "single".into(),
            Mode::Pipelined => "pipelined".into(),
        },
        depth,
        ops: measured_ops,
        posts,
        round_trips: delta.round_trips,
        rts_per_op: delta.round_trips as f64 / delta.ops().max(1) as f64,
        ops_per_sec: measured_ops as f64 / secs,
        p50_us: lat.quantile_us(0.50),
        p99_us: lat.quantile_us(0.99),
        max_us: lat.quantile_us(1.0),
        elapsed_ms: secs * 1000.0,
    })
}

#[derive(Debug, Serialize)]
struct Report<'a> {
    tool: &'static str,
    note: &'static str,
    cores: usize,
    threads: usize,
    ops_per_cell: u64,
    big_ops_per_cell: u64,
    depth: usize,
    pool: String,
    pool_bytes: u64,
    durability: String,
    /// Cells whose counted round trips per op differ from the expected 1 (or 1/8 for doorbell).
    rt_mismatches: &'a [String],
    cells: &'a [Cell],
}

fn fmt_us(us: f64) -> String {
    if us < 100.0 {
        format!("{us:.2}")
    } else {
        format!("{us:.0}")
    }
}

fn mode_label(c: &Cell) -> String {
    if c.mode == "pipelined" {
        format!("pipelined d={}", c.depth)
    } else {
        c.mode.clone()
    }
}

fn main_table(cells: &[Cell]) -> Table {
    let mut t = Table::new(&[
        ("backend", Align::Left),
        ("op", Align::Left),
        ("size", Align::Right),
        ("mode", Align::Left),
        ("ops/s", Align::Right),
        ("p50 µs", Align::Right),
        ("p99 µs", Align::Right),
        ("RTs/op", Align::Right),
    ]);
    for c in cells {
        t.row(vec![
            c.backend.clone(),
            c.op.clone(),
            human_size(c.size_bytes),
            mode_label(c),
            thousands(c.ops_per_sec),
            fmt_us(c.p50_us),
            fmt_us(c.p99_us),
            format!("{:.3}", c.rts_per_op),
        ]);
    }
    t
}

/// Each non-shm cell against the shm cell of the same op, size and mode of this run.
fn ratio_table(cells: &[Cell]) -> Option<Table> {
    let mut t = Table::new(&[
        ("backend", Align::Left),
        ("op", Align::Left),
        ("size", Align::Right),
        ("mode", Align::Left),
        ("p50 / shm p50", Align::Right),
        ("shm ops/s / ops/s", Align::Right),
    ]);
    let mut any = false;
    for c in cells.iter().filter(|c| c.backend != "shm") {
        let Some(s) = cells.iter().find(|s| {
            s.backend == "shm" && s.op == c.op && s.size_bytes == c.size_bytes && s.mode == c.mode
        }) else {
            continue;
        };
        any = true;
        t.row(vec![
            c.backend.clone(),
            c.op.clone(),
            human_size(c.size_bytes),
            mode_label(c),
            format!("{:.1}x", c.p50_us / s.p50_us.max(1e-3)),
            format!("{:.1}x", s.ops_per_sec / c.ops_per_sec.max(1e-9)),
        ]);
    }
    any.then_some(t)
}

async fn run(args: Args) -> Result<()> {
    ensure!(
        args.ops >= 1 && args.big_ops >= 1,
        "--ops and --big-ops must be at least 1"
    );
    ensure!(
        (1..=MAX_DEPTH).contains(&args.depth),
        "--depth must be between 1 and {MAX_DEPTH}, got {}",
        args.depth
    );
    let mut backends: Vec<Backend> = Vec::new();
    for b in &args.backends {
        if !backends.contains(b) {
            backends.push(*b);
        }
    }
    if backends.contains(&Backend::Verbs) && !cfg!(feature = "rdma") {
        bail!("--backends verbs needs a build with --features rdma");
    }

    let layout = Layout { depth: args.depth };
    let node = Node::create(args.pool_dir.as_deref(), layout.pool_len(), args.durability)?;
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let durability = node.region.durability().to_string();

    println!(
        "fabric-bench: {cores} cores, {} tokio worker threads",
        args.threads
    );
    println!(
        "pool: {} ({}), durability: {durability}",
        node.pool.display(),
        human_size(layout.pool_len())
    );
    println!(
        "per cell: {} ops ({} for 1 MiB WRITE) after a warm-up; pipelined = {} posts in flight on one handle",
        args.ops, args.big_ops, args.depth
    );
    println!("NOTE: {NOISE_NOTE}");
    println!(
        "Latency is per post (a READ x{DOORBELL} doorbell post carries {DOORBELL} ops); ops/s counts ops."
    );

    let mut cells = Vec::new();
    let mut mismatches = Vec::new();
    for backend in backends {
        let conn = connect(backend, &node, &args)
            .await
            .with_context(|| format!("connecting the {} backend", backend.name()))?;
        if let Some(n) = &conn.note {
            println!("{n}");
        }
        for w in WORKLOADS {
            for mode in [Mode::Single, Mode::Pipelined] {
                let ops = if u64::from(w.size) > 4 * KIB {
                    args.big_ops
                } else {
                    args.ops
                };
                eprintln!(
                    "measuring {} {} {} {mode:?} ...",
                    backend.name(),
                    w.label(),
                    human_size(u64::from(w.size))
                );
                let cell = measure(backend.name(), &conn.fabric, &node, layout, w, mode, ops)
                    .await
                    .with_context(|| format!("{} {} {mode:?}", backend.name(), w.label()))?;
                if cell.round_trips * w.ops_per_post() != cell.ops {
                    mismatches.push(format!(
                        "{} {} {} {}: {} round trips for {} ops, expected {}",
                        cell.backend,
                        cell.op,
                        human_size(cell.size_bytes),
                        cell.mode,
                        cell.round_trips,
                        cell.ops,
                        cell.ops / w.ops_per_post()
                    ));
                }
                cells.push(cell);
            }
        }
    }

    println!();
    print!("{}", main_table(&cells).render());
    if let Some(t) = ratio_table(&cells) {
        println!();
        println!("Ratios against shm, same run (higher = slower than shm):");
        print!("{}", t.render());
    }

    if let Some(path) = &args.json {
        let report = Report {
            tool: "fabric-bench",
            note: NOISE_NOTE,
            cores,
            threads: args.threads,
            ops_per_cell: args.ops,
            big_ops_per_cell: args.big_ops,
            depth: args.depth,
            pool: node.pool.display().to_string(),
            pool_bytes: layout.pool_len(),
            durability,
            rt_mismatches: &mismatches,
            cells: &cells,
        };
        write_json(path, &report)?;
        println!();
        println!("wrote {}", path.display());
    }

    if !mismatches.is_empty() {
        for m in &mismatches {
            eprintln!("round-trip mismatch: {m}");
        }
        bail!(
            "{} cell(s) did not take the expected round trips per op",
            mismatches.len()
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(args.threads >= 1, "--threads must be at least 1");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.threads)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(run(args))
}
