//! The DPM as a library: merge, MergeAll, GC, cleaning, resize, fencing, torn batches, bad
//! pools, metadata. KN logs are written through the real shm fabric by the testkit writer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::replication::image::ImageId;
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
        pool_size: "64MiB".parse().unwrap(),
        segment_size: "256KiB".parse().unwrap(),
        initial_index_buckets: 64,
        gc_interval_ms: 10,
        // Every merge, clean and cell removal in these tests is checked against a recount.
        verify_accounting: true,
        ..DpmConfigFile::in_process(dir.join("pool"))
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

/// An encoded one-KN cluster map of `version` (the DPM publishes only real maps).
pub fn cluster_map(version: u64) -> Vec<u8> {
    cluster_map_at(version, 7801)
}

/// [`cluster_map`] with its KN at `port`: maps of one version that differ.
pub fn cluster_map_at(version: u64, port: u16) -> Vec<u8> {
    let mut m = dinomo_placement::ClusterMap::new(
        vec![dinomo_placement::KnInfo {
            id: 1,
            endpoint: format!("127.0.0.1:{port}"),
        }],
        16,
        1,
    )
    .unwrap();
    m.version = version;
    m.encode()
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
    // Unsealed: not merged by the background workers (two whole passes go by).
    let p = dpm.merger().passes();
    wait_until("two merge passes", || dpm.merger().passes() >= p + 2);
    assert_eq!(value(&dpm, "a"), None);
    w.seal().await.unwrap();
    wait_until("merge", || dpm.pending_segments(1) == 0);
    assert_eq!(value(&dpm, "a").as_deref(), Some("2"));
    assert_eq!(value(&dpm, "b"), None);
    assert_eq!(value(&dpm, "c").as_deref(), Some("1"));
}

#[tokio::test]
async fn a_pool_being_prefaulted_serves_at_once_and_shuts_down_promptly() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |c| {
        c.prefault = true;
        c.pool_size = "512MiB".parse().unwrap();
    }))
    .unwrap();
    let mut w = writer(&dpm, 1);
    w.append(&[put("a", "1", 1)]).await.unwrap();
    w.seal().await.unwrap();
    wait_until("merge", || dpm.pending_segments(1) == 0);
    assert_eq!(value(&dpm, "a").as_deref(), Some("1"));
    // The prefault pass (if it is still going) stops at its next chunk.
    let t = Instant::now();
    dpm.shutdown();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
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

/// A segment abandoned after a few batches (a KN that crashed, a failed WRITE, the cleaner's
/// target at a restart) is nearly empty but all live. Space is what GC gives back, so it is
/// as sparse as its live bytes are small against the segment, not against what was written:
/// one such segment per crash would otherwise leak until the pool is full.
#[tokio::test]
async fn nearly_empty_segments_that_are_all_live_are_compacted() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |c| c.clean_threshold = 0.3)).unwrap();
    let mut abandoned = Vec::new();
    for round in 0..4 {
        let mut w = writer(&dpm, 4);
        w.append(&[put(&format!("k{round}"), "all live", round + 1)])
            .await
            .unwrap();
        abandoned.push(w.abandon().expect("an open segment"));
        dpm.merge_all(4, true).unwrap();
    }
    wait_until("the abandoned segments are compacted", || {
        abandoned
            .iter()
            .filter(|&&id| {
                dpm.pool().read_table_entry(id).unwrap().state
                    == dinomo_layout::segment::SegState::Free
            })
            .count()
            == abandoned.len()
    });
    for round in 0..4 {
        assert_eq!(
            value(&dpm, &format!("k{round}")).as_deref(),
            Some("all live")
        );
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
    // MergeAll with seal_open fences the live KN first, which seals its segment and wakes the
    // background merger: either merge may take the segment, and only the one that does counts
    // the torn tail. What matters is below: the torn batch is gone whole, the earlier stays.
    assert!(r.segments == 0 || r.invalid_tails == 1, "{r:?}");
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
        dpm.allocate_segment(6, 0, 1, false),
        Err(DpmError::Fenced { .. })
    ));
    dpm.merge_all(6, true).unwrap();
    assert_eq!(value(&dpm, "f").as_deref(), Some("1"));
    // A new incarnation may register, but gets no log space under the map it was fenced
    // under: its writes would land after the MergeAll that handed its keys over.
    let reg = dpm.register_kn(Some(6), "test").unwrap();
    assert!(matches!(
        dpm.allocate_segment(6, 0, reg.epoch, false),
        Err(DpmError::FencedUnderMap { kn: 6 })
    ));
    assert!(matches!(
        dpm.confirm_serving(6, reg.epoch),
        Err(DpmError::FencedUnderMap { kn: 6 })
    ));
    // Once the next map is published, it works again.
    dpm.compare_and_put_metadata(
        dinomo_dpm_node::dpm::CLUSTER_MAP_KEY,
        None,
        Some(&cluster_map(1)),
    )
    .unwrap();
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
        dpm.compare_and_put_metadata("cluster/map", None, Some(&cluster_map(1)))
            .unwrap();
        dpm.compare_and_put_metadata("cluster/map", Some(&cluster_map(1)), Some(&cluster_map(2)))
            .unwrap();
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
    assert_eq!(dpm.get_metadata("cluster/map"), Some(cluster_map(2)));
    assert!(matches!(
        dpm.allocate_segment(7, 0, 1, false),
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
    let reads = format!("reads version {}", dinomo_layout::FORMAT_VERSION);
    assert!(e.contains("version 99") && e.contains(&reads), "{e}");

    std::fs::write(&path, &pristine).unwrap();
    Dpm::open(cfg.clone()).expect("the undamaged pool opens");
}

/// A copy marker this dpm-node cannot read (a newer format, or damaged) is refused with the
/// way out named; with --accept-incomplete-copy the pool opens as an unfinished copy, and the
/// marker is removed.
#[test]
fn an_unreadable_copy_marker_is_refused_unless_the_loss_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    drop(Dpm::open(config(dir.path(), |_| {})).unwrap());
    let cfg = config(dir.path(), |c| c.create = false);
    let marker = dinomo_dpm_node::replication::copy_marker::copy_marker_path(&cfg.pool_path);
    let texts: [&[u8]; 3] = [b"format 2\nstate complete\n", b"\0\x01 torn", b"\xff\xfe"];
    for text in texts {
        std::fs::write(&marker, text).unwrap();
        let e = Dpm::open(cfg.clone()).map(|_| ()).unwrap_err().to_string();
        assert!(
            e.contains(".copy") && e.contains("--accept-incomplete-copy"),
            "{text:?}: {e}"
        );
        let mut accepting = cfg.clone();
        accepting.accept_incomplete_copy = true;
        drop(Dpm::open(accepting).expect("opened with the override"));
        assert!(
            !marker.exists(),
            "the marker is removed once the pool is open"
        );
    }
}

/// Selective replication at the DPM: a cell pins the segment its entry lives in (even when the
/// index no longer points there), and removing the cell writes its value back into the index.
#[tokio::test]
async fn a_cell_pins_its_segment_and_its_removal_writes_the_value_back() {
    use dinomo_fabric::FabricExt;
    use dinomo_layout::segment::SegState;
    use std::sync::atomic::Ordering;

    let dir = tempfile::tempdir().unwrap();
    // No cleaning: the subject is whether a segment is freed. (Cleaning would move the one
    // live entry of these nearly empty segments, which is right, but not what is checked.)
    let dpm = Dpm::open(config(dir.path(), |c| c.clean_threshold = 0.0)).unwrap();
    let mut w1 = writer(&dpm, 1);
    let mut w2 = writer(&dpm, 2);
    w1.append(&[put("hot", "v0", 1)]).await.unwrap();
    w1.seal().await.unwrap();
    // Sealed by their writers, who write on: a MergeAll that sealed a live KN's open
    // segments would end its session (`Dpm::merge_all`).
    dpm.merge_all(1, false).unwrap();
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
    dpm.merge_all(2, false).unwrap();
    // KN 1's later entry merges after KN 2's: the index now names it, the cell does not.
    w1.append(&[put("hot", "stale", 3)]).await.unwrap();
    w1.seal().await.unwrap();
    dpm.merge_all(1, false).unwrap();
    assert_eq!(
        value(&dpm, "hot").as_deref(),
        Some("v1"),
        "the cell is the value of record"
    );

    // KN 2's segment has no live byte by the index, but the cell pins it through many GC passes.
    let seg = dpm.pool().superblock().segment_of(p.offset).unwrap();
    let passes = dpm.gc().passes();
    wait_until("five GC passes", || dpm.gc().passes() >= passes + 5);
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
    let passes = dpm.gc().passes();
    wait_until("three GC passes", || dpm.gc().passes() >= passes + 3);
    assert_ne!(
        dpm.pool().read_table_entry(seg).unwrap().state,
        SegState::Free
    );
}

/// A segment source whose segments hold deletes only (they may come from the delete reserve),
/// on log `stream` of the KN.
struct DeletesSource(LocalSource, u16);

#[async_trait::async_trait]
impl dinomo_dpm_node::testkit::SegmentSource for DeletesSource {
    async fn allocate(&self) -> dinomo_dpm_node::Result<dinomo_dpm_node::segments::SegmentGrant> {
        self.0
            .dpm
            .allocate_segment(self.0.kn, self.1, self.0.epoch, true)
    }
    async fn seal(&self, segment: u64) -> dinomo_dpm_node::Result<u64> {
        self.0.seal(segment).await
    }
}

/// Appends batches of 24-byte keys with `value_len`-byte values until the pool refuses a
/// segment even after merging and a GC pass (the background GC's job, done here in step);
/// returns the keys acknowledged.
async fn fill(
    dpm: &Dpm,
    kn: u32,
    w: &mut Writer,
    prefix: &str,
    value_len: usize,
    version: &mut u64,
) -> (Vec<String>, String) {
    let mut acked = Vec::new();
    let value = "v".repeat(value_len);
    // Batches of at most ~16 KiB, so a batch always fits a 64 KiB segment.
    let per_batch = (16384 / (value_len + 64)).max(1);
    loop {
        let keys: Vec<String> = (0..per_batch)
            .map(|i| format!("{prefix}{:0>20}", acked.len() + i))
            .collect();
        let batch: Vec<_> = keys
            .iter()
            .map(|k| {
                *version += 1;
                put(k, &value, *version)
            })
            .collect();
        match w.append(&batch).await {
            Ok(_) => acked.extend(keys),
            Err(full @ DpmError::PoolFull { .. }) => {
                dpm.merge_all(kn, false).unwrap();
                let mut freed = 0;
                for _ in 0..50 {
                    let r = dpm.gc().run_once().unwrap();
                    freed += r.freed;
                    if r.freed == 0 && r.cleaned == 0 {
                        break;
                    }
                }
                if freed == 0 {
                    return (acked, full.to_string());
                }
            }
            Err(e) => panic!("unexpected error while filling: {e}"),
        }
    }
}

/// Issue 9: the pool fills with data, not with index. 24-byte keys and 8-byte values (where the
/// index weighs most) fill at least half the pool with live log bytes before the first refusal;
/// full is a clean state (a clear error, restart works, every acknowledged key is there, the
/// counters match a recount); deletes give the space back.
#[tokio::test]
async fn small_values_fill_half_the_pool_and_full_is_recoverable() {
    fill_delete_refill(8, 0.5).await;
}

/// The same with 1 KiB values: at least 80% of the pool holds live log bytes.
#[tokio::test]
async fn large_values_fill_four_fifths_of_the_pool() {
    fill_delete_refill(1024, 0.8).await;
}

/// A 16 MiB pool of 64 KiB segments whose GC passes only when a test asks. Accounting is
/// checked at the end of each phase (check_accounting) rather than after each of the hundreds
/// of merges over an index of up to 160k keys.
fn small_full_pool_config(dir: &std::path::Path) -> dinomo_dpm_node::config::DpmConfig {
    config(dir, |c| {
        c.pool_size = "16MiB".parse().unwrap();
        c.segment_size = "64KiB".parse().unwrap();
        c.metadata_size = "64KiB".parse().unwrap();
        c.max_indirect_cells = 64;
        c.gc_interval_ms = 1_000_000;
        c.verify_accounting = false;
    })
}

async fn fill_delete_refill(value_len: usize, min_ratio: f64) {
    let v = "v".repeat(value_len);
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_full_pool_config(dir.path());
    let pool_len = 16u64 << 20;
    let mut version = 0;
    let acked = {
        let dpm = Dpm::open(cfg.clone()).unwrap();
        let mut w = writer(&dpm, 1);
        let (acked, err) = fill(&dpm, 1, &mut w, "a", value_len, &mut version).await;
        assert!(
            err.contains("the pool is full") && err.contains("delete"),
            "the refusal says what is full and what to do: {err}"
        );
        dpm.merge_all(1, true).unwrap();
        let s = dpm.stats();
        let ratio = s.live_log_bytes as f64 / pool_len as f64;
        println!(
            "filled: {} keys, live log {} bytes = {:.3} of the pool, index {} bytes = {:.1} B/key ({} buckets, {} splits), {} of {} segments free, {} reserved",
            acked.len(),
            s.live_log_bytes,
            ratio,
            s.index_space.bytes,
            s.index_space.bytes as f64 / acked.len() as f64,
            s.index_space.buckets,
            s.index_resizes,
            s.segments_free,
            s.segments_total,
            s.segments_reserved,
        );
        assert!(
            ratio >= min_ratio,
            "live log bytes are only {ratio:.3} of the pool"
        );
        assert_eq!(s.index_items, acked.len() as u64);
        dpm.check_accounting().unwrap();
        acked
    };
    // Restart on a full pool: every acknowledged key is there.
    let dpm = Dpm::open(cfg.clone()).unwrap();
    dpm.check_accounting().unwrap();
    for k in &acked {
        assert_eq!(value(&dpm, k).as_deref(), Some(v.as_str()), "{k}");
    }
    // Deletes are accepted on a full pool (from the delete reserve) and give space back.
    let reg = dpm.register_kn(Some(1), "test").unwrap();
    let fabric =
        ShmFabric::connect(&dpm.config.pool_path, reg.key, DurabilityRequest::Auto).unwrap();
    let mut d = LogWriter::new(
        Faulty::new(fabric),
        DeletesSource(
            LocalSource {
                dpm: dpm.clone(),
                kn: 1,
                epoch: reg.epoch,
            },
            0,
        ),
    );
    let half: Vec<&String> = acked.iter().step_by(2).collect();
    for chunk in half.chunks(256) {
        let batch: Vec<_> = chunk
            .iter()
            .map(|k| {
                version += 1;
                del(k, version)
            })
            .collect();
        d.append(&batch)
            .await
            .expect("deletes are accepted on a full pool");
        // Merging as it goes frees the segments the deletes empty.
        dpm.merge_all(1, false).unwrap();
        dpm.gc().run_once().unwrap();
    }
    d.seal().await.unwrap();
    dpm.merge_all(1, true).unwrap();
    let free_before = dpm.stats().segments_free;
    for _ in 0..4 {
        dpm.gc().run_once().unwrap();
    }
    dpm.check_accounting().unwrap();
    let free_after = dpm.stats().segments_free;
    println!("after deleting half: {free_before} then {free_after} segments free");
    let mut w = writer(&dpm, 2);
    let (again, _) = fill(&dpm, 2, &mut w, "b", value_len, &mut version).await;
    dpm.merge_all(2, true).unwrap();
    dpm.check_accounting().unwrap();
    println!(
        "loaded {} new keys into the space the deletes freed",
        again.len()
    );
    assert!(
        again.len() >= half.len() * 2 / 3,
        "only {} new keys fit after deleting {} of {}",
        again.len(),
        half.len(),
        acked.len()
    );
    for (i, k) in acked.iter().enumerate() {
        let want = (i % 2 == 1).then_some(v.as_str());
        assert_eq!(value(&dpm, k).as_deref(), want, "{k}");
    }
    for k in &again {
        assert_eq!(value(&dpm, k).as_deref(), Some(v.as_str()), "{k}");
    }
}

/// Deletes on a full pool succeed even when nothing merges or collects on its own (GC thread
/// idle), through four logs at once, each of which needs a segment of its own before any
/// space comes back: a refused allocation merges what the logs hold and collects, again and
/// again, until the other logs' tombstones have freed whole segments.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deletes_on_a_full_pool_succeed_through_many_open_logs() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small_full_pool_config(dir.path());
    let dpm = Dpm::open(cfg).unwrap();
    let mut w = writer(&dpm, 1);
    let mut version = 0;
    let (acked, _) = fill(&dpm, 1, &mut w, "a", 8, &mut version).await;
    dpm.merge_all(1, true).unwrap();
    let reg = dpm.register_kn(Some(2), "deleter").unwrap();
    let started = Instant::now();
    let tasks: Vec<_> = (0..4u16)
        .map(|stream| {
            let fabric =
                ShmFabric::connect(&dpm.config.pool_path, reg.key, DurabilityRequest::Auto)
                    .unwrap();
            let mut log = LogWriter::new(
                Faulty::new(fabric),
                DeletesSource(
                    LocalSource {
                        dpm: dpm.clone(),
                        kn: 2,
                        epoch: reg.epoch,
                    },
                    stream,
                ),
            );
            // Log `stream` deletes every fourth chunk of 200 keys, in load order.
            let mine: Vec<Vec<String>> = acked
                .chunks(200)
                .skip(stream as usize)
                .step_by(4)
                .map(|c| c.to_vec())
                .collect();
            tokio::spawn(async move {
                for (i, chunk) in mine.iter().enumerate() {
                    let batch: Vec<_> = chunk.iter().map(|k| del(k, 1 << 40)).collect();
                    log.append(&batch).await.unwrap_or_else(|e| {
                        panic!("log {stream}: delete batch {i} refused on a full pool: {e}")
                    });
                }
                log.seal().await.unwrap();
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    dpm.merge_all(2, true).unwrap();
    assert_eq!(dpm.stats().index_items, 0);
    dpm.check_accounting().unwrap();
    println!(
        "deleted {} keys through 4 logs on a full pool in {:?}; {} of {} segments free after",
        acked.len(),
        started.elapsed(),
        dpm.stats().segments_free,
        dpm.stats().segments_total
    );
}

/// ListMetadata answers at most a bound of names and values (4 MiB over gRPC, see limits):
/// the entries in name order up to the first that would pass it, and that entry's name.
#[tokio::test]
async fn metadata_listing_stops_at_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |_| {})).unwrap();
    for i in 0..5 {
        dpm.put_metadata(&format!("list/{i}"), Some(&[b'v'; 100]))
            .unwrap();
    }
    // Each entry is 6 bytes of name and 100 of value.
    let (got, left_out) = dpm.list_metadata_bounded("list/", 3 * 106 + 105);
    let names: Vec<_> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["list/0", "list/1", "list/2"]);
    assert_eq!(left_out.as_deref(), Some("list/3"));
    let (got, left_out) = dpm.list_metadata_bounded("list/", 5 * 106);
    assert_eq!((got.len(), left_out), (5, None));
    assert_eq!(dpm.list_metadata("list/").len(), 5);
}

/// The identity of a pool's image is recorded before the first term is taken and advanced
/// only by [`Dpm::record_replica_image`] (a backup accepted a primary, or the replica set's
/// generation grew): starts that no backup accepted, however many, leave it where it was, and
/// it survives a reopen. (Read from the newest term taken, an empty primary restarted N+1 times
/// out-termed backups of term N and was attached, copying its empty pool over them.)
#[test]
fn terms_taken_without_a_backup_do_not_advance_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = Dpm::open(config(dir.path(), |_| {})).unwrap();
    let term = |t| ImageId {
        term: t,
        ..ImageId::default()
    };
    assert_eq!(dpm.init_replica_image().unwrap(), term(0));
    for _ in 0..3 {
        dpm.next_replica_term(0, 1).unwrap();
        assert_eq!(dpm.init_replica_image().unwrap(), term(0));
    }
    let recorded = ImageId {
        term: 4,
        instance: 5,
        generation: 2,
    };
    dpm.record_replica_image(recorded).unwrap();
    dpm.next_replica_term(0, 1).unwrap();
    assert_eq!(dpm.init_replica_image().unwrap(), recorded);
    dpm.shutdown();
    drop(dpm);
    let dpm = Dpm::open(config(dir.path(), |c| c.create = false)).unwrap();
    assert_eq!(dpm.init_replica_image().unwrap(), recorded);
    dpm.shutdown();
}
