//! FenceKn in the middle of a KN's log WRITE (issue 10, finding 7): a batch that passed the
//! grant check before the fence must either be merged by the MergeAll that follows the fence,
//! or not be acknowledged to the KN. The WRITE is paused by the grant table's post hook between
//! its check and its apply while the DPM fences and merges.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::testkit::{LocalSource, LogRecord, LogWriter};
use dinomo_dpm_node::{Dpm, DpmError};
use dinomo_fabric::grants::GrantTable;
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::tcp::{TcpFabric, TcpNic};
use dinomo_fabric::{DurabilityRequest, Fabric, FabricError};
use dinomo_layout::log::LogOp;

fn open_dpm(dir: &std::path::Path) -> Arc<Dpm> {
    let c = DpmConfigFile {
        pool_size: "64MiB".parse().unwrap(),
        segment_size: "256KiB".parse().unwrap(),
        initial_index_buckets: 64,
        verify_accounting: true,
        ..DpmConfigFile::in_process(dir.join("pool"))
    };
    Dpm::open(c.validate().unwrap()).unwrap()
}

fn put(k: &str, v: &str, version: u64) -> LogRecord {
    LogRecord {
        op: LogOp::Put,
        version,
        key: k.as_bytes().to_vec(),
        value: v.as_bytes().to_vec(),
    }
}

fn value(dpm: &Dpm, k: &str) -> Option<String> {
    dpm.lookup(k.as_bytes())
        .unwrap()
        .map(|f| String::from_utf8(f.value).unwrap())
}

fn writer<F: Fabric>(dpm: &Arc<Dpm>, kn: u32, epoch: u64, fabric: F) -> LogWriter<F, LocalSource> {
    LogWriter::new(
        fabric,
        LocalSource {
            dpm: dpm.clone(),
            kn,
            epoch,
        },
    )
}

/// Pauses the next post checked through `grants` until the returned sender is used.
fn pause_next_post(grants: &GrantTable) -> (mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (paused_tx, paused) = mpsc::channel();
    let (resume, resume_rx) = mpsc::channel::<()>();
    let resume_rx = Mutex::new(resume_rx);
    let armed = AtomicBool::new(true);
    grants.set_post_hook(Some(Arc::new(move |_| {
        if armed.swap(false, Ordering::SeqCst) {
            let _ = paused_tx.send(());
            let _ = resume_rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10));
        }
    })));
    (paused, resume)
}

/// Waits for the pause, runs `fence` on a thread of its own, lets it run for a while, resumes
/// the post and returns whether the fence had returned during the pause and its result.
fn fence_during_pause<T: Send + 'static>(
    paused: mpsc::Receiver<()>,
    resume: mpsc::Sender<()>,
    fence: impl FnOnce() -> T + Send + 'static,
) -> (bool, T) {
    paused
        .recv_timeout(Duration::from_secs(10))
        .expect("the WRITE reached the hook");
    let h = std::thread::spawn(fence);
    let deadline = std::time::Instant::now() + Duration::from_millis(300);
    while !h.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let returned_while_paused = h.is_finished();
    resume.send(()).unwrap();
    (returned_while_paused, h.join().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_fence_kn_waits_for_a_paused_batch_and_merge_all_indexes_it() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = open_dpm(dir.path());
    let nic = TcpNic::start(
        "127.0.0.1:0".parse().unwrap(),
        dpm.pool().region().clone(),
        dpm.grants().clone(),
    )
    .await
    .unwrap();
    let reg = dpm.register_kn(Some(1), "test").unwrap();
    let fabric = TcpFabric::connect(nic.local_addr(), reg.key).await.unwrap();
    let mut w = writer(&dpm, 1, reg.epoch, fabric);
    w.append(&[put("a", "1", 1)]).await.unwrap();

    let (paused, resume) = pause_next_post(dpm.grants());
    let append = tokio::spawn(async move { w.append(&[put("a", "2", 2)]).await });
    let d = dpm.clone();
    let (returned_while_paused, merged) = tokio::task::spawn_blocking(move || {
        fence_during_pause(paused, resume, move || {
            d.fence_kn(1).unwrap();
            d.merge_all(1, true).unwrap();
            value(&d, "a")
        })
    })
    .await
    .unwrap();
    let acked = append.await.unwrap();
    assert!(
        !returned_while_paused,
        "FenceKn returned while a WRITE checked against the fenced key could still apply"
    );
    acked.expect("the batch passed the check before the fence, so it completes");
    assert_eq!(
        merged.as_deref(),
        Some("2"),
        "an acknowledged batch was not indexed by the MergeAll after the fence"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_batch_landing_after_fence_and_merge_all_is_not_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = open_dpm(dir.path());
    let reg = dpm.register_kn(Some(1), "test").unwrap();
    let fabric =
        ShmFabric::connect(&dpm.config.pool_path, reg.key, DurabilityRequest::Auto).unwrap();
    let mut w = writer(&dpm, 1, reg.epoch, fabric);
    w.append(&[put("a", "1", 1)]).await.unwrap();

    // The KN's own mapping of the grant table: its CPU applies the WRITE.
    let (paused, resume) = pause_next_post(w.fabric().grants());
    let append = tokio::spawn(async move { w.append(&[put("a", "2", 2)]).await });
    let d = dpm.clone();
    let (returned_while_paused, merged) = tokio::task::spawn_blocking(move || {
        fence_during_pause(paused, resume, move || {
            d.fence_kn(1).unwrap();
            d.merge_all(1, true).unwrap();
            value(&d, "a")
        })
    })
    .await
    .unwrap();
    assert!(returned_while_paused, "the DPM cannot wait for a KN's CPU");
    assert_eq!(merged.as_deref(), Some("1"));
    let err = append
        .await
        .unwrap()
        .expect_err("a batch that landed after FenceKn and MergeAll is not acknowledged");
    assert!(
        matches!(err, DpmError::Fabric(FabricError::RevokedDuringPost { .. })),
        "{err}"
    );
    // The late bytes are in a merged segment, which no merge scans again.
    dpm.merge_all(1, true).unwrap();
    assert_eq!(value(&dpm, "a").as_deref(), Some("1"));
}

/// After FenceKn, a MergeAll that does not seal (MergeMode::All) would leave the fenced KN's
/// open segment open and pending, so a late shm batch landing in it afterwards (reported to
/// the KN as outcome unknown) would continue the segment's checksum chain and be indexed by
/// the next merge of that log, over a newer value that the key's new owner wrote meanwhile.
/// FenceKn seals the fenced KN's segments, so that merge retires them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_batch_of_a_fenced_kn_is_never_indexed_over_newer_data() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = open_dpm(dir.path());
    let reg = dpm.register_kn(Some(1), "old owner").unwrap();
    let fabric =
        ShmFabric::connect(&dpm.config.pool_path, reg.key, DurabilityRequest::Auto).unwrap();
    let mut old = writer(&dpm, 1, reg.epoch, fabric);
    old.append(&[put("a", "1", 1)]).await.unwrap();

    let (paused, resume) = pause_next_post(old.fabric().grants());
    let append = tokio::spawn(async move { old.append(&[put("a", "2", 2)]).await });
    let d = dpm.clone();
    tokio::task::spawn_blocking(move || {
        fence_during_pause(paused, resume, move || {
            d.fence_kn(1).unwrap();
            // A MergeAll that keeps open segments open (MergeMode::All).
            d.merge_all(1, false).unwrap();
        })
    })
    .await
    .unwrap();
    assert!(
        append.await.unwrap().is_err(),
        "the late batch is not acknowledged"
    );

    // The key's new owner writes a newer value, which is merged.
    let reg2 = dpm.register_kn(Some(2), "new owner").unwrap();
    let fabric =
        ShmFabric::connect(&dpm.config.pool_path, reg2.key, DurabilityRequest::Auto).unwrap();
    let mut new = writer(&dpm, 2, reg2.epoch, fabric);
    new.append(&[put("a", "3", 3)]).await.unwrap();
    dpm.merge_all(2, true).unwrap();
    assert_eq!(value(&dpm, "a").as_deref(), Some("3"));

    // Any later merge of the fenced KN's log (here: sealing it) must not bring back "2".
    dpm.merge_all(1, true).unwrap();
    assert_eq!(
        value(&dpm, "a").as_deref(),
        Some("3"),
        "a batch the KN was told had an unknown outcome was indexed over a newer value"
    );
}

/// On shm a fenced KN keeps the pool mapped: a copy it had in flight when it was stopped
/// lands when it runs again, wherever its segment then is. So its segments are not freed for
/// reuse while its process runs; once the process is gone they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_shm_kns_segments_are_not_reused_while_its_process_runs() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = open_dpm(dir.path());
    // Stands for the KN's process (the test process itself must not be the fenced one).
    let mut kn_process = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let reg = dpm
        .register_kn_process(Some(1), "fenced", Some(kn_process.id()))
        .unwrap();
    let fabric =
        ShmFabric::connect(&dpm.config.pool_path, reg.key, DurabilityRequest::Auto).unwrap();
    let mut w = writer(&dpm, 1, reg.epoch, fabric);
    w.append(&[put("a", "1", 1)]).await.unwrap();
    dpm.fence_kn(1).unwrap();
    dpm.merge_all(1, true).unwrap();
    // The key's next owner overwrites it: KN 1's segment has no live byte left.
    let reg2 = dpm.register_kn(Some(2), "next owner").unwrap();
    let fabric2 =
        ShmFabric::connect(&dpm.config.pool_path, reg2.key, DurabilityRequest::Auto).unwrap();
    let mut w2 = writer(&dpm, 2, reg2.epoch, fabric2);
    w2.append(&[put("a", "2", 2)]).await.unwrap();
    dpm.merge_all(2, false).unwrap();
    assert_eq!(value(&dpm, "a").as_deref(), Some("2"));

    let held = dpm.gc().run_once().unwrap();
    assert_eq!(
        held.freed, 0,
        "a dead segment of a fenced KN whose process runs was freed for reuse"
    );
    kn_process.kill().unwrap();
    kn_process.wait().unwrap();
    let after = dpm.gc().run_once().unwrap();
    assert_eq!(
        after.freed, 1,
        "the fenced KN's dead segment stays held after its process exited"
    );
}

/// The hold above outlives a dpm-node restart (the fenced process may still be stopped, with
/// its copy pending, when a new dpm-node opens the pool).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_shm_kns_hold_survives_a_dpm_node_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut kn_process = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    {
        let dpm = open_dpm(dir.path());
        let reg = dpm
            .register_kn_process(Some(1), "fenced", Some(kn_process.id()))
            .unwrap();
        let fabric =
            ShmFabric::connect(&dpm.config.pool_path, reg.key, DurabilityRequest::Auto).unwrap();
        let mut w = writer(&dpm, 1, reg.epoch, fabric);
        w.append(&[put("a", "1", 1)]).await.unwrap();
        dpm.fence_kn(1).unwrap();
        dpm.merge_all(1, true).unwrap();
        let d = dpm.clone();
        tokio::task::spawn_blocking(move || d.shutdown())
            .await
            .unwrap();
    }
    let dpm = open_dpm(dir.path());
    let reg2 = dpm.register_kn(Some(2), "next owner").unwrap();
    let fabric2 =
        ShmFabric::connect(&dpm.config.pool_path, reg2.key, DurabilityRequest::Auto).unwrap();
    let mut w2 = writer(&dpm, 2, reg2.epoch, fabric2);
    w2.append(&[put("a", "2", 2)]).await.unwrap();
    dpm.merge_all(2, false).unwrap();
    assert_eq!(
        dpm.gc().run_once().unwrap().freed,
        0,
        "after a restart, a dead segment of a fenced KN whose process runs was freed"
    );
    kn_process.kill().unwrap();
    kn_process.wait().unwrap();
    assert_eq!(dpm.gc().run_once().unwrap().freed, 1);
}
