//! Replication's fencing and phase rules (issue 14), in process: each test is a hole an
//! independent review of the first version found (each failed then), kept as a regression
//! test: a backup reported in sync lacking an acknowledged write, a backup that never synced
//! blocking acknowledgements, two primaries of one term, an allocation answered UNAVAILABLE
//! leaving an orphan open segment, and a stopping primary acknowledging writes alone.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_dpm_node::config::{DpmConfigFile, FabricKind};
use dinomo_dpm_node::replication::image::Claim;
use dinomo_dpm_node::replication::{Backup, ConfirmCopy, Phase, Replicator, ReplicatorOptions};
use dinomo_dpm_node::service::DpmGrpc;
use dinomo_dpm_node::Dpm;
use dinomo_fabric::grants::{GrantTable, WindowRange};
use dinomo_fabric::tcp::TcpNic;
use dinomo_fabric::{AccessKey, DurabilityRequest, PmRegion};
use dinomo_proto::dpm::dpm_service_server::DpmService;
use dinomo_proto::dpm::{AllocateSegmentRequest, RegisterKnRequest, SealSegmentRequest};

const LEN: u64 = 2 << 20;

pub(super) fn region(path: &Path) -> Arc<PmRegion> {
    Arc::new(PmRegion::create(path, LEN, DurabilityRequest::ProcessCrash).unwrap())
}

/// A backup NIC serving `region` in process, each post applied `delay` late.
pub(super) async fn backup_nic(
    dir: &Path,
    region: Arc<PmRegion>,
    delay: Duration,
) -> (TcpNic, AccessKey, Arc<GrantTable>) {
    let grants = Arc::new(GrantTable::create(&dir.join("b.grants"), 4).unwrap());
    let key = grants
        .grant_with_window(&[WindowRange::write(0, region.len())])
        .unwrap();
    if !delay.is_zero() {
        grants.set_post_hook(Some(Arc::new(move |_| std::thread::sleep(delay))));
    }
    let nic = TcpNic::start("127.0.0.1:0".parse().unwrap(), region, grants.clone())
        .await
        .unwrap();
    (nic, key, grants)
}

async fn wait_phase(rep: &Replicator, want: fn(&Phase) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = rep.status();
        if s.first().is_some_and(|b| want(&b.phase)) {
            return;
        }
        assert!(Instant::now() < deadline, "{s:?}");
        // Blocking on purpose: the backup NIC's delay blocks a runtime worker (and its timers).
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `Phase::InSync` says "holds every acknowledged byte" and the design promotes such a backup.
/// But the sender switches to InSync once the last resync chunk is acknowledged, while records
/// queued after that chunk (and acknowledged to writers while the backup was still syncing, so
/// not waited for) are still in its queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_in_sync_holds_every_acknowledged_write() {
    let dir = tempfile::tempdir().unwrap();
    let primary = region(&dir.path().join("p"));
    primary.write_durable(0, &[1u8; 64]).unwrap(); // a non-zero resync chunk
    let backup = region(&dir.path().join("b"));
    // A backup (or link) slower than the primary: each post lands 500 ms after it is sent.
    let (nic, key, _) = backup_nic(dir.path(), backup.clone(), Duration::from_millis(500)).await;
    let rep = Replicator::new(
        primary.clone(),
        ReplicatorOptions {
            ack_timeout: Duration::from_secs(10),
        },
    );
    primary.set_mirror(Some(rep.clone()));
    rep.add("b", nic.local_addr(), key, None, None);
    std::thread::sleep(Duration::from_millis(150)); // the resync chunk is in flight

    // A write, acknowledged: the barrier the NIC waits for before it answers a KN.
    primary.write_durable(4096, &[7u8; 64]).unwrap();
    primary.mirror_barrier().await.unwrap();

    wait_phase(&rep, |p| *p == Phase::InSync).await;
    let mut got = [0u8; 64];
    backup.read(4096, &mut got).unwrap();
    eprintln!("status when in-sync was seen: {:?}", rep.status());
    assert_eq!(
        got, [7u8; 64],
        "the backup is reported in-sync but lacks a write the primary acknowledged: promoting \
         it now (the primary lost) loses that write"
    );
}

/// A backup that never got in sync holds nothing anyone was told is durable, yet once it
/// fails (here: its NIC cannot be reached) every barrier fails: the primary stops
/// acknowledging anything until an admin removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_that_never_synced_blocks_no_acknowledgement() {
    let dir = tempfile::tempdir().unwrap();
    let primary = region(&dir.path().join("p"));
    let closed: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let rep = Replicator::new(
        primary.clone(),
        ReplicatorOptions {
            ack_timeout: Duration::from_secs(2),
        },
    );
    primary.set_mirror(Some(rep.clone()));
    let key = AccessKey {
        slot: 0,
        generation: 1,
        secret: [0; 16],
    };
    rep.add("b", closed, key, None, None);
    wait_phase(&rep, |p| matches!(p, Phase::Failed { .. })).await;
    primary.write_durable(4096, &[7u8; 64]).unwrap();
    let r = primary.mirror_barrier().await;
    assert!(
        r.is_ok(),
        "a backup that never was in sync blocks acknowledgements: {r:?}"
    );
}

/// Backups accept an attach of the term they already hold, from any primary: two primaries
/// that computed the same term (see the next test) both get a backup to take their writes,
/// and the later one wipes the backup's pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_refuses_a_second_primary_of_the_same_term() {
    let dir = tempfile::tempdir().unwrap();
    let b = Backup::new(
        dir.path().join("pool"),
        DurabilityRequest::ProcessCrash,
        "127.0.0.1:0".parse().unwrap(),
        String::new(),
    )
    .unwrap();
    b.attach(5, 11, Claim::default(), None, LEN, "10.0.0.1:7000", None)
        .await
        .unwrap();
    let second = b
        .attach(5, 22, Claim::default(), None, LEN, "10.0.0.2:7000", None)
        .await;
    assert!(
        second.is_err(),
        "a second primary of term 5 was accepted (and the pool wiped for it)"
    );
    // The same instance again (it added the backup back) and a newer term are accepted.
    b.attach(5, 11, Claim::default(), None, LEN, "10.0.0.1:7000", None)
        .await
        .unwrap();
    b.attach(6, 22, Claim::default(), None, LEN, "10.0.0.2:7000", None)
        .await
        .unwrap();
    assert!(b
        .attach(5, 11, Claim::default(), None, LEN, "10.0.0.1:7000", None)
        .await
        .is_err());
}

/// A control answer that fails only because the backups did not acknowledge leaves the change
/// applied: an AllocateSegment answered UNAVAILABLE leaves an open segment in the KN's log that
/// the KN never heard of. Merging stops at the first open segment of a log, so the KN's later
/// segments are never merged (the DPM itself seals the segment on its other error paths for
/// exactly this reason: dpm.rs allocate_segment).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocation_answered_unavailable_leaves_no_open_segment() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("pool");
    let mut file = DpmConfigFile::in_process(&p);
    file.pool_size = dinomo_node_common::config::ByteSize(64 << 20);
    file.segment_size = dinomo_node_common::config::ByteSize(128 << 10);
    file.initial_index_buckets = 256;
    file.gc_interval_ms = 5;
    let dpm = Dpm::open(file.validate().unwrap()).unwrap();
    let svc = DpmGrpc::new(dpm.clone(), FabricKind::Tcp, "127.0.0.1:1".into());
    let reg = svc
        .register_kn(tonic::Request::new(RegisterKnRequest {
            pid: 0,
            pid_namespace: 0,
            forwards_writes: false,
            kn_id: Some(1),
            endpoint: "127.0.0.1:1".into(),
        }))
        .await
        .unwrap()
        .into_inner();
    let (kn, epoch) = (reg.kn_id, reg.epoch);
    let alloc = || AllocateSegmentRequest {
        kn_id: kn,
        epoch,
        stream: 0,
        deletes_only: false,
    };

    // Replication on, with a backup that gets in sync and then stops acknowledging.
    let region = dpm.pool().region().clone();
    let bregion = Arc::new(
        PmRegion::create(
            &dir.path().join("b"),
            region.len(),
            DurabilityRequest::ProcessCrash,
        )
        .unwrap(),
    );
    let (nic, key, grants) = backup_nic(dir.path(), bregion, Duration::ZERO).await;
    let rep = Replicator::new(
        region.clone(),
        ReplicatorOptions {
            ack_timeout: Duration::from_millis(500),
        },
    );
    region.set_mirror(Some(rep.clone()));
    rep.add("b", nic.local_addr(), key, None, None);
    wait_phase(&rep, |p| *p == Phase::InSync).await;
    grants.set_post_hook(Some(Arc::new(|_| {
        std::thread::sleep(Duration::from_millis(1500))
    })));
    let e = svc
        .allocate_segment(tonic::Request::new(alloc()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");

    // The admin removes the failed backup; the KN retries, writes nothing, seals its segment.
    assert!(rep.remove("b"));
    let s2 = svc
        .allocate_segment(tonic::Request::new(alloc()))
        .await
        .unwrap()
        .into_inner();
    svc.seal_segment(tonic::Request::new(SealSegmentRequest {
        kn_id: kn,
        epoch,
        segment_id: s2.segment_id,
    }))
    .await
    .unwrap();
    // The background merge would take a sealed segment off the pending list within ms.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let pending = dpm.pending_segment_ids(kn);
        if !pending.contains(&s2.segment_id) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "segment {} sealed by the KN is never merged: pending {pending:?} (an orphan open \
             segment from the allocation answered UNAVAILABLE blocks the log)",
            s2.segment_id
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    region.set_mirror(None);
    rep.end("the test is over");
}

/// When a replicated primary stops (SIGTERM, or deposed by a newer term), `server::run` drops
/// the NIC (which only aborts its accept loop: connection tasks are detached) and then removes
/// the mirror (`Primary::shutdown`). A KN connection open at that moment keeps being served,
/// and its WRITEs are acknowledged with no backup holding them (in a real process until it
/// exits: d.shutdown() joins the merge and GC threads first). Here the node runs in process,
/// so the window stays open after `run` returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_primary_acknowledges_no_write_alone() {
    use dinomo_dpm_node::config::ReplicaRole;
    use dinomo_dpm_node::server;
    use dinomo_fabric::FabricExt as _;
    use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
    use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
    use dinomo_proto::dpm::ReplicaStatusRequest;

    let dir = tempfile::tempdir().unwrap();
    let small = |pool: &Path| {
        let mut f = DpmConfigFile::in_process(pool);
        f.pool_size = dinomo_node_common::config::ByteSize(64 << 20);
        f.segment_size = dinomo_node_common::config::ByteSize(128 << 10);
        f.initial_index_buckets = 256;
        f
    };
    // The backup, in process.
    let bpool = dir.path().join("b-pool");
    let mut bf = small(&bpool);
    bf.role = ReplicaRole::Backup;
    let (btx, brx) = tokio::sync::oneshot::channel();
    let (_bstop_tx, bstop) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server::run(
        bf.validate().unwrap(),
        async move {
            let _ = bstop.await;
        },
        move |r| {
            let _ = btx.send(r.grpc);
        },
    ));
    let bgrpc = brx.await.unwrap();
    // The primary, replicating to it.
    let mut pf = small(&dir.path().join("p-pool"));
    pf.fabric = FabricKind::Tcp;
    pf.backups = vec![bgrpc.to_string()];
    pf.replica_ack_timeout_ms = 1000;
    let (ptx, prx) = tokio::sync::oneshot::channel();
    let (pstop_tx, pstop) = tokio::sync::oneshot::channel::<()>();
    let primary = tokio::spawn(server::run(
        pf.validate().unwrap(),
        async move {
            let _ = pstop.await;
        },
        move |r| {
            let _ = ptx.send(r.clone());
        },
    ));
    let running = prx.await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = ReplicaServiceClient::connect(format!("http://{}", running.grpc))
            .await
            .unwrap()
            .status(ReplicaStatusRequest {})
            .await
            .unwrap()
            .into_inner();
        if s.backups.len() == 1 && s.backups[0].state == "in-sync" {
            break;
        }
        assert!(Instant::now() < deadline, "{s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A KN: registered, a segment, its fabric connection.
    let mut client = DpmServiceClient::connect(format!("http://{}", running.grpc))
        .await
        .unwrap();
    let reg = client
        .register_kn(RegisterKnRequest {
            pid: 0,
            pid_namespace: 0,
            forwards_writes: false,
            kn_id: Some(1),
            endpoint: "127.0.0.1:1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let seg = client
        .allocate_segment(AllocateSegmentRequest {
            kn_id: reg.kn_id,
            epoch: reg.epoch,
            stream: 0,
            deletes_only: false,
        })
        .await
        .unwrap()
        .into_inner();
    drop(client);
    let f = reg.fabric.unwrap();
    let key = AccessKey {
        slot: f.grant_slot,
        generation: f.grant_generation,
        secret: f.grant_secret.as_slice().try_into().unwrap(),
    };
    let fabric = dinomo_fabric::tcp::TcpFabric::connect(f.address.parse().unwrap(), key)
        .await
        .unwrap();
    let at = seg.offset + seg.first_batch;
    fabric
        .write(at, bytes::Bytes::from(vec![0xAAu8; 64]))
        .await
        .unwrap();
    let in_backup = |off: u64| {
        let b = std::fs::read(&bpool).unwrap();
        b[off as usize..off as usize + 64].to_vec()
    };
    assert_eq!(in_backup(at), vec![0xAAu8; 64], "replicated while running");

    // Stop the primary (as SIGTERM would) and let `run` return.
    let _ = pstop_tx.send(());
    primary.await.unwrap().unwrap();
    // The KN's connection is still served: this WRITE is acknowledged...
    let r = fabric
        .write(at + 64, bytes::Bytes::from(vec![0xBBu8; 64]))
        .await;
    // ...but no backup holds it.
    assert!(
        r.is_err() || in_backup(at + 64) == vec![0xBBu8; 64],
        "the stopped primary acknowledged a WRITE that its backup does not hold: {r:?}"
    );
}

/// Control for the orphan-segment test: without the allocation answered UNAVAILABLE, a sealed
/// segment leaves the pending list within the same bound (this test passes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_a_sealed_segment_is_merged() {
    let dir = tempfile::tempdir().unwrap();
    let mut file = DpmConfigFile::in_process(dir.path().join("pool"));
    file.pool_size = dinomo_node_common::config::ByteSize(64 << 20);
    file.segment_size = dinomo_node_common::config::ByteSize(128 << 10);
    file.initial_index_buckets = 256;
    file.gc_interval_ms = 5;
    let dpm = Dpm::open(file.validate().unwrap()).unwrap();
    let svc = DpmGrpc::new(dpm.clone(), FabricKind::Tcp, "127.0.0.1:1".into());
    let reg = svc
        .register_kn(tonic::Request::new(RegisterKnRequest {
            pid: 0,
            pid_namespace: 0,
            forwards_writes: false,
            kn_id: Some(1),
            endpoint: "127.0.0.1:1".into(),
        }))
        .await
        .unwrap()
        .into_inner();
    let s = svc
        .allocate_segment(tonic::Request::new(AllocateSegmentRequest {
            kn_id: reg.kn_id,
            epoch: reg.epoch,
            stream: 0,
            deletes_only: false,
        }))
        .await
        .unwrap()
        .into_inner();
    svc.seal_segment(tonic::Request::new(SealSegmentRequest {
        kn_id: reg.kn_id,
        epoch: reg.epoch,
        segment_id: s.segment_id,
    }))
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while dpm.pending_segment_ids(reg.kn_id).contains(&s.segment_id) {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The primary reports a backup in sync only once the backup recorded its copy complete (the
/// CopyComplete call, here a stand-in the test answers): until then the caught-up backup stays
/// `catching-up` (counted by barriers, not promotable); a refused confirmation fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_is_in_sync_only_after_it_recorded_its_copy_complete() {
    for refuse in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let primary = region(&dir.path().join("p"));
        primary.write_durable(0, &[1u8; 64]).unwrap();
        let backup = region(&dir.path().join("b"));
        let (nic, key, _) = backup_nic(dir.path(), backup.clone(), Duration::ZERO).await;
        let rep = Replicator::new(
            primary.clone(),
            ReplicatorOptions {
                ack_timeout: Duration::from_secs(10),
            },
        );
        primary.set_mirror(Some(rep.clone()));
        let (asked_tx, asked_rx) = std::sync::mpsc::channel::<()>();
        let (answer_tx, answer_rx) = tokio::sync::oneshot::channel::<Result<(), String>>();
        let confirm: ConfirmCopy = Box::new(move |_generation| {
            Box::pin(async move {
                asked_tx.send(()).unwrap();
                answer_rx.await.unwrap()
            })
        });
        rep.add("b", nic.local_addr(), key, None, Some(confirm));
        // Asked once the backup caught up; not in sync while the answer is pending.
        asked_rx.recv_timeout(Duration::from_secs(20)).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let s = rep.status();
        assert!(
            matches!(s[0].phase, Phase::CatchingUp { .. }),
            "reported {:?} before the backup recorded its copy complete",
            s[0].phase
        );
        assert!(
            s[0].awaiting_copy_complete,
            "status does not say why: {:?}",
            s[0]
        );
        let mut got = [0u8; 64];
        backup.read(0, &mut got).unwrap();
        assert_eq!(got, [1u8; 64]);
        if refuse {
            answer_tx.send(Err("refused by the test".into())).unwrap();
            wait_phase(&rep, |p| matches!(p, Phase::Failed { counted: true, .. })).await;
        } else {
            answer_tx.send(Ok(())).unwrap();
            wait_phase(&rep, |p| *p == Phase::InSync).await;
        }
    }
}
