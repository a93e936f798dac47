//! A KN's prepared state (between PrepareMap and CommitMap) is bounded by
//! `prepare_timeout_ms`: a monitor that crashed right after PrepareMap leaves no KN pausing its
//! keys forever. On expiry the KN takes the published map through the normal install path, so
//! it never serves a key it no longer owns.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dinomo_kv_node::config::KnConfigFile;
use dinomo_kv_node::error::KvError;
use dinomo_kv_node::shard::{PutMode, ShardOp};
use dinomo_kv_node::KvNode;
use dinomo_placement::{ClusterMap, KnInfo};

use dinomo_proto::dpm::{CompareAndPutMetadataRequest, GetMetadataRequest};

use crate::harness::{eventually, merge_all, InProcDpm};

const KEY: &[u8] = b"prepared-key";
const BOUND: Duration = Duration::from_millis(600);

fn sole_owner(kn: u32, version: u64) -> ClusterMap {
    let mut m = ClusterMap::new(
        vec![KnInfo {
            id: kn,
            endpoint: format!("127.0.0.1:{}", 17100 + kn),
        }],
        64,
        1,
    )
    .unwrap();
    m.version = version;
    m
}

async fn kn(dpm: &str, kn_id: u32) -> Arc<KvNode> {
    let cfg = KnConfigFile {
        advertise: format!("127.0.0.1:{}", 17100 + kn_id),
        shards: 1,
        cache_size: "16MiB".parse().unwrap(),
        map_poll_ms: 50,
        serve_lease_ms: 500,
        prepare_timeout_ms: BOUND.as_millis() as u64,
        ..KnConfigFile::in_process(kn_id, dpm.to_string())
    }
    .validate()
    .unwrap();
    KvNode::start(cfg).await.unwrap()
}

fn get() -> ShardOp {
    ShardOp::Get {
        key: Bytes::from_static(KEY),
    }
}

/// The monitor crashed right after PrepareMap: the map it prepared for is never published.
/// The KN serves its keys again within the bound, from the published map.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_map_never_committed_expires() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    dpm.publish_map(&sole_owner(1, 1)).await;
    let a = kn(&dpm.url(), 1).await;
    a.install_map(sole_owner(1, 1)).await;
    a.execute(ShardOp::Put {
        key: Bytes::from_static(KEY),
        value: Bytes::from_static(b"kept"),
        mode: PutMode::Upsert,
    })
    .await
    .unwrap();

    let prepared = Instant::now();
    a.prepare_map(sole_owner(2, 2)).await.unwrap();
    assert!(
        matches!(a.execute(get()).await, Err(KvError::Unavailable(_))),
        "a prepared KN pauses the keys that move"
    );
    eventually(
        "the prepared KN to serve its keys again",
        async || match a.execute(get()).await {
            Ok(v) => {
                assert_eq!(v.as_deref(), Some(&b"kept"[..]));
                true
            }
            Err(KvError::Unavailable(_)) => {
                assert!(
                    prepared.elapsed() < BOUND * 4,
                    "still paused {:?} after PrepareMap (bound {BOUND:?})",
                    prepared.elapsed()
                );
                false
            }
            Err(e) => panic!("unexpected answer {e}"),
        },
    )
    .await;
    assert!(prepared.elapsed() >= BOUND, "resumed before the bound");
    assert_eq!(a.map().version, 1);
}

/// The map was published but its CommitMap never reached the KN (and it did not poll it yet):
/// on expiry the KN takes the published map and does not serve the key it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_takes_the_published_map_and_serves_no_lost_key() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    dpm.publish_map(&sole_owner(1, 1)).await;
    let a = kn(&dpm.url(), 1).await;
    a.install_map(sole_owner(1, 1)).await;
    a.prepare_map(sole_owner(2, 2)).await.unwrap();
    merge_all(&dpm, 1, false).await;
    dpm.publish_map(&sole_owner(2, 2)).await;
    eventually(
        "the prepared KN to take the published map",
        async || match a.execute(get()).await {
            Err(KvError::WrongOwner { map_version, .. }) => {
                assert_eq!(map_version, 2);
                true
            }
            Err(KvError::Unavailable(_)) => false,
            other => panic!("KN 1 lost the key under map 2 but answered {other:?}"),
        },
    )
    .await;
}

/// The reconfiguration record (client::admin::Intent, format 1) of a move from `cur` to
/// `next` in `phase` (1 Prepare, 2 Commit), written byte by byte: this crate does not depend
/// on the client.
fn record(phase: u8, cur: &ClusterMap, next: &ClusterMap) -> Vec<u8> {
    let mut b = vec![1, phase];
    b.extend_from_slice(&7u64.to_le_bytes()); // term
    b.extend_from_slice(&99u64.to_le_bytes()); // nonce
    b.extend_from_slice(&0u32.to_le_bytes()); // no dead KN
    for m in [cur.encode(), next.encode()] {
        b.extend_from_slice(&(m.len() as u32).to_le_bytes());
        b.extend_from_slice(&m);
    }
    b
}

const RECORD: &str = "cluster/reconfiguration";

async fn write_record(dpm: &InProcDpm, raw: Vec<u8>) {
    dpm.client()
        .await
        .compare_and_put_metadata(CompareAndPutMetadataRequest {
            name: RECORD.into(),
            value: Some(raw),
            expected: None,
        })
        .await
        .unwrap();
}

async fn read_record(dpm: &InProcDpm) -> Option<Vec<u8>> {
    dpm.client()
        .await
        .get_metadata(GetMetadataRequest {
            name: RECORD.into(),
        })
        .await
        .unwrap()
        .into_inner()
        .value
}

/// The change is recorded in its Prepare phase (its monitor is slow or gone): at the bound the
/// KN withdraws it, deleting the record (so the monitor can no longer move it to its fences
/// and merges), and only then serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_withdraws_a_change_in_its_prepare_phase() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    dpm.publish_map(&sole_owner(1, 1)).await;
    let a = kn(&dpm.url(), 1).await;
    a.install_map(sole_owner(1, 1)).await;
    write_record(&dpm, record(1, &sole_owner(1, 1), &sole_owner(2, 2))).await;
    a.prepare_map(sole_owner(2, 2)).await.unwrap();
    eventually(
        "the KN to withdraw the change and serve again",
        async || match a.execute(get()).await {
            Ok(None) | Err(KvError::NotFound) => true,
            Err(KvError::Unavailable(_)) => false,
            other => panic!("unexpected answer {other:?}"),
        },
    )
    .await;
    assert_eq!(read_record(&dpm).await, None, "served before withdrawing");
}

/// A change recorded in its Commit phase is past its point of no return (its KNs may be
/// fenced and merged, its cells changed): the KN keeps waiting for its map past the bound,
/// and a CommitMap of an older map (a rollback hint) does not move it either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_past_its_point_of_no_return_is_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    dpm.publish_map(&sole_owner(1, 1)).await;
    let a = kn(&dpm.url(), 1).await;
    a.install_map(sole_owner(1, 1)).await;
    let raw = record(2, &sole_owner(1, 1), &sole_owner(2, 2));
    write_record(&dpm, raw.clone()).await;
    a.prepare_map(sole_owner(2, 2)).await.unwrap();
    a.commit_map(sole_owner(1, 1)).await.unwrap();
    tokio::time::sleep(BOUND * 3).await;
    assert!(
        matches!(a.execute(get()).await, Err(KvError::Unavailable(_))),
        "a KN resumed a change past its point of no return"
    );
    assert_eq!(read_record(&dpm).await, Some(raw));
    // The monitor finishes it: published, then the record deleted.
    merge_all(&dpm, 1, false).await;
    dpm.publish_map(&sole_owner(2, 2)).await;
    eventually("the KN to take the published map", async || {
        matches!(a.execute(get()).await, Err(KvError::WrongOwner { .. }))
    })
    .await;
}
