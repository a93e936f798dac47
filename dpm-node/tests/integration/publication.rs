//! Map publication and monitor terms at the DPM, over gRPC against the real binary: a publish
//! is a compare-and-swap on the map it replaces, so two different maps of the same version
//! cannot both become the map of record; and once a monitor term is started, calls carrying an
//! older term (a deposed monitor) are refused, also after a DPM restart.

use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::{
    CompareAndPutMetadataRequest, FenceKnRequest, GetMetadataRequest, IndirectCellRequest,
    MergeAllRequest, NewMonitorTermRequest, PutMetadataRequest,
};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use super::dpm::{cluster_map, cluster_map_at};
use super::process::{write_config, DpmProcess};

const MAP: &str = "cluster/map";
/// The request header that carries a monitor term (dpm.proto, "Monitor terms").
const TERM_HEADER: &str = "dinomo-monitor-term";

fn with_term<T>(msg: T, term: Option<u64>) -> Request<T> {
    let mut r = Request::new(msg);
    if let Some(t) = term {
        r.metadata_mut()
            .insert(TERM_HEADER, t.to_string().parse().unwrap());
    }
    r
}

/// Publishes `value` as the map of record, replacing `expected` (None: no map yet).
async fn publish(
    c: &mut DpmServiceClient<Channel>,
    expected: Option<&[u8]>,
    value: &[u8],
    term: Option<u64>,
) -> Result<(), Status> {
    c.compare_and_put_metadata(with_term(
        CompareAndPutMetadataRequest {
            name: MAP.into(),
            value: Some(value.to_vec()),
            expected: expected.map(<[u8]>::to_vec),
        },
        term,
    ))
    .await
    .map(|_| ())
}

/// Starts a new monitor term and returns it.
async fn take_term(c: &mut DpmServiceClient<Channel>) -> u64 {
    c.new_monitor_term(NewMonitorTermRequest {})
        .await
        .unwrap()
        .into_inner()
        .term
}

fn version_of(map: &[u8]) -> u64 {
    dinomo_placement::ClusterMap::decode(map).unwrap().version
}

async fn map_of_record(c: &mut DpmServiceClient<Channel>) -> Option<Vec<u8>> {
    c.get_metadata(GetMetadataRequest { name: MAP.into() })
        .await
        .unwrap()
        .into_inner()
        .value
}

#[tokio::test]
async fn two_publishes_of_the_same_next_version_one_wins() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "");
    let dpm = DpmProcess::start(&cfg, &dir.path().join("log"));
    let mut c = dpm.client().await;

    publish(&mut c, None, &cluster_map(1), None).await.unwrap();

    // Two reconfigurations started from the same map race to publish different maps of its
    // next version.
    for round in 0..20 {
        let cur = map_of_record(&mut c).await.unwrap();
        let v = version_of(&cur);
        let base = cluster_map_at(v + 1, 1000 + round);
        publish(&mut c, Some(&cur), &base, None).await.unwrap();
        let a = cluster_map_at(v + 2, 2000 + round);
        let b = cluster_map_at(v + 2, 3000 + round);
        let (mut ca, mut cb) = (c.clone(), c.clone());
        let (ra, rb) = tokio::join!(
            publish(&mut ca, Some(&base), &a, None),
            publish(&mut cb, Some(&base), &b, None)
        );
        let winner = match (&ra, &rb) {
            (Ok(()), Err(e)) => {
                assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
                &a
            }
            (Err(e), Ok(())) => {
                assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
                &b
            }
            _ => panic!(
                "round {round}: exactly one of two publishes over the same map must succeed; \
                 got {ra:?} and {rb:?}"
            ),
        };
        assert_eq!(map_of_record(&mut c).await.as_ref(), Some(winner));
        let loser = if winner == &a { &b } else { &a };
        // The loser retrying over the map it started from is refused as well.
        let e = publish(&mut c, Some(&base), loser, None).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(
            e.message().contains(MAP) && e.message().contains("re-read"),
            "{}",
            e.message()
        );
    }

    // The bootstrap publish (no map yet) happens once: a second one finds a map and is refused.
    let cur = map_of_record(&mut c).await;
    let e = publish(&mut c, None, &cluster_map_at(1, 9), None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(map_of_record(&mut c).await, cur);
}

#[tokio::test]
async fn calls_with_an_older_monitor_term_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "");
    let log = dir.path().join("log");
    let mut dpm = DpmProcess::start(&cfg, &log);
    let mut c = dpm.client().await;

    let old = take_term(&mut c).await;
    let (m1, m2) = (cluster_map(1), cluster_map(2));
    publish(&mut c, None, &m1, Some(old)).await.unwrap();
    c.fence_kn(with_term(FenceKnRequest { kn_id: 3 }, Some(old)))
        .await
        .unwrap();

    // Another monitor takes over.
    let new = take_term(&mut c).await;
    assert!(new > old);

    // The deposed monitor can no longer fence, merge or publish.
    let stale = |r: Result<(), Status>, what: &str| {
        let e = r.expect_err(&format!("{what} with the older term {old} must be refused"));
        assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
        assert!(e.message().contains("term"), "{what}: {}", e.message());
    };
    stale(
        c.fence_kn(with_term(FenceKnRequest { kn_id: 4 }, Some(old)))
            .await
            .map(|_| ()),
        "FenceKn",
    );
    stale(
        c.merge_all(with_term(
            MergeAllRequest {
                kn_id: 3,
                seal_open: true,
            },
            Some(old),
        ))
        .await
        .map(|_| ()),
        "MergeAll",
    );
    stale(
        publish(&mut c, Some(&m1), &cluster_map_at(2, 9), Some(old)).await,
        "publishing the map",
    );
    stale(
        c.put_metadata(with_term(
            PutMetadataRequest {
                name: "cluster/other".into(),
                value: Some(b"x".to_vec()),
            },
            Some(old),
        ))
        .await
        .map(|_| ()),
        "PutMetadata",
    );
    stale(
        c.install_indirect_cell(with_term(
            IndirectCellRequest {
                key: b"hot".to_vec(),
                lookup_only: false,
            },
            Some(old),
        ))
        .await
        .map(|_| ()),
        "InstallIndirectCell",
    );
    stale(
        c.remove_indirect_cell(with_term(
            IndirectCellRequest {
                key: b"hot".to_vec(),
                lookup_only: false,
            },
            Some(old),
        ))
        .await
        .map(|_| ()),
        "RemoveIndirectCell",
    );
    // A term never started, or a header that is not a number, is a caller's bug.
    let e = c
        .fence_kn(with_term(FenceKnRequest { kn_id: 4 }, Some(new + 1)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let mut bad = Request::new(FenceKnRequest { kn_id: 4 });
    bad.metadata_mut()
        .insert(TERM_HEADER, "seven".parse().unwrap());
    let e = c.fence_kn(bad).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(map_of_record(&mut c).await, Some(m1.clone()));

    // The new term works, and so do calls without a term (KNs, tests, the CLI bootstrap).
    publish(&mut c, Some(&m1), &m2, Some(new)).await.unwrap();
    c.fence_kn(with_term(FenceKnRequest { kn_id: 4 }, Some(new)))
        .await
        .unwrap();
    c.fence_kn(FenceKnRequest { kn_id: 5 }).await.unwrap();

    // The highest term survives a restart.
    dpm.stop();
    let dpm = DpmProcess::start(&cfg, &log);
    let mut c = dpm.client().await;
    stale(
        c.fence_kn(with_term(FenceKnRequest { kn_id: 4 }, Some(old)))
            .await
            .map(|_| ()),
        "FenceKn after a restart",
    );
    assert!(take_term(&mut c).await > new);
}

/// Decision 0005: the map of record is written only by CompareAndPutMetadata, whoever calls:
/// PutMetadata cannot write or delete it, and neither can a compare-and-swap delete.
#[tokio::test]
async fn the_map_is_never_put_or_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "");
    let dpm = DpmProcess::start(&cfg, &dir.path().join("log"));
    let mut c = dpm.client().await;

    let put = |value: Option<Vec<u8>>| PutMetadataRequest {
        name: MAP.into(),
        value,
    };
    // Not even the first map (nothing published yet).
    let e = c.put_metadata(put(Some(cluster_map(1)))).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("CompareAndPutMetadata"),
        "{}",
        e.message()
    );
    assert_eq!(map_of_record(&mut c).await, None);

    let m1 = cluster_map(1);
    publish(&mut c, None, &m1, None).await.unwrap();
    let e = c.put_metadata(put(Some(cluster_map(2)))).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let e = c.put_metadata(put(None)).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "a delete: {e:?}");
    let e = c
        .compare_and_put_metadata(CompareAndPutMetadataRequest {
            name: MAP.into(),
            value: None,
            expected: Some(m1.clone()),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "a CAS delete: {e:?}");
    assert_eq!(map_of_record(&mut c).await, Some(m1));
}

/// Decision 0005: a published map decodes, and its version is exactly the published one + 1
/// (1 over no map); otherwise INVALID_ARGUMENT naming both versions.
#[tokio::test]
async fn a_published_map_is_exactly_the_next_version() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "");
    let dpm = DpmProcess::start(&cfg, &dir.path().join("log"));
    let mut c = dpm.client().await;
    let refused = |r: Result<(), Status>, names: &[&str]| {
        let e = r.expect_err("the publish must be refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        for n in names {
            assert!(e.message().contains(n), "{n:?} not in: {}", e.message());
        }
    };

    // The first map is version 1.
    refused(
        publish(&mut c, None, &cluster_map(2), None).await,
        &["version 2", "no map published", "exactly version 1"],
    );
    refused(
        publish(&mut c, None, b"not a map", None).await,
        &["not a cluster map"],
    );
    let m1 = cluster_map(1);
    publish(&mut c, None, &m1, None).await.unwrap();

    // Over version 1: +0, +2 and u64::MAX are refused, garbage too.
    refused(
        publish(&mut c, Some(&m1), &cluster_map_at(1, 9), None).await,
        &["version 1 does not follow the published version 1"],
    );
    refused(
        publish(&mut c, Some(&m1), &cluster_map(3), None).await,
        &["version 3", "published version 1", "exactly version 2"],
    );
    refused(
        publish(&mut c, Some(&m1), &cluster_map(u64::MAX), None).await,
        &[&u64::MAX.to_string(), "published version 1"],
    );
    refused(
        publish(&mut c, Some(&m1), b"{\"format_version\":1}", None).await,
        &["not a cluster map"],
    );
    assert_eq!(map_of_record(&mut c).await, Some(m1.clone()));

    // A compare that fails is still answered as one (the caller re-reads and starts over).
    let e = publish(&mut c, Some(&cluster_map_at(1, 9)), &cluster_map(2), None)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");

    let m2 = cluster_map(2);
    publish(&mut c, Some(&m1), &m2, None).await.unwrap();
    assert_eq!(map_of_record(&mut c).await, Some(m2));
}

/// Decision 0005 size limits, as a caller meets them over gRPC: names, values (64 KiB, 8 MiB
/// for the map and the reconfiguration record) and KN endpoints are refused with
/// INVALID_ARGUMENT before anything changes.
#[tokio::test]
async fn oversized_metadata_and_bad_endpoints_are_refused() {
    use dinomo_dpm_node::limits::{MAX_CLUSTER_VALUE, MAX_METADATA_NAME, MAX_METADATA_VALUE};
    use dinomo_proto::dpm::{ListMetadataRequest, RegisterKnRequest};
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "");
    let dpm = DpmProcess::start(&cfg, &dir.path().join("log"));
    let mut c = dpm.client().await;
    let put = |name: String, len: usize| PutMetadataRequest {
        name,
        value: Some(vec![b'x'; len]),
    };
    fn invalid<T: std::fmt::Debug>(r: Result<tonic::Response<T>, Status>, what: &str) {
        let e = r.expect_err(what);
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
    }

    c.put_metadata(put("n".repeat(MAX_METADATA_NAME), 1))
        .await
        .unwrap();
    invalid(
        c.put_metadata(put("n".repeat(MAX_METADATA_NAME + 1), 1))
            .await,
        "a 257-byte name",
    );
    invalid(
        c.put_metadata(put("na\u{ef}ve".into(), 1)).await,
        "a name that is not ASCII",
    );
    c.put_metadata(put("v".into(), MAX_METADATA_VALUE))
        .await
        .unwrap();
    invalid(
        c.put_metadata(put("v".into(), MAX_METADATA_VALUE + 1))
            .await,
        "a value over 64 KiB",
    );
    // The reconfiguration record may be larger (up to what the metadata area holds).
    let big = vec![b'r'; MAX_METADATA_VALUE + 1];
    c.compare_and_put_metadata(CompareAndPutMetadataRequest {
        name: "cluster/reconfiguration".into(),
        value: Some(big.clone()),
        expected: None,
    })
    .await
    .unwrap();
    invalid(
        c.compare_and_put_metadata(CompareAndPutMetadataRequest {
            name: "cluster/reconfiguration".into(),
            value: Some(vec![b'r'; MAX_CLUSTER_VALUE + 1]),
            expected: Some(big),
        })
        .await,
        "a reconfiguration record over 8 MiB",
    );
    let names: Vec<String> = c
        .list_metadata(ListMetadataRequest { prefix: "".into() })
        .await
        .unwrap()
        .into_inner()
        .entries
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(
        names,
        [
            "cluster/reconfiguration",
            &"n".repeat(MAX_METADATA_NAME),
            "v"
        ],
        "nothing refused was written"
    );

    let register = |endpoint: String| RegisterKnRequest {
        kn_id: Some(1),
        endpoint,
        pid: 0,
        pid_namespace: 0,
        forwards_writes: false,
    };
    for bad in [
        String::new(),
        "x".into(),
        "host:".into(),
        format!("{}:1", "h".repeat(254)),
    ] {
        invalid(c.register_kn(register(bad.clone())).await, &bad);
    }
    c.register_kn(register("kv-0.dinomo-kv:7800".into()))
        .await
        .unwrap();
}
