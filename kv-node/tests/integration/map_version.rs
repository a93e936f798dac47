//! PrepareMap and CommitMap take only the next map version after the KN's (decision 0005,
//! "invariants and validation"): a KN behind first takes the published map; anything else is
//! refused with FAILED_PRECONDITION naming both versions, so no map can wedge a KN.

use std::sync::Arc;

use dinomo_kv_node::config::KnConfigFile;
use dinomo_kv_node::error::KvError;
use dinomo_kv_node::KvNode;
use dinomo_placement::{ClusterMap, KnInfo};
use tonic::Code;

use crate::harness::InProcDpm;

fn map(version: u64) -> ClusterMap {
    let mut m = ClusterMap::new(
        vec![KnInfo {
            id: 1,
            endpoint: "127.0.0.1:17201".into(),
        }],
        64,
        1,
    )
    .unwrap();
    m.version = version;
    m
}

/// A KN polling the published map as slowly as its lease allows (a poll may still install
/// a published map at any time: the tests allow for it).
async fn slow_polling_kn(dpm: &str) -> Arc<KvNode> {
    let cfg = KnConfigFile {
        advertise: "127.0.0.1:17201".into(),
        shards: 1,
        cache_size: "16MiB".parse().unwrap(),
        map_poll_ms: dinomo_proto::MAX_KN_SERVE_LEASE_MS / 2,
        serve_lease_ms: dinomo_proto::MAX_KN_SERVE_LEASE_MS,
        ..KnConfigFile::in_process(1, dpm.to_string())
    }
    .validate()
    .unwrap();
    KvNode::start(cfg).await.unwrap()
}

/// The refusal, as a KN answers it over gRPC.
fn refused(r: Result<u64, KvError>, kn: u64, offered: u64) {
    let e = r.expect_err("the map version must be refused");
    assert!(
        matches!(e, KvError::MapVersion { kn: k, offered: o, .. } if k == kn && o == offered),
        "{e:?}"
    );
    let s = tonic::Status::from(e);
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert!(
        s.message().contains(&kn.to_string()) && s.message().contains(&offered.to_string()),
        "the message names both versions: {}",
        s.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepare_takes_only_the_next_version() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    dpm.publish_map(&map(1)).await;
    let kn = slow_polling_kn(&dpm.url()).await;
    assert_eq!(kn.map().version, 1);

    refused(kn.prepare_map(map(1)).await, 1, 1); // +0
    refused(kn.prepare_map(map(3)).await, 1, 3); // +2, also after asking the DPM
    refused(kn.prepare_map(map(u64::MAX)).await, 1, u64::MAX);
    // Nothing was paused by the refused ones; the next version is taken.
    assert_eq!(kn.prepare_map(map(2)).await.unwrap(), 2);
    assert_eq!(kn.commit_map(map(2)).await.unwrap(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_far_ahead_is_refused_and_does_not_wedge_the_kn() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    dpm.publish_map(&map(1)).await;
    let kn = slow_polling_kn(&dpm.url()).await;

    refused(kn.commit_map(map(u64::MAX)).await, 1, u64::MAX);
    refused(kn.commit_map(map(3)).await, 1, 3); // +2
    assert_eq!(kn.map().version, 1, "a refused map is not installed");
    // The real next map still gets in.
    kn.prepare_map(map(2)).await.unwrap();
    dpm.publish_map(&map(2)).await;
    assert_eq!(kn.commit_map(map(2)).await.unwrap(), 2);
    assert_eq!(kn.map().version, 2);
    // A commit of the KN's own version (a commit racing the KN's poll, or the rollback hint
    // of admin::nudge) installs nothing and is not an error.
    assert_eq!(kn.commit_map(map(2)).await.unwrap(), 2);
    assert_eq!(kn.commit_map(map(1)).await.unwrap(), 2);
}

/// A KN behind the published map (it missed a commit and has not polled yet) is not refused:
/// it takes the published map first, then the next version after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kn_behind_catches_up_with_the_published_map_first() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = InProcDpm::start(dir.path(), "8MiB").await;
    dpm.publish_map(&map(1)).await;
    let kn = slow_polling_kn(&dpm.url()).await;
    dpm.publish_map(&map(2)).await;
    // Unless its poll came first, the KN is at v1 here: v3 is two ahead of it.
    assert_eq!(kn.prepare_map(map(3)).await.unwrap(), 3);
    assert_eq!(kn.map().version, 2, "the published map was taken first");
    dpm.publish_map(&map(3)).await;
    dpm.publish_map(&map(4)).await;
    // Behind again (v4 published); a commit of v4 is the published map itself.
    assert_eq!(kn.commit_map(map(4)).await.unwrap(), 4);
    // And a commit of v5 over it is the next version.
    assert_eq!(kn.commit_map(map(5)).await.unwrap(), 5);
}
