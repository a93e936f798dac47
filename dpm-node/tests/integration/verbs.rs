//! The dpm-node serving the verbs fabric (cargo feature `rdma`), for real inside the Soft-RoCE
//! VM (scripts/vm-cluster.sh, scripts/vm-tests.sh): its NIC is the DPM's key fence, so FenceKn
//! and a KN's re-registration stop the old key's RDMA operations at the device when they
//! return, not a watcher's poll later. Outside the VM, without an RDMA device, it says it is
//! skipped; inside it (DINOMO_VM=1) a missing device fails it.
#![cfg(feature = "rdma")]

use bytes::Bytes;
use dinomo_dpm_node::config::{DpmConfigFile, FabricKind};
use dinomo_dpm_node::server::{FabricEndpoint, Nic};
use dinomo_dpm_node::Dpm;
use dinomo_fabric::verbs::{device_names, VerbsFabric};
use dinomo_fabric::{FabricError, FabricExt};
use dinomo_layout::segment::HEADER_SIZE;

/// Whether an RDMA device is here; without one says the test is skipped (outside the test VM)
/// or fails it (inside: DINOMO_VM=1).
fn rdma_device_here() -> bool {
    if device_names().is_empty() {
        assert!(
            std::env::var("DINOMO_VM").is_err(),
            "DINOMO_VM=1 but there is no RDMA device"
        );
        println!("SKIPPED: no RDMA device (not in the test VM; scripts/vm-cluster.sh runs this)");
        return false;
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_kn_and_reregistration_stop_a_verbs_kn_at_once() {
    if !rdma_device_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = DpmConfigFile {
        pool_size: "32MiB".parse().unwrap(),
        segment_size: "256KiB".parse().unwrap(),
        fabric: FabricKind::Verbs,
        initial_index_buckets: 64,
        ..DpmConfigFile::in_process(dir.path().join("pool"))
    }
    .validate()
    .unwrap();
    assert_eq!(cfg.fabric, FabricKind::Verbs);
    let dpm = Dpm::open(cfg).unwrap();
    let (nic, endpoint) = Nic::start(&dpm).await.unwrap();
    let FabricEndpoint::Verbs(addr) = endpoint else {
        panic!("a verbs node must advertise a side channel, got {endpoint}");
    };
    assert_eq!(endpoint.to_string(), format!("verbs:{addr}"));

    // A KN's segment: it writes there (past the segment header, which the DPM reads when it
    // merges a fenced KN's logs) through its queue pair.
    let body = HEADER_SIZE as u64;
    let reg = dpm.register_kn(Some(1), "verbs-kn").unwrap();
    let seg = dpm.allocate_segment(1, 0, reg.epoch, false).unwrap();
    let kn = VerbsFabric::connect(addr, reg.key).await.unwrap();
    kn.write(seg.offset + body, Bytes::from_static(b"before the fence"))
        .await
        .unwrap();

    // FenceKn: when it returns, the device refuses the KN's next operation (no 100 ms grace).
    let d = dpm.clone();
    tokio::task::spawn_blocking(move || d.fence_kn(1))
        .await
        .unwrap()
        .unwrap();
    let e = kn
        .write(
            seg.offset + body + 64,
            Bytes::from_static(b"after the fence"),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, FabricError::AccessDenied { .. }), "{e}");
    assert_eq!(
        dpm.pool().read_vec(seg.offset + body + 64, 15).unwrap(),
        vec![0u8; 15],
        "a fenced KN's WRITE must not land"
    );

    // Re-registration revokes the previous incarnation's key the same way (another KN: a KN
    // fenced under the current map may not allocate again until the map changes).
    let reg2 = dpm.register_kn(Some(2), "verbs-kn-2").unwrap();
    let kn2 = VerbsFabric::connect(addr, reg2.key).await.unwrap();
    let seg2 = dpm.allocate_segment(2, 0, reg2.epoch, false).unwrap();
    kn2.write(seg2.offset + body, Bytes::from_static(b"second life"))
        .await
        .unwrap();
    let reg3 = dpm.register_kn(Some(2), "verbs-kn-2").unwrap();
    let e = kn2
        .write(seg2.offset + body + 64, Bytes::from_static(b"late"))
        .await
        .unwrap_err();
    assert!(matches!(e, FabricError::AccessDenied { .. }), "{e}");
    assert!(reg3.epoch > reg2.epoch);
    // A stale key cannot even connect.
    assert!(matches!(
        VerbsFabric::connect(addr, reg2.key).await.unwrap_err(),
        FabricError::AccessDenied { .. }
    ));
    drop((kn, kn2, nic));
    println!("verbs: FenceKn and re-registration fenced the KN at the device");
}

/// Replication with the KNs on verbs (docs/decisions/0007, "One-sided fabrics"): a KN's
/// forwarded batches are in both backups' pools after the primary is killed, unforwarded ones
/// are not; and a merge ships unforwarded batches before indexing them
/// (`replication_one_sided.rs` runs the same on shm).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_with_verbs_kns_keeps_what_they_forward() {
    if !rdma_device_here() {
        return;
    }
    super::replication_one_sided::forwarded_writes_survive_the_primary("verbs").await;
    super::replication_one_sided::merge_ships_unforwarded_batches("verbs").await;
}
