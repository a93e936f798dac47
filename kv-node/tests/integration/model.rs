//! Random operation sequences under every cache policy, checked against a model map. Small
//! caches (evictions, demotions, promotions), small segments (seals, merges, the unmerged-log
//! path, garbage collection and cleaning that move entries under cached shortcuts).

use std::collections::HashMap;

use bytes::Bytes;
use dinomo_kv_node::config::KnConfigFile;
use dinomo_kv_node::shard::{PutMode, ShardOp};
use dinomo_kv_node::{KvError, KvNode};
use dinomo_node_common::config::ByteSize;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::harness::InProcDpm;

async fn run_policy(policy: &str, seed: u64) {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "128KiB").await;
    let cfg = KnConfigFile {
        shards: 2,
        cache_size: "48KiB".parse().unwrap(),
        cache_policy: policy.parse().unwrap(),
        max_value_bytes: ByteSize(4096),
        batch_bytes: ByteSize(8192),
        ..KnConfigFile::in_process(0, dpm.url())
    }
    .validate()
    .unwrap();
    let node = KvNode::start(cfg).await.unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
    let mut counts = [0u32; 4];
    for step in 0..2500 {
        let key = format!("key{}", rng.random_range(0..120)).into_bytes();
        let choice = rng.random_range(0..10);
        let ctx = format!("policy {policy} seed {seed} step {step}");
        if choice < 5 {
            counts[0] += 1;
            let got = node
                .execute(ShardOp::Get {
                    key: Bytes::from(key.clone()),
                })
                .await;
            match model.get(&key) {
                Some(v) => assert_eq!(got.unwrap().as_deref(), Some(&v[..]), "{ctx}"),
                None => assert_eq!(got.unwrap_err(), KvError::NotFound, "{ctx}"),
            }
        } else if choice < 9 {
            counts[1] += 1;
            let len = if rng.random_bool(0.2) {
                rng.random_range(1000..4000)
            } else {
                rng.random_range(0..200)
            };
            let value: Vec<u8> = (0..len)
                .map(|i| (i as u8).wrapping_add(step as u8))
                .collect();
            let mode = match rng.random_range(0..3) {
                0 => PutMode::Upsert,
                1 => PutMode::Insert,
                _ => PutMode::Update,
            };
            let got = node
                .execute(ShardOp::Put {
                    key: Bytes::from(key.clone()),
                    value: Bytes::from(value.clone()),
                    mode,
                })
                .await;
            let exists = model.contains_key(&key);
            match (mode, exists) {
                (PutMode::Insert, true) => {
                    assert_eq!(got.unwrap_err(), KvError::AlreadyExists, "{ctx}")
                }
                (PutMode::Update, false) => {
                    assert_eq!(got.unwrap_err(), KvError::UpdateMissing, "{ctx}")
                }
                _ => {
                    got.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    model.insert(key, value);
                }
            }
        } else {
            counts[2] += 1;
            let got = node
                .execute(ShardOp::Delete {
                    key: Bytes::from(key.clone()),
                })
                .await;
            match model.remove(&key) {
                Some(_) => got
                    .unwrap_or_else(|e| panic!("{ctx}: {e}"))
                    .map_or((), |_| ()),
                None => assert_eq!(got.unwrap_err(), KvError::NotFound, "{ctx}"),
            }
        }
    }
    // Every key, one last time.
    for i in 0..120 {
        let key = format!("key{i}").into_bytes();
        let got = node
            .execute(ShardOp::Get {
                key: Bytes::from(key.clone()),
            })
            .await;
        match model.get(&key) {
            Some(v) => assert_eq!(got.unwrap().as_deref(), Some(&v[..]), "final {policy}"),
            None => assert_eq!(got.unwrap_err(), KvError::NotFound, "final {policy}"),
        }
    }
    let s = node.stats(0);
    println!(
        "{policy}: {} gets {} puts {} deletes; hits value {} shortcut {} unmerged {} miss {}; {} batches; {} RTs; promotions {} demotions {}",
        s.gets, s.puts, s.deletes, s.value_hits, s.shortcut_hits, s.unmerged_hits, s.misses, s.batches, s.round_trips, s.promotions, s.demotions
    );
    assert!(
        s.misses > 0,
        "the cache is small enough that reads go to the DPM"
    );
    drop(node);
    dpm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_ops_match_the_model_under_dac() {
    run_policy("dac", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_ops_match_the_model_shortcut_only() {
    run_policy("shortcut-only", 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_ops_match_the_model_value_only() {
    run_policy("value-only", 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_ops_match_the_model_static_50() {
    run_policy("static-50", 4).await;
}
