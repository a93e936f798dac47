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

    publish(&mut c, None, b"v1", None).await.unwrap();

    // Two reconfigurations started from v1 race to publish different maps of version 2.
    for round in 0..20 {
        let base = format!("v1-{round}").into_bytes();
        let cur = map_of_record(&mut c).await.unwrap();
        publish(&mut c, Some(&cur), &base, None).await.unwrap();
        let a = format!("v2a-{round}").into_bytes();
        let b = format!("v2b-{round}").into_bytes();
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
    let e = publish(&mut c, None, b"v1-again", None).await.unwrap_err();
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
    publish(&mut c, None, b"m1", Some(old)).await.unwrap();
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
        publish(&mut c, Some(b"m1"), b"m2-old", Some(old)).await,
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
    assert_eq!(map_of_record(&mut c).await.as_deref(), Some(&b"m1"[..]));

    // The new term works, and so do calls without a term (KNs, tests, the CLI bootstrap).
    publish(&mut c, Some(b"m1"), b"m2", Some(new))
        .await
        .unwrap();
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
