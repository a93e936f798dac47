//! The replica set's generation (dpm-node/src/replication/image.rs): a backup removed from the
//! set keeps a copy marked complete, but older than what the backups that stayed hold;
//! promoted, it must not be copied over them (real processes); and how the replicator holds
//! acknowledgements while a backup leaves (in process).

use std::time::{Duration, Instant};

use dinomo_dpm_node::replication::{ConfirmCopy, Phase, Replicator, ReplicatorOptions};
use dinomo_dpm_node::testkit::LogRecord;
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::BackupRequest;

use super::process::DpmProcess;
use super::replication::{
    check_pool, kn_writer, promote, record, replica_status, stop_process, two_backups, wait_in_sync,
};
use super::replication_fencing::{backup_nic, region};

/// b1 is removed from the set while in sync (its copy marked complete, made under the
/// primary's term); the primary acknowledges more writes with b2 alone, then dies. b1,
/// promoted by mistake and told to replicate to b2, is refused by b2 (its image is of an
/// older generation) and stops; b2's pool holds every acknowledged write. Without the
/// generation, b1's image (same term, same start) passed b2's check and b2 was copied b1's
/// older pool: the writes acknowledged after the removal were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_backup_promoted_cannot_overwrite_one_that_stayed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut b1, mut b2, cp, [_, pool2]) = two_backups(dir.path(), "replica_ack_timeout_ms = 2000");
    let mut primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    let s = wait_in_sync(primary.grpc, 2).await;
    assert_eq!(s.generation, 0, "{s:?}");
    let (kn, mut w) = kn_writer(&primary).await;
    const KEYS: u32 = 32;
    let append = |from: u32| -> Vec<Vec<LogRecord>> {
        (from..from + KEYS)
            .collect::<Vec<_>>()
            .chunks(8)
            .map(|c| c.iter().map(|&i| record(i)).collect())
            .collect()
    };
    for recs in append(0) {
        w.append(&recs).await.unwrap();
    }

    ReplicaServiceClient::connect(format!("http://{}", primary.grpc))
        .await
        .unwrap()
        .remove_backup(BackupRequest {
            address: b1.grpc.to_string(),
        })
        .await
        .unwrap();
    let ps = replica_status(primary.grpc).await;
    assert_eq!((ps.backups.len(), ps.generation), (1, 1), "{ps:?}");
    assert_eq!(replica_status(b2.grpc).await.generation, 1);
    let b1s = replica_status(b1.grpc).await;
    assert_eq!(
        (b1s.copy_state.as_str(), b1s.copy_term, b1s.generation),
        ("complete", s.term, 0),
        "{b1s:?}"
    );
    for recs in append(KEYS) {
        w.append(&recs).await.unwrap();
    }
    primary.kill9();

    promote(b1.grpc, vec![b2.grpc.to_string()], s.term)
        .await
        .expect("b1's copy is complete: the promotion itself is accepted");
    assert!(
        b1.exits_within(Duration::from_secs(20)),
        "b1, promoted with an older generation, still runs; log:\n{}",
        std::fs::read_to_string(dir.path().join("b1.log")).unwrap_or_default()
    );
    let b1_log = std::fs::read_to_string(dir.path().join("b1.log")).unwrap_or_default();
    assert!(
        b1_log.contains("generation 0 of term"),
        "b1 stopped for another reason; log:\n{b1_log}"
    );
    let b2s = replica_status(b2.grpc).await;
    assert_eq!(
        (b2s.term, b2s.copy_state.as_str(), b2s.generation),
        (s.term, "complete", 1),
        "b2 was attached by b1: {b2s:?}"
    );
    b2.kill9();
    let (bad, _) = check_pool(&pool2, &[kn], 0..2 * KEYS);
    assert!(
        bad.is_empty(),
        "{} acknowledged records missing in b2's pool: {bad:?}",
        bad.len()
    );
}

/// A backup leaving the set ([`Replicator::leave`]) holds every barrier, neither passing nor
/// failing it, until it is removed (its primary tells the others the new generation
/// meanwhile); and a leaving backup that catches up is not told its copy is complete: it would
/// be told a generation that counts without it, and pass, promoted, for a backup that stayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaving_backup_holds_barriers_and_is_not_told_its_copy_complete() {
    let dir = tempfile::tempdir().unwrap();
    let primary = region(&dir.path().join("p"));
    primary.write_durable(0, &[1u8; 64]).unwrap();
    let mut nics = Vec::new();
    for name in ["b1", "b2"] {
        let sub = dir.path().join(name);
        std::fs::create_dir_all(&sub).unwrap();
        let delay = if name == "b2" {
            Duration::from_millis(100)
        } else {
            Duration::ZERO
        };
        nics.push(backup_nic(&sub, region(&sub.join("pool")), delay).await);
    }
    let rep = Replicator::new(
        primary.clone(),
        ReplicatorOptions {
            ack_timeout: Duration::from_secs(10),
        },
    );
    primary.set_mirror(Some(rep.clone()));
    rep.set_generation(3);
    rep.add("b1", nics[0].0.local_addr(), nics[0].1, None, None);
    let deadline = Instant::now() + Duration::from_secs(20);
    while rep.status()[0].phase != Phase::InSync {
        assert!(Instant::now() < deadline, "{:?}", rep.status());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // b2's posts are slow: it is still copying when it is asked to leave.
    let (asked_tx, asked_rx) = std::sync::mpsc::channel::<u64>();
    let confirm: ConfirmCopy = Box::new(move |generation| {
        Box::pin(async move {
            asked_tx.send(generation).unwrap();
            Ok(())
        })
    });
    rep.add("b2", nics[1].0.local_addr(), nics[1].1, None, Some(confirm));
    assert_eq!(rep.leave("b2"), Some(false), "not counted while syncing");
    assert_eq!(rep.leave("b1"), Some(true));
    assert!(rep.status().iter().all(|b| b.leaving));

    primary.write_durable(64, &[2u8; 64]).unwrap();
    let barrier = primary.mirror_barrier();
    tokio::pin!(barrier);
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut barrier)
            .await
            .is_err(),
        "a barrier passed or failed while a counted backup was leaving"
    );
    rep.set_generation(4);
    assert!(rep.remove("b1"));
    tokio::time::timeout(Duration::from_secs(5), &mut barrier)
        .await
        .expect("the barrier goes on once the backup is removed")
        .expect("and passes: no counted backup is left");

    // b2 caught up long ago (64 KiB... in slow posts) but, leaving, was never asked.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        asked_rx.try_recv().is_err(),
        "a leaving backup was told its copy is complete"
    );
    assert!(rep.remove("b2"));
}

/// A removal that no other backup could be told of fails and changes nothing: the generation
/// stays (neither the pool nor a backup re-attached later starts from a generation nobody
/// else knows), the backup stays in the set, failed rather than leaving (so whoever tends the
/// set sees it and tries again), and the silent backup is failed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_no_other_backup_records_fails_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (b1, b2, cp, _) = two_backups(dir.path(), "replica_ack_timeout_ms = 1000");
    let primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    wait_in_sync(primary.grpc, 2).await;
    stop_process(b2.pid());
    let e = ReplicaServiceClient::connect(format!("http://{}", primary.grpc))
        .await
        .unwrap()
        .remove_backup(BackupRequest {
            address: b1.grpc.to_string(),
        })
        .await
        .unwrap_err();
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(b2.pid() as i32, libc::SIGCONT) };
    assert!(e.message().contains("no other backup recorded"), "{e:?}");
    let s = replica_status(primary.grpc).await;
    assert_eq!(s.generation, 0, "{s:?}");
    // In the order the backups were attached, which the two attach tasks race for.
    let states: std::collections::BTreeSet<(&str, &str)> = s
        .backups
        .iter()
        .map(|b| (b.address.as_str(), b.state.as_str()))
        .collect();
    let (a1, a2) = (b1.grpc.to_string(), b2.grpc.to_string());
    assert_eq!(
        states,
        [(a1.as_str(), "failed"), (a2.as_str(), "failed")].into(),
        "{s:?}"
    );
}
