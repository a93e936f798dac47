//! The replica set's generation (dpm-node/src/replication/image.rs), with real processes: a
//! backup removed from the set keeps a copy marked complete, but older than what the backups
//! that stayed hold; promoted, it must not be copied over them.

use std::time::Duration;

use dinomo_dpm_node::testkit::LogRecord;
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::BackupRequest;

use super::process::DpmProcess;
use super::replication::{
    check_pool, kn_writer, promote, record, replica_status, two_backups, wait_in_sync,
};

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
