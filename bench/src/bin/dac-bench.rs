//! dac-bench: the DAC experiment of DINOMO Figure 3, scaled to this machine.
//!
//! Loads N keys (8-byte keys, 64-byte values by default: `--value-bytes` sets another size)
//! through a KV node into an in-process dpm-node, then, for each cache policy (DAC,
//! shortcut-only, value-only, static-50%) and cache size (1, 2, 4, 8, 16% of the dataset's
//! key+value bytes), starts a KV node with an empty cache, warms it up, and runs a read-only
//! workload drawn uniformly from a 5% working set, in rounds interleaved across the policies
//! (the median round is reported).
//! Each cell reports ops/s and round trips per op (counted by the fabric, not timed).
//!
//! With the paper's 64-byte values a cached value costs only twice a shortcut (see the entry
//! overheads in `dinomo_kv_node::cache`), so every policy scores about alike; with
//! `--value-bytes 1024` a value costs about ten shortcuts and the grid tells the policies apart
//! (docs/dac-1kb.md).
//!
//! `--zipf 0.99 --scan-first` is the setting of issue 12 instead (the `ycsb_*` tables of the
//! cache simulator): zipfian reads over all keys, scrambled as `dinomo bench` scrambles them,
//! after each KN has read every key once in key order, which leaves its cache as a load phase
//! through that KN would (DAC: the first values, then shortcuts).
//!
//! This is a program that prints a table, not a test. Absolute ops/s on a small shared machine
//! are noisy; compare policies within a column of one run, and read RTs/op, which is exact.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Parser;
use dinomo_bench::{thousands, write_json, Align, Table};
use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::testkit::InProcessDpm;
use dinomo_kv_node::config::KnConfigFile;
use dinomo_kv_node::shard::{PutMode, ShardOp};
use dinomo_kv_node::{KvError, KvNode};
use dinomo_node_common::config::ByteSize;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(about = "DINOMO Figure 3: DAC vs static cache policies across cache sizes")]
struct Args {
    /// Keys loaded (8-byte keys, `--value-bytes` values).
    #[arg(long, default_value_t = 100_000)]
    keys: u64,
    /// Bytes of every value (the paper's Fig. 3 uses 64; at least 8: each value starts with its
    /// key number, which the readers check).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(8..=(1 << 20)))]
    value_bytes: u32,
    /// Share of the keys that the reads touch (uniformly), in percent. With `--zipf`, only
    /// sizes the warm-up.
    #[arg(long, default_value_t = 5.0)]
    working_set_percent: f64,
    /// Draw the reads from all keys by a zipfian of this skew (0.99 in YCSB), rank r read as
    /// key `fnv1a64(r) % keys` as `dinomo bench` does, instead of uniformly from the working
    /// set.
    #[arg(long)]
    zipf: Option<f64>,
    /// Before the warm-up, each measured KN reads every key once, in key order (the cache a
    /// load phase through that KN would leave).
    #[arg(long)]
    scan_first: bool,
    /// Cache sizes, in percent of the dataset's key+value bytes.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    cache_percent: Vec<f64>,
    /// Policies to compare.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "dac,shortcut-only,value-only,static-50"
    )]
    policies: Vec<String>,
    /// Reads measured per cell (after the warm-up).
    #[arg(long, default_value_t = 20_000)]
    reads: u64,
    /// Warm-up reads per cell, in multiples of the working set.
    #[arg(long, default_value_t = 3)]
    warmup_rounds: u64,
    /// Measured rounds per cell (interleaved across policies; the median round is reported).
    #[arg(long, default_value_t = 5)]
    repeat: u64,
    /// Concurrent readers.
    #[arg(long, default_value_t = 4)]
    clients: u64,
    /// Shards of the KV node.
    #[arg(long, default_value_t = 2)]
    shards: u32,
    /// Fabric between the KV node and the dpm-node: tcp (each round trip costs a real network
    /// round trip on loopback, so ops/s follows RTs/op as on RDMA) or shm (a round trip is a
    /// memory access, so ops/s mostly measures the KN's own overheads).
    #[arg(long, default_value = "tcp")]
    fabric: String,
    /// Write all cells as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

#[derive(Debug, Serialize)]
struct CellResult {
    policy: String,
    value_bytes: u32,
    cache_percent: f64,
    cache_bytes: u64,
    reads: u64,
    ops_per_sec: f64,
    rts_per_op: f64,
    value_hit_ratio: f64,
    shortcut_hit_ratio: f64,
    miss_ratio: f64,
}

const KEY_BYTES: usize = 8;

fn key(i: u64) -> Bytes {
    Bytes::copy_from_slice(&i.to_be_bytes())
}

/// Key `i`'s value: its number, then filler, `len` (>= 8) bytes in all.
fn value(i: u64, len: usize) -> Bytes {
    let mut v = vec![0u8; len];
    v[..8].copy_from_slice(&i.to_le_bytes());
    Bytes::from(v)
}

/// Runs `op`, retrying (with backoff, for up to about 10 s) while the KN answers Unavailable:
/// a KN that this shared machine starved for a moment lets its map lease lapse, refuses
/// requests until it confirms the map again, and says so.
async fn execute(kn: &KvNode, op: ShardOp) -> anyhow::Result<Option<Bytes>> {
    let mut backoff = Duration::from_millis(2);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match kn.execute(op.clone()).await {
            Err(KvError::Unavailable(_)) if Instant::now() < deadline => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
            r => return Ok(r?),
        }
    }
}

/// Which keys the reads draw.
#[derive(Clone)]
enum Keys {
    /// Uniformly from the first `n` keys.
    Uniform(u64),
    /// Zipfian ranks (the cumulative distribution over all keys), scrambled by FNV-1a.
    Zipf(Arc<Vec<f64>>),
}

impl Keys {
    fn zipf(theta: f64, keys: u64) -> Self {
        let mut cdf = Vec::with_capacity(keys as usize);
        let mut sum = 0.0;
        for r in 0..keys {
            sum += 1.0 / ((r + 1) as f64).powf(theta);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Keys::Zipf(Arc::new(cdf))
    }

    fn draw(&self, rng: &mut StdRng) -> u64 {
        match self {
            Keys::Uniform(n) => rng.random_range(0..*n),
            Keys::Zipf(cdf) => {
                let u: f64 = rng.random();
                let n = cdf.len() as u64;
                let rank = (cdf.partition_point(|&c| c <= u) as u64).min(n - 1);
                fnv1a64(rank) % n
            }
        }
    }
}

/// YCSB's rank scrambling, as in `dinomo bench`.
fn fnv1a64(x: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in x.to_le_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Reads every key once, in key order (one reader), checking every value.
async fn scan(kn: &KvNode, keys: u64, value_len: usize) -> anyhow::Result<()> {
    for i in 0..keys {
        let v = execute(kn, ShardOp::Get { key: key(i) }).await?;
        anyhow::ensure!(
            v.as_deref() == Some(&value(i, value_len)[..]),
            "wrong value for key {i}"
        );
    }
    Ok(())
}

/// Reads `count` keys drawn by `keys`, with `clients` concurrent readers, checking every value
/// (`value_len` bytes).
async fn read_keys(
    kn: &Arc<KvNode>,
    count: u64,
    clients: u64,
    keys: &Keys,
    value_len: usize,
    seed: u64,
) -> anyhow::Result<()> {
    let mut tasks = Vec::new();
    for c in 0..clients {
        let kn = kn.clone();
        let keys = keys.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed * 1000 + c);
            for _ in 0..count / clients {
                let i = keys.draw(&mut rng);
                let v = execute(&kn, ShardOp::Get { key: key(i) }).await?;
                anyhow::ensure!(
                    v.as_deref() == Some(&value(i, value_len)[..]),
                    "wrong value for key {i}"
                );
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

async fn start_kn(
    dpm: &str,
    kn_id: u32,
    policy: &str,
    cache_bytes: u64,
    shards: u32,
) -> anyhow::Result<Arc<KvNode>> {
    let cfg = KnConfigFile {
        shards,
        cache_size: ByteSize(cache_bytes.max(1)),
        cache_policy: policy.parse()?,
        ..KnConfigFile::in_process(kn_id, dpm.to_string())
    }
    .validate()
    .map_err(anyhow::Error::msg)?;
    Ok(KvNode::start(cfg).await?)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let value_len = args.value_bytes as usize;
    let dir = tempfile::tempdir()?;
    let dataset = args.keys * (KEY_BYTES + value_len) as u64;
    let pool = (dataset * 8).max(256 << 20);
    let cfg = DpmConfigFile {
        pool_size: ByteSize(pool),
        fabric: args
            .fabric
            .parse()
            .map_err(|e| anyhow::anyhow!("--fabric: {e}"))?,
        ..DpmConfigFile::in_process(dir.path().join("pool"))
    }
    .validate()
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let server = InProcessDpm::start(cfg)
        .await
        .context("the dpm-node did not start")?;
    let dpm = server.url();

    // Load.
    let t = Instant::now();
    {
        let kn = start_kn(&dpm, 0, "dac", 1 << 20, args.shards).await?;
        let mut tasks = Vec::new();
        for c in 0..args.clients {
            let kn = kn.clone();
            let (n, clients) = (args.keys, args.clients);
            tasks.push(tokio::spawn(async move {
                let mut i = c;
                while i < n {
                    execute(
                        &kn,
                        ShardOp::Put {
                            key: key(i),
                            value: value(i, value_len),
                            mode: PutMode::Upsert,
                        },
                    )
                    .await?;
                    i += clients;
                }
                anyhow::Ok(())
            }));
        }
        for t in tasks {
            t.await??;
        }
    }
    // The loading KN is gone: merge its log before others read (as failover would).
    dinomo_proto::dpm::dpm_service_client::DpmServiceClient::connect(dpm.clone())
        .await?
        .merge_all(dinomo_proto::dpm::MergeAllRequest {
            kn_id: 0,
            seal_open: true,
        })
        .await?;
    println!(
        "loaded {} keys ({KEY_BYTES}-byte keys, {value_len}-byte values: {} bytes of keys+values) in {:.1}s",
        args.keys,
        dataset,
        t.elapsed().as_secs_f64()
    );
    let ws = ((args.keys as f64 * args.working_set_percent / 100.0) as u64).max(1);
    let keys = match args.zipf {
        Some(theta) => Keys::zipf(theta, args.keys),
        None => Keys::Uniform(ws),
    };
    let dist = match args.zipf {
        Some(theta) => format!("scrambled zipf {theta} over all {} keys", args.keys),
        None => format!(
            "uniform over a working set of {ws} keys ({}%)",
            args.working_set_percent
        ),
    };
    println!(
        "reads: {dist}, {} measured per cell after {}{} warm-up reads, {} clients, {} shards, {} fabric",
        args.reads,
        if args.scan_first { "a scan of every key and " } else { "" },
        ws * args.warmup_rounds,
        args.clients,
        args.shards,
        args.fabric
    );
    println!("NOTE: ops/s on this small shared machine is noisy; compare within a column. RTs/op is counted, not timed.\n");

    let mut results = Vec::new();
    for &pct in &args.cache_percent {
        let cache_bytes = (dataset as f64 * pct / 100.0) as u64;
        // One KN per policy (ids 1.., each with an empty cache, all reading the loaded data
        // through the index), warmed up, then measured in interleaved rounds so that drift on
        // this shared machine hits every policy alike; each cell is the median round.
        let mut kns = Vec::new();
        for (i, policy) in args.policies.iter().enumerate() {
            let kn = start_kn(&dpm, i as u32 + 1, policy, cache_bytes, args.shards).await?;
            if args.scan_first {
                scan(&kn, args.keys, value_len).await?;
            }
            read_keys(
                &kn,
                ws * args.warmup_rounds,
                args.clients,
                &keys,
                value_len,
                1,
            )
            .await?;
            kns.push(kn);
        }
        let mut rounds: Vec<
            Vec<(
                f64,
                dinomo_kv_node::node::NodeStats,
                dinomo_kv_node::node::NodeStats,
            )>,
        > = vec![Vec::new(); kns.len()];
        for round in 0..args.repeat {
            for (i, kn) in kns.iter().enumerate() {
                let before = kn.stats(0);
                let t = Instant::now();
                read_keys(kn, args.reads, args.clients, &keys, value_len, 2 + round).await?;
                let secs = t.elapsed().as_secs_f64();
                rounds[i].push((secs, before, kn.stats(0)));
            }
        }
        for (i, policy) in args.policies.iter().enumerate() {
            let mut r = rounds[i].clone();
            r.sort_by(|a, b| a.0.total_cmp(&b.0));
            let (secs, before, after) = r[r.len() / 2].clone();
            let reads = after.gets - before.gets;
            let d = |a: u64, b: u64| (a - b) as f64 / reads as f64;
            results.push(CellResult {
                policy: policy.clone(),
                value_bytes: args.value_bytes,
                cache_percent: pct,
                cache_bytes,
                reads,
                ops_per_sec: reads as f64 / secs,
                rts_per_op: d(after.round_trips, before.round_trips),
                value_hit_ratio: d(after.value_hits, before.value_hits),
                shortcut_hit_ratio: d(after.shortcut_hits, before.shortcut_hits),
                miss_ratio: d(after.misses, before.misses),
            });
        }
        drop(kns);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Tables: one row per policy, one column per cache size.
    let mut headers: Vec<(String, Align)> = vec![("policy".into(), Align::Left)];
    for p in &args.cache_percent {
        headers.push((format!("{p}%"), Align::Right));
    }
    let hdrs: Vec<(&str, Align)> = headers.iter().map(|(h, a)| (h.as_str(), *a)).collect();
    let cell = |p: &str, pct: f64| {
        results
            .iter()
            .find(|r| r.policy == p && r.cache_percent == pct)
            .expect("measured")
    };
    for (title, f) in [
        (
            "ops/s",
            (|r: &CellResult| thousands(r.ops_per_sec)) as fn(&CellResult) -> String,
        ),
        ("RTs/op", |r: &CellResult| format!("{:.3}", r.rts_per_op)),
        ("hits value/shortcut/miss", |r: &CellResult| {
            format!(
                "{:.2}/{:.2}/{:.2}",
                r.value_hit_ratio, r.shortcut_hit_ratio, r.miss_ratio
            )
        }),
    ] {
        let mut t = Table::new(&hdrs);
        for p in &args.policies {
            let mut row = vec![p.clone()];
            row.extend(args.cache_percent.iter().map(|&pct| f(cell(p, pct))));
            t.row(row);
        }
        println!("{title} (columns: cache size as % of the dataset)");
        println!("{}", t.render());
    }
    if args.policies.iter().any(|p| p == "dac") {
        let mut t = Table::new(&hdrs);
        let mut ops = vec!["DAC ops/s vs best".to_string()];
        let mut rts = vec!["DAC RTs/op vs best".to_string()];
        for &pct in &args.cache_percent {
            let dac = cell("dac", pct);
            let best_ops = results
                .iter()
                .filter(|r| r.cache_percent == pct)
                .map(|r| r.ops_per_sec)
                .fold(0.0, f64::max);
            let best_rts = results
                .iter()
                .filter(|r| r.cache_percent == pct)
                .map(|r| r.rts_per_op)
                .fold(f64::INFINITY, f64::min);
            ops.push(format!("{:.0}%", 100.0 * dac.ops_per_sec / best_ops));
            rts.push(if best_rts == 0.0 {
                format!("+{:.3}", dac.rts_per_op)
            } else {
                format!("{:.0}%", 100.0 * dac.rts_per_op / best_rts)
            });
        }
        t.row(ops);
        t.row(rts);
        println!("DAC against the best policy of each column (ops/s: 100% = as fast as the best; RTs/op: 100% = as few as the best, +x = absolute RTs when the best needs none)");
        println!("{}", t.render());
    }
    if let Some(p) = &args.json {
        write_json(p, &results)?;
        println!("wrote {}", p.display());
    }
    server.stop().await?;
    Ok(())
}
