//! Fabric write windows at the DPM (docs/decisions/0005-security.md, Decision 5): a registered
//! KN's handle writes its open segments and CASes the cell space, and nothing else; a segment
//! leaves the window when it is sealed; AllocateSegment is refused past the window's 64 ranges.

use std::sync::Arc;

use bytes::Bytes;
use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::{Dpm, DpmError};
use dinomo_fabric::grants::MAX_WINDOW_RANGES;
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::tcp::{TcpFabric, TcpNic};
use dinomo_fabric::{DurabilityRequest, Fabric, FabricError, FabricExt};

fn open_dpm(dir: &std::path::Path) -> Arc<Dpm> {
    let c = DpmConfigFile {
        pool_size: "128MiB".parse().unwrap(),
        segment_size: "256KiB".parse().unwrap(),
        initial_index_buckets: 64,
        ..DpmConfigFile::in_process(dir.join("pool"))
    };
    Dpm::open(c.validate().unwrap()).unwrap()
}

fn local(dpm: &Dpm, offset: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    dpm.pool().region().read(offset, &mut v).unwrap();
    v
}

fn assert_outside<T: std::fmt::Debug>(r: dinomo_fabric::Result<T>, what: &str) {
    assert!(
        matches!(r, Err(FabricError::OutsideWindow { .. })),
        "{what}: expected OutsideWindow, got {r:?}"
    );
}

async fn check_handle(dpm: &Arc<Dpm>, kn: u32, epoch: u64, f: &dyn Fabric) {
    let name = f.backend();
    // The superblock: refused, unchanged.
    let sb = local(dpm, 0, 4096);
    assert_outside(
        f.write(0, Bytes::from(vec![0xee; 64])).await,
        &format!("{name}: a WRITE of the superblock"),
    );
    assert_outside(
        f.cas(0, 0, 1).await,
        &format!("{name}: a CAS of the superblock"),
    );
    assert_eq!(local(dpm, 0, 4096), sb, "{name}: the superblock changed");
    // Its open segment: written.
    let g = dpm.allocate_segment(kn, 0, epoch, false).unwrap();
    let at = g.offset + g.first_batch;
    f.write(at, Bytes::from_static(b"a batch")).await.unwrap();
    assert_eq!(local(dpm, at, 7), b"a batch");
    assert_outside(
        f.write(g.offset + g.len - 4, Bytes::from(vec![1; 8])).await,
        &format!("{name}: a WRITE straddling the segment's end"),
    );
    // The cell space: CAS only.
    let cell = dpm.install_cell(format!("hot-{name}").as_bytes()).unwrap();
    let cur = u64::from_le_bytes(local(dpm, cell, 8).try_into().unwrap());
    assert_eq!(f.cas(cell, cur, cur).await.unwrap(), cur);
    assert_outside(
        f.write(cell, Bytes::from(vec![0; 8])).await,
        &format!("{name}: a WRITE of a cell"),
    );
    // READ reaches everything.
    assert_eq!(&f.read(0, 4096).await.unwrap()[..], &sb[..]);
    // Sealed: out of the window.
    dpm.seal_segment(kn, epoch, g.segment_id).unwrap();
    let before = local(dpm, at, 7);
    assert_outside(
        f.write(at, Bytes::from_static(b"too late")).await,
        &format!("{name}: a WRITE into a sealed segment"),
    );
    assert_eq!(local(dpm, at, 7), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_kn_writes_its_open_segment_and_not_the_superblock() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = open_dpm(dir.path());
    let reg = dpm.register_kn(Some(1), "kn-1").unwrap();
    // shm, as a KN process maps the pool and the grant table.
    let shm = ShmFabric::connect(&dpm.config.pool_path, reg.key, DurabilityRequest::Auto).unwrap();
    check_handle(&dpm, 1, reg.epoch, &shm).await;
    // tcp, through the NIC the dpm-node runs.
    let nic = TcpNic::start(
        "127.0.0.1:0".parse().unwrap(),
        dpm.pool().region().clone(),
        dpm.grants().clone(),
    )
    .await
    .unwrap();
    let tcp = TcpFabric::connect(nic.local_addr(), reg.key).await.unwrap();
    check_handle(&dpm, 1, reg.epoch, &tcp).await;
    // Another KN's open segment is not in this KN's window.
    let other = dpm.register_kn(Some(2), "kn-2").unwrap();
    let g = dpm.allocate_segment(2, 0, other.epoch, false).unwrap();
    for f in [&shm as &dyn Fabric, &tcp] {
        assert_outside(
            f.write(g.offset + g.first_batch, Bytes::from_static(b"x"))
                .await,
            "a WRITE into another KN's segment",
        );
    }
    // Fenced: the key is gone, with its window.
    dpm.fence_kn(1).unwrap();
    for f in [&shm as &dyn Fabric, &tcp] {
        let r = f.write(0, Bytes::from_static(b"x")).await;
        assert!(r.as_ref().is_err_and(FabricError::is_revoked), "{r:?}");
    }
}

/// The same over verbs, through the dpm-node's NIC (its key fence), inside the Soft-RoCE VM.
/// The module is named `verbs` so that CI's filter `verbs::` picks it.
#[cfg(feature = "rdma")]
mod verbs {
    use super::*;
    use dinomo_dpm_node::config::FabricKind;
    use dinomo_dpm_node::server::{FabricEndpoint, Nic};
    use dinomo_fabric::verbs::{device_names, VerbsFabric};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_registered_verbs_kn_writes_its_open_segment_and_not_the_superblock() {
        if device_names().is_empty() {
            assert!(
                std::env::var("DINOMO_VM").is_err(),
                "DINOMO_VM=1 but there is no RDMA device"
            );
            println!("SKIPPED: no RDMA device (not in the test VM; scripts/vm-tests.sh runs this)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let c = DpmConfigFile {
            pool_size: "128MiB".parse().unwrap(),
            segment_size: "256KiB".parse().unwrap(),
            initial_index_buckets: 64,
            fabric: FabricKind::Verbs,
            ..DpmConfigFile::in_process(dir.path().join("pool"))
        };
        let dpm = Dpm::open(c.validate().unwrap()).unwrap();
        let (nic, endpoint) = Nic::start(&dpm).await.unwrap();
        let FabricEndpoint::Verbs(addr) = endpoint else {
            panic!("a verbs node must advertise a side channel, got {endpoint}");
        };
        let reg = dpm.register_kn(Some(1), "kn-1").unwrap();
        let kn = VerbsFabric::connect(addr, reg.key).await.unwrap();
        // Superblock, segment, straddle, cells, READ, and the seal (through the NIC: the
        // device refuses the segment's WRITEs when SealSegment returns).
        check_handle(&dpm, 1, reg.epoch, &kn).await;
        assert_eq!(
            kn.device_refusals(),
            1,
            "the WRITE into the sealed segment went through its stale rkey and the device \
             refused it (every other refusal was the caller's own check)"
        );
        // Another KN's open segment and the index area are not in this KN's window.
        let other = dpm.register_kn(Some(2), "kn-2").unwrap();
        let g = dpm.allocate_segment(2, 0, other.epoch, false).unwrap();
        let at = g.offset + g.first_batch;
        assert_outside(
            kn.write(at, Bytes::from_static(b"x")).await,
            "verbs: a WRITE into another KN's segment",
        );
        assert_eq!(local(&dpm, at, 1), [0]);
        let index = dinomo_layout::index::IndexArea::of(dpm.pool().superblock());
        let before = local(&dpm, index.directory_off, 64);
        assert_outside(
            kn.write(index.directory_off, Bytes::from(vec![7; 64]))
                .await,
            "verbs: a WRITE of the index directory",
        );
        assert_eq!(local(&dpm, index.directory_off, 64), before);
        // Fenced: the key is gone, with its regions.
        let d = dpm.clone();
        tokio::task::spawn_blocking(move || d.fence_kn(1))
            .await
            .unwrap()
            .unwrap();
        let r = kn.write(0, Bytes::from_static(b"x")).await;
        assert!(r.as_ref().is_err_and(FabricError::is_revoked), "{r:?}");
        drop((kn, nic));
        println!("verbs: write windows enforced through the dpm-node's NIC");
    }
}

#[test]
fn allocation_is_refused_past_the_window_limit() {
    let dir = tempfile::tempdir().unwrap();
    let dpm = open_dpm(dir.path());
    let reg = dpm.register_kn(Some(1), "kn-1").unwrap();
    // The cell space takes one range; every open segment one more.
    let open = dpm.grants().window(reg.key).unwrap().len();
    assert_eq!(open, 1, "the cell space");
    let mut segments = Vec::new();
    for stream in 0..(MAX_WINDOW_RANGES - open) as u16 {
        segments.push(
            dpm.allocate_segment(1, stream, reg.epoch, false)
                .unwrap_or_else(|e| panic!("segment {stream}: {e}")),
        );
    }
    let e = dpm
        .allocate_segment(1, 999, reg.epoch, false)
        .expect_err("a 65th range is refused");
    assert!(
        matches!(e, DpmError::Fabric(FabricError::WindowFull { .. })),
        "{e}"
    );
    // The refused segment was sealed (not left open to block its log's merge), and sealing
    // one frees a range.
    dpm.seal_segment(1, reg.epoch, segments[0].segment_id)
        .unwrap();
    dpm.allocate_segment(1, 999, reg.epoch, false).unwrap();
}
