//! DPM sessions (issue 10, finding 5): a KN whose session dies while it runs (fenced by a
//! monitor that gave up on it, or a dpm-node restart) registers again and carries on, instead
//! of failing every write forever while its heartbeat looks healthy.

use std::time::Duration;

use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::dpm::FenceKnRequest;
use dinomo_proto::kv::{GetRequest, PutMode, PutRequest};

use super::harness::{InProcDpm, KnProcess};

const KEYS: u32 = 100;

fn put(key: String, value: String) -> PutRequest {
    PutRequest {
        key: key.into_bytes().into(),
        value: value.into_bytes().into(),
        mode: PutMode::Upsert as i32,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_live_kn_registers_again_and_keeps_its_acknowledged_writes() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let log = dir.path().join("kn1.log");
    let kn = KnProcess::start(&dpm, 1, &log, &[]);
    let map = ClusterMap::new(
        vec![KnInfo {
            id: 1,
            endpoint: kn.addr.to_string(),
        }],
        64,
        1,
    )
    .unwrap();
    dpm.publish_map(&map).await;
    let mut c = kn.client().await;
    for i in 0..KEYS {
        c.put(put(format!("k{i}"), format!("v{i}"))).await.unwrap();
    }
    // Fenced while alive (as a monitor does when a PrepareMap times out), but still the owner.
    dpm.client()
        .await
        .fence_kn(FenceKnRequest { kn_id: 1 })
        .await
        .unwrap();
    let fenced = std::time::Instant::now();
    // The reconfiguration that fenced it publishes a next map (here: the same membership).
    // Until then the KN may not serve: it was fenced under the map of record (finding 4).
    let mut next = map.clone();
    next.version += 1;
    dpm.publish_map(&next).await;
    let mut last = String::new();
    loop {
        match c.put(put("after".into(), "fence".into())).await {
            Ok(_) => break,
            Err(s) => last = format!("{:?}: {}", s.code(), s.message()),
        }
        assert!(
            fenced.elapsed() < Duration::from_secs(20),
            "the fenced KN still fails writes 20 s later ({last}); log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "writes succeed again {:.2} s after the fence (last error before: {last})",
        fenced.elapsed().as_secs_f64()
    );
    for i in 0..KEYS {
        let v = c
            .get(GetRequest {
                key: format!("k{i}").into_bytes().into(),
            })
            .await
            .unwrap_or_else(|s| panic!("k{i}: {s}"));
        assert_eq!(v.into_inner().value, format!("v{i}").into_bytes());
    }
    let v = c
        .get(GetRequest {
            key: b"after".to_vec().into(),
        })
        .await
        .unwrap();
    assert_eq!(v.into_inner().value, b"fence".to_vec());
}

/// The heartbeat reflects whether the KN can write: with its DPM gone for good, its Stats
/// call fails after a few seconds instead of reporting a healthy node forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_fails_once_the_dpm_session_stays_broken() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let log = dir.path().join("kn1.log");
    let kn = KnProcess::start(&dpm, 1, &log, &[]);
    let mut c = kn.client().await;
    let stats = || dinomo_proto::kv::KnStatsRequest { top_keys: 0 };
    c.stats(stats()).await.expect("a fresh KN is healthy");
    dpm.stop().await;
    let stopped = std::time::Instant::now();
    loop {
        match c.stats(stats()).await {
            Ok(_) => {}
            Err(s) => {
                assert_eq!(s.code(), tonic::Code::Unavailable, "{s}");
                break;
            }
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(20),
            "the KN still reports itself healthy 20 s after its DPM went away"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "heartbeat failed {:.1} s after the DPM stopped",
        stopped.elapsed().as_secs_f64()
    );
}

/// Finding 4: a KN declared failed while alive (its heartbeat was slow, its map reads were
/// not) is fenced, its keys go to another KN, and a client writes them there. The fenced KN
/// must not answer a read with the value from before: its lease renewals fail from the fence
/// on, and the reconfiguration waits out the longest lease before it publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_kn_fenced_as_failed_serves_no_stale_value_after_the_new_map() {
    use dinomo_proto::dpm::MergeAllRequest;
    use dinomo_proto::kv::MapRequest;
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    // Polls the map every 200 ms: after a publish it keeps its old map for up to that long.
    let cfg = dir.path().join("kn.toml");
    std::fs::write(&cfg, "map_poll_ms = 200\nserve_lease_ms = 500\n").unwrap();
    let cfg = cfg.to_str().unwrap();
    let kn1 = KnProcess::start(&dpm, 1, &dir.path().join("kn1.log"), &["--config", cfg]);
    let kn2 = KnProcess::start(&dpm, 2, &dir.path().join("kn2.log"), &["--config", cfg]);
    let info = |id: u32, addr: std::net::SocketAddr| KnInfo {
        id,
        endpoint: addr.to_string(),
    };
    let v1 = ClusterMap::new(vec![info(1, kn1.addr), info(2, kn2.addr)], 64, 1).unwrap();
    dpm.publish_map(&v1).await;
    let keys: Vec<String> = (0..)
        .map(|i| format!("key{i}"))
        .filter(|k| v1.owner(k.as_bytes()) == Some(1))
        .take(20)
        .collect();
    let (mut c1, mut c2) = (kn1.client().await, kn2.client().await);
    tokio::time::sleep(Duration::from_millis(500)).await; // both KNs run under v1
    for k in &keys {
        c1.put(put(k.clone(), "old".into())).await.unwrap();
        c1.get(GetRequest {
            key: k.clone().into_bytes().into(),
        })
        .await
        .unwrap();
    }
    // The monitor's failover of KN 1, step by step: fence, merge, wait out the lease, publish.
    let mut d = dpm.client().await;
    d.fence_kn(FenceKnRequest { kn_id: 1 }).await.unwrap();
    let fenced = std::time::Instant::now();
    d.merge_all(MergeAllRequest {
        kn_id: 1,
        seal_open: true,
    })
    .await
    .unwrap();
    tokio::time::sleep_until(
        (fenced + Duration::from_millis(dinomo_proto::MAX_KN_SERVE_LEASE_MS)).into(),
    )
    .await;
    let v2 = v1.with_kn_removed(1).unwrap();
    dpm.publish_map(&v2).await;
    c2.commit_map(MapRequest {
        map: v2.encode().into(),
    })
    .await
    .unwrap();
    let mut stale = Vec::new();
    for k in &keys {
        c2.put(put(k.clone(), "new".into())).await.unwrap();
        if let Ok(v) = c1
            .get(GetRequest {
                key: k.clone().into_bytes().into(),
            })
            .await
        {
            if v.into_inner().value == b"old"[..] {
                stale.push(k.clone());
            }
        }
    }
    assert!(
        stale.is_empty(),
        "the fenced KN 1 answered {} of {} reads with the value from before KN 2's \
         acknowledged write (first: {})",
        stale.len(),
        keys.len(),
        stale[0]
    );
}

/// Every fabric post has a deadline: a log WRITE that never completes fails as outcome-unknown
/// after `POST_DEADLINE` (not never), the KN registers again, and later writes succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_never_completes_times_out_and_the_kn_carries_on() {
    use bytes::Bytes;
    use dinomo_fabric::fault::FaultPlan;
    use dinomo_kv_node::shard::{PutMode, ShardOp};
    use dinomo_kv_node::KvError;

    let put = |v: &'static str| ShardOp::Put {
        key: Bytes::from_static(b"k"),
        value: Bytes::from_static(v.as_bytes()),
        mode: PutMode::Upsert,
    };
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let (kn, fabrics) = super::harness::start_inproc_kn(&dpm.url(), 1).await;
    kn.execute(put("v0")).await.unwrap();
    fabrics.lock()[0].set_plan(FaultPlan {
        delay: Some(Duration::from_secs(600)),
        fail_next: 0,
        tear_next_write_after: None,
    });
    let started = std::time::Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(30), kn.execute(put("v1")))
        .await
        .expect("a hung WRITE must not hang its caller for good");
    let took = started.elapsed();
    assert!(
        matches!(r, Err(KvError::OutcomeUnknown(_))),
        "a WRITE without completion is outcome-unknown: {r:?}"
    );
    assert!(
        took <= dinomo_kv_node::deadline::POST_DEADLINE + Duration::from_secs(2),
        "answered after {took:?}"
    );
    // The stalled handle belongs to the old session; the KN carries on with a new one.
    let again = std::time::Instant::now();
    loop {
        match kn.execute(put("v2")).await {
            Ok(_) => break,
            Err(e) => assert!(
                again.elapsed() < Duration::from_secs(20),
                "writes still fail 20 s after the timeout: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let v = kn
        .execute(ShardOp::Get {
            key: Bytes::from_static(b"k"),
        })
        .await
        .unwrap();
    assert_eq!(v.as_deref(), Some(&b"v2"[..]));
    println!(
        "the hung WRITE failed after {:.1} s; writes succeeded again {:.2} s later",
        took.as_secs_f64(),
        again.elapsed().as_secs_f64()
    );
}

/// Issue 13's finding: a MergeAll that seals the open segments of a live, unfenced KN (any
/// caller can send one) once let the KN go on appending, and acknowledging writes, into
/// segments the DPM had already merged and retired: after a restart, every write acknowledged
/// since was gone. The DPM now fences such a KN first; it registers again, and what it
/// acknowledges after that lands in segments of its new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealing_a_live_kns_segments_loses_no_write_acknowledged_after() {
    const LATE: u32 = 50;
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let log = dir.path().join("kn1.log");
    let mut kn = KnProcess::start(&dpm, 1, &log, &[]);
    let map = ClusterMap::new(
        vec![KnInfo {
            id: 1,
            endpoint: kn.addr.to_string(),
        }],
        64,
        1,
    )
    .unwrap();
    dpm.publish_map(&map).await;
    let mut c = kn.client().await;
    for i in 0..KEYS {
        c.put(put(format!("k{i}"), format!("v{i}"))).await.unwrap();
    }
    // A plain MergeAll(seal_open) of the live KN, with no fence before it.
    super::harness::merge_all(&dpm, 1, true).await;
    // If that fenced the KN, it serves again under the next map (as after any fence).
    let mut next = map.clone();
    next.version += 1;
    dpm.publish_map(&next).await;

    // Writes acknowledged from now on must survive a restart.
    let started = std::time::Instant::now();
    let mut acked = Vec::new();
    for i in 0..LATE {
        let key = format!("late{i}");
        loop {
            match c.put(put(key.clone(), format!("w{i}"))).await {
                Ok(_) => {
                    acked.push(i);
                    break;
                }
                // Not applied (the KN is registering again): try again.
                Err(s) if s.code() == tonic::Code::Unavailable => {}
                // Outcome unknown: not counted as acknowledged.
                Err(_) => break,
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the KN did not take writes again within 30 s; log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert!(
        acked.len() >= 45,
        "only {} of {LATE} writes acknowledged",
        acked.len()
    );

    // A crash of the KN, then a restart of the dpm-node and of the KN.
    kn.kill9();
    dpm.stop().await;
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let kn = KnProcess::start(&dpm, 1, &dir.path().join("kn1-again.log"), &[]);
    let mut again = next.clone();
    again.version += 1;
    again.kns[0].endpoint = kn.addr.to_string();
    dpm.publish_map(&again).await;
    let mut c = kn.client().await;
    let mut lost = Vec::new();
    for &i in &acked {
        let key = format!("late{i}");
        let got = loop {
            match c
                .get(GetRequest {
                    key: key.clone().into_bytes().into(),
                })
                .await
            {
                Ok(v) => break Some(v.into_inner().value),
                Err(s) if s.code() == tonic::Code::NotFound => break None,
                Err(s) => {
                    assert!(started.elapsed() < Duration::from_secs(90), "{key}: {s}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        if got.as_deref() != Some(format!("w{i}").as_bytes()) {
            lost.push(key);
        }
    }
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged writes lost after the restart: {lost:?}",
        lost.len(),
        acked.len()
    );
    dpm.stop().await;
}
