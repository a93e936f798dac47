//! The KN's one-sided index reader while the DPM grows the index under it: a reader that keeps
//! its (increasingly stale) view of the index shape must find every merged key, following
//! bucket depths to the buckets that splits moved keys to (dinomo_layout::index).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::testkit::{LocalSource, LogRecord, LogWriter};
use dinomo_dpm_node::Dpm;
use dinomo_fabric::shm::ShmFabric;
use dinomo_kv_node::remote_index::RemoteIndex;
use dinomo_layout::log::LogOp;
use rand::Rng;

fn key(i: u64) -> Vec<u8> {
    format!("key-{i:08}").into_bytes()
}

fn value(i: u64) -> Vec<u8> {
    format!("value-{i}").into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_reader_finds_every_merged_key_while_buckets_split() {
    const KEYS: u64 = 30_000;
    const BATCH: u64 = 100;
    let dir = tempfile::tempdir().unwrap();
    let cfg = DpmConfigFile {
        pool_size: "64MiB".parse().unwrap(),
        segment_size: "256KiB".parse().unwrap(),
        initial_index_buckets: 64,
        ..DpmConfigFile::in_process(dir.path().join("pool"))
    }
    .validate()
    .unwrap();
    let dpm = Dpm::open(cfg).unwrap();
    let writer_reg = dpm.register_kn(Some(1), "writer").unwrap();
    let reader_reg = dpm.register_kn(Some(2), "reader").unwrap();
    let shm = |key| ShmFabric::from_parts(dpm.pool().region().clone(), dpm.grants().clone(), key);
    let mut writer = LogWriter::new(
        shm(writer_reg.key),
        LocalSource {
            dpm: dpm.clone(),
            kn: 1,
            epoch: writer_reg.epoch,
        },
    );
    let merged = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let reader = {
        let (merged, done) = (merged.clone(), done.clone());
        let fabric = shm(reader_reg.key);
        let root = reader_reg.index_root;
        tokio::spawn(async move {
            let mut index = RemoteIndex::new(root);
            let mut lookups = 0u64;
            while !done.load(Ordering::Acquire) {
                let n = merged.load(Ordering::Acquire);
                if n == 0 {
                    tokio::task::yield_now().await;
                    continue;
                }
                let i = rand::rng().random_range(0..n);
                let got = index.lookup(&fabric, &key(i)).await.unwrap();
                let got = got.unwrap_or_else(|| panic!("merged key {i} not found (of {n})"));
                assert_eq!(&got.value[..], &value(i)[..], "key {i}");
                lookups += 1;
            }
            lookups
        })
    };
    let mut version = 0;
    for start in (0..KEYS).step_by(BATCH as usize) {
        let batch: Vec<LogRecord> = (start..start + BATCH)
            .map(|i| {
                version += 1;
                LogRecord {
                    op: LogOp::Put,
                    version,
                    key: key(i),
                    value: value(i),
                }
            })
            .collect();
        writer.append(&batch).await.unwrap();
        let d = dpm.clone();
        tokio::task::spawn_blocking(move || d.merge_all(1, false).unwrap())
            .await
            .unwrap();
        merged.store(start + BATCH, Ordering::Release);
        tokio::task::yield_now().await;
    }
    done.store(true, Ordering::Release);
    let lookups = reader.await.unwrap();
    let s = dpm.stats();
    println!(
        "{lookups} lookups by a reader with a stale shape while the index split {} times to {} buckets",
        s.index_resizes, s.index_buckets
    );
    assert!(s.index_resizes > 10_000, "{s:?}");
    assert!(
        lookups > 1_000,
        "the reader ran alongside the splits ({lookups} lookups)"
    );
    // And a fresh reader finds everything too.
    let fabric = shm(reader_reg.key);
    let mut fresh = RemoteIndex::new(reader_reg.index_root);
    for i in (0..KEYS).step_by(7) {
        let got = fresh.lookup(&fabric, &key(i)).await.unwrap().unwrap();
        assert_eq!(&got.value[..], &value(i)[..]);
    }
    assert!(fresh.lookup(&fabric, b"absent").await.unwrap().is_none());
}
