//! Replication when KNs store into the pool without the memory node's CPU (shm here; the same
//! tests run on verbs in the VM, `verbs.rs`; docs/decisions/0007 "One-sided fabrics"): a KN
//! forwards each batch (ForwardWrites) before it counts, and a merge ships the batches it
//! indexes first, so what was acknowledged, and what the index points at, is in every
//! backup's pool.

use std::path::Path;
use std::time::{Duration, Instant};

use dinomo_dpm_node::testkit::{LogRecord, LogWriter};
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::{DurabilityRequest, Fabric, FabricExt};
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::{
    FabricKind, ForwardWritesRequest, IndirectCellRequest, PendingSegmentsRequest, PoolRange,
    RegisterKnRequest, ReplicaStatusRequest,
};

use super::process::DpmProcess;
use super::replication::{
    check_pool, promote, record, register, two_backups_on, wait_in_sync, GrpcSource,
};

pub(super) type Writer = LogWriter<Box<dyn Fabric>, GrpcSource>;

/// Registers KN `kn_id` at `dpm` and returns whether the registration asks it to forward its
/// writes, and its log writer over the fabric the DPM names (shm, or verbs in a build with
/// `rdma`), forwarding its batches when `forward` (and the registration asks for it).
pub(super) async fn one_sided_writer(
    dpm: &DpmProcess,
    kn_id: u32,
    forward: bool,
) -> (bool, Writer) {
    let (client, r, key) = register(dpm, kn_id).await;
    let f = r.fabric.as_ref().unwrap();
    let fabric: Box<dyn Fabric> = match f.kind() {
        FabricKind::Shm => Box::new(
            ShmFabric::connect(Path::new(&f.address), key, DurabilityRequest::Auto).unwrap(),
        ),
        #[cfg(feature = "rdma")]
        FabricKind::Verbs => Box::new(
            dinomo_fabric::verbs::VerbsFabric::connect(f.address.parse().unwrap(), key)
                .await
                .unwrap(),
        ),
        other => panic!("not a one-sided fabric: {other:?}"),
    };
    let source = GrpcSource {
        client: tokio::sync::Mutex::new(client),
        kn: r.kn_id,
        epoch: r.epoch,
        forward: forward && r.forward_writes,
    };
    (r.forward_writes, LogWriter::new(fabric, source))
}

pub(super) async fn append_all(w: &mut Writer, keys: std::ops::Range<u32>) {
    for chunk in keys.collect::<Vec<_>>().chunks(8) {
        let recs: Vec<LogRecord> = chunk.iter().map(|&i| record(i)).collect();
        w.append(&recs).await.unwrap();
    }
}

/// Asserts that the pool file at `pool` holds every record of `keys` that KNs `kns` forwarded.
pub(super) fn assert_forwarded_records_in(pool: &Path, kns: &[u32], keys: std::ops::Range<u32>) {
    let n = keys.len();
    let (bad, _) = check_pool(pool, kns, keys);
    assert!(
        bad.is_empty(),
        "{} of {n} forwarded records missing in {} (first: key-{})",
        bad.len(),
        pool.display(),
        bad[0]
    );
}

/// Waits until the DPM reports none of `kn`'s segments unmerged.
async fn wait_merged(dpm: &DpmProcess, kn: u32) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pending = dpm
            .client()
            .await
            .pending_segments(PendingSegmentsRequest { kn_id: kn })
            .await
            .unwrap()
            .into_inner()
            .pending_ids;
        if pending.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "KN {kn}: {pending:?} still unmerged"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Batches a shm KN stored and forwarded are in both backups' pools after the primary is
/// killed. A KN that stores without forwarding (as every shm KN did before) leaves its
/// batches on the primary alone: the backups lack them, which is what forwarding is for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_shm_writes_survive_the_primary_in_every_backup() {
    forwarded_writes_survive_the_primary("shm").await;
}

/// [`forwarded_shm_writes_survive_the_primary_in_every_backup`] with the primary on `fabric`.
pub(super) async fn forwarded_writes_survive_the_primary(fabric: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (mut b1, mut b2, cp, pools) = two_backups_on(dir.path(), fabric, "");
    let mut primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    wait_in_sync(primary.grpc, 2).await;

    let (asked, mut forwarding) = one_sided_writer(&primary, 1, true).await;
    assert!(
        asked,
        "a replicated {fabric} pool asks its KNs to forward their writes"
    );
    let (_, mut silent) = one_sided_writer(&primary, 2, false).await;
    append_all(&mut forwarding, 0..200).await;
    append_all(&mut silent, 200..260).await;

    primary.kill9();
    b1.kill9();
    b2.kill9();
    for pool in &pools {
        assert_forwarded_records_in(pool, &[1, 2], 0..200);
        let (bad, _) = check_pool(pool, &[1, 2], 200..260);
        assert_eq!(
            bad.len(),
            60,
            "{}: records never forwarded reached the backup",
            pool.display()
        );
    }
}

/// A KN that forwarded its first batches and then stored more without forwarding them (it
/// died before the call, or the call failed), its segment then sealed: the primary merges them
/// all, and ships what was not forwarded before its index points at it, so every backup that
/// gets the index lines has the entries too. Without that, a backup's index would point at
/// bytes it never received; a merge that skipped the whole segment because part of it was
/// forwarded would lose the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merge_ships_unforwarded_batches_before_indexing_them() {
    merge_ships_unforwarded_batches("shm").await;
}

/// [`a_merge_ships_unforwarded_batches_before_indexing_them`] with the primary on `fabric`.
pub(super) async fn merge_ships_unforwarded_batches(fabric: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (mut b1, mut b2, cp, pools) = two_backups_on(dir.path(), fabric, "");
    let mut primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    wait_in_sync(primary.grpc, 2).await;

    let (_, mut w) = one_sided_writer(&primary, 1, true).await;
    append_all(&mut w, 0..150).await;
    w.source_mut().forward = false;
    append_all(&mut w, 150..300).await;
    w.seal().await.unwrap();
    wait_merged(&primary, 1).await;
    // The merge's barrier passed before it indexed; anything after is not needed.
    primary.kill9();
    b1.kill9();
    b2.kill9();
    for pool in &pools {
        let (bad, _) = check_pool(pool, &[1], 0..300);
        assert!(
            bad.is_empty(),
            "{} of 300 merged records missing in {} (first: key-{})",
            bad.len(),
            pool.display(),
            bad[0]
        );
    }
}

/// A KN's session holds only with the primary process that granted it. On shm a KN that has
/// not noticed a failover still maps the old primary's pool file and stores its next batch
/// there; a primary that took over (here a backup promoted in place) must refuse that KN's
/// forward, or the KN would acknowledge a batch the new primary's pool never got. Refused
/// with FAILED_PRECONDITION, which makes the KN register again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_primary_refuses_forwards_of_sessions_it_did_not_grant() {
    let dir = tempfile::tempdir().unwrap();
    let (b1, b2, cp, _) = two_backups_on(dir.path(), "shm", "");
    let mut primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    let s = wait_in_sync(primary.grpc, 2).await;
    let (_, mut w) = one_sided_writer(&primary, 1, true).await;
    append_all(&mut w, 0..40).await;
    let (kn, epoch) = (w.source_mut().kn, w.source_mut().epoch);

    primary.kill9();
    promote(b1.grpc, vec![b2.grpc.to_string()], s.term)
        .await
        .unwrap();
    wait_until_primary(b1.grpc, Duration::from_secs(30)).await;
    // The KN stores a batch into the old pool (its mapping still works) and forwards it to
    // the primary it finds at the DPM's address now.
    w.source_mut().forward = false;
    append_all(&mut w, 40..48).await;
    let e = b1
        .client()
        .await
        .forward_writes(ForwardWritesRequest {
            kn_id: kn,
            epoch,
            ranges: vec![PoolRange { offset: 0, len: 64 }],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
}

/// A KN swings a hot key's indirect cell with a CAS the primary's CPU never sees, and
/// forwards it after; a KN that died or was fenced in between (or whose forward failed) leaves
/// the new word on the primary alone, and the backups' cell pointing at the entry it replaced,
/// whose segment nothing pins once the index moved past it. GC passes ship every live cell
/// before they free or clean anything, so the backups' cell follows the primary's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cell_swing_its_kn_never_forwarded_reaches_the_backups_before_gc_acts() {
    use std::os::unix::fs::FileExt;

    let dir = tempfile::tempdir().unwrap();
    let (mut b1, mut b2, cp, pools) = two_backups_on(dir.path(), "shm", "");
    let mut primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    wait_in_sync(primary.grpc, 2).await;
    let (_, mut w) = one_sided_writer(&primary, 1, true).await;
    let hot = record(0);
    w.append(std::slice::from_ref(&hot)).await.unwrap();
    w.seal().await.unwrap();
    wait_merged(&primary, 1).await;
    let cell = primary
        .client()
        .await
        .install_indirect_cell(IndirectCellRequest {
            key: hot.key.clone(),
            lookup_only: false,
        })
        .await
        .unwrap()
        .into_inner()
        .cell_offset;
    let word_at = |pool: &Path| {
        let mut b = [0u8; 8];
        std::fs::File::open(pool)
            .unwrap()
            .read_exact_at(&mut b, cell)
            .unwrap();
        u64::from_le_bytes(b)
    };
    let wait_for = |word: u64, what: &'static str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        for pool in &pools {
            while word_at(pool) != word {
                assert!(
                    Instant::now() < deadline,
                    "{}: the cell holds {:#x}, not {what} {word:#x}",
                    pool.display(),
                    word_at(pool)
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    // The entry the cell was installed with (GC may have moved the key's entry by then).
    let installed = word_at(&dir.path().join("p").join("pool"));
    wait_for(installed, "the installed entry");

    // The KN logs the key's next value (forwarded), swings the cell, and never forwards it.
    let next = LogRecord {
        version: 2,
        value: b"after the swing".to_vec(),
        ..record(0)
    };
    let new = w.append(std::slice::from_ref(&next)).await.unwrap()[0];
    let seen = w
        .fabric()
        .cas(cell, installed, new.to_word())
        .await
        .unwrap();
    assert_eq!(seen, installed);
    wait_for(new.to_word(), "the swung entry");
    primary.kill9();
    b1.kill9();
    b2.kill9();
}

/// A KN that does not say it forwards its writes (built before ForwardWrites) is refused by a
/// primary that needs it: it would ignore `forward_writes` and acknowledge batches that are on
/// the primary alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kn_that_does_not_forward_is_refused_by_a_replicated_shm_primary() {
    let dir = tempfile::tempdir().unwrap();
    let (mut b1, mut b2, cp, _) = two_backups_on(dir.path(), "shm", "");
    let mut primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    wait_in_sync(primary.grpc, 2).await;
    let old_kn = RegisterKnRequest {
        kn_id: Some(1),
        endpoint: "127.0.0.1:1".into(),
        pid: 0,
        pid_namespace: 0,
        forwards_writes: false,
    };
    let e = primary
        .client()
        .await
        .register_kn(old_kn.clone())
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("upgrade the KN"), "{e:?}");
    primary
        .client()
        .await
        .register_kn(RegisterKnRequest {
            forwards_writes: true,
            ..old_kn
        })
        .await
        .unwrap();
    primary.kill9();
    b1.kill9();
    b2.kill9();
}

/// Waits until the backup promoted in place at `addr` answers as the primary: its backup
/// server stops and the primary's starts on the same address.
pub(super) async fn wait_until_primary(addr: std::net::SocketAddr, within: Duration) {
    let deadline = Instant::now() + within;
    while !is_primary(addr).await {
        assert!(
            Instant::now() < deadline,
            "{addr} does not answer as the primary"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `addr` answers as a primary now (false while nothing listens there).
async fn is_primary(addr: std::net::SocketAddr) -> bool {
    let Ok(mut c) = ReplicaServiceClient::connect(format!("http://{addr}")).await else {
        return false;
    };
    c.status(ReplicaStatusRequest {})
        .await
        .is_ok_and(|r| r.into_inner().role == "primary")
}
