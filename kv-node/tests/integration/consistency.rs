//! Issue 10, "no stale read and no lost write under any fault schedule": conditional writes
//! behind a write that then fails, a Reset that cannot confirm which segments were merged, a KN
//! that skips a map version, and the seal of a clean stop. In-process KNs (the library) where a
//! test must reach into the KN (faulty fabric, cut control link, maps installed by hand).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dinomo_fabric::fault::FaultPlan;
use dinomo_kv_node::shard::{PutMode, ShardOp, MAX_DEFERRED};
use dinomo_kv_node::{KvError, KvNode};
use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::kv::{PutMode as PbPutMode, PutRequest};

use super::harness::{
    eventually, merge_all, pending_segments, start_inproc_kn, FaultyFabrics, GrpcProxy, InProcDpm,
    KnProcess,
};

const KEY: &[u8] = b"issue10-key";

fn get() -> ShardOp {
    ShardOp::Get {
        key: Bytes::from_static(KEY),
    }
}

fn put(value: &'static str, mode: PutMode) -> ShardOp {
    ShardOp::Put {
        key: Bytes::from_static(KEY),
        value: Bytes::from_static(value.as_bytes()),
        mode,
    }
}

fn delete() -> ShardOp {
    ShardOp::Delete {
        key: Bytes::from_static(KEY),
    }
}

/// A map version in which KN `kn` alone owns every key.
fn sole_owner(kn: u32, version: u64) -> ClusterMap {
    let mut m = ClusterMap::new(
        vec![KnInfo {
            id: kn,
            endpoint: format!("127.0.0.1:{}", 17000 + kn),
        }],
        64,
        1,
    )
    .unwrap();
    m.version = version;
    m
}

/// `first` is sent and its batch WRITE is held in flight (300 ms) and then fails; `cond` is
/// sent while it is in flight. Returns what `first`, `cond` and a later Get answered.
async fn conditional_behind_a_failing_write(
    initial: Option<&'static str>,
    first: ShardOp,
    cond: ShardOp,
) -> (
    dinomo_kv_node::KvResult<Option<Bytes>>,
    dinomo_kv_node::KvResult<Option<Bytes>>,
    dinomo_kv_node::KvResult<Option<Bytes>>,
) {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let (kn, fabrics): (Arc<KvNode>, FaultyFabrics) = start_inproc_kn(&dpm.url(), 1).await;
    if let Some(v) = initial {
        kn.execute(put(v, PutMode::Upsert)).await.unwrap();
    }
    let batches = kn.stats(0).batches;
    fabrics.lock()[0].set_plan(FaultPlan {
        delay: Some(Duration::from_millis(300)),
        fail_next: 1,
        tear_next_write_after: None,
    });
    let first = tokio::spawn({
        let kn = kn.clone();
        async move { kn.execute(first).await }
    });
    eventually(
        "the first write's batch WRITE to be in flight",
        async || kn.stats(0).batches > batches,
    )
    .await;
    let cond = as_a_client(&kn, cond).await;
    let first = first.await.unwrap();
    fabrics.lock()[0].set_plan(FaultPlan::default());
    let read = as_a_client(&kn, get()).await;
    (first, cond, read)
}

/// Runs `op` as a client does: UNAVAILABLE (not applied) is retried, for at most 10 s. A KN
/// answers it while it registers with the DPM again after a failed WRITE, until the DPM
/// confirms its serving lease under the new session.
async fn as_a_client(kn: &KvNode, op: ShardOp) -> dinomo_kv_node::KvResult<Option<Bytes>> {
    let started = std::time::Instant::now();
    loop {
        match kn.execute(op.clone()).await {
            Err(KvError::Unavailable(_)) if started.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            other => return other,
        }
    }
}

/// Insert behind an upsert whose WRITE fails: ALREADY_EXISTS would have been decided on a write
/// that never happened (a later Get answers NOT_FOUND).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insert_behind_a_failed_upsert_is_decided_on_acknowledged_state() {
    let (first, cond, read) = conditional_behind_a_failing_write(
        None,
        put("v1", PutMode::Upsert),
        put("v2", PutMode::Insert),
    )
    .await;
    assert!(first.is_err(), "the upsert's WRITE failed: {first:?}");
    assert!(
        cond.is_ok(),
        "insert answered {cond:?} while the upsert it depended on was in flight; the upsert \
         then failed ({first:?}) and a Get answers {read:?}"
    );
    assert_eq!(read.unwrap().as_deref(), Some(&b"v2"[..]));
}

/// Update behind a delete whose WRITE fails: NOT_FOUND would contradict the Get that follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_behind_a_failed_delete_is_decided_on_acknowledged_state() {
    let (first, cond, read) =
        conditional_behind_a_failing_write(Some("v0"), delete(), put("v2", PutMode::Update)).await;
    assert!(first.is_err(), "the delete's WRITE failed: {first:?}");
    assert!(
        cond.is_ok(),
        "update answered {cond:?} while the delete it depended on was in flight; the delete \
         then failed ({first:?}) and a Get answers {read:?}"
    );
    assert_eq!(read.unwrap().as_deref(), Some(&b"v2"[..]));
}

/// Delete behind a delete whose WRITE fails: NOT_FOUND, then the key is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_behind_a_failed_delete_is_decided_on_acknowledged_state() {
    let (first, cond, read) =
        conditional_behind_a_failing_write(Some("v0"), delete(), delete()).await;
    assert!(first.is_err(), "the first delete's WRITE failed: {first:?}");
    assert!(
        cond.is_ok(),
        "delete answered {cond:?} while the delete it depended on was in flight; that delete \
         then failed ({first:?}) and a Get answers {read:?}"
    );
    assert!(matches!(read, Err(KvError::NotFound)), "{read:?}");
}

/// Update behind an upsert whose WRITE fails: decided on top of the upsert, it is logged after
/// it and fails with it (not applied), so the key stays missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_behind_a_failed_upsert_fails_with_it() {
    let (first, cond, read) = conditional_behind_a_failing_write(
        None,
        put("v1", PutMode::Upsert),
        put("v2", PutMode::Update),
    )
    .await;
    assert!(first.is_err(), "the upsert's WRITE failed: {first:?}");
    assert!(
        matches!(
            cond,
            Err(KvError::UpdateMissing | KvError::Unavailable(_) | KvError::OutcomeUnknown(_))
        ),
        "update answered {cond:?} on top of an upsert that failed"
    );
    assert!(matches!(read, Err(KvError::NotFound)), "{read:?}");
}

/// A conditional write behind a slow write that succeeds is answered after it, on top of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_behind_a_slow_upsert_sees_it_once_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let (kn, fabrics) = start_inproc_kn(&dpm.url(), 1).await;
    fabrics.lock()[0].set_plan(FaultPlan {
        delay: Some(Duration::from_millis(200)),
        ..Default::default()
    });
    let first = tokio::spawn({
        let kn = kn.clone();
        async move { kn.execute(put("v1", PutMode::Upsert)).await }
    });
    eventually("the upsert's batch WRITE to be in flight", async || {
        kn.stats(0).batches > 0
    })
    .await;
    let cond = kn.execute(put("v2", PutMode::Update)).await;
    assert!(first.await.unwrap().is_ok());
    assert!(cond.is_ok(), "{cond:?}");
    let read = kn.execute(get()).await.unwrap();
    assert_eq!(read.as_deref(), Some(&b"v2"[..]));
}

/// Requests that must wait for a write are bounded: past `MAX_DEFERRED` they answer
/// UNAVAILABLE at once; the others are answered once the write they wait for is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_conditional_writes_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let (kn, fabrics) = start_inproc_kn(&dpm.url(), 1).await;
    fabrics.lock()[0].set_plan(FaultPlan {
        delay: Some(Duration::from_secs(1)),
        ..Default::default()
    });
    let first = tokio::spawn({
        let kn = kn.clone();
        async move { kn.execute(put("v1", PutMode::Upsert)).await }
    });
    eventually("the upsert's batch WRITE to be in flight", async || {
        kn.stats(0).batches > 0
    })
    .await;
    const EXTRA: usize = 8;
    let inserts: Vec<_> = (0..MAX_DEFERRED + EXTRA)
        .map(|_| {
            let kn = kn.clone();
            tokio::spawn(async move { kn.execute(put("v2", PutMode::Insert)).await })
        })
        .collect();
    let (mut refused, mut exists) = (0, 0);
    for t in inserts {
        match t.await.unwrap() {
            Err(KvError::Unavailable(_)) => refused += 1,
            Err(KvError::AlreadyExists) => exists += 1,
            other => panic!("an insert behind an acknowledged upsert answered {other:?}"),
        }
    }
    assert!(first.await.unwrap().is_ok());
    assert_eq!((refused, exists), (EXTRA, MAX_DEFERRED));
}

/// A key moves away from KN 1 and back while KN 1 cannot reach the DPM's control service: its
/// Resets cannot learn that the segment holding its old write was merged (and overwritten by
/// KN 2). It must not answer from that segment's copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_that_cannot_confirm_merges_serves_no_stale_value() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let proxy = GrpcProxy::start(dpm.grpc).await;
    let (a, _) = start_inproc_kn(&proxy.url(), 1).await;
    let (b, _) = start_inproc_kn(&dpm.url(), 2).await;
    a.install_map(sole_owner(1, 1)).await;
    b.install_map(sole_owner(1, 1)).await;
    a.execute(put("old", PutMode::Upsert)).await.unwrap();

    // The key moves to KN 2; KN 1 is cut off from the DPM's control service meanwhile.
    proxy.set_cut(true);
    a.prepare_map(sole_owner(2, 2)).await.unwrap();
    merge_all(&dpm, 1, true).await;
    a.commit_map(sole_owner(2, 2)).await.unwrap();
    b.prepare_map(sole_owner(2, 2)).await.unwrap();
    b.commit_map(sole_owner(2, 2)).await.unwrap();
    b.execute(put("new", PutMode::Upsert)).await.unwrap();

    // And back to KN 1.
    b.prepare_map(sole_owner(1, 3)).await.unwrap();
    merge_all(&dpm, 2, false).await;
    b.commit_map(sole_owner(1, 3)).await.unwrap();
    a.prepare_map(sole_owner(1, 3)).await.unwrap();
    a.commit_map(sole_owner(1, 3)).await.unwrap();

    let r = a.execute(get()).await;
    assert!(
        !matches!(&r, Ok(Some(v)) if v.as_ref() == b"old"),
        "KN 1 served the value it wrote before the key moved away ({r:?}); KN 2 has since \
         acknowledged \"new\""
    );
    proxy.set_cut(false);
    eventually("KN 1 to serve the key again", async || {
        match a.execute(get()).await {
            Ok(Some(v)) => {
                assert_eq!(v.as_ref(), b"new", "stale read");
                true
            }
            Err(KvError::Unavailable(_)) => false,
            other => panic!("unexpected answer {other:?}"),
        }
    })
    .await;
}

/// KN 1 takes part in moving the key away (v2) but misses that map's commit; KN 2 writes the
/// key; the key moves back (v3) and KN 1 installs v3 straight after v1. v1 and v3 give KN 1 the
/// same keys, yet what it cached under v1 is stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kn_that_skips_a_map_version_does_not_serve_what_it_cached_before() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let (a, _) = start_inproc_kn(&dpm.url(), 1).await;
    let (b, _) = start_inproc_kn(&dpm.url(), 2).await;
    a.install_map(sole_owner(1, 1)).await;
    b.install_map(sole_owner(1, 1)).await;
    a.execute(put("old", PutMode::Upsert)).await.unwrap();
    assert_eq!(
        a.execute(get()).await.unwrap().as_deref(),
        Some(&b"old"[..])
    );

    a.prepare_map(sole_owner(2, 2)).await.unwrap();
    merge_all(&dpm, 1, false).await;
    // KN 1 never hears of v2's commit.
    b.prepare_map(sole_owner(2, 2)).await.unwrap();
    b.commit_map(sole_owner(2, 2)).await.unwrap();
    b.execute(put("new", PutMode::Upsert)).await.unwrap();
    b.prepare_map(sole_owner(1, 3)).await.unwrap();
    merge_all(&dpm, 2, false).await;
    b.commit_map(sole_owner(1, 3)).await.unwrap();

    a.install_map(sole_owner(1, 3)).await;
    let r = a.execute(get()).await;
    assert!(
        matches!(&r, Ok(Some(v)) if v.as_ref() == b"new"),
        "KN 1 skipped map v2 and answers {r:?}; KN 2 acknowledged \"new\" under v2"
    );
}

/// A clean stop (SIGTERM) writes out and seals every shard's log before the process exits, so
/// the DPM merges all of it without a MergeAll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_stop_seals_every_log_before_exit() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let mut kn = KnProcess::start(&dpm, 5, &dir.path().join("kn.log"), &["--shards", "4"]);
    {
        let mut c = kn.client().await;
        for i in 0..64 {
            c.put(PutRequest {
                key: format!("stop-{i}").into_bytes().into(),
                value: vec![b'x'; 100].into(),
                mode: PbPutMode::Upsert as i32,
            })
            .await
            .unwrap();
        }
    }
    assert!(!pending_segments(&dpm, 5).await.is_empty());
    let status = kn.terminate(Duration::from_secs(20));
    assert!(status.success(), "kv-node exited with {status}");
    // Sealed segments are merged by the DPM on its own; an open one never is.
    let start = std::time::Instant::now();
    loop {
        let pending = pending_segments(&dpm, 5).await;
        if pending.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "segments {pending:?} of the stopped KN are still unmerged: its log was not sealed \
             ({})",
            std::fs::read_to_string(dir.path().join("kn.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
