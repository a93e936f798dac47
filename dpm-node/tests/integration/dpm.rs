//! The DPM as a library: merge, MergeAll, GC, cleaning, resize, fencing, torn batches, bad
//! pools, metadata. KN logs are written through the real shm fabric by the testkit writer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::testkit::{LocalSource, LogRecord, LogWriter};
use dinomo_dpm_node::{Dpm, DpmError};
use dinomo_fabric::fault::{FaultPlan, Faulty};
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::DurabilityRequest;
use dinomo_layout::log::LogOp;

fn config(
    dir: &std::path::Path,
    f: impl FnOnce(&mut DpmConfigFile),
) -> dinomo_dpm_node::config::DpmConfig {
    let mut c = DpmConfigFile {
        pool_path: dir.join("pool"),
        pool_size: "64MiB".into(),
        segment_size: "256KiB".into(),
        listen: "127.0.0.1:0".into(),
        fabric_listen: "127.0.0.1:0".into(),
        metrics_listen: String::new(),
        initial_index_buckets: 64,
        gc_interval_ms: 10,
        ..Default::default()
    };
    f(&mut c);
    c.validate().unwrap()
}

type Writer = LogWriter<Faulty<ShmFabric>, LocalSource>;

fn writer(dpm: &Arc<Dpm>, kn: u32) -> Writer {
    let reg = dpm.register_kn(Some(kn), "test").unwrap();
    let fabric =
        ShmFabric::connect(&dpm.config.pool_path, reg.key, DurabilityRequest::Auto).unwrap();
    LogWriter::new(
        Faulty::new(fabric),
        LocalSource {
            dpm: dpm.clone(),
            kn,
            epoch: reg.epoch,
        },
    )
}

fn put(k: &str, v: &str, version: u64) -> LogRecord {
    LogRecord {
        op: LogOp::Put,
        version,
        key: k.as_bytes().to_vec(),
        value: v.as_bytes().to_vec(),
    }
}

fn del(k: &str, version: u64) -> LogRecord {
    LogRecord {
        op: LogOp::Delete,
        version,
        key: k.as_bytes().to_vec(),
        value: vec![],
    }
}

fn value(dpm: &Dpm, k: &str) -> Option<String> {
    dpm.lookup(k.as_bytes())
        .unwrap()
        .map(|f| String::from_utf8(f.value).unwrap())
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[tokio::test]
async fn sealed_segments_are_merged_in_order_by_workers() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |_| {})).unwrap();
    let mut w = writer(&dpm, 1);
    w.append(&[put("a", "1", 1), put("b", "1", 2)])
        .await
        .unwrap();
    w.append(&[put("a", "2", 3), del("b", 4), put("c", "1", 5)])
        .await
        .unwrap();
    // Unsealed: not merged by the background workers.
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(value(&dpm, "a"), None);
    w.seal().await.unwrap();
    wait_until("merge", || dpm.pending_segments(1) == 0);
    assert_eq!(value(&dpm, "a").as_deref(), Some("2"));
    assert_eq!(value(&dpm, "b"), None);
    assert_eq!(value(&dpm, "c").as_deref(), Some("1"));
}

#[tokio::test]
async fn merge_all_covers_open_segments_and_many_segments() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |c| c.merge_workers = 1)).unwrap();
    let mut w = writer(&dpm, 2);
    // ~2000 entries of 300 bytes: several 256 KiB segments.
    let val = "x".repeat(300);
    for i in 0..200 {
        let batch: Vec<_> = (0..10)
            .map(|j| put(&format!("k{}", i * 10 + j), &val, (i * 10 + j) as u64))
            .collect();
        w.append(&batch).await.unwrap();
    }
    let r = dpm.merge_all(2, true).unwrap();
    assert_eq!(dpm.pending_segments(2), 0, "{r:?}");
    for i in 0..2000 {
        assert_eq!(
            value(&dpm, &format!("k{i}")).as_deref(),
            Some(val.as_str()),
            "k{i}"
        );
    }
    // Also a resize happened on the way (64 initial buckets).
    assert!(dpm.stats().index_resizes > 0);
    assert_eq!(dpm.stats().index_items, 2000);
}

#[tokio::test]
async fn dead_segments_are_freed_and_sparse_ones_cleaned() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |c| c.clean_threshold = 0.5)).unwrap();
    let mut w = writer(&dpm, 3);
    let free0 = dpm.stats().segments_free;
    let val = "v".repeat(500);
    // 50 keys overwritten 40 times: most segments become fully dead.
    let mut version = 0;
    for round in 0..40 {
        let batch: Vec<_> = (0..50)
            .map(|k| {
                version += 1;
                put(&format!("key{k}"), &format!("{round}-{val}"), version)
            })
            .collect();
        w.append(&batch).await.unwrap();
    }
    // One survivor in an old segment, so that segment is sparse (cleaned, not just freed).
    w.seal().await.unwrap();
    dpm.merge_all(3, true).unwrap();
    wait_until("gc", || dpm.stats().segments_free + 2 >= free0);
    for k in 0..50 {
        assert_eq!(value(&dpm, &format!("key{k}")), Some(format!("39-{val}")));
    }
}

#[tokio::test]
async fn cleaner_moves_live_entries_and_keeps_them_readable() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |c| {
        c.clean_threshold = 0.5;
        c.gc_interval_ms = 100_000; // drive GC by hand
    }))
    .unwrap();
    let mut w = writer(&dpm, 4);
    let val = "w".repeat(1000);
    for i in 0..500 {
        w.append(&[put(&format!("s{i}"), &val, i)]).await.unwrap();
    }
    // Overwrite all but every tenth key: old segments keep ~10% live bytes.
    for i in 0..500 {
        if i % 10 != 0 {
            w.append(&[put(&format!("s{i}"), "new", 1000 + i)])
                .await
                .unwrap();
        }
    }
    w.seal().await.unwrap();
    dpm.merge_all(4, true).unwrap();
    let before = dpm.stats().segments_free;
    let r = dpm.gc().run_once().unwrap();
    assert!(
        r.cleaned > 0 && r.moved_entries > 0,
        "{r:?} {:?}",
        dpm.stats()
    );
    let r2 = dpm.gc().run_once().unwrap();
    assert!(r2.freed > 0, "cleaned segments must be freed next: {r2:?}");
    assert!(dpm.stats().segments_free > before);
    for i in 0..500 {
        let want = if i % 10 == 0 {
            val.clone()
        } else {
            "new".into()
        };
        assert_eq!(value(&dpm, &format!("s{i}")), Some(want), "s{i}");
    }
    // And after a restart, from the pool alone.
    let cfg = dpm.config.clone();
    drop(w);
    drop(dpm);
    let dpm = Dpm::open(cfg).unwrap();
    assert_eq!(value(&dpm, "s10"), Some(val.clone()));
    assert_eq!(value(&dpm, "s11").as_deref(), Some("new"));
}

#[tokio::test]
async fn torn_batch_is_dropped_whole_and_earlier_batches_survive() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |_| {})).unwrap();
    let mut w = writer(&dpm, 5);
    w.append(&[put("ok1", "a", 1), put("ok2", "b", 2)])
        .await
        .unwrap();
    w.fabric().set_plan(FaultPlan {
        tear_next_write_after: Some(40),
        ..Default::default()
    });
    assert!(w
        .append(&[put("torn1", "c", 3), put("torn2", "d", 4)])
        .await
        .is_err());
    let r = dpm.merge_all(5, true).unwrap();
    assert_eq!(r.invalid_tails, 1, "{r:?}");
    assert_eq!(value(&dpm, "ok1").as_deref(), Some("a"));
    assert_eq!(value(&dpm, "ok2").as_deref(), Some("b"));
    assert_eq!(value(&dpm, "torn1"), None);
    assert_eq!(value(&dpm, "torn2"), None);
}

#[tokio::test]
async fn fenced_kn_loses_fabric_access_and_control_calls() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |_| {})).unwrap();
    let mut w = writer(&dpm, 6);
    w.append(&[put("f", "1", 1)]).await.unwrap();
    let reg_epoch = dpm.stats();
    let _ = reg_epoch;
    dpm.fence_kn(6).unwrap();
    let err = w.append(&[put("f", "2", 2)]).await.unwrap_err();
    assert!(matches!(err, DpmError::Fabric(_)), "{err}");
    assert!(matches!(
        dpm.allocate_segment(6, 0, 1),
        Err(DpmError::Fenced { .. })
    ));
    dpm.merge_all(6, true).unwrap();
    assert_eq!(value(&dpm, "f").as_deref(), Some("1"));
    // A new incarnation works again.
    let mut w2 = writer(&dpm, 6);
    w2.append(&[put("f", "3", 3)]).await.unwrap();
    dpm.merge_all(6, true).unwrap();
    assert_eq!(value(&dpm, "f").as_deref(), Some("3"));
}

#[tokio::test]
async fn restart_keeps_index_metadata_cells_and_fences() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), |_| {});
    {
        let dpm = Dpm::open(cfg.clone()).unwrap();
        let mut w = writer(&dpm, 7);
        w.append(&[put("p", "persisted", 1)]).await.unwrap();
        dpm.merge_all(7, false).unwrap();
        dpm.put_metadata("cluster/map", Some(b"v1")).unwrap();
        dpm.put_metadata("cluster/map", Some(b"v2")).unwrap();
        let cell = dpm.install_cell(b"p").unwrap();
        assert_eq!(dpm.install_cell(b"p").unwrap(), cell);
        assert!(
            dpm.put_metadata("dpm/kn/1", Some(b"x")).is_err(),
            "reserved names are refused"
        );
        dpm.fence_kn(7).unwrap();
    }
    let dpm = Dpm::open(cfg).unwrap();
    assert_eq!(value(&dpm, "p").as_deref(), Some("persisted"));
    assert_eq!(dpm.get_metadata("cluster/map").as_deref(), Some(&b"v2"[..]));
    assert!(matches!(
        dpm.allocate_segment(7, 0, 1),
        Err(DpmError::Fenced { .. })
    ));
    let cell = dpm.install_cell(b"p").unwrap();
    let word = dpm
        .pool()
        .region()
        .word(cell)
        .unwrap()
        .load(std::sync::atomic::Ordering::Acquire);
    assert_eq!(
        dinomo_layout::index::EntryPtr::from_word(word),
        Some(dpm.lookup(b"p").unwrap().unwrap().ptr)
    );
    assert!(dpm.remove_cell(b"p").unwrap());
}

#[test]
fn bad_pools_are_refused_with_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path(), |c| c.create = false);
    let path = cfg.pool_path.clone();
    let open = || Dpm::open(cfg.clone()).map(|_| ()).unwrap_err().to_string();

    assert!(open().contains("does not exist"), "{}", open());

    std::fs::write(&path, vec![0x42u8; 1 << 20]).unwrap();
    assert!(open().contains("bad magic"), "foreign file: {}", open());

    std::fs::write(&path, b"tiny").unwrap();
    assert!(open().contains("too small"), "{}", open());

    // A real pool, then damaged in several ways.
    let good = config(dir.path(), |_| {});
    std::fs::remove_file(&path).unwrap();
    drop(Dpm::open(good).unwrap());
    let pristine = std::fs::read(&path).unwrap();

    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(pristine.len() as u64 / 2).unwrap();
    assert!(open().contains("truncated"), "{}", open());

    let mut bytes = pristine.clone();
    bytes[20] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    assert!(
        open().contains("checksum mismatch"),
        "corrupted superblock: {}",
        open()
    );

    let mut bytes = pristine.clone();
    bytes[8..12].copy_from_slice(&99u32.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let e = open();
    assert!(e.contains("version 99") && e.contains("version 1"), "{e}");

    std::fs::write(&path, &pristine).unwrap();
    Dpm::open(cfg.clone()).expect("the undamaged pool opens");
}

/// Selective replication at the DPM: a cell pins the segment its entry lives in (even when the
/// index no longer points there), and removing the cell writes its value back into the index.
#[tokio::test]
async fn a_cell_pins_its_segment_and_its_removal_writes_the_value_back() {
    use dinomo_fabric::FabricExt;
    use dinomo_layout::segment::SegState;
    use std::sync::atomic::Ordering;

    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |_| {})).unwrap();
    let mut w1 = writer(&dpm, 1);
    let mut w2 = writer(&dpm, 2);
    w1.append(&[put("hot", "v0", 1)]).await.unwrap();
    w1.seal().await.unwrap();
    dpm.merge_all(1, true).unwrap();
    let cell = dpm.install_cell(b"hot").unwrap();
    assert_eq!(
        dpm.install_cell(b"hot").unwrap(),
        cell,
        "installing is idempotent"
    );
    assert_eq!(value(&dpm, "hot").as_deref(), Some("v0"));

    // KN 2 writes through the cell, as an owner does: log, then CAS.
    let p = w2.append(&[put("hot", "v1", 2)]).await.unwrap()[0];
    let word = |d: &Dpm| {
        d.pool()
            .region()
            .word(cell)
            .unwrap()
            .load(Ordering::Acquire)
    };
    let old = word(&dpm);
    let seen = w2.fabric().cas(cell, old, p.to_word()).await.unwrap();
    assert_eq!(seen, old);
    w2.seal().await.unwrap();
    dpm.merge_all(2, true).unwrap();
    // KN 1's later entry merges after KN 2's: the index now names it, the cell does not.
    w1.append(&[put("hot", "stale", 3)]).await.unwrap();
    w1.seal().await.unwrap();
    dpm.merge_all(1, true).unwrap();
    assert_eq!(
        value(&dpm, "hot").as_deref(),
        Some("v1"),
        "the cell is the value of record"
    );

    // KN 2's segment has no live byte by the index, but the cell pins it through many GC passes.
    let seg = dpm.pool().superblock().segment_of(p.offset).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let state = dpm.pool().read_table_entry(seg).unwrap().state;
    assert_ne!(
        state,
        SegState::Free,
        "the segment a cell points into was freed"
    );
    assert_eq!(value(&dpm, "hot").as_deref(), Some("v1"));

    // De-replication: the cell's value goes back to the index.
    assert!(dpm.remove_cell(b"hot").unwrap());
    assert!(!dpm.remove_cell(b"hot").unwrap());
    let hash = dinomo_layout::key_hash(b"hot");
    assert_eq!(dpm.index().lookup(b"hot", hash).unwrap(), Some(p));
    assert_eq!(value(&dpm, "hot").as_deref(), Some("v1"));
    // And the index's reference keeps the segment alive from now on.
    std::thread::sleep(Duration::from_millis(100));
    assert_ne!(
        dpm.pool().read_table_entry(seg).unwrap().state,
        SegState::Free
    );
}
