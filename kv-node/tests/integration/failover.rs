//! KN failure: a kv-node killed with SIGKILL while its writes sit in unmerged log segments.
//! MergeAll at the DPM (and fencing) makes every acknowledged write readable from the KN that
//! takes over its keys; a restarted KN reads everything back through the DPM.

use std::collections::HashMap;

use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::dpm::{FenceKnRequest, MergeAllRequest};
use dinomo_proto::kv::{DeleteRequest, GetRequest, PutMode, PutRequest};
use tonic::Code;

use super::harness::{eventually, InProcDpm, KnProcess};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_kn_writes_survive_through_merge_all_and_takeover() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let mut kn1 = KnProcess::start(&dpm, 1, &dir.path().join("kn1.log"), &[]);
    let kn2 = KnProcess::start(&dpm, 2, &dir.path().join("kn2.log"), &[]);
    let map = ClusterMap::new(
        vec![
            KnInfo {
                id: 1,
                endpoint: kn1.addr.to_string(),
            },
            KnInfo {
                id: 2,
                endpoint: kn2.addr.to_string(),
            },
        ],
        64,
        1,
    )
    .unwrap();
    dpm.publish_map(&map).await;
    let (mut c1, mut c2) = (kn1.client().await, kn2.client().await);
    // Wait until both KNs use the two-KN map.
    let k1 = (0..)
        .map(|i| format!("probe{i}"))
        .find(|k| map.owner(k.as_bytes()) == Some(2))
        .unwrap();
    eventually("kn1 to load the map", async || {
        c1.get(GetRequest {
            key: k1.clone().into_bytes().into(),
        })
        .await
        .err()
        .is_some_and(|e| e.code() == Code::FailedPrecondition)
    })
    .await;

    // Acknowledged state, routed to the owners.
    let mut truth: HashMap<String, Option<String>> = HashMap::new();
    for i in 0..1500 {
        let key = format!("key{}", i % 1000);
        let value = format!("value-{i}-{}", "x".repeat(i % 200));
        let owner = map.owner(key.as_bytes()).unwrap();
        let c = if owner == 1 { &mut c1 } else { &mut c2 };
        if i % 17 == 0 && truth.get(&key).is_some_and(|v| v.is_some()) {
            c.delete(DeleteRequest {
                key: key.clone().into_bytes().into(),
            })
            .await
            .unwrap();
            truth.insert(key, None);
        } else {
            c.put(PutRequest {
                key: key.clone().into_bytes().into(),
                value: value.clone().into_bytes().into(),
                mode: PutMode::Upsert as i32,
            })
            .await
            .unwrap();
            truth.insert(key, Some(value));
        }
    }
    let on_kn1 = truth
        .keys()
        .filter(|k| map.owner(k.as_bytes()) == Some(1))
        .count();
    assert!(on_kn1 > 200, "KN 1 must own a good share ({on_kn1})");

    // KN 1 dies with its log unmerged (8 MiB segments: nothing was sealed).
    kn1.kill9();
    let mut d = dpm.client().await;
    let unmerged = super::harness::pending_segments(&dpm, 1).await;
    assert!(!unmerged.is_empty(), "KN 1's log is unmerged when it dies");
    // The fence seals its open segments (the background workers may merge them from then on);
    // MergeAll returns once every one of them is merged.
    d.fence_kn(FenceKnRequest { kn_id: 1 }).await.unwrap();
    d.merge_all(MergeAllRequest {
        kn_id: 1,
        seal_open: true,
    })
    .await
    .unwrap();
    assert!(
        super::harness::pending_segments(&dpm, 1).await.is_empty(),
        "MergeAll left KN 1's segments {unmerged:?} unmerged"
    );
    let next = map.with_kn_removed(1).unwrap();
    dpm.publish_map(&next).await;
    let probe = truth
        .keys()
        .find(|k| map.owner(k.as_bytes()) == Some(1))
        .unwrap()
        .clone();
    eventually("kn2 to take over", async || {
        c2.get(GetRequest {
            key: probe.clone().into_bytes().into(),
        })
        .await
        .is_ok()
            || c2
                .get(GetRequest {
                    key: probe.clone().into_bytes().into(),
                })
                .await
                .err()
                .is_some_and(|e| e.code() == Code::NotFound)
    })
    .await;
    for (k, v) in &truth {
        let r = c2
            .get(GetRequest {
                key: k.clone().into_bytes().into(),
            })
            .await;
        match v {
            Some(v) => assert_eq!(r.unwrap().into_inner().value, v.as_bytes(), "key {k}"),
            None => assert_eq!(r.unwrap_err().code(), Code::NotFound, "deleted key {k}"),
        }
    }
    dpm.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_kn_reads_everything_back_with_an_empty_cache() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    let log = dir.path().join("kn.log");
    let mut kn = KnProcess::start(&dpm, 0, &log, &[]);
    let mut c = kn.client().await;
    for i in 0..500 {
        c.put(PutRequest {
            key: format!("r{i}").into_bytes().into(),
            value: format!("v{i}").into_bytes().into(),
            mode: 0,
        })
        .await
        .unwrap();
    }
    kn.kill9();
    let kn = KnProcess::start(&dpm, 0, &log, &[]);
    let mut c = kn.client().await;
    for i in 0..500 {
        let v = c
            .get(GetRequest {
                key: format!("r{i}").into_bytes().into(),
            })
            .await
            .unwrap()
            .into_inner()
            .value;
        assert_eq!(v, format!("v{i}").into_bytes());
    }
    let s = c
        .stats(dinomo_proto::kv::KnStatsRequest { top_keys: 0 })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        s.value_hits + s.shortcut_hits + s.unmerged_hits,
        0,
        "a restarted KN starts cold: {s:?}"
    );
    assert_eq!(s.misses, 500);
    dpm.stop().await;
}
