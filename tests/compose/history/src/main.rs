//! `dinomo-history`: the compose test's recorded client and its checker.
//!
//! - `record` runs a get/put/insert/update/delete load from several client tasks against a
//!   cluster (through its routing node), every operation stamped with one logical clock
//!   ([`dinomo_checker::History`]); when told to stop it waits until the cluster serves again,
//!   reads every key back (recorded too) and writes the history to a file.
//! - `check` reads such a file and decides it with dinomo-checker, key by key (so it counts
//!   every non-linearizable key, not only the first), and independently counts *lost writes*:
//!   acknowledged writes that the final read-back proves overwritten by nothing.
//!
//! The file is text, one operation a line, so a failed run's history can be read, diffed and
//! replayed (`check` again) without the cluster. Format (version 1):
//!
//! ```text
//! # dinomo-history v1
//! <id> <client> <invoke> <op> <key-hex> <value-hex|-> <outcome> <at|-> <res> <res-value-hex|-|none>
//! ```
//!
//! `op` is get/put/insert/update/delete; `outcome` done/unknown/pending; `res`
//! value/ok/exists/notfound/fail or `-` when there is no response. Values are unique per write
//! (`c<client>-<n>`), which is what lets `check` tell which write a read-back saw.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use dinomo_checker::{
    check_entries, CheckOptions, ClientId, Entry, History, Op, OpId, Outcome, Res, Violation,
};
use dinomo_client::{Client, ClientConfig, ClientError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const HEADER: &str = "# dinomo-history v1";
/// The client id of the final read-back.
const READBACK: ClientId = 1_000_000;

/// Records a key-value history against a Dinomo cluster, or checks a recorded one.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a recorded load, then read every key back, and write the history to --out.
    Record(RecordArgs),
    /// Check a recorded history: linearizability per key and lost acknowledged writes.
    Check(CheckArgs),
}

#[derive(Debug, clap::Args)]
struct RecordArgs {
    /// Routing node(s), HOST:PORT, comma-separated.
    #[arg(long, default_value = "127.0.0.1:7900", value_delimiter = ',')]
    routing: Vec<String>,
    /// Concurrent clients (each with its own SDK client).
    #[arg(long, default_value_t = 4)]
    clients: u64,
    /// Keys <prefix>k0..<prefix>k<keys-1>, picked uniformly.
    #[arg(long, default_value_t = 64)]
    keys: u64,
    /// Prefix of every key. The checker assumes each key starts absent, so every recorded run
    /// against the same cluster needs keys of its own (default: h<seed>- ).
    #[arg(long)]
    key_prefix: Option<String>,
    /// Stop the load after this many seconds at the latest.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Stop the load as soon as this file exists (the test's driver creates it after the heal).
    #[arg(long)]
    stop_file: Option<PathBuf>,
    /// Per-operation deadline of the SDK, in seconds (it retries through reconfigurations until
    /// then; an operation past it is recorded with an unknown outcome).
    #[arg(long, default_value_t = 30)]
    op_deadline_s: u64,
    /// After the load, how long to wait at most for a write and a read to succeed before the
    /// read-back.
    #[arg(long, default_value_t = 90)]
    settle_s: u64,
    /// Seed of the clients' operation choices (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Print a progress line every this many seconds (0: never).
    #[arg(long, default_value_t = 1)]
    progress_s: u64,
    /// Where to write the history.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Debug, clap::Args)]
struct CheckArgs {
    /// A file written by `record`.
    file: PathBuf,
    /// Most search states per key before the checker gives up (UNDECIDED, not a pass).
    #[arg(long, default_value_t = 1_000_000)]
    max_states_per_key: usize,
    /// How many violations to print in full.
    #[arg(long, default_value_t = 3)]
    show: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Record(a) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("tokio runtime")
            .and_then(|rt| rt.block_on(record(a))),
        Command::Check(a) => check(a),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dinomo-history: {e:#}");
            ExitCode::from(2)
        }
    }
}

// ----------------------------------------------------------------------------------------------
// record

#[derive(Debug)]
struct Stats {
    ops: AtomicU64,
    ok: AtomicU64,
    unknown: AtomicU64,
    errors: AtomicU64,
    start: Instant,
    /// Milliseconds since `start` of the latest successful operation.
    last_ok_ms: AtomicU64,
    /// The longest time with no successful operation from any client, milliseconds.
    max_gap_ms: AtomicU64,
}

impl Stats {
    fn new() -> Self {
        Stats {
            ops: AtomicU64::new(0),
            ok: AtomicU64::new(0),
            unknown: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            start: Instant::now(),
            last_ok_ms: AtomicU64::new(0),
            max_gap_ms: AtomicU64::new(0),
        }
    }

    fn ok_now(&self) {
        self.ok.fetch_add(1, Ordering::Relaxed);
        let now = self.start.elapsed().as_millis() as u64;
        let last = self.last_ok_ms.fetch_max(now, Ordering::Relaxed);
        if now > last {
            self.max_gap_ms.fetch_max(now - last, Ordering::Relaxed);
        }
    }
}

async fn client(routing: &[String], deadline: Duration) -> Result<Client> {
    let mut cfg = ClientConfig::new(routing);
    cfg.deadline = deadline;
    // The routing node may not hold a map yet, or may be cut off: keep trying for a while.
    let start = Instant::now();
    loop {
        match Client::connect_with(cfg.clone()).await {
            Ok(c) => return Ok(c),
            Err(e) if start.elapsed() < Duration::from_secs(60) => {
                eprintln!("connect: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e).context("connecting to the routing node"),
        }
    }
}

/// Runs one operation, recording it. `None` when it did not get a definite answer.
async fn run_op(
    client: &Client,
    history: &History,
    who: ClientId,
    op: Op,
    stats: &Stats,
) -> Option<Res> {
    let h = history.invoke(who, op.clone());
    let r: Result<Res, ClientError> = match op {
        Op::Get { key } => client
            .get(key)
            .await
            .map(|v| Res::Value(v.map(|b| b.to_vec()))),
        Op::Put { key, value } => client.put(key, value).await.map(|_| Res::Ok),
        Op::Insert { key, value } => match client.insert(key, value).await {
            Err(ClientError::AlreadyExists) => Ok(Res::AlreadyExists),
            r => r.map(|_| Res::Ok),
        },
        Op::Update { key, value } => match client.update(key, value).await {
            Err(ClientError::NotFound) => Ok(Res::NotFound),
            r => r.map(|_| Res::Ok),
        },
        Op::Delete { key } => {
            client
                .delete(key)
                .await
                .map(|existed| if existed { Res::Ok } else { Res::NotFound })
        }
    };
    stats.ops.fetch_add(1, Ordering::Relaxed);
    match r {
        Ok(res) => {
            stats.ok_now();
            history.complete(h, res.clone());
            Some(res)
        }
        Err(e) => {
            // Only a malformed request is known not to have been applied; anything else
            // (OutcomeUnknown, a deadline, a full pool seen after retries) may have been, so the
            // checker may place it anywhere after its invocation, or nowhere.
            match e {
                ClientError::InvalidArgument(_) => history.complete(h, Res::Fail),
                _ => history.complete_unknown(h),
            }
            if matches!(e, ClientError::OutcomeUnknown(_)) {
                stats.unknown.fetch_add(1, Ordering::Relaxed);
            } else {
                stats.errors.fetch_add(1, Ordering::Relaxed);
            }
            let n = stats.unknown.load(Ordering::Relaxed) + stats.errors.load(Ordering::Relaxed);
            if n <= 20 || n.is_power_of_two() {
                eprintln!("client {who}: {e} ({n} errors so far)");
            }
            None
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn load(
    who: ClientId,
    client: Client,
    history: Arc<History>,
    prefix: String,
    keys: u64,
    seed: u64,
    stop: Arc<AtomicBool>,
    stats: Arc<Stats>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ who.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let key = format!("{prefix}k{}", rng.random_range(0..keys)).into_bytes();
        let value = format!("c{who}-{n}").into_bytes();
        let op = match rng.random_range(0..10) {
            0..=4 => Op::Get { key },
            5..=6 => Op::Put { key, value },
            7 => Op::Insert { key, value },
            8 => Op::Update { key, value },
            _ => Op::Delete { key },
        };
        run_op(&client, &history, who, op, &stats).await;
    }
}

async fn record(a: RecordArgs) -> Result<ExitCode> {
    if a.clients == 0 || a.keys == 0 {
        bail!("--clients and --keys must be at least 1");
    }
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let prefix = a.key_prefix.clone().unwrap_or_else(|| format!("h{seed}-"));
    let deadline = Duration::from_secs(a.op_deadline_s);
    let history = Arc::new(History::new());
    let stats = Arc::new(Stats::new());
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    eprintln!(
        "record: {} clients, {} keys {prefix}k*, seed {seed}, at most {} s, routing {:?}",
        a.clients, a.keys, a.seconds, a.routing
    );

    let mut tasks = tokio::task::JoinSet::new();
    for who in 1..=a.clients {
        let c = client(&a.routing, deadline).await?;
        tasks.spawn(load(
            who,
            c,
            history.clone(),
            prefix.clone(),
            a.keys,
            seed,
            stop.clone(),
            stats.clone(),
        ));
    }

    // The stop condition and the progress lines.
    let limit = Duration::from_secs(a.seconds);
    let mut last_print = Instant::now();
    let mut last_ok = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let stop_now =
            start.elapsed() >= limit || a.stop_file.as_deref().is_some_and(|p| p.exists());
        if a.progress_s > 0 && last_print.elapsed() >= Duration::from_secs(a.progress_s) {
            let ok = stats.ok.load(Ordering::Relaxed);
            let dt = last_print.elapsed().as_secs_f64();
            eprintln!(
                "progress t={:.1}s ops={} ok={} unknown={} errors={} ok_per_s={:.0}",
                start.elapsed().as_secs_f64(),
                stats.ops.load(Ordering::Relaxed),
                ok,
                stats.unknown.load(Ordering::Relaxed),
                stats.errors.load(Ordering::Relaxed),
                (ok - last_ok) as f64 / dt
            );
            last_ok = ok;
            last_print = Instant::now();
        }
        if stop_now {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    // Each task finishes the operation it has in flight (bounded by the SDK deadline).
    while tasks.join_next().await.is_some() {}
    let load_s = start.elapsed().as_secs_f64();
    let max_gap_ms = stats.max_gap_ms.load(Ordering::Relaxed);

    // Settle: a write and a read (of a key outside the history) must succeed.
    let probe = client(&a.routing, deadline).await?;
    let settle_start = Instant::now();
    let mut settled = false;
    while settle_start.elapsed() < Duration::from_secs(a.settle_s) {
        let v = format!("probe-{}", settle_start.elapsed().as_nanos());
        if probe.put("probe", v.clone()).await.is_ok()
            && probe.get("probe").await.ok().flatten().as_deref() == Some(v.as_bytes())
        {
            settled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settle_ms = settle_start.elapsed().as_millis();

    // Read every key back, recorded: this is what makes a lost write visible to the checker.
    let mut unread = 0;
    for k in 0..a.keys {
        let key = format!("{prefix}k{k}").into_bytes();
        if run_op(&probe, &history, READBACK, Op::Get { key }, &stats)
            .await
            .is_none()
        {
            unread += 1;
        }
    }

    let entries = history.entries();
    write_history(&a.out, &entries)?;
    println!(
        "RECORD ops={} ok={} unknown={} errors={} load_s={load_s:.1} ok_per_s={:.0} max_stall_ms={max_gap_ms} settled={settled} settle_ms={settle_ms} readback_keys={} unread={unread} seed={seed} file={}",
        stats.ops.load(Ordering::Relaxed),
        stats.ok.load(Ordering::Relaxed),
        stats.unknown.load(Ordering::Relaxed),
        stats.errors.load(Ordering::Relaxed),
        stats.ok.load(Ordering::Relaxed) as f64 / load_s.max(0.001),
        a.keys,
        a.out.display()
    );
    Ok(if settled && unread == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

// ----------------------------------------------------------------------------------------------
// the file

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

fn unhex(s: &str) -> Result<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        bail!("odd-length hex {s:?}");
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).with_context(|| format!("bad hex {s:?}")))
        .collect()
}

fn write_history(path: &Path, entries: &[Entry]) -> Result<()> {
    let mut out = String::with_capacity(entries.len() * 64);
    out.push_str(HEADER);
    out.push('\n');
    for e in entries {
        let (kind, value) = match &e.op {
            Op::Get { .. } => ("get", None),
            Op::Put { value, .. } => ("put", Some(value)),
            Op::Insert { value, .. } => ("insert", Some(value)),
            Op::Update { value, .. } => ("update", Some(value)),
            Op::Delete { .. } => ("delete", None),
        };
        let (outcome, at, res, res_value) = match &e.outcome {
            Outcome::Pending => ("pending", "-".to_string(), "-", "-".to_string()),
            Outcome::Unknown => ("unknown", "-".to_string(), "-", "-".to_string()),
            Outcome::Done { at, res } => {
                let (r, v) = match res {
                    Res::Value(Some(v)) => ("value", hex(v)),
                    Res::Value(None) => ("value", "none".to_string()),
                    Res::Ok => ("ok", "-".to_string()),
                    Res::AlreadyExists => ("exists", "-".to_string()),
                    Res::NotFound => ("notfound", "-".to_string()),
                    Res::Fail => ("fail", "-".to_string()),
                };
                ("done", at.to_string(), r, v)
            }
        };
        let _ = writeln!(
            out,
            "{} {} {} {kind} {} {} {outcome} {at} {res} {res_value}",
            e.id.index(),
            e.client,
            e.invoke,
            hex(e.op.key()),
            value.map_or_else(|| "-".to_string(), |v| hex(v)),
        );
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, out).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

fn read_history(path: &Path) -> Result<Vec<Entry>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines();
    match lines.next() {
        Some(HEADER) => {}
        Some(h) if h.starts_with("# dinomo-history ") => {
            bail!(
                "{}: format {h:?} found, this tool reads {HEADER:?}",
                path.display()
            )
        }
        _ => bail!(
            "{}: not a dinomo history (no {HEADER:?} line)",
            path.display()
        ),
    }
    let mut entries = Vec::new();
    for (n, line) in lines.enumerate() {
        let e = parse_line(line)
            .with_context(|| format!("{} line {}: {line:?}", path.display(), n + 2))?;
        entries.push(e);
    }
    Ok(entries)
}

fn parse_line(line: &str) -> Result<Entry> {
    let f: Vec<&str> = line.split(' ').collect();
    if f.len() != 10 {
        bail!("{} fields, expected 10", f.len());
    }
    let id = OpId::from_index(f[0].parse().context("id")?);
    let client: ClientId = f[1].parse().context("client")?;
    let invoke: u64 = f[2].parse().context("invoke")?;
    let key = unhex(f[4])?;
    let value = || -> Result<Vec<u8>> {
        if f[5] == "-" {
            bail!("{} without a value", f[3]);
        }
        unhex(f[5])
    };
    let op = match f[3] {
        "get" => Op::Get { key },
        "put" => Op::Put {
            key,
            value: value()?,
        },
        "insert" => Op::Insert {
            key,
            value: value()?,
        },
        "update" => Op::Update {
            key,
            value: value()?,
        },
        "delete" => Op::Delete { key },
        k => bail!("unknown operation {k:?}"),
    };
    let outcome = match f[6] {
        "pending" => Outcome::Pending,
        "unknown" => Outcome::Unknown,
        "done" => {
            let at: u64 = f[7].parse().context("at")?;
            let res = match (f[8], f[9]) {
                ("value", "none") => Res::Value(None),
                ("value", v) => Res::Value(Some(unhex(v)?)),
                ("ok", _) => Res::Ok,
                ("exists", _) => Res::AlreadyExists,
                ("notfound", _) => Res::NotFound,
                ("fail", _) => Res::Fail,
                (r, _) => bail!("unknown response {r:?}"),
            };
            Outcome::Done { at, res }
        }
        o => bail!("unknown outcome {o:?}"),
    };
    Ok(Entry {
        id,
        client,
        op,
        invoke,
        outcome,
    })
}

// ----------------------------------------------------------------------------------------------
// check

/// Lost acknowledged writes on one key, judged from its final read-back alone.
///
/// The read-back saw state `R` (a value, or absent). The operations that can have left `R` are
/// the writes of that value (values are unique per write) or, for absent, the deletes that took
/// effect and the initial state; each either completed at a known time or has an unknown
/// outcome (then it may have taken effect at any time after its invocation). An acknowledged
/// write `w` invoked after every such candidate had completed came after all of them in real
/// time, so `R` can only be seen if `w`'s effect is gone: `w` is lost.
fn lost_writes(ops: &[&Entry]) -> Option<usize> {
    let readback = ops
        .iter()
        .filter(|e| e.client == READBACK)
        .filter_map(|e| match e.result() {
            Some(Res::Value(v)) => Some((e.invoke, v.clone())),
            _ => None,
        })
        .max_by_key(|(t, _)| *t)?;
    let (rb_invoke, seen) = readback;
    let effective = |e: &Entry| match e.result() {
        Some(Res::Ok) => true,
        None => !matches!(e.outcome, Outcome::Done { .. }), // unknown or pending
        _ => false,
    };
    // Latest completion among the candidates for the state seen (u64::MAX: may be anytime).
    let mut latest: Option<u64> = None;
    if seen.is_none() {
        latest = Some(0); // the initial state
    }
    for e in ops.iter().filter(|e| e.invoke < rb_invoke && effective(e)) {
        let produces = match (&e.op, &seen) {
            (
                Op::Put { value, .. } | Op::Insert { value, .. } | Op::Update { value, .. },
                Some(v),
            ) => value == v,
            (Op::Delete { .. }, None) => true,
            _ => false,
        };
        if produces {
            let t = e.complete_time().unwrap_or(u64::MAX);
            latest = Some(latest.map_or(t, |l| l.max(t)));
        }
    }
    let lost = ops
        .iter()
        .filter(|e| e.client != READBACK && e.invoke < rb_invoke)
        .filter(|e| !matches!(e.op, Op::Get { .. }))
        .filter(|e| matches!(e.result(), Some(Res::Ok)))
        .filter(|e| latest.is_none_or(|l| l < e.invoke))
        .count();
    Some(lost)
}

fn check(a: CheckArgs) -> Result<ExitCode> {
    let entries = read_history(&a.file)?;
    let options = CheckOptions {
        max_states_per_key: a.max_states_per_key,
    };
    let mut by_key: BTreeMap<Vec<u8>, Vec<Entry>> = BTreeMap::new();
    for e in &entries {
        by_key
            .entry(e.op.key().to_vec())
            .or_default()
            .push(e.clone());
    }
    let (mut ops, mut unknown, mut failed) = (0, 0, 0);
    let (mut violations, mut undecided, mut malformed) = (0, 0, 0);
    let (mut lost, mut lost_keys, mut unread_keys) = (0, 0, 0);
    let mut shown = 0;
    for (key, es) in &by_key {
        match check_entries(es, &options) {
            Ok(r) => {
                ops += r.ops;
                unknown += r.unknown_ops;
                failed += r.failed_ops;
            }
            Err(v) => {
                ops += es.len();
                match v {
                    Violation::NotLinearizable(_) => violations += 1,
                    Violation::Undecided { .. } => undecided += 1,
                    Violation::Malformed { .. } => malformed += 1,
                }
                if shown < a.show {
                    shown += 1;
                    println!("--- key {:?}: {v}", String::from_utf8_lossy(key));
                }
            }
        }
        // Every key the load touched was read back at the end (`record`).
        let refs: Vec<&Entry> = es.iter().collect();
        match lost_writes(&refs) {
            Some(0) => {}
            Some(n) => {
                lost += n;
                lost_keys += 1;
                println!(
                    "--- key {:?}: {n} acknowledged write(s) lost (the read-back saw an older state)",
                    String::from_utf8_lossy(key)
                );
            }
            None => unread_keys += 1,
        }
    }
    let result = if violations > 0 || malformed > 0 {
        "VIOLATION"
    } else if lost > 0 {
        "LOST"
    } else if undecided > 0 {
        "UNDECIDED"
    } else if unread_keys > 0 {
        "UNREAD"
    } else {
        "ok"
    };
    println!(
        "CHECK ops={ops} keys={} unknown={unknown} failed={failed} violations={violations} undecided={undecided} malformed={malformed} lost_writes={lost} lost_keys={lost_keys} unread_keys={unread_keys} result={result} file={}",
        by_key.len(),
        a.file.display()
    );
    Ok(if result == "ok" {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
