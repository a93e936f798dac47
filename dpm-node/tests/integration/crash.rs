//! Crash test: a KN-like writer logs batches over the tcp fabric into a real dpm-node process
//! while its merge workers and garbage collector run; the dpm-node is killed with SIGKILL at
//! random moments (at least 50 times) and restarted. At the end, after MergeAll, the index
//! must hold exactly what the writer was told is durable:
//! - every acknowledged write is there with its value (for overwritten keys: the last
//!   acknowledged version, or a later one whose acknowledgement was lost in the crash);
//! - nothing that was never attempted, and nothing from a batch the writer tore on purpose.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::testkit::{GrpcSource, LogRecord, LogWriter};
use dinomo_dpm_node::Dpm;
use dinomo_fabric::fault::{FaultPlan, Faulty};
use dinomo_fabric::tcp::TcpFabric;
use dinomo_fabric::AccessKey;
use dinomo_layout::log::{batch_len, entry_len, LogOp};
use dinomo_proto::dpm::{MergeAllRequest, RegisterKnRequest};
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::process::{write_config, DpmProcess};

const KILLS: usize = 50;
const HOT_KEYS: u64 = 20;
const KN: u32 = 1;
/// Bytes of unique-key values written over the whole test, at most: after that the writer
/// only overwrites hot keys. A fast machine writes more per round; without a bound it fills
/// the 64 MiB pool, and a full pool is the power-loss test's subject, not this one's.
/// DINOMO_CRASH_UNIQUE_MIB overrides it (a larger value drives the pool full between kills).
const UNIQUE_BUDGET_MIB: u64 = 24;

/// What the writer knows.
#[derive(Debug, Default)]
struct Ledger {
    /// Unique keys: acknowledged value.
    acked: HashMap<Vec<u8>, Vec<u8>>,
    /// Unique keys whose batch failed with an unknown outcome (crash): may or may not exist.
    maybe: HashMap<Vec<u8>, Vec<u8>>,
    /// Keys of batches torn on purpose: must not exist.
    torn: HashSet<Vec<u8>>,
    /// Hot keys: highest acknowledged version, and highest attempted version.
    hot_acked: HashMap<Vec<u8>, u64>,
    hot_attempted: HashMap<Vec<u8>, u64>,
    /// Segments whose log may end in a torn batch. Nothing more is appended to them; the
    /// writer's next registration (after the DPM restarts) seals and merges them.
    abandoned: Vec<u64>,
    batches_acked: u64,
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn value_for(key: &[u8], version: u64, len: usize) -> Vec<u8> {
    let mut v = format!("{}:{version}:", String::from_utf8_lossy(key)).into_bytes();
    v.resize(len.max(v.len()), b'.');
    v
}

fn version_of(value: &[u8]) -> u64 {
    let s = String::from_utf8_lossy(value);
    s.split(':')
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("value carries its version")
}

async fn register(dpm: &DpmProcess, log: &std::path::Path) -> (GrpcSource, AccessKey) {
    let mut client = dpm.client().await;
    let r = match client
        .register_kn(RegisterKnRequest {
            pid: 0,
            pid_namespace: 0,
            forwards_writes: false,
            kn_id: Some(KN),
            endpoint: "127.0.0.1:1".into(),
        })
        .await
    {
        Ok(r) => r.into_inner(),
        Err(e) => {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(60).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "register: {e}\n--- dpm-node log, last lines ---\n{}",
                tail.join("\n")
            );
        }
    };
    let f = r.fabric.expect("fabric info");
    assert_eq!(f.kind(), dinomo_proto::dpm::FabricKind::Tcp);
    (
        GrpcSource {
            client,
            kn: KN,
            epoch: r.epoch,
        },
        AccessKey {
            slot: f.grant_slot,
            generation: f.grant_generation,
            secret: f
                .grant_secret
                .as_slice()
                .try_into()
                .expect("a 16-byte secret"),
        },
    )
}

/// Writes until the first error; returns how many batches were acknowledged.
async fn write_until_error(
    mut w: LogWriter<Faulty<TcpFabric>, GrpcSource>,
    ledger: Arc<Mutex<Ledger>>,
    mut rng: StdRng,
    next_unique: Arc<std::sync::atomic::AtomicU64>,
    next_version: Arc<std::sync::atomic::AtomicU64>,
    unique_bytes: Arc<std::sync::atomic::AtomicU64>,
) {
    use std::sync::atomic::Ordering::Relaxed;
    let unique_budget = env_u64("DINOMO_CRASH_UNIQUE_MIB", UNIQUE_BUDGET_MIB) << 20;
    loop {
        let n = rng.random_range(1..=12);
        let mut batch = Vec::with_capacity(n);
        for _ in 0..n {
            let version = next_version.fetch_add(1, Relaxed);
            let len = rng.random_range(16..1500);
            let unique_left = unique_bytes.load(Relaxed) < unique_budget;
            let key = if !unique_left || rng.random_bool(0.3) {
                format!("hot{}", rng.random_range(0..HOT_KEYS)).into_bytes()
            } else {
                format!("u{}", next_unique.fetch_add(1, Relaxed)).into_bytes()
            };
            let value = value_for(&key, version, len);
            if !key.starts_with(b"hot") {
                unique_bytes.fetch_add(value.len() as u64, Relaxed);
            }
            batch.push(LogRecord {
                op: LogOp::Put,
                version,
                key,
                value,
            });
        }
        let mut tear = rng.random_bool(0.05);
        if tear {
            // Strictly inside the batch: a tear after its last byte would be a whole write.
            let payload: usize = batch
                .iter()
                .map(|r| entry_len(r.key.len(), r.value.len()))
                .sum();
            let k = rng.random_range(0..batch_len(payload));
            w.fabric().set_plan(FaultPlan {
                tear_next_write_after: Some(k),
                ..Default::default()
            });
        }
        {
            let mut l = ledger.lock();
            for r in &batch {
                if r.key.starts_with(b"hot") {
                    let a = l.hot_attempted.entry(r.key.clone()).or_default();
                    *a = (*a).max(r.version);
                }
            }
        }
        match w.append(&batch).await {
            Ok(_) => {
                assert!(!tear, "a torn write must fail");
                let mut l = ledger.lock();
                l.batches_acked += 1;
                for r in batch {
                    if r.key.starts_with(b"hot") {
                        let a = l.hot_acked.entry(r.key).or_default();
                        *a = (*a).max(r.version);
                    } else {
                        l.acked.insert(r.key, r.value);
                    }
                }
            }
            Err(_) => {
                if tear && w.fabric().plan().tear_next_write_after.is_some() {
                    // Failed before the write was posted (the DPM died): not a tear.
                    w.fabric().set_plan(FaultPlan::default());
                    tear = false;
                }
                let mut l = ledger.lock();
                if let Some(id) = w.abandon() {
                    l.abandoned.push(id);
                }
                for r in batch {
                    if r.key.starts_with(b"hot") {
                        continue; // covered by hot_attempted
                    }
                    if tear {
                        l.torn.insert(r.key);
                    } else {
                        l.maybe.insert(r.key, r.value);
                    }
                }
                if tear {
                    // The fabric still works: carry on in a new segment, as a KN does.
                    continue;
                }
                return;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dpm_killed_50_times_keeps_exactly_the_acknowledged_writes() {
    let seed: u64 = std::env::var("DINOMO_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("crash test seed {seed} (rerun with DINOMO_CRASH_SEED={seed})");
    let mut rng = StdRng::seed_from_u64(seed);
    // Longest time a round writes before the kill (DINOMO_CRASH_ROUND_MS; default 80 ms).
    let round_ms = env_u64("DINOMO_CRASH_ROUND_MS", 80).max(6);
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(
        dir.path(),
        "fabric = \"tcp\"\nmerge_workers = 2\nclean_threshold = 0.3\n",
    );
    let log = dir.path().join("dpm.log");
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let next_unique = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let next_version = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let unique_bytes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();

    for round in 0..KILLS {
        let mut dpm = DpmProcess::start(&cfg, &log);
        let (src, key) = register(&dpm, &log).await;
        let nic = dpm.fabric.expect("a tcp dpm-node prints its NIC address");
        let fabric = TcpFabric::connect(nic, key).await.expect("fabric connect");
        let w = LogWriter::new(Faulty::new(fabric), src);
        let task = tokio::spawn(write_until_error(
            w,
            ledger.clone(),
            StdRng::seed_from_u64(rng.random()),
            next_unique.clone(),
            next_version.clone(),
            unique_bytes.clone(),
        ));
        tokio::time::sleep(Duration::from_millis(rng.random_range(5..round_ms))).await;
        dpm.kill9();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .unwrap_or_else(|_| panic!("round {round}: the writer did not notice the crash"))
            .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "crash test exceeded its time bound"
        );
    }

    // Final restart: merge everything, stop cleanly, inspect the pool.
    let mut dpm = DpmProcess::start(&cfg, &log);
    let (src, _) = register(&dpm, &log).await;
    let merged = src
        .client
        .clone()
        .merge_all(MergeAllRequest {
            kn_id: KN,
            seal_open: true,
        })
        .await
        .expect("MergeAll")
        .into_inner();
    dpm.stop();

    let mut file =
        DpmConfigFile::from_toml(&std::fs::read_to_string(&cfg).unwrap(), "dpm config").unwrap();
    file.gc_interval_ms = 1_000_000;
    let dpm = Dpm::open(file.validate().unwrap()).unwrap();
    let l = ledger.lock();
    assert!(
        l.batches_acked > 100,
        "too few batches acknowledged to mean anything: {}",
        l.batches_acked
    );
    for (k, v) in &l.acked {
        let found = dpm
            .lookup(k)
            .unwrap()
            .unwrap_or_else(|| panic!("acknowledged key {} lost", String::from_utf8_lossy(k)));
        assert_eq!(&found.value, v, "key {}", String::from_utf8_lossy(k));
    }
    let mut maybe_present = 0;
    for (k, v) in &l.maybe {
        if let Some(found) = dpm.lookup(k).unwrap() {
            assert_eq!(&found.value, v);
            maybe_present += 1;
        }
    }
    for k in &l.torn {
        assert!(
            dpm.lookup(k).unwrap().is_none(),
            "key {} of a torn batch was indexed",
            String::from_utf8_lossy(k)
        );
    }
    for (k, attempted) in &l.hot_attempted {
        let acked = l.hot_acked.get(k).copied().unwrap_or(0);
        match dpm.lookup(k).unwrap() {
            Some(found) => {
                let v = version_of(&found.value);
                assert!(
                    v >= acked && v <= *attempted,
                    "hot key {}: version {v} outside [{acked}, {attempted}]",
                    String::from_utf8_lossy(k)
                );
            }
            None => assert_eq!(
                acked,
                0,
                "hot key {} lost (acked version {acked})",
                String::from_utf8_lossy(k)
            ),
        }
    }
    // Nothing else is indexed.
    let known: usize = l.acked.len()
        + maybe_present
        + l.hot_attempted
            .keys()
            .filter(|k| dpm.lookup(k).unwrap().is_some())
            .count();
    assert_eq!(
        dpm.stats().index_items as usize,
        known,
        "the index holds entries nobody wrote"
    );
    println!(
        "crash test: {KILLS} kills, {} batches acked, {} unique keys acked, {} maybe ({} present), {} torn keys, {} hot keys, final MergeAll {} entries / {} invalid log tails, {:.1}s",
        l.batches_acked,
        l.acked.len(),
        l.maybe.len(),
        maybe_present,
        l.torn.len(),
        l.hot_attempted.len(),
        merged.entries,
        merged.invalid_tails,
        started.elapsed().as_secs_f64()
    );
}
