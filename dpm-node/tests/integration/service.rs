//! DpmService over gRPC against the real binary: the control calls, and the statuses that bad
//! or fenced calls get.

use dinomo_proto::dpm::{
    AllocateSegmentRequest, CompareAndPutMetadataRequest, FenceKnRequest, GetMetadataRequest,
    IndirectCellRequest, MergeAllRequest, PutMetadataRequest, RegisterKnRequest,
    SealSegmentRequest, StatsRequest,
};
use tonic::Code;

use super::dpm::cluster_map;
use super::process::{write_config, DpmProcess};

#[tokio::test]
async fn control_calls_and_their_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "");
    let mut dpm = DpmProcess::start(&cfg, &dir.path().join("log"));
    let mut c = dpm.client().await;

    let r = c
        .register_kn(RegisterKnRequest {
            pid: 0,
            pid_namespace: 0,
            forwards_writes: false,
            kn_id: None,
            endpoint: "127.0.0.1:1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let f = r.fabric.clone().unwrap();
    assert_eq!(f.kind(), dinomo_proto::dpm::FabricKind::Shm);
    assert!(dpm.fabric.is_none(), "a shm dpm-node starts no tcp NIC");
    assert!(
        std::path::Path::new(&f.address).exists(),
        "shm fabric address is the pool path"
    );
    assert_eq!(r.segment_size, 128 << 10);

    let seg = c
        .allocate_segment(AllocateSegmentRequest {
            kn_id: r.kn_id,
            epoch: r.epoch,
            stream: 0,
            deletes_only: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(seg.len, 128 << 10);
    let pending = c
        .seal_segment(SealSegmentRequest {
            kn_id: r.kn_id,
            epoch: r.epoch,
            segment_id: seg.segment_id,
        })
        .await
        .unwrap()
        .into_inner()
        .pending_segments;
    assert!(pending <= 1);
    c.merge_all(MergeAllRequest {
        kn_id: r.kn_id,
        seal_open: true,
    })
    .await
    .unwrap();
    // Sealing the open segments of a registered KN fenced it first: it cannot append to
    // segments sealed under it (issue 13), so its epoch is refused from now on.
    let e = c
        .allocate_segment(AllocateSegmentRequest {
            kn_id: r.kn_id,
            epoch: r.epoch,
            stream: 0,
            deletes_only: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let r = c
        .register_kn(RegisterKnRequest {
            pid: 0,
            pid_namespace: 0,
            forwards_writes: false,
            kn_id: Some(r.kn_id),
            endpoint: "127.0.0.1:1".into(),
        })
        .await
        .unwrap()
        .into_inner();

    // Unknown KN, wrong owner, nonexistent segment.
    let e = c
        .allocate_segment(AllocateSegmentRequest {
            kn_id: 77,
            epoch: 1,
            stream: 0,
            deletes_only: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let e = c
        .seal_segment(SealSegmentRequest {
            kn_id: r.kn_id,
            epoch: r.epoch,
            segment_id: 1 << 40,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = c
        .allocate_segment(AllocateSegmentRequest {
            kn_id: 100_000,
            epoch: 1,
            stream: 0,
            deletes_only: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");

    // Fencing: the old epoch is refused with a message saying to re-register.
    c.fence_kn(FenceKnRequest { kn_id: r.kn_id }).await.unwrap();
    let e = c
        .allocate_segment(AllocateSegmentRequest {
            kn_id: r.kn_id,
            epoch: r.epoch,
            stream: 0,
            deletes_only: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(e.message().contains("re-register"), "{}", e.message());
    let r2 = c
        .register_kn(RegisterKnRequest {
            pid: 0,
            pid_namespace: 0,
            forwards_writes: false,
            kn_id: Some(r.kn_id),
            endpoint: "127.0.0.1:2".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r2.epoch > r.epoch);

    // Metadata and cells.
    c.compare_and_put_metadata(CompareAndPutMetadataRequest {
        name: "cluster/map".into(),
        value: Some(cluster_map(1)),
        expected: None,
    })
    .await
    .unwrap();
    let v = c
        .get_metadata(GetMetadataRequest {
            name: "cluster/map".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .value;
    assert_eq!(v, Some(cluster_map(1)));
    let e = c
        .put_metadata(PutMetadataRequest {
            name: "dpm/x".into(),
            value: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let e = c
        .install_indirect_cell(IndirectCellRequest {
            key: vec![],
            lookup_only: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let lookup = IndirectCellRequest {
        key: b"hot".to_vec(),
        lookup_only: true,
    };
    let e = c.install_indirect_cell(lookup.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "a lookup never creates a cell");
    let cell = c
        .install_indirect_cell(IndirectCellRequest {
            key: b"hot".to_vec(),
            lookup_only: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(cell.cell_offset > 0 && cell.cell_offset % 64 == 0);
    let found = c.install_indirect_cell(lookup.clone()).await.unwrap();
    assert_eq!(found.into_inner().cell_offset, cell.cell_offset);

    let s = c.stats(StatsRequest {}).await.unwrap().into_inner();
    assert!(s.segments_total > 0 && s.segments_free <= s.segments_total);
    assert!(!s.durability.is_empty());
    dpm.stop();

    // Metadata survived the restart.
    let dpm = DpmProcess::start(&cfg, &dir.path().join("log"));
    let v = dpm
        .client()
        .await
        .get_metadata(GetMetadataRequest {
            name: "cluster/map".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .value;
    assert_eq!(v, Some(cluster_map(1)));
    // So did the cell.
    let found = dpm
        .client()
        .await
        .install_indirect_cell(lookup)
        .await
        .unwrap();
    assert_eq!(found.into_inner().cell_offset, cell.cell_offset);
}
