//! dac-bench: the DAC experiment of DINOMO Figure 3, scaled to this machine.
//!
//! Loads N keys (8-byte keys, 64-byte values) through a KV node into an in-process dpm-node
//! (shm fabric), then, for each cache policy (DAC, shortcut-only, value-only, static-50%) and
//! cache size (1, 2, 4, 8, 16% of the dataset's key+value bytes), starts a KV node with an empty
//! cache, warms it up, and runs a read-only workload drawn uniformly from a 5% working set, in
//! rounds interleaved across the policies (the median round is reported).
//! Each cell reports ops/s and round trips per op (counted by the fabric, not timed).
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
use dinomo_kv_node::KvNode;
use dinomo_node_common::config::ByteSize;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(about = "DINOMO Figure 3: DAC vs static cache policies across cache sizes")]
struct Args {
    /// Keys loaded (8-byte keys, 64-byte values).
    #[arg(long, default_value_t = 100_000)]
    keys: u64,
    /// Share of the keys that the reads touch (uniformly), in percent.
    #[arg(long, default_value_t = 5.0)]
    working_set_percent: f64,
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
const VALUE_BYTES: usize = 64;

fn key(i: u64) -> Bytes {
    Bytes::copy_from_slice(&i.to_be_bytes())
}

fn value(i: u64) -> Bytes {
    let mut v = vec![0u8; VALUE_BYTES];
    v[..8].copy_from_slice(&i.to_le_bytes());
    Bytes::from(v)
}

/// Reads `count` keys drawn uniformly from the first `ws` keys, with `clients` concurrent
/// readers, checking every value.
async fn read_uniform(
    kn: &Arc<KvNode>,
    count: u64,
    clients: u64,
    ws: u64,
    seed: u64,
) -> anyhow::Result<()> {
    let mut tasks = Vec::new();
    for c in 0..clients {
        let kn = kn.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed * 1000 + c);
            for _ in 0..count / clients {
                let i = rng.random_range(0..ws);
                let v = kn.execute(ShardOp::Get { key: key(i) }).await?;
                anyhow::ensure!(
                    v.as_deref() == Some(&value(i)[..]),
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
    let dir = tempfile::tempdir()?;
    let dataset = args.keys * (KEY_BYTES + VALUE_BYTES) as u64;
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
                    kn.execute(ShardOp::Put {
                        key: key(i),
                        value: value(i),
                        mode: PutMode::Upsert,
                    })
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
        "loaded {} keys ({} bytes of keys+values) in {:.1}s",
        args.keys,
        dataset,
        t.elapsed().as_secs_f64()
    );
    let ws = ((args.keys as f64 * args.working_set_percent / 100.0) as u64).max(1);
    println!(
        "reads: uniform over a working set of {ws} keys ({}%), {} measured per cell after {} warm-up rounds, {} clients, {} shards, {} fabric",
        args.working_set_percent, args.reads, args.warmup_rounds, args.clients, args.shards, args.fabric
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
            read_uniform(&kn, ws * args.warmup_rounds, args.clients, ws, 1).await?;
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
                read_uniform(kn, args.reads, args.clients, ws, 2 + round).await?;
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
